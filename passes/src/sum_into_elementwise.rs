//! Column sums taken into the elementwise kernel that computes or reads their operand:
//! a `Sum` over every axis but the last (a bias gradient) of a tensor that a
//! `FusedElementwise` node or a lone elementwise node produces, or else reads whole,
//! becomes one more output of that node ([`FusedElementwise::with_column_sums`]). The
//! kernel adds each value up as it stores or loads it, so the sum no longer reads the
//! tensor from memory on its own, and its launches go. After fp16 AMP, each hidden
//! layer's bias gradient is summed by the kernel computing the activation's gradient,
//! and the output layer's by the cast of the loss gradient to f16. A kernel that
//! depends on the sum itself never takes it, nor one that no output needs (dead code
//! would come back to life). A value the node stored only for the sums it now takes
//! (a batch norm's square of `x`) is no longer stored: a program may output its
//! column sums alone.
//!
//! Sums that accumulate and store in the program's column-sum type (f32 for
//! f16/bf16/f32 operands, after `cast-into-reduce` has given f16 bias gradients their
//! f32 output; f64 for f64) fold, so the result is the Sum's; a 16-bit sum of a 16-bit
//! tensor (BF16 AMP's bias gradients) becomes a Cast of the f32 sum, which rounds as
//! the Sum does. A Sum that is a graph output stays.

use crate::rewrite::reachable_from;
use ampgraph_graph::graph::Adjacency;
use ampgraph_graph::ops::fused::{column_sum_dtype, Expr, MAX_COLUMN_SUMS};
use ampgraph_graph::ops::{Cast, FusedElementwise, Reduce, ReduceKind};
use ampgraph_graph::{DType, Graph, NodeId, Port};

