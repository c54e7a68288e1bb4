//! Shared by the integration tests: a random graph generator and helpers.
#![allow(dead_code)] // each test binary uses a different part of this module

use std::collections::HashMap;

use ampgraph::exec::feeds::seeded_tensor;
use ampgraph::exec::{CpuExecutor, Executor, Feeds};
use ampgraph::graph::format::{to_json, GraphDef};
use ampgraph::graph::ops::{
    BatchMatMul, BatchNorm, BiasAdd, Binary, BinaryKind, Cast, Concat, Const, DataFormat, Dropout,
    LogSoftmax, MatMul, NormActivation, Placeholder, Reduce, ReduceKind, Reshape, Softmax,
    Transpose, Unary, UnaryKind, Variable,
};
use ampgraph::graph::{DType, Graph, Port, Tensor, TensorType};
use proptest::prelude::{prop_assert, prop_assert_eq, TestCaseError};

/// SplitMix64, for reproducible graphs from a proptest-chosen seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        ampgraph::graph::rng::step(&mut self.0)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// `n` values uniform in [-1, 1) from `seed` ([`Rng`]).
pub fn uniform_values(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = Rng(seed);
    (0..n).map(|_| rng.unit() * 2.0 - 1.0).collect()
}

/// Whether CUDA is here; where not, prints "skipping: <reason>" (a GPU test then
/// passes without running).
pub fn cuda_or_skip() -> bool {
    match ampgraph::exec::cuda::available() {
        Ok(_) => true,
        Err(why) => {
            println!("skipping: {why}");
            false
        }
    }
}

/// Which ops the generator may use.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Menu {
    /// Every op family, numerically anything goes (for structural properties).
    Everything,
    /// Only ops whose f16 error stays proportional to the value scale (for numerics).
    WellConditioned,
    /// WellConditioned, plus what simplification passes rewrite: constant
    /// subexpressions, duplicates, x*1 and x+0, Transpose pairs, dead branches,
    /// BatchNorms after products and biases.
    Simplifiable,
}

/// How many extra step kinds [`Menu::Simplifiable`] draws from (see `simplifiable_step`).
const SIMPLIFIABLE_STEPS: usize = 8;

const D: usize = 8;

