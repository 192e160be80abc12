//! Workers at run time: `POST /v1/admin/workers` adds one, `DELETE` removes one, and `.../drain`
//! takes one out of routing and removes it once its in-flight requests have finished.

mod common;

use std::time::Duration;

use common::{eventually, Engine, Kvrouter};
use kvtest::net::{free_port, request};
use serde_json::{json, Value};

fn names(router: &Kvrouter) -> Vec<String> {
    router.get_json("/v1/admin/workers")["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_str().unwrap().to_string())
        .collect()
}

fn add(router: &Kvrouter, engine: &Engine) -> (u16, Value) {
    let body = json!({
        "url": format!("http://127.0.0.1:{}", engine.port),
        "events": format!("tcp://127.0.0.1:{}", engine.events),
        "replay": format!("tcp://127.0.0.1:{}", engine.replay),
    });
    let r = request(
        router.port,
        "POST",
        "/v1/admin/workers",
        "",
        &body.to_string(),
    );
    (
        r.status,
        serde_json::from_str(&r.body).unwrap_or(Value::Null),
    )
}

/// A prompt of one full block (16 tokens) and a bit.
const SHORT: &str =
    r#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "max_tokens": 2}"#;

#[test]
fn workers_are_added_and_removed_at_run_time() {
    let engine = Engine::start();
    let router = Kvrouter::start(&[], &[]);
    assert_eq!(router.post("/v1/completions", SHORT).0, 503);
    let (status, v) = add(&router, &engine);
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["worker_id"], engine.name());
    assert_eq!(names(&router), [engine.name()]);
    router.wait_subscribed();
    let (status, text) = router.post("/v1/completions", SHORT);
    assert_eq!(status, 200, "{text}");
    // Its events are followed: the prompt's block is mirrored.
    eventually(
        "the worker's blocks are mirrored",
        Duration::from_secs(10),
        || router.block_count(&engine.name()) > 0,
    );
    // Twice: 409. Bad bodies: 400, naming what is expected.
    assert_eq!(add(&router, &engine).0, 409);
    let bad = request(
        router.port,
        "POST",
        "/v1/admin/workers",
        "",
        r#"{"events": "x"}"#,
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("url"), "{}", bad.body);
    let bad = request(
        router.port,
        "POST",
        "/v1/admin/workers",
        "",
        r#"{"url": "ftp://x"}"#,
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
    // Removed: gone from the list and from routing.
    let path = format!("/v1/admin/workers/{}", engine.name());
    assert_eq!(request(router.port, "DELETE", &path, "", "").status, 200);
    assert!(names(&router).is_empty());
    assert_eq!(router.post("/v1/completions", SHORT).0, 503);
    assert_eq!(request(router.port, "DELETE", &path, "", "").status, 404);
}

#[test]
fn a_drained_worker_finishes_its_requests_then_leaves() {
    let slow = ["--speedup", "1"];
    let (a, b) = (
        Engine::start_with(free_port(), free_port(), free_port(), &slow),
        Engine::start_with(free_port(), free_port(), free_port(), &slow),
    );
    let router = Kvrouter::start(&[&a, &b], &["--router-policy", "round-robin"]);
    let port = router.port;
    let long = std::thread::spawn(move || {
        request(
            port,
            "POST",
            "/v1/completions",
            "",
            r#"{"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": true}"#,
        )
    });
    // Drain the worker the long request runs on.
    let mut busy = String::new();
    eventually("the long request runs", Duration::from_secs(10), || {
        let v = router.get_json("/v1/admin/workers");
        let w = v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["in_flight"] == 1)
            .cloned();
        busy = w.map_or(String::new(), |w| {
            w["worker_id"].as_str().unwrap().to_string()
        });
        !busy.is_empty()
    });
    let drain = request(
        port,
        "POST",
        &format!("/v1/admin/workers/{busy}/drain"),
        "",
        "",
    );
    assert_eq!(drain.status, 202, "{}", drain.body);
    let v = router.get_json("/v1/admin/workers");
    let state = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == busy.as_str())
        .unwrap()["state"]
        .clone();
    assert_eq!(state, "draining");
    // New requests go to the other worker, and succeed.
    for _ in 0..4 {
        let r = request(port, "POST", "/v1/completions", "", SHORT);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(r.header("x-kvkit-worker"), Some(busy.as_str()));
    }
    // The long request finishes where it was, then the worker leaves.
    let done = long.join().unwrap();
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(done.header("x-kvkit-worker"), Some(busy.as_str()));
    eventually(
        "the drained worker is removed",
        Duration::from_secs(10),
        || !names(&router).contains(&busy),
    );
    assert_eq!(names(&router).len(), 1);
    let missing = request(port, "POST", "/v1/admin/workers/127.0.0.1:1/drain", "", "");
    assert_eq!(missing.status, 404);
}
