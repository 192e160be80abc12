//! The `kvsim` command: simulate a fleet of LLM engines behind a KV-aware router.

use std::process::ExitCode;

use clap::Parser;
use kvblock::BlockSize;
use kvsim::{ArrivalModel, LinearTiming, Policy, Popularity, SimConfig, Simulation};

/// Simulate a fleet of LLM engine replicas behind a KV-cache-aware router.
///
/// Every engine holds a real, capacity-bounded KV block cache and runs continuous batching;
/// the router scores engines with the same cost function a deployed kvroute router uses, so the
/// prefix-cache hit rate emerges from content, capacity and routing. Same flags and seed, same
/// report, byte for byte.
#[derive(Debug, Parser)]
#[command(
    name = "kvsim",
    version,
    about,
    long_about,
    allow_negative_numbers = true
)]
struct Cli {
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
    /// Requests to simulate.
    #[arg(
        long,
        default_value_t = 200,
        value_name = "N",
        help_heading = "Arrivals"
    )]
    des_num_requests: usize,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 0, value_name = "S", help_heading = "Arrivals")]
    seed: u64,

    /// Prefixes in the synthetic pool.
    #[arg(long, default_value_t = 8, value_name = "P", help_heading = "Content")]
    des_num_prefixes: usize,
    /// Tokens per prefix.
    #[arg(
        long,
        default_value_t = 2048,
        value_name = "L",
        help_heading = "Content"
    )]
    des_prefix_len: usize,
    /// How requests pick a prefix: uniform, or zipf:<s> for a few hot prefixes.
    #[arg(long, default_value = "uniform", value_parser = parse_popularity, value_name = "DIST", help_heading = "Content")]
    prefix_popularity: Popularity,
    /// Prompt tokens per request, prefix included (a unique suffix fills the rest).
    #[arg(
        long,
        default_value_t = 4096,
        value_name = "TOKENS",
        help_heading = "Content"
    )]
    input_len: usize,
    /// Output tokens per request.
    #[arg(
        long,
        default_value_t = 256,
        value_name = "TOKENS",
        help_heading = "Content"
    )]
    output_len: usize,
    /// Tokens per KV block, engines and router alike.
    #[arg(long, default_value_t = 16, value_parser = parse_block_size, value_name = "TOKENS", help_heading = "Content")]
    des_block_size: usize,

    /// Engine replicas behind the router.
    #[arg(long, default_value_t = 4, value_name = "N", help_heading = "Fleet")]
    des_instances: usize,
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
    /// Step time model: fixed cost per step, microseconds.
    #[arg(
        long,
        default_value_t = 7050.0,
        value_name = "US",
        help_heading = "Timing (per engine step; fit your own)"
    )]
    timing_base_us: f64,
    /// Step time model: microseconds per uncached prefill token.
    #[arg(
        long,
        default_value_t = 19.5,
        value_name = "US",
        help_heading = "Timing (per engine step; fit your own)"
    )]
    timing_prefill_us: f64,
    /// Step time model: microseconds per decoding request.
    #[arg(
        long,
        default_value_t = 25.4,
        value_name = "US",
        help_heading = "Timing (per engine step; fit your own)"
    )]
    timing_decode_us: f64,
    /// Step time model: microseconds per context token of decoding requests.
    #[arg(
        long,
        default_value_t = 0.04,
        value_name = "US",
        help_heading = "Timing (per engine step; fit your own)"
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
    /// Delay before the router sees the engines' KV events, milliseconds.
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "MS",
        help_heading = "Routing"
    )]
    des_event_delay_ms: f64,

    /// Output format: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"], value_name = "FORMAT", help_heading = "Output")]
    format: String,
    /// Add the per-instance table to the text report.
    #[arg(long, short, help_heading = "Output")]
    verbose: bool,
}

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

fn parse_block_size(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| "expected a whole number of tokens >= 1".to_string())?;
    BlockSize::new(n)
        .map(BlockSize::get)
        .map_err(|e| e.to_string())
}

impl Cli {
    fn config(&self) -> Result<SimConfig, String> {
        let delay = self.des_event_delay_ms;
        if !(delay.is_finite() && delay >= 0.0) {
            return Err(format!(
                "invalid --des-event-delay-ms {delay}: expected a finite number >= 0"
            ));
        }
        let mut cfg = SimConfig::default();
        cfg.request_rate = self.request_rate;
        cfg.arrival_model = self.arrival_model;
        cfg.arrival_cv = self.arrival_cv;
        cfg.num_requests = self.des_num_requests;
        cfg.seed = self.seed;
        cfg.num_prefixes = self.des_num_prefixes;
        cfg.prefix_len = self.des_prefix_len;
        cfg.prefix_popularity = self.prefix_popularity;
        cfg.input_len = self.input_len;
        cfg.output_len = self.output_len;
        cfg.block_size =
            BlockSize::new(self.des_block_size).map_err(|e| format!("--des-block-size: {e}"))?;
        cfg.instances = self.des_instances;
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
        cfg.event_delay_us = (delay * 1000.0).round() as u64;
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }
}

/// One line for a usage error: clap's first line, without its colours and "error: " prefix.
fn one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let first = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("invalid arguments");
    first.trim_start_matches("error: ").trim().to_string()
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
        Err(e) => {
            eprintln!("kvsim: {}", one_line(&e));
            return ExitCode::from(2);
        }
    };
    let cfg = match cli.config() {
        Ok(c) => c,
        Err(msg) => {
            eprintln!("kvsim: {msg}");
            return ExitCode::from(2);
        }
    };
    let report = match Simulation::new(cfg).and_then(|s| s.run()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvsim: {e}");
            return ExitCode::from(2);
        }
    };
    if cli.format == "json" {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text(cli.verbose));
    }
    ExitCode::SUCCESS
}
