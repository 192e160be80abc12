//! `kvload`: replays a request stream against an OpenAI-compatible endpoint and measures it.
//!
//! - Prompts come from [`kvsim::workload_requests`]: the synthetic pool's own tokens, or a
//!   trace's hash ids, each id standing for a block of tokens that is a seeded function of the id
//!   (equal ids, equal blocks). Token ids are reduced modulo `--vocab-size` so that any model
//!   accepts them.
//! - `completions` sends the token ids as the prompt; `chat` sends them as text, one word per
//!   token, in one user message.
//! - Open loop: each request is sent at its arrival time (from the start of the run); with a
//!   concurrency cap it waits for a free slot and its latencies count from when it was sent.
//! - Every request streams (`stream_options.include_usage`), so TTFT is the first streamed
//!   token, ITL the gaps between token chunks, and the cached tokens come from `usage`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvsim::{MeasuredRequest, PromptContent, WorkloadRequest};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::error::MockError;

/// Which API the prompts go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Api {
    /// `POST /v1/completions` with token ids.
    #[default]
    Completions,
    /// `POST /v1/chat/completions` with text.
    Chat,
}

impl std::str::FromStr for Api {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "completions" => Ok(Api::Completions),
            "chat" => Ok(Api::Chat),
            _ => Err(format!("expected completions or chat, got {s:?}")),
        }
    }
}

/// How to send.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// `http://HOST:PORT`, one or more: request `i` goes to `endpoints[i % len]` (router
    /// replicas behind no load balancer). Empty is an error of [`run`]'s requests.
    pub endpoints: Vec<String>,
    /// The model to name in requests.
    pub model: String,
    /// Which API.
    pub api: Api,
    /// In-flight requests at most (`None`: open loop).
    pub max_concurrency: Option<usize>,
    /// Token ids are reduced modulo this.
    pub vocab_size: u32,
    /// Seed of the tokens that stand for trace ids.
    pub seed: u64,
    /// A request taking longer than this fails.
    pub timeout: Duration,
    /// Requests go out this many times faster than their arrival times, and measured times
    /// are multiplied by it (emulated time of a `kvmock --speedup X`).
    pub speedup: f64,
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// One per request, in the stream's order.
    pub requests: Vec<MeasuredRequest>,
    /// Every inter-token gap, microseconds.
    pub itl_us: Vec<u64>,
    /// Failed requests by reason (e.g. `HTTP 400`, `timeout`), sorted.
    pub errors: Vec<(String, usize)>,
    /// Wall time from the first send to the last response.
    pub wall_s: f64,
    /// How late each request was sent after its (scaled) arrival time, microseconds of
    /// emulated time: the open loop's own error (a concurrency cap adds its waits here).
    pub send_lag_us: Vec<u64>,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(conn)
}

/// The token ids of a request's prompt.
pub fn prompt_tokens(req: &WorkloadRequest, index: usize, seed: u64, vocab: u32) -> Vec<u32> {
    let vocab = u64::from(vocab.max(1));
    let mix = |a: u64, b: u64| {
        xxhash_rust::xxh3::xxh3_64_with_seed(&[a.to_le_bytes(), b.to_le_bytes()].concat(), seed)
    };
    match &req.content {
        PromptContent::Tokens(t) => t.iter().map(|&x| (u64::from(x) % vocab) as u32).collect(),
        PromptContent::TraceIds {
            ids,
            partial,
            block_size,
        } => {
            let mut out = Vec::with_capacity(req.input_len);
            for &id in ids.iter().chain(partial.iter()) {
                for j in 0..*block_size {
                    if out.len() >= req.input_len {
                        break;
                    }
                    out.push((mix(id, j as u64) % vocab) as u32);
                }
            }
            // Tokens the ids do not cover are the request's own.
            let own = u64::MAX - index as u64;
            while out.len() < req.input_len {
                out.push((mix(own, out.len() as u64) % vocab) as u32);
            }
            out
        }
        _ => Vec::new(),
    }
}

/// The text `kvload --api chat` sends for these tokens: one word per token.
pub fn tokens_as_text(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 6);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push('w');
        s.push_str(&t.to_string());
    }
    s
}

