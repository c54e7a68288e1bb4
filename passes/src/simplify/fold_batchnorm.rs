//! Batch-norm folding.
//!
//! - Inference (`training = false`): `BatchNorm(Conv2D(x, w) [+ b])` with constant
//!   filter, bias and statistics is `Conv2D(x, w') + b'`, per output channel `c`:
//!   `a = scale / sqrt(variance + epsilon)`, `w' = w * a`, `b' = (b - mean) * a + offset`.
//!   The same holds for `MatMul(x, w)` with the columns of the product as channels.
//!   The BatchNorm node becomes the BiasAdd, under its own name.
//! - Training (`training = true`): a BiasAdd right before the BatchNorm is cancelled by
//!   the subtraction of the batch mean, and is bypassed when nothing else reads it and
//!   the batch mean (which it shifts) is not read.
//!
//! The bypassed BiasAdds are removed; other nodes a fold leaves unread (old filters,
//! biases and statistics) are left to `dce`.

use ampgraph_graph::ops::{BatchNorm, BiasAdd, Const, Conv2D, DataFormat, MatMul, NormActivation};
use ampgraph_graph::{Graph, NodeId, Port, Tensor};

use crate::rewrite::{const_value, node_error, output_nodes, summary};
use crate::{Pass, PassError, PassSummary};

/// The `fold-batchnorm` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct FoldBatchNorm;

/// An inference BatchNorm that folds into the product before it.
struct Fold {
    bn: NodeId,
    /// The Conv2D or MatMul.
    product: NodeId,
    filter: Port,
    /// How the filter's elements map to output channels.
    filter_channel: ChannelOf,
    bias: Option<Port>,
    /// The BiasAdd between product and BatchNorm, unread once the fold is done.
    bias_add: Option<NodeId>,
    bias_format: DataFormat,
}

/// Index of the output channel of a flat filter index.
#[derive(Clone, Copy)]
enum ChannelOf {
    /// Channels are the fastest axis (HWIO filters, a MatMul's `[K, N]` operand).
    Last { channels: usize },
    /// Channels are the slowest axis (a MatMul's transposed `[N, K]` operand).
    First { inner: usize },
}

impl ChannelOf {
    fn of(self, i: usize) -> usize {
        match self {
            ChannelOf::Last { channels } => i % channels,
            ChannelOf::First { inner } => i / inner,
        }
    }
}

impl Pass for FoldBatchNorm {
    fn name(&self) -> &'static str {
        "fold-batchnorm"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        // A fold can expose another (a BatchNorm after a folded one reads a BiasAdd
        // now): sweep until nothing changes, so a second run has nothing left to do.
        let (mut folded, mut bypassed) = (0, 0);
        loop {
            let (f, b) = sweep(g)?;
            if f + b == 0 {
                break;
            }
            folded += f;
            bypassed += b;
        }
        let lines = vec![
            format!("fold-batchnorm: folded {folded} inference BatchNorms into their products"),
            format!(
                "fold-batchnorm: bypassed {bypassed} BiasAdds cancelled by a training BatchNorm"
            ),
        ];
        Ok(summary("fold-batchnorm", lines))
    }
}

