//! GPU support for ramjet, loaded at run time so that nothing links against CUDA.
//!
//! The driver API comes through cudarc with dynamic loading: the crate builds, and every test
//! passes, on machines with no CUDA and no nvcc. cudarc panics on first use when libcuda is
//! missing, so every first touch goes through [`driver_present`]. The user libraries cudarc's
//! fixed name lists miss (nvJPEG, NVRTC and cuFile as PyPI wheels ship them) are found and
//! loaded by absolute path in [`libs`].
#![deny(missing_docs)]

pub mod current;
pub mod decode_batch;
pub mod dlpack;
pub mod gpu;
pub mod kernel;
pub mod libs;
pub mod nvjpeg;
pub mod nvrtc;
pub mod pipeline;
pub mod pool;

/// Every error of the GPU path, in one enum: the driver, the buffer pools, the CUDA user
/// libraries and their search, NVRTC, and arguments refused before anything was queued.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuError {
    /// No CUDA driver library (libcuda) can be loaded in this process.
    NoDriver,
    /// The driver loaded, but a call failed.
    Driver {
        /// What was being done.
        doing: &'static str,
        /// The driver's error.
        reason: String,
    },
    /// The driver works, but sees no GPU.
    NoDevice,
    /// A buffer pool would go over its byte limit ([`pool::Pool`]): back-pressure.
    PoolExhausted {
        /// Bytes asked for (rounded).
        want: usize,
        /// Bytes handed out and not yet back.
        in_use: usize,
        /// Bytes waiting for their fence.
        pending: usize,
        /// The pool's limit.
        limit: usize,
    },
    /// A library's environment variable is set, but leads to no such library ([`libs`]).
    LibraryEnv {
        /// Which library.
        lib: libs::Lib,
        /// The variable's value.
        value: String,
    },
    /// A library was found nowhere.
    LibraryNotFound {
        /// Which library.
        lib: libs::Lib,
        /// Every folder looked in, in order.
        looked_in: Vec<std::path::PathBuf>,
    },
    /// A library was found, but the dynamic loader refused it.
    LibraryLoad {
        /// The file.
        path: std::path::PathBuf,
        /// The loader's reason.
        reason: String,
    },
    /// A symbol is missing from the NVRTC library (not NVRTC, or a very old one).
    NvrtcSymbol {
        /// The library.
        path: std::path::PathBuf,
        /// The symbol.
        name: &'static str,
    },
    /// A symbol is missing from a CUDA user library (not that library, or too old a one).
    LibrarySymbol {
        /// Which library.
        lib: libs::Lib,
        /// The file.
        path: std::path::PathBuf,
        /// The symbol.
        name: &'static str,
    },
    /// An nvJPEG call returned an error status.
    Nvjpeg {
        /// The C function.
        call: &'static str,
        /// Its `nvjpegStatus_t`.
        status: i32,
        /// The image, by its index in the batch, where the call was about one.
        image: Option<usize>,
    },
    /// The kernel's source did not compile; NVRTC's log.
    NvrtcCompile {
        /// What NVRTC said.
        log: String,
    },
    /// Another NVRTC call failed.
    NvrtcCall {
        /// The call.
        name: &'static str,
        /// Its result code.
        code: i32,
    },
    /// An argument refused before anything was queued: a DLPack stream or device, a kernel
    /// job, an output size, a staging slot too small.
    Invalid {
        /// What was being checked.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },
}

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuError::NoDriver => write!(
                f,
                "no CUDA driver: libcuda.so cannot be loaded in this process (no NVIDIA driver installed, \
                 or not visible in this container); the GPU path needs one, the CPU path does not"
            ),
            GpuError::Driver { doing, reason } => write!(f, "CUDA driver error while {doing}: {reason}"),
            GpuError::NoDevice => write!(f, "the CUDA driver sees no GPU (check CUDA_VISIBLE_DEVICES)"),
            GpuError::PoolExhausted {
                want,
                in_use,
                pending,
                limit,
            } => write!(
                f,
                "buffer pool full: {want} B wanted, {in_use} B in use and {pending} B waiting for the GPU, \
                 limit {limit} B (batches are being held; drop them or raise the limit)"
            ),
            GpuError::LibraryEnv { lib, value } => write!(
                f,
                "{}={value:?} holds no {} library ({}); unset it to search the Python environment and the system",
                lib.env_var(),
                lib.name(),
                lib.file_names().join(" or ")
            ),
            GpuError::LibraryNotFound { lib, looked_in } => {
                let places: Vec<String> = looked_in.iter().map(|p| p.display().to_string()).collect();
                write!(
                    f,
                    "no {} library ({}) found; looked in ${} (unset), {}; {}",
                    lib.name(),
                    lib.file_names().join(" or "),
                    lib.env_var(),
                    if places.is_empty() {
                        "no other folder".to_owned()
                    } else {
                        places.join(", ")
                    },
                    lib.install_hint()
                )
            }
            GpuError::LibraryLoad { path, reason } => write!(f, "cannot load {}: {reason}", path.display()),
            GpuError::NvrtcSymbol { path, name } => {
                write!(f, "{} is not a usable NVRTC: it has no {name}", path.display())
            }
            GpuError::LibrarySymbol { lib, path, name } => write!(
                f,
                "{} is not a usable {} library: it has no {name} (too old a release?)",
                path.display(),
                lib.name()
            ),
            GpuError::Nvjpeg { call, status, image } => {
                write!(
                    f,
                    "nvJPEG: {call} returned {} ({status})",
                    nvjpeg::status::name(*status)
                )?;
                match image {
                    Some(i) => write!(f, " for image {i} of the batch"),
                    None => Ok(()),
                }
            }
            GpuError::NvrtcCompile { log } => write!(f, "NVRTC could not compile the kernel:\n{log}"),
            GpuError::NvrtcCall { name, code } => write!(f, "NVRTC: {name} failed with code {code}"),
            GpuError::Invalid { what, reason } => write!(f, "{what}: {reason}"),
        }
    }
}

