//! The server's settings: the command line, and the static worker list it names.

use std::path::PathBuf;
use std::str::FromStr;

use clap::Parser;

/// A KV-aware router server in front of vLLM (or SGLang, or `kvmock`) engines: OpenAI-compatible
/// requests in, each tokenised, scored against every worker's mirrored KV cache (fed by the
/// engines' ZMQ KV events) and forwarded to the winner, the response streamed back.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvrouter", version, about, long_about, after_help = EXAMPLES)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Config {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0", value_name = "HOST")]
    pub host: String,
    /// HTTP port.
    #[arg(long, default_value_t = 8000, value_name = "PORT")]
    pub port: u16,
    /// How a worker is chosen: kv-aware (the cost function), prefix-aware (consistent hashing
    /// of the first blocks), round-robin or random.
    #[arg(long, default_value = "kv-aware", value_name = "POLICY")]
    pub router_policy: PolicyName,
    /// Weight of blocks a worker would have to prefill, against its in-flight blocks.
    #[arg(long, default_value_t = 1.0, value_name = "W")]
    pub kv_overlap_weight: f64,
    /// The weight for prefill requests [default: --kv-overlap-weight].
    #[arg(long, value_name = "W")]
    pub kv_prefill_overlap_weight: Option<f64>,
    /// The weight for decode requests [default: --kv-overlap-weight].
    #[arg(long, value_name = "W")]
    pub kv_decode_overlap_weight: Option<f64>,
    /// The model's tokenizer: a tokenizer.json, or a directory with it and tokenizer_config.json
    /// (the chat template); or builtin:bytes, a demo tokenizer of one token per UTF-8 byte with a
    /// ChatML template, what kvmock uses without --tokenizer. Without one, only requests with
    /// token ids can be routed.
    #[arg(long, value_name = "PATH|builtin:bytes")]
    pub router_tokenizer_path: Option<PathBuf>,
    /// Tokens per KV block: must equal the engines' --block-size.
    #[arg(long, default_value_t = 16, value_name = "TOKENS")]
    pub block_size: usize,
    /// Where workers come from: static (the --worker list) or etcd (records under
    /// kvkit/workers/ with a lease, as kvmock --etcd-endpoint registers them; polled twice a
    /// second). The --worker list is used with either.
    #[arg(long, default_value = "static", value_name = "BACKEND")]
    pub discovery_backend: Discovery,
    /// The etcd server of --discovery-backend etcd (its client URL's HOST:PORT).
    #[arg(long, default_value = "127.0.0.1:2379", value_name = "HOST:PORT")]
    pub etcd_endpoint: String,
    /// A worker: its HTTP URL, then optionally its KV-event PUB endpoint and its replay
    /// endpoint, e.g. http://127.0.0.1:30000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
    /// (repeat for each worker).
    #[arg(long = "worker", value_name = "URL[,events=EP][,replay=EP]")]
    pub workers: Vec<WorkerSpec>,
    /// How KV events arrive: zmq (a SUB to each worker's publisher, vLLM's and SGLang's), or
    /// nats (a JetStream stream that `kvrouter relay` sidecars fill, one subject per worker:
    /// durable, so a restarted replica catches up; see --nats-url).
    #[arg(long, default_value = "zmq", value_name = "TRANSPORT")]
    pub kv_event_transport: EventTransport,
    /// The NATS server (with JetStream) of --kv-event-transport nats, --router-replica-sync
    /// and `kvrouter relay`.
    #[arg(long, default_value = "nats://127.0.0.1:4222", value_name = "URL")]
    pub nats_url: String,
    /// Share in-flight load with the other replicas over NATS (subject kvkit.load.*): each
    /// replica publishes its routes, first tokens and finishes and counts the others' (a
    /// request whose finish never comes, for up to --remote-load-ttl-s).
    #[arg(long)]
    pub router_replica_sync: bool,
    /// This replica's id among those that sync [default: one made from the process and the
    /// time]; give each replica its own.
    #[arg(long, value_name = "N")]
    pub replica_id: Option<u64>,
    /// How long another replica's request counts as load when its finish never arrives.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS", value_parser = parse_timeout)]
    pub remote_load_ttl_s: f64,
    /// --kv-event-transport nats: store a snapshot of the mirror (with each worker's stream
    /// position) in the JetStream object store kvkit-snapshots after this many batches (0:
    /// never). A starting replica restores the newest one stored, either way.
    #[arg(long, default_value_t = 10_000, value_name = "BATCHES")]
    pub snapshot_every: u64,
    /// How requests are forwarded: http.
    #[arg(long, default_value = "http", value_name = "TRANSPORT")]
    pub request_transport: RequestTransport,
    /// Seed of the router's tie-breaking (and of the random policy).
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// Largest request body accepted; larger ones get 413.
    #[arg(long, default_value_t = 16 << 20, value_name = "BYTES")]
    pub max_body_bytes: usize,
    /// Seconds a worker may take to start its response before the request gets 504: a streamed
    /// response starts with its first chunk, a plain one only when the whole answer is ready,
    /// so raise it for long non-streamed generations. The router's load for the request is
    /// released at the 504, though the engine may still run it.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS", value_parser = parse_timeout)]
    pub upstream_timeout_s: f64,
    /// Requests forwarded at once, streams included (0: no limit). Past it, requests wait in a
    /// first-in, first-out queue for at most --queue-timeout-ms, then get 429 with Retry-After.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_concurrency: usize,
    /// How long a request may wait for one of --max-concurrency's places before its 429,
    /// milliseconds.
    #[arg(long, default_value_t = 30_000, value_name = "MS")]
    pub queue_timeout_ms: u64,
    /// Tries on other workers when a worker fails a request before its first byte reached the
    /// client (a refused connection, a 5xx answer, --upstream-timeout-s, a broken exchange);
    /// each goes to the best worker not tried yet for the request.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub retries: usize,
    /// Wait before the first retry, milliseconds; each later retry waits twice as long, every
    /// wait drawn between half and one and a half times that (jitter).
    #[arg(long, default_value_t = 20, value_name = "MS")]
    pub retry_backoff_ms: u64,
    /// Times a streamed answer may move to another worker when its worker fails after the
    /// first byte reached the client (0: never). The request is sent again with the prompt
    /// extended by the answer so far and max_tokens reduced (chat: vLLM's
    /// continue_final_message), and the client's stream goes on: same id, no token lost or
    /// repeated, one finish_reason, one final DONE, usage summed. Not for n > 1, echo, or a
    /// token-id prompt without --router-tokenizer-path.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub migration_limit: usize,
    /// What a request's x-session-id header does: soft keeps the session on the worker of its
    /// last turn unless that worker is down, draining or busy (--busy-threshold), then moves it
    /// once; hard never moves it (503 while its worker is out); off ignores the header.
    /// Sessions are shared between replicas with --router-replica-sync.
    #[arg(long, default_value = "soft", value_name = "soft|hard|off")]
    pub session_affinity: SessionAffinityName,
    /// How long a session is remembered after its last turn, seconds.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS", value_parser = parse_timeout)]
    pub session_ttl_s: f64,
    /// A worker's circuit breaker opens after this many failures within --breaker-window-s
    /// (0: never): the worker gets no requests for --breaker-cooldown-s, then requests try it
    /// again (half-open) and the next success closes the breaker, the next failure reopens it.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub breaker_failures: usize,
    /// How far back a breaker counts failures, seconds.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS", value_parser = parse_timeout)]
    pub breaker_window_s: f64,
    /// How long an open breaker keeps its worker out of routing, seconds.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS", value_parser = parse_timeout)]
    pub breaker_cooldown_s: f64,
    /// A worker that publishes KV events but served requests for this long without one is
    /// flagged silent (`silent` in /v1/admin/workers, kvrouter_silent_feeds_total, one warning):
    /// its publisher may be broken, and its mirror stale. 0: never. A worker whose requests all
    /// hit fully cached prompts with short answers stores nothing new and may be flagged too.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub event_silence_s: f64,
    /// What routing does with a silent worker: keep (score it on its mirror as before) or
    /// load-only (forget its mirror, so it is scored by load alone, until its events rebuild it).
    #[arg(long, default_value = "keep", value_name = "keep|load-only")]
    pub on_silent_feed: OnSilentFeed,
    /// kv-aware policy: seed (W x missed blocks + active blocks) or prefill-aware (W x
    /// (pending prefill + missed blocks) + decode blocks; a streamed request decodes from its
    /// first chunk on, a plain one counts as prefilling until it finishes).
    #[arg(long, default_value = "seed", value_name = "MODEL")]
    pub cost_model: CostModelName,
    /// kv-aware policy: 0 takes the lowest cost; T > 0 samples workers with probability
    /// exp(-(cost - min) / (T x (max - min))).
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub router_temperature: f64,
    /// kv-aware policy: skip busy workers unless all are. decode=F,capacity=BLOCKS: decode
    /// blocks above F x BLOCKS (with --scrape-metrics-s, or an engine's KV-cache usage above
    /// F); prefill-tokens=N: pending prefill above N tokens; waiting=N (with
    /// --scrape-metrics-s): more than N requests waiting in the engine.
    #[arg(
        long,
        value_name = "decode=F,capacity=BLOCKS,prefill-tokens=N,waiting=N"
    )]
    pub busy_threshold: Option<BusyLimits>,
    /// Count a routed request's blocks as hits on its worker for this long, or until its KV
    /// events confirm them (0 = off), milliseconds.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub predicted_ttl_ms: u64,
    /// Trust that every worker's engine evicts tail first (full-attention prefix caches of vLLM
    /// and SGLang, kvmock) and sends its own events: a worker that evicted keeps the index's
    /// strided search (about 3x faster at 64 workers) instead of a block-by-block walk; a
    /// stale worker is walked. A worker whose events break the rule (a sliding-window-only
    /// model, a KV-cache group whose kind the events do not name) gets overcounted hits.
    #[arg(long)]
    pub tail_first_evictions: bool,
    /// LoRA adapters the workers serve (vLLM's NAME=PATH form accepted, the path ignored): a
    /// request whose model names one is hashed with the adapter's name, as vLLM hashes it.
    /// Adapters the workers list in /v1/models (with a parent) are learned as well, every 2 s.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_name = "NAME[=PATH]", value_parser = parse_lora_module)]
    pub lora_modules: Vec<String>,
    /// Log lines on standard error: text, or one JSON object per line. RUST_LOG filters them
    /// (default info; kvrouter=debug adds one line per routing decision). A request's lines
    /// carry its id (the client's x-request-id, or one the router gives and sends on).
    #[arg(long, global = true, default_value = "text", value_name = "text|json")]
    pub log_format: kvserve::logging::LogFormat,
    /// Export OpenTelemetry traces to this OTLP/HTTP collector URL
    /// (http://HOST:4318/v1/traces; vLLM's flag): a span per request continuing the caller's
    /// traceparent, with tokenize, route (policy, worker, hits, cost, candidates) and upstream
    /// children; the engine receives the trace in traceparent. Batched in the background: an
    /// unreachable collector costs kvrouter_otlp_export_errors_total, not latency.
    #[arg(long, value_name = "URL")]
    pub otlp_traces_endpoint: Option<String>,
    /// A token bucket per API key (the Authorization: Bearer KEY header; requests without one
    /// share one bucket), checked before --max-concurrency: RPS requests a second, bursts of
    /// BURST [default: RPS rounded up]. Past it, 429 with Retry-After (the whole seconds until
    /// the key has a token again) and OpenAI's error object. Off by default.
    #[arg(long, value_name = "RPS[,BURST]")]
    pub rate_limit: Option<crate::ratelimit::RateLimit>,
    /// Read each worker's /metrics every S seconds (0: never) for vLLM's
    /// vllm:num_requests_running, vllm:num_requests_waiting and vllm:kv_cache_usage_perc (or
    /// the older vllm:gpu_cache_usage_perc), which --busy-threshold then uses next to the
    /// router's own counts (kvrouter_worker_engine_* in /metrics, `engine` in
    /// /v1/admin/workers). A failed scrape keeps the last values for one more period, then
    /// clears them.
    #[arg(long, default_value_t = 0.0, value_name = "S", value_parser = parse_period)]
    pub scrape_metrics_s: f64,
    /// A sidecar instead of the server (`kvrouter relay --help`).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// `kvrouter`'s subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Relay one engine's ZMQ KV events into the JetStream stream that replicas started with
    /// --kv-event-transport nats read: each batch once, in order, gaps filled from the engine's
    /// replay socket. Run one next to each engine.
    Relay(RelayArgs),
}

