//! The router's contract: the cost function and its worked example, decisions, errors and load
//! tracking against the model of `kvtest::router` (shared with the fuzz target `router_ops`),
//! policies, determinism, misuse and the multi-threaded pattern.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use kvblock::{BlockHash, BlockSize};
use kvcache::{CacheIndex, KvEvent, WorkerId};
use kvroute::{cost, Error, Policy, RequestId, Role, Router};
use kvtest::router::{self as router_model, Harness, Op};
use proptest::prelude::*;

fn b(i: u64) -> BlockHash {
    BlockHash::new(i)
}
fn chain(r: std::ops::RangeInclusive<u64>) -> Vec<BlockHash> {
    r.map(b).collect()
}
fn router(policy: Policy, weight: f64, workers: u64) -> Router {
    let mut r = Router::builder()
        .block_size(BlockSize::new(16).unwrap())
        .policy(policy)
        .overlap_weight(weight)
        .seed(7)
        .build()
        .unwrap();
    for w in 0..workers {
        r.add_worker(WorkerId::new(w));
    }
    r
}
const W0: WorkerId = WorkerId::new(0);
const W1: WorkerId = WorkerId::new(1);

#[test]
fn cost_formula_and_extremes() {
    assert_eq!(cost(1.0, 10, 8, 6), 8.0);
    assert_eq!(cost(1.0, 10, 0, 1), 11.0);
    assert_eq!(cost(0.0, 10, 0, 3), 3.0, "weight 0 is pure load");
    assert_eq!(
        cost(2.5, 4, 9, 1),
        1.0,
        "hits beyond the request count as a full hit"
    );
}

/// The source document's worked example, played through the router: W0 caches 8 blocks of a
/// 10-block prompt and has 6 active blocks, W1 is cold with 1 active block.
#[test]
fn worked_example_w0_wins_with_cost_8() {
    let mut r = router(Policy::Kv, 1.0, 2);
    r.apply_event(
        W0,
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: chain(1..=8),
        },
    )
    .unwrap();
    assert_eq!(
        r.route(RequestId::new(1), &chain(1..=6), Role::Unified)
            .unwrap()
            .worker,
        W0
    );
    assert_eq!(
        r.route(RequestId::new(2), &[b(100)], Role::Unified)
            .unwrap()
            .worker,
        W1
    );
    assert_eq!((r.active_blocks(W0), r.active_blocks(W1)), (6, 1));

    let prompt = chain(1..=10);
    let why = r.explain(&prompt, Role::Unified);
    let costs: Vec<(u64, usize, usize, f64)> = why
        .iter()
        .map(|c| (c.worker.get(), c.cache_hits, c.active_blocks, c.cost))
        .collect();
    assert_eq!(costs, vec![(0, 8, 6, 8.0), (1, 0, 1, 11.0)]);
    let d = r.route(RequestId::new(3), &prompt, Role::Unified).unwrap();
    assert_eq!(
        (d.worker, d.cache_hits, d.cost, d.request_blocks),
        (W0, 8, 8.0, 10)
    );
}

#[test]
fn weight_zero_is_pure_load_and_large_weight_pure_locality() {
    for weight in [0.0, 1000.0] {
        let mut r = router(Policy::Kv, weight, 2);
        // 41 blocks of unrelated load land on one worker; then that worker caches the prompt.
        let busy = r
            .route(RequestId::new(1), &chain(500..=540), Role::Unified)
            .unwrap()
            .worker;
        let idle = if busy == W0 { W1 } else { W0 };
        r.apply_event(
            busy,
            0,
            &KvEvent::Stored {
                parent: None,
                blocks: chain(1..=8),
            },
        )
        .unwrap();
        let d = r
            .route(RequestId::new(2), &chain(1..=8), Role::Unified)
            .unwrap();
        if weight == 0.0 {
            assert_eq!(
                d.worker, idle,
                "weight 0 must ignore the cache and pick the idle worker"
            );
        } else {
            assert_eq!(
                (d.worker, d.cache_hits),
                (busy, 8),
                "a large weight must follow the cache"
            );
        }
    }
}

