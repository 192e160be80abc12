//! See `kvtest::fuzz::block_cache_ops` (crates/kvtest/src/fuzz/block_cache_ops.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|input: kvtest::fuzz::block_cache_ops::Input| {
    kvtest::fuzz::block_cache_ops::check(&input)
});
