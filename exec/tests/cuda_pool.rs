//! The pooling kernels (MaxPool, AvgPool, MaxPoolGrad, AvgPoolGrad) against the CPU
//! reference in f32, f16, bf16 and f64, NHWC and NCHW. The kernels add in the CPU
//! kernels' order and round as they do (f32 for the 16-bit types, once on store), so
//! every output must be the CPU's exactly, NaN matching NaN, the 16-bit gradients
//! included (each compared with the CPU run in the same dtype). The GPU tests skip
//! (printing why) without CUDA; `every_case_lowers` runs anywhere.

mod common;

use ampgraph_exec::CudaExecutor;
use ampgraph_graph::ops::{AvgPool, AvgPoolGrad, DataFormat, MaxPool, MaxPoolGrad, Padding};
use ampgraph_graph::{DType, Op, Tensor};
use common::{gpu, op_graph, run_both_boxed, Gen, FLOATS};

const FORMATS: [DataFormat; 2] = [DataFormat::Nhwc, DataFormat::Nchw];

/// A pooling: the input's (batch, rows, columns, channels), the window, the strides.
struct Case {
    image: [usize; 4],
    ksize: [usize; 2],
    strides: [usize; 2],
    padding: Padding,
}

const fn case(image: [usize; 4], ksize: [usize; 2], strides: [usize; 2], padding: Padding) -> Case {
    Case {
        image,
        ksize,
        strides,
        padding,
    }
}

/// Strides 1, 2 and 3; windows equal to the stride, larger (overlapping) and smaller
/// (input elements no window covers); SAME windows past the image on both sides and
/// wider than it; explicit pads (PyTorch's `padding=1`, more after than before and
/// before than after, one below the window); odd sizes; channels 1, 3, 5 and 17, and
/// 2, 12, 16 and 64 (an NHWC thread takes a vector of channels: 2, 4 or all of a
/// 16-byte vector, by dtype); batch 1; windows of 272 elements (MaxPoolGrad's kernel
/// for windows whose maximum's place does not fit a byte), of 3 and 16 channels.
const CASES: [Case; 17] = [
    case([1, 5, 7, 3], [2, 2], [2, 2], Padding::Valid),
    case([2, 9, 8, 5], [3, 3], [2, 2], Padding::Same),
    case([1, 6, 6, 1], [3, 3], [1, 1], Padding::Same),
    case([3, 7, 11, 17], [3, 2], [3, 1], Padding::Valid),
    case([2, 10, 9, 3], [5, 4], [3, 2], Padding::Same),
    case([1, 4, 5, 5], [1, 1], [2, 3], Padding::Same),
    case([1, 3, 3, 2], [5, 5], [1, 1], Padding::Same),
    case([2, 8, 7, 17], [2, 3], [2, 2], Padding::Same),
    case([1, 1, 9, 3], [1, 3], [1, 3], Padding::Valid),
    case(
        [1, 4, 4, 3],
        [3, 3],
        [2, 2],
        Padding::Explicit([[1, 1], [1, 1]]),
    ),
    case(
        [2, 7, 6, 5],
        [3, 2],
        [2, 1],
        Padding::Explicit([[0, 2], [1, 0]]),
    ),
    case(
        [1, 5, 9, 17],
        [4, 3],
        [3, 2],
        Padding::Explicit([[3, 1], [2, 2]]),
    ),
    case([1, 20, 19, 3], [16, 17], [3, 2], Padding::Same),
    case(
        [2, 9, 8, 64],
        [3, 3],
        [2, 2],
        Padding::Explicit([[1, 1], [1, 1]]),
    ),
    case([1, 7, 6, 12], [2, 2], [1, 1], Padding::Same),
    case([2, 5, 6, 16], [3, 2], [2, 1], Padding::Valid),
    case([1, 18, 17, 16], [16, 17], [3, 2], Padding::Same),
];

