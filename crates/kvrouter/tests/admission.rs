//! Admission control: `--max-concurrency` with a first-in, first-out queue bounded by
//! `--queue-timeout-ms`, 429 with `Retry-After` past it; and the `x-kvkit-worker` header.

mod common;

use std::time::Duration;

use common::{eventually, Engine, Kvrouter};
use kvtest::net::{free_port, request};
use serde_json::Value;

/// POSTs a completion; the response's lower-cased head and its body.
fn post(port: u16, body: &str) -> (String, String) {
    let r = request(port, "POST", "/v1/completions", "", body);
    (r.head, r.body)
}

/// A request that runs for a while (at --speedup 1).
const LONG: &str = r#"{"prompt": [1, 2, 3, 4], "max_tokens": 200, "ignore_eos": true}"#;
const SHORT: &str = r#"{"prompt": [5, 6, 7, 8], "max_tokens": 2}"#;

/// An engine at wall-clock speed and a router with one place and `queue_timeout_ms`, with a
/// long request holding the place: the engine, the router and the long request's thread.
fn one_place_taken(
    queue_timeout_ms: &str,
) -> (Engine, Kvrouter, std::thread::JoinHandle<(String, String)>) {
    let engine = Engine::start_with(free_port(), free_port(), free_port(), &["--speedup", "1"]);
    let flags = [
        "--max-concurrency",
        "1",
        "--queue-timeout-ms",
        queue_timeout_ms,
    ];
    let router = Kvrouter::start(&[&engine], &flags);
    let port = router.port;
    let long = std::thread::spawn(move || post(port, LONG));
    eventually(
        "the long request holds the one place",
        Duration::from_secs(10),
        || router.get_json("/v1/admin/workers")["workers"][0]["in_flight"] == 1,
    );
    (engine, router, long)
}

#[test]
fn past_max_concurrency_requests_queue_then_get_429_with_retry_after() {
    let (engine, router, long) = one_place_taken("200");
    let port = router.port;
    let (head, body) = post(port, SHORT);
    assert!(head.starts_with("http/1.1 429"), "{head}\n{body}");
    assert!(head.contains("\r\nretry-after: 1"), "{head}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "RateLimitError", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--max-concurrency 1"));
    assert_eq!(router.metric("kvrouter_rejected_busy_total"), 1.0);
    let (head, _) = long.join().unwrap();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    // Which worker served it.
    assert!(
        head.contains(&format!("\r\nx-kvkit-worker: 127.0.0.1:{}", engine.port)),
        "{head}"
    );
}

#[test]
fn a_queued_request_runs_when_a_place_frees() {
    let (_engine, router, long) = one_place_taken("60000");
    let port = router.port;
    let queued = std::thread::spawn(move || post(port, SHORT));
    eventually("the second request waits", Duration::from_secs(10), || {
        router.metric("kvrouter_queue_depth") == 1.0
    });
    // It is not routed while it waits.
    assert_eq!(
        router.get_json("/v1/admin/workers")["workers"][0]["in_flight"],
        1
    );
    let (first, _) = long.join().unwrap();
    let (second, _) = queued.join().unwrap();
    assert!(first.starts_with("http/1.1 200") && second.starts_with("http/1.1 200"));
    assert_eq!(router.metric("kvrouter_queue_depth"), 0.0);
    assert_eq!(router.metric("kvrouter_queue_wait_seconds_count"), 2.0);
    assert_eq!(router.metric("kvrouter_rejected_busy_total"), 0.0);
}
