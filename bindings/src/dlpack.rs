//! DLPack export: a [`Tensor`] hands its memory to `torch.from_dlpack` / `numpy.from_dlpack`
//! without a copy. The consumer owns a `DLManagedTensor` whose context keeps the storage
//! alive; its deleter (or the capsule's destructor, when nobody consumed it) releases it, and
//! a batch buffer then goes back to its pool.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use ramjet_cuda::dlpack::{check_requested_device, ConsumerStream, Device, Export, Shared};
use ramjet_engine::buf::HostBuf;
use ramjet_engine::format::array::Dtype;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// DLPack 1.0's `DLPackVersion`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.0's `DLManagedTensorVersioned`: the version first, then the context, the deleter,
/// the flags (read-only, copied) and the tensor last, so the struct can grow.
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const CAPSULE_NAME: &CStr = c"dltensor";
/// The capsule of a [`DLManagedTensorVersioned`] (DLPack 1.0, array API 2023.12).
const CAPSULE_NAME_VERSIONED: &CStr = c"dltensor_versioned";
/// The DLPack version ramjet exports when the consumer accepts a versioned tensor.
const DLPACK_VERSION: DLPackVersion = DLPackVersion { major: 1, minor: 0 };

/// Whether a consumer that passed `max_version` gets the versioned capsule: it accepts DLPack
/// 1.x (a consumer that passes no `max_version` predates versioning and gets the legacy one).
pub fn wants_versioned(max_version: Option<(u32, u32)>) -> bool {
    max_version.is_some_and(|(major, _)| major >= DLPACK_VERSION.major)
}

/// Element types ramjet exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// uint8.
    U8,
    /// int64.
    I64,
    /// float32.
    F32,
    /// float64.
    F64,
    /// bool, one byte each (a nullable column's mask).
    Bool,
    /// An array column's element type.
    Array(Dtype),
}

impl DType {
    fn dl(self) -> DLDataType {
        let (code, bits) = match self {
            DType::U8 => (1, 8),
            DType::I64 => (0, 64),
            DType::F32 => (2, 32),
            DType::F64 => (2, 64),
            DType::Bool => (6, 8),
            // kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6.
            DType::Array(d) => match d {
                Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64 => (0, 8 * d.size() as u8),
                Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 => (1, 8 * d.size() as u8),
                Dtype::F16 | Dtype::F32 | Dtype::F64 => (2, 8 * d.size() as u8),
                Dtype::Bf16 => (4, 16),
            },
        };
        DLDataType { code, bits, lanes: 1 }
    }

    fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I64 => "int64",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::Bool => "bool",
            DType::Array(d) => d.name(),
        }
    }
}

/// Memory behind a tensor.
pub enum Storage {
    /// A pooled batch buffer.
    Host(HostBuf),
    /// uint8 values.
    U8(Vec<u8>),
    /// int32 values.
    I32(Vec<i32>),
    /// int64 values.
    I64(Vec<i64>),
    /// float32 values.
    F32(Vec<f32>),
    /// float64 values.
    F64(Vec<f64>),
    /// Shared bytes (an array column's elements, or a value's slice of its shard).
    Bytes(bytes::Bytes),
    /// A device buffer of ramjet's pool (the GPU decode's batches): exported to CUDA
    /// consumers, each ordered after the batch and fenced on its own stream.
    Cuda(Shared),
}

// SAFETY: a `Storage` is never mutated after construction (consumers write through the raw
// pointer they were given, as DLPack allows, but ramjet itself only reads the address),
// `HostBuf` is an owned allocation with no thread affinity, and a `Shared` device buffer is
// read for its address and device only, its releases recorded under its own lock.
unsafe impl Sync for Storage {}

impl Storage {
    fn ptr(&self) -> *mut c_void {
        match self {
            Storage::Host(b) => b.as_ptr() as *mut c_void,
            Storage::U8(v) => v.as_ptr() as *mut c_void,
            Storage::I32(v) => v.as_ptr() as *mut c_void,
            Storage::I64(v) => v.as_ptr() as *mut c_void,
            Storage::F32(v) => v.as_ptr() as *mut c_void,
            Storage::F64(v) => v.as_ptr() as *mut c_void,
            Storage::Bytes(v) => v.as_ptr() as *mut c_void,
            Storage::Cuda(b) => b.addr() as *mut c_void,
        }
    }

    fn device(&self) -> Device {
        match self {
            Storage::Cuda(b) => b.device(),
            _ => Device::CPU,
        }
    }
}

/// A tensor exported through DLPack (host memory, or a GPU batch's device buffer) (`torch.from_dlpack(t)`, `numpy.from_dlpack(t)`).
#[pyclass(frozen, module = "ramjet._ramjet")]
pub struct Tensor {
    storage: Arc<Storage>,
    shape: Vec<i64>,
    dtype: DType,
}

impl Tensor {
    /// A tensor of `shape` over `storage` (which must hold at least that many elements).
    pub fn new(storage: Storage, shape: Vec<i64>, dtype: DType) -> Self {
        Self {
            storage: Arc::new(storage),
            shape,
            dtype,
        }
    }
}

struct Ctx {
    storage: Arc<Storage>,
    shape: Vec<i64>,
    /// A CUDA export: its consumer's release is fenced when the consumer frees the tensor.
    export: Option<Export>,
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if let (Storage::Cuda(shared), Some(e)) = (&*self.storage, &self.export) {
            shared.released(e);
        }
    }
}

