//! KV events through a real `nats-server` with JetStream: `kvrouter relay` sidecars next to
//! `kvmock` engines, replicas that read the stream and share load, and restarts (a replica
//! killed with SIGKILL under load, a relay, the NATS server itself) that lose nothing. Each
//! test is ignored by default and needs `nats-server` (`.ci/run` installs it and runs them).

mod common;

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Engine, Kvrouter, Proc};
use kvtest::net::{free_port, http};
use serde_json::Value;

/// A `nats-server -js` on a free loopback port, storing JetStream in a temporary directory.
struct Nats {
    proc: Option<Proc>,
    port: u16,
    dir: tempfile::TempDir,
}

impl Nats {
    fn start() -> Nats {
        assert!(
            Command::new("nats-server")
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok(),
            "nats-server is not installed (Debian package nats-server)"
        );
        let mut n = Nats {
            proc: None,
            port: free_port(),
            dir: tempfile::tempdir().unwrap(),
        };
        n.restart();
        n
    }

    /// Starts (again) on the same port and store.
    fn restart(&mut self) {
        self.proc = None;
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("-sd")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts");
        self.proc = Some(Proc(child));
        wait_port(self.port, "nats-server");
    }

    fn stop(&mut self) {
        self.proc = None;
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

fn wait_port(port: u16, what: &str) {
    common::eventually(&format!("{what} listens"), Duration::from_secs(20), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
}

fn relay(engine: &Engine, nats: &Nats) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "relay",
            "--worker",
            &engine.spec(),
            "--nats-url",
            &nats.url(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the relay starts");
    // Let its subscription reach the publisher (ZMQ's slow joiner).
    std::thread::sleep(Duration::from_millis(500));
    Proc(child)
}

fn url(e: &Engine) -> String {
    format!("http://127.0.0.1:{}", e.port)
}

/// An engine whose cache of 40 blocks evicts, so removals flow too.
fn engine() -> Engine {
    Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--num-gpu-blocks", "40"],
    )
}

fn replica(port: u16, engines: &[&Engine], nats: &Nats, extra: &[&str]) -> Kvrouter {
    let workers: Vec<String> = engines.iter().map(|e| url(e)).collect();
    let mut args = vec!["--kv-event-transport", "nats", "--nats-url"];
    let u = nats.url();
    args.push(&u);
    args.extend_from_slice(extra);
    Kvrouter::start_at(port, &workers, &args)
}

/// Prompt `i` of 6 families: 3 shared blocks, then 2 of its own.
fn body(i: usize) -> String {
    let family = i % 6;
    let tokens: Vec<String> = (0..80)
        .map(|t| {
            if t < 48 {
                (family * 1000 + t).to_string()
            } else {
                (100_000 + i * 100 + t).to_string()
            }
        })
        .collect();
    format!(r#"{{"prompt": [{}], "max_tokens": 3}}"#, tokens.join(","))
}

fn send(k: &Kvrouter, i: usize) {
    let (status, text) = k.post("/v1/completions", &body(i));
    assert_eq!(status, 200, "{text}");
}

/// Each worker's (name, blocks in view, stale), sorted.
fn views(k: &Kvrouter) -> Vec<(String, u64, bool)> {
    let v = k.get_json("/v1/admin/workers");
    let mut out: Vec<(String, u64, bool)> = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["worker_id"].as_str().unwrap().to_string(),
                w["block_count"].as_u64().unwrap(),
                w["stale"].as_bool().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

fn positions(k: &Kvrouter) -> Vec<Value> {
    let v = k.get_json("/v1/admin/workers");
    let mut out: Vec<(String, Value)> = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["worker_id"].to_string(), w["position"].clone()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out.into_iter().map(|(_, p)| p).collect()
}

/// Waits (at most 15 s) until every server shows the reference's views, none stale.
fn wait_agree(reference: &Kvrouter, others: &[&Kvrouter]) {
    if let Err(e) = agree_within(reference, others, Duration::from_secs(15)) {
        panic!("{e}");
    }
}

/// Whether every server shows the reference's views, none stale, within `limit`.
fn agree_within(reference: &Kvrouter, others: &[&Kvrouter], limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let want = views(reference);
        let got: Vec<_> = others.iter().map(|k| views(k)).collect();
        if got.iter().all(|g| *g == want) && want.iter().all(|w| !w.2) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "views never agreed: reference {want:?}, others {got:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// After a restart, sends requests (from `first` on) until a batch that shows the gap reaches
/// the restarted part and the views agree: its ZMQ subscription takes a moment to join.
fn send_until_agree(reference: &Kvrouter, other: &Kvrouter, first: usize) {
    for i in first..first + 20 {
        send(reference, i);
        if agree_within(reference, &[other], Duration::from_secs(2)).is_ok() {
            return;
        }
    }
    wait_agree(reference, &[other]);
}

fn active_blocks(k: &Kvrouter) -> u64 {
    let v = k.get_json("/v1/admin/workers");
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["active_blocks"].as_u64().unwrap())
        .sum()
}

fn wait_until(what: &str, ok: impl FnMut() -> bool) {
    common::eventually(what, Duration::from_secs(10), ok);
}

#[test]
#[ignore = "needs nats-server (Debian package nats-server; .ci/run installs it)"]
fn replicas_on_jetstream_mirror_the_engines_and_share_load() {
    let nats = Nats::start();
    // At wall-clock speed, so that a long request is seen running.
    let slow = || Engine::start_with(free_port(), free_port(), free_port(), &["--speedup", "1"]);
    let (e0, e1) = (slow(), slow());
    let _relays = [relay(&e0, &nats), relay(&e1, &nats)];
    let sync = ["--router-replica-sync", "--replica-id"];
    let a = replica(free_port(), &[&e0, &e1], &nats, &[sync[0], sync[1], "1"]);
    let b = replica(free_port(), &[&e0, &e1], &nats, &[sync[0], sync[1], "2"]);
    // The reference reads the engines' ZMQ publishers directly, and shares no load.
    let zmq = Kvrouter::start(&[&e0, &e1], &[]);
    for i in 0..24 {
        send(if i % 2 == 0 { &a } else { &b }, i);
    }
    wait_agree(&zmq, &[&a, &b]);
    assert!(views(&zmq).iter().any(|v| v.1 > 0));
    assert_eq!(positions(&a), positions(&b), "same stream positions");
    assert_eq!(a.metric("kvrouter_kv_gaps_total"), 0.0);
    assert_eq!(b.metric("kvrouter_kv_batches_rejected_total"), 0.0);

    // A long request through a: b counts its blocks while it runs, the reference does not.
    let port = a.port;
    let long = std::thread::spawn(move || {
        let tokens: Vec<String> = (0..64).map(|t| (777_000 + t).to_string()).collect();
        let req = format!(r#"{{"prompt": [{}], "max_tokens": 300}}"#, tokens.join(","));
        http(port, "POST", "/v1/completions", Some(&req))
    });
    wait_until("b sees a's request", || active_blocks(&b) == 4);
    assert_eq!(active_blocks(&zmq), 0);
    assert!(b.metric("kvrouter_load_deltas_applied_total") >= 1.0);
    let (status, _) = long.join().unwrap();
    assert_eq!(status, 200);
    wait_until("b sees it finish", || active_blocks(&b) == 0);
}

#[test]
#[ignore = "needs nats-server (Debian package nats-server; .ci/run installs it)"]
fn a_replica_killed_under_load_catches_up_exactly() {
    let nats = Nats::start();
    let (e0, e1) = (engine(), engine());
    let _relays = [relay(&e0, &nats), relay(&e1, &nats)];
    let a = replica(free_port(), &[&e0, &e1], &nats, &[]);
    let b_port = free_port();
    let snap = ["--snapshot-every", "5"];
    let b = replica(b_port, &[&e0, &e1], &nats, &snap);
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, port) = (Arc::clone(&stop), a.port);
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let (status, text) = http(port, "POST", "/v1/completions", Some(&body(i)));
                assert_eq!(status, 200, "{text}");
                i += 1;
            }
            i
        })
    };
    // Long enough for b to store a snapshot (checked once a second).
    wait_until("b stores a snapshot", || {
        b.metric("kvrouter_snapshots_total") >= 1.0
    });
    let applied = |k: &Kvrouter| k.metric("kvrouter_kv_batches_applied_total");
    let at_kill = applied(&a);
    drop(b); // SIGKILL
             // The load goes on while b is down: batches it will have to catch up on.
    wait_until("a applies batches while b is down", || {
        applied(&a) >= at_kill + 10.0
    });
    let b = replica(b_port, &[&e0, &e1], &nats, &snap);
    let catch_up = b.metric("kvrouter_catch_up_seconds");
    assert_eq!(b.metric("kvrouter_snapshot_restored"), 1.0);
    // And on after b is back: batches it applies live.
    let at_restore = applied(&b);
    wait_until("b applies live batches", || {
        applied(&b) >= at_restore + 10.0
    });
    stop.store(true, Ordering::Relaxed);
    let sent = load.join().unwrap();
    assert!(sent > 20, "only {sent} requests under load");
    wait_agree(&a, &[&b]);
    assert_eq!(
        positions(&a),
        positions(&b),
        "no batch lost or applied twice"
    );
    assert_eq!(b.metric("kvrouter_kv_batches_rejected_total"), 0.0);
    assert_eq!(b.metric("kvrouter_kv_gaps_total"), 0.0);
    eprintln!("{sent} requests; the restarted replica caught up in {catch_up} s");
}

