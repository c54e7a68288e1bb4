//! Grouped optimizer updates: the OptimizerUpdates of small variables that share one
//! configuration (rule, hyperparameters, folded gradient scale and cast) and the same
//! input dtypes become one [`GroupedOptimizerUpdate`], which the CUDA executor runs
//! in one launch (PyTorch's multi-tensor optimizers do the same). The transformer's
//! 45 bias and layer-norm updates of 768 to 3072 values took a launch each, about
//! 2 us of work and 1.6 us of gap between kernels. Variables of more than
//! [`MAX_GROUPED_ELEMENTS`] values keep their own update: their launches are few and
//! each fills the GPU. LAMB's updates need norms over the whole variable and stay
//! apart too.

use ampgraph_graph::ops::{GroupedOptimizerUpdate, OptimizerUpdate, Rule};
use ampgraph_graph::{DType, Graph, NodeId};

use crate::rewrite::{bucketed, group_buckets};
use crate::{Pass, PassError, PassSummary};

/// The largest variable whose update is grouped.
pub const MAX_GROUPED_ELEMENTS: usize = 1 << 16;

/// The `group-updates` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupUpdates;

/// Updates that may share a node: one configuration and one dtype per input slot.
type Bucket = ((OptimizerUpdate, Vec<DType>), Vec<NodeId>);

/// The small updates of `g` by configuration, in node order.
fn buckets(g: &Graph) -> Vec<Bucket> {
    bucketed(g, |id| {
        let update = g.node(id).op.downcast_ref::<OptimizerUpdate>()?;
        let inputs = g.inputs(id);
        let small = inputs
            .get(1)
            .and_then(|&var| g.ty(var).checked_len())
            .is_some_and(|n| n <= MAX_GROUPED_ELEMENTS);
        let lamb = matches!(update.rule, Rule::Lamb { .. });
        let dtypes = inputs.iter().map(|&p| g.ty(p).dtype).collect();
        (small && !lamb).then(|| (update.clone(), dtypes))
    })
}

