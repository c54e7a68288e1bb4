//! What each ONNX op takes at each opset: its input and output counts and its
//! attributes with their defaults ([`SCHEMAS`], generated from the onnx package's
//! operator schemas by scripts/onnx/schemas.py). Every node is checked against the
//! version in force at the model's opset before it is converted (counts, attribute
//! names, none twice, the required ones given), and after: an attribute its converter
//! did not read must hold its default, so that a node never runs as something else
//! than it says.

use std::fmt::Write as _;

use super::schemas::SCHEMAS;
use crate::proto::{attribute_type, AttributeProto, NodeProto};

/// An unbounded input or output count.
pub(super) const ANY: usize = usize::MAX;

/// An attribute's default, as the schema states it.
#[derive(Clone, Copy, Debug)]
pub(super) enum AttrDefault {
    /// The node must give it.
    Required,
    /// Optional, with no default value (absent means something of its own).
    Absent,
    Int(i64),
    Float(f32),
    Str(&'static str),
}

#[derive(Clone, Copy, Debug)]
pub(super) struct AttrSchema {
    pub name: &'static str,
    pub default: AttrDefault,
}

/// One version of an op: in force from opset `since` until the next version's.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpVersion {
    pub since: i64,
    /// Least and most inputs, optional ones given as "" counted.
    pub inputs: (usize, usize),
    pub outputs: (usize, usize),
    pub attrs: &'static [AttrSchema],
}

pub(super) const fn version(
    since: i64,
    inputs: (usize, usize),
    outputs: (usize, usize),
    attrs: &'static [AttrSchema],
) -> OpVersion {
    OpVersion {
        since,
        inputs,
        outputs,
        attrs,
    }
}

const fn attr(name: &'static str, default: AttrDefault) -> AttrSchema {
    AttrSchema { name, default }
}

pub(super) const fn required(name: &'static str) -> AttrSchema {
    attr(name, AttrDefault::Required)
}

pub(super) const fn optional(name: &'static str) -> AttrSchema {
    attr(name, AttrDefault::Absent)
}

pub(super) const fn int(name: &'static str, v: i64) -> AttrSchema {
    attr(name, AttrDefault::Int(v))
}

pub(super) const fn float(name: &'static str, v: f32) -> AttrSchema {
    attr(name, AttrDefault::Float(v))
}

pub(super) const fn string(name: &'static str, v: &'static str) -> AttrSchema {
    attr(name, AttrDefault::Str(v))
}

/// The version of `op` in force at `opset`, if ampgraph imports the op.
pub(super) fn lookup(op: &str, opset: i64) -> Option<&'static OpVersion> {
    let i = SCHEMAS.binary_search_by(|(name, _)| (*name).cmp(op)).ok()?;
    SCHEMAS[i].1.iter().rev().find(|v| v.since <= opset)
}

/// `n` thing(s), `least` to `most` of them.
fn counted(least: usize, most: usize, thing: &str) -> String {
    let plural = if most == 1 { "" } else { "s" };
    match (least, most) {
        (l, m) if l == m => format!("{l} {thing}{plural}"),
        (l, ANY) => format!("{l} or more {thing}s"),
        (l, m) => format!("{l} to {m} {thing}{plural}"),
    }
}

/// The attribute names of `v`, for messages.
fn names(v: &OpVersion) -> String {
    match v.attrs {
        [] => "none".into(),
        attrs => attrs.iter().map(|a| a.name).collect::<Vec<_>>().join(", "),
    }
}

/// Attributes of a later version of their op that exporters write at earlier opsets,
/// read there too: torch.onnx.export(dynamo=True, opset_version=17) converts GPT-2's
/// Splits down and keeps opset 18's `num_outputs` (the converter checks it against the
/// node's outputs).
const LATER_ATTRIBUTES: &[(&str, &str)] = &[("Split", "num_outputs")];

/// Checks `node` against version `v` of its op at `opset`: the input and output
/// counts, every attribute a known one given once, the required ones given.
pub(super) fn check_node(node: &NodeProto, v: &OpVersion, opset: i64) -> Result<(), String> {
    let op = &node.op_type;
    for (given, (least, most), thing) in [
        (node.input.len(), v.inputs, "input"),
        (node.output.len(), v.outputs, "output"),
    ] {
        if given < least || given > most {
            return Err(format!(
                "takes {}, not {given} ({op} at opset {opset})",
                counted(least, most, thing)
            ));
        }
    }
    for (i, a) in node.attribute.iter().enumerate() {
        let later = LATER_ATTRIBUTES.contains(&(op.as_str(), a.name.as_str()));
        if !later && !v.attrs.iter().any(|s| s.name == a.name) {
            return Err(format!(
                "attribute '{}' is not read at opset {opset} ({op}'s attributes there: {})",
                a.name,
                names(v)
            ));
        }
        if node.attribute[..i].iter().any(|b| b.name == a.name) {
            return Err(format!("attribute '{}' is given twice", a.name));
        }
    }
    if let Some(s) = (v.attrs.iter())
        .find(|s| matches!(s.default, AttrDefault::Required))
        .filter(|s| node.attribute.iter().all(|a| a.name != s.name))
    {
        return Err(format!("the required attribute '{}' is missing", s.name));
    }
    Ok(())
}

