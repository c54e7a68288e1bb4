//! Every operation of the IR, one file per family, and the registry that builds an op
//! from its name and attributes.

pub mod attention;
pub mod collective;
pub mod compare;
pub mod conv;
pub mod dropout;
pub mod elementwise;
pub mod fp8;
pub mod fused;
pub mod gather;
pub mod linalg;
pub mod norm;
pub mod pad;
pub mod reduce;
pub mod resize;
pub mod schedule;
pub mod select;
pub mod shape_ops;
pub mod softmax;
pub mod source;
pub mod train;

use crate::attrs::{AttrReader, AttrValue};
use crate::graph::Port;
use crate::op::{Op, OpEntry, OpResult};
use crate::tensor::{Tensor, TensorType};

pub use attention::{FusedAttention, FusedAttentionGrad};
pub use collective::{AllReduce, Reduction};
pub use compare::{Compare, CompareKind, Logical, LogicalKind, Not};
pub use conv::{dilated_span, AvgPool, Conv2D, MaxPool};
pub use conv::{AvgPoolGrad, Conv2DBackpropFilter, Conv2DBackpropInput, MaxPoolGrad};
pub use dropout::Dropout;
pub use elementwise::{BiasAdd, Binary, BinaryKind, Unary, UnaryKind};
pub use elementwise::{BinaryGrad, UnaryGrad};
pub use fp8::{
    AmaxChoice, DequantizeFp8, Fp8MatMul, Fp8Scale, Fp8ScaleOfAmax, Fp8ScaleUpdate,
    FusedAttentionGradQuantizeFp8, FusedAttentionQuantizeFp8, FusedQuantizeFp8, GroupedQuantizeFp8,
    LayerNormGradQuantizeFp8, LayerNormQuantizeFp8, QuantizeFp8,
};
pub use fused::{ElementOp, FusedElementwise};
pub use gather::{Gather, GatherGrad};
pub use linalg::{BatchMatMul, Epilogue, FusedMatMul, MatMul};
pub use norm::{BatchNorm, LayerNorm, NormActivation};
pub use norm::{BatchNormGrad, LayerNormGrad, NormGradEpilogue};
pub use pad::{Pad, PadMode};
pub use reduce::ReduceGrad;
pub use reduce::{widens_exactly, Reduce, ReduceKind, SumTo};
pub use resize::{CoordinateTransform, NearestMode, Resize, ResizeGrad, ResizeMode};
pub use schedule::{Anneal, LearningRateSchedule};
pub use select::Where;
pub use shape_ops::{BroadcastTo, Slice};
pub use shape_ops::{Concat, Reshape, Transpose};
pub use softmax::{FusedSoftmax, LogSoftmax, Softmax, SoftmaxCrossEntropy};
pub use softmax::{
    SoftmaxCrossEntropyGrad, SoftmaxCrossEntropyWithGrad, SoftmaxGrad, MAX_SUMMED_CLASSES,
};
pub use source::{attrs_but_values, is_source, Cast, Const, Init, Placeholder, Variable};
pub use train::{
    replaced_inputs, step_count, update_members, variable_updates, AllFinite, AssignVariable,
    Group, GroupedOptimizerUpdate, IncrementIf, LossScaleUpdate, OptimizerUpdate, Rule,
    VariableUpdate, STEP_COUNT,
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
    fp8::OPS,
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
    schedule::OPS,
    dropout::OPS,
    select::OPS,
    compare::COMPARE_OPS,
    compare::LOGICAL_OPS,
    compare::NOT_OPS,
    gather::OPS,
    pad::OPS,
    resize::OPS,
    collective::OPS,
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

    /// The name files use: `NHWC` or `NCHW`.
    pub fn as_str(self) -> &'static str {
        match self {
            DataFormat::Nhwc => "NHWC",
            DataFormat::Nchw => "NCHW",
        }
    }

    /// Where height and width stand among an image's four dimensions.
    pub fn spatial_dims(self) -> [usize; 2] {
        match self {
            DataFormat::Nhwc => [1, 2],
            DataFormat::Nchw => [2, 3],
        }
    }
}

impl From<DataFormat> for AttrValue {
    fn from(f: DataFormat) -> Self {
        AttrValue::Str(f.as_str().into())
    }
}

/// Padding of windowed ops (convolution, pooling), TensorFlow's meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Padding {
    /// `ceil(len / stride)` outputs; the zeros the windows need go half before the
    /// input, half after it, the odd one after.
    Same,
    /// No zeros: every window lies inside the input.
    Valid,
    /// `[before, after]` zeros for height and width (TensorFlow's `EXPLICIT` with
    /// `explicit_paddings`). The pooling ops take it too (ONNX's `pads`), counting only
    /// in-bounds elements as with SAME, and refuse pads as wide as their window
    /// ([`check_pool`](Self::check_pool)).
    Explicit([[usize; 2]; 2]),
}

/// The windows of one spatial axis: the output length and the zeros the windows see
/// before and after the input (an explicit `after` may exceed what the last window
/// reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxisPadding {
    pub out: usize,
    pub before: usize,
    pub after: usize,
}

const EXPLICIT_PADDINGS: &str = "explicit_paddings";