/// The first model `GET /v1/models` lists.
pub async fn first_model(endpoint: &str) -> Result<String, MockError> {
    let c = client();
    let uri: hyper::Uri = format!("{endpoint}/v1/models")
        .parse()
        .map_err(|e| MockError::Endpoint(format!("{endpoint}: {e}")))?;
    let req = hyper::Request::get(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| MockError::Endpoint(e.to_string()))?;
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .map_err(|_| MockError::Endpoint(format!("{endpoint}/v1/models: timed out")))?
        .map_err(|e| MockError::Endpoint(format!("{endpoint}/v1/models: {e}")))?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| MockError::Endpoint(e.to_string()))?
        .to_bytes();
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| MockError::Endpoint(format!("/v1/models: {e}")))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| MockError::Endpoint("/v1/models lists no model".into()))
}

/// One request's outcome, before it becomes a [`MeasuredRequest`].
struct One {
    sent_us: u64,
    first_us: Option<u64>,
    last_us: u64,
    tokens: usize,
    cached: usize,
    gaps: Vec<u64>,
    error: Option<String>,
}

async fn send_one(
    client: &HttpClient,
    cfg: &LoadConfig,
    endpoint: &str,
    body: Bytes,
    start: Instant,
) -> One {
    let us = |t: Instant| t.duration_since(start).as_micros() as u64;
    let sent = Instant::now();
    let mut one = One {
        sent_us: us(sent),
        first_us: None,
        last_us: us(sent),
        tokens: 0,
        cached: 0,
        gaps: Vec::new(),
        error: None,
    };
    let path = match cfg.api {
        Api::Completions => "/v1/completions",
        Api::Chat => "/v1/chat/completions",
    };
    let work = async {
        let req = hyper::Request::post(format!("{endpoint}{path}"))
            .header("content-type", "application/json")
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status().as_u16()));
        }
        let mut body = resp.into_body();
        let mut buf: Vec<u8> = Vec::new();
        let mut last_token: Option<Instant> = None;
        let mut done = false;
        let mut usage_tokens = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("stream: {e}"))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let now = Instant::now();
            buf.extend_from_slice(&data);
            while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..pos + 2).collect();
                let Some(payload) = event.strip_prefix(b"data: ") else {
                    continue;
                };
                let payload = payload.trim_ascii();
                if payload == b"[DONE]" {
                    done = true;
                    continue;
                }
                // Only the usage and error chunks are parsed; a token chunk is recognised by its
                // keys (a chat role chunk and the usage chunk carry no token).
                let has = |needle: &[u8]| payload.windows(needle.len()).any(|w| w == needle);
                let is_usage = has(b"\"usage\"");
                if is_usage || has(b"\"error\"") {
                    let v: Value =
                        serde_json::from_slice(payload).map_err(|e| format!("bad chunk: {e}"))?;
                    if v.get("error").is_some() {
                        return Err("error in stream".to_string());
                    }
                    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                        one.cached = u["prompt_tokens_details"]["cached_tokens"]
                            .as_u64()
                            .unwrap_or(0) as usize;
                        if let Some(c) = u["completion_tokens"].as_u64() {
                            usage_tokens = Some(c as usize);
                        }
                    }
                }
                let has_token = !has(b"\"choices\":[]")
                    && (has(b"\"text\"") || (has(b"\"content\"") && !has(b"\"role\"")));
                if has_token {
                    one.tokens += 1;
                    match last_token {
                        None => one.first_us = Some(us(now)),
                        Some(prev) => one.gaps.push(now.duration_since(prev).as_micros() as u64),
                    }
                    last_token = Some(now);
                    one.last_us = us(now);
                }
            }
        }
        if let Some(c) = usage_tokens {
            one.tokens = c;
        }
        if !done {
            return Err("stream ended before [DONE]".to_string());
        }
        Ok(())
    };
    match tokio::time::timeout(cfg.timeout, work).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => one.error = Some(e),
        Err(_) => one.error = Some("timeout".to_string()),
    }
    one
}

