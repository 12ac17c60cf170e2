//! `ramjet synth`: a deterministic, photo-like YOLO dataset.
//!
//! Each image is a small outdoor scene: a sky gradient with soft clouds, a textured ground
//! below a horizon, and 1 to 6 shaded objects whose bounding boxes are the labels. Texture and
//! grain put the JPEG sizes in the range of real 640x480 photos (60-150 KB); the encoder
//! quality is nudged per image until the size lands in that range. Everything derives from
//! (seed, image index), so the same arguments always give the same bytes.

use std::fs;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use ramjet_engine::{Error, Result};

/// Image width in pixels.
pub const WIDTH: usize = 640;
/// Image height in pixels.
pub const HEIGHT: usize = 480;
/// Smallest and largest JPEG size the generator aims for.
pub const JPEG_BYTES_RANGE: (usize, usize) = (60_000, 150_000);
/// Class names written to `data.yaml`.
pub const CLASSES: [&str; 8] = ["crate", "ball", "sign", "pole", "barrel", "panel", "cone", "car"];

/// Which images `ramjet synth` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Profile {
    /// Photo-like 640x480 scenes with YOLO boxes (the demo's dataset).
    #[default]
    Yolo,
    /// ImageNet-like sizes and JPEG layouts, no boxes ([`crate::synth_imagenet`]).
    Imagenet,
}

/// Options of `ramjet synth`.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Number of images.
    pub samples: usize,
    /// Seed of the whole dataset.
    pub seed: u64,
    /// Which images.
    pub profile: Profile,
    /// With [`Profile::Imagenet`]: damaged files per thousand.
    pub damaged_per_mille: u32,
    /// Images per thousand written as WebP instead of JPEG (the same pixels; one in four of
    /// them lossless, the rest lossy at quality 90), as `NNNNNN.webp`.
    pub webp_per_mille: u32,
    /// JPEGs per thousand stored turned, with an EXIF orientation (2 to 8, drawn) that shows
    /// them as rendered: labels stay right for a reader that applies it, wrong for one that
    /// does not.
    pub exif_per_mille: u32,
    /// Images per thousand that are byte copies of an earlier image (drawn), labels too: what
    /// `ramjet pack --dedupe content` finds.
    pub duplicate_per_mille: u32,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self {
            samples: 5315,
            seed: 0,
            profile: Profile::Yolo,
            damaged_per_mille: 0,
            webp_per_mille: 0,
            exif_per_mille: 0,
            duplicate_per_mille: 0,
        }
    }
}

/// What [`synth`] wrote.
#[derive(Debug, Clone)]
pub struct SynthReport {
    /// Images written.
    pub images: usize,
    /// Total JPEG bytes.
    pub jpeg_bytes: u64,
    /// Smallest and largest JPEG.
    pub jpeg_bytes_min_max: (u64, u64),
    /// Boxes written.
    pub boxes: usize,
    /// Images per kind ([`crate::synth_imagenet::Kind`]'s names; "baseline 640x480" for the
    /// YOLO profile).
    pub kinds: std::collections::BTreeMap<&'static str, usize>,
}

/// SplitMix64: tiny, fast, and good enough for procedural textures.
#[derive(Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub(crate) fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub(crate) fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.f()
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Bilinear value noise over a coarse random grid, smoothstepped.
pub(crate) struct ValueNoise {
    gw: usize,
    grid: Vec<f32>,
    sx: f32,
    sy: f32,
}

