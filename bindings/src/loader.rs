//! The loader behind `ramjet.StreamingDataset`: configuration arrives as JSON (built by the
//! Python side), batches leave as dicts of DLPack tensors. Every wait releases the GIL and
//! wakes every 50 ms to let Python deliver signals, so Ctrl-C interrupts a blocking call.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use serde::Deserialize;

use ramjet_engine::buf::{HostAlloc, HostPool};
use ramjet_engine::cache::CacheConfig;
use ramjet_engine::image::{OutType, Scratch};
use ramjet_engine::loader::{ArrayBatch, Assembler, Batch, ColumnData, Loader as EngineLoader, LoaderConfig, Next};
use ramjet_engine::stream::{StreamConfig, StreamState};
use ramjet_engine::{Error, Opened, SampleReader};

use crate::dlpack::{DType, Storage, Tensor};
use crate::{interruptible, to_py, wait_polling, InvalidInputError};

/// What `StreamingDataset` passes down: the engine's [`LoaderConfig`] (its options and their
/// defaults are defined there, once), plus the host daemon's socket.
#[derive(Deserialize)]
pub(crate) struct ConfigJson {
    #[serde(flatten)]
    pub(crate) loader: LoaderConfig,
    /// The host daemon's socket: whole shards come through it.
    #[serde(default)]
    daemon: Option<String>,
    /// Batches go to this GPU: their buffers are page-locked memory registered with its
    /// driver, so the copy to the device is asynchronous (the Python side makes it).
    #[serde(default)]
    pinned_gpu: Option<usize>,
    /// Images are decoded on this GPU (`decode=`): the loader makes batches for the GPU path.
    #[serde(default)]
    pub(crate) gpu_decode: Option<crate::gpu_decode::GpuDecodeConfig>,
}

/// Page-locked batch buffers (`cuMemHostAlloc`, `PORTABLE`) for the engine's [`HostPool`].
struct PinnedAlloc(Mutex<ramjet_cuda::pool::CudaHost>);

// SAFETY: `alloc` returns driver memory of `len` bytes owned by nobody else until `free`, and
// only when it is aligned to HOST_ALIGN (the driver's allocations are page-aligned; anything
// else is freed and refused).
unsafe impl HostAlloc for PinnedAlloc {
    fn alloc(&self, len: usize) -> Option<NonNull<u8>> {
        use ramjet_cuda::pool::Allocator;
        let mut a = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let addr = a.alloc(len.max(1)).ok()?;
        if addr as usize % ramjet_engine::buf::HOST_ALIGN != 0 {
            // SAFETY: just allocated with this length, never handed out.
            unsafe { a.free(addr, len.max(1)) };
            return None;
        }
        NonNull::new(addr as *mut u8)
    }

    unsafe fn free(&self, ptr: NonNull<u8>, len: usize) {
        use ramjet_cuda::pool::Allocator;
        let mut a = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the caller guarantees `ptr` came from `alloc(len)`, i.e. from this allocator
        // with `len.max(1)` bytes, and is no longer used.
        unsafe { a.free(ptr.as_ptr() as u64, len.max(1)) };
    }

    fn pinned(&self) -> bool {
        true
    }
}

/// The configuration, every option checked ([`LoaderConfig::check`]) before anything uses it.
pub(crate) fn parse(config: &str) -> PyResult<ConfigJson> {
    let cfg: ConfigJson =
        serde_json::from_str(config).map_err(|e| InvalidInputError::new_err(format!("loader configuration: {e}")))?;
    cfg.loader.check().map_err(to_py)?;
    Ok(cfg)
}

impl ConfigJson {
    pub(crate) fn stream(&self) -> StreamConfig {
        let mut sc = self.loader.stream.clone();
        sc.provider = self
            .daemon
            .as_ref()
            .map(|p| Arc::new(ramjet_transport::DaemonClient::new(p)) as Arc<dyn ramjet_engine::ShardProvider>);
        sc
    }

    pub(crate) fn loader(&self) -> Result<LoaderConfig, Error> {
        let mut cfg = LoaderConfig {
            stream: self.stream(),
            ..self.loader.clone()
        };
        if let Some(ordinal) = self.pinned_gpu {
            let ctx = ramjet_cuda::gpu::context(ordinal)
                .map_err(|e| Error::invalid(format!("device cuda:{ordinal}"), e.to_string()))?;
            let keep = cfg.prefetch_batches + cfg.threads + 4;
            let alloc = PinnedAlloc(Mutex::new(ramjet_cuda::pool::CudaHost::new(ctx)));
            cfg.pool = Some(HostPool::new(Box::new(alloc), keep));
        }
        Ok(cfg)
    }
}