/// After conversion: each attribute of `node` that its converter did not read (not in
/// `read`) must hold its default, else it would have changed what the node computes.
pub(super) fn check_unread(node: &NodeProto, v: &OpVersion, read: &[String]) -> Result<(), String> {
    for a in node.attribute.iter().filter(|a| !read.contains(&a.name)) {
        let Some(s) = v.attrs.iter().find(|s| s.name == a.name) else {
            continue;
        };
        let holds_default = match s.default {
            AttrDefault::Int(d) => a.i == d,
            AttrDefault::Float(d) => a.f == d,
            AttrDefault::Str(d) => a.s == d.as_bytes(),
            AttrDefault::Required | AttrDefault::Absent => false,
        };
        if !holds_default {
            let mut msg = format!(
                "attribute '{}' = {} is not supported",
                a.name,
                value_text(a)
            );
            if let Some(d) = default_text(s.default) {
                let _ = write!(msg, " (only its default, {d})");
            }
            return Err(msg);
        }
    }
    Ok(())
}

fn default_text(d: AttrDefault) -> Option<String> {
    match d {
        AttrDefault::Int(v) => Some(v.to_string()),
        AttrDefault::Float(v) => Some(v.to_string()),
        AttrDefault::Str(v) => Some(format!("'{v}'")),
        AttrDefault::Required | AttrDefault::Absent => None,
    }
}

/// An attribute's value, short, for messages.
fn value_text(a: &AttributeProto) -> String {
    match a.r#type {
        attribute_type::INT => a.i.to_string(),
        attribute_type::FLOAT => a.f.to_string(),
        attribute_type::STRING => format!("'{}'", String::from_utf8_lossy(&a.s)),
        attribute_type::INTS => format!("{:?}", a.ints),
        attribute_type::FLOATS => format!("{:?}", a.floats),
        _ => "a tensor or graph".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import::ops::converter;
    use crate::import::{MAX_OPSET, MIN_OPSET};

    /// The table serves `lookup`'s binary search, and every op in it is one import
    /// converts, in force at each opset it is read at.
    #[test]
    fn the_table_is_sorted_and_names_the_converted_ops() {
        assert!(
            SCHEMAS.windows(2).all(|w| w[0].0 < w[1].0),
            "sorted by name"
        );
        for (op, versions) in SCHEMAS {
            assert!(
                *op == "If" || converter(op).is_some(),
                "{op} has no converter"
            );
            assert!(
                versions.windows(2).all(|w| w[0].since < w[1].since),
                "{op}: versions ascending"
            );
            assert!(versions[0].since <= MAX_OPSET, "{op}");
            if let Some(later) = versions.get(1) {
                assert!(
                    later.since > MIN_OPSET,
                    "{op}: one version in force at {MIN_OPSET}"
                );
            }
        }
        // Versions change what an opset reads: ReduceMean's axes moved from an
        // attribute to an input at 18.
        let at = |opset| lookup("ReduceMean", opset).unwrap();
        assert!(at(17).attrs.iter().any(|a| a.name == "axes"));
        assert_eq!((at(17).inputs, at(18).inputs), ((1, 1), (1, 2)));
        assert!(lookup("Gelu", 19).is_none() && lookup("Gelu", 20).is_some());
        assert!(lookup("Conv", 11).is_some() && lookup("NoSuchOp", 17).is_none());
    }

    /// torch.onnx.export(dynamo=True, opset_version=17) keeps opset 18's
    /// `num_outputs` on the Splits it converts down (Hugging Face GPT-2's q/k/v): read
    /// at 13 to 17 too; any other attribute of another version is still refused.
    #[test]
    fn split_reads_num_outputs_below_opset_18() {
        let split = |attr: &str| NodeProto {
            op_type: "Split".into(),
            input: vec!["qkv".into()],
            output: vec!["q".into(), "k".into(), "v".into()],
            attribute: vec![AttributeProto {
                name: attr.into(),
                r#type: attribute_type::INT,
                i: 3,
                ..Default::default()
            }],
            ..Default::default()
        };
        let v = lookup("Split", 17).unwrap();
        assert_eq!(check_node(&split("num_outputs"), v, 17), Ok(()));
        let err = check_node(&split("chunks"), v, 17).unwrap_err();
        assert!(
            err.contains("attribute 'chunks' is not read at opset 17"),
            "{err}"
        );
    }
}