/// One pass over the BatchNorms; returns the numbers folded and bypassed.
fn sweep(g: &mut Graph) -> Result<(usize, usize), PassError> {
    let adj = g.adjacency();
    let is_output = output_nodes(g);
    // Read by `reader` alone, and no graph output.
    let only_read_by = |id: NodeId, reader: NodeId| {
        !is_output[id.index()] && adj.consumers(id).all(|(c, _, _)| c == reader)
    };
    // Output `k` of a BatchNorm unread (its statistics outputs).
    let unread = |bn: NodeId, k: usize| {
        let port = Port::new(bn, k);
        adj.port_consumers(port).next().is_none() && !g.outputs().contains(&port)
    };
    let mut folds = Vec::new();
    let mut bypasses = Vec::new();
    for bn in g.node_ids() {
        let Some(op) = g.node(bn).op.downcast_ref::<BatchNorm>() else {
            continue;
        };
        let x = adj.inputs(bn)[0];
        let rank = g.ty(x).rank();
        let channel_axis = op.channel_axis(rank);
        let bias_add = g.node(x.node).op.downcast_ref::<BiasAdd>().filter(|b| {
            bias_channel_axis(b.data_format, rank) == channel_axis && only_read_by(x.node, bn)
        });
        if op.training {
            if bias_add.is_some() && unread(bn, 1) {
                bypasses.push((bn, x.node, adj.inputs(x.node)[0]));
            }
            continue;
        }
        // A folded BatchNorm becomes a BiasAdd, which has no activation or side input.
        let side = adj.inputs(bn).len() > 5;
        if !unread(bn, 1) || !unread(bn, 2) || op.activation != NormActivation::Identity || side {
            continue;
        }
        let (product, bias) = match bias_add {
            Some(_) => (adj.inputs(x.node)[0], Some(adj.inputs(x.node)[1])),
            None => (x, None),
        };
        let reader = if bias.is_some() { x.node } else { bn };
        if !only_read_by(product.node, reader) {
            continue;
        }
        let [_, filter] = adj.inputs(product.node) else {
            continue;
        };
        let filter_shape = &g.ty(*filter).shape;
        let product_op = &g.node(product.node).op;
        let (filter_channel, bias_format) = if let Some(c) = product_op.downcast_ref::<Conv2D>() {
            let out_axis = match c.data_format {
                DataFormat::Nhwc => 3,
                DataFormat::Nchw => 1,
            };
            if out_axis != channel_axis {
                continue;
            }
            // HWIO's O is the output channel with groups too (the filter is
            // `[kh, kw, cin / groups, cout]`): scaling it scales that channel alone.
            let channels = filter_shape[3];
            (ChannelOf::Last { channels }, c.data_format)
        } else if let Some(m) = product_op.downcast_ref::<MatMul>() {
            let channel = if m.transpose_b {
                ChannelOf::First {
                    inner: filter_shape[1],
                }
            } else {
                ChannelOf::Last {
                    channels: filter_shape[1],
                }
            };
            (channel, DataFormat::Nhwc)
        } else {
            continue;
        };
        let constants = std::iter::once(*filter)
            .chain(bias)
            .chain(adj.inputs(bn)[1..].iter().copied());
        if constants
            .into_iter()
            .all(|p| g.node(p.node).op.is::<Const>())
        {
            folds.push(Fold {
                bn,
                product: product.node,
                filter: *filter,
                filter_channel,
                bias,
                bias_add: bias.map(|_| x.node),
                bias_format,
            });
        }
    }
    // New filters and biases first, then one rewiring, then the BatchNorms become
    // BiasAdds (their old inputs are gone by then).
    let mut changes: Vec<(NodeId, usize, Port)> = Vec::new();
    let mut new_biases = Vec::with_capacity(folds.len());
    for f in &folds {
        let (filter, bias) = folded_constants(g, f, adj.inputs(f.bn))?;
        let name = g.fresh_name(format!("{}/folded_filter", g.node(f.product).name));
        let filter = g.add_node(name, Box::new(Const::new(filter)), &[])?;
        let name = g.fresh_name(format!("{}/folded_bias", g.node(f.bn).name));
        let bias = g.add_node(name, Box::new(Const::new(bias)), &[])?;
        changes.push((f.product, 1, filter.into()));
        new_biases.push(bias);
    }
    changes.extend(bypasses.iter().map(|&(bn, _, x)| (bn, 0, x)));
    g.rewire(changes)?;
    for (f, bias) in folds.iter().zip(new_biases) {
        let op = BiasAdd {
            data_format: f.bias_format,
        };
        g.set_node(f.bn, Box::new(op), &[f.product.into(), bias.into()])?;
    }
    // The bypassed BiasAdds had no other reader: removed here, so that what read
    // them is read by nothing else and a second run finds nothing new.
    let bypassed = bypasses.iter().map(|b| b.1);
    for id in folds.iter().filter_map(|f| f.bias_add).chain(bypassed) {
        g.remove_node(id)?;
    }
    Ok((folds.len(), bypasses.len()))
}

/// The channel axis of a BiasAdd on a tensor of the given rank.
fn bias_channel_axis(format: DataFormat, rank: usize) -> usize {
    match format {
        DataFormat::Nhwc => rank - 1,
        DataFormat::Nchw => 1,
    }
}

