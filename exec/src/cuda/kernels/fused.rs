//! FusedElementwise: a program of elementwise ops (the `fuse` pass's groups) as one
//! kernel, each value computed in its compute type and rounded as the unfused op
//! stored it, with optional column sums of its values over the leading axes.

use ampgraph_graph::ops::fused::{column_sum_dtype, Expr, Instr, Operand};
use ampgraph_graph::ops::{Dropout, ElementOp, FusedElementwise};
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{
    column_sums_and, column_sums_rows, elementwise, lit, module_multi, streams, vector_len, At,
    Load, Store, Streams,
};
use super::fp8::{amax_declaration, amax_fold, amax_measure, launch_amax};
use super::{
    first, kernel, launch_column_sums, CudaKernel, KernelResult, Lowering, Partials, ProgramSpec,
};
use crate::cuda::device::{Arg, DTensor};

/// A fused program's module: `k(<inputs>, <outputs>, i64 n)`, or with column sums
/// `k_cols_part` or `k_cols_rows` (`<inputs>, <outputs>, AS* part, i64 rows, i64 len,
/// i64 chunk_rows`) and `k_cols_fin`. Its key holds the program's text and its column sums
/// (every dtype and shape the source bakes in).
pub(crate) type Spec = ProgramSpec<FusedElementwise>;

/// The spec of `program`'s module.
pub(super) fn spec(program: &FusedElementwise) -> Spec {
    // The stored values are part of the kernel (one pointer each): two programs of
    // the same instructions storing different values are different modules (RWKV's
    // AMP step had one launched with the other's, one output short).
    let key = format!(
        "fused/Fused {{ program: {program}, outputs: {:?}, column_sums: {:?}, amaxes: {:?} }}",
        program.outputs(),
        program.column_sums(),
        program.amaxes()
    );
    ProgramSpec::new(key, program.clone(), fused)
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(d) = op.downcast_ref::<Dropout>() {
        return Some(lower_alone(ElementOp::Dropout(*d), ins, outs));
    }
    let f = op.downcast_ref::<FusedElementwise>()?;
    Some(Ok(lower_program(f, outs)))
}

/// A node no fusion took as a program of its one instruction: an element op whose
/// CUDA form exists only as an instruction (Dropout) runs alone through the same code.
fn lower_alone(op: ElementOp, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let mut instrs: Vec<Instr> = ins
        .iter()
        .enumerate()
        .map(|(k, ty)| Instr {
            expr: Expr::Input(k),
            ty: ty.clone(),
        })
        .collect();
    instrs.push(Instr {
        expr: Expr::Apply(op, (0..ins.len()).collect()),
        ty: first(outs)?.clone(),
    });
    let program = FusedElementwise::new(instrs, vec![ins.len()])?;
    let types: Vec<&TensorType> = ins.iter().collect();
    program.infer(&types)?;
    Ok(lower_program(&program, outs))
}

fn lower_program(f: &FusedElementwise, outs: &[TensorType]) -> Box<dyn CudaKernel> {
    let spec = spec(f);
    let outs = outs.to_vec();
    let n = f.domain_len();
    let stored_count = f.outputs().len();
    let sum_count = f.column_sums().len();
    let summed = sum_count > 0;
    // Column sums of the domain's rows (its last axis).
    let len = outs
        .first()
        .and_then(|t| t.shape.last().copied())
        .unwrap_or(1)
        .max(1);
    let v = fused_vector(f);
    let program = f.clone();
    kernel(move |c, inputs| {
        // The amaxes come last, zeroed for the kernel's atomics.
        let (plain, folded) = outs.split_at((stored_count + sum_count).min(outs.len()));
        let mut outputs = c.alloc_all(plain)?;
        for ty in folded {
            outputs.push(c.alloc_zeroed(ty)?);
        }
        let (stored, rest) = outputs.split_at(stored_count.min(outputs.len()));
        let (sums, amaxes) = rest.split_at(sum_count.min(rest.len()));
        let mut args: Vec<Arg> = inputs.iter().map(DTensor::arg).collect();
        args.extend(stored.iter().map(DTensor::arg));
        args.extend(amaxes.iter().map(DTensor::arg));
        if !summed {
            args.push(Arg::I64(n as i64));
            if amaxes.is_empty() {
                c.launch_elementwise(&spec, n, &args)?;
            } else if n > 0 {
                launch_amax(c, &spec, n, &args)?;
            }
        } else {
            let part = if len % v == 0 && streams_aligned(&program, inputs, stored) {
                Partials::Rows(v)
            } else {
                Partials::Tiles
            };
            let outs: Vec<(&DTensor, f64)> = sums.iter().map(|s| (s, 1.0)).collect();
            launch_column_sums(c, &spec, &args, (n / len, len), &outs, part)?;
        }
        Ok(outputs)
    })
}

