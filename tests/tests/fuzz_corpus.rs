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
