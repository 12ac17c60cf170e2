//! Which decoder takes an image on the GPU path, and what it decodes (issue 41).
//!
//! From the header alone ([`crate::image::frame`]), before any pixel is decoded, each image
//! is sent to one of three decoders:
//!
//! - **the hardware JPEG engine** (nvJPEG's `NVJPEG_BACKEND_HARDWARE`, on A100, H100 and
//!   later): 8-bit baseline JPEGs in 4:4:4, 4:2:2, 4:2:0, 4:4:0 or grey. It decodes a
//!   region of interest and scales by 1/2, 1/4 or 1/8 in the DCT domain;
//! - **the GPU hybrid decoder** (nvJPEG's decoupled API, Huffman on the CPU, the rest on the
//!   GPU): what the engine refuses but nvJPEG still reads (progressive, extended sequential,
//!   4:1:1, 4:1:0, other 3-component factors), with the region of interest and no scaling;
//! - **ramjet's CPU crop decoder** (libjpeg-turbo): everything else (PNG, CMYK and YCCK,
//!   12-bit, lossless, arithmetic or hierarchical coding, damaged files), and any image whose
//!   GPU decode would take more device scratch memory than the bound.
//!
//! The crop and flip are [`crate::image::plan`]'s for the same [`SampleRng`], so the GPU path
//! draws exactly the CPU path's random choices; the scale is the CPU path's
//! ([`crate::image::dct_eighths`]): the smallest of 1/8, 1/4, 1/2 that keeps the crop at least
//! the output's size. The region is the crop plus the resize filter's reach, widened to MCU
//! edges, so that at any scale its edges fall on whole decoded pixels.

use crate::image::exif::Orientation;
use crate::image::frame::{jpeg_frame, JpegCoding, JpegFrame, Subsampling};
use crate::image::probe::{probe, ImageFormat};
use crate::image::turbo::{scaled, Region};
use crate::image::{dct_eighths, plan, ImageSpec, Plan, Rect, SampleRng};

/// The three decoders of the GPU path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Path {
    /// nvJPEG's hardware JPEG engine.
    Hardware,
    /// nvJPEG's hybrid decoder (CPU Huffman, GPU IDCT and colour conversion).
    Hybrid,
    /// ramjet's CPU crop decoder.
    Cpu,
}

impl Path {
    /// Every path, in this order.
    pub const ALL: [Path; 3] = [Path::Hardware, Path::Hybrid, Path::Cpu];

    /// The name in `metrics()` and Prometheus.
    pub fn name(self) -> &'static str {
        match self {
            Path::Hardware => "hardware",
            Path::Hybrid => "hybrid",
            Path::Cpu => "cpu",
        }
    }
}

/// Why an image went where it went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// A baseline JPEG the hardware engine reads.
    Baseline,
    /// A baseline JPEG, but this GPU has no hardware engine (or it is off).
    NoEngine,
    /// Progressive JPEG: the engine reads single-scan files only.
    Progressive,
    /// Extended sequential (SOF1) JPEG.
    Extended,
    /// A chroma layout the engine does not read (4:1:1, 4:1:0, other factors).
    Subsampling,
    /// Four components (CMYK or YCCK).
    Cmyk,
    /// Not 8 bits per sample.
    Precision,
    /// Lossless, arithmetic or hierarchical coding.
    Coding,
    /// PNG.
    Png,
    /// WebP (no GPU decoder reads it).
    Webp,
    /// A JPEG whose EXIF orientation turns or mirrors it: decoded whole on the CPU as shown.
    Oriented,
    /// The header is damaged: the CPU path reports it, naming the sample.
    Damaged,
    /// The GPU decode would take more device scratch memory than the bound.
    OverBound,
    /// GPU decode is off (`decode="cpu"`), or this image was moved to the CPU by the split.
    Chosen,
}

impl Reason {
    /// Every reason, in this order.
    pub const ALL: [Reason; 14] = [
        Reason::Baseline,
        Reason::NoEngine,
        Reason::Progressive,
        Reason::Extended,
        Reason::Subsampling,
        Reason::Cmyk,
        Reason::Precision,
        Reason::Coding,
        Reason::Png,
        Reason::Webp,
        Reason::Oriented,
        Reason::Damaged,
        Reason::OverBound,
        Reason::Chosen,
    ];

