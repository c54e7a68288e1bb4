//! ONNX -> [`Graph`]: initializers become constants, graph inputs placeholders, and
//! every node one or a few of our ops (`ops.rs`, one converter per ONNX op).
//!
//! Our graphs are statically shaped, so import runs with every input's shape known
//! (from the model or [`ImportOptions::input_shapes`]). A node whose inputs are all
//! constants is computed here, with our own CPU kernels: the shape arithmetic that
//! exporters write (`Shape -> Gather -> Concat -> Reshape`) folds to constants, and an
//! op that needs a constant input (a Reshape's shape, a Slice's bounds) gets one.

mod einsum;
mod ops;
mod rnn;
mod schema;
mod schemas;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use ampgraph_graph::host_memory;
use ampgraph_graph::ops::{Const, Placeholder};
use ampgraph_graph::{Graph, Op, Port, Tensor, TensorType};
use ampgraph_passes::bias_before_reshape::BiasBeforeReshape;
use ampgraph_passes::recognize_gelu::RecognizeGelu;
use ampgraph_passes::recognize_layer_norm::RecognizeLayerNorm;
use ampgraph_passes::simplify::TransposeIntoMatmul;
use ampgraph_passes::Pass;
use prost::Message;

use crate::error::{OnnxError, Result};
use crate::proto::{
    attribute_type, AttributeProto, GraphProto, ModelProto, NodeProto, ValueInfoProto,
};
use crate::tensor;

/// The oldest default-domain opset the converters follow.
pub const MIN_OPSET: i64 = 11;

/// The newest default-domain opset the converters follow (each op's changes up to it
/// are read; a newer model may mean something they do not know).
pub const MAX_OPSET: i64 = 23;

/// How to import a model.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Shapes of graph inputs by name: required for inputs whose dims are symbolic
    /// (`batch`), and they override the model's own dims.
    pub input_shapes: BTreeMap<String, Vec<usize>>,
    /// Import the ops as the file writes them: without this, the patterns exporters
    /// write out op by op are imported as the ops they are (a GELU's Erf or Tanh, Pow
    /// and products as one Gelu: one kernel, and f16 to AMP, where `Pow` is denied),
    /// and a Linear layer's bias on a 3-D input is added next to its product (before
    /// the Reshape back), where the GEMM's epilogue and AMP's infer rule take it.
    pub as_written: bool,
}

/// Reads an ONNX model file (external data files are found beside it).
pub fn import_file(path: &Path, opts: &ImportOptions) -> Result<Graph> {
    import_model(&read_model(path)?, model_folder(path), opts)
}

/// Reads and decodes a model file.
pub(crate) fn read_model(path: &Path) -> Result<ModelProto> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| OnnxError::Io {
        path: shown.clone(),
        source,
    })?;
    decode_nonempty(&bytes, &shown)
}

/// The folder a model's external data is read from.
pub(crate) fn model_folder(path: &Path) -> Option<&Path> {
    path.parent().map(|p| {
        if p.as_os_str().is_empty() {
            Path::new(".")
        } else {
            p
        }
    })
}

/// Decodes a serialized model; `shown` names it in errors, `base` is the folder
/// external data is read from.
pub fn decode_model(bytes: &[u8], shown: &str) -> Result<ModelProto> {
    ModelProto::decode(bytes).map_err(|e| OnnxError::Decode {
        path: shown.into(),
        msg: e.to_string(),
    })
}

/// Imports a serialized model.
pub fn import_bytes(
    bytes: &[u8],
    shown: &str,
    base: Option<&Path>,
    opts: &ImportOptions,
) -> Result<Graph> {
    import_model(&decode_nonempty(bytes, shown)?, base, opts)
}

/// [`decode_model`], refusing an empty file (which decodes as an empty model).
fn decode_nonempty(bytes: &[u8], shown: &str) -> Result<ModelProto> {
    if bytes.is_empty() {
        return Err(OnnxError::Decode {
            path: shown.into(),
            msg: "the file is empty".into(),
        });
    }
    decode_model(bytes, shown)
}

/// Imports a decoded model.
pub fn import_model(
    model: &ModelProto,
    base: Option<&Path>,
    opts: &ImportOptions,
) -> Result<Graph> {
    let opset = default_opset(model)?;
    let graph = model
        .graph
        .as_ref()
        .ok_or_else(|| OnnxError::Model("the model has no graph".into()))?;
    check_nodes(model, graph)?;
    let order = topological_order(graph, &HashSet::new())?;
    let mut imp = Importer::new(opset, graph, base);
    imp.add_initializers(graph)?;
    if !graph.sparse_initializer.is_empty() {
        return Err(OnnxError::Model(
            "sparse initializers are not supported".into(),
        ));
    }
    imp.add_inputs(graph, opts)?;
    for i in order {
        imp.convert(&graph.node[i])?;
    }
    imp.check_value_info(graph)?;
    let mut g = imp.finish(graph)?;
    if !opts.as_written {
        for pass in [
            &RecognizeGelu as &dyn Pass,
            &RecognizeLayerNorm,
            &BiasBeforeReshape,
            &TransposeIntoMatmul,
        ] {
            (pass.run(&mut g))
                .map_err(|e| OnnxError::Model(format!("pass {}: {e}", pass.name())))?;
        }
    }
    Ok(g)
}

