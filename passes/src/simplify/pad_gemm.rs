//! GEMM padding for Tensor Cores: cuBLASLt's fast 16-bit kernels need every stored
//! matrix's rows to start 16 bytes apart, so a large f16/bf16 MatMul whose operands' or
//! result's row length (a leading dimension: K or M of `a`, N or K of `b`, N of the
//! result) is not a multiple of 8 multiplies zero-padded operands (Concat with zeros)
//! and its result is sliced back. GPT-2's vocabulary of 50,257 made its three LM-head
//! GEMMs run at a sixth of the H100's rate (28 ms of a 70 ms step). Zero rows and
//! columns add exact zeros to every dot product and the padded part of the result is
//! sliced off, so the values are unchanged. Padding copies operands: only products
//! whose work outweighs the copies are padded, and a tensor two products pad alike is
//! padded once (the gradient of the logits, read by two products).
//!
//! A fused cross-entropy reading the sliced logits reads the padded product itself
//! (its `classes` the unpadded width) and writes its gradient already padded with
//! zero columns, so neither the logits' Slice nor the gradient's pad is copied:
//! GPT-2's two copies of 1.6 GB each, 3.6 ms of its step.

use std::collections::HashMap;

use ampgraph_graph::autodiff::placed;
use ampgraph_graph::ops::{BroadcastTo, Concat, Const, MatMul, Slice, SoftmaxCrossEntropyWithGrad};
use ampgraph_graph::{Graph, NodeId, Port, TensorType};

use crate::rewrite::{output_nodes, remove_unread, summary};
use crate::{Pass, PassError, PassSummary};

/// Tensor Core tiles want every GEMM dimension a multiple of this (f16, bf16).
pub const GEMM_MULTIPLE: usize = 8;

/// The `pad-gemm` pass: which products it pads.
#[derive(Clone, Copy, Debug)]
pub struct PadGemm {
    /// Products of fewer flops (`2 m n k`) stay as they are: a small GEMM's time is
    /// its launch, not its alignment.
    pub min_flops: f64,
    /// A product is padded only where its flops are at least this many times the
    /// bytes the padding copies (a padded operand written, a sliced result read and
    /// written): an H100 multiplies some 300 16-bit flops in the time it copies a byte,
    /// and a misaligned GEMM ran up to 6 times slower.
    pub flops_per_copied_byte: f64,
}

impl Default for PadGemm {
    /// Products of at least 2^33 flops (some 15 us on an H100) whose flops are 256
    /// times the bytes copied.
    fn default() -> Self {
        PadGemm {
            min_flops: (1u64 << 33) as f64,
            flops_per_copied_byte: 256.0,
        }
    }
}

impl PadGemm {
    /// Pads every misaligned 16-bit product, however small (for tests and tools).
    pub fn every_size() -> Self {
        PadGemm {
            min_flops: 0.0,
            flops_per_copied_byte: 0.0,
        }
    }
}

impl Pass for PadGemm {
    fn name(&self) -> &'static str {
        "pad-gemm"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let candidates: Vec<NodeId> = g
            .node_ids()
            .filter(|&id| g.node(id).op.is::<MatMul>() && g.node(id).outputs()[0].dtype.is_half())
            .collect();
        let mut padded_operands = HashMap::new();
        let mut padded = 0;
        for id in candidates {
            if self.pad(g, id, &mut padded_operands)? {
                padded += 1;
            }
        }
        let losses: Vec<NodeId> = g
            .node_ids()
            .filter(|&id| g.node(id).op.is::<SoftmaxCrossEntropyWithGrad>())
            .collect();
        let mut unpadded = 0;
        let is_output = output_nodes(g);
        for id in losses {
            if read_padded_logits(g, id, &is_output)? {
                unpadded += 1;
            }
        }
        let lines = vec![
            format!("pad-gemm: padded {padded} 16-bit MatMuls to multiples of {GEMM_MULTIPLE}"),
            format!("pad-gemm: {unpadded} cross-entropies read padded logits and write their gradient padded"),
        ];
        Ok(summary("pad-gemm", lines))
    }
}

