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

use crate::GpuError;

/// The most one uint8 output value may differ from ramjet's CPU path (two-pass resize with
/// intermediate rounding). The mean difference stays under [`TOLERANCE_U8_MEAN`].
pub const TOLERANCE_U8: u8 = 2;
/// The most the mean absolute uint8 difference from the CPU path may be.
pub const TOLERANCE_U8_MEAN: f64 = 0.35;

/// The kernel's entry point.
pub const KERNEL_NAME: &str = "ramjet_fused_augment";
/// The entry point that fills the weight table ([`plan`]) before [`KERNEL_NAME`] runs.
pub const WEIGHTS_NAME: &str = "ramjet_fused_weights";
/// Threads per block of both kernels.
pub const BLOCK: u32 = 256;
/// The most blocks a launch's second grid dimension may have (CUDA's limit): a batch of more
/// images is walked with a stride of this many.
pub const GRID_Y_MAX: u32 = 65_535;

/// CUDA C of the two kernels. No headers (NVRTC runs without the CUDA toolkit's); fp16 and
/// bf16 through `cvt.rn` PTX.
///
/// - `ramjet_fused_weights`, grid `(ceil((ow + oh) / 256), min(n, 65535))`: one thread per
///   output column and per output row of every image computes that column's (row's) filter
///   once: its first source pixel, its tap count, the taps' weights and their sum, into the
///   image's part of the weight table (layout: [`plan`]).
/// - `ramjet_fused_augment`, grid `(ceil(ow * oh / 256), min(n, 65535))`: one thread per output
///   pixel reads its column's and row's filters from the table and accumulates
///   `sum_y wy * (sum_x wx * pixel)`: no division and no weight computed per tap.
///
/// Both walk the images with a stride of `gridDim.y`, so a batch may hold more than 65,535.
pub const KERNEL_SRC: &str = r#"
struct Job {
    unsigned long long src;   // byte offset of the image's first pixel in the source buffer
    int w, h, stride, flip;   // decoded size, bytes per row, mirror
    float cx, cy, cw, ch;     // crop in decoded pixels
};

struct DevJob {
    Job j;
    unsigned long long wofs;  // the image's weight table, in floats from the table's start
    int tx, ty;               // taps reserved per column and per row
};

__device__ __forceinline__ float tri(float x) {
    x = fabsf(x);
    return x < 1.0f ? 1.0f - x : 0.0f;
}

extern "C" __global__ void ramjet_fused_weights(
    const DevJob* __restrict__ jobs, float* __restrict__ table, int n, int ow, int oh)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= ow + oh) return;
    const bool col = t < ow;
    const int o = col ? t : t - ow;
    for (int i = blockIdx.y; i < n; i += gridDim.y) {
        const DevJob d = jobs[i];
        const int taps = col ? d.tx : d.ty;
        float* e = table + d.wofs
            + (col ? (unsigned long long)o * (d.tx + 3)
                   : (unsigned long long)ow * (d.tx + 3) + (unsigned long long)o * (d.ty + 3));
        const float start = col ? d.j.cx : d.j.cy;
        const float size = col ? d.j.cw : d.j.ch;
        const int lim = col ? d.j.w : d.j.h;
        const float s = __fdiv_rn(size, (float)(col ? ow : oh));
        const float f = fmaxf(s, 1.0f);
        const float cent = __fadd_rn(start, __fmul_rn(__fadd_rn((float)o, 0.5f), s));
        int a = (int)__fadd_rn(__fsub_rn(cent, f), 0.5f); if (a < 0) a = 0;
        int b = (int)__fadd_rn(__fadd_rn(cent, f), 0.5f); if (b > lim) b = lim;
        int cnt = b - a; if (cnt < 0) cnt = 0; if (cnt > taps) cnt = taps;
        float sum = 0.0f;
        for (int k = 0; k < cnt; ++k) {
            const float wt = tri(__fdiv_rn(__fadd_rn(__fsub_rn((float)(a + k), cent), 0.5f), f));
            e[3 + k] = wt;
            sum = __fadd_rn(sum, wt);
        }
        ((int*)e)[0] = a;
        ((int*)e)[1] = cnt;
        e[2] = sum;
    }
}

