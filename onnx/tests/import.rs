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
    let model = ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(graph),
        ..ModelProto::default()
    };
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
