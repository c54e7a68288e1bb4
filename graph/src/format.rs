//! File formats: the `ampgraph.graph` JSON interchange format (docs/design.md §2), a
//! compact binary form of the same content, and text / Graphviz dumps.
//!
//! Both file formats go through [`GraphDef`], the untyped file-level form; building a
//! [`Graph`] from it parses every op's attributes and checks the whole graph.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::attrs::{AttrMap, AttrReader, AttrValue};
use crate::dtype::DType;
use crate::error::{GraphError, Result};
use crate::graph::{Graph, NodeId};
use crate::ops::fused::MEMBERS_ANNOTATION;
use crate::ops::parse_op;
use crate::ops::{attrs_but_values, Const};
use crate::tensor::Data;

pub const FORMAT_NAME: &str = "ampgraph.graph";
pub const FORMAT_VERSION: u32 = 1;
/// Top-level key (a tool key) marking a graph for the AMP rewrite.
const MIXED_PRECISION_KEY: &str = "_mixed_precision";
/// First bytes of a binary graph file, followed by the version as u32 little-endian.
pub const BIN_MAGIC: &[u8; 8] = b"AMPGRAPH";
/// The binary form's version: 2 keeps constants' values as their own little-endian
/// bytes after the graph (version 1, still read, held them as f64s in the graph: twice
/// an f32 model's size, and past its decoding bound from 128M values).
pub const BIN_VERSION: u32 = 2;
/// Upper bound on what decoding a binary file's graph (not its constants' bytes, which
/// are read in place) may allocate.
const BIN_LIMIT: usize = 1 << 30;

/// A graph as a file holds it: names, op names, untyped attributes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GraphDef {
    pub nodes: Vec<NodeDef>,
    pub outputs: Vec<String>,
    /// The graph asks for the AMP rewrite to this type (`_mixed_precision` in JSON).
    pub mixed_precision: Option<DType>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeDef {
    pub name: String,
    pub op: String,
    pub inputs: Vec<String>,
    pub attrs: AttrMap,
    /// The dtype of output 0; written by ampgraph, checked when read.
    pub dtype: Option<DType>,
    /// A Const's values in their own type, shared with the graph it came from
    /// ([`GraphDef::from_graph`]; the binary form stores their bytes). JSON writes
    /// them as the attr `value`, and a Const read from JSON has them there instead.
    #[serde(skip)]
    pub values: Option<Arc<Data>>,
}

impl GraphDef {
    pub fn from_graph(g: &Graph) -> GraphDef {
        let nodes = g
            .node_ids()
            .map(|id| {
                let n = g.node(id);
                let mut attrs: AttrMap = (attrs_but_values(n.op.as_ref()).into_iter())
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                attrs.extend(n.annotations.iter().map(|(k, v)| (k.clone(), v.clone())));
                NodeDef {
                    name: n.name.clone(),
                    op: n.op.name().to_string(),
                    inputs: g.inputs(id).into_iter().map(|p| g.port_name(p)).collect(),
                    attrs,
                    dtype: n.outputs().first().map(|t| t.dtype),
                    values: (n.op.downcast_ref::<Const>()).and_then(|c| c.values.clone()),
                }
            })
            .collect();
        let outputs = g.outputs().iter().map(|&p| g.port_name(p)).collect();
        GraphDef {
            nodes,
            outputs,
            mixed_precision: g.mixed_precision,
        }
    }

    /// Parses every op and checks the graph: names, arity, inputs, acyclicity, types.
    pub fn to_graph(&self) -> Result<Graph> {
        let mut parts = Vec::with_capacity(self.nodes.len());
        let mut annotations = Vec::new();
        for n in &self.nodes {
            let (tool, own): (AttrMap, AttrMap) = n
                .attrs
                .clone()
                .into_iter()
                .partition(|(k, _)| k.starts_with('_'));
            let mut op = parse_op(&n.op, AttrReader::new(own))
                .map_err(|m| GraphError::node(&n.name, &n.op, m))?;
            if let Some(values) = &n.values {
                op = with_values(op.as_ref(), values)
                    .map_err(|m| GraphError::node(&n.name, &n.op, m))?;
            }
            parts.push((n.name.clone(), op, n.inputs.clone()));
            annotations.push(tool);
        }
        let mut g = Graph::from_parts(parts, &self.outputs)?;
        g.mixed_precision = self.mixed_precision;
        for (n, tool) in self.nodes.iter().zip(annotations) {
            let id = g.require(&n.name)?;
            let node = g.node_mut(id);
            node.annotations = tool;
            if let (Some(file), Some(actual)) = (n.dtype, node.outputs().first()) {
                if file != actual.dtype {
                    return Err(GraphError::node(
                        &n.name,
                        &n.op,
                        format!(
                            "the file says dtype {file} but its inputs make it {}",
                            actual.dtype
                        ),
                    ));
                }
            }
        }
        Ok(g)
    }
}

