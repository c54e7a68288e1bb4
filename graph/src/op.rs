//! The `Op` trait: everything the project knows about one operation lives in the
//! op's own file — arity, attributes, the shape/dtype rule and the CPU reference
//! kernel (gradients and precision roles join here as they arrive).

use std::any::Any;
use std::fmt;

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::error::GraphError;
use crate::graph::Port;
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

    /// The reverse-mode rule. `grads[k]` is the loss gradient of output `k` (`None` when
    /// that output does not reach the loss); the result holds the gradient of each
    /// input (`None` for inputs without one: integers, statistics). Rules add their
    /// nodes through `b`.
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let _ = (b, inputs, outputs, grads);
        Err(crate::autodiff::not_differentiable(self.name()))
    }

    /// Whether output 0 is input 0 itself, seen anew (a Reshape, an Identity, the value
    /// an assignment passes on): executors alias it instead of running a kernel, and
    /// memory plans give it no buffer of its own.
    fn is_view(&self) -> bool {
        false
    }

    /// The op's type parameters (TensorFlow's type attributes): groups of input slots
    /// and output ports that always share one dtype. The first group is the node's
    /// primary type, the one mixed precision changes. By default every input and
    /// output share the [`typed_inputs`](Op::typed_inputs) type; an op whose other
    /// inputs form a fixed-precision group (batch-norm statistics) overrides this.
    /// The groups must depend only on the op's name and the two counts (the AMP pass
    /// computes them once per such triple).
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        let typed = self.typed_inputs(num_inputs);
        // A mask, not `typed.contains`: a Concat of n inputs would take n^2 steps.
        let mut is_typed = vec![false; num_inputs];
        for &i in typed.iter().filter(|&&i| i < num_inputs) {
            is_typed[i] = true;
        }
        let rest: Vec<usize> = (0..num_inputs).filter(|&i| !is_typed[i]).collect();
        let mut groups = vec![TypeGroup::new(typed, (0..num_outputs).collect())];
        if !rest.is_empty() {
            groups.push(TypeGroup::new(rest, vec![]).fixed());
        }
        groups
    }
}

/// One type parameter of an op: the input slots and output ports it types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeGroup {
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
    /// Whether this type may become a 16-bit float (false for e.g. batch-norm statistics).
    pub can_be_half: bool,
}

impl TypeGroup {
    pub fn new(inputs: Vec<usize>, outputs: Vec<usize>) -> Self {
        TypeGroup {
            inputs,
            outputs,
            can_be_half: true,
        }
    }

    pub fn fixed(mut self) -> Self {
        self.can_be_half = false;
        self
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

/// `f` of each member's inputs (`member_inputs` of them) in turn, the results in
/// turn, an error naming its member: a grouped op's inference and evaluation, whose
/// inputs and outputs are its members' in turn.
pub fn per_member<I, O>(
    inputs: &[I],
    member_inputs: usize,
    f: impl Fn(&[I]) -> OpResult<Vec<O>>,
) -> OpResult<Vec<O>> {
    let mut out = Vec::new();
    for (m, member) in inputs.chunks(member_inputs.max(1)).enumerate() {
        out.extend(f(member).map_err(|e| format!("member {m}: {e}"))?);
    }
    Ok(out)
}

/// The inputs as a fixed-size array (the graph checks arity first; ops use this to
/// destructure without panicking): `let [a, b] = fixed(inputs)?;`
pub fn fixed<const N: usize, T>(inputs: &[T]) -> OpResult<&[T; N]> {
    inputs
        .try_into()
        .map_err(|_| format!("expected {N} inputs, got {}", inputs.len()))
}
