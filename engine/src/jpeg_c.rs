//! JPEG region decode with libjpeg-turbo, the C library (TurboJPEG 3 API, built from source
//! by `turbojpeg-sys` with its SIMD code).
//!
//! A random crop keeps on average about half of the image, so only the part that covers it is
//! decoded (`docs/python.md`, "Decode and augmentation"):
//! - columns: the iMCU columns over the crop (`jpeg_crop_scanline`); the others are
//!   entropy-decoded, as a JPEG scan requires, but never dequantised, transformed or
//!   colour-converted;
//! - rows above the crop are skipped (`jpeg_skip_scanlines`: entropy-decoded only);
//! - rows below the crop are never read: decoding stops after the crop's last row;
//! - at the DCT scale (1/8 to 8/8, in eighths) the caller picked.
//!
//! All of it goes through `tj3Decompress8` with a cropping region, whose error handling
//! (libjpeg's `longjmp`) stays inside the C library: every call returns a status, never
//! unwinds into Rust. Every `unsafe` block of ramjet's JPEG path is in this file.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::ptr::NonNull;

use turbojpeg_sys as tj;

use crate::image::{DECODE_BYTES_MAX, DECODE_PIXELS_MAX};

/// Progressive scans one image may take before it is refused: libjpeg-turbo's advice against
/// JPEGs built to take forever (thousands of tiny scans).
const SCAN_LIMIT: c_int = 500;

/// iMCU width in pixels by TJSAMP (4:4:4, 4:2:2, 4:2:0, gray, 4:4:0, 4:1:1, 4:4:1): turbojpeg.h's
/// `tjMCUWidth`, a header-only table the library does not export.
const MCU_WIDTH: [u32; 7] = [8, 16, 16, 8, 8, 32, 8];

/// A length of `v` pixels scaled by `eighths`/8, rounded up as libjpeg-turbo does (`TJSCALED`).
pub fn scaled(v: u32, eighths: u32) -> u32 {
    ((v as u64 * eighths as u64).div_ceil(8)) as u32
}

/// The header fields a region decode needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Width of an iMCU in pixels (8, 16 or 32), or `None` where the chroma subsampling is
    /// one libjpeg-turbo cannot crop (a region decode then decodes whole rows).
    pub mcu_width: Option<u32>,
}

/// A rectangle of the decoded (scaled) image, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Left edge.
    pub x: u32,
    /// Top edge.
    pub y: u32,
    /// Width.
    pub w: u32,
    /// Height.
    pub h: u32,
}

/// One TurboJPEG decompressor. Each decode thread owns one (in its `Scratch`), reused from
/// image to image.
pub struct TurboJpeg {
    handle: NonNull<std::ffi::c_void>,
}

// SAFETY: a TurboJPEG instance holds no thread-local state: it may move between threads, and
// `&mut self` on every call keeps it from being used by two at once.
unsafe impl Send for TurboJpeg {}

