//! The GPU decode's batches, carried out on the CPU: batches of the ImageNet-like profile are
//! planned (`gpu_batch::Planner`: routes, the split, places in the source buffer); each region
//! a GPU decoder would take is decoded by libjpeg-turbo at the scale it names (standing in
//! for nvJPEG), the CPU's share by `gpu_batch::decode_region`, and the fused kernel's CPU
//! reference makes the batch from the source buffer. The result must be the CPU path's RandomResizedCrop within the
//! kernel's stated tolerance (measured over 150 images in each of the modes `gpu`, `auto`
//! and `cpu`, RandomResizedCrop(224) and the evaluation crop(160): worst mean 0.20 steps,
//! worst pixel 1 step): the regions, scales, MCU widening and crop coordinates that the
//! GPU path hands nvJPEG and the kernel are right, so on a GPU only the decoders' own
//! differences remain (the device check's `nvjpeg` step measures those).

use ramjet_cuda::kernel::{reference, Params, TOLERANCE_U8, TOLERANCE_U8_MEAN};
use ramjet_engine::image::gpu_batch::{decode_region, DecodeMode, Planner};
use ramjet_engine::image::route::{Decoders, Path, Reason};
use ramjet_engine::image::{process, AugmentName, ImageConfig, ImageSpec, SampleRng, Scratch, Slot};
use ramjet_tests::{cpu_region, kernel_job};
use ramjet_tools::synth_imagenet;

/// Batches of the profile planned in `mode`, every path carried out on the CPU, the kernel's
/// reference over the whole source buffer; each image against the CPU path. Returns (images,
/// of them scaled, worst mean, worst max, images per path).
fn run(mode: DecodeMode, augment: AugmentName, out: u32) -> (usize, usize, f64, u32, [usize; 3]) {
    let decoders = Decoders {
        hardware: true,
        hybrid: true,
        scratch_bound: Decoders::SCRATCH_BOUND,
    };
    let spec: ImageSpec = ImageConfig {
        width: out,
        height: out,
        augment,
        ..ImageConfig::default()
    }
    .into();
    let p = Params::normalized(out, out, ramjet_cuda::kernel::OutType::U8, [0.0; 3], [1.0; 3]);
    let planner = Planner::new(spec.clone(), decoders, mode, 4);
    let mut scratch = Scratch::default();
    // The very large ones are slow in a debug build; `route`'s tests cover their geometry.
    let ids: Vec<u64> = (0..160u64)
        .filter(|&i| synth_imagenet::shape(3, i, 0).1 * synth_imagenet::shape(3, i, 0).2 <= 2_000_000)
        .collect();
    let (mut checked, mut scaled, mut worst_mean, mut worst_max, mut per) = (0, 0, 0f64, 0u32, [0usize; 3]);
    for chunk in ids.chunks(32) {
        let bytes: Vec<Vec<u8>> = chunk.iter().map(|&i| synth_imagenet::image(3, i, 0).1).collect();
        let samples: Vec<(&[u8], SampleRng)> = chunk
            .iter()
            .zip(&bytes)
            .map(|(&i, b)| (&b[..], SampleRng::new(9, 2, 0, i)))
            .collect();
        let plan = planner.plan(&samples);
        let mut source = vec![0u8; plan.source_bytes];
        let mut jobs = Vec::new();
        for (k, im) in plan.images.iter().enumerate() {
            let g = im.geometry.expect("the profile has no damaged files here");
            let slot = &mut source[im.src..im.src + (g.decoded.0 * g.decoded.1 * 3) as usize];
            match im.path {
                // libjpeg-turbo stands in for nvJPEG: the same region at the same scale.
                Path::Hardware | Path::Hybrid => slot.copy_from_slice(&cpu_region(&bytes[k], &g)),
                Path::Cpu => decode_region(&bytes[k], &g, slot, &mut scratch).unwrap(),
            }
            jobs.push(kernel_job(im.src as u64, &g));
        }
        let mut got = vec![0u8; jobs.len() * p.image_bytes()];
        reference(&source, &jobs, &p, &mut got);
        for (k, im) in plan.images.iter().enumerate() {
            let g = im.geometry.unwrap();
            // The hybrid decoder cannot scale: its images match the CPU path decoding at full
            // size (the CPU path itself would have used the DCT scale; on the GPU that costs a
            // mean difference of about one step, within the device check's tolerance).
            let cpu_spec = ImageSpec {
                dct_scaling: spec.dct_scaling && im.path != Path::Hybrid,
                ..spec.clone()
            };
            let mut want = vec![0u8; spec.elems()];
            let mut rng = SampleRng::new(9, 2, 0, chunk[k]);
            process(&bytes[k], &cpu_spec, &mut rng, Slot::U8(&mut want), &mut scratch).unwrap();
            let (mut sum, mut max) = (0u64, 0u32);
            for (a, b) in got[k * p.image_bytes()..(k + 1) * p.image_bytes()].iter().zip(&want) {
                let d = a.abs_diff(*b) as u32;
                sum += d as u64;
                max = max.max(d);
            }
            let mean = sum as f64 / want.len() as f64;
            // The kernel's own tolerance against the CPU path: the plan adds nothing.
            assert!(
                mean <= TOLERANCE_U8_MEAN && max <= TOLERANCE_U8 as u32,
                "{mode:?}: image {} ({:?}, {augment:?}, {:?} for {:?} at {}/8, region {:?}, crop {:?}): mean {mean:.3}, max {max}",
                chunk[k],
                synth_imagenet::shape(3, chunk[k], 0),
                im.path,
                im.reason,
                g.eighths,
                g.roi,
                g.crop
            );
            checked += 1;
            scaled += (g.eighths < 8) as usize;
            worst_mean = worst_mean.max(mean);
            worst_max = worst_max.max(max);
            per[im.path as usize] += 1;
        }
        // The split learns from rates the fake paths are given: the engine fast, the CPU slow.
        for (path, rate) in [(Path::Hardware, 4e8), (Path::Hybrid, 1e8), (Path::Cpu, 5e7)] {
            let on: Vec<_> = plan.images.iter().filter(|im| im.path == path).collect();
            let work: f64 = on
                .iter()
                .map(|im| im.geometry.map_or(0.0, |g| g.decoded.0 as f64 * g.decoded.1 as f64))
                .sum();
            planner.observe(path, on.len(), work, work / rate);
        }
    }
    if mode == DecodeMode::Auto {
        assert!(
            planner.counts().get(Path::Cpu, Reason::Chosen) > 0,
            "the split never used the CPU"
        );
    }
    (checked, scaled, worst_mean, worst_max, per)
}

