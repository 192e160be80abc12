//! The discrete-event loop: arrivals, routing, engine steps and transfers in simulated time,
//! and the delivery of the engines' KV events to the routers.

use std::collections::BinaryHeap;
use std::sync::Arc;

use kvblock::BlockHash;
use kvcache::{KvEvent, Tier};

use crate::config::{PdLink, SimConfig};
use crate::engine::{Engine, EngineRequest, Outcome, PlannedStep, Pool};
use crate::engine_loop::EngineLoop;
use crate::error::Error;
use crate::fleet::{Fleet, Routers, Stay};
use crate::records::{EngineRecord, MeasuredRequest, Records, RequestRecord, SessionCounts};
use crate::report::Report;
use crate::timing::{TimingKind, TimingModel};
use crate::workload::{closed_plan, RequestSpec, Turn, Workload};

mod closed;
mod skip;
mod transfer;

use closed::Closed;
use skip::{Chain, MAX_CHAIN};
use transfer::Link;

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
    /// Validates `cfg` and prepares a run with its timing model (`cfg.timing_kind`).
    pub fn new(cfg: SimConfig) -> Result<Self, Error> {
        cfg.validate()?;
        let timing: Arc<dyn TimingModel> = match cfg.timing_kind {
            TimingKind::Polynomial => Arc::new(cfg.polynomial_timing()),
            _ => Arc::new(cfg.timing),
        };
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
        let (content, records) = self.records(progress)?;
        Ok(Report::build(&self.cfg, content, records))
    }

    /// [`run`](Self::run), and every request as it was simulated, in arrival order: its
    /// instance, cached tokens, first-token and finish times and preemptions (the records
    /// `kvsim --requests-out` writes, see [`record_line`](crate::record_line)). A rejected
    /// request is a failed one.
    ///
    /// ```
    /// let mut cfg = kvsim::SimConfig::default();
    /// cfg.num_requests = 20;
    /// let (report, reqs) = kvsim::Simulation::new(cfg)?.run_requests()?;
    /// assert_eq!(reqs.len(), 20);
    /// let ttft_ms = reqs.iter().map(|r| r.ttft_us() as f64).sum::<f64>() / 20.0 / 1e3;
    /// assert!((ttft_ms - report.ttft_ms.mean).abs() < 1e-6);
    /// # Ok::<(), kvsim::Error>(())
    /// ```
    pub fn run_requests(&self) -> Result<(Report, Vec<MeasuredRequest>), Error> {
        let (content, records) = self.records(&mut |_| {})?;
        let bs = self.cfg.block_size.get();
        let reqs = records
            .requests
            .iter()
            .map(|r| {
                let cached = ((r.hits + r.host_hits) * bs).min(r.input);
                let mut m = if r.rejected {
                    MeasuredRequest::failed(r.arrival, r.input)
                } else {
                    MeasuredRequest::new(
                        r.arrival,
                        r.input,
                        r.output,
                        cached,
                        r.first_token,
                        r.finish,
                    )
                };
                m.instance = (!r.rejected).then_some(r.engine);
                m.preemptions = Some(r.preemptions);
                m
            })
            .collect();
        Ok((Report::build(&self.cfg, content, records), reqs))
    }

    /// Runs to the end: the report's description of the content and what it is built from.
    fn records(&self, progress: &mut dyn FnMut(usize)) -> Result<(String, Records), Error> {
        let workload = Workload::new(&self.cfg);
        let content = workload.describe_run(&self.cfg);
        let mut run = Run::new(&self.cfg, &self.timing, workload, true)?;
        run.simulate(progress);
        if run.ambiguous {
            // Skipping quiet steps met a tie it cannot order the way the step-by-step loop
            // does (very rare): run again step by step.
            let mut run = Run::new(&self.cfg, &self.timing, Workload::new(&self.cfg), false)?;
            run.simulate(progress);
            return Ok((content, run.collect()));
        }
        Ok((content, run.collect()))
    }
}

/// ITL durations below this are counted in a dense table, the rest in a sorted map.
const DENSE_ITL_US: u64 = 1 << 20;

#[derive(Debug)]
enum Kind {
    Arrival,
    /// The end of engine `.0`'s step in progress; stale unless `.1` is the engine's generation
    /// (a later push replaced it).
    StepDone(usize, u32),
    TransferDone(usize),
    Deliver(usize, Tier, Vec<KvEvent>),
    /// Closed loop: turn `.0` of the plan may be sent (its session's previous turn is done
    /// and its think time over): now if a slot is free, else when one frees up.
    Ready(usize),
    /// Closed loop: turn `.0`, which holds a slot already, is sent.
    Send(usize),
    /// Router replicas of the pool (decode pool when `.0`) receive replica `.1`'s load deltas.
    Sync(bool, usize, Vec<kvroute::LoadDelta>),
    /// Shared links: the next transfer on prefill engine `.0`'s link completes; stale
    /// unless `.1` is the link's generation.
    LinkDone(usize, u32),
}

