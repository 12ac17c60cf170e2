//! One batch of the GPU decode path, planned (issue 41, items 3 to 5): every image routed
//! ([`crate::image::route`]), the batch split between the decoders ([`crate::image::split`]),
//! and each image's decoded region given its place in the batch's source buffer, from which
//! the fused kernel makes the output. The CPU's share is decoded by [`decode_region`] into
//! the same kind of place (pinned host memory, copied to the device), so the kernel treats
//! every image alike and the CPU path's random choices hold for all.
//!
//! The plan is data only: the GPU side (nvJPEG's decoders, the copy, the kernel) carries it
//! out, and reports each path's time back through [`Planner::observe`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use bytes::Bytes;

use crate::buf::HostBuf;
use crate::image::route::{route, Decoders, Geometry, Path, Reason, RouteCounts};
use crate::image::split::{Item, Split, SplitStats};
use crate::image::turbo::Region;
use crate::image::{decode_shown, jpeg_header, ImageError, ImageSpec, SampleRng, Scratch};

/// Which decoders a loader's GPU path uses (`StreamingDataset(decode=...)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeMode {
    /// The measured split between the GPU decoders and the CPU threads.
    #[default]
    Auto,
    /// Every image a GPU decoder takes goes to it; the rest to the CPU.
    Gpu,
    /// Every image to the CPU threads (the fused kernel still runs on the GPU).
    Cpu,
}

impl DecodeMode {
    /// The mode named `s`, or an error naming the option and the value.
    pub fn parse(s: &str) -> Result<DecodeMode, crate::error::Invalid> {
        match s {
            "auto" => Ok(DecodeMode::Auto),
            "gpu" => Ok(DecodeMode::Gpu),
            "cpu" => Ok(DecodeMode::Cpu),
            other => Err(format!("decode={other:?}: expected \"auto\", \"gpu\" or \"cpu\"").into()),
        }
    }
}

/// Bytes each image's place in the source buffer is aligned to.
pub const SOURCE_ALIGN: usize = 256;

/// One image of a planned batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// The decoder that takes it.
    pub path: Path,
    /// Why ([`Reason::Chosen`] when the split moved it to the CPU).
    pub reason: Reason,
    /// What is decoded; `None` for a header that does not read (the CPU path reports it).
    pub geometry: Option<Geometry>,
    /// Byte offset of its decoded region (rows of `3 * width` bytes) in the source buffer.
    pub src: usize,
}

/// A planned batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPlan {
    /// The images, in the batch's order.
    pub images: Vec<Planned>,
    /// Bytes of the source buffer the batch needs.
    pub source_bytes: usize,
}

impl BatchPlan {
    /// Indices of the images `path` takes.
    pub fn on(&self, path: Path) -> Vec<usize> {
        (0..self.images.len())
            .filter(|&i| self.images[i].path == path)
            .collect()
    }
}

/// Plans batches for one loader: its output, its decoders, its mode, and the split's rates.
///
/// Shared by the loader's decode threads: each plans its own batch, routing every image
/// from its header without a lock; only the split's few arithmetic steps and the counters
/// are shared (a short lock per batch, relaxed atomics).
#[derive(Debug)]
pub struct Planner {
    spec: ImageSpec,
    decoders: Decoders,
    mode: DecodeMode,
    split: Mutex<Split>,
    counts: [[AtomicU64; Reason::ALL.len()]; Path::ALL.len()],
}

fn path_at(p: Path) -> usize {
    Path::ALL.iter().position(|&q| q == p).expect("every path is in ALL")
}

fn reason_at(r: Reason) -> usize {
    Reason::ALL
        .iter()
        .position(|&q| q == r)
        .expect("every reason is in ALL")
}

impl Planner {
    /// A planner for `spec`'s output over `decoders`, with `cpu_threads` decode threads.
    pub fn new(spec: ImageSpec, decoders: Decoders, mode: DecodeMode, cpu_threads: usize) -> Planner {
        Planner {
            spec,
            decoders,
            mode,
            split: Mutex::new(Split::new(cpu_threads)),
            counts: Default::default(),
        }
    }

    /// The output the batches are planned for.
    pub fn spec(&self) -> &ImageSpec {
        &self.spec
    }

    /// The decoders the GPU side has.
    pub fn decoders(&self) -> Decoders {
        self.decoders
    }

    /// The mode.
    pub fn mode(&self) -> DecodeMode {
        self.mode
    }

