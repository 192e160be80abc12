//! Test support: free loopback ports, a `kvmock` process guard, a tiny blocking HTTP client,
//! and ZMQ helpers. Every wait has a timeout; every process started is killed on drop.

#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
#[allow(unused_imports)]
pub use kvtest::net::{eventually, free_port, http, sse_events, try_http, Proc};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// A running `kvmock`; killed when dropped.
pub struct Mock {
    child: Proc,
    /// Its HTTP port.
    pub port: u16,
}

impl Mock {
    /// Starts `kvmock --host 127.0.0.1 --port P ARGS...` and waits (at most 20 s) for `/health`.
    pub fn start(port: u16, args: &[&str]) -> Mock {
        let child = Command::new(env!("CARGO_BIN_EXE_kvmock"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvmock starts");
        let mut m = Mock {
            child: Proc(child),
            port,
        };
        eventually("kvmock is healthy", Duration::from_secs(20), || {
            if let Ok(Some(status)) = m.child.0.try_wait() {
                panic!("kvmock exited early: {status}");
            }
            matches!(try_http(port, "GET", "/health", None), Ok((200, _)))
        });
        m
    }

    /// POSTs JSON, returns (status, body).
    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        http(self.port, "POST", path, Some(body))
    }

    /// GETs a path, returns (status, body).
    pub fn get(&self, path: &str) -> (u16, String) {
        http(self.port, "GET", path, None)
    }

    /// A metric's value from `/metrics` (first series of that name).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing from:\n{text}"))
    }

    /// The process.
    pub fn child_mut(&mut self) -> &mut std::process::Child {
        &mut self.child.0
    }

    /// Kills the process now.
    pub fn stop(&mut self) {
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
    }
}

/// A current-thread runtime for the ZMQ sockets.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A SUB socket connected to `port` on 127.0.0.1, subscribed to everything.
pub async fn subscriber(port: u16) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        sub.connect(&format!("tcp://127.0.0.1:{port}")),
    )
    .await
    .expect("connect in time")
    .expect("connect");
    sub.subscribe("").await.unwrap();
    // Let the subscription reach the publisher (ZMQ's slow joiner).
    tokio::time::sleep(Duration::from_millis(300)).await;
    sub
}

/// The next published message's frames, within `secs`.
pub async fn next_msg(sub: &mut zeromq::SubSocket, secs: u64) -> Option<Vec<Bytes>> {
    match tokio::time::timeout(Duration::from_secs(secs), sub.recv()).await {
        Ok(Ok(m)) => Some(m.into_vec()),
        _ => None,
    }
}

/// Asks the replay socket at `port` for every batch from `start`: the (seq, payload) pairs
/// before the end marker.
pub async fn replay(port: u16, start: u64) -> Vec<(i64, Bytes)> {
    let mut d = zeromq::DealerSocket::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        d.connect(&format!("tcp://127.0.0.1:{port}")),
    )
    .await
    .expect("connect in time")
    .expect("connect");
    let mut m = ZmqMessage::from(Bytes::new());
    m.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    d.send(m).await.unwrap();
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), d.recv())
            .await
            .expect("replay answers in time")
            .unwrap()
            .into_vec();
        // [empty, seq, payload]
        assert_eq!(msg.len(), 3, "replay frames: {msg:?}");
        assert!(msg[0].is_empty());
        let seq = i64::from_be_bytes(msg[1].as_ref().try_into().unwrap());
        if seq == -1 {
            assert!(msg[2].is_empty(), "the end marker has an empty payload");
            return out;
        }
        out.push((seq, msg[2].clone()));
    }
}

/// `"prompt": [ids]` completions body.
pub fn completion_body(tokens: &[u32], max_tokens: usize, stream: bool) -> String {
    serde_json::json!({"prompt": tokens, "max_tokens": max_tokens, "stream": stream,
                       "stream_options": {"include_usage": true}, "ignore_eos": true})
    .to_string()
}
