//! FP8 GEMMs (issue 44): after the 16-bit rewrite, the MatMuls that run in 16 bits take
//! FP8 operands where a cost model of their shapes says FP8 and its casts beat 16 bits
//! (products sharing a quantised tensor, a layer's three, decided together).
//!
//! A chosen product `MatMul(a, b)` becomes `Fp8MatMul(qa, qb, a_scale_inv,
//! b_scale_inv)`, its output still 16-bit: forward operands are stored in E4M3, a
//! gradient operand (a tensor computed from the gradient seed,
//! [`ampgraph_graph::autodiff::SEED_NAME`]) in E5M2, TransformerEngine's "hybrid"
//! format. Each quantised tensor is quantised once, whatever number of products
//! read it (a weight by its forward and its input-gradient product), with a transposed
//! copy where a product reads it the other way round from K-major (Hopper's FP8
//! products take `[m, k] x [n, k]`): every `Fp8MatMul` reads K-major operands. The
//! products sum in the GPU's fast mode, by default every one ([`FastAccumulation`]).
//!
//! Scaling lives in the graph ([`Fp8Recipe`]): current scaling computes each tensor's
//! scale from its own amax (`Fp8Scale`); delayed scaling keeps an amax history and a
//! scale per tensor in Variables (`ampgraph/fp8/<tensor>/<format>/amax_history`,
//! `.../scale`, `.../scale_inv`: [`STATE_PREFIX`]) that one `Fp8ScaleUpdate` per format
//! advances at the end of the training step, so checkpoints keep them; the products
//! read the inverse Variable and never wait for an update. A non-finite amax fails the
//! step's all-finite check, so a loss-scaled step is skipped as for an overflowing
//! gradient.
//!
//! Kept 16-bit ([`Kept`]): products whose layer is the first or the last of the
//! forward graph (both libraries' advice), listed ones, those the cost model refuses,
//! and products of two gradients (Hopper has no E5M2 x E5M2 product). A backward
//! product belongs to the layer of the forward product that reads its other operand.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use ampgraph_graph::autodiff::is_seed_name;
use ampgraph_graph::ops::{
    AllFinite, AmaxChoice, AssignVariable, BatchMatMul, Cast, Const, ElementOp, Fp8MatMul,
    Fp8Scale, Fp8ScaleUpdate, Group, Init, LayerNorm, LayerNormGrad, MatMul, QuantizeFp8, Variable,
};
use ampgraph_graph::{DType, Graph, NodeId, Op, Port, Tensor, TensorType};

use crate::rewrite::{cast_constant, node_error, output_nodes, remove_unread, through_casts};
use crate::PassError;

/// Where delayed scaling's Variables are named: precision state, not the model's, so
/// a checkpoint restores into a session with another precision (a session starts
/// the state it lacks afresh and skips the state it has no use for).
pub const STATE_PREFIX: &str = "ampgraph/fp8/";

/// How FP8 scales are computed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fp8Recipe {
    /// Each tensor's scale from its own amax, every step (torchao's default,
    /// "tensorwise"): one more read of the tensor, no state.
    Current,
    /// The scale from a history of earlier steps' amaxes (TransformerEngine's
    /// default: 1024 steps, `max`); the amax is measured while quantising. Its state
    /// is updated by the training step, so an inference graph cannot use it.
    Delayed { history: usize, amax: AmaxChoice },
    /// Each tensor's scale fixed at rewrite time from its amax on calibration inputs
    /// ([`Fp8Config::calibrated`], TensorRT's and ONNX Runtime's calibrated FP8): no
    /// amax pass, so a cast folds into the kernel computing its tensor as under delayed
    /// scaling; a value beyond the calibrated amax saturates. For inference graphs: a
    /// training step's tensors drift from their calibration.
    Static,
}

/// TransformerEngine's amax history length.
pub const DEFAULT_AMAX_HISTORY: usize = 1024;

impl Fp8Recipe {
    /// TransformerEngine's delayed scaling: a history of 1024 amaxes, scaled by their max.
    pub fn delayed() -> Self {
        Fp8Recipe::Delayed {
            history: DEFAULT_AMAX_HISTORY,
            amax: AmaxChoice::Max,
        }
    }
}

/// A GEMM's time on a device in 16 bits and in FP8 with its quantising casts: the
/// rule that keeps small products 16-bit, where the casts cost more than the faster
/// product saves (torchao measures 0.80x for a 1024x2048x1024 Linear on an H100 and
/// 1.39x for 4096x8192x16384).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCost {
    /// Dense 16-bit tensor-core rate, FLOP/s.
    pub half_flops: f64,
    /// Dense FP8 rate, FLOP/s.
    pub fp8_flops: f64,
    /// Memory bandwidth, bytes/s.
    pub bandwidth: f64,
    /// What one more kernel costs (replayed in a CUDA graph), seconds.
    pub launch: f64,
}

impl GemmCost {
    /// Hopper (an H100 SXM or an H200: 132 SMs, 989 and 1979 dense TFLOP/s) as our
    /// kernels run on it, measured on the H200 (`scripts/gemm_fp8_shapes.py`, the
    /// forty-third session): cuBLASLt's bf16 and FP8 products at 722 and 1301
    /// TFLOP/s at 8192x4096x4096 (641 and 990 at 8192x768x3072), 4 us a kernel with
    /// its scale and its gap; the quantising casts at about 3.3 TB/s (GPT-2's
    /// cast-transposes, 3.3-3.6 TB/s in the fifty-third session; 2.5 before their
    /// rewrite, when the model kept GPT-2's 768x768 attention output 16-bit, and
    /// converting it made the step 1.5% faster). At the peak rates the model put the
    /// transformer's d768 feed-forward products in FP8 under delayed scaling, and its
    /// step ran 2% slower than BF16's.
    pub const H100: GemmCost = GemmCost {
        half_flops: 700e12,
        fp8_flops: 1250e12,
        bandwidth: 3.3e12,
        launch: 4e-6,
    };

