//! The device side of the CUDA executor: context and stream, device tensors in pooled
//! buffers, uploads and downloads, and NVRTC kernels compiled once per process.

use std::cell::Cell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use ampgraph_graph::tensor::ShapeDisplay;
use ampgraph_graph::{DType, Data, Tensor, TensorType};

use super::kernel_cache::DiskCache;

/// Runs `f`, turning a panic inside cudarc (a missing library or symbol) into an error.
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("{what}: {msg}"))
        }
    }
}

/// The most dimensions a strided kernel argument holds (larger ranks are refused).
pub(crate) const MAX_RANK: usize = 8;

/// The members of a grouped update one `k_group` launch takes, and the pointers of
/// each (an update's inputs and outputs): its table is a by-value kernel parameter,
/// 3.3 KiB of CUDA's 4 KiB.
pub(crate) const GROUP_MEMBERS: usize = 32;
pub(crate) const GROUP_POINTERS: usize = 12;

/// Shape and strides of a strided kernel argument (up to [`MAX_RANK`] dims).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Dims(pub [i64; MAX_RANK]);

// SAFETY: a plain array of i64, laid out as the kernels' `struct Dims`.
unsafe impl DeviceRepr for Dims {}

impl Dims {
    pub fn new(v: &[usize]) -> Result<Dims, String> {
        if v.len() > MAX_RANK {
            return Err(format!(
                "rank {} is above the CUDA kernels' limit of {MAX_RANK}",
                v.len()
            ));
        }
        let mut d = Dims::default();
        for (o, &x) in d.0.iter_mut().zip(v) {
            *o = x as i64;
        }
        Ok(d)
    }
}

/// One kernel argument.
#[derive(Clone, Debug)]
pub enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F64(f64),
    Dims(Dims),
    Table(Box<UpdateTable>),
}

/// The pointers and lengths of a grouped update's members (an optimizer's, delayed
/// FP8 scaling's), laid out as the
/// kernels' `struct UpdateTable` (a by-value parameter): row `m` holds member `m`'s
/// arguments in its kernel's order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UpdateTable {
    ptrs: [[u64; GROUP_POINTERS]; GROUP_MEMBERS],
    lens: [i64; GROUP_MEMBERS],
}

// SAFETY: plain arrays of u64 and i64, laid out as the kernels' `struct UpdateTable`.
unsafe impl DeviceRepr for UpdateTable {}

impl Default for UpdateTable {
    fn default() -> Self {
        UpdateTable {
            ptrs: [[0; GROUP_POINTERS]; GROUP_MEMBERS],
            lens: [0; GROUP_MEMBERS],
        }
    }
}

impl UpdateTable {
    /// Row `row`: a member's arguments, pointers or integers (read back as `(i64)`
    /// of the slot), and its length.
    pub fn set(&mut self, row: usize, args: &[Arg], len: usize) -> Result<(), String> {
        let slots = self
            .ptrs
            .get_mut(row)
            .filter(|slots| args.len() <= slots.len())
            .ok_or("internal: a grouped update's table is too small")?;
        for (slot, arg) in slots.iter_mut().zip(args) {
            *slot = match arg {
                Arg::Ptr(p) => *p,
                Arg::I64(v) => *v as u64,
                _ => return Err("internal: a grouped update takes pointers and i64s only".into()),
            };
        }
        self.lens[row] = len as i64;
        Ok(())
    }
}

/// The kernels' declaration of [`UpdateTable`].
pub(crate) fn update_table_declaration() -> String {
    format!(
        "struct UpdateTable {{ const void* p[{GROUP_MEMBERS}][{GROUP_POINTERS}]; i64 n[{GROUP_MEMBERS}]; }};\n"
    )
}

/// Free device buffers by capacity, for reuse.
#[derive(Default)]
pub struct Pool {
    free: HashMap<usize, Vec<CudaSlice<u8>>>,
    /// Bytes currently handed out (live tensors).
    pub live: usize,
    /// The most bytes ever live at once.
    pub peak: usize,
    /// While a step is captured into a CUDA graph: every buffer handed out since
    /// ([`Device::start_tape`]), which the graph will keep.
    tape: Option<Vec<(Weak<Buf>, u64)>>,
    /// Capacities asked for while taping that the pool did not hold.
    missed: Vec<usize>,
}

