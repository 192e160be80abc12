//! `kvload`: replays a Mooncake trace or kvsim's synthetic prefix pool against any
//! OpenAI-compatible endpoint and prints kvsim's report lines over what it measured.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kvblock::BlockSize;
use kvmock::load::{self, Api, LoadConfig};
use kvsim::SimConfig;

/// Replay traffic against an OpenAI-compatible endpoint (kvmock, kvrouter, or a real vLLM) and
/// measure TTFT, ITL, E2E, throughput and the cached tokens the endpoint reports.
///
/// The requests are those kvsim would simulate with the same flags: a Mooncake trace, or the
/// synthetic prefix pool (same tokens). Every request streams, with max_tokens from the output
/// length and ignore_eos set; the report has kvsim's lines.
#[derive(Debug, Parser)]
#[command(name = "kvload", version, about, long_about, after_help = EXAMPLES, allow_negative_numbers = true)]
struct Cli {
    /// Log lines on standard error: text, or one JSON object per line, filtered by RUST_LOG
    /// (default info).
    #[arg(long, default_value = "text", value_name = "text|json")]
    log_format: kvserve::logging::LogFormat,
    /// The endpoint, http://HOST:PORT; repeat it (or separate with commas) to spread requests
    /// round-robin over several (router replicas).
    #[arg(long, value_name = "URL", required = true, value_delimiter = ',')]
    endpoint: Vec<String>,
    /// The model to request [default: the first one /v1/models lists].
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// completions (token ids to /v1/completions) or chat (text to /v1/chat/completions).
    #[arg(long, default_value = "completions", value_name = "API")]
    api: Api,
    /// In-flight requests at most [default: open loop, no cap].
    #[arg(long, value_name = "N")]
    max_concurrency: Option<usize>,
    /// Token ids are reduced modulo N, so that any model's vocabulary accepts them.
    #[arg(long, default_value_t = 32_000, value_name = "N")]
    vocab_size: u32,
    /// Emulated time: send X times faster than the workload's times and report every measured
    /// time multiplied by X (pass kvmock's --speedup to compare with kvsim).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    speedup: f64,
    /// A request taking longer than this many seconds fails.
    #[arg(long, default_value_t = 600.0, value_name = "S")]
    request_timeout: f64,

    /// Arrivals, synthetic content and trace replay: kvsim's own flags (`kvsim::cli`), so a
    /// workload is spelled the same way live and simulated.
    #[command(flatten)]
    workload: kvsim::cli::WorkloadArgs,

    /// Tokens per KV block of the endpoint, for the report's block figures.
    #[arg(long, value_name = "TOKENS", help_heading = "Synthetic content")]
    des_block_size: Option<usize>,

    /// Output format: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"], value_name = "FORMAT", help_heading = "Output")]
    format: String,
    /// No progress bar.
    #[arg(long, short, help_heading = "Output")]
    quiet: bool,
    /// Also write every request as one JSON line (arrival_us, prompt_tokens, cached_tokens,
    /// output_tokens, ttft_us, e2e_us, mean_itl_us, status), written after the run so that
    /// recording costs the load nothing: `kvsim --spans FILE` replays it and
    /// `kvsim calibrate --spans FILE` fits the simulator to it.
    #[arg(long, value_name = "FILE.jsonl", help_heading = "Output")]
    record: Option<std::path::PathBuf>,
}

const EXAMPLES: &str = "Examples:
  kvload --endpoint http://127.0.0.1:30000 --des-num-requests 500 --request-rate 8
  kvload --endpoint http://127.0.0.1:30000 --trace conversation.jsonl --trace-speedup 10
  kvload --endpoint http://127.0.0.1:8000 --des-num-requests 300 --record run.jsonl   # then: kvsim calibrate --spans run.jsonl
  kvload --endpoint http://vllm-host:8000 --model meta-llama/Llama-3.1-8B-Instruct --api chat
  kvload --endpoint http://127.0.0.1:8000,http://127.0.0.1:8001 --des-num-requests 500  # two router replicas";

fn fail(flag: &str, message: impl std::fmt::Display) -> ! {
    eprintln!("kvload: invalid {flag}: {message}");
    std::process::exit(2);
}