/// A queued event. Same-time events run in the order the step-by-step loop (one `StepDone`
/// per step) would have pushed them: by the time of that push (`vpush`), then by insertion
/// order. Without skipped steps `vpush` is the time of the push and the order is plain
/// insertion order; an event pushed `ahead` (the end of a step after skipped quiet steps) has
/// the time its skipped parent step ended.
#[derive(Debug)]
struct Event {
    time: u64,
    vpush: u64,
    seq: u64,
    /// The `vpush` of the event whose handling pushed it (for the skipped parent step of an
    /// `ahead` event: the start of that step). Orders two same-`vpush` pushes when one is ahead.
    ppush: u64,
    /// Pushed ahead of its parent, the `pos`-th skipped step of its engine's chain.
    ahead: bool,
    pos: usize,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        (self.time, self.vpush, self.seq) == (o.time, o.vpush, o.seq)
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
        // Min-heap on (time, push time, insertion order): same-time events run in the order
        // they were made.
        (o.time, o.vpush, o.seq).cmp(&(self.time, self.vpush, self.seq))
    }
}

/// One request's life, as the loop follows it across engines and routers.
#[derive(Debug, Clone)]
struct Req {
    rec: RequestRecord,
    /// The router replica that routed it to its first engine.
    router: usize,
    /// The decode router replica, when disaggregated.
    decode_router: usize,
    /// Its prompt blocks while its KV travels to the decode engine.
    in_transit: Vec<BlockHash>,
    /// Its session, if any.
    session: Option<u64>,
}

/// ITL samples by weight: tokens produced by decoding requests, per step duration.
#[derive(Debug, Default)]
struct ItlHistogram {
    dense: Vec<u64>,
    sparse: std::collections::BTreeMap<u64, u64>,
}

impl ItlHistogram {
    #[inline]
    fn add(&mut self, duration_us: u64, tokens: u64) {
        if duration_us < DENSE_ITL_US {
            let d = duration_us as usize;
            if d >= self.dense.len() {
                self.dense.resize(d + 1, 0);
            }
            self.dense[d] += tokens;
        } else {
            *self.sparse.entry(duration_us).or_insert(0) += tokens;
        }
    }

    /// (duration, weight) pairs by increasing duration.
    fn into_samples(self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = self
            .dense
            .iter()
            .enumerate()
            .filter(|&(_, &w)| w > 0)
            .map(|(d, &w)| (d as u64, w))
            .collect();
        out.extend(self.sparse);
        out
    }
}

struct Run<'a> {
    cfg: &'a SimConfig,
    fleet: Fleet,
    workload: Workload,
    pending: Option<RequestSpec>,
    queue: BinaryHeap<Event>,
    seq: u64,
    reqs: Vec<Req>,
    itl: ItlHistogram,
    router_errors: u64,
    /// With session affinity on: how later turns were routed.
    sessions: SessionCounts,
    outcomes: Vec<Outcome>,
    /// Engine events on their way to the routers without delay, reused.
    events: Vec<KvEvent>,
    now: u64,
    /// The `vpush`, `seq` and `ppush` of the event being handled.
    cur_vpush: u64,
    cur_seq: u64,
    cur_ppush: u64,
    /// Skip quiet steps (false: one `StepDone` per step, the reference loop).
    fast: bool,
    /// A tie the fast loop cannot order was met: the run must be redone with `fast` off.
    ambiguous: bool,
    /// Per engine: generation of its queued `StepDone`, and its skipped quiet steps.
    gens: Vec<u32>,
    chains: Vec<Chain>,
    /// `ahead` events in the queue (stale ones included).
    ahead_queued: usize,
    /// The closed-loop plan (`None`: requests arrive at their times).
    closed: Option<Closed>,
    /// Per engine, its outgoing KV link when transfers share it.
    links: Vec<Link>,
    /// Every delivery of KV events to the routers: (time, engine, tier, events), for the
    /// property tests to compare the routers' view of the caches.
    #[cfg(test)]
    delivered: Vec<(u64, usize, Tier, usize)>,
}

impl<'a> Run<'a> {
    fn new(
        cfg: &'a SimConfig,
        timing: &Arc<dyn TimingModel>,
        workload: Workload,
        fast: bool,
    ) -> Result<Self, Error> {
        let fleet = Fleet::new(cfg, timing)?;
        let n = fleet.engines.len();
        Ok(Run {
            cfg,
            fleet,
            workload,
            pending: None,
            queue: BinaryHeap::new(),
            seq: 0,
            reqs: Vec::with_capacity(cfg.request_count().min(1 << 20)),
            itl: ItlHistogram::default(),
            router_errors: 0,
            sessions: SessionCounts::default(),
            outcomes: Vec::new(),
            events: Vec::new(),
            now: 0,
            cur_vpush: 0,
            cur_seq: 0,
            cur_ppush: 0,
            fast,
            ambiguous: false,
            gens: vec![0; n],
            chains: (0..n).map(|_| Chain::default()).collect(),
            ahead_queued: 0,
            closed: Closed::new(cfg),
            links: (0..n).map(|_| Link::default()).collect(),
            #[cfg(test)]
            delivered: Vec::new(),
        })
    }