/// A random f32 graph over [8, 8] tensors, shaped like the TensorFlow oracle's graphs:
/// placeholders, a mix of allow/infer/clear/deny ops, and outputs through Identity sinks.
pub fn random_graph(seed: u64, size: usize, menu: Menu) -> Graph {
    let mut rng = Rng(seed);
    let mut g = Graph::new();
    let square = TensorType::new(DType::F32, vec![D, D]);
    let mut pool: Vec<Port> = Vec::new();
    let fresh_input = |g: &mut Graph, rng: &mut Rng| -> Port {
        let name = g.fresh_name("input");
        let op: Box<dyn ampgraph::graph::Op> = match (menu, rng.below(8)) {
            (Menu::Everything, 0) => Box::new(Variable::new(square.clone())),
            (_, 1) => {
                let values: Vec<f64> = (0..D * D).map(|_| rng.unit() - 0.5).collect();
                Box::new(Const::new(
                    Tensor::from_f64(DType::F32, vec![D, D], &values).unwrap(),
                ))
            }
            _ => Box::new(Placeholder(square.clone())),
        };
        g.add_node(name, op, &[]).unwrap().into()
    };
    for _ in 0..3 {
        let p = fresh_input(&mut g, &mut rng);
        pool.push(p);
    }
    let unary_all = [
        UnaryKind::Relu,
        UnaryKind::Relu6,
        UnaryKind::Elu,
        UnaryKind::Selu,
        UnaryKind::Gelu { approximate: false },
        UnaryKind::LeakyRelu { alpha: 0.2 },
        UnaryKind::Tanh,
        UnaryKind::Sigmoid,
        UnaryKind::Exp,
        UnaryKind::Log,
        UnaryKind::Log1p,
        UnaryKind::Sqrt,
        UnaryKind::Rsqrt,
        UnaryKind::Square,
        UnaryKind::Neg,
        UnaryKind::Abs,
        UnaryKind::Erf,
        UnaryKind::Softplus,
        UnaryKind::Reciprocal,
        UnaryKind::Sign,
        UnaryKind::Identity,
    ];
    let unary_safe = [
        UnaryKind::Relu,
        UnaryKind::Relu6,
        UnaryKind::Gelu { approximate: true },
        UnaryKind::Tanh,
        UnaryKind::Sigmoid,
        UnaryKind::Neg,
        UnaryKind::Abs,
        UnaryKind::Identity,
    ];
    let binary_all = BinaryKind::ALL;
    let binary_safe = [
        BinaryKind::Add,
        BinaryKind::Mul,
        BinaryKind::Maximum,
        BinaryKind::Minimum,
    ];
    let mut last_was_cast = vec![false; 0];
    for step in 0..size {
        let a = pool[pool.len() - 1 - rng.below(pool.len().min(6))];
        let b = rng.pick(&pool);
        let kind = rng.below(match menu {
            Menu::Everything => 14,
            Menu::WellConditioned => 12,
            Menu::Simplifiable => 12 + SIMPLIFIABLE_STEPS,
        });
        let out: Port = match kind {
            0 | 1 => {
                let mm = g
                    .add(
                        MatMul {
                            transpose_a: rng.below(4) == 0,
                            transpose_b: rng.below(4) == 0,
                        },
                        &[a, b],
                    )
                    .unwrap();
                // Chains of products grow 8x per step; keep magnitudes inside f16's range.
                match menu {
                    Menu::Everything => mm,
                    _ => g.add(Unary::new(UnaryKind::Tanh), &[mm]).unwrap(),
                }
            }
            2 | 3 => {
                let k = if menu == Menu::Everything {
                    rng.pick(&unary_all)
                } else {
                    rng.pick(&unary_safe)
                };
                g.add(Unary::new(k), &[a]).unwrap()
            }
            4 | 5 => {
                let k = if menu == Menu::Everything {
                    rng.pick(&binary_all)
                } else {
                    rng.pick(&binary_safe)
                };
                g.add(Binary::new(k), &[a, b]).unwrap()
            }
            6 => {
                let bias = g
                    .add_node(
                        g.fresh_name("bias"),
                        Box::new(Placeholder(TensorType::new(DType::F32, vec![D]))),
                        &[],
                    )
                    .unwrap();
                g.add(
                    BiasAdd {
                        data_format: ampgraph::graph::ops::DataFormat::Nhwc,
                    },
                    &[a, bias.into()],
                )
                .unwrap()
            }
            7 if rng.below(2) == 0 => g.add(Softmax { axis: -1 }, &[a]).unwrap(),
            7 => g.add(LogSoftmax { axis: -1 }, &[a]).unwrap(),
            8 => g.add(Transpose::new([1, 0]), &[a]).unwrap(),
            9 => {
                let flat = g.add(Reshape::new([-1]), &[a]).unwrap();
                g.add(Reshape::new([D as i64, D as i64]), &[flat]).unwrap()
            }
            10 => {
                let kind = if menu == Menu::Everything {
                    rng.pick(&[ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max])
                } else {
                    rng.pick(&[ReduceKind::Mean, ReduceKind::Max])
                };
                let r = g.add(Reduce::new(kind, Some(vec![1]), true), &[a]).unwrap();
                g.add(Binary::new(BinaryKind::Add), &[b, r]).unwrap()
            }
            11 => {
                let cat = g.add(Concat { axis: 1 }, &[a, b]).unwrap();
                let w = g
                    .add_node(
                        g.fresh_name("w"),
                        Box::new(Placeholder(TensorType::new(DType::F32, vec![2 * D, D]))),
                        &[],
                    )
                    .unwrap();
                g.add(
                    MatMul {
                        transpose_a: false,
                        transpose_b: false,
                    },
                    &[cat, w.into()],
                )
                .unwrap()
            }
            k if menu == Menu::Simplifiable && k >= 12 => {
                simplifiable_step(&mut g, &mut rng, k - 12, a, b, &unary_safe)
            }
            12 if !last_was_cast.last().copied().unwrap_or(false) => {
                g.add(Cast { to: DType::F32 }, &[a]).unwrap()
            }
            13 if menu == Menu::Everything && rng.below(2) == 0 => {
                let count = g.scalar(DType::F32, rng.below(1000) as f64).unwrap();
                let dropout = Dropout::new(0.25, rng.below(1 << 30) as u64).unwrap();
                g.add(dropout, &[a, count]).unwrap()
            }
            _ => fresh_input(&mut g, &mut rng),
        };
        last_was_cast.push(kind == 12);
        pool.push(out);
        let _ = step;
    }
    let n_out = 1 + rng.below(3);
    let sinks: Vec<Port> = (0..n_out)
        .map(|i| {
            let src = pool[pool.len() - 1 - i.min(pool.len() - 1)];
            let name = g.fresh_name("output");
            g.add_node(name, Box::new(Unary::new(UnaryKind::Identity)), &[src])
                .unwrap()
                .into()
        })
        .collect();
    g.set_outputs(sinks).unwrap();
    g
}

