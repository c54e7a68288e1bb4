//! The casts of master weights written by the optimizer updates.
//!
//! AMP casts each f32 variable to 16 bits where the forward pass reads it; in a
//! training step the variable is then written by an `OptimizerUpdate`. This pass sets
//! that update's `cast_to`, so the update also outputs the new value in 16 bits, from
//! the kernel that writes it (one more store per element, against a Cast kernel that
//! reads the f32 variable again next step). The Cast stays in the graph: a first step,
//! or a variable set from outside, needs it; an executor that keeps the update's cast
//! for the next step (the CUDA one does) runs it only then.

use ampgraph_graph::ops::{variable_updates, Cast, OptimizerUpdate, VariableUpdate};
use ampgraph_graph::{Graph, Port};

use crate::rewrite::summary;
use crate::{format_bytes, Pass, PassError, PassSummary};

/// The `cast-into-update` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct CastIntoUpdate;

impl Pass for CastIntoUpdate {
    fn name(&self) -> &'static str {
        "cast-into-update"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        // Each variable's writer, where it is an optimizer update's new value.
        let (mut folded, mut bytes) = (0usize, 0usize);
        for VariableUpdate {
            variable: var,
            node: update,
            ..
        } in variable_updates(g)
        {
            let var_dtype = g.ty(Port::new(var, 0)).dtype;
            // The first narrowing cast AMP made of the variable.
            let cast = g.consumers(var).into_iter().find_map(|(reader, _, _)| {
                let to = g.node(reader).op.downcast_ref::<Cast>()?.to;
                (to.is_float() && to.size_bytes() < var_dtype.size_bytes()).then_some((reader, to))
            });
            let Some((cast, to)) = cast else {
                continue;
            };
            let Some(op) = g
                .node(update)
                .op
                .downcast_ref::<OptimizerUpdate>()
                .filter(|u| u.cast_to.is_none())
            else {
                continue;
            };
            let op = OptimizerUpdate {
                cast_to: Some(to),
                ..op.clone()
            };
            let inputs = g.inputs(update).to_vec();
            g.set_node(update, Box::new(op), &inputs)?;
            bytes += g.node(cast).outputs()[0].size_bytes();
            folded += 1;
        }
        let lines = vec![format!(
            "cast-into-update: {folded} optimizer updates also write their variable's 16-bit copy ({} read by the next step's casts, which an executor keeping it no longer runs)",
            format_bytes(bytes as u64)
        )];
        Ok(summary("cast-into-update", lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::run as run_cpu;
    use ampgraph_graph::ops::{AssignVariable, Const, Rule, Variable};
    use ampgraph_graph::{DType, Tensor, TensorType};

    /// `w: f32[3]` read as f16, updated by SGD with a fed gradient.
    fn graph() -> Graph {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![3]);
        let w = g
            .add_node("w", Box::new(Variable::new(ty.clone())), &[])
            .unwrap();
        let w16 = g.add(Cast { to: DType::F16 }, &[w.into()]).unwrap();
        let grad = g.placeholder("grad", DType::F32, vec![3]).unwrap();
        let yes = g
            .add(Const::new(Tensor::scalar(DType::Bool, 1.0)), &[])
            .unwrap();
        let sgd = OptimizerUpdate::new(Rule::PLAIN_SGD, 0.5, 0.0);
        let new = g.add(sgd, &[yes, w.into(), grad]).unwrap();
        let assign = g.add(AssignVariable, &[w.into(), new]).unwrap();
        g.set_outputs(vec![w16, assign]).unwrap();
        g
    }

    #[test]
    fn the_update_writes_the_cast_of_its_new_value() {
        let before = graph();
        let mut after = before.clone();
        let s = CastIntoUpdate.run(&mut after).unwrap();
        after.validate().unwrap();
        assert!(s.lines[0].contains("1 optimizer updates"), "{:?}", s.lines);
        let update = after
            .node_ids()
            .find(|&id| after.node(id).op.is::<OptimizerUpdate>())
            .unwrap();
        let cast = Port::new(update, 1);
        assert_eq!(after.ty(cast).dtype, DType::F16);
        // The outputs are unchanged; the cast output is the new w rounded to f16.
        let w = Tensor::from_f64(DType::F32, vec![3], &[1.0, 2.5, -3.0001]).unwrap();
        let grad = Tensor::from_f64(DType::F32, vec![3], &[0.1, -0.2, 0.3]).unwrap();
        let feeds = [("w", w), ("grad", grad)].into_iter().collect();
        assert_eq!(run_cpu(&before, &feeds), run_cpu(&after, &feeds));
        let mut probe = after.clone();
        probe.set_outputs(vec![Port::new(update, 0), cast]).unwrap();
        let out = run_cpu(&probe, &feeds);
        assert_eq!(out[1], out[0].cast(DType::F16));
        // Idempotent.
        let mut again = after.clone();
        CastIntoUpdate.run(&mut again).unwrap();
        assert!(again
            .node(update)
            .op
            .downcast_ref::<OptimizerUpdate>()
            .unwrap()
            .cast_to
            .is_some());
        assert_eq!(again.len(), after.len());
    }
}
