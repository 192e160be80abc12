//! The OpenAI-compatible HTTP API, as vLLM serves it: completions and chat completions (plain
//! or streamed as server-sent events at the emulated token times), models, health, version,
//! metrics.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvserve::openai::{self, Endpoint, Input, Request};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::driver::{EngineHandle, Progress};
use crate::engine_loop::Lora;
use kvserve::tokenize::{self, ChatTemplate, Codec};

/// What the HTTP layer needs to know about the engine and the model.
#[derive(Debug)]
pub struct ApiConfig {
    /// The model name served (`--served-model-name`).
    pub model: String,
    /// Tokens per block.
    pub block_size: usize,
    /// KV blocks of the engine (`None`: unbounded).
    pub kv_blocks: Option<usize>,
    /// Prompt plus output tokens at most (`--max-model-len`).
    pub max_model_len: usize,
    /// Seed of the output tokens.
    pub seed: u64,
    /// Prompt text to tokens and output tokens to text.
    pub codec: Codec,
    /// The chat template.
    pub template: ChatTemplate,
    /// `engine` label of the metrics (the data-parallel rank).
    pub engine_label: String,
    /// The LoRA adapters served besides the base model (`--lora-modules`): requests name one as
    /// their `model`, and `/v1/models` lists each with the base model as its `parent`, as vLLM
    /// does.
    pub lora_modules: Vec<LoraModule>,
    /// Faults to inject, for testing what stands in front of the engine.
    pub faults: Faults,
}

/// Faults `kvmock` injects (llm-d's inference simulator has the like): each is off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Faults {
    /// The share of completion requests answered 500 at once (0 to 1; which ones is fixed by
    /// the seed and the request's number).
    pub error_rate: f64,
    /// How long every completion request waits before it is handled, milliseconds.
    pub stall_ms: u64,
    /// The process exits (status 3) once this many tokens have been streamed in all, right
    /// after the last one is sent, as an engine that crashes mid-answer (0: never). Meant for
    /// the `kvmock` binary: a library user's whole process exits.
    pub die_after_tokens: u64,
}

impl Faults {
    /// Whether request number `n` is one to answer 500.
    fn fails(&self, seed: u64, n: u64) -> bool {
        if self.error_rate <= 0.0 {
            return false;
        }
        let draw = xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), seed ^ 0xfa017);
        (draw as f64 / u64::MAX as f64) < self.error_rate
    }
}

/// A LoRA adapter of `--lora-modules`: its name and where it would be loaded from (kvmock
/// loads nothing; the path is only listed as the model's `root`).
///
/// ```
/// use kvmock::server::LoraModule;
/// let m: LoraModule = "sql-lora=/adapters/sql".parse()?;
/// assert_eq!((m.name.as_str(), m.path.as_str()), ("sql-lora", "/adapters/sql"));
/// let j: LoraModule = r#"{"name": "sql-lora", "path": "/adapters/sql"}"#.parse()?;
/// assert_eq!(j, m);
/// assert!("=/adapters/sql".parse::<LoraModule>().is_err());
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The adapter's name.
    pub name: String,
    /// Its path.
    pub path: String,
}

impl std::str::FromStr for LoraModule {
    type Err = String;

    /// vLLM's forms: `NAME=PATH`, or JSON `{"name": NAME, "path": PATH, ...}`; a bare `NAME`
    /// is accepted too.
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, path) = if s.trim_start().starts_with('{') {
            let v: Value = serde_json::from_str(s)
                .map_err(|e| format!("invalid JSON LoRA module {s}: {e}"))?;
            let field = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            (field("name"), field("path"))
        } else {
            match s.split_once('=') {
                Some((n, p)) => (n.to_string(), p.to_string()),
                None => (s.to_string(), String::new()),
            }
        };
        if name.is_empty() {
            return Err(format!(
                "LoRA module {s:?} has no name: expected NAME=PATH or {{\"name\": ..., \"path\": ...}}"
            ));
        }
        Ok(LoraModule { name, path })
    }
}

struct AppState {
    cfg: ApiConfig,
    engine: EngineHandle,
    next_id: AtomicU64,
    /// Completion requests seen by the fault injection.
    faulted: AtomicU64,
    /// Tokens streamed in all (counted for `Faults::die_after_tokens` only).
    streamed: Arc<AtomicU64>,
    created: u64,
}