#[test]
fn per_role_weights_override_the_global_one() {
    let mut r = Router::builder()
        .overlap_weight(1.0)
        .prefill_overlap_weight(20.0)
        .decode_overlap_weight(0.0)
        .build()
        .unwrap();
    assert_eq!(
        (
            r.weight(Role::Unified),
            r.weight(Role::Prefill),
            r.weight(Role::Decode)
        ),
        (1.0, 20.0, 0.0)
    );
    r.add_worker(W0);
    r.add_worker(W1);
    r.apply_event(
        W0,
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: chain(1..=4),
        },
    )
    .unwrap();
    r.route(RequestId::new(1), &chain(200..=230), Role::Unified)
        .unwrap(); // 31 blocks of load somewhere
    let busy = if r.active_blocks(W0) > 0 { W0 } else { W1 };
    let idle = if busy == W0 { W1 } else { W0 };
    // Decode weight 0 follows load; prefill weight 20 follows the 4-block hit only if W0 is the
    // idle one or the hit outweighs 31 blocks of load (20 * 4 = 80 > 31).
    assert_eq!(
        r.route(RequestId::new(2), &chain(1..=4), Role::Decode)
            .unwrap()
            .worker,
        idle
    );
    r.finish(RequestId::new(2)).unwrap();
    assert_eq!(
        r.route(RequestId::new(3), &chain(1..=4), Role::Prefill)
            .unwrap()
            .worker,
        W0
    );
}

#[test]
fn load_is_reference_counted_distinct_blocks() {
    let mut r = router(Policy::RoundRobin, 1.0, 1);
    r.route(RequestId::new(1), &chain(1..=10), Role::Unified)
        .unwrap();
    r.route(RequestId::new(2), &chain(1..=12), Role::Unified)
        .unwrap();
    assert_eq!(r.active_blocks(W0), 12);
    assert_eq!(r.in_flight(W0), 2);
    r.finish(RequestId::new(1)).unwrap();
    assert_eq!(r.active_blocks(W0), 12);
    r.finish(RequestId::new(2)).unwrap();
    assert_eq!(r.active_blocks(W0), 0);
    assert_eq!(
        r.finish(RequestId::new(2)),
        Err(Error::UnknownRequest {
            request_id: RequestId::new(2)
        })
    );
    assert_eq!(
        r.finish(RequestId::new(99)),
        Err(Error::UnknownRequest {
            request_id: RequestId::new(99)
        })
    );
}

#[test]
fn misuse_is_an_error_value() {
    let mut empty = router(Policy::Kv, 1.0, 0);
    assert_eq!(
        empty.route(RequestId::new(1), &chain(1..=2), Role::Unified),
        Err(Error::NoWorkers)
    );
    let mut r = router(Policy::Kv, 1.0, 1);
    r.route(RequestId::new(1), &[], Role::Unified).unwrap();
    assert_eq!(
        r.route(RequestId::new(1), &[], Role::Unified),
        Err(Error::DuplicateRequest {
            request_id: RequestId::new(1)
        })
    );
    assert_eq!(
        r.apply_event(WorkerId::new(5), 0, &KvEvent::Cleared),
        Err(Error::UnknownWorker {
            worker: WorkerId::new(5)
        })
    );
    assert!(matches!(r.apply_event(W0, 3, &KvEvent::Cleared), Ok(a) if a.gap == Some((0, 3))));
    assert!(matches!(
        r.apply_event(W0, 1, &KvEvent::Cleared),
        Err(Error::Index(_))
    ));
    for bad in [f64::NAN, -1.0, f64::INFINITY] {
        let e = Router::builder().overlap_weight(bad).build().unwrap_err();
        assert!(
            e.to_string().contains("expected a finite number >= 0"),
            "{e}"
        );
    }
    assert!(Router::builder().prefix_blocks(0).build().is_err());
    assert!(Router::builder().virtual_nodes(0).build().is_err());
    assert_eq!(
        "lru".parse::<Policy>().unwrap_err().to_string(),
        "unknown routing policy \"lru\": expected one of kv, prefix_aware, round_robin, random"
    );
}

