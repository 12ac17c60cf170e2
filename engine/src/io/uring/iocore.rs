//! The process's I/O core: a fixed set of named threads, each owning one io_uring ring, and
//! the routing of a request to one of them.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::ring::Ring;

/// A job for an I/O core thread: it runs on that thread's ring slot. It owns everything it
/// touches (the file, the destination or the data to write), so no borrow crosses threads.
pub(super) type RingJob = Box<dyn FnOnce(&mut Option<Ring>) + Send + 'static>;

/// The process's I/O core: `RAMJET_IO_THREADS` threads (default: the cores), named
/// `ramjet-io-N`, each owning one ring and its registered buffers. A request goes to the ring
/// its key (the cache file) hashes to, through that thread's own queue, so no lock is shared
/// between rings and one file's chunks are always on one ring.
pub(super) struct IoCore {
    pub(super) lanes: Vec<Lane>,
}

/// One I/O thread's queue, and how many jobs are queued on it or running there.
pub(super) struct Lane {
    pub(super) queue: std::sync::mpsc::Sender<RingJob>,
    load: AtomicUsize,
}

impl IoCore {
    /// The lane for a request keyed `key`: the one its key names, unless that one is busy and
    /// another is less loaded (then the least loaded, the first of equals). One file's request
    /// is one job, so its chunks always share one ring; routing by key alone left a warm epoch
    /// of 6 shards on 2 rings split 4:2 about half the time, one core idle while the other
    /// read (docs/benchmarks-history.md, "Engine core"). Reading the loads takes no lock.
    fn lane(&self, key: u64) -> &Lane {
        let home = &self.lanes[(key % self.lanes.len() as u64) as usize];
        if home.load.load(Ordering::Relaxed) == 0 {
            return home;
        }
        self.lanes
            .iter()
            .min_by_key(|l| l.load.load(Ordering::Relaxed))
            .filter(|l| l.load.load(Ordering::Relaxed) < home.load.load(Ordering::Relaxed))
            .unwrap_or(home)
    }
}

static CORE: crate::rt::PerProcess<IoCore> = crate::rt::PerProcess::new();

/// Threads of the I/O core.
pub fn io_threads() -> usize {
    std::env::var("RAMJET_IO_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(crate::rt::cores)
}

impl IoCore {
    pub(super) fn new(threads: usize) -> crate::Result<IoCore> {
        let mut lanes = Vec::with_capacity(threads);
        for i in 0..threads {
            let (tx, rx) = std::sync::mpsc::channel::<RingJob>();
            std::thread::Builder::new()
                .name(format!("ramjet-io-{i}"))
                .spawn(move || {
                    let mut slot: Option<Ring> = None;
                    while let Ok(job) = rx.recv() {
                        job(&mut slot);
                    }
                })
                .map_err(|e| crate::Error::io("I/O core thread", e))?;
            lanes.push(Lane {
                queue: tx,
                load: AtomicUsize::new(0),
            });
        }
        Ok(IoCore { lanes })
    }
}

/// Runs `f` on the ring of the I/O core thread that `key` routes to (the ring is made on first
/// use; a ring left stuck is leaked, never dropped, and the next request there makes a fresh
/// one). The caller waits for the result; `f` owns what it reads into or writes from, and
/// leaks it itself when it leaves the ring stuck.
pub(super) fn with_ring<T: Send + 'static>(
    key: u64,
    f: impl FnOnce(&mut Ring) -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let core = CORE.get(|| IoCore::new(io_threads())).map_err(io::Error::other)?;
    with_ring_on(core, key, f)
}

/// [`with_ring`] on a given core (the process's, or a test's own).
pub(super) fn with_ring_on<T: Send + 'static>(
    core: &IoCore,
    key: u64,
    f: impl FnOnce(&mut Ring) -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<std::thread::Result<io::Result<T>>>(1);
    let job: RingJob = Box::new(move |slot: &mut Option<Ring>| {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_in_slot(slot, Ring::new, f)));
        let _ = tx.send(r);
    });
    let lane = core.lane(key);
    lane.load.fetch_add(1, Ordering::Relaxed);
    let sent = lane.queue.send(job).is_ok();
    if !sent {
        lane.load.fetch_sub(1, Ordering::Relaxed);
        return Err(io::Error::other("the I/O core thread has ended"));
    }
    let got = rx.recv();
    lane.load.fetch_sub(1, Ordering::Relaxed);
    match got {
        Ok(Ok(r)) => r,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(io::Error::other("the I/O core thread has ended")),
    }
}

/// Runs `f` on the ring in `slot`, made on first use; a ring left stuck is leaked, never
/// dropped, and the next call makes a fresh one.
pub(super) fn run_in_slot<T>(
    slot: &mut Option<Ring>,
    make: fn() -> io::Result<Ring>,
    f: impl FnOnce(&mut Ring) -> io::Result<T>,
) -> io::Result<T> {
    if slot.is_none() {
        *slot = Some(make()?);
    }
    let ring = slot.as_mut().expect("ring just created");
    let r = f(ring);
    if ring.stuck {
        std::mem::forget(slot.take());
    }
    r
}
