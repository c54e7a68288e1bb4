//! `ampgraph bench MODEL`: a model's inference step timed as a session runs it
//! (trtexec for ampgraph). The step runs `warmup` times, then `iterations` times
//! timed: per step its device time (CUDA events around the step's work, as
//! `torch.cuda.Event`s around a PyTorch step), its wall time (the host's clock around
//! the whole call, the fetches' download included) and the host time until its last
//! launch was on the stream (enqueue). Each step's inputs are copied to the device
//! while the step before it computes (pinned buffers and a copy stream, as a serving
//! loop or PyTorch's DataLoader with `pin_memory` feed a model), unless the step is to
//! upload them itself. Reported: median, p90 and p99 of each, throughput, the
//! device's peak memory during the timed steps and how the step was launched.

use std::time::Instant;

use serde::Serialize;

use ampgraph_exec::{ExecOptions, Feeds, Staged};
use ampgraph_graph::ops::{Const, Placeholder, Variable};
use ampgraph_graph::{DType, Graph, Tensor};

use crate::session::{Device, Session, SessionError, SessionOptions};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The AMP rewrite's 16-bit type; `None`: as the graph is (marked or not).
    pub amp: Option<DType>,
    pub device: Device,
    pub warmup: usize,
    pub iterations: usize,
    /// The model's float constants (weights) become Variables holding their values,
    /// as a training graph's weights are.
    pub weights_as_variables: bool,
    /// After the timed steps, this many steps profiled op by op.
    pub profile_steps: usize,
    /// Each timed step uploads its inputs itself, rather than finding them copied
    /// while the step before it ran.
    pub sync_feeds: bool,
    pub session: SessionOptions,
}