/// The default domain's opset version; other domains' nodes are refused by
/// `check_nodes`.
fn default_opset(model: &ModelProto) -> Result<i64> {
    let version = model
        .opset_import
        .iter()
        .find(|o| is_default_domain(&o.domain))
        .map(|o| o.version)
        .ok_or_else(|| {
            OnnxError::Model("the model imports no version of the default ONNX opset".into())
        })?;
    if version > MAX_OPSET {
        return Err(OnnxError::Model(format!(
            "opset {version} is newer than {MAX_OPSET}, the newest ampgraph reads: export the \
             model at opset {MAX_OPSET} or older"
        )));
    }
    if version < MIN_OPSET {
        return Err(OnnxError::Model(format!(
            "opset {version} is older than {MIN_OPSET}, the oldest ampgraph reads: \
             upgrade the model with onnx.version_converter.convert_version(model, 17)"
        )));
    }
    Ok(version)
}

fn is_default_domain(domain: &str) -> bool {
    domain.is_empty() || domain == "ai.onnx"
}

/// Refuses nodes of other domains and control flow other than If (naming the first),
/// then lists every op without a converter with its count (in If's branches too), so
/// one run shows all that is missing.
fn check_nodes(model: &ModelProto, graph: &GraphProto) -> Result<()> {
    let functions: HashSet<(&str, &str)> = model
        .functions
        .iter()
        .map(|f| (f.domain.as_str(), f.name.as_str()))
        .collect();
    let mut missing: BTreeMap<String, usize> = BTreeMap::new();
    check_graph_nodes(graph, &functions, &mut missing)?;
    if missing.is_empty() {
        Ok(())
    } else {
        Err(OnnxError::Unsupported(missing.into_iter().collect()))
    }
}

/// [`check_nodes`] over one graph or branch, counting ops without a converter.
fn check_graph_nodes(
    graph: &GraphProto,
    functions: &HashSet<(&str, &str)>,
    missing: &mut BTreeMap<String, usize>,
) -> Result<()> {
    for node in &graph.node {
        if !is_default_domain(&node.domain) {
            let what = if functions.contains(&(node.domain.as_str(), node.op_type.as_str())) {
                "a model-local function"
            } else {
                "an op"
            };
            return Err(OnnxError::node(
                &node_name(node),
                &node.op_type,
                format!(
                    "{what} of domain '{}', which ampgraph does not read (only the default ONNX domain)",
                    node.domain
                ),
            ));
        }
        for a in node.attribute.iter().filter(|a| a.g.is_some()) {
            match (node.op_type.as_str(), &a.g) {
                ("If", Some(branch)) => check_graph_nodes(branch, functions, missing)?,
                _ => {
                    return Err(OnnxError::node(
                        &node_name(node),
                        &node.op_type,
                        format!(
                            "attribute '{}' is a subgraph: control flow other than If (with a \
                             condition computed at import) is not supported",
                            a.name
                        ),
                    ))
                }
            }
        }
        if node.op_type != "If" && ops::converter(&node.op_type).is_none() {
            *missing.entry(node.op_type.clone()).or_default() += 1;
        }
    }
    Ok(())
}

/// The values a node reads: its inputs and, for an If, what its branches read from
/// the scope around them.
fn reads(node: &NodeProto) -> impl Iterator<Item = &str> {
    let inputs = node
        .input
        .iter()
        .filter(|i| !i.is_empty())
        .map(String::as_str);
    let branches = node.attribute.iter().filter_map(|a| a.g.as_ref());
    inputs.chain(branches.flat_map(outer_reads))
}

/// The names `graph`'s nodes (and their branches) read that it does not define, each
/// once, in the order first read.
fn outer_reads(graph: &GraphProto) -> Vec<&str> {
    let defined: HashSet<&str> = (graph.node.iter())
        .flat_map(|n| n.output.iter().map(String::as_str))
        .chain(graph.initializer.iter().map(|t| t.name.as_str()))
        .chain(graph.input.iter().map(|i| i.name.as_str()))
        .collect();
    let mut seen = HashSet::new();
    (graph.node.iter().flat_map(reads))
        .filter(|name| !defined.contains(name) && seen.insert(*name))
        .collect()
}

