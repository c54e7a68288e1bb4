//! One GPU's NCCL communicator in a data-parallel group, and the stream it reduces on.
//!
//! NCCL is loaded at run time (cudarc's `nccl` feature, `libnccl.so`). Each replica's
//! thread makes its own communicator from the group's unique id and runs its
//! collectives on a stream of its own, beside the step's compute stream, so that a
//! bucket's all-reduce overlaps the rest of the backward pass. A replica waits for its
//! step by polling rather than blocking in the driver: when another replica fails
//! (the group's [`Abort`]) or the wait passes the timeout, it aborts its communicator,
//! which ends its NCCL kernels, instead of hanging on a peer that will never come.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ampgraph_graph::ops::Reduction;
use ampgraph_graph::DType;
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result, sys};

use super::device::{guard, DTensor, Device};
use crate::collective::{Abort, Collective, NcclId};

/// Whether NCCL can be loaded, or why not.
pub fn available() -> Result<(), String> {
    // SAFETY: only tries to open the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err("the NCCL library (libnccl.so) was not found: put its folder on LD_LIBRARY_PATH (pip's nvidia-nccl wheels ship libnccl.so.2: link libnccl.so to it)".into())
    }
}

/// A fresh unique id for a group's communicators.
pub fn unique_id() -> Result<NcclId, String> {
    available()?;
    guard("NCCL", || {
        let id = result::get_uniqueid().map_err(|e| format!("NCCL unique id: {e:?}"))?;
        Ok(NcclId(id.internal))
    })
}

/// How long a replica spins for its step's end before it sleeps between looks.
const SPIN: Duration = Duration::from_secs(1);

/// A replica's communicator.
pub(crate) struct Nccl {
    comm: sys::ncclComm_t,
    /// The stream its collectives run on.
    pub stream: Arc<CudaStream>,
    pub rank: usize,
    pub world: usize,
    abort: Abort,
    timeout: Duration,
    /// Whether the communicator was aborted (it is then neither used nor destroyed).
    aborted: Mutex<bool>,
}

// SAFETY: a communicator may be used from any thread, one at a time; its executor
// owns it and runs one step at a time.
unsafe impl Send for Nccl {}
// SAFETY: every use through `&self` enqueues work (ncclAllReduce on its own stream)
// or aborts under the `aborted` lock; NCCL allows both from the owning thread.
unsafe impl Sync for Nccl {}

fn nccl_err(what: &str) -> impl FnOnce(result::NcclError) -> String + '_ {
    move |e| format!("NCCL {what}: {e:?}")
}

impl Nccl {
    /// Joins rank `c.rank` of the group on `dev` (blocks until every rank joins).
    pub fn new(dev: &Device, c: &Collective, id: NcclId) -> Result<Nccl, String> {
        available()?;
        guard("NCCL", || {
            dev.bind()?;
            let stream = dev
                .ctx
                .new_stream()
                .map_err(|e| format!("CUDA stream: {e:?}"))?;
            let mut comm = std::ptr::null_mut();
            let unique = sys::ncclUniqueId { internal: id.0 };
            // SAFETY: `comm` is written by NCCL; rank and world were checked by the group.
            unsafe { result::comm_init_rank(&mut comm, c.world as i32, unique, c.rank as i32) }
                .map_err(nccl_err("communicator"))?;
            Ok(Nccl {
                comm,
                stream,
                rank: c.rank,
                world: c.world,
                abort: c.abort.clone(),
                timeout: c.timeout,
                aborted: Mutex::new(false),
            })
        })
    }

    /// Enqueues `outputs[k] = mean (or max) over the replicas of inputs[k]` on the
    /// collective stream once the compute stream's work so far is done; returns the
    /// event the readers of `outputs` wait for.
    pub fn all_reduce(
        &self,
        dev: &Device,
        inputs: &[DTensor],
        outputs: &[DTensor],
        reduction: Reduction,
    ) -> Result<CudaEvent, String> {
        let op = match reduction {
            Reduction::Mean => sys::ncclRedOp_t::ncclAvg,
            Reduction::Max => sys::ncclRedOp_t::ncclMax,
        };
        // Each tensor's NCCL type first: the group below must end once begun.
        let types = inputs
            .iter()
            .map(|x| nccl_type(x.dtype))
            .collect::<Result<Vec<_>, _>>()?;
        self.stream
            .join(&dev.stream)
            .map_err(|e| format!("CUDA stream wait: {e:?}"))?;
        result::group_start().map_err(nccl_err("group start"))?;
        let mut enqueued = Ok(());
        for ((x, y), dtype) in inputs.iter().zip(outputs).zip(types) {
            let count: usize = x.shape.iter().product();
            // SAFETY: both buffers hold `count` elements of the dtype, on this device.
            let r = unsafe {
                result::all_reduce(
                    x.ptr() as *const _,
                    y.ptr() as *mut _,
                    count,
                    dtype,
                    op,
                    self.comm,
                    self.stream.cu_stream() as _,
                )
            };
            if let Err(e) = r {
                enqueued = Err(format!("NCCL all-reduce: {e:?}"));
                break;
            }
        }
        // The group ends whatever happened inside it.
        let ended = result::group_end().map_err(nccl_err("group end"));
        enqueued?;
        ended?;
        self.stream
            .record_event(None)
            .map_err(|e| format!("CUDA event: {e:?}"))
    }

    /// Waits for `event` (of `what`: the step's end, an all-reduce), polling: gives up
    /// when another replica failed or the timeout passes, and the caller then aborts the
    /// communicator ([`Nccl::abort_comm`]).
    pub fn wait(&self, event: &CudaEvent, what: &str) -> Result<(), String> {
        let start = Instant::now();
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(format!("CUDA: {e:?}")),
            }
            let waited = start.elapsed();
            if self.abort.reason().is_some() || waited >= self.timeout {
                return Err(self.abort.stopped(self.rank, what, waited));
            }
            // Spin (each replica has a core of its own, and the next step's launches
            // should follow its end at once, as a spinning cuStreamSynchronize does);
            // a wait past a second is no longer a step's end: sleep between looks.
            if waited < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Aborts the communicator: its pending collectives end, and it is not used again.
    /// NCCL's abort returns only once every CUDA graph holding the communicator's
    /// collectives is destroyed (the last communicator of a process waits for the
    /// others' too): the executor destroys its step graphs meanwhile.
    pub fn abort_comm(&self) {
        let mut aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if !*aborted {
            *aborted = true;
            // SAFETY: the communicator is live (not aborted before) and not used after.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }

    pub fn is_aborted(&self) -> bool {
        *self.aborted.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if !self.is_aborted() {
            // SAFETY: the communicator is live and dropped once.
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}

fn nccl_type(dtype: DType) -> Result<sys::ncclDataType_t, String> {
    Ok(match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        other => return Err(format!("NCCL averages float tensors, not {other}")),
    })
}
