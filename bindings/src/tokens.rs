//! The token stream behind `ramjet.TokenDataset`: one consumer's windows of a token job
//! (`ramjet_engine::tokens`), in batches of DLPack tensors.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde::Deserialize;

use ramjet_engine::format::array::Dtype;
use ramjet_engine::tokens::{
    TokenConfig, TokenData, TokenOptions, TokenResume, TokenState, TokenStream as EngineStream,
};

use crate::dlpack::{DType, Storage, Tensor};
use crate::{interruptible, to_py, wait_polling, InvalidInputError};

/// What `TokenDataset` passes down.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenJson {
    /// The documents' stream: the loader's configuration (sources, order, topology, cache,
    /// daemon), as `StreamingDataset` builds it.
    loader: serde_json::Value,
    tokens: TokenOptions,
    #[serde(default)]
    epoch: u64,
    #[serde(default)]
    resume: Option<TokenResume>,
}

/// One consumer's token windows for one epoch.
#[pyclass(module = "ramjet._ramjet")]
pub struct TokenStream {
    inner: std::sync::Mutex<EngineStream>,
}

fn bad(e: impl std::fmt::Display) -> PyErr {
    InvalidInputError::new_err(e.to_string())
}

#[pymethods]
impl TokenStream {
    /// Opens the sources and locates this consumer's first window.
    #[new]
    fn new(py: Python<'_>, config: &str) -> PyResult<Self> {
        let j: TokenJson = serde_json::from_str(config).map_err(|e| bad(format!("token stream configuration: {e}")))?;
        let loader = crate::loader::parse(&j.loader.to_string())?;
        let cfg = TokenConfig {
            stream: loader.stream(),
            tokens: j.tokens,
            epoch: j.epoch,
            resume: j.resume,
        };
        let s = interruptible(py, move || EngineStream::open(cfg))?.map_err(to_py)?;
        Ok(TokenStream {
            inner: std::sync::Mutex::new(s),
        })
    }

    /// The next batch as a dict of tensors, `None` after the epoch's last.
    fn next_batch<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let s: &mut EngineStream = &mut guard;
        let got = wait_polling(py, |slice| match s.next_batch_timeout(slice) {
            Ok(b) => Ok(Some(b)),
            Err(None) => Ok(None),
            Err(Some(e)) => Err(to_py(e)),
        })?;
        let Some(b) = got else { return Ok(None) };
        let rows = b.windows.len() as i64;
        let width = if rows == 0 { 0 } else { b.tokens.len() as i64 / rows };
        let d = PyDict::new(py);
        let shape = vec![rows, width];
        let t = match b.tokens {
            TokenData::I32(v) => Tensor::new(Storage::I32(v), shape.clone(), DType::Array(Dtype::I32)),
            TokenData::I64(v) => Tensor::new(Storage::I64(v), shape.clone(), DType::I64),
        };
        d.set_item("tokens", Py::new(py, t)?)?;
        let i32s =
            |v: Vec<i32>, shape: Vec<i64>| Py::new(py, Tensor::new(Storage::I32(v), shape, DType::Array(Dtype::I32)));
        d.set_item("lengths", i32s(b.lengths, vec![rows])?)?;
        if let Some(p) = b.positions {
            d.set_item("positions", i32s(p, shape.clone())?)?;
        }
        if let Some(sg) = b.segments {
            d.set_item("segments", i32s(sg, shape.clone())?)?;
        }
        let w: Vec<i64> = b.windows.iter().map(|&x| x as i64).collect();
        d.set_item(
            "window",
            Py::new(py, Tensor::new(Storage::I64(w), vec![rows], DType::I64))?,
        )?;
        d.set_item("_epoch", b.epoch)?;
        d.set_item("_docs_read", b.docs_read)?;
        Ok(Some(d))
    }

    /// This consumer's state after the last batch it gave (JSON).
    fn state(&self) -> PyResult<String> {
        let s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::to_string(&s.state()).map_err(bad)
    }
}

/// The job's resume point (JSON) from every consumer's [`TokenStream::state`].
#[pyfunction]
pub fn token_job_state(states: Vec<String>) -> PyResult<String> {
    let parsed = states
        .iter()
        .enumerate()
        .map(|(i, s)| serde_json::from_str::<TokenState>(s).map_err(|e| bad(format!("token state {i}: {e}"))))
        .collect::<PyResult<Vec<_>>>()?;
    let r = TokenState::combine(&parsed).map_err(to_py)?;
    serde_json::to_string(&r).map_err(bad)
}

/// Checks a saved resume point (JSON) without opening anything: its fields and their types.
#[pyfunction]
pub fn token_resume_check(state: &str) -> PyResult<String> {
    let r: TokenResume = serde_json::from_str(state).map_err(|e| bad(format!("token resume state: {e}")))?;
    if r.kind != "tokens" {
        return Err(bad(format!("token resume state: kind {:?} is not \"tokens\"", r.kind)));
    }
    serde_json::to_string(&r).map_err(bad)
}

/// Checks token options (JSON), naming a bad one.
#[pyfunction]
pub fn token_options_check(options: &str) -> PyResult<()> {
    let o: TokenOptions = serde_json::from_str(options).map_err(|e| bad(format!("token options: {e}")))?;
    o.check().map_err(to_py)
}
