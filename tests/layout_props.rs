//! Properties of `layout-nhwc` and `pad-conv-channels` on random NCHW convolutional
//! classifiers (odd image sizes, channel counts that are not multiples of 8, strided
//! convolutions padded SAME, VALID or explicitly (symmetric or not), pools, batch norms
//! in training and inference, residual Adds,
//! Concats, a global-mean or flattening head), forward and as whole SGD training steps,
//! evaluated on the CPU before and after the passes; the rewritten graph's file reads
//! back as the same graph (explicit pads written in the new layout's order).
//!
//! `layout-nhwc`: the same outputs (and the same variables after a training step) up to
//! the CPU convolutions' summation order, no NCHW op left, and exactly one Transpose
//! per NCHW tensor at the boundary: the input image in, each fetched image out, the
//! flattening head's input (and, in training, its gradient) through the Reshape.
//! `pad-conv-channels`: every 16-bit convolution op runs on channel counts that are
//! multiples of 8, with the same values to the 16-bit ulp.

mod common;

use std::collections::BTreeSet;

use ampgraph::exec::{CpuExecutor, Executor, Feeds};
use ampgraph::graph::attrs::AttrValue;
use ampgraph::graph::format::parse_json;
use ampgraph::graph::ops::{
    BatchNorm, Concat, Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat,
    NormActivation, Padding, Transpose, Variable,
};
use ampgraph::optim::{Optimizer, Sgd};
use ampgraph::passes::layout_nhwc::{LayoutNhwc, TO_NCHW, TO_NHWC};
use ampgraph::passes::simplify::PadConvChannels;
use ampgraph::passes::Pass;
use ampgraph::{DType, Graph, Port, Tensor};
use common::{check_close, feeds, json, ulp, Rng};
use proptest::prelude::*;

/// Channel counts for the generated layers: none a multiple of 8.
const CHANNELS: [usize; 7] = [1, 2, 3, 5, 6, 7, 12];
/// Classes of the head (the feeds' integer labels are below 10).
const CLASSES: usize = 10;

/// A random NCHW classifier.
struct Net {
    graph: Graph,
    loss: Port,
    /// The block outputs that are graph outputs.
    fetched: BTreeSet<Port>,
    /// The last block's output, which the head reads.
    head: Port,
    /// Whether the head flattens with a Reshape (which reads NCHW, and whose gradient
    /// comes back NCHW) rather than averaging over the image.
    flattens: bool,
    /// Whether a layer before the head has variables (else autodiff builds no
    /// gradient of the images).
    trains_images: bool,
}

impl Net {
    /// Whether `p` differs from its NHWC transpose (`[N, 1, 1, 1]` does not).
    fn is_image(&self, p: Port) -> bool {
        self.graph.ty(p).shape[1..].iter().any(|&d| d != 1)
    }

    /// How many Transposes out of NHWC the network needs: one per image leaving it.
    fn images_out(&self) -> usize {
        let mut leaving = self.fetched.clone();
        if self.flattens {
            leaving.insert(self.head);
        }
        leaving.into_iter().filter(|&p| self.is_image(p)).count()
    }

    /// How many Transposes into NHWC a training step needs: the input image's, and the
    /// flattening head's gradient's.
    fn images_in_training(&self) -> usize {
        1 + usize::from(self.flattens && self.trains_images && self.is_image(self.head))
    }
}

/// Adds the layers of a random network.
struct Builder {
    g: Graph,
    rng: Rng,
    dtype: DType,
}

impl Builder {
    fn shape(&self, p: Port) -> [usize; 4] {
        self.g.ty(p).shape[..].try_into().unwrap()
    }

    fn variable(&mut self, stem: &str, dtype: DType, shape: &[usize]) -> Port {
        let name = self.g.fresh_name(stem);
        self.g.variable(name, dtype, shape).unwrap()
    }

    /// Padding for a `k` x `k` window over `x`: VALID where it fits, half the time.
    fn padding(&mut self, x: Port, k: usize) -> Padding {
        let [_, _, h, w] = self.shape(x);
        if k <= h.min(w) && self.rng.below(2) == 0 {
            Padding::Valid
        } else {
            Padding::Same
        }
    }

