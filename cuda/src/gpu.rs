//! One GPU as the data path uses it: its primary context (the one torch uses too), a
//! non-blocking stream of ramjet's own, events as [`Fence`]s, host-to-device copies from the
//! pinned pool, and the fused kernel loaded from NVRTC's PTX.
//!
//! **Never run on a GPU yet**: the machines these were written on have none. Every call here
//! is checked by the compiler against cudarc's driver bindings, and the tests behind
//! `RAMJET_GPU_TESTS=1` (`bindings/tests/test_gpu.py`) exercise it where a GPU is lent.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::dlpack::StreamOps;
use crate::kernel::{Job, Params, KERNEL_NAME, KERNEL_SRC};
use crate::nvrtc::{Nvrtc, NvrtcError};
use crate::pool::{CudaDevice, CudaHost, Fence, Pool, PoolBuf};
use crate::{driver_err as err, GpuError};

/// A driver stream handle that may cross threads.
#[derive(Clone, Copy)]
struct Stream(sys::CUstream);

// SAFETY: a CUstream is an opaque handle the driver lets any thread use with its context.
unsafe impl Send for Stream {}
// SAFETY: as above; the handle itself is never mutated.
unsafe impl Sync for Stream {}

/// GPU `ordinal`'s primary context (the one torch uses), or why it cannot be had. The calling
/// thread's current context is left as it was (every call made with it here borrows it:
/// [`crate::current`]). Checks for the driver first, so cudarc never panics.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, GpuError> {
    let n = crate::device_count()?;
    if ordinal >= n {
        return Err(GpuError::Driver {
            doing: "opening the GPU",
            reason: format!("GPU {ordinal} asked for; the driver sees {n}"),
        });
    }
    crate::current::retain_primary(ordinal)
}

/// One GPU: its primary context and ramjet's stream on it.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Stream,
}

