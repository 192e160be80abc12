//! The `Router` facade: cache index, load tracking and policies behind one call.

use std::time::Duration;

use kvblock::{BlockHash, BlockHasher, BlockSize, ExtraKeys};
use kvcache::{Applied, CacheIndex, IndexSnapshot, KvEvent, Overlaps, Tier, WorkerId};
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::cost::{missing, prefill_aware, sample_softmax, score, seed};
use crate::groups::Groups;
use crate::inflight::InFlightBlocks;
use crate::predicted::Predicted;
use crate::ring::Ring;
use crate::sessions::Sessions;
use crate::{
    BusyThreshold, CacheGroup, CostModel, Error, LoadChange, LoadDelta, Map, Policy, ReportedLoad,
    RequestId, Role, Salt, SessionAffinity, SessionId, TierCredits,
};

mod builder;
mod sync;

#[cfg(test)]
mod busy_count;

pub use builder::RouterBuilder;
use sync::Remote;

/// The outcome of routing one request.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// The leading run of the request's blocks the router believes that worker holds.
    pub cache_hits: usize,
    /// The chosen worker's cost with the role's weight under the router's cost model, less its
    /// lower tiers' credit (computed for every policy, so decisions can be compared); the
    /// source document's [`cost`](crate::cost) by default.
    pub cost: f64,
    /// The request's full blocks.
    pub request_blocks: usize,
    /// Blocks after `cache_hits` the worker holds on a lower tier (host memory, disk), credited
    /// by [`TierCredits`].
    pub lower_tier_hits: usize,
}

/// One worker's score for a request, as [`Router::explain`] reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Candidate {
    /// The worker.
    pub worker: WorkerId,
    /// Its leading-run cache hits.
    pub cache_hits: usize,
    /// Its in-flight distinct prompt blocks.
    pub active_blocks: usize,
    /// The uncached prompt blocks of its requests not past their first token.
    pub pending_prefill_blocks: usize,
    /// The distinct prompt blocks of its requests past their first token.
    pub decode_blocks: usize,
    /// Whether the busy threshold counts it busy.
    pub busy: bool,
    /// Blocks after `cache_hits` it holds on a lower tier.
    pub lower_tier_hits: usize,
    /// Its cost with the role's weight, under the router's cost model.
    pub cost: f64,
}

/// Per-worker in-flight load: the distinct prompt blocks of its requests, and counts.
#[derive(Debug, Clone)]
struct Load {
    id: WorkerId,
    generation: u64,
    /// Every in-flight request's prompt blocks (the seed's `active_blocks`).
    blocks: InFlightBlocks,
    /// Those of requests past their first token, and of other replicas' requests.
    decode: InFlightBlocks,
    /// Uncached prompt blocks of requests not past their first token.
    pending: usize,
    requests: usize,
    /// What its engine last reported of its load, if anything.
    reported: Option<ReportedLoad>,
}

#[derive(Debug, Clone)]
struct InFlight {
    slot: usize,
    generation: u64,
    blocks: Vec<BlockHash>,
    /// Its uncached blocks while it prefills; `None` once past its first token.
    prefill: Option<usize>,
}

/// A KV-aware router: the mirrored cache index, in-flight load per worker, and a policy.
///
/// Routing is deterministic: the same seed and the same calls give the same decisions. Ties are
/// broken uniformly at random with the seeded generator.
///
/// In-flight load counts each worker's distinct prompt blocks as the union of its requests'
/// chains: block lists are expected to be sequence hashes (as [`route_tokens`](Self::route_tokens)
/// and `kvblock` make them), where a hash names its whole prefix. The union is then a trie, kept
/// with path compression, so routing and finishing a 128-block request cost a few lookups rather
/// than one per block. Lists outside that contract (a hash after two different parents, or twice
/// in one list) are never undercounted and never stay counted once finished; they may count a
/// block more than once while the lists sharing it are in flight, or turn that worker's count
/// back into one reference per block (as exact as before, and as slow) until it is idle.
///
/// ```
/// use kvblock::BlockSize;
/// use kvroute::{Policy, RequestId, Role, Router, WorkerId};
///
/// let mut router = Router::builder().block_size(BlockSize::new(4)?).policy(Policy::RoundRobin).build()?;
/// for w in 0..3 {
///     router.add_worker(WorkerId::new(w));
/// }
/// let tokens: Vec<u32> = (0..12).collect();
/// let picks: Vec<u64> = (0..4)
///     .map(|id| router.route_tokens(RequestId::new(id), &tokens, Role::Unified).map(|d| d.worker.get()))
///     .collect::<Result<_, _>>()?;
/// assert_eq!(picks, [0, 1, 2, 0]);
/// assert_eq!(router.active_blocks(WorkerId::new(0)), 3); // two requests, same 3 blocks
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Router {
    config: RouterBuilder,
    hasher: BlockHasher,
    index: CacheIndex,
    ring: Ring,
    rng: Xoshiro256PlusPlus,
    /// Load by the index's dense worker index.
    slots: Vec<Option<Load>>,
    /// `slots[i].blocks.len()` by dense index, as a float: packed for the scan of every worker
    /// per request, which converts nothing but the blocks missing.
    active: Vec<f64>,
    /// `slots[i].pending` and `slots[i].decode.len()` by dense index, as floats, for the
    /// prefill-aware scan: one stream for both.
    queued: Vec<[f64; 2]>,
    /// `slots[i].pending` by dense index.
    pending: Vec<usize>,
    /// `slots[i].decode.len()` by dense index.
    decode: Vec<usize>,
    /// `slots[i].reported`'s KV usage and waiting requests by dense index (0 without a report).
    reported_kv: Vec<f64>,
    reported_waiting: Vec<usize>,
    /// Whether those make the worker busy under the busy threshold, by dense index.
    reported_busy: Vec<bool>,
    /// The busy threshold's limits on decode and pending prefill blocks
    /// ([`BusyThreshold::limits`]; none without a threshold).
    busy_limits: (usize, usize),
    /// Dense indices busy under `busy_limits` or by their reports, kept with every change of
    /// the vectors above: while none is, a scan skips the busy test.
    busy_slots: usize,
    /// `members` less the busy, for the scans while some worker is busy; rebuilt when
    /// `free_stale` (a worker became busy or free, or the members changed).
    free_members: Vec<usize>,
    free_stale: bool,
    /// Block lists of finished requests, reused by the next routes.
    spare: Vec<Vec<BlockHash>>,
    /// Dense indices of registered workers, in worker-id order.
    members: Vec<usize>,
    requests: Map<RequestId, InFlight>,
    next_rr: usize,
    generation: u64,
    overlaps: Overlaps,
    scratch: Vec<BlockHash>,
    /// Cache groups beyond the index's (hybrid models); empty for most fleets.
    groups: Groups,
    /// Other replicas' requests in flight, by (replica, request).
    remote: Map<(u64, RequestId), Remote>,
    /// Other replicas' requests seen finished, until the time given: their `Routed` never counts.
    tombstones: Map<(u64, RequestId), Duration>,
    /// Other replicas' requests whose first token was reported before their route arrived,
    /// until the time given.
    prefilled: Map<(u64, RequestId), Duration>,
    /// This replica's deltas not yet drained.
    outbox: Vec<LoadDelta>,
    next_delta: u64,
    /// The hit cap of the request `route_hashed` is routing, for the cache groups' rule.
    group_cap: Option<usize>,
    /// The clock predictions are stamped and lapse by.
    now: Duration,
    /// Every worker's predicted blocks, by dense index.
    predicted: Predicted,
    /// Scratch of the temperature sampling: candidates' costs and dense indices.
    costs: Vec<f64>,
    eligible: Vec<usize>,
    /// What [`lowest_of`] keeps between routes.
    tied: Ties,
    /// Scratch of `extend_predicted`: the workers a prediction may extend.
    extending: Vec<usize>,
    /// Mirrors of the workers' lower tiers (host, disk), in tier order; empty for most fleets.
    lower: Vec<(Tier, CacheIndex)>,
    /// For the request being routed, by dense index: lower-tier hits after the device run, and
    /// their credit.
    lower_hits: Vec<usize>,
    lower_credit: Vec<f64>,
    /// Each live session's worker.
    sessions: Sessions,
    /// The session of the request `route` is routing, for this call only.
    session: Option<SessionId>,
}

impl Load {
    fn new(id: WorkerId, generation: u64) -> Self {
        Load {
            id,
            generation,
            blocks: InFlightBlocks::default(),
            decode: InFlightBlocks::default(),
            pending: 0,
            requests: 0,
            reported: None,
        }
    }
}

impl Router {
    /// A builder with the defaults.
    pub fn builder() -> RouterBuilder {
        RouterBuilder::default()
    }

    /// The policy in use.
    pub fn policy(&self) -> Policy {
        self.config.policy
    }

    /// Tokens per block.
    pub fn block_size(&self) -> BlockSize {
        self.config.block_size
    }

    /// The overlap weight used for `role`.
    pub fn weight(&self, role: Role) -> f64 {
        match role {
            Role::Unified => self.config.overlap_weight,
            Role::Prefill => self
                .config
                .prefill_weight
                .unwrap_or(self.config.overlap_weight),
            Role::Decode => self
                .config
                .decode_weight
                .unwrap_or(self.config.overlap_weight),
        }
    }

