//! Image decode and augmentation, on CPU, into one slot of a batch.
//!
//! The crop is chosen in source coordinates from the header alone, before any pixel is
//! decoded. That lets the decoder skip work: JPEG is decoded at the smallest DCT scale
//! (1/8, 1/4, 1/2) that still leaves the crop at least as large as the output. The crop is
//! then resized (antialiased bilinear,
//! as Pillow and torchvision do) and written channel-first, flipped and normalised in the
//! same pass.
//!
//! Every random choice comes from a generator keyed by (seed, epoch, stream, sample), so a
//! resumed run replays identical pixels. See `docs/order.md`.

use std::panic::AssertUnwindSafe;

use fast_image_resize::images::{Image as FirImage, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::decode::{probe, ImageFormat, ImageInfo};

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
    /// Decode JPEG at a reduced DCT scale when the crop is much larger than the output.
    pub dct_scaling: bool,
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
        self.elems() * if self.out == OutType::U8 { 1 } else { 4 }
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
    /// Decode JPEG at a reduced DCT scale when the crop is much larger than the output.
    pub dct_scaling: bool,
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
/// (JPEG only; other formats decode at full size). `rows` limits the IDCT to the block rows
/// that cover [top, bottom) (JPEG only). The result's size tells what was produced.
pub fn decode_rgb(bytes: &[u8], denom: u32, rows: Option<(u32, u32)>) -> Result<Rgb, String> {
    let info = probe(bytes)?;
    check_declared(info.width, info.height, JPEG_BYTES_PER_PIXEL)?;
    // The decoders are third-party code fed untrusted bytes: a panic in them is a decode
    // error of this sample, not a crash of the process.
    std::panic::catch_unwind(AssertUnwindSafe(|| match info.format {
        ImageFormat::Jpeg => decode_jpeg(bytes, denom, rows),
        ImageFormat::Png => decode_png(bytes),
    }))
    .unwrap_or_else(|_| Err("the decoder failed on malformed data".into()))
}

/// Refuses a declared size above the pixel or memory limit, before any allocation.
fn check_declared(width: u32, height: u32, bytes_per_pixel: u64) -> Result<(), String> {
    let px = width as u64 * height as u64;
    if px > DECODE_PIXELS_MAX {
        return Err(format!(
            "image declares {width}x{height} pixels, above the {DECODE_PIXELS_MAX}-pixel decode limit (decompression bomb?)"
        ));
    }
    if px * bytes_per_pixel > DECODE_BYTES_MAX {
        return Err(format!(
            "image declares {width}x{height} pixels, whose decode would take over the {DECODE_BYTES_MAX}-byte memory limit"
        ));
    }
    Ok(())
}

fn decode_jpeg(bytes: &[u8], denom: u32, rows: Option<(u32, u32)>) -> Result<Rgb, String> {
    use libjpeg_turbo_rs::{decode::pipeline::Decoder, PixelFormat, ScalingFactor};
    let mut d = Decoder::new(bytes).map_err(|e| format!("malformed JPEG: {e}"))?;
    d.set_output_format(PixelFormat::Rgb);
    d.set_max_pixels(DECODE_PIXELS_MAX as usize);
    // The decoder's own header may disagree with what `probe` read: check it again.
    check_declared(d.header().width as u32, d.header().height as u32, JPEG_BYTES_PER_PIXEL)?;
    if denom > 1 {
        d.set_scale(ScalingFactor::new(1, denom));
    }
    if let Some((top, bottom)) = rows {
        // The decoder takes the rows in output (scaled) pixels.
        let k = denom.max(1) as usize;
        let (w, h) = (
            (d.header().width as usize).div_ceil(k),
            (d.header().height as usize).div_ceil(k),
        );
        let top = (top as usize / k).min(h);
        let bottom = (bottom as usize).div_ceil(k).clamp(top, h);
        if bottom > top {
            d.set_crop_region(0, top, w, bottom - top);
        }
    }
    let img = d.decode_image().map_err(|e| format!("malformed JPEG: {e}"))?;
    // The decoder fills damaged regions and reports them as warnings (a Huffman error, data
    // ending early): that is a damaged image, never a training sample.
    if let Some(w) = img.warnings.first() {
        return Err(format!("malformed JPEG: {w:?}"));
    }
    let need = img.width * img.height * 3;
    if img.data.len() < need {
        return Err(format!(
            "malformed JPEG: decoder returned {} of {need} bytes",
            img.data.len()
        ));
    }
    let mut data = img.data;
    data.truncate(need);
    Ok(Rgb {
        width: img.width as u32,
        height: img.height as u32,
        data,
    })
}

fn decode_png(bytes: &[u8]) -> Result<Rgb, String> {
    let limits = png::Limits {
        bytes: DECODE_BYTES_MAX as usize,
    };
    let mut dec = png::Decoder::new_with_limits(std::io::Cursor::new(bytes), limits);
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut r = dec.read_info().map_err(|e| format!("malformed PNG: {e}"))?;
    let (w, h) = (r.info().width, r.info().height);
    let need = r.output_buffer_size() as u64 + w as u64 * h as u64 * 3;
    check_declared(w, h, 0)?;
    if need > DECODE_BYTES_MAX {
        return Err(format!(
            "PNG declares {w}x{h} pixels, whose decode would take {need} bytes, over the {DECODE_BYTES_MAX}-byte memory limit"
        ));
    }
    let mut buf = vec![0u8; r.output_buffer_size()];
    let f = r.next_frame(&mut buf).map_err(|e| format!("malformed PNG: {e}"))?;
    let (w, h) = (f.width, f.height);
    let px = (w * h) as usize;
    let src = &buf[..f.buffer_size()];
    let data = match f.color_type {
        png::ColorType::Rgb => src[..px * 3].to_vec(),
        png::ColorType::Rgba => src.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => src.iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => src.chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => return Err("malformed PNG: palette was not expanded".into()),
    };
    Ok(Rgb {
        width: w,
        height: h,
        data,
    })
}

/// Per-thread buffers, reused from image to image.
#[derive(Default)]
pub struct Scratch {
    resizer: Resizer,
    resized: Vec<u8>,
}

/// The output slot of one image in a batch.
pub enum Slot<'a> {
    /// uint8 CHW.
    U8(&'a mut [u8]),
    /// float32 CHW.
    F32(&'a mut [f32]),
}

/// Decodes `bytes`, applies `spec` with the random choices of `rng`, and writes the result
/// channel-first into `slot`. Returns the decoded source size.
pub fn process(
    bytes: &[u8],
    spec: &ImageSpec,
    rng: &mut SampleRng,
    slot: Slot<'_>,
    scratch: &mut Scratch,
) -> Result<ImageInfo, String> {
    let info = probe(bytes)?;
    let p = plan(spec, info.width, info.height, rng);
    let (ow, oh) = (spec.width, spec.height);
    // The largest DCT downscale that keeps the crop at least as large as the output.
    let mut denom = 1u32;
    if spec.dct_scaling && info.format == ImageFormat::Jpeg {
        while denom < 8 && p.crop.w / (denom * 2) as f64 >= ow as f64 && p.crop.h / (denom * 2) as f64 >= oh as f64 {
            denom *= 2;
        }
    }
    // Whole rows are decoded: the decoder's row-limited mode (`rows`) left rows near the
    // crop edge unwritten in our tests, which made output depend on stale memory.
    let img = decode_rgb(bytes, denom, None)?;
    // Map the crop into the decoded image's coordinates (the decoder rounds scaled sizes up).
    let kx = img.width as f64 / info.width as f64;
    let ky = img.height as f64 / info.height as f64;
    let crop = Rect {
        x: p.crop.x * kx,
        y: p.crop.y * ky,
        w: (p.crop.w * kx).min(img.width as f64 - p.crop.x * kx),
        h: (p.crop.h * ky).min(img.height as f64 - p.crop.y * ky),
    };
    let src = ImageRef::new(img.width, img.height, &img.data, PixelType::U8x3).map_err(|e| e.to_string())?;
    let n = (ow * oh * 3) as usize;
    scratch.resized.resize(n, 0);
    let mut dst = FirImage::from_slice_u8(ow, oh, &mut scratch.resized, PixelType::U8x3).map_err(|e| e.to_string())?;
    let opts = ResizeOptions::new()
        .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
        .crop(crop.x, crop.y, crop.w, crop.h);
    scratch
        .resizer
        .resize(&src, &mut dst, &opts)
        .map_err(|e| format!("resize failed: {e}"))?;
    write_chw(&scratch.resized, ow as usize, oh as usize, p.flip, spec, slot);
    Ok(info)
}

/// Interleaved RGB to planar CHW, mirrored if `flip`, converted to the slot's type.
fn write_chw(hwc: &[u8], w: usize, h: usize, flip: bool, spec: &ImageSpec, slot: Slot<'_>) {
    match slot {
        Slot::U8(out) => planar(hwc, w, h, flip, out, |_, v| v),
        Slot::F32(out) => {
            // One multiply-add per element: (x / 255 - mean) / std = x * a + k.
            let a: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * spec.std[c]));
            let k: [f32; 3] = std::array::from_fn(|c| -spec.mean[c] / spec.std[c]);
            planar(hwc, w, h, flip, out, |c, v| v as f32 * a[c] + k[c])
        }
    }
}

/// Writes the three planes of `out` from interleaved `hwc`, converting each value with `f`
/// (given the channel), mirrored if `flip`.
#[inline(always)]
fn planar<T>(hwc: &[u8], w: usize, h: usize, flip: bool, out: &mut [T], f: impl Fn(usize, u8) -> T) {
    let plane = w * h;
    let (r, rest) = out.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    for y in 0..h {
        let row = &hwc[y * w * 3..(y + 1) * w * 3];
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
mod tests {
    use super::*;

    fn jpeg(w: u16, h: u16) -> Vec<u8> {
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
}
