//! Every op with a CUDA kernel against the CPU reference, in f32, f16, bf16 (and f64
//! where it is cheap), within dtype tolerances. Skips (printing why) without CUDA.

#![allow(clippy::cloned_ref_to_slice_refs)] // `&[x.clone()]` reads better in the tables

mod common;

use ampgraph_exec::{cuda, CudaExecutor, DeviceStats, ExecOptions, Executor, Feeds};
use ampgraph_graph::ops::*;
use ampgraph_graph::{DType, Data, Graph, Op, Port, Tensor, TensorType};
use common::{gpu, op_graph, run_both, FLOATS};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| lo + (hi - lo) * self.next()).collect()
    }
}

fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        DType::F64 => 1e-11,
        _ => 0.0,
    }
}

/// Elementwise closeness: |gpu - cpu| <= tol * max(|cpu|, scale), NaN matching NaN.
fn assert_close(what: &str, gpu: &Tensor, cpu: &Tensor, scale: f64) {
    assert_close_to(what, gpu, cpu, scale, tol(cpu.dtype()))
}

/// [`assert_close`] within `t`.
fn assert_close_to(what: &str, gpu: &Tensor, cpu: &Tensor, scale: f64, t: f64) {
    assert_eq!(gpu.ty(), cpu.ty(), "{what}: types differ");
    let (g, c) = (gpu.to_f64_vec(), cpu.to_f64_vec());
    let mut worst = (0.0, 0usize);
    for (i, (&a, &b)) in g.iter().zip(&c).enumerate() {
        if a.is_nan() && b.is_nan() || a == b {
            continue;
        }
        let err = (a - b).abs() / b.abs().max(scale);
        assert!(err.is_finite(), "{what}: element {i}: gpu {a} vs cpu {b}");
        if err > worst.0 {
            worst = (err, i);
        }
    }
    assert!(
        worst.0 <= t,
        "{what}: element {}: gpu {} vs cpu {} (relative error {:.3e} > {t:e})",
        worst.1,
        g[worst.1],
        c[worst.1],
        worst.0
    );
}

/// Runs `op` on placeholders holding `inputs` on both executors and compares every output.
fn check(gpu: &mut CudaExecutor, what: &str, op: impl Op, inputs: &[Tensor]) {
    check_scaled(gpu, what, op, inputs, 1.0)
}

fn check_scaled(gpu: &mut CudaExecutor, what: &str, op: impl Op, inputs: &[Tensor], scale: f64) {
    let (dev, cpu) = run_both(gpu, what, op, inputs);
    for (k, (a, b)) in dev.iter().zip(&cpu).enumerate() {
        assert_close(&format!("{what} output {k}"), a, b, scale);
    }
}

/// [`check_scaled`] within `t` for every output.
fn check_scaled_to(
    gpu: &mut CudaExecutor,
    what: &str,
    op: impl Op,
    inputs: &[Tensor],
    scale: f64,
    t: f64,
) {
    let (dev, cpu) = run_both(gpu, what, op, inputs);
    for (k, (a, b)) in dev.iter().zip(&cpu).enumerate() {
        assert_close_to(&format!("{what} output {k}"), a, b, scale, t);
    }
}

fn t(dtype: DType, shape: &[usize], v: &[f64]) -> Tensor {
    Tensor::from_f64(dtype, shape.to_vec(), v).expect("tensor")
}

fn rand(r: &mut Rng, dtype: DType, shape: &[usize], lo: f64, hi: f64) -> Tensor {
    let n = shape.iter().product();
    t(dtype, shape, &r.vec(n, lo, hi))
}

const HALF_AND_F32: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn unary_kinds() -> Vec<(UnaryKind, f64, f64)> {
    use UnaryKind::*;
    vec![
        (Relu, -3.0, 3.0),
        (Relu6, -2.0, 8.0),
        (Elu, -3.0, 3.0),
        (Selu, -3.0, 3.0),
        (Gelu { approximate: false }, -4.0, 4.0),
        (Gelu { approximate: true }, -4.0, 4.0),
        (LeakyRelu { alpha: 0.2 }, -3.0, 3.0),
        (Tanh, -3.0, 3.0),
        (Sigmoid, -6.0, 6.0),
        (Exp, -3.0, 3.0),
        (Log, 0.1, 5.0),
        (Log1p, -0.5, 5.0),
        (Sqrt, 0.01, 9.0),
        (Rsqrt, 0.1, 9.0),
        (Square, -3.0, 3.0),
        (Neg, -3.0, 3.0),
        (Abs, -3.0, 3.0),
        (Erf, -3.0, 3.0),
        (Softplus, -10.0, 10.0),
        (Reciprocal, 0.5, 4.0),
        (Sign, -3.0, 3.0),
        (Identity, -3.0, 3.0),
    ]
}

#[test]
fn unary_and_unary_grad() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(1);
    for d in FLOATS {
        for (kind, lo, hi) in unary_kinds() {
            let x = rand(&mut r, d, &[7, 33], lo, hi);
            let dy = rand(&mut r, d, &[7, 33], -1.0, 1.0);
            check(
                &mut gpu,
                &format!("{kind:?} {d}"),
                Unary::new(kind),
                &[x.clone()],
            );
            check(
                &mut gpu,
                &format!("{kind:?} grad {d}"),
                UnaryGrad::new(kind),
                &[x, dy],
            );
        }
    }
    // Identity on integers aliases.
    let i = Tensor::new(vec![3], Data::I32(vec![1, -2, 3])).unwrap();
    check(
        &mut gpu,
        "Identity i32",
        Unary::new(UnaryKind::Identity),
        &[i],
    );
}

#[test]
fn binary_and_binary_grad_with_broadcasting() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(2);
    let shapes: [(&[usize], &[usize]); 7] = [
        (&[4, 5], &[4, 5]),
        (&[4, 5], &[]),
        (&[], &[4, 5]),
        (&[4, 1, 3], &[5, 1]),
        (&[2, 3, 4], &[3, 1]),
        // A squeeze-excitation's NHWC scale (H and W merge into one axis), and both
        // operands broadcast (no axes merge).
        (&[2, 3, 4, 5], &[2, 1, 1, 5]),
        (&[2, 1, 4, 1], &[1, 3, 1, 5]),
    ];
    for d in FLOATS {
        for kind in BinaryKind::ALL {
            for (sa, sb) in shapes {
                let (lo, hi) = if kind == BinaryKind::Pow {
                    (0.2, 2.0)
                } else {
                    (-2.0, 2.0)
                };
                let a = rand(&mut r, d, sa, lo, hi);
                let mut b = rand(&mut r, d, sb, lo, hi);
                if kind == BinaryKind::Div {
                    b = rand(&mut r, d, sb, 0.5, 2.0);
                }
                let what = format!("{kind:?} {d} {sa:?} {sb:?}");
                check(&mut gpu, &what, Binary::new(kind), &[a.clone(), b.clone()]);
                let out = ampgraph_graph::shape::broadcast_shapes(sa, sb).unwrap();
                let dy = rand(&mut r, d, &out, -1.0, 1.0);
                for wrt in 0..2 {
                    check(
                        &mut gpu,
                        &format!("{what} grad {wrt}"),
                        BinaryGrad::new(kind, wrt),
                        &[a.clone(), b.clone(), dy.clone()],
                    );
                }
            }
        }
    }
}

#[test]
fn bias_add_cast_and_shape_ops() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(3);
    for d in FLOATS {
        let x = rand(&mut r, d, &[2, 3, 4, 5], -2.0, 2.0);
        let b5 = rand(&mut r, d, &[5], -1.0, 1.0);
        let b3 = rand(&mut r, d, &[3], -1.0, 1.0);
        check(
            &mut gpu,
            "BiasAdd NHWC",
            BiasAdd {
                data_format: DataFormat::Nhwc,
            },
            &[x.clone(), b5],
        );
        check(
            &mut gpu,
            "BiasAdd NCHW",
            BiasAdd {
                data_format: DataFormat::Nchw,
            },
            &[x.clone(), b3],
        );
        check(&mut gpu, "Reshape", Reshape::new(vec![6, -1]), &[x.clone()]);
        check(
            &mut gpu,
            "Transpose",
            Transpose::new(vec![2, 0, 3, 1]),
            &[x.clone()],
        );
        check(
            &mut gpu,
            "Slice",
            Slice::new(vec![1, 0, 1, 2], vec![1, -1, 2, 3]),
            &[x.clone()],
        );
        // Contiguous last axes move as wide words: attention's head transposes, and
        // slices whose offsets allow some widths and not others.
        let heads = rand(&mut r, d, &[2, 6, 3, 16], -2.0, 2.0);
        check(
            &mut gpu,
            "Transpose heads",
            Transpose::new(vec![0, 2, 1, 3]),
            &[heads.clone()],
        );
        // Transposes that move the contiguous axis go through shared-memory tiles
        // (sizes off the tile's 32): a matrix, NCHW -> NHWC, HWIO -> KRSC filters.
        let tiled: [(&[usize], Vec<usize>); 4] = [
            (&[37, 70], vec![1, 0]),
            (&[3, 5, 9, 33], vec![0, 2, 3, 1]),
            (&[2, 3, 7, 41], vec![0, 2, 3, 1]),
            (&[3, 3, 7, 40], vec![3, 0, 1, 2]),
        ];
        for (shape, perm) in tiled {
            check(
                &mut gpu,
                &format!("Transpose {shape:?} {perm:?}"),
                Transpose::new(perm),
                &[rand(&mut r, d, shape, -2.0, 2.0)],
            );
        }
        let slices: [(Vec<usize>, Vec<i64>); 3] = [
            (vec![0, 0, 0, 8], vec![2, 6, 3, 8]),
            (vec![1, 2, 0, 2], vec![1, 3, 3, 12]),
            (vec![0, 1, 1, 1], vec![2, 4, 2, 15]),
        ];
        for (begin, size) in slices {
            check(
                &mut gpu,
                &format!("Slice {begin:?} {size:?}"),
                Slice::new(begin, size),
                &[heads.clone()],
            );
        }
        let small = rand(&mut r, d, &[3, 1], -1.0, 1.0);
        check(
            &mut gpu,
            "BroadcastTo",
            BroadcastTo::new(vec![2, 3, 4]),
            &[small],
        );
        let y = rand(&mut r, d, &[2, 1, 4, 5], -1.0, 1.0);
        check(
            &mut gpu,
            "Concat 1",
            Concat::new(1),
            &[x.clone(), y.clone(), x.clone()],
        );
        // Two inputs: one launch over the output's rows.
        check(&mut gpu, "Concat 1 pair", Concat::new(1), &[y, x.clone()]);
        check(
            &mut gpu,
            "Concat -1",
            Concat::new(-1),
            &[x.clone(), x.clone()],
        );
        // Channel paddings, copied in words of 8 and 16 bytes where the blocks allow.
        for (a, b) in [(60, 4), (8, 8), (3, 5)] {
            let mut image = |c| rand(&mut r, d, &[2, 3, 4, c], -1.0, 1.0);
            let parts = [image(a), image(b)];
            check(
                &mut gpu,
                &format!("Concat {a}+{b} channels"),
                Concat::new(-1),
                &parts,
            );
        }
        // Long rows go a block per row (where there are 512 rows or more): a padded
        // vocabulary sliced back, zeros appended to it (a pair), three inputs, a row
        // broadcast down a matrix; then rows too few (a concat of matrices along their
        // first axis is one row of words).
        let wide = rand(&mut r, d, &[600, 1030], -1.0, 1.0);
        check(
            &mut gpu,
            "Slice of long rows",
            Slice::new(vec![0, 0], vec![600, 1025]),
            &[wide.clone()],
        );
        let narrow = rand(&mut r, d, &[600, 1025], -1.0, 1.0);
        let pad = rand(&mut r, d, &[600, 5], -1.0, 1.0);
        check(
            &mut gpu,
            "Concat long rows pair",
            Concat::new(1),
            &[narrow.clone(), pad.clone()],
        );
        check(
            &mut gpu,
            "Concat long rows",
            Concat::new(1),
            &[pad, narrow, wide],
        );
        let row = rand(&mut r, d, &[1, 1025], -1.0, 1.0);
        check(
            &mut gpu,
            "BroadcastTo long rows",
            BroadcastTo::new(vec![600, 1025]),
            &[row],
        );
        let top = rand(&mut r, d, &[9, 1030], -1.0, 1.0);
        let bottom = rand(&mut r, d, &[2, 1030], -1.0, 1.0);
        check(&mut gpu, "Concat 0 pair", Concat::new(0), &[top, bottom]);
        // Casts to and from FP8 have no CUDA kernel (refused, tested below).
        for to in DType::ALL.into_iter().filter(|t| !t.is_fp8()) {
            check(
                &mut gpu,
                &format!("Cast {d}->{to}"),
                Cast { to },
                &[x.clone()],
            );
        }
    }
    let i = Tensor::new(vec![4], Data::I64(vec![0, -3, 7, 1 << 40])).unwrap();
    for to in [DType::F32, DType::F16, DType::I32, DType::Bool] {
        check(
            &mut gpu,
            &format!("Cast i64->{to}"),
            Cast { to },
            &[i.clone()],
        );
    }
    let b = Tensor::new(vec![3], Data::Bool(vec![true, false, true])).unwrap();
    check(
        &mut gpu,
        "Cast bool->f16",
        Cast { to: DType::F16 },
        &[b.clone()],
    );
    check(&mut gpu, "Transpose bool", Transpose::new(vec![0]), &[b]);
}

