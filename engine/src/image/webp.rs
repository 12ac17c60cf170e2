//! The libwebp binding (libwebp-sys, libwebp 1.6 built from source): a WebP's features from its
//! header, and its decode to RGB, whole or as a region at a reduced scale, into a buffer
//! the caller keeps. Cropping and scaling happen inside libwebp: a lossy (VP8) decode then
//! stops after the region's last macroblock row and filters, upsamples and converts only
//! the region, and a lossless (VP8L) one converts and rescales only the region.
//!
//! Alpha is dropped, as for PNG (and as Pillow's `convert("RGB")` does): the colour channels
//! are the stored ones, not composited on a background. An animated WebP is refused.

use crate::image::{check_declared, ImageError, Rect};

/// What a WebP's header says (`WebPGetFeatures`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Width in pixels (the canvas, for an extended file).
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// The image has an alpha channel (dropped on decode).
    pub alpha: bool,
    /// An animation (refused by [`features`]).
    pub animated: bool,
    /// Lossless (VP8L) rather than lossy (VP8); `false` also for an extended file whose
    /// format libwebp leaves undefined.
    pub lossless: bool,
}

/// Bytes a WebP decode of `pixels` pixels may take: RGB output (3 B/px) plus, for lossless
/// files, the decoder's ARGB image and its transform buffers (4 B/px and rows).
pub(crate) const WEBP_BYTES_PER_PIXEL: u64 = 8;

/// Whether `b` starts like a WebP file: `RIFF`, a size, `WEBP`.
pub fn is_webp(b: &[u8]) -> bool {
    b.len() >= 12 && &b[..4] == b"RIFF" && &b[8..12] == b"WEBP"
}

fn status_text(s: libwebp_sys::VP8StatusCode) -> &'static str {
    use libwebp_sys::VP8StatusCode::*;
    match s {
        VP8_STATUS_OK => "ok",
        VP8_STATUS_OUT_OF_MEMORY => "out of memory",
        VP8_STATUS_INVALID_PARAM => "invalid parameter",
        VP8_STATUS_BITSTREAM_ERROR => "bitstream error",
        VP8_STATUS_UNSUPPORTED_FEATURE => "unsupported feature",
        VP8_STATUS_SUSPENDED => "suspended",
        VP8_STATUS_USER_ABORT => "aborted",
        VP8_STATUS_NOT_ENOUGH_DATA => "not enough data (truncated?)",
    }
}

/// Reads a WebP's features, checking the container: the RIFF chunk must fit the bytes given
/// (a truncated file is refused here, not at decode), and the image must be a still one.
pub fn features(b: &[u8]) -> Result<Features, ImageError> {
    if !is_webp(b) {
        return Err(ImageError::Malformed("not a WebP (no RIFF/WEBP header)".into()));
    }
    let riff = u32::from_le_bytes(b[4..8].try_into().expect("4")) as u64;
    if riff + 8 > b.len() as u64 {
        return Err(ImageError::Malformed(format!(
            "malformed WebP: the RIFF chunk declares {} bytes, the file holds {} (truncated?)",
            riff + 8,
            b.len()
        )));
    }
    // SAFETY: all-zero is a valid `WebPBitstreamFeatures` (plain integers).
    let mut f: libwebp_sys::WebPBitstreamFeatures = unsafe { std::mem::zeroed() };
    // SAFETY: `b` is readable for `b.len()` bytes and `f` is a live, writable struct of the
    // version the binding was generated for.
    let s = unsafe {
        libwebp_sys::WebPGetFeaturesInternal(
            b.as_ptr(),
            b.len(),
            &mut f,
            libwebp_sys::WEBP_DECODER_ABI_VERSION as std::ffi::c_int,
        )
    };
    if s != libwebp_sys::VP8StatusCode::VP8_STATUS_OK {
        return Err(ImageError::Malformed(format!("malformed WebP: {}", status_text(s))));
    }
    let (width, height) = (f.width.max(0) as u32, f.height.max(0) as u32);
    if width == 0 || height == 0 {
        return Err(ImageError::Malformed(format!(
            "malformed WebP: image size {width}x{height}"
        )));
    }
    let out = Features {
        width,
        height,
        alpha: f.has_alpha != 0,
        animated: f.has_animation != 0,
        lossless: f.format == 2,
    };
    if out.animated {
        return Err(ImageError::Unsupported(format!(
            "an animated WebP ({width}x{height}): ramjet decodes still images only"
        )));
    }
    Ok(out)
}

