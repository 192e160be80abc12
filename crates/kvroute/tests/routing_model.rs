//! The routing model beyond the source document, each formula pinned by a hand-worked example:
//! the prefill-aware cost, temperature sampling, busy thresholds (with engines' reported load)
//! and predicted blocks.

use std::time::Duration;

use kvroute::{
    BlockHash, BusyThreshold, CostModel, Error, KvEvent, Policy, ReportedLoad, RequestId, Role,
    Router, RouterBuilder, WorkerId,
};
use proptest::prelude::*;

const W0: WorkerId = WorkerId::new(0);
const W1: WorkerId = WorkerId::new(1);

fn chain(from: u64, n: u64) -> Vec<BlockHash> {
    (from..from + n).map(BlockHash::new).collect()
}

/// W0 and W1 behind the router `b` builds, W0 holding `cached`.
fn fleet(b: RouterBuilder, cached: &[BlockHash]) -> Router {
    let mut r = b.build().unwrap();
    r.add_worker(W0);
    r.add_worker(W1);
    if !cached.is_empty() {
        let blocks = cached.to_vec();
        r.apply_event(
            W0,
            0,
            &KvEvent::Stored {
                parent: None,
                blocks,
            },
        )
        .unwrap();
    }
    r
}

/// W0 caches an 8-block prefix P. A = P + 11 new blocks goes to W0 and is still prefilling;
/// B = 4 new blocks goes to W1 and is decoding. C = P + 2 new blocks, overlap weight 2:
///
/// | worker | hits | active | pending prefill | decode | seed cost | prefill-aware cost |
/// |---|---:|---:|---:|---:|---:|---:|
/// | W0 | 8 | 19 | 11 | 0 | 2·2 + 19 = 23 | 2·(11 + 2) + 0 = 26 |
/// | W1 | 0 | 4 | 0 | 4 | 2·10 + 4 = 24 | 2·(0 + 10) + 4 = 24 |
///
/// The seed's cost sends C to W0, behind A's 11 blocks of prefill; the prefill-aware one to W1.
#[test]
fn prefill_aware_cost_weighs_the_prefill_queue() {
    let p = chain(100, 8);
    let a: Vec<BlockHash> = p.iter().copied().chain(chain(200, 11)).collect();
    let b = chain(300, 4);
    let c: Vec<BlockHash> = p.iter().copied().chain(chain(400, 2)).collect();
    for (model, want, cost) in [
        (CostModel::Seed, W0, 23.0),
        (CostModel::PrefillAware, W1, 24.0),
    ] {
        let mut r = fleet(Router::builder().overlap_weight(2.0).cost_model(model), &p);
        let da = r.route(RequestId::new(1), &a, Role::Unified).unwrap();
        assert_eq!((da.worker, da.cache_hits), (W0, 8), "{model}");
        let db = r.route(RequestId::new(2), &b, Role::Unified).unwrap();
        assert_eq!(db.worker, W1, "{model}");
        r.prefill_done(RequestId::new(2)).unwrap();
        r.prefill_done(RequestId::new(2)).unwrap(); // idempotent
        assert_eq!(
            (
                r.active_blocks(W0),
                r.pending_prefill_blocks(W0),
                r.decode_blocks(W0)
            ),
            (19, 11, 0)
        );
        assert_eq!(
            (
                r.active_blocks(W1),
                r.pending_prefill_blocks(W1),
                r.decode_blocks(W1)
            ),
            (4, 0, 4)
        );
        let costs: Vec<f64> = r
            .explain(&c, Role::Unified)
            .iter()
            .map(|x| x.cost)
            .collect();
        match model {
            CostModel::Seed => assert_eq!(costs, [23.0, 24.0]),
            _ => assert_eq!(costs, [26.0, 24.0]),
        }
        let dc = r.route(RequestId::new(3), &c, Role::Unified).unwrap();
        assert_eq!((dc.worker, dc.cost), (want, cost), "{model}");
        // Finishing releases each phase's share.
        for id in 1..=3 {
            r.finish(RequestId::new(id)).unwrap();
        }
        for w in [W0, W1] {
            assert_eq!(
                (
                    r.active_blocks(w),
                    r.pending_prefill_blocks(w),
                    r.decode_blocks(w)
                ),
                (0, 0, 0)
            );
        }
    }
    let mut r = fleet(Router::builder(), &[]);
    assert_eq!(
        r.prefill_done(RequestId::new(9)),
        Err(Error::UnknownRequest {
            request_id: RequestId::new(9)
        })
    );
    assert!("fast".parse::<CostModel>().is_err());
}

