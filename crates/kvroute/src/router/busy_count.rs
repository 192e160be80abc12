//! The count of busy workers (while it is 0 the scans take every member) and the list of the
//! members not busy (which the scans take otherwise), checked against the workers' loads
//! themselves after every operation that changes a load, a report, the threshold or the
//! workers.

use std::time::Duration;

use kvcache::WorkerId;
use kvtest::chains::path;
use proptest::prelude::*;

use super::Router;
use crate::{BusyThreshold, ReportedLoad, RequestId, Role};

const WORKERS: u64 = 3;

#[derive(Debug, Clone)]
enum Op {
    /// Replica `r` routes the chain of these codes (sequence hashes: lists that start alike
    /// share their leading blocks).
    Route {
        r: usize,
        codes: Vec<u8>,
    },
    Finish {
        r: usize,
        k: usize,
    },
    PrefillDone {
        r: usize,
        k: usize,
    },
    /// Replica `r` applies every delta the other one drained.
    Deliver {
        r: usize,
    },
    Report {
        r: usize,
        w: u64,
        waiting: usize,
        kv: u8,
    },
    Unreport {
        r: usize,
        w: u64,
    },
    /// `None`: no threshold; otherwise decode blocks, prefill tokens and waiting requests.
    Threshold {
        r: usize,
        limits: Option<(usize, usize, usize)>,
    },
    Remove {
        r: usize,
        w: u64,
    },
    Add {
        r: usize,
        w: u64,
    },
    Routable {
        r: usize,
        w: u64,
        on: bool,
    },
    Restore {
        r: usize,
    },
    Expire {
        r: usize,
        secs: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let r = 0..2usize;
    let w = 0..WORKERS;
    prop_oneof![
        6 => (r.clone(), proptest::collection::vec(0..4u8, 0..6))
            .prop_map(|(r, codes)| Op::Route { r, codes }),
        3 => (r.clone(), any::<usize>()).prop_map(|(r, k)| Op::Finish { r, k }),
        3 => (r.clone(), any::<usize>()).prop_map(|(r, k)| Op::PrefillDone { r, k }),
        2 => r.clone().prop_map(|r| Op::Deliver { r }),
        2 => (r.clone(), w.clone(), 0..4usize, 0..=10u8)
            .prop_map(|(r, w, waiting, kv)| Op::Report { r, w, waiting, kv }),
        1 => (r.clone(), w.clone()).prop_map(|(r, w)| Op::Unreport { r, w }),
        1 => (r.clone(), proptest::option::of((0..6usize, 0..96usize, 1..4usize)))
            .prop_map(|(r, limits)| Op::Threshold { r, limits }),
        1 => (r.clone(), w.clone()).prop_map(|(r, w)| Op::Remove { r, w }),
        1 => (r.clone(), w.clone()).prop_map(|(r, w)| Op::Add { r, w }),
        1 => (r.clone(), w, any::<bool>()).prop_map(|(r, w, on)| Op::Routable { r, w, on }),
        1 => r.clone().prop_map(|r| Op::Restore { r }),
        1 => (r, 0..4u64).prop_map(|(r, secs)| Op::Expire { r, secs }),
    ]
}

/// Whether a worker with this load is busy, by the threshold's own test.
fn busy(router: &Router, load: &super::Load) -> bool {
    let block = router.config.block_size.get();
    let (kv, waiting) = load.reported.map_or((0.0, 0), |r| (r.kv_usage, r.waiting));
    router
        .config
        .busy
        .is_some_and(|b| b.is_busy(load.decode.len(), load.pending * block, kv, waiting))
}

/// Busy slots counted from the loads themselves.
fn naive(router: &Router) -> usize {
    router
        .slots
        .iter()
        .flatten()
        .filter(|l| busy(router, l))
        .count()
}

/// The members not busy, in member order, from the loads themselves.
fn naive_free(router: &Router) -> Vec<usize> {
    let load = |i: usize| router.slots[i].as_ref().expect("a member has a load");
    router
        .members
        .iter()
        .copied()
        .filter(|&i| !busy(router, load(i)))
        .collect()
}

fn threshold((decode, tokens, waiting): (usize, usize, usize)) -> BusyThreshold {
    // The decode limit is half of `2 × decode` blocks; half the KV cache reported in use is busy.
    BusyThreshold::new()
        .decode_fraction(0.5, 2 * decode.max(1))
        .prefill_tokens(tokens)
        .waiting_requests(waiting)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn busy_slots_follow_every_change(ops in proptest::collection::vec(op(), 1..80)) {
        let mut routers: Vec<Router> = (0..2u64)
            .map(|id| {
                let mut r = Router::builder()
                    .replica(id)
                    .seed(id)
                    .block_size(kvblock::BlockSize::new(16).unwrap())
                    .busy_threshold(threshold((2, 32, 2)))
                    .build()
                    .unwrap();
                for w in 0..WORKERS {
                    r.add_worker(WorkerId::new(w));
                }
                r
            })
            .collect();
        let mut flights: [Vec<RequestId>; 2] = [Vec::new(), Vec::new()];
        let mut next = 0u64;
        for op in ops {
            match op {
                Op::Route { r, codes } => {
                    let blocks = path(&codes, 4);
                    next += 1;
                    let id = RequestId::new(next);
                    if routers[r].route(id, &blocks, Role::Unified).is_ok() {
                        flights[r].push(id);
                    }
                }
                Op::Finish { r, k } if !flights[r].is_empty() => {
                    let id = flights[r].swap_remove(k % flights[r].len());
                    routers[r].finish(id).unwrap();
                }
                Op::PrefillDone { r, k } if !flights[r].is_empty() => {
                    let id = flights[r][k % flights[r].len()];
                    routers[r].prefill_done(id).unwrap();
                }
                Op::Finish { .. } | Op::PrefillDone { .. } => {}
                Op::Deliver { r } => {
                    for d in routers[1 - r].drain_load_deltas() {
                        routers[r].apply_load_delta(&d, Duration::ZERO);
                    }
                }
                Op::Report { r, w, waiting, kv } => {
                    let load = ReportedLoad::new(1, waiting, f64::from(kv) / 10.0);
                    routers[r].set_reported_load(WorkerId::new(w), Some(load)).unwrap();
                }
                Op::Unreport { r, w } => {
                    routers[r].set_reported_load(WorkerId::new(w), None).unwrap();
                }
                Op::Threshold { r, limits } => {
                    routers[r].set_busy_threshold(limits.map(threshold)).unwrap();
                }
                Op::Remove { r, w } => {
                    routers[r].remove_worker(WorkerId::new(w));
                }
                Op::Add { r, w } => {
                    routers[r].add_worker(WorkerId::new(w));
                }
                Op::Routable { r, w, on } => {
                    routers[r].set_routable(WorkerId::new(w), on);
                }
                Op::Restore { r } => {
                    let snapshot = routers[r].snapshot_index();
                    routers[r].restore_index(snapshot).unwrap();
                }
                Op::Expire { r, secs } => {
                    routers[r].expire_remote_load(Duration::from_secs(secs * 40));
                }
            }
            for router in &mut routers {
                prop_assert_eq!(router.busy_slots, naive(router));
                prop_assert_eq!(router.busy_limits, super::busy_limits(&router.config));
                router.refresh_free();
                if router.busy_slots > 0 {
                    prop_assert_eq!(&router.free_members, &naive_free(router));
                }
            }
        }
    }
}
