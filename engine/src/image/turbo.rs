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

use crate::image::{ImageError, DECODE_BYTES_MAX, DECODE_PIXELS_MAX};

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
    /// Four components (CMYK, or YCCK): decoded as CMYK, then converted to RGB as Adobe's
    /// inverted CMYK, the form nearly every CMYK JPEG has ([`cmyk_to_rgb`]).
    pub cmyk: bool,
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

/// An owned TurboJPEG instance with ramjet's limits, shared by the decompressor and the
/// transcoder: no more than `DECODE_PIXELS_MAX` pixels and `DECODE_BYTES_MAX` of intermediate
/// buffers, at most `SCAN_LIMIT` progressive scans, and a warning (data that ends early, a
/// corrupt Huffman code) is an error.
struct Handle(NonNull<std::ffi::c_void>);

// SAFETY: a TurboJPEG instance holds no thread-local state: it may move between threads, and
// its owners take `&mut self` on every call, so no two threads use it at once.
unsafe impl Send for Handle {}

impl Handle {
    /// A `kind` instance (`TJINIT_*`) with the limits above, then `extra` parameters.
    fn new(kind: tj::TJINIT, extra: &[(tj::TJPARAM, c_int)]) -> Result<Self, ImageError> {
        let limits = [
            (tj::TJPARAM_TJPARAM_STOPONWARNING, 1),
            (tj::TJPARAM_TJPARAM_SCANLIMIT, SCAN_LIMIT),
            (tj::TJPARAM_TJPARAM_MAXPIXELS, DECODE_PIXELS_MAX as c_int),
            (tj::TJPARAM_TJPARAM_MAXMEMORY, (DECODE_BYTES_MAX >> 20) as c_int),
        ];
        Self::with(kind, limits.iter().chain(extra))
    }

    /// A `kind` instance with `params` only (a compressor: the limits above are a reader's).
    fn with<'p>(
        kind: tj::TJINIT,
        params: impl IntoIterator<Item = &'p (tj::TJPARAM, c_int)>,
    ) -> Result<Self, ImageError> {
        // SAFETY: tj3Init takes no pointer; it returns an owned handle or null.
        let raw = unsafe { tj::tj3Init(kind as c_int) };
        let h = Handle(NonNull::new(raw).ok_or_else(|| ImageError::Codec("libjpeg-turbo: tj3Init failed".into()))?);
        for &(param, value) in params {
            h.set(param, value)?;
        }
        Ok(h)
    }

    fn ptr(&self) -> tj::tjhandle {
        self.0.as_ptr()
    }

    fn set(&self, param: tj::TJPARAM, value: c_int) -> Result<(), ImageError> {
        // SAFETY: the handle is live (owned by self); tj3Set reads only its integer arguments.
        let rc = unsafe { tj::tj3Set(self.ptr(), param as c_int, value) };
        if rc != 0 {
            return Err(ImageError::Codec(format!(
                "libjpeg-turbo: setting parameter {param}: {}",
                self.message()
            )));
        }
        Ok(())
    }

    fn get(&self, param: tj::TJPARAM) -> c_int {
        // SAFETY: the handle is live; tj3Get reads the instance's state only.
        unsafe { tj::tj3Get(self.ptr(), param as c_int) }
    }

    fn message(&self) -> String {
        // SAFETY: the handle is live; tj3GetErrorStr returns a pointer to a NUL-terminated
        // message owned by the instance, valid until its next call, and it is copied at once.
        let msg = unsafe { CStr::from_ptr(tj::tj3GetErrorStr(self.ptr())) };
        msg.to_string_lossy().into_owned()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and owned by self; it is not used after this call.
        unsafe { tj::tj3Destroy(self.ptr()) }
    }
}

/// One TurboJPEG decompressor. Each decode thread owns one (in its `Scratch`), reused from
/// image to image.
pub struct TurboJpeg {
    handle: Handle,
    /// The buffers of restart-marker cuts, from the first cut on. Boxed: decoders live in
    /// thread-locals, whose size counts against the Python extension's static TLS block
    /// (`io::uring`'s `OWN_RING` says why).
    cuts: Option<Box<Cuts>>,
}

/// A decoder's restart-marker cut state, reused from image to image.
#[derive(Default)]
struct Cuts {
    /// The JPEG a cut builds.
    jpeg: Vec<u8>,
    /// Where each restart interval's entropy-coded data starts and ends in the source.
    segments: Vec<(u32, u32)>,
    /// The instance's header state is a cut's, not that of the JPEG the caller last passed
    /// to [`TurboJpeg::header`].
    held: bool,
}