/// Whether the tensors a fused program's vector kernels move in 16-byte words are
/// aligned to them: its streamed inputs (`fused_streamed_inputs`) and `outputs`.
pub(super) fn streams_aligned<'a>(
    p: &FusedElementwise,
    inputs: &'a [DTensor],
    outputs: impl IntoIterator<Item = &'a DTensor>,
) -> bool {
    let streamed = fused_streamed_inputs(p);
    (streamed.iter().map(|&k| &inputs[k]).chain(outputs)).all(|t| t.ptr() % 16 == 0)
}

/// `r_<dtype>(x)`: a compute value (float or double) rounded to a float dtype, in
/// that dtype's compute type. From double, 16-bit types round once, as the CPU does.
pub(crate) const ROUNDING: &str = r#"
__device__ __forceinline__ float r_f32(float x) { return x; }
__device__ __forceinline__ float r_f32(double x) { return (float)x; }
__device__ __forceinline__ float r_f16(float x) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float r_f16(double x) { return __half2float(__double2half(x)); }
__device__ __forceinline__ float r_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float r_bf16(double x) { return __bfloat162float(__double2bfloat16(x)); }
__device__ __forceinline__ double r_f64(float x) { return (double)x; }
__device__ __forceinline__ double r_f64(double x) { return x; }
"#;

/// The compute type of a float dtype.
fn compute_type(d: DType) -> &'static str {
    if d == DType::F64 {
        "double"
    } else {
        "float"
    }
}

/// Index into a `view`-shaped input of element `var` (`i`, say) of the row-major
/// shape `into` (NumPy broadcasting; shapes are the program's, baked in).
fn broadcast_index(view: &[usize], into: &[usize], var: &str) -> String {
    let rank = into.len();
    let offset = rank - view.len().min(rank);
    let view_strides = strides(view);
    let terms: Vec<String> = (offset..rank)
        .filter(|&d| view[d - offset] != 1)
        .map(|d| {
            let inner: usize = into[d + 1..].iter().product();
            format!(
                "({var} / {inner} % {}) * {}",
                into[d],
                view_strides[d - offset]
            )
        })
        .collect();
    if terms.is_empty() {
        "0".into()
    } else {
        terms.join(" + ")
    }
}

/// A fused program as kernel source fragments: the module's dtypes (`I<k>` per input,
/// `O<o>` per output), the parameters (inputs, then outputs; `__restrict__`: a node's
/// output never shares memory with its inputs, and the column-sum kernels' row loop
/// may then load the next rows before storing this one), the body computing each
/// value `vj` of element `i` (in its compute type, rounded to its dtype as the unfused
/// op stored it; inputs with fewer elements read at their broadcast index), and the
/// streamed inputs (full-size, and broadcast along the last axis: [`row_broadcast`])
/// and the outputs.
pub(crate) struct FusedParts {
    pub(super) types: Vec<(String, DType)>,
    pub(super) params: Vec<String>,
    pub(super) body: String,
    streamed: Vec<StreamedInput>,
    /// (storer, pointer, value name, stored bytes) of each output.
    outputs: Vec<(String, String, String, usize)>,
}

/// An input a fused kernel streams: bound as `ty name = loader(ptr, ...)` at `i`
/// itself (`rows: None`) or at its broadcast index along the last axis (`rows`: the
/// index at `i` and at `i0`).
struct StreamedInput {
    ty: &'static str,
    name: String,
    loader: String,
    ptr: String,
    bytes: usize,
    rows: Option<(String, String)>,
}

/// How input value `j` (of fewer elements than the domain) is broadcast, `(view,
/// into)`, when every use reads it at the same index and that index moves with the
/// element along the domain's last axis, whose length is a multiple of `v`. A vector
/// of `v` elements at `i0` then reads `v` consecutive values of the input, at most 16
/// bytes (a 16-byte aligned tensor holds such vectors aligned).
fn row_broadcast(p: &FusedElementwise, j: usize, v: usize) -> Option<(Vec<usize>, Vec<usize>)> {
    if p.instrs()[j].ty.dtype.size_bytes() * v > 16 {
        return None;
    }
    let mut uses = p
        .instrs()
        .iter()
        .enumerate()
        .flat_map(|(k, ins)| match &ins.expr {
            Expr::Apply(_, args) => (0..args.len())
                .filter(|&slot| args[slot] == j)
                .map(|slot| p.operand(k, slot))
                .collect(),
            Expr::Input(_) => Vec::new(),
        });
    let first = uses.next()?;
    if uses.any(|u| u != first) {
        return None;
    }
    let Operand::Broadcast { view, into, .. } = first else {
        return None;
    };
    let last = *into.last()?;
    (view.last() == Some(&last) && last % v == 0).then_some((view, into))
}

