//! KV-aware request routing: the one cost function, in-flight load tracking, the policies and
//! the [`Router`] facade.
//!
//! Every worker streams its KV-cache events to the router, whose [`kvcache::CacheIndex`] mirrors
//! them. For each request the `Kv` policy scores every worker with [`cost`]:
//!
//! ```text
//! cost(w) = overlap_weight * (request_blocks - cache_hits(w)) + active_blocks(w)
//! ```
//!
//! and the lowest cost wins. `active_blocks(w)` is the number of distinct prompt blocks of the
//! requests routed to `w` and not yet finished (a prefix shared by several counts once).
//!
//! ```
//! use kvroute::{BlockHash, BlockSize, KvEvent, Policy, RequestId, Role, Router, WorkerId};
//!
//! let mut router = Router::builder()
//!     .block_size(BlockSize::new(16)?)
//!     .policy(Policy::Kv)
//!     .overlap_weight(1.0)
//!     .seed(7)
//!     .build()?;
//! let (w0, w1) = (WorkerId::new(0), WorkerId::new(1));
//! router.add_worker(w0);
//! router.add_worker(w1);
//!
//! // Worker 0 reports that it caches an 8-block prefix.
//! let prompt: Vec<BlockHash> = (1..=10).map(BlockHash::new).collect();
//! router.apply_event(w0, 0, &KvEvent::Stored { parent: None, blocks: prompt[..8].to_vec() })?;
//!
//! let d = router.route(RequestId::new(42), &prompt, Role::Unified)?;
//! assert_eq!((d.worker, d.cache_hits, d.cost), (w0, 8, 2.0));
//! router.finish(RequestId::new(42))?;
//! assert_eq!(router.cache_view(w0), 8);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Concurrency
//!
//! A [`Router`] is `Send + Sync` and takes `&mut self` to route, finish and apply events: a
//! multi-threaded server shares it as `Arc<Mutex<Router>>`, routing and finishing from request
//! threads and applying events from the event-subscriber thread. Each call holds the lock for
//! microseconds. See `examples/embed_router.rs`.
//!
//! # Features
//!
//! | feature | default | what it adds | what it costs |
//! |---|---|---|---|
//! | `serde` | off | `Serialize`/`Deserialize` for [`LoadDelta`] (and `kvblock/serde`, `kvcache/serde`) | the `serde` crate |
//!
//! Always needed: `kvcache` (and `kvblock`), `hashbrown`, `xxhash-rust` (the consistent-hash
//! ring), `rand_core` and `rand_xoshiro` (seeded tie-breaking) and `thiserror`. No async
//! runtime, no I/O.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
// No input a caller, an engine or a file supplies may panic the library.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod cost;
mod groups;
mod inflight;
mod predicted;
mod replicas;
mod reported;
mod ring;
mod router;
mod sessions;

use std::fmt;
use std::str::FromStr;

/// The crate's maps: hashbrown with the fixed hasher, so no order that reaches an output varies
/// between runs.
pub(crate) type Map<K, V> = hashbrown::HashMap<K, V, kvcache::FixedState>;

pub use cost::{cost, prefill_aware_cost, BusyThreshold, CostModel, TierCredits};
pub use groups::{CacheGroup, GroupRule};
pub use kvblock::{BlockHash, BlockSize};
pub use kvblock::{ExtraKeys, MultimodalSpan};
pub use kvcache::{KvEvent, Tier, WorkerId};
pub use replicas::{LoadChange, LoadDelta};
pub use reported::ReportedLoad;
pub use router::{Candidate, Decision, Router, RouterBuilder};
pub use sessions::{SessionAffinity, SessionId};

/// A request's identity while it is in flight: chosen by the caller, unique among the requests
/// routed and not yet finished.
///
/// ```
/// use kvroute::RequestId;
/// let id = RequestId::new(7);
/// assert_eq!((id.get(), id.to_string()), (7, "request 7".to_string()));
/// assert_eq!(RequestId::from(7), id);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct RequestId(u64);

