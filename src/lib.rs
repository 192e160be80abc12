//! kvkit: KV-cache-aware routing of LLM requests, and a fleet simulator that routes with the
//! same code.
//!
//! This facade re-exports the workspace's crates:
//!
//! - [`kvblock`]: token ids to chained XXH3-64 block hashes.
//! - [`kvcache`]: one engine's block cache, and the router's multi-worker cache index.
//! - [`kvroute`]: the cost function, in-flight load tracking, the policies and the `Router`.
//! - [`kvroute_vllm`]: vLLM's and SGLang's KV-event wire, decoded and applied to a `Router`.
//! - [`kvsim`]: the discrete-event fleet simulator (the `kvsim` command is in that crate).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub use kvblock;
pub use kvcache;
pub use kvroute;
pub use kvroute_vllm;
pub use kvsim;

// The Rust snippets of the README and the book, compiled and run as doc tests
// (`cargo test --doc -p kvkit`) so that what a newcomer copies builds; doctest-only items, so
// they add nothing to the crate or its documentation.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeSnippets;

#[cfg(doctest)]
#[doc = include_str!("../docs/src/embedding.md")]
pub struct BookEmbeddingSnippets;
