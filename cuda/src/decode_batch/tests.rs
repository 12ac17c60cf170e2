//! The stage against the fake nvJPEG and a fake device whose "device memory" is host memory
//! and whose kernel is the kernel's CPU reference.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::fake::{Ev, Host};
use super::*;
use crate::kernel::{reference, OutType};
use crate::nvjpeg::decoder::fake::{Fake, Heap, Pixels};
use crate::nvjpeg::decoder::Bridge;
use crate::nvjpeg::Backend;

/// A JPEG-shaped bitstream the fake reads: start, a frame header of `marker` and size, end.
fn jpeg(marker: u8, w: u16, h: u16) -> Vec<u8> {
    let mut j = vec![0xFF, 0xD8, 0xFF, marker, 0, 11, 8];
    j.extend_from_slice(&h.to_be_bytes());
    j.extend_from_slice(&w.to_be_bytes());
    j.extend_from_slice(&[1, 1, 0x11, 0, 0xFF, 0xD9]);
    j
}

/// The "decoded" pixels of a region: a pattern of the file, the region and the scale.
fn pattern(data: &[u8], roi: (i32, i32, i32, i32), sf: i32) -> Vec<u8> {
    let div = 1usize << sf;
    let (w, h) = ((roi.2 as usize).div_ceil(div), (roi.3 as usize).div_ceil(div));
    (0..w * h * 3)
        .map(|i| (i * 7 + data.len() * 3 + roi.0 as usize + 50 * sf as usize) as u8)
        .collect()
}

fn fake_pixels() -> Pixels {
    Arc::new(|data: &[u8], roi: (i32, i32, i32, i32), sf: i32| Some(pattern(data, roi, sf)))
}

fn stage(engine: bool, heap: &Heap, fake: &Fake) -> Stage<Fake, Host> {
    let bridge = |bound| Bridge::new(heap.clone(), bound);
    let hw = if engine {
        HardwareDecoder::open(fake.clone(), bridge(1 << 30), bridge(1 << 30), None).unwrap()
    } else {
        None
    };
    let hybrid = HybridDecoder::open(fake.clone(), Backend::Hybrid, bridge(1 << 30), bridge(1 << 30)).unwrap();
    Stage::new(Host::default(), hw, Some(hybrid), Pool::new(heap.clone(), 64 << 20))
}

/// A region `(x, y, w, h)`.
type Roi = (u32, u32, u32, u32);

/// A batch: (route, file, region, eighths) per image, placed one after another.
struct Batch {
    files: Vec<Vec<u8>>,
    spec: Vec<(Route, Roi, u32)>,
}

impl Batch {
    fn images(&self) -> (Vec<Image<'_>>, usize) {
        let mut at = 0;
        let mut out = Vec::new();
        for (f, &(route, roi, eighths)) in self.files.iter().zip(&self.spec) {
            let div = 8 / eighths;
            let decoded = (roi.2.div_ceil(div), roi.3.div_ceil(div));
            out.push(Image {
                route,
                data: f,
                src: at,
                decoded,
                roi,
                eighths,
                crop: (1.0, 2.0, decoded.0 as f32 - 3.0, decoded.1 as f32 - 4.0),
                flip: at % 512 == 0,
            });
            at += (decoded.0 * decoded.1 * 3).div_ceil(256) as usize * 256;
        }
        (out, at)
    }
}

