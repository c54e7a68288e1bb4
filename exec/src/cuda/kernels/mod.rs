//! The CUDA kernels, one file per family, and the lowering that picks them.
//!
//! A step's plan lowers every node once ([`lower`]): a source (a fed or held value, a
//! constant) or a [`CudaKernel`] that launches the node's work with the step's buffers.
//! A node no family takes is refused there, with its name, op and types, so which ops
//! run on the device is exactly what the families lower.
//!
//! Each family file holds its module specs (a [`KernelSpec`]: the cache key of a
//! compiled module is the spec itself, so key and source cannot disagree), their
//! source generators, the kernels' argument lists next to their C signatures, the
//! launches and the family's unit tests. [`toolbox`] holds what the families share
//! on the host (the spec trait, the launch context, row and column-sum launches),
//! [`codegen`] what their source generators share (the prelude, dtype blocks,
//! vectorised elementwise loops, warp-row and column-sum pieces). `docs/architecture.md` walks through adding an op or a family.

#[macro_use]
mod toolbox;

pub(crate) mod attention;
mod batch_norm;
pub(crate) mod codegen;
mod collective;
mod conv;
mod cross_entropy;
mod elementwise;
mod fp8;
mod fused;
mod matmul;
mod norm;
#[cfg(test)]
mod parse_check;
mod pool;
mod reduce;
mod resize;
mod select;
mod shape;
mod softmax;
mod training;

use ampgraph_graph::ops::{Const, Group, Placeholder, Variable};
use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{Op, TensorType};

use super::device::DTensor;
pub(crate) use toolbox::*;

/// A node's work on the device, decided when the step is planned.
pub(crate) trait CudaKernel: Send + Sync {
    /// Computes the node's outputs from its inputs, allocating them through `c`.
    fn launch(&self, c: &Ctx, inputs: &[DTensor]) -> Result<Vec<DTensor>, String>;
}

impl<F: Fn(&Ctx, &[DTensor]) -> Result<Vec<DTensor>, String> + Send + Sync> CudaKernel for F {
    fn launch(&self, c: &Ctx, inputs: &[DTensor]) -> Result<Vec<DTensor>, String> {
        self(c, inputs)
    }
}

/// A kernel from its launch closure (what a family's `lower` returns).
fn kernel(
    f: impl Fn(&Ctx, &[DTensor]) -> Result<Vec<DTensor>, String> + Send + Sync + 'static,
) -> Box<dyn CudaKernel> {
    Box::new(f)
}

/// A kernel of one output, of type `out`: `f` computes it into the buffer it is given.
fn one_output(
    out: TensorType,
    f: impl Fn(&Ctx, &[DTensor], &DTensor) -> Result<(), String> + Send + Sync + 'static,
) -> Box<dyn CudaKernel> {
    kernel(move |c, inputs| {
        let y = c.alloc(&out)?;
        f(c, inputs, &y)?;
        Ok(vec![y])
    })
}

/// A node's values that the executor supplies rather than computes.
pub(crate) enum Source {
    Placeholder,
    Variable,
    /// A Const's value (zeros where it holds none), or Group's `true`: uploaded when
    /// the step is planned, from the op itself.
    Constant,
}

/// What a node becomes on the device.
pub(crate) enum Lowered {
    Source(Source),
    Kernel(Box<dyn CudaKernel>),
}

/// What a family's `lower` answers: `None` where the op is not the family's, else its
/// kernel or why it cannot run (a dtype or shape the kernels do not take).
type Lowering = Option<KernelResult>;

/// A node's kernel, or why no kernel takes it.
type KernelResult = Result<Box<dyn CudaKernel>, String>;

/// A family's `lower`: the op with its input and output types.
type Lower = fn(&dyn Op, &[TensorType], &[TensorType]) -> Lowering;

/// Every family, asked in turn.
const FAMILIES: &[Lower] = &[
    elementwise::lower,
    fused::lower,
    shape::lower,
    reduce::lower,
    softmax::lower,
    cross_entropy::lower,
    norm::lower,
    matmul::lower,
    attention::lower,
    conv::lower,
    batch_norm::lower,
    training::lower,
    pool::lower,
    select::lower,
    resize::lower,
    collective::lower,
];

/// Lowers a node (`op` with its input and output types) once, for every step.
pub(crate) fn lower(
    op: &dyn Op,
    inputs: &[TensorType],
    outputs: &[TensorType],
) -> Result<Lowered, String> {
    if op.is::<Placeholder>() {
        return Ok(Lowered::Source(Source::Placeholder));
    }
    if op.is::<Variable>() {
        return Ok(Lowered::Source(Source::Variable));
    }
    if op.is::<Const>() || op.is::<Group>() {
        return Ok(Lowered::Source(Source::Constant));
    }
    // Of the kernels, only the FP8 pass's ops read and write FP8 tensors.
    if let Some(k) = fp8::lower(op, inputs, outputs) {
        return k.map(Lowered::Kernel);
    }
    if let Some(t) = inputs.iter().chain(outputs).find(|t| t.dtype.is_fp8()) {
        return Err(format!(
            "{} on {} tensors has no CUDA kernel (only the FP8 pass's ops take them): run \
             the graph on the CPU",
            op.name(),
            t.dtype
        ));
    }
    for family in FAMILIES {
        if let Some(k) = family(op, inputs, outputs) {
            return k.map(Lowered::Kernel);
        }
    }
    let types: Vec<String> = inputs
        .iter()
        .map(|t| format!("{}{}", t.dtype, ShapeDisplay(&t.shape)))
        .collect();
    Err(format!(
        "{} has no CUDA kernel for inputs ({}); use Device::Cpu",
        op.name(),
        types.join(", ")
    ))
}
