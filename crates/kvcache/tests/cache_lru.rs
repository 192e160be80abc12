//! `BlockCache` against `lru::LruCache`, the differential oracle where plain LRU is the whole
//! story: chains of one block each (every block a root with `parent: None`, so every resident
//! block is a leaf and tail-first eviction is plain least-recently-used) and no pins.
//!
//! What uses a block, in both: `insert` of a resident block touches it (`LruCache::push` of a
//! present key moves it to the front); `lookup` and `match_len` touch nothing (`LruCache::peek`
//! and `contains`). A capacity change evicts least recent first (`LruCache::pop_lru` down to the
//! new capacity, then `resize`); a capacity of 0 holds nothing (which `LruCache` cannot be: the
//! oracle is then drained and refuses new blocks, as `BlockCache` must).
//!
//! After every step: the answer, the residency of every id, `len`, the blocks evicted in order
//! (`KvEvent::Removed` from `drain_events` against the entries `push` and `pop_lru` returned),
//! the stored events, the recency order (`recency_order()`, least recent first, against
//! `LruCache::iter()` reversed) and the counters agree, and `check_invariants` passes.

use std::num::NonZeroUsize;

use kvblock::BlockHash;
use kvcache::{BlockCache, Error, KvEvent};
use kvtest::splitmix::Rng;
use lru::LruCache;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// `insert(&[b])`: stores a new root block (evicting the least recent when full), or
    /// touches a resident one.
    Insert(u64),
    /// `lookup` of a list of root blocks: counted, touches nothing.
    Lookup(Vec<u64>),
    /// `match_len`: neither counted nor touching.
    Match(Vec<u64>),
    /// `set_capacity`.
    Capacity(Option<usize>),
    /// `clear()`.
    Clear,
}

fn h(b: u64) -> BlockHash {
    BlockHash::new(b)
}

fn hashes(v: &[u64]) -> Vec<BlockHash> {
    v.iter().copied().map(h).collect()
}

/// The cache under test and its oracle.
struct Pair {
    real: BlockCache,
    lru: LruCache<BlockHash, ()>,
    /// The capacity set (`Some(0)`: the oracle holds nothing and takes nothing).
    cap: Option<usize>,
    /// Ids that may be resident: every one is probed after every step.
    universe: u64,
    lookups: u64,
    hit_blocks: u64,
    stored: u64,
    evictions: u64,
}

fn lru_cap(cap: usize) -> NonZeroUsize {
    NonZeroUsize::new(cap).unwrap_or(NonZeroUsize::MIN)
}

impl Pair {
    fn new(cap: Option<usize>, universe: u64) -> Pair {
        Pair {
            real: BlockCache::new(cap),
            lru: match cap {
                None => LruCache::unbounded(),
                Some(c) => LruCache::new(lru_cap(c)),
            },
            cap,
            universe,
            lookups: 0,
            hit_blocks: 0,
            stored: 0,
            evictions: 0,
        }
    }