/// A `[8, 8]`-valued step that a simplification pass rewrites; `kind` below
/// `SIMPLIFIABLE_STEPS`.
fn simplifiable_step(
    g: &mut Graph,
    rng: &mut Rng,
    kind: usize,
    a: Port,
    b: Port,
    unary: &[UnaryKind],
) -> Port {
    let konst = |g: &mut Graph, shape: &[usize], value: &mut dyn FnMut() -> f64| -> Port {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = (0..n).map(|_| value()).collect();
        let t = Tensor::from_f64(DType::F32, shape, &values).unwrap();
        g.add(Const::new(t), &[]).unwrap()
    };
    let add = |g: &mut Graph, op: &dyn Fn() -> Box<dyn ampgraph::graph::Op>, inputs: &[Port]| {
        let name = g.fresh_name(op().name().to_lowercase());
        Port::from(g.add_node(name, op(), inputs).unwrap())
    };
    let binary =
        |k: BinaryKind| move || -> Box<dyn ampgraph::graph::Op> { Box::new(Binary::new(k)) };
    match kind {
        // The same op of the same inputs twice (cse).
        0 => {
            let k = rng.pick(unary);
            let unary_op = move || -> Box<dyn ampgraph::graph::Op> { Box::new(Unary::new(k)) };
            let x1 = add(g, &unary_op, &[a]);
            let x2 = add(g, &unary_op, &[a]);
            let m1 = add(g, &binary(BinaryKind::Mul), &[x1, b]);
            let m2 = add(g, &binary(BinaryKind::Mul), &[x2, b]);
            add(g, &binary(BinaryKind::Add), &[m1, m2])
        }
        // x*1, 1*x, x+0, 0+x, x-0, x/1 with a scalar, row or full constant; Identity,
        // Cast to f32 (algebraic).
        1 => {
            let shape = rng.pick(&[&[][..], &[D][..], &[D, D][..]]);
            let (k, neutral, left) = rng.pick(&[
                (BinaryKind::Mul, 1.0, false),
                (BinaryKind::Mul, 1.0, true),
                (BinaryKind::Add, 0.0, false),
                (BinaryKind::Add, 0.0, true),
                (BinaryKind::Sub, 0.0, false),
                (BinaryKind::Div, 1.0, false),
            ]);
            let c = konst(g, shape, &mut || neutral);
            let x = match rng.below(3) {
                0 => g.add(Unary::new(UnaryKind::Identity), &[a]).unwrap(),
                1 => g.add(Cast { to: DType::F32 }, &[a]).unwrap(),
                _ => a,
            };
            let inputs = if left { [c, x] } else { [x, c] };
            add(g, &binary(k), &inputs)
        }
        // A Transpose of a Transpose (algebraic).
        2 => {
            let t = g.add(Transpose::new([1, 0]), &[a]).unwrap();
            let t = g.add(Transpose::new([1, 0]), &[t]).unwrap();
            g.add(Binary::new(BinaryKind::Maximum), &[t, b]).unwrap()
        }
        // Ops of constants only (const-fold).
        3 => {
            let c1 = konst(g, &[D, D], &mut || rng.unit() - 0.5);
            let c2 = konst(g, &[D], &mut || rng.unit() - 0.5);
            let k = rng.pick(&[BinaryKind::Add, BinaryKind::Mul, BinaryKind::Maximum]);
            let e = add(g, &binary(k), &[c1, c2]);
            let t = g.add(Unary::new(rng.pick(unary)), &[e]).unwrap();
            g.add(Binary::new(BinaryKind::Add), &[a, t]).unwrap()
        }
        // A branch nothing reads (dce).
        4 => {
            let dead = g.add(Unary::new(UnaryKind::Exp), &[a]).unwrap();
            g.add(Binary::new(BinaryKind::Mul), &[dead, b]).unwrap();
            g.add(Binary::new(BinaryKind::Minimum), &[a, b]).unwrap()
        }
        // MatMul by a constant, maybe a constant bias, then an inference BatchNorm
        // (fold-batchnorm).
        5 => {
            let transpose_b = rng.below(2) == 0;
            let w = konst(g, &[D, D], &mut || rng.unit() - 0.5);
            let mut x = g.add(MatMul::new(false, transpose_b), &[a, w]).unwrap();
            if rng.below(2) == 0 {
                let bias = konst(g, &[D], &mut || rng.unit() - 0.5);
                let op = BiasAdd {
                    data_format: DataFormat::Nhwc,
                };
                x = g.add(op, &[x, bias]).unwrap();
            }
            let stats: Vec<Port> = (0..4)
                .map(|i| {
                    konst(g, &[D], &mut || {
                        if i == 1 {
                            rng.unit() - 0.5
                        } else {
                            0.5 + rng.unit()
                        }
                    })
                })
                .collect();
            let bn = BatchNorm {
                epsilon: 1e-3,
                training: false,
                data_format: DataFormat::Nhwc,
                activation: NormActivation::Identity,
                ..BatchNorm::default()
            };
            let y = g
                .add(bn, &[x, stats[0], stats[1], stats[2], stats[3]])
                .unwrap();
            g.add(Unary::new(UnaryKind::Tanh), &[y]).unwrap()
        }
        // Products scaled by a scalar, after or before (scale-into-matmul).
        6 => {
            // Powers of two fold at 16 bits too (exactly); others only at 32 and 64.
            let c = konst(g, &[], &mut || rng.pick(&[0.125, 0.5, 0.3, 1.7]));
            if rng.below(2) == 0 {
                let p = g.add(BatchMatMul::new(false, true), &[a, b]).unwrap();
                g.add(Binary::new(BinaryKind::Mul), &[p, c]).unwrap()
            } else {
                let scaled = g.add(Binary::new(BinaryKind::Mul), &[c, a]).unwrap();
                g.add(BatchMatMul::new(true, false), &[scaled, b]).unwrap()
            }
        }
        // A bias right before a training BatchNorm, which cancels it (fold-batchnorm).
        _ => {
            let bias = konst(g, &[D], &mut || rng.unit() - 0.5);
            let op = BiasAdd {
                data_format: DataFormat::Nhwc,
            };
            let x = g.add(op, &[a, bias]).unwrap();
            let scale = konst(g, &[D], &mut || 0.5 + rng.unit());
            let offset = konst(g, &[D], &mut || rng.unit() - 0.5);
            let bn = BatchNorm {
                epsilon: 0.1,
                training: true,
                data_format: DataFormat::Nhwc,
                activation: NormActivation::Identity,
                ..BatchNorm::default()
            };
            g.add(bn, &[x, scale, offset, offset, scale]).unwrap()
        }
    }
}

