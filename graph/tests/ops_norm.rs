//! BatchNorm and LayerNorm against a naive float64 reference, in f32, f16, bf16 and f64.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::op::TypeGroup;
use ampgraph_graph::ops::{BatchNorm, DataFormat, LayerNorm, NormActivation};
use ampgraph_graph::{DType, Op, Tensor, TensorType};
use common::*;

/// The statistics dtype U of BatchNorm for an x of `dtype`.
fn stats_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

// ---- reference ----

struct BnRef {
    y: Vec<f64>,
    mean: Vec<f64>,
    var: Vec<f64>,
}

/// Naive batch norm: `c_axis` is the channel axis of `shape`.
#[allow(clippy::too_many_arguments)]
fn naive_batch_norm(
    x: &[f64],
    shape: &[usize],
    c_axis: usize,
    scale: &[f64],
    offset: &[f64],
    mean: &[f64],
    var: &[f64],
    eps: f64,
    training: bool,
) -> BnRef {
    let c = shape[c_axis];
    let channel = |flat: usize| unravel(flat, shape)[c_axis];
    let (m, v, out_v) = if training {
        let mut sum = vec![0.0; c];
        let mut cnt = vec![0usize; c];
        for (i, &val) in x.iter().enumerate() {
            sum[channel(i)] += val;
            cnt[channel(i)] += 1;
        }
        let m: Vec<f64> = (0..c).map(|k| sum[k] / cnt[k] as f64).collect();
        let mut ss = vec![0.0; c];
        for (i, &val) in x.iter().enumerate() {
            let k = channel(i);
            ss[k] += (val - m[k]) * (val - m[k]);
        }
        let biased: Vec<f64> = (0..c).map(|k| ss[k] / cnt[k] as f64).collect();
        let unbiased: Vec<f64> = (0..c)
            .map(|k| {
                if cnt[k] > 1 {
                    ss[k] / (cnt[k] - 1) as f64
                } else {
                    biased[k]
                }
            })
            .collect();
        (m, biased, unbiased)
    } else {
        (mean.to_vec(), var.to_vec(), var.to_vec())
    };
    let y = x
        .iter()
        .enumerate()
        .map(|(i, &val)| {
            let k = channel(i);
            (val - m[k]) / (v[k] + eps).sqrt() * scale[k] + offset[k]
        })
        .collect();
    BnRef {
        y,
        mean: m,
        var: out_v,
    }
}

/// Naive layer norm over the trailing `len` elements of each row.
fn naive_layer_norm(x: &[f64], len: usize, gamma: &[f64], beta: &[f64], eps: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for row in x.chunks(len) {
        let mean = row.iter().sum::<f64>() / len as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / len as f64;
        for (j, &v) in row.iter().enumerate() {
            out.push((v - mean) / (var + eps).sqrt() * gamma[j] + beta[j]);
        }
    }
    out
}

fn run_batch_norm_case(
    dtype: DType,
    shape: &[usize],
    format: DataFormat,
    training: bool,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let u = stats_dtype(dtype);
    let c_axis = if shape.len() == 4 && format == DataFormat::Nchw {
        1
    } else {
        shape.len() - 1
    };
    let c = shape[c_axis];
    let n: usize = shape.iter().product();
    let (x, xr) = input(dtype, shape, &rng.vals(n, -2.0, 3.0));
    let (scale, sr) = input(u, &[c], &rng.vals(c, 0.5, 1.5));
    let (offset, or) = input(u, &[c], &rng.vals(c, -1.0, 1.0));
    let (mean, mr) = input(u, &[c], &rng.vals(c, -0.5, 0.5));
    let (var, vr) = input(u, &[c], &rng.vals(c, 0.5, 2.0));
    let eps = 1e-3;
    let op = BatchNorm {
        epsilon: eps,
        training,
        data_format: format,
        activation: NormActivation::Identity,
        ..BatchNorm::default()
    };
    let inputs = [&x, &scale, &offset, &mean, &var];
    let types = tys(&inputs);
    let refs: Vec<&TensorType> = types.iter().collect();
    assert_eq!(
        op.infer(&refs).unwrap(),
        vec![x.ty(), tt(u, &[c]), tt(u, &[c])]
    );
    let out = op.eval(&inputs).unwrap();
    assert_eq!(out.len(), 3);
    let r = naive_batch_norm(&xr, shape, c_axis, &sr, &or, &mr, &vr, eps, training);
    let what = format!("BatchNorm {dtype} {shape:?} {format:?} training={training}");
    assert_close(
        &format!("{what} y"),
        &out[0],
        dtype,
        shape,
        &r.y,
        dtype,
        1.0,
    );
    assert_close(&format!("{what} mean"), &out[1], u, &[c], &r.mean, u, 1.0);
    assert_close(&format!("{what} var"), &out[2], u, &[c], &r.var, u, 1.0);
    if !training {
        assert_eq!(out[1], mean);
        assert_eq!(out[2], var);
    }
}

