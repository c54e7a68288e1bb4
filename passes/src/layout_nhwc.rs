//! Channels-last layout (`layout-nhwc`): an NCHW network computes on NHWC tensors
//! inside, where cuDNN's Tensor Core kernels want them, with Transposes only where the
//! graph's own NCHW tensors come in or go out.
//!
//! Every NCHW op whose kernel takes the layout as an attribute (Conv2D and its two
//! gradients, the pools and their gradients, BatchNorm and BatchNormGrad on images,
//! BiasAdd on images) becomes its NHWC twin (`data_format: NHWC`, `input_shape` attrs
//! permuted; filters are HWIO in both layouts). Ops that compute the same in either
//! layout follow their neighbours: elementwise ops (Unary, UnaryGrad, Binary, BinaryGrad
//! and Cast whose operands are the image, an image broadcast into it (a
//! squeeze-excitation's `[N, C, 1, 1]` scale, permuted alike) or a single value, fused
//! programs of such ops), reductions of images (axes remapped: the global average pool's Mean over
//! `[2, 3]` becomes `[1, 2]`, a bias gradient's Sum over `[0, 2, 3]` becomes `[0, 1, 2]`),
//! their gradients, Concat of images (axis 1 becomes 3) and Slice of images (Concat's
//! gradient; begin and size permuted).
//!
//! The pass decides one layout per node rather than inserting Transposes around every
//! op and sinking them: the NCHW-only ops are NHWC; a layout-agnostic op starts NHWC
//! when one of its images comes NHWC or it reads none (in topological order, so the
//! backward pass follows the forward one), and then flips wherever that needs fewer
//! Transposes, until none does. A graph without NCHW-only ops is left as it is. A Transpose goes on each tensor whose producer and some reader disagree
//! (one per tensor, shared by its readers): after graph inputs (Placeholders, Variables,
//! Constants), before graph outputs and before every other op that reads an image
//! (Reshape, BroadcastTo, a broadcast against a `[C, 1, 1]` operand). A converted
//! node that is a graph output keeps its name by becoming the Transpose back of a new
//! node `<name>/nhwc`; a node with several outputs cannot, so a BatchNorm (or fused
//! program) whose image output is a graph output stays NCHW. Last, the Transposes are
//! cancelled against the graph's own with `algebraic`'s Transpose sweep (chains merged,
//! identity permutations bypassed) and those left unread are removed.

use std::collections::BTreeMap;

use ampgraph_graph::graph::Adjacency;
use ampgraph_graph::ops::fused::Instr;
use ampgraph_graph::ops::{
    AvgPool, AvgPoolGrad, BatchNorm, BatchNormGrad, BiasAdd, Binary, BinaryGrad, Cast, Concat,
    Conv2D, Conv2DBackpropFilter, Conv2DBackpropInput, DataFormat, ElementOp, FusedElementwise,
    MaxPool, MaxPoolGrad, Reduce, ReduceGrad, Slice, SumTo, Transpose, Unary, UnaryGrad,
};
use ampgraph_graph::{Graph, NodeId, Op, Port, TensorType};
use foldhash::{HashMap, HashSet};

use crate::rewrite::{output_nodes, remove_unread, summary};
use crate::simplify::algebraic::{self, Identities};
use crate::{Pass, PassError, PassSummary};

/// The Transpose permutation from NCHW to NHWC.
pub const TO_NHWC: [usize; 4] = [0, 2, 3, 1];
/// The Transpose permutation from NHWC to NCHW; also the NHWC axis of each NCHW axis.
pub const TO_NCHW: [usize; 4] = [0, 3, 1, 2];

/// The `layout-nhwc` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayoutNhwc {
    /// Leave graphs NCHW unless a convolution in them is 16-bit: on the H100, cuDNN's
    /// f32 NHWC convolution gradients took about 40 times its NCHW ones (the registry's
    /// `layout-nhwc`, in the CUDA pipeline, is this form).
    pub sixteen_bit_only: bool,
}

impl LayoutNhwc {
    /// Every NCHW graph runs NHWC.
    pub const EVERY_GRAPH: LayoutNhwc = LayoutNhwc {
        sixteen_bit_only: false,
    };
    /// Graphs with a 16-bit convolution run NHWC (Tensor Cores read channels last).
    pub const SIXTEEN_BIT: LayoutNhwc = LayoutNhwc {
        sixteen_bit_only: true,
    };

    fn has_16_bit_convolution(g: &Graph) -> bool {
        g.node_ids().any(|id| {
            let n = g.node(id);
            (n.op.is::<Conv2D>()
                || n.op.is::<Conv2DBackpropInput>()
                || n.op.is::<Conv2DBackpropFilter>())
                && n.outputs().first().is_some_and(|t| t.dtype.is_half())
        })
    }
}

/// An op whose kernel reads and writes images in its `data_format`.
trait LayoutSensitive: Op + Clone {
    /// The input slots and the outputs that are images.
    const IMAGES: (&'static [usize], &'static [usize]);

    fn data_format(&mut self) -> &mut DataFormat;

    /// Permutes the attrs that hold an NCHW shape.
    fn permute_shape_attrs(&mut self) {}
}

macro_rules! layout_sensitive {
    ($($ty:ty { $($format:ident).+ }: $inputs:expr => $outputs:expr $(, $shape:ident)?;)*) => {
        $(
            impl LayoutSensitive for $ty {
                const IMAGES: (&'static [usize], &'static [usize]) = (&$inputs, &$outputs);

                fn data_format(&mut self) -> &mut DataFormat {
                    &mut self.$($format).+
                }

                $(
                    fn permute_shape_attrs(&mut self) {
                        self.$shape = nhwc_order(&self.$shape);
                    }
                )?
            }
        )*
    };
}

layout_sensitive! {
    Conv2D { data_format }: [0] => [0];
    Conv2DBackpropInput { conv.data_format }: [1] => [0], input_shape;
    // The filter and its gradient are HWIO in both layouts.
    Conv2DBackpropFilter { conv.data_format }: [0, 1] => [];
    MaxPool { data_format }: [0] => [0];
    AvgPool { data_format }: [0] => [0];
    MaxPoolGrad { data_format }: [0, 1, 2] => [0];
    AvgPoolGrad { data_format }: [0] => [0], input_shape;
    // Slot 5: the side input, where there is one.
    BatchNorm { data_format }: [0, 5] => [0];
    BatchNormGrad { data_format }: [0, 4] => [0];
    BiasAdd { data_format }: [0] => [0];
}

