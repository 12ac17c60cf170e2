//! Batches: a [`Stream`] read by one task on the process runtime, decoded and augmented on the
//! process's decode pool ([`crate::rt::decode_pool`], shared by every loader), and assembled
//! in [`HostBuf`]s, in the stream's order.
//!
//! ```text
//!  reader task ─ job per batch ─▶ decode pool ── batches ──▶ reorder ──▶ next_batch()
//!  (owns Stream,  (at most `threads`  (shared,                (by seq)   (frees the batch's
//!   runtime)       decoding)           cores threads)                      `ahead` permit)
//! ```
//!
//! Two bounds: at most `threads` of this loader's batches decode at once (its share of the
//! pool), and at most `prefetch_batches + threads` are cut and not yet handed out (the
//! `ahead` permits, each freed when `next_batch` hands its batch out), so memory is bounded
//! whatever the consumer's pace. Both are [`Limit`]s the loader's tuner resizes as it runs
//! ([`tune_loop`]): `threads` to this consumer's share of the host's decode budget,
//! `prefetch_batches` to cover the longest recent gather of a batch at the consumer's rate,
//! within its share of the host's memory budget; values the user set stay.
//!
//! A batch never spans two epochs: the last batch of an epoch may be short (or dropped with
//! `drop_last`) and carries `end_of_epoch`. An epoch that ends with no batch for this consumer
//! (a share of no samples, or one shorter than a batch under `drop_last`) is handed out as
//! [`Next::EpochEnd`], so the consumer's epoch ends instead of waiting for a batch that never
//! comes. Each batch carries the stream's state after its last sample, so a consumer that
//! saves the state of the last batch it used resumes exactly after it.

use crate::error::Invalid;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use crate::buf::AlignedBuf;
use crate::buf::HostPool;
use crate::error::{Error, Location, Result};
use crate::format::array::{ArrayRef, Dims, Dtype};
use crate::format::{ColumnType, Schema, ValueRef};
use crate::image::gpu_batch::{self, DecodeMode, Planner, SourceBatch};
use crate::image::route::{Decoders as GpuDecoders, Path};
use crate::image::{process, ImageSpec, OutType, SampleRng, Scratch, Slot};
use crate::metrics::Metrics;
use crate::stall::{self, ConsumerClock, Timeline, WaitOn};
use crate::stream::{FirstGate, Item, Opened, Sample, Stream, StreamConfig, StreamState};
use crate::tune::{Limit, Permit};
use cut::Cut;

pub use crate::buf::HostBuf;

pub mod buckets;
mod cut;
mod epochs;
pub mod options;

pub use epochs::{Epochs, Step, SAVED_STATE_VERSION};
pub use options::{Arg, Options};

/// What to do with a sample whose image does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnCorrupt {
    /// Fail the batch with an error naming dataset, shard and sample.
    #[default]
    Error,
    /// Leave the sample out of its batch (which is then short) and count it.
    Skip,
}

/// Settings of a [`Loader`]: the one definition of the loader's options and their defaults
/// ([`LoaderConfig::default`]). The Python package sends them as JSON with the stream's keys
/// at the top level; any key may be left out.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(default)]
pub struct LoaderConfig {
    /// The sample stream (sources, order, topology, cache, resume point).
    #[serde(flatten)]
    pub stream: StreamConfig,
    /// Samples per batch.
    pub batch_size: usize,
    /// Drop an epoch's last batch when it is short.
    pub drop_last: bool,
    /// Decode the image column into this shape; `None` yields it as bytes.
    pub image: Option<ImageSpec>,
    /// Name of the image column.
    pub image_column: String,
    /// A JSON column of YOLO boxes (`[[class, cx, cy, w, h], ...]`) yielded as a flat
    /// `(M, 5)` float32 array plus per-sample offsets.
    pub boxes_column: Option<String>,
    /// This loader's batches decoding at once on the process's decode pool: the start value,
    /// which the tuner then sets from the host's budget ([`crate::tune`]), unless
    /// `threads_pinned`.
    pub threads: usize,
    /// The user set `threads` (`num_threads`): the tuner leaves it.
    pub threads_pinned: bool,
    /// Batches prepared ahead of the consumer: the start value, which the tuner then sizes
    /// from the consumer's rate and the fetch time, unless `prefetch_pinned`.
    pub prefetch_batches: usize,
    /// The user set `prefetch_batches`: the tuner leaves it.
    pub prefetch_pinned: bool,
    /// Images that fail to decode.
    pub on_corrupt: OnCorrupt,
    /// Aspect-ratio buckets, `(height, width)` each ([`buckets`]): every batch is one
    /// bucket's, decoded at its size (the image settings' other fields apply to all).
    pub buckets: Option<Vec<(u32, u32)>>,
    /// Which decoders take the images on the GPU path (`decode=`): used once
    /// [`gpu_decoders`](Self::gpu_decoders) is set.
    pub decode: DecodeMode,
    /// The GPU side's decoders, set by the binding once nvJPEG is open on the batch's GPU:
    /// the image column then leaves as a [`SourceBatch`] ([`ColumnData::ImageSource`]) with
    /// the CPU's share decoded, for the GPU side to finish. `None`: images are decoded and
    /// augmented here ([`ColumnData::Image`]).
    #[serde(skip)]
    pub gpu_decoders: Option<GpuDecoders>,
    /// Where batch buffers come from.
    #[serde(skip)]
    pub pool: Option<HostPool>,
    /// Tests only: the reader task panics after this many samples (a seam for the test that
    /// a panic there surfaces as an error instead of a short epoch).
    #[doc(hidden)]
    #[serde(skip)]
    pub panic_reader_after_samples: Option<u64>,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        Self::new(StreamConfig::default())
    }
}

impl LoaderConfig {
    /// Defaults over `stream`: batches of 32, images as bytes, one core's worth of batches
    /// decoding at once per core.
    pub fn new(stream: StreamConfig) -> Self {
        Self {
            stream,
            batch_size: 32,
            drop_last: false,
            image: None,
            image_column: "image".into(),
            boxes_column: Some("boxes".into()),
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            threads_pinned: false,
            prefetch_batches: 4,
            prefetch_pinned: false,
            on_corrupt: OnCorrupt::Error,
            buckets: None,
            decode: DecodeMode::Auto,
            gpu_decoders: None,
            pool: None,
            panic_reader_after_samples: None,
        }
    }
}

/// One column of a batch.
#[derive(Debug)]
pub enum ColumnData {
    /// Decoded images, `(n, 3, height, width)`, uint8 or float32 per `out`.
    Image {
        /// The pixels.
        buf: HostBuf,
        /// Images.
        n: usize,
        /// Height.
        height: u32,
        /// Width.
        width: u32,
        /// Element type.
        out: OutType,
    },
    /// Int64 values.
    Int64(Vec<i64>),
    /// Float64 values.
    Float64(Vec<f64>),
    /// Text values.
    Str(Vec<String>),
    /// Raw bytes values (zero-copy slices of the shard).
    Bytes(Vec<Bytes>),
    /// JSON text values.
    Json(Vec<String>),
    /// Images for the GPU path: planned, the CPU's share decoded, the rest still encoded
    /// (with [`LoaderConfig::gpu_decoders`]).
    ImageSource(Box<SourceBatch>),
    /// Typed arrays of one column (see [`ArrayBatch`]).
    Array(ArrayBatch),
    /// Which values of the nullable column before it are present (`<name>_valid`): false
    /// where the value is null (and holds the stored sentinel, `NULL_INT64` or a NaN).
    Valid(Vec<bool>),
    /// YOLO boxes: `values` is `(M, 5)` row-major `[class, cx, cy, w, h]`; sample `i` owns
    /// rows `offsets[i]..offsets[i + 1]`.
    Boxes {
        /// Flattened rows.
        values: Vec<f32>,
        /// `n + 1` row offsets.
        offsets: Vec<i64>,
    },
}