    /// Seconds of an `m x k` by `k x n` product in 16 bits (operands and output 16-bit).
    pub fn half_seconds(&self, m: usize, k: usize, n: usize) -> f64 {
        let (m, k, n) = (m as f64, k as f64, n as f64);
        let bytes = 2.0 * (m * k + k * n + m * n);
        (2.0 * m * k * n / self.half_flops).max(bytes / self.bandwidth)
    }

    /// Seconds of the same product with FP8 operands, its casts apart.
    pub fn fp8_product_seconds(&self, m: usize, k: usize, n: usize) -> f64 {
        let (m, k, n) = (m as f64, k as f64, n as f64);
        let bytes = m * k + k * n + 2.0 * m * n;
        (2.0 * m * k * n / self.fp8_flops).max(bytes / self.bandwidth)
    }

    /// Seconds of quantising one 16-bit tensor of `elements` values made at `site`,
    /// once for every product that reads it: reads of the 16-bit values, the FP8
    /// values and their transposed copy written, and its kernels.
    /// - Current scaling: one and a half reads and two kernels (the scale, the cast),
    ///   wherever the tensor is made. The amax is measured by the kernel computing the
    ///   tensor where an elementwise kernel does (`amax-into-elementwise`), by a read
    ///   of its own where a layer norm or a product does. (At one read the model put
    ///   the transformer's feed-forward layers in FP8 under current scaling: 0.99-1.00x
    ///   its BF16 step.)
    /// - Delayed scaling, by [`CastSite`]: the kernel computing a layer norm, its
    ///   gradient or an elementwise tensor casts it as it stores it (`norm-into-fp8`,
    ///   `norm-grad-into-fp8`, `activation-into-fp8`, `elementwise-into-fp8`: the FP8
    ///   writes only); the weights' casts run in one launch (`group-fp8-casts`: a read
    ///   and the writes); any other tensor (a product's, an attention's) is read by a
    ///   cast of its own (a read, the writes and a kernel).
    ///
    /// With the former charges (two reads and three kernels, one read and two) the
    /// model kept GPT-2 and the transformer 16-bit under current and delayed scaling,
    /// whose steps ran 1.04x and 1.06x faster with every layer but the first and last
    /// in FP8 (3c93ff2, 668142c). With half a read and a kernel for every cast under
    /// delayed scaling it kept the transformer's attention output (8192x768x768)
    /// 16-bit, whose step ran 2.7% faster with every product in FP8 (the fifty-fifth
    /// session).
    pub fn cast_seconds(&self, elements: usize, site: CastSite, recipe: Fp8Recipe) -> f64 {
        let (reads, kernels) = match (recipe, site) {
            (Fp8Recipe::Current, CastSite::Constant) => return 0.0,
            (Fp8Recipe::Current, _) => (1.5, 2.0),
            (Fp8Recipe::Delayed { .. }, CastSite::Computed) => (0.0, 0.0),
            (Fp8Recipe::Delayed { .. }, CastSite::Weight) => (1.0, 0.0),
            (Fp8Recipe::Delayed { .. }, CastSite::Alone | CastSite::Constant) => (1.0, 1.0),
            (Fp8Recipe::Static, CastSite::Constant) => return 0.0,
            (Fp8Recipe::Static, CastSite::Computed) => (0.0, 0.0),
            (Fp8Recipe::Static, CastSite::Weight | CastSite::Alone) => (1.0, 1.0),
        };
        elements as f64 * (2.0 * reads + 2.0) / self.bandwidth + kernels * self.launch
    }

    /// Products decided together (`products`, each `(m, k, n)`) in 16 bits, and in FP8
    /// with the tensors they quantise (`quantised`, each's values and where it is
    /// made, cast once), seconds.
    pub fn group_seconds(
        &self,
        products: &[(usize, usize, usize)],
        quantised: impl IntoIterator<Item = (usize, CastSite)>,
        recipe: Fp8Recipe,
    ) -> (f64, f64) {
        let half = (products.iter())
            .map(|&(m, k, n)| self.half_seconds(m, k, n))
            .sum();
        let casts = quantised.into_iter();
        let fp8 = (products.iter())
            .map(|&(m, k, n)| self.fp8_product_seconds(m, k, n))
            .chain(casts.map(|(e, site)| self.cast_seconds(e, site, recipe)))
            .sum();
        (half, fp8)
    }

    /// A Linear layer of `m` rows, `k` inputs and `n` outputs in training: its three
    /// products (forward, input and weight gradients) with its three quantised tensors
    /// (the input and the output gradient made at `sites`, the weight), as
    /// [`group_seconds`](Self::group_seconds).
    pub fn linear_seconds(
        &self,
        (m, k, n): (usize, usize, usize),
        [input, gradient]: [CastSite; 2],
        recipe: Fp8Recipe,
    ) -> (f64, f64) {
        self.group_seconds(
            &[(m, k, n), (m, n, k), (k, m, n)],
            [(m * k, input), (k * n, CastSite::Weight), (m * n, gradient)],
            recipe,
        )
    }
}

/// Where a quantised tensor is made, which decides what its delayed-scaling cast costs
/// ([`GemmCost::cast_seconds`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CastSite {
    /// By a layer norm, its gradient or elementwise ops: their kernel casts it.
    Computed,
    /// A Variable (a weight): cast with the others in one launch.
    Weight,
    /// A Const (an imported model's weight in inference): under current scaling
    /// quantised once by the pass, at rewrite time, so no step casts it.
    Constant,
    /// By anything else (a product, an attention): a cast kernel of its own.
    Alone,
}

