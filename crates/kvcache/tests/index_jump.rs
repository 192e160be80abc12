//! `CacheIndex::overlaps` probes prefix-closed workers at strides and walks the ones that may
//! have holes: against a block-by-block check of `holds`, on long chains with holes punched
//! at random positions.

use kvcache::{CacheIndex, KvEvent, WorkerId};
use kvtest::chains::path;
use proptest::prelude::*;

/// Each worker's leading run of `q`, block by block.
fn walked(index: &CacheIndex, workers: u64, q: &[kvblock::BlockHash]) -> Vec<usize> {
    (0..workers)
        .map(|w| {
            q.iter()
                .take_while(|b| index.holds(WorkerId::new(w), **b))
                .count()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn strided_probes_equal_the_walk(
        workers in 1u64..70,
        chains in prop::collection::vec((0u64..70, prop::collection::vec(0u8..2, 1..80), 1usize..24), 1..24),
        holes in prop::collection::vec((0u64..70, 0usize..24, 0usize..80), 0..6),
        queries in prop::collection::vec((0usize..24, 0usize..80, prop::collection::vec(0u8..2, 0..20)), 1..12),
    ) {
        let mut index = CacheIndex::new();
        let mut ids = vec![0u64; workers as usize];
        let paths: Vec<(u64, Vec<u8>)> = chains.iter().map(|(w, c, _)| (w % workers, c.clone())).collect();
        // Each chain stored in events of `piece` blocks: the first store of a block sets the
        // run hint the query guesses from, so hints of every length, right and wrong, occur.
        for ((w, codes), &(_, _, piece)) in paths.iter().zip(&chains) {
            let blocks = path(codes, 2);
            for (k, part) in blocks.chunks(piece).enumerate() {
                let parent = (k > 0).then(|| blocks[k * piece - 1]);
                let ev = KvEvent::Stored { parent, blocks: part.to_vec() };
                index.apply(WorkerId::new(*w), ids[*w as usize], &ev).unwrap();
                ids[*w as usize] += 1;
            }
        }
        for &(w, c, at) in &holes {
            let w = w % workers;
            let blocks = path(&paths[c % paths.len()].1, 2);
            let ev = KvEvent::Removed { blocks: vec![blocks[at % blocks.len()]] };
            index.apply(WorkerId::new(w), ids[w as usize], &ev).unwrap();
            ids[w as usize] += 1;
        }
        index.check_invariants().unwrap();
        for (c, cut, tail) in queries {
            // A stored chain's prefix, then a new suffix: what routing mostly sees.
            let mut codes = paths[c % paths.len()].1.clone();
            codes.truncate(cut.min(codes.len()));
            codes.extend(tail);
            let q = path(&codes, 2);
            let ov = index.overlaps(&q);
            let got: Vec<usize> = (0..workers).map(|w| ov.get(WorkerId::new(w))).collect();
            prop_assert_eq!(got, walked(&index, workers, &q));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Workers holding prefixes of one long chain, of any lengths: runs end anywhere, several
    /// between two probes of one batch, and each must come out exact. Up to three removals
    /// inside workers' prefixes make holes.
    #[test]
    fn runs_ending_between_probes_are_exact(
        codes in prop::collection::vec(0u8..4, 1..160),
        lens in prop::collection::vec(1usize..160, 1..70),
        holes in prop::collection::vec((0usize..70, 0usize..160), 0..3),
        cuts in prop::collection::vec((0usize..160, prop::collection::vec(0u8..4, 0..8)), 1..6),
    ) {
        let chain = path(&codes, 4);
        let mut index = CacheIndex::new();
        let workers = lens.len() as u64;
        for (w, &len) in lens.iter().enumerate() {
            let ev = KvEvent::Stored { parent: None, blocks: chain[..len.min(chain.len())].to_vec() };
            index.apply(WorkerId::new(w as u64), 0, &ev).unwrap();
        }
        let mut ids = vec![1u64; lens.len()];
        for &(w, at) in &holes {
            let w = w % lens.len();
            // Inside the worker's prefix, so that the removal makes a hole.
            let ev = KvEvent::Removed { blocks: vec![chain[at % lens[w].min(chain.len())]] };
            index.apply(WorkerId::new(w as u64), ids[w], &ev).unwrap();
            ids[w] += 1;
        }
        for (cut, tail) in cuts {
            let mut q = codes.clone();
            q.truncate(cut.min(q.len()).max(1));
            q.extend(tail.iter().map(|c| c + 4));
            let q = path(&q, 8);
            let ov = index.overlaps(&q);
            let got: Vec<usize> = (0..workers).map(|w| ov.get(WorkerId::new(w))).collect();
            prop_assert_eq!(got, walked(&index, workers, &q));
        }
    }
}

/// A worker that evicted a middle block is walked; one that only stored is probed, also after
/// a gap or a rejected store.
#[test]
fn holes_are_tracked_and_heal_when_empty() {
    let mut index = CacheIndex::new();
    let (w0, w1) = (WorkerId::new(0), WorkerId::new(1));
    let long = path(&[1; 40], 2);
    for w in [w0, w1] {
        index
            .apply(
                w,
                0,
                &KvEvent::Stored {
                    parent: None,
                    blocks: long.clone(),
                },
            )
            .unwrap();
    }
    index
        .apply(
            w1,
            1,
            &KvEvent::Removed {
                blocks: vec![long[17]],
            },
        )
        .unwrap();
    assert!(!index.may_have_holes(w0) && index.may_have_holes(w1));
    let ov = index.overlaps(&long);
    assert_eq!((ov.get(w0), ov.get(w1)), (40, 17));
    index.apply(w1, 2, &KvEvent::Cleared).unwrap();
    assert!(!index.may_have_holes(w1));
    // A gap and a rejected store leave the mirror as it was: stale, still prefix-closed, and
    // probed at strides with the same answer.
    index
        .apply(
            w0,
            5,
            &KvEvent::Stored {
                parent: None,
                blocks: long[..1].to_vec(),
            },
        )
        .unwrap();
    let unknown = path(&[0; 3], 2);
    let rejected = KvEvent::Stored {
        parent: Some(unknown[2]),
        blocks: vec![long[39]],
    };
    assert!(index.apply(w0, 6, &rejected).is_err());
    assert!(index.is_stale(w0) && !index.may_have_holes(w0));
    assert_eq!(index.overlaps(&long).get(w0), 40);
}

/// Runs past the end of one batch of strided probes (16 probes reach `depth + 2^15 - 1`), so
/// the query takes a second batch; `iter` stays shortest first.
#[test]
fn runs_past_one_batch_of_probes() {
    let chain = path(&vec![1; 70_000], 2);
    let runs = [1, 2, 32_767, 32_768, 32_769, 40_000, 65_536, 70_000];
    let mut index = CacheIndex::new();
    for (w, &r) in runs.iter().enumerate() {
        let ev = KvEvent::Stored {
            parent: None,
            blocks: chain[..r].to_vec(),
        };
        index.apply(WorkerId::new(w as u64), 0, &ev).unwrap();
    }
    let ov = index.overlaps(&chain);
    let got: Vec<usize> = (0..runs.len() as u64)
        .map(|w| ov.get(WorkerId::new(w)))
        .collect();
    assert_eq!(got, runs);
    let order: Vec<usize> = ov.iter().map(|(_, r)| r).collect();
    assert_eq!(order, runs);
    assert_eq!(ov.max(), 70_000);
}

/// Removals trusted to take leaves (`set_tail_first`) keep a worker probed at strides; a lost
/// removal leaves a block in the mirror that the engine's next removal is not a leaf of, so a
/// gap must make the worker holey, or the run would overcount (5 here, where 3 is right).
#[test]
fn a_lost_removal_under_trusted_removals_makes_the_worker_holey() {
    let chain = path(&[1; 5], 2);
    let mut index = CacheIndex::new();
    index.set_tail_first(true);
    let w = WorkerId::new(0);
    let stored = KvEvent::Stored {
        parent: None,
        blocks: chain.clone(),
    };
    let removed = |i: usize| KvEvent::Removed {
        blocks: vec![chain[i]],
    };
    // A tail-first engine: store the chain, evict its tail, store it again.
    index.apply(w, 0, &stored).unwrap();
    index.apply(w, 1, &removed(4)).unwrap();
    assert!(!index.may_have_holes(w));
    assert_eq!(index.overlaps(&chain).get(w), 4);
    index.apply(w, 2, &stored).unwrap();
    // It evicts block 4 again (lost on the way), then block 3, a leaf by then.
    index.apply(w, 4, &removed(3)).unwrap();
    assert!(index.holds(w, chain[4]) && !index.holds(w, chain[3]));
    assert!(index.is_stale(w) && index.may_have_holes(w));
    assert_eq!(index.overlaps(&chain).get(w), 3);
}

/// Trusted removals: a gap whose first event is a store under a lost parent (rejected) still
/// makes the worker holey, or the engine's next eviction would leave a hole the strided probes
/// pass (5 against 3).
#[test]
fn a_gap_carried_by_a_rejected_store_makes_the_worker_holey() {
    let chain = path(&[1; 5], 2);
    let lost = path(&[0; 2], 2);
    let w = WorkerId::new(0);
    let mut index = CacheIndex::new();
    index.set_tail_first(true);
    let stored = KvEvent::Stored {
        parent: None,
        blocks: chain.clone(),
    };
    index.apply(w, 0, &stored).unwrap();
    // Lost: the engine evicted block 4 (the tail) and stored `lost[0]`.
    let rejected = KvEvent::Stored {
        parent: Some(lost[0]),
        blocks: vec![lost[1]],
    };
    assert!(index.apply(w, 3, &rejected).is_err());
    assert!(index.is_stale(w) && index.may_have_holes(w));
    // The engine evicts block 3, a leaf by then; the mirror keeps block 4.
    let removed = KvEvent::Removed {
        blocks: vec![chain[3]],
    };
    index.apply(w, 4, &removed).unwrap();
    assert_eq!(index.overlaps(&chain).get(w), 3);
}

/// Trust switched on over a stale worker (or a default-mode snapshot restored into a trusting
/// router): the stale worker becomes holey, since its lost removals are unaccounted for.
#[test]
fn trusting_a_stale_worker_makes_it_holey() {
    let chain = path(&[1; 5], 2);
    let w = WorkerId::new(0);
    let mut index = CacheIndex::new();
    let stored = KvEvent::Stored {
        parent: None,
        blocks: chain.clone(),
    };
    index.apply(w, 0, &stored).unwrap();
    // Id 1 (the removal of block 4) is lost; a gap is staleness only, by default.
    let other = KvEvent::Stored {
        parent: None,
        blocks: path(&[0], 2),
    };
    index.apply(w, 2, &other).unwrap();
    assert!(index.is_stale(w) && !index.may_have_holes(w));
    let mut index = CacheIndex::restore(index.snapshot()).unwrap();
    index.set_tail_first(true);
    assert!(index.may_have_holes(w));
    let removed = KvEvent::Removed {
        blocks: vec![chain[3]],
    };
    index.apply(w, 3, &removed).unwrap();
    assert_eq!(index.overlaps(&chain).get(w), 3);
}

/// The query guesses where a run ends from the run hint (how far the event that first stored a
/// block went on): a guess that holds for every worker, with a run ending just after it, and
/// a guess past one worker's run, both give exact runs.
#[test]
fn run_hints_right_and_wrong_give_exact_runs() {
    let b = |i: u64| kvblock::BlockHash::new(i);
    let chain = |r: std::ops::Range<u64>| r.map(b).collect::<Vec<_>>();
    let store = |index: &mut CacheIndex, w: u64, id: u64, r: std::ops::Range<u64>| {
        let parent = r.start.checked_sub(1).map(b);
        let ev = KvEvent::Stored {
            parent,
            blocks: chain(r),
        };
        index.apply(WorkerId::new(w), id, &ev).unwrap();
    };
    let runs = |index: &CacheIndex, q: &[kvblock::BlockHash]| {
        let ov = index.overlaps(q);
        let got = (ov.get(WorkerId::new(0)), ov.get(WorkerId::new(1)));
        assert_eq!(vec![got.0, got.1], walked(index, 2, q));
        got
    };

    // Worker 0 stores 0..12 in events of 4; worker 1 stores 0..4, then 4..9: the guess from
    // block 4 (its run went on to block 7) holds for both, and worker 1 ends right after it.
    let mut index = CacheIndex::new();
    for (id, r) in [0..4, 4..8, 8..12].into_iter().enumerate() {
        store(&mut index, 0, id as u64, r);
    }
    store(&mut index, 1, 0, 0..4);
    store(&mut index, 1, 1, 4..9);
    assert_eq!(runs(&index, &chain(0..12)), (12, 9));
    assert_eq!(runs(&index, &chain(0..16)), (12, 9));

    // Worker 0 stores 0..4, then 4..12; worker 1 stores 0..4, then 4..6: the guess from block
    // 4 (to block 11) is past worker 1's run and is searched back.
    let mut index = CacheIndex::new();
    store(&mut index, 0, 0, 0..4);
    store(&mut index, 0, 1, 4..12);
    store(&mut index, 1, 0, 0..4);
    store(&mut index, 1, 1, 4..6);
    assert_eq!(runs(&index, &chain(0..16)), (12, 6));
    assert_eq!(runs(&index, &chain(0..12)), (12, 6));
    assert_eq!(runs(&index, &chain(0..7)), (7, 6));
}
