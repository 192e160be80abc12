//! The naive models, shared with the proptests of `crates/kvcache/tests/` (not copied). Included
//! once per crate (the fuzz library, or `tests/fuzz_regressions.rs`), as `crate::models`.

#[allow(dead_code)]
#[path = "../../crates/kvcache/tests/model/cache.rs"]
pub mod cache;

#[allow(dead_code)]
#[path = "../../crates/kvcache/tests/model/index.rs"]
pub mod index;
