//! The HTTP side: OpenAI-compatible requests tokenised, routed, forwarded unchanged and
//! streamed back; the admin views, `/v1/models`, `/health` and `/metrics`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use http_body_util::{BodyStream, Full};
use kvroute::{RequestId, Role, SessionId};
use kvserve::keys::RequestKeys;
use kvserve::openai::{self, Endpoint, Input, Request};
use kvserve::tokenize;
use serde_json::{json, Value};
use tracing::Instrument;

use crate::migrate;
use crate::state::{Server, Worker};

/// The routes over `server`.
pub fn app(server: Arc<Server>) -> axum::Router {
    let limit = server.cfg.max_body_bytes;
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/v1/admin/cache-view/{worker}", get(cache_view))
        .route("/v1/admin/workers", get(workers).post(add_worker))
        .route(
            "/v1/admin/workers/{worker}",
            axum::routing::delete(remove_worker),
        )
        .route("/v1/admin/workers/{worker}/drain", post(drain_worker))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&server),
            crate::ratelimit::limit,
        ))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&server),
            with_request_id,
        ))
        .with_state(server)
}

/// The request id header: the client's, or one the router gives; sent on to the engine and
/// back to the client.
static REQUEST_ID: header::HeaderName = header::HeaderName::from_static("x-request-id");

/// Runs a request in a span carrying its id, so that every log line of the request names it.
async fn with_request_id(
    State(server): State<Arc<Server>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let given = req.headers().get(&REQUEST_ID).filter(|v| !v.is_empty());
    let id = match given {
        Some(v) => v.clone(),
        None => {
            let fresh = format!("kvr-{:016x}", server.next_request_id().get());
            let v = header::HeaderValue::from_str(&fresh)
                .unwrap_or(header::HeaderValue::from_static("kvr"));
            req.headers_mut().insert(REQUEST_ID.clone(), v.clone());
            v
        }
    };
    // Requests for completions are traced; health checks, scrapes and admin calls are not.
    if !req.uri().path().contains("completions") {
        let mut resp = next.run(req).await;
        resp.headers_mut().insert(REQUEST_ID.clone(), id);
        return resp;
    }
    let span = tracing::info_span!(
        "request",
        request_id = %String::from_utf8_lossy(id.as_bytes()),
        trace_id = tracing::field::Empty,
        otel.kind = "server",
        otel.name = tracing::field::Empty,
    );
    // With tracing on, the span is named, continues the caller's trace, and log lines name it.
    if kvserve::logging::tracing_on() {
        span.record(
            "otel.name",
            format!("{} {}", req.method(), req.uri().path()),
        );
        let headers = req.headers();
        let get = |k: &str| Some(headers.get(k)?.to_str().ok()?.to_string());
        if let Some(trace) = kvserve::logging::continue_trace(&span, get) {
            span.record("trace_id", trace);
        }
    }
    let mut resp = next.run(req).instrument(span).await;
    resp.headers_mut().insert(REQUEST_ID.clone(), id);
    resp
}

/// An OpenAI-shaped error.
fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = openai::error_body(status.as_u16(), kind, &message.into());
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "NotFoundError",
        format!(
            "no route {}: the endpoints are POST /v1/completions, POST /v1/chat/completions, \
             GET /v1/models, /health, /metrics, /v1/admin/workers, /v1/admin/cache-view/WORKER",
            uri.path()
        ),
    )
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowedError",
        format!("{method} is not accepted on {}", uri.path()),
    )
}

fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// An error answer not yet rendered (small, unlike a `Response`).
struct ApiError(StatusCode, &'static str, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error(self.0, self.1, self.2)
    }
}

const NO_TOKENIZER: &str = "this router has no tokenizer (start it with \
--router-tokenizer-path PATH, or builtin:bytes for a demo): send the prompt as token ids";

fn encode(server: &Server, text: &str, special: bool) -> Result<Vec<u32>, String> {
    match &server.text {
        Some((codec, _)) => codec.encode(text, special),
        None => Err(NO_TOKENIZER.into()),
    }
}