/// The inputs (numbers `k` of `in<k>`) a fused program's vector loops load in
/// vectors: those of the domain's size and those [`row_broadcast`] reads. A launch
/// choosing a vector kernel checks their alignment.
fn fused_streamed_inputs(p: &FusedElementwise) -> Vec<usize> {
    let (n, v) = (p.domain_len(), fused_vector(p));
    p.instrs()
        .iter()
        .enumerate()
        .filter_map(|(j, ins)| match ins.expr {
            Expr::Input(k)
                if ins.ty.checked_len() == Some(n) || row_broadcast(p, j, v).is_some() =>
            {
                Some(k)
            }
            _ => None,
        })
        .collect()
}

impl FusedParts {
    pub(super) fn new(p: &FusedElementwise) -> FusedParts {
        FusedParts::leaving_unrounded(p, None)
    }

    /// The parts with value `unrounded` (if any) left in its compute type, for a
    /// kernel that rounds it itself (two at a time: the FP8 casts).
    pub(super) fn leaving_unrounded(p: &FusedElementwise, unrounded: Option<usize>) -> FusedParts {
        let instrs = p.instrs();
        let (n, v) = (p.domain_len(), fused_vector(p));
        let mut parts = FusedParts {
            types: Vec::new(),
            params: Vec::new(),
            body: String::new(),
            streamed: Vec::new(),
            outputs: Vec::new(),
        };
        for ins in instrs {
            if let Expr::Input(k) = ins.expr {
                parts.types.push((format!("I{k}"), ins.ty.dtype));
                parts
                    .params
                    .push(format!("const TI{k}* __restrict__ in{k}"));
            }
        }
        for (o, &v) in p.outputs().iter().enumerate() {
            let dtype = instrs[v].ty.dtype;
            parts.types.push((format!("O{o}"), dtype));
            parts.params.push(format!("TO{o}* __restrict__ out{o}"));
            parts.outputs.push((
                format!("stO{o}"),
                format!("out{o}"),
                format!("v{v}"),
                dtype.size_bytes(),
            ));
        }
        let mut bound = vec![false; instrs.len()];
        for (j, ins) in instrs.iter().enumerate() {
            let ty = compute_type(ins.ty.dtype);
            let (op, args) = match &ins.expr {
                Expr::Input(k) => {
                    let rows = row_broadcast(p, j, v).map(|(view, into)| {
                        (
                            broadcast_index(&view, &into, "i"),
                            broadcast_index(&view, &into, "i0"),
                        )
                    });
                    // Other broadcast inputs are read where used.
                    if ins.ty.checked_len() == Some(n) || rows.is_some() {
                        bound[j] = true;
                        parts.streamed.push(StreamedInput {
                            ty,
                            name: format!("v{j}"),
                            loader: format!("ldI{k}"),
                            ptr: format!("in{k}"),
                            bytes: ins.ty.dtype.size_bytes(),
                            rows,
                        });
                    }
                    continue;
                }
                Expr::Apply(op, args) => (*op, args),
            };
            let operand = |slot: usize| match p.operand(j, slot) {
                Operand::Broadcast { input, view, into } if !bound[args[slot]] => {
                    format!(
                        "ldI{input}(in{input}, {})",
                        broadcast_index(&view, &into, "i")
                    )
                }
                _ => format!("v{}", args[slot]),
            };
            let names = ["a", "b", "c"];
            let mut block = format!("typedef {} C;", compute_type(instrs[args[0]].ty.dtype));
            for (slot, name) in names.iter().enumerate().take(args.len()) {
                block.push_str(&format!(" C {name} = {};", operand(slot)));
            }
            let compute = match op {
                ElementOp::Unary(kind) => format!("C x = a; {}", kind.cuda_expr()),
                ElementOp::UnaryGrad(kind) => format!(
                    "C x = a; {}\n      C y = d == (C)0 ? d : d * b;",
                    kind.cuda_derivative()
                ),
                ElementOp::Binary(kind) => format!("C y = {};", kind.cuda_expr()),
                ElementOp::BinaryGrad(kind, wrt) => {
                    format!("C g = c; C y = {};", kind.cuda_grad_expr(wrt))
                }
                ElementOp::BiasAdd(_) => "C y = a + b;".into(),
                ElementOp::Cast(_) => "C y = a;".into(),
                ElementOp::Dropout(d) => format!(
                    "C y = m_dropout_keeps({}ull, b, i, {}ull) ? a * (C){} : (C)0;",
                    d.seed,
                    d.threshold(),
                    lit(d.scale())
                ),
            };
            let stored = match unrounded == Some(j) {
                true => "y".to_string(),
                false => format!("r_{}(y)", ins.ty.dtype),
            };
            parts.body.push_str(&format!(
                "    {ty} v{j};\n    {{ {block}\n      {compute}\n      v{j} = {stored}; }}\n"
            ));
        }
        parts
    }

