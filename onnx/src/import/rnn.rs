//! ONNX LSTM and GRU unrolled over their sequence, whose length import knows: per
//! direction, one product of the whole input with the input weights (and their bias),
//! then per time step a product of the hidden state with the recurrent weights and
//! the gates' elementwise ops, which the fusion passes join into a kernel a step. The
//! weights are constants (initializers, as exporters write them), transposed and
//! split per direction at import. What torch.nn.LSTM and nn.GRU export (batch_first
//! models too: the exporter transposes around the sequence-first op): the default
//! activations, no clipping, no peepholes, every sequence its full length; anything
//! else, and the batch-first layout (attribute `layout` 1, which onnxruntime does not
//! run either), is one error naming the node.

use ampgraph_graph::ops::{BiasAdd, Binary, BinaryKind, Concat, DataFormat, MatMul, Reshape};
use ampgraph_graph::ops::{Slice, Unary, UnaryKind};
use ampgraph_graph::Tensor;

use super::{NodeCx, Value};
use crate::error::Result;

/// The recurrence a node unrolls.
#[derive(Clone, Copy, PartialEq)]
enum Cell {
    /// Gates i, o, f, c (ONNX's order).
    Lstm,
    /// Gates z, r, h; `linear_before_reset` applies the reset gate after the recurrent
    /// product (PyTorch's form).
    Gru { linear_before_reset: bool },
}

impl Cell {
    fn gates(self) -> usize {
        match self {
            Cell::Lstm => 4,
            Cell::Gru { .. } => 3,
        }
    }

    /// The activations its attribute may name: the defaults, once per direction.
    fn default_activations(self) -> &'static [&'static str] {
        match self {
            Cell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
            Cell::Gru { .. } => &["Sigmoid", "Tanh"],
        }
    }
}

pub(super) fn lstm(cx: &mut NodeCx) -> Result<Vec<Value>> {
    unroll(cx, Cell::Lstm)
}

pub(super) fn gru(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let linear_before_reset = cx.int_attr("linear_before_reset", 0)? != 0;
    unroll(
        cx,
        Cell::Gru {
            linear_before_reset,
        },
    )
}

/// A constant input: the weights, biases and sequence lengths are read at import.
fn constant(cx: &NodeCx, i: usize, what: &str) -> Result<Option<Tensor>> {
    match cx.opt_input(i)? {
        None => Ok(None),
        Some(Value::Const(t)) => Ok(Some(t)),
        Some(Value::Port(_)) => Err(cx.err(format!(
            "its {what} (input {i}) must be a constant: recurrent weights computed at run time are not imported"
        ))),
    }
}

/// Rows `rows` of matrix `d` of the `[dirs, rows, cols]` constant `w`, transposed:
/// `[cols, rows.len()]`, f64 values in w's dtype.
fn transposed_block(
    cx: &NodeCx,
    w: &Tensor,
    d: usize,
    rows: std::ops::Range<usize>,
) -> Result<Value> {
    let shape = w.shape();
    let (n_rows, cols) = (shape[1], shape[2]);
    let v = w.to_f64_vec();
    let mut out = Vec::with_capacity(rows.len() * cols);
    for c in 0..cols {
        for r in rows.clone() {
            out.push(v[(d * n_rows + r) * cols + c]);
        }
    }
    let t = Tensor::from_f64(w.dtype(), vec![cols, rows.len()], &out).map_err(|m| cx.err(m))?;
    Ok(Value::Const(t))
}

/// Elements `range` of row `d` of the `[dirs, n]` constant `b`, as a vector.
fn bias_part(cx: &NodeCx, b: &Tensor, d: usize, range: std::ops::Range<usize>) -> Result<Tensor> {
    let n = b.shape()[1];
    let v = b.to_f64_vec();
    let part: Vec<f64> = range.map(|j| v[d * n + j]).collect();
    Tensor::from_f64(b.dtype(), vec![part.len()], &part).map_err(|m| cx.err(m))
}

fn add_tensors(cx: &NodeCx, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let sum: Vec<f64> = (a.to_f64_vec().iter().zip(b.to_f64_vec()))
        .map(|(x, y)| x + y)
        .collect();
    Tensor::from_f64(a.dtype(), a.shape().to_vec(), &sum).map_err(|m| cx.err(m))
}