/// A node's name for messages and for the node that computes its result: its own,
/// or its first output's when it has none.
fn node_name(node: &NodeProto) -> String {
    if !node.name.is_empty() {
        node.name.clone()
    } else {
        node.output
            .first()
            .cloned()
            .unwrap_or_else(|| node.op_type.clone())
    }
}

/// The nodes in an order where each comes after those it reads (ONNX requires the
/// file's order to be one, but not every writer keeps to it). A value nothing
/// produces and a cycle are errors naming the node.
fn topological_order(graph: &GraphProto, outer: &HashSet<&str>) -> Result<Vec<usize>> {
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        for out in node.output.iter().filter(|o| !o.is_empty()) {
            if producer.insert(out.as_str(), i).is_some() {
                return Err(OnnxError::node(
                    &node_name(node),
                    &node.op_type,
                    format!("output '{out}' is produced by another node too"),
                ));
            }
        }
    }
    let sources: HashSet<&str> = graph
        .input
        .iter()
        .map(|v| v.name.as_str())
        .chain(graph.initializer.iter().map(|t| t.name.as_str()))
        .chain(outer.iter().copied())
        .collect();
    let mut deps: Vec<Vec<usize>> = Vec::with_capacity(graph.node.len());
    for node in &graph.node {
        let mut d = Vec::new();
        for input in reads(node) {
            match producer.get(input) {
                Some(&p) => d.push(p),
                None if sources.contains(input) => {}
                None => {
                    return Err(OnnxError::node(
                        &node_name(node),
                        &node.op_type,
                        format!(
                            "input '{input}' is produced by no node, graph input or initializer"
                        ),
                    ))
                }
            }
        }
        deps.push(d);
    }
    for out in &graph.output {
        if !producer.contains_key(out.name.as_str()) && !sources.contains(out.name.as_str()) {
            return Err(OnnxError::Model(format!(
                "graph output '{}' is produced by no node, graph input or initializer",
                out.name
            )));
        }
    }
    // Depth-first, iteratively (deep chains must not overflow the stack).
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    let mut mark = vec![Mark::New; graph.node.len()];
    let mut order = Vec::with_capacity(graph.node.len());
    for root in 0..graph.node.len() {
        if mark[root] != Mark::New {
            continue;
        }
        let mut stack = vec![(root, 0usize)];
        mark[root] = Mark::Open;
        while let Some(&mut (n, ref mut next)) = stack.last_mut() {
            if let Some(&d) = deps[n].get(*next) {
                *next += 1;
                match mark[d] {
                    Mark::New => {
                        mark[d] = Mark::Open;
                        stack.push((d, 0));
                    }
                    Mark::Open => {
                        let node = &graph.node[d];
                        let at = stack.iter().position(|&(s, _)| s == d).unwrap_or(0);
                        let cycle: Vec<String> = stack[at..]
                            .iter()
                            .map(|&(s, _)| node_name(&graph.node[s]))
                            .chain([node_name(node)])
                            .collect();
                        return Err(OnnxError::node(
                            &node_name(node),
                            &node.op_type,
                            format!("the graph has a cycle: {}", cycle.join(" -> ")),
                        ));
                    }
                    Mark::Done => {}
                }
            } else {
                mark[n] = Mark::Done;
                order.push(n);
                stack.pop();
            }
        }
    }
    Ok(order)
}

/// A constant's identity: its data's address and its shape (a reshaped constant
/// shares its data).
type ConstKey = (usize, Vec<usize>);

fn const_key(t: &Tensor) -> ConstKey {
    (t.data() as *const _ as usize, t.shape().to_vec())
}

/// What an ONNX value is during import: a constant known now, or a port of the graph.
#[derive(Clone, Debug)]
pub(crate) enum Value {
    Const(Tensor),
    Port(Port),
}

struct Importer {
    g: Graph,
    opset: i64,
    values: HashMap<String, Value>,
    /// Constants already added to the graph, by their data's address and shape: only
    /// those `values` holds, whose addresses no other tensor can take while it does.
    placed: HashMap<ConstKey, Port>,
    /// The keys of the constants in `values`.
    held: HashSet<ConstKey>,
    /// The initializers' names, which their Const nodes take.
    initializer_names: HashMap<ConstKey, String>,
    /// Names for constants computed from an initializer while one node converts
    /// (`w/hwio` for a filter in our layout); cleared after each node.
    derived_names: HashMap<ConstKey, String>,
    /// The graph's output names: the nodes computing them take these names.
    outputs: HashSet<String>,
    /// The folder external data is read from.
    base: Option<PathBuf>,
    /// The bytes the process could still allocate when import first computed a
    /// constant ([`NodeCx::admit`]): read once, not per constant.
    available: std::cell::OnceCell<usize>,
    /// Whether every graph input has the shape the file declares (no `--input` shape
    /// changed a dim): then every declared dim must be what import computes.
    inputs_as_declared: bool,
}

