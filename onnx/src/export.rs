//! [`Graph`] -> ONNX (opset 17): each of our ops as the ONNX node(s) that compute
//! it. Constants become initializers, written in the type their readers need (a
//! weight only casts read is stored already cast, a filter already in ONNX's OIHW
//! order); inputs and outputs keep the types they had before mixed precision unless
//! [`ExportOptions::keep_io_types`] is off.

use std::collections::HashMap;
use std::path::Path;

use ampgraph_graph::ops::{dilated_span, Conv2DBackpropInput, Resize, ResizeMode};
use ampgraph_graph::ops::{
    AvgPool, BatchMatMul, BatchNorm, BiasAdd, Binary, BinaryKind, BroadcastTo, Cast, Compare,
    Concat, Const, Conv2D, DataFormat, FusedMatMul, Gather, LayerNorm, LogSoftmax, Logical, MatMul,
    MaxPool, NormActivation, Not, Pad, PadMode, Padding, Placeholder, Reduce, ReduceKind, Reshape,
    Slice, Softmax, SoftmaxCrossEntropy, Transpose, Unary, UnaryKind, Where,
};
use ampgraph_graph::{DType, Data, Graph, NodeId, Op, Port, Tensor, TensorType};
use prost::Message;

use crate::error::{OnnxError, Result};
use crate::proto::{
    attribute_type, AttributeProto, Dimension, DimensionValue, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, TensorShapeProto, TypeProto, TypeProtoTensor, ValueInfoProto,
};
use crate::symbolic::{Entry, SymbolicDims};
use crate::tensor;

/// The opset exported models bind to.
pub const EXPORT_OPSET: i64 = 17;
/// The IR version of that opset.
const IR_VERSION: i64 = 8;

/// How to export a graph.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Inputs and outputs keep f32 where mixed precision made them 16-bit (the
    /// default, onnxruntime's converter's `keep_io_types`); off, a 16-bit graph takes
    /// and returns its 16-bit type: an f32 input only Casts read arrives in their
    /// type, and f32 outputs leave in it.
    pub keep_io_types: bool,
    /// Initializers past this many bytes in all go to an external data file beside
    /// the model (`MODEL.onnx.data`), as onnx's own writer does: one protobuf message
    /// cannot exceed 2 GiB. 1 GiB by default.
    pub external_data_above: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            keep_io_types: true,
            external_data_above: 1 << 30,
        }
    }
}

/// Writes `g` to `path` as an ONNX model, whole or not at all (a temporary file
/// renamed into place); initializers past [`ExportOptions::external_data_above`]
/// go to `PATH.data` beside it, written first.
pub fn export_file(g: &Graph, path: &Path, opts: &ExportOptions) -> Result<()> {
    export_file_with_dims(g, None, path, opts)
}

/// [`export_file`], writing the dims that `dims` finds following the model's
/// symbolic dims as symbolic (see [`SymbolicDims`]).
pub fn export_file_with_dims(
    g: &Graph,
    dims: Option<&SymbolicDims>,
    path: &Path,
    opts: &ExportOptions,
) -> Result<()> {
    let mut model = export_with_dims(g, dims, opts)?;
    let graph = model.graph.as_mut().expect("export makes a graph");
    let total: usize = graph.initializer.iter().map(|t| t.raw_data.len()).sum();
    if total > opts.external_data_above {
        let file = path
            .file_name()
            .map_or_else(|| "model.onnx".into(), |f| f.to_string_lossy().into_owned());
        let location = format!("{file}.data");
        let mut data = Vec::with_capacity(total);
        // Small tensors (shapes, axes) stay inline, where shape inference reads them;
        // 1 KiB is onnx's own writer's threshold.
        for t in graph
            .initializer
            .iter_mut()
            .filter(|t| t.raw_data.len() >= 1024)
        {
            // Aligned as onnx's own writer aligns them, so readers may map the file.
            data.resize(data.len().next_multiple_of(64), 0);
            let offset = data.len() as u64;
            data.extend(tensor::externalize(t, &location, offset));
        }
        let data_path = path.with_file_name(&location);
        ampgraph_graph::format::write_atomic(&data_path, &data)?;
    }
    ampgraph_graph::format::write_atomic(path, &model.encode_to_vec())?;
    Ok(())
}

/// The graph as an ONNX model.
pub fn export(g: &Graph, opts: &ExportOptions) -> Result<ModelProto> {
    export_with_dims(g, None, opts)
}

/// [`export`], writing the dims that `dims` finds following the model's symbolic
/// dims as symbolic.
pub fn export_with_dims(
    g: &Graph,
    dims: Option<&SymbolicDims>,
    opts: &ExportOptions,
) -> Result<ModelProto> {
    // FLOAT8 types came with opset 19.
    for id in g.node_ids() {
        let node = g.node(id);
        if let Some(t) = node.outputs().iter().find(|t| t.dtype.is_fp8()) {
            return Err(OnnxError::node(
                &node.name,
                node.op.name(),
                format!(
                    "{} needs ONNX opset 19; exports bind to opset {EXPORT_OPSET}",
                    t.dtype
                ),
            ));
        }
    }
    let mut ex = Exporter::new(g, dims.filter(|d| d.any_symbolic()));
    ex.run(opts)?;
    Ok(ModelProto {
        ir_version: IR_VERSION,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: EXPORT_OPSET,
        }],
        producer_name: "ampgraph".into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        graph: Some(ex.out),
        ..ModelProto::default()
    })
}

/// A value's declared type; `dims`, where given, declares each dim.
fn value_info(
    name: &str,
    ty: &TensorType,
    dims: Option<Vec<Option<DimensionValue>>>,
) -> ValueInfoProto {
    let dims = dims.unwrap_or_else(|| {
        (ty.shape.iter())
            .map(|&d| Some(DimensionValue::DimValue(d as i64)))
            .collect()
    });
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: tensor::elem_type_of(ty.dtype),
                shape: Some(TensorShapeProto {
                    dim: dims.into_iter().map(|value| Dimension { value }).collect(),
                }),
            }),
        }),
    }
}

fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INT,
        i,
        ..AttributeProto::default()
    }
}

fn attr_float(name: &str, f: f64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::FLOAT,
        f: f as f32,
        ..AttributeProto::default()
    }
}

fn attr_ints(name: &str, ints: impl IntoIterator<Item = i64>) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::INTS,
        ints: ints.into_iter().collect(),
        ..AttributeProto::default()
    }
}

fn attr_string(name: &str, s: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attribute_type::STRING,
        s: s.as_bytes().to_vec(),
        ..AttributeProto::default()
    }
}

