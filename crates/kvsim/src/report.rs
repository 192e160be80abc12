//! What a run measured, as text and as a stable JSON document.

use std::fmt::Write as _;

use serde::Serialize;

use kvroute::Policy;

use crate::config::SimConfig;
use crate::engine::KvAllocation;
use crate::engine::Pool;
use crate::records::{Records, RequestRecord, SessionCounts};
use crate::slo::SloReport;
use crate::stats::{ratio, Summary};

/// Load balance (max over mean requests per instance) above which the report warns of
/// hot-spotting.
pub const HOT_SPOT_THRESHOLD: f64 = 1.5;

fn policy_name<S: serde::Serializer>(p: &Policy, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.name())
}

/// One instance's share of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct InstanceReport {
    /// The instance's index (its router worker id).
    pub instance: usize,
    /// `unified`, `prefill` or `decode`.
    pub pool: Pool,
    /// Requests routed to it.
    pub requests: usize,
    /// Of those, completed.
    pub completed: usize,
    /// Share of its scheduled requests with at least one cached block.
    pub hit_rate: f64,
    /// Cached prompt blocks over all full prompt blocks of its scheduled requests.
    pub block_reuse: f64,
    /// Blocks its cache evicted.
    pub evictions: u64,
    /// Blocks resident at the end.
    pub resident_blocks: usize,
    /// Share of the makespan it spent computing.
    pub busy_fraction: f64,
}

/// One pool of a disaggregated fleet.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PoolReport {
    /// Engines in the pool.
    pub instances: usize,
    /// The overlap weight its router used.
    pub overlap_weight: f64,
    /// Share of its requests with at least one cached block (on a decode engine: a block that
    /// did not have to be transferred).
    pub request_hit_rate: f64,
    /// Cached prompt blocks over all full prompt blocks of its requests.
    pub block_reuse: f64,
    /// Lowest instance request hit rate.
    pub per_instance_hit_rate_min: f64,
    /// Highest instance request hit rate.
    pub per_instance_hit_rate_max: f64,
    /// Max over mean requests per instance.
    pub load_balance: f64,
    /// Blocks evicted in the pool.
    pub evictions: u64,
}

/// The prefill/decode split of a disaggregated run.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PdReport {
    /// The prefill pool.
    pub prefill: PoolReport,
    /// The decode pool.
    pub decode: PoolReport,
    /// Arrival to prefill scheduling (ms).
    pub prefill_queue_ms: Summary,
    /// KV transfer from prefill to decode engine (ms).
    pub transfer_ms: Summary,
}

/// Hits per tier, when engines have a host tier (`--host-kv-blocks`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct TierReport {
    /// Host-tier blocks per instance.
    pub host_capacity_per_instance: usize,
    /// Prompt blocks hit on the device (the headline `block_reuse`'s numerator).
    pub device_hit_blocks: usize,
    /// Prompt blocks loaded from the host tier instead of recomputed.
    pub host_hit_blocks: usize,
    /// Host-tier hits over all full prompt blocks.
    pub host_block_reuse: f64,
    /// What the routers credited a host hit against a device hit.
    pub host_hit_credit: f64,
}

/// Cache hits of the requests of some turns of their sessions (completed requests).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct TurnReport {
    /// Completed requests.
    pub requests: usize,
    /// Share of them with at least one cached block.
    pub request_hit_rate: f64,
    /// Cached prompt blocks over all their full prompt blocks.
    pub block_reuse: f64,
    /// Mean cached prompt tokens per request.
    pub avg_cached_tokens: f64,
}

/// Cache hits by turn of a multi-turn run: the first turns against the later ones, whose
/// prompts extend a previous turn's.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct TurnsReport {
    /// First turns.
    pub first: TurnReport,
    /// Every later turn.
    pub later: TurnReport,
    /// Turn 1, 2, ... in order.
    pub by_turn: Vec<TurnReport>,
}

