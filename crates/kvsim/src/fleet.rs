//! The fleet: engines and the router replicas of each pool.

use std::sync::Arc;

use kvblock::BlockHash;
use kvcache::{KvEvent, Tier, WorkerId};
use kvroute::{LoadDelta, RequestId, Role, Router, SessionId};

use crate::config::{DpRouting, SimConfig};
use crate::engine::{Engine, EngineConfig, Pool};
use crate::error::Error;
use crate::timing::TimingModel;

/// How long a synced replica remembers another's finished request: a simulated day, far beyond
/// any request's life.
const SYNC_TTL: std::time::Duration = std::time::Duration::from_secs(86_400);

/// In every simulated run under test: the index's runs (probed at strides for the workers it
/// deems hole-free, which with trusted tail-first evictions is nearly all) equal a walk of its
/// mirror, which fails if an engine ever removed a block its cache still extends.
#[cfg(test)]
fn exact_runs(index: &kvcache::CacheIndex, blocks: &[BlockHash]) {
    if let Err(e) = index.check_runs(blocks) {
        panic!("strided runs against the walk: {e}");
    }
}

/// Where a turn of a session went, against the worker its router knew for the session (with
/// session affinity on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stay {
    /// No session, or session affinity off.
    Alone,
    /// The router knew no worker for the session: its first turn, a lapsed TTL, or a session
    /// another replica routed and did not share.
    New,
    /// To the session's worker.
    Kept,
    /// Elsewhere (soft affinity, the session's worker busy): the session moved.
    Moved,
}

/// Router replicas of one pool; engine events go to all of them.
pub(crate) struct Routers {
    pub(crate) replicas: Vec<Router>,
    /// Whether turns of a session are routed in it (session affinity on).
    sessions: bool,
    /// With router sync: when finished remote requests were last forgotten.
    last_expiry: std::time::Duration,
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
                if let Some(t) = cfg.busy_threshold() {
                    b = b.busy_threshold(t);
                }
                if cfg.router_sync && cfg.routers > 1 {
                    // Simulated requests never lose their Finished delta, so the time to live
                    // only bounds how long finished ones are remembered: a simulated day.
                    b = b.replica(r as u64).remote_load_ttl(SYNC_TTL);
                }
                // Every engine's cache evicts tail first; only ranks sharing a worker's stream
                // (routed by engine) break the trust, as one rank's removal is not the others'.
                let own_stream = cfg.dp_routing != DpRouting::Engine || cfg.dp_ranks == 1;
                let mut router = b
                    .tail_first_evictions(own_stream)
                    .tier_credits(kvroute::TierCredits::new(cfg.host_hit_credit, 0.0))
                    .cost_model(cfg.cost_model)
                    .temperature(cfg.router_temperature)
                    .predicted_ttl(std::time::Duration::from_micros(cfg.predicted_ttl_us))
                    .session_affinity(cfg.session_affinity)
                    .session_ttl(std::time::Duration::from_micros(cfg.session_ttl_us))
                    .build()?;
                for w in workers.clone() {
                    router.add_worker(WorkerId::new(w as u64));
                }
                Ok(router)
            })
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(Routers {
            replicas,
            sessions: cfg.session_routing(),
            last_expiry: std::time::Duration::ZERO,
            next: 0,
            role,
        })
    }

    /// Routes with the next replica in turn, at simulated time `now_us`, in `session` when
    /// there is one and session affinity is on; returns (replica, engine, where the session
    /// went).
    pub(crate) fn route(
        &mut self,
        id: usize,
        blocks: &[BlockHash],
        now_us: u64,
        session: Option<u64>,
    ) -> Result<(usize, usize, Stay), kvroute::Error> {
        let r = self.next;
        self.next = (self.next + 1) % self.replicas.len();
        let router = &mut self.replicas[r];
        router.set_clock(std::time::Duration::from_micros(now_us));
        #[cfg(test)]
        exact_runs(router.index(), blocks);
        let id = RequestId::new(id as u64);
        let (d, stay) = match session.filter(|_| self.sessions).map(SessionId::new) {
            None => (router.route(id, blocks, self.role)?, Stay::Alone),
            Some(s) => {
                let before = router.session_worker(s);
                let d = router.route_in_session(s, id, blocks, self.role)?;
                let stay = match before {
                    None => Stay::New,
                    Some(w) if w == d.worker => Stay::Kept,
                    Some(_) => Stay::Moved,
                };
                (d, stay)
            }
        };
        Ok((r, d.worker.get() as usize, stay))
    }

    /// The load deltas replica `replica` queued since the last call.
    pub(crate) fn take_deltas(&mut self, replica: usize) -> Vec<LoadDelta> {
        self.replicas[replica].drain_load_deltas()
    }

    /// Applies replica `from`'s load deltas to every other replica, at simulated time `now_us`
    /// (their clocks first, so that predictions lapse on time); now and then forgets finished
    /// remote requests older than [`SYNC_TTL`].
    pub(crate) fn apply_deltas(&mut self, from: usize, deltas: &[LoadDelta], now_us: u64) {
        let now = std::time::Duration::from_micros(now_us);
        let expire = now.saturating_sub(self.last_expiry) >= SYNC_TTL;
        if expire {
            self.last_expiry = now;
        }
        for (r, router) in self.replicas.iter_mut().enumerate() {
            if r != from {
                router.set_clock(now);
                for d in deltas {
                    router.apply_load_delta(d, now);
                }
            }
            if expire {
                router.expire_remote_load(now);
            }
        }
    }

    /// Request `id` produced its first token: the replica that routed it moves it from pending
    /// prefill to decode.
    pub(crate) fn prefill_done(&mut self, replica: usize, id: usize) -> Result<(), kvroute::Error> {
        self.replicas[replica].prefill_done(RequestId::new(id as u64))
    }

    /// Releases request `id`'s load in the replica that routed it.
    pub(crate) fn finish(&mut self, replica: usize, id: usize) -> Result<(), kvroute::Error> {
        self.replicas[replica].finish(RequestId::new(id as u64))
    }

    /// Applies engine `engine`'s events of `tier`, numbered from `first`, to every replica;
    /// returns how many applications failed.
    pub(crate) fn deliver(
        &mut self,
        engine: usize,
        tier: Tier,
        first: u64,
        events: &[KvEvent],
    ) -> u64 {
        let mut errors = 0;
        for router in &mut self.replicas {
            for (k, ev) in events.iter().enumerate() {
                let w = WorkerId::new(engine as u64);
                if router
                    .apply_tier_event(w, tier, first + k as u64, ev)
                    .is_err()
                {
                    errors += 1;
                }
            }
        }
        errors
    }
}

