//! Batched decode on the hardware JPEG engine, and the hybrid decoder for what it refuses,
//! over any [`Api`] (issue 41, items 2, 3 and 7).
//!
//! [`HardwareDecoder`]: one handle with `NVJPEG_BACKEND_HARDWARE` (`None` from
//! [`HardwareDecoder::open`] where the GPU has no engine: `NVJPEG_STATUS_ARCH_MISMATCH`),
//! one state, internal buffers pre-allocated once. Per batch each image's header is parsed
//! into a bitstream handle of its own and its decode parameters set (interleaved RGB, the
//! region of interest, the scale factor); `nvjpegDecodeBatchedSupportedEx` says whether the
//! engine takes it. The taken go through one `nvjpegDecodeBatchedEx` (re-initialised only
//! when the batch's size changes or a batch failed); the refused are returned, each with its
//! status, for the hybrid decoder or the CPU.
//!
//! [`HybridDecoder`]: the decoupled API (host phase, transfer, device phase) for one image at
//! a time, with the region of interest and no scale; one per decode thread.
//!
//! Both take their device and pinned memory through a [`Bridge`]: ramjet's allocator behind
//! nvJPEG's `V2` allocator interface, with a bound on the bytes live at once. An allocation
//! over the bound fails (nvJPEG then returns `NVJPEG_STATUS_ALLOCATOR_FAILURE`), and is counted;
//! the routing ([`ramjet_engine::image::route`]) keeps images under the bound beforehand, so
//! this is the backstop that turns a misjudged image into a named error instead of an
//! out-of-memory GPU.
//!
//! Every call needs ramjet's CUDA context current on the calling thread (the GPU side wraps
//! them in [`crate::current`]'s guard); so does dropping a decoder.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{check, scale_factor, status, AllocatorV2, Api, Backend, Handle, Image, JpegStream, Params, State, Stream};
use super::{CSS_420, FLAGS_DEFAULT, OUTPUT_RGBI};
use crate::pool::Allocator;
use crate::GpuError;

/// ramjet's allocator behind nvJPEG's allocator interface, with a bound on live bytes.
pub struct Bridge {
    inner: Mutex<Box<dyn Allocator>>,
    bound: usize,
    live: AtomicUsize,
    peak: AtomicUsize,
    refused: AtomicU64,
    calls: AtomicU64,
}

/// A [`Bridge`]'s accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BridgeStats {
    /// Bytes allocated and not yet freed.
    pub live: usize,
    /// The most ever live at once.
    pub peak: usize,
    /// Allocations refused: over the bound, or the allocator failed.
    pub refused: u64,
    /// Allocations made.
    pub allocations: u64,
}

impl Bridge {
    /// `alloc` behind nvJPEG, at most `bound` bytes live at once.
    pub fn new(alloc: impl Allocator, bound: usize) -> Box<Bridge> {
        Box::new(Bridge {
            inner: Mutex::new(Box::new(alloc)),
            bound,
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        })
    }

    /// The interface nvJPEG calls; valid while this (boxed) bridge lives.
    pub fn interface(&self) -> AllocatorV2 {
        AllocatorV2 {
            malloc: bridge_malloc,
            free: bridge_free,
            ctx: self as *const Bridge as *mut c_void,
        }
    }

    /// The accounting.
    pub fn stats(&self) -> BridgeStats {
        BridgeStats {
            live: self.live.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            allocations: self.calls.load(Ordering::Relaxed),
        }
    }

    fn alloc(&self, size: usize) -> Option<u64> {
        let live = self.live.load(Ordering::Relaxed);
        if live.saturating_add(size) > self.bound {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                size,
                live,
                bound = self.bound,
                "nvJPEG asked for more scratch than the bound"
            );
            return None;
        }
        let got = self.inner.lock().unwrap_or_else(|p| p.into_inner()).alloc(size.max(1));
        match got {
            Ok(a) => {
                let now = self.live.fetch_add(size, Ordering::Relaxed) + size;
                self.peak.fetch_max(now, Ordering::Relaxed);
                self.calls.fetch_add(1, Ordering::Relaxed);
                Some(a)
            }
            Err(e) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(size, error = %e, "nvJPEG's allocation failed");
                None
            }
        }
    }

    fn free(&self, addr: u64, size: usize) {
        // SAFETY: nvJPEG frees each pointer it got from `bridge_malloc` once, with its size,
        // after its last use (the allocator interface's contract).
        unsafe {
            self.inner
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .free(addr, size.max(1))
        };
        self.live.fetch_sub(size, Ordering::Relaxed);
    }
}

