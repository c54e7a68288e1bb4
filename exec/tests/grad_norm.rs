//! Gradients of BatchNorm (training and inference, NHWC/NCHW/rank 2, with and without
//! a side input) and LayerNorm
//! (every axis) against central finite differences, and the kernels of BatchNormGrad
//! and LayerNormGrad against float64 references written here, in f32, f16, bf16 and
//! f64 (BatchNormGrad also with f16/bf16 x and f32 statistics, as under AMP).
//!
//! BatchNorm's gradient rule ignores the gradients of its outputs 1 and 2 (the batch
//! statistics, which feed running averages, not the loss) and in inference gives the
//! given mean and variance no gradient, as TensorFlow does; so its finite-difference
//! check puts only output 0 in the loss and differentiates x, scale and offset.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::op::TypeGroup;
use ampgraph_graph::ops::{
    BatchNorm, BatchNormGrad, DataFormat, LayerNorm, LayerNormGrad, NormActivation,
};
use ampgraph_graph::{DType, Op, Tensor, TensorType};
use common::*;
use proptest::prelude::*;

/// x of `shape` plus scale, offset, mean and variance `[c]` in f64.
fn bn_inputs(rng: &mut Gen, shape: &[usize], c: usize) -> Vec<Tensor> {
    vec![
        t64(shape, &rng.vec(numel(shape), -1.0, 1.0)),
        t64(&[c], &rng.vec(c, 0.5, 1.5)),
        t64(&[c], &rng.vec(c, -0.5, 0.5)),
        t64(&[c], &rng.vec(c, -0.3, 0.3)),
        t64(&[c], &rng.vec(c, 0.2, 1.0)),
    ]
}

