//! The `kvsim` command: simulate a fleet of LLM engines behind a KV-aware router.

mod plot;
mod sweep;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use kvblock::BlockSize;
use kvsim::{
    ArrivalModel, LinearTiming, Policy, Popularity, SimConfig, Simulation, Trace, TraceTiming,
};

/// Simulate a fleet of LLM engine replicas behind a KV-cache-aware router.
///
/// Every engine holds a real, capacity-bounded KV block cache and runs continuous batching;
/// the router scores engines with the same cost function a deployed kvroute router uses, so the
/// prefix-cache hit rate emerges from content, capacity and routing. Same flags and seed, same
/// report, byte for byte.
#[derive(Debug, Parser)]
#[command(
    after_help = EXAMPLES,
    name = "kvsim",
    version,
    about,
    long_about,
    allow_negative_numbers = true,
    args_override_self = true,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Print a trace's statistics: requests, span, lengths, unique blocks, ideal hit rate.
    TraceStats {
        /// The trace (Mooncake JSONL).
        file: PathBuf,
        /// Tokens per block of the trace's hash ids.
        #[arg(long, default_value_t = 512, value_parser = parse_block_size, value_name = "TOKENS")]
        trace_block_size: usize,
        /// Output format: text or json.
        #[arg(long, default_value = "text", value_parser = ["text", "json"], value_name = "FORMAT")]
        format: String,
    },
    /// Run one simulation per value of a run parameter and tabulate the results.
    Sweep(Box<SweepArgs>),
}