/// The axum application over a running engine.
pub fn app(cfg: ApiConfig, engine: EngineHandle) -> Router {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let state = Arc::new(AppState {
        cfg,
        engine,
        next_id: AtomicU64::new(0),
        faulted: AtomicU64::new(0),
        streamed: Arc::new(AtomicU64::new(0)),
        created,
    });
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route(
            "/version",
            get(|| async {
                json_body(&json!({"version": concat!("kvmock ", env!("CARGO_PKG_VERSION"))}))
            }),
        )
        .route("/metrics", get(metrics))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                "no such route".into(),
            )
        })
        .with_state(state)
}

/// An API error: OpenAI's error object, with vLLM's type names.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = openai::error_body(self.status.as_u16(), self.kind, &self.message);
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}

fn error(status: StatusCode, kind: &'static str, message: String) -> ApiError {
    ApiError {
        status,
        kind,
        message,
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message.into())
}

fn json_body(v: &Value) -> ([(header::HeaderName, &'static str); 1], String) {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string())
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.cfg.model;
    let mut data = vec![json!({
        "id": m, "object": "model", "created": st.created, "owned_by": "vllm", "root": m,
        "parent": null, "max_model_len": st.cfg.max_model_len,
    })];
    for l in &st.cfg.lora_modules {
        data.push(json!({
            "id": l.name, "object": "model", "created": st.created, "owned_by": "vllm",
            "root": l.path, "parent": m, "max_model_len": null,
        }));
    }
    let body = json!({"object": "list", "data": data});
    json_body(&body).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let c = st.engine.counters();
    let labels = format!(
        "engine=\"{}\",model_name=\"{}\"",
        st.cfg.engine_label, st.cfg.model
    );
    let mut s = String::new();
    let mut put = |name: &str, kind: &str, help: &str, extra: &str, v: String| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(s, "{name}{{{labels}{extra}}} {v}");
    };
    put(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        "",
        c.running.to_string(),
    );
    put(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        "",
        c.waiting.to_string(),
    );
    put(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        "",
        c.kv_usage.to_string(),
    );
    put(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage (the older name).",
        "",
        c.kv_usage.to_string(),
    );
    put(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        "",
        c.prefix_queries.to_string(),
    );
    put(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        "",
        c.prefix_hits.to_string(),
    );
    // The names of earlier vLLM releases, for dashboards that still read them.
    put(
        "vllm:gpu_prefix_cache_queries_total",
        "counter",
        "GPU prefix cache queries, in terms of number of queried tokens (the older name).",
        "",
        c.prefix_queries.to_string(),
    );
    put(
        "vllm:gpu_prefix_cache_hits_total",
        "counter",
        "GPU prefix cache hits, in terms of number of cached tokens (the older name).",
        "",
        c.prefix_hits.to_string(),
    );
    put(
        "vllm:gpu_prefix_cache_hit_rate",
        "gauge",
        "GPU prefix cache block hit rate (vLLM 0.x).",
        "",
        if c.prefix_queries == 0 {
            "0".to_string()
        } else {
            (c.prefix_hits as f64 / c.prefix_queries as f64).to_string()
        },
    );
    put(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        "",
        c.prompt_tokens.to_string(),
    );
    put(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        "",
        c.generation_tokens.to_string(),
    );
    put(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        ",finished_reason=\"length\"",
        c.finished.to_string(),
    );
    use crate::engine_loop::{ITL_BUCKETS_S, TTFT_BUCKETS_S};
    for (name, help, bounds, buckets, sum, count) in [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (emulated time: arrival at the server \
             to the end of prefill).",
            &TTFT_BUCKETS_S[..],
            &c.ttft_buckets[..],
            c.ttft_sum_s,
            c.ttft_count,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (emulated time).",
            &ITL_BUCKETS_S[..],
            &c.itl_buckets[..],
            c.itl_sum_s,
            c.itl_count,
        ),
    ] {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (le, n) in bounds.iter().zip(buckets) {
            let _ = writeln!(s, "{name}_bucket{{{labels},le=\"{le:?}\"}} {n}");
        }
        let _ = writeln!(s, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(s, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(s, "{name}_count{{{labels}}} {count}");
    }
    let mut put = |name: &str, kind: &str, help: &str, extra: &str, v: String| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
        let _ = writeln!(s, "{name}{{{labels}{extra}}} {v}");
    };
    put(
        "kvmock:otlp_export_errors_total",
        "counter",
        "Span batches the OTLP collector did not take (--otlp-traces-endpoint).",
        "",
        kvserve::logging::TraceGuard::export_errors().to_string(),
    );
    put(
        "kvmock:cached_blocks",
        "gauge",
        "Blocks resident in the emulated engine's cache.",
        "",
        c.cached_blocks.to_string(),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s,
    )
        .into_response()
}

/// A validated request, ready for the engine.
struct Prepared {
    tokens: Vec<u32>,
    max_tokens: usize,
    stream: bool,
    include_usage: bool,
    chat: bool,
    /// The adapter the request names.
    lora: Option<Lora>,
    /// vLLM's `cache_salt`: keys the prompt's first block.
    cache_salt: Option<String>,
}

fn parse_body(endpoint: Endpoint, body: &Bytes) -> Result<Request, ApiError> {
    openai::parse(endpoint, body).map_err(|e| bad(e.to_string()))
}

/// The adapter the request's `model` names (`None`: the base model), or 404.
fn common(st: &AppState, req: &Request) -> Result<Option<Lora>, ApiError> {
    match &req.model {
        None => Ok(None),
        Some(m) if *m == st.cfg.model => Ok(None),
        Some(m) => match st.cfg.lora_modules.iter().position(|l| l.name == *m) {
            Some(i) => Ok(Some(Lora {
                name: m.as_str().into(),
                id: i as i64 + 1,
            })),
            None => Err(error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                format!("The model `{m}` does not exist."),
            )),
        },
    }
}

