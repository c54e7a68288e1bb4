//! Softmax, LogSoftmax and SoftmaxCrossEntropy against a naive float64 reference,
//! in f32, f16, bf16 and f64.

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{
    FusedSoftmax, LogSoftmax, Softmax, SoftmaxCrossEntropy, SoftmaxCrossEntropyWithGrad,
};
use ampgraph_graph::{DType, Op, Tensor};
use common::*;

// ---- reference ----

/// Naive softmax (or log-softmax) along `axis` (already normalised), by direct
/// formula over each line of the tensor.
fn naive_softmax(vals: &[f64], shape: &[usize], axis: usize, log: bool) -> Vec<f64> {
    let mut out = vec![0.0; vals.len()];
    for flat in 0..vals.len() {
        let idx = unravel(flat, shape);
        let line: Vec<f64> = (0..shape[axis])
            .map(|k| {
                let mut j = idx.clone();
                j[axis] = k;
                vals[ravel(&j, shape)]
            })
            .collect();
        let m = line.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let denom: f64 = line.iter().map(|v| (v - m).exp()).sum();
        out[flat] = if log {
            vals[flat] - m - denom.ln()
        } else {
            (vals[flat] - m).exp() / denom
        };
    }
    out
}

/// Naive mean cross-entropy: mean over rows of -log(softmax(row)[label]).
fn naive_xent(logits: &[f64], n: usize, c: usize, labels: &[usize]) -> f64 {
    let mut total = 0.0;
    for r in 0..n {
        let row = &logits[r * c..(r + 1) * c];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        total += lse - row[labels[r]];
    }
    total / n as f64
}

// ---- hand-computed cases ----

#[test]
fn softmax_of_zero_and_ln2() {
    for dtype in FLOATS {
        let x = Tensor::from_f64(dtype, vec![2], &[0.0, 2f64.ln()]).unwrap();
        // ln 2 is not exact in 16 bits: compare to the rounded input's exact softmax
        // with the dtype's tolerance, and to 1/3, 2/3 loosely.
        let xr = x.to_f64_vec();
        let e = xr[1].exp();
        let y = Softmax::default().eval(&[&x]).unwrap();
        assert_close(
            "softmax",
            &y[0],
            dtype,
            &[2],
            &[1.0 / (1.0 + e), e / (1.0 + e)],
            dtype,
            1.0,
        );
        assert_close(
            "softmax",
            &y[0],
            dtype,
            &[2],
            &[1.0 / 3.0, 2.0 / 3.0],
            DType::BF16,
            1.0,
        );
        let ly = LogSoftmax::default().eval(&[&x]).unwrap();
        let want = [-(1.0 + e).ln(), xr[1] - (1.0 + e).ln()];
        assert_close("log_softmax", &ly[0], dtype, &[2], &want, dtype, 1.0);
    }
    let x = Tensor::from_f64(DType::F64, vec![2], &[0.0, 2f64.ln()]).unwrap();
    let y = Softmax::default().eval(&[&x]).unwrap()[0].to_f64_vec();
    assert!((y[0] - 1.0 / 3.0).abs() < 1e-15 && (y[1] - 2.0 / 3.0).abs() < 1e-15);
    let ly = LogSoftmax::default().eval(&[&x]).unwrap()[0].to_f64_vec();
    assert!((ly[0] - (1.0f64 / 3.0).ln()).abs() < 1e-15);
    assert!((ly[1] - (2.0f64 / 3.0).ln()).abs() < 1e-15);
}

#[test]
fn large_logits_are_stable() {
    for dtype in FLOATS {
        // 1000 overflows exp in every dtype without the max subtraction.
        let x = Tensor::from_f64(dtype, vec![1, 3], &[1000.0, 1000.0, -1000.0]).unwrap();
        let y = Softmax::default().eval(&[&x]).unwrap();
        assert_close(
            "softmax",
            &y[0],
            dtype,
            &[1, 3],
            &[0.5, 0.5, 0.0],
            dtype,
            1.0,
        );
        let ly = LogSoftmax::default().eval(&[&x]).unwrap();
        let l2 = -(2f64.ln());
        assert_close(
            "log_softmax",
            &ly[0],
            dtype,
            &[1, 3],
            &[l2, l2, -2000.0 + l2],
            dtype,
            1.0,
        );
    }
}

