//! The workers' predicted blocks (see
//! [`RouterBuilder::predicted_ttl`](crate::RouterBuilder::predicted_ttl)), kept as runs.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use kvblock::BlockHash;

use crate::inflight::common_prefix;

/// The blocks predicted on the router's workers: what routed requests will make each worker
/// hold, until its events confirm them or the prediction lapses.
///
/// A routed request predicts the blocks of its prompt after the worker's hits: one contiguous
/// run of a chain, stored here as one entry (the worker's dense index, its position in the
/// chain, its blocks, when it lapses) rather than one map entry per block, so predicting a
/// 128-block prompt costs one copy of its hashes. Sequence hashes name a block *and its
/// position*, so a query asks only the entries that cover its position. A block is predicted on
/// a worker while some entry of that worker not lapsed holds it; a `Stored` event removes the
/// blocks it stores from the worker's entries (cutting entries where needed): exactly the
/// per-block map of (block, latest lapse) this replaces, for lists that keep the sequence-hash
/// contract.
///
/// The entries of all workers are one queue, in the order they were predicted: on one clock and
/// with one time to live, the order they lapse, so pruning pops from the front, and a route
/// scans one contiguous list rather than each worker's.
#[derive(Debug, Clone, Default)]
pub(crate) struct Predicted {
    /// Mostly in the order they lapse: a confirmation that cuts an entry puts the pieces after
    /// the first at the back, and moves the back into an entry it empties. Pruning stops at the
    /// first entry not lapsed, so such an entry may outlive its lapse by up to a time to live;
    /// readers check the lapse.
    runs: VecDeque<Run>,
    /// Block lists of dropped runs, kept for the next ones.
    spare: Vec<Vec<BlockHash>>,
    /// A sorted copy of a `Stored` event's blocks.
    scratch: Vec<BlockHash>,
}

#[derive(Debug, Clone)]
struct Run {
    /// The worker's dense index.
    slot: usize,
    /// Position of `blocks[0]` in its prompt.
    start: usize,
    lapses: Duration,
    /// Never empty.
    blocks: Vec<BlockHash>,
}

impl Run {
    /// Where in `blocks` this run holds `b` as a prompt's block `r`, if it has not lapsed at
    /// `now`.
    #[inline]
    fn holds_at(&self, r: usize, b: BlockHash, now: Duration) -> Option<usize> {
        let at = r.checked_sub(self.start)?;
        (self.lapses > now && self.blocks.get(at) == Some(&b)).then_some(at)
    }
}

/// Block lists kept for reuse.
const SPARE: usize = 64;

impl Predicted {
    /// Whether nothing is predicted (lapsed runs not yet pruned count).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Predicts `blocks`, the blocks at positions `start..` of a prompt, on worker `slot` until
    /// `lapses`.
    pub(crate) fn add(
        &mut self,
        slot: usize,
        start: usize,
        blocks: &[BlockHash],
        lapses: Duration,
    ) {
        if blocks.is_empty() {
            return;
        }
        let mut kept = self.spare.pop().unwrap_or_default();
        kept.extend_from_slice(blocks);
        self.runs.push_back(Run {
            slot,
            start,
            lapses,
            blocks: kept,
        });
    }

    /// Worker `slot`'s events stored `stored`: they are no longer predictions.
    pub(crate) fn confirm(&mut self, slot: usize, stored: &[BlockHash]) {
        if self.runs.is_empty() || stored.is_empty() {
            return;
        }
        let mut set = std::mem::take(&mut self.scratch);
        set.clear();
        set.extend_from_slice(stored);
        set.sort_unstable();
        let confirmed = |b: &BlockHash| set.binary_search(b).is_ok();
        let mut k = 0;
        while let Some(run) = self.runs.get(k) {
            if run.slot != slot || !run.blocks.iter().any(confirmed) {
                k += 1;
                continue;
            }
            // The pieces between confirmed blocks go to the back (and are checked again
            // there, finding nothing); the run moved into `k` is checked next.
            let Some(run) = self.runs.swap_remove_back(k) else {
                break;
            };
            let mut i = 0;
            while i < run.blocks.len() {
                if confirmed(&run.blocks[i]) {
                    i += 1;
                    continue;
                }
                let len = run.blocks[i..]
                    .iter()
                    .position(confirmed)
                    .unwrap_or(run.blocks.len() - i);
                self.add(slot, run.start + i, &run.blocks[i..i + len], run.lapses);
                i += len;
            }
            self.recycle(run.blocks);
        }
        self.scratch = set;
    }

