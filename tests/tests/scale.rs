//! Issue 20's manifest-only simulation, asserted at 10^8 samples: a real manifest and binary
//! shard table of 100,000 shards, every shard served by a stub from one real tiny shard
//! (`ramjet plan-sim`, `tools/src/plansim.rs`). Starting an epoch there must stay small and
//! quick: the order is computed position by position and the table is read in place, so
//! nothing is built per sample, and the table is read a block at a time. (The figures from 10^5 to 10^9 are `docs/benchmarks-history.md`'s;
//! these bounds are loose enough for a debug build on a loaded 2-core VM.)

use ramjet_tests::ramjet_ok;

fn sim(dir: &std::path::Path, samples: u64, shuffle: &str) -> serde_json::Value {
    let out = ramjet_ok(&[
        "plan-sim",
        "--dir",
        dir.to_str().unwrap(),
        "--samples",
        &samples.to_string(),
        "--shuffle",
        shuffle,
    ]);
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn starting_an_epoch_of_a_hundred_million_samples_stays_small() {
    let t = tempfile::tempdir().unwrap();
    for shuffle in ["block", "none"] {
        let small = sim(t.path(), 100_000, shuffle);
        let big = sim(t.path(), 100_000_000, shuffle);
        assert_eq!(big["samples"], 100_000_000u64, "{big}");
        assert_eq!(big["shards"], 100_000u64, "{big}");
        let (ttfs, rss) = (big["ttfs_s"].as_f64().unwrap(), big["rss_peak_mb"].as_f64().unwrap());
        let rss_small = small["rss_peak_mb"].as_f64().unwrap();
        // The array order held 12 bytes a sample (1.2 GB here) and took seconds to shuffle.
        // Its absence shows in memory (below) and in the table blocks read, not in a time (the
        // time is for `ramjet plan-sim` in benchmarks, docs/benchmarks.md).
        eprintln!("{shuffle}: time to first sample {ttfs:.3} s at 10^8 samples (debug build)");
        assert!(rss < 200.0, "{shuffle}: peak RSS {rss:.0} MB at 10^8 samples: {big}");
        assert!(
            rss < rss_small + 16.0,
            "{shuffle}: peak RSS {rss:.0} MB at 10^8 samples vs {rss_small:.0} MB at 10^5"
        );
        // The shard table is read a block at a time, as the order reaches it.
        let (read, blocks) = (
            big["table_blocks_read"].as_u64().unwrap(),
            big["table_blocks"].as_u64().unwrap(),
        );
        assert_eq!(blocks, 98, "{big}");
        let most = if shuffle == "none" { 2 } else { blocks - 1 };
        assert!(
            read <= most,
            "{shuffle}: {read} of {blocks} table blocks read for the first sample: {big}"
        );
    }
}

/// At 10^9 samples (a million shards, a 48 MB shard table) the first sample of a block-shuffled
/// epoch reads a few of the table's 977 blocks: the first rounds' shards and what the prefetcher
/// has walked ahead (at most 64 shards here), never the table.
#[test]
fn the_first_sample_of_a_billion_reads_a_few_blocks_of_the_shard_table() {
    let t = tempfile::tempdir().unwrap();
    let big = sim(t.path(), 1_000_000_000, "block");
    let (read, blocks) = (
        big["table_blocks_read"].as_u64().unwrap(),
        big["table_blocks"].as_u64().unwrap(),
    );
    assert_eq!(blocks, 977, "{big}");
    assert!((1..=80).contains(&read), "{read} of {blocks} table blocks read: {big}");
    assert!(big["rss_peak_mb"].as_f64().unwrap() < 200.0, "{big}");
}