impl TurboJpeg {
    /// A decompressor with ramjet's limits ([`Handle`]).
    pub fn new() -> Result<Self, ImageError> {
        Ok(TurboJpeg {
            handle: Handle::new(tj::TJINIT_TJINIT_DECOMPRESS, &[])?,
            cuts: None,
        })
    }

    /// The message of the error the last call returned. The instance is then replaced by a
    /// fresh one: after some errors (a frame header it refuses) libjpeg is left mid-stream,
    /// and the next image would fail too ("two SOI markers").
    fn error(&mut self) -> String {
        let msg = self.handle.message();
        if let Ok(fresh) = TurboJpeg::new() {
            *self = fresh;
        }
        msg
    }

    /// Reads the header of `jpeg`.
    pub fn header(&mut self, jpeg: &[u8]) -> Result<Header, ImageError> {
        // SAFETY: the handle is live, and `jpeg` is a valid slice of jpeg.len() bytes that
        // outlives the call; the library only reads it.
        let rc = unsafe { tj::tj3DecompressHeader(self.handle.ptr(), jpeg.as_ptr(), jpeg.len() as tj::size_t) };
        if let Some(c) = self.cuts.as_mut() {
            c.held = false;
        }
        if rc != 0 {
            return Err(ImageError::Malformed(format!("malformed JPEG: {}", self.error())));
        }
        let (w, h) = (
            self.handle.get(tj::TJPARAM_TJPARAM_JPEGWIDTH),
            self.handle.get(tj::TJPARAM_TJPARAM_JPEGHEIGHT),
        );
        if w <= 0 || h <= 0 {
            return Err(ImageError::Malformed(format!("malformed JPEG: {w}x{h} pixels")));
        }
        let subsamp = self.handle.get(tj::TJPARAM_TJPARAM_SUBSAMP);
        let mcu_width = usize::try_from(subsamp).ok().and_then(|i| MCU_WIDTH.get(i).copied());
        let space = self.handle.get(tj::TJPARAM_TJPARAM_COLORSPACE);
        let cmyk = space == tj::TJCS_TJCS_CMYK as c_int || space == tj::TJCS_TJCS_YCCK as c_int;
        Ok(Header {
            width: w as u32,
            height: h as u32,
            mcu_width,
            cmyk,
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
    ///
    /// A JPEG with restart markers that cut its MCU rows into equal intervals (what
    /// `ramjet pack --jpeg-restarts` writes, [`Transcoder`]) is first cut: only the intervals
    /// over the region, and the few pixels beside it that the chroma upsampling reads, are
    /// copied into a smaller JPEG, so the rows above and the columns beside the region are not
    /// even entropy-decoded. Its pixels are the same ([`cut_at_restarts`]).
    pub fn decode(
        &mut self,
        jpeg: &[u8],
        header: &Header,
        eighths: u32,
        region: Option<Region>,
        out: &mut Vec<u8>,
    ) -> Result<Region, ImageError> {
        if !(1..=8).contains(&eighths) {
            return Err(ImageError::Argument(format!(
                "JPEG scale {eighths}/8 is not one of 1/8 to 8/8"
            )));
        }
        if let Some(r) = region {
            let mut cuts = self.cuts.take().unwrap_or_default();
            let got = cut_at_restarts(jpeg, eighths, r, &mut cuts.segments, &mut cuts.jpeg)
                .map(|c| self.decode_cut(&cuts.jpeg, header, eighths, r, c, out));
            // `decode_cut` read the cut's header into the instance.
            cuts.held |= got.is_some();
            self.cuts = Some(cuts);
            if let Some(got) = got {
                return got;
            }
        }
        if self.cuts.as_ref().is_some_and(|c| c.held) {
            self.header(jpeg)?;
        }
        self.decode_region(jpeg, header, eighths, region, out)
    }

    /// Decodes `region` of the original image from `cut`, the part of it [`cut_at_restarts`]
    /// copied, whose top-left corner is at `c.x`, `c.y` (scaled pixels) of the original.
    fn decode_cut(
        &mut self,
        cut: &[u8],
        header: &Header,
        eighths: u32,
        r: Region,
        c: Cut,
        out: &mut Vec<u8>,
    ) -> Result<Region, ImageError> {
        let h = self.header(cut)?;
        if h.mcu_width != header.mcu_width {
            return Err(ImageError::Malformed(format!(
                "malformed JPEG: its restart cut reads as {h:?}, not {header:?}"
            )));
        }
        let inner = Region {
            x: r.x - c.x,
            y: r.y - c.y,
            ..r
        };
        let got = self.decode_region(cut, &h, eighths, Some(inner), out)?;
        Ok(Region {
            x: got.x + c.x,
            y: got.y + c.y,
            ..got
        })
    }

    fn decode_region(
        &mut self,
        jpeg: &[u8],
        header: &Header,
        eighths: u32,
        region: Option<Region>,
        out: &mut Vec<u8>,
    ) -> Result<Region, ImageError> {
        let (sw, sh) = (scaled(header.width, eighths), scaled(header.height, eighths));
        let full = Region {
            x: 0,
            y: 0,
            w: sw,
            h: sh,
        };
        let mut r = region.unwrap_or(full);
        if r.w == 0 || r.h == 0 || r.x + r.w > sw || r.y + r.h > sh {
            return Err(ImageError::Argument(format!(
                "JPEG region {r:?} is outside the {sw}x{sh} image"
            )));
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
        let rc = unsafe { tj::tj3SetScalingFactor(self.handle.ptr(), factor) };
        if rc != 0 {
            return Err(ImageError::Codec(format!(
                "libjpeg-turbo: scale {eighths}/8: {}",
                self.error()
            )));
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
        let rc = unsafe { tj::tj3SetCroppingRegion(self.handle.ptr(), cropping) };
        if rc != 0 {
            return Err(ImageError::Codec(format!(
                "libjpeg-turbo: cropping region {r:?}: {}",
                self.error()
            )));
        }
        let (bpp, format) = match header.cmyk {
            false => (3, tj::TJPF_TJPF_RGB),
            true => (4, tj::TJPF_TJPF_CMYK),
        };
        let pitch = r.w as usize * bpp;
        let mut cmyk = Vec::new();
        let dst = if header.cmyk { &mut cmyk } else { &mut *out };
        dst.resize(pitch * r.h as usize, 0);
        // SAFETY: the handle is live; `jpeg` is a valid slice read-only for the call; `dst`
        // holds pitch * r.h bytes, exactly what tj3Decompress8 writes for an r.w x r.h region
        // of `bpp`-byte pixels at that pitch (the region set just above, or the whole scaled
        // image when uncropped).
        let rc = unsafe {
            tj::tj3Decompress8(
                self.handle.ptr(),
                jpeg.as_ptr(),
                jpeg.len() as tj::size_t,
                dst.as_mut_ptr(),
                pitch as c_int,
                format as c_int,
            )
        };
        if rc != 0 {
            return Err(ImageError::Malformed(format!("malformed JPEG: {}", self.error())));
        }
        if header.cmyk {
            cmyk_to_rgb(&cmyk, out);
        }
        Ok(r)
    }
}

/// Adobe's inverted CMYK (what Photoshop writes, and libjpeg-turbo returns as stored: 255
/// minus each ink) to RGB: each stored channel times stored K, over 255, which is
/// (255 - ink)(255 - K) / 255 (Pillow's conversion).
pub fn cmyk_to_rgb(cmyk: &[u8], rgb: &mut Vec<u8>) {
    rgb.clear();
    rgb.reserve(cmyk.len() / 4 * 3);
    for p in cmyk.chunks_exact(4) {
        let k = p[3] as u32;
        rgb.extend([p[0], p[1], p[2]].map(|c| ((c as u32 * k + 127) / 255) as u8));
    }
}

/// Where a restart-marker cut starts in the original image, in scaled pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// Left edge.
    pub x: u32,
    /// Top edge.
    pub y: u32,
}

/// The layout of a sequential Huffman-coded JPEG with one scan of every component, as far as
/// a restart-marker cut needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Scan {
    /// Offset of the SOF marker.
    sof: usize,
    /// Offset of the first byte of entropy-coded data.
    entropy: usize,
    width: u32,
    height: u32,
    /// MCU size in pixels.
    mcu_w: u32,
    mcu_h: u32,
    /// MCUs per row, and rows of MCUs.
    per_row: u32,
    rows: u32,
    /// MCUs per restart interval (the DRI marker), a divisor of `per_row`.
    interval: u32,
    /// Some component has fewer samples than another, so the decoder upsamples it.
    subsampled: bool,
}

fn be16(b: &[u8], at: usize) -> Option<u32> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]) as u32)
}

