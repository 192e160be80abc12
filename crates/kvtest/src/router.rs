//! A naive model of `kvroute::Router` and the one operation enum, [`Op`], that both the proptest
//! (`crates/kvroute/tests/router.rs`, with [`strategy`]) and the fuzz target `router_ops`
//! ([`crate::fuzz::router_ops`], decoding bytes with `arbitrary`) drive it with.
//!
//! A [`Harness`] builds a router from a [`Config`] (any policy and settings, including invalid
//! weights, which `build()` must reject with the right error) and applies route / route_tokens /
//! finish / add_worker / remove_worker / apply_event / clear_worker / explain / snapshot_index +
//! restore_index (also of corrupted snapshots) in any order, checking after every step:
//!
//! - never a panic; every `Err` is the expected one (no workers, duplicate or unknown request
//!   id, unknown worker, the index's event errors with the event's id, a bad snapshot);
//! - every decision: it names a registered worker, its `request_blocks` and `cache_hits` are the
//!   model's (the leading run the model index holds for that worker), its cost is
//!   `kvroute::cost` with the role's weight and the worker's load before routing; `Kv` picks a
//!   lowest-cost worker of `explain`, `RoundRobin` the next worker in id order, `PrefixAware`
//!   keeps a key's home unless that home was removed or a worker was added (and then it moves
//!   only to an added worker);
//! - load: `in_flight_total` is the number of routed, unfinished ids; for every worker ever
//!   named, `active_blocks(w)` is the number of distinct blocks of the in-flight requests routed
//!   to `w` since it was (re)registered and since the last restore (which resets load), and
//!   `in_flight(w)` their number (0 for unknown workers);
//! - the cache index is the naive model of [`crate::index`] fed the same events (so
//!   `cache_view`, hits, stale flags, next ids and snapshots agree; `check_invariants` passes);
//! - `explain` gives, per registered worker in id order, the model's hits, load and cost;
//! - `workers()` is the model's registered set.
//!
//! A disagreement panics with a message naming the step (proptest reports and shrinks panics
//! like failures; libFuzzer keeps the input).
//!
//! The fields of [`Op`] and [`Config`] are small codes (`u8`s, mostly) that the model maps onto
//! ids and settings (see [`worker`], [`request`], [`blocks`], [`role`]), so that the fuzz
//! target's byte layout, its seeds and its regressions stay meaningful, and so that proptest
//! shrinks towards small ids.
//!
//! ```
//! use kvtest::router::{Config, Event, Harness, Op, Weight};
//!
//! let config = Config { weight: Weight::Quarters(4), prefix_blocks: 1, ..Config::default() };
//! let mut h = Harness::new(&config).expect("a valid configuration");
//! let event = Event::Stored { parent: None, blocks: vec![1, 2] };
//! for op in [
//!     Op::Add(0),
//!     Op::Add(1),
//!     Op::Apply { worker: 0, id_delta: 0, event },
//!     Op::Route { id: 7, blocks: vec![1, 2, 3], role: 0 },
//!     Op::Finish(7),
//! ] {
//!     h.step(&op);
//! }
//! assert_eq!(h.router().in_flight_total(), 0);
//! ```

use std::collections::{BTreeMap, BTreeSet};

use arbitrary::Arbitrary;
use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::{IndexSnapshot, KvEvent, WorkerId};
use std::time::Duration;

use kvroute::{
    BusyThreshold, CostModel, Decision, Error, Policy, RequestId, Role, Router, Tier, TierCredits,
};

use crate::index as index_model;

/// An overlap weight: a multiple of 1/4, any `f64`, or one of a few special values (NaN,
/// infinities, negatives, zeros, huge, subnormal, 20).
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Weight {
    /// `q / 4`.
    Quarters(u8),
    /// Exactly this value.
    Raw(f64),
    /// One of 12 special values (`% 12`).
    Special(u8),
}

impl Weight {
    /// The weight this stands for.
    pub fn value(self) -> f64 {
        const SPECIAL: [f64; 12] = [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            -0.0,
            0.0,
            1e308,
            f64::MAX,
            f64::MIN_POSITIVE,
            5e-324,
            -5e-324,
            20.0,
        ];
        match self {
            Weight::Quarters(q) => f64::from(q) / 4.0,
            Weight::Raw(x) => x,
            Weight::Special(k) => SPECIAL[usize::from(k) % SPECIAL.len()],
        }
    }
}

impl Default for Weight {
    /// 1.0.
    fn default() -> Self {
        Weight::Quarters(4)
    }
}

