//! Pretrained weights into a session's variables: a `safetensors` file (Hugging Face's
//! checkpoint format, read by its `safetensors` crate), tensor by tensor, by name.
//!
//! The name map: variable `v` takes the file's tensor `v`, or else the tensor named
//! `v` without its first dotted component (`transformer.h.0.attn.c_attn.weight` takes
//! `h.0.attn.c_attn.weight`, as the `gpt2` checkpoint names it; `bert.embeddings.*`
//! takes `embeddings.*` of a `BertModel` checkpoint); a `.weight` or `.bias` may be
//! the legacy `.gamma` or `.beta` of TensorFlow-converted checkpoints. The zoo's models
//! (`graph::models`) name their variables as the checkpoints do, in their layouts;
//! a 4-D tensor is a convolution kernel in torch's OIHW, which becomes our HWIO. Values convert to
//! the variable's dtype (f16, bf16, f32 and f64 files). A tensor of another shape is
//! an error naming both; variables without a tensor keep their values and tensors
//! without a variable (a checkpoint's buffers) are left, both listed in the report.

use std::collections::BTreeSet;
use std::path::Path;

use ampgraph_graph::ops::{BatchNorm, Const, Init, Transpose, Variable};
use ampgraph_graph::{DType, Data, Graph, GraphError, Op, Tensor};
use safetensors::{Dtype, SafeTensors};
use thiserror::Error;

use crate::session::{Session, SessionError};

#[derive(Debug, Error)]
pub enum WeightsError {
    #[error("{path}: {msg}")]
    File { path: String, msg: String },
    #[error("{path}: tensor '{tensor}' is {got:?} but variable '{variable}' is {want:?}")]
    Shape {
        path: String,
        tensor: String,
        variable: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// What a load did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightsReport {
    /// (variable, the file's tensor) of each variable loaded.
    pub loaded: Vec<(String, String)>,
    /// Variables the file has no tensor for (they keep their values).
    pub missing: Vec<String>,
    /// The file's tensors no variable took.
    pub unused: Vec<String>,
}

/// The file's tensor for variable `name`: its own name, else without its first dotted
/// component; each also with a norm's `.weight`/`.bias` as the legacy `.gamma`/`.beta`
/// (the TensorFlow-converted checkpoints on the Hub, bert-base-uncased's among them,
/// which Hugging Face renames as it loads them).
fn tensor_name<'f>(name: &str, names: &BTreeSet<&'f str>) -> Option<&'f str> {
    let legacy = |n: &str| {
        let (stem, leaf) = n.rsplit_once('.')?;
        let old = match leaf {
            "weight" => "gamma",
            "bias" => "beta",
            _ => return None,
        };
        names.get(format!("{stem}.{old}").as_str()).copied()
    };
    let find = |n: &str| names.get(n).copied().or_else(|| legacy(n));
    find(name).or_else(|| find(name.split_once('.')?.1))
}

fn dtype_of(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}

/// Loads the `safetensors` file at `path` into the variables of `session` by the name
/// map above.
pub fn load_safetensors(session: &mut Session, path: &Path) -> Result<WeightsReport, WeightsError> {
    let shown = path.display().to_string();
    let file_err = |msg: String| WeightsError::File {
        path: shown.clone(),
        msg,
    };
    let bytes = std::fs::read(path).map_err(|e| file_err(e.to_string()))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| file_err(format!("not a safetensors file: {e}")))?;
    let names: BTreeSet<&str> = file.names().into_iter().collect();
    let graph = session.graph();
    let variables: Vec<(String, Vec<usize>, DType)> = (graph.node_ids())
        .filter(|&id| graph.node(id).op.is::<Variable>())
        .map(|id| {
            let node = graph.node(id);
            let ty = &node.outputs()[0];
            (node.name.clone(), ty.shape.clone(), ty.dtype)
        })
        .collect();
    let mut report = WeightsReport::default();
    let mut taken = BTreeSet::new();
    for (variable, shape, dtype) in variables {
        let Some(tensor) = tensor_name(&variable, &names) else {
            report.missing.push(variable);
            continue;
        };
        let view = file
            .tensor(tensor)
            .map_err(|e| file_err(format!("tensor '{tensor}': {e}")))?;
        let from = dtype_of(view.dtype())
            .ok_or_else(|| file_err(format!("tensor '{tensor}' is {:?}", view.dtype())))?;
        let data = Data::from_le_bytes(from, view.data())
            .map_err(|m| file_err(format!("tensor '{tensor}': {m}")))?;
        let mut value = Tensor::new(view.shape().to_vec(), data)
            .map_err(|m| file_err(format!("tensor '{tensor}': {m}")))?;
        let file_shape = value.shape().to_vec();
        // A 4-D tensor is torch's OIHW convolution kernel, our HWIO transposed (always:
        // a square kernel with as many channels in as out has the same shape both ways).
        if shape.len() == 4 && value.shape().len() == 4 {
            value = Transpose::new(vec![2, 3, 1, 0])
                .eval(&[&value])
                .map_err(|m| file_err(format!("tensor '{tensor}': {m}")))?
                .remove(0);
        }
        if value.shape() != shape.as_slice() {
            return Err(WeightsError::Shape {
                path: shown,
                tensor: tensor.to_string(),
                variable,
                got: file_shape,
                want: shape,
            });
        }
        session.set_variable(&variable, value.cast(dtype))?;
        taken.insert(tensor);
        report.loaded.push((variable, tensor.to_string()));
    }
    report.unused = names.difference(&taken).map(|n| n.to_string()).collect();
    Ok(report)
}

/// The weights of an imported model made trainable, so that it can be fine-tuned (with
/// AMP: its Variables are f32 master weights): every float constant of two or more
/// elements becomes a Variable of its name, except a BatchNorm's statistics (its mean
/// and variance, read in inference, stay constant). Returns each new Variable's name
/// and value, which [`set_values`] gives a session of the graph.
pub fn trainable_constants(g: &mut Graph) -> Result<Vec<(String, Tensor)>, GraphError> {
    // A BatchNorm's statistics stay constants.
    let statistics: BTreeSet<_> = (g.node_ids())
        .filter(|&id| g.node(id).op.is::<BatchNorm>())
        .flat_map(|id| g.inputs(id)[3..].iter().map(|p| p.node).collect::<Vec<_>>())
        .collect();
    let weights: Vec<_> = (g.node_ids())
        .filter(|id| !statistics.contains(id))
        .filter_map(|id| {
            let c = g.node(id).op.downcast_ref::<Const>()?;
            let weight = c.ty.dtype.is_float() && c.ty.shape.iter().product::<usize>() >= 2;
            weight.then(|| (id, c.clone()))
        })
        .collect();
    let mut values = Vec::with_capacity(weights.len());
    for (id, c) in weights {
        let value = c.eval(&[]).map_err(GraphError::Format)?.remove(0);
        g.set_op(id, Box::new(Variable::with_init(c.ty.clone(), Init::Zeros)));
        values.push((g.node(id).name.clone(), value));
    }
    Ok(values)
}

/// Gives a session's variables `values` by name ([`trainable_constants`]'s).
pub fn set_values(
    session: &mut Session,
    values: Vec<(String, Tensor)>,
) -> Result<(), SessionError> {
    for (name, value) in values {
        session.set_variable(&name, value)?;
    }
    Ok(())
}
