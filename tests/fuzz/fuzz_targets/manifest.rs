//! Fuzzes the manifest parser. Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run manifest` in tests/fuzz.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ramjet_tests::fuzzing::manifest(data));
