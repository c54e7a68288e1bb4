//! One converter per ONNX op: its inputs and attributes to our ops, NCHW as ONNX
//! lays images out. Semantics follow the ONNX operator docs for opset 11 onwards,
//! where the op changed between versions (`cx.opset()`).

use ampgraph_graph::ops::resize::resize_cubic as resize_cubic_values;
use ampgraph_graph::ops::{
    dilated_span, Conv2DBackpropInput, CoordinateTransform, Resize, ResizeMode,
};
use ampgraph_graph::ops::{
    AvgPool, BatchMatMul, BatchNorm, BiasAdd, Binary, BinaryKind, BroadcastTo, Cast, Compare,
    CompareKind, Concat, Const, Conv2D, DataFormat, Gather, LayerNorm, LogSoftmax, Logical,
    LogicalKind, MatMul, MaxPool, NormActivation, Not, Pad, PadMode, Padding, Reduce, ReduceKind,
    Reshape, Slice, Softmax, SoftmaxCrossEntropy, Transpose, Unary, UnaryKind, Where,
};
use ampgraph_graph::shape::{broadcast_indices, broadcast_shapes, normalize_axis};
use ampgraph_graph::tensor::strides;
use ampgraph_graph::{DType, Data, Op, Tensor, TensorType};

use super::{NodeCx, Value};
use crate::error::Result;
use crate::tensor::dtype_of;

pub(super) type Converter = fn(&mut NodeCx) -> Result<Vec<Value>>;

/// The converter of an ONNX op of the default domain.
pub(super) fn converter(op_type: &str) -> Option<Converter> {
    Some(match op_type {
        "Relu" | "Sigmoid" | "Tanh" | "Exp" | "Log" | "Sqrt" | "Neg" | "Abs" | "Erf"
        | "Reciprocal" | "Sign" | "Softplus" | "HardSwish" | "Sin" | "Cos" => unary,
        "Identity" | "Dropout" => identity,
        "Elu" | "Selu" | "LeakyRelu" | "Gelu" => unary_with_attrs,
        "HardSigmoid" => hard_sigmoid,
        "Clip" => clip,
        "Add" | "Sub" | "Mul" | "Div" | "Pow" => binary,
        "Max" | "Min" | "Sum" | "Mean" => variadic,
        "MatMul" => matmul,
        "Gemm" => gemm,
        "Conv" => conv,
        "ConvTranspose" => conv_transpose,
        "BatchNormalization" => batch_norm,
        "MaxPool" | "AveragePool" => pool,
        "GlobalAveragePool" | "GlobalMaxPool" => global_pool,
        "Flatten" => flatten,
        "Reshape" => reshape,
        "Transpose" => transpose,
        "Squeeze" => squeeze,
        "Unsqueeze" => unsqueeze,
        "Concat" => concat,
        "Slice" => slice,
        "Split" => split,
        "Shape" => shape,
        "Size" => size,
        "Cast" => cast,
        "Constant" => constant,
        "ConstantOfShape" => constant_of_shape,
        "Range" => range,
        "Expand" => expand,
        "Softmax" | "LogSoftmax" => softmax,
        "LayerNormalization" => layer_norm,
        "InstanceNormalization" => instance_norm,
        "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceL2" | "ReduceSumSquare" => {
            reduce
        }
        "Gather" => gather,
        "Where" => where_,
        "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" => compare,
        "And" | "Or" | "Xor" => logical,
        "Not" => not,
        "IsNaN" => is_nan,
        "Pad" => pad,
        "Resize" => resize,
        "Mod" => modulo,
        "GatherElements" => gather_elements,
        "GatherND" => gather_nd,
        "Ceil" | "Floor" => rounding,
        "Tile" => tile,
        "CumSum" => cumsum,
        "Trilu" => trilu,
        "ScatterND" => scatter_nd,
        "Einsum" => super::einsum::einsum,
        "SoftmaxCrossEntropyLoss" => softmax_cross_entropy,
        "DFT" => dft,
        "Col2Im" => col2im,
        "LSTM" => super::rnn::lstm,
        "ArgMax" | "ArgMin" => arg_extreme,
        "OneHot" => one_hot,
        "GRU" => super::rnn::gru,
        _ => return None,
    })
}

fn shape_i64(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&d| d as i64).collect()
}

fn i64_tensor(shape: Vec<usize>, values: Vec<i64>) -> Result<Tensor, String> {
    Tensor::new(shape, Data::I64(values))
}

fn scalar_like(dtype: DType, v: f64) -> Value {
    Value::Const(Tensor::scalar(dtype, v))
}

// ------------------------------------------------------------------ elementwise

fn unary(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let kind = match cx.node.op_type.as_str() {
        "Relu" => UnaryKind::Relu,
        "Sigmoid" => UnaryKind::Sigmoid,
        "Tanh" => UnaryKind::Tanh,
        "Exp" => UnaryKind::Exp,
        "Log" => UnaryKind::Log,
        "Sqrt" => UnaryKind::Sqrt,
        "Neg" => UnaryKind::Neg,
        "Abs" => UnaryKind::Abs,
        "Erf" => UnaryKind::Erf,
        "Reciprocal" => UnaryKind::Reciprocal,
        "Sign" => UnaryKind::Sign,
        "Softplus" => UnaryKind::Softplus,
        "Sin" => UnaryKind::Sin,
        "Cos" => UnaryKind::Cos,
        _ => UnaryKind::HardSwish,
    };
    let x = cx.input(0)?;
    if let Value::Const(t) = &x {
        if t.dtype().is_int() && matches!(kind, UnaryKind::Neg | UnaryKind::Abs) {
            let f = if kind == UnaryKind::Neg {
                |v: i64| -v
            } else {
                i64::abs
            };
            return Ok(vec![Value::Const(int_map(t, f)?)]);
        }
    }
    cx.out(Unary::new(kind), &[x])
}

fn int_map(t: &Tensor, f: impl Fn(i64) -> i64) -> Result<Tensor> {
    let v: Vec<i64> = t
        .to_i64_vec()
        .unwrap_or_default()
        .into_iter()
        .map(f)
        .collect();
    Ok(Tensor::new(t.shape().to_vec(), Data::I64(v))
        .map_err(ampgraph_graph::GraphError::Format)?
        .cast(t.dtype()))
}

/// Identity, and Dropout (inference: the input itself; its mask is not supported).
fn identity(cx: &mut NodeCx) -> Result<Vec<Value>> {
    if cx.node.op_type == "Dropout" {
        // Inference keeps every element: the ratio and the seed do not matter.
        cx.ignore(&["ratio", "seed"]);
        if let Some(t) = cx.const_input(2)? {
            if t.to_f64_vec().first().copied().unwrap_or(0.0) != 0.0 {
                return Err(cx.err("training mode is not supported"));
            }
        }
    }
    Ok(vec![cx.input(0)?])
}

fn unary_with_attrs(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let op = cx.node.op_type.clone();
    let kind = match op.as_str() {
        "LeakyRelu" => UnaryKind::LeakyRelu {
            alpha: cx.float_attr("alpha", 0.01)?,
        },
        "Gelu" => match cx.string_attr("approximate", "none")?.as_str() {
            "none" => UnaryKind::Gelu { approximate: false },
            "tanh" => UnaryKind::Gelu { approximate: true },
            other => return Err(cx.err(format!("approximate '{other}' is not supported"))),
        },
        "Elu" => {
            check_default(cx, "alpha", 1.0)?;
            UnaryKind::Elu
        }
        _ => {
            check_default(cx, "alpha", 1.673_263_2)?;
            check_default(cx, "gamma", 1.050_701)?;
            UnaryKind::Selu
        }
    };
    let x = cx.input(0)?;
    cx.out(Unary::new(kind), &[x])
}

/// Refuses a float attribute away from the only value our op computes.
fn check_default(cx: &NodeCx, name: &str, value: f32) -> Result<()> {
    let v = cx.float_attr(name, value)?;
    if (v - f64::from(value)).abs() > 1e-5 * f64::from(value).abs() {
        return Err(cx.err(format!(
            "attribute '{name}' {v} is not supported (only {value})"
        )));
    }
    Ok(())
}

/// `max(0, min(1, alpha x + beta))`: our HardSigmoid at PyTorch's constants, the
/// arithmetic otherwise.
fn hard_sigmoid(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let alpha = cx.float_attr("alpha", 0.2)?;
    let beta = cx.float_attr("beta", 0.5)?;
    let x = cx.input(0)?;
    if (alpha - 1.0 / 6.0).abs() < 1e-6 && beta == 0.5 {
        return cx.out(Unary::new(UnaryKind::HardSigmoid), &[x]);
    }
    let dtype = cx.ty(&x).dtype;
    let ax = cx.emit(
        Binary::new(BinaryKind::Mul),
        &[x, scalar_like(dtype, alpha)],
    )?;
    let shifted = cx.emit(
        Binary::new(BinaryKind::Add),
        &[ax, scalar_like(dtype, beta)],
    )?;
    let low = cx.emit(
        Binary::new(BinaryKind::Maximum),
        &[shifted, scalar_like(dtype, 0.0)],
    )?;
    cx.out(
        Binary::new(BinaryKind::Minimum),
        &[low, scalar_like(dtype, 1.0)],
    )
}

/// Clip with constant bounds: Relu6 or Relu where it is one, else Maximum/Minimum.
fn clip(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let bound = |cx: &NodeCx, i: usize| -> Result<Option<f64>> {
        Ok(cx
            .const_input(i)?
            .map(|t| t.to_f64_vec().first().copied().unwrap_or(0.0)))
    };
    let (lo, hi) = (bound(cx, 1)?, bound(cx, 2)?);
    match (lo, hi) {
        (Some(l), Some(h)) if l == 0.0 && h == 6.0 => cx.out(Unary::new(UnaryKind::Relu6), &[x]),
        (Some(0.0), None) => cx.out(Unary::new(UnaryKind::Relu), &[x]),
        (None, None) => Ok(vec![x]),
        (lo, hi) => {
            let dtype = cx.ty(&x).dtype;
            let mut y = x;
            if let Some(l) = lo {
                let op = Binary::new(BinaryKind::Maximum);
                y = match hi {
                    Some(_) => cx.emit(op, &[y, scalar_like(dtype, l)])?,
                    None => return cx.out(op, &[y, scalar_like(dtype, l)]),
                };
            }
            let h = hi.unwrap_or(f64::INFINITY);
            cx.out(
                Binary::new(BinaryKind::Minimum),
                &[y, scalar_like(dtype, h)],
            )
        }
    }
}

fn binary_kind(op: &str) -> BinaryKind {
    match op {
        "Add" | "Sum" | "Mean" => BinaryKind::Add,
        "Sub" => BinaryKind::Sub,
        "Mul" => BinaryKind::Mul,
        "Div" => BinaryKind::Div,
        "Pow" => BinaryKind::Pow,
        "Max" => BinaryKind::Maximum,
        _ => BinaryKind::Minimum,
    }
}

/// `f` over two integer constants with broadcasting, in a's dtype; `None` when either
/// is not integer.
fn int_zip(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(i64, i64) -> Result<i64, String>,
) -> Result<Option<Tensor>, String> {
    let (Some(av), Some(bv)) = (a.to_i64_vec(), b.to_i64_vec()) else {
        return Ok(None);
    };
    let out = broadcast_shapes(a.shape(), b.shape())?;
    let values = broadcast_indices(a.shape(), &out)
        .zip(broadcast_indices(b.shape(), &out))
        .map(|(i, j)| f(av[i], bv[j]))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(i64_tensor(out, values)?.cast(a.dtype())))
}

/// Integer arithmetic on constants (shape computations), with broadcasting.
fn int_binary(kind: BinaryKind, a: &Tensor, b: &Tensor) -> Result<Option<Tensor>, String> {
    int_zip(a, b, |x, y| {
        let r = match kind {
            BinaryKind::Add => x.checked_add(y),
            BinaryKind::Sub => x.checked_sub(y),
            BinaryKind::Mul => x.checked_mul(y),
            BinaryKind::Div => x.checked_div(y),
            BinaryKind::Maximum => Some(x.max(y)),
            BinaryKind::Minimum => Some(x.min(y)),
            BinaryKind::Pow => u32::try_from(y).ok().and_then(|e| x.checked_pow(e)),
            _ => None,
        };
        r.ok_or_else(|| {
            format!(
                "integer {} of {x} and {y} overflows or is undefined",
                kind.name()
            )
        })
    })
}

fn binary(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let kind = binary_kind(&cx.node.op_type);
    let a = cx.input(0)?;
    let mut b = cx.input(1)?;
    if let (Value::Const(x), Value::Const(y)) = (&a, &b) {
        if let Some(t) = int_binary(kind, x, y).map_err(|m| cx.err(m))? {
            return Ok(vec![Value::Const(t)]);
        }
    }
    // Integer arithmetic on values computed at run time (Hugging Face's position ids
    // from the input's padding mask): in f64, exact while the values stay within
    // 2^53, then back to the integer type.
    let (ta, tb) = (cx.ty(&a).dtype, cx.ty(&b).dtype);
    if ta.is_int()
        && tb.is_int()
        && matches!(kind, BinaryKind::Add | BinaryKind::Sub | BinaryKind::Mul)
    {
        let (wide_a, wide_b) = (in_f64(cx, a)?, in_f64(cx, b)?);
        let y = cx.emit(Binary::new(kind), &[wide_a, wide_b])?;
        return cx.out(Cast { to: ta }, &[y]);
    }
    // x + a vector along its last axis, as a Linear layer's bias: a BiasAdd, which
    // the GEMM epilogue fusion takes.
    let (sa, sb) = (cx.ty(&a).shape, cx.ty(&b).shape);
    if kind == BinaryKind::Add && sa.len() >= 2 && sb.len() == 1 && sa.last() == sb.first() {
        let op = BiasAdd {
            data_format: DataFormat::Nhwc,
        };
        let y = cx.emit_out(0, op, &[a, b])?;
        // Export writes it back as the Add it was, not as a Gemm's bias.
        cx.annotate(&y, crate::ONNX_OP_ANNOTATION, "Add");
        return Ok(vec![y]);
    }

    // Pow's exponent may be of another type than its base.
    if kind == BinaryKind::Pow && ta != tb {
        b = cx.emit(Cast { to: ta }, &[b])?;
    }
    cx.out(Binary::new(kind), &[a, b])
}

