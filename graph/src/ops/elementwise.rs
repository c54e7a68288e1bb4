//! Elementwise ops: unary activations and math, broadcasting binary ops, BiasAdd,
//! and their gradients (`UnaryGrad`, `BinaryGrad`). The maths of each unary and
//! binary function (CPU and CUDA, value and derivative) is one row of the tables in
//! `elementwise/kinds.rs`; this file holds the ops that run them.
//!
//! To add a unary op: add one row to the `unary_kinds!` table in `elementwise/kinds.rs`,
//! then put its name in the precision lists of each `allowlists/*.toml`.

mod kinds;

pub use kinds::{cuda_lit, BinaryKind, UnaryKind};
pub(crate) use kinds::{BINARY_OPS, UNARY_OPS};

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, par_fill, require_float, same_dtype, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::grad0;
use crate::ops::{DataFormat, Reduce, ReduceKind};
use crate::shape::{broadcast_indices, broadcast_shapes};
use crate::tensor::{ShapeDisplay, Tensor, TensorType};

pub(crate) const OTHER_OPS: &[OpEntry] = &[OpEntry {
    name: "BiasAdd",
    parse: |_, a| {
        Ok(Box::new(BiasAdd {
            data_format: DataFormat::read(a)?,
        }))
    },
}];

pub(crate) const GRAD_OPS: &[OpEntry] = &[
    OpEntry {
        name: "UnaryGrad",
        parse: |_, a| Ok(Box::new(UnaryGrad::parse(a)?)),
    },
    OpEntry {
        name: "BinaryGrad",
        parse: |_, a| Ok(Box::new(BinaryGrad::parse(a)?)),
    },
];

/// The ports of a fixed-size list (an op's inputs or outputs).
fn inputs_of<const N: usize>(inputs: &[Port]) -> Result<[Port; N], GraphError> {
    fixed(inputs).copied().map_err(GraphError::Format)
}

/// A one-input elementwise op.
#[derive(Clone, Debug, PartialEq)]
pub struct Unary {
    pub kind: UnaryKind,
}

impl Unary {
    pub fn new(kind: UnaryKind) -> Self {
        Unary { kind }
    }
}

impl FloatKernel for UnaryKind {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x] = fixed(inputs)?;
        let xs = T::read(x);
        let y = par_fill(xs.len(), |i| self.apply(xs[i]));
        Ok(vec![(x.shape().to_vec(), y)])
    }
}

impl Op for Unary {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn is_view(&self) -> bool {
        self.kind == UnaryKind::Identity
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        self.kind.attrs()
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        if self.kind != UnaryKind::Identity {
            require_float("the input", x.dtype)?;
        }
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        if self.kind == UnaryKind::Identity {
            return Ok(vec![(*x).clone()]);
        }
        eval_float(&self.kind, x.dtype(), inputs)
    }
    /// `dx = UnaryGrad(x, dy)`; Identity passes `dy` through; integer inputs (only
    /// Identity takes them) get none. Relu and Relu6 pass their output instead of `x`
    /// (as TensorFlow's ReluGrad may): `y` is in (0, 6) exactly where `x` is, so the
    /// mask is the same, and the pre-activation need not outlive the forward pass
    /// (a GEMM can then apply the activation in its epilogue in training too).
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x] = inputs_of(inputs)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None]);
        };
        if !b.ty(x).dtype.is_float() {
            return Ok(vec![None]);
        }
        let mask_source = match self.kind {
            UnaryKind::Identity => return Ok(vec![Some(dy)]),
            UnaryKind::Relu | UnaryKind::Relu6 => inputs_of::<1>(outputs)?[0],
            _ => x,
        };
        Ok(vec![Some(
            b.add(UnaryGrad { kind: self.kind }, &[mask_source, dy])?,
        )])
    }
}

/// The gradient of a [`Unary`] op: inputs `(x, dy)` of one shape and dtype, output
/// `dx = kind'(x) * dy` (exactly 0 where the derivative is 0, whatever `dy` holds, as
/// TensorFlow's masks give). For Relu and Relu6, autodiff passes the activation's
/// output as `x`: its derivative mask is the same. Attrs: `kind` (the unary op's name) and that kind's own
/// attrs (`approximate` for Gelu, `alpha` for LeakyRelu).
#[derive(Clone, Debug, PartialEq)]
pub struct UnaryGrad {
    pub kind: UnaryKind,
}

impl UnaryGrad {
    pub fn new(kind: UnaryKind) -> Self {
        UnaryGrad { kind }
    }

    fn parse(a: &mut AttrReader) -> OpResult<UnaryGrad> {
        let kind = a.opt_str("kind")?.ok_or("missing attr 'kind'")?;
        Ok(UnaryGrad {
            kind: UnaryKind::parse(&kind, a).map_err(|e| format!("attr 'kind': {e}"))?,
        })
    }
}

