//! Test support: `kvmock` and `kvrouter` processes on free loopback ports, killed on drop, and
//! the server's admin views. Every wait is bounded.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub use kvtest::net::{eventually, Proc};
use kvtest::net::{free_port, http, try_http};
use serde_json::Value;

/// The `kvmock` binary beside this test's (built by `cargo test --workspace`), else built now.
pub fn kvmock_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    let bin = dir.join(format!("kvmock{}", std::env::consts::EXE_SUFFIX));
    if !bin.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "kvmock", "--bin", "kvmock"])
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building kvmock failed");
    }
    bin
}

pub fn wait_healthy(port: u16, child: &mut Child, what: &str) {
    eventually(
        &format!("{what} is healthy"),
        Duration::from_secs(30),
        || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("{what} exited early: {status}");
            }
            matches!(try_http(port, "GET", "/health", None), Ok((200, _)))
        },
    );
}

pub struct Engine {
    pub proc: Proc,
    pub port: u16,
    pub events: u16,
    pub replay: u16,
}

impl Engine {
    pub fn start() -> Engine {
        Engine::start_at(free_port(), free_port(), free_port())
    }

    pub fn start_at(port: u16, events: u16, replay: u16) -> Engine {
        Engine::start_with(port, events, replay, &[])
    }

    /// An engine with extra kvmock flags.
    pub fn start_with(port: u16, events: u16, replay: u16, extra: &[&str]) -> Engine {
        let cfg = format!(
            r#"{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{events}", "replay_endpoint": "tcp://127.0.0.1:{replay}"}}"#
        );
        let mut child = Command::new(kvmock_bin())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--enable-kv-events", "--kv-events-config", &cfg])
            // Fast unless the caller chose a speed-up.
            .args(if extra.contains(&"--speedup") {
                &[][..]
            } else {
                &["--speedup", "100"][..]
            })
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvmock starts");
        wait_healthy(port, &mut child, "kvmock");
        Engine {
            proc: Proc(child),
            port,
            events,
            replay,
        }
    }

    pub fn name(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn spec(&self) -> String {
        format!(
            "http://127.0.0.1:{},events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{}",
            self.port, self.events, self.replay
        )
    }
}

pub struct Kvrouter {
    _proc: Proc,
    pub port: u16,
}

impl Kvrouter {
    pub fn start(engines: &[&Engine], extra: &[&str]) -> Kvrouter {
        let workers: Vec<String> = engines.iter().map(|e| e.spec()).collect();
        let k = Kvrouter::start_at(free_port(), &workers, extra);
        k.wait_subscribed();
        k
    }

    /// Waits until every worker whose ZMQ events the router follows shows `subscribed`
    /// (what `/v1/admin/workers` reports once the SUB socket is connected and subscribed).
    pub fn wait_subscribed(&self) {
        eventually(
            "every worker's events are subscribed",
            Duration::from_secs(20),
            || {
                let v = self.get_json("/v1/admin/workers");
                v["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|w| w["subscribed"].as_bool() != Some(false))
            },
        );
    }

    /// A server on `port` with these `--worker` values and flags, once it answers.
    pub fn start_at(port: u16, workers: &[String], extra: &[&str]) -> Kvrouter {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrouter"));
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
        for w in workers {
            cmd.args(["--worker", w]);
        }
        let mut child = cmd
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kvrouter starts");
        wait_healthy(port, &mut child, "kvrouter");
        Kvrouter {
            _proc: Proc(child),
            port,
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self._proc.0.id()
    }

    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        http(self.port, "POST", path, Some(body))
    }

    pub fn get_json(&self, path: &str) -> Value {
        let (status, body) = http(self.port, "GET", path, None);
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    /// The metric summed over its series (every label set).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = http(self.port, "GET", "/metrics", None);
        let values: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        assert!(!values.is_empty(), "metric {name} missing from:\n{text}");
        values.iter().sum()
    }

    pub fn block_count(&self, worker: &str) -> u64 {
        self.get_json(&format!("/v1/admin/cache-view/{worker}"))["block_count"]
            .as_u64()
            .unwrap()
    }

    /// Waits (at most 10 s) until the router's view of `worker` holds at least `n` blocks.
    pub fn wait_blocks(&self, worker: &str, n: u64) {
        eventually(
            &format!("{worker} shows {n} blocks"),
            Duration::from_secs(10),
            || self.block_count(worker) >= n,
        );
    }

    /// The worker that has served exactly one request (the first routed one).
    pub fn routed_once(&self) -> String {
        self.routed()
            .into_iter()
            .find(|(_, n)| *n == 1)
            .map(|(w, _)| w)
            .expect("a worker that served one request")
    }

    pub fn routed(&self) -> Vec<(String, u64)> {
        let v = self.get_json("/v1/admin/workers");
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                (
                    w["worker_id"].as_str().unwrap().to_string(),
                    w["routed"].as_u64().unwrap(),
                )
            })
            .collect()
    }
}
