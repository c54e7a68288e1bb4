//! Casts folded into layer normalisation. `LayerNorm(Cast<f32>(x: f16), gamma, beta)`
//! reads the 16-bit x and widens it as the Cast did, and LayerNormGrad does the same
//! for its x and dy. A Cast of the LayerNorm's output that is its only reader becomes
//! the LayerNorm's `to`: the kernel rounds its result once, as the Cast did. After fp16
//! AMP, a LayerNorm that the lists keep in f32 (the transformer's first, on the f32
//! input) loses the three Cast kernels around it and its gradient.
//!
//! Only casts that lose nothing fold into the inputs ([`widens_exactly`] into gamma's
//! dtype), so the kernels see the same values. An input Cast that something else also
//! reads stays for its other readers; one left unread is removed.

use ampgraph_graph::ops::{LayerNorm, LayerNormGrad};
use ampgraph_graph::{Graph, NodeId, Port};

use super::{one_cast_dtype, widened};
use crate::rewrite::{output_nodes, remove_unread, summary};
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `cast-into-norm` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct CastIntoNorm;

impl Pass for CastIntoNorm {
    fn name(&self) -> &'static str {
        "cast-into-norm"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let is_output = output_nodes(g);
        let (mut widenings, mut narrowings) = (0usize, 0usize);
        let mut casts: Vec<NodeId> = Vec::new();
        let mut rewired = Vec::new();
        let ids: Vec<NodeId> = g.node_ids().collect();
        for id in ids {
            let node = g.node(id);
            // The inputs a widening Cast may feed: x (and LayerNormGrad's dy).
            let (widenable, ln): (&[usize], Option<LayerNorm>) =
                if let Some(ln) = node.op.downcast_ref::<LayerNorm>() {
                    (&[0], Some(ln.clone()))
                } else if node.op.is::<LayerNormGrad>() {
                    (&[0, 2], None)
                } else {
                    continue;
                };
            let mut inputs = g.inputs(id);
            let params = g.ty(inputs[1]).dtype;
            let mut changed = false;
            for &slot in widenable {
                if let Some(narrow) = widened(g, inputs[slot], params) {
                    casts.push(inputs[slot].node);
                    inputs[slot] = narrow;
                    widenings += 1;
                    changed = true;
                }
            }
            let mut op = node.op.clone();
            if let Some(mut ln) = ln.filter(|ln| ln.to.is_none() && !is_output[id.index()]) {
                // Every reader a Cast to one float dtype, none of them a graph output.
                let readers = g.consumers(id);
                let cast_nodes = readers.iter().map(|&(c, _, _)| c);
                if let Some(to) = one_cast_dtype(g, cast_nodes, &is_output, |_| true) {
                    ln.to = Some(to);
                    op = Box::new(ln);
                    changed = true;
                    for (cast, _, _) in readers {
                        for (reader, slot, _) in g.consumers(cast) {
                            rewired.push((reader, slot, Port::new(id, 0)));
                        }
                        casts.push(cast);
                        narrowings += 1;
                    }
                }
            }
            if changed {
                g.set_node(id, op, &inputs)?;
            }
        }
        g.rewire(rewired)?;
        let (removed, bytes) = remove_unread(g, casts, &is_output)?;
        let lines = vec![
            format!("cast-into-norm: {widenings} normalisation inputs read the narrow tensor a widening Cast fed them"),
            format!("cast-into-norm: {narrowings} output Casts stored by the LayerNorm itself"),
            format!(
                "cast-into-norm: removed {removed} Cast kernels ({} of tensors no longer written, and read back)",
                format_bytes(bytes as u64)
            ),
        ];
        Ok(summary("cast-into-norm", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_same_bits, count, run as run_cpu};
    use ampgraph_graph::ops::UnaryKind;
    use ampgraph_graph::ops::{Cast, Unary};
    use ampgraph_graph::{DType, Tensor};

    /// The transformer's first block after AMP: `x: f16 -> Cast<f32> -> LayerNorm (f32
    /// gamma, beta) -> Cast<f16>`, read by a Tanh (and, with `shared_input`, the f32 x
    /// read by a Neg output too), and the gradient `LayerNormGrad(Cast<f32>(x), gamma,
    /// Cast<f32>(dy))`.
    fn graph(shared_input: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F16, [6, 8]).unwrap();
        let dy = g.placeholder("dy", DType::F16, [6, 8]).unwrap();
        let gamma = g.placeholder("gamma", DType::F32, [8]).unwrap();
        let beta = g.placeholder("beta", DType::F32, [8]).unwrap();
        let wide_x = g.add(Cast { to: DType::F32 }, &[x]).unwrap();
        let y = g.add(LayerNorm::default(), &[wide_x, gamma, beta]).unwrap();
        let half = g.add(Cast { to: DType::F16 }, &[y]).unwrap();
        let t = g.add(Unary::new(UnaryKind::Tanh), &[half]).unwrap();
        let wide_dy = g.add(Cast { to: DType::F32 }, &[dy]).unwrap();
        let grad = LayerNormGrad::new(-1, 1e-5);
        let id = g
            .add_node("lngrad", Box::new(grad), &[wide_x, gamma, wide_dy])
            .unwrap();
        let mut outputs = vec![t, Port::new(id, 0), Port::new(id, 1), Port::new(id, 2)];
        if shared_input {
            outputs.push(g.add(Unary::new(UnaryKind::Neg), &[wide_x]).unwrap());
        }
        g.set_outputs(outputs).unwrap();
        g
    }

