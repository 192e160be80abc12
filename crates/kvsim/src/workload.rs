//! Where requests come from: arrival times and prompt content.

use std::sync::Arc;

use kvblock::{BlockHash, BlockHasher, BlockSequence};

use crate::config::{ArrivalModel, Popularity, SimConfig, TraceTiming};
use crate::rng::{SimRng, Zipf};
use crate::trace::Trace;

/// Token ids are drawn below this, like a real tokenizer's vocabulary.
const VOCAB: u64 = 128_000;
/// From this many synthetic requests on, they are drawn on a thread of their own (where the
/// machine has a second core): drawing and hashing each prompt's tokens is a tenth of a long
/// run, and the simulation needs the requests only in order.
const AHEAD_FROM: usize = 4_096;
/// Requests the drawing thread sends at once, and batches it may be ahead by.
const AHEAD_BATCH: usize = 64;
const AHEAD_BATCHES: usize = 8;

/// One request as the workload produces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestSpec {
    pub(crate) arrival_us: u64,
    pub(crate) input_len: usize,
    pub(crate) output_len: usize,
    /// Hashes of the prompt's full blocks (a partial last block is not cacheable).
    pub(crate) blocks: Vec<BlockHash>,
}

impl RequestSpec {
    /// A placeholder left where a request was taken from.
    pub(crate) fn empty() -> Self {
        RequestSpec {
            arrival_us: 0,
            input_len: 0,
            output_len: 0,
            blocks: Vec::new(),
        }
    }
}

/// Arrival times in integer microseconds.
#[derive(Debug, Clone)]
pub(crate) struct Arrivals {
    model: ArrivalModel,
    mean_gap_s: f64,
    gamma_shape: f64,
    rng: SimRng,
    t_s: f64,
    first: bool,
}

impl Arrivals {
    pub(crate) fn new(model: ArrivalModel, rate: f64, cv: f64, rng: SimRng) -> Self {
        Arrivals {
            model,
            mean_gap_s: 1.0 / rate,
            gamma_shape: 1.0 / (cv * cv),
            rng,
            t_s: 0.0,
            first: true,
        }
    }

    /// The next arrival time; the first request arrives at time 0.
    pub(crate) fn next_us(&mut self) -> u64 {
        if !std::mem::take(&mut self.first) {
            let gap = match self.model {
                ArrivalModel::Poisson => self.rng.exp1() * self.mean_gap_s,
                ArrivalModel::Constant => self.mean_gap_s,
                ArrivalModel::Gamma => {
                    self.rng.gamma(self.gamma_shape) * self.mean_gap_s / self.gamma_shape
                }
            };
            self.t_s += gap;
        }
        (self.t_s * 1e6).round() as u64
    }
}

/// Where a run's requests come from.
#[derive(Debug)]
pub(crate) enum Workload {
    Synthetic(Box<Synthetic>),
    /// The synthetic requests, drawn on another thread.
    Ahead(Ahead),
    Trace(Replay),
}

impl Workload {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        match &cfg.trace {
            Some(t) => Workload::Trace(Replay::new(cfg, Arc::clone(t))),
            None => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                // A closed loop draws its turns from a plan of its own.
                if cfg.num_requests >= AHEAD_FROM && cores > 1 && !cfg.closed_loop() {
                    // Where no thread can be started, the run draws them itself.
                    if let Some(ahead) = Ahead::spawn(Synthetic::new(cfg)) {
                        return Workload::Ahead(ahead);
                    }
                }
                Workload::Synthetic(Box::new(Synthetic::new(cfg)))
            }
        }
    }

    pub(crate) fn next_request(&mut self) -> Option<RequestSpec> {
        match self {
            Workload::Synthetic(s) => s.next_request(),
            Workload::Ahead(a) => a.next_request(),
            Workload::Trace(t) => t.next_request(),
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            Workload::Synthetic(s) => s.describe(),
            Workload::Ahead(a) => a.describe.clone(),
            Workload::Trace(t) => t.describe(),
        }
    }

    /// [`describe`](Self::describe), with the closed loop's sessions and concurrency.
    pub(crate) fn describe_run(&self, cfg: &SimConfig) -> String {
        let mut d = match (cfg.sessions, &cfg.trace) {
            (Some(n), _) => format!(
                "{n} sessions x {} turns, think {} ms, {}",
                cfg.turns,
                cfg.think_us as f64 / 1000.0,
                self.describe()
            ),
            (None, Some(t)) if t.has_sessions() => format!("{} in sessions", self.describe()),
            _ => self.describe(),
        };
        if let Some(n) = cfg.concurrency {
            d.push_str(&format!(", closed loop at concurrency {n}"));
        }
        d
    }
}