/// Requires `dy` to have the shape `want` (the shape of what it is the gradient of).
fn check_dy(dy: &[usize], want: &[usize], of: &str) -> OpResult<()> {
    if dy == want {
        Ok(())
    } else {
        Err(format!(
            "dy has shape {} but {of} has shape {}",
            ShapeDisplay(dy),
            ShapeDisplay(want)
        ))
    }
}

impl FloatKernel for UnaryGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, dy] = fixed(inputs)?;
        check_dy(dy.shape(), x.shape(), "x")?;
        let (xs, gs) = (T::read(x), T::read(dy));
        let dx = par_fill(xs.len(), |i| self.kind.input_grad(xs[i], gs[i]));
        Ok(vec![(x.shape().to_vec(), dx)])
    }
}

impl Op for UnaryGrad {
    fn name(&self) -> &'static str {
        "UnaryGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = vec![("kind", self.kind.name().into())];
        a.extend(self.kind.attrs());
        a
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, dy] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        check_dy(&dy.shape, &x.shape, "x")?;
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x, dy] = fixed(inputs)?;
        self.infer(&[&x.ty(), &dy.ty()])?;
        eval_float(self, x.dtype(), inputs)
    }
}

/// A two-input elementwise op with NumPy broadcasting.
#[derive(Clone, Debug, PartialEq)]
pub struct Binary {
    pub kind: BinaryKind,
}

impl Binary {
    pub fn new(kind: BinaryKind) -> Self {
        Binary { kind }
    }
}

/// Applies `f` over two broadcast operands into `out_shape`.
pub(crate) fn broadcast_zip<T: Copy + Sync, U: Send>(
    a: &[T],
    a_shape: &[usize],
    b: &[T],
    b_shape: &[usize],
    out_shape: &[usize],
    f: impl Fn(T, T) -> U + Sync + Send,
) -> Vec<U> {
    if a_shape == b_shape {
        return par_fill(a.len(), |i| f(a[i], b[i]));
    }
    // A scalar operand (loss scales, learning rates) needs no index maps.
    let n: usize = out_shape.iter().product();
    if b.len() == 1 && a.len() == n {
        return par_fill(n, |i| f(a[i], b[0]));
    }
    if a.len() == 1 && b.len() == n {
        return par_fill(n, |i| f(a[0], b[i]));
    }
    // Indices walked, not tabled: two tables of the output's size took 16 bytes an
    // element beside its values (5 GB to fold a 1 GiB broadcast Add at import).
    broadcast_indices(a_shape, out_shape)
        .zip(broadcast_indices(b_shape, out_shape))
        .map(|(i, j)| f(a[i], b[j]))
        .collect()
}

impl FloatKernel for BinaryKind {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [a, b] = fixed(inputs)?;
        let out = broadcast_shapes(a.shape(), b.shape())?;
        let y = broadcast_zip(
            &T::read(a),
            a.shape(),
            &T::read(b),
            b.shape(),
            &out,
            |x, y| self.apply(x, y),
        );
        Ok(vec![(out, y)])
    }
}

impl Op for Binary {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [a, b] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        Ok(vec![TensorType::new(
            dtype,
            broadcast_shapes(&a.shape, &b.shape)?,
        )])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_float(&self.kind, inputs[0].dtype(), inputs)
    }
    /// Each operand's gradient is `BinaryGrad` (or `dy` itself where the partial is 1)
    /// at the broadcast shape, summed back to the operand's shape.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let operands: [Port; 2] = inputs_of(inputs)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None, None]);
        };
        let mut out = Vec::with_capacity(2);
        for (wrt, &p) in operands.iter().enumerate() {
            let ty = b.ty(p).clone();
            if !ty.dtype.is_float() {
                out.push(None);
                continue;
            }
            let g = if matches!(
                (self.kind, wrt),
                (BinaryKind::Add, _) | (BinaryKind::Sub, 0)
            ) {
                dy
            } else {
                let op = BinaryGrad {
                    kind: self.kind,
                    wrt,
                };
                b.add(op, &[operands[0], operands[1], dy])?
            };
            out.push(Some(b.sum_to(g, &ty.shape)?));
        }
        Ok(out)
    }
}

/// The gradient of a [`Binary`] op with respect to operand `wrt` (0 or 1): inputs
/// `(a, b, dy)` with `dy` at the broadcast shape of `a` and `b`; the output, at that
/// broadcast shape, is [`BinaryKind::grad`] elementwise. Summing it back to the
/// operand's shape is left to a `SumTo`. Attrs: `kind` (the binary op's name), `wrt`.
#[derive(Clone, Debug, PartialEq)]
pub struct BinaryGrad {
    pub kind: BinaryKind,
    pub wrt: usize,
}

impl BinaryGrad {
    pub fn new(kind: BinaryKind, wrt: usize) -> Self {
        BinaryGrad { kind, wrt }
    }

