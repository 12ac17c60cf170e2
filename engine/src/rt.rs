//! The process's fixed thread set: one tokio runtime for network I/O and one decode pool,
//! each made on first use, shared by every stream, loader and binding call, and remade in a
//! forked child (whose copy has no threads).
//!
//! Thread budget (every thread carries a `ramjet-` name):
//!
//! | Threads | Name | Count (default) | Set by |
//! |---|---|---|---|
//! | network runtime workers | `ramjet-net` | min(cores, 2) | `RAMJET_NET_THREADS` |
//! | runtime blocking pool (verification, cache opens, host-daemon calls) | `ramjet-net` | at most [`BLOCKING_THREADS_MAX`], idle ones exit | fixed |
//! | decode pool | `ramjet-decode-N` | at most cores, started on demand | `RAMJET_DECODE_THREADS` |
//! | I/O core rings (`io::uring`) | `ramjet-io-N` | cores | `RAMJET_IO_THREADS` |
//! | cache writers ([`crate::cache::Filler`]) | `ramjet-cache-fill-N` | 2 | fixed |
//!
//! so with the defaults a process holds at most 2 x cores + 8 of them, however many datasets it
//! has open.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

use crate::error::{Error, Result};

/// Most threads in the runtime's blocking pool (it starts them on demand; idle ones exit
/// after ten seconds).
pub const BLOCKING_THREADS_MAX: usize = 4;

/// Most network runtime workers by default.
pub const NET_THREADS_DEFAULT_MAX: usize = 2;

/// The cores this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn env_threads(name: &str) -> Option<usize> {
    std::env::var(name)
        .ok()?
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
}

/// Something made once per process and remade in a forked child.
pub(crate) struct PerProcess<T: 'static> {
    ptr: AtomicPtr<(u32, T)>,
}

