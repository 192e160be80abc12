//! `--scrape-metrics-s`: the engines' own `/metrics` (vLLM's running, waiting and KV-usage
//! gauges) feed the busy thresholds, the router's `/metrics` and `/v1/admin/workers`.

mod common;

use std::time::Duration;

use common::{eventually, Engine, Kvrouter};
use kvtest::net::{free_port, request};
use serde_json::Value;

/// A prompt of `n` tokens from `from` (whole 16-token blocks).
fn prompt(from: u32, n: u32) -> String {
    let tokens: Vec<u32> = (from..from + n).collect();
    serde_json::to_string(&tokens).unwrap()
}

/// `worker`'s entry in the router's `/v1/admin/workers`.
fn admin(router: &Kvrouter, worker: &str) -> Value {
    let v = router.get_json("/v1/admin/workers");
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == worker)
        .cloned()
        .unwrap_or_else(|| panic!("no {worker} in {v}"))
}

/// The worker that served a short completion of `prompt` through the router.
fn served(router: &Kvrouter, prompt: &str) -> String {
    let body = format!(r#"{{"prompt": {prompt}, "max_tokens": 2}}"#);
    let r = request(router.port, "POST", "/v1/completions", "", &body);
    assert_eq!(r.status, 200, "{}\n{}", r.head, r.body);
    r.header("x-kvkit-worker").unwrap().to_string()
}

/// Engine A (one request at a time, at wall-clock speed) gets long requests straight from a
/// client, past the router: the router's own counts say A is idle, only A's `/metrics` says
/// requests wait there. A holds the prompt's blocks, so the cost prefers A; with `waiting=0`
/// and the scraped telemetry the router sends it to B, and to A again once A's queue is empty.
#[test]
fn a_worker_whose_engine_reports_waiting_requests_is_routed_around() {
    let a = Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--speedup", "1", "--max-num-seqs", "1"],
    );
    let b = Engine::start();
    let router = Kvrouter::start(
        &[&a, &b],
        &["--busy-threshold", "waiting=0", "--scrape-metrics-s", "0.2"],
    );
    let (a_name, b_name) = (a.name(), b.name());
    // Both engines scraped, idle.
    eventually("both engines scraped", Duration::from_secs(10), || {
        [&a_name, &b_name]
            .iter()
            .all(|w| admin(&router, w)["engine"]["waiting"] == 0.0)
    });
    assert_eq!(router.metric("kvrouter_worker_engine_running"), 0.0);

    // A second prompt that only A holds, for the end.
    let (busy_prompt, later_prompt) = (prompt(1000, 64), prompt(5000, 64));
    let short = format!(r#"{{"prompt": {later_prompt}, "max_tokens": 1}}"#);
    assert_eq!(
        request(a.port, "POST", "/v1/completions", "", &short).status,
        200
    );
    // Four long requests on A, one running and the others waiting (about 2 s each).
    let long = format!(r#"{{"prompt": {busy_prompt}, "max_tokens": 300, "ignore_eos": true}}"#);
    let port = a.port;
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let long = long.clone();
            std::thread::spawn(move || request(port, "POST", "/v1/completions", "", &long).status)
        })
        .collect();
    router.wait_blocks(&a_name, 8);
    eventually(
        "A's waiting requests scraped",
        Duration::from_secs(10),
        || {
            admin(&router, &a_name)["engine"]["waiting"]
                .as_f64()
                .is_some_and(|n| n >= 1.0)
        },
    );
    assert!(router.metric("kvrouter_worker_engine_waiting") >= 1.0);
    assert!(router.metric("kvrouter_worker_engine_running") >= 1.0);
    // The router's own counts see nothing on A.
    let seen = admin(&router, &a_name);
    assert_eq!(
        (seen["in_flight"].as_u64(), seen["active_blocks"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(served(&router, &busy_prompt), b_name);

    for c in clients {
        assert_eq!(c.join().unwrap(), 200);
    }
    eventually("A's empty queue scraped", Duration::from_secs(10), || {
        admin(&router, &a_name)["engine"]["waiting"] == 0.0
    });
    assert_eq!(served(&router, &later_prompt), a_name);

    // A worker whose /metrics cannot be read keeps its values one more period, then has none.
    drop(b);
    eventually("B's values cleared", Duration::from_secs(10), || {
        admin(&router, &b_name)["engine"].is_null()
    });
    assert!(router.metric("kvrouter_worker_engine_scrape_errors_total") >= 2.0);
}

#[test]
fn without_the_flag_nothing_is_scraped() {
    let e = Engine::start();
    let router = Kvrouter::start(&[&e], &[]);
    assert!(router.get_json("/v1/admin/workers")["workers"][0]["engine"].is_null());
    let (_, text) = kvtest::net::http(router.port, "GET", "/metrics", None);
    assert!(!text.contains("kvrouter_worker_engine"), "{text}");
}

#[test]
fn waiting_without_scraping_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["--port", "0", "--busy-threshold", "waiting=2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--busy-threshold") && err.contains("--scrape-metrics-s"),
        "{err}"
    );
}