extern "C" __global__ void ramjet_fused_augment(
    const unsigned char* __restrict__ src, const DevJob* __restrict__ jobs, const float* __restrict__ table,
    unsigned char* __restrict__ out, int n, int ow, int oh, int out_type,
    float a0, float a1, float a2, float k0, float k1, float k2)
{
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= ow * oh) return;
    const int ox = p % ow, oy = p / ow;
    const int plane = ow * oh;
    const float a[3] = {a0, a1, a2}, k[3] = {k0, k1, k2};
    for (int i = blockIdx.y; i < n; i += gridDim.y) {
        const DevJob d = jobs[i];
        const float* ex = table + d.wofs + (unsigned long long)ox * (d.tx + 3);
        const float* ey = table + d.wofs + (unsigned long long)ow * (d.tx + 3) + (unsigned long long)oy * (d.ty + 3);
        const int x0 = ((const int*)ex)[0], nx = ((const int*)ex)[1];
        const int y0 = ((const int*)ey)[0], ny = ((const int*)ey)[1];
        const float* wx = ex + 3;
        const float* wy = ey + 3;
        float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f;
        for (int r = 0; r < ny; ++r) {
            const unsigned char* row = src + d.j.src + (unsigned long long)(y0 + r) * d.j.stride + 3 * x0;
            float r0 = 0.0f, r1 = 0.0f, r2 = 0.0f;
            for (int m = 0; m < nx; ++m) {
                const float wt = wx[m];
                r0 = __fadd_rn(r0, __fmul_rn(wt, (float)row[3 * m + 0]));
                r1 = __fadd_rn(r1, __fmul_rn(wt, (float)row[3 * m + 1]));
                r2 = __fadd_rn(r2, __fmul_rn(wt, (float)row[3 * m + 2]));
            }
            acc0 = __fadd_rn(acc0, __fmul_rn(wy[r], r0));
            acc1 = __fadd_rn(acc1, __fmul_rn(wy[r], r1));
            acc2 = __fadd_rn(acc2, __fmul_rn(wy[r], r2));
        }
        const float norm = __fmul_rn(ex[2], ey[2]);
        float v[3] = {acc0, acc1, acc2};
        const int dx = d.j.flip ? ow - 1 - ox : ox;
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

/// One image as the kernels read it (`struct DevJob` in [`KERNEL_SRC`]): the [`Job`] and where
/// its filters are in the weight table.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DevJob {
    /// The image and its crop.
    pub job: Job,
    /// Offset of the image's filters in the weight table, in floats.
    pub wofs: u64,
    /// Taps reserved per output column.
    pub tx: i32,
    /// Taps reserved per output row.
    pub ty: i32,
}

/// A batch laid out for the kernels: the jobs with their table offsets, and the table's size.
///
/// The weight table holds, per image, `ow` column filters of `tx + 3` floats and then `oh` row
/// filters of `ty + 3` floats. A filter is `[first, count, sum, w_0 .. w_{count-1}]`: `first`
/// and `count` are `i32`s stored in the float's bits, `sum` is the weights' sum, accumulated in
/// order. `tx = ceil(2 * max(cw / ow, 1)) + 2` is at least the window's width (it spans
/// `2 * max(scale, 1)` plus the rounding of both ends), so a filter never spills into the next.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// One per image, in order.
    pub jobs: Vec<DevJob>,
    /// Floats of the whole table.
    pub table_floats: usize,
}

impl Plan {
    /// The jobs as the bytes the kernels read.
    pub fn job_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.jobs.len() * std::mem::size_of::<DevJob>());
        for d in &self.jobs {
            let j = &d.job;
            b.extend_from_slice(&j.src.to_ne_bytes());
            for v in [j.w, j.h, j.stride, j.flip] {
                b.extend_from_slice(&v.to_ne_bytes());
            }
            for v in [j.cx, j.cy, j.cw, j.ch] {
                b.extend_from_slice(&v.to_ne_bytes());
            }
            b.extend_from_slice(&d.wofs.to_ne_bytes());
            b.extend_from_slice(&d.tx.to_ne_bytes());
            b.extend_from_slice(&d.ty.to_ne_bytes());
        }
        b
    }
}

