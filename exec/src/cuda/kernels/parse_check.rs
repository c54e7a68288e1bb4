//! Every kind of generated kernel parsed by the host C++ compiler (with stand-ins for
//! the CUDA declarations), so a broken template fails CI on machines without a GPU;
//! `AMPGRAPH_DUMP_KERNELS=DIR` writes them out for `nvcc` or a comparison.

use super::batch_norm::{
    backward as batch_norm_backward, forward as batch_norm_forward, relu_mask,
};
use super::conv::pad;
use super::cross_entropy::{sce, sce_grad, sce_with_grad};
use super::elementwise::{bias_add, binary, binary_grad, cast, unary, unary_grad};
use super::fp8;
use super::fused::fused;
use super::fused::tests::program as fused_program;
use super::norm::{
    layer_norm, layer_norm_fp8, layer_norm_grad_block, layer_norm_grad_rows, NormTypes,
};
use super::pool::{avg_pool, avg_pool_grad, max_pool, max_pool_grad};
use super::reduce::{broadcast_div, column_sum, reduce, reduce_max_grad};
use super::select::{gather as gather_indexed, gather_grad};
use super::shape::{concat, concat_pair, gather, rows, transpose};
use super::softmax::{fused_softmax, softmax, softmax_grad};
use super::training::{
    all_finite, fill_flag, increment_if, loss_scale_update, optimizer, schedule_factor, GradRead,
};
use ampgraph_graph::ops::{
    BinaryKind, FusedSoftmax, LearningRateSchedule, NormGradEpilogue, ReduceKind, Rule, UnaryKind,
};
use ampgraph_graph::DType;
use std::path::Path;
use std::process::Command;
/// The CUDA names the kernels use, declared for a host C++ compiler.
const CUDA_STANDINS: &str = r#"
#include <math.h>
#include <cmath>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) alignas(n)
struct dim3_ { unsigned x, y, z; };
extern dim3_ threadIdx, blockIdx, blockDim, gridDim;
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
float __half2float(__half); __half __float2half_rn(float); __half __double2half(double);
float __bfloat162float(__nv_bfloat16); __nv_bfloat16 __float2bfloat16_rn(float);
__nv_bfloat16 __double2bfloat16(double);
float __int_as_float(int); float __expf(float); unsigned __umulhi(unsigned, unsigned);
float __fmul_rn(float, float); float __fmaf_rn(float, float, float); double __fma_rn(double, double, double); double __dmul_rn(double, double);
template <class T> T __shfl_xor_sync(unsigned, T, int);
size_t __cvta_generic_to_shared(const void*);
template <class T> T atomicAdd(T*, T);
void __syncthreads();
struct uint4 { unsigned x, y, z, w; };
uint4 make_uint4(unsigned, unsigned, unsigned, unsigned);
struct uint2 { unsigned x, y; };
uint2 make_uint2(unsigned, unsigned);
#define __launch_bounds__(...)
struct __half2 { unsigned x; };
struct __nv_bfloat162 { unsigned x; };
__half2 __floats2half2_rn(float, float); __nv_bfloat162 __floats2bfloat162_rn(float, float);
using std::isnan; using std::isfinite;
struct __nv_fp8_e4m3 { unsigned char x; __nv_fp8_e4m3() = default; explicit __nv_fp8_e4m3(float); explicit operator float() const; };
struct __nv_fp8_e5m2 { unsigned char x; __nv_fp8_e5m2() = default; explicit __nv_fp8_e5m2(float); explicit operator float() const; };
unsigned atomicMax(unsigned*, unsigned); unsigned __float_as_uint(float); float __uint_as_float(unsigned); unsigned max(unsigned, unsigned); float __fdiv_rn(float, float);
inline long long min(long long a, long long b) { return a < b ? a : b; }
struct float2 { float x, y; }; float2 make_float2(float, float); unsigned __byte_perm(unsigned, unsigned, unsigned); unsigned __vmaxu2(unsigned, unsigned);
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE }; enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
unsigned short __nv_cvt_float2_to_fp8x2(float2, __nv_saturation_t, __nv_fp8_interpretation_t);
"#;

