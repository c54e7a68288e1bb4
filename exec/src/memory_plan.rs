//! A step's memory, planned before it runs: every tensor the step computes gets an
//! offset in one arena, chosen from the tensors' lifetimes in the schedule so that
//! tensors never alive at once share bytes. The arena's size is the step's planned
//! peak; the most bytes alive at once is a lower bound no plan can beat.
//!
//! Sources (Placeholders, Variables, Consts) live outside the arena: fed or persistent.
//! So do the values assignments write (a variable's next value outlives the step).
//! A view ([`Op::is_view`]: Reshape, Identity, an assignment's value) shares its
//! input's buffer, whose lifetime then runs to the view's last reader. Fetched tensors
//! live to the end of the step.
//!
//! Offsets come from the greedy-by-size heuristic (TensorFlow Lite's arena planner):
//! the largest buffers are placed first, each at the lowest offset clear of every
//! placed buffer whose lifetime overlaps its own. Tensors the step zeroes at its start
//! (amaxes kernels fold into) come first, alive the whole step, so one memset zeroes
//! them all ([`MemoryPlan::zeroed_bytes`]).
//!
//! [`Op::is_view`]: ampgraph_graph::Op::is_view

use ampgraph_graph::ops::{
    replaced_inputs, update_members, variable_updates, AllReduce, AssignVariable, Cast, Const,
    Placeholder, Variable, VariableUpdate,
};
use ampgraph_graph::{Graph, NodeId, Port};
use std::collections::{HashMap, HashSet};

use crate::schedule::Schedule;
use crate::ExecError;

/// Buffers start at multiples of this many bytes (what device allocators guarantee).
pub const ALIGNMENT: usize = 256;

/// One tensor's place in the arena, or a node's scratch memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedBuffer {
    /// The tensor (views of it share the buffer); for scratch, the node's output 0.
    pub port: Port,
    /// The node's scratch (its kernels' temporaries and cuDNN's workspace), alive
    /// during its own step only.
    pub scratch: bool,
    /// Steps (positions in the schedule) from the one that writes it to the last that
    /// reads it, inclusive.
    pub first: usize,
    pub last: usize,
    pub offset: usize,
    /// Its size rounded up to [`ALIGNMENT`].
    pub bytes: usize,
}

