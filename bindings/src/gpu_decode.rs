//! The GPU decode path in a Python process (issue 41): `StreamingDataset(device="cuda",
//! decode=...)` opens this once per dataset and GPU. The loader makes batches for it
//! ([`ramjet_engine::loader::LoaderConfig::gpu_decoders`]); each batch's images go through
//! [`ramjet_cuda::decode_batch`] (nvJPEG's hardware engine and hybrid decoder, the CPU's share,
//! the fused kernel) into a device buffer from ramjet's pool, which leaves as a DLPack CUDA
//! tensor ([`ramjet_cuda::dlpack::Shared`]): `torch.from_dlpack` copies nothing, the trainer's
//! stream waits for the batch's event, and the buffer is reused only after the trainer's
//! stream is done with it.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

use ramjet_cuda::decode_batch::{run_source_batch, OnGpu, Stage};
use ramjet_cuda::dlpack::{Device, Shared};
use ramjet_cuda::gpu::{FusedKernel, Gpu};
use ramjet_cuda::libs::Search;
use ramjet_cuda::nvjpeg::decoder::{Bridge, HardwareDecoder, HybridDecoder};
use ramjet_cuda::nvjpeg::{Backend, Table};
use ramjet_cuda::nvrtc::Nvrtc;
use ramjet_engine::image::gpu_batch::{Planner, SourceBatch};
use ramjet_engine::image::route::Decoders;
use ramjet_engine::image::{ImageSpec, OutType};
use ramjet_engine::loader::{Batch, ColumnData, IN_FLIGHT_COPIES};
use ramjet_engine::metrics::Metrics;
use ramjet_engine::Error;

use crate::dlpack::{DType, Storage, Tensor};

/// Device memory the GPU decode's source and output buffers may hold at once: enough for a
/// few batches of 256 ImageNet images in flight.
const POOL_LIMIT: usize = 8 << 30;

/// Pinned memory nvJPEG's hybrid decoder and the engine may hold for bitstreams and state.
const PINNED_BOUND: usize = 1 << 30;

/// What `decode=` asks of one GPU, as the Python side passes it in the configuration.
#[derive(Debug, Clone, serde::Deserialize)]
pub(crate) struct GpuDecodeConfig {
    /// The GPU.
    pub ordinal: usize,
    /// Where to look for nvJPEG and NVRTC besides the environment and the system (the Python
    /// environment's site-packages: the `nvidia-*` wheels).
    #[serde(default)]
    pub roots: Vec<PathBuf>,
}

/// The GPU side of one dataset's GPU decode.
pub(crate) struct GpuSide {
    gpu: Arc<Gpu>,
    stage: Stage<Arc<Table>, OnGpu>,
    decoders: Decoders,
    /// Host source buffers the GPU may still copy from, each with an event after its copies.
    in_flight: VecDeque<(Box<SourceBatch>, ramjet_cuda::gpu::Event)>,
}

/// Host source buffers kept while the GPU may read them: with the one being taken, at most the
/// loader's [`IN_FLIGHT_COPIES`] are out of its hands (its pinned working set counts them).
const IN_FLIGHT: usize = IN_FLIGHT_COPIES - 1;

fn gpu_err(what: &str, ordinal: usize) -> impl Fn(ramjet_cuda::GpuError) -> Error + '_ {
    move |e| Error::invalid(format!("device cuda:{ordinal}"), format!("{what}: {e}"))
}

impl GpuSide {
    /// Opens GPU `cfg.ordinal` for decoding: its context and stream, the fused kernel (NVRTC),
    /// nvJPEG's hardware engine (when the GPU has one) and hybrid decoder.
    pub(crate) fn open(cfg: &GpuDecodeConfig) -> Result<GpuSide, Error> {
        let n = cfg.ordinal;
        let gpu = Arc::new(Gpu::open(n).map_err(gpu_err("opening the GPU", n))?);
        let search = Search::from_env(&cfg.roots);
        let nvrtc = Nvrtc::find(&search).map_err(gpu_err("finding NVRTC for the fused kernel", n))?;
        let kernel = Arc::new(FusedKernel::load(&gpu, &nvrtc).map_err(gpu_err("loading the fused kernel", n))?);
        let table = Arc::new(Table::find(&search).map_err(gpu_err("loading nvJPEG", n))?);
        let _current = ramjet_cuda::current::enter(gpu.context()).map_err(gpu_err("binding the context", n))?;
        let bound = Decoders::SCRATCH_BOUND as usize;
        let dev = || Bridge::new(ramjet_cuda::pool::CudaDevice::new(gpu.context().clone()), bound);
        let pinned = || Bridge::new(ramjet_cuda::pool::CudaHost::new(gpu.context().clone()), PINNED_BOUND);
        let (hardware, why) = HardwareDecoder::open_or_fall_back(table.clone(), dev(), pinned(), Some((256, 500, 375)));
        if let Some(e) = why {
            tracing::warn!(gpu = n, error = %e, "nvJPEG's hardware decoder did not open: decoding on the hybrid decoder");
        }
        let hybrid = HybridDecoder::open(table, Backend::Hybrid, dev(), pinned())
            .map_err(gpu_err("opening nvJPEG's hybrid decoder", n))?;
        let decoders = Decoders {
            hardware: hardware.is_some(),
            hybrid: true,
            scratch_bound: Decoders::SCRATCH_BOUND,
        };
        let pool = gpu.device_pool(POOL_LIMIT);
        let stage = Stage::new(OnGpu::new(gpu.clone(), kernel), hardware, Some(hybrid), pool);
        Ok(GpuSide {
            gpu,
            stage,
            decoders,
            in_flight: VecDeque::new(),
        })
    }

