//! cuDNN: convolutions and batch normalisation.
//!
//! The library is loaded at run time like the driver (`libcudnn.so.9`): a machine
//! without it still runs everything else, and a node needing it is refused when its
//! step is planned ([`available`]), so `Device::auto_for` picks the CPU for it.
//!
//! Convolution algorithms are chosen per (direction, shapes, dtype, layout, math, room
//! for the workspace in the step's plan) the first time a shape runs — PyTorch's
//! `cudnn.benchmark`: cuDNN times every candidate (`cudnnFind*Algorithm`), the fastest
//! within the workspace limit is kept (of those within 3% of it, the one with the least
//! workspace; only the deterministic ones with [`DnnOptions::deterministic`]), in
//! memory and in a file beside the kernel cache, so a new process does not time them
//! again. The choice also keeps to the step's memory plan: an algorithm whose workspace
//! would not fit in the arena's bytes free while the convolution runs, and a quarter of
//! the arena more, is passed over for the fastest that fits, so a step's peak stays
//! near its plan's (fp32 Winograd and FFT algorithms take hundreds of MiB). Every
//! choice is logged at info level, with any faster algorithm passed over, and listed by
//! [`Dnn::choices`].
//!
//! A call's workspace is its node's scratch in the step's arena where the plan holds
//! one (from the second step: the executor plans what the first took); else one
//! workspace shared by every call, grown to the largest the chosen algorithms need (at
//! most the limit), and freed once the plan holds them.
//!
//! A legacy cuDNN call costs 100-200 us of host time (more than the GPU spends on a
//! small layer, so the GPU waited for the host), so a convolution seen a second time on
//! the same buffers is captured into a CUDA graph and replayed from then on, which
//! costs a few microseconds ([`Replays`]): from the second step a training loop's
//! buffers are its arena's, the same every step.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use cudarc::cudnn::sys;
use cudarc::driver::{sys as driver_sys, CudaGraph};
use sys::cudnnDataType_t as CudnnType;

use ampgraph_graph::ops::DataFormat;
use ampgraph_graph::DType;

use super::device::{
    capturing, capturing_here, clear_runtime_error, loading, on_a_thread_of_its_own, DTensor,
    Device, Launches,
};

/// Whether cuDNN (9 or later) can be loaded; the reason where it cannot.
pub fn available() -> Result<(), String> {
    static PRESENT: OnceLock<Result<(), String>> = OnceLock::new();
    PRESENT
        .get_or_init(|| {
            // SAFETY: only tries to open the library.
            if !unsafe { sys::is_culib_present() } {
                return Err("cuDNN (libcudnn.so.9) was not found on the library path".into());
            }
            // SAFETY: the library is present; the call reads a constant.
            let version = unsafe { sys::cudnnGetVersion() };
            if version < 90000 {
                return Err(format!(
                    "cuDNN {version} was found; ampgraph needs cuDNN 9 or later"
                ));
            }
            Ok(())
        })
        .clone()
}

/// How convolution algorithms are chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DnnOptions {
    /// Only algorithms whose results are the same from run to run (PyTorch's
    /// `cudnn.deterministic`): the fastest of those, which may be slower; by default
    /// the fastest of all, timed on first use (`cudnn.benchmark`).
    pub deterministic: bool,
    /// The most workspace one algorithm may use, in MiB (TensorFlow's
    /// `TF_CUDNN_WORKSPACE_LIMIT_IN_MB`); `None`: 1024 (`DEFAULT_WORKSPACE_LIMIT_MIB`).
    /// Faster algorithms (FFT, Winograd) often need more.
    pub workspace_limit_mib: Option<usize>,
}

/// The default of [`DnnOptions::workspace_limit_mib`]. The bench convnet's f32 training
/// step on the H100: 52.3 ms within 256 MiB, 45.2 within 512, 38.7 within 1024
/// (PyTorch, whose search has no limit: 41.0).
pub const DEFAULT_WORKSPACE_LIMIT_MIB: usize = 1024;

impl DnnOptions {
    /// The workspace limit in bytes.
    pub fn workspace_limit(&self) -> usize {
        self.workspace_limit_mib
            .unwrap_or(DEFAULT_WORKSPACE_LIMIT_MIB)
            .saturating_mul(1 << 20)
    }
}

/// Which of a convolution's three products a call computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// `y = conv(x, w)`.
    Forward,
    /// `dx` from `w` and `dy`.
    BackwardData,
    /// `dw` from `x` and `dy`.
    BackwardFilter,
}

/// A convolution as cuDNN sees it: the input after any extra padding at its end (the
/// asymmetric part of a SAME padding is made explicit by the caller), symmetric
/// padding, and the filter `[k, c / groups, r, s]` in the layout's filter format (KRSC
/// for NHWC, KCRS for NCHW).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvShape {
    pub dtype: DType,
    pub layout: DataFormat,
    /// Input `[n, c, h, w]`.
    pub input: [usize; 4],
    /// Output channels and window `[k, r, s]`.
    pub filter: [usize; 3],
    /// Channel groups (1: an ungrouped convolution); part of the algorithm's key.
    pub groups: usize,
    pub pad: [usize; 2],
    pub strides: [usize; 2],
    /// Rows and columns between the filter's taps.
    pub dilations: [usize; 2],
    /// Output `[h, w]`.
    pub out: [usize; 2],
    /// f32 convolutions may use TF32 Tensor Cores.
    pub allow_tf32: bool,
}

impl ConvShape {
    fn output(&self) -> [usize; 4] {
        [self.input[0], self.filter[0], self.out[0], self.out[1]]
    }
}

/// One algorithm chosen for one convolution, as the log and
/// [`CudaExecutor::conv_algorithms`](crate::CudaExecutor::conv_algorithms) say it.
#[derive(Clone, Debug)]
pub struct Choice {
    pub direction: Direction,
    pub shape: ConvShape,
    /// cuDNN's name of the algorithm and its math (`IMPLICIT_PRECOMP_GEMM tensor-op`).
    pub algorithm: String,
    /// Milliseconds per run as timed, `None` for a choice read from the disk file.
    pub ms: Option<f32>,
    pub workspace: usize,
    /// How many candidates ran (0 for a choice read from disk).
    pub candidates: usize,
    /// A faster algorithm not taken as its workspace would have raised the step's
    /// peak: its name, milliseconds and workspace bytes.
    pub passed_over: Option<(String, f32, usize)>,
}

