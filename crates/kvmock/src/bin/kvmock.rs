//! `kvmock`: one emulated vLLM engine (OpenAI HTTP API, vLLM's ZMQ KV events) whose GPU is the
//! simulator's engine state machine driven by a clock.

use std::path::PathBuf;

use clap::Parser;
use kvblock::BlockSize;
use kvmock::driver::EngineHandle;
use kvmock::events::{KvEventsConfig, Publisher, WireShape};
use kvmock::server::{app, ApiConfig};
use kvmock::MockError;
use kvserve::tokenize::{self, ChatTemplate, Codec};
use kvsim::{EngineConfig, LinearTiming};

/// An emulated vLLM engine without a GPU: an OpenAI-compatible server with prefix caching and
/// vLLM's KV events, whose engine is kvsim's (continuous batching, chunked prefill, a block
/// cache of --num-gpu-blocks, the linear timing model) driven by the wall clock times --speedup.
#[derive(Debug, Parser)]
#[command(name = "kvmock", version, about, long_about, after_help = EXAMPLES, allow_negative_numbers = true)]
struct Cli {
    /// Log lines on standard error: text, or one JSON object per line, filtered by RUST_LOG
    /// (default info).
    #[arg(long, default_value = "text", value_name = "text|json")]
    log_format: kvserve::logging::LogFormat,
    /// Export an OpenTelemetry `llm_request` span per request, as vLLM does, to this OTLP/HTTP
    /// collector URL (http://HOST:4318/v1/traces), continuing the caller's traceparent. The
    /// latencies are emulated seconds (equal to wall seconds at --speedup 1); `kvsim calibrate
    /// --spans` reads them as it reads vLLM's.
    #[arg(long, value_name = "URL")]
    otlp_traces_endpoint: Option<String>,
    /// Fault injection: the share of completion requests answered 500 at once (0 to 1; which
    /// ones is fixed by --seed), for testing what stands in front of the engine.
    #[arg(long, default_value_t = 0.0, value_name = "P", value_parser = parse_share)]
    fault_error_rate: f64,
    /// Fault injection: every completion request waits this long before it is handled,
    /// milliseconds (a stalled engine).
    #[arg(long, default_value_t = 0, value_name = "MS")]
    fault_stall_ms: u64,
    /// Fault injection: the process exits (status 3, as a crashed engine) once it has streamed
    /// this many tokens in all, right after sending the last one: its streams end mid-answer,
    /// without [DONE] (0: never).
    #[arg(long, default_value_t = 0, value_name = "N")]
    fault_die_after_tokens: u64,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0", value_name = "HOST")]
    host: String,
    /// HTTP port.
    #[arg(long, default_value_t = 30000, value_name = "PORT")]
    port: u16,
    /// The model name the API serves (requests naming another model get 404).
    #[arg(long, default_value = "mock", value_name = "NAME")]
    served_model_name: String,
    /// Tokens per KV block (must equal the router's).
    #[arg(long, default_value_t = 16, value_name = "TOKENS")]
    block_size: usize,
    /// KV blocks of the engine, cache and running requests together [default: unbounded].
    #[arg(long, value_name = "BLOCKS")]
    num_gpu_blocks: Option<usize>,
    /// Running requests at most.
    #[arg(long, default_value_t = 256, value_name = "N")]
    max_num_seqs: usize,
    /// Token budget of one engine step (prefill chunks plus one token per decoding request).
    #[arg(long, default_value_t = 8192, value_name = "TOKENS")]
    max_num_batched_tokens: usize,
    /// Prompt plus output tokens at most; longer requests get 400.
    #[arg(long, default_value_t = 131_072, value_name = "TOKENS")]
    max_model_len: usize,
    /// Publish KV events (as vLLM's enable_kv_cache_events).
    #[arg(long)]
    enable_kv_events: bool,
    /// vLLM's KV-events settings as JSON: publisher ("zmq"), endpoint (tcp://*:5557),
    /// replay_endpoint (e.g. tcp://*:5558), topic, buffer_steps, enable_kv_cache_events.
    #[arg(long, value_name = "JSON")]
    kv_events_config: Option<String>,
    /// Encoding of the events: map (vLLM's current tagged maps) or array (the older shape).
    #[arg(long, default_value = "map", value_name = "SHAPE")]
    kv_events_shape: WireShape,
    /// A Hugging Face tokenizer.json, or a directory with it and tokenizer_config.json (chat
    /// template), or builtin:bytes [default: builtin:bytes, one token per UTF-8 byte and a
    /// ChatML template].
    #[arg(long, value_name = "PATH|builtin:bytes")]
    tokenizer: Option<PathBuf>,
    /// Emulated time runs X times faster than the wall clock.
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    speedup: f64,
    /// Step time: fixed cost per engine step, microseconds.
    #[arg(long, value_name = "US", default_value_t = LinearTiming::default().base_us, help_heading = "Timing (kvsim's linear model)")]
    timing_base_us: f64,
    /// Step time: microseconds per uncached prefill token.
    #[arg(long, value_name = "US", default_value_t = LinearTiming::default().prefill_us_per_token, help_heading = "Timing (kvsim's linear model)")]
    timing_prefill_us: f64,
    /// Step time: microseconds per decoding request.
    #[arg(long, value_name = "US", default_value_t = LinearTiming::default().decode_us_per_request, help_heading = "Timing (kvsim's linear model)")]
    timing_decode_us: f64,
    /// Step time: microseconds per context token of decoding requests.
    #[arg(long, value_name = "US", default_value_t = LinearTiming::default().context_us_per_token, help_heading = "Timing (kvsim's linear model)")]
    timing_context_us: f64,
    /// Seed of the output tokens.
    #[arg(long, default_value_t = 0, value_name = "S")]
    seed: u64,
    /// LoRA adapters served besides the base model, as vLLM's flag: NAME=PATH (or vLLM's JSON
    /// form) each. Requests naming one as their model run with it: its blocks are keyed by its
    /// name (never shared with the base model's), and its KV events carry the name, as vLLM's.
    /// /v1/models lists each with the base model as parent. Nothing is loaded.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    lora_modules: Vec<kvmock::server::LoraModule>,
    /// Data-parallel rank: offsets the KV-event ports and tags the batches, as vLLM does.
    #[arg(long, value_name = "RANK")]
    data_parallel_rank: Option<u16>,
    /// Register this engine in etcd (HOST:PORT of its client URL) under kvkit/workers/, with a
    /// lease that lapses when the engine stops, so kvrouter --discovery-backend etcd finds it.
    #[arg(long, value_name = "HOST:PORT", help_heading = "Discovery")]
    etcd_endpoint: Option<String>,
    /// The host others reach this engine at, in its etcd record [default: --host, or 127.0.0.1
    /// when --host is a wildcard].
    #[arg(long, value_name = "HOST", help_heading = "Discovery")]
    advertise_host: Option<String>,
}

