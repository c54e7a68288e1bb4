//! `FusedElementwise`: one node running a small program of elementwise instructions
//! (the nodes of a group the `fuse` pass merged) in one sweep over the elements, so
//! that the intermediate tensors are never stored.
//!
//! Instruction `j` defines the value `vj`: an input of the node (`ink`) or an
//! elementwise op (Unary, UnaryGrad, Binary, BinaryGrad, BiasAdd, Cast, Dropout) over earlier
//! values, and carries its result type. In files the program is the `program` attr,
//! one statement per instruction, each op with its own attrs in `<key=value, ...>`:
//!
//! ```text
//! v0 = in0: f32[64, 512]; v1 = in1: f32[512];
//! v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[64, 512]; v3 = Relu(v2): f32[64, 512];
//! v4 = Cast<to=f16>(v3): f16[64, 512]
//! ```
//!
//! and the `outputs` attr lists the values the node outputs, in order. The optional
//! `column_sums` attr lists values whose sums over every axis but the last (a bias
//! gradient: [`FusedElementwise::column_sum`]) the node outputs after those, in f32
//! (f64 for f64 values): the reduction reads its operand while the program computes
//! it, not back from memory. The optional `amaxes` attr lists values whose largest
//! magnitude (`max |v|` of the value as stored, NaN where one is: an FP8 scale's
//! amax, [`crate::fp8::amax`]) the node outputs after those, as f32 scalars.
//!
//! Every value but the inputs has the element count N of the outputs (the program's
//! domain); an input with fewer elements is broadcast where it is read (NumPy rules;
//! a BiasAdd's bias along its channel axis). Each instruction computes in the compute
//! type of its operands (f32 for f32/f16/bf16, f64 for f64) and rounds its result to
//! its own dtype, as the node it replaces stored its tensor: on the CPU a fused node is
//! bitwise equal to the ops it replaced.

use std::fmt;

use rayon::prelude::*;

use crate::attrs::{AttrMap, AttrReader, AttrValue};
use crate::dtype::DType;
use crate::kernel::Real;
use crate::op::{Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::ops::{
    parse_op, BiasAdd, Binary, BinaryGrad, BinaryKind, Cast, DataFormat, Dropout, Reduce,
    ReduceKind, Unary, UnaryGrad, UnaryKind,
};
use crate::shape::broadcast_index_map;
use crate::tensor::{bf16_from_f64, checked_numel, f16_from_f64, Data, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[OpEntry {
    name: "FusedElementwise",
    parse: |_, a| Ok(Box::new(FusedElementwise::parse(a)?)),
}];

/// Annotation of a fused node: the names of the nodes it replaced, comma-separated.
pub const MEMBERS_ANNOTATION: &str = "_fused_members";

/// An elementwise op a program can hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ElementOp {
    Unary(UnaryKind),
    UnaryGrad(UnaryKind),
    Binary(BinaryKind),
    /// The kind and the operand (`wrt`) the gradient is of.
    BinaryGrad(BinaryKind, usize),
    BiasAdd(DataFormat),
    /// A conversion between float types.
    Cast(DType),
    /// Operands `(x, count)`; reads the element's index too.
    Dropout(Dropout),
}

impl ElementOp {
    /// The program form of a node's op, if a program can hold it.
    pub fn of(op: &dyn Op) -> Option<ElementOp> {
        if let Some(u) = op.downcast_ref::<Unary>() {
            Some(ElementOp::Unary(u.kind))
        } else if let Some(u) = op.downcast_ref::<UnaryGrad>() {
            Some(ElementOp::UnaryGrad(u.kind))
        } else if let Some(b) = op.downcast_ref::<Binary>() {
            Some(ElementOp::Binary(b.kind))
        } else if let Some(b) = op.downcast_ref::<BinaryGrad>() {
            Some(ElementOp::BinaryGrad(b.kind, b.wrt))
        } else if let Some(b) = op.downcast_ref::<BiasAdd>() {
            Some(ElementOp::BiasAdd(b.data_format))
        } else if let Some(d) = op.downcast_ref::<Dropout>() {
            Some(ElementOp::Dropout(*d))
        } else {
            let cast = op.downcast_ref::<Cast>()?;
            cast.to.is_float().then_some(ElementOp::Cast(cast.to))
        }
    }

    /// The op as a node holds it: its name, attrs and type rule are the instruction's.
    pub fn to_op(self) -> Box<dyn Op> {
        match self {
            ElementOp::Unary(kind) => Box::new(Unary::new(kind)),
            ElementOp::UnaryGrad(kind) => Box::new(UnaryGrad { kind }),
            ElementOp::Binary(kind) => Box::new(Binary::new(kind)),
            ElementOp::BinaryGrad(kind, wrt) => Box::new(BinaryGrad::new(kind, wrt)),
            ElementOp::BiasAdd(data_format) => Box::new(BiasAdd { data_format }),
            ElementOp::Cast(to) => Box::new(Cast { to }),
            ElementOp::Dropout(d) => Box::new(d),
        }
    }

    pub fn arity(self) -> usize {
        match self {
            ElementOp::Unary(_) | ElementOp::Cast(_) => 1,
            ElementOp::UnaryGrad(_)
            | ElementOp::Binary(_)
            | ElementOp::BiasAdd(_)
            | ElementOp::Dropout(_) => 2,
            ElementOp::BinaryGrad(..) => 3,
        }
    }

    /// Element `i` of the result, in the compute type, from the operands (unused
    /// slots are ignored). A Cast passes its operand on: rounding to the
    /// instruction's dtype converts it.
    fn apply<T: Real>(self, [a, b, c]: [T; 3], i: usize) -> T {
        match self {
            ElementOp::Unary(kind) => kind.apply(a),
            ElementOp::UnaryGrad(kind) => kind.input_grad(a, b),
            ElementOp::Binary(kind) => kind.apply(a, b),
            ElementOp::BinaryGrad(kind, wrt) => kind.grad(wrt, a, b, c),
            ElementOp::BiasAdd(_) => a + b,
            ElementOp::Cast(_) => a,
            ElementOp::Dropout(d) => d.apply(a, b, i as u64),
        }
    }
}

/// What an instruction computes.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// Input `k` of the node.
    Input(usize),
    /// An op over earlier values (their instruction indices).
    Apply(ElementOp, Vec<usize>),
}

