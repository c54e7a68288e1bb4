//! FusedElementwise on CUDA against the CPU interpreter: f32 and f16 programs with
//! casts, biases (NHWC and NCHW), a broadcast scalar and row, gradients, several
//! outputs. Skips (printing why) without CUDA.

mod common;

use ampgraph_exec::{CpuExecutor, CudaExecutor, Executor, Feeds};
use ampgraph_graph::attrs::{AttrMap, AttrReader, AttrValue};
use ampgraph_graph::ops::parse_op;
use ampgraph_graph::{DType, Graph, Port, Tensor};
use common::gpu;

/// Deterministic values in [lo, hi).
fn values(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let z = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
            lo + (hi - lo) * ((z >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// One unit in the last place of the dtype, relative: GPU and CPU transcendental
/// functions may differ by an ulp of the compute type, which can flip one rounding.
fn tol(d: DType) -> f64 {
    match d {
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        DType::F64 => 1e-11,
        _ => 1e-5,
    }
}

/// Builds a fused node over placeholders of the given types from its program text,
/// runs it on both executors and compares every output.
fn check(gpu: &mut CudaExecutor, program: &str, outputs: &[i64], inputs: &[(DType, &[usize])]) {
    check_sums(gpu, program, outputs, &[], inputs);
}

/// [`check`] for a program that also outputs the column sums of `sums`: the sums
/// are compared within the accumulation order's rounding (f32: rows of ulps).
fn check_sums(
    gpu: &mut CudaExecutor,
    program: &str,
    outputs: &[i64],
    sums: &[i64],
    inputs: &[(DType, &[usize])],
) {
    let mut attrs = AttrMap::new();
    attrs.insert("program".into(), AttrValue::Str(program.into()));
    attrs.insert("outputs".into(), AttrValue::Ints(outputs.to_vec()));
    if !sums.is_empty() {
        attrs.insert("column_sums".into(), AttrValue::Ints(sums.to_vec()));
    }
    let op = parse_op("FusedElementwise", AttrReader::new(attrs)).expect("program parses");
    let mut g = Graph::new();
    let mut feeds = Feeds::new();
    let mut ports = Vec::new();
    for (k, &(dtype, shape)) in inputs.iter().enumerate() {
        let name = format!("in{k}");
        let n = shape.iter().product();
        let t = Tensor::from_f64(dtype, shape.to_vec(), &values(n, k as u64, -3.0, 3.0)).unwrap();
        feeds.insert(name.clone(), t);
        ports.push(g.placeholder(name, dtype, shape.to_vec()).unwrap());
    }
    let id = g
        .add_node("fused", op, &ports)
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    let outs: Vec<Port> = (0..outputs.len() + sums.len())
        .map(|k| Port::new(id, k))
        .collect();
    let cpu = CpuExecutor::new().run(&g, &feeds, &outs).unwrap();
    let dev = gpu
        .run(&g, &feeds, &outs)
        .unwrap_or_else(|e| panic!("{program}: cuda: {e}"));
    for (k, (d, c)) in dev.iter().zip(&cpu).enumerate() {
        assert_eq!(d.ty(), c.ty(), "output {k} of {program}");
        // A sum of r rows: each partial sum may round differently (f32: 2^-24 each).
        let t = if k < outputs.len() {
            tol(c.dtype())
        } else {
            let rows = (g.ty(ports[0]).checked_len().unwrap_or(0) / c.len()) as f64;
            tol(c.dtype()) * rows.sqrt().max(4.0)
        };
        // A sum of a value the program also outputs is held to that output as the
        // device computed it (checked against the CPU above): its elements are
        // 16-bit roundings of an approximate function (the device's GELU), any of
        // which may round the other way than the CPU's, which the sum's own tolerance
        // is not for.
        let summed =
            (k.checked_sub(outputs.len())).and_then(|j| outputs.iter().position(|&o| o == sums[j]));
        let expected = match summed {
            Some(o) => {
                let values = dev[o].to_f64_vec();
                let cols = c.len();
                let mut sum = vec![0.0; cols];
                for (i, v) in values.iter().enumerate() {
                    sum[i % cols] += v;
                }
                sum
            }
            None => c.to_f64_vec(),
        };
        for (i, (a, b)) in d.to_f64_vec().iter().zip(expected).enumerate() {
            let close =
                a == &b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= t * b.abs().max(1.0);
            assert!(
                close,
                "output {k} element {i}: cuda {a} vs cpu {b}\n{program}"
            );
        }
    }
}

#[test]
fn fused_programs_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    // f32 bias + GELU, exported in f32 and as f16 (two outputs, two dtypes).
    check(
        &mut gpu,
        "v0 = in0: f32[64, 48]; v1 = in1: f32[48]; v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[64, 48]; \
         v3 = Gelu<approximate=true>(v2): f32[64, 48]; v4 = Cast<to=f16>(v3): f16[64, 48]",
        &[3, 4],
        &[(DType::F32, &[64, 48]), (DType::F32, &[48])],
    );
    // AMP-style f16 chain: cast in, loss-scale multiply by a broadcast f16 scalar,
    // tanh, cast out, f32 residual add; the f16 tanh is exported too.
    check(
        &mut gpu,
        "v0 = in0: f32[33, 17]; v1 = in1: f16[]; v2 = Cast<to=f16>(v0): f16[33, 17]; \
         v3 = Mul(v2, v1): f16[33, 17]; v4 = Tanh(v3): f16[33, 17]; v5 = Cast<to=f32>(v4): f32[33, 17]; \
         v6 = Add(v5, v0): f32[33, 17]",
        &[6, 4],
        &[(DType::F32, &[33, 17]), (DType::F16, &[])],
    );
    // f16 NCHW bias, Relu and its gradient against a second input.
    check(
        &mut gpu,
        "v0 = in0: f16[2, 3, 5, 7]; v1 = in1: f16[3]; v2 = BiasAdd<data_format=NCHW>(v0, v1): f16[2, 3, 5, 7]; \
         v3 = Relu(v2): f16[2, 3, 5, 7]; v4 = in2: f16[2, 3, 5, 7]; \
         v5 = UnaryGrad<kind=Relu>(v2, v4): f16[2, 3, 5, 7]",
        &[3, 5],
        &[(DType::F16, &[2, 3, 5, 7]), (DType::F16, &[3]), (DType::F16, &[2, 3, 5, 7])],
    );
    // Row and column broadcasts, a binary gradient, a leaky ReLU with an alpha.
    check(
        &mut gpu,
        "v0 = in0: f32[40, 30]; v1 = in1: f32[30]; v2 = in2: f32[40, 1]; v3 = Sub(v1, v0): f32[40, 30]; \
         v4 = Mul(v3, v2): f32[40, 30]; v5 = LeakyRelu<alpha=0.1>(v4): f32[40, 30]; \
         v6 = BinaryGrad<kind=Mul, wrt=1>(v1, v2, v5): f32[40, 30]",
        &[6],
        &[(DType::F32, &[40, 30]), (DType::F32, &[30]), (DType::F32, &[40, 1])],
    );
    // f64 rounded once to f16, then computed in f16.
    check(
        &mut gpu,
        "v0 = in0: f64[1000]; v1 = Exp(v0): f64[1000]; v2 = Cast<to=f16>(v1): f16[1000]; \
         v3 = Sigmoid(v2): f16[1000]",
        &[3, 2],
        &[(DType::F64, &[1000])],
    );
}

#[test]
fn fused_column_sums_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    // The mlp's bias gradient: the f16 GELU gradient summed in f32 over 4096 rows
    // (`k_cols_rows`: rows of 256 halves), and its f16 input summed too.
    let gelu_grad = "v0 = in0: f16[4096, 256]; v1 = in1: f16[4096, 256]; \
                     v2 = UnaryGrad<kind=Gelu, approximate=false>(v0, v1): f16[4096, 256]";
    check_sums(
        &mut gpu,
        gelu_grad,
        &[2],
        &[2, 0],
        &[(DType::F16, &[4096, 256]), (DType::F16, &[4096, 256])],
    );
    // GPT-2's bias gradient at rows of 4800 bf16 (600 words: two column tiles of
    // `k_cols_rows`, the second partly full) over 37 rows (chunks of a few rows).
    check_sums(
        &mut gpu,
        "v0 = in0: bf16[37, 4800]; v1 = in1: bf16[37, 4800]; \
         v2 = UnaryGrad<kind=Gelu, approximate=true>(v0, v1): bf16[37, 4800]",
        &[2],
        &[2],
        &[(DType::BF16, &[37, 4800]), (DType::BF16, &[37, 4800])],
    );
    // Rows of 100: not a multiple of the vector, one element at a time; a rank-3
    // domain summed over its two leading axes; a broadcast bias; f32.
    check_sums(
        &mut gpu,
        "v0 = in0: f32[3, 70, 100]; v1 = in1: f32[100]; v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[3, 70, 100]; \
         v3 = Tanh(v2): f32[3, 70, 100]",
        &[3],
        &[3, 2],
        &[(DType::F32, &[3, 70, 100]), (DType::F32, &[100])],
    );
    // f64 values sum in f64.
    check_sums(
        &mut gpu,
        "v0 = in0: f64[300, 24]; v1 = Exp(v0): f64[300, 24]",
        &[1],
        &[1],
        &[(DType::F64, &[300, 24])],
    );
}