/// How a node computes on NHWC images.
struct NhwcForm {
    /// Input slots that read images.
    inputs: Vec<usize>,
    /// Outputs that are images.
    outputs: Vec<usize>,
    op: Box<dyn Op>,
    /// An NCHW-only op: always converted. The others follow their neighbours.
    sensitive: bool,
}

/// Per-axis values of an NCHW tensor (its shape, a slice's begin) in NHWC order.
fn nhwc_order<T: Copy>(nchw: &[T]) -> Vec<T> {
    TO_NHWC.iter().map(|&a| nchw[a]).collect()
}

/// A rank-4 tensor whose NHWC transpose differs from it. `[N, 1, 1, 1]` is the same
/// tensor in both layouts, and needs no Transpose.
fn is_image(ty: &TensorType) -> bool {
    ty.rank() == 4 && ty.shape[1..].iter().any(|&d| d != 1)
}

/// A tensor that broadcasts against an image the same way in both layouts: a single
/// value, or one per image of the batch (`[N, 1, 1, 1]`).
fn layout_free(ty: &TensorType) -> bool {
    let per_image = ty.rank() == 4 && !is_image(ty);
    per_image || ty.shape.iter().all(|&d| d == 1)
}

/// An image `ty` broadcast into the image `out` (a squeeze-excitation's `[N, C, 1, 1]`
/// scale, a `[1, C, 1, 1]` constant): it broadcasts the same way once both are
/// permuted alike, so it follows the op's layout.
fn broadcast_image(ty: &TensorType, out: &TensorType) -> bool {
    is_image(ty)
        && out.rank() == 4
        && ty
            .shape
            .iter()
            .zip(&out.shape)
            .all(|(&d, &o)| d == o || d == 1)
}

/// The NHWC form of an NCHW-only op of type `T`.
fn sensitive<T: LayoutSensitive>(op: &dyn Op) -> Option<NhwcForm> {
    let mut twin = op.downcast_ref::<T>()?.clone();
    if *twin.data_format() != DataFormat::Nchw {
        return None;
    }
    *twin.data_format() = DataFormat::Nhwc;
    twin.permute_shape_attrs();
    let (inputs, outputs) = T::IMAGES;
    Some(NhwcForm {
        inputs: inputs.to_vec(),
        outputs: outputs.to_vec(),
        op: Box::new(twin),
        sensitive: true,
    })
}

/// The NCHW-only ops' forms.
const SENSITIVE: [fn(&dyn Op) -> Option<NhwcForm>; 10] = [
    sensitive::<Conv2D>,
    sensitive::<Conv2DBackpropInput>,
    sensitive::<Conv2DBackpropFilter>,
    sensitive::<MaxPool>,
    sensitive::<AvgPool>,
    sensitive::<MaxPoolGrad>,
    sensitive::<AvgPoolGrad>,
    sensitive::<BatchNorm>,
    sensitive::<BatchNormGrad>,
    sensitive::<BiasAdd>,
];

/// `op` on NHWC images, if the node can compute there.
fn nhwc_form(op: &dyn Op, inputs: &[&TensorType], outputs: &[TensorType]) -> Option<NhwcForm> {
    let mut form = match SENSITIVE.iter().find_map(|form| form(op)) {
        // BatchNorm and BiasAdd also take rank-2 `[N, C]` tensors, the same in both
        // layouts.
        Some(f)
            if !f
                .inputs
                .iter()
                .all(|&s| inputs.get(s).is_none_or(|t| t.rank() == 4)) =>
        {
            return None
        }
        Some(f) => f,
        None => agnostic_form(op, inputs, outputs)?,
    };
    form.inputs
        .retain(|&s| inputs.get(s).is_some_and(|t| is_image(t)));
    form.outputs.retain(|&k| is_image(&outputs[k]));
    // An NCHW-only op converts whatever its shapes; an agnostic one without images has
    // no layout.
    let has_images = !form.inputs.is_empty() || !form.outputs.is_empty();
    (form.sensitive || has_images).then_some(form)
}

/// A layout-agnostic op on NHWC images.
fn agnostic_form(op: &dyn Op, inputs: &[&TensorType], outputs: &[TensorType]) -> Option<NhwcForm> {
    let form = |inputs: Vec<usize>, outputs: Vec<usize>, op: Box<dyn Op>| NhwcForm {
        inputs,
        outputs,
        op,
        sensitive: false,
    };
    let first = inputs.first()?;
    let elementwise = op.is::<Unary>()
        || op.is::<UnaryGrad>()
        || op.is::<Binary>()
        || op.is::<BinaryGrad>()
        || op.is::<Cast>();
    if elementwise {
        let out = outputs.first().filter(|t| is_image(t))?;
        let mut images = Vec::new();
        for (slot, ty) in inputs.iter().enumerate() {
            if ty.shape == out.shape || broadcast_image(ty, out) {
                images.push(slot);
            } else if !layout_free(ty) {
                return None;
            }
        }
        return Some(form(images, vec![0], op.clone_op()));
    }
    if let Some(r) = op.downcast_ref::<Reduce>() {
        let (axes, image_out) = nhwc_reduction(r, first)?;
        let twin = Reduce { axes, ..r.clone() };
        let outs = if image_out { vec![0] } else { vec![] };
        return Some(form(vec![0], outs, Box::new(twin)));
    }
    if let Some(r) = op.downcast_ref::<ReduceGrad>() {
        let forward = Reduce::new(r.kind, r.axes.clone(), r.keep_dims);
        let (axes, image_dy) = nhwc_reduction(&forward, first)?;
        let twin = ReduceGrad::new(r.kind, axes, r.keep_dims);
        let ins = if image_dy { vec![0, 1] } else { vec![0] };
        return Some(form(ins, vec![0], Box::new(twin)));
    }
    if let Some(s) = op.downcast_ref::<SumTo>() {
        if !is_image(first) {
            return None;
        }
        // A sum to a single value reads the image in any order.
        if s.shape.iter().all(|&d| d == 1) {
            return Some(form(vec![0], vec![], op.clone_op()));
        }
        // A sum to an image's rank (a per-channel `[1, C, 1, 1]`: the gradient of a
        // broadcast vector) is the same sum of the NHWC image to the NHWC shape: the
        // image is not transposed back for it, only the small result.
        let image_rank = s.shape.len() == 4;
        return image_rank.then(|| {
            let twin = SumTo {
                shape: nhwc_order(&s.shape),
            };
            form(vec![0], vec![0], Box::new(twin))
        });
    }
    if let Some(s) = op.downcast_ref::<Slice>() {
        if !is_image(first) || s.begin.len() != 4 || s.size.len() != 4 {
            return None;
        }
        let twin = Slice::new(nhwc_order(&s.begin), nhwc_order(&s.size));
        return Some(form(vec![0], vec![0], Box::new(twin)));
    }
    if let Some(c) = op.downcast_ref::<Concat>() {
        if !inputs.iter().all(|t| t.rank() == 4) {
            return None;
        }
        let axis = ampgraph_graph::shape::normalize_axis(c.axis, 4).ok()?;
        let twin = Concat::new(TO_NCHW[axis] as i64);
        return Some(form((0..inputs.len()).collect(), vec![0], Box::new(twin)));
    }
    let fused = op.downcast_ref::<FusedElementwise>()?;
    let twin = nhwc_program(fused)?;
    let all = |n: usize| (0..n).collect();
    Some(form(all(inputs.len()), all(outputs.len()), Box::new(twin)))
}