/// `kvrouter relay`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = RELAY_EXAMPLES)]
pub struct RelayArgs {
    /// The engine, as the servers name it: its HTTP URL, its KV-event PUB endpoint and
    /// (to fill gaps) its replay endpoint.
    #[arg(long, value_name = "URL,events=EP[,replay=EP]", value_parser = parse_relayed)]
    pub worker: WorkerSpec,
    /// The NATS server, with JetStream.
    #[arg(long, default_value = "nats://127.0.0.1:4222", value_name = "URL")]
    pub nats_url: String,
}

const RELAY_EXAMPLES: &str = "Example:
  nats-server -js -sd /tmp/nats &
  kvrouter relay --worker http://127.0.0.1:30000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558";

fn parse_relayed(s: &str) -> Result<WorkerSpec, String> {
    let spec: WorkerSpec = s.parse()?;
    if spec.events.is_none() {
        return Err(format!(
            "worker {s:?}: a relay needs the engine's events=tcp://HOST:PORT"
        ));
    }
    Ok(spec)
}

const EXAMPLES: &str = "Examples:
  # two engines with KV events (kvmock here; vLLM takes the same --kv-events-config)
  kvmock --port 30000 --enable-kv-events --kv-events-config \
'{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}' &
  kvmock --port 30001 --enable-kv-events --kv-events-config \