#[test]
fn reductions_and_their_gradients() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(4);
    let cases: Vec<(Vec<usize>, Option<Vec<i64>>, bool)> = vec![
        (vec![5, 7], None, false),
        (vec![5, 7], Some(vec![0]), false),
        (vec![5, 7], Some(vec![1]), true),
        (vec![3, 4, 5], Some(vec![0, 2]), false),
        (vec![3, 4, 5], Some(vec![-1]), true),
        (vec![2, 3000], Some(vec![1]), false),
        (vec![300, 40], Some(vec![0]), false),
        (vec![6000, 3], Some(vec![1]), false),
        // Leading axes over many rows: the chunked column sums.
        (vec![1000, 70], Some(vec![0]), false),
        // Rows in 16-byte words (k_cols_rows): one tile of whole rows; rows of more
        // than 512 words in tiles, the last partly full.
        (vec![500, 264], Some(vec![0]), false),
        (vec![20, 4104], Some(vec![0]), false),
        (vec![9, 130, 33], Some(vec![0, 1]), true),
        // A global average pool (H and W, neighbours, reduce as one axis) and axes of
        // size 1 (dropped from the kernel's index arithmetic).
        (vec![2, 3, 4, 5], Some(vec![1, 2]), false),
        (vec![4, 1, 6, 1], Some(vec![2]), true),
        (vec![2, 1, 1, 8], Some(vec![1, 2]), false),
        // NHWC global pools over more than 64 pixels: the middle axis in row chunks
        // (k_mid), a column tile partly full; one image of 8 channels over 100 rows
        // of chunks.
        (vec![3, 9, 10, 33], Some(vec![1, 2]), true),
        (vec![1, 80, 80, 8], Some(vec![1, 2]), false),
        (vec![5, 70, 40], Some(vec![1]), false),
    ];
    for d in FLOATS {
        for kind in ReduceKind::ALL {
            for (shape, axes, keep) in &cases {
                let x = rand(&mut r, d, shape, -2.0, 2.0);
                let what = format!("{} {d} {shape:?} {axes:?}", kind.name());
                let n: usize = shape.iter().product();
                let scale = if kind == ReduceKind::Sum {
                    (n as f64).sqrt()
                } else {
                    1.0
                };
                let op = Reduce::new(kind, axes.clone(), *keep);
                let out = op.infer(&[&x.ty()]).unwrap().remove(0);
                check_scaled(&mut gpu, &what, op.clone(), &[x.clone()], scale);
                // A widening cast folded in: the sum of the narrow values, stored wide.
                let wide = if d == DType::F64 {
                    None
                } else {
                    Some(DType::F64)
                };
                for to in [Some(DType::F32), wide].into_iter().flatten() {
                    if widens_exactly(d, to) && to != d {
                        let op = op.clone().with_output(to);
                        check_scaled(
                            &mut gpu,
                            &format!("{what} to {to}"),
                            op,
                            &[x.clone()],
                            scale,
                        );
                    }
                }
                let dy = rand(&mut r, d, &out.shape, -1.0, 1.0);
                check(
                    &mut gpu,
                    &format!("{what} grad"),
                    ReduceGrad::new(kind, axes.clone(), *keep),
                    &[x, dy],
                );
            }
        }
        // Max with ties splits the gradient.
        let x = t(d, &[2, 3], &[1.0, 3.0, 3.0, -1.0, -1.0, -2.0]);
        let dy = t(d, &[2], &[1.0, 2.0]);
        check(
            &mut gpu,
            "Max ties grad",
            ReduceGrad::new(ReduceKind::Max, Some(vec![1]), false),
            &[x, dy],
        );
        for (from, to) in [
            (vec![4, 3, 5], vec![3, 1]),
            (vec![4, 5], vec![5]),
            (vec![4, 5], vec![4, 5]),
            (vec![200, 8], vec![1, 8]),
        ] {
            let x = rand(&mut r, d, &from, -1.0, 1.0);
            check_scaled(
                &mut gpu,
                &format!("SumTo {d} {from:?}->{to:?}"),
                SumTo { shape: to },
                &[x],
                4.0,
            );
        }
    }
}

#[test]
fn softmax_family_and_cross_entropy() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(5);
    for d in FLOATS {
        for (shape, axis) in [
            (vec![4, 10], -1),
            (vec![3, 1000], 1),
            (vec![37, 96], -1),
            // Rows of whole 16-byte words for every dtype: the k_warp_vec kernels.
            (vec![9, 512], -1),
            (vec![3, 2000], 1),
            (vec![3, 5, 4], 1),
            (vec![2, 3, 4], 0),
        ] {
            let x = rand(&mut r, d, &shape, -5.0, 5.0);
            let dy = rand(&mut r, d, &shape, -1.0, 1.0);
            let what = format!("{d} {shape:?} axis {axis}");
            check(
                &mut gpu,
                &format!("Softmax {what}"),
                Softmax { axis },
                &[x.clone()],
            );
            check(
                &mut gpu,
                &format!("LogSoftmax {what}"),
                LogSoftmax { axis },
                &[x.clone()],
            );
            let y = Softmax { axis }.eval(&[&x]).unwrap().remove(0);
            let ly = LogSoftmax { axis }.eval(&[&x]).unwrap().remove(0);
            check(
                &mut gpu,
                &format!("SoftmaxGrad {what}"),
                SoftmaxGrad { axis, log: false },
                &[y, dy.clone()],
            );
            check(
                &mut gpu,
                &format!("LogSoftmaxGrad {what}"),
                SoftmaxGrad { axis, log: true },
                &[ly, dy],
            );
        }
        for (n, c, ld) in [
            (8usize, 10usize, DType::I32),
            (64, 10, DType::I64),
            (5, 700, DType::I32),
            // The mlp's 1000 classes (a warp per row), and rows too long for a warp.
            (9, 1000, DType::I64),
            (3, 1500, DType::I64),
        ] {
            let x = rand(&mut r, d, &[n, c], -4.0, 4.0);
            let labels: Vec<f64> = (0..n).map(|i| ((i * 7) % c) as f64).collect();
            let l = t(ld, &[n], &labels);
            check(
                &mut gpu,
                &format!("SCE {d} {n}x{c}"),
                SoftmaxCrossEntropy,
                &[x.clone(), l.clone()],
            );
            let dl = t(d, &[], &[1.5]);
            check(
                &mut gpu,
                &format!("SCE grad {d} {n}x{c}"),
                SoftmaxCrossEntropyGrad,
                &[x, l, dl],
            );
        }
    }
}

/// `FusedSoftmax` of `x * s + mask` (`mask` along the softmax's axis and the ones after
/// it, broadcast over the rest), computed in `wide`: the kernel with its prologue,
/// against the CPU. Rows a warp holds (masked lanes, 16-byte words), rows too long for
/// a warp and a softmax over a middle axis (both through the prologue's own kernel).
#[test]
fn fused_softmax_prologues() {
    use ampgraph_graph::ops::fused::{Expr, Instr};
    use ampgraph_graph::TensorType;
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(23);
    let input = |k: usize, ty: &TensorType| Instr {
        expr: Expr::Input(k),
        ty: ty.clone(),
    };
    let apply = |op: ElementOp, args: Vec<usize>, ty: &TensorType| Instr {
        expr: Expr::Apply(op, args),
        ty: ty.clone(),
    };
    for d in FLOATS {
        let wide = if d.size_bytes() == 2 { DType::F32 } else { d };
        for (shape, axis) in [
            (vec![4, 10], -1i64),
            (vec![9, 512], -1),
            (vec![2, 6, 128], -1),
            (vec![3, 1500], -1),
            (vec![3, 5, 4], 1),
        ] {
            let a = if axis < 0 {
                shape.len() - 1
            } else {
                axis as usize
            };
            let x_ty = TensorType::new(d, shape.clone());
            let wide_ty = TensorType::new(wide, shape.clone());
            let mask_ty = TensorType::new(wide, shape[a..].to_vec());
            let program = FusedElementwise::new(
                vec![
                    input(0, &x_ty),
                    input(1, &TensorType::new(d, vec![])),
                    apply(ElementOp::Binary(BinaryKind::Mul), vec![0, 1], &x_ty),
                    apply(ElementOp::Cast(wide), vec![2], &wide_ty),
                    input(2, &mask_ty),
                    apply(ElementOp::Binary(BinaryKind::Add), vec![3, 4], &wide_ty),
                ],
                vec![5],
            )
            .unwrap();
            let x = rand(&mut r, d, &shape, -4.0, 4.0);
            let s = t(d, &[], &[0.75]);
            let mut mask = r.vec(mask_ty.shape.iter().product(), -1.0, 1.0);
            mask[1] = f64::NEG_INFINITY;
            let mask = t(wide, &mask_ty.shape, &mask);
            for log in [false, true] {
                let op = FusedSoftmax::new(axis, log, program.clone()).unwrap();
                let what = format!("FusedSoftmax {d} {shape:?} axis {axis} log {log}");
                check(&mut gpu, &what, op, &[x.clone(), s.clone(), mask.clone()]);
            }
        }
    }
    // f32 scores and mask, the softmax in f16 after a narrowing cast: vectors of 4.
    let shape = [5, 256];
    let f32s = TensorType::new(DType::F32, shape.to_vec());
    let program = FusedElementwise::new(
        vec![
            input(0, &f32s),
            input(1, &TensorType::new(DType::F32, vec![256])),
            apply(ElementOp::Binary(BinaryKind::Add), vec![0, 1], &f32s),
            apply(
                ElementOp::Cast(DType::F16),
                vec![2],
                &TensorType::new(DType::F16, shape.to_vec()),
            ),
        ],
        vec![3],
    )
    .unwrap();
    let x = rand(&mut r, DType::F32, &shape, -4.0, 4.0);
    let mask = rand(&mut r, DType::F32, &[256], -1.0, 1.0);
    let op = FusedSoftmax::new(-1, false, program).unwrap();
    check(&mut gpu, "FusedSoftmax f32 -> f16", op, &[x, mask]);
}

/// The loss and its gradient in one kernel: f16 logits widened to f32, the gradient
/// stored in f16 with its f32 column sums (the mlp's output layer; more rows than the
/// kernel's row chunks), and each float type alone, with and without the sums; rows
/// read as vectors and one by one; logits padded past their classes (`classes`, as
/// `pad-gemm` leaves an LM head's); infinite and NaN logits.
#[test]
fn cross_entropy_with_its_gradient() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(11);
    let (h, b, f, d) = (DType::F16, DType::BF16, DType::F32, DType::F64);
    // (logits, compute, gradient, column sums, rows, width, classes)
    let cases = [
        (h, f, Some(h), true, 3000usize, 1000usize, None),
        // More rows than the summing kernel has blocks (1024): several rows a block.
        (h, f, Some(h), true, 8200, 24, None),
        (b, f, Some(b), true, 40, 10, None),
        (f, f, None, false, 64, 700, None),
        (f, f, None, true, 9, 1500, None),
        (d, d, Some(f), true, 33, 40, None),
        // Rows of 3 f16 logits, an f32 gradient: not whole vectors, one by one.
        (h, f, None, false, 5, 3, None),
        // Padded: a vocabulary of 8193 in rows of 8200, read as vectors; padded and
        // summed; padded rows not whole vectors.
        (b, f, Some(b), false, 70, 8200, Some(8193)),
        (h, f, Some(h), true, 40, 1008, Some(1001)),
        (f, f, None, false, 7, 13, Some(11)),
    ];
    for (logits, compute, grad_dtype, column_sum, n, width, classes) in cases {
        let x = rand(&mut r, logits, &[n, width], -4.0, 4.0);
        let c = classes.unwrap_or(width);
        let labels: Vec<f64> = (0..n).map(|i| ((i * 7) % c) as f64).collect();
        let l = t(DType::I64, &[n], &labels);
        let dl = t(compute, &[], &[1024.0]);
        let op = SoftmaxCrossEntropyWithGrad {
            grad_dtype,
            column_sum,
            classes,
        };
        // Sums of n values compare at the scale of the values they add.
        check_scaled(
            &mut gpu,
            &format!("{op:?} {logits} {n}x{width}"),
            op.clone(),
            &[x, l, dl],
            16.0,
        );
    }
    // Each row's gradient from non-finite logits, read as vectors (bf16 rows of 16)
    // and one by one (rows of 13): -inf logits beside finite ones, a +inf logit, a
    // row of -inf, a NaN.
    let (inf, nan) = (f64::INFINITY, f64::NAN);
    for (dtype, width) in [(DType::BF16, 16), (DType::F32, 13)] {
        let mut v = r.vec(4 * width, -4.0, 4.0);
        v[0] = -inf;
        v[5] = -inf;
        v[width + 3] = inf;
        v[2 * width..3 * width].fill(-inf);
        v[3 * width + 7] = nan;
        let x = t(dtype, &[4, width], &v);
        let l = t(DType::I64, &[4], &[1.0, 2.0, 0.0, 4.0]);
        let dl = t(DType::F32, &[], &[1.0]);
        for classes in [None, Some(width - 1)] {
            let op = SoftmaxCrossEntropyWithGrad {
                classes,
                ..Default::default()
            };
            check(
                &mut gpu,
                &format!("{op:?} {dtype} non-finite"),
                op,
                &[x.clone(), l.clone(), dl.clone()],
            );
        }
    }
    // Finite rows with -inf logits: a finite loss.
    let mut v = r.vec(3 * 64, -4.0, 4.0);
    v.iter_mut().step_by(5).for_each(|x| *x = -inf);
    let x = t(DType::F16, &[3, 64], &v);
    let l = t(DType::I64, &[3], &[1.0, 2.0, 3.0]);
    let dl = t(DType::F32, &[], &[1.0]);
    check(
        &mut gpu,
        "-inf logits",
        SoftmaxCrossEntropyWithGrad::default(),
        &[x, l, dl],
    );
}