impl ValueNoise {
    fn new(rng: &mut Rng, cells_x: usize, cells_y: usize) -> Self {
        Self::sized(rng, cells_x, cells_y, WIDTH, HEIGHT)
    }
    /// Noise of `cells_x` x `cells_y` cells over a `w` x `h` image.
    pub(crate) fn sized(rng: &mut Rng, cells_x: usize, cells_y: usize, w: usize, h: usize) -> Self {
        let gw = cells_x + 2;
        let grid = (0..gw * (cells_y + 2)).map(|_| rng.f() * 2.0 - 1.0).collect();
        ValueNoise {
            gw,
            grid,
            sx: cells_x as f32 / w as f32,
            sy: cells_y as f32 / h as f32,
        }
    }
    /// Noise in [-1, 1] at pixel (x, y).
    #[inline]
    pub(crate) fn at(&self, x: usize, y: usize) -> f32 {
        let fx = x as f32 * self.sx;
        let fy = y as f32 * self.sy;
        let (ix, iy) = (fx as usize, fy as usize);
        let (tx, ty) = (fx - ix as f32, fy - iy as f32);
        let (tx, ty) = (tx * tx * (3.0 - 2.0 * tx), ty * ty * (3.0 - 2.0 * ty));
        let g = |xx: usize, yy: usize| self.grid[yy * self.gw + xx];
        let a = g(ix, iy) + (g(ix + 1, iy) - g(ix, iy)) * tx;
        let b = g(ix, iy + 1) + (g(ix + 1, iy + 1) - g(ix, iy + 1)) * tx;
        a + (b - a) * ty
    }
}

struct Object {
    class: usize,
    x0: f32,
    y0: f32,
    x1: f32,
    y1: f32,
    ellipse: bool,
    color: [f32; 3],
}

/// Renders image `index` of dataset `seed`: RGB pixels and its YOLO label lines.
pub fn render(seed: u64, index: u64) -> (Vec<u8>, Vec<(usize, [f32; 4])>) {
    let mut rng = Rng::new(seed ^ index.wrapping_mul(0xA24B_AED4_963E_E407) ^ 0x5EED);
    let horizon = rng.range(0.32, 0.6) * HEIGHT as f32;
    let sky_top = [rng.range(30.0, 90.0), rng.range(70.0, 130.0), rng.range(150.0, 230.0)];
    let sky_low = [
        rng.range(170.0, 230.0),
        rng.range(180.0, 230.0),
        rng.range(200.0, 250.0),
    ];
    let ground = match rng.below(4) {
        0 => [rng.range(60.0, 100.0), rng.range(100.0, 150.0), rng.range(40.0, 80.0)],
        1 => [rng.range(110.0, 160.0), rng.range(90.0, 130.0), rng.range(60.0, 90.0)],
        2 => [
            rng.range(100.0, 140.0),
            rng.range(100.0, 140.0),
            rng.range(100.0, 140.0),
        ],
        _ => [
            rng.range(170.0, 210.0),
            rng.range(150.0, 190.0),
            rng.range(110.0, 150.0),
        ],
    };
    let clouds = ValueNoise::new(&mut rng, 6, 3);
    let coarse = ValueNoise::new(&mut rng, 12, 9);
    let mid = ValueNoise::new(&mut rng, 48, 36);
    let fine = ValueNoise::new(&mut rng, 160, 120);
    let grain = rng.range(5.0, 9.0);

    let objects = place_objects(&mut rng, horizon);

    let mut px = vec![0u8; WIDTH * HEIGHT * 3];
    let mut hash = Rng::new(seed.wrapping_add(index) ^ 0x6A09_E667_F3BC_C908);
    for y in 0..HEIGHT {
        let yf = y as f32;
        for x in 0..WIDTH {
            let mut c;
            if yf < horizon {
                let t = yf / horizon;
                let cl = (clouds.at(x, y) * 0.8 + coarse.at(x, y) * 0.3).max(0.0);
                c = [0.0; 3];
                for k in 0..3 {
                    let sky = sky_top[k] + (sky_low[k] - sky_top[k]) * t;
                    c[k] = sky + (245.0 - sky) * cl.min(1.0) * 0.9;
                }
            } else {
                let depth = (yf - horizon) / (HEIGHT as f32 - horizon);
                let tex = coarse.at(x, y) * 22.0 + mid.at(x, y) * 16.0 + fine.at(x, y) * (6.0 + 14.0 * depth);
                let shade = 0.75 + 0.35 * depth;
                c = [
                    ground[0] * shade + tex,
                    ground[1] * shade + tex,
                    ground[2] * shade + tex * 0.8,
                ];
            }
            for o in &objects {
                if xf_in(x as f32, yf, o) {
                    let v = (yf - o.y0) / (o.y1 - o.y0);
                    let u = (x as f32 - o.x0) / (o.x1 - o.x0);
                    let light = 1.15 - 0.5 * v - 0.2 * (u - 0.3).abs();
                    let detail = mid.at(x, y) * 10.0 + fine.at(x, y) * 8.0;
                    let stripe = if o.class == 5 && ((v * 6.0) as i32) % 2 == 0 {
                        -25.0
                    } else {
                        0.0
                    };
                    c = o.color.map(|oc| oc * light + detail + stripe);
                }
            }
            let g = (hash.next_u64() & 0xFF) as f32 / 255.0 * 2.0 - 1.0;
            let o = (y * WIDTH + x) * 3;
            for (dst, v) in px[o..o + 3].iter_mut().zip(c) {
                *dst = (v + g * grain).clamp(0.0, 255.0) as u8;
            }
        }
    }

    (px, yolo_labels(&objects))
}