fn i64s(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&d| d as i64).collect()
}

/// A `Shape` node's attributes reading one dim, `axis`.
fn dim_slice(axis: usize) -> Vec<AttributeProto> {
    let axis = axis as i64;
    vec![attr_int("start", axis), attr_int("end", axis + 1)]
}

fn i64_tensor(values: Vec<i64>) -> Tensor {
    let n = values.len();
    Tensor::new(vec![n], Data::I64(values)).expect("a vector's shape fits its data")
}

struct Exporter<'g> {
    g: &'g Graph,
    out: GraphProto,
    /// Ports whose values are known here (constants, and casts of them): written as
    /// initializers only when some node reads them as they are.
    consts: HashMap<Port, Tensor>,
    /// The ONNX value holding each port, once there is one.
    names: HashMap<Port, String>,
    /// Initializers written for transformed constants, by what they were made from.
    derived: HashMap<(Port, &'static str), String>,
    /// BiasAdds written as the bias input of the Conv or Gemm before them.
    absorbed: std::collections::HashSet<NodeId>,
    /// The node being exported, for naming helper values and for errors.
    current: NodeId,
    helpers: usize,
    /// The dims that follow the model's symbolic dims, where they are written so.
    sym: Option<&'g SymbolicDims>,
    /// Each symbol's value, as a 1-element tensor read off the input declaring it.
    symbol_values: HashMap<usize, String>,
}

impl<'g> Exporter<'g> {
    fn new(g: &'g Graph, sym: Option<&'g SymbolicDims>) -> Self {
        Exporter {
            g,
            out: GraphProto {
                name: "ampgraph".into(),
                ..GraphProto::default()
            },
            consts: HashMap::new(),
            names: HashMap::new(),
            derived: HashMap::new(),
            absorbed: std::collections::HashSet::new(),
            current: NodeId::new(0),
            helpers: 0,
            sym,
            symbol_values: HashMap::new(),
        }
    }

    fn err(&self, msg: impl Into<String>) -> OnnxError {
        let node = self.g.node(self.current);
        OnnxError::Export {
            node: node.name.clone(),
            op: node.op_name().into(),
            msg: msg.into(),
        }
    }

    fn run(&mut self, opts: &ExportOptions) -> Result<()> {
        let g = self.g;
        let half_inputs = if opts.keep_io_types {
            HashMap::new()
        } else {
            self.inputs_read_as_half()
        };
        let order = g.topo_order()?;
        // Known values and inputs first, so that a node may take any of them as an
        // input of another node folded into it (a Conv its BiasAdd's bias).
        for &id in &order {
            self.current = id;
            let op = g.node(id).op.as_ref();
            let value = if op.is::<Const>() {
                op.eval(&[]).map_err(|m| self.err(m))?.swap_remove(0)
            } else if let Some(cast) = op.downcast_ref::<Cast>() {
                match self.consts.get(&g.inputs(id)[0]) {
                    Some(t) => t.cast(cast.to),
                    None => continue,
                }
            } else {
                continue;
            };
            self.consts.insert(id.into(), value);
        }
        for &id in &order {
            let node = g.node(id);
            if let Some(Placeholder(ty)) = node.op.downcast_ref::<Placeholder>() {
                let ty = match half_inputs.get(&id) {
                    Some(&half) => ty.with_dtype(half),
                    None => ty.clone(),
                };
                let dims = self.declared_dims(id.into());
                self.out.input.push(value_info(&node.name, &ty, dims));
                self.names.insert(id.into(), node.name.clone());
            }
        }
        for id in order {
            self.current = id;
            let node = g.node(id);
            let op = node.op.as_ref();
            let done = self.consts.contains_key(&id.into()) || self.names.contains_key(&id.into());
            if done || self.absorbed.contains(&id) {
                continue;
            }
            if let Some(cast) = op.downcast_ref::<Cast>() {
                let x = g.inputs(id)[0];
                if half_inputs.get(&x.node) == Some(&cast.to) {
                    let name = self.value(x)?;
                    self.names.insert(id.into(), name);
                    continue;
                }
            }
            self.node(id)?;
        }
        self.outputs(opts)
    }

    /// Placeholders (f32) that only Casts to one 16-bit type read: with 16-bit I/O
    /// they take that type and the casts go.
    fn inputs_read_as_half(&self) -> HashMap<NodeId, DType> {
        let g = self.g;
        let mut found = HashMap::new();
        for id in g.node_ids() {
            let node = g.node(id);
            if !node.op.is::<Placeholder>() || node.outputs()[0].dtype != DType::F32 {
                continue;
            }
            let targets: Vec<Option<DType>> = g
                .consumers(id)
                .iter()
                .map(|&(c, _, _)| g.node(c).op.downcast_ref::<Cast>().map(|k| k.to))
                .collect();
            if let Some(Some(first)) = targets.first() {
                if first.is_half() && targets.iter().all(|t| *t == Some(*first)) {
                    found.insert(id, *first);
                }
            }
        }
        found
    }

    fn outputs(&mut self, opts: &ExportOptions) -> Result<()> {
        let g = self.g;
        // With 16-bit I/O, f32 outputs leave in the graph's 16-bit type (if it has one).
        let half = g
            .node_ids()
            .flat_map(|id| g.node(id).outputs().iter().map(|t| t.dtype))
            .find(|d| d.is_half());
        for (i, &p) in g.outputs().iter().enumerate() {
            self.current = p.node;
            let name = g.port_name(p);
            let ty = g.ty(p).clone();
            let want = match (opts.keep_io_types, ty.dtype, half) {
                (true, d, _) if d.is_half() => DType::F32,
                (false, DType::F32, Some(h)) => h,
                _ => ty.dtype,
            };
            // A Cast from the wanted type that nothing else reads: its input is the
            // output (rather than a cast of a cast).
            let source = match g.node(p.node).op.downcast_ref::<Cast>() {
                Some(_)
                    if want != ty.dtype
                        && g.ty(g.inputs(p.node)[0]).dtype == want
                        && g.consumers(p.node).is_empty()
                        && g.outputs().iter().filter(|&&o| o == p).count() == 1 =>
                {
                    let cast_out = self.value(p)?;
                    self.out
                        .node
                        .retain(|n| n.output.first() != Some(&cast_out));
                    self.names.remove(&p);
                    g.inputs(p.node)[0]
                }
                _ => p,
            };
            let ty = ty.with_dtype(g.ty(source).dtype);
            let mut value = self.value(source)?;
            let out_name = if want != ty.dtype {
                if value == name {
                    // The cast takes the output's name; the value it casts another.
                    value = format!("{name}/{}", ty.dtype);
                    self.rename_value(&name, &value);
                }
                let cast = format!("{name}/output_cast");
                self.push_node(
                    &cast,
                    "Cast",
                    vec![value],
                    vec![name.clone()],
                    vec![attr_int("to", i64::from(tensor::elem_type_of(want)))],
                );
                name.clone()
            } else if value != name || self.out.output.iter().any(|o| o.name == value) {
                // A constant, an input or a repeated output: an Identity gives it the name.
                let unique = if self.out.output.iter().any(|o| o.name == name) {
                    format!("{name}/output{i}")
                } else {
                    name.clone()
                };
                self.push_node(
                    &format!("{unique}/identity"),
                    "Identity",
                    vec![value],
                    vec![unique.clone()],
                    vec![],
                );
                unique
            } else {
                value
            };
            let dims = self.declared_dims(p);
            self.out
                .output
                .push(value_info(&out_name, &ty.with_dtype(want), dims));
        }
        Ok(())
    }