    /// Registers a worker; returns false if it was already registered.
    pub fn add_worker(&mut self, worker: WorkerId) -> bool {
        if self.member_index(worker).is_some() {
            return false;
        }
        self.register(worker)
    }

    /// Adds `worker` to the index (if new), the load tracker and the ring.
    fn register(&mut self, worker: WorkerId) -> bool {
        let Ok(i) = self.index.add_worker(worker) else {
            return false; // 2^32 workers: cannot happen in memory
        };
        if self.slots.len() <= i {
            self.slots.resize(i + 1, None);
            self.active.resize(i + 1, 0.0);
            self.queued.resize(i + 1, [0.0; 2]);
            self.pending.resize(i + 1, 0);
            self.decode.resize(i + 1, 0);
            self.reported_kv.resize(i + 1, 0.0);
            self.reported_waiting.resize(i + 1, 0);
            self.reported_busy.resize(i + 1, false);
        }
        self.generation += 1;
        self.slots[i] = Some(Load::new(worker, self.generation));
        self.mirror(i);
        self.set_reported(i, None);
        let pos = self
            .members
            .partition_point(|&m| self.slots[m].as_ref().is_some_and(|l| l.id < worker));
        self.members.insert(pos, i);
        self.free_stale = true;
        self.ring.add(worker);
        true
    }