/// A [`Synthetic`] workload drawn on a thread of its own, a few batches ahead of the
/// simulation: the same requests in the same order, so the run is the same.
#[derive(Debug)]
pub(crate) struct Ahead {
    rx: std::sync::mpsc::Receiver<Vec<RequestSpec>>,
    batch: std::vec::IntoIter<RequestSpec>,
    describe: String,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ahead {
    /// `None` if no thread can be started.
    fn spawn(mut synthetic: Synthetic) -> Option<Self> {
        let describe = synthetic.describe();
        let (tx, rx) = std::sync::mpsc::sync_channel(AHEAD_BATCHES);
        // The thread ends after the last request, or when the run drops the receiver.
        let thread = std::thread::Builder::new()
            .name("kvsim-requests".into())
            .spawn(move || loop {
                let batch: Vec<RequestSpec> = std::iter::from_fn(|| synthetic.next_request())
                    .take(AHEAD_BATCH)
                    .collect();
                let last = batch.len() < AHEAD_BATCH;
                if tx.send(batch).is_err() || last {
                    break;
                }
            })
            .ok()?;
        Some(Ahead {
            rx,
            batch: Vec::new().into_iter(),
            describe,
            thread: Some(thread),
        })
    }

    fn next_request(&mut self) -> Option<RequestSpec> {
        loop {
            if let Some(r) = self.batch.next() {
                return Some(r);
            }
            match self.rx.recv() {
                Ok(batch) => self.batch = batch.into_iter(),
                Err(_) => {
                    // The thread is done: it sent every request, or it panicked, which the
                    // run must not take for the end of the workload.
                    if let Some(Err(panic)) = self.thread.take().map(|t| t.join()) {
                        std::panic::resume_unwind(panic);
                    }
                    return None;
                }
            }
        }
    }
}

/// Replays a trace's first requests, with its own timestamps or re-timed.
#[derive(Debug, Clone)]
pub(crate) struct Replay {
    trace: Arc<Trace>,
    next: usize,
    end: usize,
    speedup: f64,
    arrivals: Option<Arrivals>,
}

impl Replay {
    fn new(cfg: &SimConfig, trace: Arc<Trace>) -> Self {
        let arrivals = (cfg.trace_timing == TraceTiming::Rate).then(|| {
            Arrivals::new(
                cfg.arrival_model,
                cfg.request_rate,
                cfg.arrival_cv,
                SimRng::new(cfg.seed, 2),
            )
        });
        Replay {
            end: cfg.request_count(),
            trace,
            next: 0,
            speedup: cfg.trace_speedup,
            arrivals,
        }
    }

    fn next_request(&mut self) -> Option<RequestSpec> {
        if self.next >= self.end {
            return None;
        }
        let r = self.trace.requests().get(self.next)?;
        self.next += 1;
        let arrival_us = match &mut self.arrivals {
            Some(a) => a.next_us(),
            None => (r.arrival_us as f64 / self.speedup).round() as u64,
        };
        Some(RequestSpec {
            arrival_us,
            input_len: r.input_len,
            output_len: r.output_len,
            blocks: r.blocks.clone(),
        })
    }