impl RequestId {
    /// The id `raw`.
    pub const fn new(raw: u64) -> Self {
        RequestId(raw)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for RequestId {
    fn from(raw: u64) -> Self {
        RequestId(raw)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// What salts a request's block hashes (see [`Router::route_tokens_salted`]): a LoRA adapter's
/// name and a cache namespace, as `kvblock` defines them. An empty string means absent, so
/// `Salt::default()` hashes like the base model.
///
/// ```
/// let salt = kvroute::Salt::lora("my-lora").namespace("tenant-a");
/// assert_eq!((salt.lora_name(), salt.namespace_name()), ("my-lora", "tenant-a"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
#[must_use]
pub struct Salt {
    lora_name: String,
    namespace: String,
}

impl Salt {
    /// The salt of a LoRA adapter's blocks.
    pub fn lora(name: impl Into<String>) -> Self {
        Salt {
            lora_name: name.into(),
            namespace: String::new(),
        }
    }

    /// Adds a cache namespace.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// The LoRA adapter's name (empty: none).
    pub fn lora_name(&self) -> &str {
        &self.lora_name
    }

    /// The cache namespace (empty: none).
    pub fn namespace_name(&self) -> &str {
        &self.namespace
    }

    pub(crate) fn apply(&self, hasher: kvblock::BlockHasher) -> kvblock::BlockHasher {
        hasher
            .with_lora_name(&self.lora_name)
            .with_namespace(&self.namespace)
    }

    /// The chained hashes of every full block of `tokens` under this salt, block `i` keyed by
    /// `keys[i]` (none past the end of `keys`): the blocks [`Router::route_tokens_keyed`] looks
    /// up for such a request, and those an engine with the same keys caches.
    ///
    /// ```
    /// use kvroute::{BlockSize, KvEvent, RequestId, Role, Router, Salt, WorkerId};
    ///
    /// let bs = BlockSize::new(4)?;
    /// let tokens: Vec<u32> = (0..8).collect();
    /// let salt = Salt::lora("my-lora");
    /// let mut router = Router::builder().block_size(bs).build()?;
    /// let w = WorkerId::new(0);
    /// router.add_worker(w);
    /// let blocks = salt.block_hashes(bs, &tokens, &[]);
    /// router.apply_event(w, 0, &KvEvent::Stored { parent: None, blocks })?;
    /// let d = router.route_tokens_keyed(RequestId::new(1), &tokens, &salt, &[], Role::Unified)?;
    /// assert_eq!(d.cache_hits, 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn block_hashes(
        &self,
        block_size: BlockSize,
        tokens: &[u32],
        keys: &[ExtraKeys],
    ) -> Vec<BlockHash> {
        let mut out = Vec::new();
        hash_into(
            &self.apply(kvblock::BlockHasher::new(block_size)),
            tokens,
            keys,
            &mut out,
        );
        out
    }
}

/// Appends the hashes of every full block of `tokens` to `out`, keyed by `keys` (none: the
/// plain, faster loop). The one place the router's lookups are hashed.
#[inline]
pub(crate) fn hash_into(
    hasher: &kvblock::BlockHasher,
    tokens: &[u32],
    keys: &[ExtraKeys],
    out: &mut Vec<BlockHash>,
) {
    if keys.is_empty() {
        hasher.sequence_hashes_into(None, tokens, out);
    } else {
        hasher.sequence_hashes_keyed_into(None, tokens, keys, out);
    }
}

/// How the router picks a worker.
///
/// ```
/// use kvroute::Policy;
/// assert_eq!("prefix_aware".parse::<Policy>()?, Policy::PrefixAware);
/// assert_eq!(Policy::RoundRobin.to_string(), "round_robin");
/// assert!("fastest".parse::<Policy>().is_err());
/// # Ok::<(), kvroute::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Policy {
    /// Lowest [`cost`] wins, with the weight of the request's role.
    #[default]
    Kv,
    /// A consistent-hash ring (with virtual nodes) over the request's first K blocks, so requests
    /// with the same leading blocks share a home worker.
    PrefixAware,
    /// Each worker in turn, in worker-id order.
    RoundRobin,
    /// A uniformly random worker (seeded).
    Random,
}

impl Policy {
    /// Every policy, in the order of the CLI's accepted values.
    pub const ALL: [Policy; 4] = [
        Policy::Kv,
        Policy::PrefixAware,
        Policy::RoundRobin,
        Policy::Random,
    ];

    /// The policy's name as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::PrefixAware => "prefix_aware",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| Error::UnknownPolicy { got: s.to_string() })
    }
}

/// What a request is routed for; prefill and decode may use their own overlap weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Role {
    /// Prefill and decode on the same worker (the global weight).
    #[default]
    Unified,
    /// A prefill worker of a disaggregated deployment.
    Prefill,
    /// A decode worker of a disaggregated deployment.
    Decode,
}

/// Errors of this crate. Each names the offending value and what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Routing with no registered worker.
    #[error("no worker to route to: add a worker first")]
    NoWorkers,
    /// A request id that is already in flight.
    #[error("{request_id} is already in flight: finish it before routing the id again")]
    DuplicateRequest {
        /// The id.
        request_id: RequestId,
    },
    /// Finishing a request id that is not in flight (never routed, or already finished).
    #[error("{request_id} is not in flight (never routed, or already finished)")]
    UnknownRequest {
        /// The id.
        request_id: RequestId,
    },
    /// An event for a worker the router does not know.
    #[error("{worker} is not registered: add it before applying its events")]
    UnknownWorker {
        /// The worker.
        worker: WorkerId,
    },
    /// A weight that is negative, infinite or not a number.
    #[error("invalid {name} {value}: expected a finite number >= 0")]
    InvalidWeight {
        /// Which weight.
        name: &'static str,
        /// The value given.
        value: f64,
    },
    /// A setting outside its range.
    #[error("invalid {name} {value}: expected {expected}")]
    InvalidSetting {
        /// Which setting.
        name: &'static str,
        /// The value given.
        value: u64,
        /// The accepted range.
        expected: &'static str,
    },
    /// A policy name that does not exist.
    #[error(
        "unknown routing policy {got:?}: expected one of kv, prefix_aware, round_robin, random"
    )]
    UnknownPolicy {
        /// The name given.
        got: String,
    },
    /// A cost model name that does not exist.
    #[error("unknown cost model {got:?}: expected seed or prefill-aware")]
    UnknownCostModel {
        /// The name given.
        got: String,
    },
    /// A cache group whose block size is not a whole number of the router's blocks.
    #[error(
        "cache group {group} has block size {block_size}: expected a multiple of the router's block size {router}"
    )]
    GroupBlockSize {
        /// The group.
        group: u32,
        /// Its block size, in tokens.
        block_size: usize,
        /// The router's block size, in tokens.
        router: usize,
    },
    /// A session affinity name that does not exist.
    #[error("unknown session affinity {got:?}: expected off, soft or hard")]
    UnknownSessionAffinity {
        /// The name given.
        got: String,
    },
    /// Hard session affinity, and the session's worker is not routable (down, draining,
    /// removed): the turn cannot go anywhere else.
    #[error("{session} is held by {worker}, which is not routable (hard session affinity)")]
    SessionUnavailable {
        /// The session.
        session: SessionId,
        /// Its worker.
        worker: WorkerId,
    },
    /// An event the cache index rejected.
    #[error(transparent)]
    Index(#[from] kvcache::Error),
}

// The README's example, compiled and run as a doc test so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