    /// Renames an ONNX value wherever the graph so far names it.
    fn rename_value(&mut self, from: &str, to: &str) {
        let graph = &mut self.out;
        for n in &mut graph.node {
            for v in n.input.iter_mut().chain(n.output.iter_mut()) {
                if v == from {
                    *v = to.to_string();
                }
            }
        }
        for o in &mut graph.output {
            if o.name == from {
                o.name = to.to_string();
            }
        }
        for v in self.names.values_mut() {
            if v == from {
                *v = to.to_string();
            }
        }
    }

    /// The ONNX value holding port `p`: an initializer for a known value (written the
    /// first time it is read).
    fn value(&mut self, p: Port) -> Result<String> {
        if let Some(n) = self.names.get(&p) {
            return Ok(n.clone());
        }
        let Some(t) = self.consts.get(&p).cloned() else {
            return Err(self.err(format!(
                "input '{}' has no ONNX value (its node was not exported)",
                self.g.port_name(p)
            )));
        };
        let name = self.g.port_name(p);
        let shape = self.planned_shape(|sym, g| sym.const_shape(g, p), i64s(t.shape()))?;
        if shape.iter().any(|e| matches!(e, Entry::Product(..))) {
            // Written once along the axes that follow a symbol, expanded at run time.
            let axes: Vec<usize> = (shape.iter().enumerate())
                .filter(|(_, e)| matches!(e, Entry::Product(..)))
                .map(|(i, _)| i)
                .collect();
            let once = crate::symbolic::uniform_along(&t, &axes).ok_or_else(|| {
                self.err(format!(
                    "the constant '{name}' varies along a symbolic axis"
                ))
            })?;
            let once_name = format!("{name}/once");
            self.out.initializer.push(tensor::encode(&once_name, &once));
            let shape = self.shape_value("shape", shape)?;
            self.push_node(
                &format!("{name}/expand"),
                "Expand",
                vec![once_name, shape],
                vec![name.clone()],
                vec![],
            );
        } else {
            self.out.initializer.push(tensor::encode(&name, &t));
        }
        self.names.insert(p, name.clone());
        Ok(name)
    }

    /// How the dims of port `p` are declared, where some follow a symbol.
    fn declared_dims(&self, p: Port) -> Option<Vec<Option<DimensionValue>>> {
        let sym = self.sym?;
        Some(
            sym.port(self.g, p)
                .iter()
                .map(|v| sym.declared(v))
                .collect(),
        )
    }

    /// A shape input's entries: as `plan` writes them where the graph has symbolic
    /// dims, else the numbers `fixed`.
    fn planned_shape(
        &self,
        plan: impl Fn(&SymbolicDims, &Graph) -> Option<Vec<Entry>>,
        fixed: impl IntoIterator<Item = i64>,
    ) -> Result<Vec<Entry>> {
        let Some(sym) = self.sym else {
            return Ok(fixed.into_iter().map(Entry::Fixed).collect());
        };
        plan(sym, self.g)
            .ok_or_else(|| self.err("a shape that follows a symbolic dim cannot be written"))
    }

    /// A 1-D i64 ONNX value of these entries: an initializer where all are fixed,
    /// else a Concat of them, each product of symbols read off the inputs' shapes.
    fn shape_value(&mut self, what: &str, entries: Vec<Entry>) -> Result<String> {
        let mut pieces = Vec::new();
        let mut fixed = Vec::new();
        for e in entries {
            let piece = match e {
                Entry::Fixed(d) => {
                    fixed.push(d);
                    continue;
                }
                Entry::DimOf(port, axis) => {
                    let x = self.value(port)?;
                    self.helper("Shape", vec![x], dim_slice(axis))
                }
                Entry::Product(c, symbols) => {
                    let mut v = self.symbol_value(symbols[0])?;
                    for &s in &symbols[1..] {
                        let next = self.symbol_value(s)?;
                        v = self.helper("Mul", vec![v, next], vec![]);
                    }
                    if c != 1 {
                        let c = self.constant("factor", &i64_tensor(vec![c]));
                        v = self.helper("Mul", vec![v, c], vec![]);
                    }
                    v
                }
            };
            if !fixed.is_empty() {
                pieces.push(self.constant(what, &i64_tensor(std::mem::take(&mut fixed))));
            }
            pieces.push(piece);
        }
        if pieces.is_empty() {
            return Ok(self.constant(what, &i64_tensor(fixed)));
        }
        if !fixed.is_empty() {
            pieces.push(self.constant(what, &i64_tensor(fixed)));
        }
        Ok(self.helper("Concat", pieces, vec![attr_int("axis", 0)]))
    }

    /// Symbol `i`'s value: `Shape` of the input that declares it, at its axis.
    fn symbol_value(&mut self, i: usize) -> Result<String> {
        if let Some(v) = self.symbol_values.get(&i) {
            return Ok(v.clone());
        }
        let sym = self.sym.expect("symbols come with dims");
        let (input, axis) = sym.source(self.g, i).ok_or_else(|| {
            self.err(format!(
                "no input of the graph declares the symbolic dim '{}'",
                sym.symbols()[i].name
            ))
        })?;
        let x = self.value(input.into())?;
        let name = format!("{}/{}", self.g.node(input).name, sym.symbols()[i].name);
        self.push_node(&name, "Shape", vec![x], vec![name.clone()], dim_slice(axis));
        self.symbol_values.insert(i, name.clone());
        Ok(name)
    }