    /// Padding for a convolution's `k` x `k` window over `x`: a third of the time
    /// explicit pads of 0 to 2 a side, each drawn alone (PyTorch's symmetric ones and
    /// asymmetric ones), where a window fits; else as [`padding`](Self::padding).
    fn conv_padding(&mut self, x: Port, k: usize) -> Padding {
        let [_, _, h, w] = self.shape(x);
        let mut pads = [[0; 2]; 2];
        pads.iter_mut()
            .flatten()
            .for_each(|p| *p = self.rng.below(3));
        let fits = h + pads[0][0] + pads[0][1] >= k && w + pads[1][0] + pads[1][1] >= k;
        if fits && self.rng.below(3) == 0 {
            Padding::Explicit(pads)
        } else {
            self.padding(x, k)
        }
    }

    /// SAME or PyTorch's 1 on every side: a 3 x 3 window at stride 1 keeps the shape.
    fn keeping_padding(&mut self) -> Padding {
        if self.rng.below(2) == 0 {
            Padding::Same
        } else {
            Padding::Explicit([[1, 1]; 2])
        }
    }

    /// A `k` x `k` convolution to `cout` channels.
    fn conv(&mut self, x: Port, cout: usize, k: usize, stride: usize, padding: Padding) -> Port {
        let cin = self.shape(x)[1];
        let filter = self.variable("kernel", self.dtype, &[k, k, cin, cout]);
        self.g
            .conv2d(x, filter, [stride; 2], padding, DataFormat::Nchw)
            .unwrap()
    }

    /// A bias and a batch norm (training or inference), each maybe.
    fn normalise(&mut self, mut x: Port) -> Port {
        let c = self.shape(x)[1];
        if self.rng.below(2) == 0 {
            let bias = self.variable("bias", self.dtype, &[c]);
            x = self.g.bias_add_format(x, bias, DataFormat::Nchw).unwrap();
        }
        if self.rng.below(2) == 0 {
            // The statistics of f32, f16 and bf16 images are f32.
            let stats = DType::F32;
            let scale = self.variable("scale", stats, &[c]);
            let offset = self.variable("offset", stats, &[c]);
            let zeros = Tensor::from_f64(stats, [c], &vec![0.0; c]).unwrap();
            let mean = self.g.constant(zeros).unwrap();
            let ones = Tensor::from_f64(stats, [c], &vec![1.0; c]).unwrap();
            let variance = self.g.constant(ones).unwrap();
            let bn = BatchNorm {
                // Large enough that a batch of nearly equal values stays well scaled.
                epsilon: 0.01,
                training: self.rng.below(2) == 0,
                data_format: DataFormat::Nchw,
                activation: NormActivation::Identity,
                ..BatchNorm::default()
            };
            x = self.g.add(bn, &[x, scale, offset, mean, variance]).unwrap();
        }
        x
    }