    pub(super) fn loads(&self) -> Vec<Load<'_>> {
        self.streamed
            .iter()
            .map(|s| Load {
                ty: s.ty,
                name: &s.name,
                loader: &s.loader,
                ptr: &s.ptr,
                bytes: s.bytes,
                at: match &s.rows {
                    None => At::Own,
                    Some((at_i, at_i0)) => At::Rows(at_i, at_i0),
                },
            })
            .collect()
    }

    fn stores(&self) -> Vec<Store<'_>> {
        self.outputs
            .iter()
            .map(|(storer, ptr, value, bytes)| Store {
                storer,
                ptr,
                bytes: *bytes,
                value,
            })
            .collect()
    }
}

/// The elements per vector of a fused program's column-sum kernel `k_cols_rows`
/// (16 bytes of the widest tensor it streams: its full-size inputs and its outputs):
/// the launch takes it for rows whose length is a multiple of it. Read from the
/// program's types, not its generated source: the launch asks at every run.
pub(crate) fn fused_vector(p: &FusedElementwise) -> usize {
    let (instrs, n) = (p.instrs(), p.domain_len());
    let inputs = instrs
        .iter()
        .filter(|ins| matches!(ins.expr, Expr::Input(_)) && ins.ty.checked_len() == Some(n));
    let outputs = p.outputs().iter().map(|&v| &instrs[v]);
    let widest = inputs
        .chain(outputs)
        .map(|ins| ins.ty.dtype.size_bytes())
        .max();
    vector_len(widest.unwrap_or(1))
}

/// A program's amaxes as kernel fragments: the pointer parameters (after the
/// outputs'), each thread's maxima declared, measured after the body computes an
/// element (each value as stored, rounded to its dtype) and folded into the outputs
/// at the kernel's end ([`amax_fold`]).
struct Amaxes {
    params: Vec<String>,
    decl: String,
    measure: String,
    fold: String,
}

impl Amaxes {
    fn new(p: &FusedElementwise) -> Amaxes {
        let mut a = Amaxes {
            params: Vec::new(),
            decl: String::new(),
            measure: String::new(),
            fold: String::new(),
        };
        for (k, v) in p.amaxes().iter().enumerate() {
            a.params.push(format!("unsigned int* amax{k}"));
            a.decl.push_str(&amax_declaration(&format!("m{k}")));
            a.measure.push_str(&format!(
                "    {}\n",
                amax_measure(&format!("m{k}"), &format!("(float)v{v}"))
            ));
            a.fold
                .push_str(&amax_fold(&format!("m{k}"), &format!("amax{k}")));
        }
        a
    }
}

