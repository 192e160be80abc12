//! `kvrouter` in front of two `kvmock` engines, all real processes on free loopback ports:
//! routing by the engines' KV events, streaming, the admin views and metrics, bad input, and an
//! engine that goes away. Every wait is bounded; every process is killed on drop.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{wait_healthy, Engine, Kvrouter, Proc};
use kvtest::net::{free_port, http, sse_events};
use serde_json::Value;

fn completion(tokens: &[u32], stream: bool) -> String {
    serde_json::json!({"model": "mock", "prompt": tokens, "max_tokens": 3, "stream": stream,
                       "ignore_eos": true})
    .to_string()
}

#[test]
fn routes_by_the_engines_events_and_streams_back() {
    let (a, b) = (Engine::start(), Engine::start());
    let server = Kvrouter::start(&[&a, &b], &[]);
    let prompt: Vec<u32> = (0..64).collect();

    let (status, body) = server.post("/v1/completions", &completion(&prompt, false));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    let first = server.routed_once();
    // The engine's KV events reach the router's mirror of the worker it chose.
    server.wait_blocks(&first, 4);
    assert_eq!(
        server.get_json(&format!("/v1/admin/cache-view/{first}")),
        serde_json::json!({"worker_id": first, "block_count": 4})
    );

    // The same prefix goes to the same worker, as 4 predicted hits; streaming passes through.
    let mut longer = prompt.clone();
    longer.extend(1000..1016);
    let (status, body) = server.post("/v1/completions", &completion(&longer, true));
    assert_eq!(status, 200, "{body}");
    let events = sse_events(&body);
    assert!(events.len() >= 3, "{body}");
    assert_eq!(
        server
            .routed()
            .into_iter()
            .find(|(w, _)| *w == first)
            .unwrap()
            .1,
        2
    );
    assert_eq!(server.metric("kvrouter_cache_hit_blocks_total"), 4.0);
    assert_eq!(server.metric("kvrouter_request_blocks_total"), 9.0);
    assert!(server.metric("kvrouter_kv_batches_applied_total") >= 1.0);
    // Every request's load was released when its response ended.
    let workers = server.get_json("/v1/admin/workers");
    for w in workers["workers"].as_array().unwrap() {
        assert_eq!(w["in_flight"], 0, "{w}");
        assert_eq!(w["state"], "up", "{w}");
    }
    // The union of the engines' models.
    let models = server.get_json("/v1/models");
    assert_eq!(models["data"][0]["id"], "mock", "{models}");
    let names = [a.name(), b.name()];
    assert!(names.contains(&first));

    // A cache salt keys the first block (as vLLM does): the salted prompt is not a hit.
    let salted = serde_json::json!({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-7"});
    let (status, body) = server.post("/v1/completions", &salted.to_string());
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.metric("kvrouter_cache_hit_blocks_total"), 4.0);
    assert_eq!(server.metric("kvrouter_request_blocks_total"), 13.0);
}

#[test]
fn bad_input_gets_openai_errors() {
    let a = Engine::start();
    let server = Kvrouter::start(&[&a], &["--max-body-bytes", "2000"]);
    let error = |(status, body): (u16, String)| {
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{status}: {body}"));
        (
            status,
            v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    };
    let (s, m) = error(server.post("/v1/completions", "{not json"));
    assert_eq!(s, 400);
    assert!(m.contains("invalid JSON"), "{m}");
    let (s, m) = error(server.post("/v1/completions", r#"{"prompt": "hello"}"#));
    assert_eq!(s, 400);
    assert!(m.contains("--router-tokenizer-path"), "{m}");
    let (s, m) = error(server.post("/v1/chat/completions", r#"{"messages": []}"#));
    assert_eq!(s, 400);
    assert!(m.contains("tokenizer"), "{m}");
    let (s, m) = error(server.post("/v1/completions", r#"{"max_tokens": 1}"#));
    assert_eq!(s, 400);
    assert!(m.contains("prompt"), "{m}");
    // The router reads what it routes on as vLLM does, and says which field is wrong.
    let (s, m) = error(server.post("/v1/completions", r#"{"prompt": [1, 2], "stream": "yes"}"#));
    assert_eq!(s, 400);
    assert_eq!(m, r#"stream: expected a boolean, got "yes""#);
    let (s, m) = error(server.post("/v1/completions", r#"{"prompt": [1, 2], "cache_salt": 7}"#));
    assert_eq!(s, 400);
    assert!(
        m.starts_with("cache_salt: expected a non-empty string"),
        "{m}"
    );
    let big: Vec<u32> = (0..2000).collect();
    let (s, m) = error(server.post("/v1/completions", &completion(&big, false)));
    assert_eq!(s, 413);
    assert!(m.contains("--max-body-bytes"), "{m}");
    let (s, _) = http(server.port, "GET", "/v1/admin/cache-view/nobody:1", None);
    assert_eq!(s, 404);
    // Unknown paths and methods are OpenAI-shaped errors too.
    let (s, m) = error(http(server.port, "GET", "/v1/embeddings", None));
    assert_eq!(s, 404);
    assert!(m.contains("/v1/embeddings"), "{m}");
    let (s, m) = error(http(server.port, "GET", "/v1/completions", None));
    assert_eq!(s, 405);
    assert!(m.contains("GET"), "{m}");
    // The engine's own errors come back as they are.
    let (s, body) = server.post(
        "/v1/completions",
        &completion(&[], false)
            .replace("[]", "[1]")
            .replace("\"max_tokens\":3", "\"max_tokens\":0"),
    );
    assert_eq!(s, 400, "{body}");
    // And good requests still work.
    let (s, body) = server.post("/v1/completions", &completion(&[1, 2, 3], false));
    assert_eq!(s, 200, "{body}");
}

#[test]
fn a_worker_that_goes_away_is_skipped_and_its_requests_go_elsewhere() {
    let (mut a, b) = (Engine::start(), Engine::start());
    let server = Kvrouter::start(&[&a, &b], &["--router-policy", "round-robin"]);
    let prompt: Vec<u32> = (0..32).collect();
    for _ in 0..2 {
        let (status, body) = server.post("/v1/completions", &completion(&prompt, false));
        assert_eq!(status, 200, "{body}");
    }
    // Engine a stops; every later request is served by b.
    let _ = a.proc.0.kill();
    let _ = a.proc.0.wait();
    for _ in 0..4 {
        let (status, body) = server.post("/v1/completions", &completion(&prompt, false));
        assert_eq!(status, 200, "{body}");
    }
    let workers = server.get_json("/v1/admin/workers");
    let state = |name: &str| {
        workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["worker_id"] == name)
            .cloned()
            .unwrap()
    };
    assert_eq!(state(&a.name())["state"], "down", "{workers}");
    assert_eq!(state(&b.name())["state"], "up", "{workers}");
    assert_eq!(state(&b.name())["routed"], 5, "{workers}");
    assert!(
        server.metric(&format!(
            "kvrouter_upstream_errors_total{{worker=\"{}\"}}",
            a.name()
        )) >= 1.0
    );
    // Nothing left in flight anywhere.
    for w in workers["workers"].as_array().unwrap() {
        assert_eq!(w["in_flight"], 0, "{w}");
    }

    // The engine comes back on the same ports: it is routed to again, and its new events
    // (a restarted publisher) reach the router.
    let a = Engine::start_at(a.port, a.events, a.replay);
    common::eventually("the engine is back up", Duration::from_secs(10), || {
        server.get_json("/v1/admin/workers")["workers"][0]["state"] == "up"
    });
    for _ in 0..2 {
        let (status, body) = server.post("/v1/completions", &completion(&prompt, false));
        assert_eq!(status, 200, "{body}");
    }
    server.wait_blocks(&a.name(), 2);
}

#[test]
fn no_worker_is_503() {
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_healthy(port, &mut child, "kvrouter");
    let _guard = Proc(child);
    let (status, body) = http(
        port,
        "POST",
        "/v1/completions",
        Some(&completion(&[1, 2], false)),
    );
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"error\""), "{body}");
}

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["--worker", "127.0.0.1:30000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--worker") && err.contains("http://"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["--block-size", "0", "--port", &free_port().to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--block-size"));
    for (args, flag) in [
        (&["--busy-threshold", "decode=0.5"][..], "--busy-threshold"),
        (
            &["--busy-threshold", "decode=0,capacity=9"][..],
            "--busy-threshold",
        ),
        (&["--busy-threshold", "load=3"][..], "--busy-threshold"),
        (&["--router-temperature=-1"][..], "--router-temperature"),
        (&["--cost-model", "fast"][..], "--cost-model"),
        (
            &["--kv-event-transport", "kafka"][..],
            "expected zmq or nats",
        ),
        (&["--remote-load-ttl-s", "0"][..], "--remote-load-ttl-s"),
        (
            &["--lora-modules", r#"{"name":"a","path":"/p"}"#][..],
            "--lora-modules",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(args)
            .args(["--port", &free_port().to_string()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
    for (args, needle) in [
        (&["relay"][..], "--worker"),
        (
            &["relay", "--worker", "http://127.0.0.1:1"][..],
            "events=tcp://",
        ),
        (&["relay", "--worker", "127.0.0.1:1"][..], "http://"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// With every option of the routing model on, requests route, stream and release their load
/// (the prefill-aware cost's pending prefill moves to decode at the first streamed chunk).
#[test]
fn the_routing_model_options_route_and_release() {
    let (a, b) = (Engine::start(), Engine::start());
    let server = Kvrouter::start(
        &[&a, &b],
        &[
            "--cost-model",
            "prefill-aware",
            "--router-temperature",
            "0.5",
            "--busy-threshold",
            "decode=0.9,capacity=4096,prefill-tokens=65536",
            "--predicted-ttl-ms",
            "2000",
            "--tail-first-evictions",
        ],
    );
    let prompt: Vec<u32> = (0..64).collect();
    for stream in [false, true, true] {
        let (status, body) = server.post("/v1/completions", &completion(&prompt, stream));
        assert_eq!(status, 200, "{body}");
    }
    let routed: u64 = server.routed().iter().map(|(_, n)| n).sum();
    assert_eq!(routed, 3);
    let workers = server.get_json("/v1/admin/workers");
    for w in workers["workers"].as_array().unwrap() {
        assert_eq!(w["in_flight"], 0, "{w}");
    }
}

/// The engine's resident block count, from kvmock's `/metrics`.
fn engine_blocks(engine: &Engine) -> u64 {
    let (_, text) = http(engine.port, "GET", "/metrics", None);
    text.lines()
        .find(|l| l.starts_with("kvmock:cached_blocks"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("kvmock:cached_blocks missing from:\n{text}"))
}

/// Trusting the engine to evict tail first (`--tail-first-evictions`) keeps the router's
/// mirror exact under eviction pressure: after every request the mirror holds what the engine
/// holds, and the hits the router predicted for the next one are the ones the engine found.
/// Prompts share two prefixes at many lengths in a cache of 16 blocks, so from the third
/// request on every one evicts tails that other prompts' chains run through.
#[test]
fn trusted_tail_first_evictions_keep_the_router_exact() {
    let engine = Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--num-gpu-blocks", "16"],
    );
    let server = Kvrouter::start(&[&engine], &["--tail-first-evictions"]);
    let (mut predicted, mut resident) = (0.0, Vec::new());
    for k in 0..40u32 {
        // A prefix of 2..=9 blocks of one of two prompts, then 5..=37 tokens of its own (a new
        // block or more from the sixth request on): never a whole number of blocks, so the
        // engine may count every full block as cached.
        let prefix_blocks = 2 + (k * 3) % 8;
        let mut prompt: Vec<u32> = (0..prefix_blocks * 16)
            .map(|t| (k % 2) * 10_000 + t)
            .collect();
        prompt.extend((0..5 + (k % 3) * 16).map(|t| 100_000 + k * 100 + t));
        let body = serde_json::json!({"prompt": prompt, "max_tokens": 1, "ignore_eos": true});
        let (status, body) = server.post("/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_f64()
            .unwrap();
        let hits = server.metric("kvrouter_cache_hit_blocks_total");
        assert_eq!(
            hits - predicted,
            cached / 16.0,
            "request {k}: predicted hits"
        );
        predicted = hits;
        // Before the next request, the mirror catches up with the engine.
        common::eventually(
            &format!("the mirror catches up after request {k}"),
            Duration::from_secs(10),
            || server.block_count(&engine.name()) == engine_blocks(&engine),
        );
        resident.push(engine_blocks(&engine));
    }
    // Full from the third request on: every later one evicted as many blocks as it stored.
    let cap = *resident.iter().max().unwrap();
    assert!(
        cap <= 16 && resident[2..].iter().all(|&n| n == cap),
        "{resident:?}"
    );
}

#[test]
fn an_engine_killed_mid_stream_ends_the_response_and_releases_the_load() {
    let port = free_port();
    let (events, replay) = (free_port(), free_port());
    let mut a = Engine::start_with(port, events, replay, &["--speedup", "1"]);
    let server = Kvrouter::start(&[&a], &[]);
    let body = serde_json::json!({"prompt": [1, 2, 3, 4], "max_tokens": 5000, "stream": true,
                                  "ignore_eos": true})
    .to_string();
    let sport = server.port;
    let client = std::thread::spawn(move || http(sport, "POST", "/v1/completions", Some(&body)));
    // Wait until the stream is under way (the engine produced its first token), then kill the
    // engine.
    let engine_port = a.port;
    common::eventually("the first token is out", Duration::from_secs(10), || {
        let (_, metrics) = http(engine_port, "GET", "/metrics", None);
        metrics
            .lines()
            .any(|l| l.starts_with("vllm:time_to_first_token_seconds_count") && !l.ends_with(" 0"))
    });
    let _ = a.proc.0.kill();
    let _ = a.proc.0.wait();
    let (status, text) = client.join().unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("data: "), "some tokens arrived first: {text}");
    assert!(
        !text.contains("[DONE]"),
        "the stream cannot have finished: {text}"
    );
    // No other worker to continue the answer on.
    assert_eq!(server.metric("kvrouter_migrations_failed_total"), 1.0);
    let w = &server.get_json("/v1/admin/workers")["workers"][0];
    assert_eq!(
        (w["in_flight"].as_u64(), w["state"].as_str()),
        (Some(0), Some("down")),
        "{w}"
    );
    let (status, _) = server.post("/v1/completions", &completion(&[1, 2], false));
    assert_eq!(status, 503);
}

/// A worker that does not start its answer within --upstream-timeout-s gets the request a 504,
/// quickly; the server goes on serving.
#[test]
fn a_slow_worker_is_a_gateway_timeout() {
    // Real time: 2,000 tokens take over 14 s of 7 ms steps.
    let a = Engine::start_with(free_port(), free_port(), free_port(), &["--speedup", "1"]);
    let server = Kvrouter::start(&[&a], &["--upstream-timeout-s", "0.3"]);
    let slow = serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": true});
    let started = Instant::now();
    let (status, body) = server.post("/v1/completions", &slow.to_string());
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("--upstream-timeout-s"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let workers = server.get_json("/v1/admin/workers");
    assert_eq!(workers["workers"][0]["in_flight"], 0, "{workers}");
    assert_eq!(server.metric("kvrouter_upstream_errors_total"), 1.0);
    let (status, body) = server.post("/v1/completions", &completion(&[1, 2, 3], true));
    assert_eq!(status, 200, "{body}");
}