    /// Gives back the source buffers whose copies completed, and waits for the oldest while
    /// more than `keep` are held.
    fn reclaim(&mut self, keep: usize) -> Result<(), Error> {
        use ramjet_cuda::pool::Fence;
        let n = self.gpu.ordinal();
        while let Some((_, done)) = self.in_flight.front() {
            let complete = done.is_complete().map_err(gpu_err("waiting for a copy", n))?;
            if !complete && self.in_flight.len() <= keep {
                break;
            }
            if !complete {
                std::thread::sleep(std::time::Duration::from_micros(100));
                continue;
            }
            self.in_flight.pop_front();
        }
        Ok(())
    }

    /// The decoders this GPU has, for the loader's planner.
    pub(crate) fn decoders(&self) -> Decoders {
        self.decoders
    }

    /// The GPU.
    pub(crate) fn ordinal(&self) -> usize {
        self.gpu.ordinal()
    }

    /// Finishes a loader's batch made for the GPU path: its image column decoded and augmented
    /// on the GPU into a CUDA tensor, the other columns cut to the images kept (with `skip`, an
    /// image nobody could read is left out and recorded in the batch's skipped samples).
    pub(crate) fn finish(
        &mut self,
        batch: &mut Batch,
        spec: &ImageSpec,
        planner: Option<&Planner>,
        metrics: &Metrics,
        skip: bool,
    ) -> Result<Option<(String, Tensor)>, Error> {
        let Some(at) = batch
            .columns
            .iter()
            .position(|(_, c)| matches!(c, ColumnData::ImageSource(_)))
        else {
            return Ok(None);
        };
        let (name, col) = batch.columns.remove(at);
        let ColumnData::ImageSource(sb) = col else {
            unreachable!("matched above")
        };
        let n = self.gpu.ordinal();
        let _current = ramjet_cuda::current::enter(self.gpu.context()).map_err(gpu_err("binding the context", n))?;
        let (d, skipped) = run_source_batch(&mut self.stage, &sb, spec, planner, Some(metrics), skip)?;
        if d.kept.len() < sb.plan.images.len() {
            keep_rows(batch, &d.kept);
        }
        batch.skipped.extend(skipped);
        // The pinned source buffer goes back to the loader's pool once the GPU read it.
        let copied = self.gpu.record().map_err(gpu_err("recording an event", n))?;
        self.in_flight.push_back((sb, copied));
        self.reclaim(IN_FLIGHT)?;
        let ops = self.gpu.stream_ops(d.ready);
        let idle = self.gpu.record().map_err(gpu_err("recording an event", n))?;
        let shared = Shared::new(Box::new(d.out), Box::new(ops), Box::new(idle), Device::cuda(n));
        let dtype = match spec.out {
            OutType::U8 => DType::U8,
            OutType::F32 => DType::F32,
        };
        let shape = vec![d.kept.len() as i64, 3, spec.height as i64, spec.width as i64];
        Ok(Some((name, Tensor::new(Storage::Cuda(shared), shape, dtype))))
    }
}

/// Cuts every column of `batch` to the rows `kept` (indices into its rows, in order).
fn keep_rows(batch: &mut Batch, kept: &[usize]) {
    fn pick<T: Clone>(v: &[T], kept: &[usize]) -> Vec<T> {
        kept.iter().map(|&k| v[k].clone()).collect()
    }
    for (_, c) in &mut batch.columns {
        *c = match std::mem::replace(c, ColumnData::Int64(Vec::new())) {
            ColumnData::Int64(v) => ColumnData::Int64(pick(&v, kept)),
            ColumnData::Float64(v) => ColumnData::Float64(pick(&v, kept)),
            ColumnData::Str(v) => ColumnData::Str(pick(&v, kept)),
            ColumnData::Json(v) => ColumnData::Json(pick(&v, kept)),
            ColumnData::Bytes(v) => ColumnData::Bytes(pick(&v, kept)),
            ColumnData::Valid(v) => ColumnData::Valid(pick(&v, kept)),
            ColumnData::Boxes { values, offsets } => {
                let (mut vs, mut os) = (Vec::new(), vec![0i64]);
                for &k in kept {
                    vs.extend_from_slice(&values[offsets[k] as usize * 5..offsets[k + 1] as usize * 5]);
                    os.push((vs.len() / 5) as i64);
                }
                ColumnData::Boxes {
                    values: vs,
                    offsets: os,
                }
            }
            other => other,
        };
    }
    batch.indices = pick(&batch.indices, kept);
    batch.sources = pick(&batch.sources, kept);
}