/// x's shape for (n, h, w, c) in a layout; rank 2 `[n, c]` when `h == 0`.
fn bn_shape(format: DataFormat, n: usize, h: usize, w: usize, c: usize) -> Vec<usize> {
    match (h, format) {
        (0, _) => vec![n, c],
        (_, DataFormat::Nhwc) => vec![n, h, w, c],
        (_, DataFormat::Nchw) => vec![n, c, h, w],
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn batch_norm_gradient_matches_finite_differences(
        n in 1usize..=3, h in 0usize..=3, w in 1usize..=3, c in 1usize..=3,
        nchw: bool, training: bool, eps in prop_oneof![Just(1e-3), Just(0.1)], seed: u64,
    ) {
        let format = if nchw { DataFormat::Nchw } else { DataFormat::Nhwc };
        // In training the batch statistics need a few elements per channel, else the
        // variance is ~0 and the loss too curved for finite differences.
        let n = if training { n.max(2) + 1 } else { n };
        let shape = bn_shape(format, n, h, w, c);
        let mut rng = Gen(seed);
        let inputs = bn_inputs(&mut rng, &shape, c);
        let op = BatchNorm { epsilon: eps, training, data_format: format, activation: NormActivation::Identity , ..BatchNorm::default() };
        let err = check_output0(Box::new(op), &inputs, &[0, 1, 2], seed);
        prop_assert!(err < GRAD_TOL, "{shape:?} training={training}: max relative error {err:e}");
    }

    #[test]
    fn layer_norm_gradient_matches_finite_differences(
        shape in prop::collection::vec(1usize..=4, 1..=3),
        axis_pick: usize, negative: bool,
        eps in prop_oneof![Just(1e-5), Just(0.1)], seed: u64,
    ) {
        let rank = shape.len();
        let axis = (axis_pick % rank) as i64;
        let axis = if negative { axis - rank as i64 } else { axis };
        let mut rng = Gen(seed);
        let norm: Vec<usize> = shape[(axis.rem_euclid(rank as i64)) as usize..].to_vec();
        let inputs = [
            t64(&shape, &rng.vec(numel(&shape), -1.0, 1.0)),
            t64(&norm, &rng.vec(numel(&norm), 0.5, 1.5)),
            t64(&norm, &rng.vec(numel(&norm), -0.5, 0.5)),
        ];
        // A row of one element normalises to 0 whatever x is: only the epsilon keeps
        // the curvature bounded, so rows have 2+ elements unless epsilon is large.
        prop_assume!(numel(&norm) > 1 || eps > 0.01);
        assert_grad(
            Box::new(LayerNorm {
                axis,
                epsilon: eps,
                to: None,
            }),
            &inputs,
            seed,
        );
    }
}

#[test]
fn batch_norm_gradient_fixed_cases() {
    let mut rng = Gen(1);
    for training in [true, false] {
        for (format, shape, c) in [
            (DataFormat::Nhwc, vec![2, 3, 2, 3], 3),
            (DataFormat::Nchw, vec![2, 3, 2, 3], 3),
            (DataFormat::Nhwc, vec![5, 4], 4),
            (DataFormat::Nchw, vec![5, 4], 4),
        ] {
            let inputs = bn_inputs(&mut rng, &shape, c);
            // With the ReLU, the gradient's mask is recomputed from x and the offset.
            for activation in [NormActivation::Identity, NormActivation::Relu] {
                let op = BatchNorm {
                    epsilon: 1e-3,
                    training,
                    data_format: format,
                    activation,
                    ..BatchNorm::default()
                };
                let err = check_output0(Box::new(op.clone()), &inputs, &[0, 1, 2], 3);
                let what = format!("{format:?} {shape:?} {training} {activation:?}");
                assert!(err < GRAD_TOL, "{what}: {err:e}");
                // With a side input (a residual) added before the activation.
                let mut with_side = inputs.clone();
                with_side.push(t64(&shape, &rng.vec(numel(&shape), -1.0, 1.0)));
                let err = check_output0(Box::new(op), &with_side, &[0, 1, 2, 5], 3);
                assert!(err < GRAD_TOL, "{what} with a side input: {err:e}");
            }
        }
    }
}

#[test]
fn batch_norm_rule_shape() {
    // In inference mean and variance get no gradient: `gradients` gives zeros.
    let mut rng = Gen(2);
    let inputs = bn_inputs(&mut rng, &[2, 3], 3);
    for training in [true, false] {
        let op = BatchNorm {
            epsilon: 1e-3,
            training,
            data_format: DataFormat::Nhwc,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        };
        let grads = graph_gradients(Box::new(op), &inputs);
        assert_eq!(grads.len(), 5);
        assert_eq!(grads[3].to_f64_vec(), [0.0; 3]);
        assert_eq!(grads[4].to_f64_vec(), [0.0; 3]);
        assert!(grads[0].to_f64_vec().iter().any(|&v| v != 0.0));
    }
}

/// Reference BatchNormGrad in f64, NHWC-like `[outer, c, inner]` indexing.
#[allow(clippy::too_many_arguments)]
fn ref_bn_grad(
    x: &[f64],
    dy: &[f64],
    scale: &[f64],
    mean: &[f64],
    var: &[f64],
    (outer, c, inner): (usize, usize, usize),
    eps: f64,
    training: bool,
) -> [Vec<f64>; 3] {
    let n = (outer * inner) as f64;
    let at = |o: usize, ch: usize, i: usize| (o * c + ch) * inner + i;
    let mut dx = vec![0.0; x.len()];
    let mut dscale = vec![0.0; c];
    let mut doffset = vec![0.0; c];
    for ch in 0..c {
        // The biased variance: in training `var` is Bessel-corrected.
        let v = if training && n > 1.0 {
            var[ch] * (n - 1.0) / n
        } else {
            var[ch]
        };
        let inv = 1.0 / (v + eps).sqrt();
        let (mut sdy, mut sdyx) = (0.0, 0.0);
        for o in 0..outer {
            for i in 0..inner {
                let k = at(o, ch, i);
                sdy += dy[k];
                sdyx += dy[k] * (x[k] - mean[ch]) * inv;
            }
        }
        dscale[ch] = sdyx;
        doffset[ch] = sdy;
        for o in 0..outer {
            for i in 0..inner {
                let k = at(o, ch, i);
                let xhat = (x[k] - mean[ch]) * inv;
                dx[k] = if training {
                    scale[ch] * inv * (dy[k] - sdy / n - xhat * sdyx / n)
                } else {
                    dy[k] * scale[ch] * inv
                };
            }
        }
    }
    [dx, dscale, doffset]
}

/// `dy` where the forward's pre-activation `(x - mean) * scale / sqrt(var + eps) +
/// offset` (var biased, as in [`ref_bn_grad`]) is positive, else 0: the ReLU's gradient.
fn relu_masked(
    x: &[f64],
    dy: &[f64],
    [scale, offset, mean, var]: [&[f64]; 4],
    (outer, c, inner): (usize, usize, usize),
    eps: f64,
    training: bool,
) -> Vec<f64> {
    let n = (outer * inner) as f64;
    let biased = if training && n > 1.0 {
        (n - 1.0) / n
    } else {
        1.0
    };
    (x.iter().zip(dy).enumerate())
        .map(|(k, (&xv, &g))| {
            let ch = (k / inner) % c;
            let inv = 1.0 / (var[ch] * biased + eps).sqrt();
            let z = (xv - mean[ch]) * scale[ch] * inv + offset[ch];
            if z > 0.0 {
                g
            } else {
                0.0
            }
        })
        .collect()
}

#[test]
fn batch_norm_grad_kernel_matches_reference() {
    let mut rng = Gen(31);
    for (format, shape) in [
        (DataFormat::Nhwc, vec![2, 3, 4, 5]),
        (DataFormat::Nchw, vec![2, 5, 3, 4]),
        (DataFormat::Nhwc, vec![7, 3]),
        (DataFormat::Nhwc, vec![1, 1, 1, 2]),
    ] {
        let (axis, c) = match (shape.len(), format) {
            (4, DataFormat::Nchw) => (1, shape[1]),
            _ => (shape.len() - 1, shape[shape.len() - 1]),
        };
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis + 1..].iter().product();
        let x0 = rng.vec(numel(&shape), -2.0, 2.0);
        let dy0 = rng.vec(numel(&shape), -1.0, 1.0);
        let scale0 = rng.vec(c, 0.5, 1.5);
        let offset0 = rng.vec(c, -0.5, 0.5);
        for training in [true, false] {
            // In training the statistics are the batch's (variance Bessel-corrected),
            // as BatchNorm outputs them.
            let (mean0, var0) = if training {
                let n = (outer * inner) as f64;
                let mut m = vec![0.0; c];
                let mut v = vec![0.0; c];
                for (k, &xv) in x0.iter().enumerate() {
                    m[(k / inner) % c] += xv / n;
                }
                for (k, &xv) in x0.iter().enumerate() {
                    let ch = (k / inner) % c;
                    v[ch] += (xv - m[ch]).powi(2) / n;
                }
                let corr = if n > 1.0 { n / (n - 1.0) } else { 1.0 };
                (m, v.iter().map(|s| s * corr).collect())
            } else {
                (rng.vec(c, -0.5, 0.5), rng.vec(c, 0.1, 2.0))
            };
            for (dtype, activation) in FLOATS
                .into_iter()
                .flat_map(|d| [NormActivation::Identity, NormActivation::Relu].map(|a| (d, a)))
            {
                // The statistics are f32 unless x is f64 (f16/bf16 x: mixed precision).
                let u = if dtype == DType::F64 {
                    DType::F64
                } else {
                    DType::F32
                };
                let (xt, x) = stored(dtype, &shape, &x0);
                let (dyt, dy) = stored(dtype, &shape, &dy0);
                let (st, s) = stored(u, &[c], &scale0);
                let (mt, m) = stored(u, &[c], &mean0);
                let (vt, v) = stored(u, &[c], &var0);
                let (ot, o) = stored(u, &[c], &offset0);
                let op = BatchNormGrad {
                    epsilon: 1e-3,
                    training,
                    data_format: format,
                    activation,
                };
                assert_round_trip(&op);
                let mut operands = vec![&xt, &st, &mt, &vt, &dyt];
                let mut dy = dy;
                if activation == NormActivation::Relu {
                    operands.push(&ot);
                    let geometry = (outer, c, inner);
                    dy = relu_masked(&x, &dy, [&s, &o, &m, &v], geometry, 1e-3, training);
                }
                let types: Vec<TensorType> = operands.iter().map(|t| t.ty()).collect();
                let inferred = op.infer(&types.iter().collect::<Vec<_>>()).unwrap();
                let got = op.eval(&operands).unwrap();
                let got_types: Vec<TensorType> = got.iter().map(|t| t.ty()).collect();
                assert_eq!(got_types, inferred);
                assert_eq!(inferred[0], tt(dtype, &shape));
                assert_eq!(inferred[1], tt(u, &[c]));
                let want = ref_bn_grad(&x, &dy, &s, &m, &v, (outer, c, inner), 1e-3, training);
                // dx is computed in f32 for 16-bit x and rounded once; dscale and
                // doffset are sums of n terms in the compute type, stored as U.
                let n = outer * inner;
                let scale_of = |v: &[f64]| v.iter().map(|a| a.abs()).fold(0.0, f64::max);
                let what = format!("{format:?} {shape:?} training={training} {activation:?}");
                let floor = 2.0 * n as f64 * scale_of(&want[0]);
                check_close(
                    &format!("dx {what}"),
                    dtype,
                    floor * 1e-3,
                    &got[0].to_f64_vec(),
                    &want[0],
                );
                let tol_u = if dtype == DType::F64 {
                    DType::F64
                } else {
                    DType::F32
                };
                for (k, name) in [(1, "dscale"), (2, "doffset")] {
                    let floor = n as f64 * 4.0;
                    check_close(
                        &format!("{name} {what}"),
                        tol_u,
                        floor,
                        &got[k].to_f64_vec(),
                        &want[k],
                    );
                }
            }
        }
    }
}