/// The Const `op` holding `values`, or why they cannot be its values.
fn with_values(
    op: &dyn crate::op::Op,
    values: &Arc<Data>,
) -> std::result::Result<Box<dyn crate::op::Op>, String> {
    let Some(c) = op.downcast_ref::<Const>() else {
        return Err("values stored for a node that is not a Const".into());
    };
    if c.values.is_some() {
        return Err("values stored twice: in attr 'value' and as bytes".into());
    }
    let n = c.ty.checked_len().unwrap_or(usize::MAX);
    if values.dtype() != c.ty.dtype || values.len() != n {
        return Err(format!(
            "{} stored values of {} but the Const is {}",
            values.len(),
            values.dtype(),
            c.ty
        ));
    }
    Ok(Box::new(Const {
        ty: c.ty.clone(),
        values: Some(values.clone()),
    }))
}

// ---------------------------------------------------------------- JSON reading

fn format_err(msg: impl Into<String>) -> GraphError {
    GraphError::Format(msg.into())
}

/// A JSON document as the file formats read one: a UTF-8 byte order mark ignored, an
/// object that repeats a key refused (serde_json alone would keep the last). The
/// error is the message after "not valid JSON: ".
pub fn json_value(bytes: &[u8]) -> std::result::Result<Value, String> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    // serde_json refuses nesting deeper than 128 levels, so hostile input can't overflow
    // the stack in either parse.
    serde_json::from_slice::<UniqueKeys>(bytes).map_err(|e| e.to_string())?;
    serde_json::from_slice(bytes).map_err(|e| e.to_string())
}

/// Any JSON value whose objects name each key once.
struct UniqueKeys;

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(UniqueKeys)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueKeys {
    type Value = UniqueKeys;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> std::result::Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_i64<E>(self, _: i64) -> std::result::Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_u64<E>(self, _: u64) -> std::result::Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_f64<E>(self, _: f64) -> std::result::Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_str<E>(self, _: &str) -> std::result::Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_unit<E>(self) -> std::result::Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut items: A,
    ) -> std::result::Result<UniqueKeys, A::Error> {
        while items.next_element::<UniqueKeys>()?.is_some() {}
        Ok(UniqueKeys)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut entries: A,
    ) -> std::result::Result<UniqueKeys, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = entries.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!("duplicate key '{key}'")));
            }
            entries.next_value::<UniqueKeys>()?;
        }
        Ok(UniqueKeys)
    }
}