    /// Forgets every prediction on worker `slot`.
    pub(crate) fn clear(&mut self, slot: usize) {
        let spare = &mut self.spare;
        self.runs.retain_mut(|run| {
            if run.slot != slot {
                return true;
            }
            if spare.len() < SPARE {
                let mut blocks = std::mem::take(&mut run.blocks);
                blocks.clear();
                spare.push(blocks);
            }
            false
        });
    }

    /// Forgets every prediction.
    pub(crate) fn clear_all(&mut self) {
        while let Some(run) = self.runs.pop_back() {
            self.recycle(run.blocks);
        }
    }

    /// Drops the runs lapsed at `now` from the front of the queue.
    pub(crate) fn prune(&mut self, now: Duration) {
        while self.runs.front().is_some_and(|run| run.lapses <= now) {
            if let Some(run) = self.runs.pop_front() {
                self.recycle(run.blocks);
            }
        }
    }

    fn recycle(&mut self, mut blocks: Vec<BlockHash>) {
        if self.spare.len() < SPARE {
            blocks.clear();
            self.spare.push(blocks);
        }
    }

    /// Writes into `out` the workers whose leading run over `blocks` a prediction not lapsed at
    /// `now` may extend: those with a run holding `blocks[from(slot)]`, where `from(slot)` is
    /// where the worker's run ends. A worker may be written more than once.
    pub(crate) fn extending(
        &self,
        blocks: &[BlockHash],
        now: Duration,
        from: impl Fn(usize) -> usize,
        out: &mut Vec<usize>,
    ) {
        let (front, back) = self.runs.as_slices();
        // Two plain loops: a chained iterator's `next` would branch between the halves at
        // every run.
        for part in [front, back] {
            for run in part {
                let r = from(run.slot);
                if blocks
                    .get(r)
                    .is_some_and(|&b| run.holds_at(r, b, now).is_some())
                {
                    out.push(run.slot);
                }
            }
        }
    }

    /// Where worker `slot`'s leading run of `blocks` ends when the predictions not lapsed at
    /// `now` count: `from` is the end of the run the worker holds (`holds` says whether it
    /// holds a block), so it does not hold `blocks[from]`; past a predicted block, it may
    /// again.
    pub(crate) fn run(
        &self,
        slot: usize,
        blocks: &[BlockHash],
        from: usize,
        now: Duration,
        holds: impl Fn(BlockHash) -> bool,
    ) -> usize {
        let (front, back) = self.runs.as_slices();
        let mut r = from;
        while let Some(&b) = blocks.get(r) {
            let mut end = r;
            for part in [front, back] {
                for run in part {
                    if run.slot != slot {
                        continue;
                    }
                    if let Some(at) = run.holds_at(r, b, now) {
                        end = end.max(r + common_prefix(&run.blocks[at..], &blocks[r..]));
                    }
                }
            }
            if end > r {
                r = end;
            } else if r > from && holds(b) {
                r += 1;
            } else {
                break;
            }
        }
        r
    }

