//! Property tests of ONNX export and import: a random graph of ops that ONNX writes
//! one for one comes back from export -> import as the same graph (names, ops with
//! their attributes, edges, outputs) computing the same values bit for bit; any
//! random graph, with ops ONNX writes as several (Gelu, Log1p, Rsqrt, ...), comes
//! back computing the same values up to the rounding between the ops it became.

mod common;

use ampgraph::graph::ops::{
    Binary, BinaryKind, Cast, Compare, CompareKind, Concat, Const, Gather, LogSoftmax, MatMul, Pad,
    PadMode, Placeholder, Reduce, ReduceKind, Reshape, Slice, Softmax, Transpose, Unary, UnaryKind,
    Where,
};
use ampgraph::graph::{DType, Graph, Port, Tensor, TensorType};
use ampgraph::onnx::{export, import_model, ExportOptions, ImportOptions};
use ampgraph::{Device, Session};
use common::{random_graph, Menu, Rng};
use proptest::prelude::*;

const ROWS: usize = 4;
const COLS: usize = 6;

/// A random f32 graph over [4, 6] tensors of ops with one ONNX form each (not
/// Identity: import drops ONNX's Identity nodes, the exporters' no-ops). Every op
/// reads at least one placeholder-derived value (import computes constant-only
/// nodes), and the outputs are distinct op nodes.
fn one_for_one_graph(seed: u64, size: usize) -> Graph {
    let mut rng = Rng(seed);
    let mut g = Graph::new();
    let ty = TensorType::new(DType::F32, vec![ROWS, COLS]);
    let mut live: Vec<Port> = (0..2)
        .map(|i| {
            g.add_node(format!("x{i}"), Box::new(Placeholder(ty.clone())), &[])
                .unwrap()
                .into()
        })
        .collect();
    let constant = |g: &mut Graph, rng: &mut Rng| -> Port {
        let values: Vec<f64> = (0..ROWS * COLS).map(|_| (rng.unit() - 0.5) * 4.0).collect();
        let t = Tensor::from_f64(DType::F32, vec![ROWS, COLS], &values).unwrap();
        g.add(Const::new(t), &[]).unwrap()
    };
    let unary = [
        UnaryKind::Relu,
        UnaryKind::Relu6,
        UnaryKind::Elu,
        UnaryKind::Selu,
        UnaryKind::LeakyRelu { alpha: 0.25 },
        UnaryKind::Tanh,
        UnaryKind::Sigmoid,
        UnaryKind::HardSigmoid,
        UnaryKind::HardSwish,
        UnaryKind::Exp,
        UnaryKind::Log,
        UnaryKind::Sqrt,
        UnaryKind::Neg,
        UnaryKind::Abs,
        UnaryKind::Erf,
        UnaryKind::Softplus,
        UnaryKind::Reciprocal,
        UnaryKind::Sign,
    ];
    let binary = [
        BinaryKind::Add,
        BinaryKind::Sub,
        BinaryKind::Mul,
        BinaryKind::Div,
        BinaryKind::Maximum,
        BinaryKind::Minimum,
        BinaryKind::Pow,
    ];
    let mut outputs = Vec::new();
    for _ in 0..size {
        let a = live[live.len() - 1 - rng.below(live.len().min(4))];
        let b = if rng.below(3) == 0 {
            constant(&mut g, &mut rng)
        } else {
            live[rng.below(live.len())]
        };
        let y = match rng.below(13) {
            0 | 1 => g.add(Unary::new(rng.pick(&unary)), &[a]).unwrap(),
            2 | 3 => g.add(Binary::new(rng.pick(&binary)), &[a, b]).unwrap(),
            4 => {
                // [4, 6] x [6, 4] with either operand transposed, back to [4, 6].
                let (ta, tb) = (rng.below(2) == 0, rng.below(2) == 0);
                // A Transpose of a constant would be computed at import.
                let b = live[rng.below(live.len())];
                let a2 = if ta {
                    g.add(Transpose::new([1, 0]), &[a]).unwrap()
                } else {
                    a
                };
                let b2 = if tb {
                    b
                } else {
                    g.add(Transpose::new([1, 0]), &[b]).unwrap()
                };
                let p = g.add(MatMul::new(ta, tb), &[a2, b2]).unwrap();
                let w = g.add(MatMul::new(false, false), &[p, a]).unwrap();
                g.add(Slice::new([0, 0], [ROWS as i64, COLS as i64]), &[w])
                    .unwrap_or(w)
            }
            5 if rng.below(2) == 0 => g.add(Softmax { axis: -1 }, &[a]).unwrap(),
            5 => g
                .add(
                    LogSoftmax {
                        axis: rng.pick(&[0, 1]),
                    },
                    &[a],
                )
                .unwrap(),
            6 => {
                let flat = g.add(Reshape::new([-1]), &[a]).unwrap();
                g.add(Reshape::new([ROWS as i64, COLS as i64]), &[flat])
                    .unwrap()
            }
            7 => {
                let kind = rng.pick(&[ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max]);
                let axes = rng.pick(&[Some(1), Some(0), None]).map(|a| vec![a]);
                let keep = axes.is_some();
                let r = g.add(Reduce::new(kind, axes, keep), &[a]).unwrap();
                g.add(Binary::new(BinaryKind::Add), &[a, r]).unwrap()
            }
            8 => {
                let cat = g.add(Concat::new(1), &[a, b]).unwrap();
                g.add(
                    Slice::new([0, rng.below(COLS)], [ROWS as i64, COLS as i64]),
                    &[cat],
                )
                .unwrap()
            }
            9 => {
                let kind = rng.pick(&CompareKind::ALL);
                let c = g.add(Compare::new(kind), &[a, b]).unwrap();
                g.add(Where, &[c, a, b]).unwrap()
            }
            10 => {
                // A repeated index: import turns runs of neighbours into Slices.
                let mut idx: Vec<i64> = (0..COLS).map(|_| rng.below(COLS) as i64 - 3).collect();
                idx[1] = idx[0];
                let idx = g
                    .add(
                        Const::new(
                            Tensor::new(vec![COLS], ampgraph::graph::Data::I64(idx)).unwrap(),
                        ),
                        &[],
                    )
                    .unwrap();
                g.add(Gather::new(1), &[a, idx]).unwrap()
            }
            11 => {
                let p = g
                    .add(Pad::new(vec![[1, 0], [0, 2]], PadMode::Constant(0.5)), &[a])
                    .unwrap();
                g.add(Slice::new([1, 2], [ROWS as i64, COLS as i64]), &[p])
                    .unwrap()
            }
            _ => {
                let half = g.add(Cast { to: DType::F16 }, &[a]).unwrap();
                g.add(Cast { to: DType::F32 }, &[half]).unwrap()
            }
        };
        live.push(y);
        if rng.below(4) == 0 {
            outputs.push(y);
        }
    }
    let last = *live.last().unwrap();
    if !outputs.contains(&last) {
        outputs.push(last);
    }
    outputs.retain(|p| g.node(p.node).op.arity() != ampgraph::graph::Arity::Exactly(0));
    g.set_outputs(outputs.clone()).unwrap();
    // Export writes a constant only where something reads it.
    g.prune(&outputs).unwrap();
    g
}

