//! Image decode and augmentation, on CPU, into one slot of a batch.
//!
//! The crop is chosen in source coordinates from the header alone, before any pixel is
//! decoded. That lets the decoder skip work: JPEG is decoded at the smallest DCT scale
//! (1/8, 1/4, 1/2) that still leaves the crop at least as large as the output, and only the
//! region that covers the crop ([`turbo`]). The crop is then resized (antialiased
//! bilinear, as Pillow and torchvision do) and written channel-first, flipped and normalised
//! in the same pass.
//!
//! Every random choice comes from a generator keyed by (seed, epoch, stream, sample), so a
//! resumed run replays identical pixels. See `docs/order.md`.
//!
//! Submodules: [`probe`] reads an encoded image's format and size from its header, [`turbo`]
//! is the libjpeg-turbo binding (decode, encode, restart-marker transcoding), and [`error`]
//! holds [`ImageError`], the one error type of all of them.

pub mod error;
pub mod exif;
pub mod frame;
pub mod gpu_batch;
pub mod probe;
pub mod route;
pub mod split;
pub mod turbo;
pub mod webp;

pub use error::ImageError;

use std::panic::AssertUnwindSafe;

use fast_image_resize::images::{Image as FirImage, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::image::exif::Orientation;
use crate::image::probe::{probe, ImageFormat, ImageInfo};
#[cfg(test)]
use crate::image::turbo::cut_at_restarts;
use crate::image::turbo::{encode_rgb, scaled, Header, Region, Transcoder, TurboJpeg, JPEG_RESTART_PX};

/// Decompression-bomb limit on declared pixels: an image whose header claims more is refused
/// before anything is allocated. 2^26 is 8192 x 8192, above any training image in practice.
pub const DECODE_PIXELS_MAX: u64 = 1 << 26;

/// Decompression-bomb limit on the memory one decode may take (output plus the decoder's own
/// buffers, estimated from the declared size before decoding): 384 MiB, which binds before the
/// pixel limit for progressive JPEGs above about 45 MP and RGBA PNGs above about 57 MP.
pub const DECODE_BYTES_MAX: u64 = 384 << 20;

/// Bytes a JPEG decode of `pixels` pixels may take: RGB output (3 B/px) plus, for progressive
/// files, 16-bit DCT coefficients of three components (6 B/px).
const JPEG_BYTES_PER_PIXEL: u64 = 9;

/// How a training or evaluation image becomes the output rectangle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Augment {
    /// torchvision's RandomResizedCrop: a random area fraction in `scale` and aspect ratio
    /// in `ratio`, resized to the output; then a horizontal flip with probability `flip`.
    RandomResizedCrop {
        /// Area fraction range of the crop.
        scale: (f32, f32),
        /// Aspect-ratio range (width / height) of the crop.
        ratio: (f32, f32),
        /// Probability of a horizontal flip.
        flip: f32,
    },
    /// Evaluation: resize the shorter side to `output / crop_fraction`, then take the center
    /// crop of the output size (torchvision's `Resize(256)` + `CenterCrop(224)` for 0.875).
    CenterCrop {
        /// Fraction of the resized image the crop keeps (0.875 for 224 of 256).
        crop_fraction: f32,
    },
    /// Resize the whole image to the output size, ignoring aspect ratio.
    Resize,
}

/// Output element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    /// uint8, values as decoded.
    U8,
    /// float32, `(x / 255 - mean) / std` per channel.
    F32,
}

/// What a decoded image becomes. Deserialized from [`ImageConfig`]'s flat form.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(from = "ImageConfig")]
pub struct ImageSpec {
    /// Output width.
    pub width: u32,
    /// Output height.
    pub height: u32,
    /// Crop and flip.
    pub augment: Augment,
    /// Element type.
    pub out: OutType,
    /// Per-channel mean for `OutType::F32`.
    pub mean: [f32; 3],
    /// Per-channel standard deviation for `OutType::F32`.
    pub std: [f32; 3],
    /// Decode JPEG at a reduced DCT scale (1/2, 1/4, 1/8) when the crop is at least twice the
    /// output: the smallest that keeps the crop at least the output's size.
    pub dct_scaling: bool,
    /// Show the image as its EXIF orientation says (JPEG, WebP, PNG) before the crop, as
    /// Pillow's `exif_transpose` does; off, the stored pixels as they are.
    pub exif_orientation: bool,
}

impl ImageSpec {
    /// Training defaults: RandomResizedCrop(size) + horizontal flip, uint8 output.
    pub fn train(size: u32) -> Self {
        ImageConfig {
            width: size,
            height: size,
            ..ImageConfig::default()
        }
        .into()
    }

    /// Evaluation defaults: resize to size/0.875 and center-crop size, uint8 output.
    pub fn eval(size: u32) -> Self {
        ImageConfig {
            width: size,
            height: size,
            augment: AugmentName::Eval,
            ..ImageConfig::default()
        }
        .into()
    }

    /// Elements per image (3 x height x width).
    pub fn elems(&self) -> usize {
        3 * self.width as usize * self.height as usize
    }

    /// Bytes per image.
    pub fn bytes(&self) -> usize {
        self.bytes_at(self.height, self.width)
    }

    /// Bytes of one image of `height` x `width` with this output type (an aspect-ratio
    /// bucket's size in place of this one's).
    pub fn bytes_at(&self, height: u32, width: u32) -> usize {
        3 * height as usize * width as usize * if self.out == OutType::U8 { 1 } else { 4 }
    }
}

/// The augmentation, by name, in [`ImageConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AugmentName {
    /// [`Augment::RandomResizedCrop`] with `scale`, `ratio`, `flip`.
    #[default]
    Train,
    /// [`Augment::CenterCrop`] with `crop_fraction`.
    Eval,
    /// [`Augment::Resize`].
    Resize,
}

/// An [`ImageSpec`] in flat form, with every default in one place (the Python package's
/// `StreamingDataset` defaults are checked against these by a test).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ImageConfig {
    /// Output width.
    pub width: u32,
    /// Output height.
    pub height: u32,
    /// `train`, `eval` or `resize`.
    pub augment: AugmentName,
    /// Train: area fraction range of the crop.
    pub scale: (f32, f32),
    /// Train: aspect-ratio range of the crop.
    pub ratio: (f32, f32),
    /// Train: probability of a horizontal flip.
    pub flip: f32,
    /// Eval: fraction of the resized image the center crop keeps.
    pub crop_fraction: f32,
    /// float32 output, normalised with `mean` and `std` (else uint8).
    pub float: bool,
    /// Per-channel mean for float output.
    pub mean: [f32; 3],
    /// Per-channel standard deviation for float output.
    pub std: [f32; 3],
    /// Decode JPEG at a reduced DCT scale (1/2, 1/4, 1/8) when the crop is at least twice the
    /// output: the smallest that keeps the crop at least the output's size.
    pub dct_scaling: bool,
    /// Apply the EXIF orientation before the crop.
    pub exif_orientation: bool,
}

impl Default for ImageConfig {
    fn default() -> Self {
        ImageConfig {
            width: 224,
            height: 224,
            augment: AugmentName::Train,
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
            flip: 0.5,
            crop_fraction: 0.875,
            float: false,
            mean: [0.485, 0.456, 0.406],
            std: [0.229, 0.224, 0.225],
            dct_scaling: true,
            exif_orientation: true,
        }
    }
}

impl From<ImageConfig> for ImageSpec {
    fn from(c: ImageConfig) -> ImageSpec {
        ImageSpec {
            width: c.width,
            height: c.height,
            augment: match c.augment {
                AugmentName::Train => Augment::RandomResizedCrop {
                    scale: c.scale,
                    ratio: c.ratio,
                    flip: c.flip,
                },
                AugmentName::Eval => Augment::CenterCrop {
                    crop_fraction: c.crop_fraction,
                },
                AugmentName::Resize => Augment::Resize,
            },
            out: if c.float { OutType::F32 } else { OutType::U8 },
            mean: c.mean,
            std: c.std,
            dct_scaling: c.dct_scaling,
            exif_orientation: c.exif_orientation,
        }
    }
}