#[test]
fn the_gpu_paths_regions_scales_and_crops_give_the_cpu_paths_pixels() {
    for mode in [DecodeMode::Gpu, DecodeMode::Auto, DecodeMode::Cpu] {
        for (augment, out) in [(AugmentName::Train, 224), (AugmentName::Eval, 160)] {
            let (checked, scaled, mean, max, per) = run(mode, augment, out);
            println!("{mode:?} {augment:?}: {checked} images ({scaled} scaled; hardware, hybrid, cpu: {per:?}): worst mean {mean:.3}, worst max {max}");
            assert!(checked >= 100, "too few images: {checked}");
            if mode == DecodeMode::Gpu && augment == AugmentName::Train {
                assert!(
                    scaled >= 10 && per.iter().all(|&n| n > 0),
                    "not every path and scale exercised: {per:?}, {scaled} scaled"
                );
            }
        }
    }
}

/// A packed folder of `n` ImageNet-profile images of at most 700,000 pixels (every layout of the
/// profile, in a debug build's time).
fn packed_profile(dir: &std::path::Path, n: usize) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("c0")).unwrap();
    let mut made = 0;
    for i in 0..400u64 {
        let (_, w, h) = synth_imagenet::shape(5, i, 0);
        if w * h <= 700_000 {
            std::fs::write(
                src.join("c0").join(format!("{i:04}.jpg")),
                synth_imagenet::image(5, i, 0).1,
            )
            .unwrap();
            made += 1;
        }
        if made == n {
            break;
        }
    }
    let packed = dir.join("packed");
    ramjet_tests::ramjet_ok(&[
        "pack",
        src.to_str().unwrap(),
        packed.to_str().unwrap(),
        "--shard-size",
        "2MiB",
    ]);
    packed
}

