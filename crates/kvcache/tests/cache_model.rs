//! `BlockCache` against a naive model: same operations, same answers, same events, same
//! recency order; invariants checked after every step.

use std::num::NonZeroUsize;

use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::{BlockCache, Error, KvEvent};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct MBlock {
    hash: BlockHash,
    parent: Option<BlockHash>,
    pins: u32,
    stamp: u64,
}

/// Plain vectors, linear scans, stamps for recency: obviously right, slow.
#[derive(Debug, Default)]
struct Model {
    cap: Option<usize>,
    blocks: Vec<MBlock>,
    clock: u64,
    events: Vec<KvEvent>,
}

impl Model {
    fn limit(&self) -> usize {
        self.cap.unwrap_or(usize::MAX)
    }
    fn get(&self, h: BlockHash) -> Option<&MBlock> {
        self.blocks.iter().find(|b| b.hash == h)
    }
    fn get_mut(&mut self, h: BlockHash) -> Option<&mut MBlock> {
        self.blocks.iter_mut().find(|b| b.hash == h)
    }
    fn match_len(&self, chain: &[BlockHash]) -> usize {
        chain.iter().take_while(|h| self.get(**h).is_some()).count()
    }
    fn stamp(&mut self, h: BlockHash) {
        self.clock += 1;
        let c = self.clock;
        if let Some(b) = self.get_mut(h) {
            b.stamp = c;
        }
    }
    /// The next victim: least recent among unpinned blocks with no resident child, outside `protect`.
    fn victim(blocks: &[MBlock], protect: &[BlockHash]) -> Option<usize> {
        (0..blocks.len())
            .filter(|&i| {
                let b = &blocks[i];
                b.pins == 0
                    && !protect.contains(&b.hash)
                    && !blocks.iter().any(|c| c.parent == Some(b.hash))
            })
            .min_by_key(|&i| blocks[i].stamp)
    }
    fn evictable(&self, protect: &[BlockHash]) -> usize {
        let mut blocks = self.blocks.clone();
        let mut n = 0;
        while let Some(i) = Self::victim(&blocks, protect) {
            blocks.remove(i);
            n += 1;
        }
        n
    }
    fn evict(&mut self, n: usize, protect: &[BlockHash]) {
        if n == 0 {
            return;
        }
        let mut removed = Vec::new();
        for _ in 0..n {
            let i = Self::victim(&self.blocks, protect).expect("checked");
            removed.push(self.blocks.remove(i).hash);
        }
        self.events.push(KvEvent::Removed { blocks: removed });
    }
    fn insert(&mut self, chain: &[BlockHash]) -> Result<usize, ()> {
        let mut run = 0;
        for (i, h) in chain.iter().enumerate() {
            match self.get(*h) {
                None => break,
                Some(b) if b.parent != i.checked_sub(1).map(|j| chain[j]) => return Err(()),
                Some(_) => run += 1,
            }
        }
        let new = &chain[run..];
        for (j, h) in new.iter().enumerate() {
            if self.get(*h).is_some() || new[..j].contains(h) {
                return Err(());
            }
        }
        let needed = (self.blocks.len() + new.len()).saturating_sub(self.limit());
        if !new.is_empty() && needed > self.evictable(&chain[..run]) {
            return Err(());
        }
        if !new.is_empty() {
            self.evict(needed, &chain[..run]);
        }
        for (j, h) in new.iter().enumerate() {
            let parent = (run + j).checked_sub(1).map(|k| chain[k]);
            self.blocks.push(MBlock {
                hash: *h,
                parent,
                pins: 0,
                stamp: 0,
            });
        }
        for h in chain.iter().rev() {
            self.stamp(*h);
        }
        if !new.is_empty() {
            self.events.push(KvEvent::Stored {
                parent: run.checked_sub(1).map(|i| chain[i]),
                blocks: new.to_vec(),
            });
        }
        Ok(new.len())
    }
    /// The leading run of `chain` that is resident and linked as the cache holds it.
    fn linked_run(&self, chain: &[BlockHash], pinned: bool) -> usize {
        let mut prev = None;
        let mut n = 0;
        for h in chain {
            match self.get(*h) {
                Some(b) if (n == 0 || b.parent == prev) && (!pinned || b.pins > 0) => {
                    prev = Some(*h);
                    n += 1;
                }
                _ => break,
            }
        }
        n
    }
    fn pin(&mut self, chain: &[BlockHash]) -> usize {
        let run = self.linked_run(chain, false);
        for h in &chain[..run] {
            self.get_mut(*h).expect("resident").pins += 1;
        }
        run
    }
    fn unpin(&mut self, chain: &[BlockHash]) -> usize {
        let run = self.linked_run(chain, true);
        for h in chain[..run].iter().rev() {
            let b = self.get_mut(*h).expect("resident");
            b.pins -= 1;
            if b.pins == 0 {
                self.stamp(*h);
            }
        }
        run
    }
    fn set_capacity(&mut self, cap: Option<usize>) -> Result<(), ()> {
        let needed = self.blocks.len().saturating_sub(cap.unwrap_or(usize::MAX));
        if needed > self.evictable(&[]) {
            return Err(());
        }
        self.cap = cap;
        self.evict(needed, &[]);
        Ok(())
    }
    fn clear(&mut self) -> Result<usize, ()> {
        if self.blocks.iter().any(|b| b.pins > 0) {
            return Err(());
        }
        let n = self.blocks.len();
        self.blocks.clear();
        self.events.push(KvEvent::Cleared);
        Ok(n)
    }
    fn recency(&self) -> Vec<BlockHash> {
        let mut v: Vec<&MBlock> = self.blocks.iter().filter(|b| b.pins == 0).collect();
        v.sort_by_key(|b| b.stamp);
        v.into_iter().map(|b| b.hash).collect()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(Vec<BlockHash>),
    Lookup(Vec<BlockHash>),
    Pin(Vec<BlockHash>),
    Unpin(Vec<BlockHash>),
    Capacity(Option<usize>),
    Clear,
}

/// Real chained hashes of short token strings over a 3-letter alphabet at block size 1, so
/// prompts share prefixes often; now and then arbitrary ids, which may contradict the chains.
fn chain() -> impl Strategy<Value = Vec<BlockHash>> {
    let hasher = BlockHasher::new(BlockSize::new(1).expect("non-zero"));
    prop_oneof![
        8 => prop::collection::vec(0u32..3, 0..7).prop_map(move |t| hasher.sequence_hashes(&t)),
        1 => prop::collection::vec(0u64..6, 0..4).prop_map(|v| v.into_iter().map(BlockHash::new).collect()),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => chain().prop_map(Op::Insert),
        2 => chain().prop_map(Op::Lookup),
        3 => (chain(), 0usize..3).prop_map(|(c, k)| Op::Pin(c[k.min(c.len())..].to_vec())),
        3 => (chain(), 0usize..3).prop_map(|(c, k)| Op::Unpin(c[k.min(c.len())..].to_vec())),
        1 => prop::option::weighted(0.8, 0usize..12).prop_map(Op::Capacity),
        1 => Just(Op::Clear),
    ]
}

fn nz(c: Option<usize>) -> Option<NonZeroUsize> {
    c.and_then(NonZeroUsize::new)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn block_cache_matches_model(cap in prop::option::weighted(0.9, 1usize..10),
                                 ops in prop::collection::vec(op(), 1..80)) {
        let mut real = BlockCache::new(nz(cap));
        let mut model = Model { cap, ..Model::default() };
        let probe = BlockHasher::new(BlockSize::new(1).expect("non-zero"));
        for op in ops {
            match &op {
                Op::Insert(c) => {
                    let r = real.insert(c);
                    let m = model.insert(c);
                    prop_assert_eq!(r.as_ref().ok(), m.as_ref().ok(), "insert {:?}: {:?}", c, r);
                    if let Err(e) = r {
                        let expected = matches!(e, Error::CapacityExhausted { .. } | Error::InconsistentChain { .. });
                        prop_assert!(expected, "unexpected error {e}");
                    }
                }
                Op::Lookup(c) => {
                    prop_assert_eq!(real.lookup(c), model.match_len(c));
                }
                Op::Pin(c) => prop_assert_eq!(real.pin(c), model.pin(c)),
                Op::Unpin(c) => prop_assert_eq!(real.unpin(c), model.unpin(c)),
                Op::Capacity(c) => {
                    prop_assert_eq!(real.set_capacity(*c).is_ok(), model.set_capacity(*c).is_ok());
                }
                Op::Clear => prop_assert_eq!(real.clear().ok(), model.clear().ok()),
            }
            if let Err(e) = real.check_invariants() {
                return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
            }
            let events: Vec<KvEvent> = real.drain_events().collect();
            prop_assert_eq!(&events, &model.events, "events after {:?}", op);
            model.events.clear();
            prop_assert_eq!(real.len(), model.blocks.len());
            prop_assert_eq!(real.pinned_blocks(), model.blocks.iter().filter(|b| b.pins > 0).count());
            prop_assert_eq!(real.recency_order(), model.recency());
            for b in &model.blocks {
                prop_assert_eq!(real.pin_count(b.hash), b.pins);
            }
            for t in [[0u32, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1], [2, 0, 2, 0, 2, 0]] {
                let q = probe.sequence_hashes(&t);
                prop_assert_eq!(real.match_len(&q), model.match_len(&q));
            }
        }
    }
}

/// Found by the model test: a chain that repeats a block must not release one pin twice; and
/// a slice that starts mid-chain (blocks stored after an earlier pin) pins from there.
#[test]
fn repeated_block_in_a_chain_pins_and_unpins_once() {
    let b = BlockHash::new(2);
    let mut c = BlockCache::new(None);
    c.insert(&[b]).unwrap();
    assert_eq!(c.pin(&[b, b]), 1);
    assert_eq!(c.unpin(&[b, b]), 1);
    assert_eq!(c.pin_count(b), 0);
    c.check_invariants().unwrap();
    let chain: Vec<BlockHash> = (10..14).map(BlockHash::new).collect();
    c.insert(&chain).unwrap();
    assert_eq!(c.pin(&chain[..2]), 2);
    assert_eq!(c.pin(&chain[2..]), 2);
    assert_eq!(c.unpin(&chain), 4);
    assert_eq!(c.pinned_blocks(), 0);
    c.check_invariants().unwrap();
}

#[test]
fn failed_insert_changes_nothing() {
    let h = |i| BlockHash::new(i);
    let mut c = BlockCache::new(NonZeroUsize::new(2));
    c.insert(&[h(1), h(2)]).unwrap();
    c.pin(&[h(1), h(2)]);
    c.drain_events().for_each(drop);
    let err = c.insert(&[h(3)]).unwrap_err();
    assert_eq!(
        err,
        Error::CapacityExhausted {
            needed: 1,
            evictable: 0,
            capacity: 2,
            pinned: 2
        }
    );
    assert!(err.to_string().contains("1 block(s) must be evicted"));
    assert_eq!(c.len(), 2);
    assert_eq!(c.pending_events(), 0);
    assert!(!c.contains(h(3)));
    c.check_invariants().unwrap();
    // Once unpinned, the same insert evicts the tail of the old chain.
    assert_eq!(c.unpin(&[h(1), h(2)]), 2);
    assert_eq!(c.insert(&[h(3)]), Ok(1));
    assert_eq!(c.match_len(&[h(1), h(2)]), 1);
}

#[test]
fn stats_count_lookups_stores_and_evictions() {
    let h = |i| BlockHash::new(i);
    let mut c = BlockCache::new(NonZeroUsize::new(3));
    c.insert(&[h(1), h(2), h(3)]).unwrap();
    assert_eq!(c.lookup(&[h(1), h(2), h(9)]), 2);
    c.insert(&[h(4), h(5)]).unwrap();
    let s = c.stats();
    assert_eq!(
        (
            s.lookups,
            s.hit_blocks,
            s.blocks_stored,
            s.evictions,
            s.resident_blocks
        ),
        (1, 2, 5, 2, 3)
    );
}
