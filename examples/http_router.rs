//! A KV-aware HTTP router: vLLM KV events in, routing decisions out.
//!
//! ```text
//! cargo run --release --example http_router -- --port 8000 --block-size 16 --policy kv --overlap-weight 1.0
//! ```
//!
//! Endpoints (workers are named by strings such as `0.0.0.0:30000`):
//!
//! | method and path | body | answer |
//! |---|---|---|
//! | `POST /v1/kv-events/{worker}` | one raw vLLM MessagePack `EventBatch`; header `x-kv-seq` may carry its sequence number (else the next one) | 200 with a JSON summary; 400 with the reason as text for a bad payload, 409 for a replayed sequence number |
//! | `POST /v1/route` | `{"request_id": 1, "token_ids": [...]}` or `"block_hashes": [...]`, optional `"role"`: `"unified"`, `"prefill"` or `"decode"`; with token ids also `"lora_name"`, `"cache_salt"` and `"mm_items": [{"identifier": "...", "offset": n, "length": n}]` (a multimodal prompt's items, so only the same image hits) | `{"worker_id": "...", "cache_hits": n, "cost": x, "request_blocks": n}` |
//! | `POST /v1/finish/{request_id}` | | `{"request_id": n}`; 404 for a request not in flight |
//! | `GET /v1/admin/cache-view/{worker}` | | `{"worker_id": "...", "block_count": n}` |
//! | `POST /v1/workers/{worker}` | | registers a worker (201; 200 if it was already) |
//! | `DELETE /v1/workers/{worker}` | | removes it and its mirrored blocks (404 if unknown) |
//! | `GET /v1/workers` | | every worker with its cache view, load and staleness |
//!
//! A worker is registered by its first valid KV-event batch or explicitly. Errors of the JSON
//! endpoints are `{"error": "..."}` with a 4xx status.
//!
//! ```text
//! curl -X POST localhost:8000/v1/kv-events/0.0.0.0:30000 -H 'content-type: application/msgpack' \
//!      -H 'x-kv-seq: 0' --data-binary @crates/kvroute-vllm/tests/fixtures/stored_positional_int.msgpack
//! curl -X POST localhost:8000/v1/route -d '{"request_id": 1, "token_ids": [0, 1, 2, ..., 63]}'
//! curl localhost:8000/v1/admin/cache-view/0.0.0.0:30000
//! curl -X POST localhost:8000/v1/finish/1
//! ```
//!
//! The server is also a library for the integration test (`tests/http_router.rs` includes this
//! file as a module): [`app`] builds the axum router over an [`AppState`], and [`serve`] runs it on
//! a listener until a shutdown future resolves.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use kvkit::kvblock::{vllm_extra_keys, MultimodalSpan};
use kvkit::kvblock::{BlockHash, BlockSize};
use kvkit::kvroute::{self, Policy, RequestId, Role, Router, Salt, WorkerId};
use kvkit::kvroute_vllm::{decode_event_batch, IngestSummary, VllmError, VllmIngest};
use serde::Deserialize;
use serde_json::{json, Value};

/// Largest accepted request body: a vLLM batch of thousands of blocks fits comfortably.
const BODY_LIMIT: usize = 16 << 20;
/// Longest accepted worker name, in bytes.
const NAME_MAX: usize = 256;

/// The router's settings and where to listen.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to bind (127.0.0.1 unless `--host` says otherwise).
    pub host: IpAddr,
    /// Port to bind (0: any free port).
    pub port: u16,
    /// Tokens per block; must equal the engines' `--block-size`.
    pub block_size: BlockSize,
    /// The routing policy.
    pub policy: Policy,
    /// The global overlap weight.
    pub overlap_weight: f64,
    /// The prefill role's weight, if set.
    pub prefill_overlap_weight: Option<f64>,
    /// The decode role's weight, if set.
    pub decode_overlap_weight: Option<f64>,
    /// The tie-breaking seed.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8000,
            block_size: BlockSize::new(16).unwrap_or_else(|_| unreachable!("16 is valid")),
            policy: Policy::Kv,
            overlap_weight: 1.0,
            prefill_overlap_weight: None,
            decode_overlap_weight: None,
            seed: 0,
        }
    }
}

const USAGE: &str = "\
A KV-aware HTTP router fed by vLLM KV events.

Usage: http_router [OPTIONS]