    fn describe(&self) -> String {
        let name = std::path::Path::new(self.trace.name())
            .file_name()
            .map_or_else(
                || self.trace.name().to_string(),
                |f| f.to_string_lossy().into_owned(),
            );
        format!("trace: {name} ({} requests)", self.end)
    }
}

#[derive(Debug, Clone)]
struct Prefix {
    /// Hashes of the prefix's full blocks.
    blocks: Vec<BlockHash>,
    /// Prefix tokens after its last full block; they share a block with the suffix.
    tail: Vec<u32>,
}

/// The synthetic workload: a pool of prefixes, each request one of them plus a unique suffix.
#[derive(Debug, Clone)]
pub(crate) struct Synthetic {
    hasher: BlockHasher,
    prefixes: Vec<Prefix>,
    zipf: Option<Zipf>,
    arrivals: Arrivals,
    choose: SimRng,
    seed: u64,
    input_len: usize,
    output_len: usize,
    remaining: usize,
    issued: u64,
    tokens: Vec<u32>,
}

impl Synthetic {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        let hasher = BlockHasher::new(cfg.block_size);
        let mut content = SimRng::new(cfg.seed, 1);
        let prefixes = (0..cfg.num_prefixes)
            .map(|_| {
                let tokens: Vec<u32> = (0..cfg.prefix_len)
                    .map(|_| content.below(VOCAB) as u32)
                    .collect();
                let full = cfg.block_size.full_blocks(tokens.len()) * cfg.block_size.get();
                Prefix {
                    blocks: hasher.sequence_hashes(&tokens),
                    tail: tokens[full..].to_vec(),
                }
            })
            .collect();
        Synthetic {
            hasher,
            prefixes,
            zipf: match cfg.prefix_popularity {
                Popularity::Uniform => None,
                Popularity::Zipf(s) => Some(Zipf::new(cfg.num_prefixes, s)),
            },
            arrivals: Arrivals::new(
                cfg.arrival_model,
                cfg.request_rate,
                cfg.arrival_cv,
                SimRng::new(cfg.seed, 2),
            ),
            choose: SimRng::new(cfg.seed, 3),
            seed: cfg.seed,
            input_len: cfg.input_len.max(cfg.prefix_len),
            output_len: cfg.output_len,
            remaining: cfg.num_requests,
            issued: 0,
            tokens: Vec::new(),
        }
    }

    pub(crate) fn next_request(&mut self) -> Option<RequestSpec> {
        self.remaining = self.remaining.checked_sub(1)?;
        let arrival_us = self.arrivals.next_us();
        let p = match &self.zipf {
            Some(z) => z.sample(&mut self.choose),
            None => self.choose.below(self.prefixes.len() as u64) as usize,
        };
        let prefix = &self.prefixes[p];
        // The suffix comes from the request's own stream, so content does not depend on how
        // many draws arrivals or prefix choices made.
        let mut suffix_rng = SimRng::new(self.seed, 1_000 + self.issued);
        self.issued += 1;
        let prefix_len = prefix.blocks.len() * self.hasher.block_size().get() + prefix.tail.len();
        let suffix_len = self.input_len - prefix_len;
        self.tokens.clear();
        self.tokens.extend_from_slice(&prefix.tail);
        self.tokens
            .extend((0..suffix_len).map(|_| suffix_rng.below(VOCAB) as u32));
        let mut blocks = Vec::with_capacity(self.input_len / self.hasher.block_size().get());
        blocks.extend_from_slice(&prefix.blocks);
        let mut seq = match blocks.last() {
            Some(&last) => BlockSequence::with_parent(self.hasher, last),
            None => BlockSequence::new(self.hasher),
        };
        seq.extend_into(&self.tokens, &mut blocks);
        Some(RequestSpec {
            arrival_us,
            input_len: self.input_len,
            output_len: self.output_len,
            blocks,
        })
    }