'{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5567\",\"replay_endpoint\":\"tcp://*:5568\"}' &
  kvrouter --port 8000 \\
    --worker http://127.0.0.1:30000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 \\
    --worker http://127.0.0.1:30001,events=tcp://127.0.0.1:5567,replay=tcp://127.0.0.1:5568
  curl localhost:8000/v1/completions -d '{\"prompt\": [1, 2, 3], \"max_tokens\": 4}'
  curl localhost:8000/v1/admin/cache-view/127.0.0.1:30000

  # replicas that share events and load through NATS (nats-server -js), a relay per engine
  kvrouter relay --worker http://127.0.0.1:30000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 &
  kvrouter --port 8000 --kv-event-transport nats --router-replica-sync --replica-id 1 \\
    --worker http://127.0.0.1:30000 &
  kvrouter --port 8001 --kv-event-transport nats --router-replica-sync --replica-id 2 \\
    --worker http://127.0.0.1:30000";

impl Default for Config {
    fn default() -> Self {
        Config::parse_from(["kvrouter"])
    }
}

/// `--router-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyName {
    /// The cost function.
    KvAware,
    /// Consistent hashing of the first blocks.
    PrefixAware,
    /// In turn.
    RoundRobin,
    /// Uniformly at random (seeded).
    Random,
}

