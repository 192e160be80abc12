//! `router_ops`: a `kvroute::Router` built with any policy and random settings (including
//! invalid weights, which `build()` must reject), then route / route_tokens / finish /
//! add_worker / remove_worker / apply_event / clear_worker / explain / snapshot_index +
//! restore_index (also of corrupted snapshots) in any order, against a simple model:
//!
//! - never a panic; every `Err` is the expected one (no workers, duplicate or unknown request
//!   id, unknown worker, the index's event errors, a bad snapshot);
//! - `in_flight_total` is the number of routed, unfinished ids; `active_blocks(w)` is the number
//!   of distinct blocks of the in-flight requests routed to `w` since it was (re)registered and
//!   since the last restore (which resets load), and `in_flight(w)` their number;
//! - the cache index is the naive model of `crates/kvcache/tests/model/index.rs` fed the same
//!   events (so `cache_view`, hits, stale flags, next ids and snapshots agree);
//! - a decision names a registered worker, its hits and its cost (`kvroute::cost` with the role's
//!   weight and the load before routing) are right; `Kv` picks a lowest-cost worker, `RoundRobin`
//!   the next worker in id order, `PrefixAware` keeps a key's home unless that home was removed
//!   or a worker was added (and then it moves only to an added worker); `explain` agrees.

use std::collections::{BTreeMap, BTreeSet};

use arbitrary::{Arbitrary, Unstructured};
use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::{IndexSnapshot, KvEvent, WorkerId};
use kvroute::{Decision, Error, Policy, RequestId, Role, Router};

use crate::models::index as index_model;

const MAX_OPS: usize = 300;

#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Weight {
    Quarters(u8),
    Raw(f64),
    Special(u8),
}