impl<T: 'static> PerProcess<T> {
    pub(crate) const fn new() -> Self {
        PerProcess {
            ptr: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// This process's value, made with `make` on first use (and first use after a fork).
    /// A value left by the parent is leaked, never dropped: its threads do not exist here, and
    /// dropping it would wait for them.
    pub(crate) fn get(&'static self, make: impl FnOnce() -> Result<T>) -> Result<&'static T> {
        let pid = std::process::id();
        let cur = self.ptr.load(Ordering::Acquire);
        // SAFETY: a non-null pointer was made by Box::into_raw below and is never freed.
        if let Some(e) = unsafe { cur.as_ref() } {
            if e.0 == pid {
                return Ok(&e.1);
            }
        }
        let fresh = Box::into_raw(Box::new((pid, make()?)));
        match self
            .ptr
            .compare_exchange(cur, fresh, Ordering::AcqRel, Ordering::Acquire)
        {
            // SAFETY: `fresh` was just made by Box::into_raw and is now published, never freed.
            Ok(_) => Ok(unsafe { &(*fresh).1 }),
            Err(won) => {
                // Another thread of this process made one first (a fork copies only the
                // forking thread, so it is this process's): drop ours and use theirs.
                // SAFETY: `fresh` was never published, so this is its only owner.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: a non-null pointer made by Box::into_raw and never freed.
                Ok(unsafe { &(*won).1 })
            }
        }
    }
}

/// Workers asked for by [`prefer_net_threads`] (0: none).
static NET_THREADS_PREFERRED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sizes the network runtime, if it is not made yet (`ramjet serve --threads`). An
/// explicit `RAMJET_NET_THREADS` wins.
pub fn prefer_net_threads(n: usize) {
    NET_THREADS_PREFERRED.store(n, Ordering::Relaxed);
}

static RUNTIME: PerProcess<tokio::runtime::Runtime> = PerProcess::new();
static DECODE: PerProcess<Pool> = PerProcess::new();

/// This process's network runtime.
pub fn handle() -> Result<tokio::runtime::Handle> {
    RUNTIME
        .get(|| {
            let preferred = NET_THREADS_PREFERRED.load(Ordering::Relaxed);
            let workers = env_threads("RAMJET_NET_THREADS")
                .or((preferred > 0).then_some(preferred))
                .unwrap_or_else(|| cores().min(NET_THREADS_DEFAULT_MAX));
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .max_blocking_threads(BLOCKING_THREADS_MAX)
                .thread_name("ramjet-net")
                .enable_all()
                .build()
                .map_err(|e| Error::io("tokio runtime", e))
        })
        .map(|rt| rt.handle().clone())
}

/// Runs `f` to completion on the process runtime, from a thread that is not one of the
/// runtime's workers (a worker calling it would stall its other tasks; tokio panics).
pub fn block_on<F: std::future::Future>(f: F) -> Result<F::Output> {
    Ok(handle()?.block_on(f))
}

type Job = Box<dyn FnOnce() + Send>;

/// A set of at most `max` CPU threads taking jobs in submission order. Threads start on
/// demand (a job queued while none is idle starts one), so a process whose loaders are
/// granted fewer decode jobs than its cores (a rank sharing its host) holds only as many
/// threads as it ever ran jobs at once.
pub struct Pool {
    name: String,
    tx: crossbeam_channel::Sender<Job>,
    rx: crossbeam_channel::Receiver<Job>,
    max: usize,
    started: std::sync::atomic::AtomicUsize,
    idle: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Pool {
    fn new(name: &str, threads: usize) -> Result<Pool> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        Ok(Pool {
            name: name.to_owned(),
            tx,
            rx,
            max: threads.max(1),
            started: Default::default(),
            idle: Default::default(),
        })
    }

    /// Starts one more thread if none is idle and fewer than `max` run.
    fn grow(&self) {
        if self.idle.load(Ordering::Acquire) > 0 {
            return;
        }
        let Ok(i) = self
            .started
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max).then_some(n + 1))
        else {
            return;
        };
        let (rx, idle) = (self.rx.clone(), self.idle.clone());
        let r = std::thread::Builder::new()
            .name(format!("{}-{i}", self.name))
            .spawn(move || loop {
                idle.fetch_add(1, Ordering::AcqRel);
                let job = rx.recv();
                idle.fetch_sub(1, Ordering::AcqRel);
                let Ok(job) = job else { return };
                // A job catches its own panics (the loader reports them in the batch's place); one
                // that escapes must not take the pool thread down.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            });
        if let Err(e) = r {
            self.started.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(error = %e, "could not start a decode thread; the running ones take the job");
        }
    }

    /// Queues a job.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        // The pool holds a receiver for the life of the process.
        let _ = self.tx.send(Box::new(job));
        self.grow();
    }
}

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`: exact, where the rusage times
/// count in scheduler ticks) and its minor and major page faults so far
/// (`getrusage(RUSAGE_THREAD)`); zeros where either fails. For debug events.
pub fn thread_usage() -> (Duration, u64, u64) {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one `timespec` through the pointer, which points to a live
    // local of that type.
    let cpu = if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
        Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32)
    } else {
        Duration::ZERO
    };
    // SAFETY: `rusage` is plain integers, for which all zeros is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one `rusage` through the pointer, which points to a live local
    // of that type.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
        return (cpu, 0, 0);
    }
    (cpu, u.ru_minflt as u64, u.ru_majflt as u64)
}

/// Threads in this process's decode pool: `RAMJET_DECODE_THREADS`, else the cores.
pub fn decode_threads() -> usize {
    env_threads("RAMJET_DECODE_THREADS").unwrap_or_else(cores)
}

/// This process's decode pool (`RAMJET_DECODE_THREADS`, default the cores).
pub fn decode_pool() -> Result<&'static Pool> {
    DECODE.get(|| Pool::new("ramjet-decode", decode_threads()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_runtime_and_one_pool_per_process() {
        let a = handle().unwrap();
        let b = handle().unwrap();
        assert_eq!(a.id(), b.id());
        let p = decode_pool().unwrap() as *const Pool;
        assert_eq!(p, decode_pool().unwrap() as *const Pool);
        let (tx, rx) = std::sync::mpsc::channel();
        decode_pool()
            .unwrap()
            .spawn(move || tx.send(std::thread::current().name().map(String::from)).unwrap());
        assert!(rx.recv().unwrap().unwrap().starts_with("ramjet-decode-"));
        assert_eq!(block_on(async { 7 }).unwrap(), 7);
    }
}
