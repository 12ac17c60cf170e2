//! The few system calls the daemon needs beyond tokio: passing a descriptor over a Unix
//! socket, anonymous memory files, `sendfile`, and mapping a received shard. Every `unsafe`
//! block of the crate is here.

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

/// An anonymous in-memory file holding `data` (for a shard the cache did not admit).
pub fn memfd_with(name: &str, data: &[u8]) -> io::Result<File> {
    let cname = std::ffi::CString::new(name.replace('\0', "_")).expect("no NUL");
    // SAFETY: memfd_create takes a valid C string and flags; it returns a new descriptor
    // that we own from here on.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    std::io::Write::write_all(&mut &f, data)?;
    Ok(f)
}

/// Maps a received shard file read-only (prefaulted) as `Bytes`; the mapping lives as long
/// as any slice of it.
pub fn map_file(f: &File, len: u64) -> io::Result<Bytes> {
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
    // SAFETY: the file is an immutable cache entry (written once, renamed into place, never
    // modified; eviction unlinks it, which keeps our mapping valid) or a memfd only we and
    // the daemon hold and that the daemon never writes again.
    let m = unsafe { memmap2::MmapOptions::new().len(len as usize).populate().map(f)? };
    Ok(Bytes::from_owner(m))
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
        assert_eq!(&map_file(&got, 11).unwrap()[..], b"shard bytes");
        assert!(map_file(&got, 12).is_err());
    }
}
