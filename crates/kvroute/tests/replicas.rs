//! Replicas sharing in-flight load: random routes, first tokens and finishes on two replicas,
//! their deltas delivered late, out of order and twice; once everything is delivered, both
//! replicas' load views (active, pending prefill and decode blocks) equal the naive count over
//! every in-flight request. And remote load expires.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kvblock::BlockHash;
use kvroute::{LoadDelta, RequestId, Role, Router, WorkerId};
use kvtest::chains::path;
use proptest::prelude::*;

const WORKERS: u64 = 3;

/// A request in flight: its worker, its blocks, and its blocks to prefill until its first token.
type InFlight = (WorkerId, Vec<BlockHash>, Option<usize>);

fn replica(id: u64) -> Router {
    let mut r = Router::builder().replica(id).seed(id).build().unwrap();
    for w in 0..WORKERS {
        r.add_worker(WorkerId::new(w));
    }
    r
}

#[derive(Debug, Clone)]
enum Op {
    /// A route of the chain of these codes (sequence hashes: lists that start alike share
    /// their leading blocks).
    Route {
        r: usize,
        blocks: Vec<u8>,
    },
    Finish {
        r: usize,
        k: usize,
    },
    /// The first token of one of replica r's requests.
    PrefillDone {
        r: usize,
        k: usize,
    },
    /// Deliver every pending delta to replica `r`, permuted by `perm`, each twice if `dup`.
    Deliver {
        r: usize,
        perm: u64,
        dup: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2usize, proptest::collection::vec(0..3u8, 0..5)).prop_map(|(r, blocks)| Op::Route { r, blocks }),
        3 => (0..2usize, any::<usize>()).prop_map(|(r, k)| Op::Finish { r, k }),
        2 => (0..2usize, any::<usize>()).prop_map(|(r, k)| Op::PrefillDone { r, k }),
        2 => (0..2usize, any::<u64>(), any::<bool>()).prop_map(|(r, perm, dup)| Op::Deliver { r, perm, dup }),
    ]
}

