//! Whole models as graphs, for examples, benchmarks and tests: each builds its forward
//! graph from an input Placeholder, naming its Variables so that a training and an
//! inference graph built alike share them.

pub mod convnet;
