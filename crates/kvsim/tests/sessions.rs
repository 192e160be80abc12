//! Multi-turn sessions and closed loops: trace fields, per-turn hit rates, concurrency.

use std::collections::{BTreeMap, BTreeSet};

use kvblock::BlockSize;
use kvsim::{Policy, SessionAffinity, SimConfig, Simulation, Trace};
use xxhash_rust::xxh3::xxh3_64;

fn bs() -> BlockSize {
    BlockSize::new(64).unwrap()
}

/// Two conversations of three turns (each turn's ids extend the previous turn's), all
/// stamped 0, with think times; and a one-off line without a session.
const CHAT: &str = r#"{"timestamp": 0, "input_length": 130, "output_length": 5, "hash_ids": [1, 2], "session_id": "a"}
{"timestamp": 0, "input_length": 140, "output_length": 5, "hash_ids": [1, 9], "session_id": 7}
{"timestamp": 0, "input_length": 260, "output_length": 5, "hash_ids": [1, 2, 3, 4], "session_id": "a", "think_time_ms": 1000}
{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [50]}
{"timestamp": 0, "input_length": 270, "output_length": 5, "hash_ids": [1, 9, 10, 11], "session_id": 7, "think_time_ms": 500.5}
{"timestamp": 0, "input_length": 400, "output_length": 5, "hash_ids": [1, 2, 3, 4, 5, 6], "session_id": "a", "think_time_ms": 1000}
{"timestamp": 0, "input_length": 400, "output_length": 5, "hash_ids": [1, 9, 10, 11, 12, 13], "session_id": "7", "think_time_ms": 0}"#;

#[test]
fn trace_sessions_are_parsed_by_name_and_order() {
    let t = Trace::parse("chat.jsonl", CHAT, bs()).unwrap();
    let s: Vec<(Option<usize>, u64)> = t
        .requests()
        .iter()
        .map(|r| (r.session, r.think_us))
        .collect();
    // 7 and "7" are the same session: ids are compared as text.
    assert_eq!(
        s,
        [
            (Some(0), 0),
            (Some(1), 0),
            (Some(0), 1_000_000),
            (None, 0),
            (Some(1), 500_500),
            (Some(0), 1_000_000),
            (Some(1), 0)
        ]
    );
    assert!(t.has_sessions());
    let plain = r#"{"timestamp": 0, "input_length": 130, "output_length": 5, "hash_ids": [1, 2]}"#;
    assert!(!Trace::parse("p.jsonl", plain, bs()).unwrap().has_sessions());
    for (line, want) in [
        (
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [], "session_id": [1]}"#,
            "b.jsonl:1: session_id: expected a string or a whole number, got [1]",
        ),
        (
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [], "think_time_ms": -1}"#,
            "b.jsonl:1: think_time_ms: expected a number of milliseconds >= 0, got -1",
        ),
        (
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [], "think_time_ms": "x"}"#,
            "b.jsonl:1: think_time_ms: expected a number of milliseconds >= 0, got \"x\"",
        ),
    ] {
        assert_eq!(
            Trace::parse("b.jsonl", line, bs()).unwrap_err().to_string(),
            want
        );
    }
}

#[test]
fn a_session_trace_replays_turn_after_turn_and_reports_per_turn_hits() {
    let t = Trace::parse("chat.jsonl", CHAT, bs()).unwrap();
    let mut cfg = SimConfig::default().with_trace(t);
    cfg.instances = 2;
    let r = Simulation::new(cfg).unwrap().run().unwrap();
    assert_eq!(r.completed, 7);
    assert_eq!(r.content, "trace: chat.jsonl (7 requests) in sessions");
    // Session "a" waits 1 s twice: the run takes more than 2 s though every timestamp is 0.
    assert!(r.makespan_s > 2.0, "{}", r.makespan_s);
    let turns = r.turns.as_ref().unwrap();
    assert_eq!((turns.first.requests, turns.later.requests), (3, 4));
    assert_eq!(
        turns.by_turn.iter().map(|t| t.requests).collect::<Vec<_>>(),
        [3, 2, 2]
    );
    // Every later turn finds its previous prompt cached where it went (kv routing follows it):
    // turn 2 has 2 of its 4 blocks, turn 3 4 of its 6.
    assert_eq!(turns.later.request_hit_rate, 1.0);
    assert_eq!(
        turns.later.block_reuse,
        (2.0 * 2.0 + 2.0 * 4.0) / (2.0 * 4.0 + 2.0 * 6.0)
    );
    let text = r.to_text(false);
    assert!(text.contains("  Per turn: turn 1 hit rate "), "{text}");
    assert!(r.to_json().contains("\"by_turn\""));
}