    /// The name in `metrics()` and Prometheus.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Baseline => "baseline",
            Reason::NoEngine => "no_engine",
            Reason::Progressive => "progressive",
            Reason::Extended => "extended",
            Reason::Subsampling => "subsampling",
            Reason::Cmyk => "cmyk",
            Reason::Precision => "precision",
            Reason::Coding => "coding",
            Reason::Png => "png",
            Reason::Webp => "webp",
            Reason::Oriented => "oriented",
            Reason::Damaged => "damaged",
            Reason::OverBound => "over_bound",
            Reason::Chosen => "chosen",
        }
    }
}

/// What the GPU side has, and how much device memory one image's decode may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoders {
    /// The hardware engine is there (`nvjpegCreateExV2` with the hardware backend worked).
    pub hardware: bool,
    /// The hybrid decoder is there (nvJPEG loaded at all).
    pub hybrid: bool,
    /// The most device scratch memory one image's decode may take, in bytes.
    pub scratch_bound: u64,
}

impl Decoders {
    /// The default bound on one image's device scratch: 256 MiB, over what a 24-megapixel
    /// photo's hybrid decode takes, under what the 4768x5980 ImageNet outlier's needs.
    pub const SCRATCH_BOUND: u64 = 256 << 20;
}

/// Where and how one image is decoded on the GPU path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Geometry {
    /// The source's size.
    pub width: u32,
    /// The source's height.
    pub height: u32,
    /// Crop and flip, in source pixels: [`crate::image::plan`]'s for the same generator.
    pub plan: Plan,
    /// The decode scale in eighths (1, 2, 4, or 8 for none), the CPU path's.
    pub eighths: u32,
    /// The region decoded, in source pixels: on MCU edges, or the image's edge.
    pub roi: Region,
    /// The decoded region's size in pixels, after the scale.
    pub decoded: (u32, u32),
    /// The crop in the decoded region's pixels: what the fused kernel resizes.
    pub crop: Rect,
    /// Memory the decode takes (output, coefficients, bitstream): device memory on the GPU
    /// paths.
    pub scratch: u64,
    /// The EXIF orientation the decode applies (a whole image, decoded as shown, on the CPU;
    /// `UP` for every other image): `width`, `height`, the plan and the region are then the
    /// shown image's.
    pub orientation: Orientation,
}

/// One image's route.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// The decoder.
    pub path: Path,
    /// Why.
    pub reason: Reason,
    /// What is decoded, by whichever decoder; `None` only for an image whose header does not
    /// read (the CPU path then reports it, naming the sample).
    pub geometry: Option<Geometry>,
}

/// Routes one image (see the module's text). `rng` is the sample's own generator, as the
/// CPU path would receive it. Every image whose header reads has a geometry, the CPU's too:
/// on the GPU path the CPU decodes the same kind of region into the same source buffer, and
/// the fused kernel does the rest for every image alike.
pub fn route(bytes: &[u8], spec: &ImageSpec, mut rng: SampleRng, d: &Decoders) -> Route {
    let damaged = Route {
        path: Path::Cpu,
        reason: Reason::Damaged,
        geometry: None,
    };
    if !bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        // Not a JPEG: a PNG or a WebP (probed), or nothing ramjet reads.
        return match probe(bytes) {
            Ok(info) if info.format != ImageFormat::Jpeg => {
                let reason = if info.format == ImageFormat::Png {
                    Reason::Png
                } else {
                    Reason::Webp
                };
                shown(
                    (info.width, info.height),
                    orientation(spec, bytes),
                    spec,
                    &mut rng,
                    bytes.len(),
                    reason,
                )
            }
            _ => damaged,
        };
    }
    // The frame parse makes the same checks as `probe`'s for a JPEG: the header is read once.
    let Ok(frame) = jpeg_frame(bytes) else {
        return damaged;
    };
    let o = orientation(spec, bytes);
    if o != Orientation::UP {
        return shown(
            (frame.width, frame.height),
            o,
            spec,
            &mut rng,
            bytes.len(),
            Reason::Oriented,
        );
    }
    let (path, reason) = decoder_for(&frame, d);
    let p = plan(spec, frame.width, frame.height, &mut rng);
    // The engine and the CPU scale in the DCT domain; the hybrid decoder cannot.
    let eighths = |path| match path {
        Path::Hybrid => 8,
        _ => dct_eighths(spec, ImageFormat::Jpeg, &p.crop),
    };
    let g = geometry(&frame, spec, p, eighths(path), bytes.len(), path);
    if path != Path::Cpu && g.scratch > d.scratch_bound {
        return Route {
            path: Path::Cpu,
            reason: Reason::OverBound,
            geometry: Some(geometry(&frame, spec, p, eighths(Path::Cpu), bytes.len(), Path::Cpu)),
        };
    }
    Route {
        path,
        reason,
        geometry: Some(g),
    }
}

