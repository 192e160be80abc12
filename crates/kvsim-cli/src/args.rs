//! The command line: flags, their defaults (read from `SimConfig::default()`), and the mapping
//! from the library's setting names to the flags that set them.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kvblock::BlockSize;
use kvsim::{
    CostModel, KvAllocation, LinearTiming, PdLink, Policy, SessionAffinity, SimConfig, Slo,
    TimingKind, Trace, VllmLog,
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
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Option<Cmd>,
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Cmd {
    /// Print a trace's statistics: requests, span, lengths, unique blocks, ideal hit rate.
    TraceStats {
        /// The trace (Mooncake JSONL).
        file: PathBuf,
        /// Tokens per block of the trace's hash ids.
        #[arg(long, default_value_t = Trace::MOONCAKE_BLOCK_SIZE, value_parser = kvsim::cli::parse_block_size, value_name = "TOKENS")]
        trace_block_size: usize,
        /// Output format: text or json.
        #[arg(long, default_value = "text", value_parser = ["text", "json"], value_name = "FORMAT")]
        format: String,
    },
    /// Run one simulation per value of a run parameter and tabulate the results.
    Sweep(Box<SweepArgs>),
    /// Fit the linear timing model to measured requests (--spans, with the simulator in the
    /// loop) or to measured engine steps (--steps, least squares), and print the coefficients
    /// as --timing-* flags. With --spans the last line gives every flag that reproduces the fit.
    Calibrate(Box<CalibrateArgs>),
    /// Find the highest arrival rate (or the fewest instances) that keeps the --slo-* targets
    /// for a share of requests, by a parallel bisection over simulations.
    Capacity(Box<CapacityArgs>),
}

/// `kvsim calibrate`: its own flags, then every run flag (the engine the spans came from).
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub(crate) struct CalibrateArgs {
    /// Measured steps: a CSV with the header
    /// prefill_tokens,decode_requests,context_tokens,step_us (any column order; other columns
    /// ignored), one engine step per line. Instead of --spans.
    #[arg(
        long,
        value_name = "FILE.csv",
        conflicts_with = "spans",
        required_unless_present = "spans"
    )]
    pub(crate) steps: Option<PathBuf>,
    /// With --spans: cut the requests, in arrival order, into phases of N requests (a
    /// benchmark's phases, e.g. guidellm's --max-requests).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 25,
        conflicts_with = "phase_window_s"
    )]
    pub(crate) phase_requests: usize,
    /// With --spans: cut the requests into windows of S seconds of arrival time instead.
    #[arg(long, value_name = "S")]
    pub(crate) phase_window_s: Option<f64>,
    /// With --spans: fit only these phases (e.g. 0,1 or 0-3) and predict the others; default
    /// all.
    #[arg(long, value_name = "LIST")]
    pub(crate) fit_phases: Option<String>,
    /// With --spans: simulations at most.
    #[arg(long, value_name = "N", default_value_t = 1_500)]
    pub(crate) max_evaluations: usize,
    /// With --spans: draw each phase's mean TTFT, ITL and E2E, measured and simulated, as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

/// `kvsim capacity`: the search's own flags, then every run flag.
#[derive(Debug, Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub(crate) struct CapacityArgs {
    /// What to find: rate (the highest arrival rate meeting the targets; with a trace and
    /// --trace-timing keep, reached by --trace-speedup, shown as requests/s) or instances (the
    /// fewest --des-instances meeting them at the run's rate).
    #[arg(long, default_value = "rate", value_parser = ["rate", "instances"], value_name = "WHAT")]
    pub(crate) find: String,
    /// Share of all requests (rejected ones count as misses) that must meet every --slo-* target.
    #[arg(long, default_value_t = 0.99, value_name = "SHARE")]
    pub(crate) attainment: f64,
    /// Simulations in all; the search stops earlier when the rate bracket is within 0.5% or
    /// the instance bracket one apart.
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub(crate) runs: usize,
    /// Simulations per round, run in parallel. The points tried depend on this, never on --jobs,
    /// so a seed gives the same search on any machine.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub(crate) probes: usize,
    /// --find instances: the most instances to try.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub(crate) max_instances: usize,
    /// Draw attainment against the rate (or instances) as an SVG chart, with the target.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) batch: Batch,
}

/// What runs many simulations takes: how many at once, and every run flag.
#[derive(Debug, Args)]
pub(crate) struct Batch {
    /// Simulations to run at once (default: the machine's cores).
    #[arg(long, value_name = "N")]
    jobs: Option<usize>,
    #[command(flatten)]
    pub(crate) run: RunArgs,
}

