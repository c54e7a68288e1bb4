//! Feeds copied to the device while the step before them computes (PyTorch's
//! `pin_memory=True` with `.to(device, non_blocking=True)`).
//!
//! Each fed name has two slots used in turn, each a page-locked host buffer and a
//! device buffer of the feed's size. Staging copies the host tensor into the slot's
//! pinned buffer and starts its copy to the device on a stream of its own, recording
//! `copied`; the step that takes it waits for `copied` on the compute stream (the
//! GPU waits, not the host), and records `consumed` after its kernels, which the
//! slot's next copy waits for. Pinned memory is what lets the copy run while kernels
//! do: from pageable memory the driver stages the copy through its own buffer first.

use std::collections::HashMap;
use std::sync::Arc;

use ampgraph_graph::ops::Placeholder;
use ampgraph_graph::{Graph, Tensor};
use cudarc::driver::{sys, CudaEvent, CudaStream, PinnedHostSlice};

use super::device::{drv, guard, DTensor, Device, Launches};
use super::kernels::Owner;
use crate::{ExecError, Feeds, Staged};

/// One feed's buffers for one step in two.
struct Slot {
    host: PinnedHostSlice<u8>,
    device: DTensor,
    /// Recorded on the copy stream after the copy into `device`.
    copied: CudaEvent,
    /// Recorded on the compute stream after the step that read `device`.
    consumed: CudaEvent,
}

#[derive(Default)]
pub(super) struct Staging {
    /// Made on first use: an executor that is never given staged feeds has none.
    copy: Option<Arc<CudaStream>>,
    slots: HashMap<String, [Option<Slot>; 2]>,
    /// The last ticket handed out; its parity picks the slots.
    ticket: u64,
    /// The ticket of the copies under way and which slot holds each feed.
    pending: Option<u64>,
    /// The device values of the step running now, by feed name.
    pub current: HashMap<String, DTensor>,
    /// Slots the running step reads, to mark consumed when it ends.
    in_use: Vec<(String, usize)>,
}

impl Staging {
    /// Starts copying `feeds` (each a Placeholder of `graph`) to the device.
    pub fn stage(
        &mut self,
        dev: &Device,
        graph: &Graph,
        feeds: Feeds,
    ) -> Result<Staged, ExecError> {
        for name in feeds.keys() {
            let placeholder = graph
                .find(name)
                .is_some_and(|id| graph.node(id).op.is::<Placeholder>());
            if !placeholder {
                return Err(ExecError::Feed {
                    name: name.clone(),
                    msg: "only Placeholders are staged ahead of a step".into(),
                });
            }
        }
        self.ticket += 1;
        let parity = (self.ticket % 2) as usize;
        let copy = match &self.copy {
            Some(s) => s.clone(),
            None => {
                let s = guard("CUDA", || dev.ctx.new_stream().map_err(drv("copy stream")))
                    .map_err(ExecError::Device)?;
                self.copy = Some(s.clone());
                s
            }
        };
        for (name, value) in &feeds {
            let feed_err = |msg: String| ExecError::Feed {
                name: name.clone(),
                msg,
            };
            let slot = &mut self.slots.entry(name.clone()).or_default()[parity];
            let bytes = value.data().len() * value.dtype().size_bytes();
            let fits =
                |s: &Slot| s.device.dtype == value.dtype() && s.device.shape == value.shape();
            let slot = match slot.take().filter(fits) {
                Some(kept) => slot.insert(kept),
                None => {
                    slot.insert(guard("CUDA", || new_slot(dev, name, value)).map_err(feed_err)?)
                }
            };
            guard("CUDA", || {
                // The device buffer's last reader, then the host buffer's last copy.
                copy.wait(&slot.consumed).map_err(drv("stream wait"))?;
                slot.copied.synchronize().map_err(drv("event"))?;
                let host = &mut slot.host.as_mut_slice().map_err(drv("pinned buffer"))?[..bytes];
                host.copy_from_slice(&value.data().le_bytes());
                if bytes > 0 {
                    Launches::count(&dev.launches.memcpys);
                    // SAFETY: both buffers hold `bytes`; the pinned source is not
                    // written again before `copied` completes (waited for above).
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            slot.device.ptr(),
                            host,
                            copy.cu_stream(),
                        )
                    }
                    .map_err(drv("staged copy"))?;
                }
                slot.copied.record(&copy).map_err(drv("event"))
            })
            .map_err(feed_err)?;
        }
        self.pending = Some(self.ticket);
        Ok(Staged::on_device(feeds, self.ticket))
    }

    /// Makes `staged`'s device values the current step's, the compute stream waiting
    /// for their copies; feeds staged by another call (or not at all) are uploaded by
    /// the step as usual.
    pub fn begin(&mut self, dev: &Device, staged: &Staged) -> Result<(), ExecError> {
        self.current.clear();
        self.in_use.clear();
        if staged.ticket() == 0 || self.pending != Some(staged.ticket()) {
            return Ok(());
        }
        self.pending = None;
        let parity = (staged.ticket() % 2) as usize;
        for name in staged.feeds().keys() {
            let Some(slot) = self.slots.get(name).and_then(|s| s[parity].as_ref()) else {
                continue;
            };
            guard("CUDA", || {
                dev.stream.wait(&slot.copied).map_err(drv("stream wait"))
            })
            .map_err(ExecError::Device)?;
            self.current.insert(name.clone(), slot.device.clone());
            self.in_use.push((name.clone(), parity));
        }
        Ok(())
    }

    /// Marks the current step's slots read once its kernels are on the stream.
    pub fn end(&mut self, dev: &Device) -> Result<(), ExecError> {
        self.current.clear();
        for (name, parity) in self.in_use.drain(..) {
            if let Some(slot) = self.slots.get(&name).and_then(|s| s[parity].as_ref()) {
                guard("CUDA", || {
                    slot.consumed.record(&dev.stream).map_err(drv("event"))
                })
                .map_err(ExecError::Device)?;
            }
        }
        Ok(())
    }
}

/// Buffers for `value`: page-locked host memory and a device buffer, ready for a
/// copy (the device buffer's allocation is ordered on the compute stream, which the
/// copy stream does not follow: it is waited for here, once per slot).
fn new_slot(dev: &Device, name: &str, value: &Tensor) -> Result<Slot, String> {
    let bytes = value.data().len() * value.dtype().size_bytes();
    // SAFETY: u8 has no invalid values; the buffer is written before it is copied.
    // Write-combined (cudarc's default): the host only writes it, in order, and the
    // device reads it faster over PCIe.
    let host = unsafe { dev.ctx.alloc_pinned::<u8>(bytes.max(1)) }
        .map_err(drv("page-locked allocation"))?;
    let device = dev.alloc(value.dtype(), value.shape(), &Owner("staged feed", name))?;
    let event = || {
        dev.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(drv("event"))
    };
    let (copied, consumed) = (event()?, event()?);
    // Recorded once so that the first waits on them pass.
    copied.record(&dev.stream).map_err(drv("event"))?;
    consumed.record(&dev.stream).map_err(drv("event"))?;
    dev.stream.synchronize().map_err(drv("synchronize"))?;
    Ok(Slot {
        host,
        device,
        copied,
        consumed,
    })
}