/// What [`Dnn::fastest`] found.
struct Found {
    algo: Algo,
    /// Milliseconds per run as timed (NaN: cuDNN's heuristic pick, untimed).
    ms: f32,
    candidates: usize,
    passed_over: Option<(String, f32, usize)>,
}

/// An algorithm by its cuDNN number and math type, with its workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Algo {
    id: u32,
    math: u32,
    workspace: usize,
}

/// The algorithms of a disk file's text (each line: key, algo, math, workspace bytes,
/// cuDNN version) chosen under cuDNN `version`; other lines are ignored.
fn parse_stored(text: &str, version: &str) -> HashMap<String, Algo> {
    let mut stored = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        let [key, id, math, workspace, v] = f[..] else {
            continue;
        };
        let (Ok(id), Ok(math), Ok(workspace)) = (id.parse(), math.parse(), workspace.parse())
        else {
            continue;
        };
        if v == version {
            let algo = Algo {
                id,
                math,
                workspace,
            };
            stored.insert(key.to_string(), algo);
        }
    }
    stored
}

/// Adds to `stored` the algorithms of a disk file's `text` for keys it has none of (what
/// other executors chose and wrote since `stored` was read).
fn merge_stored(stored: &mut HashMap<String, Algo>, text: &str, version: &str) {
    for (k, a) in parse_stored(text, version) {
        stored.entry(k).or_insert(a);
    }
}

/// The disk file's text of `stored` under cuDNN `version`, one line a key, sorted.
fn render_stored(stored: &HashMap<String, Algo>, version: &str) -> String {
    let mut lines: Vec<String> = (stored.iter())
        .map(|(k, a)| format!("{k}\t{}\t{}\t{}\t{version}\n", a.id, a.math, a.workspace))
        .collect();
    lines.sort();
    lines.concat()
}

/// The descriptors of one convolution and its chosen algorithm.
struct ConvPlan {
    x: TensorDesc,
    y: TensorDesc,
    w: FilterDesc,
    conv: ConvDesc,
    algo: Algo,
}

/// The key of a chosen algorithm, in memory and on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    direction: Direction,
    shape: ConvShape,
    deterministic: bool,
    /// The search's limit: a larger one may find a faster algorithm.
    workspace_limit: usize,
    /// The workspace the step's plan has room for (`None`: no plan): another room
    /// may keep another algorithm.
    room: Option<usize>,
}

impl PlanKey {
    /// The line key of the disk file: the key's `Debug` form without spaces.
    fn text(&self) -> String {
        format!("{self:?}").replace(' ', "")
    }
}

pub struct Dnn {
    /// Created on first use: a machine without cuDNN never loads it.
    handle: OnceLock<Result<Handle, String>>,
    stream: sys::cudaStream_t,
    plans: Mutex<HashMap<PlanKey, Arc<ConvPlan>>>,
    /// Algorithms read from the disk file, by [`PlanKey::text`].
    stored: Mutex<HashMap<String, Algo>>,
    choices: Mutex<Vec<Choice>>,
    workspace: Mutex<Option<DTensor>>,
    /// The file of chosen algorithms (none where the kernel cache is off).
    file: Option<PathBuf>,
    replays: Mutex<Replays>,
}

/// A convolution call on given buffers: the same key runs the same kernels on the same
/// addresses, which is what a captured graph replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ReplayKey {
    plan: PlanKey,
    x: u64,
    w: u64,
    y: u64,
    workspace: u64,
}

/// Convolution calls captured as CUDA graphs. A call is captured the second time its
/// key is seen (a one-off call is not worth a capture); a call cuDNN cannot run under
/// capture keeps running directly.
#[derive(Default)]
struct Replays {
    seen: HashSet<ReplayKey>,
    graphs: HashMap<ReplayKey, Option<CudaGraph>>,
}

impl Replays {
    /// Keys kept at most: buffers that change every call (no arena) would otherwise
    /// grow the map without end.
    const LIMIT: usize = 1024;

    /// Runs `call` (a cuDNN call on the device's stream): replayed where captured
    /// before, captured now where `key` was seen once before, else directly.
    fn run(
        &mut self,
        dev: &Device,
        key: ReplayKey,
        call: impl Fn() -> sys::cudnnStatus_t,
    ) -> Result<(), String> {
        clear_runtime_error();
        // Inside a whole step's capture the call is captured with the step.
        if capturing_here() {
            return check("convolution", cudnn_call(&call));
        }
        match self.graphs.get(&key) {
            Some(Some(graph)) => {
                Launches::count(&dev.launches.dnn_replays);
                return graph
                    .launch()
                    .map_err(|e| format!("replaying a captured convolution: {e:?}"));
            }
            Some(None) => {
                Launches::count(&dev.launches.dnn_uncaptured);
                return check("convolution", cudnn_call(&call));
            }
            None => {}
        }
        if self.seen.len() + self.graphs.len() >= Self::LIMIT {
            self.seen.clear();
            self.graphs.clear();
        }
        if self.seen.insert(key) {
            return check("convolution", cudnn_call(&call));
        }
        self.seen.remove(&key);
        match capturing(&dev.ctx, || capture(dev, &call)).and_then(|c| c) {
            Ok(graph) => {
                graph
                    .launch()
                    .map_err(|e| format!("launching a captured convolution: {e:?}"))?;
                self.graphs.insert(key, Some(graph));
                Ok(())
            }
            Err(why) => {
                log::debug!("cuDNN convolution not captured ({why}): it runs directly");
                Launches::count(&dev.launches.dnn_uncaptured);
                self.graphs.insert(key, None);
                check("convolution", cudnn_call(&call))
            }
        }
    }
}

/// cuDNN's algorithm searches exclude every other cuDNN call of the process (searches
/// take it to write, calls to read): several searches at once (executors in other
/// threads) failed with internal errors on cuDNN 9.14, and a convolution called while
/// another thread searched failed with EXECUTION_FAILED (the GPU tests' first run on
/// a fresh machine, where every algorithm is searched).
static SEARCHES_ALONE: RwLock<()> = RwLock::new(());

/// Runs `call` (a cuDNN call) while no capture of another thread ([`loading`]) and no
/// algorithm search runs.
fn cudnn_call<T>(call: impl FnOnce() -> T) -> T {
    loading(|| {
        let _shared = SEARCHES_ALONE.read().unwrap_or_else(|e| e.into_inner());
        call()
    })
}