/// One instruction: its expression and result type.
#[derive(Clone, Debug, PartialEq)]
pub struct Instr {
    pub expr: Expr,
    pub ty: TensorType,
}

/// Where an instruction reads one operand.
#[derive(Clone, Debug, PartialEq)]
pub enum Operand {
    /// Value `vj` at the element being computed (an input with the domain's element
    /// count is read there too).
    Value(usize),
    /// Input `input` viewed as shape `view` and broadcast to shape `into` (the
    /// instruction's): NumPy rules, a BiasAdd's bias viewed along its channel axis.
    Broadcast {
        input: usize,
        view: Vec<usize>,
        into: Vec<usize>,
    },
}

/// A fused group of elementwise nodes: see the module documentation.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedElementwise {
    instrs: Vec<Instr>,
    outputs: Vec<usize>,
    /// Values whose column sums are output after `outputs`.
    sums: Vec<usize>,
    /// Values whose amaxes are output after the column sums.
    amaxes: Vec<usize>,
    num_inputs: usize,
}

impl FusedElementwise {
    /// A program from its instructions and output values. Checks its structure:
    /// operands defined before use with the op's count, inputs read as `in0, in1, ...`
    /// once each in this order, outputs defined. Types are checked by `infer`.
    pub fn new(instrs: Vec<Instr>, outputs: Vec<usize>) -> OpResult<FusedElementwise> {
        FusedElementwise::from_parts(instrs, outputs, Vec::new(), Vec::new())
    }

    /// The same program also outputting the column sums of `sums` (values of the
    /// domain's size, the domain of rank 2 or more, all summed in one dtype; at most
    /// [`MAX_COLUMN_SUMS`]), after its other outputs.
    pub fn with_column_sums(self, sums: Vec<usize>) -> OpResult<FusedElementwise> {
        FusedElementwise::from_parts(self.instrs, self.outputs, sums, self.amaxes)
    }

    /// The same program also outputting the amaxes of `amaxes` (values of the
    /// domain's size), after its other outputs and column sums.
    pub fn with_amaxes(self, amaxes: Vec<usize>) -> OpResult<FusedElementwise> {
        FusedElementwise::from_parts(self.instrs, self.outputs, self.sums, amaxes)
    }

    /// The same program storing only the outputs `keep` says (by their number), its
    /// column sums and amaxes unchanged: an output nothing reads is not written. A
    /// program keeps at least one output, column sum or amax.
    pub fn retain_outputs(&self, keep: impl Fn(usize) -> bool) -> OpResult<FusedElementwise> {
        let outputs = (self.outputs.iter().enumerate())
            .filter(|&(o, _)| keep(o))
            .map(|(_, &v)| v)
            .collect();
        FusedElementwise::from_parts(
            self.instrs.clone(),
            outputs,
            self.sums.clone(),
            self.amaxes.clone(),
        )
    }

    fn from_parts(
        instrs: Vec<Instr>,
        outputs: Vec<usize>,
        sums: Vec<usize>,
        amaxes: Vec<usize>,
    ) -> OpResult<FusedElementwise> {
        let mut num_inputs = 0;
        for (j, ins) in instrs.iter().enumerate() {
            match &ins.expr {
                Expr::Input(k) if *k == num_inputs => num_inputs += 1,
                Expr::Input(k) => {
                    return Err(format!(
                        "v{j} reads in{k} but the next input to read is in{num_inputs}: \
                         inputs are read once each, in order"
                    ))
                }
                Expr::Apply(op, args) => {
                    if args.len() != op.arity() {
                        return Err(format!(
                            "v{j}: {} takes {} operands, got {}",
                            op.to_op().name(),
                            op.arity(),
                            args.len()
                        ));
                    }
                    if let Some(a) = args.iter().find(|&&a| a >= j) {
                        return Err(format!("v{j} reads v{a}, which is not defined before it"));
                    }
                }
            }
        }
        if outputs.is_empty() && sums.is_empty() && amaxes.is_empty() {
            return Err("the program has no outputs (and no column sums or amaxes)".into());
        }
        if let Some(o) = outputs.iter().find(|&&o| o >= instrs.len()) {
            return Err(format!("output v{o} is not defined"));
        }
        if sums.len() > MAX_COLUMN_SUMS {
            return Err(format!(
                "{} column sums: a program takes at most {MAX_COLUMN_SUMS}",
                sums.len()
            ));
        }
        if let Some(v) = sums.iter().find(|&&v| v >= instrs.len()) {
            return Err(format!("column sum of v{v}, which is not defined"));
        }
        if let Some(v) = amaxes.iter().find(|&&v| v >= instrs.len()) {
            return Err(format!("amax of v{v}, which is not defined"));
        }
        let program = FusedElementwise {
            instrs,
            outputs,
            sums,
            amaxes,
            num_inputs,
        };
        let n = program.domain_len();
        if let Some(&v) =
            (program.amaxes.iter()).find(|&&v| program.instrs[v].ty.checked_len() != Some(n))
        {
            return Err(format!(
                "amax of v{v} ({}): only values of the domain's {n} elements have amaxes",
                program.instrs[v].ty
            ));
        }
        for &v in &program.sums {
            let ty = &program.instrs[v].ty;
            if ty.rank() < 2 || ty.checked_len() != Some(n) {
                return Err(format!(
                    "column sum of v{v} ({ty}): only values of the domain's {n} elements \
                     with two or more axes have column sums"
                ));
            }
        }
        let dtypes = (program.sums.iter()).map(|&v| column_sum_dtype(program.instrs[v].ty.dtype));
        if dtypes.collect::<std::collections::BTreeSet<_>>().len() > 1 {
            return Err("column sums in both f32 and f64: a program sums in one dtype".into());
        }
        Ok(program)
    }

    pub fn instrs(&self) -> &[Instr] {
        &self.instrs
    }

    /// The values the node outputs, in order.
    pub fn outputs(&self) -> &[usize] {
        &self.outputs
    }

    pub fn num_inputs(&self) -> usize {
        self.num_inputs
    }

    /// The values whose column sums the node outputs after [`Self::outputs`].
    pub fn column_sums(&self) -> &[usize] {
        &self.sums
    }

    /// The values whose amaxes the node outputs after its column sums.
    pub fn amaxes(&self) -> &[usize] {
        &self.amaxes
    }

    /// The reduction a column sum of value `v` is: a Sum over every axis but the last,
    /// accumulated and stored in `f32` (`f64` for an f64 value).
    pub fn column_sum(&self, v: usize) -> Reduce {
        column_sum_of(&self.instrs[v].ty)
    }