/// An integer (or bool) value in f64, for integer arithmetic at run time: the f64
/// value such arithmetic cast back to integers (which held integers, so the round
/// trip is the identity), the source of a cast between integer types that loses
/// nothing, or a new Cast. So chained integer ops cast once, not a cast of a cast.
fn in_f64(cx: &mut NodeCx, v: Value) -> Result<Value> {
    if let Some(source) = bridged_integers(cx, &v) {
        return Ok(source);
    }
    if let Some((op, inputs)) = cx.producer(&v) {
        if let (Some(cast), [source]) = (op.downcast_ref::<Cast>(), &inputs[..]) {
            let from = cx.ty(source).dtype;
            if (from.is_int() || from == DType::Bool) && widens_integers(from, cast.to) {
                return cx.emit(Cast { to: DType::F64 }, std::slice::from_ref(source));
            }
        }
    }
    cx.emit(Cast { to: DType::F64 }, &[v])
}

/// The f64 value that integer arithmetic at run time cast to the integers `v`, if
/// that is how `v` was computed.
fn bridged_integers(cx: &NodeCx, v: &Value) -> Option<Value> {
    let (op, inputs) = cx.producer(v)?;
    let (cast, [source]) = (op.downcast_ref::<Cast>()?, &inputs[..]) else {
        return None;
    };
    let from = cx.ty(source).dtype;
    (from == DType::F64 && cast.to.is_int() && holds_integers(cx, source)).then(|| source.clone())
}

/// Whether the f64 value `v` holds integers by construction: integer arithmetic at
/// run time (Casts of integers to f64, integral constants, and their sums, differences,
/// products, zero-padded shifts and reduced sums and maxima), as far as a bounded walk
/// back sees.
fn holds_integers(cx: &NodeCx, v: &Value) -> bool {
    let mut stack = vec![v.clone()];
    let mut seen = std::collections::HashSet::new();
    while let Some(v) = stack.pop() {
        if let Value::Port(p) = &v {
            if !seen.insert(*p) {
                continue;
            }
            if seen.len() > 256 {
                return false;
            }
        }
        let integral = |values: Vec<f64>| values.iter().all(|x| x.fract() == 0.0);
        let Some((op, inputs)) = cx.producer(&v) else {
            let Value::Const(t) = v else { return false };
            if !integral(t.to_f64_vec()) {
                return false;
            }
            continue;
        };
        if let Some(c) = op.downcast_ref::<Const>() {
            match &c.values {
                Some(v) if integral(v.to_f64()) => continue,
                _ => return false,
            }
        }
        let integral_op = match op.downcast_ref::<Cast>() {
            Some(_) => {
                let from = inputs.first().map(|i| cx.ty(i).dtype);
                if from.is_some_and(|d| d.is_int() || d == DType::Bool) {
                    continue;
                }
                from == Some(DType::F64)
            }
            None => {
                let binary = op.downcast_ref::<Binary>().is_some_and(|b| {
                    matches!(b.kind, BinaryKind::Add | BinaryKind::Sub | BinaryKind::Mul)
                });
                let pad = op
                    .downcast_ref::<Pad>()
                    .is_some_and(|p| p.mode == PadMode::Constant(0.0));
                let reduce = op
                    .downcast_ref::<Reduce>()
                    .is_some_and(|r| matches!(r.kind, ReduceKind::Sum | ReduceKind::Max));
                binary || pad || reduce
            }
        };
        if !integral_op {
            return false;
        }
        stack.extend(inputs);
    }
    true
}

/// Whether every value of integer (or bool) type `from` is one of `to`.
fn widens_integers(from: DType, to: DType) -> bool {
    let rank = |d: DType| match d {
        DType::Bool => Some(0),
        DType::I32 => Some(1),
        DType::I64 => Some(2),
        _ => None,
    };
    matches!((rank(from), rank(to)), (Some(f), Some(t)) if f <= t)
}

/// Max, Min, Sum (any number of inputs, chained) and Mean (their sum over the count).
fn variadic(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let op = cx.node.op_type.clone();
    let kind = binary_kind(&op);
    let inputs = cx.inputs()?;
    let n = inputs.len();
    let mut acc = inputs
        .first()
        .cloned()
        .ok_or_else(|| cx.err("takes at least one input"))?;
    if n == 1 {
        return Ok(vec![acc]);
    }
    for (i, v) in inputs.into_iter().enumerate().skip(1) {
        // Integer Min and Max of constants (shape and mask arithmetic) are computed here.
        if let (Value::Const(a), Value::Const(b)) = (&acc, &v) {
            if let Some(t) = int_binary(kind, a, b).map_err(|m| cx.err(m))? {
                acc = Value::Const(t);
                continue;
            }
        }
        let last = i == n - 1 && op != "Mean";
        acc = if last {
            cx.emit_out(0, Binary::new(kind), &[acc, v])?
        } else {
            cx.emit(Binary::new(kind), &[acc, v])?
        };
    }
    if op == "Mean" {
        let dtype = cx.ty(&acc).dtype;
        return cx.out(
            Binary::new(BinaryKind::Div),
            &[acc, scalar_like(dtype, n as f64)],
        );
    }
    Ok(vec![acc])
}

// ------------------------------------------------------------------ products

/// ONNX MatMul (NumPy's matmul): matrices as MatMul, a stack times a matrix as one
/// MatMul over the stacked rows, stacks as BatchMatMul (batch dims broadcast); a 1-D
/// operand is a row or column that the result drops.
fn matmul(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let mut a = cx.input(0)?;
    let mut b = cx.input(1)?;
    let (sa, sb) = (cx.ty(&a).shape, cx.ty(&b).shape);
    if sa.is_empty() || sb.is_empty() {
        return Err(cx.err("MatMul operands must have rank 1 or more"));
    }
    let mut out_shape = Vec::new();
    let (ra, rb) = (sa.len().max(2), sb.len().max(2));
    if sa.len() == 1 {
        a = cx.emit(Reshape::new(vec![1, sa[0] as i64]), &[a])?;
    }
    if sb.len() == 1 {
        b = cx.emit(Reshape::new(vec![sb[0] as i64, 1]), &[b])?;
    }
    let sa2 = if sa.len() == 1 {
        vec![1, sa[0]]
    } else {
        sa.clone()
    };
    let sb2 = if sb.len() == 1 {
        vec![sb[0], 1]
    } else {
        sb.clone()
    };
    let batch = broadcast_shapes(&sa2[..ra - 2], &sb2[..rb - 2]).map_err(|m| cx.err(m))?;
    out_shape.extend(&batch);
    if sa.len() > 1 {
        out_shape.push(sa2[ra - 2]);
    }
    if sb.len() > 1 {
        out_shape.push(sb2[rb - 1]);
    }
    let product = if ra == 2 && rb == 2 {
        if sa.len() == 2 && sb.len() == 2 {
            return cx.out(MatMul::new(false, false), &[a, b]);
        }
        cx.emit(MatMul::new(false, false), &[a, b])?
    } else if rb == 2 {
        // [..., M, K] x [K, N]: one [rows, K] x [K, N] product.
        let k = sa2[ra - 1] as i64;
        let rows = cx.emit(Reshape::new(vec![-1, k]), &[a])?;
        cx.emit(MatMul::new(false, false), &[rows, b])?
    } else {
        // Stacks of matrices: the product is the node's output where its shape is
        // already ONNX's (no 1-D operand), with no Reshape after it that would hide it
        // from the passes that look for a product (attention fusion).
        let op = BatchMatMul::new(false, false);
        let (ta, tb) = (cx.ty(&a), cx.ty(&b));
        let whole = op.infer(&[&ta, &tb]).is_ok_and(|t| t[0].shape == out_shape);
        if whole {
            return cx.out(op, &[a, b]);
        }
        cx.emit(op, &[a, b])?
    };
    cx.out(Reshape::new(shape_i64(&out_shape)), &[product])
}

/// A 3-D convolution whose windows tile its input (strides equal to the kernel, no
/// padding or dilation, one group: a video transformer's tubelet embedding, as
/// VideoMAE's) as the product it is: `[N, C, D, H, W]` viewed as windows `[N, D', kd,
/// H', kh, W', kw]`, moved to rows of `C kd kh kw` values, times the filter viewed `[O,
/// C kd kh kw]` (transposed), plus the bias, back to `[N, O, D', H', W']`. Other 3-D
/// convolutions are refused by name.
fn patch_embedding_3d(
    cx: &mut NodeCx,
    x: Value,
    w: Value,
    bias: Option<Value>,
    xs: &[usize],
    ws: &[usize],
) -> Result<Vec<Value>> {
    let kernel = &ws[2..];
    check_kernel_shape(cx, kernel)?;
    let strides = per_axis(cx, "strides", 3)?;
    let dilations = per_axis(cx, "dilations", 3)?;
    let pads = cx.ints_attr("pads")?.unwrap_or_else(|| vec![0; 6]);
    let auto_pad = cx.string_attr("auto_pad", "NOTSET")?;
    let groups = cx.int_attr("group", 1)?;
    let tiles = (strides.iter().zip(kernel)).all(|(&s, &k)| s == k)
        && dilations.iter().all(|&d| d == 1)
        && pads.iter().all(|&p| p == 0)
        && matches!(auto_pad.as_str(), "NOTSET" | "VALID")
        && groups == 1
        && ws[1] == xs[1]
        && (xs[2..].iter().zip(kernel)).all(|(&n, &k)| k > 0 && n % k == 0);
    if !tiles {
        return Err(cx.err(format!(
            "a 3-D convolution imports where its windows tile the input (strides equal to the kernel, no padding or dilation, one group), not x {xs:?}, w {ws:?}, strides {strides:?}, pads {pads:?}, dilations {dilations:?}, group {groups}"
        )));
    }
    let [n, c, d, h, wd] = xs[..] else {
        return Err(cx.err("x must be [N, C, D, H, W]"));
    };
    let (o, [kd, kh, kw]) = (ws[0], [kernel[0], kernel[1], kernel[2]]);
    let counts = [d / kd, h / kh, wd / kw];
    let i = |v: usize| v as i64;
    let windows = vec![
        i(n),
        i(c),
        i(counts[0]),
        i(kd),
        i(counts[1]),
        i(kh),
        i(counts[2]),
        i(kw),
    ];
    let x = cx.emit(Reshape::new(windows), &[x])?;
    // [N, D', H', W', C, kd, kh, kw]
    let x = cx.emit(Transpose::new(vec![0, 2, 4, 6, 1, 3, 5, 7]), &[x])?;
    let patch = c * kd * kh * kw;
    let rows = n * counts.iter().product::<usize>();
    let x = cx.emit(Reshape::new(vec![i(rows), i(patch)]), &[x])?;
    let w = cx.emit_weight(Reshape::new(vec![i(o), i(patch)]), &[w], 1, "rows")?;
    let mut y = cx.emit(MatMul::new(false, true), &[x, w])?;
    if let Some(b) = bias {
        let op = BiasAdd {
            data_format: DataFormat::Nhwc,
        };
        y = cx.emit(op, &[y, b])?;
    }
    let y = cx.emit(
        Reshape::new(vec![i(n), i(counts[0]), i(counts[1]), i(counts[2]), i(o)]),
        &[y],
    )?;
    cx.out(Transpose::new(vec![0, 4, 1, 2, 3]), &[y])
}

/// `alpha op(A) op(B) + beta C`.
fn gemm(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let a = cx.input(0)?;
    let b = cx.input(1)?;
    let c = cx.opt_input(2)?;
    let alpha = cx.float_attr("alpha", 1.0)?;
    let beta = cx.float_attr("beta", 1.0)?;
    let trans_a = cx.int_attr("transA", 0)? != 0;
    let trans_b = cx.int_attr("transB", 0)? != 0;
    let dtype = cx.ty(&a).dtype;
    let product = MatMul::new(trans_a, trans_b);
    let Some(mut c) = c.filter(|_| beta != 0.0) else {
        if alpha == 1.0 {
            return cx.out(product, &[a, b]);
        }
        let ab = cx.emit(product, &[a, b])?;
        return cx.out(
            Binary::new(BinaryKind::Mul),
            &[ab, scalar_like(dtype, alpha)],
        );
    };
    let mut ab = cx.emit(product, &[a, b])?;
    if alpha != 1.0 {
        ab = cx.emit(
            Binary::new(BinaryKind::Mul),
            &[ab, scalar_like(dtype, alpha)],
        )?;
    }
    if beta != 1.0 {
        c = cx.emit(Binary::new(BinaryKind::Mul), &[c, scalar_like(dtype, beta)])?;
    }
    let n = cx.ty(&ab).shape.get(1).copied();
    if cx.ty(&c).shape.len() == 1 && cx.ty(&c).shape.first().copied() == n {
        return cx.out(
            BiasAdd {
                data_format: DataFormat::Nhwc,
            },
            &[ab, c],
        );
    }
    cx.out(Binary::new(BinaryKind::Add), &[ab, c])
}