type Body413 = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// The body, or the OpenAI-shaped error for one too large (or unreadable).
fn body_of(server: &Server, body: Body413) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError(
                StatusCode::PAYLOAD_TOO_LARGE,
                "RequestTooLargeError",
                format!(
                    "the request body is larger than {} bytes (--max-body-bytes)",
                    server.cfg.max_body_bytes
                ),
            )
        } else {
            ApiError(StatusCode::BAD_REQUEST, "BadRequestError", e.body_text())
        }
    })
}

/// The body and what the router reads of it, or the error answer.
fn request_of(
    server: &Server,
    endpoint: Endpoint,
    body: Body413,
) -> Result<(Bytes, Request, RequestKeys), ApiError> {
    let body = body_of(server, body)?;
    match openai::parse(endpoint, &body) {
        Ok(req) => {
            let keys = RequestKeys::of(&req, |m| server.lora.is_adapter(m));
            Ok((body, req, keys))
        }
        Err(e) => Err(ApiError(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            e.to_string(),
        )),
    }
}

async fn completions(
    State(server): State<Arc<Server>>,
    headers: header::HeaderMap,
    body: Body413,
) -> Response {
    let (body, req, keys) = match request_of(&server, Endpoint::Completions, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let tokens = tracing::info_span!("tokenize")
        .in_scope(|| tokenize::prompt_tokens(&req.input, |t| encode(&server, t, true)));
    match tokens {
        Ok(tokens) => forward(server, &req, body, &headers, tokens, &keys).await,
        Err(e) => bad(e),
    }
}

async fn chat(
    State(server): State<Arc<Server>>,
    headers: header::HeaderMap,
    body: Body413,
) -> Response {
    if server.text.is_none() {
        return bad("this router has no tokenizer (start it with --router-tokenizer-path PATH, or builtin:bytes for a demo): chat requests need one");
    }
    let (body, req, keys) = match request_of(&server, Endpoint::Chat, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let tokens = tracing::info_span!("tokenize").in_scope(|| chat_tokens(&server, &req, &keys));
    match tokens {
        Ok(tokens) => forward(server, &req, body, &headers, tokens, &keys).await,
        Err(e) => bad(e),
    }
}

/// The tokens a chat request is routed on: the whole rendered prompt, or for a prompt with
/// media only its text before the first media message's content (see
/// [`tokenize::chat_text_before`]), less its last token (a tokenizer may merge it with what
/// follows). Nothing when the template hides where that content starts: the request is then
/// routed on load alone.
fn chat_tokens(server: &Server, req: &Request, keys: &RequestKeys) -> Result<Vec<u32>, String> {
    let (Some((_, template)), Input::Messages(msgs)) = (&server.text, &req.input) else {
        return Err(NO_TOKENIZER.into());
    };
    match keys.first_media_message() {
        None => encode(server, &tokenize::chat_text(template, msgs)?, false),
        Some(first) => match tokenize::chat_text_before(template, msgs, first) {
            Some(text) => {
                let mut t = encode(server, &text, false)?;
                t.pop();
                Ok(t)
            }
            None => Ok(Vec::new()),
        },
    }
}

/// Releases a request's load in the router when its response ends, fails or is dropped.
struct Finish {
    server: Arc<Server>,
    id: RequestId,
    /// The request's place under --max-concurrency, given back with the response's end.
    place: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        // Finishing twice cannot happen: the guard runs once.
        let mut m = self.server.mirror();
        let _ = m.router.finish(self.id);
        self.server.flush_deltas(&mut m.router);
    }
}

/// A place under `--max-concurrency` (none without a limit), waited for in arrival order for at
/// most `--queue-timeout-ms`; past it, 429 with `Retry-After`.
async fn admit(server: &Server) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Response> {
    let Some(places) = &server.places else {
        return Ok(None);
    };
    let c = &server.counters;
    let started = Instant::now();
    c.queued.fetch_add(1, Ordering::Relaxed);
    let limit = std::time::Duration::from_millis(server.cfg.queue_timeout_ms);
    let got = tokio::time::timeout(limit, Arc::clone(places).acquire_owned())
        .instrument(tracing::info_span!("queue"))
        .await;
    c.queued.fetch_sub(1, Ordering::Relaxed);
    server
        .queue_wait
        .observe(started.elapsed().as_micros() as u64);
    match got {
        Ok(Ok(place)) => Ok(Some(place)),
        // Timed out (or, never, the semaphore closed).
        _ => {
            c.rejected_busy.fetch_add(1, Ordering::Relaxed);
            let mut busy = error(
                StatusCode::TOO_MANY_REQUESTS,
                "RateLimitError",
                format!(
                    "the router is at --max-concurrency {} and no place freed within \
                     --queue-timeout-ms {}",
                    server.cfg.max_concurrency, server.cfg.queue_timeout_ms
                ),
            );
            busy.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            Err(busy)
        }
    }
}

/// One request as the router forwards it: what it is routed on and sent with, kept for a
/// retry or for continuing its answer on another worker.
struct Job {
    endpoint: Endpoint,
    /// The engine's path.
    path: &'static str,
    /// The client's headers sent on: credentials, request id, trace context.
    headers: header::HeaderMap,
    tokens: Vec<u32>,
    salt: kvroute::Salt,
    extra: Vec<kvblock::ExtraKeys>,
    /// Its `x-session-id` (with --session-affinity soft or hard).
    session: Option<SessionId>,
    /// It asked for a streamed answer.
    stream: bool,
}

/// The session header.
static SESSION_ID: header::HeaderName = header::HeaderName::from_static("x-session-id");

/// Routes `tokens`, forwards `body` to the winner and streams its response back (see
/// [`send`] for retries, [`Relay`] for the answer). The request's `cache_salt` (vLLM's field)
/// keys its first block, so only requests with the same salt share cached blocks.
async fn forward(
    server: Arc<Server>,
    req: &Request,
    body: Bytes,
    headers: &header::HeaderMap,
    tokens: Vec<u32>,
    keys: &RequestKeys,
) -> Response {
    // The one keying rule (LoRA adapter, cache salt), shared with the engine emulator.
    let bs = kvblock::BlockSize::new(server.cfg.block_size).unwrap_or_default();
    let mut sent_on = header::HeaderMap::new();
    for name in [&header::AUTHORIZATION, &REQUEST_ID] {
        if let Some(v) = headers.get(name) {
            sent_on.insert(name.clone(), v.clone());
        }
    }
    for name in ["traceparent", "tracestate"] {
        if let Some(v) = headers.get(name) {
            sent_on.insert(name, v.clone());
        }
    }
    let session = (server.cfg.session_affinity.0 != kvroute::SessionAffinity::Off)
        .then(|| {
            headers
                .get(&SESSION_ID)?
                .to_str()
                .ok()
                .filter(|s| !s.is_empty())
        })
        .flatten()
        .map(SessionId::from_name);
    let job = Job {
        endpoint: req.endpoint,
        path: if matches!(req.endpoint, Endpoint::Chat) {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        },
        headers: sent_on,
        salt: keys.salt(),
        extra: keys.extra_keys(bs, tokens.len()),
        tokens,
        session,
        stream: req.stream,
    };
    let place = match admit(&server).await {
        Ok(place) => place,
        Err(busy) => return busy,
    };
    let mut tried = Vec::new();
    match send(&server, &job, &body, &mut tried).await {
        Ok(mut sent) => {
            sent.guard.place = place;
            Relay::respond(server, job, body, sent, tried)
        }
        Err(failure) => failure,
    }
}

/// A worker's answer to a request: the response, the request's load (released when the guard
/// drops) and the worker.
struct Sent {
    resp: hyper::Response<hyper::body::Incoming>,
    guard: Finish,
    worker: Arc<Worker>,
}

/// Routes `job` and sends `body` to the winner. A worker that refuses the connection, answers
/// 5xx or not within --upstream-timeout-s is left for the next-best worker not in `tried`
/// (--retries), after a backoff; every worker tried is added to `tried`. The error is the answer
/// for the client.
async fn send(
    server: &Arc<Server>,
    job: &Job,
    body: &Bytes,
    tried: &mut Vec<Arc<Worker>>,
) -> Result<Sent, Response> {
    let mut last_failure = None;
    for attempt in 0..=server.cfg.retries {
        if attempt > 0 {
            server.counters.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(backoff(server.cfg.retry_backoff_ms, attempt)).await;
        }
        let id = server.next_request_id();
        let started = Instant::now();
        let route_span = tracing::info_span!(
            "route",
            policy = ?server.cfg.router_policy,
            attempt = attempt as i64,
            candidates = server.worker_count() as i64,
            worker = tracing::field::Empty,
            hits = tracing::field::Empty,
            blocks = tracing::field::Empty,
            cost = tracing::field::Empty,
        );
        let _entered = route_span.enter();
        let decision = {
            let mut mirror = server.mirror();
            mirror.router.set_clock(server.started.elapsed());
            // The workers tried already are out of this decision only.
            for w in tried.iter() {
                mirror.router.set_routable(w.id, false);
            }
            let (salt, extra) = (&job.salt, &job.extra);
            let d = match job.session {
                None => {
                    mirror
                        .router
                        .route_tokens_keyed(id, &job.tokens, salt, extra, Role::Unified)
                }
                Some(s) => {
                    let before = mirror.router.session_worker(s);
                    let d = mirror.router.route_tokens_in_session(
                        s,
                        id,
                        &job.tokens,
                        salt,
                        extra,
                        Role::Unified,
                    );
                    if matches!((&d, before), (Ok(d), Some(b)) if d.worker != b) {
                        server
                            .counters
                            .session_moves
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    d
                }
            };
            for w in tried.iter() {
                mirror.router.set_routable(w.id, server.routable(w));
            }
            server.flush_deltas(&mut mirror.router);
            d
        };
        server.observe_route(started.elapsed().as_micros() as u64);
        let d = match decision {
            Ok(d) => d,
            Err(kvroute::Error::NoWorkers) => break,
            // A hard session whose worker failed this request: that failure is the answer.
            Err(kvroute::Error::SessionUnavailable { .. }) if last_failure.is_some() => break,
            Err(e @ kvroute::Error::SessionUnavailable { .. }) => {
                return Err(error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ServiceUnavailableError",
                    format!("{e} (--session-affinity hard)"),
                ))
            }
            Err(e) => {
                return Err(error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                    e.to_string(),
                ))
            }
        };
        // Whole numbers as OTLP integers (tracing-opentelemetry writes a u64 as a string).
        route_span.record("worker", d.worker.get() as i64);
        route_span.record("hits", d.cache_hits as i64);
        route_span.record("blocks", d.request_blocks as i64);
        route_span.record("cost", d.cost);
        // Not held across the upstream call (the guard is not Send).
        drop(_entered);
        let guard = Finish {
            server: Arc::clone(server),
            id,
            place: None,
        };
        let Some(worker) = server.worker(d.worker) else {
            continue;
        };
        log::decision(&worker, &d);
        tried.push(Arc::clone(&worker));
        let upstream_span =
            tracing::info_span!("upstream", worker = %worker.spec.name, otel.kind = "client");
        let req = match upstream_request(&worker, job, body, &upstream_span) {
            Ok(r) => r,
            Err(e) => return Err(bad(format!("cannot forward the request: {e}"))),
        };
        let limit = std::time::Duration::from_secs_f64(server.cfg.upstream_timeout_s);
        let sent = tokio::time::timeout(limit, server.client.request(req))
            .instrument(upstream_span)
            .await;
        let last_try = attempt == server.cfg.retries;
        let failure = match sent {
            Ok(Ok(resp)) if !resp.status().is_server_error() || last_try => {
                worker.routed.fetch_add(1, Ordering::Relaxed);
                server.routed_to(&worker);
                worker
                    .request_blocks
                    .fetch_add(d.request_blocks as u64, Ordering::Relaxed);
                worker
                    .hit_blocks
                    .fetch_add(d.cache_hits as u64, Ordering::Relaxed);
                server.set_down(&worker, false);
                if resp.status().is_server_error() {
                    server.worker_failed(&worker);
                } else {
                    server.worker_served(&worker);
                }
                return Ok(Sent {
                    resp,
                    guard,
                    worker,
                });
            }
            Ok(Ok(resp)) => error(
                StatusCode::BAD_GATEWAY,
                "BadGatewayError",
                format!("worker {} answered {}", worker.spec.name, resp.status()),
            ),
            Ok(Err(e)) if e.is_connect() => {
                tracing::warn!("worker {} refused the connection: {e}", worker.spec.name);
                server.set_down(&worker, true);
                error(
                    StatusCode::BAD_GATEWAY,
                    "BadGatewayError",
                    format!("worker {} refused the connection: {e}", worker.spec.name),
                )
            }
            Ok(Err(e)) => error(
                StatusCode::BAD_GATEWAY,
                "BadGatewayError",
                format!("worker {} failed the request: {e}", worker.spec.name),
            ),
            Err(_) => error(
                StatusCode::GATEWAY_TIMEOUT,
                "GatewayTimeoutError",
                format!(
                    "worker {} did not answer within --upstream-timeout-s {}",
                    worker.spec.name, server.cfg.upstream_timeout_s
                ),
            ),
        };
        // Nothing reached the client: the load is released and the next-best worker tries.
        drop(guard);
        server.worker_failed(&worker);
        last_failure = Some(failure);
    }
    Err(last_failure.unwrap_or_else(|| {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            "no worker is available",
        )
    }))
}