/// Reads the markers of `jpeg` up to its first scan. `None` unless it is sequential,
/// Huffman-coded and 8-bit, its first scan holds every component, and a restart interval cuts
/// every MCU row into whole intervals.
fn scan_layout(jpeg: &[u8]) -> Option<Scan> {
    if jpeg.get(..2)? != [0xFF, 0xD8] {
        return None;
    }
    let mut i = 2;
    let mut sof = None;
    let mut interval = 0;
    let (mut width, mut height, mut comps, mut hmax, mut vmax) = (0, 0, 0, 1, 1);
    let (mut hmin, mut vmin) = (4, 4);
    loop {
        if *jpeg.get(i)? != 0xFF {
            return None;
        }
        while *jpeg.get(i + 1)? == 0xFF {
            i += 1; // fill bytes before a marker
        }
        let marker = jpeg[i + 1];
        if matches!(marker, 0x00 | 0x01 | 0xD0..=0xD9) {
            return None; // no segment of its own here: not a JPEG this path reads
        }
        let len = be16(jpeg, i + 2)? as usize;
        let body = jpeg.get(i + 4..(i + 2 + len).max(i + 4))?;
        match marker {
            0xC0 | 0xC1 => {
                // P, Y, X, Nf, then Nf times (id, H<<4 | V, Tq).
                if sof.is_some() || *body.first()? != 8 {
                    return None;
                }
                height = be16(body, 1)?;
                width = be16(body, 3)?;
                comps = *body.get(5)? as usize;
                if comps == 0 || body.len() < 6 + 3 * comps {
                    return None;
                }
                for c in 0..comps {
                    let hv = body[6 + 3 * c + 1];
                    let (h, v) = ((hv >> 4) as u32, (hv & 15) as u32);
                    if !(1..=4).contains(&h) || !(1..=4).contains(&v) {
                        return None;
                    }
                    (hmax, vmax) = (hmax.max(h), vmax.max(v));
                    (hmin, vmin) = (hmin.min(h), vmin.min(v));
                }
                sof = Some(i);
            }
            // Progressive, lossless, hierarchical or arithmetic-coded: not cut.
            0xC2 | 0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF => return None,
            0xDD => interval = be16(body, 0)?,
            0xDA => {
                if sof.is_none() || *body.first()? as usize != comps {
                    return None;
                }
                let entropy = i + 2 + len;
                let (mcu_w, mcu_h) = if comps == 1 { (8, 8) } else { (8 * hmax, 8 * vmax) };
                if width == 0 || height == 0 || interval == 0 || entropy > jpeg.len() {
                    return None;
                }
                let per_row = width.div_ceil(mcu_w);
                if per_row % interval != 0 {
                    return None;
                }
                return Some(Scan {
                    sof: sof?,
                    entropy,
                    width,
                    height,
                    mcu_w,
                    mcu_h,
                    per_row,
                    rows: height.div_ceil(mcu_h),
                    interval,
                    subsampled: comps > 1 && (hmin < hmax || vmin < vmax),
                });
            }
            _ => {}
        }
        i += 2 + len;
    }
}

