//! A Parquet file's footer: found from its 8-byte tail when a dataset is indexed, and read
//! again (checked against the size and XXH3-64 its index recorded) by every process that
//! reads one of its row groups, once a process, however many row groups it reads.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};

use super::ParquetPart;
use crate::error::{Error, Location, Result};
use crate::Store;

/// The tail of every Parquet file: the footer's length (`u32`), then `PAR1`.
const TAIL_LEN: u64 = 8;
/// Largest footer read (a bound on what a damaged tail can make us fetch).
const FOOTER_BYTES_MAX: u64 = 256 << 20;
/// Footers kept in a process.
const KEPT: usize = 64;

/// A file's footer as found at indexing: where it is and its bytes.
pub struct Found {
    /// The file's size.
    pub file_bytes: u64,
    /// Where the footer starts.
    pub offset: u64,
    /// The footer's bytes (without the tail).
    pub bytes: Bytes,
}

/// Reads the footer of the Parquet file `key` in `store` from its tail.
pub async fn find(store: &Store, key: &str) -> Result<Found> {
    let url = store.url(key);
    let bad = |r: String| Error::corrupt(Location::object(url.clone()), r);
    let file_bytes = store.size(key).await?;
    if file_bytes < 12 {
        return Err(bad(format!("{file_bytes} bytes is too short for a Parquet file")));
    }
    let tail = store.get_range(key, file_bytes - TAIL_LEN..file_bytes).await?;
    match &tail[4..] {
        b"PAR1" => {}
        b"PARE" => return Err(bad("an encrypted Parquet file is not read".into())),
        _ => return Err(bad("it does not end in PAR1: not a Parquet file, or cut short".into())),
    }
    let len = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")) as u64;
    if len == 0 || len > FOOTER_BYTES_MAX || len + TAIL_LEN + 4 > file_bytes {
        return Err(bad(format!(
            "its tail says a {len}-byte footer, which the {file_bytes}-byte file cannot hold"
        )));
    }
    let offset = file_bytes - TAIL_LEN - len;
    let bytes = store.get_range(key, offset..offset + len).await?;
    Ok(Found {
        file_bytes,
        offset,
        bytes,
    })
}

/// A footer's bytes (of the file `object`) decoded.
pub fn decode(bytes: &[u8], object: &str) -> Result<Arc<ParquetMetaData>> {
    let m = std::panic::catch_unwind(|| ParquetMetaDataReader::decode_metadata(bytes))
        .map_err(|_| Error::corrupt(Location::object(object), "the Parquet footer does not decode"))?
        .map_err(|e| {
            Error::corrupt(
                Location::object(object),
                format!("the Parquet footer does not decode: {e}"),
            )
        })?;
    Ok(Arc::new(m))
}

/// Footers read by this process, by their XXH3-64.
static FOOTERS: Mutex<Vec<(u64, Arc<ParquetMetaData>)>> = Mutex::new(Vec::new());

/// The footer of `part`'s file, from `store` (or kept from an earlier read), checked against
/// the size and XXH3-64 the index recorded: a file replaced since is an error naming it.
pub async fn footer(store: &Store, part: &ParquetPart) -> Result<Arc<ParquetMetaData>> {
    let sum = part.footer_checksum.get();
    if let Some((_, m)) = FOOTERS.lock().expect("footers lock").iter().find(|(s, _)| *s == sum) {
        return Ok(m.clone());
    }
    let url = store.url(&part.file);
    let end = part.footer_offset + part.footer_bytes;
    let bytes = store.get_range(&part.file, part.footer_offset..end).await?;
    let got = xxhash_rust::xxh3::xxh3_64(&bytes);
    if bytes.len() as u64 != part.footer_bytes || got != sum {
        return Err(Error::corrupt(
            Location::object(url),
            format!(
                "its footer at [{}, +{}) hashes to {got:016x}, its index says {} (the file changed since it was indexed: run `ramjet index` again, or delete the learned manifest `ramjet inspect` names)",
                part.footer_offset, part.footer_bytes, part.footer_checksum
            ),
        ));
    }
    let m = decode(&bytes, &url)?;
    let mut kept = FOOTERS.lock().expect("footers lock");
    if kept.len() >= KEPT {
        kept.remove(0);
    }
    kept.push((sum, m.clone()));
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Checksum;

    const FILE: &[u8] = include_bytes!("../../../tests/fuzz/corpus/parquet/snappy.parquet");

    #[test]
    fn a_footer_is_found_from_the_tail_and_a_changed_one_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.parquet");
        std::fs::write(&path, FILE).unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let found = rt.block_on(find(&store, "x.parquet")).unwrap();
        assert_eq!(found.file_bytes, FILE.len() as u64);
        assert_eq!(decode(&found.bytes, "x").unwrap().num_row_groups(), 2);
        let part = ParquetPart {
            file: "x.parquet".into(),
            file_bytes: found.file_bytes,
            row_group: 0,
            offset: 4,
            footer_offset: found.offset,
            footer_bytes: found.bytes.len() as u64,
            footer_checksum: Checksum(xxhash_rust::xxh3::xxh3_64(&found.bytes)),
        };
        // Changed before this process read it: its checksum refuses it, naming the file.
        let mut changed = FILE.to_vec();
        changed[found.offset as usize + 10] ^= 0x01;
        std::fs::write(&path, &changed).unwrap();
        let e = rt.block_on(footer(&store, &part)).unwrap_err().to_string();
        assert!(e.contains("x.parquet") && e.contains("footer"), "{e}");
        std::fs::write(&path, FILE).unwrap();
        assert_eq!(rt.block_on(footer(&store, &part)).unwrap().num_row_groups(), 2);
        // Not a Parquet file at all.
        std::fs::write(&path, b"not a parquet file at all").unwrap();
        let e = rt.block_on(find(&store, "x.parquet")).err().unwrap().to_string();
        assert!(e.contains("PAR1"), "{e}");
    }
}