/// Costs 0 (W0 holds the whole 10-block request) and 10 (W1 holds nothing): at temperature T
/// the spread is 10, so P(W1) = e^(-1/T) / (1 + e^(-1/T)).
#[test]
fn temperature_samples_by_the_softmax_of_costs() {
    let blocks = chain(1, 10);
    for (t, seed) in [(0.5, 3), (1.0, 4), (4.0, 5)] {
        let mut r = fleet(Router::builder().temperature(t).seed(seed), &blocks);
        let trials = 20_000;
        let mut to_w1 = 0;
        let mut picks = Vec::new();
        for id in 0..trials {
            let d = r.route(RequestId::new(id), &blocks, Role::Unified).unwrap();
            to_w1 += usize::from(d.worker == W1);
            picks.push(d.worker);
            r.finish(RequestId::new(id)).unwrap();
        }
        let q = (-1.0f64 / t).exp();
        let want = q / (1.0 + q);
        let got = to_w1 as f64 / trials as f64;
        // 20,000 draws: the standard error is below 0.0036.
        assert!((got - want).abs() < 0.015, "T={t}: {got} vs {want}");
        // Same seed, same picks.
        let mut again = fleet(Router::builder().temperature(t).seed(seed), &blocks);
        for (id, &w) in picks.iter().enumerate().take(500) {
            let id = RequestId::new(id as u64);
            assert_eq!(again.route(id, &blocks, Role::Unified).unwrap().worker, w);
            again.finish(id).unwrap();
        }
    }
    assert!(matches!(
        Router::builder().temperature(-1.0).build(),
        Err(Error::InvalidWeight {
            name: "temperature",
            ..
        })
    ));
}

/// Capacity 10 blocks at fraction 0.5: more than 5 decode blocks is busy. W0 holds the prefix
/// but decodes 6 blocks, so the request goes to W1 until W1 is busy too; then to the less loaded.
#[test]
fn busy_workers_are_skipped_unless_all_are_busy() {
    let prefix = chain(1, 6);
    let mut r = fleet(
        Router::builder().busy_threshold(BusyThreshold::new().decode_fraction(0.5, 10)),
        &prefix,
    );
    let first = r.route(RequestId::new(1), &prefix, Role::Unified).unwrap();
    assert_eq!(first.worker, W0);
    // Still prefilling: not decode load, so W0 is not busy and takes the next one too.
    assert_eq!(
        r.route(RequestId::new(2), &prefix, Role::Unified)
            .unwrap()
            .worker,
        W0
    );
    r.prefill_done(RequestId::new(1)).unwrap();
    assert_eq!(r.decode_blocks(W0), 6);
    assert!(r.explain(&prefix, Role::Unified)[0].busy);
    let longer: Vec<BlockHash> = prefix.iter().copied().chain(chain(50, 2)).collect();
    let d = r.route(RequestId::new(3), &longer, Role::Unified).unwrap();
    assert_eq!((d.worker, d.cache_hits), (W1, 0));
    r.prefill_done(RequestId::new(3)).unwrap();
    // Both busy (W0: 6 decode blocks, W1: 8): the least loaded by active blocks, W0 (6).
    assert_eq!((r.decode_blocks(W0), r.decode_blocks(W1)), (6, 8));
    let d = r
        .route(RequestId::new(5), &chain(90, 3), Role::Unified)
        .unwrap();
    assert_eq!(d.worker, W0);
    // Changed at run time: a limit of 20 makes nobody busy, and locality wins again.
    r.set_busy_threshold(Some(BusyThreshold::new().decode_fraction(2.0, 10)))
        .unwrap();
    assert!(r.explain(&prefix, Role::Unified).iter().all(|c| !c.busy));
    assert!(r
        .set_busy_threshold(Some(BusyThreshold::new().decode_fraction(0.5, 0)))
        .is_err());
    r.set_busy_threshold(None).unwrap();
    assert_eq!(r.busy_threshold(), None);

    // A prefill budget of 32 tokens at block size 16: more than 2 pending blocks is busy.
    let mut r = fleet(
        Router::builder().busy_threshold(BusyThreshold::new().prefill_tokens(32)),
        &prefix,
    );
    let long: Vec<BlockHash> = prefix.iter().copied().chain(chain(70, 3)).collect();
    assert_eq!(
        r.route(RequestId::new(1), &long, Role::Unified)
            .unwrap()
            .worker,
        W0
    );
    assert_eq!(r.pending_prefill_blocks(W0), 3);
    assert_eq!(
        r.route(RequestId::new(2), &prefix, Role::Unified)
            .unwrap()
            .worker,
        W1
    );
}