// ------------------------------------------------------------------ windows

/// Per spatial axis: `[before, after]` zeros, from `pads` (`[x1_begin, x2_begin, ...,
/// x1_end, ...]`) or `auto_pad`.
fn window_pads(
    cx: &NodeCx,
    spatial: &[usize],
    kernel: &[usize],
    strides: &[usize],
) -> Result<Vec<[usize; 2]>> {
    let n = spatial.len();
    let auto = cx.string_attr("auto_pad", "NOTSET")?;
    match auto.as_str() {
        "NOTSET" => {
            let pads = cx.ints_attr("pads")?.unwrap_or_else(|| vec![0; 2 * n]);
            if pads.len() != 2 * n || pads.iter().any(|&p| p < 0) {
                return Err(cx.err(format!(
                    "pads {pads:?} must be {} non-negative numbers",
                    2 * n
                )));
            }
            Ok((0..n)
                .map(|i| [pads[i] as usize, pads[i + n] as usize])
                .collect())
        }
        "VALID" => Ok(vec![[0, 0]; n]),
        "SAME_UPPER" | "SAME_LOWER" => Ok((0..n)
            .map(|i| {
                let out = spatial[i].div_ceil(strides[i]);
                let total =
                    ((out.saturating_sub(1)) * strides[i] + kernel[i]).saturating_sub(spatial[i]);
                let small = total / 2;
                if auto == "SAME_UPPER" {
                    [small, total - small]
                } else {
                    [total - small, small]
                }
            })
            .collect()),
        other => Err(cx.err(format!("auto_pad '{other}' is not supported"))),
    }
}

/// A Conv's or ConvTranspose's `kernel_shape`, where given, must be its weights'.
fn check_kernel_shape(cx: &NodeCx, kernel: &[usize]) -> Result<()> {
    if let Some(declared) = cx.ints_attr("kernel_shape")? {
        if !declared
            .iter()
            .map(|&k| k as usize)
            .eq(kernel.iter().copied())
        {
            return Err(cx.err(format!(
                "kernel_shape {declared:?} contradicts the weights' spatial dims {kernel:?}"
            )));
        }
    }
    Ok(())
}

/// The input elements each window spans: `kernel` taps `dilations` apart.
fn dilated_spans(kernel: &[usize], dilations: &[usize]) -> Vec<usize> {
    (kernel.iter().zip(dilations))
        .map(|(&k, &d)| dilated_span(k, d))
        .collect()
}

/// A list attribute of one positive number per spatial axis (default all 1).
fn per_axis(cx: &NodeCx, name: &str, n: usize) -> Result<Vec<usize>> {
    match cx.ints_attr(name)? {
        None => Ok(vec![1; n]),
        Some(v) if v.len() == n && v.iter().all(|&s| s > 0) => {
            Ok(v.iter().map(|&s| s as usize).collect())
        }
        Some(v) => Err(cx.err(format!("{name} {v:?} must be {n} positive numbers"))),
    }
}

/// Our padding for two spatial axes.
fn padding_of(pads: &[[usize; 2]]) -> Padding {
    if pads.iter().all(|p| *p == [0, 0]) {
        Padding::Valid
    } else {
        Padding::Explicit([pads[0], pads[1]])
    }
}

/// 1-D windows run as 2-D ones over a trailing axis of 1.
fn to_2d(cx: &mut NodeCx, x: Value, rank: usize) -> Result<Value> {
    if rank == 3 {
        let mut s = shape_i64(&cx.ty(&x).shape);
        s.push(1);
        cx.emit(Reshape::new(s), &[x])
    } else {
        Ok(x)
    }
}

fn conv(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let w = cx.input(1)?;
    let bias = cx.opt_input(2)?;
    let xs = cx.ty(&x).shape;
    let ws = cx.ty(&w).shape;
    let rank = xs.len();
    if rank == 5 && ws.len() == 5 {
        return patch_embedding_3d(cx, x, w, bias, &xs, &ws);
    }
    if !(rank == 3 || rank == 4) || ws.len() != rank {
        return Err(cx.err(format!(
            "only 1-D and 2-D convolutions, and 3-D ones whose windows tile the input, are supported (x {xs:?}, w {ws:?})"
        )));
    }
    let n = rank - 2;
    let dilations = per_axis(cx, "dilations", n)?;
    let groups = usize::try_from(cx.int_attr("group", 1)?)
        .ok()
        .filter(|&g| g > 0)
        .ok_or_else(|| cx.err("group must be positive"))?;
    let strides = per_axis(cx, "strides", n)?;
    let kernel = &ws[2..];
    check_kernel_shape(cx, kernel)?;
    let spans = dilated_spans(kernel, &dilations);
    let mut pads = window_pads(cx, &xs[2..], &spans, &strides)?;
    let (mut strides2, mut dilations2) = ([strides[0], 1], [dilations[0], 1]);
    if n == 2 {
        strides2[1] = strides[1];
        dilations2[1] = dilations[1];
    } else {
        pads.push([0, 0]);
    }
    let x = to_2d(cx, x, rank)?;
    let w = to_2d(cx, w, rank)?;
    // OIHW -> HWIO.
    let w = cx.emit_weight(Transpose::new(vec![2, 3, 1, 0]), &[w], 1, "hwio")?;
    let op = Conv2D::new(strides2, padding_of(&pads), DataFormat::Nchw)
        .with_groups(groups)
        .with_dilations(dilations2);
    let last = bias.is_none() && rank == 4;
    let mut y = if last {
        return cx.out(op, &[x, w]);
    } else {
        cx.emit(op, &[x, w])?
    };
    if let Some(b) = bias {
        let op = BiasAdd {
            data_format: DataFormat::Nchw,
        };
        if rank == 4 {
            return cx.out(op, &[y, b]);
        }
        y = cx.emit(op, &[y, b])?;
    }
    let mut s = shape_i64(&cx.ty(&y).shape);
    s.pop();
    cx.out(Reshape::new(s), &[y])
}

/// ConvTranspose (2-D): the input gradient of the convolution that it undoes, whose
/// input has the transposed convolution's output shape. ONNX's filter
/// [C_in, C_out / group, kh, kw] is that convolution's OIHW filter.
fn conv_transpose(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let w = cx.input(1)?;
    let bias = cx.opt_input(2)?;
    let (xs, ws) = (cx.ty(&x).shape, cx.ty(&w).shape);
    if xs.len() != 4 || ws.len() != 4 {
        return Err(cx.err(format!(
            "only 2-D transposed convolutions are supported (x {xs:?}, w {ws:?})"
        )));
    }
    let dilations = per_axis(cx, "dilations", 2)?;
    let groups = usize::try_from(cx.int_attr("group", 1)?)
        .ok()
        .filter(|&g| g > 0)
        .ok_or_else(|| cx.err("group must be positive"))?;
    let strides = per_axis(cx, "strides", 2)?;
    let extra = match cx.ints_attr("output_padding")? {
        None => vec![0, 0],
        Some(v)
            if v.len() == 2
                && v.iter()
                    .zip(&strides)
                    .all(|(&p, &s)| p >= 0 && (p as usize) < s) =>
        {
            v.iter().map(|&p| p as usize).collect()
        }
        Some(v) => {
            return Err(cx.err(format!(
                "output_padding {v:?} must be 2 numbers below the strides"
            )))
        }
    };
    check_kernel_shape(cx, &ws[2..])?;
    let spans = dilated_spans(&ws[2..], &dilations);
    // The full output before cropping: stride * (in - 1) + extra + the window's span.
    let full: Vec<usize> = (0..2)
        .map(|i| strides[i] * (xs[2 + i].max(1) - 1) + extra[i] + spans[i])
        .collect();
    let auto = cx.string_attr("auto_pad", "NOTSET")?;
    // With output_shape given, ONNX computes the pads and ignores any written.
    cx.ignore(&["pads"]);
    let pads: Vec<[usize; 2]> = match (cx.ints_attr("output_shape")?, auto.as_str()) {
        (Some(out), mode) => {
            let out = &out[out.len().saturating_sub(2)..];
            (0..2)
                .map(|i| {
                    let total = full[i]
                        .checked_sub(usize::try_from(out[i]).unwrap_or(usize::MAX))
                        .ok_or_else(|| {
                            cx.err(format!(
                                "output_shape {out:?} is larger than the full output {full:?}"
                            ))
                        })?;
                    let small = total / 2;
                    Ok(if mode == "SAME_UPPER" {
                        [small, total - small]
                    } else {
                        [total - small, small]
                    })
                })
                .collect::<Result<_>>()?
        }
        (None, "NOTSET") => {
            let p = cx.ints_attr("pads")?.unwrap_or_else(|| vec![0; 4]);
            if p.len() != 4 || p.iter().any(|&v| v < 0) {
                return Err(cx.err(format!("pads {p:?} must be 4 non-negative numbers")));
            }
            vec![
                [p[0] as usize, p[2] as usize],
                [p[1] as usize, p[3] as usize],
            ]
        }
        (None, "VALID") => vec![[0, 0]; 2],
        (None, mode @ ("SAME_UPPER" | "SAME_LOWER")) => (0..2)
            .map(|i| {
                // The output is in * stride: the rest of the full output is padding.
                let total = full[i].saturating_sub(xs[2 + i] * strides[i]);
                let small = total / 2;
                if mode == "SAME_UPPER" {
                    [small, total - small]
                } else {
                    [total - small, small]
                }
            })
            .collect(),
        (None, other) => return Err(cx.err(format!("auto_pad '{other}' is not supported"))),
    };
    let out: Vec<usize> = (0..2)
        .map(|i| full[i].checked_sub(pads[i][0] + pads[i][1]))
        .collect::<Option<_>>()
        .ok_or_else(|| cx.err("the padding is larger than the output"))?;
    let cout = ws[1] * groups;
    let w = cx.emit_weight(Transpose::new(vec![2, 3, 1, 0]), &[w], 1, "hwio")?;
    let op = Conv2DBackpropInput {
        input_shape: vec![xs[0], cout, out[0], out[1]],
        conv: Conv2D::new(
            [strides[0], strides[1]],
            padding_of(&pads),
            DataFormat::Nchw,
        )
        .with_groups(groups)
        .with_dilations([dilations[0], dilations[1]]),
    };
    match bias {
        None => cx.out(op, &[w, x]),
        Some(b) => {
            let y = cx.emit(op, &[w, x])?;
            cx.out(
                BiasAdd {
                    data_format: DataFormat::Nchw,
                },
                &[y, b],
            )
        }
    }
}

fn batch_norm(cx: &mut NodeCx) -> Result<Vec<Value>> {
    if cx.int_attr("training_mode", 0)? != 0 {
        return Err(cx.err("training mode is not supported"));
    }
    // The running statistics' momentum only matters in training.
    cx.ignore(&["momentum"]);
    let epsilon = cx.float_attr("epsilon", 1e-5)?;
    let inputs = [
        cx.input(0)?,
        cx.input(1)?,
        cx.input(2)?,
        cx.input(3)?,
        cx.input(4)?,
    ];
    let xs = cx.ty(&inputs[0]).shape;
    let op = BatchNorm {
        epsilon,
        training: false,
        data_format: DataFormat::Nchw,
        activation: NormActivation::Identity,
        ..BatchNorm::default()
    };
    match xs.len() {
        2 | 4 => cx.out(op, &inputs),
        r if r >= 3 => {
            // [N, C, ...] as [N, C, rest, 1].
            let rest: usize = xs[2..].iter().product();
            let [x, s, b, m, v] = inputs;
            let x4 = cx.emit(
                Reshape::new(vec![xs[0] as i64, xs[1] as i64, rest as i64, 1]),
                &[x],
            )?;
            let y = cx.emit(op, &[x4, s, b, m, v])?;
            cx.out(Reshape::new(shape_i64(&xs)), &[y])
        }
        _ => Err(cx.err(format!("x {xs:?} must have rank 2 or more"))),
    }
}

