//! Import details checked on models built here: constants computed at import (each
//! convolution's filter, transposed to HWIO) stay each convolution's own.

use ampgraph_graph::ops::Conv2D;
use ampgraph_onnx::proto::{
    attribute_type, AttributeProto, Dimension, DimensionValue, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto, TypeProtoTensor, ValueInfoProto,
};
use ampgraph_onnx::{import_model, ImportOptions};

fn input(name: &str, shape: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: 1,
                shape: Some(TensorShapeProto {
                    dim: shape
                        .iter()
                        .map(|&d| Dimension {
                            value: Some(DimensionValue::DimValue(d)),
                        })
                        .collect(),
                }),
            }),
        }),
    }
}

/// An f32 value of no declared shape.
fn unshaped(name: &str) -> ValueInfoProto {
    let mut v = input(name, &[]);
    if let Some(tt) = v.r#type.as_mut().and_then(|t| t.tensor_type.as_mut()) {
        tt.shape = None;
    }
    v
}

/// `v` holding int64 values.
fn int64(mut v: ValueInfoProto) -> ValueInfoProto {
    if let Some(t) = v.r#type.as_mut().and_then(|t| t.tensor_type.as_mut()) {
        t.elem_type = 7;
    }
    v
}

/// A reduction `op` over axis 1 (axes as an attribute), not keeping it.
fn reduce_axis_1(name: &str, op: &str) -> NodeProto {
    let axes = AttributeProto {
        name: "axes".into(),
        r#type: attribute_type::INTS,
        ints: vec![1],
        ..AttributeProto::default()
    };
    node(name, op, &["x"], vec![axes, int_attr("keepdims", 0)])
}

/// A model of `graph` at default-domain `opset`.
fn model_of(graph: GraphProto, opset: i64) -> ModelProto {
    ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: opset,
        }],
        graph: Some(graph),
        ..ModelProto::default()
    }
}

/// An int attribute.
fn int_attr(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INT,
        i,
        ..AttributeProto::default()
    }
}

/// An int64 initializer of `dims` holding `values`.
fn int64s(name: &str, dims: Vec<i64>, values: Vec<i64>) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims,
        data_type: 7,
        int64_data: values,
        ..TensorProto::default()
    }
}

/// An f32 initializer of `dims` holding `values`.
fn float32s(name: &str, dims: Vec<i64>, values: Vec<f32>) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims,
        data_type: 1,
        float_data: values,
        ..TensorProto::default()
    }
}

/// `err` is one line naming node `node` and saying `says`.
fn assert_one_line_naming(err: &str, node: &str, says: &str) {
    assert!(err.contains(&format!("'{node}'")), "{err}");
    assert!(err.contains(says), "{says}: {err}");
    assert!(!err.contains('\n'), "one line: {err}");
}

/// A node whose one output is named as the node.
fn node(name: &str, op: &str, inputs: &[&str], attribute: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        name: name.into(),
        op_type: op.into(),
        input: inputs.iter().map(|&i| i.into()).collect(),
        output: vec![name.into()],
        attribute,
        ..NodeProto::default()
    }
}

#[test]
fn many_filters_of_one_shape_each_stay_their_own() {
    const CONVS: usize = 48;
    let mut graph = GraphProto {
        input: vec![input("x", &[1, 4, 5, 5])],
        ..GraphProto::default()
    };
    let mut prev = "x".to_string();
    for i in 0..CONVS {
        let w = format!("w{i}");
        graph.initializer.push(TensorProto {
            name: w.clone(),
            dims: vec![4, 4, 3, 3],
            data_type: 1,
            float_data: (0..144).map(|k| (i * 1000 + k) as f32).collect(),
            ..TensorProto::default()
        });
        let out = format!("y{i}");
        graph.node.push(NodeProto {
            name: format!("conv{i}"),
            op_type: "Conv".into(),
            input: vec![prev.clone(), w],
            output: vec![out.clone()],
            attribute: vec![AttributeProto {
                name: "pads".into(),
                r#type: attribute_type::INTS,
                ints: vec![1, 1, 1, 1],
                ..AttributeProto::default()
            }],
            ..NodeProto::default()
        });
        prev = out;
    }
    graph.output.push(input(&prev, &[1, 4, 5, 5]));
    let model = model_of(graph, 17);
    let g = import_model(&model, None, &ImportOptions::default()).unwrap();
    for i in 0..CONVS {
        let id = g
            .require(&format!("conv{i}"))
            .unwrap_or_else(|_| g.require(&format!("y{i}")).unwrap());
        assert!(g.node(id).op.is::<Conv2D>(), "conv{i}");
        let filter = g.inputs(id)[1];
        let value = g.node(filter.node).op.eval(&[]).unwrap().remove(0);
        assert_eq!(value.shape(), [3, 3, 4, 4]);
        // HWIO [r][s][c][k] = OIHW [k][c][r][s] = i * 1000 + ((k * 4 + c) * 3 + r) * 3 + s.
        let v = value.to_f64_vec();
        for (r, s, c, k) in [(0, 0, 0, 0), (2, 1, 3, 2), (1, 2, 0, 3)] {
            let want = (i * 1000 + ((k * 4 + c) * 3 + r) * 3 + s) as f64;
            assert_eq!(
                v[((r * 3 + s) * 4 + c) * 4 + k],
                want,
                "conv{i} filter at {r},{s},{c},{k}"
            );
        }
    }
}

/// Runs `g` with its ops' CPU kernels, one node after another.
fn evaluate(
    g: &ampgraph_graph::Graph,
    feeds: &[(&str, ampgraph_graph::Tensor)],
) -> Vec<ampgraph_graph::Tensor> {
    use std::collections::HashMap;
    let mut values: HashMap<ampgraph_graph::Port, ampgraph_graph::Tensor> = HashMap::new();
    for id in g.topo_order().unwrap() {
        let node = g.node(id);
        let outs = match feeds.iter().find(|(n, _)| *n == node.name) {
            Some((_, t)) => vec![t.clone()],
            None => {
                let ins: Vec<&ampgraph_graph::Tensor> =
                    g.inputs(id).iter().map(|p| &values[p]).collect();
                node.op.eval(&ins).unwrap()
            }
        };
        for (k, t) in outs.into_iter().enumerate() {
            values.insert(ampgraph_graph::Port::new(id, k), t);
        }
    }
    g.outputs().iter().map(|p| values[p].clone()).collect()
}

