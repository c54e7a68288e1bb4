//! Ops with no inputs (Placeholder, Variable, Const) and Cast.

use std::sync::Arc;

use crate::attrs::{AttrReader, AttrValue};
use crate::autodiff::GradBuilder;
use crate::dtype::DType;
use crate::error::GraphError;
use crate::graph::Port;
use crate::op::{fixed, Arity, Op, OpEntry, OpResult, TypeGroup};
use crate::tensor::{checked_numel, Data, ShapeDisplay, Tensor, TensorType};

pub(crate) const OPS: &[OpEntry] = &[
    OpEntry {
        name: "Placeholder",
        parse: |_, a| Ok(Box::new(Placeholder(read_type(a)?))),
    },
    OpEntry {
        name: "Variable",
        parse: |_, a| {
            let ty = read_type(a)?;
            Ok(Box::new(Variable {
                ty,
                init: Init::read(a)?,
            }))
        },
    },
    OpEntry {
        name: "Const",
        parse: |_, a| Ok(Box::new(Const::parse(a)?)),
    },
    OpEntry {
        name: "Cast",
        parse: |_, a| Ok(Box::new(Cast { to: a.dtype("to")? })),
    },
];

fn read_type(a: &mut AttrReader) -> OpResult<TensorType> {
    let dtype = a.dtype("dtype")?;
    let shape = a.shape("shape")?;
    if checked_numel(&shape).is_none() {
        return Err(format!(
            "shape {} has more elements than can be addressed",
            ShapeDisplay(&shape)
        ));
    }
    Ok(TensorType::new(dtype, shape))
}

fn type_attrs(t: &TensorType) -> Vec<(&'static str, AttrValue)> {
    vec![
        ("dtype", t.dtype.into()),
        ("shape", t.shape.as_slice().into()),
    ]
}

fn not_computed(name: &str) -> String {
    format!("a {name} has no kernel: the executor supplies its value")
}

/// Whether `op` is a source whose value a step holds whole: a Placeholder (fed), a
/// Variable or a Const.
pub fn is_source(op: &dyn Op) -> bool {
    op.is::<Placeholder>() || op.is::<Variable>() || op.is::<Const>()
}

/// A value fed at run time.
#[derive(Clone, Debug, PartialEq)]
pub struct Placeholder(pub TensorType);

impl Op for Placeholder {
    fn name(&self) -> &'static str {
        "Placeholder"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(0)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        type_attrs(&self.0)
    }
    fn infer(&self, _: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![self.0.clone()])
    }
    fn eval(&self, _: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        Err(not_computed("Placeholder"))
    }
}

/// How a session fills a Variable before its first step.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Init {
    /// Glorot-uniform for rank >= 2 (weights), zeros otherwise (biases): Keras's defaults.
    #[default]
    Auto,
    Zeros,
    Constant(f64),
    GlorotUniform,
    GlorotNormal,
    HeUniform,
    HeNormal,
}

impl Init {
    const NAMES: [(&'static str, Init); 6] = [
        ("auto", Init::Auto),
        ("zeros", Init::Zeros),
        ("glorot_uniform", Init::GlorotUniform),
        ("glorot_normal", Init::GlorotNormal),
        ("he_uniform", Init::HeUniform),
        ("he_normal", Init::HeNormal),
    ];

    fn read(a: &mut AttrReader) -> OpResult<Init> {
        let value = a.opt_float("init_value")?;
        match (a.opt_str("init")?.as_deref(), value) {
            (Some("constant"), Some(v)) => Ok(Init::Constant(v)),
            (Some("constant"), None) => Err("init \"constant\" needs attr 'init_value'".into()),
            (_, Some(_)) => Err("attr 'init_value' goes with init \"constant\"".into()),
            (None, None) => Ok(Init::Auto),
            (Some(name), None) => Init::NAMES.iter().find(|(n, _)| *n == name).map(|&(_, i)| i).ok_or_else(|| {
                format!("unknown init '{name}' (known: auto zeros constant glorot_uniform glorot_normal he_uniform he_normal)")
            }),
        }
    }

    fn attrs(self) -> Vec<(&'static str, AttrValue)> {
        match self {
            Init::Auto => vec![],
            Init::Constant(v) => vec![("init", "constant".into()), ("init_value", v.into())],
            other => Init::NAMES
                .iter()
                .filter(|(_, i)| *i == other)
                .map(|(n, _)| ("init", AttrValue::from(*n)))
                .collect(),
        }
    }
}

/// A trainable value held by the session (in f32 under AMP: the master weights).
#[derive(Clone, Debug, PartialEq)]
pub struct Variable {
    pub ty: TensorType,
    pub init: Init,
}

impl Variable {
    pub fn new(ty: TensorType) -> Self {
        Variable {
            ty,
            init: Init::Auto,
        }
    }