fn pool(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let xs = cx.ty(&x).shape;
    let rank = xs.len();
    if !(rank == 3 || rank == 4) {
        return Err(cx.err(format!("only 1-D and 2-D pooling is supported (x {xs:?})")));
    }
    let n = rank - 2;
    let kernel: Vec<usize> = match cx.ints_attr("kernel_shape")? {
        Some(k) if k.len() == n && k.iter().all(|&v| v > 0) => {
            k.iter().map(|&v| v as usize).collect()
        }
        other => {
            return Err(cx.err(format!(
                "kernel_shape {other:?} must be {n} positive numbers"
            )))
        }
    };
    if per_axis(cx, "dilations", n)?.iter().any(|&d| d != 1) {
        return Err(cx.err("dilations other than 1 are not supported"));
    }
    if cx.int_attr("storage_order", 0)? != 0 {
        return Err(cx.err("storage_order 1 is not supported"));
    }
    let strides = per_axis(cx, "strides", n)?;
    let mut pads = window_pads(cx, &xs[2..], &kernel, &strides)?;
    let explicit = pads.clone();
    if cx.int_attr("ceil_mode", 0)? != 0 {
        // Rounding the output length up is padding after; as PyTorch, a last window
        // that would start in the padding is dropped.
        for (i, p) in pads.iter_mut().enumerate() {
            let span = xs[2 + i] + p[0] + p[1];
            let floor_out = (span.saturating_sub(kernel[i])) / strides[i] + 1;
            let mut out = (span.saturating_sub(kernel[i])).div_ceil(strides[i]) + 1;
            if (out - 1) * strides[i] >= xs[2 + i] + p[0] {
                out -= 1;
            }
            if out > floor_out {
                p[1] += (out - 1) * strides[i] + kernel[i] - span;
            }
        }
    }
    let avg = cx.node.op_type == "AveragePool";
    let include_pad = avg && cx.int_attr("count_include_pad", 0)? != 0;
    if include_pad && pads != explicit {
        return Err(cx.err("count_include_pad 1 with ceil_mode's padding is not supported"));
    }
    let (mut ksize, mut strides2) = ([kernel[0], 1], [strides[0], 1]);
    if n == 2 {
        ksize[1] = kernel[1];
        strides2[1] = strides[1];
    } else {
        pads.push([0, 0]);
    }
    let mut x = to_2d(cx, x, rank)?;
    if include_pad && pads.iter().any(|p| *p != [0, 0]) {
        // The padding counts in every window's divisor: zeros padded first, then
        // windows without padding (each window lies in the padded input).
        let per_axis: Vec<[i64; 2]> = [[0, 0]; 2]
            .into_iter()
            .chain(pads.iter().map(|p| [p[0] as i64, p[1] as i64]))
            .collect();
        x = cx.emit(Pad::constant(per_axis, 0.0), &[x])?;
        pads = vec![[0, 0]; 2];
    }
    let padding = padding_of(&pads);
    let y = match (avg, rank) {
        (false, 4) => {
            return cx.out(
                MaxPool::new(ksize, strides2, padding, DataFormat::Nchw),
                &[x],
            )
        }
        (true, 4) => {
            return cx.out(
                AvgPool::new(ksize, strides2, padding, DataFormat::Nchw),
                &[x],
            )
        }
        (false, _) => cx.emit(
            MaxPool::new(ksize, strides2, padding, DataFormat::Nchw),
            &[x],
        )?,
        (true, _) => cx.emit(
            AvgPool::new(ksize, strides2, padding, DataFormat::Nchw),
            &[x],
        )?,
    };
    let mut s = shape_i64(&cx.ty(&y).shape);
    s.pop();
    cx.out(Reshape::new(s), &[y])
}

fn global_pool(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let rank = cx.ty(&x).shape.len();
    if rank < 3 {
        return Err(cx.err("x must have rank 3 or more ([N, C, ...])"));
    }
    let kind = if cx.node.op_type == "GlobalMaxPool" {
        ReduceKind::Max
    } else {
        ReduceKind::Mean
    };
    let axes = (2..rank as i64).collect();
    cx.out(Reduce::new(kind, Some(axes), true), &[x])
}

// ------------------------------------------------------------------ shapes

fn flatten(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let s = cx.ty(&x).shape;
    let axis = cx.int_attr("axis", 1)?;
    let axis = if axis < 0 {
        axis + s.len() as i64
    } else {
        axis
    };
    if !(0..=s.len() as i64).contains(&axis) {
        return Err(cx.err(format!("axis {axis} is out of range for rank {}", s.len())));
    }
    let (outer, inner) = s.split_at(axis as usize);
    let shape = vec![
        outer.iter().product::<usize>() as i64,
        inner.iter().product::<usize>() as i64,
    ];
    cx.out(Reshape::new(shape), &[x])
}

fn reshape(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let xs = cx.ty(&x).shape;
    let mut shape = cx
        .ints_input(1)?
        .ok_or_else(|| cx.err("the shape input is missing"))?;
    if cx.int_attr("allowzero", 0)? == 0 {
        for (i, d) in shape.iter_mut().enumerate() {
            if *d == 0 {
                *d = *xs
                    .get(i)
                    .ok_or_else(|| cx.err(format!("shape {i} copies a dimension x {xs:?} lacks")))?
                    as i64;
            }
        }
    }
    cx.out(Reshape::new(shape), &[x])
}

fn transpose(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let rank = cx.ty(&x).shape.len();
    let perm = match cx.ints_attr("perm")? {
        Some(p) => p
            .iter()
            .map(|&v| {
                usize::try_from(v).map_err(|_| cx.err(format!("perm {p:?} has a negative entry")))
            })
            .collect::<Result<Vec<_>>>()?,
        None => (0..rank).rev().collect(),
    };
    cx.out(Transpose::new(perm), &[x])
}

/// The `axes` of a Squeeze, Unsqueeze or reduction: an attribute before the opset
/// that made it an input (13 for Squeeze, Unsqueeze and ReduceSum, 18 for the other
/// reductions); the schema check refused the form the model's opset does not read.
fn axes(cx: &NodeCx) -> Result<Option<Vec<i64>>> {
    match cx.ints_attr("axes")? {
        Some(a) => Ok(Some(a)),
        None => cx.ints_input(1),
    }
}

fn squeeze(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let s = cx.ty(&x).shape;
    let drop: Vec<usize> = match axes(cx)? {
        None => (0..s.len()).filter(|&i| s[i] == 1).collect(),
        Some(a) => a
            .iter()
            .map(|&v| normalize_axis(v, s.len()).map_err(|m| cx.err(m)))
            .collect::<Result<_>>()?,
    };
    if let Some(&i) = drop.iter().find(|&&i| s[i] != 1) {
        return Err(cx.err(format!("axis {i} of x {s:?} is not 1")));
    }
    let shape: Vec<i64> = (0..s.len())
        .filter(|i| !drop.contains(i))
        .map(|i| s[i] as i64)
        .collect();
    cx.out(Reshape::new(shape), &[x])
}

fn unsqueeze(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let s = cx.ty(&x).shape;
    let added = axes(cx)?.ok_or_else(|| cx.err("axes are missing"))?;
    let rank = s.len() + added.len();
    let mut new: Vec<usize> = added
        .iter()
        .map(|&v| normalize_axis(v, rank).map_err(|m| cx.err(m)))
        .collect::<Result<_>>()?;
    new.sort_unstable();
    new.dedup();
    if new.len() != added.len() {
        return Err(cx.err(format!("axes {added:?} repeat an axis")));
    }
    let mut dims = s.iter();
    let shape: Vec<i64> = (0..rank)
        .map(|i| {
            if new.contains(&i) {
                1
            } else {
                dims.next().map_or(1, |&d| d as i64)
            }
        })
        .collect();
    cx.out(Reshape::new(shape), &[x])
}

fn concat(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let inputs = cx.inputs()?;
    let axis = cx.int_attr("axis", 0)?;
    if inputs.len() == 1 {
        return Ok(inputs);
    }
    cx.out(Concat::new(axis), &inputs)
}

/// The positions one sliced axis keeps, clamped as ONNX clamps (a negative step
/// walks backwards from `start`).
fn slice_positions(dim: usize, start: i64, end: i64, step: i64) -> Vec<i64> {
    let d = dim as i64;
    let wrap = |v: i64| if v < 0 { v + d } else { v };
    if step > 0 {
        let (b, e) = (wrap(start).clamp(0, d), wrap(end).clamp(0, d));
        (b..e).step_by(step as usize).collect()
    } else {
        let (b, e) = (wrap(start).clamp(-1, d - 1), wrap(end).clamp(-1, d - 1));
        std::iter::successors(Some(b), |&i| Some(i + step))
            .take_while(|&i| i > e)
            .collect()
    }
}

/// Slice: a contiguous block as our Slice, then each axis with a step other than 1
/// as a Gather of the positions it keeps.
fn slice(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let s = cx.ty(&x).shape;
    let need = |cx: &NodeCx, i: usize, what: &str| -> Result<Vec<i64>> {
        cx.ints_input(i)?
            .ok_or_else(|| cx.err(format!("{what} are missing")))
    };
    let starts = need(cx, 1, "starts")?;
    let ends = need(cx, 2, "ends")?;
    let axes = cx
        .ints_input(3)?
        .unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = cx.ints_input(4)?.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return Err(cx.err("starts, ends, axes and steps must have one entry each per sliced axis"));
    }
    let mut begin = vec![0usize; s.len()];
    let mut size: Vec<i64> = s.iter().map(|&d| d as i64).collect();
    let mut gathers = Vec::new();
    for i in 0..starts.len() {
        let ax = normalize_axis(axes[i], s.len()).map_err(|m| cx.err(m))?;
        if steps[i] == 0 {
            return Err(cx.err("a step is 0"));
        }
        let keep = slice_positions(s[ax], starts[i], ends[i], steps[i]);
        if steps[i] == 1 || keep.is_empty() {
            begin[ax] = keep.first().map_or(0, |&b| b as usize);
            size[ax] = keep.len() as i64;
        } else {
            gathers.push((ax, keep));
        }
    }
    // A block that is the whole input is left out before gathers (it would copy).
    let whole = begin.iter().all(|&b| b == 0) && size.iter().zip(&s).all(|(&n, &d)| n == d as i64);
    let mut y = x;
    if !whole || gathers.is_empty() {
        y = if gathers.is_empty() {
            return cx.out(Slice::new(begin, size), &[y]);
        } else {
            cx.emit(Slice::new(begin, size), &[y])?
        };
    }
    let last = gathers.len();
    for (k, (ax, keep)) in gathers.into_iter().enumerate() {
        let n = keep.len();
        let idx = Value::Const(i64_tensor(vec![n], keep).map_err(|m| cx.err(m))?);
        let op = Gather::new(ax as i64);
        y = if k + 1 == last {
            cx.emit_out(0, op, &[y, idx])?
        } else {
            cx.emit(op, &[y, idx])?
        };
    }
    Ok(vec![y])
}

fn split(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let s = cx.ty(&x).shape;
    let axis = normalize_axis(cx.int_attr("axis", 0)?, s.len()).map_err(|m| cx.err(m))?;
    let outputs = cx.node.output.len();
    let sizes: Vec<usize> = match if cx.opset() >= 13 {
        cx.ints_input(1)?
    } else {
        cx.ints_attr("split")?
    } {
        Some(v) => v
            .iter()
            .map(|&d| {
                usize::try_from(d).map_err(|_| cx.err(format!("split {v:?} has a negative size")))
            })
            .collect::<Result<_>>()?,
        None => {
            // Equal parts, the last smaller (opset 18's num_outputs rule); none empty.
            if let Some(n) = cx.attr("num_outputs").map(|a| a.i) {
                if n != outputs as i64 {
                    return Err(cx.err(format!(
                        "num_outputs {n} but the node has {outputs} outputs"
                    )));
                }
            }
            if outputs > s[axis] {
                return Err(cx.err(format!(
                    "{outputs} outputs from an axis of {} elements: some would be empty",
                    s[axis]
                )));
            }
            let each = s[axis].div_ceil(outputs.max(1));
            (0..outputs)
                .map(|k| each.min(s[axis].saturating_sub(k * each)))
                .collect()
        }
    };
    if sizes.len() != outputs || sizes.iter().sum::<usize>() != s[axis] {
        return Err(cx.err(format!(
            "split sizes {sizes:?} must be one per output ({outputs}) and add up to {}",
            s[axis]
        )));
    }
    let mut results = Vec::with_capacity(outputs);
    let mut at = 0;
    for (k, &len) in sizes.iter().enumerate() {
        let mut begin = vec![0; s.len()];
        let mut size: Vec<i64> = s.iter().map(|&d| d as i64).collect();
        begin[axis] = at;
        size[axis] = len as i64;
        results.push(cx.emit_out(k, Slice::new(begin, size), std::slice::from_ref(&x))?);
        at += len;
    }
    Ok(results)
}

fn shape(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let s = cx.ty(&x).shape;
    let r = s.len() as i64;
    let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = clamp(cx.int_attr("start", 0)?);
    let end = clamp(cx.int_attr("end", r)?).max(start);
    let dims = shape_i64(&s[start..end]);
    let t = i64_tensor(vec![dims.len()], dims).map_err(|m| cx.err(m))?;
    Ok(vec![Value::Const(t)])
}

fn size(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let n = cx.ty(&x).shape.iter().product::<usize>() as i64;
    Ok(vec![Value::Const(
        i64_tensor(vec![], vec![n]).map_err(|m| cx.err(m))?,
    )])
}

fn cast(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let to = dtype_of(cx.int_attr("to", 0)? as i32).map_err(|m| cx.err(m))?;
    // Only casts to float8 saturate (ours always do, as the GPU's `satfinite`).
    if to.is_fp8() && cx.int_attr("saturate", 1)? == 0 {
        return Err(cx.err(format!(
            "a cast to {to} with saturate=0 (out-of-range values to NaN or infinity) is \
             not supported: casts to float8 saturate"
        )));
    }
    cx.ignore(&["saturate"]);
    let x = cx.input(0)?;
    if cx.ty(&x).dtype == to {
        return Ok(vec![x]);
    }
    // Integers that integer arithmetic at run time computed in f64: cast from there
    // (the same values, one cast rather than a cast of a cast).
    let x = bridged_integers(cx, &x).unwrap_or(x);
    cx.out(Cast { to }, &[x])
}

fn constant(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let t = if let Some(t) = cx.tensor_attr("value")? {
        t
    } else if let Some(a) = cx.attr("value_float") {
        Tensor::scalar(DType::F32, f64::from(a.f))
    } else if let Some(a) = cx.attr("value_int") {
        i64_tensor(vec![], vec![a.i]).map_err(|m| cx.err(m))?
    } else if let Some(v) = cx.floats_attr("value_floats")? {
        Tensor::new(vec![v.len()], Data::F32(v)).map_err(|m| cx.err(m))?
    } else if let Some(v) = cx.ints_attr("value_ints")? {
        i64_tensor(vec![v.len()], v).map_err(|m| cx.err(m))?
    } else {
        return Err(cx.err("only value, value_float(s) and value_int(s) constants are supported"));
    };
    Ok(vec![Value::Const(t)])
}