/// Reference LayerNormGrad in f64 over rows of `len`.
fn ref_ln_grad(x: &[f64], gamma: &[f64], dy: &[f64], len: usize, eps: f64) -> [Vec<f64>; 3] {
    let n = len as f64;
    let mut dx = Vec::new();
    let mut dgamma = vec![0.0; len];
    let mut dbeta = vec![0.0; len];
    for (row, drow) in x.chunks(len).zip(dy.chunks(len)) {
        let mean = row.iter().sum::<f64>() / n;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * inv).collect();
        let g: Vec<f64> = (0..len).map(|j| drow[j] * gamma[j]).collect();
        let mg = g.iter().sum::<f64>() / n;
        let mgx = (0..len).map(|j| g[j] * xhat[j]).sum::<f64>() / n;
        for j in 0..len {
            dx.push((g[j] - mg - xhat[j] * mgx) * inv);
            dgamma[j] += drow[j] * xhat[j];
            dbeta[j] += drow[j];
        }
    }
    [dx, dgamma, dbeta]
}

#[test]
fn layer_norm_grad_kernel_matches_reference() {
    let mut rng = Gen(37);
    for (shape, axis) in [
        (vec![4, 8], -1i64),
        (vec![2, 3, 5], 1),
        (vec![3, 2, 4], -2),
        (vec![6], 0),
        (vec![2, 3, 1], -1),
    ] {
        let rank = shape.len() as i64;
        let a = axis.rem_euclid(rank) as usize;
        let norm = shape[a..].to_vec();
        let len = numel(&norm);
        let x0 = rng.vec(numel(&shape), -2.0, 2.0);
        let dy0 = rng.vec(numel(&shape), -1.0, 1.0);
        let g0 = rng.vec(len, 0.5, 1.5);
        for dtype in FLOATS {
            let (xt, x) = stored(dtype, &shape, &x0);
            let (dyt, dy) = stored(dtype, &shape, &dy0);
            let (gt, g) = stored(dtype, &norm, &g0);
            let op = LayerNormGrad::new(axis, 1e-5);
            assert_round_trip(&op);
            let got = op.eval(&[&xt, &gt, &dyt]).unwrap();
            let types: Vec<TensorType> = got.iter().map(|t| t.ty()).collect();
            assert_eq!(
                types,
                [tt(dtype, &shape), tt(dtype, &norm), tt(dtype, &norm)]
            );
            let want = ref_ln_grad(&x, &g, &dy, len, 1e-5);
            let rows = numel(&shape) / len;
            let what = format!("{shape:?} axis {axis}");
            // dx: a few terms of magnitude up to |g| * inv (inv <= ~1/sqrt(eps) for a
            // row of one element, where dx is ~0): relative to the row's scale.
            let inv_max = 1.0 / 1e-5f64.sqrt();
            let floor = if len == 1 {
                4.0 * inv_max
            } else {
                4.0 * len as f64
            };
            check_close(
                &format!("dx {what}"),
                dtype,
                floor,
                &got[0].to_f64_vec(),
                &want[0],
            );
            check_close(
                &format!("dgamma {what}"),
                dtype,
                4.0 * rows as f64,
                &got[1].to_f64_vec(),
                &want[1],
            );
            check_close(
                &format!("dbeta {what}"),
                dtype,
                2.0 * rows as f64,
                &got[2].to_f64_vec(),
                &want[2],
            );
        }
    }
}

