//! See `fuzz/src/trace_line.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvkit_fuzz::trace_line::run(data));
