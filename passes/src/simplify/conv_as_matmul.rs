//! Convolutions that are products (`conv-as-matmul`): an NHWC Conv2D with unit
//! dilations, no padding and one group whose filter `[kh, kw, Cin, Cout]` moves by its
//! own size (strides `[kh, kw]`, the image's height and width multiples of them) reads
//! each `kh x kw` patch of the image once: it is the product of the patches
//! `[N H/kh W/kw, kh kw Cin]` by the filter `[kh kw Cin, Cout]`. Pointwise
//! convolutions (1x1, unit strides) take their pixels as they are,
//! `Reshape(MatMul(Reshape(x), Reshape(w)))`; patch embeddings (ViT's 16x16 of stride
//! 16) gather each patch's rows first (a Reshape to `[N, H/kh, kh, W/kw, kw, Cin]` and
//! a Transpose of the two middle axes). A BiasAdd and then a Relu reading it alone come
//! inside, on the product's rows, where `gemm-epilogue` takes them into the GEMM.
//!
//! Why: cuDNN ran MobileNetV3's squeeze-excitation convolutions (`[64, 1, 1, C]`) at
//! 0.1-0.15 ms each on the H200, and the pointwise convolutions of ResNet-50,
//! MobileNetV3 and EfficientNet as separate convolution, bias and activation kernels;
//! cuBLASLt runs such products with their bias and ReLU in one call. ViT-B/16's patch
//! embedding (7.4 GFLOP at batch 32, three input channels) took cuDNN 0.34 ms.
//!
//! Inference only: a convolution whose filter or image a gradient reads (a training
//! step) keeps cuDNN's kernels, its gradients with it.

use ampgraph_graph::ops::{
    BiasAdd, Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat, MatMul, Padding,
    Reshape, Transpose, Unary, UnaryKind,
};
use ampgraph_graph::{Graph, NodeId, Op, Port};

use crate::rewrite::{const_value, dims, sole_reader, summary};
use crate::{Pass, PassError, PassSummary};

/// The `conv-as-matmul` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvAsMatmul;

/// The patch `[kh, kw]` of `conv` over `image` when it reads each patch once:
/// strides equal to the filter's size, which divides the image's (so `SAME` pads
/// nothing), no padding, dilation or groups.
fn patch(conv: &Conv2D, image: &[usize], filter: &[usize]) -> Option<[usize; 2]> {
    let unpadded = match conv.padding {
        Padding::Valid | Padding::Same => true,
        Padding::Explicit(pads) => pads == [[0, 0], [0, 0]],
    };
    let (&[kh, kw, _, _], &[_, h, w, _]) = (filter, image) else {
        return None;
    };
    let tiles = kh > 0 && kw > 0 && h % kh == 0 && w % kw == 0;
    (conv.data_format == DataFormat::Nhwc
        && conv.strides == [kh, kw]
        && conv.dilations == [1, 1]
        && conv.groups == 1
        && unpadded
        && tiles)
        .then_some([kh, kw])
}

/// The NCHW tensor an NHWC image is the Transpose of, where it is one.
fn nchw_source(g: &Graph, x: Port) -> Option<Port> {
    let t = g.node(x.node).op.downcast_ref::<Transpose>()?;
    (t.perm == [0, 2, 3, 1]).then(|| g.inputs(x.node)[0])
}

/// `x` split into `split` and transposed by `perm`: an image's patches gathered.
fn gather(
    g: &mut Graph,
    name: &str,
    x: Port,
    split: &[usize],
    perm: &[usize],
) -> Result<Port, PassError> {
    let tiles = g.add_node(
        g.fresh_name(format!("{name}/tiles")),
        Box::new(Reshape::new(dims(split))),
        &[x],
    )?;
    let patches = g.add_node(
        g.fresh_name(format!("{name}/patches")),
        Box::new(Transpose::new(perm.to_vec())),
        &[tiles.into()],
    )?;
    Ok(patches.into())
}

/// The filter `w` transposed by `perm`: computed now where it is a constant (a
/// model's weight), else a Transpose node.
fn transposed(g: &mut Graph, name: &str, w: Port, perm: &[usize]) -> Result<Port, PassError> {
    let op = Transpose::new(perm.to_vec());
    if let Some(value) = const_value(g, w.node)? {
        let value = op
            .eval(&[&value])
            .map_err(|e| PassError::Rewrite(e.to_string()))?;
        if let Some(value) = value.into_iter().next() {
            return Ok(g.constant(value)?);
        }
    }
    let node = g.add_node(
        g.fresh_name(format!("{name}/filter_rows")),
        Box::new(op),
        &[w],
    )?;
    Ok(node.into())
}

/// Whether a convolution gradient reads `port` (the convolution is trained).
fn read_by_gradient(g: &Graph, port: Port) -> bool {
    g.port_consumers(port).iter().any(|&(r, _)| {
        let op = &g.node(r).op;
        op.is::<Conv2DBackpropInput>() || op.is::<Conv2DBackpropFilter>()
    })
}

