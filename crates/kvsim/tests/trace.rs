//! Trace replay: validation with FILE:LINE errors, replay equal to the ideal hit rate, and the
//! real Mooncake traces when the shared data is present.

use std::path::{Path, PathBuf};

use kvblock::BlockSize;
use kvsim::{ArrivalModel, Policy, SimConfig, Simulation, Trace, TraceTiming};

fn bs(n: usize) -> BlockSize {
    BlockSize::new(n).unwrap()
}

/// A small prefix-chained trace: conversations that grow turn by turn, sharing a system prompt.
fn generated_trace(convs: u64, turns: u64) -> String {
    let mut lines = Vec::new();
    let mut next_id = 1u64;
    let mut histories: Vec<Vec<u64>> = (0..convs).map(|_| vec![0]).collect();
    for turn in 0..turns {
        for (c, h) in histories.iter_mut().enumerate() {
            for _ in 0..(1 + (c as u64 + turn) % 3) {
                h.push(next_id);
                next_id += 1;
            }
            let input = h.len() * 16 - (c % 2) * 5; // odd conversations end in a partial block
            lines.push(format!(
                r#"{{"timestamp": {}, "input_length": {input}, "output_length": {}, "hash_ids": {:?}, "note": "x"}}"#,
                turn * 1000 + c as u64 * 10,
                3 + c % 4,
                h
            ));
        }
    }
    lines.join("\n")
}

/// One unbounded instance, arrivals re-timed 20 s apart so requests never overlap: the replay's
/// block reuse must equal the trace's ideal hit rate.
fn sequential_replay(trace: Trace) -> kvsim::Report {
    let mut cfg = SimConfig::default().with_trace(trace);
    cfg.instances = 1;
    cfg.trace_timing = TraceTiming::Rate;
    cfg.arrival_model = ArrivalModel::Constant;
    cfg.request_rate = 0.05;
    Simulation::new(cfg).unwrap().run().unwrap()
}

#[test]
fn replay_one_instance_equals_the_ideal_hit_rate() {
    let trace = Trace::parse("gen.jsonl", &generated_trace(7, 9), bs(16)).unwrap();
    let ideal = trace.stats().ideal_hit_rate_full_blocks;
    assert!(ideal > 0.3, "{ideal}");
    let r = sequential_replay(trace);
    assert_eq!(r.block_reuse, ideal);
    assert_eq!(r.completed, 63);
    assert!(r.content.starts_with("trace: gen.jsonl (63 requests)"));
}