/// Opens `n` pooled connections ahead (concurrent `GET /health`), so that the first requests
/// of a burst do not pay for a TCP connect inside their TTFT. Failures are ignored: the run
/// reports them.
async fn warm_up(client: &HttpClient, endpoint: &str, n: usize) {
    let calls: Vec<_> = (0..n)
        .filter_map(|_| {
            let uri: hyper::Uri = format!("{endpoint}/health").parse().ok()?;
            let req = hyper::Request::get(uri)
                .body(Full::new(Bytes::new()))
                .ok()?;
            let c = client.clone();
            Some(tokio::spawn(async move {
                if let Ok(Ok(resp)) =
                    tokio::time::timeout(Duration::from_secs(5), c.request(req)).await
                {
                    let _ = resp.into_body().collect().await;
                }
            }))
        })
        .collect();
    for c in calls {
        let _ = c.await;
    }
}

/// A thread that sends one tick at each of `times` (ascending), on time: tokio's timers tick
/// once a millisecond, which at `--speedup 10` would send requests up to 10 emulated ms late.
fn ticker(times: Vec<Instant>) -> Ticks {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let thread_times = times.clone();
    let spawned = std::thread::Builder::new()
        .name("kvload-ticker".into())
        .spawn(move || {
            kvserve::clock::precise_timers();
            for at in thread_times {
                kvserve::clock::sleep_until(at);
                if tx.send(()).is_err() {
                    break;
                }
            }
        });
    match spawned {
        Ok(_) => Ticks::Thread(rx),
        Err(e) => {
            tracing::warn!(
                "cannot start the send-timing thread ({e}); sending on tokio's 1 ms timer"
            );
            Ticks::Timer(times.into_iter())
        }
    }
}

/// The ticks of [`ticker`].
enum Ticks {
    /// From the ticker thread.
    Thread(tokio::sync::mpsc::UnboundedReceiver<()>),
    /// Without it, tokio's timer.
    Timer(std::vec::IntoIter<Instant>),
}

impl Ticks {
    /// Waits for the next send time; `None` after the last.
    async fn recv(&mut self) -> Option<()> {
        match self {
            Ticks::Thread(rx) => rx.recv().await,
            Ticks::Timer(times) => {
                let at = times.next()?;
                tokio::time::sleep_until(at.into()).await;
                Some(())
            }
        }
    }
}

