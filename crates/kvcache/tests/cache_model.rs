//! `BlockCache` against a naive model: same operations, same answers, same events, same
//! recency order; invariants checked after every step.
//!
//! The model, its `Op`, the strategy and the step that compares it with the real cache live in
//! `kvtest::cache`, shared with the fuzz target `block_cache_ops`. The same cache against
//! `lru::LruCache` is `tests/cache_lru.rs`.

use kvblock::BlockHash;
use kvcache::{BlockCache, Error};
use kvtest::cache::{self as model, strategy::op, Model};
use proptest::prelude::*;

/// The model treats a capacity of 0 as unbounded.
fn nz(c: Option<usize>) -> Option<usize> {
    c.filter(|&c| c > 0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn block_cache_matches_model(cap in prop::option::weighted(0.9, 1usize..10),
                                 ops in prop::collection::vec(op(), 1..80)) {
        let mut real = BlockCache::new(nz(cap));
        let mut model = Model::new(cap);
        let probes = model::strategy::probes();
        for op in &ops {
            if let Err(e) = model::step(&mut real, &mut model, op, &probes) {
                return Err(TestCaseError::fail(e));
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
    let mut c = BlockCache::new(Some(2));
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
    let mut c = BlockCache::new(Some(3));
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
