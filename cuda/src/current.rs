//! The calling thread's current CUDA context, borrowed and given back (issue 40, item 4).
//!
//! A driver call works on the thread's current context, and ramjet's calls run on the
//! caller's threads too (the Python thread that iterates the loader, the trainer's). cudarc's
//! `bind_to_thread` makes ramjet's context current and leaves it so: on a host with several
//! GPUs, with `device` from `LOCAL_RANK`, torch's current device on that thread would change
//! under the trainer. Every driver call of this crate instead runs inside a [`Borrowed`]:
//! the context that was current is saved, ours is made current only if it is not already,
//! and the saved one is put back when the guard drops, on every path out (errors and panics
//! too).
//!
//! The guard's logic is generic over [`ContextApi`], so it is tested here against a fake
//! thread-current slot; [`Driver`] is the real one (`cuCtxGetCurrent` / `cuCtxSetCurrent`).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::{driver_err, GpuError};

/// Reading and setting the calling thread's current context.
pub trait ContextApi {
    /// A context handle.
    type Ctx: Copy + PartialEq + std::fmt::Debug;
    /// The thread's current context, if any.
    fn current(&self) -> Result<Option<Self::Ctx>, GpuError>;
    /// Makes `ctx` current on the thread (`None`: none).
    fn set(&self, ctx: Option<Self::Ctx>) -> Result<(), GpuError>;
}

/// A context made current for a while; the one that was current before comes back on drop.
#[must_use = "the context is current only while the guard lives"]
pub struct Borrowed<'a, A: ContextApi> {
    api: &'a A,
    prev: Option<A::Ctx>,
    changed: bool,
}

impl<'a, A: ContextApi> Borrowed<'a, A> {
    /// Makes `ours` current on the calling thread until the guard drops.
    pub fn enter(api: &'a A, ours: A::Ctx) -> Result<Self, GpuError> {
        let prev = api.current()?;
        if prev == Some(ours) {
            return Ok(Borrowed {
                api,
                prev,
                changed: false,
            });
        }
        api.set(Some(ours))?;
        Ok(Borrowed {
            api,
            prev,
            changed: true,
        })
    }
}

impl<A: ContextApi> Drop for Borrowed<'_, A> {
    fn drop(&mut self) {
        if self.changed {
            if let Err(e) = self.api.set(self.prev) {
                tracing::warn!(error = %e, "could not restore the thread's previous CUDA context");
            }
        }
    }
}

/// The driver's own current-context calls.
pub struct Driver;

/// A `CUcontext` as an address (the handle is opaque; only its identity matters here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawCtx(usize);

impl ContextApi for Driver {
    type Ctx = RawCtx;

    fn current(&self) -> Result<Option<RawCtx>, GpuError> {
        Ok(result::ctx::get_current()
            .map_err(driver_err("reading the thread's current context"))?
            .map(|c| RawCtx(c as usize)))
    }

    fn set(&self, ctx: Option<RawCtx>) -> Result<(), GpuError> {
        let raw = ctx.map_or(std::ptr::null_mut(), |c| c.0 as sys::CUcontext);
        // SAFETY: `raw` is null (no current context) or a context this thread had current a
        // moment ago or that a live `CudaContext` holds (its primary context stays retained
        // while that lives).
        unsafe { result::ctx::set_current(raw) }.map_err(driver_err("setting the thread's current context"))
    }
}

static DRIVER: Driver = Driver;

/// Makes `ctx` current on the calling thread until the guard drops (then the previous one
/// comes back).
pub fn enter(ctx: &Arc<CudaContext>) -> Result<Borrowed<'static, Driver>, GpuError> {
    Borrowed::enter(&DRIVER, RawCtx(ctx.cu_ctx() as usize))
}

