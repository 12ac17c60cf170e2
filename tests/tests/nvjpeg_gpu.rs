//! nvJPEG on a GPU (issue 41's device-check step `nvjpeg`): the real library behind the
//! decoders that the fake tests hold to nvJPEG's contract (`ramjet-cuda`'s
//! `nvjpeg::decoder` tests), over the ImageNet-like synthetic profile (every JPEG layout,
//! some damaged).
//!
//! What it checks, on one GPU:
//! - each image is routed (hardware engine, hybrid, CPU) from its header, and every path is
//!   taken where the GPU has an engine;
//! - every GPU-decoded region (with the engine's scale factor) equals libjpeg-turbo's decode
//!   of the same region at the same scale, within [`DECODE_MEAN_MAX`] mean absolute
//!   difference per image (the two IDCTs and chroma upsamplers differ);
//! - the fused kernel over those regions gives the CPU path's RandomResizedCrop within
//!   [`RRC_MEAN_MAX`] per image (the same crop boxes and flips: the same `SampleRng`);
//! - a decode over the scratch bound fails by name, and nothing is left allocated;
//! - device memory stays flat over 10 rounds of decoding;
//! - the rate of decode + RandomResizedCrop(224) + normalise to bf16 on the engine, from
//!   pinned host bytes, batches of 256.
//!
//! It prints `FIGURE name value` lines, which the device check collects into its summary.
//! Never run yet: no GPU has been lent to this project so far.

use std::fmt::Display;
use std::time::Instant;

use ramjet_cuda::gpu::{DevSpan, FusedKernel, Gpu};
use ramjet_cuda::kernel::{Job as KernelJob, OutType, Params};
use ramjet_cuda::libs::{site_packages, Search};
use ramjet_cuda::nvjpeg::decoder::{Bridge, HardwareDecoder, HybridDecoder, Job};
use ramjet_cuda::nvjpeg::{self, Backend, Table};
use ramjet_cuda::nvrtc::Nvrtc;
use ramjet_cuda::pool::{CudaDevice, CudaHost};
use ramjet_engine::image::route::{route, Decoders, Geometry, Path, RouteCounts};
use ramjet_engine::image::{process, ImageSpec, SampleRng, Scratch, Slot};
use ramjet_tests::{cpu_region, engine_batches, kernel_job};
use ramjet_tools::synth_imagenet;

/// The most the mean absolute difference between nvJPEG's and libjpeg-turbo's decode of one
/// image's region may be, in 8-bit steps. Their IDCTs round differently and libjpeg-turbo
/// upsamples chroma with a triangle filter; a wrong region, scale or colour conversion gives
/// tens of steps.
const DECODE_MEAN_MAX: f64 = 4.0;
/// The same for the whole RandomResizedCrop(224) output against the CPU path's.
const RRC_MEAN_MAX: f64 = 4.0;
const IMAGES: u64 = 400;
/// Images per engine batch in the check (the loader's batches are of this order).
const ENGINE_BATCH: usize = 32;

fn figure(name: &str, v: impl Display) {
    println!("FIGURE {name} {v}");
}

fn mean_max(a: &[u8], b: &[u8]) -> (f64, u8) {
    assert_eq!(a.len(), b.len());
    let (mut sum, mut max) = (0u64, 0u8);
    for (x, y) in a.iter().zip(b) {
        let d = x.abs_diff(*y);
        sum += d as u64;
        max = max.max(d);
    }
    (sum as f64 / a.len().max(1) as f64, max)
}

