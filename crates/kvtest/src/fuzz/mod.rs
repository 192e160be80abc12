//! The bodies of the fuzz targets of `fuzz/` (a cargo-fuzz package outside the workspace), one
//! module per target, each with `run(&[u8])` (what the target does with libFuzzer's bytes: it
//! decodes them exactly as `libfuzzer_sys::fuzz_target!` decodes a typed input) and, for the
//! typed targets, `check(&Input)`.
//!
//! `fuzz/fuzz_targets/<target>.rs` are one-line wrappers around these, and the workspace's
//! `tests/fuzz_regressions.rs` replays `fuzz/regressions/<target>/*` and `fuzz/seeds/<target>/*`
//! through `run` under plain `cargo test`.

pub mod block_cache_ops;
pub mod hash_incremental;
pub mod index_events;
#[cfg(feature = "openai")]
pub mod openai_request;
pub mod router_ops;
#[cfg(feature = "sim")]
pub mod trace_line;
#[cfg(feature = "vllm")]
pub mod vllm_decode;
