//! NVRTC, loaded by absolute path ([`crate::libs`]), compiling CUDA C at run time to a cubin for
//! the device's own architecture, or to PTX where the driver can load NVRTC's PTX.
//! Compiling needs no GPU and no driver, so the fused kernel's source is checked wherever
//! NVRTC is installed (torch's CUDA wheels bring it).

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use crate::libs::{self, Lib, Search};
use crate::GpuError;

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
    /// `nvrtcGetCUBINSize` / `nvrtcGetCUBIN` (NVRTC 11.1 and later).
    cubin: Option<(SizeFn, GetFn)>,
    // Last: the symbols above point into it and must not outlive it.
    _lib: libloading::Library,
}

impl Nvrtc {
    /// Finds NVRTC with `search` and loads it.
    pub fn find(search: &Search) -> Result<Nvrtc, GpuError> {
        let found = search.find(Lib::Nvrtc)?;
        Nvrtc::open(&found.path)
    }

    /// Loads NVRTC from `path`.
    pub fn open(path: &Path) -> Result<Nvrtc, GpuError> {
        let lib = libs::load(path)?;
        fn sym<T: Copy>(lib: &libloading::Library, path: &Path, name: &'static str) -> Result<T, GpuError> {
            let c = format!("{name}\0");
            // SAFETY: each `T` below is the C signature NVRTC documents for `name`; the
            // pointer is copied out and used only while `Nvrtc` (which owns `lib`) lives.
            unsafe { lib.get::<T>(c.as_bytes()) }
                .map(|s| *s)
                .map_err(|_| GpuError::NvrtcSymbol {
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
            cubin: sym(&lib, path, "nvrtcGetCUBINSize")
                .ok()
                .zip(sym(&lib, path, "nvrtcGetCUBIN").ok()),
            _lib: lib,
        })
    }

    /// The library's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// NVRTC's `(major, minor)` version.
    pub fn version(&self) -> Result<(i32, i32), GpuError> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out-pointers.
        let code = unsafe { (self.version)(&mut a, &mut b) };
        if code != 0 {
            return Err(GpuError::NvrtcCall {
                name: "nvrtcVersion",
                code,
            });
        }
        Ok((a, b))
    }

    /// Compiles `src` (named `name` in messages) to PTX for virtual architecture `arch`
    /// (`"compute_80"`), which the driver then compiles for the GPU it runs on.
    pub fn compile(&self, src: &str, name: &str, arch: &str) -> Result<CString, GpuError> {
        let ptx = self.build(src, name, arch, |prog| self.read(prog, self.ptx_size, self.ptx, "PTX"))?;
        CString::new(ptx.trim_end_matches('\0')).map_err(|_| GpuError::NvrtcCompile {
            log: "the PTX contains a NUL byte".into(),
        })
    }

    /// Compiles `src` to a cubin for real architecture `arch` (`"sm_90"`): machine code the
    /// driver loads as it is, with no JIT, whatever PTX version the driver accepts.
    pub fn compile_cubin(&self, src: &str, name: &str, arch: &str) -> Result<Vec<u8>, GpuError> {
        let Some((size, get)) = self.cubin else {
            return Err(GpuError::NvrtcSymbol {
                path: self.path.clone(),
                name: "nvrtcGetCUBIN",
            });
        };
        self.build(src, name, arch, |prog| {
            let mut n = 0usize;
            // SAFETY: a live program and a valid out-pointer.
            let code = unsafe { size(prog, &mut n) };
            if code != 0 {
                return Err(GpuError::NvrtcCall {
                    name: "nvrtcGetCUBINSize",
                    code,
                });
            }
            let mut buf = vec![0u8; n];
            // SAFETY: `buf` holds the `n` bytes NVRTC said it will write.
            let code = unsafe { get(prog, buf.as_mut_ptr().cast()) };
            if code != 0 {
                return Err(GpuError::NvrtcCall {
                    name: "nvrtcGetCUBIN",
                    code,
                });
            }
            Ok(buf)
        })
    }

    /// Creates, compiles for `--gpu-architecture=arch`, reads the result with `out`, and
    /// destroys the program on every path.
    fn build<T>(
        &self,
        src: &str,
        name: &str,
        arch: &str,
        out: impl FnOnce(Prog) -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        let c_src = CString::new(src).map_err(|_| GpuError::NvrtcCompile {
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
                Err(GpuError::NvrtcCall { name, code })
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
                return Err(GpuError::NvrtcCompile {
                    log: self.read(prog, self.log_size, self.log, "log").unwrap_or_default(),
                });
            }
            out(prog)
        })();
        // SAFETY: `prog` was created above and is destroyed once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn read(&self, prog: Prog, size: SizeFn, get: GetFn, what: &'static str) -> Result<String, GpuError> {
        let mut n = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        let code = unsafe { size(prog, &mut n) };
        if code != 0 {
            return Err(GpuError::NvrtcCall { name: what, code });
        }
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it will write.
        let code = unsafe { get(prog, buf.as_mut_ptr().cast()) };
        if code != 0 {
            return Err(GpuError::NvrtcCall { name: what, code });
        }
        Ok(CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| String::from_utf8_lossy(&buf).into_owned()))
    }
}