/// `call` captured from the device's stream as a graph (not run).
fn capture(dev: &Device, call: &impl Fn() -> sys::cudnnStatus_t) -> Result<CudaGraph, String> {
    let mode = driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    dev.stream
        .begin_capture(mode)
        .map_err(|e| format!("begin capture: {e:?}"))?;
    let status = cudnn_call(call);
    // The capture ends whatever the call returned: the stream must leave capture mode.
    let graph = dev
        .stream
        .end_capture(driver_sys::CUgraphInstantiate_flags(0))
        .map_err(|e| format!("end capture: {e:?}"))?;
    check("convolution under capture", status)?;
    graph.ok_or_else(|| "an empty capture".to_string())
}

// SAFETY: the handle and descriptors are used from one executor at a time (`&mut`
// access to the executor runs one node at a time), on the executor's one stream.
unsafe impl Send for Dnn {}
unsafe impl Sync for Dnn {}
unsafe impl Send for ConvPlan {}
unsafe impl Sync for ConvPlan {}

struct Handle(sys::cudnnHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // cudnnDestroy synchronizes the device: not while another thread captures
        // (see Gemm's drop).
        // SAFETY: created by cudnnCreate, destroyed once.
        loading(|| unsafe { sys::cudnnDestroy(self.0) });
    }
}

fn check(what: &str, status: sys::cudnnStatus_t) -> Result<(), String> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuDNN returns a static C string for every status.
    let text = unsafe { std::ffi::CStr::from_ptr(sys::cudnnGetErrorString(status)) };
    Err(format!("cuDNN {what}: {}", text.to_string_lossy()))
}

macro_rules! descriptor {
    ($name:ident, $raw:ty, $create:ident, $destroy:ident) => {
        struct $name($raw);

        impl $name {
            fn new() -> Result<$name, String> {
                let mut d = std::ptr::null_mut();
                // SAFETY: writes one descriptor.
                check(stringify!($create), unsafe { sys::$create(&mut d) })?;
                Ok($name(d))
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: created by `new`, destroyed once.
                unsafe { sys::$destroy(self.0) };
            }
        }
    };
}

descriptor!(
    TensorDesc,
    sys::cudnnTensorDescriptor_t,
    cudnnCreateTensorDescriptor,
    cudnnDestroyTensorDescriptor
);
descriptor!(
    FilterDesc,
    sys::cudnnFilterDescriptor_t,
    cudnnCreateFilterDescriptor,
    cudnnDestroyFilterDescriptor
);
descriptor!(
    ConvDesc,
    sys::cudnnConvolutionDescriptor_t,
    cudnnCreateConvolutionDescriptor,
    cudnnDestroyConvolutionDescriptor
);

fn data_type(d: DType) -> Result<CudnnType, String> {
    Ok(match d {
        DType::F32 => CudnnType::CUDNN_DATA_FLOAT,
        DType::F16 => CudnnType::CUDNN_DATA_HALF,
        DType::BF16 => CudnnType::CUDNN_DATA_BFLOAT16,
        DType::F64 => CudnnType::CUDNN_DATA_DOUBLE,
        other => return Err(format!("cuDNN takes no {other} tensors")),
    })
}

fn format(layout: DataFormat) -> sys::cudnnTensorFormat_t {
    match layout {
        DataFormat::Nhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
        DataFormat::Nchw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
    }
}

fn dim(v: usize) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("dimension {v} is too large for cuDNN"))
}

fn dims4(v: [usize; 4]) -> Result<[i32; 4], String> {
    Ok([dim(v[0])?, dim(v[1])?, dim(v[2])?, dim(v[3])?])
}

/// A packed 4-D tensor `[n, c, h, w]` of `layout`.
fn tensor_desc(dtype: DType, layout: DataFormat, nchw: [usize; 4]) -> Result<TensorDesc, String> {
    let d = TensorDesc::new()?;
    let [n, c, h, w] = dims4(nchw)?;
    // SAFETY: a live descriptor.
    check("tensor descriptor", unsafe {
        sys::cudnnSetTensor4dDescriptor(d.0, format(layout), data_type(dtype)?, n, c, h, w)
    })?;
    Ok(d)
}

/// The scale type of alpha and beta: f64 for f64 tensors, else f32.
enum Scale {
    F32(f32),
    F64(f64),
}

impl Scale {
    fn of(dtype: DType, v: f64) -> Scale {
        if dtype == DType::F64 {
            Scale::F64(v)
        } else {
            Scale::F32(v as f32)
        }
    }
    fn ptr(&self) -> *const c_void {
        match self {
            Scale::F32(v) => v as *const f32 as *const c_void,
            Scale::F64(v) => v as *const f64 as *const c_void,
        }
    }
}

/// cuDNN's perf result, the same layout for the three directions; read with plain
/// integers (an enum holding a value Rust does not know would be undefined).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Perf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math: u32,
    reserved: [i32; 3],
}

impl Perf {
    fn algo(&self) -> Algo {
        Algo {
            id: self.algo,
            math: self.math,
            workspace: self.memory,
        }
    }
}

/// A workspace this small may raise a step's peak: beside the step's tensors it does
/// not matter, and the fastest algorithms often take a few MiB.
const SMALL_WORKSPACE: usize = 16 << 20;

/// cuDNN's timings tell apart no closer than this fraction of the fastest time (each
/// algorithm runs once, on a GPU whose clocks move): within it, less workspace wins.
const SAME_SPEED: f32 = 0.03;

/// Of `usable` results (cuDNN's order: fastest first), the one with the least workspace
/// among those as fast as the fastest within [`SAME_SPEED`]: a workspace is the step's
/// memory (an f32 FFT algorithm takes hundreds of MiB to win by a percent).
fn least_workspace_of_the_fastest<'a>(
    mut usable: impl Iterator<Item = &'a Perf>,
) -> Option<&'a Perf> {
    let fastest = usable.next()?;
    let bound = fastest.time * (1.0 + SAME_SPEED);
    Some(
        usable
            .take_while(|p| p.time <= bound)
            .fold(
                fastest,
                |best, p| if p.memory < best.memory { p } else { best },
            ),
    )
}

/// Each timed result as `ALGO math T ms N KiB`, for the debug log.
fn timings(direction: Direction, results: &[Perf]) -> String {
    let each: Vec<String> = results
        .iter()
        .filter(|p| p.status == 0)
        .map(|p| {
            format!(
                "{} {:.4} ms {} KiB",
                p.algo().name(direction),
                p.time,
                p.memory >> 10
            )
        })
        .collect();
    each.join("; ")
}

