//! Matrix products: MatMul (rank 2) and BatchMatMul (broadcast batch dimensions).
//!
//! Kernels run through the `gemm` crate in the kernel's compute type (f32 for f32, f16
//! and bf16 tensors, f64 for f64). Transposes are expressed as strides, never copied.

use std::any::TypeId;

use rayon::prelude::*;

use crate::attrs::AttrValue;
use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::{eval_float, require_float, same_dtype, FloatKernel, Real};
use crate::op::{fixed, Arity, Op, OpEntry, OpResult};
use crate::ops::{widens_exactly, BiasAdd, Binary, BinaryKind, DataFormat, Unary, UnaryKind};
use crate::shape::{broadcast_index_map, broadcast_shapes};
use crate::tensor::{checked_numel, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "MatMul",
        parse: |_, a| {
            Ok(Box::new(MatMul {
                transpose_a: a.bool_or("transpose_a", false)?,
                transpose_b: a.bool_or("transpose_b", false)?,
            }))
        },
    },
    OpEntry {
        name: "FusedMatMul",
        parse: |_, a| {
            Ok(Box::new(FusedMatMul {
                product: MatMul {
                    transpose_a: a.bool_or("transpose_a", false)?,
                    transpose_b: a.bool_or("transpose_b", false)?,
                },
                epilogue: a.choice("epilogue", &Epilogue::NAMES, None)?,
                to: a.opt_dtype("to")?,
                residual: a.bool_or("residual", false)?,
            }))
        },
    },
    OpEntry {
        name: "BatchMatMul",
        parse: |_, a| {
            Ok(Box::new(BatchMatMul {
                adj_x: a.bool_or("adj_x", false)?,
                adj_y: a.bool_or("adj_y", false)?,
                alpha: a.float_or("alpha", 1.0)?,
            }))
        },
    },
];

/// Products of at least this many multiply-adds use every core; smaller ones stay on
/// the calling thread, where spawning would cost more than it saves.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// A row-major matrix operand read through strides: element (i, j) sits at
/// `i * rs + j * cs`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatView<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> MatView<'a, T> {
    /// A contiguous row-major matrix of `cols` columns, read transposed when `transpose`.
    pub fn dense(data: &'a [T], cols: usize, transpose: bool) -> Self {
        if transpose {
            MatView {
                data,
                rs: 1,
                cs: cols,
            }
        } else {
            MatView {
                data,
                rs: cols,
                cs: 1,
            }
        }
    }

    /// Whether every element of a `rows x cols` view lies inside the slice.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows - 1).checked_mul(self.rs).and_then(|r| {
            (cols - 1)
                .checked_mul(self.cs)
                .and_then(|c| r.checked_add(c))
        });
        matches!(last, Some(l) if l < self.data.len())
    }
}