/// The graph as JSON: equal renderings are equal graphs.
pub fn json(g: &Graph) -> String {
    to_json(&GraphDef::from_graph(g))
}

/// Seeded values for every Placeholder and Variable of `g`.
pub fn feeds(g: &Graph, seed: u64) -> Feeds {
    g.node_ids()
        .map(|id| g.node(id))
        .filter(|n| n.op.is::<Placeholder>() || n.op.is::<Variable>())
        .map(|n| {
            (
                n.name.clone(),
                seeded_tensor(&n.name, &n.outputs()[0], seed),
            )
        })
        .collect::<HashMap<String, Tensor>>()
}

/// Longest path length (in nodes) of the graph.
pub fn depth(g: &Graph) -> usize {
    let mut d = std::collections::HashMap::new();
    let mut best = 0;
    for id in g.topo_order().unwrap() {
        let here = 1 + g.inputs(id).iter().map(|p| d[&p.node]).max().unwrap_or(0);
        d.insert(id, here);
        best = best.max(here);
    }
    best
}

/// The graph inside an oracle case file.
pub fn oracle_cases() -> Vec<(String, serde_json::Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/oracle/public");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the oracle cases must be at {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
            (p.file_name().unwrap().to_string_lossy().into_owned(), v)
        })
        .collect()
}