/// Sends every request at its arrival time and measures each; `progress` is called with the
/// number of requests finished so far.
pub async fn run(
    cfg: &LoadConfig,
    requests: &[WorkloadRequest],
    progress: Arc<dyn Fn(usize) + Send + Sync>,
) -> Measured {
    let client = client();
    let cfg = Arc::new(cfg.clone());
    let sem = cfg
        .max_concurrency
        .map(|n| Arc::new(Semaphore::new(n.max(1))));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Bodies are built before the clock starts, so that building them does not delay sends.
    let bodies: Vec<Bytes> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let tokens = prompt_tokens(r, i, cfg.seed, cfg.vocab_size);
            let common = json!({"model": cfg.model, "max_tokens": r.output_len.max(1), "ignore_eos": true,
                                "stream": true, "stream_options": {"include_usage": true}});
            let mut body = common;
            match cfg.api {
                Api::Completions => body["prompt"] = json!(tokens),
                Api::Chat => {
                    body["messages"] = json!([{"role": "user", "content": tokens_as_text(&tokens)}]);
                }
            }
            Bytes::from(body.to_string())
        })
        .collect();
    for endpoint in &cfg.endpoints {
        warm_up(&client, endpoint, cfg.max_concurrency.unwrap_or(32).min(64)).await;
    }
    let start = Instant::now();
    let mut ticks = ticker(
        requests
            .iter()
            .map(|r| start + Duration::from_secs_f64(r.arrival_us as f64 / 1e6 / cfg.speedup))
            .collect(),
    );
    let mut tasks = Vec::with_capacity(requests.len());
    for (i, body) in bodies.into_iter().enumerate() {
        let endpoint = cfg
            .endpoints
            .get(i % cfg.endpoints.len().max(1))
            .cloned()
            .unwrap_or_default();
        // There is one tick per request; were one ever missing, the request goes at once
        // rather than not at all.
        let _ = ticks.recv().await;
        let permit = match &sem {
            Some(s) => Arc::clone(s).acquire_owned().await.ok(),
            None => None,
        };
        let (client, cfg, done, progress) = (
            client.clone(),
            Arc::clone(&cfg),
            Arc::clone(&done),
            Arc::clone(&progress),
        );
        tasks.push(tokio::spawn(async move {
            let one = send_one(&client, &cfg, &endpoint, body, start).await;
            drop(permit);
            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            progress(n);
            one
        }));
    }
    let mut m = Measured::default();
    let mut errors: std::collections::BTreeMap<String, usize> = Default::default();
    for (r, t) in requests.iter().zip(tasks) {
        let one = match t.await {
            Ok(o) => {
                let due = r.arrival_us as f64 / cfg.speedup;
                m.send_lag_us
                    .push(((o.sent_us as f64 - due).max(0.0) * cfg.speedup) as u64);
                Ok(o)
            }
            Err(e) => Err(e),
        };
        let one = match one {
            Ok(o) => o,
            Err(e) => One {
                sent_us: 0,
                first_us: None,
                last_us: 0,
                tokens: 0,
                cached: 0,
                gaps: Vec::new(),
                error: Some(format!("task: {e}")),
            },
        };
        match (&one.error, one.first_us) {
            (None, Some(first)) => {
                m.requests.push(MeasuredRequest::new(
                    one.sent_us,
                    r.input_len,
                    one.tokens,
                    one.cached,
                    first,
                    one.last_us,
                ));
                m.itl_us.extend(one.gaps);
            }
            (e, _) => {
                *errors
                    .entry(e.clone().unwrap_or_else(|| "no tokens".into()))
                    .or_default() += 1;
                m.requests
                    .push(MeasuredRequest::failed(one.sent_us, r.input_len));
            }
        }
    }
    m.wall_s = start.elapsed().as_secs_f64();
    if cfg.speedup != 1.0 {
        let x = |us: u64| (us as f64 * cfg.speedup).round() as u64;
        for r in &mut m.requests {
            r.arrival_us = x(r.arrival_us);
            r.first_token_us = x(r.first_token_us);
            r.finish_us = x(r.finish_us);
        }
        for g in &mut m.itl_us {
            *g = x(*g);
        }
    }
    m.errors = errors.into_iter().collect();
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace_req(ids: Vec<u64>, partial: Option<u64>, input_len: usize) -> WorkloadRequest {
        let text = format!(
            r#"{{"timestamp": 0, "input_length": {input_len}, "output_length": 1, "hash_ids": {:?}}}"#,
            ids.iter().chain(partial.iter()).collect::<Vec<_>>()
        );
        let trace = kvsim::Trace::parse("t", &text, kvblock::BlockSize::new(4).unwrap()).unwrap();
        let cfg = kvsim::SimConfig::default().with_trace(trace);
        kvsim::workload_requests(&cfg).0.remove(0)
    }

    #[test]
    fn equal_ids_give_equal_blocks() {
        let a = prompt_tokens(&trace_req(vec![1, 2], Some(3), 10), 0, 5, 1000);
        let b = prompt_tokens(&trace_req(vec![1, 2], None, 11), 1, 5, 1000);
        assert_eq!((a.len(), b.len()), (10, 11));
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..10]);
        assert!(a.iter().all(|&t| t < 1000));
        // Another seed, other tokens.
        assert_ne!(
            a,
            prompt_tokens(&trace_req(vec![1, 2], Some(3), 10), 0, 6, 1000)
        );
    }

    #[test]
    fn ticks_come_in_order_never_early_and_end() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let t0 = Instant::now();
        let times: Vec<Instant> = [0, 300, 1_000, 4_000]
            .iter()
            .map(|&us| t0 + Duration::from_micros(us))
            .collect();
        rt.block_on(async {
            let mut ticks = ticker(times.clone());
            for at in &times {
                assert_eq!(ticks.recv().await, Some(()));
                assert!(Instant::now() >= *at);
            }
            assert_eq!(ticks.recv().await, None);
        });
    }

    #[test]
    fn chat_text_has_one_word_per_token() {
        assert_eq!(tokens_as_text(&[1, 22]), "w1 w22");
    }
}