#[test]
fn gathers_of_neighbouring_constant_indices_are_slices() {
    // x [3, 2, 4]; Gather(x, 1) on axis 0 -> [2, 4]; Gather(x, [-1]) on axis 2 -> [3, 2, 1];
    // Gather(x, [2, 0]) on axis 2 stays a Gather.
    let gather = |name: &str, idx: &str, axis: i64| {
        node(name, "Gather", &["x", idx], vec![int_attr("axis", axis)])
    };
    let graph = GraphProto {
        input: vec![input("x", &[3, 2, 4])],
        initializer: vec![
            int64s("one", vec![], vec![1]),
            int64s("last", vec![1], vec![-1]),
            int64s("apart", vec![2], vec![2, 0]),
        ],
        node: vec![
            gather("row", "one", 0),
            gather("col", "last", 2),
            gather("pick", "apart", 2),
        ],
        output: vec![
            input("row", &[2, 4]),
            input("col", &[3, 2, 1]),
            input("pick", &[3, 2, 2]),
        ],
        ..GraphProto::default()
    };
    let model = model_of(graph, 13);
    let g = import_model(&model, None, &ImportOptions::default()).unwrap();
    let ops: Vec<&str> = g.node_ids().map(|id| g.node(id).op.name()).collect();
    assert_eq!(ops.iter().filter(|&&o| o == "Gather").count(), 1, "{ops:?}");
    assert_eq!(ops.iter().filter(|&&o| o == "Slice").count(), 2, "{ops:?}");
    let x: Vec<f64> = (0..24).map(f64::from).collect();
    let x =
        ampgraph_graph::Tensor::from_f64(ampgraph_graph::DType::F32, vec![3, 2, 4], &x).unwrap();
    let out = evaluate(&g, &[("x", x)]);
    assert_eq!(out[0].shape(), [2, 4]);
    assert_eq!(
        out[0].to_f64_vec(),
        (8..16).map(f64::from).collect::<Vec<_>>()
    );
    assert_eq!(out[1].shape(), [3, 2, 1]);
    assert_eq!(out[1].to_f64_vec(), [3.0, 7.0, 11.0, 15.0, 19.0, 23.0]);
    assert_eq!(out[2].shape(), [3, 2, 2]);
    assert_eq!(out[2].to_f64_vec()[..4], [2.0, 0.0, 6.0, 4.0]);
}

/// A float CumSum is computed at import only: one of a run-time value is refused with
/// the node's name and the input that is not a constant.
#[test]
fn import_time_ops_on_run_time_values_are_one_clear_error() {
    let axis = TensorProto {
        name: "axis".into(),
        dims: vec![],
        data_type: 7,
        int64_data: vec![1],
        ..TensorProto::default()
    };
    let graph = GraphProto {
        input: vec![input("x", &[2, 3])],
        initializer: vec![axis],
        node: vec![NodeProto {
            name: "running".into(),
            op_type: "CumSum".into(),
            input: vec!["x".into(), "axis".into()],
            output: vec!["y".into()],
            ..NodeProto::default()
        }],
        output: vec![input("y", &[2, 3])],
        ..GraphProto::default()
    };
    let model = model_of(graph, 17);
    let err = import_model(&model, None, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert_one_line_naming(
        &err,
        "running",
        "CumSum of f32 values computed at run time is not imported",
    );
}

/// Run-time values through the ops exporters use on buffers: GatherElements of a
/// run-time x at constant indices (negative ones count from the end), and an integer
/// CumSum (inclusive, and exclusive from the end) of a run-time integer input, against
/// hand-computed values.
#[test]
fn gather_elements_and_integer_cumsum_take_run_time_values() {
    use ampgraph_graph::{DType, Tensor};
    // A value of ONNX element type `elem` (1 f32, 7 i64).
    let typed = |name: &str, shape: &[i64], elem: i32| {
        let mut v = input(name, shape);
        if let Some(tt) = v.r#type.as_mut().and_then(|t| t.tensor_type.as_mut()) {
            tt.elem_type = elem;
        }
        v
    };
    let graph = GraphProto {
        input: vec![input("x", &[2, 3]), typed("n", &[2, 4], 7)],
        initializer: vec![
            int64s("idx", vec![2, 3], vec![2, 0, -1, 1, -3, 1]),
            int64s("axis", vec![], vec![1]),
        ],
        node: vec![
            node(
                "pick",
                "GatherElements",
                &["x", "idx"],
                vec![int_attr("axis", 1)],
            ),
            node("sums", "CumSum", &["n", "axis"], vec![]),
            node(
                "after",
                "CumSum",
                &["n", "axis"],
                vec![int_attr("exclusive", 1), int_attr("reverse", 1)],
            ),
        ],
        output: vec![
            typed("pick", &[2, 3], 1),
            typed("sums", &[2, 4], 7),
            typed("after", &[2, 4], 7),
        ],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 17), None, &ImportOptions::default()).unwrap();
    let x = Tensor::from_f64(
        DType::F32,
        vec![2, 3],
        &[10.0, 11.0, 12.0, 20.0, 21.0, 22.0],
    )
    .unwrap();
    let n = Tensor::from_f64(
        DType::I64,
        vec![2, 4],
        &[1.0, 2.0, 3.0, 4.0, 0.0, -5.0, 7.0, 1.0],
    )
    .unwrap();
    let got = evaluate(&g, &[("x", x), ("n", n)]);
    assert_eq!(got[0].to_f64_vec(), [12.0, 10.0, 12.0, 21.0, 20.0, 21.0]);
    assert_eq!(got[1].dtype(), DType::I64);
    assert_eq!(
        got[1].to_f64_vec(),
        [1.0, 3.0, 6.0, 10.0, 0.0, -5.0, 2.0, 3.0]
    );
    assert_eq!(
        got[2].to_f64_vec(),
        [9.0, 7.0, 4.0, 0.0, 3.0, 8.0, 1.0, 0.0]
    );
}