    /// N: the element count of every value but the inputs (its first output's, or
    /// first summed or measured value's where it stores none).
    pub fn domain_len(&self) -> usize {
        (self
            .outputs
            .first()
            .or(self.sums.first())
            .or(self.amaxes.first()))
        .and_then(|&v| self.instrs[v].ty.checked_len())
        .unwrap_or(0)
    }

    /// Where instruction `j` reads its operand `slot`.
    pub fn operand(&self, j: usize, slot: usize) -> Operand {
        let ins = &self.instrs[j];
        let Expr::Apply(op, args) = &ins.expr else {
            return Operand::Value(j);
        };
        let a = args[slot];
        let source = &self.instrs[a];
        match source.expr {
            Expr::Input(input) if source.ty.checked_len() != Some(self.domain_len()) => {
                let mut view = source.ty.shape.clone();
                if let (ElementOp::BiasAdd(data_format), 1) = (op, slot) {
                    // [C] followed by a 1 for each axis after the channel axis.
                    let rank = ins.ty.rank();
                    let axis = BiasAdd {
                        data_format: *data_format,
                    }
                    .channel_axis(rank);
                    view.resize(rank - axis, 1);
                }
                Operand::Broadcast {
                    input,
                    view,
                    into: ins.ty.shape.clone(),
                }
            }
            _ => Operand::Value(a),
        }
    }

    pub(crate) fn parse(a: &mut AttrReader) -> OpResult<FusedElementwise> {
        let text = a.opt_str("program")?.ok_or("missing attr 'program'")?;
        let outputs = a
            .ints("outputs")?
            .into_iter()
            .map(|o| usize::try_from(o).map_err(|_| format!("attr 'outputs' holds {o}")))
            .collect::<OpResult<Vec<usize>>>()?;
        let instrs = text
            .split(';')
            .enumerate()
            .map(|(j, s)| {
                parse_statement(j, s.trim())
                    .map_err(|e| format!("attr 'program', statement {j} '{}': {e}", s.trim()))
            })
            .collect::<OpResult<Vec<Instr>>>()?;
        let sums = a
            .opt_ints("column_sums")?
            .unwrap_or_default()
            .into_iter()
            .map(|v| usize::try_from(v).map_err(|_| format!("attr 'column_sums' holds {v}")))
            .collect::<OpResult<Vec<usize>>>()?;
        let amaxes = a
            .opt_ints("amaxes")?
            .unwrap_or_default()
            .into_iter()
            .map(|v| usize::try_from(v).map_err(|_| format!("attr 'amaxes' holds {v}")))
            .collect::<OpResult<Vec<usize>>>()?;
        FusedElementwise::from_parts(instrs, outputs, sums, amaxes)
            .map_err(|e| format!("attr 'program': {e}"))
    }

    /// Per instruction, how the CPU kernel computes it.
    fn plan(&self, inputs: &[&Tensor]) -> Vec<Step> {
        let n = self.domain_len();
        self.instrs
            .iter()
            .enumerate()
            .map(|(j, ins)| match &ins.expr {
                Expr::Input(k) if inputs[*k].len() == n => Step::Load(*k),
                Expr::Input(_) => Step::Skip,
                Expr::Apply(op, args) => Step::Apply {
                    op: *op,
                    wide: self.instrs[args[0]].ty.dtype == DType::F64,
                    dtype: ins.ty.dtype,
                    reads: (0..args.len())
                        .map(|slot| match self.operand(j, slot) {
                            Operand::Value(v) => Read::Value(v),
                            Operand::Broadcast { input, view, into } => {
                                Read::Gather(input, broadcast_index_map(&view, &into))
                            }
                        })
                        .collect(),
                },
            })
            .collect()
    }
}

/// How the CPU kernel computes one instruction at an element.
enum Step {
    /// The element of input `k`.
    Load(usize),
    /// A broadcast input: read where it is used.
    Skip,
    Apply {
        op: ElementOp,
        /// Computes in f64 (operands f64) rather than f32.
        wide: bool,
        dtype: DType,
        reads: Vec<Read>,
    },
}

/// How the CPU kernel reads one operand at an element.
enum Read {
    Value(usize),
    /// Input `k` at `index[element]`.
    Gather(usize, Vec<usize>),
}

/// The most column sums one program takes (a CUDA kernel holds each sum's partials
/// for a tile of columns in shared memory).
pub const MAX_COLUMN_SUMS: usize = 4;

/// The dtype column sums of `dtype` values accumulate in and are stored as.
pub fn column_sum_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The column sum of a tensor of type `ty`: a Sum over every axis but the last (a bias
/// gradient), accumulated and stored in [`column_sum_dtype`].
pub fn column_sum_of(ty: &TensorType) -> Reduce {
    let leading = (0..ty.rank().saturating_sub(1) as i64).collect();
    Reduce::new(ReduceKind::Sum, Some(leading), false).with_output(column_sum_dtype(ty.dtype))
}

/// Rounds `v` to the nearest value of a float `dtype`, as storing it would.
fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::F16 => f16_from_f64(v).to_f64(),
        DType::BF16 => bf16_from_f64(v).to_f64(),
        _ => v,
    }
}

/// Elements per parallel task of the CPU kernel.
const CHUNK: usize = 1 << 14;