#[test]
fn cross_entropy_known_values() {
    for dtype in FLOATS {
        for label_dtype in [DType::I32, DType::I64] {
            // Row 0: softmax([0, ln 2]) = [1/3, 2/3], label 1: -ln(2/3) = ln 1.5.
            // Row 1: two equal logits, label 0: ln 2.
            let logits = Tensor::from_f64(dtype, vec![2, 2], &[0.0, 2f64.ln(), 5.0, 5.0]).unwrap();
            let labels = Tensor::from_f64(label_dtype, vec![2], &[1.0, 0.0]).unwrap();
            let op = SoftmaxCrossEntropy;
            assert_eq!(
                op.infer(&[&logits.ty(), &labels.ty()]).unwrap(),
                vec![tt(dtype, &[])]
            );
            let loss = op.eval(&[&logits, &labels]).unwrap();
            let want = (1.5f64.ln() + 2f64.ln()) / 2.0;
            // 16-bit ln 2 is inexact: the bf16 tolerance for 16-bit inputs.
            let td = if dtype.is_half() { DType::BF16 } else { dtype };
            assert_close("xent", &loss[0], dtype, &[], &[want], td, 1.0);
        }
    }
    // [1, 2, 3] with label 2: ln(e + e^2 + e^3) - 3.
    let logits = Tensor::from_f64(DType::F64, vec![1, 3], &[1.0, 2.0, 3.0]).unwrap();
    let labels = Tensor::from_f64(DType::I64, vec![1], &[2.0]).unwrap();
    let loss = SoftmaxCrossEntropy.eval(&[&logits, &labels]).unwrap()[0].to_f64_vec()[0];
    let e = std::f64::consts::E;
    assert!(
        (loss - ((e + e * e + e * e * e).ln() - 3.0)).abs() < 1e-14,
        "{loss}"
    );
}

// ---- every dtype against the reference ----

#[test]
fn softmax_and_log_softmax_vs_reference() {
    let mut rng = Rng(3);
    let shape = [3, 4, 5];
    for dtype in FLOATS {
        let (x, xr) = input(dtype, &shape, &rng.vals(60, -4.0, 4.0));
        for axis in [-1i64, 0, 1, 2, -2] {
            let ax = if axis < 0 {
                (axis + 3) as usize
            } else {
                axis as usize
            };
            let want = naive_softmax(&xr, &shape, ax, false);
            let y = Softmax { axis }.eval(&[&x]).unwrap();
            assert_close(
                &format!("softmax axis {axis}"),
                &y[0],
                dtype,
                &shape,
                &want,
                dtype,
                0.0,
            );
            let want = naive_softmax(&xr, &shape, ax, true);
            let y = LogSoftmax { axis }.eval(&[&x]).unwrap();
            // log-softmax values are O(|x|): scale by the input range.
            assert_close(
                &format!("log_softmax axis {axis}"),
                &y[0],
                dtype,
                &shape,
                &want,
                dtype,
                1.0,
            );
        }
    }
}

#[test]
fn softmax_long_rows() {
    let mut rng = Rng(5);
    for dtype in FLOATS {
        let (x, xr) = input(dtype, &[2, 1000], &rng.vals(2000, -8.0, 8.0));
        let want = naive_softmax(&xr, &[2, 1000], 1, false);
        let y = Softmax::default().eval(&[&x]).unwrap();
        // Each value is ~1/1000 of the sum; compare relative to the largest value.
        let scale = want.iter().cloned().fold(0.0, f64::max);
        assert_close(
            "softmax long",
            &y[0],
            dtype,
            &[2, 1000],
            &want,
            dtype,
            scale * 4.0,
        );
        let sum: f64 = y[0].to_f64_vec().iter().sum();
        assert!(
            (sum - 2.0).abs() < 1000.0 * rtol(dtype) * 2.0,
            "{dtype}: sum {sum}"
        );
    }
}

