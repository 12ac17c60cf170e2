//! The nvJPEG GPU test's engine share in batches (`tests/tests/nvjpeg_gpu.rs`), as a function
//! over any [`Api`], so its guards run on the CPU against the fake nvJPEG
//! (`tests/tests/gpu_decode_plan.rs`): batches of a bounded size rather than every image at
//! once, a refused image and a failed batch sent to the hybrid decoder, and the figures of
//! what the engine did.

use ramjet_cuda::nvjpeg::decoder::{HardwareDecoder, Job};
use ramjet_cuda::nvjpeg::{status, Api};

/// What the engine made of its share.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EngineSplit {
    /// Images the engine decoded.
    pub decoded: Vec<usize>,
    /// Images for the hybrid decoder: those the engine refused, and every image of a batch
    /// that failed.
    pub to_hybrid: Vec<usize>,
    /// Images the engine refused.
    pub refused: usize,
    /// Images of the batches that failed.
    pub failed: usize,
    /// One line per refusal and per failed batch, for the log.
    pub log: Vec<String>,
}

/// Decodes images `ids` on the engine `batch` at a time (`job(i)` is image `i`'s job), on
/// `stream`; a batch's error sends all its images to the hybrid decoder and the next batch
/// still runs.
pub fn engine_batches<'a, A: Api>(
    hw: &mut HardwareDecoder<A>,
    ids: &[usize],
    job: impl Fn(usize) -> Job<'a>,
    stream: u64,
    batch: usize,
) -> EngineSplit {
    let mut out = EngineSplit::default();
    for chunk in ids.chunks(batch.max(1)) {
        let jobs: Vec<Job<'_>> = chunk.iter().map(|&i| job(i)).collect();
        match hw.decode(&jobs, stream) {
            Ok(rep) => {
                out.decoded.extend(rep.decoded.iter().map(|&k| chunk[k]));
                for &(k, s) in &rep.refused {
                    out.log
                        .push(format!("engine refused image {}: {}", chunk[k], status::name(s)));
                    out.to_hybrid.push(chunk[k]);
                }
                out.refused += rep.refused.len();
            }
            Err(e) => {
                out.log
                    .push(format!("engine batch of {} images failed: {e}", chunk.len()));
                out.failed += chunk.len();
                out.to_hybrid.extend_from_slice(chunk);
            }
        }
    }
    out
}
