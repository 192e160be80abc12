//! The bodies of the fuzz targets, one module per target, each with `run(&[u8])` (what the
//! target does with libFuzzer's bytes) and `check(&Input)`.
//!
//! The modules are plain files so that the workspace's `tests/fuzz_regressions.rs` can include
//! them with `#[path]` and replay `fuzz/regressions/<target>/*` under `cargo test`. The naive
//! models come from `crates/kvcache/tests/model/` (shared with the proptests) through
//! [`models`], which an including crate must declare at its root as `mod models;`.

pub mod models;

pub mod block_cache_ops;
pub mod hash_incremental;
pub mod index_events;
pub mod router_ops;
pub mod trace_line;