/// One array column of a batch. When every value has the same shape, `data` is one tensor of
/// shape `(n, *shape)`; otherwise (ragged) it is every value's elements back to back,
/// `offsets` says where each starts (in elements, `n + 1` of them) and `shapes` gives each
/// value's shape (`n` rows of `rank`).
#[derive(Debug)]
pub struct ArrayBatch {
    /// Element type of every value.
    pub dtype: Dtype,
    /// Elements, little-endian, row-major, in a buffer aligned to 4 KiB.
    pub data: Bytes,
    /// `(n, *shape)` when every value has the same shape; `None` when ragged.
    pub shape: Option<Vec<u64>>,
    /// Ragged: `n + 1` element offsets.
    pub offsets: Vec<i64>,
    /// Ragged: each value's shape, `n * rank` row-major.
    pub shapes: Vec<i64>,
    /// Number of axes of every value.
    pub rank: usize,
}

impl ArrayBatch {
    /// A batch of no values of a column of type `ty` (an array column).
    pub fn empty(ty: ColumnType) -> ArrayBatch {
        let ColumnType::Array(spec) = ty else {
            unreachable!("an array column")
        };
        let fixed = spec.fixed_shape();
        let rank = match spec.dims {
            Dims::Any => 1,
            Dims::Rank { rank, .. } => rank as usize,
        };
        ArrayBatch {
            dtype: spec.dtype.unwrap_or(Dtype::U8),
            data: Bytes::new(),
            shape: fixed
                .as_ref()
                .map(|f| std::iter::once(0).chain(f.iter().copied()).collect()),
            offsets: if fixed.is_some() { Vec::new() } else { vec![0] },
            shapes: Vec::new(),
            rank,
        }
    }

    /// The batch of `values` (at least one), named `what` in errors: every value must have the
    /// same dtype and rank.
    pub fn gather(values: &[ArrayRef<'_>], what: &str) -> std::result::Result<ArrayBatch, Invalid> {
        let first = values.first().ok_or("an array batch of no values")?;
        let (dtype, rank) = (first.dtype, first.rank());
        let mut total = 0usize;
        let mut same = true;
        for (k, v) in values.iter().enumerate() {
            if v.dtype != dtype {
                return Err(Invalid::from(format!(
                    "{what}: the batch mixes dtypes ({} at value 0, {} at value {k}); a batch needs one",
                    dtype.name(),
                    v.dtype.name()
                )));
            }
            if v.rank() != rank {
                return Err(Invalid::from(format!(
                    "{what}: the batch mixes ranks ({rank} at value 0, {} at value {k}); declare the column's rank",
                    v.rank()
                )));
            }
            same &= (0..rank).all(|a| v.dim(a) == first.dim(a));
            total += v.data.len();
        }
        let mut buf = AlignedBuf::zeroed(total);
        let out = buf.as_mut();
        let (mut at, mut offsets, mut shapes) = (0usize, Vec::new(), Vec::new());
        if !same {
            offsets.reserve(values.len() + 1);
            offsets.push(0);
            shapes.reserve(values.len() * rank);
        }
        for v in values {
            out[at..at + v.data.len()].copy_from_slice(v.data);
            at += v.data.len();
            if !same {
                offsets.push((at / dtype.size()) as i64);
                shapes.extend((0..rank).map(|a| v.dim(a) as i64));
            }
        }
        let shape = same.then(|| std::iter::once(values.len() as u64).chain(first.shape()).collect());
        Ok(ArrayBatch {
            dtype,
            data: buf.into_bytes(),
            shape,
            offsets,
            shapes,
            rank,
        })
    }
}

/// A sample left out of a batch because its image did not decode.
#[derive(Debug, Clone)]
pub struct Skipped {
    /// Shard URL.
    pub shard: String,
    /// Index of the sample in its dataset.
    pub sample: u64,
    /// Why.
    pub reason: String,
}

/// One batch.
#[derive(Debug)]
pub struct Batch {
    /// Epoch.
    pub epoch: u64,
    /// Columns, in schema order.
    pub columns: Vec<(String, ColumnData)>,
    /// Index of each sample in its dataset.
    pub indices: Vec<i64>,
    /// Source (input dataset of the mix) of each sample.
    pub sources: Vec<i64>,
    /// The stream's state after this batch's last sample (`None` for samples read by random
    /// access, which belong to no stream position).
    pub state: Option<StreamState>,
    /// This is the epoch's last batch for this consumer.
    pub end_of_epoch: bool,
    /// Samples left out (with `OnCorrupt::Skip`).
    pub skipped: Vec<Skipped>,
}

impl Batch {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// Host batches out of the loader's hands at once on the GPU path: the one just taken and those
/// whose copy to the GPU may still be in flight (`ramjet.StreamingDataset._to_device` keeps at
/// most 3 and waits for the oldest beyond).
pub const IN_FLIGHT_COPIES: usize = 4;

struct Job {
    seq: u64,
    epoch: u64,
    samples: Vec<Sample>,
    urls: Vec<String>,
    state: Option<StreamState>,
    end_of_epoch: bool,
    /// Its bucket's image settings (`None`: the loader's).
    spec: Option<Arc<ImageSpec>>,
}

/// The end of an epoch that gave this consumer no batch (see [`Next::EpochEnd`]).
#[derive(Debug, Clone)]
pub struct EpochEnd {
    /// The epoch that ended.
    pub epoch: u64,
    /// The stream's state at its end.
    pub state: Option<StreamState>,
}

/// What the reader hands to the consumer, in sequence.
enum Out {
    Batch(Batch),
    EpochEnd(EpochEnd),
}

/// A finished batch (or an epoch's end) by sequence number, with the permit that counts it as
/// ahead of the consumer, and its way through the loader (for the consumer's wait:
/// [`crate::stall`]).
type Done = (u64, Result<Out>, Option<Permit>, Option<Timeline>);

/// A finished batch waiting for its turn ([`Done`] without its sequence number).
type Waiting = (Result<Out>, Option<Permit>, Option<Timeline>);

/// Batch assembly (decode, augment, collate into pooled buffers): the one implementation,
/// used by the loader for whole batches on the decode pool and by random access (the Python
/// package's map-style reads) for one sample.
pub struct Assembler {
    cfg: LoaderConfig,
    schema: Arc<Schema>,
    pool: HostPool,
    seed: u64,
    metrics: Arc<Metrics>,
    /// The GPU path's planner (with [`LoaderConfig::gpu_decoders`] and images).
    planner: Option<Arc<Planner>>,
}

impl Assembler {
    /// An assembler of `schema`'s samples with `cfg`'s image, columns and corrupt-image
    /// settings, buffers from `cfg.pool` (else `buffers` aligned host buffers).
    pub fn new(cfg: LoaderConfig, schema: Arc<Schema>, metrics: Arc<Metrics>, buffers: usize) -> Assembler {
        let pool = cfg
            .pool
            .clone()
            .unwrap_or_else(|| HostPool::new(Box::new(crate::buf::AlignedAlloc), buffers));
        let planner = match (&cfg.image, cfg.gpu_decoders) {
            // Buckets decode on the CPU path: the GPU path's batches have one size.
            (Some(_), Some(_)) if cfg.buckets.is_some() => None,
            (Some(spec), Some(d)) => {
                let p = Arc::new(Planner::new(spec.clone(), d, cfg.decode, cfg.threads.max(1)));
                // The first planner of a stream's metrics is the one they report.
                let _ = metrics.decode.set(p.clone());
                Some(p)
            }
            _ => None,
        };
        Assembler {
            planner,
            seed: cfg.stream.order.seed,
            cfg,
            schema,
            pool,
            metrics,
        }
    }

