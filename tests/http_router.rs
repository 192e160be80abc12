//! The `http_router` example, served in-process on 127.0.0.1 and driven over loopback by a
//! minimal HTTP/1.1 client: vLLM events for two workers, a route that must find the prefix, the
//! cache view before and after a removal, and malformed requests.
//!
//! Every socket has a timeout and the server is shut down when a test ends, so a hang fails the
//! test instead of stalling CI.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use kvkit::kvroute_vllm::{BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch};
use serde_json::Value;

#[path = "../examples/http_router.rs"]
#[allow(dead_code)] // the example's `main` and argument parsing are not used here
mod http_router;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The example's server on an ephemeral loopback port, stopped on drop.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start(config: http_router::Config) -> Server {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        listener.set_nonblocking(true).expect("nonblocking");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let shutdown = async move {
                    let _ = stopped.await;
                };
                http_router::serve(listener, &config, shutdown)
                    .await
                    .expect("serve");
            });
        });
        Server {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Sends one request and returns (status, content type, body).
    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        let mut s = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT).expect("connect");
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {}\r\nconnection: close\r\ncontent-length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("read response");
        parse_response(&raw)
    }

    fn json(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        let (status, ctype, body) = self.request(
            method,
            path,
            &[("content-type", "application/json")],
            body.as_bytes(),
        );
        assert!(ctype.starts_with("application/json"), "{ctype}: {body:?}");
        (status, serde_json::from_slice(&body).expect("JSON answer"))
    }

    fn events(&self, worker: &str, seq: Option<u64>, payload: &[u8]) -> (u16, String) {
        let seq = seq.map(|s| s.to_string());
        let mut headers = vec![("content-type", "application/msgpack")];
        if let Some(s) = &seq {
            headers.push(("x-kv-seq", s));
        }
        let (status, _, body) = self.request(
            "POST",
            &format!("/v1/kv-events/{worker}"),
            &headers,
            payload,
        );
        (status, String::from_utf8(body).expect("UTF-8 answer"))
    }

    fn block_count(&self, worker: &str) -> u64 {
        let (status, v) = self.json("GET", &format!("/v1/admin/cache-view/{worker}"), "");
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["worker_id"], worker);
        v["block_count"].as_u64().expect("block_count")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            // Do not turn a failing test into a double panic.
            if t.join().is_err() && !std::thread::panicking() {
                panic!("server thread panicked");
            }
        }
    }
}

fn parse_response(raw: &[u8]) -> (u16, String, Vec<u8>) {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = std::str::from_utf8(&raw[..split]).expect("ASCII headers");
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let mut ctype = String::new();
    let mut chunked = false;
    for l in lines {
        let (k, v) = l.split_once(':').expect("header line");
        match k.to_ascii_lowercase().as_str() {
            "content-type" => ctype = v.trim().to_string(),
            "transfer-encoding" => chunked = v.trim().eq_ignore_ascii_case("chunked"),
            _ => {}
        }
    }
    assert!(!chunked, "this client reads whole bodies only");
    (status, ctype, raw[split + 4..].to_vec())
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> EngineEvent {
    EngineEvent::BlockStored(BlockStored::new(
        hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
        parent.map(EngineHash::Int),
        tokens.collect(),
        16,
    ))
}

fn payload(events: Vec<EngineEvent>) -> Vec<u8> {
    EventBatch::new(1.0, events).to_msgpack()
}

fn token_json(tokens: std::ops::Range<u32>) -> String {
    serde_json::to_string(&tokens.collect::<Vec<_>>()).unwrap()
}

const A: &str = "10.0.0.1:30000";
const B: &str = "10.0.0.2:30000";

#[test]
fn events_route_cache_view_and_removal() {
    let server = Server::start(http_router::Config::default());

    // Worker A caches a 6-block prefix (tokens 0..96) in two batches; worker B an unrelated one.
    let (status, body) = server.events(
        A,
        Some(0),
        &payload(vec![stored(&[1, 2, 3, 4], None, 0..64)]),
    );
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["blocks_stored"].as_u64(), v["block_count"].as_u64()),
        (Some(4), Some(4))
    );
    let (status, body) = server.events(A, None, &payload(vec![stored(&[5, 6], Some(4), 64..96)]));
    assert_eq!(status, 200, "{body}");
    // The checked-in fixture (vLLM's map shape with byte hashes) for worker B.
    let fixture = include_bytes!("../crates/kvroute-vllm/tests/fixtures/stored_map_bytes.msgpack");
    let (status, body) = server.events(B, Some(0), fixture);
    assert_eq!(status, 200, "{body}");
    assert_eq!((server.block_count(A), server.block_count(B)), (6, 3));

    // A prompt sharing A's prefix goes to A, with every prefix block a hit.
    let (status, v) = server.json(
        "POST",
        "/v1/route",
        &format!(
            r#"{{"request_id": 1, "token_ids": {}}}"#,
            token_json(0..128)
        ),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["worker_id"], A);
    assert_eq!(v["cache_hits"], 6);
    assert_eq!(v["cost"], 2.0); // 8 blocks, 6 hits, nothing in flight
                                // B's prefix goes to B, under the prefill role.
    let (status, v) = server.json(
        "POST",
        "/v1/route",
        &format!(
            r#"{{"request_id": 2, "token_ids": {}, "role": "prefill"}}"#,
            token_json(5000..5048)
        ),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["worker_id"].as_str(), v["cache_hits"].as_u64()),
        (Some(B), Some(3))
    );
    for id in [1, 2] {
        let (status, v) = server.json("POST", &format!("/v1/finish/{id}"), "");
        assert_eq!((status, &v["request_id"]), (200, &Value::from(id)), "{v}");
    }

    // A evicts its last two blocks: the view shrinks and so do the hits.
    let removal = payload(vec![EngineEvent::BlockRemoved(BlockRemoved::new(vec![
        EngineHash::Int(6),
        EngineHash::Int(5),
    ]))]);
    let (status, body) = server.events(A, Some(2), &removal);
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.block_count(A), 4);
    let (_, v) = server.json(
        "POST",
        "/v1/route",
        &format!(
            r#"{{"request_id": 3, "token_ids": {}}}"#,
            token_json(0..128)
        ),
    );
    assert_eq!(
        (v["worker_id"].as_str(), v["cache_hits"].as_u64()),
        (Some(A), Some(4))
    );

    // Block hashes can be routed directly too.
    let (status, v) = server.json(
        "POST",
        "/v1/route",
        r#"{"request_id": 4, "block_hashes": [1, 2]}"#,
    );
    assert_eq!((status, v["cache_hits"].as_u64()), (200, Some(0)), "{v}");

    // Removing a worker drops its view; routing then goes to the other one.
    let (status, v) = server.json("DELETE", &format!("/v1/workers/{A}"), "");
    assert_eq!(status, 200, "{v}");
    let (status, v) = server.json("GET", &format!("/v1/admin/cache-view/{A}"), "");
    assert_eq!(status, 404, "{v}");
    let (_, v) = server.json(
        "POST",
        "/v1/route",
        &format!(r#"{{"request_id": 5, "token_ids": {}}}"#, token_json(0..64)),
    );
    assert_eq!(v["worker_id"], B);
}