/// Finds where restart intervals `0..=last` of the scan start and end: `segments[k]` is the
/// entropy-coded data of interval `k`, without the RST marker after it. `None` where the
/// markers are not RST0, RST1, ... RST7, RST0 ... in order, or the data ends first.
fn find_segments(jpeg: &[u8], s: &Scan, last: usize, segments: &mut Vec<(u32, u32)>) -> Option<()> {
    segments.clear();
    let total = (s.per_row / s.interval) as usize * s.rows as usize;
    let mut start = s.entropy;
    let mut at = s.entropy;
    while segments.len() <= last {
        let ff = at + memchr::memchr(0xFF, jpeg.get(at..)?)?;
        let next = *jpeg.get(ff + 1)?;
        match next {
            0x00 | 0xFF => at = ff + 1, // a stuffed 0xFF byte, or fill before a marker
            0xD0..=0xD7 => {
                if next - 0xD0 != (segments.len() % 8) as u8 || segments.len() + 1 >= total {
                    return None;
                }
                segments.push((start as u32, ff as u32));
                start = ff + 2;
                at = start;
            }
            _ => {
                // The scan ends: the last interval ends here, and only the last.
                if segments.len() + 1 != total {
                    return None;
                }
                segments.push((start as u32, ff as u32));
            }
        }
    }
    Some(())
}

