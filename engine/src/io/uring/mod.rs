//! io_uring on the process's I/O core: [`UringIo`], the cache I/O that runs each file on one
//! ring (see [`iocore`]), with up to [`IO_CHUNKS_IN_FLIGHT`](super::IO_CHUNKS_IN_FLIGHT) chunks
//! in flight. A request's job owns its file and its buffer: nothing borrowed crosses to an I/O
//! thread, and a ring left stuck leaks what the kernel may still touch.

mod iocore;
mod ring;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use bytes::Bytes;

use self::iocore::{run_in_slot, with_ring, with_ring_on, IoCore};
use self::ring::{Ring, DEST_SLOT};
use super::hash::ChunkHasher;
use super::{CacheIo, IO_ALIGN, IO_CHUNK_BYTES};
use crate::buf::{BufPool, PooledBuf};

pub use self::iocore::io_threads;

thread_local! {
    /// The ring of a thread that owns one: the cache writers (see [`own_ring_on_this_thread`]).
    /// `None` on every other thread, whose requests go to the I/O core.
    /// Boxed: a thread-local's inline size counts against the static TLS block that the Python
    /// extension must get from glibc when it is loaded (it uses mimalloc's initial-exec TLS),
    /// which is small and shared with every library loaded before it (torch's among them).
    static OWN_RING: std::cell::RefCell<Option<Box<Option<Ring>>>> = const { std::cell::RefCell::new(None) };
}

/// Makes this thread run its own cache I/O on a ring of its own instead of the I/O core's.
/// For the cache writers (`cache::Filler`), which run at a low CPU priority: the kernel's
/// io_uring workers for their buffered writes are made from the thread that owns the ring and
/// take its priority, so a cache copy never takes a core from the read path. On an I/O core
/// thread (nice 0) those workers ran at normal priority.
pub fn own_ring_on_this_thread() {
    OWN_RING.with(|r| {
        let mut r = r.borrow_mut();
        if r.is_none() {
            *r = Some(Box::new(None));
        }
    });
}

/// The route of a cache file: a hash of its path (which names the shard).
fn route(path: &Path) -> u64 {
    xxhash_rust::xxh3::xxh3_64(path.as_os_str().as_encoded_bytes())
}

/// io_uring with registered buffers; `direct` opens files with `O_DIRECT` when the
/// filesystem accepts it (falling back to buffered I/O per file when it does not).
pub struct UringIo {
    /// Reads open files with O_DIRECT (where the filesystem allows).
    direct: bool,
    /// Cache fills (writes) open files with O_DIRECT (where the filesystem allows).
    fill_direct: bool,
    /// A core of its own (tests of faulted rings); `None`: the process's.
    core: Option<IoCore>,
}

impl std::fmt::Debug for UringIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringIo")
            .field("direct", &self.direct)
            .field("fill_direct", &self.fill_direct)
            .finish()
    }
}

impl UringIo {
    /// An io_uring implementation, or the error that says why io_uring is unusable here.
    /// `direct`: reads and writes open files with O_DIRECT where the filesystem allows.
    pub fn new(direct: bool) -> io::Result<UringIo> {
        with_ring(0, |_| Ok(()))?;
        Ok(UringIo {
            direct,
            fill_direct: direct,
            core: None,
        })
    }

    /// Whether cache fills (writes) bypass the page cache with O_DIRECT, whatever reads do.
    pub fn with_direct_fills(mut self, on: bool) -> UringIo {
        self.fill_direct = on;
        self
    }

    fn on_ring<T: Send + 'static>(
        &self,
        path: &Path,
        f: impl FnOnce(&mut Ring) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        match &self.core {
            Some(c) => with_ring_on(c, route(path), f),
            None => {
                let mut f = Some(f);
                let own = OWN_RING.with(|r| {
                    let mut r = r.borrow_mut();
                    r.as_mut()
                        .map(|slot| run_in_slot(slot, Ring::for_writer, f.take().expect("runs once")))
                });
                match own {
                    Some(r) => r,
                    None => with_ring(route(path), f.take().expect("not run")),
                }
            }
        }
    }

    fn open(&self, path: &Path, write: bool) -> io::Result<(File, bool)> {
        let mut o = OpenOptions::new();
        if write {
            o.write(true).create_new(true);
        } else {
            o.read(true);
        }
        if (write && self.fill_direct) || (!write && self.direct) {
            let mut od = o.clone();
            od.custom_flags(libc::O_DIRECT);
            match od.open(path) {
                Ok(f) => return Ok((f, true)),
                // tmpfs and some others refuse O_DIRECT with EINVAL.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
        }
        Ok((o.open(path)?, false))
    }
}

