//! [`MirrorSnapshot`]: a router's index and its [`VllmIngest`] feeds as plain data, with the
//! position in each worker's event stream they reflect, so that a restarted router (or a new
//! replica) restores it and replays each stream from that position to reach the live state.

use kvcache::{IndexSnapshot, WorkerId};

use super::ingest::{Feed, FeedSnapshot};
use super::{VllmError, VllmIngest};
use kvroute::Router;

/// The [`MirrorSnapshot`] format this version of the crate writes and reads.
pub const MIRROR_SNAPSHOT_VERSION: u32 = 1;

/// A router's cache index and the vLLM feeds that fill it, as plain data (feature `serde` for a
/// wire format). Take it with [`VllmIngest::snapshot`], restore it with
/// [`VllmIngest::restore`], then apply each worker's batches from after its
/// [`FeedSnapshot::position`]: the router and adapter are then exactly those of a router that
/// never stopped.
///
/// What it holds, per worker: the index's view (blocks, next event id, stale flag), the next
/// batch sequence number, the engine-hash to our-hash map of the group the index mirrors, and
/// the caller's stream position ([`VllmIngest::set_position`]). Not held, so they refill from
/// events after a restore, as with [`Router::restore_index`]: the other KV-cache groups of
/// hybrid models, the lower tiers (CPU offload), the counters ([`VllmIngest::stats`]) and
/// data-parallel rank assignments. In-flight load is never part of a snapshot.
///
/// ```
/// use kvroute_vllm::{BlockStored, EngineEvent, EngineHash, EventBatch, VllmIngest};
/// use kvroute::{Router, WorkerId};
///
/// let builder = || Router::builder().block_size(kvblock::BlockSize::new(4).unwrap());
/// let w = WorkerId::new(3);
/// let batch = |hash: u64, parent: Option<u64>, first: u32| {
///     let stored = BlockStored::new(vec![EngineHash::Int(hash)], parent.map(EngineHash::Int),
///         (first..first + 4).collect(), 4);
///     EventBatch::new(0.0, vec![EngineEvent::BlockStored(stored)])
/// };
/// let (mut live, mut ingest) = (builder().build()?, VllmIngest::new());
/// live.add_worker(w);
/// ingest.apply_batch(&mut live, w, Some(0), &batch(11, None, 0))?;
/// ingest.set_position(w, Some(100)); // e.g. the stream's sequence number of that batch
///
/// let snapshot = ingest.snapshot(&live);
/// ingest.apply_batch(&mut live, w, Some(1), &batch(12, Some(11), 4))?;
///
/// // A restarted router: restore, then replay what came after position 100.
/// let mut restarted = builder().build()?;
/// let mut again = VllmIngest::restore(&mut restarted, snapshot)?;
/// assert_eq!(again.position(w), Some(100));
/// again.apply_batch(&mut restarted, w, Some(1), &batch(12, Some(11), 4))?;
/// assert_eq!(restarted.snapshot_index(), live.snapshot_index());
/// assert_eq!(again.snapshot(&restarted), ingest.snapshot(&live));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct MirrorSnapshot {
    /// The format version ([`MIRROR_SNAPSHOT_VERSION`]).
    pub version: u32,
    /// The router's block size, tokens: our hashes depend on it, so a router of another size
    /// cannot use them.
    pub block_size: usize,
    /// The router's cache index.
    pub index: IndexSnapshot,
    /// One entry per worker with a feed, in worker-id order.
    pub feeds: Vec<FeedSnapshot>,
}

impl VllmIngest {
    /// Records `worker`'s position in its event stream (for example the sequence number of the
    /// transport's message that carried the last batch applied), kept in snapshots.
    pub fn set_position(&mut self, worker: WorkerId, position: Option<u64>) {
        self.feed_mut(worker).position = position;
    }

    /// `worker`'s stream position, as last set with [`set_position`](Self::set_position).
    pub fn position(&self, worker: WorkerId) -> Option<u64> {
        self.feed(worker).and_then(|f| f.position)
    }

    /// A snapshot of `router`'s index and of this adapter's feeds (see [`MirrorSnapshot`]).
    pub fn snapshot(&self, router: &Router) -> MirrorSnapshot {
        // Only the router's workers: a feed left by a worker removed meanwhile mirrors nothing.
        let feeds = self
            .workers()
            .into_iter()
            .filter(|&w| router.index().worker_index(w).is_some())
            .filter_map(|w| self.feed(w).map(|f| f.snapshot(w)))
            .collect();
        MirrorSnapshot {
            version: MIRROR_SNAPSHOT_VERSION,
            block_size: router.block_size().get(),
            index: router.snapshot_index(),
            feeds,
        }
    }

    /// Restores `snapshot` into `router` ([`Router::restore_index`]: meant for a router that
    /// is starting) and returns the adapter that goes with it. An unknown version, a feed listed
    /// twice, a feed of a worker the index does not list, an engine hash listed twice, or a block
    /// size other than the router's is an error, and then `router` is unchanged.
    pub fn restore(router: &mut Router, snapshot: MirrorSnapshot) -> Result<VllmIngest, VllmError> {
        let bad = |why: String| VllmError::BadSnapshot { why };
        if snapshot.version != MIRROR_SNAPSHOT_VERSION {
            return Err(bad(format!(
                "version {} (expected {MIRROR_SNAPSHOT_VERSION})",
                snapshot.version
            )));
        }
        if snapshot.block_size != router.block_size().get() {
            return Err(bad(format!(
                "block size {} (the router's is {})",
                snapshot.block_size,
                router.block_size().get()
            )));
        }
        let mut ingest = VllmIngest::new();
        for f in snapshot.feeds {
            if !snapshot.index.workers.iter().any(|w| w.worker == f.worker) {
                return Err(bad(format!(
                    "a feed of worker {} that the index does not list",
                    f.worker
                )));
            }
            if ingest.feed(f.worker).is_some() {
                return Err(bad(format!("worker {} has two feeds", f.worker)));
            }
            let worker = f.worker;
            let feed = Feed::restore(f)
                .map_err(|h| bad(format!("worker {worker}: engine hash {h} is listed twice")))?;
            ingest.insert_feed(worker, feed);
        }
        router.restore_index(snapshot.index)?;
        Ok(ingest)
    }
}