#[test]
#[ignore = "needs nats-server (Debian package nats-server; .ci/run installs it)"]
fn relay_and_nats_restarts_lose_nothing() {
    let mut nats = Nats::start();
    let e = engine();
    let mut relayed = relay(&e, &nats);
    let s = replica(free_port(), &[&e], &nats, &[]);
    let zmq = Kvrouter::start(&[&e], &[]);
    for i in 0..10 {
        send(&s, i);
    }
    wait_agree(&zmq, &[&s]);

    // The relay goes; the engine goes on publishing; a new relay fills the gap by replay when
    // the next batch shows it.
    drop(relayed);
    for i in 10..20 {
        send(&zmq, i);
    }
    relayed = relay(&e, &nats);
    send_until_agree(&zmq, &s, 100);

    // NATS goes (JetStream is on disk); the relay retries until it is back.
    nats.stop();
    for i in 21..30 {
        send(&zmq, i);
    }
    nats.restart();
    send_until_agree(&zmq, &s, 200);
    assert_eq!(s.metric("kvrouter_kv_gaps_total"), 0.0);
    assert_eq!(s.metric("kvrouter_kv_batches_rejected_total"), 0.0);
    drop(relayed);
}

/// A snapshot that does not read costs time, not state: the replica logs it, replays the stream
/// from its start, and mirrors what a replica reading ZMQ directly mirrors.
#[test]
#[ignore = "needs nats-server (Debian package nats-server; .ci/run installs it)"]
fn an_unreadable_snapshot_falls_back_to_the_whole_stream() {
    let nats = Nats::start();
    let e = engine();
    let _relayed = relay(&e, &nats);
    let zmq = Kvrouter::start(&[&e], &[]);
    for i in 0..8 {
        send(&zmq, i);
    }
    let url = nats.url();
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let client = async_nats::connect(url.as_str()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let store = js
            .create_object_store(async_nats::jetstream::object_store::Config {
                bucket: kvrouter::nats::SNAPSHOT_BUCKET.to_string(),
                ..Default::default()
            })
            .await
            .unwrap();
        store
            .put("mirror", &mut &b"{not a snapshot"[..])
            .await
            .unwrap();
    });
    let s = replica(free_port(), &[&e], &nats, &[]);
    wait_agree(&zmq, &[&s]);
    assert_eq!(s.metric("kvrouter_snapshot_restored"), 0.0);
    assert!(views(&s)[0].1 > 0);
}