/// A burst of 16 requests over a new 8-block prefix, no events yet, overlap weight 2: without
/// predictions they spread over both workers by load (the second sees costs 16 + 8 against
/// 16 + 0); with them, all but the first hit the first one's worker (0 + 8 against 16 + 0).
/// The worker's events confirm the prediction; without events it lapses after its time to
/// live; another replica's routes predict too.
#[test]
fn predicted_blocks_keep_a_burst_together_until_confirmed_or_lapsed() {
    let prefix = chain(1, 8);
    let burst = |ttl: Duration| {
        let mut r = fleet(
            Router::builder().overlap_weight(2.0).predicted_ttl(ttl),
            &[],
        );
        let ds: Vec<_> = (0..16)
            .map(|id| r.route(RequestId::new(id), &prefix, Role::Unified).unwrap())
            .collect();
        (r, ds)
    };
    let (_, cold) = burst(Duration::ZERO);
    assert!(cold.iter().any(|d| d.worker == W0) && cold.iter().any(|d| d.worker == W1));
    assert!(cold.iter().all(|d| d.cache_hits == 0));

    let ttl = Duration::from_millis(50);
    let (mut r, warm) = burst(ttl);
    let home = warm[0].worker;
    assert!(warm.iter().all(|d| d.worker == home));
    assert_eq!(warm.iter().map(|d| d.cache_hits).sum::<usize>(), 15 * 8);
    assert_eq!(r.predicted_blocks(home), 8);
    // The engine reports the first 5: those are confirmed, 3 remain predicted.
    r.apply_event(
        home,
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: prefix[..5].to_vec(),
        },
    )
    .unwrap();
    assert_eq!((r.predicted_blocks(home), r.cache_view(home)), (3, 5));
    r.set_clock(ttl - Duration::from_millis(1));
    assert_eq!(
        r.explain(&prefix, Role::Unified)[home.get() as usize].cache_hits,
        8
    );
    r.set_clock(ttl);
    assert_eq!(r.predicted_blocks(home), 0);
    assert_eq!(
        r.explain(&prefix, Role::Unified)[home.get() as usize].cache_hits,
        5
    );

    // Another replica's route predicts on this one too, and lapses the same way.
    let mut a = fleet(Router::builder().replica(1), &[]);
    let mut b = fleet(Router::builder().replica(2).predicted_ttl(ttl), &[]);
    let d = a.route(RequestId::new(1), &prefix, Role::Unified).unwrap();
    let t0 = Duration::from_secs(1);
    for delta in a.drain_load_deltas() {
        b.apply_load_delta(&delta, t0);
    }
    assert_eq!(b.predicted_blocks(d.worker), 8);
    b.set_clock(ttl);
    assert_eq!(b.predicted_blocks(d.worker), 0);
    // Stamped on this router's clock, whatever clock the delta came with.
    b.set_clock(Duration::from_secs(10));
    let d = a
        .route(RequestId::new(2), &chain(100, 8), Role::Unified)
        .unwrap();
    for delta in a.drain_load_deltas() {
        b.apply_load_delta(&delta, Duration::ZERO);
    }
    b.set_clock(Duration::from_secs(10) + ttl - Duration::from_millis(1));
    assert_eq!(b.predicted_blocks(d.worker), 8);
    b.set_clock(Duration::from_secs(10) + ttl);
    assert_eq!(b.predicted_blocks(d.worker), 0);
    // A removed worker's predictions go with it.
    let (mut r, warm) = burst(ttl);
    r.remove_worker(warm[0].worker);
    r.add_worker(warm[0].worker);
    assert_eq!(r.predicted_blocks(warm[0].worker), 0);
}