impl Padding {
    /// Reads a windowed op's `padding` (SAME, VALID or EXPLICIT) and
    /// `explicit_paddings`: with EXPLICIT, 8 integers, a (before, after) pair per
    /// dimension in `format`'s order, the batch and channel pairs 0; otherwise empty
    /// or absent.
    pub fn read(a: &mut AttrReader, format: DataFormat) -> OpResult<Padding> {
        let named = Self::read_name(a)?;
        let list = a.opt_ints(EXPLICIT_PADDINGS)?.unwrap_or_default();
        match named {
            Some(p) if list.is_empty() => Ok(p),
            Some(_) => Err(format!(
                "attr '{EXPLICIT_PADDINGS}' must be empty unless padding is EXPLICIT, got {list:?}"
            )),
            None => Self::explicit_from(&list, format),
        }
    }

    /// `padding`'s value: a padding, `None` for EXPLICIT.
    fn read_name(a: &mut AttrReader) -> OpResult<Option<Padding>> {
        a.choice(
            "padding",
            &[
                ("SAME", Some(Padding::Same)),
                ("VALID", Some(Padding::Valid)),
                ("EXPLICIT", None),
            ],
            None,
        )
    }

    fn explicit_from(list: &[i64], format: DataFormat) -> OpResult<Padding> {
        let bad = |what: &str| {
            format!(
                "attr '{EXPLICIT_PADDINGS}' {what} with padding EXPLICIT ({} order), got {list:?}",
                format.as_str()
            )
        };
        if list.len() != 8 {
            return Err(bad("must hold 8 integers, before and after each dimension"));
        }
        let pads: Vec<usize> = list
            .iter()
            .map(|&p| usize::try_from(p))
            .collect::<Result<_, _>>()
            .map_err(|_| bad("must not be negative"))?;
        let pair = |d: usize| [pads[2 * d], pads[2 * d + 1]];
        let [h, w] = format.spatial_dims();
        if (0..4).any(|d| d != h && d != w && pair(d) != [0, 0]) {
            return Err(bad("must not pad the batch or channel dimension"));
        }
        Ok(Padding::Explicit([pair(h), pair(w)]))
    }

    /// The attrs that write this padding for an op in `format`: `padding`, and
    /// `explicit_paddings` when EXPLICIT.
    pub fn attrs(self, format: DataFormat) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("padding", self.into())];
        if let Padding::Explicit(pads) = self {
            let mut list = vec![0; 8];
            for (d, [before, after]) in format.spatial_dims().into_iter().zip(pads) {
                list[2 * d] = before as i64;
                list[2 * d + 1] = after as i64;
            }
            a.push((EXPLICIT_PADDINGS, AttrValue::Ints(list)));
        }
        a
    }

    /// Refuses explicit pads that leave a pooling window (`ksize`) over an `[h, w]`
    /// image without an input element: pads as wide as the window or wider, or an
    /// empty image. Pads below the window cannot (every window then starts before
    /// the input's end and ends after its start). PyTorch refuses pads over half the
    /// window; ONNX allows any below it.
    pub fn check_pool(self, ksize: [usize; 2], [h, w]: [usize; 2]) -> OpResult<()> {
        let Padding::Explicit(pads) = self else {
            return Ok(());
        };
        for (axis, (name, len)) in [("height", h), ("width", w)].into_iter().enumerate() {
            let ([before, after], window) = (pads[axis], ksize[axis]);
            if before >= window || after >= window {
                return Err(format!(
                    "{name}: explicit padding {before} before and {after} after must be \
                     smaller than the pooling window {window}: a window in the padding \
                     alone has nothing to pool"
                ));
            }
            if len == 0 {
                return Err(format!(
                    "{name}: an empty input with explicit padding has only windows of \
                     padding to pool"
                ));
            }
        }
        Ok(())
    }

    /// The windows of spatial axis `axis` (0 height, 1 width) over `input` elements.
    pub fn output_len(
        self,
        axis: usize,
        input: usize,
        window: usize,
        stride: usize,
    ) -> OpResult<AxisPadding> {
        match self {
            Padding::Valid => {
                if input < window {
                    return Err(format!(
                        "window {window} is larger than the input {input} with VALID padding"
                    ));
                }
                Ok(AxisPadding {
                    out: (input - window) / stride + 1,
                    before: 0,
                    after: 0,
                })
            }
            Padding::Same => {
                let out = input.div_ceil(stride);
                let needed = ((out.saturating_sub(1)) * stride + window).saturating_sub(input);
                Ok(AxisPadding {
                    out,
                    before: needed / 2,
                    after: needed - needed / 2,
                })
            }
            Padding::Explicit(pads) => {
                let [before, after] = pads[axis];
                let padded = input
                    .checked_add(before)
                    .and_then(|l| l.checked_add(after))
                    .ok_or_else(|| format!("padding {before} + {after} overflows"))?;
                if padded < window {
                    return Err(format!(
                        "window {window} is larger than the input {input} with explicit \
                         padding {before} before and {after} after"
                    ));
                }
                Ok(AxisPadding {
                    out: (padded - window) / stride + 1,
                    before,
                    after,
                })
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
                Padding::Explicit(_) => "EXPLICIT",
            }
            .into(),
        )
    }
}