#[test]
#[ignore = "needs a GPU and nvJPEG: RAMJET_GPU_TESTS=1 (the device check's nvjpeg step)"]
fn gpu_nvjpeg_decodes_every_path_as_the_cpu_does() {
    assert_eq!(
        std::env::var("RAMJET_GPU_TESTS").as_deref(),
        Ok("1"),
        "set RAMJET_GPU_TESTS=1"
    );
    let t0 = Instant::now();
    let gpu = Gpu::open(0).unwrap_or_else(|e| panic!("{e}"));
    let roots = std::env::var_os("RAMJET_VENV")
        .map(|v| site_packages(std::path::Path::new(&v)))
        .unwrap_or_default();
    let search = Search::from_env(&roots);
    let table = Table::find(&search).unwrap_or_else(|e| panic!("{e}"));
    let (a, b, c) = nvjpeg::version(&table).unwrap_or_else(|e| panic!("{e}"));
    figure("nvjpeg_version", format!("{a}.{b}.{c}"));
    println!("nvJPEG from {}", table.path().display());
    let ctx = gpu.context().clone();
    let _current = ramjet_cuda::current::enter(&ctx).unwrap();
    let bound = Decoders::SCRATCH_BOUND as usize;
    let bridges = |bound: usize| {
        (
            Bridge::new(CudaDevice::new(ctx.clone()), bound),
            Bridge::new(CudaHost::new(ctx.clone()), usize::MAX),
        )
    };
    let (d, p) = bridges(bound);
    let mut hw = HardwareDecoder::open(&table, d, p, Some((256, 640, 480))).unwrap_or_else(|e| panic!("{e}"));
    figure("hardware_engine", hw.is_some() as u8);
    let (d, p) = bridges(bound);
    let mut hybrid = HybridDecoder::open(&table, Backend::Hybrid, d, p).unwrap_or_else(|e| panic!("{e}"));
    let decoders = Decoders {
        hardware: hw.is_some(),
        hybrid: true,
        scratch_bound: bound as u64,
    };
    let no_engine = Decoders {
        hardware: false,
        ..decoders
    };
    figure("setup_s", format!("{:.2}", t0.elapsed().as_secs_f64()));

    // The profile, routed; each GPU image's hybrid geometry too, for an engine refusal.
    let spec = ImageSpec::train(224);
    let images: Vec<Vec<u8>> = (0..IMAGES).map(|i| synth_imagenet::image(11, i, 10).1).collect();
    let rng = |i: usize| SampleRng::new(5, 0, 0, i as u64);
    let routes: Vec<_> = images
        .iter()
        .enumerate()
        .map(|(i, b)| route(b, &spec, rng(i), &decoders))
        .collect();
    let fallback: Vec<_> = images
        .iter()
        .enumerate()
        .map(|(i, b)| route(b, &spec, rng(i), &no_engine))
        .collect();
    let mut counts = RouteCounts::default();
    for r in &routes {
        counts.add(r.path, r.reason);
    }
    for ((p, r), n) in &counts.counts {
        figure(&format!("routed_{}_{}", p.name(), r.name()), n);
    }
    let size = |g: &Option<Geometry>| g.map_or(0, |g| (g.decoded.0 * g.decoded.1 * 3) as usize);
    let mut offsets = vec![0usize; images.len()];
    let mut total = 0usize;
    for i in 0..images.len() {
        offsets[i] = total;
        total += size(&routes[i].geometry).max(size(&fallback[i].geometry)).div_ceil(256) * 256;
    }
    let dev = gpu.device_pool(total + (256 << 20));
    let src = dev.get(total.max(1)).unwrap();
    let pinned = gpu.pinned_pool(1 << 30);
    let mut bits = pinned.get(images.iter().map(Vec::len).sum()).unwrap();
    let mut starts = Vec::new();
    {
        let h = bits.host_slice_mut().unwrap();
        let mut at = 0;
        for b in &images {
            h[at..at + b.len()].copy_from_slice(b);
            starts.push(at);
            at += b.len();
        }
    }
    let host: &[u8] = bits.host_slice_mut().unwrap();
    let data = |i: usize| &host[starts[i]..starts[i] + images[i].len()];
    let job = |i: usize, g: &Geometry| Job {
        data: data(i),
        roi: (g.roi.x, g.roi.y, g.roi.w, g.roi.h),
        eighths: g.eighths,
        dst: src.addr() + offsets[i] as u64,
        pitch: 3 * g.decoded.0 as usize,
    };

    // Decode: the engine's batch, then the hybrid decoder for what it refused and what was
    // routed to it; what the hybrid decoder refuses is the CPU's.
    let stream = gpu.stream_handle();
    let mut decoded: Vec<Option<(Path, Geometry)>> = vec![None; images.len()];
    let mut to_hybrid: Vec<usize> = (0..images.len()).filter(|&i| routes[i].path == Path::Hybrid).collect();
    if let Some(hw) = hw.as_mut() {
        let ids: Vec<usize> = (0..images.len())
            .filter(|&i| routes[i].path == Path::Hardware)
            .collect();
        // In batches of ENGINE_BATCH (the loader's size, not every image at once under the
        // scratch bound); a batch the engine fails goes to the hybrid decoder whole, its error
        // recorded, so the later figures still come (fake-tested: `gpu_decode_plan.rs`).
        let split = engine_batches(hw, &ids, |i| job(i, &routes[i].geometry.unwrap()), stream, ENGINE_BATCH);
        split.log.iter().for_each(|l| println!("{l}"));
        for &i in &split.decoded {
            decoded[i] = Some((Path::Hardware, routes[i].geometry.unwrap()));
        }
        to_hybrid.extend_from_slice(&split.to_hybrid);
        let (refused, failed) = (split.refused, split.failed);
        figure("engine_refused", refused);
        figure("engine_batch_failed_images", failed);
    }
    let mut cpu_fallbacks = 0;
    for &i in &to_hybrid {
        let Some(g) = fallback[i].geometry.filter(|_| fallback[i].path == Path::Hybrid) else {
            cpu_fallbacks += 1;
            continue;
        };
        let mut mark = || gpu.record().map(|e| Box::new(e) as Box<dyn ramjet_cuda::pool::Fence>);
        match hybrid.decode(i, &job(i, &g), stream, &mut mark) {
            Ok(()) => decoded[i] = Some((Path::Hybrid, g)),
            Err(e) => {
                println!("hybrid refused image {i}: {e}");
                cpu_fallbacks += 1;
            }
        }
    }
    figure("hybrid_decoded", hybrid.decoded());
    figure("cpu_fallbacks", cpu_fallbacks);

    // Every GPU-decoded region against libjpeg-turbo's (damaged files excepted: each decoder
    // makes what it can of them).
    let mut worst = (0f64, 0u8, 0usize);
    let mut sum = 0f64;
    let mut n = 0;
    for (i, d) in decoded.iter().enumerate() {
        let Some((path, g)) = d else { continue };
        if synth_imagenet::shape(11, i as u64, 10).0 == synth_imagenet::Kind::Damaged {
            continue;
        }
        let mut got = vec![0u8; size(&Some(*g))];
        gpu.copy_to_host(&src, offsets[i], &mut got).unwrap();
        let (mean, max) = mean_max(&got, &cpu_region(&images[i], g));
        assert!(
            mean <= DECODE_MEAN_MAX,
            "image {i} ({path:?}, {:?}, eighths {}): mean difference {mean:.2} from libjpeg-turbo (max {max})",
            synth_imagenet::shape(11, i as u64, 10),
            g.eighths
        );
        if mean > worst.0 {
            worst = (mean, max, i);
        }
        sum += mean;
        n += 1;
    }
    figure("decode_images_compared", n);
    figure("decode_mean_abs_diff_vs_cpu", format!("{:.3}", sum / n.max(1) as f64));
    figure("decode_worst_image_mean_abs_diff", format!("{:.3}", worst.0));
    figure("decode_worst_image_max_abs_diff", worst.1);

    // The fused kernel over the decoded regions against the CPU path's RandomResizedCrop.
    let nvrtc = Nvrtc::find(&search).unwrap_or_else(|e| panic!("{e}"));
    let kernel = FusedKernel::load(&gpu, &nvrtc).unwrap_or_else(|e| panic!("{e}"));
    let ids: Vec<usize> = (0..images.len()).filter(|&i| decoded[i].is_some()).collect();
    let kjob = |i: usize, g: &Geometry| kernel_job(offsets[i] as u64, g);
    let kjobs: Vec<KernelJob> = ids.iter().map(|&i| kjob(i, &decoded[i].unwrap().1)).collect();
    let p = Params::normalized(224, 224, OutType::U8, [0.0; 3], [1.0; 3]);
    let out = dev.get(kjobs.len() * p.image_bytes()).unwrap();
    kernel
        .launch(&gpu, DevSpan::of(&src), &kjobs, DevSpan::of(&out), &p)
        .unwrap();
    let mut got = vec![0u8; kjobs.len() * p.image_bytes()];
    gpu.copy_to_host(&out, 0, &mut got).unwrap();
    let (mut rsum, mut rworst) = (0f64, 0f64);
    let mut scratch = Scratch::default();
    let mut compared = 0;
    for (k, &i) in ids.iter().enumerate() {
        if synth_imagenet::shape(11, i as u64, 10).0 == synth_imagenet::Kind::Damaged {
            continue;
        }
        let mut want = vec![0u8; spec.elems()];
        process(&images[i], &spec, &mut rng(i), Slot::U8(&mut want), &mut scratch).unwrap();
        let (mean, max) = mean_max(&got[k * p.image_bytes()..(k + 1) * p.image_bytes()], &want);
        assert!(
            mean <= RRC_MEAN_MAX,
            "image {i}: RandomResizedCrop differs from the CPU path's by {mean:.2} (max {max})"
        );
        rsum += mean;
        rworst = rworst.max(mean);
        compared += 1;
    }
    figure("rrc_images_compared", compared);
    figure(
        "rrc_mean_abs_diff_vs_cpu_path",
        format!("{:.3}", rsum / compared.max(1) as f64),
    );
    figure("rrc_worst_image_mean_abs_diff", format!("{:.3}", rworst));

    // The scratch bound, on the real library: a 1 MiB bound and a large image.
    if hw.is_some() {
        let big = (0..IMAGES as usize)
            .filter(|&i| routes[i].path == Path::Hardware)
            .max_by_key(|&i| routes[i].geometry.unwrap().decoded.0 * routes[i].geometry.unwrap().decoded.1)
            .unwrap();
        let (d, p) = bridges(1 << 20);
        match HardwareDecoder::open(&table, d, p, None) {
            Ok(Some(mut tight)) => {
                let g = routes[big].geometry.unwrap();
                match tight.decode(&[job(big, &g)], stream) {
                    Err(e) => {
                        println!("over the bound, as it should: {e}");
                        assert!(e.to_string().contains("ALLOCATOR_FAILURE"), "{e}");
                    }
                    Ok(_) => println!("image {big} decoded under a 1 MiB bound: its scratch was smaller"),
                }
                let (m, _) = tight.memory();
                figure("bound_refusals", m.refused);
            }
            // Opening itself under the bound may fail: that is the bound refusing too.
            Ok(None) => figure("bound_refusals", "none: no engine under a 1 MiB bound"),
            Err(e) => figure("bound_refusals", format!("open refused under a 1 MiB bound: {e}")),
        }
    }

    // Throughput and flat memory: the engine's images in batches of 256, decode + kernel to
    // bf16, 10 rounds of 2,048 images; device memory read before round 2 and after round 10.
    let Some(hw) = hw.as_mut() else {
        figure("nvjpeg_rrc_img_s", "none: no hardware engine");
        return;
    };
    let eligible: Vec<usize> = (0..images.len())
        .filter(|&i| decoded[i].map(|d| d.0) == Some(Path::Hardware))
        .collect();
    if eligible.is_empty() {
        figure("nvjpeg_rrc_img_s", "none: the engine decoded no image");
        return;
    }
    let pb = Params::normalized(224, 224, OutType::BF16, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
    let out = dev.get(256 * pb.image_bytes()).unwrap();
    let mut rates = Vec::new();
    let mut free_before = 0usize;
    for round in 0..10 {
        if round == 1 {
            free_before = cudarc::driver::result::mem_get_info().unwrap().0;
        }
        let t = Instant::now();
        for b in 0..8 {
            let batch: Vec<usize> = (0..256).map(|k| eligible[(b * 256 + k) % eligible.len()]).collect();
            let jobs: Vec<Job<'_>> = batch.iter().map(|&i| job(i, &routes[i].geometry.unwrap())).collect();
            let rep = hw.decode(&jobs, stream).unwrap();
            assert_eq!(rep.decoded.len(), 256);
            let kj: Vec<KernelJob> = batch.iter().map(|&i| kjob(i, &routes[i].geometry.unwrap())).collect();
            kernel
                .launch(&gpu, DevSpan::of(&src), &kj, DevSpan::of(&out), &pb)
                .unwrap();
        }
        let done = gpu.record().unwrap();
        while !ramjet_cuda::pool::Fence::is_complete(&done).unwrap() {
            std::hint::spin_loop();
        }
        rates.push(2048.0 / t.elapsed().as_secs_f64());
    }
    let drift = free_before as i64 - cudarc::driver::result::mem_get_info().unwrap().0 as i64;
    let mut sorted = rates.clone();
    sorted.sort_by(f64::total_cmp);
    figure("nvjpeg_rrc_img_s", format!("{:.0}", sorted[sorted.len() / 2]));
    figure("nvjpeg_rrc_img_s_rounds", format!("{rates:.0?}").replace(' ', ""));
    figure(
        "device_memory_drift_mib",
        format!("{:.1}", drift as f64 / (1 << 20) as f64),
    );
    let (m, _) = hw.memory();
    figure(
        "engine_scratch_peak_mib",
        format!("{:.1}", m.peak as f64 / (1 << 20) as f64),
    );
    assert!(drift < 64 << 20, "device memory grew by {drift} B over 9 rounds");
}