/// GatherND of a run-time x at constant index vectors (negative ones from the end),
/// and Tile of a run-time x, against hand-computed values.
#[test]
fn gather_nd_and_tile_take_run_time_values() {
    use ampgraph_graph::{DType, Tensor};
    let graph = GraphProto {
        input: vec![input("x", &[2, 3, 2])],
        initializer: vec![
            // Two index vectors of the first two axes: (1, 2) and (0, -1).
            int64s("at", vec![2, 2], vec![1, 2, 0, -1]),
            int64s("repeats", vec![3], vec![2, 1, 1]),
            int64s("inner", vec![3], vec![1, 2, 1]),
        ],
        node: vec![
            node("picked", "GatherND", &["x", "at"], vec![]),
            node("tiled", "Tile", &["x", "repeats"], vec![]),
            node("rows", "Tile", &["x", "inner"], vec![]),
        ],
        output: vec![
            input("picked", &[2, 2]),
            input("tiled", &[4, 3, 2]),
            input("rows", &[2, 6, 2]),
        ],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 17), None, &ImportOptions::default()).unwrap();
    let values: Vec<f64> = (0..12).map(f64::from).collect();
    let x = Tensor::from_f64(DType::F32, vec![2, 3, 2], &values).unwrap();
    let got = evaluate(&g, &[("x", x)]);
    // x[1, 2, :] = [10, 11]; x[0, 2, :] = [4, 5].
    assert_eq!(got[0].to_f64_vec(), [10.0, 11.0, 4.0, 5.0]);
    assert_eq!(got[1].shape(), [4, 3, 2]);
    let twice: Vec<f64> = values.iter().chain(&values).copied().collect();
    assert_eq!(got[1].to_f64_vec(), twice);
    // Each x[i] (3 rows of 2) twice over, one after the other.
    let rows: Vec<f64> = (0..2)
        .flat_map(|i| {
            let block = &values[6 * i..6 * i + 6];
            block.iter().chain(block).copied().collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(got[2].to_f64_vec(), rows);
}

/// InstanceNormalization against a float64 reference: each (n, c) row normalised
/// over its spatial values, then scaled and shifted per channel.
#[test]
fn instance_normalization_matches_a_float64_reference() {
    use ampgraph_graph::{DType, Tensor};
    let floats = |name: &str, v: Vec<f32>| TensorProto {
        name: name.into(),
        dims: vec![v.len() as i64],
        data_type: 1,
        float_data: v,
        ..TensorProto::default()
    };
    let graph = GraphProto {
        input: vec![input("x", &[2, 2, 3])],
        initializer: vec![
            floats("scale", vec![2.0, -0.5]),
            floats("b", vec![0.25, 1.0]),
        ],
        node: vec![NodeProto {
            name: "norm".into(),
            op_type: "InstanceNormalization".into(),
            input: vec!["x".into(), "scale".into(), "b".into()],
            output: vec!["y".into()],
            attribute: vec![AttributeProto {
                name: "epsilon".into(),
                r#type: attribute_type::FLOAT,
                f: 1e-3,
                ..AttributeProto::default()
            }],
            ..NodeProto::default()
        }],
        output: vec![input("y", &[2, 2, 3])],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 17), None, &ImportOptions::default()).unwrap();
    let x = [1.0, 2.0, 4.0, -3.0, 0.5, 0.0, 7.0, 7.5, 6.0, 0.1, -0.2, 0.3];
    let got = evaluate(
        &g,
        &[(
            "x",
            Tensor::from_f64(DType::F32, vec![2, 2, 3], &x).unwrap(),
        )],
    );
    let (scale, b) = ([2.0, -0.5], [0.25, 1.0]);
    let want: Vec<f64> = x
        .chunks(3)
        .enumerate()
        .flat_map(|(row, v)| {
            let mean = v.iter().sum::<f64>() / 3.0;
            let var = v.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / 3.0;
            let c = row % 2;
            v.iter()
                .map(move |a| (a - mean) / (var + 1e-3f32 as f64).sqrt() * scale[c] + b[c])
                .collect::<Vec<_>>()
        })
        .collect();
    for (g, w) in got[0].to_f64_vec().iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
    }
}

/// ReduceL2, ReduceSumSquare and ReduceMin over an axis, against hand-computed values.
#[test]
fn reduce_l2_sum_square_and_min_against_hand_computed_values() {
    use ampgraph_graph::{DType, Tensor};
    let graph = GraphProto {
        input: vec![input("x", &[2, 2])],
        node: vec![
            reduce_axis_1("l2", "ReduceL2"),
            reduce_axis_1("squares", "ReduceSumSquare"),
            reduce_axis_1("least", "ReduceMin"),
        ],
        output: vec![
            input("l2", &[2]),
            input("squares", &[2]),
            input("least", &[2]),
        ],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 17), None, &ImportOptions::default()).unwrap();
    let x = Tensor::from_f64(DType::F32, vec![2, 2], &[3.0, -4.0, 0.5, 1.2]).unwrap();
    let got = evaluate(&g, &[("x", x)]);
    let l2 = got[0].to_f64_vec();
    assert_eq!(l2[0], 5.0);
    assert!((l2[1] - 1.3).abs() < 1e-6, "{l2:?}");
    let squares = got[1].to_f64_vec();
    assert_eq!(squares[0], 25.0);
    assert!((squares[1] - 1.69).abs() < 1e-6, "{squares:?}");
    assert_eq!(got[2].to_f64_vec(), [-4.0, 0.5]);
}

/// Sin and Cos (sinusoidal position embeddings: Funnel's, XLNet's) against their
/// values at multiples of pi / 6.
#[test]
fn sin_and_cos_import_as_unary_ops() {
    use ampgraph_graph::{DType, Tensor};
    let graph = GraphProto {
        input: vec![input("x", &[4])],
        node: vec![
            node("sin", "Sin", &["x"], vec![]),
            node("cos", "Cos", &["x"], vec![]),
        ],
        output: vec![input("sin", &[4]), input("cos", &[4])],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 13), None, &ImportOptions::default()).unwrap();
    let pi = std::f64::consts::PI;
    let x = Tensor::from_f64(DType::F32, vec![4], &[0.0, pi / 6.0, pi / 2.0, pi]).unwrap();
    let got = evaluate(&g, &[("x", x)]);
    let want = [[0.0, 0.5, 1.0, 0.0], [1.0, 0.75f64.sqrt(), 0.0, -1.0]];
    for (out, want) in got.iter().zip(want) {
        for (g, w) in out.to_f64_vec().iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
    }
}

/// IsNaN is true for NaN only, not for infinities, zeros or numbers.
#[test]
fn is_nan_finds_nans_only() {
    use ampgraph_graph::{DType, Tensor};
    let mut bools = input("nan", &[5]);
    if let Some(TypeProto {
        tensor_type: Some(t),
        ..
    }) = bools.r#type.as_mut()
    {
        t.elem_type = 9;
    }
    let graph = GraphProto {
        input: vec![input("x", &[5])],
        node: vec![node("nan", "IsNaN", &["x"], vec![])],
        output: vec![bools],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 13), None, &ImportOptions::default()).unwrap();
    let v = [f64::NAN, f64::INFINITY, -0.0, 1.5, f64::NEG_INFINITY];
    let x = Tensor::from_f64(DType::F32, vec![5], &v).unwrap();
    let got = evaluate(&g, &[("x", x)]);
    assert_eq!(got[0].dtype(), DType::Bool);
    assert_eq!(got[0].to_f64_vec(), [1.0, 0.0, 0.0, 0.0, 0.0]);
}