// Engines' reported load (`Router::set_reported_load`) in the busy thresholds: a reported KV
// usage above the decode fraction, or more waiting requests than allowed, counts a worker busy;
// without reports, routing is unchanged.

fn route(r: &mut Router, id: u64, blocks: &[BlockHash]) -> WorkerId {
    r.route(RequestId::new(id), blocks, Role::Unified)
        .unwrap()
        .worker
}

#[test]
fn a_reported_kv_usage_above_the_decode_fraction_is_busy() {
    let prefix = chain(1, 6);
    let t = BusyThreshold::new().decode_fraction(0.8, 1_000);
    let mut r = fleet(Router::builder().busy_threshold(t), &prefix);
    // W0 holds the prefix: it wins while its engine reports nothing, or a usage at the limit.
    assert_eq!(route(&mut r, 1, &prefix), W0);
    assert!(r
        .set_reported_load(W0, Some(ReportedLoad::new(4, 0, 0.8)))
        .unwrap());
    assert_eq!(route(&mut r, 2, &prefix), W0);
    // Above it: busy, though the router's own counts are far below.
    r.set_reported_load(W0, Some(ReportedLoad::new(4, 0, 0.81)))
        .unwrap();
    assert!(r.explain(&prefix, Role::Unified)[0].busy);
    assert_eq!(route(&mut r, 3, &prefix), W1);
    // Both busy: the least loaded by the router's counts (W1 has one request, W0 two).
    r.set_reported_load(W1, Some(ReportedLoad::new(1, 0, 0.99)))
        .unwrap();
    assert_eq!((r.active_blocks(W0), r.active_blocks(W1)), (6, 6));
    for id in [1, 2] {
        r.finish(RequestId::new(id)).unwrap();
    }
    assert_eq!(route(&mut r, 4, &prefix), W0);
    // Forgotten: locality wins again.
    r.set_reported_load(W1, None).unwrap();
    r.set_reported_load(W0, None).unwrap();
    assert_eq!(r.reported_load(W0), None);
    assert!(r.explain(&prefix, Role::Unified).iter().all(|c| !c.busy));
}

#[test]
fn more_waiting_requests_than_allowed_is_busy() {
    let prefix = chain(1, 6);
    let t = BusyThreshold::new().waiting_requests(2);
    let mut r = fleet(Router::builder().busy_threshold(t), &prefix);
    r.set_reported_load(W0, Some(ReportedLoad::new(30, 2, 0.99)))
        .unwrap();
    // Two waiting is the limit, and a KV usage alone counts only with a decode fraction.
    assert_eq!(route(&mut r, 1, &prefix), W0);
    r.set_reported_load(W0, Some(ReportedLoad::new(30, 3, 0.1)))
        .unwrap();
    assert_eq!(route(&mut r, 2, &prefix), W1);
    assert_eq!(r.reported_load(W0), Some(ReportedLoad::new(30, 3, 0.1)));
}

#[test]
fn reports_follow_the_worker_and_bad_values_are_refused() {
    let mut r = fleet(Router::builder(), &[]);
    let l = ReportedLoad::new(1, 2, 0.5);
    // Out of routing, it keeps its report.
    r.set_routable(W0, false);
    assert!(r.set_reported_load(W0, Some(l)).unwrap());
    r.set_routable(W0, true);
    assert_eq!(r.reported_load(W0), Some(l));
    // Removed and added again: nothing reported.
    r.remove_worker(W0);
    assert!(!r.set_reported_load(W0, Some(l)).unwrap());
    assert!(!r.set_reported_load(WorkerId::new(9), Some(l)).unwrap());
    r.add_worker(W0);
    assert_eq!(r.reported_load(W0), None);
    for bad in [f64::NAN, -0.1, f64::INFINITY] {
        assert!(matches!(
            r.set_reported_load(W0, Some(ReportedLoad::new(0, 0, bad))),
            Err(Error::InvalidWeight { .. })
        ));
    }
}

