//! See `kvtest::fuzz::vllm_decode` (crates/kvtest/src/fuzz/vllm_decode.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvtest::fuzz::vllm_decode::run(data));