impl Weight {
    fn value(self) -> f64 {
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

#[derive(Debug, Arbitrary)]
pub struct Config {
    pub policy: u8,
    pub weight: Weight,
    pub prefill: Option<Weight>,
    pub decode: Option<Weight>,
    pub seed: u64,
    pub prefix_blocks: u8,
    pub vnodes: u8,
    pub block_size: u8,
}

#[derive(Debug, Arbitrary)]
pub enum FuzzEvent {
    Stored { parent: Option<u8>, blocks: Vec<u8> },
    Removed(Vec<u8>),
    Cleared,
}

#[derive(Debug, Arbitrary)]
pub enum FuzzOp {
    Route(u8, Vec<u8>, u8),
    RouteTokens(u8, Vec<u8>, u8),
    Finish(u8),
    Add(u8),
    Remove(u8),
    /// Worker, event id relative to the next expected one, event.
    Apply(u8, i8, FuzzEvent),
    ClearWorker(u8),
    Explain(Vec<u8>, u8),
    Snapshot,
    Restore(u8),
    /// Restore a corrupted copy of a snapshot: a later version, a worker listed twice, or a
    /// block listed twice.
    RestoreBad(u8, u8),
}

#[derive(Debug, Arbitrary)]
pub struct Input {
    pub config: Config,
    pub ops: Vec<FuzzOp>,
}

fn worker(w: u8) -> WorkerId {
    WorkerId::new(match w % 10 {
        8 => 1000,
        9 => u64::MAX,
        k => u64::from(k),
    })
}

fn request(r: u8) -> u64 {
    if r == 255 {
        u64::MAX
    } else {
        u64::from(r % 16)
    }
}

fn role(r: u8) -> Role {
    [Role::Unified, Role::Prefill, Role::Decode][usize::from(r % 3)]
}

fn blocks(v: &[u8]) -> Vec<BlockHash> {
    v.iter()
        .take(10)
        .map(|&b| BlockHash::new(u64::from(b % 8)))
        .collect()
}

fn event(e: &FuzzEvent) -> KvEvent {
    match e {
        FuzzEvent::Stored { parent, blocks: b } => KvEvent::Stored {
            parent: parent.map(|p| BlockHash::new(u64::from(p % 8))),
            blocks: blocks(b),
        },
        FuzzEvent::Removed(b) => KvEvent::Removed { blocks: blocks(b) },
        FuzzEvent::Cleared => KvEvent::Cleared,
    }
}

fn valid_weight(w: f64) -> bool {
    w.is_finite() && w >= 0.0
}

#[derive(Debug, Clone)]
struct Req {
    worker: WorkerId,
    blocks: Vec<BlockHash>,
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
    fn load(&self, w: WorkerId) -> (usize, usize) {
        let reqs: Vec<&Req> = self
            .inflight
            .values()
            .filter(|r| r.counts && r.worker == w)
            .collect();
        let distinct: BTreeSet<BlockHash> =
            reqs.iter().flat_map(|r| r.blocks.iter().copied()).collect();
        (distinct.len(), reqs.len())
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
    }
}

/// Builds the router, or checks that `build()` rejected exactly an invalid configuration.
fn build(c: &Config) -> Option<(Router, Model, BlockHasher)> {
    let policy = Policy::ALL[usize::from(c.policy) % Policy::ALL.len()];
    let weight = c.weight.value();
    let prefill = c.prefill.map(Weight::value);
    let decode = c.decode.map(Weight::value);
    let prefix_blocks = match c.prefix_blocks % 4 {
        3 => usize::MAX,
        k => usize::from(k),
    };
    // The limits rarely (a ring of 65,536 nodes per worker is slow to build), small rings often.
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
    let weights = [Some(weight), prefill, decode];
    let bad_weight = weights.iter().flatten().any(|&w| !valid_weight(w));
    let valid = !bad_weight && prefix_blocks >= 1 && (1..=65_536).contains(&vnodes);
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
            let model = Model {
                policy: Some(policy),
                weights,
                prefix_blocks,
                ..Model::default()
            };
            Some((router, model, BlockHasher::new(block_size)))
        }
        Err(e) => {
            assert!(!valid, "build rejected a valid {c:?}: {e}");
            match e {
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
                Error::InvalidSetting { .. } => assert!(!bad_weight, "{e}"),
                e => panic!("build: unexpected error {e}"),
            }
            None
        }
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
    let hits = m.index.run(d.worker, &blocks);
    let (active, _) = m.load(d.worker);
    assert_eq!(
        (d.request_blocks, d.cache_hits),
        (n, hits),
        "{d:?}: request blocks / hits"
    );
    let want = kvroute::cost(weight, n, hits, active);
    assert_eq!(
        d.cost.to_bits(),
        want.to_bits(),
        "{d:?}: cost, expected {want}"
    );
    match m.policy.expect("built") {
        Policy::Kv => {
            let best = before.iter().map(|c| c.cost).fold(f64::INFINITY, f64::min);
            assert_eq!(d.cost, best, "{d:?} is not a lowest cost of {before:?}");
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
    m.inflight.insert(
        id,
        Req {
            worker: d.worker,
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
    for &w in &m.seen {
        let (active, reqs) = m.load(w);
        assert_eq!(
            (router.active_blocks(w), router.in_flight(w)),
            (active, reqs),
            "{w}: (active blocks, in-flight requests)"
        );
        let view = m.index.workers.get(&w).map_or(0, |s| s.blocks.len());
        assert_eq!(router.cache_view(w), view, "{w}: cache view");
    }
}

/// Runs one input; panics on the first disagreement with the model.
pub fn check(input: &Input) {
    let Some((mut router, mut m, hasher)) = build(&input.config) else {
        return;
    };
    for op in input.ops.iter().take(MAX_OPS) {
        match op {
            FuzzOp::Route(id, b, r) => {
                let (id, b, r) = (request(*id), blocks(b), role(*r));
                route(&mut router, &mut m, id, b.clone(), r, |x| {
                    x.route(RequestId::new(id), &b, r)
                });
            }
            FuzzOp::RouteTokens(id, t, r) => {
                let (id, r) = (request(*id), role(*r));
                let tokens: Vec<u32> = t.iter().take(16).map(|&x| u32::from(x % 3)).collect();
                let b = hasher.sequence_hashes(&tokens);
                route(&mut router, &mut m, id, b, r, |x| {
                    x.route_tokens(RequestId::new(id), &tokens, r)
                });
            }
            FuzzOp::Finish(id) => {
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
            FuzzOp::Add(w) => {
                let w = worker(*w);
                m.seen.insert(w);
                let fresh = !m.index.workers.contains_key(&w);
                assert_eq!(router.add_worker(w), fresh, "add {w}");
                if fresh {
                    m.index.workers.entry(w).or_default();
                    m.added(w);
                }
            }
            FuzzOp::Remove(w) => {
                let w = worker(*w);
                m.seen.insert(w);
                let known = m.index.workers.remove(&w).is_some();
                assert_eq!(router.remove_worker(w), known, "remove {w}");
                if known {
                    m.removed(w);
                }
            }
            FuzzOp::Apply(w, delta, e) => {
                let (w, ev) = (worker(*w), event(e));
                m.seen.insert(w);
                let next = m.index.workers.get(&w).map_or(0, |s| s.next);
                let id = next.saturating_add_signed(i64::from(*delta));
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
                } else {
                    assert_eq!(r, Err(Error::UnknownWorker { worker: w }), "apply to {w}");
                }
            }
            FuzzOp::ClearWorker(w) => {
                let w = worker(*w);
                m.seen.insert(w);
                assert_eq!(router.clear_worker(w), m.index.clear(w), "clear {w}");
            }
            FuzzOp::Explain(b, r) => {
                let (b, r) = (blocks(b), role(*r));
                let got = router.explain(&b, r);
                let weight = m.weight(r);
                let want: Vec<_> = m
                    .registered()
                    .into_iter()
                    .map(|w| {
                        let (hits, (active, _)) = (m.index.run(w, &b), m.load(w));
                        (
                            w,
                            hits,
                            active,
                            kvroute::cost(weight, b.len(), hits, active).to_bits(),
                        )
                    })
                    .collect();
                let got: Vec<_> = got
                    .iter()
                    .map(|c| (c.worker, c.cache_hits, c.active_blocks, c.cost.to_bits()))
                    .collect();
                assert_eq!(got, want, "explain {b:?} {r:?}");
            }
            FuzzOp::Snapshot => {
                if m.snapshots.len() == 4 {
                    m.snapshots.remove(0);
                }
                m.snapshots.push((router.snapshot_index(), m.index.clone()));
            }
            FuzzOp::Restore(k) => {
                if m.snapshots.is_empty() {
                    continue;
                }
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
            }
            FuzzOp::RestoreBad(k, how) => {
                if m.snapshots.is_empty() {
                    continue;
                }
                let (mut snap, _) = m.snapshots[usize::from(*k) % m.snapshots.len()].clone();
                match how % 3 {
                    0 => snap.version = snap.version.wrapping_add(1 + u32::from(*how)),
                    1 if !snap.workers.is_empty() => {
                        let i = usize::from(*how) % snap.workers.len();
                        let dup = snap.workers[i].clone();
                        snap.workers.push(dup);
                    }
                    _ => match snap.workers.iter_mut().find(|w| !w.blocks.is_empty()) {
                        Some(w) => {
                            let b = w.blocks[0];
                            w.blocks.push(b);
                        }
                        None => continue,
                    },
                }
                match router.restore_index(snap) {
                    Err(Error::Index(kvcache::Error::BadSnapshot { .. })) => {}
                    r => panic!("restore of a corrupted snapshot: {r:?}"),
                }
            }
        }
        check_state(&router, &m);
    }
}

/// What the fuzz target does with its bytes, for replaying regressions under `cargo test`.
pub fn run(data: &[u8]) {
    if data.len() < <Input as Arbitrary>::size_hint(0).0 {
        return;
    }
    if let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) {
        check(&input);
    }
}
