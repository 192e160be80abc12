//! A naive model of `kvcache::CacheIndex` (a set of blocks per worker, the next expected event
//! id, the stale flag), the operation enum [`Op`], and the differential [`step`] that drives the
//! real index and the model with the same operation, then compares everything observable.
//!
//! One model, one `Op`: the proptest `crates/kvcache/tests/index_model.rs` generates `Op`s with
//! [`strategy::op`], the fuzz target `index_events` ([`crate::fuzz::index_events`]) decodes them
//! from bytes, and the router model ([`crate::router`]) mirrors its router's index with
//! [`Model`].
//!
//! ```
//! use kvblock::BlockHash;
//! use kvcache::{CacheIndex, KvEvent};
//! use kvtest::index::{step, Model, Op};
//!
//! let (mut real, mut model) = (CacheIndex::new(), Model::default());
//! let stored = KvEvent::Stored { parent: None, blocks: vec![BlockHash::new(1)] };
//! for op in [
//!     Op::Apply { worker: 3, id_delta: 0, event: stored },
//!     Op::Query(vec![BlockHash::new(1), BlockHash::new(2)]),
//!     Op::Restore,
//! ] {
//!     step(&mut real, &mut model, &op).unwrap();
//! }
//! ```

use std::collections::{BTreeMap, BTreeSet};

use kvblock::BlockHash;
use kvcache::{Applied, CacheIndex, Error, KvEvent, WorkerId};

/// One worker of the [`Model`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MWorker {
    /// The blocks it holds.
    pub blocks: BTreeSet<BlockHash>,
    /// The next event id it expects.
    pub next: u64,
    /// Whether its view may be incomplete (a gap or an unknown parent since the last `Cleared`).
    pub stale: bool,
}

/// `(gap, stored, already_present, removed, unknown_removed)`, as [`Applied`] reports them.
pub type Outcome = (Option<(u64, u64)>, usize, usize, usize, usize);

/// Why the model rejects an event (the real error must be of the same kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// `Error::StaleEvent`: an id at or below one already applied.
    Stale,
    /// `Error::UnknownParent`: a `Stored` under a parent the worker does not hold.
    Parent,
    /// `Error::EventIdOutOfRange`: the id `u64::MAX`.
    OutOfRange,
}

/// The naive index: registered workers in id order, each a plain set.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Model {
    /// The registered workers.
    pub workers: BTreeMap<WorkerId, MWorker>,
    /// Every block an accepted `Stored` event named, with the parent it was stored under
    /// (`None`: the first block of a chain). Sequence hashes give a block one parent, so the
    /// first record is the only one.
    pub parents: BTreeMap<BlockHash, Option<BlockHash>>,
}

