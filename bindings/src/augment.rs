//! The fused augmentation kernel ([`ramjet_cuda::kernel`]) on memory torch owns: the GPU
//! parity test and the kernel benchmark (issue 40, step 5) launch it on torch's tensors and
//! torch's current stream through this, beside torchvision over the very same images.
//!
//! Private to the package (`ramjet._ramjet`); the Python side wraps it in
//! `ramjet._fused.FusedAugment`, which passes only pointers and sizes of tensors it holds.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use ramjet_cuda::gpu::{DevSpan, FusedKernel, Gpu};
use ramjet_cuda::kernel::{Job, OutType, Params};
use ramjet_cuda::libs::Search;
use ramjet_cuda::nvrtc::Nvrtc;

use crate::{InvalidInputError, RamjetError};

/// `(offset, w, h, stride, flip, crop left, crop top, crop width, crop height)` per image.
type JobTuple = (u64, i32, i32, i32, i32, f32, f32, f32, f32);

fn jobs(t: &[JobTuple]) -> Vec<Job> {
    t.iter()
        .map(|&(src, w, h, stride, flip, cx, cy, cw, ch)| Job {
            src,
            w,
            h,
            stride,
            flip,
            cx,
            cy,
            cw,
            ch,
        })
        .collect()
}

fn params(ow: i32, oh: i32, out: &str, mean: [f32; 3], std: [f32; 3]) -> PyResult<Params> {
    let t = match out {
        "uint8" => OutType::U8,
        "float16" => OutType::F16,
        "bfloat16" => OutType::BF16,
        "float32" => OutType::F32,
        other => {
            return Err(InvalidInputError::new_err(format!(
                "out_type must be uint8, float16, bfloat16 or float32, not {other:?}"
            )))
        }
    };
    if ow < 1 || oh < 1 {
        return Err(InvalidInputError::new_err(format!("output size {ow}x{oh}")));
    }
    if std.iter().any(|s| !s.is_finite() || *s == 0.0) || mean.iter().any(|m| !m.is_finite()) {
        return Err(InvalidInputError::new_err(format!(
            "mean {mean:?} and std {std:?} must be finite, std non-zero"
        )));
    }
    Ok(Params::normalized(ow as u32, oh as u32, t, mean, std))
}

/// The kernel loaded on one GPU (its primary context, the one torch uses).
#[pyclass(module = "ramjet._ramjet", unsendable)]
pub struct FusedAugment {
    gpu: Gpu,
    kernel: FusedKernel,
}

#[pymethods]
impl FusedAugment {
    /// Opens GPU `ordinal` and compiles the kernel for it, finding NVRTC in `python_roots`'
    /// wheels or the system.
    #[new]
    fn new(ordinal: usize, python_roots: Vec<std::path::PathBuf>) -> PyResult<Self> {
        let gpu = Gpu::open(ordinal).map_err(|e| RamjetError::new_err(e.to_string()))?;
        let nvrtc = Nvrtc::find(&Search::from_env(&python_roots)).map_err(|e| RamjetError::new_err(e.to_string()))?;
        let kernel = FusedKernel::load(&gpu, &nvrtc).map_err(|e| RamjetError::new_err(e.to_string()))?;
        Ok(FusedAugment { gpu, kernel })
    }

    /// Queues the kernel on `stream` (a CUDA stream handle of this GPU): the images at the
    /// jobs' byte offsets in the `src_len` bytes at `src`, into the `out_len` bytes at `out`
    /// (`[n, 3, oh, ow]` of `out_type`). The caller (ramjet._fused) passes the data pointers
    /// and sizes of CUDA tensors on this GPU that it keeps alive until the stream passes.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        src: u64,
        src_len: usize,
        jobs_: Vec<JobTuple>,
        out: u64,
        out_len: usize,
        ow: i32,
        oh: i32,
        out_type: &str,
        mean: [f32; 3],
        std: [f32; 3],
        stream: u64,
    ) -> PyResult<()> {
        let p = params(ow, oh, out_type, mean, std)?;
        // SAFETY: the Python wrapper passes the storage of CUDA tensors on this GPU and holds
        // them (and torch's caching allocator their blocks) until the stream passes the kernel.
        let (s, o) = unsafe { (DevSpan::new(src, src_len), DevSpan::new(out, out_len)) };
        self.kernel
            .launch_on(stream, s, &jobs(&jobs_), o, &p)
            .map_err(|e| InvalidInputError::new_err(e.to_string()))
    }

    /// The GPU's ordinal.
    #[getter]
    fn ordinal(&self) -> usize {
        self.gpu.ordinal()
    }
}

/// The kernel's arithmetic on the CPU ([`ramjet_cuda::kernel::reference`]) over `src`, as
/// bytes of `[n, 3, oh, ow]` `out_type` elements: what the GPU must return bit for bit.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn fused_reference<'py>(
    py: Python<'py>,
    src: &[u8],
    jobs_: Vec<JobTuple>,
    ow: i32,
    oh: i32,
    out_type: &str,
    mean: [f32; 3],
    std: [f32; 3],
) -> PyResult<Bound<'py, PyBytes>> {
    let p = params(ow, oh, out_type, mean, std)?;
    let j = jobs(&jobs_);
    ramjet_cuda::kernel::plan(&j, &p, Some(src.len())).map_err(|e| InvalidInputError::new_err(e.to_string()))?;
    let mut out = vec![0u8; j.len() * p.image_bytes()];
    py.detach(|| ramjet_cuda::kernel::reference(src, &j, &p, &mut out));
    Ok(PyBytes::new(py, &out))
}