/// The router's settings, as codes.
#[derive(Debug, Clone, Default, Arbitrary)]
pub struct Config {
    /// `Policy::ALL[policy % 4]`.
    pub policy: u8,
    /// The global overlap weight.
    pub weight: Weight,
    /// The prefill weight, when set.
    pub prefill: Option<Weight>,
    /// The decode weight, when set.
    pub decode: Option<Weight>,
    /// The tie-breaking seed.
    pub seed: u64,
    /// `% 4`, and 3 is `usize::MAX` (0 is invalid).
    pub prefix_blocks: u8,
    /// 255: 65,536; 254: 65,537 (invalid); 253: `usize::MAX` (invalid); 252: 0 (invalid); else
    /// `[1, 2, 3, 4, 5, 8, 16, 128][v % 8]`.
    pub vnodes: u8,
    /// `[1, 2, 3, 16][b % 4]` tokens.
    pub block_size: u8,
    /// `CostModel::ALL[c % 2]`.
    pub cost_model: u8,
    /// The temperature, when set (an invalid one must be rejected).
    pub temperature: Option<Weight>,
    /// The busy threshold's decode limit, when set: fraction `(f % 8) / 4` of capacity `c % 8`
    /// blocks (0 of either is invalid).
    pub busy_decode: Option<(u8, u8)>,
    /// The busy threshold's pending-prefill budget in tokens, when set.
    pub busy_prefill: Option<u8>,
    /// Predicted blocks' time to live in milliseconds (0: off).
    pub predicted_ttl_ms: u8,
    /// The host tier's credit `(c % 6) / 4` (above 1 is invalid); `None`: the default.
    pub host_credit: Option<u8>,
}

/// A KV event, as codes of paths (see [`crate::chains`]).
#[derive(Debug, Clone, Arbitrary)]
pub enum Event {
    /// `KvEvent::Stored`.
    Stored {
        /// Where the stored tail starts under its parent (`None`: the whole path from the root).
        parent: Option<u8>,
        /// The stored blocks (at most 10 are used).
        blocks: Vec<u8>,
    },
    /// `KvEvent::Removed` of these blocks.
    Removed(Vec<u8>),
    /// `KvEvent::Cleared`.
    Cleared,
}

impl Event {
    /// The event this stands for.
    pub fn event(&self) -> KvEvent {
        match self {
            Event::Stored { parent, blocks: b } => {
                crate::chains::stored(&b[..b.len().min(10)], *parent, 3)
            }
            Event::Removed(b) => match b.split_first() {
                Some((&from, rest)) => crate::chains::removed(&rest[..rest.len().min(10)], from, 3),
                None => KvEvent::Removed { blocks: Vec::new() },
            },
            Event::Cleared => KvEvent::Cleared,
        }
    }
}

/// One operation on a router. Worker codes go through [`worker`], request codes through
/// [`request`], block lists through [`blocks`], role codes through [`role`].
///
/// The variants, their order and their field types are the fuzz target's byte layout: changing
/// them changes what its seeds and regressions mean.
#[derive(Debug, Clone, Arbitrary)]
pub enum Op {
    /// `route(request, blocks, role)`.
    Route {
        /// The request code.
        id: u8,
        /// The prompt's blocks.
        blocks: Vec<u8>,
        /// The role code.
        role: u8,
    },
    /// `route_tokens(request, tokens, role)`, tokens `% 3` (at most 16), hashed at the router's
    /// block size.
    RouteTokens {
        /// The request code.
        id: u8,
        /// The prompt's tokens.
        tokens: Vec<u8>,
        /// The role code.
        role: u8,
    },
    /// `finish(request)`.
    Finish(u8),
    /// `add_worker`.
    Add(u8),
    /// `remove_worker`.
    Remove(u8),
    /// `apply_event` with the id the model expects next, plus `id_delta` (saturating).
    Apply {
        /// The worker code.
        worker: u8,
        /// 0 is in order, < 0 a replay, > 0 a gap.
        id_delta: i8,
        /// The event.
        event: Event,
    },
    /// `clear_worker`.
    ClearWorker(u8),
    /// `prefill_done(request)`.
    PrefillDone(u8),
    /// `set_clock` to the model's time plus this many milliseconds.
    Clock(u8),
    /// `apply_tier_event` of the host tier, with the next id (a `Stored` is parentless, as an
    /// engine's demoted blocks are).
    ApplyHost {
        /// The worker code.
        worker: u8,
        /// The event.
        event: Event,
    },
    /// `explain(blocks, role)`.
    Explain {
        /// The prompt's blocks.
        blocks: Vec<u8>,
        /// The role code.
        role: u8,
    },
    /// `snapshot_index()`, kept (with the model index of the time; the last 4).
    Snapshot,
    /// `restore_index` of kept snapshot `k % kept`.
    Restore(u8),
    /// `restore_index` of a corrupted copy of kept snapshot `k % kept` (`how % 3`: a later
    /// version, a worker listed twice, or a block listed twice), which must fail.
    RestoreBad {
        /// Which kept snapshot.
        k: u8,
        /// How to corrupt it.
        how: u8,
    },
}

/// A router's settings and the operations to apply, as the fuzz target decodes them.
#[derive(Debug, Clone, Arbitrary)]
pub struct Input {
    /// The settings.
    pub config: Config,
    /// The operations.
    pub ops: Vec<Op>,
}

