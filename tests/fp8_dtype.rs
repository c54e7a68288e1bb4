//! The FP8 dtypes (`f8e4m3`, `f8e5m2`; issue 44): casts round as the GPU's
//! `cvt.rn.satfinite` (an f64 correctly, not through an f32 tie), and FP8 tensors
//! survive every format a tensor is stored in (graph JSON and binary, checkpoints).
//! onnxruntime's casts are compared in tests/onnx_export.rs.

use ampgraph::graph::format::{self, GraphDef};
use ampgraph::graph::fp8::Fp8;
use ampgraph::graph::ops::Const;
use ampgraph::graph::Op;
use ampgraph::{DType, Graph, Tensor};

const FORMATS: [(DType, Fp8); 2] = [(DType::F8E4M3, Fp8::E4M3), (DType::F8E5M2, Fp8::E5M2)];

/// Every finite code of `f`, both zeros included.
fn finite_codes(f: Fp8) -> Vec<u8> {
    (0..=255u8).filter(|&c| f.decode(c).is_finite()).collect()
}

/// The float64 reference: the nearest finite value by brute force over the codes
/// (ties to the even code), saturating; zeros keep the sign.
fn nearest(f: Fp8, x: f64) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= f64::from(f.max()) {
        return f.max_code() | sign;
    }
    let mut best = (f64::INFINITY, 0u8);
    for code in 0..=f.max_code() {
        let d = (f64::from(f.decode(code)) - a).abs();
        if d < best.0 || (d == best.0 && code % 2 == 0) {
            best = (d, code);
        }
    }
    best.1 | sign
}

/// f64 values a hair either side of each midpoint round to the nearer neighbour,
/// where going through f32 first would land on the midpoint and round it to even.
#[test]
fn casts_from_f64_round_once_to_the_nearest() {
    for (dtype, f) in FORMATS {
        let values: Vec<f64> = (0..=f.max_code()).map(|c| f64::from(f.decode(c))).collect();
        let mut xs = Vec::new();
        for pair in values.windows(2) {
            let mid = (pair[0] + pair[1]) / 2.0;
            let hair = mid * 2f64.powi(-40);
            xs.extend([mid, mid + hair, mid - hair, pair[0], pair[1]]);
        }
        xs.extend([f64::from(f.max()) * 1.5, 1e300, f64::INFINITY]);
        let xs: Vec<f64> = xs.iter().flat_map(|&x| [x, -x]).collect();
        let t = Tensor::from_f64(DType::F64, [xs.len()], &xs)
            .unwrap()
            .cast(dtype);
        let codes = t.data().to_le_bytes();
        for (x, code) in xs.iter().zip(codes) {
            assert_eq!(code, nearest(f, *x), "{dtype} of {x:e}");
        }
        // From f32, the same rounding as the format's own conversion.
        let ys: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
        let t = Tensor::new([ys.len()], ampgraph::graph::Data::F32(ys.clone())).unwrap();
        for (y, code) in ys.iter().zip(t.cast(dtype).data().to_le_bytes()) {
            assert_eq!(code, f.encode(*y), "{dtype} of {y:e}");
        }
    }
}

