//! Helpers shared by the gradient and GPU tests: deterministic data, tolerances, op
//! runners, the CUDA executor or the reason there is none.
// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use ampgraph_exec::gradcheck::{check_op_gradient, check_output0_gradient};
use ampgraph_exec::{cuda, CpuExecutor, CudaExecutor, Executor, Feeds};
use ampgraph_graph::attrs::{AttrMap, AttrReader, AttrValue};
use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::ops::{parse_op, Binary, BinaryKind, Const, Placeholder, Reduce, ReduceKind};
use ampgraph_graph::{DType, Graph, Op, Port, Tensor, TensorType};
use proptest::prelude::*;

/// A CUDA executor, or `None` (after printing why) where CUDA is unavailable.
pub fn gpu() -> Option<CudaExecutor> {
    match cuda::available() {
        Err(why) => {
            println!("skipping: {why}");
            None
        }
        Ok(_) => Some(CudaExecutor::new(0).expect("CUDA is available but the executor failed")),
    }
}

pub const FLOATS: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// The bound on gradcheck's relative error. Central differences with h = 1e-6 in
/// f64 have truncation error ~h^2 |f'''| ~ 1e-12 and rounding error ~eps |loss| / h
/// ~ 1e-10 |loss| for the small losses used here: 1e-6 leaves a wide margin while
/// catching any wrong rule (those are off by O(1)).
pub const GRAD_TOL: f64 = 1e-6;

/// splitmix64: small, deterministic, good enough for test data.
pub struct Gen(pub u64);

impl Gen {
    pub fn next_u64(&mut self) -> u64 {
        ampgraph_graph::rng::step(&mut self.0)
    }
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * u
    }
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// Uniform in [lo, hi] with |x - k| >= gap for each kink k.
    pub fn away(&mut self, lo: f64, hi: f64, kinks: &[f64], gap: f64) -> f64 {
        loop {
            let x = self.uniform(lo, hi);
            if kinks.iter().all(|k| (x - k).abs() >= gap) {
                return x;
            }
        }
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// A random permutation of 0..n.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
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

/// NumPy broadcast of two shapes (restated).
pub fn broadcast(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    let pad = |s: &[usize]| {
        let mut v = vec![1; r - s.len()];
        v.extend_from_slice(s);
        v
    };
    pad(a).iter().zip(pad(b)).map(|(&x, y)| x.max(y)).collect()
}

pub fn t64(shape: &[usize], values: &[f64]) -> Tensor {
    Tensor::from_f64(DType::F64, shape.to_vec(), values).unwrap()
}

/// Stores `values` as `dtype`; returns the tensor and the values as stored.
pub fn stored(dtype: DType, shape: &[usize], values: &[f64]) -> (Tensor, Vec<f64>) {
    let t = Tensor::from_f64(dtype, shape.to_vec(), values).unwrap();
    let v = t.to_f64_vec();
    (t, v)
}

/// Asserts gradcheck's relative error is below [`GRAD_TOL`].
pub fn assert_grad(op: Box<dyn Op>, inputs: &[Tensor], seed: u64) {
    let what = format!("{op:?}");
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
    let r = check_op_gradient(op, inputs, seed)
        .unwrap_or_else(|e| panic!("{what} at {shapes:?}: gradcheck failed: {e}"));
    assert!(
        r.max_rel_err < GRAD_TOL,
        "{what} at {shapes:?}: max relative error {:e} (abs {:e}) over {} elements",
        r.max_rel_err,
        r.max_abs_err,
        r.checked
    );
}

/// Per-dtype relative tolerance of one kernel evaluation against an f64 reference:
/// one rounding to the storage dtype plus a few ulps of f32 (or f64) compute.
pub fn rtol(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        _ => unreachable!(),
    }
}

/// |got - want| <= rtol * (|want| + floor), with `floor` the value scale below which
/// errors count as absolute.
pub fn check_close(what: &str, dtype: DType, floor: f64, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &r)) in got.iter().zip(want).enumerate() {
        let tol = rtol(dtype) * (r.abs() + floor);
        assert!(
            (g - r).abs() <= tol || (g.is_nan() && r.is_nan()) || g == r,
            "{what} {dtype}: element {i}: got {g}, want {r} (tolerance {tol:e})"
        );
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
    assert_eq!(
        y.ty(),
        inferred[0],
        "{op:?}: eval's type differs from infer's"
    );
    y
}