impl TurnsReport {
    fn build(done: &[&RequestRecord], bs: usize) -> Self {
        let of = |keep: &dyn Fn(u32) -> bool| {
            let mine: Vec<&&RequestRecord> = done.iter().filter(|r| keep(r.turn)).collect();
            let cached: usize = mine.iter().map(|r| r.hits).sum();
            let prompt: usize = mine.iter().map(|r| r.prompt_blocks).sum();
            TurnReport {
                requests: mine.len(),
                request_hit_rate: ratio(
                    mine.iter().filter(|r| r.hits > 0).count() as f64,
                    mine.len() as f64,
                ),
                block_reuse: ratio(cached as f64, prompt as f64),
                avg_cached_tokens: ratio((cached * bs) as f64, mine.len() as f64),
            }
        };
        let last = done.iter().map(|r| r.turn).max().unwrap_or(1);
        TurnsReport {
            first: of(&|t| t == 1),
            later: of(&|t| t > 1),
            by_turn: (1..=last).map(|k| of(&|t| t == k)).collect(),
        }
    }

    fn to_text(&self) -> String {
        let part = |name: &str, t: &TurnReport| {
            format!(
                "{name} hit rate {:.1}%, block-reuse {:.1}% ({} requests)",
                t.request_hit_rate * 100.0,
                t.block_reuse * 100.0,
                t.requests
            )
        };
        format!(
            "  Per turn: {} | {}\n",
            part("turn 1", &self.first),
            part("later turns", &self.later)
        )
    }
}

/// How the routers kept sessions together (with session affinity on): where each later turn
/// of a session went, against the engine its router knew for the session. Counted when the
/// turn was routed, so rejected requests count too.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SessionsReport {
    /// `soft` or `hard`.
    pub affinity: String,
    /// How long a router remembers a session after its last turn (s).
    pub ttl_s: f64,
    /// Later turns (turn 2 on) routed.
    pub later_turns: usize,
    /// Of those, routed to the engine of their session.
    pub kept: usize,
    /// Routed elsewhere: the session's engine was busy (soft affinity), and the session moved.
    pub moved: usize,
    /// Routed as new sessions: their router knew no engine for the session (its TTL lapsed, or
    /// another router replica routed the previous turn and did not share it).
    pub new: usize,
}

impl SessionsReport {
    fn build(cfg: &SimConfig, c: SessionCounts) -> Self {
        SessionsReport {
            affinity: cfg.session_affinity.to_string(),
            ttl_s: cfg.session_ttl_us as f64 / 1e6,
            later_turns: c.kept + c.moved + c.new,
            kept: c.kept,
            moved: c.moved,
            new: c.new,
        }
    }

    fn to_text(&self) -> String {
        let share = |n: usize| 100.0 * ratio(n as f64, self.later_turns as f64);
        format!(
            "  Sessions: {} affinity, TTL {} s | later turns: {} kept on their session's instance ({:.1}%), \
             {} moved (busy), {} new (TTL lapsed or unknown to the router)\n",
            self.affinity,
            self.ttl_s,
            self.kept,
            share(self.kept),
            self.moved,
            self.new
        )
    }
}