/// A region of an image, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Area {
    /// Left.
    pub x: u32,
    /// Top.
    pub y: u32,
    /// Width.
    pub w: u32,
    /// Height.
    pub h: u32,
}

/// Decodes `area` of the WebP `b` (the whole image when `None`; its corner at even
/// coordinates for a lossy image, whose chroma libwebp would otherwise misalign), scaled to `to` pixels
/// (unscaled when `None`), to interleaved RGB in `out` (resized to fit; its capacity is kept
/// from call to call). Returns the decoded size. `f` is [`features`]' answer for `b`.
pub fn decode(
    b: &[u8],
    f: &Features,
    area: Option<Area>,
    to: Option<(u32, u32)>,
    out: &mut Vec<u8>,
) -> Result<(u32, u32), ImageError> {
    let a = area.unwrap_or(Area {
        x: 0,
        y: 0,
        w: f.width,
        h: f.height,
    });
    if a.w == 0 || a.h == 0 || a.x as u64 + a.w as u64 > f.width as u64 || a.y as u64 + a.h as u64 > f.height as u64 {
        return Err(ImageError::Argument(format!(
            "the region {}x{} at ({}, {}) is not inside the {}x{} WebP",
            a.w, a.h, a.x, a.y, f.width, f.height
        )));
    }
    if area.is_some() && !f.lossless && (a.x % 2 == 1 || a.y % 2 == 1) {
        return Err(ImageError::Argument(format!(
            "a lossy WebP's region starts at ({}, {}): its corner must be even",
            a.x, a.y
        )));
    }
    let (w, h) = to.unwrap_or((a.w, a.h));
    if w == 0 || h == 0 || w > a.w || h > a.h {
        return Err(ImageError::Argument(format!(
            "a WebP region of {}x{} scaled to {w}x{h}: only shrinking is asked",
            a.w, a.h
        )));
    }
    let stride = w as usize * 3;
    out.resize(stride * h as usize, 0);
    let mut c = libwebp_sys::WebPDecoderConfig::new()
        .map_err(|()| ImageError::Codec("libwebp refused its own decoder configuration (ABI mismatch)".into()))?;
    let o = &mut c.options;
    if area.is_some() {
        (o.use_cropping, o.crop_left, o.crop_top) = (1, a.x as i32, a.y as i32);
        (o.crop_width, o.crop_height) = (a.w as i32, a.h as i32);
    }
    if (w, h) != (a.w, a.h) {
        (o.use_scaling, o.scaled_width, o.scaled_height) = (1, w as i32, h as i32);
    }
    c.output.colorspace = libwebp_sys::WEBP_CSP_MODE::MODE_RGB;
    c.output.is_external_memory = 1;
    c.output.u.RGBA = libwebp_sys::WebPRGBABuffer {
        rgba: out.as_mut_ptr(),
        stride: stride as i32,
        size: out.len(),
    };
    // SAFETY: `b` is readable for its length; `c` was initialised by libwebp for this ABI and
    // points its output at `out`, which holds `stride * h` writable bytes and outlives the call.
    // With external memory, libwebp allocates no output buffer, so nothing is left to free.
    let s = unsafe { libwebp_sys::WebPDecode(b.as_ptr(), b.len(), &mut c) };
    if s != libwebp_sys::VP8StatusCode::VP8_STATUS_OK {
        return Err(ImageError::Malformed(format!("malformed WebP: {}", status_text(s))));
    }
    Ok((w, h))
}