#[test]
fn layer_norm_and_grad() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(6);
    for d in FLOATS {
        for (shape, axis) in [
            (vec![4, 16], -1i64),
            (vec![3, 2, 300], 1),
            (vec![5, 1024], 1),
            (vec![7, 768], -1),
            (vec![700, 40], -1),
            // Longer than a warp holds: the block-per-row kernels.
            (vec![3, 1500], -1),
        ] {
            let x = rand(&mut r, d, &shape, -2.0, 2.0);
            let a = if axis < 0 {
                shape.len() - 1
            } else {
                axis as usize
            };
            let gshape = shape[a..].to_vec();
            let g = rand(&mut r, d, &gshape, 0.5, 1.5);
            let b = rand(&mut r, d, &gshape, -0.5, 0.5);
            let dy = rand(&mut r, d, &shape, -1.0, 1.0);
            let what = format!("{d} {shape:?} axis {axis}");
            check(
                &mut gpu,
                &format!("LayerNorm {what}"),
                LayerNorm {
                    axis,
                    epsilon: 1e-5,
                    to: None,
                },
                &[x.clone(), g.clone(), b],
            );
            check_scaled(
                &mut gpu,
                &format!("LayerNormGrad {what}"),
                LayerNormGrad::new(axis, 1e-5),
                &[x, g, dy],
                2.0,
            );
        }
    }
    // Casts folded in: 16-bit x (and dy) read and widened into f32 parameters' math,
    // the output stored in 16 bits or f32; word rows, odd rows and block rows.
    for narrow in [DType::F16, DType::BF16] {
        for shape in [vec![7usize, 768], vec![5, 40], vec![3, 1500]] {
            let len = shape[1];
            let x = rand(&mut r, narrow, &shape, -2.0, 2.0);
            let dy = rand(&mut r, narrow, &shape, -1.0, 1.0);
            let g = rand(&mut r, DType::F32, &[len], 0.5, 1.5);
            let b = rand(&mut r, DType::F32, &[len], -0.5, 0.5);
            for to in [Some(narrow), None] {
                let ln = LayerNorm {
                    axis: -1,
                    epsilon: 1e-5,
                    to,
                };
                let what = format!("LayerNorm {narrow} {shape:?} to {to:?}");
                check(&mut gpu, &what, ln, &[x.clone(), g.clone(), b.clone()]);
            }
            let grad = LayerNormGrad::new(-1, 1e-5);
            let what = format!("LayerNormGrad {narrow} {shape:?}");
            check_scaled(&mut gpu, &what, grad, &[x, g, dy], 2.0);
        }
    }
}

/// LayerNormGrad's epilogue: the residual added to dx and the column sums, on the
/// row kernels (word rows, odd rows, a warp taking several rows of 9000), the block
/// kernels (rows of 1500) and normalised rows that are not the summed columns.
#[test]
fn layer_norm_grad_epilogue() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(16);
    let epilogues = [
        NormGradEpilogue {
            residual: true,
            ..Default::default()
        },
        NormGradEpilogue {
            sum_dx: true,
            ..Default::default()
        },
        NormGradEpilogue {
            residual: true,
            sum_dx: true,
            sum_residual: true,
        },
    ];
    for d in FLOATS {
        for (shape, axis) in [
            (vec![4, 16], -1i64),
            (vec![7, 768], -1),
            (vec![700, 40], -1),
            (vec![9000, 32], -1),
            (vec![3, 1500], -1),
            (vec![3, 2, 300], 1),
        ] {
            let a = shape.len() - if axis < 0 { 1 } else { 2 };
            let x = rand(&mut r, d, &shape, -2.0, 2.0);
            let g = rand(&mut r, d, &shape[a..], 0.5, 1.5);
            let dy = rand(&mut r, d, &shape, -1.0, 1.0);
            let residual = rand(&mut r, d, &shape, -1.0, 1.0);
            let rows: usize = shape[..shape.len() - 1].iter().product();
            for epilogue in epilogues {
                let mut inputs = vec![x.clone(), g.clone(), dy.clone()];
                if epilogue.residual {
                    inputs.push(residual.clone());
                }
                let op = LayerNormGrad {
                    epilogue,
                    ..LayerNormGrad::new(axis, 1e-5)
                };
                let what = format!("{d} {shape:?} axis {axis} {epilogue:?}");
                let (dev, cpu) = run_both(&mut gpu, &what, op, &inputs);
                assert_eq!(dev.len(), 3 + epilogue.sums(), "{what}");
                for (k, (a, b)) in dev.iter().zip(&cpu).enumerate() {
                    // Sums of many rows compare at the scale of the values they add,
                    // and f32 sums of 16-bit values to the 16-bit values' tolerance
                    // (either side's dx may round to the neighbouring value).
                    let scale = if k == 0 {
                        2.0
                    } else {
                        2.0 * (rows as f64).sqrt()
                    };
                    assert_close_to(&format!("{what} output {k}"), a, b, scale, tol(d));
                }
            }
        }
    }
}

/// FusedMatMul's epilogues with (m, k, n): odd and Tensor-Core-aligned sizes.
const EPILOGUE_CASES: [(Epilogue, (usize, usize, usize)); 3] = [
    (Epilogue::Bias, (33, 70, 17)),
    (Epilogue::BiasRelu, (64, 32, 24)),
    (Epilogue::BiasGeluTanh, (40, 16, 48)),
];

#[test]
fn matmul_and_batch_matmul() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(7);
    for d in FLOATS {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (m, k, n) = (33, 70, 17);
            let a = rand(
                &mut r,
                d,
                &if ta { vec![k, m] } else { vec![m, k] },
                -1.0,
                1.0,
            );
            let b = rand(
                &mut r,
                d,
                &if tb { vec![n, k] } else { vec![k, n] },
                -1.0,
                1.0,
            );
            check_scaled(
                &mut gpu,
                &format!("MatMul {d} {ta} {tb}"),
                MatMul::new(ta, tb),
                &[a, b],
                4.0,
            );
        }
        // Bias and activation in the GEMM's epilogue (the pass leaves f64 products be).
        let epilogues = if d == DType::F64 {
            &[][..]
        } else {
            &EPILOGUE_CASES[..]
        };
        for &(epilogue, (m, k, n)) in epilogues {
            for (ta, tb) in [(false, false), (true, true)] {
                let a = rand(&mut r, d, &if ta { [k, m] } else { [m, k] }, -1.0, 1.0);
                let b = rand(&mut r, d, &if tb { [n, k] } else { [k, n] }, -1.0, 1.0);
                let bias = rand(&mut r, d, &[n], -1.0, 1.0);
                let fused = FusedMatMul {
                    product: MatMul::new(ta, tb),
                    epilogue,
                    to: None,
                    residual: false,
                };
                let what = format!("FusedMatMul {} {d} {ta} {tb}", epilogue.name());
                let inputs = [a, b, bias];
                check_scaled(&mut gpu, &what, fused.clone(), &inputs, 4.0);
                // A residual added as cuBLASLt's C matrix (bias only).
                if epilogue == Epilogue::Bias {
                    let residual = rand(&mut r, d, &[m, n], -4.0, 4.0);
                    let with_residual = FusedMatMul {
                        residual: true,
                        ..fused.clone()
                    };
                    let mut four = inputs.to_vec();
                    four.push(residual);
                    check_scaled(
                        &mut gpu,
                        &format!("{what} residual"),
                        with_residual,
                        &four,
                        4.0,
                    );
                }
                // Stored in f32 by the GEMM: the CPU's f16 result, to the rounding
                // the GPU skips.
                if d != DType::F32 {
                    let wide = FusedMatMul {
                        to: Some(DType::F32),
                        ..fused
                    };
                    let (dev, cpu) = run_both(&mut gpu, &what, wide, &inputs);
                    assert_eq!(dev[0].dtype(), DType::F32);
                    assert_close(
                        &format!("{what} to f32"),
                        &dev[0].cast(d),
                        &cpu[0].cast(d),
                        4.0,
                    );
                }
            }
        }
        let cases: [(&[usize], &[usize], bool, bool); 5] = [
            (&[3, 4, 5], &[3, 5, 6], false, false),
            (&[3, 5, 4], &[3, 6, 5], true, true),
            (&[2, 3, 4, 5], &[1, 5, 6], false, false),
            (&[4, 5], &[2, 3, 5, 6], false, false),
            (&[2, 1, 4, 5], &[1, 3, 5, 6], false, false),
        ];
        for (i, (sa, sb, ax, ay)) in cases.into_iter().enumerate() {
            let a = rand(&mut r, d, sa, -1.0, 1.0);
            let b = rand(&mut r, d, sb, -1.0, 1.0);
            // Every other case scaled in the GEMM (alpha), the last (batches that
            // broadcast both ways) one product per matrix.
            let alpha = if i % 2 == 0 { 0.125 } else { 1.0 };
            check_scaled(
                &mut gpu,
                &format!("BatchMatMul {d} {sa:?} {sb:?} alpha {alpha}"),
                BatchMatMul::new(ax, ay).with_alpha(alpha),
                &[a, b],
                2.0,
            );
        }
    }
}

/// An update's inputs: `flag`, a variable of `d` and a gradient of `gd` of `shape`,
/// the rule's slots, its step (3) and the gradient scale if any.
fn update_inputs(
    r: &mut Rng,
    flag: &Tensor,
    (d, gd, grad_scale): (DType, DType, Option<f64>),
    rule: Rule,
    factor: Option<f64>,
    shape: &[usize],
) -> Vec<Tensor> {
    let mut inputs = vec![
        flag.clone(),
        rand(r, d, shape, -1.0, 1.0),
        rand(r, gd, shape, -1.0, 1.0),
    ];
    for _ in rule.slots() {
        inputs.push(rand(r, d, shape, 0.0, 1.0));
    }
    if rule.uses_step() {
        inputs.push(Tensor::scalar(DType::I64, 3.0));
    }
    inputs.extend(factor.map(|f| Tensor::scalar(DType::F32, f)));
    inputs.extend(grad_scale.map(|s| Tensor::scalar(d, s)));
    inputs
}

/// An update by `rule`; the scaled forms (a 16-bit gradient `gd` unscaled in the
/// variable's dtype) also write the new variable in `gd`; `scheduled` reads its rate's
/// factor.
fn scaled_update(
    rule: Rule,
    gd: DType,
    grad_scale: Option<f64>,
    scheduled: bool,
) -> OptimizerUpdate {
    OptimizerUpdate {
        grad_scale: grad_scale.is_some(),
        cast_to: grad_scale.map(|_| gd),
        scheduled,
        ..OptimizerUpdate::new(rule, 0.01, 0.01)
    }
}

#[test]
fn training_ops() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(8);
    let yes = Tensor::scalar(DType::Bool, 1.0);
    let no = Tensor::scalar(DType::Bool, 0.0);
    for d in HALF_AND_F32 {
        let ok = rand(&mut r, d, &[5, 7], -1.0, 1.0);
        let bad = t(d, &[2], &[1.0, f64::INFINITY]);
        let nan = t(d, &[2], &[f64::NAN, 1.0]);
        let plain = AllFinite::default();
        check(
            &mut gpu,
            "AllFinite ok",
            plain.clone(),
            &[ok.clone(), ok.clone()],
        );
        check(
            &mut gpu,
            "AllFinite inf",
            plain.clone(),
            &[ok.clone(), bad.clone()],
        );
        check(&mut gpu, "AllFinite nan", plain.clone(), &[nan, ok.clone()]);
        // Eleven tensors of two dtypes (lists of at most 8 per launch): the bad
        // value in the last, then none.
        let other = if d == DType::F32 {
            DType::F16
        } else {
            DType::F32
        };
        let mut many: Vec<Tensor> = (0..10)
            .map(|i| {
                if i % 3 == 0 {
                    ok.cast(other)
                } else {
                    ok.clone()
                }
            })
            .collect();
        many.push(bad);
        check(&mut gpu, "AllFinite eleven, inf last", plain.clone(), &many);
        many.pop();
        many.push(ok.clone());
        check(&mut gpu, "AllFinite eleven", plain, &many);
        // Scaled: the products are checked, in the scale's dtype. 60000 * 1e35
        // overflows f32; times 2^-10 it does not.
        let scaled = AllFinite { scaled: true };
        let big = t(d, &[2], &[60000.0, 1.0]);
        for (s, what) in [(1e35, "overflows"), (1.0 / 1024.0, "fits")] {
            check(
                &mut gpu,
                &format!("AllFinite scaled {d} {what}"),
                scaled.clone(),
                &[ok.clone(), big.clone(), Tensor::scalar(DType::F32, s)],
            );
        }
    }
    for cd in [DType::I64, DType::I32, DType::F32] {
        let c = Tensor::scalar(cd, 41.0);
        check(
            &mut gpu,
            "IncrementIf yes",
            IncrementIf,
            &[yes.clone(), c.clone()],
        );
        check(&mut gpu, "IncrementIf no", IncrementIf, &[no.clone(), c]);
    }
    let lsu = LossScaleUpdate {
        growth_interval: 3,
        growth_factor: 2.0,
        backoff_factor: 0.5,
    };
    for (f, good) in [(&yes, 0.0), (&yes, 2.0), (&no, 1.0)] {
        check(
            &mut gpu,
            "LossScaleUpdate",
            lsu.clone(),
            &[
                f.clone(),
                Tensor::scalar(DType::F32, 1024.0),
                Tensor::scalar(DType::I64, good),
            ],
        );
    }
    check(
        &mut gpu,
        "LossScaleUpdate floor",
        lsu,
        &[
            no.clone(),
            Tensor::scalar(DType::F32, 1.0),
            Tensor::scalar(DType::I32, 0.0),
        ],
    );
    let rules = [
        Rule::PLAIN_SGD,
        Rule::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        Rule::Sgd {
            momentum: 0.9,
            nesterov: true,
        },
        Rule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-7,
            decoupled: false,
        },
        Rule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-7,
            decoupled: true,
        },
        Rule::Lamb {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-6,
        },
    ];
    // (variable dtype, gradient dtype, gradient scale): the scaled forms read a
    // 16-bit gradient and unscale it in the variable's dtype, and write a cast.
    let kinds = [
        (DType::F32, DType::F32, None),
        (DType::F16, DType::F16, None),
        (DType::F64, DType::F64, None),
        (DType::F32, DType::F16, Some(1.0 / 1024.0)),
        (DType::F64, DType::BF16, Some(0.5)),
    ];
    for (d, gd, grad_scale) in kinds {
        for rule in rules {
            for flag in [&yes, &no] {
                // 2107 elements: the vectorised loops leave a tail for every dtype.
                let inputs =
                    update_inputs(&mut r, flag, (d, gd, grad_scale), rule, None, &[301, 7]);
                let op = scaled_update(rule, gd, grad_scale, false);
                check(
                    &mut gpu,
                    &format!(
                        "OptimizerUpdate {d} grad {gd} scale {grad_scale:?} {rule:?} {:?}",
                        flag.to_f64_vec()
                    ),
                    op,
                    &inputs,
                );
            }
        }
    }
    // Scheduled: the rate times a factor read from the device (every rule, the
    // kernel's rate argument beside the step and before the gradient scale).
    for (d, gd, grad_scale) in [kinds[0], kinds[3]] {
        for rule in rules {
            let inputs = update_inputs(
                &mut r,
                &yes,
                (d, gd, grad_scale),
                rule,
                Some(0.37),
                &[301, 7],
            );
            check(
                &mut gpu,
                &format!("OptimizerUpdate scheduled {d} grad {gd} scale {grad_scale:?} {rule:?}"),
                scaled_update(rule, gd, grad_scale, true),
                &inputs,
            );
        }
    }
    // An f32 gradient read rounded to bf16 (`grad-round-into-update`), every rule:
    // the kernels round as the CPU's Cast does (the slots' new values differ by the
    // rounding otherwise).
    for rule in rules {
        let inputs = update_inputs(&mut r, &yes, kinds[0], rule, None, &[301, 7]);
        let op = OptimizerUpdate {
            grad_rounded_to: Some(DType::BF16),
            ..scaled_update(rule, DType::F32, None, false)
        };
        check(
            &mut gpu,
            &format!("OptimizerUpdate rounded {rule:?}"),
            op,
            &inputs,
        );
    }
    // Grouped: 35 members of 1 to 300 values (two launches of at most 32), each
    // with its own values, against the members' updates on the CPU; scheduled too.
    for (d, gd, grad_scale) in [kinds[0], kinds[3]] {
        for (rule, factor) in [(rules[1], None), (rules[4], None), (rules[4], Some(0.37))] {
            let update = OptimizerUpdate {
                // The unscaled f32 members read their gradients rounded to bf16.
                grad_rounded_to: (gd == DType::F32).then_some(DType::BF16),
                ..scaled_update(rule, gd, grad_scale, factor.is_some())
            };
            let inputs: Vec<Tensor> = (0..35)
                .flat_map(|m| {
                    let shape = [(m * 37) % 300 + 1];
                    update_inputs(&mut r, &yes, (d, gd, grad_scale), rule, factor, &shape)
                })
                .collect();
            check(
                &mut gpu,
                &format!(
                    "GroupedOptimizerUpdate {d} grad {gd} scale {grad_scale:?} {rule:?} factor {factor:?}"
                ),
                GroupedOptimizerUpdate {
                    update,
                    members: 35,
                },
                &inputs,
            );
        }
    }
    // Dropout alone (a fused program of one instruction): every float dtype, vector
    // loops with a tail, counts whose masks differ, rates 0.1 and 0.5.
    for d in FLOATS {
        let x = rand(&mut r, d, &[301, 7], -2.0, 2.0);
        for (rate, count) in [(0.1, 0.0), (0.1, 5.0), (0.5, 123456.0)] {
            check(
                &mut gpu,
                &format!("Dropout {d} rate {rate} count {count}"),
                Dropout::new(rate, 42).unwrap(),
                &[x.clone(), Tensor::scalar(DType::F32, count)],
            );
        }
    }
    // Schedules' factors at counts in the warmup, the annealing and after it.
    for schedule in [
        LearningRateSchedule::warmup_cosine(4, 10, 0.1),
        LearningRateSchedule::warmup_linear(0, 7, 0.0),
    ] {
        for cd in [DType::I64, DType::F32] {
            for count in [0.0, 1.0, 3.0, 4.0, 5.0, 6.5, 8.0, 10.0, 11.0, 1e6] {
                check(
                    &mut gpu,
                    &format!("{schedule:?} at {count} ({cd})"),
                    schedule,
                    &[Tensor::scalar(cd, count)],
                );
            }
        }
    }
}

