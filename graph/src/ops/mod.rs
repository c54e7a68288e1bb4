//! Every operation of the IR, one file per family, and the registry that builds an op
//! from its name and attributes.

pub mod attention;
pub mod conv;
pub mod elementwise;
pub mod fused;
pub mod linalg;
pub mod norm;
pub mod reduce;
pub mod shape_ops;
pub mod softmax;
pub mod source;
pub mod train;

use crate::attrs::{AttrReader, AttrValue};
use crate::graph::Port;
use crate::op::{Op, OpEntry, OpResult};
use crate::tensor::{Tensor, TensorType};

pub use attention::{FusedAttention, FusedAttentionGrad};
pub use conv::{AvgPool, Conv2D, MaxPool};
pub use conv::{AvgPoolGrad, Conv2DBackpropFilter, Conv2DBackpropInput, MaxPoolGrad};
pub use elementwise::{BiasAdd, Binary, BinaryKind, Unary, UnaryKind};
pub use elementwise::{BinaryGrad, UnaryGrad};
pub use fused::{ElementOp, FusedElementwise};
pub use linalg::{BatchMatMul, Epilogue, FusedMatMul, MatMul};
pub use norm::{BatchNorm, LayerNorm, NormActivation};
pub use norm::{BatchNormGrad, LayerNormGrad, NormGradEpilogue};
pub use reduce::ReduceGrad;
pub use reduce::{widens_exactly, Reduce, ReduceKind, SumTo};
pub use shape_ops::{BroadcastTo, Slice};
pub use shape_ops::{Concat, Reshape, Transpose};
pub use softmax::{FusedSoftmax, LogSoftmax, Softmax, SoftmaxCrossEntropy};
pub use softmax::{
    SoftmaxCrossEntropyGrad, SoftmaxCrossEntropyWithGrad, SoftmaxGrad, MAX_SUMMED_CLASSES,
};
pub use source::{Cast, Const, Init, Placeholder, Variable};
pub use train::{
    update_members, variable_updates, AllFinite, AssignVariable, Group, GroupedOptimizerUpdate,
    IncrementIf, LossScaleUpdate, OptimizerUpdate, Rule, VariableUpdate,
};

/// The gradient flowing into output 0, when there is one.
fn grad0(grads: &[Option<Port>]) -> Option<Port> {
    grads.first().copied().flatten()
}

/// The types of the given tensors, for checking them as `infer` does.
fn types_of(inputs: &[&Tensor]) -> Vec<TensorType> {
    inputs.iter().map(|t| t.ty()).collect()
}

/// All op families' registry rows.
const FAMILIES: &[&[OpEntry]] = &[
    source::OPS,
    elementwise::UNARY_OPS,
    elementwise::BINARY_OPS,
    elementwise::OTHER_OPS,
    elementwise::GRAD_OPS,
    fused::OPS,
    linalg::OPS,
    attention::OPS,
    conv::OPS,
    norm::OPS,
    reduce::OPS,
    reduce::SUM_TO_OPS,
    reduce::GRAD_OPS,
    softmax::OPS,
    softmax::GRAD_OPS,
    shape_ops::OPS,
    shape_ops::MORE_OPS,
    train::OPS,
];

/// Every op name the IR knows.
pub fn op_names() -> impl Iterator<Item = &'static str> {
    FAMILIES.iter().flat_map(|f| f.iter().map(|e| e.name))
}

pub fn is_known_op(name: &str) -> bool {
    op_names().any(|n| n == name)
}

/// Builds an op from its file form; unknown ops and attrs are errors.
pub fn parse_op(name: &str, mut attrs: AttrReader) -> OpResult<Box<dyn Op>> {
    let entry = FAMILIES
        .iter()
        .flat_map(|f| f.iter())
        .find(|e| e.name == name)
        .ok_or_else(|| format!("unknown op '{name}'"))?;
    let op = (entry.parse)(entry.name, &mut attrs)?;
    attrs.finish()?;
    Ok(op)
}

/// Memory layout of image tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataFormat {
    Nhwc,
    Nchw,
}

impl DataFormat {
    /// Reads the optional `data_format` attr (NHWC when absent, as in TensorFlow).
    pub fn read(a: &mut AttrReader) -> OpResult<DataFormat> {
        a.choice(
            "data_format",
            &[("NHWC", DataFormat::Nhwc), ("NCHW", DataFormat::Nchw)],
            Some(DataFormat::Nhwc),
        )
    }
}

impl From<DataFormat> for AttrValue {
    fn from(f: DataFormat) -> Self {
        AttrValue::Str(
            match f {
                DataFormat::Nhwc => "NHWC",
                DataFormat::Nchw => "NCHW",
            }
            .into(),
        )
    }
}

/// Padding of windowed ops (convolution, pooling), TensorFlow's meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Padding {
    Same,
    Valid,
}

impl Padding {
    pub fn read(a: &mut AttrReader) -> OpResult<Padding> {
        a.choice(
            "padding",
            &[("SAME", Padding::Same), ("VALID", Padding::Valid)],
            None,
        )
    }

    /// Output length and padding before, for one spatial axis.
    pub fn output_len(
        self,
        input: usize,
        window: usize,
        stride: usize,
    ) -> OpResult<(usize, usize)> {
        match self {
            Padding::Valid => {
                if input < window {
                    return Err(format!(
                        "window {window} is larger than the input {input} with VALID padding"
                    ));
                }
                Ok(((input - window) / stride + 1, 0))
            }
            Padding::Same => {
                let out = input.div_ceil(stride);
                let needed = ((out.saturating_sub(1)) * stride + window).saturating_sub(input);
                Ok((out, needed / 2))
            }
        }
    }
}

impl From<Padding> for AttrValue {
    fn from(p: Padding) -> Self {
        AttrValue::Str(
            match p {
                Padding::Same => "SAME",
                Padding::Valid => "VALID",
            }
            .into(),
        )
    }
}
