//! The GPU side of one GPU-decode batch (issue 41, items 3 to 7): from a planned batch (every
//! image routed, the CPU's share already decoded into its place in a pinned source buffer) to
//! the batch's output tensor in a device buffer from ramjet's pool.
//!
//! Per batch, all on ramjet's stream:
//!
//! 1. the CPU's regions are copied from the pinned source buffer into the device's copy of it
//!    (one copy per run of neighbouring CPU images);
//! 2. the hardware engine decodes its share straight into the device source buffer, each image
//!    at its place, region and scale ([`HardwareDecoder`]); what it refuses goes to the hybrid
//!    decoder when the image is unscaled, else to the CPU;
//! 3. the hybrid decoder decodes its share and the refused ([`HybridDecoder`]); what it fails
//!    goes to the CPU;
//! 4. the CPU decodes the fallen-back images (the caller's decoder, `cpu`), and they are copied
//!    to their places;
//! 5. the fused kernel makes the output from the whole source buffer (crop, resize, flip,
//!    normalise, cast: [`crate::kernel`]).
//!
//! An image no decoder could read is an error naming its index in the batch, or, when the
//! caller skips such images, left out of the output and reported. The source buffer goes back
//! to the pool once the kernel is done with it (an event); the output leaves with an event the
//! consumer waits for. Each GPU decoder's time is measured with events around its share and
//! reported, once they completed, by [`Stage::observations`] (the split's rates).
//!
//! The stage runs over the [`Device`] trait: a GPU ([`OnGpu`]), or host memory in the tests
//! with the fake nvJPEG, where the end-to-end test runs the whole path on the CPU.

use std::collections::VecDeque;
use std::sync::Arc;

use ramjet_engine::image::gpu_batch::{decode_region, Planner, SourceBatch};
use ramjet_engine::image::route::Path;
use ramjet_engine::image::{ImageSpec, OutType as EngineOut};
use ramjet_engine::loader::Skipped;
use ramjet_engine::metrics::Metrics;
use ramjet_engine::Error as EngineError;

use crate::kernel::{Job as KernelJob, Params};
use crate::nvjpeg::decoder::{HardwareDecoder, HybridDecoder, Job as DecodeJob};
use crate::nvjpeg::{status::name as status_name, Api};
use crate::pool::{Allocator, Fence, Pool, PoolBuf};
use crate::GpuError;

/// The decoder an image was routed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// The hardware JPEG engine.
    Hardware,
    /// nvJPEG's hybrid decoder.
    Hybrid,
    /// The CPU (already decoded into the pinned source buffer).
    Cpu,
}

impl Route {
    /// Every route, in this order (the index of [`Decoded::per_route`]).
    pub const ALL: [Route; 3] = [Route::Hardware, Route::Hybrid, Route::Cpu];

    fn at(self) -> usize {
        self as usize
    }
}

/// One image of a planned batch.
#[derive(Debug, Clone, Copy)]
pub struct Image<'a> {
    /// Its decoder.
    pub route: Route,
    /// The encoded image (for the GPU decoders, and the CPU when they fail).
    pub data: &'a [u8],
    /// Byte offset of its decoded region in the source buffer.
    pub src: usize,
    /// The decoded region's size in pixels.
    pub decoded: (u32, u32),
    /// The region in source pixels `(x, y, w, h)`.
    pub roi: (u32, u32, u32, u32),
    /// The decode scale in eighths (8: none).
    pub eighths: u32,
    /// The crop in the decoded region's pixels `(x, y, w, h)`: what the kernel resizes.
    pub crop: (f32, f32, f32, f32),
    /// Mirror it.
    pub flip: bool,
}

impl Image<'_> {
    /// Bytes of its decoded region.
    pub fn bytes(&self) -> usize {
        self.decoded.0 as usize * self.decoded.1 as usize * 3
    }

    fn work(&self) -> f64 {
        self.decoded.0 as f64 * self.decoded.1 as f64
    }

    fn decode_job(&self, base: u64) -> DecodeJob<'_> {
        DecodeJob {
            data: self.data,
            roi: self.roi,
            eighths: self.eighths,
            dst: base + self.src as u64,
            pitch: 3 * self.decoded.0 as usize,
        }
    }

    fn kernel_job(&self) -> KernelJob {
        KernelJob {
            src: self.src as u64,
            w: self.decoded.0 as i32,
            h: self.decoded.1 as i32,
            stride: 3 * self.decoded.0 as i32,
            flip: self.flip as i32,
            cx: self.crop.0,
            cy: self.crop.1,
            cw: self.crop.2,
            ch: self.crop.3,
        }
    }
}

