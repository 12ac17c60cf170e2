//! Replays the cargo-fuzz corpus (tests/fuzz/corpus) through the fuzz entry points, so every
//! input the fuzzer ever kept is re-checked by the normal test suite.

use std::path::Path;

fn replay(target: &str, f: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display())) {
        let p = e.unwrap().path();
        let data = std::fs::read(&p).unwrap();
        let r = std::panic::catch_unwind(|| f(&data));
        assert!(
            r.is_ok(),
            "fuzz target {target} panicked on corpus file {}",
            p.display()
        );
        n += 1;
    }
    n
}

#[test]
fn shard_corpus_replays() {
    let n = replay("shard", ramjet_tests::fuzzing::shard);
    assert!(n >= 5, "shard corpus has only {n} files");
}

#[test]
fn manifest_corpus_replays() {
    let n = replay("manifest", ramjet_tests::fuzzing::manifest);
    assert!(n >= 3, "manifest corpus has only {n} files");
}

#[test]
fn wire_corpus_replays() {
    let n = replay("wire", ramjet_tests::fuzzing::wire);
    assert!(n >= 5, "wire corpus has only {n} files");
}

#[test]
fn image_corpus_replays() {
    let n = replay("image", ramjet_tests::fuzzing::image);
    assert!(n >= 5, "image corpus has only {n} files");
}

#[test]
fn index_corpus_replays() {
    let n = replay("index", ramjet_tests::fuzzing::index);
    assert!(n >= 4, "index corpus has only {n} files");
}

#[test]
fn foreign_corpus_replays() {
    let n = replay("foreign", ramjet_tests::fuzzing::foreign);
    assert!(n >= 5, "foreign corpus has only {n} files");
}

#[test]
fn parquet_corpus_replays() {
    let n = replay("parquet", ramjet_tests::fuzzing::parquet);
    assert!(n >= 3, "parquet corpus has only {n} files");
}

/// The Parquet seeds reach past the footer: each decodes, and its row groups transcode to its
/// three rows (so the fuzzer's mutants exercise the page decoders, not only the tail check).
#[test]
fn the_parquet_seeds_are_sound_files() {
    use ramjet_engine::foreign::{
        parquet_footer, parquet_rows, parquet_schema, ForeignFormat, ForeignSpec, ParquetPart,
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/parquet");
    for name in ["snappy.parquet", "plain-crc.parquet", "zstd-v2.parquet"] {
        let data = std::fs::read(dir.join(name)).unwrap();
        let n = data.len();
        let len = u32::from_le_bytes(data[n - 8..n - 4].try_into().unwrap()) as usize;
        let meta = parquet_footer::decode(&data[n - 8 - len..n - 8], name).unwrap();
        let (columns, schema) = parquet_schema::columns(&[meta.as_ref()]).unwrap();
        let spec = ForeignSpec {
            format: ForeignFormat::Parquet,
            columns,
            jpeg_restart_px: None,
        };
        let mut rows = 0;
        for (r, rg) in meta.row_groups().iter().enumerate() {
            let (offset, bytes) = parquet_rows::row_group_span(rg).unwrap();
            let part = ParquetPart {
                file: name.into(),
                file_bytes: n as u64,
                row_group: r as u32,
                offset,
                footer_offset: (n - 8 - len) as u64,
                footer_bytes: len as u64,
                footer_checksum: ramjet_engine::format::Checksum(0),
            };
            let span = bytes::Bytes::copy_from_slice(&data[offset as usize..(offset + bytes) as usize]);
            rows += parquet_rows::transcode_row_group(&spec, &schema, &meta, &part, span, name)
                .unwrap_or_else(|e| panic!("{name} row group {r}: {e}"))
                .samples;
        }
        assert_eq!(rows, 3, "{name}");
    }
}

/// Without cargo-fuzz at hand, each foreign seed is also mutated here, deterministically:
/// byte flips, random 32-bit words (MDS offsets and sizes), truncations and duplicated runs
/// (tar headers out of place). None may panic.
#[test]
fn mutated_foreign_shards_never_panic() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/foreign");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut tried = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let seed = std::fs::read(&p).unwrap();
        if seed.is_empty() {
            continue;
        }
        for _ in 0..2000 {
            let mut d = seed.clone();
            for _ in 0..1 + next() % 3 {
                let at = (next() % d.len().max(1) as u64) as usize;
                match next() % 4 {
                    0 if !d.is_empty() => d[at] ^= 1 << (next() % 8),
                    1 if d.len() >= 4 => {
                        let at = at.min(d.len() - 4) & !3;
                        d[at..at + 4].copy_from_slice(&(next() as u32).to_le_bytes());
                    }
                    2 => d.truncate(at),
                    _ => {
                        let run: Vec<u8> = d[at..(at + 600).min(d.len())].to_vec();
                        d.splice(at..at, run);
                    }
                }
            }
            let r = std::panic::catch_unwind(|| ramjet_tests::fuzzing::foreign(&d));
            assert!(r.is_ok(), "a mutation of {} panicked; input: {:?}", p.display(), d);
            tried += 1;
        }
    }
    assert!(tried >= 10_000, "only {tried} mutations");
}

/// The seeds the mutations start from are sound shards, so the mutations reach past the
/// first check: the plain MDS shard and the tar transcode to their 3 samples each.
#[test]
fn the_foreign_seeds_are_sound_shards() {
    use ramjet_engine::foreign::{mds, wds};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/foreign");
    let m = std::fs::read(dir.join("mds-plain.mds")).unwrap();
    assert_eq!(mds::MdsShard::parse(&m, "seed").unwrap().samples(), 3);
    let t = std::fs::read(dir.join("wds.tar")).unwrap();
    let s = wds::samples(&t, "seed").unwrap();
    assert_eq!(s.len(), 3);
    assert!(
        s[2].key.ends_with(&"x".repeat(120)),
        "the pax long name was not read: {}",
        s[2].key
    );
    assert!(wds::samples(&std::fs::read(dir.join("wds-cut.tar")).unwrap(), "cut").is_err());
}
