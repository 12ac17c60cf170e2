//! A fake nvJPEG behind [`Api`], and the decoders' tests against it. Built for this crate's
//! tests, and for other crates' with the `fake` feature (the GPU decode's end-to-end test
//! puts libjpeg-turbo behind it: [`Fake::with_pixels`]).
//!
//! The fake keeps a ledger of every handle (made, live, destroyed) and refuses a call on a
//! handle that is not live, as nvJPEG's contract would be broken there. "Device memory" is
//! host memory the tests own. It reads the bitstream's start-of-frame marker as nvJPEG's
//! header parse would: no `FF D8` start is `BAD_JPEG`; the engine takes baseline (SOF0)
//! frames only, and a region inside the frame. A decode allocates its output's size as
//! scratch through the device allocator it was given (so the bridge's bound applies), then
//! writes each decoded pixel as `[image's index in the call, region x, scale factor]` into
//! the destination at its pitch, or, with [`Fake::with_pixels`], the pixels a real decoder
//! gives for the region and scale.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, Mutex};

use super::super::{status, AllocatorV2, Api, Buffer, Decoder, Handle, Image, JpegStream, Params, State, Stream};
use super::*;

/// A real decoder behind the fake: `(jpeg, region (x, y, w, h), scale factor (0: none, 1 to
/// 3: 1/2 to 1/8))` to the region's pixels, rows of `3 x width` bytes, `None` for a file it
/// cannot decode.
pub type Pixels = Arc<dyn Fn(&[u8], (i32, i32, i32, i32), i32) -> Option<Vec<u8>> + Send + Sync>;

/// What a parameter handle was set to: output format, region, scale factor.
type ParamsSet = (c_int, (c_int, c_int, c_int, c_int), c_int);

#[derive(Default)]
struct Ledger {
    next: usize,
    live: BTreeMap<usize, &'static str>,
    made: usize,
    /// Per bitstream handle: (baseline, width, height) of the last parsed header.
    streams: BTreeMap<usize, (bool, u32, u32)>,
    /// Per parameter handle: (format, roi, scale factor).
    params: BTreeMap<usize, ParamsSet>,
    /// The device allocator each library handle was made with.
    dev: BTreeMap<usize, AllocatorV2>,
    initialized: Option<c_int>,
    calls: Vec<String>,
    /// Per bitstream handle: the bitstream the hybrid decoder last parsed into it.
    parsed: BTreeMap<usize, Vec<u8>>,
    /// Per decoder state: the pinned buffer attached to it.
    attached: BTreeMap<usize, usize>,
    /// Per pinned buffer: what its last host phase wrote (bitstream, region).
    pinned: BTreeMap<usize, HostPhase>,
    /// What the last transfer queued for the device phase.
    transferred: Option<HostPhase>,
    /// Per pinned buffer: the number of the last transfer queued from it.
    queued: BTreeMap<usize, u64>,
    /// Transfers queued, and how many of the first ones completed (a fence said so).
    transfers: u64,
    completed: u64,
    /// Host phases that wrote into a pinned buffer whose transfer had not completed.
    overwrites: usize,
}

/// What a host phase leaves in a pinned buffer: the bitstream and the region.
type HostPhase = (Vec<u8>, (c_int, c_int, c_int, c_int));

/// A fence after the transfers queued so far ([`Fake::fence`]): asked, it completes them.
struct Transfers {
    ledger: Arc<Mutex<Ledger>>,
    upto: u64,
}

// SAFETY: the ledger's raw pointers (handles as ids, allocator contexts) are only touched
// under its mutex, and the fake runs in one test at a time.
unsafe impl Send for Transfers {}

impl crate::pool::Fence for Transfers {
    fn is_complete(&self) -> Result<bool, GpuError> {
        let mut l = self.ledger.lock().unwrap();
        l.completed = l.completed.max(self.upto);
        Ok(true)
    }
}

/// The fake library (see the module's text). Clones share one ledger.
#[derive(Clone, Default)]
pub struct Fake {
    no_engine: bool,
    /// The status creating the engine's handle returns instead of success (0: none).
    engine_create: i32,
    ledger: Arc<Mutex<Ledger>>,
    pixels: Option<Pixels>,
}

impl Fake {
    /// A library whose decodes write `pixels`' output; `engine`: whether the GPU has a
    /// hardware JPEG engine.
    pub fn with_pixels(pixels: Pixels, engine: bool) -> Fake {
        Fake {
            no_engine: !engine,
            engine_create: 0,
            ledger: Arc::default(),
            pixels: Some(pixels),
        }
    }