    fn push(&mut self, time: u64, kind: Kind) {
        self.seq += 1;
        let ev = Event {
            time: time.max(self.now),
            vpush: self.now,
            seq: self.seq,
            ppush: self.cur_vpush,
            ahead: false,
            pos: 0,
            kind,
        };
        self.push_event(ev);
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
        if self.closed.is_some() {
            self.schedule_next_root();
        } else {
            self.schedule_next_arrival();
        }
        while let Some(ev) = self.queue.pop() {
            if ev.ahead {
                self.ahead_queued -= 1;
            }
            if self.is_stale(&ev) {
                continue;
            }
            self.now = ev.time;
            self.cur_vpush = ev.vpush;
            self.cur_seq = ev.seq;
            self.cur_ppush = ev.ppush;
            match ev.kind {
                Kind::Arrival => {
                    self.arrive();
                    if self.reqs.len() % every == 0 {
                        progress(self.reqs.len());
                    }
                }
                Kind::StepDone(e, _) => {
                    if self.chains[e].active {
                        let n = self.chains[e].ends.len() as u64;
                        self.commit(e, n);
                    }
                    self.end_step(e);
                }
                Kind::TransferDone(r) => self.transfer_done(r),
                Kind::Deliver(e, tier, events) => self.deliver(e, tier, &events),
                Kind::Ready(j) => {
                    self.ready(j);
                    if self.reqs.len() % every == 0 {
                        progress(self.reqs.len());
                    }
                }
                Kind::Send(j) => self.send_turn(j),
                Kind::LinkDone(e, g) => self.link_done(e, g),
                Kind::Sync(decode, from, deltas) => {
                    let side = if decode { Pool::Decode } else { Pool::Unified };
                    let now = self.now;
                    self.fleet.routers_of(side).apply_deltas(from, &deltas, now);
                }
            }
            if self.ambiguous {
                return;
            }
        }
    }

    fn arrive(&mut self) {
        let Some(spec) = self.pending.take() else {
            return;
        };
        self.send(spec, 1, None);
        self.schedule_next_arrival();
    }

    /// Routes a request (turn `turn` of `session`, if any) to an engine and submits it there
    /// (or counts it rejected).
    fn send(&mut self, spec: RequestSpec, turn: u32, session: Option<u64>) {
        let id = self.reqs.len();
        let (router, engine, stay) = match self.fleet.route(id, &spec.blocks, self.now, session) {
            Ok(x) => x,
            Err(_) => {
                // Hard session affinity cannot fail here (simulated engines are always
                // routable), but a failed route is counted, never a panic.
                self.router_errors += 1;
                (0, 0, Stay::Alone)
            }
        };
        if turn > 1 {
            let c = &mut self.sessions;
            match stay {
                Stay::Alone => {}
                Stay::New => c.new += 1,
                Stay::Kept => c.kept += 1,
                Stay::Moved => c.moved += 1,
            }
        }
        self.share_load(Pool::Unified, router);
        self.reqs.push(Req {
            rec: RequestRecord {
                arrival: self.now,
                input: spec.input_len,
                output: spec.output_len,
                prompt_blocks: spec.blocks.len(),
                engine,
                hits: 0,
                decode_engine: None,
                decode_hits: 0,
                host_hits: 0,
                scheduled: 0,
                transfer_us: 0,
                first_token: 0,
                finish: 0,
                rejected: false,
                turn,
                preemptions: 0,
            },
            router,
            decode_router: 0,
            in_transit: Vec::new(),
            session,
        });
        let req = EngineRequest::new(id as u64, spec.blocks, spec.input_len, spec.output_len);
        self.interrupt(engine);
        if !self.submit(engine, req) {
            // It can never fit on this engine: count it and release the router's load.
            self.reqs[id].rec.rejected = true;
            self.release_router(id, Pool::Unified);
            self.request_done(id);
        }
    }

    /// Tells the router that routed the request on the given side that its first token came.
    fn prefill_done(&mut self, r: usize, side: Pool) {
        self.with_router(r, side, Routers::prefill_done);
    }

    /// Releases the request's load in the router that routed it on the given side.
    fn release_router(&mut self, r: usize, side: Pool) {
        self.with_router(r, side, Routers::finish);
    }

    /// Calls `f` with the routers of the given side, the replica that routed request `r` there,
    /// and `r`; counts a failure.
    fn with_router(
        &mut self,
        r: usize,
        side: Pool,
        f: fn(&mut Routers, usize, usize) -> Result<(), kvroute::Error>,
    ) {
        let req = &self.reqs[r];
        let (replica, done) = match (side, &mut self.fleet.decode_routers) {
            (Pool::Decode, Some(d)) => (req.decode_router, f(d, req.decode_router, r)),
            _ => (req.router, f(&mut self.fleet.routers, req.router, r)),
        };
        if done.is_err() {
            self.router_errors += 1;
        }
        self.share_load(side, replica);
    }

    /// With router sync: sends what replica `replica` of `side`'s pool queued to the others,
    /// after the sync delay.
    fn share_load(&mut self, side: Pool, replica: usize) {
        if !self.cfg.router_sync || self.cfg.routers < 2 {
            return;
        }
        let deltas = self.fleet.routers_of(side).take_deltas(replica);
        if deltas.is_empty() {
            return;
        }
        if self.cfg.sync_delay_us == 0 {
            let now = self.now;
            self.fleet
                .routers_of(side)
                .apply_deltas(replica, &deltas, now);
        } else {
            let decode = side == Pool::Decode && self.fleet.decode_routers.is_some();
            self.push(
                self.now.saturating_add(self.cfg.sync_delay_us),
                Kind::Sync(decode, replica, deltas),
            );
        }
    }