impl Batch {
    /// Threads to run simulations on: --jobs, or the machine's cores.
    pub(crate) fn jobs(&self) -> usize {
        self.jobs
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

#[derive(Debug, Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub(crate) struct SweepArgs {
    /// The parameter and its values: NAME=V1,V2,... where NAME is any run flag without its
    /// dashes (des-overlap-weight, des-kv-blocks, des-instances, des-routing, request-rate, ...).
    /// Repeat it to move several parameters together (the i-th run takes each one's i-th value).
    #[arg(long, value_name = "NAME=V1,V2,...", required = true)]
    pub(crate) param: Vec<String>,
    /// Also write the rows as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    pub(crate) csv: Option<PathBuf>,
    /// Draw hit rate and TTFT p99 against the swept value as an SVG chart.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) batch: Batch,
}

/// The run flags. Each simulation setting is an `Option`: unset means `SimConfig::default()`'s
/// value, which `--help` shows (see [`command`]).
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct RunArgs {
    /// Arrivals, synthetic content and trace replay: the flags kvload shares.
    #[command(flatten)]
    pub(crate) workload: kvsim::cli::WorkloadArgs,

    /// Synthetic chat sessions instead of single requests: N sessions start at the arrival
    /// model's times (--request-rate sessions/s), each with a pool prefix and
    /// input-len - des-prefix-len new tokens; every later turn is sent --think-ms after the
    /// previous one finished, its prompt that prompt + its answer + new tokens.
    #[arg(long, value_name = "N", help_heading = "Sessions and closed loops")]
    sessions: Option<usize>,
    /// Turns per synthetic session.
    #[arg(long, value_name = "T", help_heading = "Sessions and closed loops")]
    turns: Option<usize>,
    /// Think time between a synthetic turn's end and the next turn, milliseconds.
    #[arg(long, value_name = "MS", help_heading = "Sessions and closed loops")]
    think_ms: Option<f64>,
    /// Closed loop: keep N requests in flight, sending the next as soon as one finishes
    /// (arrival times and trace timestamps ignored; sessions keep their order).
    #[arg(long, value_name = "N", help_heading = "Sessions and closed loops")]
    concurrency: Option<usize>,
    /// How the routers treat a session's turns (--sessions, or a trace's session_id), as
    /// kvrouter's flag of the same name does with x-session-id: soft sends a turn to the
    /// instance of its session's last turn unless that one is busy (--busy-threshold), then
    /// moves the session; hard never moves it; off routes every turn on its own. Off by
    /// default here, soft in kvrouter: a run without the flag routes as it always did.
    /// Simulated instances never go down, so hard differs from soft only on busy ones.
    #[arg(long, value_parser = parse_session_affinity, value_name = "MODE", help_heading = "Sessions and closed loops")]
    session_affinity: Option<SessionAffinity>,
    /// With --session-affinity: how long a router remembers a session after its last turn,
    /// seconds of simulated time (0 remembers none).
    #[arg(long, value_name = "S", help_heading = "Sessions and closed loops")]
    session_ttl_s: Option<f64>,

    /// Replay measured requests (their arrival times, prompt and output lengths): vLLM's
    /// OpenTelemetry request spans as a collector's file exporter writes them (one OTLP/JSON
    /// resourceSpans object per line), or the JSONL records of kvload --record and
    /// kvsim --requests-out.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "trace",
        help_heading = "Measured requests"
    )]
    pub(crate) spans: Option<PathBuf>,
    /// With --spans: tokens at the start of every prompt that all prompts share (spans carry no
    /// tokens, so nothing else is shared).
    #[arg(
        long,
        value_name = "N",
        requires = "spans",
        help_heading = "Measured requests"
    )]
    pub(crate) shared_prefix_tokens: Option<usize>,
    /// Configure each engine as this vLLM startup log states: block size, KV blocks
    /// (num_gpu_blocks or the KV cache size in tokens), --max-batched-tokens, --max-num-seqs,
    /// incremental KV allocation and --scheduler vllm. Flags given explicitly win.
    #[arg(long, value_name = "FILE", help_heading = "Measured requests")]
    pub(crate) vllm_log: Option<PathBuf>,
    /// Also write every simulated request as one JSON line (arrival_us, prompt_tokens,
    /// cached_tokens, output_tokens, ttft_us, e2e_us, mean_itl_us, status, instance,
    /// preemptions): the format --spans reads back.
    #[arg(long, value_name = "FILE.jsonl", help_heading = "Output")]
    pub(crate) requests_out: Option<PathBuf>,

    /// Tokens per KV block, engines and router alike (a trace: its block size).
    #[arg(long, value_parser = kvsim::cli::parse_block_size, value_name = "TOKENS", help_heading = "Fleet")]
    pub(crate) des_block_size: Option<usize>,
    /// Engine replicas behind the router.
    #[arg(long, value_name = "N", help_heading = "Fleet")]
    pub(crate) des_instances: Option<usize>,
    /// Data-parallel ranks per instance, each with its own KV cache (--des-kv-blocks) and batch.
    #[arg(long, value_name = "R", help_heading = "Fleet")]
    dp_ranks: Option<usize>,
    /// With --dp-ranks: rank (the router picks the engine and the rank, mirroring each rank) or
    /// engine (the router picks an engine, which hands requests to its ranks in turn, and
    /// mirrors it as one cache from all its ranks' events).
    #[arg(long, value_parser = parse_dp_routing, value_name = "WHAT", help_heading = "Fleet")]
    dp_routing: Option<kvsim::DpRouting>,
    /// Host-memory KV blocks per engine: device evictions are demoted there and loaded back
    /// instead of recomputed (unset or 0: no host tier).
    #[arg(long, value_name = "BLOCKS", help_heading = "Fleet")]
    host_kv_blocks: Option<usize>,
    /// Host-to-device bandwidth for loading host-tier blocks, gigabytes per second (each block
    /// is --kv-bytes-per-token x block size bytes).
    #[arg(long, value_name = "GBPS", help_heading = "Fleet")]
    host_load_gbps: Option<f64>,
    /// KV blocks per engine (cache plus running requests); unset means unbounded.
    #[arg(long, value_name = "BLOCKS", help_heading = "Fleet")]
    des_kv_blocks: Option<usize>,
    /// Token budget of one engine step (prefill chunks plus one token per decoding request).
    #[arg(long, value_name = "TOKENS", help_heading = "Fleet")]
    max_batched_tokens: Option<usize>,
    /// Running requests per engine.
    #[arg(long, value_name = "N", help_heading = "Fleet")]
    max_num_seqs: Option<usize>,
    /// KV allocation: reserve (a request's prompt and output blocks at admission) or
    /// incremental (as vLLM: the prompt's at admission, then a block at a time as it decodes;
    /// when none is free the newest request is preempted and later recomputes; the report
    /// counts preemptions and recomputed tokens).
    #[arg(long, value_parser = parse_kv_allocation, value_name = "MODE", help_heading = "Fleet")]
    kv_allocation: Option<KvAllocation>,
    /// Step scheduling: kvsim (admit whenever a sequence slot and blocks are free) or vllm
    /// (vLLM V1's scheduler: running requests first, waiting ones admitted while the step's
    /// token budget, --max-num-seqs and free blocks allow, each chunk's blocks allocated as it
    /// is scheduled, a cached prefix reused in whole blocks up to the prompt less one token;
    /// always incremental allocation). --vllm-log sets vllm.
    #[arg(long, value_parser = parse_scheduler, value_name = "RULES", help_heading = "Fleet")]
    scheduler: Option<kvsim::Scheduler>,
    /// Step-time model: linear (the --timing-* coefficients) or polynomial (NVIDIA Dynamo
    /// mocker's: prefill quadratic in new tokens, decode quadratic in KV utilisation; see
    /// kvsim::PolynomialTiming).
    #[arg(long, value_parser = parse_timing_kind, value_name = "MODEL", help_heading = TIMING)]
    timing: Option<TimingKind>,
    /// Polynomial timing: KV capacity in tokens that utilisation is measured against when
    /// --des-kv-blocks is unset (otherwise blocks times block size).
    #[arg(long, value_name = "TOKENS", help_heading = TIMING)]
    timing_kv_tokens: Option<u64>,
    /// Step time: fixed cost per engine step, microseconds.
    #[arg(
        long,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_base_us: Option<f64>,
    /// Step time: microseconds per uncached prefill token.
    #[arg(
        long,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_prefill_us: Option<f64>,
    /// Step time: microseconds per decoding request.
    #[arg(
        long,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_decode_us: Option<f64>,
    /// Step time: microseconds per context token of decoding requests.
    #[arg(
        long,
        value_name = "US",
        help_heading = "Timing (linear per engine step; fit your own)"
    )]
    timing_context_us: Option<f64>,

    /// Routing policy: kv, prefix_aware, round_robin or random.
    #[arg(long, value_parser = parse_policy, value_name = "POLICY", help_heading = "Routing")]
    des_routing: Option<Policy>,
    /// kv policy: weight of missed blocks against load (0 = pure load balance).
    #[arg(long, value_name = "W", help_heading = "Routing")]
    des_overlap_weight: Option<f64>,
    /// prefix_aware policy: how many leading blocks form the consistent-hash key.
    #[arg(long, value_name = "K", help_heading = "Routing")]
    prefix_aware_blocks: Option<usize>,
    /// Delay before the router sees the engines' KV events, milliseconds.
    #[arg(long, value_name = "MS", help_heading = "Routing")]
    des_event_delay_ms: Option<f64>,
    /// Router replicas, each with its own load view and cache index, taking arrivals in turn.
    #[arg(long, value_name = "R", help_heading = "Routing")]
    des_routers: Option<usize>,
    /// Router replicas share their in-flight load: each route and finish reaches the others as
    /// a load delta after --des-sync-delay-ms.
    #[arg(long, help_heading = "Routing")]
    des_router_sync: bool,
    /// Delay of a load delta between router replicas, milliseconds.
    #[arg(long, value_name = "MS", help_heading = "Routing")]
    des_sync_delay_ms: Option<f64>,
    /// kv policy: seed (W x missed blocks + active blocks) or prefill-aware
    /// (W x (pending prefill + missed blocks) + decode blocks).
    #[arg(long, value_parser = parse_cost_model, value_name = "MODEL", help_heading = "Routing")]
    cost_model: Option<CostModel>,
    /// kv policy: 0 takes the lowest cost; T > 0 samples engines with probability
    /// exp(-(cost - min) / (T x (max - min))).
    #[arg(long, value_name = "T", help_heading = "Routing")]
    router_temperature: Option<f64>,
    /// kv policy: skip busy engines unless all are busy. decode=F: decode blocks above F x
    /// --des-kv-blocks; prefill-tokens=N: pending prefill above N tokens; one or both, comma
    /// separated.
    #[arg(long, value_parser = parse_busy, value_name = "decode=F,prefill-tokens=N", help_heading = "Routing")]
    busy_threshold: Option<Busy>,
    /// Count a routed request's blocks as hits on its engine for this long, or until the
    /// engine's events confirm them (0 = off), milliseconds.
    #[arg(long, value_name = "MS", help_heading = "Routing")]
    predicted_ttl_ms: Option<f64>,
    /// kv policy: what a host-tier hit counts against a device hit, 0 to 1 (0: the router
    /// ignores the host tier).
    #[arg(long, value_name = "C", help_heading = "Routing")]
    host_hit_credit: Option<f64>,

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
        value_name = "GBPS",
        help_heading = "Disaggregated prefill/decode"
    )]
    pd_transfer_gbps: Option<f64>,
    /// per-transfer: every KV transfer gets the whole --pd-transfer-gbps; shared: the transfers
    /// leaving one prefill engine share it equally.
    #[arg(long, value_parser = parse_pd_link, value_name = "MODE", help_heading = "Disaggregated prefill/decode")]
    pd_link: Option<PdLink>,
    /// Fixed latency of each KV transfer, microseconds.
    #[arg(long, value_name = "US", help_heading = "Disaggregated prefill/decode")]
    pd_transfer_latency_us: Option<u64>,
    /// KV cache bytes per token (131072: an 8B model with grouped-query attention in 16-bit).
    #[arg(
        long,
        value_name = "BYTES",
        help_heading = "Disaggregated prefill/decode"
    )]
    kv_bytes_per_token: Option<u64>,

    /// Target time to first token (arrival to first token), ms: the report adds the share of
    /// requests within each target, within all of them, and the goodput (requests per second
    /// within all). A rejected request misses every target.
    #[arg(long, value_name = "MS", help_heading = "Service-level objectives")]
    pub(crate) slo_ttft_ms: Option<f64>,
    /// Target inter-token latency, ms, on each request's mean gap between its output tokens
    /// ((last - first token) / (output - 1); one output token always meets it).
    #[arg(long, value_name = "MS", help_heading = "Service-level objectives")]
    pub(crate) slo_itl_ms: Option<f64>,
    /// Target end-to-end latency (arrival to last token), ms.
    #[arg(long, value_name = "MS", help_heading = "Service-level objectives")]
    pub(crate) slo_e2e_ms: Option<f64>,

    /// Output format: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"], value_name = "FORMAT", help_heading = "Output")]
    format: String,
    /// Add the per-instance table to the text report.
    #[arg(long, short, help_heading = "Output")]
    verbose: bool,
    /// No progress bar.
    #[arg(long, short, help_heading = "Output")]
    quiet: bool,
    /// Whether the caller draws progress bars at all (the command does; a library call
    /// through [`crate::run`] does not): not a flag.
    #[arg(skip)]
    pub(crate) bars: bool,
}

