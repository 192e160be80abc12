//! The server's shared state: the router and its vLLM adapter behind one lock, the workers,
//! the tokenizer and the counters `/metrics` shows.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvblock::BlockSize;
use kvroute::{LoadDelta, Router, WorkerId};
use kvroute_vllm::VllmIngest;
use kvserve::tokenize::{self, ChatTemplate, Codec};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use crate::breaker::{Breaker, BreakerConfig};
use crate::config::{Config, WorkerSpec};
use crate::histogram::Histogram;
use crate::ServerError;

/// The HTTP client that forwards requests to the workers.
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The router and its vLLM adapter: changed together, so one lock.
#[derive(Debug)]
pub struct Mirror {
    /// The router.
    pub router: Router,
    /// Its vLLM event adapter.
    pub ingest: VllmIngest,
}

/// One worker (an engine).
#[derive(Debug)]
pub struct Worker {
    /// Its id in the router.
    pub id: WorkerId,
    /// Where it is.
    pub spec: WorkerSpec,
    /// Refused a connection, and has not answered since: routing skips it.
    pub down: AtomicBool,
    /// Requests routed to it.
    pub routed: AtomicU64,
    /// Requests it failed (refused, or broke off mid-stream).
    pub upstream_errors: AtomicU64,
    /// Full prompt blocks of the requests routed to it.
    pub request_blocks: AtomicU64,
    /// Of those, blocks the router predicted cached on it.
    pub hit_blocks: AtomicU64,
    /// Its NATS follower has read its events to the end of the stream once.
    pub caught_up: AtomicBool,
    /// Its circuit breaker (`--breaker-failures`).
    pub breaker: Mutex<Breaker>,
    /// When (milliseconds since the server started, plus one; 0: none) the first request was
    /// routed to it after its last KV-event batch.
    pub unconfirmed_since_ms: AtomicU64,
    /// Flagged silent: it served requests for `--event-silence-s` without an event.
    pub silent: AtomicBool,
    /// Draining: it gets no new requests, and is removed once its in-flight ones finish.
    pub draining: AtomicBool,
    /// Its ZMQ KV-event subscription is connected and subscribed (a readiness signal:
    /// `/v1/admin/workers` shows it).
    pub subscribed: AtomicBool,
    /// Its KV-event subscription, stopped when the worker is removed.
    pub(crate) task: Mutex<Option<tokio::task::AbortHandle>>,
    /// What its engine's `/metrics` last said of its load (`--scrape-metrics-s`).
    pub engine: crate::telemetry::Scraped,
}

/// Server-wide counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// vLLM batches applied.
    pub batches_applied: AtomicU64,
    /// vLLM batches rejected (malformed, invalid, replayed).
    pub batches_rejected: AtomicU64,
    /// Batches that followed missed ones.
    pub gaps: AtomicU64,
    /// Publisher restarts seen without their batch 0 (the mirror was started afresh).
    pub restarts: AtomicU64,
    /// Replay requests sent.
    pub replays: AtomicU64,
    /// Batches obtained by replay and applied.
    pub replayed_batches: AtomicU64,
    /// Other replicas' load deltas applied.
    pub deltas_applied: AtomicU64,
    /// Other replicas' load-delta messages that did not parse.
    pub deltas_rejected: AtomicU64,
    /// Snapshots stored.
    pub snapshots: AtomicU64,
    /// Requests waiting for a place under --max-concurrency.
    pub queued: AtomicU64,
    /// Requests turned away with 429 after --queue-timeout-ms.
    pub rejected_busy: AtomicU64,
    /// Tries on another worker after a failure before the first byte.
    pub retries: AtomicU64,
    /// Workers flagged silent (`--event-silence-s`).
    pub silent_feeds: AtomicU64,
    /// Circuit breakers opened.
    pub breaker_opened: AtomicU64,
    /// Streamed answers moved to another worker after their worker failed mid-stream.
    pub migrations: AtomicU64,
    /// Mid-stream failures that could not move (limit reached, request not continuable, no
    /// worker took it): the client's stream broke off.
    pub migrations_failed: AtomicU64,
    /// Session turns that went to another worker than the session's last one.
    pub session_moves: AtomicU64,
    /// How long the start took to catch up with the event stream, milliseconds.
    pub catch_up_ms: AtomicU64,
    /// 1 when the start restored a snapshot.
    pub restored: AtomicU64,
    /// Requests answered 429 by `--rate-limit`.
    pub rate_limited: AtomicU64,
}

