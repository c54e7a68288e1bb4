//! Shared by the integration tests: a random graph generator and helpers.
#![allow(dead_code)] // each test binary uses a different part of this module

use ampgraph::graph::ops::{
    BiasAdd, Binary, BinaryKind, Cast, Concat, Const, LogSoftmax, MatMul, Placeholder, Reduce,
    ReduceKind, Reshape, Softmax, Transpose, Unary, UnaryKind, Variable,
};
use ampgraph::graph::{DType, Graph, Port, Tensor, TensorType};

/// SplitMix64, for reproducible graphs from a proptest-chosen seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
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

/// Which ops the generator may use.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Menu {
    /// Every op family, numerically anything goes (for structural properties).
    Everything,
    /// Only ops whose f16 error stays proportional to the value scale (for numerics).
    WellConditioned,
}

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
        let kind = rng.below(if menu == Menu::Everything { 14 } else { 12 });
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
                    Menu::WellConditioned => g.add(Unary::new(UnaryKind::Tanh), &[mm]).unwrap(),
                    Menu::Everything => mm,
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
                let r = g
                    .add(
                        Reduce {
                            kind,
                            axes: Some(vec![1]),
                            keep_dims: true,
                        },
                        &[a],
                    )
                    .unwrap();
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
            12 if !last_was_cast.last().copied().unwrap_or(false) => {
                g.add(Cast { to: DType::F32 }, &[a]).unwrap()
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