use crate::fuse::{fusible, program, record_members};
use crate::rewrite::{output_nodes, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `sum-into-elementwise` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct SumIntoElementwise;

/// Whether `reduce`, reading a tensor of that rank and dtype, is a column sum.
pub(crate) fn is_column_sum(reduce: &Reduce, rank: usize, dtype: DType) -> bool {
    reduce.kind == ReduceKind::Sum
        && !reduce.keep_dims
        && rank >= 2
        && reduce
            .reduced_axes(rank)
            .is_ok_and(|axes| axes.iter().copied().eq(0..rank - 1))
        && reduce.output_dtype(dtype) == column_sum_dtype(dtype)
}

/// Whether `reduce`, reading a 16-bit tensor of that rank, is a column sum stored in
/// that dtype (BF16 AMP's bias gradients: Sum is on its infer list). It sums in f32
/// and rounds once more, so it is the f32 column sum cast to the dtype: f64 sums
/// rounded to f32, then to 16 bits, as the Sum stores them.
fn is_narrow_column_sum(reduce: &Reduce, rank: usize, dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && reduce.output_dtype(dtype) == dtype
        && is_column_sum(&reduce.clone().with_output(DType::F32), rank, dtype)
}

/// Whether `reduce` is a column sum a kernel's f32 column sum gives: the same, or cast
/// to 16 bits.
pub(crate) fn is_any_column_sum(reduce: &Reduce, rank: usize, dtype: DType) -> bool {
    is_column_sum(reduce, rank, dtype) || is_narrow_column_sum(reduce, rank, dtype)
}

/// Where the kernel that takes a column sum finds the summed tensor.
#[derive(Clone, Copy, Debug)]
enum Operand {
    /// Its own output (a port of the kernel's node).
    Output(Port),
    /// A tensor it reads whole (another node's output).
    Read(Port),
}

impl Operand {
    fn port(self) -> Port {
        match self {
            Operand::Output(p) | Operand::Read(p) => p,
        }
    }

    /// The program value holding the tensor, if the program has it at full size.
    fn value(self, op: &FusedElementwise, inputs: &[Port]) -> Option<usize> {
        let v = match self {
            Operand::Output(p) => *op.outputs().get(p.index)?,
            Operand::Read(p) => {
                let k = inputs.iter().position(|&q| q == p)?;
                op.instrs()
                    .iter()
                    .position(|ins| matches!(ins.expr, Expr::Input(i) if i == k))?
            }
        };
        (op.instrs()[v].ty.checked_len() == Some(op.domain_len())).then_some(v)
    }
}

/// The kernel that can take the column sum `sum` of `x`: the fused or lone
/// elementwise node producing `x`, or else one reading `x` whole that an output needs
/// and that depends on no column sum (`downstream`).
fn summing_kernel(
    g: &Graph,
    live: &[bool],
    downstream: &[bool],
    sum: NodeId,
    x: Port,
) -> Option<(NodeId, Operand)> {
    let elementwise = |id: NodeId| {
        let node = g.node(id);
        match node.op.downcast_ref::<FusedElementwise>() {
            Some(f) => Some(f.domain_len()),
            None => fusible(g, id, &g.inputs(id))
                .then(|| node.outputs()[0].checked_len())
                .flatten(),
        }
    };
    let producer = g.node(x.node);
    let own_output = match producer.op.downcast_ref::<FusedElementwise>() {
        Some(f) => x.index < f.outputs().len(),
        None => elementwise(x.node).is_some(),
    };
    if own_output {
        return Some((x.node, Operand::Output(x)));
    }
    let len = g.ty(x).checked_len()?;
    // Only a reader that an output needs: dead code would come back to life.
    let mut readers: Vec<NodeId> = g
        .consumers(x.node)
        .into_iter()
        .filter(|&(c, _, p)| p == x && c != sum && elementwise(c) == Some(len) && live[c.index()])
        .map(|(c, _, _)| c)
        .collect();
    readers.sort();
    readers.dedup();
    let reader = readers.into_iter().find(|r| !downstream[r.index()])?;
    Some((reader, Operand::Read(x)))
}

/// The program a producer runs with its column sums: a fused node's own, or a lone
/// elementwise node's one instruction (with its inputs, in order).
pub(crate) fn producer_program(
    g: &Graph,
    adj: &Adjacency,
    id: NodeId,
) -> Option<(FusedElementwise, Vec<Port>)> {
    let node = g.node(id);
    if let Some(f) = node.op.downcast_ref::<FusedElementwise>() {
        return Some((f.clone(), adj.inputs(id).to_vec()));
    }
    if !fusible(g, id, adj.inputs(id)) {
        return None;
    }
    let fused = program(g, adj, &[id], |m| m == id, |_| true).ok()?;
    Some((fused.op, fused.inputs))
}

/// Drops the outputs of the fused program `id` that nothing reads (and the graph does
/// not output), its readers' ports renumbered: the bytes no longer written.
fn drop_unread_outputs(g: &mut Graph, id: NodeId) -> Result<u64, PassError> {
    let Some(op) = g.node(id).op.downcast_ref::<FusedElementwise>() else {
        return Ok(0);
    };
    let total = op.outputs().len() + op.column_sums().len() + op.amaxes().len();
    let mut read = vec![false; total];
    for port in (g.consumers(id).into_iter().map(|c| c.2)).chain(g.outputs().iter().copied()) {
        if port.node == id {
            read[port.index] = true;
        }
    }
    let stored = op.outputs().len();
    if read[..stored].iter().all(|&r| r) {
        return Ok(0);
    }
    let kept = op
        .retain_outputs(|o| read[o])
        .map_err(|e| PassError::Rewrite(format!("'{}': {e}", g.node(id).name)))?;
    let unwritten: u64 = (0..stored)
        .filter(|&o| !read[o])
        .map(|o| g.node(id).outputs()[o].size_bytes() as u64)
        .sum();
    // Every output read keeps its order: each moves down by the unread ones before it
    // (so to a port the node has now as well).
    let new_index: Vec<usize> = (0..total)
        .scan(0, |next, o| {
            let index = *next;
            *next += usize::from(read[o] || o >= stored);
            Some(index)
        })
        .collect();
    let moves: Vec<(NodeId, usize, Port)> = (g.consumers(id).into_iter())
        .filter(|c| new_index[c.2.index] != c.2.index)
        .map(|(reader, slot, port)| (reader, slot, Port::new(id, new_index[port.index])))
        .collect();
    g.rewire(moves)?;
    if g.outputs()
        .iter()
        .any(|p| p.node == id && new_index[p.index] != p.index)
    {
        let outputs: Vec<Port> = (g.outputs().iter())
            .map(|&p| match p.node == id {
                true => Port::new(id, new_index[p.index]),
                false => p,
            })
            .collect();
        g.set_outputs(outputs)?;
    }
    let inputs = g.inputs(id);
    g.set_node(id, Box::new(kept), &inputs)?;
    Ok(unwritten)
}

impl Pass for SumIntoElementwise {
    fn name(&self) -> &'static str {
        "sum-into-elementwise"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let sums: Vec<(NodeId, Port)> = g
            .node_ids()
            .filter_map(|id| {
                let reduce = g.node(id).op.downcast_ref::<Reduce>()?;
                let [x] = g.inputs(id)[..] else {
                    return None;
                };
                let (rank, dtype) = (g.ty(x).rank(), g.ty(x).dtype);
                let summed = is_any_column_sum(reduce, rank, dtype);
                (!is_output[id.index()] && summed).then_some((id, x))
            })
            .collect();
        let live = g.needed_by(g.outputs());
        // What depends on any of them: a kernel reading an operand whole must not (it
        // would compute its own input, or two such kernels each other's).
        let downstream = reachable_from(g, sums.iter().map(|&(id, _)| id));
        // The column sums each kernel takes: (sum node, where its operand is).
        let mut taken: Vec<(NodeId, Vec<(NodeId, Operand)>)> = Vec::new();
        for (id, x) in sums {
            let Some((kernel, operand)) = summing_kernel(g, &live, &downstream, id, x) else {
                continue;
            };
            match taken.iter_mut().find(|(k, _)| *k == kernel) {
                Some((_, sums)) => sums.push((id, operand)),
                None => taken.push((kernel, vec![(id, operand)])),
            }
        }
        // Kernels keep their inputs: one adjacency serves every rewrite below.
        let adj = g.adjacency();
        let (mut folded, mut bytes) = (0usize, 0u64);
        let mut rewired = Vec::new();
        let mut removed = Vec::new();
        let mut producers = Vec::new();
        for (producer, sums) in taken {
            let Some((op, inputs)) = producer_program(g, &adj, producer) else {
                continue;
            };
            let first_sum = op.outputs().len() + op.column_sums().len();
            // One dtype and at most MAX_COLUMN_SUMS sums per program; the rest stay.
            let dtype_of = |v: usize| column_sum_dtype(op.instrs()[v].ty.dtype);
            let mut all = op.column_sums().to_vec();
            let mut dtype = all.first().map(|&v| dtype_of(v));
            let mut kept = Vec::new();
            for (sum, operand) in sums {
                let Some(v) = operand.value(&op, &inputs) else {
                    continue;
                };
                if all.len() < MAX_COLUMN_SUMS && *dtype.get_or_insert(dtype_of(v)) == dtype_of(v) {
                    all.push(v);
                    kept.push((sum, operand.port()));
                }
            }
            let sums = kept;
            if sums.is_empty() {
                continue;
            }
            let op = op
                .with_column_sums(all)
                .map_err(|e| PassError::Rewrite(format!("'{}': {e}", g.node(producer).name)))?;
            let mut narrowed = Vec::new();
            for (k, &(sum, x)) in sums.iter().enumerate() {
                bytes += g.ty(x).size_bytes() as u64;
                let column_sum = Port::new(producer, first_sum + k);
                // A sum stored narrower than the kernel's is cast to its own dtype.
                let stored = g.node(sum).outputs()[0].dtype;
                if stored != column_sum_dtype(g.ty(x).dtype) {
                    narrowed.push((sum, stored, column_sum));
                    continue;
                }
                for (reader, slot, _) in g.consumers(sum) {
                    rewired.push((reader, slot, column_sum));
                }
                removed.push(sum);
            }
            g.set_node(producer, Box::new(op), &inputs)?;
            // A narrow sum becomes the cast of the kernel's f32 sum (a kernel of one
            // row's values).
            for (sum, to, column_sum) in narrowed {
                g.set_node(sum, Box::new(Cast { to }), &[column_sum])?;
            }
            producers.push(producer);
            let summed: Vec<NodeId> = sums.iter().map(|&(sum, _)| sum).collect();
            record_members(g, producer, producer, &summed);
            folded += sums.len();
        }
        g.rewire(rewired)?;
        for id in removed {
            g.remove_node(id)?;
        }
        // A value written only for the sum now taken (a batch norm's square of x) is
        // not written at all.
        let mut unwritten = 0;
        for &producer in &producers {
            unwritten += drop_unread_outputs(g, producer)?;
        }
        let lines = vec![
            format!(
                "sum-into-elementwise: {folded} column sums computed by the elementwise kernel producing their operand ({folded} reductions fewer per run)"
            ),
            format!(
                "sum-into-elementwise: {} of tensors no longer read back, {} no longer written (values only summed)",
                format_bytes(bytes),
                format_bytes(unwritten)
            ),
        ];
        Ok(summary("sum-into-elementwise", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, run as run_cpu};
    use ampgraph_graph::ops::{MatMul, Unary, UnaryGrad, UnaryKind};
    use ampgraph_graph::Tensor;

    /// The backward of `gelu(x w + b)` in f16 as AMP leaves it: `dz = gelu'(z) * dy`,
    /// the bias gradient `Sum<to=f32>(dz)` (read by a Neg) and `dx = dz w^T` (dz has a
    /// second reader).
    fn backward(sum: Reduce) -> Graph {
        let mut g = Graph::new();
        let z = g.placeholder("z", DType::F16, [16, 8]).unwrap();
        let dy = g.placeholder("dy", DType::F16, [16, 8]).unwrap();
        let w = g.placeholder("w", DType::F16, [4, 8]).unwrap();
        let gelu = UnaryKind::Gelu { approximate: false };
        let dz = g.add(UnaryGrad { kind: gelu }, &[z, dy]).unwrap();
        let db = g.add(sum, &[dz]).unwrap();
        let mm = MatMul {
            transpose_b: true,
            ..MatMul::default()
        };
        let dx = g.add(mm, &[dz, w]).unwrap();
        let neg = g.add(Unary::new(UnaryKind::Neg), &[db]).unwrap();
        g.set_outputs(vec![neg, dx]).unwrap();
        g
    }

    fn bias_grad() -> Reduce {
        Reduce::new(ReduceKind::Sum, Some(vec![0]), false).with_output(DType::F32)
    }

    fn feeds() -> std::collections::HashMap<String, Tensor> {
        let ramp =
            |n: usize, k: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * k).sin() * 3.0).collect() };
        [
            ("z", vec![16, 8], ramp(128, 0.37)),
            ("dy", vec![16, 8], ramp(128, 0.91)),
            ("w", vec![4, 8], ramp(32, 0.13)),
        ]
        .into_iter()
        .map(|(name, shape, v)| {
            (
                name.to_string(),
                Tensor::from_f64(DType::F16, shape, &v).unwrap(),
            )
        })
        .collect()
    }

    #[test]
    fn a_bias_gradient_is_summed_by_the_kernel_computing_its_operand() {
        let before = backward(bias_grad());
        let mut g = before.clone();
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 column sums"), "{summary}");
        // The Sum is gone; the gradient node computes dz and its column sums.
        assert!(g.node_ids().all(|id| !g.node(id).op.is::<Reduce>()));
        let id = g
            .node_ids()
            .find(|&id| g.node(id).op.is::<FusedElementwise>())
            .unwrap();
        let f = g.node(id).op.downcast_ref::<FusedElementwise>().unwrap();
        assert_eq!(f.column_sums(), &[f.outputs()[0]]);
        assert_eq!(g.inputs(g.outputs()[0].node), &[Port::new(id, 1)]);
        // Bit-exact on the CPU, and a second run changes nothing.
        let f = feeds();
        let feeds = f.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        assert_same_bits(&run_cpu(&before, &feeds), &run_cpu(&g, &feeds));
        let text = ampgraph_graph::format::to_text(&g);
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 column sums"), "{summary}");
        assert_eq!(text, ampgraph_graph::format::to_text(&g));
    }

    /// A bias gradient summed into the gradient's own 16-bit dtype (BF16 AMP's, Sum
    /// being on its infer list) is the kernel's f32 sum cast to that dtype: the same
    /// bits.
    #[test]
    fn a_16_bit_bias_gradient_becomes_a_cast_of_the_kernels_sum() {
        let narrow = Reduce::new(ReduceKind::Sum, Some(vec![0]), false);
        let before = backward(narrow);
        let mut g = before.clone();
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 column sums"), "{summary}");
        assert!(g.node_ids().all(|id| !g.node(id).op.is::<Reduce>()));
        let cast = g.inputs(g.outputs()[0].node)[0].node;
        let op = g.node(cast).op.downcast_ref::<Cast>().unwrap();
        assert_eq!(op.to, DType::F16);
        let summing = g.inputs(cast)[0].node;
        assert!(g.node(summing).op.is::<FusedElementwise>());
        let f = feeds();
        let feeds = f.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        assert_same_bits(&run_cpu(&before, &feeds), &run_cpu(&g, &feeds));
    }

    /// A batch norm's statistics on `[N, C]` f16 values: the column sums of x in f32
    /// and of its square. After `fuse` one program casts and squares; once both sums
    /// are its own, nothing reads the square it stored, and it stores only the sums.
    #[test]
    fn a_value_only_summed_is_no_longer_written() {
        let mut before = Graph::new();
        let x = before.placeholder("x", DType::F16, [16, 8]).unwrap();
        let wide = before
            .add(ampgraph_graph::ops::Cast { to: DType::F32 }, &[x])
            .unwrap();
        let square = before.mul(wide, wide).unwrap();
        let sum = || Reduce::new(ReduceKind::Sum, Some(vec![0]), false);
        let (s1, s2) = (
            before.add(sum(), &[wide]).unwrap(),
            before.add(sum(), &[square]).unwrap(),
        );
        let (mean, mean_square) = (before.mul(s1, s1).unwrap(), before.mul(s2, s2).unwrap());
        before.set_outputs(vec![mean, mean_square]).unwrap();
        let mut g = before.clone();
        crate::fuse::Fuse.run(&mut g).unwrap();
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 2 column sums"), "{summary}");
        assert!(
            summary.lines[1].contains("1.0 KiB no longer written"),
            "{summary}"
        );
        let programs: Vec<&FusedElementwise> = (g.node_ids())
            .filter_map(|id| g.node(id).op.downcast_ref::<FusedElementwise>())
            .collect();
        let stats = programs
            .iter()
            .find(|f| !f.column_sums().is_empty())
            .unwrap();
        assert!(stats.outputs().is_empty(), "{stats}");
        let ramp: Vec<f64> = (0..128).map(|i| (i as f64 * 0.37).sin() * 3.0).collect();
        let x = Tensor::from_f64(DType::F16, vec![16, 8], &ramp).unwrap();
        let feeds = [("x", x)].into_iter().collect();
        assert_same_bits(&run_cpu(&before, &feeds), &run_cpu(&g, &feeds));
    }

    /// `g: f32[16, 8]` (a Placeholder: no kernel produces it) read by `Cast<f16>` and
    /// by its bias gradient `Sum(g)`; with `cycle`, the Sum also feeds a BiasAdd of
    /// `g`, which reads `g` whole but cannot compute its own bias.
    fn read_twice(cycle: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.placeholder("g", DType::F32, [16, 8]).unwrap();
        let half = g
            .add(ampgraph_graph::ops::Cast { to: DType::F16 }, &[x])
            .unwrap();
        let sum = Reduce::new(ReduceKind::Sum, Some(vec![0]), false);
        let db = g.add(sum, &[x]).unwrap();
        let mut outputs = vec![half, g.add(Unary::new(UnaryKind::Neg), &[db]).unwrap()];
        if cycle {
            let biased = ampgraph_graph::ops::BiasAdd {
                data_format: ampgraph_graph::ops::DataFormat::Nhwc,
            };
            outputs.push(g.add(biased, &[x, db]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    #[test]
    fn a_kernel_reading_the_operand_whole_sums_it_unless_it_depends_on_the_sum() {
        let before = read_twice(false);
        let mut g = before.clone();
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 column sums"), "{summary}");
        let id = g.outputs()[0].node;
        let f = g.node(id).op.downcast_ref::<FusedElementwise>().unwrap();
        // The sum is of the program's input (v0), the f32 tensor itself.
        assert_eq!(f.column_sums(), &[0]);
        let ramp: Vec<f64> = (0..128).map(|i| (i as f64 * 0.37).sin() * 3.0).collect();
        let x = Tensor::from_f64(DType::F32, vec![16, 8], &ramp).unwrap();
        let feeds = [("g", x)].into_iter().collect();
        assert_same_bits(&run_cpu(&before, &feeds), &run_cpu(&g, &feeds));
        // A BiasAdd of g by the sum reads g whole but needs the sum first; the Cast
        // still takes it.
        let mut g = read_twice(true);
        SumIntoElementwise.run(&mut g).unwrap();
        g.validate().unwrap();
        let fused: Vec<_> = g
            .node_ids()
            .filter(|&id| g.node(id).op.is::<FusedElementwise>())
            .map(|id| g.node(id).name.clone())
            .collect();
        assert_eq!(fused, ["cast"]);
        // With the Cast gone, nothing can take it.
        let mut g = read_twice(true);
        let outputs = g.outputs()[1..].to_vec();
        g.set_outputs(outputs).unwrap();
        let cast = g.find("cast").unwrap();
        g.remove_node(cast).unwrap();
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 column sums"), "{summary}");
        // Nor can a Cast that only dead code reads (an Exp of it that no output needs):
        // taking the sum would bring it back to life.
        let mut g = read_twice(false);
        let (cast, sum) = (g.outputs()[0], g.outputs()[1]);
        g.add(Unary::new(UnaryKind::Exp), &[cast]).unwrap();
        g.set_outputs(vec![sum]).unwrap();
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        assert!(summary.lines[0].contains(": 0 column sums"), "{summary}");
    }

    /// Two sums whose only whole readers each depend on the other sum: folding both
    /// would make the two kernels read each other. Neither folds.
    #[test]
    fn kernels_that_depend_on_a_column_sum_never_take_one() {
        use ampgraph_graph::ops::{BiasAdd, DataFormat};
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [4, 3]).unwrap();
        let y = g.placeholder("y", DType::F32, [4, 3]).unwrap();
        let s1 = g.add(bias_grad(), &[x]).unwrap();
        let s2 = g.add(bias_grad(), &[y]).unwrap();
        let n1 = g.add(Unary::new(UnaryKind::Neg), &[s1]).unwrap();
        let n2 = g.add(Unary::new(UnaryKind::Neg), &[s2]).unwrap();
        let bias = || BiasAdd {
            data_format: DataFormat::Nhwc,
        };
        let k1 = g.add(bias(), &[x, n2]).unwrap();
        let k2 = g.add(bias(), &[y, n1]).unwrap();
        g.set_outputs(vec![k1, k2]).unwrap();
        let summary = SumIntoElementwise.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 0 column sums"), "{summary}");
    }

    #[test]
    fn sums_over_other_axes_and_graph_outputs_stay() {
        let row_sum = Reduce::new(ReduceKind::Sum, Some(vec![1]), false).with_output(DType::F32);
        let kept_dims = Reduce::new(ReduceKind::Sum, Some(vec![0]), true).with_output(DType::F32);
        let mean = Reduce::new(ReduceKind::Mean, Some(vec![0]), false).with_output(DType::F32);
        for sum in [row_sum, kept_dims, mean] {
            let mut g = backward(sum.clone());
            let summary = SumIntoElementwise.run(&mut g).unwrap();
            assert!(summary.lines[0].contains(": 0 column sums"), "{sum:?}");
        }
        // A bias gradient that is itself a graph output keeps its node.
        let mut g = backward(bias_grad());
        let mut outputs = g.outputs().to_vec();
        let sum = g.inputs(outputs[0].node)[0].node;
        outputs.push(Port::new(sum, 0));
        g.set_outputs(outputs).unwrap();
        SumIntoElementwise.run(&mut g).unwrap();
        assert!(g.node(sum).op.is::<Reduce>());
    }
}
