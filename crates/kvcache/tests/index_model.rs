//! `CacheIndex` against a naive model (a set per worker), and the mirror property: caches under
//! eviction pressure, their events applied to one index, always agree.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;

use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::{BlockCache, CacheIndex, Error, KvEvent, WorkerId};
use proptest::prelude::*;

#[derive(Debug, Default)]
struct MWorker {
    blocks: BTreeSet<BlockHash>,
    next: u64,
    stale: bool,
}

type Outcome = (Option<(u64, u64)>, usize, usize, usize, usize);

#[derive(Debug, Default)]
struct Model {
    workers: BTreeMap<WorkerId, MWorker>,
}

impl Model {
    /// Ok(gap, stored, present, removed, unknown) or Err(kind).
    fn apply(&mut self, w: WorkerId, id: u64, ev: &KvEvent) -> Result<Outcome, &'static str> {
        let st = self.workers.entry(w).or_default();
        if id < st.next {
            return Err("stale");
        }
        let gap = (id > st.next).then_some((st.next, id));
        st.stale |= gap.is_some();
        st.next = id.saturating_add(1);
        match ev {
            KvEvent::Stored { parent, blocks } => {
                if let Some(p) = parent {
                    if !st.blocks.contains(p) {
                        st.stale = true;
                        return Err("parent");
                    }
                }
                let (mut new, mut present) = (0, 0);
                for b in blocks {
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
    fn run(&self, w: WorkerId, q: &[BlockHash]) -> usize {
        self.workers
            .get(&w)
            .map_or(0, |s| q.iter().take_while(|b| s.blocks.contains(b)).count())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Apply {
        worker: u64,
        id_delta: i8,
        event: KvEvent,
    },
    Remove(u64),
    Clear(u64),
    Query(Vec<BlockHash>),
}

fn blocks() -> impl Strategy<Value = Vec<BlockHash>> {
    prop::collection::vec((0u64..12).prop_map(BlockHash::new), 0..6)
}

fn op() -> impl Strategy<Value = Op> {
    // Worker ids spread over two bitset words (0..3 and 64..67) and a far one.
    let worker = prop_oneof![0u64..3, 64u64..67, Just(200u64)];
    let event = prop_oneof![
        4 => (prop::option::weighted(0.5, (0u64..12).prop_map(BlockHash::new)), blocks())
            .prop_map(|(parent, blocks)| KvEvent::Stored { parent, blocks }),
        2 => blocks().prop_map(|blocks| KvEvent::Removed { blocks }),
        1 => Just(KvEvent::Cleared),
    ];
    prop_oneof![
        8 => (worker.clone(), prop_oneof![8 => Just(0i8), 1 => -2i8..0, 1 => 1i8..3], event)
            .prop_map(|(worker, id_delta, event)| Op::Apply { worker, id_delta, event }),
        1 => worker.clone().prop_map(Op::Remove),
        1 => worker.prop_map(Op::Clear),
        3 => blocks().prop_map(Op::Query),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn index_matches_model(placeholders in prop::sample::select(vec![0u64, 30, 61]), ops in prop::collection::vec(op(), 1..100)) {
        let mut real = CacheIndex::new();
        let mut model = Model::default();
        // Dense indices follow registration order: placeholders push the tested workers across
        // the 32- and 64-worker boundaries of the holder sets.
        for k in 0..placeholders {
            let w = WorkerId::new(10_000 + k);
            real.add_worker(w).unwrap();
            model.workers.entry(w).or_default();
        }
        for op in &ops {
            match op {
                Op::Apply { worker, id_delta, event } => {
                    let w = WorkerId::new(*worker);
                    let next = model.workers.get(&w).map_or(0, |s| s.next);
                    let id = next.saturating_add_signed(i64::from(*id_delta));
                    let r = real.apply(w, id, event);
                    let m = model.apply(w, id, event);
                    match (r, m) {
                        (Ok(a), Ok((gap, stored, present, removed, unknown))) => {
                            prop_assert_eq!((a.gap, a.stored, a.already_present, a.removed, a.unknown_removed),
                                            (gap, stored, present, removed, unknown));
                        }
                        (Err(Error::StaleEvent { got, .. }), Err("stale")) => prop_assert_eq!(got, id),
                        (Err(Error::UnknownParent { .. }), Err("parent")) => {}
                        (r, m) => prop_assert!(false, "{:?}: real {:?}, model {:?}", op, r, m),
                    }
                }
                Op::Remove(w) => {
                    let w = WorkerId::new(*w);
                    prop_assert_eq!(real.remove_worker(w), model.workers.remove(&w).is_some());
                }
                Op::Clear(w) => {
                    let w = WorkerId::new(*w);
                    let n = model.workers.get_mut(&w).map_or(0, |s| {
                        s.stale = false;
                        std::mem::take(&mut s.blocks).len()
                    });
                    prop_assert_eq!(real.clear_worker(w), n);
                }
                Op::Query(q) => {
                    let ov = real.overlaps(q);
                    for &w in model.workers.keys() {
                        prop_assert_eq!(ov.get(w), model.run(w, q));
                        let i = real.worker_index(w).expect("registered");
                        prop_assert_eq!(ov.run_at(i), model.run(w, q));
                    }
                    prop_assert_eq!(ov.iter().count(), model.workers.keys().filter(|w| model.run(**w, q) > 0).count());
                }
            }
            if let Err(e) = real.check_invariants() {
                return Err(TestCaseError::fail(format!("after {op:?}: {e}")));
            }
            prop_assert_eq!(real.workers(), model.workers.keys().copied().collect::<Vec<_>>());
            for (w, s) in &model.workers {
                prop_assert_eq!(real.block_count(*w), s.blocks.len());
                prop_assert_eq!(real.is_stale(*w), s.stale);
                prop_assert_eq!(real.next_event_id(*w), Some(s.next));
            }
            prop_assert_eq!(real.pairs(), model.workers.values().map(|s| s.blocks.len()).sum::<usize>());
        }
    }

    /// N engines under eviction pressure; their drained events go to one index. After every
    /// step, the index's view of each worker equals the engine's truth.
    #[test]
    fn mirror_property(caps in prop::collection::vec(1usize..8, 1..5),
                       steps in prop::collection::vec((0usize..5, prop::collection::vec(0u32..3, 1..6), any::<bool>()), 1..60),
                       queries in prop::collection::vec(prop::collection::vec(0u32..3, 1..6), 4)) {
        let hasher = BlockHasher::new(BlockSize::new(1).expect("non-zero"));
        let mut caches: Vec<BlockCache> = caps.iter().map(|&c| BlockCache::new(NonZeroUsize::new(c))).collect();
        let mut ids = vec![0u64; caches.len()];
        let mut index = CacheIndex::new();
        let mut pinned: Vec<Option<Vec<BlockHash>>> = vec![None; caches.len()];
        for (w, tokens, pin) in steps {
            let w = w % caches.len();
            let chain = hasher.sequence_hashes(&tokens);
            let cache = &mut caches[w];
            if let Some(p) = pinned[w].take() {
                cache.unpin(&p);
            }
            if cache.insert(&chain).is_ok() && pin {
                let n = cache.pin(&chain);
                pinned[w] = Some(chain[..n].to_vec());
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
                prop_assert_eq!(index.block_count(WorkerId::new(i as u64)), c.len());
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
