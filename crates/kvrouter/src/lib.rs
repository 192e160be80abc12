//! `kvrouter`: the KV-aware router server of the source document, on `kvroute`.
//!
//! Engines (vLLM, SGLang, `kvmock`) publish their KV events over ZMQ; the server mirrors every
//! worker's cache from them ([`kvroute_vllm`]), tokenises each OpenAI-compatible request with
//! the model's tokenizer (and chat template), scores every worker with the cost function,
//! forwards the request body unchanged to the winner and streams the response back, releasing
//! the request's load when the stream ends, fails or the client goes away. A worker that
//! refuses a connection is marked down (routing skips it; its mirror and subscription stay, so it
//! comes back warm) and the next-best worker gets the request.
//!
//! | method and path | what |
//! |---|---|
//! | `POST /v1/completions`, `POST /v1/chat/completions` | routed and forwarded |
//! | `GET /v1/models` | the union of the workers' models |
//! | `GET /health` | `ok` |
//! | `GET /metrics` | Prometheus text: requests routed per worker, request and hit blocks, events applied, gaps, replays, stale workers, cache views, route latency, upstream errors |
//! | `GET /v1/admin/cache-view/{worker}` | `{"worker_id": "host:port", "block_count": n}` |
//! | `GET /v1/admin/workers` | every worker's cache view, load, staleness, state and whether its ZMQ event subscription is up (`subscribed`) |
//!
//! Errors are OpenAI's error objects: 400 for a malformed body or a text prompt without a
//! tokenizer, 413 for a body over `--max-body-bytes`, 503 when no worker is available.
//!
//! ```no_run
//! use clap::Parser;
//! let cfg = kvrouter::Config::parse_from(["kvrouter", "--port", "8000",
//!     "--worker", "http://127.0.0.1:30000,events=tcp://127.0.0.1:5557"]);
//! let rt = tokio::runtime::Runtime::new()?;
//! rt.block_on(kvrouter::run(cfg, std::future::pending()))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod breaker;
pub mod config;
pub mod discovery;
pub mod events;
mod feeds;
pub mod histogram;
pub mod lora;
mod migrate;
pub mod nats;
pub mod proxy;
pub mod ratelimit;
pub mod relay;
pub mod state;
pub mod telemetry;

use std::sync::Arc;

pub use config::{Config, WorkerSpec};
pub use state::Server;

/// Errors of the server's set-up; each names the flag.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// A setting that cannot be used.
    #[error("{flag}: {message}")]
    Setting {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The listening socket could not be opened.
    #[error("--host/--port {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Runs the server for `cfg` until `shutdown` resolves: binds, subscribes to every worker's
/// events, serves.
pub async fn run(
    cfg: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Listen {
            addr: addr.clone(),
            source,
        })?;
    serve(listener, cfg, shutdown).await
}

/// [`run`] on a listener already bound (tests bind port 0).
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let statics = cfg.workers.clone();
    let etcd = match cfg.discovery_backend {
        config::Discovery::Static => None,
        config::Discovery::Etcd => Some(cfg.etcd_endpoint.clone()),
    };
    let on_nats = cfg.kv_event_transport == config::EventTransport::Nats;
    let sync = cfg.router_replica_sync;
    let snapshot_every = cfg.snapshot_every;
    let nats_url = cfg.nats_url.clone();
    let server = Arc::new(Server::new(cfg)?);
    if on_nats || sync {
        let bad = |message| ServerError::Setting {
            flag: "--nats-url",
            message,
        };
        let nats = nats::connect(&nats_url, std::time::Duration::from_secs(30))
            .await
            .map_err(bad)?;
        if on_nats {
            // The newest snapshot, then each worker's stream from the position it records.
            // An unreadable snapshot costs time, not state: the stream is replayed from its
            // start instead.
            match feeds::load_snapshot(&nats).await {
                Ok(Some((ids, mirror))) => {
                    if let Err(e) = server.restore(ids, mirror) {
                        tracing::warn!(
                            "snapshot not restored ({e}): replaying the stream from its start"
                        );
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("{e}: replaying the stream from its start"),
            }
        }
        let _ = server.nats.set(nats);
        if sync {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let _ = server.deltas.set(tx);
            tokio::spawn(feeds::publish_deltas(Arc::clone(&server), rx));
            tokio::spawn(feeds::apply_deltas(Arc::clone(&server)));
        }
    }
    for spec in statics {
        let w = server
            .add_worker(spec)
            .map_err(|message| ServerError::Setting {
                flag: "--worker",
                message,
            })?;
        discovery::follow_events(&server, &w);
    }
    if let (true, Some(nats)) = (on_nats, server.nats.get()) {
        let took =
            feeds::catch_up(&server, nats)
                .await
                .map_err(|message| ServerError::Setting {
                    flag: "--nats-url",
                    message,
                })?;
        server.counters.catch_up_ms.store(
            took.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        tracing::info!(
            "caught up with the KV-event stream in {} ms",
            took.as_millis()
        );
        if snapshot_every > 0 {
            tokio::spawn(feeds::snapshot_loop(Arc::clone(&server), snapshot_every));
        }
    }
    if let Some(endpoint) = etcd {
        tokio::spawn(discovery::watch_etcd(Arc::clone(&server), endpoint));
    }
    tokio::spawn(proxy::revive(Arc::clone(&server)));
    tokio::spawn(state::watch_adapters(Arc::clone(&server)));
    if server.cfg.scrape_metrics_s > 0.0 {
        let every = std::time::Duration::from_secs_f64(server.cfg.scrape_metrics_s);
        tokio::spawn(telemetry::scrape_loop(Arc::clone(&server), every));
    }
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    // No Nagle delay: streamed chunks leave when the engine sends them.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, proxy::app(server))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|source| ServerError::Listen { addr, source })
}