/// `dst = lhs x rhs` for an `m x k` lhs and a `k x n` rhs, `dst` row-major `m x n`
/// (overwritten). Every access is bounds-checked up front; an out-of-range view or a
/// compute type `gemm` does not know is an error, not a panic.
pub(crate) fn gemm_into<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    lhs: MatView<'_, T>,
    rhs: MatView<'_, T>,
    parallel: bool,
) -> OpResult<()> {
    let is_supported =
        TypeId::of::<T>() == TypeId::of::<f32>() || TypeId::of::<T>() == TypeId::of::<f64>();
    if !is_supported {
        return Err("matrix products run in f32 or f64 only".into());
    }
    if m.checked_mul(n) != Some(dst.len()) || !lhs.fits(m, k) || !rhs.fits(k, n) {
        return Err(format!(
            "internal: matrix product {m}x{k} by {k}x{n} does not fit its buffers"
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst.iter_mut().for_each(|v| *v = T::zero());
        return Ok(());
    }
    let work = m.saturating_mul(n).saturating_mul(k);
    let threads = rayon::current_num_threads();
    if parallel && work >= PARALLEL_MIN_WORK && threads > 1 && m >= 16 * threads {
        // Split the rows of dst into one band per thread, each an independent product
        // on one core: on few cores this beats gemm's own work splitting.
        let band = m.div_ceil(threads);
        return dst
            .par_chunks_mut(band * n)
            .enumerate()
            .try_for_each(|(i, d)| {
                let lhs = MatView {
                    data: &lhs.data[i * band * lhs.rs..],
                    ..lhs
                };
                gemm_into(d.len() / n, n, k, d, lhs, rhs, false)
            });
    }
    let parallelism = if parallel && work >= PARALLEL_MIN_WORK {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let strides = [n, lhs.cs, lhs.rs, rhs.cs, rhs.rs].map(isize::try_from);
    let [Ok(dst_rs), Ok(lhs_cs), Ok(lhs_rs), Ok(rhs_cs), Ok(rhs_rs)] = strides else {
        return Err("internal: matrix stride overflows isize".into());
    };
    // SAFETY: T is f32 or f64 (checked above), the types gemm supports. `fits`
    // proved every element (i, j) of both operands lies inside its slice, and dst is
    // a dense m x n row-major buffer of exactly m * n elements that we borrow
    // mutably. With read_dst = false gemm writes dst = lhs * rhs (alpha is unused).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs,
            false,
            lhs.data.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.data.as_ptr(),
            rhs_cs,
            rhs_rs,
            T::zero(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

fn common_float_dtype(inputs: &[&TensorType]) -> OpResult<()> {
    let dtype = same_dtype(inputs)?;
    require_float("the inputs", dtype)
}

/// Product of two matrices: `a [m, k] x b [k, n] -> [m, n]`, either operand optionally
/// transposed first.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct MatMul {
    pub transpose_a: bool,
    pub transpose_b: bool,
}

impl MatMul {
    pub fn new(transpose_a: bool, transpose_b: bool) -> Self {
        MatMul {
            transpose_a,
            transpose_b,
        }
    }

    /// The product's `(m, k, n)`: `a` is `m x k` and `b` is `k x n` after the transposes.
    pub fn dims(&self, a: &[usize], b: &[usize]) -> OpResult<(usize, usize, usize)> {
        if a.len() != 2 || b.len() != 2 {
            return Err(format!(
                "MatMul needs two matrices (rank 2): a is {}, b is {}",
                ShapeDisplay(a),
                ShapeDisplay(b)
            ));
        }
        let (m, ka) = if self.transpose_a {
            (a[1], a[0])
        } else {
            (a[0], a[1])
        };
        let (kb, n) = if self.transpose_b {
            (b[1], b[0])
        } else {
            (b[0], b[1])
        };
        if ka != kb {
            return Err(format!(
                "inner dimensions differ: a is {}, b is {}{}",
                ShapeDisplay(a),
                ShapeDisplay(b),
                transpose_note(
                    ("transpose_a", self.transpose_a),
                    ("transpose_b", self.transpose_b)
                )
            ));
        }
        Ok((m, ka, n))
    }
}

/// " (with transpose_a)" and the like, when an operand is transposed.
fn transpose_note(a: (&str, bool), b: (&str, bool)) -> String {
    match (a.1, b.1) {
        (false, false) => String::new(),
        (true, false) => format!(" (with {})", a.0),
        (false, true) => format!(" (with {})", b.0),
        (true, true) => format!(" (with {} and {})", a.0, b.0),
    }
}

impl FloatKernel for MatMul {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [a, b] = fixed(inputs)?;
        let (m, k, n) = self.dims(a.shape(), b.shape())?;
        let (av, bv) = (T::read(a), T::read(b));
        let mut out = vec![T::zero(); m * n];
        gemm_into(
            m,
            n,
            k,
            &mut out,
            MatView::dense(&av, a.shape()[1], self.transpose_a),
            MatView::dense(&bv, b.shape()[1], self.transpose_b),
            true,
        )?;
        Ok(vec![(vec![m, n], out)])
    }
}

impl Op for MatMul {
    fn name(&self) -> &'static str {
        "MatMul"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("transpose_a", self.transpose_a.into()),
            ("transpose_b", self.transpose_b.into()),
        ]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [a, b] = fixed(inputs)?;
        common_float_dtype(inputs)?;
        let (m, _, n) = self.dims(&a.shape, &b.shape)?;
        Ok(vec![TensorType::new(a.dtype, vec![m, n])])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_same_dtype_pair(self, inputs)
    }
    /// With `y = op_a(a) op_b(b)`: `da = dy op_b(b)^T` and `db = op_a(a)^T dy`, each
    /// written as one MatMul whose transpose flags absorb every transpose.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let (&[x, y], Some(&Some(dz))) = (inputs, grads.first()) else {
            return Ok(vec![None; inputs.len()]);
        };
        let (da, db) = matmul_grad_products(self.transpose_a, self.transpose_b, x, y, dz);
        let da = b.add(MatMul::new(da.2, da.3), &[da.0, da.1])?;
        let db = b.add(MatMul::new(db.2, db.3), &[db.0, db.1])?;
        Ok(vec![Some(da), Some(db)])
    }
}

