//! The router under faults and overload, with real processes on loopback: an engine killed
//! under 200 streams (every answer moves and completes), an engine that flaps for 30 s (its
//! breaker opens and closes, no client sees an error), overload at five times capacity (429s,
//! every accepted request completes, memory stays bounded), and sessions that stay on their
//! worker until it drains, then move once.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{eventually, Engine, Kvrouter};
use kvtest::net::{free_port, http, request, Reply};
use serde_json::{json, Value};

/// A system prompt every request shares, so that the router has hits to keep.
const SYSTEM: &str = "You are a helpful assistant who answers briefly and precisely. ";

/// Request `i`: a streamed completion of `max_tokens` tokens, or (every fourth) a chat; half
/// of them ask for usage.
fn streamed(i: usize, max_tokens: u64) -> (&'static str, String, bool) {
    let usage = i.is_multiple_of(2);
    if i % 4 == 3 {
        let body = json!({"messages": [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": format!("Question {i}?")}],
                          "max_tokens": max_tokens, "stream": true, "ignore_eos": true,
                          "stream_options": {"include_usage": usage}});
        ("/v1/chat/completions", body.to_string(), true)
    } else {
        let body = json!({"prompt": format!("{SYSTEM}Request {i}:"), "max_tokens": max_tokens,
                          "stream": true, "ignore_eos": true,
                          "stream_options": {"include_usage": usage}});
        ("/v1/completions", body.to_string(), false)
    }
}

/// Checks a streamed answer as a client would: 200, exactly `max_tokens` token chunks, one
/// id, one finish_reason, one `[DONE]` at the end, and usage (when asked) counting them.
fn check_stream(r: &Reply, max_tokens: u64, chat: bool) -> Result<(), String> {
    let fail = |what: &str| Err(format!("{what}: {} {}", r.status, r.body));
    if r.status != 200 {
        return fail("not 200");
    }
    if r.body.matches("data: [DONE]").count() != 1 || !r.body.trim_end().ends_with("data: [DONE]") {
        return fail("not one [DONE] at the end");
    }
    let (mut tokens, mut finishes, mut ids, mut usage) = (0, 0, Vec::new(), None);
    for data in r
        .body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
    {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if v.get("error").is_some() {
            return fail("an error event");
        }
        if !ids.contains(&v["id"]) {
            ids.push(v["id"].clone());
        }
        if !v["usage"].is_null() {
            usage = Some(v["usage"]["completion_tokens"].as_u64());
        }
        let Some(c) = v["choices"].get(0) else {
            continue;
        };
        if !c["finish_reason"].is_null() {
            finishes += 1;
        }
        let text = if chat {
            c["delta"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        // The opening role chunk of a chat is no token.
        if text.is_some_and(|t| !t.is_empty()) {
            tokens += 1;
        }
    }
    if tokens != max_tokens {
        return fail(&format!("{tokens} tokens, not {max_tokens}"));
    }
    if finishes != 1 || ids.len() != 1 {
        return fail(&format!("{finishes} finishes, ids {ids:?}"));
    }
    if usage.is_some_and(|u| u != Some(max_tokens)) {
        return fail(&format!("usage says {usage:?}"));
    }
    Ok(())
}

fn post_stream(port: u16, i: usize, max_tokens: u64) -> Result<(), String> {
    let (path, body, chat) = streamed(i, max_tokens);
    let r = request(port, "POST", path, "", &body);
    check_stream(&r, max_tokens, chat)
}

/// Clients sending streamed requests back to back until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<(usize, Vec<String>)>>,
}

impl Load {
    fn start(port: u16, clients: usize, max_tokens: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..clients)
            .map(|t| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let (mut sent, mut errors) = (0, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        if let Err(e) = post_stream(port, t + clients * sent, max_tokens) {
                            errors.push(e);
                        }
                        sent += 1;
                    }
                    (sent, errors)
                })
            })
            .collect();
        Load { stop, threads }
    }

    /// Stops the clients: the requests they sent, and the errors they saw.
    fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = (0, Vec::new());
        for t in self.threads {
            let (sent, errors) = t.join().unwrap();
            all.0 += sent;
            all.1.extend(errors);
        }
        all
    }
}