const EXAMPLES: &str = "Examples:
  kvmock --port 30000 --num-gpu-blocks 4096 --enable-kv-events \\
         --kv-events-config '{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}'
  kvmock --tokenizer ./my-model/ --speedup 10
  curl localhost:30000/v1/completions -d '{\"prompt\": [1,2,3], \"max_tokens\": 4}'";

fn config_err(flag: &'static str, message: impl Into<String>) -> MockError {
    MockError::Config {
        flag,
        message: message.into(),
    }
}

struct Setup {
    engine: EngineConfig,
    timing: LinearTiming,
    events: Option<KvEventsConfig>,
    codec: Codec,
    template: ChatTemplate,
}

fn setup(cli: &Cli) -> Result<Setup, MockError> {
    let bs = BlockSize::new(cli.block_size)
        .map_err(|e| config_err("--block-size", format!("{}: {e}", cli.block_size)))?;
    if !(cli.speedup.is_finite() && cli.speedup > 0.0) {
        return Err(config_err(
            "--speedup",
            format!("{}: expected a finite number > 0", cli.speedup),
        ));
    }
    if cli.num_gpu_blocks == Some(0) {
        return Err(config_err("--num-gpu-blocks", "0: expected at least 1"));
    }
    if cli.max_num_seqs == 0 || cli.max_num_seqs >= cli.max_num_batched_tokens {
        return Err(config_err(
            "--max-num-seqs",
            format!(
                "{}: expected at least 1 and fewer than --max-num-batched-tokens ({})",
                cli.max_num_seqs, cli.max_num_batched_tokens
            ),
        ));
    }
    if cli.max_model_len == 0 {
        return Err(config_err("--max-model-len", "0: expected at least 1"));
    }
    let mut engine = EngineConfig::new(bs);
    engine.kv_blocks = cli.num_gpu_blocks;
    engine.max_num_seqs = cli.max_num_seqs;
    engine.max_batched_tokens = cli.max_num_batched_tokens;
    let timing = LinearTiming::new(
        cli.timing_base_us,
        cli.timing_prefill_us,
        cli.timing_decode_us,
        cli.timing_context_us,
    );
    for (flag, v) in [
        ("--timing-base-us", timing.base_us),
        ("--timing-prefill-us", timing.prefill_us_per_token),
        ("--timing-decode-us", timing.decode_us_per_request),
        ("--timing-context-us", timing.context_us_per_token),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(config_err(
                flag,
                format!("{v}: expected a finite number >= 0"),
            ));
        }
    }
    let mut events: KvEventsConfig = match &cli.kv_events_config {
        Some(json) => serde_json::from_str(json)
            .map_err(|e| config_err("--kv-events-config", format!("{e}")))?,
        None => KvEventsConfig::default(),
    };
    events.enable_kv_cache_events |= cli.enable_kv_events;
    let events = match events.publisher.as_str() {
        _ if !events.enable_kv_cache_events => None,
        "null" => None,
        "zmq" => Some(events),
        other => {
            return Err(config_err(
                "--kv-events-config",
                format!("publisher {other:?}: expected \"zmq\" or \"null\""),
            ))
        }
    };
    let (codec, template) = match &cli.tokenizer {
        Some(p) => tokenize::load(p)?,
        None => (Codec::Bytes, ChatTemplate::default()),
    };
    Ok(Setup {
        engine,
        timing,
        events,
        codec,
        template,
    })
}

