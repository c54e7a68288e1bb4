//! The GPU's energy counter (NVML's `nvmlDeviceGetTotalEnergyConsumption`, in
//! millijoules), loaded at run time like the CUDA libraries: past its first 100 ms
//! or so a dense training loop runs at the GPU's power limit, where the joules a step
//! takes set its time, so the bench reports them beside the milliseconds.

use std::ffi::c_void;

type Init = unsafe extern "C" fn() -> i32;
type HandleByIndex = unsafe extern "C" fn(u32, *mut *mut c_void) -> i32;
type TotalEnergy = unsafe extern "C" fn(*mut c_void, *mut u64) -> i32;

pub struct EnergyCounter {
    // Keeps the library loaded while `total_energy` may be called.
    _lib: libloading::Library,
    total_energy: TotalEnergy,
    device: *mut c_void,
}

impl EnergyCounter {
    /// The counter of NVML's device `index` (NVML's order, which is CUDA's on a
    /// one-GPU machine); None without NVML or where the GPU has no such counter.
    pub fn open(index: u32) -> Option<Self> {
        // SAFETY: the symbols are NVML's, declared with their C signatures; the
        // library outlives the function pointer (both live in the struct).
        unsafe {
            let lib = libloading::Library::new("libnvidia-ml.so.1").ok()?;
            let init = *lib.get::<Init>(b"nvmlInit_v2").ok()?;
            let by_index = *lib
                .get::<HandleByIndex>(b"nvmlDeviceGetHandleByIndex_v2")
                .ok()?;
            let total_energy = *lib
                .get::<TotalEnergy>(b"nvmlDeviceGetTotalEnergyConsumption")
                .ok()?;
            let mut device = std::ptr::null_mut();
            if init() != 0 || by_index(index, &mut device) != 0 {
                return None;
            }
            let counter = Self {
                _lib: lib,
                total_energy,
                device,
            };
            counter.millijoules().map(|_| counter)
        }
    }

    /// Millijoules the GPU has used since the driver loaded.
    pub fn millijoules(&self) -> Option<u64> {
        let mut mj = 0;
        // SAFETY: `device` came from NVML for this library; `mj` is a valid out-pointer.
        (unsafe { (self.total_energy)(self.device, &mut mj) } == 0).then_some(mj)
    }
}
