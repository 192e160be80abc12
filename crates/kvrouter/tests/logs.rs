//! The router server's logs: JSON lines with `--log-format json`, filtered by `RUST_LOG`, and a
//! request's lines carrying its id (the client's `x-request-id`, or one the router gives).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{eventually, wait_healthy, Engine, Proc};
use kvtest::net::{free_port, request};
use serde_json::Value;

/// POSTs a completion with extra header lines; the response's lower-cased head.
fn post_with(port: u16, extra_headers: &str) -> String {
    let body = r#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "max_tokens": 2}"#;
    let r = request(port, "POST", "/v1/completions", extra_headers, body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.head
}

fn lines(log: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The request id of each `routed` line.
fn routed_ids(log: &std::path::Path) -> Vec<String> {
    lines(log)
        .iter()
        .filter(|l| l["fields"]["message"] == "routed")
        .map(|l| l["span"]["request_id"].as_str().unwrap_or("").to_string())
        .collect()
}

/// A router in front of `engine` logging JSON at `kvrouter::proxy=debug,warn` into a file, with
/// `extra` flags: its guard, port, and the log's path (in `dir`).
fn logged_router(
    engine: &Engine,
    dir: &tempfile::TempDir,
    extra: &[&str],
) -> (Proc, u16, std::path::PathBuf) {
    let log = dir.path().join("kvrouter.log");
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--worker", &engine.spec(), "--log-format", "json"])
        .args(extra)
        .env("RUST_LOG", "kvrouter::proxy=debug,warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    wait_healthy(port, &mut child, "kvrouter");
    (Proc(child), port, log)
}

#[test]
fn json_lines_carry_the_request_id_and_rust_log_filters_them() {
    let engine = Engine::start();
    let dir = tempfile::tempdir().unwrap();
    let (_router, port, log) = logged_router(&engine, &dir, &[]);

    // The client's id: sent back, and on the decision's line.
    let head = post_with(port, "x-request-id: req-42\r\n");
    assert!(head.contains("\r\nx-request-id: req-42"), "{head}");
    eventually("the decision is logged", Duration::from_secs(10), || {
        routed_ids(&log).contains(&"req-42".to_string())
    });
    let routed = lines(&log)
        .into_iter()
        .find(|l| l["fields"]["message"] == "routed")
        .unwrap();
    assert_eq!(routed["level"], "DEBUG");
    assert_eq!(
        routed["fields"]["worker"],
        format!("127.0.0.1:{}", engine.port)
    );
    assert_eq!(routed["fields"]["blocks"], 1);

    // None given: the router gives one, and logs under it.
    let head = post_with(port, "");
    let given = head
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .expect("an id in the response")
        .to_string();
    assert!(given.starts_with("kvr-"), "{given}");
    eventually(
        "the second decision is logged",
        Duration::from_secs(10),
        || routed_ids(&log).contains(&given),
    );
    // kvrouter::proxy=debug,warn: the startup line (info, another module) is filtered out.
    assert!(
        lines(&log).iter().all(|l| !l["fields"]["message"]
            .as_str()
            .unwrap()
            .starts_with("listening")),
        "{:?}",
        lines(&log)
    );
}

#[test]
fn with_tracing_on_a_requests_lines_name_its_trace() {
    let collector = kvtest::net::OtlpReceiver::start();
    let engine = Engine::start();
    let dir = tempfile::tempdir().unwrap();
    let endpoint = collector.endpoint();
    let (_router, port, log) = logged_router(&engine, &dir, &["--otlp-traces-endpoint", &endpoint]);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    post_with(
        port,
        &format!("traceparent: 00-{trace}-00f067aa0ba902b7-01\r\nx-request-id: t-1\r\n"),
    );
    eventually("the decision is logged", Duration::from_secs(10), || {
        routed_ids(&log).contains(&"t-1".to_string())
    });
    let routed = lines(&log)
        .into_iter()
        .find(|l| l["fields"]["message"] == "routed")
        .unwrap();
    assert_eq!(routed["span"]["trace_id"], trace, "{routed}");
}