/// Runs a product kernel on `a` and `b`, which must share one dtype.
fn eval_same_dtype_pair<K: FloatKernel>(op: &K, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
    let [a, b] = fixed(inputs)?;
    if a.dtype() != b.dtype() {
        return Err(format!("a is {} but b is {}", a.dtype(), b.dtype()));
    }
    eval_float(op, a.dtype(), inputs)
}

/// One product of a gradient rule: (lhs, rhs, transpose lhs, transpose rhs).
type GradProduct = (Port, Port, bool, bool);

/// The products giving the gradients of `a` and `b` in `z = op(a) op(b)` (TensorFlow's
/// `_MatMulGrad`): with `ta`/`tb` the transpose flags of the forward product,
///
/// | ta, tb | da | db |
/// |---|---|---|
/// | F, F | dz b^T | a^T dz |
/// | F, T | dz b | dz^T a |
/// | T, F | b dz^T | a dz |
/// | T, T | b^T dz^T | dz^T a^T |
fn matmul_grad_products(
    ta: bool,
    tb: bool,
    a: Port,
    b: Port,
    dz: Port,
) -> (GradProduct, GradProduct) {
    match (ta, tb) {
        (false, false) => ((dz, b, false, true), (a, dz, true, false)),
        (false, true) => ((dz, b, false, false), (dz, a, true, false)),
        (true, false) => ((b, dz, false, true), (a, dz, false, false)),
        (true, true) => ((b, dz, true, true), (dz, a, true, true)),
    }
}

/// Batched matrix product: `a [..., m, k] x b [..., k, n] -> [..., m, n]`, the batch
/// dimensions broadcast as in NumPy; `adj_x`/`adj_y` transpose the last two axes
/// (the adjoint, for real numbers). `alpha` (attr, default 1) scales the product, as
/// BLAS's does: the scale-into-matmul pass folds scalar multiplications in, which
/// then cost no pass over memory.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchMatMul {
    pub adj_x: bool,
    pub adj_y: bool,
    pub alpha: f64,
}

impl Default for BatchMatMul {
    fn default() -> Self {
        BatchMatMul::new(false, false)
    }
}

/// The shape facts of one batched product.
struct BatchDims {
    batch: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
}

impl BatchMatMul {
    pub fn new(adj_x: bool, adj_y: bool) -> Self {
        BatchMatMul {
            adj_x,
            adj_y,
            alpha: 1.0,
        }
    }

    /// The same product scaled by `alpha`.
    pub fn with_alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }

    fn dims(&self, a: &[usize], b: &[usize]) -> OpResult<BatchDims> {
        if a.len() < 2 || b.len() < 2 {
            return Err(format!(
                "BatchMatMul needs operands of rank 2 or more: a is {}, b is {}",
                ShapeDisplay(a),
                ShapeDisplay(b)
            ));
        }
        let (ra, rb) = (a.len(), b.len());
        let (m, ka) = if self.adj_x {
            (a[ra - 1], a[ra - 2])
        } else {
            (a[ra - 2], a[ra - 1])
        };
        let (kb, n) = if self.adj_y {
            (b[rb - 1], b[rb - 2])
        } else {
            (b[rb - 2], b[rb - 1])
        };
        if ka != kb {
            return Err(format!(
                "inner dimensions differ: a is {}, b is {}{}",
                ShapeDisplay(a),
                ShapeDisplay(b),
                transpose_note(("adj_x", self.adj_x), ("adj_y", self.adj_y))
            ));
        }
        let batch = broadcast_shapes(&a[..ra - 2], &b[..rb - 2]).map_err(|_| {
            format!(
                "batch dimensions {} of a {} and {} of b {} do not broadcast",
                ShapeDisplay(&a[..ra - 2]),
                ShapeDisplay(a),
                ShapeDisplay(&b[..rb - 2]),
                ShapeDisplay(b)
            )
        })?;
        Ok(BatchDims { batch, m, k: ka, n })
    }
}