/// A loader over `packed` with 96x96 training crops, seed 17; for the GPU path in `gpu`'s mode.
fn loader_config(packed: &std::path::Path, gpu: Option<DecodeMode>) -> ramjet_engine::loader::LoaderConfig {
    let mut stream = ramjet_engine::StreamConfig::new(packed.to_str().unwrap());
    stream.order.seed = 17;
    let mut cfg = ramjet_engine::loader::LoaderConfig::new(stream);
    cfg.batch_size = 12;
    cfg.threads = 2;
    cfg.image = Some(spec96());
    if let Some(mode) = gpu {
        cfg.decode = mode;
        cfg.gpu_decoders = Some(Decoders {
            hardware: true,
            hybrid: true,
            scratch_bound: Decoders::SCRATCH_BOUND,
        });
    }
    cfg
}

fn spec96() -> ImageSpec {
    ImageConfig {
        width: 96,
        height: 96,
        augment: AugmentName::Train,
        ..ImageConfig::default()
    }
    .into()
}

/// Every batch of a loader, and its metrics at the end.
fn all_batches(
    cfg: ramjet_engine::loader::LoaderConfig,
) -> (
    Vec<ramjet_engine::loader::Batch>,
    ramjet_engine::metrics::MetricsSnapshot,
) {
    use ramjet_engine::loader::{Loader, Next};
    let mut l = Loader::start(cfg).unwrap();
    let mut out = Vec::new();
    loop {
        match l.next_batch(std::time::Duration::from_secs(60)).unwrap() {
            Next::Batch(b) => out.push(*b),
            Next::End | Next::EpochEnd(_) => break,
            Next::Pending => panic!("no batch in 60 s"),
        }
    }
    (out, l.metrics().snapshot())
}

/// The CPU path's output for one image of a GPU batch: the CPU loader's, or for the hybrid
/// decoder (which does not scale) the CPU path decoding at full size.
fn cpu_path_image(
    b: &ramjet_engine::loader::Batch,
    k: usize,
    path: Path,
    bitstream: &[u8],
    cpu_loader: &[u8],
) -> Vec<u8> {
    let spec = spec96();
    if path != Path::Hybrid {
        return cpu_loader[k * spec.bytes()..(k + 1) * spec.bytes()].to_vec();
    }
    let mut v = vec![0u8; spec.elems()];
    let mut rng = SampleRng::new(17, b.epoch, b.sources[k] as u32, b.indices[k] as u64);
    let cpu_spec = ImageSpec {
        dct_scaling: false,
        ..spec
    };
    process(
        bitstream,
        &cpu_spec,
        &mut rng,
        Slot::U8(&mut v),
        &mut Scratch::default(),
    )
    .unwrap();
    v
}

/// Mean and largest difference of two images.
fn diff(a: &[u8], b: &[u8]) -> (f64, u8) {
    let (sum, max) = a.iter().zip(b).fold((0u64, 0u8), |(s, m), (x, y)| {
        (s + x.abs_diff(*y) as u64, m.max(x.abs_diff(*y)))
    });
    (sum as f64 / a.len() as f64, max)
}

