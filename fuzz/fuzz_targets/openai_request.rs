//! See `kvtest::fuzz::openai_request` (crates/kvtest/src/fuzz/openai_request.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvtest::fuzz::openai_request::run(data));
