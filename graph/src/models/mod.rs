//! Whole models as graphs, for examples, benchmarks and tests: each builds its forward
//! graph from an input Placeholder, naming its Variables so that a training and an
//! inference graph built alike share them.

pub mod convnet;

use crate::ops::{Init, Variable};
use crate::{DType, Graph, Port, Result, TensorType};

/// An f32 Variable named `name` starting at `init`.
pub fn f32_variable(g: &mut Graph, name: String, shape: Vec<usize>, init: Init) -> Result<Port> {
    let ty = TensorType::new(DType::F32, shape);
    Ok(
        g.add_node(name, Box::new(Variable::with_init(ty, init)), &[])?
            .into(),
    )
}