// ---- BatchNorm ----

#[test]
fn batch_norm_hand_computed() {
    for dtype in FLOATS {
        let u = stats_dtype(dtype);
        let t = |shape: Vec<usize>, v: &[f64], d| Tensor::from_f64(d, shape, v).unwrap();
        let x = t(vec![2, 2], &[1., 2., 3., 4.], dtype);
        let scale = t(vec![2], &[1., 2.], u);
        let offset = t(vec![2], &[0., 1.], u);
        let mean = t(vec![2], &[2., 3.], u);
        let var = t(vec![2], &[1., 4.], u);
        let op = BatchNorm {
            epsilon: 0.0,
            training: false,
            data_format: DataFormat::Nhwc,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        };
        let out = op.eval(&[&x, &scale, &offset, &mean, &var]).unwrap();
        assert_close("y", &out[0], dtype, &[2, 2], &[-1., 0., 1., 2.], dtype, 1.0);

        // Training: mean [2, 4], biased var [1, 4] -> y = ±1; var output unbiased [2, 8].
        let x = t(vec![2, 2], &[1., 2., 3., 6.], dtype);
        let ones = t(vec![2], &[1., 1.], u);
        let zeros = t(vec![2], &[0., 0.], u);
        let op = BatchNorm {
            epsilon: 0.0,
            training: true,
            data_format: DataFormat::Nhwc,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        };
        let out = op.eval(&[&x, &ones, &zeros, &zeros, &ones]).unwrap();
        assert_close(
            "y",
            &out[0],
            dtype,
            &[2, 2],
            &[-1., -1., 1., 1.],
            dtype,
            1.0,
        );
        assert_close("mean", &out[1], u, &[2], &[2., 4.], u, 1.0);
        assert_close("var", &out[2], u, &[2], &[2., 8.], u, 1.0);
    }
}

#[test]
fn batch_norm_vs_reference_all_layouts() {
    let mut seed = 1;
    for dtype in FLOATS {
        for training in [false, true] {
            for (shape, format) in [
                (vec![2, 3, 4, 5], DataFormat::Nhwc),
                (vec![2, 5, 3, 4], DataFormat::Nchw),
                (vec![8, 3], DataFormat::Nhwc),
                (vec![8, 3], DataFormat::Nchw),
                (vec![1, 1, 1, 3], DataFormat::Nhwc),
            ] {
                seed += 1;
                run_batch_norm_case(dtype, &shape, format, training, seed);
            }
        }
    }
}

#[test]
fn batch_norm_training_accepts_empty_statistics() {
    let x = Tensor::from_f64(DType::F16, vec![4, 2], &[1., 2., 3., 4., 5., 6., 7., 8.]).unwrap();
    let one = Tensor::from_f64(DType::F32, vec![2], &[1., 1.]).unwrap();
    let empty = Tensor::from_f64(DType::F32, vec![0], &[]).unwrap();
    let op = BatchNorm {
        training: true,
        ..BatchNorm::default()
    };
    let out = op.eval(&[&x, &one, &one, &empty, &empty]).unwrap();
    assert_eq!(out[1].to_f64_vec(), vec![4.0, 5.0]);
    let e = BatchNorm::default()
        .eval(&[&x, &one, &one, &empty, &empty])
        .unwrap_err();
    assert!(e.contains("mean") && e.contains("[0]"), "{e}");
}