/// The result of a run. The text form ([`to_text`](Self::to_text)) starts with the source
/// document's three lines; the JSON form ([`to_json`](Self::to_json)) has every field below
/// under the same name, with times in the unit its name ends with.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Report {
    /// Engine replicas (both pools when disaggregated).
    pub instances: usize,
    /// Router replicas per pool.
    pub routers: usize,
    /// The routing policy (its name in JSON).
    #[serde(serialize_with = "policy_name")]
    pub routing: Policy,
    /// The `kv` policy's overlap weight.
    pub overlap_weight: f64,
    /// Where the content came from, e.g. `prefix pool: 8 prefixes`.
    pub content: String,
    /// Tokens per block.
    pub block_size: usize,
    /// KV blocks per instance (`null`: unbounded).
    pub capacity_per_instance: Option<usize>,
    /// The seed.
    pub seed: u64,
    /// Requests simulated.
    pub requests: usize,
    /// Requests completed.
    pub completed: usize,
    /// Requests that could never fit in an instance's KV blocks.
    pub rejected: usize,
    /// Blocks evicted, all instances.
    pub evictions: u64,
    /// Cached prompt blocks over all full prompt blocks.
    pub block_reuse: f64,
    /// Share of requests with at least one cached block.
    pub request_hit_rate: f64,
    /// Mean cached prompt tokens per request.
    pub avg_cached_tokens: f64,
    /// Lowest instance request hit rate.
    pub per_instance_hit_rate_min: f64,
    /// Highest instance request hit rate.
    pub per_instance_hit_rate_max: f64,
    /// Time to first token, from arrival (ms).
    pub ttft_ms: Summary,
    /// Inter-token latency over every output token after the first (ms).
    pub itl_ms: Summary,
    /// Arrival to last token (ms).
    pub e2e_ms: Summary,
    /// Completed requests per second of makespan.
    pub throughput_rps: f64,
    /// Output tokens per second of makespan.
    pub output_tokens_per_s: f64,
    /// From time 0 to the last completion (s).
    pub makespan_s: f64,
    /// Max over mean requests per instance (1.0 is perfectly even).
    pub load_balance: f64,
    /// Whether `load_balance` exceeds the hot-spotting threshold (1.5).
    pub hot_spot: bool,
    /// Router calls that failed (0 unless something is wrong).
    pub router_errors: u64,
    /// Per-instance breakdown (prefill engines first when disaggregated).
    pub per_instance: Vec<InstanceReport>,
    /// The prefill/decode split (`null` for a unified fleet).
    pub pd: Option<PdReport>,
    /// Attainment of the latency targets and goodput; only present (in JSON too) when a
    /// target is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloReport>,
    /// With incremental KV allocation: requests preempted (all engines); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preemptions: Option<u64>,
    /// With incremental KV allocation: prefill tokens computed again by preempted requests
    /// when scheduled again (their prompt and produced tokens, less what was still cached).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recomputed_tokens: Option<u64>,
    /// Multi-turn runs (synthetic sessions, a trace with sessions): cache hits by turn;
    /// absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turns: Option<TurnsReport>,
    /// With session affinity on: how sessions' later turns were routed; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions: Option<SessionsReport>,
    /// Hits per tier (absent without a host tier).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TierReport>,
    /// Data-parallel ranks per instance, when more than one (every rank is one of `instances`
    /// and of `per_instance`, ranks of an instance adjacent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_ranks: Option<usize>,
    /// What the routers saw of the ranks: `rank` or `engine` (with `dp_ranks`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_routing: Option<String>,
    /// With router sync (and several routers): the delay of a load delta between them (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_sync_delay_ms: Option<f64>,
}

