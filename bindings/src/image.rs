//! One image decoded as the loader's decode threads decode it, for tests against Pillow and
//! the single-core decode benchmarks (`benches/python/webp_decode.py`): `ramjet.decode_image`.

use std::cell::RefCell;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use ramjet_engine::image::exif::{orientation, Orientation};
use ramjet_engine::image::{decode_shown, process, ImageConfig, ImageSpec, OutBufs, OutType, SampleRng, Scratch};

use crate::{CorruptError, InvalidInputError};

thread_local! {
    /// The calling thread's decoder and buffers, kept from call to call as a decode thread's.
    /// Boxed: the extension's thread-locals share a small static TLS block with the libraries
    /// loaded before it (`test_the_extension_loads_after_torch_with_a_small_static_tls_block`).
    static SCRATCH: RefCell<Option<Box<Scratch>>> = const { RefCell::new(None) };
}

/// Decodes `data` (JPEG, PNG or WebP). Without `config`: the whole image as its EXIF
/// orientation shows it (as stored when `exif_orientation` is false), `(bytes, [h, w, 3])` of
/// uint8 RGB. With `config` (the loader's image options as JSON, as
/// `ramjet.loader_defaults()` lists them): the image made as the loader makes sample
/// `sample` of stream 0 in `epoch` under `seed`, `(bytes, [3, h, w])` of uint8, or float32
/// when `config` asks for float. The GIL is released while it runs.
#[pyfunction]
#[pyo3(signature = (data, config=None, seed=0, epoch=0, sample=0, exif_orientation=true))]
pub fn decode_image<'py>(
    py: Python<'py>,
    data: &[u8],
    config: Option<&str>,
    seed: u64,
    epoch: u64,
    sample: u64,
    exif_orientation: bool,
) -> PyResult<(Bound<'py, PyBytes>, Vec<usize>)> {
    let Some(config) = config else {
        let o = if exif_orientation {
            orientation(data)
        } else {
            Orientation::UP
        };
        let rgb = py
            .detach(|| decode_shown(data, o))
            .map_err(|e| CorruptError::new_err(format!("decode_image: {e}")))?;
        let shape = vec![rgb.height as usize, rgb.width as usize, 3];
        return Ok((PyBytes::new(py, &rgb.data), shape));
    };
    let c: ImageConfig =
        serde_json::from_str(config).map_err(|e| InvalidInputError::new_err(format!("decode_image config: {e}")))?;
    if c.width == 0 || c.height == 0 || c.width > 16384 || c.height > 16384 {
        return Err(InvalidInputError::new_err(format!(
            "decode_image config: an output of {}x{} (1 to 16384 each way)",
            c.width, c.height
        )));
    }
    let spec = ImageSpec::from(c);
    let shape = vec![3, spec.height as usize, spec.width as usize];
    let mut out = OutBufs::default();
    py.detach(|| {
        SCRATCH.with(|s| {
            let mut rng = SampleRng::new(seed, epoch, 0, sample);
            let mut s = s.borrow_mut();
            let scratch = s.get_or_insert_with(Box::default);
            process(data, &spec, &mut rng, out.slot(&spec), scratch)
        })
    })
    .map_err(|e| CorruptError::new_err(format!("decode_image: {e}")))?;
    if spec.out == OutType::F32 {
        out.u8s = out.f32s.iter().flat_map(|x| x.to_ne_bytes()).collect();
    }
    Ok((PyBytes::new(py, &out.u8s), shape))
}