impl PlannedBuffer {
    fn alive_with(&self, other: &PlannedBuffer) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// Where every tensor of a step lives.
#[derive(Clone, Debug, Default)]
pub struct MemoryPlan {
    pub buffers: Vec<PlannedBuffer>,
    /// The arena's size: the step's planned peak bytes.
    pub arena_bytes: usize,
    /// The most bytes alive at one step: no plan needs less.
    pub live_bytes: usize,
    /// The (first) step at which `live_bytes` are alive.
    pub peak_step: usize,
    /// The bytes of every buffer added up: what a step allocating each tensor anew and
    /// freeing nothing would need.
    pub total_bytes: usize,
    /// The arena's first bytes: the tensors the step zeroes before its first kernel
    /// (amaxes its kernels fold their values into), alive the whole step, so that one
    /// memset zeroes them all rather than one a tensor.
    pub zeroed_bytes: usize,
}

/// The update outputs that may be written over the variable they replace (an
/// optimizer update's variables and slots, delayed scaling's amax history, scale and
/// inverse: `replaced_inputs`), assigned to the Variable node they update, where nothing later
/// in the step reads that variable's old value (directly or through a view) and it is
/// not fetched. Their kernels read every old value they need before they write, so
/// the variable needs no second buffer for its next value (and a captured step no
/// copy back into it).
pub fn in_place_updates(graph: &Graph, fetches: &[Port]) -> Result<Vec<(Port, NodeId)>, ExecError> {
    let order = Schedule::new(graph, fetches)?.order;
    Ok(in_place_updates_in_order(graph, &order, fetches))
}

/// [`in_place_updates`] with the step's schedule given.
fn in_place_updates_in_order(
    graph: &Graph,
    order: &[NodeId],
    fetches: &[Port],
) -> Vec<(Port, NodeId)> {
    let position = positions(order);
    let mut found = Vec::new();
    for (at, &id) in order.iter().enumerate() {
        let inputs = graph.inputs(id);
        for (k, slot) in replaced_inputs(graph.node(id).op.as_ref()) {
            let Some(&target) = inputs.get(slot) else {
                continue;
            };
            let port = Port::new(id, k);
            let writes_target = graph.port_consumers(port).iter().any(|&(reader, _)| {
                graph.node(reader).op.is::<AssignVariable>()
                    && graph.inputs(reader).first() == Some(&target)
            });
            if target.index == 0
                && graph.node(target.node).op.is::<Variable>()
                && writes_target
                && !fetches.iter().any(|f| f.node == target.node)
                && last_read(graph, &position, target.node) <= Some(at)
            {
                found.push((port, target.node));
            }
        }
    }
    found
}

/// Each node of `order` with its position.
fn positions(order: &[NodeId]) -> HashMap<NodeId, usize> {
    order.iter().enumerate().map(|(i, &id)| (id, i)).collect()
}

/// The last position in the step (`position`) that reads `start`'s values, through
/// views; an assignment does not read the variable it writes.
fn last_read(graph: &Graph, position: &HashMap<NodeId, usize>, start: NodeId) -> Option<usize> {
    let (mut last, mut stack) = (None, vec![start]);
    while let Some(id) = stack.pop() {
        for (reader, slot, _) in graph.consumers(id) {
            let Some(&at) = position.get(&reader) else {
                continue;
            };
            let op = &graph.node(reader).op;
            if op.is::<AssignVariable>() && slot == 0 {
                continue;
            }
            last = last.max(Some(at));
            if op.is_view() {
                stack.push(reader);
            }
        }
    }
    last
}

/// The updates' cast outputs among `updates` ([`update_casts`]) that may be written
/// over the kept cast they replace: every reader of the kept cast (through views)
/// runs before the update, the step assigns the update's new value to the variable
/// (so the new cast is kept when the step commits), and no fetch is the cast or a
/// view of it. Training then holds one 16-bit copy of each weight, not two.
fn in_place_casts_in_order(
    graph: &Graph,
    order: &[NodeId],
    fetches: &[Port],
    updates: &[(Port, String, Port)],
) -> HashSet<Port> {
    let position = positions(order);
    let assigned_in_step = |var: NodeId, update: NodeId| {
        graph.consumers(var).into_iter().any(|(reader, slot, _)| {
            slot == 0
                && position.contains_key(&reader)
                && graph.node(reader).op.is::<AssignVariable>()
                && graph
                    .inputs(reader)
                    .get(1)
                    .is_some_and(|v| v.node == update)
        })
    };
    let mut found = HashSet::new();
    for &(cast, _, next) in updates {
        let (Some(&update_at), Some(var)) = (
            position.get(&next.node),
            graph.inputs(cast.node).first().map(|x| x.node),
        ) else {
            continue;
        };
        if last_read(graph, &position, cast.node) < Some(update_at)
            && assigned_in_step(var, next.node)
            && !fetches.iter().any(|&f| root(graph, f) == cast)
            && !fetches.contains(&next)
        {
            found.insert(next);
        }
    }
    found
}

/// Casts of variables that no assignment in the graph writes (the f16 copies AMP
/// makes of an inference graph's weights), each with its variable's name: their
/// values hold until the variable is written, so an executor may keep them from one
/// step to the next instead of casting again.
pub fn constant_casts(graph: &Graph) -> Vec<(Port, String)> {
    let written: HashSet<NodeId> = graph
        .node_ids()
        .filter(|&id| graph.node(id).op.is::<AssignVariable>())
        .filter_map(|id| graph.inputs(id).first().map(|p| p.node))
        .collect();
    graph
        .node_ids()
        .filter_map(|id| {
            let cast = graph.node(id).op.downcast_ref::<Cast>()?;
            let &[x] = &graph.inputs(id)[..] else {
                return None;
            };
            let var = graph.node(x.node);
            let widens_or_narrows = graph.ty(x).dtype != cast.to;
            (var.op.is::<Variable>() && !written.contains(&x.node) && widens_or_narrows)
                .then(|| (Port::new(id, 0), var.name.clone()))
        })
        .collect()
}

/// Casts of variables that an optimizer update writes and also outputs cast to the
/// cast's dtype (`OptimizerUpdate::cast_to`): each cast with its variable's name and
/// the update output holding the next step's value of the cast.
pub fn update_casts(graph: &Graph) -> Vec<(Port, String, Port)> {
    let mut found = Vec::new();
    for VariableUpdate {
        variable: var,
        node: id,
        member,
    } in variable_updates(graph)
    {
        let Some((update, _)) = update_members(graph.node(id).op.as_ref()) else {
            continue;
        };
        let (Some(to), Some(cast)) = (update.cast_to, update.cast_output()) else {
            continue;
        };
        let cast_out = Port::new(id, member * update.num_outputs() + cast);
        for (reader, _, _) in graph.consumers(var) {
            if graph
                .node(reader)
                .op
                .downcast_ref::<Cast>()
                .is_some_and(|c| c.to == to)
            {
                let name = graph.node(var).name.clone();
                found.push((Port::new(reader, 0), name, cast_out));
            }
        }
    }
    found
}

/// The variables among `casts` ([`constant_casts`]) that nothing else reads, no
/// other op and no fetch: once their casts are kept, a step needs no copy of the
/// variable itself.
pub fn read_only_through_casts(
    graph: &Graph,
    fetches: &[Port],
    casts: &[(Port, String)],
) -> HashSet<NodeId> {
    let cast_nodes: HashSet<NodeId> = casts.iter().map(|c| c.0.node).collect();
    casts
        .iter()
        .filter_map(|c| graph.inputs(c.0.node).first().map(|x| x.node))
        .filter(|&var| {
            graph
                .consumers(var)
                .iter()
                .all(|(reader, _, _)| cast_nodes.contains(reader))
                && !fetches.iter().any(|f| f.node == var)
        })
        .collect()
}

/// Plans the memory of the step that computes `fetches`.
pub fn plan(graph: &Graph, fetches: &[Port]) -> Result<MemoryPlan, ExecError> {
    plan_outside(graph, fetches, &Default::default(), &Default::default())
}

/// [`plan`], with the tensors of `outside` kept out of the arena too (values an
/// executor keeps beyond the step), and `scratch` bytes for the nodes that need them
/// while they run (what the CUDA executor saw their kernels take).
pub fn plan_outside(
    graph: &Graph,
    fetches: &[Port],
    outside: &HashSet<Port>,
    scratch: &HashMap<NodeId, usize>,
) -> Result<MemoryPlan, ExecError> {
    let order = Schedule::new(graph, fetches)?.order;
    Ok(plan_in_order(
        graph,
        &order,
        fetches,
        outside,
        scratch,
        &HashSet::new(),
    ))
}

/// [`plan_outside`] with the step's schedule given, and the tensors of `zeroed` (those
/// in the arena) at its start ([`MemoryPlan::zeroed_bytes`]).
fn plan_in_order(
    graph: &Graph,
    order: &[NodeId],
    fetches: &[Port],
    outside: &HashSet<Port>,
    scratch: &HashMap<NodeId, usize>,
    zeroed: &HashSet<Port>,
) -> MemoryPlan {
    let end = order.len();
    let is_source = |p: Port| is_source(graph, p);
    let root = |p: Port| root(graph, p);
    let assigned = assigned_values(graph, order);
    let mut buffers: Vec<PlannedBuffer> = Vec::new();
    let mut slot_of: HashMap<Port, usize> = Default::default();
    for (i, &id) in order.iter().enumerate() {
        let node = graph.node(id);
        if let Some(&bytes) = scratch.get(&id).filter(|&&b| b > 0) {
            buffers.push(PlannedBuffer {
                port: Port::new(id, 0),
                scratch: true,
                first: i,
                last: i,
                offset: 0,
                bytes: aligned(bytes),
            });
        }
        if node.op.is_view() {
            continue;
        }
        for (k, ty) in node.outputs().iter().enumerate() {
            let port = Port::new(id, k);
            if is_source(port) || assigned.contains(&port) || outside.contains(&port) {
                continue;
            }
            let size = ty.size_bytes();
            slot_of.insert(port, buffers.len());
            buffers.push(PlannedBuffer {
                port,
                scratch: false,
                first: i,
                last: i,
                offset: 0,
                bytes: aligned(size),
            });
        }
    }
    let mut extend = |p: Port, to: usize| {
        if let Some(&b) = slot_of.get(&root(p)) {
            buffers[b].last = buffers[b].last.max(to);
        }
    };
    for (i, &id) in order.iter().enumerate() {
        for p in graph.inputs(id) {
            extend(p, i);
        }
    }
    for &p in fetches {
        extend(p, end);
    }
    // A collective may read its inputs on another stream until its outputs are read:
    // their buffers stay theirs until then.
    for &id in order
        .iter()
        .filter(|&&id| graph.node(id).op.is::<AllReduce>())
    {
        let outputs_read_until = (0..graph.node(id).outputs().len())
            .filter_map(|k| slot_of.get(&Port::new(id, k)))
            .map(|&b| buffers[b].last)
            .max();
        if let Some(last) = outputs_read_until {
            for p in graph.inputs(id) {
                if let Some(&b) = slot_of.get(&root(p)) {
                    buffers[b].last = buffers[b].last.max(last);
                }
            }
        }
    }
    let (mut first, mut rest): (Vec<PlannedBuffer>, Vec<PlannedBuffer>) = buffers
        .into_iter()
        .partition(|b| !b.scratch && zeroed.contains(&b.port));
    place(&mut rest);
    let mut zeroed_bytes = 0;
    for b in &mut first {
        (b.first, b.last, b.offset) = (0, end, zeroed_bytes);
        zeroed_bytes += b.bytes;
    }
    for b in &mut rest {
        b.offset += zeroed_bytes;
    }
    first.extend(rest);
    let mut plan = summarise(first, end);
    plan.zeroed_bytes = zeroed_bytes;
    plan
}

/// Refuses the step computing `fetches` where the tensors it must hold at once (the
/// plan's lower bound; the graph's sources are already in memory) exceed `available`
/// bytes of `place`: the error names the largest tensors alive then.
pub fn admit(
    graph: &Graph,
    fetches: &[Port],
    available: usize,
    place: &str,
) -> Result<(), ExecError> {
    let plan = plan(graph, fetches)?;
    if plan.live_bytes <= available {
        return Ok(());
    }
    Err(ExecError::Memory(format!(
        "the step holds {:.1} MiB of tensors at once but {place} has {:.1} MiB available; the largest then: {}",
        mib(plan.live_bytes),
        mib(available),
        plan.largest_at_peak(graph, 3)
    )))
}

/// Whether `p` is a Placeholder's, Variable's or Const's value (fed or persistent).
fn is_source(graph: &Graph, p: Port) -> bool {
    ampgraph_graph::ops::is_source(graph.node(p.node).op.as_ref())
}

/// The buffer a tensor lives in: a view's is its input's.
fn root(graph: &Graph, mut p: Port) -> Port {
    while p.index == 0 && graph.node(p.node).op.is_view() {
        match graph.inputs(p.node).first() {
            Some(&input) => p = input,
            None => break,
        }
    }
    p
}

/// The buffers of the values the assignments among `order` write.
fn assigned_values(graph: &Graph, order: &[NodeId]) -> HashSet<Port> {
    order
        .iter()
        .filter(|&&id| graph.node(id).op.is::<AssignVariable>())
        .filter_map(|&id| graph.inputs(id).get(1).map(|&v| root(graph, v)))
        .collect()
}

/// The casts the CUDA executor keeps beyond a step, outside its arena: casts of
/// variables no step writes ([`constant_casts`]), casts of variables an optimizer
/// update writes with their cast, and those updates' cast outputs, which replace them
/// when the step ends ([`update_casts`]).
pub fn kept_casts(graph: &Graph) -> HashSet<Port> {
    kept_of(&constant_casts(graph), &update_casts(graph))
}

/// [`kept_casts`] from the graph's constant and update casts.
fn kept_of(constant: &[(Port, String)], updates: &[(Port, String, Port)]) -> HashSet<Port> {
    let constant = constant.iter().map(|(cast, _)| *cast);
    let updated = updates.iter().flat_map(|&(cast, _, next)| [cast, next]);
    constant.chain(updated).collect()
}

/// A step's device memory, planned on the host: the arena of the tensors it computes
/// and what lives beside it. Each part is rounded up to [`ALIGNMENT`] per tensor. The
/// nodes' scratch (kernels' temporaries, cuDNN's workspaces) is in the arena where it
/// is given (the CUDA executor knows it after a step:
/// [`DeviceStats::planned_scratch`](crate::DeviceStats::planned_scratch)). Not counted: the
/// GEMM library's workspace, kernels' code, the CUDA context.
#[derive(Clone, Debug, Default)]
pub struct StepFootprint {
    /// The arena, with the kept casts outside it (as the CUDA executor plans it).
    pub plan: MemoryPlan,
    /// Every Variable of the graph (an executor holds them all): weights, optimizer
    /// slots, loss-scale state, inputs made resident.
    pub variable_bytes: usize,
    pub variables: usize,
    /// The Placeholders the step reads, fed (uploaded) per step.
    pub fed_bytes: usize,
    /// The Consts the step reads (uploaded once).
    pub constant_bytes: usize,
    /// The casts kept from one step to the next ([`kept_casts`] but the updates' cast
    /// outputs): the 16-bit copies of the weights an AMP step keeps. The first step
    /// holds them beside their variables' f32 copies, so both count, but for
    /// `cast_only_bytes`.
    pub kept_cast_bytes: usize,
    /// The variables among `variable_bytes` that only casts no step changes read
    /// ([`read_only_through_casts`]): an inference graph's weights, a resident input.
    /// The CUDA executor makes those casts before it takes the arena and then drops
    /// the variables' device copies (their host copies are current where they were
    /// set from the host), so they are not held beside the arena.
    pub cast_only_bytes: usize,
    /// New values made outside the arena during the step, alive beside the values
    /// they replace until it ends: variables' next values that optimizer updates do
    /// not write in place ([`in_place_updates`]), the updates' cast outputs not
    /// written over the kept casts they replace.
    pub written_bytes: usize,
}

impl StepFootprint {
    /// The step's planned peak: the arena and everything beside it, or, where more,
    /// what is held before the arena (every variable and the casts kept).
    pub fn peak_bytes(&self) -> usize {
        let with_arena = self.plan.arena_bytes + self.variable_bytes - self.cast_only_bytes
            + self.fed_bytes
            + self.constant_bytes
            + self.kept_cast_bytes
            + self.written_bytes;
        with_arena.max(self.variable_bytes + self.kept_cast_bytes)
    }

