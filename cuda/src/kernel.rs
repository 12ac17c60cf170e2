//! The fused augmentation kernel: crop, antialiased resize, horizontal flip, normalisation,
//! HWC to CHW and the output type, in one pass over each output pixel. [`KERNEL_SRC`] is CUDA C
//! compiled at run time by NVRTC ([`crate::nvrtc`]); [`reference`] is the same arithmetic on
//! the CPU, statement for statement, which the tests hold against ramjet's CPU path
//! (`tests/tests/fused_kernel.rs`) and, on a GPU, against the kernel itself.
//!
//! The resize is the separable triangle (bilinear) filter with antialiasing that Pillow,
//! torchvision's `antialias=True` and ramjet's CPU path use: for output column `ox`, with
//! `scale = crop_w / out_w` and `fs = max(scale, 1)`, the source columns `x` in
//! `[trunc(center - fs + 0.5), trunc(center + fs + 0.5))` (clamped to the image) around
//! `center = crop_x + (ox + 0.5) * scale` weigh `max(0, 1 - |(x - center + 0.5) / fs|)`,
//! normalised to sum to 1. The window may reach past the crop into the rest of the decoded
//! image, as Pillow's does. Rows likewise.
//!
//! The CPU path resizes in two passes with 8-bit rounding between them; this one accumulates
//! both directions in f32 and rounds once, so the two may differ by one or two steps of 255 on
//! a pixel ([`TOLERANCE_U8`]). Like the CPU path, the value is then rounded to 8 bits before it
//! is normalised, so every output type carries the same pixel. fp16 and bf16 round to nearest
//! even. The kernel spells its arithmetic with `__fadd_rn` / `__fmul_rn` / `__fdiv_rn`, which the
//! compiler never fuses into multiply-adds, so it rounds exactly as the reference does.

use half::{bf16, f16};

/// The most one uint8 output value may differ from ramjet's CPU path (two-pass resize with
/// intermediate rounding). The mean difference stays under [`TOLERANCE_U8_MEAN`].
pub const TOLERANCE_U8: u8 = 2;
/// The most the mean absolute uint8 difference from the CPU path may be.
pub const TOLERANCE_U8_MEAN: f64 = 0.35;

/// The kernel's entry point.
pub const KERNEL_NAME: &str = "ramjet_fused_augment";

/// CUDA C of the kernel: one thread per output pixel, grid `(ceil(out_w * out_h / 256), n)`.
/// No headers (NVRTC runs without the CUDA toolkit's); fp16 and bf16 through `cvt.rn` PTX.
pub const KERNEL_SRC: &str = r#"
struct Job {
    unsigned long long src;   // byte offset of the image's first pixel in the source buffer
    int w, h, stride, flip;   // decoded size, bytes per row, mirror
    float cx, cy, cw, ch;     // crop in decoded pixels
};

__device__ __forceinline__ float tri(float x) {
    x = fabsf(x);
    return x < 1.0f ? 1.0f - x : 0.0f;
}