fn deliver(to: &mut Router, pending: &mut Vec<LoadDelta>, perm: u64, dup: bool) {
    let mut batch = std::mem::take(pending);
    if dup {
        batch.extend(batch.clone());
    }
    // A deterministic shuffle from `perm`.
    let mut x = perm | 1;
    for i in (1..batch.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        batch.swap(i, (x % (i as u64 + 1)) as usize);
    }
    for d in &batch {
        to.apply_load_delta(d, Duration::ZERO);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn shared_load_converges_to_the_union(ops in proptest::collection::vec(op(), 1..60), last in any::<u64>()) {
        let mut routers = [replica(1), replica(2)];
        // pending[r]: deltas on their way to replica r.
        let mut pending: [Vec<LoadDelta>; 2] = [Vec::new(), Vec::new()];
        // In flight: (replica, request) -> (worker, blocks, blocks to prefill until its first
        // token).
        let mut flight: BTreeMap<(usize, u64), InFlight> = BTreeMap::new();
        let mut next = 0u64;
        for op in ops {
            match op {
                Op::Route { r, blocks } => {
                    let blocks = path(&blocks, 3);
                    next += 1;
                    let d = routers[r].route(RequestId::new(next), &blocks, Role::Unified).unwrap();
                    let uncached = d.request_blocks - d.cache_hits;
                    flight.insert((r, next), (d.worker, blocks, Some(uncached)));
                }
                Op::Finish { r, k } => {
                    let mine: Vec<u64> = flight.keys().filter(|(x, _)| *x == r).map(|&(_, id)| id).collect();
                    if !mine.is_empty() {
                        let id = mine[k % mine.len()];
                        routers[r].finish(RequestId::new(id)).unwrap();
                        flight.remove(&(r, id));
                    }
                }
                Op::PrefillDone { r, k } => {
                    let mine: Vec<u64> = flight.keys().filter(|(x, _)| *x == r).map(|&(_, id)| id).collect();
                    if !mine.is_empty() {
                        let id = mine[k % mine.len()];
                        routers[r].prefill_done(RequestId::new(id)).unwrap();
                        flight.get_mut(&(r, id)).unwrap().2 = None;
                    }
                }
                Op::Deliver { r, perm, dup } => {
                    let [a, b] = &mut routers;
                    let to = if r == 0 { a } else { b };
                    deliver(to, &mut pending[r], perm, dup);
                }
            }
            for r in 0..2 {
                let out = routers[r].drain_load_deltas();
                pending[1 - r].extend(out);
            }
            // Never more remote requests than the other replica ever routed and did not finish
            // in the deltas delivered so far: at most its in-flight count plus undelivered ones.
            for r in 0..2 {
                let theirs = flight.keys().filter(|(x, _)| *x != r).count();
                prop_assert!(routers[r].remote_in_flight() <= theirs + pending[r].len());
            }
        }
        for (to, p) in routers.iter_mut().zip(pending.iter_mut()) {
            deliver(to, p, last, true);
        }
        for w in 0..WORKERS {
            let w = WorkerId::new(w);
            let on_w = || flight.values().filter(|(x, _, _)| *x == w);
            let union: BTreeSet<BlockHash> = on_w().flat_map(|(_, b, _)| b.iter().copied()).collect();
            let pending: usize = on_w().filter_map(|(_, _, p)| *p).sum();
            let decode: BTreeSet<BlockHash> = on_w()
                .filter(|(_, _, p)| p.is_none())
                .flat_map(|(_, b, _)| b.iter().copied())
                .collect();
            for r in &routers {
                prop_assert_eq!(r.active_blocks(w), union.len(), "worker {:?}", w);
                prop_assert_eq!(r.pending_prefill_blocks(w), pending, "worker {:?}", w);
                prop_assert_eq!(r.decode_blocks(w), decode.len(), "worker {:?}", w);
            }
        }
    }
}

#[test]
fn a_lost_finish_expires_and_an_early_finish_cancels_its_route() {
    let w = WorkerId::new(0);
    let ttl = Duration::from_secs(30);
    let mut a = Router::builder().replica(1).build().unwrap();
    let mut b = Router::builder()
        .replica(2)
        .remote_load_ttl(ttl)
        .build()
        .unwrap();
    a.add_worker(w);
    b.add_worker(w);
    a.route(RequestId::new(1), &[BlockHash::new(9)], Role::Unified)
        .unwrap();
    let routed = a.drain_load_deltas();
    let t0 = Duration::from_secs(100);
    b.apply_load_delta(&routed[0], t0);
    assert_eq!((b.active_blocks(w), b.remote_in_flight()), (1, 1));
    assert_eq!(b.expire_remote_load(t0 + ttl - Duration::from_millis(1)), 0);
    assert_eq!(b.expire_remote_load(t0 + ttl), 1);
    assert_eq!((b.active_blocks(w), b.remote_in_flight()), (0, 0));

    // Finished first, then its Routed: nothing is counted.
    a.route(RequestId::new(2), &[BlockHash::new(5)], Role::Unified)
        .unwrap();
    a.finish(RequestId::new(2)).unwrap();
    let mut d = a.drain_load_deltas();
    d.reverse();
    for x in &d {
        b.apply_load_delta(x, t0);
    }
    assert_eq!(b.active_blocks(w), 0);
    // A replica ignores its own deltas.
    a.route(RequestId::new(3), &[BlockHash::new(4)], Role::Unified)
        .unwrap();
    let own = a.drain_load_deltas();
    assert!(!a.apply_load_delta(&own[0], t0));
    assert_eq!(a.active_blocks(w), 2); // requests 1 and 3, once each
}

#[cfg(feature = "serde")]
#[test]
fn deltas_round_trip_through_json() {
    let mut a = Router::builder().replica(1).build().unwrap();
    a.add_worker(WorkerId::new(4));
    a.route(RequestId::new(1), &[BlockHash::new(3)], Role::Unified)
        .unwrap();
    a.finish(RequestId::new(1)).unwrap();
    for d in a.drain_load_deltas() {
        let text = serde_json::to_string(&d).unwrap();
        assert_eq!(
            serde_json::from_str::<LoadDelta>(&text).unwrap(),
            d,
            "{text}"
        );
    }
}
