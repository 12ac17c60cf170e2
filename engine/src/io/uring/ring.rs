//! One thread's io_uring ring: its registered bounce buffers, the destination slot, and the
//! loop that keeps a file's chunks in flight and reaps their completions.

use std::io;

use super::super::{IO_CHUNKS_IN_FLIGHT, IO_CHUNK_BYTES, WRITER_IO_WORKERS_MAX};
use crate::buf::AlignedBuf;

/// The registered-buffer slot that points at the current read's destination.
pub(super) const DEST_SLOT: u16 = IO_CHUNKS_IN_FLIGHT as u16;

/// Faults injected at the ring level, for the tests of its failure paths.
#[derive(Debug, Default)]
pub(super) struct RingFaults {
    /// Fail this many waits with EINTR before calling the kernel.
    pub(super) eintr_waits: u32,
    /// Once this many operations are in flight, fail the next wait with this errno (once).
    pub(super) fail_wait_in_flight: Option<(usize, i32)>,
    /// Report the submission queue full this many times.
    pub(super) sq_full: u32,
    /// Fail every buffer registration with ENOMEM (as RLIMIT_MEMLOCK does for non-root users).
    pub(super) register_enomem: bool,
    /// Run every call at full depth from its first operation, as for a file not in the page
    /// cache (so tests on page-cached files get several operations in flight).
    pub(super) full_depth: bool,
}

/// Attempts to drain operations still in flight after a failed wait before the ring is given
/// up (leaked with every buffer the kernel may write into).
const DRAIN_ATTEMPTS_MAX: u32 = 100;

/// One thread's ring and its buffers.
///
/// Invariant: no method returns while an operation it submitted is in flight, unless it marks
/// the ring `stuck`; a stuck ring is leaked with its buffers (and the caller leaks its
/// destination), so the kernel never writes into memory that was freed or reused.
pub(super) struct Ring {
    ring: io_uring::IoUring,
    bufs: Vec<AlignedBuf>,
    /// Whether the bounce buffers are registered (else operations use plain Read and Write).
    pub(super) registered: bool,
    /// Operations submitted and not yet reaped.
    pub(super) in_flight: usize,
    /// Operations could not be drained: the ring and its buffers must never be freed.
    pub(super) stuck: bool,
    pub(super) faults: RingFaults,
}

impl Ring {
    pub(super) fn new() -> io::Result<Ring> {
        Self::with_faults(RingFaults::default())
    }

    /// A cache writer's ring: the kernel runs its buffered writes on at most
    /// [`WRITER_IO_WORKERS_MAX`] io-wq workers (one file is written at a time, at low priority).
    pub(super) fn for_writer() -> io::Result<Ring> {
        let r = Self::new()?;
        let mut workers = [WRITER_IO_WORKERS_MAX as u32, 1];
        let _ = r.ring.submitter().register_iowq_max_workers(&mut workers);
        Ok(r)
    }