fn round_trip(g: &Graph) -> Graph {
    let model = export(g, &ExportOptions::default()).unwrap();
    // As written: the import-time rewrites (GELU recognised, biases and transposes
    // moved into the products) would change the graph the round trip gives back.
    let opts = ImportOptions {
        as_written: true,
        ..ImportOptions::default()
    };
    import_model(&model, None, &opts).unwrap()
}

/// The same graph: every node by name with an equal op and the same inputs, and the
/// same outputs.
fn same_graph(a: &Graph, b: &Graph) -> Result<(), TestCaseError> {
    let names = |g: &Graph| {
        let mut v: Vec<String> = g.node_ids().map(|id| g.node(id).name.clone()).collect();
        v.sort();
        v
    };
    prop_assert_eq!(names(a), names(b));
    for id in a.node_ids() {
        let na = a.node(id);
        let nb = b.node(b.require(&na.name).unwrap());
        prop_assert!(*na.op == *nb.op, "{}: {:?} vs {:?}", na.name, na.op, nb.op);
        let ins = |g: &Graph, id| {
            g.inputs(id)
                .iter()
                .map(|&p| g.port_name(p))
                .collect::<Vec<_>>()
        };
        prop_assert_eq!(
            ins(a, id),
            ins(b, b.require(&na.name).unwrap()),
            "{}",
            na.name
        );
        prop_assert_eq!(na.outputs(), nb.outputs(), "{}", na.name);
    }
    let outs = |g: &Graph| {
        g.outputs()
            .iter()
            .map(|&p| g.port_name(p))
            .collect::<Vec<_>>()
    };
    prop_assert_eq!(outs(a), outs(b));
    Ok(())
}