/// One error naming the node for what the unrolling does not compute: activations
/// other than the defaults (given once per direction), clipping, the activations'
/// alpha and beta, coupled input and forget gates, the batch-first layout.
fn refuse_what_it_does_not_unroll(cx: &NodeCx, cell: Cell, directions: usize) -> Result<()> {
    if let Some(a) = cx.attr("activations") {
        let names: Vec<String> = a
            .strings
            .iter()
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        let default = cell.default_activations();
        let expected: Vec<&str> = (0..directions)
            .flat_map(|_| default.iter().copied())
            .collect();
        if names != expected {
            return Err(cx.err(format!(
                "activations {names:?}: only the defaults ({default:?} per direction) are imported"
            )));
        }
    }
    if cx.attr("clip").is_some() {
        return Err(cx.err("a clipped cell (attribute 'clip') is not imported"));
    }
    if cx.attr("activation_alpha").is_some() || cx.attr("activation_beta").is_some() {
        return Err(cx.err("activation_alpha and activation_beta are not imported"));
    }
    if cell == Cell::Lstm && cx.int_attr("input_forget", 0)? != 0 {
        return Err(cx.err("input_forget (coupled input and forget gates) is not imported"));
    }
    if cx.int_attr("layout", 0)? != 0 {
        return Err(cx.err("the batch-first layout (layout 1) is not imported"));
    }
    Ok(())
}

/// Columns `k * hidden ..` of one gate of `[batch, gates * hidden]` rows.
fn gate(cx: &mut NodeCx, hidden: usize, v: &Value, k: usize) -> Result<Value> {
    let op = Slice::new(vec![0, k * hidden], vec![-1, hidden as i64]);
    cx.emit(op, std::slice::from_ref(v))
}

fn unary(cx: &mut NodeCx, kind: UnaryKind, v: Value) -> Result<Value> {
    cx.emit(Unary::new(kind), &[v])
}

fn binary(cx: &mut NodeCx, kind: BinaryKind, a: Value, b: Value) -> Result<Value> {
    cx.emit(Binary::new(kind), &[a, b])
}

/// One LSTM step from the input's and the state's products `xt` and `hr` (gates i, o,
/// f, c) and the cell state `c`: the next hidden and cell states.
fn lstm_step(
    cx: &mut NodeCx,
    hidden: usize,
    xt: Value,
    hr: Value,
    c: Value,
) -> Result<(Value, Value)> {
    let g = binary(cx, BinaryKind::Add, xt, hr)?;
    let [gi, go, gf, gc] = [0, 1, 2, 3].map(|k| gate(cx, hidden, &g, k));
    let i = unary(cx, UnaryKind::Sigmoid, gi?)?;
    let o = unary(cx, UnaryKind::Sigmoid, go?)?;
    let f = unary(cx, UnaryKind::Sigmoid, gf?)?;
    let candidate = unary(cx, UnaryKind::Tanh, gc?)?;
    let kept = binary(cx, BinaryKind::Mul, f, c)?;
    let added = binary(cx, BinaryKind::Mul, i, candidate)?;
    let c = binary(cx, BinaryKind::Add, kept, added)?;
    let squashed = unary(cx, UnaryKind::Tanh, c.clone())?;
    Ok((binary(cx, BinaryKind::Mul, o, squashed)?, c))
}

/// Where a GRU applies its reset gate to the state's h part: to the recurrent
/// product (PyTorch's `linear_before_reset`), or to the state before its own product
/// with R's h rows (ONNX's default), which the step's product with R then leaves out.
enum Reset {
    Before,
    After(Value),
}

/// One GRU step from the input's and the state's products `xt` and `hr` (gates z, r,
/// and h with the reset before its product) and the state `h`, with the h gate's
/// recurrent bias `rbh`: the next state `(1 - z) h~ + z h`.
fn gru_step(
    cx: &mut NodeCx,
    hidden: usize,
    (xt, hr, h): (Value, Value, Value),
    (reset, rbh): &(Reset, Value),
) -> Result<Value> {
    let [xz, xr, xh] = [0, 1, 2].map(|k| gate(cx, hidden, &xt, k));
    let [hz, hrr] = [0, 1].map(|k| gate(cx, hidden, &hr, k));
    let zsum = binary(cx, BinaryKind::Add, xz?, hz?)?;
    let z = unary(cx, UnaryKind::Sigmoid, zsum)?;
    let rsum = binary(cx, BinaryKind::Add, xr?, hrr?)?;
    let r = unary(cx, UnaryKind::Sigmoid, rsum)?;
    let recurrent = match reset {
        Reset::Before => {
            let hh = gate(cx, hidden, &hr, 2)?;
            let biased = binary(cx, BinaryKind::Add, hh, rbh.clone())?;
            binary(cx, BinaryKind::Mul, r, biased)?
        }
        Reset::After(rt_h) => {
            let rh = binary(cx, BinaryKind::Mul, r, h.clone())?;
            let product = cx.emit(MatMul::new(false, false), &[rh, rt_h.clone()])?;
            binary(cx, BinaryKind::Add, product, rbh.clone())?
        }
    };
    let hsum = binary(cx, BinaryKind::Add, xh?, recurrent)?;
    let candidate = unary(cx, UnaryKind::Tanh, hsum)?;
    let dtype = cx.ty(&h).dtype;
    let one = Value::Const(Tensor::scalar(dtype, 1.0));
    let keep_new = binary(cx, BinaryKind::Sub, one, z.clone())?;
    let new = binary(cx, BinaryKind::Mul, keep_new, candidate)?;
    let old = binary(cx, BinaryKind::Mul, z, h)?;
    binary(cx, BinaryKind::Add, new, old)
}