    /// This library, whose engine handle's creation fails with `status` (an error other than
    /// "no engine": a driver refusing, memory short).
    pub fn engine_fails(mut self, status: i32) -> Fake {
        self.engine_create = status;
        self
    }

    /// A fence after the transfers queued so far: until it is asked, they have not completed,
    /// and a host phase into their pinned buffers is counted as an overwrite.
    pub fn fence(&self) -> Box<dyn crate::pool::Fence> {
        Box::new(Transfers {
            ledger: self.ledger.clone(),
            upto: self.ledger.lock().unwrap().transfers,
        })
    }

    /// Host phases that wrote into a pinned buffer a queued transfer had not yet read.
    pub fn overwrites(&self) -> usize {
        self.ledger.lock().unwrap().overwrites
    }

    /// Handles made and not destroyed.
    pub fn live_handles(&self) -> usize {
        self.ledger.lock().unwrap().live.len()
    }

    /// Calls whose log line starts with `prefix` (`"batched"`, `"host"`, ...).
    pub fn calls(&self, prefix: &str) -> usize {
        self.ledger
            .lock()
            .unwrap()
            .calls
            .iter()
            .filter(|c| c.starts_with(prefix))
            .count()
    }

    fn make(&self, kind: &'static str, out: *mut *mut c_void) -> i32 {
        let mut l = self.ledger.lock().unwrap();
        l.next += 1;
        l.made += 1;
        let id = l.next;
        l.live.insert(id, kind);
        // SAFETY: the decoders pass valid out-pointers.
        unsafe { *out = id as *mut c_void };
        status::SUCCESS
    }
    /// A handle of `kind` made under library handle `parent`, if that one is live.
    fn make_under(&self, parent: Handle, kind: &'static str, out: *mut *mut c_void) -> i32 {
        if !self.live(parent, "handle") {
            return status::NOT_INITIALIZED;
        }
        self.make(kind, out)
    }
    /// Changes what parameter handle `p` is set to (it must be live).
    fn set(&self, p: Params, f: impl FnOnce(&mut ParamsSet)) -> i32 {
        assert!(self.live(p, "params"));
        f(self
            .ledger
            .lock()
            .unwrap()
            .params
            .entry(p as usize)
            .or_insert((0, (0, 0, -1, -1), 0)));
        status::SUCCESS
    }
    fn live(&self, h: *mut c_void, kind: &str) -> bool {
        self.ledger.lock().unwrap().live.get(&(h as usize)) == Some(&kind)
    }
    fn kill(&self, h: *mut c_void, kind: &str) -> i32 {
        let mut l = self.ledger.lock().unwrap();
        match l.live.get(&(h as usize)) {
            Some(k) if *k == kind => {
                l.live.remove(&(h as usize));
                status::SUCCESS
            }
            _ => status::NOT_INITIALIZED,
        }
    }
    fn log(&self, s: String) {
        self.ledger.lock().unwrap().calls.push(s);
    }

    /// Writes one decoded region (`roi` scaled by `sf`) at `dst`, its scratch taken through
    /// the handle's device allocator.
    fn write(
        &self,
        handle: Handle,
        data: &[u8],
        dst: &Image,
        roi: (c_int, c_int, c_int, c_int),
        sf: c_int,
        index: usize,
    ) -> i32 {
        let a = *self
            .ledger
            .lock()
            .unwrap()
            .dev
            .get(&(handle as usize))
            .expect("a handle with an allocator");
        let div = 1 << sf;
        let (w, h) = ((roi.2 as usize).div_ceil(div), (roi.3 as usize).div_ceil(div));
        let bytes = w * h * 3;
        let mut scratch: *mut c_void = std::ptr::null_mut();
        // SAFETY: the allocator the decoder handed to `create_ex_v2`, still alive.
        if unsafe { (a.malloc)(a.ctx, &mut scratch, bytes, std::ptr::null_mut()) } != 0 {
            return status::ALLOCATOR_FAILURE;
        }
        let real = match &self.pixels {
            Some(f) => match f(data, roi, sf) {
                Some(px) if px.len() == bytes => Some(px),
                _ => {
                    // SAFETY: as below.
                    unsafe { (a.free)(a.ctx, scratch, bytes, std::ptr::null_mut()) };
                    return status::BAD_JPEG;
                }
            },
            None => None,
        };
        for y in 0..h {
            for x in 0..w {
                let px = match &real {
                    Some(r) => [r[(y * w + x) * 3], r[(y * w + x) * 3 + 1], r[(y * w + x) * 3 + 2]],
                    None => [index as u8, roi.0 as u8, sf as u8],
                };
                // SAFETY: the caller's destination holds `pitch` bytes for each decoded row.
                unsafe {
                    let p = dst.channel[0].add(y * dst.pitch[0] + 3 * x);
                    *p = px[0];
                    *p.add(1) = px[1];
                    *p.add(2) = px[2];
                }
            }
        }
        // SAFETY: as above; the pointer came from this allocator.
        unsafe { (a.free)(a.ctx, scratch, bytes, std::ptr::null_mut()) };
        status::SUCCESS
    }
}