#[test]
fn cross_entropy_vs_reference() {
    let mut rng = Rng(9);
    let (n, c) = (16, 10);
    for dtype in FLOATS {
        let (logits, lr) = input(dtype, &[n, c], &rng.vals(n * c, -5.0, 5.0));
        let labels: Vec<usize> = (0..n)
            .map(|_| (rng.next_u64() % c as u64) as usize)
            .collect();
        let lf: Vec<f64> = labels.iter().map(|&l| l as f64).collect();
        for label_dtype in [DType::I32, DType::I64] {
            let lt = Tensor::from_f64(label_dtype, vec![n], &lf).unwrap();
            let loss = SoftmaxCrossEntropy.eval(&[&logits, &lt]).unwrap();
            let want = naive_xent(&lr, n, c, &labels);
            assert_close("xent", &loss[0], dtype, &[], &[want], dtype, 1.0);
        }
    }
}

// ---- errors ----

#[test]
fn shape_and_dtype_errors() {
    let e = infer_err(&Softmax { axis: 2 }, &[tt(DType::F32, &[2, 3])]);
    assert!(e.contains("axis 2") && e.contains("out of range"), "{e}");
    let e = infer_err(&LogSoftmax { axis: -3 }, &[tt(DType::F32, &[2, 3])]);
    assert!(e.contains("axis -3"), "{e}");
    let e = infer_err(&Softmax::default(), &[tt(DType::F32, &[])]);
    assert!(e.contains("out of range"), "{e}");
    let e = infer_err(&Softmax::default(), &[tt(DType::I32, &[3])]);
    assert!(e.contains("float"), "{e}");

    let x = SoftmaxCrossEntropy;
    for ld in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let e = infer_err(&x, &[tt(DType::F32, &[4, 3]), tt(ld, &[4])]);
        assert!(
            e.contains("float") && e.contains(ld.as_str()) && e.contains("i32"),
            "{e}"
        );
    }
    let e = infer_err(&x, &[tt(DType::F32, &[4, 3]), tt(DType::Bool, &[4])]);
    assert!(e.contains("i32 or i64"), "{e}");
    let e = infer_err(&x, &[tt(DType::F32, &[4, 3]), tt(DType::I64, &[5])]);
    assert!(e.contains("[5]") && e.contains("[4]"), "{e}");
    let e = infer_err(&x, &[tt(DType::F32, &[4, 3, 1]), tt(DType::I64, &[4])]);
    assert!(e.contains("rank 2"), "{e}");
    let e = infer_err(&x, &[tt(DType::I32, &[4, 3]), tt(DType::I64, &[4])]);
    assert!(e.contains("logits") && e.contains("float"), "{e}");
}

#[test]
fn label_out_of_range_at_eval() {
    let logits = Tensor::from_f64(DType::F32, vec![3, 4], &[0.0; 12]).unwrap();
    for (bad, idx) in [(4.0, 1), (-1.0, 2)] {
        let mut l = vec![0.0, 1.0, 2.0];
        l[idx] = bad;
        for ld in [DType::I32, DType::I64] {
            let labels = Tensor::from_f64(ld, vec![3], &l).unwrap();
            let e = SoftmaxCrossEntropy.eval(&[&logits, &labels]).unwrap_err();
            assert!(
                e.contains(&format!("labels[{idx}]")) && e.contains(&format!("{}", bad as i64)),
                "{e}"
            );
        }
    }
    // Zero classes: every label is out of range.
    let logits = Tensor::from_f64(DType::F32, vec![2, 0], &[]).unwrap();
    let labels = Tensor::from_f64(DType::I32, vec![2], &[0.0, 0.0]).unwrap();
    assert!(SoftmaxCrossEntropy
        .eval(&[&logits, &labels])
        .unwrap_err()
        .contains("labels[0]"));
}