/// A channel of 2^25 elements (a large batch's): its mean and variance add in f64, so
/// they hold where an f32 running sum stalls (at 2^21 for terms near 0.1: the mean came
/// out 0.0625).
#[test]
fn batch_norm_statistics_of_a_long_channel() {
    let n = 1usize << 25;
    let values: Vec<f32> = (0..n)
        .map(|i| if i % 2 == 0 { 0.05 } else { 0.15 })
        .collect();
    let want_mean = (f64::from(0.05f32) + f64::from(0.15f32)) / 2.0;
    let half_gap = (f64::from(0.15f32) - f64::from(0.05f32)) / 2.0;
    let want_var = half_gap * half_gap * n as f64 / (n - 1) as f64;
    let x = Tensor::new(vec![n, 1], ampgraph_graph::Data::F32(values)).unwrap();
    let one = Tensor::from_f64(DType::F32, vec![1], &[1.0]).unwrap();
    let empty = Tensor::from_f64(DType::F32, vec![0], &[]).unwrap();
    let op = BatchNorm {
        training: true,
        ..BatchNorm::default()
    };
    let out = op.eval(&[&x, &one, &one, &empty, &empty]).unwrap();
    let (mean, var) = (out[1].to_f64_vec()[0], out[2].to_f64_vec()[0]);
    assert!(
        (mean - want_mean).abs() <= 1e-7 * want_mean,
        "mean {mean}, want {want_mean}"
    );
    assert!(
        (var - want_var).abs() <= 1e-6 * want_var,
        "variance {var}, want {want_var}"
    );
}

#[test]
fn batch_norm_errors() {
    let op = BatchNorm::default();
    let p = |d, n| tt(d, &[n]);
    let x = tt(DType::F16, &[2, 4, 4, 3]);
    let ok = [
        x.clone(),
        p(DType::F32, 3),
        p(DType::F32, 3),
        p(DType::F32, 3),
        p(DType::F32, 3),
    ];
    let refs: Vec<&TensorType> = ok.iter().collect();
    assert!(op.infer(&refs).is_ok());
    for (slot, name) in [(1, "scale"), (2, "offset"), (3, "mean"), (4, "variance")] {
        let mut bad = ok.clone();
        bad[slot] = p(DType::F32, 4);
        let e = infer_err(&op, &bad);
        assert!(
            e.contains(name) && e.contains("[4]") && e.contains("3 channels"),
            "{e}"
        );
        let mut bad = ok.clone();
        bad[slot] = p(DType::F16, 3);
        let e = infer_err(&op, &bad);
        assert!(e.contains(name) && e.contains("must be f32"), "{e}");
    }
    // f64 x needs f64 statistics.
    let mut bad = ok.clone();
    bad[0] = tt(DType::F64, &[2, 4, 4, 3]);
    let e = infer_err(&op, &bad);
    assert!(e.contains("must be f64"), "{e}");
    // NCHW reads C from axis 1.
    let nchw = BatchNorm {
        data_format: DataFormat::Nchw,
        ..BatchNorm::default()
    };
    let e = infer_err(&nchw, &ok);
    assert!(e.contains("4 channels"), "{e}");
    // Rank 3 and integer x.
    let mut bad = ok.clone();
    bad[0] = tt(DType::F32, &[2, 4, 3]);
    let e = infer_err(&op, &bad);
    assert!(e.contains("rank 4") && e.contains("[2, 4, 3]"), "{e}");
    let mut bad = ok.clone();
    bad[0] = tt(DType::I32, &[2, 3]);
    assert!(infer_err(&op, &bad).contains("float"));
    // eval re-checks and errors instead of indexing out of bounds.
    let x = Tensor::from_f64(DType::F32, vec![1, 3], &[1., 2., 3.]).unwrap();
    let two = Tensor::from_f64(DType::F32, vec![2], &[1., 1.]).unwrap();
    assert!(op.eval(&[&x, &two, &two, &two, &two]).is_err());
    let e = parse("BatchNorm", &[("epsilon", AttrValue::Float(-1.0))]).unwrap_err();
    assert!(e.contains("epsilon"), "{e}");
}