impl Pass for GroupUpdates {
    fn name(&self) -> &'static str {
        "group-updates"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        // In the first update's place, a schedule in node order runs the group where it
        // ran, and the members' gradients (a bias gradient's column sum, say) run early
        // instead of keeping what they read alive to the step's end.
        let (groups, grouped) = group_buckets(g, buckets(g), |_, (update, _), members| {
            let n_out = update.num_outputs();
            let op = GroupedOptimizerUpdate {
                update,
                members: members.len(),
            };
            Ok((Box::new(op), n_out))
        })?;
        Ok(PassSummary {
            title: "group-updates pass summary:".into(),
            lines: vec![format!(
                "group-updates: {grouped} optimizer updates of variables of at most {MAX_GROUPED_ELEMENTS} values in {groups} grouped nodes ({} launches fewer per run)",
                grouped - groups
            )],
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::testing::{assert_grouped_keeps_bits, count, run};
    use ampgraph_graph::ops::{AssignVariable, Placeholder, Variable};
    use ampgraph_graph::{Port, Tensor, TensorType};

    fn momentum(learning_rate: f64) -> OptimizerUpdate {
        let rule = Rule::Sgd {
            momentum: 0.9,
            nesterov: false,
        };
        OptimizerUpdate::new(rule, learning_rate, 0.0)
    }

    /// Variables `v<k>` of `sizes[k]` values with momentum slots, each updated by
    /// `updates[k]` from a fed gradient `g<k>`, the new values and slots assigned and
    /// also the graph's outputs; the feeds.
    fn model(sizes: &[usize], updates: &[OptimizerUpdate]) -> (Graph, HashMap<String, Tensor>) {
        let mut g = Graph::new();
        let mut feeds = HashMap::new();
        let finite = g.scalar(DType::Bool, 1.0).unwrap();
        let mut outputs = Vec::new();
        for (k, (&n, update)) in sizes.iter().zip(updates).enumerate() {
            let ty = TensorType::new(DType::F32, vec![n]);
            let mut node = |g: &mut Graph, name: String, op: Box<dyn ampgraph_graph::Op>| {
                let values: Vec<f64> = (0..n).map(|i| ((i * 7 + k) % 11) as f64 - 5.0).collect();
                feeds.insert(
                    name.clone(),
                    Tensor::from_f64(DType::F32, vec![n], &values).unwrap(),
                );
                Port::from(g.add_node(name, op, &[]).unwrap())
            };
            let v = node(&mut g, format!("v{k}"), Box::new(Variable::new(ty.clone())));
            let m = node(
                &mut g,
                format!("v{k}/momentum"),
                Box::new(Variable::new(ty.clone())),
            );
            let grad = node(&mut g, format!("g{k}"), Box::new(Placeholder(ty)));
            let next = g.add(update.clone(), &[finite, v, grad, m]).unwrap();
            let slot = Port::new(next.node, 1);
            for (target, value) in [(v, next), (m, slot)] {
                g.add(AssignVariable, &[target, value]).unwrap();
            }
            outputs.extend([next, slot]);
        }
        g.set_outputs(outputs).unwrap();
        (g, feeds)
    }

    #[test]
    fn small_updates_of_one_configuration_group_with_the_same_values() {
        let big = MAX_GROUPED_ELEMENTS + 1;
        let sizes = [3, 768, big, 5, 2, 4];
        let updates = [
            momentum(0.1),
            momentum(0.1),
            momentum(0.1),
            momentum(0.2),
            momentum(0.1),
            momentum(0.2),
        ];
        let (g, feeds) = model(&sizes, &updates);
        let feeds: HashMap<&str, Tensor> =
            feeds.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let want = run(&g, &feeds);
        let first_update = g
            .node_ids()
            .find(|&id| g.node(id).op.is::<OptimizerUpdate>())
            .unwrap();
        let mut grouped = g.clone();
        let summary = GroupUpdates.run(&mut grouped).unwrap();
        grouped.validate().unwrap();
        // Sizes 3, 768 and 2 at 0.1; 5 and 4 at 0.2; the big one alone.
        assert_eq!(count(&grouped, "GroupedOptimizerUpdate"), 2, "{summary}");
        assert_eq!(count(&grouped, "OptimizerUpdate"), 1);
        assert!(
            summary.lines[0].contains("5 optimizer updates"),
            "{summary}"
        );
        assert!(summary.lines[0].contains("(3 launches fewer"), "{summary}");
        // The first group took its first member's place and name.
        let first = grouped.node(first_update);
        assert!(first.op.is::<GroupedOptimizerUpdate>());
        assert_eq!(first.name, g.node(first_update).name);
        assert_grouped_keeps_bits(&GroupUpdates, &mut grouped, &feeds, &want);
    }

    #[test]
    fn lamb_single_and_chained_updates_stay_apart() {
        let lamb = OptimizerUpdate::new(
            Rule::Lamb {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-6,
            },
            0.1,
            0.0,
        );
        // LAMB has two slots and a step; only the update's own nodes matter here.
        let mut g = Graph::new();
        let finite = g.scalar(DType::Bool, 1.0).unwrap();
        let step = g.scalar(DType::F32, 1.0).unwrap();
        let x = g.placeholder("x", DType::F32, [4]).unwrap();
        for _ in 0..2 {
            let out = g.add(lamb.clone(), &[finite, x, x, x, x, step]).unwrap();
            let mut outputs = g.outputs().to_vec();
            outputs.push(out);
            g.set_outputs(outputs).unwrap();
        }
        let (mut one, _) = model(&[3], &[momentum(0.1)]);
        // The second update's gradient is the first's new value.
        let (mut chained, _) = model(&[3, 3], &[momentum(0.1), momentum(0.1)]);
        let updates: Vec<NodeId> = chained
            .node_ids()
            .filter(|&id| chained.node(id).op.is::<OptimizerUpdate>())
            .collect();
        chained
            .set_input(updates[1], 2, Port::new(updates[0], 0))
            .unwrap();
        for g in [&mut g, &mut one, &mut chained] {
            let before = g.len();
            GroupUpdates.run(g).unwrap();
            assert_eq!(g.len(), before);
            assert_eq!(count(g, "GroupedOptimizerUpdate"), 0);
        }
    }
}