#[test]
fn malformed_lines_name_file_line_and_problem() {
    let ok = r#"{"timestamp": 5, "input_length": 40, "output_length": 2, "hash_ids": [1, 2, 3]}"#;
    for (bad, expect) in [
        ("{not json", "gen.jsonl:2: bad JSON"),
        (r#"[1, 2]"#, "gen.jsonl:2: expected a JSON object"),
        (
            r#"{"timestamp": 6, "output_length": 2, "hash_ids": []}"#,
            "gen.jsonl:2: missing field \"input_length\"",
        ),
        (
            r#"{"timestamp": 6, "input_length": -1, "output_length": 2, "hash_ids": []}"#,
            "input_length: expected a whole number from 0 to 16777216, got -1",
        ),
        (
            r#"{"timestamp": 6, "input_length": 1.5, "output_length": 2, "hash_ids": []}"#,
            "input_length: expected a whole number from 0 to 16777216, got 1.5",
        ),
        (
            r#"{"timestamp": 6, "input_length": 10, "output_length": "x", "hash_ids": []}"#,
            "output_length: expected a whole number",
        ),
        (
            r#"{"timestamp": 6, "input_length": 20, "output_length": 2, "hash_ids": [1, 2, 3]}"#,
            "gen.jsonl:2: 3 hash_ids for input_length 20: at most 2 blocks",
        ),
        (
            r#"{"timestamp": 4, "input_length": 20, "output_length": 2, "hash_ids": [1]}"#,
            "gen.jsonl:2: timestamp 4 goes backwards",
        ),
        (
            r#"{"timestamp": 6, "input_length": 20, "output_length": 2, "hash_ids": [9, 2]}"#,
            "hash id 2 follows id 9 here but id 1 on line 1",
        ),
        (
            r#"{"timestamp": 6, "input_length": 20, "output_length": 2, "hash_ids": [1, -2]}"#,
            "hash_ids: expected whole numbers >= 0, got -2",
        ),
    ] {
        let text = format!("{ok}\n{bad}\n{ok}");
        let e = Trace::parse("gen.jsonl", &text, bs(16)).unwrap_err();
        assert!(e.to_string().contains(expect), "{bad}: got {e}");
        match e {
            kvsim::Error::Trace(t) => assert_eq!((t.file.as_str(), t.line), ("gen.jsonl", 2)),
            other => panic!("not a trace error: {other:?}"),
        }
    }
}

#[test]
fn zero_lengths_and_blank_lines_replay_cleanly() {
    let text = "\n{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 0, \"hash_ids\": []}\n\n\
                {\"timestamp\": 0, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [4]}\n";
    let trace = Trace::parse("z.jsonl", text, bs(16)).unwrap();
    assert_eq!(trace.requests().len(), 2);
    let r = Simulation::new(SimConfig::default().with_trace(trace))
        .unwrap()
        .run()
        .unwrap();
    assert_eq!((r.completed, r.router_errors), (2, 0));
}

#[test]
fn block_size_must_match_the_trace() {
    let trace = Trace::parse("t.jsonl", &generated_trace(2, 2), bs(16)).unwrap();
    let mut cfg = SimConfig::default().with_trace(trace);
    cfg.block_size = bs(64);
    let e = Simulation::new(cfg).unwrap_err().to_string();
    assert_eq!(
        e,
        "invalid block_size 64: expected the trace's block size 16 (its ids name 16-token blocks and cannot be re-blocked)"
    );
}

#[test]
fn speedup_and_request_count() {
    let trace = Trace::parse("t.jsonl", &generated_trace(3, 4), bs(16)).unwrap();
    let base = SimConfig::default().with_trace(trace);
    let mut fast = base.clone();
    fast.trace_speedup = 10.0;
    fast.num_requests = 5;
    let slow = Simulation::new(base).unwrap().run().unwrap();
    let quick = Simulation::new(fast).unwrap().run().unwrap();
    assert_eq!((slow.completed, quick.completed), (12, 5));
    assert!(quick.makespan_s < slow.makespan_s);
}

/// A file of the shared data beside the repository (the tests that use it are ignored by
/// default; `.ci/run` runs them, and a missing file fails them).
fn shared(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .join(name);
    assert!(
        p.exists(),
        "{} is absent: the shared data sits beside the repository",
        p.display()
    );
    p
}

/// The acceptance figures on the real traces: replaying with one unbounded instance and
/// non-overlapping arrivals reuses exactly the ideal share of full blocks.
#[test]
#[ignore = "needs ../shared/data beside the repository (.ci/run runs it)"]
fn mooncake_traces_replay_to_their_ideal_hit_rate() {
    for (name, ideal) in [
        ("mooncake_synthetic_trace.jsonl", 0.659),
        ("mooncake_conversation_trace.jsonl", 0.382),
    ] {
        let path = shared(name);
        let trace = Trace::load(&path, bs(512)).unwrap();
        let stats = trace.stats();
        assert!(
            (stats.ideal_hit_rate_full_blocks - ideal).abs() < 0.0005,
            "{name}: {}",
            stats.ideal_hit_rate_full_blocks
        );
        let r = sequential_replay(trace);
        assert_eq!(r.block_reuse, stats.ideal_hit_rate_full_blocks, "{name}");
    }
}

/// On the conversation trace every request starts with block 0: kv beats round robin on block
/// reuse by a wide margin, and prefix_aware with K=1 sends everything to one instance.
#[test]
#[ignore = "needs ../shared/data beside the repository (.ci/run runs it)"]
fn conversation_trace_policies() {
    let path = shared("mooncake_conversation_trace.jsonl");
    let trace = Trace::load(&path, bs(512)).unwrap();
    let run_k = |policy, k| {
        let mut cfg = SimConfig::default().with_trace(trace.clone());
        cfg.instances = 8;
        cfg.kv_blocks = Some(2000);
        cfg.num_requests = 4000;
        cfg.routing = policy;
        cfg.prefix_aware_blocks = k;
        Simulation::new(cfg).unwrap().run().unwrap()
    };
    let run = |policy| run_k(policy, 1);
    let (kv, rr, pa) = (
        run(Policy::Kv),
        run(Policy::RoundRobin),
        run(Policy::PrefixAware),
    );
    assert!(
        kv.block_reuse > 1.5 * rr.block_reuse,
        "kv {} vs round robin {}",
        kv.block_reuse,
        rr.block_reuse
    );
    assert!(pa.hot_spot && pa.load_balance > 7.9, "{}", pa.load_balance);
    assert!(pa.to_text(false).contains("WARNING: hot-spotting"));
    // Keying on the first two blocks separates the conversations again.
    let pa2 = run_k(Policy::PrefixAware, 2);
    assert!(
        pa2.load_balance < 4.0 && pa2.block_reuse > pa.block_reuse,
        "{} {}",
        pa2.load_balance,
        pa2.block_reuse
    );
}

/// Router replicas on the conversation trace re-timed as a Poisson stream at its mean rate (its
/// own timestamps come in 3 s ticks of about 10 simultaneous requests): 8 replicas synced after
/// 5 ms balance like one router and keep its TTFT tail within 10%; unsynced ones do not.
#[test]
#[ignore = "needs ../shared/data beside the repository (.ci/run runs it)"]
fn synced_replicas_route_like_one_router() {
    let path = shared("mooncake_conversation_trace.jsonl");
    let trace = Trace::load(&path, bs(512)).unwrap();
    let run = |routers, sync| {
        let mut cfg = SimConfig::default().with_trace(trace.clone());
        cfg.instances = 8;
        cfg.kv_blocks = Some(900);
        cfg.trace_timing = TraceTiming::Rate;
        cfg.arrival_model = ArrivalModel::Poisson;
        cfg.request_rate = 3.4;
        cfg.routers = routers;
        cfg.router_sync = sync;
        cfg.sync_delay_us = 5_000;
        Simulation::new(cfg).unwrap().run().unwrap()
    };
    let (one, unsynced, synced) = (run(1, false), run(8, false), run(8, true));
    assert!(synced.load_balance <= 1.05, "{}", synced.load_balance);
    assert!(unsynced.load_balance > 1.2, "{}", unsynced.load_balance);
    let p99 = |r: &kvsim::Report| r.ttft_ms.p99;
    assert!(
        p99(&synced) <= 1.1 * p99(&one),
        "{} vs {}",
        p99(&synced),
        p99(&one)
    );
    assert!(
        p99(&unsynced) > 1.1 * p99(&one),
        "{} vs {}",
        p99(&unsynced),
        p99(&one)
    );
}