#[test]
fn batch_norm_registry_and_typed_inputs() {
    let op = parse("BatchNorm", &[]).unwrap();
    assert_eq!(
        op.downcast_ref::<BatchNorm>(),
        Some(&BatchNorm {
            epsilon: 0.001,
            training: false,
            data_format: DataFormat::Nhwc,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        })
    );
    assert_eq!(op.typed_inputs(5), vec![0]);
    assert_eq!(
        op.type_groups(5, 3),
        vec![
            TypeGroup::new(vec![0], vec![0]),
            TypeGroup::new(vec![1, 2, 3, 4], vec![1, 2]).fixed(),
        ]
    );
    let op = parse(
        "BatchNorm",
        &[
            ("epsilon", AttrValue::Float(1e-5)),
            ("training", AttrValue::Bool(true)),
            ("data_format", AttrValue::Str("NCHW".into())),
        ],
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<BatchNorm>(),
        Some(&BatchNorm {
            epsilon: 1e-5,
            training: true,
            data_format: DataFormat::Nchw,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        })
    );
    assert_round_trip(op.as_ref());
    // Synchronised statistics: written only when set, for the inference form.
    let synchronised = parse("BatchNorm", &[("sync_replicas", AttrValue::Int(2))]).unwrap();
    let bn = synchronised.downcast_ref::<BatchNorm>().unwrap();
    assert!(bn.sync_replicas == 2 && !bn.training);
    assert_round_trip(synchronised.as_ref());
    assert!(!op.attrs().iter().any(|(k, _)| *k == "sync_replicas"));
    let both = parse(
        "BatchNorm",
        &[
            ("training", AttrValue::Bool(true)),
            ("sync_replicas", AttrValue::Int(2)),
        ],
    );
    assert!(both.is_err_and(|e| e.contains("sync_replicas")));
    let negative = parse("BatchNorm", &[("sync_replicas", AttrValue::Int(-1))]);
    assert!(negative.is_err_and(|e| e.contains("sync_replicas")));
    assert!(parse(
        "BatchNorm",
        &[("data_format", AttrValue::Str("NWC".into()))]
    )
    .is_err());
}

// ---- LayerNorm ----

#[test]
fn layer_norm_hand_computed() {
    for dtype in FLOATS {
        let x = Tensor::from_f64(dtype, vec![1, 3], &[1., 2., 3.]).unwrap();
        let g = Tensor::from_f64(dtype, vec![3], &[1., 1., 2.]).unwrap();
        let b = Tensor::from_f64(dtype, vec![3], &[0., 0., 1.]).unwrap();
        let op = LayerNorm {
            axis: -1,
            epsilon: 0.0,
            to: None,
        };
        let out = op.eval(&[&x, &g, &b]).unwrap();
        let s = 1.5f64.sqrt(); // 1 / sqrt(2/3)
        assert_close(
            "ln",
            &out[0],
            dtype,
            &[1, 3],
            &[-s, 0.0, 2.0 * s + 1.0],
            dtype,
            1.0,
        );
    }
}

#[test]
fn layer_norm_vs_reference() {
    let mut rng = Rng(21);
    let shape = [3, 4, 5];
    for dtype in FLOATS {
        let (x, xr) = input(dtype, &shape, &rng.vals(60, -2.0, 4.0));
        for axis in [-1i64, 2, 1, -2, 0] {
            let ax = if axis < 0 {
                (axis + 3) as usize
            } else {
                axis as usize
            };
            let pshape = &shape[ax..];
            let len: usize = pshape.iter().product();
            let (g, gr) = input(dtype, pshape, &rng.vals(len, 0.5, 1.5));
            let (b, br) = input(dtype, pshape, &rng.vals(len, -0.5, 0.5));
            let op = LayerNorm {
                axis,
                epsilon: 1e-5,
                to: None,
            };
            assert_eq!(
                op.infer(&[&x.ty(), &g.ty(), &b.ty()]).unwrap(),
                vec![x.ty()]
            );
            let out = op.eval(&[&x, &g, &b]).unwrap();
            let want = naive_layer_norm(&xr, len, &gr, &br, 1e-5);
            let what = format!("LayerNorm {dtype} axis {axis}");
            assert_close(&what, &out[0], dtype, &shape, &want, dtype, 1.0);
        }
    }
}