    /// Removes a worker from the ring, the index and the load tracker; returns whether it was
    /// registered. Its in-flight requests may still be finished (a no-op for its load).
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let Some(i) = self.member_index(worker) else {
            return false;
        };
        self.index.remove_worker(worker);
        for (_, ix) in &mut self.lower {
            ix.remove_worker(worker);
        }
        self.groups.clear_worker(worker, Some(i));
        self.slots[i] = None;
        self.predicted.clear(i);
        self.mirror(i);
        self.set_reported(i, None);
        self.members.retain(|&m| m != i);
        self.free_stale = true;
        self.ring.remove(worker);
        true
    }

    /// Takes a registered worker out of routing (`false`: it is down, say) or back in (`true`),
    /// keeping its mirrored cache and its in-flight load, so it comes back warm. While out of
    /// routing it is left out of every policy, [`workers`](Self::workers) and
    /// [`explain`](Self::explain); its events still apply. Returns whether the worker is
    /// registered. [`restore_index`](Self::restore_index) puts every worker back in.
    ///
    /// ```
    /// use kvblock::BlockSize;
    /// use kvroute::{Policy, RequestId, Role, Router, WorkerId};
    /// let mut router = Router::builder().policy(Policy::RoundRobin).build()?;
    /// let (a, b) = (WorkerId::new(0), WorkerId::new(1));
    /// router.add_worker(a);
    /// router.add_worker(b);
    /// router.set_routable(a, false);
    /// let picks: Vec<WorkerId> = (0..3)
    ///     .map(|i| router.route(RequestId::new(i), &[], Role::Unified).map(|d| d.worker))
    ///     .collect::<Result<_, _>>()?;
    /// assert_eq!(picks, [b, b, b]);
    /// assert!(router.set_routable(a, true));
    /// assert_eq!(router.workers(), [a, b]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_routable(&mut self, worker: WorkerId, routable: bool) -> bool {
        let Some(i) = self.member_index(worker) else {
            return false;
        };
        let listed = self.members.contains(&i);
        if routable && !listed {
            let pos = self
                .members
                .partition_point(|&m| self.slots[m].as_ref().is_some_and(|l| l.id < worker));
            self.members.insert(pos, i);
            self.free_stale = true;
            self.ring.add(worker);
            self.next_rr = 0;
        } else if !routable && listed {
            self.members.retain(|&m| m != i);
            self.free_stale = true;
            self.ring.remove(worker);
            self.next_rr = 0;
        }
        true
    }

    fn is_member(&self, i: usize) -> bool {
        self.slots.get(i).is_some_and(Option::is_some)
    }

    /// The dense index of a registered worker.
    fn member_index(&self, worker: WorkerId) -> Option<usize> {
        self.index
            .worker_index(worker)
            .filter(|&i| self.is_member(i))
    }

    /// Registered workers, in id order.
    pub fn workers(&self) -> Vec<WorkerId> {
        self.members
            .iter()
            .filter_map(|&i| self.load(i).map(|l| l.id))
            .collect()
    }

    fn load(&self, i: usize) -> Option<&Load> {
        self.slots.get(i)?.as_ref()
    }

    /// Applies one KV event of a registered worker to the cache index.
    pub fn apply_event(
        &mut self,
        worker: WorkerId,
        event_id: u64,
        event: &KvEvent,
    ) -> Result<Applied, Error> {
        match self.member_index(worker) {
            Some(i) => {
                let applied = self.index.apply(worker, event_id, event)?;
                if matches!(event, KvEvent::Stored { .. }) {
                    self.groups.primary_stored(i);
                }
                if !self.predicted.is_empty() {
                    match event {
                        // Confirmed: the index holds them now.
                        KvEvent::Stored { blocks, .. } => self.predicted.confirm(i, blocks),
                        KvEvent::Cleared => self.predicted.clear(i),
                        KvEvent::Removed { .. } => {}
                    }
                }
                Ok(applied)
            }
            _ => Err(Error::UnknownWorker { worker }),
        }
    }

    /// Applies one KV event of a worker's cache group other than the one the index mirrors
    /// (see [`CacheGroup`] and the hit rule in its docs): a hybrid model's
    /// sliding-window or state-space group, say. The event's hashes are ours at the router's
    /// block size; for a group whose blocks are `k` router blocks long, a group block is named
    /// by our hash of its last router block. The group's kind and size are fixed by its first
    /// event (a different `spec` later starts it afresh). Event ids are not checked: a group
    /// mirror is a set.
    ///
    /// An error when the worker is not registered, or when `spec`'s block size is not a
    /// multiple of the router's.
    ///
    /// ```
    /// use kvblock::{BlockHasher, BlockSize};
    /// use kvroute::{CacheGroup, GroupRule, KvEvent, RequestId, Role, Router, WorkerId};
    ///
    /// let bs = BlockSize::new(4)?;
    /// let mut router = Router::builder().block_size(bs).build()?;
    /// let w = WorkerId::new(0);
    /// router.add_worker(w);
    /// let tokens: Vec<u32> = (0..32).collect();
    /// let blocks = BlockHasher::new(bs).sequence_hashes(&tokens); // 8 blocks
    /// // Full attention holds all 8; a sliding window of 9 tokens (2 blocks) lost the first 6.
    /// router.apply_event(w, 0, &KvEvent::Stored { parent: None, blocks: blocks.clone() })?;
    /// let sw = CacheGroup::new(GroupRule::SlidingWindow { window_tokens: 9 }, bs);
    /// router.apply_group_event(w, 1, sw, &KvEvent::Stored { parent: None, blocks: blocks.clone() })?;
    /// router.apply_group_event(w, 1, sw, &KvEvent::Removed { blocks: blocks[..6].to_vec() })?;
    /// // A follow-up turn (4 more tokens): the window before block 8 is resident, so 8 hits.
    /// let next: Vec<u32> = (0..36).collect();
    /// let d = router.route_tokens(RequestId::new(1), &next, Role::Unified)?;
    /// assert_eq!(d.cache_hits, 8);
    /// // The same 32 tokens again: the engine reuses at most 31 of them, and the window before
    /// // block 7 lost block 5, so nothing.
    /// let again = router.route_tokens(RequestId::new(2), &tokens, Role::Unified)?;
    /// assert_eq!(again.cache_hits, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_group_event(
        &mut self,
        worker: WorkerId,
        group: u32,
        spec: CacheGroup,
        event: &KvEvent,
    ) -> Result<Applied, Error> {
        match self.member_index(worker) {
            Some(_) => {
                let bs = self.config.block_size;
                self.groups.apply(worker, group, spec, bs, event)
            }
            _ => Err(Error::UnknownWorker { worker }),
        }
    }

    /// How many blocks the router believes `worker`'s cache group `group` holds (`None`: no
    /// such group; the index's own group is [`cache_view`](Self::cache_view)).
    pub fn group_view(&self, worker: WorkerId, group: u32) -> Option<usize> {
        self.groups.group_blocks(worker, group)
    }

    /// `worker`'s cache groups beyond the index's, by group id.
    pub fn groups(&self, worker: WorkerId) -> Vec<(u32, CacheGroup)> {
        self.groups.groups_of(worker)
    }

    /// Forgets everything the index holds for `worker` (for example after its publisher
    /// restarted); returns how many blocks it held.
    pub fn clear_worker(&mut self, worker: WorkerId) -> usize {
        let i = self.index.worker_index(worker);
        if let Some(i) = i {
            self.predicted.clear(i);
        }
        for (_, ix) in &mut self.lower {
            ix.clear_worker(worker);
        }
        self.index.clear_worker(worker) + self.groups.clear_worker(worker, i)
    }

    /// The router's view of `worker`'s cache: how many blocks it believes the worker holds.
    pub fn cache_view(&self, worker: WorkerId) -> usize {
        self.index.block_count(worker)
    }

    /// The mirrored cache index.
    pub fn index(&self) -> &CacheIndex {
        &self.index
    }

    /// A snapshot of the router's cache index (with per-worker event ids), for
    /// [`restore_index`](Self::restore_index) in a restarted router or a new replica.
    pub fn snapshot_index(&self) -> IndexSnapshot {
        self.index.snapshot()
    }

    /// Replaces the cache index with a snapshot's and registers the workers it lists. Workers
    /// registered here but absent from the snapshot stay, with an empty view. Meant for a router
    /// that is starting: in-flight load is reset (finishing an earlier request is still fine).
    pub fn restore_index(&mut self, snapshot: IndexSnapshot) -> Result<(), Error> {
        let mut index = CacheIndex::restore(snapshot)?;
        index.set_tail_first(self.config.tail_first);
        let keep = self.workers();
        for &w in &keep {
            index.add_worker(w)?;
        }
        let listed = index.workers();
        self.index = index;
        // A snapshot holds the index's groups only; the others refill from events, and so do
        // the lower tiers.
        self.groups = Groups::default();
        self.lower.clear();
        self.slots.clear();
        self.active.clear();
        self.queued.clear();
        self.pending.clear();
        self.decode.clear();
        self.reported_kv.clear();
        self.reported_waiting.clear();
        self.reported_busy.clear();
        self.busy_slots = 0;
        self.predicted.clear_all();
        self.members.clear();
        self.free_stale = true;
        self.ring = Ring::new(self.ring.vnodes());
        for w in listed {
            // The index has them already; this registers them for load tracking and the ring.
            self.register(w);
        }
        Ok(())
    }

    /// Distinct in-flight prompt blocks on `worker` (see the type's docs for the contract).
    pub fn active_blocks(&self, worker: WorkerId) -> usize {
        self.worker_load(worker).map_or(0, |l| l.blocks.len())
    }

    /// In-flight requests on `worker`.
    pub fn in_flight(&self, worker: WorkerId) -> usize {
        self.worker_load(worker).map_or(0, |l| l.requests)
    }

    /// All in-flight requests.
    pub fn in_flight_total(&self) -> usize {
        self.requests.len()
    }

    fn worker_load(&self, worker: WorkerId) -> Option<&Load> {
        self.load(self.index.worker_index(worker)?)
    }

    /// Routes request `request_id` with its prompt's block hashes, and records it as in flight on
    /// the chosen worker until [`finish`](Self::finish).
    pub fn route(
        &mut self,
        request_id: RequestId,
        blocks: &[BlockHash],
        role: Role,
    ) -> Result<Decision, Error> {
        // Set by `route_hashed` and `route_in_session` for this call only.
        let cap = self.group_cap.take();
        let session = self.session.take();
        if self.members.is_empty() {
            return Err(Error::NoWorkers);
        }
        if self.requests.contains_key(&request_id) {
            return Err(Error::DuplicateRequest { request_id });
        }
        let sticky = match session {
            Some(s) => self.sticky(s)?,
            None => None,
        };
        let weight = self.weight(role);
        let n = blocks.len();
        self.index.overlaps_into(blocks, &mut self.overlaps);
        if !self.config.predicted_ttl.is_zero() {
            self.extend_predicted(blocks);
        }
        let cap = cap.unwrap_or(n);
        if !self.groups.is_empty() {
            self.groups
                .cut(&self.index, blocks, cap, &mut self.overlaps);
        }
        if !self.lower.is_empty() {
            self.credit_lower_tiers(blocks);
        }
        let chosen = match (sticky, self.config.policy) {
            (Some(i), _) => i,
            (None, Policy::Kv) => self.choose_kv(weight, n),
            (None, Policy::PrefixAware) => match Ring::key(blocks, self.config.prefix_blocks) {
                Some(key) => self
                    .ring
                    .owner(key)
                    .and_then(|w| self.index.worker_index(w))
                    .unwrap_or(self.members[0]),
                // No full block: nothing to be consistent about, so spread by turns.
                None => self.round_robin(),
            },
            (None, Policy::RoundRobin) => self.round_robin(),
            (None, Policy::Random) => {
                let k = self.uniform(self.members.len());
                self.members[k]
            }
        };
        let hits = self.overlaps.run_at(chosen);
        let cost = self.cost_at(weight, n, chosen);
        let lower_tier_hits = if self.lower.is_empty() {
            0
        } else {
            self.lower_hits[chosen]
        };
        let uncached = n.saturating_sub(hits);
        let ttl = self.config.predicted_ttl;
        let (worker, generation) = {
            let load = self.slots[chosen].as_mut().ok_or(Error::NoWorkers)?;
            load.blocks.add(blocks);
            load.requests += 1;
            load.pending += uncached;
            (load.id, load.generation)
        };
        self.mirror(chosen);
        if !ttl.is_zero() {
            let lapses = self.now.saturating_add(ttl);
            if let Some(rest) = blocks.get(hits..) {
                self.predicted.add(chosen, hits, rest, lapses);
            }
        }
        let mut kept = self.spare.pop().unwrap_or_default();
        kept.extend_from_slice(blocks);
        self.requests.insert(
            request_id,
            InFlight {
                slot: chosen,
                generation,
                blocks: kept,
                prefill: Some(uncached),
            },
        );
        if let Some(s) = session.filter(|_| self.config.session_affinity != SessionAffinity::Off) {
            self.sessions.record(s, worker, self.now);
        }
        if self.config.replica.is_some() {
            self.share(LoadChange::Routed {
                request: request_id,
                worker,
                blocks: blocks.to_vec(),
                pending: Some(uncached),
                session,
            });
        }
        Ok(Decision {
            worker,
            cache_hits: hits,
            cost,
            request_blocks: n,
            lower_tier_hits,
        })
    }

    /// The dense index `session`'s turn must go to: its worker's, unless affinity is off, the
    /// session is unknown or lapsed, or (soft) its worker is not routable or busy.
    fn sticky(&mut self, session: SessionId) -> Result<Option<usize>, Error> {
        let affinity = self.config.session_affinity;
        if affinity == SessionAffinity::Off {
            return Ok(None);
        }
        let Some(worker) = self.sessions.worker(session, self.now) else {
            return Ok(None);
        };
        // Routable: listed in `members` (sorted by worker id).
        let routable = self
            .members
            .binary_search_by_key(&worker, |&m| {
                self.slots[m].as_ref().map_or(worker, |l| l.id)
            })
            .ok()
            .map(|k| self.members[k]);
        match (affinity, routable) {
            (SessionAffinity::Hard, Some(i)) => Ok(Some(i)),
            (SessionAffinity::Hard, None) => Err(Error::SessionUnavailable { session, worker }),
            (_, Some(i)) if !self.is_busy(i) => Ok(Some(i)),
            _ => Ok(None),
        }
    }

    /// [`route`](Self::route) for a turn of `session`: under the router's
    /// [`SessionAffinity`](crate::SessionAffinity) it goes to the worker of the session's last
    /// turn (see [`RouterBuilder::session_affinity`]), and the session lives on the worker it
    /// went to, for the session TTL on the router's clock ([`set_clock`](Self::set_clock)).
    /// With replica sharing on, the other replicas learn the session's worker from this route's
    /// [`LoadChange::Routed`].
    pub fn route_in_session(
        &mut self,
        session: SessionId,
        request_id: RequestId,
        blocks: &[BlockHash],
        role: Role,
    ) -> Result<Decision, Error> {
        self.in_session(session, |r| r.route(request_id, blocks, role))
    }

    /// [`route_tokens_keyed`](Self::route_tokens_keyed) for a turn of `session` (see
    /// [`route_in_session`](Self::route_in_session)).
    pub fn route_tokens_in_session(
        &mut self,
        session: SessionId,
        request_id: RequestId,
        tokens: &[u32],
        salt: &Salt,
        keys: &[ExtraKeys],
        role: Role,
    ) -> Result<Decision, Error> {
        self.in_session(session, |r| {
            r.route_tokens_keyed(request_id, tokens, salt, keys, role)
        })
    }

    /// Runs one route with `session` as the turn's session.
    fn in_session<R>(&mut self, session: SessionId, route: impl FnOnce(&mut Self) -> R) -> R {
        self.session = Some(session);
        let d = route(self);
        self.session = None;
        d
    }

    /// The worker of `session`'s last turn, unless the session lapsed.
    pub fn session_worker(&mut self, session: SessionId) -> Option<WorkerId> {
        self.sessions.worker(session, self.now)
    }

    /// Sessions remembered (used within the session TTL).
    pub fn live_sessions(&mut self) -> usize {
        self.sessions.expire(self.now);
        self.sessions.len()
    }

    /// Every worker's lower-tier hits after its device run, and their credit.
    fn credit_lower_tiers(&mut self, blocks: &[BlockHash]) {
        let bound = self.slots.len();
        self.lower_hits.clear();
        self.lower_hits.resize(bound, 0);
        self.lower_credit.clear();
        self.lower_credit.resize(bound, 0.0);
        for &i in &self.members {
            let Some(load) = self.slots[i].as_ref() else {
                continue;
            };
            let (h, c) = self.lower_run(load.id, blocks, self.overlaps.run_at(i));
            self.lower_hits[i] = h;
            self.lower_credit[i] = c;
        }
    }

    /// The run of `blocks[from..]` that `worker` holds on lower tiers, each block credited by the
    /// highest tier holding it (so a block never counts twice), and the credits' sum.
    fn lower_run(&self, worker: WorkerId, blocks: &[BlockHash], from: usize) -> (usize, f64) {
        let mut credit = 0.0;
        let mut r = from;
        while let Some(&b) = blocks.get(r) {
            let Some((tier, _)) = self.lower.iter().find(|(_, ix)| ix.holds(worker, b)) else {
                break;
            };
            credit += self.config.tier_credits.of(*tier);
            r += 1;
        }
        (r - from, credit)
    }

    /// Applies one KV event of a registered worker's `tier` (host memory, disk: an engine that
    /// offloads; vLLM's `medium`) to the router's mirror of that tier; [`Tier::Device`] is
    /// [`apply_event`](Self::apply_event). A lower tier's mirror is a set: a block it holds
    /// counts, credited by [`TierCredits`], where the device's run ends.
    pub fn apply_tier_event(
        &mut self,
        worker: WorkerId,
        tier: Tier,
        event_id: u64,
        event: &KvEvent,
    ) -> Result<Applied, Error> {
        if tier == Tier::Device {
            return self.apply_event(worker, event_id, event);
        }
        if self.member_index(worker).is_none() {
            return Err(Error::UnknownWorker { worker });
        }
        let at = match self.lower.binary_search_by_key(&tier, |(t, _)| *t) {
            Ok(at) => at,
            Err(at) => {
                self.lower.insert(at, (tier, CacheIndex::new()));
                at
            }
        };
        Ok(self.lower[at].1.apply(worker, event_id, event)?)
    }

    /// How many blocks the router believes `worker` holds on `tier`.
    pub fn tier_view(&self, worker: WorkerId, tier: Tier) -> usize {
        if tier == Tier::Device {
            return self.cache_view(worker);
        }
        self.lower
            .iter()
            .find(|(t, _)| *t == tier)
            .map_or(0, |(_, ix)| ix.block_count(worker))
    }

    /// Extends every worker's leading run over its predicted blocks.
    ///
    /// Walks only the workers with a prediction holding the block where their run ends (one
    /// scan of the predictions). A worker out of routing may get a longer run too: nothing reads
    /// it (`Overlaps::set_run` keeps each worker's run apart, and only the runs by dense index
    /// are read here).
    fn extend_predicted(&mut self, blocks: &[BlockHash]) {
        let now = self.now;
        let (predicted, overlaps) = (&self.predicted, &mut self.overlaps);
        let mut extending = std::mem::take(&mut self.extending);
        extending.clear();
        predicted.extending(blocks, now, |i| overlaps.run_at(i), &mut extending);
        for &i in &extending {
            let Some(load) = self.slots.get(i).and_then(Option::as_ref) else {
                continue;
            };
            let from = overlaps.run_at(i);
            let index = &self.index;
            let run = predicted.run(i, blocks, from, now, |b| index.holds(load.id, b));
            if run > from {
                overlaps.set_run(i, load.id, run);
            }
        }
        self.extending = extending;
    }

    /// Hashes `tokens` at the router's block size (a partial tail is ignored), then routes.
    pub fn route_tokens(
        &mut self,
        request_id: RequestId,
        tokens: &[u32],
        role: Role,
    ) -> Result<Decision, Error> {
        let hasher = self.hasher;
        self.route_hashed(&hasher, request_id, tokens, &[], role)
    }

    /// [`route_tokens`](Self::route_tokens) with a salted hash: a LoRA adapter's blocks (or a
    /// cache namespace's) are other blocks than the base model's, exactly as the engine and
    /// [`vllm`](crate#features) ingestion hash them, so only requests for the same adapter hit.
    ///
    /// ```
    /// use kvblock::{BlockHasher, BlockSize};
    /// use kvroute::{KvEvent, RequestId, Role, Router, Salt, WorkerId};
    ///
    /// let bs = BlockSize::new(4)?;
    /// let mut router = Router::builder().block_size(bs).build()?;
    /// let w = WorkerId::new(0);
    /// router.add_worker(w);
    /// let tokens: Vec<u32> = (0..8).collect();
    /// // The engine stored these tokens for the adapter "my-lora".
    /// let blocks = BlockHasher::new(bs).with_lora_name("my-lora").sequence_hashes(&tokens);
    /// router.apply_event(w, 0, &KvEvent::Stored { parent: None, blocks })?;
    ///
    /// let base = router.route_tokens(RequestId::new(1), &tokens, Role::Unified)?;
    /// let lora = router.route_tokens_salted(RequestId::new(2), &tokens, &Salt::lora("my-lora"), Role::Unified)?;
    /// assert_eq!((base.cache_hits, lora.cache_hits), (0, 2));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn route_tokens_salted(
        &mut self,
        request_id: RequestId,
        tokens: &[u32],
        salt: &Salt,
        role: Role,
    ) -> Result<Decision, Error> {
        let hasher = salt.apply(BlockHasher::new(self.config.block_size));
        self.route_hashed(&hasher, request_id, tokens, &[], role)
    }

    /// [`route_tokens_salted`](Self::route_tokens_salted) with each block's extra keys (block
    /// `i` keyed by `keys[i]`; past the end of `keys`, none): a multimodal prompt's image
    /// identifiers and offsets, a cache salt, as vLLM keys its blocks and publishes them in its
    /// events. Build them with [`kvblock::vllm_extra_keys`]. Only a request for the same image
    /// hits its blocks; a request without keys never hits blocks stored with keys.
    ///
    /// ```
    /// use kvblock::{vllm_extra_keys, BlockHasher, BlockSize, MultimodalSpan};
    /// use kvroute::{KvEvent, RequestId, Role, Router, Salt, WorkerId};
    ///
    /// let bs = BlockSize::new(16)?;
    /// let mut router = Router::builder().block_size(bs).build()?;
    /// let w = WorkerId::new(0);
    /// router.add_worker(w);
    /// let tokens = vec![9u32; 32]; // one image's placeholders
    /// let keys = |id| vllm_extra_keys(bs, tokens.len(), &[MultimodalSpan::new(id, 0, 32)], None);
    /// let stored = BlockHasher::new(bs).sequence_hashes_keyed(&tokens, &keys("img-A"));
    /// router.apply_event(w, 0, &KvEvent::Stored { parent: None, blocks: stored })?;
    ///
    /// let same = router.route_tokens_keyed(RequestId::new(1), &tokens, &Salt::default(), &keys("img-A"), Role::Unified)?;
    /// let other = router.route_tokens_keyed(RequestId::new(2), &tokens, &Salt::default(), &keys("img-B"), Role::Unified)?;
    /// assert_eq!((same.cache_hits, other.cache_hits), (2, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn route_tokens_keyed(
        &mut self,
        request_id: RequestId,
        tokens: &[u32],
        salt: &Salt,
        keys: &[ExtraKeys],
        role: Role,
    ) -> Result<Decision, Error> {
        let hasher = salt.apply(BlockHasher::new(self.config.block_size));
        self.route_hashed(&hasher, request_id, tokens, keys, role)
    }

    fn route_hashed(
        &mut self,
        hasher: &BlockHasher,
        request_id: RequestId,
        tokens: &[u32],
        keys: &[ExtraKeys],
        role: Role,
    ) -> Result<Decision, Error> {
        let mut blocks = std::mem::take(&mut self.scratch);
        blocks.clear();
        crate::hash_into(hasher, tokens, keys, &mut blocks);
        // The engine recomputes at least the last token: its hit covers at most len - 1 tokens,
        // which matters to the groups whose rule looks at the blocks just before the hit point.
        self.group_cap = Some(tokens.len().saturating_sub(1) / self.config.block_size.get());
        let d = self.route(request_id, &blocks, role);
        self.scratch = blocks;
        d
    }

    /// Marks a request finished, releasing its in-flight blocks.
    pub fn finish(&mut self, request_id: RequestId) -> Result<(), Error> {
        let mut req = self
            .requests
            .remove(&request_id)
            .ok_or(Error::UnknownRequest { request_id })?;
        if let Some(load) = self.slots.get_mut(req.slot).and_then(Option::as_mut) {
            if load.generation == req.generation {
                load.blocks.release(&req.blocks);
                load.requests -= 1;
                match req.prefill {
                    Some(p) => load.pending -= p,
                    None => load.decode.release(&req.blocks),
                }
                self.mirror(req.slot);
            }
        }
        if self.spare.len() < 64 {
            req.blocks.clear();
            self.spare.push(req.blocks);
        }
        self.share(LoadChange::Finished {
            request: request_id,
        });
        Ok(())
    }

    /// Moves a request past its first token: its uncached blocks leave its worker's pending
    /// prefill and its prompt blocks join the worker's decode blocks (see
    /// [`CostModel::PrefillAware`] and [`BusyThreshold`]). Call it when the first token
    /// arrives; a second call is a no-op. An error when the request is not in flight.
    ///
    /// ```
    /// use kvroute::{BlockHash, RequestId, Role, Router, WorkerId};
    /// let mut router = Router::builder().build()?;
    /// let w = WorkerId::new(0);
    /// router.add_worker(w);
    /// let blocks: Vec<BlockHash> = (1..=4).map(BlockHash::new).collect();
    /// router.route(RequestId::new(1), &blocks, Role::Unified)?;
    /// assert_eq!((router.pending_prefill_blocks(w), router.decode_blocks(w)), (4, 0));
    /// router.prefill_done(RequestId::new(1))?;
    /// assert_eq!((router.pending_prefill_blocks(w), router.decode_blocks(w)), (0, 4));
    /// assert_eq!(router.active_blocks(w), 4); // the seed's load counts both phases
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prefill_done(&mut self, request_id: RequestId) -> Result<(), Error> {
        let req = self
            .requests
            .get_mut(&request_id)
            .ok_or(Error::UnknownRequest { request_id })?;
        let Some(p) = req.prefill.take() else {
            return Ok(());
        };
        if let Some(load) = self.slots.get_mut(req.slot).and_then(Option::as_mut) {
            if load.generation == req.generation {
                load.pending -= p;
                load.decode.add(&req.blocks);
                let slot = req.slot;
                self.mirror(slot);
            }
        }
        self.share(LoadChange::PrefillDone {
            request: request_id,
        });
        Ok(())
    }

    /// Sets the router's clock, by which predicted blocks lapse (see
    /// [`RouterBuilder::predicted_ttl`]): any monotonic clock, such as the time since the
    /// router started. An earlier time than the last is ignored.
    pub fn set_clock(&mut self, now: Duration) {
        if now <= self.now {
            return;
        }
        self.now = now;
        self.predicted.prune(now);
    }

    /// Blocks predicted on `worker` and not yet confirmed by its events nor lapsed.
    pub fn predicted_blocks(&self, worker: WorkerId) -> usize {
        match self.index.worker_index(worker) {
            Some(i) if self.load(i).is_some() => self.predicted.count(i, self.now),
            _ => 0,
        }
    }

    /// Uncached prompt blocks of `worker`'s requests not past their first token.
    pub fn pending_prefill_blocks(&self, worker: WorkerId) -> usize {
        self.worker_load(worker).map_or(0, |l| l.pending)
    }

    /// Distinct prompt blocks of `worker`'s requests past their first token (and of other
    /// replicas' requests, whose phase this router does not know).
    pub fn decode_blocks(&self, worker: WorkerId) -> usize {
        self.worker_load(worker).map_or(0, |l| l.decode.len())
    }

    /// Gives the router what `worker`'s engine reports of its own load (its metrics), or
    /// forgets it (`None`): the [`BusyThreshold`] reads it next to the router's own counts (a
    /// reported KV usage above the decode fraction, more waiting requests than
    /// [`BusyThreshold::waiting_requests`], count the worker busy). Costs are unchanged.
    /// Returns whether `worker` is registered (routable or not); an error for a KV usage that
    /// is not a number from 0 up.
    ///
    /// ```
    /// use kvblock::BlockSize;
    /// use kvroute::{BusyThreshold, ReportedLoad, RequestId, Role, Router, WorkerId};
    ///
    /// let mut router = Router::builder()
    ///     .block_size(BlockSize::new(4)?)
    ///     .busy_threshold(BusyThreshold::new().decode_fraction(0.9, 1_000).waiting_requests(2))
    ///     .build()?;
    /// let (w0, w1) = (WorkerId::new(0), WorkerId::new(1));
    /// router.add_worker(w0);
    /// router.add_worker(w1);
    /// // w0's engine says its KV cache is 95% full: it is busy, w1 gets the requests.
    /// assert!(router.set_reported_load(w0, Some(ReportedLoad::new(8, 0, 0.95)))?);
    /// let tokens: Vec<u32> = (0..8).collect();
    /// for id in 0..3 {
    ///     let d = router.route_tokens(RequestId::new(id), &tokens, Role::Unified)?;
    ///     assert_eq!(d.worker, w1);
    /// }
    /// assert_eq!(router.reported_load(w0).map(|l| l.running), Some(8));
    /// // Forgotten: only the router's own counts decide again.
    /// router.set_reported_load(w0, None)?;
    /// assert_eq!(router.reported_load(w0), None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_reported_load(
        &mut self,
        worker: WorkerId,
        load: Option<ReportedLoad>,
    ) -> Result<bool, Error> {
        if let Some(l) = &load {
            if !(l.kv_usage.is_finite() && l.kv_usage >= 0.0) {
                return Err(Error::InvalidWeight {
                    name: "reported KV usage",
                    value: l.kv_usage,
                });
            }
        }
        let Some(i) = self.index.worker_index(worker) else {
            return Ok(false);
        };
        let Some(slot) = self.slots.get_mut(i).and_then(Option::as_mut) else {
            return Ok(false);
        };
        slot.reported = load;
        self.set_reported(i, load);
        Ok(true)
    }

    /// What `worker`'s engine last reported of its load ([`set_reported_load`](Self::set_reported_load)).
    pub fn reported_load(&self, worker: WorkerId) -> Option<ReportedLoad> {
        self.worker_load(worker)?.reported
    }

    /// Replaces the busy threshold (`None`: nobody is busy); an error names an invalid limit.
    pub fn set_busy_threshold(&mut self, threshold: Option<BusyThreshold>) -> Result<(), Error> {
        if let Some(t) = &threshold {
            t.validate()?;
        }
        self.config.busy = threshold;
        self.busy_limits = busy_limits(&self.config);
        for i in 0..self.reported_busy.len() {
            self.reported_busy[i] = self.reported_busy_at(i);
        }
        self.busy_slots = (0..self.reported_busy.len())
            .filter(|&i| self.over(i, self.busy_limits))
            .count();
        self.free_stale = true;
        Ok(())
    }

    /// Whether worker `i`'s reported load makes it busy.
    fn reported_busy_at(&self, i: usize) -> bool {
        self.config
            .busy
            .is_some_and(|b| b.reported_busy(self.reported_kv[i], self.reported_waiting[i]))
    }

    /// Records what worker `i`'s engine reports of its load (`None`: nothing), keeping
    /// `busy_slots`.
    fn set_reported(&mut self, i: usize, load: Option<ReportedLoad>) {
        let was = self.over(i, self.busy_limits);
        self.reported_kv[i] = load.map_or(0.0, |l| l.kv_usage);
        self.reported_waiting[i] = load.map_or(0, |l| l.waiting);
        self.reported_busy[i] = self.reported_busy_at(i);
        self.count_busy(was, i);
    }

    /// Copies worker `i`'s load (none when its slot is empty) into the vectors the scans read,
    /// keeping `busy_slots`. Every change of a worker's load ends here.
    fn mirror(&mut self, i: usize) {
        // Without a threshold nobody is busy (`set_busy_threshold` counts afresh).
        let counted = self.config.busy.is_some();
        let was = counted && self.over(i, self.busy_limits);
        let (active, pending, decode) = self.slots[i]
            .as_ref()
            .map_or((0, 0, 0), |l| (l.blocks.len(), l.pending, l.decode.len()));
        self.active[i] = active as f64;
        self.queued[i] = [pending as f64, decode as f64];
        self.pending[i] = pending;
        self.decode[i] = decode;
        if counted {
            self.count_busy(was, i);
        }
    }

    /// Counts worker `i`'s change in `busy_slots`, given whether it was busy before.
    #[inline]
    fn count_busy(&mut self, was: bool, i: usize) {
        let now = self.over(i, self.busy_limits);
        self.busy_slots = self.busy_slots + usize::from(now) - usize::from(was);
        self.free_stale |= now != was;
    }

    /// Brings `free_members` up to date, while some worker is busy and it is stale.
    fn refresh_free(&mut self) {
        if self.busy_slots == 0 || !self.free_stale {
            return;
        }
        let mut free = std::mem::take(&mut self.free_members);
        free.clear();
        let limits = self.busy_limits;
        free.extend(
            self.members
                .iter()
                .copied()
                .filter(|&i| !self.over(i, limits)),
        );
        self.free_members = free;
        self.free_stale = false;
    }

    /// Whether worker `i` is busy under `limits` (from [`BusyThreshold::limits`]) or by what its
    /// engine reports: [`is_busy`](Self::is_busy) without a float per worker.
    #[inline]
    fn over(&self, i: usize, limits: (usize, usize)) -> bool {
        self.decode[i] > limits.0 || self.pending[i] > limits.1 || self.reported_busy[i]
    }

    /// The busy threshold in use.
    pub fn busy_threshold(&self) -> Option<BusyThreshold> {
        self.config.busy
    }

    /// The cost model in use.
    pub fn cost_model(&self) -> CostModel {
        self.config.cost_model
    }

    /// Every worker's hits, load and cost for a request, in worker-id order, without routing it.
    pub fn explain(&self, blocks: &[BlockHash], role: Role) -> Vec<Candidate> {
        let weight = self.weight(role);
        let n = blocks.len();
        let predicting = !self.config.predicted_ttl.is_zero();
        let mut ov = self.index.overlaps(blocks);
        for &i in &self.members {
            if let Some(load) = self.load(i).filter(|_| predicting) {
                let from = ov.run_at(i);
                let holds = |b| self.index.holds(load.id, b);
                let run = self.predicted.run(i, blocks, from, self.now, holds);
                if run > from {
                    ov.set_run(i, load.id, run);
                }
            }
        }
        self.groups.cut(&self.index, blocks, n, &mut ov);
        self.members
            .iter()
            .filter_map(|&i| {
                let load = self.load(i)?;
                let hits = ov.run_at(i);
                let (lower, credit) = self.lower_run(load.id, blocks, hits);
                Some(Candidate {
                    worker: load.id,
                    cache_hits: hits,
                    active_blocks: load.blocks.len(),
                    pending_prefill_blocks: load.pending,
                    decode_blocks: load.decode.len(),
                    busy: self.is_busy(i),
                    lower_tier_hits: lower,
                    cost: self.cost_of(weight, n, hits, i) - weight * credit,
                })
            })
            .collect()
    }

    /// Worker `i`'s cost with `hits`, under the cost model.
    #[inline]
    fn cost_of(&self, weight: f64, n: usize, hits: usize, i: usize) -> f64 {
        let (active, queued) = (self.active[i], self.queued[i]);
        score(
            self.config.cost_model,
            weight,
            missing(n, hits),
            active,
            queued,
        )
    }

    /// Worker `i`'s cost for the request being routed.
    #[inline]
    fn cost_at(&self, weight: f64, n: usize, i: usize) -> f64 {
        let c = self.cost_of(weight, n, self.overlaps.run_at(i), i);
        if self.lower.is_empty() {
            c
        } else {
            c - weight * self.lower_credit[i]
        }
    }

    #[inline]
    fn is_busy(&self, i: usize) -> bool {
        self.config.busy.is_some_and(|b| {
            b.is_busy(
                self.decode[i],
                self.pending[i].saturating_mul(self.config.block_size.get()),
                self.reported_kv[i],
                self.reported_waiting[i],
            )
        })
    }

    /// Worker `i`'s load, for the busy fallback.
    fn load_term(&self, i: usize) -> f64 {
        match self.config.cost_model {
            CostModel::Seed => self.active[i],
            CostModel::PrefillAware => (self.pending[i] + self.decode[i]) as f64,
        }
    }

    /// The `Kv` policy's choice: among the workers not busy (all, when every one is busy: then
    /// the least loaded), the lowest cost, or a sample at the router's temperature.
    fn choose_kv(&mut self, weight: f64, n: usize) -> usize {
        // Busy when decode > limits.0 or pending > limits.1 (see `BusyThreshold::limits`), or
        // by its engine's report. While nobody is, the scans take every member untested.
        let some_busy = self.busy_slots > 0;
        let limits = self.busy_limits;
        let t = self.config.temperature;
        // Brings the list of the workers not busy up to date (nothing while nobody is).
        self.refresh_free();
        let costs = Costs {
            model: self.config.cost_model,
            weight,
            n,
            active: &self.active,
            queued: &self.queued,
            overlaps: &self.overlaps,
            credit: (!self.lower.is_empty()).then_some(&self.lower_credit[..]),
        };
        if t == 0.0 && !some_busy && costs.credit.is_none() {
            // The common case, written out: the same scan through `Costs::scan` ran 5–10%
            // slower at 1,024 workers with the prefill-aware cost (the compiler's choices, not
            // the loop's instructions, which read alike).
            let members = self.members.iter().copied();
            let (rng, tied) = (&mut self.rng, &mut self.tied);
            let chosen = match costs.model {
                CostModel::Seed => lowest_of(rng, tied, members, |_| true, |i| costs.seed(i)),
                CostModel::PrefillAware => {
                    lowest_of(rng, tied, members, |_| true, |i| costs.prefill_aware(i))
                }
            };
            return chosen.unwrap_or(self.members[0]);
        }
        // The workers not busy, in member order: the scans take them without a busy test.
        let scanned = if some_busy {
            &self.free_members[..]
        } else {
            &self.members[..]
        };
        if t == 0.0 {
            // One pass over the workers not busy, reading only the load its cost needs.
            let (rng, tied) = (&mut self.rng, &mut self.tied);
            let lowest = Lowest {
                members: scanned,
                rng,
                tied,
            };
            if let Some(i) = costs.scan(lowest) {
                return i;
            }
            // Every worker is busy: the least loaded.
            let (mut rng, mut tied) = (self.rng.clone(), std::mem::take(&mut self.tied));
            let load = |i| self.load_term(i);
            let chosen = lowest_of(
                &mut rng,
                &mut tied,
                self.members.iter().copied(),
                |_| true,
                load,
            );
            let chosen = chosen.unwrap_or(self.members[0]);
            (self.rng, self.tied) = (rng, tied);
            return chosen;
        }
        // The spread of the costs of the workers not busy, in one pass that stores nothing.
        let (min, max, free) = costs.scan(Spread { members: scanned });
        if free > EXACT_SAMPLING {
            // By rejection: a uniformly drawn worker not busy, accepted with probability its
            // weight (see `sample_softmax_rejection`).
            let scale = t * (max - min);
            if !(scale.is_finite() && scale > 0.0) {
                // Equal costs: the lowest, ties broken at random (as below).
                return self.lowest_free(weight, n, limits);
            }
            let m = self.members.len();
            for _ in 0..REJECTION_TRIALS {
                let k = self.uniform(m);
                let i = self.members[k];
                let w = if self.over(i, limits) {
                    0.0
                } else {
                    (-(self.cost_at(weight, n, i) - min) / scale).exp()
                };
                if unit(&mut self.rng) < w {
                    return i;
                }
            }
        }
        let mut eligible = std::mem::take(&mut self.eligible);
        let mut costs = std::mem::take(&mut self.costs);
        eligible.clear();
        costs.clear();
        for &i in &self.members {
            if !self.over(i, limits) {
                eligible.push(i);
                costs.push(self.cost_at(weight, n, i));
            }
        }
        let k = if eligible.is_empty() {
            eligible.extend_from_slice(&self.members);
            costs.extend(eligible.iter().map(|&i| self.load_term(i)));
            argmin(&mut self.rng, &mut self.tied, &costs)
        } else {
            let u = unit(&mut self.rng);
            match sample_softmax(&mut costs, t, u) {
                Some(k) => k,
                // Not sampled: the costs are intact.
                None => argmin(&mut self.rng, &mut self.tied, &costs),
            }
        };
        let chosen = eligible[k];
        self.eligible = eligible;
        self.costs = costs;
        chosen
    }

    /// The lowest cost among the workers not busy under `limits` (some are), ties broken at
    /// random.
    fn lowest_free(&mut self, weight: f64, n: usize, limits: (usize, usize)) -> usize {
        let (mut rng, mut tied) = (self.rng.clone(), std::mem::take(&mut self.tied));
        let keep = |i| !self.over(i, limits);
        let chosen = lowest_of(
            &mut rng,
            &mut tied,
            self.members.iter().copied(),
            keep,
            |i| self.cost_at(weight, n, i),
        );
        (self.rng, self.tied) = (rng, tied);
        chosen.unwrap_or(self.members[0])
    }

    fn round_robin(&mut self) -> usize {
        let i = self.members[self.next_rr % self.members.len()];
        self.next_rr = (self.next_rr + 1) % self.members.len();
        i
    }

    fn uniform(&mut self, n: usize) -> usize {
        ((u128::from(self.rng.next_u64()) * n as u128) >> 64) as usize
    }
}