impl Op for FusedElementwise {
    fn name(&self) -> &'static str {
        "FusedElementwise"
    }

    fn arity(&self) -> Arity {
        Arity::Exactly(self.num_inputs)
    }

    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let ints = |values: &[usize]| AttrValue::Ints(values.iter().map(|&v| v as i64).collect());
        let mut attrs = vec![
            ("program", AttrValue::Str(self.to_string())),
            ("outputs", ints(&self.outputs)),
        ];
        if !self.sums.is_empty() {
            attrs.push(("column_sums", ints(&self.sums)));
        }
        if !self.amaxes.is_empty() {
            attrs.push(("amaxes", ints(&self.amaxes)));
        }
        attrs
    }

    /// Recomputes every instruction's type from the inputs' with the op's own rule
    /// and requires the recorded one.
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        if inputs.len() != self.num_inputs {
            return Err(format!(
                "the program reads {} inputs, got {}",
                self.num_inputs,
                inputs.len()
            ));
        }
        let n = self.domain_len();
        for (j, ins) in self.instrs.iter().enumerate() {
            let inferred = match &ins.expr {
                Expr::Input(k) => inputs[*k].clone(),
                Expr::Apply(op, args) => {
                    let types: Vec<&TensorType> =
                        args.iter().map(|&a| &self.instrs[a].ty).collect();
                    let op = op.to_op();
                    op.infer(&types)
                        .map_err(|e| format!("v{j} ({}): {e}", op.name()))?
                        .into_iter()
                        .next()
                        .ok_or_else(|| format!("v{j} ({}) has no output", op.name()))?
                }
            };
            if inferred != ins.ty {
                return Err(format!(
                    "v{j} is recorded as {} but its operands give {inferred}",
                    ins.ty
                ));
            }
            if !ins.ty.dtype.is_float() {
                return Err(format!(
                    "v{j} is {}: fused programs hold float tensors only",
                    ins.ty
                ));
            }
            let counts = matches!(ins.expr, Expr::Apply(..)) || self.outputs.contains(&j);
            if counts && ins.ty.checked_len() != Some(n) {
                return Err(format!(
                    "v{j} ({}) does not have the {n} elements of the program's outputs",
                    ins.ty
                ));
            }
        }
        let sums = self.sums.iter().map(|&v| {
            let ty = &self.instrs[v].ty;
            let last = ty.shape[ty.rank() - 1];
            TensorType::new(column_sum_dtype(ty.dtype), vec![last])
        });
        let amaxes = self.amaxes.iter().map(|_| TensorType::new(DType::F32, []));
        Ok(self
            .outputs
            .iter()
            .map(|&o| self.instrs[o].ty.clone())
            .chain(sums)
            .chain(amaxes)
            .collect())
    }

    /// Interprets the program element by element, rounding every value to its dtype.
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
        let out_types = self.infer(&types.iter().collect::<Vec<_>>())?;
        // Float values are exact in f64, whatever their dtype.
        let values: Vec<Vec<f64>> = inputs.iter().map(|t| t.to_f64_vec()).collect();
        let plan = self.plan(inputs);
        let n = self.domain_len();
        // The outputs' values, then those summed and measured (each sum or amax reduces
        // its value's tensor).
        let stored: Vec<usize> = (self.outputs.iter().chain(&self.sums).chain(&self.amaxes))
            .copied()
            .collect();
        let chunks: Vec<Vec<Vec<f64>>> = (0..n.div_ceil(CHUNK))
            .into_par_iter()
            .map(|c| {
                let range = c * CHUNK..n.min((c + 1) * CHUNK);
                let mut vals = vec![0.0; self.instrs.len()];
                let mut outs = vec![Vec::with_capacity(range.len()); stored.len()];
                for i in range {
                    for (j, step) in plan.iter().enumerate() {
                        vals[j] = match step {
                            Step::Load(k) => values[*k][i],
                            Step::Skip => continue,
                            Step::Apply {
                                op,
                                wide,
                                dtype,
                                reads,
                            } => {
                                let mut args = [0.0; 3];
                                for (arg, read) in args.iter_mut().zip(reads) {
                                    *arg = match read {
                                        Read::Value(v) => vals[*v],
                                        Read::Gather(k, index) => values[*k][index[i]],
                                    };
                                }
                                let y = if *wide {
                                    op.apply(args, i)
                                } else {
                                    op.apply(args.map(|a| a as f32), i) as f64
                                };
                                round_to(*dtype, y)
                            }
                        };
                    }
                    for (out, &j) in outs.iter_mut().zip(&stored) {
                        out.push(vals[j]);
                    }
                }
                outs
            })
            .collect();
        let tensor = |o: usize, ty: &TensorType| {
            let v = chunks.iter().flat_map(|c| c[o].iter().copied());
            Tensor::new(ty.shape.clone(), Data::from_f64(ty.dtype, v))
        };
        let mut results = Vec::with_capacity(out_types.len());
        for (o, &v) in stored.iter().enumerate() {
            if o < self.outputs.len() {
                results.push(tensor(o, &out_types[o])?);
            } else if o < self.outputs.len() + self.sums.len() {
                let value = tensor(o, &self.instrs[v].ty)?;
                results.extend(self.column_sum(v).eval(&[&value])?);
            } else {
                let value = tensor(o, &self.instrs[v].ty)?.to_f32_vec();
                let amax = crate::fp8::amax(&value);
                results.push(Tensor::scalar(DType::F32, f64::from(amax)));
            }
        }
        Ok(results)
    }

    /// Each input and output is its own fixed type: the program mixes dtypes on
    /// purpose (it holds the casts AMP placed), and repainting one tensor would break
    /// the recorded types. AMP runs before fusion, never across a fused node.
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        let outputs = (0..num_outputs).map(|o| TypeGroup::new(vec![], vec![o]).fixed());
        let inputs = (0..num_inputs).map(|i| TypeGroup::new(vec![i], vec![]).fixed());
        outputs.chain(inputs).collect()
    }
}

/// The program text: statements `vj = expr: type` joined by `; `.
impl fmt::Display for FusedElementwise {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (j, ins) in self.instrs.iter().enumerate() {
            if j > 0 {
                f.write_str("; ")?;
            }
            write!(f, "v{j} = ")?;
            match &ins.expr {
                Expr::Input(k) => write!(f, "in{k}")?,
                Expr::Apply(op, args) => {
                    let op = op.to_op();
                    f.write_str(op.name())?;
                    let attrs = op.attrs();
                    if !attrs.is_empty() {
                        let attrs: Vec<String> = attrs
                            .iter()
                            .map(|(k, v)| format!("{k}={}", attr_text(v)))
                            .collect();
                        write!(f, "<{}>", attrs.join(", "))?;
                    }
                    let args: Vec<String> = args.iter().map(|a| format!("v{a}")).collect();
                    write!(f, "({})", args.join(", "))?;
                }
            }
            write!(f, ": {}", ins.ty)?;
        }
        Ok(())
    }
}

/// An attr value in program text (elementwise ops' attrs are scalars).
fn attr_text(v: &AttrValue) -> String {
    match v {
        AttrValue::Bool(b) => b.to_string(),
        AttrValue::Int(i) => i.to_string(),
        AttrValue::Float(x) => x.to_string(),
        AttrValue::Str(s) => s.clone(),
        other => format!("{other:?}"),
    }
}

