//! Symbolic dimensions, through import and back out. Our graphs are statically
//! shaped: a model whose inputs have symbolic dims (`batch`, `sequence`) is imported
//! at the values `--input` gives. To write it back with those dims symbolic, the model
//! is imported again with each symbol at another value (a probe) and put through the
//! same rewrites; comparing the graphs node by node shows which dims and which shape
//! attributes follow each symbol, and as what (`batch`, `2*batch`, `batch*seq`). The
//! exporter writes them as exporters do: `0` and `-1` in a Reshape's shape, a Slice
//! to the end, `Shape` of the input that declares the symbol times a constant. A
//! symbol that some node cannot follow (a constant computed from it, a dim that is not
//! a multiple of it, a graph that changes with it) stays at its value everywhere, and
//! [`SymbolicDims::fixed`] says which node kept it.

use std::collections::HashMap;
use std::path::Path;

use ampgraph_graph::attrs::AttrValue;
use ampgraph_graph::ops::{BroadcastTo, Const, Placeholder, Reshape, Resize, Slice};
use ampgraph_graph::{Graph, NodeId, Op, Port, Tensor};

use crate::error::Result;
use crate::import::{import_model, read_model, ImportOptions};
use crate::proto::{DimensionValue, ModelProto};

/// A symbolic dim of the model's inputs and the value the graph was imported at.
#[derive(Clone, Debug, PartialEq)]
pub struct Symbol {
    /// The model's name for it (`batch`), or `INPUT_AXIS` where the dim has none.
    pub name: String,
    pub value: usize,
    /// The inputs and axes that declare it.
    pub sources: Vec<(String, usize)>,
}

/// The model imported once more per symbol, at another value of that symbol.
pub struct Probes {
    symbols: Vec<Symbol>,
    /// Per symbol: its probe value and graph, or why there is none.
    graphs: Vec<std::result::Result<(usize, Graph), String>>,
}

/// Reads an ONNX model, imports it, and imports it again at other values of each of
/// its inputs' symbolic dims (see the module's documentation).
pub fn import_file_probed(path: &Path, opts: &ImportOptions) -> Result<(Graph, Probes)> {
    let model = read_model(path)?;
    let base = crate::import::model_folder(path);
    let g = import_model(&model, base, opts)?;
    let probes = Probes::import(&model, base, opts);
    Ok((g, probes))
}

impl Probes {
    /// Imports `model` once per symbolic input dim that `opts` gives a value: at twice
    /// that value (which keeps what divided it dividing it), else one more.
    pub fn import(model: &ModelProto, base: Option<&Path>, opts: &ImportOptions) -> Probes {
        let symbols = symbols_of(model, opts);
        let graphs = symbols
            .iter()
            .map(|s| {
                let mut first_error = None;
                // At 1, twice and one more are the same probe.
                let probes: &[usize] = if s.value == 1 {
                    &[2]
                } else {
                    &[2 * s.value, s.value + 1]
                };
                for &probe in probes {
                    let mut o = opts.clone();
                    for (input, axis) in &s.sources {
                        if let Some(shape) = o.input_shapes.get_mut(input) {
                            shape[*axis] = probe;
                        }
                    }
                    match import_model(model, base, &o) {
                        Ok(g) => return Ok((probe, g)),
                        Err(e) => {
                            first_error
                                .get_or_insert(format!("importing at {}={probe}: {e}", s.name));
                        }
                    }
                }
                Err(first_error.unwrap_or_default())
            })
            .collect();
        Probes { symbols, graphs }
    }

    /// The symbols, in the order of the model's inputs.
    pub fn symbols(&self) -> &[Symbol] {
        &self.symbols
    }

    /// Applies to every probe the rewrite the graph itself got; a probe it fails on
    /// is dropped (its symbol stays fixed, with the error as the reason).
    pub fn rewrite<T, E: std::fmt::Display>(
        &mut self,
        mut f: impl FnMut(&mut Graph) -> std::result::Result<T, E>,
    ) {
        for (s, probe) in self.symbols.iter().zip(&mut self.graphs) {
            if let Ok((value, g)) = probe {
                if let Err(e) = f(g) {
                    *probe = Err(format!("rewriting the graph at {}={value}: {e}", s.name));
                }
            }
        }
    }

