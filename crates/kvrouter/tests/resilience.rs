//! Failures before the first byte: retries on the next-best worker, and per-worker circuit
//! breakers, against `kvmock`'s injected faults.

mod common;

use std::time::Duration;

use common::{eventually, Engine, Kvrouter};
use kvtest::net::{free_port, request};

/// POSTs a completion; the response's lower-cased head and its body.
fn post(port: u16, body: &str) -> (String, String) {
    let r = request(port, "POST", "/v1/completions", "", body);
    (r.head, r.body)
}

fn served_by(head: &str) -> &str {
    head.lines()
        .find_map(|l| l.strip_prefix("x-kvkit-worker: "))
        .unwrap_or("")
}

fn breaker(router: &Kvrouter, name: &str) -> String {
    let v = router.get_json("/v1/admin/workers");
    let w = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == name)
        .unwrap()
        .clone();
    w["breaker"].as_str().unwrap().to_string()
}

#[test]
fn a_failing_worker_is_retried_elsewhere_and_its_breaker_opens_and_probes() {
    let broken = Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--fault-error-rate", "1"],
    );
    let good = Engine::start();
    let (bad_name, good_name) = (
        format!("127.0.0.1:{}", broken.port),
        format!("127.0.0.1:{}", good.port),
    );
    let flags = [
        "--router-policy",
        "round-robin",
        "--breaker-failures",
        "3",
        "--breaker-cooldown-s",
        "1",
        "--retry-backoff-ms",
        "1",
    ];
    let router = Kvrouter::start(&[&broken, &good], &flags);
    // Round robin sends every other request to the broken worker first: each is retried on
    // the good one, and no client sees an error.
    for i in 0..12 {
        let body = format!(r#"{{"prompt": [{i}, 1, 2, 3], "max_tokens": 2}}"#);
        let (head, text) = post(router.port, &body);
        assert!(head.starts_with("http/1.1 200"), "{head}\n{text}");
        assert_eq!(served_by(&head), good_name, "{head}");
    }
    // Three failures opened the broken worker's breaker: it got no request after them.
    assert_eq!(router.metric("kvrouter_retries_total"), 3.0);
    assert_eq!(router.metric("kvrouter_breaker_opened_total"), 1.0);
    assert_eq!(router.metric("kvrouter_upstream_errors_total"), 3.0);
    assert_eq!(breaker(&router, &bad_name), "open");
    assert_eq!(breaker(&router, &good_name), "closed");
    // After its cooldown it is tried again (half-open); failing, it opens again.
    eventually(
        "the breaker goes half-open",
        Duration::from_secs(10),
        || breaker(&router, &bad_name) == "half-open",
    );
    for i in 0..2 {
        let body = format!(r#"{{"prompt": [{i}, 9, 9, 9], "max_tokens": 2}}"#);
        let (head, _) = post(router.port, &body);
        assert!(head.starts_with("http/1.1 200"), "{head}");
    }
    assert_eq!(router.metric("kvrouter_breaker_opened_total"), 2.0);
    assert_eq!(breaker(&router, &bad_name), "open");
}

#[test]
fn a_stalled_worker_times_out_and_the_request_goes_elsewhere() {
    let stalled = Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--fault-stall-ms", "5000"],
    );
    let good = Engine::start();
    let flags = [
        "--router-policy",
        "round-robin",
        "--upstream-timeout-s",
        "0.3",
        "--retry-backoff-ms",
        "1",
    ];
    let router = Kvrouter::start(&[&stalled, &good], &flags);
    for i in 0..2 {
        let body = format!(r#"{{"prompt": [{i}, 1, 2, 3], "max_tokens": 2}}"#);
        let (head, text) = post(router.port, &body);
        assert!(head.starts_with("http/1.1 200"), "{head}\n{text}");
        assert_eq!(served_by(&head), format!("127.0.0.1:{}", good.port));
    }
    // Each time the stalled worker was tried first, it timed out and the request was retried.
    let retries = router.metric("kvrouter_retries_total");
    assert!(retries >= 1.0, "{retries}");
    assert_eq!(router.metric("kvrouter_upstream_errors_total"), retries);
}

#[test]
fn with_no_retries_the_failure_reaches_the_client() {
    let broken = Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--fault-error-rate", "1"],
    );
    let router = Kvrouter::start(&[&broken], &["--retries", "0"]);
    let (head, text) = post(router.port, r#"{"prompt": [1, 2, 3], "max_tokens": 2}"#);
    // The engine's own 500, as it answered.
    assert!(head.starts_with("http/1.1 500"), "{head}\n{text}");
    assert!(text.contains("injected fault"), "{text}");
    assert_eq!(router.metric("kvrouter_retries_total"), 0.0);
}
