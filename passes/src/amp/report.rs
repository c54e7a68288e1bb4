//! What the AMP pass did and why: the Grappler-style summary (docs/design.md §5), per-op
//! counts, explanations of single nodes, and the before/after dumps.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use ampgraph_graph::format::{self, GraphDef};
use ampgraph_graph::ops::Cast;
use ampgraph_graph::{DType, Graph, NodeId};

use super::fp8::{self, Decision, Fp8Stats};
use super::lists::ListClass;
use super::paint::{Painting, Step, NONE};
use super::rewrite::{self, RewriteStats};
use super::AmpConfig;
use crate::{PassError, PassSummary};

/// Counts of one op type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub total: usize,
    pub converted: usize,
    pub blocked: usize,
}

impl OpCounts {
    fn add(&mut self, other: &OpCounts) {
        self.total += other.total;
        self.converted += other.converted;
        self.blocked += other.blocked;
    }
}

/// What one denylisted op type kept in f32.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DenyCounts {
    /// Its own nodes (in f32).
    pub nodes: usize,
    /// Other nodes kept in f32 because of them.
    pub blocked: usize,
}

#[derive(Clone, Debug)]
pub struct AmpReport {
    pub target: DType,
    /// Nodes not fetched whose type is f32: the candidates.
    pub processable: usize,
    /// Processable nodes whose op is in some list.
    pub recognized: usize,
    pub allowlisted_converted: usize,
    /// Denylisted nodes (in f32).
    pub denylisted: usize,
    /// Other nodes kept in f32 by deny propagation.
    pub blocked: usize,
    pub per_op: BTreeMap<&'static str, OpCounts>,
    /// Per denylisted op type: its nodes kept in f32, and the nodes they blocked
    /// (each blocked node counted under the deny node its blocking starts from).
    pub per_deny_op: BTreeMap<&'static str, DenyCounts>,
    /// Indexed by `NodeId::index()`: the node was kept in f32 by a deny op.
    pub denied: Vec<bool>,
    pub stats: RewriteStats,
    /// What the FP8 phase did, where it ran.
    pub fp8: Option<Fp8Stats>,
}

impl AmpReport {
    /// The decisions of a painting, before the rewrite adds its counts.
    pub(crate) fn decisions(p: &Painting, config: &AmpConfig) -> AmpReport {
        let mut r = AmpReport {
            target: config.target,
            processable: 0,
            recognized: 0,
            allowlisted_converted: 0,
            denylisted: 0,
            blocked: 0,
            per_op: BTreeMap::new(),
            per_deny_op: BTreeMap::new(),
            denied: vec![false; p.node.iter().map(|n| n.index() + 1).max().unwrap_or(0)],
            stats: RewriteStats::default(),
            fp8: None,
        };
        let mut per_op = vec![OpCounts::default(); p.op_names.len()];
        for &id in &p.order {
            let v = p.primary(id) as usize;
            let counts = &mut per_op[p.op[v] as usize];
            counts.total += 1;
            if !p.is_f32[v] {
                continue;
            }
            let converted = p.allow[v];
            let class = p.class[v];
            if p.process[v] {
                r.processable += 1;
                r.recognized += usize::from(class.is_some());
            }
            if converted {
                counts.converted += 1;
                r.allowlisted_converted += usize::from(class == Some(ListClass::Allow));
            } else if p.deny[v] {
                r.denied[id.index()] = true;
                let root = p.op_names[p.op[deny_root(p, v)] as usize];
                let by_deny = r.per_deny_op.entry(root).or_default();
                if class == Some(ListClass::Deny) {
                    r.denylisted += 1;
                    by_deny.nodes += 1;
                } else {
                    counts.blocked += 1;
                    r.blocked += 1;
                    by_deny.blocked += 1;
                }
            }
        }
        for (name, counts) in p.op_names.iter().zip(per_op) {
            r.per_op.entry(name).or_default().add(&counts);
        }
        r
    }

    pub(crate) fn with_stats(mut self, stats: RewriteStats) -> AmpReport {
        self.stats = stats;
        self
    }

