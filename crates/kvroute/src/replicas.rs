//! Load shared between router replicas: each replica's routes and finishes, as deltas the others
//! apply to their own load view (see [`Router::apply_load_delta`](crate::Router::apply_load_delta)).

use kvblock::BlockHash;
use kvcache::WorkerId;

use crate::RequestId;

/// One replica's change of in-flight load, to send to the other replicas (feature `serde` for
/// a wire format). Tagged with the replica and its own sequence number.
///
/// ```
/// use kvroute::{LoadChange, LoadDelta, RequestId};
/// let d = LoadDelta::new(1, 0, LoadChange::Finished { request: RequestId::new(7) });
/// assert_eq!((d.replica, d.seq), (1, 0));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct LoadDelta {
    /// The replica that routed or finished the request.
    pub replica: u64,
    /// The replica's sequence number of the delta (0, 1, 2, ...).
    pub seq: u64,
    /// What changed.
    pub change: LoadChange,
}

impl LoadDelta {
    /// A delta of `replica` with sequence number `seq`.
    pub fn new(replica: u64, seq: u64, change: LoadChange) -> Self {
        LoadDelta {
            replica,
            seq,
            change,
        }
    }
}

/// What a [`LoadDelta`] says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(tag = "type", rename_all = "snake_case"))]
#[non_exhaustive]
pub enum LoadChange {
    /// The replica routed `request` with these prompt blocks to `worker`.
    Routed {
        /// The request (its id at that replica).
        request: RequestId,
        /// Where it went.
        worker: WorkerId,
        /// Its prompt's block hashes.
        blocks: Vec<BlockHash>,
        /// The blocks it has to prefill (its uncached ones), counted as the worker's pending
        /// prefill until [`LoadChange::PrefillDone`]; `None` (as from a replica of an earlier
        /// version): counted as decoding at once.
        #[cfg_attr(feature = "serde", serde(default))]
        pending: Option<usize>,
        /// The session it belongs to, which now lives on `worker` at every replica (absent
        /// from replicas of an earlier version).
        #[cfg_attr(
            feature = "serde",
            serde(default, skip_serializing_if = "Option::is_none")
        )]
        session: Option<crate::SessionId>,
    },
    /// The replica saw `request`'s first token: its blocks move from pending prefill to decode
    /// (see [`Router::prefill_done`](crate::Router::prefill_done)).
    PrefillDone {
        /// The request.
        request: RequestId,
    },
    /// The replica finished `request`.
    Finished {
        /// The request.
        request: RequestId,
    },
}
