//! One worker's predicted blocks (see
//! [`RouterBuilder::predicted_ttl`](crate::RouterBuilder::predicted_ttl)), kept as runs.

use std::collections::BTreeSet;
use std::time::Duration;

use kvblock::BlockHash;

use crate::inflight::common_prefix;

/// The blocks predicted on one worker: what routed requests will make it hold, until its events
/// confirm them or the prediction lapses.
///
/// A routed request predicts the blocks of its prompt after the worker's hits: one contiguous
/// run of a chain, stored here as one entry (its position in the chain, its blocks, when it
/// lapses) rather than one map entry per block, so predicting a 128-block prompt costs one copy
/// of its hashes. Sequence hashes name a block *and its position*, so a query asks only the
/// entries that cover its position. A block is predicted while some entry not lapsed holds it;
/// a `Stored` event removes the blocks it stores from every entry (cutting entries where
/// needed): exactly the per-block map of (block, latest lapse) this replaces, for lists that
/// keep the sequence-hash contract.
#[derive(Debug, Clone, Default)]
pub(crate) struct Predicted {
    runs: Vec<Run>,
    /// Block lists of dropped runs, kept for the next ones.
    spare: Vec<Vec<BlockHash>>,
    /// A sorted copy of a `Stored` event's blocks.
    scratch: Vec<BlockHash>,
}

#[derive(Debug, Clone)]
struct Run {
    /// Position of `blocks[0]` in its prompt.
    start: usize,
    lapses: Duration,
    blocks: Vec<BlockHash>,
}

impl Predicted {
    /// Whether nothing is predicted (lapsed runs not yet pruned count).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Predicts `blocks`, the blocks at positions `start..` of a prompt, until `lapses`.
    pub(crate) fn add(&mut self, start: usize, blocks: &[BlockHash], lapses: Duration) {
        if blocks.is_empty() {
            return;
        }
        let mut kept = self.spare.pop().unwrap_or_default();
        kept.extend_from_slice(blocks);
        self.runs.push(Run {
            start,
            lapses,
            blocks: kept,
        });
    }

