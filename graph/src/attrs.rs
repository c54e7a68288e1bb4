//! Untyped attribute values, as they stand in files, and a reader that turns them
//! into an op's typed attributes with precise errors.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;

/// One attribute value as written in a graph file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum AttrValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Ints(Vec<i64>),
    Floats(Vec<f64>),
}

impl AttrValue {
    fn kind(&self) -> &'static str {
        match self {
            AttrValue::Bool(_) => "a boolean",
            AttrValue::Int(_) => "an integer",
            AttrValue::Float(_) => "a number",
            AttrValue::Str(_) => "a string",
            AttrValue::Ints(_) => "a list of integers",
            AttrValue::Floats(_) => "a list of numbers",
        }
    }
}

impl From<bool> for AttrValue {
    fn from(v: bool) -> Self {
        AttrValue::Bool(v)
    }
}
impl From<i64> for AttrValue {
    fn from(v: i64) -> Self {
        AttrValue::Int(v)
    }
}
impl From<f64> for AttrValue {
    fn from(v: f64) -> Self {
        AttrValue::Float(v)
    }
}
impl From<&str> for AttrValue {
    fn from(v: &str) -> Self {
        AttrValue::Str(v.to_string())
    }
}
impl From<DType> for AttrValue {
    fn from(v: DType) -> Self {
        AttrValue::Str(v.as_str().to_string())
    }
}
impl From<Vec<i64>> for AttrValue {
    fn from(v: Vec<i64>) -> Self {
        AttrValue::Ints(v)
    }
}
impl From<&[usize]> for AttrValue {
    fn from(v: &[usize]) -> Self {
        AttrValue::Ints(v.iter().map(|&d| d as i64).collect())
    }
}

/// Attribute map of a node; keys starting with `_` belong to tools and are kept aside.
pub type AttrMap = BTreeMap<String, AttrValue>;

/// Hands out an op's attributes one by one; whatever is left at `finish` is unknown.
pub struct AttrReader {
    map: AttrMap,
}

type R<T> = Result<T, String>;

impl AttrReader {
    pub fn new(map: AttrMap) -> Self {
        AttrReader { map }
    }

    fn take(&mut self, key: &str) -> Option<AttrValue> {
        self.map.remove(key)
    }

    fn wrong(key: &str, want: &str, got: &AttrValue) -> String {
        format!("attr '{key}' must be {want}, got {}", got.kind())
    }

    fn missing(key: &str) -> String {
        format!("missing attr '{key}'")
    }

    pub fn opt_bool(&mut self, key: &str) -> R<Option<bool>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(Self::wrong(key, "a boolean", &v)),
        }
    }

    pub fn bool_or(&mut self, key: &str, default: bool) -> R<bool> {
        Ok(self.opt_bool(key)?.unwrap_or(default))
    }

    pub fn opt_int(&mut self, key: &str) -> R<Option<i64>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Int(i)) => Ok(Some(i)),
            Some(v) => Err(Self::wrong(key, "an integer", &v)),
        }
    }

    /// A required count of at least one (a grouped op's `members`).
    pub fn positive(&mut self, key: &str) -> R<usize> {
        let v = self
            .opt_int(key)?
            .ok_or_else(|| format!("missing attr '{key}'"))?;
        usize::try_from(v)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("attr '{key}' must be positive"))
    }

    pub fn opt_float(&mut self, key: &str) -> R<Option<f64>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Int(i)) => Ok(Some(i as f64)),
            Some(AttrValue::Float(f)) if f.is_finite() => Ok(Some(f)),
            Some(AttrValue::Float(_)) => Err(format!("attr '{key}' must be finite")),
            Some(v) => Err(Self::wrong(key, "a number", &v)),
        }
    }

    pub fn float_or(&mut self, key: &str, default: f64) -> R<f64> {
        Ok(self.opt_float(key)?.unwrap_or(default))
    }

    pub fn opt_str(&mut self, key: &str) -> R<Option<String>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Str(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(key, "a string", &v)),
        }
    }

    /// A string attr that must be one of `choices`; `default` when absent.
    pub fn choice<T: Copy>(
        &mut self,
        key: &str,
        choices: &[(&str, T)],
        default: Option<T>,
    ) -> R<T> {
        match self.opt_str(key)? {
            None => default.ok_or_else(|| Self::missing(key)),
            Some(s) => choices
                .iter()
                .find(|(name, _)| *name == s)
                .map(|&(_, v)| v)
                .ok_or_else(|| {
                    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
                    format!("attr '{key}' must be one of {}, got '{s}'", names.join(" "))
                }),
        }
    }

    pub fn dtype(&mut self, key: &str) -> R<DType> {
        self.opt_dtype(key)?.ok_or_else(|| Self::missing(key))
    }

    /// A dtype attr, `None` when absent.
    pub fn opt_dtype(&mut self, key: &str) -> R<Option<DType>> {
        self.opt_str(key)?
            .map(|s| s.parse().map_err(|e| format!("attr '{key}': {e}")))
            .transpose()
    }

    pub fn opt_ints(&mut self, key: &str) -> R<Option<Vec<i64>>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Ints(v)) => Ok(Some(v)),
            Some(v) => Err(Self::wrong(key, "a list of integers", &v)),
        }
    }

    pub fn ints(&mut self, key: &str) -> R<Vec<i64>> {
        self.opt_ints(key)?.ok_or_else(|| Self::missing(key))
    }

    /// A shape: a list of non-negative integers.
    pub fn shape(&mut self, key: &str) -> R<Vec<usize>> {
        self.ints(key)?
            .into_iter()
            .map(|d| {
                usize::try_from(d).map_err(|_| format!("attr '{key}' has a negative dimension {d}"))
            })
            .collect()
    }

    /// A pair of positive integers such as strides or a pooling window.
    pub fn pair(&mut self, key: &str, default: Option<[usize; 2]>) -> R<[usize; 2]> {
        match self.opt_ints(key)? {
            None => default.ok_or_else(|| Self::missing(key)),
            Some(v) if v.len() == 2 && v.iter().all(|&x| x > 0) => {
                Ok([v[0] as usize, v[1] as usize])
            }
            Some(v) => Err(format!(
                "attr '{key}' must be two positive integers, got {v:?}"
            )),
        }
    }

    pub fn opt_floats(&mut self, key: &str) -> R<Option<Vec<f64>>> {
        match self.take(key) {
            None => Ok(None),
            Some(AttrValue::Floats(v)) => Ok(Some(v)),
            Some(AttrValue::Ints(v)) => Ok(Some(v.into_iter().map(|i| i as f64).collect())),
            Some(v) => Err(Self::wrong(key, "a list of numbers", &v)),
        }
    }

    /// Ends reading: any attribute not taken is unknown to the op.
    pub fn finish(self) -> R<()> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(k) => Err(format!("unknown attr '{k}'")),
        }
    }
}