    /// A report of the plan: the peak and its parts, the lower bound, the peak step
    /// and the `top` largest tensors alive there, one a line.
    pub fn report(&self, graph: &Graph, top: usize) -> String {
        let amount = |bytes: usize| format!("{bytes} bytes ({:.1} MiB)", mib(bytes));
        let plan = &self.plan;
        let mut lines = vec![
            format!("planned peak: {}", amount(self.peak_bytes())),
            format!("arena: {}", amount(plan.arena_bytes)),
            format!(
                "lower bound (most bytes alive at once): {}",
                amount(plan.live_bytes)
            ),
            format!("every tensor apart: {}", amount(plan.total_bytes)),
            format!(
                "variables ({} nodes): {}",
                self.variables,
                amount(self.variable_bytes)
            ),
            format!("fed: {}", amount(self.fed_bytes)),
            format!("constants: {}", amount(self.constant_bytes)),
            format!("kept casts: {}", amount(self.kept_cast_bytes)),
            format!(
                "variables read only through them, dropped before the arena: {}",
                amount(self.cast_only_bytes)
            ),
            format!(
                "written beside the old values: {}",
                amount(self.written_bytes)
            ),
            match plan.buffers.iter().find(|b| b.first == plan.peak_step) {
                Some(b) => {
                    let node = graph.node(b.port.node);
                    format!(
                        "peak step: {} (while '{}' ({}) runs)",
                        plan.peak_step,
                        node.name,
                        node.op.name()
                    )
                }
                None => format!("peak step: {}", plan.peak_step),
            },
            "alive at the peak, largest first:".to_string(),
        ];
        for b in plan.alive_at_peak().into_iter().take(top) {
            let node = graph.node(b.port.node);
            let what = match b.scratch {
                true => format!("scratch of '{}' ({})", node.name, node.op.name()),
                false => format!(
                    "{} ({}) {}",
                    graph.port_name(b.port),
                    node.op.name(),
                    graph.ty(b.port)
                ),
            };
            lines.push(format!(
                "  {:>8.1} MiB  {what}  steps {}..{}",
                mib(b.bytes),
                b.first,
                b.last
            ));
        }
        lines.join("\n") + "\n"
    }
}

pub use ampgraph_graph::host_memory::mib;

fn aligned(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ALIGNMENT) * ALIGNMENT
}

/// The host's half of a step's plan, decided from the graph alone: the order its nodes
/// run in, the casts kept from one step to the next (outside the arena), the updates
/// written in place, and the arena. The CUDA executor's step plan is made from one and
/// [`step_footprint`] reports one: the memory planned and the memory a step takes come
/// from one computation.
pub(crate) struct StepLayout {
    /// The nodes the step runs, in order: first the variables only kept casts read
    /// and those casts (neither is in the arena), then the rest.
    pub schedule: Schedule,
    /// How many nodes of the order run before the arena: those variables and casts.
    pub before_arena: usize,
    /// Casts of variables no step writes, with the variable's name ([`constant_casts`]).
    pub constant_casts: Vec<(Port, String)>,
    /// The variables nothing but those casts reads ([`read_only_through_casts`]).
    pub cast_only: HashSet<NodeId>,
    /// Casts of variables an update writes with its cast: the cast, the variable's
    /// name and the update's cast output ([`update_casts`]).
    pub update_casts: Vec<(Port, String, Port)>,
    /// Optimizer outputs written over the variable they replace ([`in_place_updates`]).
    pub in_place: Vec<(Port, NodeId)>,
    /// Update casts written over the kept cast they replace ([`in_place_casts_in_order`]).
    pub casts_in_place: HashSet<Port>,
    /// The arena, the kept casts outside it, each node's `scratch` in it.
    pub plan: MemoryPlan,
}