/// The wait before retry `attempt` (1, 2, ...): `base_ms` doubled for each retry after the
/// first, times a factor drawn between 0.5 and 1.5 so that retries do not march in step.
fn backoff(base_ms: u64, attempt: usize) -> std::time::Duration {
    let doubled = base_ms.saturating_mul(1 << attempt.saturating_sub(1).min(16));
    // Jitter from the clock's nanoseconds: no generator to seed, and no two requests in step.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let factor = 0.5 + f64::from(nanos % 1_000) / 1_000.0;
    std::time::Duration::from_secs_f64(doubled as f64 * factor / 1e3)
}

/// The request to send `worker`: the body, the client's credentials and request id, and the
/// trace (this request's span with tracing on, else the caller's headers as they came).
fn upstream_request(
    worker: &Worker,
    job: &Job,
    body: &Bytes,
    span: &tracing::Span,
) -> Result<hyper::Request<Full<Bytes>>, axum::http::Error> {
    let mut req = hyper::Request::post(format!("{}{}", worker.spec.url, job.path))
        .header(header::CONTENT_TYPE, "application/json");
    let traced = kvserve::logging::trace_headers(span);
    for (name, v) in &job.headers {
        // vLLM names its request by the request id; a traced router sends its own trace.
        if traced.is_empty() || !name.as_str().starts_with("trace") {
            req = req.header(name, v.clone());
        }
    }
    for (name, v) in traced {
        req = req.header(name, v);
    }
    req.body(Full::new(body.clone()))
}