/// Parses the JSON interchange format (structure only; see [`GraphDef::to_graph`]).
pub fn parse_json(bytes: &[u8]) -> Result<GraphDef> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(format_err("the file is empty"));
    }
    let v = json_value(bytes).map_err(|e| format_err(format!("not valid JSON: {e}")))?;
    let top = v
        .as_object()
        .ok_or_else(|| format_err("a graph file must be a JSON object"))?;
    for key in top.keys() {
        if !matches!(key.as_str(), "format" | "version" | "nodes" | "outputs")
            && !key.starts_with('_')
        {
            return Err(format_err(format!("unknown top-level key '{key}'")));
        }
    }
    match top.get("format") {
        Some(Value::String(s)) if s == FORMAT_NAME => {}
        Some(other) => {
            return Err(format_err(format!(
                "'format' must be \"{FORMAT_NAME}\", got {other}"
            )))
        }
        None => return Err(format_err(format!("missing 'format' (\"{FORMAT_NAME}\")"))),
    }
    match top.get("version").and_then(Value::as_u64) {
        Some(v) if v == u64::from(FORMAT_VERSION) => {}
        Some(v) => {
            return Err(format_err(format!(
                "unsupported version {v} (this ampgraph reads version {FORMAT_VERSION})"
            )))
        }
        None => return Err(format_err("missing or non-integer 'version'")),
    }
    let nodes = top
        .get("nodes")
        .and_then(Value::as_array)
        .ok_or_else(|| format_err("missing 'nodes' list"))?
        .iter()
        .enumerate()
        .map(|(i, n)| parse_node(i, n))
        .collect::<Result<Vec<_>>>()?;
    let outputs = match top.get("outputs") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|o| {
                o.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format_err("'outputs' must be a list of node names"))
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(format_err("'outputs' must be a list of node names")),
    };
    let mixed_precision = match top.get(MIXED_PRECISION_KEY) {
        None => None,
        Some(Value::String(s)) => Some(
            s.parse::<DType>()
                .map_err(|e| format_err(format!("'{MIXED_PRECISION_KEY}': {e}")))?,
        ),
        Some(_) => {
            return Err(format_err(format!(
                "'{MIXED_PRECISION_KEY}' must be a dtype string"
            )))
        }
    };
    Ok(GraphDef {
        nodes,
        outputs,
        mixed_precision,
    })
}

fn parse_node(index: usize, v: &Value) -> Result<NodeDef> {
    let obj = v
        .as_object()
        .ok_or_else(|| format_err(format!("node #{index} is not a JSON object")))?;
    let name = match obj.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(_) => {
            return Err(format_err(format!(
                "node #{index}: 'name' must be a non-empty string"
            )))
        }
        None => return Err(format_err(format!("node #{index} has no 'name'"))),
    };
    let op = match obj.get("op") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(GraphError::node(&name, "?", "missing or non-string 'op'")),
    };
    let err = |m: String| GraphError::node(&name, &op, m);
    for key in obj.keys() {
        if !matches!(key.as_str(), "name" | "op" | "inputs" | "attrs" | "dtype")
            && !key.starts_with('_')
        {
            return Err(err(format!("unknown key '{key}'")));
        }
    }
    let inputs = match obj.get("inputs") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| err("'inputs' must be a list of strings".into()))
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(err("'inputs' must be a list of strings".into())),
    };
    let attrs = match obj.get("attrs") {
        None => AttrMap::new(),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| {
                json_to_attr(v)
                    .map(|a| (k.clone(), a))
                    .map_err(|e| err(format!("attr '{k}': {e}")))
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(err("'attrs' must be an object".into())),
    };
    let dtype = match obj.get("dtype") {
        None => None,
        Some(Value::String(s)) => Some(s.parse().map_err(|e: String| err(e))?),
        Some(_) => return Err(err("'dtype' must be a string".into())),
    };
    Ok(NodeDef {
        name,
        op,
        inputs,
        attrs,
        dtype,
        values: None,
    })
}

/// Non-finite numbers have no JSON spelling; lists of numbers write them as strings.
fn special_float(s: &str) -> Option<f64> {
    match s {
        "nan" | "NaN" => Some(f64::NAN),
        "inf" | "Infinity" => Some(f64::INFINITY),
        "-inf" | "-Infinity" => Some(f64::NEG_INFINITY),
        _ => None,
    }
}

fn json_to_attr(v: &Value) -> std::result::Result<AttrValue, String> {
    Ok(match v {
        Value::Bool(b) => AttrValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AttrValue::Int(i),
            None => AttrValue::Float(n.as_f64().ok_or("number out of range")?),
        },
        Value::String(s) => AttrValue::Str(s.clone()),
        Value::Array(items) => {
            if items.iter().all(|x| x.as_i64().is_some()) {
                AttrValue::Ints(items.iter().filter_map(Value::as_i64).collect())
            } else {
                AttrValue::Floats(
                    items
                        .iter()
                        .map(|x| match x {
                            Value::Number(n) => {
                                n.as_f64().ok_or_else(|| "number out of range".to_string())
                            }
                            Value::String(s) => {
                                special_float(s).ok_or_else(|| format!("'{s}' is not a number"))
                            }
                            _ => Err("lists must hold numbers only".to_string()),
                        })
                        .collect::<std::result::Result<_, _>>()?,
                )
            }
        }
        Value::Null | Value::Object(_) => {
            return Err("must be a boolean, number, string or list of numbers".into())
        }
    })
}