/// The whole GPU decode path end to end on the CPU: the loader's GPU batches go through the
/// GPU side (`decode_batch::run_source_batch`) with the fake nvJPEG decoding by libjpeg-turbo
/// behind nvJPEG's function table, "device memory" of host memory and the kernel's CPU
/// reference; the output is the CPU loader's batch within the kernel's tolerance, every route
/// is taken (the engine refusing the progressive images sends them to the hybrid decoder),
/// and the GPU decoders' measured rates reach the loader's metrics.
#[test]
fn the_gpu_decode_path_end_to_end_on_fakes_gives_the_cpu_loaders_batches() {
    use ramjet_cuda::decode_batch::{fake::Host, run_source_batch, Stage};
    use ramjet_cuda::nvjpeg::decoder::fake::{Fake, Heap, Pixels};
    use ramjet_cuda::nvjpeg::decoder::{Bridge, HardwareDecoder, HybridDecoder};
    use ramjet_cuda::nvjpeg::Backend;
    use ramjet_engine::loader::{ColumnData, Loader, Next};
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let packed = packed_profile(tmp.path(), 40);
    let (want, _) = all_batches(loader_config(&packed, None));
    // libjpeg-turbo behind the fake's function table: the region at the scale nvJPEG is asked.
    let turbo: Pixels = Arc::new(|data: &[u8], roi: (i32, i32, i32, i32), sf: i32| {
        let div = 1u32 << sf;
        let full = ramjet_engine::image::decode_rgb(data, div, None).ok()?;
        let (x, y) = (roi.0 as u32 / div, roi.1 as u32 / div);
        let (w, h) = ((roi.2 as u32).div_ceil(div), (roi.3 as u32).div_ceil(div));
        if x + w > full.width || y + h > full.height {
            return None;
        }
        let mut out = Vec::with_capacity((w * h * 3) as usize);
        for row in y..y + h {
            let at = ((row * full.width + x) * 3) as usize;
            out.extend_from_slice(&full.data[at..at + (w * 3) as usize]);
        }
        Some(out)
    });
    let spec = spec96();
    for mode in [DecodeMode::Gpu, DecodeMode::Auto] {
        let heap = Heap::default();
        let fake = Fake::with_pixels(turbo.clone(), true);
        let bridge = |bound| Bridge::new(heap.clone(), bound);
        let hw = HardwareDecoder::open(fake.clone(), bridge(1 << 30), bridge(1 << 30), None).unwrap();
        let hybrid = HybridDecoder::open(fake.clone(), Backend::Hybrid, bridge(1 << 30), bridge(1 << 30)).unwrap();
        let mut stage = Stage::new(
            Host::default(),
            hw,
            Some(hybrid),
            ramjet_cuda::pool::Pool::new(heap.clone(), 256 << 20),
        );
        let mut l = Loader::start(loader_config(&packed, Some(mode))).unwrap();
        let planner = l.planner().expect("a GPU loader has a planner").clone();
        let (mut per_route, mut fell_back, mut n, mut worst) = ([0usize; 3], 0usize, 0usize, 0f64);
        for w in &want {
            let Next::Batch(g) = l.next_batch(std::time::Duration::from_secs(60)).unwrap() else {
                panic!("{mode:?}: fewer batches than the CPU loader")
            };
            assert_eq!(g.indices, w.indices);
            let ColumnData::ImageSource(sb) = &g.columns.iter().find(|(c, _)| c == "image").unwrap().1 else {
                panic!("not a source batch")
            };
            let ColumnData::Image { buf, .. } = &w.columns.iter().find(|(c, _)| c == "image").unwrap().1 else {
                panic!("not decoded")
            };
            let (d, skipped) =
                run_source_batch(&mut stage, sb, &spec, Some(&planner), Some(&l.metrics()), false).unwrap();
            assert!(skipped.is_empty());
            assert_eq!(d.kept.len(), g.indices.len());
            // SAFETY: the host device's output buffer is host memory, written by the reference.
            let out = unsafe { std::slice::from_raw_parts(d.out.addr() as *const u8, d.kept.len() * spec.bytes()) };
            for k in 0..d.kept.len() {
                let path = sb.plan.images[k].path;
                let want_px = cpu_path_image(&g, k, path, &sb.bitstreams[k], buf.as_slice());
                let (mean, max) = diff(&out[k * spec.bytes()..(k + 1) * spec.bytes()], &want_px);
                assert!(
                    mean <= TOLERANCE_U8_MEAN && max <= TOLERANCE_U8,
                    "{mode:?}: sample {} routed {path:?}: mean {mean:.3}, max {max}",
                    sb.samples[k]
                );
                worst = worst.max(mean);
            }
            for (total, n) in per_route.iter_mut().zip(d.per_route) {
                *total += n;
            }
            fell_back += d.fell_back.len();
            n += d.kept.len();
        }
        assert!(matches!(
            l.next_batch(std::time::Duration::from_secs(60)).unwrap(),
            Next::End
        ));
        // One more round of observations: the last batch's events completed.
        run_source_batch(&mut stage, &empty_batch(), &spec, Some(&planner), None, false).unwrap();
        let snap = l.metrics().snapshot();
        assert_eq!(
            snap.images_decoded as usize, n,
            "{mode:?}: images decoded, the CPU's and the GPU's"
        );
        let m = snap.decode;
        println!("{mode:?}: {n} images, per route {per_route:?}, {fell_back} fell back, worst mean {worst:.3}; {m:?}");
        assert!(per_route[0] > 0 && per_route[1] > 0, "{mode:?}: {per_route:?}");
        if mode == DecodeMode::Auto {
            assert!(per_route[2] > 0, "the split never used the CPU");
        }
        assert!(
            m.contains_key("decode_rate_hardware_px_s") && m.contains_key("decode_rate_hybrid_px_s"),
            "{m:?}"
        );
        drop(stage);
        assert_eq!(fake.live_handles(), 0);
    }
}

