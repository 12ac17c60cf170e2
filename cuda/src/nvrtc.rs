//! NVRTC, loaded by absolute path ([`crate::libs`]), compiling CUDA C to PTX at run time.
//! Compiling needs no GPU and no driver, so the fused kernel's source is checked wherever
//! NVRTC is installed (torch's CUDA wheels bring it).

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use crate::libs::{self, Lib, LibError, Search};

type Prog = *mut std::ffi::c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Prog,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Prog, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Prog, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Prog) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// NVRTC's entry points, from one loaded library.
pub struct Nvrtc {
    path: PathBuf,
    create: CreateFn,
    compile: CompileFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    log_size: SizeFn,
    log: GetFn,
    destroy: DestroyFn,
    version: VersionFn,
    // Last: the symbols above point into it and must not outlive it.
    _lib: libloading::Library,
}

/// Why compiling failed.
#[derive(Debug)]
pub enum NvrtcError {
    /// The library was not found or not loaded.
    Lib(LibError),
    /// A symbol is missing (not an NVRTC library, or a very old one).
    Symbol {
        /// The library.
        path: PathBuf,
        /// The symbol.
        name: &'static str,
    },
    /// The source did not compile; NVRTC's log.
    Compile {
        /// What NVRTC said.
        log: String,
    },
    /// Another NVRTC call failed.
    Call {
        /// The call.
        name: &'static str,
        /// Its result code.
        code: i32,
    },
}

impl std::fmt::Display for NvrtcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NvrtcError::Lib(e) => write!(f, "{e}"),
            NvrtcError::Symbol { path, name } => {
                write!(f, "{} is not a usable NVRTC: it has no {name}", path.display())
            }
            NvrtcError::Compile { log } => write!(f, "NVRTC could not compile the kernel:\n{log}"),
            NvrtcError::Call { name, code } => write!(f, "NVRTC: {name} failed with code {code}"),
        }
    }
}

impl std::error::Error for NvrtcError {}

impl Nvrtc {
    /// Finds NVRTC with `search` and loads it.
    pub fn find(search: &Search) -> Result<Nvrtc, NvrtcError> {
        let found = search.find(Lib::Nvrtc).map_err(NvrtcError::Lib)?;
        Nvrtc::open(&found.path)
    }

    /// Loads NVRTC from `path`.
    pub fn open(path: &Path) -> Result<Nvrtc, NvrtcError> {
        let lib = libs::load(path).map_err(NvrtcError::Lib)?;
        fn sym<T: Copy>(lib: &libloading::Library, path: &Path, name: &'static str) -> Result<T, NvrtcError> {
            let c = format!("{name}\0");
            // SAFETY: each `T` below is the C signature NVRTC documents for `name`; the
            // pointer is copied out and used only while `Nvrtc` (which owns `lib`) lives.
            unsafe { lib.get::<T>(c.as_bytes()) }
                .map(|s| *s)
                .map_err(|_| NvrtcError::Symbol {
                    path: path.to_path_buf(),
                    name,
                })
        }
        Ok(Nvrtc {
            path: path.to_path_buf(),
            create: sym(&lib, path, "nvrtcCreateProgram")?,
            compile: sym(&lib, path, "nvrtcCompileProgram")?,
            ptx_size: sym(&lib, path, "nvrtcGetPTXSize")?,
            ptx: sym(&lib, path, "nvrtcGetPTX")?,
            log_size: sym(&lib, path, "nvrtcGetProgramLogSize")?,
            log: sym(&lib, path, "nvrtcGetProgramLog")?,
            destroy: sym(&lib, path, "nvrtcDestroyProgram")?,
            version: sym(&lib, path, "nvrtcVersion")?,
            _lib: lib,
        })
    }