fn cpu_pixels<'a>(images: &'a [Image<'a>]) -> impl FnMut(usize) -> Result<Vec<u8>, ramjet_engine::Invalid> + 'a {
    move |k| {
        let im = &images[k];
        if !im.data.starts_with(&[0xFF, 0xD8]) {
            return Err("not a JPEG".into());
        }
        let sf = (8 / im.eighths).trailing_zeros() as i32;
        let roi = (im.roi.0 as i32, im.roi.1 as i32, im.roi.2 as i32, im.roi.3 as i32);
        Ok(pattern(im.data, roi, sf))
    }
}

/// What the kernel should make: the reference over the source buffer as each decoder would
/// have filled it.
fn expected(images: &[Image<'_>], host: &[u8], size: usize, keep: &[usize], p: &Params) -> Vec<u8> {
    let mut src = vec![0u8; size];
    for im in images {
        let px = if im.route == Route::Cpu {
            host[im.src..im.src + im.bytes()].to_vec()
        } else {
            let sf = (8 / im.eighths).trailing_zeros() as i32;
            pattern(
                im.data,
                (im.roi.0 as i32, im.roi.1 as i32, im.roi.2 as i32, im.roi.3 as i32),
                sf,
            )
        };
        src[im.src..im.src + im.bytes()].copy_from_slice(&px);
    }
    let jobs: Vec<KernelJob> = keep.iter().map(|&k| images[k].kernel_job()).collect();
    let mut out = vec![0u8; jobs.len() * p.image_bytes()];
    reference(&src, &jobs, p, &mut out);
    out
}

/// The first image whose output differs, if any.
fn same(got: &[u8], want: &[u8], p: &Params) {
    assert_eq!(got.len(), want.len());
    let n = p.image_bytes();
    if let Some(k) = (0..got.len() / n).find(|k| got[k * n..(k + 1) * n] != want[k * n..(k + 1) * n]) {
        panic!("image {k} of the output differs");
    }
}

fn out_bytes(d: &Decoded<Heap, Ev>, p: &Params) -> Vec<u8> {
    // SAFETY: the output buffer is host memory here, written by the reference.
    unsafe { std::slice::from_raw_parts(d.out.addr() as *const u8, d.kept.len() * p.image_bytes()) }.to_vec()
}

fn every_route() -> Batch {
    Batch {
        files: vec![
            jpeg(0xC0, 640, 480),
            jpeg(0xC0, 500, 375),
            jpeg(0xC2, 400, 300),
            jpeg(0xC2, 640, 480),
            jpeg(0xC1, 300, 200),
            b"png stand-in".to_vec(),
            jpeg(0xC0, 320, 240),
        ],
        spec: vec![
            (Route::Hardware, (64, 32, 256, 192), 4),
            (Route::Hardware, (0, 0, 500, 375), 8),
            // Progressive: the engine refuses; unscaled to the hybrid, scaled to the CPU.
            (Route::Hardware, (16, 16, 200, 120), 8),
            (Route::Hardware, (0, 0, 320, 240), 2),
            (Route::Hybrid, (8, 8, 100, 80), 8),
            (Route::Cpu, (0, 0, 60, 40), 8),
            (Route::Cpu, (16, 0, 64, 64), 8),
        ],
    }
}

/// Every route in one batch: the engine takes its baseline images at their region and scale,
/// the refused unscaled one goes to the hybrid decoder and the refused scaled one to the CPU,
/// the CPU's regions are copied in one run, and the output is the kernel's reference over the
/// source buffer each decoder filled. Each GPU decoder's time is observed once its events
/// complete.
#[test]
fn a_batch_of_every_route_is_the_kernels_output_over_each_decoders_regions() {
    let heap = Heap::default();
    let fake = Fake::with_pixels(fake_pixels(), true);
    let mut s = stage(true, &heap, &fake);
    let b = every_route();
    let (images, size) = b.images();
    let mut host = vec![0u8; size];
    for im in images.iter().filter(|i| i.route == Route::Cpu) {
        host[im.src..im.src + im.bytes()].copy_from_slice(&pattern(
            im.data,
            (im.roi.0 as i32, im.roi.1 as i32, im.roi.2 as i32, im.roi.3 as i32),
            0,
        ));
    }
    let p = Params::normalized(48, 40, OutType::U8, [0.0; 3], [1.0; 3]);
    let mut cpu = cpu_pixels(&images);
    let d = s.run(&images, &host, size, &mut cpu, &p, false).unwrap();
    assert_eq!(d.kept, (0..7).collect::<Vec<_>>());
    assert!(d.failed.is_empty());
    let falls: Vec<(usize, Route)> = d.fell_back.iter().map(|(k, r, _)| (*k, *r)).collect();
    assert_eq!(falls, vec![(2, Route::Hardware), (3, Route::Hardware)]);
    assert!(d.fell_back[0].2.contains("JPEG_NOT_SUPPORTED"), "{:?}", d.fell_back);
    assert_eq!(d.per_route, [2, 2, 3]);
    same(&out_bytes(&d, &p), &expected(&images, &host, size, &d.kept, &p), &p);
    // The two neighbouring CPU images went in one copy, the fallen-back one in its own.
    let uploads = s.device().uploads.lock().unwrap().clone();
    assert_eq!(uploads.len(), 2, "{uploads:?}");
    assert_eq!(uploads[0].1, images[6].src + images[6].bytes() - images[5].src);
    let obs = s.observations().unwrap();
    let routes: Vec<(Route, usize)> = obs.iter().map(|o| (o.route, o.images)).collect();
    assert_eq!(routes, vec![(Route::Hardware, 2), (Route::Hybrid, 2)]);
    assert!(obs.iter().all(|o| o.seconds > 0.0 && o.work > 0.0));
    assert!(s.observations().unwrap().is_empty(), "observed twice");
    assert_eq!(fake.calls("batched"), 1);
}

/// An image no decoder reads fails the batch naming it and what each decoder said; skipping,
/// it is left out and reported, and the others are the output. Nothing leaks either way.
#[test]
fn an_image_nobody_reads_fails_naming_it_or_is_left_out() {
    let heap = Heap::default();
    let fake = Fake::with_pixels(fake_pixels(), true);
    let mut s = stage(true, &heap, &fake);
    let mut b = every_route();
    b.files[1] = b"\xFF\xD9 not a JPEG at all".to_vec();
    let (images, size) = b.images();
    let host = vec![0u8; size];
    let p = Params::normalized(32, 32, OutType::U8, [0.0; 3], [1.0; 3]);
    let e = s
        .run(&images, &host, size, &mut cpu_pixels(&images), &p, false)
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(matches!(e, StageError::Image { index: 1, .. }), "{msg}");
    assert!(msg.contains("BAD_JPEG") && msg.contains("the CPU: not a JPEG"), "{msg}");
    let d = s.run(&images, &host, size, &mut cpu_pixels(&images), &p, true).unwrap();
    assert_eq!(d.kept, vec![0, 2, 3, 4, 5, 6]);
    assert_eq!(d.failed.len(), 1);
    assert_eq!(d.failed[0].0, 1);
    assert_eq!(out_bytes(&d, &p).len(), 6 * p.image_bytes());
    assert_eq!(
        &out_bytes(&d, &p)[..p.image_bytes()],
        &expected(&images, &host, size, &[0], &p)[..]
    );
    drop(d);
    let st = s.pool_stats();
    assert_eq!((st.in_use, st.pending), (0, 0), "{st:?}");
    drop(s);
    assert_eq!(fake.live_handles(), 0, "a handle outlived its decoder");
}

/// Without a hardware engine its share goes to the hybrid decoder (unscaled) or the CPU
/// (scaled), each counted as fallen back, and the output is the same.
#[test]
fn without_an_engine_the_hybrid_decoder_and_the_cpu_take_its_share() {
    let heap = Heap::default();
    let fake = Fake::with_pixels(fake_pixels(), false);
    let mut s = stage(false, &heap, &fake);
    assert_eq!(s.decoders(), (false, true));
    let b = every_route();
    let (images, size) = b.images();
    let host = vec![0u8; size];
    let p = Params::normalized(24, 24, OutType::U8, [0.0; 3], [1.0; 3]);
    let d = s
        .run(&images, &host, size, &mut cpu_pixels(&images), &p, false)
        .unwrap();
    assert_eq!(d.per_route, [0, 3, 4]);
    assert!(d
        .fell_back
        .iter()
        .all(|(_, r, why)| *r == Route::Hardware && why == "no hardware engine"));
    same(&out_bytes(&d, &p), &expected(&images, &host, size, &d.kept, &p), &p);
    assert_eq!(fake.calls("batched"), 0);
}

/// Device memory is flat over many batches (ten epochs of a small dataset): the pool reuses
/// the source and output buffers once their events complete, and the decoders' scratch goes
/// back after each image.
#[test]
fn device_memory_stays_flat_over_many_batches() {
    let heap = Heap::default();
    let fake = Fake::with_pixels(fake_pixels(), true);
    let mut s = stage(true, &heap, &fake);
    let b = every_route();
    let (images, size) = b.images();
    let host = vec![0u8; size];
    let p = Params::normalized(16, 16, OutType::U8, [0.0; 3], [1.0; 3]);
    let mut after = Vec::new();
    for _ in 0..200 {
        let d = s
            .run(&images, &host, size, &mut cpu_pixels(&images), &p, false)
            .unwrap();
        // The consumer frees the batch after its stream used it.
        let fence = s.device().record().unwrap();
        d.out.release_after(Box::new(fence));
        after.push((s.pool_stats().allocated, heap.live_bytes()));
        s.observations().unwrap();
    }
    assert!(
        after[2..].iter().all(|a| *a == after[2]),
        "memory grew: {:?} then {:?}",
        after[2],
        after.last()
    );
    assert_eq!(s.device().launches.load(Ordering::Relaxed), 200);
}

/// A place outside the source buffer, or a host buffer smaller than it, is refused before
/// anything is queued.
#[test]
fn a_place_outside_the_source_buffer_is_refused() {
    let heap = Heap::default();
    let fake = Fake::with_pixels(fake_pixels(), true);
    let mut s = stage(true, &heap, &fake);
    let b = every_route();
    let (images, size) = b.images();
    let p = Params::normalized(16, 16, OutType::U8, [0.0; 3], [1.0; 3]);
    let e = s
        .run(&images, &vec![0u8; size], size - 1, &mut cpu_pixels(&images), &p, false)
        .err()
        .unwrap();
    assert!(e.to_string().contains("image 6's place"), "{e}");
    let e = s
        .run(&images, &[0u8; 10], size, &mut cpu_pixels(&images), &p, false)
        .err()
        .unwrap();
    assert!(e.to_string().contains("host source buffer"), "{e}");
    assert_eq!(s.device().launches.load(Ordering::Relaxed), 0);
}
