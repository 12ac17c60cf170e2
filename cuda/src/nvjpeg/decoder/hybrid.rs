//! The hybrid decoder: nvJPEG's decoupled API (host phase, transfer, device phase) for one
//! image at a time, with the region of interest and no scale; one per decode thread.
//!
//! The host phase writes an image's coefficients into a pinned buffer, and the transfer only
//! queues their copy to the device on the stream: the copy runs later. So the decoder keeps
//! [`PINNED_BUFFERS`] pinned buffers and takes them in turn, and marks each one's transfer
//! with a fence from the caller (an event recorded on the stream after it). Before a host
//! phase writes into a buffer again, it waits for that buffer's fence: the bytes of a queued
//! copy are never overwritten, and the host phase of one image overlaps the previous image's
//! transfer and device phase (as DALI's decoupled decoder does). A fence that cannot be
//! recorded leaves its buffer's state unknown, so the decoder refuses every later image (they
//! fall back to the CPU) rather than risk one. Dropping the decoder waits for its fences
//! before the buffers go.

use std::ffi::c_int;

use super::super::{
    check, AllocatorV2, Api, Backend, Buffer, Decoder, Handle, Image, JpegStream, Params, State, Stream,
};
use super::super::{FLAGS_DEFAULT, OUTPUT_RGBI};
use super::{int, Bridge, BridgeStats, Job};
use crate::pool::Fence;
use crate::GpuError;

/// Pinned buffers (and bitstream handles) the hybrid decoder takes in turn.
pub const PINNED_BUFFERS: usize = 2;

/// Makes a fence after the work queued on the decoder's stream so far.
pub type Mark<'a> = dyn FnMut() -> Result<Box<dyn Fence>, GpuError> + 'a;

/// The hybrid decoder (see the module's text).
pub struct HybridDecoder<A: Api> {
    api: A,
    handle: Handle,
    decoder: Decoder,
    state: State,
    pinned_buffers: [Buffer; PINNED_BUFFERS],
    device_buffer: Buffer,
    streams: [JpegStream; PINNED_BUFFERS],
    /// Per pinned buffer: the fence after the transfer that last read it.
    queued: [Option<Box<dyn Fence>>; PINNED_BUFFERS],
    /// The buffer the next image takes.
    next: usize,
    /// Why no image may be decoded any more (a buffer's state is unknown).
    broken: Option<String>,
    params: Params,
    decoded: u64,
    allocators: Box<[AllocatorV2; 2]>,
    dev: Box<Bridge>,
    _pinned: Box<Bridge>,
}

// SAFETY: as for `HardwareDecoder`: nvJPEG's raw handles, used only through `&mut self`.
unsafe impl<A: Api + Send> Send for HybridDecoder<A> {}

impl<A: Api> HybridDecoder<A> {
    /// A decoder with `backend` (`Hybrid`: Huffman on the CPU; `GpuHybrid`).
    pub fn open(api: A, backend: Backend, dev: Box<Bridge>, pinned: Box<Bridge>) -> Result<Self, GpuError> {
        let mut me = HybridDecoder {
            api,
            handle: std::ptr::null_mut(),
            decoder: std::ptr::null_mut(),
            state: std::ptr::null_mut(),
            pinned_buffers: [std::ptr::null_mut(); PINNED_BUFFERS],
            device_buffer: std::ptr::null_mut(),
            streams: [std::ptr::null_mut(); PINNED_BUFFERS],
            queued: Default::default(),
            next: 0,
            broken: None,
            params: std::ptr::null_mut(),
            decoded: 0,
            allocators: Box::new([dev.interface(), pinned.interface()]),
            dev,
            _pinned: pinned,
        };
        me.make(backend)?;
        Ok(me)
    }

    /// Makes the handles (on an error, `drop` destroys what was made).
    fn make(&mut self, backend: Backend) -> Result<(), GpuError> {
        let (d, p): (*mut AllocatorV2, *mut AllocatorV2) = (&mut self.allocators[0], &mut self.allocators[1]);
        let api = &self.api;
        // SAFETY: each call gets live handles made just before and valid out-pointers; the
        // allocator interfaces live in `self.allocators` as long as the handles.
        unsafe {
            let c = api.create_ex_v2(Backend::Default as c_int, d, p, FLAGS_DEFAULT, &mut self.handle);
            check(c, "nvjpegCreateExV2", None)?;
            let c = api.decoder_create(self.handle, backend as c_int, &mut self.decoder);
            check(c, "nvjpegDecoderCreate", None)?;
            let c = api.decoder_state_create(self.handle, self.decoder, &mut self.state);
            check(c, "nvjpegDecoderStateCreate", None)?;
            for k in 0..PINNED_BUFFERS {
                let c = api.buffer_pinned_create(self.handle, p, &mut self.pinned_buffers[k]);
                check(c, "nvjpegBufferPinnedCreateV2", None)?;
                let c = api.stream_create(self.handle, &mut self.streams[k]);
                check(c, "nvjpegJpegStreamCreate", None)?;
            }
            let c = api.buffer_device_create(self.handle, d, &mut self.device_buffer);
            check(c, "nvjpegBufferDeviceCreateV2", None)?;
            let c = api.state_attach_device(self.state, self.device_buffer);
            check(c, "nvjpegStateAttachDeviceBuffer", None)?;
            check(
                api.params_create(self.handle, &mut self.params),
                "nvjpegDecodeParamsCreate",
                None,
            )?;
            let c = api.params_set_output_format(self.params, OUTPUT_RGBI);
            check(c, "nvjpegDecodeParamsSetOutputFormat", None)?;
        }
        Ok(())
    }