impl Pass for ConvAsMatmul {
    fn name(&self) -> &'static str {
        "conv-as-matmul"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let convs: Vec<(NodeId, Conv2D)> = (g.node_ids())
            .filter_map(|id| Some((id, g.node(id).op.downcast_ref::<Conv2D>()?.clone())))
            .collect();
        let (mut products, mut over_patches, mut epilogues) = (0, 0, 0);
        for (id, conv) in convs {
            let [x, w] = g.inputs(id)[..] else {
                continue;
            };
            let (image, filter) = (g.ty(x).shape.clone(), g.ty(w).shape.clone());
            let trained = read_by_gradient(g, x) || read_by_gradient(g, w);
            let Some([kh, kw]) = patch(&conv, &image, &filter).filter(|_| !trained) else {
                continue;
            };
            let [n, h, w_, cin] = image[..] else {
                continue;
            };
            let cout = filter[3];
            let out = [n, h / kh, w_ / kw, cout];
            let (rows, depth) = (n * out[1] * out[2], kh * kw * cin);
            let name = g.node(id).name.clone();
            // An image made NHWC from the model's NCHW input (`layout-nhwc`) gives its
            // patches channel-major, `[C, kh, kw]` (the filter's rows likewise): each
            // patch row is then `kw` adjacent values of the NCHW source, which the one
            // Transpose `compose-views` leaves reads in runs.
            let over_tiles = [kh, kw] != [1, 1];
            let from_nchw = nchw_source(g, x).filter(|_| over_tiles);
            let (mut patches, mut filter) = (x, w);
            if let Some(source) = from_nchw {
                let split = [n, cin, out[1], kh, out[2], kw];
                patches = gather(g, &name, source, &split, &[0, 2, 4, 1, 3, 5])?;
                filter = transposed(g, &name, w, &[2, 0, 1, 3])?;
            } else if over_tiles {
                let split = [n, out[1], kh, out[2], kw, cin];
                patches = gather(g, &name, x, &split, &[0, 1, 3, 2, 4, 5])?;
            }
            over_patches += usize::from(over_tiles);
            let pixels = g.add_node(
                g.fresh_name(format!("{name}/pixels")),
                Box::new(Reshape::new(dims(&[rows, depth]))),
                &[patches],
            )?;
            let matrix = g.add_node(
                g.fresh_name(format!("{name}/filter")),
                Box::new(Reshape::new(dims(&[depth, cout]))),
                &[filter],
            )?;
            let product = g.add_node(
                g.fresh_name(format!("{name}/product")),
                Box::new(MatMul::new(false, false)),
                &[pixels.into(), matrix.into()],
            )?;
            // The bias and the ReLU after it on the product's rows; the last of them
            // becomes the view back to the image, under its own name.
            let mut last = product;
            let mut end = id;
            let bias = sole_reader(g, Port::new(id, 0))
                .filter(|&(r, slot)| slot == 0 && g.node(r).op.is::<BiasAdd>())
                .map(|(r, _)| r);
            if let Some(b) = bias {
                let bias = g.inputs(b)[1];
                let op = BiasAdd {
                    data_format: DataFormat::Nhwc,
                };
                last = g.add_node(
                    g.fresh_name(format!("{name}/bias")),
                    Box::new(op),
                    &[last.into(), bias],
                )?;
                end = b;
                epilogues += 1;
                let relu = sole_reader(g, Port::new(b, 0))
                    .map(|(r, _)| r)
                    .filter(|&r| {
                        let unary = g.node(r).op.downcast_ref::<Unary>();
                        unary.is_some_and(|u| u.kind == UnaryKind::Relu)
                    });
                if let Some(r) = relu {
                    let op = Unary::new(UnaryKind::Relu);
                    last = g.add_node(
                        g.fresh_name(format!("{name}/relu")),
                        Box::new(op),
                        &[last.into()],
                    )?;
                    end = r;
                    epilogues += 1;
                }
            }
            let back = Reshape::new(dims(&out));
            g.set_node(end, Box::new(back), &[last.into()])?;
            // The bias (where the ReLU took the name) and the convolution, unread now.
            if let Some(b) = bias.filter(|&b| b != end) {
                g.remove_node(b)?;
            }
            if end != id {
                g.remove_node(id)?;
            }
            // The NHWC copy the patches no longer read.
            if from_nchw.is_some() && g.port_consumers(x).is_empty() && !g.outputs().contains(&x) {
                g.remove_node(x.node)?;
            }
            products += 1;
        }
        let line = format!(
            "conv-as-matmul: {products} convolutions as products ({over_patches} over patches; {epilogues} biases and ReLUs on their rows)"
        );
        Ok(summary("conv-as-matmul", vec![line]))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use ampgraph_graph::{DType, Tensor};