    /// What follows each symbol in `g` (the graph imported at the symbols' values and
    /// rewritten as the probes were).
    pub fn dims(&self, g: &Graph) -> SymbolicDims {
        let mut fixed: Vec<(usize, String)> = Vec::new();
        let mut live: Vec<usize> = Vec::new();
        for (i, probe) in self.graphs.iter().enumerate() {
            match probe {
                Ok(_) => live.push(i),
                Err(why) => fixed.push((i, why.clone())),
            }
        }
        // Each symbol that some node cannot follow is fixed, and the rest compared
        // again without it: what follows it may follow the others.
        while !live.is_empty() {
            let probes: Vec<(i64, &Graph)> = (live.iter())
                .filter_map(|&i| self.graphs[i].as_ref().ok())
                .map(|(value, probe)| (*value as i64, probe))
                .collect();
            let values = probes.iter().map(|&(v, _)| v).collect();
            let dims = SymbolicDims::new(self.symbols.clone(), live.clone(), values, fixed.clone());
            match dims.compare(g, &probes) {
                Ok(dims) => return dims,
                Err((k, why)) => fixed.push((live.remove(k), why)),
            }
        }
        SymbolicDims::new(self.symbols.clone(), live, Vec::new(), fixed)
    }
}

/// The symbolic dims of the inputs that `opts` gives shapes for, one per name.
fn symbols_of(model: &ModelProto, opts: &ImportOptions) -> Vec<Symbol> {
    let Some(graph) = &model.graph else {
        return Vec::new();
    };
    let initializers: std::collections::HashSet<&str> =
        graph.initializer.iter().map(|t| t.name.as_str()).collect();
    let mut symbols: Vec<Symbol> = Vec::new();
    for input in graph
        .input
        .iter()
        .filter(|i| !initializers.contains(i.name.as_str()))
    {
        let Some(given) = opts.input_shapes.get(&input.name) else {
            continue;
        };
        let dims = input
            .r#type
            .as_ref()
            .and_then(|t| t.tensor_type.as_ref())
            .and_then(|t| t.shape.as_ref())
            .map(|s| s.dim.as_slice())
            .unwrap_or_default();
        if dims.len() != given.len() {
            continue;
        }
        for (axis, (dim, &value)) in dims.iter().zip(given).enumerate() {
            let name = match &dim.value {
                Some(DimensionValue::DimValue(_)) => continue,
                Some(DimensionValue::DimParam(p)) if !p.is_empty() => p.clone(),
                _ => format!("{}_{axis}", input.name),
            };
            if value == 0 {
                continue;
            }
            match symbols.iter_mut().find(|s| s.name == name) {
                // Two inputs that name one symbol at two values: neither follows it.
                Some(s) if s.value != value => s.sources.clear(),
                Some(s) => s.sources.push((input.name.clone(), axis)),
                None => symbols.push(Symbol {
                    name,
                    value,
                    sources: vec![(input.name.clone(), axis)],
                }),
            }
        }
    }
    symbols.retain(|s| !s.sources.is_empty());
    symbols
}

/// A dim's (or a shape entry's) value in the graph, then in each live symbol's probe.
pub(crate) type Values = Vec<i64>;

/// What follows the symbols in one graph: dims of its ports and entries of its shape
/// attributes, by their values at the symbols' values and at each live probe's.
pub struct SymbolicDims {
    symbols: Vec<Symbol>,
    /// The symbols that follow, by index into `symbols`; `Values` has one entry per
    /// live symbol after the graph's.
    live: Vec<usize>,
    /// The value each live symbol's probe was imported at.
    probes: Vec<i64>,
    fixed: Vec<(usize, String)>,
    /// The dims of the ports with a dim that follows a symbol.
    ports: HashMap<Port, Vec<Values>>,
    /// The entries of the shape attributes with an entry that follows one.
    attrs: HashMap<(NodeId, &'static str), Vec<Values>>,
    /// Each node's place in the order the graph is written in.
    order: HashMap<NodeId, usize>,
    /// For the values of a dim that follows a symbol, the first port (in that order)
    /// with such a dim, and its axis: where no product of symbols gives a shape
    /// entry, `Shape` of that port does (`seq + 1` after a class token).
    dims_of: HashMap<Values, (usize, Port, usize)>,
}

/// How a dim or a shape entry is written.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Form {
    Fixed(i64),
    /// This multiple of the product of these live symbols (by their index in
    /// [`SymbolicDims::symbols`]).
    Product(i64, Vec<usize>),
    /// It follows a symbol in no form we write (`seq + 1`).
    Other,
}