/// The help heading of the timing flags.
const TIMING: &str = "Timing (linear per engine step; fit your own)";

const EXAMPLES: &str = "Examples:
  kvsim                                         the default fleet on a synthetic prefix pool
  kvsim --des-routing round_robin --des-kv-blocks 20000
  kvsim --trace conversation.jsonl --des-instances 8 --des-kv-blocks 900
  kvsim --des-prefill-instances 4 --des-decode-instances 4 --kv-prefill-overlap-weight 20
  kvsim trace-stats conversation.jsonl
  kvsim --sessions 400 --turns 6 --think-ms 3000 --session-affinity soft
  kvsim sweep --param des-overlap-weight=0,0.5,1,2,4 --plot sweep.svg
  kvsim capacity --slo-ttft-ms 2000 --slo-itl-ms 50 --attainment 0.99 --des-num-requests 2000
  kvsim calibrate --steps steps.csv               fit --timing-* to measured step times
  kvsim calibrate --spans traces.otel.jsonl --vllm-log vllm.log   fit them to vLLM's request spans
  kvsim --spans traces.otel.jsonl --vllm-log vllm.log --requests-out sim.jsonl
  kvsim capacity --find instances --request-rate 40 --slo-ttft-ms 2000 --des-num-requests 2000";

/// Each `SimConfig` setting (as the library's errors name it) and the flag that sets it.
pub(crate) const FLAGS: &[(&str, &str)] = &[
    ("request_rate", "--request-rate"),
    ("arrival_model", "--arrival-model"),
    ("arrival_cv", "--arrival-cv"),
    ("num_requests", "--des-num-requests"),
    ("seed", "--seed"),
    ("num_prefixes", "--des-num-prefixes"),
    ("prefix_len", "--des-prefix-len"),
    ("prefix_popularity", "--prefix-popularity"),
    ("input_len", "--input-len"),
    ("output_len", "--output-len"),
    ("block_size", "--des-block-size"),
    ("instances", "--des-instances"),
    ("kv_blocks", "--des-kv-blocks"),
    ("max_batched_tokens", "--max-batched-tokens"),
    ("max_num_seqs", "--max-num-seqs"),
    ("kv_allocation", "--kv-allocation"),
    ("scheduler", "--scheduler"),
    ("timing.base_us", "--timing-base-us"),
    ("timing.prefill_us_per_token", "--timing-prefill-us"),
    ("timing.decode_us_per_request", "--timing-decode-us"),
    ("timing.context_us_per_token", "--timing-context-us"),
    ("timing_kind", "--timing"),
    ("polynomial.kv_capacity_tokens", "--timing-kv-tokens"),
    ("routing", "--des-routing"),
    ("overlap_weight", "--des-overlap-weight"),
    ("prefix_aware_blocks", "--prefix-aware-blocks"),
    ("event_delay_us", "--des-event-delay-ms"),
    ("prefill_instances", "--des-prefill-instances"),
    ("decode_instances", "--des-decode-instances"),
    ("prefill_overlap_weight", "--kv-prefill-overlap-weight"),
    ("decode_overlap_weight", "--kv-decode-overlap-weight"),
    ("pd_transfer_gbps", "--pd-transfer-gbps"),
    ("pd_transfer_latency_us", "--pd-transfer-latency-us"),
    ("pd_link", "--pd-link"),
    ("kv_bytes_per_token", "--kv-bytes-per-token"),
    ("routers", "--des-routers"),
    ("cost_model", "--cost-model"),
    ("router_temperature", "--router-temperature"),
    ("busy_decode_fraction", "--busy-threshold"),
    ("busy_prefill_tokens", "--busy-threshold"),
    ("predicted_ttl_us", "--predicted-ttl-ms"),
    ("host_kv_blocks", "--host-kv-blocks"),
    ("dp_ranks", "--dp-ranks"),
    ("router_sync", "--des-router-sync"),
    ("sync_delay_us", "--des-sync-delay-ms"),
    ("dp_routing", "--dp-routing"),
    ("host_load_gbps", "--host-load-gbps"),
    ("host_hit_credit", "--host-hit-credit"),
    ("trace_speedup", "--trace-speedup"),
    ("trace_timing", "--trace-timing"),
    ("sessions", "--sessions"),
    ("turns", "--turns"),
    ("think_us", "--think-ms"),
    ("concurrency", "--concurrency"),
    ("session_affinity", "--session-affinity"),
    ("session_ttl_us", "--session-ttl-s"),
    ("slo.ttft_ms", "--slo-ttft-ms"),
    ("slo.itl_ms", "--slo-itl-ms"),
    ("slo.e2e_ms", "--slo-e2e-ms"),
];