fn constant_of_shape(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let dims = cx
        .ints_input(0)?
        .ok_or_else(|| cx.err("the shape input is missing"))?;
    let shape = crate::tensor::shape_of(&dims).map_err(|m| cx.err(m))?;
    let fill = cx
        .tensor_attr("value")?
        .unwrap_or_else(|| Tensor::scalar(DType::F32, 0.0));
    let v = fill.to_f64_vec().first().copied().unwrap_or(0.0);
    let ty = TensorType::new(fill.dtype(), shape);
    cx.admit(std::slice::from_ref(&ty))?;
    Ok(vec![Value::Const(Tensor::full(&ty, v))])
}

fn range(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let get = |cx: &NodeCx, i: usize| -> Result<Tensor> {
        cx.const_input(i)?
            .ok_or_else(|| cx.err(format!("input {i} is missing")))
    };
    let (start, limit, delta) = (get(cx, 0)?, get(cx, 1)?, get(cx, 2)?);
    let f = |t: &Tensor| t.to_f64_vec().first().copied().unwrap_or(0.0);
    let (s, l, d) = (f(&start), f(&limit), f(&delta));
    if d == 0.0 {
        return Err(cx.err("delta is 0"));
    }
    let n = ((l - s) / d).ceil().max(0.0);
    if n > 1e12 {
        return Err(cx.err(format!("the range has {n} elements")));
    }
    cx.admit(&[TensorType::new(start.dtype(), [n as usize])])?;
    let values: Vec<f64> = (0..n as usize).map(|i| s + i as f64 * d).collect();
    let t = Tensor::from_f64(start.dtype(), vec![n as usize], &values).map_err(|m| cx.err(m))?;
    Ok(vec![Value::Const(t)])
}

/// Expand broadcasts both ways: the result has the broadcast of x's shape and `shape`.
fn expand(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let dims = cx
        .ints_input(1)?
        .ok_or_else(|| cx.err("the shape input is missing"))?;
    let want = crate::tensor::shape_of(&dims).map_err(|m| cx.err(m))?;
    let xs = cx.ty(&x).shape;
    let out = broadcast_shapes(&xs, &want).map_err(|m| cx.err(m))?;
    if out == xs {
        return Ok(vec![x]);
    }
    cx.out(BroadcastTo::new(out), &[x])
}

// ------------------------------------------------------------------ normalisation

fn softmax(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let s = cx.ty(&x).shape;
    let log = cx.node.op_type == "LogSoftmax";
    let default = if cx.opset() >= 13 { -1 } else { 1 };
    let given = cx.int_attr("axis", default)?;
    let axis = normalize_axis(given, s.len()).map_err(|m| cx.err(m))?;
    let whole_rows = cx.opset() < 13 && axis + 1 != s.len();
    if !whole_rows {
        let axis = given;
        return if log {
            cx.out(LogSoftmax { axis }, &[x])
        } else {
            cx.out(Softmax { axis }, &[x])
        };
    }
    // Before opset 13 the input is seen as [prod(s[..axis]), prod(s[axis..])].
    let rows = s[..axis].iter().product::<usize>() as i64;
    let flat = cx.emit(Reshape::new(vec![rows, -1]), &[x])?;
    let y = if log {
        cx.emit(LogSoftmax { axis: -1 }, &[flat])?
    } else {
        cx.emit(Softmax { axis: -1 }, &[flat])?
    };
    cx.out(Reshape::new(shape_i64(&s)), &[y])
}

fn layer_norm(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let mut gamma = cx.input(1)?;
    let xt = cx.ty(&x);
    let given = cx.int_attr("axis", -1)?;
    let axis = normalize_axis(given, xt.shape.len()).map_err(|m| cx.err(m))?;
    let norm_shape = xt.shape[axis..].to_vec();
    let dtype = cx.ty(&gamma).dtype;
    if cx.ty(&gamma).shape != norm_shape {
        gamma = cx.emit(BroadcastTo::new(norm_shape.clone()), &[gamma])?;
    }
    let beta = match cx.opt_input(2)? {
        Some(b) if cx.ty(&b).shape == norm_shape => b,
        Some(b) => cx.emit(BroadcastTo::new(norm_shape.clone()), &[b])?,
        None => {
            let n = norm_shape.iter().product();
            let zeros =
                Tensor::from_f64(dtype, norm_shape, &vec![0.0; n]).map_err(|m| cx.err(m))?;
            Value::Const(zeros)
        }
    };
    let op = LayerNorm {
        axis: given,
        epsilon: cx.float_attr("epsilon", 1e-5)?,
        to: None,
    };
    cx.out(op, &[x, gamma, beta])
}

/// ONNX InstanceNormalization (Wav2Vec2's GroupNorm of one channel a group): each
/// `(n, c)` normalised over the spatial axes, as a LayerNorm over the axes from 2
/// (unit gamma, zero beta), then times `scale[c]` plus `B[c]`, viewed `[C, 1, ...]`.
fn instance_norm(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let (x, scale, bias) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let xt = cx.ty(&x);
    if xt.shape.len() < 3 {
        return Err(cx.err(format!(
            "x of shape {:?}: at least one spatial axis after [N, C]",
            xt.shape
        )));
    }
    let channels = xt.shape[1];
    for (what, v) in [("scale", &scale), ("B", &bias)] {
        if cx.ty(v).shape != [channels] {
            return Err(cx.err(format!("{what} must be [{channels}], one per channel")));
        }
    }
    let spatial = xt.shape[2..].to_vec();
    let n = spatial.iter().product::<usize>();
    let filled = |v: f64| Tensor::from_f64(xt.dtype, spatial.clone(), &vec![v; n]);
    let (ones, zeros) = (
        filled(1.0).map_err(|m| cx.err(m))?,
        filled(0.0).map_err(|m| cx.err(m))?,
    );
    let op = LayerNorm {
        axis: 2,
        epsilon: cx.float_attr("epsilon", 1e-5)?,
        to: None,
    };
    let normed = cx.emit(op, &[x, Value::Const(ones), Value::Const(zeros)])?;
    let mut per_channel = vec![channels as i64];
    per_channel.extend(std::iter::repeat_n(1, spatial.len()));
    let scale = cx.emit(Reshape::new(per_channel.clone()), &[scale])?;
    let bias = cx.emit(Reshape::new(per_channel), &[bias])?;
    let scaled = cx.emit(Binary::new(BinaryKind::Mul), &[normed, scale])?;
    cx.out(Binary::new(BinaryKind::Add), &[scaled, bias])
}

/// ReduceMean, ReduceSum, ReduceMax; ReduceMin as the negated Max of the negation
/// (exact); ReduceSumSquare as a Sum of the Squares and ReduceL2 as its Sqrt
/// (ConvNeXt V2's global response norm, SwinV2's cosine attention); the sum, maximum
/// and minimum of integers in f64, cast back.
fn reduce(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let op = cx.node.op_type.clone();
    let kind = match op.as_str() {
        "ReduceMean" => ReduceKind::Mean,
        "ReduceMax" | "ReduceMin" => ReduceKind::Max,
        _ => ReduceKind::Sum,
    };
    let mut x = cx.input(0)?;
    let axes = axes(cx)?.filter(|a| !a.is_empty());
    let keep = cx.int_attr("keepdims", 1)? != 0;
    let noop_without_axes = cx.int_attr("noop_with_empty_axes", 0)? != 0;
    if axes.is_none() && noop_without_axes {
        // Nothing reduced: each element's own square, or its root, |x|.
        return match op.as_str() {
            "ReduceL2" => cx.out(Unary::new(UnaryKind::Abs), &[x]),
            "ReduceSumSquare" => cx.out(Unary::new(UnaryKind::Square), &[x]),
            _ => Ok(vec![x]),
        };
    }
    if matches!(op.as_str(), "ReduceL2" | "ReduceSumSquare") {
        x = cx.emit(Unary::new(UnaryKind::Square), &[x])?;
    }
    if op == "ReduceL2" {
        let sum = cx.emit(Reduce::new(kind, axes, keep), &[x])?;
        return cx.out(Unary::new(UnaryKind::Sqrt), &[sum]);
    }
    // Integers reduced at run time (Flaubert's lengths: the count of non-padding
    // tokens a row): in f64, exact while the sums stay within 2^53, then back.
    let integers = cx.ty(&x).dtype;
    let integral =
        integers.is_int() && matches!(op.as_str(), "ReduceSum" | "ReduceMax" | "ReduceMin");
    if integral {
        x = in_f64(cx, x)?;
    }
    let reduced = if op == "ReduceMin" {
        let negated = cx.emit(Unary::new(UnaryKind::Neg), &[x])?;
        let max = cx.emit(Reduce::new(kind, axes, keep), &[negated])?;
        let min = Unary::new(UnaryKind::Neg);
        if !integral {
            return cx.out(min, &[max]);
        }
        cx.emit(min, &[max])?
    } else if integral {
        cx.emit(Reduce::new(kind, axes, keep), &[x])?
    } else {
        return cx.out(Reduce::new(kind, axes, keep), &[x]);
    };
    cx.out(Cast { to: integers }, &[reduced])
}

// ------------------------------------------------------------------ selection

/// OneHot of a depth known at import: `Where(index == k, on, off)` for each k along
/// the new axis, the indices compared in f64 (exact within 2^53) after a negative one
/// is wrapped (`index + depth`); an index out of range is all `off`, as ONNX says.
fn one_hot(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let indices = cx.input(0)?;
    let depth = (cx.const_input(1)?)
        .and_then(|t| t.to_f64_vec().first().copied())
        .ok_or_else(|| cx.err("its depth must be computed at import"))?;
    if depth < 1.0 || depth.fract() != 0.0 {
        return Err(cx.err(format!("depth {depth} must be a positive integer")));
    }
    let values =
        (cx.const_input(2)?).ok_or_else(|| cx.err("its values (off, on) must be constants"))?;
    if values.len() != 2 {
        return Err(cx.err(format!("values of shape {:?}: [off, on]", values.shape())));
    }
    let shape = cx.ty(&indices).shape;
    let rank = shape.len() + 1;
    let axis = normalize_axis(cx.int_attr("axis", -1)?, rank).map_err(|m| cx.err(m))?;
    let depth = depth as usize;
    let index = wrapped_in_f64(cx, indices, scalar_like(DType::F64, depth as f64))?;
    let mut expanded = shape_i64(&shape);
    expanded.insert(axis, 1);
    let index = cx.emit(Reshape::new(expanded), &[index])?;
    let mut along = vec![1; rank];
    along[axis] = depth;
    let positions: Vec<f64> = (0..depth).map(|k| k as f64).collect();
    let positions = Tensor::from_f64(DType::F64, along, &positions).map_err(|m| cx.err(m))?;
    let hot = cx.emit(
        Compare::new(CompareKind::Equal),
        &[index, Value::Const(positions)],
    )?;
    let (off, on) = (values.to_f64_vec()[0], values.to_f64_vec()[1]);
    let (off, on) = (
        scalar_like(values.dtype(), off),
        scalar_like(values.dtype(), on),
    );
    cx.out(Where, &[hot, on, off])
}

/// ArgMax and ArgMin as reductions in f64 (indices exact): the positions where x
/// equals its maximum along the axis (its minimum: the maximum of -x) keep their
/// index and the others a sentinel, and the least index is taken (the greatest with
/// `select_last_index`), then cast to int64. Integers (token ids: GPT-2's last token
/// before padding) compare in f64 too, exact within 2^53.
fn arg_extreme(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let shape = cx.ty(&x).shape;
    let axis = normalize_axis(cx.int_attr("axis", 0)?, shape.len()).map_err(|m| cx.err(m))?;
    let keep = cx.int_attr("keepdims", 1)? != 0;
    let last = cx.int_attr("select_last_index", 0)? != 0;
    let n = shape[axis];
    let mut x = in_f64(cx, x)?;
    if cx.node.op_type == "ArgMin" {
        x = cx.emit(Unary::new(UnaryKind::Neg), &[x])?;
    }
    let axes = Some(vec![axis as i64]);
    let most = cx.emit(
        Reduce::new(ReduceKind::Max, axes.clone(), true),
        &[x.clone()],
    )?;
    let at_most = cx.emit(Compare::new(CompareKind::Equal), &[x, most])?;
    // Each position's index along the axis, broadcast over the others; the least
    // index wins as the greatest of the negated ones.
    let mut along = vec![1; shape.len()];
    along[axis] = n;
    let sign = if last { 1.0 } else { -1.0 };
    let index: Vec<f64> = (0..n).map(|i| sign * i as f64).collect();
    let index = Tensor::from_f64(DType::F64, along, &index).map_err(|m| cx.err(m))?;
    let never = scalar_like(DType::F64, -(n as f64) - 1.0);
    let kept = cx.emit(Where, &[at_most, Value::Const(index), never])?;
    let picked = cx.emit(Reduce::new(ReduceKind::Max, axes, keep), &[kept])?;
    let picked = if last {
        picked
    } else {
        cx.emit(Unary::new(UnaryKind::Neg), &[picked])?
    };
    cx.out(Cast { to: DType::I64 }, &[picked])
}