pub fn tt(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dtype, shape.to_vec())
}

pub fn infer_err(op: &dyn Op, types: &[TensorType]) -> String {
    let refs: Vec<&TensorType> = types.iter().collect();
    match op.infer(&refs) {
        Ok(t) => panic!("{op:?} accepted {types:?} giving {t:?}"),
        Err(e) => e,
    }
}

/// Checks that `op` refuses each case's input types with an error naming the problem.
pub fn assert_infer_errs(op: &dyn Op, cases: &[(Vec<TensorType>, &str)]) {
    for (types, wanted) in cases {
        let e = infer_err(op, types);
        assert!(e.contains(wanted), "{types:?}: {e} (wanted {wanted:?})");
    }
}

/// Builds an op from its file form.
pub fn parse(name: &str, attrs: &[(&str, AttrValue)]) -> Result<Box<dyn Op>, String> {
    let map: AttrMap = attrs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    parse_op(name, AttrReader::new(map))
}

/// The op's attrs written out and parsed back give the same op.
pub fn assert_round_trip(op: &dyn Op) {
    let back = parse(op.name(), &op.attrs()).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    assert!(*back == *op, "{op:?} round-trips to {back:?}");
}

/// Adds a placeholder `in{i}` for each input and `op` (named "op") on them; returns
/// the placeholders and the op's output 0.
pub fn add_op_on_placeholders(
    g: &mut Graph,
    op: Box<dyn Op>,
    inputs: &[Tensor],
) -> (Vec<Port>, Port) {
    let ports: Vec<Port> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            g.add_node(format!("in{i}"), Box::new(Placeholder(t.ty())), &[])
                .unwrap()
                .into()
        })
        .collect();
    let y = g.add_node("op", op, &ports).unwrap();
    (ports, Port::new(y, 0))
}

/// A graph of `op` on placeholders `in{i}` and the feeds giving them `inputs`; the
/// op's outputs.
pub fn op_graph(op: Box<dyn Op>, inputs: &[Tensor]) -> (Graph, Feeds, Vec<Port>) {
    let mut g = Graph::new();
    let (_, y) = add_op_on_placeholders(&mut g, op, inputs);
    let outs = (0..g.node(y.node).outputs().len())
        .map(|k| Port::new(y.node, k))
        .collect();
    let feeds = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("in{i}"), t.clone()))
        .collect();
    (g, feeds, outs)
}

/// `op` over `inputs` on the GPU and on the CPU: (GPU outputs, CPU outputs).
pub fn run_both(
    gpu: &mut CudaExecutor,
    what: &str,
    op: impl Op,
    inputs: &[Tensor],
) -> (Vec<Tensor>, Vec<Tensor>) {
    run_both_boxed(gpu, what, Box::new(op), inputs)
}

/// [`run_both`] of a boxed op.
pub fn run_both_boxed(
    gpu: &mut CudaExecutor,
    what: &str,
    op: Box<dyn Op>,
    inputs: &[Tensor],
) -> (Vec<Tensor>, Vec<Tensor>) {
    let (g, feeds, outs) = op_graph(op, inputs);
    let cpu = CpuExecutor::new()
        .run(&g, &feeds, &outs)
        .unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let dev = gpu
        .run(&g, &feeds, &outs)
        .unwrap_or_else(|e| panic!("{what}: cuda: {e}"));
    (dev, cpu)
}

/// Adds `sum(y * w)` with `w` a constant; returns the loss.
pub fn weighted_sum(g: &mut Graph, y: Port, w: Tensor) -> Port {
    let w = g.add(Const::new(w), &[]).unwrap();
    let prod = g.add(Binary::new(BinaryKind::Mul), &[y, w]).unwrap();
    g.add(Reduce::new(ReduceKind::Sum, None, false), &[prod])
        .unwrap()
}