/// The deterministic generator of one sample's random choices (splitmix64).
#[derive(Debug, Clone)]
pub struct SampleRng(u64);

impl SampleRng {
    /// The generator of (seed, epoch, stream, sample).
    pub fn new(seed: u64, epoch: u64, stream: u32, sample: u64) -> Self {
        let mut key = [0u8; 28];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&epoch.to_le_bytes());
        key[16..20].copy_from_slice(&stream.to_le_bytes());
        key[20..].copy_from_slice(&sample.to_le_bytes());
        Self(xxhash_rust::xxh3::xxh3_64_with_seed(&key, 0x5241_4d4a_4155_4721))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in [0, n] (inclusive).
    pub fn upto(&mut self, n: u32) -> u32 {
        (self.next_u64() % (n as u64 + 1)) as u32
    }
}

/// A rectangle in source pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rect {
    /// Left.
    pub x: f64,
    /// Top.
    pub y: f64,
    /// Width.
    pub w: f64,
    /// Height.
    pub h: f64,
}

/// The geometric decisions for one image.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    /// Source rectangle that becomes the output.
    pub crop: Rect,
    /// Mirror horizontally.
    pub flip: bool,
}

/// Chooses crop and flip for an image of `w` x `h` (torchvision's algorithms).
pub fn plan(spec: &ImageSpec, w: u32, h: u32, rng: &mut SampleRng) -> Plan {
    let (wf, hf) = (w as f64, h as f64);
    match spec.augment {
        Augment::RandomResizedCrop { scale, ratio, flip } => {
            let area = wf * hf;
            let (lr0, lr1) = ((ratio.0 as f64).ln(), (ratio.1 as f64).ln());
            let mut crop = None;
            for _ in 0..10 {
                let target = area * rng.uniform(scale.0 as f64, scale.1 as f64);
                let aspect = rng.uniform(lr0, lr1).exp();
                let cw = (target * aspect).sqrt().round();
                let ch = (target / aspect).sqrt().round();
                if cw > 0.0 && ch > 0.0 && cw <= wf && ch <= hf {
                    let x = rng.upto((wf - cw) as u32) as f64;
                    let y = rng.upto((hf - ch) as u32) as f64;
                    crop = Some(Rect { x, y, w: cw, h: ch });
                    break;
                }
            }
            let crop = crop.unwrap_or_else(|| {
                // Fallback: the whole image, clamped to the ratio range, centered.
                let r = wf / hf;
                let (cw, ch) = if r < ratio.0 as f64 {
                    (wf, (wf / ratio.0 as f64).round())
                } else if r > ratio.1 as f64 {
                    ((hf * ratio.1 as f64).round(), hf)
                } else {
                    (wf, hf)
                };
                Rect {
                    x: ((wf - cw) / 2.0).floor(),
                    y: ((hf - ch) / 2.0).floor(),
                    w: cw,
                    h: ch,
                }
            });
            let flip = (rng.unit() as f32) < flip;
            Plan { crop, flip }
        }
        Augment::CenterCrop { crop_fraction } => {
            // Resize so the shorter side is out/fraction, then crop out: in source pixels,
            // the crop is out * (source short side / resized short side) wide.
            let out_short = spec.width.min(spec.height) as f64;
            let resized_short = (out_short / crop_fraction as f64).round();
            let k = wf.min(hf) / resized_short;
            let (cw, ch) = ((spec.width as f64 * k).min(wf), (spec.height as f64 * k).min(hf));
            Plan {
                crop: Rect {
                    x: (wf - cw) / 2.0,
                    y: (hf - ch) / 2.0,
                    w: cw,
                    h: ch,
                },
                flip: false,
            }
        }
        Augment::Resize => Plan {
            crop: Rect {
                x: 0.0,
                y: 0.0,
                w: wf,
                h: hf,
            },
            flip: false,
        },
    }
}

/// A decoded RGB image (interleaved, 3 bytes per pixel).
#[derive(Debug, Clone, Default)]
pub struct Rgb {
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
    /// Pixels.
    pub data: Vec<u8>,
}

/// Decodes an image to RGB. `denom` (1, 2, 4 or 8) asks for a DCT-domain downscale
/// (JPEG only; other formats decode at full size). `rows` asks for only the rows [top,
/// bottom) of the scaled image (JPEG only): the result then holds those rows alone, and its
/// size tells what was produced.
pub fn decode_rgb(bytes: &[u8], denom: u32, rows: Option<(u32, u32)>) -> Result<Rgb, ImageError> {
    let info = probe(bytes)?;
    check_declared(info.width, info.height, JPEG_BYTES_PER_PIXEL)?;
    match info.format {
        ImageFormat::Jpeg => TURBO.with(|t| {
            let mut t = t.borrow_mut();
            let (t, hdr) = jpeg_header(&mut t, bytes)?;
            if ![1, 2, 4, 8].contains(&denom) {
                return Err(ImageError::Argument(format!(
                    "JPEG scale 1/{denom} is not 1, 1/2, 1/4 or 1/8"
                )));
            }
            let eighths = 8 / denom;
            let sh = scaled(hdr.height, eighths);
            let region = rows.map(|(top, bottom)| {
                let top = top.min(sh.saturating_sub(1));
                Region {
                    x: 0,
                    y: top,
                    w: scaled(hdr.width, eighths),
                    h: bottom.clamp(top + 1, sh) - top,
                }
            });
            let mut data = Vec::new();
            let r = t.decode(bytes, &hdr, eighths, region, &mut data)?;
            Ok(Rgb {
                width: r.w,
                height: r.h,
                data,
            })
        }),
        ImageFormat::Webp => {
            let f = webp::features(bytes)?;
            let mut data = Vec::new();
            let (width, height) = webp::decode(bytes, &f, None, None, &mut data)?;
            Ok(Rgb { width, height, data })
        }
        // The PNG decoder is third-party Rust fed untrusted bytes: a panic in it is a decode
        // error of this sample, not a crash of the process.
        ImageFormat::Png => std::panic::catch_unwind(AssertUnwindSafe(|| decode_png(bytes)))
            .unwrap_or_else(|_| Err(ImageError::Malformed("the decoder failed on malformed data".into()))),
    }
}

/// Decodes a whole image to RGB as orientation `o` shows it (`decode_rgb`, then turned or
/// mirrored).
pub fn decode_shown(bytes: &[u8], o: Orientation) -> Result<Rgb, ImageError> {
    let rgb = decode_rgb(bytes, 1, None)?;
    if o == Orientation::UP {
        return Ok(rgb);
    }
    let (w, h) = (rgb.width as usize, rgb.height as usize);
    let (dw, dh) = o.displayed(rgb.width, rgb.height);
    let mut data = vec![0u8; w * h * 3];
    for y in 0..dh as usize {
        for x in 0..dw as usize {
            let (sx, sy) = o.source(x, y, w, h);
            let (d, s) = ((y * dw as usize + x) * 3, (sy * w + sx) * 3);
            data[d..d + 3].copy_from_slice(&rgb.data[s..s + 3]);
        }
    }
    Ok(Rgb {
        width: dw,
        height: dh,
        data,
    })
}