/// One to six objects standing on the ground below `horizon`, far ones first (nearer, lower
/// ones cover them, as in a photo).
fn place_objects(rng: &mut Rng, horizon: f32) -> Vec<Object> {
    let n_obj = 1 + rng.below(6) as usize;
    let mut objects = Vec::with_capacity(n_obj);
    for _ in 0..n_obj {
        let class = rng.below(CLASSES.len() as u64) as usize;
        let h = rng.range(0.08, 0.45) * HEIGHT as f32;
        let w = h * rng.range(0.4, 1.8);
        let base_y = rng.range(horizon + 10.0, HEIGHT as f32 + h * 0.3);
        let cx = rng.range(-w * 0.2, WIDTH as f32 + w * 0.2);
        objects.push(Object {
            class,
            x0: cx - w / 2.0,
            x1: cx + w / 2.0,
            y0: base_y - h,
            y1: base_y,
            ellipse: class == 1 || class == 4,
            color: [rng.range(20.0, 240.0), rng.range(20.0, 240.0), rng.range(20.0, 240.0)],
        });
    }
    objects.sort_by(|a, b| a.y1.total_cmp(&b.y1));
    objects
}

/// The YOLO label lines of the objects seen in the frame: class and normalised centre and
/// size, clipped to the frame; objects under 2 pixels a side left out.
fn yolo_labels(objects: &[Object]) -> Vec<(usize, [f32; 4])> {
    objects
        .iter()
        .filter_map(|o| {
            let x0 = o.x0.max(0.0);
            let x1 = o.x1.min(WIDTH as f32);
            let y0 = o.y0.max(0.0);
            let y1 = o.y1.min(HEIGHT as f32);
            if x1 - x0 < 2.0 || y1 - y0 < 2.0 {
                return None;
            }
            let (w, h) = (WIDTH as f32, HEIGHT as f32);
            Some((
                o.class,
                [(x0 + x1) / 2.0 / w, (y0 + y1) / 2.0 / h, (x1 - x0) / w, (y1 - y0) / h],
            ))
        })
        .collect()
}

#[inline]
fn xf_in(x: f32, y: f32, o: &Object) -> bool {
    if x < o.x0 || x >= o.x1 || y < o.y0 || y >= o.y1 {
        return false;
    }
    if !o.ellipse {
        return true;
    }
    let cx = (o.x0 + o.x1) / 2.0;
    let cy = (o.y0 + o.y1) / 2.0;
    let dx = (x - cx) / ((o.x1 - o.x0) / 2.0);
    let dy = (y - cy) / ((o.y1 - o.y0) / 2.0);
    dx * dx + dy * dy <= 1.0
}