extern "C" __global__ void ramjet_fused_augment(
    const unsigned char* __restrict__ src, const Job* __restrict__ jobs, unsigned char* __restrict__ out,
    int ow, int oh, int out_type,
    float a0, float a1, float a2, float k0, float k1, float k2)
{
    const int i = blockIdx.y;
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= ow * oh) return;
    const int ox = p % ow, oy = p / ow;
    const Job j = jobs[i];

    const float sx = __fdiv_rn(j.cw, (float)ow), sy = __fdiv_rn(j.ch, (float)oh);
    const float fx = fmaxf(sx, 1.0f), fy = fmaxf(sy, 1.0f);
    const float centx = __fadd_rn(j.cx, __fmul_rn(__fadd_rn((float)ox, 0.5f), sx));
    const float centy = __fadd_rn(j.cy, __fmul_rn(__fadd_rn((float)oy, 0.5f), sy));
    int x0 = (int)__fadd_rn(__fsub_rn(centx, fx), 0.5f); if (x0 < 0) x0 = 0;
    int x1 = (int)__fadd_rn(__fadd_rn(centx, fx), 0.5f); if (x1 > j.w) x1 = j.w;
    int y0 = (int)__fadd_rn(__fsub_rn(centy, fy), 0.5f); if (y0 < 0) y0 = 0;
    int y1 = (int)__fadd_rn(__fadd_rn(centy, fy), 0.5f); if (y1 > j.h) y1 = j.h;

    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, sum_y = 0.0f, sum_x = 0.0f;
    for (int x = x0; x < x1; ++x) sum_x = __fadd_rn(sum_x, tri(__fdiv_rn(__fadd_rn(__fsub_rn((float)x, centx), 0.5f), fx)));
    for (int y = y0; y < y1; ++y) {
        const float wy = tri(__fdiv_rn(__fadd_rn(__fsub_rn((float)y, centy), 0.5f), fy));
        sum_y = __fadd_rn(sum_y, wy);
        const unsigned char* row = src + j.src + (unsigned long long)y * j.stride;
        float r0 = 0.0f, r1 = 0.0f, r2 = 0.0f;
        for (int x = x0; x < x1; ++x) {
            const float wx = tri(__fdiv_rn(__fadd_rn(__fsub_rn((float)x, centx), 0.5f), fx));
            r0 = __fadd_rn(r0, __fmul_rn(wx, (float)row[3 * x + 0]));
            r1 = __fadd_rn(r1, __fmul_rn(wx, (float)row[3 * x + 1]));
            r2 = __fadd_rn(r2, __fmul_rn(wx, (float)row[3 * x + 2]));
        }
        acc0 = __fadd_rn(acc0, __fmul_rn(wy, r0));
        acc1 = __fadd_rn(acc1, __fmul_rn(wy, r1));
        acc2 = __fadd_rn(acc2, __fmul_rn(wy, r2));
    }
    const float norm = __fmul_rn(sum_x, sum_y);
    float v[3] = {acc0, acc1, acc2};
    const float a[3] = {a0, a1, a2}, k[3] = {k0, k1, k2};
    const int plane = ow * oh;
    const int dx = j.flip ? ow - 1 - ox : ox;
    const long long base = (long long)i * 3 * plane + (long long)oy * ow + dx;
    for (int c = 0; c < 3; ++c) {
        float q = norm > 0.0f ? __fdiv_rn(v[c], norm) : 0.0f;
        q = floorf(__fadd_rn(q, 0.5f));
        q = fminf(fmaxf(q, 0.0f), 255.0f);
        const long long at = base + (long long)c * plane;
        if (out_type == 0) {
            out[at] = (unsigned char)q;
        } else {
            const float f = __fadd_rn(__fmul_rn(q, a[c]), k[c]);
            if (out_type == 3) {
                ((float*)out)[at] = f;
            } else {
                unsigned short h;
                if (out_type == 1) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
                else asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
                ((unsigned short*)out)[at] = h;
            }
        }
    }
}
"#;

/// One image of a batch, as the kernel reads it (`struct Job` in [`KERNEL_SRC`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Job {
    /// Byte offset of the image's first pixel in the source buffer.
    pub src: u64,
    /// Decoded width.
    pub w: i32,
    /// Decoded height.
    pub h: i32,
    /// Bytes per source row (at least `3 * w`).
    pub stride: i32,
    /// Mirror horizontally (1) or not (0).
    pub flip: i32,
    /// Crop left, in decoded pixels.
    pub cx: f32,
    /// Crop top.
    pub cy: f32,
    /// Crop width.
    pub cw: f32,
    /// Crop height.
    pub ch: f32,
}

/// Element type of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    /// uint8, the pixel itself.
    U8 = 0,
    /// IEEE half, normalised.
    F16 = 1,
    /// bfloat16, normalised.
    BF16 = 2,
    /// float32, normalised.
    F32 = 3,
}

impl OutType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            OutType::U8 => 1,
            OutType::F16 | OutType::BF16 => 2,
            OutType::F32 => 4,
        }
    }
}

/// What every image of a batch becomes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Output width.
    pub ow: i32,
    /// Output height.
    pub oh: i32,
    /// Output element type.
    pub out: OutType,
    /// `out = pixel * a + k` per channel (ignored for uint8).
    pub a: [f32; 3],
    /// See `a`.
    pub k: [f32; 3],
}

impl Params {
    /// Output of `ow` x `oh` with `(pixel / 255 - mean) / std`, the CPU path's constants.
    pub fn normalized(ow: u32, oh: u32, out: OutType, mean: [f32; 3], std: [f32; 3]) -> Params {
        Params {
            ow: ow as i32,
            oh: oh as i32,
            out,
            a: std::array::from_fn(|c| 1.0 / (255.0 * std[c])),
            k: std::array::from_fn(|c| -mean[c] / std[c]),
        }
    }

    /// Bytes of one output image.
    pub fn image_bytes(&self) -> usize {
        3 * self.ow as usize * self.oh as usize * self.out.size()
    }
}