    fn split(&self) -> std::sync::MutexGuard<'_, Split> {
        // A panic while holding it leaves only rates behind: still usable.
        self.split.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Plans one batch: each sample's bytes with its own generator.
    pub fn plan(&self, samples: &[(&[u8], SampleRng)]) -> BatchPlan {
        let cpu_only = Decoders {
            hardware: false,
            hybrid: false,
            ..self.decoders
        };
        let decoders = match self.mode {
            DecodeMode::Cpu => cpu_only,
            _ => self.decoders,
        };
        let routes: Vec<_> = samples
            .iter()
            .map(|(b, rng)| route(b, &self.spec, rng.clone(), &decoders))
            .collect();
        let mut images: Vec<Planned> = routes
            .into_iter()
            .map(|r| Planned {
                path: r.path,
                reason: if self.mode == DecodeMode::Cpu {
                    Reason::Chosen
                } else {
                    r.reason
                },
                geometry: r.geometry,
                src: 0,
            })
            .collect();
        let items: Vec<Item> = images
            .iter()
            .map(|p| Item {
                path: p.path,
                work: p.work(),
            })
            .collect();
        if self.mode != DecodeMode::Auto {
            let to: Vec<Path> = images.iter().map(|p| p.path).collect();
            self.split().record(&items, &to);
        } else {
            let to = self.split().assign(&items);
            for (p, to) in images.iter_mut().zip(to) {
                if to != p.path {
                    // The CPU decodes the same region, at the DCT scale the hybrid decoder
                    // could not use (its geometry is recomputed for the CPU).
                    (p.path, p.reason) = (to, Reason::Chosen);
                }
            }
            for (p, (b, rng)) in images.iter_mut().zip(samples) {
                if p.reason == Reason::Chosen && p.geometry.is_some_and(|g| g.eighths == 8) {
                    p.geometry = route(b, &self.spec, rng.clone(), &cpu_only).geometry;
                }
            }
        }
        let mut at = 0;
        for p in &mut images {
            self.counts[path_at(p.path)][reason_at(p.reason)].fetch_add(1, Relaxed);
            p.src = at;
            at += p.source_len().div_ceil(SOURCE_ALIGN) * SOURCE_ALIGN;
        }
        BatchPlan {
            images,
            source_bytes: at,
        }
    }

    /// Records that `path` decoded `images` images of `work` decoded pixels in `seconds`.
    pub fn observe(&self, path: Path, images: usize, work: f64, seconds: f64) {
        self.split().observe(path, images, work, seconds);
    }

    /// Records that one of the CPU's decode threads decoded `work` decoded pixels in
    /// `seconds` (the loader's threads each decode their own batch's share, side by side).
    pub fn observe_cpu_thread(&self, work: f64, seconds: f64) {
        self.split().observe_one_thread(work, seconds);
    }

    /// Images per path and reason so far.
    pub fn counts(&self) -> RouteCounts {
        let mut c = RouteCounts::default();
        for (pi, p) in Path::ALL.iter().enumerate() {
            for (ri, r) in Reason::ALL.iter().enumerate() {
                let n = self.counts[pi][ri].load(Relaxed);
                if n > 0 {
                    c.counts.insert((*p, *r), n);
                }
            }
        }
        c
    }

    /// What the split last did, and each path's rate.
    pub fn split_stats(&self) -> SplitStats {
        self.split().stats()
    }

    /// The counters and the split as flat `metrics()` entries: `decode_<path>` images,
    /// `decode_<path>_<reason>` images, `decode_share_<path>` (0 to 1, the last batch's work)
    /// and `decode_rate_<path>_px_s` (once measured).
    pub fn metrics(&self) -> std::collections::BTreeMap<String, f64> {
        let mut m = std::collections::BTreeMap::new();
        let counts = self.counts();
        let stats = self.split_stats();
        for (i, p) in Path::ALL.iter().enumerate() {
            m.insert(format!("decode_{}", p.name()), counts.on(*p) as f64);
            for r in Reason::ALL {
                let n = counts.get(*p, r);
                if n > 0 {
                    m.insert(format!("decode_{}_{}", p.name(), r.name()), n as f64);
                }
            }
            m.insert(format!("decode_share_{}", p.name()), stats.share[i]);
            if let Some(r) = stats.rate[i] {
                m.insert(format!("decode_rate_{}_px_s", p.name()), r);
            }
        }
        m
    }
}

