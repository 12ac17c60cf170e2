//! The few system calls the daemon needs beyond tokio: passing a descriptor over a Unix
//! socket, anonymous memory files, `sendfile`, and mapping a received shard. The crate's other
//! `unsafe` blocks are the verbs calls of `rdma.rs` (feature `rdma`), one read into an
//! uninitialised buffer in `peer.rs`, and the tests' own in `client.rs`.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use bytes::Bytes;

/// Sends `data` with `fd` attached (`SCM_RIGHTS`) on a connected Unix stream socket.
/// Returns the bytes of `data` sent (the descriptor goes with the first of them).
pub fn send_with_fd(sock: RawFd, data: &[u8], fd: RawFd) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // Room for one descriptor, u64-aligned as cmsghdr requires.
    let mut space = [0u64; 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let cmsg_len = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    assert!(cmsg_len <= std::mem::size_of_val(&space));
    // SAFETY: msghdr is plain data; all-zero is a valid starting value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = cmsg_len as _;
    // SAFETY: msg_control points at `space`, large enough for one header plus one fd
    // (checked above); CMSG_FIRSTHDR/CMSG_DATA stay inside it.
    let n = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Receives into `buf`, collecting any descriptors that arrive with the bytes. Returns the
/// bytes read (0 at end of stream).
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut space = [0u64; 16];
    // SAFETY: msghdr is plain data; all-zero is a valid starting value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&space) as _;
    // SAFETY: iov points at `buf` and msg_control at `space`, both live for the call;
    // MSG_CMSG_CLOEXEC keeps received descriptors from leaking into children.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of well-formed control
    // messages; we walk them with the CMSG macros and read each SCM_RIGHTS payload as fds,
    // taking ownership of descriptors the kernel just installed in our table.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let count = ((*c).cmsg_len as usize - (data as usize - c as usize)) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned((data as *const RawFd).add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("descriptor message truncated"));
    }
    Ok(n as usize)
}

/// The seals a shard memfd carries: its size and bytes can never change again.
const SHARD_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;

/// An anonymous in-memory file holding `data` (for a shard the cache did not admit), sealed
/// against shrinking, growing and writing, so a receiver may map it safely.
pub fn memfd_with(name: &str, data: &[u8]) -> io::Result<File> {
    let cname = std::ffi::CString::new(name.replace('\0', "_")).expect("no NUL");
    // SAFETY: memfd_create takes a valid C string and flags; it returns a new descriptor
    // that we own from here on.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    std::io::Write::write_all(&mut &f, data)?;
    // SAFETY: fcntl on a descriptor we own; no memory is involved.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, SHARD_SEALS | libc::F_SEAL_SEAL) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

/// A sealed memfd holding the first `len` bytes of `src` (a cache file), copied in the kernel
/// (`copy_file_range` or `sendfile`, through `std::io::copy`): the one copy of a shard that
/// several local consumers then map (`daemon::local`, shared shards). A file of another length
/// is an error.
pub fn memfd_from_file(name: &str, src: &File, len: u64) -> io::Result<File> {
    let actual = src.metadata()?.len();
    if actual != len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a cache file of {actual} bytes for a shard of {len}"),
        ));
    }
    let cname = std::ffi::CString::new(name.replace('\0', "_")).expect("no NUL");
    // SAFETY: as in `memfd_with`.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    let n = std::io::copy(&mut std::io::Read::take(src, len), &mut &f)?;
    if n != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the cache file gave {n} of {len} bytes"),
        ));
    }
    // SAFETY: fcntl on a descriptor we own; no memory is involved.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, SHARD_SEALS | libc::F_SEAL_SEAL) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

