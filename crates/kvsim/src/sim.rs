//! The discrete-event engine: arrivals, routing, continuous batching, KV events.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use kvblock::{BlockHash, BlockSize};
use kvcache::{BlockCache, KvEvent, WorkerId};
use kvroute::{Role, Router};

use crate::config::SimConfig;
use crate::report::{Collected, Report};
use crate::timing::{StepShape, TimingModel};
use crate::workload::{RequestSpec, Workload};
use crate::Error;
#[cfg(test)]
use kvroute::Policy;

/// A configured simulation. [`run`](Self::run) may be called any number of times and gives the
/// same report each time.
///
/// ```
/// use kvsim::{LinearTiming, SimConfig, Simulation};
/// let mut cfg = SimConfig::default();
/// cfg.num_requests = 20;
/// let fast = Simulation::new(cfg.clone())?.with_timing(LinearTiming::new(1_000.0, 1.0, 1.0, 0.0));
/// let default = Simulation::new(cfg)?;
/// assert!(fast.run()?.makespan_s < default.run()?.makespan_s);
/// # Ok::<(), kvsim::Error>(())
/// ```
#[derive(Clone)]
pub struct Simulation {
    cfg: SimConfig,
    timing: Arc<dyn TimingModel>,
}

impl std::fmt::Debug for Simulation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulation")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Simulation {
    /// Validates `cfg` and prepares a run with its linear timing model.
    pub fn new(cfg: SimConfig) -> Result<Self, Error> {
        cfg.validate()?;
        let timing = Arc::new(cfg.timing);
        Ok(Simulation { cfg, timing })
    }

    /// Replaces the timing model.
    pub fn with_timing(mut self, timing: impl TimingModel + 'static) -> Self {
        self.timing = Arc::new(timing);
        self
    }

    /// The settings.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// Runs the simulation to the last request's completion.
    pub fn run(&self) -> Result<Report, Error> {
        self.run_with_progress(&mut |_| {})
    }

    /// [`run`](Self::run), calling `progress` with the number of requests that have arrived so
    /// far, about every 1% of them.
    pub fn run_with_progress(&self, progress: &mut dyn FnMut(usize)) -> Result<Report, Error> {
        let router = Router::builder()
            .block_size(self.cfg.block_size)
            .policy(self.cfg.routing)
            .overlap_weight(self.cfg.overlap_weight)
            .seed(self.cfg.seed)
            .build()?;
        let workload = Workload::new(&self.cfg);
        let content = workload.describe();
        let mut run = Run::new(&self.cfg, self.timing.as_ref(), router, workload);
        run.simulate(progress);
        Ok(Report::build(&self.cfg, content, run.collect()))
    }
}

#[derive(Debug)]
enum Kind {
    Arrival,
    StepDone(usize),
    Deliver(usize, Vec<KvEvent>),
}

#[derive(Debug)]
struct Event {
    time: u64,
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        (self.time, self.seq) == (o.time, o.seq)
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // Min-heap on (time, insertion order): same-time events run in the order they were made.
        (o.time, o.seq).cmp(&(self.time, self.seq))
    }
}

/// One request's life.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) arrival: u64,
    pub(crate) input: usize,
    pub(crate) output: usize,
    blocks: Vec<BlockHash>,
    pub(crate) prompt_blocks: usize,
    pub(crate) engine: usize,
    /// Leading prompt blocks resident on the engine when it was scheduled (engine truth).
    pub(crate) hits: usize,
    prefill_left: usize,
    /// Blocks the request occupies while it runs: ceil((input + output) / block size).
    mem_blocks: usize,
    decoding: bool,
    pub(crate) first_token: u64,
    pub(crate) finish: u64,
    pub(crate) rejected: bool,
}

#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) cache: BlockCache,
    total: Option<usize>,
    /// Blocks held by running requests outside the cache (their unique and output blocks).
    private: usize,
    waiting: VecDeque<usize>,
    prefilling: VecDeque<usize>,
    decoding: usize,
    context: u64,
    finishing: BinaryHeap<Reverse<(u64, usize)>>,
    steps: u64,
    busy: bool,
    chunks: Vec<(usize, usize)>,
    step_decode: usize,
    next_event_id: u64,
    pub(crate) busy_us: u64,
}

