//! A device of host memory for the stage's tests (here, and other crates' with the `fake`
//! feature): "device memory" is host memory ([`Heap`]), copies are `memcpy`, the kernel is its
//! CPU reference, and every event completes at once, one millisecond after the one before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::Device;
use crate::kernel::{reference, Job as KernelJob, Params};
use crate::nvjpeg::decoder::fake::Heap;
use crate::pool::Fence;
use crate::GpuError;

/// Completes at once; `t` is the fake clock's reading when it was recorded.
pub struct Ev(f64);

impl Fence for Ev {
    fn is_complete(&self) -> Result<bool, GpuError> {
        Ok(true)
    }
}

/// Host memory as device memory; every event one millisecond after the one before.
#[derive(Default)]
pub struct Host {
    clock: AtomicU64,
    /// Every copy: (device address, bytes).
    pub uploads: Mutex<Vec<(u64, usize)>>,
    /// Kernel launches.
    pub launches: AtomicU64,
}

impl Device for Host {
    type Mem = Heap;
    type Event = Ev;
    fn stream(&self) -> u64 {
        7
    }
    unsafe fn upload(&self, dst: u64, src: *const u8, bytes: usize) -> Result<(), GpuError> {
        self.uploads.lock().unwrap().push((dst, bytes));
        // SAFETY: the stage's contract: `src` and `dst` hold `bytes` bytes (host memory here).
        unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, bytes) };
        Ok(())
    }
    unsafe fn upload_now(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        // SAFETY: as above.
        unsafe { self.upload(dst, src.as_ptr(), src.len()) }
    }
    fn launch(&self, src: (u64, usize), jobs: &[KernelJob], out: (u64, usize), p: &Params) -> Result<(), GpuError> {
        self.launches.fetch_add(1, Ordering::Relaxed);
        crate::kernel::plan(jobs, p, Some(src.1))?;
        // SAFETY: the stage's pool buffers of these sizes, host memory here.
        let (s, o) = unsafe {
            (
                std::slice::from_raw_parts(src.0 as *const u8, src.1),
                std::slice::from_raw_parts_mut(out.0 as *mut u8, out.1),
            )
        };
        reference(s, jobs, p, o);
        Ok(())
    }
    fn record(&self) -> Result<Ev, GpuError> {
        Ok(Ev(self.clock.fetch_add(1, Ordering::Relaxed) as f64 * 1e-3))
    }
    fn seconds(&self, from: &Ev, to: &Ev) -> Result<f64, GpuError> {
        Ok(to.0 - from.0)
    }
}