    /// One block of layers after `x`; its output is a single-output node's.
    fn block(&mut self, x: Port) -> Port {
        let c = self.shape(x)[1];
        match self.rng.below(5) {
            0 => {
                let (cout, k) = (self.rng.pick(&CHANNELS), self.rng.pick(&[1, 3]));
                let (stride, padding) = (self.rng.pick(&[1, 2]), self.conv_padding(x, k));
                let y = self.conv(x, cout, k, stride, padding);
                let y = self.normalise(y);
                self.g.relu(y).unwrap()
            }
            1 => {
                // A residual block: the shape kept for the Add.
                let padding = self.keeping_padding();
                let y = self.conv(x, c, 3, 1, padding);
                let y = self.normalise(y);
                let y = self.g.plus(y, x).unwrap();
                self.g.relu(y).unwrap()
            }
            2 => {
                let (k, stride) = (self.rng.pick(&[2, 3]), self.rng.pick(&[1, 2]));
                let padding = self.padding(x, k);
                if self.rng.below(2) == 0 {
                    self.g
                        .max_pool(x, [k, k], [stride; 2], padding, DataFormat::Nchw)
                        .unwrap()
                } else {
                    self.g
                        .avg_pool(x, [k, k], [stride; 2], padding, DataFormat::Nchw)
                        .unwrap()
                }
            }
            3 => {
                // An inception-like pair of branches joined along the channels.
                let (ca, cb) = (self.rng.pick(&CHANNELS), self.rng.pick(&CHANNELS));
                let a = self.conv(x, ca, 1, 1, Padding::Same);
                let padding = self.keeping_padding();
                let b = self.conv(x, cb, 3, 1, padding);
                let cat = self.g.add(Concat::new(1), &[a, b]).unwrap();
                self.g.relu(cat).unwrap()
            }
            _ => {
                // A leaky ReLU from a scalar product and a maximum.
                let cout = self.rng.pick(&CHANNELS);
                let y = self.conv(x, cout, 3, 1, Padding::Same);
                let slope = self.g.scalar(self.dtype, 0.25).unwrap();
                let scaled = self.g.mul(y, slope).unwrap();
                self.g.maximum(y, scaled).unwrap()
            }
        }
    }
}

/// A random classifier of `dtype` images: 1 to 4 blocks, then a global mean or a
/// flattening, a product to the classes and the cross-entropy.
fn random_net(seed: u64, dtype: DType) -> Net {
    let mut b = Builder {
        g: Graph::new(),
        rng: Rng(seed),
        dtype,
    };
    let n = 1 + b.rng.below(3);
    let c = b.rng.pick(&[1, 3, 3, 5, 7]);
    let (h, w) = (b.rng.pick(&[3, 5, 7, 9]), b.rng.pick(&[3, 5, 7, 9]));
    let mut x = b.g.placeholder("x", dtype, [n, c, h, w]).unwrap();
    let mut fetched = BTreeSet::new();
    for _ in 0..1 + b.rng.below(4) {
        x = b.block(x);
        if b.rng.below(3) == 0 {
            fetched.insert(x);
        }
    }
    // Only the blocks of a pool alone have no variables.
    let trains_images = b.g.node_ids().any(|id| b.g.node(id).op.is::<Variable>());
    let flattens = b.rng.below(3) == 0;
    let features = if flattens {
        b.g.reshape(x, [n as i64, -1]).unwrap()
    } else {
        b.g.mean(x, Some(&[2, 3]), false).unwrap()
    };
    let width = b.g.ty(features).shape[1];
    let w_fc = b.variable("dense", dtype, &[width, CLASSES]);
    let logits = b.g.matmul(features, w_fc).unwrap();
    let labels = b.g.placeholder("labels", DType::I64, [n]).unwrap();
    let loss = b.g.softmax_cross_entropy(logits, labels).unwrap();
    let mut graph = b.g;
    let outputs = [vec![logits, loss], fetched.iter().copied().collect()].concat();
    graph.set_outputs(outputs).unwrap();
    Net {
        graph,
        loss,
        fetched,
        head: x,
        flattens,
        trains_images,
    }
}

/// `pass` on a copy of `g`: valid, the same output names and types, and a second run
/// changes nothing.
fn rewritten(g: &Graph, pass: &dyn Pass) -> Result<Graph, TestCaseError> {
    let mut out = g.clone();
    pass.run(&mut out).unwrap();
    out.validate().unwrap();
    let outputs = |g: &Graph| -> Vec<(String, ampgraph::TensorType)> {
        g.outputs()
            .iter()
            .map(|&p| (g.port_name(p), g.ty(p).clone()))
            .collect()
    };
    prop_assert_eq!(outputs(g), outputs(&out));
    let mut again = out.clone();
    pass.run(&mut again).unwrap();
    prop_assert_eq!(
        json(&out),
        json(&again),
        "{} is not idempotent",
        pass.name()
    );
    let reread = parse_json(json(&out).as_bytes())
        .and_then(|d| d.to_graph())
        .unwrap();
    prop_assert_eq!(json(&reread), json(&out), "the file does not read back");
    Ok(out)
}

