//! PyO3 glue for the `ramjet` Python package. No logic lives here that a Rust user would also
//! need: every function converts arguments, releases the GIL, calls the engine, and converts
//! the result or maps the error onto the `ramjet.Error` tree.
#![deny(missing_docs)]

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use ramjet_engine::{Dataset, Error};

mod augment;
mod dlpack;
mod gpu_decode;
mod image;
mod loader;
mod session;
mod tokens;

// mimalloc keeps freed memory mapped for reuse: with the system allocator each decoded image's
// buffers were fresh pages, faulted in again image after image (docs/dependencies.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

create_exception!(
    ramjet,
    RamjetError,
    PyException,
    "Base class of every error ramjet raises."
);
create_exception!(
    ramjet,
    NotFoundError,
    RamjetError,
    "An object (manifest, shard) does not exist."
);
create_exception!(
    ramjet,
    CorruptError,
    RamjetError,
    "Bytes failed a checksum or structure check, or were truncated."
);
create_exception!(
    ramjet,
    OriginError,
    RamjetError,
    "The object store failed after every retry."
);
create_exception!(ramjet, AuthError, RamjetError, "Credentials were refused.");
create_exception!(
    ramjet,
    LocalError,
    RamjetError,
    "A local file or socket (the node cache, a local dataset, the host daemon) failed."
);
create_exception!(
    ramjet,
    InvalidInputError,
    RamjetError,
    "An argument, URL, manifest or input file is not acceptable."
);

/// Maps an engine error onto the Python exception tree, keeping its full message.
fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::NotFound { .. } => NotFoundError::new_err(msg),
        Error::Corrupt { .. } | Error::Truncated { .. } | Error::SchemaMismatch { .. } => CorruptError::new_err(msg),
        Error::Origin { .. } => OriginError::new_err(msg),
        Error::Io { .. } => LocalError::new_err(msg),
        Error::Auth { .. } => AuthError::new_err(msg),
        Error::Internal { .. } => RamjetError::new_err(msg),
        _ => InvalidInputError::new_err(msg),
    }
}

/// How often a waiting call lets Python raise pending signals.
const SIGNAL_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// The one way the bindings wait for the engine: `poll(slice)` runs with the GIL released and
/// waits at most `slice` (50 ms), returning `Some` when done; between slices Python raises any
/// pending signal, so Ctrl-C becomes `KeyboardInterrupt` at once. Every blocking call goes
/// through it, directly (the loader's `next_batch`) or through [`interruptible`].
pub(crate) fn wait_polling<T>(
    py: Python<'_>,
    mut poll: impl FnMut(std::time::Duration) -> PyResult<Option<T>> + Send,
) -> PyResult<T>
where
    T: Send,
{
    loop {
        if let Some(v) = py.detach(|| poll(SIGNAL_POLL))? {
            return Ok(v);
        }
        py.check_signals()?;
    }
}

/// A call that cannot poll (opening a dataset, a blocking read): `f` runs on a short-lived
/// `ramjet-call` thread and this thread waits through [`wait_polling`]. An interrupted `f`
/// finishes in the background and its result is dropped.
pub(crate) fn interruptible<T: Send + 'static>(py: Python<'_>, f: impl FnOnce() -> T + Send + 'static) -> PyResult<T> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("ramjet-call".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| to_py(Error::io("thread", e)))?;
    wait_polling(py, |slice| match rx.recv_timeout(slice) {
        Ok(v) => Ok(Some(v)),
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(None),
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(RamjetError::new_err(
            "ramjet call: its thread ended without a result (it panicked)",
        )),
    })
}

/// Runs async engine work to completion through [`interruptible`].
fn block_on<T: Send + 'static, F: std::future::Future<Output = T> + 'static>(
    py: Python<'_>,
    make: impl FnOnce() -> F + Send + 'static,
) -> PyResult<T> {
    interruptible(py, move || {
        let f = make();
        ramjet_engine::rt::block_on(f).map_err(to_py)
    })?
}