    /// The library's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// NVRTC's `(major, minor)` version.
    pub fn version(&self) -> Result<(i32, i32), NvrtcError> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out-pointers.
        let code = unsafe { (self.version)(&mut a, &mut b) };
        if code != 0 {
            return Err(NvrtcError::Call {
                name: "nvrtcVersion",
                code,
            });
        }
        Ok((a, b))
    }

    /// Compiles `src` (named `name` in messages) to PTX for virtual architecture `arch`
    /// (`"compute_80"`), which the driver then compiles for the GPU it runs on.
    pub fn compile(&self, src: &str, name: &str, arch: &str) -> Result<CString, NvrtcError> {
        let c_src = CString::new(src).map_err(|_| NvrtcError::Compile {
            log: "the source contains a NUL byte".into(),
        })?;
        let c_name = CString::new(name).unwrap_or_else(|_| c"kernel.cu".into());
        let opts: Vec<CString> = [format!("--gpu-architecture={arch}"), "--std=c++17".into()]
            .into_iter()
            .map(|o| CString::new(o).expect("options have no NUL"))
            .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        let call = |name: &'static str, code: c_int| {
            if code == 0 {
                Ok(())
            } else {
                Err(NvrtcError::Call { name, code })
            }
        };
        // SAFETY: valid C strings, no headers (0 and nulls); `prog` receives the program.
        call("nvrtcCreateProgram", unsafe {
            (self.create)(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        // From here `prog` is destroyed on every path.
        let result = (|| {
            // SAFETY: a live program and `opt_ptrs.len()` valid C strings.
            let code = unsafe { (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
            if code != 0 {
                return Err(NvrtcError::Compile {
                    log: self.read(prog, self.log_size, self.log, "log").unwrap_or_default(),
                });
            }
            let ptx = self.read(prog, self.ptx_size, self.ptx, "PTX")?;
            CString::new(ptx.trim_end_matches('\0')).map_err(|_| NvrtcError::Compile {
                log: "the PTX contains a NUL byte".into(),
            })
        })();
        // SAFETY: `prog` was created above and is destroyed once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn read(&self, prog: Prog, size: SizeFn, get: GetFn, what: &'static str) -> Result<String, NvrtcError> {
        let mut n = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        let code = unsafe { size(prog, &mut n) };
        if code != 0 {
            return Err(NvrtcError::Call { name: what, code });
        }
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it will write.
        let code = unsafe { get(prog, buf.as_mut_ptr().cast()) };
        if code != 0 {
            return Err(NvrtcError::Call { name: what, code });
        }
        Ok(CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| String::from_utf8_lossy(&buf).into_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Python environment tools/setup.sh builds (`RAMJET_VENV`, else the checkout's
    /// `.venv`): torch's CUDA wheels in it bring NVRTC. A machine without it fails here, with
    /// the search's message, rather than skip.
    fn search() -> Search {
        let venv = std::env::var_os("RAMJET_VENV")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv"));
        Search::from_env(&libs::site_packages(&venv))
    }

    #[test]
    fn the_fused_kernel_compiles_to_ptx_with_the_environment_s_nvrtc() {
        let nvrtc = match Nvrtc::find(&search()) {
            Ok(n) => n,
            Err(e) => panic!("NVRTC is needed for this test (run tools/setup.sh): {e}"),
        };
        let (major, _) = nvrtc.version().unwrap();
        assert!(major >= 12, "NVRTC {major} at {}", nvrtc.path().display());
        let ptx = nvrtc
            .compile(crate::kernel::KERNEL_SRC, "ramjet_fused.cu", "compute_80")
            .unwrap_or_else(|e| panic!("{e}"));
        let ptx = ptx.to_str().unwrap();
        assert!(ptx.contains(&format!(".entry {}", crate::kernel::KERNEL_NAME)), "{ptx}");
        // The conversions the reference mirrors are the rounding ones, and nothing was fused.
        assert!(ptx.contains("cvt.rn.f16.f32") && ptx.contains("cvt.rn.bf16.f32"));
        assert!(
            !ptx.contains("fma.rn.f32"),
            "a multiply-add was fused: the reference would differ"
        );
    }

    #[test]
    fn a_compile_error_returns_nvrtc_s_log() {
        let nvrtc = Nvrtc::find(&search()).unwrap_or_else(|e| panic!("{e}"));
        let err = nvrtc
            .compile(
                "extern \"C\" __global__ void k() { undeclared_thing(); }",
                "bad.cu",
                "compute_80",
            )
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("bad.cu") && msg.contains("undeclared_thing"), "{msg}");
    }

    #[test]
    fn a_file_that_is_not_nvrtc_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let libc = [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/lib64/libc.so.6",
        ]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file());
        if let Some(libc) = libc {
            match Nvrtc::open(libc) {
                Err(NvrtcError::Symbol { name, .. }) => assert_eq!(name, "nvrtcCreateProgram"),
                Err(e) => panic!("{e}"),
                Ok(_) => panic!("libc was taken for NVRTC"),
            }
        }
        let fake = dir.path().join("libnvrtc.so.13");
        std::fs::write(&fake, b"no").unwrap();
        assert!(matches!(Nvrtc::open(&fake), Err(NvrtcError::Lib(_))));
    }
}