/// `tDevMallocV2` / `tPinnedMallocV2` over a [`Bridge`].
unsafe extern "C" fn bridge_malloc(ctx: *mut c_void, ptr: *mut *mut c_void, size: usize, _stream: Stream) -> c_int {
    if ctx.is_null() || ptr.is_null() {
        return 1;
    }
    // SAFETY: `ctx` is the `Bridge` that `Bridge::interface` handed out; the decoders keep
    // it boxed and alive until after their nvJPEG handle is destroyed.
    let b = unsafe { &*(ctx as *const Bridge) };
    match b.alloc(size) {
        Some(a) => {
            // SAFETY: `ptr` is nvJPEG's valid out-pointer (checked non-null above).
            unsafe { *ptr = a as *mut c_void };
            0
        }
        None => 1,
    }
}

/// `tDevFreeV2` / `tPinnedFreeV2` over a [`Bridge`].
unsafe extern "C" fn bridge_free(ctx: *mut c_void, ptr: *mut c_void, size: usize, _stream: Stream) -> c_int {
    if ctx.is_null() || ptr.is_null() {
        return 0;
    }
    // SAFETY: as in `bridge_malloc`.
    let b = unsafe { &*(ctx as *const Bridge) };
    b.free(ptr as u64, size);
    0
}

/// One image for a decoder: its bitstream (in pinned host memory), what to decode of it and
/// where the interleaved RGB goes.
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    /// The JPEG.
    pub data: &'a [u8],
    /// The region of interest in source pixels: `(x, y, width, height)`.
    pub roi: (u32, u32, u32, u32),
    /// The scale in eighths (8: none; 4, 2, 1: 1/2, 1/4, 1/8). Hardware only.
    pub eighths: u32,
    /// Device address of the decoded region's first pixel.
    pub dst: u64,
    /// Bytes per row at `dst` (at least 3 x the decoded width).
    pub pitch: usize,
}

/// What a batch did: the images decoded, and those refused with nvJPEG's status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Indices of the images the engine decoded.
    pub decoded: Vec<usize>,
    /// Indices of the images it refused, each with the status that said why
    /// (`NVJPEG_STATUS_JPEG_NOT_SUPPORTED` from the support check, or the header parse's).
    pub refused: Vec<(usize, i32)>,
}

/// A hardware decoder's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HardwareStats {
    /// Batches sent to the engine.
    pub batches: u64,
    /// Images the engine decoded.
    pub images: u64,
    /// Images it refused.
    pub refused: u64,
    /// `nvjpegDecodeBatchedInitialize` calls.
    pub initializations: u64,
    /// Batches that failed as a whole.
    pub failed: u64,
}

/// The hardware JPEG engine's batched decoder (see the module's text).
pub struct HardwareDecoder<A: Api> {
    api: A,
    handle: Handle,
    state: State,
    slots: Vec<(JpegStream, Params)>,
    batch: Option<usize>,
    stats: HardwareStats,
    // Last: nvJPEG calls into these until the handle is destroyed (in `drop`).
    #[allow(dead_code)]
    allocators: Box<[AllocatorV2; 2]>,
    dev: Box<Bridge>,
    pinned: Box<Bridge>,
}

// SAFETY: the raw handles are nvJPEG's, used only through `&mut self` (one thread at a time);
// nvJPEG allows a handle to be used from any thread.
unsafe impl<A: Api + Send> Send for HardwareDecoder<A> {}