/// The ring side of [`UringIo::read_file`]: reads `len` bytes of `f` into `out`, hashing each
/// chunk as it completes. Owns what the kernel writes into: when the ring is left stuck, `out`
/// is leaked here (the kernel may still write into it), never freed or reused.
fn read_on_ring(
    ring: &mut Ring,
    f: File,
    direct: bool,
    len: usize,
    mut out: PooledBuf,
    mut hasher: ChunkHasher,
) -> io::Result<(PooledBuf, ChunkHasher)> {
    let chunks = len.div_ceil(IO_CHUNK_BYTES);
    let fd = io_uring::types::Fd(f.as_raw_fd());
    let (dst, _, cap) = out.raw();
    // Only O_DIRECT gains from a registered destination (the kernel pins each page once
    // instead of once per operation). A buffered read is a copy out of the page cache, and
    // registering the destination would pin every page of it for nothing: measured at 0.76x
    // the speed of unregistered reads on warm files (docs/benchmarks-history.md).
    // SAFETY: `out` outlives the registration: the slot is cleared below, before this function
    // returns, and no operation is in flight after `run` returns (or the ring is stuck, and
    // then `out` is leaked).
    let fixed = direct && unsafe { ring.register_dest(dst, cap) };
    let r = ring.run(
        chunks,
        |i, _slot, _bounce, _registered| {
            // O_DIRECT needs aligned lengths: read whole aligned chunks (they stay inside the
            // aligned capacity); the kernel stops at end of file.
            let off = i * IO_CHUNK_BYTES;
            let want = (len - off).min(IO_CHUNK_BYTES).div_ceil(IO_ALIGN) * IO_ALIGN;
            // SAFETY: off + want <= cap, inside the destination.
            let p = unsafe { dst.add(off) };
            chunk_op(Op::Read, fd, p, want, off, fixed.then_some(DEST_SLOT))
        },
        |i, _buf, res| {
            complete(res, (len - i * IO_CHUNK_BYTES).min(IO_CHUNK_BYTES), Op::Read, i)?;
            hasher.done(i, |r| {
                // SAFETY: the hasher asks only for ranges of completed chunks: they are
                // initialised and no read in flight overlaps them.
                unsafe { std::slice::from_raw_parts(dst.add(r.start), r.end - r.start) }
            });
            Ok(())
        },
    );
    if fixed {
        ring.clear_dest();
    }
    if ring.stuck {
        // The kernel may still write into the destination, and read the file: never free them.
        std::mem::forget(out);
        std::mem::forget(f);
        return Err(r.err().unwrap_or_else(|| io::Error::other("io_uring ring retired")));
    }
    r.map(|()| (out, hasher))
}

/// The ring side of [`UringIo::write_file`]: writes `data[..ring_end]` to `f`. Owns what the
/// kernel reads from: when the ring is left stuck, its handle on `data` is leaked here (the
/// kernel may still read it), so the memory is never freed or reused.
fn write_on_ring(
    ring: &mut Ring,
    f: File,
    direct: bool,
    ring_end: usize,
    data: Bytes,
    shown: &str,
) -> io::Result<(File, Bytes)> {
    let chunks = ring_end.div_ceil(IO_CHUNK_BYTES);
    let fd = io_uring::types::Fd(f.as_raw_fd());
    // Writes go straight from `data`: a copy into the bounce buffers would read every byte
    // once more (and registering `data` would only pin its pages first). Buffered, the kernel
    // copies it into the page cache; with O_DIRECT the device reads it where it is, which
    // needs an aligned address: a pooled buffer's chunks are aligned, and other data goes
    // through the bounce buffers.
    let aligned = data.as_ptr() as usize % IO_ALIGN == 0;
    let r = ring.run(
        chunks,
        |i, b, ptr, registered| {
            let off = i * IO_CHUNK_BYTES;
            let n = (ring_end - off).min(IO_CHUNK_BYTES);
            if !direct || aligned {
                return chunk_op(Op::Write, fd, data[off..].as_ptr().cast_mut(), n, off, None);
            }
            // SAFETY: ptr is bounce buffer `b` of IO_CHUNK_BYTES bytes, not in flight.
            let buf = unsafe { std::slice::from_raw_parts_mut(ptr, IO_CHUNK_BYTES) };
            buf[..n].copy_from_slice(&data[off..off + n]);
            chunk_op(Op::Write, fd, ptr, n, off, registered.then_some(b))
        },
        |i, _buf, res| complete(res, (ring_end - i * IO_CHUNK_BYTES).min(IO_CHUNK_BYTES), Op::Write, i),
    );
    if ring.stuck {
        tracing::error!(path = shown, "io_uring ring retired during a cache write");
        std::mem::forget(data);
        std::mem::forget(f);
        return Err(r.err().unwrap_or_else(|| io::Error::other("io_uring ring retired")));
    }
    r.map(|()| (f, data))
}