/// The engine's loader defaults, as JSON (the Python package's test checks its own signature
/// against them).
#[pyfunction]
pub fn loader_defaults() -> PyResult<String> {
    let d = LoaderConfig::default();
    let v = serde_json::json!({
        "batch_size": d.batch_size,
        "drop_last": d.drop_last,
        "image_column": d.image_column,
        "boxes_column": d.boxes_column,
        // Unpinned (the default), the depth is the tuner's: `None`, as the signature says.
        "prefetch_batches": d.prefetch_pinned.then_some(d.prefetch_batches),
        "on_corrupt": d.on_corrupt,
        "image": ramjet_engine::image::ImageConfig::default(),
        "order": d.stream.order,
    });
    serde_json::to_string(&v).map_err(|e| InvalidInputError::new_err(e.to_string()))
}

/// This process's embedded daemon, kept for the life of the process.
static HOST_DAEMON: std::sync::Mutex<Option<ramjet_transport::HostDaemon>> = std::sync::Mutex::new(None);

/// Connects to the host daemon at `socket` (default: `RAMJET_SOCKET`, else a per-user path),
/// or starts one embedded in this process with its cache at `cache_dir`. Returns the socket
/// path and whether this process started the daemon.
#[pyfunction]
#[pyo3(signature = (cache_dir, cache_limit, socket=None))]
pub fn init(
    py: Python<'_>,
    cache_dir: String,
    cache_limit: &Bound<'_, PyAny>,
    socket: Option<String>,
) -> PyResult<(String, bool)> {
    let cache_limit = match crate::session::to_arg(cache_limit)? {
        ramjet_engine::loader::Arg::None => 64 << 30,
        arg => ramjet_engine::loader::options::size("cache_limit", &arg).map_err(to_py)?,
    };
    let mut held = HOST_DAEMON.lock().expect("not poisoned");
    let path = socket
        .map(std::path::PathBuf::from)
        .unwrap_or_else(ramjet_transport::default_socket);
    if let Some(h) = held.as_ref() {
        if h.client.socket() == path {
            return Ok((path.display().to_string(), h.embedded.is_some()));
        }
    }
    let cache = CacheConfig::new(&cache_dir, cache_limit);
    let p = path.clone();
    let h = interruptible(py, move || ramjet_transport::ensure_daemon(&p, cache))?.map_err(to_py)?;
    let embedded = h.embedded.is_some();
    *held = Some(h);
    Ok((path.display().to_string(), embedded))
}

/// A running batch pipeline (one consumer of the job).
#[pyclass(module = "ramjet._ramjet")]
pub struct Loader {
    inner: Arc<Mutex<EngineLoader>>,
}

impl Loader {
    /// A handle on a loader a [`crate::session::Session`] runs.
    pub(crate) fn shared(inner: Arc<Mutex<EngineLoader>>) -> Self {
        Self { inner }
    }
}

#[pymethods]
impl Loader {
    /// Opens the datasets and starts the reader and decode threads.
    #[new]
    fn new(py: Python<'_>, config: &str) -> PyResult<Self> {
        let cfg = parse(config)?.loader().map_err(to_py)?;
        let inner = interruptible(py, move || EngineLoader::start(cfg))?.map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(inner)),
        })
    }

    /// The next batch as `(columns, meta)`, or `None` after the last epoch.
    fn next_batch<'py>(&self, py: Python<'py>) -> PyResult<Option<(Bound<'py, PyDict>, Bound<'py, PyDict>)>> {
        let next = wait_polling(py, |slice| {
            let mut l = self.inner.lock().expect("not poisoned");
            match l.next_batch(slice).map_err(to_py)? {
                Next::Pending => Ok(None),
                other => Ok(Some(other)),
            }
        })?;
        match next {
            Next::Batch(b) => batch_to_py(py, *b).map(Some),
            _ => Ok(None),
        }
    }

    /// Counters of the stream and the decoders.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snap = self.inner.lock().expect("not poisoned").metrics().snapshot();
        snapshot_dict(py, &snap)
    }
}