/// An entry of a shape input (a Reshape's shape, a Slice's starts and ends) as
/// written in ONNX.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Entry {
    Fixed(i64),
    /// This multiple of the product of these symbols.
    Product(i64, Vec<usize>),
    /// This dim of a port written before.
    DimOf(Port, usize),
}

impl SymbolicDims {
    /// Symbols, the live ones and their probes' values, and the fixed ones (in the
    /// symbols' order): no dims compared yet.
    fn new(
        symbols: Vec<Symbol>,
        live: Vec<usize>,
        probes: Vec<i64>,
        mut fixed: Vec<(usize, String)>,
    ) -> SymbolicDims {
        fixed.sort_by_key(|&(i, _)| i);
        SymbolicDims {
            symbols,
            live,
            probes,
            fixed,
            ports: HashMap::new(),
            attrs: HashMap::new(),
            order: HashMap::new(),
            dims_of: HashMap::new(),
        }
    }

    /// The symbols of the model's inputs.
    pub fn symbols(&self) -> &[Symbol] {
        &self.symbols
    }

    /// The symbols that stay at their value in the export, with the reason.
    pub fn fixed(&self) -> impl Iterator<Item = (&Symbol, &str)> + '_ {
        self.fixed
            .iter()
            .map(|(i, why)| (&self.symbols[*i], why.as_str()))
    }

    /// Whether any symbol follows through the export.
    pub fn any_symbolic(&self) -> bool {
        !self.live.is_empty()
    }

    fn constant(&self, v: usize) -> Values {
        vec![v as i64; 1 + self.live.len()]
    }

    /// The values of each dim of port `p` of `g`.
    pub(crate) fn port(&self, g: &Graph, p: Port) -> Vec<Values> {
        match self.ports.get(&p) {
            Some(dims) => dims.clone(),
            None => g.ty(p).shape.iter().map(|&d| self.constant(d)).collect(),
        }
    }

    /// The values of each entry of a shape attribute, given its entries in `g`.
    pub(crate) fn attr(&self, node: NodeId, name: &'static str, entries: &[i64]) -> Vec<Values> {
        match self.attrs.get(&(node, name)) {
            Some(v) => v.clone(),
            None => entries
                .iter()
                .map(|&e| vec![e; 1 + self.live.len()])
                .collect(),
        }
    }

    /// How a dim with these values is written.
    pub(crate) fn form(&self, v: &[i64]) -> Form {
        let base = v[0];
        let moved: Vec<usize> = (0..self.live.len()).filter(|&k| v[k + 1] != base).collect();
        if moved.is_empty() {
            return Form::Fixed(base);
        }
        let value = |k: usize| self.symbols[self.live[k]].value as i64;
        let product: i64 = moved.iter().map(|&k| value(k)).product();
        if product == 0 || base % product != 0 {
            return Form::Other;
        }
        let c = base / product;
        // Each probe moves one symbol: the dim there is c times the product with that
        // symbol at its probe value.
        let follows =
            (moved.iter()).all(|&k| v[k + 1] == c * (product / value(k)) * self.probes[k]);
        if c <= 0 || !follows {
            return Form::Other;
        }
        Form::Product(c, moved.iter().map(|&k| self.live[k]).collect())
    }

    /// A shape entry of node `at` from its values, where it can be written: a
    /// number, a product of symbols, or a dim of a port written before `at`.
    pub(crate) fn entry(&self, v: &[i64], at: NodeId) -> Option<Entry> {
        match self.form(v) {
            Form::Fixed(n) => Some(Entry::Fixed(n)),
            Form::Product(c, s) => Some(Entry::Product(c, s)),
            Form::Other => {
                let &(place, port, axis) = self.dims_of.get(v)?;
                (place < *self.order.get(&at)?).then_some(Entry::DimOf(port, axis))
            }
        }
    }

    /// How a dim is declared in a model's inputs and outputs: a number, the symbol's
    /// name, a product of names (`2*batch*seq`), or nothing where it follows the
    /// symbols otherwise.
    pub(crate) fn declared(&self, v: &[i64]) -> Option<DimensionValue> {
        match self.form(v) {
            Form::Fixed(n) => Some(DimensionValue::DimValue(n)),
            Form::Product(c, s) => {
                let mut parts: Vec<String> = Vec::new();
                if c != 1 {
                    parts.push(c.to_string());
                }
                parts.extend(s.iter().map(|&i| self.symbols[i].name.clone()));
                Some(DimensionValue::DimParam(parts.join("*")))
            }
            Form::Other => None,
        }
    }

    /// An input and axis of `g` that holds symbol `i` (`Shape` reads it there).
    pub(crate) fn source(&self, g: &Graph, i: usize) -> Option<(NodeId, usize)> {
        self.symbols[i].sources.iter().find_map(|(input, axis)| {
            g.find(input)
                .filter(|&id| g.node(id).op.is::<Placeholder>())
                .map(|id| (id, *axis))
        })
    }
}

