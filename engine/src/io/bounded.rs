//! Reading a local file whole, bounded: a path that comes from outside (a JSONL row's image, a
//! `--tokenizer`, a state file) may name `/dev/zero`, a FIFO or a file larger than memory. Only
//! a regular file is read, at most `max` bytes of it, opened without blocking (a FIFO's open
//! would wait for a writer forever); anything else is an error naming the path.

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// The whole of the regular file `path`, refused when it is larger than `max` bytes or not a
/// regular file (a FIFO, a device, a directory), with an error naming it.
pub fn read_file_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let io = |e: std::io::Error| Error::io(path.display(), e);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let m = f.metadata().map_err(io)?;
    let t = m.file_type();
    if !t.is_file() {
        let what = if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else if t.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(Error::invalid(
            path.display().to_string(),
            format!("is {what}: only a regular file is read"),
        ));
    }
    if m.len() > max {
        return Err(Error::invalid(
            path.display().to_string(),
            format!("is {} bytes, more than the {max} a file read here may be", m.len()),
        ));
    }
    let mut out = Vec::with_capacity(m.len() as usize);
    // A file that grows while it is read is cut off past the bound and refused.
    f.take(max + 1).read_to_end(&mut out).map_err(io)?;
    if out.len() as u64 > max {
        return Err(Error::invalid(
            path.display().to_string(),
            format!("grew past the {max} bytes a file read here may be while it was read"),
        ));
    }
    Ok(out)
}

/// [`read_file_bounded`] on the runtime's blocking pool.
pub async fn read_file_bounded_async(path: std::path::PathBuf, max: u64) -> Result<Vec<u8>> {
    let p = path.clone();
    tokio::task::spawn_blocking(move || read_file_bounded(&p, max))
        .await
        .map_err(|e| Error::io(path.display(), std::io::Error::other(e.to_string())))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_fifos_and_files_past_the_bound_are_refused_by_name_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let e = read_file_bounded(Path::new("/dev/zero"), 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/dev/zero") && e.contains("a device"), "{e}");
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t = std::time::Instant::now();
        let e = read_file_bounded(&fifo, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("a FIFO") && t.elapsed().as_secs() < 2, "{e}");
        let big = d.path().join("big");
        std::fs::write(&big, vec![1u8; 4097]).unwrap();
        let e = read_file_bounded(&big, 4096).unwrap_err().to_string();
        assert!(e.contains("4097 bytes"), "{e}");
        assert_eq!(read_file_bounded(&big, 4097).unwrap().len(), 4097);
        let e = read_file_bounded(d.path(), 10).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
    }
}
