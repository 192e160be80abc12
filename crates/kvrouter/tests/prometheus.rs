//! A real Prometheus scrapes the router and two engines under traffic: every metric family they
//! export is stored and queryable, and every PromQL expression of the shipped Grafana dashboard
//! (`deploy/grafana/kvkit.json`) parses and returns data.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{eventually, Engine, Kvrouter, Proc};
use kvtest::net::{free_port, http, try_http};
use serde_json::Value;

/// `s` percent-encoded for a query string.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus's answer to an instant query: its `data.result`, or the error it gave.
fn query(port: u16, promql: &str) -> Result<Vec<Value>, String> {
    let (status, body) = http(
        port,
        "GET",
        &format!("/api/v1/query?query={}", encode(promql)),
        None,
    );
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    if status != 200 || v["status"] != "success" {
        return Err(format!("{promql}: {status} {body}"));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// The metric families `/metrics` on `port` declares, with the series name to query for each
/// (a histogram's `_count`).
fn families(port: u16) -> Vec<String> {
    let (_, text) = http(port, "GET", "/metrics", None);
    let declared: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .collect();
    let mut once = declared.clone();
    once.sort();
    once.dedup();
    assert_eq!(
        once.len(),
        declared.len(),
        "a family declared twice:\n{text}"
    );
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut it = l.split(' ');
            let (name, kind) = (it.next().unwrap(), it.next().unwrap_or(""));
            match kind {
                "histogram" => format!("{name}_count"),
                _ => name.to_string(),
            }
        })
        .collect()
}

fn dashboard_expressions() -> Vec<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/kvkit.json"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let exprs: Vec<String> = v["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");
    exprs
}

#[test]
#[ignore = "needs prometheus (Debian package prometheus; .ci/run installs it)"]
fn a_real_prometheus_stores_every_family_and_the_dashboard_has_data() {
    let (e0, e1) = (Engine::start(), Engine::start());
    let router = Kvrouter::start(&[&e0, &e1], &[]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    let target = |p: u16| format!("'127.0.0.1:{p}'");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  \
             - job_name: kvrouter\n    static_configs:\n      - targets: [{}]\n  \
             - job_name: engines\n    static_configs:\n      - targets: [{}, {}]\n",
            target(router.port),
            target(e0.port),
            target(e1.port)
        ),
    )
    .unwrap();
    let port = free_port();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prometheus starts (Debian package prometheus)");
    let _prometheus = Proc(child);
    eventually("prometheus is ready", Duration::from_secs(30), || {
        matches!(try_http(port, "GET", "/-/ready", None), Ok((200, _)))
    });

    // Traffic: a few prompts, each sent several times, so that hits, tokens and events flow.
    for i in 0..24u32 {
        let prompt: Vec<String> = (0..48).map(|t| (1_000 * (i % 4) + t).to_string()).collect();
        let body = format!(r#"{{"prompt": [{}], "max_tokens": 4}}"#, prompt.join(","));
        let (status, text) = router.post("/v1/completions", &body);
        assert_eq!(status, 200, "{text}");
    }
    eventually("all three targets are up", Duration::from_secs(30), || {
        query(port, "up == 1").is_ok_and(|r| r.len() == 3)
    });

    let mut wanted = families(router.port);
    wanted.extend(families(e0.port));
    wanted.sort();
    wanted.dedup();
    assert!(wanted.len() >= 20, "{wanted:?}");
    for name in &wanted {
        eventually(
            &format!("{name} is stored"),
            Duration::from_secs(30),
            || query(port, name).is_ok_and(|r| !r.is_empty()),
        );
    }
    // The traffic reached the engines through the router, and Prometheus saw it.
    let routed = query(port, "sum(kvrouter_requests_routed_total)").unwrap();
    assert_eq!(routed[0]["value"][1], "24");

    for expr in dashboard_expressions() {
        // A rate needs two scrapes in its window: wait for data, but a parse error fails now.
        eventually(
            &format!("{expr} returns data"),
            Duration::from_secs(30),
            || match query(port, &expr) {
                Ok(r) => !r.is_empty(),
                Err(e) => panic!("{e}"),
            },
        );
    }
}
