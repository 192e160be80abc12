//! Multi-turn sessions and closed loops: trace fields, per-turn hit rates, concurrency.

use kvblock::BlockSize;
use kvsim::{SimConfig, Simulation, Trace};

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