/// Lays out `jobs` for the kernels, or says which image (by index) or output size is unusable:
/// an image smaller than 1x1, a row stride under `3 * w`, a crop that is not finite, not
/// positive or larger than the image, or an output under 1x1 or over 2^28 pixels. `src_len`,
/// when given, is the source buffer's size, which every image must lie inside.
pub fn plan(jobs: &[Job], p: &Params, src_len: Option<usize>) -> Result<Plan, GpuError> {
    let refuse = |reason: String| GpuError::Invalid {
        what: "the fused kernel's batch",
        reason,
    };
    if p.ow < 1 || p.oh < 1 || (p.ow as i64) * (p.oh as i64) > 1 << 28 {
        return Err(refuse(format!(
            "output size {}x{}: each side at least 1, at most 2^28 pixels",
            p.ow, p.oh
        )));
    }
    let mut out = Vec::with_capacity(jobs.len());
    let mut wofs = 0u64;
    for (i, j) in jobs.iter().enumerate() {
        if j.w < 1 || j.h < 1 || (j.stride as i64) < 3 * j.w as i64 {
            return Err(refuse(format!(
                "image {i}: {}x{} with a row stride of {} B",
                j.w, j.h, j.stride
            )));
        }
        if let Some(len) = src_len {
            let end = j.src as u128 + j.stride as u128 * j.h as u128;
            if end > len as u128 {
                return Err(refuse(format!(
                    "image {i} reaches outside the source buffer ({end} B of {len} B): {j:?}"
                )));
            }
        }
        let fine = |v: f32| v.is_finite();
        if !(fine(j.cx) && fine(j.cy) && fine(j.cw) && fine(j.ch))
            || j.cw <= 0.0
            || j.ch <= 0.0
            || j.cw > j.w as f32
            || j.ch > j.h as f32
        {
            return Err(refuse(format!(
                "image {i}: crop {}x{} at ({}, {}) does not fit a {}x{} image",
                j.cw, j.ch, j.cx, j.cy, j.w, j.h
            )));
        }
        let taps = |size: f32, n: i32| (2.0 * (size / n as f32).max(1.0)).ceil() as i32 + 2;
        let (tx, ty) = (taps(j.cw, p.ow), taps(j.ch, p.oh));
        out.push(DevJob { job: *j, wofs, tx, ty });
        wofs += p.ow as u64 * (tx as u64 + 3) + p.oh as u64 * (ty as u64 + 3);
    }
    Ok(Plan {
        jobs: out,
        table_floats: wofs as usize,
    })
}

/// One output column's (`o < ow`) or row's filter, as `ramjet_fused_weights` computes it:
/// `(first, count, sum)` and the weights written into `w`.
fn filter(start: f32, size: f32, outn: i32, o: i32, lim: i32, w: &mut [f32]) -> (i32, i32, f32) {
    let s = size / outn as f32;
    let f = s.max(1.0);
    let cent = start + (o as f32 + 0.5) * s;
    let a = ((cent - f + 0.5) as i32).max(0);
    let b = ((cent + f + 0.5) as i32).min(lim);
    let cnt = (b - a).clamp(0, w.len() as i32);
    let mut sum = 0f32;
    for k in 0..cnt {
        let wt = tri(((a + k) as f32 - cent + 0.5) / f);
        w[k as usize] = wt;
        sum += wt;
    }
    (a, cnt, sum)
}

/// The weight table `ramjet_fused_weights` writes for `plan` (floats; `first` and `count`
/// as `i32` bits). Unwritten taps stay 0.
pub fn weight_table(plan: &Plan, p: &Params) -> Vec<f32> {
    let mut t = vec![0f32; plan.table_floats];
    for d in &plan.jobs {
        let j = &d.job;
        let base = d.wofs as usize;
        for o in 0..p.ow + p.oh {
            let col = o < p.ow;
            let (taps, at) = if col {
                (d.tx as usize, base + o as usize * (d.tx as usize + 3))
            } else {
                let r = (o - p.ow) as usize;
                (
                    d.ty as usize,
                    base + p.ow as usize * (d.tx as usize + 3) + r * (d.ty as usize + 3),
                )
            };
            let e = &mut t[at..at + taps + 3];
            let (first, cnt, sum) = if col {
                filter(j.cx, j.cw, p.ow, o, j.w, &mut e[3..])
            } else {
                filter(j.cy, j.ch, p.oh, o - p.ow, j.h, &mut e[3..])
            };
            e[0] = f32::from_bits(first as u32);
            e[1] = f32::from_bits(cnt as u32);
            e[2] = sum;
        }
    }
    t
}