    fn feeds() -> std::collections::HashMap<&'static str, Tensor> {
        let vals =
            |n: usize, k: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * k).sin() * 2.0).collect() };
        [
            ("x", DType::F16, vec![6, 8], vals(48, 0.37)),
            ("dy", DType::F16, vec![6, 8], vals(48, 0.91)),
            ("gamma", DType::F32, vec![8], vals(8, 0.13)),
            ("beta", DType::F32, vec![8], vals(8, 0.29)),
        ]
        .into_iter()
        .map(|(n, d, s, v)| (n, Tensor::from_f64(d, s, &v).unwrap()))
        .collect()
    }

    #[test]
    fn the_casts_around_a_layer_norm_and_its_gradient_fold_bit_exactly() {
        for shared in [false, true] {
            let before = graph(shared);
            let mut g = before.clone();
            let summary = CastIntoNorm.run(&mut g).unwrap();
            g.validate().unwrap();
            assert!(
                summary.lines[0].contains(": 3 normalisation inputs"),
                "{summary}"
            );
            assert!(summary.lines[1].contains(": 1 output Casts"), "{summary}");
            // All three go, but x's widening where the Neg still reads it.
            assert_eq!(count(&g, "Cast"), usize::from(shared), "{summary}");
            let f = feeds();
            assert_same_bits(&run_cpu(&before, &f), &run_cpu(&g, &f));
            let text = ampgraph_graph::format::to_text(&g);
            let again = CastIntoNorm.run(&mut g).unwrap();
            assert!(again.lines[0].contains(": 0 "), "{again}");
            assert_eq!(text, ampgraph_graph::format::to_text(&g));
        }
    }

    #[test]
    fn an_output_cast_with_other_readers_or_a_graph_output_stays() {
        // The f32 output is also read directly: the Cast stays.
        let mut g = graph(false);
        let ln = g
            .node_ids()
            .find(|&id| g.node(id).op.is::<LayerNorm>())
            .unwrap();
        let mut outputs = g.outputs().to_vec();
        outputs.push(Port::new(ln, 0));
        g.set_outputs(outputs).unwrap();
        let summary = CastIntoNorm.run(&mut g).unwrap();
        assert!(summary.lines[1].contains(": 0 output Casts"), "{summary}");
        let op = g.node(ln).op.downcast_ref::<LayerNorm>().unwrap();
        assert_eq!(op.to, None);
    }
}