Options:
  --host <ADDR>                     address to bind [default: 127.0.0.1]
  --port <PORT>                     port to bind [default: 8000]
  --block-size <TOKENS>             tokens per KV block, as the engines' --block-size [default: 16]
  --policy <POLICY>                 kv, prefix_aware, round_robin or random [default: kv]
  --overlap-weight <W>              cache locality versus load balance [default: 1.0]
  --prefill-overlap-weight <W>      weight for role \"prefill\" [default: the overlap weight]
  --decode-overlap-weight <W>       weight for role \"decode\" [default: the overlap weight]
  --seed <N>                        tie-breaking seed [default: 0]
  -h, --help                        print this help
";

/// Parses the command line (`--flag value` or `--flag=value`). `Ok(None)` means `--help`.
pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Option<Config>, String> {
    fn num<T: std::str::FromStr>(flag: &str, v: &str, what: &str) -> Result<T, String> {
        v.parse()
            .map_err(|_| format!("invalid value {v:?} for {flag}: expected {what}"))
    }
    let mut c = Config::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(None);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        if !matches!(
            flag.as_str(),
            "--host"
                | "--port"
                | "--block-size"
                | "--policy"
                | "--overlap-weight"
                | "--prefill-overlap-weight"
                | "--decode-overlap-weight"
                | "--seed"
        ) {
            return Err(format!("unknown argument {arg:?} (see --help)"));
        }
        let v = match inline.or_else(|| args.next()) {
            Some(v) => v,
            None => return Err(format!("{flag} needs a value (see --help)")),
        };
        match flag.as_str() {
            "--host" => c.host = num(&flag, &v, "an IP address such as 127.0.0.1")?,
            "--port" => c.port = num(&flag, &v, "a port from 0 to 65535")?,
            "--block-size" => {
                let n: usize = num(&flag, &v, "a whole number of tokens")?;
                c.block_size = BlockSize::new(n).map_err(|e| format!("--block-size: {e}"))?;
            }
            "--policy" => c.policy = v.parse().map_err(|e| format!("--policy: {e}"))?,
            "--overlap-weight" => c.overlap_weight = num(&flag, &v, "a number >= 0")?,
            "--prefill-overlap-weight" => {
                c.prefill_overlap_weight = Some(num(&flag, &v, "a number >= 0")?);
            }
            "--decode-overlap-weight" => {
                c.decode_overlap_weight = Some(num(&flag, &v, "a number >= 0")?);
            }
            _ => c.seed = num(&flag, &v, "a whole number")?,
        }
    }
    Ok(Some(c))
}

/// The server's shared state: one router, its vLLM adapter and the worker names, behind one
/// mutex (every handler holds it for microseconds and never across an `.await`).
#[derive(Debug)]
pub struct AppState {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    router: Router,
    ingest: VllmIngest,
    by_name: BTreeMap<String, WorkerId>,
    names: BTreeMap<WorkerId, String>,
    /// Ids are never reused, so a re-registered name starts afresh.
    next_id: u64,
}