/// A chunk operation's direction.
#[derive(Clone, Copy)]
enum Op {
    Read,
    Write,
}

/// The entry for one chunk: `n` bytes at `p`, file offset `off`, through registered buffer
/// `slot` when given. A write only reads through `p`.
fn chunk_op(
    op: Op,
    fd: io_uring::types::Fd,
    p: *mut u8,
    n: usize,
    off: usize,
    slot: Option<u16>,
) -> io_uring::squeue::Entry {
    use io_uring::opcode::{Read, ReadFixed, Write, WriteFixed};
    let (n, off) = (n as u32, off as u64);
    match (op, slot) {
        (Op::Read, Some(s)) => ReadFixed::new(fd, p, n, s).offset(off).build(),
        (Op::Read, None) => Read::new(fd, p, n).offset(off).build(),
        (Op::Write, Some(s)) => WriteFixed::new(fd, p, n, s).offset(off).build(),
        (Op::Write, None) => Write::new(fd, p, n).offset(off).build(),
    }
}

/// Chunk `i`'s completion: an error, or fewer than `want` bytes, fails the call.
fn complete(res: i32, want: usize, op: Op, i: usize) -> io::Result<()> {
    if res < 0 {
        return Err(io::Error::from_raw_os_error(-res));
    }
    if (res as usize) < want {
        return Err(match op {
            Op::Read => io::Error::new(io::ErrorKind::UnexpectedEof, format!("short read at chunk {i}")),
            Op::Write => io::Error::new(io::ErrorKind::WriteZero, format!("short write at chunk {i}")),
        });
    }
    Ok(())
}