impl StepLayout {
    /// The layout of the step that computes `fetches`, with `scratch` bytes for the
    /// nodes whose kernels take some and the tensors of `zeroed` zeroed at its start.
    pub fn new(
        graph: &Graph,
        fetches: &[Port],
        scratch: &HashMap<NodeId, usize>,
        zeroed: &HashSet<Port>,
    ) -> Result<StepLayout, ExecError> {
        let mut schedule = Schedule::new(graph, fetches)?;
        let constant_casts = constant_casts(graph);
        let update_casts = update_casts(graph);
        let cast_only = read_only_through_casts(graph, fetches, &constant_casts);
        let kept = kept_of(&constant_casts, &update_casts);
        // Planned in the schedule's own order: moving the variables only casts read
        // and their casts (neither in the arena) first moves no arena tensor's place
        // among the others.
        let plan = plan_in_order(graph, &schedule.order, fetches, &kept, scratch, zeroed);
        let in_place = in_place_updates_in_order(graph, &schedule.order, fetches);
        let casts_in_place =
            in_place_casts_in_order(graph, &schedule.order, fetches, &update_casts);
        let reads_cast_only =
            |id: &NodeId| (graph.inputs(*id).first()).is_some_and(|x| cast_only.contains(&x.node));
        let their_casts: HashSet<NodeId> = (constant_casts.iter())
            .map(|(cast, _)| cast.node)
            .filter(reads_cast_only)
            .collect();
        let (mut order, rest): (Vec<NodeId>, Vec<NodeId>) = (schedule.order.iter())
            .partition(|id| cast_only.contains(id) || their_casts.contains(id));
        let before_arena = order.len();
        order.extend(rest);
        schedule.order = order;
        Ok(StepLayout {
            schedule,
            before_arena,
            constant_casts,
            cast_only,
            update_casts,
            in_place,
            casts_in_place,
            plan,
        })
    }

    /// The step's device memory, this layout's arena and what lives beside it.
    fn footprint(self, graph: &Graph) -> StepFootprint {
        let bytes = |p: &Port| aligned(graph.ty(*p).size_bytes());
        let order = &self.schedule.order;
        let in_step: HashSet<NodeId> = order.iter().copied().collect();
        let kept = kept_of(&self.constant_casts, &self.update_casts);
        let cast_outputs: HashSet<Port> = (self.update_casts.iter())
            .map(|&(_, _, next)| next)
            .filter(|p| in_step.contains(&p.node))
            .collect();
        let in_place: HashSet<Port> = self.in_place.iter().map(|&(port, _)| port).collect();
        let next_values = assigned_values(graph, order)
            .into_iter()
            .filter(|&p| !is_source(graph, p) && !in_place.contains(&p));
        let mut footprint = StepFootprint {
            cast_only_bytes: (self.cast_only.iter())
                .filter(|id| in_step.contains(id))
                .map(|&id| bytes(&id.into()))
                .sum(),
            kept_cast_bytes: (kept.iter())
                .filter(|p| in_step.contains(&p.node) && !cast_outputs.contains(p))
                .map(bytes)
                .sum(),
            written_bytes: (next_values.chain(cast_outputs).collect::<HashSet<Port>>())
                .difference(&self.casts_in_place)
                .map(bytes)
                .sum(),
            ..StepFootprint::default()
        };
        for id in graph.node_ids() {
            if graph.node(id).op.is::<Variable>() {
                footprint.variables += 1;
                footprint.variable_bytes += bytes(&id.into());
            }
        }
        for &id in order {
            let op = &graph.node(id).op;
            if op.is::<Placeholder>() {
                footprint.fed_bytes += bytes(&id.into());
            } else if op.is::<Const>() {
                footprint.constant_bytes += bytes(&id.into());
            }
        }
        footprint.plan = self.plan;
        footprint
    }
}

/// The device memory of the step that computes `fetches`, planned on the host as the
/// CUDA executor plans it (from the same `StepLayout`: the arena with the kept casts
/// outside and each node's `scratch` bytes in it; none before a step has shown them),
/// with what lives beside the arena. The amaxes a step zeroes at its start (known once
/// it has run) are planned among the other tensors here: a few hundred bytes each.
pub fn step_footprint(
    graph: &Graph,
    fetches: &[Port],
    scratch: &HashMap<NodeId, usize>,
) -> Result<StepFootprint, ExecError> {
    Ok(StepLayout::new(graph, fetches, scratch, &HashSet::new())?.footprint(graph))
}

/// Steps per bucket of [`place`]'s index of placed buffers by lifetime.
const STEPS_PER_BUCKET: usize = 64;

/// Greedy by size: the largest first, each at the lowest offset clear of the placed
/// buffers alive at the same time. Which placed buffers those are comes from counts by
/// step: where all of them are (the inputs of a Concat of 60k), the lowest gap of
/// their union, kept as a free list; where few are (a deep chain), those of an index
/// by step (buckets of [`STEPS_PER_BUCKET`]); else every placed buffer in offset order.
/// Near linear in a deep graph's length (a 100k-op chain took 11 s when every buffer
/// looked at every placed one) and in a wide one's.
fn place(buffers: &mut [PlannedBuffer]) {
    let mut by_size: Vec<usize> = (0..buffers.len()).collect();
    by_size.sort_by_key(|&b| (std::cmp::Reverse(buffers[b].bytes), buffers[b].first));
    let steps = buffers.iter().map(|b| b.last + 1).max().unwrap_or(0);
    let mut buckets: Vec<Vec<usize>> = vec![Vec::new(); steps / STEPS_PER_BUCKET + 1];
    // Placed buffers by (offset, buffer); counts of them by first and by last step.
    let mut placed: std::collections::BTreeSet<(usize, usize)> = Default::default();
    let (mut by_first, mut by_last) = (StepCounts::new(steps), StepCounts::new(steps));
    let mut union = FreeList::default();
    let mut near: Vec<usize> = Vec::new();
    for b in by_size {
        let (first, last, bytes) = (buffers[b].first, buffers[b].last, buffers[b].bytes);
        let (lo, hi) = (first / STEPS_PER_BUCKET, last / STEPS_PER_BUCKET);
        // Placed buffers not alive with `b`: ended before it, or starting after it.
        let apart = by_last.up_to(first) + (placed.len() - by_first.up_to(last + 1));
        let indexed: usize = buckets[lo..=hi].iter().map(Vec::len).sum();
        // The lowest offset clear of `others` (in offset order) alive with `b`.
        let lowest = |others: &mut dyn Iterator<Item = usize>| {
            let mut offset = 0;
            for o in others
                .map(|o| &buffers[o])
                .filter(|o| o.alive_with(&buffers[b]))
            {
                if offset + bytes <= o.offset {
                    break;
                }
                offset = offset.max(o.offset + o.bytes);
            }
            offset
        };
        let offset = if apart == 0 {
            union.lowest_fit(bytes)
        } else if indexed <= placed.len() / 2 {
            near.clear();
            near.extend(buckets[lo..=hi].iter().flatten().copied());
            near.sort_by_key(|&o| (buffers[o].offset, o));
            near.dedup();
            lowest(&mut near.iter().copied())
        } else {
            lowest(&mut placed.iter().map(|&(_, o)| o))
        };
        buffers[b].offset = offset;
        placed.insert((offset, b));
        by_first.add(first);
        by_last.add(last);
        union.take(offset, offset + bytes);
        for bucket in &mut buckets[lo..=hi] {
            bucket.push(b);
        }
    }
}

/// Counts of buffers by step, with prefix sums (a Fenwick tree).
struct StepCounts(Vec<usize>);

impl StepCounts {
    fn new(steps: usize) -> Self {
        StepCounts(vec![0; steps + 1])
    }