#[derive(Debug, Clone)]
enum ReportOp {
    Route(u64, u64),
    Finish(u64),
    Report(bool, usize, u8),
}

fn report_op() -> impl Strategy<Value = ReportOp> {
    prop_oneof![
        (0u64..40, 1u64..6).prop_map(|(from, n)| ReportOp::Route(from, n)),
        (0u64..20).prop_map(ReportOp::Finish),
        (any::<bool>(), 0usize..4, 0u8..=50)
            .prop_map(|(w, wait, kv)| ReportOp::Report(w, wait, kv)),
    ]
}

proptest! {
    /// Reports that never pass the limits (KV usage up to 0.5 under a decode fraction of 0.5
    /// with a capacity nobody reaches, up to 3 waiting under a limit of 3) decide nothing: the
    /// router routes exactly as one without thresholds or reports, tie-breaks included.
    #[test]
    fn reports_within_the_limits_change_no_decision(ops in prop::collection::vec(report_op(), 1..80)) {
        let plain = Router::builder().policy(Policy::Kv).seed(3);
        let limited = plain
            .clone()
            .busy_threshold(BusyThreshold::new().decode_fraction(0.5, 1 << 30).waiting_requests(3));
        let (mut a, mut b) = (fleet(plain, &chain(0, 4)), fleet(limited, &chain(0, 4)));
        let mut next = 0u64;
        for op in ops {
            match op {
                ReportOp::Route(from, n) => {
                    let blocks = chain(from, n);
                    let id = RequestId::new(next);
                    next += 1;
                    let (da, db) = (
                        a.route(id, &blocks, Role::Unified).unwrap(),
                        b.route(id, &blocks, Role::Unified).unwrap(),
                    );
                    prop_assert_eq!(da, db);
                }
                ReportOp::Finish(id) => {
                    let id = RequestId::new(id);
                    prop_assert_eq!(a.finish(id).is_ok(), b.finish(id).is_ok());
                }
                ReportOp::Report(w0, waiting, kv) => {
                    let w = if w0 { W0 } else { W1 };
                    let load = ReportedLoad::new(0, waiting, f64::from(kv) / 100.0);
                    prop_assert!(b.set_reported_load(w, Some(load)).unwrap());
                }
            }
        }
    }
}

/// Reported load counts in every way the Kv choice scans the workers: at temperature 0 and
/// sampled, by exact weighing (up to 16 candidates) and by rejection (more), and when every
/// worker is busy by its own counts or by its report.
#[test]
fn reported_busy_workers_are_skipped_on_every_path() {
    for (workers, t) in [(8u64, 0.0), (8, 0.5), (40, 0.0), (40, 0.5), (40, 2.0)] {
        let mut r = Router::builder()
            .temperature(t)
            .busy_threshold(BusyThreshold::new().waiting_requests(0))
            .build()
            .unwrap();
        for w in 0..workers {
            r.add_worker(WorkerId::new(w));
        }
        let free = WorkerId::new(workers / 2);
        for w in (0..workers).map(WorkerId::new).filter(|&w| w != free) {
            r.set_reported_load(w, Some(ReportedLoad::new(1, 1, 0.1)))
                .unwrap();
        }
        for id in 0..50 {
            let d = r
                .route(RequestId::new(id), &chain(7, 4), Role::Unified)
                .unwrap();
            assert_eq!(d.worker, free, "{workers} workers at temperature {t}");
        }
        // The threshold replaced by one without a waiting limit: nobody is busy any more.
        r.set_busy_threshold(Some(BusyThreshold::new().prefill_tokens(1 << 30)))
            .unwrap();
        let spread: std::collections::BTreeSet<WorkerId> = (100..300)
            .map(|id| {
                let d = r
                    .route(RequestId::new(id), &chain(7, 4), Role::Unified)
                    .unwrap();
                r.finish(RequestId::new(id)).unwrap();
                d.worker
            })
            .collect();
        assert!(
            spread.len() > 1,
            "{workers} workers at temperature {t}: {spread:?}"
        );
    }
}