/// A worker code: `% 10`, and 8 is 1000, 9 is `u64::MAX`.
pub fn worker(w: u8) -> WorkerId {
    WorkerId::new(match w % 10 {
        8 => 1000,
        9 => u64::MAX,
        k => u64::from(k),
    })
}

/// A request code: `% 16`, and 255 is `u64::MAX`.
pub fn request(r: u8) -> u64 {
    if r == 255 {
        u64::MAX
    } else {
        u64::from(r % 16)
    }
}

/// A role code: `[Unified, Prefill, Decode][r % 3]`.
pub fn role(r: u8) -> Role {
    [Role::Unified, Role::Prefill, Role::Decode][usize::from(r % 3)]
}

/// A block list: the chain of sequence hashes of at most 10 codes of a 3-letter alphabet
/// ([`crate::chains::path`]), so lists that start alike share their leading blocks.
pub fn blocks(v: &[u8]) -> Vec<BlockHash> {
    crate::chains::path(&v[..v.len().min(10)], 3)
}

fn valid_weight(w: f64) -> bool {
    w.is_finite() && w >= 0.0
}

#[derive(Debug, Clone)]
struct Req {
    worker: WorkerId,
    blocks: Vec<BlockHash>,
    /// Its uncached blocks until its first token.
    prefill: Option<usize>,
    /// Still counted in its worker's load (false once the worker was removed or the index
    /// restored: both reset load).
    counts: bool,
}

#[derive(Debug, Default)]
struct Model {
    policy: Option<Policy>,
    weights: [f64; 3],
    prefix_blocks: usize,
    /// Registered workers are exactly the workers of the index model.
    index: index_model::Model,
    inflight: BTreeMap<u64, Req>,
    next_rr: usize,
    /// Every worker ever named, to check that unknown ones report no load.
    seen: BTreeSet<WorkerId>,
    /// `PrefixAware`: for a ring key (its block), the workers it may map to now: its last home,
    /// and every worker added since. A key with no entry may map anywhere.
    homes: BTreeMap<BlockHash, BTreeSet<WorkerId>>,
    snapshots: Vec<(IndexSnapshot, index_model::Model)>,
    cost_model: CostModel,
    temperature: f64,
    busy: Option<BusyThreshold>,
    block_size: usize,
    /// Predicted blocks' time to live, and the clock, in milliseconds.
    ttl: u64,
    now: u64,
    /// Per worker: predicted blocks and when each lapses.
    predicted: BTreeMap<WorkerId, BTreeMap<BlockHash, u64>>,
    /// Per worker: the host tier's blocks and its next event id.
    host: BTreeMap<WorkerId, (BTreeSet<BlockHash>, u64)>,
    host_credit: f64,
}

/// A worker's load as the model counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Load {
    active: usize,
    requests: usize,
    pending: usize,
    decode: usize,
}

impl Model {
    fn registered(&self) -> Vec<WorkerId> {
        self.index.workers.keys().copied().collect()
    }
    fn weight(&self, role: Role) -> f64 {
        match role {
            Role::Unified => self.weights[0],
            Role::Prefill => self.weights[1],
            Role::Decode => self.weights[2],
        }
    }
    fn load_of(&self, w: WorkerId) -> Load {
        let reqs: Vec<&Req> = self
            .inflight
            .values()
            .filter(|r| r.counts && r.worker == w)
            .collect();
        let distinct = |f: &dyn Fn(&Req) -> bool| {
            reqs.iter()
                .filter(|r| f(r))
                .flat_map(|r| r.blocks.iter().copied())
                .collect::<BTreeSet<BlockHash>>()
                .len()
        };
        Load {
            active: distinct(&|_| true),
            requests: reqs.len(),
            pending: reqs.iter().filter_map(|r| r.prefill).sum(),
            decode: distinct(&|r| r.prefill.is_none()),
        }
    }
    /// The leading run `w` holds or is predicted to hold.
    fn hits(&self, w: WorkerId, b: &[BlockHash]) -> usize {
        let mut r = self.index.run(w, b);
        let (Some(pred), Some(held)) = (self.predicted.get(&w), self.index.workers.get(&w)) else {
            return r;
        };
        while r < b.len()
            && (pred.get(&b[r]).is_some_and(|&t| t > self.now) || held.blocks.contains(&b[r]))
        {
            r += 1;
        }
        r
    }
    fn predicted_count(&self, w: WorkerId) -> usize {
        self.predicted
            .get(&w)
            .map_or(0, |p| p.values().filter(|&&t| t > self.now).count())
    }
    fn cost(&self, w: WorkerId, weight: f64, n: usize, hits: usize, b: &[BlockHash]) -> f64 {
        let l = self.load_of(w);
        let c = match self.cost_model {
            CostModel::PrefillAware => {
                kvroute::prefill_aware_cost(weight, n, hits, l.pending, l.decode)
            }
            _ => kvroute::cost(weight, n, hits, l.active),
        };
        let credit = (0..self.host_run(w, b, hits)).fold(0.0, |a, _| a + self.host_credit);
        c - weight * credit
    }
    /// The run of `b[from..]` on `w`'s host tier.
    fn host_run(&self, w: WorkerId, b: &[BlockHash], from: usize) -> usize {
        self.host.get(&w).map_or(0, |(set, _)| {
            b[from.min(b.len())..]
                .iter()
                .take_while(|x| set.contains(x))
                .count()
        })
    }
    fn busy(&self, w: WorkerId) -> bool {
        let Some(b) = self.busy else {
            return false;
        };
        let l = self.load_of(w);
        b.decode_limit()
            .is_some_and(|(f, cap)| l.decode as f64 > f * cap as f64)
            || b.prefill_limit()
                .is_some_and(|t| l.pending * self.block_size > t)
    }
    fn load_term(&self, w: WorkerId) -> usize {
        let l = self.load_of(w);
        match self.cost_model {
            CostModel::PrefillAware => l.pending + l.decode,
            _ => l.active,
        }
    }
    fn added(&mut self, w: WorkerId) {
        for set in self.homes.values_mut() {
            set.insert(w);
        }
    }
    fn removed(&mut self, w: WorkerId) {
        for r in self.inflight.values_mut() {
            if r.worker == w {
                r.counts = false;
            }
        }
        // A key that may live on `w` moves to whichever node follows on the ring: any worker.
        // Keys that cannot live on `w` stay where they are.
        self.homes.retain(|_, s| !s.contains(&w));
        self.predicted.remove(&w);
        self.host.remove(&w);
    }
}

