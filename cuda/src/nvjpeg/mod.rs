//! nvJPEG, loaded by absolute path ([`crate::libs`]) into a function table (issue 41, item 1).
//!
//! Every call ramjet makes to nvJPEG goes through the [`Api`] trait: [`Table`] forwards each
//! method to the library's C function of the same name; the tests put a fake behind the same
//! trait ([`decoder`]'s tests), so the batch split, the decode parameters, the fallbacks and
//! the memory bound are checked on machines with no GPU. The C types are declared here as
//! nvJPEG's header (`nvjpeg.h`, CUDA 12 and 13) lays them out: handles are opaque pointers,
//! enums are `int`, [`Image`] is `nvjpegImage_t`, [`AllocatorV2`] is both
//! `nvjpegDevAllocatorV2_t` and `nvjpegPinnedAllocatorV2_t` (the same three fields).
//!
//! **Never run on a GPU yet.** The table's signatures are checked against the header by
//! reading only; the device check (`tools/device-check`) runs them.

pub mod decoder;

use std::ffi::{c_int, c_uint, c_void};
use std::path::{Path, PathBuf};

use crate::libs::{self, Lib, Search};
use crate::GpuError;

/// `nvjpegHandle_t`.
pub type Handle = *mut c_void;
/// `nvjpegJpegState_t`.
pub type State = *mut c_void;
/// `nvjpegJpegStream_t`: a parsed bitstream's header.
pub type JpegStream = *mut c_void;
/// `nvjpegDecodeParams_t`.
pub type Params = *mut c_void;
/// `nvjpegJpegDecoder_t`.
pub type Decoder = *mut c_void;
/// `nvjpegBufferPinned_t` and `nvjpegBufferDevice_t`.
pub type Buffer = *mut c_void;
/// `cudaStream_t` (a driver `CUstream` is the same pointer).
pub type Stream = *mut c_void;

/// `nvjpegStatus_t` values ramjet tells apart.
pub mod status {
    /// Success.
    pub const SUCCESS: i32 = 0;
    /// A handle or state was not initialised.
    pub const NOT_INITIALIZED: i32 = 1;
    /// A wrong argument.
    pub const INVALID_PARAMETER: i32 = 2;
    /// The bitstream is damaged.
    pub const BAD_JPEG: i32 = 3;
    /// The JPEG is valid but this decoder does not read it.
    pub const JPEG_NOT_SUPPORTED: i32 = 4;
    /// An allocator returned an error (ramjet's: the scratch bound).
    pub const ALLOCATOR_FAILURE: i32 = 5;
    /// A GPU operation failed.
    pub const EXECUTION_FAILED: i32 = 6;
    /// The GPU lacks what the backend needs (no hardware JPEG engine).
    pub const ARCH_MISMATCH: i32 = 7;
    /// nvJPEG's own error.
    pub const INTERNAL_ERROR: i32 = 8;
    /// The call is not supported by this backend.
    pub const IMPLEMENTATION_NOT_SUPPORTED: i32 = 9;
    /// The bitstream ends early.
    pub const INCOMPLETE_BITSTREAM: i32 = 10;

    /// The status's name as the header spells it.
    pub fn name(s: i32) -> &'static str {
        match s {
            SUCCESS => "NVJPEG_STATUS_SUCCESS",
            NOT_INITIALIZED => "NVJPEG_STATUS_NOT_INITIALIZED",
            INVALID_PARAMETER => "NVJPEG_STATUS_INVALID_PARAMETER",
            BAD_JPEG => "NVJPEG_STATUS_BAD_JPEG",
            JPEG_NOT_SUPPORTED => "NVJPEG_STATUS_JPEG_NOT_SUPPORTED",
            ALLOCATOR_FAILURE => "NVJPEG_STATUS_ALLOCATOR_FAILURE",
            EXECUTION_FAILED => "NVJPEG_STATUS_EXECUTION_FAILED",
            ARCH_MISMATCH => "NVJPEG_STATUS_ARCH_MISMATCH",
            INTERNAL_ERROR => "NVJPEG_STATUS_INTERNAL_ERROR",
            IMPLEMENTATION_NOT_SUPPORTED => "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED",
            INCOMPLETE_BITSTREAM => "NVJPEG_STATUS_INCOMPLETE_BITSTREAM",
            _ => "an unknown nvJPEG status",
        }
    }
}