/// The geometry of an image decoded whole at full size (PNG).
fn whole(width: u32, height: u32, plan: Plan, bytes: usize, orientation: Orientation) -> Geometry {
    Geometry {
        orientation,
        width,
        height,
        plan,
        eighths: 8,
        roi: Region {
            x: 0,
            y: 0,
            w: width,
            h: height,
        },
        decoded: (width, height),
        crop: plan.crop,
        scratch: width as u64 * height as u64 * 3 + bytes as u64,
    }
}

/// A CPU route decoding the whole image as its orientation `o` shows it, for `reason`.
fn shown(
    info: (u32, u32),
    o: Orientation,
    spec: &ImageSpec,
    rng: &mut SampleRng,
    bytes: usize,
    reason: Reason,
) -> Route {
    let (w, h) = o.displayed(info.0, info.1);
    let p = plan(spec, w, h, rng);
    Route {
        path: Path::Cpu,
        reason,
        geometry: Some(whole(w, h, p, bytes, o)),
    }
}

/// The orientation `spec` shows `bytes` in: its EXIF one, or `UP` when the spec turns that off.
fn orientation(spec: &ImageSpec, bytes: &[u8]) -> Orientation {
    if spec.exif_orientation {
        crate::image::exif::orientation(bytes)
    } else {
        Orientation::UP
    }
}

/// The decoder a JPEG's frame allows, and why.
pub fn decoder_for(f: &JpegFrame, d: &Decoders) -> (Path, Reason) {
    let gpu = |reason| {
        if d.hybrid {
            (Path::Hybrid, reason)
        } else {
            (Path::Cpu, reason)
        }
    };
    if f.precision != 8 {
        return (Path::Cpu, Reason::Precision);
    }
    if f.is_cmyk() {
        return (Path::Cpu, Reason::Cmyk);
    }
    match f.coding {
        JpegCoding::Baseline => {}
        JpegCoding::Progressive => return gpu(Reason::Progressive),
        JpegCoding::Extended => return gpu(Reason::Extended),
        JpegCoding::Lossless | JpegCoding::Arithmetic | JpegCoding::Hierarchical => return (Path::Cpu, Reason::Coding),
    }
    match f.subsampling() {
        Subsampling::S444 | Subsampling::S422 | Subsampling::S420 | Subsampling::S440 | Subsampling::Gray => {}
        _ => return gpu(Reason::Subsampling),
    }
    if d.hardware {
        (Path::Hardware, Reason::Baseline)
    } else {
        gpu(Reason::NoEngine)
    }
}

