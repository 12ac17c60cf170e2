//! File locks (`flock`) that a forked child never holds.
//!
//! An `flock` belongs to the open file description, and `fork` shares every description with
//! the child. A DataLoader worker forked while this process held the fetch lock or the
//! admission lock would keep that lock for its whole life: the parent's next insert would
//! block forever, and the child's own `Cache::open` would wait on a lock it can never get.
//!
//! So every descriptor that refers to a lock file is registered, and a `pthread_atfork` child
//! handler points each registered descriptor number at `/dev/null` (`dup3`) in the child. The
//! child then holds no reference to the parent's locked descriptions: it holds or waits on
//! only the locks it takes itself. The number stays valid (now `/dev/null`), so a lock value
//! that the forking thread owned and later drops in the child closes nothing else.
//!
//! Registration and release run under a process-wide gate that the atfork *prepare* handler
//! also takes, so a fork never lands between opening a lock file and registering it, or
//! between closing it and unregistering it. Only those short steps run under the gate; the
//! `flock` wait itself does not.

use std::cell::UnsafeCell;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Once;

/// The gate: a plain pthread mutex, because the atfork handlers lock it in `prepare` and unlock
/// it in `parent` and `child`, which no RAII guard can express.
struct Gate {
    mutex: UnsafeCell<libc::pthread_mutex_t>,
    /// Descriptors of lock files; touched only with the mutex held.
    fds: UnsafeCell<Vec<RawFd>>,
}

// SAFETY: every access to both cells happens with `mutex` held (see `with`, and the atfork
// handlers, which run with it held from `prepare` on).
unsafe impl Sync for Gate {}

static GATE: Gate = Gate {
    mutex: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
    fds: UnsafeCell::new(Vec::new()),
};

static ATFORK: Once = Once::new();

fn lock_gate() {
    // SAFETY: the mutex is a valid, statically initialised pthread mutex that is never moved.
    let r = unsafe { libc::pthread_mutex_lock(GATE.mutex.get()) };
    assert_eq!(r, 0, "lock-file gate: pthread_mutex_lock failed");
}

fn unlock_gate() {
    // SAFETY: called only by the thread that locked the gate (in `with`, or the forking thread
    // in the atfork handlers, which glibc runs on the thread that called fork).
    unsafe { libc::pthread_mutex_unlock(GATE.mutex.get()) };
}

extern "C" fn before_fork() {
    lock_gate();
}

extern "C" fn after_fork_parent() {
    unlock_gate();
}

extern "C" fn after_fork_child() {
    // SAFETY: the gate is held (taken in `before_fork`), so no other reference to `fds` exists;
    // open, dup3 and close are async-signal-safe, as a child of a threaded process requires.
    unsafe {
        let fds = &*GATE.fds.get();
        if !fds.is_empty() {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            for &fd in fds {
                if null >= 0 {
                    libc::dup3(null, fd, libc::O_CLOEXEC);
                } else {
                    // Without /dev/null, closing still drops the child's reference.
                    libc::close(fd);
                }
            }
            if null >= 0 {
                libc::close(null);
            }
        }
    }
    unlock_gate();
}

/// Runs `f` with the gate held, registering the atfork handlers on first use.
fn with<T>(f: impl FnOnce(&mut Vec<RawFd>) -> T) -> T {
    ATFORK.call_once(|| {
        // SAFETY: the three handlers are `extern "C"` functions with static lifetime.
        let r = unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_parent), Some(after_fork_child)) };
        assert_eq!(r, 0, "pthread_atfork failed");
    });
    lock_gate();
    // SAFETY: the gate is held until `unlock_gate` below, so this is the only reference.
    let out = f(unsafe { &mut *GATE.fds.get() });
    unlock_gate();
    out
}

/// An `flock` on a file, released on drop; never inherited by a forked child.
pub struct FileLock {
    // `None` only while dropping.
    file: Option<File>,
}

impl FileLock {
    /// Opens `path` (creating it when `create`) and locks it: exclusive or shared, blocking or
    /// not. `Ok(None)` when `block` is false and another holder has it.
    pub fn acquire(path: &Path, exclusive: bool, block: bool, create: bool) -> std::io::Result<Option<FileLock>> {
        let file = with(|fds| {
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(create).create(create).truncate(false);
            // A cached shard read a sample at a time is read a million times an epoch: without
            // O_NOATIME every read checks (and may update) its access time, 5% of such an epoch
            // here. Only the file's owner may ask for it; anyone else opens it without.
            let f = if create {
                o.open(path)?
            } else {
                let mut quiet = o.clone();
                quiet.custom_flags(libc::O_NOATIME);
                match quiet.open(path) {
                    Err(e) if e.raw_os_error() == Some(libc::EPERM) => o.open(path)?,
                    other => other?,
                }
            };
            fds.push(f.as_raw_fd());
            Ok::<_, std::io::Error>(f)
        })?;
        // From here the value owns the registration: an early return unregisters on drop.
        let lock = FileLock { file: Some(file) };
        let mut op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH };
        if !block {
            op |= libc::LOCK_NB;
        }
        loop {
            // SAFETY: flock on a descriptor this value owns; no memory is involved.
            let r = unsafe { libc::flock(lock.file().as_raw_fd(), op) };
            if r == 0 {
                return Ok(Some(lock));
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EWOULDBLOCK) => return Ok(None),
                _ => return Err(e),
            }
        }
    }

    /// The locked file.
    pub fn file(&self) -> &File {
        self.file.as_ref().expect("present until drop")
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        let Some(f) = self.file.take() else { return };
        with(|fds| {
            let fd = f.as_raw_fd();
            if let Some(i) = fds.iter().position(|&x| x == fd) {
                fds.swap_remove(i);
            }
            // Closed with the gate held: a fork never sees the number unregistered but open.
            drop(f);
        });
    }
}