    /// The worker's events stored `stored`: they are no longer predictions.
    pub(crate) fn confirm(&mut self, stored: &[BlockHash]) {
        if self.runs.is_empty() || stored.is_empty() {
            return;
        }
        let mut set = std::mem::take(&mut self.scratch);
        set.clear();
        set.extend_from_slice(stored);
        set.sort_unstable();
        let confirmed = |b: &BlockHash| set.binary_search(b).is_ok();
        let mut k = 0;
        while k < self.runs.len() {
            if !self.runs[k].blocks.iter().any(confirmed) {
                k += 1;
                continue;
            }
            // The pieces between confirmed blocks go to the end (and are checked again there,
            // finding nothing); the run swapped into `k` is checked next.
            let run = self.runs.swap_remove(k);
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
                self.add(run.start + i, &run.blocks[i..i + len], run.lapses);
                i += len;
            }
            self.recycle(run.blocks);
        }
        self.scratch = set;
    }

    /// Forgets every prediction.
    pub(crate) fn clear(&mut self) {
        while let Some(run) = self.runs.pop() {
            self.recycle(run.blocks);
        }
    }

    /// Drops the runs lapsed at `now`.
    pub(crate) fn prune(&mut self, now: Duration) {
        let mut k = 0;
        while k < self.runs.len() {
            if self.runs[k].lapses <= now {
                let run = self.runs.swap_remove(k);
                self.recycle(run.blocks);
            } else {
                k += 1;
            }
        }
    }

    fn recycle(&mut self, mut blocks: Vec<BlockHash>) {
        if self.spare.len() < 16 {
            blocks.clear();
            self.spare.push(blocks);
        }
    }

    /// Where the leading run of `blocks` ends when the predictions not lapsed at `now` count:
    /// `from` is the end of the run the worker holds (`holds` says whether it holds a block),
    /// so it does not hold `blocks[from]`; past a predicted block, it may again.
    pub(crate) fn run(
        &self,
        blocks: &[BlockHash],
        from: usize,
        now: Duration,
        holds: impl Fn(BlockHash) -> bool,
    ) -> usize {
        let mut r = from;
        while let Some(&b) = blocks.get(r) {
            let mut end = r;
            for run in &self.runs {
                let Some(at) = r.checked_sub(run.start) else {
                    continue;
                };
                if run.lapses > now && run.blocks.get(at) == Some(&b) {
                    end = end.max(r + common_prefix(&run.blocks[at..], &blocks[r..]));
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

    /// Distinct blocks predicted and not lapsed at `now`.
    pub(crate) fn count(&self, now: Duration) -> usize {
        self.runs
            .iter()
            .filter(|run| run.lapses > now)
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

    #[derive(Debug, Clone)]
    enum Op {
        /// Predict the blocks of a path from a position on, with a time to live.
        Add(Vec<u8>, usize, u8),
        /// A `Stored` event of a path's blocks from a position on (the worker then holds them).
        Stored(Vec<u8>, usize),
        /// The worker dropped a path's blocks from a position on.
        Removed(Vec<u8>, usize),
        Tick(u8),
        Clear,
        Query(Vec<u8>),
    }

    fn op() -> impl Strategy<Value = Op> {
        let codes = || prop::collection::vec(0u8..3, 0..10);
        prop_oneof![
            4 => (codes(), 0usize..6, 1u8..20).prop_map(|(c, s, t)| Op::Add(c, s, t)),
            2 => (codes(), 0usize..6).prop_map(|(c, s)| Op::Stored(c, s)),
            1 => (codes(), 0usize..6).prop_map(|(c, s)| Op::Removed(c, s)),
            2 => (0u8..8).prop_map(Op::Tick),
            1 => Just(Op::Clear),
            4 => codes().prop_map(Op::Query),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Runs against the per-block map they replace: the same leading runs and the same
        /// count of predicted blocks after every step.
        #[test]
        fn runs_match_a_map_of_predicted_blocks(ops in prop::collection::vec(op(), 1..60)) {
            let mut p = Predicted::default();
            let mut m = Model::default();
            let mut held = BTreeSet::new();
            let mut now = Duration::ZERO;
            for op in ops {
                match op {
                    Op::Add(c, s, ttl) => {
                        let b = path(&c);
                        let s = s.min(b.len());
                        let lapses = now + Duration::from_millis(u64::from(ttl));
                        p.add(s, &b[s..], lapses);
                        // The router's lapses only grow (one time to live, a monotonic clock):
                        // its map's last lapse of a block is the latest.
                        for &x in &b[s..] {
                            let t = m.0.entry(x).or_insert(lapses);
                            *t = (*t).max(lapses);
                        }
                    }
                    Op::Stored(c, s) => {
                        let b = path(&c);
                        let s = s.min(b.len());
                        p.confirm(&b[s..]);
                        for x in &b[s..] {
                            m.0.remove(x);
                            held.insert(*x);
                        }
                    }
                    Op::Removed(c, s) => {
                        let b = path(&c);
                        for x in &b[s.min(b.len())..] {
                            held.remove(x);
                        }
                    }
                    Op::Tick(t) => {
                        now += Duration::from_millis(u64::from(t));
                        if t % 2 == 0 {
                            p.prune(now);
                        }
                    }
                    Op::Clear => {
                        p.clear();
                        m.0.clear();
                    }
                    Op::Query(c) => {
                        let b = path(&c);
                        // The worker's own run: as the index gives it.
                        let from = b.iter().take_while(|x| held.contains(x)).count();
                        let got = p.run(&b, from, now, |x| held.contains(&x));
                        prop_assert_eq!(got, m.run(&b, from, now, &held), "{:?}", c);
                    }
                }
                let live = m.0.values().filter(|&&t| t > now).count();
                prop_assert_eq!(p.count(now), live);
            }
        }
    }
}