/// A real router and its model, driven in lockstep.
#[derive(Debug)]
pub struct Harness {
    router: Router,
    model: Model,
    hasher: BlockHasher,
}

impl Harness {
    /// Builds the router, checking that `build()` accepts exactly the valid configurations (and
    /// then reports the settings given) and rejects the others with the right error: `None`
    /// then. Panics on a disagreement.
    pub fn new(c: &Config) -> Option<Harness> {
        let policy = Policy::ALL[usize::from(c.policy) % Policy::ALL.len()];
        let weight = c.weight.value();
        let prefill = c.prefill.map(Weight::value);
        let decode = c.decode.map(Weight::value);
        let prefix_blocks = match c.prefix_blocks % 4 {
            3 => usize::MAX,
            k => usize::from(k),
        };
        // The limits rarely (a ring of 65,536 nodes per worker is slow to build), small rings
        // often.
        let vnodes = match c.vnodes {
            255 => 65_536,
            254 => 65_537,
            253 => usize::MAX,
            252 => 0,
            v => [1, 2, 3, 4, 5, 8, 16, 128][usize::from(v % 8)],
        };
        let bs = [1, 2, 3, 16][usize::from(c.block_size % 4)];
        let block_size = BlockSize::new(bs).expect("non-zero");

        let mut b = Router::builder()
            .block_size(block_size)
            .policy(policy)
            .overlap_weight(weight)
            .seed(c.seed)
            .prefix_blocks(prefix_blocks)
            .virtual_nodes(vnodes);
        if let Some(w) = prefill {
            b = b.prefill_overlap_weight(w);
        }
        if let Some(w) = decode {
            b = b.decode_overlap_weight(w);
        }
        let cost_model = CostModel::ALL[usize::from(c.cost_model) % CostModel::ALL.len()];
        let temperature = c.temperature.map(Weight::value);
        let mut busy = None;
        let mut bad_busy = false;
        if c.busy_decode.is_some() || c.busy_prefill.is_some() {
            let mut t = BusyThreshold::new();
            if let Some((f, cap)) = c.busy_decode {
                let (f, cap) = (f64::from(f % 8) / 4.0, usize::from(cap % 8));
                bad_busy = f == 0.0 || cap == 0;
                t = t.decode_fraction(f, cap);
            }
            if let Some(tokens) = c.busy_prefill {
                t = t.prefill_tokens(usize::from(tokens));
            }
            b = b.busy_threshold(t);
            busy = Some(t);
        }
        let ttl = u64::from(c.predicted_ttl_ms);
        let host_credit = c
            .host_credit
            .map_or(TierCredits::default().host(), |k| f64::from(k % 6) / 4.0);
        b = b
            .cost_model(cost_model)
            .predicted_ttl(Duration::from_millis(ttl))
            .tier_credits(TierCredits::new(host_credit, 0.0));
        let bad_busy = bad_busy || host_credit > 1.0;
        if let Some(t) = temperature {
            b = b.temperature(t);
        }
        let weights = [Some(weight), prefill, decode, temperature];
        let bad_weight = weights.iter().flatten().any(|&w| !valid_weight(w));
        let valid =
            !bad_weight && !bad_busy && prefix_blocks >= 1 && (1..=65_536).contains(&vnodes);
        match b.build() {
            Ok(router) => {
                assert!(valid, "build accepted {c:?}");
                let weights = [weight, prefill.unwrap_or(weight), decode.unwrap_or(weight)];
                for (i, r) in [Role::Unified, Role::Prefill, Role::Decode]
                    .into_iter()
                    .enumerate()
                {
                    assert_eq!(
                        router.weight(r).to_bits(),
                        weights[i].to_bits(),
                        "weight of {r:?}"
                    );
                }
                assert_eq!((router.policy(), router.block_size()), (policy, block_size));
                assert_eq!(
                    (router.cost_model(), router.busy_threshold()),
                    (cost_model, busy)
                );
                let model = Model {
                    policy: Some(policy),
                    weights,
                    prefix_blocks,
                    cost_model,
                    temperature: temperature.unwrap_or(0.0),
                    busy,
                    block_size: bs,
                    ttl,
                    host_credit,
                    ..Model::default()
                };
                Some(Harness {
                    router,
                    model,
                    hasher: BlockHasher::new(block_size),
                })
            }
            Err(e) => {
                assert!(!valid, "build rejected a valid {c:?}: {e}");
                match e {
                    Error::InvalidWeight {
                        name: "busy decode fraction" | "host tier credit",
                        ..
                    }
                    | Error::InvalidSetting {
                        name: "busy capacity blocks",
                        ..
                    } => assert!(bad_busy && !bad_weight, "{e}"),
                    Error::InvalidWeight { value, .. } => {
                        assert!(bad_weight, "{e}");
                        assert!(
                            weights
                                .iter()
                                .flatten()
                                .any(|w| !valid_weight(*w) && w.to_bits() == value.to_bits()),
                            "{e} names a weight that was not given"
                        );
                    }
                    Error::InvalidSetting { .. } => assert!(!bad_weight && !bad_busy, "{e}"),
                    e => panic!("build: unexpected error {e}"),
                }
                None
            }
        }
    }