impl CastSite {
    /// Where `port` (a tensor before any Cast, [`source`]) is made, through views.
    fn of(g: &Graph, mut port: Port) -> CastSite {
        // As `quantize` folds it: a Const read directly (Casts are already stripped).
        if g.node(port.node).op.is::<Const>() {
            return CastSite::Constant;
        }
        while g.node(port.node).op.is_view() {
            match g.inputs(port.node).first() {
                Some(&input) => port = input,
                None => break,
            }
        }
        let op = g.node(port.node).op.as_ref();
        if op.is::<Variable>() {
            CastSite::Weight
        } else if op.is::<LayerNorm>() || op.is::<LayerNormGrad>() || ElementOp::of(op).is_some() {
            CastSite::Computed
        } else {
            CastSite::Alone
        }
    }
}

/// Settings of the FP8 phase of the AMP pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Config {
    pub recipe: Fp8Recipe,
    /// The cost model deciding per product; `None` converts every 16-bit MatMul (but
    /// those kept for the other reasons).
    pub cost: Option<GemmCost>,
    /// Keep the products of the forward graph's first and last layers 16-bit.
    pub keep_first_and_last: bool,
    /// Forward MatMuls kept 16-bit by name, with their backward products.
    pub keep: BTreeSet<String>,
    /// Keep the products cuBLASLt's FP8 kernels do not take (k or n not a multiple
    /// of 16), as the CUDA executor refuses them.
    pub device_shapes: bool,
    /// Scales leave `2^margin` of headroom below the format's largest value.
    pub margin: i32,
    /// Which products sum in the GPU's fast mode.
    pub fast_accumulation: FastAccumulation,
    /// Under [`Fp8Recipe::Static`], the amax of each tensor a product may quantise,
    /// measured on calibration inputs, by the name of its cast under current scaling
    /// ([`calibration_key`]).
    pub calibrated: BTreeMap<String, f32>,
}

/// Which FP8 products sum in Hopper's fast accumulation mode
/// ([`Fp8MatMul::fast_accumulation`]: partial sums kept in the tensor cores, never
/// promoted to f32 registers).
///
/// Measured on the H200 (Gaussian operands, E4M3 by E5M2, against float64 of the same
/// FP8 values): fast sums add a relative rms error of 3.6e-4 at K = 768, 9.2e-4 at
/// K = 3072 and 1.1e-3 at K = 16384, where rounding the operands to FP8 costs 5.9e-2,
/// fifty times more; and GPT-2's gradient products run 1.02-1.21x faster (the input
/// gradients' most). So every product sums fast by default; torchao and
/// TransformerEngine promote their gradient products, which `Forward` matches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FastAccumulation {
    /// Every product promotes its partial sums to f32.
    Never,
    /// The forward products (E4M3 by E4M3) only.
    Forward,
    /// Every product.
    #[default]
    All,
}

impl FastAccumulation {
    /// Whether a product of `a` by `b` sums fast.
    pub fn applies(self, a: DType, b: DType) -> bool {
        match self {
            FastAccumulation::Never => false,
            FastAccumulation::Forward => a == DType::F8E4M3 && b == DType::F8E4M3,
            FastAccumulation::All => true,
        }
    }
}

impl Default for Fp8Config {
    /// Current scaling, the H100's cost model, first and last layers kept.
    fn default() -> Self {
        Fp8Config {
            recipe: Fp8Recipe::Current,
            cost: Some(GemmCost::H100),
            keep_first_and_last: true,
            keep: BTreeSet::new(),
            device_shapes: true,
            margin: 0,
            fast_accumulation: FastAccumulation::default(),
            calibrated: BTreeMap::new(),
        }
    }
}

impl Fp8Config {
    /// Every 16-bit MatMul in FP8 (no cost model, no layer kept): for checking FP8's
    /// numerics on models too small to gain from it.
    pub fn everywhere(recipe: Fp8Recipe) -> Self {
        Fp8Config {
            recipe,
            cost: None,
            keep_first_and_last: false,
            device_shapes: false,
            ..Fp8Config::default()
        }
    }

    /// Every 16-bit MatMul the GPU's FP8 kernels take in FP8 (no cost model, no layer
    /// kept): for timing and training what the cost model would keep.
    pub fn every_device_product(recipe: Fp8Recipe) -> Self {
        Fp8Config {
            device_shapes: true,
            ..Fp8Config::everywhere(recipe)
        }
    }
}

/// Why a 16-bit product stayed 16-bit.
#[derive(Clone, Debug, PartialEq)]
pub enum Kept {
    /// Its layer is the first or last of the forward graph.
    FirstOrLast,
    /// Its layer's forward product is listed by name.
    Listed(String),
    /// The cost model: microseconds in 16 bits and in FP8 with the casts, of the
    /// products that share quantised operands with it (a layer's three), decided
    /// together.
    Cost { half_us: f64, fp8_us: f64 },
    /// A shape the device's FP8 products do not take: `k` or `n` not a multiple of 16
    /// (cuBLASLt's 16-byte leading dimensions).
    Shape { k: usize, n: usize },
    /// Both operands are gradients.
    BothGradients,
}

impl fmt::Display for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kept::FirstOrLast => write!(f, "its layer is the model's first or last"),
            Kept::Listed(name) => write!(f, "its layer '{name}' is listed to stay 16-bit"),
            Kept::Cost { half_us, fp8_us } => write!(
                f,
                "the cost model gives {fp8_us:.2} us in FP8 with its casts against {half_us:.2} us in 16 bits, for the products that share its operands"
            ),
            Kept::Shape { k, n } => write!(
                f,
                "cuBLASLt's FP8 products need k and n multiples of 16 (k = {k}, n = {n})"
            ),
            Kept::BothGradients => {
                write!(f, "both operands are gradients (E5M2 x E5M2 has no product)")
            }
        }
    }
}