/// Reads a dataset's manifest and returns its summary as a dict.
#[pyfunction]
fn inspect<'py>(py: Python<'py>, url: &str) -> PyResult<Bound<'py, PyDict>> {
    let u = url.to_owned();
    let ds = block_on(py, move || async move { Dataset::open(&u).await })?.map_err(to_py)?;
    let m = ds.manifest();
    let d = PyDict::new(py);
    d.set_item("url", ds.manifest_url())?;
    d.set_item("version", &m.version)?;
    d.set_item("source", &m.packed_from)?;
    let cols: Vec<(String, String)> = m
        .schema
        .columns
        .iter()
        .map(|c| (c.name.clone(), c.type_name()))
        .collect();
    d.set_item("schema", cols)?;
    d.set_item("shards", m.shard_count())?;
    d.set_item("samples", m.samples)?;
    d.set_item("bytes", m.bytes)?;
    let meta = serde_json::to_string(&m.meta).map_err(|e| InvalidInputError::new_err(e.to_string()))?;
    d.set_item("meta_json", meta)?;
    d.set_item("columns_sidecars", m.has_columns())?;
    d.set_item("jpeg_restart_px", m.jpeg_restart_px())?;
    Ok(d)
}

/// Re-reads every shard and checks every checksum. Returns a dict with `ok` and `problems`.
#[pyfunction]
#[pyo3(signature = (url, parallel = 4))]
fn verify<'py>(py: Python<'py>, url: &str, parallel: usize) -> PyResult<Bound<'py, PyDict>> {
    let u = url.to_owned();
    let report = block_on(py, move || async move {
        let ds = Dataset::open(&u).await?;
        Ok::<_, Error>(ds.verify(parallel, no_progress).await)
    })?
    .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("ok", report.is_ok())?;
    d.set_item("shards", report.shards)?;
    d.set_item("samples", report.samples)?;
    d.set_item("bytes_read", report.bytes_read)?;
    let probs: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
    d.set_item("problems", probs)?;
    Ok(d)
}

fn no_progress(_bytes: u64) {}

/// This process's place in its job, `(rank, world, local_rank, local_world)`, from the
/// arguments `rank` / `world_size`, torch.distributed's `(rank, world)` when initialised
/// (`dist`), and the launcher's environment, each checked alike: a bad value or a contradiction
/// is an `InvalidInputError` naming both sources (`ramjet_engine::launch`).
#[pyfunction]
#[pyo3(signature = (rank = None, world_size = None, dist = None))]
fn launch(
    rank: Option<i64>,
    world_size: Option<i64>,
    dist: Option<(i64, i64)>,
) -> PyResult<(usize, usize, usize, usize)> {
    let count = |v: i64, what: &str| {
        usize::try_from(v).map_err(|_| InvalidInputError::new_err(format!("{what}: must be at least 0, not {v}")))
    };
    let given = ramjet_engine::launch::Given {
        rank: rank.map(|r| count(r, "rank")).transpose()?,
        world: world_size.map(|w| count(w, "world_size")).transpose()?,
        dist: dist
            .map(|(r, w)| {
                Ok::<_, PyErr>((
                    count(r, "torch.distributed rank")?,
                    count(w, "torch.distributed world size")?,
                ))
            })
            .transpose()?,
    };
    let l = ramjet_engine::launch::resolve_env(&given).map_err(to_py)?;
    Ok((l.rank, l.world, l.local_rank, l.local_world))
}

/// Why a job of several nodes deals position by position, every node reading the whole
/// dataset (`ramjet_engine::order::DealRule::why_strided`), or `None`: from the JSON of its
/// order and its topology, as the loader's configuration holds them.
#[pyfunction]
fn why_strided(order: &str, topology: &str) -> PyResult<Option<String>> {
    let bad = |e: serde_json::Error| InvalidInputError::new_err(format!("order or topology: {e}"));
    let order: ramjet_engine::order::OrderSpec = serde_json::from_str(order).map_err(bad)?;
    let topo: ramjet_engine::order::Topology = serde_json::from_str(topology).map_err(bad)?;
    Ok(ramjet_engine::order::DealRule::why_strided(&order, &topo))
}

/// The global order of one epoch over one source whose shards hold `shard_samples` samples,
/// under the order `order` (its JSON, as the loader's configuration holds it): each position's
/// sample as its index in the source (shard by shard). For studying the order (the shuffle
/// quality benchmark); a loader never builds the order as a list.
#[pyfunction]
fn global_order(shard_samples: Vec<u64>, order: &str, epoch: u64) -> PyResult<Vec<u64>> {
    use ramjet_engine::order::{SourceShape, Weight};
    let spec: ramjet_engine::order::OrderSpec =
        serde_json::from_str(order).map_err(|e| InvalidInputError::new_err(format!("order: {e}")))?;
    let mut starts = vec![0u64];
    for n in &shard_samples {
        starts.push(starts.last().copied().unwrap_or(0).saturating_add(*n));
    }
    let shapes = vec![SourceShape::listed("study", shard_samples, Weight::Natural)];
    let g = ramjet_engine::order::global_order(&shapes, &spec, epoch).map_err(to_py)?;
    Ok(g.iter()
        .map(|r| starts[r.shard as usize] + u64::from(r.index))
        .collect())
}