/// Each result as `ALGO status S [non-]deterministic N KiB`, for errors.
fn describe(direction: Direction, results: &[Perf]) -> String {
    let each: Vec<String> = results
        .iter()
        .map(|p| {
            format!(
                "{} status {} {}deterministic {} KiB",
                p.algo().name(direction),
                p.status,
                if p.determinism == 1 { "" } else { "non-" },
                p.memory >> 10
            )
        })
        .collect();
    if each.is_empty() {
        "none".into()
    } else {
        each.join("; ")
    }
}

const FWD_ALGOS: [sys::cudnnConvolutionFwdAlgo_t; 8] = {
    use sys::cudnnConvolutionFwdAlgo_t::*;
    [
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
};
const BWD_DATA_ALGOS: [sys::cudnnConvolutionBwdDataAlgo_t; 6] = {
    use sys::cudnnConvolutionBwdDataAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
};
const BWD_FILTER_ALGOS: [sys::cudnnConvolutionBwdFilterAlgo_t; 7] = {
    use sys::cudnnConvolutionBwdFilterAlgo_t::*;
    [
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
    ]
};
const MATH_TYPES: [sys::cudnnMathType_t; 4] = {
    use sys::cudnnMathType_t::*;
    [
        CUDNN_DEFAULT_MATH,
        CUDNN_TENSOR_OP_MATH,
        CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        CUDNN_FMA_MATH,
    ]
};

/// A convolution's chosen algorithm as cuDNN's enum of its direction.
#[derive(Clone, Copy)]
enum Chosen {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    Data(sys::cudnnConvolutionBwdDataAlgo_t),
    Filter(sys::cudnnConvolutionBwdFilterAlgo_t),
}

fn pick<T: Copy>(table: &[T], i: u32, what: &str) -> Result<T, String> {
    table
        .get(i as usize)
        .copied()
        .ok_or_else(|| format!("cuDNN returned unknown {what} {i}"))
}

impl Algo {
    fn name(&self, direction: Direction) -> String {
        let algo = match direction {
            Direction::Forward => pick(&FWD_ALGOS, self.id, "").map(|a| format!("{a:?}")),
            Direction::BackwardData => pick(&BWD_DATA_ALGOS, self.id, "").map(|a| format!("{a:?}")),
            Direction::BackwardFilter => {
                pick(&BWD_FILTER_ALGOS, self.id, "").map(|a| format!("{a:?}"))
            }
        }
        .unwrap_or_else(|_| format!("algo {}", self.id));
        let short = algo.rsplit("_ALGO_").next().unwrap_or(&algo).to_string();
        let math = match self.math {
            1 => " tensor-op",
            2 => " tensor-op (converting)",
            3 => " fma",
            _ => "",
        };
        format!("{short}{math}")
    }
}

/// The operands of one convolution call: `x`, `w` and `y` in the forward's roles;
/// the direction decides which is written (y forward, x backward-data, w
/// backward-filter).
pub struct ConvOperands<'a> {
    pub x: &'a DTensor,
    pub w: &'a DTensor,
    pub y: &'a DTensor,
}

impl Dnn {
    /// cuDNN for `dev`'s stream, keeping chosen algorithms in `dir` (the kernel cache's
    /// directory) where there is one. Loads nothing yet.
    pub fn new(dev: &Device, dir: Option<&PathBuf>) -> Dnn {
        let file = dir.map(|d| {
            let gpu: String = dev
                .name
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .collect();
            d.join(format!("cudnn-algorithms-{gpu}.txt"))
        });
        Dnn {
            handle: OnceLock::new(),
            stream: dev.stream.cu_stream() as sys::cudaStream_t,
            plans: Mutex::new(HashMap::new()),
            stored: Mutex::new(HashMap::new()),
            choices: Mutex::new(Vec::new()),
            workspace: Mutex::new(None),
            file,
            replays: Mutex::new(Replays::default()),
        }
    }

    fn handle(&self) -> Result<sys::cudnnHandle_t, String> {
        self.handle
            .get_or_init(|| {
                available()?;
                let mut h = std::ptr::null_mut();
                // SAFETY: writes one handle. Starting cuDNN loads its kernels: not
                // while another thread captures.
                check("create", loading(|| unsafe { sys::cudnnCreate(&mut h) }))?;
                let handle = Handle(h);
                // SAFETY: a live handle and the executor's stream.
                check("set stream", unsafe { sys::cudnnSetStream(h, self.stream) })?;
                self.load_stored();
                Ok(handle)
            })
            .as_ref()
            .map(|h| h.0)
            .map_err(Clone::clone)
    }

    /// The algorithms chosen so far, in the order they were chosen.
    pub fn choices(&self) -> Vec<Choice> {
        self.choices.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Reads the disk file of chosen algorithms ([`parse_stored`]).
    fn load_stored(&self) {
        let Some(text) = (self.file.as_ref()).and_then(|f| std::fs::read_to_string(f).ok()) else {
            return;
        };
        // SAFETY: cuDNN is loaded (called from `handle`).
        let version = unsafe { sys::cudnnGetVersion() }.to_string();
        if let Ok(mut s) = self.stored.lock() {
            *s = parse_stored(&text, &version);
        }
    }

    /// Adds a chosen algorithm to the disk file, rewritten whole and atomically with
    /// what other executors (other processes) added to it since it was read: each
    /// rewrote it from its own entries before, and the last writer's were all a
    /// shared cache kept.
    fn store(&self, key: &PlanKey, algo: Algo) {
        let Some(file) = &self.file else { return };
        let Ok(mut stored) = self.stored.lock() else {
            return;
        };
        // SAFETY: cuDNN is loaded (an algorithm was just chosen).
        let version = unsafe { sys::cudnnGetVersion() }.to_string();
        if let Ok(text) = std::fs::read_to_string(file) {
            merge_stored(&mut stored, &text, &version);
        }
        stored.insert(key.text(), algo);
        let written = file
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                let text = render_stored(&stored, &version);
                ampgraph_graph::format::write_atomic(file, text.as_bytes())
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            log::debug!("cuDNN algorithms not stored in {}: {e}", file.display());
        }
    }