#[test]
fn layer_norm_errors_and_registry() {
    let op = LayerNorm::default();
    let x = tt(DType::F32, &[2, 3, 4]);
    let e = infer_err(
        &op,
        &[x.clone(), tt(DType::F32, &[3]), tt(DType::F32, &[4])],
    );
    assert!(
        e.contains("gamma") && e.contains("[3]") && e.contains("[4]"),
        "{e}"
    );
    let e = infer_err(
        &op,
        &[x.clone(), tt(DType::F32, &[4]), tt(DType::F32, &[3, 4])],
    );
    assert!(e.contains("beta"), "{e}");
    let op1 = LayerNorm {
        axis: 1,
        epsilon: 1e-5,
        to: None,
    };
    let e = infer_err(
        &op1,
        &[x.clone(), tt(DType::F32, &[4]), tt(DType::F32, &[4])],
    );
    assert!(e.contains("[3, 4]"), "{e}");
    let e = infer_err(
        &LayerNorm {
            axis: 3,
            epsilon: 1e-5,
            to: None,
        },
        &[x.clone(), tt(DType::F32, &[4]), tt(DType::F32, &[4])],
    );
    assert!(e.contains("axis 3") && e.contains("out of range"), "{e}");
    let e = infer_err(&op, &[x, tt(DType::F16, &[4]), tt(DType::F32, &[4])]);
    assert!(e.contains("f16"), "{e}");

    let op = parse("LayerNorm", &[]).unwrap();
    assert_eq!(
        op.downcast_ref::<LayerNorm>(),
        Some(&LayerNorm {
            axis: -1,
            epsilon: 1e-5,
            to: None,
        })
    );
    assert_eq!(op.typed_inputs(3), vec![0, 1, 2]);
    let op = parse(
        "LayerNorm",
        &[
            ("axis", AttrValue::Int(1)),
            ("epsilon", AttrValue::Float(1e-6)),
        ],
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<LayerNorm>(),
        Some(&LayerNorm {
            axis: 1,
            epsilon: 1e-6,
            to: None,
        })
    );
    assert_round_trip(op.as_ref());
}

/// With a 16-bit x (and dy), f32 parameters and a 16-bit output, LayerNorm and its
/// gradient give bitwise what the casts around the f32 ops gave: the widening is exact
/// and the output rounds once, as the Cast rounded it.
#[test]
fn layer_norm_takes_its_casts_in() {
    use ampgraph_graph::ops::{Cast, LayerNormGrad};
    let vals =
        |n: usize, k: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * k).sin() * 2.0).collect() };
    for narrow in [DType::F16, DType::BF16] {
        let x = Tensor::from_f64(narrow, vec![6, 40], &vals(240, 0.37)).unwrap();
        let dy = Tensor::from_f64(narrow, vec![6, 40], &vals(240, 0.91)).unwrap();
        let g = Tensor::from_f64(DType::F32, vec![40], &vals(40, 0.13)).unwrap();
        let b = Tensor::from_f64(DType::F32, vec![40], &vals(40, 0.29)).unwrap();
        let wide = |t: &Tensor| Cast { to: DType::F32 }.eval(&[t]).unwrap().remove(0);
        let f32_ln = LayerNorm::default();
        let y32 = f32_ln.eval(&[&wide(&x), &g, &b]).unwrap().remove(0);
        let want = Cast { to: narrow }.eval(&[&y32]).unwrap().remove(0);
        let folded = LayerNorm {
            to: Some(narrow),
            ..LayerNorm::default()
        };
        let got = folded.eval(&[&x, &g, &b]).unwrap().remove(0);
        assert_eq!(got.ty(), want.ty());
        assert_eq!(got.to_f64_vec(), want.to_f64_vec());
        // Without `to`, gamma's dtype.
        let got = f32_ln.eval(&[&x, &g, &b]).unwrap().remove(0);
        assert_eq!(got.to_f64_vec(), y32.to_f64_vec());
        let grad = LayerNormGrad::new(-1, 1e-5);
        let want = grad.eval(&[&wide(&x), &g, &wide(&dy)]).unwrap();
        let got = grad.eval(&[&x, &g, &dy]).unwrap();
        for (w, o) in want.iter().zip(&got) {
            assert_eq!(w.ty(), o.ty());
            assert_eq!(w.to_f64_vec(), o.to_f64_vec());
        }
    }
    // An x wider than gamma, or one that does not widen exactly, is refused by name.
    let e = LayerNorm::default()
        .infer(&[
            &TensorType::new(DType::F32, vec![2, 4]),
            &TensorType::new(DType::F16, vec![4]),
            &TensorType::new(DType::F16, vec![4]),
        ])
        .unwrap_err();
    assert!(e.contains("x is f32 but gamma is f16"), "{e}");
    let e = LayerNorm::default()
        .infer(&[
            &TensorType::new(DType::BF16, vec![2, 4]),
            &TensorType::new(DType::F16, vec![4]),
            &TensorType::new(DType::F16, vec![4]),
        ])
        .unwrap_err();
    assert!(e.contains("x is bf16 but gamma is f16"), "{e}");
}