/// Work put on the stream since the device was opened, by kind (what a profiler such as
/// nsys would count as launches: a cuBLASLt call may run one or two kernels of its own).
#[derive(Debug, Default)]
pub struct Launches {
    pub kernels: AtomicU64,
    pub gemms: AtomicU64,
    pub dnn: AtomicU64,
    pub dnn_replays: AtomicU64,
    pub dnn_uncaptured: AtomicU64,
    pub step_graphs: AtomicU64,
    pub memsets: AtomicU64,
    pub memcpys: AtomicU64,
}

/// A snapshot of the device's launch counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchCounts {
    /// NVRTC kernels.
    pub kernels: u64,
    /// cuBLASLt matmul calls.
    pub gemms: u64,
    /// cuDNN calls (convolutions, batch normalisation).
    pub dnn: u64,
    /// Of those, replays of a captured call (one graph launch each).
    pub dnn_replays: u64,
    /// Calls seen twice that cuDNN could not run under a capture: they run directly
    /// (which algorithms capture can depend on the search's timings).
    pub dnn_uncaptured: u64,
    /// Whole steps launched as their CUDA graph (every kernel of the step in one
    /// launch, counted here and not above).
    pub step_graphs: u64,
    pub memsets: u64,
    /// Host-device copies (uploads of feeds, downloads of fetches).
    pub memcpys: u64,
}

impl LaunchCounts {
    /// Everything put on the stream.
    pub fn total(&self) -> u64 {
        self.kernels + self.gemms + self.dnn + self.step_graphs + self.memsets + self.memcpys
    }
}

impl std::ops::Sub for LaunchCounts {
    type Output = LaunchCounts;
    fn sub(self, o: LaunchCounts) -> LaunchCounts {
        LaunchCounts {
            kernels: self.kernels - o.kernels,
            gemms: self.gemms - o.gemms,
            dnn: self.dnn - o.dnn,
            dnn_replays: self.dnn_replays - o.dnn_replays,
            dnn_uncaptured: self.dnn_uncaptured - o.dnn_uncaptured,
            step_graphs: self.step_graphs - o.step_graphs,
            memsets: self.memsets - o.memsets,
            memcpys: self.memcpys - o.memcpys,
        }
    }
}

impl Launches {
    pub fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> LaunchCounts {
        LaunchCounts {
            kernels: self.kernels.load(Ordering::Relaxed),
            gemms: self.gemms.load(Ordering::Relaxed),
            dnn: self.dnn.load(Ordering::Relaxed),
            dnn_replays: self.dnn_replays.load(Ordering::Relaxed),
            dnn_uncaptured: self.dnn_uncaptured.load(Ordering::Relaxed),
            step_graphs: self.step_graphs.load(Ordering::Relaxed),
            memsets: self.memsets.load(Ordering::Relaxed),
            memcpys: self.memcpys.load(Ordering::Relaxed),
        }
    }
}

/// A device allocation; back to the pool when the last tensor using it drops.
pub struct Buf {
    slice: Option<CudaSlice<u8>>,
    cap: usize,
    ptr: u64,
    pool: Arc<Mutex<Pool>>,
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            if let Ok(mut p) = self.pool.lock() {
                p.live = p.live.saturating_sub(self.cap);
                p.free.entry(self.cap).or_default().push(s);
            }
        }
    }
}