#[test]
fn removing_a_worker_drops_it_everywhere() {
    let mut r = router(Policy::Kv, 1.0, 2);
    r.apply_event(
        W0,
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: chain(1..=8),
        },
    )
    .unwrap();
    r.route(RequestId::new(1), &chain(1..=8), Role::Unified)
        .unwrap();
    assert!(r.remove_worker(W0));
    assert!(!r.remove_worker(W0));
    assert_eq!(r.cache_view(W0), 0);
    assert_eq!(r.workers(), vec![W1]);
    for id in 2..10 {
        assert_eq!(
            r.route(RequestId::new(id), &chain(1..=8), Role::Unified)
                .unwrap()
                .worker,
            W1
        );
    }
    // The removed worker's request can still be finished; re-adding starts clean.
    r.finish(RequestId::new(1)).unwrap();
    assert!(r.add_worker(W0));
    assert_eq!(r.active_blocks(W0), 0);
    assert!(r.apply_event(W0, 0, &KvEvent::Cleared).is_ok());
}

#[test]
fn prefix_aware_sends_a_prefix_home_and_spreads_prefixes() {
    let mut r = router(Policy::PrefixAware, 1.0, 8);
    let mut homes = BTreeSet::new();
    for p in 0..64u64 {
        let first = r
            .route(RequestId::new(p * 10), &[b(p), b(1000 + p)], Role::Unified)
            .unwrap()
            .worker;
        let again = r
            .route(
                RequestId::new(p * 10 + 1),
                &[b(p), b(2000 + p)],
                Role::Unified,
            )
            .unwrap()
            .worker;
        assert_eq!(first, again, "same first block, same home");
        homes.insert(first);
    }
    assert!(
        homes.len() >= 6,
        "64 prefixes should land on most of 8 workers, got {}",
        homes.len()
    );
}

#[test]
fn random_and_round_robin_spread_evenly() {
    for policy in [Policy::Random, Policy::RoundRobin] {
        let mut r = router(policy, 1.0, 4);
        let mut counts = BTreeMap::new();
        for id in 0..4000 {
            *counts
                .entry(
                    r.route(RequestId::new(id), &[b(1)], Role::Unified)
                        .unwrap()
                        .worker,
                )
                .or_insert(0) += 1;
        }
        for (w, c) in counts {
            assert!((850..=1150).contains(&c), "{policy}: {w} got {c} of 4000");
        }
    }
}