impl Model {
    /// The same accept/reject rules as `CacheIndex::apply` (registering an unknown worker).
    pub fn apply(&mut self, w: WorkerId, id: u64, ev: &KvEvent) -> Result<Outcome, Reject> {
        let st = self.workers.entry(w).or_default();
        if id == u64::MAX {
            return Err(Reject::OutOfRange);
        }
        if id < st.next {
            return Err(Reject::Stale);
        }
        let gap = (id > st.next).then_some((st.next, id));
        st.stale |= gap.is_some();
        st.next = id + 1;
        match ev {
            KvEvent::Stored { parent, blocks } => {
                if let Some(p) = parent {
                    if !st.blocks.contains(p) {
                        st.stale = true;
                        return Err(Reject::Parent);
                    }
                }
                let (mut new, mut present) = (0, 0);
                let mut up = *parent;
                for b in blocks {
                    self.parents.entry(*b).or_insert(up);
                    up = Some(*b);
                    if st.blocks.insert(*b) {
                        new += 1
                    } else {
                        present += 1
                    }
                }
                Ok((gap, new, present, 0, 0))
            }
            KvEvent::Removed { blocks } => {
                let (mut rem, mut unk) = (0, 0);
                for b in blocks {
                    if st.blocks.remove(b) {
                        rem += 1
                    } else {
                        unk += 1
                    }
                }
                Ok((gap, 0, 0, rem, unk))
            }
            KvEvent::Cleared => {
                let n = st.blocks.len();
                st.blocks.clear();
                st.stale = false;
                Ok((gap, 0, 0, n, 0))
            }
        }
    }
    /// `clear_worker`: forgets the blocks, keeps the id sequence; returns how many it held.
    pub fn clear(&mut self, w: WorkerId) -> usize {
        self.workers.get_mut(&w).map_or(0, |s| {
            s.stale = false;
            std::mem::take(&mut s.blocks).len()
        })
    }
    /// Whether worker `w`'s blocks are prefix-closed: each one's parent is held too.
    pub fn closed(&self, w: WorkerId) -> bool {
        self.workers.get(&w).is_none_or(|s| {
            s.blocks.iter().all(|b| {
                self.parents
                    .get(b)
                    .copied()
                    .flatten()
                    .is_none_or(|p| s.blocks.contains(&p))
            })
        })
    }
    /// `blocks` without the ones that would not be leaves of worker `w` when removed in order
    /// (a block it holds that a block it keeps extends): a `Removed` event of an engine that
    /// evicts tail first, for `CacheIndex::set_tail_first`.
    pub fn leaves_only(&self, w: WorkerId, blocks: &[BlockHash]) -> Vec<BlockHash> {
        let mut held = self
            .workers
            .get(&w)
            .map(|s| s.blocks.clone())
            .unwrap_or_default();
        let mut out = Vec::new();
        for b in blocks {
            let extended = held
                .iter()
                .any(|c| self.parents.get(c).copied().flatten() == Some(*b));
            if !extended {
                held.remove(b);
                out.push(*b);
            }
        }
        out
    }
    /// The leading run of `q` that worker `w` holds (0 for an unknown worker).
    pub fn run(&self, w: WorkerId, q: &[BlockHash]) -> usize {
        self.workers
            .get(&w)
            .map_or(0, |s| q.iter().take_while(|b| s.blocks.contains(b)).count())
    }
}

/// Compares a real `apply` result with the model's: the same `Applied` counts, or an error of the
/// same kind naming event `id`.
pub fn same_outcome(
    r: &Result<Applied, Error>,
    m: &Result<Outcome, Reject>,
    id: u64,
) -> Result<(), String> {
    match (r, m) {
        (Ok(a), Ok(o)) => {
            let got = (
                a.gap,
                a.stored,
                a.already_present,
                a.removed,
                a.unknown_removed,
            );
            if got != *o {
                return Err(format!("applied {got:?}, model {o:?}"));
            }
        }
        (Err(Error::StaleEvent { got, .. }), Err(Reject::Stale)) if *got == id => {}
        (Err(Error::UnknownParent { event_id, .. }), Err(Reject::Parent)) if *event_id == id => {}
        (Err(Error::EventIdOutOfRange { .. }), Err(Reject::OutOfRange)) => {}
        (r, m) => return Err(format!("real {r:?}, model {m:?}")),
    }
    Ok(())
}

/// One operation on an index. The proptest generates these with [`strategy::op`], the fuzz target
/// decodes them from bytes.
#[derive(Debug, Clone)]
pub enum Op {
    /// `apply` with the id the model expects next, plus `id_delta` (saturating).
    Apply {
        /// The raw worker id.
        worker: u64,
        /// Added to the next expected id: 0 is in order, < 0 a replay, > 0 a gap.
        id_delta: i8,
        /// The event.
        event: KvEvent,
    },
    /// `apply` with this exact id.
    ApplyAt {
        /// The raw worker id.
        worker: u64,
        /// The event id.
        id: u64,
        /// The event.
        event: KvEvent,
    },
    /// `add_worker`.
    Add(u64),
    /// `remove_worker`.
    Remove(u64),
    /// `clear_worker`.
    Clear(u64),
    /// `overlaps` and `overlaps_into` of this chain.
    Query(Vec<BlockHash>),
    /// Replace the real index with `CacheIndex::restore(index.snapshot())`.
    Restore,
}