/// Launch dimensions of either kernel for `n` images over `per_image` threads each:
/// `(blocks along x, blocks along y)`, with y at most [`GRID_Y_MAX`] (the kernels stride over
/// the rest).
pub fn grid(n: usize, per_image: u32) -> (u32, u32) {
    (per_image.div_ceil(BLOCK), (n as u64).clamp(1, GRID_Y_MAX as u64) as u32)
}

/// The last step of one output value, as the kernel does it: `v / norm` rounded to 8 bits,
/// then (for the float types) `q * a + k` in channel `c`'s constants, stored at element `at`.
fn store(out: &mut [u8], p: &Params, c: usize, at: usize, v: f32, norm: f32) {
    let q = if norm > 0.0 { v / norm } else { 0.0 };
    let q = (q + 0.5).floor().clamp(0.0, 255.0);
    let f = q * p.a[c] + p.k[c];
    match p.out {
        OutType::U8 => out[at] = q as u8,
        OutType::F16 => out[2 * at..2 * at + 2].copy_from_slice(&f16::from_f32(f).to_ne_bytes()),
        OutType::BF16 => out[2 * at..2 * at + 2].copy_from_slice(&bf16::from_f32(f).to_ne_bytes()),
        OutType::F32 => out[4 * at..4 * at + 4].copy_from_slice(&f.to_ne_bytes()),
    }
}