/// The NHWC axes of a reduction of an NCHW image `x`, and whether its result is an
/// image (`keep_dims`). Without `keep_dims` the axes kept must stay in their order
/// (N and C, or H and W): the result is then the same tensor in both layouts.
fn nhwc_reduction(r: &Reduce, x: &TensorType) -> Option<(Option<Vec<i64>>, bool)> {
    if !is_image(x) {
        return None;
    }
    let reduced = r.reduced_axes(4).ok()?;
    if !r.keep_dims {
        let kept: Vec<usize> = (0..4)
            .filter(|a| !reduced.contains(a))
            .map(|a| TO_NCHW[a])
            .collect();
        if !kept.windows(2).all(|w| w[0] < w[1]) {
            return None;
        }
    }
    let axes = r.axes.as_ref().map(|_| {
        let mut axes: Vec<i64> = reduced.iter().map(|&a| TO_NCHW[a] as i64).collect();
        axes.sort_unstable();
        axes
    });
    Some((axes, r.keep_dims))
}

/// A fused program of image-shaped values (and single values or images broadcast into
/// them) on NHWC images: every image type permuted. Programs with column sums (over every axis
/// but the last, the channel axis only in NHWC) or BiasAdds (a channel axis of their
/// own) are not layout-agnostic; those with amaxes (which FP8 gives programs after
/// the layout pass) are left as they are.
fn nhwc_program(fused: &FusedElementwise) -> Option<FusedElementwise> {
    if !fused.column_sums().is_empty() || !fused.amaxes().is_empty() {
        return None;
    }
    let domain = &fused.instrs()[*fused.outputs().first()?].ty;
    if !is_image(domain) {
        return None;
    }
    let instrs = fused
        .instrs()
        .iter()
        .map(|ins| {
            let bias_add = matches!(
                ins.expr,
                ampgraph_graph::ops::fused::Expr::Apply(ElementOp::BiasAdd(_), _)
            );
            if bias_add {
                None
            } else if ins.ty.shape == domain.shape || broadcast_image(&ins.ty, domain) {
                let ty = TensorType::new(ins.ty.dtype, nhwc_order(&ins.ty.shape));
                Some(Instr {
                    expr: ins.expr.clone(),
                    ty,
                })
            } else {
                layout_free(&ins.ty).then(|| ins.clone())
            }
        })
        .collect::<Option<Vec<_>>>()?;
    FusedElementwise::new(instrs, fused.outputs().to_vec()).ok()
}

/// Which nodes compute on NHWC images.
struct Plan<'a> {
    adj: &'a Adjacency,
    forms: Vec<Option<NhwcForm>>,
    nhwc: Vec<bool>,
    graph_outputs: HashSet<Port>,
}

impl Plan<'_> {
    fn form(&self, id: NodeId) -> Option<&NhwcForm> {
        self.forms[id.index()].as_ref()
    }

    /// Whether the tensor at `p` is an NHWC image.
    fn is_nhwc(&self, p: Port) -> bool {
        self.nhwc[p.node.index()]
            && self
                .form(p.node)
                .is_some_and(|f| f.outputs.contains(&p.index))
    }

    /// Whether input `slot` of `reader` wants an NHWC image.
    fn wants_nhwc(&self, reader: NodeId, slot: usize) -> bool {
        self.nhwc[reader.index()] && self.form(reader).is_some_and(|f| f.inputs.contains(&slot))
    }

    /// The Transposes the tensor at `p` needs (0 or 1): one where some reader (a graph
    /// output reads NCHW) wants the other layout.
    fn transposes(&self, p: Port) -> usize {
        let produced = self.is_nhwc(p);
        let mismatch = self
            .adj
            .port_consumers(p)
            .any(|(reader, slot)| self.wants_nhwc(reader, slot) != produced)
            || (produced && self.graph_outputs.contains(&p));
        usize::from(mismatch)
    }

    /// The images `id` reads and writes.
    fn images_of(&self, id: NodeId) -> Vec<Port> {
        let Some(form) = self.form(id) else {
            return Vec::new();
        };
        let inputs = self.adj.inputs(id);
        let mut ports: Vec<Port> = form.inputs.iter().map(|&s| inputs[s]).collect();
        ports.extend(form.outputs.iter().map(|&k| Port::new(id, k)));
        ports.sort_unstable();
        ports.dedup();
        ports
    }

    /// Flips `id` to the other layout if that needs fewer Transposes around it.
    fn improve(&mut self, id: NodeId) -> bool {
        let ports = self.images_of(id);
        let cost = |plan: &Self| ports.iter().map(|&p| plan.transposes(p)).sum::<usize>();
        let before = cost(self);
        self.nhwc[id.index()] ^= true;
        if cost(self) < before {
            return true;
        }
        self.nhwc[id.index()] ^= true;
        false
    }
}

/// What the rewrite did, for the summary.
#[derive(Default)]
struct Counts {
    /// NCHW-only ops rewritten to NHWC, by op name.
    sensitive: BTreeMap<&'static str, usize>,
    agnostic: usize,
    inserted: usize,
    /// NCHW-only nodes kept because an image output of theirs is a graph output.
    pinned: usize,
}