/// Gather; constant indices that pick a run of neighbours (q, k and v out of one
/// projection, a token's row) are a Slice and a Reshape instead: a view of the data
/// on every backend.
fn gather(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let (data, indices) = (cx.input(0)?, cx.input(1)?);
    let axis = cx.int_attr("axis", 0)?;
    if let (Value::Port(_), Value::Const(idx)) = (&data, &indices) {
        let shape = cx.ty(&data).shape;
        let ax = normalize_axis(axis, shape.len()).map_err(|m| cx.err(m))?;
        let n = shape[ax] as i64;
        let picked: Option<Vec<i64>> = idx
            .to_i64_vec()
            .map(|v| v.iter().map(|&i| if i < 0 { i + n } else { i }).collect());
        if let Some(picked) = picked.filter(|p| {
            !p.is_empty()
                && p.iter().all(|&i| (0..n).contains(&i))
                && p.windows(2).all(|w| w[1] == w[0] + 1)
        }) {
            let mut begin = vec![0usize; shape.len()];
            let mut size: Vec<i64> = shape_i64(&shape);
            begin[ax] = picked[0] as usize;
            size[ax] = picked.len() as i64;
            let block = cx.emit(Slice::new(begin, size), &[data])?;
            let mut out: Vec<i64> = shape_i64(&shape[..ax]);
            out.extend(shape_i64(idx.shape()));
            out.extend(shape_i64(&shape[ax + 1..]));
            return cx.out(Reshape::new(out), &[block]);
        }
    }
    cx.out(Gather::new(axis), &[data, indices])
}

/// Inputs `0..n` of a node that runs only at import (its values computed here, as
/// exporters write it for position ids, masks and index tables): each must be a
/// constant, or one clear error naming the first that is computed at run time.
fn import_time_inputs(cx: &NodeCx, n: usize) -> Result<Vec<Tensor>> {
    (0..n)
        .map(|i| match cx.input(i)? {
            Value::Const(t) => Ok(t),
            Value::Port(_) => Err(cx.err(format!(
                "{} is computed at import only, from constants and input shapes, but input {i} \
                 ('{}') is computed at run time",
                cx.node.op_type, cx.node.input[i]
            ))),
        })
        .collect()
}

/// The elements of `t` at flat positions `picks`, as a tensor of `shape` and `t`'s
/// dtype (integers exactly).
fn take(t: &Tensor, picks: &[usize], shape: Vec<usize>) -> Result<Tensor, String> {
    match t.to_i64_vec().filter(|_| t.dtype().is_int()) {
        Some(v) => Ok(i64_tensor(shape, picks.iter().map(|&i| v[i]).collect())?.cast(t.dtype())),
        None => {
            let v = t.to_f64_vec();
            Tensor::from_f64(
                t.dtype(),
                shape,
                &picks.iter().map(|&i| v[i]).collect::<Vec<_>>(),
            )
        }
    }
}

/// Index `i` along an axis of `n`, negative from the end; an error where out of range.
fn index_in(i: i64, n: usize) -> Result<usize, String> {
    let at = if i < 0 { i + n as i64 } else { i };
    usize::try_from(at)
        .ok()
        .filter(|&a| a < n)
        .ok_or_else(|| format!("index {i} is out of range for an axis of {n}"))
}

/// ONNX GatherElements (`torch.gather`): `out[i] = data[i with axis i_axis replaced by
/// indices[i]]`, computed at import.
fn gather_elements(cx: &mut NodeCx) -> Result<Vec<Value>> {
    if [cx.input(0)?, cx.input(1)?]
        .iter()
        .any(|v| matches!(v, Value::Port(_)))
    {
        return gather_elements_at_run_time(cx);
    }
    let [data, indices] = <[Tensor; 2]>::try_from(import_time_inputs(cx, 2)?)
        .map_err(|_| cx.err("takes data and indices"))?;
    let (shape, ishape) = (data.shape().to_vec(), indices.shape().to_vec());
    let axis = normalize_axis(cx.int_attr("axis", 0)?, shape.len()).map_err(|m| cx.err(m))?;
    let beside = offsets_beside_axis(&shape, &ishape, axis).map_err(|m| cx.err(m))?;
    let idx = (indices.to_i64_vec()).ok_or_else(|| cx.err("indices must be integers"))?;
    let stride = strides(&shape)[axis];
    let picks = (idx.iter().zip(beside))
        .map(|(&i, at)| index_in(i, shape[axis]).map(|i| at + i * stride))
        .collect::<Result<Vec<usize>, String>>()
        .map_err(|m| cx.err(m))?;
    let out = take(&data, &picks, ishape).map_err(|m| cx.err(m))?;
    Ok(vec![Value::Const(out)])
}

/// GatherElements' offset in `data` (of `shape`) of each element of its indices (of
/// `ishape`, the same rank) along every axis but `axis`.
fn offsets_beside_axis(
    shape: &[usize],
    ishape: &[usize],
    axis: usize,
) -> Result<Vec<usize>, String> {
    if ishape.len() != shape.len() {
        return Err(format!(
            "indices of rank {} for data of rank {}",
            ishape.len(),
            shape.len()
        ));
    }
    if (0..shape.len()).any(|d| d != axis && ishape[d] > shape[d]) {
        return Err(format!(
            "indices of shape {ishape:?} exceed data of {shape:?}"
        ));
    }
    let (strides, istrides) = (strides(shape), strides(ishape));
    let offsets = (0..ishape.iter().product::<usize>()).map(|flat| {
        (0..shape.len())
            .filter(|&d| d != axis)
            .map(|d| (flat / istrides[d]) % ishape[d] * strides[d])
            .sum()
    });
    Ok(offsets.collect())
}

/// GatherElements of data or indices computed at run time (RoBERTa's token types,
/// gathered at its position ids): a Gather from the flattened data at `base + index *
/// stride`, where `base` (a constant of the indices' shape) holds each element's
/// offset along the other axes and a negative index counts from the axis' end. The
/// offsets are computed in f64 (exact below 2^53); an index out of range is the
/// Gather's error.
fn gather_elements_at_run_time(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let (data, indices) = (cx.input(0)?, cx.input(1)?);
    let (shape, ishape) = (cx.ty(&data).shape, cx.ty(&indices).shape);
    let axis = normalize_axis(cx.int_attr("axis", 0)?, shape.len()).map_err(|m| cx.err(m))?;
    let base = offsets_beside_axis(&shape, &ishape, axis).map_err(|m| cx.err(m))?;
    if !cx.ty(&indices).dtype.is_int() {
        return Err(cx.err("indices must be integers"));
    }
    let strides = strides(&shape);
    let base: Vec<f64> = base.into_iter().map(|at| at as f64).collect();
    let base = Tensor::from_f64(DType::F64, ishape.clone(), &base).map_err(|m| cx.err(m))?;
    let f64s = |v: f64| scalar_like(DType::F64, v);
    let index = wrapped_in_f64(cx, indices, f64s(shape[axis] as f64))?;
    let along = cx.emit(
        Binary::new(BinaryKind::Mul),
        &[index, f64s(strides[axis] as f64)],
    )?;
    let flat = cx.emit(Binary::new(BinaryKind::Add), &[along, Value::Const(base)])?;
    let flat = cx.emit(Cast { to: DType::I64 }, &[flat])?;
    let values = cx.emit(Reshape::new(vec![-1]), &[data])?;
    cx.out(Gather::new(0), &[values, flat])
}

/// ONNX GatherND (batch_dims 0): each index vector of the last axis of `indices`
/// picks a slice of `data` by its first `k` axes, a negative index counting from the
/// end: a Gather from `data` with those `k` axes flattened into one. Constant indices
/// (Falcon's and GPT-J's rotary tables, at positions known at import) give constant
/// positions, the whole of it computed at import where `data` is constant too; indices
/// computed at run time (a sequence classifier's logits at each row's last token:
/// `[row, length - 1]` pairs) give their offsets `sum(index * stride)`, computed in f64
/// (exact below 2^53), an index out of range then the Gather's error.
fn gather_nd(cx: &mut NodeCx) -> Result<Vec<Value>> {
    if cx.int_attr("batch_dims", 0)? != 0 {
        return Err(cx.err("only batch_dims 0 is supported"));
    }
    let (data, indices) = (cx.input(0)?, cx.input(1)?);
    let (shape, ishape) = (cx.ty(&data).shape, cx.ty(&indices).shape);
    let k = *ishape
        .last()
        .ok_or_else(|| cx.err("indices must have one axis or more"))?;
    if k == 0 || k > shape.len() {
        return Err(cx.err(format!(
            "index vectors of {k} elements for data of rank {}",
            shape.len()
        )));
    }
    if !cx.ty(&indices).dtype.is_int() {
        return Err(cx.err("indices must be integers"));
    }
    let outer = strides(&shape[..k]);
    let picks = match indices {
        Value::Const(indices) => {
            let idx = (indices.to_i64_vec()).ok_or_else(|| cx.err("indices must be integers"))?;
            let flat = (idx.chunks(k))
                .map(|v| {
                    (v.iter().zip(&shape).zip(&outer))
                        .map(|((&i, &n), &st)| index_in(i, n).map(|i| i * st))
                        .sum::<Result<usize, String>>()
                        .map(|at| at as i64)
                })
                .collect::<Result<Vec<i64>, String>>()
                .map_err(|m| cx.err(m))?;
            let picks = i64_tensor(ishape[..ishape.len() - 1].to_vec(), flat);
            Value::Const(picks.map_err(|m| cx.err(m))?)
        }
        Value::Port(_) => {
            let vector = |values: Vec<f64>| Tensor::from_f64(DType::F64, vec![k], &values);
            let sides = vector(shape[..k].iter().map(|&n| n as f64).collect());
            let outer = vector(outer.iter().map(|&st| st as f64).collect());
            let (sides, outer) = (sides.map_err(|m| cx.err(m))?, outer.map_err(|m| cx.err(m))?);
            let index = wrapped_in_f64(cx, indices, Value::Const(sides))?;
            let offsets = cx.emit(Binary::new(BinaryKind::Mul), &[index, Value::Const(outer)])?;
            let last = ishape.len() as i64 - 1;
            let sum = Reduce::new(ReduceKind::Sum, Some(vec![last]), false);
            let offsets = cx.emit(sum, &[offsets])?;
            cx.emit(Cast { to: DType::I64 }, &[offsets])?
        }
    };
    let mut rows = vec![shape[..k].iter().product::<usize>() as i64];
    rows.extend(shape[k..].iter().map(|&d| d as i64));
    let rows = cx.emit(Reshape::new(rows), &[data])?;
    cx.out(Gather::new(0), &[rows, picks])
}

/// Integer indices computed at run time, in f64 (exact within 2^53), each negative one
/// wrapped by its axis' size in `sides` (a scalar, or one a trailing axis of the
/// indices holds): `index + sides * (index < 0)`.
fn wrapped_in_f64(cx: &mut NodeCx, indices: Value, sides: Value) -> Result<Value> {
    let index = in_f64(cx, indices)?;
    let zero = scalar_like(DType::F64, 0.0);
    let negative = cx.emit(Compare::new(CompareKind::Less), &[index.clone(), zero])?;
    let negative = cx.emit(Cast { to: DType::F64 }, &[negative])?;
    let wrap = cx.emit(Binary::new(BinaryKind::Mul), &[negative, sides])?;
    cx.emit(Binary::new(BinaryKind::Add), &[index, wrap])
}

/// ONNX Ceil and Floor, computed at import (MobileViT's patch grid, its size rounded
/// up from the input's shape); on a value computed at run time, one error naming the
/// node and that input.
fn rounding(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let [x] = <[Tensor; 1]>::try_from(import_time_inputs(cx, 1)?)
        .map_err(|_| cx.err("takes one input"))?;
    if !x.dtype().is_float() {
        return Err(cx.err(format!("{} of {} values", cx.node.op_type, x.dtype())));
    }
    let round = if cx.node.op_type == "Ceil" {
        f64::ceil
    } else {
        f64::floor
    };
    let v: Vec<f64> = x.to_f64_vec().into_iter().map(round).collect();
    let out = Tensor::from_f64(x.dtype(), x.shape().to_vec(), &v).map_err(|m| cx.err(m))?;
    Ok(vec![Value::Const(out)])
}

/// ONNX Tile with repeats known at import (BLOOM's attention bias): each axis `x`
/// repeats `r` times, as `x` viewed with a new axis of 1 before each, broadcast to
/// `r` there and the pairs merged (Reshape, BroadcastTo, Reshape).
fn tile(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let shape = cx.ty(&x).shape;
    let repeats =
        (cx.ints_input(1)?).ok_or_else(|| cx.err("its repeats must be computed at import"))?;
    if repeats.len() != shape.len() || repeats.iter().any(|&r| r < 0) {
        return Err(cx.err(format!(
            "repeats {repeats:?} for a value of shape {shape:?}"
        )));
    }
    let repeats: Vec<usize> = repeats.iter().map(|&r| r as usize).collect();
    let paired = |first: &dyn Fn(usize) -> usize| -> Vec<usize> {
        (0..shape.len())
            .flat_map(|d| [first(d), shape[d]])
            .collect()
    };
    let viewed: Vec<i64> = paired(&|_| 1).iter().map(|&d| d as i64).collect();
    let out: Vec<i64> = (0..shape.len())
        .map(|d| (repeats[d] * shape[d]) as i64)
        .collect();
    let x = cx.emit(Reshape::new(viewed), &[x])?;
    let x = cx.emit(BroadcastTo::new(paired(&|d| repeats[d])), &[x])?;
    cx.out(Reshape::new(out), &[x])
}

