//! Resize in both modes, every coordinate transformation and nearest rounding: the
//! values of onnxruntime 1.32 (one-node ONNX Resize models, float32, `sizes` given)
//! for 2x2 -> 4x4, 4x4 -> 2x2 and 1-D resizes, in every float dtype; trilinear
//! resizing of a multilinear function; ResizeGrad by hand and as Resize's adjoint;
//! errors, the gradient's form, the file forms. (Finite-difference checks of both
//! gradients are in exec/tests/grad_resize.rs.)

mod common;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::ops::{CoordinateTransform, NearestMode, Resize, ResizeGrad, ResizeMode};
use ampgraph_graph::{DType, Graph, Op, Tensor};
use common::*;
use CoordinateTransform::*;
use NearestMode::*;
use ResizeMode::{Linear, Nearest};

type Case = (ResizeMode, CoordinateTransform, &'static [f64]);

/// Resizes `x` (given as f64 values) to `to` in each float dtype and compares with
/// onnxruntime's float32 `want`: within f32's tolerance in f64 too, as onnxruntime
/// computes coordinates and weights in f32.
fn check_cases(what: &str, shape: &[usize], x: &[f64], to: &[usize], cases: &[Case]) {
    for &(mode, coordinates, want) in cases {
        for dtype in FLOATS {
            let (t, _) = input(dtype, shape, x);
            let y = run(&Resize::new(to, mode, coordinates), &[&t]);
            let tol = if dtype == DType::F64 {
                DType::F32
            } else {
                dtype
            };
            let what = format!("{what} {mode:?} {coordinates:?}");
            assert_close(&what, &y, dtype, to, want, tol, 1.0);
        }
    }
}

#[test]
fn upsample_2x2_to_4x4_matches_onnxruntime() {
    #[rustfmt::skip]
    let cases: &[Case] = &[
        (Nearest(RoundPreferFloor), HalfPixel, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(RoundPreferFloor), Asymmetric, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(RoundPreferFloor), AlignCorners, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(RoundPreferFloor), PytorchHalfPixel, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(RoundPreferFloor), TfHalfPixelForNn, &[1.0, 2.0, 2.0, 2.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0]),
        (Linear, HalfPixel, &[1.0, 1.25, 1.75, 2.0, 2.0, 2.5625, 3.6875, 4.25, 4.0, 5.1875, 7.5625, 8.75, 5.0, 6.5, 9.5, 11.0]),
        (Linear, Asymmetric, &[1.0, 1.5, 2.0, 2.0, 3.0, 4.75, 6.5, 6.5, 5.0, 8.0, 11.0, 11.0, 5.0, 8.0, 11.0, 11.0]),
        (Linear, AlignCorners, &[1.0, 1.3333333, 1.6666667, 2.0, 2.3333335, 3.2222223, 4.111111, 5.0, 3.6666667, 5.111111, 6.555556, 8.0, 5.0, 7.0, 9.0, 11.0]),
        (Linear, PytorchHalfPixel, &[1.0, 1.25, 1.75, 2.0, 2.0, 2.5625, 3.6875, 4.25, 4.0, 5.1875, 7.5625, 8.75, 5.0, 6.5, 9.5, 11.0]),
        (Linear, TfHalfPixelForNn, &[2.5625, 3.6875, 4.25, 4.25, 5.1875, 7.5625, 8.75, 8.75, 6.5, 9.5, 11.0, 11.0, 6.5, 9.5, 11.0, 11.0]),
        (Nearest(RoundPreferCeil), HalfPixel, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(RoundPreferCeil), Asymmetric, &[1.0, 2.0, 2.0, 2.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0]),
        (Nearest(RoundPreferCeil), AlignCorners, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(RoundPreferCeil), PytorchHalfPixel, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(RoundPreferCeil), TfHalfPixelForNn, &[1.0, 2.0, 2.0, 2.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0]),
        (Nearest(Floor), HalfPixel, &[1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 5.0, 5.0, 5.0, 11.0]),
        (Nearest(Floor), Asymmetric, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(Floor), AlignCorners, &[1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 5.0, 5.0, 5.0, 11.0]),
        (Nearest(Floor), PytorchHalfPixel, &[1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 5.0, 5.0, 5.0, 11.0]),
        (Nearest(Floor), TfHalfPixelForNn, &[1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 11.0, 11.0, 5.0, 5.0, 11.0, 11.0]),
        (Nearest(Ceil), HalfPixel, &[1.0, 2.0, 2.0, 2.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0]),
        (Nearest(Ceil), Asymmetric, &[1.0, 2.0, 2.0, 2.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0]),
        (Nearest(Ceil), AlignCorners, &[1.0, 2.0, 2.0, 2.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0]),
        (Nearest(Ceil), PytorchHalfPixel, &[1.0, 2.0, 2.0, 2.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0, 5.0, 11.0, 11.0, 11.0]),
        (Nearest(Ceil), TfHalfPixelForNn, &[11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0, 11.0]),
    ];
    check_cases(
        "up",
        &[1, 1, 2, 2],
        &[1., 2., 5., 11.],
        &[1, 1, 4, 4],
        cases,
    );
}

#[test]
fn downsample_4x4_to_2x2_matches_onnxruntime() {
    #[rustfmt::skip]
    let x = [
        -3., -2., 1., -1.,
        -1., 1., -2., -3.,
        -2., 1., -1., -1.,
        1., -2., -3., -2.,
    ];
    #[rustfmt::skip]
    let cases: &[Case] = &[
        (Nearest(RoundPreferFloor), HalfPixel, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(RoundPreferCeil), HalfPixel, &[1.0, -3.0, -2.0, -2.0]),
        (Nearest(Floor), HalfPixel, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(Ceil), HalfPixel, &[1.0, -3.0, -2.0, -2.0]),
        (Nearest(RoundPreferFloor), Asymmetric, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(RoundPreferCeil), Asymmetric, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(Floor), Asymmetric, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(Ceil), Asymmetric, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(RoundPreferFloor), AlignCorners, &[-3.0, -1.0, 1.0, -2.0]),
        (Nearest(RoundPreferCeil), AlignCorners, &[-3.0, -1.0, 1.0, -2.0]),
        (Nearest(Floor), AlignCorners, &[-3.0, -1.0, 1.0, -2.0]),
        (Nearest(Ceil), AlignCorners, &[-3.0, -1.0, 1.0, -2.0]),
        (Nearest(RoundPreferFloor), PytorchHalfPixel, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(RoundPreferCeil), PytorchHalfPixel, &[1.0, -3.0, -2.0, -2.0]),
        (Nearest(Floor), PytorchHalfPixel, &[-3.0, 1.0, -2.0, -1.0]),
        (Nearest(Ceil), PytorchHalfPixel, &[1.0, -3.0, -2.0, -2.0]),
        (Nearest(RoundPreferFloor), TfHalfPixelForNn, &[1.0, -3.0, -2.0, -2.0]),
        (Nearest(RoundPreferCeil), TfHalfPixelForNn, &[1.0, -3.0, -2.0, -2.0]),
        (Nearest(Floor), TfHalfPixelForNn, &[1.0, -3.0, -2.0, -2.0]),
        (Nearest(Ceil), TfHalfPixelForNn, &[1.0, -3.0, -2.0, -2.0]),
        (Linear, HalfPixel, &[-1.25, -1.25, -0.5, -1.75]),
        (Linear, Asymmetric, &[-3.0, 1.0, -2.0, -1.0]),
        (Linear, AlignCorners, &[-3.0, -1.0, 1.0, -2.0]),
        (Linear, PytorchHalfPixel, &[-1.25, -1.25, -0.5, -1.75]),
        (Linear, TfHalfPixelForNn, &[1.0, -3.0, -2.0, -2.0]),
    ];
    check_cases("down", &[1, 1, 4, 4], &x, &[1, 1, 2, 2], cases);
}

#[test]
fn one_axis_matches_onnxruntime() {
    // onnxruntime's linear mode takes no 1-D input: these are its [1, 5] -> [1, n].
    let x = [3., -1., 4., 1.5, 9.];
    #[rustfmt::skip]
    let to3: &[Case] = &[
        (Nearest(RoundPreferFloor), HalfPixel, &[3.0, 4.0, 9.0]),
        (Nearest(RoundPreferFloor), Asymmetric, &[3.0, 4.0, 1.5]),
        (Nearest(RoundPreferFloor), AlignCorners, &[3.0, 4.0, 9.0]),
        (Nearest(RoundPreferFloor), PytorchHalfPixel, &[3.0, 4.0, 9.0]),
        (Nearest(RoundPreferFloor), TfHalfPixelForNn, &[-1.0, 4.0, 9.0]),
        (Linear, HalfPixel, &[1.6666667, 4.0, 6.499999]),
        (Linear, Asymmetric, &[3.0, 2.333333, 3.9999995]),
        (Linear, AlignCorners, &[3.0, 4.0, 9.0]),
        (Linear, PytorchHalfPixel, &[1.6666667, 4.0, 6.499999]),
        (Linear, TfHalfPixelForNn, &[-0.33333325, 2.75, 9.0]),
    ];
    #[rustfmt::skip]
    let to8: &[Case] = &[
        (Nearest(RoundPreferFloor), HalfPixel, &[3.0, 3.0, -1.0, 4.0, 4.0, 1.5, 9.0, 9.0]),
        (Nearest(RoundPreferFloor), Asymmetric, &[3.0, -1.0, -1.0, 4.0, 4.0, 1.5, 9.0, 9.0]),
        (Nearest(RoundPreferFloor), AlignCorners, &[3.0, -1.0, -1.0, 4.0, 4.0, 1.5, 1.5, 9.0]),
        (Nearest(RoundPreferFloor), PytorchHalfPixel, &[3.0, 3.0, -1.0, 4.0, 4.0, 1.5, 9.0, 9.0]),
        (Nearest(RoundPreferFloor), TfHalfPixelForNn, &[3.0, -1.0, 4.0, 4.0, 1.5, 1.5, 9.0, 9.0]),
        (Linear, HalfPixel, &[3.0, 1.25, -0.6875, 2.4375, 3.21875, 1.65625, 5.71875, 9.0]),
        (Linear, Asymmetric, &[3.0, 0.5, 0.25, 3.375, 2.75, 2.4375, 7.125, 9.0]),
        (Linear, AlignCorners, &[3.0, 0.7142856, -0.28571403, 2.5714288, 3.2857141, 1.8571427, 4.714286, 9.0]),
        (Linear, PytorchHalfPixel, &[3.0, 1.25, -0.6875, 2.4375, 3.21875, 1.65625, 5.71875, 9.0]),
        (Linear, TfHalfPixelForNn, &[1.75, -0.75, 1.8125, 3.53125, 1.96875, 4.78125, 9.0, 9.0]),
    ];
    // One output: half-pixel reads the middle; PyTorch's and align-corners read 0.
    #[rustfmt::skip]
    let to1: &[Case] = &[
        (Nearest(RoundPreferFloor), HalfPixel, &[4.0]),
        (Nearest(RoundPreferFloor), Asymmetric, &[3.0]),
        (Nearest(RoundPreferFloor), AlignCorners, &[3.0]),
        (Nearest(RoundPreferFloor), PytorchHalfPixel, &[3.0]),
        (Nearest(RoundPreferFloor), TfHalfPixelForNn, &[4.0]),
        (Linear, HalfPixel, &[4.0]),
        (Linear, Asymmetric, &[3.0]),
        (Linear, AlignCorners, &[3.0]),
        (Linear, PytorchHalfPixel, &[3.0]),
        (Linear, TfHalfPixelForNn, &[2.75]),
    ];
    for (n, cases) in [(3, to3), (8, to8), (1, to1)] {
        check_cases("1-D", &[5], &x, &[n], cases);
    }
}

#[test]
fn only_the_changed_axes_are_resized() {
    // ONNX would resize the unchanged rows too, by a scale of 1, and this transform
    // with ceil shifts them by one (row o reads row o + 1); they are copied instead.
    let (x, _) = input(DType::F32, &[3, 2], &[1., 2., 3., 4., 5., 6.]);
    let y = run(&Resize::new([3, 4], Nearest(Ceil), TfHalfPixelForNn), &[&x]);
    assert_eq!(
        y.to_f64_vec(),
        [2., 2., 2., 2., 4., 4., 4., 4., 6., 6., 6., 6.]
    );
    let y = run(&Resize::new([3, 2], Linear, AlignCorners), &[&x]);
    assert_eq!(y, x);
}

/// A multilinear function of three coordinates, which trilinear resizing reproduces.
fn multilinear(i: f64, j: f64, k: f64) -> f64 {
    1. + 2. * i + 3. * j + 5. * k + 7. * i * j * k
}

#[test]
fn trilinear_reproduces_a_multilinear_function() {
    let corners: Vec<f64> = (0..8)
        .map(|c| multilinear((c >> 2) as f64, ((c >> 1) & 1) as f64, (c & 1) as f64))
        .collect();
    // Each axis's source coordinates, clamped: align-corners 2 -> 3 is o / 2;
    // half-pixel 2 -> 3 is (o + 0.5) * 2/3 - 0.5 and 2 -> 5 is (o + 0.5) * 2/5 - 0.5.
    let half = [0.0, 0.5, 1.0];
    let cases = [
        (
            Resize::new([3, 3, 3], Linear, AlignCorners),
            [half, half, half].map(Vec::from),
        ),
        (
            Resize::new([3, 5, 2], Linear, HalfPixel),
            [
                vec![0.0, 0.5, 1.0],
                vec![0.0, 0.1, 0.5, 0.9, 1.0],
                vec![0.0, 1.0],
            ],
        ),
    ];
    for (op, [ci, cj, ck]) in cases {
        let mut want = Vec::new();
        for &i in &ci {
            for &j in &cj {
                want.extend(ck.iter().map(|&k| multilinear(i, j, k)));
            }
        }
        for dtype in FLOATS {
            let (x, _) = input(dtype, &[2, 2, 2], &corners);
            let y = run(&op, &[&x]);
            assert_close("trilinear", &y, dtype, &op.shape, &want, dtype, 18.0);
        }
    }
}

#[test]
fn linear_mixes_only_what_it_weighs_and_nearest_copies_exactly() {
    // The last output lies on the 1: the infinity beside it has weight 0 and stays out.
    let (x, _) = input(DType::F32, &[2], &[f64::INFINITY, 1.0]);
    let y = run(&Resize::new([3], Linear, AlignCorners), &[&x]);
    assert_eq!(y.to_f64_vec(), [f64::INFINITY, f64::INFINITY, 1.0]);
    // Copies keep -0, NaN and the stored bits of every dtype.
    for dtype in FLOATS {
        let (x, xv) = input(dtype, &[3], &[-0.0, f64::NAN, 0.1]);
        let y = run(&Resize::new([6], Nearest(Floor), Asymmetric), &[&x]);
        let v = y.to_f64_vec();
        assert!(
            v[0] == 0.0 && v[0].is_sign_negative() && v[1].is_sign_negative(),
            "{dtype}"
        );
        assert!(v[2].is_nan() && v[3].is_nan(), "{dtype}");
        assert_eq!(&v[4..], [xv[2], xv[2]], "{dtype}");
    }
}

#[test]
fn empty_results() {
    for (from, to) in [
        (vec![2, 3], vec![2, 0]),
        (vec![0, 3], vec![0, 5]),
        (vec![3, 0], vec![5, 0]),
    ] {
        let (x, _) = input(DType::F32, &from, &[0.0; 6][..from.iter().product()]);
        for mode in [Linear, Nearest(RoundPreferFloor)] {
            let y = run(&Resize::new(to.clone(), mode, HalfPixel), &[&x]);
            assert_eq!(y.shape(), to.as_slice());
            let (dy, _) = input(DType::F32, &to, &[]);
            let dx = run(&ResizeGrad::new(from.clone(), mode, HalfPixel), &[&dy]);
            assert_eq!(dx.to_f64_vec(), vec![0.0; from.iter().product()]);
        }
    }
}

#[test]
fn resize_grad_hand_computed() {
    // (input length, output length, mode, dy, dx)
    type GradCase = (usize, usize, ResizeMode, &'static [f64], &'static [f64]);
    let cases: [GradCase; 4] = [
        // 2 -> 4 linear reads (0: 1), (0: 3/4, 1: 1/4), (0: 1/4, 1: 3/4), (1: 1).
        (2, 4, Linear, &[1., 2., 3., 4.], &[3.25, 6.75]),
        // Nearest reads 0, 0, 1, 1 (the coordinates -1/4, 1/4, 3/4, 5/4).
        (
            2,
            4,
            Nearest(RoundPreferFloor),
            &[1., 2., 3., 4.],
            &[3., 7.],
        ),
        // 4 -> 2 reads the coordinates 1/2 and 5/2: ties, rounded down.
        (
            4,
            2,
            Nearest(RoundPreferFloor),
            &[1., 2.],
            &[1., 0., 2., 0.],
        ),
        (4, 2, Linear, &[1., 2.], &[0.5, 0.5, 1., 1.]),
    ];
    for (n, m, mode, dy, want) in cases {
        for dtype in FLOATS {
            let (g, _) = input(dtype, &[m], dy);
            let dx = run(&ResizeGrad::new([n], mode, HalfPixel), &[&g]);
            assert_eq!(dx.dtype(), dtype);
            assert_eq!(dx.to_f64_vec(), want, "{mode:?} {n} -> {m} {dtype}");
        }
    }
}

/// `sum(a * b)` over two tensors' values.
fn dot(a: &Tensor, b: &Tensor) -> f64 {
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| x * y)
        .sum()
}

