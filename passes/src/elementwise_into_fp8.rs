//! A fused elementwise program whose one stored value only a delayed-scaling FP8 cast
//! reads becomes that cast's prologue ([`FusedQuantizeFp8`]): the cast's kernel
//! computes the value as it loads each tile, and the program's column sums come out
//! of the same kernel. In the FP8 mlp's backward pass each hidden layer's GELU
//! gradient (and its bias gradient) is computed by the E5M2 cast-transpose that reads
//! it (TransformerEngine's `dgelu_cast_transpose_dbias`): the 16-bit gradient, 64 MiB
//! a layer, is no longer written and read back.
//!
//! A tensor no program computes (an attention gradient) whose readers are the cast
//! and column Sums (its bias gradient) has those sums taken by the cast likewise: its
//! prologue is the program that only loads it, with one column sum. GPT-2's qkv
//! gradient, [16384, 2304] in bf16, is then read once a layer, not twice.
//!
//! Only where the CUDA kernel takes it: a transposed cast of a matrix whose sides are
//! multiples of 8, from a program whose inputs all have its element count. Under
//! current scaling the value's amax is read first (`amax-into-elementwise` gives the
//! program an amax), so such programs stay. Bit-exact on the CPU: the op runs the
//! program, then the cast; a Sum stored in 16 bits becomes the Cast of the f32 column
//! sum, which rounds as it did (`sum-into-elementwise` likewise).

use ampgraph_graph::ops::fused::{column_sum_dtype, Expr, Instr};
use ampgraph_graph::ops::{Cast, FusedElementwise, FusedQuantizeFp8, QuantizeFp8, Reduce};
use ampgraph_graph::{Graph, NodeId, Port};

use crate::rewrite::{fp8_casts, read_only_by, summary};
use crate::sum_into_elementwise::is_any_column_sum;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `elementwise-into-fp8` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct ElementwiseIntoFp8;

/// The cast `cast` (a QuantizeFp8 of `x`) with the program computing `x` as its
/// prologue, where the CUDA kernel takes it: a transposed matrix with sides multiples
/// of 8, the program's inputs all of its element count, `x` read by the cast alone and
/// none of the program's outputs a graph output. The op itself refuses the rest (more
/// than one stored value, an amax, an activation of the cast's own).
fn with_prologue(g: &Graph, cast: NodeId, x: Port) -> Option<FusedQuantizeFp8> {
    let q = g.node(cast).op.downcast_ref::<QuantizeFp8>()?;
    let program = g.node(x.node).op.downcast_ref::<FusedElementwise>()?;
    let n = program.domain_len();
    let full_size = (g.inputs(x.node).iter()).all(|&p| g.ty(p).checked_len() == Some(n));
    let tiles = q.tiled_sides(&g.ty(x).shape).is_some();
    let output = g.outputs().iter().any(|p| p.node == x.node);
    let alone = x.index == 0 && read_only_by(g, x, cast, 0) && !output;
    if !(tiles && full_size && alone) {
        return None;
    }
    FusedQuantizeFp8::new(q.clone(), program.clone()).ok()
}

/// The cast `cast` of `x` summing `x`'s columns, with the Sums it replaces, where every
/// other reader of `x` is a column Sum (none a graph output, nor `x` itself) and there
/// is one at least.
fn with_column_sums(g: &Graph, cast: NodeId, x: Port) -> Option<(FusedQuantizeFp8, Vec<NodeId>)> {
    let q = g.node(cast).op.downcast_ref::<QuantizeFp8>()?;
    let outputs = g.outputs();
    if q.tiled_sides(&g.ty(x).shape).is_none() || outputs.contains(&x) {
        return None;
    }
    let ty = g.ty(x);
    let mut sums = Vec::new();
    for (reader, slot) in g.port_consumers(x) {
        if reader == cast && slot == 0 {
            continue;
        }
        let reduce = g.node(reader).op.downcast_ref::<Reduce>();
        let summed = reduce.is_some_and(|r| is_any_column_sum(r, ty.rank(), ty.dtype));
        if !summed || outputs.iter().any(|p| p.node == reader) {
            return None;
        }
        sums.push(reader);
    }
    let load = Instr {
        expr: Expr::Input(0),
        ty: ty.clone(),
    };
    let program = FusedElementwise::new(vec![load], vec![0]).ok()?;
    let program = program.with_column_sums(vec![0]).ok()?;
    let op = FusedQuantizeFp8::new(q.clone(), program).ok()?;
    (!sums.is_empty()).then_some((op, sums))
}

