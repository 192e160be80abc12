//! See `kvtest::fuzz::index_events` (crates/kvtest/src/fuzz/index_events.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|input: kvtest::fuzz::index_events::Input| {
    kvtest::fuzz::index_events::check(&input)
});