/// Creates a memfd without seals (tests of the receiver's refusal).
#[doc(hidden)]
pub fn memfd_unsealed(data: &[u8]) -> io::Result<File> {
    // SAFETY: as in `memfd_with`.
    let fd = unsafe { libc::memfd_create(c"ramjet-unsealed".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    std::io::Write::write_all(&mut &f, data)?;
    Ok(f)
}

/// Whether `f` is a memfd (its `/proc` link reads `/memfd:NAME (deleted)`).
fn is_memfd(f: &File) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .is_ok_and(|p| p.to_string_lossy().starts_with("/memfd:"))
}

/// The seals of a memfd (`F_GET_SEALS`).
fn seals(f: &File) -> io::Result<libc::c_int> {
    // SAFETY: fcntl on a descriptor we hold; no memory is involved.
    let s = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(s)
}

/// The bytes of a shard file received from the daemon, `len` long, in a form no other process
/// can change afterwards:
/// - a memfd must carry the shrink, grow and write seals (else it is refused); it is mapped;
/// - anything else (a cache file, which another process could truncate or rewrite) is copied
///   into this process's memory: a truncation shows as a short read (an error), never as
///   SIGBUS, and the copy that the caller verifies is the copy it uses.
pub fn received_shard(f: &File, len: u64) -> io::Result<Bytes> {
    if is_memfd(f) {
        let s = seals(f)?;
        if s & SHARD_SEALS != SHARD_SEALS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("received an unsealed memfd (seals {s:#x}); refused"),
            ));
        }
        // SAFETY: the memfd is sealed against shrinking, growing and writing (checked above),
        // so its pages stay valid and unchanged while mapped.
        return unsafe { map_file(f, len) };
    }
    read_private(f, len)
}

/// Reads `len` bytes of `f` from offset 0 into a buffer of this process (a verified copy once
/// the caller checks it). A file of another length is an error.
pub fn read_private(f: &File, len: u64) -> io::Result<Bytes> {
    use std::os::unix::fs::FileExt;
    let actual = f.metadata()?.len();
    if actual != len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("received a file of {actual} bytes for a shard of {len}"),
        ));
    }
    let n = usize::try_from(len).map_err(|_| io::Error::other("shard larger than memory"))?;
    // SAFETY: read_exact_at fills all of [0, n) or fails, and then the buffer is dropped unread.
    let mut buf = unsafe { ramjet_engine::buf::BufPool::global().try_take(n) }.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("no memory for a shard of {len} bytes"),
        )
    })?;
    f.read_exact_at(buf.as_mut_slice(), 0).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            io::Error::new(io::ErrorKind::UnexpectedEof, "the file was truncated while being read")
        } else {
            e
        }
    })?;
    Ok(buf.into_bytes())
}

/// Maps a file read-only (prefaulted) as `Bytes`; the mapping lives as long as any slice of it.
///
/// # Safety
/// Nothing may truncate or write the file while any slice of the mapping lives: a truncation
/// raises SIGBUS on the next read of a lost page, and a write changes bytes already handed out.
/// A memfd sealed with `F_SEAL_SHRINK | F_SEAL_WRITE` satisfies this.
pub unsafe fn map_file(f: &File, len: u64) -> io::Result<Bytes> {
    let actual = f.metadata()?.len();
    if actual != len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("received a file of {actual} bytes for a shard of {len}"),
        ));
    }
    if len == 0 {
        return Ok(Bytes::new());
    }
    // SAFETY: the caller guarantees the file stays unchanged while mapped.
    let m = unsafe { memmap2::MmapOptions::new().len(len as usize).populate().map(f)? };
    Ok(Bytes::from_owner(m))
}

/// Our user id.
pub fn my_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// For tests that need root (to run a process as another user): true when this process is
/// root. Otherwise the test is skipped only when `RAMJET_SKIP_ROOT_TESTS` asks for it by name,
/// and fails when it does not, so it never passes silently. `what` says what root is for.
#[doc(hidden)]
pub fn root_or_skip(what: &str) -> bool {
    if my_uid() == 0 {
        return true;
    }
    assert!(
        std::env::var_os("RAMJET_SKIP_ROOT_TESTS").is_some(),
        "this test needs root to {what} (CI runs as root); set RAMJET_SKIP_ROOT_TESTS=1 to skip it"
    );
    eprintln!("SKIPPED (RAMJET_SKIP_ROOT_TESTS): needs root to {what}");
    false
}

