//! Single-thread JPEG decode rates over a folder of JPEGs, the decoders side by side in
//! interleaved rounds (the order rotated each round), with medians, per-round ratios and CPU
//! milliseconds per image:
//!
//! `cargo run --release -p ramjet-engine --example decode_rate -- DIR [N] [ROUNDS]`
//!
//! Contenders, on the same N files, each image cropped by its own RandomResizedCrop(224) plan:
//! - `rust full`: libjpeg-turbo-rs (the pure-Rust port ramjet used before), whole image;
//! - `rust crop rows`: libjpeg-turbo-rs with its crop region (it skips the IDCT of MCU rows
//!   outside the crop, still entropy-decodes every row and converts every column);
//! - `C full`: libjpeg-turbo (the C library, `image::turbo`), whole image;
//! - `C region`: libjpeg-turbo, only the crop's region (`image::turbo`: columns by iMCU, rows
//!   skipped above, decoding stopped below);
//! - `C region, 2^-k scale` and `C region, k/8 scale`: the crop's region at the smallest DCT
//!   scale that keeps it at least 224, among 1/8, 1/4, 1/2, 1 (ramjet's choice before) or
//!   among every eighth (now);
//! - `C region 2^-k, restarts` and `process train, restarts`: the same, on the files as
//!   `ramjet pack --jpeg-restarts` stores them (transcoded losslessly with a restart marker
//!   every `RESTART_PX` pixels, `JPEG_RESTART_PX` (32) unless set), so that a crop is cut at
//!   the markers first;
//! - `process train 224`: the whole per-image path ramjet runs (C region at the DCT scale that
//!   keeps the crop at least 224, resize, flip, CHW);
//! - `process eval 224`: the centre crop of Resize(256), likewise.
//!
//! `ONLY="C full;process train, restarts"` runs just the contenders named (`;` between names),
//! for a profile of one of them; the ratios then print only where both sides ran.
use ramjet_engine::image::probe::probe;
use ramjet_engine::image::turbo::{Region, Transcoder, TurboJpeg};
use ramjet_engine::image::{plan, process, ImageSpec, Rect, SampleRng, Scratch, Slot};
use std::time::Instant;
// mimalloc keeps freed memory mapped for reuse: with the system allocator every decoded image's
// buffers were fresh pages, faulted in again image after image (docs/dependencies.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn thread_cpu_s() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