/// `nvjpegBackend_t`.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `NVJPEG_BACKEND_DEFAULT`.
    Default = 0,
    /// `NVJPEG_BACKEND_HYBRID`: Huffman on the CPU.
    Hybrid = 1,
    /// `NVJPEG_BACKEND_GPU_HYBRID`: Huffman on the GPU for large batches.
    GpuHybrid = 2,
    /// `NVJPEG_BACKEND_HARDWARE`: the hardware JPEG engine.
    Hardware = 3,
    /// `NVJPEG_BACKEND_GPU_HYBRID_DEVICE`: bitstreams in device memory.
    GpuHybridDevice = 4,
    /// `NVJPEG_BACKEND_HARDWARE_DEVICE`: the engine, bitstreams in device memory.
    HardwareDevice = 5,
}

/// `NVJPEG_OUTPUT_RGBI`: interleaved RGB into `channel[0]`, what the fused kernel reads.
pub const OUTPUT_RGBI: c_int = 5;
/// `NVJPEG_CSS_420`, the layout pre-allocation is sized for.
pub const CSS_420: c_int = 2;
/// `NVJPEG_FLAGS_DEFAULT`.
pub const FLAGS_DEFAULT: c_uint = 0;

/// `nvjpegScaleFactor_t` for a decode at `eighths`/8 (8, 4, 2 or 1), or `None` for another.
pub fn scale_factor(eighths: u32) -> Option<c_int> {
    match eighths {
        8 => Some(0),
        4 => Some(1),
        2 => Some(2),
        1 => Some(3),
        _ => None,
    }
}

/// `nvjpegImage_t`: up to four planes and their pitches (bytes per row).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Image {
    /// Each plane's first byte (device memory).
    pub channel: [*mut u8; 4],
    /// Each plane's row pitch in bytes.
    pub pitch: [usize; 4],
}

impl Image {
    /// One interleaved RGB plane at device address `addr`, `pitch` bytes a row.
    pub fn rgbi(addr: u64, pitch: usize) -> Image {
        let mut channel = [std::ptr::null_mut(); 4];
        channel[0] = addr as *mut u8;
        Image {
            channel,
            pitch: [pitch, 0, 0, 0],
        }
    }
}

/// `tDevMallocV2` / `tPinnedMallocV2`: `(ctx, &mut ptr, size, stream) -> 0 on success`.
pub type MallocV2 = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, usize, Stream) -> c_int;
/// `tDevFreeV2` / `tPinnedFreeV2`: `(ctx, ptr, size, stream) -> 0 on success`.
pub type FreeV2 = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Stream) -> c_int;

/// `nvjpegDevAllocatorV2_t` and `nvjpegPinnedAllocatorV2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AllocatorV2 {
    /// Allocates.
    pub malloc: MallocV2,
    /// Frees.
    pub free: FreeV2,
    /// Passed back to both as their first argument.
    pub ctx: *mut c_void,
}