impl FromStr for PolicyName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kv-aware" | "kv" => Ok(PolicyName::KvAware),
            "prefix-aware" | "prefix_aware" => Ok(PolicyName::PrefixAware),
            "round-robin" | "round_robin" => Ok(PolicyName::RoundRobin),
            "random" => Ok(PolicyName::Random),
            _ => Err(format!(
                "unknown policy {s:?}: expected kv-aware, prefix-aware, round-robin or random"
            )),
        }
    }
}

impl From<PolicyName> for kvroute::Policy {
    fn from(p: PolicyName) -> Self {
        match p {
            PolicyName::KvAware => kvroute::Policy::Kv,
            PolicyName::PrefixAware => kvroute::Policy::PrefixAware,
            PolicyName::RoundRobin => kvroute::Policy::RoundRobin,
            PolicyName::Random => kvroute::Policy::Random,
        }
    }
}

fn parse_lora_module(s: &str) -> Result<String, String> {
    if s.contains(['{', '}', '"']) {
        return Err(format!(
            "{s:?}: expected NAME or NAME=PATH (vLLM's JSON form is not read here: give the adapters' names)"
        ));
    }
    Ok(s.to_string())
}

fn parse_timeout(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if t.is_finite() && t > 0.0 && t <= 1e6 => Ok(t),
        _ => Err(format!(
            "expected a number of seconds above 0 and at most 1e6, got {s:?}"
        )),
    }
}