/// ONNX CumSum along `axis` (`exclusive`: each sum without its own element;
/// `reverse`: from the end): computed at import for a constant x (HF's position ids
/// from a mask of ones), integers exactly; otherwise [`scan`].
fn cumsum(cx: &mut NodeCx) -> Result<Vec<Value>> {
    if let Value::Port(_) = cx.input(0)? {
        return scan(cx);
    }
    let [x, axis] = <[Tensor; 2]>::try_from(import_time_inputs(cx, 2)?)
        .map_err(|_| cx.err("takes x and axis"))?;
    let shape = x.shape().to_vec();
    let axis = (axis.to_i64_vec().and_then(|v| v.first().copied()))
        .ok_or_else(|| cx.err("axis must be an integer"))?;
    let axis = normalize_axis(axis, shape.len()).map_err(|m| cx.err(m))?;
    let (exclusive, reverse) = (
        cx.int_attr("exclusive", 0)? != 0,
        cx.int_attr("reverse", 0)? != 0,
    );
    let (len, inner) = (shape[axis], shape[axis + 1..].iter().product::<usize>());
    let outer = shape[..axis].iter().product::<usize>();
    // Each run along the axis: (outer, inner) fixed, positions in summing order.
    let sums = |v: &mut Vec<f64>| {
        for o in 0..outer {
            for i in 0..inner {
                let mut total = 0.0;
                for step in 0..len {
                    let p = if reverse { len - 1 - step } else { step };
                    let at = (o * len + p) * inner + i;
                    let here = v[at];
                    v[at] = if exclusive { total } else { total + here };
                    total += here;
                }
            }
        }
    };
    let out = match x.to_i64_vec().filter(|_| x.dtype().is_int()) {
        Some(ints) => {
            // i64 sums exactly: f64 holds them while below 2^53.
            let mut v: Vec<f64> = ints.iter().map(|&i| i as f64).collect();
            sums(&mut v);
            i64_tensor(shape, v.iter().map(|&f| f as i64).collect()).map(|t| t.cast(x.dtype()))
        }
        None => {
            let mut v = x.to_f64_vec();
            sums(&mut v);
            Tensor::from_f64(x.dtype(), shape, &v)
        }
    }
    .map_err(|m| cx.err(m))?;
    Ok(vec![Value::Const(out)])
}

/// CumSum of integers computed at run time (RoBERTa's position ids, from the input's
/// padding mask): `log2(len)` steps of `x += x shifted by 2^j along the axis` (a Pad
/// that crops what it shifts out), then one more shift where `exclusive`, in f64:
/// exact while the sums stay within 2^53. Floats are refused by name: summed in
/// that order they would round unlike onnxruntime's sums, one by one.
fn scan(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let ty = cx.ty(&x);
    let axis = (cx.ints_input(1)?)
        .and_then(|v| v.first().copied())
        .ok_or_else(|| cx.err("axis must be a constant integer"))?;
    let axis = normalize_axis(axis, ty.shape.len()).map_err(|m| cx.err(m))?;
    let (exclusive, reverse) = (
        cx.int_attr("exclusive", 0)? != 0,
        cx.int_attr("reverse", 0)? != 0,
    );
    if !ty.dtype.is_int() {
        return Err(cx.err(format!(
            "CumSum of {} values computed at run time is not imported (integers are)",
            ty.dtype
        )));
    }
    // Shifts by `k` towards the end (the start where `reverse`), zeros coming in.
    let shift = |k: usize| {
        let k = k as i64;
        let mut pads = vec![[0i64, 0]; ty.shape.len()];
        pads[axis] = if reverse { [-k, k] } else { [k, -k] };
        Pad::new(pads, PadMode::Constant(0.0))
    };
    let len = ty.shape[axis];
    let mut acc = in_f64(cx, x)?;
    let mut k = 1;
    while k < len {
        let shifted = cx.emit(shift(k), std::slice::from_ref(&acc))?;
        acc = cx.emit(Binary::new(BinaryKind::Add), &[acc, shifted])?;
        k *= 2;
    }
    if exclusive {
        acc = cx.emit(shift(1), &[acc])?;
    }
    cx.out(Cast { to: ty.dtype }, &[acc])
}

/// ONNX Trilu: the upper (`upper` 1) or lower triangle of each matrix of x's last two
/// axes from diagonal `k` (input 1, default 0), zeros elsewhere: a Where of a constant
/// mask, which keeps the values exactly (computed at import for a constant x).
fn trilu(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let xt = cx.ty(&x);
    let [.., m, n] = xt.shape[..] else {
        return Err(cx.err(format!("x {:?} must have two axes or more", xt.shape)));
    };
    let k = (cx.ints_input(1)?).map_or(0, |v| v.first().copied().unwrap_or(0));
    let upper = cx.int_attr("upper", 1)? != 0;
    let keep: Vec<f64> = (0..m * n)
        .map(|at| {
            let diagonal = (at % n) as i64 - (at / n) as i64;
            f64::from(u8::from(if upper { diagonal >= k } else { diagonal <= k }))
        })
        .collect();
    let mask = Tensor::from_f64(DType::Bool, [m, n], &keep).map_err(|m| cx.err(m))?;
    let zero = scalar_like(xt.dtype, 0.0);
    cx.out(Where, &[Value::Const(mask), x, zero])
}

/// ONNX ScatterND: a copy of `data` with the slices `indices` address (each row of
/// its last axis a prefix of data's coordinates) set from `updates`, or combined with
/// them (`reduction` add, mul, max, min); computed at import from constants. With
/// constant indices and data or updates computed at run time (RWKV's outputs written a
/// time step at a time; `x[:, t] = y` as torch exports it), setting them is a Where of
/// the written positions between the updates gathered into place and the data; the
/// reductions then are one error naming the node.
fn scatter_nd(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let reduction = cx.string_attr("reduction", "none")?;
    if !["none", "add", "mul", "max", "min"].contains(&reduction.as_str()) {
        return Err(cx.err(format!("reduction '{reduction}' is not an ONNX reduction")));
    }
    let (data_v, indices_v, updates_v) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let at_run_time = matches!(data_v, Value::Port(_)) || matches!(updates_v, Value::Port(_));
    if at_run_time && reduction == "none" {
        if let Value::Const(indices) = &indices_v {
            let shape = cx.ty(&data_v).shape;
            let writes = scatter_writes(cx, &shape, indices, &cx.ty(&updates_v).shape)?;
            return scatter_at_run_time(cx, data_v, updates_v, &shape, &writes);
        }
    }
    let [data, indices, updates] = <[Tensor; 3]>::try_from(import_time_inputs(cx, 3)?)
        .map_err(|_| cx.err("takes data, indices and updates"))?;
    let shape = data.shape().to_vec();
    let writes = scatter_writes(cx, &shape, &indices, updates.shape())?;
    let out = match (data.to_i64_vec(), updates.to_i64_vec()) {
        (Some(out), Some(upd)) if data.dtype().is_int() => {
            let out = scattered(out, &upd, &writes, &reduction);
            i64_tensor(shape, out).map(|t| t.cast(data.dtype()))
        }
        _ => {
            let out = scattered(
                data.to_f64_vec(),
                &updates.to_f64_vec(),
                &writes,
                &reduction,
            );
            Tensor::from_f64(data.dtype(), shape, &out)
        }
    };
    Ok(vec![Value::Const(out.map_err(|m| cx.err(m))?)])
}

/// `(position in data, position in updates)` of every element a ScatterND writes, in
/// order, for data of `shape`, its `indices` and updates of `updates`.
fn scatter_writes(
    cx: &NodeCx,
    shape: &[usize],
    indices: &Tensor,
    updates: &[usize],
) -> Result<Vec<(usize, usize)>> {
    let ishape = indices.shape().to_vec();
    let k = *ishape
        .last()
        .ok_or_else(|| cx.err("indices must have rank 1 or more"))?;
    let mut want: Vec<usize> = ishape[..ishape.len() - 1].to_vec();
    want.extend(shape.get(k..).unwrap_or(&[]));
    if k > shape.len() || updates != want.as_slice() {
        return Err(cx.err(format!(
            "indices {ishape:?} and updates {updates:?} do not address data {shape:?} (updates must be {want:?})"
        )));
    }
    let idx = (indices.to_i64_vec()).ok_or_else(|| cx.err("indices must be integers"))?;
    let st = strides(shape);
    let slice: usize = shape[k..].iter().product();
    let count: usize = updates.iter().product();
    let mut writes = Vec::with_capacity(count);
    for (row, at) in idx.chunks(k.max(1)).take(count / slice.max(1)).enumerate() {
        let mut base = 0;
        for (d, &i) in at.iter().enumerate().take(k) {
            base += index_in(i, shape[d]).map_err(|m| cx.err(m))? * st[d];
        }
        writes.extend((0..slice).map(|j| (base + j, row * slice + j)));
    }
    Ok(writes)
}

/// ScatterND's `writes` of `updates` into `data` where either is computed at run time:
/// `Where(written, Gather(updates flattened, source of each position), data)`, the
/// last write to a position winning.
fn scatter_at_run_time(
    cx: &mut NodeCx,
    data: Value,
    updates: Value,
    shape: &[usize],
    writes: &[(usize, usize)],
) -> Result<Vec<Value>> {
    let n: usize = shape.iter().product();
    let (mut written, mut source) = (vec![false; n], vec![0i64; n]);
    for &(at, from) in writes {
        written[at] = true;
        source[at] = from as i64;
    }
    let written = Tensor::new(shape.to_vec(), Data::Bool(written)).map_err(|m| cx.err(m))?;
    let source = i64_tensor(vec![n], source).map_err(|m| cx.err(m))?;
    let flat = cx.emit(Reshape::new(vec![-1]), &[updates])?;
    let placed = cx.emit(Gather::new(0), &[flat, Value::Const(source)])?;
    let placed = cx.emit(Reshape::new(shape_i64(shape)), &[placed])?;
    cx.out(Where, &[Value::Const(written), placed, data])
}

/// The values ScatterND combines: integers wrap as ONNX's int64 arithmetic does.
trait Scattered: Copy + PartialOrd {
    fn add(self, u: Self) -> Self;
    fn mul(self, u: Self) -> Self;
}

impl Scattered for i64 {
    fn add(self, u: i64) -> i64 {
        self.wrapping_add(u)
    }
    fn mul(self, u: i64) -> i64 {
        self.wrapping_mul(u)
    }
}

impl Scattered for f64 {
    fn add(self, u: f64) -> f64 {
        self + u
    }
    fn mul(self, u: f64) -> f64 {
        self * u
    }
}

/// `out` with each `(to, from)` of `writes` set from `updates[from]` or combined with
/// it by `reduction`.
fn scattered<T: Scattered>(
    mut out: Vec<T>,
    updates: &[T],
    writes: &[(usize, usize)],
    reduction: &str,
) -> Vec<T> {
    for &(to, from) in writes {
        let (d, u) = (out[to], updates[from]);
        out[to] = match reduction {
            "add" => d.add(u),
            "mul" => d.mul(u),
            "max" if d >= u => d,
            "min" if d <= u => d,
            _ => u,
        };
    }
    out
}

/// ONNX SoftmaxCrossEntropyLoss as ampgraph's loss computes it: scores [N, C], integer
/// labels [N], the mean over the rows; weights, ignore_index, other reductions and the
/// log-probabilities output are refused.
fn softmax_cross_entropy(cx: &mut NodeCx) -> Result<Vec<Value>> {
    if cx.num_inputs() > 2 {
        return Err(cx.err("class weights are not supported"));
    }
    if cx.node.output.len() > 1 {
        return Err(cx.err("the log-probabilities output is not supported"));
    }
    let reduction = cx.string_attr("reduction", "mean")?;
    if reduction != "mean" || cx.int_attr("ignore_index", i64::MIN)? != i64::MIN {
        return Err(cx.err(format!(
            "only the mean over every row is supported (reduction '{reduction}', ignore_index)"
        )));
    }
    let (x, labels) = (cx.input(0)?, cx.input(1)?);
    cx.out(SoftmaxCrossEntropy, &[x, labels])
}

fn where_(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let inputs = [cx.input(0)?, cx.input(1)?, cx.input(2)?];
    cx.out(Where, &inputs)
}

fn compare(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let kind = match cx.node.op_type.as_str() {
        "Equal" => CompareKind::Equal,
        "Less" => CompareKind::Less,
        "LessOrEqual" => CompareKind::LessOrEqual,
        "Greater" => CompareKind::Greater,
        _ => CompareKind::GreaterOrEqual,
    };
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    cx.out(Compare::new(kind), &[a, b])
}

fn logical(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let kind = match cx.node.op_type.as_str() {
        "And" => LogicalKind::And,
        "Or" => LogicalKind::Or,
        _ => LogicalKind::Xor,
    };
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    cx.out(Logical::new(kind), &[a, b])
}

fn not(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    cx.out(Not, &[x])
}

/// IsNaN as `!(x == x)`: only NaN is unequal to itself (CodeGen's attention mask).
fn is_nan(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let equal = cx.emit(Compare::new(CompareKind::Equal), &[x.clone(), x])?;
    cx.out(Not, &[equal])
}