/// Declares the table: each entry is one nvJPEG function, a method of [`Api`] of the same
/// arguments, and a field of [`Table`] loaded from the symbol of that name.
macro_rules! nvjpeg_api {
    ($( $(#[$doc:meta])* fn $method:ident = $sym:literal ( $($arg:ident : $ty:ty),* ); )*) => {
        /// The nvJPEG calls ramjet makes, each with its C function's arguments and status.
        ///
        /// Every method is `unsafe` as the C function is: handles come from the same
        /// implementation and are live, pointers are valid for what the function reads and
        /// writes, for the length of the call (and of the stream's work, for device memory).
        pub trait Api {
            $( $(#[$doc])* #[allow(clippy::too_many_arguments, clippy::missing_safety_doc)]
               unsafe fn $method(&self, $($arg: $ty),*) -> i32; )*
        }

        /// nvJPEG's entry points from one loaded library.
        pub struct Table {
            path: PathBuf,
            $( $method: unsafe extern "C" fn($($ty),*) -> c_int, )*
            // Last: the pointers above point into it and must not outlive it.
            _lib: libloading::Library,
        }

        impl Table {
            /// Loads nvJPEG from `path`, with every symbol the table needs.
            pub fn open(path: &Path) -> Result<Table, GpuError> {
                let lib = libs::load(path)?;
                Ok(Table {
                    path: path.to_path_buf(),
                    $( $method: symbol(&lib, path, $sym)?, )*
                    _lib: lib,
                })
            }
        }

        impl<T: Api + ?Sized> Api for &T {
            $( unsafe fn $method(&self, $($arg: $ty),*) -> i32 {
                // SAFETY: the same call, forwarded; the caller upholds its contract.
                unsafe { (**self).$method($($arg),*) }
            } )*
        }

        impl<T: Api + ?Sized> Api for std::sync::Arc<T> {
            $( unsafe fn $method(&self, $($arg: $ty),*) -> i32 {
                // SAFETY: the same call, forwarded; the caller upholds its contract.
                unsafe { (**self).$method($($arg),*) }
            } )*
        }

        impl Api for Table {
            $( unsafe fn $method(&self, $($arg: $ty),*) -> i32 {
                // SAFETY: the caller upholds the C function's contract (the trait's text);
                // the pointer was loaded from the symbol of that name with its signature.
                unsafe { (self.$method)($($arg),*) }
            } )*
        }
    };
}

nvjpeg_api! {
    /// `nvjpegGetProperty(type, &value)`: 0 major, 1 minor, 2 patch.
    fn get_property = "nvjpegGetProperty"(kind: c_int, value: *mut c_int);
    /// `nvjpegCreateExV2(backend, dev_allocator, pinned_allocator, flags, &handle)`.
    fn create_ex_v2 = "nvjpegCreateExV2"(backend: c_int, dev: *mut AllocatorV2, pinned: *mut AllocatorV2, flags: c_uint, handle: *mut Handle);
    /// `nvjpegDestroy(handle)`.
    fn destroy = "nvjpegDestroy"(handle: Handle);
    /// `nvjpegJpegStateCreate(handle, &state)`.
    fn state_create = "nvjpegJpegStateCreate"(handle: Handle, state: *mut State);
    /// `nvjpegJpegStateDestroy(state)`.
    fn state_destroy = "nvjpegJpegStateDestroy"(state: State);
    /// `nvjpegJpegStreamCreate(handle, &stream)`.
    fn stream_create = "nvjpegJpegStreamCreate"(handle: Handle, js: *mut JpegStream);
    /// `nvjpegJpegStreamDestroy(stream)`.
    fn stream_destroy = "nvjpegJpegStreamDestroy"(js: JpegStream);
    /// `nvjpegJpegStreamParseHeader(handle, data, length, stream)`.
    fn stream_parse_header = "nvjpegJpegStreamParseHeader"(handle: Handle, data: *const u8, len: usize, js: JpegStream);
    /// `nvjpegJpegStreamParse(handle, data, length, save_metadata, save_stream, stream)`.
    fn stream_parse = "nvjpegJpegStreamParse"(handle: Handle, data: *const u8, len: usize, save_metadata: c_int, save_stream: c_int, js: JpegStream);
    /// `nvjpegDecodeParamsCreate(handle, &params)`.
    fn params_create = "nvjpegDecodeParamsCreate"(handle: Handle, params: *mut Params);
    /// `nvjpegDecodeParamsDestroy(params)`.
    fn params_destroy = "nvjpegDecodeParamsDestroy"(params: Params);
    /// `nvjpegDecodeParamsSetOutputFormat(params, format)`.
    fn params_set_output_format = "nvjpegDecodeParamsSetOutputFormat"(params: Params, format: c_int);
    /// `nvjpegDecodeParamsSetROI(params, x, y, width, height)`; `(0, 0, -1, -1)`: none.
    fn params_set_roi = "nvjpegDecodeParamsSetROI"(params: Params, x: c_int, y: c_int, w: c_int, h: c_int);
    /// `nvjpegDecodeParamsSetScaleFactor(params, factor)` (hardware backend only).
    fn params_set_scale_factor = "nvjpegDecodeParamsSetScaleFactor"(params: Params, factor: c_int);
    /// `nvjpegDecodeBatchedSupportedEx(handle, stream, params, &is_supported)`; 0: supported.
    fn batched_supported_ex = "nvjpegDecodeBatchedSupportedEx"(handle: Handle, js: JpegStream, params: Params, is_supported: *mut c_int);
    /// `nvjpegDecodeBatchedPreAllocate(handle, state, batch, width, height, css, format)`.
    fn batched_pre_allocate = "nvjpegDecodeBatchedPreAllocate"(handle: Handle, state: State, batch: c_int, w: c_int, h: c_int, css: c_int, format: c_int);
    /// `nvjpegDecodeBatchedInitialize(handle, state, batch, max_cpu_threads, format)`.
    fn batched_initialize = "nvjpegDecodeBatchedInitialize"(handle: Handle, state: State, batch: c_int, threads: c_int, format: c_int);
    /// `nvjpegDecodeBatchedEx(handle, state, data, lengths, destinations, params, stream)`.
    fn batched_ex = "nvjpegDecodeBatchedEx"(handle: Handle, state: State, data: *const *const u8, lengths: *const usize, dst: *mut Image, params: *mut Params, stream: Stream);
    /// `nvjpegDecoderCreate(handle, backend, &decoder)`: the decoupled API's decoder.
    fn decoder_create = "nvjpegDecoderCreate"(handle: Handle, backend: c_int, decoder: *mut Decoder);
    /// `nvjpegDecoderDestroy(decoder)`.
    fn decoder_destroy = "nvjpegDecoderDestroy"(decoder: Decoder);
    /// `nvjpegDecoderStateCreate(handle, decoder, &state)`.
    fn decoder_state_create = "nvjpegDecoderStateCreate"(handle: Handle, decoder: Decoder, state: *mut State);
    /// `nvjpegBufferPinnedCreateV2(handle, allocator, &buffer)`.
    fn buffer_pinned_create = "nvjpegBufferPinnedCreateV2"(handle: Handle, alloc: *mut AllocatorV2, buffer: *mut Buffer);
    /// `nvjpegBufferPinnedDestroy(buffer)`.
    fn buffer_pinned_destroy = "nvjpegBufferPinnedDestroy"(buffer: Buffer);
    /// `nvjpegBufferDeviceCreateV2(handle, allocator, &buffer)`.
    fn buffer_device_create = "nvjpegBufferDeviceCreateV2"(handle: Handle, alloc: *mut AllocatorV2, buffer: *mut Buffer);
    /// `nvjpegBufferDeviceDestroy(buffer)`.
    fn buffer_device_destroy = "nvjpegBufferDeviceDestroy"(buffer: Buffer);
    /// `nvjpegStateAttachPinnedBuffer(state, buffer)`.
    fn state_attach_pinned = "nvjpegStateAttachPinnedBuffer"(state: State, buffer: Buffer);
    /// `nvjpegStateAttachDeviceBuffer(state, buffer)`.
    fn state_attach_device = "nvjpegStateAttachDeviceBuffer"(state: State, buffer: Buffer);
    /// `nvjpegDecodeJpegHost(handle, decoder, state, params, stream)`: the CPU phase.
    fn decode_jpeg_host = "nvjpegDecodeJpegHost"(handle: Handle, decoder: Decoder, state: State, params: Params, js: JpegStream);
    /// `nvjpegDecodeJpegTransferToDevice(handle, decoder, state, stream, cuda_stream)`.
    fn decode_jpeg_transfer = "nvjpegDecodeJpegTransferToDevice"(handle: Handle, decoder: Decoder, state: State, js: JpegStream, stream: Stream);
    /// `nvjpegDecodeJpegDevice(handle, decoder, state, destination, cuda_stream)`.
    fn decode_jpeg_device = "nvjpegDecodeJpegDevice"(handle: Handle, decoder: Decoder, state: State, dst: *mut Image, stream: Stream);
}

/// One symbol of `lib`, as the function pointer type `T`.
fn symbol<T: Copy>(lib: &libloading::Library, path: &Path, name: &'static str) -> Result<T, GpuError> {
    let c = format!("{name}\0");
    // SAFETY: every `T` the table asks for is the C signature nvJPEG's header gives `name`;
    // the pointer is copied out and used only while the `Table` that owns `lib` lives.
    unsafe { lib.get::<T>(c.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| GpuError::LibrarySymbol {
            lib: Lib::Nvjpeg,
            path: path.to_path_buf(),
            name,
        })
}

impl Table {
    /// Finds nvJPEG with `search` and loads it.
    pub fn find(search: &Search) -> Result<Table, GpuError> {
        Table::open(&search.find(Lib::Nvjpeg)?.path)
    }

    /// The library's file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// nvJPEG's `(major, minor, patch)` version, through any [`Api`].
pub fn version(api: &impl Api) -> Result<(i32, i32, i32), GpuError> {
    let mut v = [0; 3];
    for (kind, out) in v.iter_mut().enumerate() {
        // SAFETY: a valid out-pointer; the property kinds are 0, 1 and 2.
        check(
            unsafe { api.get_property(kind as c_int, out) },
            "nvjpegGetProperty",
            None,
        )?;
    }
    Ok((v[0], v[1], v[2]))
}

/// A status as a result: [`GpuError::Nvjpeg`] naming the call (and the image, by its index in
/// the batch, where one is known) unless it is success.
pub fn check(s: i32, call: &'static str, image: Option<usize>) -> Result<(), GpuError> {
    if s == status::SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Nvjpeg { call, status: s, image })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that is not nvJPEG is refused by the loader, or for its first missing symbol,
    /// by name; never a crash.
    #[test]
    fn a_library_without_the_symbols_is_refused_by_name() {
        let t = tempfile::tempdir().unwrap();
        let fake = t.path().join("libnvjpeg.so.13");
        std::fs::write(&fake, b"not an ELF file").unwrap();
        assert!(matches!(Table::open(&fake), Err(GpuError::LibraryLoad { .. })));
        // A real shared library without nvJPEG's symbols: the C library itself.
        match Table::open(crate::libs::system_libc()) {
            Err(e @ GpuError::LibrarySymbol { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("nvjpegGetProperty") && msg.contains("nvjpeg"), "{msg}");
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("libc loaded as nvJPEG"),
        }
    }

    #[test]
    fn scale_factors_and_statuses_are_the_headers() {
        assert_eq!([8, 4, 2, 1].map(scale_factor), [Some(0), Some(1), Some(2), Some(3)]);
        assert_eq!(scale_factor(3), None);
        assert_eq!(status::name(7), "NVJPEG_STATUS_ARCH_MISMATCH");
        let e = check(status::BAD_JPEG, "nvjpegDecodeBatchedEx", Some(3)).unwrap_err();
        assert!(
            e.to_string().contains("image 3") && e.to_string().contains("BAD_JPEG"),
            "{e}"
        );
        assert_eq!(std::mem::size_of::<Image>(), 64);
        assert_eq!(std::mem::size_of::<AllocatorV2>(), 24);
    }
}