    /// One sample (read by random access) as a batch of one, with `epoch`'s augmentation.
    pub fn one(&self, epoch: u64, sample: Sample, url: String, scratch: &mut Scratch) -> Result<Batch> {
        let job = Job {
            seq: 0,
            epoch,
            samples: vec![sample],
            urls: vec![url],
            state: None,
            end_of_epoch: false,
            spec: None,
        };
        assemble(self, job, scratch)
    }

    /// The GPU path's planner, when batches are made for it: the GPU side reports each
    /// decoder's time to it ([`Planner::observe`]).
    pub fn planner(&self) -> Option<&Arc<Planner>> {
        self.planner.as_ref()
    }
}

type Ctx = Assembler;

/// A running batch pipeline. Dropping it stops its reader task.
pub struct Loader {
    done: Receiver<Done>,
    reorder: BTreeMap<u64, Waiting>,
    /// Where the consumer's time goes ([`crate::stall`]).
    clock: ConsumerClock,
    next: u64,
    finished: bool,
    stop: Arc<AtomicBool>,
    reader: tokio::task::JoinHandle<()>,
    /// The task that resizes the decode and prefetch bounds ([`tune_loop`]).
    tuner: tokio::task::JoinHandle<()>,
    /// Batches handed to the consumer (the tuner's consumption rate).
    handed: Arc<AtomicU64>,
    metrics: Arc<Metrics>,
    schema: Arc<Schema>,
    /// The GPU path's planner (with [`LoaderConfig::gpu_decoders`] and images).
    planner: Option<Arc<Planner>>,
    /// When [`Loader::start`] began, until the first batch is handed out
    /// (`RAMJET_LOG=ramjet_engine=debug` shows how long that took).
    started: Option<std::time::Instant>,
}

/// What [`Loader::next_batch`] found.
#[derive(Debug)]
pub enum Next {
    /// A batch.
    Batch(Box<Batch>),
    /// This consumer's epoch ended without a batch (nothing to read in it, or only a short
    /// batch that `drop_last` dropped): the epoch's iteration is over, with no batch to yield.
    EpochEnd(Box<EpochEnd>),
    /// No batch within the timeout; ask again.
    Pending,
    /// The stream ended (its `epochs` ran out).
    End,
}

impl Drop for Loader {
    fn drop(&mut self) {
        // The reader task stops at its next await (its stream's cache copies go on in the
        // background); decode jobs queued on the pool see `stop` and return. Nothing here
        // waits, so a consumer is never held up by a fetch in flight.
        self.stop.store(true, Ordering::Relaxed);
        self.reader.abort();
        self.tuner.abort();
    }
}

/// The most samples in one batch.
pub const BATCH_SIZE_MAX: usize = 1 << 16;
/// The longest side of a decoded image, in pixels.
pub const IMAGE_SIDE_MAX: u32 = 16384;
/// The most bytes of one batch's decoded images (its buffer is allocated whole).
pub const BATCH_BYTES_MAX: u64 = 8 << 30;
/// The most batches prepared ahead.
pub const PREFETCH_BATCHES_MAX: usize = 1024;
/// The most decode threads one loader asks for.
pub const THREADS_MAX: usize = 4096;

impl LoaderConfig {
    /// Refuses settings that cannot work, each named, before any thread starts or any buffer is
    /// sized by them: the stream's ([`StreamConfig::check`]), a batch size of 0 or past
    /// [`BATCH_SIZE_MAX`], images of 0 pixels or past [`IMAGE_SIDE_MAX`] a side, batches past
    /// [`BATCH_BYTES_MAX`], augmentation parameters outside their ranges, a zero or non-finite
    /// `std` (a normalised image would be NaN).
    pub fn check(&self) -> Result<()> {
        self.stream.check()?;
        let bad = |what: &str, why: String| Err(Error::invalid(what, why));
        if self.batch_size == 0 || self.batch_size > BATCH_SIZE_MAX {
            return bad(
                "batch_size",
                format!("{} is not in 1..={BATCH_SIZE_MAX}", self.batch_size),
            );
        }
        if self.prefetch_batches > PREFETCH_BATCHES_MAX {
            return bad(
                "prefetch_batches",
                format!("{} is over {PREFETCH_BATCHES_MAX}", self.prefetch_batches),
            );
        }
        if self.threads == 0 || self.threads > THREADS_MAX {
            return bad("num_threads", format!("{} is not in 1..={THREADS_MAX}", self.threads));
        }
        let Some(spec) = &self.image else {
            if self.buckets.is_some() {
                return bad(
                    "buckets",
                    "needs images decoded (image_size set): a bucket is an image size".into(),
                );
            }
            return Ok(());
        };
        let mut sizes = vec![("image_size", spec.height, spec.width)];
        if let Some(b) = &self.buckets {
            buckets::BucketSizes::new(b)?;
            sizes.extend(b.iter().map(|&(h, w)| ("buckets", h, w)));
        }
        for (what, h, w) in sizes {
            if h == 0 || w == 0 || h > IMAGE_SIDE_MAX || w > IMAGE_SIDE_MAX {
                return bad(what, format!("({h}, {w}) is not in 1..={IMAGE_SIDE_MAX} pixels a side"));
            }
            let batch_bytes = (spec.bytes_at(h, w) as u64).saturating_mul(self.batch_size as u64);
            if batch_bytes > BATCH_BYTES_MAX {
                return bad(
                    "batch_size",
                    format!(
                        "{} images of {h}x{w} ({what}) make a batch of {batch_bytes} bytes, over {BATCH_BYTES_MAX}",
                        self.batch_size
                    ),
                );
            }
        }
        let unit = |v: f32| v.is_finite() && (0.0..=1.0).contains(&v);
        match spec.augment {
            crate::image::Augment::RandomResizedCrop { scale, ratio, flip } => {
                if !(unit(scale.0) && unit(scale.1) && scale.0 > 0.0 && scale.0 <= scale.1) {
                    return bad("scale", format!("{scale:?} is not (lo, hi) with 0 < lo <= hi <= 1"));
                }
                if !(ratio.0.is_finite() && ratio.1.is_finite() && ratio.0 > 0.0 && ratio.0 <= ratio.1) {
                    return bad("ratio", format!("{ratio:?} is not (lo, hi) with 0 < lo <= hi"));
                }
                if !unit(flip) {
                    return bad("flip", format!("{flip} is not a probability in [0, 1]"));
                }
            }
            crate::image::Augment::CenterCrop { crop_fraction } => {
                if !(unit(crop_fraction) && crop_fraction > 0.0) {
                    return bad("crop_fraction", format!("{crop_fraction} is not in (0, 1]"));
                }
            }
            crate::image::Augment::Resize => {}
        }
        if spec.mean.iter().any(|m| !m.is_finite()) {
            return bad("mean", format!("{:?} has a value that is not finite", spec.mean));
        }
        if spec.std.iter().any(|d| !d.is_finite() || *d <= 0.0) {
            return bad(
                "std",
                format!(
                    "{:?}: every value must be finite and above 0 (images are divided by it)",
                    spec.std
                ),
            );
        }
        Ok(())
    }
}

impl Loader {
    /// Opens the stream and starts the reader and decode threads.
    pub fn start(cfg: LoaderConfig) -> Result<Loader> {
        let started = std::time::Instant::now();
        cfg.check()?;
        let (mut stream, first_gate) = Stream::open_gated(cfg.stream.clone(), cfg.batch_size)?;
        let schema = check_schema(&stream, &cfg)?;
        let metrics = stream.metrics_handle();
        let stop = Arc::new(AtomicBool::new(false));
        let tuning = Tuning::new(&cfg);
        let threads = tuning.threads_start;
        let ahead = tuning.prefetch_start + threads;
        // Every batch cut holds an `ahead` permit until handed out, so at most `ahead` sit in
        // this channel: it never blocks a decode job.
        let (done_tx, done_rx) = unbounded::<Done>();
        // The working set: `ahead` batches decoding or queued, plus the host batches out of
        // the loader's hands on the GPU path (`IN_FLIGHT_COPIES`).
        let ctx = Arc::new(Assembler::new(
            cfg,
            schema.clone(),
            metrics.clone(),
            ahead + IN_FLIGHT_COPIES,
        ));
        let decode = crate::rt::decode_pool()?;
        // While the first batch is read (over a slow link, several round trips), the decode
        // threads ready themselves, and this loader's first batch buffers get their pages:
        // first touches that would otherwise fall into the first batch's decode.
        if let Some(spec) = ctx.cfg.image.clone() {
            // Under buckets, the largest bucket's batch.
            let most = ctx.cfg.buckets.iter().flatten().map(|&(h, w)| spec.bytes_at(h, w));
            let len = most.fold(spec.bytes(), usize::max) * ctx.cfg.batch_size;
            // The whole working set now (page-locked memory for a GPU: never allocated or
            // freed mid-training, where it would synchronise the GPU's streams).
            ctx.pool.count_in(metrics.clone());
            ctx.pool.prefill(len);
            for _ in 0..threads {
                let (ctx, spec) = (ctx.clone(), spec.clone());
                decode.spawn(move || {
                    prime_thread(&spec);
                    if let Some(mut b) = ctx.pool.take(len) {
                        b.as_mut_slice().fill(0);
                    }
                });
            }
        }
        let rt = crate::rt::handle()?;
        // Dropped on a runtime thread (when the reader task ends or is aborted), the stream
        // must not block that thread waiting for its cache copies; they finish regardless.
        stream.wait_inserts_on_drop(false);
        let reader = {
            let (ctx, stop, done_tx) = (ctx.clone(), stop.clone(), done_tx.clone());
            let permits = Permits {
                ahead: tuning.ahead.clone(),
                decoding: tuning.decoding.clone(),
                gap_ns: tuning.gap_ns.clone(),
            };
            rt.spawn(async move {
                use futures::FutureExt;
                // The next batch's sequence number, kept outside the loop, so that a panic
                // is reported in its place: the batches before it are delivered, then the
                // error, never a silently short epoch.
                let next = Arc::new(AtomicU64::new(0));
                let to = Decoders {
                    pool: decode,
                    done: &done_tx,
                    started,
                    first_gate,
                };
                let r = std::panic::AssertUnwindSafe(read_loop(stream, &ctx, &stop, &next, permits, to))
                    .catch_unwind()
                    .await;
                if let Err(p) = r {
                    let _ = done_tx.send((
                        next.load(Ordering::SeqCst),
                        Err(Error::from_panic("ramjet-reader", &*p)),
                        None,
                        None,
                    ));
                }
            })
        };
        let handed = tuning.handed.clone();
        let tuner = rt.spawn(tune_loop(tuning, metrics.clone()));
        Ok(Loader {
            tuner,
            handed,
            done: done_rx,
            reorder: BTreeMap::new(),
            clock: ConsumerClock::default(),
            next: 0,
            finished: false,
            stop,
            reader,
            metrics,
            schema,
            planner: ctx.planner.clone(),
            started: Some(started),
        })
    }

