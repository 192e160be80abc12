//! `CacheIndex` against a naive model (a set per worker), and the mirror property: caches under
//! eviction pressure, their events applied to one index, always agree.
//!
//! The model, its `Op`, the strategy and the step that compares it with the real index live in
//! `kvtest::index`, shared with the fuzz target `index_events` and the router model.

use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::{BlockCache, CacheIndex, KvEvent, WorkerId};
use kvtest::index::{self as model, strategy::op, Model};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn index_matches_model(layout in 0usize..4, ops in prop::collection::vec(op(), 1..100)) {
        let mut real = CacheIndex::new();
        let mut model = Model::default();
        // Dense indices follow registration order, and freed ones are reused last freed first:
        // placeholders push the tested workers across the 32- and 64-worker boundaries of the
        // holder sets. The last layout puts them at 31..34 and 64..68, so that one set can
        // span both halves of a word and reach into the next word, then shrink back.
        let (placeholders, freed): (u64, &[u64]) =
            [(0, &[][..]), (30, &[]), (61, &[]), (70, &[67, 66, 65, 64, 33, 32, 31])][layout];
        for k in 0..placeholders {
            let w = WorkerId::new(10_000 + k);
            real.add_worker(w).unwrap();
            model.workers.entry(w).or_default();
        }
        for &k in freed {
            let w = WorkerId::new(10_000 + k);
            prop_assert!(real.remove_worker(w));
            model.workers.remove(&w);
        }
        for op in &ops {
            if let Err(e) = model::step(&mut real, &mut model, op) {
                return Err(TestCaseError::fail(e));
            }
        }
    }

    /// [`index_matches_model`] with removals trusted to take leaves (`set_tail_first`): each
    /// `Removed` keeps only blocks the worker holds nothing under, as a tail-first engine's
    /// would, so the index keeps probing after removals; gaps still make holes.
    #[test]
    fn tail_first_index_matches_model(ops in prop::collection::vec(op(), 1..100)) {
        let mut real = CacheIndex::new();
        real.set_tail_first(true);
        let mut model = Model::default();
        for op in &ops {
            let op = match op {
                model::Op::Apply { worker, id_delta, event: KvEvent::Removed { blocks } } => model::Op::Apply {
                    worker: *worker,
                    id_delta: *id_delta,
                    event: KvEvent::Removed { blocks: model.leaves_only(WorkerId::new(*worker), blocks) },
                },
                other => other.clone(),
            };
            if let Err(e) = model::step(&mut real, &mut model, &op) {
                return Err(TestCaseError::fail(e));
            }
            // A snapshot does not carry the setting.
            real.set_tail_first(true);
            // Trusted, removals never make holes; staleness (a gap, a rejected store) does.
            for &w in model.workers.keys() {
                let want = real.is_stale(w) && real.block_count(w) > 0;
                prop_assert_eq!(real.may_have_holes(w), want, "{} after {:?}", w, op);
            }
        }
    }

    /// N engines under eviction pressure; their drained events go to one index. After every
    /// step, the index's view of each worker equals the engine's truth. Requests pin nothing,
    /// their whole chain, a prefix of it, or a part from a later block on (pins of partial
    /// chains leave unpinned blocks under pinned ones, which eviction must step over).
    #[test]
    fn mirror_property(caps in prop::collection::vec(1usize..8, 1..5),
                       steps in prop::collection::vec((0usize..5, prop::collection::vec(0u32..3, 1..6), 0u8..4, 0usize..6), 1..60),
                       queries in prop::collection::vec(prop::collection::vec(0u32..3, 1..6), 4),
                       tail_first in any::<bool>()) {
        let hasher = BlockHasher::new(BlockSize::new(1).expect("non-zero"));
        let mut caches: Vec<BlockCache> = caps.iter().map(|&c| BlockCache::new(Some(c).filter(|&c| c > 0))).collect();
        let mut ids = vec![0u64; caches.len()];
        let mut index = CacheIndex::new();
        // The engine evicts tail first: trusted, its mirror never needs a block-by-block walk.
        index.set_tail_first(tail_first);
        let mut pinned: Vec<Option<Vec<BlockHash>>> = vec![None; caches.len()];
        for (w, tokens, pin, cut) in steps {
            let w = w % caches.len();
            let chain = hasher.sequence_hashes(&tokens);
            let cache = &mut caches[w];
            if let Some(p) = pinned[w].take() {
                cache.unpin(&p);
            }
            if cache.insert(&chain).is_ok() && pin > 0 {
                let cut = cut.min(chain.len() - 1);
                let part = match pin {
                    1 => &chain[..],
                    2 => &chain[..=cut],
                    _ => &chain[cut..],
                };
                let n = cache.pin(part);
                pinned[w] = Some(part[..n].to_vec());
            }
            for ev in cache.drain_events() {
                let applied = index.apply(WorkerId::new(w as u64), ids[w], &ev);
                prop_assert!(applied.is_ok(), "{:?}", applied);
                prop_assert_eq!(applied.ok().and_then(|a| a.gap), None);
                ids[w] += 1;
            }
            for q in &queries {
                let q = hasher.sequence_hashes(q);
                let ov = index.overlaps(&q);
                for (i, c) in caches.iter().enumerate() {
                    prop_assert_eq!(ov.get(WorkerId::new(i as u64)), c.match_len(&q));
                }
            }
            for (i, c) in caches.iter().enumerate() {
                let w = WorkerId::new(i as u64);
                prop_assert_eq!(index.block_count(w), c.len());
                prop_assert!(!(tail_first && index.may_have_holes(w)));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Engines evicting tail first with removals trusted (`set_tail_first`), and some of their
    /// events lost on the way: after a lost `Removed` the mirror keeps blocks the engine
    /// dropped, under which the engine's later removals are not leaves, so a gap must make the
    /// worker holey. The runs must equal a block-by-block walk of the mirror (`holds`) always,
    /// and the engine's own run while nothing of that worker was lost.
    #[test]
    fn lost_events_under_trusted_removals(
        caps in prop::collection::vec(2usize..16, 1..4),
        steps in prop::collection::vec((0usize..4, prop::collection::vec(0u32..2, 1..12), any::<bool>(), prop::bool::weighted(0.15)), 1..80),
        queries in prop::collection::vec(prop::collection::vec(0u32..2, 1..14), 6),
    ) {
        let hasher = BlockHasher::new(BlockSize::new(1).expect("non-zero"));
        let mut caches: Vec<BlockCache> = caps.iter().map(|&c| BlockCache::new(Some(c))).collect();
        let mut ids = vec![0u64; caches.len()];
        let mut lost = vec![false; caches.len()];
        let mut index = CacheIndex::new();
        index.set_tail_first(true);
        for (w, tokens, pin, lose) in steps {
            let w = w % caches.len();
            let chain = hasher.sequence_hashes(&tokens);
            let cache = &mut caches[w];
            cache.unpin(&chain);
            if cache.insert(&chain).is_ok() && pin {
                cache.pin(&chain);
            }
            let id = WorkerId::new(w as u64);
            for ev in cache.drain_events() {
                if lose {
                    lost[w] = true;
                } else {
                    // Errors are expected (a store under a parent that was lost).
                    let _ = index.apply(id, ids[w], &ev);
                }
                ids[w] += 1;
            }
            for q in &queries {
                let q = hasher.sequence_hashes(q);
                if let Err(e) = index.check_runs(&q) {
                    return Err(TestCaseError::fail(format!("{e} on {q:?}")));
                }
                let ov = index.overlaps(&q);
                for (i, c) in caches.iter().enumerate() {
                    if !lost[i] {
                        prop_assert_eq!(ov.get(WorkerId::new(i as u64)), c.match_len(&q));
                    }
                }
            }
        }
    }
}

#[test]
fn overlaps_across_many_workers_and_words() {
    let b = BlockHash::new;
    let mut index = CacheIndex::new();
    for w in 0..300u64 {
        let depth = (w % 5) as usize;
        let chain: Vec<BlockHash> = (1..=depth as u64).map(b).collect();
        index
            .apply(
                WorkerId::new(w),
                0,
                &KvEvent::Stored {
                    parent: None,
                    blocks: chain,
                },
            )
            .unwrap();
    }
    let q: Vec<BlockHash> = (1..=6).map(b).collect();
    let ov = index.overlaps(&q);
    for w in 0..300u64 {
        assert_eq!(ov.get(WorkerId::new(w)), (w % 5) as usize, "worker {w}");
    }
    assert_eq!(ov.max(), 4);
    assert_eq!(index.distinct_blocks(), 4);
    assert!(index.remove_worker(WorkerId::new(4)));
    assert_eq!(index.overlaps(&q).get(WorkerId::new(4)), 0);
    index.check_invariants().unwrap();
}

#[test]
fn errors_name_the_values() {
    let mut index = CacheIndex::new();
    let w = WorkerId::new(9);
    index.apply(w, 0, &KvEvent::Cleared).unwrap();
    let e = index.apply(w, 0, &KvEvent::Cleared).unwrap_err();
    assert_eq!(
        e.to_string(),
        "worker 9: event id 0 already seen (expected 1); not applied"
    );
    let e = index
        .apply(
            w,
            1,
            &KvEvent::Stored {
                parent: Some(BlockHash::new(5)),
                blocks: vec![BlockHash::new(6)],
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("parent 0x0000000000000005"), "{e}");
    assert!(index.is_stale(w));
}

/// The id after `u64::MAX` would not fit, so that id is refused outright: before, it was
/// applied, the next expected id stayed `u64::MAX`, and the same id was applied again and again.
#[test]
fn the_last_event_id_is_refused_and_the_one_before_it_taken_once() {
    let mut index = CacheIndex::new();
    let w = WorkerId::new(2);
    let stored = KvEvent::Stored {
        parent: None,
        blocks: vec![BlockHash::new(7)],
    };
    let e = index.apply(w, u64::MAX, &stored).unwrap_err();
    assert_eq!(
        e.to_string(),
        "worker 2: event id 18446744073709551615 (u64::MAX) is out of range: ids run from 0 to 2^64 - 2; not applied"
    );
    assert_eq!(index.block_count(w), 0, "nothing applied");
    assert_eq!(index.next_event_id(w), Some(0));

    let applied = index.apply(w, u64::MAX - 1, &stored).unwrap();
    assert_eq!(applied.stored, 1);
    assert_eq!(index.next_event_id(w), Some(u64::MAX));
    for id in [u64::MAX - 1, u64::MAX] {
        let removed = KvEvent::Removed {
            blocks: vec![BlockHash::new(7)],
        };
        assert!(index.apply(w, id, &removed).is_err(), "id {id} taken again");
    }
    assert_eq!(index.block_count(w), 1);
}

/// `Overlaps::set_run` with an index no `CacheIndex` hands out sets the worker's run and
/// allocates nothing for it (it panicked, or tried to allocate the index's worth of slots).
#[test]
fn set_run_with_an_index_out_of_range() {
    let mut index = CacheIndex::new();
    let w = WorkerId::new(1);
    index.add_worker(w).unwrap();
    let mut o = index.overlaps(&[BlockHash::new(1)]);
    for at in [usize::MAX, 1 << 40, 1 << 24] {
        o.set_run(at, w, 3);
        assert_eq!((o.get(w), o.max(), o.run_at(at)), (3, 3, 0));
    }
}