    /// Runs one convolution product (`direction`) of `shape` on `ops`, its algorithm's
    /// workspace from `scratch` (given the bytes: the node's planned scratch) or else
    /// one workspace shared by every convolution. `room`: the bytes its workspace may
    /// take in the step's arena, which a first choice of algorithm keeps within.
    #[allow(clippy::too_many_arguments)]
    pub fn conv(
        &self,
        dev: &Device,
        direction: Direction,
        shape: &ConvShape,
        options: DnnOptions,
        room: Option<usize>,
        ops: ConvOperands,
        scratch: impl FnOnce(usize) -> Result<Option<DTensor>, String>,
    ) -> Result<(), String> {
        let handle = self.handle()?;
        let key = PlanKey {
            direction,
            shape: *shape,
            deterministic: options.deterministic,
            workspace_limit: options.workspace_limit(),
            room,
        };
        let cached = self
            .plans
            .lock()
            .map_err(|_| "poisoned")?
            .get(&key)
            .cloned();
        let plan = match cached {
            Some(p) => p,
            None => {
                // cuDNN's queries load kernels too (its heuristics, workspace sizes);
                // the search's failed candidates leave their errors on its thread.
                let plan = on_a_thread_of_its_own(&dev.ctx, || {
                    loading(|| self.plan(dev, handle, &key, options, &ops))
                })??;
                let plan = Arc::new(plan);
                self.plans
                    .lock()
                    .map_err(|_| "poisoned")?
                    .insert(key, plan.clone());
                plan
            }
        };
        let bytes = plan.algo.workspace;
        let workspace = match (bytes > 0).then(|| scratch(bytes)).transpose()?.flatten() {
            Some(planned) => Some(planned),
            None => self.workspace(dev, bytes)?,
        };
        let (ws, ws_bytes) = match &workspace {
            Some(w) => (w.ptr() as *mut c_void, plan.algo.workspace),
            None => (std::ptr::null_mut(), 0),
        };
        let (one, zero) = (Scale::of(shape.dtype, 1.0), Scale::of(shape.dtype, 0.0));
        let (x, w, y) = (ops.x.ptr(), ops.w.ptr(), ops.y.ptr());
        Launches::count(&dev.launches.dnn);
        let id = plan.algo.id;
        let algo = match direction {
            Direction::Forward => Chosen::Forward(pick(&FWD_ALGOS, id, "algorithm")?),
            Direction::BackwardData => Chosen::Data(pick(&BWD_DATA_ALGOS, id, "algorithm")?),
            Direction::BackwardFilter => Chosen::Filter(pick(&BWD_FILTER_ALGOS, id, "algorithm")?),
        };
        // SAFETY: the descriptors describe the operands' buffers (the caller made them
        // from the tensors' shapes); the workspace holds the algorithm's bytes; ordered
        // on the executor's stream.
        let call = || unsafe {
            match algo {
                Chosen::Forward(algo) => sys::cudnnConvolutionForward(
                    handle,
                    one.ptr(),
                    plan.x.0,
                    x as *const c_void,
                    plan.w.0,
                    w as *const c_void,
                    plan.conv.0,
                    algo,
                    ws,
                    ws_bytes,
                    zero.ptr(),
                    plan.y.0,
                    y as *mut c_void,
                ),
                Chosen::Data(algo) => sys::cudnnConvolutionBackwardData(
                    handle,
                    one.ptr(),
                    plan.w.0,
                    w as *const c_void,
                    plan.y.0,
                    y as *const c_void,
                    plan.conv.0,
                    algo,
                    ws,
                    ws_bytes,
                    zero.ptr(),
                    plan.x.0,
                    x as *mut c_void,
                ),
                Chosen::Filter(algo) => sys::cudnnConvolutionBackwardFilter(
                    handle,
                    one.ptr(),
                    plan.x.0,
                    x as *const c_void,
                    plan.y.0,
                    y as *const c_void,
                    plan.conv.0,
                    algo,
                    ws,
                    ws_bytes,
                    zero.ptr(),
                    plan.w.0,
                    w as *mut c_void,
                ),
            }
        };
        let replay = ReplayKey {
            plan: key,
            x,
            w,
            y,
            workspace: ws as u64,
        };
        self.replays
            .lock()
            .map_err(|_| "poisoned")?
            .run(dev, replay, call)
    }

    /// The shared workspace's bytes (0 where there is none).
    pub fn shared_workspace_bytes(&self) -> usize {
        let ws = self.workspace.lock();
        ws.map_or(0, |w| w.as_ref().map_or(0, DTensor::bytes))
    }

    /// Frees the shared workspace (the step's plan now holds each convolution's).
    pub fn release_workspace(&self) {
        if let Ok(mut ws) = self.workspace.lock() {
            *ws = None;
        }
    }

    /// The shared workspace, grown to at least `bytes` (none for 0 bytes).
    fn workspace(&self, dev: &Device, bytes: usize) -> Result<Option<DTensor>, String> {
        if bytes == 0 {
            return Ok(None);
        }
        // It is freed once the plan holds the scratch: no captured graph may keep it.
        if capturing_here() {
            return Err("the convolution's workspace is not planned yet".into());
        }
        let mut ws = self.workspace.lock().map_err(|_| "poisoned")?;
        if ws.as_ref().is_none_or(|w| w.bytes() < bytes) {
            *ws = None;
            *ws = Some(dev.alloc(DType::F32, &[bytes.div_ceil(4)], &"the cuDNN workspace")?);
        }
        Ok(ws.clone())
    }