// ---------------------------------------------------------------- JSON writing

fn attr_to_json(v: &AttrValue) -> Value {
    let float = |f: f64| {
        if f.is_finite() {
            Value::from(f)
        } else if f.is_nan() {
            Value::from("nan")
        } else if f > 0.0 {
            Value::from("inf")
        } else {
            Value::from("-inf")
        }
    };
    match v {
        AttrValue::Bool(b) => Value::from(*b),
        AttrValue::Int(i) => Value::from(*i),
        AttrValue::Float(f) => float(*f),
        AttrValue::Str(s) => Value::from(s.as_str()),
        AttrValue::Ints(v) => Value::from(v.clone()),
        AttrValue::Floats(v) => Value::Array(v.iter().map(|&f| float(f)).collect()),
    }
}

/// Writes the JSON interchange format, one node per line.
pub fn to_json(def: &GraphDef) -> String {
    let s = |v: &str| Value::from(v).to_string();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{{\n  \"format\": {},\n  \"version\": {FORMAT_VERSION},\n  \"nodes\": [",
        s(FORMAT_NAME)
    );
    for (i, n) in def.nodes.iter().enumerate() {
        let _ = write!(out, "    {{\"name\": {}, \"op\": {}", s(&n.name), s(&n.op));
        if !n.inputs.is_empty() {
            let _ = write!(out, ", \"inputs\": {}", Value::from(n.inputs.clone()));
        }
        if !n.attrs.is_empty() || n.values.is_some() {
            let value =
                (n.values.as_ref()).map(|v| ("value".to_string(), AttrValue::Floats(v.to_f64())));
            let attrs: serde_json::Map<String, Value> = (n.attrs.iter())
                .map(|(k, v)| (k.clone(), attr_to_json(v)))
                .chain(value.iter().map(|(k, v)| (k.clone(), attr_to_json(v))))
                .collect();
            let _ = write!(out, ", \"attrs\": {}", Value::Object(attrs));
        }
        if let Some(d) = n.dtype {
            let _ = write!(out, ", \"dtype\": {}", s(d.as_str()));
        }
        out.push('}');
        out.push_str(if i + 1 < def.nodes.len() { ",\n" } else { "\n" });
    }
    let _ = write!(
        out,
        "  ],\n  \"outputs\": {}",
        Value::from(def.outputs.clone())
    );
    if let Some(d) = def.mixed_precision {
        let _ = write!(out, ",\n  \"{MIXED_PRECISION_KEY}\": {}", s(d.as_str()));
    }
    out.push_str("\n}\n");
    out
}

// ---------------------------------------------------------------- binary

fn bin_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<BIN_LIMIT>()
}

/// The part of a binary file before the constants' bytes: the graph, and for each
/// node whose values follow (in this order, back to back) its index and byte count.
#[derive(Serialize, Deserialize)]
struct BinHeader {
    def: GraphDef,
    values: Vec<(u64, u64)>,
}

/// The binary form (version [`BIN_VERSION`]): the magic, the version, the header's
/// length (u64 little-endian), the header (bincode), then the constants' values as
/// their little-endian bytes.
pub fn to_bin(def: &GraphDef) -> Result<Vec<u8>> {
    // Each stored node's index, values and their byte count.
    let stored: Vec<(usize, &Data, usize)> = (def.nodes.iter().enumerate())
        .filter_map(|(i, n)| n.values.as_deref().map(|v| (i, v)))
        .map(|(i, v)| (i, v, v.len() * v.dtype().size_bytes()))
        .collect();
    let header = BinHeader {
        def: def.clone(),
        values: (stored.iter())
            .map(|&(i, _, bytes)| (i as u64, bytes as u64))
            .collect(),
    };
    let header = bincode::serde::encode_to_vec(&header, bin_config())
        .map_err(|e| format_err(format!("cannot encode the graph: {e}")))?;
    let value_bytes: usize = stored.iter().map(|&(_, _, bytes)| bytes).sum();
    let mut out = Vec::with_capacity(BIN_MAGIC.len() + 12 + header.len() + value_bytes);
    out.extend_from_slice(BIN_MAGIC);
    out.extend_from_slice(&BIN_VERSION.to_le_bytes());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    for (_, v, _) in stored {
        out.extend_from_slice(&v.le_bytes());
    }
    Ok(out)
}