    /// The GPU path's planner, when batches are made for it (the GPU side reports each
    /// decoder's measured rate to it: [`Planner::observe`]).
    pub fn planner(&self) -> Option<&Arc<Planner>> {
        self.planner.as_ref()
    }

    /// The next batch in order, waiting at most `timeout` (so a caller can check for
    /// interrupts between waits). Time spent waiting counts as batch wait in the metrics.
    pub fn next_batch(&mut self, timeout: Duration) -> Result<Next> {
        let t = std::time::Instant::now();
        self.clock.asking(t, &self.metrics);
        let r = self.next_inner(timeout);
        Metrics::add(&self.metrics.batch_wait_ns, t.elapsed().as_nanos() as u64);
        r
    }

    /// The consumer's call spent `d` more on `on` after its batch was handed out (the GPU
    /// side's decode): charged there in the wait's split, not to "not waiting".
    pub fn charge(&mut self, on: WaitOn, d: Duration) {
        self.clock.charge(on, d, &self.metrics);
    }

    fn next_inner(&mut self, timeout: Duration) -> Result<Next> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some((r, permit, tl)) = self.reorder.remove(&self.next) {
                self.next += 1;
                // Handed out: the reader may cut one more.
                drop(permit);
                self.handed.fetch_add(1, Ordering::Relaxed);
                self.clock
                    .delivered(std::time::Instant::now(), tl.as_ref(), &self.metrics);
                return match r {
                    Ok(Out::EpochEnd(e)) => {
                        consumer_at(&self.metrics, e.epoch, e.state.as_ref());
                        Ok(Next::EpochEnd(Box::new(e)))
                    }
                    Ok(Out::Batch(b)) => {
                        if let Some(t) = self.started.take() {
                            tracing::debug!(ms = t.elapsed().as_secs_f64() * 1e3, "loader: first batch handed out");
                        }
                        // Counted on delivery, not on decode: the reader runs ahead into the
                        // next epoch, and its skips belong to batches not yet handed out.
                        Metrics::add(&self.metrics.samples_skipped, b.skipped.len() as u64);
                        self.metrics.batch_handed();
                        consumer_at(&self.metrics, b.epoch, b.state.as_ref());
                        Ok(Next::Batch(Box::new(b)))
                    }
                    Err(e) => {
                        self.finished = true;
                        Err(e)
                    }
                };
            }
            if self.finished {
                return Ok(Next::End);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.done.recv_timeout(left) {
                Ok((seq, r, permit, tl)) => {
                    self.reorder.insert(seq, (r, permit, tl));
                }
                Err(RecvTimeoutError::Timeout) => return Ok(Next::Pending),
                Err(RecvTimeoutError::Disconnected) => {
                    self.finished = true;
                }
            }
        }
    }

    /// The live counters of the underlying stream.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// The schema of the batches' columns.
    pub fn schema(&self) -> Arc<Schema> {
        self.schema.clone()
    }
}

/// The reader's two bounds (see the module docs), both resized by the tuner, and the longest
/// time the reader took to gather one batch since the tuner last looked (nanoseconds).
struct Permits {
    ahead: Arc<Limit>,
    decoding: Arc<Limit>,
    gap_ns: Arc<AtomicU64>,
}

/// Where the reader's batches go: the decode pool, then the channel of finished batches.
struct Decoders<'a> {
    pool: &'static crate::rt::Pool,
    done: &'a Sender<Done>,
    /// When the loader started (the first batch's debug events count from it).
    started: std::time::Instant,
    /// Opened once the first batch is decoded: until then the stream reads nothing more
    /// (neither samples nor whole shards, for at most half a second), so that nothing takes
    /// the CPU or the link from the first batch ([`Stream::open_gated`]).
    first_gate: Option<FirstGate>,
}