impl Importer {
    fn new(opset: i64, graph: &GraphProto, base: Option<&Path>) -> Self {
        Importer {
            g: Graph::new(),
            opset,
            values: HashMap::new(),
            placed: HashMap::new(),
            held: HashSet::new(),
            initializer_names: HashMap::new(),
            derived_names: HashMap::new(),
            outputs: graph.output.iter().map(|o| o.name.clone()).collect(),
            base: base.map(Path::to_path_buf),
            available: std::cell::OnceCell::new(),
            inputs_as_declared: true,
        }
    }

    /// The initializers of `graph` (or of an If's branch), as constants.
    fn add_initializers(&mut self, graph: &GraphProto) -> Result<()> {
        for init in &graph.initializer {
            if self.values.contains_key(&init.name) {
                return Err(OnnxError::tensor(
                    &init.name,
                    "is defined twice (an initializer of the same name is already in scope)",
                ));
            }
            let t = tensor::decode(init, self.base.as_deref())?;
            self.initializer_names
                .insert(const_key(&t), init.name.clone());
            self.held.insert(const_key(&t));
            self.values.insert(init.name.clone(), Value::Const(t));
        }
        Ok(())
    }

    /// An If whose condition is known at import (computed from constants and input
    /// shapes, as exporters write checks of sizes): the branch it takes, imported in
    /// its place. A condition computed at run time is refused.
    fn convert_if(&mut self, node: &NodeProto) -> Result<()> {
        let name = node_name(node);
        let err = |msg: String| OnnxError::node(&name, "If", msg);
        let cond = match node.input.first().and_then(|i| self.values.get(i)) {
            Some(Value::Const(t)) => match t.to_f64_vec().as_slice() {
                [c] => *c != 0.0,
                _ => {
                    return Err(err(format!(
                        "its condition holds {} values, not one",
                        t.len()
                    )))
                }
            },
            Some(Value::Port(_)) => {
                return Err(err(format!(
                    "its condition '{}' is computed at run time: control flow that depends on \
                     the data is not supported (only conditions computed at import, from \
                     constants and input shapes)",
                    node.input[0]
                )))
            }
            None => return Err(err("its condition is missing".into())),
        };
        let taken = if cond { "then_branch" } else { "else_branch" };
        let branch = (node.attribute.iter())
            .find(|a| a.name == taken)
            .and_then(|a| a.g.as_ref())
            .ok_or_else(|| err(format!("it has no {taken}")))?;
        if branch.output.len() != node.output.len() {
            return Err(err(format!(
                "its {taken} has {} outputs but the node {}",
                branch.output.len(),
                node.output.len()
            )));
        }
        self.add_initializers(branch)?;
        let order = topological_order(branch, &self.values.keys().map(String::as_str).collect())?;
        for i in order {
            self.convert(&branch.node[i])?;
        }
        for (out, from) in node.output.iter().zip(&branch.output) {
            let value = (self.values.get(&from.name).cloned())
                .ok_or_else(|| err(format!("its {taken} does not compute '{}'", from.name)))?;
            if !out.is_empty() {
                self.values.insert(out.clone(), value);
            }
        }
        Ok(())
    }