#[test]
fn open_loop_reports_have_no_turns() {
    let mut cfg = SimConfig::default();
    cfg.num_requests = 30;
    let r = Simulation::new(cfg).unwrap().run().unwrap();
    assert!(r.turns.is_none() && !r.to_json().contains("\"turns\""));
}

#[test]
fn session_settings_are_checked() {
    let mut cfg = SimConfig::default();
    cfg.turns = 3;
    assert_eq!(
        Simulation::new(cfg).unwrap_err().to_string(),
        "invalid turns 3: expected sessions set (they describe synthetic sessions)"
    );
    let mut cfg = SimConfig::default();
    cfg.sessions = Some(2);
    cfg.turns = 5000;
    assert!(Simulation::new(cfg).is_err());
    let mut cfg = SimConfig::default();
    cfg.concurrency = Some(0);
    assert_eq!(
        Simulation::new(cfg).unwrap_err().to_string(),
        "invalid concurrency 0: expected a whole number >= 1"
    );
    let t = Trace::parse("chat.jsonl", CHAT, bs()).unwrap();
    let mut cfg = SimConfig::default().with_trace(t);
    cfg.sessions = Some(2);
    assert!(Simulation::new(cfg)
        .unwrap_err()
        .to_string()
        .contains("a trace brings its own sessions"));
}

/// `sessions` chats of `turns` turns on 4 instances with room for a few chats' history each.
fn chats(sessions: usize, turns: usize) -> SimConfig {
    let mut cfg = SimConfig::default();
    cfg.sessions = Some(sessions);
    cfg.turns = turns;
    cfg.think_us = 2_000_000;
    cfg.request_rate = 4.0;
    cfg.input_len = 1024;
    cfg.prefix_len = 512;
    cfg.output_len = 128;
    cfg.kv_blocks = Some(3000);
    cfg
}

/// A trace of `n` (< 64) conversations of `turns` turns, and what tells a request's session
/// and turn (from 0) by its prompt length, which is every line's own.
fn conversations(n: u64, turns: u64) -> (Trace, impl Fn(usize) -> (u64, u64)) {
    let len = move |s: u64, t: u64| 64 * (1 + 2 * t) + 1 + s;
    let mut lines = Vec::new();
    for t in 0..turns {
        for s in 0..n {
            let ids: Vec<String> = (0..2 + 2 * t)
                .map(|b| (if b < 2 { b } else { 1000 * (s + 1) + b }).to_string())
                .collect();
            lines.push(format!(
                r#"{{"timestamp": {}, "input_length": {}, "output_length": 8, "hash_ids": [{}], "session_id": {s}, "think_time_ms": 100}}"#,
                (t * n + s) * 50,
                len(s, t),
                ids.join(", ")
            ));
        }
    }
    let trace = Trace::parse("conv.jsonl", &lines.join("\n"), bs()).unwrap();
    let which = move |input: usize| {
        let k = input as u64 - 1;
        (k % 64, (k / 64 - 1) / 2)
    };
    (trace, which)
}

#[test]
fn with_affinity_every_turn_of_a_session_lands_on_one_instance() {
    let (trace, which) = conversations(23, 4);
    for affinity in [SessionAffinity::Soft, SessionAffinity::Hard] {
        let mut cfg = SimConfig::default().with_trace(trace.clone());
        // Round robin would spread a session's turns over every instance.
        cfg.routing = Policy::RoundRobin;
        cfg.session_affinity = affinity;
        let (report, reqs) = Simulation::new(cfg).unwrap().run_requests().unwrap();
        let mut home: BTreeMap<u64, usize> = BTreeMap::new();
        for r in &reqs {
            let (session, _) = which(r.input_len);
            let instance = r.instance.unwrap();
            assert_eq!(
                *home.entry(session).or_insert(instance),
                instance,
                "{affinity}: session {session}"
            );
        }
        assert_eq!(home.len(), 23);
        let s = report.sessions.as_ref().unwrap();
        assert_eq!(
            (s.later_turns, s.kept, s.moved, s.new),
            (69, 69, 0, 0),
            "{affinity}"
        );
        assert_eq!(s.affinity, affinity.to_string());
        assert!(report.to_text(false).contains(&format!(
            "  Sessions: {affinity} affinity, TTL 600 s | later turns: 69 kept on their session's instance (100.0%), 0 moved (busy), 0 new"
        )));
        assert!(report.to_json().contains("\"sessions\": {"));
    }
    // Off: round robin moves them.
    let mut cfg = SimConfig::default().with_trace(trace);
    cfg.routing = Policy::RoundRobin;
    let (report, reqs) = Simulation::new(cfg).unwrap().run_requests().unwrap();
    let placed: BTreeSet<(u64, Option<usize>)> = reqs
        .iter()
        .map(|r| (which(r.input_len).0, r.instance))
        .collect();
    assert!(placed.len() > 23 * 2, "{placed:?}");
    assert!(report.sessions.is_none());
}