/// Pulls samples, cuts them into per-epoch batches and hands them to the decode pool.
async fn read_loop(
    mut stream: Stream,
    ctx: &Arc<Ctx>,
    stop: &Arc<AtomicBool>,
    next: &AtomicU64,
    permits: Permits,
    to: Decoders<'_>,
) {
    let Decoders {
        pool,
        done,
        started,
        mut first_gate,
    } = to;
    let mut cutter = match cutter(ctx, &stream) {
        Ok(c) => c,
        Err(e) => {
            let _ = done.send((0, Err(e), None, None));
            return;
        }
    };
    let mut seq = 0u64;
    let mut read = 0u64;
    // This batch's read: when it began, and the reader's waits on each source until then.
    let mut read_start = std::time::Instant::now();
    let mut blocked_before = stall::read_waits(&ctx.metrics);
    loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        if ctx.cfg.panic_reader_after_samples == Some(read) {
            panic!("injected reader panic after {read} samples");
        }
        read += 1;
        let s = match stream.next_item_async().await {
            Ok(Some(Item::Sample(s))) => s,
            Ok(Some(Item::EmptyEpoch { epoch })) => {
                let end = EpochEnd {
                    epoch,
                    state: stream.state(),
                };
                hand_epoch_end(end, &mut seq, next, &permits, done, &mut first_gate).await;
                if let Cutter::InOrder(c) = &mut cutter {
                    c.empty_epoch(epoch);
                }
                continue;
            }
            Ok(None) => return,
            Err(e) => {
                let _ = done.send((seq, Err(e), None, None));
                return;
            }
        };
        let b = match cutter.push(&stream, s) {
            Ok(None) => continue,
            Ok(Some(Cut::EpochEnd(end))) => {
                hand_epoch_end(end, &mut seq, next, &permits, done, &mut first_gate).await;
                continue;
            }
            Ok(Some(Cut::Batch(b))) => b,
            Err(e) => {
                let _ = done.send((seq, Err(e), None, None));
                return;
            }
        };
        let after = stall::read_waits(&ctx.metrics);
        let timeline = Timeline::read(read_start, std::time::Instant::now(), blocked_before, after);
        let job = Job {
            seq,
            epoch: b.epoch,
            samples: b.samples,
            urls: b.urls,
            state: Some(b.state),
            end_of_epoch: b.end_of_epoch,
            spec: b.spec,
        };
        seq += 1;
        next.store(seq, Ordering::SeqCst);
        permits
            .gap_ns
            .fetch_max(read_start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let to = Decoders {
            pool,
            done,
            started,
            first_gate: if job.seq == 0 { first_gate.take() } else { None },
        };
        dispatch(ctx, stop, &permits, to, (job, timeline)).await;
        // The next batch's read begins now (the wait for permits above belongs to decode).
        read_start = std::time::Instant::now();
        blocked_before = stall::read_waits(&ctx.metrics);
    }
}

/// How the reader cuts samples into batches.
enum Cutter {
    InOrder(cut::InOrder),
    Buckets(Box<buckets::Fill>),
}

impl Cutter {
    /// Takes `s`, the sample `stream` just delivered.
    fn push(&mut self, stream: &Stream, s: Sample) -> Result<Option<Cut>> {
        let state = stream.state().expect("a sample was delivered");
        let r = cut::Read {
            url: stream.shard_url(s.id.source, s.id.shard),
            left: stream
                .epoch_len()
                .map_or(usize::MAX, |n| n.saturating_sub(state.delivered as usize)),
            sample: s,
            state,
        };
        match self {
            Cutter::InOrder(c) => Ok(c.push(r)),
            Cutter::Buckets(f) => f.push(r),
        }
    }
}

/// Hands `job` to the decode pool once this loader may have one more batch ahead and one more
/// decoding (the first batch opens the stream's gate when decoded: `to.first_gate`).
async fn dispatch(ctx: &Arc<Ctx>, stop: &Arc<AtomicBool>, permits: &Permits, to: Decoders<'_>, work: (Job, Timeline)) {
    let ahead = permits.ahead.acquire().await;
    let decoding = permits.decoding.acquire().await;
    if work.0.seq == 0 {
        // The first batch's stages (RAMJET_LOG=debug): its samples read, then decoded.
        tracing::debug!(
            ms = to.started.elapsed().as_secs_f64() * 1e3,
            "loader: first batch read"
        );
    }
    let (job_ctx, stop, done, gate, started) = (ctx.clone(), stop.clone(), to.done.clone(), to.first_gate, to.started);
    to.pool
        .spawn(move || decode_and_send(&job_ctx, work, &stop, &done, (ahead, decoding), gate, started));
}

/// The cutter `ctx`'s settings ask for: by bucket (checked against the stream's schema, and
/// resumed from the consumer's saved buckets), else in read order.
fn cutter(ctx: &Ctx, stream: &Stream) -> Result<Cutter> {
    let cfg = &ctx.cfg;
    match (&cfg.buckets, &cfg.image) {
        (Some(sizes), Some(spec)) => Ok(Cutter::Buckets(Box::new(buckets::Fill::new(
            sizes,
            spec,
            cfg.batch_size,
            &stream.schema(0),
            ctx.metrics.clone(),
            cfg.stream.resume_consumer.as_ref(),
        )?))),
        _ => Ok(Cutter::InOrder(cut::InOrder::new(cfg.batch_size, cfg.drop_last))),
    }
}

/// Records where the consumer is after what it was just handed: the epoch, its position and
/// the epoch's length (the heartbeat and `metrics()` report them).
fn consumer_at(m: &Metrics, epoch: u64, state: Option<&StreamState>) {
    m.consumer_epoch.store(epoch, Ordering::Relaxed);
    if let Some(st) = state {
        m.consumer_position.store(st.delivered, Ordering::Relaxed);
        m.consumer_epoch_len.store(st.len, Ordering::Relaxed);
    }
}

/// Hands the consumer the end of an epoch that gave it no batch, in sequence, holding an
/// `ahead` permit like a batch (so a run of empty epochs waits for the consumer instead of
/// spinning). It opens the first-batch gate: there is no first batch to wait for.
async fn hand_epoch_end(
    end: EpochEnd,
    seq: &mut u64,
    next: &AtomicU64,
    permits: &Permits,
    done: &Sender<Done>,
    first_gate: &mut Option<FirstGate>,
) {
    if let Some(g) = first_gate.take() {
        g.open();
    }
    let ahead = permits.ahead.acquire().await;
    let _ = done.send((*seq, Ok(Out::EpochEnd(end)), Some(ahead), None));
    *seq += 1;
    next.store(*seq, Ordering::SeqCst);
}

/// The loader's tuner: its bounds and what it measures (see [`crate::tune`]).
struct Tuning {
    decoding: Arc<Limit>,
    ahead: Arc<Limit>,
    gap_ns: Arc<AtomicU64>,
    handed: Arc<AtomicU64>,
    threads_start: usize,
    prefetch_start: usize,
    threads_pinned: bool,
    /// Why the prefetch depth is pinned, if it is.
    prefetch_pinned: Option<&'static str>,
    batch_bytes: u64,
}

/// How often the loader's tuner looks.
const TUNE_EVERY: Duration = Duration::from_millis(500);
/// A host grant older than this is stale (the daemon stopped answering): the process is
/// then the host.
const GRANT_STALE: Duration = Duration::from_secs(10);