/// A GPU batch of no images.
fn empty_batch() -> ramjet_engine::image::gpu_batch::SourceBatch {
    let pool = ramjet_engine::buf::HostPool::new(Box::new(ramjet_engine::buf::AlignedAlloc), 1);
    ramjet_engine::image::gpu_batch::SourceBatch {
        plan: ramjet_engine::image::gpu_batch::BatchPlan {
            images: Vec::new(),
            source_bytes: 0,
        },
        source: pool.take(64).unwrap(),
        bitstreams: Vec::new(),
        shards: Vec::new(),
        samples: Vec::new(),
    }
}

/// The loader makes batches for the GPU path (`LoaderConfig::gpu_decoders`): the image column
/// leaves as a `SourceBatch` with the CPU's share decoded into its places and every image's
/// bitstream beside it. Carried out on the CPU (libjpeg-turbo standing in for nvJPEG, the
/// kernel's reference), each batch is the CPU loader's batch of the same seed within the
/// kernel's tolerance: the same samples in the same order, each with its own random crop and
/// flip (the generator seeded by epoch, source and index as on the CPU path). The routes and
/// the split show in the loader's metrics, and the CPU's share is counted as decoded.
#[test]
fn the_loaders_gpu_batches_carried_out_on_the_cpu_are_the_cpu_loaders_batches() {
    use ramjet_engine::loader::ColumnData;

    let tmp = tempfile::tempdir().unwrap();
    let packed = packed_profile(tmp.path(), 56);
    let (want, cpu_metrics) = all_batches(loader_config(&packed, None));
    assert!(cpu_metrics.decode.is_empty(), "{:?}", cpu_metrics.decode);
    let p = Params::normalized(96, 96, ramjet_cuda::kernel::OutType::U8, [0.0; 3], [1.0; 3]);
    for mode in [DecodeMode::Gpu, DecodeMode::Auto, DecodeMode::Cpu] {
        let (got, metrics) = all_batches(loader_config(&packed, Some(mode)));
        assert_eq!(got.len(), want.len(), "{mode:?}: batches");
        let (mut images, mut cpu_share, mut worst) = (0u64, 0u64, 0f64);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.indices, w.indices, "{mode:?}: another order");
            let ColumnData::ImageSource(sb) = &g.columns.iter().find(|(c, _)| c == "image").unwrap().1 else {
                panic!("{mode:?}: the image column is not a source batch")
            };
            let ColumnData::Image { buf, .. } = &w.columns.iter().find(|(c, _)| c == "image").unwrap().1 else {
                panic!("the CPU loader's image column is not decoded")
            };
            assert_eq!(sb.plan.images.len(), g.indices.len());
            assert_eq!(sb.samples, g.indices.iter().map(|&i| i as u64).collect::<Vec<_>>());
            assert!(sb.source.len() >= sb.plan.source_bytes);
            let mut source = sb.source.as_slice()[..sb.plan.source_bytes].to_vec();
            let mut jobs = Vec::new();
            for (k, im) in sb.plan.images.iter().enumerate() {
                let geo = im.geometry.expect("a packed image's header reads");
                if im.path != Path::Cpu {
                    source[im.src..im.src + im.source_len()].copy_from_slice(&cpu_region(&sb.bitstreams[k], &geo));
                } else {
                    cpu_share += 1;
                }
                jobs.push(kernel_job(im.src as u64, &geo));
            }
            let mut out = vec![0u8; jobs.len() * p.image_bytes()];
            reference(&source, &jobs, &p, &mut out);
            for (k, im) in sb.plan.images.iter().enumerate() {
                let range = k * p.image_bytes()..(k + 1) * p.image_bytes();
                let expected = cpu_path_image(g, k, im.path, &sb.bitstreams[k], buf.as_slice());
                let (mean, max) = diff(&out[range], &expected);
                assert!(
                    mean <= TOLERANCE_U8_MEAN && max <= TOLERANCE_U8,
                    "{mode:?}: sample {} on {:?} ({:?}): mean {mean:.3}, max {max}",
                    sb.samples[k],
                    im.path,
                    im.reason
                );
                worst = worst.max(mean);
                images += 1;
            }
        }
        let m = &metrics.decode;
        let routed: f64 = ["hardware", "hybrid", "cpu"]
            .iter()
            .map(|p| m[&format!("decode_{p}")])
            .sum();
        assert_eq!(routed as u64, images, "{mode:?}: metrics {m:?}");
        assert_eq!(m["decode_cpu"] as u64, cpu_share, "{mode:?}: {m:?}");
        assert_eq!(
            metrics.images_decoded, cpu_share,
            "{mode:?}: the GPU side counts its own"
        );
        match mode {
            DecodeMode::Cpu => assert_eq!(cpu_share, images),
            DecodeMode::Gpu => assert!(m["decode_hardware"] > 0.0 && m["decode_hybrid"] > 0.0, "{m:?}"),
            DecodeMode::Auto => assert!(
                m.contains_key("decode_rate_cpu_px_s") && m["decode_cpu_chosen"] > 0.0,
                "{m:?}"
            ),
        }
        println!("{mode:?}: {images} images, {cpu_share} on the CPU, worst mean {worst:.3}; {m:?}");
    }
}

