//! Compressed foreign shards: the names accepted, and bounded decompression.

use super::FOREIGN_SHARD_BYTES_MAX;
use crate::error::{Error, Invalid, Location, Result};

/// The compressions a foreign shard may have.
pub const COMPRESSIONS: &[&str] = &["zstd", "gz"];

/// Checks a compression name (`zstd`, `zstd:7`, `gz`; the level is ignored when reading).
pub fn compression_name(c: &str) -> std::result::Result<&str, Invalid> {
    let name = c.split(':').next().unwrap_or(c);
    if COMPRESSIONS.contains(&name) {
        Ok(name)
    } else {
        Err(Invalid::from(format!(
            "compression {c:?} is not supported (ramjet reads {})",
            COMPRESSIONS.join(" and ")
        )))
    }
}

/// `bytes` decompressed with `compression` (`None`: returned as they are), at most `max_out`
/// bytes of it (a bound on what a damaged or hostile stream can make us allocate; at most
/// [`FOREIGN_SHARD_BYTES_MAX`]). `object` names the shard in errors.
pub fn decompress<'a>(
    bytes: &'a [u8],
    compression: Option<&str>,
    max_out: u64,
    object: &str,
) -> Result<std::borrow::Cow<'a, [u8]>> {
    use std::io::Read;
    let Some(c) = compression else {
        return Ok(std::borrow::Cow::Borrowed(bytes));
    };
    let name = compression_name(c).map_err(|r| Error::invalid(object, r))?;
    let bad = |e: std::io::Error| Error::corrupt(Location::object(object), format!("{name} decompression failed: {e}"));
    let max_out = max_out.min(FOREIGN_SHARD_BYTES_MAX);
    let mut out = Vec::with_capacity((bytes.len() as u64 * 3).min(max_out) as usize);
    let limit = max_out + 1;
    match name {
        "zstd" => {
            let d = zstd::stream::read::Decoder::new(bytes).map_err(bad)?;
            d.take(limit).read_to_end(&mut out).map_err(bad)?;
        }
        _ => {
            let d = flate2::read::MultiGzDecoder::new(bytes);
            d.take(limit).read_to_end(&mut out).map_err(bad)?;
        }
    }
    if out.len() as u64 > max_out {
        return Err(Error::corrupt(
            Location::object(object),
            format!("decompresses to more than the {max_out} bytes it may hold"),
        ));
    }
    Ok(std::borrow::Cow::Owned(out))
}