/// A worker's answer on its way to the client. A streamed answer (`stream: true`, an event
/// stream) is forwarded event by event, and when its worker fails before `[DONE]` it continues
/// on another worker (`--migration-limit`, see [`migrate`]); anything else is forwarded as it
/// comes. The request's load is released when the answer ends, fails or the client leaves.
struct Relay {
    server: Arc<Server>,
    job: Job,
    /// The request body (the continuation is made from it).
    body: Bytes,
    upstream: BodyStream<hyper::body::Incoming>,
    /// The current attempt's load and the client's place (`None` only while moving).
    guard: Option<Finish>,
    worker: Arc<Worker>,
    /// The router needs the first token of the current attempt (`Router::prefill_done`).
    prefilling: bool,
    /// Cuts the answer into whole events; `None`: the answer is forwarded as it comes.
    events: Option<migrate::Events>,
    /// What the client has of the answer.
    answer: migrate::Answer,
    /// Set once the answer continues on another worker.
    rewrite: Option<migrate::Rewrite>,
    moves: usize,
    tried: Vec<Arc<Worker>>,
    ended: bool,
}

impl Relay {
    /// The client's response: the worker's status and headers, and the answer as a stream.
    fn respond(
        server: Arc<Server>,
        job: Job,
        body: Bytes,
        sent: Sent,
        tried: Vec<Arc<Worker>>,
    ) -> Response {
        let Sent {
            resp,
            guard,
            worker,
        } = sent;
        let (parts, incoming) = resp.into_parts();
        let served = header::HeaderValue::from_str(&worker.spec.name).ok();
        // A streamed response's first chunk carries the first token; a plain one arrives whole
        // at the end, so its request counts as prefilling until it finishes.
        let streamed = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let movable =
            streamed && job.stream && parts.status.is_success() && server.cfg.migration_limit > 0;
        let relay = Relay {
            prefilling: server.tracks_prefill && streamed,
            server,
            job,
            body,
            upstream: BodyStream::new(incoming),
            guard: Some(guard),
            worker,
            events: movable.then(migrate::Events::default),
            answer: migrate::Answer::default(),
            rewrite: None,
            moves: 0,
            tried,
            ended: false,
        };
        let stream =
            futures_util::stream::unfold(
                relay,
                |mut r| async move { r.next().await.map(|b| (b, r)) },
            );
        let mut out = Response::new(Body::from_stream(stream));
        *out.status_mut() = parts.status;
        for (k, v) in &parts.headers {
            if k != header::CONTENT_LENGTH
                && k != header::TRANSFER_ENCODING
                && k != header::CONNECTION
            {
                out.headers_mut().insert(k.clone(), v.clone());
            }
        }
        if let Some(len) = parts.headers.get(header::CONTENT_LENGTH) {
            out.headers_mut()
                .insert(header::CONTENT_LENGTH, len.clone());
        }
        // Which worker served it (when the answer moves, an SSE comment names the next one).
        if let Some(v) = served {
            out.headers_mut().insert("x-kvkit-worker", v);
        }
        out
    }

