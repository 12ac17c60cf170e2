//! What `ramjet.StreamingDataset` keeps across iterations: the engine's [`Epochs`] (which epoch
//! the next iteration reads, where it starts, the state to save) and the loader running for it.
//! The Python side finds the topology and converts batches; every decision is the engine's.
//!
//! Fork safety: a DataLoader worker is forked from the trainer with this object inside. The
//! child must read the position but may never touch the loader (its threads do not exist
//! there, and its lock may have been held by a thread of the parent). So the position, the
//! running loader's handle and a deferred batch sit behind locks taken only while the GIL is
//! held, never across a wait; the loader's own lock, the one held while waiting for a batch
//! with the GIL released, is never taken by [`Session::forked`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use ramjet_engine::loader::{Arg, Batch, Epochs, Loader as EngineLoader, Next, Options, Step};

use crate::gpu_decode::GpuSide;
use crate::loader::{batch_to_py, parse, snapshot_dict, Loader};
use crate::{interruptible, to_py, wait_polling, InvalidInputError};

/// A Python value as an engine [`Arg`], without judging it (the engine checks it and names the
/// option): `None`, `bool`, `str`, a dict, an int, a float, anything with a working
/// `__index__` (numpy integers) or `__float__` (numpy floats, one-element tensors), and any
/// other iterable (a list, a tuple, a numpy array, a tensor) as a list.
pub(crate) fn to_arg(v: &Bound<'_, PyAny>) -> PyResult<Arg> {
    if v.is_none() {
        return Ok(Arg::None);
    }
    if v.is_instance_of::<PyBool>() {
        return Ok(Arg::Bool(v.extract()?));
    }
    if v.is_instance_of::<PyString>() {
        return Ok(Arg::Str(v.extract()?));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        let mut m = BTreeMap::new();
        for (k, x) in d.iter() {
            m.insert(k.str()?.to_string(), to_arg(&x)?);
        }
        return Ok(Arg::Map(m));
    }
    // Beyond i128 is beyond any option's range: the engine names it out of range.
    let int = |i: &Bound<'_, PyAny>| Arg::Int(i.extract().unwrap_or(i128::MAX));
    if v.is_instance_of::<PyInt>() {
        return Ok(int(v));
    }
    if v.is_instance_of::<PyFloat>() {
        return Ok(Arg::Float(v.extract()?));
    }
    if !v.is_instance_of::<PyList>() && !v.is_instance_of::<PyTuple>() {
        if let Ok(i) = v.call_method0("__index__") {
            return Ok(int(&i));
        }
        if v.hasattr("__float__")? {
            if let Ok(f) = v.extract::<f64>() {
                return Ok(Arg::Float(f));
            }
        }
    }
    if let Ok(items) = v.try_iter() {
        return items.map(|x| to_arg(&x?)).collect::<PyResult<_>>().map(Arg::List);
    }
    Ok(Arg::Str(format!("<{}>", v.repr()?)))
}

/// Checks a dataset's options (a dict of keyword arguments; any left out take the engine's
/// defaults) and returns `(config, rank, world_size, num_threads, batch_size, drop_last)`,
/// the configuration as JSON text. A bad option raises `InvalidInputError` naming it.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn loader_options(
    options: &Bound<'_, PyDict>,
) -> PyResult<(String, Option<usize>, Option<usize>, Option<usize>, usize, bool)> {
    let mut given = BTreeMap::new();
    for (k, v) in options.iter() {
        let name: String = k.extract()?;
        given.insert(name, to_arg(&v)?);
    }
    let o = Options::parse(given).map_err(to_py)?;
    Ok((
        o.config.to_string(),
        o.rank,
        o.world_size,
        o.num_threads,
        o.batch_size,
        o.drop_last,
    ))
}

/// The options the engine takes, with their defaults, as JSON (`{name: default}`; a
/// required option's default is `null`).
#[pyfunction]
pub fn loader_option_defaults() -> String {
    let m: serde_json::Map<String, serde_json::Value> = ramjet_engine::loader::options::OPTIONS
        .iter()
        .map(|(k, d)| ((*k).to_owned(), d.to_json()))
        .collect();
    serde_json::Value::Object(m).to_string()
}

/// A `StreamingDataset`'s walk over epochs and the loader running for it.
#[pyclass(module = "ramjet._ramjet")]
pub struct Session {
    epochs: Mutex<Epochs>,
    loader: Mutex<Option<Arc<Mutex<EngineLoader>>>>,
    /// A batch of the next epoch, read while ending the current one.
    deferred: Mutex<Option<Box<Batch>>>,
    /// The current iteration has ended (its last batch was yielded).
    ended: Mutex<bool>,
    /// The GPU decode's side (`decode=` with a GPU), opened once; taken out of the lock while
    /// it works (with the GIL released).
    gpu: Mutex<Option<GpuSide>>,
    /// Whether the GPU side skips an image no decoder reads (`on_corrupt="skip"`).
    gpu_skip: Mutex<bool>,
}

