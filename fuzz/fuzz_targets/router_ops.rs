//! See `kvtest::fuzz::router_ops` (crates/kvtest/src/fuzz/router_ops.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|input: kvtest::fuzz::router_ops::Input| {
    kvtest::fuzz::router_ops::check(&input)
});