impl<A: Api> HardwareDecoder<A> {
    /// The engine's decoder, its buffers pre-allocated for `prealloc` = (images, width,
    /// height) where given; `Ok(None)` where this GPU has no hardware JPEG engine.
    pub fn open(
        api: A,
        dev: Box<Bridge>,
        pinned: Box<Bridge>,
        prealloc: Option<(usize, u32, u32)>,
    ) -> Result<Option<Self>, GpuError> {
        let mut allocators = Box::new([dev.interface(), pinned.interface()]);
        let (d, p): (*mut AllocatorV2, *mut AllocatorV2) = (&mut allocators[0], &mut allocators[1]);
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: the allocators are boxed (moving the box keeps them in place) and live as
        // long as the decoder; a valid out-pointer.
        let s = unsafe { api.create_ex_v2(Backend::Hardware as c_int, d, p, FLAGS_DEFAULT, &mut handle) };
        if s == status::ARCH_MISMATCH || s == status::IMPLEMENTATION_NOT_SUPPORTED {
            return Ok(None);
        }
        check(s, "nvjpegCreateExV2", None)?;
        let mut state: State = std::ptr::null_mut();
        // SAFETY: a live handle and a valid out-pointer.
        if let Err(e) = check(
            unsafe { api.state_create(handle, &mut state) },
            "nvjpegJpegStateCreate",
            None,
        ) {
            // SAFETY: the handle just created, used by nothing else.
            unsafe { api.destroy(handle) };
            return Err(e);
        }
        let me = HardwareDecoder {
            api,
            handle,
            state,
            slots: Vec::new(),
            batch: None,
            stats: HardwareStats::default(),
            allocators,
            dev,
            pinned,
        };
        if let Some((n, w, h)) = prealloc {
            let (n, w, h) = (int(n, "batch")?, int(w, "width")?, int(h, "height")?);
            // SAFETY: live handle and state.
            let s = unsafe {
                me.api
                    .batched_pre_allocate(me.handle, me.state, n, w, h, CSS_420, OUTPUT_RGBI)
            };
            check(s, "nvjpegDecodeBatchedPreAllocate", None)?;
        }
        Ok(Some(me))
    }

    /// [`open`](Self::open), where any failure to open the engine is a reason to decode on the
    /// hybrid decoder instead: `(None, Some(why))`. A driver that refuses the engine's handle
    /// or its pre-allocation must not fail a dataset that the hybrid decoder can read.
    pub fn open_or_fall_back(
        api: A,
        dev: Box<Bridge>,
        pinned: Box<Bridge>,
        prealloc: Option<(usize, u32, u32)>,
    ) -> (Option<Self>, Option<GpuError>) {
        match Self::open(api, dev, pinned, prealloc) {
            Ok(d) => (d, None),
            Err(e) => (None, Some(e)),
        }
    }

    /// The counters.
    pub fn stats(&self) -> HardwareStats {
        self.stats
    }

    /// The device and pinned bridges' accounting.
    pub fn memory(&self) -> (BridgeStats, BridgeStats) {
        (self.dev.stats(), self.pinned.stats())
    }