impl Report {
    pub(crate) fn build(cfg: &SimConfig, content: String, c: Records) -> Self {
        let bs = cfg.block_size.get();
        let done: Vec<&RequestRecord> = c.requests.iter().filter(|r| !r.rejected).collect();
        let makespan_us = done.iter().map(|r| r.finish).max().unwrap_or(0);
        let makespan_s = makespan_us as f64 / 1e6;
        // On a decode engine a request's "hits" are the blocks it did not need transferred.
        let on = |r: &RequestRecord, i: usize, pool: Pool| match pool {
            Pool::Decode => r.decode_engine == Some(i),
            _ => r.engine == i,
        };
        let hits_on = |r: &RequestRecord, pool: Pool| {
            if pool == Pool::Decode {
                r.decode_hits
            } else {
                r.hits
            }
        };
        let mut per = Vec::with_capacity(c.engines.len());
        for (i, eng) in c.engines.iter().enumerate() {
            let mine: Vec<&&RequestRecord> = done.iter().filter(|r| on(r, i, eng.pool)).collect();
            let hits = mine.iter().filter(|r| hits_on(r, eng.pool) > 0).count();
            let cached: usize = mine.iter().map(|r| hits_on(r, eng.pool)).sum();
            let prompt: usize = mine.iter().map(|r| r.prompt_blocks).sum();
            per.push(InstanceReport {
                instance: i,
                pool: eng.pool,
                requests: c.requests.iter().filter(|r| on(r, i, eng.pool)).count(),
                completed: mine.len(),
                hit_rate: ratio(hits as f64, mine.len() as f64),
                block_reuse: ratio(cached as f64, prompt as f64),
                evictions: eng.evictions,
                resident_blocks: eng.resident_blocks,
                busy_fraction: ratio(eng.busy_us as f64, makespan_us as f64),
            });
        }
        let pool = |pool: Pool, weight: f64| {
            let mine: Vec<&InstanceReport> = per.iter().filter(|p| p.pool == pool).collect();
            let reqs: usize = mine.iter().map(|p| p.requests).sum();
            let served: Vec<&&RequestRecord> = done
                .iter()
                .filter(|r| pool != Pool::Decode || r.decode_engine.is_some())
                .collect();
            let cached: usize = served.iter().map(|r| hits_on(r, pool)).sum();
            let prompt: usize = served.iter().map(|r| r.prompt_blocks).sum();
            let used: Vec<f64> = mine
                .iter()
                .filter(|p| p.completed > 0)
                .map(|p| p.hit_rate)
                .collect();
            PoolReport {
                instances: mine.len(),
                overlap_weight: weight,
                request_hit_rate: ratio(
                    served.iter().filter(|r| hits_on(r, pool) > 0).count() as f64,
                    served.len() as f64,
                ),
                block_reuse: ratio(cached as f64, prompt as f64),
                per_instance_hit_rate_min: used
                    .iter()
                    .copied()
                    .fold(f64::INFINITY, f64::min)
                    .min(1.0),
                per_instance_hit_rate_max: used.iter().copied().fold(0.0, f64::max),
                load_balance: ratio(
                    mine.iter().map(|p| p.requests).max().unwrap_or(0) as f64,
                    reqs as f64 / mine.len().max(1) as f64,
                ),
                evictions: mine.iter().map(|p| p.evictions).sum(),
            }
        };
        let pd = cfg.disaggregated().then(|| PdReport {
            prefill: pool(
                Pool::Prefill,
                cfg.prefill_overlap_weight.unwrap_or(cfg.overlap_weight),
            ),
            decode: pool(
                Pool::Decode,
                cfg.decode_overlap_weight.unwrap_or(cfg.overlap_weight),
            ),
            prefill_queue_ms: Summary::from_us(done.iter().map(|r| r.scheduled - r.arrival)),
            transfer_ms: Summary::from_us(done.iter().map(|r| r.transfer_us)),
        });
        // The headline figures are the prefill side's: a hit there is prefill compute skipped.
        let front = pool(
            if pd.is_some() {
                Pool::Prefill
            } else {
                Pool::Unified
            },
            cfg.overlap_weight,
        );
        let load_balance = match &pd {
            Some(p) => p.prefill.load_balance.max(p.decode.load_balance),
            None => front.load_balance,
        };
        let cached: usize = done.iter().map(|r| r.hits).sum();
        let outputs: usize = done.iter().map(|r| r.output).sum();
        let tiers = cfg.host_kv_blocks.filter(|&h| h > 0).map(|h| {
            let host: usize = done.iter().map(|r| r.host_hits).sum();
            let prompt: usize = done.iter().map(|r| r.prompt_blocks).sum();
            TierReport {
                host_capacity_per_instance: h,
                device_hit_blocks: cached,
                host_hit_blocks: host,
                host_block_reuse: ratio(host as f64, prompt as f64),
                host_hit_credit: cfg.host_hit_credit,
            }
        });
        let mut itl = c.itl;
        let incremental = cfg.kv_allocation == KvAllocation::Incremental
            || cfg.scheduler == crate::engine::Scheduler::Vllm;
        let turns = cfg.has_sessions();
        let slo = cfg
            .slo
            .is_set()
            .then(|| SloReport::build(&cfg.slo, &c.requests, makespan_s));
        Report {
            instances: c.engines.len(),
            routers: cfg.routers,
            routing: cfg.routing,
            overlap_weight: cfg.overlap_weight,
            content,
            block_size: bs,
            capacity_per_instance: cfg.kv_blocks,
            seed: cfg.seed,
            requests: c.requests.len(),
            completed: done.len(),
            rejected: c.requests.len() - done.len(),
            evictions: per.iter().map(|p| p.evictions).sum(),
            block_reuse: front.block_reuse,
            request_hit_rate: front.request_hit_rate,
            avg_cached_tokens: ratio((cached * bs) as f64, done.len() as f64),
            per_instance_hit_rate_min: front.per_instance_hit_rate_min,
            per_instance_hit_rate_max: front.per_instance_hit_rate_max,
            ttft_ms: Summary::from_us(done.iter().map(|r| r.first_token - r.arrival)),
            itl_ms: Summary::weighted(&mut itl),
            e2e_ms: Summary::from_us(done.iter().map(|r| r.finish - r.arrival)),
            throughput_rps: ratio(done.len() as f64, makespan_s),
            output_tokens_per_s: ratio(outputs as f64, makespan_s),
            makespan_s,
            load_balance,
            hot_spot: load_balance > HOT_SPOT_THRESHOLD,
            router_errors: c.router_errors + c.inconsistent_inserts,
            per_instance: per,
            pd,
            slo,
            preemptions: incremental.then(|| c.engines.iter().map(|e| e.preemptions).sum()),
            recomputed_tokens: incremental
                .then(|| c.engines.iter().map(|e| e.recomputed_tokens).sum()),
            turns: turns.then(|| TurnsReport::build(&done, bs)),
            sessions: c.sessions.map(|s| SessionsReport::build(cfg, s)),
            tiers,
            dp_ranks: (cfg.dp_ranks > 1).then_some(cfg.dp_ranks),
            dp_routing: (cfg.dp_ranks > 1).then(|| cfg.dp_routing.to_string()),
            router_sync_delay_ms: (cfg.router_sync && cfg.routers > 1)
                .then(|| cfg.sync_delay_us as f64 / 1000.0),
        }
    }

