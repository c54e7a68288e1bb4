//! What the CUDA executor keeps between steps: casts of weights no step writes (and
//! which copies of such a weight stay on the device, from the first step's arena on), the casts optimizer updates
//! write with their variable, the scratch of convolutions planned in the arena (their
//! workspaces within the plan's peak), convolutions replayed from captured graphs,
//! FP8 amaxes zeroed at the step's start, and which ops a profiled step times. Skips (printing why) without CUDA.

mod common;

use ampgraph_exec::cuda::CudaExecutor;
use ampgraph_exec::{
    memory_plan, CpuExecutor, DeviceStats, ExecError, ExecOptions, Executor, Feeds,
};
use ampgraph_graph::ops::{
    AssignVariable, BatchMatMul, Cast, Const, Conv2D, Conv2DBackpropFilter, DataFormat,
    OptimizerUpdate, Padding, QuantizeFp8, Rule, Unary, UnaryKind, Variable,
};
use ampgraph_graph::{DType, Graph, Port, Tensor, TensorType};
use common::{gpu, wide_sum, wide_sum_feeds, Gen};

const N: usize = 512;

/// x[8, N] (f16) times the f16 cast of the f32 variable w[N, N]: an inference
/// layer after AMP.
fn layer() -> (Graph, Port, Port) {
    let mut g = Graph::new();
    let w_ty = TensorType::new(DType::F32, vec![N, N]);
    let w = g.add_node("w", Box::new(Variable::new(w_ty)), &[]).unwrap();
    let w16 = g.add(Cast { to: DType::F16 }, &[w.into()]).unwrap();
    let x = g.placeholder("x", DType::F16, vec![8, N]).unwrap();
    let y = g.add(BatchMatMul::default(), &[x, w16]).unwrap();
    (g, w.into(), y)
}

fn weights(scale: f64) -> Tensor {
    let v: Vec<f64> = Gen(7)
        .vec(N * N, -0.1, 0.1)
        .iter()
        .map(|x| x * scale)
        .collect();
    Tensor::from_f64(DType::F32, vec![N, N], &v).unwrap()
}

fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// After the first run the executor keeps w's f16 cast and, the host copy being
/// current, drops w's f32 copy from the device; a graph that reads w itself uploads
/// it again; setting w drops the kept cast, so the next run uses the new weights.
#[test]
fn weights_read_only_through_casts_leave_the_device() {
    let Some(mut gpu) = gpu() else { return };
    let (g, w, y) = layer();
    let mut feeds = Feeds::new();
    let x = Gen(3).vec(8 * N, -1.0, 1.0);
    feeds.insert(
        "x".into(),
        Tensor::from_f64(DType::F16, vec![8, N], &x).unwrap(),
    );
    let mut cpu = CpuExecutor::new();
    cpu.variables.insert("w".into(), weights(1.0));
    gpu.set_variable("w", weights(1.0)).unwrap();
    let with_f32_weights = gpu.live_bytes();
    let expected = cpu.run(&g, &feeds, &[y]).unwrap();
    let first = gpu.run(&g, &feeds, &[y]).unwrap();
    let second = gpu.run(&g, &feeds, &[y]).unwrap();
    assert!(max_rel_diff(&first[0], &expected[0]) < 2e-3);
    assert_eq!(first, second, "the kept cast gives the same product");
    // w's 1 MiB in f32 left, its 0.5 MiB f16 cast stays; the arena is a few KiB.
    let (f32_bytes, f16_bytes) = (N * N * 4, N * N * 2);
    let live = gpu.live_bytes();
    assert!(
        live + f32_bytes - f16_bytes <= with_f32_weights + 64 * 1024,
        "live {live} bytes, {with_f32_weights} before the first run"
    );
    // The host copy answers; a graph that reads w in f32 gets it back on the device.
    assert_eq!(gpu.variable("w").unwrap(), &weights(1.0));
    let fetched = gpu.run(&g, &Feeds::new(), &[w]).unwrap();
    assert_eq!(fetched[0], weights(1.0));
    // New weights: the kept cast goes, the next run casts again.
    gpu.set_variable("w", weights(2.0)).unwrap();
    cpu.variables.insert("w".into(), weights(2.0));
    let changed = gpu.run(&g, &feeds, &[y]).unwrap();
    let expected = cpu.run(&g, &feeds, &[y]).unwrap();
    assert!(max_rel_diff(&changed[0], &expected[0]) < 2e-3);
    assert!(
        max_rel_diff(&changed[0], &first[0]) > 0.5,
        "the new weights were used"
    );
}