/// Reads an attr value back from program text: a boolean, an integer, a number or
/// else a word.
fn parse_attr_value(s: &str) -> AttrValue {
    match s {
        "true" => AttrValue::Bool(true),
        "false" => AttrValue::Bool(false),
        _ => s
            .parse::<i64>()
            .map(AttrValue::Int)
            .or_else(|_| s.parse::<f64>().map(AttrValue::Float))
            .unwrap_or_else(|_| AttrValue::Str(s.to_string())),
    }
}

/// `vj = expr: type`.
fn parse_statement(j: usize, s: &str) -> OpResult<Instr> {
    let (lhs, rhs) = s
        .split_once('=')
        .ok_or_else(|| format!("expected 'v{j} = ...'"))?;
    if lhs.trim() != format!("v{j}") {
        return Err(format!(
            "expected 'v{j} = ...', the statements number their values in order"
        ));
    }
    let (expr, ty) = rhs
        .rsplit_once(':')
        .ok_or("missing ': type' after the expression")?;
    Ok(Instr {
        expr: parse_expr(expr.trim())?,
        ty: parse_type(ty.trim())?,
    })
}

/// `f32[64, 512]` (`f32[]` for a scalar).
fn parse_type(s: &str) -> OpResult<TensorType> {
    let bad = || format!("bad type '{s}' (expected a dtype and a shape, e.g. f32[64, 512])");
    let (dtype, dims) = s.split_once('[').ok_or_else(bad)?;
    let dims = dims.strip_suffix(']').ok_or_else(bad)?;
    let dtype: DType = dtype.trim().parse()?;
    let shape = if dims.trim().is_empty() {
        Vec::new()
    } else {
        dims.split(',')
            .map(|d| d.trim().parse::<usize>().map_err(|_| bad()))
            .collect::<OpResult<Vec<usize>>>()?
    };
    if checked_numel(&shape).is_none() {
        return Err(format!(
            "type '{s}' has more elements than can be addressed"
        ));
    }
    Ok(TensorType::new(dtype, shape))
}