/// A tensor on the device: a buffer of its own, or a slot at `offset` bytes into a
/// shared one (a step's arena). Cloning shares the buffer (Reshape and Identity alias).
#[derive(Clone)]
pub struct DTensor {
    buf: Arc<Buf>,
    offset: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl DTensor {
    pub fn ptr(&self) -> u64 {
        self.buf.ptr + self.offset as u64
    }
    /// A tensor of `ty` at byte `offset` of this one's buffer.
    pub fn slot(&self, offset: usize, ty: &TensorType) -> Result<DTensor, String> {
        let offset = self.offset + offset;
        if offset + ty.size_bytes() > self.buf.cap {
            return Err(format!(
                "a slot of {} bytes at offset {offset} overruns a buffer of {} bytes",
                ty.size_bytes(),
                self.buf.cap
            ));
        }
        Ok(DTensor {
            buf: self.buf.clone(),
            offset,
            dtype: ty.dtype,
            shape: ty.shape.clone(),
        })
    }
    /// Whether both live in the same buffer.
    pub fn shares_buffer(&self, other: &DTensor) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype.size_bytes()
    }
    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype, self.shape.clone())
    }
    /// The same buffer with another shape of equal size.
    pub fn reshaped(&self, shape: Vec<usize>) -> DTensor {
        DTensor {
            buf: self.buf.clone(),
            offset: self.offset,
            dtype: self.dtype,
            shape,
        }
    }
    pub fn arg(&self) -> Arg {
        Arg::Ptr(self.ptr())
    }
}

/// PTX by (arch, kernel key), shared by every executor of the process.
fn ptx_cache() -> &'static Mutex<HashMap<String, Ptx>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Ptx>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// NVRTC's version (`major.minor`), asked once: part of every disk-cache key.
fn nvrtc_version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-parameters, written by NVRTC; a missing library panics
        // inside cudarc, which the executor's guard turns into an error.
        let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        match status {
            cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => format!("{major}.{minor}"),
            other => format!("unknown ({other:?})"),
        }
    })
}