    fn add(&mut self, step: usize) {
        let mut i = step + 1;
        while i < self.0.len() {
            self.0[i] += 1;
            i += i & i.wrapping_neg();
        }
    }

    /// How many were added at steps below `step`.
    fn up_to(&self, step: usize) -> usize {
        let (mut i, mut sum) = (step.min(self.0.len() - 1), 0);
        while i > 0 {
            sum += self.0[i];
            i -= i & i.wrapping_neg();
        }
        sum
    }
}

/// The byte ranges no placed buffer covers, by start (the last one open-ended).
struct FreeList(std::collections::BTreeMap<usize, usize>);

impl Default for FreeList {
    fn default() -> Self {
        FreeList([(0, usize::MAX)].into())
    }
}

impl FreeList {
    /// The lowest start of a free range of `bytes` or more.
    fn lowest_fit(&self, bytes: usize) -> usize {
        (self.0.iter())
            .find(|&(&start, &end)| end - start >= bytes)
            .map_or(0, |(&start, _)| start)
    }

    /// Marks `start..end` covered.
    fn take(&mut self, start: usize, end: usize) {
        let touched: Vec<(usize, usize)> = (self.0.range(..end))
            .rev()
            .take_while(|&(_, &e)| e > start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in touched {
            self.0.remove(&s);
            if s < start {
                self.0.insert(s, start);
            }
            if e > end {
                self.0.insert(end, e);
            }
        }
    }
}

/// Bytes alive at each of `steps` steps (and one past), from +size at a buffer's
/// `first` step and -size after its `last`.
fn alive_per_step(buffers: &[PlannedBuffer], steps: usize) -> Vec<usize> {
    let mut delta = vec![0isize; steps + 2];
    for b in buffers {
        delta[b.first] += b.bytes as isize;
        delta[b.last + 1] -= b.bytes as isize;
    }
    let mut alive = 0isize;
    delta
        .into_iter()
        .map(|d| {
            alive += d;
            alive as usize
        })
        .collect()
}

fn summarise(buffers: Vec<PlannedBuffer>, steps: usize) -> MemoryPlan {
    let arena_bytes = buffers
        .iter()
        .map(|b| b.offset + b.bytes)
        .max()
        .unwrap_or(0);
    let total_bytes = buffers.iter().map(|b| b.bytes).sum();
    let (mut live_bytes, mut peak_step) = (0usize, 0usize);
    for (step, alive) in alive_per_step(&buffers, steps).into_iter().enumerate() {
        if alive > live_bytes {
            (live_bytes, peak_step) = (alive, step);
        }
    }
    MemoryPlan {
        buffers,
        arena_bytes,
        live_bytes,
        peak_step,
        total_bytes,
        zeroed_bytes: 0,
    }
}

impl MemoryPlan {
    /// Each planned tensor's offset in the arena.
    pub fn offsets(&self) -> HashMap<Port, usize> {
        (self.buffers.iter().filter(|b| !b.scratch))
            .map(|b| (b.port, b.offset))
            .collect()
    }

    /// Each node's scratch in the arena: its offset and bytes.
    pub fn scratch(&self) -> HashMap<NodeId, (usize, usize)> {
        (self.buffers.iter().filter(|b| b.scratch))
            .map(|b| (b.port.node, (b.offset, b.bytes)))
            .collect()
    }

    /// For each node writing a planned tensor, the arena's bytes not alive during its
    /// step: what its scratch (a cuDNN workspace) may take without raising the peak.
    pub fn headroom(&self) -> HashMap<NodeId, usize> {
        let steps = self.buffers.iter().map(|b| b.last + 1).max().unwrap_or(0);
        let alive = alive_per_step(&self.buffers, steps);
        (self.buffers.iter().filter(|b| !b.scratch))
            .map(|b| {
                let free = self.arena_bytes.saturating_sub(alive[b.first]);
                (b.port.node, free)
            })
            .collect()
    }

    /// The `n` largest tensors alive at the peak, as an error names them: `'name'
    /// type (size)`, comma-separated.
    pub fn largest_at_peak(&self, graph: &Graph, n: usize) -> String {
        let named: Vec<String> = (self.alive_at_peak().into_iter().filter(|b| !b.scratch))
            .take(n)
            .map(|b| {
                let what = graph.port_name(b.port);
                format!("'{what}' {} ({:.1} MiB)", graph.ty(b.port), mib(b.bytes))
            })
            .collect();
        named.join(", ")
    }

