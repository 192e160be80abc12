//! The discrete-event engine: arrivals, routing, continuous batching, KV events.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use kvblock::{BlockHash, BlockSize};
use kvcache::{BlockCache, KvEvent, WorkerId};
use kvroute::{RequestId, Role, Router};

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
        let workload = Workload::new(&self.cfg);
        let content = workload.describe();
        let mut run = Run::new(&self.cfg, self.timing.as_ref(), workload)?;
        run.simulate(progress);
        Ok(Report::build(&self.cfg, content, run.collect()))
    }
}

#[derive(Debug)]
enum Kind {
    Arrival,
    StepDone(usize),
    TransferDone(usize),
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

/// What an engine does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pool {
    /// Prefill and decode (the default fleet).
    Unified,
    /// Prefill only; the KV then moves to a decode engine.
    Prefill,
    /// Decode only, from KV that arrived from a prefill engine.
    Decode,
}

/// One request's life.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) arrival: u64,
    pub(crate) input: usize,
    pub(crate) output: usize,
    blocks: Vec<BlockHash>,
    pub(crate) prompt_blocks: usize,
    /// The engine that prefills it (unified or prefill pool).
    pub(crate) engine: usize,
    /// Leading prompt blocks resident on `engine` when it was scheduled (engine truth).
    pub(crate) hits: usize,
    /// The decode engine, when disaggregated.
    pub(crate) decode_engine: Option<usize>,
    /// Leading prompt blocks already on the decode engine when the transfer started.
    pub(crate) decode_hits: usize,
    router: usize,
    decode_router: usize,
    prefill_left: usize,
    /// Blocks the request occupies on the engine it is on now.
    mem_blocks: usize,
    decoding: bool,
    /// When the prefill engine scheduled it.
    pub(crate) scheduled: u64,
    pub(crate) transfer_us: u64,
    pub(crate) first_token: u64,
    pub(crate) finish: u64,
    pub(crate) rejected: bool,
}