/// `--session-affinity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionAffinityName(pub kvroute::SessionAffinity);

impl FromStr for SessionAffinityName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.parse()
            .map(SessionAffinityName)
            .map_err(|e: kvroute::Error| e.to_string())
    }
}

fn parse_period(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if t == 0.0 || (0.01..=1e6).contains(&t) => Ok(t),
        _ => Err(format!(
            "expected 0 (off) or a number of seconds from 0.01 to 1e6, got {s:?}"
        )),
    }
}

/// `--on-silent-feed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnSilentFeed {
    /// Score it on its mirror as before.
    #[default]
    Keep,
    /// Forget its mirror: it is scored by load alone until its events rebuild it.
    LoadOnly,
}

impl FromStr for OnSilentFeed {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(OnSilentFeed::Keep),
            "load-only" => Ok(OnSilentFeed::LoadOnly),
            _ => Err(format!("expected keep or load-only, got {s:?}")),
        }
    }
}

/// `--cost-model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostModelName(pub kvroute::CostModel);

impl FromStr for CostModelName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        s.parse()
            .map(CostModelName)
            .map_err(|e: kvroute::Error| e.to_string())
    }
}

/// `--busy-threshold`: its `key=value` parts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BusyLimits {
    /// `decode=F`.
    pub decode: Option<f64>,
    /// `capacity=BLOCKS`.
    pub capacity: Option<usize>,
    /// `prefill-tokens=N`.
    pub prefill_tokens: Option<usize>,
    /// `waiting=N`.
    pub waiting: Option<usize>,
}

impl BusyLimits {
    /// The threshold these limits make; an error when `decode` comes without `capacity`.
    pub fn threshold(&self) -> Result<kvroute::BusyThreshold, String> {
        let mut t = kvroute::BusyThreshold::new();
        match (self.decode, self.capacity) {
            (Some(f), Some(cap)) => t = t.decode_fraction(f, cap),
            (None, None) => {}
            _ => return Err("decode=F and capacity=BLOCKS go together".to_string()),
        }
        if let Some(n) = self.prefill_tokens {
            t = t.prefill_tokens(n);
        }
        if let Some(n) = self.waiting {
            t = t.waiting_requests(n);
        }
        Ok(t)
    }
}

impl FromStr for BusyLimits {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut l = BusyLimits::default();
        for part in s.split(',') {
            let bad = || {
                format!(
                    "expected decode=F, capacity=BLOCKS, prefill-tokens=N, waiting=N; got {part:?}"
                )
            };
            let (key, value) = part.split_once('=').ok_or_else(bad)?;
            let value = value.trim();
            match key.trim() {
                "decode" => l.decode = Some(value.parse().map_err(|_| bad())?),
                "capacity" => l.capacity = Some(value.parse().map_err(|_| bad())?),
                "prefill-tokens" => l.prefill_tokens = Some(value.parse().map_err(|_| bad())?),
                "waiting" => l.waiting = Some(value.parse().map_err(|_| bad())?),
                _ => return Err(bad()),
            }
        }
        Ok(l)
    }
}

/// `--discovery-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discovery {
    /// The `--worker` list.
    Static,
    /// Records in etcd.
    Etcd,
}

impl FromStr for Discovery {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "static" => Ok(Discovery::Static),
            "etcd" => Ok(Discovery::Etcd),
            _ => Err(format!(
                "unknown discovery backend {s:?}: expected static or etcd"
            )),
        }
    }
}

/// `--kv-event-transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventTransport {
    /// ZMQ SUB to each worker's publisher.
    Zmq,
    /// A JetStream stream filled by relays.
    Nats,
}

impl FromStr for EventTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "zmq" => Ok(EventTransport::Zmq),
            "nats" => Ok(EventTransport::Nats),
            _ => Err(format!(
                "unknown KV-event transport {s:?}: expected zmq or nats"
            )),
        }
    }
}