/// What a bincode decoding error means for a reader of the file (bincode's own text
/// is its enum's debug form: `UnexpectedEnd { additional: 5 }`).
pub fn describe_decode_error(e: &bincode::error::DecodeError) -> String {
    use bincode::error::DecodeError as E;
    match e {
        E::UnexpectedEnd { additional } => {
            format!("the data ends {additional} byte(s) before its last value")
        }
        E::LimitExceeded => "a length exceeds what the file can hold".into(),
        E::Utf8 { .. } | E::InvalidCharEncoding(_) => "a name is not valid UTF-8".into(),
        E::OutsideUsizeRange(n) => format!("a length of {n} exceeds this machine's addresses"),
        E::UnexpectedVariant { found, .. } => format!("an unknown tag {found}"),
        E::InvalidBooleanValue(b) => format!("{b} where a boolean (0 or 1) belongs"),
        _ => "a value of the wrong kind".into(),
    }
}

pub fn is_bin(bytes: &[u8]) -> bool {
    bytes.starts_with(BIN_MAGIC)
}

/// Decodes a binary graph (version 1 or [`BIN_VERSION`]); hostile bytes give an
/// error, never a panic or an allocation beyond the graph's bound and the file's
/// size.
pub fn from_bin(bytes: &[u8]) -> Result<GraphDef> {
    let rest = bytes
        .strip_prefix(BIN_MAGIC.as_slice())
        .ok_or_else(|| format_err("not an ampgraph binary graph (bad magic)"))?;
    let (version, body) = split_le::<4>(rest, "truncated binary graph header")?;
    match u32::from_le_bytes(version) {
        1 => decode_all::<GraphDef>(body),
        BIN_VERSION => {
            let (length, rest) = split_le::<8>(body, "truncated binary graph header")?;
            let (header, mut values) = usize::try_from(u64::from_le_bytes(length))
                .ok()
                .and_then(|n| rest.split_at_checked(n))
                .ok_or_else(|| {
                    format_err("corrupt binary graph: its header runs past the file's end")
                })?;
            let BinHeader {
                mut def,
                values: stored,
            } = decode_all(header)?;
            for (node, length) in stored {
                let corrupt = |why: String| format_err(format!("corrupt binary graph: {why}"));
                let n = (usize::try_from(node).ok())
                    .and_then(|i| def.nodes.get_mut(i))
                    .ok_or_else(|| {
                        corrupt(format!("values stored for node {node}, which it has not"))
                    })?;
                let dtype = (n.attrs.get("dtype"))
                    .and_then(|d| match d {
                        AttrValue::Str(s) => s.parse::<DType>().ok(),
                        _ => None,
                    })
                    .ok_or_else(|| {
                        corrupt(format!(
                            "values stored for node '{}', which has no dtype",
                            n.name
                        ))
                    })?;
                let (these, rest) = (usize::try_from(length).ok())
                    .and_then(|k| values.split_at_checked(k))
                    .ok_or_else(|| {
                        corrupt(format!(
                            "node '{}''s values run past the file's end",
                            n.name
                        ))
                    })?;
                if n.values.is_some() {
                    return Err(corrupt(format!(
                        "node '{}''s values are stored twice",
                        n.name
                    )));
                }
                let data = Data::from_le_bytes(dtype, these)
                    .map_err(|e| corrupt(format!("node '{}': {e}", n.name)))?;
                n.values = Some(Arc::new(data));
                values = rest;
            }
            if !values.is_empty() {
                return Err(format_err("corrupt binary graph: trailing bytes"));
            }
            Ok(def)
        }
        v => Err(format_err(format!(
            "unsupported binary version {v} (this ampgraph reads versions 1 and {BIN_VERSION})"
        ))),
    }
}

/// The first `N` bytes of `bytes` and the rest, or `why`.
fn split_le<'a, const N: usize>(bytes: &'a [u8], why: &str) -> Result<([u8; N], &'a [u8])> {
    let (head, rest) = bytes.split_at_checked(N).ok_or_else(|| format_err(why))?;
    let head = head.try_into().map_err(|_| format_err(why))?;
    Ok((head, rest))
}