/// The busy threshold's limits on decode and pending prefill blocks under `config` (see
/// [`BusyThreshold::limits`]); none without a threshold.
fn busy_limits(config: &RouterBuilder) -> (usize, usize) {
    config.busy.map_or((usize::MAX, usize::MAX), |b| {
        b.limits(config.block_size.get())
    })
}

/// Up to this many candidates, temperature sampling computes every candidate's weight
/// ([`sample_softmax`]). Above, it samples by rejection: a worker drawn uniformly (a busy one
/// weighs 0) is accepted with probability its weight `exp(−(cost − min) / (t × (max − min)))`,
/// at most 1, so a trial costs one weight instead of all of them. The accepted worker follows
/// the same distribution; after [`REJECTION_TRIALS`] rejections (a low temperature, where
/// most weights are tiny) it falls back to computing every weight, which draws from it too.
const EXACT_SAMPLING: usize = 16;

/// A uniform draw in [0, 1) from `rng` (53 bits).
#[inline]
fn unit(rng: &mut Xoshiro256PlusPlus) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// The position of the lowest of `costs`, ties broken as [`lowest_of`] breaks them; 0 when
/// there is none.
fn argmin(rng: &mut Xoshiro256PlusPlus, tied: &mut Ties, costs: &[f64]) -> usize {
    let positions = 0..costs.len();
    lowest_of(rng, tied, positions, |_| true, |k| costs[k]).unwrap_or(0)
}

