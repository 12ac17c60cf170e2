//! Fuzzing on the stable toolchain, in every test run: each fuzz entry point
//! (`tests/src/fuzzing.rs`: shard and its footer, manifest, peer frame, images, foreign shards,
//! the MDS/LitData index and npy header, a Parquet file) is fed mutations of its kept corpus
//! (`tests/fuzz/corpus/<target>`) for a bounded time: `RAMJET_FUZZ_SECONDS` a target (CI sets
//! 20; 3 by default). Each input is a pure function of the target, the round and the corpus, so
//! a failure is replayed by its round; an input that panics is written into the corpus as
//! `crash-<xxh3>` (a regression input the corpus replay then keeps checking) and named.
//!
//! The mutator: bit flips, random bytes, 32-bit words set to edge values (sizes and offsets),
//! truncation, duplicated or deleted runs, and splices from another corpus file. cargo-fuzz
//! (`tests/fuzz`, nightly, coverage-guided) runs the same entry points where a nightly
//! toolchain is at hand.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ramjet_tests::fuzzing;

fn corpus(target: &str) -> (PathBuf, Vec<Vec<u8>>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let mut seeds: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            let d = std::fs::read(&p).unwrap();
            (p, d)
        })
        .collect();
    seeds.sort();
    (
        dir,
        seeds.into_iter().map(|(_, d)| d).filter(|d| !d.is_empty()).collect(),
    )
}

/// A counter through the order's mixer (splitmix64's finalizer): seedable, the same on every
/// machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        ramjet_engine::order::mix64(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Input `round` of a target: a corpus file changed by one to four mutations.
fn mutant(seeds: &[Vec<u8>], target: &str, round: u64) -> Vec<u8> {
    let mut r = Rng(xxhash_rust::xxh3::xxh3_64(format!("{target}:{round}").as_bytes()));
    let mut d = seeds[r.below(seeds.len())].clone();
    for _ in 0..1 + r.below(4) {
        let at = r.below(d.len());
        match r.below(7) {
            0 if !d.is_empty() => d[at] ^= 1 << r.below(8),
            1 if !d.is_empty() => d[at] = r.next() as u8,
            2 if d.len() >= 4 => {
                let at = at.min(d.len() - 4);
                let edge = [
                    0,
                    1,
                    0x7fff_ffff,
                    0xffff_ffff,
                    d.len() as u32,
                    d.len() as u32 + 1,
                    r.next() as u32,
                ];
                d[at..at + 4].copy_from_slice(&edge[r.below(edge.len())].to_le_bytes());
            }
            3 => d.truncate(at),
            4 => {
                let run = d[at..(at + 1 + r.below(600)).min(d.len())].to_vec();
                d.splice(at..at, run);
            }
            5 => {
                let end = (at + 1 + r.below(64)).min(d.len());
                d.drain(at..end);
            }
            _ => {
                let other = &seeds[r.below(seeds.len())];
                let from = r.below(other.len());
                let part = other[from..(from + 1 + r.below(256)).min(other.len())].to_vec();
                d.splice(at..(at + part.len()).min(d.len()), part);
            }
        }
    }
    d
}

fn seconds() -> Duration {
    let s = std::env::var("RAMJET_FUZZ_SECONDS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok());
    Duration::from_secs_f64(s.unwrap_or(3.0).clamp(0.1, 600.0))
}

/// Runs `f` over mutations of `target`'s corpus for the bounded time; returns the inputs tried.
fn fuzz(target: &str, f: fn(&[u8])) -> u64 {
    let (dir, seeds) = corpus(target);
    assert!(!seeds.is_empty(), "corpus {} is empty", dir.display());
    let (t0, limit) = (Instant::now(), seconds());
    let mut round = 0u64;
    while t0.elapsed() < limit {
        let d = mutant(&seeds, target, round);
        if std::panic::catch_unwind(|| f(&d)).is_err() {
            let name = format!("crash-{:016x}", xxhash_rust::xxh3::xxh3_64(&d));
            let kept = std::fs::write(dir.join(&name), &d)
                .map(|_| "kept")
                .unwrap_or("could not be kept");
            panic!(
                "fuzz target {target} panicked on round {round}'s input ({} bytes, {kept} as {}/{name})",
                d.len(),
                dir.display()
            );
        }
        round += 1;
    }
    eprintln!("fuzz {target}: {round} inputs in {:?}", t0.elapsed());
    round
}

#[test]
fn fuzz_shard_and_footer() {
    assert!(fuzz("shard", fuzzing::shard) > 0);
}

#[test]
fn fuzz_manifest() {
    assert!(fuzz("manifest", fuzzing::manifest) > 0);
}

#[test]
fn fuzz_peer_frames() {
    assert!(fuzz("wire", fuzzing::wire) > 0);
}

#[test]
fn fuzz_images_jpeg_png_webp_frames() {
    assert!(fuzz("image", fuzzing::image) > 0);
}

#[test]
fn fuzz_foreign_mds_and_tar_shards() {
    assert!(fuzz("foreign", fuzzing::foreign) > 0);
}

#[test]
fn fuzz_mds_and_litdata_indexes_and_npy_headers() {
    assert!(fuzz("index", fuzzing::index) > 0);
}

/// The mutator reaches past the parsers' first checks: the seeds parse, and mutants differ
/// from them and from each other (a mutator that returned its seed would fuzz nothing).
#[test]
fn the_index_seeds_parse_and_mutants_differ() {
    use ramjet_engine::foreign::{lit, mds};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/index");
    let m = std::fs::read(dir.join("mds-index.json")).unwrap();
    assert!(mds::Index::parse(&m, "seed").unwrap().columns("seed").is_ok());
    let l = std::fs::read(dir.join("litdata-index.json")).unwrap();
    assert!(lit::as_mds_index(&l, "seed").unwrap().unwrap().columns("seed").is_ok());
    let a = ramjet_engine::format::npy::parse_npy(&std::fs::read(dir.join("array.npy")).unwrap()).unwrap();
    assert_eq!(a.shape, [2, 3]);
    let (_, seeds) = corpus("index");
    let ms: Vec<Vec<u8>> = (0..50).map(|r| mutant(&seeds, "index", r)).collect();
    assert!(ms.iter().filter(|m| !seeds.contains(m)).count() >= 45);
    assert!(ms.windows(2).filter(|w| w[0] != w[1]).count() >= 45);
}

#[test]
fn fuzz_parquet_files() {
    assert!(fuzz("parquet", fuzzing::parquet) > 0);
}