    /// Queues the end of engine `e`'s step in progress, at `end`; or, when it and the steps
    /// after it are quiet, the end of the first step after them (the quiet ones are skipped,
    /// to be run for real when that end comes or something is submitted to the engine).
    fn schedule_step(&mut self, e: usize, end: u64) {
        self.gens[e] = self.gens[e].wrapping_add(1);
        let kind = Kind::StepDone(e, self.gens[e]);
        let engine = &self.fleet.engines[e];
        // KV events that planning this step queued (incremental allocation: a decode block
        // taken by evicting cached ones) go out when it ends, which must then be handled.
        let q = if self.fast && engine.pending_events() == 0 && engine.pending_host_events() == 0 {
            engine.quiet_steps().min(MAX_CHAIN)
        } else {
            0
        };
        if q == 0 {
            self.push(end, kind);
            return;
        }
        let chain = &mut self.chains[e];
        chain.active = true;
        chain.t0 = self.now;
        chain.ends.clear();
        chain.ends.push(end);
        let mut t = end;
        let durations = self.fleet.engines[e].quiet_durations(q as usize);
        // The ends of the skipped steps after the first, then that of the one queued.
        let (skipped, queued) = durations.split_at(durations.len().saturating_sub(1));
        chain.ends.extend(skipped.iter().map(|&d| {
            t = t.saturating_add(d);
            t
        }));
        let last = t.saturating_add(queued.first().copied().unwrap_or(0));
        self.seq += 1;
        chain.seq0 = self.seq;
        chain.ppush0 = self.cur_vpush;
        let l = chain.ends.len();
        let ev = Event {
            time: last,
            vpush: chain.ends[l - 1],
            seq: self.seq,
            ppush: chain.start(l - 1),
            ahead: true,
            pos: l - 1,
            kind,
        };
        self.push_event(ev);
    }

    /// Stamps what engine `e` reports with the current time and moves requests on.
    fn handle_outcomes(&mut self, e: usize) {
        let mut out = std::mem::take(&mut self.outcomes);
        self.fleet.engines[e].take_outcomes(&mut out);
        let pool = self.fleet.engines[e].config().pool;
        let now = self.now;
        for o in out.drain(..) {
            match o {
                // A decode engine's hits are counted when the transfer starts.
                Outcome::Admitted { id, cached_blocks } if pool != Pool::Decode => {
                    let rec = &mut self.reqs[id as usize].rec;
                    rec.hits = cached_blocks;
                    rec.scheduled = now;
                }
                Outcome::HostLoaded { id, blocks } => self.reqs[id as usize].rec.host_hits = blocks,
                Outcome::FirstToken { id } => {
                    self.reqs[id as usize].rec.first_token = now;
                    if self.cfg.tracks_prefill() {
                        self.prefill_done(id as usize, pool);
                    }
                }
                Outcome::PrefillDone { id, blocks } => self.hand_over(id as usize, blocks),
                Outcome::Preempted { id } => self.reqs[id as usize].rec.preemptions += 1,
                Outcome::Finished { id } => {
                    self.reqs[id as usize].rec.finish = now;
                    self.release_router(id as usize, pool);
                    self.request_done(id as usize);
                }
                _ => {}
            }
        }
        self.outcomes = out;
    }

    fn flush_events(&mut self, e: usize) {
        self.flush_tier(e, Tier::Device);
        if self.fleet.engines[e].pending_host_events() > 0 {
            self.flush_tier(e, Tier::Host);
        }
    }

    /// Delivers engine `e`'s queued events of `tier`, now or after the event delay.
    fn flush_tier(&mut self, e: usize, tier: Tier) {
        let engine = &mut self.fleet.engines[e];
        let pending = match tier {
            Tier::Device => engine.pending_events(),
            _ => engine.pending_host_events(),
        };
        if pending == 0 {
            return;
        }
        let mut events = if self.cfg.event_delay_us == 0 {
            std::mem::take(&mut self.events)
        } else {
            Vec::with_capacity(pending)
        };
        match tier {
            Tier::Device => events.extend(engine.drain_events()),
            _ => events.extend(engine.drain_host_events()),
        }
        if self.cfg.event_delay_us == 0 {
            self.deliver(e, tier, &events);
            events.clear();
            self.events = events;
        } else {
            self.push(
                self.now.saturating_add(self.cfg.event_delay_us),
                Kind::Deliver(e, tier, events),
            );
        }
    }

    /// Applies an engine's events of `tier` to every router replica of its pool, with the same
    /// ids.
    fn deliver(&mut self, e: usize, tier: Tier, events: &[KvEvent]) {
        #[cfg(test)]
        self.delivered.push((self.now, e, tier, events.len()));
        let pool = self.fleet.engines[e].config().pool;
        // The worker's stream: several ranks' events share it when the routers see engines.
        let w = self.fleet.worker_of(e);
        let next = match tier {
            Tier::Device => &mut self.fleet.next_event_id[w],
            _ => &mut self.fleet.next_host_event_id[w],
        };
        let first = *next;
        *next += events.len() as u64;
        self.router_errors += self.fleet.routers_of(pool).deliver(w, tier, first, events);
    }

