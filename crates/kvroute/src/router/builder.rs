//! The router's settings and their validation: [`RouterBuilder`].

use super::*;

/// Builds a [`Router`]; [`build`](Self::build) validates every setting.
///
/// Defaults: block size 16, `Kv` policy, overlap weight 1.0, no per-role weights, seed 0,
/// `PrefixAware` over the first block with 128 virtual nodes per worker; the source document's
/// cost at temperature 0, nobody busy, no predicted blocks.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct RouterBuilder {
    pub(super) block_size: BlockSize,
    pub(super) policy: Policy,
    pub(super) overlap_weight: f64,
    pub(super) prefill_weight: Option<f64>,
    pub(super) decode_weight: Option<f64>,
    pub(super) seed: u64,
    pub(super) prefix_blocks: usize,
    pub(super) virtual_nodes: usize,
    pub(super) replica: Option<u64>,
    pub(super) remote_ttl: std::time::Duration,
    pub(super) cost_model: CostModel,
    pub(super) temperature: f64,
    pub(super) busy: Option<BusyThreshold>,
    pub(super) predicted_ttl: Duration,
    pub(super) tier_credits: TierCredits,
    pub(super) tail_first: bool,
    pub(super) session_affinity: SessionAffinity,
    pub(super) session_ttl: Duration,
}

impl Default for RouterBuilder {
    fn default() -> Self {
        RouterBuilder {
            block_size: BlockSize::default(),
            policy: Policy::Kv,
            overlap_weight: 1.0,
            prefill_weight: None,
            decode_weight: None,
            seed: 0,
            prefix_blocks: 1,
            virtual_nodes: 128,
            replica: None,
            remote_ttl: std::time::Duration::from_secs(600),
            cost_model: CostModel::Seed,
            temperature: 0.0,
            busy: None,
            predicted_ttl: Duration::ZERO,
            tier_credits: TierCredits::default(),
            tail_first: false,
            session_affinity: SessionAffinity::Soft,
            session_ttl: Duration::from_secs(600),
        }
    }
}

impl RouterBuilder {
    /// Tokens per block; must equal the engines' (used by [`Router::route_tokens`]).
    pub fn block_size(mut self, block_size: BlockSize) -> Self {
        self.block_size = block_size;
        self
    }

    /// The routing policy.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The global overlap weight (locality versus load balance); 0 is pure load balance.
    pub fn overlap_weight(mut self, weight: f64) -> Self {
        self.overlap_weight = weight;
        self
    }

    /// The weight for [`Role::Prefill`], overriding the global one (typically 20).
    pub fn prefill_overlap_weight(mut self, weight: f64) -> Self {
        self.prefill_weight = Some(weight);
        self
    }

    /// The weight for [`Role::Decode`], overriding the global one (typically 2).
    pub fn decode_overlap_weight(mut self, weight: f64) -> Self {
        self.decode_weight = Some(weight);
        self
    }

    /// The seed of tie-breaking and of the `Random` policy.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// `PrefixAware`: how many leading blocks form the ring key (at least 1).
    pub fn prefix_blocks(mut self, k: usize) -> Self {
        self.prefix_blocks = k;
        self
    }

    /// `PrefixAware`: virtual nodes per worker on the ring (1 to 65,536).
    pub fn virtual_nodes(mut self, n: usize) -> Self {
        self.virtual_nodes = n;
        self
    }

    /// Makes the router replica `id` of several that share their in-flight load: every route
    /// and finish is queued as a [`LoadDelta`] for [`drain_load_deltas`](Router::drain_load_deltas),
    /// to be sent to the other replicas, which apply it with
    /// [`apply_load_delta`](Router::apply_load_delta).
    pub fn replica(mut self, id: u64) -> Self {
        self.replica = Some(id);
        self
    }

    /// How long another replica's request counts as in flight without its `Finished` delta
    /// (lost deltas, a replica that died), and how long a finished one is remembered against
    /// duplicates and late deltas. Default 600 s.
    pub fn remote_load_ttl(mut self, ttl: std::time::Duration) -> Self {
        self.remote_ttl = ttl;
        self
    }

    /// The cost the `Kv` policy minimises (default [`CostModel::Seed`], the source document's).
    /// The prefill-aware cost needs [`Router::prefill_done`] at each request's first token.
    pub fn cost_model(mut self, model: CostModel) -> Self {
        self.cost_model = model;
        self
    }