pub(crate) fn snapshot_dict<'py>(py: Python<'py>, snap: &impl serde::Serialize) -> PyResult<Bound<'py, PyDict>> {
    let v = serde_json::to_value(snap).map_err(|e| InvalidInputError::new_err(e.to_string()))?;
    let d = PyDict::new(py);
    if let serde_json::Value::Object(m) = v {
        for (k, v) in m {
            if let Some(f) = v.as_f64() {
                d.set_item(k, f)?;
            } else if let Some(t) = v.as_str() {
                // The tuner's reasons (`tune_*_reason`).
                d.set_item(k, t)?;
            } else if let Some(b) = v.as_bool() {
                d.set_item(k, b)?;
            } else if v.is_array() {
                // The job's ranks (`job_ranks`): a list of dicts, as JSON gives them.
                d.set_item(k, py.import("json")?.call_method1("loads", (v.to_string(),))?)?;
            }
        }
    }
    Ok(d)
}

fn tensor(py: Python<'_>, storage: Storage, shape: Vec<i64>, dtype: DType) -> PyResult<Py<Tensor>> {
    Py::new(py, Tensor::new(storage, shape, dtype))
}

/// Decoded images in a pooled buffer, as a tensor of `shape` (zero-copy).
fn image_tensor(
    py: Python<'_>,
    buf: ramjet_engine::buf::HostBuf,
    shape: Vec<i64>,
    out: OutType,
) -> PyResult<Py<Tensor>> {
    let dt = if out == OutType::U8 { DType::U8 } else { DType::F32 };
    tensor(py, Storage::Host(buf), shape, dt)
}

/// An array column's batch into `d`: `name` is one `(n, *shape)` tensor when every value has
/// the same shape; ragged, `name` is the elements back to back, `{name}_offsets` (`n + 1`
/// element offsets) and `{name}_shapes` (`(n, rank)`).
fn set_array(py: Python<'_>, d: &Bound<'_, PyDict>, name: &str, a: ArrayBatch) -> PyResult<()> {
    let dt = DType::Array(a.dtype);
    match a.shape {
        Some(shape) => {
            let shape = shape.iter().map(|&x| x as i64).collect();
            d.set_item(name, tensor(py, Storage::Bytes(a.data), shape, dt)?)?;
        }
        None => {
            let elems = (a.data.len() / a.dtype.size()) as i64;
            let n = a.offsets.len().saturating_sub(1) as i64;
            d.set_item(name, tensor(py, Storage::Bytes(a.data), vec![elems], dt)?)?;
            let k = a.offsets.len() as i64;
            d.set_item(
                format!("{name}_offsets"),
                tensor(py, Storage::I64(a.offsets), vec![k], DType::I64)?,
            )?;
            d.set_item(
                format!("{name}_shapes"),
                tensor(py, Storage::I64(a.shapes), vec![n, a.rank as i64], DType::I64)?,
            )?;
        }
    }
    Ok(())
}