/// The first step of an inference graph casts the weights only casts read before it
/// takes its arena, and drops their f32 copies there: the 16 MiB f32 weight is never
/// held beside the step's 24 MiB of tensors, and the step's measured peak is the
/// host's plan, which counts it so.
#[test]
fn a_first_step_drops_weights_read_only_through_casts_before_its_arena() {
    let Some(mut gpu) = gpu() else { return };
    let n = 4 << 20;
    let mut g = Graph::new();
    let ty = TensorType::new(DType::F32, vec![n]);
    let w = g.add_node("w", Box::new(Variable::new(ty)), &[]).unwrap();
    let w16 = g.add(Cast { to: DType::F16 }, &[w.into()]).unwrap();
    let relu = |g: &mut Graph, x| g.add(Unary::new(UnaryKind::Relu), &[x]).unwrap();
    let y1 = relu(&mut g, w16);
    let y2 = relu(&mut g, y1);
    let y3 = relu(&mut g, y2);
    let fetches = [y1, y2, y3];
    let plan = memory_plan::step_footprint(&g, &fetches, &Default::default()).unwrap();
    let (f32_bytes, f16_bytes) = (n * 4, n * 2);
    assert_eq!(plan.cast_only_bytes, f32_bytes);
    assert!(plan.peak_bytes() < plan.plan.arena_bytes + f32_bytes + f16_bytes);
    let value = Tensor::from_f64(DType::F32, vec![n], &Gen(11).vec(n, -1.0, 1.0)).unwrap();
    let mut cpu = CpuExecutor::new();
    cpu.variables.insert("w".into(), value.clone());
    let held = gpu.live_bytes();
    gpu.set_variable("w", value).unwrap();
    gpu.reset_peak_bytes();
    let got = gpu.run(&g, &Feeds::new(), &fetches).unwrap();
    assert_eq!(got, cpu.run(&g, &Feeds::new(), &fetches).unwrap());
    let step_peak = gpu.peak_bytes() - held;
    assert!(
        step_peak <= plan.peak_bytes(),
        "the first step's measured peak {step_peak} bytes, planned {}",
        plan.peak_bytes()
    );
}

/// [`layer`] with an SGD step of `w` by the fed `grad`, which writes w's f16 cast too:
/// the graph, its feeds and its outputs (the product and the assignment).
fn layer_and_update() -> (Graph, Feeds, [Port; 2]) {
    let (mut g, w, y) = layer();
    let grad = g.placeholder("grad", DType::F32, vec![N, N]).unwrap();
    let yes = g
        .add(Const::new(Tensor::scalar(DType::Bool, 1.0)), &[])
        .unwrap();
    let sgd = OptimizerUpdate {
        cast_to: Some(DType::F16),
        ..OptimizerUpdate::new(Rule::PLAIN_SGD, 0.5, 0.0)
    };
    let new = g.add(sgd, &[yes, w, grad]).unwrap();
    let assign = g.add(AssignVariable, &[w, new]).unwrap();
    let mut feeds = Feeds::new();
    let x = Gen(3).vec(8 * N, -1.0, 1.0);
    feeds.insert(
        "x".into(),
        Tensor::from_f64(DType::F16, vec![8, N], &x).unwrap(),
    );
    let step = Gen(5).vec(N * N, -0.1, 0.1);
    feeds.insert(
        "grad".into(),
        Tensor::from_f64(DType::F32, vec![N, N], &step).unwrap(),
    );
    (g, feeds, [y, assign])
}

/// A training step whose update also writes w's f16 copy (`cast_to`): from the
/// second step the forward pass's Cast kernel no longer runs, and each step's product
/// uses the weights the previous update wrote, as on the CPU.
#[test]
fn updates_that_write_the_cast_replace_the_cast_kernel() {
    let Some(mut gpu) = gpu() else { return };
    let (g, feeds, [y, assign]) = layer_and_update();
    let mut cpu = CpuExecutor::new();
    cpu.variables.insert("w".into(), weights(1.0));
    gpu.set_variable("w", weights(1.0)).unwrap();
    let mut kernels = Vec::new();
    for k in 0..4 {
        if k == 2 {
            // Set from outside: the kept cast goes and the Cast kernel runs again.
            cpu.variables.insert("w".into(), weights(2.0));
            gpu.set_variable("w", weights(2.0)).unwrap();
        }
        let before = gpu.launches();
        let got = gpu.run(&g, &feeds, &[y, assign]).unwrap();
        kernels.push((gpu.launches() - before).kernels);
        let want = cpu.run(&g, &feeds, &[y, assign]).unwrap();
        assert!(max_rel_diff(&got[0], &want[0]) < 2e-3, "step {k}");
        assert!(
            max_rel_diff(&got[1], &want[1]) < 1e-6,
            "step {k}: the update"
        );
    }
    assert_eq!(kernels[1] + 1, kernels[0], "{kernels:?}");
    assert_eq!(kernels[2], kernels[0], "{kernels:?}");
    assert_eq!(kernels[3], kernels[1], "{kernels:?}");
}