/// An engine's vLLM metric, summed over its series (0 when absent).
fn engine_metric(engine: &Engine, name: &str) -> f64 {
    let (_, metrics) = http(engine.port, "GET", "/metrics", None);
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn two_hundred_streams_survive_an_engine_killed_mid_stream() {
    let slow = || Engine::start_with(free_port(), free_port(), free_port(), &["--speedup", "1"]);
    let (mut a, b, c) = (slow(), slow(), slow());
    let router = Kvrouter::start(&[&a, &b, &c], &["--router-tokenizer-path", "builtin:bytes"]);
    let port = router.port;
    let clients: Vec<_> = (0..200)
        .map(|i| {
            std::thread::spawn(move || {
                let (path, body, chat) = streamed(i, 48);
                let r = request(port, "POST", path, "", &body);
                check_stream(&r, 48, chat).map(|()| r.body)
            })
        })
        .collect();
    // Mid-stream: ten of its answers have begun.
    eventually("engine a is streaming", Duration::from_secs(30), || {
        engine_metric(&a, "vllm:time_to_first_token_seconds_count") >= 10.0
    });
    let _ = a.proc.0.kill();
    let _ = a.proc.0.wait();
    let results: Vec<Result<String, String>> =
        clients.into_iter().map(|c| c.join().unwrap()).collect();
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    let replies: Vec<&String> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert!(
        errors.is_empty(),
        "{} clients saw errors: {errors:#?}",
        errors.len()
    );
    let moved = router.metric("kvrouter_migrations_total");
    assert!(moved >= 1.0);
    assert_eq!(router.metric("kvrouter_migrations_failed_total"), 0.0);
    // Each moved answer named its new worker in an SSE comment, never engine a.
    let notes: Vec<String> = replies
        .iter()
        .flat_map(|b| {
            b.lines()
                .filter_map(|l| l.strip_prefix(": x-kvkit-worker "))
                .map(str::to_string)
        })
        .collect();
    assert_eq!(notes.len() as f64, moved);
    assert!(!notes.contains(&a.name()), "{notes:?}");
}

#[test]
fn a_flapping_engine_opens_and_closes_its_breaker_and_no_client_sees_an_error() {
    let fast =
        |port, events, replay| Engine::start_with(port, events, replay, &["--speedup", "10"]);
    let (pa, ea, ra) = (free_port(), free_port(), free_port());
    let a = Arc::new(Mutex::new(Some(fast(pa, ea, ra))));
    let (b, c) = (
        fast(free_port(), free_port(), free_port()),
        fast(free_port(), free_port(), free_port()),
    );
    let workers = [
        a.lock().unwrap().as_ref().unwrap().spec(),
        b.spec(),
        c.spec(),
    ];
    let router = Kvrouter::start_at(
        free_port(),
        &workers,
        &[
            "--router-tokenizer-path",
            "builtin:bytes",
            "--breaker-failures",
            "2",
            "--breaker-cooldown-s",
            "1",
        ],
    );
    router.wait_subscribed();
    let port = router.port;
    let load = Load::start(port, 6, 24);
    let name = format!("127.0.0.1:{pa}");
    let served = |router: &Kvrouter| {
        router
            .routed()
            .into_iter()
            .find(|(w, _)| *w == name)
            .map_or(0, |(_, n)| n)
    };
    // Killed and restarted for 30 s, each time as soon as the router gives the restarted
    // engine requests again (about every 2 s: its revival, then the breaker's 1 s cooldown).
    let started = Instant::now();
    let mut kills = 0;
    while started.elapsed() < Duration::from_secs(30) {
        let before = served(&router);
        eventually("engine a serves again", Duration::from_secs(20), || {
            served(&router) >= before + 3
        });
        if let Some(mut engine) = a.lock().unwrap().take() {
            let _ = engine.proc.0.kill();
            let _ = engine.proc.0.wait();
        }
        kills += 1;
        *a.lock().unwrap() = Some(fast(pa, ea, ra));
    }
    eventually("a's breaker closes again", Duration::from_secs(20), || {
        router.metric("kvrouter_breaker_state") == 0.0 && served(&router) > 0
    });
    let (sent, errors) = load.stop();
    assert!(
        errors.is_empty(),
        "{} clients saw errors: {errors:#?}",
        errors.len()
    );
    assert!(kills >= 10, "{kills} kills");
    assert!(router.metric("kvrouter_breaker_opened_total") >= 1.0);
    assert!(sent > 100, "{sent} requests");
}

/// The router's resident memory, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .strip_suffix(" kB")?
                .parse()
                .ok()
        })
        .unwrap()
}