    /// The buffers alive at the peak, largest first: what to shrink to lower it.
    pub fn alive_at_peak(&self) -> Vec<&PlannedBuffer> {
        let mut alive: Vec<&PlannedBuffer> = self
            .buffers
            .iter()
            .filter(|b| b.first <= self.peak_step && self.peak_step <= b.last)
            .collect();
        alive.sort_by_key(|b| std::cmp::Reverse(b.bytes));
        alive
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use ampgraph_graph::ops::{
        AmaxChoice, Fp8Scale, Fp8ScaleUpdate, GroupedOptimizerUpdate, OptimizerUpdate, Reduce,
        ReduceKind, Reshape, Rule, Unary, UnaryKind,
    };
    use ampgraph_graph::{DType, TensorType};

    fn placeholder(g: &mut Graph, name: &str, shape: &[usize]) -> Port {
        let ty = TensorType::new(DType::F32, shape.to_vec());
        g.add_node(name, Box::new(Placeholder(ty)), &[])
            .unwrap()
            .into()
    }

    fn relu(g: &mut Graph, x: Port) -> Port {
        g.add(Unary::new(UnaryKind::Relu), &[x]).unwrap()
    }

    /// x [256] (f32, 1 KiB) through 8 relus, `at(g, k, output)` after the k-th; the
    /// last relu's output.
    fn relu_chain(g: &mut Graph, mut at: impl FnMut(&mut Graph, usize, Port)) -> Port {
        let mut h = placeholder(g, "x", &[256]);
        for k in 0..8 {
            h = relu(g, h);
            at(g, k, h);
        }
        h
    }

    /// No two buffers alive at once overlap, and the sizes add up as they must.
    fn assert_sound(plan: &MemoryPlan) {
        for (i, a) in plan.buffers.iter().enumerate() {
            for b in &plan.buffers[i + 1..] {
                let apart = a.offset + a.bytes <= b.offset || b.offset + b.bytes <= a.offset;
                assert!(!a.alive_with(b) || apart, "{a:?} overlaps {b:?}");
            }
        }
        assert!(plan.live_bytes <= plan.arena_bytes);
        assert!(plan.arena_bytes <= plan.total_bytes);
    }

    /// Greedy by size as it was first written: every buffer looks at every placed one,
    /// in offset order (quadratic; the reference [`place`] must match).
    fn place_by_scanning(buffers: &mut [PlannedBuffer]) {
        let mut by_size: Vec<usize> = (0..buffers.len()).collect();
        by_size.sort_by_key(|&b| (std::cmp::Reverse(buffers[b].bytes), buffers[b].first));
        let mut placed: Vec<usize> = Vec::new();
        for b in by_size {
            let mut offset = 0;
            for &other in &placed {
                let o = &buffers[other];
                if !o.alive_with(&buffers[b]) {
                    continue;
                }
                if offset + buffers[b].bytes <= o.offset {
                    break;
                }
                offset = offset.max(o.offset + o.bytes);
            }
            buffers[b].offset = offset;
            let at = placed.partition_point(|&p| buffers[p].offset <= offset);
            placed.insert(at, b);
        }
    }

    /// `place` puts every buffer where the quadratic scan does, on random lifetimes and
    /// sizes (ties included), deep chains and wide fan-ins, at sizes that take each of
    /// its three ways of finding the buffers alive at once.
    #[test]
    fn placement_matches_the_quadratic_scan() {
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let buffer = |first: usize, last: usize, bytes: usize| PlannedBuffer {
            port: Port::new(NodeId::new(0), 0),
            scratch: false,
            first,
            last,
            offset: 0,
            bytes: bytes * ALIGNMENT,
        };
        for trial in 0..300 {
            let n = 1 + next(if trial % 10 == 0 { 2000 } else { 200 });
            let steps = 1 + next(3 * n);
            let mut buffers: Vec<PlannedBuffer> = (0..n)
                .map(|k| {
                    let first = match trial % 3 {
                        0 => next(steps),
                        1 => k.min(steps - 1),
                        _ => next(steps.min(8)),
                    };
                    let span = match next(4) {
                        0 => steps,
                        1 => next(steps),
                        _ => next(3),
                    };
                    buffer(first, (first + span).min(steps), 1 + next(5))
                })
                .collect();
            let mut reference = buffers.clone();
            place(&mut buffers);
            place_by_scanning(&mut reference);
            let offsets = |b: &[PlannedBuffer]| b.iter().map(|b| b.offset).collect::<Vec<_>>();
            assert_eq!(offsets(&buffers), offsets(&reference), "trial {trial}");
        }
    }

    #[test]
    fn a_chain_needs_two_buffers_not_one_per_op() {
        // x -> relu -> relu -> ... (8 times), 1 KiB each: each value dies as the next
        // op runs, so two buffers take turns.
        let mut g = Graph::new();
        let h = relu_chain(&mut g, |_, _, _| {});
        let plan = plan(&g, &[h]).unwrap();
        assert_sound(&plan);
        assert_eq!(plan.buffers.len(), 8, "the placeholder is fed, not planned");
        assert_eq!(plan.total_bytes, 8 * 1024);
        assert_eq!(plan.live_bytes, 2 * 1024);
        assert_eq!(plan.arena_bytes, 2 * 1024);
    }

    #[test]
    fn zeroed_tensors_lie_at_the_arenas_start_for_the_whole_step() {
        // The chain of 8 relus, 1 KiB each (two buffers take turns), with a 4-byte sum
        // of the third's output that its kernel folds into: the sum gets the arena's
        // first 256 bytes, alive from the step's start to its end (fetched, it would be
        // alive from the third relu on), and the chain's buffers lie after them.
        let mut g = Graph::new();
        let mut sum = None;
        let h = relu_chain(&mut g, |g, k, h| {
            if k == 2 {
                let reduce = Reduce::new(ReduceKind::Sum, None, false);
                sum = Some(g.add(reduce, &[h]).unwrap());
            }
        });
        let sum = sum.unwrap();
        let fetches = [h, sum];
        let order = Schedule::new(&g, &fetches).unwrap().order;
        let zeroed = [sum].into_iter().collect();
        let none = HashSet::new();
        let plan = plan_in_order(&g, &order, &fetches, &none, &HashMap::new(), &zeroed);
        assert_sound(&plan);
        assert_eq!(plan.zeroed_bytes, ALIGNMENT);
        let b = plan.buffers.iter().find(|b| b.port == sum).unwrap();
        assert_eq!((b.offset, b.first, b.last), (0, 0, order.len()));
        assert!(plan
            .buffers
            .iter()
            .all(|o| o.port == sum || o.offset >= ALIGNMENT));
        assert_eq!(plan.arena_bytes, ALIGNMENT + 2 * 1024);
        let unzeroed = plan_in_order(&g, &order, &fetches, &none, &HashMap::new(), &none);
        assert_eq!(unzeroed.zeroed_bytes, 0);
        let b = unzeroed.buffers.iter().find(|b| b.port == sum).unwrap();
        assert!(b.first > 0, "planned from its own step");
    }

    #[test]
    fn a_nodes_scratch_lives_only_while_it_runs() {
        // The chain of 8 relus, 1 KiB each, with 3 KiB of scratch for the fourth: it
        // lies beside that relu's input and output only (5 KiB alive then), and is no
        // tensor's slot.
        let mut g = Graph::new();
        let mut fourth = None;
        let h = relu_chain(&mut g, |_, k, h| {
            if k == 3 {
                fourth = Some(h.node);
            }
        });
        let fourth = fourth.unwrap();
        let scratch = [(fourth, 3000)].into_iter().collect();
        let plan = plan_outside(&g, &[h], &Default::default(), &scratch).unwrap();
        assert_sound(&plan);
        let step = plan
            .buffers
            .iter()
            .find(|b| b.port == fourth.into() && !b.scratch);
        let step = step.unwrap().first;
        let (_, bytes) = plan.scratch()[&fourth];
        assert_eq!(bytes, 3072, "rounded up to the alignment");
        assert_eq!((plan.live_bytes, plan.peak_step), (2 * 1024 + 3072, step));
        assert_eq!(plan.arena_bytes, 2 * 1024 + 3072);
        assert_eq!(plan.offsets().len(), 8, "the relus' outputs");
    }

    #[test]
    fn headroom_is_the_arena_less_what_is_alive_at_a_nodes_step() {
        // x -> big [4, 256] (4 KiB) -> small (its column sums, 1 KiB) -> small2 (1 KiB):
        // the arena holds big and small together (5 KiB); while small2 runs only small
        // and small2 are alive.
        let mut g = Graph::new();
        let x = placeholder(&mut g, "x", &[4, 256]);
        let big = relu(&mut g, x);
        let sum = Reduce::new(ReduceKind::Sum, Some(vec![0]), false);
        let small = g.add(sum, &[big]).unwrap();
        let small2 = relu(&mut g, small);
        let plan = plan(&g, &[small2]).unwrap();
        assert_eq!(plan.arena_bytes, 5 * 1024);
        let free = plan.headroom();
        assert_eq!(
            free[&big.node], 1024,
            "big alone is alive while it is written"
        );
        assert_eq!(free[&small.node], 0, "the peak: big and small");
        assert_eq!(free[&small2.node], 3 * 1024);
    }

    #[test]
    fn views_share_their_input_and_extend_its_life() {
        // a = relu(x); v = reshape(a); b = relu(x); c = relu(b); out = v + c:
        // a lives until the add reads it through the view.
        let mut g = Graph::new();
        let x = placeholder(&mut g, "x", &[4, 64]);
        let a = relu(&mut g, x);
        let v = g.add(Reshape::new(vec![64, 4]), &[a]).unwrap();
        let v = g.add(Reshape::new(vec![4, 64]), &[v]).unwrap();
        let b = relu(&mut g, x);
        let c = relu(&mut g, b);
        let out = g.plus(v, c).unwrap();
        let plan = plan(&g, &[out]).unwrap();
        assert_sound(&plan);
        assert_eq!(
            plan.buffers.len(),
            4,
            "a, b, c, out: the reshapes have none"
        );
        let a_buf = plan.buffers.iter().find(|b| b.port == a).unwrap();
        let add_step = plan.buffers.iter().find(|b| b.port == out).unwrap().first;
        assert_eq!(a_buf.last, add_step);
        // a, b (until c runs) and c are alive together; then a, c and the sum.
        assert_eq!(plan.live_bytes, 3 * 1024);
    }

    #[test]
    fn assigned_values_are_not_in_the_arena() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![256]);
        let v = g.add_node("v", Box::new(Variable::new(ty)), &[]).unwrap();
        let next = relu(&mut g, v.into());
        let assign = g.add(AssignVariable, &[v.into(), next]).unwrap();
        let plan = plan(&g, &[assign]).unwrap();
        assert!(plan.buffers.is_empty(), "{:?}", plan.buffers);
        assert_eq!(plan.arena_bytes, 0);
    }

