//! Checks an op's gradient rule against central finite differences in float64, the
//! way PyTorch's `gradcheck` does: the graph `loss = sum_k sum(output_k * W_k)` with
//! fixed random weights `W_k` is differentiated by [`gradients`] and numerically.

use std::collections::HashMap;

use ampgraph_graph::autodiff::gradients;
use ampgraph_graph::ops::{Binary, BinaryKind, Const, Placeholder, Reduce, ReduceKind};
use ampgraph_graph::{DType, Graph, Op, Port, Tensor};

use crate::feeds::seeded_tensor;
use crate::{CpuExecutor, Executor};

/// The worst disagreement between the analytic and the numeric gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct GradCheck {
    pub max_abs_err: f64,
    /// Largest |analytic - numeric| / max(1, |numeric|).
    pub max_rel_err: f64,
    /// Number of gradient elements compared.
    pub checked: usize,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Differentiates `op` at `inputs` (float inputs should be f64) both ways. Every
/// float input is differentiated; integer inputs are held fixed.
pub fn check_op_gradient(
    op: Box<dyn Op>,
    inputs: &[Tensor],
    seed: u64,
) -> Result<GradCheck, String> {
    let floats: Vec<usize> = (0..inputs.len())
        .filter(|&i| inputs[i].dtype().is_float())
        .collect();
    check(op, inputs, Loss::AllOutputs, &floats, seed)
}

/// As [`check_op_gradient`], with only output 0 in the loss and only the inputs `wrt`
/// differentiated: for ops whose other outputs are statistics their rule gives no
/// gradient (batch norm's batch moments, attention's log-sum-exp).
pub fn check_output0_gradient(
    op: Box<dyn Op>,
    inputs: &[Tensor],
    wrt: &[usize],
    seed: u64,
) -> Result<GradCheck, String> {
    check(op, inputs, Loss::Output0, wrt, seed)
}

/// Which outputs the loss weighs.
#[derive(Clone, Copy, PartialEq)]
enum Loss {
    AllOutputs,
    Output0,
}

fn check(
    op: Box<dyn Op>,
    inputs: &[Tensor],
    outputs: Loss,
    wrt: &[usize],
    seed: u64,
) -> Result<GradCheck, String> {
    if inputs
        .iter()
        .any(|t| t.dtype().is_float() && t.dtype() != DType::F64)
    {
        return Err("gradcheck needs f64 float inputs".into());
    }
    let mut g = Graph::new();
    let mut placeholders = Vec::new();
    for (i, t) in inputs.iter().enumerate() {
        let p: Port = g
            .add_node(format!("in{i}"), Box::new(Placeholder(t.ty())), &[])
            .map_err(err)?
            .into();
        placeholders.push(p);
    }
    let node = g.add_node("op", op, &placeholders).map_err(err)?;
    let mut loss: Option<Port> = None;
    for k in 0..g.node(node).outputs().len() {
        let ty = g.node(node).outputs()[k].clone();
        if !ty.dtype.is_float() || (outputs == Loss::Output0 && k > 0) {
            continue;
        }
        let w = seeded_tensor(&format!("weight{k}"), &ty, seed);
        let w = g.add(Const::new(w), &[]).map_err(err)?;
        let prod = g
            .add(Binary::new(BinaryKind::Mul), &[Port::new(node, k), w])
            .map_err(err)?;
        let term = g
            .add(Reduce::new(ReduceKind::Sum, None, false), &[prod])
            .map_err(err)?;
        loss = Some(match loss {
            None => term,
            Some(l) => g
                .add(Binary::new(BinaryKind::Add), &[l, term])
                .map_err(err)?,
        });
    }
    let loss = loss.ok_or("the op has no float output")?;
    let wrt: Vec<(usize, Port)> = wrt
        .iter()
        .map(|&i| {
            let p = placeholders
                .get(i)
                .ok_or(format!("the op has no input {i}"))?;
            Ok((i, *p))
        })
        .collect::<Result<_, String>>()?;
    let wrt_ports: Vec<Port> = wrt.iter().map(|&(_, p)| p).collect();
    let grads = gradients(&mut g, loss, &wrt_ports).map_err(err)?;
    g.validate().map_err(err)?;
    let feeds = |values: &[Tensor]| -> HashMap<String, Tensor> {
        values
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("in{i}"), t.clone()))
            .collect()
    };
    let mut exec = CpuExecutor::new();
    let analytic = exec.run(&g, &feeds(inputs), &grads).map_err(err)?;
    let loss_at = |exec: &mut CpuExecutor, values: &[Tensor]| -> Result<f64, String> {
        let out = exec.run(&g, &feeds(values), &[loss]).map_err(err)?;
        Ok(out[0].to_f64_vec()[0])
    };
    let mut report = GradCheck {
        max_abs_err: 0.0,
        max_rel_err: 0.0,
        checked: 0,
    };
    for (&(i, _), grad) in wrt.iter().zip(&analytic) {
        let base = inputs[i].to_f64_vec();
        let analytic = grad.to_f64_vec();
        for j in 0..base.len() {
            let h = 1e-6 * base[j].abs().max(1.0);
            let mut values = inputs.to_vec();
            let mut shifted = |delta: f64| -> Result<f64, String> {
                let mut v = base.clone();
                v[j] += delta;
                values[i] = Tensor::from_f64(inputs[i].dtype(), inputs[i].shape().to_vec(), &v)?;
                loss_at(&mut exec, &values)
            };
            let numeric = (shifted(h)? - shifted(-h)?) / (2.0 * h);
            let abs = (analytic[j] - numeric).abs();
            report.max_abs_err = report.max_abs_err.max(abs);
            report.max_rel_err = report.max_rel_err.max(abs / numeric.abs().max(1.0));
            report.checked += 1;
        }
    }
    Ok(report)
}