    /// A new initializer holding `t`, named after the current node.
    fn constant(&mut self, what: &str, t: &Tensor) -> String {
        let name = self.helper_name(what);
        self.out.initializer.push(tensor::encode(&name, t));
        name
    }

    fn helper_name(&mut self, what: &str) -> String {
        self.helpers += 1;
        format!("{}/{what}_{}", self.g.node(self.current).name, self.helpers)
    }

    fn push_node(
        &mut self,
        name: &str,
        op_type: &str,
        inputs: Vec<String>,
        outputs: Vec<String>,
        attribute: Vec<AttributeProto>,
    ) {
        self.out.node.push(NodeProto {
            input: inputs,
            output: outputs,
            name: name.into(),
            op_type: op_type.into(),
            attribute,
            ..NodeProto::default()
        });
    }

    /// A helper node of the current one, returning its output's name.
    fn helper(&mut self, op_type: &str, inputs: Vec<String>, attrs: Vec<AttributeProto>) -> String {
        let out = self.helper_name(&op_type.to_lowercase());
        self.push_node(&out.clone(), op_type, inputs, vec![out.clone()], attrs);
        out
    }

    /// The node computing the current node's output 0.
    fn finish(&mut self, op_type: &str, inputs: Vec<String>, attrs: Vec<AttributeProto>) {
        self.finish_as(self.current.into(), op_type, inputs, attrs);
    }

    /// A node named as the current one computing port `out` (the current node's, or
    /// that of a node folded into it).
    fn finish_as(
        &mut self,
        out: Port,
        op_type: &str,
        inputs: Vec<String>,
        attrs: Vec<AttributeProto>,
    ) {
        let name = self.g.node(self.current).name.clone();
        let value = self.g.port_name(out);
        self.names.insert(out, value.clone());
        self.push_node(&name, op_type, inputs, vec![value], attrs);
    }

    /// The BiasAdd that alone reads the current node's output, adding along
    /// `format`'s channel axis: ONNX's Conv and Gemm take it as an input. Returns
    /// its output and its bias.
    fn bias_after(&mut self, format: DataFormat) -> Option<(Port, Port)> {
        let g = self.g;
        let id = self.current;
        if g.outputs().iter().any(|p| p.node == id) {
            return None;
        }
        let [(reader, 0, _)] = g.consumers(id)[..] else {
            return None;
        };
        let b = g.node(reader).op.downcast_ref::<BiasAdd>()?;
        let was_add = g.node(reader).annotations.get(crate::ONNX_OP_ANNOTATION)
            == Some(&ampgraph_graph::attrs::AttrValue::Str("Add".into()));
        if was_add {
            return None;
        }
        if b.data_format != format && g.ty(id.into()).shape.len() > 2 {
            return None;
        }
        // The bias must have its ONNX value already (an input or a constant).
        let bias = g.inputs(reader)[1];
        if !self.names.contains_key(&bias) && !self.consts.contains_key(&bias) {
            return None;
        }
        self.absorbed.insert(reader);
        Some((reader.into(), bias))
    }

    /// `p` transformed by `f` (a constant, written once as a new initializer) or by
    /// the ONNX node `op_type` with `attrs` (a runtime value).
    fn transformed(
        &mut self,
        p: Port,
        key: &'static str,
        f: impl Fn(&Tensor) -> std::result::Result<Tensor, String>,
        op_type: &str,
        inputs_after: Vec<String>,
        attrs: Vec<AttributeProto>,
    ) -> Result<String> {
        if let Some(t) = self.consts.get(&p).cloned() {
            if let Some(n) = self.derived.get(&(p, key)) {
                return Ok(n.clone());
            }
            let value = f(&t).map_err(|m| self.err(m))?;
            // A filter imported as `w/hwio` goes back as `w`.
            let port = self.g.port_name(p);
            let name = match port.strip_suffix("/hwio") {
                Some(stem)
                    if key == "oihw" && !self.out.initializer.iter().any(|i| i.name == stem) =>
                {
                    stem.to_string()
                }
                _ => format!("{port}/{key}"),
            };
            self.out.initializer.push(tensor::encode(&name, &value));
            self.derived.insert((p, key), name.clone());
            return Ok(name);
        }
        let x = self.value(p)?;
        let mut inputs = vec![x];
        inputs.extend(inputs_after);
        Ok(self.helper(op_type, inputs, attrs))
    }