/// Makes the fused cross-entropy `id`, where it reads a Slice of the first columns of
/// wider logits, read those with its `classes` set; its gradient is then as wide, so
/// the pads that widened it (Concats of zero columns) go, and any other reader reads
/// a Slice of it.
fn read_padded_logits(g: &mut Graph, id: NodeId, is_output: &[bool]) -> Result<bool, PassError> {
    let Some(op) = g.node(id).op.downcast_ref::<SoftmaxCrossEntropyWithGrad>() else {
        return Ok(false);
    };
    let [logits, labels, dloss] = g.inputs(id)[..] else {
        return Ok(false);
    };
    let sliced = g.node(logits.node).op.downcast_ref::<Slice>();
    let Some(&[rows, classes]) = sliced
        .filter(|s| op.classes.is_none() && s.begin == [0, 0])
        .map(|s| &s.size[..])
    else {
        return Ok(false);
    };
    let padded = g.inputs(logits.node)[0];
    let grad = Port::new(id, 1);
    if g.ty(padded).shape.first() != Some(&(rows as usize)) || g.outputs().contains(&grad) {
        return Ok(false);
    }
    let width = g.ty(padded).shape[1];
    let op = SoftmaxCrossEntropyWithGrad {
        classes: Some(classes as usize),
        ..op.clone()
    };
    let readers = g.port_consumers(grad);
    g.set_node(id, Box::new(op), &[padded, labels, dloss])?;
    let mut stale = vec![logits.node];
    let mut rewired = Vec::new();
    let mut slice = None;
    for (reader, slot) in readers {
        // A pad of the gradient with zero columns to the logits' width: [`pad_axis`]'s.
        let padded_grad = Port::new(reader, 0);
        let is_pad = placed(g, padded_grad).is_some_and(|p| {
            (p.axis, p.start, p.piece) == (1, 0, grad) && g.ty(padded_grad).shape[1] == width
        });
        if is_pad {
            rewired.extend(
                g.consumers(reader)
                    .into_iter()
                    .map(|(r, s, _)| (r, s, grad)),
            );
            stale.push(reader);
            stale.extend(g.inputs(reader)[1..].iter().map(|p| p.node));
        } else {
            let slice = match slice {
                Some(s) => s,
                None => {
                    let name = g.fresh_name(format!("{}/classes", g.node(id).name));
                    let op = Slice::new([0, 0], [rows, classes]);
                    *slice.insert(Port::from(g.add_node(name, Box::new(op), &[grad])?))
                }
            };
            rewired.push((reader, slot, slice));
        }
    }
    g.rewire(rewired)?;
    let zeros: Vec<NodeId> = stale
        .iter()
        .filter(|&&n| g.node(n).op.is::<BroadcastTo>())
        .flat_map(|&n| g.inputs(n).into_iter().map(|p| p.node))
        .collect();
    stale.extend(zeros);
    remove_unread(g, stale, is_output)?;
    Ok(true)
}

/// `d` rounded up to a multiple of [`GEMM_MULTIPLE`].
pub(super) fn round_up(d: usize) -> usize {
    d.div_ceil(GEMM_MULTIPLE) * GEMM_MULTIPLE
}

/// Operands padded so far, by (tensor, padded shape).
type Padded = HashMap<(Port, (usize, usize)), Port>;