/// What the stage needs of a GPU besides nvJPEG: one stream, copies, the kernel, events.
pub trait Device {
    /// Its memory (the pool's allocator).
    type Mem: Allocator;
    /// An event recorded on the stream (with timing).
    type Event: Fence;
    /// The stream everything is queued on.
    fn stream(&self) -> u64;
    /// Queues a copy of `bytes` bytes of pinned host memory at `src` to device address `dst`.
    ///
    /// # Safety
    /// `src` is pinned host memory of `bytes` bytes left untouched until an event recorded
    /// afterwards completes; `dst` is device memory of as many.
    unsafe fn upload(&self, dst: u64, src: *const u8, bytes: usize) -> Result<(), GpuError>;
    /// Copies `src` (any host memory) to device address `dst`, ordered before the work queued
    /// afterwards; `src` may be reused when this returns.
    ///
    /// # Safety
    /// `dst` is device memory of `src.len()` bytes.
    unsafe fn upload_now(&self, dst: u64, src: &[u8]) -> Result<(), GpuError>;
    /// Queues the fused kernel: `jobs` from `src` (address, bytes) into `out` (address, bytes).
    fn launch(&self, src: (u64, usize), jobs: &[KernelJob], out: (u64, usize), p: &Params) -> Result<(), GpuError>;
    /// An event after the work queued so far.
    fn record(&self) -> Result<Self::Event, GpuError>;
    /// Seconds between two completed events.
    fn seconds(&self, from: &Self::Event, to: &Self::Event) -> Result<f64, GpuError>;
}

/// A finished batch (queued: `ready` says when it is on the device).
pub struct Decoded<A: Allocator, E> {
    /// The output, `[kept, 3, oh, ow]` of the kernel's type.
    pub out: PoolBuf<A>,
    /// Completes when the output is written.
    pub ready: E,
    /// The images in the output, by their index in the batch, in order.
    pub kept: Vec<usize>,
    /// Images no decoder could read, left out (only when skipping), each with why.
    pub failed: Vec<(usize, String)>,
    /// Images decoded by another decoder than routed: (index, route, why).
    pub fell_back: Vec<(usize, Route, String)>,
    /// Images each decoder decoded in the end ([`Route::ALL`] order).
    pub per_route: [usize; 3],
}

/// One GPU decoder's measured share of a batch, for the split's rates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// The decoder.
    pub route: Route,
    /// Images.
    pub images: usize,
    /// Decoded pixels.
    pub work: f64,
    /// Seconds on the GPU.
    pub seconds: f64,
}

/// Why a batch failed.
#[derive(Debug)]
pub enum StageError {
    /// No decoder could read image `index` of the batch.
    Image {
        /// Its index in the batch.
        index: usize,
        /// What each decoder said.
        reason: String,
    },
    /// The GPU failed (the batch's images are unharmed).
    Gpu(GpuError),
}

impl std::fmt::Display for StageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageError::Image { index, reason } => write!(f, "image {index} of the batch: {reason}"),
            StageError::Gpu(e) => write!(f, "{e}"),
        }
    }
}

impl From<GpuError> for StageError {
    fn from(e: GpuError) -> Self {
        StageError::Gpu(e)
    }
}

type Timing<E> = (Route, usize, f64, E, E);

/// Each image's decoder in the end, the images nobody read (with why), and those decoded
/// elsewhere than routed (index, route, why).
type Placed = (Vec<Route>, Vec<(usize, String)>, Vec<(usize, Route, String)>);

/// The GPU side of GPU-decode batches on one GPU (see the module's text). Calls need the
/// device's context current (nvJPEG's rule), which [`OnGpu`] and the bindings see to.
pub struct Stage<A: Api, D: Device> {
    device: D,
    hardware: Option<HardwareDecoder<A>>,
    hybrid: Option<HybridDecoder<A>>,
    pool: Pool<D::Mem>,
    timings: VecDeque<Timing<D::Event>>,
}