    fn node(&mut self, id: NodeId) -> Result<()> {
        let g = self.g;
        let node = g.node(id);
        let op = node.op.as_ref();
        let inputs = g.inputs(id);
        if node.outputs().len() > 1 && !op.is::<BatchNorm>() {
            return Err(self.err("ops with several outputs are not exported"));
        }
        if let Some(u) = op.downcast_ref::<Unary>() {
            let x = self.value(inputs[0])?;
            return self.unary(u.kind, x, &node.outputs()[0]);
        }
        if let Some(b) = op.downcast_ref::<Binary>() {
            let (a, c) = (self.value(inputs[0])?, self.value(inputs[1])?);
            let onnx = match b.kind {
                BinaryKind::Add => "Add",
                BinaryKind::Sub => "Sub",
                BinaryKind::Mul => "Mul",
                BinaryKind::Div => "Div",
                BinaryKind::Maximum => "Max",
                BinaryKind::Minimum => "Min",
                BinaryKind::Pow => "Pow",
                BinaryKind::SquaredDifference => {
                    let d = self.helper("Sub", vec![a, c], vec![]);
                    self.finish("Mul", vec![d.clone(), d], vec![]);
                    return Ok(());
                }
            };
            self.finish(onnx, vec![a, c], vec![]);
            return Ok(());
        }
        if let Some(b) = op.downcast_ref::<BiasAdd>() {
            let x = self.value(inputs[0])?;
            let rank = node.outputs()[0].shape.len();
            let c = g.ty(inputs[1]).shape[0];
            let bias = if b.data_format == DataFormat::Nchw && rank > 2 {
                let mut shape = vec![c];
                shape.extend(std::iter::repeat_n(1, rank - 2));
                let shape_name = self.constant("shape", &i64_tensor(i64s(&shape)));
                let reshaped = shape.clone();
                self.transformed(
                    inputs[1],
                    "channels",
                    move |t| t.clone().reshaped(reshaped.clone()),
                    "Reshape",
                    vec![shape_name],
                    vec![],
                )?
            } else {
                self.value(inputs[1])?
            };
            self.finish("Add", vec![x, bias], vec![]);
            return Ok(());
        }
        if let Some(c) = op.downcast_ref::<Cast>() {
            let x = self.value(inputs[0])?;
            self.finish(
                "Cast",
                vec![x],
                vec![attr_int("to", i64::from(tensor::elem_type_of(c.to)))],
            );
            return Ok(());
        }
        if let Some(m) = op.downcast_ref::<MatMul>() {
            let (a, b) = (self.value(inputs[0])?, self.value(inputs[1])?);
            let trans = vec![
                attr_int("transA", i64::from(m.transpose_a)),
                attr_int("transB", i64::from(m.transpose_b)),
            ];
            if let Some((out, bias)) = self.bias_after(DataFormat::Nhwc) {
                let c = self.value(bias)?;
                self.finish_as(out, "Gemm", vec![a, b, c], trans);
            } else if m.transpose_a || m.transpose_b {
                self.finish("Gemm", vec![a, b], trans);
            } else {
                self.finish("MatMul", vec![a, b], vec![]);
            }
            return Ok(());
        }
        if let Some(f) = op.downcast_ref::<FusedMatMul>() {
            return self.fused_matmul(f, &inputs);
        }
        if let Some(m) = op.downcast_ref::<BatchMatMul>() {
            return self.batch_matmul(m, &inputs);
        }
        if let Some(c) = op.downcast_ref::<Conv2D>() {
            return self.conv(c, &inputs);
        }
        if let Some(p) = op.downcast_ref::<MaxPool>() {
            return self.pool(
                "MaxPool",
                p.ksize,
                p.strides,
                p.padding,
                p.data_format,
                inputs[0],
            );
        }
        if let Some(p) = op.downcast_ref::<AvgPool>() {
            return self.pool(
                "AveragePool",
                p.ksize,
                p.strides,
                p.padding,
                p.data_format,
                inputs[0],
            );
        }
        if let Some(bn) = op.downcast_ref::<BatchNorm>() {
            return self.batch_norm(bn, &inputs);
        }
        if let Some(ln) = op.downcast_ref::<LayerNorm>() {
            let args = inputs
                .iter()
                .map(|&p| self.value(p))
                .collect::<Result<Vec<_>>>()?;
            let attrs = vec![attr_int("axis", ln.axis), attr_float("epsilon", ln.epsilon)];
            return self.finish_to("LayerNormalization", args, attrs, ln.to);
        }
        if let Some(s) = op.downcast_ref::<Softmax>() {
            let x = self.value(inputs[0])?;
            self.finish("Softmax", vec![x], vec![attr_int("axis", s.axis)]);
            return Ok(());
        }
        if op.is::<SoftmaxCrossEntropy>() {
            // The mean over the rows of -log softmax(x)[label]: ONNX's default reduction.
            let (x, labels) = (self.value(inputs[0])?, self.value(inputs[1])?);
            let mean = vec![attr_string("reduction", "mean")];
            self.finish("SoftmaxCrossEntropyLoss", vec![x, labels], mean);
            return Ok(());
        }
        if let Some(s) = op.downcast_ref::<LogSoftmax>() {
            let x = self.value(inputs[0])?;
            self.finish("LogSoftmax", vec![x], vec![attr_int("axis", s.axis)]);
            return Ok(());
        }
        if let Some(r) = op.downcast_ref::<Reduce>() {
            return self.reduce(r, inputs[0]);
        }
        if let Some(r) = op.downcast_ref::<Reshape>() {
            let x = self.value(inputs[0])?;
            let entries = self.planned_shape(|sym, g| sym.reshape_shape(g, id), r.shape.clone())?;
            let shape = self.shape_value("shape", entries)?;
            // Our 0 is a dimension of 0, ONNX's copies the input's unless allowzero.
            let attrs = if r.shape.contains(&0) {
                vec![attr_int("allowzero", 1)]
            } else {
                vec![]
            };
            self.finish("Reshape", vec![x, shape], attrs);
            return Ok(());
        }
        if let Some(t) = op.downcast_ref::<Transpose>() {
            let x = self.value(inputs[0])?;
            self.finish(
                "Transpose",
                vec![x],
                vec![attr_ints("perm", t.perm.iter().map(|&p| p as i64))],
            );
            return Ok(());
        }
        if let Some(c) = op.downcast_ref::<Concat>() {
            let args = inputs
                .iter()
                .map(|&p| self.value(p))
                .collect::<Result<Vec<_>>>()?;
            self.finish("Concat", args, vec![attr_int("axis", c.axis)]);
            return Ok(());
        }
        if let Some(s) = op.downcast_ref::<Slice>() {
            let x = self.value(inputs[0])?;
            let out = &node.outputs()[0].shape;
            let fixed = |v: Vec<i64>| v.into_iter().map(Entry::Fixed).collect::<Vec<_>>();
            let (starts, ends) = match self.sym {
                Some(sym) => sym.slice_bounds(g, id).ok_or_else(|| {
                    self.err("bounds that follow a symbolic dim cannot be written")
                })?,
                None => {
                    let starts = i64s(&s.begin);
                    let ends = (starts.iter().zip(out))
                        .map(|(&b, &n)| b + n as i64)
                        .collect();
                    (fixed(starts), fixed(ends))
                }
            };
            let axes: Vec<i64> = (0..starts.len() as i64).collect();
            let starts = self.shape_value("starts", starts)?;
            let ends = self.shape_value("ends", ends)?;
            let axes = self.constant("axes", &i64_tensor(axes));
            self.finish("Slice", vec![x, starts, ends, axes], vec![]);
            return Ok(());
        }
        if let Some(b) = op.downcast_ref::<BroadcastTo>() {
            let x = self.value(inputs[0])?;
            let entries = self.planned_shape(|sym, g| sym.expand_shape(g, id), i64s(&b.shape))?;
            let shape = self.shape_value("shape", entries)?;
            self.finish("Expand", vec![x, shape], vec![]);
            return Ok(());
        }
        if let Some(gather) = op.downcast_ref::<Gather>() {
            let (x, i) = (self.value(inputs[0])?, self.value(inputs[1])?);
            self.finish("Gather", vec![x, i], vec![attr_int("axis", gather.axis)]);
            return Ok(());
        }
        if op.is::<Where>() || op.is::<Compare>() || op.is::<Logical>() || op.is::<Not>() {
            // Our names are ONNX's.
            let args = inputs
                .iter()
                .map(|&p| self.value(p))
                .collect::<Result<Vec<_>>>()?;
            self.finish(op.name(), args, vec![]);
            return Ok(());
        }
        if let Some(p) = op.downcast_ref::<Pad>() {
            return self.pad(p, inputs[0]);
        }
        if let Some(r) = op.downcast_ref::<Resize>() {
            let x = self.value(inputs[0])?;
            let entries = self.planned_shape(|sym, g| sym.resize_sizes(g, id), i64s(&r.shape))?;
            let sizes = self.shape_value("sizes", entries)?;
            let mut attrs = vec![attr_string(
                "coordinate_transformation_mode",
                r.coordinate_transformation_mode.name(),
            )];
            match r.mode {
                ResizeMode::Linear => attrs.push(attr_string("mode", "linear")),
                ResizeMode::Nearest(n) => {
                    attrs.push(attr_string("mode", "nearest"));
                    attrs.push(attr_string("nearest_mode", n.name()));
                }
            }
            self.finish(
                "Resize",
                vec![x, String::new(), String::new(), sizes],
                attrs,
            );
            return Ok(());
        }
        if let Some(c) = op.downcast_ref::<Conv2DBackpropInput>() {
            return self.conv_transpose(c, &inputs);
        }
        Err(self.err("this op has no ONNX form"))
    }