/// The JPEG's header as libjpeg-turbo reads it, refused like `probe`'s when it declares more
/// than the decode limits; `turbo` is made on first use.
fn jpeg_header<'t>(turbo: &'t mut Option<TurboJpeg>, bytes: &[u8]) -> Result<(&'t mut TurboJpeg, Header), ImageError> {
    if turbo.is_none() {
        *turbo = Some(TurboJpeg::new()?);
    }
    let t = turbo.as_mut().expect("set just above");
    let hdr = t.header(bytes)?;
    // The decoder's own header may disagree with what `probe` read: check it again.
    check_declared(hdr.width, hdr.height, JPEG_BYTES_PER_PIXEL)?;
    Ok((t, hdr))
}

thread_local! {
    /// [`decode_rgb`]'s JPEG decompressor, one per thread.
    static TURBO: std::cell::RefCell<Option<TurboJpeg>> = const { std::cell::RefCell::new(None) };
}

/// Refuses a declared size above the pixel or memory limit, before any allocation.
pub(crate) fn check_declared(width: u32, height: u32, bytes_per_pixel: u64) -> Result<(), ImageError> {
    let px = width as u64 * height as u64;
    if px > DECODE_PIXELS_MAX {
        return Err(ImageError::TooLarge(format!(
            "image declares {width}x{height} pixels, above the {DECODE_PIXELS_MAX}-pixel decode limit (decompression bomb?)"
        )));
    }
    if px * bytes_per_pixel > DECODE_BYTES_MAX {
        return Err(ImageError::TooLarge(format!(
            "image declares {width}x{height} pixels, whose decode would take over the {DECODE_BYTES_MAX}-byte memory limit"
        )));
    }
    Ok(())
}

fn decode_png(bytes: &[u8]) -> Result<Rgb, ImageError> {
    let limits = png::Limits {
        bytes: DECODE_BYTES_MAX as usize,
    };
    let mut dec = png::Decoder::new_with_limits(std::io::Cursor::new(bytes), limits);
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut r = dec
        .read_info()
        .map_err(|e| ImageError::Malformed(format!("malformed PNG: {e}")))?;
    let (w, h) = (r.info().width, r.info().height);
    let need = r.output_buffer_size() as u64 + w as u64 * h as u64 * 3;
    check_declared(w, h, 0)?;
    if need > DECODE_BYTES_MAX {
        return Err(ImageError::TooLarge(format!(
            "PNG declares {w}x{h} pixels, whose decode would take {need} bytes, over the {DECODE_BYTES_MAX}-byte memory limit"
        )));
    }
    let mut buf = vec![0u8; r.output_buffer_size()];
    let f = r
        .next_frame(&mut buf)
        .map_err(|e| ImageError::Malformed(format!("malformed PNG: {e}")))?;
    let (w, h) = (f.width, f.height);
    let px = (w * h) as usize;
    let src = &buf[..f.buffer_size()];
    let data = match f.color_type {
        png::ColorType::Rgb => src[..px * 3].to_vec(),
        png::ColorType::Rgba => src.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => src.iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => src.chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => return Err(ImageError::Codec("malformed PNG: palette was not expanded".into())),
    };
    Ok(Rgb {
        width: w,
        height: h,
        data,
    })
}

/// Per-thread buffers and decoder, reused from image to image.
#[derive(Default)]
pub struct Scratch {
    resizer: Resizer,
    resized: Vec<u8>,
    decoded: Vec<u8>,
    turbo: Option<TurboJpeg>,
    /// [`prime`] ran on this scratch.
    primed: bool,
}

/// Buffers for one image's output outside a batch, grown to a spec's size on use.
#[derive(Debug, Default)]
pub struct OutBufs {
    /// The uint8 output.
    pub u8s: Vec<u8>,
    /// The float32 output.
    pub f32s: Vec<f32>,
}

impl OutBufs {
    /// The slot of `spec`'s element type, `spec.elems()` long.
    pub fn slot(&mut self, spec: &ImageSpec) -> Slot<'_> {
        match spec.out {
            OutType::U8 => {
                self.u8s.resize(spec.elems(), 0);
                Slot::U8(&mut self.u8s)
            }
            OutType::F32 => {
                self.f32s.resize(spec.elems(), 0.0);
                Slot::F32(&mut self.f32s)
            }
        }
    }
}

/// The output slot of one image in a batch.
pub enum Slot<'a> {
    /// uint8 CHW.
    U8(&'a mut [u8]),
    /// float32 CHW.
    F32(&'a mut [f32]),
}

/// Readies a decode thread's `scratch` for `spec`'s images before its first real one: a
/// synthetic JPEG twice the output's size each way (the largest region a crop decodes, given
/// the DCT scale [`dct_eighths`] picks) goes through [`process`] twice, as given and cut at
/// restart markers. So the first real image no longer also pays for libjpeg-turbo's set-up,
/// the buffers' first growth and the first touch of their pages, which in a fresh process on
/// a VM can cost several microseconds a page. The loader runs it on the decode threads while
/// the first batch is still being read. A scratch is primed once: `Ok(false)` says it was
/// already.
pub fn prime(spec: &ImageSpec, scratch: &mut Scratch) -> Result<bool, ImageError> {
    if scratch.primed {
        return Ok(false);
    }
    scratch.primed = true;
    let (w, h) = ((spec.width * 2).clamp(16, 2048), (spec.height * 2).clamp(16, 2048));
    // A gradient with some noise, so that the entropy decode has real work.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let px: Vec<u8> = (0..w as usize * h as usize * 3)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((i / 3 % w as usize) as u8).wrapping_add((x >> 61) as u8)
        })
        .collect();
    let plain = encode_rgb(&px, w, h, 90)?;
    let cut = Transcoder::new()?.with_restarts(&plain, JPEG_RESTART_PX)?;
    let mut out = OutBufs::default();
    for (i, jpeg) in [&plain, &cut].into_iter().enumerate() {
        let mut rng = SampleRng::new(0, 0, 0, i as u64);
        process(jpeg, spec, &mut rng, out.slot(spec), scratch)?;
    }
    // The largest region a crop decodes: just under twice the output each way, plus the
    // filter's margin and an iMCU column.
    let most = (w as usize + 64) * (h as usize + 64) * 3;
    if scratch.decoded.len() < most {
        scratch.decoded.resize(most, 0);
    }
    Ok(true)
}

/// A buffer the resizer refused (a size that does not match its pixels).
fn resizer_err(e: impl std::fmt::Display) -> ImageError {
    ImageError::Codec(e.to_string())
}

/// Decodes `bytes`, applies `spec` with the random choices of `rng`, and writes the result
/// channel-first into `slot`. Returns the decoded source size.
pub fn process(
    bytes: &[u8],
    spec: &ImageSpec,
    rng: &mut SampleRng,
    slot: Slot<'_>,
    scratch: &mut Scratch,
) -> Result<ImageInfo, ImageError> {
    let info = probe(bytes)?;
    let o = if spec.exif_orientation {
        exif::orientation(bytes)
    } else {
        Orientation::UP
    };
    // The plan is made on the image as shown; the decode and the resize work on the stored
    // pixels (the crop mapped back, the output's sides swapped for a quarter turn), and the
    // planar write shows the result.
    let (dw, dh) = o.displayed(info.width, info.height);
    let p = plan(spec, dw, dh, rng);
    let stored = o.stored_rect(&p.crop, info.width as f64, info.height as f64);
    let (ow, oh) = o.displayed(spec.width, spec.height);
    let eighths = eighths_for(spec, info.format, &stored, (ow, oh));
    let Scratch {
        resizer,
        resized,
        decoded,
        turbo,
        primed: _,
    } = scratch;
    let (src, crop) = if info.format == ImageFormat::Jpeg {
        decode_jpeg_crop(bytes, &info, &stored, eighths, (ow, oh), turbo, decoded)?
    } else if info.format == ImageFormat::Webp {
        let ((w, h), crop) = webp::decode_crop(bytes, &stored, eighths, (ow, oh), decoded)?;
        (
            ImageRef::new(w, h, decoded, PixelType::U8x3).map_err(resizer_err)?,
            crop,
        )
    } else {
        *decoded = decode_rgb(bytes, 1, None)?.data;
        let src = ImageRef::new(info.width, info.height, decoded, PixelType::U8x3).map_err(resizer_err)?;
        (src, stored)
    };
    let n = (ow * oh * 3) as usize;
    resized.resize(n, 0);
    let mut dst = FirImage::from_slice_u8(ow, oh, resized, PixelType::U8x3).map_err(resizer_err)?;
    let opts = ResizeOptions::new()
        .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
        .crop(crop.x, crop.y, crop.w, crop.h);
    resizer
        .resize(&src, &mut dst, &opts)
        .map_err(|e| ImageError::Codec(format!("resize failed: {e}")))?;
    write_chw(resized, ow as usize, oh as usize, o.mirrored_if(p.flip), spec, slot);
    Ok(info)
}

