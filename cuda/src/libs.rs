//! Finding and loading the CUDA user libraries ramjet needs beyond the driver (nvJPEG, NVRTC,
//! cuFile), by absolute path.
//!
//! cudarc loads libraries by fixed names through the dynamic linker, which misses the copies
//! that PyPI wheels ship inside the Python environment (`site-packages/nvidia/nvjpeg/lib/` for
//! CUDA 12, `site-packages/nvidia/cu13/lib/` for CUDA 13). So each library is looked for in
//! this order, and the first match wins:
//!
//! 1. its environment variable (`RAMJET_NVJPEG`, `RAMJET_NVRTC`, `RAMJET_CUFILE`): the file, or
//!    a folder holding it. When set, it must lead to the library: it is never passed over;
//! 2. the Python environment's `nvidia/*/lib` folders, under each site-packages folder given
//!    (the Python package passes its `sys.path`; `$VIRTUAL_ENV/lib/python*/site-packages`
//!    otherwise);
//! 3. the system: `LD_LIBRARY_PATH`, `$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`, and the
//!    distribution's library folders.
//!
//! Within each place, a newer major version comes first (`.so.13` before `.so.12`).

use crate::GpuError;
use std::path::{Path, PathBuf};

/// A CUDA user library ramjet loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lib {
    /// nvJPEG: batched JPEG decode on the GPU.
    Nvjpeg,
    /// NVRTC: compiles the fused augmentation kernel at run time.
    Nvrtc,
    /// cuFile (GPUDirect Storage): NVMe to GPU memory.
    Cufile,
}

impl Lib {
    /// Every library, in a fixed order.
    pub const ALL: [Lib; 3] = [Lib::Nvjpeg, Lib::Nvrtc, Lib::Cufile];

    /// Its short name.
    pub fn name(self) -> &'static str {
        match self {
            Lib::Nvjpeg => "nvjpeg",
            Lib::Nvrtc => "nvrtc",
            Lib::Cufile => "cufile",
        }
    }

    /// The environment variable that names its file or folder.
    pub fn env_var(self) -> &'static str {
        match self {
            Lib::Nvjpeg => "RAMJET_NVJPEG",
            Lib::Nvrtc => "RAMJET_NVRTC",
            Lib::Cufile => "RAMJET_CUFILE",
        }
    }

    /// File names it goes by, the preferred first.
    pub fn file_names(self) -> &'static [&'static str] {
        match self {
            Lib::Nvjpeg => &["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so"],
            Lib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
            Lib::Cufile => &["libcufile.so.0", "libcufile.so"],
        }
    }

    /// How to install it.
    pub fn install_hint(self) -> &'static str {
        match self {
            Lib::Nvjpeg => "pip install 'ramjet[cuda]' (the nvidia-nvjpeg wheel; CUDA 12: nvidia-nvjpeg-cu12)",
            Lib::Nvrtc => "it comes with torch's CUDA wheels (nvidia-cuda-nvrtc)",
            Lib::Cufile => "it comes with torch's CUDA wheels (nvidia-cufile)",
        }
    }
}

/// Where a library was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Its environment variable.
    Env,
    /// A wheel in the Python environment.
    Python,
    /// A system folder.
    System,
}

/// A library found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Which library.
    pub lib: Lib,
    /// Its absolute path.
    pub path: PathBuf,
    /// Which step of the search found it.
    pub origin: Origin,
}

/// Where to look: the settings a search runs with, taken from the environment by
/// [`Search::from_env`] or given whole (tests).
#[derive(Debug, Clone, Default)]
pub struct Search {
    /// Each library's environment variable's value, where set.
    pub env: Vec<(Lib, String)>,
    /// site-packages folders of the Python environment.
    pub python_roots: Vec<PathBuf>,
    /// System folders, in order.
    pub system_dirs: Vec<PathBuf>,
}

