//! See `fuzz/src/hash_incremental.rs`.
#![no_main]

use kvkit_fuzz::hash_incremental::{check, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input| check(&input));