    /// The summary in the words of TensorFlow's Grappler report.
    pub fn summary(&self) -> PassSummary {
        let half = if self.target == DType::BF16 {
            "BF16"
        } else {
            "FP16"
        };
        let mut lines = vec![
            format!("Total processable nodes: {}", self.processable),
            format!(
                "Recognized nodes available for conversion: {}",
                self.recognized
            ),
            format!("Total nodes converted: {}", self.stats.nodes_converted),
            format!(
                "Total {half} Cast ops used (excluding Const and Variable casts): {}",
                self.stats.casts_to_half
            ),
            format!(
                "Allowlisted nodes converted: {}",
                self.allowlisted_converted
            ),
            format!("Denylisted nodes blocking conversion: {}", self.denylisted),
            format!(
                "Nodes blocked from conversion by denylisted nodes: {}",
                self.blocked
            ),
        ];
        if let Some(f) = &self.fp8 {
            let constants = match f.constants {
                0 => String::new(),
                n => format!("; constants quantised once by the pass: {n}"),
            };
            lines.push(format!(
                "FP8 GEMMs (E4M3 forward, E5M2 gradients): {}; kept {half} by the cost model: {}, as first/last or listed layers: {}, as products of two gradients: {}{constants}",
                f.gemms, f.kept_by_cost, f.kept_by_layer, f.kept_both_gradients
            ));
        }
        PassSummary {
            title: "Automatic Mixed Precision Grappler Pass Summary:".into(),
            lines,
        }
    }

    /// The summary plus per-op counts and cast details, for `ampgraph rewrite --report`.
    pub fn detailed(&self) -> String {
        let mut s = self.summary().to_string();
        let st = &self.stats;
        let _ = writeln!(
            s,
            "Casts inserted: {} to {}, {} of Variables to {}, {} back to f32; Consts stored in {}: {}",
            st.casts_to_half, self.target, st.variable_casts, self.target, st.casts_to_f32, self.target, st.consts_folded
        );
        let _ = writeln!(
            s,
            "{:<20} {:>7} {:>10} {:>8}",
            "op", "nodes", "converted", "blocked"
        );
        for (op, c) in &self.per_op {
            let _ = writeln!(
                s,
                "{op:<20} {:>7} {:>10} {:>8}",
                c.total, c.converted, c.blocked
            );
        }
        if !self.per_deny_op.is_empty() {
            let _ = writeln!(s, "Kept in f32 by denylisted ops:");
            let _ = writeln!(
                s,
                "{:<20} {:>7} {:>12}",
                "denylisted op", "nodes", "and blocked"
            );
            for (op, c) in &self.per_deny_op {
                let _ = writeln!(s, "{op:<20} {:>7} {:>12}", c.nodes, c.blocked);
            }
        }
        s
    }

    /// Node colours for DOT dumps: 16-bit, f32 left alone, f32 blocked by deny, casts.
    pub fn color(&self, g: &Graph, id: NodeId) -> &'static str {
        let n = g.node(id);
        if n.op.is::<Cast>() {
            "#ffe08a"
        } else if n.outputs().first().is_some_and(|t| t.dtype.is_half()) {
            "#9be39b"
        } else if self.denied.get(id.index()).copied().unwrap_or(false) {
            "#f4a7a7"
        } else if n.outputs().first().is_some_and(|t| t.dtype == DType::F32) {
            "#cfe2ff"
        } else {
            "#eeeeee"
        }
    }
}

/// Why one node has its precision.
#[derive(Clone, Debug, PartialEq)]
pub struct Explanation {
    pub node: String,
    pub op: String,
    pub class: Option<ListClass>,
    /// The dtype the node produces after the rewrite.
    pub dtype: DType,
    pub reasons: Vec<String>,
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "node '{}' ({}): {}", self.node, self.op, self.dtype)?;
        match self.class {
            Some(c) => writeln!(f, "  list: {c}")?,
            None => writeln!(f, "  list: none")?,
        }
        for r in &self.reasons {
            writeln!(f, "  {r}")?;
        }
        Ok(())
    }
}

/// `name` (Op) of a vertex's node.
fn label(g: &Graph, p: &Painting, v: u32) -> String {
    let n = g.node(p.node[v as usize]);
    format!("'{}' ({})", n.name, n.op.name())
}