    pub(crate) fn describe(&self) -> String {
        format!("prefix pool: {} prefixes", self.prefixes.len())
    }
}

/// One request of a closed-loop run: what it sends and what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Turn {
    /// The request; `arrival_us` is the earliest time it may be sent.
    pub(crate) spec: RequestSpec,
    /// The previous turn of its session, which must finish first.
    pub(crate) prev: Option<usize>,
    /// Pause after `prev` finished, µs.
    pub(crate) think_us: u64,
    /// Its turn in its session, from 1.
    pub(crate) turn: u32,
    /// Its session (a synthetic session's number, a trace's `session_id` in order of first
    /// appearance); `None` for a request of its own.
    pub(crate) session: Option<u64>,
}

/// The requests of a closed-loop run in order (sessions' turns after one another), or `None`
/// for an open-loop run.
pub(crate) fn closed_plan(cfg: &SimConfig) -> Option<Vec<Turn>> {
    if !cfg.closed_loop() {
        return None;
    }
    let mut plan = match (cfg.sessions, &cfg.trace) {
        (Some(n), _) => synthetic_sessions(cfg, n),
        (None, Some(t)) => {
            let mut replay = Replay::new(cfg, Arc::clone(t));
            let mut last: Vec<Option<usize>> = Vec::new();
            let mut turns: Vec<u32> = Vec::new();
            let mut plan = Vec::new();
            for r in t.requests().iter().take(cfg.request_count()) {
                let Some(spec) = replay.next_request() else {
                    break;
                };
                let (prev, turn) = match r.session {
                    Some(k) => {
                        if k >= last.len() {
                            last.resize(k + 1, None);
                            turns.resize(k + 1, 0);
                        }
                        turns[k] += 1;
                        (last[k].replace(plan.len()), turns[k])
                    }
                    None => (None, 1),
                };
                plan.push(Turn {
                    spec,
                    prev,
                    think_us: r.think_us,
                    turn,
                    session: r.session.map(|k| k as u64),
                });
            }
            plan
        }
        (None, None) => {
            let mut w = Synthetic::new(cfg);
            std::iter::from_fn(|| w.next_request())
                .map(|spec| Turn {
                    spec,
                    prev: None,
                    think_us: 0,
                    turn: 1,
                    session: None,
                })
                .collect()
        }
    };
    if cfg.concurrency.is_some() {
        // A fixed concurrency sends as fast as slots free up.
        for t in &mut plan {
            t.spec.arrival_us = 0;
        }
    }
    Some(plan)
}