/// The nvJPEG GPU test's engine loop (`ramjet_tests::engine_batches`) against the fake: the
/// images go to the engine a bounded batch at a time; a refused (progressive) image goes to the
/// hybrid decoder; a batch whose scratch is over the bound fails whole, its images go to the
/// hybrid decoder too, and the batch after it still runs; with every image refused the engine
/// decodes none (the GPU test then reports the rate figure as "none" rather than divide by 0).
#[test]
fn the_nvjpeg_checks_engine_batches_keep_going_past_a_refusal_and_a_failed_batch() {
    use ramjet_cuda::nvjpeg::decoder::fake::{Fake, Heap};
    use ramjet_cuda::nvjpeg::decoder::{Bridge, HardwareDecoder, Job};
    use ramjet_tests::engine_batches;

    fn jpeg(marker: u8, w: u16, h: u16) -> Vec<u8> {
        let mut j = vec![0xFF, 0xD8, 0xFF, marker, 0, 11, 8];
        j.extend_from_slice(&h.to_be_bytes());
        j.extend_from_slice(&w.to_be_bytes());
        j.extend_from_slice(&[1, 1, 0x11, 0, 0xFF, 0xD9]);
        j
    }
    // 0xC0: baseline (the engine takes it); 0xC2: progressive (refused). Image 4 needs more
    // scratch than the bound.
    let shapes: [(u8, u16); 7] = [
        (0xC0, 64),
        (0xC0, 64),
        (0xC2, 64),
        (0xC0, 64),
        (0xC0, 400),
        (0xC0, 64),
        (0xC0, 64),
    ];
    let images: Vec<Vec<u8>> = shapes.iter().map(|&(m, s)| jpeg(m, s, s)).collect();
    let mut dst: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(_, s)| vec![0u8; 3 * s as usize * s as usize])
        .collect();
    let addrs: Vec<u64> = dst.iter_mut().map(|d| d.as_mut_ptr() as u64).collect();
    let job = |i: usize| {
        let s = shapes[i].1 as u32;
        Job {
            data: &images[i],
            roi: (0, 0, s, s),
            eighths: 8,
            dst: addrs[i],
            pitch: 3 * s as usize,
        }
    };
    let heap = Heap::default();
    let fake = Fake::default();
    let bound = 3 * 200 * 200;
    let mut hw = HardwareDecoder::open(
        fake.clone(),
        Bridge::new(heap.clone(), bound),
        Bridge::new(heap, usize::MAX),
        None,
    )
    .unwrap()
    .expect("the fake has an engine");
    let ids: Vec<usize> = (0..images.len()).collect();
    let split = engine_batches(&mut hw, &ids, job, 0, 3);
    assert_eq!(fake.calls("batched"), 3, "{split:?}");
    assert_eq!(split.decoded, vec![0, 1, 6], "{split:?}");
    assert_eq!(split.to_hybrid, vec![2, 3, 4, 5], "{split:?}");
    assert_eq!((split.refused, split.failed), (1, 3));
    assert!(
        split
            .log
            .iter()
            .any(|l| l.contains("image 2") && l.contains("NOT_SUPPORTED")),
        "{:?}",
        split.log
    );
    assert!(
        split
            .log
            .iter()
            .any(|l| l.contains("batch of 3 images failed") && l.contains("ALLOCATOR_FAILURE")),
        "{:?}",
        split.log
    );
    let refused_all = engine_batches(&mut hw, &[2], job, 0, 3);
    assert!(
        refused_all.decoded.is_empty() && refused_all.to_hybrid == vec![2],
        "{refused_all:?}"
    );
}