/// Measurements waiting for their events, at most (older ones are dropped unmeasured).
const TIMINGS_KEPT: usize = 64;

impl<A: Api, D: Device> Stage<A, D> {
    /// A stage over `device`, its decoders (either may be missing: the CPU then takes their
    /// share), its source and output buffers from `pool`.
    pub fn new(
        device: D,
        hardware: Option<HardwareDecoder<A>>,
        hybrid: Option<HybridDecoder<A>>,
        pool: Pool<D::Mem>,
    ) -> Self {
        Stage {
            device,
            hardware,
            hybrid,
            pool,
            timings: VecDeque::new(),
        }
    }

    /// Which GPU decoders there are: (hardware engine, hybrid).
    pub fn decoders(&self) -> (bool, bool) {
        (self.hardware.is_some(), self.hybrid.is_some())
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The pool's accounting (flat from batch to batch once warm: the memory bound's check).
    pub fn pool_stats(&self) -> crate::pool::PoolStats {
        self.pool.stats()
    }

    /// The GPU decoders' measured shares whose events completed since the last call.
    pub fn observations(&mut self) -> Result<Vec<Observation>, GpuError> {
        let mut out = Vec::new();
        while let Some((_, _, _, _, end)) = self.timings.front() {
            if !end.is_complete()? {
                break;
            }
            let (route, images, work, start, end) = self.timings.pop_front().expect("checked");
            out.push(Observation {
                route,
                images,
                work,
                seconds: self.device.seconds(&start, &end)?,
            });
        }
        Ok(out)
    }

    fn timed(&mut self, route: Route, images: usize, work: f64, start: D::Event) -> Result<(), GpuError> {
        let end = self.device.record()?;
        if self.timings.len() == TIMINGS_KEPT {
            self.timings.pop_front();
        }
        self.timings.push_back((route, images, work, start, end));
        Ok(())
    }