/// `--request-transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestTransport {
    /// HTTP/1.1 to each worker's OpenAI server.
    Http,
}

impl FromStr for RequestTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "http" => Ok(RequestTransport::Http),
            _ => Err(format!("unknown request transport {s:?}: expected http")),
        }
    }
}

/// One `--worker`: where its OpenAI server listens and where it publishes KV events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The HTTP base URL, e.g. `http://127.0.0.1:30000`.
    pub url: String,
    /// Its name in the admin API and metrics: the URL's `host:port`.
    pub name: String,
    /// The ZMQ PUB endpoint of its KV events, if any.
    pub events: Option<String>,
    /// The ZMQ ROUTER endpoint that replays missed batches, if any.
    pub replay: Option<String>,
}

impl FromStr for WorkerSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let url = parts
            .next()
            .unwrap_or_default()
            .trim()
            .trim_end_matches('/');
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("worker {s:?}: expected a URL starting with http://"))?;
        let name = rest.split('/').next().unwrap_or_default();
        if !name.contains(':') || name.starts_with(':') {
            return Err(format!(
                "worker {s:?}: expected http://HOST:PORT (the port names the worker)"
            ));
        }
        let mut spec = WorkerSpec {
            url: url.to_string(),
            name: name.to_string(),
            events: None,
            replay: None,
        };
        for p in parts {
            match p.split_once('=') {
                Some(("events", ep)) if ep.starts_with("tcp://") => spec.events = Some(ep.into()),
                Some(("replay", ep)) if ep.starts_with("tcp://") => spec.replay = Some(ep.into()),
                _ => {
                    return Err(format!(
                        "worker {s:?}: unknown part {p:?}: expected events=tcp://HOST:PORT or replay=tcp://HOST:PORT"
                    ))
                }
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_specs_parse_and_errors_name_the_part() {
        let w: WorkerSpec =
            "http://127.0.0.1:30000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"
                .parse()
                .unwrap();
        assert_eq!(w.name, "127.0.0.1:30000");
        assert_eq!(w.events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(w.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        let bare: WorkerSpec = "http://10.0.0.1:8000/".parse().unwrap();
        assert_eq!(
            (bare.url.as_str(), bare.events),
            ("http://10.0.0.1:8000", None)
        );
        assert!("10.0.0.1:8000"
            .parse::<WorkerSpec>()
            .unwrap_err()
            .contains("http://"));
        assert!("http://h:1,foo=bar"
            .parse::<WorkerSpec>()
            .unwrap_err()
            .contains("\"foo=bar\""));
        assert!("http://host".parse::<WorkerSpec>().is_err());
    }

    #[test]
    fn busy_limits_take_waiting_requests_and_scrape_periods_parse() {
        let l: BusyLimits = "decode=0.9,capacity=100,waiting=4".parse().unwrap();
        assert_eq!(l.waiting, Some(4));
        let t = l.threshold().unwrap();
        assert_eq!(
            (t.waiting_limit(), t.decode_limit()),
            (Some(4), Some((0.9, 100)))
        );
        let t = "waiting=0"
            .parse::<BusyLimits>()
            .unwrap()
            .threshold()
            .unwrap();
        assert_eq!((t.waiting_limit(), t.decode_limit()), (Some(0), None));
        assert!("waiting=x"
            .parse::<BusyLimits>()
            .unwrap_err()
            .contains("waiting=N"));
        let c = Config::parse_from(["kvrouter", "--scrape-metrics-s", "0.5"]);
        assert_eq!(c.scrape_metrics_s, 0.5);
        assert_eq!(Config::default().scrape_metrics_s, 0.0);
        for bad in ["-1", "0.001", "inf", "x"] {
            assert!(Config::try_parse_from(["kvrouter", "--scrape-metrics-s", bad]).is_err());
        }
    }

    #[test]
    fn defaults_are_the_documents() {
        let c = Config::default();
        assert_eq!((c.port, c.block_size, c.kv_overlap_weight), (8000, 16, 1.0));
        assert_eq!(c.router_policy, PolicyName::KvAware);
        assert_eq!("etcd".parse::<Discovery>(), Ok(Discovery::Etcd));
        assert!("consul".parse::<Discovery>().is_err());
    }
}