/// Ceil and Floor of shapes are computed at import (a patch grid's size rounded up);
/// of a value computed at run time, one error naming the node.
#[test]
fn ceil_and_floor_of_shapes_are_computed_at_import() {
    let half = TensorProto {
        name: "half".into(),
        dims: vec![],
        data_type: 1,
        float_data: vec![0.5],
        ..TensorProto::default()
    };
    let graph = |rounded: NodeProto, output: ValueInfoProto| GraphProto {
        input: vec![input("x", &[2, 5])],
        initializer: vec![half.clone()],
        node: vec![
            node("shape", "Shape", &["x"], vec![]),
            node("sizes", "Cast", &["shape"], vec![int_attr("to", 1)]),
            node("halves", "Mul", &["sizes", "half"], vec![]),
            rounded,
        ],
        output: vec![output],
        ..GraphProto::default()
    };
    let up = graph(node("up", "Ceil", &["halves"], vec![]), input("up", &[2]));
    let g = import_model(&model_of(up, 17), None, &ImportOptions::default()).unwrap();
    let x = ampgraph_graph::Tensor::from_f64(ampgraph_graph::DType::F32, vec![2, 5], &[0.0; 10])
        .unwrap();
    assert_eq!(evaluate(&g, &[("x", x)])[0].to_f64_vec(), [1.0, 3.0]);
    let down = graph(
        node("down", "Floor", &["x"], vec![]),
        input("down", &[2, 5]),
    );
    let err = import_model(&model_of(down, 17), None, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("'down'") && err.contains("computed at run time"),
        "{err}"
    );
}