fn finish_prepare(
    st: &AppState,
    req: &Request,
    tokens: Vec<u32>,
    chat: bool,
    lora: Option<Lora>,
) -> Result<Prepared, ApiError> {
    // `ignore_eos` is accepted: outputs always run to max_tokens.
    let max_tokens = match req.max_tokens {
        None => 16,
        Some(0) => {
            let key = if chat {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            return Err(bad(format!("{key} must be at least 1, got 0")));
        }
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
    };
    let include_usage = req.stream && req.include_usage;
    if tokens.is_empty() {
        return Err(bad("the prompt is empty"));
    }
    if let Some(limit) = st.cfg.codec.vocab_limit() {
        if let Some(t) = tokens.iter().find(|&&t| t >= limit) {
            return Err(bad(format!(
                "token id {t} is out of vocabulary (size {limit})"
            )));
        }
    }
    let total = tokens.len().saturating_add(max_tokens);
    if total > st.cfg.max_model_len {
        return Err(bad(format!(
            "This model's maximum context length is {} tokens. However, you requested {total} tokens \
             ({} in the messages, {max_tokens} in the completion).",
            st.cfg.max_model_len,
            tokens.len()
        )));
    }
    if let Some(kv) = st.cfg.kv_blocks {
        let need = total.div_ceil(st.cfg.block_size);
        if need > kv {
            return Err(bad(format!(
                "the request needs {need} KV blocks of {} tokens ({total} tokens) but the engine has {kv}",
                st.cfg.block_size
            )));
        }
    }
    Ok(Prepared {
        tokens,
        max_tokens,
        stream: req.stream,
        include_usage,
        chat,
        lora,
        cache_salt: req.cache_salt.clone(),
    })
}

fn prepare_completion(st: &AppState, body: &Bytes) -> Result<Prepared, ApiError> {
    let req = parse_body(Endpoint::Completions, body)?;
    let lora = common(st, &req)?;
    let tokens =
        tokenize::prompt_tokens(&req.input, |text| st.cfg.codec.encode(text, true)).map_err(bad)?;
    finish_prepare(st, &req, tokens, false, lora)
}

fn prepare_chat(st: &AppState, body: &Bytes) -> Result<Prepared, ApiError> {
    let req = parse_body(Endpoint::Chat, body)?;
    let lora = common(st, &req)?;
    let Input::Messages(msgs) = &req.input else {
        return Err(bad("a chat request needs `messages`"));
    };
    let text = if req.continue_final_message {
        tokenize::chat_text_continued(&st.cfg.template, msgs)
    } else {
        tokenize::chat_text(&st.cfg.template, msgs)
    }
    .map_err(bad)?;
    let tokens = st.cfg.codec.encode(&text, false).map_err(bad)?;
    finish_prepare(st, &req, tokens, true, lora)
}

/// Most bytes a request body may have.
const BODY_LIMIT: usize = 256 << 20;

/// Reads a request's body. The caller stamps the arrival first: once the request line and
/// headers are in, as the client's clock would, not after a long prompt has been read.
async fn read_body(req: axum::extract::Request) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(req.into_body(), BODY_LIMIT)
        .await
        .map_err(|e| {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "BadRequestError",
                    format!("the request body is larger than {BODY_LIMIT} bytes"),
                )
            } else {
                bad(format!("cannot read the request body: {e}"))
            }
        })
}