/// Cuts from `jpeg` the restart intervals that a decode of `region` (scaled by `eighths`/8)
/// needs into `out`: a JPEG of its own, with the same markers, a smaller frame and the
/// intervals' entropy-coded data renumbered. The cut holds the region, the column past its
/// right edge (which [`TurboJpeg::decode`] returns too) and a margin on every side where the
/// image goes on: [`UPSAMPLE_REACH`] pixels where the image is chroma subsampled, else one.
/// It is `None` (decode the whole JPEG) where the JPEG has no such restart intervals, the cut
/// would be the whole image, or the markers are not as its header says.
///
/// Why the pixels are the same: each interval's data is coded on its own (the DC predictions
/// restart at every marker), so the cut's blocks have the original's DCT coefficients. The
/// only pixels of a JPEG that depend on neighbouring blocks are those the chroma upsampling
/// interpolates across a block edge, from at most the next chroma sample; the margin keeps
/// every chroma sample the region's pixels are interpolated from inside the cut, and away
/// from its edges, where the decoder repeats the edge sample instead.
pub fn cut_at_restarts(
    jpeg: &[u8],
    eighths: u32,
    region: Region,
    segments: &mut Vec<(u32, u32)>,
    out: &mut Vec<u8>,
) -> Option<Cut> {
    let s = scan_layout(jpeg)?;
    let (sw, sh) = (scaled(s.width, eighths), scaled(s.height, eighths));
    if region.w == 0 || region.h == 0 || region.x + region.w > sw || region.y + region.h > sh {
        return None;
    }
    // An MCU's size in scaled pixels: a whole number, as MCUs are multiples of 8 pixels.
    let (mw, mh) = (s.mcu_w / 8 * eighths, s.mcu_h / 8 * eighths);
    let iv = s.interval;
    // One pixel at least, so that the region still starts strictly right of the cut's edge,
    // as `TurboJpeg::decode` promises.
    let m = if s.subsampled { UPSAMPLE_REACH } else { 1 };
    let c0 = region.x.saturating_sub(m) / mw / iv * iv;
    let c1 = (region.x + region.w + 1 + m).div_ceil(mw).min(s.per_row).div_ceil(iv) * iv;
    let r0 = region.y.saturating_sub(m) / mh;
    let r1 = (region.y + region.h + m).div_ceil(mh).min(s.rows);
    if c0 == 0 && c1 == s.per_row && r0 == 0 {
        return None; // decoding stops after the region anyway: nothing to skip
    }
    let per_row = (s.per_row / iv) as usize;
    let (g0, g1) = ((c0 / iv) as usize, (c1 / iv) as usize);
    let last = (r1 as usize - 1) * per_row + g1 - 1;
    find_segments(jpeg, &s, last, segments)?;
    let w = s.width.min(c1 * s.mcu_w) - c0 * s.mcu_w;
    let h = s.height.min(r1 * s.mcu_h) - r0 * s.mcu_h;
    out.clear();
    out.extend_from_slice(&jpeg[..s.entropy]);
    out[s.sof + 5..s.sof + 7].copy_from_slice(&(h as u16).to_be_bytes());
    out[s.sof + 7..s.sof + 9].copy_from_slice(&(w as u16).to_be_bytes());
    let mut n = 0usize;
    for row in r0 as usize..r1 as usize {
        for &(a, b) in &segments[row * per_row + g0..row * per_row + g1] {
            if n > 0 {
                out.extend_from_slice(&[0xFF, 0xD0 + ((n - 1) % 8) as u8]);
            }
            out.extend_from_slice(&jpeg[a as usize..b as usize]);
            n += 1;
        }
    }
    out.extend_from_slice(&[0xFF, 0xD9]);
    Some(Cut { x: c0 * mw, y: r0 * mh })
}

/// How far, in (scaled) pixels, a pixel's colour may reach for the chroma samples it is
/// upsampled from: libjpeg-turbo's fancy upsampling interpolates each pixel between its own
/// chroma sample and the next one toward it (2:1 subsampling, so at most 2 px away), and a
/// scaled decode either does the same at its scale or needs no upsampling at all.
const UPSAMPLE_REACH: u32 = 2;

