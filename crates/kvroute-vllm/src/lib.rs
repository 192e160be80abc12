//! vLLM's and SGLang's KV-event wire for kvkit's router: decode the engines' MessagePack event
//! batches and apply them to a [`kvroute::Router`].
//!
//! vLLM (`--kv-events-config` with the ZMQ publisher) sends one ZMQ multipart message per batch of
//! cache changes: `(topic, 8-byte big-endian sequence number, payload)`, where the payload is a
//! MessagePack `EventBatch`:
//!
//! ```text
//! [timestamp, [event, ...], data_parallel_rank?]
//! BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?, lora_name?,
//!                  extra_keys?, group_idx?, kv_cache_spec_kind?, kv_cache_spec_sliding_window?,
//!                  lookahead_token_ids?
//! BlockRemoved     block_hashes, medium?, group_idx?
//! AllBlocksCleared
//! ```
//!
//! SGLang publishes the same batches (`attn_dp_rank` in the third place) as tagged arrays. Its
//! `BlockStoredWithMetadata` shares the `BlockStored` tag and adds the request's cache salt as a
//! map, `{"cache_salt": ...}` (read into [`BlockStored::cache_salt`]): in its first layout right
//! after `medium` (where vLLM has `lora_name`), in its later one after every positional field
//! (`locality` and `ownership` follow `kv_cache_spec_sliding_window`; a string there is SGLang's
//! `locality`, not a lookahead), with the salt also in each block's extra keys behind
//! [`SGLANG_CACHE_SALT_PREFIX`]. Either way ingestion keys the prompt's first block with the salt,
//! as a request with `cache_salt` is keyed ([`kvblock::vllm_extra_keys`]); a map shape may carry
//! it under `metadata`.
//!
//! Each event is either an array whose first element names it (`["BlockStored", [...], ...]`,
//! msgspec's tagged array form) or a map with a `"type"` key and the fields by name. Engine block
//! hashes are integers (a negative `i64` is taken as its bit pattern) or byte strings. Extra fields
//! and trailing elements are ignored, so newer engines still decode.
//!
//! Engine hashes are not ours: vLLM hashes with its own function. [`VllmIngest`] therefore
//! re-hashes each stored block's `token_ids` with [`kvblock`] at the router's block size (salted
//! with `lora_name`, and keyed by the block's `extra_keys`), chained from *our* hash of the
//! engine's parent, and remembers engine hash -> our hash per worker and group so that a later
//! `BlockRemoved` can name the same blocks.
//!
//! # KV-cache groups (hybrid models)
//!
//! A model with several layer kinds (full and sliding-window attention, attention and Mamba)
//! has one KV-cache group per kind; vLLM sends one `BlockStored`/`BlockRemoved` per group with
//! `group_idx`, the *same* hashes in every group, and the group's kind on stores. Each group's
//! residency is kept apart, so a removal in one group never drops another's copy:
//!
//! - the first full-attention group at the router's block size (normally group 0) is mirrored
//!   by the router's index, as a single-group engine is;
//! - every other group becomes a [`CacheGroup`](kvroute::CacheGroup) of the router, with the rule
//!   of its kind: `sliding_window`/`sliding_window_mla` (with `kv_cache_spec_sliding_window`),
//!   `mamba` (the state at the hit point), `full_attention`/`mla_attention`/
//!   `sink_full_attention`; an unknown kind, or a sliding window without its size, is treated
//!   as full attention and counted in [`IngestSummary::unknown_group_kinds`];
//! - a group whose block size is a multiple of the router's is tracked at its own size; one
//!   whose block size is not (or a larger-block group with extra keys) is accepted and counted
//!   in [`IngestSummary::untracked_blocks`], and does not limit hits. Only the group the router
//!   hashes with (group 0, or no group, of full attention) must be at the router's block size.
//!
//! The hit the router predicts is the one vLLM's hybrid coordinator finds: the longest prefix
//! that every group can serve (see [`CacheGroup`](kvroute::CacheGroup)).
//!
//! # Extra keys (multimodal prompts, cache salts)
//!
//! An image enters a prompt as placeholder tokens that are equal for every image; vLLM keeps
//! their blocks apart with per-block `extra_keys` (multimodal identifiers with offsets, the cache
//! salt, prompt-embedding digests, the LoRA name). Ingestion keys our hash of each block by its
//! extra keys ([`kvblock::ExtraKeys`]; the LoRA name, which vLLM lists first, salts the hasher
//! instead, so it is not hashed twice). Route such requests with
//! [`Router::route_tokens_keyed`](kvroute::Router::route_tokens_keyed) and the request's keys
//! ([`kvblock::vllm_extra_keys`]); a request without keys never hits blocks stored with keys.
//!
//! ```
//! use kvblock::{BlockHasher, BlockSize};
//! use kvroute_vllm::{BlockStored, EngineEvent, EngineHash, EventBatch, VllmIngest};
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
//! - `u64::MAX` (the number after it would not fit): rejected with
//!   [`VllmError::SequenceOutOfRange`].
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
//! - `lookahead_token_ids` (lookahead hashing: per block, the tokens after it that also keyed the
//!   engine's hash of it; vLLM 0.33 writes `list[list[int]]`, one list per block, and an older
//!   flat list is read as one list) are decoded, not hashed: our hash of a block names the block and its whole
//!   prefix, which is what a later request must share for a hit. An engine that keys one of our
//!   blocks by more than that stores it under several engine hashes; ingestion counts them per
//!   block and removes ours with the last.
//! - The router's hits count up to every full block of a request; an engine recomputes at least
//!   the last prompt token, so for a prompt that ends on a block boundary it reuses one block
//!   less. The difference is the same on every worker and does not change a decision.
//! - A router index snapshot holds the index's group only; the other groups refill from events.
//! - `data_parallel_rank`: each rank of a data-parallel engine has its own cache and publishes
//!   its own stream; give each rank its own [`WorkerId`] with
//!   [`VllmIngest::set_rank_worker`] and its batches apply to that worker's mirror. Without
//!   it, every rank's batches apply to the engine's worker, as if it were one cache.
//! - `medium`: a `BlockStored` or `BlockRemoved` of another medium than the GPU (vLLM's
//!   offloading connector: `CPU`, `STORAGE`; `DISK`) applies to the router's mirror of that
//!   [`Tier`] ([`Router::apply_tier_event`]), credited by [`TierCredits`] where the device's run
//!   ends. Such a block carries no tokens: it is mapped through the device's engine-to-ours map
//!   or another lower tier's, so one offloaded after both forgot it is counted in
//!   [`IngestSummary::untracked_blocks`], and so are offloaded blocks larger than ours (one
//!   hash for several of our blocks).
//! - The engine-to-ours map of a worker grows by the blocks stored and shrinks by the blocks
//!   removed; removals lost in missed batches stay until the worker is cleared (by an
//!   `AllBlocksCleared`, a publisher restart, or [`VllmIngest::forget_worker`]).
//!
//! [`Router`]: kvroute::Router
//! [`Router::route`]: kvroute::Router::route
//! [`Router::route_tokens`]: kvroute::Router::route_tokens
//! [`KvEvent`]: kvcache::KvEvent
//! [`BlockHasher`]: kvblock::BlockHasher
//! [`WorkerId`]: kvcache::WorkerId
//! [`Tier`]: kvcache::Tier
//! [`TierCredits`]: kvroute::TierCredits
//! [`Router::apply_tier_event`]: kvroute::Router::apply_tier_event

#![deny(missing_docs)]
#![forbid(unsafe_code)]
// No input an engine or a file supplies may panic the library.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

/// Maps with a fixed hasher: no OS-seeded state in anything that must reproduce.
pub(crate) type Map<K, V> = hashbrown::HashMap<K, V, kvcache::FixedState>;

// The module by idea: `error` (what can go wrong), `wire` (the engine's types and how each field
// is encoded), `decode` (network bytes into those types), `ingest` (applying them to a Router).
mod decode;
mod error;
mod ingest;
mod snapshot;
mod wire;

pub use decode::{decode_event_batch, parse_replay_seq, parse_seq_frame, seq_frame, REPLAY_END};
pub use error::VllmError;
pub use ingest::{FeedSnapshot, IngestStats, IngestSummary, VllmIngest};
pub use snapshot::{MirrorSnapshot, MIRROR_SNAPSHOT_VERSION};
pub use wire::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, KeyValue,
    SGLANG_CACHE_SALT_PREFIX,
};

// The README's example, compiled and run as a doc test so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
