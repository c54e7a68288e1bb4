//! The `Op` trait: everything the project knows about one operation lives in the
//! op's own file — arity, attributes, the shape/dtype rule and the CPU reference
//! kernel (gradients and precision roles join here as they arrive).

use std::any::Any;
use std::fmt;

use crate::attrs::{AttrReader, AttrValue};
use crate::tensor::{Tensor, TensorType};

/// How many inputs an op takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    Exactly(usize),
    AtLeast(usize),
}

impl Arity {
    pub fn accepts(self, n: usize) -> bool {
        match self {
            Arity::Exactly(k) => n == k,
            Arity::AtLeast(k) => n >= k,
        }
    }
}

impl fmt::Display for Arity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arity::Exactly(1) => write!(f, "1 input"),
            Arity::Exactly(k) => write!(f, "{k} inputs"),
            Arity::AtLeast(k) => write!(f, "at least {k} inputs"),
        }
    }
}

/// Op-level errors are plain messages; the graph adds the node's name and op.
pub type OpResult<T> = Result<T, String>;

pub trait Op: fmt::Debug + Send + Sync + Any + OpClone {
    /// The op's name in files and lists (`"MatMul"`).
    fn name(&self) -> &'static str;

    fn arity(&self) -> Arity;

    /// The typed attributes as they are written to files.
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        Vec::new()
    }

    /// The types of the outputs, given the inputs' types; the error says what disagrees.
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>>;

    /// The CPU reference kernel. Inputs have the types `infer` accepted.
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>>;

    /// Input slots whose dtype is the op's compute type: under mixed precision they
    /// change together with output 0. The rest (batch-norm statistics, labels) keep theirs.
    fn typed_inputs(&self, num_inputs: usize) -> Vec<usize> {
        (0..num_inputs).collect()
    }
}

/// Cloning a boxed op; implemented for every `Op + Clone`.
pub trait OpClone {
    fn clone_op(&self) -> Box<dyn Op>;
}

impl<T: Op + Clone> OpClone for T {
    fn clone_op(&self) -> Box<dyn Op> {
        Box::new(self.clone())
    }
}

impl Clone for Box<dyn Op> {
    fn clone(&self) -> Self {
        self.clone_op()
    }
}

impl dyn Op {
    pub fn downcast_ref<T: Op>(&self) -> Option<&T> {
        (self as &dyn Any).downcast_ref::<T>()
    }

    pub fn is<T: Op>(&self) -> bool {
        self.downcast_ref::<T>().is_some()
    }
}

/// Two ops are equal when they have the same name and attributes.
impl PartialEq for dyn Op {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name() && self.attrs() == other.attrs()
    }
}

/// Builds an op of the given name from its attributes.
pub type OpParser = fn(name: &'static str, attrs: &mut AttrReader) -> OpResult<Box<dyn Op>>;

/// One row of the op registry: each op family contributes its rows.
pub struct OpEntry {
    pub name: &'static str,
    pub parse: OpParser,
}

/// The inputs as a fixed-size array (the graph checks arity first; ops use this to
/// destructure without panicking): `let [a, b] = fixed(inputs)?;`
pub fn fixed<const N: usize, T>(inputs: &[T]) -> OpResult<&[T; N]> {
    inputs
        .try_into()
        .map_err(|_| format!("expected {N} inputs, got {}", inputs.len()))
}
