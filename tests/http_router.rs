//! The `http_router` embedding example, served in-process on loopback: vLLM events for two
//! workers, a route that finds the prefix, finishing, and bad input answered with 4xx.

use std::time::Duration;

use kvkit::kvblock::BlockSize;
use kvkit::kvroute_vllm::{BlockStored, EngineEvent, EngineHash, EventBatch};
use kvtest::net::{free_port, http};
use serde_json::Value;

#[path = "../examples/http_router.rs"]
#[allow(dead_code)] // the example's `main` is not used here
mod http_router;

/// The example on a free loopback port, on a runtime that ends with the test's process.
fn start() -> u16 {
    let port = free_port();
    let (ready, up) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = http_router::app(BlockSize::new(16).unwrap()).unwrap();
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .unwrap();
            ready.send(()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    up.recv_timeout(Duration::from_secs(10))
        .expect("the example listens");
    port
}

/// A vLLM batch storing `blocks` blocks of 16 tokens from token 0, engine hashes from `first`.
fn batch(first: i64, blocks: u32) -> Vec<u8> {
    let hashes = (0..i64::from(blocks))
        .map(|i| EngineHash::from(first + i))
        .collect();
    let tokens = (0..16 * blocks).collect();
    let stored = BlockStored::new(hashes, None, tokens, 16);
    EventBatch::new(0.0, vec![EngineEvent::BlockStored(stored)]).to_msgpack()
}

fn post_bytes(port: u16, path: &str, body: &[u8]) -> (u16, Value) {
    // The loopback client takes text: a MessagePack payload goes through as Latin-1 would not,
    // so bytes are sent with a raw socket.
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw[9..12].parse().unwrap();
    let json = raw.split("\r\n\r\n").nth(1).unwrap_or("null");
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

fn post(port: u16, path: &str, body: &str) -> (u16, Value) {
    let (status, text) = http(port, "POST", path, Some(body));
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[test]
fn events_in_routing_decisions_out() {
    let port = start();
    // w0 holds 4 blocks of tokens 0..64, w1 one block of them.
    assert_eq!(post_bytes(port, "/v1/kv-events/w0", &batch(100, 4)).0, 200);
    assert_eq!(post_bytes(port, "/v1/kv-events/w1", &batch(200, 1)).0, 200);
    let tokens: Vec<u32> = (0..64).collect();
    let route = |id: u64| {
        post(
            port,
            "/v1/route",
            &serde_json::json!({"request_id": id, "token_ids": tokens}).to_string(),
        )
    };
    let (status, d) = route(1);
    assert_eq!(status, 200, "{d}");
    assert_eq!(
        (d["worker"].as_str(), d["cache_hits"].as_u64()),
        (Some("w0"), Some(4))
    );
    // The same request again is in flight already; finishing it twice is unknown the second time.
    assert_eq!(route(1).0, 409);
    assert_eq!(post(port, "/v1/finish/1", "").0, 200);
    assert_eq!(post(port, "/v1/finish/1", "").0, 404);
    // Bad input: a truncated batch, a body that is not a route request.
    let truncated = &batch(300, 2)[..10];
    let (status, e) = post_bytes(port, "/v1/kv-events/w0", truncated);
    assert_eq!(status, 400);
    assert!(e["error"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
    assert_eq!(post(port, "/v1/route", "{\"token_ids\": \"no\"}").0, 400);
}