    fn pad(&mut self, p: &Pad, x: Port) -> Result<()> {
        let x = self.value(x)?;
        let pads: Vec<i64> = p
            .pads
            .iter()
            .map(|a| a[0])
            .chain(p.pads.iter().map(|a| a[1]))
            .collect();
        let pads = self.constant("pads", &i64_tensor(pads));
        let (mode, args) = match p.mode {
            PadMode::Constant(v) => {
                let dtype = self.g.node(self.current).outputs()[0].dtype;
                let value = self.constant("value", &Tensor::scalar(dtype, v));
                ("constant", vec![x, pads, value])
            }
            PadMode::Reflect => ("reflect", vec![x, pads]),
            PadMode::Edge => ("edge", vec![x, pads]),
        };
        self.finish("Pad", args, vec![attr_string("mode", mode)]);
        Ok(())
    }

    /// The current node computed by `op_type`, then cast to `to` when given (a
    /// widening folded into our op).
    fn finish_to(
        &mut self,
        op_type: &str,
        inputs: Vec<String>,
        attrs: Vec<AttributeProto>,
        to: Option<DType>,
    ) -> Result<()> {
        match to {
            None => self.finish(op_type, inputs, attrs),
            Some(to) => {
                let y = self.helper(op_type, inputs, attrs);
                self.finish(
                    "Cast",
                    vec![y],
                    vec![attr_int("to", i64::from(tensor::elem_type_of(to)))],
                );
            }
        }
        Ok(())
    }

    fn scalar(&mut self, dtype: DType, v: f64) -> String {
        self.constant("scalar", &Tensor::scalar(dtype, v))
    }

    fn unary(&mut self, kind: UnaryKind, x: String, ty: &TensorType) -> Result<()> {
        let dtype = ty.dtype;
        let simple = match kind {
            UnaryKind::Relu => "Relu",
            UnaryKind::Elu => "Elu",
            UnaryKind::Selu => "Selu",
            UnaryKind::Tanh => "Tanh",
            UnaryKind::Sigmoid => "Sigmoid",
            UnaryKind::HardSwish => "HardSwish",
            UnaryKind::Exp => "Exp",
            UnaryKind::Log => "Log",
            UnaryKind::Sqrt => "Sqrt",
            UnaryKind::Neg => "Neg",
            UnaryKind::Abs => "Abs",
            UnaryKind::Erf => "Erf",
            UnaryKind::Sin => "Sin",
            UnaryKind::Cos => "Cos",
            UnaryKind::Softplus => "Softplus",
            UnaryKind::Reciprocal => "Reciprocal",
            UnaryKind::Sign => "Sign",
            UnaryKind::Identity => "Identity",
            UnaryKind::LeakyRelu { alpha } => {
                self.finish("LeakyRelu", vec![x], vec![attr_float("alpha", alpha)]);
                return Ok(());
            }
            UnaryKind::HardSigmoid => {
                let attrs = vec![attr_float("alpha", 1.0 / 6.0), attr_float("beta", 0.5)];
                self.finish("HardSigmoid", vec![x], attrs);
                return Ok(());
            }
            UnaryKind::Relu6 => {
                let (lo, hi) = (self.scalar(dtype, 0.0), self.scalar(dtype, 6.0));
                self.finish("Clip", vec![x, lo, hi], vec![]);
                return Ok(());
            }
            UnaryKind::Log1p => {
                let one = self.scalar(dtype, 1.0);
                let s = self.helper("Add", vec![x, one], vec![]);
                self.finish("Log", vec![s], vec![]);
                return Ok(());
            }
            UnaryKind::Rsqrt => {
                let s = self.helper("Sqrt", vec![x], vec![]);
                self.finish("Reciprocal", vec![s], vec![]);
                return Ok(());
            }
            UnaryKind::Square => {
                self.finish("Mul", vec![x.clone(), x], vec![]);
                return Ok(());
            }
            UnaryKind::Gelu { approximate } => {
                // Gelu is an op from opset 20: written out, as exporters write it.
                let half = self.scalar(dtype, 0.5);
                let one = self.scalar(dtype, 1.0);
                let inner = if approximate {
                    let x2 = self.helper("Mul", vec![x.clone(), x.clone()], vec![]);
                    let x3 = self.helper("Mul", vec![x2, x.clone()], vec![]);
                    let k = self.scalar(dtype, 0.044715);
                    let kx3 = self.helper("Mul", vec![x3, k], vec![]);
                    let s = self.helper("Add", vec![x.clone(), kx3], vec![]);
                    let c = self.scalar(dtype, (2.0 / std::f64::consts::PI).sqrt());
                    let u = self.helper("Mul", vec![s, c], vec![]);
                    self.helper("Tanh", vec![u], vec![])
                } else {
                    let r = self.scalar(dtype, std::f64::consts::FRAC_1_SQRT_2);
                    let u = self.helper("Mul", vec![x.clone(), r], vec![]);
                    self.helper("Erf", vec![u], vec![])
                };
                let p = self.helper("Add", vec![inner, one], vec![]);
                let hx = self.helper("Mul", vec![x, half], vec![]);
                self.finish("Mul", vec![hx, p], vec![]);
                return Ok(());
            }
            #[allow(unreachable_patterns)]
            _ => return Err(self.err(format!("unary {} has no ONNX form", kind.name()))),
        };
        self.finish(simple, vec![x], vec![]);
        Ok(())
    }