#[test]
fn overload_at_five_times_capacity_gets_429s_and_every_accepted_request_completes() {
    // Capacity: 8 places, each request about 0.3 s of engine time.
    let engine = Engine::start_with(
        free_port(),
        free_port(),
        free_port(),
        &["--speedup", "1", "--max-num-seqs", "8"],
    );
    let router = Kvrouter::start(
        &[&engine],
        &[
            "--router-tokenizer-path",
            "builtin:bytes",
            "--max-concurrency",
            "8",
            "--queue-timeout-ms",
            "200",
        ],
    );
    let port = router.port;
    for i in 0..16 {
        post_stream(port, i, 40).unwrap();
    }
    let before = rss_kib(router.pid());
    // Five times what the engine completes, open loop: 25 new requests each time it has
    // completed five more (its own counter is the clock), 500 in all.
    let completed = || engine_metric(&engine, "vllm:request_success_total");
    let mut done = completed();
    let mut clients = Vec::new();
    for i in 0..500 {
        if i > 0 && i % 25 == 0 {
            done += 5.0;
            eventually("five more completions", Duration::from_secs(30), || {
                completed() >= done
            });
        }
        clients.push(std::thread::spawn(move || {
            let (path, body, chat) = streamed(i, 40);
            let r = request(port, "POST", path, "", &body);
            if r.status == 429 {
                let retry = r.header("retry-after").map(str::to_string);
                let v: Value = serde_json::from_str(&r.body).map_err(|e| e.to_string())?;
                return match (retry, v["error"]["type"].as_str()) {
                    (Some(_), Some("RateLimitError")) => Ok(false),
                    other => Err(format!("a 429 without Retry-After or its error: {other:?}")),
                };
            }
            check_stream(&r, 40, chat).map(|()| true)
        }));
    }
    let results: Vec<Result<bool, String>> =
        clients.into_iter().map(|c| c.join().unwrap()).collect();
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let accepted = results.iter().filter(|r| r == &&Ok(true)).count();
    let refused = results.len() - accepted;
    assert!(
        accepted >= 50 && refused >= 100,
        "{accepted} accepted, {refused} refused"
    );
    assert_eq!(
        router.metric("kvrouter_rejected_busy_total"),
        refused as f64
    );
    eventually("the queue empties", Duration::from_secs(10), || {
        router.metric("kvrouter_queue_depth") == 0.0
    });
    let after = rss_kib(router.pid());
    assert!(
        after < before + 64 * 1024,
        "RSS grew from {before} to {after} KiB"
    );
}