#[test]
fn variables_live_on_the_device_and_assignments_apply_at_step_end() {
    let Some(mut gpu) = gpu() else { return };
    let mut g = Graph::new();
    let v = g.variable("v", DType::F32, [3]).unwrap();
    let one = g.scalar(DType::F32, 1.0).unwrap();
    let v1 = g.add(Binary::new(BinaryKind::Add), &[v, one]).unwrap();
    let assign = g.add(AssignVariable, &[v, v1]).unwrap();
    let read = g.add(Unary::new(UnaryKind::Identity), &[v]).unwrap();
    gpu.set_variable("v", t(DType::F32, &[3], &[1.0, 2.0, 3.0]))
        .unwrap();
    for step in 0..3 {
        let out = gpu.run(&g, &Feeds::new(), &[read, assign]).unwrap();
        let base = step as f64;
        assert_eq!(
            out[0].to_f64_vec(),
            vec![1.0 + base, 2.0 + base, 3.0 + base],
            "reads the old value"
        );
        assert_eq!(
            out[1].to_f64_vec(),
            vec![2.0 + base, 3.0 + base, 4.0 + base]
        );
    }
    assert_eq!(gpu.variable("v").unwrap().to_f64_vec(), vec![4.0, 5.0, 6.0]);
    assert!(gpu.peak_bytes() > 0);
}

/// An op no CUDA family lowers.
#[derive(Clone, Debug, PartialEq)]
struct Opaque;

impl Op for Opaque {
    fn name(&self) -> &'static str {
        "Opaque"
    }
    fn arity(&self) -> ampgraph_graph::op::Arity {
        ampgraph_graph::op::Arity::Exactly(1)
    }
    fn infer(&self, inputs: &[&TensorType]) -> Result<Vec<TensorType>, String> {
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> Result<Vec<Tensor>, String> {
        Ok(vec![inputs[0].clone()])
    }
}

/// Bools from uniform draws: true with probability `p`.
fn bools(r: &mut Rng, shape: &[usize], p: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| f64::from(u8::from(r.next() < p))).collect();
    t(DType::Bool, shape, &v)
}

/// Integers in -3..=3 (ties for the comparisons).
fn small_ints(r: &mut Rng, n: usize) -> Vec<f64> {
    r.vec(n, -3.0, 3.0).iter().map(|v| v.round()).collect()
}

#[test]
fn select_compare_gather_and_pad() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(11);
    let values = [FLOATS.as_slice(), &[DType::I32, DType::I64, DType::Bool]].concat();
    // Where, broadcasting all three ways (cond over a row, a column, b a scalar).
    for &d in &values {
        let cond = bools(&mut r, &[4, 1, 5], 0.5);
        let a = rand(&mut r, d, &[3, 5], -4.0, 4.0);
        let b = rand(&mut r, d, &[], -4.0, 4.0);
        check(
            &mut gpu,
            &format!("Where {d}"),
            Where,
            &[cond, a.clone(), b],
        );
        let full = bools(&mut r, &[3, 5], 0.3);
        let b = rand(&mut r, d, &[3, 5], -4.0, 4.0);
        check(&mut gpu, &format!("Where same {d}"), Where, &[full, a, b]);
    }
    // Comparisons on small integers (ties), broadcast; Equal on bools.
    for d in [FLOATS.as_slice(), &[DType::I32, DType::I64]].concat() {
        for kind in CompareKind::ALL {
            let a = t(d, &[6, 1, 7], &small_ints(&mut r, 42));
            let b = t(d, &[5, 7], &small_ints(&mut r, 35));
            check(
                &mut gpu,
                &format!("{kind:?} {d}"),
                Compare::new(kind),
                &[a, b],
            );
        }
    }
    let (a, b) = (bools(&mut r, &[3, 1, 8], 0.5), bools(&mut r, &[4, 8], 0.5));
    check(
        &mut gpu,
        "Equal bool",
        Compare::new(CompareKind::Equal),
        &[a.clone(), b.clone()],
    );
    for kind in LogicalKind::ALL {
        check(
            &mut gpu,
            &format!("{kind:?}"),
            Logical::new(kind),
            &[a.clone(), b.clone()],
        );
    }
    check(&mut gpu, "Not", Not, &[bools(&mut r, &[5, 9], 0.5)]);
    // Gather: negative indices, each axis, both index dtypes, inner slices of odd and
    // whole-word sizes, a scalar index: (data shape, axis, index dtype, indices'
    // shape, indices).
    type GatherCase = (
        &'static [usize],
        i64,
        DType,
        &'static [usize],
        &'static [f64],
    );
    let gathers: [GatherCase; 5] = [
        (
            &[4, 6, 3],
            1,
            DType::I64,
            &[2, 3],
            &[0.0, -1.0, 5.0, -6.0, 2.0, 2.0],
        ),
        (&[4, 6, 3], -1, DType::I32, &[4], &[2.0, -3.0, 0.0, 1.0]),
        (&[5, 8], 0, DType::I32, &[3, 1], &[4.0, -5.0, 0.0]),
        (&[7, 2, 16], 0, DType::I64, &[], &[-2.0]),
        (
            &[2, 9, 4, 2],
            2,
            DType::I64,
            &[5],
            &[3.0, -4.0, 1.0, -1.0, 0.0],
        ),
    ];
    for d in FLOATS {
        for (shape, axis, index, ishape, idx) in gathers {
            let x = rand(&mut r, d, shape, -4.0, 4.0);
            let i = t(index, ishape, idx);
            check(
                &mut gpu,
                &format!("Gather {shape:?} axis {axis} {d}"),
                Gather::new(axis),
                &[x.clone(), i.clone()],
            );
            // Its gradient: repeated indices (2, 2 in the first case) accumulate.
            let gathered = Gather::new(axis).eval(&[&x, &i]).expect("gather")[0].ty();
            let dy = rand(&mut r, d, &gathered.shape, -1.0, 1.0);
            check(
                &mut gpu,
                &format!("GatherGrad {shape:?} axis {axis} {d}"),
                GatherGrad::new(axis, shape.to_vec()),
                &[dy, i],
            );
        }
    }
    // Pad: every mode, with crops, reflections wider than the kept axis.
    type PadCase = (&'static [usize], Vec<[i64; 2]>, PadMode);
    let pads: [PadCase; 6] = [
        (
            &[3, 4, 5],
            vec![[1, 2], [-1, 2], [0, -2]],
            PadMode::Constant(1.5),
        ),
        (&[3, 4, 5], vec![[2, 3], [1, 1], [3, 0]], PadMode::Reflect),
        (&[4, 5], vec![[-1, 5], [4, -2]], PadMode::Reflect),
        (&[4, 1, 5], vec![[1, 2], [2, 1], [-2, 3]], PadMode::Reflect),
        (&[3, 4, 5], vec![[2, -1], [0, 3], [1, 1]], PadMode::Edge),
        (
            &[2, 3, 6, 6],
            vec![[0, 0], [0, 0], [1, 1], [1, 1]],
            PadMode::Constant(0.0),
        ),
    ];
    for &d in &values {
        for (shape, p, mode) in &pads {
            let x = rand(&mut r, d, shape, -4.0, 4.0);
            let op = Pad::new(p.clone(), *mode);
            check(
                &mut gpu,
                &format!("Pad {shape:?} {p:?} {mode:?} {d}"),
                op,
                &[x],
            );
        }
    }
}

#[test]
fn resize_nearest_and_linear() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(12);
    // Up, down, 1-D, and NCHW with one axis up and one down.
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[2, 2], &[4, 4]),
        (&[4, 4], &[2, 2]),
        (&[5], &[12]),
        (&[2, 3, 5, 7], &[2, 3, 9, 4]),
    ];
    let modes = [
        (
            ResizeMode::Nearest(NearestMode::RoundPreferFloor),
            CoordinateTransform::HalfPixel,
        ),
        (
            ResizeMode::Nearest(NearestMode::Floor),
            CoordinateTransform::Asymmetric,
        ),
        (ResizeMode::Linear, CoordinateTransform::HalfPixel),
        (ResizeMode::Linear, CoordinateTransform::AlignCorners),
        (ResizeMode::Linear, CoordinateTransform::Asymmetric),
        (
            ResizeMode::Nearest(NearestMode::RoundPreferCeil),
            CoordinateTransform::AlignCorners,
        ),
        (
            ResizeMode::Nearest(NearestMode::Ceil),
            CoordinateTransform::TfHalfPixelForNn,
        ),
        (ResizeMode::Linear, CoordinateTransform::PytorchHalfPixel),
    ];
    for d in FLOATS {
        for (from, to) in shapes {
            for (mode, coordinates) in modes {
                let x = rand(&mut r, d, from, -4.0, 4.0);
                check(
                    &mut gpu,
                    &format!("Resize {from:?} -> {to:?} {mode:?} {coordinates:?} {d}"),
                    Resize::new(to, mode, coordinates),
                    &[x],
                );
            }
        }
    }
}

#[test]
fn unsupported_ops_are_clear_errors() {
    // No device needed: the check happens before anything runs.
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [1, 8, 8, 3]).unwrap();
    g.add_node("mystery", Box::new(Opaque), &[x]).unwrap();
    let err = CudaExecutor::check_supported(&g).unwrap_err().to_string();
    assert!(
        err.contains(
            "(Opaque): Opaque has no CUDA kernel for inputs (f32[1, 8, 8, 3]); use Device::Cpu"
        ),
        "the lowering names the op and its input types: {err}"
    );
    assert!(err.contains("mystery"), "names the node: {err}");
}

/// (n, h, w, c, k, r, s, strides, padding): odd sizes, channels not multiples of 8,
/// batch 1, SAME (its asymmetric cases included), VALID and explicit pads (symmetric,
/// more before than after, more after than before, wider than the window), strides 1
/// to 3.
type ConvCase = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    [usize; 2],
    Padding,
);

const CONV_SHAPES: [ConvCase; 13] = [
    (1, 5, 7, 3, 4, 3, 3, [1, 1], Padding::Same),
    (2, 8, 8, 5, 6, 3, 3, [2, 2], Padding::Same),
    (2, 9, 6, 17, 8, 3, 2, [2, 1], Padding::Valid),
    (1, 7, 7, 8, 16, 1, 1, [2, 2], Padding::Same),
    (3, 6, 10, 4, 3, 4, 4, [1, 1], Padding::Same),
    (2, 5, 5, 3, 2, 5, 5, [1, 1], Padding::Valid),
    (2, 11, 13, 6, 5, 3, 3, [3, 2], Padding::Same),
    (4, 16, 16, 16, 32, 3, 3, [1, 1], Padding::Same),
    // PyTorch's `padding=1` at stride 2: cuDNN's own padding, no copy.
    (
        2,
        8,
        8,
        5,
        6,
        3,
        3,
        [2, 2],
        Padding::Explicit([[1, 1], [1, 1]]),
    ),
    // Before > after: zeros added at the input's start.
    (
        1,
        7,
        9,
        3,
        4,
        3,
        3,
        [1, 2],
        Padding::Explicit([[2, 0], [3, 1]]),
    ),
    // After > before: zeros added at its end.
    (
        2,
        6,
        7,
        4,
        5,
        3,
        2,
        [2, 1],
        Padding::Explicit([[0, 2], [1, 3]]),
    ),
    // Both at once, pads wider than the window (windows of zeros only).
    (
        1,
        5,
        6,
        2,
        3,
        2,
        3,
        [1, 1],
        Padding::Explicit([[4, 1], [0, 5]]),
    ),
    // A 1x1 window with cuDNN padding wider than it.
    (
        2,
        5,
        5,
        8,
        8,
        1,
        1,
        [1, 1],
        Padding::Explicit([[1, 1], [3, 2]]),
    ),
];