/// Parses the `graph` member of an oracle case.
pub fn oracle_graph(case: &serde_json::Value) -> Graph {
    let bytes = serde_json::to_vec(&case["graph"]).unwrap();
    ampgraph::graph::format::graph_from_bytes(&bytes).unwrap()
}

/// Same type and the same bits in every element (any NaN matching any NaN).
pub fn identical(a: &Tensor, b: &Tensor) -> bool {
    a.ty() == b.ty()
        && a.to_f64_vec()
            .iter()
            .zip(b.to_f64_vec())
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// Values agree within `tol` of the output's scale (non-finite values exactly).
pub fn check_close(want: &[Tensor], got: &[Tensor], tol: f64) -> Result<(), TestCaseError> {
    check_close_with_floor(want, got, tol, 0.0)
}

/// [`check_close`], the difference allowed never below `floor`.
pub fn check_close_with_floor(
    want: &[Tensor],
    got: &[Tensor],
    tol: f64,
    floor: f64,
) -> Result<(), TestCaseError> {
    for (w, o) in want.iter().zip(got) {
        prop_assert_eq!(w.ty(), o.ty());
        let (w, o) = (w.to_f64_vec(), o.to_f64_vec());
        let scale = w
            .iter()
            .filter(|x| x.is_finite())
            .fold(1.0f64, |m, x| m.max(x.abs()));
        let allowed = (tol * scale).max(floor);
        for (a, b) in w.iter().zip(&o) {
            if a.is_finite() {
                prop_assert!(
                    (a - b).abs() <= allowed,
                    "{} vs {} (scale {}, allowed {:e})",
                    a,
                    b,
                    scale,
                    allowed
                );
            } else {
                prop_assert!(a == b || (a.is_nan() && b.is_nan()), "{} vs {}", a, b);
            }
        }
    }
    Ok(())
}

/// The largest `|got - want|` over the largest `|want|` (the difference itself where
/// `want` is all zeros).
pub fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let diff = (got.iter().zip(want)).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    if scale == 0.0 {
        diff
    } else {
        diff / scale
    }
}

/// [`relative_error`] of two tensors' values.
pub fn tensor_relative_error(got: &Tensor, want: &Tensor) -> f64 {
    relative_error(&got.to_f64_vec(), &want.to_f64_vec())
}