#[test]
fn batch_norm_grad_keeps_statistics_in_a_fixed_group() {
    let op = BatchNormGrad {
        epsilon: 1e-3,
        training: true,
        data_format: DataFormat::Nhwc,
        activation: NormActivation::Identity,
    };
    assert_eq!(op.typed_inputs(5), vec![0, 4]);
    assert_eq!(
        op.type_groups(5, 3),
        vec![
            TypeGroup::new(vec![0, 4], vec![0]),
            TypeGroup::new(vec![1, 2, 3], vec![1, 2]).fixed(),
        ]
    );
    // Mixed precision: f16 x and dy with f32 statistics.
    let f32c = tt(DType::F32, &[3]);
    let out = op
        .infer(&[
            &tt(DType::F16, &[2, 3]),
            &f32c,
            &f32c,
            &f32c,
            &tt(DType::F16, &[2, 3]),
        ])
        .unwrap();
    assert_eq!(out, [tt(DType::F16, &[2, 3]), f32c.clone(), f32c]);
}

#[test]
fn norm_grad_ops_reject_bad_types() {
    let op = BatchNormGrad {
        epsilon: 1e-3,
        training: true,
        data_format: DataFormat::Nchw,
        activation: NormActivation::Identity,
    };
    let f32t = |s: &[usize]| tt(DType::F32, s);
    let c = f32t(&[3]);
    assert!(op
        .infer(&[&f32t(&[2, 3, 4, 4]), &c, &c, &c, &f32t(&[2, 3, 4, 4])])
        .is_ok());
    // x, scale, mean, variance, dy
    let g = |x: TensorType, scale: TensorType, variance: TensorType, dy: TensorType| {
        vec![x, scale, c.clone(), variance, dy]
    };
    assert_infer_errs(
        &op,
        &[
            (
                g(
                    f32t(&[2, 4, 4, 3]),
                    c.clone(),
                    c.clone(),
                    f32t(&[2, 4, 4, 3]),
                ),
                "4 channels",
            ),
            (
                g(
                    f32t(&[2, 3, 4, 4]),
                    c.clone(),
                    c.clone(),
                    f32t(&[2, 3, 4, 5]),
                ),
                "dy is f32[2, 3, 4, 5]",
            ),
            (
                g(
                    tt(DType::F16, &[2, 3]),
                    tt(DType::F16, &[3]),
                    c.clone(),
                    tt(DType::F16, &[2, 3]),
                ),
                "scale is f16 but must be f32",
            ),
            (
                g(f32t(&[2, 3, 4]), c.clone(), c.clone(), f32t(&[2, 3, 4])),
                "rank 4",
            ),
            (
                g(f32t(&[2, 3]), c.clone(), f32t(&[0]), f32t(&[2, 3])),
                "variance has shape [0]",
            ),
            (
                g(
                    tt(DType::I32, &[2, 3]),
                    c.clone(),
                    c.clone(),
                    tt(DType::I32, &[2, 3]),
                ),
                "float",
            ),
        ],
    );
    // Kernels handed mismatched tensors err rather than panic.
    let x = Tensor::from_f64(DType::F32, [2, 3], &[0.0; 6]).unwrap();
    let s = Tensor::from_f64(DType::F32, [2], &[1.0; 2]).unwrap();
    assert!(op.eval(&[&x, &s, &s, &s, &x]).is_err());
    assert!(op.eval(&[&x]).is_err());

    let ln = LayerNormGrad::new(-1, 1e-5);
    let ok = ln
        .infer(&[&f32t(&[2, 4]), &f32t(&[4]), &f32t(&[2, 4])])
        .unwrap();
    assert_eq!(ok, [f32t(&[2, 4]), f32t(&[4]), f32t(&[4])]);
    let e = infer_err(&ln, &[f32t(&[2, 4]), f32t(&[2, 4]), f32t(&[2, 4])]);
    assert!(e.contains("gamma has shape [2, 4] but must be [4]"), "{e}");
    let e = infer_err(&ln, &[f32t(&[2, 4]), f32t(&[4]), f32t(&[4, 2])]);
    assert!(e.contains("dy has shape [4, 2]"), "{e}");
    // A 16-bit dy (or x) with f32 parameters is a folded widening Cast: accepted,
    // outputs in the parameters' dtype. One wider than gamma is refused by name.
    let ok = ln
        .infer(&[&f32t(&[2, 4]), &f32t(&[4]), &tt(DType::F16, &[2, 4])])
        .unwrap();
    assert_eq!(ok, [f32t(&[2, 4]), f32t(&[4]), f32t(&[4])]);
    let f16t = |s: &[usize]| tt(DType::F16, s);
    let e = infer_err(&ln, &[f16t(&[2, 4]), f16t(&[4]), f32t(&[2, 4])]);
    assert!(e.contains("dy is f32 but gamma is f16"), "{e}");
    let e = infer_err(&ln, &[tt(DType::BF16, &[2, 4]), f16t(&[4]), f16t(&[2, 4])]);
    assert!(e.contains("x is bf16 but gamma is f16"), "{e}");
    let bad_axis = LayerNormGrad::new(2, 1e-5);
    let e = infer_err(&bad_axis, &[f32t(&[2, 4]), f32t(&[4]), f32t(&[2, 4])]);
    assert!(e.contains("axis 2 is out of range"), "{e}");
    let e = infer_err(&ln, &[f32t(&[]), f32t(&[]), f32t(&[])]);
    assert!(e.contains("out of range"), "{e}");
    let x = Tensor::from_f64(DType::F32, [2, 4], &[0.0; 8]).unwrap();
    let g = Tensor::from_f64(DType::F32, [3], &[0.0; 3]).unwrap();
    assert!(ln.eval(&[&x, &g, &x]).is_err());
    // An empty normalised axis: empty results, no panic.
    let x = Tensor::from_f64(DType::F32, [2, 0], &[]).unwrap();
    let g = Tensor::from_f64(DType::F32, [0], &[]).unwrap();
    let out = ln.eval(&[&x, &g, &x]).unwrap();
    assert_eq!(out[0].shape(), &[2, 0]);
}