/// Upper bounds of the route-latency histogram's buckets, microseconds.
pub const LATENCY_BUCKETS_US: [u64; 9] = [5, 10, 25, 50, 100, 250, 500, 1_000, 5_000];

/// Upper bounds of the KV-event lag histogram's buckets, microseconds (1 ms to 10 s).
pub const LAG_BUCKETS_US: [u64; 10] = [
    1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 500_000, 1_000_000, 10_000_000,
];

/// The shared state of a running server.
pub struct Server {
    /// The settings.
    pub cfg: Config,
    mirror: Mutex<Mirror>,
    workers: RwLock<Vec<Arc<Worker>>>,
    next_worker: AtomicU64,
    /// The tokenizer and chat template, when `--router-tokenizer-path` was given.
    pub text: Option<(Codec, ChatTemplate)>,
    /// Counters for `/metrics`.
    pub counters: Counters,
    /// Route decision latency (tokenising excluded).
    pub route_latency: Histogram,
    /// From a KV-event batch's publication (its `ts`) to its application here.
    pub kv_event_lag: Histogram,
    /// How long requests waited for a place under --max-concurrency.
    pub queue_wait: Histogram,
    /// The places of --max-concurrency (none without a limit), handed out first come, first
    /// served.
    pub places: Option<Arc<tokio::sync::Semaphore>>,
    next_request: AtomicU64,
    pub(crate) client: HttpClient,
    /// The router's clock (predicted blocks lapse by it) starts with the server.
    pub(crate) started: std::time::Instant,
    /// Whether the router needs each request's first token (`Router::prefill_done`).
    pub(crate) tracks_prefill: bool,
    /// The LoRA adapters requests may name (`--lora-modules`, the workers' `/v1/models`).
    pub lora: crate::lora::Adapters,
    /// This replica's id among those that share load (`--router-replica-sync`).
    pub replica: u64,
    /// Where this replica's load deltas go to be published (`--router-replica-sync`).
    pub(crate) deltas: OnceLock<UnboundedSender<Vec<LoadDelta>>>,
    /// The NATS connection, when a NATS part is on.
    pub(crate) nats: OnceLock<crate::nats::Nats>,
    /// Router ids of workers a restored snapshot names, so that they keep their mirrors.
    known: Mutex<BTreeMap<String, WorkerId>>,
    /// The API keys' token buckets (`--rate-limit`).
    pub rate_limiter: Option<crate::ratelimit::Limiter>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("workers", &self.workers())
            .finish_non_exhaustive()
    }
}