/// The injected faults' answer to a request, if any: a stall, then perhaps a 500.
async fn inject_faults(st: &AppState) -> Option<Response> {
    let f = st.cfg.faults;
    if f.stall_ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(f.stall_ms)).await;
    }
    let n = st.faulted.fetch_add(1, Ordering::Relaxed);
    f.fails(st.cfg.seed, n).then(|| {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "an injected fault (--fault-error-rate)".into(),
        )
        .into_response()
    })
}

async fn completions(State(st): State<Arc<AppState>>, req: axum::extract::Request) -> Response {
    if let Some(fault) = inject_faults(&st).await {
        return fault;
    }
    let arrived = Instant::now();
    let ids = Ids::of(req.headers());
    match read_body(req)
        .await
        .and_then(|b| prepare_completion(&st, &b))
    {
        Ok(p) => run(st, p, arrived, ids).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
) -> Response {
    if let Some(fault) = inject_faults(&st).await {
        return fault;
    }
    let arrived = Instant::now();
    let ids = Ids::of(req.headers());
    match read_body(req).await.and_then(|b| prepare_chat(&st, &b)) {
        Ok(p) => run(st, p, arrived, ids).await,
        Err(e) => e.into_response(),
    }
}

/// Per-request identity of the responses.
struct Meta {
    id: String,
    created: u64,
    model: String,
    chat: bool,
}

impl Meta {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Value {
        if self.chat {
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish}]})
        } else {
            json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null}]})
        }
    }

    /// The streamed token chunk as `(head, tail)` around the JSON string of the token's text:
    /// the same document as [`chunk`](Self::chunk), formatted once per request instead of once
    /// per token.
    fn token_frame(&self, finish: Option<&str>) -> (String, String) {
        let marker = "\u{1}KVMOCK\u{1}";
        let doc = self.chunk(marker, finish).to_string();
        let quoted = Value::from(marker).to_string();
        match doc.split_once(&quoted) {
            Some((h, t)) => (format!("data: {h}"), format!("{t}\n\n")),
            None => (format!("data: {doc}"), "\n\n".into()),
        }
    }

    fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
        json!({"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
               "prompt_tokens_details": {"cached_tokens": cached}})
    }
}

/// Appends one streamed token chunk: `head`, the text as a JSON string, `tail`.
fn token_sse(frame: &(String, String), text: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(frame.0.as_bytes());
    out.extend_from_slice(Value::from(text).to_string().as_bytes());
    out.extend_from_slice(frame.1.as_bytes());
}