impl Pass for ElementwiseIntoFp8 {
    fn name(&self) -> &'static str {
        "elementwise-into-fp8"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (mut folded, mut bytes) = (0usize, 0u64);
        let (mut summed, mut sum_bytes) = (0usize, 0u64);
        for (id, x, scale) in fp8_casts(g) {
            if let Some((op, sums)) = with_column_sums(g, id, x) {
                let column_sum = Port::new(id, op.cast_outputs());
                g.set_node(id, Box::new(op), &[x, scale])?;
                for sum in sums {
                    // A sum stored narrower than the kernel's is cast to its own dtype.
                    let stored = g.node(sum).outputs()[0].dtype;
                    if stored != column_sum_dtype(g.ty(x).dtype) {
                        g.set_node(sum, Box::new(Cast { to: stored }), &[column_sum])?;
                        continue;
                    }
                    let readers = g.consumers(sum).into_iter();
                    g.rewire(readers.map(|(r, slot, _)| (r, slot, column_sum)).collect())?;
                    g.remove_node(sum)?;
                }
                sum_bytes += g.ty(x).size_bytes() as u64;
                summed += 1;
                continue;
            }
            let Some(op) = with_prologue(g, id, x) else {
                continue;
            };
            let first_sum = op.cast_outputs();
            let mut inputs = g.inputs(x.node).to_vec();
            inputs.push(scale);
            // The program's column sums come from the cast now.
            let moves: Vec<(NodeId, usize, Port)> = (g.consumers(x.node).into_iter())
                .filter(|c| c.2.index > 0)
                .map(|(reader, slot, p)| (reader, slot, Port::new(id, first_sum + p.index - 1)))
                .collect();
            bytes += 2 * g.ty(x).size_bytes() as u64;
            g.set_node(id, Box::new(op), &inputs)?;
            g.rewire(moves)?;
            g.remove_node(x.node)?;
            folded += 1;
        }
        let lines = vec![
            format!(
                "elementwise-into-fp8: {folded} fused programs computed by the FP8 cast reading them ({} fewer written and read back)",
                format_bytes(bytes)
            ),
            format!(
                "elementwise-into-fp8: {summed} tensors' column sums computed by the FP8 cast reading them ({} fewer read back)",
                format_bytes(sum_bytes)
            ),
        ];
        Ok(summary("elementwise-into-fp8", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{count, run as run_cpu};
    use ampgraph_graph::ops::{Cast, Reduce, ReduceKind, UnaryGrad, UnaryKind};
    use ampgraph_graph::{DType, Tensor};

    /// The graph's outputs: `x`'s cast `q` (E5M2, transposed, scale 0.5) and its column
    /// sum `sum` (node `bias_sum`) read by a Neg (an update's, say: a Sum that is an
    /// output stays); with `leak`, a Neg of `x` too.
    fn cast_and_sum(g: &mut Graph, x: Port, sum: Reduce, leak: bool) {
        let bias = g.add_node("bias_sum", Box::new(sum), &[x]).unwrap();
        let neg = ampgraph_graph::ops::Unary::new(UnaryKind::Neg);
        let bias = g.add(neg.clone(), &[bias.into()]).unwrap();
        let scale = g.scalar(DType::F32, 0.5).unwrap();
        let q = QuantizeFp8::new(DType::F8E5M2)
            .unwrap()
            .with_transposed(true);
        let q = g.add_node("q", Box::new(q), &[x, scale]).unwrap();
        let mut outputs = vec![Port::new(q, 0), Port::new(q, 1), Port::new(q, 2), bias];
        if leak {
            outputs.push(g.add(neg, &[x]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
    }

    /// `q(gelu'(z) * dy)` (E5M2, transposed, a given scale) with the gradient's bias sum
    /// cast to bf16, fused as the pipeline leaves them; with `leak`, a Neg reads the
    /// gradient too; `shape` the matrix's.
    fn graph(leak: bool, shape: [usize; 2]) -> Graph {
        let mut g = Graph::new();
        let z = g.placeholder("z", DType::BF16, shape).unwrap();
        let dy = g.placeholder("dy", DType::BF16, shape).unwrap();
        let gelu = UnaryKind::Gelu { approximate: false };
        let dz = g.add(UnaryGrad::new(gelu), &[z, dy]).unwrap();
        let sum = Reduce::new(ReduceKind::Sum, Some(vec![0]), false);
        cast_and_sum(&mut g, dz, sum, leak);
        for pass in [
            &crate::fuse::Fuse as &dyn Pass,
            &crate::sum_into_elementwise::SumIntoElementwise,
        ] {
            pass.run(&mut g).unwrap();
        }
        g
    }

    fn feeds(shape: [usize; 2]) -> std::collections::HashMap<&'static str, Tensor> {
        let n = shape[0] * shape[1];
        let z: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin() * 3.0).collect();
        let dy: Vec<f64> = (0..n).map(|i| (i as f64 * 0.11).cos() * 40.0).collect();
        [
            ("z", Tensor::from_f64(DType::BF16, shape, &z).unwrap()),
            ("dy", Tensor::from_f64(DType::BF16, shape, &dy).unwrap()),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn a_gradient_read_only_by_its_cast_is_computed_by_it_with_the_same_bits() {
        let before = graph(false, [16, 24]);
        assert_eq!(count(&before, "FusedElementwise"), 1);
        let mut g = before.clone();
        let summary = ElementwiseIntoFp8.run(&mut g).unwrap();
        g.validate().unwrap();
        assert!(summary.lines[0].contains(": 1 fused programs"), "{summary}");
        assert_eq!(count(&g, "FusedElementwise"), 0);
        assert_eq!(count(&g, "FusedQuantizeFp8"), 1);
        let id = g.find("q").unwrap();
        assert_eq!(g.node(id).outputs().len(), 4, "y, amax, y^T, the bias sum");
        // The f32 bias sum, cast to bf16 as the Sum stored it.
        assert!(g.node_ids().any(|c| g.node(c).op.is::<Cast>()));
        let (want, got) = (
            run_cpu(&before, &feeds([16, 24])),
            run_cpu(&g, &feeds([16, 24])),
        );
        crate::testing::assert_same_bits(&want, &got);
        // Idempotent, and it reads back from a file.
        let mut again = g.clone();
        ElementwiseIntoFp8.run(&mut again).unwrap();
        assert_eq!(again.len(), g.len());
        use ampgraph_graph::format::{graph_from_bytes, to_json, GraphDef};
        let read = graph_from_bytes(to_json(&GraphDef::from_graph(&g)).as_bytes()).unwrap();
        crate::testing::assert_same_bits(&got, &run_cpu(&read, &feeds([16, 24])));
    }

    /// `q(a b)` (E5M2, transposed) of a product no program computes (an attention
    /// gradient), its column sum stored as `sum_to` (bf16: BF16 AMP's bias gradient;
    /// f32) read by a Neg; with `leak`, a Neg reads the product too.
    fn summed_graph(sum_to: DType, leak: bool, shape: [usize; 2]) -> Graph {
        let mut g = Graph::new();
        let a = g.placeholder("a", DType::BF16, [shape[0], 8]).unwrap();
        let b = g.placeholder("b", DType::BF16, [8, shape[1]]).unwrap();
        let x = g
            .add(ampgraph_graph::ops::MatMul::new(false, false), &[a, b])
            .unwrap();
        let sum = Reduce::new(ReduceKind::Sum, Some(vec![0]), false).with_output(sum_to);
        cast_and_sum(&mut g, x, sum, leak);
        g
    }

    fn product_feeds(shape: [usize; 2]) -> std::collections::HashMap<&'static str, Tensor> {
        let a: Vec<f64> = (0..shape[0] * 8)
            .map(|i| (i as f64 * 0.37).sin() * 3.0)
            .collect();
        let b: Vec<f64> = (0..8 * shape[1])
            .map(|i| (i as f64 * 0.11).cos() * 5.0)
            .collect();
        [
            (
                "a",
                Tensor::from_f64(DType::BF16, [shape[0], 8], &a).unwrap(),
            ),
            (
                "b",
                Tensor::from_f64(DType::BF16, [8, shape[1]], &b).unwrap(),
            ),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn a_tensors_column_sums_are_taken_by_its_cast_with_the_same_bits() {
        for sum_to in [DType::BF16, DType::F32] {
            let before = summed_graph(sum_to, false, [16, 24]);
            let mut g = before.clone();
            let summary = ElementwiseIntoFp8.run(&mut g).unwrap();
            g.validate().unwrap();
            assert!(summary.lines[1].contains(": 1 tensors"), "{summary}");
            assert_eq!(count(&g, "Sum"), 0, "{sum_to}");
            let id = g.find("q").unwrap();
            assert!(g.node(id).op.is::<FusedQuantizeFp8>());
            assert_eq!(
                g.node(id).outputs().len(),
                4,
                "y, amax, y^T, the column sum"
            );
            // A bf16 sum is the cast of the f32 one, under the Sum's name.
            let cast = g.find("bias_sum").map(|s| g.node(s).op.is::<Cast>());
            assert_eq!(cast, (sum_to == DType::BF16).then_some(true), "{sum_to}");
            let feeds = product_feeds([16, 24]);
            let (want, got) = (run_cpu(&before, &feeds), run_cpu(&g, &feeds));
            crate::testing::assert_same_bits(&want, &got);
            let mut again = g.clone();
            ElementwiseIntoFp8.run(&mut again).unwrap();
            assert_eq!(again.len(), g.len(), "idempotent");
        }
        // Another reader of the tensor, or sides not multiples of 8: nothing changes.
        for (leak, shape) in [(true, [16, 24]), (false, [16, 20])] {
            let mut g = summed_graph(DType::BF16, leak, shape);
            let summary = ElementwiseIntoFp8.run(&mut g).unwrap();
            assert!(summary.lines[1].contains(": 0 tensors"), "{summary}");
            assert_eq!((count(&g, "Sum"), count(&g, "FusedQuantizeFp8")), (1, 0));
        }
    }

    #[test]
    fn a_gradient_something_else_reads_or_of_sides_not_multiples_of_8_stays() {
        for (leak, shape) in [(true, [16, 24]), (false, [16, 20])] {
            let mut g = graph(leak, shape);
            let summary = ElementwiseIntoFp8.run(&mut g).unwrap();
            assert!(summary.lines[0].contains(": 0 fused programs"), "{summary}");
            assert_eq!(count(&g, "FusedElementwise"), 1);
        }
    }
}