/// The chain of `parent` links from `v` back to where the decision started.
/// The vertex a blocked vertex's blocking starts from (itself for a deny node).
fn deny_root(p: &Painting, v: usize) -> usize {
    let mut cur = v;
    // Parents form chains back to a root; the bound guards against a malformed one.
    for _ in 0..p.parent.len() {
        match p.parent[cur] {
            NONE => break,
            next => cur = next as usize,
        }
    }
    cur
}

fn chain(g: &Graph, p: &Painting, v: u32) -> Vec<String> {
    let mut out = vec![g.node(p.node[v as usize]).name.clone()];
    let mut cur = p.parent[v as usize];
    while cur != NONE && out.len() < 10_000 {
        out.push(g.node(p.node[cur as usize]).name.clone());
        cur = p.parent[cur as usize];
    }
    out
}

/// Explains the decision on node `name` of `g` (the graph before the rewrite).
pub fn explain(
    g: &Graph,
    p: &Painting,
    config: &AmpConfig,
    name: &str,
) -> Result<Explanation, PassError> {
    let id = g.require(name)?;
    let node = g.node(id);
    let v = p.primary(id);
    let i = v as usize;
    let t = config.target;
    let dtype = node
        .outputs()
        .first()
        .map(|t| t.dtype)
        .unwrap_or(DType::F32);
    let converted = p.allow[i] && p.is_f32[i];
    let mut reasons = Vec::new();
    let op = node.op.name();
    if !p.process[i] {
        reasons.push(
            "kept: it is a graph output, and fetched tensors keep their declared type".into(),
        );
    } else if !p.is_f32[i] {
        reasons.push(format!(
            "kept: its type is {dtype}; only f32 tensors are converted"
        ));
    } else if converted {
        reasons.push(match p.step[i] {
            Step::Allowlisted => format!("converted: {op} is allowlisted (always worth running in {t})"),
            Step::BetweenAllow => format!(
                "converted: it lies between allowlisted ops, on the path {}",
                chain(g, p, v).join(" -> ")
            ),
            Step::FollowsAllow => {
                let mut path = chain(g, p, v);
                path.reverse();
                format!("converted: it is fed in {t} along {} (infer ops follow their inputs)", path.join(" -> "))
            }
            Step::ClearNextToAllow => format!(
                "converted: clear op next to {}, which runs in {t} (clear ops follow their neighbours)",
                label(g, p, p.parent[i])
            ),
            Step::CastToHalf => format!("converted: every consumer runs in {t}, so this Cast produces {t} directly"),
            Step::FromConstants => format!("converted: it is computed from constants alone and every reader runs in {t}, so its constants are stored in {t} rather than its result cast"),
            Step::None | Step::Denied => "converted".into(),
        });
    } else if let Some(why) = config.lists.kept_f32(name).filter(|_| p.deny[i]) {
        reasons.push(format!("kept in f32: {why}"));
    } else if p.deny[i] && p.class[i] == Some(ListClass::Deny) {
        reasons.push(format!(
            "kept in f32: {op} is denylisted (numerically unsafe in {t})"
        ));
    } else if p.deny[i] {
        let mut path = chain(g, p, v);
        path.reverse();
        let root = path.first().cloned().unwrap_or_default();
        let root_op = g.find(&root).map(|r| g.node(r).op.name()).unwrap_or("?");
        reasons.push(format!(
            "kept in f32: blocked by denylisted node '{root}' ({root_op}) along {}",
            path.join(" -> ")
        ));
    } else {
        match p.class[i] {
            None => reasons.push(format!(
                "kept in f32: {op} is in no list; ops in no list always run in f32"
            )),
            Some(ListClass::Infer) => {
                let denied: Vec<u32> = p
                    .fanin(v)
                    .iter()
                    .copied()
                    .filter(|&f| p.deny[f as usize])
                    .collect();
                if let Some(&f) = denied.first() {
                    let mut path = chain(g, p, f);
                    path.reverse();
                    reasons.push(format!(
                        "kept in f32: its input {} is blocked ({}), and an infer op never mixes with a blocked input",
                        label(g, p, f),
                        path.join(" -> ")
                    ));
                } else if let Some(&f) = (p.fanin(v).iter()).find(|&&f| {
                    matches!(
                        p.step[f as usize],
                        Step::ClearNextToAllow | Step::CastToHalf
                    )
                }) {
                    // The input went 16-bit in a later phase than the one in which
                    // infer ops follow their inputs: TensorFlow's order, kept here.
                    let how = match p.step[f as usize] {
                        Step::ClearNextToAllow => {
                            format!(
                                ", as a clear op next to {}",
                                label(g, p, p.parent[f as usize])
                            )
                        }
                        _ => ", as a Cast all of whose consumers run in it".into(),
                    };
                    reasons.push(format!(
                        "kept in f32: no input ran in {t} when infer ops took their inputs' \
                         precision; its input {} went {t} afterwards{how} (TensorFlow's \
                         order of phases)",
                        label(g, p, f),
                    ));
                } else {
                    reasons.push(format!(
                        "kept in f32: no input runs in {t} (infer ops follow their inputs)"
                    ));
                }
            }
            Some(ListClass::Clear) => reasons.push(format!(
                "kept in f32: no neighbour runs in {t} (clear ops follow their neighbours)"
            )),
            Some(ListClass::Allow) | Some(ListClass::Deny) => reasons.push("kept in f32".into()),
        }
    }
    if let (Some(fp8), true) = (&config.fp8, converted) {
        if let Some(reason) = fp8_reason(g, p, config, fp8, id)? {
            reasons.push(reason);
        }
    }
    // The inputs' precision after the rewrite, for context.
    let inputs: Vec<String> = g
        .inputs(id)
        .iter()
        .map(|port| {
            let half = p
                .output_vertex(port.node, port.index)
                .is_some_and(|u| p.allow[u as usize] && p.is_f32[u as usize]);
            let ty = if half { t } else { g.ty(*port).dtype };
            format!("{} ({ty})", g.port_name(*port))
        })
        .collect();
    if !inputs.is_empty() {
        reasons.push(format!("inputs: {}", inputs.join(", ")));
    }
    Ok(Explanation {
        node: name.to_string(),
        op: op.to_string(),
        class: p.class[i],
        dtype: if converted { t } else { dtype },
        reasons,
    })
}

