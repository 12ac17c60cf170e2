//! Single-thread rate of decode + augmentation over a folder of JPEGs:
//! `cargo run --release -p ramjet-engine --example decode_rate -- DIR [N]`.
use ramjet_engine::image::{decode_rgb, process, ImageSpec, SampleRng, Scratch, Slot};
use std::time::Instant;
// mimalloc keeps freed memory mapped for reuse: with the system allocator every decoded image's
// buffers were fresh pages, faulted in again image after image (docs/dependencies.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("DIR");
    let n: usize = args.next().map_or(300, |s| s.parse().expect("N"));
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .collect();
    names.sort();
    let files: Vec<Vec<u8>> = names.iter().take(n).map(|p| std::fs::read(p).expect("read")).collect();
    let rate = |name: &str, f: &mut dyn FnMut(&[u8], u64)| {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            for (i, b) in files.iter().enumerate() {
                f(b, i as u64);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{name:28} {:7.0} img/s", files.len() as f64 / best);
    };
    rate("raw ljt-rs", &mut |b, _| {
        let mut d = libjpeg_turbo_rs::decode::pipeline::Decoder::new(b).expect("hdr");
        d.set_output_format(libjpeg_turbo_rs::PixelFormat::Rgb);
        std::hint::black_box(d.decode_image().expect("decode"));
    });
    rate("rows 100..400", &mut |b, _| {
        std::hint::black_box(decode_rgb(b, 1, Some((100, 400))).expect("decode"));
    });
    rate("1/2", &mut |b, _| {
        std::hint::black_box(decode_rgb(b, 2, None).expect("decode"));
    });
    rate("1/4", &mut |b, _| {
        std::hint::black_box(decode_rgb(b, 4, None).expect("decode"));
    });
    rate("full decode", &mut |b, _| {
        std::hint::black_box(decode_rgb(b, 1, None).expect("decode"));
    });
    let mut s = Scratch::default();
    for (name, spec) in [
        ("train 224 (RRC+flip)", ImageSpec::train(224)),
        (
            "train 224, no DCT scaling",
            ImageSpec {
                dct_scaling: false,
                ..ImageSpec::train(224)
            },
        ),
        ("eval 224", ImageSpec::eval(224)),
        ("train 112", ImageSpec::train(112)),
    ] {
        let mut out = vec![0u8; spec.elems()];
        rate(name, &mut |b, i| {
            process(b, &spec, &mut SampleRng::new(0, 0, 0, i), Slot::U8(&mut out), &mut s).expect("process");
        });
    }
}