/// A profiled step times the ops that put work on the stream (the product, the
/// update), not the assignment the update wrote in place, which launches nothing.
#[test]
fn a_profiled_step_times_only_the_ops_that_launch_work() {
    let Some(mut gpu) = gpu() else { return };
    let (g, feeds, outputs) = layer_and_update();
    gpu.set_variable("w", weights(1.0)).unwrap();
    for _ in 0..2 {
        gpu.run(&g, &feeds, &outputs).unwrap();
    }
    let plain = gpu.options();
    gpu.set_options(ExecOptions {
        profile: true,
        ..plain
    });
    for _ in 0..2 {
        gpu.run(&g, &feeds, &outputs).unwrap();
    }
    let table = gpu.stats().unwrap().profile_table(30);
    assert!(
        table.contains("BatchMatMul") && table.contains("OptimizerUpdate"),
        "{table}"
    );
    assert!(!table.contains("AssignVariable"), "{table}");
}

/// The amaxes FP8 casts fold their values into start each step at zero: after the
/// first step the executor plans them at the arena's start and zeroes them with one
/// memset (the first step zeroes each apart), and every step's amax is its own input's,
/// though each step's input is half the one before (a leftover would keep the first).
#[test]
fn fp8_amaxes_are_zeroed_by_one_memset_from_the_second_step() {
    let Some(mut gpu) = gpu() else { return };
    let (rows, cols) = (64, 128);
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, vec![rows, cols]).unwrap();
    let scale = g.scalar(DType::F32, 4.0).unwrap();
    let relu = g.add(Unary::new(UnaryKind::Relu), &[x]).unwrap();
    let cast = QuantizeFp8::new(DType::F8E4M3).unwrap();
    let q = g
        .add_node("q", Box::new(cast.clone()), &[x, scale])
        .unwrap();
    let transposed = cast.with_transposed(true);
    let r = g
        .add_node("r", Box::new(transposed), &[relu, scale])
        .unwrap();
    let fetches = [Port::new(q, 1), Port::new(r, 1), Port::new(r, 0)];
    let base = Gen(11).vec(rows * cols, -3.0, 2.0);
    let mut memsets = Vec::new();
    for k in 0..5 {
        let values: Vec<f64> = base.iter().map(|v| v * 0.5f64.powi(k)).collect();
        let x_k = Tensor::from_f64(DType::F32, vec![rows, cols], &values).unwrap();
        let (abs_max, max) = x_k
            .to_f64_vec()
            .iter()
            .fold((0f64, 0f64), |(a, m), &v| (a.max(v.abs()), m.max(v)));
        let feeds: Feeds = [("x".to_string(), x_k)].into_iter().collect();
        let before = gpu.launches();
        let got = gpu.run(&g, &feeds, &fetches).unwrap();
        memsets.push((gpu.launches() - before).memsets);
        assert_eq!(got[0].to_f64_vec(), [abs_max], "step {k}: |x|'s amax");
        assert_eq!(got[1].to_f64_vec(), [max], "step {k}: relu(x)'s amax");
    }
    assert_eq!(memsets[..2], [2, 1], "{memsets:?}");
}

/// An f16 NHWC convolution (3x3 filters, SAME) of the fed `x` by the fed `f` and its
/// filter gradient, each operand first through `pre` where given (its output then lies
/// in the step's arena rather than in a feed's buffer).
struct ConvAndFilterGradient {
    graph: Graph,
    outputs: [Port; 2],
    shapes: [Vec<usize>; 2],
}