/// The region, decoded size, crop and scratch of a GPU decode at `eighths`.
fn geometry(f: &JpegFrame, spec: &ImageSpec, p: Plan, eighths: u32, bitstream: usize, path: Path) -> Geometry {
    let (w, h) = (f.width, f.height);
    let (mcu_w, mcu_h) = f.mcu();
    // The resize filter reaches one output pixel's span (plus rounding) past the crop, in
    // decoded pixels (as the CPU path's region decode); in source pixels, 8/eighths as many.
    let k = 8.0 / eighths as f64;
    let mx = ((p.crop.w / k / spec.width as f64).ceil() + 2.0) * k;
    let my = ((p.crop.h / k / spec.height as f64).ceil() + 2.0) * k;
    let edge = |lo: f64, len: f64, m: f64, mcu: u32, size: u32| {
        let a = ((lo - m).max(0.0) / mcu as f64).floor() as u32 * mcu;
        let b = (((lo + len + m) / mcu as f64).ceil() as u32)
            .saturating_mul(mcu)
            .min(size);
        (a.min(size - 1), b.max(a.min(size - 1) + 1))
    };
    let (x0, x1) = edge(p.crop.x, p.crop.w, mx, mcu_w, w);
    let (y0, y1) = edge(p.crop.y, p.crop.h, my, mcu_h, h);
    let roi = Region {
        x: x0,
        y: y0,
        w: x1 - x0,
        h: y1 - y0,
    };
    // MCU edges are multiples of 8, so they scale to whole pixels; the image's own right and
    // bottom edges round up, as libjpeg-turbo's scaled sizes do.
    let (dx, dy) = (x0 * eighths / 8, y0 * eighths / 8);
    let decoded = (scaled(x1, eighths) - dx, scaled(y1, eighths) - dy);
    let (kx, ky) = (
        scaled(w, eighths) as f64 / w as f64,
        scaled(h, eighths) as f64 / h as f64,
    );
    let crop = Rect {
        x: p.crop.x * kx - dx as f64,
        y: p.crop.y * ky - dy as f64,
        w: (p.crop.w * kx).min(decoded.0 as f64 - (p.crop.x * kx - dx as f64)),
        h: (p.crop.h * ky).min(decoded.1 as f64 - (p.crop.y * ky - dy as f64)),
    };
    let out = decoded.0 as u64 * decoded.1 as u64 * 3;
    // The hybrid decoder holds the whole frame's DCT coefficients (16 bits a sample, every
    // component at full resolution at worst) before it crops.
    let coefficients = match path {
        Path::Hybrid => w as u64 * h as u64 * 2 * f.components.len() as u64,
        _ => 0,
    };
    Geometry {
        width: w,
        height: h,
        plan: p,
        eighths,
        roi,
        decoded,
        crop,
        scratch: out + coefficients + bitstream as u64,
        orientation: Orientation::UP,
    }
}

/// Images per path and per reason, as `metrics()` reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteCounts {
    /// Images per ([`Path`], [`Reason`]).
    pub counts: std::collections::BTreeMap<(Path, Reason), u64>,
}

impl RouteCounts {
    /// Counts one image.
    pub fn add(&mut self, path: Path, reason: Reason) {
        *self.counts.entry((path, reason)).or_default() += 1;
    }

    /// Images that went to `path`.
    pub fn on(&self, path: Path) -> u64 {
        self.counts
            .iter()
            .filter(|((p, _), _)| *p == path)
            .map(|(_, n)| n)
            .sum()
    }

    /// Images that went to `path` for `reason`.
    pub fn get(&self, path: Path, reason: Reason) -> u64 {
        self.counts.get(&(path, reason)).copied().unwrap_or(0)
    }
}

