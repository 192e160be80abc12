//! The discrete-event loop: arrivals, routing, engine steps and transfers in simulated time,
//! and the delivery of the engines' KV events to the routers.

use std::collections::BinaryHeap;
use std::sync::Arc;

use kvblock::BlockHash;
use kvcache::KvEvent;

use crate::config::SimConfig;
use crate::engine::{EngineRequest, Outcome, Pool};
use crate::error::Error;
use crate::fleet::Fleet;
use crate::report::{EngineRecord, Records, Report, RequestRecord};
use crate::timing::TimingModel;
use crate::workload::{RequestSpec, Workload};

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
        let mut run = Run::new(&self.cfg, &self.timing, workload)?;
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
}

struct Run<'a> {
    cfg: &'a SimConfig,
    fleet: Fleet,
    workload: Workload,
    pending: Option<RequestSpec>,
    queue: BinaryHeap<Event>,
    seq: u64,
    reqs: Vec<Req>,
    /// (step duration, tokens it produced for decoding requests): ITL samples by weight.
    itl: Vec<(u64, u64)>,
    router_errors: u64,
    outcomes: Vec<Outcome>,
    now: u64,
}

impl<'a> Run<'a> {
    fn new(
        cfg: &'a SimConfig,
        timing: &Arc<dyn TimingModel>,
        workload: Workload,
    ) -> Result<Self, Error> {
        Ok(Run {
            cfg,
            fleet: Fleet::new(cfg, timing)?,
            workload,
            pending: None,
            queue: BinaryHeap::new(),
            seq: 0,
            reqs: Vec::with_capacity(cfg.request_count().min(1 << 20)),
            itl: Vec::new(),
            router_errors: 0,
            outcomes: Vec::new(),
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
        let (router, engine) = match self.fleet.routers.route(id, &spec.blocks) {
            Ok(x) => x,
            Err(_) => {
                self.router_errors += 1;
                (0, 0)
            }
        };
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
                scheduled: 0,
                transfer_us: 0,
                first_token: 0,
                finish: 0,
                rejected: false,
            },
            router,
            decode_router: 0,
            in_transit: Vec::new(),
        });
        let req = EngineRequest::new(id as u64, spec.blocks, spec.input_len, spec.output_len);
        if self.fleet.engines[engine].submit(req) {
            if !self.fleet.engines[engine].is_busy() {
                self.start_step(engine);
            }
        } else {
            // It can never fit on this engine: count it and release the router's load.
            self.reqs[id].rec.rejected = true;
            self.release_router(id, Pool::Unified);
        }
        self.schedule_next_arrival();
    }

    /// Releases the request's load in the router that routed it on the given side.
    fn release_router(&mut self, r: usize, side: Pool) {
        let req = &self.reqs[r];
        let done = match (side, &mut self.fleet.decode_routers) {
            (Pool::Decode, Some(d)) => d.finish(req.decode_router, r),
            _ => self.fleet.routers.finish(req.router, r),
        };
        if done.is_err() {
            self.router_errors += 1;
        }
    }

    /// Admits what fits on engine `e` and, unless it has nothing to run, starts its next step.
    fn start_step(&mut self, e: usize) {
        self.fleet.engines[e].admit();
        self.handle_outcomes(e);
        self.flush_events(e);
        if let Some(step) = self.fleet.engines[e].plan_step() {
            if step.shape.decode_requests > 0 {
                self.itl
                    .push((step.duration_us, step.shape.decode_requests));
            }
            self.push(self.now.saturating_add(step.duration_us), Kind::StepDone(e));
        }
    }

    fn step_done(&mut self, e: usize) {
        self.fleet.engines[e].finish_step();
        // The property tests check the engine's invariants after every step.
        #[cfg(test)]
        if let Err(broken) = self.fleet.engines[e].check_invariants() {
            panic!(
                "engine {e} after step {}: {broken}",
                self.fleet.engines[e].steps()
            );
        }
        self.handle_outcomes(e);
        self.flush_events(e);
        self.start_step(e);
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
                Outcome::FirstToken { id } => self.reqs[id as usize].rec.first_token = now,
                Outcome::PrefillDone { id, blocks } => self.hand_over(id as usize, blocks),
                Outcome::Finished { id } => {
                    self.reqs[id as usize].rec.finish = now;
                    self.release_router(id as usize, pool);
                }
                _ => {}
            }
        }
        self.outcomes = out;
    }

    /// Disaggregated: the prefill engine has let go of the request; a decode engine is routed
    /// with the decode role's weight, and the KV it lacks is sent over.
    fn hand_over(&mut self, r: usize, blocks: Vec<BlockHash>) {
        self.release_router(r, Pool::Prefill);
        let Some(decode) = self.fleet.decode_routers.as_mut() else {
            return;
        };
        let (router, d) = match decode.route(r, &blocks) {
            Ok(x) => x,
            Err(_) => {
                self.router_errors += 1;
                return;
            }
        };
        let bs = self.cfg.block_size.get();
        let decode_hits = self.fleet.engines[d].cache().match_len(&blocks);
        let req = &mut self.reqs[r];
        req.decode_router = router;
        req.rec.decode_engine = Some(d);
        req.rec.decode_hits = decode_hits;
        req.in_transit = blocks;
        let input = req.rec.input;
        let sent_tokens = input - (decode_hits * bs).min(input);
        let bits = sent_tokens as f64 * self.cfg.kv_bytes_per_token as f64 * 8.0;
        let transfer = (bits / (self.cfg.pd_transfer_gbps * 1e3)).round() as u64
            + self.cfg.pd_transfer_latency_us;
        req.rec.transfer_us = transfer;
        self.push(self.now.saturating_add(transfer), Kind::TransferDone(r));
    }

    fn transfer_done(&mut self, r: usize) {
        let req = &mut self.reqs[r];
        let Some(d) = req.rec.decode_engine else {
            return;
        };
        let blocks = std::mem::take(&mut req.in_transit);
        let er = EngineRequest::new(r as u64, blocks, req.rec.input, req.rec.output);
        if self.fleet.engines[d].submit(er) {
            if !self.fleet.engines[d].is_busy() {
                self.start_step(d);
            }
        } else {
            self.reqs[r].rec.rejected = true;
            self.release_router(r, Pool::Decode);
        }
    }

    fn flush_events(&mut self, e: usize) {
        if self.fleet.engines[e].pending_events() == 0 {
            return;
        }
        let events: Vec<KvEvent> = self.fleet.engines[e].drain_events().collect();
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
        let pool = self.fleet.engines[e].config().pool;
        let first = self.fleet.next_event_id[e];
        self.router_errors += self.fleet.routers_of(pool).deliver(e, first, events);
        self.fleet.next_event_id[e] += events.len() as u64;
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
                    busy_us: e.busy_us(),
                })
                .collect(),
            inconsistent_inserts: engines.iter().map(|e| e.inconsistent_inserts()).sum(),
            requests: self.reqs.into_iter().map(|r| r.rec).collect(),
            itl: self.itl,
            router_errors: self.router_errors,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::LinearTiming;
    use kvblock::BlockSize;
    use kvroute::Policy;
    use proptest::prelude::*;

    fn finished_run(cfg: &SimConfig) -> (Records, Vec<kvroute::Router>, Vec<(usize, usize)>) {
        let timing: Arc<dyn TimingModel> = Arc::new(LinearTiming::default());
        let mut run = Run::new(cfg, &timing, Workload::new(cfg)).unwrap();
        run.simulate(&mut |_| {});
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
            prop_assert!(c.requests.iter().all(|r| r.rejected || (r.finish >= r.first_token && r.first_token > r.arrival)));
            prop_assert!(leftovers.iter().all(|&l| l == (0, 0)), "{:?}", leftovers);
            prop_assert_eq!(c.router_errors + c.inconsistent_inserts, 0);
            for router in &routers {
                prop_assert_eq!(router.in_flight_total(), 0);
                for w in router.workers() {
                    prop_assert_eq!(router.cache_view(w), c.engines[w.get() as usize].resident_blocks);
                }
            }
            let pools: usize = routers.iter().map(|r| r.workers().len()).sum();
            prop_assert_eq!(pools, c.engines.len() * cfg.routers);
            for e in &c.engines {
                if let Some(k) = kv {
                    prop_assert!(e.resident_blocks <= k);
                }
            }
        }
    }
}