fn every_kind_of_kernel() -> Vec<(String, String)> {
    let mut k: Vec<(String, String)> = Vec::new();
    for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let gelu = UnaryKind::Gelu { approximate: false };
        let tanh_gelu = UnaryKind::Gelu { approximate: true };
        k.extend([
            (format!("unary_{d}"), unary(d, gelu)),
            (format!("unary_selu_{d}"), unary(d, UnaryKind::Selu)),
            (format!("unary_grad_{d}"), unary_grad(d, tanh_gelu)),
            (format!("binary_{d}"), binary(d, BinaryKind::Maximum)),
            (
                format!("binary_grad_{d}"),
                binary_grad(d, BinaryKind::Pow, 1),
            ),
            (format!("bias_add_{d}"), bias_add(d)),
            (format!("broadcast_div_{d}"), broadcast_div(d)),
            (format!("reduce_mean_{d}"), reduce(d, d, ReduceKind::Mean)),
            (
                format!("reduce_max_{d}"),
                reduce(d, DType::F64, ReduceKind::Max),
            ),
            (format!("reduce_max_grad_{d}"), reduce_max_grad(d)),
            (format!("column_sum_{d}"), column_sum(d, d)),
            (format!("column_sum_{d}_f64"), column_sum(d, DType::F64)),
            (format!("log_softmax_{d}"), softmax(d, true, 4)),
            (format!("softmax_{d}"), softmax(d, false, 32)),
            (format!("softmax_grad_{d}"), softmax_grad(d, false, 8)),
            (format!("log_softmax_grad_{d}"), softmax_grad(d, true, 1)),
            (
                format!("layer_norm_{d}"),
                layer_norm(NormTypes::uniform(d), 1e-5, 32),
            ),
            (
                format!("layer_norm_grad_{d}"),
                layer_norm_grad_rows(
                    NormTypes::uniform(d),
                    1e-5,
                    32,
                    NormGradEpilogue::default(),
                    None,
                ),
            ),
            (
                format!("layer_norm_grad_residual_{d}"),
                layer_norm_grad_rows(
                    NormTypes::uniform(d),
                    1e-5,
                    24,
                    NormGradEpilogue {
                        residual: true,
                        sum_dx: true,
                        sum_residual: true,
                    },
                    None,
                ),
            ),
            (
                format!("layer_norm_grad_residual_short_{d}"),
                layer_norm_grad_rows(
                    NormTypes::uniform(d),
                    1e-5,
                    1,
                    NormGradEpilogue {
                        residual: true,
                        ..NormGradEpilogue::default()
                    },
                    None,
                ),
            ),
            (
                format!("layer_norm_grad_block_{d}"),
                layer_norm_grad_block(NormTypes::uniform(d), 1e-5, true),
            ),
            (format!("sce_{d}"), sce(d, DType::I64)),
            (format!("sce_grad_{d}"), sce_grad(d, DType::I32)),
            (
                format!("sce_with_grad_{d}"),
                sce_with_grad(d, d, d, DType::I32, None),
            ),
            (
                format!("sce_with_grad_summed_{d}"),
                sce_with_grad(DType::F16, d, DType::F16, DType::I64, Some(1000)),
            ),
            (format!("all_finite_{d}"), all_finite(&[d], None)),
            (
                format!("all_finite_scaled_{d}"),
                all_finite(&[d, DType::F32], Some(DType::F32)),
            ),
            (format!("increment_if_{d}"), increment_if(d)),
            (
                format!("schedule_cosine_{d}"),
                schedule_factor(d, LearningRateSchedule::warmup_cosine(10, 100, 0.1)),
            ),
            (
                format!("schedule_linear_{d}"),
                schedule_factor(d, LearningRateSchedule::warmup_linear(0, 100, 0.0)),
            ),
        ]);
        for (wide, lanes) in [(false, 1), (true, 1), (false, 8)] {
            let id = format!("{d}_{wide}_{lanes}");
            k.extend([
                (format!("max_pool_{id}"), max_pool(d, wide, lanes)),
                (format!("avg_pool_{id}"), avg_pool(d, wide, lanes)),
                (format!("max_pool_grad_{id}"), max_pool_grad(d, wide, lanes)),
                (format!("avg_pool_grad_{id}"), avg_pool_grad(d, wide, lanes)),
            ]);
        }
        let rules = [
            Rule::PLAIN_SGD,
            Rule::Sgd {
                momentum: 0.9,
                nesterov: true,
            },
            Rule::Adam {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-8,
                decoupled: true,
            },
            Rule::Lamb {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-6,
            },
        ];
        for (r, rule) in rules.into_iter().enumerate() {
            for (scaled, scheduled) in [(false, false), (true, false), (true, true)] {
                let cast = scaled.then_some(DType::F16);
                // The scheduled forms of a wide gradient read it rounded to bf16.
                let rounded_to = (scheduled && d.size_bytes() > 2).then_some(DType::BF16);
                let grad = GradRead {
                    dtype: d,
                    scaled,
                    rounded_to,
                };
                let src = optimizer(
                    DType::F32,
                    grad,
                    Some(DType::I64),
                    cast,
                    rule,
                    1e-3,
                    scheduled,
                    1e-2,
                );
                k.push((format!("optimizer_{r}_{d}_{scaled}_{scheduled}"), src));
            }
        }
    }
    for (from, to) in [
        (DType::F16, DType::F32),
        (DType::F32, DType::Bool),
        (DType::I64, DType::F16),
        (DType::BF16, DType::I32),
    ] {
        k.push((format!("cast_{from}_{to}"), cast(from, to)));
    }
    for index in [DType::I32, DType::I64] {
        for d in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            k.push((format!("gather_grad_{d}_{index}"), gather_grad(d, index)));
        }
        for bytes in [1, 2, 4, 8, 16] {
            k.push((
                format!("gather_indexed_{bytes}_{index}"),
                gather_indexed(bytes, index),
            ));
        }
    }
    for bytes in [1, 2, 4, 8, 16] {
        k.push((format!("gather_{bytes}"), gather(bytes)));
        k.push((format!("rows_{bytes}"), rows(bytes)));
        k.push((format!("transpose_{bytes}"), transpose(bytes)));
        k.push((format!("pad_{bytes}"), pad(bytes)));
    }
    for (x, u) in [
        (DType::F32, DType::F32),
        (DType::F16, DType::F32),
        (DType::BF16, DType::F32),
        (DType::F64, DType::F64),
    ] {
        for (relu, vectors) in [(false, false), (true, false), (false, true), (true, true)] {
            for side in [false, true] {
                k.push((
                    format!("batch_norm_{x}_{relu}_{side}_{vectors}"),
                    batch_norm_forward(x, u, relu, side, vectors),
                ));
            }
            k.push((
                format!("batch_norm_grad_{x}_{relu}_{vectors}"),
                batch_norm_backward(x, u, relu, vectors),
            ));
        }
        k.push((format!("batch_norm_relu_mask_{x}"), relu_mask(x, u)));
    }
    for bytes in [2, 8, 16] {
        k.push((format!("concat_{bytes}"), concat(bytes)));
        k.push((format!("concat_pair_{bytes}"), concat_pair(bytes)));
    }
    use super::attention::{NARROW, WIDE};
    // The bf16 heads of 64 are the transformer's modules (scripts/attention_check.cu
    // times them); the last two cast o and the gradient to FP8 as they store them.
    for (d, head_dim, shape, causal, key_bias, dropout, cast) in [
        (DType::F16, 64, WIDE, false, false, false, None),
        (DType::BF16, 64, WIDE, false, false, false, None),
        (DType::BF16, 64, NARROW, false, false, false, None),
        (DType::BF16, 32, NARROW, false, true, true, None),
        (DType::F16, 128, NARROW, true, false, false, None),
        (DType::F16, 64, WIDE, true, true, true, None),
        (
            DType::BF16,
            64,
            WIDE,
            false,
            false,
            false,
            Some(DType::F8E5M2),
        ),
        (
            DType::BF16,
            64,
            NARROW,
            true,
            true,
            true,
            Some(DType::F8E4M3),
        ),
    ] {
        let q8 = cast.map_or(String::new(), |to| format!("_{to}"));
        let narrow = if shape == NARROW { "_narrow" } else { "" };
        let name = format!("attention_{d}_{head_dim}{narrow}_{causal}_{key_bias}_{dropout}{q8}");
        let masks = (causal, key_bias, dropout);
        let source = super::attention::source(d, head_dim, (shape, false), masks, cast);
        // And as compiled for Hopper's own target, with its warpgroup products.
        let hopper = super::attention::source(d, head_dim, (shape, true), masks, cast);
        let hopper = format!("#define __CUDA_ARCH_FEAT_SM90_ALL 1\n{hopper}");
        k.push((format!("{name}_sm90a"), hopper));
        k.push((name, source));
    }
    // Casts folded into the normalisations: f16 x and dy, f32 math, f16 or f32 out.
    for y in [DType::F16, DType::F32] {
        let types = NormTypes {
            params: DType::F32,
            x: DType::F16,
            dy: DType::BF16,
            y,
        };
        k.push((format!("layer_norm_mixed_{y}"), layer_norm(types, 1e-5, 8)));
        k.push((
            format!("layer_norm_grad_mixed_{y}"),
            layer_norm_grad_rows(types, 1e-5, 8, NormGradEpilogue::default(), None),
        ));
        k.push((
            format!("layer_norm_grad_block_mixed_{y}"),
            layer_norm_grad_block(types, 1e-5, false),
        ));
    }
    // Layer norms cast to FP8: GPT-2's (bf16 rows of 768 in words, f32 parameters
    // widened), and f32 rows of 100 a lane at a time into E5M2.
    let bf16_norm = NormTypes {
        params: DType::F32,
        x: DType::BF16,
        dy: DType::BF16,
        y: DType::BF16,
    };
    k.push((
        "layer_norm_fp8_bf16".into(),
        layer_norm_fp8(bf16_norm, 1e-5, 24, DType::F8E4M3),
    ));
    k.push((
        "layer_norm_fp8_f32".into(),
        layer_norm_fp8(NormTypes::uniform(DType::F32), 1e-5, 4, DType::F8E5M2),
    ));
    // Layer norms' gradients cast to FP8: GPT-2's (bf16 rows of 768 adding the
    // residual, summing dx), and f32 rows of 128 with every sum.
    let gpt2_grad = NormGradEpilogue {
        residual: true,
        sum_dx: true,
        sum_residual: false,
    };
    k.push((
        "layer_norm_grad_fp8_bf16".into(),
        layer_norm_grad_rows(
            NormTypes::uniform(DType::BF16),
            1e-5,
            24,
            gpt2_grad,
            Some(DType::F8E5M2),
        ),
    ));
    k.push((
        "layer_norm_grad_fp8_f32".into(),
        layer_norm_grad_rows(
            NormTypes::uniform(DType::F32),
            1e-5,
            4,
            NormGradEpilogue {
                residual: true,
                sum_dx: true,
                sum_residual: true,
            },
            Some(DType::F8E4M3),
        ),
    ));
    // Selections: each word width, a comparison of each kind of operand, both index
    // dtypes, a logical op on bools.
    use super::select;
    for bytes in [1, 2, 8] {
        k.push((format!("where_{bytes}"), select::where_(bytes)));
        k.push((format!("pad_{bytes}"), select::pad(bytes)));
    }
    for (d, op) in [
        (DType::F16, "<="),
        (DType::F64, "=="),
        (DType::I64, ">"),
        (DType::Bool, "^"),
    ] {
        k.push((format!("compare_{d}"), select::compare(d, op)));
    }
    k.push(("not".into(), select::not()));
    k.push(("gather_i32_16".into(), select::gather(16, DType::I32)));
    k.push(("gather_i64_2".into(), select::gather(2, DType::I64)));
    // Resize: a 16-bit dtype and f64 (its double accumulator).
    for d in [DType::BF16, DType::F64] {
        k.push((format!("resize_{d}"), super::resize::resize(d)));
    }
    k.push(("fill_flag".into(), fill_flag()));
    k.push((
        "loss_scale_update".into(),
        loss_scale_update(DType::F32, DType::I64, 2000, 2.0, 0.5),
    ));
    let programs = [
        (
            "v0 = in0: f32[4, 6]; v1 = in1: f32[6]; v2 = BiasAdd<data_format=NHWC>(v0, v1): f32[4, 6]; \
             v3 = Relu(v2): f32[4, 6]; v4 = Cast<to=f16>(v3): f16[4, 6]; v5 = in2: f16[]; \
             v6 = Mul(v4, v5): f16[4, 6]; v7 = UnaryGrad<kind=Tanh>(v6, v4): f16[4, 6]",
            vec![3, 7],
        ),
        (
            "v0 = in0: bf16[4, 6]; v1 = in1: bf16[4, 1]; v2 = BinaryGrad<kind=Div, wrt=1>(v0, v1, v0): bf16[4, 6]; \
             v3 = Cast<to=f64>(v2): f64[4, 6]; v4 = Gelu<approximate=true>(v3): f64[4, 6]; \
             v5 = Cast<to=f16>(v4): f16[4, 6]",
            vec![5],
        ),
        // Dropout after a bias, in bf16 with an f32 step count, and in f64.
        (
            "v0 = in0: bf16[4, 6]; v1 = in1: bf16[6]; v2 = Add(v0, v1): bf16[4, 6]; v3 = in2: f32[]; \
             v4 = Dropout<rate=0.1, seed=12345>(v2, v3): bf16[4, 6]; v5 = Cast<to=f64>(v4): f64[4, 6]; \
             v6 = in3: f64[]; v7 = Dropout<rate=0.5, seed=-3>(v5, v6): f64[4, 6]",
            vec![4, 7],
        ),
    ];
    for (i, (text, outputs)) in programs.into_iter().enumerate() {
        k.push((format!("fused_{i}"), fused(&fused_program(text, outputs))));
    }
    // Column sums: an f16 GELU gradient summed in f32 (with a summed input), f64, and
    // a row bias.
    let sums = [
        (
            "v0 = in0: f16[8, 16]; v1 = in1: f16[8, 16]; \
             v2 = UnaryGrad<kind=Gelu, approximate=false>(v0, v1): f16[8, 16]",
            vec![2],
            vec![2, 0],
        ),
        (
            "v0 = in0: f64[2, 3, 4]; v1 = Exp(v0): f64[2, 3, 4]",
            vec![1],
            vec![1],
        ),
        // A bias along the rows, loaded in vectors.
        (
            "v0 = in0: f16[8, 16]; v1 = in1: f16[16]; v2 = Add(v0, v1): f16[8, 16]",
            vec![2],
            vec![2],
        ),
    ];
    for (i, (text, outputs, summed)) in sums.into_iter().enumerate() {
        let p = fused_program(text, outputs)
            .with_column_sums(summed)
            .unwrap();
        k.push((format!("fused_sums_{i}"), fused(&p)));
    }
    // Column sums alone (a batch norm's statistics: x and its square, nothing stored).
    let statistics = fused_program(
        "v0 = in0: f16[8, 16]; v1 = Cast<to=f32>(v0): f32[8, 16]; v2 = Mul(v1, v1): f32[8, 16]",
        vec![2],
    )
    .with_column_sums(vec![1, 2])
    .and_then(|p| p.retain_outputs(|_| false))
    .unwrap();
    k.push(("fused_sums_alone".into(), fused(&statistics)));
    // Amaxes (current FP8 scaling's, `amax-into-elementwise`): a plain program and one
    // with column sums (both its kernels).
    let gelu_gradient = "v0 = in0: bf16[8, 16]; v1 = in1: bf16[8, 16]; \
                         v2 = UnaryGrad<kind=Gelu, approximate=false>(v0, v1): bf16[8, 16]";
    for (i, summed) in [vec![], vec![2]].into_iter().enumerate() {
        let p = fused_program(gelu_gradient, vec![2])
            .with_column_sums(summed)
            .and_then(|p| p.with_amaxes(vec![2, 0]))
            .unwrap();
        k.push((format!("fused_amaxes_{i}"), fused(&p)));
    }
    // Softmax prologues: f16 scores scaled, an f32 mask added (vectors of 4), and
    // bf16 widened to f64 (a log-softmax).
    let prologues = [
        (
            "v0 = in0: f16[2, 4, 64]; v1 = in1: f16[]; v2 = Mul(v0, v1): f16[2, 4, 64]; \
             v3 = Cast<to=f32>(v2): f32[2, 4, 64]; v4 = in2: f32[4, 64]; \
             v5 = Add(v3, v4): f32[2, 4, 64]",
            5,
            false,
        ),
        (
            "v0 = in0: bf16[3, 40]; v1 = Cast<to=f64>(v0): f64[3, 40]",
            1,
            true,
        ),
    ];
    for (i, (text, value, log)) in prologues.into_iter().enumerate() {
        let op = FusedSoftmax::new(-1, log, fused_program(text, vec![value])).unwrap();
        k.push((format!("fused_softmax_{i}"), fused_softmax(&op, 2)));
    }
    let gelu = UnaryKind::Gelu { approximate: false };
    for (x, to) in [(DType::BF16, DType::F8E4M3), (DType::F32, DType::F8E5M2)] {
        k.extend([
            (format!("fp8_amax_{x}"), fp8::amax(x, None)),
            (format!("fp8_amax_gelu_{x}"), fp8::amax(x, Some(gelu))),
            (format!("fp8_quantize_{x}_{to}"), fp8::quantize(x, to, None)),
            (
                format!("fp8_quantize_gelu_{x}_{to}"),
                fp8::quantize(x, to, Some(gelu)),
            ),
            (
                format!("fp8_quantize_transposed_{x}_{to}"),
                fp8::quantize_transposed(x, to, None, fp8::Tiles { whole: false }),
            ),
            (
                format!("fp8_quantize_transposed_gelu_{x}_{to}"),
                fp8::quantize_transposed(x, to, Some(gelu), fp8::Tiles { whole: true }),
            ),
            (
                format!("fp8_quantize_transposed_group_{x}_{to}"),
                fp8::quantize_transposed_group(
                    x,
                    to,
                    fp8::Tiles {
                        whole: x == DType::BF16,
                    },
                ),
            ),
            (format!("fp8_dequantize_{to}_{x}"), fp8::dequantize(to, x)),
            (format!("fp8_scale_{to}"), fp8::scale(to, 1)),
            (
                format!("fp8_scale_update_{to}"),
                fp8::scale_update(to, 0, false),
            ),
            (
                format!("fp8_scale_update_recent_{to}"),
                fp8::scale_update(to, 0, true),
            ),
        ]);
    }
    k.push(("fp8_transpose".into(), fp8::transpose()));
    // The FP8 cast of a program's value (`elementwise-into-fp8`): with its column sum
    // and without; and of a tensor it only loads, with its column sum.
    for (i, summed) in [vec![2], vec![]].into_iter().enumerate() {
        let p = fused_program(gelu_gradient, vec![2])
            .with_column_sums(summed)
            .unwrap();
        k.push((
            format!("fp8_quantize_program_{i}"),
            fp8::quantize_program(&p, DType::F8E5M2, fp8::Tiles { whole: i == 0 }),
        ));
    }
    let load = fused_program("v0 = in0: bf16[16, 24]", vec![0])
        .with_column_sums(vec![0])
        .unwrap();
    k.push((
        "fp8_quantize_program_load".into(),
        fp8::quantize_program(&load, DType::F8E5M2, fp8::Tiles { whole: false }),
    ));
    k
}