impl CacheIo for UringIo {
    fn name(&self) -> &'static str {
        match (self.direct, self.fill_direct) {
            (true, _) => "io_uring+O_DIRECT",
            (false, true) => "io_uring, O_DIRECT fills",
            (false, false) => "io_uring",
        }
    }

    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let (f, direct) = self.open(path, false)?;
        let len = f.metadata()?.len() as usize;
        // SAFETY: every byte of [0, len) is written by the reads below, each checked to be
        // complete; on any error the buffer is dropped unread (or leaked, if the ring is stuck).
        let out = unsafe { BufPool::global().try_take(len) }.ok_or_else(|| super::no_memory(len))?;
        let hasher = ChunkHasher::new(len, hash_skip_tail);
        // The job owns the file, the destination and the hasher, and hands them back.
        let (out, hasher) = self.on_ring(path, move |ring| read_on_ring(ring, f, direct, len, out, hasher))?;
        Ok((out.into_bytes(), hasher.finish()))
    }

    fn write_file(&self, path: &Path, data: Bytes) -> io::Result<()> {
        let (f, direct) = self.open(path, true)?;
        // With O_DIRECT only whole aligned blocks go through the ring; an unaligned tail is
        // written buffered after. Padding the tail to a block and truncating after would leave
        // the file, for a moment, up to a block longer than its data, over the cache's budget.
        let ring_end = if direct {
            data.len() / IO_ALIGN * IO_ALIGN
        } else {
            data.len()
        };
        // The job owns the file and a handle on the data, and hands them back.
        let shown = path.display().to_string();
        let (f, data) = self.on_ring(path, move |ring| write_on_ring(ring, f, direct, ring_end, data, &shown))?;
        if ring_end < data.len() {
            // SAFETY: fcntl on a descriptor this function owns (F_GETFL/F_SETFL take no pointer).
            let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
            if flags < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: as above; clearing O_DIRECT makes the tail's write a buffered one.
            if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
                return Err(io::Error::last_os_error());
            }
            std::os::unix::fs::FileExt::write_all_at(&f, &data[ring_end..], ring_end as u64)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use self::ring::RingFaults;
    use super::*;
    use crate::io::hash::hash_prefix;
    use crate::io::tests::suite;
    use crate::io::uring_expected;

    #[test]
    fn uring_suite() {
        // Buffered, O_DIRECT, and the default: O_DIRECT fills with buffered reads.
        for (direct, fills) in [(false, false), (true, true), (false, true)] {
            match UringIo::new(direct) {
                Ok(u) => suite(&u.with_direct_fills(fills)),
                Err(e) if uring_expected() => {
                    panic!("io_uring expected (RAMJET_EXPECT_IO_URING=1) but unavailable: {e}")
                }
                Err(e) => println!("SKIPPED io_uring (direct={direct}): unavailable here: {e}"),
            }
        }
    }

    /// Replaces this thread's ring with one carrying `faults`; `None` (with the reason printed)
    /// where io_uring is unavailable and not expected.
    fn ring_with(faults: RingFaults) -> Option<UringIo> {
        let core = IoCore::new(1).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        core.lanes[0]
            .queue
            .send(Box::new(move |slot: &mut Option<Ring>| {
                let r = Ring::with_faults(faults).map(|r| *slot = Some(r));
                tx.send(r).unwrap();
            }))
            .unwrap();
        match rx.recv().unwrap() {
            Ok(()) => Some(UringIo {
                direct: false,
                fill_direct: false,
                core: Some(core),
            }),
            Err(e) if uring_expected() => panic!("io_uring expected (RAMJET_EXPECT_IO_URING=1) but unavailable: {e}"),
            Err(e) => {
                println!("SKIPPED io_uring ring test: unavailable here: {e}");
                None
            }
        }
    }

    /// Reads a field of the test core's ring.
    fn ring_field<T: Send + 'static>(io: &UringIo, f: impl FnOnce(&Ring) -> T + Send + 'static) -> T {
        with_ring_on(io.core.as_ref().unwrap(), 0, |r| Ok(f(r))).unwrap()
    }

    fn ring_in_flight(io: &UringIo) -> usize {
        ring_field(io, |r| r.in_flight)
    }

    fn data_file(d: &Path, name: &str, len: usize) -> (std::path::PathBuf, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let p = d.join(name);
        std::fs::write(&p, &data).unwrap();
        (p, data)
    }

    /// Writes a file of `len` bytes and reads it back through `io`, checking every byte.
    /// Returns its folder (alive while held) and the data.
    fn read_back(io: &UringIo, len: usize) -> (tempfile::TempDir, Vec<u8>) {
        let d = tempfile::tempdir().unwrap();
        let (p, data) = data_file(d.path(), "f", len);
        let (got, _) = io.read_file(&p, 0).unwrap();
        assert_eq!(&got[..], &data[..]);
        (d, data)
    }

    /// Regression: a wait interrupted by a signal (EINTR) failed the whole read.
    #[test]
    fn uring_wait_interrupted_by_a_signal_is_retried() {
        let Some(io) = ring_with(RingFaults {
            eintr_waits: 5,
            ..Default::default()
        }) else {
            return;
        };
        let (_d, _) = read_back(&io, 5 * IO_CHUNK_BYTES + 3);
        assert_eq!(ring_field(&io, |r| r.faults.eintr_waits), 0, "faults not exercised");
    }

    /// Regression: a failed `submit_and_wait` returned with reads in flight; the buffer went
    /// back to the pool while the kernel could still write into it, and the late completions
    /// were taken for the next call's.
    #[test]
    fn uring_failed_wait_returns_only_after_draining_in_flight_reads() {
        let Some(io) = ring_with(RingFaults {
            fail_wait_in_flight: Some((4, libc::EBUSY)),
            full_depth: true,
            ..Default::default()
        }) else {
            return;
        };
        let d = tempfile::tempdir().unwrap();
        let (p, _) = data_file(d.path(), "a", 9 * IO_CHUNK_BYTES);
        let e = io
            .read_file(&p, 0)
            .expect_err("the injected wait failure must fail the read");
        assert_eq!(e.raw_os_error(), Some(libc::EBUSY));
        assert_eq!(ring_in_flight(&io), 0, "returned with operations in flight");
        // The same ring serves the next read correctly: no stale completion is mistaken for it.
        let (q, data) = data_file(d.path(), "b", 3 * IO_CHUNK_BYTES + 11);
        let (got, h) = io.read_file(&q, 5).unwrap();
        assert_eq!(&got[..], &data[..]);
        assert_eq!(h, hash_prefix(&data, 5));
    }

    /// Regression: a full submission queue failed the read instead of flushing it.
    #[test]
    fn uring_full_submission_queue_is_flushed_not_fatal() {
        let Some(io) = ring_with(RingFaults {
            sq_full: 3,
            ..Default::default()
        }) else {
            return;
        };
        let (d, data) = read_back(&io, 4 * IO_CHUNK_BYTES + 1);
        io.write_file(&d.path().join("w"), Bytes::from(data.clone())).unwrap();
        assert_eq!(std::fs::read(d.path().join("w")).unwrap(), data);
        assert_eq!(ring_in_flight(&io), 0);
    }

    /// Regression: buffer registration refused (ENOMEM under RLIMIT_MEMLOCK for non-root users)
    /// failed every read; the ring now runs unregistered reads and writes.
    #[test]
    fn uring_registration_refused_by_memlock_falls_back_to_unregistered_io() {
        let Some(io) = ring_with(RingFaults {
            register_enomem: true,
            ..Default::default()
        }) else {
            return;
        };
        assert!(!ring_field(&io, |r| r.registered));
        suite(&io);
    }
}