/// The largest finite magnitude among the float values `g`'s outputs depend on, fed
/// `feeds` on the CPU, at least 1: the scale of the roundoff an output can carry, since
/// a sum that cancels to a small output keeps the error of its large terms.
pub fn largest_value(g: &Graph, feeds: &Feeds) -> f64 {
    let needed = g.needed_by(g.outputs());
    let fetches: Vec<Port> = g
        .node_ids()
        .filter(|id| needed[id.index()])
        .flat_map(|id| (0..g.node(id).outputs().len()).map(move |k| Port::new(id, k)))
        .filter(|&p| g.ty(p).dtype.is_float())
        .collect();
    CpuExecutor::new()
        .run(g, feeds, &fetches)
        .unwrap()
        .iter()
        .flat_map(|t| t.to_f64_vec())
        .filter(|v| v.is_finite())
        .fold(1.0, |m, v| m.max(v.abs()))
}

/// One unit in the last place at `x` of the 16-bit type `dtype`.
pub fn ulp(x: f64, dtype: DType) -> f64 {
    let (fraction_bits, min_exponent) = if dtype == DType::BF16 {
        (7, -126)
    } else {
        (10, -14)
    };
    let exponent = if x == 0.0 {
        min_exponent
    } else {
        x.log2().floor() as i32
    };
    2f64.powi(exponent.max(min_exponent) - fraction_bits)
}

/// x[8,4] -> dense 16 tanh -> dense 3 -> cross-entropy, trained by AMP SGD with
/// momentum: f32 weights and slots, f32 and i64 loss-scale state, casts.
pub fn small_training_graph() -> Graph {
    use ampgraph::graph::nn::{self, Activation};
    use ampgraph::optim::{enable_mixed_precision_graph_rewrite, Optimizer, Sgd};
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [8, 4]).unwrap();
    let labels = g.placeholder("labels", DType::I64, [8]).unwrap();
    let h = nn::dense(&mut g, x, 16, Some(Activation::Tanh)).unwrap();
    let logits = nn::dense(&mut g, h, 3, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    g.set_outputs(vec![logits]).unwrap();
    enable_mixed_precision_graph_rewrite(Sgd::momentum(0.1, 0.9))
        .minimize(&mut g, loss)
        .unwrap();
    g
}

/// The example `name` cargo built beside this test (`target/<profile>/examples/`):
/// `cargo test` builds every example before it runs the tests.
pub fn example_binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("tests run from target/<profile>/deps");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds it, `cargo test --test ...` alone does not \
         (`cargo build --example {name}` first)",
        path.display()
    );
    path
}

/// The graph after AMP (f16) and the CUDA executor's passes (run on the CPU: the
/// graph the GPU would run).
pub fn amp_and_cuda_passes(g: &mut Graph) {
    use ampgraph::passes::amp::{AmpConfig, AutoMixedPrecision};
    AutoMixedPrecision::new(AmpConfig::new(DType::F16).unwrap())
        .rewrite(g)
        .unwrap();
    cuda_passes(g);
}

/// The graph after the CUDA executor's passes (an AMP graph: they run after AMP).
pub fn cuda_passes(g: &mut Graph) {
    let mut passes = ampgraph::passes::PassManager::new();
    for pass in ampgraph::exec::cuda::pipeline(&Default::default()) {
        passes.push(pass);
    }
    passes.run(g).unwrap();
}

/// How many nodes of `g` run `op`.
pub fn count(g: &Graph, op: &str) -> usize {
    g.node_ids()
        .filter(|&id| g.node(id).op_name() == op)
        .count()
}

