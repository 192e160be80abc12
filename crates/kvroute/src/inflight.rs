//! The distinct prompt blocks in flight on one worker, kept as a path-compressed trie.

use kvblock::BlockHash;
use kvcache::FixedState;

type Map<K, V> = hashbrown::HashMap<K, V, FixedState>;

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
/// list) are counted as if they did not: a block may then count more than once. The count never
/// goes negative, and it is 0 again once every added list has been released.
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
}

#[derive(Debug, Clone, Default)]
struct Segment {
    blocks: Vec<BlockHash>,
    /// Lists in flight that pass the whole segment.
    refs: u32,
}

/// How many leading elements `a` and `b` share.
#[inline]
fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
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
        let mut pos = 0;
        while let Some(first) = blocks.get(pos) {
            let Some(&s) = self.starts.get(first) else {
                return;
            };
            let seg = &mut self.segs[s as usize];
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
                if add || live.is_empty() {
                    let blocks = path(&codes);
                    t.add(&blocks);
                    m.add(&blocks);
                    live.push(blocks);
                } else {
                    let blocks = live.swap_remove(pick.index(live.len()));
                    t.release(&blocks);
                    m.release(&blocks);
                }
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

        /// Lists outside the contract (any hashes, repeats): no panic, the count never exceeds
        /// the blocks added since the worker was last idle, and it is 0 once all are released.
        #[test]
        fn lists_outside_the_contract_are_bounded(
            ops in prop::collection::vec(
                (any::<bool>(), prop::collection::vec(0u64..6, 0..10), any::<prop::sample::Index>()),
                1..80,
            ),
        ) {
            let mut t = InFlightBlocks::default();
            let mut live: Vec<Vec<BlockHash>> = Vec::new();
            let mut since_idle = 0;
            for (add, raw, pick) in ops {
                if add || live.is_empty() {
                    let blocks: Vec<BlockHash> = raw.into_iter().map(BlockHash::new).collect();
                    t.add(&blocks);
                    since_idle += blocks.len();
                    live.push(blocks);
                } else {
                    t.release(&live.swap_remove(pick.index(live.len())));
                    if live.is_empty() {
                        since_idle = 0;
                    }
                }
                prop_assert!(t.len() <= since_idle, "{} blocks counted, {since_idle} added", t.len());
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
}