/// Grouped convolutions (case, groups): depthwise (groups = channels, as MobileNet's)
/// with multipliers 1 and 2 and PyTorch's `padding=1`, groups of 8 channels, a grouped
/// 1x1, asymmetric SAME and explicit pads (the input extended around cuDNN's padding).
const GROUPED_CONV_SHAPES: [(ConvCase, usize); 7] = [
    ((2, 8, 8, 6, 6, 3, 3, [1, 1], Padding::Same), 6),
    ((1, 9, 7, 4, 8, 3, 3, [2, 2], Padding::Same), 4),
    (
        (
            2,
            12,
            12,
            32,
            32,
            3,
            3,
            [1, 1],
            Padding::Explicit([[1, 1], [1, 1]]),
        ),
        32,
    ),
    (
        (
            2,
            8,
            8,
            16,
            32,
            3,
            3,
            [2, 2],
            Padding::Explicit([[1, 1], [1, 1]]),
        ),
        2,
    ),
    ((1, 7, 9, 6, 9, 1, 1, [1, 1], Padding::Valid), 3),
    (
        (
            2,
            6,
            7,
            4,
            6,
            3,
            2,
            [2, 1],
            Padding::Explicit([[0, 2], [1, 3]]),
        ),
        2,
    ),
    ((4, 16, 16, 64, 64, 3, 3, [1, 1], Padding::Same), 64),
];

/// Dilated convolutions (case, groups, dilations): DeepLabV3's atrous 3x3 at rates 2
/// and 12 (PyTorch's `padding=dilation`), SAME with uneven rates (asymmetric padding
/// over the dilated span), a dilated depthwise one, a strided one.
const DILATED_CONV_SHAPES: [(ConvCase, usize, [usize; 2]); 5] = [
    (
        (
            2,
            16,
            16,
            8,
            8,
            3,
            3,
            [1, 1],
            Padding::Explicit([[2, 2], [2, 2]]),
        ),
        1,
        [2, 2],
    ),
    (
        (
            1,
            28,
            28,
            16,
            8,
            3,
            3,
            [1, 1],
            Padding::Explicit([[12, 12], [12, 12]]),
        ),
        1,
        [12, 12],
    ),
    ((2, 9, 10, 4, 6, 3, 2, [1, 1], Padding::Same), 1, [2, 3]),
    ((2, 12, 12, 8, 8, 3, 3, [1, 1], Padding::Same), 8, [2, 2]),
    ((1, 13, 11, 4, 4, 3, 3, [2, 2], Padding::Valid), 1, [2, 1]),
];

#[test]
fn convolutions_and_their_gradients_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(11);
    let mut failures: Vec<String> = Vec::new();
    // Every case runs (a failure is kept, not raised) so one run shows them all.
    macro_rules! try_check {
        ($gpu:expr, $what:expr, $op:expr, $inputs:expr, $scale:expr $(,)?) => {
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                check_scaled($gpu, $what, $op, $inputs, $scale)
            }));
            if let Err(e) = run {
                failures.push(e.downcast_ref::<String>().cloned().unwrap_or_default());
            }
        };
    }
    for format in [DataFormat::Nhwc, DataFormat::Nchw] {
        for d in FLOATS {
            let dense = CONV_SHAPES.iter().map(|&c| (c, 1, [1, 1]));
            let grouped = GROUPED_CONV_SHAPES.iter().map(|&(c, g)| (c, g, [1, 1]));
            for ((n, h, w, c, k, kh, kw, strides, padding), groups, dilations) in
                dense.chain(grouped).chain(DILATED_CONV_SHAPES)
            {
                let image = |c: usize, h: usize, w: usize| match format {
                    DataFormat::Nhwc => vec![n, h, w, c],
                    DataFormat::Nchw => vec![n, c, h, w],
                };
                let x = rand(&mut r, d, &image(c, h, w), -1.0, 1.0);
                let f = rand(&mut r, d, &[kh, kw, c / groups, k], -1.0, 1.0);
                let conv = Conv2D::new(strides, padding, format)
                    .with_groups(groups)
                    .with_dilations(dilations);
                let what = format!(
                    "{format:?} {d} x{:?} f{:?} groups {groups} dilations {dilations:?} \
                     {strides:?} {padding:?}",
                    x.shape(),
                    f.shape()
                );
                let (ys, _) = run_both(&mut gpu, &what, conv.clone(), &[x.clone(), f.clone()]);
                let dy = rand(&mut r, d, ys[0].shape(), -1.0, 1.0);
                // Errors grow with the terms a sum adds: judge them against its typical size.
                let terms = (kh * kw * c / groups) as f64;
                try_check!(
                    &mut gpu,
                    &format!("Conv2D {what}"),
                    conv.clone(),
                    &[x.clone(), f.clone()],
                    terms.sqrt(),
                );
                let dx = Conv2DBackpropInput {
                    input_shape: x.shape().to_vec(),
                    conv: conv.clone(),
                };
                if d == DType::F64 && format == DataFormat::Nhwc {
                    let err = CudaExecutor::check_supported(
                        &op_graph(Box::new(dx), &[f.clone(), dy.clone()]).0,
                    )
                    .expect_err("no f64 NHWC gradients");
                    assert!(
                        err.to_string()
                            .contains("no f64 NHWC convolution gradients"),
                        "{err}"
                    );
                    continue;
                }
                let terms = (kh * kw * k / groups) as f64;
                try_check!(
                    &mut gpu,
                    &format!("Conv2DBackpropInput {what}"),
                    dx,
                    &[f.clone(), dy.clone()],
                    terms.sqrt(),
                );
                let df = Conv2DBackpropFilter {
                    filter_shape: f.shape().to_vec(),
                    conv,
                };
                let terms = (dy.len() / k) as f64;
                try_check!(
                    &mut gpu,
                    &format!("Conv2DBackpropFilter {what}"),
                    df,
                    &[x, dy],
                    terms.sqrt(),
                );
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let chosen = gpu.conv_algorithms();
    assert!(!chosen.is_empty(), "the chosen algorithms are listed");
    println!(
        "{} cuDNN algorithm choices, e.g. {}",
        chosen.len(),
        chosen[0]
    );
}

#[test]
fn batch_norm_and_its_gradient_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(12);
    // Channels-last statistics read whole 16-byte words where the channels fill them
    // (8 and 24 channels, and many row chunks at 64; 1024 f64 channels are too many
    // words for a block) and 32-column tiles otherwise (3 and 5 channels).
    let shapes: [(&[usize], DataFormat); 7] = [
        (&[2, 5, 7, 3], DataFormat::Nhwc),
        (&[1, 4, 4, 8], DataFormat::Nhwc),
        (&[3, 6, 5, 4], DataFormat::Nchw),
        (&[16, 5], DataFormat::Nhwc),
        (&[8, 9, 9, 24], DataFormat::Nhwc),
        (&[32, 16, 16, 64], DataFormat::Nhwc),
        (&[2, 3, 3, 1024], DataFormat::Nhwc),
    ];
    for d in FLOATS {
        let u = if d == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for (shape, format) in shapes {
            let c = if format == DataFormat::Nchw && shape.len() == 4 {
                shape[1]
            } else {
                shape[shape.len() - 1]
            };
            let x = rand(&mut r, d, shape, -2.0, 3.0);
            let scale = rand(&mut r, u, &[c], 0.5, 1.5);
            let offset = rand(&mut r, u, &[c], -0.5, 0.5);
            let mean = rand(&mut r, u, &[c], -0.2, 0.2);
            let var = rand(&mut r, u, &[c], 0.5, 2.0);
            let inputs = [x.clone(), scale.clone(), offset, mean, var];
            for activation in [NormActivation::Identity, NormActivation::Relu] {
                for training in [true, false] {
                    let bn = BatchNorm {
                        epsilon: 1e-3,
                        training,
                        data_format: format,
                        activation,
                        ..BatchNorm::default()
                    };
                    let what = format!(
                        "BatchNorm {d} {shape:?} {format:?} training {training} {activation:?}"
                    );
                    check(&mut gpu, &what, bn.clone(), &inputs);
                    // A side input (a residual) on channels-last values, as
                    // fuse-batchnorm-activation makes it.
                    if format == DataFormat::Nhwc {
                        let mut with_side = inputs.to_vec();
                        with_side.push(rand(&mut r, d, shape, -2.0, 2.0));
                        check(&mut gpu, &format!("{what} side input"), bn, &with_side);
                    }
                }
                // The gradient reads the forward's batch statistics (and, with the
                // ReLU, its offset).
                let bn = BatchNorm {
                    epsilon: 1e-3,
                    training: true,
                    data_format: format,
                    activation,
                    ..BatchNorm::default()
                };
                let (_, forward) = run_both(&mut gpu, "statistics", bn, &inputs);
                let dy = rand(&mut r, d, shape, -1.0, 1.0);
                let grad = BatchNormGrad {
                    epsilon: 1e-3,
                    training: true,
                    data_format: format,
                    activation,
                };
                let what = format!("BatchNormGrad {d} {shape:?} {format:?} {activation:?}");
                let count = (x.len() / c) as f64;
                let mut grad_inputs = vec![
                    x.clone(),
                    scale.clone(),
                    forward[1].clone(),
                    forward[2].clone(),
                    dy,
                ];
                if activation == NormActivation::Relu {
                    grad_inputs.push(inputs[2].clone());
                }
                check_scaled(&mut gpu, &what, grad, &grad_inputs, count.sqrt());
                // The inference form's gradient (the synchronised batch norm's) reads
                // the given statistics; channels-last values only.
                if format == DataFormat::Nhwc || shape.len() == 2 {
                    let grad = BatchNormGrad {
                        epsilon: 1e-3,
                        training: false,
                        data_format: format,
                        activation,
                    };
                    grad_inputs[2] = inputs[3].clone();
                    grad_inputs[3] = inputs[4].clone();
                    let what = format!("{what} inference form");
                    check_scaled(&mut gpu, &what, grad, &grad_inputs, count.sqrt());
                }
            }
        }
    }
}

#[test]
fn conv_algorithms_are_timed_once_then_read_from_disk_and_deterministic_ones_repeat() {
    let Some(_) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("ampgraph-cudnn-{}", std::process::id()));
    let cache = ampgraph_exec::KernelCache::Dir(dir.clone());
    let mut r = Rng(13);
    let x = rand(&mut r, DType::F16, &[4, 12, 12, 16], -1.0, 1.0);
    let dy = rand(&mut r, DType::F16, &[4, 12, 12, 24], -1.0, 1.0);
    let df = Conv2DBackpropFilter {
        filter_shape: vec![3, 3, 16, 24],
        conv: Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc),
    };
    let run = |options: ExecOptions| {
        let mut gpu = CudaExecutor::with_kernel_cache(0, options, &cache).expect("executor");
        let (out, _) = run_both(&mut gpu, "dfilter", df.clone(), &[x.clone(), dy.clone()]);
        (out, gpu.conv_algorithms())
    };
    let (_, timed) = run(ExecOptions::default());
    assert!(
        timed.iter().all(|c| c.ms.is_some() && c.candidates > 0),
        "timed: {timed:?}"
    );
    let file = std::fs::read_dir(&dir).unwrap().flatten().find(|e| {
        e.file_name()
            .to_string_lossy()
            .starts_with("cudnn-algorithms")
    });
    assert!(file.is_some(), "the choices are kept in {}", dir.display());
    let (_, stored) = run(ExecOptions::default());
    assert!(
        stored.iter().all(|c| c.ms.is_none()),
        "read from disk: {stored:?}"
    );
    assert_eq!(timed[0].algorithm, stored[0].algorithm);
    // Deterministic algorithms give the same bits every run.
    let deterministic = ExecOptions {
        conv: cuda::DnnOptions {
            deterministic: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let (a, _) = run(deterministic);
    let (b, _) = run(deterministic);
    assert_eq!(a[0].to_f64_vec(), b[0].to_f64_vec());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn no_cuda_is_a_clear_error_not_a_panic() {
    match cuda::available() {
        Ok(n) => println!("CUDA available: {n} device(s)"),
        Err(why) => {
            let err = CudaExecutor::new(0)
                .err()
                .expect("no CUDA, no executor")
                .to_string();
            assert!(err.contains("CUDA is not available"), "{err}");
            assert!(err.contains(&why), "{err}");
        }
    }
}

/// The largest magnitude of a tensor (at least `floor`): the scale its errors are
/// measured against where outputs are sums of many rounded products.
fn magnitude(t: &Tensor, floor: f64) -> f64 {
    t.to_f64_vec().iter().fold(floor, |m, v| m.max(v.abs()))
}

#[test]
fn fused_attention_and_its_gradient() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(13);
    // (batch, heads, q_len, k_len, head_dim, scale): whole and partial 64-row tiles,
    // cross attention, every head width the kernels take, and large scores (scale 2)
    // that move the running maximum between tiles; each plain and causal; heads
    // wider than 64 (96, 128: every kernel in narrow blocks). Two cases walk several
    // blocks each way, causal ones where a block's queries see
    // none of the keys past the diagonal (q300 k130) and where keys lie past every
    // query (q70 k300: dk and dv zero there). Every case also runs with a key bias
    // (one row for all batches where the batch is odd, else one per batch): values in
    // [-2, 2], and -inf on the last third of the keys (padding) in batch 0. The
    // self-attention (q100 k100) runs packed too: q, k and v one [B, S, 3, H, D] input.
    let cases = [
        (2, 3, 80, 100, 64, 0.125),
        (1, 2, 128, 64, 32, 1.0 / 32f64.sqrt()),
        (3, 1, 17, 130, 16, 0.25),
        (1, 2, 64, 192, 48, 2.0),
        (1, 2, 300, 130, 64, 0.125),
        (2, 1, 70, 300, 32, 0.25),
        (1, 2, 150, 140, 128, 1.0 / 128f64.sqrt()),
        (2, 1, 70, 90, 96, 0.125),
        (2, 3, 100, 100, 64, 0.125),
    ];
    let masks = [(false, false), (true, false), (false, true), (true, true)];
    let masked_cases = cases.iter().flat_map(|&c| masks.map(|m| (c, m)));
    for d in [DType::F16, DType::BF16] {
        let cases = masked_cases.clone();
        // Self-attentions once more with q, k and v packed in one tensor.
        let packed = masked_cases
            .clone()
            .filter(|((_, _, sq, sk, ..), _)| sq == sk);
        let cases = cases.map(|c| (c, false)).chain(packed.map(|c| (c, true)));
        for (((b, h, sq, sk, hd, scale), (causal, key_bias)), packed) in cases {
            let what = format!(
                "{d} b{b} h{h} q{sq} k{sk} d{hd} scale {scale} causal {causal} key bias {key_bias} packed {packed}"
            );
            let mut forward = if packed {
                vec![rand(&mut r, d, &[b, sq, 3, h, hd], -2.0, 2.0)]
            } else {
                vec![
                    rand(&mut r, d, &[b, sq, h, hd], -2.0, 2.0),
                    rand(&mut r, d, &[b, sk, h, hd], -2.0, 2.0),
                    rand(&mut r, d, &[b, sk, h, hd], -1.0, 1.0),
                ]
            };
            let qkv = forward.clone();
            let bias = key_bias.then(|| {
                let rows = if b % 2 == 1 { 1 } else { b };
                let mut values = rand(&mut r, d, &[rows * sk], -2.0, 2.0).to_f64_vec();
                values[2 * sk.div_ceil(3)..sk].fill(f64::NEG_INFINITY);
                Tensor::from_f64(d, vec![rows, 1, 1, sk], &values).unwrap()
            });
            forward.extend(bias.clone());
            // Attention dropout on every other shape: the kernels' masks are the CPU's.
            let dropout = (sq % 2 == 0).then(|| Dropout::new(0.2, 1234 + sq as u64).unwrap());
            let count = dropout.map(|_| t(DType::F32, &[], &[3.0]));
            let what = format!("{what} dropout {}", dropout.is_some());
            forward.extend(count.clone());
            let (dev, cpu) = run_both(
                &mut gpu,
                &what,
                FusedAttention {
                    scale,
                    causal,
                    key_bias,
                    packed,
                    dropout,
                },
                &forward,
            );
            assert_close(&format!("FusedAttention o {what}"), &dev[0], &cpu[0], 1.0);
            assert_close(&format!("FusedAttention lse {what}"), &dev[1], &cpu[1], 1.0);
            let d_o = rand(&mut r, d, &[b, sq, h, hd], -1.0, 1.0);
            let mut inputs = qkv;
            inputs.extend([cpu[0].clone(), cpu[1].clone(), d_o]);
            inputs.extend(bias);
            inputs.extend(count);
            let (dev, cpu) = run_both(
                &mut gpu,
                &what,
                FusedAttentionGrad {
                    scale,
                    causal,
                    key_bias,
                    packed,
                    dropout,
                },
                &inputs,
            );
            let names = if packed {
                &["dqkv"][..]
            } else {
                &["dq", "dk", "dv"][..]
            };
            for (k, name) in names.iter().enumerate() {
                let what = format!("FusedAttentionGrad {name} {what}");
                assert_close(&what, &dev[k], &cpu[k], magnitude(&cpu[k], 1e-3));
            }
        }
    }
}

/// Outputs equal bit for bit (NaN matching NaN).
fn assert_identical(what: &str, (dev, cpu): (Vec<Tensor>, Vec<Tensor>)) {
    for (k, (a, b)) in dev.iter().zip(&cpu).enumerate() {
        assert_eq!(a.ty(), b.ty(), "{what} output {k}: types differ");
        let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
        let same = |(p, q): (&f64, &f64)| p == q || (p.is_nan() && q.is_nan());
        if let Some(i) = x.iter().zip(&y).position(|pair| !same(pair)) {
            panic!(
                "{what} output {k}: element {i}: gpu {} vs cpu {}",
                x[i], y[i]
            );
        }
    }
}

/// A layer norm cast to FP8 by one kernel (`norm-into-fp8`'s LayerNormQuantizeFp8)
/// gives on the GPU what the LayerNorm and QuantizeFp8 kernels give apart, bit for bit:
/// GPT-2's bf16 rows of 768 with f32 parameters (16-byte words, a partial band of 32
/// rows), f32 rows of 104 into E5M2 (a value a lane), rows of 64 in more bands than
/// the grid's blocks (the grid strides), and a cast without the transposed copy.
#[test]
fn layer_norm_cast_to_fp8_equals_the_norm_and_the_cast_apart() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(45);
    let cases = [
        (DType::BF16, DType::F32, [2056, 768], DType::F8E4M3, true),
        (DType::F32, DType::F32, [40, 104], DType::F8E5M2, true),
        (DType::BF16, DType::BF16, [32_800, 64], DType::F8E4M3, true),
        (DType::BF16, DType::F32, [16, 768], DType::F8E4M3, false),
    ];
    for (x_ty, params, [rows, len], to, transposed) in cases {
        let what =
            format!("LayerNormQuantizeFp8 {x_ty} x, {params} gamma, [{rows}, {len}] -> {to}");
        // Rows of different means and spreads; gamma and beta away from 1 and 0.
        let x: Vec<f64> = (r.vec(rows * len, -3.0, 3.0).into_iter().enumerate())
            .map(|(i, v)| v * (1.0 + (i / len % 5) as f64) + (i / len % 3) as f64)
            .collect();
        let feeds: Feeds = [("x".to_string(), t(x_ty, &[rows, len], &x))]
            .into_iter()
            .collect();
        let (gamma, beta) = (r.vec(len, 0.5, 1.5), r.vec(len, -0.5, 0.5));
        let norm = LayerNorm {
            to: Some(DType::BF16),
            ..LayerNorm::default()
        };
        let cast = QuantizeFp8::new(to).unwrap().with_transposed(transposed);
        let mut run = |fused: bool| {
            let mut g = Graph::new();
            let xp = g.placeholder("x", x_ty, [rows, len]).unwrap();
            let gp = g.add(Const::new(t(params, &[len], &gamma)), &[]).unwrap();
            let bp = g.add(Const::new(t(params, &[len], &beta)), &[]).unwrap();
            let scale = g.scalar(DType::F32, 37.0).unwrap();
            let q = if fused {
                let op = LayerNormQuantizeFp8::new(norm.clone(), cast.clone()).unwrap();
                g.add_node("q", Box::new(op), &[xp, gp, bp, scale]).unwrap()
            } else {
                let y = g.add(norm.clone(), &[xp, gp, bp]).unwrap();
                g.add_node("q", Box::new(cast.clone()), &[y, scale])
                    .unwrap()
            };
            let outs: Vec<Port> = (0..2 + usize::from(transposed))
                .map(|k| Port::new(q, k))
                .collect();
            g.set_outputs(outs.clone()).unwrap();
            gpu.run(&g, &feeds, &outs)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
        };
        let (fused, apart) = (run(true), run(false));
        assert_eq!(fused.len(), 2 + usize::from(transposed));
        assert_identical(&what, (fused, apart));
    }
}