fn sse(v: &Value, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(v.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// What names a request across hops: the client's `x-request-id` (vLLM's request id is made of
/// it) and, with tracing on, the `llm_request` span continuing the caller's trace.
struct Ids {
    request_id: Option<String>,
    span: Option<tracing::Span>,
}

impl Ids {
    fn of(headers: &header::HeaderMap) -> Ids {
        let get = |k: &str| Some(headers.get(k)?.to_str().ok()?.to_string());
        let span = kvserve::logging::tracing_on().then(|| {
            let span = tracing::info_span!(
                "llm_request",
                otel.kind = "server",
                otel.status_code = tracing::field::Empty,
                gen_ai.request.id = tracing::field::Empty,
                gen_ai.request.max_tokens = tracing::field::Empty,
                gen_ai.request.n = 1,
                gen_ai.usage.prompt_tokens = tracing::field::Empty,
                gen_ai.usage.completion_tokens = tracing::field::Empty,
                gen_ai.latency.time_in_queue = tracing::field::Empty,
                gen_ai.latency.time_to_first_token = tracing::field::Empty,
                gen_ai.latency.e2e = tracing::field::Empty,
                gen_ai.latency.time_in_model_prefill = tracing::field::Empty,
                gen_ai.latency.time_in_model_decode = tracing::field::Empty,
                gen_ai.latency.time_in_model_inference = tracing::field::Empty,
            );
            kvserve::logging::continue_trace(&span, get);
            span
        });
        Ids {
            request_id: get("x-request-id").filter(|v| !v.is_empty()),
            span,
        }
    }
}

/// The engine's progress for one request; with tracing on, it stamps the `llm_request` span
/// as vLLM does (latencies in emulated seconds) and ends it when the request finishes.
struct Traced {
    rx: mpsc::UnboundedReceiver<Progress>,
    span: Option<tracing::Span>,
    /// Emulated arrival, scheduling and first-token times.
    times: [Option<u64>; 3],
    tokens: u64,
}

impl Traced {
    async fn recv(&mut self) -> Option<Progress> {
        let p = self.rx.recv().await;
        self.observe(p)
    }

    fn try_recv(&mut self) -> Option<Progress> {
        let p = self.rx.try_recv().ok();
        self.observe(p)
    }

    fn observe(&mut self, p: Option<Progress>) -> Option<Progress> {
        if self.span.is_none() {
            return p;
        }
        let [arrived, admitted, first] = &mut self.times;
        match p {
            Some(Progress::Arrived { at_us }) => *arrived = Some(at_us),
            Some(Progress::Admitted { at_us, .. }) => *admitted = Some(at_us),
            Some(Progress::Token { at_us }) => {
                first.get_or_insert(at_us);
                self.tokens += 1;
            }
            Some(Progress::Finished { at_us }) => {
                let s =
                    |from: Option<u64>, to: u64| to.saturating_sub(from.unwrap_or(to)) as f64 / 1e6;
                let (arrived, admitted) = (*arrived, admitted.or(*arrived));
                let first_us = first.unwrap_or(at_us);
                if let Some(span) = self.span.take() {
                    span.record("gen_ai.usage.completion_tokens", self.tokens as i64);
                    span.record(
                        "gen_ai.latency.time_in_queue",
                        s(arrived, admitted.unwrap_or(at_us)),
                    );
                    span.record("gen_ai.latency.time_to_first_token", s(arrived, first_us));
                    span.record("gen_ai.latency.e2e", s(arrived, at_us));
                    span.record(
                        "gen_ai.latency.time_in_model_prefill",
                        s(admitted, first_us),
                    );
                    span.record(
                        "gen_ai.latency.time_in_model_decode",
                        s(Some(first_us), at_us),
                    );
                    span.record("gen_ai.latency.time_in_model_inference", s(admitted, at_us));
                    // Dropped here: the span ends with the request.
                }
            }
            _ => {}
        }
        p
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        // Not finished (the client left, the engine stopped): an error span, which readers of
        // vLLM's spans (`kvsim --spans`) skip.
        if let Some(span) = self.span.take() {
            span.record("otel.status_code", "error");
        }
    }
}

async fn run(st: Arc<AppState>, p: Prepared, arrived: Instant, ids: Ids) -> Response {
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let kind = if p.chat { "chatcmpl" } else { "cmpl" };
    let meta = Meta {
        id: match &ids.request_id {
            Some(given) => format!("{kind}-{given}"),
            None => format!("{kind}-{n}"),
        },
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        // vLLM answers with the model name asked for: the adapter's for a LoRA request.
        model: p
            .lora
            .as_ref()
            .map_or_else(|| st.cfg.model.clone(), |l| l.name.to_string()),
        chat: p.chat,
    };
    let prompt_hash = xxhash_rust::xxh3::xxh3_64(
        &p.tokens
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let prompt_len = p.tokens.len();
    // Whole numbers as OTLP integers, as vLLM's (tracing-opentelemetry writes a u64 as a string).
    if let Some(span) = &ids.span {
        span.record("gen_ai.request.id", meta.id.as_str());
        span.record("gen_ai.request.max_tokens", p.max_tokens as i64);
        span.record("gen_ai.usage.prompt_tokens", prompt_len as i64);
    }
    let rx = st
        .engine
        .submit(n, arrived, p.tokens, p.max_tokens, p.lora, p.cache_salt);
    let mut progress = Traced {
        rx,
        span: ids.span,
        times: [None; 3],
        tokens: 0,
    };
    let codec = st.cfg.codec.clone();
    let seed = st.cfg.seed;
    let bs = st.cfg.block_size;
    if !p.stream {
        let mut dec = codec.decoder();
        let (mut text, mut k, mut cached) = (String::new(), 0usize, 0usize);
        loop {
            match progress.recv().await {
                Some(Progress::Arrived { .. }) => {}
                Some(Progress::Admitted { cached_blocks, .. }) => cached = cached_blocks * bs,
                Some(Progress::Token { .. }) => {
                    text.push_str(&dec.push(codec.output_token(seed, prompt_hash, k)));
                    k += 1;
                }
                Some(Progress::Finished { .. }) => break,
                Some(Progress::Rejected) => {
                    return bad("the request can never fit the KV cache").into_response()
                }
                None => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "InternalServerError",
                        "the engine stopped".into(),
                    )
                    .into_response()
                }
            }
        }
        let choice = if meta.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null})
        };
        let body = json!({"id": meta.id, "object": if meta.chat { "chat.completion" } else { "text_completion" },
            "created": meta.created, "model": meta.model, "choices": [choice],
            "usage": Meta::usage(prompt_len, k, cached.min(prompt_len))});
        return json_body(&body).into_response();
    }
    let mut out = Vec::new();
    if meta.chat {
        let mut first = meta.chunk("", None);
        first["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
        sse(&first, &mut out);
    }
    let state = SseState {
        frames: (meta.token_frame(None), meta.token_frame(Some("length"))),
        meta,
        progress,
        decoder: codec.decoder(),
        codec,
        seed,
        prompt_hash,
        prompt_len,
        block_size: bs,
        max_tokens: p.max_tokens,
        include_usage: p.include_usage,
        tokens: 0,
        cached: 0,
        done: false,
        pending: out,
        die: (st.cfg.faults.die_after_tokens > 0)
            .then(|| (Arc::clone(&st.streamed), st.cfg.faults.die_after_tokens)),
        dying: false,
    };
    // The body reads the engine's progress itself: no task between the engine and the socket.
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        st.next_bytes().await.map(|b| (Ok::<_, Infallible>(b), st))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A streamed response in progress: turns the engine's progress into SSE bytes.
struct SseState {
    meta: Meta,
    /// Token chunk frames: (not the last, the last).
    frames: ((String, String), (String, String)),
    progress: Traced,
    codec: Codec,
    decoder: kvserve::tokenize::Decoder,
    seed: u64,
    prompt_hash: u64,
    prompt_len: usize,
    block_size: usize,
    max_tokens: usize,
    include_usage: bool,
    tokens: usize,
    cached: usize,
    done: bool,
    /// Bytes to send before waiting again (the chat role chunk).
    pending: Vec<u8>,
    /// `Faults::die_after_tokens`: the server's count of streamed tokens, and the limit.
    die: Option<(Arc<AtomicU64>, u64)>,
    /// The limit was reached with the bytes last returned: exit at the next call.
    dying: bool,
}

impl SseState {
    /// The next bytes to write: everything the engine produced since the last call, in one
    /// piece; `None` once the stream has ended.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        if self.dying {
            // The last token's bytes went to the socket with the previous call.
            tracing::error!("exiting: an injected fault (--fault-die-after-tokens)");
            std::process::exit(3);
        }
        let mut out = std::mem::take(&mut self.pending);
        if !out.is_empty() {
            return Some(Bytes::from(out));
        }
        if self.done {
            return None;
        }
        let mut next = self.progress.recv().await;
        if next.is_none() {
            self.done = true;
            return None;
        }
        while let Some(p) = next.take() {
            match p {
                Progress::Arrived { .. } => {}
                Progress::Admitted { cached_blocks, .. } => {
                    self.cached = cached_blocks * self.block_size;
                }
                Progress::Token { .. } => {
                    let id = self
                        .codec
                        .output_token(self.seed, self.prompt_hash, self.tokens);
                    let text = self.decoder.push(id);
                    self.tokens += 1;
                    let f = if self.tokens >= self.max_tokens {
                        &self.frames.1
                    } else {
                        &self.frames.0
                    };
                    token_sse(f, &text, &mut out);
                    if let Some((streamed, limit)) = &self.die {
                        if streamed.fetch_add(1, Ordering::Relaxed) + 1 >= *limit {
                            self.dying = true;
                            return Some(Bytes::from(out));
                        }
                    }
                }
                Progress::Finished { .. } => self.done = true,
                Progress::Rejected => {
                    let e = json!({"error": {"message": "the request can never fit the KV cache",
                                   "type": "BadRequestError", "code": 400}});
                    sse(&e, &mut out);
                    self.done = true;
                }
            }
            if self.done {
                break;
            }
            next = self.progress.try_recv();
        }
        if self.done {
            if self.include_usage {
                let mut u = self.meta.chunk("", None);
                u["choices"] = json!([]);
                u["usage"] = Meta::usage(
                    self.prompt_len,
                    self.tokens,
                    self.cached.min(self.prompt_len),
                );
                sse(&u, &mut out);
            }
            out.extend_from_slice(b"data: [DONE]\n\n");
        }
        Some(Bytes::from(out))
    }
}