/// Every decoder present, the default bound (tests here and in [`crate::image::gpu_batch`]).
#[cfg(test)]
pub(crate) const TEST_DECODERS: Decoders = Decoders {
    hardware: true,
    hybrid: true,
    scratch_bound: Decoders::SCRATCH_BOUND,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::frame::test_jpeg as jpeg;
    use crate::image::ImageConfig;
    use jpeg_encoder::{ColorType, SamplingFactor};

    const ALL: Decoders = TEST_DECODERS;

    /// Every kind of file goes where the module's text says, and says why.
    #[test]
    fn every_kind_of_file_takes_its_decoder() {
        use SamplingFactor::*;
        let spec = ImageSpec::train(224);
        let rng = || SampleRng::new(1, 0, 0, 7);
        let r = |b: &[u8], d: &Decoders| {
            let r = route(b, &spec, rng(), d);
            (r.path, r.reason)
        };
        for s in [F_1_1, F_2_1, F_2_2, F_1_2] {
            assert_eq!(
                r(&jpeg(500, 375, s, false, ColorType::Rgb), &ALL),
                (Path::Hardware, Reason::Baseline),
                "{s:?}"
            );
        }
        assert_eq!(
            r(&jpeg(500, 375, F_2_2, false, ColorType::Luma), &ALL),
            (Path::Hardware, Reason::Baseline)
        );
        for s in [F_4_1, F_4_2] {
            assert_eq!(
                r(&jpeg(500, 375, s, false, ColorType::Rgb), &ALL),
                (Path::Hybrid, Reason::Subsampling)
            );
        }
        let progressive = jpeg(500, 375, F_2_2, true, ColorType::Rgb);
        assert_eq!(r(&progressive, &ALL), (Path::Hybrid, Reason::Progressive));
        assert_eq!(
            r(&jpeg(300, 200, F_1_1, false, ColorType::Cmyk), &ALL),
            (Path::Cpu, Reason::Cmyk)
        );
        let mut damaged = jpeg(300, 200, F_2_2, false, ColorType::Rgb);
        damaged.truncate(damaged.len() / 2);
        assert_eq!(r(&damaged, &ALL), (Path::Cpu, Reason::Damaged));
        let png = {
            let mut out = Vec::new();
            let mut e = png::Encoder::new(&mut out, 8, 8);
            e.set_color(png::ColorType::Rgb);
            e.write_header().unwrap().write_image_data(&[9; 192]).unwrap();
            out
        };
        assert_eq!(r(&png, &ALL), (Path::Cpu, Reason::Png));
        let webp = crate::image::webp::encode_rgb(&[9; 192], 8, 8, Some(80.0)).unwrap();
        assert_eq!(r(&webp, &ALL), (Path::Cpu, Reason::Webp));
        // A turned JPEG is decoded whole on the CPU, as shown (the plan on the shown size);
        // with the orientation off, it goes where its frame sends it.
        let base = jpeg(500, 376, F_2_2, false, ColorType::Rgb);
        let turned = crate::image::exif::with_exif(&base, 6);
        assert_eq!(r(&turned, &ALL), (Path::Cpu, Reason::Oriented));
        let g = route(&turned, &spec, rng(), &ALL).geometry.unwrap();
        assert_eq!((g.width, g.height, g.orientation.value()), (376, 500, 6));
        let off = ImageSpec {
            exif_orientation: false,
            ..spec.clone()
        };
        assert_eq!(route(&turned, &off, rng(), &ALL).path, r(&base, &ALL).0);
        let no_engine = Decoders { hardware: false, ..ALL };
        let baseline = jpeg(500, 375, F_2_2, false, ColorType::Rgb);
        assert_eq!(r(&baseline, &no_engine), (Path::Hybrid, Reason::NoEngine));
        let nothing = Decoders {
            hardware: false,
            hybrid: false,
            ..ALL
        };
        assert_eq!(r(&baseline, &nothing), (Path::Cpu, Reason::NoEngine));
        assert_eq!(r(&progressive, &nothing), (Path::Cpu, Reason::Progressive));
        // 12-bit and lossless frames: the SOF's precision byte and marker, patched.
        let sof = baseline.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        let mut twelve = baseline.clone();
        twelve[sof + 4] = 12;
        assert_eq!(r(&twelve, &ALL), (Path::Cpu, Reason::Precision));
        let mut lossless = baseline.clone();
        lossless[sof + 1] = 0xC3;
        assert_eq!(r(&lossless, &ALL), (Path::Cpu, Reason::Coding));
        let mut extended = baseline;
        extended[sof + 1] = 0xC1;
        assert_eq!(r(&extended, &ALL), (Path::Hybrid, Reason::Extended));
    }

    /// The crop, flip and scale are the CPU path's for the same seed; the region holds the
    /// crop with the filter's margin, lies on MCU edges (or the image's), and maps the crop
    /// into decoded pixels exactly as the scale does.
    #[test]
    fn the_plan_is_the_cpu_paths_and_the_region_lies_on_mcu_edges() {
        use SamplingFactor::*;
        for (i, (w, h, s)) in [
            (500u16, 375u16, F_2_2),
            (4000, 3000, F_2_1),
            (213, 640, F_1_1),
            (1023, 767, F_1_2),
        ]
        .into_iter()
        .enumerate()
        {
            let b = jpeg(w, h, s, false, ColorType::Rgb);
            let f = jpeg_frame(&b).unwrap();
            let (mw, mh) = f.mcu();
            for sample in 0..200u64 {
                for augment in [crate::image::AugmentName::Train, crate::image::AugmentName::Eval] {
                    let spec: ImageSpec = ImageConfig {
                        width: 224,
                        height: 160,
                        augment,
                        ..ImageConfig::default()
                    }
                    .into();
                    let r = route(&b, &spec, SampleRng::new(3, 1, 0, sample), &ALL);
                    let g = r.geometry.expect("a GPU route has geometry");
                    let want = plan(&spec, w as u32, h as u32, &mut SampleRng::new(3, 1, 0, sample));
                    assert_eq!(g.plan, want, "image {i} sample {sample}");
                    assert_eq!(g.eighths, dct_eighths(&spec, ImageFormat::Jpeg, &want.crop));
                    let roi = g.roi;
                    assert!(roi.x % mw == 0 && roi.y % mh == 0, "{roi:?}");
                    assert!((roi.x + roi.w) % mw == 0 || roi.x + roi.w == w as u32, "{roi:?}");
                    assert!((roi.y + roi.h) % mh == 0 || roi.y + roi.h == h as u32, "{roi:?}");
                    let c = want.crop;
                    assert!(roi.x as f64 <= c.x && roi.y as f64 <= c.y);
                    assert!((roi.x + roi.w) as f64 >= (c.x + c.w).min(w as f64 - 0.5));
                    assert!((roi.y + roi.h) as f64 >= (c.y + c.h).min(h as f64 - 0.5));
                    // The crop, in decoded pixels, inside the decoded region.
                    let k = g.eighths as f64 / 8.0;
                    assert!(g.crop.x >= 0.0 && g.crop.y >= 0.0);
                    assert!(g.crop.x + g.crop.w <= g.decoded.0 as f64 + 1e-9);
                    assert!(g.crop.y + g.crop.h <= g.decoded.1 as f64 + 1e-9);
                    assert!(
                        (g.crop.w - c.w * k).abs() <= 1.0 && (g.crop.h - c.h * k).abs() <= 1.0,
                        "{g:?}"
                    );
                    assert_eq!(g.decoded.0, scaled(roi.x + roi.w, g.eighths) - roi.x * g.eighths / 8);
                    assert!(
                        g.crop.w >= spec.width as f64 - 1.0 || g.eighths == 8,
                        "the scale keeps the crop"
                    );
                }
            }
        }
    }

    /// An image whose decode would take more device memory than the bound goes to the CPU,
    /// and says so; under the bound it stays on the GPU.
    #[test]
    fn the_memory_bound_routes_huge_images_to_the_cpu() {
        let spec = ImageSpec::train(224);
        let big = jpeg(4768, 5980, SamplingFactor::F_2_2, true, ColorType::Rgb);
        let r = route(&big, &spec, SampleRng::new(0, 0, 0, 0), &ALL);
        // The hybrid decoder holds a progressive 28.5-megapixel frame's coefficients whole
        // (171 MB); a bound one byte under its scratch sends it to the CPU.
        let g = r.geometry.unwrap();
        assert_eq!((r.path, r.reason), (Path::Hybrid, Reason::Progressive));
        assert!(g.scratch >= 4768 * 5980 * 6, "{}", g.scratch);
        let tight = Decoders {
            scratch_bound: g.scratch - 1,
            ..ALL
        };
        let r = route(&big, &spec, SampleRng::new(0, 0, 0, 0), &tight);
        assert_eq!((r.path, r.reason), (Path::Cpu, Reason::OverBound));
        let mut counts = RouteCounts::default();
        counts.add(r.path, r.reason);
        counts.add(Path::Hardware, Reason::Baseline);
        counts.add(Path::Hardware, Reason::Baseline);
        assert_eq!(
            (counts.on(Path::Cpu), counts.on(Path::Hardware), counts.on(Path::Hybrid)),
            (1, 2, 0)
        );
        assert_eq!(counts.get(Path::Cpu, Reason::OverBound), 1);
    }
}
