//! The fleet: engines and the router replicas of each pool.

use std::sync::Arc;

use kvblock::BlockHash;
use kvcache::{KvEvent, WorkerId};
use kvroute::{RequestId, Role, Router};

use crate::config::SimConfig;
use crate::engine::{Engine, EngineConfig, Pool};
use crate::error::Error;
use crate::timing::TimingModel;

/// Router replicas of one pool; engine events go to all of them.
pub(crate) struct Routers {
    pub(crate) replicas: Vec<Router>,
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
    pub(crate) fn route(
        &mut self,
        id: usize,
        blocks: &[BlockHash],
    ) -> Result<(usize, usize), kvroute::Error> {
        let r = self.next;
        self.next = (self.next + 1) % self.replicas.len();
        let d = self.replicas[r].route(RequestId::new(id as u64), blocks, self.role)?;
        Ok((r, d.worker.get() as usize))
    }

    /// Releases request `id`'s load in the replica that routed it.
    pub(crate) fn finish(&mut self, replica: usize, id: usize) -> Result<(), kvroute::Error> {
        self.replicas[replica].finish(RequestId::new(id as u64))
    }

    /// Applies engine `engine`'s events, numbered from `first`, to every replica; returns how
    /// many applications failed.
    pub(crate) fn deliver(&mut self, engine: usize, first: u64, events: &[KvEvent]) -> u64 {
        let mut errors = 0;
        for router in &mut self.replicas {
            for (k, ev) in events.iter().enumerate() {
                if router
                    .apply_event(WorkerId::new(engine as u64), first + k as u64, ev)
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
    /// Unified or prefill pool routers.
    pub(crate) routers: Routers,
    /// Decode pool routers, when disaggregated.
    pub(crate) decode_routers: Option<Routers>,
}

impl Fleet {
    pub(crate) fn new(cfg: &SimConfig, timing: &Arc<dyn TimingModel>) -> Result<Self, Error> {
        let engine = |pool| {
            let mut c = EngineConfig::new(cfg.block_size);
            c.pool = pool;
            c.kv_blocks = cfg.kv_blocks;
            c.max_batched_tokens = cfg.max_batched_tokens;
            c.max_num_seqs = cfg.max_num_seqs;
            c.kv_allocation = cfg.kv_allocation;
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
                _ => (
                    (0..cfg.instances).map(|_| engine(Pool::Unified)).collect(),
                    Routers::new(cfg, Role::Unified, 0..cfg.instances)?,
                    None,
                ),
            };
        Ok(Fleet {
            next_event_id: vec![0; engines.len()],
            engines,
            routers,
            decode_routers,
        })
    }

    /// The routers of engine `e`'s pool.
    pub(crate) fn routers_of(&mut self, pool: Pool) -> &mut Routers {
        match (pool, &mut self.decode_routers) {
            (Pool::Decode, Some(d)) => d,
            _ => &mut self.routers,
        }
    }
}