/// A layer norm's gradient casting its dx to FP8 as it stores it
/// (`norm-grad-into-fp8`'s LayerNormGradQuantizeFp8) gives on the GPU what the
/// LayerNormGrad and QuantizeFp8 kernels give apart: dx, the casts, their amax and the
/// transposed copies bit for bit, dgamma, dbeta and the column sums to rounding (the
/// kernels add their rows in blocks of their own). GPT-2's bf16 rows of 768 with the
/// residual added and dx summed (16-byte words, blocks of several bands, a partial
/// one), every sum of a few rows, f32 rows of 128 into E5M2; and where the fused kernel
/// does not take the rows (f32 rows of 104, a cast without the transposed copy) the
/// kernels apart.
#[test]
fn layer_norm_grad_cast_to_fp8_equals_the_gradient_and_the_cast_apart() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(46);
    let dx_sum = NormGradEpilogue {
        residual: true,
        sum_dx: true,
        sum_residual: false,
    };
    let every_sum = NormGradEpilogue {
        sum_residual: true,
        ..dx_sum
    };
    let cases = [
        (DType::BF16, [2056, 768], dx_sum, DType::F8E5M2, true),
        (DType::BF16, [72, 768], every_sum, DType::F8E4M3, true),
        (DType::F32, [40, 128], every_sum, DType::F8E5M2, true),
        (DType::F32, [40, 104], dx_sum, DType::F8E5M2, true),
        (DType::BF16, [16, 768], dx_sum, DType::F8E5M2, false),
    ];
    for (d, [rows, len], epilogue, to, transposed) in cases {
        let what = format!("LayerNormGradQuantizeFp8 {d} [{rows}, {len}] {epilogue:?} -> {to}");
        let n = rows * len;
        // Rows of different means and spreads; gradients that saturate once scaled.
        let x: Vec<f64> = (r.vec(n, -3.0, 3.0).into_iter().enumerate())
            .map(|(i, v)| v * (1.0 + (i / len % 5) as f64) + (i / len % 3) as f64)
            .collect();
        let feeds: Feeds = [
            ("x".to_string(), t(d, &[rows, len], &x)),
            ("dy".to_string(), t(d, &[rows, len], &r.vec(n, -2.0, 2.0))),
            ("r".to_string(), t(d, &[rows, len], &r.vec(n, -1.0, 1.0))),
        ]
        .into_iter()
        .collect();
        let gamma = r.vec(len, 0.5, 1.5);
        let grad = LayerNormGrad {
            epilogue,
            ..LayerNormGrad::new(-1, 1e-5)
        };
        let cast = QuantizeFp8::new(to).unwrap().with_transposed(transposed);
        let grad_outs = 3 + epilogue.sums();
        let outputs = grad_outs + 2 + usize::from(transposed);
        let mut run = |fused: bool| {
            let mut g = Graph::new();
            let mut inputs: Vec<Port> = ["x", "dy", "r"]
                .map(|name| g.placeholder(name, d, [rows, len]).unwrap())
                .to_vec();
            let gp = g.add(Const::new(t(d, &[len], &gamma)), &[]).unwrap();
            inputs.insert(1, gp);
            let scale = g.scalar(DType::F32, 60.0).unwrap();
            let outs: Vec<Port> = if fused {
                inputs.push(scale);
                let op = LayerNormGradQuantizeFp8::new(grad.clone(), cast.clone()).unwrap();
                let node = g.add_node("q", Box::new(op), &inputs).unwrap();
                (0..outputs).map(|k| Port::new(node, k)).collect()
            } else {
                let dx = g.add(grad.clone(), &inputs).unwrap();
                let q = g
                    .add_node("q", Box::new(cast.clone()), &[dx, scale])
                    .unwrap();
                let mut outs: Vec<Port> = (0..grad_outs).map(|k| Port::new(dx.node, k)).collect();
                outs.extend((0..outputs - grad_outs).map(|k| Port::new(q, k)));
                outs
            };
            g.set_outputs(outs.clone()).unwrap();
            gpu.run(&g, &feeds, &outs)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
        };
        let (fused, apart) = (run(true), run(false));
        assert_eq!(fused.len(), outputs, "{what}");
        for (k, (a, b)) in fused.iter().zip(&apart).enumerate() {
            if (1..grad_outs).contains(&k) {
                let scale = 2.0 * (rows as f64).sqrt();
                assert_close_to(&format!("{what} output {k}"), a, b, scale, tol(d));
            } else {
                assert_identical(
                    &format!("{what} output {k}"),
                    (vec![a.clone()], vec![b.clone()]),
                );
            }
        }
    }
}

/// An attention casting its output to FP8 as its forward kernel stores it
/// (`attention-into-fp8`'s FusedAttentionQuantizeFp8) gives on the GPU what the
/// attention and the cast of its `[B S, H D]` rows give apart, bit for bit: o, lse,
/// the cast, its amax and its transposed copy. bf16 heads of 64 packed (blocks of 128
/// rows) and apart, a key bias with dropout, heads of 128 (blocks of 64 rows), f16
/// into E5M2; scales that saturate some values.
#[test]
fn attention_cast_to_fp8_equals_the_attention_and_the_cast_apart() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(48);
    // (dtype, batch, seq, heads, head width, packed, key bias and dropout, FP8 dtype)
    let cases = [
        (DType::BF16, 2, 128, 3, 64, true, false, DType::F8E4M3),
        (DType::BF16, 1, 192, 2, 64, false, false, DType::F8E4M3),
        (DType::BF16, 2, 64, 2, 32, true, true, DType::F8E4M3),
        (DType::BF16, 1, 128, 2, 128, true, false, DType::F8E4M3),
        (DType::F16, 1, 64, 4, 16, false, false, DType::F8E5M2),
    ];
    for (d, b, s, h, hd, packed, masked, to) in cases {
        let what = format!(
            "FusedAttentionQuantizeFp8 {d} b{b} s{s} h{h} d{hd} packed {packed} bias and dropout {masked} -> {to}"
        );
        let attention = FusedAttention {
            scale: 1.0 / (hd as f64).sqrt(),
            causal: false,
            key_bias: masked,
            packed,
            dropout: masked.then(|| Dropout::new(0.2, 77).unwrap()),
        };
        let names: &[&str] = if packed { &["qkv"] } else { &["q", "k", "v"] };
        let shape = |name: &str| -> Vec<usize> {
            if name == "qkv" {
                vec![b, s, 3, h, hd]
            } else {
                vec![b, s, h, hd]
            }
        };
        let mut feeds: Feeds = (names.iter())
            .map(|&n| (n.to_string(), rand(&mut r, d, &shape(n), -2.0, 2.0)))
            .collect();
        if masked {
            feeds.insert("bias".into(), rand(&mut r, d, &[b, 1, 1, s], -2.0, 2.0));
        }
        let quantize = QuantizeFp8::new(to).unwrap().with_transposed(true);
        let mut run = |fused: bool| {
            let mut g = Graph::new();
            let mut inputs: Vec<Port> = (names.iter())
                .map(|&n| g.placeholder(n, d, shape(n)).unwrap())
                .collect();
            if masked {
                inputs.push(g.placeholder("bias", d, [b, 1, 1, s]).unwrap());
                inputs.push(g.scalar(DType::F32, 3.0).unwrap());
            }
            let scale = g.scalar(DType::F32, 200.0).unwrap();
            let outs: Vec<Port> = if fused {
                inputs.push(scale);
                let op =
                    FusedAttentionQuantizeFp8::new(attention.clone(), quantize.clone()).unwrap();
                let node = g.add_node("a", Box::new(op), &inputs).unwrap();
                (0..5).map(|k| Port::new(node, k)).collect()
            } else {
                let node = g
                    .add_node("a", Box::new(attention.clone()), &inputs)
                    .unwrap();
                let o = Port::new(node, 0);
                let rows = g
                    .add(Reshape::new([(b * s) as i64, (h * hd) as i64]), &[o])
                    .unwrap();
                let q = g
                    .add_node("cast", Box::new(quantize.clone()), &[rows, scale])
                    .unwrap();
                vec![
                    o,
                    Port::new(node, 1),
                    Port::new(q, 0),
                    Port::new(q, 1),
                    Port::new(q, 2),
                ]
            };
            g.set_outputs(outs.clone()).unwrap();
            gpu.run(&g, &feeds, &outs)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
        };
        let (fused, apart) = (run(true), run(false));
        assert_eq!(fused.len(), 5, "{what}");
        assert_identical(&what, (fused, apart));
    }
}