/// Divisors up to this many have their constants in [`DIVISIBILITY`].
const DIVISORS: usize = 256;

/// For each divisor `t` in `1..=DIVISORS` (at `t - 1`): the inverse of its odd part modulo
/// 2^64, and `u64::MAX / t` (see [`divides`]).
const DIVISIBILITY: [(u64, u64); DIVISORS] = {
    let mut table = [(0, 0); DIVISORS];
    let mut k = 0;
    while k < DIVISORS {
        let t = k as u64 + 1;
        let odd = t >> t.trailing_zeros();
        // Newton's iteration: `odd` is its own inverse modulo 8 (3 bits), and each step
        // doubles the bits that are right; five reach 96.
        let mut inv = odd;
        let mut step = 0;
        while step < 5 {
            inv = inv.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(inv)));
            step += 1;
        }
        table[k] = (inv, u64::MAX / t);
        k += 1;
    }
    table
};

/// Whether `t` divides `x`: `x % t == 0`, without a division up to [`DIVISORS`]. The two-pass
/// scan runs it for each tie of the lowest, one after the other with no branch to hide them
/// behind, and a 64-bit division takes longer than the rest of a tie's step.
///
/// The test of Granlund and Montgomery (Hacker's Delight, 10–17): with `t = odd × 2^k`,
/// `t` divides `x` exactly when `x × odd⁻¹ mod 2^64`, rotated right by `k`, is at most
/// `⌊(2^64 − 1) / t⌋`. The multiple `x = q × t` maps to `q`, which is that small; any other
/// `x` maps to a larger value or has one of its `k` low bits set, which the rotation brings to
/// the top.
#[inline]
fn divides(t: u64, x: u64) -> bool {
    match DIVISIBILITY.get((t as usize).wrapping_sub(1)) {
        Some(&(inv, limit)) => x.wrapping_mul(inv).rotate_right(t.trailing_zeros()) <= limit,
        None => x % t == 0,
    }
}