/// Decodes the part of a WebP that `crop` (in source pixels) needs into `decoded`: the crop
/// with a margin on every side for the resize filter, scaled by `eighths`/8 inside libwebp
/// (the rule of [`crate::image::dct_eighths`], which keeps the scaled crop at least the
/// output's size). Returns the decoded size and the crop in the decoded pixels.
pub(crate) fn decode_crop(
    b: &[u8],
    crop: &Rect,
    eighths: u32,
    out: (u32, u32),
    decoded: &mut Vec<u8>,
) -> Result<((u32, u32), Rect), ImageError> {
    let f = features(b)?;
    check_declared(f.width, f.height, WEBP_BYTES_PER_PIXEL)?;
    let (fw, fh) = (f.width as f64, f.height as f64);
    // The bilinear filter reaches one output pixel's span, plus two decoded pixels, beyond
    // the crop: in source pixels, that span and two decoded pixels scaled back up.
    let k = 8.0 / eighths.clamp(1, 8) as f64;
    let mx = (crop.w / out.0.max(1) as f64).ceil() + 2.0 * k;
    let my = (crop.h / out.1.max(1) as f64).ceil() + 2.0 * k;
    // Even corners: a lossy WebP's chroma is subsampled 2x2, and libwebp's crop at an odd
    // corner pairs the luma with its neighbour's chroma (a difference of up to 116 measured).
    let x0 = (crop.x - mx).floor().clamp(0.0, fw - 1.0) as u32 & !1;
    let y0 = (crop.y - my).floor().clamp(0.0, fh - 1.0) as u32 & !1;
    let x1 = ((crop.x + crop.w + mx).ceil().min(fw) as u32).max(x0 + 1);
    let y1 = ((crop.y + crop.h + my).ceil().min(fh) as u32).max(y0 + 1);
    let area = Area {
        x: x0,
        y: y0,
        w: x1 - x0,
        h: y1 - y0,
    };
    let to = (eighths < 8).then(|| {
        let s = |n: u32| ((n as u64 * eighths as u64).div_ceil(8) as u32).max(1);
        (s(area.w), s(area.h))
    });
    let whole = area.w == f.width && area.h == f.height && to.is_none();
    let (w, h) = decode(b, &f, (!whole).then_some(area), to, decoded)?;
    let (kx, ky) = (w as f64 / area.w as f64, h as f64 / area.h as f64);
    let rel = Rect {
        x: (crop.x - x0 as f64) * kx,
        y: (crop.y - y0 as f64) * ky,
        w: 0.0,
        h: 0.0,
    };
    let rel = Rect {
        w: (crop.w * kx).min(w as f64 - rel.x),
        h: (crop.h * ky).min(h as f64 - rel.y),
        ..rel
    };
    Ok(((w, h), rel))
}

/// Encodes interleaved RGB (`px`, `w` x `h`) as a WebP: lossy at `quality` (0-100), or
/// lossless when `quality` is `None`. For `ramjet synth` and tests.
pub fn encode_rgb(px: &[u8], w: u32, h: u32, quality: Option<f32>) -> Result<Vec<u8>, ImageError> {
    encode(px, w, h, 3, quality)
}

/// [`encode_rgb`] for RGBA pixels (the alpha is kept in the file).
pub fn encode_rgba(px: &[u8], w: u32, h: u32, quality: Option<f32>) -> Result<Vec<u8>, ImageError> {
    encode(px, w, h, 4, quality)
}

