//! Loopback networking for integration tests: free ports and a minimal blocking HTTP/1.1
//! client (with chunked bodies and server-sent events), every wait bounded.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// A port free on 127.0.0.1 right now, and never one this process was given before (the OS
/// may hand the same free port out twice in a row, and a test takes several before binding any).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A blocking HTTP/1.1 request with a 20 s timeout; panics on a transport error.
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    try_http(port, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// [`http`] that returns a transport error instead of panicking.
pub fn try_http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    try_request(port, method, path, "", body.unwrap_or("")).map(|r| (r.status, r.body))
}

/// An HTTP answer: its status, its head (status line and headers, lower-cased) and its body
/// (de-chunked).
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The status line and headers, lower-cased, `\r\n` between lines.
    pub head: String,
    /// The body as text.
    pub body: String,
}

impl Reply {
    /// A header's value (`name` lower-case), if the answer has it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k == name).then(|| v.trim())
        })
    }
}

/// A blocking HTTP/1.1 request with extra header lines (`"name: value\r\n"` each) and a JSON
/// body; panics on a transport error. 60 s timeout.
pub fn request(port: u16, method: &str, path: &str, headers: &str, body: &str) -> Reply {
    try_request(port, method, path, headers, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn try_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> std::io::Result<Reply> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.set_write_timeout(Some(Duration::from_secs(20)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         {headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
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
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Ok(Reply { status, head, body })
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

/// A child process killed (and reaped) when dropped: every test's one process guard.
#[derive(Debug)]
pub struct Proc(pub std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `ready` every 10 ms until it holds, for at most `limit`; panics naming `what` when it
/// never does. Tests wait on a readiness signal with it, never on a fixed sleep.
///
/// ```
/// let start = std::time::Instant::now();
/// kvtest::net::eventually("a millisecond passes", std::time::Duration::from_secs(1), || {
///     start.elapsed().as_millis() >= 1
/// });
/// ```
pub fn eventually(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A minimal OTLP/HTTP receiver for tests (no collector ships in Debian): it answers every
/// `POST` with `200 {}` and keeps each body, for a process exporting traces in JSON
/// (`--otlp-traces-endpoint`). Its thread ends with the test process.
#[derive(Debug, Clone)]
pub struct OtlpReceiver {
    port: u16,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl OtlpReceiver {
    /// Listens on a free loopback port.
    pub fn start() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = std::sync::Arc::clone(&bodies);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let kept = std::sync::Arc::clone(&kept);
                std::thread::spawn(move || serve_otlp(conn, &kept));
            }
        });
        OtlpReceiver { port, bodies }
    }

    /// The traces URL to export to.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/v1/traces", self.port)
    }

    /// Every body received so far (OTLP/JSON `ExportTraceServiceRequest`s: `resourceSpans`).
    pub fn bodies(&self) -> Vec<String> {
        self.bodies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every span received so far, flattened out of its resource and scope.
    pub fn spans(&self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        for body in self.bodies() {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            for rs in v["resourceSpans"].as_array().into_iter().flatten() {
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    out.extend(ss["spans"].as_array().into_iter().flatten().cloned());
                }
            }
        }
        out
    }
}

/// Serves one keep-alive connection: each request's body is kept and answered `200 {}`.
fn serve_otlp(mut conn: TcpStream, kept: &std::sync::Mutex<Vec<String>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < end + 4 + len {
            match conn.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
        buf.drain(..end + 4 + len);
        kept.lock().unwrap_or_else(|e| e.into_inner()).push(body);
        let ok = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
        if conn.write_all(ok.as_bytes()).is_err() {
            return;
        }
    }
}