pub(crate) fn batch_to_py(py: Python<'_>, b: Batch) -> PyResult<(Bound<'_, PyDict>, Bound<'_, PyDict>)> {
    let d = PyDict::new(py);
    let n = b.len() as i64;
    for (name, col) in b.columns {
        match col {
            ColumnData::Image {
                buf,
                n,
                height,
                width,
                out,
            } => {
                let shape = vec![n as i64, 3, height as i64, width as i64];
                d.set_item(&name, image_tensor(py, buf, shape, out)?)?;
            }
            ColumnData::Int64(v) => d.set_item(&name, tensor(py, Storage::I64(v), vec![n], DType::I64)?)?,
            ColumnData::Float64(v) => d.set_item(&name, tensor(py, Storage::F64(v), vec![n], DType::F64)?)?,
            ColumnData::Str(v) | ColumnData::Json(v) => d.set_item(&name, PyList::new(py, v)?)?,
            ColumnData::Bytes(v) => {
                let l = PyList::empty(py);
                for x in v {
                    l.append(PyBytes::new(py, &x))?;
                }
                d.set_item(&name, l)?;
            }
            ColumnData::ImageSource(_) => {
                return Err(InvalidInputError::new_err(
                    "a batch made for the GPU decode reached the host conversion (the GPU side finishes it first)",
                ))
            }
            ColumnData::Array(a) => set_array(py, &d, &name, a)?,
            ColumnData::Valid(v) => {
                let bytes: Vec<u8> = v.into_iter().map(u8::from).collect();
                d.set_item(&name, tensor(py, Storage::U8(bytes), vec![n], DType::Bool)?)?
            }
            ColumnData::Boxes { values, offsets } => {
                let rows = (values.len() / 5) as i64;
                d.set_item(&name, tensor(py, Storage::F32(values), vec![rows, 5], DType::F32)?)?;
                let k = offsets.len() as i64;
                d.set_item(
                    format!("{name}_offsets"),
                    tensor(py, Storage::I64(offsets), vec![k], DType::I64)?,
                )?;
            }
        }
    }
    d.set_item("_index", tensor(py, Storage::I64(b.indices), vec![n], DType::I64)?)?;
    d.set_item("_source", tensor(py, Storage::I64(b.sources), vec![n], DType::I64)?)?;
    let meta = PyDict::new(py);
    meta.set_item("epoch", b.epoch)?;
    meta.set_item("end_of_epoch", b.end_of_epoch)?;
    if let Some(state) = &b.state {
        // A raw loader's batch (a session keeps the state itself: no text per batch).
        let state = serde_json::to_string(state).map_err(|e| InvalidInputError::new_err(e.to_string()))?;
        meta.set_item("state", state)?;
    }
    let skipped: Vec<(String, u64, String)> = b.skipped.into_iter().map(|s| (s.shard, s.sample, s.reason)).collect();
    meta.set_item("skipped", skipped)?;
    Ok((d, meta))
}

/// Consumers' states from their JSON text.
pub(crate) fn parse_states(states: &[String]) -> PyResult<Vec<StreamState>> {
    states
        .iter()
        .map(|s| serde_json::from_str(s))
        .collect::<Result<_, _>>()
        .map_err(|e| InvalidInputError::new_err(format!("stream state: {e}")))
}

/// The job's resume point (JSON) from every consumer's state (JSON), all taken after the
/// same step.
#[pyfunction]
pub fn job_progress(states: Vec<String>) -> PyResult<String> {
    let r = StreamState::job_progress(&parse_states(&states)?).map_err(to_py)?;
    serde_json::to_string(&r).map_err(|e| InvalidInputError::new_err(e.to_string()))
}

/// The exactly-once audit (`ramjet_engine::stream::audit`) of the job position given by
/// `states` (every consumer's state, taken at the same step) or `resume` (a job state's
/// `resume` JSON), as the report's JSON.
#[pyfunction]
#[pyo3(signature = (config, states=None, resume=None))]
pub fn audit(py: Python<'_>, config: &str, states: Option<Vec<String>>, resume: Option<String>) -> PyResult<String> {
    let sc = parse(config)?.stream();
    let bad = |e: serde_json::Error| InvalidInputError::new_err(format!("audited state: {e}"));
    let (point, len) = match (states, resume) {
        (Some(states), None) => {
            let parsed: Vec<StreamState> = states
                .iter()
                .map(|s| serde_json::from_str(s))
                .collect::<Result<_, _>>()
                .map_err(bad)?;
            let (p, len) = StreamState::combine(&parsed).map_err(to_py)?;
            (p, Some(len))
        }
        (None, Some(r)) => (serde_json::from_str(&r).map_err(bad)?, None),
        _ => return Err(InvalidInputError::new_err("audit takes either states or resume")),
    };
    let report = interruptible(py, move || {
        ramjet_engine::rt::block_on(ramjet_engine::stream::audit(&sc, &point, len)).and_then(|r| r)
    })?
    .map_err(to_py)?;
    serde_json::to_string(&report).map_err(|e| InvalidInputError::new_err(e.to_string()))
}

/// `(epoch_len, mine, least)`: samples in an epoch's order, this consumer's share, and the
/// least share of any consumer of the job.
#[pyfunction]
pub fn epoch_lengths(py: Python<'_>, config: &str) -> PyResult<(u64, u64, u64)> {
    let sc = parse(config)?.stream();
    interruptible(py, move || {
        ramjet_engine::rt::block_on(ramjet_engine::stream::epoch_lengths(&sc)).and_then(|r| r)
    })?
    .map_err(to_py)
}