/// What this process can use of the GPU path: whether the CUDA driver loads, how many GPUs it
/// sees (or why none), and where each CUDA user library was found (or why not), searching
/// `python_roots` (site-packages folders) for the wheels' copies.
#[pyfunction]
#[pyo3(signature = (python_roots = Vec::new()))]
fn gpu_info<'py>(py: Python<'py>, python_roots: Vec<std::path::PathBuf>) -> PyResult<Bound<'py, PyDict>> {
    use ramjet_cuda::libs::{Lib, Origin, Search};
    let d = PyDict::new(py);
    d.set_item("driver", ramjet_cuda::driver_present())?;
    match ramjet_cuda::device_count() {
        Ok(n) => {
            d.set_item("devices", n)?;
            d.set_item("error", py.None())?;
        }
        Err(e) => {
            d.set_item("devices", 0)?;
            d.set_item("error", e.to_string())?;
        }
    }
    let search = Search::from_env(&python_roots);
    let libs = PyDict::new(py);
    for lib in Lib::ALL {
        let one = PyDict::new(py);
        match search.find(lib) {
            Ok(f) => {
                one.set_item("path", f.path.display().to_string())?;
                let origin = match f.origin {
                    Origin::Env => "env",
                    Origin::Python => "python",
                    Origin::System => "system",
                };
                one.set_item("origin", origin)?;
                if lib == Lib::Nvjpeg {
                    // Loading needs no GPU: the table's symbols and the library's version.
                    match ramjet_cuda::nvjpeg::Table::open(&f.path).and_then(|t| ramjet_cuda::nvjpeg::version(&t)) {
                        Ok((a, b, c)) => one.set_item("version", format!("{a}.{b}.{c}"))?,
                        Err(e) => one.set_item("load_error", e.to_string())?,
                    }
                }
            }
            Err(e) => one.set_item("error", e.to_string())?,
        }
        libs.set_item(lib.name(), one)?;
    }
    d.set_item("libraries", libs)?;
    Ok(d)
}

/// Columns `names` of every sample of the dataset at `url`, as a dict of lists in sample
/// order. They come from the shards' columns sidecars (labels without the images) when the
/// dataset has them, else from the whole shards. `bytes` columns are refused.
#[pyfunction]
#[pyo3(signature = (url, names, parallel = 8))]
fn columns<'py>(py: Python<'py>, url: &str, names: Vec<String>, parallel: usize) -> PyResult<Bound<'py, PyDict>> {
    use ramjet_engine::format::Value;
    let (u, n) = (url.to_owned(), names.clone());
    let cols = block_on(py, move || async move {
        let ds = Dataset::open(&u).await?;
        ds.columns(&n, parallel).await
    })?
    .map_err(to_py)?;
    let d = PyDict::new(py);
    for (name, col) in names.iter().zip(cols) {
        let l = pyo3::types::PyList::empty(py);
        for v in col {
            match v {
                Value::Int64(x) => l.append(x)?,
                Value::Float64(x) => l.append(x)?,
                Value::Str(t) | Value::Json(t) => l.append(t)?,
                Value::Bytes(b) => l.append(pyo3::types::PyBytes::new(py, &b))?,
                Value::Array(a) => {
                    let shape = a.shape.iter().map(|&x| x as i64).collect();
                    let data = aligned_bytes(&a.data);
                    let t = dlpack::Tensor::new(dlpack::Storage::Bytes(data), shape, dlpack::DType::Array(a.dtype));
                    l.append(Py::new(py, t)?)?
                }
            }
        }
        d.set_item(name, l)?;
    }
    Ok(d)
}

/// Holds the cluster ring of the daemon at `socket` at its current version, so a training
/// run sees one ring from start to end, and returns the lease. The lease is its own
/// connection to the daemon: `release()` (or leaving its `with` block) releases it, and so
/// does the connection closing when the holder exits or is killed.
#[pyfunction]
fn freeze(py: Python<'_>, socket: &str) -> PyResult<RingFreeze> {
    let c = ramjet_transport::DaemonClient::new(socket);
    let lease = interruptible(py, move || c.freeze())?.map_err(to_py)?;
    Ok(RingFreeze {
        lease: std::sync::Mutex::new(lease),
    })
}

