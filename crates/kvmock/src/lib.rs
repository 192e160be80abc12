//! `kvmock`: one emulated vLLM engine, and `kvload`: trace-driven load against any
//! OpenAI-compatible endpoint.
//!
//! `kvmock` is a real process on real sockets that behaves, to a router and a client, like a
//! vLLM OpenAI server with prefix caching and KV events on, while its "GPU" is the simulator's
//! own engine state machine ([`kvsim::Engine`]: continuous batching, chunked prefill, a
//! `kvcache::BlockCache`, the linear timing model) driven by a clock. The difference from
//! `kvsim` is only who advances time ([`engine_loop::Core`] is the loop without a clock; [`driver`]
//! runs it against the wall clock times `--speedup`).
//!
//! - [`server`]: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming at the
//!   emulated token times, `usage.prompt_tokens_details.cached_tokens`), `GET /v1/models`,
//!   `GET /health`, `GET /metrics` (vLLM's metric names).
//! - [`events`]: vLLM's ZMQ KV-event wire (PUB `[topic, seq, msgpack EventBatch]`, map or
//!   array shape, ROUTER replay), with engine-private block hashes.
//! - the tokenizer, chat template, OpenAI bodies and etcd registration are the serving crate's
//!   (`kvserve`), shared with the router server.
//! - [`load`]: the `kvload` client (open loop at the trace's times, streaming, the simulator's
//!   report).
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod driver;
pub mod engine_loop;
pub mod error;
pub mod events;
pub mod load;
pub mod server;

pub use error::MockError;