/// Batches every consumer yields per epoch under `buckets` aspect-ratio buckets of
/// `batch_size`, when the job's least share is `least` samples.
#[pyfunction]
pub fn bucket_batches(least: u64, buckets: usize, batch_size: usize) -> u64 {
    ramjet_engine::loader::buckets::epoch_batches(least, buckets, batch_size)
}

/// Random access to samples by index, decoded with the evaluation transform.
#[pyclass(module = "ramjet._ramjet")]
pub struct Reader {
    state: Arc<Mutex<(SampleReader, Scratch)>>,
    /// The loader's batch assembly, for one sample at a time (one per source: each has its
    /// own schema).
    assemblers: Arc<Vec<Assembler>>,
}

#[pymethods]
impl Reader {
    /// Opens the datasets (nothing is prefetched).
    ///
    /// A reader has no epoch to draw random crops from, so the training transform is read as
    /// the evaluation one. `resident_bytes` bounds the whole shards held in memory.
    #[new]
    #[pyo3(signature = (config, resident_bytes=None))]
    fn new(py: Python<'_>, config: &str, resident_bytes: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mut v: serde_json::Value = serde_json::from_str(config)
            .map_err(|e| InvalidInputError::new_err(format!("reader configuration: {e}")))?;
        if let Some(img) = v.get_mut("image").filter(|i| i.is_object()) {
            if img.get("augment").and_then(|a| a.as_str()).unwrap_or("train") == "train" {
                img["augment"] = "eval".into();
            }
        }
        if let Some(n) = Self::check_resident_bytes(resident_bytes)? {
            v["resident_bytes_max"] = n.into();
        }
        let cfg = parse(&v.to_string())?;
        let sc = cfg.stream();
        let reader = interruptible(py, move || SampleReader::open(sc))?.map_err(to_py)?;
        // The loader's assembly with the evaluation settings given, the boxes column left as
        // its JSON text (one sample has no batch offsets), and a corrupt image an error.
        let mut lc = cfg.loader.clone();
        lc.boxes_column = None;
        lc.on_corrupt = ramjet_engine::loader::OnCorrupt::Error;
        let assemblers = (0..reader.sources())
            .map(|i| Assembler::new(lc.clone(), reader.schema(i), reader.metrics_handle(), 4))
            .collect();
        Ok(Self {
            state: Arc::new(Mutex::new((reader, Scratch::default()))),
            assemblers: Arc::new(assemblers),
        })
    }

    /// `resident_bytes` checked by the engine: `None`, or a byte count of at least 0.
    #[staticmethod]
    #[pyo3(signature = (resident_bytes=None))]
    fn check_resident_bytes(resident_bytes: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
        let Some(r) = resident_bytes else { return Ok(None) };
        let arg = crate::session::to_arg(r)?;
        if arg == ramjet_engine::loader::Arg::None {
            return Ok(None);
        }
        let n = ramjet_engine::loader::options::int("resident_bytes", &arg, 0, u64::MAX as i128).map_err(to_py)?;
        Ok(Some(n as u64))
    }