/// What a kernel is compiled to for one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Machine code for a real architecture (`sm_90`): loaded as it is, no JIT.
    Cubin(String),
    /// PTX for a virtual architecture (`compute_90`), which the driver compiles at load.
    Ptx(String),
}

/// The targets to try, in order, for a GPU of compute capability `cc`, given NVRTC's version
/// and the driver's (`cuDriverGetVersion`: 1000 × major + 10 × minor). A cubin for the device
/// first. PTX only as a fallback, and only when NVRTC is no newer than the driver: a newer
/// NVRTC writes a PTX version the driver refuses (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`),
/// as CUDA 13.1's NVRTC would under driver 580 (CUDA 13.0).
pub fn targets(cc: (i32, i32), nvrtc: (i32, i32), driver: i32) -> Vec<Target> {
    let mut v = vec![Target::Cubin(format!("sm_{}{}", cc.0, cc.1))];
    let drv = (driver / 1000, (driver % 1000) / 10);
    if nvrtc <= drv {
        v.push(Target::Ptx(format!("compute_{}{}", cc.0, cc.1)));
    }
    v
}

/// A compiled kernel, ready for `cuModuleLoadData`.
#[derive(Debug)]
pub enum Compiled {
    /// An ELF cubin.
    Cubin(Vec<u8>),
    /// NUL-terminated PTX text.
    Ptx(CString),
}

impl Compiled {
    /// The image `cuModuleLoadData` takes (valid while `self` lives).
    pub fn image(&self) -> *const std::ffi::c_void {
        match self {
            Compiled::Cubin(b) => b.as_ptr().cast(),
            Compiled::Ptx(p) => p.as_ptr().cast(),
        }
    }
}

/// Where compiled cubins are kept between processes: `RAMJET_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/ramjet/kernels`, else `~/.cache/ramjet/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("RAMJET_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ramjet/kernels"))
}

/// FNV-1a, 64 bits: a stable name for a source text (the cache's key; not a checksum).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The cache file of `src` compiled for `arch` by NVRTC `version`.
pub fn cache_file(dir: &Path, src: &str, arch: &str, version: (i32, i32)) -> PathBuf {
    dir.join(format!(
        "{:016x}-{arch}-nvrtc{}.{}.cubin",
        fnv1a(src.as_bytes()),
        version.0,
        version.1
    ))
}

