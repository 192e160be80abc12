//! vLLM events of hybrid models (several KV-cache groups) and multimodal prompts (per-block extra
//! keys): the two reproductions of the bug report in both wire shapes, each group kind, and a
//! model test of the hit rule over random group event streams.

use std::collections::{BTreeMap, BTreeSet};

use kvblock::{vllm_extra_keys, BlockHasher, BlockSize, MultimodalSpan};
use kvroute::{CacheGroup, GroupRule, RequestId, Role, Router, Salt, WorkerId};
use kvroute_vllm::{
    decode_event_batch, BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, KeyValue,
    VllmError, VllmIngest,
};
use proptest::prelude::*;

use super::support::{router, toks, W0, W1};

/// A checked-in fixture of `fixtures/make_vllm_fixtures.py`.
fn fx(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/{name}.msgpack",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

const SHAPES: [&str; 2] = ["map", "positional"];
const BS: usize = 16;

/// The hits each worker would get for `tokens`, without routing.
fn hits(router: &Router, tokens: &[u32]) -> BTreeMap<WorkerId, usize> {
    let blocks = BlockHasher::new(router.block_size()).sequence_hashes(tokens);
    router
        .explain(&blocks, Role::Unified)
        .into_iter()
        .map(|c| (c.worker, c.cache_hits))
        .collect()
}

fn apply(router: &mut Router, ingest: &mut VllmIngest, payload: &[u8]) {
    ingest.apply_payload(router, W0, None, payload).unwrap();
}

#[test]
fn a_sliding_window_eviction_keeps_the_full_attention_hits() {
    for shape in SHAPES {
        let (mut r, mut ingest) = (router(), VllmIngest::new());
        let payload = &fx(&format!("hybrid_sliding_window_{shape}"));
        let batch = decode_event_batch(payload).unwrap();
        let EngineEvent::BlockStored(sw) = &batch.events[1] else {
            panic!("{batch:?}")
        };
        assert_eq!(
            (
                sw.group_idx,
                sw.kv_cache_spec_kind.as_deref(),
                sw.kv_cache_spec_sliding_window
            ),
            (Some(1), Some("sliding_window"), Some(128)),
            "{shape}"
        );
        apply(&mut r, &mut ingest, payload);
        // Group 0 holds all 16 blocks; group 1 holds the 8 its window needs: the engine serves 16.
        assert_eq!(hits(&r, &toks(0, 256))[&W0], 16, "{shape}");
        // Routed by tokens: a follow-up turn reuses all 16 blocks; an exact repeat of the 256
        // tokens reuses at most 15 (the last token is recomputed), whose window lost block 7.
        let mut route = |id: u64, n: u32| {
            let d = r
                .route_tokens(RequestId::new(id), &toks(0, n), Role::Unified)
                .unwrap();
            r.finish(RequestId::new(id)).unwrap();
            d.cache_hits
        };
        assert_eq!((route(1, 304), route(2, 256)), (16, 0), "{shape}");
        assert_eq!((r.cache_view(W0), r.group_view(W0, 1)), (16, Some(8)));
        let sw = CacheGroup::new(
            GroupRule::SlidingWindow { window_tokens: 128 },
            BlockSize::new(BS).unwrap(),
        );
        assert_eq!(r.groups(W0), [(1, sw)]);
        // A request that ends inside the evicted stretch finds no window: only what group 1's
        // window before it holds counts (blocks 0..8 are gone there), so 0 hits.
        assert_eq!(hits(&r, &toks(0, 128))[&W0], 0, "{shape}");
        // 12 blocks: the window before block 12 is blocks 4..12, half evicted; the longest
        // prefix group 1 serves is 0 (no 8 resident in a row end at or below 12).
        assert_eq!(hits(&r, &toks(0, 192))[&W0], 0, "{shape}");
    }
}

#[test]
fn a_state_space_group_at_its_own_block_size_is_tracked_not_rejected() {
    for shape in SHAPES {
        let (mut r, mut ingest) = (router(), VllmIngest::new());
        let s = ingest
            .apply_payload(
                &mut r,
                W0,
                None,
                &fx(&format!("hybrid_mamba_block_size_{shape}")),
            )
            .unwrap();
        assert_eq!((s.events_applied, s.untracked_blocks), (2, 0), "{shape}");
        assert_eq!((r.cache_view(W0), r.group_view(W0, 1)), (8, Some(2)));
        assert_eq!(hits(&r, &toks(0, 128))[&W0], 8, "{shape}");
        // Without the state at token 128, the last state the group holds is at token 64.
        let removed = BlockRemoved::new(vec![EngineHash::Int(5102)]).in_group(1);
        let batch = EventBatch::new(1.0, vec![EngineEvent::BlockRemoved(removed)]);
        ingest.apply_batch(&mut r, W0, None, &batch).unwrap();
        assert_eq!(hits(&r, &toks(0, 128))[&W0], 4, "{shape}");
        // A 7-block request: the group's states sit at 4 and 8 router blocks, so 4.
        assert_eq!(hits(&r, &toks(0, 112))[&W0], 4, "{shape}");
        // Routed by its tokens, a 128-token prompt can reuse at most 127 tokens, as in vLLM: the
        // state at 64 tokens is the last one before that, so 4 (it was at 128 before the removal).
        let d = r
            .route_tokens(RequestId::new(9), &toks(0, 128), Role::Unified)
            .unwrap();
        assert_eq!(d.cache_hits, 4, "{shape}");
        r.finish(RequestId::new(9)).unwrap();
    }
}

#[test]
fn a_window_group_store_may_chain_on_a_parent_only_the_full_group_holds() {
    let (mut r, mut ingest) = (router(), VllmIngest::new());
    let h = |i: u64| EngineHash::Int(4000 + i);
    let full = BlockStored::new((1..=8).map(h).collect(), None, toks(0, 128), 16).in_group(
        0,
        "full_attention",
        None,
    );
    // The window group stores only the second half, chained on block 8 (hash h(8)).
    let sw = BlockStored::new((9..=16).map(h).collect(), Some(h(8)), toks(128, 128), 16).in_group(
        1,
        "sliding_window",
        Some(128),
    );
    let full2 = BlockStored::new((9..=16).map(h).collect(), Some(h(8)), toks(128, 128), 16)
        .in_group(0, "full_attention", None);
    let batch = EventBatch::new(
        0.0,
        vec![
            EngineEvent::BlockStored(full),
            EngineEvent::BlockStored(sw),
            EngineEvent::BlockStored(full2),
        ],
    );
    let s = ingest.apply_batch(&mut r, W0, None, &batch).unwrap();
    assert_eq!((s.unknown_parents, s.blocks_stored), (0, 24), "{s:?}");
    assert_eq!(r.group_view(W0, 1), Some(8));
    assert_eq!(hits(&r, &toks(0, 256))[&W0], 16);
}

#[test]
fn a_group_at_a_block_size_that_does_not_divide_is_counted() {
    let (mut r, mut ingest) = (router(), VllmIngest::new());
    let full = BlockStored::new(
        (1..=4).map(EngineHash::Int).collect(),
        None,
        toks(0, 64),
        16,
    )
    .in_group(0, "full_attention", None);
    let odd = BlockStored::new(vec![EngineHash::Int(9)], None, toks(0, 24), 24)
        .in_group(1, "mamba", None);
    let batch = EventBatch::new(
        0.0,
        vec![
            EngineEvent::BlockStored(full),
            EngineEvent::BlockStored(odd),
        ],
    );
    let s = ingest.apply_batch(&mut r, W0, None, &batch).unwrap();
    assert_eq!((s.blocks_stored, s.untracked_blocks), (4, 1));
    assert_eq!(ingest.stats(W0).untracked_blocks, 1);
    assert_eq!(hits(&r, &toks(0, 64))[&W0], 4);
    // The group the router hashes with must still be at its block size.
    let wrong = BlockStored::new(vec![EngineHash::Int(1)], None, toks(0, 32), 32).in_group(
        0,
        "full_attention",
        None,
    );
    let batch = EventBatch::new(0.0, vec![EngineEvent::BlockStored(wrong)]);
    assert!(matches!(
        ingest.apply_batch(&mut r, W1, None, &batch),
        Err(VllmError::BlockSizeMismatch {
            engine: 32,
            router: 16,
            ..
        })
    ));
}

#[test]
fn only_the_same_image_hits() {
    for shape in SHAPES {
        let (mut r, mut ingest) = (router(), VllmIngest::new());
        let payload = &fx(&format!("multimodal_extra_keys_{shape}"));
        let batch = decode_event_batch(payload).unwrap();
        let EngineEvent::BlockStored(st) = &batch.events[0] else {
            panic!()
        };
        let key = |off| {
            Some(vec![KeyValue::Tuple(vec![
                KeyValue::Str("img-A".into()),
                KeyValue::Int(off),
            ])])
        };
        assert_eq!(st.extra_keys, [key(0), key(-16)], "{shape}");
        apply(&mut r, &mut ingest, payload);
        let placeholders = vec![151_655u32; 32];
        let bs = r.block_size();
        let image = |id: &str| vllm_extra_keys(bs, 32, &[MultimodalSpan::new(id, 0, 32)], None);
        let mut route = |id: u64, keys: &[kvroute::ExtraKeys]| {
            let d = r
                .route_tokens_keyed(
                    RequestId::new(id),
                    &placeholders,
                    &Salt::default(),
                    keys,
                    Role::Unified,
                )
                .unwrap();
            r.finish(RequestId::new(id)).unwrap();
            d
        };
        let other = route(1, &image("img-B"));
        assert_eq!(
            other.cache_hits, 0,
            "{shape}: a different image must not hit"
        );
        let plain = route(2, &[]);
        assert_eq!(
            plain.cache_hits, 0,
            "{shape}: no keys never matches keyed blocks"
        );
        let same = route(3, &image("img-A"));
        assert_eq!((same.worker, same.cache_hits), (W0, 2), "{shape}");
    }
}

#[test]
fn the_lora_name_in_extra_keys_is_not_hashed_twice() {
    for shape in SHAPES {
        let (mut r, mut ingest) = (router(), VllmIngest::new());
        apply(
            &mut r,
            &mut ingest,
            &fx(&format!("lora_extra_keys_{shape}")),
        );
        let ours = BlockHasher::new(r.block_size())
            .with_lora_name("my-lora")
            .sequence_hashes(&toks(0, 16));
        assert_eq!(
            ingest.our_hash(W0, &EngineHash::Int(6101)),
            Some(ours[0]),
            "{shape}"
        );
        let d = r
            .route_tokens_salted(
                RequestId::new(1),
                &toks(0, 16),
                &Salt::lora("my-lora"),
                Role::Unified,
            )
            .unwrap();
        assert_eq!((d.worker, d.cache_hits), (W0, 1), "{shape}");
    }
}

#[test]
fn unknown_kinds_count_as_full_attention_and_lookahead_is_accepted() {
    // vLLM 0.33 writes lookahead tokens as list[list[int]], one list per block (an empty one or
    // nil where a block has none): such a batch applies, and the blocks hit as without them.
    for lookahead in [vec![vec![16, 17], vec![32, 33]], vec![vec![], vec![32]]] {
        let mut st = BlockStored::new(
            vec![EngineHash::Int(501), EngineHash::Int(502)],
            None,
            toks(0, 32),
            16,
        );
        st.lookahead_token_ids = Some(lookahead.clone());
        let batch = EventBatch::new(1.0, vec![EngineEvent::BlockStored(st)]);
        let payload = batch.to_msgpack();
        assert_eq!(decode_event_batch(&payload).unwrap(), batch);
        let (mut r, mut ingest) = (router(), VllmIngest::new());
        let s = ingest.apply_payload(&mut r, W0, None, &payload).unwrap();
        assert_eq!(s.blocks_stored, 2, "{lookahead:?}");
        assert_eq!(hits(&r, &toks(0, 32))[&W0], 2, "{lookahead:?}");
    }

    for shape in SHAPES {
        let (mut r, mut ingest) = (router(), VllmIngest::new());
        let payload = &fx(&format!("unknown_kind_lookahead_{shape}"));
        let batch = decode_event_batch(payload).unwrap();
        let EngineEvent::BlockStored(st) = &batch.events[0] else {
            panic!()
        };
        // An older flat list reads as one list.
        assert_eq!(st.lookahead_token_ids, Some(vec![vec![32u32]]));
        let s = ingest.apply_payload(&mut r, W0, None, payload).unwrap();
        assert_eq!((s.unknown_group_kinds, s.blocks_stored), (1, 2), "{shape}");
        assert_eq!(ingest.stats(W0).unknown_group_kinds, 1);
        assert_eq!(hits(&r, &toks(0, 32))[&W0], 2, "{shape}");
    }
}

#[test]
fn extra_keys_must_have_one_entry_per_block() {
    let e = decode_event_batch(&fx("bad_extra_keys_count"))
        .map(|b| VllmIngest::new().apply_batch(&mut router(), W0, None, &b));
    let err = e.unwrap().unwrap_err();
    assert_eq!(
        err,
        VllmError::ExtraKeysCountMismatch {
            event: 0,
            keys: 1,
            blocks: 2
        }
    );
    assert!(err
        .to_string()
        .contains("1 extra_keys entries for 2 block hash(es)"));
}

#[test]
fn two_engine_blocks_with_one_of_our_hashes_leave_with_the_last() {
    // An engine that keys blocks by more than we do (a draft model's lookahead, say) may store
    // the same tokens under two hashes: ours stays until both are removed.
    let (mut r, mut ingest) = (router(), VllmIngest::new());
    let st = |h| {
        EngineEvent::BlockStored(BlockStored::new(
            vec![EngineHash::Int(h)],
            None,
            toks(0, 16),
            16,
        ))
    };
    let rm = |h| EngineEvent::BlockRemoved(BlockRemoved::new(vec![EngineHash::Int(h)]));
    let batch = EventBatch::new(0.0, vec![st(1), st(2), rm(1)]);
    ingest.apply_batch(&mut r, W0, None, &batch).unwrap();
    assert_eq!(hits(&r, &toks(0, 16))[&W0], 1);
    let batch = EventBatch::new(0.0, vec![rm(2)]);
    ingest.apply_batch(&mut r, W0, None, &batch).unwrap();
    assert_eq!(hits(&r, &toks(0, 16))[&W0], 0);
}

// ---- The model test: random group event streams against the hit rule spelled out. ----

/// Router blocks per prompt.
const N: usize = 16;
/// The groups: 0 full attention at 16 (the index's), 1 sliding window at 16, 2 state space at
/// 32 (2 router blocks per block).
const GROUPS: [(u32, usize); 3] = [(0, 1), (1, 1), (2, 2)];

fn prompt(p: usize) -> Vec<u32> {
    // Prompts 0 and 1 share their first 4 blocks.
    (0..(N * BS) as u32)
        .map(|t| {
            if (t as usize) < 4 * BS {
                t
            } else {
                t + 100_000 * p as u32
            }
        })
        .collect()
}

/// The engine's hash of block `i` (in group `g`'s blocks) of prompt `p`: shared where the
/// prompts share tokens.
fn engine_hash(g: u32, p: usize, i: usize) -> u64 {
    let factor = GROUPS[g as usize].1;
    let shared = (i + 1) * factor <= 4;
    let base = if g == 2 { 50_000 } else { 0 };
    base + if shared {
        i as u64
    } else {
        1_000 * (p as u64 + 1) + i as u64
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Group g of worker w stored blocks 0..upto of prompt p (in the group's blocks).
    Store {
        w: usize,
        g: u32,
        p: usize,
        upto: usize,
    },
    /// Group g of worker w evicted these blocks of prompt p.
    Remove {
        w: usize,
        g: u32,
        p: usize,
        blocks: Vec<usize>,
    },
    Clear {
        w: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..2usize, 0..3u32, 0..2usize, 1..=N).prop_map(|(w, g, p, upto)| {
            let upto = upto.div_ceil(GROUPS[g as usize].1);
            Op::Store { w, g, p, upto }
        }),
        4 => (0..2usize, 0..3u32, 0..2usize, proptest::collection::vec(0..N, 1..6)).prop_map(
            |(w, g, p, blocks)| {
                let n = N / GROUPS[g as usize].1;
                Op::Remove { w, g, p, blocks: blocks.into_iter().map(|b| b % n).collect() }
            }
        ),
        1 => (0..2usize).prop_map(|w| Op::Clear { w }),
    ]
}

fn spec(g: u32, window: usize) -> (&'static str, Option<u64>, usize) {
    match g {
        0 => ("full_attention", None, BS),
        1 => ("sliding_window", Some(window as u64), BS),
        _ => ("mamba", None, 2 * BS),
    }
}

/// The model: per worker and group, the engine hashes resident; and which groups were seen.
#[derive(Default, Debug)]
struct Model {
    resident: BTreeMap<(usize, u32), BTreeSet<u64>>,
    seen: BTreeSet<(usize, u32)>,
}

impl Model {
    /// The hit rule, spelled out: start from group 0's leading run (or all N for a worker with
    /// other groups but never group 0),
    /// then cut by each group's rule, by its definition, until nothing changes.
    fn hit(&self, w: usize, p: usize, window: usize) -> usize {
        let holds = |g: u32, i: usize| {
            self.resident
                .get(&(w, g))
                .is_some_and(|s| s.contains(&engine_hash(g, p, i)))
        };
        let any_side = (1..3).any(|g| self.seen.contains(&(w, g)));
        let mut h = if self.seen.contains(&(w, 0)) || !any_side {
            (0..N).take_while(|&i| holds(0, i)).count()
        } else {
            N
        };
        loop {
            let before = h;
            for (g, k) in GROUPS.into_iter().skip(1) {
                if !self.seen.contains(&(w, g)) {
                    continue;
                }
                let need = if g == 1 {
                    (window - 1).div_ceil(BS).max(1)
                } else {
                    1
                };
                // The largest hit point c (in group blocks) with every block of the `need`
                // before it resident (every block, when c < need).
                let c = (0..=h / k)
                    .rev()
                    .find(|&c| (c.saturating_sub(need)..c).all(|j| holds(g, j)))
                    .unwrap_or(0);
                h = c * k;
            }
            if h == before {
                return h;
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn group_hits_follow_the_rule(window in 1..100usize, ops in proptest::collection::vec(op(), 1..40)) {
        let mut r = router();
        let mut ingest = VllmIngest::new();
        let mut model = Model::default();
        let workers = [W0, W1];
        for op in ops {
            let views_before: Vec<Option<usize>> =
                (1..3).map(|g| r.group_view(W0, g)).collect();
            let event = match &op {
                Op::Store { w, g, p, upto } => {
                    let (kind, win, gbs) = spec(*g, window);
                    let hashes = (0..*upto).map(|i| EngineHash::Int(engine_hash(*g, *p, i))).collect();
                    let tokens = prompt(*p)[..upto * gbs].to_vec();
                    let st = BlockStored::new(hashes, None, tokens, gbs as u64).in_group(*g, kind, win);
                    let set = model.resident.entry((*w, *g)).or_default();
                    set.extend((0..*upto).map(|i| engine_hash(*g, *p, i)));
                    model.seen.insert((*w, *g));
                    (*w, EngineEvent::BlockStored(st))
                }
                Op::Remove { w, g, p, blocks } => {
                    let hashes: Vec<u64> = blocks.iter().map(|&i| engine_hash(*g, *p, i)).collect();
                    if let Some(set) = model.resident.get_mut(&(*w, *g)) {
                        for h in &hashes {
                            set.remove(h);
                        }
                    }
                    let rm = BlockRemoved::new(hashes.into_iter().map(EngineHash::Int).collect()).in_group(*g);
                    (*w, EngineEvent::BlockRemoved(rm))
                }
                Op::Clear { w } => {
                    for g in 0..3 {
                        model.resident.remove(&(*w, g));
                    }
                    (*w, EngineEvent::AllBlocksCleared)
                }
            };
            let (w, ev) = event;
            ingest
                .apply_batch(&mut r, workers[w], None, &EventBatch::new(0.0, vec![ev]))
                .unwrap();
            // A removal in group 0 never changes another group's mirror.
            if let Op::Remove { w: 0, g: 0, .. } = op {
                let after: Vec<Option<usize>> = (1..3).map(|g| r.group_view(W0, g)).collect();
                prop_assert_eq!(&views_before, &after);
            }
            for (wi, &worker) in workers.iter().enumerate() {
                for g in 1..3u32 {
                    let expected = model.resident.get(&(wi, g)).map(BTreeSet::len);
                    let got = r.group_view(worker, g);
                    if model.seen.contains(&(wi, g)) {
                        prop_assert_eq!(got, Some(expected.unwrap_or(0)), "group {} of {:?}", g, worker);
                    }
                }
                prop_assert_eq!(
                    r.cache_view(worker),
                    model.resident.get(&(wi, 0)).map_or(0, BTreeSet::len),
                    "group 0 of {:?}", worker
                );
            }
            for p in 0..2 {
                let got = hits(&r, &prompt(p));
                for (wi, &worker) in workers.iter().enumerate() {
                    prop_assert_eq!(got[&worker], model.hit(wi, p, window), "prompt {} on {:?} after {:?}", p, worker, op);
                }
            }
        }
    }
}