    /// The descriptors of `key`'s convolution and its algorithm: stored on disk, else
    /// timed now.
    fn plan(
        &self,
        dev: &Device,
        handle: sys::cudnnHandle_t,
        key: &PlanKey,
        options: DnnOptions,
        ops: &ConvOperands,
    ) -> Result<ConvPlan, String> {
        let s = &key.shape;
        let x = tensor_desc(s.dtype, s.layout, s.input)?;
        let y = tensor_desc(s.dtype, s.layout, s.output())?;
        let w = FilterDesc::new()?;
        let [k, r, sw] = s.filter;
        let [wk, wc, wr, ws] = dims4([k, s.input[1] / s.groups.max(1), r, sw])?;
        // SAFETY: a live descriptor.
        check("filter descriptor", unsafe {
            sys::cudnnSetFilter4dDescriptor(
                w.0,
                data_type(s.dtype)?,
                format(s.layout),
                wk,
                wc,
                wr,
                ws,
            )
        })?;
        let conv = ConvDesc::new()?;
        // 16-bit convolutions accumulate in f32.
        let compute = if s.dtype == DType::F64 {
            CudnnType::CUDNN_DATA_DOUBLE
        } else {
            CudnnType::CUDNN_DATA_FLOAT
        };
        // SAFETY: a live descriptor.
        check("convolution descriptor", unsafe {
            sys::cudnnSetConvolution2dDescriptor(
                conv.0,
                dim(s.pad[0])?,
                dim(s.pad[1])?,
                dim(s.strides[0])?,
                dim(s.strides[1])?,
                dim(s.dilations[0])?,
                dim(s.dilations[1])?,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute,
            )
        })?;
        // SAFETY: a live descriptor.
        check("convolution group count", unsafe {
            sys::cudnnSetConvolutionGroupCount(conv.0, dim(s.groups)?)
        })?;
        let mut plan = ConvPlan {
            x,
            y,
            w,
            conv,
            algo: Algo {
                id: 0,
                math: 0,
                workspace: 0,
            },
        };
        let stored = self
            .stored
            .lock()
            .map_err(|_| "poisoned")?
            .get(&key.text())
            .copied();
        // A stored choice is taken only where cuDNN takes its algorithm for this
        // convolution within its workspace (a line another build or a torn write left
        // is timed again).
        let stored = stored.filter(|a| {
            (self.workspace_for(handle, key.direction, &plan, *a))
                .is_ok_and(|need| need <= a.workspace)
        });
        let (algo, ms, candidates, passed_over) = match stored {
            Some(a) => (a, None, 0, None),
            _ => {
                let found = self.fastest(dev, handle, key, &plan, options, ops)?;
                self.store(key, found.algo);
                (
                    found.algo,
                    Some(found.ms),
                    found.candidates,
                    found.passed_over,
                )
            }
        };
        // SAFETY: a live descriptor; the math type the algorithm was timed with.
        check("math type", unsafe {
            sys::cudnnSetConvolutionMathType(plan.conv.0, pick(&MATH_TYPES, algo.math, "math")?)
        })?;
        plan.algo = algo;
        let choice = Choice {
            direction: key.direction,
            shape: *s,
            algorithm: algo.name(key.direction),
            ms,
            workspace: algo.workspace,
            candidates,
            passed_over,
        };
        log::info!("cuDNN {}", choice);
        if let Ok(mut c) = self.choices.lock() {
            c.push(choice);
        }
        Ok(plan)
    }

    /// Times every algorithm of `key`'s convolution on the call's own operands (the
    /// output is overwritten by the real run after) with a search workspace of the
    /// limit, freed after; returns the fastest that fits the limit (and is
    /// deterministic where asked) and whose workspace fits the key's room (or
    /// [`SMALL_WORKSPACE`]; where none does, the fastest), its time, and how many ran.
    /// Where no timed run succeeds, cuDNN's heuristic order picks, untimed. Runs
    /// under its caller's [`loading`].
    fn fastest(
        &self,
        dev: &Device,
        handle: sys::cudnnHandle_t,
        key: &PlanKey,
        plan: &ConvPlan,
        options: DnnOptions,
        ops: &ConvOperands,
    ) -> Result<Found, String> {
        // f32 convolutions use TF32 Tensor Cores only where allowed.
        let s = &key.shape;
        let math = match (s.dtype, s.allow_tf32) {
            (DType::F32, false) => sys::cudnnMathType_t::CUDNN_FMA_MATH,
            (DType::F64, _) => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
            _ => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        };
        // SAFETY: a live descriptor.
        check("math type", unsafe {
            sys::cudnnSetConvolutionMathType(plan.conv.0, math)
        })?;
        let usable = |p: &&Perf| {
            p.status == 0
                && p.memory <= options.workspace_limit()
                && (!options.deterministic || p.determinism == 1)
        };
        let timed = {
            let workspace = dev.alloc(
                DType::F32,
                &[options.workspace_limit().div_ceil(4)],
                &"the cuDNN algorithm search",
            )?;
            let ws = (workspace.ptr() as *mut c_void, workspace.bytes());
            let _alone = SEARCHES_ALONE.write().unwrap_or_else(|e| e.into_inner());
            self.perf(handle, key.direction, plan, Some((ops, ws)))?
        };
        log::debug!(
            "cuDNN timed {:?} {:?}: {}",
            key.direction,
            s,
            timings(key.direction, &timed)
        );
        let fastest = least_workspace_of_the_fastest(timed.iter().filter(usable));
        let room = key.room.map_or(usize::MAX, |r| r.max(SMALL_WORKSPACE));
        let fits = |p: &&Perf| usable(p) && p.memory <= room;
        let fitting = least_workspace_of_the_fastest(timed.iter().filter(fits));
        if let Some(p) = fitting.or(fastest) {
            let passed_over = fastest
                .filter(|f| f.memory > p.memory && f.time < p.time)
                .map(|f| (f.algo().name(key.direction), f.time, f.memory));
            return Ok(Found {
                algo: p.algo(),
                ms: p.time,
                candidates: timed.len(),
                passed_over,
            });
        }
        let ranked = self.perf(handle, key.direction, plan, None)?;
        // The heuristic's order, the first whose workspace fits the room first.
        if let Some(p) = ranked.iter().find(fits).or(ranked.iter().find(usable)) {
            log::warn!(
                "cuDNN: no timed run succeeded ({}); taking the heuristic's pick",
                describe(key.direction, &timed)
            );
            return Ok(Found {
                algo: p.algo(),
                ms: f32::NAN,
                candidates: 0,
                passed_over: None,
            });
        }
        Err(format!(
            "no {}cuDNN algorithm runs this convolution within the workspace limit of {} MiB (timed: {}; ranked: {})",
            if options.deterministic { "deterministic " } else { "" },
            options.workspace_limit() >> 20,
            describe(key.direction, &timed),
            describe(key.direction, &ranked),
        ))
    }

    /// The workspace cuDNN asks of algorithm `algo` (with its math) for `plan`'s
    /// convolution in `direction`; an error where cuDNN does not take it.
    fn workspace_for(
        &self,
        handle: sys::cudnnHandle_t,
        direction: Direction,
        plan: &ConvPlan,
        algo: Algo,
    ) -> Result<usize, String> {
        let (x, w, y, c) = (plan.x.0, plan.w.0, plan.y.0, plan.conv.0);
        // SAFETY: a live descriptor.
        check("math type", unsafe {
            sys::cudnnSetConvolutionMathType(c, pick(&MATH_TYPES, algo.math, "math")?)
        })?;
        let mut bytes = 0usize;
        // SAFETY: live descriptors; cuDNN writes one size.
        let status = unsafe {
            match direction {
                Direction::Forward => sys::cudnnGetConvolutionForwardWorkspaceSize(
                    handle,
                    x,
                    w,
                    c,
                    y,
                    pick(&FWD_ALGOS, algo.id, "algorithm")?,
                    &mut bytes,
                ),
                Direction::BackwardData => sys::cudnnGetConvolutionBackwardDataWorkspaceSize(
                    handle,
                    w,
                    y,
                    c,
                    x,
                    pick(&BWD_DATA_ALGOS, algo.id, "algorithm")?,
                    &mut bytes,
                ),
                Direction::BackwardFilter => sys::cudnnGetConvolutionBackwardFilterWorkspaceSize(
                    handle,
                    x,
                    y,
                    c,
                    w,
                    pick(&BWD_FILTER_ALGOS, algo.id, "algorithm")?,
                    &mut bytes,
                ),
            }
        };
        check("workspace size", status)?;
        Ok(bytes)
    }