impl Gpu {
    /// GPU `ordinal`, or why it cannot be used (no driver, no such device, a driver error).
    /// Checks for the driver first, so cudarc never panics.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        let ctx = context(ordinal)?;
        let _current = crate::current::enter(&ctx)?;
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(err("creating a stream"))?;
        Ok(Gpu {
            ctx,
            stream: Stream(stream),
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The context (shared with torch: the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// ramjet's stream, as an integer handle.
    pub fn stream_handle(&self) -> u64 {
        self.stream.0 as u64
    }

    /// A pool of pinned host memory of at most `limit` bytes.
    pub fn pinned_pool(&self, limit: usize) -> Pool<CudaHost> {
        Pool::new(CudaHost::new(self.ctx.clone()), limit)
    }

    /// A pool of this GPU's memory of at most `limit` bytes.
    pub fn device_pool(&self, limit: usize) -> Pool<CudaDevice> {
        Pool::new(CudaDevice::new(self.ctx.clone()), limit)
    }

    /// An event recorded on ramjet's stream now: it completes when the work queued so far does.
    pub fn record(&self) -> Result<Event, GpuError> {
        Event::record(&self.ctx, self.stream.0 as u64)
    }

    /// Queues a copy of `src`'s first `bytes` bytes to device address `dst` on ramjet's stream.
    /// `src` must stay untouched until an event recorded afterwards completes (give it back
    /// with [`PoolBuf::release_after`]).
    pub fn copy_to_device(
        &self,
        src: &PoolBuf<CudaHost>,
        dst: &PoolBuf<CudaDevice>,
        bytes: usize,
    ) -> Result<(), GpuError> {
        if bytes > src.len() || bytes > dst.len() {
            return Err(GpuError::Driver {
                doing: "copying to the GPU",
                reason: format!("{bytes} B asked; source {} B, destination {} B", src.len(), dst.len()),
            });
        }
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: both buffers hold at least `bytes` bytes (checked above); the source is
        // pinned, so the copy is asynchronous, and the caller keeps it alive until a later
        // event completes.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.addr(), src.addr() as *const c_void, bytes, self.stream.0).result() }
            .map_err(err("queueing a host-to-device copy"))
    }

    /// The stream operations of one exported buffer: consumers wait for `ready`.
    pub fn stream_ops(&self, ready: Event) -> CudaStreamOps {
        CudaStreamOps {
            ctx: self.ctx.clone(),
            ready,
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if let Ok(_current) = crate::current::enter(&self.ctx) {
            // SAFETY: the stream was created in `open` and is destroyed once; pending work
            // still completes (the driver defers the release).
            let _ = unsafe { result::stream::destroy(self.stream.0) };
        }
    }
}

/// A CUDA event (timing disabled), used as a [`Fence`].
pub struct Event {
    ctx: Arc<CudaContext>,
    ev: sys::CUevent,
}

// SAFETY: a CUevent is an opaque handle the driver lets any thread use with its context.
unsafe impl Send for Event {}

impl Event {
    /// Records a new event on `stream` (a handle; 1 and 2 are the legacy and per-thread
    /// default streams).
    pub fn record(ctx: &Arc<CudaContext>, stream: u64) -> Result<Event, GpuError> {
        let _current = crate::current::enter(ctx)?;
        let ev =
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(err("creating an event"))?;
        let e = Event { ctx: ctx.clone(), ev };
        // SAFETY: a live event, and a stream handle the caller vouches for.
        unsafe { result::event::record(e.ev, stream as sys::CUstream) }.map_err(err("recording an event"))?;
        Ok(e)
    }

    /// Makes `stream` wait for this event (asynchronously).
    pub fn make_wait(&self, stream: u64) -> Result<(), GpuError> {
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: a live event, and a stream handle the caller vouches for.
        unsafe {
            result::stream::wait_event(
                stream as sys::CUstream,
                self.ev,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(err("making a stream wait for an event"))
    }
}

impl Fence for Event {
    fn is_complete(&self) -> Result<bool, GpuError> {
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: a live event.
        match unsafe { result::event::query(self.ev) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(err("querying an event")(e)),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_current) = crate::current::enter(&self.ctx) {
            // SAFETY: created in `record`, destroyed once; the driver defers the release if
            // it has not completed.
            let _ = unsafe { result::event::destroy(self.ev) };
        }
    }
}

/// [`StreamOps`] of one exported buffer on a real GPU.
pub struct CudaStreamOps {
    ctx: Arc<CudaContext>,
    ready: Event,
}

// SAFETY: `Event` is Send and its handle is only used through driver calls, which are
// thread-safe; `CudaContext` is Send + Sync.
unsafe impl Sync for CudaStreamOps {}

impl StreamOps for CudaStreamOps {
    fn wait_ready(&self, consumer: u64) -> Result<(), GpuError> {
        self.ready.make_wait(consumer)
    }

    fn record_release(&self, consumer: Option<u64>) -> Result<Box<dyn Fence>, GpuError> {
        // No consumer stream: the legacy default stream orders after every blocking stream.
        Ok(Box::new(Event::record(&self.ctx, consumer.unwrap_or(1))?))
    }
}

/// The fused kernel, compiled by NVRTC and loaded on one GPU.
pub struct FusedKernel {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    func: sys::CUfunction,
}

// SAFETY: module and function handles are opaque and usable from any thread with their context.
unsafe impl Send for FusedKernel {}

/// Why the kernel could not be had or run.
#[derive(Debug)]
pub enum KernelError {
    /// Compiling failed.
    Nvrtc(NvrtcError),
    /// The driver refused.
    Gpu(GpuError),
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelError::Nvrtc(e) => write!(f, "{e}"),
            KernelError::Gpu(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for KernelError {}

impl FusedKernel {
    /// Compiles [`KERNEL_SRC`] to a cubin for `gpu`'s own compute capability (cached on disk,
    /// [`crate::nvrtc::cache_dir`]), or to PTX where the driver can load NVRTC's PTX
    /// ([`crate::nvrtc::targets`]), and loads it on `gpu`.
    pub fn load(gpu: &Gpu, nvrtc: &Nvrtc) -> Result<FusedKernel, KernelError> {
        let g = |doing| move |e| KernelError::Gpu(err(doing)(e));
        let cc = gpu
            .ctx
            .compute_capability()
            .map_err(g("reading the compute capability"))?;
        let mut driver = 0;
        // SAFETY: one valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut driver).result() }.map_err(g("reading the driver's version"))?;
        let cache = crate::nvrtc::cache_dir();
        let (image, _target) =
            crate::nvrtc::compile_for_device(nvrtc, KERNEL_SRC, "ramjet_fused.cu", cc, driver, cache.as_deref())
                .map_err(KernelError::Nvrtc)?;
        let _current = crate::current::enter(&gpu.ctx).map_err(KernelError::Gpu)?;
        // SAFETY: `image` is an ELF cubin or NUL-terminated PTX, both of which
        // cuModuleLoadData accepts, and it lives across the call.
        let module = unsafe { result::module::load_data(image.image()) }.map_err(g("loading the kernel"))?;
        let name = CString::new(KERNEL_NAME).expect("no NUL");
        // SAFETY: a module loaded above.
        let func = unsafe { result::module::get_function(module, name) }.map_err(g("finding the kernel"))?;
        Ok(FusedKernel {
            ctx: gpu.ctx.clone(),
            module,
            func,
        })
    }

    /// Queues the kernel on `gpu`'s stream: `jobs.len()` images from `src` (HWC uint8, offsets
    /// in the jobs) into `out` (`[n, 3, oh, ow]` of `p.out`). `jobs` is device memory holding
    /// the same jobs (the caller copied them); `host_jobs` is checked against `src`'s size
    /// here, so the kernel never reads outside it.
    pub fn launch(
        &self,
        gpu: &Gpu,
        src: &PoolBuf<CudaDevice>,
        host_jobs: &[Job],
        jobs: &PoolBuf<CudaDevice>,
        out: &PoolBuf<CudaDevice>,
        p: &Params,
    ) -> Result<(), GpuError> {
        let bad = |reason: String| GpuError::Driver {
            doing: "checking the kernel's arguments",
            reason,
        };
        for (i, j) in host_jobs.iter().enumerate() {
            let end = j.src as u128 + j.stride.max(0) as u128 * j.h.max(0) as u128;
            if j.w < 1 || j.h < 1 || (j.stride as i64) < 3 * j.w as i64 || end > src.len() as u128 {
                return Err(bad(format!("image {i} reaches outside the source buffer: {j:?}")));
            }
        }
        if p.ow < 1 || p.oh < 1 {
            return Err(bad(format!("output size {}x{}", p.ow, p.oh)));
        }
        if out.len() < host_jobs.len() * p.image_bytes() || jobs.len() < std::mem::size_of_val(host_jobs) {
            return Err(bad("an output or job buffer is too small".into()));
        }
        if host_jobs.is_empty() {
            return Ok(());
        }
        let _current = crate::current::enter(&self.ctx)?;
        let (mut s, mut jb, mut o) = (src.addr(), jobs.addr(), out.addr());
        let (mut ow, mut oh, mut ty) = (p.ow, p.oh, p.out as i32);
        let [mut a0, mut a1, mut a2] = p.a;
        let [mut k0, mut k1, mut k2] = p.k;
        let mut args: [*mut c_void; 12] = [
            (&mut s as *mut u64).cast(),
            (&mut jb as *mut u64).cast(),
            (&mut o as *mut u64).cast(),
            (&mut ow as *mut i32).cast(),
            (&mut oh as *mut i32).cast(),
            (&mut ty as *mut i32).cast(),
            (&mut a0 as *mut f32).cast(),
            (&mut a1 as *mut f32).cast(),
            (&mut a2 as *mut f32).cast(),
            (&mut k0 as *mut f32).cast(),
            (&mut k1 as *mut f32).cast(),
            (&mut k2 as *mut f32).cast(),
        ];
        let pixels = (p.ow as u32) * (p.oh as u32);
        let grid = (pixels.div_ceil(256), host_jobs.len() as u32, 1);
        // SAFETY: the arguments match the kernel's signature in order and type (three device
        // pointers, three ints, six floats), every buffer was checked to be large enough, and
        // they outlive the launch call, which copies the argument values.
        unsafe { result::launch_kernel(self.func, grid, (256, 1, 1), 0, gpu.stream.0, &mut args) }
            .map_err(err("launching the fused kernel"))
    }
}

impl Drop for FusedKernel {
    fn drop(&mut self) {
        if let Ok(_current) = crate::current::enter(&self.ctx) {
            // SAFETY: loaded in `load`, unloaded once.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{reference, OutType};

    /// Pinned pool, async copy, events, and the kernel against its CPU reference, bit for bit,
    /// in every output type. Needs a GPU, NVRTC and `RAMJET_GPU_TESTS=1`; shown as ignored
    /// elsewhere.
    #[test]
    #[ignore = "needs a GPU: RAMJET_GPU_TESTS=1 cargo test -p ramjet-cuda -- --ignored"]
    fn the_kernel_on_the_gpu_is_its_reference_bit_for_bit() {
        assert_eq!(
            std::env::var("RAMJET_GPU_TESTS").as_deref(),
            Ok("1"),
            "set RAMJET_GPU_TESTS=1"
        );
        let gpu = Gpu::open(0).unwrap_or_else(|e| panic!("{e}"));
        let roots = std::env::var_os("RAMJET_VENV")
            .map(|v| crate::libs::site_packages(std::path::Path::new(&v)))
            .unwrap_or_default();
        let nvrtc = Nvrtc::find(&crate::libs::Search::from_env(&roots)).unwrap_or_else(|e| panic!("{e}"));
        let kernel = FusedKernel::load(&gpu, &nvrtc).unwrap_or_else(|e| panic!("{e}"));
        // Two images of different sizes in one source buffer.
        let sizes = [(301i32, 217i32), (64, 80)];
        let mut src = Vec::new();
        let mut jobs = Vec::new();
        let mut s = 0x9e3779b97f4a7c15u64;
        for (i, &(w, h)) in sizes.iter().enumerate() {
            jobs.push(Job {
                src: src.len() as u64,
                w,
                h,
                stride: 3 * w,
                flip: i as i32,
                cx: 10.5,
                cy: 7.25,
                cw: w as f32 * 0.7,
                ch: h as f32 * 0.6,
            });
            for _ in 0..w * h * 3 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                src.push((s >> 56) as u8);
            }
        }
        let pinned = gpu.pinned_pool(64 << 20);
        let device = gpu.device_pool(64 << 20);
        for out in [OutType::U8, OutType::F16, OutType::BF16, OutType::F32] {
            let p = Params::normalized(96, 80, out, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
            let mut want = vec![0u8; jobs.len() * p.image_bytes()];
            reference(&src, &jobs, &p, &mut want);
            let job_bytes: Vec<u8> = jobs
                .iter()
                .flat_map(|j| {
                    // SAFETY: `Job` is repr(C) plain data with no padding (40 bytes, checked).
                    unsafe { std::slice::from_raw_parts((j as *const Job).cast::<u8>(), std::mem::size_of::<Job>()) }
                        .to_vec()
                })
                .collect();
            let mut hs = pinned.get(src.len()).unwrap();
            hs.host_slice_mut().unwrap().copy_from_slice(&src);
            let mut hj = pinned.get(job_bytes.len()).unwrap();
            hj.host_slice_mut().unwrap().copy_from_slice(&job_bytes);
            let (ds, dj, dout) = (
                device.get(src.len()).unwrap(),
                device.get(job_bytes.len()).unwrap(),
                device.get(want.len()).unwrap(),
            );
            gpu.copy_to_device(&hs, &ds, src.len()).unwrap();
            gpu.copy_to_device(&hj, &dj, job_bytes.len()).unwrap();
            kernel.launch(&gpu, &ds, &jobs, &dj, &dout, &p).unwrap();
            let done = gpu.record().unwrap();
            let mut got = vec![0u8; want.len()];
            while !done.is_complete().unwrap() {
                std::thread::yield_now();
            }
            // SAFETY: `dout` holds `got.len()` bytes and the kernel that wrote it completed.
            unsafe { sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), dout.addr(), got.len()).result() }.unwrap();
            hs.release_after(Box::new(gpu.record().unwrap()));
            hj.release_after(Box::new(gpu.record().unwrap()));
            assert!(got == want, "{out:?}: the GPU's output differs from the reference");
        }
        let st = pinned.stats();
        assert_eq!(st.in_use, 0, "{st:?}");
    }
}