    /// Images decoded.
    pub fn decoded(&self) -> u64 {
        self.decoded
    }

    /// The device bridge's accounting.
    pub fn memory(&self) -> BridgeStats {
        self.dev.stats()
    }

    /// Decodes one image's region (no scale: `job.eighths` must be 8) on `stream`. `index`
    /// names the image in errors; `mark` makes a fence after the work queued on `stream` so
    /// far (a recorded event), which the decoder waits for before it reuses the pinned buffer
    /// this image's transfer reads.
    pub fn decode(&mut self, index: usize, job: &Job<'_>, stream: u64, mark: &mut Mark<'_>) -> Result<(), GpuError> {
        if let Some(why) = &self.broken {
            return Err(GpuError::Invalid {
                what: "nvJPEG hybrid decode",
                reason: format!("image {index}: the decoder is out of service ({why})"),
            });
        }
        if job.eighths != 8 {
            return Err(GpuError::Invalid {
                what: "nvJPEG hybrid decode",
                reason: format!(
                    "image {index}: the hybrid decoder does not scale ({}/8 asked)",
                    job.eighths
                ),
            });
        }
        let (x, y, w, h) = (
            int(job.roi.0, "roi x")?,
            int(job.roi.1, "roi y")?,
            int(job.roi.2, "roi width")?,
            int(job.roi.3, "roi height")?,
        );
        let k = self.next;
        if let Some(fence) = self.queued[k].take() {
            if let Err(e) = fence.wait() {
                self.broken = Some(format!("a transfer's fence failed: {e}"));
                return Err(e);
            }
        }
        self.next = (k + 1) % PINNED_BUFFERS;
        let (js, i) = (self.streams[k], Some(index));
        // SAFETY: this decoder's live handles; `data` is the caller's live slice. Pinned
        // buffer `k` has no queued transfer (its fence was waited for just above).
        unsafe {
            check(
                self.api.params_set_roi(self.params, x, y, w, h),
                "nvjpegDecodeParamsSetROI",
                i,
            )?;
            let c = self
                .api
                .stream_parse(self.handle, job.data.as_ptr(), job.data.len(), 0, 0, js);
            check(c, "nvjpegJpegStreamParse", i)?;
            let c = self.api.state_attach_pinned(self.state, self.pinned_buffers[k]);
            check(c, "nvjpegStateAttachPinnedBuffer", i)?;
            let c = self
                .api
                .decode_jpeg_host(self.handle, self.decoder, self.state, self.params, js);
            check(c, "nvjpegDecodeJpegHost", i)?;
        }
        self.transfer_and_finish(k, index, job, stream, mark)
    }

    /// The transfer from pinned buffer `k` (fenced) and the device phase into `job.dst`.
    fn transfer_and_finish(
        &mut self,
        k: usize,
        index: usize,
        job: &Job<'_>,
        stream: u64,
        mark: &mut Mark<'_>,
    ) -> Result<(), GpuError> {
        let (s, js, i) = (stream as Stream, self.streams[k], Some(index));
        // SAFETY: this decoder's live handles and `stream`, the caller's.
        let transferred = unsafe {
            self.api
                .decode_jpeg_transfer(self.handle, self.decoder, self.state, js, s)
        };
        // Whether or not the transfer was queued, the buffer is fenced before its next use.
        match mark() {
            Ok(f) => self.queued[k] = Some(f),
            Err(e) => {
                self.broken = Some(format!("no fence after a transfer: {e}"));
                return Err(e);
            }
        }
        check(transferred, "nvjpegDecodeJpegTransferToDevice", i)?;
        let mut image = Image::rgbi(job.dst, job.pitch);
        // SAFETY: this decoder's live handles; `dst` is the caller's device buffer of the
        // stated pitch.
        let c = unsafe {
            self.api
                .decode_jpeg_device(self.handle, self.decoder, self.state, &mut image, s)
        };
        check(c, "nvjpegDecodeJpegDevice", i)?;
        self.decoded += 1;
        Ok(())
    }
}

impl<A: Api> Drop for HybridDecoder<A> {
    fn drop(&mut self) {
        // Queued transfers read the pinned buffers: they finish before the buffers go (a
        // fence that fails can say no more; the library defers nothing, so this is the best).
        for f in self.queued.iter_mut().filter_map(Option::take) {
            let _ = f.wait();
        }
        // SAFETY: each non-null handle was made by this decoder and is destroyed once,
        // children first; the bridges outlive the library handle (fields drop after).
        unsafe {
            if !self.params.is_null() {
                self.api.params_destroy(self.params);
            }
            for &js in self.streams.iter().filter(|h| !h.is_null()) {
                self.api.stream_destroy(js);
            }
            if !self.state.is_null() {
                self.api.state_destroy(self.state);
            }
            for &b in self.pinned_buffers.iter().filter(|h| !h.is_null()) {
                self.api.buffer_pinned_destroy(b);
            }
            if !self.device_buffer.is_null() {
                self.api.buffer_device_destroy(self.device_buffer);
            }
            if !self.decoder.is_null() {
                self.api.decoder_destroy(self.decoder);
            }
            if !self.handle.is_null() {
                self.api.destroy(self.handle);
            }
        }
    }
}
