//! Session affinity: soft keeps a session on its worker until that worker is unroutable or
//! busy, then moves it once; hard never moves it; off ignores sessions; sessions lapse after
//! their TTL on the router's clock and travel to other replicas with the route's delta.

use std::time::Duration;

use kvroute::{
    BlockHash, BusyThreshold, Error, KvEvent, Policy, RequestId, Role, Router, RouterBuilder,
    SessionAffinity, SessionId, WorkerId,
};

const WORKERS: u64 = 4;

fn fleet(b: RouterBuilder) -> Router {
    let mut r = b.build().unwrap();
    for w in 0..WORKERS {
        r.add_worker(WorkerId::new(w));
    }
    r
}

/// Routes `turns` turns of `session` from request id `first`, finishing each, and returns
/// their workers.
fn turns(r: &mut Router, session: SessionId, first: u64, turns: u64) -> Vec<u64> {
    (first..first + turns)
        .map(|i| {
            let d = r
                .route_in_session(session, RequestId::new(i), &[], Role::Unified)
                .unwrap();
            r.finish(RequestId::new(i)).unwrap();
            d.worker.get()
        })
        .collect()
}

#[test]
fn soft_sessions_stay_until_their_worker_drains_then_move_once() {
    let mut r = fleet(Router::builder().policy(Policy::RoundRobin));
    let sessions: Vec<SessionId> = (0..8).map(SessionId::new).collect();
    // First turns spread round robin; every later turn stays.
    let homes: Vec<u64> = sessions
        .iter()
        .enumerate()
        .map(|(k, &s)| turns(&mut r, s, 100 * k as u64, 1)[0])
        .collect();
    assert_eq!(homes, [0, 1, 2, 3, 0, 1, 2, 3]);
    for (k, &s) in sessions.iter().enumerate() {
        assert_eq!(turns(&mut r, s, 100 * k as u64 + 1, 5), vec![homes[k]; 5]);
    }
    // Worker 0 drains: its two sessions move, once each, and stay where they went.
    r.set_routable(WorkerId::new(0), false);
    for (k, &s) in sessions.iter().enumerate() {
        let after = turns(&mut r, s, 100 * k as u64 + 10, 4);
        assert!(after.iter().all(|&w| w == after[0]), "{after:?}");
        if homes[k] == 0 {
            assert_ne!(after[0], 0);
        } else {
            assert_eq!(after[0], homes[k]);
        }
    }
    // Back in routing, worker 0 does not take its old sessions back.
    r.set_routable(WorkerId::new(0), true);
    for (k, &s) in sessions.iter().enumerate() {
        assert_ne!(turns(&mut r, s, 100 * k as u64 + 20, 1)[0], 0);
    }
}

#[test]
fn soft_sessions_leave_a_busy_worker() {
    // More than 2 decode blocks of capacity 4 at fraction 0.5 is busy.
    let mut r = fleet(
        Router::builder()
            .policy(Policy::Kv)
            .busy_threshold(BusyThreshold::new().decode_fraction(0.5, 4)),
    );
    let s = SessionId::from_name("agent");
    let home = turns(&mut r, s, 0, 1)[0];
    // Someone else's long request decodes on the session's worker.
    let blocks: Vec<BlockHash> = (1..=3).map(BlockHash::new).collect();
    r.apply_event(
        WorkerId::new(home),
        0,
        &KvEvent::Stored {
            parent: None,
            blocks: blocks.clone(),
        },
    )
    .unwrap();
    let other = r.route(RequestId::new(99), &blocks, Role::Unified).unwrap();
    assert_eq!(other.worker.get(), home);
    r.prefill_done(RequestId::new(99)).unwrap();
    let moved = turns(&mut r, s, 1, 3);
    assert_ne!(moved[0], home);
    assert!(moved.iter().all(|&w| w == moved[0]));
}

#[test]
fn hard_sessions_never_move() {
    let mut r = fleet(
        Router::builder()
            .policy(Policy::RoundRobin)
            .session_affinity(SessionAffinity::Hard),
    );
    let s = SessionId::new(7);
    let home = turns(&mut r, s, 0, 3);
    assert!(home.iter().all(|&w| w == home[0]));
    r.set_routable(WorkerId::new(home[0]), false);
    let e = r
        .route_in_session(s, RequestId::new(10), &[], Role::Unified)
        .unwrap_err();
    assert_eq!(
        e,
        Error::SessionUnavailable {
            session: s,
            worker: WorkerId::new(home[0])
        }
    );
    assert!(e.to_string().contains("not routable"), "{e}");
    // Nothing was recorded for the failed turn: the id is free.
    assert_eq!(r.in_flight_total(), 0);
    r.set_routable(WorkerId::new(home[0]), true);
    assert_eq!(turns(&mut r, s, 10, 2), vec![home[0]; 2]);
}

#[test]
fn off_ignores_sessions() {
    let mut r = fleet(
        Router::builder()
            .policy(Policy::RoundRobin)
            .session_affinity(SessionAffinity::Off),
    );
    let s = SessionId::new(1);
    assert_eq!(turns(&mut r, s, 0, 4), [0, 1, 2, 3]);
    assert_eq!(r.session_worker(s), None);
}

#[test]
fn sessions_lapse_after_their_ttl() {
    let mut r = fleet(
        Router::builder()
            .policy(Policy::RoundRobin)
            .session_ttl(Duration::from_secs(10)),
    );
    let s = SessionId::new(1);
    r.set_clock(Duration::from_secs(1));
    assert_eq!(turns(&mut r, s, 0, 1), [0]);
    // Each use renews it.
    r.set_clock(Duration::from_secs(10));
    assert_eq!(turns(&mut r, s, 1, 1), [0]);
    r.set_clock(Duration::from_secs(19));
    assert_eq!(r.session_worker(s), Some(WorkerId::new(0)));
    assert_eq!(r.live_sessions(), 1);
    r.set_clock(Duration::from_secs(20));
    assert_eq!(r.session_worker(s), None);
    assert_eq!(r.live_sessions(), 0);
    // Routed afresh (round robin's next).
    assert_eq!(turns(&mut r, s, 2, 1), [1]);
}

#[test]
fn replicas_learn_each_others_sessions() {
    let replica = |id| {
        fleet(
            Router::builder()
                .policy(Policy::RoundRobin)
                .replica(id)
                .seed(id),
        )
    };
    let (mut a, mut b) = (replica(1), replica(2));
    // Move b's round robin on, so that it would not pick a's worker by chance.
    turns(&mut b, SessionId::new(99), 1_000, 1);
    b.drain_load_deltas();
    let s = SessionId::from_name("shared");
    let home = turns(&mut a, s, 0, 1)[0];
    for d in a.drain_load_deltas() {
        b.apply_load_delta(&d, Duration::ZERO);
    }
    assert_eq!(b.session_worker(s), Some(WorkerId::new(home)));
    assert_eq!(turns(&mut b, s, 0, 3), vec![home; 3]);
}

#[cfg(feature = "serde")]
#[test]
fn the_session_travels_in_the_routed_delta() {
    let mut a = fleet(Router::builder().replica(1));
    a.route_in_session(SessionId::new(5), RequestId::new(1), &[], Role::Unified)
        .unwrap();
    a.route(RequestId::new(2), &[], Role::Unified).unwrap();
    let json: Vec<String> = a
        .drain_load_deltas()
        .iter()
        .map(|d| serde_json::to_string(d).unwrap())
        .collect();
    assert!(json[0].contains(r#""session":5"#), "{}", json[0]);
    // No field when there is no session: an earlier replica reads it as before.
    assert!(!json[1].contains("session"), "{}", json[1]);
}
