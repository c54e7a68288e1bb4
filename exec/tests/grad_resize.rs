//! Gradients of Resize (ResizeGrad) in both modes, upsampling and downsampling, every
//! coordinate transformation and nearest rounding, and of ResizeGrad itself (a
//! Resize) against central finite differences; the gradient graph in 16-bit types;
//! and the CUDA executor's refusal of Resize, which has no CUDA kernel (no device
//! needed).

mod common;

use ampgraph_exec::CudaExecutor;
use ampgraph_graph::ops::{CoordinateTransform, NearestMode, Resize, ResizeGrad, ResizeMode};
use ampgraph_graph::{DType, Graph};
use common::*;
use proptest::prelude::*;

const TRANSFORMS: [CoordinateTransform; 5] = [
    CoordinateTransform::HalfPixel,
    CoordinateTransform::Asymmetric,
    CoordinateTransform::AlignCorners,
    CoordinateTransform::PytorchHalfPixel,
    CoordinateTransform::TfHalfPixelForNn,
];

const MODES: [ResizeMode; 5] = [
    ResizeMode::Nearest(NearestMode::RoundPreferFloor),
    ResizeMode::Nearest(NearestMode::RoundPreferCeil),
    ResizeMode::Nearest(NearestMode::Floor),
    ResizeMode::Nearest(NearestMode::Ceil),
    ResizeMode::Linear,
];

/// An input shape and a resized one of the same rank (1 to 3): each axis kept,
/// grown or shrunk.
fn shapes() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec((1usize..=4, 1usize..=6), 1..=3).prop_map(|axes| axes.into_iter().unzip())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn resize_gradient_matches_finite_differences(
        (from, to) in shapes(),
        mode in 0..MODES.len(),
        transform in 0..TRANSFORMS.len(),
        seed in any::<u64>(),
    ) {
        let x = t64(&from, &Gen(seed).vec(numel(&from), -2.0, 2.0));
        let op = Resize::new(to, MODES[mode], TRANSFORMS[transform]);
        assert_grad(Box::new(op), &[x], seed);
    }

    #[test]
    fn resize_grad_gradient_matches_finite_differences(
        (from, to) in shapes(),
        mode in 0..MODES.len(),
        transform in 0..TRANSFORMS.len(),
        seed in any::<u64>(),
    ) {
        let dy = t64(&to, &Gen(seed).vec(numel(&to), -2.0, 2.0));
        let op = ResizeGrad::new(from, MODES[mode], TRANSFORMS[transform]);
        assert_grad(Box::new(op), &[dy], seed);
    }
}

#[test]
fn image_resizes_up_and_down() {
    // NCHW images, as exporters write them: 2x upsampling, 2x and 3/5 downsampling.
    let cases: [(&[usize], &[usize]); 3] = [
        (&[1, 2, 3, 3], &[1, 2, 6, 6]),
        (&[1, 2, 6, 4], &[1, 2, 3, 2]),
        (&[2, 1, 5, 5], &[2, 1, 3, 3]),
    ];
    for (seed, (from, to)) in cases.into_iter().enumerate() {
        for mode in [
            ResizeMode::Nearest(NearestMode::RoundPreferFloor),
            ResizeMode::Linear,
        ] {
            for transform in TRANSFORMS {
                let x = t64(from, &Gen(seed as u64).vec(numel(from), -2.0, 2.0));
                let op = Resize::new(to, mode, transform);
                assert_grad(Box::new(op), &[x], seed as u64);
            }
        }
    }
}

#[test]
fn gradient_graph_in_half_precision() {
    // The gradient runs in the input's dtype; the f16 result is the f64 one rounded.
    for mode in [ResizeMode::Nearest(NearestMode::Floor), ResizeMode::Linear] {
        let op = Resize::new([1, 1, 4, 6], mode, CoordinateTransform::HalfPixel);
        let values = Gen(3).vec(6, -2.0, 2.0);
        let (x16, xv) = stored(DType::F16, &[1, 1, 2, 3], &values);
        let half = graph_gradients(Box::new(op.clone()), &[x16]);
        let full = graph_gradients(Box::new(op), &[t64(&[1, 1, 2, 3], &xv)]);
        assert_eq!(half[0].dtype(), DType::F16);
        check_close(
            "dx",
            DType::F16,
            1.0,
            &half[0].to_f64_vec(),
            &full[0].to_f64_vec(),
        );
    }
}

#[test]
fn cuda_refuses_resize_grad() {
    // No device needed: every node is lowered before anything runs. Resize runs on the
    // GPU; its gradient does not yet.
    let mut g = Graph::new();
    let dy = g.placeholder("dy", DType::F32, [1, 1, 4, 6]).unwrap();
    let op = ResizeGrad::new(
        [1, 1, 2, 3],
        ResizeMode::Linear,
        CoordinateTransform::HalfPixel,
    );
    g.add_node("dx", Box::new(op), &[dy]).unwrap();
    let err = CudaExecutor::check_supported(&g).unwrap_err().to_string();
    assert!(
        err.contains("ResizeLinearGrad has no CUDA kernel for inputs (f32[1, 1, 4, 6])")
            && err.contains("use Device::Cpu"),
        "{err}"
    );
}