#[test]
fn same_seed_same_decisions() {
    let run = |seed| {
        let mut r = Router::builder()
            .policy(Policy::Kv)
            .overlap_weight(0.0)
            .seed(seed)
            .build()
            .unwrap();
        (0..16).for_each(|w| {
            r.add_worker(WorkerId::new(w));
        });
        // Weight 0 and equal load: every decision is a tie broken by the seeded generator.
        (0..200u64)
            .map(|id| {
                let d = r
                    .route(RequestId::new(id), &[], Role::Unified)
                    .unwrap()
                    .worker
                    .get();
                r.finish(RequestId::new(id)).unwrap();
                d
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

#[test]
fn route_tokens_hashes_at_the_router_block_size() {
    let mut r = router(Policy::Kv, 1.0, 2);
    let tokens: Vec<u32> = (0..40).collect();
    let hashes = kvblock::BlockHasher::new(BlockSize::new(16).unwrap()).sequence_hashes(&tokens);
    r.apply_event(
        W1,
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: hashes.clone(),
        },
    )
    .unwrap();
    let d = r
        .route_tokens(RequestId::new(1), &tokens, Role::Prefill)
        .unwrap();
    assert_eq!((d.worker, d.cache_hits, d.request_blocks), (W1, 2, 2));
}

/// Two threads route and finish through a shared router while a third applies engine events:
/// no lost update, every request finished exactly once, bounded time.
#[test]
fn shared_router_across_threads() {
    let shared = Arc::new(Mutex::new(router(Policy::Kv, 1.0, 4)));
    let events: Vec<(WorkerId, u64, KvEvent)> = (0..4u64)
        .flat_map(|w| {
            (0..200u64).map(move |i| {
                let ev = if i % 5 == 4 {
                    KvEvent::Removed {
                        blocks: vec![b(w * 10_000 + i - 1)],
                    }
                } else {
                    KvEvent::Stored {
                        parent: None,
                        blocks: vec![b(w * 10_000 + i)],
                    }
                };
                (WorkerId::new(w), i, ev)
            })
        })
        .collect();
    let feeder = {
        let shared = Arc::clone(&shared);
        let events = events.clone();
        std::thread::spawn(move || {
            for (w, id, ev) in events {
                shared.lock().unwrap().apply_event(w, id, &ev).unwrap();
            }
        })
    };
    let routers: Vec<_> = (0..2u64)
        .map(|t| {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || {
                let mut finished = 0;
                for i in 0..2000u64 {
                    let id = t * 1_000_000 + i;
                    let blocks: Vec<BlockHash> = (0..8).map(|k| b(i % 50 * 100 + k)).collect();
                    shared
                        .lock()
                        .unwrap()
                        .route(RequestId::new(id), &blocks, Role::Unified)
                        .unwrap();
                    shared.lock().unwrap().finish(RequestId::new(id)).unwrap();
                    finished += 1;
                }
                finished
            })
        })
        .collect();
    feeder.join().unwrap();
    let finished: u64 = routers.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(finished, 4000);
    let r = shared.lock().unwrap();
    assert_eq!(r.in_flight_total(), 0);
    let mut sequential = CacheIndex::new();
    for (w, id, ev) in &events {
        sequential.apply(*w, *id, ev).unwrap();
    }
    for w in 0..4 {
        let w = WorkerId::new(w);
        assert_eq!(r.cache_view(w), sequential.block_count(w));
        assert_eq!(r.active_blocks(w), 0);
    }
}

proptest! {
    /// The router against the naive model of `kvtest::router`, with the one `Op` that the fuzz
    /// target `router_ops` decodes from bytes too: any policy and settings (invalid ones must be
    /// rejected by `build()`), three workers to start, then routes (by blocks and by tokens, every
    /// role), finishes, worker changes, engine events, `explain`, snapshots and restores. After
    /// every step: each decision's worker, request blocks, cache hits and cost (and the policy's
    /// choice), each error, the load of every worker (active blocks: the distinct blocks of its
    /// unfinished requests; in-flight requests) and the total, the index, `explain`.
    #[test]
    fn router_matches_model(config in router_model::strategy::config(),
                            ops in prop::collection::vec(router_model::strategy::op(), 1..120)) {
        let Some(mut h) = Harness::new(&config) else {
            return Ok(());
        };
        for w in 0..3 {
            h.step(&Op::Add(w));
        }
        for op in &ops {
            h.step(op);
        }
    }
}

#[test]
fn a_restored_router_starts_warm_and_continues_the_event_ids() {
    let mut a = router(Policy::Kv, 1.0, 2);
    a.apply_event(
        W0,
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: chain(1..=8),
        },
    )
    .unwrap();
    a.apply_event(
        W1,
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: chain(20..=23),
        },
    )
    .unwrap();
    a.apply_event(
        W1,
        1,
        &KvEvent::Removed {
            blocks: vec![b(23)],
        },
    )
    .unwrap();
    let snap = a.snapshot_index();

    let mut fresh = router(Policy::Kv, 1.0, 0);
    fresh.add_worker(WorkerId::new(7)); // registered here, absent from the snapshot: kept, empty
    fresh.restore_index(snap).unwrap();
    assert_eq!(fresh.workers(), vec![W0, W1, WorkerId::new(7)]);
    assert_eq!((fresh.cache_view(W0), fresh.cache_view(W1)), (8, 3));
    assert_eq!(
        fresh.explain(&chain(1..=10), Role::Unified),
        a.explain(&chain(1..=10), Role::Unified)[..]
            .iter()
            .copied()
            .chain(
                fresh
                    .explain(&chain(1..=10), Role::Unified)
                    .into_iter()
                    .filter(|c| c.worker == WorkerId::new(7))
            )
            .collect::<Vec<_>>()
    );
    let d = fresh
        .route(RequestId::new(1), &chain(1..=10), Role::Unified)
        .unwrap();
    assert_eq!((d.worker, d.cache_hits), (W0, 8));
    // Event ids continue where the snapshot left them.
    assert!(fresh.apply_event(W1, 1, &KvEvent::Cleared).is_err());
    assert_eq!(
        fresh.apply_event(W1, 2, &KvEvent::Cleared).unwrap().gap,
        None
    );
}