    /// `act(a b + bias [+ residual])`, cast to `to`.
    fn fused_matmul(&mut self, f: &FusedMatMul, inputs: &[Port]) -> Result<()> {
        let (a, b, bias) = (
            self.value(inputs[0])?,
            self.value(inputs[1])?,
            self.value(inputs[2])?,
        );
        let attrs = vec![
            attr_int("transA", i64::from(f.product.transpose_a)),
            attr_int("transB", i64::from(f.product.transpose_b)),
        ];
        let mut y = self.helper("Gemm", vec![a, b, bias], attrs);
        if let Some(&r) = inputs.get(3) {
            let r = self.value(r)?;
            y = self.helper("Add", vec![y, r], vec![]);
        }
        let ty = self.g.node(self.current).outputs()[0].clone();
        match (f.epilogue.activation(), f.to) {
            (None, None) => self.finish("Identity", vec![y], vec![]),
            (Some(kind), None) => self.unary(kind, y, &ty)?,
            (act, Some(to)) => {
                if let Some(kind) = act {
                    let op = match kind {
                        UnaryKind::Relu => "Relu",
                        _ => return Err(self.err("a widened GELU epilogue has no ONNX form")),
                    };
                    y = self.helper(op, vec![y], vec![]);
                }
                self.finish(
                    "Cast",
                    vec![y],
                    vec![attr_int("to", i64::from(tensor::elem_type_of(to)))],
                );
            }
        }
        Ok(())
    }

    fn batch_matmul(&mut self, m: &BatchMatMul, inputs: &[Port]) -> Result<()> {
        let g = self.g;
        let mut args = Vec::with_capacity(2);
        for (i, (&p, adj)) in inputs.iter().zip([m.adj_x, m.adj_y]).enumerate() {
            let rank = g.ty(p).shape.len();
            let name = if adj {
                let mut perm: Vec<usize> = (0..rank).collect();
                perm.swap(rank - 2, rank - 1);
                let key = if i == 0 { "adj_x" } else { "adj_y" };
                let p2 = perm.clone();
                self.transformed(
                    p,
                    key,
                    move |t| {
                        Transpose::new(p2.clone())
                            .eval(&[t])
                            .map(|mut v| v.swap_remove(0))
                    },
                    "Transpose",
                    vec![],
                    vec![attr_ints("perm", perm.iter().map(|&v| v as i64))],
                )?
            } else {
                self.value(p)?
            };
            args.push(name);
        }
        if m.alpha == 1.0 {
            self.finish("MatMul", args, vec![]);
        } else {
            let y = self.helper("MatMul", args, vec![]);
            let dtype = self.g.node(self.current).outputs()[0].dtype;
            let alpha = self.scalar(dtype, m.alpha);
            self.finish("Mul", vec![y, alpha], vec![]);
        }
        Ok(())
    }

    /// ONNX `pads` ([top, left, bottom, right]) or `auto_pad` of our padding.
    fn pads_attr(padding: Padding) -> AttributeProto {
        match padding {
            Padding::Same => attr_string("auto_pad", "SAME_UPPER"),
            Padding::Valid => attr_ints("pads", [0, 0, 0, 0]),
            Padding::Explicit([[t, b], [l, r]]) => {
                attr_ints("pads", [t, l, b, r].map(|v| v as i64))
            }
        }
    }

    /// NHWC images go through ONNX's NCHW ops between two Transposes.
    fn nchw_value(&mut self, x: Port, format: DataFormat) -> Result<String> {
        let v = self.value(x)?;
        Ok(match format {
            DataFormat::Nchw => v,
            DataFormat::Nhwc => {
                self.helper("Transpose", vec![v], vec![attr_ints("perm", [0, 3, 1, 2])])
            }
        })
    }

    fn finish_image(
        &mut self,
        op_type: &str,
        inputs: Vec<String>,
        attrs: Vec<AttributeProto>,
        format: DataFormat,
    ) {
        self.finish_image_as(self.current.into(), op_type, inputs, attrs, format);
    }

    fn finish_image_as(
        &mut self,
        out: Port,
        op_type: &str,
        inputs: Vec<String>,
        attrs: Vec<AttributeProto>,
        format: DataFormat,
    ) {
        match format {
            DataFormat::Nchw => self.finish_as(out, op_type, inputs, attrs),
            DataFormat::Nhwc => {
                let y = self.helper(op_type, inputs, attrs);
                self.finish_as(
                    out,
                    "Transpose",
                    vec![y],
                    vec![attr_ints("perm", [0, 2, 3, 1])],
                );
            }
        }
    }

    /// An HWIO filter as ONNX's OIHW: a constant written transposed once, a computed
    /// one through a Transpose.
    fn oihw_filter(&mut self, w: Port) -> Result<String> {
        let perm = [3usize, 2, 0, 1];
        self.transformed(
            w,
            "oihw",
            |t| {
                Transpose::new(perm.to_vec())
                    .eval(&[t])
                    .map(|mut v| v.swap_remove(0))
            },
            "Transpose",
            vec![],
            vec![attr_ints("perm", perm.map(|v| v as i64))],
        )
    }

    fn conv(&mut self, c: &Conv2D, inputs: &[Port]) -> Result<()> {
        let x = self.nchw_value(inputs[0], c.data_format)?;
        let w = self.oihw_filter(inputs[1])?;
        let ws = &self.g.ty(inputs[1]).shape;
        let padding = match c.padding {
            // onnxruntime refuses auto_pad SAME with dilations: the pads it means.
            Padding::Same if c.dilations != [1, 1] => {
                let xs = &self.g.ty(inputs[0]).shape;
                let spatial = match c.data_format {
                    DataFormat::Nchw => [xs[2], xs[3]],
                    DataFormat::Nhwc => [xs[1], xs[2]],
                };
                let mut pads = [[0; 2]; 2];
                for (i, p) in pads.iter_mut().enumerate() {
                    let span = dilated_span(ws[i], c.dilations[i]);
                    let a = c
                        .padding
                        .output_len(i, spatial[i], span, c.strides[i])
                        .map_err(|m| self.err(m))?;
                    *p = [a.before, a.after];
                }
                Padding::Explicit(pads)
            }
            other => other,
        };
        let attrs = vec![
            attr_ints("kernel_shape", [ws[0] as i64, ws[1] as i64]),
            attr_ints("strides", c.strides.map(|s| s as i64)),
            attr_ints("dilations", c.dilations.map(|d| d as i64)),
            attr_int("group", c.groups as i64),
            Self::pads_attr(padding),
        ];
        let mut args = vec![x, w];
        let out = match self.bias_after(c.data_format) {
            Some((out, bias)) => {
                args.push(self.value(bias)?);
                out
            }
            None => self.current.into(),
        };
        self.finish_image_as(out, "Conv", args, attrs, c.data_format);
        Ok(())
    }