/// `ink`, `Op(va, ...)` or `Op<key=value, ...>(va, ...)`.
fn parse_expr(s: &str) -> OpResult<Expr> {
    if let Some(k) = s.strip_prefix("in").and_then(|k| k.parse().ok()) {
        return Ok(Expr::Input(k));
    }
    let (head, args) = s
        .strip_suffix(')')
        .and_then(|r| r.split_once('('))
        .ok_or_else(|| format!("expected 'inK' or 'Op(vA, ...)', got '{s}'"))?;
    let (name, attrs) = match head.split_once('<') {
        Some((name, attrs)) => (
            name.trim(),
            attrs
                .strip_suffix('>')
                .ok_or_else(|| format!("unclosed '<' in '{head}'"))?,
        ),
        None => (head.trim(), ""),
    };
    let mut map = AttrMap::new();
    for kv in attrs.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("attr '{kv}' is not key=value"))?;
        map.insert(k.trim().to_string(), parse_attr_value(v.trim()));
    }
    let op = parse_op(name, AttrReader::new(map)).map_err(|e| format!("{name}: {e}"))?;
    let op = ElementOp::of(op.as_ref())
        .ok_or_else(|| format!("{name} is not an elementwise op a fused program can hold"))?;
    let args = args
        .split(',')
        .map(str::trim)
        .map(|a| {
            a.strip_prefix('v')
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("bad operand '{a}' (expected vN)"))
        })
        .collect::<OpResult<Vec<usize>>>()?;
    Ok(Expr::Apply(op, args))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attrs::AttrMap;

    fn ty(dtype: DType, shape: &[usize]) -> TensorType {
        TensorType::new(dtype, shape.to_vec())
    }

    fn input(k: usize, t: TensorType) -> Instr {
        Instr {
            expr: Expr::Input(k),
            ty: t,
        }
    }

    fn apply(op: ElementOp, args: &[usize], t: TensorType) -> Instr {
        Instr {
            expr: Expr::Apply(op, args.to_vec()),
            ty: t,
        }
    }

    /// Values in [-3, 3) with a fractional part f16 cannot hold exactly.
    fn data(dtype: DType, shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n as u64)
            .map(|i| {
                let z = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                (z >> 11) as f64 / (1u64 << 53) as f64 * 6.0 - 3.0
            })
            .collect();
        Tensor::from_f64(dtype, shape.to_vec(), &v).unwrap()
    }

    /// The reference: each instruction run as its own op, one tensor after another.
    fn unfused(p: &FusedElementwise, inputs: &[Tensor]) -> Vec<Tensor> {
        let mut vals: Vec<Tensor> = Vec::new();
        for ins in p.instrs() {
            let v = match &ins.expr {
                Expr::Input(k) => inputs[*k].clone(),
                Expr::Apply(op, args) => {
                    let operands: Vec<&Tensor> = args.iter().map(|&a| &vals[a]).collect();
                    op.to_op().eval(&operands).unwrap().remove(0)
                }
            };
            vals.push(v);
        }
        p.outputs().iter().map(|&o| vals[o].clone()).collect()
    }

    fn bitwise_equal(a: &Tensor, b: &Tensor) -> bool {
        a.ty() == b.ty()
            && a.to_f64_vec()
                .iter()
                .zip(b.to_f64_vec())
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    fn check_against_unfused(p: &FusedElementwise, inputs: &[Tensor]) {
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let fused = p.eval(&refs).unwrap();
        let want = unfused(p, inputs);
        assert_eq!(fused.len(), want.len());
        for (k, (f, w)) in fused.iter().zip(&want).enumerate() {
            assert!(bitwise_equal(f, w), "output {k} of `{p}` differs");
        }
    }

    fn reparse(p: &FusedElementwise) -> OpResult<Box<dyn Op>> {
        let attrs: AttrMap = p
            .attrs()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        parse_op("FusedElementwise", AttrReader::new(attrs))
    }

    fn parse_text(program: &str, outputs: Vec<i64>) -> OpResult<Box<dyn Op>> {
        let mut attrs = AttrMap::new();
        attrs.insert("program".into(), AttrValue::Str(program.into()));
        attrs.insert("outputs".into(), AttrValue::Ints(outputs));
        parse_op("FusedElementwise", AttrReader::new(attrs))
    }

    /// x f32[4, 6], bias f32[6]: BiasAdd, Relu, Cast to f16, plus the f32 activation.
    fn bias_relu_cast() -> FusedElementwise {
        let (f32s, f16s) = (ty(DType::F32, &[4, 6]), ty(DType::F16, &[4, 6]));
        FusedElementwise::new(
            vec![
                input(0, f32s.clone()),
                input(1, ty(DType::F32, &[6])),
                apply(ElementOp::BiasAdd(DataFormat::Nhwc), &[0, 1], f32s.clone()),
                apply(ElementOp::Unary(UnaryKind::Relu), &[2], f32s),
                apply(ElementOp::Cast(DType::F16), &[3], f16s),
            ],
            vec![4, 3],
        )
        .unwrap()
    }

    /// `dx = gelu'(x) * dy` of two inputs of type `t`, stored (value 2).
    fn gelu_gradient(t: &TensorType) -> FusedElementwise {
        FusedElementwise::new(
            vec![
                input(0, t.clone()),
                input(1, t.clone()),
                apply(
                    ElementOp::UnaryGrad(UnaryKind::Gelu { approximate: false }),
                    &[0, 1],
                    t.clone(),
                ),
            ],
            vec![2],
        )
        .unwrap()
    }

    #[test]
    fn column_sums_are_the_sums_of_the_stored_values_over_the_leading_axes() {
        // f16 [3, 4, 6]: dx = gelu'(x) * dy, exported and summed into f32[6] (a bias
        // gradient), and the f16 input summed too.
        let t = ty(DType::F16, &[3, 4, 6]);
        let p = gelu_gradient(&t).with_column_sums(vec![2, 0]).unwrap();
        let inputs = [
            data(DType::F16, &[3, 4, 6], 1),
            data(DType::F16, &[3, 4, 6], 2),
        ];
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = p.eval(&refs).unwrap();
        assert_eq!(out.len(), 3);
        let types: Vec<TensorType> = out.iter().map(Tensor::ty).collect();
        let tys: Vec<&TensorType> = inputs.iter().map(|_| &t).collect();
        assert_eq!(p.infer(&tys).unwrap(), types);
        assert_eq!(types[1], ty(DType::F32, &[6]));
        // Against sums in f64 of the stored f16 values (exact: 12 terms of f16 in f32
        // may round; the f64 sum rounded to f32 is within an f32 ulp or two).
        for (sum, of) in [(&out[1], &out[0]), (&out[2], &inputs[0])] {
            let (s, v) = (sum.to_f64_vec(), of.to_f64_vec());
            for (j, &got) in s.iter().enumerate() {
                let want: f64 = (0..12).map(|r| v[r * 6 + j]).sum();
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
        }
        // The attr round-trips; an empty list writes no attr.
        let back = reparse(&p).unwrap();
        assert_eq!(back.downcast_ref::<FusedElementwise>(), Some(&p));
        assert!(bias_relu_cast()
            .attrs()
            .iter()
            .all(|(k, _)| *k != "column_sums"));
        // Only full-size values of rank 2 or more have column sums.
        let bias = bias_relu_cast();
        let e = bias.clone().with_column_sums(vec![1]).unwrap_err();
        assert!(e.contains("column sum of v1 (f32[6])"), "{e}");
        assert!(bias.clone().with_column_sums(vec![9]).is_err());
        let flat = FusedElementwise::new(
            vec![
                input(0, ty(DType::F32, &[5])),
                apply(
                    ElementOp::Unary(UnaryKind::Relu),
                    &[0],
                    ty(DType::F32, &[5]),
                ),
            ],
            vec![1],
        )
        .unwrap();
        assert!(flat.with_column_sums(vec![1]).is_err());
    }

    /// Amaxes come after the outputs and column sums: `max |v|` of each value as
    /// stored (the f16 rounding of the GELU gradient, not its f32 value), NaN where
    /// one is NaN; they round-trip; only values of the domain's size have them.
    #[test]
    fn amaxes_are_the_largest_magnitudes_of_the_stored_values() {
        let t = ty(DType::F16, &[3, 4, 6]);
        let p = gelu_gradient(&t)
            .with_column_sums(vec![2])
            .unwrap()
            .with_amaxes(vec![2, 1])
            .unwrap();
        let mut inputs = [
            data(DType::F16, &[3, 4, 6], 1),
            data(DType::F16, &[3, 4, 6], 2),
        ];
        let largest = |t: &Tensor| t.to_f64_vec().iter().fold(0f64, |m, v| m.max(v.abs()));
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = p.eval(&refs).unwrap();
        assert_eq!(out.len(), 4);
        let tys: Vec<&TensorType> = inputs.iter().map(|_| &t).collect();
        let types: Vec<TensorType> = out.iter().map(Tensor::ty).collect();
        assert_eq!(p.infer(&tys).unwrap(), types);
        assert_eq!(types[2], ty(DType::F32, &[]));
        assert_eq!(out[2].to_f64_vec(), [largest(&out[0])]);
        assert_eq!(out[3].to_f64_vec(), [largest(&inputs[1])]);
        assert!(largest(&out[0]) > 0.5, "the test measures something");
        let back = reparse(&p).unwrap();
        assert_eq!(back.downcast_ref::<FusedElementwise>(), Some(&p));
        // A NaN in dy makes the gradient's amax NaN.
        let mut dy = inputs[1].to_f64_vec();
        dy[7] = f64::NAN;
        inputs[1] = Tensor::from_f64(DType::F16, vec![3, 4, 6], &dy).unwrap();
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = p.eval(&refs).unwrap();
        assert!(out[2].to_f64_vec()[0].is_nan() && out[3].to_f64_vec()[0].is_nan());
        // A broadcast input has no amax.
        let bias = bias_relu_cast();
        let e = bias.with_amaxes(vec![1]).unwrap_err();
        assert!(e.contains("amax of v1 (f32[6])"), "{e}");
    }

    /// A program whose outputs nothing reads stores only its column sums: the same
    /// sums, bit for bit, from a kernel that writes nothing else; it round-trips, and
    /// one with neither outputs nor sums is refused.
    #[test]
    fn a_program_may_store_its_column_sums_alone() {
        // x f16 [3, 4, 6]: x as f32, its square; the sums of both (batch statistics).
        let (h, f) = (ty(DType::F16, &[3, 4, 6]), ty(DType::F32, &[3, 4, 6]));
        let with_square = FusedElementwise::new(
            vec![
                input(0, h),
                apply(ElementOp::Cast(DType::F32), &[0], f.clone()),
                apply(ElementOp::Binary(BinaryKind::Mul), &[1, 1], f),
            ],
            vec![2],
        )
        .unwrap()
        .with_column_sums(vec![1, 2])
        .unwrap();
        let sums_alone = with_square.retain_outputs(|_| false).unwrap();
        assert!(sums_alone.outputs().is_empty());
        assert_eq!(sums_alone.domain_len(), 72);
        let x = data(DType::F16, &[3, 4, 6], 3);
        let all = with_square.eval(&[&x]).unwrap();
        let sums = sums_alone.eval(&[&x]).unwrap();
        assert_eq!(sums.len(), 2);
        assert!(bitwise_equal(&sums[0], &all[1]) && bitwise_equal(&sums[1], &all[2]));
        assert_eq!(
            sums_alone.infer(&[&x.ty()]).unwrap(),
            vec![ty(DType::F32, &[6]), ty(DType::F32, &[6])]
        );
        let back = reparse(&sums_alone).unwrap();
        assert_eq!(back.downcast_ref::<FusedElementwise>(), Some(&sums_alone));
        let e = bias_relu_cast().retain_outputs(|_| false).unwrap_err();
        assert!(
            e.contains("no outputs (and no column sums or amaxes)"),
            "{e}"
        );
        // Keeping the second output of two renumbers nothing but the outputs.
        let second = bias_relu_cast().retain_outputs(|o| o == 1).unwrap();
        assert_eq!(second.outputs(), &[3]);
    }

    #[test]
    fn program_text_is_readable_and_round_trips() {
        let p = bias_relu_cast();
        assert_eq!(
            p.to_string(),
            "v0 = in0: f32[4, 6]; v1 = in1: f32[6]; v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[4, 6]; \
             v3 = Relu(v2): f32[4, 6]; v4 = Cast<to=f16>(v3): f16[4, 6]"
        );
        let back = reparse(&p).unwrap();
        assert_eq!(back.downcast_ref::<FusedElementwise>(), Some(&p));

        // Ops with attrs of every kind: bool, float, int, dtype.
        let t = ty(DType::F64, &[3]);
        let q = FusedElementwise::new(
            vec![
                input(0, t.clone()),
                input(1, t.clone()),
                apply(
                    ElementOp::Unary(UnaryKind::Gelu { approximate: true }),
                    &[0],
                    t.clone(),
                ),
                apply(
                    ElementOp::Unary(UnaryKind::LeakyRelu { alpha: 0.125 }),
                    &[2],
                    t.clone(),
                ),
                apply(
                    ElementOp::UnaryGrad(UnaryKind::Gelu { approximate: false }),
                    &[0, 3],
                    t.clone(),
                ),
                apply(
                    ElementOp::BinaryGrad(BinaryKind::Pow, 1),
                    &[0, 1, 4],
                    t.clone(),
                ),
                apply(ElementOp::Cast(DType::BF16), &[5], ty(DType::BF16, &[3])),
            ],
            vec![6],
        )
        .unwrap();
        let text = q.to_string();
        assert!(text.contains("LeakyRelu<alpha=0.125>(v2)"), "{text}");
        assert!(
            text.contains("BinaryGrad<kind=Pow, wrt=1>(v0, v1, v4)"),
            "{text}"
        );
        let back = reparse(&q).unwrap();
        assert_eq!(back.downcast_ref::<FusedElementwise>(), Some(&q));
        assert_eq!(back.attrs(), q.attrs());
    }

    #[test]
    fn eval_equals_the_unfused_ops_bias_relu_cast_two_outputs() {
        let p = bias_relu_cast();
        let inputs = [data(DType::F32, &[4, 6], 1), data(DType::F32, &[6], 2)];
        check_against_unfused(&p, &inputs);
        let out = p.eval(&[&inputs[0], &inputs[1]]).unwrap();
        assert_eq!(out[0].dtype(), DType::F16);
        assert_eq!(out[1].dtype(), DType::F32);
        assert!(out[1].to_f64_vec().iter().all(|&v| v >= 0.0));
    }

    /// An f16 chain whose intermediate roundings change the result: the fused node
    /// rounds each value to f16 as the unfused ops stored it.
    #[test]
    fn eval_rounds_every_intermediate_to_its_dtype() {
        let (h, s) = (ty(DType::F16, &[64]), ty(DType::F16, &[]));
        let p = FusedElementwise::new(
            vec![
                input(0, ty(DType::F32, &[64])),
                input(1, s),
                apply(ElementOp::Cast(DType::F16), &[0], h.clone()),
                apply(ElementOp::Binary(BinaryKind::Mul), &[2, 1], h.clone()),
                apply(ElementOp::Unary(UnaryKind::Tanh), &[3], h.clone()),
                apply(ElementOp::Binary(BinaryKind::Add), &[4, 2], h.clone()),
                apply(ElementOp::Cast(DType::F32), &[5], ty(DType::F32, &[64])),
            ],
            vec![6],
        )
        .unwrap();
        let inputs = [
            data(DType::F32, &[64], 3),
            Tensor::scalar(DType::F16, 1.0 / 3.0),
        ];
        check_against_unfused(&p, &inputs);
        // The same arithmetic in f32 throughout gives other values: rounding matters here.
        let x = inputs[0].to_f32_vec();
        let scale = inputs[1].to_f32_vec()[0];
        let fused = p.eval(&[&inputs[0], &inputs[1]]).unwrap()[0].to_f32_vec();
        let differs = x
            .iter()
            .zip(&fused)
            .any(|(&x, &y)| ((x * scale).tanh() + x) != y);
        assert!(differs, "the test data do not exercise f16 rounding");
    }

    #[test]
    fn eval_broadcasts_inputs_numpy_style() {
        let t = ty(DType::F32, &[4, 5]);
        let p = FusedElementwise::new(
            vec![
                input(0, t.clone()),
                input(1, ty(DType::F32, &[5])),
                input(2, ty(DType::F32, &[4, 1])),
                input(3, ty(DType::F32, &[1, 1, 1])),
                apply(ElementOp::Binary(BinaryKind::Sub), &[1, 0], t.clone()),
                apply(ElementOp::Binary(BinaryKind::Mul), &[4, 2], t.clone()),
                apply(
                    ElementOp::Binary(BinaryKind::Maximum),
                    &[5, 3],
                    ty(DType::F32, &[1, 4, 5]),
                ),
                apply(
                    ElementOp::BinaryGrad(BinaryKind::Div, 1),
                    &[1, 2, 5],
                    t.clone(),
                ),
            ],
            vec![6, 7],
        )
        .unwrap();
        let inputs = [
            data(DType::F32, &[4, 5], 4),
            data(DType::F32, &[5], 5),
            data(DType::F32, &[4, 1], 6),
            data(DType::F32, &[1, 1, 1], 7),
        ];
        check_against_unfused(&p, &inputs);
    }

    #[test]
    fn eval_bias_add_nchw_and_nhwc() {
        for (format, shape, c) in [
            (DataFormat::Nchw, [2, 3, 4, 5], 3),
            (DataFormat::Nhwc, [2, 3, 4, 5], 5),
        ] {
            let t = ty(DType::BF16, &shape);
            let p = FusedElementwise::new(
                vec![
                    input(0, t.clone()),
                    input(1, ty(DType::BF16, &[c])),
                    apply(ElementOp::BiasAdd(format), &[0, 1], t.clone()),
                    apply(ElementOp::Unary(UnaryKind::Sigmoid), &[2], t.clone()),
                    apply(ElementOp::UnaryGrad(UnaryKind::Relu), &[2, 3], t),
                ],
                vec![4],
            )
            .unwrap();
            let inputs = [data(DType::BF16, &shape, 8), data(DType::BF16, &[c], 9)];
            check_against_unfused(&p, &inputs);
        }
    }

    #[test]
    fn eval_f64_casts_round_once() {
        let t = ty(DType::F64, &[32]);
        let p = FusedElementwise::new(
            vec![
                input(0, t.clone()),
                apply(ElementOp::Unary(UnaryKind::Exp), &[0], t),
                apply(ElementOp::Cast(DType::F16), &[1], ty(DType::F16, &[32])),
                apply(
                    ElementOp::Unary(UnaryKind::Softplus),
                    &[2],
                    ty(DType::F16, &[32]),
                ),
            ],
            vec![3, 2],
        )
        .unwrap();
        check_against_unfused(&p, &[data(DType::F64, &[32], 10)]);
    }

    #[test]
    fn infer_checks_recorded_types_and_element_counts() {
        let p = bias_relu_cast();
        let x = ty(DType::F32, &[4, 6]);
        assert!(p.infer(&[&x, &ty(DType::F32, &[6])]).is_ok());
        let e = p.infer(&[&x, &ty(DType::F32, &[5])]).unwrap_err();
        assert!(e.contains("v1 is recorded as f32[6]"), "{e}");
        let e = p
            .infer(&[&x.with_dtype(DType::F16), &ty(DType::F32, &[6])])
            .unwrap_err();
        assert!(e.contains("v0"), "{e}");
        // A value with fewer elements than the outputs cannot be computed per element.
        let e = parse_text(
            "v0 = in0: f32[4]; v1 = Relu(v0): f32[4]; v2 = in1: f32[2, 4]; v3 = Add(v1, v2): f32[2, 4]",
            vec![3],
        )
        .unwrap()
        .infer(&[&ty(DType::F32, &[4]), &ty(DType::F32, &[2, 4])])
        .unwrap_err();
        assert!(e.contains("v1") && e.contains("8 elements"), "{e}");
    }

    #[test]
    fn bad_program_text_is_a_clear_error() {
        let cases = [
            (
                "v0 = in0: f32[2]; v1 = Frob(v0): f32[2]",
                "unknown op 'Frob'",
            ),
            (
                "v0 = in0: f32[2]; v1 = MatMul(v0, v0): f32[2]",
                "not an elementwise op",
            ),
            ("v0 = in0: f32[2]; v1 = Relu(v2): f32[2]", "v1 reads v2"),
            (
                "v0 = in0: f32[2]; v1 = Relu(v0): f33[2]",
                "unknown dtype 'f33'",
            ),
            ("v0 = in0: f32[2]; v1 = Relu(v0): f32[2", "bad type"),
            (
                "v0 = in0: f32[2]; v2 = Relu(v0): f32[2]",
                "expected 'v1 = ...'",
            ),
            ("v0 = in0: f32[2]; v1 = Relu(v0)", "missing ': type'"),
            (
                "v0 = in0: f32[2]; v1 = Relu(x0): f32[2]",
                "bad operand 'x0'",
            ),
            (
                "v0 = in0: f32[2]; v1 = Add(v0): f32[2]",
                "Add takes 2 operands",
            ),
            (
                "v0 = in0: f32[2]; v1 = Cast<to=f16, x=1>(v0): f16[2]",
                "unknown attr 'x'",
            ),
            (
                "v0 = in0: f32[2]; v1 = Cast<to>(v0): f16[2]",
                "attr 'to' is not key=value",
            ),
            ("v0 = in1: f32[2]", "v0 reads in1"),
            ("", "expected 'v0 = ...'"),
        ];
        for (text, want) in cases {
            let e = parse_text(text, vec![0]).unwrap_err();
            assert!(e.contains(want), "`{text}`: {e}");
            assert!(e.contains("attr 'program'"), "`{text}`: {e}");
        }
        let e = parse_text("v0 = in0: f32[2]", vec![1]).unwrap_err();
        assert!(e.contains("output v1 is not defined"), "{e}");
        let e = parse_text("v0 = in0: f32[2]", vec![-1]).unwrap_err();
        assert!(e.contains("attr 'outputs'"), "{e}");
    }

    #[test]
    fn bad_program_in_a_file_names_the_node() {
        let json = r#"{"format": "ampgraph.graph", "version": 1, "nodes": [
            {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [2]}},
            {"name": "fused/relu", "op": "FusedElementwise", "inputs": ["x"],
             "attrs": {"program": "v0 = in0: f32[2]; v1 = Relu(v0: f32[2]", "outputs": [1]}}
        ], "outputs": ["fused/relu"]}"#;
        let e = crate::format::graph_from_bytes(json.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'fused/relu'") && e.contains("statement 1"),
            "{e}"
        );
    }

    #[test]
    fn every_port_is_its_own_fixed_type() {
        let groups = bias_relu_cast().type_groups(2, 2);
        assert_eq!(groups.len(), 4);
        assert!(groups.iter().all(|g| !g.can_be_half));
        assert_eq!(groups[0].outputs, vec![0]);
        assert_eq!(groups[3].inputs, vec![1]);
    }
}