    fn parse(a: &mut AttrReader) -> OpResult<BinaryGrad> {
        let kind = a.opt_str("kind")?.ok_or("missing attr 'kind'")?;
        let kind = BinaryKind::parse(&kind).map_err(|e| format!("attr 'kind': {e}"))?;
        let wrt = match a.opt_int("wrt")? {
            Some(0) => 0,
            Some(1) => 1,
            Some(w) => return Err(format!("attr 'wrt' must be 0 or 1, got {w}")),
            None => return Err("missing attr 'wrt'".into()),
        };
        Ok(BinaryGrad { kind, wrt })
    }

    fn output_shape(&self, a: &[usize], b: &[usize], dy: &[usize]) -> OpResult<Vec<usize>> {
        if self.wrt > 1 {
            return Err(format!("wrt must be 0 or 1, got {}", self.wrt));
        }
        let out = broadcast_shapes(a, b)?;
        check_dy(dy, &out, "the broadcast of a and b")?;
        Ok(out)
    }
}

impl FloatKernel for BinaryGrad {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [a, b, dy] = fixed(inputs)?;
        let out = self.output_shape(a.shape(), b.shape(), dy.shape())?;
        let (av, bv, gv) = (T::read(a), T::read(b), T::read(dy));
        let f = |i: usize, j: usize, g: T| self.kind.grad(self.wrt, av[i], bv[j], g);
        let dx = if a.shape() == b.shape() {
            par_fill(gv.len(), |i| f(i, i, gv[i]))
        } else {
            broadcast_indices(a.shape(), &out)
                .zip(broadcast_indices(b.shape(), &out))
                .zip(gv.iter())
                .map(|((i, j), &g)| f(i, j, g))
                .collect()
        };
        Ok(vec![(out, dx)])
    }
}

impl Op for BinaryGrad {
    fn name(&self) -> &'static str {
        "BinaryGrad"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(3)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("kind", self.kind.name().into()),
            ("wrt", (self.wrt as i64).into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [a, b, dy] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        Ok(vec![TensorType::new(
            dtype,
            self.output_shape(&a.shape, &b.shape, &dy.shape)?,
        )])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [a, b, dy] = fixed(inputs)?;
        self.infer(&[&a.ty(), &b.ty(), &dy.ty()])?;
        eval_float(self, a.dtype(), inputs)
    }
}

/// Adds a 1-D bias along the channel axis (last for NHWC, 1 for NCHW).
#[derive(Clone, Debug, PartialEq)]
pub struct BiasAdd {
    pub data_format: DataFormat,
}

impl BiasAdd {
    /// The channel axis of an input of rank `rank` (2 or more).
    pub fn channel_axis(&self, rank: usize) -> usize {
        match self.data_format {
            DataFormat::Nhwc => rank - 1,
            DataFormat::Nchw => 1,
        }
    }
}

impl FloatKernel for BiasAdd {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [x, bias] = fixed(inputs)?;
        let shape = x.shape();
        let axis = self.channel_axis(shape.len());
        let inner: usize = shape[axis + 1..].iter().product();
        let c = shape[axis];
        let (bias, xs) = (T::read(bias), T::read(x));
        let y = par_fill(xs.len(), |i| xs[i] + bias[(i / inner) % c]);
        Ok(vec![(shape.to_vec(), y)])
    }
}

impl Op for BiasAdd {
    fn name(&self) -> &'static str {
        "BiasAdd"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("data_format", self.data_format.into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x, bias] = fixed(inputs)?;
        let dtype = same_dtype(inputs)?;
        require_float("the inputs", dtype)?;
        if x.rank() < 2 {
            return Err(format!(
                "x must have rank 2 or more, got {}",
                ShapeDisplay(&x.shape)
            ));
        }
        let c = x.shape[self.channel_axis(x.rank())];
        if bias.shape != [c] {
            return Err(format!(
                "bias has shape {} but x {} has {c} channels",
                ShapeDisplay(&bias.shape),
                ShapeDisplay(&x.shape)
            ));
        }
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_float(self, inputs[0].dtype(), inputs)
    }
    /// `dx = dy`; `dbias` sums `dy` over every axis but the channel axis.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let [x, _bias] = inputs_of(inputs)?;
        let Some(dy) = grad0(grads) else {
            return Ok(vec![None, None]);
        };
        let rank = b.ty(x).rank();
        if rank < 2 {
            return Err(GraphError::Format(format!(
                "x must have rank 2 or more, got {rank}"
            )));
        }
        let channel = self.channel_axis(rank);
        let axes: Vec<i64> = (0..rank)
            .filter(|&a| a != channel)
            .map(|a| a as i64)
            .collect();
        let dbias = b.add(Reduce::new(ReduceKind::Sum, Some(axes), false), &[dy])?;
        Ok(vec![Some(dy), Some(dbias)])
    }
}
