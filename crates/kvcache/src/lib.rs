//! What an engine holds, and what a router believes every engine holds.
//!
//! - [`BlockCache`]: one engine's capacity-bounded, content-addressed KV block cache. A lookup
//!   returns the longest resident leading run of a prompt's blocks; eviction is LRU and
//!   tail-first, so the resident set is always prefix-closed; pinned blocks (in-flight requests)
//!   are never evicted. Every change is reported as a [`KvEvent`].
//! - [`CacheIndex`]: the router's mirror of many workers' caches, fed by their [`KvEvent`]s, which
//!   answers "how long a leading run of this prompt does each worker hold?" in time proportional to
//!   the matched depth.
//!
//! ```
//! use kvblock::{BlockHasher, BlockSize};
//! use kvcache::{BlockCache, CacheIndex, WorkerId};
//!
//! let hasher = BlockHasher::new(BlockSize::new(4)?);
//! let prompt = hasher.sequence_hashes(&(0..16).collect::<Vec<u32>>()); // 4 blocks
//!
//! let mut engine = BlockCache::new(Some(100));
//! engine.insert(&prompt[..3])?;
//!
//! let mut index = CacheIndex::new();
//! for (id, ev) in engine.drain_events().enumerate() {
//!     index.apply(WorkerId::new(7), id as u64, &ev)?;
//! }
//! assert_eq!(index.overlaps(&prompt).get(WorkerId::new(7)), 3);
//! assert_eq!(engine.match_len(&prompt), 3);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Features
//!
//! | feature | default | what it adds | what it costs |
//! |---|---|---|---|
//! | `serde` | off | `Serialize`/`Deserialize` for [`KvEvent`], [`WorkerId`] and [`IndexSnapshot`] (and `kvblock/serde`) | the `serde` crate |
//!
//! Always needed: `kvblock`, `hashbrown` (with a fixed, seedless hasher: iteration order never
//! depends on the process) and `thiserror`.
#![deny(missing_docs)]
// `unsafe` is denied in the workspace; `prefetch` alone allows it, each block documented.
#![deny(clippy::undocumented_unsafe_blocks)]
// No input a caller, an engine or a file supplies may panic the library.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod blockmap;
mod cache;
mod hasher;
mod index;
mod prefetch;
mod snapshot;
mod tier;
mod workerset;

use std::fmt;

pub use cache::{BlockCache, CacheStats, SlotId};
pub use hasher::FixedState;
pub use index::{Applied, CacheIndex, Overlaps};
pub use kvblock::BlockHash;
pub use snapshot::{IndexSnapshot, WorkerSnapshot, SNAPSHOT_VERSION};
pub use tier::Tier;

/// A worker (engine replica) as the router names it.
///
/// ```
/// let w = kvcache::WorkerId::new(3);
/// assert_eq!(w.get(), 3);
/// assert_eq!(w.to_string(), "worker 3");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct WorkerId(u64);

impl WorkerId {
    /// Wraps a raw id.
    pub const fn new(raw: u64) -> Self {
        WorkerId(raw)
    }

    /// The raw id.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {}", self.0)
    }
}

/// A change to one engine's cache, as the engine reports it to routers.
///
/// ```
/// use kvcache::{BlockHash, KvEvent};
/// let ev = KvEvent::Stored { parent: None, blocks: vec![BlockHash::new(1), BlockHash::new(2)] };
/// assert_eq!(ev.block_count(), 2);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(tag = "type", rename_all = "snake_case"))]
pub enum KvEvent {
    /// A chain of blocks became resident: `blocks[0]` extends `parent` (`None`: it starts a
    /// prompt), each later block extends the one before it.
    Stored {
        /// The resident block the chain extends, if any.
        parent: Option<BlockHash>,
        /// The new blocks, parent first.
        blocks: Vec<BlockHash>,
    },
    /// Blocks were evicted.
    Removed {
        /// The evicted blocks.
        blocks: Vec<BlockHash>,
    },
    /// Every block was dropped (an engine restart or reset).
    Cleared,
}

impl KvEvent {
    /// How many blocks the event names (0 for `Cleared`).
    pub fn block_count(&self) -> usize {
        match self {
            KvEvent::Stored { blocks, .. } | KvEvent::Removed { blocks } => blocks.len(),
            KvEvent::Cleared => 0,
        }
    }
}

/// Errors of this crate. Each names the offending value and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An insert or a capacity change needs more room than eviction can make, because the rest of
    /// the cache is pinned. Nothing was changed.
    #[error(
        "cache full: {needed} block(s) must be evicted but only {evictable} can be \
         (capacity {capacity}, {pinned} pinned)"
    )]
    CapacityExhausted {
        /// Blocks that would have to be evicted.
        needed: usize,
        /// Blocks that could be evicted.
        evictable: usize,
        /// The capacity in blocks.
        capacity: usize,
        /// Resident blocks pinned by in-flight requests.
        pinned: usize,
    },
    /// The hashes given as one prompt's chain contradict what the cache holds: a block appears
    /// twice, a block is resident under a different parent, or a block is resident after a gap.
    /// Sequence hashes from `kvblock` never do this. Nothing was changed.
    #[error("inconsistent chain: block {block} at position {position} {why}")]
    InconsistentChain {
        /// The block.
        block: BlockHash,
        /// Its position in the given chain.
        position: usize,
        /// What is wrong with it.
        why: &'static str,
    },
    /// `clear` while requests still pin blocks. Nothing was changed.
    #[error("cannot clear the cache: {pinned} block(s) are pinned by in-flight requests")]
    Pinned {
        /// Pinned blocks.
        pinned: usize,
    },
    /// An event id at or below one already applied for this worker (a duplicate or a replay).
    /// The event was not applied.
    #[error("{worker}: event id {got} already seen (expected {expected}); not applied")]
    StaleEvent {
        /// The worker.
        worker: WorkerId,
        /// The event's id.
        got: u64,
        /// The next id the index expects.
        expected: u64,
    },
    /// An event with id `u64::MAX`: ids run from 0 to 2^64 - 2, so that the id after every
    /// applied one fits. The event was not applied.
    #[error("{worker}: event id 18446744073709551615 (u64::MAX) is out of range: ids run from 0 to 2^64 - 2; not applied")]
    EventIdOutOfRange {
        /// The worker.
        worker: WorkerId,
    },
    /// A `Stored` event whose parent is not resident on that worker. Nothing was applied; the
    /// worker is marked possibly stale.
    #[error("{worker}: event {event_id} stores blocks under parent {parent}, which it does not hold; not applied")]
    UnknownParent {
        /// The worker.
        worker: WorkerId,
        /// The event's id.
        event_id: u64,
        /// The missing parent.
        parent: BlockHash,
    },
    /// A snapshot that cannot be restored.
    #[error("bad index snapshot: {why}")]
    BadSnapshot {
        /// What is wrong with it.
        why: String,
    },
    /// More workers at once than the index can number (2^24).
    #[error("too many workers: cannot add {worker}, the index holds at most 2^24 at once")]
    TooManyWorkers {
        /// The worker that did not fit.
        worker: WorkerId,
    },
}

// The README's example, compiled and run as a doc test so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