/// The frame's marker and size, as the header parse reads them.
fn frame(data: &[u8]) -> Option<(bool, u32, u32)> {
    if !data.starts_with(&[0xFF, 0xD8]) {
        return None;
    }
    let at = data
        .windows(2)
        .position(|w| w[0] == 0xFF && matches!(w[1], 0xC0..=0xC2))?;
    let b = data.get(at + 5..at + 9)?;
    Some((
        data[at + 1] == 0xC0,
        u16::from_be_bytes([b[2], b[3]]) as u32,
        u16::from_be_bytes([b[0], b[1]]) as u32,
    ))
}

impl Api for Fake {
    unsafe fn get_property(&self, kind: c_int, value: *mut c_int) -> i32 {
        // SAFETY: a valid out-pointer.
        unsafe { *value = [13, 0, 2][kind as usize] };
        status::SUCCESS
    }
    unsafe fn create_ex_v2(
        &self,
        backend: c_int,
        dev: *mut AllocatorV2,
        pinned: *mut AllocatorV2,
        flags: c_uint,
        handle: *mut Handle,
    ) -> i32 {
        self.log(format!("create {backend} {flags}"));
        if self.no_engine && backend == Backend::Hardware as c_int {
            return status::ARCH_MISMATCH;
        }
        if self.engine_create != 0 && backend == Backend::Hardware as c_int {
            return self.engine_create;
        }
        assert!(
            !dev.is_null() && !pinned.is_null(),
            "ramjet always passes its allocators"
        );
        let s = self.make("handle", handle);
        // SAFETY: the decoder's boxed allocator and the id just written.
        unsafe { self.ledger.lock().unwrap().dev.insert(*handle as usize, *dev) };
        s
    }
    unsafe fn destroy(&self, handle: Handle) -> i32 {
        self.kill(handle, "handle")
    }
    unsafe fn state_create(&self, handle: Handle, state: *mut State) -> i32 {
        self.make_under(handle, "state", state)
    }
    unsafe fn state_destroy(&self, state: State) -> i32 {
        self.kill(state, "state")
    }
    unsafe fn stream_create(&self, handle: Handle, js: *mut JpegStream) -> i32 {
        self.make_under(handle, "stream", js)
    }
    unsafe fn stream_destroy(&self, js: JpegStream) -> i32 {
        self.kill(js, "stream")
    }
    unsafe fn stream_parse_header(&self, handle: Handle, data: *const u8, len: usize, js: JpegStream) -> i32 {
        assert!(self.live(handle, "handle") && self.live(js, "stream"));
        // SAFETY: the caller's live slice.
        let d = unsafe { std::slice::from_raw_parts(data, len) };
        match frame(d) {
            Some(f) => {
                self.ledger.lock().unwrap().streams.insert(js as usize, f);
                status::SUCCESS
            }
            None => status::BAD_JPEG,
        }
    }
    unsafe fn stream_parse(
        &self,
        handle: Handle,
        data: *const u8,
        len: usize,
        _meta: c_int,
        _stream: c_int,
        js: JpegStream,
    ) -> i32 {
        // SAFETY: the caller's live slice.
        let d = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        self.ledger.lock().unwrap().parsed.insert(js as usize, d);
        // SAFETY: as the header parse.
        unsafe { self.stream_parse_header(handle, data, len, js) }
    }
    unsafe fn params_create(&self, handle: Handle, params: *mut Params) -> i32 {
        self.make_under(handle, "params", params)
    }
    unsafe fn params_destroy(&self, params: Params) -> i32 {
        self.kill(params, "params")
    }
    unsafe fn params_set_output_format(&self, params: Params, format: c_int) -> i32 {
        self.set(params, |p| p.0 = format)
    }
    unsafe fn params_set_roi(&self, params: Params, x: c_int, y: c_int, w: c_int, h: c_int) -> i32 {
        self.set(params, |p| p.1 = (x, y, w, h))
    }
    unsafe fn params_set_scale_factor(&self, params: Params, factor: c_int) -> i32 {
        self.set(params, |p| p.2 = factor)
    }
    unsafe fn batched_supported_ex(
        &self,
        handle: Handle,
        js: JpegStream,
        params: Params,
        is_supported: *mut c_int,
    ) -> i32 {
        assert!(self.live(handle, "handle"));
        let l = self.ledger.lock().unwrap();
        let (baseline, w, h) = l.streams[&(js as usize)];
        let (_, (x, y, rw, rh), _) = l.params[&(params as usize)];
        let inside = x >= 0 && y >= 0 && rw > 0 && rh > 0 && (x + rw) as u32 <= w && (y + rh) as u32 <= h;
        // SAFETY: a valid out-pointer.
        unsafe { *is_supported = if baseline && inside { 0 } else { 1 } };
        status::SUCCESS
    }
    unsafe fn batched_pre_allocate(
        &self,
        handle: Handle,
        state: State,
        batch: c_int,
        w: c_int,
        h: c_int,
        css: c_int,
        format: c_int,
    ) -> i32 {
        assert!(self.live(handle, "handle") && self.live(state, "state"));
        self.log(format!("preallocate {batch} {w} {h} {css} {format}"));
        status::SUCCESS
    }
    unsafe fn batched_initialize(
        &self,
        handle: Handle,
        state: State,
        batch: c_int,
        threads: c_int,
        format: c_int,
    ) -> i32 {
        assert!(self.live(handle, "handle") && self.live(state, "state"));
        self.log(format!("initialize {batch} {threads} {format}"));
        self.ledger.lock().unwrap().initialized = Some(batch);
        status::SUCCESS
    }
    unsafe fn batched_ex(
        &self,
        handle: Handle,
        state: State,
        data: *const *const u8,
        lengths: *const usize,
        dst: *mut Image,
        params: *mut Params,
        _stream: Stream,
    ) -> i32 {
        assert!(self.live(handle, "handle") && self.live(state, "state"));
        let Some(n) = self.ledger.lock().unwrap().initialized else {
            return status::NOT_INITIALIZED;
        };
        self.log(format!("batched {n}"));
        for i in 0..n as usize {
            // SAFETY: the decoder passes `n` entries in every array.
            let (d, len, img, p) = unsafe { (*data.add(i), *lengths.add(i), *dst.add(i), *params.add(i)) };
            // SAFETY: the caller's live slice.
            if frame(unsafe { std::slice::from_raw_parts(d, len) }).is_none() {
                return status::BAD_JPEG;
            }
            let (format, roi, sf) = self.ledger.lock().unwrap().params[&(p as usize)];
            assert_eq!(format, OUTPUT_RGBI);
            // SAFETY: the caller's live slice.
            let s = self.write(handle, unsafe { std::slice::from_raw_parts(d, len) }, &img, roi, sf, i);
            if s != status::SUCCESS {
                self.ledger.lock().unwrap().initialized = None;
                return s;
            }
        }
        status::SUCCESS
    }
    unsafe fn decoder_create(&self, handle: Handle, backend: c_int, decoder: *mut Decoder) -> i32 {
        assert!(self.live(handle, "handle"));
        self.log(format!("decoder {backend}"));
        self.make("decoder", decoder)
    }
    unsafe fn decoder_destroy(&self, decoder: Decoder) -> i32 {
        self.kill(decoder, "decoder")
    }
    unsafe fn decoder_state_create(&self, handle: Handle, decoder: Decoder, state: *mut State) -> i32 {
        assert!(self.live(handle, "handle") && self.live(decoder, "decoder"));
        self.make("state", state)
    }
    unsafe fn buffer_pinned_create(&self, handle: Handle, alloc: *mut AllocatorV2, buffer: *mut Buffer) -> i32 {
        assert!(self.live(handle, "handle") && !alloc.is_null());
        self.make("pinned", buffer)
    }
    unsafe fn buffer_pinned_destroy(&self, buffer: Buffer) -> i32 {
        self.kill(buffer, "pinned")
    }
    unsafe fn buffer_device_create(&self, handle: Handle, alloc: *mut AllocatorV2, buffer: *mut Buffer) -> i32 {
        assert!(self.live(handle, "handle") && !alloc.is_null());
        self.make("device", buffer)
    }
    unsafe fn buffer_device_destroy(&self, buffer: Buffer) -> i32 {
        self.kill(buffer, "device")
    }
    unsafe fn state_attach_pinned(&self, state: State, buffer: Buffer) -> i32 {
        assert!(self.live(state, "state") && self.live(buffer, "pinned"));
        let mut l = self.ledger.lock().unwrap();
        l.attached.insert(state as usize, buffer as usize);
        status::SUCCESS
    }
    unsafe fn state_attach_device(&self, state: State, buffer: Buffer) -> i32 {
        assert!(self.live(state, "state") && self.live(buffer, "device"));
        status::SUCCESS
    }
    unsafe fn decode_jpeg_host(
        &self,
        handle: Handle,
        decoder: Decoder,
        state: State,
        params: Params,
        js: JpegStream,
    ) -> i32 {
        assert!(self.live(handle, "handle") && self.live(decoder, "decoder") && self.live(state, "state"));
        assert!(self.live(params, "params") && self.live(js, "stream"));
        self.log("host".into());
        let mut l = self.ledger.lock().unwrap();
        let buffer = *l.attached.get(&(state as usize)).expect("a pinned buffer attached");
        if l.queued.get(&buffer).is_some_and(|&t| t > l.completed) {
            l.overwrites += 1;
        }
        let phase = (
            l.parsed.get(&(js as usize)).cloned().unwrap_or_default(),
            l.params[&(params as usize)].1,
        );
        l.pinned.insert(buffer, phase);
        status::SUCCESS
    }
    unsafe fn decode_jpeg_transfer(
        &self,
        handle: Handle,
        decoder: Decoder,
        state: State,
        js: JpegStream,
        _stream: Stream,
    ) -> i32 {
        assert!(
            self.live(handle, "handle")
                && self.live(decoder, "decoder")
                && self.live(state, "state")
                && self.live(js, "stream")
        );
        self.log("transfer".into());
        let mut l = self.ledger.lock().unwrap();
        let buffer = *l.attached.get(&(state as usize)).expect("a pinned buffer attached");
        l.transferred = l.pinned.get(&buffer).cloned();
        l.transfers += 1;
        let t = l.transfers;
        l.queued.insert(buffer, t);
        status::SUCCESS
    }
    unsafe fn decode_jpeg_device(
        &self,
        handle: Handle,
        decoder: Decoder,
        state: State,
        dst: *mut Image,
        _stream: Stream,
    ) -> i32 {
        assert!(self.live(handle, "handle") && self.live(decoder, "decoder") && self.live(state, "state"));
        self.log("device".into());
        let (data, roi) = self.ledger.lock().unwrap().transferred.take().expect("a transfer ran");
        // SAFETY: the decoder's destination.
        self.write(handle, &data, unsafe { &*dst }, roi, 0, 0)
    }
}