unsafe extern "C" fn managed_deleter(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were created by `Box::into_raw` in `__dlpack__` and the
    // DLPack protocol calls the deleter exactly once.
    unsafe {
        drop(Box::from_raw((*m).manager_ctx.cast::<Ctx>()));
        drop(Box::from_raw(m));
    }
}

unsafe extern "C" fn managed_deleter_versioned(m: *mut DLManagedTensorVersioned) {
    if m.is_null() {
        return;
    }
    // SAFETY: as for `managed_deleter`: both were made by `Box::into_raw` in `__dlpack__`, and
    // the protocol calls the deleter exactly once.
    unsafe {
        drop(Box::from_raw((*m).manager_ctx.cast::<Ctx>()));
        drop(Box::from_raw(m));
    }
}

unsafe extern "C" fn capsule_destructor_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: called by CPython with a live capsule; a consumer renames it
    // "used_dltensor_versioned" once it owns the tensor.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME_VERSIONED.as_ptr()) == 1 {
            let m =
                ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME_VERSIONED.as_ptr()).cast::<DLManagedTensorVersioned>();
            managed_deleter_versioned(m);
        }
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by CPython with a live capsule. A consumer renames it "used_dltensor"
    // once it owns the tensor; only an unconsumed capsule still owns it here.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr()).cast::<DLManagedTensor>();
            managed_deleter(m);
        }
    }
}

#[pymethods]
impl Tensor {
    /// Exports the tensor as a DLPack capsule (CPU, compact row-major): a versioned one
    /// (`"dltensor_versioned"`, DLPack 1.0) when the consumer's `max_version` accepts it, the
    /// legacy `"dltensor"` otherwise.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        // The protocol's rules (ramjet_cuda::dlpack): host memory takes only stream=None, and
        // a request for another device is refused rather than copied.
        let stream = match stream {
            None => None,
            Some(s) => Some(s.extract::<i64>(py).map_err(|_| {
                PyValueError::new_err("__dlpack__: stream must be None or an integer (DLPack protocol)")
            })?),
        };
        let device = self.storage.device();
        check_requested_device(device, dl_device).map_err(|e| PyBufferError::new_err(e.to_string()))?;
        if copy == Some(true) {
            return Err(PyValueError::new_err(
                "ramjet exports without copying; copy=True is not supported",
            ));
        }
        // A CUDA consumer's stream waits for the batch here; host memory takes no stream.
        let export = match &*self.storage {
            Storage::Cuda(shared) => Some(
                shared
                    .export(stream)
                    .map_err(|e| PyValueError::new_err(e.to_string()))?,
            ),
            _ => {
                ConsumerStream::parse(device, stream).map_err(|e| PyValueError::new_err(e.to_string()))?;
                None
            }
        };
        let mut ctx = Box::new(Ctx {
            storage: self.storage.clone(),
            shape: self.shape.clone(),
            export,
        });
        let dl_tensor = DLTensor {
            data: self.storage.ptr(),
            device: DLDevice {
                device_type: device.kind,
                device_id: device.id,
            },
            ndim: self.shape.len() as i32,
            dtype: self.dtype.dl(),
            shape: ctx.shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let manager_ctx = Box::into_raw(ctx).cast::<c_void>();
        let cap = if wants_versioned(max_version) {
            let raw = Box::into_raw(Box::new(DLManagedTensorVersioned {
                version: DLPACK_VERSION,
                manager_ctx,
                deleter: Some(managed_deleter_versioned),
                // Writable, and not a copy.
                flags: 0,
                dl_tensor,
            }));
            // SAFETY: `raw` is a valid DLManagedTensorVersioned; the capsule takes ownership
            // and its destructor releases it unless a consumer took it over.
            let cap = unsafe {
                ffi::PyCapsule_New(
                    raw.cast::<c_void>(),
                    CAPSULE_NAME_VERSIONED.as_ptr(),
                    Some(capsule_destructor_versioned),
                )
            };
            if cap.is_null() {
                // SAFETY: the capsule was not created, so we still own `raw`.
                unsafe { managed_deleter_versioned(raw) };
            }
            cap
        } else {
            let raw = Box::into_raw(Box::new(DLManagedTensor {
                dl_tensor,
                manager_ctx,
                deleter: Some(managed_deleter),
            }));
            // SAFETY: `raw` is a valid DLManagedTensor; the capsule takes ownership and its
            // destructor releases it unless a consumer took it over.
            let cap =
                unsafe { ffi::PyCapsule_New(raw.cast::<c_void>(), CAPSULE_NAME.as_ptr(), Some(capsule_destructor)) };
            if cap.is_null() {
                // SAFETY: the capsule was not created, so we still own `raw`.
                unsafe { managed_deleter(raw) };
            }
            cap
        };
        if cap.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `cap` is a new, owned reference.
        Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
    }

    /// `(kDLCPU, 0)`, or `(kDLCUDA, ordinal)` for a GPU batch.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = self.storage.device();
        (d.kind, d.id)
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    /// The element type's name (numpy spelling).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// Address of the first element (for checking that consumers did not copy).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.storage.ptr() as usize
    }

    fn __repr__(&self) -> String {
        format!("ramjet.Tensor(shape={:?}, dtype={})", self.shape, self.dtype.name())
    }
}
