//! Simulation settings, their defaults and their validation.

use std::fmt;
use std::str::FromStr;

use std::sync::Arc;

use kvblock::BlockSize;
use kvroute::{CostModel, Policy, SessionAffinity};

use crate::engine::{KvAllocation, Scheduler};
use crate::error::Error;
use crate::slo::Slo;
use crate::timing::{LinearTiming, PolynomialTiming, TimingKind};
use crate::trace::{Trace, MAX_TOKENS};
/// Engines per pool above this are refused.
const MAX_ENGINES: usize = 1 << 16;

/// How request arrival times are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ArrivalModel {
    /// Exponential inter-arrival times (a Poisson process).
    #[default]
    Poisson,
    /// Evenly spaced arrivals.
    Constant,
    /// Gamma inter-arrival times with coefficient of variation `arrival_cv` (1 is Poisson,
    /// above 1 is burstier).
    Gamma,
}

impl ArrivalModel {
    /// Every model, as the CLI spells them.
    pub const ALL: [ArrivalModel; 3] = [
        ArrivalModel::Poisson,
        ArrivalModel::Constant,
        ArrivalModel::Gamma,
    ];

    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            ArrivalModel::Poisson => "poisson",
            ArrivalModel::Constant => "constant",
            ArrivalModel::Gamma => "gamma",
        }
    }
}

impl fmt::Display for ArrivalModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ArrivalModel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        ArrivalModel::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| Error::invalid("arrival_model", s, "one of poisson, constant, gamma"))
    }
}

/// How often each prefix of the pool is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub enum Popularity {
    /// Every prefix equally often.
    #[default]
    Uniform,
    /// Zipf with exponent `s` over the pool: a few hot prefixes.
    Zipf(f64),
}

impl fmt::Display for Popularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Popularity::Uniform => f.write_str("uniform"),
            Popularity::Zipf(s) => write!(f, "zipf:{s}"),
        }
    }
}

impl FromStr for Popularity {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        const EXPECTED: &str = "uniform or zipf:<s> with s a finite number > 0";
        if s == "uniform" {
            return Ok(Popularity::Uniform);
        }
        match s.strip_prefix("zipf:").map(str::parse::<f64>) {
            Some(Ok(x)) if x.is_finite() && x > 0.0 => Ok(Popularity::Zipf(x)),
            _ => Err(Error::invalid("prefix_popularity", s, EXPECTED)),
        }
    }
}

/// How concurrent prefill-to-decode KV transfers use bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PdLink {
    /// Every transfer gets the whole `pd_transfer_gbps`, however many run at once.
    #[default]
    PerTransfer,
    /// The transfers leaving one prefill engine share its `pd_transfer_gbps` equally (each of
    /// `k` concurrent ones gets `1/k`, recomputed whenever one starts or ends); the fixed
    /// latency follows each transfer's last bit.
    Shared,
}

impl fmt::Display for PdLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PdLink::PerTransfer => "per-transfer",
            PdLink::Shared => "shared",
        })
    }
}

impl FromStr for PdLink {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "per-transfer" => Ok(PdLink::PerTransfer),
            "shared" => Ok(PdLink::Shared),
            _ => Err(Error::invalid("pd_link", s, "per-transfer or shared")),
        }
    }
}

/// What the routers see of data-parallel engines (`--dp-routing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DpRouting {
    /// Each rank is a worker of its own: the router picks the engine and the rank, and mirrors
    /// each rank's cache from its own events.
    #[default]
    Rank,
    /// The router picks an engine, which hands requests to its ranks in turn, and mirrors the
    /// engine as one cache from all its ranks' events (a router that ignores
    /// `data_parallel_rank`).
    Engine,
}

impl fmt::Display for DpRouting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DpRouting::Rank => "rank",
            DpRouting::Engine => "engine",
        })
    }
}

impl FromStr for DpRouting {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "rank" => Ok(DpRouting::Rank),
            "engine" => Ok(DpRouting::Engine),
            _ => Err(Error::invalid("dp_routing", s, "rank or engine")),
        }
    }
}