/// Host memory standing in for device memory, with a ledger of what is live.
#[derive(Clone, Default)]
pub struct Heap {
    live: Arc<Mutex<BTreeMap<u64, usize>>>,
}

impl Heap {
    /// Bytes allocated and not freed.
    pub fn live_bytes(&self) -> usize {
        self.live.lock().unwrap().values().sum()
    }
}

impl Allocator for Heap {
    fn memory(&self) -> crate::pool::Memory {
        crate::pool::Memory::PinnedHost
    }
    fn alloc(&mut self, bytes: usize) -> Result<u64, GpuError> {
        let v = vec![0u8; bytes].into_boxed_slice();
        let a = Box::into_raw(v) as *mut u8 as u64;
        self.live.lock().unwrap().insert(a, bytes);
        Ok(a)
    }
    unsafe fn free(&mut self, addr: u64, bytes: usize) {
        assert_eq!(
            self.live.lock().unwrap().remove(&addr),
            Some(bytes),
            "freed with another size, or twice"
        );
        // SAFETY: made by `alloc` above with this size, freed once (the ledger says so).
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(addr as *mut u8, bytes)) });
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::version;
    use super::*;

    fn bridges(bound: usize) -> (Box<Bridge>, Box<Bridge>, Heap) {
        let heap = Heap::default();
        (
            Bridge::new(heap.clone(), bound),
            Bridge::new(heap.clone(), usize::MAX),
            heap,
        )
    }

    /// A JPEG-shaped bitstream: `FF D8`, a frame header of the given marker and size, `FF D9`.
    fn jpeg(marker: u8, w: u16, h: u16) -> Vec<u8> {
        let mut j = vec![0xFF, 0xD8, 0xFF, marker, 0, 11, 8];
        j.extend_from_slice(&h.to_be_bytes());
        j.extend_from_slice(&w.to_be_bytes());
        j.extend_from_slice(&[1, 1, 0x11, 0, 0xFF, 0xD9]);
        j
    }

    /// Destination rows of `pitch` bytes, with room for `rows`.
    struct Dst(Vec<u8>, usize);

    impl Dst {
        fn new(pitch: usize, rows: usize) -> Dst {
            Dst(vec![0xEE; pitch * rows], pitch)
        }
        fn addr(&mut self) -> u64 {
            self.0.as_mut_ptr() as u64
        }
    }

    /// The batch split: the engine gets exactly the images it supports, in order, each with its
    /// own region and scale; the damaged and the unsupported come back with their status;
    /// every decoded pixel lands at its row's pitch and nothing past the decoded width is
    /// written.
    #[test]
    fn the_engine_gets_what_it_supports_with_each_images_region_and_scale() {
        let fake = Fake::default();
        let (dev, pinned, heap) = bridges(1 << 30);
        let mut d = HardwareDecoder::open(fake.clone(), dev, pinned, Some((64, 640, 480)))
            .unwrap()
            .expect("an engine");
        assert_eq!(fake.calls("preallocate 64 640 480 2 5"), 1);
        let images = [
            jpeg(0xC0, 640, 480),
            jpeg(0xC2, 640, 480),
            b"not a jpeg".to_vec(),
            jpeg(0xC0, 320, 200),
            jpeg(0xC0, 100, 100),
        ];
        let rois = [
            (16, 8, 64, 32),
            (0, 0, 640, 480),
            (0, 0, 1, 1),
            (32, 0, 288, 200),
            (0, 0, 200, 100),
        ];
        let eighths = [4, 8, 8, 1, 8];
        let mut dsts: Vec<Dst> = (0..5).map(|_| Dst::new(1024, 200)).collect();
        let jobs: Vec<Job<'_>> = (0..5)
            .map(|i| Job {
                data: &images[i],
                roi: rois[i],
                eighths: eighths[i],
                dst: dsts[i].addr(),
                pitch: dsts[i].1,
            })
            .collect();
        let r = d.decode(&jobs, 0).unwrap();
        assert_eq!(r.decoded, vec![0, 3]);
        assert_eq!(
            r.refused,
            vec![
                (1, status::JPEG_NOT_SUPPORTED),
                (2, status::BAD_JPEG),
                (4, status::JPEG_NOT_SUPPORTED)
            ]
        );
        // Image 0: region 64x32 at 1/2 -> 32x16 pixels, written as [0, x 16, factor 1].
        let px =
            |d: &Dst, x: usize, y: usize| [d.0[y * d.1 + 3 * x], d.0[y * d.1 + 3 * x + 1], d.0[y * d.1 + 3 * x + 2]];
        assert_eq!(px(&dsts[0], 31, 15), [0, 16, 1]);
        assert_eq!(px(&dsts[0], 32, 15), [0xEE; 3], "written past the decoded width");
        assert_eq!(px(&dsts[0], 0, 16), [0xEE; 3], "written past the decoded height");
        // Image 3 is the call's second: region 288x200 at 1/8 -> 36x25.
        assert_eq!(px(&dsts[3], 35, 24), [1, 32, 3]);
        assert_eq!(px(&dsts[3], 36, 24), [0xEE; 3]);
        assert_eq!(px(&dsts[1], 0, 0), [0xEE; 3], "a refused image was written");
        let st = d.stats();
        assert_eq!((st.batches, st.images, st.refused, st.initializations), (1, 2, 3, 1));
        // The scratch was the bridge's, and all of it came back.
        let (devm, _) = d.memory();
        assert_eq!((devm.live, devm.peak, devm.allocations), (0, 36 * 25 * 3, 2));
        drop(d);
        assert!(
            fake.ledger.lock().unwrap().live.is_empty(),
            "a handle outlived its decoder"
        );
        assert!(heap.live.lock().unwrap().is_empty());
    }

    /// Issue 68, defect 4: any failure to open the engine (not only "no engine") leaves the
    /// GPU path on the hybrid decoder, with the reason, instead of failing the dataset; nothing
    /// is left open.
    #[test]
    fn an_engine_that_fails_to_open_falls_back_to_the_hybrid_decoder() {
        for s in [
            status::INTERNAL_ERROR,
            status::ALLOCATOR_FAILURE,
            status::EXECUTION_FAILED,
        ] {
            let fake = Fake::default().engine_fails(s);
            let (dev, pinned, _heap) = bridges(1 << 30);
            let (d, why) = HardwareDecoder::open_or_fall_back(fake.clone(), dev, pinned, None);
            assert!(d.is_none());
            let why = why.expect("a reason").to_string();
            assert!(
                why.contains("nvjpegCreateExV2") && why.contains(status::name(s)),
                "{why}"
            );
            assert_eq!(fake.live_handles(), 0);
        }
        // No engine at all: no decoder and no error to report.
        let fake = Fake::with_pixels(Arc::new(|_: &[u8], _, _| None), false);
        let (dev, pinned, _heap) = bridges(1 << 30);
        let (d, why) = HardwareDecoder::open_or_fall_back(fake, dev, pinned, None);
        assert!(d.is_none() && why.is_none());
        // A sound engine opens.
        let (dev, pinned, _heap) = bridges(1 << 30);
        assert!(HardwareDecoder::open_or_fall_back(Fake::default(), dev, pinned, None)
            .0
            .is_some());
    }

    /// Initialisation happens when the batch's size changes and after a failed batch, not per
    /// batch; an absurd scale or region is refused before anything is queued.
    #[test]
    fn initialises_only_when_the_size_changes_or_a_batch_failed() {
        let fake = Fake::default();
        let (dev, pinned, _heap) = bridges(1 << 30);
        let mut d = HardwareDecoder::open(fake.clone(), dev, pinned, None).unwrap().unwrap();
        assert_eq!(fake.calls("preallocate"), 0);
        let img = jpeg(0xC0, 64, 64);
        let mut dst = Dst::new(256, 64);
        let job = Job {
            data: &img,
            roi: (0, 0, 64, 64),
            eighths: 8,
            dst: dst.addr(),
            pitch: 256,
        };
        for _ in 0..3 {
            d.decode(&[job, job], 0).unwrap();
        }
        assert_eq!(fake.calls("initialize"), 1);
        d.decode(&[job], 0).unwrap();
        assert_eq!(fake.calls("initialize 1 1 5"), 1);
        let e = d.decode(&[Job { eighths: 3, ..job }], 0).unwrap_err();
        assert!(e.to_string().contains("3/8"), "{e}");
        let e = d
            .decode(
                &[Job {
                    roi: (0, 0, u32::MAX, 1),
                    ..job
                }],
                0,
            )
            .unwrap_err();
        assert!(e.to_string().contains("roi width"), "{e}");
        assert_eq!(fake.calls("batched"), 4);
    }

    /// The memory bound: a decode whose scratch would pass it fails with
    /// `NVJPEG_STATUS_ALLOCATOR_FAILURE`, counted by the bridge, nothing left allocated, and the
    /// next batch initialises again and decodes.
    #[test]
    fn scratch_over_the_bound_fails_the_batch_by_name_and_leaks_nothing() {
        let fake = Fake::default();
        let (dev, pinned, heap) = bridges(100 * 100 * 3);
        let mut d = HardwareDecoder::open(fake.clone(), dev, pinned, None).unwrap().unwrap();
        let (small, big) = (jpeg(0xC0, 100, 100), jpeg(0xC0, 200, 200));
        let mut dst = Dst::new(600, 200);
        let at = dst.addr();
        let job = |data: &'static [u8], n: u32| Job {
            data,
            roi: (0, 0, n, n),
            eighths: 8,
            dst: at,
            pitch: 600,
        };
        let (small, big): (&'static [u8], &'static [u8]) = (small.leak(), big.leak());
        let e = d.decode(&[job(big, 200)], 0).unwrap_err();
        assert!(e.to_string().contains("ALLOCATOR_FAILURE"), "{e}");
        let (m, _) = d.memory();
        assert_eq!((m.refused, m.live), (1, 0));
        assert_eq!(d.stats().failed, 1);
        d.decode(&[job(small, 100)], 0).unwrap();
        assert_eq!(
            fake.calls("initialize 1"),
            2,
            "a failed batch must be initialised again"
        );
        drop(d);
        assert!(heap.live.lock().unwrap().is_empty());
    }

    /// Without a hardware engine `open` says so (`None`), and the hybrid decoder takes the image:
    /// host phase, transfer, device phase, with the region; it refuses a scale.
    #[test]
    fn without_an_engine_the_hybrid_decoder_takes_the_image() {
        let fake = Fake {
            no_engine: true,
            ..Fake::default()
        };
        let (dev, pinned, _heap) = bridges(1 << 30);
        assert!(HardwareDecoder::open(fake.clone(), dev, pinned, None)
            .unwrap()
            .is_none());
        let (dev, pinned, heap) = bridges(1 << 30);
        let mut h = HybridDecoder::open(fake.clone(), Backend::Hybrid, dev, pinned).unwrap();
        let img = jpeg(0xC2, 64, 48);
        let mut dst = Dst::new(256, 48);
        let job = Job {
            data: &img,
            roi: (8, 0, 40, 48),
            eighths: 8,
            dst: dst.addr(),
            pitch: 256,
        };
        h.decode(7, &job, 0, &mut || Ok(fake.fence())).unwrap();
        assert_eq!(
            (fake.calls("host"), fake.calls("transfer"), fake.calls("device")),
            (1, 1, 1)
        );
        assert_eq!(&dst.0[39 * 3..39 * 3 + 3], &[0, 8, 0]);
        assert_eq!(dst.0[40 * 3], 0xEE);
        let e = h
            .decode(7, &Job { eighths: 4, ..job }, 0, &mut || Ok(fake.fence()))
            .unwrap_err();
        assert!(
            e.to_string().contains("image 7") && e.to_string().contains("does not scale"),
            "{e}"
        );
        let bad = b"garbage".to_vec();
        let e = h
            .decode(9, &Job { data: &bad, ..job }, 0, &mut || Ok(fake.fence()))
            .unwrap_err();
        assert!(
            e.to_string().contains("image 9") && e.to_string().contains("BAD_JPEG"),
            "{e}"
        );
        assert_eq!(h.decoded(), 1);
        drop(h);
        assert!(
            fake.ledger.lock().unwrap().live.is_empty(),
            "a handle outlived its decoder"
        );
        assert!(heap.live.lock().unwrap().is_empty());
        assert_eq!(version(&fake).unwrap(), (13, 0, 2));
    }

    /// The hybrid decoder takes its pinned buffers in turn and waits for a buffer's transfer
    /// before its next host phase writes into it: six images, no bytes of a queued copy
    /// overwritten, each image's own pixels; dropping it waits for the last transfers.
    #[test]
    fn the_hybrid_decoder_never_overwrites_a_pinned_buffer_under_a_queued_transfer() {
        let fake = Fake {
            no_engine: true,
            ..Fake::default()
        };
        let (dev, pinned, _heap) = bridges(1 << 30);
        let mut h = HybridDecoder::open(fake.clone(), Backend::Hybrid, dev, pinned).unwrap();
        let img = jpeg(0xC2, 64, 48);
        for i in 0..6u8 {
            let mut dst = Dst::new(256, 48);
            let job = Job {
                data: &img,
                roi: (i as u32, 0, 40, 48),
                eighths: 8,
                dst: dst.addr(),
                pitch: 256,
            };
            h.decode(i as usize, &job, 0, &mut || Ok(fake.fence())).unwrap();
            assert_eq!(dst.0[1], i, "image {i} got another image's region");
        }
        assert_eq!(fake.overwrites(), 0, "a host phase wrote under a queued transfer");
        let (transfers, completed) = {
            let l = fake.ledger.lock().unwrap();
            (l.transfers, l.completed)
        };
        assert_eq!((transfers, completed), (6, 6 - PINNED_BUFFERS as u64));
        drop(h);
        let l = fake.ledger.lock().unwrap();
        assert_eq!(l.completed, 6, "dropped with transfers still queued");
        assert!(l.live.is_empty(), "a handle outlived its decoder");
    }

    /// A fence that cannot be made leaves a buffer's state unknown: the image fails and so does
    /// every later one, by name, so the batch falls back to the CPU instead of risking a copy.
    #[test]
    fn a_hybrid_decoder_without_a_fence_refuses_every_later_image() {
        let fake = Fake {
            no_engine: true,
            ..Fake::default()
        };
        let (dev, pinned, _heap) = bridges(1 << 30);
        let mut h = HybridDecoder::open(fake.clone(), Backend::Hybrid, dev, pinned).unwrap();
        let img = jpeg(0xC2, 64, 48);
        let mut dst = Dst::new(256, 48);
        let job = Job {
            data: &img,
            roi: (0, 0, 40, 48),
            eighths: 8,
            dst: dst.addr(),
            pitch: 256,
        };
        let mut no_event = || {
            Err(GpuError::Driver {
                doing: "recording an event",
                reason: "CUDA_ERROR_LAUNCH_FAILED".into(),
            })
        };
        let e = h.decode(3, &job, 0, &mut no_event).unwrap_err();
        assert!(e.to_string().contains("recording an event"), "{e}");
        let e = h.decode(4, &job, 0, &mut || Ok(fake.fence())).unwrap_err();
        assert!(
            e.to_string().contains("image 4") && e.to_string().contains("out of service"),
            "{e}"
        );
        assert_eq!((fake.calls("host"), h.decoded()), (1, 0));
    }
}
