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

/// The dtypes read and print as `f8e4m3` and `f8e5m2`, one byte a value.
#[test]
fn fp8_dtypes_are_named_and_sized() {
    for (dtype, _) in FORMATS {
        assert_eq!(dtype.as_str().parse::<DType>().unwrap(), dtype);
        assert_eq!(dtype.size_bytes(), 1);
        assert!(dtype.is_float() && dtype.is_fp8() && !dtype.is_half());
    }
}