fn tri(x: f32) -> f32 {
    let x = x.abs();
    if x < 1.0 {
        1.0 - x
    } else {
        0.0
    }
}

/// The kernel's arithmetic on the CPU: writes `jobs.len()` images of `p` into `out`
/// (`[n, 3, oh, ow]`, native-endian elements of `p.out`). Panics if a job reaches outside
/// `src` or `out` is too small (the GPU path checks the same before launching).
pub fn reference(src: &[u8], jobs: &[Job], p: &Params, out: &mut [u8]) {
    let (ow, oh) = (p.ow, p.oh);
    let plane = (ow * oh) as usize;
    assert!(out.len() >= jobs.len() * p.image_bytes(), "output buffer too small");
    for (i, j) in jobs.iter().enumerate() {
        let sx = j.cw / ow as f32;
        let sy = j.ch / oh as f32;
        let (fx, fy) = (sx.max(1.0), sy.max(1.0));
        for oy in 0..oh {
            for ox in 0..ow {
                let centx = j.cx + (ox as f32 + 0.5) * sx;
                let centy = j.cy + (oy as f32 + 0.5) * sy;
                let x0 = ((centx - fx + 0.5) as i32).max(0);
                let x1 = ((centx + fx + 0.5) as i32).min(j.w);
                let y0 = ((centy - fy + 0.5) as i32).max(0);
                let y1 = ((centy + fy + 0.5) as i32).min(j.h);
                let mut acc = [0f32; 3];
                let (mut sum_y, mut sum_x) = (0f32, 0f32);
                for x in x0..x1 {
                    sum_x += tri((x as f32 - centx + 0.5) / fx);
                }
                for y in y0..y1 {
                    let wy = tri((y as f32 - centy + 0.5) / fy);
                    sum_y += wy;
                    let row = &src[(j.src + y as u64 * j.stride as u64) as usize..];
                    let mut r = [0f32; 3];
                    for x in x0..x1 {
                        let wx = tri((x as f32 - centx + 0.5) / fx);
                        for c in 0..3 {
                            r[c] += wx * row[3 * x as usize + c] as f32;
                        }
                    }
                    for c in 0..3 {
                        acc[c] += wy * r[c];
                    }
                }
                let norm = sum_x * sum_y;
                let dx = if j.flip != 0 { ow - 1 - ox } else { ox };
                let base = i * 3 * plane + (oy * ow + dx) as usize;
                for (c, &v) in acc.iter().enumerate() {
                    let q = if norm > 0.0 { v / norm } else { 0.0 };
                    let q = (q + 0.5).floor().clamp(0.0, 255.0);
                    let at = base + c * plane;
                    let f = q * p.a[c] + p.k[c];
                    match p.out {
                        OutType::U8 => out[at] = q as u8,
                        OutType::F16 => out[2 * at..2 * at + 2].copy_from_slice(&f16::from_f32(f).to_ne_bytes()),
                        OutType::BF16 => out[2 * at..2 * at + 2].copy_from_slice(&bf16::from_f32(f).to_ne_bytes()),
                        OutType::F32 => out[4 * at..4 * at + 4].copy_from_slice(&f.to_ne_bytes()),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(w: usize, h: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..w * h * 3)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    fn whole(w: i32, h: i32) -> Job {
        Job {
            src: 0,
            w,
            h,
            stride: 3 * w,
            flip: 0,
            cx: 0.0,
            cy: 0.0,
            cw: w as f32,
            ch: h as f32,
        }
    }

    #[test]
    fn the_job_struct_has_the_kernel_s_layout() {
        // unsigned long long, 4 ints, 4 floats: 40 bytes, 8-aligned, as nvcc lays out `Job`.
        assert_eq!(std::mem::size_of::<Job>(), 40);
        assert_eq!(std::mem::align_of::<Job>(), 8);
        assert_eq!(std::mem::offset_of!(Job, cx), 24);
    }

    #[test]
    fn an_identity_job_copies_pixels_and_a_flip_mirrors_them() {
        let (w, h) = (13, 7);
        let src = noise(w, h, 1);
        let p = Params::normalized(w as u32, h as u32, OutType::U8, [0.0; 3], [1.0; 3]);
        let mut out = vec![0u8; p.image_bytes()];
        reference(&src, &[whole(w as i32, h as i32)], &p, &mut out);
        for y in 0..h {
            for x in 0..w {
                for c in 0..3 {
                    assert_eq!(out[c * w * h + y * w + x], src[(y * w + x) * 3 + c], "({x},{y},{c})");
                }
            }
        }
        let mut flipped = vec![0u8; p.image_bytes()];
        reference(
            &src,
            &[Job {
                flip: 1,
                ..whole(w as i32, h as i32)
            }],
            &p,
            &mut flipped,
        );
        for y in 0..h {
            for x in 0..w {
                assert_eq!(flipped[y * w + (w - 1 - x)], out[y * w + x]);
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat_in_every_type_and_normalises_as_the_cpu_path() {
        let (w, h) = (40, 30);
        let src: Vec<u8> = std::iter::repeat_n([200u8, 100, 50], w * h).flatten().collect();
        let mean = [0.485, 0.456, 0.406];
        let std = [0.229, 0.224, 0.225];
        for out in [OutType::U8, OutType::F16, OutType::BF16, OutType::F32] {
            let p = Params::normalized(9, 11, out, mean, std);
            let job = Job {
                cx: 3.5,
                cy: 2.25,
                cw: 30.0,
                ch: 20.0,
                ..whole(w as i32, h as i32)
            };
            let mut buf = vec![0u8; p.image_bytes()];
            reference(&src, &[job], &p, &mut buf);
            let plane = 9 * 11;
            for (c, v) in [200u8, 100, 50].into_iter().enumerate() {
                // The CPU path's formula: (x / 255 - mean) / std as x * a + k.
                let f = v as f32 * (1.0 / (255.0 * std[c])) + (-mean[c] / std[c]);
                for e in 0..plane {
                    let at = c * plane + e;
                    let got = match out {
                        OutType::U8 => buf[at] as f32,
                        OutType::F16 => f16::from_ne_bytes([buf[2 * at], buf[2 * at + 1]]).to_f32(),
                        OutType::BF16 => bf16::from_ne_bytes([buf[2 * at], buf[2 * at + 1]]).to_f32(),
                        OutType::F32 => f32::from_ne_bytes(buf[4 * at..4 * at + 4].try_into().unwrap()),
                    };
                    let want = match out {
                        OutType::U8 => v as f32,
                        OutType::F16 => f16::from_f32(f).to_f32(),
                        OutType::BF16 => bf16::from_f32(f).to_f32(),
                        OutType::F32 => f,
                    };
                    assert_eq!(got, want, "{out:?} channel {c}");
                }
            }
        }
    }

    #[test]
    fn a_downscale_averages_and_never_reads_outside_the_image() {
        // A 2x2 checkerboard of 0 and 255 shrunk 8x averages to the middle grey.
        let (w, h) = (64usize, 48usize);
        let src: Vec<u8> = (0..w * h)
            .flat_map(|i| {
                let v = if ((i % w) / 2 + (i / w) / 2) % 2 == 0 { 0 } else { 255 };
                [v; 3]
            })
            .collect();
        let p = Params::normalized(8, 6, OutType::U8, [0.0; 3], [1.0; 3]);
        let mut out = vec![0u8; p.image_bytes()];
        reference(&src, &[whole(w as i32, h as i32)], &p, &mut out);
        for (e, &v) in out.iter().enumerate() {
            assert!((120..=135).contains(&v), "element {e}: {v}");
        }
        // A crop at the corner reaches past the image's edge: clamped, not read out of bounds.
        let edge = Job {
            cx: 60.0,
            cy: 44.0,
            cw: 4.0,
            ch: 4.0,
            ..whole(w as i32, h as i32)
        };
        let p = Params::normalized(16, 16, OutType::U8, [0.0; 3], [1.0; 3]);
        let mut out = vec![0u8; p.image_bytes()];
        reference(&src, &[edge], &p, &mut out);
    }

    #[test]
    fn the_source_declares_what_the_reference_implements() {
        assert!(KERNEL_SRC.contains(&format!("void {KERNEL_NAME}(")));
        // The output type codes the kernel switches on are the enum's.
        assert_eq!(
            (
                OutType::U8 as i32,
                OutType::F16 as i32,
                OutType::BF16 as i32,
                OutType::F32 as i32
            ),
            (0, 1, 2, 3)
        );
        for needle in [
            "cvt.rn.f16.f32",
            "cvt.rn.bf16.f32",
            "floorf(__fadd_rn(q, 0.5f))",
            "j.flip ? ow - 1 - ox : ox",
        ] {
            assert!(KERNEL_SRC.contains(needle), "{needle}");
        }
    }
}