/// Nodes that still run an NCHW op.
fn nchw_ops(g: &Graph) -> Vec<String> {
    let nchw = AttrValue::from(DataFormat::Nchw);
    g.node_ids()
        .filter(|&id| g.node(id).op.attrs().iter().any(|(_, v)| *v == nchw))
        .map(|id| g.node(id).name.clone())
        .collect()
}

/// The Transposes into NHWC (each with the name of what it reads) and out of it.
fn transposes(g: &Graph) -> (Vec<String>, usize) {
    let (mut into, mut out) = (Vec::new(), 0);
    for id in g.node_ids() {
        let Some(t) = g.node(id).op.downcast_ref::<Transpose>() else {
            continue;
        };
        if t.perm == TO_NHWC {
            into.push(g.node(g.inputs(id)[0].node).name.clone());
        } else {
            assert_eq!(t.perm, TO_NCHW);
            out += 1;
        }
    }
    (into, out)
}

/// The HWIO filter shapes the convolution ops of `g` run with.
/// Each convolution op's filter (HWIO) and the pixels of its image (`x`'s H times W).
fn conv_ops(g: &Graph) -> Vec<(Vec<usize>, usize)> {
    let pixels = |shape: &[usize], format: DataFormat| -> usize {
        match format {
            DataFormat::Nhwc => shape[1] * shape[2],
            DataFormat::Nchw => shape[2] * shape[3],
        }
    };
    g.node_ids()
        .filter_map(|id| {
            let node = g.node(id);
            let inputs = g.inputs(id);
            if let Some(c) = node.op.downcast_ref::<Conv2D>() {
                let x = &g.ty(inputs[0]).shape;
                Some((g.ty(inputs[1]).shape.clone(), pixels(x, c.data_format)))
            } else if let Some(dx) = node.op.downcast_ref::<Conv2DBackpropInput>() {
                let x = &dx.input_shape;
                Some((
                    g.ty(inputs[0]).shape.clone(),
                    pixels(x, dx.conv.data_format),
                ))
            } else {
                let dw = node.op.downcast_ref::<Conv2DBackpropFilter>()?;
                let x = &g.ty(inputs[0]).shape;
                Some((dw.filter_shape.clone(), pixels(x, dw.conv.data_format)))
            }
        })
        .collect()
}

/// Adds one SGD step of the net's loss; returns the graph and what to fetch.
fn training_step(mut net: Net) -> (Graph, Vec<Port>) {
    let step = Sgd::new(0.05).minimize(&mut net.graph, net.loss).unwrap();
    (net.graph, vec![step.step, step.loss])
}

/// Runs one training step of each graph from the same feeds; the losses and every
/// variable written agree within `tol` of their scale.
fn same_step(
    want: (&Graph, &[Port]),
    got: (&Graph, &[Port]),
    seed: u64,
    tol: f64,
) -> Result<(), TestCaseError> {
    let f = feeds(want.0, seed);
    let (mut a, mut b) = (CpuExecutor::new(), CpuExecutor::new());
    let loss_a = a.run(want.0, &f, want.1).unwrap();
    let loss_b = b.run(got.0, &f, got.1).unwrap();
    check_close(&loss_a[1..], &loss_b[1..], tol)?;
    let mut names: Vec<&String> = a.variables.keys().collect();
    names.sort();
    let mut other: Vec<&String> = b.variables.keys().collect();
    other.sort();
    prop_assert_eq!(&names, &other);
    for name in names {
        let (va, vb) = (&a.variables[name], &b.variables[name]);
        check_close(std::slice::from_ref(va), std::slice::from_ref(vb), tol)
            .map_err(|e| TestCaseError::fail(format!("variable {name}: {e}")))?;
    }
    Ok(())
}

