//! `kvload` against a live `kvmock`: the synthetic pool (completions and chat), a Mooncake trace
//! (ignored by default: it needs the shared data, which `.ci/run` has), and bad flags.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{free_port, Mock};
use serde_json::Value;

/// Runs kvload with a hard time limit.
fn kvload(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvload"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("kvload timed out: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "kvload failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn kvload_measures_a_synthetic_pool_on_kvmock() {
    let m = Mock::start(
        free_port(),
        &["--speedup", "20", "--num-gpu-blocks", "2000"],
    );
    let ep = format!("http://127.0.0.1:{}", m.port);
    let common = [
        "--endpoint",
        &ep,
        "--des-num-requests",
        "30",
        "--request-rate",
        "100",
        "--des-num-prefixes",
        "2",
        "--des-prefix-len",
        "256",
        "--input-len",
        "300",
        "--output-len",
        "5",
        "--format",
        "json",
        "--quiet",
    ];
    let v = json_of(&kvload(&common, Duration::from_secs(60)));
    assert_eq!(
        v["model"], "mock",
        "the model defaults to the first one listed"
    );
    assert_eq!(v["completed"], 30);
    assert_eq!(v["errors"].as_array().unwrap().len(), 0);
    // Two prefixes of 16 blocks: everything after the first of each hits.
    assert!(v["request_hit_rate"].as_f64().unwrap() >= 0.9, "{v}");
    assert!(v["avg_cached_tokens"].as_f64().unwrap() >= 200.0, "{v}");
    assert!(v["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
    // Under load several tokens can share one read (a zero gap), so the mean is checked.
    assert!(v["itl_ms"]["mean"].as_f64().unwrap() > 0.0);
    assert!(v["output_tokens_per_s"].as_f64().unwrap() > 0.0);

    // Chat: text prompts through the template; the hit structure survives tokenisation.
    let mut chat = common.to_vec();
    chat.extend(["--api", "chat", "--model", "mock"]);
    let v = json_of(&kvload(&chat, Duration::from_secs(60)));
    assert_eq!(v["completed"], 30);
    assert!(v["request_hit_rate"].as_f64().unwrap() >= 0.9, "{v}");

    // The text report has kvsim's lines.
    let mut text = common.to_vec();
    text.truncate(text.len() - 3);
    text.push("--quiet");
    let out = kvload(&text, Duration::from_secs(60));
    let s = String::from_utf8_lossy(&out.stdout);
    for line in [
        "Prefix-cache hit rate:",
        "Requests: 30 completed, 0 rejected",
        "TTFT ms:",
        "ITL  ms:",
        "E2E  ms:",
    ] {
        assert!(s.contains(line), "{line} in {s}");
    }

    // --record: every request as a line kvsim reads back, with what the endpoint reported.
    let record = std::env::temp_dir().join(format!("kvload-record-{}.jsonl", std::process::id()));
    let mut recorded = common.to_vec();
    recorded.extend(["--record", record.to_str().unwrap()]);
    let v = json_of(&kvload(&recorded, Duration::from_secs(60)));
    let reqs = kvsim::load_measured(&record).unwrap();
    assert_eq!(reqs.len(), 30);
    assert!(reqs
        .iter()
        .all(|r| !r.failed && r.input_len == 300 && r.output_len == 5));
    let cached: usize = reqs.iter().map(|r| r.cached_tokens).sum();
    let mean = v["avg_cached_tokens"].as_f64().unwrap();
    assert!(
        (cached as f64 / 30.0 - mean).abs() < 1.0,
        "{cached} vs {mean}"
    );
    std::fs::remove_file(&record).ok();

    // A cap on in-flight requests still completes everything.
    let mut capped = common.to_vec();
    capped.extend(["--max-concurrency", "2"]);
    assert_eq!(
        json_of(&kvload(&capped, Duration::from_secs(60)))["completed"],
        30
    );
}

#[test]
fn kvload_spreads_requests_round_robin_over_endpoints() {
    let (a, b) = (
        Mock::start(free_port(), &["--speedup", "20"]),
        Mock::start(free_port(), &["--speedup", "20"]),
    );
    let (ea, eb) = (
        format!("http://127.0.0.1:{}", a.port),
        format!("http://127.0.0.1:{}", b.port),
    );
    let both = format!("{ea},{eb}");
    let args = [
        "--endpoint",
        &both,
        "--des-num-requests",
        "9",
        "--request-rate",
        "100",
        "--input-len",
        "40",
        "--des-prefix-len",
        "32",
        "--output-len",
        "2",
        "--format",
        "json",
        "--quiet",
    ];
    let v = json_of(&kvload(&args, Duration::from_secs(60)));
    assert_eq!(v["completed"], 9);
    assert_eq!(v["endpoint"], both.as_str());
    let served = |port: u16| {
        let (_, text) = kvtest::net::http(port, "GET", "/metrics", None);
        text.lines()
            .find(|l| l.starts_with("vllm:request_success_total"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Requests 0, 2, 4, 6, 8 to the first; 1, 3, 5, 7 to the second.
    assert_eq!((served(a.port), served(b.port)), (5.0, 4.0));
}

#[test]
#[ignore = "needs ../shared/data beside the repository (.ci/run runs it)"]
fn kvload_replays_a_mooncake_trace() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/mooncake_conversation_trace.jsonl");
    assert!(path.is_file(), "{} is absent", path.display());
    let m = Mock::start(
        free_port(),
        &["--speedup", "200", "--num-gpu-blocks", "40000"],
    );
    let ep = format!("http://127.0.0.1:{}", m.port);
    let p = path.to_str().unwrap();
    let out = kvload(
        &[
            "--endpoint",
            &ep,
            "--trace",
            p,
            "--des-num-requests",
            "40",
            "--trace-speedup",
            "100",
            "--format",
            "json",
            "--quiet",
        ],
        Duration::from_secs(120),
    );
    let v = json_of(&out);
    assert_eq!(v["completed"], 40, "{v}");
    // Every request of this trace starts with the same block.
    assert!(v["request_hit_rate"].as_f64().unwrap() > 0.5, "{v}");
}

#[test]
fn bad_flags_exit_2_with_one_line_naming_the_flag() {
    let cases: &[(&str, &[&str], &str)] = &[
        (env!("CARGO_BIN_EXE_kvmock"), &["--port", "x"], "--port"),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--no-such-flag"],
            "--no-such-flag",
        ),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--block-size", "0"],
            "--block-size",
        ),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--speedup", "0"],
            "--speedup",
        ),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--kv-events-config", "{nope"],
            "--kv-events-config",
        ),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--kv-events-shape", "tree"],
            "--kv-events-shape",
        ),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--max-num-seqs", "9000"],
            "--max-num-seqs",
        ),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--timing-base-us", "-1"],
            "--timing-base-us",
        ),
        (
            env!("CARGO_BIN_EXE_kvmock"),
            &["--tokenizer", "/nonexistent/tok.json"],
            "/nonexistent/tok.json",
        ),
        (
            env!("CARGO_BIN_EXE_kvload"),
            &["--endpoint", "ftp://x"],
            "--endpoint",
        ),
        (
            env!("CARGO_BIN_EXE_kvload"),
            &["--endpoint", "http://127.0.0.1:1", "--request-rate", "-3"],
            "--request-rate",
        ),
        (
            env!("CARGO_BIN_EXE_kvload"),
            &["--endpoint", "http://127.0.0.1:1", "--api", "soap"],
            "--api",
        ),
        (
            env!("CARGO_BIN_EXE_kvload"),
            &[
                "--endpoint",
                "http://127.0.0.1:1",
                "--trace",
                "/nonexistent.jsonl",
            ],
            "--trace",
        ),
        (env!("CARGO_BIN_EXE_kvload"), &[], "--endpoint"),
    ];
    for (bin, args, flag) in cases {
        let out = Command::new(bin).args(*args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
    for bin in [env!("CARGO_BIN_EXE_kvmock"), env!("CARGO_BIN_EXE_kvload")] {
        let out = Command::new(bin).arg("--help").output().unwrap();
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("Examples:"), "{help}");
    }
}