/// GPU `ordinal`'s primary context, retained, with the thread's current context left as it was
/// (cudarc's constructor makes the new one current).
pub fn retain_primary(ordinal: usize) -> Result<Arc<CudaContext>, GpuError> {
    let prev = DRIVER.current()?;
    let ctx = CudaContext::new(ordinal).map_err(driver_err("retaining the primary context"));
    DRIVER.set(prev)?;
    ctx
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    /// A thread-current slot and a log of every change.
    #[derive(Default)]
    struct Fake {
        current: Cell<Option<u32>>,
        sets: RefCell<Vec<Option<u32>>>,
        fail_set: Cell<bool>,
    }

    impl ContextApi for Fake {
        type Ctx = u32;
        fn current(&self) -> Result<Option<u32>, GpuError> {
            Ok(self.current.get())
        }
        fn set(&self, ctx: Option<u32>) -> Result<(), GpuError> {
            if self.fail_set.get() {
                return Err(GpuError::Driver {
                    doing: "setting",
                    reason: "refused".into(),
                });
            }
            self.sets.borrow_mut().push(ctx);
            self.current.set(ctx);
            Ok(())
        }
    }

    /// Regression (issue 40, item 4): the context was bound to the caller's thread and never
    /// given back, so torch's current device there changed under the trainer.
    #[test]
    fn the_callers_context_comes_back_on_every_path_out() {
        let f = Fake::default();
        // The trainer's context (torch's cuda:1) is current.
        f.current.set(Some(1));
        {
            let _g = Borrowed::enter(&f, 7).unwrap();
            assert_eq!(f.current.get(), Some(7), "ours is current inside");
        }
        assert_eq!(f.current.get(), Some(1), "the trainer's is back after");
        // On an error path (the guard dropped by `?`) and on a panic.
        let r: Result<(), GpuError> = (|| {
            let _g = Borrowed::enter(&f, 7)?;
            Err(GpuError::NoDevice)
        })();
        assert!(r.is_err());
        assert_eq!(f.current.get(), Some(1));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = Borrowed::enter(&f, 7).unwrap();
            panic!("a failure inside");
        }));
        assert!(caught.is_err());
        assert_eq!(f.current.get(), Some(1));
        // No context current before: none after.
        f.current.set(None);
        drop(Borrowed::enter(&f, 7).unwrap());
        assert_eq!(f.current.get(), None);
    }

    #[test]
    fn nothing_is_set_when_ours_is_already_current_and_nesting_unwinds_in_order() {
        let f = Fake::default();
        f.current.set(Some(7));
        drop(Borrowed::enter(&f, 7).unwrap());
        assert!(f.sets.borrow().is_empty(), "no driver call when ours is current");
        f.current.set(Some(1));
        {
            let _a = Borrowed::enter(&f, 7).unwrap();
            {
                let _b = Borrowed::enter(&f, 9).unwrap();
                assert_eq!(f.current.get(), Some(9));
            }
            assert_eq!(f.current.get(), Some(7));
        }
        assert_eq!(f.current.get(), Some(1));
        assert_eq!(*f.sets.borrow(), vec![Some(7), Some(9), Some(7), Some(1)]);
    }

    #[test]
    fn a_context_that_cannot_be_made_current_is_an_error_and_changes_nothing() {
        let f = Fake::default();
        f.current.set(Some(1));
        f.fail_set.set(true);
        assert!(Borrowed::enter(&f, 7).is_err());
        assert_eq!(f.current.get(), Some(1));
    }

    /// Issue 68, defect 1: the only Rust kernel test read its results back with a raw
    /// `cuMemcpyDtoH_v2` on a thread with no current context (every guard restores the empty
    /// one), so on a real GPU it failed at its first readback. Every driver copy in the crate
    /// and its GPU tests must run inside a function that entered the context first
    /// (`current::enter`), or go through `Gpu::copy_to_host`.
    #[test]
    fn every_driver_copy_runs_with_a_current_context() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files: Vec<std::path::PathBuf> = Vec::new();
        let mut dirs = vec![root.join("src"), root.join("../tests/tests")];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
        // Spelt in two parts, so this test's own text is not one of the copies it finds.
        let needle = ["sys::", "cuMemcpy"].concat();
        let mut copies = 0;
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (n, l) in lines.iter().enumerate() {
                if !l.contains(&needle) || l.trim_start().starts_with("//") {
                    continue;
                }
                copies += 1;
                // Back to the start of the enclosing function: an `enter` on the way.
                let entered = lines[..n]
                    .iter()
                    .rev()
                    .take_while(|b| {
                        !b.trim_start().starts_with("pub fn ")
                            && !b.trim_start().starts_with("fn ")
                            && !b.contains(" fn ")
                    })
                    .any(|b| b.contains("current::enter("));
                assert!(
                    entered,
                    "{}:{}: a driver copy with no `current::enter` before it in its function (use Gpu::copy_to_host)",
                    f.display(),
                    n + 1
                );
            }
        }
        assert!(
            copies >= 5,
            "the scan found {copies} driver copies: it no longer sees the code"
        );
    }
}
