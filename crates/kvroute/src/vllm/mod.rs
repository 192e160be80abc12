//! vLLM KV-event ingestion (feature `vllm`): decode the engine's MessagePack event batches and
//! apply them to a [`Router`].
//!
//! vLLM (`--kv-events-config` with the ZMQ publisher) sends one ZMQ multipart message per batch of
//! cache changes: `(topic, 8-byte big-endian sequence number, payload)`, where the payload is a
//! MessagePack `EventBatch`:
//!
//! ```text
//! [timestamp, [event, ...], data_parallel_rank?]
//! BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?, lora_name?
//! BlockRemoved     block_hashes, medium?
//! AllBlocksCleared
//! ```
//!
//! Each event is either an array whose first element names it (`["BlockStored", [...], ...]`,
//! msgspec's tagged array form) or a map with a `"type"` key and the fields by name. Engine block
//! hashes are integers (a negative `i64` is taken as its bit pattern) or byte strings. Extra fields
//! and trailing elements are ignored, so newer engines still decode.
//!
//! Engine hashes are not ours: vLLM hashes with its own function (and may mix in multimodal
//! inputs or a cache salt). [`VllmIngest`] therefore re-hashes each stored block's `token_ids`
//! with [`kvblock`] at the router's block size (salted with `lora_name`), chained from *our* hash
//! of the engine's parent, and remembers engine hash -> our hash per worker so that a later
//! `BlockRemoved` can name the same blocks.
//!
//! ```
//! use kvblock::{BlockHasher, BlockSize};
//! use kvroute::vllm::{BlockStored, EngineEvent, EngineHash, EventBatch, VllmIngest};
//! use kvroute::{RequestId, Role, Router, WorkerId};
//!
//! let mut router = Router::builder().block_size(BlockSize::new(4)?).build()?;
//! let (w0, w1) = (WorkerId::new(0), WorkerId::new(1));
//! router.add_worker(w0);
//! router.add_worker(w1);
//!
//! // Worker 0's engine stored the 3 blocks of these 12 tokens under its own hashes 11, 12, 13.
//! let tokens: Vec<u32> = (100..112).collect();
//! let stored = BlockStored::new(
//!     vec![EngineHash::Int(11), EngineHash::Int(12), EngineHash::Int(13)],
//!     None,
//!     tokens.clone(),
//!     4,
//! );
//! let payload = EventBatch::new(0.5, vec![EngineEvent::BlockStored(stored)]).to_msgpack();
//!
//! // The ZMQ frames: topic, sequence number, payload.
//! let mut ingest = VllmIngest::new();
//! let seq = 0u64.to_be_bytes();
//! let summary = ingest.apply_multipart(&mut router, w0, &[&b""[..], &seq[..], &payload[..]])?;
//! assert_eq!((summary.events_applied, summary.blocks_stored), (1, 3));
//!
//! // The router now finds the prefix on worker 0.
//! let d = router.route_tokens(RequestId::new(1), &tokens, Role::Unified)?;
//! assert_eq!((d.worker, d.cache_hits), (w0, 3));
//! let ours = BlockHasher::new(router.block_size()).sequence_hashes(&tokens);
//! assert_eq!(ingest.our_hash(w0, &EngineHash::Int(13)), Some(ours[2]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Sequence numbers and router event ids
//!
//! The router's index wants one id per [`KvEvent`] (0, 1, 2, ... per worker) while a batch has
//! one sequence number and any number of events. [`VllmIngest`] numbers the router events itself
//! and uses the batch sequence number only to detect trouble:
//!
//! - the expected number (the previous one plus 1; 0 at first): applied normally;
//! - a larger one (batches were missed): applied, and one router id is skipped so the index
//!   records a gap and marks the worker possibly stale;
//! - 0 when a larger one was expected (the publisher restarted): the worker's blocks are cleared
//!   and the batch is applied as the first of a new stream;
//! - any other smaller one (a duplicate or a replay): rejected with
//!   [`VllmError::DuplicateSequence`].
//!
//! A batch that does not decode or validate is rejected whole before anything changes, and its
//! sequence number is not consumed.
//!
//! # Limits
//!
//! - A `BlockStored` whose engine parent was never seen (the router joined late, or batches were
//!   missed) cannot be re-hashed, because our hash of a block depends on our hash of its parent:
//!   it is skipped, counted in [`IngestSummary::unknown_parents`], and the worker is marked
//!   possibly stale (the next router event id is skipped).
//! - `lora_id` without `lora_name` hashes as no adapter. [`Router::route_tokens`] hashes without a
//!   LoRA salt; route LoRA requests with [`Router::route`] and a salted [`BlockHasher`].
//! - `medium` and `data_parallel_rank` are decoded but not interpreted: give each data-parallel
//!   rank (or each medium you track) its own [`WorkerId`].
//! - The engine-to-ours map of a worker grows by the blocks stored and shrinks by the blocks
//!   removed; removals lost in missed batches stay until the worker is cleared (by an
//!   `AllBlocksCleared`, a publisher restart, or [`VllmIngest::forget_worker`]).
//!
//! [`Router`]: crate::Router
//! [`Router::route`]: crate::Router::route
//! [`Router::route_tokens`]: crate::Router::route_tokens
//! [`KvEvent`]: kvcache::KvEvent
//! [`BlockHasher`]: kvblock::BlockHasher
//! [`WorkerId`]: kvcache::WorkerId

// The module by idea: `error` (what can go wrong), `wire` (the engine's types and how each field
// is encoded), `decode` (network bytes into those types), `ingest` (applying them to a Router).
mod decode;
mod error;
mod ingest;
mod wire;

pub use decode::{decode_event_batch, parse_seq_frame};
pub use error::VllmError;
pub use ingest::{IngestStats, IngestSummary, VllmIngest};
pub use wire::{BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch};
