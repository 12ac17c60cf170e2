//! One GPU as the data path uses it: its primary context (the one torch uses too), a
//! non-blocking stream of ramjet's own, events as [`Fence`]s, host-to-device copies from the
//! pinned pool, and the fused kernel compiled by NVRTC to a cubin for the device (PTX where the
//! driver can load NVRTC's PTX) and loaded.
//!
//! **Never run on a GPU yet**: the machines these were written on have none. Every call here
//! is checked by the compiler against cudarc's driver bindings, and the tests behind
//! `RAMJET_GPU_TESTS=1` (`bindings/tests/test_gpu.py`) exercise it where a GPU is lent.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::dlpack::StreamOps;
use crate::kernel::{Job, Params, BLOCK, KERNEL_NAME, KERNEL_SRC, WEIGHTS_NAME};
use crate::nvrtc::Nvrtc;
use crate::pipeline::GpuPipeline;
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

/// One GPU: its primary context and ramjet's two streams on it, one for work (kernels) and one
/// for host-to-device copies ([`crate::pipeline`] joins them with events).
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Stream,
    copy: Stream,
}

impl Gpu {
    /// GPU `ordinal`, or why it cannot be used (no driver, no such device, a driver error).
    /// Checks for the driver first, so cudarc never panics.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        let ctx = context(ordinal)?;
        let _current = crate::current::enter(&ctx)?;
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(err("creating a stream"))?;
        let copy = match result::stream::create(result::stream::StreamKind::NonBlocking) {
            Ok(c) => c,
            Err(e) => {
                // SAFETY: created above, destroyed once, nothing queued on it.
                let _ = unsafe { result::stream::destroy(stream) };
                return Err(err("creating a stream")(e));
            }
        };
        Ok(Gpu {
            ctx,
            stream: Stream(stream),
            copy: Stream(copy),
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

    /// The copy stream, as an integer handle.
    pub fn copy_stream_handle(&self) -> u64 {
        self.copy.0 as u64
    }

    /// A copy/compute pipeline on this GPU's two streams over `slots` (device staging
    /// buffers; two for double buffering).
    pub fn pipeline(&self, slots: Vec<PoolBuf<CudaDevice>>) -> Result<GpuPipeline, GpuError> {
        GpuPipeline::new(self.ctx.clone(), self.copy.0 as u64, self.stream.0 as u64, slots)
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

    /// Waits for ramjet's stream, then copies `out.len()` bytes from device buffer `src`,
    /// starting `offset` bytes in, into `out` (tests and the device check read results back
    /// with it; the data path never copies to the host).
    pub fn copy_to_host(&self, src: &PoolBuf<CudaDevice>, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        if offset.checked_add(out.len()).is_none_or(|end| end > src.len()) {
            return Err(GpuError::Invalid {
                what: "copy to the host",
                reason: format!("{} B at offset {offset} of a {} B buffer", out.len(), src.len()),
            });
        }
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: a live stream of this context.
        unsafe { sys::cuStreamSynchronize(self.stream.0).result() }.map_err(err("waiting for the stream"))?;
        // SAFETY: `src` holds `offset + out.len()` bytes (checked above); `out` is writable for
        // its length; the copy is synchronous.
        unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src.addr() + offset as u64, out.len()).result() }
            .map_err(err("copying to the host"))
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
            for s in [self.stream.0, self.copy.0] {
                // SAFETY: the streams were created in `open` and are destroyed once; pending
                // work still completes (the driver defers the release).
                let _ = unsafe { result::stream::destroy(s) };
            }
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

    /// Records a new event with timing on `stream` ([`Event::seconds_since`] reads it).
    pub fn record_timed(ctx: &Arc<CudaContext>, stream: u64) -> Result<Event, GpuError> {
        let _current = crate::current::enter(ctx)?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(err("creating an event"))?;
        let e = Event { ctx: ctx.clone(), ev };
        // SAFETY: a live event, and a stream handle the caller vouches for.
        unsafe { result::event::record(e.ev, stream as sys::CUstream) }.map_err(err("recording an event"))?;
        Ok(e)
    }

    /// Seconds from `earlier` to this event, both recorded with timing and completed.
    pub fn seconds_since(&self, earlier: &Event) -> Result<f64, GpuError> {
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: two live events of this context.
        let ms = unsafe { result::event::elapsed(earlier.ev, self.ev) }.map_err(err("timing two events"))?;
        Ok(ms as f64 / 1e3)
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

/// Queues a copy of `bytes` bytes from host address `src` to device address `dst` on `stream`.
///
/// # Safety
/// `src` is pinned host memory of `bytes` bytes, untouched until an event recorded on `stream`
/// afterwards completes; `dst` is device memory of `ctx` of as many bytes.
pub unsafe fn copy_async(
    ctx: &Arc<CudaContext>,
    dst: u64,
    src: *const u8,
    bytes: usize,
    stream: u64,
) -> Result<(), GpuError> {
    let _current = crate::current::enter(ctx)?;
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream as sys::CUstream).result() }
        .map_err(err("queueing a host-to-device copy"))
}

/// Copies `src` (any host memory) to device address `dst`, returning when it is done.
///
/// # Safety
/// `dst` is device memory of `ctx` of `src.len()` bytes.
pub unsafe fn copy_sync(ctx: &Arc<CudaContext>, dst: u64, src: &[u8]) -> Result<(), GpuError> {
    let _current = crate::current::enter(ctx)?;
    // SAFETY: the caller's contract; a synchronous copy from a live slice.
    unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()).result() }
        .map_err(err("copying to the GPU"))
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

/// A span of device memory the fused kernel reads or writes: a pool buffer ([`DevSpan::of`])
/// or memory another library allocated (a torch tensor's storage, [`DevSpan::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevSpan {
    addr: u64,
    len: usize,
}