    /// `Kv` policy: 0 (the default) takes the lowest cost; above 0 samples worker `w` with
    /// probability ∝ `exp(−(cost(w) − min) / (T × (max − min)))` over the candidates' costs
    /// (seeded, so deterministic for a seed): at `T = 1` the worst candidate is `e` times less
    /// likely than the best, and a higher `T` spreads load further. When all candidates cost the
    /// same, the tie is broken uniformly (up to 16 candidates after one draw of the generator
    /// for the sample). Up to 16 candidates the sample weighs every one; above, it draws
    /// candidates uniformly and accepts one with probability its weight (rejection sampling:
    /// the same distribution, a few weights per request instead of one per worker).
    ///
    /// ```
    /// use kvroute::{RequestId, Role, Router, WorkerId};
    /// let mut hot = Router::builder().temperature(2.0).seed(1).build()?;
    /// for w in 0..4 {
    ///     hot.add_worker(WorkerId::new(w));
    /// }
    /// let mut seen = std::collections::BTreeSet::new();
    /// for id in 0..40 {
    ///     let d = hot.route(RequestId::new(id), &[], Role::Unified)?;
    ///     seen.insert(d.worker);
    ///     hot.finish(RequestId::new(id))?;
    /// }
    /// assert_eq!(seen.len(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn temperature(mut self, t: f64) -> Self {
        self.temperature = t;
        self
    }

    /// `Kv` policy: skips the workers this threshold counts busy, unless all are (then the least
    /// loaded: fewest active blocks under the seed's cost, fewest pending prefill plus decode
    /// blocks under the prefill-aware one). Changeable later with
    /// [`Router::set_busy_threshold`].
    pub fn busy_threshold(mut self, threshold: BusyThreshold) -> Self {
        self.busy = Some(threshold);
        self
    }

    /// Predicted blocks: a routed request's blocks count as hits on its worker for later
    /// requests, before the worker's events report them, until those events confirm them or
    /// `ttl` passes on the router's clock ([`Router::set_clock`]). A burst of requests over a
    /// new prefix then goes to one worker instead of scattering. Zero (the default) is off.
    /// Predictions lapse only as [`Router::set_clock`] advances: a router that never calls it
    /// keeps every unconfirmed prediction (those of a request that failed included).
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvroute::{BlockHash, RequestId, Role, Router, WorkerId};
    /// let mut router = Router::builder().predicted_ttl(Duration::from_millis(500)).build()?;
    /// router.add_worker(WorkerId::new(0));
    /// router.add_worker(WorkerId::new(1));
    /// let prefix: Vec<BlockHash> = (1..=8).map(BlockHash::new).collect();
    /// let first = router.route(RequestId::new(1), &prefix, Role::Unified)?;
    /// let second = router.route(RequestId::new(2), &prefix, Role::Unified)?;
    /// assert_eq!((second.worker, second.cache_hits), (first.worker, 8));
    /// router.set_clock(Duration::from_millis(500)); // no event came: the prediction lapses
    /// assert_eq!(router.predicted_blocks(first.worker), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn predicted_ttl(mut self, ttl: Duration) -> Self {
        self.predicted_ttl = ttl;
        self
    }

    /// What a hit on a lower tier (host memory, disk) is worth against a device hit, for workers
    /// whose lower tiers the router mirrors ([`Router::apply_tier_event`]). Default
    /// [`TierCredits::default`].
    ///
    /// ```
    /// use kvroute::{BlockHash, KvEvent, RequestId, Role, Router, Tier, TierCredits, WorkerId};
    /// let blocks: Vec<BlockHash> = (1..=8).map(BlockHash::new).collect();
    /// let mut router = Router::builder().tier_credits(TierCredits::new(0.5, 0.0)).build()?;
    /// let (w0, w1) = (WorkerId::new(0), WorkerId::new(1));
    /// router.add_worker(w0);
    /// router.add_worker(w1);
    /// // W0 holds the first 2 blocks on the GPU and the next 6 in host memory.
    /// router.apply_event(w0, 0, &KvEvent::Stored { parent: None, blocks: blocks[..2].to_vec() })?;
    /// router.apply_tier_event(w0, Tier::Host, 0, &KvEvent::Stored { parent: None, blocks: blocks[2..].to_vec() })?;
    /// let d = router.route(RequestId::new(1), &blocks, Role::Unified)?;
    /// // Cost 8 - 2 - 0.5 x 6 = 3 against 8 on W1.
    /// assert_eq!((d.worker, d.cache_hits, d.lower_tier_hits, d.cost), (w0, 2, 6, 3.0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tier_credits(mut self, credits: TierCredits) -> Self {
        self.tier_credits = credits;
        self
    }

    /// Trusts that every engine evicts tail first (only blocks no resident block extends, as
    /// vLLM's and SGLang's prefix caches and [`kvcache::BlockCache`] do) and sends its own
    /// events: the index's queries then stay on strided probes after evictions instead of
    /// walking each evicting worker block by block (see [`CacheIndex::set_tail_first`], whose
    /// rules and risks this sets). Off by default.
    ///
    /// ```
    /// use kvroute::{KvEvent, Role, Router, RequestId, WorkerId};
    /// use kvblock::BlockHash;
    /// let mut router = Router::builder().tail_first_evictions(true).build()?;
    /// let w = WorkerId::new(1);
    /// router.add_worker(w);
    /// let blocks: Vec<BlockHash> = (1..=3).map(BlockHash::new).collect();
    /// router.apply_event(w, 0, &KvEvent::Stored { parent: None, blocks: blocks.clone() })?;
    /// router.apply_event(w, 1, &KvEvent::Removed { blocks: vec![blocks[2]] })?; // the tail
    /// assert!(!router.index().may_have_holes(w));
    /// assert_eq!(router.route(RequestId::new(1), &blocks, Role::Unified)?.cache_hits, 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tail_first_evictions(mut self, trust: bool) -> Self {
        self.tail_first = trust;
        self
    }

    /// How the turns of a session are routed by
    /// [`route_in_session`](Router::route_in_session) (default [`SessionAffinity::Soft`]).
    ///
    /// ```
    /// use kvroute::{Policy, RequestId, Role, Router, SessionAffinity, SessionId, WorkerId};
    ///
    /// let mut router = Router::builder()
    ///     .policy(Policy::RoundRobin)
    ///     .session_affinity(SessionAffinity::Soft)
    ///     .build()?;
    /// for w in 0..3 {
    ///     router.add_worker(WorkerId::new(w));
    /// }
    /// let chat = SessionId::from_name("chat-1");
    /// let turns: Vec<u64> = (0..3)
    ///     .map(|i| router.route_in_session(chat, RequestId::new(i), &[], Role::Unified).map(|d| d.worker.get()))
    ///     .collect::<Result<_, _>>()?;
    /// assert_eq!(turns, [0, 0, 0]); // round robin would have given 0, 1, 2
    /// router.set_routable(WorkerId::new(0), false); // drained: the session moves, once
    /// let moved: Vec<u64> = (3..6)
    ///     .map(|i| router.route_in_session(chat, RequestId::new(i), &[], Role::Unified).map(|d| d.worker.get()))
    ///     .collect::<Result<_, _>>()?;
    /// assert_eq!(moved, [1, 1, 1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn session_affinity(mut self, affinity: SessionAffinity) -> Self {
        self.session_affinity = affinity;
        self
    }

    /// How long a session is remembered after its last turn, on the router's clock
    /// ([`Router::set_clock`]; default 600 s). Zero remembers none.
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl;
        self
    }

    /// Validates the settings and builds the router.
    pub fn build(self) -> Result<Router, Error> {
        let check = |name, w: f64| {
            if w.is_finite() && w >= 0.0 {
                Ok(w)
            } else {
                Err(Error::InvalidWeight { name, value: w })
            }
        };
        check("overlap weight", self.overlap_weight)?;
        if let Some(w) = self.prefill_weight {
            check("prefill overlap weight", w)?;
        }
        if let Some(w) = self.decode_weight {
            check("decode overlap weight", w)?;
        }
        check("temperature", self.temperature)?;
        self.tier_credits.validate()?;
        if let Some(b) = &self.busy {
            b.validate()?;
        }
        if self.prefix_blocks == 0 {
            return Err(Error::InvalidSetting {
                name: "prefix blocks",
                value: 0,
                expected: "at least 1",
            });
        }
        let vnodes = u32::try_from(self.virtual_nodes)
            .ok()
            .filter(|v| (1..=65_536).contains(v))
            .ok_or(Error::InvalidSetting {
                name: "virtual nodes",
                value: self.virtual_nodes as u64,
                expected: "1 to 65536",
            })?;
        let mut index = CacheIndex::new();
        index.set_tail_first(self.tail_first);
        let session_ttl = self.session_ttl;
        let busy_limits = super::busy_limits(&self);
        Ok(Router {
            hasher: BlockHasher::new(self.block_size),
            ring: Ring::new(vnodes),
            rng: Xoshiro256PlusPlus::seed_from_u64(self.seed),
            config: self,
            index,
            slots: Vec::new(),
            active: Vec::new(),
            queued: Vec::new(),
            pending: Vec::new(),
            decode: Vec::new(),
            reported_kv: Vec::new(),
            reported_waiting: Vec::new(),
            reported_busy: Vec::new(),
            busy_limits,
            busy_slots: 0,
            free_members: Vec::new(),
            free_stale: true,
            spare: Vec::new(),
            members: Vec::new(),
            requests: Map::default(),
            next_rr: 0,
            generation: 0,
            overlaps: Overlaps::new(),
            scratch: Vec::new(),
            groups: Groups::default(),
            remote: Map::default(),
            tombstones: Map::default(),
            prefilled: Map::default(),
            outbox: Vec::new(),
            next_delta: 0,
            group_cap: None,
            now: Duration::ZERO,
            predicted: Predicted::default(),
            costs: Vec::new(),
            eligible: Vec::new(),
            tied: Ties::default(),
            extending: Vec::new(),
            lower: Vec::new(),
            lower_hits: Vec::new(),
            lower_credit: Vec::new(),
            sessions: Sessions::new(session_ttl),
            session: None,
        })
    }
}