/// A packed attention gradient cast to FP8 as its kernels store it
/// (`attention-grad-into-fp8`'s FusedAttentionGradQuantizeFp8) gives on the GPU what
/// the gradient kernels and the cast of the `[B S, 3 H D]` matrix give apart: the cast,
/// its amax and its transposed copy bit for bit, the column sums to rounding (added in
/// other blocks). The transformer's bf16 heads of 64 (dq in blocks of 128 rows, two
/// bands of 64), causal heads of 32 in a longer sequence, a key bias with dropout,
/// heads of 128 (every kernel in blocks of 64 rows), f16 into E4M3; scales that
/// saturate some values.
#[test]
fn attention_grad_cast_to_fp8_equals_the_gradient_and_the_cast_apart() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(47);
    // (dtype, batch, seq, heads, head width, causal, key bias and dropout, FP8 dtype)
    let cases = [
        (DType::BF16, 2, 128, 3, 64, false, false, DType::F8E5M2),
        (DType::BF16, 1, 192, 2, 32, true, false, DType::F8E5M2),
        (DType::BF16, 2, 64, 2, 64, false, true, DType::F8E5M2),
        (DType::BF16, 1, 128, 2, 128, true, false, DType::F8E5M2),
        (DType::F16, 1, 64, 4, 16, false, false, DType::F8E4M3),
    ];
    for (d, b, s, h, hd, causal, masked, to) in cases {
        let what = format!(
            "FusedAttentionGradQuantizeFp8 {d} b{b} s{s} h{h} d{hd} causal {causal} bias and dropout {masked} -> {to}"
        );
        let dropout = masked.then(|| Dropout::new(0.2, 99).unwrap());
        let forward = FusedAttention {
            scale: 1.0 / (hd as f64).sqrt(),
            causal,
            key_bias: masked,
            packed: true,
            dropout,
        };
        let grad = FusedAttentionGrad {
            scale: forward.scale,
            causal,
            key_bias: masked,
            packed: true,
            dropout,
        };
        let mut feeds: Feeds = [
            (
                "qkv".to_string(),
                rand(&mut r, d, &[b, s, 3, h, hd], -2.0, 2.0),
            ),
            ("do".to_string(), rand(&mut r, d, &[b, s, h, hd], -1.0, 1.0)),
        ]
        .into_iter()
        .collect();
        if masked {
            feeds.insert("bias".into(), rand(&mut r, d, &[b, 1, 1, s], -2.0, 2.0));
        }
        let width = 3 * h * hd;
        let mut run = |fused: bool| {
            let mut g = Graph::new();
            let qkv = g.placeholder("qkv", d, [b, s, 3, h, hd]).unwrap();
            let d_o = g.placeholder("do", d, [b, s, h, hd]).unwrap();
            let mut extra = Vec::new();
            if masked {
                extra.push(g.placeholder("bias", d, [b, 1, 1, s]).unwrap());
                extra.push(g.scalar(DType::F32, 3.0).unwrap());
            }
            let fwd_inputs: Vec<Port> = [qkv].into_iter().chain(extra.iter().copied()).collect();
            let o = g
                .add_node("attention", Box::new(forward.clone()), &fwd_inputs)
                .unwrap();
            let mut inputs = vec![qkv, Port::new(o, 0), Port::new(o, 1), d_o];
            inputs.extend(extra);
            let scale = g.scalar(DType::F32, 24.0).unwrap();
            let rows_ty = TensorType::new(d, [b * s, width]);
            let load = ampgraph_graph::ops::fused::Instr {
                expr: ampgraph_graph::ops::fused::Expr::Input(0),
                ty: rows_ty,
            };
            let program = FusedElementwise::new(vec![load], vec![0])
                .unwrap()
                .with_column_sums(vec![0])
                .unwrap();
            let quantize = QuantizeFp8::new(to).unwrap().with_transposed(true);
            let cast = FusedQuantizeFp8::new(quantize, program).unwrap();
            let node = if fused {
                inputs.push(scale);
                let op = FusedAttentionGradQuantizeFp8::new(grad.clone(), cast).unwrap();
                g.add_node("q", Box::new(op), &inputs).unwrap()
            } else {
                let dqkv = g.add(grad.clone(), &inputs).unwrap();
                let rows = g
                    .add(Reshape::new([(b * s) as i64, width as i64]), &[dqkv])
                    .unwrap();
                g.add_node("q", Box::new(cast), &[rows, scale]).unwrap()
            };
            let outs: Vec<Port> = (0..4).map(|k| Port::new(node, k)).collect();
            g.set_outputs(outs.clone()).unwrap();
            gpu.run(&g, &feeds, &outs)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
        };
        let (fused, apart) = (run(true), run(false));
        assert_eq!(fused.len(), 4, "{what}");
        for (k, (a, b)) in fused.iter().zip(&apart).enumerate() {
            if k == 3 {
                assert_close_to(
                    &format!("{what} column sums"),
                    a,
                    b,
                    (s as f64).sqrt(),
                    tol(d),
                );
            } else {
                assert_identical(
                    &format!("{what} output {k}"),
                    (vec![a.clone()], vec![b.clone()]),
                );
            }
        }
    }
}

/// A group of weights' FP8 casts (`group-fp8-casts`' GroupedQuantizeFp8) against the
/// CPU bit for bit: 34 bf16 members to E4M3 (two launches of the table's 32 rows), of
/// one tile, partial tiles, more tiles than one member's blocks; 3 f32 members to
/// E5M2. Each member its own scale; values saturate once scaled.
#[test]
fn grouped_fp8_casts_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(45);
    let shapes = [
        (64, 64),
        (8, 8),
        (16, 104),
        (200, 72),
        (2112, 2048),
        (0, 16),
    ];
    // Whole tiles only (the kernel without bounds: `Tiles`).
    let whole = [(64, 64), (2112, 2048), (128, 192)];
    for (x_ty, to, members, shapes) in [
        (DType::BF16, DType::F8E4M3, 34, &shapes[..]),
        (DType::F32, DType::F8E5M2, 3, &shapes[..]),
        (DType::BF16, DType::F8E4M3, 5, &whole[..]),
    ] {
        let mut inputs = Vec::new();
        for m in 0..members {
            let (rows, cols) = shapes[m % shapes.len()];
            inputs.push(t(x_ty, &[rows, cols], &r.vec(rows * cols, -700.0, 700.0)));
            inputs.push(t(DType::F32, &[], &[0.25 + 0.01 * m as f64]));
        }
        assert_identical(
            &format!("GroupedQuantizeFp8 of {members} {x_ty} -> {to}"),
            run_both(
                &mut gpu,
                "grouped quantize",
                GroupedQuantizeFp8::new(to, members).unwrap(),
                &inputs,
            ),
        );
    }
}

/// The FP8 ops (issue 44) against the CPU reference: quantisation and its amax, the
/// scales of both recipes, the history and dequantisation bit for bit; the FP8
/// product (each transpose, the mixed formats, 16-bit and f32 results) within its
/// f32 accumulation's rounding; shapes cuBLASLt's FP8 products do not take refused.
#[test]
fn fp8_ops_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(44);
    for x_ty in HALF_AND_F32 {
        for to in [DType::F8E4M3, DType::F8E5M2] {
            let what = format!("{x_ty} -> {to}");
            // Beyond both formats' range once scaled (saturation), and tiny values
            // (subnormals and zeros).
            let mut v = r.vec(1600, -700.0, 700.0);
            v[3] = 1e-5;
            v[4] = -0.0;
            v[5] = 250_000.0;
            let x = t(x_ty, &[16, 100], &v);
            let scale = t(DType::F32, &[], &[0.37]);
            assert_identical(
                &format!("QuantizeFp8 {what}"),
                run_both(
                    &mut gpu,
                    "quantize",
                    QuantizeFp8::new(to).unwrap(),
                    &[x.clone(), scale],
                ),
            );
            // With the transposed copy: fused for sides that are multiples of 8 (one
            // partial tile; more tiles than blocks, so the grid strides), after the
            // quantisation otherwise (in words for multiples of 4, else bytes).
            let mut shapes = vec![(16, 104), (16, 100), (10, 30)];
            if (x_ty, to) == (DType::BF16, DType::F8E4M3) {
                shapes.push((2112, 2048));
            }
            for (rows, cols) in shapes {
                let values = r.vec(rows * cols, -700.0, 700.0);
                assert_identical(
                    &format!("QuantizeFp8 {what} transposed [{rows}, {cols}]"),
                    run_both(
                        &mut gpu,
                        "quantize",
                        QuantizeFp8::new(to).unwrap().with_transposed(true),
                        &[t(x_ty, &[rows, cols], &values), t(DType::F32, &[], &[0.37])],
                    ),
                );
            }
            for margin in [0, 2] {
                assert_identical(
                    &format!("Fp8Scale {what} margin {margin}"),
                    run_both(
                        &mut gpu,
                        "scale",
                        Fp8Scale::new(to, margin).unwrap(),
                        &[x.clone()],
                    ),
                );
            }
            let zeros = t(x_ty, &[40], &[0.0; 40]);
            let mut with_nan = v.clone();
            with_nan[77] = f64::NAN;
            for special in [zeros, t(x_ty, &[16, 100], &with_nan)] {
                assert_identical(
                    &format!("Fp8Scale {what} of zeros or a NaN"),
                    run_both(&mut gpu, "scale", Fp8Scale::new(to, 0).unwrap(), &[special]),
                );
            }
            let y = t(to, &[16, 100], &r.vec(1600, -400.0, 400.0));
            assert_identical(
                &format!("DequantizeFp8 {what}"),
                run_both(
                    &mut gpu,
                    "dequantize",
                    DequantizeFp8::new(x_ty).unwrap(),
                    &[y, t(DType::F32, &[], &[0.013])],
                ),
            );
        }
    }
    // An activation folded into the scale and the cast (`activation-into-fp8`) computes
    // on the GPU what the Unary and the casts apart compute, bit for bit (the Unary
    // kernel's expression, rounded to bf16 alike); the CPU's erf may differ from
    // CUDA's in the last bit of an f32. Partial tiles and whole ones (`Tiles`).
    let gelu = UnaryKind::Gelu { approximate: false };
    for (transposed, rows, cols) in [(false, 64, 96), (true, 64, 96), (true, 128, 192)] {
        let z = t(DType::BF16, &[rows, cols], &r.vec(rows * cols, -6.0, 6.0));
        let mut run = |fold: bool| {
            let mut g = Graph::new();
            let zp = g.placeholder("z", DType::BF16, [rows, cols]).unwrap();
            let (x, activation) = match fold {
                true => (zp, Some(gelu)),
                false => (g.add(Unary::new(gelu), &[zp]).unwrap(), None),
            };
            let scale_op = Fp8Scale::new(DType::F8E4M3, 0).unwrap();
            let scale = g.add(scale_op.with_activation(activation), &[x]).unwrap();
            let q = QuantizeFp8::new(DType::F8E4M3).unwrap();
            let q = q.with_transposed(transposed).with_activation(activation);
            let q = g.add_node("q", Box::new(q), &[x, scale]).unwrap();
            let mut outs = vec![scale, Port::new(q, 0), Port::new(q, 1)];
            outs.extend(transposed.then(|| Port::new(q, 2)));
            g.set_outputs(outs.clone()).unwrap();
            let feeds: Feeds = [("z".to_string(), z.clone())].into_iter().collect();
            gpu.run(&g, &feeds, &outs).unwrap()
        };
        let (folded, apart) = (run(true), run(false));
        assert_identical(
            &format!(
                "GELU into Fp8Scale and QuantizeFp8 [{rows}, {cols}] (transposed {transposed})"
            ),
            (folded, apart),
        );
    }
    for n in [1, 7, 1024] {
        let history = t(DType::F32, &[n], &r.vec(n, 0.0, 50.0));
        for amax in [AmaxChoice::Max, AmaxChoice::MostRecent] {
            for m in [3.5, 0.0, f64::INFINITY, f64::NAN] {
                let op = Fp8ScaleUpdate {
                    scale: Fp8Scale::new(DType::F8E4M3, 1).unwrap(),
                    amax,
                    members: 1,
                };
                let inputs = [
                    history.clone(),
                    t(DType::F32, &[], &[m]),
                    t(DType::F32, &[], &[2.5]),
                    t(DType::F32, &[], &[0.4]),
                ];
                assert_identical(
                    &format!("Fp8ScaleUpdate n {n} {amax:?} amax {m}"),
                    run_both(&mut gpu, "update", op, &inputs),
                );
            }
        }
    }
    // A step's updates in one node: 40 members (two launches of 32 and 8), histories
    // of several lengths, every kind of amax.
    let amaxes = [3.5, 0.0, f64::INFINITY, f64::NAN, 700.0];
    let mut inputs = Vec::new();
    for k in 0..40 {
        let n = [1, 7, 1024, 16][k % 4];
        inputs.extend([
            t(DType::F32, &[n], &r.vec(n, 0.0, 50.0)),
            t(DType::F32, &[], &[amaxes[k % amaxes.len()]]),
            t(DType::F32, &[], &[0.25 + k as f64]),
            t(DType::F32, &[], &[1.0]),
        ]);
    }
    for amax in [AmaxChoice::Max, AmaxChoice::MostRecent] {
        let op = Fp8ScaleUpdate {
            scale: Fp8Scale::new(DType::F8E5M2, 0).unwrap(),
            amax,
            members: 40,
        };
        assert_identical(
            &format!("Fp8ScaleUpdate of 40 members, {amax:?}"),
            run_both(&mut gpu, "update", op, &inputs),
        );
    }
    let formats = [
        (DType::F8E4M3, DType::F8E4M3),
        (DType::F8E5M2, DType::F8E4M3),
        (DType::F8E4M3, DType::F8E5M2),
    ];
    // Operands transposed in words (one partial 64x64 tile, then several) and, where
    // m is not a multiple of 4, byte by byte.
    let shapes = [(48, 64, 32), (200, 96, 80), (50, 64, 32)];
    for ((m, k, n), (fa, fb)) in shapes.into_iter().flat_map(|s| formats.map(|f| (s, f))) {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for to in [DType::BF16, DType::F16, DType::F32] {
                let a = rand(
                    &mut r,
                    fa,
                    &if ta { vec![k, m] } else { vec![m, k] },
                    -3.0,
                    3.0,
                );
                let b = rand(
                    &mut r,
                    fb,
                    &if tb { vec![n, k] } else { vec![k, n] },
                    -3.0,
                    3.0,
                );
                let inputs = [
                    a,
                    b,
                    t(DType::F32, &[], &[0.5]),
                    t(DType::F32, &[], &[0.25]),
                ];
                // Each in both modes (the AMP pass sums every product fast by default).
                for fast in [false, true] {
                    let op = Fp8MatMul::new(MatMul::new(ta, tb), to)
                        .unwrap()
                        .with_fast_accumulation(fast);
                    // Terms of up to 9/8 each, k of them: the sums' scale is about
                    // k/8. Hopper's FP8 Tensor Cores accumulate in about 14 bits, not
                    // f32's 24 (DeepSeek-V3's report, §3.3.2): an f32 output is good
                    // to about 2^-12 of that scale (2.6e-4 seen; the fast mode, which
                    // never promotes its partial sums, to 4x that), the 16-bit ones
                    // to their rounding.
                    let within = match (to, fast) {
                        (DType::F32, false) => 1e-3,
                        (DType::F32, true) => 4e-3,
                        _ => tol(to),
                    };
                    check_scaled_to(
                        &mut gpu,
                        &format!(
                            "Fp8MatMul [{m}x{k}] x [{k}x{n}] {fa} x {fb} {ta} {tb} -> {to} \
                             (fast accumulation {fast})"
                        ),
                        op,
                        &inputs,
                        k as f64 / 8.0,
                        within,
                    );
                }
                // A 16-bit result with its bias, its residual (cuBLASLt's C) or both in
                // the epilogue.
                if to != DType::F32 {
                    for (bias, residual) in [(true, false), (false, true), (true, true)] {
                        let op = Fp8MatMul::new(MatMul::new(ta, tb), to)
                            .unwrap()
                            .with_bias(bias)
                            .and_then(|op| op.with_residual(residual))
                            .unwrap();
                        let mut added = inputs.to_vec();
                        if bias {
                            added.push(rand(&mut r, to, &[n], -3.0, 3.0));
                        }
                        if residual {
                            added.push(rand(&mut r, to, &[m, n], -3.0, 3.0));
                        }
                        check_scaled_to(
                            &mut gpu,
                            &format!(
                                "Fp8MatMul [{m}x{k}] x [{k}x{n}] {fa} x {fb} {ta} {tb} -> {to} \
                                 (bias {bias}, residual {residual})"
                            ),
                            op,
                            &added,
                            k as f64 / 8.0,
                            tol(to),
                        );
                    }
                }
            }
        }
    }
    let a = t(DType::F8E4M3, &[16, 24], &[1.0; 16 * 24]);
    let b = t(DType::F8E4M3, &[24, 16], &[1.0; 24 * 16]);
    let (g, feeds, outs) = common::op_graph(
        Box::new(Fp8MatMul::new(MatMul::new(false, false), DType::BF16).unwrap()),
        &[a, b, t(DType::F32, &[], &[1.0]), t(DType::F32, &[], &[1.0])],
    );
    let err = gpu.run(&g, &feeds, &outs).unwrap_err().to_string();
    assert!(err.contains("multiples of 16"), "{err}");
}