/// Every convolution op of `g` runs on channel counts that are multiples of 8, but a
/// filter gradient's fewer than 8 input channels and convolutions of one-pixel images
/// (`pad-conv-channels` keeps those).
fn channels_aligned(g: &Graph) -> Result<(), TestCaseError> {
    let filter_gradients: Vec<Vec<usize>> = g
        .node_ids()
        .filter_map(|id| g.node(id).op.downcast_ref::<Conv2DBackpropFilter>())
        .map(|dw| dw.filter_shape.clone())
        .collect();
    for (filter, pixels) in conv_ops(g) {
        if pixels == 1 {
            continue;
        }
        let kept = filter[2] < 8 && filter_gradients.contains(&filter);
        let cin = if kept { 0 } else { filter[2] % 8 };
        prop_assert_eq!((cin, filter[3] % 8), (0, 0), "{:?}", filter);
    }
    Ok(())
}

/// Outputs within one 16-bit ulp of each other plus what two f32 sums of `terms`
/// products may differ by in their order (Higham's bound, 2 * terms * 2^-24 * the sum
/// of the products' magnitudes, which `magnitudes` holds): padding adds zero products
/// but may change the CPU's blocking of the sum.
fn alike_in_16_bits(
    want: &[Tensor],
    got: &[Tensor],
    magnitudes: &[Tensor],
    terms: usize,
    dtype: DType,
) -> Result<(), TestCaseError> {
    // f32::EPSILON is 2^-23, twice the unit roundoff.
    let accumulation = terms as f64 * f64::from(f32::EPSILON);
    for ((w, o), m) in want.iter().zip(got).zip(magnitudes) {
        prop_assert_eq!(w.ty(), o.ty());
        let values = w.to_f64_vec().into_iter().zip(o.to_f64_vec());
        for ((a, b), m) in values.zip(m.to_f64_vec()) {
            let bound = ulp(a.abs().max(b.abs()), dtype) + accumulation * m;
            prop_assert!((a - b).abs() <= bound, "{} vs {} (magnitude {})", a, b, m);
        }
    }
    Ok(())
}

/// The feeds with every value made non-negative: a convolution of them sums the
/// magnitudes of the products the convolution of `feeds` sums.
fn magnitudes_of(feeds: &Feeds) -> Feeds {
    feeds
        .iter()
        .map(|(name, t)| {
            let abs: Vec<f64> = t.to_f64_vec().iter().map(|v| v.abs()).collect();
            let abs = Tensor::from_f64(t.dtype(), t.shape(), &abs).unwrap();
            (name.clone(), abs)
        })
        .collect()
}

