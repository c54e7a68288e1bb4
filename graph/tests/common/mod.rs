//! Helpers shared by the `ops_*` tests: deterministic data, per-dtype tolerances,
//! tensor builders, op runners and reference index helpers. None of them calls the
//! kernels under test.
// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::collections::BTreeMap;

use ampgraph_graph::attrs::{AttrReader, AttrValue};
use ampgraph_graph::ops::parse_op;
use ampgraph_graph::{DType, Op, Tensor, TensorType};

pub const FLOATS: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// splitmix64: small, deterministic, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// `n` values uniform in [lo, hi).
    pub fn vals(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| lo + (hi - lo) * self.uniform()).collect()
    }
    /// `n` values uniform in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f64> {
        self.vals(n, -1.0, 1.0)
    }
}

/// Per-dtype relative tolerance of one kernel evaluation against an f64 reference:
/// one rounding to the storage dtype plus a few ulps of f32 (or f64) compute.
pub fn rtol(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        other => panic!("no tolerance for {other}"),
    }
}

/// The unit roundoff of the compute type (f64 computes in f64, the others in f32).
pub fn unit_roundoff(d: DType) -> f64 {
    if d == DType::F64 {
        2f64.powi(-53)
    } else {
        2f64.powi(-24)
    }
}

/// The storage dtype's smallest subnormal step.
pub fn tiny(d: DType) -> f64 {
    match d {
        DType::F64 => f64::MIN_POSITIVE,
        DType::F32 => 1e-45,
        DType::F16 => 2f64.powi(-24),
        DType::BF16 => 1e-40,
        _ => unreachable!(),
    }
}

/// Checks outputs that each sum `k` terms:
/// |got - want| <= rtol * |want| + 2 * k * u * sum |terms| + tiny.
pub fn check_sums(what: &str, dtype: DType, k: usize, got: &[f64], want: &[f64], abs: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &r), &s)) in got.iter().zip(want).zip(abs).enumerate() {
        let tol = rtol(dtype) * r.abs() + 2.0 * k as f64 * unit_roundoff(dtype) * s + tiny(dtype);
        assert!(
            (g - r).abs() <= tol,
            "{what} {dtype}: element {i}: got {g}, want {r} (tolerance {tol:e})"
        );
    }
}

/// A tensor of `dtype` from f64 values, and the values it actually holds (rounded).
pub fn input(dtype: DType, shape: &[usize], vals: &[f64]) -> (Tensor, Vec<f64>) {
    let t = Tensor::from_f64(dtype, shape.to_vec(), vals).unwrap();
    let r = t.to_f64_vec();
    (t, r)
}

/// Asserts `got` has `dtype`, `shape` and values within `rtol(tol_dtype) * max(scale, |want|)`.
pub fn assert_close(
    what: &str,
    got: &Tensor,
    dtype: DType,
    shape: &[usize],
    want: &[f64],
    tol_dtype: DType,
    scale: f64,
) {
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    assert_eq!(got.shape(), shape, "{what}: shape");
    let g = got.to_f64_vec();
    assert_eq!(g.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in g.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
        } else if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}]");
        } else {
            let bound = rtol(tol_dtype) * scale.max(w.abs());
            assert!(
                (g - w).abs() <= bound,
                "{what}[{i}] ({tol_dtype}): got {g}, want {w}, |diff| {} > {bound}",
                (g - w).abs()
            );
        }
    }
}

/// Runs an op's kernel, checking the result has the type `infer` promised.
pub fn run(op: &dyn Op, inputs: &[&Tensor]) -> Tensor {
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = types.iter().collect();
    let inferred = op.infer(&refs).expect("infer");
    let mut out = op.eval(inputs).expect("eval");
    assert_eq!(out.len(), 1);
    let y = out.remove(0);
    assert_eq!(y.ty(), inferred[0], "eval's type differs from infer's");
    y
}

pub fn tys(ts: &[&Tensor]) -> Vec<TensorType> {
    ts.iter().map(|t| t.ty()).collect()
}

/// `op.infer` on the given types, expecting an error; returns its message.
pub fn infer_err(op: &dyn Op, types: &[TensorType]) -> String {
    let refs: Vec<&TensorType> = types.iter().collect();
    match op.infer(&refs) {
        Ok(t) => panic!("{} accepted {types:?} giving {t:?}", op.name()),
        Err(e) => e,
    }
}

pub fn tt(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dtype, shape.to_vec())
}

pub fn f32t(shape: &[usize]) -> TensorType {
    tt(DType::F32, shape)
}

/// An attribute reader over the given pairs.
pub fn attrs(pairs: &[(&str, AttrValue)]) -> AttrReader {
    AttrReader::new(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
    )
}

/// Builds an op from its file form.
pub fn parse(name: &str, pairs: &[(&str, AttrValue)]) -> Result<Box<dyn Op>, String> {
    parse_op(name, attrs(pairs))
}

/// The op's attrs written out and parsed back give the same op.
pub fn assert_round_trip(op: &dyn Op) {
    let attrs = op.attrs();
    let back = parse(op.name(), &attrs).unwrap();
    assert!(*back == *op, "{op:?} round-trips to {back:?}");
}

/// Row-major index of a multi-index.
pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// Multi-index of a row-major index.
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for ax in (0..shape.len()).rev() {
        idx[ax] = flat % shape[ax];
        flat /= shape[ax];
    }
    idx
}

/// A graph of `op` on placeholders of the given types, written as JSON and read back:
/// the op (name and attrs) and its output types survive.
pub fn assert_json_round_trip(op: Box<dyn Op>, inputs: &[TensorType]) {
    use ampgraph_graph::format::{parse_json, to_json, GraphDef};
    use ampgraph_graph::{Graph, Port};
    let mut g = Graph::new();
    let ports: Vec<Port> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            g.placeholder(format!("in{i}"), t.dtype, t.shape.clone())
                .unwrap()
        })
        .collect();
    let y = g.add_node("op", op, &ports).unwrap();
    g.set_outputs(vec![Port::new(y, 0)]).unwrap();
    let json = to_json(&GraphDef::from_graph(&g));
    let back = parse_json(json.as_bytes())
        .and_then(|d| d.to_graph())
        .unwrap_or_else(|e| panic!("{json}: {e}"));
    let (was, now) = (g.node(y), back.node(back.require("op").unwrap()));
    assert!(
        *now.op == *was.op,
        "{:?} reads back as {:?}",
        was.op,
        now.op
    );
    assert_eq!(now.outputs(), was.outputs());
}
