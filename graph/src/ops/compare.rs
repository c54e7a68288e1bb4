//! Comparisons (Equal, Less, LessOrEqual, Greater, GreaterOrEqual) and the logical
//! ops on bools (And, Or, Xor, Not), as in ONNX: NumPy broadcasting, bool results,
//! no gradient. Each binary op is one row of a table below (its name in files and
//! its operator).
//!
//! Under mixed precision a comparison's inputs are one type parameter, as
//! TensorFlow's `T` of Less or Equal: the bool output is in no group, so the AMP
//! pass never casts it, and the inputs may become 16-bit. That is right because
//! comparing rounds nothing: 16-bit operands compare exactly as their f32 values
//! would. A clear comparison turns 16-bit only next to a 16-bit producer, whose
//! value is already rounded, so keeping it in f32 would buy a cast and no accuracy;
//! an f32 operand rounded for it can tie with a close value or become inf, the
//! risk Maximum and Minimum (also clear) take.

use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::kernel::same_dtype;
use crate::op::{fixed, Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::ops::elementwise::broadcast_zip;
use crate::ops::shape_ops::{dispatch, typed, Elem};
use crate::shape::broadcast_shapes;
use crate::tensor::{checked_numel, Data, ShapeDisplay, Tensor, TensorType};

/// A table of binary functions to bool: the kind enum, its names, the registry rows
/// that parse each name into `$Op`, and `apply` (`a <operator> b`).
macro_rules! kinds {
    (
        $(#[$kind_doc:meta])*
        $Kind:ident for $Op:ident in $OPS:ident, <$($g:ident: $bound:path)?> $T:ty {
            $( $(#[$doc:meta])* $V:ident => $name:literal ($op:tt), )*
        }
    ) => {
        $(#[$kind_doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $Kind {
            $( $(#[$doc])* $V, )*
        }

        pub(crate) const $OPS: &[OpEntry] = &[$(
            OpEntry {
                name: $name,
                parse: |_, _| Ok(Box::new($Op::new($Kind::$V))),
            },
        )*];

        impl $Kind {
            pub const ALL: [$Kind; [$($name),*].len()] = [$($Kind::$V),*];

            pub fn name(self) -> &'static str {
                match self {
                    $( Self::$V => $name, )*
                }
            }

            /// The function at one pair of elements.
            pub fn apply<$($g: $bound)?>(self, a: $T, b: $T) -> bool {
                match self {
                    $( Self::$V => a $op b, )*
                }
            }
        }
    };
}

kinds! {
    /// Which comparison a [`Compare`] makes. NaN compares false (Equal included).
    CompareKind for Compare in COMPARE_OPS, <T: PartialOrd> T {
        /// The one comparison bools take.
        Equal => "Equal" (==),
        Less => "Less" (<),
        LessOrEqual => "LessOrEqual" (<=),
        Greater => "Greater" (>),
        GreaterOrEqual => "GreaterOrEqual" (>=),
    }
}

kinds! {
    /// Which function of two bools a [`Logical`] computes.
    LogicalKind for Logical in LOGICAL_OPS, <> bool {
        And => "And" (&),
        Or => "Or" (|),
        Xor => "Xor" (^),
    }
}

pub(crate) const NOT_OPS: &[OpEntry] = &[OpEntry {
    name: "Not",
    parse: |_, _| Ok(Box::new(Not)),
}];

/// The inputs' common dtype and the bool result of a broadcasting two-input op.
fn bool_result(inputs: &[&TensorType]) -> OpResult<(DType, TensorType)> {
    let [a, b] = fixed(inputs)?;
    let dtype = same_dtype(inputs)?;
    let shape = broadcast_shapes(&a.shape, &b.shape)?;
    if checked_numel(&shape).is_none() {
        return Err(format!(
            "the result {} has too many elements",
            ShapeDisplay(&shape)
        ));
    }
    Ok((dtype, TensorType::new(DType::Bool, shape)))
}

/// Requires bool inputs (the logical ops).
fn require_bool(dtype: DType) -> OpResult<()> {
    if dtype == DType::Bool {
        Ok(())
    } else {
        Err(format!("the inputs must be bool, got {dtype}"))
    }
}

/// A bool result carries no gradient: every input gets none. Not an error, since a
/// loss may read a comparison through a Where's condition, which passes none either.
fn no_gradient(inputs: &[Port]) -> Result<Vec<Option<Port>>, GraphError> {
    Ok(vec![None; inputs.len()])
}

/// `a <kind> b` elementwise with NumPy broadcasting: inputs of one dtype (any but
/// bool for the orderings), a bool output.
#[derive(Clone, Debug, PartialEq)]
pub struct Compare {
    pub kind: CompareKind,
}

impl Compare {
    pub fn new(kind: CompareKind) -> Self {
        Compare { kind }
    }

    fn output_type(&self, inputs: &[&TensorType]) -> OpResult<TensorType> {
        let (dtype, out) = bool_result(inputs)?;
        if dtype == DType::Bool && self.kind != CompareKind::Equal {
            return Err(format!(
                "{} cannot order bool inputs (of the comparisons only Equal takes bools)",
                self.name()
            ));
        }
        Ok(out)
    }
}

fn compare_typed<T: Elem + PartialOrd + Sync>(
    kind: CompareKind,
    a: &Tensor,
    b: &Tensor,
    shape: &[usize],
) -> OpResult<Vec<bool>> {
    let (av, bv) = (typed::<T>(a)?, typed::<T>(b)?);
    Ok(broadcast_zip(
        av,
        a.shape(),
        bv,
        b.shape(),
        shape,
        |x, y| kind.apply(x, y),
    ))
}

impl Op for Compare {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![self.output_type(inputs)?])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [a, b] = fixed(inputs)?;
        let out = self.output_type(&[&a.ty(), &b.ty()])?;
        let y = dispatch!(a.dtype(), compare_typed(self.kind, a, b, &out.shape))?;
        Ok(vec![Tensor::new(out.shape, Data::Bool(y))?])
    }
    /// See the module's comment: the inputs may become 16-bit, the output stays bool.
    fn type_groups(&self, num_inputs: usize, _num_outputs: usize) -> Vec<TypeGroup> {
        vec![TypeGroup::new((0..num_inputs).collect(), vec![])]
    }
    fn gradient(
        &self,
        _b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        _grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        no_gradient(inputs)
    }
}

/// `a <kind> b` on bools, elementwise with NumPy broadcasting.
#[derive(Clone, Debug, PartialEq)]
pub struct Logical {
    pub kind: LogicalKind,
}

impl Logical {
    pub fn new(kind: LogicalKind) -> Self {
        Logical { kind }
    }

    fn output_type(inputs: &[&TensorType]) -> OpResult<TensorType> {
        let (dtype, out) = bool_result(inputs)?;
        require_bool(dtype)?;
        Ok(out)
    }
}

impl Op for Logical {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(2)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![Self::output_type(inputs)?])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [a, b] = fixed(inputs)?;
        let out = Self::output_type(&[&a.ty(), &b.ty()])?;
        let (av, bv) = (typed::<bool>(a)?, typed::<bool>(b)?);
        let y = broadcast_zip(av, a.shape(), bv, b.shape(), &out.shape, |x, y| {
            self.kind.apply(x, y)
        });
        Ok(vec![Tensor::new(out.shape, Data::Bool(y))?])
    }
    fn gradient(
        &self,
        _b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        _grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        no_gradient(inputs)
    }
}

/// `!x` on a bool tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Not;

impl Op for Not {
    fn name(&self) -> &'static str {
        "Not"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        require_bool(x.dtype)?;
        Ok(vec![(*x).clone()])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        require_bool(x.dtype())?;
        let y = typed::<bool>(x)?.iter().map(|&v| !v).collect();
        Ok(vec![Tensor::new(x.shape(), Data::Bool(y))?])
    }
    fn gradient(
        &self,
        _b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        _grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        no_gradient(inputs)
    }
}