impl Planned {
    /// Bytes of its decoded region (rows of `3 * width` bytes; 0 without a geometry).
    pub fn source_len(&self) -> usize {
        self.geometry
            .map_or(0, |g| g.decoded.0 as usize * g.decoded.1 as usize * 3)
    }

    /// Decoded pixels (the split's unit of work).
    pub fn work(&self) -> f64 {
        self.geometry.map_or(0.0, |g| g.decoded.0 as f64 * g.decoded.1 as f64)
    }
}

/// A batch made for the GPU path: the plan, the source buffer with the CPU's share decoded
/// into its places, and every image's encoded bytes for the GPU decoders (and for a fallback
/// to the CPU when a GPU decoder refuses one). The GPU side copies the CPU's regions, decodes
/// the rest into the device's copy of the source buffer, and runs the fused kernel.
#[derive(Debug)]
pub struct SourceBatch {
    /// The images, in the batch's order (those left out as corrupt are not in it).
    pub plan: BatchPlan,
    /// At least `plan.source_bytes` bytes of pinned (or aligned) host memory; the CPU's
    /// images are decoded at their places, the GPU's places are left as they were.
    pub source: HostBuf,
    /// Each image's encoded bytes (zero-copy slices of its shard's record).
    pub bitstreams: Vec<Bytes>,
    /// Each image's shard, to name it in an error.
    pub shards: Vec<String>,
    /// Each image's index in its dataset, to name it in an error.
    pub samples: Vec<u64>,
}