/// Whether an attribute may follow a symbol: the exporter writes these from their
/// values.
fn is_shape_attr(op: &dyn Op, attr: &str) -> bool {
    let shaped = op.is::<Reshape>() || op.is::<BroadcastTo>() || op.is::<Resize>();
    (shaped && attr == "shape") || (op.is::<Slice>() && (attr == "begin" || attr == "size"))
}

/// Why a live symbol (by its index among the live ones) cannot follow.
type Blame = (usize, String);

impl SymbolicDims {
    /// `self` (with no dims yet) with the dims and shape attributes that differ
    /// between `g` and the live symbols' probes, or the first symbol some node of `g`
    /// cannot follow.
    fn compare(mut self, g: &Graph, probes: &[(i64, &Graph)]) -> Result<SymbolicDims, Blame> {
        let n = 1 + probes.len();
        let order = g.topo_order().map_err(|e| (0, e.to_string()))?;
        self.order = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        for (place, &id) in order.iter().enumerate() {
            let node = g.node(id);
            let mut others = Vec::with_capacity(probes.len());
            for (k, &(value, probe)) in probes.iter().enumerate() {
                let changed = |how: &str| {
                    let s = &self.symbols[self.live[k]].name;
                    (
                        k,
                        format!(
                            "node '{}' ({}) {how} at {s}={value}",
                            node.name,
                            node.op_name()
                        ),
                    )
                };
                let other = (probe.find(&node.name))
                    .or_else(|| folded_counterpart(g, id, probe))
                    .map(|p| probe.node(p))
                    .ok_or_else(|| changed("is not in the graph"))?;
                let same_ranks = other.outputs().len() == node.outputs().len()
                    && (other.outputs().iter().zip(node.outputs()))
                        .all(|(a, b)| a.shape.len() == b.shape.len() && a.dtype == b.dtype);
                if other.op_name() != node.op_name() || !same_ranks {
                    return Err(changed("is another op or type"));
                }
                others.push(other);
            }
            // The dims of its outputs.
            for (i, ty) in node.outputs().iter().enumerate() {
                let dims: Vec<Values> = (0..ty.shape.len())
                    .map(|axis| {
                        let mut v = Vec::with_capacity(n);
                        v.push(ty.shape[axis] as i64);
                        v.extend(others.iter().map(|o| o.outputs()[i].shape[axis] as i64));
                        v
                    })
                    .collect();
                if dims.iter().any(|v| v.iter().any(|&d| d != v[0])) {
                    for (axis, v) in dims.iter().enumerate() {
                        self.dims_of
                            .entry(v.clone())
                            .or_insert((place, Port::new(id, i), axis));
                    }
                    self.ports.insert(Port::new(id, i), dims);
                }
            }
            // Its attributes.
            if node.op.is::<Placeholder>() {
                continue;
            }
            if let Some(c) = node.op.downcast_ref::<Const>() {
                for (k, other) in others.iter().enumerate() {
                    let Some(o) = other.op.downcast_ref::<Const>() else {
                        unreachable!()
                    };
                    if !same_constant(c, o) {
                        let s = &self.symbols[self.live[k]].name;
                        return Err((
                            k,
                            format!("node '{}' is a constant computed from {s}", node.name),
                        ));
                    }
                }
                continue;
            }
            let attrs = node.op.attrs();
            for (k, other) in others.iter().enumerate() {
                for ((name, mine), (_, theirs)) in attrs.iter().zip(other.op.attrs()) {
                    if *mine == theirs {
                        continue;
                    }
                    let known = is_shape_attr(node.op.as_ref(), name);
                    match (mine, theirs) {
                        (AttrValue::Ints(a), AttrValue::Ints(b)) if known && a.len() == b.len() => {
                            let entries = self
                                .attrs
                                .entry((id, *name))
                                .or_insert_with(|| a.iter().map(|&e| vec![e; n]).collect());
                            for (entry, b) in entries.iter_mut().zip(b) {
                                entry[k + 1] = b;
                            }
                        }
                        _ => {
                            let s = &self.symbols[self.live[k]].name;
                            return Err((
                                k,
                                format!(
                                    "node '{}' ({}) has its attribute '{name}' computed from {s}",
                                    node.name,
                                    node.op_name()
                                ),
                            ));
                        }
                    }
                }
            }
        }
        self.check_writable(g)?;
        Ok(self)
    }