impl FloatKernel for BatchMatMul {
    fn compute<T: Real>(&self, inputs: &[&Tensor]) -> OpResult<Vec<(Vec<usize>, Vec<T>)>> {
        let [a, b] = fixed(inputs)?;
        let (sa, sb) = (a.shape(), b.shape());
        let BatchDims { batch, m, k, n } = self.dims(sa, sb)?;
        let (ra, rb) = (sa.len(), sb.len());
        let mut shape = batch.clone();
        shape.extend([m, n]);
        let total = checked_numel(&shape).ok_or("the output shape overflows")?;
        let (av, bv) = (T::read(a), T::read(b));
        let mut out = vec![T::zero(); total];
        if total == 0 {
            return Ok(vec![(shape, out)]);
        }
        // Which a- and b-matrix each output matrix reads.
        let ia = broadcast_index_map(&sa[..ra - 2], &batch);
        let ib = broadcast_index_map(&sb[..rb - 2], &batch);
        let (a_size, b_size) = (m * k, k * n);
        let (a_cols, b_cols) = (sa[ra - 1], sb[rb - 1]);
        let one = |dst: &mut [T], (i, j): (usize, usize), parallel: bool| {
            gemm_into(
                m,
                n,
                k,
                dst,
                MatView::dense(&av[i * a_size..(i + 1) * a_size], a_cols, self.adj_x),
                MatView::dense(&bv[j * b_size..(j + 1) * b_size], b_cols, self.adj_y),
                parallel,
            )
        };
        let pairs: Vec<(usize, usize)> = ia.into_iter().zip(ib).collect();
        let per_matrix = m.saturating_mul(n).saturating_mul(k);
        if per_matrix >= PARALLEL_MIN_WORK || pairs.len() == 1 {
            // Large products: one at a time, each spread over every core.
            for (dst, &p) in out.chunks_mut(m * n).zip(&pairs) {
                one(dst, p, true)?;
            }
        } else {
            // Many small products: spread the batch over the cores.
            out.par_chunks_mut(m * n)
                .zip(pairs.par_iter())
                .try_for_each(|(dst, &p)| one(dst, p, false))?;
        }
        if self.alpha != 1.0 {
            let alpha = T::lit(self.alpha);
            out.iter_mut().for_each(|v| *v = *v * alpha);
        }
        Ok(vec![(shape, out)])
    }
}

impl Op for BatchMatMul {
    fn name(&self) -> &'static str {
        "BatchMatMul"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = vec![("adj_x", self.adj_x.into()), ("adj_y", self.adj_y.into())];
        if self.alpha != 1.0 {
            attrs.push(("alpha", self.alpha.into()));
        }
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [a, b] = fixed(inputs)?;
        common_float_dtype(inputs)?;
        let BatchDims {
            mut batch, m, n, ..
        } = self.dims(&a.shape, &b.shape)?;
        batch.extend([m, n]);
        Ok(vec![TensorType::new(a.dtype, batch)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        eval_same_dtype_pair(self, inputs)
    }
    /// As MatMul's rule, with BatchMatMul products (adjoint flags for the transposes);
    /// an operand whose batch dimensions were broadcast gets its gradient summed back
    /// to its own shape.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let (&[x, y], Some(&Some(dz))) = (inputs, grads.first()) else {
            return Ok(vec![None; inputs.len()]);
        };
        let (dx, dy) = matmul_grad_products(self.adj_x, self.adj_y, x, y, dz);
        let mut out = Vec::with_capacity(2);
        for ((lhs, rhs, adj_l, adj_r), operand) in [(dx, x), (dy, y)] {
            let op = BatchMatMul::new(adj_l, adj_r).with_alpha(self.alpha);
            let full = b.add(op, &[lhs, rhs])?;
            let shape = b.ty(operand).shape.clone();
            out.push(Some(b.sum_to(full, &shape)?));
        }
        Ok(out)
    }
}

/// The activation a [`FusedMatMul`] applies after its bias: those cuBLASLt's epilogues
/// compute exactly as the unfused op does (its GELU is the tanh approximation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    Bias,
    BiasRelu,
    BiasGeluTanh,
}