#[test]
fn norm_grad_attrs_parse_and_reject_mistakes() {
    let op = parse(
        "BatchNormGrad",
        &[
            ("epsilon", AttrValue::Float(0.01)),
            ("training", AttrValue::Bool(false)),
            ("data_format", AttrValue::from("NCHW")),
        ],
    )
    .unwrap();
    assert_round_trip(op.as_ref());
    let op = op.downcast_ref::<BatchNormGrad>().unwrap().clone();
    assert_eq!(
        op,
        BatchNormGrad {
            epsilon: 0.01,
            training: false,
            data_format: DataFormat::Nchw,
            activation: NormActivation::Identity,
        }
    );
    // Defaults: TensorFlow's epsilon, training (FusedBatchNormGrad's is_training), NHWC.
    let op = parse("BatchNormGrad", &[]).unwrap();
    let op = op.downcast_ref::<BatchNormGrad>().unwrap();
    assert_eq!(
        (op.epsilon, op.training, op.data_format),
        (0.001, true, DataFormat::Nhwc)
    );
    let op = parse("LayerNormGrad", &[("axis", AttrValue::Int(-2))]).unwrap();
    assert_round_trip(op.as_ref());
    let e = parse("BatchNormGrad", &[("epsilon", AttrValue::Float(-1.0))]).unwrap_err();
    assert!(e.contains("epsilon"), "{e}");
    let e = parse("BatchNormGrad", &[("training", AttrValue::Int(1))]).unwrap_err();
    assert!(e.contains("training"), "{e}");
    let e = parse("LayerNormGrad", &[("axis", AttrValue::from("last"))]).unwrap_err();
    assert!(e.contains("axis"), "{e}");
    let e = parse("LayerNormGrad", &[("momentum", AttrValue::Float(0.9))]).unwrap_err();
    assert!(e.contains("unknown attr 'momentum'"), "{e}");
}