#[derive(Debug, Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
struct SweepArgs {
    /// The parameter and its values: NAME=V1,V2,... where NAME is any run flag without its
    /// dashes (des-overlap-weight, des-kv-blocks, des-instances, des-routing, request-rate, ...).
    /// Repeat it to move several parameters together (the i-th run takes each one's i-th value).
    #[arg(long, value_name = "NAME=V1,V2,...", required = true)]
    param: Vec<String>,
    /// Also write the rows as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Draw hit rate and TTFT p99 against the swept value as an SVG chart.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Simulations to run at once (default: the machine's cores).
    #[arg(long, value_name = "N")]
    jobs: Option<usize>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    /// Arrival rate, requests per second.
    #[arg(
        long,
        default_value_t = 6.0,
        value_name = "R",
        help_heading = "Arrivals"
    )]
    request_rate: f64,
    /// Arrival process: poisson, constant or gamma.
    #[arg(long, default_value = "poisson", value_parser = parse_arrival, value_name = "MODEL", help_heading = "Arrivals")]
    arrival_model: ArrivalModel,
    /// Coefficient of variation of gamma inter-arrival times (1 = Poisson, higher = burstier).
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "CV",
        help_heading = "Arrivals"
    )]
    arrival_cv: f64,
    /// Requests to simulate [default: 200, or the whole trace].
    #[arg(long, value_name = "N", help_heading = "Arrivals")]
    des_num_requests: Option<usize>,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 0, value_name = "S", help_heading = "Arrivals")]
    seed: u64,

    /// Prefixes in the synthetic pool.
    #[arg(
        long,
        default_value_t = 8,
        value_name = "P",
        help_heading = "Synthetic content"
    )]
    des_num_prefixes: usize,
    /// Tokens per prefix.
    #[arg(
        long,
        default_value_t = 2048,
        value_name = "L",
        help_heading = "Synthetic content"
    )]
    des_prefix_len: usize,
    /// How requests pick a prefix: uniform, or zipf:<s> for a few hot prefixes.
    #[arg(long, default_value = "uniform", value_parser = parse_popularity, value_name = "DIST", help_heading = "Synthetic content")]
    prefix_popularity: Popularity,
    /// Prompt tokens per request, prefix included (a unique suffix fills the rest).
    #[arg(
        long,
        default_value_t = 4096,
        value_name = "TOKENS",
        help_heading = "Synthetic content"
    )]
    input_len: usize,
    /// Output tokens per request.
    #[arg(
        long,
        default_value_t = 256,
        value_name = "TOKENS",
        help_heading = "Synthetic content"
    )]
    output_len: usize,

    /// Replay this Mooncake-format JSONL trace instead of the synthetic prefix pool.
    #[arg(long, value_name = "FILE", help_heading = "Trace replay")]
    trace: Option<PathBuf>,
    /// Tokens per block of the trace's hash ids.
    #[arg(long, default_value_t = 512, value_parser = parse_block_size, value_name = "TOKENS", help_heading = "Trace replay")]
    trace_block_size: usize,
    /// Divide the trace's inter-arrival times by X.
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "X",
        help_heading = "Trace replay"
    )]
    trace_speedup: f64,
    /// keep: the trace's timestamps; rate: re-time arrivals with --arrival-model and --request-rate.
    #[arg(long, default_value = "keep", value_parser = parse_trace_timing, value_name = "MODE", help_heading = "Trace replay")]
    trace_timing: TraceTiming,

    /// Tokens per KV block, engines and router alike [default: 16, or the trace's block size].
    #[arg(long, value_parser = parse_block_size, value_name = "TOKENS", help_heading = "Fleet")]
    des_block_size: Option<usize>,
    /// Engine replicas behind the router [default: 4].
    #[arg(long, value_name = "N", help_heading = "Fleet")]
    des_instances: Option<usize>,
    /// KV blocks per engine (cache plus running requests); unset means unbounded.
    #[arg(long, value_name = "BLOCKS", help_heading = "Fleet")]
    des_kv_blocks: Option<usize>,
    /// Token budget of one engine step (prefill chunks plus one token per decoding request).
    #[arg(
        long,
        default_value_t = 8192,
        value_name = "TOKENS",
        help_heading = "Fleet"
    )]
    max_batched_tokens: usize,
    /// Running requests per engine.
    #[arg(long, default_value_t = 256, value_name = "N", help_heading = "Fleet")]
    max_num_seqs: usize,
    /// Step time: fixed cost per engine step, microseconds.
    #[arg(
        long,
        default_value_t = 7050.0,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_base_us: f64,
    /// Step time: microseconds per uncached prefill token.
    #[arg(
        long,
        default_value_t = 19.5,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_prefill_us: f64,
    /// Step time: microseconds per decoding request.
    #[arg(
        long,
        default_value_t = 25.4,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_decode_us: f64,
    /// Step time: microseconds per context token of decoding requests.
    #[arg(
        long,
        default_value_t = 0.04,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_context_us: f64,

    /// Routing policy: kv, prefix_aware, round_robin or random.
    #[arg(long, default_value = "kv", value_parser = parse_policy, value_name = "POLICY", help_heading = "Routing")]
    des_routing: Policy,
    /// kv policy: weight of missed blocks against load (0 = pure load balance).
    #[arg(
        long,
        default_value_t = 1.0,
        value_name = "W",
        help_heading = "Routing"
    )]
    des_overlap_weight: f64,
    /// prefix_aware policy: how many leading blocks form the consistent-hash key.
    #[arg(long, default_value_t = 1, value_name = "K", help_heading = "Routing")]
    prefix_aware_blocks: usize,
    /// Delay before the router sees the engines' KV events, milliseconds.
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "MS",
        help_heading = "Routing"
    )]
    des_event_delay_ms: f64,

    /// Router replicas, each with its own load view and cache index, taking arrivals in turn.
    #[arg(long, default_value_t = 1, value_name = "R", help_heading = "Routing")]
    des_routers: usize,

    /// Disaggregated serving: prefill engines (with --des-decode-instances, instead of --des-instances).
    #[arg(long, value_name = "P", help_heading = "Disaggregated prefill/decode")]
    des_prefill_instances: Option<usize>,
    /// Disaggregated serving: decode engines.
    #[arg(long, value_name = "D", help_heading = "Disaggregated prefill/decode")]
    des_decode_instances: Option<usize>,
    /// Overlap weight for routing prefills (typically 20) [default: --des-overlap-weight].
    #[arg(long, value_name = "W", help_heading = "Disaggregated prefill/decode")]
    kv_prefill_overlap_weight: Option<f64>,
    /// Overlap weight for routing decodes (typically 2) [default: --des-overlap-weight].
    #[arg(long, value_name = "W", help_heading = "Disaggregated prefill/decode")]
    kv_decode_overlap_weight: Option<f64>,
    /// Prefill-to-decode KV link bandwidth, gigabits per second.
    #[arg(
        long,
        default_value_t = 400.0,
        value_name = "GBPS",
        help_heading = "Disaggregated prefill/decode"
    )]
    pd_transfer_gbps: f64,
    /// Fixed latency of each KV transfer, microseconds.
    #[arg(
        long,
        default_value_t = 100,
        value_name = "US",
        help_heading = "Disaggregated prefill/decode"
    )]
    pd_transfer_latency_us: u64,
    /// KV cache bytes per token (131072: an 8B model with grouped-query attention in 16-bit).
    #[arg(
        long,
        default_value_t = 131_072,
        value_name = "BYTES",
        help_heading = "Disaggregated prefill/decode"
    )]
    kv_bytes_per_token: u64,

    /// Output format: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"], value_name = "FORMAT", help_heading = "Output")]
    format: String,
    /// Add the per-instance table to the text report.
    #[arg(long, short, help_heading = "Output")]
    verbose: bool,
    /// No progress bar.
    #[arg(long, short, help_heading = "Output")]
    quiet: bool,
}