impl Case {
    fn shape(&self, f: DataFormat) -> Vec<usize> {
        let [n, h, w, c] = self.image;
        match f {
            DataFormat::Nhwc => vec![n, h, w, c],
            DataFormat::Nchw => vec![n, c, h, w],
        }
    }
}

/// What an input holds.
#[derive(Clone, Copy, Debug)]
enum Values {
    /// Uniform in [-2, 2].
    Uniform,
    /// Five values: ties in most windows, so the first maximum matters.
    Quantised,
    /// Quantised, with NaNs (an eighth) and infinities of both signs.
    NonFinite,
}

impl Values {
    fn sample(self, gen: &mut Gen, n: usize) -> Vec<f64> {
        (0..n)
            .map(|_| match self {
                Values::Uniform => gen.uniform(-2.0, 2.0),
                Values::Quantised => quantised(gen),
                Values::NonFinite => match gen.below(16) {
                    0 | 1 => f64::NAN,
                    2 => f64::NEG_INFINITY,
                    3 => f64::INFINITY,
                    _ => quantised(gen),
                },
            })
            .collect()
    }
}

fn quantised(gen: &mut Gen) -> f64 {
    (gen.below(5) as f64 - 2.0) * 0.5
}

/// The four pooling ops of case `c` in layout `f` over `x`, each with its inputs:
/// MaxPoolGrad's `y` is the CPU's MaxPool of `x` (the op checks its type only), both
/// gradients take the same random `dy`.
fn pooling_runs(
    c: &Case,
    f: DataFormat,
    x: &Tensor,
    gen: &mut Gen,
) -> Vec<(Box<dyn Op>, Vec<Tensor>)> {
    let (ksize, strides, padding) = (c.ksize, c.strides, c.padding);
    let max_pool = MaxPool::new(ksize, strides, padding, f);
    let y = max_pool.eval(&[x]).expect("MaxPool on the CPU").remove(0);
    let dy = gen.vec(y.len(), -1.0, 1.0);
    let dy = Tensor::from_f64(x.dtype(), y.shape().to_vec(), &dy).unwrap();
    let avg_pool_grad = AvgPoolGrad {
        input_shape: x.shape().to_vec(),
        ksize,
        strides,
        padding,
        data_format: f,
    };
    vec![
        (Box::new(max_pool), vec![x.clone()]),
        (
            Box::new(AvgPool::new(ksize, strides, padding, f)),
            vec![x.clone()],
        ),
        (
            Box::new(MaxPoolGrad::new(ksize, strides, padding, f)),
            vec![x.clone(), y, dy.clone()],
        ),
        (Box::new(avg_pool_grad), vec![dy]),
    ]
}

/// The GPU's outputs are the CPU's exactly, NaN matching NaN.
fn assert_same(what: &str, gpu: &[Tensor], cpu: &[Tensor]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: output count");
    for (g, c) in gpu.iter().zip(cpu) {
        assert_eq!(g.ty(), c.ty(), "{what}: types differ");
        let (g, c) = (g.to_f64_vec(), c.to_f64_vec());
        let differ: Vec<usize> = (0..g.len())
            .filter(|&i| g[i] != c[i] && !(g[i].is_nan() && c[i].is_nan()))
            .collect();
        if let Some(&i) = differ.first() {
            panic!(
                "{what}: {} of {} elements differ; the first, {i}: gpu {} vs cpu {}",
                differ.len(),
                g.len(),
                g[i],
                c[i]
            );
        }
    }
}

/// Every op of case `c` in layout `f` and dtype `d` over an input of `values`, on
/// both executors.
fn check_case(
    gpu: &mut CudaExecutor,
    c: &Case,
    f: DataFormat,
    d: DType,
    values: Values,
    gen: &mut Gen,
) {
    let shape = c.shape(f);
    let x = values.sample(gen, shape.iter().product());
    let x = Tensor::from_f64(d, shape.clone(), &x).unwrap();
    for (op, inputs) in pooling_runs(c, f, &x, gen) {
        let what = format!(
            "{} {d} {f:?} x{shape:?} ksize {:?} strides {:?} {:?} {values:?}",
            op.name(),
            c.ksize,
            c.strides,
            c.padding
        );
        let (dev, cpu) = run_both_boxed(gpu, &what, op, &inputs);
        assert_same(&what, &dev, &cpu);
    }
}