/// A fused program's amaxes (`amax-into-elementwise`) against the CPU, bit for bit:
/// `max |v|` of the stored bf16 values of `relu(a * b) - a`, with the program's own
/// kernel (a tail past whole vectors; more blocks' worth of elements than the amax
/// grid, so it strides) and its column-sum kernels (rows of whole vectors and not);
/// a NaN wins. The stored values match too; the sums' order differs from the CPU's.
#[test]
fn fused_amaxes_match_the_cpu() {
    use ampgraph_graph::ops::fused::{Expr, Instr};
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(45);
    for (rows, cols, summed) in [
        (37, 100, false),
        (2112, 2048, false),
        (64, 256, true),
        (33, 100, true),
    ] {
        for nan in [false, true] {
            let ty = TensorType::new(DType::BF16, vec![rows, cols]);
            let input = |k: usize| Instr {
                expr: Expr::Input(k),
                ty: ty.clone(),
            };
            let apply = |op: ElementOp, args: Vec<usize>| Instr {
                expr: Expr::Apply(op, args),
                ty: ty.clone(),
            };
            let mut program = FusedElementwise::new(
                vec![
                    input(0),
                    input(1),
                    apply(ElementOp::Binary(BinaryKind::Mul), vec![0, 1]),
                    apply(ElementOp::Unary(UnaryKind::Relu), vec![2]),
                    apply(ElementOp::Binary(BinaryKind::Sub), vec![3, 0]),
                ],
                vec![4],
            )
            .unwrap();
            if summed {
                program = program.with_column_sums(vec![4]).unwrap();
            }
            let program = program.with_amaxes(vec![4, 3]).unwrap();
            let mut a = r.vec(rows * cols, -3.0, 3.0);
            if nan {
                a[rows * cols / 2 + 1] = f64::NAN;
            }
            let inputs = [
                t(DType::BF16, &[rows, cols], &a),
                rand(&mut r, DType::BF16, &[rows, cols], -40.0, 40.0),
            ];
            let what = format!("amaxes of [{rows}, {cols}] (column sums {summed}, NaN {nan})");
            let (dev, cpu) = run_both(&mut gpu, &what, program, &inputs);
            let last = dev.len() - 2;
            assert_identical(&what, (vec![dev[0].clone()], vec![cpu[0].clone()]));
            assert_identical(&what, (dev[last..].to_vec(), cpu[last..].to_vec()));
            assert_eq!(cpu[last].to_f64_vec()[0].is_nan(), nan, "{what}");
        }
    }
}

/// The FP8 cast of a program's value (`elementwise-into-fp8`): `relu(a * b)` cast to
/// E5M2 with its transposed copy, against the CPU bit for bit (one tile, partial
/// tiles, more tiles than blocks), its column sums within f32's rounding of their
/// terms, and likewise of a program that only loads its input; and the GELU gradient's cast, its bias sum too, equal on the GPU to the
/// program and the cast run apart.
#[test]
fn fp8_casts_of_programs_match_the_cpu_and_the_ops_apart() {
    use ampgraph_graph::ops::fused::{Expr, Instr};
    let Some(mut gpu) = gpu() else { return };
    let mut r = Rng(46);
    let program = |ty: &TensorType, ops: &[(ElementOp, Vec<usize>)], sum: usize| {
        let mut instrs = vec![
            Instr {
                expr: Expr::Input(0),
                ty: ty.clone(),
            },
            Instr {
                expr: Expr::Input(1),
                ty: ty.clone(),
            },
        ];
        for (op, args) in ops {
            instrs.push(Instr {
                expr: Expr::Apply(*op, args.clone()),
                ty: ty.clone(),
            });
        }
        let last = instrs.len() - 1;
        FusedElementwise::new(instrs, vec![last])
            .unwrap()
            .with_column_sums(vec![sum])
            .unwrap()
    };
    let cast = QuantizeFp8::new(DType::F8E5M2)
        .unwrap()
        .with_transposed(true);
    for (rows, cols) in [(64, 128), (72, 200), (2112, 2048)] {
        let ty = TensorType::new(DType::BF16, vec![rows, cols]);
        let relu_product = program(
            &ty,
            &[
                (ElementOp::Binary(BinaryKind::Mul), vec![0, 1]),
                (ElementOp::Unary(UnaryKind::Relu), vec![2]),
            ],
            3,
        );
        let op = FusedQuantizeFp8::new(cast.clone(), relu_product).unwrap();
        let inputs = [
            rand(&mut r, DType::BF16, &[rows, cols], -3.0, 3.0),
            rand(&mut r, DType::BF16, &[rows, cols], -3.0, 3.0),
            t(DType::F32, &[], &[1000.0]),
        ];
        // And the program that only loads its input (a tensor's column sums taken by
        // its cast: an attention gradient's bias sum).
        let load = FusedElementwise::new(
            vec![Instr {
                expr: Expr::Input(0),
                ty: ty.clone(),
            }],
            vec![0],
        )
        .and_then(|p| p.with_column_sums(vec![0]))
        .unwrap();
        let loaded = FusedQuantizeFp8::new(cast.clone(), load).unwrap();
        let loaded_inputs = [inputs[0].clone(), inputs[2].clone()];
        for (what, op, inputs, bound) in [
            ("FusedQuantizeFp8", op, &inputs[..], 9.0),
            (
                "FusedQuantizeFp8 of a load",
                loaded,
                &loaded_inputs[..],
                3.0,
            ),
        ] {
            let what = format!("{what} [{rows}, {cols}]");
            let (dev, cpu) = run_both(&mut gpu, &what, op, inputs);
            assert_identical(&what, (dev[..3].to_vec(), cpu[..3].to_vec()));
            let (got, want) = (dev[3].to_f64_vec(), cpu[3].to_f64_vec());
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                // rows terms of at most `bound` each, summed in f32.
                let within = bound * rows as f64 * 2f64.powi(-22);
                assert!(
                    (g - w).abs() <= within,
                    "{what}: column {j}: gpu {g} vs cpu {w}"
                );
            }
        }
    }
    // The GELU gradient with its bias sum, folded and apart, on the GPU.
    let (rows, cols) = (128, 256);
    let ty = TensorType::new(DType::BF16, vec![rows, cols]);
    let gelu = UnaryKind::Gelu { approximate: false };
    let gradient = program(&ty, &[(ElementOp::UnaryGrad(gelu), vec![0, 1])], 2);
    let z = rand(&mut r, DType::BF16, &[rows, cols], -4.0, 4.0);
    let dy = rand(&mut r, DType::BF16, &[rows, cols], -30.0, 30.0);
    let mut run = |fold: bool| {
        let mut g = Graph::new();
        let zp = g.placeholder("z", DType::BF16, [rows, cols]).unwrap();
        let dyp = g.placeholder("dy", DType::BF16, [rows, cols]).unwrap();
        let scale = g.scalar(DType::F32, 0.25).unwrap();
        let outs: Vec<Port> = if fold {
            let op = FusedQuantizeFp8::new(cast.clone(), gradient.clone()).unwrap();
            let q = g.add_node("q", Box::new(op), &[zp, dyp, scale]).unwrap();
            (0..4).map(|k| Port::new(q, k)).collect()
        } else {
            let p = g
                .add_node("p", Box::new(gradient.clone()), &[zp, dyp])
                .unwrap();
            let q = g.add_node("q", Box::new(cast.clone()), &[Port::new(p, 0), scale]);
            let q = q.unwrap();
            vec![
                Port::new(q, 0),
                Port::new(q, 1),
                Port::new(q, 2),
                Port::new(p, 1),
            ]
        };
        g.set_outputs(outs.clone()).unwrap();
        let feeds: Feeds = [("z".to_string(), z.clone()), ("dy".to_string(), dy.clone())]
            .into_iter()
            .collect();
        gpu.run(&g, &feeds, &outs).unwrap()
    };
    let (folded, apart) = (run(true), run(false));
    assert_identical(
        "the GELU gradient's cast, folded and apart",
        (folded[..3].to_vec(), apart[..3].to_vec()),
    );
    let (got, want) = (folded[3].to_f64_vec(), apart[3].to_f64_vec());
    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 30.0 * 1.2 * rows as f64 * 2f64.powi(-22),
            "bias sum column {j}: {g} vs {w}"
        );
    }
}

/// The FP8 ops lower on their own (no device needed): FP8 placeholders feed them,
/// cuBLASLt's shape rule is checked when the step is planned, and another op on an
/// FP8 tensor is refused by name.
#[test]
fn fp8_ops_lower_and_other_ops_on_fp8_are_refused() {
    let product = |k: usize| {
        let mut g = Graph::new();
        let a = g.placeholder("a", DType::F8E4M3, [32, k]).unwrap();
        let b = g.placeholder("b", DType::F8E5M2, [32, k]).unwrap();
        let one = g.scalar(DType::F32, 1.0).unwrap();
        let op = Fp8MatMul::new(MatMul::new(false, true), DType::BF16).unwrap();
        g.add_node("product", Box::new(op), &[a, b, one, one])
            .unwrap();
        g
    };
    CudaExecutor::check_supported(&product(64)).unwrap();
    let err = CudaExecutor::check_supported(&product(24))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("product") && err.contains("multiples of 16"),
        "{err}"
    );
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F8E4M3, [4]).unwrap();
    g.add_node("wide", Box::new(Cast { to: DType::F32 }), &[x])
        .unwrap();
    let err = CudaExecutor::check_supported(&g).unwrap_err().to_string();
    assert!(
        err.contains("wide") && err.contains("Cast on f8e4m3 tensors has no CUDA kernel"),
        "{err}"
    );
}