/// The DCT scale, in eighths, a JPEG is decoded at: the smallest of 1/8, 1/4 and 1/2 that
/// keeps the crop at least as large as the output, so the resize still only shrinks; 8 (none)
/// without `dct_scaling`, for PNG, and for crops under twice the output. A WebP's crop is
/// scaled by the same rule inside libwebp's decode ([`webp::decode_crop`]). (libjpeg-turbo
/// also scales by 3/8, 5/8, 6/8 and 7/8, but those IDCTs have no SIMD code: a region decode at
/// them ran at 0.82x the rate of one at the next power of two up, `decode_rate`.)
pub(crate) fn dct_eighths(spec: &ImageSpec, format: ImageFormat, crop: &Rect) -> u32 {
    eighths_for(spec, format, crop, (spec.width, spec.height))
}

/// [`dct_eighths`] for an output of `out` pixels (the spec's, sides swapped for a stored
/// crop that a quarter turn shows).
fn eighths_for(spec: &ImageSpec, format: ImageFormat, crop: &Rect, out: (u32, u32)) -> u32 {
    if !spec.dct_scaling || format == ImageFormat::Png {
        return 8;
    }
    [1, 2, 4]
        .into_iter()
        .find(|&e| crop.w * e as f64 / 8.0 >= out.0 as f64 && crop.h * e as f64 / 8.0 >= out.1 as f64)
        .unwrap_or(8)
}

/// Decodes the part of a JPEG that a crop needs, at `eighths`/8 scale, into `decoded`:
/// the crop's rows and (rounded to iMCU columns) its columns, with a margin of a few pixels
/// on every side for the resize filter. Returns the decoded pixels and the crop in their
/// coordinates.
fn decode_jpeg_crop<'s>(
    bytes: &[u8],
    info: &ImageInfo,
    crop: &Rect,
    eighths: u32,
    out: (u32, u32),
    turbo: &mut Option<TurboJpeg>,
    decoded: &'s mut Vec<u8>,
) -> Result<(ImageRef<'s>, Rect), ImageError> {
    let (t, hdr) = jpeg_header(turbo, bytes)?;
    if (hdr.width, hdr.height) != (info.width, info.height) {
        return Err(ImageError::Malformed(format!(
            "malformed JPEG: frame headers disagree ({}x{} and {}x{})",
            info.width, info.height, hdr.width, hdr.height
        )));
    }
    // The crop in the scaled image (libjpeg-turbo rounds scaled sizes up).
    let (sw, sh) = (scaled(hdr.width, eighths), scaled(hdr.height, eighths));
    let (kx, ky) = (sw as f64 / hdr.width as f64, sh as f64 / hdr.height as f64);
    let c = Rect {
        x: crop.x * kx,
        y: crop.y * ky,
        w: crop.w * kx,
        h: crop.h * ky,
    };
    // The bilinear filter reaches one output pixel's span (plus rounding) beyond the crop.
    let mx = (c.w / out.0 as f64).ceil() + 2.0;
    let my = (c.h / out.1 as f64).ceil() + 2.0;
    let x0 = (c.x - mx).floor().max(0.0) as u32;
    let y0 = (c.y - my).floor().max(0.0) as u32;
    let x1 = ((c.x + c.w + mx).ceil() as u32).clamp(x0 + 1, sw);
    let y1 = ((c.y + c.h + my).ceil() as u32).clamp(y0 + 1, sh);
    let want = Region {
        x: x0,
        y: y0,
        w: x1 - x0,
        h: y1 - y0,
    };
    let got = t.decode(bytes, &hdr, eighths, Some(want), decoded)?;
    let rel = Rect {
        x: c.x - got.x as f64,
        y: c.y - got.y as f64,
        w: c.w.min(got.w as f64 - (c.x - got.x as f64)),
        h: c.h.min(got.h as f64 - (c.y - got.y as f64)),
    };
    let src = ImageRef::new(got.w, got.h, decoded, PixelType::U8x3).map_err(resizer_err)?;
    Ok((src, rel))
}

/// Interleaved RGB (`w` x `h`, as stored) to planar CHW shown in orientation `o` (the EXIF
/// orientation composed with the random flip: `o.displayed(w, h)` is the slot's size),
/// converted to the slot's type.
pub(crate) fn write_chw(hwc: &[u8], w: usize, h: usize, o: Orientation, spec: &ImageSpec, slot: Slot<'_>) {
    match slot {
        Slot::U8(out) => planar_u8(hwc, w, h, o, out),
        Slot::F32(out) => {
            // One multiply-add per element: (x / 255 - mean) / std = x * a + k.
            let a: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * spec.std[c]));
            let k: [f32; 3] = std::array::from_fn(|c| -spec.mean[c] / spec.std[c]);
            planar(hwc, w, h, o, out, |c, v| v as f32 * a[c] + k[c])
        }
    }
}

/// [`planar`] for uint8 output: 16 pixels at a time with byte shuffles where the CPU has
/// SSSE3 ([`deinterleave`]), the rest of each row as [`planar`] does it. The same bytes either
/// way (`the_shuffled_planar_write_is_the_scalar_one`); the scalar loop cost 6% of a warm
/// loader's CPU (docs/benchmarks-history.md, "The quick run's verdicts, and the run-on").
fn planar_u8(hwc: &[u8], w: usize, h: usize, o: Orientation, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if deinterleave::available() && !o.transposed() {
        let (flip, upside_down) = rows_of(o);
        let plane = w * h;
        let (r, rest) = out.split_at_mut(plane);
        let (g, b) = rest.split_at_mut(plane);
        for y in 0..h {
            let sy = if upside_down { h - 1 - y } else { y };
            let (src, o) = (&hwc[sy * w * 3..(sy + 1) * w * 3], y * w);
            let (r, g, b) = (&mut r[o..o + w], &mut g[o..o + w], &mut b[o..o + w]);
            // SAFETY: `available` said this CPU has SSSE3, the one feature `row` enables.
            let done = unsafe { deinterleave::row(src, r, g, b, flip) };
            for x in done..w {
                let ox = if flip { w - 1 - x } else { x };
                (r[ox], g[ox], b[ox]) = (src[3 * x], src[3 * x + 1], src[3 * x + 2]);
            }
        }
        return;
    }
    planar(hwc, w, h, o, out, |_, v| v)
}

/// For an orientation that keeps rows rows (1 to 4): whether each row is mirrored, and
/// whether the rows come bottom first.
fn rows_of(o: Orientation) -> (bool, bool) {
    match o.value() {
        2 => (true, false),
        3 => (true, true),
        4 => (false, true),
        _ => (false, false),
    }
}

