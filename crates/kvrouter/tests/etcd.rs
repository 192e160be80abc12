//! etcd discovery with a real `etcd` (Debian's `etcd-server`) on free loopback ports and a
//! temporary data directory: engines that register appear, an engine that stops goes when its
//! lease lapses, and one at another block size is refused. Ignored by default: it needs `etcd`, which `.ci/run` installs.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Engine, Kvrouter, Proc};
use kvtest::net::{free_port, try_http};
use serde_json::Value;

fn etcd_present() -> bool {
    Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn start_etcd(dir: &std::path::Path) -> (Proc, u16) {
    let (client, peer) = (free_port(), free_port());
    let c = format!("http://127.0.0.1:{client}");
    let p = format!("http://127.0.0.1:{peer}");
    let child = Command::new("etcd")
        .args(["--name", "t", "--data-dir"])
        .arg(dir)
        .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
        .args([
            "--listen-peer-urls",
            &p,
            "--initial-advertise-peer-urls",
            &p,
        ])
        .args(["--initial-cluster", &format!("t={p}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd starts");
    let proc = Proc(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, body)) = try_http(client, "GET", "/health", None) {
            if body.contains("true") {
                return (proc, client);
            }
        }
        assert!(Instant::now() < deadline, "etcd did not become healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn names(server: &Kvrouter) -> Vec<String> {
    let v: Value = server.get_json("/v1/admin/workers");
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["worker_id"].as_str().unwrap().to_string())
        .collect()
}

fn wait_for(what: &str, secs: u64, ok: impl FnMut() -> bool) {
    common::eventually(what, Duration::from_secs(secs), ok);
}

#[test]
#[ignore = "needs etcd (Debian package etcd-server; .ci/run installs it)"]
fn workers_come_and_go_through_etcd() {
    assert!(
        etcd_present(),
        "no `etcd` binary (Debian package etcd-server)"
    );
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, port) = start_etcd(dir.path());
    let etcd = format!("127.0.0.1:{port}");
    let server = Kvrouter::start(
        &[],
        &["--discovery-backend", "etcd", "--etcd-endpoint", &etcd],
    );
    let reg = ["--etcd-endpoint", etcd.as_str()];
    let mut a = Engine::start_with(free_port(), free_port(), free_port(), &reg);
    let b = Engine::start_with(free_port(), free_port(), free_port(), &reg);
    // An engine at another block size registers too, and is refused.
    let odd_args = ["--etcd-endpoint", etcd.as_str(), "--block-size", "32"];
    let odd = Engine::start_with(free_port(), free_port(), free_port(), &odd_args);
    wait_for("both engines to join", 10, || names(&server).len() == 2);
    let mut got = names(&server);
    got.sort();
    let mut want = vec![a.name(), b.name()];
    want.sort();
    assert_eq!(got, want);
    assert!(!names(&server).contains(&odd.name()));

    // Requests are routed to them, and their events reach the mirror.
    let body =
        r#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], "max_tokens": 2}"#;
    let (status, text) = server.post("/v1/completions", body);
    assert_eq!(status, 200, "{text}");
    wait_for("the stored block in a mirror", 10, || {
        server.block_count(&a.name()) + server.block_count(&b.name()) >= 1
    });

    // a stops: its lease lapses and it leaves.
    let _ = a.proc.0.kill();
    let _ = a.proc.0.wait();
    wait_for("the stopped engine to leave", 15, || {
        names(&server) == vec![b.name()]
    });
    let (status, text) = server.post("/v1/completions", body);
    assert_eq!(status, 200, "{text}");
}