impl Search {
    /// The process's settings: the libraries' variables, the given site-packages folders
    /// (plus `$VIRTUAL_ENV`'s), and the system folders.
    pub fn from_env(python_roots: &[PathBuf]) -> Search {
        let env = Lib::ALL
            .iter()
            .filter_map(|&l| std::env::var(l.env_var()).ok().map(|v| (l, v)))
            .filter(|(_, v)| !v.trim().is_empty())
            .collect();
        let mut roots: Vec<PathBuf> = python_roots.to_vec();
        if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
            roots.extend(site_packages(Path::new(&venv)));
        }
        let mut system: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
            .map(|v| std::env::split_paths(&v).collect())
            .unwrap_or_default();
        if let Some(home) = std::env::var_os("CUDA_HOME") {
            system.push(Path::new(&home).join("lib64"));
        }
        system.extend(
            [
                "/usr/local/cuda/lib64",
                "/usr/local/nvidia/lib64",
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu",
                "/usr/lib64",
                "/usr/lib",
            ]
            .map(PathBuf::from),
        );
        Search {
            env,
            python_roots: roots,
            system_dirs: system,
        }
    }

    /// The library's file, or why there is none (see the module's search order).
    pub fn find(&self, lib: Lib) -> Result<Found, GpuError> {
        if let Some((_, value)) = self.env.iter().find(|(l, _)| *l == lib) {
            let p = Path::new(value);
            let hit = if p.is_dir() {
                in_dir(p, lib)
            } else {
                p.is_file().then(|| p.to_path_buf())
            };
            return match hit {
                Some(path) => Ok(Found {
                    lib,
                    path: absolute(path),
                    origin: Origin::Env,
                }),
                None => Err(GpuError::LibraryEnv {
                    lib,
                    value: value.clone(),
                }),
            };
        }
        let mut looked_in = Vec::new();
        for root in &self.python_roots {
            let dirs = subdirs(&root.join("nvidia"), "lib");
            // The preferred name first across every wheel folder: a CUDA 13 wheel beats a
            // CUDA 12 one installed beside it.
            for name in lib.file_names() {
                if let Some(d) = dirs.iter().find(|d| d.join(name).is_file()) {
                    return Ok(Found {
                        lib,
                        path: absolute(d.join(name)),
                        origin: Origin::Python,
                    });
                }
            }
            looked_in.push(root.join("nvidia/*/lib"));
        }
        for dir in &self.system_dirs {
            if let Some(path) = in_dir(dir, lib) {
                return Ok(Found {
                    lib,
                    path: absolute(path),
                    origin: Origin::System,
                });
            }
            looked_in.push(dir.clone());
        }
        Err(GpuError::LibraryNotFound { lib, looked_in })
    }
}

/// The folders `parent/*/child` that exist, sorted (none when `parent` cannot be read).
/// The site-packages folders of the Python environment at `venv` (`lib/python*/site-packages`).
pub fn site_packages(venv: &Path) -> Vec<PathBuf> {
    subdirs(&venv.join("lib"), "site-packages")
}

fn subdirs(parent: &Path, child: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(parent)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join(child))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// The library's preferred file in `dir`.
fn in_dir(dir: &Path, lib: Lib) -> Option<PathBuf> {
    lib.file_names().iter().map(|n| dir.join(n)).find(|p| p.is_file())
}

fn absolute(p: PathBuf) -> PathBuf {
    std::fs::canonicalize(&p).unwrap_or(p)
}