/// The FP8 decision on one 16-bit product.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// FP8 operands in these formats.
    Fp8 {
        a: DType,
        b: DType,
    },
    Kept(Kept),
}

/// The decisions on every 16-bit MatMul of a graph, in topological order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub decisions: Vec<(NodeId, Decision)>,
}

/// What the FP8 phase did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fp8Stats {
    /// Products given FP8 operands.
    pub gemms: usize,
    /// 16-bit products kept by the cost model (or a shape the device's FP8 products
    /// do not take).
    pub kept_by_cost: usize,
    /// Kept as a first or last layer, or listed.
    pub kept_by_layer: usize,
    /// Products of two gradients.
    pub kept_both_gradients: usize,
    /// Tensors quantised (each once).
    pub quantized: usize,
    /// Of those, constants the pass quantised itself (current scaling).
    pub constants: usize,
}

impl Plan {
    pub fn decision(&self, id: NodeId) -> Option<&Decision> {
        self.decisions
            .iter()
            .find(|(n, _)| *n == id)
            .map(|(_, d)| d)
    }

    pub fn stats(&self) -> Fp8Stats {
        let mut s = Fp8Stats::default();
        for (_, d) in &self.decisions {
            match d {
                Decision::Fp8 { .. } => s.gemms += 1,
                Decision::Kept(Kept::Cost { .. } | Kept::Shape { .. }) => s.kept_by_cost += 1,
                Decision::Kept(Kept::FirstOrLast | Kept::Listed(_)) => s.kept_by_layer += 1,
                Decision::Kept(Kept::BothGradients) => s.kept_both_gradients += 1,
            }
        }
        s
    }
}

fn is_gemm(g: &Graph, id: NodeId) -> bool {
    let op = &g.node(id).op;
    op.is::<MatMul>() || op.is::<BatchMatMul>()
}

/// A MatMul computing in 16 bits: the candidates.
fn half_matmul(g: &Graph, id: NodeId) -> Option<&MatMul> {
    let product = g.node(id).op.downcast_ref::<MatMul>()?;
    let half = |t: &TensorType| t.dtype.is_half();
    (half(&g.node(id).outputs()[0]) && g.inputs(id).iter().all(|&p| half(g.ty(p))))
        .then_some(product)
}

/// The tensor a port holds before any Cast: the same weight or activation whatever
/// precision a reader takes it in.
fn source(g: &Graph, mut port: Port) -> Port {
    while g.node(port.node).op.is::<Cast>() {
        port = g.inputs(port.node)[0];
    }
    port
}

/// A product FP8 may take, before the cost model: where its decision is, its sides,
/// and each operand's quantised tensor (the source and its format) with its size.
struct Candidate {
    at: usize,
    dims: (usize, usize, usize),
    operands: [((Port, DType), (usize, CastSite)); 2],
}

/// The candidates in groups that share quantised tensors (directly or through one
/// another): a Linear layer's forward product and its two gradient products share
/// its input, weight and output gradient, and projections of one input share it. A
/// tensor is quantised once for all its readers, so a group is decided together.
fn sharing_groups(candidates: &[Candidate]) -> Vec<Vec<usize>> {
    // Union-find over the candidates, joined by the tensors they read.
    let mut parent: Vec<usize> = (0..candidates.len()).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    let mut first_reader: HashMap<(Port, DType), usize> = HashMap::new();
    for (i, c) in candidates.iter().enumerate() {
        for (tensor, _) in c.operands {
            let j = *first_reader.entry(tensor).or_insert(i);
            let (a, b) = (root(&mut parent, i), root(&mut parent, j));
            parent[a] = b;
        }
    }
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of: HashMap<usize, usize> = HashMap::new();
    for i in 0..candidates.len() {
        let r = root(&mut parent, i);
        let k = *group_of.entry(r).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[k].push(i);
    }
    groups
}