const EXAMPLES: &str = "Examples:
  kvsim                                         the default fleet on a synthetic prefix pool
  kvsim --des-routing round_robin --des-kv-blocks 20000
  kvsim --trace conversation.jsonl --des-instances 8 --des-kv-blocks 900
  kvsim --des-prefill-instances 4 --des-decode-instances 4 --kv-prefill-overlap-weight 20
  kvsim trace-stats conversation.jsonl
  kvsim sweep --param des-overlap-weight=0,0.5,1,2,4 --plot sweep.svg";

fn parse_arrival(s: &str) -> Result<ArrivalModel, String> {
    s.parse()
        .map_err(|_| "expected one of poisson, constant, gamma".to_string())
}

fn parse_popularity(s: &str) -> Result<Popularity, String> {
    s.parse()
        .map_err(|_| "expected uniform or zipf:<s> with s a finite number > 0".to_string())
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    s.parse()
        .map_err(|_| "expected one of kv, prefix_aware, round_robin, random".to_string())
}

fn parse_trace_timing(s: &str) -> Result<TraceTiming, String> {
    s.parse().map_err(|_| "expected keep or rate".to_string())
}

fn parse_block_size(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| "expected a whole number of tokens >= 1".to_string())?;
    BlockSize::new(n)
        .map(BlockSize::get)
        .map_err(|e| e.to_string())
}

impl RunArgs {
    /// The simulation settings; errors are one line naming the flag (or FILE:LINE for a trace).
    pub(crate) fn config(&self) -> Result<SimConfig, String> {
        let delay = self.des_event_delay_ms;
        if !(delay.is_finite() && delay >= 0.0) {
            return Err(format!(
                "invalid --des-event-delay-ms {delay}: expected a finite number >= 0"
            ));
        }
        let mut cfg = SimConfig::default();
        if let Some(path) = &self.trace {
            let bs = BlockSize::new(self.trace_block_size)
                .map_err(|e| format!("--trace-block-size: {e}"))?;
            let trace = Trace::load(path, bs).map_err(|e| e.to_string())?;
            cfg = cfg.with_trace(trace);
        }
        if let Some(n) = self.des_num_requests {
            cfg.num_requests = n;
        }
        if let Some(bs) = self.des_block_size {
            cfg.block_size = BlockSize::new(bs).map_err(|e| format!("--des-block-size: {e}"))?;
        }
        cfg.request_rate = self.request_rate;
        cfg.arrival_model = self.arrival_model;
        cfg.arrival_cv = self.arrival_cv;
        cfg.seed = self.seed;
        cfg.num_prefixes = self.des_num_prefixes;
        cfg.prefix_len = self.des_prefix_len;
        cfg.prefix_popularity = self.prefix_popularity;
        cfg.input_len = self.input_len;
        cfg.output_len = self.output_len;
        cfg.trace_speedup = self.trace_speedup;
        cfg.trace_timing = self.trace_timing;
        if self.des_instances.is_some()
            && (self.des_prefill_instances.is_some() || self.des_decode_instances.is_some())
        {
            return Err("--des-instances cannot be combined with --des-prefill-instances/--des-decode-instances: \
                        give one fleet size or the two pool sizes"
                .to_string());
        }
        cfg.instances = self.des_instances.unwrap_or(cfg.instances);
        cfg.prefill_instances = self.des_prefill_instances;
        cfg.decode_instances = self.des_decode_instances;
        cfg.prefill_overlap_weight = self.kv_prefill_overlap_weight;
        cfg.decode_overlap_weight = self.kv_decode_overlap_weight;
        cfg.pd_transfer_gbps = self.pd_transfer_gbps;
        cfg.pd_transfer_latency_us = self.pd_transfer_latency_us;
        cfg.kv_bytes_per_token = self.kv_bytes_per_token;
        cfg.routers = self.des_routers;
        cfg.kv_blocks = self.des_kv_blocks;
        cfg.max_batched_tokens = self.max_batched_tokens;
        cfg.max_num_seqs = self.max_num_seqs;
        cfg.timing = LinearTiming::new(
            self.timing_base_us,
            self.timing_prefill_us,
            self.timing_decode_us,
            self.timing_context_us,
        );
        cfg.routing = self.des_routing;
        cfg.overlap_weight = self.des_overlap_weight;
        cfg.prefix_aware_blocks = self.prefix_aware_blocks;
        cfg.event_delay_us = (delay * 1000.0).round() as u64;
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }

    pub(crate) fn json(&self) -> bool {
        self.format == "json"
    }

    /// Whether to draw progress: stderr is a terminal and --quiet is not set.
    pub(crate) fn progress(&self) -> bool {
        !self.quiet && std::io::stderr().is_terminal()
    }
}

/// One line for a usage error: clap's first line, without its "error: " prefix.
pub(crate) fn one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let first = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("invalid arguments");
    first.trim_start_matches("error: ").trim().to_string()
}

fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("kvsim: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => return usage_error(one_line(&e)),
    };
    match cli.cmd {
        None => run(&cli.run),
        Some(Cmd::TraceStats {
            file,
            trace_block_size,
            format,
        }) => trace_stats(&file, trace_block_size, &format),
        Some(Cmd::Sweep(args)) => sweep_command(&args),
    }
}

/// Builds one configuration per swept value by parsing the command line again with the value
/// appended, so every run flag can be swept and is validated exactly as for a single run.
/// Several `--param`s move together: the i-th run takes the i-th value of each.
fn sweep_command(args: &SweepArgs) -> ExitCode {
    let params = match args
        .param
        .iter()
        .map(|p| sweep::parse_param(p))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(p) => p,
        Err(e) => return usage_error(e),
    };
    let runs = params.first().map_or(0, |p| p.1.len());
    if let Some((name, values)) = params.iter().find(|p| p.1.len() != runs) {
        return usage_error(format!(
            "invalid --param {name}: {} value(s), but the first --param has {runs}; swept parameters move together",
            values.len()
        ));
    }
    let argv: Vec<String> = std::env::args().collect();
    let mut configs = Vec::with_capacity(runs);
    for i in 0..runs {
        let mut a = argv.clone();
        for (name, values) in &params {
            a.push(format!("--{name}"));
            a.push(values[i].clone());
        }
        let label = params
            .iter()
            .map(|p| p.1[i].as_str())
            .collect::<Vec<_>>()
            .join("/");
        let parsed = match Cli::try_parse_from(&a) {
            Ok(Cli {
                cmd: Some(Cmd::Sweep(s)),
                ..
            }) => s.run.config(),
            Ok(_) => Err("internal: the sweep's command line did not parse as a sweep".to_string()),
            Err(e) => Err(one_line(&e)),
        };
        match parsed {
            Ok(cfg) => configs.push((label, cfg)),
            Err(e) => {
                let given = params
                    .iter()
                    .map(|p| format!("{}={}", p.0, p.1[i]))
                    .collect::<Vec<_>>()
                    .join(" ");
                return usage_error(format!("--param {given}: {e}"));
            }
        }
    }
    let name = params
        .iter()
        .map(|p| p.0.as_str())
        .collect::<Vec<_>>()
        .join("/");
    sweep::main(args, &name, configs)
}

fn run(args: &RunArgs) -> ExitCode {
    let cfg = match args.config() {
        Ok(c) => c,
        Err(msg) => return usage_error(msg),
    };
    let total = cfg.request_count();
    let sim = match Simulation::new(cfg) {
        Ok(s) => s,
        Err(e) => return usage_error(e),
    };
    let bar = (args.progress() && total >= 20_000).then(|| sweep::bar(total as u64, "requests"));
    let result = match &bar {
        Some(b) => sim.run_with_progress(&mut |done| b.set_position(done as u64)),
        None => sim.run(),
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    match result {
        Ok(report) if args.json() => println!("{}", report.to_json()),
        Ok(report) => print!("{}", report.to_text(args.verbose)),
        Err(e) => return usage_error(e),
    }
    ExitCode::SUCCESS
}

fn trace_stats(file: &std::path::Path, block_size: usize, format: &str) -> ExitCode {
    let Ok(bs) = BlockSize::new(block_size) else {
        return usage_error(format!("invalid --trace-block-size {block_size}"));
    };
    match Trace::load(file, bs) {
        Ok(t) => {
            let stats = t.stats();
            if format == "json" {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&stats).unwrap_or_default()
                );
            } else {
                print!("{}", stats.to_text(t.name()));
            }
            ExitCode::SUCCESS
        }
        Err(e) => usage_error(e),
    }
}