fn unroll(cx: &mut NodeCx, cell: Cell) -> Result<Vec<Value>> {
    let hidden = cx.int_attr("hidden_size", 0)?;
    let hidden = usize::try_from(hidden)
        .ok()
        .filter(|&h| h > 0)
        .ok_or_else(|| cx.err("hidden_size must be given and positive"))?;
    let direction = cx.string_attr("direction", "forward")?;
    let directions: &[bool] = match direction.as_str() {
        "forward" => &[false],
        "reverse" => &[true],
        "bidirectional" => &[false, true],
        other => return Err(cx.err(format!("direction '{other}' is not an ONNX direction"))),
    };
    refuse_what_it_does_not_unroll(cx, cell, directions.len())?;
    let x = cx.input(0)?;
    let xt = cx.ty(&x);
    let [seq, batch, input] = xt.shape[..] else {
        return Err(cx.err(format!("X of shape {:?}: [seq, batch, input]", xt.shape)));
    };
    let gates = cell.gates();
    let dirs = directions.len();
    let w = constant(cx, 1, "W")?.ok_or_else(|| cx.err("W is missing"))?;
    let r = constant(cx, 2, "R")?.ok_or_else(|| cx.err("R is missing"))?;
    let want_w = [dirs, gates * hidden, input];
    let want_r = [dirs, gates * hidden, hidden];
    if w.shape() != want_w || r.shape() != want_r {
        return Err(cx.err(format!(
            "W {:?} and R {:?} must be {want_w:?} and {want_r:?}",
            w.shape(),
            r.shape()
        )));
    }
    let zeros = |n: usize| Tensor::from_f64(w.dtype(), vec![dirs, n], &vec![0.0; dirs * n]);
    let bias = match constant(cx, 3, "B")? {
        Some(b) if b.shape() == [dirs, 2 * gates * hidden] => b,
        Some(b) => {
            return Err(cx.err(format!(
                "B {:?} must be [{dirs}, {}]",
                b.shape(),
                2 * gates * hidden
            )))
        }
        None => zeros(2 * gates * hidden).map_err(|m| cx.err(m))?,
    };
    if let Some(lens) = constant(cx, 4, "sequence_lens")? {
        let full = lens
            .to_i64_vec()
            .is_some_and(|v| v.iter().all(|&l| l == seq as i64));
        if !full {
            return Err(cx.err(format!(
                "sequence_lens {:?}: only sequences of the full length {seq} are imported",
                lens.to_i64_vec().unwrap_or_default()
            )));
        }
    }
    if cell == Cell::Lstm && cx.opt_input(7)?.is_some() {
        return Err(cx.err("peepholes (input P) are not imported"));
    }
    // Initial states: [dirs, batch, hidden].
    let (h0, c0) = (cx.opt_input(5)?, cx.opt_input(6)?);
    let state_of = |cx: &mut NodeCx, v: &Option<Value>, d: usize| -> Result<Value> {
        match v {
            Some(v) => {
                let part = cx.emit(
                    Slice::new(vec![d, 0, 0], vec![1, -1, -1]),
                    std::slice::from_ref(v),
                )?;
                cx.emit(Reshape::new(vec![batch as i64, hidden as i64]), &[part])
            }
            None => {
                let t =
                    Tensor::from_f64(w.dtype(), vec![batch, hidden], &vec![0.0; batch * hidden]);
                Ok(Value::Const(t.map_err(|m| cx.err(m))?))
            }
        }
    };
    let gh = gates * hidden;
    let rows = cx.emit(Reshape::new(vec![(seq * batch) as i64, input as i64]), &[x])?;
    let (mut ys, mut last_h, mut last_c) = (Vec::new(), Vec::new(), Vec::new());
    for (d, &reverse) in directions.iter().enumerate() {
        // The input's products for every step at once, with the biases they take:
        // both of the LSTM's, the GRU's z and r both and h's input one (its recurrent
        // one goes inside the reset gate with linear_before_reset).
        let wt = transposed_block(cx, &w, d, 0..gh)?;
        let (wb, rb) = (
            bias_part(cx, &bias, d, 0..gh)?,
            bias_part(cx, &bias, d, gh..2 * gh)?,
        );
        let mut input_bias = add_tensors(cx, &wb, &rb)?;
        // The state's product with R, all its rows but a GRU's h rows where the reset
        // comes before their product; the GRU's h gate takes its input bias here and
        // its recurrent one (`rbh`) in the step.
        let (rt, gru) = match cell {
            Cell::Lstm => (transposed_block(cx, &r, d, 0..gh)?, None),
            Cell::Gru {
                linear_before_reset,
            } => {
                let mut joined = input_bias.to_f64_vec();
                joined[2 * hidden..].copy_from_slice(&wb.to_f64_vec()[2 * hidden..]);
                input_bias =
                    Tensor::from_f64(w.dtype(), vec![gh], &joined).map_err(|m| cx.err(m))?;
                let rbh = Value::Const(bias_part(cx, &bias, d, gh + 2 * hidden..2 * gh)?);
                if linear_before_reset {
                    let rt = transposed_block(cx, &r, d, 0..gh)?;
                    (rt, Some((Reset::Before, rbh)))
                } else {
                    let rt = transposed_block(cx, &r, d, 0..2 * hidden)?;
                    let rt_h = transposed_block(cx, &r, d, 2 * hidden..gh)?;
                    (rt, Some((Reset::After(rt_h), rbh)))
                }
            }
        };
        let xw = cx.emit(MatMul::new(false, false), &[rows.clone(), wt])?;
        let bias_add = BiasAdd {
            data_format: DataFormat::Nhwc,
        };
        let xw = cx.emit(bias_add, &[xw, Value::Const(input_bias)])?;
        let xw = cx.emit(
            Reshape::new(vec![seq as i64, batch as i64, gh as i64]),
            &[xw],
        )?;
        let mut h = state_of(cx, &h0, d)?;
        let mut c = state_of(cx, &c0, d)?;
        let mut outputs: Vec<Option<Value>> = vec![None; seq];
        let steps: Vec<usize> = if reverse {
            (0..seq).rev().collect()
        } else {
            (0..seq).collect()
        };
        for t in steps {
            let xt = cx.emit(
                Slice::new(vec![t, 0, 0], vec![1, -1, -1]),
                std::slice::from_ref(&xw),
            )?;
            let xt = cx.emit(Reshape::new(vec![batch as i64, gh as i64]), &[xt])?;
            let hr = cx.emit(MatMul::new(false, false), &[h.clone(), rt.clone()])?;
            match &gru {
                None => (h, c) = lstm_step(cx, hidden, xt, hr, c)?,
                Some(gru) => h = gru_step(cx, hidden, (xt, hr, h), gru)?,
            }
            outputs[t] = Some(cx.emit(
                Reshape::new(vec![1, 1, batch as i64, hidden as i64]),
                std::slice::from_ref(&h),
            )?);
        }
        let steps: Vec<Value> = outputs.into_iter().flatten().collect();
        ys.push(cx.emit(Concat::new(0), &steps)?);
        let state = |cx: &mut NodeCx, v: Value| {
            cx.emit(Reshape::new(vec![1, batch as i64, hidden as i64]), &[v])
        };
        last_h.push(state(cx, h)?);
        if cell == Cell::Lstm {
            last_c.push(state(cx, c)?);
        }
    }
    // Y [seq, dirs, batch, hidden], Y_h and Y_c [dirs, batch, hidden].
    let mut out = vec![cx.emit_out(0, Concat::new(1), &ys)?];
    let wanted = cx.node.output.len();
    if wanted > 1 {
        out.push(cx.emit_out(1, Concat::new(0), &last_h)?);
    }
    if wanted > 2 && cell == Cell::Lstm {
        out.push(cx.emit_out(2, Concat::new(0), &last_c)?);
    }
    Ok(out)
}