/// Loads a library by its absolute path (never by name through the linker's search).
pub fn load(path: &Path) -> Result<libloading::Library, GpuError> {
    // SAFETY: loading a shared library runs its initialisers. The CUDA libraries' have no
    // preconditions on the caller; a file that is no library is refused by the loader with an
    // error, which is returned.
    unsafe { libloading::Library::new(path) }.map_err(|e| GpuError::LibraryLoad {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// The C library, by absolute path: a real shared library that is none of CUDA's (the
/// loaders' tests refuse it by its missing symbols).
#[cfg(test)]
pub(crate) fn system_libc() -> &'static Path {
    [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/aarch64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
    ]
    .into_iter()
    .map(Path::new)
    .find(|p| p.is_file())
    .expect("a libc.so.6 in a standard folder")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"not really a library").unwrap();
    }

    fn search(env: &[(Lib, &Path)], roots: &[&Path], system: &[&Path]) -> Search {
        Search {
            env: env.iter().map(|(l, p)| (*l, p.display().to_string())).collect(),
            python_roots: roots.iter().map(|p| p.to_path_buf()).collect(),
            system_dirs: system.iter().map(|p| p.to_path_buf()).collect(),
        }
    }

    #[test]
    fn env_then_python_wheels_then_system() {
        let t = tempfile::tempdir().unwrap();
        let site = t.path().join("site-packages");
        let sys = t.path().join("usr/lib");
        let own = t.path().join("mine/libnvjpeg.so.12");
        touch(&site.join("nvidia/nvjpeg/lib/libnvjpeg.so.12"));
        touch(&sys.join("libnvjpeg.so.12"));
        touch(&own);

        let all = search(&[(Lib::Nvjpeg, &own)], &[&site], &[&sys]);
        let f = all.find(Lib::Nvjpeg).unwrap();
        assert_eq!((f.origin, f.path.clone()), (Origin::Env, own.canonicalize().unwrap()));
        // The variable may name the folder.
        let folder = search(&[(Lib::Nvjpeg, own.parent().unwrap())], &[&site], &[&sys]);
        assert_eq!(folder.find(Lib::Nvjpeg).unwrap().path, own.canonicalize().unwrap());

        let no_env = search(&[], &[&site], &[&sys]);
        let f = no_env.find(Lib::Nvjpeg).unwrap();
        assert_eq!(f.origin, Origin::Python);
        assert!(f.path.ends_with("nvidia/nvjpeg/lib/libnvjpeg.so.12"), "{f:?}");

        let system_only = search(&[], &[&t.path().join("empty-site")], &[&sys]);
        let f = system_only.find(Lib::Nvjpeg).unwrap();
        assert_eq!(f.origin, Origin::System);
        assert_eq!(f.path, sys.join("libnvjpeg.so.12").canonicalize().unwrap());
    }

    #[test]
    fn a_cuda_13_wheel_comes_before_a_cuda_12_one() {
        let t = tempfile::tempdir().unwrap();
        let site = t.path();
        // The layouts the wheels really have (nvidia-nvjpeg 13.x, nvidia-nvjpeg-cu12 12.x).
        touch(&site.join("nvidia/nvjpeg/lib/libnvjpeg.so.12"));
        touch(&site.join("nvidia/cu13/lib/libnvjpeg.so.13"));
        touch(&site.join("nvidia/cu13/lib/libcufile.so.0"));
        // A folder that sorts before cu13 with the older library: the name decides, not the
        // folder's place.
        touch(&site.join("nvidia/cu12/lib/libnvjpeg.so.12"));
        let s = search(&[], &[site], &[]);
        assert!(s
            .find(Lib::Nvjpeg)
            .unwrap()
            .path
            .ends_with("nvidia/cu13/lib/libnvjpeg.so.13"));
        assert!(s
            .find(Lib::Cufile)
            .unwrap()
            .path
            .ends_with("nvidia/cu13/lib/libcufile.so.0"));
    }

    #[test]
    fn a_variable_that_leads_nowhere_is_an_error_not_passed_over() {
        let t = tempfile::tempdir().unwrap();
        touch(&t.path().join("nvidia/cu13/lib/libnvrtc.so.13"));
        let missing = t.path().join("no/such/libnvrtc.so.13");
        let s = search(&[(Lib::Nvrtc, &missing)], &[t.path()], &[]);
        let e = s.find(Lib::Nvrtc).unwrap_err();
        assert!(matches!(e, GpuError::LibraryEnv { lib: Lib::Nvrtc, .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("RAMJET_NVRTC") && msg.contains("no/such/libnvrtc.so.13"),
            "{msg}"
        );
    }

    #[test]
    fn not_found_names_every_place_and_the_way_to_install() {
        let t = tempfile::tempdir().unwrap();
        let (site, sys) = (t.path().join("site"), t.path().join("sys"));
        let e = search(&[], &[&site], &[&sys]).find(Lib::Nvjpeg).unwrap_err();
        let msg = e.to_string();
        for needle in [
            "libnvjpeg.so.13 or libnvjpeg.so.12",
            "RAMJET_NVJPEG",
            "site/nvidia/*/lib",
            "sys",
            "ramjet[cuda]",
        ] {
            assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
        }
    }

    #[test]
    fn loading_by_path_refuses_a_file_that_is_no_library_and_takes_a_real_one() {
        let t = tempfile::tempdir().unwrap();
        let fake = t.path().join("libnvjpeg.so.13");
        touch(&fake);
        let e = load(&fake).unwrap_err();
        assert!(e.to_string().contains(&fake.display().to_string()), "{e}");
        // A real shared library by absolute path: the C library this test runs with.
        load(system_libc()).expect("libc loads by path");
    }
}