impl Tuning {
    fn new(cfg: &LoaderConfig) -> Tuning {
        let cores = crate::rt::decode_threads();
        // Before the host daemon's first grant, a rank assumes an even split among the ranks
        // torchrun or Slurm say share its host.
        let local_ranks = ["LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"]
            .iter()
            .find_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok())
            .filter(|n| *n > 0)
            .unwrap_or(1);
        let threads_start = if cfg.threads_pinned {
            cfg.threads.max(1)
        } else {
            cfg.threads.clamp(1, (cores / local_ranks).max(1))
        };
        // Page-locked batch memory (a GPU's) is sized once, so its depth stays as set.
        let prefetch_pinned = if cfg.prefetch_pinned {
            Some("pinned by the user")
        } else if cfg.pool.is_some() {
            Some("page-locked host memory is sized once")
        } else {
            None
        };
        let batch_bytes = cfg
            .image
            .as_ref()
            .map_or(1 << 20, |s| (s.bytes() * cfg.batch_size) as u64);
        Tuning {
            decoding: Limit::new(threads_start),
            ahead: Limit::new(cfg.prefetch_batches.max(1) + threads_start),
            gap_ns: Arc::default(),
            handed: Arc::default(),
            threads_start,
            prefetch_start: cfg.prefetch_batches.max(1),
            threads_pinned: cfg.threads_pinned,
            prefetch_pinned,
            batch_bytes: batch_bytes.max(1),
        }
    }
}

/// Every [`TUNE_EVERY`]: this loader's decode jobs at once follow its share of the host's
/// decode budget (the host daemon's grant, else the process's decode pool: the process is the
/// host), and its batches ahead cover the longest recent gather of one batch at the consumer's
/// rate, within its share of the host's memory budget ([`crate::tune::prefetch_batches`]).
/// Pinned values stay. What it chose and why is in the metrics (`tune_*`).
async fn tune_loop(t: Tuning, metrics: Arc<Metrics>) {
    let pool = crate::rt::decode_threads();
    let (mut last, mut handed_before) = (std::time::Instant::now(), 0u64);
    let mut gap_s = 0.0f64;
    let mut rate = 0.0f64;
    loop {
        let last_grant = *metrics.grant.lock().expect("grant lock");
        let grant = last_grant.filter(|(at, _)| at.elapsed() < GRANT_STALE).map(|(_, g)| g);
        let (threads, why) = if t.threads_pinned {
            (t.decoding.size(), "pinned by the user")
        } else if let Some(g) = grant {
            (g.decode_threads as usize, "host daemon's share")
        } else if last_grant.is_some() {
            (pool, "host daemon silent: the process is the host")
        } else {
            (
                t.threads_start,
                "the process's share (no host daemon grant yet, or none)",
            )
        };
        // A pinned value stays as given; a tuned one fits the decode pool.
        let threads = if t.threads_pinned {
            threads
        } else {
            threads.clamp(1, pool.max(1))
        };
        t.decoding.resize(threads);
        metrics.decode_threads.store(threads as u64, Ordering::Relaxed);
        metrics.set_tune("decode_threads", threads as u64);
        metrics.set_tune("decode_threads_reason", why);
        // The consumer's rate (batches/s, smoothed) and the longest gather of one batch
        // (decaying by a tenth a look, so one long fetch is remembered for some seconds).
        let now = std::time::Instant::now();
        let dt = now.duration_since(last).as_secs_f64().max(1e-3);
        let handed = t.handed.load(Ordering::Relaxed);
        let r = handed.saturating_sub(handed_before) as f64 / dt;
        rate = if rate == 0.0 { r } else { 0.7 * rate + 0.3 * r };
        (last, handed_before) = (now, handed);
        gap_s = (gap_s * 0.9).max(t.gap_ns.swap(0, Ordering::Relaxed) as f64 / 1e9);
        let memory = grant.map_or_else(crate::tune::host_memory_budget, |g| g.memory_bytes);
        let (depth, why) = match t.prefetch_pinned {
            Some(why) => (t.prefetch_start, why),
            None => (
                crate::tune::prefetch_batches(rate, gap_s, t.batch_bytes, memory, 2),
                "covers the longest recent batch gather at the consumer's rate",
            ),
        };
        t.ahead.resize(depth + threads);
        metrics.set_tune("prefetch_batches", depth as u64);
        metrics.set_tune("prefetch_batches_reason", why);
        metrics.set_tune("consumer_batches_per_s", (rate * 100.0).round() / 100.0);
        metrics.set_tune("gather_s", (gap_s * 1e4).round() / 1e4);
        metrics.set_tune("memory_budget_bytes", memory);
        tokio::time::sleep(TUNE_EVERY).await;
    }
}

/// On a decode-pool thread: decodes `job` (unless the loader stopped) and hands its batch on
/// with its `ahead` permit; the `decoding` permit is freed when this returns. The first batch
/// opens the stream's gate and logs its decode (RAMJET_LOG=debug): the thread's own CPU time
/// and page faults tell a decode that waited for a core from one that worked longer.
fn decode_and_send(
    ctx: &Ctx,
    (job, mut timeline): (Job, Timeline),
    stop: &AtomicBool,
    done: &Sender<Done>,
    (ahead, _decoding): (Permit, Permit),
    gate: Option<FirstGate>,
    started: std::time::Instant,
) {
    if stop.load(Ordering::Relaxed) {
        return;
    }
    timeline.decode_start = Some(std::time::Instant::now());
    let ms = move || started.elapsed().as_secs_f64() * 1e3;
    let t = (job.seq == 0).then(|| (ms(), crate::rt::thread_usage()));
    let (seq, r) = (job.seq, decode_job(ctx, job));
    if let Some((t, (cpu, minflt, majflt))) = t {
        let (cpu2, minflt2, majflt2) = crate::rt::thread_usage();
        tracing::debug!(
            ms = ms(),
            decode_ms = ms() - t,
            cpu_ms = cpu2.saturating_sub(cpu).as_secs_f64() * 1e3,
            minflt = minflt2.saturating_sub(minflt),
            majflt = majflt2.saturating_sub(majflt),
            "loader: first batch decoded"
        );
    }
    if let Some(g) = gate {
        g.open();
    }
    let _ = done.send((seq, r.map(Out::Batch), Some(ahead), Some(timeline)));
}

thread_local! {
    /// Each decode-pool thread's resize scratch, reused across jobs and loaders. Boxed, to
    /// keep the static TLS block small (`io::uring`'s `OWN_RING` says why).
    static SCRATCH: std::cell::RefCell<Box<Scratch>> = std::cell::RefCell::new(Box::default());
}

/// Runs `f` on this decode-pool thread's scratch. A panic comes back as the `Err`, and the
/// scratch, whose buffers may then be half-written, starts afresh.
fn on_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> std::thread::Result<T> {
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut scratch)));
        if r.is_err() {
            **scratch = Scratch::default();
        }
        r
    })
}

/// Primes this decode-pool thread's scratch for `spec` ([`crate::image::prime`]), once.
fn prime_thread(spec: &crate::image::ImageSpec) {
    let t = std::time::Instant::now();
    match on_scratch(|scratch| crate::image::prime(spec, scratch)) {
        Ok(Ok(true)) => tracing::trace!(ms = t.elapsed().as_secs_f64() * 1e3, "loader: decode thread primed"),
        Ok(Ok(false)) => {}
        // Not fatal: the real images decode regardless (and report their own errors).
        Ok(Err(e)) => tracing::debug!("loader: priming the decode thread failed: {e}"),
        Err(_) => tracing::debug!("loader: priming the decode thread panicked"),
    }
}

/// Decodes one job on a pool thread; a panic comes back as the batch's error.
fn decode_job(ctx: &Ctx, job: Job) -> Result<Batch> {
    on_scratch(|scratch| assemble(ctx, job, scratch)).unwrap_or_else(|p| Err(Error::from_panic("ramjet-decode", &*p)))
}

fn corrupt(url: &str, sample: u64, reason: impl Into<String>) -> Error {
    Error::corrupt(Location::sample(url, sample), reason)
}