/// Interleaved RGB to planes with SSSE3: each 16 pixels (48 bytes, three 16-byte loads) give
/// 16 bytes of each plane, each the OR of three `pshufb`s of the loads.
#[cfg(target_arch = "x86_64")]
mod deinterleave {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_or_si128, _mm_shuffle_epi8, _mm_storeu_si128};

    /// `m[c][k][j]`: where output byte `j` of channel `c` sits in load `k` (bytes 16k..16k+16
    /// of the 48), or 0x80 (`pshufb` then writes 0) where it sits in another load. Mirrored:
    /// output byte `j` is pixel 15 - j.
    const fn masks(mirrored: bool) -> [[[u8; 16]; 3]; 3] {
        let mut m = [[[0x80u8; 16]; 3]; 3];
        let mut c = 0;
        while c < 3 {
            let mut j = 0;
            while j < 16 {
                let at = 3 * (if mirrored { 15 - j } else { j }) + c;
                m[c][at / 16][j] = (at % 16) as u8;
                j += 1;
            }
            c += 1;
        }
        m
    }
    const FORWARD: [[[u8; 16]; 3]; 3] = masks(false);
    const MIRRORED: [[[u8; 16]; 3]; 3] = masks(true);

    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("ssse3")
    }

    /// Writes pixels `0..n` of one row into its planes `r`, `g`, `b` (mirrored if `flip`:
    /// pixel x to w - 1 - x), n the largest multiple of 16 up to the width; returns n.
    /// `src` holds 3 bytes a pixel, the planes one each.
    #[target_feature(enable = "ssse3")]
    pub(super) fn row(src: &[u8], r: &mut [u8], g: &mut [u8], b: &mut [u8], flip: bool) -> usize {
        let w = r.len();
        assert!(
            src.len() == 3 * w && g.len() == w && b.len() == w,
            "a row and its planes"
        );
        let masks = if flip { &MIRRORED } else { &FORWARD };
        let m = masks.map(|c| c.map(|k| load(&k)));
        let n = w / 16 * 16;
        for x in (0..n).step_by(16) {
            let s = &src[3 * x..3 * x + 48];
            let v = [load(&s[..16]), load(&s[16..32]), load(&s[32..48])];
            let o = if flip { w - 16 - x } else { x };
            for (c, plane) in [&mut *r, &mut *g, &mut *b].into_iter().enumerate() {
                let got = _mm_or_si128(
                    _mm_or_si128(_mm_shuffle_epi8(v[0], m[c][0]), _mm_shuffle_epi8(v[1], m[c][1])),
                    _mm_shuffle_epi8(v[2], m[c][2]),
                );
                let dst = &mut plane[o..o + 16];
                // SAFETY: `dst` is 16 bytes long; the store is unaligned.
                unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), got) };
            }
        }
        n
    }

    /// 16 bytes from `s` (at least 16 long), unaligned.
    #[inline(always)]
    fn load(s: &[u8]) -> __m128i {
        assert!(s.len() >= 16);
        // SAFETY: `s` holds at least 16 readable bytes; the load is unaligned (SSE2, which
        // every x86_64 CPU has).
        unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
    }
}

