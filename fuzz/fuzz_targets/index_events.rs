//! See `fuzz/src/index_events.rs`.
#![no_main]

use kvkit_fuzz::index_events::{check, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input| check(&input));