/// The user id of the process at the other end of a connected Unix socket (`SO_PEERCRED`).
pub fn peer_uid(sock: RawFd) -> io::Result<u32> {
    // SAFETY: ucred is plain data; all-zero is a valid starting value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is that large.
    let r = unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// One `sendfile` call from `file` at `*off` to the socket; advances `*off`.
pub fn sendfile_once(sock: RawFd, file: &File, off: &mut i64, count: usize) -> io::Result<usize> {
    // SAFETY: both descriptors are open for the call; `off` is a valid pointer to our offset.
    let n = unsafe { libc::sendfile(sock, file.as_raw_fd(), off as *mut i64, count) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_descriptor_crosses_a_socket_and_maps() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = memfd_with("t", b"shard bytes").unwrap();
        let frame = b"hello frame";
        assert_eq!(send_with_fd(a.as_raw_fd(), frame, f.as_raw_fd()).unwrap(), frame.len());
        let mut buf = [0u8; 64];
        let mut fds = Vec::new();
        let n = recv_with_fds(b.as_raw_fd(), &mut buf, &mut fds).unwrap();
        assert_eq!(&buf[..n], frame);
        assert_eq!(fds.len(), 1);
        let got = File::from(fds.pop().unwrap());
        assert_eq!(&received_shard(&got, 11).unwrap()[..], b"shard bytes");
        assert!(received_shard(&got, 12).is_err());
    }

    /// Regression: memfds crossed the socket unsealed and were mapped shared, so the sender
    /// could change or shrink a shard after the receiver verified it.
    #[test]
    fn a_cache_file_becomes_a_sealed_memfd_that_maps_without_a_copy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard");
        std::fs::write(&path, b"shard bytes, long enough").unwrap();
        let src = File::open(&path).unwrap();
        let m = memfd_from_file("t", &src, 24).unwrap();
        assert!(is_memfd(&m));
        assert_eq!(seals(&m).unwrap() & SHARD_SEALS, SHARD_SEALS);
        assert_eq!(&received_shard(&m, 24).unwrap()[..], b"shard bytes, long enough");
        // The cache file changing afterwards changes nothing in the copy.
        std::fs::write(&path, b"XXXXXXXXXXXXXXXXXXXXXXXX").unwrap();
        assert_eq!(&received_shard(&m, 24).unwrap()[..], b"shard bytes, long enough");
        let e = memfd_from_file("t", &File::open(&path).unwrap(), 30).unwrap_err();
        assert!(e.to_string().contains("24 bytes for a shard of 30"), "{e}");
    }

    #[test]
    fn received_memfds_are_sealed_and_unsealed_ones_refused() {
        let sealed = memfd_with("t", b"abc").unwrap();
        assert_eq!(seals(&sealed).unwrap() & SHARD_SEALS, SHARD_SEALS);
        assert!(sealed.set_len(1).is_err(), "a sealed shard memfd could be shrunk");
        let unsealed = memfd_unsealed(b"abc").unwrap();
        let e = received_shard(&unsealed, 3).unwrap_err();
        assert!(e.to_string().contains("unsealed memfd"), "{e}");
    }

    /// Regression: a cache file received from the daemon was mapped shared; truncating it in
    /// another process killed the trainer with SIGBUS, and rewriting it changed bytes after
    /// they were verified. Now the receiver holds its own copy.
    #[test]
    fn a_cache_file_truncated_or_rewritten_after_delivery_changes_nothing_delivered() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("shard.rjs");
        let data: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let f = File::open(&p).unwrap();
        let got = received_shard(&f, data.len() as u64).unwrap();
        // Another process rewrites the file in place, then truncates it.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .write_all_at(&vec![0xEE; 1 << 20], 0)
            .unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(10)
            .unwrap();
        assert_eq!(&got[..], &data[..], "delivered bytes changed after verification");
        // Read after the truncation: an error naming the size, not SIGBUS.
        let e = received_shard(&f, data.len() as u64).unwrap_err();
        assert!(e.to_string().contains("10 bytes"), "{e}");
    }
}