/// How a trace's requests are timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TraceTiming {
    /// The trace's own timestamps (divided by the speed-up).
    #[default]
    Keep,
    /// New arrival times from the arrival model and rate, in the trace's order.
    Rate,
}

impl fmt::Display for TraceTiming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TraceTiming::Keep => "keep",
            TraceTiming::Rate => "rate",
        })
    }
}

impl FromStr for TraceTiming {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "keep" => Ok(TraceTiming::Keep),
            "rate" => Ok(TraceTiming::Rate),
            _ => Err(Error::invalid("trace_timing", s, "keep or rate")),
        }
    }
}

/// Everything a simulation run needs. Start from [`SimConfig::default`] and change fields;
/// [`validate`](Self::validate) (called by [`crate::Simulation::new`]) checks them.
///
/// The defaults are the source document's example fleet (4 instances, `kv` routing, 8 prefixes
/// of 2,048 tokens, 200 Poisson requests at 6/s) at block size 16 with 4,096-token prompts and
/// 256-token outputs on an 8B-class model.
///
/// ```
/// let mut cfg = kvsim::SimConfig::default();
/// cfg.instances = 0;
/// assert_eq!(cfg.validate().unwrap_err().to_string(), "invalid instances 0: expected a whole number >= 1");
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SimConfig {
    /// Requests per second (`--request-rate`).
    pub request_rate: f64,
    /// Arrival process (`--arrival-model`).
    pub arrival_model: ArrivalModel,
    /// Coefficient of variation of gamma inter-arrival times (`--arrival-cv`).
    pub arrival_cv: f64,
    /// Requests to simulate (`--des-num-requests`).
    pub num_requests: usize,
    /// Seed of every random choice (`--seed`).
    pub seed: u64,
    /// Prefixes in the synthetic pool (`--des-num-prefixes`).
    pub num_prefixes: usize,
    /// Tokens per prefix (`--des-prefix-len`).
    pub prefix_len: usize,
    /// Prefix popularity (`--prefix-popularity`).
    pub prefix_popularity: Popularity,
    /// Prompt tokens per request, prefix included; the unique suffix fills the rest
    /// (`--input-len`).
    pub input_len: usize,
    /// Output tokens per request (`--output-len`).
    pub output_len: usize,
    /// Tokens per KV block, for engines and router alike (`--des-block-size`).
    pub block_size: BlockSize,
    /// Engine replicas (`--des-instances`).
    pub instances: usize,
    /// KV blocks per engine, cache and running requests together; `None` is unbounded
    /// (`--des-kv-blocks`).
    pub kv_blocks: Option<usize>,
    /// Token budget of one engine step, prefill chunks plus one token per decoding request
    /// (`--max-batched-tokens`).
    pub max_batched_tokens: usize,
    /// Running requests per engine (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Reserve each request's blocks at admission, or allocate them as it decodes and preempt
    /// the newest request when none is free (`--kv-allocation`).
    pub kv_allocation: KvAllocation,
    /// How engines schedule a step (`--scheduler`): kvsim's own rules, or vLLM V1's (which
    /// allocate blocks incrementally whatever `kv_allocation` says).
    pub scheduler: Scheduler,
    /// The default timing model's coefficients (`--timing-*`).
    pub timing: LinearTiming,
    /// Which timing model the engines use (`--timing`): `timing` or `polynomial`.
    pub timing_kind: TimingKind,
    /// The polynomial model's settings, used when `timing_kind` is `Polynomial`; its KV
    /// capacity is replaced by `kv_blocks` times the block size when `kv_blocks` is set
    /// (`--timing-kv-tokens`).
    pub polynomial: PolynomialTiming,
    /// Routing policy (`--des-routing`).
    pub routing: Policy,
    /// The `kv` policy's overlap weight (`--des-overlap-weight`).
    pub overlap_weight: f64,
    /// The `prefix_aware` policy's key: the first K blocks (`--prefix-aware-blocks`).
    pub prefix_aware_blocks: usize,
    /// Delay before the router sees an engine's KV events, in microseconds
    /// (`--des-event-delay-ms` × 1000).
    pub event_delay_us: u64,
    /// Disaggregated serving: prefill engines (`--des-prefill-instances`); set together with
    /// `decode_instances`, and `instances` is then unused.
    pub prefill_instances: Option<usize>,
    /// Disaggregated serving: decode engines (`--des-decode-instances`).
    pub decode_instances: Option<usize>,
    /// Overlap weight for routing prefills, overriding `overlap_weight`
    /// (`--kv-prefill-overlap-weight`; typically 20).
    pub prefill_overlap_weight: Option<f64>,
    /// Overlap weight for routing decodes, overriding `overlap_weight`
    /// (`--kv-decode-overlap-weight`; typically 2).
    pub decode_overlap_weight: Option<f64>,
    /// Prefill-to-decode link bandwidth, gigabits per second (`--pd-transfer-gbps`).
    pub pd_transfer_gbps: f64,
    /// Fixed latency of a prefill-to-decode transfer, microseconds (`--pd-transfer-latency-us`).
    pub pd_transfer_latency_us: u64,
    /// Whether concurrent transfers from one prefill engine share its link (`--pd-link`).
    pub pd_link: PdLink,
    /// KV cache bytes per token (`--kv-bytes-per-token`; 131,072 is an 8B model with
    /// grouped-query attention in 16-bit: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes).
    pub kv_bytes_per_token: u64,
    /// Independent router replicas per pool, each with its own load view and cache index,
    /// receiving arrivals in turn (`--des-routers`).
    pub routers: usize,
    /// The cost the `kv` policy minimises (`--cost-model`).
    pub cost_model: CostModel,
    /// `kv` policy: 0 takes the lowest cost, above 0 samples by it (`--router-temperature`).
    pub router_temperature: f64,
    /// `kv` policy: a worker whose decode blocks exceed this fraction of `kv_blocks` is busy
    /// (`--busy-threshold decode=F`).
    pub busy_decode_fraction: Option<f64>,
    /// `kv` policy: a worker whose pending prefill exceeds this many tokens is busy
    /// (`--busy-threshold prefill-tokens=N`).
    pub busy_prefill_tokens: Option<usize>,
    /// How long a routed request's blocks count as hits on its engine before the engine's
    /// events confirm them, microseconds; 0 is off (`--predicted-ttl-ms` × 1000).
    pub predicted_ttl_us: u64,
    /// Blocks of each engine's host tier, which the device's evictions are demoted to and
    /// requests load back from instead of recomputing (`--host-kv-blocks`; `None` or
    /// `Some(0)`: no host tier).
    pub host_kv_blocks: Option<usize>,
    /// Host-to-device bandwidth for loading host-tier blocks, gigabytes per second
    /// (`--host-load-gbps`); with `kv_bytes_per_token` it gives each block's load time.
    pub host_load_gbps: f64,
    /// What the routers credit a host-tier hit against a device hit, 0 to 1
    /// (`--host-hit-credit`; 0: the routers ignore the host tier).
    pub host_hit_credit: f64,
    /// Router replicas share their in-flight load: each route and finish reaches the other
    /// replicas of its pool as a load delta after `sync_delay_us` (`--des-router-sync`).
    pub router_sync: bool,
    /// Delay of a load delta between router replicas, microseconds (`--des-sync-delay-ms` ×
    /// 1000).
    pub sync_delay_us: u64,
    /// Data-parallel ranks per instance, each with its own KV cache of `kv_blocks` and its own
    /// batch (`--dp-ranks`; unified pools only).
    pub dp_ranks: usize,
    /// What the routers see of the ranks (`--dp-routing`).
    pub dp_routing: DpRouting,
    /// Replay this trace instead of the synthetic prefix pool (`--trace`): its first
    /// `num_requests` requests. See [`SimConfig::with_trace`].
    pub trace: Option<Arc<Trace>>,
    /// Divide the trace's inter-arrival times by this (`--trace-speedup`).
    pub trace_speedup: f64,
    /// Keep the trace's timestamps or re-time arrivals (`--trace-timing`).
    pub trace_timing: TraceTiming,
    /// Synthetic multi-turn conversations (`--sessions`): this many sessions of `turns` turns
    /// replace the single-turn requests (`num_requests` is then unused). A session starts at
    /// an arrival of the arrival model (at `request_rate` sessions per second) with a prefix
    /// of the pool and `input_len - prefix_len` new tokens; each later turn is sent
    /// `think_us` after the previous one finished, its prompt the previous prompt, its answer
    /// (`output_len` tokens) and `input_len - prefix_len` new tokens, so prefixes grow as in
    /// a chat.
    pub sessions: Option<usize>,
    /// Turns per synthetic session (`--turns`).
    pub turns: usize,
    /// Think time between a synthetic turn's end and the next turn, µs (`--think-ms` × 1000).
    pub think_us: u64,
    /// Closed loop at a fixed concurrency (`--concurrency`): this many requests in flight,
    /// a new one sent as soon as one finishes (or is rejected), arrival times and trace
    /// timestamps ignored; sessions keep their turn order and think times.
    pub concurrency: Option<usize>,
    /// How the routers keep a session's turns together (`--session-affinity`): with `Soft` or
    /// `Hard`, every turn of a synthetic session or of a trace's `session_id` is routed with
    /// [`kvroute::Router::route_in_session`]. `Off` by default, unlike kvrouter's `soft`, so
    /// that a run without the flag routes exactly as before it existed. Simulated engines
    /// never go down, so `Hard` differs from `Soft` only in never moving a session off a busy
    /// engine (`--busy-threshold`).
    pub session_affinity: SessionAffinity,
    /// How long a router remembers a session after its last turn, µs of simulated time
    /// (`--session-ttl-s` × 1,000,000; 0 remembers none).
    pub session_ttl_us: u64,
    /// Latency targets; when any is set the report adds their attainment and the goodput
    /// (`--slo-ttft-ms`, `--slo-itl-ms`, `--slo-e2e-ms`).
    pub slo: Slo,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            request_rate: 6.0,
            arrival_model: ArrivalModel::Poisson,
            arrival_cv: 1.0,
            num_requests: 200,
            seed: 0,
            num_prefixes: 8,
            prefix_len: 2048,
            prefix_popularity: Popularity::Uniform,
            input_len: 4096,
            output_len: 256,
            block_size: BlockSize::default(),
            instances: 4,
            kv_blocks: None,
            max_batched_tokens: 8192,
            max_num_seqs: 256,
            kv_allocation: KvAllocation::Reserve,
            scheduler: Scheduler::Kvsim,
            timing: LinearTiming::default(),
            timing_kind: TimingKind::Linear,
            polynomial: PolynomialTiming::default(),
            routing: Policy::Kv,
            overlap_weight: 1.0,
            prefix_aware_blocks: 1,
            event_delay_us: 0,
            prefill_instances: None,
            decode_instances: None,
            prefill_overlap_weight: None,
            decode_overlap_weight: None,
            pd_transfer_gbps: 400.0,
            pd_transfer_latency_us: 100,
            pd_link: PdLink::PerTransfer,
            kv_bytes_per_token: 131_072,
            routers: 1,
            cost_model: CostModel::Seed,
            router_temperature: 0.0,
            busy_decode_fraction: None,
            busy_prefill_tokens: None,
            predicted_ttl_us: 0,
            host_kv_blocks: None,
            host_load_gbps: 25.0,
            host_hit_credit: 0.75,
            router_sync: false,
            sync_delay_us: 0,
            dp_ranks: 1,
            dp_routing: DpRouting::Rank,
            trace: None,
            trace_speedup: 1.0,
            trace_timing: TraceTiming::Keep,
            slo: Slo::default(),
            sessions: None,
            turns: 1,
            think_us: 0,
            concurrency: None,
            session_affinity: SessionAffinity::Off,
            session_ttl_us: 600_000_000,
        }
    }
}