    fn collect(self) -> Records {
        let engines = &self.fleet.engines;
        Records {
            engines: engines
                .iter()
                .map(|e| EngineRecord {
                    pool: e.config().pool,
                    evictions: e.cache().stats().evictions,
                    resident_blocks: e.cache().len(),
                    host_blocks: e.cache().host_tier().map_or(0, |(_, n)| n),
                    busy_us: e.busy_us(),
                    preemptions: e.preemptions(),
                    recomputed_tokens: e.recomputed_tokens(),
                })
                .collect(),
            inconsistent_inserts: engines.iter().map(|e| e.inconsistent_inserts()).sum(),
            requests: self.reqs.into_iter().map(|r| r.rec).collect(),
            itl: self.itl.into_samples(),
            router_errors: self.router_errors,
            sessions: self.cfg.session_routing().then_some(self.sessions),
        }
    }
}

/// The simulator drives every engine through the one engine loop; the event queue is the clock.
impl EngineLoop for Run<'_> {
    fn engine_mut(&mut self, e: usize) -> &mut Engine {
        &mut self.fleet.engines[e]
    }

    fn on_outcomes(&mut self, e: usize) {
        self.handle_outcomes(e);
    }

    fn on_events(&mut self, e: usize) {
        self.flush_events(e);
    }

    fn on_step_planned(&mut self, e: usize, step: PlannedStep) {
        if step.shape.decode_requests > 0 {
            self.itl.add(step.duration_us, step.shape.decode_requests);
        }
        self.schedule_step(e, self.now.saturating_add(step.duration_us));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ArrivalModel, PdLink};
    use crate::engine::KvAllocation;
    use crate::timing::LinearTiming;
    use kvblock::BlockSize;
    use kvroute::Policy;
    use proptest::prelude::*;

    /// A whole run with the default timing, as `Simulation::run` makes it: a fast run that met
    /// a tie it cannot order stops early and is redone step by step.
    fn settled_run(cfg: &SimConfig) -> Run<'_> {
        let timing: Arc<dyn TimingModel> = Arc::new(LinearTiming::default());
        let mut run = Run::new(cfg, &timing, Workload::new(cfg), true).unwrap();
        run.simulate(&mut |_| {});
        if run.ambiguous {
            run = Run::new(cfg, &timing, Workload::new(cfg), false).unwrap();
            run.simulate(&mut |_| {});
        }
        run
    }

    fn finished_run(cfg: &SimConfig) -> (Records, Vec<kvroute::Router>, Vec<(usize, usize)>) {
        let run = settled_run(cfg);
        let leftovers = run
            .fleet
            .engines
            .iter()
            .map(|e| (e.reserved_blocks(), e.cache().pinned_blocks()))
            .collect();
        for e in &run.fleet.engines {
            e.check_invariants().unwrap();
            assert!(e.is_idle() && !e.is_busy());
        }
        let routers = run.fleet.routers.replicas.clone();
        let decode = run
            .fleet
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
            .requests
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

    /// The routing model's options, each off half the time.
    #[derive(Debug, Clone, Copy)]
    struct RoutingModel {
        cost_model: kvroute::CostModel,
        temperature: f64,
        busy: Option<(f64, usize)>,
        predicted_ttl_us: u64,
        /// Router sync and its delay.
        sync: Option<u64>,
    }

    impl RoutingModel {
        /// The default configuration with these options (the decode limit only with a capacity).
        fn apply(self, kv: Option<usize>) -> SimConfig {
            SimConfig {
                cost_model: self.cost_model,
                router_temperature: self.temperature,
                busy_decode_fraction: self.busy.filter(|_| kv.is_some()).map(|b| b.0),
                busy_prefill_tokens: self.busy.map(|b| b.1),
                predicted_ttl_us: self.predicted_ttl_us,
                router_sync: self.sync.is_some(),
                sync_delay_us: self.sync.unwrap_or(0),
                ..SimConfig::default()
            }
        }
    }

    /// The records of a closed-loop run and the plan index of each request id.
    fn closed_run(cfg: &SimConfig) -> (Records, Vec<Turn>, Vec<usize>) {
        let run = settled_run(cfg);
        let plan = closed_plan(cfg).unwrap();
        let turn_of = run.closed.as_ref().unwrap().turn_of.clone();
        (run.collect(), plan, turn_of)
    }

    /// The most requests in flight at once (arrival to finish, a finish before an arrival at
    /// the same microsecond).
    fn max_in_flight(c: &Records) -> usize {
        let mut ev: Vec<(u64, i32)> = c
            .requests
            .iter()
            .flat_map(|r| {
                [
                    (r.arrival, 1),
                    (if r.rejected { r.arrival } else { r.finish }, -1),
                ]
            })
            .collect();
        ev.sort_unstable();
        let (mut now, mut max) = (0i32, 0i32);
        for (_, d) in ev {
            now += d;
            max = max.max(now);
        }
        max as usize
    }

    /// A turn is sent no earlier than its session's previous turn finished plus the think
    /// time, and exactly then when no concurrency limit holds it back; at most `concurrency`
    /// requests are in flight, and with a limit of 1 each request starts when the one before
    /// finished.
    #[test]
    fn closed_loops_respect_turn_order_think_time_and_concurrency() {
        for concurrency in [None, Some(1), Some(3)] {
            let cfg = SimConfig {
                sessions: Some(12),
                turns: 4,
                think_us: 250_000,
                concurrency,
                input_len: 600,
                prefix_len: 200,
                output_len: 20,
                request_rate: 5.0,
                kv_blocks: Some(400),
                ..SimConfig::default()
            };
            cfg.validate().unwrap();
            let (c, plan, turn_of) = closed_run(&cfg);
            assert_eq!(c.requests.len(), 48);
            let id_of: std::collections::BTreeMap<usize, usize> =
                turn_of.iter().enumerate().map(|(id, &j)| (j, id)).collect();
            for (id, r) in c.requests.iter().enumerate() {
                let t = &plan[turn_of[id]];
                assert_eq!(r.turn, t.turn);
                assert_eq!(r.input, t.spec.input_len);
                assert!(!r.rejected && r.finish > r.arrival);
                match t.prev {
                    Some(p) => {
                        let prev = &c.requests[id_of[&p]];
                        let earliest = prev.finish + cfg.think_us;
                        assert!(
                            r.arrival >= earliest,
                            "turn {} sent before its think time",
                            t.turn
                        );
                        if concurrency.is_none() {
                            assert_eq!(r.arrival, earliest);
                        }
                    }
                    None if concurrency.is_none() => assert_eq!(r.arrival, t.spec.arrival_us),
                    None => {}
                }
            }
            let most = max_in_flight(&c);
            match concurrency {
                Some(n) => assert_eq!(most, n),
                None => assert!(most > 3, "{most}"),
            }
            if concurrency == Some(1) {
                for w in c.requests.windows(2) {
                    assert!(w[1].arrival >= w[0].finish);
                }
            }
        }
    }

    fn routing_model() -> impl Strategy<Value = RoutingModel> {
        (
            prop::sample::select(kvroute::CostModel::ALL.to_vec()),
            prop::sample::select(vec![0.0f64, 0.5, 2.0]),
            prop::option::of((prop::sample::select(vec![0.25f64, 0.8]), 0usize..2000)),
            prop::sample::select(vec![0u64, 3_000, 50_000]),
            prop::option::of(prop::sample::select(vec![0u64, 1, 2_000])),
        )
            .prop_map(|(cost_model, temperature, busy, predicted_ttl_us, sync)| {
                RoutingModel {
                    cost_model,
                    temperature,
                    busy,
                    predicted_ttl_us,
                    sync,
                }
            })
    }

    /// A turn's prompt is the previous prompt, its answer and new text: its blocks extend the
    /// previous turn's, and its length grows by output + new tokens.
    #[test]
    fn synthetic_session_prompts_grow_as_in_a_chat() {
        let cfg = SimConfig {
            sessions: Some(5),
            turns: 6,
            input_len: 300,
            prefix_len: 100,
            output_len: 37,
            block_size: BlockSize::new(16).unwrap(),
            ..SimConfig::default()
        };
        let plan = closed_plan(&cfg).unwrap();
        assert_eq!(plan.len(), 30);
        for (j, t) in plan.iter().enumerate() {
            assert_eq!(t.turn as usize, j % 6 + 1);
            match t.prev {
                Some(p) => {
                    let prev = &plan[p];
                    assert_eq!(p, j - 1);
                    assert_eq!(t.spec.input_len, prev.spec.input_len + 37 + 200);
                    assert!(t.spec.blocks.starts_with(&prev.spec.blocks));
                    assert_eq!(t.think_us, cfg.think_us);
                }
                None => assert_eq!(t.spec.input_len, 300),
            }
            assert_eq!(t.spec.blocks.len(), t.spec.input_len / 16);
        }
        // Sessions differ after their shared prefix (6 full blocks of 100 tokens' pool).
        assert_ne!(plan[0].spec.blocks[6], plan[6].spec.blocks[6]);
    }

    /// The proptests' workload shapes: KV allocation reserved or incremental (and then, for
    /// every other seed, vLLM's scheduling rules); open loop, a fixed concurrency, chat
    /// sessions, or both (`mode` 0 to 3).
    fn with_loop_mode(cfg: &mut SimConfig, incremental: bool, mode: u8, seed: u64) {
        cfg.kv_allocation = if incremental {
            KvAllocation::Incremental
        } else {
            KvAllocation::Reserve
        };
        cfg.scheduler = if incremental && seed % 2 == 0 {
            crate::engine::Scheduler::Vllm
        } else {
            crate::engine::Scheduler::Kvsim
        };
        cfg.concurrency = (mode % 2 == 1).then_some(3);
        cfg.sessions = (mode >= 2).then_some(15);
        cfg.turns = if mode >= 2 { 4 } else { 1 };
        cfg.think_us = if mode >= 2 { seed % 3 * 5_000 } else { 0 };
    }

    /// What a run's routers saw: its records and every delivery of KV events.
    type Seen = (Records, Vec<(u64, usize, Tier, usize)>);

    /// What a run's routers saw, skipping quiet steps or not; and whether skipping gave up.
    fn records(cfg: &SimConfig, timing: LinearTiming, fast: bool) -> (Seen, bool) {
        let timing: Arc<dyn TimingModel> = Arc::new(timing);
        let mut run = Run::new(cfg, &timing, Workload::new(cfg), fast).unwrap();
        run.simulate(&mut |_| {});
        let ambiguous = run.ambiguous;
        let delivered = std::mem::take(&mut run.delivered);
        ((run.collect(), delivered), ambiguous)
    }

    /// Planning a decode step can queue KV events: with incremental allocation, the step's new
    /// block is taken by evicting cached ones. Step by step, they go out when that step ends;
    /// skipping a quiet run that started with that step sent them only at the run's end, so
    /// the routers' view of the cache lagged and later routing differed (the two saved
    /// proptest cases with a routing model, a closed loop and the prefill-aware cost, and open
    /// loops with incremental allocation too).
    #[test]
    fn evictions_made_planning_a_step_reach_the_routers_when_it_ends() {
        let cfg = SimConfig {
            instances: 1,
            kv_blocks: Some(24),
            kv_allocation: KvAllocation::Incremental,
            block_size: BlockSize::new(16).unwrap(),
            input_len: 64,
            prefix_len: 32,
            output_len: 40,
            max_num_seqs: 1,
            num_requests: 12,
            request_rate: 50.0,
            arrival_model: ArrivalModel::Constant,
            ..SimConfig::default()
        };
        cfg.validate().unwrap();
        let t = LinearTiming::new(1000.0, 1.0, 0.0, 0.0);
        let ((slow, slow_seen), _) = records(&cfg, t, false);
        let ((fast, fast_seen), ambiguous) = records(&cfg, t, true);
        assert!(!ambiguous);
        assert!(slow.engines[0].evictions > 0);
        assert_eq!(fast_seen, slow_seen);
        assert_eq!(fast, slow);
    }

    /// The routers trust their engines to evict tail first (`tail_first_evictions`): under
    /// eviction pressure, with a host tier and data-parallel ranks, no worker is ever walked
    /// block by block, and every route's runs equal a walk of the mirror (checked before each
    /// route in tests: [`crate::fleet`]'s `exact_runs`).
    #[test]
    fn trusted_routers_probe_exactly_under_eviction() {
        for (dp_ranks, host) in [(1, None), (2, Some(300)), (1, Some(300))] {
            let cfg = SimConfig {
                instances: 3,
                dp_ranks,
                host_kv_blocks: host,
                kv_blocks: Some(400),
                block_size: BlockSize::new(16).unwrap(),
                input_len: 1500,
                prefix_len: 600,
                num_prefixes: 3,
                output_len: 20,
                num_requests: 150,
                request_rate: 40.0,
                ..SimConfig::default()
            };
            cfg.validate().unwrap();
            let (records, routers, _) = finished_run(&cfg);
            assert!(records.engines.iter().all(|e| e.evictions > 0));
            for r in &routers {
                assert!(r.index().tail_first());
                assert!(r
                    .index()
                    .workers()
                    .iter()
                    .all(|&w| !r.index().may_have_holes(w)));
            }
        }
    }

    /// Ranks routed by their engine share one worker's event stream, so one rank can evict a
    /// block another rank's longer chain extends: the mirror then has a hole, and such routers
    /// must not trust tail-first evictions. This run makes such holes where later turns run
    /// over them: trusted, the runs checked before every route (`exact_runs`) differ from a
    /// walk of the mirror, and the run panics.
    #[test]
    fn engine_routed_ranks_are_walked_where_they_have_holes() {
        let cfg = SimConfig {
            instances: 2,
            dp_ranks: 2,
            dp_routing: crate::config::DpRouting::Engine,
            kv_blocks: Some(40),
            block_size: BlockSize::new(16).unwrap(),
            sessions: Some(10),
            turns: 10,
            think_us: 1_000,
            input_len: 64,
            prefix_len: 32,
            num_prefixes: 1,
            output_len: 20,
            request_rate: 100.0,
            ..SimConfig::default()
        };
        cfg.validate().unwrap();
        let (records, routers, _) = finished_run(&cfg);
        assert!(records.engines.iter().all(|e| e.evictions > 0));
        for r in &routers {
            assert!(!r.index().tail_first());
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(160))]
        /// Skipping quiet steps changes nothing the routers see (the records, and when each
        /// engine's KV events reach them), ties included: round timing coefficients and
        /// constant arrivals make many events fall on the same microsecond.
        #[test]
        fn skipping_quiet_steps_changes_nothing(instances in 1usize..5, pd in prop::option::of((1usize..3, 1usize..3)),
                          routers in 1usize..3, kv in prop::option::of(8usize..80),
                          bs in prop::sample::select(vec![16usize, 64]),
                          policy in prop::sample::select(Policy::ALL.to_vec()),
                          delay in prop::sample::select(vec![0u64, 1_000, 2_000, 5_000]),
                          arrivals in prop::sample::select(vec![ArrivalModel::Constant, ArrivalModel::Poisson]),
                          rate in prop::sample::select(vec![10.0f64, 50.0, 200.0, 1000.0]),
                          timing in prop::sample::select(vec![(1000.0, 1.0, 0.0, 0.0), (1000.0, 0.0, 500.0, 0.0), (7050.0, 19.5, 25.4, 0.04), (2000.0, 2.0, 0.0, 1.0)]),
                          input in 1usize..600, output in 1usize..60, seqs in 1usize..6,
                          (seed, incremental, mode, shared) in (0u64..1000, any::<bool>(), 0u8..4, any::<bool>()),
                          rm in routing_model()) {
            let mut cfg = SimConfig {
                instances,
                prefill_instances: pd.map(|p| p.0),
                decode_instances: pd.map(|p| p.1),
                pd_link: if shared { PdLink::Shared } else { PdLink::PerTransfer },
                routers,
                kv_blocks: kv,
                block_size: BlockSize::new(bs).unwrap(),
                routing: policy,
                event_delay_us: delay,
                arrival_model: arrivals,
                pd_transfer_latency_us: 1_000,
                pd_transfer_gbps: 1e12,
                input_len: input,
                prefix_len: input / 2,
                output_len: output,
                max_num_seqs: seqs,
                max_batched_tokens: 256,
                num_requests: 80,
                request_rate: rate,
                seed,
                ..rm.apply(kv)
            };
            with_loop_mode(&mut cfg, incremental, mode, seed);
            cfg.validate().unwrap();
            let t = LinearTiming::new(timing.0, timing.1, timing.2, timing.3);
            let (slow, _) = records(&cfg, t, false);
            let (fast, ambiguous) = records(&cfg, t, true);
            // An ambiguous fast run is thrown away and redone step by step.
            if !ambiguous {
                prop_assert_eq!(fast, slow);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever the settings (incremental allocation and its preemptions included): every
        /// request completes or is rejected, nothing stays pinned or reserved, every router
        /// replica ends with no load, and its view of each engine of its pool equals that
        /// engine's cache.
        #[test]
        fn runs_end_clean(instances in 1usize..5, pd in prop::option::of((1usize..3, 1usize..3)), routers in 1usize..4,
                          kv in prop::option::of(4usize..60), bs in prop::sample::select(vec![16usize, 64, 256]),
                          policy in prop::sample::select(Policy::ALL.to_vec()), delay in prop::sample::select(vec![0u64, 5_000]),
                          input in 1usize..3000, output in 1usize..40, seqs in 1usize..8,
                          (seed, incremental, mode) in (0u64..1000, any::<bool>(), 0u8..4),
                          rm in routing_model(), host in prop::option::of(0usize..40),
                          (dp, by_engine) in (1usize..3, any::<bool>())) {
            let mut cfg = SimConfig {
                instances,
                // Data-parallel ranks (unified pools only), workers of their own or one per engine.
                dp_ranks: if pd.is_none() { dp } else { 1 },
                dp_routing: if by_engine { crate::config::DpRouting::Engine } else { crate::config::DpRouting::Rank },
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
                host_kv_blocks: host,
                host_load_gbps: 10.0,
                ..rm.apply(kv)
            };
            with_loop_mode(&mut cfg, incremental, mode, seed);
            cfg.validate().unwrap();
            let (c, routers, leftovers) = finished_run(&cfg);
            // Every request was sent (a closed loop never stalls) ...
            prop_assert_eq!(c.requests.len(), cfg.request_count());
            prop_assert!(c.requests.iter().all(|r| r.rejected || (r.finish >= r.first_token && r.first_token > r.arrival)));
            prop_assert!(leftovers.iter().all(|&l| l == (0, 0)), "{:?}", leftovers);
            // Routed by engine, ranks' events mix in one mirror: a store under a parent one
            // rank evicted is refused, which is the point of that mode.
            let mixed = cfg.dp_ranks > 1 && by_engine;
            prop_assert_eq!(c.inconsistent_inserts, 0);
            if !mixed {
                prop_assert_eq!(c.router_errors, 0);
            }
            let ranks = if mixed { cfg.dp_ranks } else { 1 };
            for router in &routers {
                prop_assert_eq!((router.in_flight_total(), router.remote_in_flight()), (0, 0));
                for w in router.workers() {
                    prop_assert_eq!(router.active_blocks(w), 0);
                    prop_assert_eq!((router.pending_prefill_blocks(w), router.decode_blocks(w)), (0, 0));
                    let of = |f: &dyn Fn(&EngineRecord) -> usize| -> usize {
                        let first = w.get() as usize * ranks;
                        c.engines[first..first + ranks].iter().map(f).sum()
                    };
                    if mixed {
                        // A mirrored block is one the rank that stored it last still holds.
                        prop_assert!(router.cache_view(w) <= of(&|e| e.resident_blocks));
                        prop_assert!(router.tier_view(w, Tier::Host) <= of(&|e| e.host_blocks));
                    } else {
                        prop_assert_eq!(router.tier_view(w, Tier::Host), of(&|e| e.host_blocks));
                        prop_assert_eq!(router.cache_view(w), of(&|e| e.resident_blocks));
                    }
                }
            }
            let pools: usize = routers.iter().map(|r| r.workers().len()).sum();
            prop_assert_eq!(pools, c.engines.len() / ranks * cfg.routers);
            for e in &c.engines {
                if let Some(k) = kv {
                    prop_assert!(e.resident_blocks <= k);
                }
            }
        }
    }
}