    /// The leading run of `chain` that the oracle holds, without touching it.
    fn oracle_run(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|&&b| self.lru.peek(&h(b)).is_some())
            .count()
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        let mut want_events = Vec::new();
        match op {
            Op::Insert(b) => {
                let b = h(*b);
                let got = self.real.insert(&[b]);
                if self.lru.contains(&b) {
                    // Present: `push` moves it to the front and hands back its own entry.
                    let back = self.lru.push(b, ());
                    if back.map(|(k, ())| k) != Some(b) {
                        return Err(format!("lru push of a present {b} returned {back:?}"));
                    }
                    if got != Ok(0) {
                        return Err(format!("insert of a resident {b}: {got:?}, want Ok(0)"));
                    }
                } else if self.cap == Some(0) {
                    let want = Err(Error::CapacityExhausted {
                        needed: 1,
                        evictable: 0,
                        capacity: 0,
                        pinned: 0,
                    });
                    if got != want {
                        return Err(format!("insert {b} at capacity 0: {got:?}, want {want:?}"));
                    }
                } else {
                    if let Some((evicted, ())) = self.lru.push(b, ()) {
                        want_events.push(KvEvent::Removed {
                            blocks: vec![evicted],
                        });
                        self.evictions += 1;
                    }
                    want_events.push(KvEvent::Stored {
                        parent: None,
                        blocks: vec![b],
                    });
                    self.stored += 1;
                    if got != Ok(1) {
                        return Err(format!("insert of a new {b}: {got:?}, want Ok(1)"));
                    }
                }
            }
            Op::Lookup(chain) => {
                let (got, want) = (self.real.lookup(&hashes(chain)), self.oracle_run(chain));
                self.lookups += 1;
                self.hit_blocks += want as u64;
                if got != want {
                    return Err(format!("lookup {chain:?}: {got}, lru holds {want}"));
                }
            }
            Op::Match(chain) => {
                let (got, want) = (self.real.match_len(&hashes(chain)), self.oracle_run(chain));
                if got != want {
                    return Err(format!("match_len {chain:?}: {got}, lru holds {want}"));
                }
            }
            Op::Capacity(cap) => {
                self.real
                    .set_capacity(*cap)
                    .map_err(|e| format!("set_capacity {cap:?} with nothing pinned: {e}"))?;
                let keep = cap.unwrap_or(usize::MAX);
                let mut evicted = Vec::new();
                while self.lru.len() > keep {
                    let (k, ()) = self.lru.pop_lru().expect("non-empty");
                    evicted.push(k);
                }
                self.lru.resize(lru_cap(keep));
                self.cap = *cap;
                if !evicted.is_empty() {
                    self.evictions += evicted.len() as u64;
                    want_events.push(KvEvent::Removed { blocks: evicted });
                }
                if self.real.capacity() != *cap {
                    return Err(format!("capacity {:?}, set {cap:?}", self.real.capacity()));
                }
            }
            Op::Clear => {
                let n = self.lru.len();
                self.lru.clear();
                want_events.push(KvEvent::Cleared);
                let got = self.real.clear();
                if got != Ok(n) {
                    return Err(format!("clear: {got:?}, want Ok({n})"));
                }
            }
        }
        self.real
            .check_invariants()
            .map_err(|e| format!("after {op:?}: {e}"))?;
        let events: Vec<KvEvent> = self.real.drain_events().collect();
        if events != want_events {
            return Err(format!(
                "after {op:?}: events {events:?}, lru evicted/stored {want_events:?}"
            ));
        }
        if self.real.len() != self.lru.len() {
            return Err(format!(
                "after {op:?}: len {}, lru {}",
                self.real.len(),
                self.lru.len()
            ));
        }
        let lru_order: Vec<BlockHash> = self.lru.iter().rev().map(|(k, ())| *k).collect();
        if self.real.recency_order() != lru_order {
            return Err(format!(
                "after {op:?}: recency {:?}, lru (least recent first) {lru_order:?}",
                self.real.recency_order()
            ));
        }
        if let Some(b) =
            (0..self.universe).find(|&b| self.real.contains(h(b)) != self.lru.contains(&h(b)))
        {
            return Err(format!(
                "after {op:?}: {} resident {}, in lru {}",
                h(b),
                self.real.contains(h(b)),
                self.lru.contains(&h(b))
            ));
        }
        let s = self.real.stats();
        let got = (
            s.lookups,
            s.hit_blocks,
            s.blocks_stored,
            s.evictions,
            s.resident_blocks,
        );
        let want = (
            self.lookups,
            self.hit_blocks,
            self.stored,
            self.evictions,
            self.lru.len(),
        );
        if got != want {
            return Err(format!("after {op:?}: stats {got:?}, lru {want:?}"));
        }
        Ok(())
    }
}

const UNIVERSE: u64 = 10;

fn op() -> impl Strategy<Value = Op> {
    let chain = prop::collection::vec(0..UNIVERSE, 0..4);
    prop_oneof![
        10 => (0..UNIVERSE).prop_map(Op::Insert),
        2 => chain.clone().prop_map(Op::Lookup),
        1 => chain.prop_map(Op::Match),
        1 => prop::option::weighted(0.9, 0usize..8).prop_map(Op::Capacity),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Single-block chains, no pins: `BlockCache` is an LRU cache, step for step.
    #[test]
    fn single_block_chains_evict_like_lru(cap in prop::option::weighted(0.9, 0usize..7),
                                          ops in prop::collection::vec(op(), 1..200)) {
        let mut pair = Pair::new(cap, UNIVERSE);
        for op in &ops {
            if let Err(e) = pair.step(op) {
                return Err(TestCaseError::fail(e));
            }
        }
    }
}

/// A long seeded run at a realistic size: 64 blocks of capacity, 200 ids drawn with a skew (so
/// some stay hot and others churn), lookups, and now and then a capacity change (16 to 111).
#[test]
fn long_single_block_run_evicts_like_lru() {
    let mut rng = Rng(0x006c_7275);
    let mut pair = Pair::new(Some(64), 200);
    for i in 0..20_000u64 {
        let op = match rng.below(100) {
            0..=79 => Op::Insert(rng.skewed(200) as u64),
            80..=97 => Op::Lookup((0..rng.below(4)).map(|_| rng.skewed(200) as u64).collect()),
            98 if i % 16 == 0 => Op::Capacity(Some(16 + rng.below(96) as usize)),
            _ => Op::Match(vec![rng.below(200)]),
        };
        if let Err(e) = pair.step(&op) {
            panic!("step {i}: {e}");
        }
    }
    assert!(
        pair.evictions > 4_000,
        "the run must evict: {}",
        pair.evictions
    );
}