/// A model in a fresh folder whose initializer 'w' ([2, 2] f32) lies in external data
/// at `location`.
#[cfg(unix)]
fn model_with_external(name: &str, location: &str) -> std::path::PathBuf {
    use ampgraph_onnx::proto::StringStringEntryProto;
    use prost::Message;
    let dir = std::env::temp_dir().join(format!("ampgraph-ext-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let entry = |k: &str, v: &str| StringStringEntryProto {
        key: k.into(),
        value: v.into(),
    };
    let w = TensorProto {
        name: "w".into(),
        dims: vec![2, 2],
        data_type: 1,
        data_location: 1,
        external_data: vec![entry("location", location), entry("length", "16")],
        ..TensorProto::default()
    };
    let graph = GraphProto {
        input: vec![input("x", &[2, 2])],
        initializer: vec![w],
        node: vec![NodeProto {
            name: "add".into(),
            op_type: "Add".into(),
            input: vec!["x".into(), "w".into()],
            output: vec!["y".into()],
            ..NodeProto::default()
        }],
        output: vec![input("y", &[2, 2])],
        ..GraphProto::default()
    };
    let model = model_of(graph, 17);
    std::fs::write(dir.join("model.onnx"), model.encode_to_vec()).unwrap();
    dir
}

/// External data is read only from regular files inside the model's folder once links
/// are resolved: a link to a file outside, a linked folder outside and a FIFO (which
/// would block the reader for ever) are refused at once, naming the tensor.
#[cfg(unix)]
#[test]
fn external_data_through_links_or_from_fifos_is_refused() {
    use std::os::unix::fs::symlink;
    let outside = std::env::temp_dir().join(format!("ampgraph-ext-secret-{}", std::process::id()));
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret.bin"), [7u8; 16]).unwrap();
    let import = |dir: &std::path::Path| {
        ampgraph_onnx::import_file(&dir.join("model.onnx"), &ImportOptions::default())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };

    let fine = model_with_external("fine", "w.bin");
    std::fs::write(fine.join("w.bin"), [0u8; 16]).unwrap();
    assert_eq!(import(&fine), Ok(()));
    // A link inside the folder to a file inside it is fine too.
    let alias = model_with_external("alias", "alias.bin");
    std::fs::write(alias.join("w.bin"), [0u8; 16]).unwrap();
    symlink(alias.join("w.bin"), alias.join("alias.bin")).unwrap();
    assert_eq!(import(&alias), Ok(()));

    let linked = model_with_external("link", "w.bin");
    symlink(outside.join("secret.bin"), linked.join("w.bin")).unwrap();
    let err = import(&linked).unwrap_err();
    assert!(
        err.contains("tensor 'w'") && err.contains("outside the model's folder"),
        "{err}"
    );

    let folder = model_with_external("folder", "data/secret.bin");
    symlink(&outside, folder.join("data")).unwrap();
    let err = import(&folder).unwrap_err();
    assert!(err.contains("outside the model's folder"), "{err}");

    let fifo = model_with_external("fifo", "w.bin");
    let made = std::process::Command::new("mkfifo")
        .arg(fifo.join("w.bin"))
        .status();
    if made.is_ok_and(|s| s.success()) {
        let err = import(&fifo).unwrap_err();
        assert!(err.contains("not a regular file"), "{err}");
    } else {
        println!("skipped the FIFO case: mkfifo is not available");
    }
    for dir in [fine, alias, linked, folder, fifo, outside] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A model of one node `op` reading graph input x [2, 3] and initializers `inits`
/// (f32 of x's shape, or i64 lists), at `opset`; its output y is f32 of no declared
/// shape.
fn one_node(op: &str, inputs: &[&str], attribute: Vec<AttributeProto>, opset: i64) -> ModelProto {
    let init = |name: &str| match name {
        "axes" => TensorProto {
            name: name.into(),
            dims: vec![1],
            data_type: 7,
            int64_data: vec![1],
            ..TensorProto::default()
        },
        _ => TensorProto {
            name: name.into(),
            dims: vec![2, 3],
            data_type: 1,
            float_data: vec![1.0; 6],
            ..TensorProto::default()
        },
    };
    let graph = GraphProto {
        input: vec![input("x", &[2, 3])],
        initializer: (inputs.iter())
            .filter(|n| **n != "x")
            .map(|n| init(n))
            .collect(),
        node: vec![NodeProto {
            name: "n".into(),
            op_type: op.into(),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec!["y".into()],
            attribute,
            ..NodeProto::default()
        }],
        output: vec![unshaped("y")],
        ..GraphProto::default()
    };
    model_of(graph, opset)
}

/// Nodes that would run as something else than written are refused naming the node:
/// an extra input (`Add(x, w, w2)` ran as `x + w`), `axes` in the form the opset does
/// not read (ReduceMean's attribute at opset 18 reduced every axis).
#[test]
fn inputs_and_axes_the_op_does_not_read_are_refused() {
    let err = |m: ModelProto| {
        import_model(&m, None, &ImportOptions::default())
            .unwrap_err()
            .to_string()
    };
    let e = err(one_node("Add", &["x", "w", "w2"], vec![], 17));
    assert!(
        e.contains("'n'") && e.contains("takes 2 inputs, not 3"),
        "{e}"
    );
    let e = err(one_node("Relu", &[], vec![], 17));
    assert!(e.contains("takes 1 input, not 0"), "{e}");
    let axes_attr = || AttributeProto {
        name: "axes".into(),
        r#type: attribute_type::INTS,
        ints: vec![1],
        ..AttributeProto::default()
    };
    let e = err(one_node("ReduceMean", &["x"], vec![axes_attr()], 18));
    assert!(
        e.contains("attribute 'axes' is not read at opset 18"),
        "{e}"
    );
    let e = err(one_node("ReduceSum", &["x", "axes"], vec![], 11));
    assert!(
        e.contains("takes 1 input, not 2 (ReduceSum at opset 11)"),
        "{e}"
    );
    // The forms each opset reads import.
    for (m, op) in [
        (one_node("ReduceMean", &["x"], vec![axes_attr()], 17), "17"),
        (one_node("ReduceMean", &["x", "axes"], vec![], 18), "18"),
    ] {
        import_model(&m, None, &ImportOptions::default()).unwrap_or_else(|e| panic!("{op}: {e}"));
    }
}

/// Every node is read as its op's schema at the model's opset says (scripts/onnx/
/// schemas.py, from the onnx package): an attribute the op does not have, one given
/// twice, a required one missing, more outputs than the op makes, an op the opset does
/// not have are refused by name; an attribute the converter does not read must hold
/// its default, except those that cannot change an inference (a Dropout's ratio, a
/// BatchNormalization's momentum).
#[test]
fn nodes_are_read_by_their_schema_at_the_models_opset() {
    let err = |m: ModelProto| {
        import_model(&m, None, &ImportOptions::default())
            .unwrap_err()
            .to_string()
    };
    let ok = |m: ModelProto, what: &str| {
        import_model(&m, None, &ImportOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
    };
    let float = |name: &str, f: f32| AttributeProto {
        name: name.into(),
        r#type: attribute_type::FLOAT,
        f,
        ..AttributeProto::default()
    };
    let e = err(one_node(
        "Add",
        &["x", "w"],
        vec![int_attr("broadcast", 1)],
        17,
    ));
    assert!(
        e.contains("'n'") && e.contains("attribute 'broadcast' is not read at opset 17"),
        "{e}"
    );
    let e = err(one_node(
        "Softmax",
        &["x"],
        vec![int_attr("axis", 1), int_attr("axis", 0)],
        17,
    ));
    assert!(e.contains("attribute 'axis' is given twice"), "{e}");
    let e = err(one_node("Cast", &["x"], vec![], 17));
    assert!(e.contains("the required attribute 'to' is missing"), "{e}");
    let mut two_outputs = one_node("Relu", &["x"], vec![], 17);
    two_outputs.graph.as_mut().unwrap().node[0]
        .output
        .push("z".into());
    let e = err(two_outputs);
    assert!(
        e.contains("takes 1 output, not 2 (Relu at opset 17)"),
        "{e}"
    );
    let e = err(one_node("Gelu", &["x"], vec![], 17));
    assert!(e.contains("is not an op of opset 17"), "{e}");
    ok(one_node("Gelu", &["x"], vec![], 20), "Gelu at 20");
    // Per-channel parameters: the initializers as 3-vectors.
    let per_channel = |mut m: ModelProto| {
        for t in &mut m.graph.as_mut().unwrap().initializer {
            t.dims = vec![3];
            t.float_data.truncate(3);
        }
        m
    };
    // LayerNormalization's stash_type (the statistics' dtype) is not read: only its
    // default (f32) imports.
    let ln = |stash| {
        per_channel(one_node(
            "LayerNormalization",
            &["x", "w", "b"],
            vec![int_attr("stash_type", stash)],
            17,
        ))
    };
    ok(ln(1), "stash_type 1");
    let e = err(ln(11));
    assert!(
        e.contains("attribute 'stash_type' = 11 is not supported (only its default, 1)"),
        "{e}"
    );
    // Each form of a Constant is read.
    ok(
        one_node("Constant", &[], vec![float("value_float", 2.0)], 17),
        "value_float",
    );
    let mut int_constant = one_node("Constant", &[], vec![int_attr("value_int", 2)], 17);
    let out = &mut int_constant.graph.as_mut().unwrap().output[0];
    (out.r#type.as_mut().and_then(|t| t.tensor_type.as_mut()))
        .unwrap()
        .elem_type = 7;
    ok(int_constant, "value_int");
    // What cannot change an inference imports whatever it holds.
    ok(
        one_node("Dropout", &["x"], vec![float("ratio", 0.1)], 11),
        "Dropout ratio",
    );
    let mut bn = per_channel(one_node(
        "BatchNormalization",
        &["x", "w", "b", "m", "v"],
        vec![float("momentum", 0.99)],
        15,
    ));
    let g = bn.graph.as_mut().unwrap();
    g.input[0] = input("x", &[2, 3, 1, 1]);
    g.output[0] = input("y", &[2, 3, 1, 1]);
    ok(bn, "BatchNormalization momentum");
}

/// What a model declares of the values it computes (graph outputs, value_info) must
/// be what import computes: element type and rank always, each numeric dim while the
/// inputs have their declared shapes (an `--input` shape changes those that follow).
#[test]
fn declared_types_and_shapes_are_what_import_computes() {
    let import = |m: &ModelProto, opts: &ImportOptions| import_model(m, None, opts);
    let relu = |output: ValueInfoProto, value_info: Vec<ValueInfoProto>| {
        let mut m = one_node("Relu", &["x"], vec![], 17);
        let g = m.graph.as_mut().unwrap();
        g.output[0] = output;
        g.value_info = value_info;
        m
    };
    let defaults = ImportOptions::default();
    let e = import(&relu(input("y", &[2, 3, 1]), vec![]), &defaults)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("graph output 'y' is declared with shape [2, 3, 1] but computes [2, 3]"),
        "{e}"
    );
    let e = import(&relu(unshaped("y"), vec![input("y", &[2, 4])]), &defaults)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("value 'y' is declared with shape [2, 4] but computes [2, 3]"),
        "{e}"
    );
    let mut wide = input("y", &[2, 3]);
    (wide.r#type.as_mut().and_then(|t| t.tensor_type.as_mut()))
        .unwrap()
        .elem_type = 11;
    let e = import(&relu(unshaped("y"), vec![wide]), &defaults)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("value 'y' is declared f64 but computes f32"),
        "{e}"
    );
    // A symbolic dim matches any; at another batch only the rank is held to.
    let mut batch = input("y", &[2, 3]);
    let tt = (batch.r#type.as_mut().and_then(|t| t.tensor_type.as_mut())).unwrap();
    tt.shape.as_mut().unwrap().dim[0].value = Some(DimensionValue::DimParam("batch".into()));
    import(&relu(batch, vec![]), &defaults).unwrap();
    let other_batch = ImportOptions {
        input_shapes: [("x".to_string(), vec![5, 3])].into_iter().collect(),
        ..ImportOptions::default()
    };
    import(
        &relu(input("y", &[2, 3]), vec![input("y", &[2, 3])]),
        &other_batch,
    )
    .unwrap();
    let e = import(&relu(input("y", &[2, 3, 1]), vec![]), &other_batch)
        .unwrap_err()
        .to_string();
    assert!(e.contains("computes [5, 3]"), "{e}");
}

/// An initializer defined twice (the second silently won) and an opset newer than the
/// converters follow are refused.
#[test]
fn duplicate_initializers_and_future_opsets_are_refused() {
    let err = |m: &ModelProto| {
        import_model(m, None, &ImportOptions::default())
            .unwrap_err()
            .to_string()
    };
    let mut twice = one_node("Add", &["x", "w"], vec![], 17);
    let graph = twice.graph.as_mut().unwrap();
    let mut second = graph.initializer[0].clone();
    second.float_data = vec![2.0; 6];
    graph.initializer.push(second);
    let e = err(&twice);
    assert!(
        e.contains("tensor 'w'") && e.contains("defined twice"),
        "{e}"
    );
    let e = err(&one_node("Add", &["x", "w"], vec![], 99));
    assert!(e.contains("opset 99 is newer than"), "{e}");
}

/// Constants a tiny file asks import to compute are refused before they are made when
/// they exceed what the process can allocate (a 4 TiB ConstantOfShape, an Expand of a
/// constant to the same size): the allocation would abort the process.
#[test]
fn constants_beyond_the_memory_budget_are_refused_before_they_are_made() {
    let huge = TensorProto {
        name: "shape".into(),
        dims: vec![2],
        data_type: 7,
        int64_data: vec![1 << 20, 1 << 20],
        ..TensorProto::default()
    };
    let one = TensorProto {
        name: "one".into(),
        dims: vec![1],
        data_type: 1,
        float_data: vec![1.0],
        ..TensorProto::default()
    };
    for (op, inputs) in [
        ("ConstantOfShape", vec!["shape"]),
        ("Expand", vec!["one", "shape"]),
    ] {
        let graph = GraphProto {
            initializer: vec![huge.clone(), one.clone()],
            node: vec![NodeProto {
                name: "big".into(),
                op_type: op.into(),
                input: inputs.iter().map(|s| s.to_string()).collect(),
                output: vec!["y".into()],
                ..NodeProto::default()
            }],
            output: vec![input("y", &[1 << 20, 1 << 20])],
            ..GraphProto::default()
        };
        let model = model_of(graph, 17);
        let started = std::time::Instant::now();
        let err = import_model(&model, None, &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("'big'")
                && err.contains("f32[1048576, 1048576]")
                && err.contains("4194304.0 MiB")
                && err.contains("can still allocate"),
            "{op}: {err}"
        );
        assert!(started.elapsed().as_secs() < 2, "{op}");
    }
}

/// A Conv whose kernel_shape contradicts its weights is refused (it ran with the
/// weights' shape, silently).
#[test]
fn a_conv_kernel_shape_contradicting_its_weights_is_refused() {
    let w = TensorProto {
        name: "w".into(),
        dims: vec![4, 3, 3, 3],
        data_type: 1,
        float_data: vec![0.5; 108],
        ..TensorProto::default()
    };
    let graph = GraphProto {
        input: vec![input("x", &[1, 3, 8, 8])],
        initializer: vec![w],
        node: vec![NodeProto {
            name: "conv".into(),
            op_type: "Conv".into(),
            input: vec!["x".into(), "w".into()],
            output: vec!["y".into()],
            attribute: vec![AttributeProto {
                name: "kernel_shape".into(),
                r#type: attribute_type::INTS,
                ints: vec![5, 5],
                ..AttributeProto::default()
            }],
            ..NodeProto::default()
        }],
        output: vec![input("y", &[1, 4, 6, 6])],
        ..GraphProto::default()
    };
    let model = model_of(graph, 17);
    let err = import_model(&model, None, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("'conv'")
            && err.contains("kernel_shape [5, 5] contradicts the weights' spatial dims [3, 3]"),
        "{err}"
    );
}

/// A Split into more outputs than its axis has elements is refused (empty outputs
/// were accepted).
#[test]
fn a_split_into_more_outputs_than_elements_is_refused() {
    let mut m = one_node("Split", &["x"], vec![], 17);
    let node = &mut m.graph.as_mut().unwrap().node[0];
    node.output = vec!["a".into(), "b".into(), "c".into()];
    node.attribute = vec![AttributeProto {
        name: "axis".into(),
        r#type: attribute_type::INT,
        i: 0,
        ..AttributeProto::default()
    }];
    m.graph.as_mut().unwrap().output = vec![input("a", &[1, 3])];
    let err = import_model(&m, None, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("3 outputs from an axis of 2 elements"),
        "{err}"
    );
}

/// A graph output declared with another element type than the one computed is refused
/// (a model read wrong would run on, silently).
#[test]
fn an_output_declared_with_another_type_is_refused() {
    let mut m = one_node("Add", &["x", "w"], vec![], 17);
    let output = &mut m.graph.as_mut().unwrap().output[0];
    let tensor = output
        .r#type
        .as_mut()
        .unwrap()
        .tensor_type
        .as_mut()
        .unwrap();
    tensor.elem_type = 10; // FLOAT16
    let err = import_model(&m, None, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("graph output 'y' is declared f16 but computes f32"),
        "{err}"
    );
}

/// AveragePool with `count_include_pad` (MaxViT's): the padding counts in every
/// window's divisor, against hand-computed values; with the padding `ceil_mode`
/// adds (windows past the padded input, whose divisor ONNX leaves to the runtime),
/// one clear error.
#[test]
fn average_pools_that_count_their_padding() {
    let ints = |name: &str, v: &[i64]| AttributeProto {
        name: name.into(),
        r#type: attribute_type::INTS,
        ints: v.to_vec(),
        ..AttributeProto::default()
    };
    let pool = |include: i64, strides: &[i64], ceil: i64| {
        let graph = GraphProto {
            input: vec![input("x", &[1, 1, 3, 3])],
            node: vec![NodeProto {
                name: "pool".into(),
                op_type: "AveragePool".into(),
                input: vec!["x".into()],
                output: vec!["y".into()],
                attribute: vec![
                    ints("kernel_shape", &[3, 3]),
                    ints("pads", &[1, 1, 1, 1]),
                    ints("strides", strides),
                    int_attr("count_include_pad", include),
                    int_attr("ceil_mode", ceil),
                ],
                ..NodeProto::default()
            }],
            output: vec![unshaped("y")],
            ..GraphProto::default()
        };
        import_model(&model_of(graph, 17), None, &ImportOptions::default())
    };
    let x = ampgraph_graph::Tensor::from_f64(
        ampgraph_graph::DType::F32,
        [1, 1, 3, 3],
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
    )
    .unwrap();
    // Window sums over the zero-padded 5x5: corners 12, 16, 24, 28; edges 21, 27,
    // 33, 39; the centre 45.
    let sums = [12.0, 21.0, 16.0, 27.0, 45.0, 33.0, 24.0, 39.0, 28.0];
    let counts = [4.0, 6.0, 4.0, 6.0, 9.0, 6.0, 4.0, 6.0, 4.0];
    for (include, divisors) in [(1, [9.0; 9]), (0, counts)] {
        let g = pool(include, &[1, 1], 0).unwrap();
        let y = evaluate(&g, &[("x", x.clone())]).remove(0);
        assert_eq!(y.shape(), [1, 1, 3, 3]);
        let want: Vec<f64> = sums.iter().zip(&divisors).map(|(s, d)| s / d).collect();
        let got = y.to_f64_vec();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() < 1e-6,
                "count_include_pad {include}: {got:?} vs {want:?}"
            );
        }
    }
    // Stride 3 over 3 + 2 padded: ceil_mode adds a window past the padding.
    let e = pool(1, &[3, 3], 1)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("'pool'") && e.contains("ceil_mode"), "{e}");
}