/// Decides every 16-bit MatMul of `g` (a graph after the 16-bit rewrite) that its
/// outputs need.
pub fn plan(g: &Graph, config: &Fp8Config) -> Result<Plan, PassError> {
    let order = g.topo_order()?;
    let bound = g.node_bound();
    // Computed from a gradient seed.
    let mut gradient = vec![false; bound];
    for &id in &order {
        let inputs = g.inputs(id);
        gradient[id.index()] = if inputs.is_empty() {
            is_seed_name(&g.node(id).name)
        } else {
            inputs.iter().any(|p| gradient[p.node.index()])
        };
    }
    let forward_gemm = |id: NodeId| is_gemm(g, id) && !gradient[id.index()];
    // A forward product lies before / after this node in the forward graph.
    let mut gemm_before = vec![false; bound];
    for &id in &order {
        gemm_before[id.index()] = g
            .inputs(id)
            .iter()
            .any(|p| forward_gemm(p.node) || gemm_before[p.node.index()]);
    }
    let mut gemm_after = vec![false; bound];
    for &id in order.iter().rev() {
        gemm_after[id.index()] = g
            .consumers(id)
            .iter()
            .any(|&(c, _, _)| !gradient[c.index()] && (forward_gemm(c) || gemm_after[c.index()]));
    }
    // The forward products reading each tensor: a backward product's layer.
    let mut readers: HashMap<Port, Vec<NodeId>> = HashMap::new();
    for &id in order.iter().filter(|&&id| forward_gemm(id)) {
        for p in g.inputs(id) {
            readers.entry(source(g, p)).or_default().push(id);
        }
    }
    let layer_kept = |layer: NodeId| -> Option<Kept> {
        let name = &g.node(layer).name;
        if config.keep.contains(name) {
            Some(Kept::Listed(name.clone()))
        } else if config.keep_first_and_last
            && (!gemm_before[layer.index()] || !gemm_after[layer.index()])
        {
            Some(Kept::FirstOrLast)
        } else {
            None
        }
    };
    // Products no output needs (an input gradient nobody reads) run nowhere.
    let needed = g.needed_by(g.outputs());
    let mut decisions = Vec::new();
    let mut candidates: Vec<Candidate> = Vec::new();
    for &id in order.iter().filter(|id| needed[id.index()]) {
        let Some(product) = half_matmul(g, id) else {
            continue;
        };
        let inputs = g.inputs(id);
        let grad = [
            gradient[inputs[0].node.index()],
            gradient[inputs[1].node.index()],
        ];
        let layers: Vec<NodeId> = match grad {
            [false, false] => vec![id],
            [true, true] => {
                decisions.push((id, Decision::Kept(Kept::BothGradients)));
                continue;
            }
            [_, b_is_gradient] => {
                let other = inputs[usize::from(!b_is_gradient)];
                readers.get(&source(g, other)).cloned().unwrap_or_default()
            }
        };
        if let Some(kept) = layers.into_iter().find_map(layer_kept) {
            decisions.push((id, Decision::Kept(kept)));
            continue;
        }
        let (m, k, n) = product
            .dims(&g.ty(inputs[0]).shape, &g.ty(inputs[1]).shape)
            .map_err(|e| node_error(g, id, &e))?;
        if config.device_shapes && (k % 16 != 0 || n % 16 != 0) {
            decisions.push((id, Decision::Kept(Kept::Shape { k, n })));
            continue;
        }
        let format = |g: bool| if g { DType::F8E5M2 } else { DType::F8E4M3 };
        let operands = [0, 1].map(|i| {
            let elements = g.ty(inputs[i]).shape.iter().product::<usize>();
            let tensor = source(g, inputs[i]);
            (
                (tensor, format(grad[i])),
                (elements, CastSite::of(g, tensor)),
            )
        });
        decisions.push((
            id,
            Decision::Fp8 {
                a: format(grad[0]),
                b: format(grad[1]),
            },
        ));
        candidates.push(Candidate {
            at: decisions.len() - 1,
            dims: (m, k, n),
            operands,
        });
    }
    if let Some(cost) = &config.cost {
        for group in sharing_groups(&candidates) {
            let members = || group.iter().map(|&c| &candidates[c]);
            let products: Vec<(usize, usize, usize)> = members().map(|c| c.dims).collect();
            let quantised: HashMap<(Port, DType), (usize, CastSite)> =
                members().flat_map(|c| c.operands).collect();
            let (half, fp8) = cost.group_seconds(&products, quantised.into_values(), config.recipe);
            if fp8 >= half {
                let kept = Kept::Cost {
                    half_us: half * 1e6,
                    fp8_us: fp8 * 1e6,
                };
                for c in members() {
                    decisions[c.at].1 = Decision::Kept(kept.clone());
                }
            }
        }
    }
    Ok(Plan { decisions })
}

/// A quantised tensor: its FP8 values, their transposed copy where a product reads
/// it, and the inverse of their scale.
#[derive(Clone, Copy)]
struct Quantized {
    values: Port,
    transposed: Option<Port>,
    scale_inv: Port,
}

impl Quantized {
    /// The operand a product reads K-major (Hopper's FP8 products take `a` as
    /// `[m, k]` and `b` as `[n, k]`): the values, or their transposed copy where the
    /// values are the other way round (`flipped`).
    fn k_major(&self, flipped: bool) -> Port {
        match (flipped, self.transposed) {
            (true, Some(t)) => t,
            _ => self.values,
        }
    }
}

/// A tensor's delayed-scaling state: its Variables and this step's amax.
struct DelayedState {
    format: DType,
    history: Port,
    amax: Port,
    scale: Port,
    scale_inv: Port,
}

/// The key of [`Fp8Config::calibrated`] that the cast node `name` of a graph rewritten
/// under current scaling measures (`QuantizeFp8`'s second output is its input's amax):
/// the tensor's and the format's stem, `ampgraph/fp8/<tensor>/<format>`.
pub fn calibration_key(name: &str) -> Option<&str> {
    name.strip_prefix(STATE_PREFIX)?;
    name.strip_suffix("/quantize")
}