#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) pool: Pool,
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
    fn new(pool: Pool, total: Option<usize>) -> Self {
        Engine {
            pool,
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

    fn fits(&self, blocks: usize) -> bool {
        self.total.is_none_or(|t| blocks <= t)
    }
}

/// Router replicas of one pool; engine events go to all of them.
struct Routers {
    replicas: Vec<Router>,
    next: usize,
    role: Role,
}

impl Routers {
    fn new(cfg: &SimConfig, role: Role, workers: std::ops::Range<usize>) -> Result<Self, Error> {
        let replicas = (0..cfg.routers)
            .map(|r| {
                let mut b = Router::builder()
                    .block_size(cfg.block_size)
                    .policy(cfg.routing)
                    .overlap_weight(cfg.overlap_weight)
                    .prefix_blocks(cfg.prefix_aware_blocks)
                    // Replica 0 uses the run's seed, so one replica is exactly the plain run.
                    .seed(
                        cfg.seed
                            .wrapping_add((r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    );
                if let Some(w) = cfg.prefill_overlap_weight {
                    b = b.prefill_overlap_weight(w);
                }
                if let Some(w) = cfg.decode_overlap_weight {
                    b = b.decode_overlap_weight(w);
                }
                let mut router = b.build()?;
                for w in workers.clone() {
                    router.add_worker(WorkerId::new(w as u64));
                }
                Ok(router)
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Routers {
            replicas,
            next: 0,
            role,
        })
    }

    /// Routes with the next replica in turn; returns (replica, engine).
    fn route(&mut self, id: usize, blocks: &[BlockHash]) -> Result<(usize, usize), kvroute::Error> {
        let r = self.next;
        self.next = (self.next + 1) % self.replicas.len();
        let d = self.replicas[r].route(RequestId::new(id as u64), blocks, self.role)?;
        Ok((r, d.worker.get() as usize))
    }
}

struct Run<'a> {
    cfg: &'a SimConfig,
    block_size: BlockSize,
    timing: &'a dyn TimingModel,
    /// Unified or prefill pool routers.
    routers: Routers,
    /// Decode pool routers, when disaggregated.
    decode_routers: Option<Routers>,
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
        workload: Workload,
    ) -> Result<Self, Error> {
        let (engines, routers, decode_routers) = match (cfg.prefill_instances, cfg.decode_instances)
        {
            (Some(p), Some(d)) => {
                let engines = (0..p)
                    .map(|_| Engine::new(Pool::Prefill, cfg.kv_blocks))
                    .chain((0..d).map(|_| Engine::new(Pool::Decode, cfg.kv_blocks)))
                    .collect();
                let prefill = Routers::new(cfg, Role::Prefill, 0..p)?;
                let decode = Routers::new(cfg, Role::Decode, p..p + d)?;
                (engines, prefill, Some(decode))
            }
            _ => {
                let engines = (0..cfg.instances)
                    .map(|_| Engine::new(Pool::Unified, cfg.kv_blocks))
                    .collect();
                (
                    engines,
                    Routers::new(cfg, Role::Unified, 0..cfg.instances)?,
                    None,
                )
            }
        };
        Ok(Run {
            cfg,
            block_size: cfg.block_size,
            timing,
            routers,
            decode_routers,
            workload,
            pending: None,
            queue: BinaryHeap::new(),
            seq: 0,
            reqs: Vec::with_capacity(cfg.request_count().min(1 << 20)),
            engines,
            itl: Vec::new(),
            router_errors: 0,
            inconsistent_inserts: 0,
            now: 0,
        })
    }

    fn push(&mut self, time: u64, kind: Kind) {
        self.seq += 1;
        let time = time.max(self.now);
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
                Kind::TransferDone(r) => self.transfer_done(r),
                Kind::Deliver(e, events) => self.deliver(e, &events),
            }
        }
    }

    fn arrive(&mut self) {
        let Some(spec) = self.pending.take() else {
            return;
        };
        let id = self.reqs.len();
        let (router, engine) = match self.routers.route(id, &spec.blocks) {
            Ok(x) => x,
            Err(_) => {
                self.router_errors += 1;
                (0, 0)
            }
        };
        let disaggregated = self.engines[engine].pool == Pool::Prefill;
        // A prefill engine holds only the prompt; otherwise the output's blocks too.
        let mem_tokens = if disaggregated {
            spec.input_len
        } else {
            spec.input_len + spec.output_len
        };
        let mem_blocks = self.block_size.blocks_for(mem_tokens);
        let rejected = !self.engines[engine].fits(mem_blocks);
        self.reqs.push(Req {
            arrival: self.now,
            input: spec.input_len,
            output: spec.output_len,
            prompt_blocks: spec.blocks.len(),
            blocks: spec.blocks,
            engine,
            hits: 0,
            decode_engine: None,
            decode_hits: 0,
            router,
            decode_router: 0,
            prefill_left: spec.input_len,
            mem_blocks,
            decoding: false,
            scheduled: 0,
            transfer_us: 0,
            first_token: 0,
            finish: 0,
            rejected,
        });
        if rejected {
            // It can never fit on this engine: count it and release the router's load.
            self.release_router(id, Pool::Unified);
            self.reqs[id].blocks = Vec::new();
        } else {
            self.enqueue(engine, id);
        }
        self.schedule_next_arrival();
    }

    fn enqueue(&mut self, e: usize, r: usize) {
        self.engines[e].waiting.push_back(r);
        if !self.engines[e].busy {
            self.start_step(e);
        }
    }

    /// Releases the request's load in the router that routed it on the given side.
    fn release_router(&mut self, r: usize, side: Pool) {
        let req = &self.reqs[r];
        let done = match (side, &mut self.decode_routers) {
            (Pool::Decode, Some(d)) => {
                d.replicas[req.decode_router].finish(RequestId::new(r as u64))
            }
            _ => self.routers.replicas[req.router].finish(RequestId::new(r as u64)),
        };
        if done.is_err() {
            self.router_errors += 1;
        }
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
        let pool = eng.pool;
        let req = &mut self.reqs[r];
        if pool == Pool::Decode {
            // The prompt's KV arrived by transfer: it becomes resident now and decoding starts.
            self.store_prompt(r, hits);
            self.start_decoding(r);
            return true;
        }
        // A full hit still computes the last prompt token, to produce the first output token.
        let cached_tokens = (hits * self.block_size.get()).min(req.input.saturating_sub(1));
        req.hits = hits;
        req.scheduled = self.now;
        req.prefill_left = req.input - cached_tokens;
        self.engines[e].prefilling.push_back(r);
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
        self.push(self.now.saturating_add(dur), Kind::StepDone(e));
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

    /// Makes the prompt's full blocks resident on the request's current engine and pins the
    /// ones that were not pinned at admission; the blocks reserved for them move into the cache.
    fn store_prompt(&mut self, r: usize, hits: usize) {
        let req = &self.reqs[r];
        let e = req.decode_engine.unwrap_or(req.engine);
        let eng = &mut self.engines[e];
        if eng.total.is_some() {
            eng.private -= req.prompt_blocks - hits;
            eng.resize_cache(0);
        }
        if eng.cache.insert(&req.blocks).is_err() {
            self.inconsistent_inserts += 1;
        }
        eng.cache.pin(&req.blocks[hits..]);
    }

    /// The prompt is computed and the first token produced.
    fn prefill_done(&mut self, r: usize, now: u64) {
        let hits = self.reqs[r].hits;
        self.store_prompt(r, hits);
        let e = self.reqs[r].engine;
        if self.engines[e].pool == Pool::Prefill {
            self.hand_over(r, now);
            return;
        }
        self.reqs[r].first_token = now;
        if self.reqs[r].output <= 1 {
            self.finish(r, now);
        } else {
            self.start_decoding(r);
        }
    }

    fn start_decoding(&mut self, r: usize) {
        let req = &mut self.reqs[r];
        if req.output <= 1 {
            req.first_token = self.now;
            self.finish(r, self.now);
            return;
        }
        req.decoding = true;
        if req.decode_engine.is_some() {
            req.first_token = self.now;
        }
        let (input, output) = (req.input, req.output);
        let eng = &mut self.engines[req.decode_engine.unwrap_or(req.engine)];
        eng.decoding += 1;
        eng.context += (input + 1) as u64;
        eng.finishing
            .push(Reverse((eng.steps + (output as u64 - 1), r)));
    }

    /// Disaggregated: the prefill engine lets go of the request, a decode engine is routed with
    /// the decode role's weight, and the KV it lacks is sent over.
    fn hand_over(&mut self, r: usize, now: u64) {
        let req = &self.reqs[r];
        let eng = &mut self.engines[req.engine];
        eng.cache.unpin(&req.blocks);
        if eng.total.is_some() {
            eng.private -= req.mem_blocks - req.prompt_blocks;
            eng.resize_cache(0);
        }
        self.release_router(r, Pool::Prefill);
        let Some(decode) = self.decode_routers.as_mut() else {
            return;
        };
        let (router, d) = match decode.route(r, &self.reqs[r].blocks) {
            Ok(x) => x,
            Err(_) => {
                self.router_errors += 1;
                return;
            }
        };
        let bs = self.block_size.get();
        let req = &mut self.reqs[r];
        req.decode_router = router;
        req.decode_engine = Some(d);
        req.decode_hits = self.engines[d].cache.match_len(&req.blocks);
        let sent_tokens = req.input - (req.decode_hits * bs).min(req.input);
        let bits = sent_tokens as f64 * self.cfg.kv_bytes_per_token as f64 * 8.0;
        let transfer = (bits / (self.cfg.pd_transfer_gbps * 1e3)).round() as u64
            + self.cfg.pd_transfer_latency_us;
        req.transfer_us = transfer;
        req.mem_blocks = self.block_size.blocks_for(req.input + req.output);
        self.push(now.saturating_add(transfer), Kind::TransferDone(r));
    }

    fn transfer_done(&mut self, r: usize) {
        let Some(d) = self.reqs[r].decode_engine else {
            return;
        };
        if self.engines[d].fits(self.reqs[r].mem_blocks) {
            self.enqueue(d, r);
        } else {
            self.reqs[r].rejected = true;
            self.reqs[r].blocks = Vec::new();
            self.release_router(r, Pool::Decode);
        }
    }

    fn finish(&mut self, r: usize, now: u64) {
        let req = &mut self.reqs[r];
        req.finish = now;
        let eng = &mut self.engines[req.decode_engine.unwrap_or(req.engine)];
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
        let side = eng.pool;
        self.release_router(r, side);
    }

    fn flush_events(&mut self, e: usize) {
        if self.engines[e].cache.pending_events() == 0 {
            return;
        }
        let events: Vec<KvEvent> = self.engines[e].cache.drain_events().collect();
        if self.cfg.event_delay_us == 0 {
            self.deliver(e, &events);
        } else {
            self.push(
                self.now.saturating_add(self.cfg.event_delay_us),
                Kind::Deliver(e, events),
            );
        }
    }

    /// Applies an engine's events to every router replica of its pool, with the same ids.
    fn deliver(&mut self, e: usize, events: &[KvEvent]) {
        let routers = match (self.engines[e].pool, &mut self.decode_routers) {
            (Pool::Decode, Some(d)) => d,
            _ => &mut self.routers,
        };
        let first = self.engines[e].next_event_id;
        for router in &mut routers.replicas {
            for (k, ev) in events.iter().enumerate() {
                if router
                    .apply_event(WorkerId::new(e as u64), first + k as u64, ev)
                    .is_err()
                {
                    self.router_errors += 1;
                }
            }
        }
        self.engines[e].next_event_id += events.len() as u64;
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

    fn finished_run(cfg: &SimConfig) -> (Collected, Vec<Router>, Vec<(usize, usize)>) {
        let timing = LinearTiming::default();
        let mut run = Run::new(cfg, &timing, Workload::new(cfg)).unwrap();
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
        let routers = run.routers.replicas.clone();
        let decode = run
            .decode_routers
            .as_ref()
            .map(|d| d.replicas.clone())
            .unwrap_or_default();
        (
            run.collect(),
            routers.into_iter().chain(decode).collect(),
            leftovers,
        )
    }

    /// Requests with equal timestamps arrive in file order (the conversation trace has only
    /// 1,180 distinct timestamps for 12,031 requests).
    #[test]
    fn equal_timestamps_keep_file_order() {
        let lines: Vec<String> = (0..6)
            .map(|i| {
                format!(
                    r#"{{"timestamp": {}, "input_length": {}, "output_length": 2, "hash_ids": [{i}]}}"#,
                    if i < 3 { 0 } else { 7 },
                    100 + i
                )
            })
            .collect();
        let trace =
            crate::Trace::parse("t", &lines.join("\n"), BlockSize::new(64).unwrap()).unwrap();
        let cfg = SimConfig {
            instances: 3,
            routing: Policy::RoundRobin,
            ..SimConfig::default().with_trace(trace)
        };
        let (c, _, _) = finished_run(&cfg);
        let order: Vec<(usize, usize, u64)> = c
            .reqs
            .iter()
            .map(|r| (r.input, r.engine, r.arrival))
            .collect();
        assert_eq!(
            order,
            vec![
                (100, 0, 0),
                (101, 1, 0),
                (102, 2, 0),
                (103, 0, 7000),
                (104, 1, 7000),
                (105, 2, 7000)
            ]
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever the settings: every request completes or is rejected, nothing stays pinned
        /// or reserved, every router replica ends with no load, and its view of each engine of
        /// its pool equals that engine's cache.
        #[test]
        fn runs_end_clean(instances in 1usize..5, pd in prop::option::of((1usize..3, 1usize..3)), routers in 1usize..4,
                          kv in prop::option::of(4usize..60), bs in prop::sample::select(vec![16usize, 64, 256]),
                          policy in prop::sample::select(Policy::ALL.to_vec()), delay in prop::sample::select(vec![0u64, 5_000]),
                          input in 1usize..3000, output in 1usize..40, seqs in 1usize..8, seed in 0u64..1000) {
            let cfg = SimConfig {
                instances,
                prefill_instances: pd.map(|p| p.0),
                decode_instances: pd.map(|p| p.1),
                decode_overlap_weight: Some(0.5),
                routers,
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
            let (c, routers, leftovers) = finished_run(&cfg);
            prop_assert!(c.reqs.iter().all(|r| r.rejected || (r.finish >= r.first_token && r.first_token > r.arrival)));
            prop_assert!(leftovers.iter().all(|&l| l == (0, 0)), "{:?}", leftovers);
            prop_assert_eq!(c.router_errors + c.inconsistent_inserts, 0);
            for router in &routers {
                prop_assert_eq!(router.in_flight_total(), 0);
                for w in router.workers() {
                    prop_assert_eq!(router.cache_view(w), c.engines[w.get() as usize].cache.len());
                }
            }
            let pools: usize = routers.iter().map(|r| r.workers().len()).sum();
            prop_assert_eq!(pools, c.engines.len() * cfg.routers);
            for e in &c.engines {
                if let Some(k) = kv {
                    prop_assert!(e.cache.len() <= k);
                }
            }
        }
    }
}