/// `n` synthetic chat sessions (see [`SimConfig::sessions`]).
fn synthetic_sessions(cfg: &SimConfig, n: usize) -> Vec<Turn> {
    let mut pool = Synthetic::new(cfg);
    let bs = cfg.block_size.get();
    let new_len = cfg.input_len.saturating_sub(cfg.prefix_len);
    let mut plan = Vec::with_capacity(n.saturating_mul(cfg.turns).min(1 << 20));
    for s in 0..n as u64 {
        let start = pool.arrivals.next_us();
        let p = match &pool.zipf {
            Some(z) => z.sample(&mut pool.choose),
            None => pool.choose.below(pool.prefixes.len() as u64) as usize,
        };
        let prefix = &pool.prefixes[p];
        // Each session's text (its users' and its answers') comes from its own stream.
        let mut text = SimRng::new(cfg.seed, (1 << 40) + s);
        let mut blocks = prefix.blocks.clone();
        let mut seq = match blocks.last() {
            Some(&last) => BlockSequence::with_parent(pool.hasher, last),
            None => BlockSequence::new(pool.hasher),
        };
        let mut tokens: Vec<u32> = prefix.tail.clone();
        let mut input_len = prefix.blocks.len() * bs + prefix.tail.len();
        for turn in 1..=cfg.turns {
            if turn > 1 {
                // The previous answer, then the user's next message.
                tokens.extend((0..cfg.output_len).map(|_| text.below(VOCAB) as u32));
                input_len += cfg.output_len;
            }
            tokens.extend((0..new_len).map(|_| text.below(VOCAB) as u32));
            input_len += new_len;
            seq.extend_into(&tokens, &mut blocks);
            tokens.clear();
            plan.push(Turn {
                spec: RequestSpec {
                    arrival_us: if turn == 1 { start } else { 0 },
                    input_len,
                    output_len: cfg.output_len,
                    blocks: blocks.clone(),
                },
                prev: (turn > 1).then(|| plan.len() - 1),
                think_us: if turn > 1 { cfg.think_us } else { 0 },
                turn: turn as u32,
                session: Some(s),
            });
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvblock::BlockSize;

    /// Drawn on a thread of their own, the requests are the same, in the same order, whether
    /// their number fills the last batch or not; dropping the run early stops the thread.
    #[test]
    fn requests_drawn_ahead_are_the_same() {
        for n in [0, 1, AHEAD_BATCH, 3 * AHEAD_BATCH + 5] {
            let cfg = SimConfig {
                num_requests: n,
                input_len: 300,
                ..SimConfig::default()
            };
            let mut plain = Synthetic::new(&cfg);
            let mut ahead = Ahead::spawn(Synthetic::new(&cfg)).unwrap();
            let want: Vec<RequestSpec> = std::iter::from_fn(|| plain.next_request()).collect();
            let got: Vec<RequestSpec> = std::iter::from_fn(|| ahead.next_request()).collect();
            assert_eq!((got.len(), &got), (n, &want));
            assert_eq!(ahead.next_request(), None);
            assert_eq!(ahead.describe, plain.describe());
        }
        let cfg = SimConfig {
            num_requests: 100 * AHEAD_BATCH,
            ..SimConfig::default()
        };
        let mut ahead = Ahead::spawn(Synthetic::new(&cfg)).unwrap();
        assert!(ahead.next_request().is_some());
        let thread = ahead.thread.take().unwrap();
        drop(ahead);
        thread.join().unwrap();
        // The workload a long run uses is this one.
        assert!(
            matches!(Workload::new(&cfg), Workload::Ahead(_))
                || std::thread::available_parallelism().map_or(true, |n| n.get() == 1)
        );
    }

    #[test]
    fn requests_share_exactly_their_prefix_blocks() {
        let cfg = SimConfig {
            num_prefixes: 2,
            prefix_len: 40,
            input_len: 100,
            block_size: BlockSize::new(16).unwrap(),
            num_requests: 50,
            ..SimConfig::default()
        };
        let mut w = Synthetic::new(&cfg);
        let reqs: Vec<RequestSpec> = std::iter::from_fn(|| w.next_request()).collect();
        assert_eq!(reqs.len(), 50);
        for r in &reqs {
            assert_eq!(r.blocks.len(), 6);
            assert_eq!(r.input_len, 100);
        }
        // Two full prefix blocks are shared within a prefix; the third block mixes in the suffix.
        let firsts: std::collections::BTreeSet<_> =
            reqs.iter().map(|r| (r.blocks[0], r.blocks[1])).collect();
        assert_eq!(firsts.len(), 2);
        let thirds: std::collections::BTreeSet<_> = reqs.iter().map(|r| r.blocks[2]).collect();
        assert_eq!(thirds.len(), 50);
        assert!(reqs.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
        assert_eq!(reqs[0].arrival_us, 0);
    }

    #[test]
    fn arrival_rates_hold() {
        for model in ArrivalModel::ALL {
            let mut a = Arrivals::new(model, 4.0, 2.0, SimRng::new(9, 2));
            let last = (0..20_001).map(|_| a.next_us()).last().unwrap();
            let rate = 20_000.0 / (last as f64 / 1e6);
            assert!((rate - 4.0).abs() < 0.15, "{model}: {rate}");
        }
    }
}