impl DevSpan {
    /// The span `addr .. addr + len`.
    ///
    /// # Safety
    /// It is device memory of the context the kernel runs in (or memory the device can address),
    /// and stays allocated until the work queued on it completes.
    pub unsafe fn new(addr: u64, len: usize) -> DevSpan {
        DevSpan { addr, len }
    }

    /// A pool buffer's bytes (the caller keeps the buffer until the work completes, as
    /// [`PoolBuf::release_after`] does).
    pub fn of(buf: &PoolBuf<CudaDevice>) -> DevSpan {
        DevSpan {
            addr: buf.addr(),
            len: buf.len(),
        }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The fused kernel ([`crate::kernel`]), compiled by NVRTC and loaded on one GPU, with the
/// scratch memory its launches use: the batch's jobs and weight table, uploaded and computed
/// on the launch's stream, and given back once that stream passes the kernel.
pub struct FusedKernel {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    augment: sys::CUfunction,
    weights: sys::CUfunction,
    host: Pool<CudaHost>,
    dev: Pool<CudaDevice>,
}

// SAFETY: module and function handles are opaque and usable from any thread with their context;
// the pools are Send.
unsafe impl Send for FusedKernel {}
// SAFETY: `&self` methods only pass the handles to driver calls (thread-safe with their
// context) and take scratch from the pools, which lock.
unsafe impl Sync for FusedKernel {}

/// Scratch a launch may hold (jobs and weight table), pinned and on the device alike: a batch
/// of 256 images at 224x224 takes about 5 MiB, so dozens of launches can be in flight.
const SCRATCH_LIMIT: usize = 256 << 20;

impl FusedKernel {
    /// Compiles [`KERNEL_SRC`] to a cubin for `gpu`'s own compute capability (cached on disk,
    /// [`crate::nvrtc::cache_dir`]), or to PTX where the driver can load NVRTC's PTX
    /// ([`crate::nvrtc::targets`]), and loads it on `gpu`.
    pub fn load(gpu: &Gpu, nvrtc: &Nvrtc) -> Result<FusedKernel, GpuError> {
        let g = |doing| move |e| err(doing)(e);
        let cc = gpu
            .ctx
            .compute_capability()
            .map_err(g("reading the compute capability"))?;
        let mut driver = 0;
        // SAFETY: one valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut driver).result() }.map_err(g("reading the driver's version"))?;
        let cache = crate::nvrtc::cache_dir();
        let (image, _target) =
            crate::nvrtc::compile_for_device(nvrtc, KERNEL_SRC, "ramjet_fused.cu", cc, driver, cache.as_deref())?;
        let _current = crate::current::enter(&gpu.ctx)?;
        // SAFETY: `image` is an ELF cubin or NUL-terminated PTX, both of which
        // cuModuleLoadData accepts, and it lives across the call.
        let module = unsafe { result::module::load_data(image.image()) }.map_err(g("loading the kernel"))?;
        let func = |name: &str| {
            let name = CString::new(name).expect("no NUL");
            // SAFETY: a module loaded above.
            unsafe { result::module::get_function(module, name) }.map_err(g("finding the kernel"))
        };
        let (augment, weights) = match (func(KERNEL_NAME), func(WEIGHTS_NAME)) {
            (Ok(a), Ok(w)) => (a, w),
            (Err(e), _) | (_, Err(e)) => {
                // SAFETY: loaded above, unloaded once, nothing from it in use.
                let _ = unsafe { result::module::unload(module) };
                return Err(e);
            }
        };
        Ok(FusedKernel {
            ctx: gpu.ctx.clone(),
            module,
            augment,
            weights,
            host: gpu.pinned_pool(SCRATCH_LIMIT),
            dev: gpu.device_pool(SCRATCH_LIMIT),
        })
    }

    /// Queues the kernel on `gpu`'s stream: `jobs.len()` images from `src` (HWC uint8, byte
    /// offsets in the jobs) into `out` (`[n, 3, oh, ow]` of `p.out`). Every job is checked
    /// against `src` ([`crate::kernel::plan`]) and `out`'s size here, so the kernel never
    /// reads or writes outside them.
    pub fn launch(&self, gpu: &Gpu, src: DevSpan, jobs: &[Job], out: DevSpan, p: &Params) -> Result<(), GpuError> {
        self.launch_on(gpu.stream.0 as u64, src, jobs, out, p)
    }

    /// [`FusedKernel::launch`] on any stream of the kernel's context (a handle: torch's
    /// `torch.cuda.current_stream().cuda_stream`, 0 for the legacy default stream). `src` and
    /// `out` must stay allocated until the stream passes the kernel.
    pub fn launch_on(&self, stream: u64, src: DevSpan, jobs: &[Job], out: DevSpan, p: &Params) -> Result<(), GpuError> {
        let bad = |reason: String| GpuError::Driver {
            doing: "checking the kernel's arguments",
            reason,
        };
        let plan = crate::kernel::plan(jobs, p, Some(src.len))?;
        check_output(out, jobs.len(), p)?;
        if jobs.is_empty() {
            return Ok(());
        }
        let job_bytes = plan.job_bytes();
        let table_at = job_bytes.len().div_ceil(256) * 256;
        let scratch = table_at + plan.table_floats * 4;
        let stream_h = stream as sys::CUstream;
        let _current = crate::current::enter(&self.ctx)?;
        let get_both = || -> Result<_, GpuError> { Ok((self.host.get(job_bytes.len())?, self.dev.get(scratch)?)) };
        let (mut host, dev) = match get_both() {
            Ok(b) => b,
            Err(_) => {
                // Every earlier launch's scratch is still in flight: wait for the stream, once.
                // SAFETY: a stream handle the caller vouches for, in the current context.
                unsafe { sys::cuStreamSynchronize(stream_h).result() }.map_err(err("waiting for the stream"))?;
                get_both().map_err(|e| bad(format!("scratch for {} images: {e}", jobs.len())))?
            }
        };
        host.host_slice_mut().expect("pinned").copy_from_slice(&job_bytes);
        let queue = || -> Result<(), GpuError> {
            // SAFETY: `dev` holds `scratch` >= `job_bytes.len()` bytes, `host` is pinned and holds
            // them, and both are parked until an event recorded after the kernels completes (or
            // never reused, where no event can be recorded).
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(dev.addr(), host.addr() as *const c_void, job_bytes.len(), stream_h).result()
            }
            .map_err(err("queueing the jobs' upload"))?;
            let n = jobs.len() as i32;
            let (mut jb, mut tb, mut s, mut o) = (dev.addr(), dev.addr() + table_at as u64, src.addr, out.addr);
            let (mut n_, mut ow, mut oh, mut ty) = (n, p.ow, p.oh, p.out as i32);
            let mut wargs: [*mut c_void; 5] = [
                (&mut jb as *mut u64).cast(),
                (&mut tb as *mut u64).cast(),
                (&mut n_ as *mut i32).cast(),
                (&mut ow as *mut i32).cast(),
                (&mut oh as *mut i32).cast(),
            ];
            let (gx, gy) = crate::kernel::grid(jobs.len(), (p.ow + p.oh) as u32);
            // SAFETY: the arguments match `ramjet_fused_weights(const DevJob*, float*, int, int,
            // int)` in order and type; the jobs were uploaded before on the same stream and the
            // table has room for every filter (`plan`); the values are copied by the call.
            unsafe { result::launch_kernel(self.weights, (gx, gy, 1), (BLOCK, 1, 1), 0, stream_h, &mut wargs) }
                .map_err(err("launching the weight kernel"))?;
            let [mut a0, mut a1, mut a2] = p.a;
            let [mut k0, mut k1, mut k2] = p.k;
            let mut args: [*mut c_void; 14] = [
                (&mut s as *mut u64).cast(),
                (&mut jb as *mut u64).cast(),
                (&mut tb as *mut u64).cast(),
                (&mut o as *mut u64).cast(),
                (&mut n_ as *mut i32).cast(),
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
            let (gx, gy) = crate::kernel::grid(jobs.len(), (p.ow * p.oh) as u32);
            // SAFETY: the arguments match `ramjet_fused_augment`'s signature in order and type
            // (four device pointers, four ints, six floats); every image lies inside `src` and the
            // output fits `out` (checked above); the table was filled before on the same stream.
            unsafe { result::launch_kernel(self.augment, (gx, gy, 1), (BLOCK, 1, 1), 0, stream_h, &mut args) }
                .map_err(err("launching the fused kernel"))
        };
        let fenced = queue().and_then(|()| Ok((Event::record(&self.ctx, stream)?, Event::record(&self.ctx, stream)?)));
        match fenced {
            Ok((h, d)) => {
                host.release_after(Box::new(h));
                dev.release_after(Box::new(d));
                Ok(())
            }
            Err(e) => {
                // Work already queued may still read the scratch, and no fence says when it
                // is done: never reuse it (leaked on purpose, as the pool does for a failed fence).
                std::mem::forget(host);
                std::mem::forget(dev);
                Err(e)
            }
        }
    }
}

/// Checks that `out` holds `n` output images of `p`'s size and type.
fn check_output(out: DevSpan, n: usize, p: &Params) -> Result<(), GpuError> {
    if out.len >= n * p.image_bytes() {
        return Ok(());
    }
    Err(GpuError::Driver {
        doing: "checking the kernel's arguments",
        reason: format!(
            "the output holds {} B; {n} images of {}x{} {:?} need {} B",
            out.len,
            p.ow,
            p.oh,
            p.out,
            n * p.image_bytes()
        ),
    })
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
        let run = |src: &[u8], jobs: &[Job], p: &Params| -> Vec<u8> {
            let mut hs = pinned.get(src.len()).unwrap();
            hs.host_slice_mut().unwrap().copy_from_slice(src);
            let (ds, dout) = (
                device.get(src.len()).unwrap(),
                device.get(jobs.len() * p.image_bytes()).unwrap(),
            );
            gpu.copy_to_device(&hs, &ds, src.len()).unwrap();
            kernel
                .launch(&gpu, DevSpan::of(&ds), jobs, DevSpan::of(&dout), p)
                .unwrap();
            let done = gpu.record().unwrap();
            let mut got = vec![0u8; dout.len()];
            while !done.is_complete().unwrap() {
                std::thread::yield_now();
            }
            // Through the context (a raw copy on this thread has no current context).
            gpu.copy_to_host(&dout, 0, &mut got).unwrap();
            hs.release_after(Box::new(gpu.record().unwrap()));
            got
        };
        for out in [OutType::U8, OutType::F16, OutType::BF16, OutType::F32] {
            let p = Params::normalized(96, 80, out, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
            let mut want = vec![0u8; jobs.len() * p.image_bytes()];
            reference(&src, &jobs, &p, &mut want);
            assert!(
                run(&src, &jobs, &p) == want,
                "{out:?}: the GPU's output differs from the reference"
            );
        }
        // Past the grid's 65,535 images per launch: 70,000 tiny images, each its own crop.
        let tiny: Vec<Job> = (0..70_000u64)
            .map(|i| Job {
                src: (i % 1000) * 48,
                w: 4,
                h: 4,
                stride: 12,
                flip: (i % 2) as i32,
                cx: (i % 3) as f32 * 0.5,
                cy: 0.25,
                cw: 2.5 + (i % 3) as f32 * 0.5,
                ch: 3.0,
            })
            .collect();
        let p = Params::normalized(3, 2, OutType::U8, [0.0; 3], [1.0; 3]);
        let mut want = vec![0u8; tiny.len() * p.image_bytes()];
        reference(&src[..48_000], &tiny, &p, &mut want);
        assert!(
            run(&src[..48_000], &tiny, &p) == want,
            "70,000 images: the GPU's output differs"
        );
        // The pipeline: copies on the copy stream into two staging slots, the kernel on the
        // compute stream; six batches queued without a host wait, each output its reference.
        let p = Params::normalized(64, 48, OutType::BF16, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
        let batches: Vec<(Vec<u8>, Vec<Job>)> = (0..6u64)
            .map(|b| {
                let mut bytes = src.clone();
                bytes.rotate_left((b * 7919) as usize % src.len());
                let js = jobs
                    .iter()
                    .map(|j| Job {
                        flip: (b % 2) as i32,
                        cx: j.cx + b as f32,
                        ..*j
                    })
                    .collect();
                (bytes, js)
            })
            .collect();
        let slots = (0..2).map(|_| device.get(src.len()).unwrap()).collect();
        let mut pipe = gpu.pipeline(slots).unwrap();
        let mut outs = Vec::new();
        for (bytes, js) in &batches {
            let mut host = pinned.get(bytes.len()).unwrap();
            host.host_slice_mut().unwrap().copy_from_slice(bytes);
            let dout = device.get(js.len() * p.image_bytes()).unwrap();
            let work = |stream, slot, n| {
                // SAFETY: the slot is a staging buffer of at least `n` bytes the pipeline keeps
                // until this work completes.
                kernel.launch_on(stream, unsafe { DevSpan::new(slot, n) }, js, DevSpan::of(&dout), &p)
            };
            // SAFETY: `host` is pinned, holds the batch, and is parked until `copied` completes.
            let sub = unsafe { pipe.pipeline().submit(host.addr(), bytes.len(), work) }.unwrap();
            host.release_after(Box::new(sub.copied));
            outs.push((dout, sub.done));
        }
        for (b, ((bytes, js), (dout, done))) in batches.iter().zip(outs).enumerate() {
            let mut want = vec![0u8; js.len() * p.image_bytes()];
            reference(bytes, js, &p, &mut want);
            while !done.is_complete().unwrap() {
                std::thread::yield_now();
            }
            let mut got = vec![0u8; want.len()];
            gpu.copy_to_host(&dout, 0, &mut got).unwrap();
            assert!(got == want, "pipelined batch {b} differs from its reference");
        }
        drop(pipe);
        let st = pinned.stats();
        assert_eq!(st.in_use, 0, "{st:?}");
    }
}