impl SimConfig {
    /// Replays all of `trace`, at its block size.
    ///
    /// ```
    /// use kvblock::BlockSize;
    /// let text = r#"{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [7, 8, 9]}"#;
    /// let trace = kvsim::Trace::parse("t.jsonl", text, BlockSize::new(16)?)?;
    /// let report = kvsim::Simulation::new(kvsim::SimConfig::default().with_trace(trace))?.run()?;
    /// assert_eq!(report.content, "trace: t.jsonl (1 requests)");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn with_trace(mut self, trace: Trace) -> Self {
        self.block_size = trace.block_size();
        self.num_requests = trace.requests().len();
        self.trace = Some(Arc::new(trace));
        self
    }

    /// The routers' busy threshold, when one is set.
    pub(crate) fn busy_threshold(&self) -> Option<kvroute::BusyThreshold> {
        if self.busy_decode_fraction.is_none() && self.busy_prefill_tokens.is_none() {
            return None;
        }
        let mut t = kvroute::BusyThreshold::new();
        if let (Some(f), Some(cap)) = (self.busy_decode_fraction, self.kv_blocks) {
            // A router worker is a rank, or a whole engine of `dp_ranks` ranks.
            let ranks = match self.dp_routing {
                DpRouting::Engine => self.dp_ranks,
                _ => 1,
            };
            t = t.decode_fraction(f, cap.saturating_mul(ranks));
        }
        if let Some(tokens) = self.busy_prefill_tokens {
            t = t.prefill_tokens(tokens);
        }
        Some(t)
    }

    /// Whether the routers need each request's first token ([`kvroute::Router::prefill_done`]):
    /// only the prefill-aware cost and the busy threshold look at it.
    pub(crate) fn tracks_prefill(&self) -> bool {
        self.cost_model != CostModel::Seed || self.busy_threshold().is_some()
    }

    /// Nanoseconds to load one block from the host tier: its bytes over `host_load_gbps`.
    pub(crate) fn host_load_ns_per_block(&self) -> u64 {
        let bytes = self.block_size.get() as f64 * self.kv_bytes_per_token as f64;
        (bytes / self.host_load_gbps).round() as u64
    }

    /// The polynomial model as the engines use it: its KV capacity is the engines' when bounded.
    pub fn polynomial_timing(&self) -> PolynomialTiming {
        let mut p = self.polynomial;
        if let Some(k) = self.kv_blocks {
            p.kv_capacity_tokens = (k as u64).saturating_mul(self.block_size.get() as u64);
        }
        p
    }

    /// Whether requests are sent in a closed loop (sessions, a trace with `session_id`s, or a
    /// fixed concurrency) rather than at their arrival times.
    pub fn closed_loop(&self) -> bool {
        self.has_sessions() || self.concurrency.is_some()
    }

    /// Whether the run has sessions: synthetic ones, or a trace with `session_id`s.
    pub fn has_sessions(&self) -> bool {
        self.sessions.is_some() || self.trace.as_ref().is_some_and(|t| t.has_sessions())
    }

    /// Whether the routers route sessions' turns to their session's engine.
    pub(crate) fn session_routing(&self) -> bool {
        self.session_affinity != SessionAffinity::Off
    }

    /// Whether prefill and decode run on separate pools.
    pub fn disaggregated(&self) -> bool {
        self.prefill_instances.is_some() || self.decode_instances.is_some()
    }

    /// Engines in all, each data-parallel rank one: `instances × dp_ranks`, or prefill plus
    /// decode engines.
    pub fn engine_count(&self) -> usize {
        if self.disaggregated() {
            self.prefill_instances.unwrap_or(0) + self.decode_instances.unwrap_or(0)
        } else {
            self.instances.saturating_mul(self.dp_ranks)
        }
    }

    /// Requests a run simulates: `num_requests`, or fewer when the trace is shorter, or
    /// sessions times turns.
    pub fn request_count(&self) -> usize {
        if let Some(n) = self.sessions {
            return n.saturating_mul(self.turns);
        }
        match &self.trace {
            Some(t) => self.num_requests.min(t.requests().len()),
            None => self.num_requests,
        }
    }

    /// Checks every setting; the error names the setting (its field), the value and what is
    /// accepted.
    pub fn validate(&self) -> Result<(), Error> {
        let positive = |flag, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::invalid(flag, v, "a finite number > 0"))
            }
        };
        let non_negative = |flag, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(Error::invalid(flag, v, "a finite number >= 0"))
            }
        };
        let at_least_one = |flag, v: usize| {
            if v >= 1 {
                Ok(())
            } else {
                Err(Error::invalid(flag, v, "a whole number >= 1"))
            }
        };
        // Bounds keep arithmetic finite and memory sane; they are far beyond any real fleet.
        let within = |flag, v: f64, lo: f64, hi: f64, expected: &'static str| {
            if v.is_finite() && (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(Error::invalid(flag, v, expected))
            }
        };
        let at_most = |flag, v: usize, hi: usize| {
            if v <= hi {
                Ok(())
            } else {
                Err(Error::invalid(flag, v, format!("at most {hi}")))
            }
        };
        within(
            "request_rate",
            self.request_rate,
            1e-6,
            1e9,
            "a number from 0.000001 to 1e9 (requests/s)",
        )?;
        within(
            "arrival_cv",
            self.arrival_cv,
            1e-3,
            1e3,
            "a number from 0.001 to 1000",
        )?;
        at_most("input_len", self.input_len, MAX_TOKENS)?;
        at_most("output_len", self.output_len, MAX_TOKENS)?;
        at_most("prefix_len", self.prefix_len, MAX_TOKENS)?;
        at_most("num_prefixes", self.num_prefixes, 1 << 20)?;
        at_most("instances", self.instances, MAX_ENGINES)?;
        at_most(
            "prefill_instances",
            self.prefill_instances.unwrap_or(0),
            MAX_ENGINES,
        )?;
        at_most(
            "decode_instances",
            self.decode_instances.unwrap_or(0),
            MAX_ENGINES,
        )?;
        at_most("routers", self.routers, 1024)?;
        at_least_one("num_requests", self.num_requests)?;
        at_least_one("num_prefixes", self.num_prefixes)?;
        at_least_one("input_len", self.input_len)?;
        if self.trace.is_none() && self.prefix_len > self.input_len {
            return Err(Error::invalid(
                "prefix_len",
                self.prefix_len,
                format!(
                    "at most input_len ({}): the prefix is part of the prompt",
                    self.input_len
                ),
            ));
        }
        at_least_one("output_len", self.output_len)?;
        at_least_one("instances", self.instances)?;
        at_least_one("dp_ranks", self.dp_ranks)?;
        at_most("dp_ranks", self.dp_ranks, 64)?;
        if self.engine_count() > MAX_ENGINES {
            return Err(Error::invalid(
                "dp_ranks",
                self.dp_ranks,
                format!(
                    "instances x dp_ranks at most {MAX_ENGINES} (got {})",
                    self.engine_count()
                ),
            ));
        }
        if self.dp_ranks > 1 && self.disaggregated() {
            return Err(Error::invalid(
                "dp_ranks",
                self.dp_ranks,
                "1 with prefill_instances and decode_instances (data-parallel ranks are simulated in unified pools)",
            ));
        }
        if let Some(k) = self.kv_blocks {
            at_least_one("kv_blocks", k)?;
        }
        at_least_one("max_batched_tokens", self.max_batched_tokens)?;
        at_least_one("max_num_seqs", self.max_num_seqs)?;
        if self.max_num_seqs >= self.max_batched_tokens {
            return Err(Error::invalid(
                "max_num_seqs",
                self.max_num_seqs,
                "fewer than max_batched_tokens (each decoding request takes a token of the budget)",
            ));
        }
        if let Popularity::Zipf(s) = self.prefix_popularity {
            positive("prefix_popularity", s)?;
        }
        non_negative("overlap_weight", self.overlap_weight)?;
        positive("trace_speedup", self.trace_speedup)?;
        at_least_one("routers", self.routers)?;
        at_least_one("prefix_aware_blocks", self.prefix_aware_blocks)?;
        if self.disaggregated() {
            let (Some(p), Some(d)) = (self.prefill_instances, self.decode_instances) else {
                let (flag, v) = if self.prefill_instances.is_some() {
                    ("decode_instances", "unset")
                } else {
                    ("prefill_instances", "unset")
                };
                return Err(Error::invalid(
                    flag,
                    v,
                    "both prefill_instances and decode_instances, or neither",
                ));
            };
            at_least_one("prefill_instances", p)?;
            at_least_one("decode_instances", d)?;
        }
        if let Some(w) = self.prefill_overlap_weight {
            non_negative("prefill_overlap_weight", w)?;
        }
        if let Some(w) = self.decode_overlap_weight {
            non_negative("decode_overlap_weight", w)?;
        }
        positive("pd_transfer_gbps", self.pd_transfer_gbps)?;
        within(
            "router_temperature",
            self.router_temperature,
            0.0,
            1e6,
            "a number from 0 to 1000000",
        )?;
        positive("host_load_gbps", self.host_load_gbps)?;
        within(
            "host_hit_credit",
            self.host_hit_credit,
            0.0,
            1.0,
            "a number from 0 to 1",
        )?;
        if let Some(f) = self.busy_decode_fraction {
            positive("busy_decode_fraction", f)?;
            if self.kv_blocks.is_none() {
                return Err(Error::invalid(
                    "busy_decode_fraction",
                    f,
                    "kv_blocks to be set (the fraction is of an engine's capacity)",
                ));
            }
        }
        if let Some(t) = &self.trace {
            if t.block_size() != self.block_size {
                return Err(Error::invalid(
                    "block_size",
                    self.block_size,
                    format!(
                        "the trace's block size {} (its ids name {}-token blocks and cannot be re-blocked)",
                        t.block_size(),
                        t.block_size()
                    ),
                ));
            }
        }
        self.timing.validate()?;
        self.polynomial.validate()?;
        self.slo.validate()?;
        if let Some(n) = self.sessions {
            at_least_one("sessions", n)?;
            at_most("sessions", n, 1 << 20)?;
            if self.trace.is_some() {
                return Err(Error::invalid(
                    "sessions",
                    n,
                    "no trace: a trace brings its own sessions (session_id)",
                ));
            }
        } else if self.turns != 1 || self.think_us != 0 {
            let (setting, v) = if self.turns != 1 {
                ("turns", self.turns.to_string())
            } else {
                ("think_us", self.think_us.to_string())
            };
            return Err(Error::invalid(
                setting,
                v,
                "sessions set (they describe synthetic sessions)",
            ));
        }
        at_least_one("turns", self.turns)?;
        at_most("turns", self.turns, 4096)?;
        if self.sessions.is_some() {
            let grow = self.output_len + self.input_len.saturating_sub(self.prefix_len);
            let last = self.input_len + (self.turns - 1).saturating_mul(grow);
            if last > MAX_TOKENS {
                return Err(Error::invalid(
                    "turns",
                    self.turns,
                    format!(
                        "few enough that the last prompt ({last} tokens) stays within {MAX_TOKENS}"
                    ),
                ));
            }
        }
        if let Some(n) = self.concurrency {
            at_least_one("concurrency", n)?;
        }
        if self.session_routing() && !self.has_sessions() {
            return Err(Error::invalid(
                "session_affinity",
                self.session_affinity,
                "off without sessions (sessions set, or a trace with session_id): no request has a session to keep",
            ));
        }
        Ok(())
    }
}