/// Whether `source` parses; the compiler's complaint otherwise.
fn parses(cxx: &str, dir: &Path, name: &str, source: &str) -> Result<(), String> {
    let file = dir.join(format!("{name}.cu"));
    std::fs::write(&file, source).map_err(|e| e.to_string())?;
    let out = Command::new(cxx)
        .args(["-std=c++17", "-fsyntax-only", "-x", "c++", "-I"])
        .arg(dir)
        .arg("-include")
        .arg(dir.join("cuda_standins.h"))
        .arg(&file)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{name}: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// With `AMPGRAPH_DUMP_KERNELS=DIR`, writes one source of every kind of kernel to
/// DIR/<name>.cu, for `nvcc -arch=sm_90 --fmad=false -Xptxas -v -c` on the GPU
/// machine (registers, spills) or a microbenchmark; otherwise does nothing.
#[test]
fn dump_kernels_when_asked() {
    let Some(dir) = std::env::var_os("AMPGRAPH_DUMP_KERNELS") else {
        return;
    };
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).unwrap();
    for (name, source) in every_kind_of_kernel() {
        std::fs::write(dir.join(format!("{name}.cu")), source).unwrap();
    }
}

#[test]
fn every_generated_kernel_parses() {
    let Some(cxx) = ["c++", "g++", "clang++"]
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok())
    else {
        println!("skipping: no C++ compiler to parse the kernels with");
        return;
    };
    let dir = std::env::temp_dir().join(format!("ampgraph-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for header in ["cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"] {
        std::fs::write(dir.join(header), "").unwrap();
    }
    std::fs::write(dir.join("cuda_standins.h"), CUDA_STANDINS).unwrap();
    let kernels = every_kind_of_kernel();
    let half = kernels.len() / 2;
    let (first, second) = kernels.split_at(half);
    let check = |part: &[(String, String)]| -> Vec<String> {
        part.iter()
            .filter_map(|(name, src)| parses(cxx, &dir, name, src).err())
            .collect()
    };
    let failures: Vec<String> = std::thread::scope(|s| {
        let other = s.spawn(|| check(second));
        let mut f = check(first);
        f.extend(other.join().unwrap());
        f
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(kernels.len() > 100);
}