/// With round robin and unbounded caches, a kept session finds exactly its previous prompt's
/// full blocks cached on every later turn (answers are not cached, so nothing more); routed
/// off, fewer.
#[test]
fn a_kept_session_reuses_its_whole_previous_prompt() {
    let mut cfg = chats(40, 4);
    cfg.kv_blocks = None;
    cfg.routing = Policy::RoundRobin;
    let bs = cfg.block_size.get();
    let grow = cfg.output_len + cfg.input_len - cfg.prefix_len;
    let off = Simulation::new(cfg.clone()).unwrap().run().unwrap();
    cfg.session_affinity = SessionAffinity::Soft;
    let (soft, reqs) = Simulation::new(cfg.clone())
        .unwrap()
        .run_requests()
        .unwrap();
    for r in reqs.iter().filter(|r| r.input_len > cfg.input_len) {
        let previous = r.input_len - grow;
        assert_eq!(r.cached_tokens, previous / bs * bs, "{r:?}");
    }
    let (soft, off) = (soft.turns.unwrap(), off.turns.unwrap());
    assert!(
        soft.later.block_reuse > off.later.block_reuse + 0.2,
        "{soft:?} {off:?}"
    );
}

/// The measured effect on kv routing with bounded caches: keeping sessions on their instance
/// reuses more of their history on later turns than kv routing alone finds.
#[test]
fn soft_affinity_raises_later_turns_reuse_under_kv_routing() {
    let cfg = chats(200, 5);
    let off = Simulation::new(cfg.clone()).unwrap().run().unwrap();
    let mut soft_cfg = cfg.clone();
    soft_cfg.session_affinity = SessionAffinity::Soft;
    let soft = Simulation::new(soft_cfg).unwrap().run().unwrap();
    let (s, o) = (soft.turns.as_ref().unwrap(), off.turns.as_ref().unwrap());
    assert!(
        s.later.block_reuse > o.later.block_reuse + 0.1,
        "soft {} off {}",
        s.later.block_reuse,
        o.later.block_reuse
    );
    assert!(soft.block_reuse > off.block_reuse);
    let sessions = soft.sessions.as_ref().unwrap();
    assert_eq!(sessions.kept, 800);
}

/// Off is the routing of before: the flag's default, and exactly the same bytes as an unset
/// one, for synthetic sessions and a session trace (pinned as the simulator printed them
/// before session affinity existed).
#[test]
fn off_reproduces_the_reports_of_before() {
    assert_eq!(SimConfig::default().session_affinity, SessionAffinity::Off);
    let (trace, _) = conversations(23, 4);
    let mut on_trace = SimConfig::default().with_trace(trace);
    on_trace.kv_blocks = Some(40);
    let mut replicas = chats(100, 4);
    replicas.routers = 3;
    replicas.router_sync = true;
    replicas.sync_delay_us = 5_000;
    // XXH3-64 of to_json() and to_text(true); each equals the report of the same flags of the
    // kvsim command built before session affinity existed.
    let pinned: [(SimConfig, u64, u64); 3] = [
        (chats(200, 5), 0x4caaa60226a1de0a, 0xa2d94b60d07bee4f),
        (on_trace, 0x622b570ec05a000b, 0xdc69cb89ac3b009d),
        (replicas, 0x8051efab39e98fa1, 0xbf1ece6d7c8e7d6b),
    ];
    for (cfg, json, text) in pinned {
        let mut off = cfg.clone();
        off.session_affinity = SessionAffinity::Off;
        off.session_ttl_us = 1;
        let a = Simulation::new(cfg).unwrap().run().unwrap();
        let b = Simulation::new(off).unwrap().run().unwrap();
        assert_eq!(a, b);
        assert!(a.sessions.is_none() && !a.to_json().contains("\"sessions\""));
        assert!(!a.to_text(true).contains("Sessions:"));
        assert_eq!(
            (
                xxh3_64(a.to_json().as_bytes()),
                xxh3_64(a.to_text(true).as_bytes())
            ),
            (json, text)
        );
    }
}