/// The kernels' arithmetic on the CPU: writes `jobs.len()` images of `p` into `out`
/// (`[n, 3, oh, ow]`, native-endian elements of `p.out`), through the same weight table.
/// Panics if [`plan`] refuses a job or `out` is too small (the GPU path returns the same as
/// an error before launching).
pub fn reference(src: &[u8], jobs: &[Job], p: &Params, out: &mut [u8]) {
    let plan = plan(jobs, p, Some(src.len())).unwrap_or_else(|e| panic!("{e}"));
    let table = weight_table(&plan, p);
    let (ow, oh) = (p.ow, p.oh);
    let plane = (ow * oh) as usize;
    assert!(out.len() >= jobs.len() * p.image_bytes(), "output buffer too small");
    for (i, d) in plan.jobs.iter().enumerate() {
        let j = &d.job;
        for oy in 0..oh {
            for ox in 0..ow {
                let ex = &table[d.wofs as usize + ox as usize * (d.tx as usize + 3)..];
                let ey =
                    &table[d.wofs as usize + ow as usize * (d.tx as usize + 3) + oy as usize * (d.ty as usize + 3)..];
                let (x0, nx) = (ex[0].to_bits() as i32, ex[1].to_bits() as i32);
                let (y0, ny) = (ey[0].to_bits() as i32, ey[1].to_bits() as i32);
                let mut acc = [0f32; 3];
                for r in 0..ny {
                    let row = &src[(j.src + (y0 + r) as u64 * j.stride as u64) as usize + 3 * x0 as usize..];
                    let mut s = [0f32; 3];
                    for m in 0..nx as usize {
                        let wt = ex[3 + m];
                        for c in 0..3 {
                            s[c] += wt * row[3 * m + c] as f32;
                        }
                    }
                    for c in 0..3 {
                        acc[c] += ey[3 + r as usize] * s[c];
                    }
                }
                let norm = ex[2] * ey[2];
                let dx = if j.flip != 0 { ow - 1 - ox } else { ox };
                let base = i * 3 * plane + (oy * ow + dx) as usize;
                for (c, &v) in acc.iter().enumerate() {
                    store(out, p, c, base + c * plane, v, norm);
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

    /// The kernel's arithmetic before the weight table (every weight computed per tap, one
    /// division each), kept to pin that the table changed no bit of the output.
    fn direct(src: &[u8], jobs: &[Job], p: &Params) -> Vec<u8> {
        let (ow, oh) = (p.ow, p.oh);
        let plane = (ow * oh) as usize;
        let mut out = vec![0u8; jobs.len() * p.image_bytes()];
        for (i, j) in jobs.iter().enumerate() {
            let (sx, sy) = (j.cw / ow as f32, j.ch / oh as f32);
            let (fx, fy) = (sx.max(1.0), sy.max(1.0));
            for oy in 0..oh {
                for ox in 0..ow {
                    let centx = j.cx + (ox as f32 + 0.5) * sx;
                    let centy = j.cy + (oy as f32 + 0.5) * sy;
                    let x0 = ((centx - fx + 0.5) as i32).max(0);
                    let x1 = ((centx + fx + 0.5) as i32).min(j.w);
                    let y0 = ((centy - fy + 0.5) as i32).max(0);
                    let y1 = ((centy + fy + 0.5) as i32).min(j.h);
                    let (mut acc, mut sum_y, mut sum_x) = ([0f32; 3], 0f32, 0f32);
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
                    for (c, &v) in acc.iter().enumerate() {
                        store(
                            &mut out,
                            p,
                            c,
                            i * 3 * plane + (oy * ow + dx) as usize + c * plane,
                            v,
                            norm,
                        );
                    }
                }
            }
        }
        out
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// Random crops of images in one buffer: upscales, mild and extreme downscales, odd
    /// offsets, crops touching every edge, flips.
    fn random_batch(rng: &mut Rng, n: usize) -> (Vec<u8>, Vec<Job>) {
        let mut src = Vec::new();
        let mut jobs = Vec::new();
        for i in 0..n {
            let (w, h) = if i == 0 {
                (1200, 900)
            } else {
                (1 + (rng.next() % 400) as i32, 1 + (rng.next() % 300) as i32)
            };
            let cw = (w as f32 * (0.05 + 0.95 * rng.unit())).max(1.0).min(w as f32);
            let ch = (h as f32 * (0.05 + 0.95 * rng.unit())).max(1.0).min(h as f32);
            let cx = (w as f32 - cw) * rng.unit();
            let cy = if i % 5 == 1 {
                h as f32 - ch
            } else {
                (h as f32 - ch) * rng.unit()
            };
            let pad = (rng.next() % 3) as i32 * 3;
            jobs.push(Job {
                src: src.len() as u64,
                w,
                h,
                stride: 3 * w + pad,
                flip: (rng.next() % 2) as i32,
                cx,
                cy,
                cw,
                ch,
            });
            src.extend((0..(3 * w + pad) * h).map(|_| (rng.next() >> 56) as u8));
        }
        (src, jobs)
    }

    #[test]
    fn the_weight_table_changes_no_bit_of_the_output() {
        let mut rng = Rng(0x2545f4914f6cdd1d);
        let (src, jobs) = random_batch(&mut rng, 24);
        for (ow, oh, out) in [
            (32, 24, OutType::U8),
            (17, 40, OutType::BF16),
            (224, 224, OutType::F32),
            (5, 3, OutType::F16),
        ] {
            // The 1200x900 image shrunk to 32x24 takes ~75x75 taps a pixel; 224 enlarges most.
            let p = Params::normalized(ow, oh, out, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
            let take = if ow == 224 { &jobs[1..6] } else { &jobs[..] };
            let mut got = vec![0u8; take.len() * p.image_bytes()];
            reference(&src, take, &p, &mut got);
            assert!(got == direct(&src, take, &p), "{ow}x{oh} {out:?}");
        }
    }

    #[test]
    fn the_taps_reserved_always_cover_the_window() {
        // The unclamped window of every output column and row, over scales from 1/1000 to 1000,
        // never exceeds the taps `plan` reserves (the kernel would drop taps otherwise).
        let mut rng = Rng(0x9e3779b97f4a7c15);
        for _ in 0..20_000 {
            let w = 1 + (rng.next() % 5000) as i32;
            let outn = 1 + (rng.next() % 1000) as i32;
            let size = (w as f32 * rng.unit()).max(1e-3);
            let start = (w as f32 - size) * rng.unit();
            let job = Job {
                src: 0,
                w,
                h: 1,
                stride: 3 * w,
                flip: 0,
                cx: start,
                cy: 0.0,
                cw: size,
                ch: 1.0,
            };
            let p = Params::normalized(outn as u32, 1, OutType::U8, [0.0; 3], [1.0; 3]);
            let d = plan(&[job], &p, None).unwrap().jobs[0];
            let s = size / outn as f32;
            let f = s.max(1.0);
            for o in [0, outn / 2, outn - 1] {
                let cent = start + (o as f32 + 0.5) * s;
                let a = ((cent - f + 0.5) as i32).max(0);
                let b = ((cent + f + 0.5) as i32).min(w);
                assert!(
                    b - a <= d.tx,
                    "w {w} crop {size} at {start} to {outn}: window {} > {} taps",
                    b - a,
                    d.tx
                );
            }
        }
    }

    #[test]
    fn absurd_jobs_and_sizes_are_refused_naming_the_image() {
        let ok = whole(10, 10);
        let p = Params::normalized(4, 4, OutType::U8, [0.0; 3], [1.0; 3]);
        assert!(plan(&[ok], &p, Some(300)).is_ok());
        let cases = [
            (Job { w: 0, ..ok }, "image 1: 0x10"),
            (Job { stride: 29, ..ok }, "row stride of 29"),
            (Job { cw: f32::NAN, ..ok }, "does not fit"),
            (Job { cw: 11.0, ..ok }, "does not fit"),
            (Job { ch: -1.0, ..ok }, "does not fit"),
            (
                Job {
                    cx: f32::INFINITY,
                    ..ok
                },
                "does not fit",
            ),
            (Job { src: 1, ..ok }, "outside the source buffer"),
        ];
        for (bad, want) in cases {
            let e = plan(&[ok, bad], &p, Some(300)).unwrap_err().to_string();
            assert!(e.contains("image 1") && e.contains(want), "{e}");
        }
        for (w, h) in [(0, 4), (4, -1), (1 << 15, 1 << 14)] {
            let q = Params { ow: w, oh: h, ..p };
            assert!(plan(&[ok], &q, None).unwrap_err().to_string().contains("output size"));
        }
    }

    #[test]
    fn a_batch_past_the_grid_limit_is_strided_not_refused() {
        assert_eq!(grid(1, 224 * 224), (196, 1));
        assert_eq!(grid(0, 10), (1, 1));
        assert_eq!(grid(65_535, 256), (1, 65_535));
        assert_eq!(grid(70_000, 257), (2, GRID_Y_MAX));
        assert_eq!(grid(usize::MAX, 1), (1, GRID_Y_MAX));
    }

    #[test]
    fn the_dev_job_bytes_are_its_layout() {
        // Job (40 B) then an unsigned long long and two ints: 56 bytes, 8-aligned, as nvcc
        // lays out `DevJob`; `job_bytes` writes exactly the struct's memory.
        assert_eq!(std::mem::size_of::<DevJob>(), 56);
        assert_eq!(std::mem::align_of::<DevJob>(), 8);
        assert_eq!(std::mem::offset_of!(DevJob, wofs), 40);
        assert_eq!(std::mem::offset_of!(DevJob, ty), 52);
        let mut rng = Rng(7);
        let (src, jobs) = random_batch(&mut rng, 3);
        let p = Params::normalized(8, 8, OutType::U8, [0.0; 3], [1.0; 3]);
        let plan = plan(&jobs, &p, Some(src.len())).unwrap();
        // SAFETY: `DevJob` is repr(C) plain data without padding (56 bytes, checked above).
        let raw = unsafe {
            std::slice::from_raw_parts(
                plan.jobs.as_ptr().cast::<u8>(),
                plan.jobs.len() * std::mem::size_of::<DevJob>(),
            )
        };
        assert_eq!(plan.job_bytes(), raw);
        assert_eq!(
            plan.jobs[1].wofs,
            8 * (plan.jobs[0].tx as u64 + 3) + 8 * (plan.jobs[0].ty as u64 + 3)
        );
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
        assert!(KERNEL_SRC.contains(&format!("void {WEIGHTS_NAME}(")));
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
            "d.j.flip ? ow - 1 - ox : ox",
            "i += gridDim.y",
        ] {
            assert!(KERNEL_SRC.contains(needle), "{needle}");
        }
    }
}