/// With `--jpeg-restarts` (`ramjet pack`, `ramjet index`), a restart marker at least every
/// this many pixels of each MCU row: a crop then skips all but at most this much of each row it
/// does not need. On the synthetic set, 32 px made the files as large as its own JPEGs (optimal
/// Huffman tables make up for the markers: 64 px saved 2.4%, 16 px cost 4.1%), and `process`
/// took 3% less CPU per image than at 64 px, as little as at 16 px (`docs/benchmarks-history.md`,
/// "Restart markers every 32 px").
pub const JPEG_RESTART_PX: u32 = 32;

/// `jpeg` transcoded losslessly ([`Transcoder::with_restarts`]) with a restart marker at least
/// every `max_px` pixels, or as it is where libjpeg-turbo will not transcode it (it then
/// decodes as before). A pure function of the bytes for a given libjpeg-turbo (the one built
/// in), so a foreign shard transcodes to the same ramjet shard on every host.
pub fn with_restarts_or_given(jpeg: Vec<u8>, max_px: u32) -> Vec<u8> {
    thread_local! {
        // A transcoder is one pointer (its handle): the thread's static TLS block stays small.
        static TRANSCODER: std::cell::RefCell<Option<Transcoder>> = const { std::cell::RefCell::new(None) };
    }
    TRANSCODER.with_borrow_mut(|t| {
        if t.is_none() {
            *t = Transcoder::new().ok();
        }
        t.as_mut()
            .and_then(|t| t.with_restarts(&jpeg, max_px).ok())
            .unwrap_or(jpeg)
    })
}

/// `px` (packed RGB, `width` x `height`) compressed as a baseline JPEG with 4:2:0 chroma at
/// `quality` (1 to 100). The decode threads prime themselves with one at start
/// ([`crate::image::prime`]); nothing else in ramjet encodes.
pub fn encode_rgb(px: &[u8], width: u32, height: u32, quality: u8) -> Result<Vec<u8>, ImageError> {
    if px.len() != width as usize * height as usize * 3 || width == 0 || height == 0 {
        return Err(ImageError::Argument(format!(
            "{} bytes are not a {width}x{height} RGB image",
            px.len()
        )));
    }
    let handle = Handle::with(
        tj::TJINIT_TJINIT_COMPRESS,
        &[
            (tj::TJPARAM_TJPARAM_QUALITY, quality.clamp(1, 100) as c_int),
            (tj::TJPARAM_TJPARAM_SUBSAMP, tj::TJSAMP_TJSAMP_420 as c_int),
        ],
    )?;
    let mut dst: *mut u8 = std::ptr::null_mut();
    let mut size: tj::size_t = 0;
    // SAFETY: the handle is live; `px` holds width x height packed RGB pixels (checked above)
    // and outlives the call; `dst` is null, so the library allocates the output with tj3Alloc
    // and stores it and its size through the two pointers, which point to live locals.
    let rc = unsafe {
        tj::tj3Compress8(
            handle.ptr(),
            px.as_ptr(),
            width as c_int,
            0,
            height as c_int,
            tj::TJPF_TJPF_RGB as c_int,
            &mut dst,
            &mut size,
        )
    };
    // SAFETY: `dst` is null or the buffer tj3Compress8 allocated, with `size` bytes, unused after.
    unsafe { take_output(rc, dst, size) }.ok_or_else(|| ImageError::Codec(format!("JPEG encode: {}", handle.message())))
}

/// The output of a TurboJPEG call that allocated it (`rc` its status), copied into a `Vec`,
/// and the library's buffer freed; `None` where the call failed.
///
/// # Safety
/// `dst` is null or a buffer of `size` bytes that the call allocated with tj3Alloc, and not
/// used after this.
unsafe fn take_output(rc: c_int, dst: *mut u8, size: tj::size_t) -> Option<Vec<u8>> {
    let out = (rc == 0 && !dst.is_null()).then(|| {
        // SAFETY: on success `dst` points to `size` initialised bytes the library wrote.
        unsafe { std::slice::from_raw_parts(dst, size as usize) }.to_vec()
    });
    if !dst.is_null() {
        // SAFETY: `dst` came from tj3Alloc (the caller's promise) and is freed once, here.
        unsafe { tj::tj3Free(dst.cast()) };
    }
    out
}

