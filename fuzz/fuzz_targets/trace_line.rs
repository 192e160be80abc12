//! See `kvtest::fuzz::trace_line` (crates/kvtest/src/fuzz/trace_line.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvtest::fuzz::trace_line::run(data));
