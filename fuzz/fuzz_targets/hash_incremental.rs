//! See `kvtest::fuzz::hash_incremental` (crates/kvtest/src/fuzz/hash_incremental.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|input: kvtest::fuzz::hash_incremental::Input| {
    kvtest::fuzz::hash_incremental::check(&input)
});