/// Percentiles of a list of milliseconds.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Spread {
    fn of(mut ms: Vec<f64>) -> Option<Spread> {
        if ms.is_empty() {
            return None;
        }
        ms.sort_by(f64::total_cmp);
        // Nearest rank: the smallest value with at least p% of the values at or below.
        let at =
            |p: f64| ms[((p / 100.0 * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
        Some(Spread {
            median: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
        })
    }
}

/// What `bench` measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub device: String,
    pub nodes: usize,
    /// Examples per step: the first dim of the first Placeholder (1 where it has none).
    pub batch: usize,
    pub iterations: usize,
    /// Device milliseconds per step (CUDA events from the step's first work to its
    /// last kernel; `None` on the CPU).
    pub device_ms: Option<Spread>,
    /// Wall milliseconds per step, download of the outputs included.
    pub wall_ms: Spread,
    /// Host milliseconds per step until its last launch (`None` on the CPU).
    pub enqueue_ms: Option<Spread>,
    /// Examples per second at the median wall time.
    pub throughput: f64,
    /// The device's peak memory during the timed steps (weights, the arena, the
    /// inputs).
    pub peak_mib: Option<f64>,
    /// How the last timed step was launched.
    pub launch: Option<String>,
    /// The per-op table of the profiled steps.
    pub profile: Option<String>,
}

/// Turns every float Const of more than one value into a Variable; their values, to
/// set once the session exists.
fn weights_to_variables(g: &mut Graph) -> Vec<(String, Tensor)> {
    let mut values = Vec::new();
    let ids: Vec<_> = g.node_ids().collect();
    for id in ids {
        let node = g.node(id);
        let Some(k) = node.op.downcast_ref::<Const>() else {
            continue;
        };
        let (Some(data), ty) = (&k.values, k.ty.clone()) else {
            continue;
        };
        if !ty.dtype.is_float() || data.len() < 2 {
            continue;
        }
        let Ok(t) = Tensor::shared(ty.shape.clone(), data.clone()) else {
            continue;
        };
        values.push((node.name.clone(), t));
        g.set_op(id, Box::new(Variable::new(ty)));
    }
    values
}

/// Runs `graph`'s outputs as `options` say, fed `feeds` (every Placeholder).
pub fn bench(
    mut graph: Graph,
    feeds: &Feeds,
    options: &BenchOptions,
) -> Result<BenchReport, SessionError> {
    if let Some(dtype) = options.amp {
        graph.mixed_precision = Some(dtype);
    }
    let weights = match options.weights_as_variables {
        true => weights_to_variables(&mut graph),
        false => Vec::new(),
    };
    let batch = (graph.node_ids())
        .map(|id| graph.node(id))
        .find(|n| n.op.is::<Placeholder>())
        .and_then(|n| n.outputs()[0].shape.first().copied())
        .unwrap_or(1);
    let mut session = Session::with_options(graph, options.device, options.session.clone())?;
    for (name, value) in weights {
        session.set_variable(&name, value)?;
    }
    let fetches = session.graph().outputs().to_vec();
    for _ in 0..options.warmup {
        session.run(&fetches, feeds)?;
    }
    let (mut device_ms, mut wall_ms, mut enqueue_ms) = (Vec::new(), Vec::new(), Vec::new());
    if let Some(stats) = session.executor().stats() {
        stats.reset_peak_bytes();
    }
    // Each step's inputs are copied to the device while the step before computes
    // (a serving loop's or a DataLoader's pinned, non-blocking copies), unless
    // `sync_feeds`: then each step uploads its own.
    let mut staged = Some(Staged::host(feeds.clone()));
    for _ in 0..options.iterations.max(1) {
        let start = Instant::now();
        let device = match options.sync_feeds {
            true => session.run_timed(&fetches, feeds)?.1,
            false => {
                let current = staged.take().unwrap_or_else(|| Staged::host(feeds.clone()));
                let step = session.run_overlapped(&fetches, current, Some(feeds.clone()))?;
                staged = step.next;
                step.device_ms
            }
        };
        wall_ms.push(start.elapsed().as_secs_f64() * 1e3);
        device_ms.extend(device);
        if let Some(step) = session.executor().stats().map(|s| s.last_step()) {
            enqueue_ms.push(step.host_enqueue_secs * 1e3);
        }
    }
    let stats = session.executor().stats();
    let launch = stats.map(|s| s.last_step().launch);
    let peak_mib = stats.map(|s| s.peak_bytes() as f64 / (1 << 20) as f64);
    let profile = match options.profile_steps {
        0 => None,
        n => {
            let plain = session.executor().options();
            session.executor_mut().set_options(ExecOptions {
                profile: true,
                ..plain
            });
            for _ in 0..n {
                session.run(&fetches, feeds)?;
            }
            session.executor_mut().set_options(plain);
            session.executor().stats().map(|s| s.profile_table(25))
        }
    };
    let wall = Spread::of(wall_ms).unwrap_or(Spread {
        median: 0.0,
        p90: 0.0,
        p99: 0.0,
    });
    Ok(BenchReport {
        device: session.executor().device_name(),
        nodes: session.graph_for(&fetches).len(),
        batch,
        iterations: options.iterations.max(1),
        device_ms: Spread::of(device_ms),
        enqueue_ms: Spread::of(enqueue_ms),
        throughput: batch as f64 / (wall.median / 1e3),
        wall_ms: wall,
        peak_mib,
        launch,
        profile,
    })
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let spread =
            |s: &Spread| format!("median {:.3}, p90 {:.3}, p99 {:.3}", s.median, s.p90, s.p99);
        writeln!(
            f,
            "device: {} ({} nodes, batch {})",
            self.device, self.nodes, self.batch
        )?;
        if let Some(launch) = &self.launch {
            writeln!(f, "steps: {launch}")?;
        }
        writeln!(f, "iterations: {}", self.iterations)?;
        if let Some(d) = &self.device_ms {
            writeln!(f, "device ms per step: {}", spread(d))?;
        }
        if let Some(e) = &self.enqueue_ms {
            writeln!(f, "host enqueue ms per step: {}", spread(e))?;
        }
        writeln!(f, "wall ms per step: {}", spread(&self.wall_ms))?;
        writeln!(f, "throughput: {:.1} examples/s", self.throughput)?;
        if let Some(p) = self.peak_mib {
            writeln!(f, "peak device memory: {p:.1} MiB")?;
        }
        if let Some(table) = &self.profile {
            write!(f, "{table}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{weights_to_variables, Spread};
    use crate::session::{Device, Session};
    use ampgraph_graph::ops::{Const, Variable};
    use ampgraph_graph::{DType, Graph, Tensor};

    /// The float constants of more than one value become Variables holding their
    /// values: the step computes the same outputs; a scalar stays a Const.
    #[test]
    fn weights_become_variables_with_their_values() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [2, 3]).unwrap();
        let w =
            Tensor::from_f64(DType::F32, vec![3, 2], &[1.0, -2.0, 0.5, 3.0, -1.5, 2.5]).unwrap();
        let w = g.add(Const::new(w), &[]).unwrap();
        let y = g.matmul(x, w).unwrap();
        let two = g.scalar(DType::F32, 2.0).unwrap();
        let y = g.mul(y, two).unwrap();
        g.set_outputs(vec![y]).unwrap();
        let feeds = [(
            "x".to_string(),
            Tensor::from_f64(DType::F32, vec![2, 3], &[0.5, 1.0, -1.0, 2.0, 0.25, -0.5]).unwrap(),
        )]
        .into();
        let want = Session::new(g.clone(), Device::Cpu)
            .unwrap()
            .run(&[y], &feeds)
            .unwrap();
        let mut converted = g.clone();
        let values = weights_to_variables(&mut converted);
        assert_eq!(values.len(), 1, "the weight, not the scalar");
        assert!(converted.node(w.node).op.is::<Variable>());
        assert!(converted.node(two.node).op.is::<Const>());
        let mut s = Session::new(converted, Device::Cpu).unwrap();
        for (name, value) in values {
            s.set_variable(&name, value).unwrap();
        }
        assert_eq!(s.run(&[y], &feeds).unwrap(), want);
    }

    #[test]
    fn percentiles_are_nearest_ranks() {
        let ms: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Spread::of(ms).unwrap();
        assert_eq!((s.median, s.p90, s.p99), (50.0, 90.0, 99.0));
        let s = Spread::of(vec![3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.p90, s.p99), (2.0, 3.0, 3.0));
        assert!(Spread::of(Vec::new()).is_none());
    }
}