#[test]
fn same_seed_same_report_with_affinity() {
    let mut cfg = chats(100, 4);
    cfg.session_affinity = SessionAffinity::Soft;
    cfg.routers = 2;
    cfg.router_sync = true;
    cfg.sync_delay_us = 3_000;
    cfg.busy_prefill_tokens = Some(1500);
    let a = Simulation::new(cfg.clone()).unwrap().run().unwrap();
    let b = Simulation::new(cfg.clone()).unwrap().run().unwrap();
    assert_eq!(a.to_json(), b.to_json());
    assert_eq!(a.to_text(true), b.to_text(true));
    cfg.seed = 1;
    let c = Simulation::new(cfg).unwrap().run().unwrap();
    assert_ne!(a.to_json(), c.to_json());
}

/// Soft moves a session off a busy instance; hard never does. Without a busy threshold the
/// two route alike (simulated instances never go down).
#[test]
fn soft_moves_off_busy_instances_and_hard_never_does() {
    let mut cfg = chats(200, 5);
    cfg.busy_prefill_tokens = Some(1500);
    let run = |cfg: &SimConfig, affinity| {
        let mut c = cfg.clone();
        c.session_affinity = affinity;
        Simulation::new(c).unwrap().run().unwrap()
    };
    let both = |cfg: &SimConfig| {
        (
            run(cfg, SessionAffinity::Soft),
            run(cfg, SessionAffinity::Hard),
        )
    };
    let (soft, hard) = both(&cfg);
    let (s, h) = (soft.sessions.unwrap(), hard.sessions.unwrap());
    assert!(s.moved > 0, "{s:?}");
    assert_eq!((h.moved, h.new, h.kept), (0, 0, 800), "{h:?}");
    assert_eq!((soft.router_errors, hard.router_errors), (0, 0));
    cfg.busy_prefill_tokens = None;
    let (soft, hard) = both(&cfg);
    assert_eq!(soft.turns, hard.turns);
    assert_eq!(soft.ttft_ms, hard.ttft_ms);
}

/// The TTL runs on simulated time: one shorter than a turn plus its think time forgets every
/// session, and the run routes as with affinity off.
#[test]
fn the_ttl_lapses_in_simulated_time() {
    let mut cfg = chats(100, 3);
    let off = Simulation::new(cfg.clone()).unwrap().run().unwrap();
    cfg.session_affinity = SessionAffinity::Soft;
    cfg.session_ttl_us = 1_000_000;
    let lapsed = Simulation::new(cfg.clone()).unwrap().run().unwrap();
    let s = lapsed.sessions.as_ref().unwrap();
    assert_eq!((s.kept, s.new), (0, 200));
    assert_eq!(lapsed.turns, off.turns);
    assert_eq!(lapsed.ttft_ms, off.ttft_ms);
    cfg.session_ttl_us = 30_000_000;
    let kept = Simulation::new(cfg).unwrap().run().unwrap();
    assert_eq!(kept.sessions.unwrap().kept, 200);
}

/// Router replicas know a session only from the turns they routed, or, with replica sync, from
/// the others' Routed deltas, which carry the session.
#[test]
fn replicas_share_sessions_only_when_synced() {
    let mut cfg = chats(100, 4);
    cfg.session_affinity = SessionAffinity::Soft;
    cfg.routers = 3;
    let alone = Simulation::new(cfg.clone()).unwrap().run().unwrap();
    let s = alone.sessions.unwrap();
    assert!(s.new > 100 && s.kept > 0, "{s:?}");
    cfg.router_sync = true;
    cfg.sync_delay_us = 10_000;
    let synced = Simulation::new(cfg).unwrap().run().unwrap();
    let s = synced.sessions.unwrap();
    assert_eq!((s.kept, s.new), (300, 0), "{s:?}");
}

#[test]
fn affinity_needs_sessions() {
    let mut cfg = SimConfig::default();
    cfg.session_affinity = SessionAffinity::Hard;
    assert_eq!(
        Simulation::new(cfg).unwrap_err().to_string(),
        "invalid session_affinity hard: expected off without sessions (sessions set, or a trace with session_id): no request has a session to keep"
    );
    let mut cfg = chats(3, 2);
    cfg.session_affinity = SessionAffinity::Hard;
    cfg.prefill_instances = Some(1);
    cfg.decode_instances = Some(1);
    let r = Simulation::new(cfg).unwrap().run().unwrap();
    assert_eq!(r.sessions.unwrap().kept, 3);
}