/// Decodes one job into a batch.
fn assemble(ctx: &Ctx, job: Job, scratch: &mut Scratch) -> Result<Batch> {
    let cfg = &ctx.cfg;
    let schema = &ctx.schema;
    let mut rows: Vec<(usize, Vec<ValueRef<'_>>)> = Vec::with_capacity(job.samples.len());
    for (i, s) in job.samples.iter().enumerate() {
        rows.push((i, s.values()?));
    }
    let spec = job.spec.as_deref().or(cfg.image.as_ref());
    let image_col = spec.and_then(|_| schema.columns.iter().position(|c| c.name == cfg.image_column));
    let mut skipped = Vec::new();
    let mut image = None;
    let mut sources = None;
    match (spec, image_col, &ctx.planner) {
        (Some(_), Some(ci), Some(planner)) => {
            let (kept, batch) = decode_sources(ctx, planner, &job, rows, ci, scratch, &mut skipped)?;
            rows = kept;
            sources = Some((ci, batch));
        }
        (Some(spec), Some(ci), None) => {
            let (kept, buf, n) = decode_images(ctx, &job, rows, spec, ci, scratch, &mut skipped)?;
            rows = kept;
            image = Some((ci, buf, n));
        }
        _ => {}
    }
    let mut columns = Vec::with_capacity(schema.columns.len());
    for (ci, col) in schema.columns.iter().enumerate() {
        if sources.as_ref().is_some_and(|(ic, _)| *ic == ci) {
            let (_, batch) = sources.take().expect("present");
            columns.push((col.name.clone(), ColumnData::ImageSource(Box::new(batch))));
            continue;
        }
        if let Some((ic, _, _)) = &image {
            if *ic == ci {
                let (_, buf, n) = image.take().expect("present");
                let spec = spec.expect("set");
                columns.push((
                    col.name.clone(),
                    ColumnData::Image {
                        buf,
                        n,
                        height: spec.height,
                        width: spec.width,
                        out: spec.out,
                    },
                ));
                continue;
            }
        }
        let data = column_data(cfg, &job, &rows, ci, col)?;
        columns.push((col.name.clone(), data));
        if col.nullable {
            let valid = rows.iter().map(|(_, v)| !col.is_null(&v[ci])).collect();
            columns.push((format!("{}_valid", col.name), ColumnData::Valid(valid)));
        }
    }
    let indices = rows.iter().map(|(i, _)| job.samples[*i].global_index as i64).collect();
    let sources = rows.iter().map(|(i, _)| job.samples[*i].id.source as i64).collect();
    Ok(Batch {
        epoch: job.epoch,
        columns,
        indices,
        sources,
        state: job.state,
        end_of_epoch: job.end_of_epoch,
        skipped,
    })
}

/// The schema of a loader's batches: every source of the mix must have the same, and with
/// images decoded, a bytes column of `cfg.image_column`.
fn check_schema(stream: &Stream, cfg: &LoaderConfig) -> Result<Arc<Schema>> {
    let schema = stream.schema(0);
    for s in 1..stream.sources() {
        if *stream.schema(s) != *schema {
            return Err(Error::invalid(
                stream.dataset(s).manifest_url(),
                "its columns differ from the first dataset's; mixed datasets must share one schema",
            ));
        }
    }
    if cfg.image.is_some() {
        match schema.columns.iter().find(|c| c.name == cfg.image_column) {
            Some(c) if c.ty == ColumnType::Bytes => {}
            _ => {
                return Err(Error::invalid(
                    stream.dataset(0).manifest_url(),
                    format!("no bytes column {:?} to decode images from", cfg.image_column),
                ))
            }
        }
    }
    Ok(schema)
}

/// A batch's rows: each sample's position in its job and its values.
type Rows<'a> = Vec<(usize, Vec<ValueRef<'a>>)>;

/// Decodes and augments the image column `ci` of `rows` into one pooled buffer, sample after
/// sample. Returns the rows whose image decoded (a corrupt one is an error, or with
/// [`OnCorrupt::Skip`] left out and recorded in `skipped`), the buffer and their count.
fn decode_images<'a>(
    ctx: &Ctx,
    job: &Job,
    rows: Rows<'a>,
    spec: &ImageSpec,
    ci: usize,
    scratch: &mut Scratch,
    skipped: &mut Vec<Skipped>,
) -> Result<(Rows<'a>, HostBuf, usize)> {
    let cfg = &ctx.cfg;
    let per = spec.bytes();
    let mut buf = ctx
        .pool
        .take(per * rows.len().max(1))
        .ok_or_else(|| Error::invalid("batch buffer", format!("cannot allocate {} bytes", per * rows.len())))?;
    let mut kept = Vec::with_capacity(rows.len());
    let mut n = 0usize;
    for (i, vals) in rows {
        let s = &job.samples[i];
        let ValueRef::Bytes(bytes) = vals[ci] else {
            unreachable!("checked to be a bytes column at start")
        };
        let mut rng = SampleRng::new(ctx.seed, job.epoch, s.id.source, s.global_index);
        let r = match spec.out {
            OutType::U8 => {
                let slot = &mut buf.as_mut_slice()[n * per..(n + 1) * per];
                process(bytes, spec, &mut rng, Slot::U8(slot), scratch)
            }
            OutType::F32 => {
                let e = spec.elems();
                let slot = &mut buf.as_mut_f32()[n * e..(n + 1) * e];
                process(bytes, spec, &mut rng, Slot::F32(slot), scratch)
            }
        };
        match r {
            Ok(_) => {
                Metrics::add(&ctx.metrics.images_decoded, 1);
                n += 1;
                kept.push((i, vals));
            }
            Err(reason) => bad_image(cfg, job, i, reason, skipped)?,
        }
    }
    Ok((kept, buf, n))
}