impl PadGemm {
    /// Pads the MatMul `id` where a leading dimension needs it and it pays: the
    /// product moves to a new node of padded operands, and `id` becomes the Slice of it
    /// (keeping its name and type).
    fn pad(&self, g: &mut Graph, id: NodeId, padded: &mut Padded) -> Result<bool, PassError> {
        let Some(&MatMul {
            transpose_a,
            transpose_b,
        }) = g.node(id).op.downcast_ref::<MatMul>()
        else {
            return Ok(false);
        };
        let [a, b] = g.inputs(id)[..] else {
            return Ok(false);
        };
        let [m, n] = g.node(id).outputs()[0].shape[..] else {
            return Ok(false);
        };
        let k = g.ty(a).shape[if transpose_a { 0 } else { 1 }];
        // The row lengths as stored: `a` is [m, k] ([k, m] transposed), `b` [k, n]
        // ([n, k] transposed), the result [m, n].
        let k_leads = !transpose_a || transpose_b;
        let pm = if transpose_a { round_up(m) } else { m };
        let pk = if k_leads { round_up(k) } else { k };
        let pn = round_up(n);
        if (pm, pk, pn) == (m, k, n) {
            return Ok(false);
        }
        let orient = |rows: usize, cols: usize, transposed: bool| {
            if transposed {
                (cols, rows)
            } else {
                (rows, cols)
            }
        };
        let (shape_a, shape_b) = (orient(pm, pk, transpose_a), orient(pk, pn, transpose_b));
        let bytes = g.ty(a).dtype.size_bytes() as f64;
        let copied = |x: Port, (rows, cols): (usize, usize)| {
            let unchanged = g.ty(x).shape[..] == [rows, cols];
            if unchanged || padded.contains_key(&(x, (rows, cols))) {
                0.0
            } else {
                (rows * cols) as f64 * bytes
            }
        };
        let sliced = if (pm, pn) == (m, n) {
            0.0
        } else {
            2.0 * (pm * pn) as f64 * bytes
        };
        let copies = copied(a, shape_a) + copied(b, shape_b) + sliced;
        let flops = 2.0 * (m * n * k) as f64;
        if flops < self.min_flops || flops < self.flops_per_copied_byte * copies {
            return Ok(false);
        }
        let stem = g.node(id).name.clone();
        let a = padded_operand(g, a, shape_a, &format!("{stem}/pad_a"), padded)?;
        let b = padded_operand(g, b, shape_b, &format!("{stem}/pad_b"), padded)?;
        let name = g.fresh_name(format!("{stem}/padded"));
        let product = g.add_node(
            name,
            Box::new(MatMul::new(transpose_a, transpose_b)),
            &[a, b],
        )?;
        let slice = Slice::new([0, 0], [m as i64, n as i64]);
        g.set_node(id, Box::new(slice), &[product.into()])?;
        Ok(true)
    }
}

/// `x` padded to `shape` ([`pad_matrix`]), once per tensor and shape.
fn padded_operand(
    g: &mut Graph,
    x: Port,
    shape: (usize, usize),
    stem: &str,
    padded: &mut Padded,
) -> Result<Port, PassError> {
    if let Some(&p) = padded.get(&(x, shape)) {
        return Ok(p);
    }
    let p = pad_matrix(g, x, shape, stem)?;
    padded.insert((x, shape), p);
    Ok(p)
}

/// `x` with zero columns, then zero rows, appended up to `rows` x `cols`.
fn pad_matrix(
    g: &mut Graph,
    x: Port,
    (rows, cols): (usize, usize),
    stem: &str,
) -> Result<Port, PassError> {
    let x = pad_axis(g, x, 1, cols, stem)?;
    pad_axis(g, x, 0, rows, stem)
}

