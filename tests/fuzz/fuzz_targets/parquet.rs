//! Fuzzes the Parquet reader (footer, schema, row groups). Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run parquet` in tests/fuzz.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ramjet_tests::fuzzing::parquet(data));
