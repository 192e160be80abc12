//! The silent-feed alarm: a worker that serves requests for `--event-silence-s` without a KV
//! event is flagged; with `--on-silent-feed load-only` its mirror is forgotten.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{eventually, kvmock_bin, wait_healthy, Engine, Kvrouter, Proc};
use serde_json::Value;

fn worker(router: &Kvrouter) -> Value {
    router.get_json("/v1/admin/workers")["workers"][0].clone()
}

fn prompt(i: u32) -> String {
    let tokens: Vec<String> = (0..32).map(|t| (1_000 * i + t).to_string()).collect();
    format!(r#"{{"prompt": [{}], "max_tokens": 2}}"#, tokens.join(","))
}

#[test]
fn a_worker_publishing_events_is_never_flagged() {
    let engine = Engine::start();
    let router = Kvrouter::start(&[&engine], &["--event-silence-s", "0.3"]);
    // Over a second of traffic, each request's blocks are new: every one is confirmed by events.
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(1) {
        let (status, text) = router.post("/v1/completions", &prompt(i));
        assert_eq!(status, 200, "{text}");
        i += 1;
    }
    assert_eq!(worker(&router)["silent"], false);
    assert_eq!(router.metric("kvrouter_silent_feeds_total"), 0.0);
}

#[test]
fn a_worker_whose_events_stop_is_flagged_and_load_only_forgets_its_mirror() {
    let mut engine = Engine::start();
    let flags = ["--event-silence-s", "0.3", "--on-silent-feed", "load-only"];
    let router = Kvrouter::start(&[&engine], &flags);
    let (status, _) = router.post("/v1/completions", &prompt(0));
    assert_eq!(status, 200);
    eventually(
        "the worker's blocks are mirrored",
        Duration::from_secs(10),
        || worker(&router)["block_count"].as_u64() > Some(0),
    );
    // The same engine again on its port, its KV-event publisher gone.
    let _ = engine.proc.0.kill();
    let _ = engine.proc.0.wait();
    let mut child = Command::new(kvmock_bin())
        .args(["--host", "127.0.0.1", "--port", &engine.port.to_string()])
        .args(["--speedup", "100"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvmock starts");
    wait_healthy(engine.port, &mut child, "kvmock");
    let _silent_engine = Proc(child);
    // It serves (once the router has seen it back up), and publishes nothing.
    let mut i = 1;
    eventually("a request is served again", Duration::from_secs(10), || {
        i += 1;
        router.post("/v1/completions", &prompt(i)).0 == 200
    });
    eventually(
        "the worker is flagged silent",
        Duration::from_secs(10),
        || worker(&router)["silent"] == true,
    );
    assert_eq!(router.metric("kvrouter_silent_feeds_total"), 1.0);
    // load-only: its mirror is forgotten, so it is scored by load alone.
    assert_eq!(worker(&router)["block_count"], 0);
}
