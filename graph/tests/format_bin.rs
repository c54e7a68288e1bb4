//! The binary graph form's constants: stored as their own little-endian bytes after
//! the graph (version 2), read back bit for bit; version 1 files (values as f64s in
//! the graph) still read; damaged value sections are refused by name.

use std::sync::Arc;

use ampgraph_graph::format::{self, GraphDef, BIN_MAGIC, BIN_VERSION};
use ampgraph_graph::fp8::{F8E4M3, F8E5M2};
use ampgraph_graph::ops::Const;
use ampgraph_graph::{Data, Graph, Tensor};
use half::{bf16, f16};

/// A graph of one Const of each value type, with values a text or f64 form would
/// bend: NaN payloads, -0.0, subnormals, the integers past 2^53.
fn constants() -> (Graph, Vec<Data>) {
    let data = vec![
        Data::F32(vec![
            f32::from_bits(0x7fc0_1234),
            -0.0,
            f32::from_bits(1),
            1.0 / 3.0,
            f32::INFINITY,
        ]),
        Data::F16(vec![f16::from_bits(0x7e01), f16::from_bits(1), f16::MAX]),
        Data::BF16(vec![bf16::from_bits(0xffc1), bf16::MIN_POSITIVE]),
        Data::F64(vec![
            std::f64::consts::PI,
            f64::from_bits(0x7ff8_0000_0000_0042),
        ]),
        Data::I32(vec![i32::MIN, 7]),
        Data::I64(vec![(1 << 53) + 1, -1]),
        Data::Bool(vec![true, false, true]),
        Data::F8E4M3(vec![F8E4M3(0x7e), F8E4M3(0x01)]),
        Data::F8E5M2(vec![F8E5M2(0x7b), F8E5M2(0x80)]),
    ];
    let mut g = Graph::new();
    for (i, d) in data.iter().enumerate() {
        let t = Tensor::new([d.len()], d.clone()).unwrap();
        g.add_node(format!("c{i}"), Box::new(Const::new(t)), &[])
            .unwrap();
    }
    let outputs = (0..data.len())
        .map(|i| g.find(&format!("c{i}")).unwrap().into())
        .collect();
    g.set_outputs(outputs).unwrap();
    (g, data)
}

fn stored(g: &Graph, name: &str) -> Arc<Data> {
    let id = g.find(name).unwrap();
    (g.node(id)
        .op
        .downcast_ref::<Const>()
        .unwrap()
        .values
        .clone())
    .unwrap()
}

fn le_bits(d: &Data) -> Vec<u8> {
    d.to_le_bytes()
}

#[test]
fn constants_round_trip_bit_for_bit_in_their_own_size() {
    let (g, data) = constants();
    let bin = format::to_bin(&GraphDef::from_graph(&g)).unwrap();
    let back = format::graph_from_bytes(&bin).unwrap();
    for (i, d) in data.iter().enumerate() {
        assert_eq!(
            le_bits(&stored(&back, &format!("c{i}"))),
            le_bits(d),
            "c{i}"
        );
    }
    // A large constant costs its own bytes and a header, not eight bytes a value.
    let mut big = Graph::new();
    let values: Vec<f32> = (0..1 << 20).map(|i| i as f32 * 0.5).collect();
    let t = Tensor::new([1 << 20], Data::F32(values)).unwrap();
    let c = big.add_node("big", Box::new(Const::new(t)), &[]).unwrap();
    big.set_outputs(vec![c.into()]).unwrap();
    let bin = format::to_bin(&GraphDef::from_graph(&big)).unwrap();
    assert!(bin.len() < (4 << 20) + 1024, "{} bytes", bin.len());
    let back = format::graph_from_bytes(&bin).unwrap();
    assert_eq!(
        le_bits(&stored(&back, "big")),
        le_bits(&stored(&big, "big"))
    );
}

#[test]
fn version_1_files_still_read() {
    let (g, data) = constants();
    // Version 1: the graph alone, each Const's values an f64 list in attr `value`.
    let json = format::to_json(&GraphDef::from_graph(&g));
    let def = format::parse_json(json.as_bytes()).unwrap();
    assert!(def.nodes.iter().all(|n| n.values.is_none()));
    let mut v1 = BIN_MAGIC.to_vec();
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend(bincode::serde::encode_to_vec(&def, bincode::config::standard()).unwrap());
    let back = format::graph_from_bytes(&v1).unwrap();
    // The same values (JSON's and version 1's text and f64 keep no NaN payload).
    let same = |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for (i, d) in data.iter().enumerate() {
        let got = stored(&back, &format!("c{i}"));
        assert_eq!(got.dtype(), d.dtype(), "c{i}");
        let pairs = got.to_f64().into_iter().zip(d.to_f64());
        assert!(
            pairs.clone().all(|(a, b)| same(a, b)),
            "c{i}: {:?}",
            pairs.collect::<Vec<_>>()
        );
    }
}

/// The version 2 file of `g` cut into (header with its length, values).
fn parts(g: &Graph) -> (Vec<u8>, Vec<u8>) {
    let bin = format::to_bin(&GraphDef::from_graph(g)).unwrap();
    let at = BIN_MAGIC.len() + 4;
    assert_eq!(bin[BIN_MAGIC.len()..at], BIN_VERSION.to_le_bytes());
    let length = u64::from_le_bytes(bin[at..at + 8].try_into().unwrap()) as usize;
    let end = at + 8 + length;
    (bin[..end].to_vec(), bin[end..].to_vec())
}

fn error(bytes: &[u8]) -> String {
    match format::graph_from_bytes(bytes) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damaged_value_sections_are_refused_by_name() {
    let (g, _) = constants();
    let (header, values) = parts(&g);
    let whole = [header.clone(), values.clone()].concat();
    // Values cut short, values with more after them.
    let e = error(&whole[..whole.len() - 1]);
    assert!(
        e.contains("'c8'") && e.contains("past the file's end"),
        "{e}"
    );
    let e = error(&[whole.clone(), vec![0]].concat());
    assert!(e.contains("trailing bytes"), "{e}");
    // A header whose length points past the file.
    let mut long = whole.clone();
    long[BIN_MAGIC.len() + 4..BIN_MAGIC.len() + 12].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(
        error(&long).contains("header runs past"),
        "{}",
        error(&long)
    );
    // A bool byte other than 0 or 1 names its node.
    let mut bad_bool = whole.clone();
    let bools_at = header.len() + values.len() - 2 - 2 - 3;
    bad_bool[bools_at] = 2;
    let e = error(&bad_bool);
    assert!(e.contains("'c6'") && e.contains("neither 0 nor 1"), "{e}");
    // Values stored for a node that is not a Const, or of the wrong size.
    let mut g2 = Graph::new();
    let p = g2
        .placeholder("p", ampgraph_graph::DType::F32, vec![2])
        .unwrap();
    g2.set_outputs(vec![p]).unwrap();
    let mut def = GraphDef::from_graph(&g2);
    def.nodes[0].values = Some(Arc::new(Data::F32(vec![1.0, 2.0])));
    let bin = format::to_bin(&def).unwrap();
    let e = error(&bin);
    assert!(e.contains("'p'") && e.contains("not a Const"), "{e}");
    let mut def = GraphDef::from_graph(&g);
    def.nodes[0].values = Some(Arc::new(Data::F32(vec![1.0])));
    let e = error(&format::to_bin(&def).unwrap());
    assert!(
        e.contains("'c0'") && e.contains("1 stored values of f32"),
        "{e}"
    );
}