/// `x` with zeros appended along `axis` up to `len` (`x` itself when it has that
/// length): a Concat with a zero Const, named after `stem`.
pub(super) fn pad_axis(
    g: &mut Graph,
    x: Port,
    axis: usize,
    len: usize,
    stem: &str,
) -> Result<Port, PassError> {
    let ty = g.ty(x).clone();
    if ty.shape[axis] == len {
        return Ok(x);
    }
    let mut zero_shape = ty.shape.clone();
    zero_shape[axis] = len - ty.shape[axis];
    // One zero (no values: lazily materialised, `value` absent in files) broadcast to
    // the pad's shape in the step: a batch-sized zero constant would stay resident
    // beside the variables (79 MiB of the bench convnet's input at batch 2030).
    let zero = Const {
        ty: TensorType::new(ty.dtype, vec![1; zero_shape.len()]),
        values: None,
    };
    let z = g.add_node(g.fresh_name(format!("{stem}/zero")), Box::new(zero), &[])?;
    let zeros = BroadcastTo::new(zero_shape);
    let z = g.add_node(
        g.fresh_name(format!("{stem}/zeros")),
        Box::new(zeros),
        &[z.into()],
    )?;
    let name = g.fresh_name(stem);
    let padded = g.add_node(name, Box::new(Concat::new(axis as i64)), &[x, z.into()])?;
    Ok(padded.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::ops::Placeholder;
    use ampgraph_graph::{DType, Tensor};

    fn matrix(rows: usize, cols: usize, seed: f64) -> Tensor {
        let v: Vec<f64> = (0..rows * cols)
            .map(|i| ((i as f64 * 0.37 + seed).sin() * 4.0).round() / 4.0)
            .collect();
        Tensor::from_f64(DType::F16, [rows, cols], &v).unwrap()
    }

    /// Evaluates the graph's single output from Const inputs (every node's kernel in
    /// topological order), as a test-local reference executor.
    fn eval(g: &Graph) -> Tensor {
        let mut values: std::collections::HashMap<NodeId, Tensor> = Default::default();
        for id in g.topo_order().unwrap() {
            let args: Vec<Tensor> = g
                .inputs(id)
                .iter()
                .map(|p| values[&p.node].clone())
                .collect();
            let refs: Vec<&Tensor> = args.iter().collect();
            let out = g.node(id).op.eval(&refs).unwrap().remove(0);
            values.insert(id, out);
        }
        values[&g.outputs()[0].node].clone()
    }

    #[test]
    fn pads_a_5x7_by_7x3_f16_product_and_keeps_its_values() {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut g = Graph::new();
            let a = if ta {
                matrix(7, 5, 0.1)
            } else {
                matrix(5, 7, 0.1)
            };
            let b = if tb {
                matrix(3, 7, 2.0)
            } else {
                matrix(7, 3, 2.0)
            };
            let a = g.add_node("a", Box::new(Const::new(a)), &[]).unwrap();
            let b = g.add_node("b", Box::new(Const::new(b)), &[]).unwrap();
            let mm = g
                .add_node("mm", Box::new(MatMul::new(ta, tb)), &[a.into(), b.into()])
                .unwrap();
            g.set_outputs(vec![mm.into()]).unwrap();
            let want = eval(&g);

            let s = PadGemm::every_size().run(&mut g).unwrap();
            g.validate().unwrap();
            assert_eq!(
                s.lines[0],
                "pad-gemm: padded 1 16-bit MatMuls to multiples of 8"
            );
            let padded = g.find("mm/padded").unwrap();
            let [pa, pb] = g.inputs(padded)[..] else {
                panic!()
            };
            let (sa, sb) = (&g.ty(pa).shape, &g.ty(pb).shape);
            // Only the stored row lengths pad: m = 5 where `a` is [m, k], k = 7
            // where neither operand stores rows of k.
            let (want_a, want_b) = match (ta, tb) {
                (false, false) => ([5, 8], [8, 8]),
                (true, false) => ([7, 8], [7, 8]),
                (false, true) => ([5, 8], [8, 8]),
                (true, true) => ([8, 8], [8, 8]),
            };
            assert_eq!((&sa[..], &sb[..]), (&want_a[..], &want_b[..]), "{ta} {tb}");
            assert_eq!(g.node(mm).op_name(), "Slice");
            assert_eq!(g.ty(mm.into()), &TensorType::new(DType::F16, [5, 3]));
            assert_eq!(eval(&g), want, "transpose_a {ta}, transpose_b {tb}");
            // Idempotent.
            assert_eq!(
                PadGemm::every_size().run(&mut g).unwrap().lines[0],
                "pad-gemm: padded 0 16-bit MatMuls to multiples of 8"
            );
        }
    }

    #[test]
    fn leaves_f32_and_aligned_products_alone() {
        let mut g = Graph::new();
        let x = g
            .add_node(
                "x",
                Box::new(Placeholder(TensorType::new(DType::F32, [5, 7]))),
                &[],
            )
            .unwrap();
        let y = g
            .add_node(
                "y",
                Box::new(Placeholder(TensorType::new(DType::F16, [8, 16]))),
                &[],
            )
            .unwrap();
        g.add_node(
            "f32",
            Box::new(MatMul::new(false, true)),
            &[x.into(), x.into()],
        )
        .unwrap();
        g.add_node(
            "aligned",
            Box::new(MatMul::new(true, false)),
            &[y.into(), y.into()],
        )
        .unwrap();
        let before = g.len();
        PadGemm::every_size().run(&mut g).unwrap();
        assert_eq!(g.len(), before);
    }

    /// A 16-bit LM head's step, 5 classes: logits `x w^T`, the fused cross-entropy,
    /// and the two products reading its gradient; with `other_reader`, a Neg of the
    /// gradient too.
    fn lm_head(other_reader: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F16, [6, 4]).unwrap();
        let w = g.placeholder("w", DType::F16, [5, 4]).unwrap();
        let labels = g.placeholder("labels", DType::I64, [6]).unwrap();
        let dloss = g.placeholder("dloss", DType::F32, []).unwrap();
        let logits = g.add(MatMul::new(false, true), &[x, w]).unwrap();
        let op = SoftmaxCrossEntropyWithGrad {
            grad_dtype: Some(DType::F16),
            ..Default::default()
        };
        let loss = g.add(op, &[logits, labels, dloss]).unwrap();
        let grad = Port::new(loss.node, 1);
        let dx = g.add(MatMul::new(false, false), &[grad, w]).unwrap();
        let dw = g.add(MatMul::new(true, false), &[grad, x]).unwrap();
        let mut outputs = vec![loss, dx, dw];
        if other_reader {
            let neg = ampgraph_graph::ops::Unary::new(ampgraph_graph::ops::UnaryKind::Neg);
            outputs.push(g.add(neg, &[grad]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    #[test]
    fn a_cross_entropy_reads_the_padded_logits_and_writes_its_gradient_padded() {
        let feeds = std::collections::HashMap::from([
            ("x", matrix(6, 4, 0.3)),
            ("w", matrix(5, 4, 1.7)),
            (
                "labels",
                Tensor::from_f64(DType::I64, [6], &[0.0, 4.0, 2.0, 2.0, 1.0, 3.0]).unwrap(),
            ),
            ("dloss", Tensor::scalar(DType::F32, 1024.0)),
        ]);
        for other_reader in [false, true] {
            let before = lm_head(other_reader);
            let mut g = before.clone();
            let s = PadGemm::every_size().run(&mut g).unwrap();
            g.validate().unwrap();
            assert_eq!(
                s.lines[1],
                "pad-gemm: 1 cross-entropies read padded logits and write their gradient padded"
            );
            let loss = g.outputs()[0].node;
            let op = g
                .node(loss)
                .op
                .downcast_ref::<SoftmaxCrossEntropyWithGrad>();
            assert_eq!(op.and_then(|op| op.classes), Some(5));
            let logits = g.inputs(loss)[0];
            assert!(g.node(logits.node).name.ends_with("/padded"));
            assert_eq!(g.ty(logits).shape, [6, 8]);
            // Nothing copies the logits or their gradient: the products read it as
            // it is, and only the other reader reads a Slice of it.
            let readers: Vec<&str> = (g.port_consumers(Port::new(loss, 1)).into_iter())
                .map(|(r, _)| g.node(r).op_name())
                .collect();
            let slice = ["Slice"].iter().take(other_reader as usize);
            let want: Vec<&str> = ["MatMul", "MatMul"].iter().chain(slice).copied().collect();
            assert_eq!(readers, want, "other reader {other_reader}");
            assert!(g.consumers(logits.node).len() == 1);
            assert_eq!(
                crate::testing::run(&g, &feeds),
                crate::testing::run(&before, &feeds),
                "other reader {other_reader}"
            );
        }
    }
}