    pub fn with_init(ty: TensorType, init: Init) -> Self {
        Variable { ty, init }
    }
}

impl Op for Variable {
    fn name(&self) -> &'static str {
        "Variable"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(0)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = type_attrs(&self.ty);
        a.extend(self.init.attrs());
        a
    }
    fn infer(&self, _: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![self.ty.clone()])
    }
    fn eval(&self, _: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        Err(not_computed("Variable"))
    }
}

/// `op`'s attributes, a Const's values left out (its [`Op::attrs`] copies them into
/// f64s, eight bytes an element): what the text dump shows and the binary form writes
/// beside the values' own bytes.
pub fn attrs_but_values(op: &dyn Op) -> Vec<(&'static str, AttrValue)> {
    match op.downcast_ref::<Const>() {
        Some(c) => type_attrs(&c.ty),
        None => op.attrs(),
    }
}

/// A constant; absent values mean zeros (kept lazy so a huge zero Const costs nothing
/// until it runs). The values are shared, not copied, by clones of the op (a graph's
/// copies), by the tensor it was made from and by the tensors it evaluates to: a
/// constant folded at import from a small file may be gigabytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Const {
    pub ty: TensorType,
    pub values: Option<Arc<Data>>,
}

impl Const {
    pub fn new(t: Tensor) -> Const {
        Const {
            ty: t.ty(),
            values: Some(t.into_shared_data()),
        }
    }

    fn parse(a: &mut AttrReader) -> OpResult<Const> {
        let ty = read_type(a)?;
        let values = match a.opt_floats("value")? {
            None => None,
            Some(v) => {
                let n = ty.checked_len().unwrap_or(usize::MAX);
                if v.len() != n {
                    return Err(format!(
                        "attr 'value' has {} values but shape {} needs {n}",
                        v.len(),
                        ShapeDisplay(&ty.shape)
                    ));
                }
                Some(Arc::new(Data::from_f64(ty.dtype, v)))
            }
        };
        Ok(Const { ty, values })
    }
}

impl Op for Const {
    fn name(&self) -> &'static str {
        "Const"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(0)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        let mut a = type_attrs(&self.ty);
        if let Some(v) = &self.values {
            a.push(("value", AttrValue::Floats(v.to_f64())));
        }
        a
    }
    fn infer(&self, _: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        Ok(vec![self.ty.clone()])
    }
    fn eval(&self, _: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        Ok(vec![match &self.values {
            Some(v) => Tensor::shared(self.ty.shape.clone(), v.clone())?,
            None => Tensor::zeros(&self.ty),
        }])
    }
}

/// Elementwise conversion to another dtype (round to nearest even for floats).
#[derive(Clone, Debug, PartialEq)]
pub struct Cast {
    pub to: DType,
}

impl Op for Cast {
    fn name(&self) -> &'static str {
        "Cast"
    }
    fn arity(&self) -> Arity {
        Arity::Exactly(1)
    }
    fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![("to", self.to.into())]
    }
    fn infer(&self, inputs: &[&TensorType]) -> OpResult<Vec<TensorType>> {
        let [x] = fixed(inputs)?;
        Ok(vec![x.with_dtype(self.to)])
    }
    fn eval(&self, inputs: &[&Tensor]) -> OpResult<Vec<Tensor>> {
        let [x] = fixed(inputs)?;
        Ok(vec![x.cast(self.to)])
    }
    fn gradient(
        &self,
        b: &mut GradBuilder,
        inputs: &[Port],
        _outputs: &[Port],
        grads: &[Option<Port>],
    ) -> Result<Vec<Option<Port>>, GraphError> {
        let dtype = b.ty(inputs[0]).dtype;
        Ok(match grads.first().copied().flatten() {
            Some(dy) if dtype.is_float() => vec![Some(b.add(Cast { to: dtype }, &[dy])?)],
            _ => vec![None],
        })
    }
    /// The destination type comes first: it is what the node produces.
    fn type_groups(&self, num_inputs: usize, num_outputs: usize) -> Vec<TypeGroup> {
        vec![
            TypeGroup::new(vec![], (0..num_outputs).collect()),
            TypeGroup::new((0..num_inputs).collect(), vec![]),
        ]
    }
}