    /// The report as text; `verbose` adds the per-instance table.
    pub fn to_text(&self, verbose: bool) -> String {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let cap = self
            .capacity_per_instance
            .map_or_else(|| "unbounded".to_string(), |c| c.to_string());
        let lo = if self.per_instance_hit_rate_min.is_finite() {
            self.per_instance_hit_rate_min
        } else {
            0.0
        };
        let mut s = String::new();
        let fleet = match &self.pd {
            Some(pd) => format!(
                "{} prefill + {} decode",
                pd.prefill.instances, pd.decode.instances
            ),
            None => self.instances.to_string(),
        };
        let dp = match (self.dp_ranks, &self.dp_routing) {
            (Some(r), Some(by)) => format!(
                " ({} x {r} data-parallel ranks, routed by {by})",
                self.instances / r.max(1)
            ),
            _ => String::new(),
        };
        let routers = match (self.routers > 1, self.router_sync_delay_ms) {
            (true, Some(d)) => format!(", {} routers synced after {d} ms", self.routers),
            (true, None) => format!(", {} routers", self.routers),
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "  Fleet: {fleet} instance(s){dp}, routing={}{routers} | {}",
            self.routing, self.content
        );
        let _ = writeln!(
            s,
            "  KV block cache: block_size={} tok, capacity/instance={}, evictions={}, block-reuse={}",
            self.block_size,
            cap,
            self.evictions,
            pct(self.block_reuse)
        );
        let _ = writeln!(
            s,
            "  Prefix-cache hit rate: {} of requests (avg {:.0} cached tok/req; per-instance {:.0}–{:.0}%)",
            pct(self.request_hit_rate),
            self.avg_cached_tokens,
            lo * 100.0,
            self.per_instance_hit_rate_max * 100.0
        );
        if let Some(t) = &self.tiers {
            let _ = writeln!(
                s,
                "  Host tier: capacity/instance={}, host hits={} blocks (block-reuse {}), device hits={} blocks, router credit {}",
                t.host_capacity_per_instance,
                t.host_hit_blocks,
                pct(t.host_block_reuse),
                t.device_hit_blocks,
                t.host_hit_credit
            );
        }
        if let Some(pd) = &self.pd {
            for (name, p, what, m) in [
                ("Prefill", &pd.prefill, "queueing", &pd.prefill_queue_ms),
                ("Decode", &pd.decode, "transfer", &pd.transfer_ms),
            ] {
                let lo = if p.per_instance_hit_rate_min.is_finite() {
                    p.per_instance_hit_rate_min
                } else {
                    0.0
                };
                let _ = writeln!(
                    s,
                    "  {name} pool: weight {}, hit rate {} of requests, block-reuse {} (per-instance {:.0}–{:.0}%), \
                     balance {:.2}, evictions {}, {what} p50 {:.1} ms p99 {:.1} ms",
                    p.overlap_weight,
                    pct(p.request_hit_rate),
                    pct(p.block_reuse),
                    lo * 100.0,
                    p.per_instance_hit_rate_max * 100.0,
                    p.load_balance,
                    p.evictions,
                    m.p50,
                    m.p99
                );
            }
        }
        let _ = writeln!(
            s,
            "  Requests: {} completed, {} rejected | makespan {:.2} s | throughput {:.2} req/s, {:.0} output tok/s",
            self.completed, self.rejected, self.makespan_s, self.throughput_rps, self.output_tokens_per_s
        );
        for (name, m) in [
            ("TTFT", &self.ttft_ms),
            ("ITL", &self.itl_ms),
            ("E2E", &self.e2e_ms),
        ] {
            let _ = writeln!(
                s,
                "  {name:<4} ms: mean {:.1}, p50 {:.1}, p90 {:.1}, p99 {:.1}",
                m.mean, m.p50, m.p90, m.p99
            );
        }
        if let Some(slo) = &self.slo {
            s.push_str(&slo.to_text());
        }
        if let Some(t) = &self.turns {
            s.push_str(&t.to_text());
        }
        if let Some(t) = &self.sessions {
            s.push_str(&t.to_text());
        }
        if let (Some(p), Some(t)) = (self.preemptions, self.recomputed_tokens) {
            let _ = writeln!(
                s,
                "  Preemptions (incremental KV allocation): {p}, {t} prefill tokens recomputed"
            );
        }
        let (min_r, max_r) = self
            .per_instance
            .iter()
            .fold((usize::MAX, 0), |(lo, hi), p| {
                (lo.min(p.requests), hi.max(p.requests))
            });
        let _ = writeln!(
            s,
            "  Load balance: max/mean requests per instance {:.2} (min {}, max {})",
            self.load_balance,
            if self.per_instance.is_empty() {
                0
            } else {
                min_r
            },
            max_r
        );
        if self.hot_spot {
            let _ = writeln!(
                s,
                "  WARNING: hot-spotting: one instance took {:.1}x the mean share of requests; locality is \
                 concentrating load, so a high hit rate here is not a win",
                self.load_balance
            );
        }
        if self.router_errors > 0 {
            let _ = writeln!(s, "  WARNING: {} router call(s) failed", self.router_errors);
        }
        if verbose {
            let _ = writeln!(
                s,
                "  instance  pool      requests  hit-rate  block-reuse  evictions  resident  busy"
            );
            for p in &self.per_instance {
                let _ = writeln!(
                    s,
                    "  {:>8}  {:<8}  {:>8}  {:>8}  {:>11}  {:>9}  {:>8}  {:>4.0}%",
                    p.instance,
                    p.pool,
                    p.requests,
                    pct(p.hit_rate),
                    pct(p.block_reuse),
                    p.evictions,
                    p.resident_blocks,
                    p.busy_fraction * 100.0
                );
            }
        }
        s
    }

    /// The report as one pretty-printed JSON document.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}