/// A lock taken only with the GIL held and never across a wait (see the module's note).
fn held<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Session {
    fn with(epochs: Epochs) -> Self {
        Self {
            epochs: Mutex::new(epochs),
            loader: Mutex::new(None),
            deferred: Mutex::new(None),
            ended: Mutex::new(false),
            gpu: Mutex::new(None),
            gpu_skip: Mutex::new(false),
        }
    }

    /// A GPU-decode batch's image column through the GPU side (with the GIL released), as a
    /// CUDA tensor; `None` for any other batch.
    fn finish_on_gpu(&self, py: Python<'_>, batch: &mut Batch) -> PyResult<Option<(String, crate::dlpack::Tensor)>> {
        use ramjet_engine::loader::ColumnData;
        if !batch
            .columns
            .iter()
            .any(|(_, c)| matches!(c, ColumnData::ImageSource(_)))
        {
            return Ok(None);
        }
        let Some(loader) = held(&self.loader).clone() else {
            return Err(InvalidInputError::new_err("a GPU batch without its loader"));
        };
        let (planner, metrics) = {
            let l = loader.lock().unwrap_or_else(|p| p.into_inner());
            (l.planner().cloned(), l.metrics())
        };
        let Some(planner) = planner else {
            return Err(InvalidInputError::new_err(
                "a GPU batch from a loader without a planner",
            ));
        };
        let Some(mut side) = held(&self.gpu).take() else {
            return Err(InvalidInputError::new_err(
                "a GPU batch, but the GPU side is busy or closed (one iteration at a time)",
            ));
        };
        let skip = *held(&self.gpu_skip);
        let r = py.detach(|| side.finish(batch, planner.spec(), Some(&planner), &metrics, skip));
        *held(&self.gpu) = Some(side);
        r.map_err(to_py)
    }

    /// Drops the running loader (a new one starts on the next iteration).
    fn stop(&self) {
        *held(&self.loader) = None;
        *held(&self.deferred) = None;
        held(&self.epochs).stopped();
    }
}

fn json_text(v: serde_json::Value) -> String {
    v.to_string()
}

#[pymethods]
impl Session {
    /// At the start of epoch 0, no loader running.
    #[new]
    fn new() -> Self {
        Self::with(Epochs::new())
    }

    /// The same position in a fresh object without the loader: for a forked child (the
    /// parent's object is kept, never dropped, there) and for pickling.
    fn forked(&self) -> Self {
        let mut e = held(&self.epochs).clone();
        e.stopped();
        Self::with(e)
    }

    /// The position as JSON text (no loader): what a pickled dataset carries.
    fn position(&self) -> PyResult<String> {
        held(&self.epochs).to_json().map(json_text).map_err(to_py)
    }

    /// A session at `position` (from [`Session::position`]).
    #[staticmethod]
    fn from_position(position: &str) -> PyResult<Self> {
        let v: serde_json::Value =
            serde_json::from_str(position).map_err(|e| InvalidInputError::new_err(format!("position: {e}")))?;
        Epochs::from_json(&v).map(Self::with).map_err(to_py)
    }

    /// Starts an iteration under the configuration `config` (JSON: the options' configuration
    /// with this process's topology, threads and daemon). The running loader goes on when it
    /// is in the epoch to read and was started for this topology; otherwise a new one starts
    /// where the engine says (the epoch's start, or a loaded state).
    fn begin(&self, py: Python<'_>, config: &str) -> PyResult<()> {
        let cfg = parse(config)?;
        let topology = cfg.loader.stream.topology;
        let running = held(&self.loader).is_some();
        if !running || held(&self.epochs).needs_start(&topology) {
            self.stop();
            let mut lc = cfg.loader().map_err(to_py)?;
            // Buckets decode on the CPU path (the GPU path's batches have one size).
            if let Some(g) = cfg.gpu_decode.clone().filter(|_| lc.buckets.is_none()) {
                let open = held(&self.gpu).as_ref().map(|s| s.ordinal()) == Some(g.ordinal);
                if !open {
                    let side = interruptible(py, move || GpuSide::open(&g))?.map_err(to_py)?;
                    *held(&self.gpu) = Some(side);
                }
                lc.gpu_decoders = held(&self.gpu).as_ref().map(|s| s.decoders());
                *held(&self.gpu_skip) = lc.on_corrupt == ramjet_engine::loader::OnCorrupt::Skip;
            }
            held(&self.epochs).start(&mut lc.stream);
            let loader = interruptible(py, move || EngineLoader::start(lc))?;
            let loader = match loader {
                Ok(l) => l,
                Err(e) => {
                    held(&self.epochs).stopped();
                    return Err(to_py(e));
                }
            };
            *held(&self.loader) = Some(Arc::new(Mutex::new(loader)));
        }
        *held(&self.ended) = false;
        Ok(())
    }

    /// The canonical partitions an iteration under `config` (JSON, as for `begin`) reads: the
    /// user's, or when none were given the run's ([`Epochs::settle_partitions`]: a loaded
    /// state's, else the job's node count at the run's first start). Records nothing.
    fn partitions(&self, config: &str) -> PyResult<usize> {
        let mut stream = parse(config)?.loader.stream;
        held(&self.epochs).settle_partitions(&mut stream);
        Ok(stream.order.partitions)
    }