    /// The next bytes for the client; `None` at the answer's end.
    async fn next(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        loop {
            if self.ended {
                return None;
            }
            let why = match self.upstream.next().await {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    self.first_token();
                    let Some(events) = &mut self.events else {
                        return Some(Ok(data));
                    };
                    let whole = events.push(&data);
                    let out = match &self.rewrite {
                        Some(r) => r.events(&whole),
                        None => whole,
                    };
                    if out.is_empty() {
                        continue;
                    }
                    self.answer.read(&out);
                    return Some(Ok(Bytes::from(out)));
                }
                Some(Err(e)) => format!(
                    "worker {} broke off the response: {e}",
                    self.worker.spec.name
                ),
                None if self.events.is_none() || self.answer.done => {
                    self.ended = true;
                    return None;
                }
                None => format!(
                    "worker {} ended the stream before [DONE]",
                    self.worker.spec.name
                ),
            };
            self.worker.upstream_errors.fetch_add(1, Ordering::Relaxed);
            // It broke off mid-stream: skip it until its /health answers again.
            self.server.set_down(&self.worker, true);
            self.server.worker_failed(&self.worker);
            if self.answer.finished {
                // Only the end was missing.
                self.ended = true;
                return Some(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
            }
            match self.continue_elsewhere(&why).await {
                Ok(true) => return Some(Ok(self.moved_note())),
                Ok(false) => {
                    self.ended = true;
                    return Some(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
                }
                Err(e) => {
                    self.ended = true;
                    self.server
                        .counters
                        .migrations_failed
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("{e}");
                    return Some(Err(std::io::Error::other(e)));
                }
            }
        }
    }

    /// The router learns the current attempt's first token from its first bytes.
    fn first_token(&mut self) {
        if self.prefilling {
            self.prefilling = false;
            if let Some(g) = &self.guard {
                let mut m = self.server.mirror();
                let _ = m.router.prefill_done(g.id);
                self.server.flush_deltas(&mut m.router);
            }
        }
    }

    /// Sends the continuation of the answer to another worker and reads on from it: `Ok(true)`
    /// once it answers, `Ok(false)` when the answer was complete, else why it cannot move.
    async fn continue_elsewhere(&mut self, why: &str) -> Result<bool, String> {
        let limit = self.server.cfg.migration_limit;
        if self.moves >= limit
            || self.events.as_ref().is_none_or(|e| !e.whole())
            || self.answer.error
        {
            return Err(format!(
                "{why}; the answer cannot move to another worker (--migration-limit {limit})"
            ));
        }
        let encode = self
            .server
            .text
            .as_ref()
            .map(|(codec, _)| move |t: &str| codec.encode(t, false));
        let encode = encode
            .as_ref()
            .map(|f| f as &dyn Fn(&str) -> Result<Vec<u32>, String>);
        let next = migrate::continuation(self.job.endpoint, &self.body, &self.answer, encode)
            .map_err(|e| format!("{why}; the answer cannot move to another worker: {e}"))?;
        let Some(next) = next else {
            return Ok(false);
        };
        self.moves += 1;
        // The failed attempt's load goes; the client's place stays.
        let place = self.guard.take().and_then(|mut g| g.place.take());
        let sent = send(&self.server, &self.job, &Bytes::from(next), &mut self.tried)
            .await
            .map_err(|_| format!("{why}; no other worker took the rest of the answer"))?;
        let Sent {
            resp,
            mut guard,
            worker,
        } = sent;
        guard.place = place;
        self.guard = Some(guard);
        if !resp.status().is_success() {
            return Err(format!(
                "{why}; worker {} answered the rest with {}",
                worker.spec.name,
                resp.status()
            ));
        }
        tracing::warn!(
            "{why}: the answer moved to worker {} after {} tokens",
            worker.spec.name,
            self.answer.tokens
        );
        self.server
            .counters
            .migrations
            .fetch_add(1, Ordering::Relaxed);
        self.worker = worker;
        self.upstream = BodyStream::new(resp.into_body());
        self.prefilling = self.server.tracks_prefill;
        self.events = Some(migrate::Events::default());
        self.rewrite = Some(migrate::Rewrite::new(&self.answer));
        Ok(true)
    }

    /// An SSE comment naming the worker the answer moved to (the response's headers, with
    /// `x-kvkit-worker`, are gone): clients skip comments.
    fn moved_note(&self) -> Bytes {
        Bytes::from(format!(": x-kvkit-worker {}\n\n", self.worker.spec.name))
    }
}

/// How often a down worker's `/health` is asked whether it is back.
const REVIVE_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// Brings down workers back into routing once their `/health` answers 200 again.
pub async fn revive(server: Arc<Server>) {
    loop {
        tokio::time::sleep(REVIVE_EVERY).await;
        server.tick_breakers();
        server.finish_drains();
        server.check_silence();
        for w in &server.workers() {
            if !w.down.load(Ordering::Relaxed) {
                continue;
            }
            let Ok(req) =
                hyper::Request::get(format!("{}/health", w.spec.url)).body(Full::new(Bytes::new()))
            else {
                continue;
            };
            let answer = tokio::time::timeout(REVIVE_EVERY, server.client.request(req)).await;
            if matches!(answer, Ok(Ok(ref r)) if r.status().is_success()) {
                server.set_down(w, false);
            }
        }
    }
}

async fn models(State(server): State<Arc<Server>>) -> Response {
    let mut seen = std::collections::BTreeMap::new();
    let mut answers = Vec::new();
    for w in &server.workers() {
        answers.push((
            w.spec.name.clone(),
            crate::state::worker_models(&server, w).await,
        ));
    }
    server
        .lora
        .learn(answers.iter().map(|(n, a)| (n.as_str(), a.as_ref())));
    for v in answers.iter().filter_map(|(_, a)| a.as_ref()) {
        for m in v["data"].as_array().into_iter().flatten() {
            if let Some(id) = m["id"].as_str() {
                seen.entry(id.to_string()).or_insert_with(|| m.clone());
            }
        }
    }
    let data: Vec<Value> = seen.into_values().collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(server): State<Arc<Server>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        server.metrics_text(),
    )
        .into_response()
}