type Contender<'a> = (&'static str, Box<dyn FnMut(usize) + 'a>);

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("DIR");
    let n: usize = args.next().map_or(300, |s| s.parse().expect("N"));
    let rounds: usize = args.next().map_or(5, |s| s.parse().expect("ROUNDS"));
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jpg" || e == "jpeg"))
        .collect();
    names.sort();
    let files: Vec<Vec<u8>> = names.iter().take(n).map(|p| std::fs::read(p).expect("read")).collect();
    let train = ImageSpec::train(224);
    let crops: Vec<Rect> = files
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let info = probe(b).expect("probe");
            plan(&train, info.width, info.height, &mut SampleRng::new(0, 0, 0, i as u64)).crop
        })
        .collect();
    let covered: f64 = files
        .iter()
        .zip(&crops)
        .map(|(b, c)| {
            let info = probe(b).expect("probe");
            c.w * c.h / (info.width as f64 * info.height as f64)
        })
        .sum::<f64>()
        / files.len() as f64;
    println!(
        "{} files from {dir}; the crops cover {:.0}% of the image on average",
        files.len(),
        100.0 * covered
    );

    // The same files as `ramjet pack --jpeg-restarts` stores them: transcoded losslessly
    // with a restart marker every RESTART_PX pixels of each MCU row.
    let restart_px: u32 = std::env::var("RESTART_PX").map_or(ramjet_engine::image::turbo::JPEG_RESTART_PX, |v| {
        v.parse().expect("RESTART_PX")
    });
    let mut tc = Transcoder::new().expect("libjpeg-turbo");
    let cut: Vec<Vec<u8>> = files
        .iter()
        .map(|b| tc.with_restarts(b, restart_px).expect("transcode"))
        .collect();
    let (a, b) = (
        files.iter().map(Vec::len).sum::<usize>(),
        cut.iter().map(Vec::len).sum::<usize>(),
    );
    println!(
        "with a restart marker every {restart_px} px: {:.1} MB against {:.1} MB ({:+.1}%)",
        b as f64 / 1e6,
        a as f64 / 1e6,
        100.0 * (b as f64 / a as f64 - 1.0)
    );
    let mut tj = TurboJpeg::new().expect("libjpeg-turbo");
    let mut tj2 = TurboJpeg::new().expect("libjpeg-turbo");
    let (mut buf, mut buf2) = (Vec::new(), Vec::new());
    let (mut tj3, mut buf3) = (TurboJpeg::new().expect("libjpeg-turbo"), Vec::new());
    let (mut tj4, mut buf4) = (TurboJpeg::new().expect("libjpeg-turbo"), Vec::new());
    // The scale a crop is decoded at: the smallest that keeps it at least 224 on both sides,
    // among 1/8, 1/4, 1/2, 1 (what ramjet used before) or among every eighth (now).
    let pick = |c: &Rect, eighths: &[u32]| {
        *eighths
            .iter()
            .find(|&&e| c.w * e as f64 / 8.0 >= 224.0 && c.h * e as f64 / 8.0 >= 224.0)
            .unwrap_or(&8)
    };
    let region_at = |c: &Rect, e: u32| Region {
        x: (c.x * e as f64 / 8.0) as u32,
        y: (c.y * e as f64 / 8.0) as u32,
        w: ((c.w * e as f64 / 8.0) as u32).max(1),
        h: ((c.h * e as f64 / 8.0) as u32).max(1),
    };
    let (mut tj5, mut buf5) = (TurboJpeg::new().expect("libjpeg-turbo"), Vec::new());
    let mut s3 = Scratch::default();
    let mut out3 = vec![0u8; train.elems()];
    let mut s1 = Scratch::default();
    let mut s2 = Scratch::default();
    let eval = ImageSpec::eval(224);
    let mut out1 = vec![0u8; train.elems()];
    let mut out2 = vec![0u8; eval.elems()];
    let rust_full = |i: usize| {
        let mut d = libjpeg_turbo_rs::decode::pipeline::Decoder::new(&files[i]).expect("hdr");
        d.set_output_format(libjpeg_turbo_rs::PixelFormat::Rgb);
        std::hint::black_box(d.decode_image().expect("decode"));
    };
    let rust_rows = |i: usize| {
        let c = crops[i];
        let mut d = libjpeg_turbo_rs::decode::pipeline::Decoder::new(&files[i]).expect("hdr");
        d.set_output_format(libjpeg_turbo_rs::PixelFormat::Rgb);
        d.set_crop_region(c.x as usize, c.y as usize, c.w as usize, c.h as usize);
        std::hint::black_box(d.decode_image().expect("decode"));
    };
    let mut contenders: Vec<Contender> = vec![
        ("rust full", Box::new(rust_full)),
        ("rust crop rows", Box::new(rust_rows)),
        (
            "C full",
            Box::new(|i: usize| {
                let h = tj.header(&files[i]).expect("hdr");
                std::hint::black_box(tj.decode(&files[i], &h, 8, None, &mut buf).expect("decode"));
            }),
        ),
        (
            "C region",
            Box::new(|i: usize| {
                let h = tj2.header(&files[i]).expect("hdr");
                let c = crops[i];
                let r = Region {
                    x: c.x as u32,
                    y: c.y as u32,
                    w: (c.w as u32).max(1),
                    h: (c.h as u32).max(1),
                };
                std::hint::black_box(tj2.decode(&files[i], &h, 8, Some(r), &mut buf2).expect("decode"));
            }),
        ),
        (
            "C region, 2^-k scale",
            Box::new(|i: usize| {
                let h = tj3.header(&files[i]).expect("hdr");
                let e = pick(&crops[i], &[1, 2, 4]);
                let r = region_at(&crops[i], e);
                std::hint::black_box(tj3.decode(&files[i], &h, e, Some(r), &mut buf3).expect("decode"));
            }),
        ),
        (
            "C region, k/8 scale",
            Box::new(|i: usize| {
                let h = tj4.header(&files[i]).expect("hdr");
                let e = pick(&crops[i], &[1, 2, 3, 4, 5, 6, 7]);
                let r = region_at(&crops[i], e);
                std::hint::black_box(tj4.decode(&files[i], &h, e, Some(r), &mut buf4).expect("decode"));
            }),
        ),
        (
            "C region 2^-k, restarts",
            Box::new(|i: usize| {
                let h = tj5.header(&cut[i]).expect("hdr");
                let e = pick(&crops[i], &[1, 2, 4]);
                let r = region_at(&crops[i], e);
                std::hint::black_box(tj5.decode(&cut[i], &h, e, Some(r), &mut buf5).expect("decode"));
            }),
        ),
        (
            "process train, restarts",
            Box::new(|i: usize| {
                let mut rng = SampleRng::new(0, 0, 0, i as u64);
                process(&cut[i], &train, &mut rng, Slot::U8(&mut out3), &mut s3).expect("process");
            }),
        ),
        (
            "process train 224",
            Box::new(|i: usize| {
                let mut rng = SampleRng::new(0, 0, 0, i as u64);
                process(&files[i], &train, &mut rng, Slot::U8(&mut out1), &mut s1).expect("process");
            }),
        ),
        (
            "process eval 224",
            Box::new(|i: usize| {
                let mut rng = SampleRng::new(0, 0, 0, i as u64);
                process(&files[i], &eval, &mut rng, Slot::U8(&mut out2), &mut s2).expect("process");
            }),
        ),
    ];
    let only: Option<Vec<String>> = std::env::var("ONLY")
        .ok()
        .map(|v| v.split(';').map(|n| n.trim().to_string()).collect());
    let runs = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    let k = contenders.len();
    let mut rate = vec![Vec::new(); k];
    let mut cpu_ms = vec![Vec::new(); k];
    for r in 0..rounds {
        let mut line = format!("round {r}:");
        for j in 0..k {
            let c = (j + r) % k; // rotated: none always first
            let (name, f) = &mut contenders[c];
            if !runs(name) {
                continue;
            }
            let (t, cpu) = (Instant::now(), thread_cpu_s());
            for i in 0..files.len() {
                f(i);
            }
            let (wall, cpu) = (t.elapsed().as_secs_f64(), thread_cpu_s() - cpu);
            rate[c].push(files.len() as f64 / wall);
            cpu_ms[c].push(cpu * 1e3 / files.len() as f64);
            line += &format!(" {name} {:.0}/s;", files.len() as f64 / wall);
        }
        println!("{line}");
    }
    println!("\n{:22} {:>10} {:>14}", "median of rounds", "img/s", "CPU ms/img");
    for c in (0..k).filter(|&c| !rate[c].is_empty()) {
        println!(
            "{:22} {:>10.0} {:>14.3}",
            contenders[c].0,
            median(rate[c].clone()),
            median(cpu_ms[c].clone())
        );
    }
    let ratio = |a: usize, b: usize| {
        if rate[a].is_empty() || rate[b].is_empty() {
            return "(not run)".to_string();
        }
        let per: Vec<f64> = rate[a].iter().zip(&rate[b]).map(|(x, y)| x / y).collect();
        let text: Vec<String> = per.iter().map(|x| format!("{x:.2}")).collect();
        format!("{:.2}x (per round {})", median(per), text.join(", "))
    };
    println!("\nC full / rust full: {}", ratio(2, 0));
    println!("C region / C full: {}", ratio(3, 2));
    println!("C region / rust crop rows: {}", ratio(3, 1));
    println!("C region / rust full: {}", ratio(3, 0));
    println!("C region k/8 scale / 2^-k scale: {}", ratio(5, 4));
    println!("C region 2^-k, restarts / without: {}", ratio(6, 4));
    println!("process train, restarts / without: {}", ratio(7, 8));
}