#[test]
fn resize_grad_is_the_adjoint_of_resize() {
    // <Resize(x), y> = <x, ResizeGrad(y)> for every mode and transform.
    let shapes: [(&[usize], &[usize]); 5] = [
        (&[2, 3, 4], &[3, 3, 7]),
        (&[5, 4], &[2, 9]),
        (&[1], &[3]),
        (&[3, 1], &[7, 2]),
        (&[6, 5], &[4, 5]),
    ];
    let roundings = [RoundPreferFloor, RoundPreferCeil, Floor, Ceil];
    let modes = roundings.map(Nearest).into_iter().chain([Linear]);
    let transforms = [
        HalfPixel,
        Asymmetric,
        AlignCorners,
        PytorchHalfPixel,
        TfHalfPixelForNn,
    ];
    let mut rng = Rng(7);
    for mode in modes {
        for coordinates in transforms {
            for (from, to) in shapes {
                let x =
                    Tensor::from_f64(DType::F64, from.to_vec(), &rng.vec(from.iter().product()))
                        .unwrap();
                let y = Tensor::from_f64(DType::F64, to.to_vec(), &rng.vec(to.iter().product()))
                    .unwrap();
                let rx = run(&Resize::new(to, mode, coordinates), &[&x]);
                let ry = run(&ResizeGrad::new(from, mode, coordinates), &[&y]);
                let (a, b) = (dot(&rx, &y), dot(&x, &ry));
                assert!(
                    (a - b).abs() <= 1e-12 * a.abs().max(1.0),
                    "{mode:?} {coordinates:?} {from:?} -> {to:?}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn resize_errors() {
    let op = Resize::new([4, 4], Linear, HalfPixel);
    let e = infer_err(&op, &[f32t(&[1, 2, 2])]);
    assert!(
        e.contains("the resized shape [4, 4] has rank 2 but the input [1, 2, 2] has rank 3"),
        "{e}"
    );
    let e = infer_err(&Resize::new([], Linear, HalfPixel), &[f32t(&[])]);
    assert!(e.contains("Resize needs an input of rank 1 or more"), "{e}");
    let e = infer_err(&op, &[f32t(&[0, 4])]);
    assert!(
        e.contains("axis 0 of the input [0, 4] is empty: nothing to resize to 4 elements"),
        "{e}"
    );
    let e = infer_err(
        &Resize::new([usize::MAX, 2], Linear, HalfPixel),
        &[f32t(&[1, 2])],
    );
    assert!(e.contains("has too many elements"), "{e}");
    let e = infer_err(&op, &[tt(DType::I32, &[2, 2])]);
    assert!(e.contains("x must be a float tensor, got i32"), "{e}");
    let e = infer_err(&op, &[f32t(&[2, 2]), f32t(&[2, 2])]);
    assert!(e.contains("expected 1 inputs, got 2"), "{e}");
    // eval refuses what infer does, without panicking.
    let s = Tensor::scalar(DType::F32, 1.0);
    assert!(op.eval(&[&s]).unwrap_err().contains("rank 1 or more"));
    let (i, _) = input(DType::I64, &[2, 2], &[1., 2., 3., 4.]);
    assert!(op.eval(&[&i]).unwrap_err().contains("float"));
    // The gradient checks dy against the input shape it produces.
    let grad = ResizeGrad::new([2, 2], Nearest(Floor), Asymmetric);
    let e = infer_err(&grad, &[f32t(&[4, 4, 1])]);
    assert!(
        e.contains("the resized shape [4, 4, 1] has rank 3 but the input [2, 2] has rank 2"),
        "{e}"
    );
    let e = infer_err(&grad, &[tt(DType::I64, &[4, 4])]);
    assert!(e.contains("dy must be a float tensor, got i64"), "{e}");
    let e = infer_err(&ResizeGrad::new([0], Linear, HalfPixel), &[f32t(&[3])]);
    assert!(e.contains("axis 0 of the input [0] is empty"), "{e}");
}

#[test]
fn modes_from_onnx_names() {
    assert_eq!(ResizeMode::from_names("linear", None), Ok(Linear));
    // nearest_mode only matters for nearest, as in ONNX (exporters write it anyway).
    assert_eq!(ResizeMode::from_names("linear", Some("floor")), Ok(Linear));
    assert_eq!(
        ResizeMode::from_names("nearest", None),
        Ok(Nearest(RoundPreferFloor))
    );
    assert_eq!(
        ResizeMode::from_names("nearest", Some("round_prefer_ceil")),
        Ok(Nearest(RoundPreferCeil))
    );
    let e = ResizeMode::from_names("cubic", None).unwrap_err();
    assert!(
        e.contains("Resize mode 'cubic' is not supported: only nearest and linear"),
        "{e}"
    );
    let e = ResizeMode::from_names("bilinear", None).unwrap_err();
    assert!(
        e.contains("unknown Resize mode 'bilinear': must be nearest or linear"),
        "{e}"
    );
    let e = ResizeMode::from_names("nearest", Some("round")).unwrap_err();
    assert!(
        e.contains(
            "attr 'nearest_mode' must be one of round_prefer_floor round_prefer_ceil floor \
             ceil, got 'round'"
        ),
        "{e}"
    );
    for t in [
        HalfPixel,
        Asymmetric,
        AlignCorners,
        PytorchHalfPixel,
        TfHalfPixelForNn,
    ] {
        assert_eq!(CoordinateTransform::from_name(t.name()), Ok(t));
    }
    let e = CoordinateTransform::from_name("tf_crop_and_resize").unwrap_err();
    assert!(
        e.contains("attr 'coordinate_transformation_mode' must be one of half_pixel"),
        "{e}"
    );
}

#[test]
fn gradient_forms() {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F16, [1, 1, 2, 2]).unwrap();
    let y = g.resize(x, &[1, 1, 4, 4], Linear, AlignCorners).unwrap();
    assert_eq!(g.ty(y), &tt(DType::F16, &[1, 1, 4, 4]));
    let loss = g.sum(y, None, false).unwrap();
    let dx = gradients(&mut g, loss, &[x]).unwrap()[0];
    g.validate().unwrap();
    assert_eq!(g.ty(dx), g.ty(x));
    let op = g.node(dx.node).op.clone();
    assert_eq!(op.name(), "ResizeLinearGrad");
    assert_eq!(
        op.downcast_ref::<ResizeGrad>(),
        Some(&ResizeGrad::new([1, 1, 2, 2], Linear, AlignCorners))
    );
    // ResizeGrad is linear in dy: its gradient resizes back to dy's shape.
    let mut g = Graph::new();
    let dy = g.placeholder("dy", DType::F32, [5, 3]).unwrap();
    let grad = ResizeGrad::new([2, 3], Nearest(Ceil), PytorchHalfPixel);
    let dx = g.add(grad, &[dy]).unwrap();
    let loss = g.sum(dx, None, false).unwrap();
    let ddy = gradients(&mut g, loss, &[dy]).unwrap()[0];
    assert_eq!(
        g.node(ddy.node).op.downcast_ref::<Resize>(),
        Some(&Resize::new([5, 3], Nearest(Ceil), PytorchHalfPixel))
    );
}

#[test]
fn file_forms() {
    let shape = ("shape", AttrValue::Ints(vec![1, 3, 8, 8]));
    let op = parse(
        "ResizeNearest",
        &[
            shape.clone(),
            ("coordinate_transformation_mode", "asymmetric".into()),
            ("nearest_mode", "floor".into()),
        ],
    )
    .unwrap();
    assert_eq!(
        op.downcast_ref::<Resize>(),
        Some(&Resize::new([1, 3, 8, 8], Nearest(Floor), Asymmetric))
    );
    // The defaults: half-pixel, rounding halves down.
    let op = parse("ResizeNearest", std::slice::from_ref(&shape)).unwrap();
    let want = Resize::new([1, 3, 8, 8], Nearest(RoundPreferFloor), HalfPixel);
    assert_eq!(op.downcast_ref::<Resize>(), Some(&want));
    let op = parse("ResizeLinear", std::slice::from_ref(&shape)).unwrap();
    let want = Resize::new([1, 3, 8, 8], Linear, HalfPixel);
    assert_eq!(op.downcast_ref::<Resize>(), Some(&want));
    assert_eq!(
        op.attrs(),
        [
            shape.clone(),
            ("coordinate_transformation_mode", "half_pixel".into())
        ]
    );
    // Each op, written and read back (as attrs and in a JSON graph).
    let x = f32t(&[1, 3, 4, 4]);
    let dy = f32t(&[1, 3, 8, 8]);
    for mode in [Nearest(RoundPreferCeil), Linear] {
        for t in [AlignCorners, TfHalfPixelForNn] {
            let op = Resize::new([1, 3, 8, 8], mode, t);
            assert_round_trip(&op);
            assert_json_round_trip(Box::new(op), std::slice::from_ref(&x));
            let grad = ResizeGrad::new([1, 3, 4, 4], mode, t);
            assert_round_trip(&grad);
            assert_json_round_trip(Box::new(grad), std::slice::from_ref(&dy));
        }
    }
    let names = |mode| {
        let op = Resize::new([2], mode, HalfPixel);
        let grad = ResizeGrad::new([2], mode, HalfPixel);
        [op.name(), grad.name()]
    };
    assert_eq!(names(Nearest(Ceil)), ["ResizeNearest", "ResizeNearestGrad"]);
    assert_eq!(names(Linear), ["ResizeLinear", "ResizeLinearGrad"]);
    // Errors.
    let e = parse("ResizeLinear", &[]).unwrap_err();
    assert!(e.contains("missing attr 'shape'"), "{e}");
    let e = parse(
        "ResizeLinear",
        &[shape.clone(), ("nearest_mode", "floor".into())],
    )
    .unwrap_err();
    assert!(e.contains("unknown attr 'nearest_mode'"), "{e}");
    let e = parse(
        "ResizeNearestGrad",
        &[
            shape.clone(),
            ("coordinate_transformation_mode", "half".into()),
        ],
    )
    .unwrap_err();
    assert!(
        e.contains("attr 'coordinate_transformation_mode' must be one of half_pixel asymmetric"),
        "{e}"
    );
    let e = parse(
        "ResizeNearest",
        &[shape, ("nearest_mode", AttrValue::Int(1))],
    )
    .unwrap_err();
    assert!(e.contains("attr 'nearest_mode' must be a string"), "{e}");
    // The mode is in the name: there is no plain Resize.
    let e = parse("Resize", &[]).unwrap_err();
    assert!(e.contains("unknown op 'Resize'"), "{e}");
}