async fn cache_view(State(server): State<Arc<Server>>, Path(name): Path<String>) -> Response {
    match server.worker_named(&name) {
        Some(w) => {
            let n = server.mirror().router.cache_view(w.id);
            axum::Json(json!({"worker_id": name, "block_count": n})).into_response()
        }
        None => error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("no worker {name:?}: workers are named host:port"),
        ),
    }
}

/// `POST /v1/admin/workers` with `{"url": ..., "events": ..., "replay": ...}` (the last two
/// optional, as `--worker`'s): adds the worker and follows its KV events. 201, or 409 when a
/// worker of that name is there, or 400.
async fn add_worker(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad(format!("the body is not JSON: {e}")),
    };
    let field = |k: &str| v.get(k).and_then(Value::as_str);
    let Some(url) = field("url") else {
        return bad(
            r#"expected {"url": "http://HOST:PORT", "events": "tcp://HOST:PORT", "replay": "tcp://HOST:PORT"} (events and replay optional)"#,
        );
    };
    let mut spec = url.to_string();
    for k in ["events", "replay"] {
        if let Some(ep) = field(k) {
            spec.push_str(&format!(",{k}={ep}"));
        }
    }
    let spec: crate::config::WorkerSpec = match spec.parse() {
        Ok(s) => s,
        Err(e) => return bad(e),
    };
    if server.worker_named(&spec.name).is_some() {
        return error(
            StatusCode::CONFLICT,
            "ConflictError",
            format!("worker {} is there already", spec.name),
        );
    }
    match server.add_worker(spec) {
        Ok(w) => {
            crate::discovery::follow_events(&server, &w);
            tracing::info!("worker {} added", w.spec.name);
            (
                StatusCode::CREATED,
                axum::Json(json!({"worker_id": w.spec.name, "url": w.spec.url})),
            )
                .into_response()
        }
        Err(e) => error(StatusCode::CONFLICT, "ConflictError", e),
    }
}