impl ConvAndFilterGradient {
    fn new(x: [usize; 4], cout: usize, stride: usize, pre: Option<Unary>) -> Self {
        let shapes = [x.to_vec(), vec![3, 3, x[3], cout]];
        let mut g = Graph::new();
        let mut operand = |name: &str, shape: &[usize]| {
            let p = g.placeholder(name, DType::F16, shape.to_vec()).unwrap();
            match &pre {
                Some(op) => g.add(op.clone(), &[p]).unwrap(),
                None => p,
            }
        };
        let (x, f) = (operand("x", &shapes[0]), operand("f", &shapes[1]));
        let strides = [stride, stride];
        let y = g
            .conv2d(x, f, strides, Padding::Same, DataFormat::Nhwc)
            .unwrap();
        let df = Conv2DBackpropFilter {
            filter_shape: shapes[1].clone(),
            conv: Conv2D::new(strides, Padding::Same, DataFormat::Nhwc),
        };
        let df = g.add(df, &[x, y]).unwrap();
        ConvAndFilterGradient {
            graph: g,
            outputs: [y, df],
            shapes,
        }
    }

    /// New random values of `x` and `f` in [-1, 1].
    fn feeds(&self, r: &mut Gen) -> Feeds {
        let mut feeds = Feeds::new();
        for (name, shape) in ["x", "f"].into_iter().zip(&self.shapes) {
            let v = r.vec(shape.iter().product(), -1.0, 1.0);
            let t = Tensor::from_f64(DType::F16, shape.clone(), &v).unwrap();
            feeds.insert(name.into(), t);
        }
        feeds
    }
}

/// A convolution and its filter gradient: the first step takes the filters' gathered
/// copies and cuDNN's workspace where it can (the workspace shared by every
/// convolution); the executor then plans them in the arena as each node's scratch and
/// frees the shared workspace, and the next steps compute the same values from there.
#[test]
fn convolution_scratch_is_planned_in_the_arena_after_the_first_step() {
    let Some(mut gpu) = gpu() else { return };
    let conv = ConvAndFilterGradient::new([8, 16, 16, 32], 32, 1, None);
    let (g, [y, df]) = (&conv.graph, conv.outputs);
    let feeds = conv.feeds(&mut Gen(5));
    let expected = CpuExecutor::new().run(g, &feeds, &[y, df]).unwrap();
    let scratch_bytes = |gpu: &CudaExecutor| gpu.planned_scratch().values().sum::<usize>();
    assert_eq!(scratch_bytes(&gpu), 0);
    let first = gpu.run(g, &feeds, &[y, df]).unwrap();
    let filters = 2 * 3 * 3 * 32 * 32 * 2;
    let planned = scratch_bytes(&gpu);
    assert!(planned >= filters, "{planned} bytes of scratch planned");
    assert_eq!(gpu.shared_conv_workspace_bytes(), 0);
    let second = gpu.run(g, &feeds, &[y, df]).unwrap();
    assert_eq!(scratch_bytes(&gpu), planned, "no step takes more");
    for (k, want) in expected.iter().enumerate() {
        assert!(max_rel_diff(&first[k], want) < 2e-2, "output {k}");
        assert!(max_rel_diff(&second[k], want) < 2e-2, "output {k}");
    }
}

/// Convolutions whose operands lie in the arena (here behind a Neg each) run on the
/// same buffers every step: from the third step on each cuDNN call is a replay of the
/// graph captured in an earlier one (or, for an algorithm cuDNN cannot run under a
/// capture, a direct call counted as such), and every step still computes its own
/// feeds' values (new ones each step), as the CPU does.
#[test]
fn convolutions_on_the_same_buffers_are_replayed_with_each_steps_values() {
    let Some(mut gpu) = gpu() else { return };
    // Each call on its own: a whole step's graph would hold the convolutions.
    gpu.options.op_by_op = true;
    let neg = Unary::new(UnaryKind::Neg);
    let conv = ConvAndFilterGradient::new([4, 12, 12, 16], 24, 2, Some(neg));
    let (g, [y, df]) = (&conv.graph, conv.outputs);
    let mut r = Gen(11);
    let mut counts = Vec::new();
    for step in 0..6 {
        let feeds = conv.feeds(&mut r);
        let expected = CpuExecutor::new().run(g, &feeds, &[y, df]).unwrap();
        let got = gpu.run(g, &feeds, &[y, df]).unwrap();
        for (k, want) in expected.iter().enumerate() {
            let diff = max_rel_diff(&got[k], want);
            assert!(diff < 2e-2, "step {step} output {k}: {diff}");
        }
        counts.push(gpu.launches());
    }
    // Step 1 plans the scratch (the arena moves), step 2 sees the final buffers,
    // step 3 captures, and each later step replays both convolutions, or runs one
    // directly where the algorithm the search chose (timings differ on a loaded GPU)
    // cannot be captured; at least one of the two here always captures.
    for step in [4, 5] {
        let d = counts[step] - counts[step - 1];
        let what = format!(
            "step {step}: {} replays, {} run directly",
            d.dnn_replays, d.dnn_uncaptured
        );
        assert_eq!(d.dnn_replays + d.dnn_uncaptured, 2, "{what}");
        assert!(d.dnn_replays >= 1, "{what}");
    }
}