/// A freeze of the ring, held until released or until its process ends.
#[pyclass(module = "ramjet._ramjet")]
struct RingFreeze {
    lease: std::sync::Mutex<ramjet_transport::FreezeLease>,
}

#[pymethods]
impl RingFreeze {
    /// Releases the freeze now (a second call does nothing).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let mut l = std::mem::replace(
            &mut *self.lease.lock().expect("lease lock"),
            ramjet_transport::FreezeLease::released(),
        );
        interruptible(py, move || l.release())?.map_err(to_py)
    }

    /// Whether the freeze is still held by this handle.
    #[getter]
    fn held(&self) -> bool {
        self.lease.lock().expect("lease lock").held()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }
}

/// Engine log lines go to stderr: warnings by default (a cached shard that failed its
/// checksum and was re-fetched, a cache write that failed), more with `RAMJET_LOG` (its
/// `tracing` filter syntax, e.g. `RAMJET_LOG=ramjet_engine::store=trace` for each origin
/// request's latency). Set once per process, when the module is imported.
fn init_log() {
    let filter = tracing_subscriber::EnvFilter::builder()
        .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
        .with_env_var("RAMJET_LOG")
        .from_env_lossy();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_timer(tracing_subscriber::fmt::time::uptime())
        .try_init();
}

/// The native module behind `ramjet`. It declares that it runs without the GIL on a
/// free-threaded CPython (`gil_used = false`): every class keeps its state behind a `Mutex`
/// or in atomics (PyO3 requires its classes to be `Sync`), and the engine's threads never
/// touch Python objects (docs/python.md, "Free-threaded Python").
#[pymodule(gil_used = false)]
fn _ramjet(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    init_log();
    // One-time process setup happens here, at import, before the trainer can fork DataLoader
    // workers: a `Once` a worker inherits half-done (run by a thread of the parent at the
    // moment of the fork) would block that worker's first S3 client for good.
    ramjet_engine::store::ensure_crypto_provider();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("Error", py.get_type::<RamjetError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("CorruptError", py.get_type::<CorruptError>())?;
    m.add("OriginError", py.get_type::<OriginError>())?;
    m.add("AuthError", py.get_type::<AuthError>())?;
    m.add("LocalError", py.get_type::<LocalError>())?;
    m.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    m.add_function(wrap_pyfunction!(launch, m)?)?;
    m.add_function(wrap_pyfunction!(why_strided, m)?)?;
    m.add_function(wrap_pyfunction!(global_order, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_info, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(columns, m)?)?;
    m.add_function(wrap_pyfunction!(freeze, m)?)?;
    m.add_function(wrap_pyfunction!(image::decode_image, m)?)?;
    m.add_class::<RingFreeze>()?;
    m.add_class::<augment::FusedAugment>()?;
    m.add_function(wrap_pyfunction!(augment::fused_reference, m)?)?;
    m.add_class::<dlpack::Tensor>()?;
    m.add_class::<loader::Loader>()?;
    m.add_class::<loader::Reader>()?;
    m.add_function(wrap_pyfunction!(loader::job_progress, m)?)?;
    m.add_function(wrap_pyfunction!(loader::audit, m)?)?;
    m.add_function(wrap_pyfunction!(loader::epoch_lengths, m)?)?;
    m.add_function(wrap_pyfunction!(loader::bucket_batches, m)?)?;
    m.add_function(wrap_pyfunction!(loader::init, m)?)?;
    m.add_function(wrap_pyfunction!(loader::loader_defaults, m)?)?;
    m.add_class::<session::Session>()?;
    m.add_class::<tokens::TokenStream>()?;
    m.add_function(wrap_pyfunction!(tokens::token_job_state, m)?)?;
    m.add_function(wrap_pyfunction!(tokens::token_resume_check, m)?)?;
    m.add_function(wrap_pyfunction!(tokens::token_options_check, m)?)?;
    m.add_function(wrap_pyfunction!(session::loader_options, m)?)?;
    m.add_function(wrap_pyfunction!(session::loader_option_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(session::job_state, m)?)?;
    Ok(())
}

/// `data` copied into a buffer aligned for any element type (a tensor's storage).
fn aligned_bytes(data: &[u8]) -> bytes::Bytes {
    let mut b = ramjet_engine::buf::AlignedBuf::zeroed(data.len());
    b.as_mut().copy_from_slice(data);
    b.into_bytes()
}
