//! Serving parts shared by kvkit's router server (`kvrouter`) and its engine emulator
//! (`kvmock`), so that the router links no part of the emulator or the simulator:
//!
//! - [`openai`]: what a router or an engine reads of an OpenAI completions or chat request body
//!   (prompt text or token ids, chat messages and their media parts, model, `stream`,
//!   `max_tokens`, vLLM's `cache_salt`), with errors naming the field;
//! - [`keys`]: the one rule that keys a request's blocks besides its tokens (LoRA adapter,
//!   `cache_salt`, where media cut a chat prompt), for the router and the emulator alike;
//! - [`tokenize`]: a Hugging Face `tokenizer.json` and the chat template of
//!   `tokenizer_config.json` (minijinja), or one token per byte without a tokenizer: the router's
//!   tokens must be the engine's, or its block hashes are not the engine's;
//! - [`clock`]: waiting until an instant on time, for the emulator's engine and `kvload`;
//! - [`logging`]: the serving binaries' log lines, text or JSON, filtered by `RUST_LOG`;
//! - [`etcd`]: the record a worker registers for discovery and a minimal client of etcd's v3
//!   JSON gateway.
//!
//! # Features
//!
//! | feature | default | what it adds | what it costs |
//! |---|---|---|---|
//! | `tokenize` | on | [`tokenize`] | the `tokenizers`, `minijinja` and `xxhash-rust` crates |
//! | `clock` | on | [`clock`] | `nix` on Linux (the timer slack) |
//! | `logging` | on | [`logging`] | `tracing-subscriber` |
//! | `etcd` | on | [`etcd`] | `tokio`, `hyper` (a client), `serde`, `base64` |
//!
//! [`openai`] and [`keys`] are always there (they need `serde_json` and kvkit's routing crates).
//!
//! ```
//! # #[cfg(feature = "tokenize")] {
//! use kvserve::openai::{parse, Endpoint, Input};
//! use kvserve::tokenize::prompt_tokens;
//!
//! let req = parse(Endpoint::Completions, br#"{"model": "m", "prompt": "hi"}"#)?;
//! assert_eq!(req.input, Input::Text("hi".into()));
//! // A completions prompt through an encoder (here one token per byte).
//! let tokens = prompt_tokens(&req.input, |s| Ok(s.bytes().map(u32::from).collect()))?;
//! assert_eq!(tokens, [104, 105]);
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]
// No input a caller, a client or a file supplies may panic the library.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

#[cfg(feature = "clock")]
pub mod clock;
mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod keys;
#[cfg(feature = "logging")]
pub mod logging;
pub mod openai;
#[cfg(feature = "tokenize")]
pub mod tokenize;

pub use error::Error;

// The README's example, compiled and run as a doc test so that it stays true (it tokenises).
#[cfg(all(doctest, feature = "tokenize"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