fn sim_config(cli: &Cli) -> SimConfig {
    let mut cfg = SimConfig::default();
    if let Err(e) = cli.workload.load_trace(&mut cfg) {
        fail("--trace", e);
    }
    cli.workload.apply_settings(&mut cfg);
    if let Some(b) = cli.des_block_size {
        if cfg.trace.is_some() {
            fail(
                "--des-block-size",
                "a trace uses its own block size (--trace-block-size)",
            );
        }
        cfg.block_size = BlockSize::new(b).unwrap_or_else(|e| fail("--des-block-size", e));
    } else if cfg.trace.is_none() {
        cfg.block_size = BlockSize::new(16).unwrap_or_default();
    }
    if let Err(e) = cfg.validate() {
        // The library names the setting; map the common ones to their flags.
        let text = e.to_string();
        let flag = [
            ("request_rate", "--request-rate"),
            ("arrival_cv", "--arrival-cv"),
            ("num_requests", "--des-num-requests"),
            ("num_prefixes", "--des-num-prefixes"),
            ("prefix_len", "--des-prefix-len"),
            ("input_len", "--input-len"),
            ("output_len", "--output-len"),
            ("trace_speedup", "--trace-speedup"),
            ("arrival_model", "--arrival-model"),
            ("trace_timing", "--trace-timing"),
        ]
        .iter()
        .find(|(s, _)| text.contains(&format!("invalid {s} ")))
        .map_or("settings", |(_, f)| *f);
        fail(flag, text);
    }
    cfg
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let text = e.to_string();
            eprintln!("kvload: {}", kvmock::error::one_line(&text));
            std::process::exit(2);
        }
    };
    kvserve::logging::init(cli.log_format);
    if let Some(bad) = cli.endpoint.iter().find(|e| !e.starts_with("http://")) {
        fail("--endpoint", format!("{bad:?}: expected http://HOST:PORT"));
    }
    if !(cli.request_timeout.is_finite() && cli.request_timeout > 0.0) {
        fail("--request-timeout", "expected a number of seconds > 0");
    }
    if !(cli.speedup.is_finite() && cli.speedup > 0.0) {
        fail(
            "--speedup",
            format!("{}: expected a finite number > 0", cli.speedup),
        );
    }
    if cli.max_concurrency == Some(0) {
        fail("--max-concurrency", "0: expected at least 1");
    }
    let cfg = sim_config(&cli);
    let (requests, content) = kvsim::workload_requests(&cfg);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvload: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let endpoints: Vec<String> = cli
        .endpoint
        .iter()
        .map(|e| e.trim_end_matches('/').to_string())
        .collect();
    let endpoint = endpoints.join(",");
    let result = rt.block_on(async {
        let model = match &cli.model {
            Some(m) => m.clone(),
            None => load::first_model(&endpoints[0]).await?,
        };
        let lc = LoadConfig {
            endpoints: endpoints.clone(),
            model: model.clone(),
            api: cli.api,
            max_concurrency: cli.max_concurrency,
            vocab_size: cli.vocab_size,
            seed: cfg.seed,
            timeout: Duration::from_secs_f64(cli.request_timeout),
            speedup: cli.speedup,
        };
        let bar = indicatif::ProgressBar::new(requests.len() as u64);
        if cli.quiet || !std::io::stderr().is_terminal() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let b = bar.clone();
        let m = load::run(&lc, &requests, Arc::new(move |n| b.set_position(n as u64))).await;
        bar.finish_and_clear();
        Ok::<_, kvmock::MockError>((model, m))
    });
    let (model, m) = match result {
        Ok(x) => x,
        Err(e) => {
            eprintln!("kvload: {e}");
            std::process::exit(1);
        }
    };
    if let Some(path) = &cli.record {
        if let Err(e) = kvsim::write_records(path, &m.requests) {
            eprintln!("kvload: --record {}: cannot write: {e}", path.display());
            std::process::exit(1);
        }
    }
    let report = kvsim::measured_report(&cfg, format!("{content}, live"), &m.requests, &m.itl_us);
    let failed: usize = m.errors.iter().map(|e| e.1).sum();
    let lag = {
        let mut l = m.send_lag_us.clone();
        l.sort_unstable();
        let ms = |us: u64| us as f64 / 1e3;
        let mean = l.iter().sum::<u64>() as f64 / l.len().max(1) as f64 / 1e3;
        let p99 = l
            .get((l.len() * 99).div_ceil(100).saturating_sub(1))
            .copied()
            .unwrap_or(0);
        (mean, ms(p99), ms(l.last().copied().unwrap_or(0)))
    };
    if cli.format == "json" {
        let mut v = serde_json::to_value(&report).unwrap_or_default();
        v["endpoint"] = serde_json::json!(endpoint);
        v["model"] = serde_json::json!(model);
        v["wall_s"] = serde_json::json!(m.wall_s);
        v["issued_rps"] = serde_json::json!(m.requests.len() as f64 / m.wall_s.max(1e-9));
        v["send_lag_ms"] = serde_json::json!({"mean": lag.0, "p99": lag.1, "max": lag.2});
        v["errors"] = serde_json::json!(m
            .errors
            .iter()
            .map(|(k, n)| serde_json::json!({"reason": k, "count": n}))
            .collect::<Vec<_>>());
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        println!(
            "  Endpoint: {endpoint} model={model} | wall {:.2} s",
            m.wall_s
        );
        print!("{}", report.to_text(false));
        println!(
            "  Send lag ms: mean {:.1}, p99 {:.1}, max {:.1} (sent after the arrival time)",
            lag.0, lag.1, lag.2
        );
        if failed > 0 {
            let list: Vec<String> = m.errors.iter().map(|(k, n)| format!("{n} × {k}")).collect();
            println!("  Errors: {failed} ({})", list.join(", "));
        }
    }
    if failed == m.requests.len() && failed > 0 {
        std::process::exit(1);
    }
}