/// Adds the quantisation of `x` to `format` under `config`'s recipe, with a transposed
/// copy if `transposed`; under delayed scaling its state joins `delayed`. A constant
/// under current scaling is quantised here, once, into Consts (its nodes, and those
/// Consts, join `folded`, to go where nothing reads them after the rewrite).
fn quantize(
    g: &mut Graph,
    x: Port,
    (format, transposed): (DType, bool),
    config: &Fp8Config,
    delayed: &mut Vec<DelayedState>,
    folded: &mut Vec<NodeId>,
) -> Result<Quantized, PassError> {
    let src = source(g, x);
    let stem = format!(
        "{STATE_PREFIX}{}/{}",
        g.port_name(src).replace(':', "_"),
        // `e4m3` or `e5m2`: the dtype's name after its `f8`.
        format.as_str().trim_start_matches("f8")
    );
    let scale_op = Fp8Scale::new(format, config.margin).map_err(PassError::Rewrite)?;
    let quantize_op = QuantizeFp8::new(format)
        .map_err(PassError::Rewrite)?
        .with_transposed(transposed);
    let copy = |q: NodeId| transposed.then(|| Port::new(q, 2));
    // What the pass computes itself, with the ops' CPU kernels, as Consts.
    let at = |g: &Graph, m: String| node_error(g, x.node, &m);
    let constant = |g: &mut Graph, what: &str, t: Tensor| -> Result<Port, PassError> {
        let id = g.add_node(
            g.fresh_name(format!("{stem}/{what}")),
            Box::new(Const::new(t)),
            &[],
        )?;
        Ok(Port::from(id))
    };
    let scales_of = |g: &Graph, t: &Tensor| -> Result<[Tensor; 2], PassError> {
        (scale_op.eval(&[t]))
            .map_err(|m| at(g, m))?
            .try_into()
            .map_err(|_| at(g, "Fp8Scale gave other than two outputs".into()))
    };
    match config.recipe {
        Fp8Recipe::Current | Fp8Recipe::Static if g.node(src.node).op.is::<Const>() => {
            let value = cast_constant(g, x)
                .map(|(value, _)| value)
                .ok_or_else(|| node_error(g, src.node, "a constant the CPU cannot evaluate"))?;
            let [scale, scale_inv] = scales_of(g, &value)?;
            let mut parts = (quantize_op.eval(&[&value, &scale]))
                .map_err(|m| at(g, m))?
                .into_iter();
            // (values, amax, the transposed copy): the amax is the scale's, no reader's.
            let (Some(values), Some(_)) = (parts.next(), parts.next()) else {
                return Err(at(g, "QuantizeFp8 gave fewer than two outputs".into()));
            };
            let values = constant(g, "quantized", values)?;
            let copy = parts
                .next()
                .map(|t| constant(g, "quantized_transposed", t))
                .transpose()?;
            let scale_inv = constant(g, "scale_inv", scale_inv)?;
            folded.extend(copy.iter().chain([&values]).map(|p| p.node));
            folded.extend(through_casts(g, x));
            Ok(Quantized {
                values,
                transposed: copy,
                scale_inv,
            })
        }
        Fp8Recipe::Current => {
            let scale = g.add_node(
                g.fresh_name(format!("{stem}/scale")),
                Box::new(scale_op),
                &[x],
            )?;
            let q = g.add_node(
                g.fresh_name(format!("{stem}/quantize")),
                Box::new(quantize_op),
                &[x, Port::new(scale, 0)],
            )?;
            Ok(Quantized {
                values: Port::new(q, 0),
                transposed: copy(q),
                scale_inv: Port::new(scale, 1),
            })
        }
        Fp8Recipe::Static => {
            let amax = config.calibrated.get(&stem).copied().ok_or_else(|| {
                node_error(
                    g,
                    x.node,
                    &format!("no calibrated amax for its FP8 cast {stem} (static scaling)"),
                )
            })?;
            // The scale current scaling computes from this amax, as Consts.
            let [scale, scale_inv] = scales_of(g, &Tensor::scalar(DType::F32, f64::from(amax)))?;
            let (scale, scale_inv) = (
                constant(g, "scale", scale)?,
                constant(g, "scale_inv", scale_inv)?,
            );
            let q = g.add_node(
                g.fresh_name(format!("{stem}/quantize")),
                Box::new(quantize_op),
                &[x, scale],
            )?;
            Ok(Quantized {
                values: Port::new(q, 0),
                transposed: copy(q),
                scale_inv,
            })
        }
        Fp8Recipe::Delayed { history, .. } => {
            if history == 0 {
                return Err(PassError::Rewrite(
                    "delayed FP8 scaling needs an amax history of at least 1".into(),
                ));
            }
            let state = |g: &mut Graph, what: &str, ty: TensorType, init: Init| {
                g.add_node(
                    g.fresh_name(format!("{stem}/{what}")),
                    Box::new(Variable::with_init(ty, init)),
                    &[],
                )
                .map(Port::from)
            };
            let scalar = || TensorType::new(DType::F32, []);
            let amaxes = state(
                g,
                "amax_history",
                TensorType::new(DType::F32, [history]),
                Init::Zeros,
            )?;
            let scale = state(g, "scale", scalar(), Init::Constant(1.0))?;
            let scale_inv = state(g, "scale_inv", scalar(), Init::Constant(1.0))?;
            let q = g.add_node(
                g.fresh_name(format!("{stem}/quantize")),
                Box::new(quantize_op),
                &[x, scale],
            )?;
            delayed.push(DelayedState {
                format,
                history: amaxes,
                amax: Port::new(q, 1),
                scale,
                scale_inv,
            });
            Ok(Quantized {
                values: Port::new(q, 0),
                transposed: copy(q),
                scale_inv,
            })
        }
    }
}

/// Delayed scaling's step: one `Fp8ScaleUpdate` per format for all its tensors, their
/// next histories, scales and inverses assigned to their Variables, and the amaxes
/// added to the step's all-finite checks (a non-finite amax skips a loss-scaled step
/// as an overflowing gradient does; the saturating casts would hide it). Returns the
/// writes.
fn update_delayed_state(
    g: &mut Graph,
    delayed: &[DelayedState],
    config: &Fp8Config,
) -> Result<Vec<Port>, PassError> {
    let Fp8Recipe::Delayed { amax, .. } = config.recipe else {
        return Ok(Vec::new());
    };
    let mut writes = Vec::new();
    for format in [DType::F8E4M3, DType::F8E5M2] {
        let members: Vec<&DelayedState> = delayed.iter().filter(|d| d.format == format).collect();
        if members.is_empty() {
            continue;
        }
        let op = Fp8ScaleUpdate {
            scale: Fp8Scale::new(format, config.margin).map_err(PassError::Rewrite)?,
            amax,
            members: members.len(),
        };
        let inputs: Vec<Port> = members
            .iter()
            .flat_map(|d| [d.history, d.amax, d.scale, d.scale_inv])
            .collect();
        let name = format!(
            "{STATE_PREFIX}update/{}",
            format.as_str().trim_start_matches("f8")
        );
        let update = g.add_node(g.fresh_name(name), Box::new(op), &inputs)?;
        for (m, d) in members.iter().enumerate() {
            for (k, var) in [d.history, d.scale, d.scale_inv].into_iter().enumerate() {
                let next = Port::new(update, Fp8ScaleUpdate::MEMBER_OUTPUTS * m + k);
                writes.push(g.add(AssignVariable, &[var, next])?);
            }
        }
    }
    let checks: Vec<NodeId> = g
        .node_ids()
        .filter(|&id| g.node(id).op.is::<AllFinite>())
        .collect();
    for id in checks {
        let mut inputs = g.inputs(id);
        // A scaled check's last input is its scale.
        let at = inputs.len()
            - usize::from(
                g.node(id)
                    .op
                    .downcast_ref::<AllFinite>()
                    .is_some_and(|a| a.scaled),
            );
        inputs.splice(at..at, delayed.iter().map(|d| d.amax));
        let op = g.node(id).op.clone();
        g.set_node(id, op, &inputs)?;
    }
    Ok(writes)
}