    /// The real router.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Applies `op` to the router and the model, checks the answer, then the whole observable
    /// state (see the module documentation). Panics on the first disagreement.
    pub fn step(&mut self, op: &Op) {
        let Harness {
            router,
            model: m,
            hasher,
        } = self;
        match op {
            Op::Route {
                id,
                blocks: b,
                role: r,
            } => {
                let (id, b, r) = (request(*id), blocks(b), role(*r));
                route(router, m, id, b.clone(), r, |x| {
                    x.route(RequestId::new(id), &b, r)
                });
            }
            Op::RouteTokens {
                id,
                tokens,
                role: r,
            } => {
                let (id, r) = (request(*id), role(*r));
                let tokens: Vec<u32> = tokens.iter().take(16).map(|&x| u32::from(x % 3)).collect();
                let b = hasher.sequence_hashes(&tokens);
                route(router, m, id, b, r, |x| {
                    x.route_tokens(RequestId::new(id), &tokens, r)
                });
            }
            Op::Finish(id) => {
                let id = request(*id);
                let r = router.finish(RequestId::new(id));
                if m.inflight.remove(&id).is_some() {
                    assert_eq!(r, Ok(()), "finish {id}");
                } else {
                    assert_eq!(
                        r,
                        Err(Error::UnknownRequest {
                            request_id: RequestId::new(id)
                        }),
                        "finish {id}"
                    );
                }
            }
            Op::PrefillDone(id) => {
                let id = request(*id);
                let r = router.prefill_done(RequestId::new(id));
                match m.inflight.get_mut(&id) {
                    Some(req) => {
                        assert_eq!(r, Ok(()), "prefill_done {id}");
                        req.prefill = None;
                    }
                    None => assert_eq!(
                        r,
                        Err(Error::UnknownRequest {
                            request_id: RequestId::new(id)
                        }),
                        "prefill_done {id}"
                    ),
                }
            }
            Op::ApplyHost {
                worker: w,
                event: e,
            } => {
                let w = worker(*w);
                m.seen.insert(w);
                let ev = match e.event() {
                    KvEvent::Stored { blocks, .. } => KvEvent::Stored {
                        parent: None,
                        blocks,
                    },
                    other => other,
                };
                let next = m.host.get(&w).map_or(0, |h| h.1);
                let r = router.apply_tier_event(w, Tier::Host, next, &ev);
                if m.index.workers.contains_key(&w) {
                    assert!(r.is_ok(), "host event of {w}: {r:?}");
                    let (set, id) = m.host.entry(w).or_default();
                    *id += 1;
                    match ev {
                        KvEvent::Stored { blocks, .. } => set.extend(blocks),
                        KvEvent::Removed { blocks } => {
                            for b in blocks {
                                set.remove(&b);
                            }
                        }
                        KvEvent::Cleared => set.clear(),
                    }
                } else {
                    assert_eq!(
                        r,
                        Err(Error::UnknownWorker { worker: w }),
                        "host event of {w}"
                    );
                }
            }
            Op::Clock(dt) => {
                m.now += u64::from(*dt);
                router.set_clock(Duration::from_millis(m.now));
            }
            Op::Add(w) => {
                let w = worker(*w);
                m.seen.insert(w);
                let fresh = !m.index.workers.contains_key(&w);
                assert_eq!(router.add_worker(w), fresh, "add {w}");
                if fresh {
                    m.index.workers.entry(w).or_default();
                    m.added(w);
                }
            }
            Op::Remove(w) => {
                let w = worker(*w);
                m.seen.insert(w);
                let known = m.index.workers.remove(&w).is_some();
                assert_eq!(router.remove_worker(w), known, "remove {w}");
                if known {
                    m.removed(w);
                }
            }
            Op::Apply {
                worker: w,
                id_delta,
                event: e,
            } => {
                let (w, ev) = (worker(*w), e.event());
                m.seen.insert(w);
                let next = m.index.workers.get(&w).map_or(0, |s| s.next);
                let id = next.saturating_add_signed(i64::from(*id_delta));
                let r = router.apply_event(w, id, &ev);
                if m.index.workers.contains_key(&w) {
                    let mm = m.index.apply(w, id, &ev);
                    let r = r.map_err(|e| match e {
                        Error::Index(e) => e,
                        e => panic!("apply {w} {id} {ev:?}: unexpected {e}"),
                    });
                    if let Err(e) = index_model::same_outcome(&r, &mm, id) {
                        panic!("apply {w} {id} {ev:?}: {e}");
                    }
                    if r.is_ok() {
                        // The worker's events confirm its predictions (or clear them).
                        if let Some(p) = m.predicted.get_mut(&w) {
                            match &ev {
                                KvEvent::Stored { blocks, .. } => {
                                    for b in blocks {
                                        p.remove(b);
                                    }
                                }
                                KvEvent::Cleared => p.clear(),
                                KvEvent::Removed { .. } => {}
                            }
                        }
                    }
                } else {
                    assert_eq!(r, Err(Error::UnknownWorker { worker: w }), "apply to {w}");
                }
            }
            Op::ClearWorker(w) => {
                let w = worker(*w);
                m.seen.insert(w);
                assert_eq!(router.clear_worker(w), m.index.clear(w), "clear {w}");
                if m.index.workers.contains_key(&w) {
                    m.predicted.remove(&w);
                    if let Some((set, _)) = m.host.get_mut(&w) {
                        set.clear();
                    }
                }
            }
            Op::Explain { blocks: b, role: r } => {
                let (b, r) = (blocks(b), role(*r));
                let got = router.explain(&b, r);
                let weight = m.weight(r);
                let want: Vec<_> = m
                    .registered()
                    .into_iter()
                    .map(|w| {
                        let (hits, l) = (m.hits(w, &b), m.load_of(w));
                        (
                            w,
                            (hits, m.host_run(w, &b, hits)),
                            (l.active, l.pending, l.decode, m.busy(w)),
                            m.cost(w, weight, b.len(), hits, &b).to_bits(),
                        )
                    })
                    .collect();
                let got: Vec<_> = got
                    .iter()
                    .map(|c| {
                        (
                            c.worker,
                            (c.cache_hits, c.lower_tier_hits),
                            (
                                c.active_blocks,
                                c.pending_prefill_blocks,
                                c.decode_blocks,
                                c.busy,
                            ),
                            c.cost.to_bits(),
                        )
                    })
                    .collect();
                assert_eq!(got, want, "explain {b:?} {r:?}");
            }
            Op::Snapshot => {
                if m.snapshots.len() == 4 {
                    m.snapshots.remove(0);
                }
                m.snapshots.push((router.snapshot_index(), m.index.clone()));
            }
            Op::Restore(k) => {
                if !m.snapshots.is_empty() {
                    let (snap, saved) = m.snapshots[usize::from(*k) % m.snapshots.len()].clone();
                    if let Err(e) = router.restore_index(snap) {
                        panic!("restore of a router's own snapshot failed: {e}");
                    }
                    let mut index = saved;
                    let before = m.registered();
                    for &w in &before {
                        index.workers.entry(w).or_default();
                    }
                    m.index = index;
                    for w in m.registered() {
                        if !before.contains(&w) {
                            m.added(w);
                        }
                    }
                    for r in m.inflight.values_mut() {
                        r.counts = false;
                    }
                    m.predicted.clear();
                    // The lower tiers refill from events; their ids go on.
                    for (set, _) in m.host.values_mut() {
                        set.clear();
                    }
                }
            }
            Op::RestoreBad { k, how } => {
                if !m.snapshots.is_empty() {
                    restore_bad(router, m, *k, *how);
                }
            }
        }
        check_state(router, m);
    }
}