/// Applies `op` to the real index and the model, then compares answers, the registered workers,
/// every worker's block count, stale flag, next event id and held blocks, the totals, and runs
/// `check_invariants`. `Err` describes the first disagreement.
pub fn step(real: &mut CacheIndex, model: &mut Model, op: &Op) -> Result<(), String> {
    match op {
        Op::Apply {
            worker,
            id_delta,
            event,
        } => {
            let w = WorkerId::new(*worker);
            let next = model.workers.get(&w).map_or(0, |s| s.next);
            let id = next.saturating_add_signed(i64::from(*id_delta));
            apply(real, model, w, id, event).map_err(|e| format!("{op:?} (id {id}): {e}"))?;
        }
        Op::ApplyAt { worker, id, event } => {
            apply(real, model, WorkerId::new(*worker), *id, event)
                .map_err(|e| format!("{op:?}: {e}"))?;
        }
        Op::Add(w) => {
            let w = WorkerId::new(*w);
            let i = real.add_worker(w).map_err(|e| format!("{op:?}: {e}"))?;
            model.workers.entry(w).or_default();
            if real.worker_at(i) != Some(w) || real.worker_index(w) != Some(i) {
                return Err(format!("{op:?}: dense index {i} does not name {w}"));
            }
        }
        Op::Remove(w) => {
            let w = WorkerId::new(*w);
            let (r, m) = (real.remove_worker(w), model.workers.remove(&w).is_some());
            if r != m {
                return Err(format!("{op:?}: real {r}, model {m}"));
            }
        }
        Op::Clear(w) => {
            let w = WorkerId::new(*w);
            let (r, m) = (real.clear_worker(w), model.clear(w));
            if r != m {
                return Err(format!("{op:?}: real {r}, model {m}"));
            }
        }
        Op::Query(q) => {
            let ov = real.overlaps(q);
            let mut reused = kvcache::Overlaps::new();
            real.overlaps_into(&[BlockHash::new(u64::MAX)], &mut reused);
            real.overlaps_into(q, &mut reused);
            for &w in model.workers.keys() {
                let want = model.run(w, q);
                let i = real.worker_index(w).ok_or(format!("{w} not registered"))?;
                let got = (ov.get(w), ov.run_at(i), reused.get(w), reused.run_at(i));
                if got != (want, want, want, want) {
                    return Err(format!("{op:?}: {w} runs {got:?}, model {want}"));
                }
            }
            let matched = model
                .workers
                .keys()
                .filter(|w| model.run(**w, q) > 0)
                .count();
            let max = model.workers.keys().map(|w| model.run(*w, q)).max();
            if ov.iter().count() != matched || ov.max() != max.unwrap_or(0) {
                return Err(format!(
                    "{op:?}: {} matched (max {}), model {matched} (max {max:?})",
                    ov.iter().count(),
                    ov.max()
                ));
            }
            if ov
                .iter()
                .any(|(w, r)| r == 0 || !model.workers.contains_key(&w))
                || ov.iter().zip(ov.iter().skip(1)).any(|(a, b)| a.1 > b.1)
            {
                return Err(format!(
                    "{op:?}: bad iter {:?}",
                    ov.iter().collect::<Vec<_>>()
                ));
            }
        }
        Op::Restore => {
            *real = CacheIndex::restore(real.snapshot()).map_err(|e| format!("{op:?}: {e}"))?;
        }
    }
    check(real, model).map_err(|e| format!("after {op:?}: {e}"))
}

fn apply(
    real: &mut CacheIndex,
    model: &mut Model,
    w: WorkerId,
    id: u64,
    event: &KvEvent,
) -> Result<(), String> {
    let r = real.apply(w, id, event);
    let m = model.apply(w, id, event);
    same_outcome(&r, &m, id)
}

