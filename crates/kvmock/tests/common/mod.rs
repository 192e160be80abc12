//! Test support: free loopback ports, a `kvmock` process guard, a tiny blocking HTTP client,
//! and ZMQ helpers. Every wait has a timeout; every process started is killed on drop.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// A port free on 127.0.0.1 right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `kvmock`; killed when dropped.
pub struct Mock {
    child: Child,
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
        let mut m = Mock { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = m.child.try_wait() {
                panic!("kvmock exited early: {status}");
            }
            if let Ok((200, _)) = try_http(port, "GET", "/health", None) {
                return m;
            }
            assert!(Instant::now() < deadline, "kvmock did not become healthy");
            std::thread::sleep(Duration::from_millis(20));
        }
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

    /// Kills the process now.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A blocking HTTP/1.1 request with a 20 s timeout; panics on a transport error.
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    try_http(port, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn try_http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    s.set_write_timeout(Some(Duration::from_secs(20)))?;
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("no status"))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// The JSON payloads of an SSE body, `[DONE]` excluded; panics if `[DONE]` is missing.
pub fn sse_events(body: &str) -> Vec<serde_json::Value> {
    assert!(
        body.trim_end().ends_with("data: [DONE]"),
        "no [DONE]: {body}"
    );
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
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