async fn serve(cli: Cli, s: Setup) -> Result<(), MockError> {
    let rank = cli.data_parallel_rank.map(i64::from);
    let events_cfg = s.events.clone();
    let publisher = match &s.events {
        Some(ev) => Some(Publisher::start(ev, cli.kv_events_shape, rank).await?),
        None => None,
    };
    let engine = EngineHandle::start(s.engine, s.timing, cli.speedup, publisher);
    let api = ApiConfig {
        model: cli.served_model_name.clone(),
        block_size: cli.block_size,
        kv_blocks: cli.num_gpu_blocks,
        max_model_len: cli.max_model_len,
        seed: cli.seed,
        codec: s.codec,
        template: s.template,
        engine_label: cli.data_parallel_rank.unwrap_or(0).to_string(),
        lora_modules: cli.lora_modules.clone(),
        faults: kvmock::server::Faults {
            error_rate: cli.fault_error_rate,
            stall_ms: cli.fault_stall_ms,
            die_after_tokens: cli.fault_die_after_tokens,
        },
    };
    let addr = format!("{}:{}", cli.host, cli.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| MockError::Io(format!("cannot listen on {addr}: {e}")))?;
    tracing::info!(
        "serving {} on http://{addr} (block size {}, {} KV blocks, speedup {}){}",
        cli.served_model_name,
        cli.block_size,
        cli.num_gpu_blocks
            .map_or_else(|| "unbounded".to_string(), |n| n.to_string()),
        cli.speedup,
        s.events
            .as_ref()
            .map(|e| format!(", KV events on {}", e.endpoint))
            .unwrap_or_default()
    );
    let _registration = match &cli.etcd_endpoint {
        Some(ep) => Some(register(&cli, &events_cfg, ep).await?),
        None => None,
    };
    // No Nagle delay: streamed tokens leave when they are produced.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app(api, engine))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| MockError::Io(e.to_string()))
}

/// Registers the engine in etcd; the returned task keeps its lease alive.
async fn register(
    cli: &Cli,
    events: &Option<KvEventsConfig>,
    etcd: &str,
) -> Result<tokio::task::JoinHandle<()>, MockError> {
    let host = cli.advertise_host.clone().unwrap_or_else(|| {
        if cli.host == "0.0.0.0" || cli.host == "::" {
            "127.0.0.1".into()
        } else {
            cli.host.clone()
        }
    });
    let offset = cli.data_parallel_rank.unwrap_or(0);
    // A wildcard or bound address is reached at the advertised host.
    let reach = |ep: &str| -> Result<String, MockError> {
        let ep = kvmock::events::endpoint_for(ep, offset)?;
        let port = ep.rsplit(':').next().unwrap_or_default();
        Ok(format!("tcp://{host}:{port}"))
    };
    let (events, replay) = match events {
        Some(ev) => (
            Some(reach(&ev.endpoint)?),
            ev.replay_endpoint.as_deref().map(reach).transpose()?,
        ),
        None => (None, None),
    };
    let name = format!("{host}:{}", cli.port);
    let record = kvserve::etcd::WorkerRecord {
        url: format!("http://{name}"),
        events,
        replay,
        block_size: cli.block_size,
        model: Some(cli.served_model_name.clone()),
    };
    kvserve::etcd::Etcd::new(etcd)
        .register(&name, &record, 3)
        .await
        .map_err(|e| config_err("--etcd-endpoint", e))
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let text = e.to_string();
            eprintln!("kvmock: {}", kvmock::error::one_line(&text));
            std::process::exit(2);
        }
    };
    let endpoint = cli.otlp_traces_endpoint.as_deref();
    let traces = match kvserve::logging::init_traced(cli.log_format, endpoint, "kvmock") {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("kvmock: {e}");
            std::process::exit(2);
        }
    };
    let s = match setup(&cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvmock: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvmock: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(serve(cli, s)) {
        eprintln!("kvmock: {e}");
        std::process::exit(1);
    }
    // The spans still queued go out before the process ends.
    drop(traces);
}

/// A share between 0 and 1.
fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("expected a number from 0 to 1, got {s:?}")),
    }
}