fn flag_of(setting: &str) -> Option<&'static str> {
    FLAGS.iter().find(|(s, _)| *s == setting).map(|(_, f)| *f)
}

/// A library error as the command reports it: settings named by their flags, one line.
pub(crate) fn flagged(e: &kvsim::Error) -> String {
    match e {
        kvsim::Error::InvalidSetting {
            setting,
            value,
            expected,
        } => {
            // Settings named inside `expected` are field names with an underscore or a dot.
            let expected: String = split_words(expected)
                .into_iter()
                .map(|w| match flag_of(w) {
                    Some(f) if w.contains(['_', '.']) => f,
                    _ => w,
                })
                .collect();
            format!(
                "invalid {} {value}: expected {expected}",
                flag_of(setting).unwrap_or(setting)
            )
        }
        other => other.to_string(),
    }
}

/// Splits text into identifier runs (letters, digits, `_`, `.` inside a word) and the rest,
/// keeping every character.
fn split_words(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut in_word = false;
    for (i, c) in text.char_indices() {
        let w = c.is_alphanumeric() || c == '_' || (c == '.' && in_word);
        if w != in_word && i > start {
            out.push(&text[start..i]);
            start = i;
        }
        in_word = w;
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

/// `SimConfig::default()` as each flag's shown default.
fn defaults() -> Vec<(&'static str, String)> {
    let d = SimConfig::default();
    let t = d.timing;
    vec![
        ("request_rate", d.request_rate.to_string()),
        ("arrival_model", d.arrival_model.to_string()),
        ("arrival_cv", d.arrival_cv.to_string()),
        (
            "des_num_requests",
            format!("{}, or the whole trace", d.num_requests),
        ),
        ("seed", d.seed.to_string()),
        ("des_num_prefixes", d.num_prefixes.to_string()),
        ("des_prefix_len", d.prefix_len.to_string()),
        ("prefix_popularity", d.prefix_popularity.to_string()),
        ("input_len", d.input_len.to_string()),
        ("output_len", d.output_len.to_string()),
        ("turns", d.turns.to_string()),
        ("think_ms", (d.think_us as f64 / 1000.0).to_string()),
        ("session_affinity", d.session_affinity.to_string()),
        ("session_ttl_s", (d.session_ttl_us as f64 / 1e6).to_string()),
        ("trace_speedup", d.trace_speedup.to_string()),
        ("trace_timing", d.trace_timing.to_string()),
        (
            "des_block_size",
            format!("{}, or the trace's block size", d.block_size),
        ),
        ("des_instances", d.instances.to_string()),
        ("max_batched_tokens", d.max_batched_tokens.to_string()),
        ("max_num_seqs", d.max_num_seqs.to_string()),
        ("kv_allocation", d.kv_allocation.to_string()),
        ("scheduler", d.scheduler.to_string()),
        ("timing_base_us", t.base_us.to_string()),
        ("timing_prefill_us", t.prefill_us_per_token.to_string()),
        ("timing_decode_us", t.decode_us_per_request.to_string()),
        ("timing_context_us", t.context_us_per_token.to_string()),
        ("timing", d.timing_kind.to_string()),
        (
            "timing_kv_tokens",
            d.polynomial.kv_capacity_tokens.to_string(),
        ),
        ("des_routing", d.routing.to_string()),
        ("des_overlap_weight", d.overlap_weight.to_string()),
        ("prefix_aware_blocks", d.prefix_aware_blocks.to_string()),
        (
            "des_event_delay_ms",
            (d.event_delay_us as f64 / 1000.0).to_string(),
        ),
        ("des_routers", d.routers.to_string()),
        (
            "des_sync_delay_ms",
            (d.sync_delay_us as f64 / 1000.0).to_string(),
        ),
        ("cost_model", d.cost_model.to_string()),
        ("router_temperature", d.router_temperature.to_string()),
        ("host_load_gbps", d.host_load_gbps.to_string()),
        ("dp_ranks", d.dp_ranks.to_string()),
        ("dp_routing", d.dp_routing.to_string()),
        ("host_hit_credit", d.host_hit_credit.to_string()),
        (
            "predicted_ttl_ms",
            (d.predicted_ttl_us as f64 / 1000.0).to_string(),
        ),
        ("pd_transfer_gbps", d.pd_transfer_gbps.to_string()),
        (
            "pd_transfer_latency_us",
            d.pd_transfer_latency_us.to_string(),
        ),
        ("kv_bytes_per_token", d.kv_bytes_per_token.to_string()),
        ("pd_link", d.pd_link.to_string()),
    ]
}

/// The command with each run flag's help ending in its default from `SimConfig::default()`.
pub(crate) fn command() -> clap::Command {
    let defaults = defaults();
    let add = |a: clap::Arg| match defaults.iter().find(|(id, _)| a.get_id() == *id) {
        Some((_, d)) => {
            let help = a.get_help().map(ToString::to_string).unwrap_or_default();
            a.help(format!("{help} [default: {d}]"))
        }
        None => a,
    };
    Cli::command()
        .mut_args(add)
        .mut_subcommand("sweep", |s| s.mut_args(add))
        .mut_subcommand("capacity", |s| s.mut_args(add))
        .mut_subcommand("calibrate", |s| s.mut_args(add))
}

/// Parses a command line (the first item is the program name).
pub(crate) fn parse_from<I, T>(argv: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = command().try_get_matches_from(argv)?;
    Cli::from_arg_matches(&matches)
}

/// The part of a library parse error after "expected", for clap's message.
fn expected(e: kvsim::Error) -> String {
    match e {
        kvsim::Error::InvalidSetting { expected, .. } => format!("expected {expected}"),
        other => other.to_string(),
    }
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    s.parse::<Policy>().map_err(|e| e.to_string())
}

fn parse_dp_routing(s: &str) -> Result<kvsim::DpRouting, String> {
    s.parse().map_err(expected)
}

fn parse_cost_model(s: &str) -> Result<CostModel, String> {
    s.parse::<CostModel>().map_err(|e| e.to_string())
}

/// `--busy-threshold`: the decode fraction and the prefill budget, either or both.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Busy {
    decode: Option<f64>,
    prefill_tokens: Option<usize>,
}

fn parse_busy(s: &str) -> Result<Busy, String> {
    let mut busy = Busy::default();
    for part in s.split(',') {
        let bad =
            || format!("expected decode=F and/or prefill-tokens=N, comma separated; got {part:?}");
        let (key, value) = part.split_once('=').ok_or_else(bad)?;
        match key.trim() {
            "decode" => {
                let f: f64 = value.trim().parse().map_err(|_| bad())?;
                busy.decode = Some(f);
            }
            "prefill-tokens" => {
                let n: usize = value.trim().parse().map_err(|_| bad())?;
                busy.prefill_tokens = Some(n);
            }
            _ => return Err(bad()),
        }
    }
    Ok(busy)
}

fn parse_session_affinity(s: &str) -> Result<SessionAffinity, String> {
    s.parse::<SessionAffinity>().map_err(|e| e.to_string())
}

fn parse_pd_link(s: &str) -> Result<PdLink, String> {
    s.parse().map_err(expected)
}

fn parse_kv_allocation(s: &str) -> Result<KvAllocation, String> {
    s.parse().map_err(expected)
}

fn parse_scheduler(s: &str) -> Result<kvsim::Scheduler, String> {
    s.parse().map_err(expected)
}

fn parse_timing_kind(s: &str) -> Result<TimingKind, String> {
    s.parse().map_err(expected)
}

impl RunArgs {
    /// The simulation settings: `SimConfig::default()` with every given flag applied; errors
    /// are one line naming the flag (or FILE:LINE for a trace).
    pub(crate) fn config(&self) -> Result<SimConfig, String> {
        let mut cfg = SimConfig::default();
        if let Some(path) = &self.vllm_log {
            let log = VllmLog::load(path).map_err(|e| format!("--vllm-log {e}"))?;
            log.configure(&mut cfg);
        }
        if let Some(path) = &self.spans {
            let reqs = kvsim::load_measured(path).map_err(|e| format!("--spans {e}"))?;
            let bs = match self.des_block_size {
                Some(bs) => BlockSize::new(bs).map_err(|e| format!("--des-block-size: {e}"))?,
                None => cfg.block_size,
            };
            let name = path.display().to_string();
            let shared = self.shared_prefix_tokens.unwrap_or(0);
            cfg = cfg.with_trace(Trace::from_measured(&name, &reqs, shared, bs));
        }
        self.workload
            .load_trace(&mut cfg)
            .map_err(|e| flagged(&e))?;
        if let Some(bs) = self.des_block_size {
            cfg.block_size = BlockSize::new(bs).map_err(|e| format!("--des-block-size: {e}"))?;
        }
        if self.des_instances.is_some()
            && (self.des_prefill_instances.is_some() || self.des_decode_instances.is_some())
        {
            return Err("--des-instances cannot be combined with --des-prefill-instances/--des-decode-instances: \
                        give one fleet size or the two pool sizes"
                .to_string());
        }
        if let Some(delay) = self.des_event_delay_ms {
            if !(delay.is_finite() && delay >= 0.0) {
                return Err(format!(
                    "invalid --des-event-delay-ms {delay}: expected a finite number >= 0"
                ));
            }
            cfg.event_delay_us = (delay * 1000.0).round() as u64;
        }
        fn set<T: Clone>(field: &mut T, flag: &Option<T>) {
            if let Some(v) = flag {
                *field = v.clone();
            }
        }
        if let Some(ms) = self.think_ms {
            if !(ms.is_finite() && (0.0..=1e9).contains(&ms)) {
                return Err(format!(
                    "invalid --think-ms {ms}: expected a number of milliseconds from 0 to 1e9"
                ));
            }
            cfg.think_us = (ms * 1000.0).round() as u64;
        }
        if self.sessions.is_some() {
            cfg.sessions = self.sessions;
        }
        if self.concurrency.is_some() {
            cfg.concurrency = self.concurrency;
        }
        set(&mut cfg.turns, &self.turns);
        set(&mut cfg.session_affinity, &self.session_affinity);
        if let Some(s) = self.session_ttl_s {
            if !(s.is_finite() && (0.0..=1e9).contains(&s)) {
                return Err(format!(
                    "invalid --session-ttl-s {s}: expected a number of seconds from 0 to 1e9"
                ));
            }
            cfg.session_ttl_us = (s * 1e6).round() as u64;
        }
        self.workload.apply_settings(&mut cfg);
        set(&mut cfg.instances, &self.des_instances);
        if self.des_prefill_instances.is_some() {
            cfg.prefill_instances = self.des_prefill_instances;
        }
        if self.des_decode_instances.is_some() {
            cfg.decode_instances = self.des_decode_instances;
        }
        if self.kv_prefill_overlap_weight.is_some() {
            cfg.prefill_overlap_weight = self.kv_prefill_overlap_weight;
        }
        if self.kv_decode_overlap_weight.is_some() {
            cfg.decode_overlap_weight = self.kv_decode_overlap_weight;
        }
        if self.des_kv_blocks.is_some() {
            cfg.kv_blocks = self.des_kv_blocks;
        }
        set(&mut cfg.pd_transfer_gbps, &self.pd_transfer_gbps);
        set(
            &mut cfg.pd_transfer_latency_us,
            &self.pd_transfer_latency_us,
        );
        set(&mut cfg.kv_bytes_per_token, &self.kv_bytes_per_token);
        set(&mut cfg.pd_link, &self.pd_link);
        set(&mut cfg.routers, &self.des_routers);
        set(&mut cfg.cost_model, &self.cost_model);
        set(&mut cfg.router_temperature, &self.router_temperature);
        set(&mut cfg.host_load_gbps, &self.host_load_gbps);
        set(&mut cfg.dp_ranks, &self.dp_ranks);
        if self.des_router_sync {
            cfg.router_sync = true;
        }
        if let Some(ms) = self.des_sync_delay_ms {
            if !(ms.is_finite() && (0.0..=1e9).contains(&ms)) {
                return Err(format!(
                    "invalid --des-sync-delay-ms {ms}: expected a number of milliseconds from 0 to 1e9"
                ));
            }
            cfg.sync_delay_us = (ms * 1000.0).round() as u64;
        }
        set(&mut cfg.dp_routing, &self.dp_routing);
        set(&mut cfg.host_hit_credit, &self.host_hit_credit);
        if self.host_kv_blocks.is_some() {
            cfg.host_kv_blocks = self.host_kv_blocks;
        }
        if let Some(b) = self.busy_threshold {
            cfg.busy_decode_fraction = b.decode;
            cfg.busy_prefill_tokens = b.prefill_tokens;
        }
        if let Some(ms) = self.predicted_ttl_ms {
            if !(ms.is_finite() && (0.0..=1e9).contains(&ms)) {
                return Err(format!(
                    "invalid --predicted-ttl-ms {ms}: expected a number of milliseconds from 0 to 1e9"
                ));
            }
            cfg.predicted_ttl_us = (ms * 1000.0).round() as u64;
        }
        set(&mut cfg.max_batched_tokens, &self.max_batched_tokens);
        set(&mut cfg.max_num_seqs, &self.max_num_seqs);
        set(&mut cfg.kv_allocation, &self.kv_allocation);
        set(&mut cfg.scheduler, &self.scheduler);
        let t = cfg.timing;
        cfg.timing = LinearTiming::new(
            self.timing_base_us.unwrap_or(t.base_us),
            self.timing_prefill_us.unwrap_or(t.prefill_us_per_token),
            self.timing_decode_us.unwrap_or(t.decode_us_per_request),
            self.timing_context_us.unwrap_or(t.context_us_per_token),
        );
        set(&mut cfg.timing_kind, &self.timing);
        set(
            &mut cfg.polynomial.kv_capacity_tokens,
            &self.timing_kv_tokens,
        );
        set(&mut cfg.routing, &self.des_routing);
        set(&mut cfg.overlap_weight, &self.des_overlap_weight);
        set(&mut cfg.prefix_aware_blocks, &self.prefix_aware_blocks);
        cfg.slo = Slo::new(self.slo_ttft_ms, self.slo_itl_ms, self.slo_e2e_ms);
        cfg.validate().map_err(|e| flagged(&e))?;
        Ok(cfg)
    }

    pub(crate) fn requests_out(&self) -> Option<&std::path::Path> {
        self.requests_out.as_deref()
    }

    pub(crate) fn json(&self) -> bool {
        self.format == "json"
    }

    pub(crate) fn verbose(&self) -> bool {
        self.verbose
    }

    /// Whether to draw progress: the caller draws bars, stderr is a terminal and --quiet is
    /// not set.
    pub(crate) fn progress(&self) -> bool {
        self.bars && !self.quiet && std::io::stderr().is_terminal()
    }
}

/// One line for a usage error: clap's first line, without its "error: " prefix.
pub(crate) fn one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().unwrap_or("invalid arguments");
    let first = first.trim_start_matches("error: ").trim();
    // "the following required arguments were not provided:" names them on the next line.
    match lines.next() {
        Some(next) if first.ends_with(':') => format!("{first} {}", next.trim()),
        _ => first.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One source of defaults: no flag at all is exactly the library's default configuration.
    #[test]
    fn no_flags_is_the_library_default() {
        let cli = parse_from(["kvsim"]).unwrap();
        assert_eq!(cli.run.config().unwrap(), SimConfig::default());
        let sweep = parse_from(["kvsim", "sweep", "--param", "seed=1"]).unwrap();
        let Some(Cmd::Sweep(s)) = sweep.cmd else {
            panic!("not a sweep")
        };
        assert_eq!(s.batch.run.config().unwrap(), SimConfig::default());
    }

    /// Every setting the library can name maps to a flag the command has, and every run flag
    /// that is a setting shows the library's default.
    #[test]
    fn settings_map_to_existing_flags_and_show_defaults() {
        let cmd = command();
        let longs: Vec<String> = cmd
            .get_arguments()
            .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
            .collect();
        for (setting, flag) in FLAGS {
            assert!(longs.iter().any(|l| l == flag), "{setting}: no flag {flag}");
        }
        let help = cmd.clone().render_help().to_string();
        for needle in [
            "[default: 6]",
            "[default: poisson]",
            "[default: 7050]",
            "[default: 0.04]",
            "[default: kv]",
            "[default: 16, or the trace's block size]",
        ] {
            assert!(help.contains(needle), "--help lacks {needle}:\n{help}");
        }
    }

    #[test]
    fn library_errors_name_flags() {
        let e = kvsim::Error::InvalidSetting {
            setting: "decode_instances",
            value: "unset".into(),
            expected: "both prefill_instances and decode_instances, or neither".into(),
        };
        assert_eq!(
            flagged(&e),
            "invalid --des-decode-instances unset: expected both --des-prefill-instances and --des-decode-instances, or neither"
        );
        let e = kvsim::Error::InvalidSetting {
            setting: "prefix_len",
            value: "9000".into(),
            expected: "at most input_len (4096): the prefix is part of the prompt".into(),
        };
        assert_eq!(
            flagged(&e),
            "invalid --des-prefix-len 9000: expected at most --input-len (4096): the prefix is part of the prompt"
        );
    }
}
