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
    let mut planner = Planner::new(spec.clone(), decoders, mode, 4);
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