/// `bytes` decoded as one `T` (bincode, within [`BIN_LIMIT`]), nothing left over.
fn decode_all<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let (value, used): (T, usize) = bincode::serde::decode_from_slice(bytes, bin_config())
        .map_err(|e| {
            format_err(format!(
                "corrupt binary graph: {}",
                describe_decode_error(&e)
            ))
        })?;
    if used != bytes.len() {
        return Err(format_err("corrupt binary graph: trailing bytes"));
    }
    Ok(value)
}

// ---------------------------------------------------------------- files

/// Reads a graph from JSON or binary bytes (told apart by the magic header).
pub fn graph_from_bytes(bytes: &[u8]) -> Result<Graph> {
    let def = if is_bin(bytes) {
        from_bin(bytes)?
    } else {
        parse_json(bytes)?
    };
    def.to_graph()
}

/// Loads a `.json` or `.bin` graph file; `-` reads JSON from standard input.
pub fn load(path: &str) -> Result<Graph> {
    let shown = if path == "-" { "<stdin>" } else { path };
    let bytes = if path == "-" {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf).map_err(|source| {
            GraphError::Io {
                path: "<stdin>".into(),
                source,
            }
        })?;
        buf
    } else {
        std::fs::read(path).map_err(|source| GraphError::Io {
            path: path.into(),
            source,
        })?
    };
    let parsed = match path.ends_with(".bin") && !is_bin(&bytes) {
        true => Err(GraphError::Format(
            "not an ampgraph binary graph: it does not begin with the format's header".into(),
        )),
        false => graph_from_bytes(&bytes),
    };
    parsed.map_err(|e| GraphError::InFile {
        path: shown.into(),
        source: Box::new(e),
    })
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, flushed to disk
/// (`sync_all`), then a rename over `path`, then (on Unix) an fsync of the directory
/// so that the rename itself survives a crash. On any error the temporary is removed
/// and `path` is left as it was; temporaries of earlier writes whose process was
/// killed are removed by the next write of the same file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, bytes, false)
}

/// [`write_atomic`], and where `path` already exists its previous contents are kept
/// as `PATH.prev` (replaced atomically too) before the new file takes its place, so
/// that one bad write never destroys the last good file.
pub fn write_atomic_keeping_previous(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, bytes, true)
}

/// `path` with `suffix` appended to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The file that [`write_atomic_keeping_previous`] keeps the previous contents of
/// `path` in: `PATH.prev`.
pub fn previous_path(path: &Path) -> PathBuf {
    with_suffix(path, ".prev")
}