/// What a worker's cost reads for the request being routed, borrowed apart from the router's
/// generator so that a scan can draw while it reads.
struct Costs<'a> {
    model: CostModel,
    weight: f64,
    n: usize,
    active: &'a [f64],
    queued: &'a [[f64; 2]],
    overlaps: &'a Overlaps,
    /// The lower tiers' credit by dense index, when the router has lower tiers.
    credit: Option<&'a [f64]>,
}

impl Costs<'_> {
    /// Worker `i`'s cost under the seed's model, without the lower tiers' credit.
    #[inline(always)]
    fn seed(&self, i: usize) -> f64 {
        seed(
            self.weight,
            missing(self.n, self.overlaps.run_at(i)),
            self.active[i],
        )
    }

    /// Worker `i`'s prefill-aware cost, without the lower tiers' credit.
    #[inline(always)]
    fn prefill_aware(&self, i: usize) -> f64 {
        let [pending, decode] = self.queued[i];
        let lacks = missing(self.n, self.overlaps.run_at(i));
        prefill_aware(self.weight, lacks, pending, decode)
    }

    /// Runs `scan` with the cost function of the router's cost model: one closure per model,
    /// so that each scan is compiled for the load its cost reads.
    #[inline]
    fn scan<S: CostScan>(&self, scan: S) -> S::Out {
        let weight = self.weight;
        match (self.model, self.credit) {
            (CostModel::Seed, None) => scan.run(|i| self.seed(i)),
            (CostModel::Seed, Some(cr)) => scan.run(|i| self.seed(i) - weight * cr[i]),
            (CostModel::PrefillAware, None) => scan.run(|i| self.prefill_aware(i)),
            (CostModel::PrefillAware, Some(cr)) => {
                scan.run(|i| self.prefill_aware(i) - weight * cr[i])
            }
        }
    }
}

