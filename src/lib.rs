//! ampgraph facade
