//! The distinct prompt blocks in flight on one worker, kept as a path-compressed trie.

use hashbrown::hash_map::Entry;
use kvblock::BlockHash;

use crate::Map;

/// The union of the block chains of the requests in flight on one worker, and its size.
///
/// Sequence hashes name a block *and its whole prefix*, so the prompts in flight form a trie:
/// two prompts share block `i` only if they share every block before it. The trie is kept with
/// path compression: a segment is a run of blocks that the same requests pass, found by the
/// hash of its first block. Adding a prompt walks its segments (one map lookup each, then a
/// comparison of contiguous hashes), splits the one it leaves in the middle and stores its new
/// tail as one segment; releasing it walks the same way. A 128-block prompt costs a few lookups,
/// not 128 reference counts, and the count of distinct blocks is exact under the contract.
///
/// Lists that break the contract (a hash after two different parents, a hash twice in one
/// list) never make the count too low or leave a finished list counted. Where one would make a
/// segment start at a hash another segment starts at, the tracker turns into one reference
/// count per block (exact for any lists, as slow as before the trie) until the worker has
/// nothing in flight; other breaches may count a block more than once while the lists sharing
/// it are in flight.
#[derive(Debug, Clone, Default)]
pub(crate) struct InFlightBlocks {
    /// Segment slot by the hash of the segment's first block.
    starts: Map<BlockHash, u32>,
    segs: Vec<Segment>,
    free: Vec<u32>,
    /// Block lists of freed segments, kept for the next ones.
    spare: Vec<Vec<BlockHash>>,
    /// Distinct blocks: the segments' lengths summed.
    len: usize,
    /// Lists added and not yet released.
    lists: usize,
    /// A reference count per block instead of the trie, once a list broke the contract in a
    /// way the trie cannot hold; `None` again when the worker is idle.
    exact: Option<Map<BlockHash, u32>>,
}

#[derive(Debug, Clone, Default)]
struct Segment {
    blocks: Vec<BlockHash>,
    /// Lists in flight that pass the whole segment.
    refs: u32,
}

/// How many leading elements `a` and `b` share.
#[inline]
pub(crate) fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Whether `list` starts with `seg`: every pair compared without an early exit, which the
/// compiler turns into wide compares (a segment is most often a whole prompt's tail).
#[inline]
fn starts_with(list: &[BlockHash], seg: &[BlockHash]) -> bool {
    list.len() >= seg.len()
        && list
            .iter()
            .zip(seg)
            .fold(0, |acc, (a, b)| acc | (a.get() ^ b.get()))
            == 0
}

impl InFlightBlocks {
    /// Distinct blocks in flight.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Adds one request's blocks.
    pub(crate) fn add(&mut self, blocks: &[BlockHash]) {
        self.lists += 1;
        if self.exact.is_some() {
            self.add_exact(blocks);
            return;
        }
        let mut pos = 0;
        while let Some(&first) = blocks.get(pos) {
            let rest = &blocks[pos..];
            let Some(&s) = self.starts.get(&first) else {
                self.new_segment(rest, 1);
                return;
            };
            let seg = &self.segs[s as usize];
            // At least 1: the segment starts with `first`.
            let shared = common_prefix(&seg.blocks, rest).max(1);
            if shared < seg.blocks.len() {
                if self.starts.contains_key(&seg.blocks[shared]) {
                    // Outside the contract: the tail would start where another segment does.
                    // `blocks[..pos]` is already counted, whole segments of the trie.
                    self.count_exactly();
                    self.add_exact(rest);
                    return;
                }
                self.split(s, shared);
            }
            let seg = &mut self.segs[s as usize];
            seg.refs = seg.refs.saturating_add(1);
            pos += shared;
        }
    }

    /// Releases one request's blocks, as they were added.
    pub(crate) fn release(&mut self, blocks: &[BlockHash]) {
        self.lists = self.lists.saturating_sub(1);
        if self.lists == 0 {
            // Nothing in flight: whatever lists outside the contract left behind goes too.
            self.clear();
            return;
        }
        if let Some(counts) = &mut self.exact {
            for b in blocks {
                if let Entry::Occupied(mut e) = counts.entry(*b) {
                    *e.get_mut() -= 1;
                    if *e.get() == 0 {
                        e.remove();
                    }
                }
            }
            self.len = counts.len();
            return;
        }
        let mut pos = 0;
        while let Some(first) = blocks.get(pos) {
            let Some(&s) = self.starts.get(first) else {
                return;
            };
            let seg = &mut self.segs[s as usize];
            if !starts_with(&blocks[pos..], &seg.blocks) {
                // A guard: with no start ever shared (see `add`), a list retraces the segments
                // it was added through, however they were split since.
                return;
            }
            pos += seg.blocks.len();
            seg.refs = seg.refs.saturating_sub(1);
            if seg.refs == 0 {
                self.free_segment(s);
            }
        }
    }