    /// The iteration's next batch as `(columns, meta)`, or `None` when the iteration ends
    /// (the epoch's last batch was yielded, or the next batch belongs to the next epoch).
    fn next_batch<'py>(&self, py: Python<'py>) -> PyResult<Option<(Bound<'py, PyDict>, Bound<'py, PyDict>)>> {
        if *held(&self.ended) {
            return Ok(None);
        }
        let deferred = held(&self.deferred).take();
        let mut batch = match deferred {
            Some(b) => b,
            None => {
                let Some(loader) = held(&self.loader).clone() else {
                    return Err(InvalidInputError::new_err("next_batch before begin"));
                };
                let next = wait_polling(py, |slice| {
                    let mut l = loader.lock().unwrap_or_else(|p| p.into_inner());
                    match l.next_batch(slice).map_err(to_py)? {
                        Next::Pending => Ok(None),
                        other => Ok(Some(other)),
                    }
                })?;
                match next {
                    Next::Batch(b) => b,
                    Next::EpochEnd(mut end) => {
                        held(&self.epochs).on_epoch_end(&mut end);
                        *held(&self.ended) = true;
                        return Ok(None);
                    }
                    _ => {
                        *held(&self.ended) = true;
                        return Ok(None);
                    }
                }
            }
        };
        match held(&self.epochs).on_batch(&mut batch) {
            Step::Defer => {
                *held(&self.deferred) = Some(batch);
                *held(&self.ended) = true;
                return Ok(None);
            }
            Step::YieldLast | Step::End => *held(&self.ended) = true,
            Step::Yield => {}
        }
        let t = std::time::Instant::now();
        let image = self.finish_on_gpu(py, &mut batch)?;
        if image.is_some() {
            // The GPU side's share of the decode ran in this call: the consumer waited on it.
            if let Some(l) = held(&self.loader).clone() {
                let mut l = l.lock().unwrap_or_else(|p| p.into_inner());
                l.charge(ramjet_engine::stall::WaitOn::Decode, t.elapsed());
            }
        }
        let (cols, meta) = batch_to_py(py, *batch)?;
        if let Some((name, t)) = image {
            cols.set_item(name, Py::new(py, t)?)?;
        }
        Ok(Some((cols, meta)))
    }

    /// The epoch the next iteration reads.
    #[getter]
    fn epoch(&self) -> u64 {
        held(&self.epochs).epoch()
    }

    /// Selects the epoch the next iteration reads ([`Epochs::set_epoch`]).
    fn set_epoch(&self, epoch: &Bound<'_, PyAny>) -> PyResult<()> {
        let e = ramjet_engine::loader::options::int("epoch", &to_arg(epoch)?, 0, u64::MAX as i128).map_err(to_py)?;
        held(&self.epochs).set_epoch(e as u64);
        Ok(())
    }

    /// Continues from a saved state (JSON text of a `state_dict()`); a bad one raises
    /// `InvalidInputError` naming the field and changes nothing.
    fn load_state(&self, state: &str) -> PyResult<()> {
        let v: serde_json::Value = serde_json::from_str(state)
            .map_err(|e| InvalidInputError::new_err(format!("state_dict: not a saved state: {e}")))?;
        held(&self.epochs).load(&v).map_err(to_py)?;
        self.stop();
        Ok(())
    }

    /// A DataLoader worker's saved state, as JSON text.
    fn worker_state(&self) -> PyResult<String> {
        held(&self.epochs).worker_state().map(json_text).map_err(to_py)
    }

    /// The job's saved state before this consumer yielded anything, as JSON text.
    fn unstarted_job_state(&self) -> String {
        json_text(held(&self.epochs).unstarted_job_state())
    }

    /// This consumer's state after the last batch it yielded (JSON text), if any.
    fn consumer_state(&self) -> PyResult<Option<String>> {
        held(&self.epochs)
            .consumer_state()
            .map(|s| serde_json::to_string(s).map_err(|e| InvalidInputError::new_err(e.to_string())))
            .transpose()
    }

    /// The loaded job progress this object starts from (JSON text), if any.
    fn resume(&self) -> Option<String> {
        held(&self.epochs).resume_text().map(str::to_owned)
    }

    /// The running loader, if any (tests read raw batches from it).
    fn loader(&self) -> Option<Loader> {
        held(&self.loader).clone().map(Loader::shared)
    }

    /// The running loader's counters (empty when none runs).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        match held(&self.loader).clone() {
            Some(l) => {
                let snap = l.lock().unwrap_or_else(|p| p.into_inner()).metrics().snapshot();
                snapshot_dict(py, &snap)
            }
            None => Ok(PyDict::new(py)),
        }
    }
}

/// The job's saved state (JSON text) from every consumer's state (JSON text), all taken after
/// the same step.
#[pyfunction]
pub fn job_state(states: Vec<String>) -> PyResult<String> {
    Epochs::job_state(&crate::loader::parse_states(&states)?)
        .map(json_text)
        .map_err(to_py)
}