/// Everything the index reports, against the model.
pub fn check(real: &CacheIndex, model: &Model) -> Result<(), String> {
    real.check_invariants()?;
    let workers: Vec<WorkerId> = model.workers.keys().copied().collect();
    if real.workers() != workers || real.worker_count() != workers.len() {
        return Err(format!("workers {:?}, model {workers:?}", real.workers()));
    }
    for (w, s) in &model.workers {
        let got = (
            real.block_count(*w),
            real.is_stale(*w),
            real.next_event_id(*w),
        );
        let want = (s.blocks.len(), s.stale, Some(s.next));
        if got != want {
            return Err(format!(
                "{w}: (blocks, stale, next id) {got:?}, model {want:?}"
            ));
        }
        if let Some(b) = s.blocks.iter().find(|b| !real.holds(*w, **b)) {
            return Err(format!("{w} does not hold {b}"));
        }
        // Queries probe a worker the index deems hole-free at strides: it must be so.
        if !real.may_have_holes(*w) && !model.closed(*w) {
            return Err(format!(
                "{w} is not prefix-closed, yet the index says it has no holes"
            ));
        }
        let i = real.worker_index(*w).ok_or(format!("{w} has no index"))?;
        if real.worker_at(i) != Some(*w) || i >= real.index_bound() {
            return Err(format!("{w}: dense index {i} is wrong"));
        }
    }
    let snap = real.snapshot();
    let listed: Vec<_> = snap
        .workers
        .iter()
        .map(|w| (w.worker, w.next_event_id, w.stale, w.blocks.clone()))
        .collect();
    let want: Vec<_> = model
        .workers
        .iter()
        .map(|(w, s)| {
            (
                *w,
                s.next,
                s.stale,
                s.blocks.iter().copied().collect::<Vec<_>>(),
            )
        })
        .collect();
    if snap.version != kvcache::SNAPSHOT_VERSION || listed != want {
        return Err(format!("snapshot {snap:?}, model {want:?}"));
    }
    let pairs: usize = model.workers.values().map(|s| s.blocks.len()).sum();
    let distinct: BTreeSet<BlockHash> = model
        .workers
        .values()
        .flat_map(|s| s.blocks.iter().copied())
        .collect();
    if (real.pairs(), real.distinct_blocks()) != (pairs, distinct.len()) {
        return Err(format!(
            "pairs/distinct {:?}, model {:?}",
            (real.pairs(), real.distinct_blocks()),
            (pairs, distinct.len())
        ));
    }
    Ok(())
}

/// Proptest strategies for [`Op`].
pub mod strategy {
    use kvblock::BlockHash;
    use kvcache::KvEvent;
    use proptest::prelude::*;

    use super::Op;

    /// Mostly up to 11 codes of a 2-letter alphabet, so that paths (see [`crate::chains`])
    /// overlap often; else a prefix of one of three fixed 90-code paths and up to 3 codes of
    /// its own: long shared chains, on which the index's strided probes skip many blocks and
    /// its searches end runs anywhere, and removals punch holes deep inside.
    pub fn codes() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            3 => prop::collection::vec(0u8..2, 0..12),
            1 => (0u64..3, 0usize..90, prop::collection::vec(0u8..2, 0..4)).prop_map(
                |(base, len, tail)| {
                    let mut codes: Vec<u8> = (0..len as u64).map(|i| long_code(base, i)).collect();
                    codes.extend(tail);
                    codes
                }
            ),
        ]
    }

    /// Code `i` of fixed long path `base`: scrambled bits, so the three paths part early.
    fn long_code(base: u64, i: u64) -> u8 {
        let x = (base.wrapping_add(1))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        ((x ^ (x >> 29)) >> 63) as u8
    }

    /// A chain of sequence hashes: the path of [`codes`].
    pub fn blocks() -> impl Strategy<Value = Vec<BlockHash>> {
        codes().prop_map(|c| crate::chains::path(&c, 2))
    }

    /// Mostly events in order (some replays and gaps), queries, and now and then worker
    /// registration changes and a snapshot round trip.
    pub fn op() -> impl Strategy<Value = Op> {
        // Worker ids spread over two bitset words (0..3 and 64..67) and a far one.
        let worker = prop_oneof![0u64..3, 64u64..67, Just(200u64)];
        // Stores of whole paths or of their tails under a parent, removals of a path's tail
        // (a middle stretch or a whole path leaves holes where a longer chain stays).
        let event = prop_oneof![
            4 => (prop::option::weighted(0.5, any::<u8>()), codes())
                .prop_map(|(split, c)| crate::chains::stored(&c, split, 2)),
            1 => (codes(), any::<u8>()).prop_map(|(c, from)| crate::chains::removed(&c, from, 2)),
            1 => (codes(), any::<u8>()).prop_map(|(c, at)| crate::chains::removed_one(&c, at, 2)),
            1 => Just(KvEvent::Cleared),
        ];
        prop_oneof![
            8 => (worker.clone(), prop_oneof![8 => Just(0i8), 1 => -2i8..0, 1 => 1i8..3], event)
                .prop_map(|(worker, id_delta, event)| Op::Apply { worker, id_delta, event }),
            1 => worker.clone().prop_map(Op::Remove),
            1 => worker.clone().prop_map(Op::Clear),
            1 => worker.prop_map(Op::Add),
            3 => blocks().prop_map(Op::Query),
            1 => Just(Op::Restore),
        ]
    }
}