/// A pass over the workers' costs, given the cost function by [`Costs::scan`].
trait CostScan {
    type Out;
    fn run(self, cost: impl Fn(usize) -> f64) -> Self::Out;
}

/// The worker of `members` (those not busy) of lowest cost, ties broken as [`lowest_of`] does;
/// `None` when there is none.
struct Lowest<'a> {
    members: &'a [usize],
    rng: &'a mut Xoshiro256PlusPlus,
    tied: &'a mut Ties,
}

impl CostScan for Lowest<'_> {
    type Out = Option<usize>;

    #[inline]
    fn run(self, cost: impl Fn(usize) -> f64) -> Option<usize> {
        let members = self.members.iter().copied();
        lowest_of(self.rng, self.tied, members, |_| true, cost)
    }
}

/// The lowest and highest cost of `members` (those not busy; NaN skipped), and how many those
/// are.
struct Spread<'a> {
    members: &'a [usize],
}

impl CostScan for Spread<'_> {
    type Out = (f64, f64, usize);

    #[inline]
    fn run(self, cost: impl Fn(usize) -> f64) -> (f64, f64, usize) {
        spread(self.members.iter().copied(), cost)
    }
}

/// The lowest and highest `cost` of `members` (NaN skipped), and how many those are;
/// infinities when none is a number.
#[inline]
fn spread(members: impl Iterator<Item = usize>, cost: impl Fn(usize) -> f64) -> (f64, f64, usize) {
    let (mut min, mut max, mut count) = (f64::INFINITY, f64::NEG_INFINITY, 0usize);
    for i in members {
        let c = cost(i);
        // Branches rather than `f64::min`, whose chain of dependent instructions is slower;
        // both skip NaN.
        if c < min {
            min = c;
        }
        if c > max {
            max = c;
        }
        count += 1;
    }
    (min, max, count)
}

/// What the lowest-cost scans keep from one route to the next: the two-pass scan's record of
/// the workers at the running lowest, and the recent scans' draws per 1,024 workers scanned
/// (each scan weighing 1/8).
#[derive(Debug, Clone, Default)]
struct Ties {
    at_lowest: Vec<usize>,
    per_1024: usize,
}

impl Ties {
    /// Recent scans drew for more than one worker in eight.
    const DENSE: usize = 128;
}

/// The worker of `members` that `keep` keeps with the lowest `cost`, ties broken at random
/// (the first one kept when no cost is a number); `None` when none is kept.
///
/// The draws are a contract (each decision, and every later random number, depends on them):
/// those of one scan that keeps the running lowest cost and, at each cost equal to it, draws a
/// number `x` and takes the worker when `ties` (the workers at that cost so far, this one
/// included) divides `x`, so that each of the tied workers ends up chosen with probability
/// 1/ties. Until a cost undercuts it, infinity is the running lowest with no worker at it.
///
/// That scan ([`one_pass`]) branches at each tie, which way at random; where ties are many (the
/// prefill-aware cost ties a fifth of 64 workers in the route bench) the mispredictions cost
/// more than the rest of the scan, and [`two_pass`] draws the same numbers without those
/// branches, at the price of a write per worker, which a scan with few ties does not repay. So
/// the scan follows the recent ones: two passes where more than one worker in eight drew.
#[inline]
fn lowest_of(
    rng: &mut Xoshiro256PlusPlus,
    ties: &mut Ties,
    members: impl ExactSizeIterator<Item = usize> + Clone,
    keep: impl Fn(usize) -> bool,
    cost: impl Fn(usize) -> f64,
) -> Option<usize> {
    let scanned = members.len().max(1);
    let (chosen, draws) = if ties.per_1024 > Ties::DENSE {
        two_pass(rng, &mut ties.at_lowest, members, keep, cost)
    } else {
        one_pass(rng, members, keep, cost)
    };
    let rate = draws.saturating_mul(1024) / scanned;
    ties.per_1024 = (ties.per_1024 * 7 + rate.min(1024)) / 8;
    chosen
}

/// [`lowest_of`] in one pass, as its contract reads, and how many numbers it drew.
///
/// A plain loop rather than an iterator's `filter`, whose `next` (a loop of its own) the
/// compiler leaves as a call per worker: at 1,024 workers that doubled a route with a busy
/// threshold.
///
/// Its tie test keeps the division: behind a branch predicted not taken it costs little, and
/// [`divides`] here made the options-off route at 64 workers 3–8% slower, in two sessions.
#[inline]
fn one_pass(
    rng: &mut Xoshiro256PlusPlus,
    members: impl Iterator<Item = usize>,
    keep: impl Fn(usize) -> bool,
    cost: impl Fn(usize) -> f64,
) -> (Option<usize>, usize) {
    let (mut best, mut ties, mut chosen) = (f64::INFINITY, 0u64, None);
    let mut draws = 0;
    for i in members {
        if !keep(i) {
            continue;
        }
        let c = cost(i);
        let take = if c < best {
            (best, ties) = (c, 1);
            true
        } else if c == best {
            ties += 1;
            draws += 1;
            rng.next_u64() % ties == 0
        } else {
            false
        };
        if take || chosen.is_none() {
            chosen = Some(i);
        }
    }
    (chosen, draws)
}

/// [`lowest_of`] in two passes, and how many numbers it drew. The first branches only on a
/// new lowest (rare and predictable) and writes every worker at the running lowest into
/// `at_lowest` without a branch. The draws of the ties before the lowest's first worker only
/// advance the generator; then each of the lowest's ties draws and is taken without a branch.
#[inline]
fn two_pass(
    rng: &mut Xoshiro256PlusPlus,
    at_lowest: &mut Vec<usize>,
    members: impl ExactSizeIterator<Item = usize> + Clone,
    keep: impl Fn(usize) -> bool,
    cost: impl Fn(usize) -> f64,
) -> (Option<usize>, usize) {
    // Written before it is counted: one slot more than the workers.
    if at_lowest.len() <= members.len() {
        at_lowest.resize(members.len() + 1, 0);
    }
    let (n, first, lows) = at_lowest_of(at_lowest, members.clone(), &keep, &cost);
    let (mut chosen, mut ties, from) = if first == usize::MAX {
        // No cost below infinity: the costs at infinity, if any, are ties with no worker.
        (None, 0, 0)
    } else {
        // Before slot `first`: every earlier lowest but this one, and a draw for each other.
        for _ in 0..first + 1 - lows {
            rng.next_u64();
        }
        (at_lowest.get(first).copied(), 1, first + 1)
    };
    for &i in at_lowest.get(from..n).unwrap_or_default() {
        ties += 1;
        let take = divides(ties, rng.next_u64());
        chosen = if take { Some(i) } else { chosen };
    }
    let draws = n - lows;
    // No cost a number: the first worker kept.
    (
        chosen.or_else(|| members.into_iter().find(|&i| keep(i))),
        draws,
    )
}