fn restore_bad(router: &mut Router, m: &Model, k: u8, how: u8) {
    let (mut snap, _) = m.snapshots[usize::from(k) % m.snapshots.len()].clone();
    match how % 3 {
        0 => snap.version = snap.version.wrapping_add(1 + u32::from(how)),
        1 if !snap.workers.is_empty() => {
            let i = usize::from(how) % snap.workers.len();
            let dup = snap.workers[i].clone();
            snap.workers.push(dup);
        }
        _ => match snap.workers.iter_mut().find(|w| !w.blocks.is_empty()) {
            Some(w) => {
                let b = w.blocks[0];
                w.blocks.push(b);
            }
            None => return,
        },
    }
    match router.restore_index(snap) {
        Err(Error::Index(kvcache::Error::BadSnapshot { .. })) => {}
        r => panic!("restore of a corrupted snapshot: {r:?}"),
    }
}

fn route(
    router: &mut Router,
    m: &mut Model,
    id: u64,
    blocks: Vec<BlockHash>,
    role: Role,
    result: impl FnOnce(&mut Router) -> Result<Decision, Error>,
) {
    let registered = m.registered();
    let before = router.explain(&blocks, role);
    let r = result(router);
    if registered.is_empty() {
        assert_eq!(r, Err(Error::NoWorkers), "route {id} with no worker");
        return;
    }
    if m.inflight.contains_key(&id) {
        assert_eq!(
            r,
            Err(Error::DuplicateRequest {
                request_id: RequestId::new(id)
            }),
            "route {id} twice"
        );
        return;
    }
    let d = r.unwrap_or_else(|e| panic!("route {id} {blocks:?}: {e}"));
    let weight = m.weight(role);
    let n = blocks.len();
    assert!(
        registered.contains(&d.worker),
        "{d:?} names an unregistered worker"
    );
    let hits = m.hits(d.worker, &blocks);
    assert!(hits <= n, "{d:?}: more hits than blocks");
    assert_eq!(
        (d.request_blocks, d.cache_hits),
        (n, hits),
        "{d:?}: request blocks / hits"
    );
    let want = m.cost(d.worker, weight, n, hits, &blocks);
    assert_eq!(
        d.lower_tier_hits,
        m.host_run(d.worker, &blocks, hits),
        "{d:?}: host hits"
    );
    assert_eq!(
        d.cost.to_bits(),
        want.to_bits(),
        "{d:?}: cost, expected {want}"
    );
    match m.policy.expect("built") {
        Policy::Kv => {
            let free: Vec<_> = before.iter().filter(|c| !c.busy).collect();
            if free.is_empty() {
                // Every worker busy: the least loaded.
                let least = registered.iter().map(|&w| m.load_term(w)).min();
                assert_eq!(
                    Some(m.load_term(d.worker)),
                    least,
                    "{d:?}: all busy, not least loaded"
                );
            } else {
                assert!(
                    !m.busy(d.worker),
                    "{d:?} went to a busy worker of {before:?}"
                );
                if m.temperature == 0.0 {
                    let best = free.iter().map(|c| c.cost).fold(f64::INFINITY, f64::min);
                    assert_eq!(d.cost, best, "{d:?} is not a lowest cost of {before:?}");
                }
            }
        }
        Policy::RoundRobin => {
            assert_eq!(
                d.worker,
                registered[m.next_rr % registered.len()],
                "round robin"
            );
            m.next_rr = (m.next_rr + 1) % registered.len();
        }
        Policy::PrefixAware if n == 0 => {
            assert_eq!(
                d.worker,
                registered[m.next_rr % registered.len()],
                "no key: round robin"
            );
            m.next_rr = (m.next_rr + 1) % registered.len();
        }
        Policy::PrefixAware => {
            let key = blocks[m.prefix_blocks.min(n) - 1];
            if let Some(allowed) = m.homes.get(&key) {
                assert!(
                    allowed.contains(&d.worker),
                    "key {key} moved to {} (may be on {allowed:?})",
                    d.worker
                );
            }
            m.homes.insert(key, BTreeSet::from([d.worker]));
        }
        _ => {}
    }
    if m.ttl > 0 {
        let lapses = m.now + m.ttl;
        let p = m.predicted.entry(d.worker).or_default();
        for &b in &blocks[hits..] {
            p.insert(b, lapses);
        }
    }
    m.inflight.insert(
        id,
        Req {
            worker: d.worker,
            prefill: Some(n - hits),
            blocks,
            counts: true,
        },
    );
}