/// The training step's Group among the graph's outputs, which delayed scaling's
/// writes join.
fn step_group(g: &Graph) -> Option<NodeId> {
    g.outputs()
        .iter()
        .map(|p| p.node)
        .find(|&id| g.node(id).op.is::<Group>())
}

/// Rewrites the products `plan` chose into FP8 ones; returns the plan's counts.
pub fn apply(g: &mut Graph, plan: &Plan, config: &Fp8Config) -> Result<Fp8Stats, PassError> {
    let mut stats = plan.stats();
    if stats.gemms == 0 {
        return Ok(stats);
    }
    let group = step_group(g);
    if matches!(config.recipe, Fp8Recipe::Delayed { .. }) && group.is_none() {
        return Err(PassError::Rewrite(
            "delayed FP8 scaling updates its amax histories in a training step, and this \
             graph has none among its outputs (a Group of updates): use current scaling"
                .into(),
        ));
    }
    if config.recipe == Fp8Recipe::Static && group.is_some() {
        return Err(PassError::Rewrite(
            "static FP8 scales are calibrated for inference, and this graph trains (its \
             tensors drift from their calibration): use delayed or current scaling"
                .into(),
        ));
    }
    // Each chosen product with its operands: (port, format, whether it is stored the
    // other way round from K-major).
    let mut products = Vec::new();
    for (id, decision) in &plan.decisions {
        let &Decision::Fp8 { a, b } = decision else {
            continue;
        };
        let product = (g.node(*id).op.downcast_ref::<MatMul>().cloned())
            .ok_or_else(|| node_error(g, *id, "not a MatMul"))?;
        let inputs = g.inputs(*id);
        let operands = [
            (inputs[0], a, product.transpose_a),
            (inputs[1], b, !product.transpose_b),
        ];
        products.push((*id, operands));
    }
    // A tensor some product reads the other way round gets a transposed copy.
    let mut flipped: HashMap<(Port, DType), bool> = HashMap::new();
    for (_, operands) in &products {
        for &(x, format, flip) in operands {
            *flipped.entry((source(g, x), format)).or_default() |= flip;
        }
    }
    let mut quantized: HashMap<(Port, DType), Quantized> = HashMap::new();
    let (mut delayed, mut folded) = (Vec::new(), Vec::new());
    for (id, [(xa, a, flip_a), (xb, b, flip_b)]) in products {
        let mut operands = Vec::with_capacity(2);
        for (x, format) in [(xa, a), (xb, b)] {
            let key = (source(g, x), format);
            let q = match quantized.get(&key) {
                Some(q) => *q,
                None => {
                    let copy = flipped.get(&key).copied().unwrap_or(false);
                    let q = quantize(g, x, (format, copy), config, &mut delayed, &mut folded)?;
                    quantized.insert(key, q);
                    q
                }
            };
            operands.push(q);
        }
        let [qa, qb] = [operands[0], operands[1]];
        // Read K-major (every flipped operand has its copy), the product needs no
        // transposes of its own: `a` as `[m, k]`, `b` as `[n, k]`.
        let k_major = MatMul::new(
            flip_a && qa.transposed.is_none(),
            !(flip_b && qb.transposed.is_none()),
        );
        let to = g.node(id).outputs()[0].dtype;
        let op = Fp8MatMul::new(k_major, to)
            .map_err(|e| node_error(g, id, &e))?
            .with_fast_accumulation(config.fast_accumulation.applies(a, b));
        g.set_node(
            id,
            Box::new(op),
            &[
                qa.k_major(flip_a),
                qb.k_major(flip_b),
                qa.scale_inv,
                qb.scale_inv,
            ],
        )?;
    }
    stats.constants = match config.recipe {
        Fp8Recipe::Current | Fp8Recipe::Static => (quantized.keys())
            .filter(|(p, _)| g.node(p.node).op.is::<Const>())
            .count(),
        Fp8Recipe::Delayed { .. } => 0,
    };
    // The quantised constants' parts no product reads (a weight's values where every
    // product reads its transposed copy), then the 16-bit constants they replace.
    remove_unread(g, folded, &output_nodes(g))?;
    let writes = update_delayed_state(g, &delayed, config)?;
    if let (Some(group), false) = (group, writes.is_empty()) {
        let mut inputs = g.inputs(group);
        inputs.extend(writes);
        g.set_node(group, Box::new(Group), &inputs)?;
    }
    stats.quantized = quantized.len();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amp::AmpConfig;

    /// Products are grouped by the quantised tensors they share, through one another:
    /// two projections of one input, and a layer whose weight its gradient product
    /// reads again; a tensor in another format is another tensor.
    #[test]
    fn products_sharing_a_quantised_tensor_form_one_group() {
        let port = |n: usize| Port::new(NodeId::new(n), 0);
        let (e4, e5) = (DType::F8E4M3, DType::F8E5M2);
        let candidate = |a: (Port, DType), b: (Port, DType)| Candidate {
            at: 0,
            dims: (8, 8, 8),
            operands: [(a, (64, CastSite::Alone)), (b, (64, CastSite::Alone))],
        };
        let (x, wq, wk, y, w, dy) = (port(0), port(1), port(2), port(3), port(4), port(5));
        let candidates = [
            candidate((x, e4), (wq, e4)),
            candidate((x, e4), (wk, e4)),
            candidate((y, e4), (w, e4)),
            candidate((dy, e5), (w, e4)),
            // The same source in E5M2 is not the E4M3 tensor of the first two.
            candidate((x, e5), (dy, e4)),
        ];
        assert_eq!(
            sharing_groups(&candidates),
            vec![vec![0, 1], vec![2, 3], vec![4]]
        );
    }

    /// `AMPGRAPH_AMP_FP8_SCALING` picks the recipe where FP8 is on, is ignored where
    /// it is off, and refuses other values by name.
    #[test]
    fn the_environment_picks_the_scaling() {
        let env = |value: &'static str| {
            move |k: &str| (k == "AMPGRAPH_AMP_FP8_SCALING").then(|| value.to_string())
        };
        let mut fp8 = AmpConfig::new(DType::F8E4M3).unwrap();
        fp8.apply_vars(env("delayed")).unwrap();
        assert_eq!(fp8.fp8.unwrap().recipe, Fp8Recipe::delayed());
        let mut bf16 = AmpConfig::new(DType::BF16).unwrap();
        bf16.apply_vars(env("delayed")).unwrap();
        assert!(bf16.fp8.is_none());
        let mut bad = AmpConfig::new(DType::F8E4M3).unwrap();
        let err = bad.apply_vars(env("sometimes")).unwrap_err().to_string();
        assert!(
            err.contains("AMPGRAPH_AMP_FP8_SCALING is 'sometimes'"),
            "{err}"
        );
    }

    /// `AMPGRAPH_AMP_FP8_FAST_ACCUMULATION` picks which products sum fast, survives
    /// `on_every_device_product`, and refuses other values by name.
    #[test]
    fn the_environment_picks_the_fast_accumulation() {
        let env = |value: &'static str| {
            move |k: &str| (k == "AMPGRAPH_AMP_FP8_FAST_ACCUMULATION").then(|| value.to_string())
        };
        let mut fp8 = AmpConfig::new(DType::F8E4M3).unwrap();
        assert_eq!(
            fp8.fp8.as_ref().unwrap().fast_accumulation,
            FastAccumulation::All
        );
        fp8.apply_vars(env("forward")).unwrap();
        let fp8 = fp8.on_every_device_product().fp8.unwrap();
        assert_eq!(fp8.fast_accumulation, FastAccumulation::Forward);
        let mut bad = AmpConfig::new(DType::F8E4M3).unwrap();
        let err = bad.apply_vars(env("often")).unwrap_err().to_string();
        assert!(
            err.contains("AMPGRAPH_AMP_FP8_FAST_ACCUMULATION is 'often'"),
            "{err}"
        );
    }

    /// torchao's H100 measurements of a Linear's FP8 training speed-up: 0.80x at
    /// 1024x2048x1024 (keep 16 bits), 1.39x at 4096x8192x16384 (FP8).
    #[test]
    fn the_cost_model_keeps_small_layers_16_bit_and_converts_large_ones() {
        let cost = GemmCost::H100;
        let gain = |dims, recipe| {
            let (half, fp8) = cost.linear_seconds(dims, [CastSite::Computed; 2], recipe);
            half / fp8
        };
        let current = Fp8Recipe::Current;
        assert!(gain((1024, 2048, 1024), current) < 1.0);
        assert!((1.2..1.6).contains(&gain((4096, 8192, 16384), current)));
        // A tiny layer is memory- and launch-bound either way: 16 bits.
        assert!(gain((64, 784, 256), current) < 1.0);
    }

    /// What the step measured on the H200 with every layer but the first and last in
    /// FP8: GPT-2 (16384 tokens, d768) 1.06x faster under delayed scaling and 1.04x
    /// under current scaling; the transformer (8192 tokens, d768) 1.06x and 0.90x
    /// (668142c, 3c93ff2); the mlp (8192 x 4096) 1.35-1.45x under both. The attention
    /// outputs (d768 by d768, an attention's output in, the residual's gradient out)
    /// made the delayed-scaling steps faster in FP8: GPT-2's by 1.5% (the fifty-fourth
    /// session), the transformer's, half the rows, by 2.7% (the fifty-fifth); both stay
    /// 16-bit under current scaling.
    #[test]
    fn the_cost_model_picks_what_the_workloads_measured() {
        use CastSite::{Alone, Computed};
        let cost = GemmCost::H100;
        let delayed = Fp8Recipe::delayed();
        let pays = |dims, sites, recipe| {
            let (half, fp8) = cost.linear_seconds(dims, sites, recipe);
            fp8 < half
        };
        // A layer's input made by a layer norm, a GELU or an attention, and its output
        // gradient by a GELU's gradient, the residual's (a layer norm's gradient) or an
        // attention's.
        let (up, down, qkv, out) = (
            [Computed; 2],
            [Computed; 2],
            [Computed, Alone],
            [Alone, Computed],
        );
        let layers = |rows| {
            [
                ((rows, 768, 3072), up),
                ((rows, 3072, 768), down),
                ((rows, 768, 2304), qkv),
            ]
        };
        for (dims, sites) in layers(16384) {
            assert!(pays(dims, sites, delayed), "{dims:?}");
            assert!(pays(dims, sites, Fp8Recipe::Current), "{dims:?}");
        }
        for (dims, sites) in layers(8192) {
            assert!(pays(dims, sites, delayed), "{dims:?}");
            assert!(!pays(dims, sites, Fp8Recipe::Current), "{dims:?}");
        }
        for rows in [16384, 8192] {
            assert!(pays((rows, 768, 768), out, delayed), "{rows}");
            assert!(!pays((rows, 768, 768), out, Fp8Recipe::Current), "{rows}");
        }
        assert!(pays((8192, 4096, 4096), up, delayed));
        assert!(pays((8192, 4096, 4096), up, Fp8Recipe::Current));
    }
}