/// The MNIST acceptance runs, shortened for the CPU: an MLP of `hidden` GELU layers
/// (784 in, 10 out) built by `minimize` into a training step, run by a session with
/// `options`, trained `epochs` epochs on the first 4000 real images (batches of 100,
/// shuffled) and evaluated on the last 1000: the accuracy in percent, and the graph
/// the session ran.
pub fn mnist_mlp_accuracy(
    hidden: &[usize],
    epochs: usize,
    minimize: impl FnOnce(&mut Graph, Port) -> ampgraph::optim::TrainStep,
    options: ampgraph::SessionOptions,
) -> (f64, Graph) {
    use ampgraph::data::{Dataset, Loader, LoaderOptions, Mnist};
    use ampgraph::graph::nn::{self, Activation};
    use ampgraph::train::{Position, TrainOptions, Trainer};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/mnist");
    let all = Mnist::load(&dir).unwrap();
    let loader = |set: Mnist, shuffle: bool| {
        let options = LoaderOptions {
            batch_size: 100,
            shuffle,
            drop_last: shuffle,
            ..LoaderOptions::default()
        };
        Loader::new(std::sync::Arc::new(set), options).unwrap()
    };
    let train = loader(all.slice(0, 4000), true);
    let eval = loader(all.slice(all.len() - 1000, all.len()), false);
    let mut g = Graph::new();
    let images = g
        .placeholder("images", DType::F32, [100, 1, 28, 28])
        .unwrap();
    let labels = g.placeholder("labels", DType::I64, [100]).unwrap();
    let mut h = g.reshape(images, [100, 784]).unwrap();
    for &width in hidden {
        h = nn::dense(&mut g, h, width, Some(Activation::Gelu)).unwrap();
    }
    let logits = nn::dense(&mut g, h, 10, None).unwrap();
    let loss = g.softmax_cross_entropy(logits, labels).unwrap();
    let step = minimize(&mut g, loss);
    let mut s = ampgraph::Session::with_options(g, ampgraph::Device::Cpu, options).unwrap();
    let ran = s.graph().clone();
    let mut trainer = Trainer::new(&mut s, step, images, labels, TrainOptions::default()).unwrap();
    let mut at = Position::START;
    while at.epoch <= epochs {
        at = trainer.epoch(&train, at).unwrap().next;
    }
    let accuracy = ampgraph::train::evaluate(&mut s, logits, images, &eval)
        .unwrap()
        .accuracy;
    (100.0 * accuracy, ran)
}

/// Five steps of the session `session(passes)` makes, once without passes and once
/// with the simplification and CUDA pipelines, fed `feeds(step, poison)` (the third
/// step poisoned with an infinity): asserts that every fetch is the same bits (a
/// poisoned step's NaNs alike) and returns both sessions and the second's fetches.
pub fn assert_same_bits_through_the_pipelines(
    session: impl Fn(&[&str]) -> (ampgraph::Session, Vec<Port>),
    feeds: impl Fn(u64, Option<f32>) -> Feeds,
    what: &str,
) -> (ampgraph::Session, ampgraph::Session, Vec<Port>) {
    use ampgraph::exec::cuda::pipeline_names;
    use ampgraph::passes::registry::SIMPLIFY_PIPELINE;
    let (mut plain, plain_fetch) = session(&[]);
    let pipeline = [SIMPLIFY_PIPELINE, &pipeline_names(&Default::default())].concat();
    let (mut fused, fused_fetch) = session(&pipeline);
    for k in 0..5 {
        let poison = (k == 2).then_some(f32::INFINITY);
        let want = plain.run(&plain_fetch, &feeds(k, poison)).unwrap();
        let got = fused.run(&fused_fetch, &feeds(k, poison)).unwrap();
        let same = want.len() == got.len() && want.iter().zip(&got).all(|(w, g)| identical(w, g));
        assert!(same, "step {k}, {what}: {want:?} against {got:?}");
    }
    (plain, fused, fused_fetch)
}

/// A directory of its own under the system's temp dir for one test (`name` and the
/// process id; tests run in parallel in one process), emptied when made and removed
/// with everything in it when dropped, a failing test's too. It derefs to its path.
pub struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    pub fn new(name: &str) -> ScratchDir {
        let dir = std::env::temp_dir().join(format!("ampgraph-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        ScratchDir(dir)
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for ScratchDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