/// Lossless JPEG transcoding with libjpeg-turbo's `tj3Transform`: the DCT coefficients are
/// moved as they are, so a decode of the result has exactly the original's pixels.
pub struct Transcoder {
    handle: Handle,
}

/// MCUs per restart interval for an image `per_row` MCUs wide: the largest divisor of
/// `per_row` no wider than `max_px` pixels (at least one MCU).
pub fn restart_interval(per_row: u32, mcu_w: u32, max_px: u32) -> u32 {
    let most = (max_px / mcu_w).clamp(1, per_row.max(1));
    (1..=most).rev().find(|d| per_row % d == 0).unwrap_or(1)
}

impl Transcoder {
    /// A transcoder with ramjet's decode limits ([`Handle`]), optimal Huffman tables, and
    /// every marker of the source copied.
    pub fn new() -> Result<Self, ImageError> {
        let extra = [(tj::TJPARAM_TJPARAM_OPTIMIZE, 1), (tj::TJPARAM_TJPARAM_SAVEMARKERS, 2)];
        Ok(Transcoder {
            handle: Handle::new(tj::TJINIT_TJINIT_TRANSFORM, &extra)?,
        })
    }

    /// The last call's error as `kind` (with `what` before the library's message); the
    /// instance is replaced by a fresh one, as [`TurboJpeg`]'s is.
    fn fail(&mut self, kind: fn(String) -> ImageError, what: &str) -> ImageError {
        let msg = format!("{what}: {}", self.handle.message());
        if let Ok(fresh) = Transcoder::new() {
            *self = fresh;
        }
        kind(msg)
    }

    /// `jpeg` rewritten as a sequential JPEG with optimal Huffman tables and a restart marker
    /// every [`restart_interval`]`(.., max_px)` MCUs, so that [`TurboJpeg::decode`] can cut a
    /// region out of it without entropy-decoding the rest. Every marker (EXIF, ICC, comments)
    /// is kept. The pixels are the original's, bit for bit.
    pub fn with_restarts(&mut self, jpeg: &[u8], max_px: u32) -> Result<Vec<u8>, ImageError> {
        let h = self.handle.ptr();
        // SAFETY: the handle is live; `jpeg` is a valid slice that outlives the call.
        if unsafe { tj::tj3DecompressHeader(h, jpeg.as_ptr(), jpeg.len() as tj::size_t) } != 0 {
            return Err(self.fail(ImageError::Malformed, "malformed JPEG"));
        }
        let (w, subsamp) = (
            self.handle.get(tj::TJPARAM_TJPARAM_JPEGWIDTH),
            self.handle.get(tj::TJPARAM_TJPARAM_SUBSAMP),
        );
        let mcu_w = usize::try_from(subsamp)
            .ok()
            .and_then(|i| MCU_WIDTH.get(i).copied())
            .ok_or_else(|| ImageError::Malformed(format!("JPEG chroma subsampling {subsamp} has no restart cut")))?;
        let interval = restart_interval((w.max(1) as u32).div_ceil(mcu_w), mcu_w, max_px);
        if self
            .handle
            .set(tj::TJPARAM_TJPARAM_RESTARTBLOCKS, interval as c_int)
            .is_err()
        {
            return Err(self.fail(ImageError::Codec, "libjpeg-turbo: restart interval"));
        }
        let transform = tj::tjtransform {
            r: tj::tjregion { x: 0, y: 0, w: 0, h: 0 },
            op: tj::TJXOP_TJXOP_NONE as c_int,
            options: 0,
            data: std::ptr::null_mut(),
            customFilter: None,
        };
        let mut dst: *mut u8 = std::ptr::null_mut();
        let mut size: tj::size_t = 0;
        // SAFETY: the handle is live; `jpeg` is valid for the call; `dst` is null, so the
        // library allocates the output with tj3Alloc and stores it and its size through the
        // two pointers, which point to live locals; one transform is passed, by pointer.
        let rc = unsafe {
            tj::tj3Transform(
                h,
                jpeg.as_ptr(),
                jpeg.len() as tj::size_t,
                1,
                &mut dst,
                &mut size,
                &transform,
            )
        };
        // SAFETY: `dst` is null or the buffer tj3Transform allocated, with `size` bytes,
        // unused after.
        unsafe { take_output(rc, dst, size) }.ok_or_else(|| self.fail(ImageError::Codec, "JPEG transcode"))
    }
}