/// f32 convolutions of [32, 128, 32, 32], for which cuDNN's fastest algorithms
/// (Winograd, FFT) take workspaces several times the tensors: each keeps its workspace
/// near the arena's bytes free while it runs, so the step's measured peak is the
/// host's plan (within the small workspace any algorithm may take), values as the CPU.
#[test]
fn convolution_workspaces_keep_to_the_steps_planned_peak() {
    let Some(mut gpu) = gpu() else { return };
    // A search within 128 MiB: Winograd (74 MiB) runs, FFT (660 MiB) does not.
    gpu.options.conv.workspace_limit_mib = Some(128);
    let (x_shape, f_shape) = (vec![32, 128, 32, 32], vec![3, 3, 128, 128]);
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, x_shape.clone()).unwrap();
    let f1 = g.placeholder("f1", DType::F32, f_shape.clone()).unwrap();
    let f2 = g.placeholder("f2", DType::F32, f_shape.clone()).unwrap();
    let conv = |g: &mut Graph, x, f| g.conv2d(x, f, [1, 1], Padding::Same, DataFormat::Nchw);
    let y1 = conv(&mut g, x, f1).unwrap();
    let r = g.add(Unary::new(UnaryKind::Relu), &[y1]).unwrap();
    let y2 = conv(&mut g, r, f2).unwrap();
    let mut feeds = Feeds::new();
    let mut gen = Gen(13);
    for (name, shape) in [("x", &x_shape), ("f1", &f_shape), ("f2", &f_shape)] {
        let v = gen.vec(shape.iter().product(), -0.1, 0.1);
        feeds.insert(
            name.into(),
            Tensor::from_f64(DType::F32, shape.clone(), &v).unwrap(),
        );
    }
    let expected = CpuExecutor::new().run(&g, &feeds, &[y2]).unwrap();
    // What the executor holds before any step: the GEMM library's workspace.
    let before = gpu.live_bytes();
    for _ in 0..2 {
        gpu.run(&g, &feeds, &[y2]).unwrap();
    }
    gpu.reset_peak_bytes();
    let got = gpu.run(&g, &feeds, &[y2]).unwrap();
    assert!(max_rel_diff(&got[0], &expected[0]) < 1e-4);
    let planned = memory_plan::step_footprint(&g, &[y2], &Default::default())
        .unwrap()
        .peak_bytes();
    let with_scratch = memory_plan::step_footprint(&g, &[y2], &gpu.planned_scratch())
        .unwrap()
        .peak_bytes();
    let small_workspace = 16 << 20;
    let choices: Vec<String> = gpu
        .conv_algorithms()
        .iter()
        .map(|c| c.to_string())
        .collect();
    let step_peak = gpu.peak_bytes() - before;
    assert!(
        step_peak <= planned + small_workspace,
        "the step's measured peak {step_peak} bytes, planned {planned}; {choices:?}"
    );
    // Planned with the workspaces the step took, the plan is the measured peak.
    assert!(
        step_peak <= with_scratch && with_scratch - step_peak < 1 << 20,
        "the step's measured peak {step_peak} bytes, planned with its scratch \
         {with_scratch}; {choices:?}"
    );
}

/// A step whose tensors need more memory than the GPU has (8 tensors of 14 GB alive at
/// once) fails before any launch, in well under a second, naming the largest tensors.
#[test]
fn a_step_larger_than_the_device_fails_at_once_naming_its_tensors() {
    let Some(mut gpu) = gpu() else { return };
    // Terms of 14 GB, alive at once: more than the device holds (8 on an 80 GB H100,
    // 12 on a 141 GB H200, where 8 fit and the step ran for minutes).
    let terms = gpu.device_bytes() / 14_000_000_000 + 2;
    let (g, sum) = wide_sum(terms, 3_500_000_000);
    let feeds = wide_sum_feeds();
    let start = std::time::Instant::now();
    let err = gpu.run(&g, &feeds, &[sum]).unwrap_err();
    assert!(start.elapsed().as_secs_f64() < 1.0, "{:?}", start.elapsed());
    let ExecError::Memory(msg) = &err else {
        panic!("{err}")
    };
    assert!(msg.contains("f32[3500000000] (13351.4 MiB)"), "{msg}");
}
