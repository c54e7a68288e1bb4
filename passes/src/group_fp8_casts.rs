//! Grouped FP8 casts of weights: the transposed delayed-scaling `QuantizeFp8`s of a
//! step's weights (a Variable, or AMP's 16-bit copy of one, cast by a scale held in a
//! Variable) that share a format and an input dtype become one [`GroupedQuantizeFp8`],
//! which the CUDA executor runs in one launch per 32 weights (TransformerEngine's
//! `multi_cast_transpose`). GPT-2's 35 weight casts took a launch each, 9 us apiece,
//! most of them too few tiles to fill the GPU. Such a cast reads nothing the step
//! computes, so the group runs where its first member ran without waiting on
//! anything, and no member can depend on another.

use ampgraph_graph::ops::{GroupedQuantizeFp8, QuantizeFp8, Variable};
use ampgraph_graph::{DType, Graph, NodeId, Port};

use crate::rewrite::{bucketed, group_buckets, is_variable_cast, node_error};
use crate::{Pass, PassError, PassSummary};

/// The `group-fp8-casts` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupFp8Casts;

/// Whether `p` is a Variable's value, or a Cast of one.
fn of_a_variable(g: &Graph, p: Port) -> bool {
    g.node(p.node).op.is::<Variable>() || is_variable_cast(g, p.node)
}

/// The casts that may share a node, by (format, input dtype), in node order: transposed,
/// of matrices with sides multiples of 8 (the tiled kernel's), without an activation,
/// of a weight by a scale held in a Variable.
fn buckets(g: &Graph) -> Vec<((DType, DType), Vec<NodeId>)> {
    bucketed(g, |id| {
        let q = g.node(id).op.downcast_ref::<QuantizeFp8>()?;
        let [x, scale] = g.inputs(id)[..] else {
            return None;
        };
        let tiled = q.tiled_sides(&g.ty(x).shape).is_some();
        let weight = of_a_variable(g, x) && g.node(scale.node).op.is::<Variable>();
        (tiled && weight && q.activation.is_none()).then_some((q.to, g.ty(x).dtype))
    })
}

impl Pass for GroupFp8Casts {
    fn name(&self) -> &'static str {
        "group-fp8-casts"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        let (groups, grouped) = group_buckets(g, buckets(g), |g, (to, _), members| {
            let op = GroupedQuantizeFp8::new(to, members.len())
                .map_err(|e| node_error(g, members[0], &e))?;
            Ok((Box::new(op), GroupedQuantizeFp8::MEMBER_OUTPUTS))
        })?;
        Ok(PassSummary {
            title: "group-fp8-casts pass summary:".into(),
            lines: vec![format!(
                "group-fp8-casts: {grouped} FP8 casts of weights in {groups} grouped nodes"
            )],
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::{assert_grouped_keeps_bits, count, run};
    use ampgraph_graph::ops::{Cast, UnaryKind};
    use ampgraph_graph::{Tensor, TensorType};

    /// A variable `name` holding `value`, fed.
    fn variable(
        g: &mut Graph,
        feeds: &mut HashMap<String, Tensor>,
        name: &str,
        value: Tensor,
    ) -> Port {
        let ty = TensorType::new(value.dtype(), value.shape().to_vec());
        feeds.insert(name.into(), value);
        g.add_node(name, Box::new(Variable::new(ty)), &[])
            .unwrap()
            .into()
    }

    /// An f32 weight of `shape` holding values from -600 to 600 (some saturate once
    /// scaled).
    fn weight(shape: &[usize], seed: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = (0..n)
            .map(|i| ((i * 37 + seed * 11) % 1201) as f64 - 600.0)
            .collect();
        Tensor::from_f64(DType::F32, shape.to_vec(), &values).unwrap()
    }

    /// Casts of weights, read through AMP's bf16 copy or directly (f32), to E4M3 or
    /// E5M2, beside casts the pass must leave: one of a placeholder, one with an
    /// activation, one of sides not multiples of 8, one not transposed.
    fn model() -> (Graph, HashMap<String, Tensor>) {
        let mut g = Graph::new();
        let mut feeds = HashMap::new();
        let mut outputs = Vec::new();
        let e4m3 = QuantizeFp8::new(DType::F8E4M3)
            .unwrap()
            .with_transposed(true);
        let e5m2 = QuantizeFp8::new(DType::F8E5M2)
            .unwrap()
            .with_transposed(true);
        let cases: [(&str, [usize; 2], bool, &QuantizeFp8); 6] = [
            ("w0", [64, 96], true, &e4m3),
            ("w1", [8, 8], true, &e4m3),
            ("w2", [72, 16], false, &e4m3),
            ("w3", [16, 24], true, &e4m3),
            ("w4", [24, 40], true, &e5m2),
            ("w5", [40, 8], true, &e5m2),
        ];
        for (k, (name, shape, cast, q)) in cases.into_iter().enumerate() {
            let w = variable(&mut g, &mut feeds, name, weight(&shape, k));
            let x = match cast {
                true => g.add(Cast { to: DType::BF16 }, &[w]).unwrap(),
                false => w,
            };
            let s = Tensor::scalar(DType::F32, 0.3 + k as f64);
            let scale = variable(&mut g, &mut feeds, &format!("{name}/scale"), s);
            let y = g.add(q.clone(), &[x, scale]).unwrap();
            outputs.extend((0..3).map(|i| Port::new(y.node, i)));
        }
        let s = Tensor::scalar(DType::F32, 0.7);
        let scale = variable(&mut g, &mut feeds, "scale", s);
        let z = g.placeholder("z", DType::BF16, [16, 16]).unwrap();
        feeds.insert(
            "z".into(),
            Tensor::from_f64(DType::BF16, vec![16, 16], &[1.5; 256]).unwrap(),
        );
        let w = variable(&mut g, &mut feeds, "odd", weight(&[12, 8], 7));
        let gelu = Some(UnaryKind::Gelu { approximate: true });
        for (x, q) in [
            (z, e4m3.clone()),
            (w, e4m3.clone()),
            (w, e4m3.clone().with_activation(gelu)),
            (w, QuantizeFp8::new(DType::F8E4M3).unwrap()),
        ] {
            let y = g.add(q, &[x, scale]).unwrap();
            outputs.extend([y, Port::new(y.node, 1)]);
        }
        g.set_outputs(outputs).unwrap();
        (g, feeds)
    }

    #[test]
    fn weights_casts_of_one_format_and_dtype_group_with_the_same_bits() {
        let (g, feeds) = model();
        let feeds: HashMap<&str, Tensor> =
            feeds.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let want = run(&g, &feeds);
        let mut grouped = g.clone();
        let summary = GroupFp8Casts.run(&mut grouped).unwrap();
        grouped.validate().unwrap();
        // bf16 to E4M3: w0, w1, w3; bf16 to E5M2: w4, w5; w2 (f32) alone, as the four
        // the pass leaves.
        assert_eq!(count(&grouped, "GroupedQuantizeFp8"), 2, "{summary}");
        assert_eq!(count(&grouped, "QuantizeFp8"), 5);
        assert!(
            summary.lines[0].contains("5 FP8 casts of weights in 2"),
            "{summary}"
        );
        assert_grouped_keeps_bits(&GroupFp8Casts, &mut grouped, &feeds, &want);
    }
}