/// The first pass of [`two_pass`]: writes the workers at the running lowest cost into
/// `tied`, and returns how many, the slot of the lowest's first worker (`usize::MAX`: none
/// below infinity) and the count of new lowests. A function of its own so that `tied` is a
/// slice the compiler knows no other reference reaches: otherwise its write would make every
/// worker's step reload the load vectors' addresses.
#[inline]
fn at_lowest_of(
    tied: &mut [usize],
    members: impl Iterator<Item = usize>,
    keep: impl Fn(usize) -> bool,
    cost: impl Fn(usize) -> f64,
) -> (usize, usize, usize) {
    let mut best = f64::INFINITY;
    // Workers written; the slot of the lowest's first worker; new lowests so far.
    let (mut n, mut first, mut lows) = (0, usize::MAX, 0);
    for i in members {
        if !keep(i) {
            continue;
        }
        let c = cost(i);
        // At or below the running lowest: one comparison for both cases (false for NaN).
        let at = c <= best;
        if c < best {
            best = c;
            first = n;
            // Opaque, so that the compiler keeps this rare case a branch: as a select, the
            // running lowest would chain every worker's step to the one before.
            lows = std::hint::black_box(lows + 1);
        }
        if let Some(slot) = tied.get_mut(n) {
            *slot = i;
        }
        n += usize::from(at);
    }
    (n, first, lows)
}

/// Trials of temperature sampling by rejection before it falls back to computing every weight.
const REJECTION_TRIALS: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;
    // Named, as proptest's prelude brings another `RngCore` in too.
    use rand_core::{RngCore, SeedableRng};

    proptest! {
        /// `divides` is `x % t == 0` for any `x`, and for multiples of `t` and their
        /// neighbours (a random `x` is rarely a multiple), at divisors in and past the table.
        #[test]
        fn divides_is_the_remainder_test(
            t in 1u64..=DIVISORS as u64 + 64,
            x in any::<u64>(),
            q in any::<u64>(),
        ) {
            prop_assert_eq!(divides(t, x), x % t == 0);
            let m = q / t * t;
            for y in [m, m.wrapping_add(1), m.wrapping_sub(1)] {
                prop_assert_eq!(divides(t, y), y % t == 0, "{} divides {}", t, y);
            }
        }
    }

    /// The scan whose draws [`lowest_of`] keeps: the running lowest, and at each cost equal to
    /// it a draw that takes the worker when the count of tied workers divides it.
    fn lowest_naive(rng: &mut Xoshiro256PlusPlus, costs: &[(bool, f64)]) -> Option<usize> {
        let (mut best, mut ties, mut chosen) = (f64::INFINITY, 0u64, None);
        for (i, &(keep, c)) in costs.iter().enumerate() {
            if !keep {
                continue;
            }
            let take = if c < best {
                (best, ties) = (c, 1);
                true
            } else if c == best {
                ties += 1;
                rng.next_u64() % ties == 0
            } else {
                false
            };
            if take || chosen.is_none() {
                chosen = Some(i);
            }
        }
        chosen
    }

    /// A cost from a few values, so that ties are common: 0 to 3, infinities, NaN.
    fn tie_prone() -> impl Strategy<Value = (bool, f64)> {
        let cost = prop_oneof![
            6 => (0u8..4).prop_map(f64::from),
            1 => Just(f64::INFINITY),
            1 => Just(f64::NEG_INFINITY),
            1 => Just(f64::NAN),
        ];
        (prop::bool::weighted(0.8), cost)
    }

    proptest! {
        /// Both scans choose the worker the naive scan does and leave the generator in the
        /// same state, for any costs (ties, infinities, NaN, workers left out), scan after scan
        /// on one scratch; so does `lowest_of`, whichever scan it takes.
        #[test]
        fn lowest_of_draws_as_the_one_pass_scan(
            scans in prop::collection::vec(prop::collection::vec(tie_prone(), 0..80), 1..6),
            seed in any::<u64>(),
        ) {
            let mut naive = Xoshiro256PlusPlus::seed_from_u64(seed);
            let (mut one, mut two, mut real) = (naive.clone(), naive.clone(), naive.clone());
            let (mut scratch, mut ties) = (Vec::new(), Ties::default());
            for costs in &scans {
                let all = 0..costs.len();
                let (keep, cost) = (|i: usize| costs[i].0, |i: usize| costs[i].1);
                let want = lowest_naive(&mut naive, costs);
                prop_assert_eq!(one_pass(&mut one, all.clone(), keep, cost).0, want);
                prop_assert_eq!(two_pass(&mut two, &mut scratch, all.clone(), keep, cost).0, want);
                prop_assert_eq!(lowest_of(&mut real, &mut ties, all, keep, cost), want);
                let next = naive.clone().next_u64();
                for rng in [&one, &two, &real] {
                    prop_assert_eq!(rng.clone().next_u64(), next);
                }
            }
        }
    }

    /// With no cost a number, the first worker kept; with none kept, none; no draw either way.
    #[test]
    fn lowest_of_without_a_number() {
        let costs = [(false, 0.0), (true, f64::NAN), (true, f64::NAN)];
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
        let before = rng.clone().next_u64();
        for dense in [false, true] {
            let of = |keep: bool| {
                let mut rng = rng.clone();
                let mut ties = Ties {
                    per_1024: if dense { 1024 } else { 0 },
                    ..Ties::default()
                };
                let keep = |i: usize| keep && costs[i].0;
                let got = lowest_of(&mut rng, &mut ties, 0..3, keep, |i| costs[i].1);
                (got, rng.next_u64())
            };
            assert_eq!(of(true), (Some(1), before));
            assert_eq!(of(false), (None, before));
        }
        assert_eq!(rng.next_u64(), before);
    }

    /// Every divisor of the table at the values where the test's bound is tight.
    #[test]
    fn divides_at_the_edges() {
        for t in 1..=DIVISORS as u64 + 1 {
            let top = u64::MAX / t * t;
            for x in [
                0,
                1,
                t - 1,
                t,
                t + 1,
                top - 1,
                top,
                top.wrapping_add(1),
                u64::MAX,
            ] {
                assert_eq!(divides(t, x), x % t == 0, "{t} divides {x}");
            }
        }
    }

    /// The exact probabilities of `sample_softmax` for `costs` at temperature `t`.
    fn softmax(costs: &[f64], t: f64) -> Vec<f64> {
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = costs
            .iter()
            .map(|c| (-(c - min) / (t * (max - min))).exp())
            .collect();
        let total: f64 = w.iter().sum();
        w.iter().map(|x| x / total).collect()
    }

    /// Rejection sampling (40 workers, above [`EXACT_SAMPLING`]) draws from the softmax: at
    /// temperatures where most trials are accepted, and at a low one where it mostly falls back
    /// to computing every weight.
    #[test]
    fn rejection_sampling_follows_the_softmax() {
        let blocks: Vec<BlockHash> = (1..=10).map(BlockHash::new).collect();
        // Worker w holds the first w % 11 blocks: cost 10 - w % 11 (nothing in flight).
        let costs: Vec<f64> = (0..40u32).map(|w| f64::from(10 - w % 11)).collect();
        for (t, seed) in [(0.5, 1), (2.0, 2), (0.05, 3)] {
            let mut r = Router::builder().temperature(t).seed(seed).build().unwrap();
            for w in 0..40u64 {
                let id = WorkerId::new(w);
                r.add_worker(id);
                let held = (w % 11) as usize;
                if held > 0 {
                    let stored = KvEvent::Stored {
                        parent: None,
                        blocks: blocks[..held].to_vec(),
                    };
                    r.apply_event(id, 0, &stored).unwrap();
                }
            }
            let want = softmax(&costs, t);
            let trials = 100_000u32;
            let mut got = vec![0u32; costs.len()];
            for id in 0..u64::from(trials) {
                let d = r.route(RequestId::new(id), &blocks, Role::Unified).unwrap();
                r.finish(RequestId::new(id)).unwrap();
                got[d.worker.get() as usize] += 1;
            }
            for (w, (&g, &p)) in got.iter().zip(&want).enumerate() {
                let f = f64::from(g) / f64::from(trials);
                // Five standard errors.
                let tol = 5.0 * (p * (1.0 - p) / f64::from(trials)).sqrt() + 1e-9;
                assert!((f - p).abs() <= tol, "t={t} worker {w}: {f} vs {p}");
            }
        }
    }

    /// A fleet of more workers than [`EXACT_SAMPLING`] samples by rejection: two seeds route
    /// alike, and the lowest-cost worker wins most often.
    #[test]
    fn large_fleets_sample_by_rejection() {
        let blocks: Vec<BlockHash> = (1..=10).map(BlockHash::new).collect();
        let picks = |seed| {
            let mut r = Router::builder()
                .temperature(0.3)
                .seed(seed)
                .build()
                .unwrap();
            for w in 0..40 {
                r.add_worker(WorkerId::new(w));
            }
            let stored = KvEvent::Stored {
                parent: None,
                blocks: blocks.clone(),
            };
            r.apply_event(WorkerId::new(5), 0, &stored).unwrap();
            (0..2_000)
                .map(|id| {
                    let d = r.route(RequestId::new(id), &blocks, Role::Unified).unwrap();
                    r.finish(RequestId::new(id)).unwrap();
                    d.worker.get()
                })
                .collect::<Vec<_>>()
        };
        let a = picks(9);
        assert_eq!(a, picks(9));
        // Costs 0 (worker 5) and 10 (the 39 others): P(5) = 1 / (1 + 39 e^(-1/0.3)) = 0.418.
        let to_5 = a.iter().filter(|&&w| w == 5).count() as f64 / a.len() as f64;
        assert!((to_5 - 0.418).abs() < 0.05, "{to_5}");
    }
}