impl Engine {
    fn new(total: Option<usize>) -> Self {
        Engine {
            cache: BlockCache::new(None),
            total,
            private: 0,
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            decoding: 0,
            context: 0,
            finishing: BinaryHeap::new(),
            steps: 0,
            busy: false,
            chunks: Vec::new(),
            step_decode: 0,
            next_event_id: 0,
            busy_us: 0,
        }
    }

    fn running(&self) -> usize {
        self.prefilling.len() + self.decoding
    }

    /// Gives the cache whatever the running requests do not hold privately.
    fn resize_cache(&mut self, extra_private: usize) -> bool {
        match self.total {
            None => true,
            Some(total) => match total.checked_sub(self.private + extra_private) {
                Some(room) => self.cache.set_capacity(Some(room)).is_ok(),
                None => false,
            },
        }
    }
}

struct Run<'a> {
    cfg: &'a SimConfig,
    block_size: BlockSize,
    timing: &'a dyn TimingModel,
    router: Router,
    workload: Workload,
    pending: Option<RequestSpec>,
    queue: BinaryHeap<Event>,
    seq: u64,
    reqs: Vec<Req>,
    engines: Vec<Engine>,
    /// (step duration, tokens it produced for decoding requests): ITL samples by weight.
    itl: Vec<(u64, u64)>,
    router_errors: u64,
    inconsistent_inserts: u64,
    now: u64,
}

impl<'a> Run<'a> {
    fn new(
        cfg: &'a SimConfig,
        timing: &'a dyn TimingModel,
        mut router: Router,
        workload: Workload,
    ) -> Self {
        let engines = (0..cfg.instances)
            .map(|_| Engine::new(cfg.kv_blocks))
            .collect();
        for w in 0..cfg.instances {
            router.add_worker(WorkerId::new(w as u64));
        }
        Run {
            cfg,
            block_size: cfg.block_size,
            timing,
            router,
            workload,
            pending: None,
            queue: BinaryHeap::new(),
            seq: 0,
            reqs: Vec::with_capacity(cfg.request_count()),
            engines,
            itl: Vec::new(),
            router_errors: 0,
            inconsistent_inserts: 0,
            now: 0,
        }
    }

    fn push(&mut self, time: u64, kind: Kind) {
        self.seq += 1;
        self.queue.push(Event {
            time,
            seq: self.seq,
            kind,
        });
    }

    fn schedule_next_arrival(&mut self) {
        self.pending = self.workload.next_request();
        if let Some(r) = &self.pending {
            let t = r.arrival_us.max(self.now);
            self.push(t, Kind::Arrival);
        }
    }

    fn simulate(&mut self, progress: &mut dyn FnMut(usize)) {
        let every = (self.cfg.request_count() / 100).max(1);
        self.schedule_next_arrival();
        while let Some(ev) = self.queue.pop() {
            self.now = ev.time;
            match ev.kind {
                Kind::Arrival => {
                    self.arrive();
                    if self.reqs.len() % every == 0 {
                        progress(self.reqs.len());
                    }
                }
                Kind::StepDone(e) => self.step_done(e),
                Kind::Deliver(e, events) => self.deliver(e, &events),
            }
        }
    }

    fn arrive(&mut self) {
        let Some(spec) = self.pending.take() else {
            return;
        };
        let id = self.reqs.len();
        let decision = self.router.route(id as u64, &spec.blocks, Role::Unified);
        let engine = match decision {
            Ok(d) => d.worker.get() as usize,
            Err(_) => {
                self.router_errors += 1;
                0
            }
        };
        let mem_blocks = self.block_size.blocks_for(spec.input_len + spec.output_len);
        let rejected = self.engines[engine].total.is_some_and(|t| mem_blocks > t);
        self.reqs.push(Req {
            arrival: self.now,
            input: spec.input_len,
            output: spec.output_len,
            prompt_blocks: spec.blocks.len(),
            blocks: spec.blocks,
            engine,
            hits: 0,
            prefill_left: spec.input_len,
            mem_blocks,
            decoding: false,
            first_token: 0,
            finish: 0,
            rejected,
        });
        if rejected {
            // It can never fit on this engine: count it and release the router's load.
            let _ = self.router.finish(id as u64);
            self.reqs[id].blocks = Vec::new();
        } else {
            self.engines[engine].waiting.push_back(id);
            if !self.engines[engine].busy {
                self.start_step(engine);
            }
        }
        self.schedule_next_arrival();
    }

