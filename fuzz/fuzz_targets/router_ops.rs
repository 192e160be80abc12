//! See `fuzz/src/router_ops.rs`.
#![no_main]

use kvkit_fuzz::router_ops::{check, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input| check(&input));