    /// cuDNN's results for every algorithm of a convolution: timed on `run`'s operands
    /// and workspace (`cudnnFind*AlgorithmEx`), else ranked by its heuristics
    /// (`cudnnGet*Algorithm_v7`, nothing runs).
    fn perf(
        &self,
        handle: sys::cudnnHandle_t,
        direction: Direction,
        plan: &ConvPlan,
        run: Option<(&ConvOperands, (*mut c_void, usize))>,
    ) -> Result<Vec<Perf>, String> {
        const MOST: usize = 16;
        let mut perf = [Perf::default(); MOST];
        let mut returned = 0i32;
        let (n, out) = (MOST as i32, &mut returned as *mut i32);
        let (x, w, y) = (plan.x.0, plan.w.0, plan.y.0);
        let c = plan.conv.0;
        // SAFETY: the descriptors are live and describe the operands' buffers; `perf`
        // holds MOST results of the layout cuDNN writes (Perf mirrors its structs).
        let status = unsafe {
            use Direction::*;
            let fwd = perf.as_mut_ptr() as *mut sys::cudnnConvolutionFwdAlgoPerf_t;
            let bwd_data = perf.as_mut_ptr() as *mut sys::cudnnConvolutionBwdDataAlgoPerf_t;
            let bwd_filter = perf.as_mut_ptr() as *mut sys::cudnnConvolutionBwdFilterAlgoPerf_t;
            match (direction, run) {
                (Forward, Some((o, (ws, bytes)))) => sys::cudnnFindConvolutionForwardAlgorithmEx(
                    handle,
                    x,
                    o.x.ptr() as _,
                    w,
                    o.w.ptr() as _,
                    c,
                    y,
                    o.y.ptr() as _,
                    n,
                    out,
                    fwd,
                    ws,
                    bytes,
                ),
                (BackwardData, Some((o, (ws, bytes)))) => {
                    sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        handle,
                        w,
                        o.w.ptr() as _,
                        y,
                        o.y.ptr() as _,
                        c,
                        x,
                        o.x.ptr() as _,
                        n,
                        out,
                        bwd_data,
                        ws,
                        bytes,
                    )
                }
                (BackwardFilter, Some((o, (ws, bytes)))) => {
                    sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        handle,
                        x,
                        o.x.ptr() as _,
                        y,
                        o.y.ptr() as _,
                        c,
                        w,
                        o.w.ptr() as _,
                        n,
                        out,
                        bwd_filter,
                        ws,
                        bytes,
                    )
                }
                (Forward, None) => {
                    sys::cudnnGetConvolutionForwardAlgorithm_v7(handle, x, w, c, y, n, out, fwd)
                }
                (BackwardData, None) => sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                    handle, w, y, c, x, n, out, bwd_data,
                ),
                (BackwardFilter, None) => sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                    handle, x, y, c, w, n, out, bwd_filter,
                ),
            }
        };
        check("algorithm search", status)?;
        Ok(perf[..(returned.max(0) as usize).min(MOST)].to_vec())
    }

    /// Batch normalisation of `x` (`[n, c, h, w]` in `layout`) over all but the
    /// channels: in training with the batch's statistics, writing the batch mean and
    /// the batch variance with Bessel's correction into `stats`; else with the given
    /// `stats` (mean, variance). `params` are the scale and offset (`[c]`, f32 or f64).
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm(
        &self,
        dev: &Device,
        layout: DataFormat,
        nchw: [usize; 4],
        epsilon: f64,
        training: bool,
        x: &DTensor,
        [scale, offset]: [&DTensor; 2],
        [mean, variance]: [&DTensor; 2],
        y: &DTensor,
    ) -> Result<(), String> {
        let handle = self.handle()?;
        let (xd, pd) = batch_norm_descriptors(x, scale, layout, nchw)?;
        let (one, zero) = (Scale::of(x.dtype, 1.0), Scale::of(x.dtype, 0.0));
        let ptr = |t: &DTensor| t.ptr() as *mut c_void;
        Launches::count(&dev.launches.dnn);
        // SAFETY: the descriptors describe the buffers (the caller checked the types);
        // ordered on the executor's stream.
        if training {
            // With an averaging factor of 1 the running averages cuDNN updates are the
            // batch statistics (the variance with Bessel's correction), once they hold
            // no NaN to carry over.
            dev.zero(mean)?;
            dev.zero(variance)?;
        }
        let status = cudnn_call(|| unsafe {
            if training {
                sys::cudnnBatchNormalizationForwardTraining(
                    handle,
                    bn_mode(layout, x.dtype),
                    one.ptr(),
                    zero.ptr(),
                    xd.0,
                    ptr(x),
                    xd.0,
                    ptr(y),
                    pd.0,
                    ptr(scale),
                    ptr(offset),
                    1.0,
                    ptr(mean),
                    ptr(variance),
                    epsilon,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            } else {
                sys::cudnnBatchNormalizationForwardInference(
                    handle,
                    sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL,
                    one.ptr(),
                    zero.ptr(),
                    xd.0,
                    ptr(x),
                    xd.0,
                    ptr(y),
                    pd.0,
                    ptr(scale),
                    ptr(offset),
                    ptr(mean),
                    ptr(variance),
                    epsilon,
                )
            }
        });
        check("batch norm", status)
    }

    /// The gradient of a training batch normalisation: `dx`, `dscale`, `doffset` from
    /// `x`, `dy` and the scale, the batch statistics computed again from `x`.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm_grad(
        &self,
        dev: &Device,
        layout: DataFormat,
        nchw: [usize; 4],
        epsilon: f64,
        [x, scale, dy]: [&DTensor; 3],
        [dx, dscale, doffset]: [&DTensor; 3],
    ) -> Result<(), String> {
        let handle = self.handle()?;
        let (xd, pd) = batch_norm_descriptors(x, scale, layout, nchw)?;
        let (one, zero) = (Scale::of(x.dtype, 1.0), Scale::of(x.dtype, 0.0));
        let ptr = |t: &DTensor| t.ptr() as *mut c_void;
        Launches::count(&dev.launches.dnn);
        // SAFETY: as in `batch_norm`; no saved statistics (cuDNN computes them again).
        let status = cudnn_call(|| unsafe {
            sys::cudnnBatchNormalizationBackward(
                handle,
                bn_mode(layout, x.dtype),
                one.ptr(),
                zero.ptr(),
                one.ptr(),
                zero.ptr(),
                xd.0,
                ptr(x),
                xd.0,
                ptr(dy),
                xd.0,
                ptr(dx),
                pd.0,
                ptr(scale),
                ptr(dscale),
                ptr(doffset),
                epsilon,
                std::ptr::null(),
                std::ptr::null(),
            )
        });
        check("batch norm gradient", status)
    }
}