impl Server {
    /// The state for `cfg`: the router, the static workers, the tokenizer.
    pub fn new(cfg: Config) -> Result<Self, ServerError> {
        let places = (cfg.max_concurrency > 0)
            .then(|| Arc::new(tokio::sync::Semaphore::new(cfg.max_concurrency)));
        let block_size = BlockSize::new(cfg.block_size).map_err(|e| ServerError::Setting {
            flag: "--block-size",
            message: e.to_string(),
        })?;
        let setting = |e: kvroute::Error| ServerError::Setting {
            flag: match &e {
                kvroute::Error::InvalidWeight { name, .. } if name.contains("temperature") => {
                    "--router-temperature"
                }
                kvroute::Error::InvalidWeight { name, .. }
                | kvroute::Error::InvalidSetting { name, .. }
                    if name.contains("busy") =>
                {
                    "--busy-threshold"
                }
                kvroute::Error::InvalidWeight { name, .. } if name.contains("prefill") => {
                    "--kv-prefill-overlap-weight"
                }
                kvroute::Error::InvalidWeight { name, .. } if name.contains("decode") => {
                    "--kv-decode-overlap-weight"
                }
                _ => "--kv-overlap-weight",
            },
            message: e.to_string(),
        };
        let mut b = Router::builder()
            .block_size(block_size)
            .policy(cfg.router_policy.into())
            .overlap_weight(cfg.kv_overlap_weight)
            .seed(cfg.seed);
        if let Some(w) = cfg.kv_prefill_overlap_weight {
            b = b.prefill_overlap_weight(w);
        }
        if let Some(w) = cfg.kv_decode_overlap_weight {
            b = b.decode_overlap_weight(w);
        }
        if let Some(limits) = &cfg.busy_threshold {
            if limits.waiting.is_some() && cfg.scrape_metrics_s <= 0.0 {
                return Err(ServerError::Setting {
                    flag: "--busy-threshold",
                    message: "waiting=N counts the requests the engines' /metrics say wait: \
                              give --scrape-metrics-s too"
                        .into(),
                });
            }
            let t = limits.threshold().map_err(|message| ServerError::Setting {
                flag: "--busy-threshold",
                message,
            })?;
            b = b.busy_threshold(t);
        }
        let replica = cfg.replica_id.unwrap_or_else(default_replica_id);
        if cfg.router_replica_sync {
            b = b
                .replica(replica)
                .remote_load_ttl(std::time::Duration::from_secs_f64(cfg.remote_load_ttl_s));
        }
        let router = b
            .cost_model(cfg.cost_model.0)
            .temperature(cfg.router_temperature)
            .predicted_ttl(std::time::Duration::from_millis(cfg.predicted_ttl_ms))
            .tail_first_evictions(cfg.tail_first_evictions)
            .session_affinity(cfg.session_affinity.0)
            .session_ttl(std::time::Duration::from_secs_f64(cfg.session_ttl_s))
            .build()
            .map_err(setting)?;
        let text = match &cfg.router_tokenizer_path {
            None => None,
            Some(p) => Some(tokenize::load(p).map_err(|e| ServerError::Setting {
                flag: "--router-tokenizer-path",
                message: e.to_string(),
            })?),
        };
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build(conn);
        let tracks_prefill =
            cfg.cost_model.0 != kvroute::CostModel::Seed || cfg.busy_threshold.is_some();
        let lora = crate::lora::Adapters::new(&cfg.lora_modules);
        let rate_limit = cfg.rate_limit;
        Ok(Server {
            lora,
            started: std::time::Instant::now(),
            tracks_prefill,
            cfg,
            mirror: Mutex::new(Mirror {
                router,
                ingest: VllmIngest::new(),
            }),
            workers: RwLock::new(Vec::new()),
            next_worker: AtomicU64::new(0),
            text,
            counters: Counters::default(),
            route_latency: Histogram::new(&LATENCY_BUCKETS_US),
            kv_event_lag: Histogram::new(&LAG_BUCKETS_US),
            queue_wait: Histogram::new(&LAG_BUCKETS_US),
            places,
            // A run's request ids never repeat an earlier run's: other replicas remember a
            // replica's finished ids for a while, and would ignore a restarted one's.
            next_request: AtomicU64::new(first_request_id()),
            client,
            replica,
            deltas: OnceLock::new(),
            nats: OnceLock::new(),
            known: Mutex::new(BTreeMap::new()),
            rate_limiter: rate_limit.map(crate::ratelimit::Limiter::new),
        })
    }

