//! GPU support for ramjet, loaded at run time so that nothing links against CUDA.
//!
//! The driver API comes through cudarc with dynamic loading: the crate builds, and every test
//! passes, on machines with no CUDA and no nvcc. cudarc panics on first use when libcuda is
//! missing, so every first touch goes through [`driver_present`]. The user libraries cudarc's
//! fixed name lists miss (nvJPEG, NVRTC and cuFile as PyPI wheels ship them) are found and
//! loaded by absolute path in [`libs`].
#![deny(missing_docs)]

pub mod current;
pub mod dlpack;
pub mod gpu;
pub mod kernel;
pub mod libs;
pub mod nvrtc;
pub mod pipeline;
pub mod pool;

/// Why the GPU cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
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