    /// Every node whose dims follow a symbol can be written so in ONNX.
    fn check_writable(&self, g: &Graph) -> Result<(), Blame> {
        let mut nodes: Vec<NodeId> = (self.ports.keys().map(|p| p.node))
            .chain(self.attrs.keys().map(|&(id, _)| id))
            .collect();
        nodes.sort();
        nodes.dedup();
        for id in nodes {
            let op = g.node(id).op.as_ref();
            let writable = if op.is::<Reshape>() {
                self.reshape_shape(g, id).is_some()
            } else if op.is::<BroadcastTo>() {
                self.expand_shape(g, id).is_some()
            } else if op.is::<Slice>() {
                self.slice_bounds(g, id).is_some()
            } else if op.is::<Resize>() {
                self.resize_sizes(g, id).is_some()
            } else if op.is::<Const>() {
                self.const_shape(g, id.into()).is_some()
            } else {
                true
            };
            if !writable {
                let node = g.node(id);
                let moved = (0..g.node(id).outputs().len())
                    .flat_map(|i| self.port(g, Port::new(id, i)))
                    .chain(
                        self.attrs
                            .iter()
                            .filter(|((n, _), _)| *n == id)
                            .flat_map(|(_, v)| v.clone()),
                    )
                    .find_map(|v| (1..v.len()).find(|&k| v[k] != v[0]))
                    .map_or(0, |k| k - 1);
                let s = &self.symbols[self.live[moved]].name;
                return Err((
                    moved,
                    format!(
                        "node '{}' ({}) has a shape that follows {s} in no form ONNX can compute",
                        node.name,
                        node.op_name()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A Reshape's ONNX shape: `0` copies the input's dim, one `-1` is inferred.
    pub(crate) fn reshape_shape(&self, g: &Graph, id: NodeId) -> Option<Vec<Entry>> {
        let r = g.node(id).op.downcast_ref::<Reshape>()?;
        let target = self.attr(id, "shape", &r.shape);
        let input = self.port(g, g.inputs(id)[0]);
        let forms: Vec<Form> = target.iter().map(|v| self.form(v)).collect();
        // A literal 0 is a dim of 0 (`allowzero`), so no 0 may copy.
        let may_copy = !forms.contains(&Form::Fixed(0));
        let mut infer = !forms.contains(&Form::Fixed(-1));
        let copies = |i: usize| may_copy && input.get(i) == Some(&target[i]);
        let pending = (0..target.len())
            .filter(|&i| !matches!(forms[i], Form::Fixed(_)) && !copies(i))
            .count();
        target
            .iter()
            .zip(forms)
            .enumerate()
            .map(|(i, (v, form))| match form {
                Form::Fixed(d) => Some(Entry::Fixed(d)),
                _ if copies(i) => Some(Entry::Fixed(0)),
                _ if pending == 1 && infer => {
                    infer = false;
                    Some(Entry::Fixed(-1))
                }
                _ => self.entry(v, id),
            })
            .collect()
    }

    /// An Expand's shape: `1` keeps the input's dim.
    pub(crate) fn expand_shape(&self, g: &Graph, id: NodeId) -> Option<Vec<Entry>> {
        let b = g.node(id).op.downcast_ref::<BroadcastTo>()?;
        let shape: Vec<i64> = b.shape.iter().map(|&d| d as i64).collect();
        let target = self.attr(id, "shape", &shape);
        let input = self.port(g, g.inputs(id)[0]);
        let offset = target.len().checked_sub(input.len())?;
        (target.iter().enumerate())
            .map(|(i, v)| match self.form(v) {
                Form::Fixed(d) => Some(Entry::Fixed(d)),
                _ if i >= offset && input[i - offset] == *v => Some(Entry::Fixed(1)),
                _ => self.entry(v, id),
            })
            .collect()
    }

    /// A Slice's starts and ends (`i64::MAX`: to the end of the axis).
    pub(crate) fn slice_bounds(&self, g: &Graph, id: NodeId) -> Option<(Vec<Entry>, Vec<Entry>)> {
        let s = g.node(id).op.downcast_ref::<Slice>()?;
        let begin: Vec<i64> = s.begin.iter().map(|&b| b as i64).collect();
        let begin = self.attr(id, "begin", &begin);
        let input = self.port(g, g.inputs(id)[0]);
        let out = self.port(g, id.into());
        let mut starts = Vec::with_capacity(begin.len());
        let mut ends = Vec::with_capacity(begin.len());
        for ((b, o), d) in begin.iter().zip(&out).zip(&input) {
            starts.push(self.entry(b, id)?);
            let end: Values = b.iter().zip(o).map(|(b, o)| b + o).collect();
            ends.push(
                if end == *d && matches!(self.form(d), Form::Product(..) | Form::Other) {
                    Entry::Fixed(i64::MAX)
                } else {
                    self.entry(&end, id)?
                },
            );
        }
        Some((starts, ends))
    }

    /// A Resize's output sizes.
    pub(crate) fn resize_sizes(&self, g: &Graph, id: NodeId) -> Option<Vec<Entry>> {
        let r = g.node(id).op.downcast_ref::<Resize>()?;
        let shape: Vec<i64> = r.shape.iter().map(|&d| d as i64).collect();
        (self.attr(id, "shape", &shape).iter())
            .map(|v| self.entry(v, id))
            .collect()
    }

    /// The shape of a constant whose dims follow a symbol (written as the constant
    /// along those axes once, expanded), where every dim is a number or a product of
    /// symbols (it is written where it is first read, so no port is known to come
    /// before it).
    pub(crate) fn const_shape(&self, g: &Graph, p: Port) -> Option<Vec<Entry>> {
        (self.port(g, p).iter())
            .map(|v| match self.form(v) {
                Form::Fixed(n) => Some(Entry::Fixed(n)),
                Form::Product(c, s) => Some(Entry::Product(c, s)),
                Form::Other => None,
            })
            .collect()
    }
}

/// The probe's constant in the place of the Const `id` of `g` that the probe does not
/// name: what the first reader of `id` (by name) reads there. Import names a constant
/// it computes after its reader, and one it did not need to compute (an `Expand` of
/// a class token to a batch of 1) after the initializer.
fn folded_counterpart(g: &Graph, id: NodeId, probe: &Graph) -> Option<NodeId> {
    g.node(id).op.downcast_ref::<Const>()?;
    let &(reader, slot, _) = g.consumers(id).first()?;
    let theirs = probe.find(&g.node(reader).name)?;
    let source = probe.inputs(theirs).get(slot)?.node;
    probe.node(source).op.is::<Const>().then_some(source)
}

/// Whether two constants are the same but for dims along which neither varies (a
/// constant that an exporter's `ConstantOfShape` or `Expand` of the input's shape
/// made: written once, expanded to the shape at run time).
fn same_constant(a: &Const, b: &Const) -> bool {
    if a.ty.dtype != b.ty.dtype || a.ty.shape.len() != b.ty.shape.len() {
        return false;
    }
    if a.ty.shape == b.ty.shape {
        return a.values == b.values;
    }
    let axes: Vec<usize> = (0..a.ty.shape.len())
        .filter(|&i| a.ty.shape[i] != b.ty.shape[i])
        .collect();
    match (a.values.as_ref(), b.values.as_ref()) {
        (None, None) => true,
        (Some(_), Some(_)) => {
            let (Ok(a), Ok(b)) = (a.eval(&[]), b.eval(&[])) else {
                return false;
            };
            match (uniform_along(&a[0], &axes), uniform_along(&b[0], &axes)) {
                (Some(x), Some(y)) => x == y,
                _ => false,
            }
        }
        _ => false,
    }
}

/// `t` with the given axes cut to their first index, where `t` is that broadcast
/// along them.
pub(crate) fn uniform_along(t: &Tensor, axes: &[usize]) -> Option<Tensor> {
    let begin = vec![0; t.shape().len()];
    let size: Vec<i64> = (0..t.shape().len())
        .map(|i| if axes.contains(&i) { 1 } else { -1 })
        .collect();
    let first = Slice::new(begin, size).eval(&[t]).ok()?.swap_remove(0);
    let again = BroadcastTo::new(t.shape().to_vec())
        .eval(&[&first])
        .ok()?
        .swap_remove(0);
    (again == *t).then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ampgraph_graph::Data;

    /// `batch` at 2 (probed at 4) and `seq` at 5 (probed at 10).
    fn batch_and_seq() -> SymbolicDims {
        let symbol = |name: &str, value| Symbol {
            name: name.into(),
            value,
            sources: vec![("x".into(), 0)],
        };
        let symbols = vec![symbol("batch", 2), symbol("seq", 5)];
        SymbolicDims::new(symbols, vec![0, 1], vec![4, 10], Vec::new())
    }

    #[test]
    fn a_dim_is_a_number_a_multiple_of_a_product_of_symbols_or_other() {
        let d = batch_and_seq();
        assert_eq!(d.form(&[16, 16, 16]), Form::Fixed(16));
        assert_eq!(d.form(&[2, 4, 2]), Form::Product(1, vec![0]));
        assert_eq!(d.form(&[20, 40, 40]), Form::Product(2, vec![0, 1]));
        // seq + 1, batch * (seq + 1), and a dim that grows with batch but not in step.
        assert_eq!(d.form(&[6, 6, 11]), Form::Other);
        assert_eq!(d.form(&[12, 24, 22]), Form::Other);
        assert_eq!(d.form(&[2, 5, 2]), Form::Other);
        let declared = |v: &[i64]| d.declared(v);
        assert_eq!(declared(&[16, 16, 16]), Some(DimensionValue::DimValue(16)));
        assert_eq!(
            declared(&[2, 4, 2]),
            Some(DimensionValue::DimParam("batch".into()))
        );
        assert_eq!(
            declared(&[20, 40, 40]),
            Some(DimensionValue::DimParam("2*batch*seq".into()))
        );
        assert_eq!(declared(&[6, 6, 11]), None);
    }

    #[test]
    fn a_constant_broadcast_along_axes_is_cut_to_one_along_them() {
        let row = [1.0f32, 2.0, 3.0];
        let t = Tensor::new(vec![2, 3], Data::F32([row, row].concat())).unwrap();
        let once = uniform_along(&t, &[0]).unwrap();
        assert_eq!(
            once,
            Tensor::new(vec![1, 3], Data::F32(row.to_vec())).unwrap()
        );
        assert_eq!(uniform_along(&t, &[1]), None);
    }
}
