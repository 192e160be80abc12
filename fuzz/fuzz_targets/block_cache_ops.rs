//! See `fuzz/src/block_cache_ops.rs`.
#![no_main]

use kvkit_fuzz::block_cache_ops::{check, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input| check(&input));