/// The CPU's share of a GPU batch: decodes `g`'s region of `bytes` at `g`'s scale into `out`
/// (rows of `3 * g.decoded.0` bytes), as nvJPEG would. `scratch` is the decode thread's.
pub fn decode_region(bytes: &[u8], g: &Geometry, out: &mut [u8], scratch: &mut Scratch) -> Result<(), ImageError> {
    let (w, h) = (g.decoded.0 as usize, g.decoded.1 as usize);
    if out.len() < w * h * 3 {
        return Err(ImageError::Argument(format!(
            "a {}x{} region needs {} bytes; the slot has {}",
            w,
            h,
            w * h * 3,
            out.len()
        )));
    }
    let (x, y) = (g.roi.x * g.eighths / 8, g.roi.y * g.eighths / 8);
    let (got, pixels): (Region, &[u8]) = if g.orientation != crate::image::exif::Orientation::UP
        || crate::image::probe::probe(bytes)?.format != crate::image::probe::ImageFormat::Jpeg
    {
        let rgb = decode_shown(bytes, g.orientation)?;
        scratch.decoded = rgb.data;
        let full = Region {
            x: 0,
            y: 0,
            w: rgb.width,
            h: rgb.height,
        };
        (full, &scratch.decoded)
    } else {
        let (t, hdr) = jpeg_header(&mut scratch.turbo, bytes)?;
        let want = Region {
            x,
            y,
            w: g.decoded.0,
            h: g.decoded.1,
        };
        let got = t.decode(bytes, &hdr, g.eighths, Some(want), &mut scratch.decoded)?;
        (got, &scratch.decoded)
    };
    if x < got.x || y < got.y || x + w as u32 > got.x + got.w || y + h as u32 > got.y + got.h {
        return Err(ImageError::Codec(format!(
            "the decoder gave region {got:?}, which does not hold the {w}x{h} region at ({x}, {y})"
        )));
    }
    for row in 0..h {
        let from = ((y - got.y) as usize + row) * got.w as usize * 3 + (x - got.x) as usize * 3;
        out[row * w * 3..(row + 1) * w * 3].copy_from_slice(&pixels[from..from + w * 3]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::frame::test_jpeg;
    use jpeg_encoder::{ColorType, SamplingFactor};

    const ALL: Decoders = crate::image::route::TEST_DECODERS;

    fn batch() -> Vec<Vec<u8>> {
        use SamplingFactor::*;
        let mut v: Vec<Vec<u8>> = (0..12)
            .map(|i| test_jpeg(300 + 40 * i, 260, F_2_2, false, ColorType::Rgb))
            .collect();
        v.push(test_jpeg(320, 240, F_2_2, true, ColorType::Rgb));
        v.push(test_jpeg(320, 240, F_1_1, false, ColorType::Cmyk));
        v.push(b"not an image".to_vec());
        v
    }

    /// Places in the source buffer are aligned, in order, non-overlapping and large enough;
    /// `Cpu` mode sends everything to the CPU and says it was chosen; `Gpu` mode never
    /// moves a GPU image; `Auto` explores the CPU with its threads' worth first.
    #[test]
    fn places_are_aligned_and_modes_route_as_they_say() {
        let b = batch();
        let samples: Vec<(&[u8], SampleRng)> = b
            .iter()
            .enumerate()
            .map(|(i, b)| (&b[..], SampleRng::new(1, 0, 0, i as u64)))
            .collect();
        let spec = ImageSpec::train(224);
        let gpu = Planner::new(spec.clone(), ALL, DecodeMode::Gpu, 4);
        let plan = gpu.plan(&samples);
        assert_eq!(plan.on(Path::Hardware).len(), 12);
        assert_eq!(plan.on(Path::Hybrid), vec![12]);
        assert_eq!(plan.on(Path::Cpu), vec![13, 14]);
        assert_eq!(plan.images[14].geometry, None);
        let mut end = 0;
        for p in &plan.images {
            assert_eq!(p.src % SOURCE_ALIGN, 0);
            assert!(p.src >= end, "places overlap");
            end = p.src + p.geometry.map_or(0, |g| (g.decoded.0 * g.decoded.1 * 3) as usize);
        }
        assert!(plan.source_bytes >= end);
        let cpu = Planner::new(spec.clone(), ALL, DecodeMode::Cpu, 4);
        let plan = cpu.plan(&samples);
        assert!(plan
            .images
            .iter()
            .all(|p| (p.path, p.reason) == (Path::Cpu, Reason::Chosen)));
        assert_eq!(cpu.counts().get(Path::Cpu, Reason::Chosen), 15);
        let auto = Planner::new(spec, ALL, DecodeMode::Auto, 4);
        let plan = auto.plan(&samples);
        let chosen = plan.images.iter().filter(|p| p.reason == Reason::Chosen).count();
        assert_eq!(chosen, 4, "the CPU's first share is one image per thread");
        assert_eq!(auto.split_stats().images.iter().sum::<u64>(), 15);
        assert!(DecodeMode::parse("gpu").is_ok());
        assert!(DecodeMode::parse("GPU").unwrap_err().contains("decode=\"GPU\""));
    }

    /// The CPU's region decode gives exactly the pixels of the same region of a full decode
    /// at the same scale, for JPEG (every scale) and PNG, and refuses a slot too small.
    #[test]
    fn the_cpus_region_is_the_full_decodes_pixels() {
        let spec = ImageSpec::train(96);
        let mut scratch = Scratch::default();
        let jpeg = test_jpeg(900, 700, SamplingFactor::F_2_2, false, ColorType::Rgb);
        let png = {
            let mut out = Vec::new();
            let mut e = png::Encoder::new(&mut out, 50, 40);
            e.set_color(png::ColorType::Rgb);
            let px: Vec<u8> = (0..50 * 40 * 3).map(|i| (i * 13 % 256) as u8).collect();
            e.write_header().unwrap().write_image_data(&px).unwrap();
            out
        };
        let cpu = Decoders {
            hardware: false,
            hybrid: false,
            ..ALL
        };
        let mut scales = std::collections::BTreeSet::new();
        for (name, bytes) in [("jpeg", &jpeg), ("png", &png)] {
            for sample in 0..40 {
                let g = route(bytes, &spec, SampleRng::new(4, 0, 0, sample), &cpu)
                    .geometry
                    .unwrap();
                scales.insert(g.eighths);
                let mut out = vec![0u8; (g.decoded.0 * g.decoded.1 * 3) as usize];
                decode_region(bytes, &g, &mut out, &mut scratch).unwrap();
                let full = crate::image::decode_rgb(bytes, 8 / g.eighths, None).unwrap();
                let (x, y) = ((g.roi.x * g.eighths / 8) as usize, (g.roi.y * g.eighths / 8) as usize);
                let w = g.decoded.0 as usize;
                for row in 0..g.decoded.1 as usize {
                    let from = ((y + row) * full.width as usize + x) * 3;
                    assert!(
                        out[row * w * 3..(row + 1) * w * 3] == full.data[from..from + w * 3],
                        "{name} sample {sample}: row {row} differs"
                    );
                }
                let e = decode_region(bytes, &g, &mut out[..5], &mut scratch).unwrap_err();
                assert!(e.contains("needs"), "{e}");
            }
        }
        assert!(scales.len() >= 2, "only scales {scales:?} exercised");
    }
}