/// Differentiates `loss = sum(op(inputs) * w)` built entirely in the inputs' dtypes
/// (f16 stays f16) and returns the gradient of each float input, run on the CPU with
/// the given values. The graph is also checked to validate and to round-trip
/// through the JSON format.
pub fn graph_gradients(op: Box<dyn Op>, inputs: &[Tensor]) -> Vec<Tensor> {
    let mut g = Graph::new();
    let (ports, y) = add_op_on_placeholders(&mut g, op, inputs);
    let ty = g.ty(y).clone();
    let n = ty.checked_len().unwrap();
    let w: Vec<f64> = (0..n)
        .map(|i| 0.25 + 0.5 * ((i % 5) as f64) / 4.0)
        .collect();
    let w = Tensor::from_f64(ty.dtype, ty.shape.clone(), &w).unwrap();
    let loss = weighted_sum(&mut g, y, w);
    let wrt: Vec<Port> = ports
        .iter()
        .zip(inputs)
        .filter(|(_, t)| t.dtype().is_float())
        .map(|(&p, _)| p)
        .collect();
    let grads = gradients(&mut g, loss, &wrt).unwrap();
    g.validate().unwrap();
    for (&p, &x) in grads.iter().zip(&wrt) {
        assert_eq!(g.ty(p), g.ty(x), "the gradient's type is the input's");
    }
    let def = ampgraph_graph::format::GraphDef::from_graph(&g);
    let json = ampgraph_graph::format::to_json(&def);
    let back = ampgraph_graph::format::parse_json(json.as_bytes())
        .and_then(|d| d.to_graph())
        .unwrap_or_else(|e| panic!("the gradient graph does not reload: {e}"));
    assert_eq!(back.len(), g.len());
    let feeds = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("in{i}"), t.clone()))
        .collect();
    CpuExecutor::new().run(&g, &feeds, &grads).unwrap()
}

/// Shapes of rank 0..=max_rank with dimensions 1..=max_dim.
pub fn shape(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1..=max_dim, 0..=max_rank)
}

/// Two shapes that broadcast together (either may be of lower rank or have 1s).
pub fn broadcast_pair(
    max_rank: usize,
    max_dim: usize,
) -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    shape(max_rank, max_dim).prop_flat_map(|out| {
        let r = out.len();
        let side = move |out: Vec<usize>| {
            (0..=r, prop::collection::vec(any::<bool>(), r)).prop_map(move |(drop, ones)| {
                out.iter()
                    .zip(&ones)
                    .skip(drop)
                    .map(|(&d, &one)| if one { 1 } else { d })
                    .collect::<Vec<usize>>()
            })
        };
        (side(out.clone()), side(out))
    })
}

/// gradcheck restricted to output 0 in the loss and the inputs `wrt`: the largest
/// |analytic - numeric| / max(1, |numeric|).
pub fn check_output0(op: Box<dyn Op>, inputs: &[Tensor], wrt: &[usize], seed: u64) -> f64 {
    check_output0_gradient(op, inputs, wrt, seed)
        .unwrap()
        .max_rel_err
}

/// `k` tensors of `n` f32 values, each `Exp(BroadcastTo(x))` of the `[1]` Placeholder
/// `x`, summed right to left: every one is alive when the innermost sum runs. Returns
/// the graph and the sum.
pub fn wide_sum(k: usize, n: usize) -> (Graph, Port) {
    use ampgraph_graph::ops::{BroadcastTo, Unary, UnaryKind};
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [1]).unwrap();
    let terms: Vec<Port> = (0..k)
        .map(|_| {
            let b = g.add(BroadcastTo::new([n]), &[x]).unwrap();
            g.add(Unary::new(UnaryKind::Exp), &[b]).unwrap()
        })
        .collect();
    let mut sum = *terms.last().unwrap();
    for &t in terms.iter().rev().skip(1) {
        sum = g.add(Binary::new(BinaryKind::Add), &[t, sum]).unwrap();
    }
    g.set_outputs(vec![sum]).unwrap();
    (g, sum)
}

/// The feed of [`wide_sum`]'s `x`: 0.5.
pub fn wide_sum_feeds() -> Feeds {
    Feeds::from([(
        "x".into(),
        Tensor::from_f64(DType::F32, [1], &[0.5]).unwrap(),
    )])
}