    /// Conv2DBackpropInput is ONNX's ConvTranspose of `dy` with the same OIHW filter;
    /// the padding of the convolution it undoes crops the full output, and what the
    /// convolution's windows did not reach is `output_padding`.
    fn conv_transpose(&mut self, b: &Conv2DBackpropInput, inputs: &[Port]) -> Result<()> {
        let (g, c) = (self.g, &b.conv);
        let dy = self.nchw_value(inputs[1], c.data_format)?;
        let w = self.oihw_filter(inputs[0])?;
        let ws = g.ty(inputs[0]).shape.clone();
        let dys = g.ty(inputs[1]).shape.clone();
        let spatial = |s: &[usize]| match c.data_format {
            DataFormat::Nchw => [s[2], s[3]],
            DataFormat::Nhwc => [s[1], s[2]],
        };
        let (xin, yin) = (spatial(&b.input_shape), spatial(&dys));
        let mut pads = [0i64; 4];
        let mut extra = [0i64; 2];
        for i in 0..2 {
            let span = dilated_span(ws[i], c.dilations[i]);
            let p = c
                .padding
                .output_len(i, xin[i], span, c.strides[i])
                .map_err(|m| self.err(m))?;
            pads[i] = p.before as i64;
            pads[i + 2] = p.after as i64;
            let full = c.strides[i] * (yin[i].max(1) - 1) + span;
            extra[i] = (xin[i] + p.before + p.after) as i64 - full as i64;
            if extra[i] < 0 {
                // The convolution's padding after the input was never read.
                pads[i + 2] += extra[i];
                extra[i] = 0;
            }
        }
        let attrs = vec![
            attr_ints("kernel_shape", [ws[0] as i64, ws[1] as i64]),
            attr_ints("strides", c.strides.map(|s| s as i64)),
            attr_ints("dilations", c.dilations.map(|d| d as i64)),
            attr_int("group", c.groups as i64),
            attr_ints("pads", pads),
            attr_ints("output_padding", extra),
        ];
        self.finish_image("ConvTranspose", vec![dy, w], attrs, c.data_format);
        Ok(())
    }

    fn pool(
        &mut self,
        op_type: &str,
        ksize: [usize; 2],
        strides: [usize; 2],
        padding: Padding,
        format: DataFormat,
        x: Port,
    ) -> Result<()> {
        let x = self.nchw_value(x, format)?;
        let attrs = vec![
            attr_ints("kernel_shape", ksize.map(|s| s as i64)),
            attr_ints("strides", strides.map(|s| s as i64)),
            Self::pads_attr(padding),
        ];
        self.finish_image(op_type, vec![x], attrs, format);
        Ok(())
    }

    fn batch_norm(&mut self, bn: &BatchNorm, inputs: &[Port]) -> Result<()> {
        if bn.training {
            return Err(self.err("training batch norm has no inference ONNX form"));
        }
        let id = self.current;
        if self.g.consumers(id).iter().any(|&(_, _, p)| p.index > 0)
            || self.g.outputs().iter().any(|p| p.node == id && p.index > 0)
        {
            return Err(self.err("its statistics outputs are read: not exported"));
        }
        let rank = self.g.ty(inputs[0]).shape.len();
        let format = if rank == 4 {
            bn.data_format
        } else {
            DataFormat::Nchw
        };
        let mut args = vec![self.nchw_value(inputs[0], format)?];
        for &p in &inputs[1..5] {
            args.push(self.value(p)?);
        }
        let attrs = vec![attr_float("epsilon", bn.epsilon)];
        // A side input is an Add after the normalisation, before the activation.
        let side = match inputs.get(5) {
            Some(&p) => Some(self.nchw_value(p, format)?),
            None => None,
        };
        match (bn.activation, side) {
            (NormActivation::Identity, None) => {
                self.finish_image("BatchNormalization", args, attrs, format)
            }
            (NormActivation::Identity, Some(side)) => {
                let y = self.helper("BatchNormalization", args, attrs);
                self.finish_image("Add", vec![y, side], vec![], format);
            }
            (NormActivation::Relu, side) => {
                let mut y = self.helper("BatchNormalization", args, attrs);
                if let Some(side) = side {
                    y = self.helper("Add", vec![y, side], vec![]);
                }
                self.finish_image("Relu", vec![y], vec![], format);
            }
        }
        Ok(())
    }

    fn reduce(&mut self, r: &Reduce, x: Port) -> Result<()> {
        let rank = self.g.ty(x).shape.len();
        let mut v = self.value(x)?;
        if let Some(to) = r.to {
            v = self.helper(
                "Cast",
                vec![v],
                vec![attr_int("to", i64::from(tensor::elem_type_of(to)))],
            );
        }
        // A mean or maximum over an image's spatial axes, kept: ONNX's global pools.
        let spatial: Vec<i64> = (2..rank as i64).collect();
        if rank >= 3 && r.keep_dims && r.to.is_none() && r.axes.as_deref() == Some(&spatial[..]) {
            let global = match r.kind {
                ReduceKind::Mean => Some("GlobalAveragePool"),
                ReduceKind::Max => Some("GlobalMaxPool"),
                ReduceKind::Sum => None,
            };
            if let Some(op_type) = global {
                self.finish(op_type, vec![v], vec![]);
                return Ok(());
            }
        }
        // No axes reduce them all, in ONNX as here.
        let axes: Option<Vec<i64>> = match &r.axes {
            None => None,
            Some(_) => Some(
                r.reduced_axes(rank)
                    .map_err(|m| self.err(m))?
                    .iter()
                    .map(|&a| a as i64)
                    .collect(),
            ),
        };
        let mut attrs = vec![attr_int("keepdims", i64::from(r.keep_dims))];
        let op_type = match r.kind {
            ReduceKind::Sum => {
                let mut args = vec![v];
                if let Some(axes) = axes {
                    args.push(self.constant("axes", &i64_tensor(axes)));
                }
                self.finish("ReduceSum", args, attrs);
                return Ok(());
            }
            ReduceKind::Mean => "ReduceMean",
            ReduceKind::Max => "ReduceMax",
        };
        attrs.extend(axes.map(|a| attr_ints("axes", a)));
        self.finish(op_type, vec![v], attrs);
        Ok(())
    }
}
