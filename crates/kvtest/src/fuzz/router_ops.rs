//! `router_ops`: a `kvroute::Router` built with any policy and random settings (including
//! invalid weights, which `build()` must reject), then any sequence of [`Op`]s, against the
//! router model of [`crate::router`] (the model the proptest of `crates/kvroute/tests/router.rs`
//! uses): decisions (worker, hits, cost, policy), errors, load (`active_blocks`, `in_flight`,
//! `in_flight_total`), the index against the index model, `explain`, after every step.

use arbitrary::{Arbitrary, Unstructured};

pub use crate::router::{Input, Op};

/// Steps per input.
pub const MAX_OPS: usize = 300;

/// Runs one input; panics on the first disagreement with the model.
pub fn check(input: &Input) {
    crate::router::check(input, MAX_OPS);
}

/// What the fuzz target does with its bytes, for replaying regressions under `cargo test`.
pub fn run(data: &[u8]) {
    if data.len() < <Input as Arbitrary>::size_hint(0).0 {
        return;
    }
    if let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) {
        check(&input);
    }
}