/// Plans the image column `ci` of `rows` for the GPU path and decodes the CPU's share into
/// the source buffer (see [`SourceBatch`]). An image whose header does not read, or whose CPU
/// decode fails, is an error naming it, or with [`OnCorrupt::Skip`] left out and recorded in
/// `skipped`; the GPU side reports its own decoders' failures the same way.
fn decode_sources<'a>(
    ctx: &Ctx,
    planner: &Planner,
    job: &Job,
    rows: Rows<'a>,
    ci: usize,
    scratch: &mut Scratch,
    skipped: &mut Vec<Skipped>,
) -> Result<(Rows<'a>, SourceBatch)> {
    let cfg = &ctx.cfg;
    let image = |vals: &[ValueRef<'a>]| -> &'a [u8] {
        let ValueRef::Bytes(b) = vals[ci] else {
            unreachable!("checked to be a bytes column at start")
        };
        b
    };
    let samples: Vec<(&[u8], SampleRng)> = rows
        .iter()
        .map(|(i, vals)| {
            let s = &job.samples[*i];
            let rng = SampleRng::new(ctx.seed, job.epoch, s.id.source, s.global_index);
            (image(vals), rng)
        })
        .collect();
    let mut plan = planner.plan(&samples);
    // Buffers of a few sizes only, so that the pool reuses them (a pinned allocation mid-run
    // synchronises the GPU).
    let len = plan.source_bytes.max(1).next_power_of_two().max(1 << 20);
    let mut source = ctx
        .pool
        .take(len)
        .ok_or_else(|| Error::invalid("source buffer", format!("cannot allocate {len} bytes")))?;
    let (mut kept, mut planned) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
    let (mut bitstreams, mut shards, mut indices) = (Vec::new(), Vec::new(), Vec::new());
    let (mut cpu_work, t) = (0.0, std::time::Instant::now());
    for ((i, vals), p) in rows.into_iter().zip(plan.images.drain(..)) {
        let s = &job.samples[i];
        let bytes = image(&vals);
        let r = match (&p.geometry, p.path) {
            (None, _) => Err(match crate::image::decode_rgb(bytes, 8, None) {
                Err(e) => e.to_string(),
                Ok(_) => "its header does not read".to_owned(),
            }),
            (Some(g), Path::Cpu) => {
                cpu_work += p.work();
                let slot = &mut source.as_mut_slice()[p.src..p.src + p.source_len()];
                gpu_batch::decode_region(bytes, g, slot, scratch).map_err(|e| e.to_string())
            }
            (Some(_), _) => Ok(()),
        };
        match r {
            Ok(()) => {
                bitstreams.push(s.record.slice_ref(bytes));
                shards.push(job.urls[i].clone());
                indices.push(s.global_index);
                planned.push(p);
                kept.push((i, vals));
            }
            Err(reason) => bad_image(cfg, job, i, reason, skipped)?,
        }
    }
    if cpu_work > 0.0 {
        planner.observe_cpu_thread(cpu_work, t.elapsed().as_secs_f64());
    }
    // The GPU side counts the images its decoders take.
    let on_cpu = planned.iter().filter(|p| p.path == Path::Cpu).count();
    Metrics::add(&ctx.metrics.images_decoded, on_cpu as u64);
    plan.images = planned;
    Ok((
        kept,
        SourceBatch {
            plan,
            source,
            bitstreams,
            shards,
            samples: indices,
        },
    ))
}

/// Sample `i` of `job`, whose image did not decode: an error naming it, or with
/// [`OnCorrupt::Skip`] recorded in `skipped`.
fn bad_image(
    cfg: &LoaderConfig,
    job: &Job,
    i: usize,
    reason: impl std::fmt::Display,
    skipped: &mut Vec<Skipped>,
) -> Result<()> {
    let s = &job.samples[i];
    let reason = format!("image column {:?}: {reason}", cfg.image_column);
    if cfg.on_corrupt == OnCorrupt::Error {
        return Err(corrupt(&job.urls[i], s.global_index, reason));
    }
    skipped.push(Skipped {
        shard: job.urls[i].clone(),
        sample: s.global_index,
        reason,
    });
    Ok(())
}

/// Column `ci` (not the decoded image) of `rows`: YOLO boxes flattened with their offsets, or
/// the values as stored (bytes sliced from their records without a copy).
fn column_data(
    cfg: &LoaderConfig,
    job: &Job,
    rows: &Rows<'_>,
    ci: usize,
    col: &crate::format::Column,
) -> Result<ColumnData> {
    let is_boxes = cfg.boxes_column.as_deref() == Some(col.name.as_str()) && col.ty == ColumnType::Json;
    if is_boxes {
        let mut values = Vec::new();
        let mut offsets = vec![0i64];
        for (i, vals) in rows {
            let s = &job.samples[*i];
            let ValueRef::Json(text) = vals[ci] else {
                unreachable!("json column")
            };
            parse_boxes(text, &mut values)
                .map_err(|r| corrupt(&job.urls[*i], s.global_index, format!("column {:?}: {r}", col.name)))?;
            offsets.push((values.len() / 5) as i64);
        }
        return Ok(ColumnData::Boxes { values, offsets });
    }
    let it = rows.iter().map(|(i, v)| (*i, v[ci]));
    Ok(match col.ty {
        ColumnType::Int64 => ColumnData::Int64(it.map(|(_, v)| as_i64(v)).collect()),
        ColumnType::Float64 => ColumnData::Float64(it.map(|(_, v)| as_f64(v)).collect()),
        ColumnType::Str => ColumnData::Str(it.map(|(_, v)| as_text(v)).collect()),
        ColumnType::Json => ColumnData::Json(it.map(|(_, v)| as_text(v)).collect()),
        ColumnType::Array(_) => {
            let values: Vec<ArrayRef<'_>> = rows
                .iter()
                .map(|(_, v)| match v[ci] {
                    ValueRef::Array(a) => a,
                    _ => unreachable!("array column"),
                })
                .collect();
            if values.is_empty() {
                return Ok(ColumnData::Array(ArrayBatch::empty(col.ty)));
            }
            let what = format!("column {:?} of {}", col.name, job.urls[rows[0].0]);
            ColumnData::Array(ArrayBatch::gather(&values, &what).map_err(|r| Error::invalid(what, r))?)
        }
        ColumnType::Bytes => ColumnData::Bytes(
            it.map(|(i, v)| {
                let ValueRef::Bytes(b) = v else {
                    unreachable!("bytes column")
                };
                job.samples[i].record.slice_ref(b)
            })
            .collect(),
        ),
    })
}

fn as_i64(v: ValueRef<'_>) -> i64 {
    match v {
        ValueRef::Int64(x) => x,
        _ => unreachable!("schema says int64"),
    }
}

fn as_f64(v: ValueRef<'_>) -> f64 {
    match v {
        ValueRef::Float64(x) => x,
        _ => unreachable!("schema says float64"),
    }
}

fn as_text(v: ValueRef<'_>) -> String {
    match v {
        ValueRef::Str(s) | ValueRef::Json(s) => s.to_string(),
        _ => unreachable!("schema says text"),
    }
}

/// Appends `[[class, cx, cy, w, h], ...]` rows to `out`.
pub fn parse_boxes(text: &str, out: &mut Vec<f32>) -> std::result::Result<(), Invalid> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("boxes are not JSON: {e}"))?;
    let rows = v.as_array().ok_or("boxes are not a JSON array")?;
    for r in rows {
        let r = r
            .as_array()
            .filter(|r| r.len() == 5)
            .ok_or("a box is not [class, cx, cy, w, h]")?;
        for x in r {
            out.push(x.as_f64().ok_or("a box value is not a number")? as f32);
        }
    }
    Ok(())
}

#[cfg(test)]
mod array_batch_tests {
    use super::*;
    use crate::format::array::{Array, Dtype};

    fn arr(dtype: Dtype, shape: Vec<u64>) -> Array {
        let n = shape.iter().product::<u64>() as usize * dtype.size();
        Array::new(dtype, shape, (0..n).map(|x| x as u8).collect()).unwrap()
    }

    #[test]
    fn one_shape_is_one_tensor_and_ragged_values_keep_offsets_and_shapes() {
        let (a, b) = (arr(Dtype::I32, vec![2, 3]), arr(Dtype::I32, vec![2, 3]));
        let g = ArrayBatch::gather(&[a.as_array_ref(), b.as_array_ref()], "c").unwrap();
        assert_eq!(g.shape, Some(vec![2, 2, 3]));
        assert_eq!(&g.data[..24], &a.data[..]);
        assert_eq!(g.data.as_ptr() as usize % 64, 0);
        let c = arr(Dtype::I32, vec![1, 3]);
        let g = ArrayBatch::gather(&[a.as_array_ref(), c.as_array_ref()], "c").unwrap();
        assert_eq!((g.shape, g.offsets, g.shapes), (None, vec![0, 6, 9], vec![2, 3, 1, 3]));
        assert_eq!(&g.data[24..36], &c.data[..]);
    }

    #[test]
    fn a_batch_mixing_dtypes_or_ranks_is_refused_naming_the_column() {
        let (a, b) = (arr(Dtype::I32, vec![2]), arr(Dtype::F32, vec![2]));
        let e = ArrayBatch::gather(&[a.as_array_ref(), b.as_array_ref()], "column \"x\"").unwrap_err();
        assert!(
            e.to_string().contains("column \"x\"") && e.to_string().contains("float32"),
            "{e}"
        );
        let c = arr(Dtype::I32, vec![1, 2]);
        let e = ArrayBatch::gather(&[a.as_array_ref(), c.as_array_ref()], "column \"x\"").unwrap_err();
        assert!(e.to_string().contains("ranks"), "{e}");
    }
}