    /// Forgets everything, keeping the allocations.
    pub(crate) fn clear(&mut self) {
        for seg in self.segs.drain(..) {
            let mut blocks = seg.blocks;
            if blocks.capacity() > 0 {
                blocks.clear();
                self.spare.push(blocks);
            }
        }
        self.starts.clear();
        self.free.clear();
        self.len = 0;
        self.lists = 0;
        self.exact = None;
    }

    /// Turns the trie into a reference count per block: each segment's blocks once per list
    /// passing it.
    fn count_exactly(&mut self) {
        let mut counts: Map<BlockHash, u32> = Map::default();
        for &s in self.starts.values() {
            let seg = &self.segs[s as usize];
            for &b in &seg.blocks {
                let n = counts.entry(b).or_insert(0);
                *n = n.saturating_add(seg.refs);
            }
        }
        let lists = self.lists;
        self.clear();
        self.lists = lists;
        self.len = counts.len();
        self.exact = Some(counts);
    }

    fn add_exact(&mut self, blocks: &[BlockHash]) {
        let counts = self.exact.get_or_insert_with(Map::default);
        for &b in blocks {
            let n = counts.entry(b).or_insert(0);
            *n = n.saturating_add(1);
        }
        self.len = counts.len();
    }

    fn new_segment(&mut self, blocks: &[BlockHash], refs: u32) -> u32 {
        let mut v = self.spare.pop().unwrap_or_default();
        v.extend_from_slice(blocks);
        let seg = Segment { blocks: v, refs };
        let s = match self.free.pop() {
            Some(s) => {
                self.segs[s as usize] = seg;
                s
            }
            None => {
                self.segs.push(seg);
                (self.segs.len() - 1) as u32
            }
        };
        self.len += blocks.len();
        // Outside the contract a segment may already start there: it is then no longer
        // reachable, and stays counted until the worker is idle.
        self.starts.insert(blocks[0], s);
        s
    }

    /// Cuts segment `s` after `at` blocks; the tail keeps its references.
    fn split(&mut self, s: u32, at: usize) {
        let seg = &mut self.segs[s as usize];
        let refs = seg.refs;
        let mut tail = self.spare.pop().unwrap_or_default();
        tail.extend_from_slice(&seg.blocks[at..]);
        seg.blocks.truncate(at);
        // `new_segment` counts the tail's blocks again: they were counted in `s`.
        self.len -= tail.len();
        self.new_segment(&tail, refs);
        tail.clear();
        self.spare.push(tail);
    }

    fn free_segment(&mut self, s: u32) {
        let seg = &mut self.segs[s as usize];
        let mut blocks = std::mem::take(&mut seg.blocks);
        self.len -= blocks.len();
        if let Some(&first) = blocks.first() {
            if self.starts.get(&first) == Some(&s) {
                self.starts.remove(&first);
            }
        }
        blocks.clear();
        self.spare.push(blocks);
        self.free.push(s);
    }