#[test]
fn typed_inputs_and_registry() {
    assert_eq!(SoftmaxCrossEntropy.typed_inputs(2), vec![0]);
    let groups = SoftmaxCrossEntropy.type_groups(2, 1);
    assert_eq!(
        (groups[0].inputs.as_slice(), groups[0].outputs.as_slice()),
        (&[0][..], &[0][..])
    );
    assert!(groups[0].can_be_half);
    assert!(groups
        .iter()
        .skip(1)
        .all(|g| !g.can_be_half && g.outputs.is_empty()));
    assert_eq!(Softmax::default().typed_inputs(1), vec![0]);
    let op = parse("Softmax", &[]).unwrap();
    assert_eq!(op.downcast_ref::<Softmax>(), Some(&Softmax { axis: -1 }));
    let op = parse("LogSoftmax", &[("axis", AttrValue::Int(0))]).unwrap();
    assert_eq!(
        op.downcast_ref::<LogSoftmax>(),
        Some(&LogSoftmax { axis: 0 })
    );
    assert_round_trip(op.as_ref());
    assert_round_trip(&Softmax { axis: 1 });
    assert_round_trip(&SoftmaxCrossEntropy);
    assert!(parse("SoftmaxCrossEntropy", &[("axis", AttrValue::Int(0))]).is_err());
}

// ---- FusedSoftmax: the softmax of an elementwise prologue ----

/// `FusedSoftmax` over `x[3, 8] * s + mask[8]` (s a scalar input), from its file form.
fn masked(dtype: DType, axis: i64, log: bool) -> Box<dyn Op> {
    let program = format!(
        "v0 = in0: {dtype}[3, 8]; v1 = in1: {dtype}[]; v2 = Mul(v0, v1): {dtype}[3, 8]; \
         v3 = in2: {dtype}[8]; v4 = Add(v2, v3): {dtype}[3, 8]"
    );
    parse(
        "FusedSoftmax",
        &[
            ("axis", AttrValue::Int(axis)),
            ("log", AttrValue::Bool(log)),
            ("program", AttrValue::Str(program)),
            ("outputs", AttrValue::Ints(vec![4])),
        ],
    )
    .unwrap()
}

#[test]
fn fused_softmax_is_the_softmax_of_its_prologue() {
    let mut rng = Rng(9);
    for dtype in FLOATS {
        let (x, xr) = input(dtype, &[3, 8], &rng.vals(24, -3.0, 3.0));
        let (s, sr) = input(dtype, &[], &[0.75]);
        let mut mask_vals = rng.vals(8, -1.0, 1.0);
        mask_vals[5] = f64::NEG_INFINITY;
        let (mask, mr) = input(dtype, &[8], &mask_vals);
        // The prologue's value as the unfused Mul and Add store it: rounded to the
        // dtype after each op (the products and sums are exact in f64).
        let round = |v: Vec<f64>| input(dtype, &[v.len()], &v).1;
        let scaled = round(xr.iter().map(|v| v * sr[0]).collect());
        let pre = round(
            scaled
                .iter()
                .enumerate()
                .map(|(i, v)| v + mr[i % 8])
                .collect(),
        );
        for log in [false, true] {
            let op = masked(dtype, -1, log);
            assert_round_trip(op.as_ref());
            let y = run(op.as_ref(), &[&x, &s, &mask]);
            let want = naive_softmax(&pre, &[3, 8], 1, log);
            let what = format!("{dtype} fused softmax (log {log})");
            assert_close(
                &what,
                &y,
                dtype,
                &[3, 8],
                &want,
                dtype,
                f64::from(u8::from(log)),
            );
            let masked_out = y.to_f64_vec();
            let zero = if log { f64::NEG_INFINITY } else { 0.0 };
            assert!(
                (0..3).all(|r| masked_out[r * 8 + 5] == zero),
                "{what}: the masked column"
            );
            // Bit for bit what the Mul, the Add and the softmax give as nodes.
            let pre_t = Tensor::from_f64(dtype, vec![3, 8], &pre).unwrap();
            let plain = op.downcast_ref::<FusedSoftmax>().unwrap().softmax();
            assert_eq!(plain.eval(&[&pre_t]).unwrap()[0], y, "{what}: bits");
        }
    }
}

