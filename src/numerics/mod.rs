//! Numerics you can debug: which op made the first non-finite value
//! ([`check`]), which tensors would overflow in 16 bits on real inputs
//! ([`calibrate`]), and which few nodes to keep in f32 so a rewritten graph stays
//! within tolerance ([`bisect`]). All three read a step node by node through
//! [`CpuExecutor::run_observed`](ampgraph_exec::CpuExecutor::run_observed).

pub mod bisect;
pub mod calibrate;
pub mod check;