    pub(super) fn with_faults(faults: RingFaults) -> io::Result<Ring> {
        let ring = io_uring::IoUring::new(IO_CHUNKS_IN_FLIGHT as u32 * 2)?;
        // Buffered file I/O the kernel cannot finish inline goes to its io-wq workers (kernel
        // threads named `iou-wrk-*` in this process): at most one per operation in flight, so
        // the process's thread count stays bounded. Older kernels refuse; their default applies.
        let mut workers = [IO_CHUNKS_IN_FLIGHT as u32, 1];
        let _ = ring.submitter().register_iowq_max_workers(&mut workers);
        let mut bufs: Vec<AlignedBuf> = (0..IO_CHUNKS_IN_FLIGHT)
            .map(|_| AlignedBuf::zeroed(IO_CHUNK_BYTES))
            .collect();
        let mut r = Ring {
            ring,
            bufs: Vec::new(),
            registered: false,
            in_flight: 0,
            stuck: false,
            faults,
        };
        // Slots 0..IO_CHUNKS_IN_FLIGHT hold the bounce buffers (writes); slot DEST_SLOT is
        // re-pointed at each read's destination, so reads land in place with one copy.
        // Registration pins memory against RLIMIT_MEMLOCK; where that is refused (ENOMEM for
        // a non-root user with a small limit), the ring runs unregistered operations instead.
        let iovecs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.full_mut().as_mut_ptr().cast(),
                iov_len: IO_CHUNK_BYTES,
            })
            .collect();
        let reg = if r.faults.register_enomem {
            Err(io::Error::from_raw_os_error(libc::ENOMEM))
        } else {
            r.ring
                .submitter()
                .register_buffers_sparse(IO_CHUNKS_IN_FLIGHT as u32 + 1)
                // SAFETY: the buffers live as long as the ring (both owned by this struct; the
                // ring is dropped, unregistering them, before the buffers: fields drop in order).
                .and_then(|()| unsafe { r.ring.submitter().register_buffers_update(0, &iovecs, None) })
        };
        match reg {
            Ok(()) => r.registered = true,
            Err(e) => {
                tracing::info!(error = %e, "io_uring buffer registration refused; using unregistered I/O");
                let _ = r.ring.submitter().unregister_buffers();
            }
        }
        r.bufs = bufs;
        Ok(r)
    }

    /// Points the destination slot at `[ptr, ptr + len)`. False when refused (the caller then
    /// uses unregistered operations).
    ///
    /// # Safety
    /// The memory must stay valid until `clear_dest` has run, and no operation may use the slot
    /// after that.
    pub(super) unsafe fn register_dest(&mut self, ptr: *mut u8, len: usize) -> bool {
        if !self.registered || self.faults.register_enomem || len == 0 {
            return false;
        }
        let dest = [libc::iovec {
            iov_base: ptr.cast(),
            iov_len: len,
        }];
        // SAFETY: forwarded to our caller.
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(DEST_SLOT as u32, &dest, None)
        }
        .is_ok()
    }

    /// Empties the destination slot, releasing the kernel's reference to the memory it held.
    /// A failure marks the ring stuck: its slot may still name memory about to be freed.
    pub(super) fn clear_dest(&mut self) {
        let clear = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }];
        // SAFETY: an empty iovec registers no memory; it only drops the slot's old reference.
        let r = unsafe {
            self.ring
                .submitter()
                .register_buffers_update(DEST_SLOT as u32, &clear, None)
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, "io_uring: clearing the destination slot failed; ring retired");
            self.stuck = true;
        }
    }

    /// Pushes one entry, flushing the queue to the kernel once if it is full.
    ///
    /// # Safety
    /// As `SubmissionQueue::push`: the entry's buffers must stay valid until it completes.
    unsafe fn push(&mut self, e: &io_uring::squeue::Entry) -> io::Result<()> {
        for attempt in 0..2 {
            let injected = attempt == 0 && self.faults.sq_full > 0;
            if injected {
                self.faults.sq_full -= 1;
            }
            // SAFETY: forwarded to our caller.
            if !injected && unsafe { self.ring.submission().push(e) }.is_ok() {
                return Ok(());
            }
            if attempt == 0 {
                // The queue is full of entries the kernel has not taken yet: hand them over.
                loop {
                    match self.ring.submit() {
                        Ok(_) => break,
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(_) => break,
                    }
                }
            }
        }
        Err(io::Error::other("io_uring submission queue full"))
    }

    /// Submits what is queued and waits for at least one completion; EINTR is retried.
    fn wait(&mut self) -> io::Result<()> {
        loop {
            let r = if self.faults.eintr_waits > 0 {
                self.faults.eintr_waits -= 1;
                Err(io::Error::from_raw_os_error(libc::EINTR))
            } else if let Some((_, errno)) = self.faults.fail_wait_in_flight.filter(|(n, _)| self.in_flight >= *n) {
                // Hand the queued operations to the kernel first, so they really are in flight
                // when the failure is reported.
                let _ = self.ring.submit();
                self.faults.fail_wait_in_flight = None;
                Err(io::Error::from_raw_os_error(errno))
            } else {
                self.ring.submit_and_wait(1).map(|_| ())
            };
            match r {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                other => return other,
            }
        }
    }

    /// Reaps every available completion: `(buffer index, result)`.
    fn reap(&mut self) -> Vec<(usize, i32)> {
        let cqes: Vec<(usize, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        self.in_flight = self.in_flight.saturating_sub(cqes.len());
        cqes
    }

    /// After a failed wait: waits until nothing is in flight, or marks the ring stuck.
    fn drain(&mut self) {
        let mut attempts = 0;
        while self.in_flight > 0 {
            match self.wait() {
                Ok(()) => {
                    self.reap();
                }
                Err(e) => {
                    attempts += 1;
                    if attempts >= DRAIN_ATTEMPTS_MAX {
                        tracing::error!(error = %e, in_flight = self.in_flight, "io_uring: operations cannot be drained; ring and buffers retired");
                        self.stuck = true;
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    /// Runs `ops` chunked operations: `prep(i, buf_index, buf_ptr, registered)` builds the entry
    /// for chunk `i`; `done(i, buf_index, result)` handles its completion. At most one operation
    /// per bounce buffer is in flight, so a buffer is never reused before the kernel is done,
    /// and nothing is in flight when this returns (or the ring is marked stuck).
    ///
    /// Depth adapts to where the data is. A call starts with one operation in flight: a
    /// buffered read of a page-cached file completes while it is being submitted, and its chunk
    /// is then handed to `done` (which hashes it) while it is still in the core's L2 cache;
    /// eight chunks submitted at once were hashed after the first had left it, at a third of
    /// the speed (docs/dependencies.md, `twox-hash`). The first operation that does not
    /// complete on submission (the disk, O_DIRECT) raises the depth to every bounce buffer for
    /// the rest of the call.
    pub(super) fn run(
        &mut self,
        ops: usize,
        mut prep: impl FnMut(usize, u16, *mut u8, bool) -> io_uring::squeue::Entry,
        mut done: impl FnMut(usize, &AlignedBuf, i32) -> io::Result<()>,
    ) -> io::Result<()> {
        assert_eq!(self.in_flight, 0, "io_uring: a previous call left operations in flight");
        // Completions nobody waits for would be taken for this call's: there must be none.
        let stale = self.reap();
        assert!(stale.is_empty(), "io_uring: {} stale completions", stale.len());
        let mut next = 0usize;
        let mut free: Vec<u16> = (0..self.bufs.len() as u16).collect();
        let mut owner = vec![usize::MAX; self.bufs.len()];
        let mut first_err: Option<io::Error> = None;
        let full = self.bufs.len();
        let mut depth = if self.faults.full_depth { full } else { 1 };
        while (next < ops && first_err.is_none()) || self.in_flight > 0 {
            while next < ops && first_err.is_none() && self.in_flight < depth {
                let Some(b) = free.pop() else { break };
                let ptr = self.bufs[b as usize].full_mut().as_mut_ptr();
                let e = prep(next, b, ptr, self.registered).user_data(b as u64);
                // SAFETY: the entry points into bounce buffer `b` (or the caller's destination),
                // which stays alive and untouched by us until its completion is reaped below.
                match unsafe { self.push(&e) } {
                    Ok(()) => {
                        owner[b as usize] = next;
                        next += 1;
                        self.in_flight += 1;
                    }
                    Err(err) => {
                        free.push(b);
                        if self.in_flight == 0 {
                            first_err = Some(err);
                        }
                        break;
                    }
                }
            }
            if self.in_flight == 0 {
                break;
            }
            if depth < full && first_err.is_none() {
                // Hand the queue over without waiting: an operation served from the page cache
                // completes in this call. A failure here is seen again by the wait below.
                let _ = self.ring.submit();
                if self.ring.completion().is_empty() {
                    depth = full;
                    continue;
                }
            }
            if let Err(e) = self.wait() {
                // Nothing may be returned (or freed) while the kernel still owns buffers.
                first_err.get_or_insert(e);
                self.drain();
                break;
            }
            for (b, res) in self.reap() {
                free.push(b as u16);
                if first_err.is_none() {
                    if let Err(e) = done(owner[b], &self.bufs[b], res) {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