    /// Sends the router's load deltas to the other replicas (a no-op without
    /// `--router-replica-sync`). Call after each route, finish and first token.
    pub fn flush_deltas(&self, router: &mut Router) {
        if let Some(tx) = self.deltas.get() {
            let d = router.drain_load_deltas();
            if !d.is_empty() {
                let _ = tx.send(d);
            }
        }
    }

    /// Restores a snapshot's mirror, before any worker is added: its workers keep their ids
    /// (and so their mirrors) when they are added, and are not routed to until then.
    pub fn restore(
        &self,
        ids: BTreeMap<String, WorkerId>,
        mirror: kvroute_vllm::MirrorSnapshot,
    ) -> Result<(), String> {
        let mut m = self.mirror();
        let m = &mut *m;
        let ingest = VllmIngest::restore(&mut m.router, mirror).map_err(|e| e.to_string())?;
        m.ingest = ingest;
        for w in m.router.workers() {
            m.router.set_routable(w, false);
        }
        // Above every id the snapshot holds, named or not, so that none is given to another.
        let next = ids
            .values()
            .copied()
            .chain(m.router.workers())
            .map(|w| w.get() + 1)
            .max()
            .unwrap_or(0);
        self.next_worker.fetch_max(next, Ordering::Relaxed);
        *self.known.lock().unwrap_or_else(|e| e.into_inner()) = ids;
        self.counters.restored.store(1, Ordering::Relaxed);
        Ok(())
    }

    /// The mirror's snapshot and the names of the ids it uses, taken together (the workers'
    /// lock, then the mirror's, as `add_worker` takes them).
    pub fn snapshot_state(&self) -> (BTreeMap<String, WorkerId>, kvroute_vllm::MirrorSnapshot) {
        let list = self.workers.read().unwrap_or_else(|e| e.into_inner());
        let ids = list.iter().map(|w| (w.spec.name.clone(), w.id)).collect();
        let m = self.mirror();
        (ids, m.ingest.snapshot(&m.router))
    }

    /// Router ids by worker name, for snapshots.
    pub fn worker_ids(&self) -> BTreeMap<String, WorkerId> {
        self.workers()
            .iter()
            .map(|w| (w.spec.name.clone(), w.id))
            .collect()
    }

    /// The router and its adapter, locked. Hold it for one operation, never across an await.
    pub fn mirror(&self) -> MutexGuard<'_, Mirror> {
        // A panic while holding the lock cannot leave the router half-changed in a way later
        // calls trip on (each call validates before it changes anything), so keep serving.
        self.mirror.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> kvroute::RequestId {
        kvroute::RequestId::new(self.next_request.fetch_add(1, Ordering::Relaxed))
    }

    /// The workers, in the order they were added.
    pub fn workers(&self) -> Vec<Arc<Worker>> {
        self.workers.read().map(|w| w.clone()).unwrap_or_default()
    }

    /// How many workers there are (without copying the list).
    pub fn worker_count(&self) -> usize {
        self.workers.read().map_or(0, |w| w.len())
    }

    /// The worker named `name` (`host:port`).
    pub fn worker_named(&self, name: &str) -> Option<Arc<Worker>> {
        self.workers().into_iter().find(|w| w.spec.name == name)
    }

    /// The worker with router id `id`.
    pub fn worker(&self, id: WorkerId) -> Option<Arc<Worker>> {
        self.workers().into_iter().find(|w| w.id == id)
    }