/// What the transforms' imports do not take is one error line naming the node: a Col2Im whose
/// blocks overlap (they add up), a DFT padding its signal (`dft_length` 8 of a
/// signal of 6), a one-sided transform of a complex signal.
#[test]
fn overlapping_folds_and_padded_transforms_are_one_clear_error() {
    let strides = AttributeProto {
        name: "strides".into(),
        r#type: attribute_type::INTS,
        ints: vec![1, 1],
        ..AttributeProto::default()
    };
    let cases = [
        (
            node("fold", "Col2Im", &["x", "image", "block"], vec![strides]),
            input("x", &[1, 8, 12]),
            18,
            "only blocks that tile the image",
        ),
        (
            node("fft", "DFT", &["x", "length"], vec![int_attr("axis", 1)]),
            input("x", &[2, 6, 1]),
            17,
            "dft_length 8 differs from the signal's 6",
        ),
        (
            node("rfft", "DFT", &["x"], vec![int_attr("onesided", 1)]),
            input("x", &[2, 6, 2]),
            17,
            "a one-sided transform of a complex signal",
        ),
    ];
    for (node, x, opset, says) in cases {
        let name = node.name.clone();
        let graph = GraphProto {
            input: vec![x],
            initializer: vec![
                int64s("image", vec![2], vec![4, 5]),
                int64s("block", vec![2], vec![2, 2]),
                int64s("length", vec![], vec![8]),
            ],
            output: vec![unshaped(&name)],
            node: vec![node],
            ..GraphProto::default()
        };
        let err = import_model(&model_of(graph, opset), None, &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert_one_line_naming(&err, &name, says);
    }
}

/// Integers summed and their maxima and minima taken at run time (Flaubert's lengths:
/// the non-padding tokens a row), in f64 and cast back, against hand-computed values
/// (sums past f32's 2^24 stay exact).
#[test]
fn integer_reductions_of_run_time_values_are_exact() {
    use ampgraph_graph::{DType, Tensor};
    let integers = |name: &str, shape: &[i64]| int64(input(name, shape));
    let graph = GraphProto {
        input: vec![integers("x", &[2, 3])],
        node: vec![
            reduce_axis_1("sum", "ReduceSum"),
            reduce_axis_1("most", "ReduceMax"),
            reduce_axis_1("least", "ReduceMin"),
        ],
        output: ["sum", "most", "least"].map(|n| integers(n, &[2])).to_vec(),
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 11), None, &ImportOptions::default()).unwrap();
    let big = 1i64 << 40;
    let values = [big + 1, 2, -7, 4, 0, 5];
    let x = Tensor::new(vec![2, 3], ampgraph_graph::Data::I64(values.to_vec())).unwrap();
    let got = evaluate(&g, &[("x", x)]);
    assert!(got.iter().all(|t| t.dtype() == DType::I64));
    assert_eq!(got[0].to_i64_vec().unwrap(), [big - 4, 9]);
    assert_eq!(got[1].to_i64_vec().unwrap(), [big + 1, 5]);
    assert_eq!(got[2].to_i64_vec().unwrap(), [-7, 0]);
}