/// A Const holding every finite code of each format keeps its bits through the graph
/// formats (JSON, binary) and a checkpoint.
#[test]
fn fp8_values_survive_every_format() {
    let mut g = Graph::new();
    let mut tensors = Vec::new();
    for (dtype, f) in FORMATS {
        let codes = finite_codes(f);
        let t = Tensor::new(
            [codes.len()],
            ampgraph::graph::Data::from_le_bytes(dtype, &codes).unwrap(),
        )
        .unwrap();
        g.add_node(dtype.as_str(), Box::new(Const::new(t.clone())), &[])
            .unwrap();
        tensors.push((dtype.as_str().to_string(), t));
    }
    let def = GraphDef::from_graph(&g);
    let from_json = format::graph_from_bytes(format::to_json(&def).as_bytes()).unwrap();
    let from_bin = format::from_bin(&format::to_bin(&def).unwrap())
        .unwrap()
        .to_graph()
        .unwrap();
    for (name, want) in &tensors {
        for (how, graph) in [("json", &from_json), ("bin", &from_bin)] {
            let node = graph.node(graph.require(name).unwrap());
            let got = node.op.downcast_ref::<Const>().unwrap().eval(&[]).unwrap();
            assert_eq!(got[0].dtype(), want.dtype(), "{how}");
            assert_eq!(
                got[0].data().to_le_bytes(),
                want.data().to_le_bytes(),
                "{name} via {how}"
            );
        }
    }
    let dir = std::env::temp_dir().join(format!("ampgraph-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("fp8.ckpt");
    ampgraph::checkpoint::write(&path, &tensors).unwrap();
    let back = ampgraph::checkpoint::read(&path, false).unwrap();
    for ((name, want), (got_name, got)) in tensors.iter().zip(&back) {
        assert_eq!(name, got_name);
        assert_eq!(
            got.data().to_le_bytes(),
            want.data().to_le_bytes(),
            "{name}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The dtypes read and print as `f8e4m3` and `f8e5m2`, one byte a value; a product
/// of FP8 tensors is refused when the graph is built, not when it runs.
#[test]
fn fp8_dtypes_are_named_and_sized() {
    for (dtype, _) in FORMATS {
        assert_eq!(dtype.as_str().parse::<DType>().unwrap(), dtype);
        assert_eq!(dtype.size_bytes(), 1);
        // Storage: no arithmetic reads them (the scaled casts do).
        assert!(dtype.is_fp8() && !dtype.is_float() && !dtype.is_half());
    }
}

/// `QuantizeFp8` stores `f32(x) * scale` as the format's conversion does and gives
/// max |x| beside it (NaN where x holds one); `DequantizeFp8` by the inverse scale
/// gives x back within the format's half step (2^-4 relative for E4M3, 2^-3 for
/// E5M2) where the scaled values are normal, and the saturated value past the largest.
#[test]
fn scaled_casts_round_saturate_and_report_the_amax() {
    use ampgraph::graph::ops::{DequantizeFp8, QuantizeFp8};
    let xs: Vec<f64> = (0..2000)
        .map(|i| ((i as f64) * 0.37).sin() * 3.0 * (1.0 + (i % 7) as f64))
        .collect();
    let amax = xs.iter().fold(0f64, |m, v| m.max(v.abs())) as f32;
    let x = Tensor::from_f64(DType::F32, [xs.len()], &xs).unwrap();
    for ((dtype, f), half_step) in FORMATS.into_iter().zip([2f64.powi(-4), 2f64.powi(-3)]) {
        // Current scaling: the amax lands on the format's largest value.
        let s = f.max() / amax;
        let scale = Tensor::scalar(DType::F32, f64::from(s));
        let q = QuantizeFp8::new(dtype).unwrap();
        let out = q.eval(&[&x, &scale]).unwrap();
        assert_eq!(out[0].dtype(), dtype);
        assert_eq!(out[1].to_f64_vec(), vec![f64::from(amax)]);
        for (v, code) in xs.iter().zip(out[0].data().to_le_bytes()) {
            assert_eq!(code, f.encode(*v as f32 * s), "{dtype} of {v}");
        }
        let inv = Tensor::scalar(DType::F32, f64::from(1.0 / s));
        let back = DequantizeFp8::new(DType::F32)
            .unwrap()
            .eval(&[&out[0], &inv])
            .unwrap();
        let min_normal = f64::from(f.decode(1 << f.mantissa_bits())) / f64::from(s);
        for (v, b) in xs.iter().zip(back[0].to_f64_vec()) {
            if v.abs() >= min_normal {
                assert!(
                    (b - v).abs() <= half_step * v.abs() * 1.0001,
                    "{dtype}: {v} -> {b}"
                );
            }
        }
        // Twice the scale: the largest values saturate at the format's largest.
        let twice = Tensor::scalar(DType::F32, f64::from(2.0 * s));
        let out = q.eval(&[&x, &twice]).unwrap();
        let top = out[0].to_f64_vec().iter().fold(0f64, |m, v| m.max(v.abs()));
        assert_eq!(top, f64::from(f.max()));
    }
    let with_nan = Tensor::from_f64(DType::F32, [3], &[1.0, f64::NAN, -2.0]).unwrap();
    let one = Tensor::scalar(DType::F32, 1.0);
    let out = QuantizeFp8::new(DType::F8E4M3)
        .unwrap()
        .eval(&[&with_nan, &one])
        .unwrap();
    assert!(out[1].to_f64_vec()[0].is_nan());
}

/// The transposed copy holds the same codes as the values, element `[j, i]` being
/// `[i, j]`; only matrices have one, and the attr reads back from a file.
#[test]
fn a_transposed_quantisation_copies_the_codes_transposed() {
    use ampgraph::graph::ops::QuantizeFp8;
    use ampgraph::TensorType;
    let (rows, cols) = (5, 7);
    let xs: Vec<f64> = (0..rows * cols)
        .map(|i| (i as f64 * 0.71).sin() * 40.0)
        .collect();
    let x = Tensor::from_f64(DType::BF16, [rows, cols], &xs).unwrap();
    let scale = Tensor::scalar(DType::F32, 3.5);
    let q = QuantizeFp8::new(DType::F8E4M3)
        .unwrap()
        .with_transposed(true);
    let out = q.eval(&[&x, &scale]).unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(out[2].shape(), &[cols, rows]);
    let (codes, t) = (out[0].data().to_le_bytes(), out[2].data().to_le_bytes());
    for i in 0..rows {
        for j in 0..cols {
            assert_eq!(t[j * rows + i], codes[i * cols + j], "[{i}, {j}]");
        }
    }
    let plain = QuantizeFp8::new(DType::F8E4M3).unwrap();
    assert_eq!(plain.eval(&[&x, &scale]).unwrap()[0], out[0]);
    let vector = TensorType::new(DType::BF16, [8]);
    let s = TensorType::new(DType::F32, []);
    assert!(q.infer(&[&vector, &s]).unwrap_err().contains("of a matrix"));
    let mut g = Graph::new();
    let xp = g.placeholder("x", DType::BF16, [rows, cols]).unwrap();
    let sp = g.scalar(DType::F32, 3.5).unwrap();
    let node = g.add_node("q", Box::new(q), &[xp, sp]).unwrap();
    g.set_outputs(vec![ampgraph::Port::new(node, 2)]).unwrap();
    let again =
        format::graph_from_bytes(format::to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
    assert_eq!(again.ty(again.outputs()[0]).shape, vec![cols, rows]);
}

/// Wrong types are refused by name; the ops read back from a graph file.
#[test]
fn scaled_casts_check_their_types_and_serialise() {
    use ampgraph::graph::ops::{DequantizeFp8, QuantizeFp8};
    use ampgraph::TensorType;
    assert!(QuantizeFp8::new(DType::F16)
        .unwrap_err()
        .contains("not f16"));
    assert!(DequantizeFp8::new(DType::F8E4M3)
        .unwrap_err()
        .contains("not f8e4m3"));
    let q = QuantizeFp8::new(DType::F8E5M2).unwrap();
    let x = TensorType::new(DType::BF16, [4, 8]);
    let vector = TensorType::new(DType::F32, [1]);
    assert!(q
        .infer(&[&x, &vector])
        .unwrap_err()
        .contains("scale must be an f32 scalar"));
    let mut g = Graph::new();
    let xp = g.placeholder("x", DType::BF16, [4, 8]).unwrap();
    let s = g.scalar(DType::F32, 0.5).unwrap();
    let y = g.add(q, &[xp, s]).unwrap();
    let back = g
        .add(DequantizeFp8::new(DType::F16).unwrap(), &[y, s])
        .unwrap();
    let w = g.placeholder("w", DType::F8E4M3, [8, 3]).unwrap();
    let product = ampgraph::graph::ops::MatMul::new(false, false);
    let op = ampgraph::graph::ops::Fp8MatMul::new(product, DType::BF16).unwrap();
    let p = g.add(op, &[y, w, s, s]).unwrap();
    g.set_outputs(vec![back, p]).unwrap();
    let again =
        format::graph_from_bytes(format::to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
    assert_eq!(again.ty(again.outputs()[0]).dtype, DType::F16);
    let ops: Vec<&str> = again
        .node_ids()
        .map(|id| again.node(id).op.name())
        .collect();
    assert!(
        ops.contains(&"QuantizeFp8") && ops.contains(&"DequantizeFp8"),
        "{ops:?}"
    );
    assert_eq!(
        again.ty(again.outputs()[1]),
        &TensorType::new(DType::BF16, [4, 3])
    );
}

/// A group of weights' casts takes matrices of one dtype, names the member at fault,
/// and refuses a parsed group of no members.
#[test]
fn grouped_casts_check_their_members() {
    use ampgraph::graph::attrs::AttrReader;
    use ampgraph::graph::ops::{parse_op, GroupedQuantizeFp8};
    use ampgraph::TensorType;
    let op = GroupedQuantizeFp8::new(DType::F8E4M3, 2).unwrap();
    let s = TensorType::new(DType::F32, []);
    let (bf16, f32) = (
        TensorType::new(DType::BF16, [8, 16]),
        TensorType::new(DType::F32, [16, 8]),
    );
    let outs = op.infer(&[&bf16, &s, &bf16, &s]).unwrap();
    assert_eq!(outs.len(), 6);
    assert_eq!(outs[5], TensorType::new(DType::F8E4M3, [16, 8]));
    let mixed = op.infer(&[&bf16, &s, &f32, &s]).unwrap_err();
    assert!(mixed.contains("one dtype, not bf16 and f32"), "{mixed}");
    let vector = TensorType::new(DType::BF16, [8]);
    let err = op.infer(&[&bf16, &s, &vector, &s]).unwrap_err();
    assert!(err.starts_with("member 1: "), "{err}");
    let attrs = |members: i64| {
        let map = [("to", DType::F8E4M3.into()), ("members", members.into())];
        AttrReader::new(map.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
    };
    let none = parse_op("GroupedQuantizeFp8", attrs(0)).unwrap_err();
    assert!(none.contains("'members' must be positive"), "{none}");
    let two = parse_op("GroupedQuantizeFp8", attrs(2)).unwrap();
    assert_eq!(two.downcast_ref::<GroupedQuantizeFp8>(), Some(&op));
}

/// The FP8 cast of a program's value takes a program of one stored value and no
/// amaxes, and no activation of its own; its outputs are the cast's, then the
/// program's column sums.
#[test]
fn a_cast_of_a_program_checks_its_program() {
    use ampgraph::graph::ops::fused::{Expr, Instr};
    use ampgraph::graph::ops::{BinaryKind, UnaryKind};
    use ampgraph::graph::ops::{ElementOp, FusedElementwise, FusedQuantizeFp8, QuantizeFp8};
    use ampgraph::TensorType;
    let ty = TensorType::new(DType::BF16, [16, 24]);
    let instr = |expr| Instr {
        expr,
        ty: ty.clone(),
    };
    let program = |outputs: Vec<usize>| {
        FusedElementwise::new(
            vec![
                instr(Expr::Input(0)),
                instr(Expr::Input(1)),
                instr(Expr::Apply(ElementOp::Binary(BinaryKind::Mul), vec![0, 1])),
                instr(Expr::Apply(ElementOp::Unary(UnaryKind::Relu), vec![2])),
            ],
            outputs,
        )
        .unwrap()
    };
    let cast = QuantizeFp8::new(DType::F8E4M3)
        .unwrap()
        .with_transposed(true);
    let two = FusedQuantizeFp8::new(cast.clone(), program(vec![2, 3])).unwrap_err();
    assert!(two.contains("stores one value"), "{two}");
    let measured = program(vec![3]).with_amaxes(vec![3]).unwrap();
    let e = FusedQuantizeFp8::new(cast.clone(), measured).unwrap_err();
    assert!(e.contains("1 amaxes"), "{e}");
    let gelu = Some(UnaryKind::Gelu { approximate: false });
    let e = FusedQuantizeFp8::new(cast.clone().with_activation(gelu), program(vec![3]));
    assert!(e.unwrap_err().contains("no activation"));
    let summed = program(vec![3]).with_column_sums(vec![3]).unwrap();
    let op = FusedQuantizeFp8::new(cast, summed).unwrap();
    let scale = TensorType::new(DType::F32, []);
    let outs = op.infer(&[&ty, &ty, &scale]).unwrap();
    let dtypes: Vec<DType> = outs.iter().map(|t| t.dtype).collect();
    assert_eq!(
        dtypes,
        [DType::F8E4M3, DType::F32, DType::F8E4M3, DType::F32]
    );
    assert_eq!(outs[2].shape, [24, 16]);
    assert_eq!(outs[3].shape, [24]);
}

#[test]
fn arithmetic_on_fp8_is_refused_when_built() {
    let mut g = Graph::new();
    let a = g.placeholder("a", DType::F8E4M3, [2, 2]).unwrap();
    let e = g.matmul(a, a).unwrap_err().to_string();
    assert!(e.contains("must be a float tensor, got f8e4m3"), "{e}");
}

/// `Fp8MatMul` of quantized operands against a float64 product of the values the
/// codes hold, times the scale inverses: within f32 accumulation's rounding (and the
/// output type's); E5M2 by E5M2 and FP8 outputs are refused, as cuBLASLt has neither.
#[test]
fn fp8_products_match_a_float64_reference() {
    use ampgraph::graph::ops::{Fp8MatMul, MatMul, QuantizeFp8};
    use ampgraph::TensorType;
    let (m, k, n) = (7, 64, 5);
    let values = |count: usize, seed: f64| -> Vec<f64> {
        (0..count)
            .map(|i| ((i as f64) * seed).sin() * 2.5)
            .collect()
    };
    let a = Tensor::from_f64(DType::F32, [k, m], &values(m * k, 0.71)).unwrap();
    let b = Tensor::from_f64(DType::F32, [k, n], &values(k * n, 1.37)).unwrap();
    let (sa, sb) = (64.0f32, 8.0f32);
    let quantize = |x: &Tensor, to: DType, s: f32| {
        QuantizeFp8::new(to)
            .unwrap()
            .eval(&[x, &Tensor::scalar(DType::F32, f64::from(s))])
            .unwrap()[0]
            .clone()
    };
    for (ta, tb, to) in [
        (DType::F8E4M3, DType::F8E4M3, DType::F32),
        (DType::F8E4M3, DType::F8E5M2, DType::BF16),
        (DType::F8E5M2, DType::F8E4M3, DType::F16),
    ] {
        let (qa, qb) = (quantize(&a, ta, sa), quantize(&b, tb, sb));
        let op = Fp8MatMul::new(MatMul::new(true, false), to).unwrap();
        let inv = |s: f32| Tensor::scalar(DType::F32, f64::from(1.0 / s));
        let y = op.eval(&[&qa, &qb, &inv(sa), &inv(sb)]).unwrap().remove(0);
        assert_eq!(y.ty(), TensorType::new(to, [m, n]));
        let (av, bv) = (qa.to_f64_vec(), qb.to_f64_vec());
        let scale = f64::from(1.0 / sa) * f64::from(1.0 / sb);
        let got = y.to_f64_vec();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|p| av[p * m + i] * bv[p * n + j]).sum::<f64>() * scale;
                let bound: f64 = (0..k)
                    .map(|p| (av[p * m + i] * bv[p * n + j]).abs())
                    .sum::<f64>()
                    * scale;
                let out_ulp = if to == DType::F32 { 0.0 } else { 2f64.powi(-8) };
                let tol = bound * (k as f64 * 2f64.powi(-23)) + want.abs() * out_ulp;
                let e = (got[i * n + j] - want).abs();
                assert!(
                    e <= tol.max(1e-12),
                    "{ta}x{tb}->{to} [{i},{j}]: {} vs {want}",
                    got[i * n + j]
                );
            }
        }
        // The product approximates the unquantized one within the formats' steps:
        // each operand off by at most a half step (2^-4 of it for E4M3, 2^-3 for E5M2).
        let (af, bf) = (a.to_f64_vec(), b.to_f64_vec());
        let terms = (0..k).map(|p| af[p * m] * bf[p * n]);
        let (exact, size) = terms.fold((0.0, 0.0), |(s, z), t| (s + t, z + f64::abs(t)));
        assert!(
            (got[0] - exact).abs() <= 0.2 * size,
            "{} vs {exact}",
            got[0]
        );
    }
    let e5 = TensorType::new(DType::F8E5M2, [k, m]);
    let e5b = TensorType::new(DType::F8E5M2, [k, n]);
    let s = TensorType::new(DType::F32, []);
    let op = Fp8MatMul::new(MatMul::new(true, false), DType::F32).unwrap();
    assert!(op
        .infer(&[&e5, &e5b, &s, &s])
        .unwrap_err()
        .contains("both f8e5m2"));
    assert!(Fp8MatMul::new(MatMul::new(false, false), DType::F8E4M3)
        .unwrap_err()
        .contains("not f8e4m3"));
    // A bias: 16-bit results only, one value per column of the result's dtype.
    assert!(op.clone().with_bias(true).unwrap_err().contains("not f32"));
    let biased = Fp8MatMul::new(MatMul::new(true, false), DType::BF16)
        .unwrap()
        .with_bias(true)
        .unwrap();
    let e4 = TensorType::new(DType::F8E4M3, [k, n]);
    let wrong = TensorType::new(DType::BF16, [m]);
    assert!(biased
        .infer(&[&e5, &e4, &s, &s, &wrong])
        .unwrap_err()
        .contains("the bias must be bf16"));
    // A residual: 16-bit results only, the result's type, added after the bias: the
    // product, a BiasAdd and an Add apart, bit for bit (hand-checked on one value).
    assert!(op.with_residual(true).unwrap_err().contains("not f32"));
    let with_residual = biased.clone().with_residual(true).unwrap();
    let out = TensorType::new(DType::BF16, [m, n]);
    assert!(with_residual
        .infer(&[&e5, &e4, &s, &s, &TensorType::new(DType::BF16, [n]), &wrong])
        .unwrap_err()
        .contains("the residual must be bf16"));
    let values = |ty: &TensorType, seed: f64| {
        let v: Vec<f64> = (0..ty.checked_len().unwrap())
            .map(|i| ((i as f64 + seed) * 0.71).sin() * 2.0)
            .collect();
        Tensor::from_f64(ty.dtype, ty.shape.clone(), &v).unwrap()
    };
    let (qa, qb) = (values(&e5, 1.0), values(&e4, 2.0));
    let (sa, sb) = (
        Tensor::scalar(DType::F32, 0.5),
        Tensor::scalar(DType::F32, 4.0),
    );
    let bias = values(&TensorType::new(DType::BF16, [n]), 3.0);
    let residual = values(&out, 4.0);
    let fused = with_residual
        .eval(&[&qa, &qb, &sa, &sb, &bias, &residual])
        .unwrap();
    let apart = biased.eval(&[&qa, &qb, &sa, &sb, &bias]).unwrap();
    let add = ampgraph::graph::ops::Binary::new(ampgraph::graph::ops::BinaryKind::Add);
    let apart = add.eval(&[&apart[0], &residual]).unwrap();
    assert_eq!(fused, apart);
    let (af, bf) = (qa.to_f64_vec(), qb.to_f64_vec());
    let dot: f64 = (0..k).map(|p| af[p * m] * bf[p * n]).sum();
    let want = dot * 2.0 + bias.to_f64_vec()[0] + residual.to_f64_vec()[0];
    let got = fused[0].to_f64_vec()[0];
    assert!(
        (got - want).abs() <= 2e-2 * want.abs().max(1.0),
        "{got} vs {want}"
    );
    // Serialised and read back with its residual.
    let mut g = Graph::new();
    let ports: Vec<_> = [("a", &e5), ("b", &e4), ("sa", &s), ("sb", &s)]
        .into_iter()
        .chain([("bias", &TensorType::new(DType::BF16, [n])), ("r", &out)])
        .map(|(name, ty)| g.placeholder(name, ty.dtype, ty.shape.clone()).unwrap())
        .collect();
    let p = g.add(with_residual.clone(), &ports).unwrap();
    g.set_outputs(vec![p]).unwrap();
    let again =
        format::graph_from_bytes(format::to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
    let read = again
        .node(again.outputs()[0].node)
        .op
        .downcast_ref::<Fp8MatMul>();
    assert_eq!(read, Some(&with_residual));
}

/// The scale ops: current scaling maps the amax onto the format's largest value
/// (`2^margin` below it), is 1 for zeros and NaN for a non-finite amax; delayed
/// scaling pushes finite amaxes onto the history, newest first, and scales by its
/// max or newest, keeping the old scale where the history holds only zeros.
#[test]
fn fp8_scales_follow_the_recipes() {
    use ampgraph::graph::ops::{AmaxChoice, Fp8Scale, Fp8ScaleUpdate};
    let scalar = |v: f32| Tensor::scalar(DType::F32, f64::from(v));
    let values = |t: &Tensor| t.to_f64_vec();
    let current = |format, margin, x: &[f64]| {
        let x = Tensor::from_f64(DType::F32, [x.len()], x).unwrap();
        let out = Fp8Scale::new(format, margin).unwrap().eval(&[&x]).unwrap();
        (values(&out[0])[0], values(&out[1])[0])
    };
    assert_eq!(
        current(DType::F8E4M3, 0, &[0.5, -3.5]),
        (f64::from(448f32 / 3.5), f64::from(3.5f32 / 448.0))
    );
    assert_eq!(current(DType::F8E5M2, 2, &[2.0]).0, 57344.0 / 2.0 / 4.0);
    assert_eq!(current(DType::F8E4M3, 0, &[0.0, -0.0]), (1.0, 1.0));
    let (s, inv) = current(DType::F8E4M3, 0, &[1.0, f64::INFINITY]);
    assert!(s.is_nan() && inv.is_nan());
    assert!(Fp8Scale::new(DType::F16, 0).is_err() && Fp8Scale::new(DType::F8E4M3, 17).is_err());

    let op = |amax: AmaxChoice, members: usize| Fp8ScaleUpdate {
        scale: Fp8Scale::new(DType::F8E4M3, 0).unwrap(),
        amax,
        members,
    };
    let history = |h: &[f64]| Tensor::from_f64(DType::F32, [h.len()], h).unwrap();
    let update = |amax: AmaxChoice, h: &[f64], m: f32, scale: f32| {
        let inv = scalar(1.0 / scale);
        let out = op(amax, 1)
            .eval(&[&history(h), &scalar(m), &scalar(scale), &inv])
            .unwrap();
        (values(&out[0]), values(&out[1])[0], values(&out[2])[0])
    };
    // The inverse is the next scale's, which the next step's products read.
    let inverse = |s: f64| f64::from(1.0 / s as f32);
    let (h, next, inv) = update(AmaxChoice::Max, &[4.0, 8.0, 2.0], 1.0, 0.5);
    assert_eq!((h, next, inv), (vec![1.0, 4.0, 8.0], 56.0, inverse(56.0)));
    let (h, next, inv) = update(AmaxChoice::MostRecent, &[4.0, 8.0, 2.0], 7.0, 0.5);
    assert_eq!((h, next, inv), (vec![7.0, 4.0, 8.0], 64.0, 1.0 / 64.0));
    // A non-finite amax leaves the history, and so the scale, as they were.
    let (h, next, inv) = update(AmaxChoice::Max, &[4.0, 8.0], f32::NAN, 0.5);
    assert_eq!((h, next, inv), (vec![4.0, 8.0], 56.0, inverse(56.0)));
    let (h, next, inv) = update(AmaxChoice::Max, &[0.0, 0.0], f32::INFINITY, 3.0);
    assert_eq!((h, next, inv), (vec![0.0, 0.0], 3.0, inverse(3.0)));
    assert_eq!(update(AmaxChoice::Max, &[0.0, 0.0], 0.0, 3.0).1, 3.0);

    // Members step independently, inputs and outputs member after member.
    let (h0, h1) = (history(&[4.0, 8.0, 2.0]), history(&[0.5, 0.25, 1.0]));
    let (m0, m1, s0, s1) = (scalar(1.0), scalar(3.0), scalar(0.5), scalar(2.0));
    let (i0, i1) = (scalar(2.0), scalar(0.5));
    let both = op(AmaxChoice::Max, 2)
        .eval(&[&h0, &m0, &s0, &i0, &h1, &m1, &s1, &i1])
        .unwrap();
    let first = op(AmaxChoice::Max, 1).eval(&[&h0, &m0, &s0, &i0]).unwrap();
    let second = op(AmaxChoice::Max, 1).eval(&[&h1, &m1, &s1, &i1]).unwrap();
    assert_eq!(both, [first, second].concat());
    assert_eq!(values(&both[3]), [3.0, 0.5, 0.25]);
    let ty = |t: &Tensor| t.ty();
    let member = |h: &Tensor, m: &Tensor| [ty(h), ty(m), ty(&s0), ty(&i0)];
    let types = [member(&h0, &m0), member(&h1, &h1)].concat();
    let err = op(AmaxChoice::Max, 2)
        .infer(&types.iter().collect::<Vec<_>>())
        .unwrap_err();
    assert!(err.contains("member 1") && err.contains("amax"), "{err}");
}