#[test]
fn sequence_numbers_over_http() {
    let server = Server::start(http_router::Config::default());
    let batch = payload(vec![stored(&[1], None, 0..16)]);
    assert_eq!(server.events(A, Some(0), &batch).0, 200);
    let (status, body) = server.events(A, Some(1), &payload(vec![stored(&[2], Some(1), 16..32)]));
    assert_eq!(status, 200, "{body}");
    // A replayed batch is a conflict.
    let (status, body) = server.events(A, Some(1), &batch);
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("sequence number 1 already seen"), "{body}");
    // Sequence 0 again: the publisher restarted; the view is rebuilt from this batch.
    let (status, body) = server.events(A, Some(0), &batch);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""restarted":true"#), "{body}");
    assert_eq!(server.block_count(A), 1);
    let (status, body) = server.events(A, Some(7), &payload(vec![]));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""gap":{"expected":1,"got":7}"#), "{body}");
    let (status, body) = server.events(A, None, &[]);
    assert_eq!(status, 400, "{body}");
    let (status, _, body) = server.request(
        "POST",
        &format!("/v1/kv-events/{A}"),
        &[("x-kv-seq", "seven")],
        &batch,
    );
    assert_eq!(status, 400, "{body:?}");
}

#[test]
fn malformed_requests_are_client_errors() {
    let server = Server::start(http_router::Config::default());

    // No worker yet.
    let (status, v) = server.json("POST", "/v1/route", r#"{"request_id": 1, "token_ids": []}"#);
    assert_eq!(status, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains("no worker"), "{v}");

    // Bad msgpack: 400 with the reason as text, and no phantom worker registered.
    for bad in [
        &include_bytes!("../crates/kvroute-vllm/tests/fixtures/bad_truncated.msgpack")[..],
        &include_bytes!("../crates/kvroute-vllm/tests/fixtures/bad_unknown_type.msgpack")[..],
        &include_bytes!("../crates/kvroute-vllm/tests/fixtures/bad_token_count.msgpack")[..],
        &include_bytes!("../crates/kvroute-vllm/tests/fixtures/bad_block_size.msgpack")[..],
        b"not msgpack at all",
    ] {
        let (status, ctype, body) = server.request("POST", &format!("/v1/kv-events/{A}"), &[], bad);
        let body = String::from_utf8(body).unwrap();
        assert_eq!(status, 400, "{body}");
        assert!(ctype.starts_with("text/plain"), "{ctype}");
        assert!(!body.trim().is_empty());
    }
    let (status, v) = server.json("GET", &format!("/v1/admin/cache-view/{A}"), "");
    assert_eq!(status, 404, "{v}");

    let (status, v) = server.json("POST", &format!("/v1/workers/{A}"), "");
    assert_eq!((status, &v["created"]), (201, &Value::Bool(true)), "{v}");
    let (status, _) = server.json("POST", &format!("/v1/workers/{A}"), "");
    assert_eq!(status, 200);
    assert_eq!(server.block_count(A), 0);

    // Bad JSON, wrong types, unknown fields, both or neither of the inputs, unknown role.
    for body in [
        "{not json",
        r#"{"request_id": "one", "token_ids": []}"#,
        r#"{"request_id": 1, "token_ids": [-1]}"#,
        r#"{"request_id": 1, "tokens": []}"#,
        r#"{"request_id": 1}"#,
        r#"{"request_id": 1, "token_ids": [], "block_hashes": []}"#,
        r#"{"request_id": 1, "token_ids": [], "role": "chef"}"#,
    ] {
        let (status, v) = server.json("POST", "/v1/route", body);
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v["error"].is_string(), "{v}");
    }

    // A duplicate request id is a conflict; an unknown finish is not found.
    let ok = r#"{"request_id": 9, "token_ids": [1, 2, 3]}"#;
    assert_eq!(server.json("POST", "/v1/route", ok).0, 200);
    let (status, v) = server.json("POST", "/v1/route", ok);
    assert_eq!(status, 409, "{v}");
    let (status, v) = server.json("POST", "/v1/finish/10", "");
    assert_eq!(status, 404, "{v}");
    assert!(v["error"].as_str().unwrap().contains("request 10"), "{v}");
    let (status, _) = server.json("POST", "/v1/finish/ten", "");
    assert_eq!(status, 400);
    assert_eq!(server.json("POST", "/v1/finish/9", "").0, 200);

    let (status, v) = server.json("DELETE", "/v1/workers/nobody", "");
    assert_eq!(status, 404, "{v}");
}