fn write_atomic_with(path: &Path, bytes: &[u8], keep_previous: bool) -> Result<()> {
    let io = |source| GraphError::Io {
        path: path.display().to_string(),
        source,
    };
    // One temporary per write: two threads of a process writing the same file at
    // once (executors keeping cuDNN's algorithms) each rename a whole file of their
    // own, never one the other truncated under it.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let unique = format!("{TEMPORARY}{}.{n}", std::process::id());
    remove_stale_temporaries(path);
    let tmp = with_suffix(path, &unique);
    let prev = previous_path(path);
    let prev_tmp = with_suffix(&prev, &unique);
    let result = (|| -> std::io::Result<()> {
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        if keep_previous && path.exists() {
            // A link (else a copy) of the current file, renamed over PATH.prev: PATH
            // itself is never missing, and PATH.prev is always whole.
            let _ = std::fs::remove_file(&prev_tmp);
            if std::fs::hard_link(path, &prev_tmp).is_err() {
                std::fs::copy(path, &prev_tmp)?;
                std::fs::File::open(&prev_tmp)?.sync_all()?;
            }
            std::fs::rename(&prev_tmp, &prev)?;
        }
        std::fs::rename(&tmp, path)?;
        sync_parent(path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        if keep_previous {
            let _ = std::fs::remove_file(&prev_tmp);
        }
        io(e)
    })
}

/// What a write's temporary appends to the file's name, before `<pid>.<n>`.
const TEMPORARY: &str = ".tmp";

/// Removes the temporaries of earlier writes of `path` (and of its `.prev`) whose
/// process is gone (killed between creating and renaming them): `PATH.tmp<pid>.<n>`
/// where no process `<pid>` runs. Only where the OS lists its processes (`/proc`).
fn remove_stale_temporaries(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let stale_pid = |file: &str| -> Option<u32> {
        let rest = file.strip_prefix(name)?;
        let rest = rest.strip_prefix(".prev").unwrap_or(rest);
        let (pid, n) = rest.strip_prefix(TEMPORARY)?.split_once('.')?;
        n.parse::<u64>().ok()?;
        pid.parse().ok()
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(stale_pid) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Flushes the directory holding `path` (its entries: a rename), where the platform
/// can open a directory for that (Unix).
fn sync_parent(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::File::open(parent)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

// ---------------------------------------------------------------- dumps

/// One line per node: `name = Op(inputs) {attrs} -> types`.
pub fn to_text(g: &Graph) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "graph: {} nodes", g.len());
    for id in g.topo_order().unwrap_or_else(|_| g.node_ids().collect()) {
        let n = g.node(id);
        let inputs: Vec<String> = g.inputs(id).into_iter().map(|p| g.port_name(p)).collect();
        let attrs: Vec<String> = (attrs_but_values(n.op.as_ref()).iter())
            .map(|(k, v)| format!("{k}={}", attr_to_json(v)))
            .collect();
        let types: Vec<String> = n.outputs().iter().map(ToString::to_string).collect();
        let _ = write!(out, "{} = {}({})", n.name, n.op.name(), inputs.join(", "));
        if !attrs.is_empty() {
            let _ = write!(out, " {{{}}}", attrs.join(", "));
        }
        let _ = writeln!(out, " -> {}", types.join(", "));
    }
    let outs: Vec<String> = g.outputs().iter().map(|&p| g.port_name(p)).collect();
    let _ = writeln!(out, "outputs: {}", outs.join(", "));
    out
}

/// Fill colour of a node in DOT dumps: by the precision of its output.
pub fn default_color(g: &Graph, id: NodeId) -> &'static str {
    let n = g.node(id);
    if n.op.name() == "Cast" {
        return "#ffe08a";
    }
    match n.outputs().first().map(|t| t.dtype) {
        Some(DType::F16) | Some(DType::BF16) => "#9be39b",
        Some(DType::F32) => "#cfe2ff",
        _ => "#eeeeee",
    }
}

/// Graphviz DOT with one box per node, edges labelled with their tensor types and
/// nodes filled by `color` (see [`default_color`]). A fused node sits in a dashed
/// cluster labelled with the nodes it replaced.
pub fn to_dot(g: &Graph, color: &dyn Fn(&Graph, NodeId) -> &'static str) -> String {
    let q = |s: &str| Value::from(s).to_string();
    let mut out = String::from("digraph ampgraph {\n  rankdir=TB;\n  node [shape=box, style=filled, fontname=\"Helvetica\"];\n");
    let mut clusters = 0;
    for id in g.node_ids() {
        let n = g.node(id);
        let ty = n
            .outputs()
            .first()
            .map(ToString::to_string)
            .unwrap_or_default();
        let label = format!("{}\\n{}\\n{}", n.name, n.op.name(), ty);
        let node_line = format!(
            "{} [label=\"{}\", fillcolor=\"{}\"];",
            q(&n.name),
            label.replace('"', "'"),
            color(g, id)
        );
        match n.annotations.get(MEMBERS_ANNOTATION) {
            Some(AttrValue::Str(members)) => {
                let title = format!("fused: {}", members.replace(',', ", "));
                let _ = writeln!(
                    out,
                    "  subgraph cluster_{clusters} {{\n    label={};\n    style=\"dashed,rounded\";\n    {node_line}\n  }}",
                    q(&title)
                );
                clusters += 1;
            }
            _ => {
                let _ = writeln!(out, "  {node_line}");
            }
        }
    }
    for id in g.node_ids() {
        for (slot, p) in g.inputs(id).into_iter().enumerate() {
            let _ = writeln!(
                out,
                "  {} -> {} [label=\"{}:{slot} {}\"];",
                q(&g.node(p.node).name),
                q(&g.node(id).name),
                p.index,
                g.ty(p)
            );
        }
    }
    out.push_str("}\n");
    out
}