/// A batch stored twice (a relay that retried after JetStream's de-duplication window) is
/// dropped, not taken for a publisher restart that would wipe the mirror.
#[test]
#[ignore = "needs nats-server (Debian package nats-server; .ci/run installs it)"]
fn a_batch_stored_twice_is_dropped() {
    let nats = Nats::start();
    let e = engine();
    let _relayed = relay(&e, &nats);
    let s = replica(free_port(), &[&e], &nats, &[]);
    let zmq = Kvrouter::start(&[&e], &[]);
    for i in 0..6 {
        send(&zmq, i);
    }
    wait_agree(&zmq, &[&s]);
    let url = nats.url();
    let subject = kvrouter::nats::subject_of(&e.name());
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let client = async_nats::connect(url.as_str()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(kvrouter::nats::STREAM).await.unwrap();
        let mut first = stream.get_raw_message(1).await.unwrap();
        first.headers.insert("Nats-Msg-Id", "a retry long after");
        js.publish_with_headers(subject, first.headers, first.payload)
            .await
            .unwrap()
            .await
            .unwrap();
    });
    wait_until("the duplicate is seen", || {
        s.metric("kvrouter_kv_batches_rejected_total") == 1.0
    });
    assert_eq!(s.metric("kvrouter_kv_restarts_total"), 0.0);
    wait_agree(&zmq, &[&s]);
}

#[test]
#[ignore = "needs nats-server (Debian package nats-server; .ci/run installs it)"]
fn replicas_share_sessions() {
    let nats = Nats::start();
    let engines: Vec<Engine> = (0..3).map(|_| engine()).collect();
    let refs: Vec<&Engine> = engines.iter().collect();
    // Round robin: without the shared session, b's turns would go round the engines.
    let url = nats.url();
    let flags = |id| {
        [
            "--router-replica-sync",
            "--replica-id",
            id,
            "--router-policy",
            "round-robin",
            "--nats-url",
            &url,
        ]
    };
    let a = Kvrouter::start(&refs, &flags("1"));
    let b = Kvrouter::start(&refs, &flags("2"));
    let turn = |k: &Kvrouter| {
        let body = r#"{"prompt": [1, 2, 3, 4], "max_tokens": 2}"#;
        let r = kvtest::net::request(
            k.port,
            "POST",
            "/v1/completions",
            "x-session-id: agent-7\r\n",
            body,
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.header("x-kvkit-worker").unwrap().to_string()
    };
    let home = turn(&a);
    wait_until("b knows the session", || {
        b.metric("kvrouter_sessions") == 1.0
    });
    for _ in 0..4 {
        assert_eq!(turn(&b), home);
    }
    assert_eq!(turn(&a), home);
}