/// Compiles `src` for the first of [`targets`] that works, and returns it with the target it
/// was built for. A cubin is read from, or written to, `cache` when given (an unreadable or
/// damaged cache file is compiled again and replaced; a cache that cannot be written costs
/// only the next process's compile). Without a cubin, and without a PTX that this driver can
/// load, the error says both.
pub fn compile_for_device(
    nvrtc: &Nvrtc,
    src: &str,
    name: &str,
    cc: (i32, i32),
    driver: i32,
    cache: Option<&Path>,
) -> Result<(Compiled, Target), GpuError> {
    let version = nvrtc.version()?;
    let mut errors = Vec::new();
    for t in targets(cc, version, driver) {
        match &t {
            Target::Cubin(arch) => {
                let file = cache.map(|d| cache_file(d, src, arch, version));
                if let Some(b) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
                    if b.len() > 64 && b.starts_with(b"\x7fELF") {
                        return Ok((Compiled::Cubin(b), t));
                    }
                }
                match nvrtc.compile_cubin(src, name, arch) {
                    Ok(b) => {
                        if let (Some(f), Some(d)) = (&file, cache) {
                            let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                            let written = std::fs::create_dir_all(d)
                                .and_then(|_| std::fs::write(&tmp, &b))
                                .and_then(|_| std::fs::rename(&tmp, f));
                            if written.is_err() {
                                let _ = std::fs::remove_file(&tmp);
                            }
                        }
                        return Ok((Compiled::Cubin(b), t));
                    }
                    Err(e) => errors.push(format!("{arch}: {e}")),
                }
            }
            Target::Ptx(arch) => match nvrtc.compile(src, name, arch) {
                Ok(p) => return Ok((Compiled::Ptx(p), t)),
                Err(e) => errors.push(format!("{arch}: {e}")),
            },
        }
    }
    let drv = (driver / 1000, (driver % 1000) / 10);
    if version > drv {
        errors.push(format!(
            "no PTX fallback: NVRTC {}.{} is newer than the driver's CUDA {}.{}, whose JIT would refuse its PTX",
            version.0, version.1, drv.0, drv.1
        ));
    }
    Err(GpuError::NvrtcCompile { log: errors.join("\n") })
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
        for entry in [crate::kernel::KERNEL_NAME, crate::kernel::WEIGHTS_NAME] {
            assert!(ptx.contains(&format!(".entry {entry}")), "{entry} missing:\n{ptx}");
        }
        // The conversions the reference mirrors are the rounding ones, and nothing was fused.
        assert!(ptx.contains("cvt.rn.f16.f32") && ptx.contains("cvt.rn.bf16.f32"));
        assert!(
            !ptx.contains("fma.rn.f32"),
            "a multiply-add was fused: the reference would differ"
        );
    }

    /// Issue 40, item 1: a cubin for the device's own architecture (no JIT, no PTX version
    /// for the driver to refuse), compiled here with the real NVRTC (no GPU needed), for the
    /// lent machines' Hopper (sm_90) and for sm_80.
    #[test]
    fn the_fused_kernel_compiles_to_a_cubin_for_the_device_architecture() {
        let nvrtc = Nvrtc::find(&search()).unwrap_or_else(|e| panic!("{e}"));
        for arch in ["sm_90", "sm_80"] {
            let b = nvrtc
                .compile_cubin(crate::kernel::KERNEL_SRC, "ramjet_fused.cu", arch)
                .unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert!(b.starts_with(b"\x7fELF") && b.len() > 1024, "{arch}: not an ELF cubin");
            for name in [crate::kernel::KERNEL_NAME, crate::kernel::WEIGHTS_NAME] {
                assert!(
                    b.windows(name.len()).any(|w| w == name.as_bytes()),
                    "{arch}: the symbol {name} is missing"
                );
            }
        }
    }

    #[test]
    fn ptx_is_a_fallback_only_when_nvrtc_is_no_newer_than_the_driver() {
        let cubin = Target::Cubin("sm_90".into());
        let ptx = Target::Ptx("compute_90".into());
        // Driver 580 = CUDA 13.0 (13000).
        assert_eq!(targets((9, 0), (13, 0), 13000), vec![cubin.clone(), ptx.clone()]);
        assert_eq!(targets((9, 0), (12, 8), 13000), vec![cubin.clone(), ptx]);
        assert_eq!(
            targets((9, 0), (13, 1), 13000),
            vec![cubin],
            "a newer NVRTC's PTX would be refused"
        );
        assert_eq!(targets((8, 6), (13, 0), 13020)[0], Target::Cubin("sm_86".into()));
    }

    /// The cubin is cached per (source, architecture, NVRTC version): a second compile reads
    /// the file; a damaged file is compiled again and replaced; another source or architecture
    /// has its own file.
    #[test]
    fn cubins_are_cached_by_source_architecture_and_nvrtc_version() {
        let nvrtc = Nvrtc::find(&search()).unwrap_or_else(|e| panic!("{e}"));
        let version = nvrtc.version().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let src = crate::kernel::KERNEL_SRC;
        let (first, t) = compile_for_device(&nvrtc, src, "k.cu", (9, 0), 13000, Some(dir.path())).unwrap();
        assert_eq!(t, Target::Cubin("sm_90".into()));
        let file = cache_file(dir.path(), src, "sm_90", version);
        let Compiled::Cubin(bytes) = first else {
            panic!("not a cubin")
        };
        assert_eq!(std::fs::read(&file).unwrap(), bytes, "written to the cache");
        // Read back without NVRTC's work: a marked file comes back as it is.
        let mut marked = bytes.clone();
        let last = marked.len() - 1;
        marked[last] ^= 0x5a;
        std::fs::write(&file, &marked).unwrap();
        let (again, _) = compile_for_device(&nvrtc, src, "k.cu", (9, 0), 13000, Some(dir.path())).unwrap();
        assert!(
            matches!(again, Compiled::Cubin(b) if b == marked),
            "the cached file is used"
        );
        // A damaged file (not ELF) is compiled again and replaced.
        std::fs::write(&file, b"garbage").unwrap();
        let (fixed, _) = compile_for_device(&nvrtc, src, "k.cu", (9, 0), 13000, Some(dir.path())).unwrap();
        assert!(matches!(fixed, Compiled::Cubin(b) if b == bytes));
        assert_eq!(std::fs::read(&file).unwrap(), bytes);
        assert_ne!(file, cache_file(dir.path(), src, "sm_80", version));
        assert_ne!(file, cache_file(dir.path(), "other source", "sm_90", version));
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
        match Nvrtc::open(crate::libs::system_libc()) {
            Err(GpuError::NvrtcSymbol { name, .. }) => assert_eq!(name, "nvrtcCreateProgram"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("libc was taken for NVRTC"),
        }
        let fake = dir.path().join("libnvrtc.so.13");
        std::fs::write(&fake, b"no").unwrap();
        assert!(matches!(Nvrtc::open(&fake), Err(GpuError::LibraryLoad { .. })));
    }
}