#[test]
fn sessions_stay_on_their_worker_until_it_drains_then_move_once() {
    let engines: Vec<Engine> = (0..3).map(|_| Engine::start()).collect();
    let refs: Vec<&Engine> = engines.iter().collect();
    let router = Kvrouter::start(&refs, &["--router-tokenizer-path", "builtin:bytes"]);
    let port = router.port;
    // One turn of session `s`: its history so far as the prompt; the worker that served it.
    let turn = move |s: usize, history: &mut String| -> Result<String, String> {
        let body = json!({"prompt": history.clone(), "max_tokens": 8}).to_string();
        let r = request(
            port,
            "POST",
            "/v1/completions",
            &format!("x-session-id: chat-{s}\r\n"),
            &body,
        );
        if r.status != 200 {
            return Err(format!("{}: {}", r.status, r.body));
        }
        let v: Value = serde_json::from_str(&r.body).map_err(|e| e.to_string())?;
        history.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        history.push_str(" Next: ");
        r.header("x-kvkit-worker")
            .map(str::to_string)
            .ok_or_else(|| "no x-kvkit-worker".into())
    };
    let mut histories: Vec<String> = (0..20).map(|s| format!("{SYSTEM}Session {s}. ")).collect();
    let mut first: Vec<Vec<String>> = vec![Vec::new(); 20];
    for _ in 0..5 {
        for s in 0..20 {
            first[s].push(turn(s, &mut histories[s]).unwrap());
        }
    }
    for (s, w) in first.iter().enumerate() {
        assert!(w.iter().all(|x| *x == w[0]), "session {s} moved: {w:?}");
    }
    // Drain the worker with the most sessions, under load from other clients.
    let count = |name: &str| first.iter().filter(|w| w[0] == name).count();
    let drained = engines
        .iter()
        .map(Engine::name)
        .max_by_key(|n| count(n))
        .unwrap();
    let load = Load::start(port, 4, 16);
    let (status, body) = router.post(&format!("/v1/admin/workers/{drained}/drain"), "");
    assert_eq!(status, 202, "{body}");
    eventually(
        "the drained worker is removed",
        Duration::from_secs(20),
        || router.routed().iter().all(|(w, _)| *w != drained),
    );
    let mut later: Vec<Vec<String>> = vec![Vec::new(); 20];
    for _ in 0..5 {
        for s in 0..20 {
            later[s].push(turn(s, &mut histories[s]).unwrap());
        }
    }
    let (_, errors) = load.stop();
    assert!(errors.is_empty(), "the drain failed requests: {errors:#?}");
    for s in 0..20 {
        let w = &later[s];
        assert!(
            w.iter().all(|x| *x == w[0]),
            "session {s} moved more than once: {w:?}"
        );
        if first[s][0] == drained {
            assert_ne!(w[0], drained);
        } else {
            assert_eq!(w[0], first[s][0], "session {s} moved without cause");
        }
    }
    assert_eq!(
        router.metric("kvrouter_session_moves_total"),
        count(&drained) as f64
    );
    assert_eq!(router.metric("kvrouter_sessions"), 20.0);
}

#[test]
fn hard_sessions_never_move_and_get_503_while_their_worker_is_out() {
    let engines: Vec<Engine> = (0..2).map(|_| Engine::start()).collect();
    let refs: Vec<&Engine> = engines.iter().collect();
    let router = Kvrouter::start(&refs, &["--session-affinity", "hard"]);
    let turn = |session: &str| {
        let body = json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}).to_string();
        request(
            router.port,
            "POST",
            "/v1/completions",
            &format!("x-session-id: {session}\r\n"),
            &body,
        )
    };
    let home = turn("a").header("x-kvkit-worker").unwrap().to_string();
    for _ in 0..4 {
        assert_eq!(turn("a").header("x-kvkit-worker"), Some(home.as_str()));
    }
    let (status, body) = router.post(&format!("/v1/admin/workers/{home}/drain"), "");
    assert_eq!(status, 202, "{body}");
    let r = turn("a");
    assert_eq!(r.status, 503, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "ServiceUnavailableError");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("hard"),
        "{v}"
    );
    // Another session goes to the worker left.
    let other = turn("b");
    assert_eq!(other.status, 200);
    assert_ne!(other.header("x-kvkit-worker"), Some(home.as_str()));
    assert_eq!(router.metric("kvrouter_session_moves_total"), 0.0);
}

#[test]
fn with_affinity_off_the_session_header_changes_nothing() {
    let engines: Vec<Engine> = (0..2).map(|_| Engine::start()).collect();
    let refs: Vec<&Engine> = engines.iter().collect();
    let router = Kvrouter::start(
        &refs,
        &[
            "--session-affinity",
            "off",
            "--router-policy",
            "round-robin",
        ],
    );
    let workers: Vec<String> = (0..4)
        .map(|_| {
            let body = json!({"prompt": [1, 2, 3], "max_tokens": 1}).to_string();
            let r = request(
                router.port,
                "POST",
                "/v1/completions",
                "x-session-id: s\r\n",
                &body,
            );
            r.header("x-kvkit-worker").unwrap().to_string()
        })
        .collect();
    assert_ne!(workers[0], workers[1], "{workers:?}");
    assert_eq!(router.metric("kvrouter_sessions"), 0.0);
}