/// The kernels of a fused program. Without column sums, `k` over the elements `i` of
/// its domain ([`elementwise`]: the full-size inputs streamed in vectors); arguments:
/// the inputs, the outputs, then `n`. With column sums, [`column_sums`]' kernels over
/// the domain as `[rows, len]` rows of its last axis: each computes and stores the
/// outputs of the elements it reads and adds up the summed values as it goes (the
/// sums in `S`, f32 or f64), and [`column_sums_rows`]' `k_cols_rows` does the same
/// moving vectors of [`fused_vector`] elements of a row (aligned rows whose length is
/// a multiple of it). Its row loop is not unrolled: with 16-byte vectors a row is a
/// long enough stretch of loads and arithmetic, and unrolling only costs registers and
/// so resident blocks.
pub(super) fn fused(p: &FusedElementwise) -> String {
    let parts = FusedParts::new(p);
    let (loads, stores) = (parts.loads(), parts.stores());
    let amaxes = Amaxes::new(p);
    let params = (parts.params.iter().chain(&amaxes.params))
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    let body = format!("{}{}", parts.body, amaxes.measure);
    let mut types: Vec<(&str, DType)> = parts.types.iter().map(|(s, d)| (s.as_str(), *d)).collect();
    let Some(&first_sum) = p.column_sums().first() else {
        return module_multi(
            &types,
            &format!(
                "{ROUNDING}extern \"C\" __global__ void k({params}, i64 n) {{\n{}{}{}}}\n",
                amaxes.decl,
                elementwise(&loads, &body, &stores),
                amaxes.fold
            ),
        );
    };
    types.push(("S", column_sum_dtype(p.instrs()[first_sum].ty.dtype)));
    let sums: Vec<String> = p
        .column_sums()
        .iter()
        .map(|v| format!("(AS)v{v}"))
        .collect();
    let Streams {
        v,
        fetch,
        bind_vec,
        put_vec,
        flush,
        bind_one,
        put_one,
        ..
    } = streams(&loads, &stores);
    let adds: String = (sums.iter().enumerate())
        .map(|(k, term)| format!("acc{k}[u] += {term}; "))
        .collect();
    let row = format!(
        "{fetch}#pragma unroll\n\
         for (int u = 0; u < V; ++u) {{ const i64 i = i0 + u; {bind_vec}\n{body}\n{put_vec} {adds}}}\n\
         {flush}"
    );
    let row_setup = format!("const i64 i = at; {bind_one}\n{body}\n{put_one}");
    let terms: Vec<&str> = sums.iter().map(String::as_str).collect();
    let folds = (&amaxes.decl[..], &amaxes.fold[..]);
    module_multi(
        &types,
        &format!(
            "{ROUNDING}{}{}",
            column_sums_and(&params, &row_setup, &terms, "S", folds),
            column_sums_rows(&params, (v, 1), &row, (sums.len(), "S"), folds),
        ),
    )
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use ampgraph_graph::attrs::{AttrMap, AttrReader, AttrValue};
    use ampgraph_graph::ops::parse_op;

    /// A FusedElementwise of a program's text and its stored values.
    pub(in crate::cuda::kernels) fn program(text: &str, outputs: Vec<i64>) -> FusedElementwise {
        let mut attrs = AttrMap::new();
        attrs.insert("program".into(), AttrValue::Str(text.into()));
        attrs.insert("outputs".into(), AttrValue::Ints(outputs));
        let op = parse_op("FusedElementwise", AttrReader::new(attrs)).unwrap();
        op.downcast_ref::<FusedElementwise>().unwrap().clone()
    }

    /// Programs of the same instructions that store different values are different
    /// modules: their keys and sources (the store parameters) differ.
    #[test]
    fn a_programs_stored_values_are_in_its_key() {
        use super::super::KernelSpec;
        let text = "v0 = in0: f16[2, 64]; v1 = Cast<to=f32>(v0): f32[2, 64]; \
                    v2 = in1: f32[2, 64]; v3 = Mul(v2, v1): f32[2, 64]";
        let (one, two) = (program(text, vec![3]), program(text, vec![1, 3]));
        assert_ne!(spec(&one).key(), spec(&two).key());
        assert_ne!(fused(&one), fused(&two));
        assert_eq!(spec(&one).key(), spec(&program(text, vec![3])).key());
    }

    #[test]
    fn broadcast_index_follows_numpy_rules() {
        assert_eq!(broadcast_index(&[6], &[4, 6], "i"), "(i / 1 % 6) * 1");
        assert_eq!(broadcast_index(&[4, 1], &[4, 6], "i"), "(i / 6 % 4) * 1");
        assert_eq!(
            broadcast_index(&[3, 1, 1], &[2, 3, 4, 5], "i"),
            "(i / 20 % 3) * 1"
        );
        assert_eq!(broadcast_index(&[], &[4, 6], "i"), "0");
        assert_eq!(broadcast_index(&[1, 1], &[4, 6], "i"), "0");
    }

    /// The launch's vector width is the one the column-sum kernel was generated with:
    /// f16 streams move 8, an f32 input or output 4, an f64 one 2; a broadcast input
    /// does not count.
    #[test]
    fn fused_vector_is_the_generated_kernels() {
        for (text, outputs, want) in [
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f32[16]; v2 = Cast<to=f32>(v0): f32[8, 16]; \
                 v3 = BiasAdd<data_format=NHWC>(v2, v1): f32[8, 16]; v4 = Cast<to=f16>(v3): f16[8, 16]",
                vec![4],
                8,
            ),
            (
                "v0 = in0: f32[8, 16]; v1 = Cast<to=f16>(v0): f16[8, 16]",
                vec![1],
                4,
            ),
            ("v0 = in0: f16[8, 16]; v1 = Cast<to=f64>(v0): f64[8, 16]", vec![1], 2),
        ] {
            let p = program(text, outputs).with_column_sums(vec![0]).unwrap();
            assert_eq!(fused_vector(&p), want, "{text}");
            assert!(
                fused(&p).contains(&format!("constexpr int V = {want};")),
                "{text}"
            );
        }
    }

    /// Broadcast inputs move in vectors where every use reads them along the last
    /// axis in whole vectors of at most 16 bytes; the launch checks those inputs'
    /// alignment with the full-size ones'.
    #[test]
    fn row_broadcasts_are_streamed_in_vectors() {
        for (text, want) in [
            // f16 vectors of 8: a [16] row bias streams, a [8, 1] column does not.
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f16[16]; v2 = Add(v0, v1): f16[8, 16]; \
                 v3 = in2: f16[8, 1]; v4 = Mul(v2, v3): f16[8, 16]",
                vec![0, 1],
            ),
            // An f32 row under f16 vectors of 8 would be 32 bytes a vector.
            (
                "v0 = in0: f16[8, 16]; v1 = in1: f32[16]; v2 = Cast<to=f32>(v0): f32[8, 16]; \
                 v3 = Add(v2, v1): f32[8, 16]; v4 = Cast<to=f16>(v3): f16[8, 16]",
                vec![0],
            ),
            // Rows of 12 are not whole vectors of 8.
            (
                "v0 = in0: f16[8, 12]; v1 = in1: f16[12]; v2 = Add(v0, v1): f16[8, 12]",
                vec![0],
            ),
            // Read at two different indices: along the rows and along the channels.
            (
                "v0 = in0: f32[2, 4, 4]; v1 = in1: f32[4]; v2 = Add(v0, v1): f32[2, 4, 4]; \
                 v3 = BiasAdd<data_format=NCHW>(v2, v1): f32[2, 4, 4]",
                vec![0],
            ),
        ] {
            // The last value is the output.
            let last = text.matches("; ").count() as i64;
            let p = program(text, vec![last]);
            assert_eq!(fused_streamed_inputs(&p), want, "{text}");
            let source = fused(&p);
            for k in &want[1..] {
                assert!(source.contains(&format!("s_in{k}.v")), "{text}");
            }
        }
    }

    #[test]
    fn fused_source_rounds_each_value_and_stores_each_output() {
        let p = program(
            "v0 = in0: f32[4, 6]; v1 = in1: f32[6]; v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[4, 6]; \
             v3 = Relu(v2): f32[4, 6]; v4 = Cast<to=f16>(v3): f16[4, 6]; v5 = in2: f16[]; \
             v6 = Mul(v4, v5): f16[4, 6]; v7 = UnaryGrad<kind=Tanh>(v6, v4): f16[4, 6]",
            vec![3, 7],
        );
        let src = fused(&p);
        for want in [
            "void k(const TI0* __restrict__ in0, const TI1* __restrict__ in1, const TI2* __restrict__ in2, TO0* __restrict__ out0, TO1* __restrict__ out1, i64 n)",
            "s_in0 = *(const VEC_T(in0, V)*)(in0 + i0);",
            "float v0 = ldI0(s_in0.v, u);",
            "float v0 = ldI0(in0, i);",
            "C b = ldI1(in1, (i / 1 % 6) * 1);",
            "v2 = r_f32(y);",
            "m_max(x, (C)0)",
            "v4 = r_f16(y);",
            "C b = ldI2(in2, 0);",
            "C y = d == (C)0 ? d : d * b;",
            "stO0(out0, i, v3);",
            "stO1(out1, i, v7);",
            "stO1(s_out1.v, u, v7);",
            "*(VEC_T(out1, V)*)(out1 + i0) = s_out1;",
            // 16 bytes of f32 at a time.
            "constexpr int V = 4;",
        ] {
            assert!(src.contains(want), "missing `{want}` in\n{src}");
        }
        // Broadcast inputs are not loaded at the domain index.
        assert!(!src.contains("ldI1(in1, i)"), "{src}");
    }
}
