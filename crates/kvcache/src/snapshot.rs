//! Versioned snapshots of a [`CacheIndex`], so a restarted router or a new replica starts warm.

use kvblock::BlockHash;

use crate::{CacheIndex, Error, WorkerId};

/// The snapshot format this version of the crate writes and reads.
pub const SNAPSHOT_VERSION: u32 = 1;

/// Everything a [`CacheIndex`] knows, as plain data: per worker, its next expected event id,
/// whether it is possibly stale, and the blocks it holds. Serialize it with any serde format
/// (behind the `serde` feature); [`CacheIndex::restore`] checks it before using it.
///
/// Workers are in id order and blocks in hash order, so equal indexes give equal snapshots.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct IndexSnapshot {
    /// The format version ([`SNAPSHOT_VERSION`]).
    pub version: u32,
    /// One entry per registered worker.
    pub workers: Vec<WorkerSnapshot>,
    /// The blocks' run hints (how far the event that first stored a block went on, which
    /// [`CacheIndex::overlaps`] probes first), in hash order, hints of 0 left out. They change
    /// no run of blocks stored as chained sequence hashes, only where a query looks; a
    /// snapshot written without them reads as none.
    #[cfg_attr(feature = "serde", serde(default))]
    pub run_hints: Vec<(BlockHash, u16)>,
}

/// One worker of an [`IndexSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct WorkerSnapshot {
    /// The worker.
    pub worker: WorkerId,
    /// The next event id the index expects from it.
    pub next_event_id: u64,
    /// Whether its events were skipped or rejected since it was last cleared.
    pub stale: bool,
    /// The blocks it holds, in hash order.
    pub blocks: Vec<BlockHash>,
    /// Whether its mirror may have holes (see [`CacheIndex::may_have_holes`]); a snapshot
    /// written without the field reads as `true`, the safe value. [`CacheIndex::restore`]
    /// trusts it (blocks carry no parents to check it against): `false` on blocks that are
    /// not prefix-closed makes the worker's runs overcount.
    #[cfg_attr(feature = "serde", serde(default = "holes_unknown"))]
    pub may_have_holes: bool,
}

#[cfg(feature = "serde")]
fn holes_unknown() -> bool {
    true
}

impl CacheIndex {
    /// A snapshot of everything the index holds.
    ///
    /// ```
    /// use kvcache::{BlockHash, CacheIndex, KvEvent, WorkerId};
    /// let mut index = CacheIndex::new();
    /// let blocks = vec![BlockHash::new(1), BlockHash::new(2)];
    /// index.apply(WorkerId::new(4), 0, &KvEvent::Stored { parent: None, blocks: blocks.clone() })?;
    ///
    /// let restored = CacheIndex::restore(index.snapshot())?;
    /// assert_eq!(restored.overlaps(&blocks).get(WorkerId::new(4)), 2);
    /// assert_eq!(restored.next_event_id(WorkerId::new(4)), Some(1));
    /// # Ok::<(), kvcache::Error>(())
    /// ```
    pub fn snapshot(&self) -> IndexSnapshot {
        let mut per: Vec<Vec<BlockHash>> = vec![Vec::new(); self.index_bound()];
        for (block, holders) in self.holders() {
            for i in holders {
                if let Some(v) = per.get_mut(i) {
                    v.push(block);
                }
            }
        }
        let mut workers: Vec<WorkerSnapshot> = per
            .into_iter()
            .enumerate()
            .filter_map(|(i, mut blocks)| {
                let id = self.worker_at(i)?;
                blocks.sort_unstable();
                Some(WorkerSnapshot {
                    worker: id,
                    next_event_id: self.next_event_id(id).unwrap_or(0),
                    stale: self.is_stale(id),
                    may_have_holes: self.may_have_holes(id),
                    blocks,
                })
            })
            .collect();
        workers.sort_unstable_by_key(|w| w.worker);
        let mut run_hints: Vec<(BlockHash, u16)> = self
            .run_hints()
            .filter(|&(_, h)| h > 0)
            .map(|(b, h)| (b, u16::try_from(h).unwrap_or(u16::MAX)))
            .collect();
        run_hints.sort_unstable();
        IndexSnapshot {
            version: SNAPSHOT_VERSION,
            workers,
            run_hints,
        }
    }

    /// An index rebuilt from a snapshot. An unknown version, a worker listed twice, a block
    /// listed twice for one worker, or a run hint for a block no worker holds is an error
    /// ([`Error::BadSnapshot`]).
    pub fn restore(snapshot: IndexSnapshot) -> Result<Self, Error> {
        if snapshot.version != SNAPSHOT_VERSION {
            return Err(Error::BadSnapshot {
                why: format!(
                    "version {} is not supported (this build reads version {SNAPSHOT_VERSION})",
                    snapshot.version
                ),
            });
        }
        let mut index = CacheIndex::new();
        for w in snapshot.workers {
            if index.worker_index(w.worker).is_some() {
                return Err(Error::BadSnapshot {
                    why: format!("{} is listed twice", w.worker),
                });
            }
            index.add_worker(w.worker)?;
            let stored = index.restore_worker(
                w.worker,
                w.next_event_id,
                w.stale,
                w.may_have_holes,
                &w.blocks,
            );
            if stored != w.blocks.len() {
                return Err(Error::BadSnapshot {
                    why: format!("{} lists a block twice", w.worker),
                });
            }
        }
        for (block, hint) in snapshot.run_hints {
            if !index.set_run_hint(block, usize::from(hint)) {
                return Err(Error::BadSnapshot {
                    why: format!("a run hint for {block}, which no worker holds"),
                });
            }
        }
        Ok(index)
    }
}