#[test]
fn command_line() {
    let args = |a: &[&str]| http_router::parse_args(a.iter().map(|s| s.to_string()));
    let c = args(&[
        "--port",
        "8000",
        "--block-size=32",
        "--policy",
        "prefix_aware",
        "--overlap-weight",
        "2.5",
    ])
    .unwrap()
    .unwrap();
    assert_eq!(
        (c.port, c.block_size.get(), c.overlap_weight),
        (8000, 32, 2.5)
    );
    assert!(args(&["--help"]).unwrap().is_none());
    for bad in [
        &["--block-size", "0"][..],
        &["--policy", "fastest"],
        &["--port"],
        &["--frobnicate"],
    ] {
        let e = args(bad).unwrap_err();
        assert!(e.contains(bad[0]), "{e}");
    }
}

/// The bug report's two reproductions, through the example's HTTP API: a hybrid model's
/// sliding-window eviction must not drop the full-attention hits, and a different image must
/// not hit another image's blocks.
#[test]
fn hybrid_groups_and_multimodal_keys_over_http() {
    let server = Server::start(http_router::Config::default());
    let fx =
        include_bytes!("../crates/kvroute-vllm/tests/fixtures/hybrid_sliding_window_map.msgpack");
    let (status, body) = server.events(A, Some(0), fx);
    assert_eq!(status, 200, "{body}");
    let (status, v) = server.json(
        "POST",
        "/v1/route",
        // A follow-up turn: the 256 cached tokens and 48 new ones. (The engine never reuses the
        // block holding a prompt's last token, so an exact repeat of the 256 tokens would look
        // at the window before block 15, which lost block 7: no hit, in vLLM too.)
        &format!(
            r#"{{"request_id": 1, "token_ids": {}}}"#,
            token_json(0..304)
        ),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["worker_id"].as_str(), v["cache_hits"].as_u64()),
        (Some(A), Some(16))
    );

    let fx = include_bytes!(
        "../crates/kvroute-vllm/tests/fixtures/multimodal_extra_keys_positional.msgpack"
    );
    let (status, body) = server.events(B, Some(0), fx);
    assert_eq!(status, 200, "{body}");
    let placeholders = serde_json::to_string(&vec![151_655u32; 32]).unwrap();
    let route = |id: u64, image: &str| {
        server.json(
            "POST",
            "/v1/route",
            &format!(
                r#"{{"request_id": {id}, "token_ids": {placeholders}, "mm_items": [{{"identifier": "{image}", "offset": 0, "length": 32}}]}}"#
            ),
        )
    };
    let (status, v) = route(2, "img-B");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["cache_hits"], 0, "{v}");
    let (status, v) = route(3, "img-A");
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["worker_id"].as_str(), v["cache_hits"].as_u64()),
        (Some(B), Some(2))
    );
}