/// The folded filter and bias, computed in f64 and stored in the filter's and the
/// product's dtypes.
fn folded_constants(
    g: &Graph,
    f: &Fold,
    bn_inputs: &[Port],
) -> Result<(Tensor, Tensor), PassError> {
    let value = |p: Port| -> Result<Tensor, PassError> {
        const_value(g, p.node)?.ok_or_else(|| node_error(g, p.node, "expected a Const"))
    };
    let epsilon = g
        .node(f.bn)
        .op
        .downcast_ref::<BatchNorm>()
        .map_or(0.0, |b| b.epsilon);
    let [scale, offset, mean, variance] = [1, 2, 3, 4].map(|k| bn_inputs[k]);
    let (scale, offset, mean, variance) = (
        value(scale)?.to_f64_vec(),
        value(offset)?.to_f64_vec(),
        value(mean)?.to_f64_vec(),
        value(variance)?.to_f64_vec(),
    );
    let a: Vec<f64> = scale
        .iter()
        .zip(&variance)
        .map(|(s, v)| s / (v + epsilon).sqrt())
        .collect();
    let filter = value(f.filter)?;
    let w: Vec<f64> = filter
        .to_f64_vec()
        .iter()
        .enumerate()
        .map(|(i, w)| w * a[f.filter_channel.of(i)])
        .collect();
    let b = match f.bias {
        Some(p) => value(p)?.to_f64_vec(),
        None => vec![0.0; a.len()],
    };
    let bias: Vec<f64> = (0..a.len())
        .map(|c| (b[c] - mean[c]) * a[c] + offset[c])
        .collect();
    let dtype = g.ty(Port::from(f.product)).dtype;
    let err = |m: String| node_error(g, f.bn, &m);
    Ok((
        Tensor::from_f64(filter.dtype(), filter.shape(), &w).map_err(err)?,
        Tensor::from_f64(dtype, [a.len()], &bias).map_err(err)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::{Padding, Placeholder};
    use ampgraph_graph::{DType, Op, TensorType};

    fn add(g: &mut Graph, name: &str, op: impl Op, inputs: &[Port]) -> Port {
        g.add_node(name, Box::new(op), inputs).unwrap().into()
    }

    /// `mm = x[4, 2] @ w`, w a Const 2x2.
    fn product_of_constant_weights() -> (Graph, Port) {
        let mut g = Graph::new();
        let x = add(
            &mut g,
            "x",
            Placeholder(TensorType::new(DType::F32, [4, 2])),
            &[],
        );
        let w = konst(&mut g, "w", &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let mm = add(&mut g, "mm", MatMul::new(false, false), &[x, w]);
        (g, mm)
    }

    fn konst(g: &mut Graph, name: &str, shape: &[usize], v: &[f64]) -> Port {
        add(
            g,
            name,
            Const::new(Tensor::from_f64(DType::F32, shape, v).unwrap()),
            &[],
        )
    }

    fn values(g: &Graph, p: Port) -> Vec<f64> {
        const_value(g, p.node).unwrap().unwrap().to_f64_vec()
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-6, "{a:?} vs {b:?}");
        }
    }

    /// An inference batch norm's op (given statistics).
    fn inference(epsilon: f64, data_format: DataFormat) -> BatchNorm {
        BatchNorm {
            epsilon,
            data_format,
            ..BatchNorm::default()
        }
    }

    /// `BatchNorm(x)` named `bn`, its per-channel constants (scale, offset, mean,
    /// variance) given in that order, as the graph's output.
    fn batch_norm_output(g: &mut Graph, op: BatchNorm, x: Port, constants: [&[f64]; 4]) {
        let names = ["scale", "offset", "mean", "var"];
        let mut inputs = vec![x];
        for (name, v) in names.into_iter().zip(constants) {
            inputs.push(konst(g, name, &[v.len()], v));
        }
        let bn = add(g, "bn", op, &inputs);
        g.set_outputs(vec![bn]).unwrap();
    }

    /// Folds `g`'s one batch norm into its convolution `conv_op` (which keeps its
    /// attrs) and returns the output before and after, fed `x` of `shape`.
    fn fold_convolution(g: &mut Graph, conv_op: &Conv2D, shape: [usize; 4]) -> [Vec<f64>; 2] {
        let n = shape.iter().product::<usize>();
        let xv: Vec<f64> = (0..n).map(|i| (i as f64 * 0.7).sin()).collect();
        let feeds = [("x", Tensor::from_f64(DType::F32, shape, &xv).unwrap())].into();
        let want = crate::testing::run(g, &feeds);
        let s = FoldBatchNorm.run(g).unwrap();
        g.validate().unwrap();
        assert!(s.lines[0].contains("folded 1 "), "{s}");
        let conv = g.find("conv").unwrap();
        assert_eq!(g.node(conv).op.downcast_ref::<Conv2D>(), Some(conv_op));
        let got = crate::testing::run(g, &feeds);
        [want[0].to_f64_vec(), got[0].to_f64_vec()]
    }

    /// Conv2D 1x1, 1 input channel, 2 output channels, then BiasAdd and BatchNorm.
    #[test]
    fn folds_conv_bias_batchnorm_into_hand_computed_constants() {
        let mut g = Graph::new();
        let x = add(
            &mut g,
            "x",
            Placeholder(TensorType::new(DType::F32, [1, 2, 2, 1])),
            &[],
        );
        let w = konst(&mut g, "w", &[1, 1, 1, 2], &[2.0, -1.0]);
        let conv = add(
            &mut g,
            "conv",
            Conv2D::new([1, 1], Padding::Valid, DataFormat::Nhwc),
            &[x, w],
        );
        let b = konst(&mut g, "b", &[2], &[1.0, 3.0]);
        let biased = add(
            &mut g,
            "biased",
            BiasAdd {
                data_format: DataFormat::Nhwc,
            },
            &[conv, b],
        );
        let constants: [&[f64]; 4] = [&[3.0, 0.5], &[0.25, -1.0], &[1.0, 2.0], &[4.0, 1.0]];
        batch_norm_output(&mut g, inference(0.0, DataFormat::Nhwc), biased, constants);

        let s = FoldBatchNorm.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(s.lines[0].contains("folded 1 "), "{s}");
        // a = [3/2, 0.5/1] = [1.5, 0.5]; w' = [2*1.5, -1*0.5]; b' = (b - mean)*a + offset.
        let bn = g.find("bn").unwrap();
        assert_eq!(g.node(bn).op_name(), "BiasAdd");
        let [conv_port, bias_port] = g.inputs(bn)[..] else {
            panic!()
        };
        assert_eq!(g.node(conv_port.node).name, "conv");
        close(&values(&g, g.inputs(conv_port.node)[1]), &[3.0, -0.5]);
        close(
            &values(&g, bias_port),
            &[(1.0 - 1.0) * 1.5 + 0.25, (3.0 - 2.0) * 0.5 - 1.0],
        );
        // Idempotent.
        assert!(FoldBatchNorm.run(&mut g).unwrap().lines[0].contains("folded 0 "));
    }

    /// An NCHW 2x2 convolution with asymmetric explicit pads: the fold keeps them and
    /// the values.
    #[test]
    fn folds_an_explicitly_padded_convolution() {
        let mut g = Graph::new();
        let shape = [1, 2, 3, 4];
        let x = add(
            &mut g,
            "x",
            Placeholder(TensorType::new(DType::F32, shape)),
            &[],
        );
        let wv: Vec<f64> = (0..12).map(|i| f64::from(i) * 0.25 - 1.0).collect();
        let w = konst(&mut g, "w", &[2, 2, 2, 3], &[wv.clone(), wv].concat());
        let pads = Padding::Explicit([[1, 0], [0, 2]]);
        let conv_op = Conv2D::new([1, 2], pads, DataFormat::Nchw);
        let conv = add(&mut g, "conv", conv_op.clone(), &[x, w]);
        let constants: [&[f64]; 4] = [
            &[3.0, 0.5, -2.0],
            &[0.25, -1.0, 2.0],
            &[1.0, 2.0, -0.5],
            &[4.0, 1.0, 0.25],
        ];
        batch_norm_output(&mut g, inference(0.0, DataFormat::Nchw), conv, constants);
        let [want, got] = fold_convolution(&mut g, &conv_op, shape);
        close(&got, &want);
    }

    /// A depthwise NHWC convolution (3 groups, 2 output channels each) folds per output
    /// channel and keeps its groups.
    #[test]
    fn folds_a_grouped_convolution() {
        let mut g = Graph::new();
        let shape = [2, 4, 3, 3];
        let x = add(
            &mut g,
            "x",
            Placeholder(TensorType::new(DType::F32, shape)),
            &[],
        );
        let wv: Vec<f64> = (0..36).map(|i| (f64::from(i) * 0.9).cos()).collect();
        let w = konst(&mut g, "w", &[3, 2, 1, 6], &wv);
        let conv_op = Conv2D::new([1, 1], Padding::Same, DataFormat::Nhwc).with_groups(3);
        let conv = add(&mut g, "conv", conv_op.clone(), &[x, w]);
        let constants: [&[f64]; 4] = [
            &[3.0, 0.5, -2.0, 1.0, 0.25, 4.0],
            &[0.25, -1.0, 2.0, 0.0, 1.5, -3.0],
            &[1.0, 2.0, -0.5, 0.0, 3.0, -1.0],
            &[4.0, 1.0, 0.25, 2.0, 9.0, 0.5],
        ];
        batch_norm_output(&mut g, inference(0.001, DataFormat::Nhwc), conv, constants);
        let [want, got] = fold_convolution(&mut g, &conv_op, shape);
        // f32 sums of 6 products of at most ~6 each, rounded apart: a few ulps.
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn folds_a_transposed_matmul_and_drops_a_bias_before_training_batchnorm() {
        let mut g = Graph::new();
        let x = add(
            &mut g,
            "x",
            Placeholder(TensorType::new(DType::F32, [4, 3])),
            &[],
        );
        // w is [N=2, K=3] with transpose_b: row n belongs to channel n.
        let w = konst(&mut g, "w", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let mm = add(&mut g, "mm", MatMul::new(false, true), &[x, w]);
        let ones = konst(&mut g, "ones", &[2], &[1.0, 1.0]);
        let zeros = konst(&mut g, "zeros", &[2], &[0.0, 0.0]);
        let var = konst(&mut g, "var", &[2], &[3.0, 0.0]);
        let bn_op = inference(1.0, DataFormat::Nhwc);
        let bn = add(&mut g, "bn", bn_op, &[mm, ones, zeros, zeros, var]);
        // Training mode: the bias is cancelled by the batch mean.
        let b = konst(&mut g, "b", &[2], &[5.0, -7.0]);
        let biased = add(
            &mut g,
            "biased",
            BiasAdd {
                data_format: DataFormat::Nhwc,
            },
            &[bn, b],
        );
        let train_op = BatchNorm {
            training: true,
            ..inference(1e-3, DataFormat::Nhwc)
        };
        let tbn = add(&mut g, "tbn", train_op, &[biased, ones, zeros, zeros, ones]);
        g.set_outputs(vec![tbn]).unwrap();

        let s = FoldBatchNorm.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(
            s.lines[0].contains("folded 1 ") && s.lines[1].contains("bypassed 2 "),
            "{s}"
        );
        // a = [1/2, 1/1]: row 0 halves, row 1 stays; bias' = offset = 0.
        let mm = g.find("mm").unwrap();
        close(
            &values(&g, g.inputs(mm)[1]),
            &[0.5, 1.0, 1.5, 4.0, 5.0, 6.0],
        );
        // `biased` goes, then the folded `bn` (a BiasAdd now) is cancelled too.
        let tbn = g.find("tbn").unwrap();
        assert_eq!(g.node(g.inputs(tbn)[0].node).name, "mm");
        assert!(g.find("biased").is_none() && g.find("bn").is_none());
    }

    #[test]
    fn leaves_batchnorms_whose_product_has_other_readers() {
        let (mut g, mm) = product_of_constant_weights();
        let s = konst(&mut g, "s", &[2], &[1.0, 1.0]);
        let bn = add(&mut g, "bn", BatchNorm::default(), &[mm, s, s, s, s]);
        g.set_outputs(vec![bn, mm]).unwrap();
        FoldBatchNorm.run(&mut g).unwrap();
        assert_eq!(g.node(g.find("bn").unwrap()).op_name(), "BatchNorm");
    }

    /// MatMul -> BatchNorm -> BatchNorm (inference) -> BatchNorm (training): the
    /// second fold and the bypass appear only once the first fold is done.
    #[test]
    fn folds_chains_in_one_run() {
        let (mut g, mm) = product_of_constant_weights();
        let s = konst(&mut g, "s", &[2], &[2.0, 2.0]);
        let bn1 = add(&mut g, "bn1", BatchNorm::default(), &[mm, s, s, s, s]);
        let bn2 = add(&mut g, "bn2", BatchNorm::default(), &[bn1, s, s, s, s]);
        let train = BatchNorm {
            training: true,
            ..BatchNorm::default()
        };
        let bn3 = add(&mut g, "bn3", train, &[bn2, s, s, s, s]);
        g.set_outputs(vec![bn3]).unwrap();
        let s = FoldBatchNorm.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(
            s.lines[0].contains("folded 2 ") && s.lines[1].contains("bypassed 1 "),
            "{s}"
        );
        let bn3 = g.find("bn3").unwrap();
        assert_eq!(g.node(g.inputs(bn3)[0].node).name, "mm");
        let again = FoldBatchNorm.run(&mut g).unwrap();
        assert!(again.lines[0].contains("folded 0 ") && again.lines[1].contains("bypassed 0 "));
    }
}