    /// Schedules a waiting request if memory allows: pins its cached run and reserves the rest.
    fn admit(&mut self, e: usize, r: usize) -> bool {
        let req = &self.reqs[r];
        let eng = &mut self.engines[e];
        // The leading run resident now (engine truth), pinned so it stays while the request runs.
        let hits = eng.cache.pin(&req.blocks);
        let need = req.mem_blocks - hits;
        if !eng.resize_cache(need) {
            eng.cache.unpin(&req.blocks[..hits]);
            return false;
        }
        if eng.total.is_some() {
            eng.private += need;
        }
        // A full hit still computes the last prompt token, to produce the first output token.
        let cached_tokens = (hits * self.block_size.get()).min(req.input.saturating_sub(1));
        let req = &mut self.reqs[r];
        req.hits = hits;
        req.prefill_left = req.input - cached_tokens;
        eng.prefilling.push_back(r);
        true
    }

    fn start_step(&mut self, e: usize) {
        loop {
            let eng = &self.engines[e];
            let Some(&r) = eng.waiting.front() else { break };
            if eng.running() >= self.cfg.max_num_seqs || !self.admit(e, r) {
                break;
            }
            self.engines[e].waiting.pop_front();
        }
        self.flush_events(e);
        let eng = &mut self.engines[e];
        if eng.prefilling.is_empty() && eng.decoding == 0 {
            return;
        }
        let mut budget = self.cfg.max_batched_tokens.saturating_sub(eng.decoding);
        let mut prefill_tokens = 0;
        eng.chunks.clear();
        for &r in &eng.prefilling {
            if budget == 0 {
                break;
            }
            let chunk = self.reqs[r].prefill_left.min(budget);
            eng.chunks.push((r, chunk));
            budget -= chunk;
            prefill_tokens += chunk;
        }
        eng.step_decode = eng.decoding;
        let shape = StepShape::new(prefill_tokens as u64, eng.decoding as u64, eng.context);
        let dur = self.timing.step_us(&shape).max(1);
        eng.busy = true;
        eng.busy_us += dur;
        if eng.decoding > 0 {
            self.itl.push((dur, eng.decoding as u64));
        }
        self.push(self.now + dur, Kind::StepDone(e));
    }

    fn step_done(&mut self, e: usize) {
        let now = self.now;
        let eng = &mut self.engines[e];
        eng.busy = false;
        eng.steps += 1;
        // Every request that was decoding in this step produced one token.
        eng.context += eng.step_decode as u64;
        loop {
            let eng = &mut self.engines[e];
            match eng.finishing.peek() {
                Some(&Reverse((step, r))) if step <= eng.steps => {
                    eng.finishing.pop();
                    self.finish(r, now);
                }
                _ => break,
            }
        }
        let eng = &mut self.engines[e];
        for i in 0..eng.chunks.len() {
            let (r, chunk) = eng.chunks[i];
            self.reqs[r].prefill_left -= chunk;
        }
        // Chunks go to the queue's front first, so completed prefills are a prefix of it.
        while let Some(&r) = self.engines[e].prefilling.front() {
            if self.reqs[r].prefill_left > 0 {
                break;
            }
            self.engines[e].prefilling.pop_front();
            self.prefill_done(r, now);
        }
        self.flush_events(e);
        self.start_step(e);
    }

    /// The prompt is computed and the first token produced: its full blocks become resident.
    fn prefill_done(&mut self, r: usize, now: u64) {
        let req = &mut self.reqs[r];
        req.first_token = now;
        let eng = &mut self.engines[req.engine];
        if eng.total.is_some() {
            // The blocks reserved for the new prompt blocks move into the cache.
            eng.private -= req.prompt_blocks - req.hits;
            eng.resize_cache(0);
        }
        if eng.cache.insert(&req.blocks).is_err() {
            self.inconsistent_inserts += 1;
        }
        // The cached run is pinned since admission; pin the blocks just computed.
        eng.cache.pin(&req.blocks[req.hits..]);
        if req.output <= 1 {
            self.finish(r, now);
            return;
        }
        let (engine, input, output) = (req.engine, req.input, req.output);
        req.decoding = true;
        let eng = &mut self.engines[engine];
        eng.decoding += 1;
        eng.context += (input + 1) as u64;
        eng.finishing
            .push(Reverse((eng.steps + (output as u64 - 1), r)));
    }