/// The CPU's NCHW and NHWC filter gradients sum the batch's positions in different
/// blocks: a training step's variables moved by up to 2.7e-7 of their scale in 300
/// random networks (the forward pass came out bitwise equal).
const F32_TOL: f64 = 1e-5;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn layout_nhwc_keeps_a_networks_outputs_with_transposes_only_at_its_boundary(
        seed in any::<u64>(),
    ) {
        let net = random_net(seed, DType::F32);
        let g = &net.graph;
        let after = rewritten(g, &LayoutNhwc::EVERY_GRAPH)?;
        prop_assert!(nchw_ops(&after).is_empty(), "{:?}", nchw_ops(&after));
        let (into, out) = transposes(&after);
        prop_assert_eq!(into, ["x"]);
        prop_assert_eq!(out, net.images_out());
        let f = feeds(g, seed);
        let want = CpuExecutor::new().run(g, &f, g.outputs()).unwrap();
        let got = CpuExecutor::new().run(&after, &f, after.outputs()).unwrap();
        check_close(&want, &got, F32_TOL)?;
    }

    #[test]
    fn layout_nhwc_trains_a_network_as_nchw_does(seed in any::<u64>()) {
        let net = random_net(seed, DType::F32);
        let (images_in, images_out) = (net.images_in_training(), net.images_out());
        let (g, fetch) = training_step(net);
        let after = rewritten(&g, &LayoutNhwc::EVERY_GRAPH)?;
        prop_assert!(nchw_ops(&after).is_empty(), "{:?}", nchw_ops(&after));
        let (into, out) = transposes(&after);
        prop_assert_eq!(into.iter().filter(|t| *t == "x").count(), 1);
        prop_assert_eq!((into.len(), out), (images_in, images_out), "{:?}", into);
        same_step((&g, &fetch), (&after, &fetch), seed, F32_TOL)?;
    }

    #[test]
    fn pad_conv_channels_keeps_16_bit_convolutions_and_gradients(
        seed in any::<u64>(),
        bf16 in any::<bool>(),
        nhwc in any::<bool>(),
    ) {
        let dtype = if bf16 { DType::BF16 } else { DType::F16 };
        let mut rng = Rng(seed);
        let format = if nhwc { DataFormat::Nhwc } else { DataFormat::Nchw };
        let (n, cin, cout) = (1 + rng.below(3), rng.pick(&CHANNELS), rng.pick(&CHANNELS));
        let (h, w) = (rng.pick(&[3, 5, 7, 9]), rng.pick(&[3, 5, 7, 9]));
        let k = rng.pick(&[1, 2, 3]);
        let stride = [rng.pick(&[1, 2]), rng.pick(&[1, 2])];
        let padding = match rng.below(3) {
            0 => Padding::Same,
            1 => Padding::Valid,
            _ => Padding::Explicit([[rng.below(4), rng.below(4)], [rng.below(4), rng.below(4)]]),
        };
        let image = |c: usize, h: usize, w: usize| match format {
            DataFormat::Nhwc => [n, h, w, c],
            DataFormat::Nchw => [n, c, h, w],
        };
        let mut g = Graph::new();
        let x = g.placeholder("x", dtype, image(cin, h, w)).unwrap();
        let filter = g.placeholder("filter", dtype, [k, k, cin, cout]).unwrap();
        let y = g.conv2d(x, filter, stride, padding, format).unwrap();
        let dy = g.placeholder("dy", dtype, g.ty(y).shape.clone()).unwrap();
        let (dx, dw) = (
            Conv2DBackpropInput {
                input_shape: g.ty(x).shape.clone(),
                conv: Conv2D::new(stride, padding, format),
            },
            Conv2DBackpropFilter {
                filter_shape: vec![k, k, cin, cout],
                conv: Conv2D::new(stride, padding, format),
            },
        );
        let dx = g.add(dx, &[filter, dy]).unwrap();
        let dw = g.add(dw, &[x, dy]).unwrap();
        g.set_outputs(vec![y, dx, dw]).unwrap();

        let padded = rewritten(&g, &PadConvChannels)?;
        channels_aligned(&padded)?;
        prop_assert_eq!(padded.len() == g.len(), cin % 8 == 0 && cout % 8 == 0);
        let f = feeds(&g, seed);
        let want = CpuExecutor::new().run(&g, &f, g.outputs()).unwrap();
        let got = CpuExecutor::new().run(&padded, &f, padded.outputs()).unwrap();
        let magnitudes = CpuExecutor::new().run(&g, &magnitudes_of(&f), g.outputs()).unwrap();
        let positions = g.ty(dy).shape.iter().product::<usize>() / cout;
        let terms = (k * k * cin.max(cout)).max(positions);
        alike_in_16_bits(&want, &got, &magnitudes, terms, dtype)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// The CUDA pipeline's order: NHWC first, then the padding on the channel axis;
    /// a 16-bit training step pads every convolution and its gradients.
    #[test]
    fn pad_conv_channels_after_layout_nhwc_trains_a_16_bit_network_alike(
        seed in any::<u64>(),
        bf16 in any::<bool>(),
    ) {
        let dtype = if bf16 { DType::BF16 } else { DType::F16 };
        let (g, fetch) = training_step(random_net(seed, dtype));
        let nhwc = rewritten(&g, &LayoutNhwc::EVERY_GRAPH)?;
        let padded = rewritten(&nhwc, &PadConvChannels)?;
        channels_aligned(&padded)?;
        // Padding changes how the CPU blocks a convolution's f32 sums, which may move
        // a 16-bit result by an ulp and a training step's variables by a few.
        same_step((&nhwc, &fetch), (&padded, &fetch), seed, 4.0 * ulp(1.0, dtype))?;
    }
}