    /// Distinct blocks predicted on worker `slot` and not lapsed at `now`.
    pub(crate) fn count(&self, slot: usize, now: Duration) -> usize {
        self.runs
            .iter()
            .filter(|run| run.slot == slot && run.lapses > now)
            .flat_map(|run| &run.blocks)
            .collect::<BTreeSet<_>>()
            .len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    /// The chain of `codes` (modulo 3).
    fn path(codes: &[u8]) -> Vec<BlockHash> {
        kvtest::chains::path(codes, 3)
    }

    /// The naive model: each predicted block and its latest lapse.
    #[derive(Default)]
    struct Model(BTreeMap<BlockHash, Duration>);

    impl Model {
        fn run(
            &self,
            b: &[BlockHash],
            from: usize,
            now: Duration,
            held: &BTreeSet<BlockHash>,
        ) -> usize {
            let mut r = from;
            while r < b.len()
                && (self.0.get(&b[r]).is_some_and(|&t| t > now)
                    || (r > from && held.contains(&b[r])))
            {
                r += 1;
            }
            r
        }
    }

    /// Workers of the tests.
    const WORKERS: usize = 3;

    #[derive(Debug, Clone)]
    enum Op {
        /// Predict the blocks of a path from a position on, on a worker, with a time to live.
        Add(usize, Vec<u8>, usize, u8),
        /// A worker's `Stored` event of a path's blocks from a position on (it then holds them).
        Stored(usize, Vec<u8>, usize),
        /// A worker dropped a path's blocks from a position on.
        Removed(usize, Vec<u8>, usize),
        Tick(u8),
        Clear(usize),
        ClearAll,
        Query(Vec<u8>),
    }

    fn op() -> impl Strategy<Value = Op> {
        let codes = || prop::collection::vec(0u8..3, 0..10);
        let w = || 0..WORKERS;
        prop_oneof![
            6 => (w(), codes(), 0usize..6, 1u8..20).prop_map(|(w, c, s, t)| Op::Add(w, c, s, t)),
            3 => (w(), codes(), 0usize..6).prop_map(|(w, c, s)| Op::Stored(w, c, s)),
            1 => (w(), codes(), 0usize..6).prop_map(|(w, c, s)| Op::Removed(w, c, s)),
            2 => (0u8..8).prop_map(Op::Tick),
            1 => w().prop_map(Op::Clear),
            1 => Just(Op::ClearAll),
            4 => codes().prop_map(Op::Query),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Runs against the per-block maps they replace, one per worker: the same leading runs,
        /// the same workers extended, and the same count of predicted blocks after every step.
        #[test]
        fn runs_match_a_map_of_predicted_blocks(ops in prop::collection::vec(op(), 1..80)) {
            let mut p = Predicted::default();
            let mut m: [Model; WORKERS] = Default::default();
            let mut held: [BTreeSet<BlockHash>; WORKERS] = Default::default();
            let mut now = Duration::ZERO;
            for op in ops {
                match op {
                    Op::Add(w, c, s, ttl) => {
                        let b = path(&c);
                        let s = s.min(b.len());
                        let lapses = now + Duration::from_millis(u64::from(ttl));
                        p.add(w, s, &b[s..], lapses);
                        // The router's lapses only grow (one time to live, a monotonic clock):
                        // its map's last lapse of a block is the latest.
                        for &x in &b[s..] {
                            let t = m[w].0.entry(x).or_insert(lapses);
                            *t = (*t).max(lapses);
                        }
                    }
                    Op::Stored(w, c, s) => {
                        let b = path(&c);
                        let s = s.min(b.len());
                        p.confirm(w, &b[s..]);
                        for x in &b[s..] {
                            m[w].0.remove(x);
                            held[w].insert(*x);
                        }
                    }
                    Op::Removed(w, c, s) => {
                        let b = path(&c);
                        for x in &b[s.min(b.len())..] {
                            held[w].remove(x);
                        }
                    }
                    Op::Tick(t) => {
                        now += Duration::from_millis(u64::from(t));
                        if t % 2 == 0 {
                            p.prune(now);
                        }
                    }
                    Op::Clear(w) => {
                        p.clear(w);
                        m[w].0.clear();
                    }
                    Op::ClearAll => {
                        p.clear_all();
                        m.iter_mut().for_each(|m| m.0.clear());
                    }
                    Op::Query(c) => {
                        let b = path(&c);
                        // Each worker's own run: as the index gives it.
                        let from: Vec<usize> = held
                            .iter()
                            .map(|h| b.iter().take_while(|x| h.contains(x)).count())
                            .collect();
                        let mut out = Vec::new();
                        p.extending(&b, now, |w| from[w], &mut out);
                        let extending: BTreeSet<usize> = out.into_iter().collect();
                        for w in 0..WORKERS {
                            let got = p.run(w, &b, from[w], now, |x| held[w].contains(&x));
                            let want = m[w].run(&b, from[w], now, &held[w]);
                            prop_assert_eq!(got, want, "worker {} on {:?}", w, c);
                            prop_assert_eq!(extending.contains(&w), want > from[w], "worker {}", w);
                        }
                    }
                }
                for (w, m) in m.iter().enumerate() {
                    let live = m.0.values().filter(|&&t| t > now).count();
                    prop_assert_eq!(p.count(w, now), live);
                }
            }
        }
    }
}