    /// `v -= 0.1 * relu(v)`, assigned back; with `late_reader`, `v` is also read by
    /// an Add of the update's result, which must run after it.
    fn update(late_reader: bool) -> (Graph, Vec<Port>) {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![256]);
        let v = g.add_node("v", Box::new(Variable::new(ty)), &[]).unwrap();
        let finite = g
            .add(
                Const::new(ampgraph_graph::Tensor::scalar(DType::Bool, 1.0)),
                &[],
            )
            .unwrap();
        let grad = relu(&mut g, v.into());
        let sgd = OptimizerUpdate::new(Rule::PLAIN_SGD, 0.1, 0.0);
        let next = g.add(sgd, &[finite, v.into(), grad]).unwrap();
        let mut fetches = vec![g.add(AssignVariable, &[v.into(), next]).unwrap()];
        if late_reader {
            fetches.push(g.plus(next, v.into()).unwrap());
        }
        (g, fetches)
    }

    #[test]
    fn update_casts_find_each_grouped_members_cast_output() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![4]);
        let finite = g
            .add(
                Const::new(ampgraph_graph::Tensor::scalar(DType::Bool, 1.0)),
                &[],
            )
            .unwrap();
        let (a, b) = (
            Port::from(
                g.add_node("a", Box::new(Variable::new(ty.clone())), &[])
                    .unwrap(),
            ),
            Port::from(g.add_node("b", Box::new(Variable::new(ty)), &[]).unwrap()),
        );
        let casts: Vec<Port> = [a, b]
            .into_iter()
            .map(|v| g.add(Cast { to: DType::F16 }, &[v]).unwrap())
            .collect();
        let (ga, gb) = (relu(&mut g, a), relu(&mut g, b));
        // Plain SGD with a cast: each member's outputs are its variable and its cast.
        let sgd = OptimizerUpdate {
            cast_to: Some(DType::F16),
            ..OptimizerUpdate::new(Rule::PLAIN_SGD, 0.1, 0.0)
        };
        let grouped = g
            .add_node(
                "grouped",
                Box::new(GroupedOptimizerUpdate {
                    update: sgd,
                    members: 2,
                }),
                &[finite, a, ga, finite, b, gb],
            )
            .unwrap();
        for (target, k) in [(a, 0), (b, 2)] {
            g.add(AssignVariable, &[target, Port::new(grouped, k)])
                .unwrap();
        }
        let found = update_casts(&g);
        assert_eq!(
            found,
            vec![
                (casts[0], "a".to_string(), Port::new(grouped, 1)),
                (casts[1], "b".to_string(), Port::new(grouped, 3)),
            ]
        );
    }

    /// A weight `w` (1024 f32), its f16 cast read by `relu(cast)` (fetched), and an
    /// SGD update writing `w` and its next cast; with `late_reader`, a fetched value
    /// adds the old cast to the new one too (a read after the update).
    fn update_with_cast(late_reader: bool) -> (Graph, Vec<Port>, Port) {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![1024]);
        let w: Port = g
            .add_node("w", Box::new(Variable::new(ty)), &[])
            .unwrap()
            .into();
        let finite = g
            .add(
                Const::new(ampgraph_graph::Tensor::scalar(DType::Bool, 1.0)),
                &[],
            )
            .unwrap();
        let cast = g.add(Cast { to: DType::F16 }, &[w]).unwrap();
        let read = relu(&mut g, cast);
        let grad = relu(&mut g, w);
        let sgd = OptimizerUpdate {
            cast_to: Some(DType::F16),
            ..OptimizerUpdate::new(Rule::PLAIN_SGD, 0.1, 0.0)
        };
        let update = g.add(sgd, &[finite, w, grad]).unwrap();
        let next_cast = Port::new(update.node, 1);
        let assign = g.add(AssignVariable, &[w, update]).unwrap();
        let mut fetches = vec![read, assign];
        if late_reader {
            fetches.push(g.plus(cast, next_cast).unwrap());
        }
        (g, fetches, next_cast)
    }

    #[test]
    fn an_update_writes_its_cast_over_the_kept_one_when_every_reader_ran_before() {
        let (g, fetches, next_cast) = update_with_cast(false);
        let layout = StepLayout::new(&g, &fetches, &HashMap::new(), &HashSet::new()).unwrap();
        assert_eq!(layout.casts_in_place, HashSet::from([next_cast]));
        // The step writes w in place and its cast over the kept one: nothing beside.
        let footprint = step_footprint(&g, &fetches, &HashMap::new()).unwrap();
        assert_eq!(footprint.kept_cast_bytes, 2048);
        assert_eq!(footprint.written_bytes, 0);
        // The old cast read after the update: the new one needs a buffer of its own.
        let (g, fetches, next_cast) = update_with_cast(true);
        let layout = StepLayout::new(&g, &fetches, &HashMap::new(), &HashSet::new()).unwrap();
        assert!(layout.casts_in_place.is_empty());
        let footprint = step_footprint(&g, &fetches, &HashMap::new()).unwrap();
        assert_eq!(footprint.written_bytes, 2048);
        // Fetching the new cast, or not assigning the update, keeps it apart too.
        let (g, mut fetches, _) = update_with_cast(false);
        fetches.push(next_cast);
        assert!(
            (StepLayout::new(&g, &fetches, &HashMap::new(), &HashSet::new()).unwrap())
                .casts_in_place
                .is_empty()
        );
        let (g, fetches, next_cast) = update_with_cast(false);
        let unassigned = [fetches[0], next_cast.node.into()];
        assert!(
            (StepLayout::new(&g, &unassigned, &HashMap::new(), &HashSet::new()).unwrap())
                .casts_in_place
                .is_empty()
        );
    }

    #[test]
    fn a_grouped_update_overwrites_each_members_variable_and_slot() {
        let mut g = Graph::new();
        let var = |g: &mut Graph, name: &str| -> Port {
            let ty = TensorType::new(DType::F32, vec![8]);
            g.add_node(name, Box::new(Variable::new(ty)), &[])
                .unwrap()
                .into()
        };
        let (v, mv, u, mu) = (
            var(&mut g, "v"),
            var(&mut g, "v/momentum"),
            var(&mut g, "u"),
            var(&mut g, "u/momentum"),
        );
        let finite = g
            .add(
                Const::new(ampgraph_graph::Tensor::scalar(DType::Bool, 1.0)),
                &[],
            )
            .unwrap();
        let (gv, gu) = (relu(&mut g, v), relu(&mut g, u));
        let momentum = OptimizerUpdate::new(
            Rule::Sgd {
                momentum: 0.9,
                nesterov: false,
            },
            0.1,
            0.0,
        );
        let grouped = g
            .add_node(
                "grouped",
                Box::new(GroupedOptimizerUpdate {
                    update: momentum,
                    members: 2,
                }),
                &[finite, v, gv, mv, finite, u, gu, mu],
            )
            .unwrap();
        let fetches: Vec<Port> = [v, mv, u, mu]
            .into_iter()
            .enumerate()
            .map(|(k, target)| {
                g.add(AssignVariable, &[target, Port::new(grouped, k)])
                    .unwrap()
            })
            .collect();
        let mut found = in_place_updates(&g, &fetches).unwrap();
        found.sort_by_key(|(port, _)| port.index);
        let names: Vec<&str> = found
            .iter()
            .map(|(_, var)| g.node(*var).name.as_str())
            .collect();
        assert_eq!(names, ["v", "v/momentum", "u", "u/momentum"]);
        assert!(found
            .iter()
            .enumerate()
            .all(|(k, (port, _))| *port == Port::new(grouped, k)));
    }

    #[test]
    fn delayed_scalings_state_is_written_in_place_unless_fetched() {
        let mut g = Graph::new();
        let mut variable = |name: &str, shape: Vec<usize>| -> NodeId {
            g.add_node(
                name,
                Box::new(Variable::new(TensorType::new(DType::F32, shape))),
                &[],
            )
            .unwrap()
        };
        let state = [
            variable("history", vec![16]),
            variable("scale", vec![]),
            variable("scale_inv", vec![]),
        ];
        let amax = placeholder(&mut g, "amax", &[]);
        let [history, scale, scale_inv] = state;
        let update = g
            .add(
                Fp8ScaleUpdate {
                    scale: Fp8Scale::new(DType::F8E4M3, 0).unwrap(),
                    amax: AmaxChoice::Max,
                    members: 1,
                },
                &[history.into(), amax, scale.into(), scale_inv.into()],
            )
            .unwrap();
        let mut fetches: Vec<Port> = state
            .iter()
            .enumerate()
            .map(|(k, &var)| {
                g.add(AssignVariable, &[var.into(), Port::new(update.node, k)])
                    .unwrap()
            })
            .collect();
        let mut found = in_place_updates(&g, &fetches).unwrap();
        found.sort_by_key(|(port, _)| port.index);
        let expected: Vec<(Port, NodeId)> = state
            .iter()
            .enumerate()
            .map(|(k, &var)| (Port::new(update.node, k), var))
            .collect();
        assert_eq!(found, expected);
        // A fetched scale keeps its buffer: the update's goes elsewhere.
        fetches.push(scale.into());
        let mut found = in_place_updates(&g, &fetches).unwrap();
        found.sort_by_key(|(port, _)| port.index);
        assert_eq!(found, [expected[0], expected[2]]);
    }

    #[test]
    fn an_update_overwrites_its_variable_only_when_no_one_reads_it_later() {
        let (g, fetches) = update(false);
        let found = in_place_updates(&g, &fetches).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(g.node(found[0].1).name, "v");
        let (g, fetches) = update(true);
        assert!(in_place_updates(&g, &fetches).unwrap().is_empty());
    }

    #[test]
    fn casts_of_variables_no_one_writes_are_constant_and_outside_the_arena() {
        let (mut g, mut fetches) = update(false);
        let ty = TensorType::new(DType::F32, vec![256]);
        let w = g.add_node("w", Box::new(Variable::new(ty)), &[]).unwrap();
        let w16 = g.add(Cast { to: DType::F16 }, &[w.into()]).unwrap();
        let v = g.find("v").unwrap();
        let v16 = g.add(Cast { to: DType::F16 }, &[v.into()]).unwrap();
        fetches.extend([w16, v16]);
        // v is assigned: only w's cast holds from step to step.
        assert_eq!(constant_casts(&g), vec![(w16, "w".to_string())]);
        let inside = plan(&g, &fetches).unwrap();
        let outside = plan_outside(
            &g,
            &fetches,
            &[w16].into_iter().collect(),
            &Default::default(),
        )
        .unwrap();
        assert!(inside.buffers.iter().any(|b| b.port == w16));
        assert!(!outside.buffers.iter().any(|b| b.port == w16));
    }

    #[test]
    fn a_variable_read_elsewhere_or_fetched_is_not_read_only_through_casts() {
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![64]);
        let mut var = |name: &str| {
            g.add_node(name, Box::new(Variable::new(ty.clone())), &[])
                .unwrap()
        };
        let (a, b, c) = (var("a"), var("b"), var("c"));
        let cast = |g: &mut Graph, x: NodeId| g.add(Cast { to: DType::F16 }, &[x.into()]).unwrap();
        let (a16, b16, c16) = (cast(&mut g, a), cast(&mut g, b), cast(&mut g, c));
        // b is also read in f32 (a Relu); c is fetched.
        let b_sum = relu(&mut g, b.into());
        let fetches = vec![a16, b16, c16, b_sum, c.into()];
        let casts = constant_casts(&g);
        assert_eq!(casts.len(), 3);
        let only = read_only_through_casts(&g, &fetches, &casts);
        assert_eq!(only, [a].into_iter().collect());
    }

    #[test]
    fn a_footprint_counts_what_lives_beside_the_arena() {
        // v's update is written in place unless v is read after it; the finite flag
        // is a Const.
        for (late_reader, written) in [(false, 0), (true, 1024)] {
            let (g, fetches) = update(late_reader);
            let f = step_footprint(&g, &fetches, &Default::default()).unwrap();
            assert_eq!((f.variables, f.variable_bytes), (1, 1024));
            assert_eq!((f.fed_bytes, f.kept_cast_bytes), (0, 0));
            assert_eq!(f.constant_bytes, ALIGNMENT);
            assert_eq!(f.written_bytes, written, "late reader: {late_reader}");
        }
        // An inference step: x fed, w kept as its f16 cast (256 f16 values).
        let mut g = Graph::new();
        let x = placeholder(&mut g, "x", &[256]);
        let ty = TensorType::new(DType::F32, vec![256]);
        let w = g.add_node("w", Box::new(Variable::new(ty)), &[]).unwrap();
        let w16 = g.add(Cast { to: DType::F16 }, &[w.into()]).unwrap();
        let x16 = g.add(Cast { to: DType::F16 }, &[x]).unwrap();
        let y = g.mul(x16, w16).unwrap();
        let f = step_footprint(&g, &[y], &Default::default()).unwrap();
        assert_eq!(kept_casts(&g), [w16].into_iter().collect());
        assert_eq!((f.fed_bytes, f.variable_bytes), (1024, 1024));
        assert_eq!(f.kept_cast_bytes, 512);
        assert!(!f.plan.buffers.iter().any(|b| b.port == w16));
        assert_eq!(f.plan.arena_bytes, 2 * 512, "x16 and y");
        // w, read only through its kept cast, is dropped before the arena.
        assert_eq!(f.cast_only_bytes, 1024);
        assert_eq!(f.peak_bytes(), 1024 + 512 + 2 * 512);
        let report = f.report(&g, 5);
        for field in [
            "planned peak: 2560 bytes",
            "kept casts: 512 bytes",
            "dropped before the arena: 1024 bytes",
            "  mul (",
        ] {
            assert!(report.contains(field), "{field} in {report}");
        }
        // A large weight and a small step: the peak is before the arena, the weight
        // beside its cast.
        let mut g = Graph::new();
        let ty = TensorType::new(DType::F32, vec![4096]);
        let w = g.add_node("w", Box::new(Variable::new(ty)), &[]).unwrap();
        let w16 = g.add(Cast { to: DType::F16 }, &[w.into()]).unwrap();
        let y = relu(&mut g, w16);
        let f = step_footprint(&g, &[y], &Default::default()).unwrap();
        assert_eq!(f.plan.arena_bytes, 8192);
        assert_eq!(f.peak_bytes(), 16384 + 8192);
    }

    #[test]
    fn fetched_values_live_to_the_end() {
        let mut g = Graph::new();
        let x = placeholder(&mut g, "x", &[256]);
        let early = relu(&mut g, x);
        let mut h = early;
        for _ in 0..4 {
            h = relu(&mut g, h);
        }
        let plan = plan(&g, &[early, h]).unwrap();
        assert_sound(&plan);
        let kept = plan.buffers.iter().find(|b| b.port == early).unwrap();
        assert_eq!(kept.last, 6, "past the last of the 6 steps (x and 5 relus)");
        assert_eq!(plan.arena_bytes, 3 * 1024);
    }
}