fn check_state(router: &Router, m: &Model) {
    if let Err(e) = index_model::check(router.index(), &m.index) {
        panic!("router index: {e}");
    }
    assert_eq!(router.workers(), m.registered(), "workers");
    assert_eq!(
        router.in_flight_total(),
        m.inflight.len(),
        "in_flight_total"
    );
    for w in m.seen.iter().chain(m.index.workers.keys()) {
        let l = m.load_of(*w);
        assert_eq!(
            (
                router.active_blocks(*w),
                router.in_flight(*w),
                router.pending_prefill_blocks(*w),
                router.decode_blocks(*w)
            ),
            (l.active, l.requests, l.pending, l.decode),
            "{w}: (active blocks, in-flight requests, pending prefill, decode blocks)"
        );
        assert_eq!(
            router.predicted_blocks(*w),
            m.predicted_count(*w),
            "{w}: predicted blocks"
        );
        assert_eq!(
            router.tier_view(*w, Tier::Host),
            m.host.get(w).map_or(0, |h| h.0.len()),
            "{w}: host tier view"
        );
        let view = m.index.workers.get(w).map_or(0, |s| s.blocks.len());
        assert_eq!(router.cache_view(*w), view, "{w}: cache view");
    }
}

/// Builds the router of `input.config` and applies the first `max_ops` operations; panics on
/// the first disagreement with the model.
pub fn check(input: &Input, max_ops: usize) {
    let Some(mut h) = Harness::new(&input.config) else {
        return;
    };
    for op in input.ops.iter().take(max_ops) {
        h.step(op);
    }
}