#[test]
fn every_case_lowers() {
    // No device needed: the lowering checks the shapes and picks the kernels.
    let mut gen = Gen(1);
    for c in &CASES {
        for f in FORMATS {
            for d in FLOATS {
                let x = Tensor::zeros(&ampgraph_graph::TensorType::new(d, c.shape(f)));
                for (op, inputs) in pooling_runs(c, f, &x, &mut gen) {
                    let what = format!("{} {d} {f:?} {:?}", op.name(), c.image);
                    let (g, _, _) = op_graph(op, &inputs);
                    CudaExecutor::check_supported(&g).unwrap_or_else(|e| panic!("{what}: {e}"));
                }
            }
        }
    }
}

#[test]
fn small_images_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut gen = Gen(2);
    for c in &CASES {
        for f in FORMATS {
            for d in FLOATS {
                for values in [Values::Uniform, Values::Quantised] {
                    check_case(&mut gpu, c, f, d, values, &mut gen);
                }
            }
        }
    }
}

#[test]
fn nans_and_infinities_match_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut gen = Gen(3);
    for c in &CASES {
        for f in FORMATS {
            for d in FLOATS {
                check_case(&mut gpu, c, f, d, Values::NonFinite, &mut gen);
            }
        }
    }
}

#[test]
fn a_large_batch_matches_the_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut gen = Gen(4);
    let c = case([8, 65, 65, 24], [3, 3], [2, 2], Padding::Same);
    for f in FORMATS {
        for d in FLOATS {
            for values in [Values::Uniform, Values::Quantised] {
                check_case(&mut gpu, &c, f, d, values, &mut gen);
            }
        }
    }
}

/// Worked by hand, not by the CPU kernel: each 2x2 window's gradient goes to its first
/// maximum in row-major order, a NaN being the maximum.
#[test]
fn the_first_maximum_takes_the_gradient() {
    let Some(mut gpu) = gpu() else { return };
    let nan = f64::NAN;
    // Windows {3, 3 / 3, 0} and {1, NaN / NaN, NaN}.
    let x = [3.0, 3.0, 1.0, nan, 3.0, 0.0, nan, nan];
    let dy = [0.5, -2.0];
    let dx = [0.5, 0.0, 0.0, -2.0, 0.0, 0.0, 0.0, 0.0];
    for (f, shape, pooled) in [
        (DataFormat::Nhwc, [1, 2, 4, 1], [1, 1, 2, 1]),
        (DataFormat::Nchw, [1, 1, 2, 4], [1, 1, 1, 2]),
    ] {
        for d in FLOATS {
            let tensor =
                |shape: &[usize], v: &[f64]| Tensor::from_f64(d, shape.to_vec(), v).unwrap();
            let (x, dy) = (tensor(&shape, &x), tensor(&pooled, &dy));
            let op = MaxPool::new([2, 2], [2, 2], Padding::Valid, f);
            let (y, _) =
                run_both_boxed(&mut gpu, "MaxPool", Box::new(op), std::slice::from_ref(&x));
            let y = y[0].to_f64_vec();
            assert!(y[0] == 3.0 && y[1].is_nan(), "MaxPool {d} {f:?}: {y:?}");
            let op = MaxPoolGrad::new([2, 2], [2, 2], Padding::Valid, f);
            let y = tensor(&pooled, &[3.0, nan]);
            let (got, _) = run_both_boxed(&mut gpu, "MaxPoolGrad", Box::new(op), &[x, y, dy]);
            assert_eq!(got[0].to_f64_vec(), dx, "MaxPoolGrad {d} {f:?}");
        }
    }
}