    /// Runs one batch (see the module's text). `host` holds the source buffer with the CPU's
    /// images at their places (pinned, untouched until the returned `ready` completes);
    /// `source_bytes` is the buffer's size; `cpu(index)` decodes an image the GPU decoders
    /// could not, as the CPU path decodes its share (its region at its scale, rows of
    /// `3 x width` bytes); `skip`: leave out an image nobody can read instead of failing.
    pub fn run(
        &mut self,
        images: &[Image<'_>],
        host: &[u8],
        source_bytes: usize,
        cpu: &mut dyn FnMut(usize) -> Result<Vec<u8>, ramjet_engine::Invalid>,
        p: &Params,
        skip: bool,
    ) -> Result<Decoded<D::Mem, D::Event>, StageError> {
        for (k, im) in images.iter().enumerate() {
            if im.src.checked_add(im.bytes()).is_none_or(|end| end > source_bytes) {
                return Err(GpuError::Invalid {
                    what: "GPU decode batch",
                    reason: format!(
                        "image {k}'s place {}+{} is outside the {source_bytes} B source buffer",
                        im.src,
                        im.bytes()
                    ),
                }
                .into());
            }
        }
        if host.len() < source_bytes {
            return Err(GpuError::Invalid {
                what: "GPU decode batch",
                reason: format!("the host source buffer has {} B of {source_bytes}", host.len()),
            }
            .into());
        }
        let source = self.pool.get(source_bytes.max(1))?;
        let r = self.decode_into(images, host, &source, cpu);
        // From here on the source may be in use on the stream: it goes back after an event.
        let release = |source: PoolBuf<D::Mem>, device: &D| match device.record() {
            Ok(e) => source.release_after(Box::new(e)),
            // The stream's state is unknown: the buffer is never reused (leaked, not reused
            // while something may still write it).
            Err(_) => std::mem::forget(source),
        };
        let (route_of, failed, fell_back) = match r {
            Ok(v) => v,
            Err(e) => {
                release(source, &self.device);
                return Err(e);
            }
        };
        if !skip {
            if let Some((index, reason)) = failed.first() {
                release(source, &self.device);
                return Err(StageError::Image {
                    index: *index,
                    reason: reason.clone(),
                });
            }
        }
        let kept: Vec<usize> = (0..images.len())
            .filter(|k| !failed.iter().any(|(f, _)| f == k))
            .collect();
        let jobs: Vec<KernelJob> = kept.iter().map(|&k| images[k].kernel_job()).collect();
        let out = match self.pool.get((kept.len() * p.image_bytes()).max(1)) {
            Ok(o) => o,
            Err(e) => {
                release(source, &self.device);
                return Err(e.into());
            }
        };
        let launched = self.device.launch(
            (source.addr(), source_bytes),
            &jobs,
            (out.addr(), kept.len() * p.image_bytes()),
            p,
        );
        let ready = launched.and_then(|_| self.device.record());
        release(source, &self.device);
        let ready = match ready {
            Ok(e) => e,
            Err(e) => {
                release(out, &self.device);
                return Err(e.into());
            }
        };
        let mut per_route = [0usize; 3];
        for &k in &kept {
            per_route[route_of[k].at()] += 1;
        }
        Ok(Decoded {
            out,
            ready,
            kept,
            failed,
            fell_back,
            per_route,
        })
    }

    /// Steps 1 to 4 (see the module's text): every image decoded into `source`, or failed.
    fn decode_into(
        &mut self,
        images: &[Image<'_>],
        host: &[u8],
        source: &PoolBuf<D::Mem>,
        cpu: &mut dyn FnMut(usize) -> Result<Vec<u8>, ramjet_engine::Invalid>,
    ) -> Result<Placed, StageError> {
        let base = source.addr();
        let mut route_of: Vec<Route> = images.iter().map(|i| i.route).collect();
        let mut fell_back = Vec::new();
        let mut fall = |k: usize, from: Route, why: String, route_of: &mut Vec<Route>, hybrid: bool| {
            // The hybrid decoder cannot scale: a scaled image's place holds the scaled size.
            route_of[k] = if hybrid && from == Route::Hardware && images[k].eighths == 8 {
                Route::Hybrid
            } else {
                Route::Cpu
            };
            fell_back.push((k, from, why));
        };
        // 1. The CPU's regions, a copy per run of neighbours.
        let mut k = 0;
        while k < images.len() {
            if images[k].route != Route::Cpu {
                k += 1;
                continue;
            }
            let first = k;
            while k + 1 < images.len() && images[k + 1].route == Route::Cpu {
                k += 1;
            }
            let (start, end) = (images[first].src, images[k].src + images[k].bytes());
            if end > start {
                // SAFETY: `host` holds the source buffer (checked by `run`), pinned and left
                // alone until the batch's event; the device buffer holds `end` bytes.
                unsafe {
                    self.device
                        .upload(base + start as u64, host.as_ptr().add(start), end - start)?
                };
            }
            k += 1;
        }
        // 2. The hardware engine's share.
        let hybrid = self.hybrid.is_some();
        let hw: Vec<usize> = (0..images.len())
            .filter(|&k| images[k].route == Route::Hardware)
            .collect();
        if !hw.is_empty() {
            match self.hardware.as_mut() {
                None => {
                    for &k in &hw {
                        fall(k, Route::Hardware, "no hardware engine".into(), &mut route_of, hybrid);
                    }
                }
                Some(engine) => {
                    let jobs: Vec<DecodeJob<'_>> = hw.iter().map(|&k| images[k].decode_job(base)).collect();
                    let start = self.device.record()?;
                    match engine.decode(&jobs, self.device.stream()) {
                        Ok(report) => {
                            for (j, s) in &report.refused {
                                let why = format!("the hardware engine refused it ({})", status_name(*s));
                                fall(hw[*j], Route::Hardware, why, &mut route_of, hybrid);
                            }
                            let work = report.decoded.iter().map(|&j| images[hw[j]].work()).sum();
                            self.timed(Route::Hardware, report.decoded.len(), work, start)?;
                        }
                        Err(e) => {
                            tracing::warn!("GPU decode: the hardware engine failed a batch of {}: {e}", hw.len());
                            for &k in &hw {
                                fall(
                                    k,
                                    Route::Hardware,
                                    format!("its batch failed: {e}"),
                                    &mut route_of,
                                    hybrid,
                                );
                            }
                        }
                    }
                }
            }
        }
        // 3. The hybrid decoder's share and what the engine refused.
        let hy: Vec<usize> = (0..images.len()).filter(|&k| route_of[k] == Route::Hybrid).collect();
        if !hy.is_empty() {
            let stream = self.device.stream();
            let start = self.device.record()?;
            let (mut done, mut work) = (0, 0.0);
            let device = &self.device;
            // The fence after each transfer, which the decoder waits for before it reuses the
            // transfer's pinned buffer.
            let mut mark = || device.record().map(|e| Box::new(e) as Box<dyn Fence>);
            for &k in &hy {
                let r = match self.hybrid.as_mut() {
                    None => Err("no hybrid decoder".to_owned()),
                    Some(d) => d
                        .decode(k, &images[k].decode_job(base), stream, &mut mark)
                        .map_err(|e| e.to_string()),
                };
                match r {
                    Ok(()) => {
                        done += 1;
                        work += images[k].work();
                    }
                    Err(why) => fall(k, Route::Hybrid, why, &mut route_of, false),
                }
            }
            if done > 0 {
                self.timed(Route::Hybrid, done, work, start)?;
            }
        }
        // 4. The CPU takes what fell back.
        let mut failed = Vec::new();
        for k in 0..images.len() {
            if route_of[k] != Route::Cpu || images[k].route == Route::Cpu {
                continue;
            }
            let why: Vec<&str> = fell_back
                .iter()
                .filter(|(i, _, _)| *i == k)
                .map(|(_, _, w)| w.as_str())
                .collect();
            match cpu(k) {
                Ok(px) if px.len() == images[k].bytes() => {
                    // SAFETY: the place is inside the device buffer (checked by `run`).
                    unsafe { self.device.upload_now(base + images[k].src as u64, &px)? };
                }
                Ok(px) => failed.push((
                    k,
                    format!(
                        "the CPU decoder gave {} B for a {}x{} region",
                        px.len(),
                        images[k].decoded.0,
                        images[k].decoded.1
                    ),
                )),
                Err(e) => failed.push((k, format!("{}; the CPU: {e}", why.join("; ")))),
            }
        }
        Ok((route_of, failed, fell_back))
    }
}

/// A loader's GPU batch ([`SourceBatch`], with [`LoaderConfig::gpu_decoders`] set) as the
/// stage's images.
///
/// [`LoaderConfig::gpu_decoders`]: ramjet_engine::loader::LoaderConfig::gpu_decoders
pub fn images_of(sb: &SourceBatch) -> Vec<Image<'_>> {
    sb.plan
        .images
        .iter()
        .zip(&sb.bitstreams)
        .map(|(p, data)| {
            // The loader leaves out every image whose header does not read.
            let g = p
                .geometry
                .unwrap_or_else(|| unreachable!("a planned image without a geometry"));
            Image {
                route: match p.path {
                    Path::Hardware => Route::Hardware,
                    Path::Hybrid => Route::Hybrid,
                    Path::Cpu => Route::Cpu,
                },
                data,
                src: p.src,
                decoded: g.decoded,
                roi: (g.roi.x, g.roi.y, g.roi.w, g.roi.h),
                eighths: g.eighths,
                crop: (g.crop.x as f32, g.crop.y as f32, g.crop.w as f32, g.crop.h as f32),
                flip: g.plan.flip,
            }
        })
        .collect()
}

/// The kernel's parameters for a loader's image output: uint8, or float32 normalised with
/// its mean and standard deviation, as the CPU path makes them.
pub fn params_of(spec: &ImageSpec) -> Params {
    let out = match spec.out {
        EngineOut::U8 => crate::kernel::OutType::U8,
        EngineOut::F32 => crate::kernel::OutType::F32,
    };
    Params::normalized(spec.width, spec.height, out, spec.mean, spec.std)
}

/// A finished loader batch: the output, and the samples left out.
pub type Finished<D> = (Decoded<<D as Device>::Mem, <D as Device>::Event>, Vec<Skipped>);

/// A loader's GPU batch through `stage`, made into `spec`'s output, with the planner (when
/// given) told each GPU decoder's measured rate, and the images decoded here (all but the
/// CPU's share, which the loader counted) added to `metrics`. An image no decoder reads is an error naming its shard and sample, or with
/// `skip`, left out (returned with its reason, as the loader's own skipped samples are).
pub fn run_source_batch<A: Api, D: Device>(
    stage: &mut Stage<A, D>,
    sb: &SourceBatch,
    spec: &ImageSpec,
    planner: Option<&Planner>,
    metrics: Option<&Metrics>,
    skip: bool,
) -> Result<Finished<D>, EngineError> {
    let gpu = |e: GpuError| EngineError::invalid("GPU decode", e.to_string());
    if let Some(planner) = planner {
        for o in stage.observations().map_err(gpu)? {
            let path = match o.route {
                Route::Hardware => Path::Hardware,
                Route::Hybrid => Path::Hybrid,
                Route::Cpu => Path::Cpu,
            };
            planner.observe(path, o.images, o.work, o.seconds);
        }
    }
    let images = images_of(sb);
    let p = params_of(spec);
    let mut scratch = ramjet_engine::image::Scratch::default();
    let mut cpu = |k: usize| -> Result<Vec<u8>, ramjet_engine::Invalid> {
        let g = sb.plan.images[k].geometry.ok_or("no geometry")?;
        // The CPU decodes the region at the CPU path's scale where the GPU's cannot be had.
        let mut out = vec![0u8; sb.plan.images[k].source_len()];
        decode_region(&sb.bitstreams[k], &g, &mut out, &mut scratch).map_err(|e| e.to_string())?;
        Ok(out)
    };
    let name = |k: usize| ramjet_engine::error::Location::sample(sb.shards[k].clone(), sb.samples[k]);
    match stage.run(&images, sb.source.as_slice(), sb.plan.source_bytes, &mut cpu, &p, skip) {
        Ok(d) => {
            if let Some(m) = metrics {
                let here = d.kept.iter().filter(|&&k| images[k].route != Route::Cpu).count();
                Metrics::add(&m.images_decoded, here as u64);
            }
            let skipped = d
                .failed
                .iter()
                .map(|(k, why)| Skipped {
                    shard: sb.shards[*k].clone(),
                    sample: sb.samples[*k],
                    reason: format!("GPU decode: {why}"),
                })
                .collect();
            Ok((d, skipped))
        }
        Err(StageError::Image { index, reason }) => {
            Err(EngineError::corrupt(name(index), format!("GPU decode: {reason}")))
        }
        Err(StageError::Gpu(e)) => Err(gpu(e)),
    }
}

/// A real GPU behind [`Device`]: ramjet's stream, its device pool's memory, the fused kernel.
pub struct OnGpu {
    gpu: Arc<crate::gpu::Gpu>,
    kernel: Arc<crate::gpu::FusedKernel>,
}

impl OnGpu {
    /// `gpu`'s stream with `kernel` loaded on it.
    pub fn new(gpu: Arc<crate::gpu::Gpu>, kernel: Arc<crate::gpu::FusedKernel>) -> OnGpu {
        OnGpu { gpu, kernel }
    }
}

impl Device for OnGpu {
    type Mem = crate::pool::CudaDevice;
    type Event = crate::gpu::Event;

