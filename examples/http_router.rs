//! Embedding the router in your own HTTP service: vLLM's KV events in, routing decisions out.
//! A sketch of what an embedding needs (one `Router` and one `VllmIngest` behind a mutex); the
//! full router server, an OpenAI proxy with ZMQ subscriptions, replicas and metrics, is
//! `kvrouter`.
//!
//! ```text
//! cargo run --release --example http_router -- 8000
//! curl -X POST localhost:8000/v1/kv-events/w0 \
//!      --data-binary @crates/kvroute-vllm/tests/fixtures/stored_positional_int.msgpack
//! curl -X POST localhost:8000/v1/route -d '{"request_id": 1, "token_ids": [0, 1, 2, 3]}'
//! curl -X POST localhost:8000/v1/finish/1
//! ```
//!
//! - `POST /v1/kv-events/{worker}`: one vLLM MessagePack `EventBatch` (the worker is registered
//!   on first sight); 400 with the reason for a bad one.
//! - `POST /v1/route`: `{"request_id": n, "token_ids": [...]}` gives `{"worker", "cache_hits",
//!   "cost"}`; 409 for a request already in flight.
//! - `POST /v1/finish/{request_id}`: releases its load; 404 for one not in flight.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Json;
use kvkit::kvblock::BlockSize;
use kvkit::kvroute::{Error, RequestId, Role, Router, WorkerId};
use kvkit::kvroute_vllm::VllmIngest;
use serde::Deserialize;
use serde_json::{json, Value};

/// The router, its vLLM feeds, and the workers by name.
pub struct Mirror {
    router: Router,
    ingest: VllmIngest,
    names: BTreeMap<String, WorkerId>,
}

type Shared = Arc<Mutex<Mirror>>;
type Answer = (StatusCode, Json<Value>);

fn answer(status: StatusCode, body: Value) -> Answer {
    (status, Json(body))
}

/// The service over a router of `block_size` tokens per block (the engines' `--block-size`).
pub fn app(block_size: BlockSize) -> Result<axum::Router, Error> {
    let router = Router::builder().block_size(block_size).build()?;
    let mirror = Mirror {
        router,
        ingest: VllmIngest::new(),
        names: BTreeMap::new(),
    };
    Ok(axum::Router::new()
        .route("/v1/kv-events/{worker}", post(events))
        .route("/v1/route", post(route))
        .route("/v1/finish/{request_id}", post(finish))
        .with_state(Arc::new(Mutex::new(mirror))))
}

async fn events(State(m): State<Shared>, Path(worker): Path<String>, body: Bytes) -> Answer {
    let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
    let m = &mut *m;
    let next = WorkerId::new(m.names.len() as u64);
    let id = *m.names.entry(worker).or_insert(next);
    m.router.add_worker(id);
    match m.ingest.apply_payload(&mut m.router, id, None, &body) {
        Ok(s) => answer(StatusCode::OK, json!({"blocks_stored": s.blocks_stored})),
        Err(e) => answer(StatusCode::BAD_REQUEST, json!({"error": e.to_string()})),
    }
}

#[derive(Deserialize)]
struct RouteRequest {
    request_id: u64,
    token_ids: Vec<u32>,
}

async fn route(State(m): State<Shared>, body: Bytes) -> Answer {
    let req: RouteRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return answer(StatusCode::BAD_REQUEST, json!({"error": e.to_string()})),
    };
    let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
    match m.router.route_tokens(
        RequestId::new(req.request_id),
        &req.token_ids,
        Role::Unified,
    ) {
        Ok(d) => {
            let name = m.names.iter().find(|(_, &w)| w == d.worker).map(|(n, _)| n);
            answer(
                StatusCode::OK,
                json!({"worker": name, "cache_hits": d.cache_hits, "cost": d.cost}),
            )
        }
        Err(e @ Error::DuplicateRequest { .. }) => {
            answer(StatusCode::CONFLICT, json!({"error": e.to_string()}))
        }
        Err(e) => answer(StatusCode::BAD_REQUEST, json!({"error": e.to_string()})),
    }
}

async fn finish(State(m): State<Shared>, Path(id): Path<u64>) -> Answer {
    let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
    match m.router.finish(RequestId::new(id)) {
        Ok(()) => answer(StatusCode::OK, json!({"request_id": id})),
        Err(e) => answer(StatusCode::NOT_FOUND, json!({"error": e.to_string()})),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = std::env::args().nth(1).unwrap_or("8000".into()).parse()?;
    let app = app(BlockSize::new(16)?)?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("routing on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