impl AppState {
    /// A router built from `config`, with no worker.
    pub fn new(config: &Config) -> Result<Self, kvroute::Error> {
        let mut b = Router::builder()
            .block_size(config.block_size)
            .policy(config.policy)
            .overlap_weight(config.overlap_weight)
            .seed(config.seed);
        if let Some(w) = config.prefill_overlap_weight {
            b = b.prefill_overlap_weight(w);
        }
        if let Some(w) = config.decode_overlap_weight {
            b = b.decode_overlap_weight(w);
        }
        Ok(AppState {
            inner: Mutex::new(Inner {
                router: b.build()?,
                ingest: VllmIngest::new(),
                by_name: BTreeMap::new(),
                names: BTreeMap::new(),
                next_id: 0,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A handler cannot leave the state half-updated on a panic that matters here; carry on.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Inner {
    /// Registers `name` if new; returns its id and whether it was new.
    fn register(&mut self, name: &str) -> (WorkerId, bool) {
        if let Some(&id) = self.by_name.get(name) {
            return (id, false);
        }
        let id = WorkerId::new(self.next_id);
        self.next_id += 1;
        self.router.add_worker(id);
        self.by_name.insert(name.to_string(), id);
        self.names.insert(id, name.to_string());
        (id, true)
    }

    fn unregister(&mut self, name: &str) -> bool {
        let Some(id) = self.by_name.remove(name) else {
            return false;
        };
        self.names.remove(&id);
        self.router.remove_worker(id);
        self.ingest.forget_worker(id);
        true
    }

    fn name(&self, id: WorkerId) -> String {
        self.names
            .get(&id)
            .cloned()
            .unwrap_or_else(|| id.get().to_string())
    }
}

/// The HTTP routes over `state`.
pub fn app(state: Arc<AppState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/kv-events/{worker}", post(kv_events))
        .route("/v1/route", post(route))
        .route("/v1/finish/{request_id}", post(finish))
        .route("/v1/admin/cache-view/{worker}", get(cache_view))
        .route("/v1/workers", get(list_workers))
        .route(
            "/v1/workers/{worker}",
            post(add_worker).delete(remove_worker),
        )
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

/// Serves [`app`] for a new router built from `config` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let state = Arc::new(AppState::new(config)?);
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

fn text_error(status: StatusCode, msg: impl Into<String>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        msg.into() + "\n",
    )
        .into_response()
}

fn json_error(status: StatusCode, msg: impl std::fmt::Display) -> Response {
    (status, Json(json!({ "error": msg.to_string() }))).into_response()
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_MAX {
        return Err(format!(
            "invalid worker name of {} bytes: expected 1 to {NAME_MAX}",
            name.len()
        ));
    }
    Ok(())
}

fn summary_json(name: &str, s: &IngestSummary, block_count: usize) -> Value {
    json!({
        "worker_id": name,
        "seq": s.seq,
        "events": s.events,
        "events_applied": s.events_applied,
        "blocks_stored": s.blocks_stored,
        "blocks_removed": s.blocks_removed,
        "blocks_cleared": s.blocks_cleared,
        "unknown_removals": s.unknown_removals,
        "unknown_parents": s.unknown_parents,
        "gap": s.gap.map(|(expected, got)| json!({ "expected": expected, "got": got })),
        "restarted": s.restarted,
        "block_count": block_count,
    })
}

async fn kv_events(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(e) = check_name(&name) {
        return text_error(StatusCode::BAD_REQUEST, e);
    }
    let seq = match headers.get("x-kv-seq").map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => match v.trim().parse::<u64>() {
            Ok(n) => Some(n),
            Err(_) => {
                return text_error(
                    StatusCode::BAD_REQUEST,
                    format!("invalid x-kv-seq {v:?}: expected a whole number"),
                )
            }
        },
        Some(Err(_)) => {
            return text_error(
                StatusCode::BAD_REQUEST,
                "invalid x-kv-seq: expected a whole number",
            )
        }
    };
    // Decode before taking the lock or registering anything: a garbage post must not create a
    // worker that would then receive traffic.
    let batch = match decode_event_batch(&body) {
        Ok(b) => b,
        Err(e) => return text_error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let mut guard = state.lock();
    let inner = &mut *guard;
    let (id, new) = inner.register(&name);
    match inner.ingest.apply_batch(&mut inner.router, id, seq, &batch) {
        Ok(s) => {
            let count = inner.router.cache_view(id);
            (StatusCode::OK, Json(summary_json(&name, &s, count))).into_response()
        }
        Err(e) => {
            if new {
                inner.unregister(&name);
            }
            let status = match e {
                VllmError::DuplicateSequence { .. } => StatusCode::CONFLICT,
                _ => StatusCode::BAD_REQUEST,
            };
            text_error(status, e.to_string())
        }
    }
}

/// The body of `POST /v1/route`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteRequest {
    request_id: u64,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    block_hashes: Option<Vec<u64>>,
    #[serde(default)]
    role: Option<String>,
    /// The LoRA adapter the request runs on: its blocks are salted with the name, as the
    /// engine's events are.
    #[serde(default)]
    lora_name: Option<String>,
    /// The prompt's multimodal items (images, ...), whose blocks vLLM keys by identifier.
    #[serde(default)]
    mm_items: Vec<MmItem>,
    /// The request's cache salt (vLLM's `cache_salt`), which keys its first block.
    #[serde(default)]
    cache_salt: Option<String>,
}

/// A multimodal item of `POST /v1/route`: its identifier and the placeholder tokens it fills.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MmItem {
    identifier: String,
    offset: usize,
    length: usize,
}

async fn route(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: RouteRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")),
    };
    let role = match req.role.as_deref() {
        None | Some("unified") => Role::Unified,
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        Some(other) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                format!("unknown role {other:?}: expected unified, prefill or decode"),
            )
        }
    };
    let mut inner = state.lock();
    let decision = match (&req.token_ids, &req.block_hashes) {
        (Some(tokens), None) => {
            let salt = Salt::lora(req.lora_name.clone().unwrap_or_default());
            let items: Vec<MultimodalSpan> = req
                .mm_items
                .iter()
                .map(|m| MultimodalSpan::new(m.identifier.clone(), m.offset, m.length))
                .collect();
            let bs = inner.router.block_size();
            let keys = vllm_extra_keys(bs, tokens.len(), &items, req.cache_salt.as_deref());
            inner.router.route_tokens_keyed(
                RequestId::new(req.request_id),
                tokens,
                &salt,
                &keys,
                role,
            )
        }
        (None, Some(hashes)) => {
            let blocks: Vec<BlockHash> = hashes.iter().map(|&h| BlockHash::new(h)).collect();
            inner
                .router
                .route(RequestId::new(req.request_id), &blocks, role)
        }
        _ => {
            return json_error(
                StatusCode::BAD_REQUEST,
                "expected exactly one of token_ids and block_hashes",
            )
        }
    };
    match decision {
        Ok(d) => Json(json!({
            "worker_id": inner.name(d.worker),
            "cache_hits": d.cache_hits,
            "cost": d.cost,
            "request_blocks": d.request_blocks,
        }))
        .into_response(),
        // Both are conflicts with the router's current state, not malformed requests.
        Err(e @ (kvroute::Error::NoWorkers | kvroute::Error::DuplicateRequest { .. })) => {
            json_error(StatusCode::CONFLICT, e)
        }
        Err(e) => json_error(StatusCode::BAD_REQUEST, e),
    }
}

async fn finish(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let Ok(request_id) = id.parse::<u64>() else {
        return json_error(
            StatusCode::BAD_REQUEST,
            format!("invalid request id {id:?}: expected a whole number"),
        );
    };
    match state.lock().router.finish(RequestId::new(request_id)) {
        Ok(()) => Json(json!({ "request_id": request_id })).into_response(),
        Err(e) => json_error(StatusCode::NOT_FOUND, e),
    }
}

async fn cache_view(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    let inner = state.lock();
    match inner.by_name.get(&name) {
        Some(&id) => Json(json!({
            "worker_id": name,
            "block_count": inner.router.cache_view(id),
        }))
        .into_response(),
        None => json_error(StatusCode::NOT_FOUND, format!("unknown worker {name:?}")),
    }
}

async fn list_workers(State(state): State<Arc<AppState>>) -> Response {
    let inner = state.lock();
    let workers: Vec<Value> = inner
        .by_name
        .iter()
        .map(|(name, &id)| {
            json!({
                "worker_id": name,
                "block_count": inner.router.cache_view(id),
                "active_blocks": inner.router.active_blocks(id),
                "in_flight": inner.router.in_flight(id),
                "stale": inner.router.index().is_stale(id),
                "next_seq": inner.ingest.next_seq(id),
            })
        })
        .collect();
    Json(json!({ "workers": workers })).into_response()
}

async fn add_worker(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    if let Err(e) = check_name(&name) {
        return json_error(StatusCode::BAD_REQUEST, e);
    }
    let (_, new) = state.lock().register(&name);
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, Json(json!({ "worker_id": name, "created": new }))).into_response()
}

async fn remove_worker(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    if state.lock().unregister(&name) {
        Json(json!({ "worker_id": name, "removed": true })).into_response()
    } else {
        json_error(StatusCode::NOT_FOUND, format!("unknown worker {name:?}"))
    }
}

fn main() -> ExitCode {
    let config = match parse_args(std::env::args().skip(1)) {
        Ok(Some(c)) => c,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // Invalid settings (a negative weight, ...) are usage errors, reported before binding.
    if let Err(e) = AppState::new(&config) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let addr = SocketAddr::new(config.host, config.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        eprintln!(
            "http_router listening on http://{} (block size {}, policy {}, overlap weight {})",
            listener.local_addr().map_err(|e| e.to_string())?,
            config.block_size,
            config.policy,
            config.overlap_weight,
        );
        let ctrl_c = async {
            // If the signal handler cannot be installed, run until killed.
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        serve(listener, &config, ctrl_c)
            .await
            .map_err(|e| e.to_string())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