/// Proptest strategies for [`Config`] and [`Op`]: valid settings mostly, small ids, events
/// that overlap the routed prompts.
pub mod strategy {
    use kvroute::Policy;
    use proptest::prelude::*;

    use super::{Config, Event, Op, Weight};

    /// A weight: quarters in 0..=5 mostly, now and then a special (possibly invalid) value.
    pub fn weight() -> impl Strategy<Value = Weight> {
        prop_oneof![
            19 => (0u8..=20).prop_map(Weight::Quarters),
            1 => any::<u8>().prop_map(Weight::Special),
        ]
    }

    /// Any policy, mostly valid weights (per-role ones half the time), 1..=2 prefix blocks or
    /// all of them, small rings, any block size; now and then an invalid prefix length.
    pub fn config() -> impl Strategy<Value = Config> {
        (
            0..Policy::ALL.len() as u8,
            weight(),
            prop::option::of(weight()),
            prop::option::of(weight()),
            any::<u64>(),
            prop_oneof![19 => 1u8..4, 1 => Just(0u8)],
            0u8..8,
            any::<u8>(),
            (model(), prop::option::of(0u8..6)),
        )
            .prop_map(
                |(policy, weight, prefill, decode, seed, prefix_blocks, vnodes, block_size, m)| {
                    let (cost_model, temperature, busy_decode, busy_prefill, predicted_ttl_ms) =
                        m.0;
                    let host_credit = m.1;
                    Config {
                        policy,
                        weight,
                        prefill,
                        decode,
                        seed,
                        prefix_blocks,
                        vnodes,
                        block_size,
                        cost_model,
                        temperature,
                        busy_decode,
                        busy_prefill,
                        predicted_ttl_ms,
                        host_credit,
                    }
                },
            )
    }

    /// The routing model's settings: each off half the time; busy limits small enough to bite,
    /// now and then an invalid one.
    #[allow(clippy::type_complexity)]
    fn model() -> impl Strategy<Value = (u8, Option<Weight>, Option<(u8, u8)>, Option<u8>, u8)> {
        (
            0u8..2,
            prop::option::of(weight()),
            prop::option::of((
                prop_oneof![9 => 1u8..8, 1 => Just(0u8)],
                prop_oneof![9 => 1u8..8, 1 => Just(0u8)],
            )),
            prop::option::of(0u8..48),
            prop_oneof![Just(0u8), 1u8..40],
        )
    }

    /// Workers 0..5 mostly, and now and then 1000 or `u64::MAX`.
    fn worker() -> impl Strategy<Value = u8> {
        prop_oneof![10 => 0u8..5, 1 => Just(8u8), 1 => Just(9u8)]
    }

    /// Requests 0..16 mostly, and now and then `u64::MAX`.
    fn request() -> impl Strategy<Value = u8> {
        prop_oneof![15 => 0u8..16, 1 => Just(255u8)]
    }

    fn blocks() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(0u8..8, 0..8)
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            4 => (prop::option::weighted(0.3, 0u8..8), blocks())
                .prop_map(|(parent, blocks)| Event::Stored { parent, blocks }),
            2 => blocks().prop_map(Event::Removed),
            1 => Just(Event::Cleared),
        ]
    }

    /// Routes and finishes mostly, engine events, and now and then every other operation.
    pub fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (request(), blocks(), 0u8..3)
                .prop_map(|(id, blocks, role)| Op::Route { id, blocks, role }),
            2 => (request(), prop::collection::vec(0u8..3, 0..12), 0u8..3)
                .prop_map(|(id, tokens, role)| Op::RouteTokens { id, tokens, role }),
            4 => request().prop_map(Op::Finish),
            2 => request().prop_map(Op::PrefillDone),
            1 => (0u8..30).prop_map(Op::Clock),
            2 => (worker(), event()).prop_map(|(worker, event)| Op::ApplyHost { worker, event }),
            1 => worker().prop_map(Op::Add),
            1 => worker().prop_map(Op::Remove),
            4 => (worker(), prop_oneof![8 => Just(0i8), 1 => -2i8..0, 1 => 1i8..3], event())
                .prop_map(|(worker, id_delta, event)| Op::Apply { worker, id_delta, event }),
            1 => worker().prop_map(Op::ClearWorker),
            1 => (blocks(), 0u8..3).prop_map(|(blocks, role)| Op::Explain { blocks, role }),
            1 => Just(Op::Snapshot),
            1 => any::<u8>().prop_map(Op::Restore),
            1 => (any::<u8>(), any::<u8>()).prop_map(|(k, how)| Op::RestoreBad { k, how }),
        ]
    }
}