    /// Decodes what the engine takes of `jobs` on `stream` (queued; the caller's event on the
    /// stream says when it is done); returns which were decoded and which refused. An error
    /// means the whole batch failed: none of its images can be trusted.
    pub fn decode(&mut self, jobs: &[Job<'_>], stream: u64) -> Result<BatchReport, GpuError> {
        self.grow(jobs.len())?;
        let mut report = BatchReport::default();
        for (i, j) in jobs.iter().enumerate() {
            match self.prepare(i, j)? {
                None => report.decoded.push(i),
                Some(s) => report.refused.push((i, s)),
            }
        }
        self.stats.refused += report.refused.len() as u64;
        let n = report.decoded.len();
        if n == 0 {
            return Ok(report);
        }
        if self.batch != Some(n) {
            // SAFETY: live handle and state.
            let s = unsafe {
                self.api
                    .batched_initialize(self.handle, self.state, int(n, "batch")?, 1, OUTPUT_RGBI)
            };
            check(s, "nvjpegDecodeBatchedInitialize", None)?;
            self.batch = Some(n);
            self.stats.initializations += 1;
        }
        let data: Vec<*const u8> = report.decoded.iter().map(|&i| jobs[i].data.as_ptr()).collect();
        let lengths: Vec<usize> = report.decoded.iter().map(|&i| jobs[i].data.len()).collect();
        let mut images: Vec<Image> = report
            .decoded
            .iter()
            .map(|&i| Image::rgbi(jobs[i].dst, jobs[i].pitch))
            .collect();
        let mut params: Vec<Params> = report.decoded.iter().map(|&i| self.slots[i].1).collect();
        // SAFETY: every array holds `n` entries (the initialised batch size); the bitstreams
        // are the caller's live slices, the destinations its device buffers of the stated
        // pitch, the params this decoder's, each set for its image by `prepare`.
        let s = unsafe {
            self.api.batched_ex(
                self.handle,
                self.state,
                data.as_ptr(),
                lengths.as_ptr(),
                images.as_mut_ptr(),
                params.as_mut_ptr(),
                stream as Stream,
            )
        };
        self.stats.batches += 1;
        if s != status::SUCCESS {
            // The header: after a failed batch, initialise again.
            self.batch = None;
            self.stats.failed += 1;
            return Err(GpuError::Nvjpeg {
                call: "nvjpegDecodeBatchedEx",
                status: s,
                image: None,
            });
        }
        self.stats.images += n as u64;
        Ok(report)
    }

    /// One bitstream handle and one set of decode parameters per image slot, made once.
    fn grow(&mut self, n: usize) -> Result<(), GpuError> {
        while self.slots.len() < n {
            let (mut js, mut p): (JpegStream, Params) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: a live handle and valid out-pointers.
            check(
                unsafe { self.api.stream_create(self.handle, &mut js) },
                "nvjpegJpegStreamCreate",
                None,
            )?;
            // SAFETY: as above.
            if let Err(e) = check(
                unsafe { self.api.params_create(self.handle, &mut p) },
                "nvjpegDecodeParamsCreate",
                None,
            ) {
                // SAFETY: the stream just made, used by nothing.
                unsafe { self.api.stream_destroy(js) };
                return Err(e);
            }
            self.slots.push((js, p));
        }
        Ok(())
    }

    /// Parses image `i`'s header, sets its parameters and asks the engine whether it takes
    /// it: `None` if so, else the status that says why not.
    fn prepare(&mut self, i: usize, j: &Job<'_>) -> Result<Option<i32>, GpuError> {
        let (js, p) = self.slots[i];
        let sf = scale_factor(j.eighths).ok_or_else(|| GpuError::Invalid {
            what: "nvJPEG scale",
            reason: format!("image {i}: {}/8 is not 1, 1/2, 1/4 or 1/8", j.eighths),
        })?;
        let (x, y, w, h) = (
            int(j.roi.0, "roi x")?,
            int(j.roi.1, "roi y")?,
            int(j.roi.2, "roi width")?,
            int(j.roi.3, "roi height")?,
        );
        // SAFETY: a live handle and stream handle; `data` is the caller's live slice.
        let s = unsafe {
            self.api
                .stream_parse_header(self.handle, j.data.as_ptr(), j.data.len(), js)
        };
        if s != status::SUCCESS {
            return Ok(Some(s));
        }
        // SAFETY: this decoder's live parameter handle.
        unsafe {
            check(
                self.api.params_set_output_format(p, OUTPUT_RGBI),
                "nvjpegDecodeParamsSetOutputFormat",
                Some(i),
            )?;
            check(
                self.api.params_set_roi(p, x, y, w, h),
                "nvjpegDecodeParamsSetROI",
                Some(i),
            )?;
            check(
                self.api.params_set_scale_factor(p, sf),
                "nvjpegDecodeParamsSetScaleFactor",
                Some(i),
            )?;
        }
        let mut unsupported: c_int = 1;
        // SAFETY: live handles and a valid out-pointer.
        let s = unsafe { self.api.batched_supported_ex(self.handle, js, p, &mut unsupported) };
        if s != status::SUCCESS {
            return Ok(Some(s));
        }
        Ok((unsupported != 0).then_some(status::JPEG_NOT_SUPPORTED))
    }
}

impl<A: Api> Drop for HardwareDecoder<A> {
    fn drop(&mut self) {
        // SAFETY: every handle was made by this decoder and is destroyed once, children
        // before the library handle; the bridges outlive the handle (fields drop after).
        unsafe {
            for (js, p) in self.slots.drain(..) {
                self.api.params_destroy(p);
                self.api.stream_destroy(js);
            }
            self.api.state_destroy(self.state);
            self.api.destroy(self.handle);
        }
    }
}

/// A size or coordinate as nvJPEG's `int`, or an error naming it.
pub(crate) fn int<T: TryInto<c_int> + Copy + std::fmt::Display>(v: T, what: &'static str) -> Result<c_int, GpuError> {
    v.try_into().map_err(|_| GpuError::Invalid {
        what: "nvJPEG argument",
        reason: format!("{what} {v} does not fit a C int"),
    })
}

mod hybrid;
pub use hybrid::{HybridDecoder, PINNED_BUFFERS};

#[cfg(any(test, feature = "fake"))]
pub mod fake;
