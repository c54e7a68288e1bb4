//! Gradients of Where (three-way broadcasting), Gather (repeated and negative
//! indices), GatherGrad and constant-mode Pad (growing and cropping) against central
//! finite differences; and the CUDA executor's refusal of these ops and the
//! comparisons, which have no CUDA kernels yet (no device needed).

mod common;

use ampgraph_exec::CudaExecutor;
use ampgraph_graph::ops::{
    CoordinateTransform, Gather, GatherGrad, Pad, ResizeGrad, ResizeMode, Where,
};
use ampgraph_graph::{DType, Graph, Port, Tensor};
use common::*;
use proptest::prelude::*;

fn bools(shape: &[usize], rng: &mut Gen) -> Tensor {
    let v: Vec<f64> = (0..numel(shape)).map(|_| rng.below(2) as f64).collect();
    Tensor::from_f64(DType::Bool, shape.to_vec(), &v).unwrap()
}

/// `count` indices into an axis of `n` (n > 0), negative ones among them, as i32 or i64.
fn indices(shape: &[usize], n: usize, rng: &mut Gen) -> Tensor {
    let dtype = if rng.below(2) == 0 {
        DType::I32
    } else {
        DType::I64
    };
    let v: Vec<f64> = (0..numel(shape))
        .map(|_| rng.below(2 * n) as f64 - n as f64)
        .collect();
    Tensor::from_f64(dtype, shape.to_vec(), &v).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn where_gradient_matches_finite_differences(
        (sa, sb) in broadcast_pair(3, 3),
        cond_shape in 0usize..3,
        seed in any::<u64>(),
    ) {
        let out = broadcast(&sa, &sb);
        let cs = match cond_shape {
            0 => out,
            1 => sa.clone(),
            _ => vec![],
        };
        let mut rng = Gen(seed);
        let cond = bools(&cs, &mut rng);
        let a = t64(&sa, &rng.vec(numel(&sa), -2.0, 2.0));
        let b = t64(&sb, &rng.vec(numel(&sb), -2.0, 2.0));
        assert_grad(Box::new(Where), &[cond, a, b], seed);
    }

    #[test]
    fn gather_gradient_matches_finite_differences(
        shape in prop::collection::vec(1usize..=3, 1..=3),
        ishape in shape(2, 4),
        axis_pick in any::<u64>(),
        negative in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let rank = shape.len();
        let axis = (axis_pick % rank as u64) as usize;
        let mut rng = Gen(seed);
        let idx = indices(&ishape, shape[axis], &mut rng);
        let x = t64(&shape, &rng.vec(numel(&shape), -2.0, 2.0));
        let axis = if negative { axis as i64 - rank as i64 } else { axis as i64 };
        assert_grad(Box::new(Gather::new(axis)), &[x, idx], seed);
    }

    #[test]
    fn gather_grad_gradient_matches_finite_differences(
        shape in prop::collection::vec(1usize..=3, 1..=3),
        ishape in shape(2, 4),
        axis_pick in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let axis = (axis_pick % shape.len() as u64) as usize;
        let mut rng = Gen(seed);
        let idx = indices(&ishape, shape[axis], &mut rng);
        let mut dy_shape = shape[..axis].to_vec();
        dy_shape.extend_from_slice(&ishape);
        dy_shape.extend_from_slice(&shape[axis + 1..]);
        let dy = t64(&dy_shape, &rng.vec(numel(&dy_shape), -2.0, 2.0));
        assert_grad(Box::new(GatherGrad::new(axis as i64, shape)), &[dy, idx], seed);
    }

    #[test]
    fn pad_gradient_matches_finite_differences(shape in shape(3, 3), seed in any::<u64>()) {
        // Per axis: up to 2 grown or the whole axis cropped, at either end.
        let mut rng = Gen(seed);
        let pads: Vec<[i64; 2]> = shape
            .iter()
            .map(|&d| {
                let before = rng.below(d + 3) as i64 - d as i64;
                let left = d as i64 + before.min(0);
                let after = rng.below(left as usize + 3) as i64 - left;
                [before, after]
            })
            .collect();
        let x = t64(&shape, &rng.vec(numel(&shape), -2.0, 2.0));
        assert_grad(Box::new(Pad::constant(pads, rng.uniform(-1.0, 1.0))), &[x], seed);
    }
}

/// The CUDA lowering's error for the graph `build` makes from an f32 [2, 3] `x`.
fn cuda_refusal(build: impl FnOnce(&mut Graph, Port) -> ampgraph_graph::Result<Port>) -> String {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, 3]).unwrap();
    build(&mut g, x).unwrap();
    CudaExecutor::check_supported(&g).unwrap_err().to_string()
}

/// GatherGrad (an embedding's gradient) lowers on CUDA: no device needed, every node
/// is lowered before anything runs (exec/tests/cuda_ops.rs checks its values). An op
/// without a kernel (a Resize's gradient) is refused naming it.
#[test]
fn cuda_lowers_gather_grad_and_refuses_what_has_no_kernel() {
    let mut g = Graph::new();
    let dy = g.placeholder("dy", DType::F32, [2, 3]).unwrap();
    let i = g.placeholder("i", DType::I64, [3]).unwrap();
    g.add(GatherGrad::new(1, [2, 5]), &[dy, i]).unwrap();
    CudaExecutor::check_supported(&g).unwrap();
    let err = cuda_refusal(|g, x| {
        let x = g.reshape(x, [1, 1, 2, 3])?;
        let op = ResizeGrad::new(
            vec![1, 1, 1, 2],
            ResizeMode::Linear,
            CoordinateTransform::HalfPixel,
        );
        g.add(op, &[x])
    });
    assert!(
        err.contains("ResizeLinearGrad has no CUDA kernel") && err.contains("use Device::Cpu"),
        "{err}"
    );
}