/// Writes the three planes of `out` from interleaved `hwc` (`w` x `h`), shown in orientation
/// `o`, converting each value with `f` (given the channel).
#[inline(always)]
fn planar<T>(hwc: &[u8], w: usize, h: usize, o: Orientation, out: &mut [T], f: impl Fn(usize, u8) -> T) {
    let plane = w * h;
    let (r, rest) = out.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    if o.transposed() {
        // Displayed h wide and w high: each output pixel from its stored one.
        for y in 0..w {
            for x in 0..h {
                let (sx, sy) = o.source(x, y, w, h);
                let (px, ox) = (&hwc[(sy * w + sx) * 3..], y * h + x);
                (r[ox], g[ox], b[ox]) = (f(0, px[0]), f(1, px[1]), f(2, px[2]));
            }
        }
        return;
    }
    let (flip, upside_down) = rows_of(o);
    for y in 0..h {
        let sy = if upside_down { h - 1 - y } else { y };
        let row = &hwc[sy * w * 3..(sy + 1) * w * 3];
        let o = y * w;
        for (x, px) in row.chunks_exact(3).enumerate() {
            let ox = o + if flip { w - 1 - x } else { x };
            r[ox] = f(0, px[0]);
            g[ox] = f(1, px[1]);
            b[ox] = f(2, px[2]);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The sample a reference pipeline makes of a whole decode (`rgb`, `size`): `crop` resized
    /// to the spec's size with the same filter, mirrored if `flip`, planar uint8.
    pub(crate) fn reference_sample(rgb: &[u8], size: (u32, u32), crop: &Rect, flip: bool, spec: &ImageSpec) -> Vec<u8> {
        let src = ImageRef::new(size.0, size.1, rgb, PixelType::U8x3).unwrap();
        let mut hwc = vec![0u8; spec.elems()];
        let mut dst = FirImage::from_slice_u8(spec.width, spec.height, &mut hwc, PixelType::U8x3).unwrap();
        let opts = ResizeOptions::new()
            .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
            .crop(crop.x, crop.y, crop.w, crop.h);
        Resizer::new().resize(&src, &mut dst, &opts).unwrap();
        let mut want = vec![0u8; spec.elems()];
        let (w, h) = (spec.width as usize, spec.height as usize);
        write_chw(&hwc, w, h, Orientation::UP.mirrored_if(flip), spec, Slot::U8(&mut want));
        want
    }

    /// A `w` x `h` JPEG of a gradient (other modules' tests use it too).
    pub(crate) fn jpeg(w: u16, h: u16) -> Vec<u8> {
        let mut px = Vec::with_capacity(w as usize * h as usize * 3);
        for y in 0..h {
            for x in 0..w {
                px.extend_from_slice(&[(x % 256) as u8, (y % 256) as u8, 128]);
            }
        }
        let mut out = Vec::new();
        jpeg_encoder::Encoder::new(&mut out, 95)
            .encode(&px, w, h, jpeg_encoder::ColorType::Rgb)
            .unwrap();
        out
    }

    #[test]
    fn a_primed_scratch_gives_the_same_pixels_as_a_fresh_one() {
        let j = jpeg(320, 240);
        let cut = Transcoder::new().unwrap().with_restarts(&j, JPEG_RESTART_PX).unwrap();
        for spec in [ImageSpec::train(64), ImageSpec::eval(48), {
            let mut f = ImageSpec::train(40);
            f.out = OutType::F32;
            f
        }] {
            let mut primed = Scratch::default();
            assert_eq!(prime(&spec, &mut primed), Ok(true));
            assert!(primed.primed && primed.turbo.is_some(), "{spec:?}");
            // Priming again is free, and leaves what the first left.
            let cap = primed.decoded.capacity();
            assert_eq!(prime(&spec, &mut primed), Ok(false));
            assert_eq!(primed.decoded.capacity(), cap);
            for (i, bytes) in [&j, &cut].into_iter().cycle().take(6).enumerate() {
                let run = |scratch: &mut Scratch| -> Vec<u8> {
                    let mut rng = SampleRng::new(3, 0, 0, i as u64);
                    match spec.out {
                        OutType::U8 => {
                            let mut out = vec![0u8; spec.elems()];
                            process(bytes, &spec, &mut rng, Slot::U8(&mut out), scratch).unwrap();
                            out
                        }
                        OutType::F32 => {
                            let mut out = vec![0f32; spec.elems()];
                            process(bytes, &spec, &mut rng, Slot::F32(&mut out), scratch).unwrap();
                            out.iter().flat_map(|v| v.to_le_bytes()).collect()
                        }
                    }
                };
                assert_eq!(run(&mut primed), run(&mut Scratch::default()), "{spec:?}, image {i}");
            }
        }
    }

    #[test]
    fn the_shuffled_planar_write_is_the_scalar_one() {
        // Widths below, at and past multiples of 16 (the shuffled chunks and the scalar tail),
        // both directions, every byte value in play.
        let mut rng = SampleRng::new(7, 0, 0, 0);
        for w in (1..=70).chain([224, 225, 239]) {
            for h in [1, 3] {
                let hwc: Vec<u8> = (0..w * h * 3).map(|_| rng.next_u64() as u8).collect();
                for flip in [false, true] {
                    let mut want = vec![0u8; w * h * 3];
                    planar(&hwc, w, h, Orientation::UP.mirrored_if(flip), &mut want, |_, v| v);
                    let mut got = vec![0u8; w * h * 3];
                    planar_u8(&hwc, w, h, Orientation::UP.mirrored_if(flip), &mut got);
                    assert_eq!(got, want, "{w}x{h}, flip {flip}");
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(deinterleave::available(), "the shuffled path was not tested: no SSSE3");
    }

    #[test]
    fn the_encoder_refuses_a_buffer_of_the_wrong_size() {
        let e = encode_rgb(&[0u8; 10], 2, 2, 90).unwrap_err();
        assert!(e.contains("10 bytes are not a 2x2 RGB image"), "{e}");
        let j = encode_rgb(&[200u8; 16 * 8 * 3], 16, 8, 90).unwrap();
        assert_eq!(probe(&j).map(|i| (i.width, i.height)), Ok((16, 8)));
    }

    #[test]
    fn plans_are_deterministic_and_inside_the_image() {
        let spec = ImageSpec::train(224);
        for i in 0..500 {
            let a = plan(&spec, 640, 480, &mut SampleRng::new(7, 1, 0, i));
            let b = plan(&spec, 640, 480, &mut SampleRng::new(7, 1, 0, i));
            assert_eq!(a, b);
            let c = a.crop;
            assert!(
                c.x >= 0.0 && c.y >= 0.0 && c.x + c.w <= 640.0 && c.y + c.h <= 480.0,
                "{c:?}"
            );
            let area = c.w * c.h / (640.0 * 480.0);
            assert!((0.07..=1.0).contains(&area), "area {area}");
        }
        let other = plan(&spec, 640, 480, &mut SampleRng::new(7, 2, 0, 0));
        assert_ne!(other, plan(&spec, 640, 480, &mut SampleRng::new(7, 1, 0, 0)));
    }

    #[test]
    fn center_crop_matches_torchvision_geometry() {
        let p = plan(&ImageSpec::eval(224), 640, 480, &mut SampleRng::new(0, 0, 0, 0));
        // Resize(256): 480 -> 256, so 224 output pixels span 224 * 480 / 256 = 420 source pixels.
        assert!((p.crop.h - 420.0).abs() < 1e-9 && (p.crop.w - 420.0).abs() < 1e-9);
        assert!((p.crop.x - 110.0).abs() < 1e-9 && (p.crop.y - 30.0).abs() < 1e-9);
    }

    #[test]
    fn decodes_resizes_and_flips() {
        let j = jpeg(256, 192);
        let mut spec = ImageSpec::eval(64);
        spec.augment = Augment::Resize;
        let mut out = vec![0u8; spec.elems()];
        let mut s = Scratch::default();
        process(&j, &spec, &mut SampleRng::new(0, 0, 0, 0), Slot::U8(&mut out), &mut s).unwrap();
        // Red grows with x; blue is flat 128.
        assert!(out[63] > out[0] + 100, "{} {}", out[0], out[63]);
        assert!(out[2 * 64 * 64..].iter().all(|&b| (120..=136).contains(&b)));
        let mut f = vec![0f32; spec.elems()];
        spec.out = OutType::F32;
        spec.mean = [0.0; 3];
        spec.std = [1.0; 3];
        process(&j, &spec, &mut SampleRng::new(0, 0, 0, 0), Slot::F32(&mut f), &mut s).unwrap();
        assert!((f[63] - out[63] as f32 / 255.0).abs() < 1e-6);
    }

    #[test]
    fn dct_scaling_stays_close_to_full_decode() {
        let j = jpeg(1024, 768);
        let mut spec = ImageSpec::eval(64);
        spec.augment = Augment::Resize;
        let mut s = Scratch::default();
        let mut a = vec![0u8; spec.elems()];
        let mut b = vec![0u8; spec.elems()];
        process(&j, &spec, &mut SampleRng::new(0, 0, 0, 0), Slot::U8(&mut a), &mut s).unwrap();
        spec.dct_scaling = false;
        process(&j, &spec, &mut SampleRng::new(0, 0, 0, 0), Slot::U8(&mut b), &mut s).unwrap();
        let mad: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64 - *y as f64).abs())
            .sum::<f64>()
            / a.len() as f64;
        assert!(mad < 3.0, "mean abs difference {mad}");
    }

    #[test]
    fn scaled_and_row_limited_decodes_match_full_decodes() {
        // Structure everywhere, so a wrongly placed or missing row shows.
        let (w, h) = (1024u16, 768u16);
        let mut px = Vec::new();
        for y in 0..h {
            for x in 0..w {
                px.extend_from_slice(&[(x / 4) as u8, (y / 3) as u8, ((x ^ y) & 0xFF) as u8]);
            }
        }
        let mut j = Vec::new();
        jpeg_encoder::Encoder::new(&mut j, 95)
            .encode(&px, w, h, jpeg_encoder::ColorType::Rgb)
            .unwrap();
        let mut s = Scratch::default();
        let mut spec = ImageSpec::train(96);
        for i in 0..40 {
            let mut a = vec![0u8; spec.elems()];
            let mut b = vec![0u8; spec.elems()];
            spec.dct_scaling = true;
            process(&j, &spec, &mut SampleRng::new(3, 0, 0, i), Slot::U8(&mut a), &mut s).unwrap();
            spec.dct_scaling = false;
            process(&j, &spec, &mut SampleRng::new(3, 0, 0, i), Slot::U8(&mut b), &mut s).unwrap();
            // Red and green are smooth ramps: they must agree closely. (Blue is an XOR
            // pattern above the scaled image's Nyquist limit, so it may differ.)
            let plane = 96 * 96;
            let mad = a[..2 * plane]
                .iter()
                .zip(&b[..2 * plane])
                .map(|(x, y)| (*x as f64 - *y as f64).abs())
                .sum::<f64>()
                / (2 * plane) as f64;
            assert!(mad < 4.0, "sample {i}: mean abs difference {mad}");
        }
    }

    /// A 4:2:0 or 4:4:4 JPEG with structure everywhere (ramps and an XOR pattern), so a
    /// misplaced or missing pixel shows.
    fn structured_jpeg(w: u16, h: u16, sampling: jpeg_encoder::SamplingFactor) -> Vec<u8> {
        let mut px = Vec::new();
        for y in 0..h {
            for x in 0..w {
                px.extend_from_slice(&[(x / 4) as u8, (y / 3) as u8, ((x ^ y) & 0xFF) as u8]);
            }
        }
        let mut j = Vec::new();
        let mut e = jpeg_encoder::Encoder::new(&mut j, 92);
        e.set_sampling_factor(sampling);
        e.encode(&px, w, h, jpeg_encoder::ColorType::Rgb).unwrap();
        j
    }

    /// Asserts that every pixel of region decodes of `j` (random regions, every DCT scale)
    /// equals the same pixel of the full decode of `reference` (an image with the same
    /// pixels: `j` itself, or the file `j` was transcoded from).
    fn assert_regions_are_the_full_decode_s_pixels(j: &[u8], reference: &[u8], label: &str) {
        let mut t = TurboJpeg::new().unwrap();
        let hdr = t.header(j).unwrap();
        let rhdr = t.header(reference).unwrap();
        for eighths in 1..=8u32 {
            let mut full = Vec::new();
            let f = t.decode(reference, &rhdr, eighths, None, &mut full).unwrap();
            assert_eq!((f.w, f.h), (scaled(hdr.width, eighths), scaled(hdr.height, eighths)));
            assert_eq!(full.len(), (f.w * f.h * 3) as usize);
            let mut rng = SampleRng::new(5, eighths as u64, 0, 0);
            for _ in 0..25 {
                let w = 1 + rng.upto(f.w - 1);
                let h = 1 + rng.upto(f.h - 1);
                let want = Region {
                    x: rng.upto(f.w - w),
                    y: rng.upto(f.h - h),
                    w,
                    h,
                };
                let mut part = Vec::new();
                let got = t
                    .decode(j, &hdr, eighths, Some(want), &mut part)
                    .unwrap_or_else(|e| panic!("{label} {eighths}/8 {want:?}: {e}"));
                let (end, want_end) = (got.x + got.w, want.x + want.w);
                assert!(
                    end == (want_end + 1).min(f.w) && (got.x < want.x || want.x == 0),
                    "{label} {eighths}/8: {want:?} -> {got:?}"
                );
                assert_eq!((got.y, got.h), (want.y, want.h));
                assert_eq!(part.len(), (got.w * got.h * 3) as usize);
                let mut bad = Vec::new();
                for row in 0..got.h {
                    for col in 0..got.w {
                        let a = ((row * got.w + col) * 3) as usize;
                        let b = (((got.y + row) * f.w + got.x + col) * 3) as usize;
                        // The columns beside the asked region are the iMCU rounding and the
                        // margin; the outermost may be upsampled without its neighbour.
                        let x = got.x + col;
                        if x >= want.x && x < want_end && part[a..a + 3] != full[b..b + 3] {
                            bad.push((col, row));
                        }
                    }
                }
                if !bad.is_empty() {
                    let cols: std::collections::BTreeSet<_> = bad.iter().map(|b| b.0).collect();
                    let rows: std::collections::BTreeSet<_> = bad.iter().map(|b| b.1).collect();
                    panic!(
                        "{label} {eighths}/8 {want:?} -> {got:?}: {} differ, cols {cols:?} rows {:?}",
                        bad.len(),
                        rows.iter().take(10).collect::<Vec<_>>()
                    );
                }
            }
        }
    }

    #[test]
    fn region_decodes_are_the_full_decode_s_pixels() {
        // Every pixel of a region decode equals the same pixel of a full decode at the same
        // scale: columns rounded to iMCUs, rows skipped above, decoding stopped below.
        use jpeg_encoder::SamplingFactor::{F_1_1, F_2_2};
        let mut t = TurboJpeg::new().unwrap();
        for sampling in [F_2_2, F_1_1] {
            let j = structured_jpeg(643, 481, sampling);
            let hdr = t.header(&j).unwrap();
            assert_eq!((hdr.width, hdr.height), (643, 481));
            assert_eq!(hdr.mcu_width, Some(if sampling == F_2_2 { 16 } else { 8 }));
            assert_regions_are_the_full_decode_s_pixels(&j, &j, &format!("{sampling:?}"));
        }
    }

    #[test]
    fn restart_cuts_decode_the_original_s_pixels() {
        // A JPEG transcoded with restart markers is cut down to the intervals a region needs
        // before it is decoded; every pixel of the region is still the original's own. The
        // widths give rows of 40, 41 (prime: one MCU an interval), 80 and 81 MCUs; the
        // intervals run from one MCU to a whole row.
        use jpeg_encoder::SamplingFactor::{F_1_1, F_2_1, F_2_2};
        let mut tc = Transcoder::new().unwrap();
        let mut t = TurboJpeg::new().unwrap();
        let mut cut_at_all = 0;
        for (w, sampling) in [(640, F_2_2), (643, F_2_2), (640, F_1_1), (645, F_1_1), (643, F_2_1)] {
            let j = structured_jpeg(w, 481, sampling);
            for max_px in [1, 24, 64, 100_000] {
                let label = format!("{w} {sampling:?} restarts every {max_px} px");
                let r = tc.with_restarts(&j, max_px).unwrap();
                // Lossless: the full decodes are the same bytes.
                let (mut a, mut b) = (Vec::new(), Vec::new());
                let (hj, hr) = (t.header(&j).unwrap(), t.header(&r).unwrap());
                t.decode(&j, &hj, 8, None, &mut a).unwrap();
                t.decode(&r, &hr, 8, None, &mut b).unwrap();
                assert!(a == b, "{label}: the transcode changed pixels");
                let dri = r.windows(2).position(|m| m == [0xFF, 0xDD]).expect("a DRI marker");
                assert!(u16::from_be_bytes([r[dri + 4], r[dri + 5]]) > 0, "{label}");
                let (mut segs, mut cut) = (Vec::new(), Vec::new());
                let small = Region {
                    x: 300,
                    y: 200,
                    w: 40,
                    h: 40,
                };
                if cut_at_restarts(&r, 8, small, &mut segs, &mut cut).is_some() {
                    cut_at_all += 1;
                    assert!(cut.len() < r.len() / 2, "{label}: a cut of {} bytes", cut.len());
                }
                assert_regions_are_the_full_decode_s_pixels(&r, &j, &label);
            }
        }
        // Every file is cut: at its intervals, or by rows alone where an interval is a row.
        assert_eq!(cut_at_all, 20, "cuts made");
    }

    #[test]
    fn a_restart_marker_out_of_order_is_an_error_not_wrong_pixels() {
        let j = structured_jpeg(640, 480, jpeg_encoder::SamplingFactor::F_2_2);
        let mut r = Transcoder::new().unwrap().with_restarts(&j, 64).unwrap();
        let sos = r.windows(2).position(|m| m == [0xFF, 0xDA]).unwrap();
        let rst = sos
            + r[sos..]
                .windows(2)
                .position(|m| m[0] == 0xFF && (0xD0..=0xD7).contains(&m[1]))
                .unwrap();
        r[rst + 1] = 0xD0 + (r[rst + 1] - 0xD0 + 3) % 8;
        let mut t = TurboJpeg::new().unwrap();
        let hdr = t.header(&r).unwrap();
        let mut out = Vec::new();
        for region in [
            Region {
                x: 300,
                y: 200,
                w: 40,
                h: 40,
            },
            Region {
                x: 0,
                y: 0,
                w: 640,
                h: 480,
            },
        ] {
            let e = t.decode(&r, &hdr, 8, Some(region), &mut out).unwrap_err();
            assert!(e.contains("JPEG"), "{e}");
        }
    }

    #[test]
    fn restart_cuts_never_panic_on_damaged_files() {
        // Bytes flipped anywhere in a file with restart markers: each decode either fails with
        // an error or returns the region it was asked for.
        let j = structured_jpeg(320, 240, jpeg_encoder::SamplingFactor::F_2_2);
        let r = Transcoder::new().unwrap().with_restarts(&j, 32).unwrap();
        let mut t = TurboJpeg::new().unwrap();
        let mut rng = SampleRng::new(11, 0, 0, 0);
        let mut out = Vec::new();
        for _ in 0..400 {
            let mut bad = r.clone();
            for _ in 0..1 + rng.upto(3) {
                let at = rng.upto(bad.len() as u32 - 1) as usize;
                bad[at] ^= 1 << rng.upto(7);
            }
            let region = Region {
                x: 100,
                y: 80,
                w: 60,
                h: 50,
            };
            if let Ok(hdr) = t.header(&bad) {
                if let Ok(got) = t.decode(&bad, &hdr, 8, Some(region), &mut out) {
                    assert_eq!((got.y, got.h), (80, 50));
                }
            }
        }
    }

    #[test]
    fn crop_region_decode_matches_a_full_decode_then_the_same_crop() {
        // process() decodes only the crop's region; the reference decodes the whole image at
        // the same scale and crops and resizes it the same way. (The tolerance the other decode
        // tests use, a mean difference under 3-4, is not needed: they are identical.)
        let j = structured_jpeg(1024, 768, jpeg_encoder::SamplingFactor::F_2_2);
        let mut s = Scratch::default();
        let mut t = TurboJpeg::new().unwrap();
        let mut scales = std::collections::BTreeSet::new();
        for (size, dct) in [(96u32, true), (96, false), (224, true), (224, false)] {
            let mut spec = ImageSpec::train(size);
            spec.dct_scaling = dct;
            for i in 0..30 {
                let mut got = vec![0u8; spec.elems()];
                let info = probe(&j).unwrap();
                let p = plan(&spec, info.width, info.height, &mut SampleRng::new(9, 0, 0, i));
                process(&j, &spec, &mut SampleRng::new(9, 0, 0, i), Slot::U8(&mut got), &mut s).unwrap();
                let e = dct_eighths(&spec, ImageFormat::Jpeg, &p.crop);
                assert!(dct || e == 8);
                scales.insert(e);
                let hdr = t.header(&j).unwrap();
                let mut data = Vec::new();
                let full = t.decode(&j, &hdr, e, None, &mut data).unwrap();
                let (kx, ky) = (full.w as f64 / 1024.0, full.h as f64 / 768.0);
                let crop = Rect {
                    x: p.crop.x * kx,
                    y: p.crop.y * ky,
                    w: p.crop.w * kx,
                    h: p.crop.h * ky,
                };
                let want = reference_sample(&data, (full.w, full.h), &crop, p.flip, &spec);
                let worst = got.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
                // The region's pixels are the full decode's own (above), so the outputs are the
                // same bytes.
                assert!(worst == 0, "{size} dct {dct} sample {i}: a pixel differs by {worst}");
            }
        }
        // The crops took several DCT scales, not only the full one.
        assert!(scales.len() >= 3, "scales used: {scales:?}");
    }

    #[test]
    fn a_zero_sampling_factor_is_an_error_every_time() {
        // The file's structure stays valid, but no decoder can read it; the decoder instance
        // is reused after the error, as the decode threads do.
        let good = jpeg(64, 48);
        let mut bad = good.clone();
        let sof = bad.windows(2).position(|w| w == [0xFF, 0xC0]).expect("SOF0");
        bad[sof + 11] = 0;
        let spec = ImageSpec::train(32);
        let mut out = vec![0u8; spec.elems()];
        let mut s = Scratch::default();
        for i in 0..3 {
            let e = process(&bad, &spec, &mut SampleRng::new(0, 0, 0, i), Slot::U8(&mut out), &mut s).unwrap_err();
            assert!(e.contains("JPEG"), "{e}");
            process(
                &good,
                &spec,
                &mut SampleRng::new(0, 0, 0, i),
                Slot::U8(&mut out),
                &mut s,
            )
            .unwrap();
        }
        assert!(decode_rgb(&bad, 1, None).is_err());
    }

    #[test]
    fn malformed_images_are_errors() {
        let mut j = jpeg(64, 64);
        let mut s = Scratch::default();
        let spec = ImageSpec::eval(32);
        let mut out = vec![0u8; spec.elems()];
        assert!(process(
            b"nope",
            &spec,
            &mut SampleRng::new(0, 0, 0, 0),
            Slot::U8(&mut out),
            &mut s
        )
        .is_err());
        for i in (200..j.len() - 2).step_by(7) {
            j[i] ^= 0x5A;
        }
        // Either an error or some pixels; never a panic.
        let _ = process(&j, &spec, &mut SampleRng::new(0, 0, 0, 0), Slot::U8(&mut out), &mut s);
        let t = &j[..j.len() / 2];
        assert!(decode_rgb(t, 1, None).is_err());
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }

    /// A PNG of only a header (IHDR declaring `w` x `h`, colour type `color`) and IEND.
    fn png_header_only(w: u32, h: u32, color: u8) -> Vec<u8> {
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut chunk = |kind: &[u8], body: &[u8]| {
            out.extend((body.len() as u32).to_be_bytes());
            let mut c = kind.to_vec();
            c.extend(body);
            out.extend(&c);
            out.extend(crc32(&c).to_be_bytes());
        };
        let mut ihdr = w.to_be_bytes().to_vec();
        ihdr.extend(h.to_be_bytes());
        ihdr.extend([8, color, 0, 0, 0]);
        chunk(b"IHDR", &ihdr);
        chunk(b"IEND", b"");
        out
    }

    /// Regression: decode trusted the declared size up to 2^28 pixels (805 MB of RGB per image,
    /// per decode thread), and PNG allocated its whole buffer from the header before reading a
    /// byte of data. Bombs are now refused from the header, before allocating.
    #[test]
    fn decompression_bombs_are_refused_before_allocating() {
        // Pixels: a PNG declaring 60000 x 60000.
        let e = decode_rgb(&png_header_only(60_000, 60_000, 2), 1, None).unwrap_err();
        assert!(e.contains("pixel decode limit"), "{e}");
        // Memory: 8000 x 8000 RGBA is under the pixel limit, but its decode is not.
        let e = decode_rgb(&png_header_only(8_000, 8_000, 6), 1, None).unwrap_err();
        assert!(e.contains("memory limit"), "{e}");
        // A JPEG whose start-of-frame is patched to declare 65535 x 65535.
        let mut j = jpeg(16, 16);
        let sof = j
            .windows(2)
            .position(|w| w[0] == 0xFF && (0xC0..=0xC2).contains(&w[1]))
            .expect("a start-of-frame marker");
        j[sof + 5..sof + 9].copy_from_slice(&[0xFF, 0xFF, 0xFF, 0xFF]);
        let e = decode_rgb(&j, 1, None).unwrap_err();
        assert!(e.contains("pixel decode limit"), "{e}");
        // An ordinary image still decodes.
        assert_eq!(decode_rgb(&jpeg(64, 48), 1, None).unwrap().width, 64);
    }

    /// A CMYK JPEG (Adobe's inverted form, what Photoshop writes; ImageNet has a few dozen)
    /// decodes on the CPU path, full and cropped, to (255 - ink)(255 - K) / 255 per channel.
    #[test]
    fn cmyk_jpegs_decode_to_rgb() {
        let (w, h) = (64u16, 48u16);
        let px: Vec<u8> = (0..w as usize * h as usize)
            .flat_map(|i| [200, 100, (i % 200) as u8, 25])
            .collect();
        let mut j = Vec::new();
        jpeg_encoder::Encoder::new(&mut j, 100)
            .encode(&px, w, h, jpeg_encoder::ColorType::Cmyk)
            .unwrap();
        let rgb = decode_rgb(&j, 1, None).unwrap();
        assert_eq!((rgb.width, rgb.height), (64, 48));
        // Adobe's form stores 255 minus each ink; red is (255 - C)(255 - K) / 255.
        let want = |c: u8| (((255 - c) as u32 * 230 + 127) / 255) as i32;
        for (i, p) in rgb.data.chunks_exact(3).enumerate() {
            for (got, ink) in p.iter().zip([200, 100, (i % 200) as u8]) {
                assert!((*got as i32 - want(ink)).abs() <= 6, "pixel {i}: {p:?}");
            }
        }
        let spec = ImageSpec::train(32);
        let mut out = vec![0u8; spec.elems()];
        process(
            &j,
            &spec,
            &mut SampleRng::new(0, 0, 0, 0),
            Slot::U8(&mut out),
            &mut Scratch::default(),
        )
        .unwrap();
        let r = out[..32 * 32].iter().map(|&v| v as u32).sum::<u32>() / (32 * 32);
        assert!((r as i32 - want(200)).abs() <= 4, "red plane mean {r}");
    }
}