/// `DELETE /v1/admin/workers/{host:port}`: removes the worker at once (its streams in progress
/// go on; their load is forgotten with it). 404 when there is none.
async fn remove_worker(State(server): State<Arc<Server>>, Path(name): Path<String>) -> Response {
    match server.remove_worker(&name) {
        Some(w) => {
            tracing::info!("worker {} removed", w.spec.name);
            axum::Json(json!({"removed": w.spec.name})).into_response()
        }
        None => no_worker(&name),
    }
}

/// `POST /v1/admin/workers/{host:port}/drain`: the worker gets no new requests and is removed
/// once its in-flight ones have finished. 202, or 404.
async fn drain_worker(State(server): State<Arc<Server>>, Path(name): Path<String>) -> Response {
    if server.set_draining(&name, true) {
        (StatusCode::ACCEPTED, axum::Json(json!({"draining": name}))).into_response()
    } else {
        no_worker(&name)
    }
}

fn no_worker(name: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "NotFoundError",
        format!("no worker {name}"),
    )
}

async fn workers(State(server): State<Arc<Server>>) -> Response {
    // The worker list first: add/remove take it before the mirror, so never the other way round.
    let all = server.workers();
    let m = server.mirror();
    let list: Vec<Value> = all
        .iter()
        .map(|w| {
            json!({
                "worker_id": w.spec.name,
                "url": w.spec.url,
                "state": if w.draining.load(Ordering::Relaxed) {
                    "draining"
                } else if w.down.load(Ordering::Relaxed) {
                    "down"
                } else {
                    "up"
                },
                "breaker": server.breaker_state(w).name(),
                "block_count": m.router.cache_view(w.id),
                "in_flight": m.router.in_flight(w.id),
                "position": m.ingest.position(w.id),
                "active_blocks": m.router.active_blocks(w.id),
                "stale": m.router.index().is_stale(w.id),
                // Served requests for --event-silence-s without a KV event.
                "silent": w.silent.load(Ordering::Relaxed),
                // Whether its ZMQ KV-event subscription is up (null: it publishes none, or
                // its events come through NATS).
                "subscribed": (w.spec.events.is_some()
                    && server.cfg.kv_event_transport == crate::config::EventTransport::Zmq)
                    .then(|| w.subscribed.load(Ordering::Acquire)),
                "routed": w.routed.load(Ordering::Relaxed),
                "upstream_errors": w.upstream_errors.load(Ordering::Relaxed),
                // Its engine's load as its /metrics last said (--scrape-metrics-s), or null.
                "engine": crate::telemetry::admin_json(w),
            })
        })
        .collect();
    axum::Json(json!({"workers": list, "lora_adapters": server.lora.names()})).into_response()
}

mod log {
    use kvroute::Decision;

    use crate::state::Worker;

    /// One line per decision at `RUST_LOG=kvrouter=debug`, in the request's span.
    pub(super) fn decision(w: &Worker, d: &Decision) {
        tracing::debug!(
            worker = %w.spec.name,
            hits = d.cache_hits,
            blocks = d.request_blocks,
            cost = d.cost,
            "routed"
        );
    }
}
