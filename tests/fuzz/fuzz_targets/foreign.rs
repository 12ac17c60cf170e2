//! Fuzzes the MDS and WebDataset readers. Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run foreign` in tests/fuzz.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ramjet_tests::fuzzing::foreign(data));