    /// Placeholders for the graph inputs that are not initializers (old exporters
    /// list initializers as inputs too: they stay constants).
    fn add_inputs(&mut self, graph: &GraphProto, opts: &ImportOptions) -> Result<()> {
        let names: HashSet<&str> = graph.input.iter().map(|i| i.name.as_str()).collect();
        if let Some(name) = opts
            .input_shapes
            .keys()
            .find(|n| !names.contains(n.as_str()))
        {
            return Err(OnnxError::Model(format!(
                "--input names '{name}', which is not an input of the model (its inputs: {})",
                graph
                    .input
                    .iter()
                    .map(|i| i.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        for input in &graph.input {
            if self.values.contains_key(&input.name) {
                continue;
            }
            let err = |msg: String| OnnxError::Model(format!("input '{}': {msg}", input.name));
            let tt = input
                .r#type
                .as_ref()
                .and_then(|t| t.tensor_type.as_ref())
                .ok_or_else(|| err("not a tensor".into()))?;
            let dtype = tensor::dtype_of(tt.elem_type).map_err(err)?;
            let declared = static_shape(tt.shape.as_ref());
            let shape = match opts.input_shapes.get(&input.name) {
                Some(s) => {
                    self.inputs_as_declared &= declared.as_ref() == Ok(s);
                    s.clone()
                }
                None => declared.map_err(|m| {
                    err(format!(
                        "{m}: give its shape with --input {}=DxDx... (e.g. 1x3x224x224)",
                        input.name
                    ))
                })?,
            };
            let ty = TensorType::new(dtype, shape);
            let id = self
                .g
                .add_node(input.name.clone(), Box::new(Placeholder(ty)), &[])?;
            self.values
                .insert(input.name.clone(), Value::Port(id.into()));
        }
        Ok(())
    }

    fn convert(&mut self, node: &NodeProto) -> Result<()> {
        let node_err = |msg: String| OnnxError::node(&node_name(node), &node.op_type, msg);
        let convert = ops::converter(&node.op_type);
        if convert.is_none() && node.op_type != "If" {
            return Err(OnnxError::Unsupported(vec![(node.op_type.clone(), 1)]));
        }
        let version = schema::lookup(&node.op_type, self.opset)
            .ok_or_else(|| node_err(format!("is not an op of opset {}", self.opset)))?;
        schema::check_node(node, version, self.opset).map_err(node_err)?;
        let Some(convert) = convert else {
            return self.convert_if(node);
        };
        let mut cx = NodeCx {
            imp: self,
            node,
            name: node_name(node),
            read: RefCell::default(),
        };
        let results = convert(&mut cx);
        let read = cx.read.take();
        self.derived_names.clear();
        let results = results?;
        schema::check_unread(node, version, &read).map_err(node_err)?;
        for (k, out) in node.output.iter().enumerate() {
            if out.is_empty() {
                continue;
            }
            match results.get(k) {
                Some(v) => {
                    if let Value::Const(t) = v {
                        self.held.insert(const_key(t));
                    }
                    self.values.insert(out.clone(), v.clone());
                }
                None => {
                    return Err(OnnxError::node(
                        &node_name(node),
                        &node.op_type,
                        format!("output {k} ('{out}') is not supported"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// The graph's outputs, each computed by a node of its name (an Identity where the
    /// value is another output's, an input, or a constant).
    fn finish(mut self, graph: &GraphProto) -> Result<Graph> {
        let mut outs = Vec::with_capacity(graph.output.len());
        for o in &graph.output {
            let value = self.values.get(&o.name).cloned().ok_or_else(|| {
                OnnxError::Model(format!("graph output '{}' was not computed", o.name))
            })?;
            self.check_declared("graph output", o, &value)?;
            let port = match value {
                Value::Port(p) if p.index == 0 && self.g.node(p.node).name == o.name => p,
                Value::Port(p) => self.identity(&o.name, p)?,
                Value::Const(t) => {
                    let name = self.g.fresh_name(o.name.clone());
                    self.g.add_node(name, Box::new(Const::new(t)), &[])?.into()
                }
            };
            outs.push(port);
        }
        self.g.set_outputs(outs)?;
        Ok(self.g)
    }

    /// The model's declarations of the values import computed (`value_info`, where
    /// exporters write what shape inference found).
    fn check_value_info(&self, graph: &GraphProto) -> Result<()> {
        for vi in &graph.value_info {
            if let Some(value) = self.values.get(&vi.name) {
                self.check_declared("value", vi, value)?;
            }
        }
        Ok(())
    }

    /// A value declared with another element type, rank or dim than import computes
    /// means the model was read wrong (or declares what it does not compute): refused
    /// naming the value. Dims are compared only while every input has its declared
    /// shape (an `--input` shape changes the dims that follow from it); symbolic and
    /// unknown dims match any.
    fn check_declared(&self, what: &str, declared: &ValueInfoProto, value: &Value) -> Result<()> {
        use crate::proto::DimensionValue;
        let Some(tt) = (declared.r#type.as_ref()).and_then(|t| t.tensor_type.as_ref()) else {
            return Ok(());
        };
        let err = |msg: String| OnnxError::Model(format!("{what} '{}' {msg}", declared.name));
        let computed = match value {
            Value::Port(p) => self.g.ty(*p).clone(),
            Value::Const(t) => t.ty(),
        };
        if tt.elem_type != 0 {
            let want = tensor::dtype_of(tt.elem_type).map_err(|m| err(format!(": {m}")))?;
            if want != computed.dtype {
                return Err(err(format!(
                    "is declared {want} but computes {}",
                    computed.dtype
                )));
            }
        }
        let Some(shape) = &tt.shape else {
            return Ok(());
        };
        let text = || {
            let dims: Vec<String> = (shape.dim.iter())
                .map(|d| match &d.value {
                    Some(DimensionValue::DimValue(v)) => v.to_string(),
                    Some(DimensionValue::DimParam(p)) => p.clone(),
                    None => "?".into(),
                })
                .collect();
            format!("[{}]", dims.join(", "))
        };
        let mismatch = shape.dim.len() != computed.rank()
            || (self.inputs_as_declared
                && shape.dim.iter().zip(&computed.shape).any(
                    |(d, &c)| matches!(d.value, Some(DimensionValue::DimValue(v)) if v != c as i64),
                ));
        if mismatch {
            return Err(err(format!(
                "is declared with shape {} but computes {:?}",
                text(),
                computed.shape
            )));
        }
        Ok(())
    }

    fn identity(&mut self, name: &str, p: Port) -> Result<Port> {
        use ampgraph_graph::ops::{Unary, UnaryKind};
        let name = self.g.fresh_name(name.to_string());
        Ok(self
            .g
            .add_node(name, Box::new(Unary::new(UnaryKind::Identity)), &[p])?
            .into())
    }

    /// A port holding `v`, adding a Const node the first time a constant is used
    /// (named as its initializer, or `hint`).
    fn port(&mut self, v: &Value, hint: &str) -> Result<Port> {
        match v {
            Value::Port(p) => Ok(*p),
            Value::Const(t) => {
                // A temporary's address may be another's once it is gone: only
                // constants `values` holds are looked up and kept by address.
                let key = const_key(t);
                let held = self.held.contains(&key);
                if let Some(&p) = self.placed.get(&key).filter(|_| held) {
                    return Ok(p);
                }
                let stem = self
                    .initializer_names
                    .get(&key)
                    .or_else(|| self.derived_names.get(&key))
                    .cloned();
                let name = self.g.fresh_name(stem.unwrap_or_else(|| hint.to_string()));
                let p: Port = self
                    .g
                    .add_node(name, Box::new(Const::new(t.clone())), &[])?
                    .into();
                if held {
                    self.placed.insert(key, p);
                }
                Ok(p)
            }
        }
    }
}

/// The dims of a declared shape, all of which must be numbers.
fn static_shape(shape: Option<&crate::proto::TensorShapeProto>) -> Result<Vec<usize>, String> {
    use crate::proto::DimensionValue;
    let shape = shape.ok_or("its shape is not given")?;
    shape
        .dim
        .iter()
        .enumerate()
        .map(|(i, d)| match &d.value {
            Some(DimensionValue::DimValue(v)) => {
                usize::try_from(*v).map_err(|_| format!("dimension {i} is negative ({v})"))
            }
            Some(DimensionValue::DimParam(p)) => Err(format!("dimension {i} is symbolic ('{p}')")),
            None => Err(format!("dimension {i} is unknown")),
        })
        .collect()
}

/// One node being converted: its inputs, attributes, and the ops it adds.
pub(crate) struct NodeCx<'a> {
    imp: &'a mut Importer,
    node: &'a NodeProto,
    name: String,
    /// The attributes the converter read (or said it ignores), for
    /// [`schema::check_unread`].
    read: RefCell<Vec<String>>,
}

impl NodeCx<'_> {
    pub fn opset(&self) -> i64 {
        self.imp.opset
    }

    pub fn err(&self, msg: impl Into<String>) -> OnnxError {
        OnnxError::node(&self.name, &self.node.op_type, msg)
    }

    /// How many inputs the node names (trailing empty names, omitted optionals, aside).
    pub fn num_inputs(&self) -> usize {
        self.node
            .input
            .iter()
            .rposition(|i| !i.is_empty())
            .map_or(0, |i| i + 1)
    }

    pub fn opt_input(&self, i: usize) -> Result<Option<Value>> {
        match self.node.input.get(i).filter(|n| !n.is_empty()) {
            None => Ok(None),
            Some(name) => self
                .imp
                .values
                .get(name)
                .cloned()
                .map(Some)
                .ok_or_else(|| self.err(format!("input '{name}' is not computed"))),
        }
    }

    pub fn input(&self, i: usize) -> Result<Value> {
        self.opt_input(i)?
            .ok_or_else(|| self.err(format!("input {i} is missing")))
    }

    /// Every named input, in order.
    pub fn inputs(&self) -> Result<Vec<Value>> {
        (0..self.num_inputs()).map(|i| self.input(i)).collect()
    }

    pub fn ty(&self, v: &Value) -> TensorType {
        match v {
            Value::Const(t) => t.ty(),
            Value::Port(p) => self.imp.g.ty(*p).clone(),
        }
    }

    /// Input `i`, which must be known at import (a constant, or computed from
    /// constants and shapes).
    /// The op computing `v` at run time, with its inputs (none for a constant).
    pub fn producer(&self, v: &Value) -> Option<(&dyn Op, Vec<Value>)> {
        let Value::Port(p) = v else {
            return None;
        };
        let inputs = self.imp.g.inputs(p.node).into_iter().map(Value::Port);
        Some((self.imp.g.node(p.node).op.as_ref(), inputs.collect()))
    }

    pub fn const_input(&self, i: usize) -> Result<Option<Tensor>> {
        match self.opt_input(i)? {
            None => Ok(None),
            Some(Value::Const(t)) => Ok(Some(t)),
            Some(Value::Port(_)) => Err(self.err(format!(
                "input {i} ('{}') must be a constant (computed from initializers and input shapes): \
                 ampgraph's graphs are statically shaped",
                self.node.input[i]
            ))),
        }
    }

    /// A constant integer input as a list.
    pub fn ints_input(&self, i: usize) -> Result<Option<Vec<i64>>> {
        match self.const_input(i)? {
            None => Ok(None),
            Some(t) => t.to_i64_vec().map(Some).ok_or_else(|| {
                self.err(format!("input {i} must hold integers, not {}", t.dtype()))
            }),
        }
    }

    /// The attribute `name`, if given; read from here on.
    pub fn attr(&self, name: &str) -> Option<&AttributeProto> {
        let a = self.node.attribute.iter().find(|a| a.name == name)?;
        self.read.borrow_mut().push(a.name.clone());
        Some(a)
    }

    /// Attributes that do not change what the converter builds (a Dropout's ratio at
    /// inference): read, whatever they hold.
    pub fn ignore(&self, names: &[&str]) {
        for name in names {
            self.attr(name);
        }
    }

    fn typed_attr(&self, name: &str, want: i32, what: &str) -> Result<Option<&AttributeProto>> {
        match self.attr(name) {
            None => Ok(None),
            Some(a) if a.r#type == want || a.r#type == 0 => Ok(Some(a)),
            Some(_) => Err(self.err(format!("attribute '{name}' must be {what}"))),
        }
    }

    pub fn int_attr(&self, name: &str, default: i64) -> Result<i64> {
        Ok(self
            .typed_attr(name, attribute_type::INT, "an int")?
            .map_or(default, |a| a.i))
    }

    /// A float attribute as the decimal its writer meant: ONNX stores f32, so an
    /// epsilon of 1e-5 arrives as 9.99999974e-6 (below cuDNN's least epsilon); the
    /// shortest decimal that reads back as the same f32 is the value (and exports as
    /// the same f32).
    pub fn float_attr(&self, name: &str, default: f32) -> Result<f64> {
        let f = self
            .typed_attr(name, attribute_type::FLOAT, "a float")?
            .map_or(default, |a| a.f);
        Ok(f.to_string().parse().unwrap_or(f64::from(f)))
    }

    pub fn ints_attr(&self, name: &str) -> Result<Option<Vec<i64>>> {
        Ok(self
            .typed_attr(name, attribute_type::INTS, "a list of ints")?
            .map(|a| a.ints.clone()))
    }

    pub fn floats_attr(&self, name: &str) -> Result<Option<Vec<f32>>> {
        Ok(self
            .typed_attr(name, attribute_type::FLOATS, "a list of floats")?
            .map(|a| a.floats.clone()))
    }

    pub fn string_attr(&self, name: &str, default: &str) -> Result<String> {
        match self.typed_attr(name, attribute_type::STRING, "a string")? {
            None => Ok(default.into()),
            Some(a) => String::from_utf8(a.s.clone())
                .map_err(|_| self.err(format!("attribute '{name}' is not UTF-8"))),
        }
    }

    pub fn tensor_attr(&self, name: &str) -> Result<Option<Tensor>> {
        match self.typed_attr(name, attribute_type::TENSOR, "a tensor")? {
            None => Ok(None),
            Some(a) => {
                let t =
                    a.t.as_ref()
                        .ok_or_else(|| self.err(format!("attribute '{name}' holds no tensor")))?;
                tensor::decode(t, None).map(Some)
            }
        }
    }

    /// Notes on the node computing `v` (where one does) the ONNX op it came from.
    pub fn annotate(&mut self, v: &Value, key: &str, value: &str) {
        if let Value::Port(p) = v {
            self.imp.g.node_mut(p.node).annotations.insert(
                key.into(),
                ampgraph_graph::attrs::AttrValue::Str(value.into()),
            );
        }
    }

    /// Adds `op` over `inputs` as a helper node of this one; when every input is a
    /// constant, computes it now instead (our CPU kernel) and returns the constant.
    pub fn emit(&mut self, op: impl Op, inputs: &[Value]) -> Result<Value> {
        let stem = format!("{}/{}", self.name, op.name().to_lowercase());
        self.add(stem, Box::new(op), inputs)
    }

    /// As [`emit`](Self::emit) for a weight in another layout: computed from input
    /// `input` where that is an initializer, the constant takes its name and `suffix`.
    pub fn emit_weight(
        &mut self,
        op: impl Op,
        inputs: &[Value],
        input: usize,
        suffix: &str,
    ) -> Result<Value> {
        let value = self.emit(op, inputs)?;
        if let (Value::Const(t), Some(name)) = (&value, self.node.input.get(input)) {
            self.imp
                .derived_names
                .insert(const_key(t), format!("{name}/{suffix}"));
        }
        Ok(value)
    }

    /// As [`emit`](Self::emit), for the node computing output `k` of the ONNX node: it
    /// takes the node's name (`name:k` past output 0), or the value's when the value
    /// is a graph output.
    pub fn emit_out(&mut self, k: usize, op: impl Op, inputs: &[Value]) -> Result<Value> {
        let value = self.node.output.get(k).cloned().unwrap_or_default();
        let stem = if self.imp.outputs.contains(&value) {
            value
        } else if k == 0 {
            self.name.clone()
        } else {
            format!("{}_{k}", self.name)
        };
        self.add(stem, Box::new(op), inputs)
    }

    /// The node's result: [`emit_out`](Self::emit_out) for output 0, as a list.
    pub fn out(&mut self, op: impl Op, inputs: &[Value]) -> Result<Vec<Value>> {
        Ok(vec![self.emit_out(0, op, inputs)?])
    }

    /// Refuses constants of `outputs`' types where computing them would take more
    /// memory than the process can still allocate: a tiny file may ask for any size
    /// (ConstantOfShape of [65536, 65536]), and the allocation would abort the process.
    /// Computing one counts 12 bytes an element beyond the result: the CPU kernels
    /// compute 16-bit values in f32, so a binary op of two full-size 16-bit operands
    /// reads both as f32 (8 bytes) and computes its f32 result (4) before storing it
    /// in 16 bits; f32 and f64 operands are read in place and the result moved.
    /// Measured: folding a 1 GiB f32 broadcast Add, BroadcastTo or Where peaks at 1.0
    /// to 1.3 GB for the whole `dump` or `plan`.
    pub fn admit(&self, outputs: &[TensorType]) -> Result<()> {
        // The result's bytes, and with the working values.
        let bytes = |extra: usize| {
            outputs.iter().try_fold(0usize, |sum, t| {
                let one = t.checked_len()?.checked_mul(t.dtype.size_bytes() + extra)?;
                sum.checked_add(one)
            })
        };
        let (result, working) = (bytes(0), bytes(12));
        let available = *(self.imp.available)
            .get_or_init(|| host_memory::available_bytes().unwrap_or(usize::MAX));
        if working.is_some_and(|b| b <= available) {
            return Ok(());
        }
        let mib = |b: Option<usize>| {
            b.map_or("more bytes than can be addressed".into(), |b| {
                format!("{:.1} MiB", host_memory::mib(b))
            })
        };
        let shown: Vec<String> = outputs.iter().map(|t| t.to_string()).collect();
        Err(self.err(format!(
            "computing it at import makes {} ({}; {} with its working values), beyond the {} \
             this process can still allocate",
            shown.join(", "),
            mib(result),
            mib(working),
            mib(Some(available))
        )))
    }

    fn add(&mut self, stem: String, op: Box<dyn Op>, inputs: &[Value]) -> Result<Value> {
        if inputs.iter().all(|v| matches!(v, Value::Const(_))) && !inputs.is_empty() {
            let ts: Vec<&Tensor> = inputs
                .iter()
                .filter_map(|v| match v {
                    Value::Const(t) => Some(t),
                    Value::Port(_) => None,
                })
                .collect();
            let types: Vec<TensorType> = ts.iter().map(|t| t.ty()).collect();
            let type_refs: Vec<&TensorType> = types.iter().collect();
            let outputs = op.infer(&type_refs).map_err(|m| self.err(m))?;
            self.admit(&outputs)?;
            let mut out = op.eval(&ts).map_err(|m| self.err(m))?;
            if out.is_empty() {
                return Err(self.err(format!("{} computed nothing", op.name())));
            }
            return Ok(Value::Const(out.swap_remove(0)));
        }
        let hint = format!("{}/const", self.name);
        let ports = inputs
            .iter()
            .map(|v| self.imp.port(v, &hint))
            .collect::<Result<Vec<_>>>()?;
        let name = self.imp.g.fresh_name(stem);
        let id = self.imp.g.add_node(name, op, &ports)?;
        Ok(Value::Port(id.into()))
    }
}