/// The engines (prefill engines first when disaggregated) and the routers in front of them.
pub(crate) struct Fleet {
    pub(crate) engines: Vec<Engine>,
    /// Events delivered so far, per engine: the next event's id.
    pub(crate) next_event_id: Vec<u64>,
    /// The same for each engine's host tier.
    pub(crate) next_host_event_id: Vec<u64>,
    /// Unified or prefill pool routers.
    pub(crate) routers: Routers,
    /// Decode pool routers, when disaggregated.
    pub(crate) decode_routers: Option<Routers>,
    /// Data-parallel ranks per instance, and whether each is a router worker of its own.
    dp_ranks: usize,
    rank_workers: bool,
    /// Routed by engine: each engine's next rank.
    next_rank: Vec<usize>,
}

impl Fleet {
    pub(crate) fn new(cfg: &SimConfig, timing: &Arc<dyn TimingModel>) -> Result<Self, Error> {
        let engine = |pool| {
            let mut c = EngineConfig::new(cfg.block_size);
            c.pool = pool;
            c.kv_blocks = cfg.kv_blocks;
            c.max_batched_tokens = cfg.max_batched_tokens;
            c.max_num_seqs = cfg.max_num_seqs;
            c.host_kv_blocks = cfg.host_kv_blocks.filter(|&h| h > 0);
            c.host_load_ns_per_block = cfg.host_load_ns_per_block();
            c.kv_allocation = cfg.kv_allocation;
            c.scheduler = cfg.scheduler;
            Engine::with_shared_timing(c, Arc::clone(timing))
        };
        let (engines, routers, decode_routers): (Vec<Engine>, _, _) =
            match (cfg.prefill_instances, cfg.decode_instances) {
                (Some(p), Some(d)) => (
                    (0..p)
                        .map(|_| engine(Pool::Prefill))
                        .chain((0..d).map(|_| engine(Pool::Decode)))
                        .collect(),
                    Routers::new(cfg, Role::Prefill, 0..p)?,
                    Some(Routers::new(cfg, Role::Decode, p..p + d)?),
                ),
                _ => {
                    // Every rank is an engine; the routers' workers are the ranks, or the
                    // instances when they route by engine.
                    let workers = match cfg.dp_routing {
                        DpRouting::Engine => cfg.instances,
                        _ => cfg.engine_count(),
                    };
                    (
                        (0..cfg.engine_count())
                            .map(|_| engine(Pool::Unified))
                            .collect(),
                        Routers::new(cfg, Role::Unified, 0..workers)?,
                        None,
                    )
                }
            };
        Ok(Fleet {
            next_event_id: vec![0; engines.len()],
            next_host_event_id: vec![0; engines.len()],
            dp_ranks: cfg.dp_ranks,
            rank_workers: cfg.dp_routing != DpRouting::Engine || cfg.dp_ranks == 1,
            next_rank: vec![0; cfg.instances],
            engines,
            routers,
            decode_routers,
        })
    }

    /// Routes request `id` (of `session`, if any) in the unified or prefill pool at `now_us`;
    /// returns (replica, engine, where the session went). Routed by engine, the chosen
    /// engine's next rank takes it.
    pub(crate) fn route(
        &mut self,
        id: usize,
        blocks: &[BlockHash],
        now_us: u64,
        session: Option<u64>,
    ) -> Result<(usize, usize, Stay), kvroute::Error> {
        let (replica, w, stay) = self.routers.route(id, blocks, now_us, session)?;
        if self.rank_workers {
            return Ok((replica, w, stay));
        }
        let rank = self.next_rank[w];
        self.next_rank[w] = (rank + 1) % self.dp_ranks;
        Ok((replica, w * self.dp_ranks + rank, stay))
    }

    /// The router worker whose mirror engine `e`'s events feed: `e`, or its instance when the
    /// routers see engines, not ranks.
    pub(crate) fn worker_of(&self, e: usize) -> usize {
        if self.rank_workers {
            e
        } else {
            e / self.dp_ranks
        }
    }

    /// The routers of engine `e`'s pool.
    pub(crate) fn routers_of(&mut self, pool: Pool) -> &mut Routers {
        match (pool, &mut self.decode_routers) {
            (Pool::Decode, Some(d)) => d,
            _ => &mut self.routers,
        }
    }
}