    fn finish(&mut self, r: usize, now: u64) {
        let req = &mut self.reqs[r];
        req.finish = now;
        let eng = &mut self.engines[req.engine];
        if std::mem::take(&mut req.decoding) {
            eng.decoding -= 1;
            eng.context -= (req.input + req.output) as u64;
        }
        eng.cache.unpin(&req.blocks);
        if eng.total.is_some() {
            eng.private -= req.mem_blocks - req.prompt_blocks;
            eng.resize_cache(0);
        }
        req.blocks = Vec::new();
        if self.router.finish(r as u64).is_err() {
            self.router_errors += 1;
        }
    }

    fn flush_events(&mut self, e: usize) {
        if self.engines[e].cache.pending_events() == 0 {
            return;
        }
        let events: Vec<KvEvent> = self.engines[e].cache.drain_events().collect();
        if self.cfg.event_delay_us == 0 {
            self.deliver(e, &events);
        } else {
            self.push(self.now + self.cfg.event_delay_us, Kind::Deliver(e, events));
        }
    }

    fn deliver(&mut self, e: usize, events: &[KvEvent]) {
        for ev in events {
            let id = self.engines[e].next_event_id;
            self.engines[e].next_event_id += 1;
            if self
                .router
                .apply_event(WorkerId::new(e as u64), id, ev)
                .is_err()
            {
                self.router_errors += 1;
            }
        }
    }

    fn collect(self) -> Collected {
        Collected {
            reqs: self.reqs,
            engines: self.engines,
            itl: self.itl,
            router_errors: self.router_errors,
            inconsistent_inserts: self.inconsistent_inserts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::LinearTiming;
    use proptest::prelude::*;

    fn finished_run(cfg: &SimConfig) -> (Collected, Router, Vec<(usize, usize)>) {
        let timing = LinearTiming::default();
        let router = Router::builder()
            .block_size(cfg.block_size)
            .policy(cfg.routing)
            .overlap_weight(cfg.overlap_weight)
            .seed(cfg.seed)
            .build()
            .unwrap();
        let mut run = Run::new(cfg, &timing, router, Workload::new(cfg));
        run.simulate(&mut |_| {});
        let leftovers = run
            .engines
            .iter()
            .map(|e| (e.private, e.cache.pinned_blocks()))
            .collect();
        for e in &run.engines {
            e.cache.check_invariants().unwrap();
            assert!(
                e.waiting.is_empty()
                    && e.prefilling.is_empty()
                    && e.decoding == 0
                    && e.context == 0
            );
        }
        let router = run.router.clone();
        (run.collect(), router, leftovers)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Whatever the settings: every request completes or is rejected, nothing stays pinned
        /// or reserved, the router ends with no load, and its view equals the engines' caches.
        #[test]
        fn runs_end_clean(instances in 1usize..5, kv in prop::option::of(4usize..60), bs in prop::sample::select(vec![16usize, 64, 256]),
                          policy in prop::sample::select(Policy::ALL.to_vec()), delay in prop::sample::select(vec![0u64, 5_000]),
                          input in 1usize..3000, output in 1usize..40, seqs in 1usize..8, seed in 0u64..1000) {
            let cfg = SimConfig {
                instances,
                kv_blocks: kv,
                block_size: BlockSize::new(bs).unwrap(),
                routing: policy,
                event_delay_us: delay,
                input_len: input,
                prefix_len: input / 2,
                output_len: output,
                max_num_seqs: seqs,
                max_batched_tokens: 512,
                num_requests: 60,
                request_rate: 40.0,
                seed,
                ..SimConfig::default()
            };
            cfg.validate().unwrap();
            let (c, router, leftovers) = finished_run(&cfg);
            prop_assert!(c.reqs.iter().all(|r| r.rejected || (r.finish >= r.first_token && r.first_token > r.arrival)));
            prop_assert!(leftovers.iter().all(|&l| l == (0, 0)), "{:?}", leftovers);
            prop_assert_eq!(router.in_flight_total(), 0);
            prop_assert_eq!(c.router_errors + c.inconsistent_inserts, 0);
            for (i, e) in c.engines.iter().enumerate() {
                prop_assert_eq!(router.cache_view(WorkerId::new(i as u64)), e.cache.len());
                if let Some(k) = kv {
                    prop_assert!(e.cache.len() <= k);
                }
            }
        }
    }
}