impl Epilogue {
    const NAMES: [(&'static str, Epilogue); 3] = [
        ("bias", Epilogue::Bias),
        ("bias_relu", Epilogue::BiasRelu),
        ("bias_gelu_tanh", Epilogue::BiasGeluTanh),
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, e)| *e == self)
            .map_or("bias", |(n, _)| n)
    }

    /// The activation op, if any.
    pub fn activation(self) -> Option<UnaryKind> {
        match self {
            Epilogue::Bias => None,
            Epilogue::BiasRelu => Some(UnaryKind::Relu),
            Epilogue::BiasGeluTanh => Some(UnaryKind::Gelu { approximate: true }),
        }
    }

    /// The epilogue that also applies `kind`, where one exists.
    pub fn with_activation(kind: UnaryKind) -> Option<Epilogue> {
        match kind {
            UnaryKind::Relu => Some(Epilogue::BiasRelu),
            UnaryKind::Gelu { approximate: true } => Some(Epilogue::BiasGeluTanh),
            _ => None,
        }
    }
}

/// `act(MatMul(a, b) + bias)` as one node (TensorFlow's `_FusedMatMul`): the product
/// with its bias (a vector over the output's columns) and activation folded into the
/// GEMM's epilogue. The CPU kernel runs the unfused ops in turn, rounding between them
/// as they do, so fusing never changes a CPU result. `to`: the result is stored in
/// this wider dtype (a widening Cast folded in; cuBLASLt writes it directly).
/// `residual`: a fourth input of the output's type is added after the bias (a
/// residual connection's `Add`, cuBLASLt's `C` matrix with beta 1); only without an
/// activation or a wider result.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedMatMul {
    pub product: MatMul,
    pub epilogue: Epilogue,
    pub to: Option<DType>,
    pub residual: bool,
}

/// A FusedMatMul's operands: a, b, the bias and the residual when there is one.
fn fused_operands<'a, T>(inputs: &[&'a T]) -> OpResult<(&'a T, &'a T, &'a T, Option<&'a T>)> {
    match *inputs {
        [a, b, bias] => Ok((a, b, bias, None)),
        [a, b, bias, r] => Ok((a, b, bias, Some(r))),
        _ => Err(format!("expected 3 or 4 inputs, got {}", inputs.len())),
    }
}

impl Op for FusedMatMul {
    fn name(&self) -> &'static str {
        "FusedMatMul"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(if self.residual { 4 } else { 3 })
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut attrs = self.product.attrs();
        attrs.push(("epilogue", self.epilogue.name().into()));
        if let Some(to) = self.to {
            attrs.push(("to", to.into()));
        }
        if self.residual {
            attrs.push(("residual", true.into()));
        }
        attrs
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let (a, b, bias, residual) = fused_operands(inputs)?;
        let out = self.product.infer(&[a, b])?;
        if let Some(r) = residual {
            if self.epilogue.activation().is_some() || self.to.is_some() {
                return Err(
                    "a residual is added only without an activation or a wider result".into(),
                );
            }
            if *r != out[0] {
                return Err(format!(
                    "the residual must be {} (the output's type), got {r}",
                    out[0]
                ));
            }
        }
        let n = out[0].shape[1];
        if bias.shape != [n] || bias.dtype != a.dtype {
            return Err(format!(
                "the bias must be {}[{n}] (one per output column), got {bias}",
                a.dtype
            ));
        }
        match self.to {
            Some(to) if to != a.dtype && !widens_exactly(a.dtype, to) => Err(format!(
                "the result can be stored wider only: {} does not widen to {to}",
                a.dtype
            )),
            Some(to) => Ok(vec![TensorType::new(to, out[0].shape.clone())]),
            None => Ok(out),
        }
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let (a, b, bias, residual) = fused_operands(inputs)?;
        let product = self.product.eval(&[a, b])?;
        let with_bias = BiasAdd {
            data_format: DataFormat::Nhwc,
        }
        .eval(&[&product[0], bias])?;
        let mut out = match self.epilogue.activation() {
            Some(kind) => Unary::new(kind).eval(&[&with_bias[0]])?,
            None => with_bias,
        };
        if let Some(to) = self.to {
            out[0] = out[0].cast(to);
        }
        if let Some(r) = residual {
            out = Binary::new(BinaryKind::Add).eval(&[&out[0], r])?;
        }
        Ok(out)
    }
}