/// Pad (opset 11 on: pads, the constant and, from 18, the axes as inputs).
fn pad(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let rank = cx.ty(&x).shape.len();
    let pads = cx
        .ints_input(1)?
        .ok_or_else(|| cx.err("the pads input is missing"))?;
    let axes: Vec<usize> = match cx.ints_input(3)? {
        Some(a) => a
            .iter()
            .map(|&v| normalize_axis(v, rank).map_err(|m| cx.err(m)))
            .collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(cx.err(format!(
            "pads {pads:?} must hold 2 numbers per padded axis ({})",
            axes.len()
        )));
    }
    let mut per_axis = vec![[0i64; 2]; rank];
    for (i, &ax) in axes.iter().enumerate() {
        per_axis[ax] = [pads[i], pads[i + axes.len()]];
    }
    let mode = match cx.string_attr("mode", "constant")?.as_str() {
        "constant" => {
            let value = cx
                .const_input(2)?
                .and_then(|t| t.to_f64_vec().first().copied())
                .unwrap_or(0.0);
            PadMode::Constant(value)
        }
        "reflect" => PadMode::Reflect,
        "edge" => PadMode::Edge,
        other => return Err(cx.err(format!("mode '{other}' is not supported"))),
    };
    cx.out(Pad::new(per_axis, mode), &[x])
}

/// Resize (opset 11 on) with its output size from `sizes`, or from `scales` where each
/// gives a whole size (our op maps coordinates with out / in, which is ONNX's scale
/// exactly then).
fn resize(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let xs = cx.ty(&x).shape;
    let coords = cx.string_attr("coordinate_transformation_mode", "half_pixel")?;
    // Only tf_crop_and_resize reads it, and it is refused.
    cx.ignore(&["extrapolation_value"]);
    if coords == "tf_crop_and_resize" {
        return Err(cx.err("coordinate_transformation_mode tf_crop_and_resize is not supported"));
    }
    if cx.int_attr("antialias", 0)? != 0 {
        return Err(cx.err("antialias is not supported"));
    }
    if cx.ints_attr("axes")?.is_some() {
        return Err(cx.err("the axes attribute is not supported"));
    }
    let shape: Vec<usize> = if let Some(sizes) = cx.ints_input(3)? {
        crate::tensor::shape_of(&sizes).map_err(|m| cx.err(format!("sizes: {m}")))?
    } else {
        let scales = cx
            .const_input(2)?
            .ok_or_else(|| cx.err("neither scales nor sizes is given"))?
            .to_f64_vec();
        if scales.len() != xs.len() {
            return Err(cx.err(format!(
                "scales {scales:?} must have one entry per axis of x {xs:?}"
            )));
        }
        xs.iter()
            .zip(&scales)
            .map(|(&d, &s)| {
                let out = d as f64 * s;
                if out.fract() != 0.0 || out < 0.0 {
                    Err(cx.err(format!("scale {s} of an axis of {d} gives {out}: only whole output sizes are supported")))
                } else {
                    Ok(out as usize)
                }
            })
            .collect::<Result<_>>()?
    };
    let nearest = cx.string_attr("nearest_mode", "round_prefer_floor")?;
    let mode = cx.string_attr("mode", "nearest")?;
    let coords = CoordinateTransform::from_name(&coords).map_err(|m| cx.err(m))?;
    if mode == "cubic" {
        return resize_cubic(cx, x, &shape, coords);
    }
    cx.ignore(&["cubic_coeff_a"]);
    let mode = ResizeMode::from_names(&mode, Some(&nearest)).map_err(|m| cx.err(m))?;
    if shape == xs {
        return Ok(vec![x]);
    }
    cx.out(Resize::new(shape, mode, coords), &[x])
}

/// A cubic Resize, computed at import: of a value known there (a position embedding
/// resized to the image's patch grid), as ONNX computes it.
fn resize_cubic(
    cx: &mut NodeCx,
    x: Value,
    shape: &[usize],
    coords: CoordinateTransform,
) -> Result<Vec<Value>> {
    let a = cx.float_attr("cubic_coeff_a", -0.75)?;
    let exclude_outside = cx.int_attr("exclude_outside", 0)? != 0;
    let Value::Const(x) = x else {
        return Err(cx.err(format!(
            "mode cubic is supported on values known at import (position embeddings), but \
             input 0 ('{}') is computed at run time",
            cx.node.input[0]
        )));
    };
    let y = resize_cubic_values(&x, shape, coords, a, exclude_outside).map_err(|m| cx.err(m))?;
    Ok(vec![Value::Const(y)])
}

/// Mod of integer constants (shape arithmetic): `fmod` 0 takes the divisor's sign,
/// as Python's %, 1 the dividend's, as C's.
fn modulo(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let (Some(a), Some(b)) = (cx.const_input(0)?, cx.const_input(1)?) else {
        return Err(cx.err("Mod is supported on constants only"));
    };
    let c_like = cx.int_attr("fmod", 0)? != 0;
    let t = int_zip(&a, &b, |x, y| match (x.checked_rem(y), c_like) {
        (None, _) => Err(format!("{x} mod {y} is undefined")),
        (Some(r), true) => Ok(r),
        (Some(r), false) if r != 0 && (r < 0) != (y < 0) => Ok(r + y),
        (Some(r), false) => Ok(r),
    })
    .map_err(|m| cx.err(m))?
    .ok_or_else(|| cx.err("Mod is supported on integers only"))?;
    Ok(vec![Value::Const(t)])
}

// ------------------------------------------------------------------ transforms

/// DFT of a signal whose length along `axis` is known at import, as products with the
/// transform's cosines and sines (computed in f64, stored in x's dtype): with the
/// signal A + iB along the axis, Re = A C + B S and Im = B C - A S, C and S the n x m
/// matrices cos(2 pi j k / n) and sin(2 pi j k / n) (the inverse's sines negated and
/// both divided by n), m = n, or n / 2 + 1 one-sided. FNet's token mixing (the real
/// part of a two-axis transform) becomes products that run as any product does. A
/// `dft_length` other than the signal's, and a one-sided transform of a complex
/// signal or an inverse one, are refused by name.
fn dft(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let xt = cx.ty(&x);
    let rank = xt.shape.len();
    // The last axis holds the real part, or the real and the imaginary parts.
    let parts = xt.shape.last().copied().unwrap_or(0);
    if rank < 2 || !(parts == 1 || parts == 2) {
        return Err(cx.err(format!(
            "input of shape {:?}: a signal with a last axis of 1 (real) or 2 (complex)",
            xt.shape
        )));
    }
    let axis = match cx.opset() {
        ..20 => cx.int_attr("axis", 1)?,
        _ => (cx.ints_input(2)?.and_then(|v| v.first().copied())).unwrap_or(-2),
    };
    let axis = normalize_axis(axis, rank).map_err(|m| cx.err(m))?;
    if axis == rank - 1 {
        return Err(cx.err("its axis is the last one, which holds the complex parts"));
    }
    let n = xt.shape[axis];
    if let Some(length) = cx.ints_input(1)?.and_then(|v| v.first().copied()) {
        if length != n as i64 {
            return Err(cx.err(format!(
                "dft_length {length} differs from the signal's {n} (padding or cropping the signal does not import)"
            )));
        }
    }
    let (inverse, onesided) = (
        cx.int_attr("inverse", 0)? != 0,
        cx.int_attr("onesided", 0)? != 0,
    );
    if onesided && (inverse || parts == 2) {
        return Err(
            cx.err("a one-sided transform of a complex signal, or an inverse one, does not import")
        );
    }
    let m = if onesided { n / 2 + 1 } else { n };
    let scale = if inverse { 1.0 / n as f64 } else { 1.0 };
    let sine_sign = if inverse { -1.0 } else { 1.0 };
    let matrix = |f: fn(f64) -> f64, sign: f64| -> Result<Value> {
        let values: Vec<f64> = (0..n * m)
            .map(|i| {
                let (j, k) = (i / m, i % m);
                let turn = ((j * k) % n.max(1)) as f64 / n as f64;
                sign * scale * f(2.0 * std::f64::consts::PI * turn)
            })
            .collect();
        let t = Tensor::from_f64(xt.dtype, [n, m], &values).map_err(|e| cx.err(e))?;
        Ok(Value::Const(t))
    };
    let (cos, sin) = (matrix(f64::cos, 1.0)?, matrix(f64::sin, sine_sign)?);
    // The signal's parts without the last axis, the transformed axis moved last.
    let mut signal: Vec<usize> = (0..rank - 1).filter(|&a| a != axis).collect();
    signal.push(axis);
    let moved: Vec<usize> = signal.iter().map(|&a| xt.shape[a]).collect();
    let rows = moved[..rank - 2].iter().product::<usize>() as i64;
    let mut part = |k: usize| -> Result<Value> {
        let mut begin = vec![0; rank];
        begin[rank - 1] = k;
        let mut size = vec![-1; rank];
        size[rank - 1] = 1;
        let mut v = cx.emit(Slice::new(begin, size), std::slice::from_ref(&x))?;
        if axis != rank - 2 {
            let perm: Vec<usize> = signal.iter().copied().chain([rank - 1]).collect();
            v = cx.emit(Transpose::new(perm), &[v])?;
        }
        cx.emit(Reshape::new(vec![rows, n as i64]), &[v])
    };
    let a = part(0)?;
    let b = if parts == 2 { Some(part(1)?) } else { None };
    let product = |cx: &mut NodeCx, v: &Value, w: &Value| {
        cx.emit(MatMul::new(false, false), &[v.clone(), w.clone()])
    };
    let (ac, asin) = (product(cx, &a, &cos)?, product(cx, &a, &sin)?);
    let (re, im) = match &b {
        None => (ac, cx.emit(Unary::new(UnaryKind::Neg), &[asin])?),
        Some(b) => {
            let (bc, bsin) = (product(cx, b, &cos)?, product(cx, b, &sin)?);
            (
                cx.emit(Binary::new(BinaryKind::Add), &[ac, bsin])?,
                cx.emit(Binary::new(BinaryKind::Sub), &[bc, asin])?,
            )
        }
    };
    // The parts side by side, then back to the signal's layout (m along the axis).
    let paired: Vec<Value> = [re, im]
        .into_iter()
        .map(|v| cx.emit(Reshape::new(vec![rows, m as i64, 1]), &[v]))
        .collect::<Result<_>>()?;
    let joined = cx.emit(Concat::new(2), &paired)?;
    let mut moved_out: Vec<i64> = moved[..rank - 2].iter().map(|&d| d as i64).collect();
    moved_out.extend([m as i64, 2]);
    let mut back = vec![0; rank];
    for (to, &from) in signal.iter().chain([&(rank - 1)]).enumerate() {
        back[from] = to;
    }
    if back.iter().enumerate().all(|(k, &a)| k == a) {
        return cx.out(Reshape::new(moved_out), &[joined]);
    }
    let joined = cx.emit(Reshape::new(moved_out), &[joined])?;
    cx.out(Transpose::new(back), &[joined])
}

/// Col2Im of blocks that tile the image (strides equal to the block, no padding or
/// dilation: MobileViTV2's fold of its unfolded patches), which is a rearrangement:
/// `[N, C * k1..kd, b1..bd]` viewed as `[N, C, k1..kd, b1..bd]`, its axes interleaved
/// to `[N, C, b1, k1, .., bd, kd]`, viewed as the image `[N, C, b1 k1, .., bd kd]`.
/// Overlapping blocks, which add up, are refused by name.
fn col2im(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let x = cx.input(0)?;
    let image =
        (cx.ints_input(1)?).ok_or_else(|| cx.err("its image_shape must be computed at import"))?;
    let block =
        (cx.ints_input(2)?).ok_or_else(|| cx.err("its block_shape must be computed at import"))?;
    let d = image.len();
    let strides = cx.ints_attr("strides")?.unwrap_or_else(|| vec![1; d]);
    let dilations = cx.ints_attr("dilations")?.unwrap_or_else(|| vec![1; d]);
    let pads = cx.ints_attr("pads")?.unwrap_or_else(|| vec![0; 2 * d]);
    let tiles = d > 0
        && block.len() == d
        && strides == block
        && dilations.iter().all(|&v| v == 1)
        && pads.iter().all(|&p| p == 0)
        && (image.iter().zip(&block)).all(|(&i, &k)| k > 0 && i > 0 && i % k == 0);
    if !tiles {
        return Err(cx.err(format!(
            "blocks {block:?} with strides {strides:?}, dilations {dilations:?} and pads {pads:?} into an image of {image:?}: only blocks that tile the image (strides equal to the block, no padding or dilation) import"
        )));
    }
    let shape = cx.ty(&x).shape;
    let counts: Vec<i64> = image.iter().zip(&block).map(|(&i, &k)| i / k).collect();
    let block_size: i64 = block.iter().product();
    let [n, c_blocks, l] = shape[..] else {
        return Err(cx.err(format!(
            "input of shape {shape:?}: [N, C * block size, blocks]"
        )));
    };
    let (n, c_blocks, l) = (n as i64, c_blocks as i64, l as i64);
    if c_blocks % block_size != 0 || l != counts.iter().product::<i64>() {
        return Err(cx.err(format!(
            "input of shape {shape:?}: not [N, C * {block_size}, {}] for blocks {block:?} tiling {image:?}",
            counts.iter().product::<i64>()
        )));
    }
    let c = c_blocks / block_size;
    let lead = [n, c];
    let viewed: Vec<i64> = lead.iter().chain(&block).chain(&counts).copied().collect();
    let perm: Vec<usize> = [0, 1]
        .into_iter()
        .chain((0..d).flat_map(|a| [2 + d + a, 2 + a]))
        .collect();
    let out: Vec<i64> = lead.iter().chain(&image).copied().collect();
    let x = cx.emit(Reshape::new(viewed), &[x])?;
    let x = cx.emit(Transpose::new(perm), &[x])?;
    cx.out(Reshape::new(out), &[x])
}