impl Pass for LayoutNhwc {
    fn name(&self) -> &'static str {
        if self.sixteen_bit_only {
            "layout-nhwc"
        } else {
            "layout-nhwc-all"
        }
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        if self.sixteen_bit_only && !Self::has_16_bit_convolution(g) {
            let line = "layout-nhwc: no 16-bit convolution; the graph stays as it is".to_string();
            return Ok(summary(self.name(), vec![line]));
        }
        let mut counts = Counts::default();
        let adj = g.adjacency();
        let order = g.topo_order_in(&adj)?;
        let plan = plan(g, &adj, &order, &mut counts);
        let converted: Vec<NodeId> = order
            .iter()
            .copied()
            .filter(|id| plan.nhwc[id.index()])
            .collect();
        let mut cancelled = 0;
        if !converted.is_empty() {
            counts.inserted = rewrite(g, &plan, &order, &converted)?;
            for &id in &converted {
                let form = plan.form(id).expect("converted nodes have a form");
                if form.sensitive {
                    *counts.sensitive.entry(form.op.name()).or_default() += 1;
                } else {
                    counts.agnostic += 1;
                }
            }
            cancelled = cancel_transposes(g)?;
        }
        let rewritten: usize = counts.sensitive.values().sum();
        let by_op: Vec<String> = counts
            .sensitive
            .iter()
            .map(|(op, n)| format!("{op} {n}"))
            .collect();
        let lines = vec![
            format!(
                "layout-nhwc: rewrote {rewritten} NCHW ops to NHWC{}{}",
                if by_op.is_empty() { "" } else { ": " },
                by_op.join(", ")
            ),
            format!(
                "layout-nhwc: {} layout-agnostic ops compute on NHWC images",
                counts.agnostic
            ),
            format!(
                "layout-nhwc: added {} Transposes, removed {cancelled} that cancelled",
                counts.inserted
            ),
            format!(
                "layout-nhwc: kept {} NCHW ops whose image output is a graph output of a node with several outputs",
                counts.pinned
            ),
        ];
        Ok(summary(self.name(), lines))
    }
}

/// Decides which nodes compute on NHWC images.
fn plan<'a>(g: &Graph, adj: &'a Adjacency, order: &[NodeId], counts: &mut Counts) -> Plan<'a> {
    let graph_outputs: HashSet<Port> = g.outputs().iter().copied().collect();
    let mut forms: Vec<Option<NhwcForm>> = (0..g.node_bound()).map(|_| None).collect();
    for &id in order {
        let node = g.node(id);
        let inputs: Vec<&TensorType> = adj.inputs(id).iter().map(|&p| g.ty(p)).collect();
        let Some(form) = nhwc_form(node.op.as_ref(), &inputs, node.outputs()) else {
            continue;
        };
        // A converted graph output becomes the Transpose back of its new node, which
        // only a node of one output can.
        let pinned = node.outputs().len() > 1
            && form
                .outputs
                .iter()
                .any(|&k| graph_outputs.contains(&Port::new(id, k)));
        if pinned {
            counts.pinned += usize::from(form.sensitive);
            continue;
        }
        forms[id.index()] = Some(form);
    }
    let nhwc = forms
        .iter()
        .map(|f| f.as_ref().is_some_and(|f| f.sensitive))
        .collect();
    let mut plan = Plan {
        adj,
        forms,
        nhwc,
        graph_outputs,
    };
    let agnostic: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|&id| plan.form(id).is_some_and(|f| !f.sensitive))
        .collect();
    // Nothing to convert: no layout-agnostic op moves on its own.
    if !plan.nhwc.contains(&true) {
        return plan;
    }
    // Start from the images flowing out of the NCHW-only ops, forward and (in a
    // training graph) through the gradients that follow them. An op without images to
    // read (a Concat of `[N, 1, 1, 1]` tensors) costs nothing upstream either way.
    for &id in &agnostic {
        let inputs = adj.inputs(id);
        let starts_nhwc = plan.form(id).is_some_and(|f| {
            f.inputs.is_empty() || f.inputs.iter().any(|&s| plan.is_nhwc(inputs[s]))
        });
        plan.nhwc[id.index()] = starts_nhwc;
    }
    // Each flip removes a Transpose, so this ends.
    loop {
        let mut flipped = false;
        for &id in &agnostic {
            flipped |= plan.improve(id);
        }
        if !flipped {
            return plan;
        }
    }
}

/// Rewrites the converted nodes to their NHWC forms and puts a Transpose on each
/// tensor whose producer and readers disagree; `order` lists every node the plan
/// covers. Returns how many Transposes it added.
fn rewrite(
    g: &mut Graph,
    plan: &Plan,
    order: &[NodeId],
    converted: &[NodeId],
) -> Result<usize, PassError> {
    let adj = plan.adj;
    // Where the NHWC computation of each converted node runs: the node itself, or for a
    // graph output a new node whose Transpose back the old one becomes. The new nodes
    // go in first, while every type they are checked against is still the original.
    let mut compute: HashMap<NodeId, NodeId> = HashMap::default();
    for &id in converted {
        let form = plan.form(id).expect("converted nodes have a form");
        let moved = form
            .outputs
            .iter()
            .any(|&k| plan.graph_outputs.contains(&Port::new(id, k)));
        let at = if moved {
            let node = g.node(id);
            let name = g.fresh_name(format!("{}/nhwc", node.name));
            let op = node.op.clone();
            g.add_node(name, op, adj.inputs(id))?
        } else {
            id
        };
        compute.insert(id, at);
    }
    // Types are stale from here on (a Transpose of any rank-4 tensor type-checks);
    // they are inferred again once everything is rewired.
    let mut inserted = 0;
    for &id in converted {
        let at = compute[&id];
        if at != id {
            g.set_node(id, Box::new(Transpose::new(TO_NCHW)), &[at.into()])?;
            inserted += 1;
        }
        let form = plan.form(id).expect("converted nodes have a form");
        g.set_op(at, form.op.clone());
    }
    let nhwc_at = |p: Port| Port::new(compute[&p.node], p.index);
    // One Transpose per tensor, shared by its readers.
    let mut transposed: HashMap<Port, Port> = HashMap::default();
    let mut changes = Vec::new();
    for &id in order {
        let reader = compute.get(&id).copied().unwrap_or(id);
        for (slot, &p) in adj.inputs(id).iter().enumerate() {
            let target = match (plan.is_nhwc(p), plan.wants_nhwc(id, slot)) {
                (true, true) => nhwc_at(p),
                (false, false) => p,
                // A moved node's old self is its Transpose back.
                (true, false) if compute[&p.node] != p.node => p,
                (produced, _) => {
                    let (source, perm, layout) = if produced {
                        (nhwc_at(p), TO_NCHW, "nchw")
                    } else {
                        (p, TO_NHWC, "nhwc")
                    };
                    match transposed.get(&source) {
                        Some(&t) => t,
                        None => {
                            let stem = format!("{}/to_{layout}", g.node(source.node).name);
                            let t = g.add_node(
                                g.fresh_name(stem),
                                Box::new(Transpose::new(perm)),
                                &[source],
                            )?;
                            inserted += 1;
                            transposed.insert(source, t.into());
                            t.into()
                        }
                    }
                }
            };
            // A moved node reads anew what its old self read.
            if target != p || reader != id {
                changes.push((reader, slot, target));
            }
        }
    }
    g.rewire(changes)?;
    g.infer_types()?;
    Ok(inserted)
}