/// The descriptors of a batch norm's images (`x`, `[n, c, h, w]` in `layout`) and of
/// its per-channel parameters and statistics (`[1, c, 1, 1]` of `scale`'s dtype).
fn batch_norm_descriptors(
    x: &DTensor,
    scale: &DTensor,
    layout: DataFormat,
    nchw: [usize; 4],
) -> Result<(TensorDesc, TensorDesc), String> {
    let images = tensor_desc(x.dtype, layout, nchw)?;
    let params = tensor_desc(scale.dtype, DataFormat::Nchw, [1, nchw[1], 1, 1])?;
    Ok((images, params))
}

/// cuDNN's persistent batch-norm kernels (one pass over memory where the batch fits)
/// take NHWC 16-bit tensors; the plain spatial mode takes everything.
fn bn_mode(layout: DataFormat, dtype: DType) -> sys::cudnnBatchNormMode_t {
    if layout == DataFormat::Nhwc && dtype.is_half() {
        sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL_PERSISTENT
    } else {
        sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL
    }
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shape;
        let [n, c, h, w] = s.input;
        let [k, r, sw] = s.filter;
        write!(
            f,
            "{:?} {} {:?} x[{n},{c},{h},{w}] filter {k}x{r}x{sw} stride {}x{} pad {}x{}",
            self.direction, s.dtype, s.layout, s.strides[0], s.strides[1], s.pad[0], s.pad[1],
        )?;
        if s.groups != 1 {
            write!(f, " groups {}", s.groups)?;
        }
        if s.dilations != [1, 1] {
            write!(f, " dilation {}x{}", s.dilations[0], s.dilations[1])?;
        }
        write!(f, ": {}", self.algorithm)?;
        match self.ms {
            Some(ms) if ms.is_nan() => write!(f, " (cuDNN's heuristic pick: timing failed)")?,
            Some(ms) => write!(f, ", {ms:.3} ms of {} timed", self.candidates)?,
            None => write!(f, " (from the disk file)")?,
        }
        write!(f, ", workspace {} KiB", self.workspace >> 10)?;
        if let Some((name, ms, bytes)) = &self.passed_over {
            let kib = bytes >> 10;
            write!(
                f,
                " (not {name}, {ms:.3} ms: its {kib} KiB would raise the step's peak)"
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(algo: u32, time: f32, memory: usize) -> Perf {
        Perf {
            algo,
            status: 0,
            time,
            memory,
            determinism: 1,
            math: 0,
            reserved: [0; 3],
        }
    }

    #[test]
    fn the_least_workspace_within_three_percent_of_the_fastest_wins() {
        let mib = 1 << 20;
        let results = [
            timed(5, 1.000, 300 * mib), // fastest, FFT-like workspace
            timed(1, 1.020, 2 * mib),   // 2% slower, little workspace: chosen
            timed(0, 1.025, 0),         // as fast, none: chosen over both
            timed(2, 1.040, 0),         // 4% slower: out of the tie
        ];
        let pick = least_workspace_of_the_fastest(results.iter()).map(|p| p.algo);
        assert_eq!(pick, Some(0));
        // Beyond 3% the fastest keeps its place whatever it needs.
        let apart = [timed(5, 1.0, 300 * mib), timed(1, 1.031, 0)];
        assert_eq!(
            least_workspace_of_the_fastest(apart.iter()).map(|p| p.algo),
            Some(5)
        );
        // Equal workspaces: the faster.
        let equal = [timed(3, 1.0, mib), timed(4, 1.01, mib)];
        assert_eq!(
            least_workspace_of_the_fastest(equal.iter()).map(|p| p.algo),
            Some(3)
        );
        assert!(least_workspace_of_the_fastest([].iter()).is_none());
    }

    /// The disk file's lines round-trip; another cuDNN version's lines and damaged ones
    /// are left out; a store keeps what another process wrote since (merged as
    /// `store` merges: entries of the file it lacks join its own).
    #[test]
    fn stored_algorithms_round_trip_and_merge() {
        let algo = |id, workspace| Algo {
            id,
            math: 1,
            workspace,
        };
        let ours = HashMap::from([
            ("a".to_string(), algo(1, 0)),
            ("b".to_string(), algo(2, 64)),
        ]);
        let text = render_stored(&ours, "91400");
        assert_eq!(text, "a\t1\t1\t0\t91400\nb\t2\t1\t64\t91400\n");
        assert_eq!(parse_stored(&text, "91400"), ours);
        assert!(parse_stored(&text, "90100").is_empty(), "another version");
        let damaged = "a\t1\t1\t0\nb\tx\t1\t64\t91400\nc\t3\t0\t8\t91400\n";
        assert_eq!(
            parse_stored(damaged, "91400"),
            HashMap::from([(
                "c".to_string(),
                Algo {
                    id: 3,
                    math: 0,
                    workspace: 8
                }
            )])
        );
        // Another process's file holds c and its own b: ours keep b, c joins.
        let theirs = render_stored(
            &HashMap::from([("b".to_string(), algo(9, 0)), ("c".to_string(), algo(3, 8))]),
            "91400",
        );
        let mut merged = ours.clone();
        merge_stored(&mut merged, &theirs, "91400");
        assert_eq!(merged["b"], algo(2, 64));
        assert_eq!(merged["c"], algo(3, 8));
        assert_eq!(merged.len(), 3);
    }
}