/// Include directories for `cuda_fp16.h` and `cuda_bf16.h`.
fn include_paths() -> Vec<String> {
    let mut roots = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            roots.push(v);
        }
    }
    roots.push("/usr/local/cuda".into());
    let mut out = Vec::new();
    for r in roots {
        for sub in ["include", "include/cccl"] {
            let p = format!("{r}/{sub}");
            if std::path::Path::new(&p).is_dir() && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// Captures of the stream into CUDA graphs (cuDNN's convolutions, [`capturing`])
/// exclude, process-wide, work that may load kernels ([`loading`]): with CUDA's lazy
/// loading a kernel's first launch loads its module, and a load in one thread while
/// another captures failed that thread's cuDNN call (CUDNN_STATUS_EXECUTION_FAILED).
static CAPTURE_EXCLUDES_LOADS: RwLock<()> = RwLock::new(());

thread_local! {
    /// Whether this thread runs a [`capturing`] call now: its own library calls
    /// inside the capture need no [`loading`] lock (they would wait for themselves).
    static CAPTURING_HERE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (library calls that may load kernels: cuDNN, cuBLASLt, module loads) with
/// no capture in progress; any number run at once.
pub fn loading<T>(f: impl FnOnce() -> T) -> T {
    if CAPTURING_HERE.get() {
        return f();
    }
    let _shared = CAPTURE_EXCLUDES_LOADS
        .read()
        .unwrap_or_else(|e| e.into_inner());
    f()
}

/// Runs `f` (a stream capture of a stream of `ctx`) while no [`loading`] call of
/// another thread runs, on a thread of its own ([`on_a_thread_of_its_own`]). A library
/// call that fails under a capture leaves the failure (901, the capture invalidated)
/// as its thread's last CUDA runtime error.
pub fn capturing<T>(ctx: &Arc<CudaContext>, f: impl FnOnce() -> T) -> Result<T, String> {
    if CAPTURING_HERE.get() {
        return Ok(f());
    }
    on_a_thread_of_its_own(ctx, || {
        let _alone = CAPTURE_EXCLUDES_LOADS
            .write()
            .unwrap_or_else(|e| e.into_inner());
        CAPTURING_HERE.set(true);
        f()
    })
}

/// Runs `f` (library calls expected to fail in part, such as cuDNN's algorithm
/// searches, which run every algorithm) on a thread of its own bound to `ctx`, and
/// waits for it. cuDNN and cuBLASLt each keep their own copy of the CUDA runtime,
/// whose per-thread last error [`clear_runtime_error`] cannot reach: after one of
/// their calls failed inside the runtime, their next call on that thread, captured or
/// not, failed with EXECUTION_FAILED (seen after captures, and after searches on a
/// loaded GPU). The thread ends with its errors. Inside a capture `f` runs here.
pub fn on_a_thread_of_its_own<T>(
    ctx: &Arc<CudaContext>,
    f: impl FnOnce() -> T,
) -> Result<T, String> {
    if CAPTURING_HERE.get() {
        return Ok(f());
    }
    /// Moves `f` and its result across the threads.
    struct Across<T>(T);
    // SAFETY: the thread is joined before this returns, and the CUDA objects `f` uses
    // may be used from any thread bound to their context, one thread at a time: the
    // calling thread waits meanwhile.
    unsafe impl<T> Send for Across<T> {}
    let (work, ctx) = (Across(f), ctx.clone());
    let joined = std::thread::scope(|s| {
        s.spawn(move || {
            let work = work;
            ctx.bind_to_thread()
                .map_err(|e| format!("context: {e:?}"))?;
            Ok(Across((work.0)()))
        })
        .join()
    });
    match joined {
        Ok(result) => result.map(|r: Across<T>| r.0),
        Err(_) => Err("a CUDA library's thread panicked".into()),
    }
}

/// Whether this thread is capturing a stream now ([`capturing`]).
pub fn capturing_here() -> bool {
    CAPTURING_HERE.get()
}

/// Clears the last error of this thread in the CUDA runtime the process loads. A
/// library that calls that runtime reads its last error after its launches: an error
/// left by an earlier call that failed and was handled would fail its next call with
/// `EXECUTION_FAILED`. (Libraries with a runtime of their own keep theirs: a capture,
/// where calls fail and are handled, runs on a thread of its own, [`capturing`].)
pub fn clear_runtime_error() {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library.
    if *PRESENT.get_or_init(|| unsafe { cudarc::runtime::sys::is_culib_present() }) {
        // SAFETY: reads and resets this thread's last error; no other effect.
        let _ = unsafe { cudarc::runtime::sys::cudaGetLastError() };
    }
}

/// What a module is compiled for: any GPU of the device's compute capability, or the
/// device's own architecture with its instructions that later ones may lack (Hopper's
/// `wgmma`, `compute_90a`), which the source uses only where the compiler defines
/// `__CUDA_ARCH_FEAT_SM90_ALL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Portable,
    ArchSpecific,
}

pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// `compute_90` for an H100.
    arch: String,
    /// The compute capability, `90` for an H100.
    pub sm: u32,
    pub name: String,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    /// Kernels by module key, then by name.
    functions: Mutex<HashMap<String, HashMap<&'static str, Arc<CudaFunction>>>>,
    /// Streaming multiprocessors (132 on an H100).
    pub multiprocessors: u32,
    /// Blocks of a kernel that fit on the GPU at once, by module key and name.
    resident: Mutex<HashMap<(String, &'static str), u32>>,
    pub pool: Arc<Mutex<Pool>>,
    /// The GPU's memory in bytes.
    pub total_bytes: usize,
    /// Compiled PTX kept between processes.
    disk_cache: DiskCache,
    pub launches: Launches,
}

pub(super) fn drv<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("CUDA {what}: {e:?}")
}

impl Device {
    /// The device `ordinal`, keeping compiled kernels in `disk_cache`.
    pub fn new(ordinal: usize, disk_cache: DiskCache) -> Result<Device, String> {
        let ctx = CudaContext::new(ordinal).map_err(drv("context"))?;
        // One stream orders every use of a buffer; cudarc's per-buffer events are not needed.
        // SAFETY: no buffer of this context exists yet and all work goes to one stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("stream"))?;
        let (major, minor) = ctx.compute_capability().map_err(drv("device query"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("device query"))?;
        let total_bytes = ctx.total_mem().map_err(drv("device query"))?;
        Ok(Device {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            sm: (major * 10 + minor) as u32,
            name,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            multiprocessors: multiprocessors.max(1) as u32,
            resident: Mutex::new(HashMap::new()),
            pool: Arc::new(Mutex::new(Pool::default())),
            total_bytes,
            disk_cache,
            launches: Launches::default(),
        })
    }

    /// A fresh (uninitialised) tensor. `who` names it in an out-of-memory error (and is
    /// formatted only then: allocations are on every step's path).
    pub fn alloc(
        &self,
        dtype: DType,
        shape: &[usize],
        who: &dyn std::fmt::Display,
    ) -> Result<DTensor, String> {
        let n: usize = shape.iter().product();
        let bytes = n * dtype.size_bytes();
        let cap = bytes.max(1).div_ceil(256) * 256;
        let (reused, taping) = {
            let mut p = self.pool.lock().map_err(|_| "device pool poisoned")?;
            let s = p.free.get_mut(&cap).and_then(|v| v.pop());
            if s.is_some() {
                p.live += cap;
                p.peak = p.peak.max(p.live);
            }
            let taping = p.tape.is_some();
            if taping && s.is_none() {
                p.missed.push(cap);
            }
            (s, taping)
        };
        let slice = match reused {
            Some(s) => s,
            // A stream-ordered allocation would become part of the captured graph.
            None if taping => {
                return Err(format!(
                    "{who} needs {bytes} bytes the buffer pool does not hold while the step is captured"
                ))
            }
            // Never asked of the driver: around a stream-ordered allocation beyond the
            // GPU's memory, other work on the GPU (other processes' too) ran out of
            // memory.
            None if cap > self.total_bytes => {
                return Err(format!(
                    "out of device memory: {bytes} bytes for {who} {}{} exceed the GPU's {} bytes",
                    dtype,
                    ShapeDisplay(shape),
                    self.total_bytes
                ))
            }
            None => {
                // SAFETY: u8 has no invalid bit patterns; every kernel writes before reads.
                let first = unsafe { self.stream.alloc::<u8>(cap) };
                let s = match first {
                    Ok(s) => s,
                    Err(_) => {
                        // Give the pool's free buffers back and try once more.
                        if let Ok(mut p) = self.pool.lock() {
                            p.free.clear();
                        }
                        let _ = self.stream.synchronize();
                        unsafe { self.stream.alloc::<u8>(cap) }.map_err(|e| {
                            format!(
                                "out of device memory allocating {bytes} bytes for {who} {}{} ({e:?})",
                                dtype,
                                ShapeDisplay(shape)
                            )
                        })?
                    }
                };
                let mut p = self.pool.lock().map_err(|_| "device pool poisoned")?;
                p.live += cap;
                p.peak = p.peak.max(p.live);
                s
            }
        };
        let ptr = {
            let (p, _sync) = slice.device_ptr(&self.stream);
            p
        };
        let buf = Arc::new(Buf {
            slice: Some(slice),
            cap,
            ptr,
            pool: self.pool.clone(),
        });
        if taping {
            let mut p = self.pool.lock().map_err(|_| "device pool poisoned")?;
            if let Some(tape) = p.tape.as_mut() {
                tape.push((Arc::downgrade(&buf), ptr));
            }
        }
        Ok(DTensor {
            buf,
            offset: 0,
            dtype,
            shape: shape.to_vec(),
        })
    }

    /// Starts recording the buffers handed out (a step being captured): while it
    /// records, an allocation the pool cannot serve fails rather than reaching the
    /// driver.
    pub fn start_tape(&self) -> Result<(), String> {
        let mut p = self.pool.lock().map_err(|_| "device pool poisoned")?;
        p.tape = Some(Vec::new());
        p.missed.clear();
        Ok(())
    }

    /// The capacities the pool did not hold during the last tape.
    pub fn tape_misses(&self) -> Vec<usize> {
        self.pool
            .lock()
            .map(|p| p.missed.clone())
            .unwrap_or_default()
    }

    /// Adds a free buffer of each capacity in `caps` to the pool (allocated from the
    /// driver now), for a capture to take.
    pub fn reserve(&self, caps: &[usize]) -> Result<(), String> {
        for &cap in caps {
            // SAFETY: u8 has no invalid bit patterns; every kernel writes before reads.
            let slice = unsafe { self.stream.alloc::<u8>(cap) }.map_err(|e| {
                format!("out of device memory reserving {cap} bytes for a captured step ({e:?})")
            })?;
            let mut p = self.pool.lock().map_err(|_| "device pool poisoned")?;
            p.free.entry(cap).or_default().push(slice);
        }
        Ok(())
    }

    /// Stops recording and returns every buffer handed out since
    /// [`start_tape`](Self::start_tape): those still alive, and those freed meanwhile
    /// taken back out of the pool, so that nothing else is given them while a graph
    /// captured meanwhile may still write them. Dropping the result returns them.
    pub fn end_tape(&self) -> Result<Vec<DTensor>, String> {
        let mut p = self.pool.lock().map_err(|_| "device pool poisoned")?;
        let tape = p.tape.take().unwrap_or_default();
        let mut held = Vec::new();
        for (weak, ptr) in tape {
            let buf = match weak.upgrade() {
                Some(buf) => buf,
                None => {
                    let found = p.free.iter_mut().find_map(|(&cap, list)| {
                        let at = list.iter().position(|s| {
                            let (q, _sync) = s.device_ptr(&self.stream);
                            q == ptr
                        })?;
                        Some((cap, list.swap_remove(at)))
                    });
                    // Handed out twice during the capture: already held.
                    let Some((cap, slice)) = found else { continue };
                    p.live += cap;
                    p.peak = p.peak.max(p.live);
                    Arc::new(Buf {
                        slice: Some(slice),
                        cap,
                        ptr,
                        pool: self.pool.clone(),
                    })
                }
            };
            held.push(DTensor {
                offset: 0,
                dtype: DType::F32,
                shape: vec![buf.cap / 4],
                buf,
            });
        }
        Ok(held)
    }

    /// Makes this device's context the calling thread's: with several GPUs in one
    /// process, a thread may touch a device other than the one it last used.
    pub fn bind(&self) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(drv("context"))
    }

    pub fn upload(&self, t: &Tensor, who: &dyn std::fmt::Display) -> Result<DTensor, String> {
        self.upload_data(t.data(), t.shape(), who)
    }

    /// `data` of shape `shape` on the device (checked by the caller to match).
    pub fn upload_data(
        &self,
        data: &Data,
        shape: &[usize],
        who: &dyn std::fmt::Display,
    ) -> Result<DTensor, String> {
        self.bind()?;
        let d = self.alloc(data.dtype(), shape, who)?;
        self.write(&d, data)?;
        Ok(d)
    }

    /// Copies `data` from the host into `d` (of its type), on the stream.
    pub fn write(&self, d: &DTensor, data: &Data) -> Result<(), String> {
        if data.len() != d.len() || data.dtype() != d.dtype {
            return Err(format!(
                "{} values of {} copied into {}{}",
                data.len(),
                data.dtype(),
                d.dtype,
                ShapeDisplay(&d.shape)
            ));
        }
        let bytes = data.le_bytes();
        if !bytes.is_empty() {
            Launches::count(&self.launches.memcpys);
            // SAFETY: the buffer holds at least `bytes.len()` bytes; the copy is ordered
            // on the stream, and a pageable source is staged before the call returns.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(d.ptr(), &bytes, self.stream.cu_stream())
                    .map_err(drv("upload"))?;
            }
        }
        Ok(())
    }

    /// Copies `d` to the host. The values land in the returned tensor's own vector,
    /// unwritten until the copy fills it: a byte vector converted into a second one
    /// cost a large output (GPT-2's 25 MB of hidden states) two fresh allocations
    /// faulted in and freed every step, and zeroing one first a pass over it.
    pub fn download(&self, d: &DTensor) -> Result<Tensor, String> {
        self.bind()?;
        let data = match d.dtype {
            // A byte other than 0 or 1 is no bool; a big-endian host reorders bytes.
            DType::Bool => Data::from_le_bytes(d.dtype, &self.download_values::<u8>(d)?)?,
            _ if cfg!(target_endian = "big") => {
                Data::from_le_bytes(d.dtype, &self.download_values::<u8>(d)?)?
            }
            DType::F32 => Data::F32(self.download_values(d)?),
            DType::F16 => Data::F16(self.download_values(d)?),
            DType::BF16 => Data::BF16(self.download_values(d)?),
            DType::F64 => Data::F64(self.download_values(d)?),
            DType::I32 => Data::I32(self.download_values(d)?),
            DType::I64 => Data::I64(self.download_values(d)?),
            DType::F8E4M3 => Data::F8E4M3(self.download_values(d)?),
            DType::F8E5M2 => Data::F8E5M2(self.download_values(d)?),
        };
        Tensor::new(d.shape.clone(), data)
    }

    /// `d`'s bytes as values of `T`, a type of `d`'s size whose every bit pattern is a
    /// value (a numeric element type, or bytes), copied and waited for.
    fn download_values<T: Copy>(&self, d: &DTensor) -> Result<Vec<T>, String> {
        let size = std::mem::size_of::<T>();
        if d.bytes() % size != 0 || (size != 1 && size != d.dtype.size_bytes()) {
            return Err(format!("{} downloaded as values of {size} bytes", d.dtype));
        }
        let n = d.bytes() / size;
        let mut values = Vec::<T>::with_capacity(n);
        if n > 0 {
            Launches::count(&self.launches.memcpys);
            // SAFETY: the spare capacity holds `n` values, `d.bytes()` bytes; the host
            // side is read only after the stream synchronises below.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut values.spare_capacity_mut()[..n],
                    d.ptr(),
                    self.stream.cu_stream(),
                )
                .map_err(drv("download"))?;
            }
        }
        self.stream.synchronize().map_err(drv("synchronize"))?;
        // SAFETY: the copy wrote all `n` values, and any bytes are a value of `T`.
        unsafe { values.set_len(n) };
        Ok(values)
    }

    /// Copies `src` into `dst` (of the same size), on the stream.
    pub fn copy(&self, src: &DTensor, dst: &DTensor) -> Result<(), String> {
        if src.bytes() != dst.bytes() {
            return Err(format!(
                "copy of {} bytes into {}",
                src.bytes(),
                dst.bytes()
            ));
        }
        if src.bytes() == 0 {
            return Ok(());
        }
        Launches::count(&self.launches.memcpys);
        // SAFETY: both ranges lie inside their buffers; ordered on this stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.ptr(),
                src.ptr(),
                src.bytes(),
                self.stream.cu_stream(),
            )
        }
        .map_err(drv("copy"))
    }

    /// Sets every byte of `d` to zero.
    pub fn zero(&self, d: &DTensor) -> Result<(), String> {
        if d.bytes() == 0 {
            return Ok(());
        }
        Launches::count(&self.launches.memsets);
        // SAFETY: the range lies inside the buffer; ordered on this stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(d.ptr(), 0, d.bytes(), self.stream.cu_stream())
        }
        .map_err(drv("memset"))
    }

    /// The kernel `name` of the module `key` (built from `src()` on first use, for
    /// `target`).
    fn function(
        &self,
        (key, target): (&str, Target),
        src: impl FnOnce() -> String,
        name: &'static str,
    ) -> Result<Arc<CudaFunction>, String> {
        let cached = self
            .functions
            .lock()
            .map_err(|_| "poisoned")?
            .get(key)
            .and_then(|m| m.get(name))
            .cloned();
        if let Some(f) = cached {
            return Ok(f);
        }
        // The first use: the module built and loaded where it is new, then the kernel.
        loading(|| {
            let module = {
                let mut modules = self.modules.lock().map_err(|_| "poisoned")?;
                match modules.get(key) {
                    Some(m) => m.clone(),
                    None => {
                        let ptx = self.compile(key, target, src)?;
                        let m = self
                            .ctx
                            .load_module(ptx)
                            .map_err(|e| format!("loading kernel module '{key}': {e:?}"))?;
                        modules.insert(key.to_string(), m.clone());
                        m
                    }
                }
            };
            let f = Arc::new(
                module
                    .load_function(name)
                    .map_err(|e| format!("kernel '{name}' of '{key}': {e:?}"))?,
            );
            self.functions
                .lock()
                .map_err(|_| "poisoned")?
                .entry(key.to_string())
                .or_default()
                .insert(name, f.clone());
            Ok(f)
        })
    }

    fn compile(
        &self,
        key: &str,
        target: Target,
        src: impl FnOnce() -> String,
    ) -> Result<Ptx, String> {
        // Hopper's own instructions (wgmma) need its arch-specific target.
        let arch = match target {
            Target::ArchSpecific if self.sm == 90 => format!("{}a", self.arch),
            _ => self.arch.clone(),
        };
        let ckey = format!("{arch}/{key}");
        if let Some(p) = ptx_cache().lock().map_err(|_| "poisoned")?.get(&ckey) {
            return Ok(p.clone());
        }
        let src = src();
        let arch_option = format!("--gpu-architecture={arch}");
        // Everything the PTX depends on; the headers come with the NVRTC version.
        let disk_key = [nvrtc_version(), &arch_option, "--fmad=false", &src];
        if let Some(text) = self.disk_cache.load(&disk_key) {
            let ptx = Ptx::from_src(text);
            ptx_cache()
                .lock()
                .map_err(|_| "poisoned")?
                .insert(ckey, ptx.clone());
            return Ok(ptx);
        }
        let opts = CompileOptions {
            fmad: Some(false),
            include_paths: include_paths(),
            options: vec![arch_option.clone()],
            name: Some(format!("{}.cu", key.replace(['/', ' '], "_"))),
            ..Default::default()
        };
        let ptx = guard("NVRTC", || {
            compile_ptx_with_opts(&src, opts).map_err(|e| match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => format!(
                    "NVRTC could not compile kernel '{key}':\n{}",
                    log.to_string_lossy()
                ),
                other => format!("NVRTC could not compile kernel '{key}': {other:?}"),
            })
        })?;
        if ptx.as_bytes().is_some() {
            self.disk_cache.store(&disk_key, &ptx.to_src());
        }
        ptx_cache()
            .lock()
            .map_err(|_| "poisoned")?
            .insert(ckey, ptx.clone());
        Ok(ptx)
    }

    /// A timing event recorded on the stream now.
    pub fn timing_event(&self) -> Result<CudaEvent, String> {
        let event = self.event()?;
        self.record(&event)?;
        Ok(event)
    }

    /// An event for timing, not yet recorded.
    pub fn event(&self) -> Result<CudaEvent, String> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| format!("CUDA event: {e:?}"))
    }

    /// Records `event` on the stream (after the work put on it so far).
    pub fn record(&self, event: &CudaEvent) -> Result<(), String> {
        event
            .record(&self.stream)
            .map_err(|e| format!("CUDA event: {e:?}"))
    }

    /// How many blocks of `block` threads of kernel `name` of module `key` the GPU
    /// runs at once (its multiprocessors times the blocks one holds, given the
    /// kernel's registers and shared memory): a grid of that many is one full wave.
    pub fn resident_blocks(
        &self,
        (key, target): (&str, Target),
        src: impl FnOnce() -> String,
        name: &'static str,
        block: u32,
    ) -> Result<u32, String> {
        let id = (key.to_string(), name);
        if let Some(&n) = self.resident.lock().map_err(|_| "poisoned")?.get(&id) {
            return Ok(n);
        }
        let per_sm = self
            .function((key, target), src, name)?
            .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)
            .map_err(drv("occupancy query"))?;
        let n = per_sm.max(1) * self.multiprocessors;
        self.resident.lock().map_err(|_| "poisoned")?.insert(id, n);
        Ok(n)
    }

    /// Launches kernel `name` of module `key` over `grid` blocks of `block` threads.
    pub fn launch(
        &self,
        module: (&str, Target),
        src: impl FnOnce() -> String,
        name: &'static str,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<(), String> {
        let f = self.function(module, src, name)?;
        let mut b = self.stream.launch_builder(&f);
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
                Arg::Dims(d) => b.arg(d),
                Arg::Table(t) => b.arg(t.as_ref()),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.max(1), 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        Launches::count(&self.launches.kernels);
        // SAFETY: the argument list matches the generated kernel's signature, and every
        // pointer is a live buffer of the size the kernel indexes (checked by the caller).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| format!("launching kernel '{}': {e:?}", module.0))
    }
}

/// Enough blocks of 256 threads for `n` items, `per_thread` each (grid-stride loops
/// take the rest beyond the grid limit).
pub fn items_grid(n: usize, per_thread: usize) -> u32 {
    n.div_ceil(256 * per_thread).min(1 << 20) as u32
}

/// Threads per block for a row of `len` elements: a warp multiple up to 256.
pub fn row_block(len: usize) -> u32 {
    (len.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// Blocks for `rows` rows (grid-stride loops cover the rest).
pub fn row_grid(rows: usize) -> u32 {
    rows.clamp(1, 1 << 20) as u32
}