/// Merges chained Transposes and bypasses identity ones (`algebraic`'s Transpose
/// sweep), then removes the Transposes left unread; returns how many went.
fn cancel_transposes(g: &mut Graph) -> Result<usize, PassError> {
    let transposes = |g: &Graph| -> Vec<NodeId> {
        g.node_ids()
            .filter(|&id| g.node(id).op.is::<Transpose>())
            .collect()
    };
    // Only those the sweep leaves unread go: dead ones before it are `dce`'s.
    let read: Vec<NodeId> = transposes(g)
        .into_iter()
        .filter(|&id| !g.consumers(id).is_empty())
        .collect();
    let before = transposes(g).len();
    algebraic::simplify(g, Identities::Transposes)?;
    let is_output = output_nodes(g);
    let live: HashSet<NodeId> = g.node_ids().collect();
    let unread = read.into_iter().filter(|id| live.contains(id)).collect();
    remove_unread(g, unread, &is_output)?;
    Ok(before - transposes(g).len())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use ampgraph_graph::attrs::AttrValue;
    use ampgraph_graph::autodiff::gradients;
    use ampgraph_graph::format::{to_json, GraphDef};
    use ampgraph_graph::ops::{NormActivation, Padding};
    use ampgraph_graph::{DType, Tensor};

    use super::*;
    use crate::fuse::Fuse;
    use crate::testing::{count, run};

    fn tensor(shape: &[usize], seed: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|i| (i as f64 * 0.73 + seed).sin()).collect();
        Tensor::from_f64(DType::F32, shape, &v).unwrap()
    }

    fn shape(g: &Graph, p: Port) -> Vec<usize> {
        g.ty(p).shape.clone()
    }

    /// Values for every Placeholder, by name.
    fn feeds(g: &Graph) -> HashMap<&str, Tensor> {
        g.node_ids()
            .map(|id| g.node(id))
            .filter(|n| n.op.is::<ampgraph_graph::ops::Placeholder>())
            .map(|n| {
                (
                    n.name.as_str(),
                    tensor(&n.outputs()[0].shape, n.name.len() as f64),
                )
            })
            .collect()
    }

    /// An NCHW convolution of `x` with a constant `k`x`k` filter.
    fn conv(g: &mut Graph, x: Port, cout: usize, k: usize, stride: usize, pad: Padding) -> Port {
        let cin = shape(g, x)[1];
        let w = g.constant(tensor(&[k, k, cin, cout], cout as f64)).unwrap();
        g.conv2d(x, w, [stride; 2], pad, DataFormat::Nchw).unwrap()
    }

    /// An NCHW BatchNorm of `x` with constant parameters.
    fn batch_norm(g: &mut Graph, x: Port, training: bool) -> Port {
        let c = shape(g, x)[1];
        let params: Vec<Port> = (0..4)
            .map(|i| {
                let v: Vec<f64> = (0..c).map(|j| 1.0 + 0.1 * (i * c + j) as f64).collect();
                g.constant(Tensor::from_f64(DType::F32, [c], &v).unwrap())
                    .unwrap()
            })
            .collect();
        let bn = BatchNorm {
            epsilon: 1e-3,
            training,
            data_format: DataFormat::Nchw,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        };
        g.add(bn, &[x, params[0], params[1], params[2], params[3]])
            .unwrap()
    }

    fn json(g: &Graph) -> String {
        to_json(&GraphDef::from_graph(g))
    }

    /// The pass on a copy of `g`: valid, the same outputs (names, types, values within
    /// the CPU's summation order), and a second run changes nothing.
    fn layout(g: &Graph) -> (Graph, PassSummary) {
        let mut out = g.clone();
        let summary = LayoutNhwc::EVERY_GRAPH.run(&mut out).unwrap();
        out.validate().unwrap();
        let names =
            |g: &Graph| -> Vec<String> { g.outputs().iter().map(|&p| g.port_name(p)).collect() };
        assert_eq!(names(g), names(&out));
        let f = feeds(g);
        for (want, got) in run(g, &f).iter().zip(run(&out, &f)) {
            assert_eq!(want.ty(), got.ty());
            for (a, b) in want.to_f64_vec().iter().zip(got.to_f64_vec()) {
                assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
            }
        }
        let mut again = out.clone();
        LayoutNhwc::EVERY_GRAPH.run(&mut again).unwrap();
        assert_eq!(json(&out), json(&again), "a second run changed the graph");
        (out, summary)
    }

    /// Nodes still running an NCHW op.
    fn nchw_ops(g: &Graph) -> Vec<String> {
        let nchw = AttrValue::from(DataFormat::Nchw);
        g.node_ids()
            .filter(|&id| g.node(id).op.attrs().iter().any(|(_, v)| *v == nchw))
            .map(|id| g.node(id).name.clone())
            .collect()
    }

    /// Each Transpose as (its input's node name, its perm).
    fn transposes(g: &Graph) -> Vec<(String, Vec<usize>)> {
        let mut t: Vec<_> = g
            .node_ids()
            .filter_map(|id| {
                let perm = g.node(id).op.downcast_ref::<Transpose>()?.perm.clone();
                Some((g.node(g.inputs(id)[0].node).name.clone(), perm))
            })
            .collect();
        t.sort();
        t
    }

    #[test]
    fn a_conv_bn_relu_conv_chain_ends_with_one_transpose_in_and_one_out() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 7, 5]).unwrap();
        let y = conv(&mut g, x, 4, 3, 1, Padding::Same);
        let y = batch_norm(&mut g, y, false);
        let y = g.relu(y).unwrap();
        let y = conv(&mut g, y, 6, 1, 2, Padding::Valid);
        g.set_outputs(vec![y]).unwrap();
        let out_name = g.port_name(y);

        let (after, summary) = layout(&g);
        assert_eq!(
            summary.lines,
            [
                "layout-nhwc: rewrote 3 NCHW ops to NHWC: BatchNorm 1, Conv2D 2",
                "layout-nhwc: 1 layout-agnostic ops compute on NHWC images",
                "layout-nhwc: added 2 Transposes, removed 0 that cancelled",
                "layout-nhwc: kept 0 NCHW ops whose image output is a graph output of a node with several outputs",
            ]
        );
        assert!(nchw_ops(&after).is_empty(), "{:?}", nchw_ops(&after));
        let conv_out = format!("{out_name}/nhwc");
        assert_eq!(
            transposes(&after),
            [
                (conv_out.clone(), TO_NCHW.to_vec()),
                ("x".into(), TO_NHWC.to_vec())
            ]
        );
        // The output keeps its name as the Transpose back of the NHWC convolution.
        let out = after.outputs()[0];
        assert!(after.node(out.node).op.is::<Transpose>());
        assert_eq!(shape(&after, after.inputs(out.node)[0]), [2, 4, 3, 6]);
        assert_eq!(
            after.node(after.find(&conv_out).unwrap()).op_name(),
            "Conv2D"
        );
    }

    #[test]
    fn consecutive_fetched_images_each_become_a_transpose_back() {
        // One channel: the fetched ReLU's NCHW shape read as NHWC would be 1 high.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [1, 5, 5, 7]).unwrap();
        let y = conv(&mut g, x, 1, 3, 1, Padding::Same);
        let relu = g.relu(y).unwrap();
        let pool = g
            .max_pool(relu, [2, 2], [2, 2], Padding::Valid, DataFormat::Nchw)
            .unwrap();
        let z = conv(&mut g, pool, 2, 1, 1, Padding::Same);
        let z = g.mean(z, Some(&[2, 3]), false).unwrap();
        g.set_outputs(vec![z, relu, pool]).unwrap();

        let (after, _) = layout(&g);
        assert!(nchw_ops(&after).is_empty());
        assert_eq!(
            transposes(&after),
            [
                ("maxpool/nhwc".into(), TO_NCHW.to_vec()),
                ("relu/nhwc".into(), TO_NCHW.to_vec()),
                ("x".into(), TO_NHWC.to_vec()),
            ]
        );
    }

    #[test]
    fn an_op_between_an_nhwc_image_and_nchw_ones_takes_the_cheaper_layout() {
        // The sum of a convolution and a fed NCHW tensor, fetched: in NHWC it needs the
        // fed tensor in and the sum out, in NCHW only the convolution's output out.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 5, 5]).unwrap();
        let y = conv(&mut g, x, 4, 3, 1, Padding::Same);
        let residual = g.placeholder("residual", DType::F32, [2, 4, 5, 5]).unwrap();
        let sum = g.plus(y, residual).unwrap();
        g.set_outputs(vec![sum]).unwrap();

        let (after, summary) = layout(&g);
        assert_eq!(
            summary.lines[1],
            "layout-nhwc: 0 layout-agnostic ops compute on NHWC images"
        );
        assert_eq!(
            transposes(&after),
            [
                ("conv2d".into(), TO_NCHW.to_vec()),
                ("x".into(), TO_NHWC.to_vec())
            ]
        );
    }

    #[test]
    fn a_training_step_keeps_one_transpose_at_the_input() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 6, 5]).unwrap();
        let w1 = g.placeholder("w1", DType::F32, [3, 3, 3, 5]).unwrap();
        let b1 = g.placeholder("b1", DType::F32, [5]).unwrap();
        let scale = g.placeholder("scale", DType::F32, [5]).unwrap();
        let offset = g.placeholder("offset", DType::F32, [5]).unwrap();
        let w2 = g.placeholder("w2", DType::F32, [3, 3, 5, 4]).unwrap();
        let w_fc = g.placeholder("w_fc", DType::F32, [4, 3]).unwrap();
        let y = g
            .conv2d(x, w1, [1, 1], Padding::Same, DataFormat::Nchw)
            .unwrap();
        let y = g.bias_add_format(y, b1, DataFormat::Nchw).unwrap();
        let bn = BatchNorm {
            epsilon: 1e-3,
            training: true,
            data_format: DataFormat::Nchw,
            activation: NormActivation::Identity,
            ..BatchNorm::default()
        };
        let y = g.add(bn, &[y, scale, offset, offset, scale]).unwrap();
        let y = g.relu(y).unwrap();
        let y = g
            .max_pool(y, [2, 2], [2, 2], Padding::Same, DataFormat::Nchw)
            .unwrap();
        let y = g
            .conv2d(y, w2, [1, 1], Padding::Valid, DataFormat::Nchw)
            .unwrap();
        let pooled = g
            .avg_pool(y, [3, 3], [1, 1], Padding::Same, DataFormat::Nchw)
            .unwrap();
        let y = g.plus(y, pooled).unwrap();
        let features = g.mean(y, Some(&[2, 3]), false).unwrap();
        let logits = g.matmul(features, w_fc).unwrap();
        let squared = g.square(logits).unwrap();
        let loss = g.mean(squared, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[w1, b1, scale, offset, w2, w_fc]).unwrap();
        g.set_outputs([vec![loss], grads].concat()).unwrap();

        let (after, summary) = layout(&g);
        assert!(nchw_ops(&after).is_empty(), "{:?}", nchw_ops(&after));
        assert_eq!(transposes(&after), [("x".into(), TO_NHWC.to_vec())]);
        assert_eq!(
            summary.lines[0],
            "layout-nhwc: rewrote 13 NCHW ops to NHWC: AvgPool 1, AvgPoolGrad 1, BatchNorm 1, \
             BatchNormGrad 1, BiasAdd 1, Conv2D 2, Conv2DBackpropFilter 2, Conv2DBackpropInput 2, \
             MaxPool 1, MaxPoolGrad 1"
        );
        // The global average pool and the bias gradient reduce NHWC axes.
        let axes: Vec<Option<Vec<i64>>> = after
            .node_ids()
            .filter_map(|id| after.node(id).op.downcast_ref::<Reduce>())
            .filter(|r| r.axes.is_some())
            .map(|r| r.axes.clone())
            .collect();
        assert!(axes.contains(&Some(vec![1, 2])), "{axes:?}");
        assert!(axes.contains(&Some(vec![0, 1, 2])), "{axes:?}");
    }

    /// A grouped convolution's training step and an explicitly padded MaxPool: the NHWC
    /// twins keep the groups and the pads (written in the new order).
    #[test]
    fn groups_and_pooling_pads_carry_over() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 4, 6, 5]).unwrap();
        let w = g.placeholder("w", DType::F32, [3, 3, 2, 6]).unwrap();
        let conv = Conv2D::new([1, 1], Padding::Same, DataFormat::Nchw).with_groups(2);
        let y = g.add(conv, &[x, w]).unwrap();
        let pads = Padding::Explicit([[1, 0], [2, 1]]);
        let y = g
            .max_pool(y, [3, 3], [2, 2], pads, DataFormat::Nchw)
            .unwrap();
        let loss = g.mean(y, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[x, w]).unwrap();
        g.set_outputs([vec![y], grads].concat()).unwrap();

        let (after, _) = layout(&g);
        assert!(nchw_ops(&after).is_empty(), "{:?}", nchw_ops(&after));
        let with = |attr: (&str, AttrValue)| {
            after
                .node_ids()
                .filter(|&id| after.node(id).op.attrs().contains(&attr))
                .count()
        };
        assert_eq!(
            with(("groups", AttrValue::Int(2))),
            3,
            "Conv2D and its gradients"
        );
        let nhwc_pads = AttrValue::Ints(vec![0, 0, 1, 0, 2, 1, 0, 0]);
        assert_eq!(
            with(("explicit_paddings", nhwc_pads)),
            2,
            "MaxPool, MaxPoolGrad"
        );
    }

    #[test]
    fn explicit_padding_follows_the_rewritten_layout() {
        // A training step: the gradients are convolutions with the forward's padding.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 6, 5]).unwrap();
        let w = g.placeholder("w", DType::F32, [3, 2, 3, 4]).unwrap();
        let pads = Padding::Explicit([[0, 2], [3, 1]]);
        let y = g.conv2d(x, w, [2, 1], pads, DataFormat::Nchw).unwrap();
        let loss = g.mean(y, None, false).unwrap();
        let grads = gradients(&mut g, loss, &[x, w]).unwrap();
        g.set_outputs([vec![y], grads].concat()).unwrap();
        let written = |g: &Graph, format: DataFormat| {
            let (mut convs, mut lists) = (0, Vec::new());
            for id in g.node_ids() {
                let attrs = g.node(id).op.attrs();
                if attrs.contains(&("padding", "EXPLICIT".into())) {
                    convs += 1;
                    assert!(attrs.contains(&("data_format", format.into())), "{attrs:?}");
                    lists.extend(attrs.into_iter().filter(|(k, _)| *k == "explicit_paddings"));
                }
            }
            assert_eq!(convs, 3, "Conv2D and its two gradients");
            lists.dedup();
            lists
        };
        // Pairs by dimension in each op's order: (N, C, H, W), then (N, H, W, C).
        assert_eq!(
            written(&g, DataFormat::Nchw),
            [(
                "explicit_paddings",
                AttrValue::Ints(vec![0, 0, 0, 0, 0, 2, 3, 1])
            )]
        );
        let (after, _) = layout(&g);
        assert!(nchw_ops(&after).is_empty(), "{:?}", nchw_ops(&after));
        assert_eq!(
            written(&after, DataFormat::Nhwc),
            [(
                "explicit_paddings",
                AttrValue::Ints(vec![0, 0, 0, 2, 3, 1, 0, 0])
            )]
        );
        // The file reads back as the same graph.
        let back = GraphDef::from_graph(&after).to_graph().unwrap();
        assert_eq!(json(&back), json(&after));
    }

    #[test]
    fn ops_it_cannot_rewrite_keep_transposes_and_concat_and_reductions_remap_axes() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 5, 5]).unwrap();
        let a = conv(&mut g, x, 4, 3, 1, Padding::Same);
        let a = g.relu(a).unwrap();
        let b = conv(&mut g, x, 2, 1, 1, Padding::Same);
        let cat = g.concat(&[a, b], 1).unwrap();
        let mean = g.mean(cat, Some(&[-2, -1]), false).unwrap();
        let part = g
            .add(Slice::new([0, 1, 0, 2], [-1, 3, -1, 3]), &[cat])
            .unwrap();
        let sum = g.sum(cat, Some(&[0, 2, 3]), false).unwrap();
        let flat = g.reshape(a, [2, -1]).unwrap();
        // A per-channel scale broadcast from [C, 1, 1] is NCHW only (one from
        // [N, C, 1, 1] follows: `a_squeeze_excitation_block_computes_nhwc`).
        let per_channel = g.constant(tensor(&[6, 1, 1], 0.5)).unwrap();
        let scaled = g.mul(cat, per_channel).unwrap();
        let scaled = conv(&mut g, scaled, 3, 1, 1, Padding::Valid);
        let pooled = g.mean(scaled, Some(&[2, 3]), false).unwrap();
        let part = g.mean(part, Some(&[1, 2, 3]), false).unwrap();
        g.set_outputs(vec![mean, sum, flat, pooled, part]).unwrap();

        let (after, _) = layout(&g);
        assert!(nchw_ops(&after).is_empty());
        // In: x, and the scaled tensor back into the convolution; out: the ReLU for
        // the Reshape, the Concat for the per-channel Mul.
        let relu = after.node(after.inputs(after.find("reshape").unwrap())[0].node);
        assert_eq!(relu.op_name(), "Transpose");
        assert_eq!(count(&after, "Transpose"), 4);
        let concat = after.find("concat").unwrap();
        assert_eq!(
            after.node(concat).op.downcast_ref::<Concat>().unwrap().axis,
            3
        );
        // The outputs' Means and Sum, in order.
        let axes = |k: usize| {
            let r = after
                .node(after.outputs()[k].node)
                .op
                .downcast_ref::<Reduce>();
            r.unwrap().axes.clone().unwrap()
        };
        assert_eq!(axes(0), [1, 2]);
        assert_eq!(axes(1), [0, 1, 2]);
        assert_eq!(axes(4), [1, 2, 3]);
        let slice = after
            .node(after.find("slice").unwrap())
            .op
            .downcast_ref::<Slice>();
        let slice = slice.unwrap();
        assert_eq!(
            (&slice.begin[..], &slice.size[..]),
            (&[0, 0, 2, 1][..], &[-1, -1, 3, 3][..])
        );
    }

    #[test]
    fn a_per_channel_sum_of_an_nhwc_image_sums_it_in_place() {
        // The gradient of a `[1, C, 1, 1]` vector broadcast over a convolution's
        // output (a composed batch norm's offset): a SumTo to the vector's shape.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 6, 6]).unwrap();
        let y = conv(&mut g, x, 4, 3, 1, Padding::Same);
        let y = g.relu(y).unwrap();
        let per_channel = g
            .add(
                SumTo {
                    shape: vec![1, 4, 1, 1],
                },
                &[y],
            )
            .unwrap();
        let flat = g.reshape(per_channel, [4]).unwrap();
        g.set_outputs(vec![flat]).unwrap();
        let (after, _) = layout(&g);
        let sums: Vec<&SumTo> = (after.node_ids())
            .filter_map(|id| after.node(id).op.downcast_ref::<SumTo>())
            .collect();
        assert_eq!(
            sums,
            [&SumTo {
                shape: vec![1, 1, 1, 4]
            }]
        );
        // Only the small result goes back to NCHW (for the Reshape), not the image.
        let moved: Vec<Vec<usize>> = (after.node_ids())
            .filter(|&id| after.node(id).op.is::<Transpose>())
            .map(|id| after.node(id).outputs()[0].shape.clone())
            .filter(|s| s.iter().product::<usize>() > 4)
            .collect();
        assert_eq!(moved, [vec![2, 6, 6, 3]], "only x goes NHWC: {moved:?}");
    }

    #[test]
    fn transposes_cancel_against_the_graphs_own() {
        // An NHWC model written with NCHW ops between explicit Transposes.
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 6, 5, 3]).unwrap();
        let nchw = g.transpose(x, TO_NCHW).unwrap();
        let y = conv(&mut g, nchw, 4, 3, 1, Padding::Same);
        let y = g.relu(y).unwrap();
        let y = g.transpose(y, TO_NHWC).unwrap();
        g.set_outputs(vec![y]).unwrap();

        let (after, summary) = layout(&g);
        assert_eq!(
            summary.lines[2],
            "layout-nhwc: added 2 Transposes, removed 4 that cancelled"
        );
        assert_eq!(count(&after, "Transpose"), 0);
        let out = after.outputs()[0].node;
        assert_eq!(after.node(out).op_name(), "Identity");
    }

    #[test]
    fn a_batch_norm_whose_image_output_is_fetched_stays_nchw() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 4, 5]).unwrap();
        let y = conv(&mut g, x, 4, 3, 1, Padding::Same);
        let y = batch_norm(&mut g, y, true);
        let z = conv(&mut g, y, 2, 1, 1, Padding::Same);
        g.set_outputs(vec![y, z]).unwrap();

        let (after, summary) = layout(&g);
        assert_eq!(nchw_ops(&after), ["batchnorm"]);
        assert_eq!(
            summary.lines[3],
            "layout-nhwc: kept 1 NCHW ops whose image output is a graph output of a node with several outputs"
        );
        // x in; the first conv out to the BatchNorm; its output into the second; out.
        assert_eq!(count(&after, "Transpose"), 4);
    }

    /// MobileNetV3's and EfficientNet's squeeze-excitation: the image times a
    /// per-image, per-channel scale computed from its mean, `[N, C, 1, 1]`, and a
    /// `[1, C, 1, 1]` constant: the whole block NHWC, Transposes only at x and the
    /// output, fused or not.
    #[test]
    fn a_squeeze_excitation_block_computes_nhwc() {
        for fused in [false, true] {
            let mut g = Graph::new();
            let x = g.placeholder("x", DType::F32, [2, 3, 4, 5]).unwrap();
            let y = conv(&mut g, x, 6, 3, 1, Padding::Same);
            let pooled = g.mean(y, Some(&[2, 3]), true).unwrap();
            let s = conv(&mut g, pooled, 2, 1, 1, Padding::Valid);
            let s = g.relu(s).unwrap();
            let s = conv(&mut g, s, 6, 1, 1, Padding::Valid);
            let s = g.sigmoid(s).unwrap();
            let per_channel = g.constant(tensor(&[1, 6, 1, 1], 0.5)).unwrap();
            let s = g.mul(s, per_channel).unwrap();
            let y = g.mul(y, s).unwrap();
            let y = conv(&mut g, y, 2, 1, 1, Padding::Same);
            g.set_outputs(vec![y]).unwrap();
            if fused {
                Fuse.run(&mut g).unwrap();
            }
            let (after, _) = layout(&g);
            assert!(nchw_ops(&after).is_empty(), "fused {fused}");
            let inputs: Vec<String> = transposes(&after).into_iter().map(|(i, _)| i).collect();
            let output = format!("{}/nhwc", after.port_name(g.outputs()[0]));
            assert_eq!(
                inputs,
                [g.node(per_channel.node).name.clone(), output, "x".into()],
                "fused {fused}"
            );
        }
    }

    #[test]
    fn a_fused_program_of_images_follows_its_neighbours() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3, 4, 5]).unwrap();
        let y = conv(&mut g, x, 4, 3, 1, Padding::Same);
        let half = g.scalar(DType::F32, 0.5).unwrap();
        let y = g.mul(y, half).unwrap();
        let y = g.tanh(y).unwrap();
        let y = conv(&mut g, y, 2, 1, 1, Padding::Same);
        g.set_outputs(vec![y]).unwrap();
        Fuse.run(&mut g).unwrap();
        assert_eq!(count(&g, "FusedElementwise"), 1);

        let (after, summary) = layout(&g);
        assert_eq!(
            summary.lines[1],
            "layout-nhwc: 1 layout-agnostic ops compute on NHWC images"
        );
        assert_eq!(count(&after, "Transpose"), 2);
    }

    #[test]
    fn graphs_without_nchw_ops_are_left_alone() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 5, 5, 3]).unwrap();
        let w = g.constant(tensor(&[3, 3, 3, 4], 1.0)).unwrap();
        let y = g
            .conv2d(x, w, [1, 1], Padding::Same, DataFormat::Nhwc)
            .unwrap();
        let y = g.relu(y).unwrap();
        let t = g.transpose(y, TO_NCHW).unwrap();
        let t = g.transpose(t, TO_NHWC).unwrap();
        let flat = g.reshape(t, [2, -1]).unwrap();
        g.set_outputs(vec![flat]).unwrap();
        let (after, summary) = layout(&g);
        assert_eq!(json(&g), json(&after));
        assert_eq!(summary.lines[0], "layout-nhwc: rewrote 0 NCHW ops to NHWC");
    }
}
