//! Fuzzes every shard reading path. Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run shard` in tests/fuzz.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ramjet_tests::fuzzing::shard(data));