/// ScatterND of run-time updates at constant indices (RWKV writing its outputs a time
/// step at a time): each slice set from its update, a position written twice keeping
/// the last, into a constant and into a run-time data; a reduction of run-time values
/// and run-time indices are one error naming the node.
#[test]
fn scatter_nd_sets_run_time_updates_at_constant_indices() {
    use ampgraph_graph::{DType, Tensor};
    let scatter = |name: &str, data: &str, indices: &str, attribute| {
        node(name, "ScatterND", &[data, indices, "u"], attribute)
    };
    let graph = |nodes: Vec<NodeProto>| GraphProto {
        input: vec![input("x", &[3, 2]), input("u", &[2, 2])],
        initializer: vec![
            // Rows 2 and 0; rows 1 and 1 (the second write wins).
            int64s("rows", vec![2, 1], vec![2, 0]),
            int64s("twice", vec![2, 1], vec![1, 1]),
            float32s("zeros", vec![3, 2], vec![0.0; 6]),
        ],
        output: nodes.iter().map(|n| unshaped(&n.name)).collect(),
        node: nodes,
        ..GraphProto::default()
    };
    let model = model_of(
        graph(vec![
            scatter("into_data", "x", "rows", vec![]),
            scatter("into_zeros", "zeros", "twice", vec![]),
        ]),
        16,
    );
    let g = import_model(&model, None, &ImportOptions::default()).unwrap();
    let x = Tensor::from_f64(DType::F32, vec![3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let u = Tensor::from_f64(DType::F32, vec![2, 2], &[10.0, 20.0, 30.0, 40.0]).unwrap();
    let got = evaluate(&g, &[("x", x), ("u", u)]);
    assert_eq!(got[0].to_f64_vec(), [30.0, 40.0, 3.0, 4.0, 10.0, 20.0]);
    assert_eq!(got[1].to_f64_vec(), [0.0, 0.0, 30.0, 40.0, 0.0, 0.0]);

    let add = AttributeProto {
        name: "reduction".into(),
        r#type: attribute_type::STRING,
        s: b"add".to_vec(),
        ..AttributeProto::default()
    };
    for (bad, says) in [
        (
            scatter("summed", "x", "rows", vec![add]),
            "input 0 ('x') is computed at run time",
        ),
        (
            scatter("moving", "zeros", "x", vec![]),
            "input 1 ('x') is computed at run time",
        ),
    ] {
        let name = bad.name.clone();
        let err = import_model(
            &model_of(graph(vec![bad]), 16),
            None,
            &ImportOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert_one_line_naming(&err, &name, says);
    }
}

/// What the recurrent cells' import does not take is one error line naming the node:
/// the batch-first layout, peepholes, a clipped cell, weights computed at run time,
/// sequences shorter than the input.
#[test]
fn recurrent_cells_it_does_not_unroll_are_one_clear_error() {
    let floats = |name: &str, dims: Vec<i64>| {
        let n = dims.iter().product::<i64>() as usize;
        float32s(name, dims, vec![0.1; n])
    };
    let clip = AttributeProto {
        name: "clip".into(),
        r#type: attribute_type::FLOAT,
        f: 1.0,
        ..AttributeProto::default()
    };
    let hidden = || int_attr("hidden_size", 2);
    let cases = [
        (
            vec!["x", "W", "R"],
            vec![hidden(), int_attr("layout", 1)],
            "batch-first layout",
        ),
        (
            vec!["x", "W", "R", "", "", "", "", "P"],
            vec![hidden()],
            "peepholes",
        ),
        (vec!["x", "W", "R"], vec![hidden(), clip], "clipped cell"),
        (
            vec!["x", "x", "R"],
            vec![hidden()],
            "its W (input 1) must be a constant",
        ),
        (
            vec!["x", "W", "R", "", "short"],
            vec![hidden()],
            "only sequences of the full length 3",
        ),
    ];
    for (inputs, attribute, says) in cases {
        let graph = GraphProto {
            input: vec![input("x", &[3, 1, 4])],
            initializer: vec![
                floats("W", vec![1, 8, 4]),
                floats("R", vec![1, 8, 2]),
                floats("P", vec![1, 6]),
                TensorProto {
                    name: "short".into(),
                    dims: vec![1],
                    data_type: 6,
                    int32_data: vec![2],
                    ..TensorProto::default()
                },
            ],
            output: vec![unshaped("cell")],
            node: vec![node("cell", "LSTM", &inputs, attribute)],
            ..GraphProto::default()
        };
        let err = import_model(&model_of(graph, 14), None, &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert_one_line_naming(&err, "cell", says);
    }
}

/// ArgMax and ArgMin against hand-computed indices: ties going to the first index, or
/// to the last with `select_last_index`; kept axes; an integer input (token ids)
/// above f32's exact range.
#[test]
fn arg_max_and_min_pick_hand_computed_indices() {
    use ampgraph_graph::{DType, Tensor};
    let longs = |name: &str| int64(unshaped(name));
    let arg = |name: &str, op: &str, extra: Vec<AttributeProto>| {
        let mut attribute = vec![int_attr("axis", 1)];
        attribute.extend(extra);
        node(name, op, &["x"], attribute)
    };
    let graph = GraphProto {
        input: vec![input("x", &[2, 4])],
        node: vec![
            arg("first", "ArgMax", vec![int_attr("keepdims", 0)]),
            arg(
                "last",
                "ArgMax",
                vec![int_attr("keepdims", 0), int_attr("select_last_index", 1)],
            ),
            arg("least", "ArgMin", vec![]),
        ],
        output: vec![longs("first"), longs("last"), longs("least")],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 13), None, &ImportOptions::default()).unwrap();
    let x = Tensor::from_f64(
        DType::F32,
        vec![2, 4],
        &[1.0, 7.0, 7.0, -2.0, 0.5, -3.0, 0.5, -3.0],
    )
    .unwrap();
    let got = evaluate(&g, &[("x", x)]);
    assert!(got.iter().all(|t| t.dtype() == DType::I64));
    assert_eq!(got[0].to_i64_vec().unwrap(), [1, 0]);
    assert_eq!(got[1].to_i64_vec().unwrap(), [2, 2]);
    assert_eq!(got[2].shape(), [2, 1]);
    assert_eq!(got[2].to_i64_vec().unwrap(), [3, 1]);

    let graph = GraphProto {
        input: vec![int64(input("ids", &[1, 3]))],
        node: vec![node("top", "ArgMax", &["ids"], vec![int_attr("axis", -1)])],
        output: vec![longs("top")],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 13), None, &ImportOptions::default()).unwrap();
    let big = (1i64 << 30) + 1;
    let ids = Tensor::new(vec![1, 3], ampgraph_graph::Data::I64(vec![big - 1, big, 5])).unwrap();
    assert_eq!(evaluate(&g, &[("ids", ids)])[0].to_i64_vec().unwrap(), [1]);
}

/// GatherND at index vectors computed at run time (a sequence classifier's logits at
/// each row's last token), a negative index counting from its axis' end, against
/// hand-computed values.
#[test]
fn gather_nd_takes_run_time_index_vectors() {
    use ampgraph_graph::{DType, Tensor};
    let graph = GraphProto {
        input: vec![input("x", &[2, 3, 2]), int64(input("at", &[2, 2]))],
        node: vec![node("picked", "GatherND", &["x", "at"], vec![])],
        output: vec![input("picked", &[2, 2])],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 17), None, &ImportOptions::default()).unwrap();
    let values: Vec<f64> = (0..12).map(f64::from).collect();
    let x = Tensor::from_f64(DType::F32, vec![2, 3, 2], &values).unwrap();
    let at = Tensor::new(vec![2, 2], ampgraph_graph::Data::I64(vec![1, 2, 0, -1])).unwrap();
    // x[1, 2, :] = [10, 11]; x[0, -1, :] = x[0, 2, :] = [4, 5].
    assert_eq!(
        evaluate(&g, &[("x", x), ("at", at)])[0].to_f64_vec(),
        [10.0, 11.0, 4.0, 5.0]
    );
}

/// A 3-D convolution whose windows overlap is one error line naming the node (only
/// those that tile the input, a tubelet embedding's, import).
#[test]
fn overlapping_3d_convolutions_are_one_clear_error() {
    let w = float32s("w", vec![4, 3, 2, 2, 2], vec![0.1; 96]);
    let graph = GraphProto {
        input: vec![input("x", &[1, 3, 4, 4, 4])],
        initializer: vec![w],
        node: vec![node("conv3d", "Conv", &["x", "w"], vec![])],
        output: vec![unshaped("conv3d")],
        ..GraphProto::default()
    };
    let err = import_model(&model_of(graph, 13), None, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert_one_line_naming(&err, "conv3d", "windows tile the input");
}

/// OneHot against hand-computed values: run-time int64 indices, a negative one
/// counting from the depth's end, one out of range (all `off`), the new axis last and
/// first.
#[test]
fn one_hot_of_run_time_indices() {
    use ampgraph_graph::{DType, Tensor};
    let values = float32s("values", vec![2], vec![-1.0, 3.0]);
    let graph = GraphProto {
        input: vec![int64(input("i", &[3]))],
        initializer: vec![int64s("depth", vec![], vec![4]), values],
        node: vec![
            node("last", "OneHot", &["i", "depth", "values"], vec![]),
            node(
                "first",
                "OneHot",
                &["i", "depth", "values"],
                vec![int_attr("axis", 0)],
            ),
        ],
        output: vec![input("last", &[3, 4]), input("first", &[4, 3])],
        ..GraphProto::default()
    };
    let g = import_model(&model_of(graph, 11), None, &ImportOptions::default()).unwrap();
    let i = Tensor::new(vec![3], ampgraph_graph::Data::I64(vec![2, -1, 5])).unwrap();
    let got = evaluate(&g, &[("i", i)]);
    let (off, on) = (-1.0, 3.0);
    let rows = [[off, off, on, off], [off, off, off, on], [off; 4]];
    assert_eq!(got[0].to_f64_vec(), rows.concat());
    let columns: Vec<f64> = (0..4)
        .flat_map(|k| rows.iter().map(move |r| r[k]))
        .collect();
    assert_eq!(got[1].to_f64_vec(), columns);
    assert_eq!(got[0].dtype(), DType::F32);
}