impl TurboJpeg {
    /// A decompressor with ramjet's limits: no more than `DECODE_PIXELS_MAX` pixels and
    /// `DECODE_BYTES_MAX` of intermediate buffers, at most `SCAN_LIMIT` progressive scans, and
    /// a warning (data that ends early, a corrupt Huffman code) is an error.
    pub fn new() -> Result<Self, String> {
        // SAFETY: tj3Init takes no pointer; it returns an owned handle or null.
        let raw = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as c_int) };
        let handle = NonNull::new(raw).ok_or("libjpeg-turbo: tj3Init failed")?;
        let mut t = TurboJpeg { handle };
        t.set(tj::TJPARAM_TJPARAM_STOPONWARNING, 1)?;
        t.set(tj::TJPARAM_TJPARAM_SCANLIMIT, SCAN_LIMIT)?;
        t.set(tj::TJPARAM_TJPARAM_MAXPIXELS, DECODE_PIXELS_MAX as c_int)?;
        t.set(tj::TJPARAM_TJPARAM_MAXMEMORY, (DECODE_BYTES_MAX >> 20) as c_int)?;
        Ok(t)
    }

    fn set(&mut self, param: tj::TJPARAM, value: c_int) -> Result<(), String> {
        // SAFETY: the handle is live (owned by self); tj3Set reads only its integer arguments.
        let rc = unsafe { tj::tj3Set(self.handle.as_ptr(), param as c_int, value) };
        if rc != 0 {
            return Err(format!("libjpeg-turbo: setting parameter {param}: {}", self.message()));
        }
        Ok(())
    }

    fn get(&self, param: tj::TJPARAM) -> c_int {
        // SAFETY: the handle is live; tj3Get reads the instance's state only.
        unsafe { tj::tj3Get(self.handle.as_ptr(), param as c_int) }
    }

    fn message(&self) -> String {
        // SAFETY: the handle is live; tj3GetErrorStr returns a pointer to a NUL-terminated
        // message owned by the instance, valid until its next call, and it is copied at once.
        let msg = unsafe { CStr::from_ptr(tj::tj3GetErrorStr(self.handle.as_ptr())) };
        msg.to_string_lossy().into_owned()
    }

    /// The message of the error the last call returned. The instance is then replaced by a
    /// fresh one: after some errors (a frame header it refuses) libjpeg is left mid-stream,
    /// and the next image would fail too ("two SOI markers").
    fn error(&mut self) -> String {
        let msg = self.message();
        if let Ok(fresh) = TurboJpeg::new() {
            *self = fresh;
        }
        msg
    }

    /// Reads the header of `jpeg`.
    pub fn header(&mut self, jpeg: &[u8]) -> Result<Header, String> {
        // SAFETY: the handle is live, and `jpeg` is a valid slice of jpeg.len() bytes that
        // outlives the call; the library only reads it.
        let rc = unsafe { tj::tj3DecompressHeader(self.handle.as_ptr(), jpeg.as_ptr(), jpeg.len() as tj::size_t) };
        if rc != 0 {
            return Err(format!("malformed JPEG: {}", self.error()));
        }
        let (w, h) = (
            self.get(tj::TJPARAM_TJPARAM_JPEGWIDTH),
            self.get(tj::TJPARAM_TJPARAM_JPEGHEIGHT),
        );
        if w <= 0 || h <= 0 {
            return Err(format!("malformed JPEG: {w}x{h} pixels"));
        }
        let subsamp = self.get(tj::TJPARAM_TJPARAM_SUBSAMP);
        let mcu_width = usize::try_from(subsamp).ok().and_then(|i| MCU_WIDTH.get(i).copied());
        Ok(Header {
            width: w as u32,
            height: h as u32,
            mcu_width,
        })
    }

    /// Decodes `region` of `jpeg` scaled by `eighths`/8 (1 to 8: libjpeg-turbo scales in the
    /// DCT domain, with an IDCT of that many points) into `out` as packed RGB,
    /// and returns the region actually decoded: its left edge moved left to an iMCU boundary, as
    /// libjpeg-turbo requires, and strictly left of `region`, and its right edge one column
    /// past (so every pixel of `region` is the full decode's own), or the whole width where
    /// the subsampling cannot be cropped.
    /// `region` is in scaled pixels and must lie inside the scaled image; `None` decodes the
    /// whole image. [`TurboJpeg::header`] must have been called on the same `jpeg` first.
    pub fn decode(
        &mut self,
        jpeg: &[u8],
        header: &Header,
        eighths: u32,
        region: Option<Region>,
        out: &mut Vec<u8>,
    ) -> Result<Region, String> {
        if !(1..=8).contains(&eighths) {
            return Err(format!("JPEG scale {eighths}/8 is not one of 1/8 to 8/8"));
        }
        let (sw, sh) = (scaled(header.width, eighths), scaled(header.height, eighths));
        let full = Region {
            x: 0,
            y: 0,
            w: sw,
            h: sh,
        };
        let mut r = region.unwrap_or(full);
        if r.w == 0 || r.h == 0 || r.x + r.w > sw || r.y + r.h > sh {
            return Err(format!("JPEG region {r:?} is outside the {sw}x{sh} image"));
        }
        match header.mcu_width.map(|m| scaled(m, eighths)) {
            Some(mw) => {
                // An iMCU boundary strictly left of the region (unless it starts at the image's
                // edge): a cropped decode's first column is upsampled without its left
                // neighbour's chroma, so it may differ from a full decode's.
                let x = r.x.saturating_sub(1) / mw * mw;
                // Likewise one column past its right edge, which then has its right neighbour
                // in the iMCUs decoded.
                let end = (r.x + r.w + 1).min(sw);
                r = Region { x, w: end - x, ..r };
            }
            None => r = Region { x: 0, w: sw, ..r },
        }
        // libjpeg-turbo accepts its scaling factors in lowest terms only (4/8 is 1/2).
        let g = [8u32, 4, 2, 1].into_iter().find(|g| eighths % g == 0).unwrap_or(1);
        let factor = tj::tjscalingfactor {
            num: (eighths / g) as c_int,
            denom: (8 / g) as c_int,
        };
        // SAFETY: the handle is live; the scaling factor is passed by value.
        let rc = unsafe { tj::tj3SetScalingFactor(self.handle.as_ptr(), factor) };
        if rc != 0 {
            return Err(format!("libjpeg-turbo: scale {eighths}/8: {}", self.error()));
        }
        let cropping = if r == full {
            tj::tjregion { x: 0, y: 0, w: 0, h: 0 } // TJUNCROPPED
        } else {
            tj::tjregion {
                x: r.x as c_int,
                y: r.y as c_int,
                w: r.w as c_int,
                h: r.h as c_int,
            }
        };
        // SAFETY: the handle is live and the header was read; the region is passed by value.
        let rc = unsafe { tj::tj3SetCroppingRegion(self.handle.as_ptr(), cropping) };
        if rc != 0 {
            return Err(format!("libjpeg-turbo: cropping region {r:?}: {}", self.error()));
        }
        let pitch = r.w as usize * 3;
        out.resize(pitch * r.h as usize, 0);
        // SAFETY: the handle is live; `jpeg` is a valid slice read-only for the call; `out`
        // holds pitch * r.h bytes, exactly what tj3Decompress8 writes for an r.w x r.h region
        // of 3-byte RGB pixels at that pitch (the region set just above, or the whole scaled
        // image when uncropped).
        let rc = unsafe {
            tj::tj3Decompress8(
                self.handle.as_ptr(),
                jpeg.as_ptr(),
                jpeg.len() as tj::size_t,
                out.as_mut_ptr(),
                pitch as c_int,
                tj::TJPF_TJPF_RGB as c_int,
            )
        };
        if rc != 0 {
            return Err(format!("malformed JPEG: {}", self.error()));
        }
        Ok(r)
    }
}

impl Drop for TurboJpeg {
    fn drop(&mut self) {
        // SAFETY: the handle is live and owned by self; it is not used after this call.
        unsafe { tj::tj3Destroy(self.handle.as_ptr()) }
    }
}