    fn stream(&self) -> u64 {
        self.gpu.stream_handle()
    }

    unsafe fn upload(&self, dst: u64, src: *const u8, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: the caller's contract is the driver's for an asynchronous copy.
        unsafe { crate::gpu::copy_async(self.gpu.context(), dst, src, bytes, self.stream()) }
    }

    unsafe fn upload_now(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        // SAFETY: the caller's contract; the copy is synchronous.
        unsafe { crate::gpu::copy_sync(self.gpu.context(), dst, src) }
    }

    fn launch(&self, src: (u64, usize), jobs: &[KernelJob], out: (u64, usize), p: &Params) -> Result<(), GpuError> {
        // SAFETY: the stage's own pool buffers, kept until the stream passes the kernel.
        let (src, out) = unsafe {
            (
                crate::gpu::DevSpan::new(src.0, src.1),
                crate::gpu::DevSpan::new(out.0, out.1),
            )
        };
        self.kernel.launch_on(self.stream(), src, jobs, out, p)
    }

    fn record(&self) -> Result<Self::Event, GpuError> {
        crate::gpu::Event::record_timed(self.gpu.context(), self.stream())
    }

    fn seconds(&self, from: &Self::Event, to: &Self::Event) -> Result<f64, GpuError> {
        to.seconds_since(from)
    }
}

#[cfg(any(test, feature = "fake"))]
pub mod fake;
#[cfg(test)]
mod tests;