impl std::error::Error for GpuError {}

/// Maps a driver call's error to [`GpuError::Driver`], saying what was being done.
pub(crate) fn driver_err(doing: &'static str) -> impl Fn(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        doing,
        reason: e.to_string(),
    }
}

/// Whether the CUDA driver library can be loaded in this process. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: only tries to load libcuda by cudarc's names, each handle dropped at once; no
    // symbol is called. Loading runs the library's initialisers, which have no preconditions.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// GPUs the driver sees: [`GpuError::NoDriver`] without a driver (checked first, so cudarc
/// never panics), [`GpuError::NoDevice`] when it sees none.
pub fn device_count() -> Result<usize, GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    match cudarc::driver::result::init() {
        // A driver with no GPU behind it (a container without one passed through) fails here.
        Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => return Err(GpuError::NoDevice),
        // cudarc opens `libcuda.so` before `libcuda.so.1`: the CUDA toolkit's stub of that name
        // (its `lib64/stubs`) on the library path is found first, and says so here.
        Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_STUB_LIBRARY => {
            return Err(GpuError::Driver {
                doing: "initialising",
                reason: "the libcuda.so loaded is the CUDA toolkit's stub, not the driver: take the toolkit's \
                         `stubs` folder off LD_LIBRARY_PATH"
                    .into(),
            })
        }
        other => other.map_err(driver_err("initialising"))?,
    }
    let n = cudarc::driver::result::device::get_count().map_err(driver_err("counting devices"))?;
    match usize::try_from(n) {
        Ok(0) | Err(_) => Err(GpuError::NoDevice),
        Ok(n) => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer is checked against an independent look for the driver: the same library
    /// names, opened here directly.
    #[test]
    fn detection_agrees_with_the_loader_and_never_panics() {
        let direct = ["libcuda.so.1", "libcuda.so"].iter().any(|n| {
            // SAFETY: as in `driver_present`: a load whose handle is dropped at once.
            unsafe { libloading::Library::new(n) }.is_ok()
        });
        assert_eq!(driver_present(), direct);
        match device_count() {
            Err(GpuError::NoDriver) => assert!(!direct),
            other => assert!(direct, "a driver answered without one present: {other:?}"),
        }
    }

    #[test]
    fn the_no_driver_error_says_what_to_do() {
        let msg = GpuError::NoDriver.to_string();
        assert!(
            msg.contains("libcuda") && msg.contains("the CPU path does not"),
            "{msg}"
        );
    }
}