#[test]
fn fused_softmax_errors_name_the_problem() {
    let program = "v0 = in0: f32[2, 4]; v1 = Neg(v0): f32[2, 4]; v2 = Exp(v0): f32[2, 4]";
    let two = |outputs: Vec<i64>| {
        parse(
            "FusedSoftmax",
            &[
                ("program", AttrValue::Str(program.into())),
                ("outputs", AttrValue::Ints(outputs)),
            ],
        )
    };
    assert!(two(vec![2]).is_ok());
    let e = two(vec![1, 2]).unwrap_err();
    assert!(e.contains("outputs one value"), "{e}");
    let e = infer_err(
        masked(DType::F32, 2, false).as_ref(),
        &[f32t(&[3, 8]), f32t(&[]), f32t(&[8])],
    );
    assert!(e.contains("axis"), "{e}");
    let e = infer_err(
        masked(DType::F32, -1, false).as_ref(),
        &[f32t(&[3, 8]), f32t(&[]), f32t(&[7])],
    );
    assert!(e.contains("v3"), "{e}");
}

// ---- SoftmaxCrossEntropyWithGrad over padded logits ----

/// With `classes`, only the first columns are classes: the loss and gradient are those
/// of the sliced logits (the naive reference), the gradient padded with zero columns,
/// whatever the padding holds.
#[test]
fn cross_entropy_with_grad_reads_only_its_classes() {
    let (n, c, width) = (3, 5, 8);
    let mut v: Vec<f64> = (0..n * width)
        .map(|i| (i as f64 * 0.61).sin() * 3.0)
        .collect();
    for r in 0..n {
        v[r * width + c..(r + 1) * width].fill(f64::NAN);
    }
    let padded = Tensor::from_f64(DType::F32, [n, width], &v).unwrap();
    let labels = [4usize, 0, 2];
    let l = Tensor::from_f64(DType::I64, [n], &labels.map(|x| x as f64)).unwrap();
    let dloss = Tensor::scalar(DType::F32, 2.0);
    let op = SoftmaxCrossEntropyWithGrad {
        grad_dtype: Some(DType::F16),
        column_sum: true,
        classes: Some(c),
    };
    let out = op.eval(&[&padded, &l, &dloss]).unwrap();
    let sliced: Vec<f64> = (0..n)
        .flat_map(|r| v[r * width..r * width + c].to_vec())
        .collect();
    let loss = naive_xent(&sliced, n, c, &labels);
    assert!(
        (out[0].to_f64_vec()[0] - loss).abs() < 1e-6,
        "{:?} vs {loss}",
        out[0]
    );
    let softmax = naive_softmax(&sliced, &[n, c], 1, false);
    let grad = out[1].to_f64_vec();
    assert_eq!(out[1].shape(), [n, width]);
    for r in 0..n {
        for j in 0..width {
            let want = if j < c {
                let target = if j == labels[r] { 1.0 } else { 0.0 };
                (softmax[r * c + j] - target) * 2.0 / n as f64
            } else {
                0.0
            };
            let got = grad[r * width + j];
            assert!((got - want).abs() < 1e-3, "[{r}, {j}]: {got} vs {want}");
        }
    }
    let sums = out[2].to_f64_vec();
    assert_eq!(sums.len(), width);
    assert!(sums[c..].iter().all(|&s| s == 0.0));
    assert_round_trip(&op);

    let f32t = |s: &[usize]| tt(DType::F32, s);
    let (labels_ty, scalar) = (tt(DType::I64, &[n]), f32t(&[]));
    for classes in [0, 9] {
        let op = SoftmaxCrossEntropyWithGrad {
            classes: Some(classes),
            ..Default::default()
        };
        let e = infer_err(&op, &[f32t(&[n, width]), labels_ty.clone(), scalar.clone()]);
        assert!(e.contains("must be 1 to the width"), "{e}");
    }
    let e = parse(
        "SoftmaxCrossEntropyWithGrad",
        &[("classes", AttrValue::Int(-1))],
    );
    assert!(e.is_err_and(|e| e.contains("negative")));
}