/// Runs both graphs on the CPU on the same feeds: the outputs are bit-identical, or
/// with `tol`, within it of each output's scale.
fn same_values(a: Graph, b: Graph, seed: u64, tol: Option<f64>) -> Result<(), TestCaseError> {
    let feeds = common::feeds(&a, seed);
    let run = |g: Graph| {
        let fetches = g.outputs().to_vec();
        Session::new(g, Device::Cpu)
            .unwrap()
            .run(&fetches, &feeds)
            .unwrap()
    };
    let (ya, yb) = (run(a), run(b));
    prop_assert_eq!(ya.len(), yb.len());
    if let Some(tol) = tol {
        return common::check_close(&ya, &yb, tol);
    }
    for (k, (x, y)) in ya.iter().zip(&yb).enumerate() {
        prop_assert!(common::identical(x, y), "output {}: {:?} vs {:?}", k, x, y);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn one_for_one_graphs_come_back_the_same(seed in any::<u64>(), size in 1usize..30) {
        let g = one_for_one_graph(seed, size);
        let back = round_trip(&g);
        same_graph(&g, &back)?;
        same_values(g, back, seed, None)?;
    }

    #[test]
    fn any_graph_comes_back_computing_the_same_values(seed in any::<u64>(), size in 1usize..30) {
        let g = random_graph(seed, size, Menu::WellConditioned);
        let back = round_trip(&g);
        // f32 rounding between the ops a decomposition makes: a few ulps of 2^-24
        // of the largest value computed, which cancellation may leave in an output
        // much smaller than it (|m| * m summed, then offset).
        let tol = 1e-6 * common::largest_value(&g, &common::feeds(&g, seed));
        same_values(g, back, seed, Some(tol))?;
    }
}

/// An inference BatchNorm with a side input (the residual `fuse-batchnorm-activation`
/// folds in), with and without its ReLU, NHWC and `[N, C]`, exports as
/// BatchNormalization, Add (and Relu) and computes the same values.
#[test]
fn a_batch_norm_with_a_side_input_exports_as_its_add() {
    use ampgraph::graph::ops::{BatchNorm, DataFormat, NormActivation};
    for shape in [vec![2, 3, 3, 4], vec![5, 4]] {
        for activation in [NormActivation::Identity, NormActivation::Relu] {
            let mut g = Graph::new();
            let ty = TensorType::new(DType::F32, shape.clone());
            let x = g.add(Placeholder(ty.clone()), &[]).unwrap();
            let side = g.add(Placeholder(ty), &[]).unwrap();
            let stats: Vec<Port> = [
                [1.5, 0.5, 2.0, 1.0],
                [0.1, -0.2, 0.3, 0.0],
                [0.2, 0.0, -0.1, 0.3],
                [1.0, 0.5, 2.0, 0.7],
            ]
            .iter()
            .map(|v| {
                g.add(
                    Const::new(Tensor::from_f64(DType::F32, vec![4], v).unwrap()),
                    &[],
                )
                .unwrap()
            })
            .collect();
            let bn = BatchNorm {
                epsilon: 1e-3,
                training: false,
                data_format: DataFormat::Nhwc,
                activation,
                ..BatchNorm::default()
            };
            let mut inputs = vec![x];
            inputs.extend(&stats);
            inputs.push(side);
            let y = g.add(bn, &inputs).unwrap();
            g.set_outputs(vec![y]).unwrap();
            let back = round_trip(&g);
            assert!(
                back.node_ids().any(|id| back.node(id).op_name() == "Add"),
                "{shape:?} {activation:?}"
            );
            same_values(g, back, 7, Some(1e-6)).unwrap();
        }
    }
}