    /// Adds a worker (with a fresh router id); an error if one of that name exists.
    pub fn add_worker(&self, spec: WorkerSpec) -> Result<Arc<Worker>, String> {
        let mut list = self.workers.write().unwrap_or_else(|e| e.into_inner());
        if list.iter().any(|w| w.spec.name == spec.name) {
            return Err(format!("worker {} is given twice", spec.name));
        }
        let restored = self
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&spec.name)
            .copied();
        let id = restored
            .unwrap_or_else(|| WorkerId::new(self.next_worker.fetch_add(1, Ordering::Relaxed)));
        {
            let mut m = self.mirror();
            m.router.add_worker(id);
            m.router.set_routable(id, true);
        }
        let w = Arc::new(Worker {
            id,
            spec,
            down: AtomicBool::new(false),
            routed: AtomicU64::new(0),
            upstream_errors: AtomicU64::new(0),
            request_blocks: AtomicU64::new(0),
            hit_blocks: AtomicU64::new(0),
            caught_up: AtomicBool::new(false),
            subscribed: AtomicBool::new(false),
            breaker: Mutex::new(Breaker::new(self.breaker_config())),
            unconfirmed_since_ms: AtomicU64::new(0),
            silent: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            task: Mutex::new(None),
            engine: crate::telemetry::Scraped::default(),
        });
        list.push(Arc::clone(&w));
        Ok(w)
    }

    /// Removes the worker named `name`: its mirror, load and subscription. Returns it.
    pub fn remove_worker(&self, name: &str) -> Option<Arc<Worker>> {
        let mut list = self.workers.write().unwrap_or_else(|e| e.into_inner());
        let at = list.iter().position(|w| w.spec.name == name)?;
        let w = list.remove(at);
        {
            let mut m = self.mirror();
            m.router.remove_worker(w.id);
            m.ingest.forget_worker(w.id);
        }
        if let Some(t) = w.task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            t.abort();
        }
        Some(w)
    }

    /// Marks a worker down (routing skips it) or up again.
    pub fn set_down(&self, w: &Worker, down: bool) {
        // Under the mirror's lock, so the flag and the router never disagree.
        let mut m = self.mirror();
        if w.down.swap(down, Ordering::Relaxed) != down {
            m.router.set_routable(w.id, self.routable(w));
            drop(m);
            tracing::info!(
                "worker {} is {}",
                w.spec.name,
                if down { "down" } else { "up again" }
            );
        }
    }

    /// Whether routing may choose `w`: it is not down or draining, and its breaker is not open.
    pub fn routable(&self, w: &Worker) -> bool {
        !w.down.load(Ordering::Relaxed)
            && !w.draining.load(Ordering::Relaxed)
            && !self.breaker(w).is_open()
    }

    /// Drains the worker named `name` (or stops draining it): a draining worker gets no new
    /// requests and is removed once its in-flight ones have finished
    /// ([`finish_drains`](Self::finish_drains)). False if there is no such worker.
    pub fn set_draining(&self, name: &str, draining: bool) -> bool {
        let Some(w) = self.worker_named(name) else {
            return false;
        };
        let mut m = self.mirror();
        if w.draining.swap(draining, Ordering::Relaxed) != draining {
            m.router.set_routable(w.id, self.routable(&w));
            drop(m);
            if draining {
                tracing::info!("worker {name} draining");
            } else {
                tracing::info!("worker {name} no longer draining");
            }
        }
        true
    }

    /// Removes the draining workers that have no request in flight.
    pub fn finish_drains(&self) {
        for w in self.workers() {
            if !w.draining.load(Ordering::Relaxed) || self.mirror().router.in_flight(w.id) > 0 {
                continue;
            }
            if self.remove_worker(&w.spec.name).is_some() {
                tracing::info!("worker {} drained and removed", w.spec.name);
            }
        }
    }

    /// Where `w`'s circuit breaker is.
    pub fn breaker_state(&self, w: &Worker) -> crate::breaker::State {
        self.breaker(w).state()
    }

    fn breaker<'a>(&self, w: &'a Worker) -> MutexGuard<'a, Breaker> {
        w.breaker.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn breaker_config(&self) -> BreakerConfig {
        BreakerConfig {
            failures: self.cfg.breaker_failures,
            window: Duration::from_secs_f64(self.cfg.breaker_window_s),
            cooldown: Duration::from_secs_f64(self.cfg.breaker_cooldown_s),
        }
    }

    /// `w` failed a request: its breaker counts it, and may open (the worker then leaves
    /// routing until its cooldown ends).
    pub fn worker_failed(&self, w: &Worker) {
        w.upstream_errors.fetch_add(1, Ordering::Relaxed);
        let mut m = self.mirror();
        if self.breaker(w).failure(self.started.elapsed()) {
            m.router.set_routable(w.id, false);
            drop(m);
            self.counters.breaker_opened.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "worker {}: circuit breaker open for {} s after {} failures",
                w.spec.name,
                self.cfg.breaker_cooldown_s,
                self.cfg.breaker_failures
            );
        }
    }

    /// `w` served a request: a half-open breaker closes.
    pub fn worker_served(&self, w: &Worker) {
        self.breaker(w).success();
    }

    /// Open breakers whose cooldown is over go half-open: their workers are routable again.
    pub fn tick_breakers(&self) {
        let now = self.started.elapsed();
        for w in self.workers() {
            let mut m = self.mirror();
            if self.breaker(&w).tick(now) {
                m.router.set_routable(w.id, self.routable(&w));
                drop(m);
                tracing::info!("worker {}: circuit breaker half-open", w.spec.name);
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// A request was routed to `w`: if nothing has been waiting for its events, this one is.
    pub fn routed_to(&self, w: &Worker) {
        if w.spec.events.is_some()
            || self.cfg.kv_event_transport != crate::config::EventTransport::Zmq
        {
            let _ = w.unconfirmed_since_ms.compare_exchange(
                0,
                self.now_ms() + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// `w` published a KV-event batch: nothing waits for its events, and it is not silent.
    pub fn heard_from(&self, w: &Worker) {
        w.unconfirmed_since_ms.store(0, Ordering::Relaxed);
        if w.silent.swap(false, Ordering::Relaxed) {
            tracing::info!("worker {}: KV events again", w.spec.name);
        }
    }

    /// Flags the workers that served requests for `--event-silence-s` without an event (once
    /// each until they publish again); with `--on-silent-feed load-only`, forgets their mirror.
    pub fn check_silence(&self) {
        if self.cfg.event_silence_s <= 0.0 {
            return;
        }
        let limit_ms = (self.cfg.event_silence_s * 1e3) as u64;
        let now = self.now_ms() + 1;
        for w in self.workers() {
            let since = w.unconfirmed_since_ms.load(Ordering::Relaxed);
            if since == 0
                || now.saturating_sub(since) < limit_ms
                || w.silent.swap(true, Ordering::Relaxed)
            {
                continue;
            }
            self.counters.silent_feeds.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "worker {}: no KV event for {} s while serving requests: its publisher may be broken",
                w.spec.name,
                self.cfg.event_silence_s
            );
            if self.cfg.on_silent_feed == crate::config::OnSilentFeed::LoadOnly {
                // As after a publisher restart: the mirror starts afresh from the events to come.
                let mut m = self.mirror();
                m.router.clear_worker(w.id);
                m.ingest.forget_worker(w.id);
            }
        }
    }

    /// Records one route decision's latency.
    pub fn observe_route(&self, us: u64) {
        self.route_latency.observe(us);
    }

    /// `/metrics` in Prometheus text.
    pub fn metrics_text(&self) -> String {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        for (name, help, v) in [
            ("kvrouter_kv_batches_applied_total", "KV-event batches applied.", &c.batches_applied),
            ("kvrouter_kv_batches_rejected_total", "KV-event batches rejected (malformed, invalid or replayed).", &c.batches_rejected),
            ("kvrouter_kv_gaps_total", "KV-event batches that followed missed ones.", &c.gaps),
            ("kvrouter_kv_restarts_total", "Publisher restarts seen after a missed batch 0 (the worker's mirror started afresh).", &c.restarts),
            ("kvrouter_kv_replays_total", "Replay requests sent to workers.", &c.replays),
            ("kvrouter_kv_replayed_batches_total", "Batches obtained by replay and applied.", &c.replayed_batches),
            ("kvrouter_load_deltas_applied_total", "Other replicas' load deltas applied (--router-replica-sync).", &c.deltas_applied),
            ("kvrouter_load_deltas_rejected_total", "Other replicas' load-delta messages that did not parse.", &c.deltas_rejected),
            ("kvrouter_snapshots_total", "Mirror snapshots stored (--kv-event-transport nats).", &c.snapshots),
            ("kvrouter_silent_feeds_total", "Workers flagged silent: they served requests for --event-silence-s without a KV event.", &c.silent_feeds),
            ("kvrouter_retries_total", "Requests tried again on another worker after a failure before their first byte.", &c.retries),
            ("kvrouter_breaker_opened_total", "Circuit breakers opened (--breaker-failures failures within --breaker-window-s).", &c.breaker_opened),
            ("kvrouter_rejected_busy_total", "Requests answered 429 after waiting --queue-timeout-ms for a place under --max-concurrency.", &c.rejected_busy),
            ("kvrouter_migrations_total", "Streamed answers moved to another worker after their worker failed mid-stream (--migration-limit).", &c.migrations),
            ("kvrouter_migrations_failed_total", "Mid-stream failures that could not move to another worker: the client's stream broke off.", &c.migrations_failed),
            ("kvrouter_session_moves_total", "Session turns routed to another worker than the session's last one (--session-affinity).", &c.session_moves),
            ("kvrouter_rate_limited_total", "Requests answered 429 because their API key was over --rate-limit.", &c.rate_limited),
        ] {
            counter(name, help, get(v));
        }
        counter(
            "kvrouter_otlp_export_errors_total",
            "Span batches the OTLP collector did not take (--otlp-traces-endpoint).",
            kvserve::logging::TraceGuard::export_errors(),
        );
        let workers = self.workers();
        let (views, stale): (Vec<(String, usize)>, usize) = {
            let m = self.mirror();
            let views = workers
                .iter()
                .map(|w| (w.spec.name.clone(), m.router.cache_view(w.id)))
                .collect();
            let stale = workers
                .iter()
                .filter(|w| m.router.index().is_stale(w.id))
                .count();
            (views, stale)
        };
        let _ = writeln!(
            out,
            "# HELP kvrouter_catch_up_seconds How long the start took to catch up with the KV-event stream.\n# TYPE kvrouter_catch_up_seconds gauge\nkvrouter_catch_up_seconds {}",
            get(&c.catch_up_ms) as f64 / 1e3
        );
        let _ = writeln!(
            out,
            "# HELP kvrouter_snapshot_restored 1 when the start restored a stored snapshot.\n# TYPE kvrouter_snapshot_restored gauge\nkvrouter_snapshot_restored {}",
            get(&c.restored)
        );
        let sessions = self.mirror().router.live_sessions();
        let _ = writeln!(
            out,
            "# HELP kvrouter_sessions Sessions remembered (an x-session-id used within --session-ttl-s).\n# TYPE kvrouter_sessions gauge\nkvrouter_sessions {sessions}"
        );
        let _ = writeln!(
            out,
            "# HELP kvrouter_stale_workers Workers whose mirror may have missed events.\n# TYPE kvrouter_stale_workers gauge\nkvrouter_stale_workers {stale}"
        );
        let in_flight: Vec<usize> = {
            let m = self.mirror();
            workers.iter().map(|w| m.router.in_flight(w.id)).collect()
        };
        for (name, kind, help, value) in [
            (
                "kvrouter_requests_routed_total",
                "counter",
                "Requests routed, by worker.",
                &|w: &Worker, _| get(&w.routed),
            ),
            (
                "kvrouter_upstream_errors_total",
                "counter",
                "Requests a worker refused, broke off or did not answer in time, by worker.",
                &|w: &Worker, _| get(&w.upstream_errors),
            ),
            (
                "kvrouter_request_blocks_total",
                "counter",
                "Full prompt blocks of routed requests, by worker.",
                &|w: &Worker, _| get(&w.request_blocks),
            ),
            (
                "kvrouter_cache_hit_blocks_total",
                "counter",
                "Prompt blocks the router predicted cached on the chosen worker, by worker.",
                &|w: &Worker, _| get(&w.hit_blocks),
            ),
            (
                "kvrouter_in_flight_requests",
                "gauge",
                "Requests routed to a worker and not finished, by worker.",
                &|_: &Worker, k: usize| in_flight[k] as u64,
            ),
            (
                "kvrouter_worker_routable",
                "gauge",
                "1 when routing may choose the worker (not down, draining or behind an open breaker).",
                &|w: &Worker, _| u64::from(self.routable(w)),
            ),
            (
                "kvrouter_worker_draining",
                "gauge",
                "1 while the worker drains (no new requests; removed once its requests finish).",
                &|w: &Worker, _| u64::from(w.draining.load(Ordering::Relaxed)),
            ),
            (
                "kvrouter_breaker_state",
                "gauge",
                "A worker's circuit breaker: 0 closed, 1 open, 2 half-open.",
                &|w: &Worker, _| u64::from(self.breaker(w).state().gauge()),
            ),
        ]
            as [(&str, &str, &str, &dyn Fn(&Worker, usize) -> u64); 8]
        {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (k, w) in workers.iter().enumerate() {
                let _ = writeln!(out, "{name}{{worker=\"{}\"}} {}", w.spec.name, value(w, k));
            }
        }
        let _ = writeln!(out, "# HELP kvrouter_cache_view_blocks Blocks the router believes each worker holds.\n# TYPE kvrouter_cache_view_blocks gauge");
        for (name, n) in views {
            let _ = writeln!(out, "kvrouter_cache_view_blocks{{worker=\"{name}\"}} {n}");
        }
        self.route_latency.write(
            &mut out,
            "kvrouter_route_seconds",
            "Route decision latency (tokenising excluded).",
        );
        let _ = writeln!(
            out,
            "# HELP kvrouter_queue_depth Requests waiting for a place under --max-concurrency.\n# TYPE kvrouter_queue_depth gauge\nkvrouter_queue_depth {}",
            get(&c.queued)
        );
        self.queue_wait.write(
            &mut out,
            "kvrouter_queue_wait_seconds",
            "How long requests waited for a place under --max-concurrency.",
        );
        self.kv_event_lag.write(
            &mut out,
            "kvrouter_kv_event_lag_seconds",
            "From a KV-event batch's publication (the engine's timestamp) to its application.",
        );
        crate::telemetry::write_metrics(self, &workers, &mut out);
        out
    }
}

/// A replica id for `--router-replica-sync` without `--replica-id`: the process id and the
/// start time, so that two processes differ.
fn default_replica_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 40)
}

/// The first request id of this run: the time in nanoseconds (at least 1).
fn first_request_id() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| (d.as_nanos() as u64).max(1))
}

/// A worker's `/v1/models` answer (within 2 s), if it gives one.
pub(crate) async fn worker_models(server: &Server, w: &Worker) -> Option<Value> {
    let req = hyper::Request::get(format!("{}/v1/models", w.spec.url))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(2), server.client.request(req))
        .await
        .ok()?
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    serde_json::from_slice(&body).ok()
}

/// Learns the workers' LoRA adapters ([`crate::lora`]) now and every
/// [`LEARN_EVERY`](crate::lora::LEARN_EVERY).
pub async fn watch_adapters(server: Arc<Server>) {
    loop {
        let mut answers = Vec::new();
        for w in &server.workers() {
            answers.push((w.spec.name.clone(), worker_models(&server, w).await));
        }
        server
            .lora
            .learn(answers.iter().map(|(n, a)| (n.as_str(), a.as_ref())));
        tokio::time::sleep(crate::lora::LEARN_EVERY).await;
    }
}