    /// Column `column` of sample `index` of source `source`, as bytes (a `bytes` column, e.g.
    /// the encoded image, undecoded): the read a map-style dataset makes per sample. A sample
    /// held in memory or in the disk cache is read in place with the GIL released; one that
    /// needs the network is read interruptibly.
    fn get_bytes<'py>(
        &self,
        py: Python<'py>,
        source: usize,
        index: u64,
        column: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        // Local first, inline (no thread): a resident or cached sample is a memory read.
        let local = {
            let state = self.state.clone();
            py.detach(move || state.lock().expect("not poisoned").0.get_local(source, index))
        };
        let sample = match local.map_err(to_py)? {
            Some(s) => s,
            None => {
                let state = self.state.clone();
                interruptible(py, move || state.lock().expect("not poisoned").0.get(source, index))?.map_err(to_py)?
            }
        };
        let schema = self.state.lock().expect("not poisoned").0.schema(source);
        let k = schema.index_of(column).ok_or_else(|| {
            to_py(Error::invalid(
                format!("column {column:?}"),
                format!("the dataset's columns are {}", schema.describe()),
            ))
        })?;
        match sample.values().map_err(to_py)?.get(k) {
            Some(ramjet_engine::format::ValueRef::Bytes(b)) => Ok(PyBytes::new(py, b)),
            _ => Err(to_py(Error::invalid(
                format!("column {column:?}"),
                "not a bytes column",
            ))),
        }
    }

    /// Counters of the random-access reads (ranged samples, resident samples, origin bytes).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snap = self.state.lock().expect("not poisoned").0.metrics();
        snapshot_dict(py, &snap)
    }

    /// Sample `index` of source `source` as a dict (image as a `(3, H, W)` tensor).
    fn get<'py>(&self, py: Python<'py>, source: usize, index: u64) -> PyResult<Bound<'py, PyDict>> {
        let (state, assemblers) = (self.state.clone(), self.assemblers.clone());
        let batch = interruptible(py, move || {
            let mut g = state.lock().expect("not poisoned");
            let (st, scratch) = &mut *g;
            let s = st.get(source, index)?;
            let url = st.shard_url(s.id.source, s.id.shard);
            match assemblers.get(source) {
                Some(a) => a.one(0, s, url, scratch),
                None => Err(Error::invalid(format!("source {source}"), "no such source")),
            }
        })?
        .map_err(to_py)?;
        one_sample_dict(py, batch, source, index)
    }

    /// Samples `indices` of source `source`, in the order asked, as dicts: each shard touched
    /// is read once (from memory, the disk cache, or one whole-shard fetch), the fetches all at
    /// once.
    fn get_many<'py>(&self, py: Python<'py>, source: usize, indices: Vec<u64>) -> PyResult<Bound<'py, PyList>> {
        let (state, assemblers) = (self.state.clone(), self.assemblers.clone());
        let asked = indices.clone();
        let batches = interruptible(py, move || {
            let mut g = state.lock().expect("not poisoned");
            let (st, scratch) = &mut *g;
            let samples = st.get_many(source, &asked)?;
            let a = assemblers
                .get(source)
                .ok_or_else(|| Error::invalid(format!("source {source}"), "no such source"))?;
            samples
                .into_iter()
                .map(|s| {
                    let url = st.shard_url(s.id.source, s.id.shard);
                    a.one(0, s, url, scratch)
                })
                .collect::<ramjet_engine::Result<Vec<Batch>>>()
        })?
        .map_err(to_py)?;
        let out = PyList::empty(py);
        for (b, &i) in batches.into_iter().zip(&indices) {
            out.append(one_sample_dict(py, b, source, i)?)?;
        }
        Ok(out)
    }
}

/// A one-sample batch as the sample's dict: an image as a `(3, H, W)` tensor, an array as a
/// tensor of its own shape, scalars and text as Python values.
fn one_sample_dict<'py>(py: Python<'py>, batch: Batch, source: usize, index: u64) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, col) in batch.columns {
        match col {
            ColumnData::Image {
                buf,
                height,
                width,
                out,
                ..
            } => {
                d.set_item(&name, image_tensor(py, buf, vec![3, height as i64, width as i64], out)?)?;
            }
            ColumnData::Int64(v) => d.set_item(&name, v[0])?,
            ColumnData::Float64(v) => d.set_item(&name, v[0])?,
            ColumnData::Str(mut v) | ColumnData::Json(mut v) => d.set_item(&name, v.swap_remove(0))?,
            ColumnData::Bytes(v) => d.set_item(&name, PyBytes::new(py, &v[0]))?,
            ColumnData::Array(a) => {
                // One value: its own shape (the batch's leading axis of 1 dropped).
                let shape: Vec<i64> = match &a.shape {
                    Some(s) => s[1..].iter().map(|&x| x as i64).collect(),
                    None => a.shapes.clone(),
                };
                d.set_item(&name, tensor(py, Storage::Bytes(a.data), shape, DType::Array(a.dtype))?)?;
            }
            ColumnData::Valid(v) => {
                // One sample: a null is None, beside its mask.
                if !v[0] {
                    let of = name.strip_suffix("_valid").expect("a mask is named <column>_valid");
                    d.set_item(of, py.None())?;
                }
                d.set_item(&name, v[0])?
            }
            ColumnData::Boxes { .. } => unreachable!("the reader's assembler parses no boxes"),
            ColumnData::ImageSource(_) => unreachable!("the reader's assembler makes no GPU batches"),
        }
    }
    d.set_item("_index", index)?;
    d.set_item("_source", source)?;
    Ok(d)
}