    /// Checks the bookkeeping (every segment reachable by its first block, non-empty and
    /// referenced, the count their lengths' sum); property tests call it after every step.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        if let Some(counts) = &self.exact {
            return if self.starts.is_empty() && counts.len() == self.len {
                Ok(())
            } else {
                Err(format!(
                    "exact mode: {} counted, {} blocks",
                    self.len,
                    counts.len()
                ))
            };
        }
        let mut sum = 0;
        for (first, &s) in &self.starts {
            let seg = self
                .segs
                .get(s as usize)
                .ok_or_else(|| format!("{first} maps to a missing segment {s}"))?;
            if seg.blocks.first() != Some(first) || seg.refs == 0 {
                return Err(format!("segment {s} under {first} is {seg:?}"));
            }
            sum += seg.blocks.len();
        }
        if sum != self.len {
            return Err(format!("counted {} blocks, segments hold {sum}", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use kvblock::{chain, LocalBlockHash};
    use proptest::prelude::*;

    use super::*;

    /// The chain of `codes` (modulo 3): lists that start alike share their leading blocks.
    fn path(codes: &[u8]) -> Vec<BlockHash> {
        let mut parent = None;
        codes
            .iter()
            .map(|&c| {
                let h = chain(parent, LocalBlockHash::new(u64::from(c % 3)));
                parent = Some(h);
                h
            })
            .collect()
    }

    /// The naive model: a reference count per distinct block.
    #[derive(Default)]
    struct Model(HashMap<BlockHash, u32>);

    impl Model {
        fn add(&mut self, blocks: &[BlockHash]) {
            for &b in blocks {
                *self.0.entry(b).or_default() += 1;
            }
        }

        fn release(&mut self, blocks: &[BlockHash]) {
            for b in blocks {
                let n = self.0.get_mut(b).expect("added");
                *n -= 1;
                if *n == 0 {
                    self.0.remove(b);
                }
            }
        }
    }

    /// The same step on the tracker and the model: add `blocks` (always when nothing is in
    /// flight), or release the live list at `pick`.
    fn step(
        (t, m, live): (&mut InFlightBlocks, &mut Model, &mut Vec<Vec<BlockHash>>),
        add: bool,
        blocks: Vec<BlockHash>,
        pick: prop::sample::Index,
    ) {
        if add || live.is_empty() {
            t.add(&blocks);
            m.add(&blocks);
            live.push(blocks);
        } else {
            let blocks = live.swap_remove(pick.index(live.len()));
            t.release(&blocks);
            m.release(&blocks);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Chains added and released in any order: the count equals the model's distinct
        /// blocks after every step.
        #[test]
        fn counts_the_distinct_blocks_of_chains(
            ops in prop::collection::vec(
                (any::<bool>(), prop::collection::vec(0u8..3, 0..14), any::<prop::sample::Index>()),
                1..120,
            ),
        ) {
            let mut t = InFlightBlocks::default();
            let mut m = Model::default();
            let mut live: Vec<Vec<BlockHash>> = Vec::new();
            for (add, codes, pick) in ops {
                step((&mut t, &mut m, &mut live), add, path(&codes), pick);
                t.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert_eq!(t.len(), m.0.len());
            }
            for blocks in live.drain(..) {
                t.release(&blocks);
                m.release(&blocks);
                prop_assert_eq!(t.len(), m.0.len());
            }
            prop_assert_eq!(t.len(), 0);
        }

        /// Lists outside the contract (any hashes, repeats): no panic, the count is never below
        /// the distinct blocks in flight nor above their sum, and 0 once all are released.
        #[test]
        fn lists_outside_the_contract_are_bounded(
            ops in prop::collection::vec(
                (any::<bool>(), prop::collection::vec(0u64..6, 0..10), any::<prop::sample::Index>()),
                1..80,
            ),
        ) {
            let mut t = InFlightBlocks::default();
            let mut m = Model::default();
            let mut live: Vec<Vec<BlockHash>> = Vec::new();
            for (add, raw, pick) in ops {
                let blocks = raw.into_iter().map(BlockHash::new).collect();
                step((&mut t, &mut m, &mut live), add, blocks, pick);
                t.check_invariants().map_err(TestCaseError::fail)?;
                // Never fewer than the distinct blocks in flight, never more than their sum.
                let most: usize = live.iter().map(Vec::len).sum();
                prop_assert!(m.0.len() <= t.len() && t.len() <= most,
                    "{} counted, {} distinct, {most} in all", t.len(), m.0.len());
            }
            for blocks in live.drain(..) {
                t.release(&blocks);
            }
            prop_assert_eq!(t.len(), 0);
        }
    }

    #[test]
    fn a_shared_prefix_counts_once_and_splits_where_prompts_part() {
        let mut t = InFlightBlocks::default();
        let a = path(&[0, 1, 2, 0]);
        let b = path(&[0, 1, 0]);
        t.add(&a);
        t.add(&b);
        // [0 1] shared, then [2 0] and [0].
        assert_eq!(t.len(), 5);
        assert_eq!(t.starts.len(), 3);
        t.add(&a[..1]);
        assert_eq!(t.len(), 5);
        t.release(&a);
        assert_eq!(t.len(), 3);
        t.release(&b);
        assert_eq!(t.len(), 1);
        t.check_invariants().unwrap();
        t.release(&a[..1]);
        assert_eq!(t.len(), 0);
    }

    /// Lists outside the contract that a trie would hold wrongly (found by review): a finished
    /// request left counted while the worker stays busy, and a release that freed a segment
    /// another list still passes.
    #[test]
    fn lists_outside_the_contract_neither_leak_nor_undercount() {
        let h = |v: &[u64]| v.iter().map(|&x| BlockHash::new(x)).collect::<Vec<_>>();
        let mut t = InFlightBlocks::default();
        t.add(&h(&[99]));
        for _ in 0..1000 {
            let lists = [h(&[10]), h(&[20, 10]), h(&[20, 30])];
            for l in &lists {
                t.add(l);
            }
            for l in &lists {
                t.release(l);
            }
        }
        assert_eq!(t.len(), 1);
        let mut t = InFlightBlocks::default();
        t.add(&h(&[1, 1, 2]));
        t.add(&h(&[1]));
        t.release(&h(&[1]));
        assert_eq!(t.len(), 2);
        t.check_invariants().unwrap();
    }
}
