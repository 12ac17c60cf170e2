//! Fuzzes the wire parsers. Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run wire` in tests/fuzz.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| ramjet_tests::fuzzing::wire(data));