fn encode(px: &[u8], w: u32, h: u32, channels: usize, quality: Option<f32>) -> Result<Vec<u8>, ImageError> {
    if px.len() != w as usize * h as usize * channels || w == 0 || h == 0 || w > 16383 || h > 16383 {
        return Err(ImageError::Argument(format!(
            "{} bytes are not a {w}x{h} image of {channels} channels that WebP can hold",
            px.len()
        )));
    }
    let stride = (w as usize * channels) as i32;
    let mut ptr: *mut u8 = std::ptr::null_mut();
    // SAFETY: `px` holds `h` rows of `stride` bytes; libwebp writes a buffer it allocated to
    // `ptr` and returns its size (0 on failure, `ptr` then unset).
    let n = unsafe {
        match (channels, quality) {
            (3, Some(q)) => libwebp_sys::WebPEncodeRGB(px.as_ptr(), w as i32, h as i32, stride, q, &mut ptr),
            (3, None) => libwebp_sys::WebPEncodeLosslessRGB(px.as_ptr(), w as i32, h as i32, stride, &mut ptr),
            (_, Some(q)) => libwebp_sys::WebPEncodeRGBA(px.as_ptr(), w as i32, h as i32, stride, q, &mut ptr),
            (_, None) => libwebp_sys::WebPEncodeLosslessRGBA(px.as_ptr(), w as i32, h as i32, stride, &mut ptr),
        }
    };
    if n == 0 || ptr.is_null() {
        return Err(ImageError::Codec(format!("libwebp could not encode a {w}x{h} image")));
    }
    // SAFETY: libwebp returned `n` initialised bytes at `ptr`, freed right after the copy with
    // its own deallocator.
    let v = unsafe { std::slice::from_raw_parts(ptr, n) }.to_vec();
    // SAFETY: `ptr` came from a libwebp encoder and is freed once.
    unsafe { libwebp_sys::WebPFree(ptr.cast()) };
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(w: u32, h: u32, channels: usize) -> Vec<u8> {
        (0..h)
            .flat_map(|y| {
                (0..w).flat_map(move |x| [(x * 255 / w) as u8, (y * 255 / h) as u8, 128, 200][..channels].to_vec())
            })
            .collect()
    }

    #[test]
    fn lossless_round_trips_and_a_region_is_the_whole_decode_cut() {
        let px = gradient(96, 64, 3);
        let b = encode_rgb(&px, 96, 64, None).unwrap();
        let f = features(&b).unwrap();
        assert_eq!((f.width, f.height, f.lossless, f.alpha), (96, 64, true, false));
        let mut out = Vec::new();
        assert_eq!(decode(&b, &f, None, None, &mut out).unwrap(), (96, 64));
        assert_eq!(out, px);
        let a = Area {
            x: 7,
            y: 5,
            w: 30,
            h: 20,
        };
        assert_eq!(decode(&b, &f, Some(a), None, &mut out).unwrap(), (30, 20));
        for y in 0..20usize {
            let row = &px[((y + 5) * 96 + 7) * 3..((y + 5) * 96 + 37) * 3];
            assert_eq!(&out[y * 90..(y + 1) * 90], row, "row {y}");
        }
        assert_eq!(decode(&b, &f, Some(a), Some((15, 10)), &mut out).unwrap(), (15, 10));
        assert_eq!(out.len(), 15 * 10 * 3);
    }

    #[test]
    fn alpha_is_dropped_and_damage_is_named() {
        let px = gradient(32, 32, 4);
        let b = encode_rgba(&px, 32, 32, None).unwrap();
        let f = features(&b).unwrap();
        assert!(f.alpha);
        let mut out = Vec::new();
        decode(&b, &f, None, None, &mut out).unwrap();
        let rgb: Vec<u8> = px.chunks(4).flat_map(|p| [p[0], p[1], p[2]]).collect();
        assert_eq!(out, rgb);
        let cut = &b[..b.len() - 10];
        assert!(features(cut).unwrap_err().contains("truncated"));
        let mut bad = b.clone();
        let n = bad.len();
        bad[20..n].iter_mut().for_each(|x| *x ^= 0x5a);
        assert!(features(&bad).is_err() || decode(&bad, &f, None, None, &mut out).is_err());
        let outside = Area {
            x: 20,
            y: 0,
            w: 20,
            h: 4,
        };
        assert!(decode(&b, &f, Some(outside), None, &mut out)
            .unwrap_err()
            .contains("not inside"));
    }

    #[test]
    fn lossy_decodes_close_to_the_source() {
        let px = gradient(128, 96, 3);
        let b = encode_rgb(&px, 128, 96, Some(90.0)).unwrap();
        let f = features(&b).unwrap();
        assert!(!f.lossless);
        let mut out = Vec::new();
        decode(&b, &f, None, None, &mut out).unwrap();
        let err: u64 = out
            .iter()
            .zip(&px)
            .map(|(&a, &b)| (a as i64 - b as i64).unsigned_abs())
            .sum();
        assert!(
            err / (px.len() as u64) < 4,
            "mean error {}",
            err as f64 / px.len() as f64
        );
    }

    /// `process` of `b` (crop decoded, maybe scaled, in libwebp) against the whole image
    /// decoded, then the same crop resized the same way: the worst and the mean difference
    /// over 20 samples, and the scales the crops took.
    fn against_the_whole_decode(b: &[u8], size: u32, dct: bool) -> (u8, f64, std::collections::BTreeSet<u32>) {
        use crate::image::{dct_eighths, plan, process, ImageSpec, SampleRng, Scratch, Slot};
        let f = features(b).unwrap();
        let mut full = Vec::new();
        decode(b, &f, None, None, &mut full).unwrap();
        let mut spec = ImageSpec::train(size);
        spec.dct_scaling = dct;
        let (mut worst, mut sum, mut n, mut scales) = (0u8, 0u64, 0u64, std::collections::BTreeSet::new());
        let mut s = Scratch::default();
        for i in 0..20 {
            let mut got = vec![0u8; spec.elems()];
            process(b, &spec, &mut SampleRng::new(3, 0, 0, i), Slot::U8(&mut got), &mut s).unwrap();
            let p = plan(&spec, f.width, f.height, &mut SampleRng::new(3, 0, 0, i));
            scales.insert(dct_eighths(&spec, crate::image::probe::ImageFormat::Webp, &p.crop));
            let want = crate::image::tests::reference_sample(&full, (f.width, f.height), &p.crop, p.flip, &spec);
            for (a, b) in got.iter().zip(&want) {
                worst = worst.max(a.abs_diff(*b));
                sum += a.abs_diff(*b) as u64;
                n += 1;
            }
        }
        (worst, sum as f64 / n as f64, scales)
    }

    fn structured(w: u32, h: u32) -> Vec<u8> {
        (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(x / 4) as u8, (y / 3) as u8, ((x ^ y) & 0xFF) as u8]))
            .collect()
    }

    #[test]
    fn a_crop_decode_is_the_whole_decode_cropped() {
        let px = structured(900, 700);
        let lossless = encode_rgb(&px, 900, 700, None).unwrap();
        let lossy = encode_rgb(&px, 900, 700, Some(90.0)).unwrap();
        for (name, b) in [("lossless", &lossless), ("lossy", &lossy)] {
            for (size, dct) in [(64u32, true), (64, false), (224, false), (224, true)] {
                let (worst, mean, scales) = against_the_whole_decode(b, size, dct);
                let label = format!("{name} {size} dct {dct}: worst {worst} mean {mean:.3} scales {scales:?}");
                if dct {
                    // Scaled inside libwebp (its rescaler, and no loop filter below 3/4 of the
                    // size): close to the full decode's resize, and more than one scale used.
                    assert!(mean < 1.5 && scales.len() >= 2, "{label}");
                } else {
                    // The region's pixels are the whole decode's own: the same bytes.
                    assert_eq!(worst, 0, "{label}");
                }
            }
        }
    }
}