/// Encodes RGB pixels as a baseline JPEG, adjusting quality until the size falls within
/// [`JPEG_BYTES_RANGE`] (or the quality bounds are reached).
pub fn encode_jpeg(px: &[u8]) -> Vec<u8> {
    let mut quality = 88u8;
    let mut last = Vec::new();
    for _ in 0..6 {
        let mut out = Vec::with_capacity(160_000);
        let enc = jpeg_encoder::Encoder::new(&mut out, quality);
        enc.encode(px, WIDTH as u16, HEIGHT as u16, jpeg_encoder::ColorType::Rgb)
            .expect("encoding an in-memory RGB buffer cannot fail");
        let n = out.len();
        last = out;
        if n < JPEG_BYTES_RANGE.0 && quality < 98 {
            quality = (quality + 4).min(98);
        } else if n > JPEG_BYTES_RANGE.1 && quality > 40 {
            quality = quality.saturating_sub(8).max(40);
        } else {
            break;
        }
    }
    last
}

/// Writes `opts.samples` images to `dir/images/NNNNNN.jpg` (`.webp` for those
/// `webp_per_mille` picks), labels to
/// `dir/labels/NNNNNN.txt` and class names to `dir/data.yaml`.
pub fn synth(dir: &Path, opts: &SynthOptions, progress: &indicatif::ProgressBar) -> Result<SynthReport> {
    let images = dir.join("images");
    let labels = dir.join("labels");
    for d in [&images, &labels] {
        fs::create_dir_all(d).map_err(|e| Error::io(d.display(), e))?;
    }
    let yaml = format!(
        "# written by ramjet synth\npath: .\ntrain: images\nval: images\nnc: {}\nnames: [{}]\n",
        CLASSES.len(),
        CLASSES.join(", ")
    );
    write_file(&dir.join("data.yaml"), yaml.as_bytes())?;
    progress.set_length(opts.samples as u64);
    let per: Vec<(u64, usize, &'static str)> = (0..opts.samples)
        .into_par_iter()
        .map(|out| -> Result<(u64, usize, &'static str)> {
            // A duplicate is written as the image it copies: every draw below is that one's.
            let i = original(opts, out as u64) as usize;
            let (jpg, boxes, kind) = match opts.profile {
                Profile::Yolo => {
                    let (px, boxes) = render(opts.seed, i as u64);
                    (encode_jpeg(&px), boxes, "baseline 640x480")
                }
                Profile::Imagenet => {
                    let (kind, jpg) = crate::synth_imagenet::image(opts.seed, i as u64, opts.damaged_per_mille);
                    (jpg, Vec::new(), kind.name())
                }
            };
            let mut txt = String::new();
            for (c, b) in &boxes {
                txt.push_str(&format!("{c} {:.6} {:.6} {:.6} {:.6}\n", b[0], b[1], b[2], b[3]));
            }
            let (jpg, kind, ext) = match as_webp(opts, i as u64, kind) {
                Some(lossless) => (
                    to_webp(&jpg, lossless)?,
                    if lossless { "webp lossless" } else { "webp lossy" },
                    "webp",
                ),
                None => match draw(opts, i as u64, b"exif", opts.exif_per_mille, kind) {
                    Some(h) => {
                        let v = 2 + (h >> 32) as u16 % 7;
                        (turned(&jpg, v)?, EXIF_KINDS[v as usize - 2], "jpg")
                    }
                    None => (jpg, kind, "jpg"),
                },
            };
            write_file(&images.join(format!("{out:06}.{ext}")), &jpg)?;
            write_file(&labels.join(format!("{out:06}.txt")), txt.as_bytes())?;
            progress.inc(1);
            Ok((jpg.len() as u64, boxes.len(), if out != i { "duplicate" } else { kind }))
        })
        .collect::<Result<_>>()?;
    progress.finish_and_clear();
    Ok(SynthReport {
        images: per.len(),
        jpeg_bytes: per.iter().map(|p| p.0).sum(),
        jpeg_bytes_min_max: (
            per.iter().map(|p| p.0).min().unwrap_or(0),
            per.iter().map(|p| p.0).max().unwrap_or(0),
        ),
        boxes: per.iter().map(|p| p.1).sum(),
        kinds: per.iter().fold(Default::default(), |mut m, p| {
            *m.entry(p.2).or_insert(0) += 1;
            m
        }),
    })
}

/// The image that image `i` is written as: itself, or for one of the `duplicate_per_mille`
/// drawn, the original of an earlier image (drawn too).
pub fn original(opts: &SynthOptions, mut i: u64) -> u64 {
    while i > 0 {
        match draw(opts, i, b"dupe", opts.duplicate_per_mille, "") {
            Some(h) => i = (h >> 20) % i,
            None => break,
        }
    }
    i
}

/// Whether image `i` is written as WebP (`Some(lossless)`): a fixed draw of (seed, i) under
/// `webp_per_mille`; a damaged JPEG stays one.
fn as_webp(opts: &SynthOptions, i: u64, kind: &str) -> Option<bool> {
    draw(opts, i, b"webp", opts.webp_per_mille, kind).map(|h| (h >> 32) % 4 == 0)
}

/// A fixed draw of (seed, i, what) that falls under `per_mille` (its hash), never for a
/// damaged image.
fn draw(opts: &SynthOptions, i: u64, what: &[u8; 4], per_mille: u32, kind: &str) -> Option<u64> {
    let mut key = [0u8; 20];
    key[..8].copy_from_slice(&opts.seed.to_le_bytes());
    key[8..16].copy_from_slice(&i.to_le_bytes());
    key[16..].copy_from_slice(what);
    let h = xxhash_rust::xxh3::xxh3_64(&key);
    (h % 1000 < per_mille as u64 && kind != "damaged").then_some(h)
}

/// The kinds of the turned JPEGs, by orientation (2 to 8).
const EXIF_KINDS: [&str; 7] = ["exif 2", "exif 3", "exif 4", "exif 5", "exif 6", "exif 7", "exif 8"];

/// The JPEG `jpg`'s pixels stored so that EXIF orientation `v` shows them as they are, with
/// that orientation (re-encoded as a baseline RGB JPEG at quality 90).
fn turned(jpg: &[u8], v: u16) -> Result<Vec<u8>> {
    use ramjet_engine::image::exif::{with_exif, Orientation};
    let bad = |e: ramjet_engine::image::ImageError| Error::invalid("synth exif", e.to_string());
    let rgb = ramjet_engine::image::decode_rgb(jpg, 1, None).map_err(bad)?;
    let o = Orientation::new(v);
    let (w, h) = (rgb.width as usize, rgb.height as usize);
    // Stored w' x h' (the sides swapped for a quarter turn); shown pixel (x, y) is stored
    // pixel o.source(x, y), so each shown pixel is written there.
    let (sw, sh) = o.displayed(rgb.width, rgb.height);
    let mut stored = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let (sx, sy) = o.source(x, y, sw as usize, sh as usize);
            let d = (sy * sw as usize + sx) * 3;
            stored[d..d + 3].copy_from_slice(&rgb.data[(y * w + x) * 3..(y * w + x) * 3 + 3]);
        }
    }
    let plain = ramjet_engine::image::turbo::encode_rgb(&stored, sw, sh, 90).map_err(bad)?;
    Ok(with_exif(&plain, v))
}

/// The JPEG `jpg`'s pixels as a WebP.
fn to_webp(jpg: &[u8], lossless: bool) -> Result<Vec<u8>> {
    let bad = |e: ramjet_engine::image::ImageError| Error::invalid("synth webp", e.to_string());
    let rgb = ramjet_engine::image::decode_rgb(jpg, 1, None).map_err(bad)?;
    ramjet_engine::image::webp::encode_rgb(&rgb.data, rgb.width, rgb.height, (!lossless).then_some(90.0)).map_err(bad)
}

fn write_file(path: &PathBuf, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).map_err(|e| Error::io(path.display(), e))
}