    use super::*;
    use crate::testing::{count, run, sine};
    use ampgraph_graph::format::to_text;

    /// A pointwise convolution with its bias and ReLU (as an exported ResNet's), one
    /// without either, a 3x3 one, a 1x1 one of strides 2, 2x3 patch embeddings (as
    /// ViT's; of an NHWC image and of one from NCHW) and a 2x2 one whose image's
    /// height 3 it does not tile: the two pointwise ones and the patch embeddings
    /// become products computing the same (to
    /// f32 rounding in another order).
    #[test]
    fn pointwise_convolutions_compute_the_same_as_products() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 4, 5]).unwrap();
        let w1 = g.placeholder("w1", DType::F32, [1, 1, 5, 6]).unwrap();
        let b1 = g.placeholder("b1", DType::F32, [6]).unwrap();
        let w2 = g.placeholder("w2", DType::F32, [1, 1, 6, 7]).unwrap();
        let w3 = g.placeholder("w3", DType::F32, [3, 3, 7, 8]).unwrap();
        let conv = |g: &mut Graph, x, w, strides| {
            g.add(
                Conv2D::new(strides, Padding::Same, DataFormat::Nhwc),
                &[x, w],
            )
            .unwrap()
        };
        let y = conv(&mut g, x, w1, [1, 1]);
        let y = g
            .add(
                BiasAdd {
                    data_format: DataFormat::Nhwc,
                },
                &[y, b1],
            )
            .unwrap();
        let y = g.relu(y).unwrap();
        let y = conv(&mut g, y, w2, [1, 1]);
        let z = conv(&mut g, y, w3, [1, 1]);
        let w4 = g.placeholder("w4", DType::F32, [1, 1, 7, 3]).unwrap();
        let strided = conv(&mut g, y, w4, [2, 2]);
        let image = g.placeholder("image", DType::F32, [2, 4, 6, 3]).unwrap();
        let w5 = g.placeholder("w5", DType::F32, [2, 3, 3, 8]).unwrap();
        let embedded = conv(&mut g, image, w5, [2, 3]);
        let w6 = g.placeholder("w6", DType::F32, [2, 2, 5, 4]).unwrap();
        let untiled = conv(&mut g, x, w6, [2, 2]);
        // The same image from an NCHW input (as `layout-nhwc` leaves an ONNX model's),
        // with the filter read and with a constant one: channel-major patches.
        let nchw = g.placeholder("nchw", DType::F32, [2, 3, 4, 6]).unwrap();
        let nhwc = g.transpose(nchw, [0, 2, 3, 1]).unwrap();
        let from_nchw = conv(&mut g, nhwc, w5, [2, 3]);
        let w7 = g.constant(sine(&[2, 3, 3, 8], 0.45)).unwrap();
        let constant_filter = conv(&mut g, nhwc, w7, [2, 3]);
        let outputs = vec![y, z, strided, embedded, untiled, from_nchw, constant_filter];
        g.set_outputs(outputs).unwrap();
        let feeds: HashMap<&str, Tensor> = [
            ("x", sine(&[2, 3, 4, 5], 0.3)),
            ("w1", sine(&[1, 1, 5, 6], 0.7)),
            ("b1", sine(&[6], 1.1)),
            ("w2", sine(&[1, 1, 6, 7], 0.5)),
            ("w3", sine(&[3, 3, 7, 8], 0.9)),
            ("w4", sine(&[1, 1, 7, 3], 0.4)),
            ("image", sine(&[2, 4, 6, 3], 0.8)),
            ("nchw", sine(&[2, 3, 4, 6], 0.35)),
            ("w5", sine(&[2, 3, 3, 8], 0.6)),
            ("w6", sine(&[2, 2, 5, 4], 0.2)),
        ]
        .into();
        let before = run(&g, &feeds);
        let mut after = g.clone();
        let s = ConvAsMatmul.run(&mut after).unwrap();
        after.validate().unwrap();
        assert!(
            s.lines[0].contains(": 5 convolutions as products (3 over patches; 2 biases"),
            "{}",
            s.lines[0]
        );
        assert_eq!((count(&after, "Conv2D"), count(&after, "MatMul")), (3, 5));
        // The patches Transposes, and the read filter's rows (the constant one's are
        // computed now); the NHWC copy of the NCHW image went.
        assert_eq!(count(&after, "Transpose"), 3 + 1, "{}", to_text(&after));
        for (a, b) in before.iter().zip(run(&after, &feeds)) {
            assert_eq!(a.ty(), b.ty());
            for (p, q) in a.to_f64_vec().iter().zip(b.to_f64_vec()) {
                assert!((p - q).abs() <= 1e-5 * p.abs().max(1.0), "{p} vs {q}");
            }
        }
        // The output names stay.
        let names =
            |g: &Graph| -> Vec<String> { g.outputs().iter().map(|&p| g.port_name(p)).collect() };
        assert_eq!(names(&g), names(&after));
    }
}