/// The FP8 phase's decision on node `id` of `g` (before the rewrite), where it is a
/// product the phase considered.
fn fp8_reason(
    g: &Graph,
    p: &Painting,
    config: &AmpConfig,
    fp8: &fp8::Fp8Config,
    id: NodeId,
) -> Result<Option<String>, PassError> {
    let mut after = g.clone();
    rewrite::apply(&mut after, p, config.target)?;
    let plan = fp8::plan(&after, fp8)?;
    let t = config.target;
    Ok(plan.decision(id).map(|d| match d {
        Decision::Fp8 { a, b } => format!(
            "FP8: its operands are stored in {a} and {b} (accumulated in f32, the result in {t})"
        ),
        Decision::Kept(why) => format!("kept {t} rather than FP8: {why}"),
    }))
}

/// Writes the graph before and after the rewrite into `dir`: JSON, DOT coloured by
/// precision and, where Graphviz is installed, SVG.
pub(crate) fn dump(
    dir: &Path,
    before: &Graph,
    after: &Graph,
    report: &AmpReport,
) -> Result<(), PassError> {
    static RUN: AtomicUsize = AtomicUsize::new(0);
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| PassError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let stem = format!(
        "ampgraph_amp_{}_{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    );
    for (phase, g) in [("before", before), ("after", after)] {
        let json = dir.join(format!("{stem}_{phase}.json"));
        format::write_atomic(&json, format::to_json(&GraphDef::from_graph(g)).as_bytes())?;
        let dot = dir.join(format!("{stem}_{phase}.dot"));
        let text = format::to_dot(g, &|g, id| report.color(g, id));
        format::write_atomic(&dot, text.as_bytes())?;
        let svg = dir.join(format!("{stem}_{phase}.svg"));
        // SVG only where Graphviz is installed; its absence is not an error.
        let _ = std::process::Command::new("dot")
            .arg("-Tsvg")
            .arg(&dot)
            .arg("-o")
            .arg(&svg)
            .stderr(std::process::Stdio::null())
            .status();
    }
    log::info!(
        "AMP graphs dumped to {}/{stem}_{{before,after}}.{{json,dot}}",
        dir.display()
    );
    Ok(())
}
