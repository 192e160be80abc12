//! A naive model of `kvcache::BlockCache`, the operation enum [`Op`], and the differential
//! [`step`] that drives the real cache and the model with the same operation, then compares
//! everything observable.
//!
//! One model, one `Op`: the proptest `crates/kvcache/tests/cache_model.rs` generates `Op`s with
//! [`strategy::op`], the fuzz target `block_cache_ops` ([`crate::fuzz::block_cache_ops`]) decodes
//! them from libFuzzer's bytes.
//!
//! ```
//! use kvblock::BlockHash;
//! use kvcache::BlockCache;
//! use kvtest::cache::{step, Model, Op};
//!
//! let (mut real, mut model) = (BlockCache::new(Some(2)), Model::new(Some(2)));
//! let chain: Vec<BlockHash> = (1..=3).map(BlockHash::new).collect();
//! for op in [Op::Insert(chain[..2].to_vec()), Op::Pin(chain[..1].to_vec()), Op::Insert(chain)] {
//!     step(&mut real, &mut model, &op, &[]).unwrap();
//! }
//! ```

use kvblock::BlockHash;
use kvcache::{BlockCache, Error, KvEvent};

/// One resident block of the [`Model`].
#[derive(Debug, Clone)]
pub struct MBlock {
    /// Its sequence hash.
    pub hash: BlockHash,
    /// The block it extends (`None`: it starts a prompt).
    pub parent: Option<BlockHash>,
    /// In-flight requests holding it.
    pub pins: u32,
    /// When it was last used (a model clock tick); lower is less recent.
    pub stamp: u64,
}

/// Why the model rejects an operation (the real error must be of the same kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// `Error::CapacityExhausted`.
    Capacity,
    /// `Error::InconsistentChain`.
    Chain,
    /// `Error::Pinned`.
    Pinned,
}

impl Reject {
    /// The kind of a real error (`None` for an error the model never expects).
    pub fn of(e: &Error) -> Option<Reject> {
        match e {
            Error::CapacityExhausted { .. } => Some(Reject::Capacity),
            Error::InconsistentChain { .. } => Some(Reject::Chain),
            Error::Pinned { .. } => Some(Reject::Pinned),
            _ => None,
        }
    }
}

/// Plain vectors, linear scans, stamps for recency: obviously right, slow.
#[derive(Debug, Default, Clone)]
pub struct Model {
    /// The capacity in blocks (`None`: unbounded).
    pub cap: Option<usize>,
    /// The resident blocks, in no particular order.
    pub blocks: Vec<MBlock>,
    /// The recency clock: every use stamps a block with the next tick.
    pub clock: u64,
    /// Events queued since the last [`step`] compared them.
    pub events: Vec<KvEvent>,
    /// `CacheStats::lookups`.
    pub lookups: u64,
    /// `CacheStats::hit_blocks`.
    pub hit_blocks: u64,
    /// `CacheStats::blocks_stored`.
    pub stored: u64,
    /// `CacheStats::evictions`.
    pub evictions: u64,
}

impl Model {
    /// An empty model of `BlockCache::new(cap)` (`None` and `Some(0)` are both unbounded there).
    pub fn new(cap: Option<usize>) -> Self {
        Model {
            cap: cap.filter(|&c| c > 0),
            ..Model::default()
        }
    }
    fn limit(&self) -> usize {
        self.cap.unwrap_or(usize::MAX)
    }
    /// The resident block `h`.
    pub fn get(&self, h: BlockHash) -> Option<&MBlock> {
        self.blocks.iter().find(|b| b.hash == h)
    }
    fn get_mut(&mut self, h: BlockHash) -> Option<&mut MBlock> {
        self.blocks.iter_mut().find(|b| b.hash == h)
    }
    /// `BlockCache::match_len`: the leading run of `chain` that is resident.
    pub fn match_len(&self, chain: &[BlockHash]) -> usize {
        chain.iter().take_while(|h| self.get(**h).is_some()).count()
    }
    /// `BlockCache::lookup`: [`match_len`](Self::match_len), counted.
    pub fn lookup(&mut self, chain: &[BlockHash]) -> usize {
        let n = self.match_len(chain);
        self.lookups += 1;
        self.hit_blocks += n as u64;
        n
    }
    fn stamp(&mut self, h: BlockHash) {
        self.clock += 1;
        let c = self.clock;
        if let Some(b) = self.get_mut(h) {
            b.stamp = c;
        }
    }
    /// The next victim: least recent among unpinned blocks with no resident child, outside `protect`.
    fn victim(blocks: &[MBlock], protect: &[BlockHash]) -> Option<usize> {
        (0..blocks.len())
            .filter(|&i| {
                let b = &blocks[i];
                b.pins == 0
                    && !protect.contains(&b.hash)
                    && !blocks.iter().any(|c| c.parent == Some(b.hash))
            })
            .min_by_key(|&i| blocks[i].stamp)
    }
    fn evictable(&self, protect: &[BlockHash]) -> usize {
        let mut blocks = self.blocks.clone();
        let mut n = 0;
        while let Some(i) = Self::victim(&blocks, protect) {
            blocks.remove(i);
            n += 1;
        }
        n
    }
    fn evict(&mut self, n: usize, protect: &[BlockHash]) {
        if n == 0 {
            return;
        }
        let mut removed = Vec::new();
        for _ in 0..n {
            let i = Self::victim(&self.blocks, protect).expect("checked");
            removed.push(self.blocks.remove(i).hash);
        }
        self.evictions += n as u64;
        self.events.push(KvEvent::Removed { blocks: removed });
    }
    /// `BlockCache::insert`: the number of blocks stored, or why it fails (changing nothing).
    pub fn insert(&mut self, chain: &[BlockHash]) -> Result<usize, Reject> {
        let mut run = 0;
        for (i, h) in chain.iter().enumerate() {
            match self.get(*h) {
                None => break,
                Some(b) if b.parent != i.checked_sub(1).map(|j| chain[j]) => {
                    return Err(Reject::Chain)
                }
                Some(_) => run += 1,
            }
        }
        let new = &chain[run..];
        for (j, h) in new.iter().enumerate() {
            if self.get(*h).is_some() || new[..j].contains(h) {
                return Err(Reject::Chain);
            }
        }
        let needed = (self.blocks.len() + new.len()).saturating_sub(self.limit());
        if !new.is_empty() && needed > self.evictable(&chain[..run]) {
            return Err(Reject::Capacity);
        }
        if !new.is_empty() {
            self.evict(needed, &chain[..run]);
        }
        for (j, h) in new.iter().enumerate() {
            let parent = (run + j).checked_sub(1).map(|k| chain[k]);
            self.blocks.push(MBlock {
                hash: *h,
                parent,
                pins: 0,
                stamp: 0,
            });
        }
        for h in chain.iter().rev() {
            self.stamp(*h);
        }
        if !new.is_empty() {
            self.stored += new.len() as u64;
            self.events.push(KvEvent::Stored {
                parent: run.checked_sub(1).map(|i| chain[i]),
                blocks: new.to_vec(),
            });
        }
        Ok(new.len())
    }
    /// The leading run of `chain` that is resident and linked as the cache holds it.
    fn linked_run(&self, chain: &[BlockHash], pinned: bool) -> usize {
        let mut prev = None;
        let mut n = 0;
        for h in chain {
            match self.get(*h) {
                Some(b) if (n == 0 || b.parent == prev) && (!pinned || b.pins > 0) => {
                    prev = Some(*h);
                    n += 1;
                }
                _ => break,
            }
        }
        n
    }
    /// `BlockCache::pin`: pins the linked resident leading run; returns its length.
    pub fn pin(&mut self, chain: &[BlockHash]) -> usize {
        let run = self.linked_run(chain, false);
        for h in &chain[..run] {
            self.get_mut(*h).expect("resident").pins += 1;
        }
        run
    }
    /// `BlockCache::unpin`: releases one pin from each block of the linked, pinned leading run
    /// (tail first, so the leading blocks end up the most recent); returns its length.
    pub fn unpin(&mut self, chain: &[BlockHash]) -> usize {
        let run = self.linked_run(chain, true);
        for h in chain[..run].iter().rev() {
            let b = self.get_mut(*h).expect("resident");
            b.pins -= 1;
            if b.pins == 0 {
                self.stamp(*h);
            }
        }
        run
    }
    /// `BlockCache::set_capacity`: evicts down to `cap`, or fails changing nothing.
    pub fn set_capacity(&mut self, cap: Option<usize>) -> Result<(), Reject> {
        let needed = self.blocks.len().saturating_sub(cap.unwrap_or(usize::MAX));
        if needed > self.evictable(&[]) {
            return Err(Reject::Capacity);
        }
        self.cap = cap;
        self.evict(needed, &[]);
        Ok(())
    }
    /// `BlockCache::clear`: drops every block unless one is pinned.
    pub fn clear(&mut self) -> Result<usize, Reject> {
        if self.blocks.iter().any(|b| b.pins > 0) {
            return Err(Reject::Pinned);
        }
        let n = self.blocks.len();
        self.blocks.clear();
        self.events.push(KvEvent::Cleared);
        Ok(n)
    }
    /// `BlockCache::recency_order`: unpinned blocks from least to most recently used.
    pub fn recency(&self) -> Vec<BlockHash> {
        let mut v: Vec<&MBlock> = self.blocks.iter().filter(|b| b.pins == 0).collect();
        v.sort_by_key(|b| b.stamp);
        v.into_iter().map(|b| b.hash).collect()
    }
}

/// One operation on a cache. The proptest generates these with [`strategy::op`], the fuzz target
/// decodes them from bytes.
#[derive(Debug, Clone)]
pub enum Op {
    /// `insert(chain)`.
    Insert(Vec<BlockHash>),
    /// `lookup(chain)`.
    Lookup(Vec<BlockHash>),
    /// `pin(chain)` (the chain may start mid-prompt).
    Pin(Vec<BlockHash>),
    /// `unpin(chain)`.
    Unpin(Vec<BlockHash>),
    /// `set_capacity(capacity)`.
    Capacity(Option<usize>),
    /// `clear()`.
    Clear,
}

macro_rules! ensure_eq {
    ($a:expr, $b:expr, $($ctx:tt)+) => {{
        let (a, b) = (&$a, &$b);
        if a != b {
            return Err(format!(
                "{}: real {:?} != model {:?} ({} vs {})",
                format_args!($($ctx)+),
                a,
                b,
                stringify!($a),
                stringify!($b)
            ));
        }
    }};
}

/// Applies `op` to the real cache and the model, then compares the answers, the drained events,
/// sizes, pins, recency order, counters and the leading run of every `probe`, and runs
/// `check_invariants`. `Err` describes the first disagreement.
pub fn step(
    real: &mut BlockCache,
    model: &mut Model,
    op: &Op,
    probes: &[Vec<BlockHash>],
) -> Result<(), String> {
    match op {
        Op::Insert(c) => {
            let r = real.insert(c);
            let m = model.insert(c);
            ensure_eq!(r.as_ref().ok(), m.as_ref().ok(), "insert {c:?}: {r:?}");
            if let (Err(e), Err(kind)) = (&r, &m) {
                ensure_eq!(Reject::of(e), Some(*kind), "insert {c:?}: error {e}");
            }
        }
        Op::Lookup(c) => ensure_eq!(real.lookup(c), model.lookup(c), "lookup {c:?}"),
        Op::Pin(c) => ensure_eq!(real.pin(c), model.pin(c), "pin {c:?}"),
        Op::Unpin(c) => ensure_eq!(real.unpin(c), model.unpin(c), "unpin {c:?}"),
        Op::Capacity(cap) => {
            let r = real.set_capacity(*cap);
            let m = model.set_capacity(*cap);
            ensure_eq!(r.is_ok(), m.is_ok(), "set_capacity {cap:?}: {r:?}");
            if let (Err(e), Err(kind)) = (&r, &m) {
                ensure_eq!(
                    Reject::of(e),
                    Some(*kind),
                    "set_capacity {cap:?}: error {e}"
                );
            }
            if r.is_ok() {
                ensure_eq!(real.capacity(), *cap, "capacity after set_capacity");
            }
        }
        Op::Clear => {
            let r = real.clear();
            let m = model.clear();
            ensure_eq!(r.as_ref().ok(), m.as_ref().ok(), "clear: {r:?}");
            if let (Err(e), Err(kind)) = (&r, &m) {
                ensure_eq!(Reject::of(e), Some(*kind), "clear: error {e}");
            }
        }
    }
    real.check_invariants()
        .map_err(|e| format!("after {op:?}: {e}"))?;
    let events: Vec<KvEvent> = real.drain_events().collect();
    ensure_eq!(events, model.events, "events after {op:?}");
    model.events.clear();
    ensure_eq!(real.len(), model.blocks.len(), "len after {op:?}");
    ensure_eq!(
        real.pinned_blocks(),
        model.blocks.iter().filter(|b| b.pins > 0).count(),
        "pinned blocks after {op:?}"
    );
    ensure_eq!(
        real.recency_order(),
        model.recency(),
        "recency after {op:?}"
    );
    for b in &model.blocks {
        ensure_eq!(
            real.pin_count(b.hash),
            b.pins,
            "pin count of {} after {op:?}",
            b.hash
        );
        ensure_eq!(
            real.contains(b.hash),
            true,
            "{} resident after {op:?}",
            b.hash
        );
    }
    let s = real.stats();
    ensure_eq!(
        (
            s.lookups,
            s.hit_blocks,
            s.blocks_stored,
            s.evictions,
            s.resident_blocks
        ),
        (
            model.lookups,
            model.hit_blocks,
            model.stored,
            model.evictions,
            model.blocks.len()
        ),
        "stats after {op:?}"
    );
    for q in probes {
        ensure_eq!(
            real.match_len(q),
            model.match_len(q),
            "match_len {q:?} after {op:?}"
        );
    }
    Ok(())
}

/// Proptest strategies for [`Op`].
pub mod strategy {
    use kvblock::{BlockHash, BlockHasher, BlockSize};
    use proptest::prelude::*;

    use super::Op;

    /// Real chained hashes of short token strings over a 3-letter alphabet at block size 1, so
    /// prompts share prefixes often; now and then arbitrary ids, which may contradict the chains.
    pub fn chain() -> impl Strategy<Value = Vec<BlockHash>> {
        let hasher = BlockHasher::new(BlockSize::new(1).expect("non-zero"));
        prop_oneof![
            8 => prop::collection::vec(0u32..3, 0..7).prop_map(move |t| hasher.sequence_hashes(&t)),
            1 => prop::collection::vec(0u64..6, 0..4).prop_map(|v| v.into_iter().map(BlockHash::new).collect()),
        ]
    }

    /// Mostly inserts and pins (also from mid-chain), some lookups, rare capacity changes and
    /// clears.
    pub fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => chain().prop_map(Op::Insert),
            2 => chain().prop_map(Op::Lookup),
            3 => (chain(), 0usize..3).prop_map(|(c, k)| Op::Pin(c[k.min(c.len())..].to_vec())),
            3 => (chain(), 0usize..3).prop_map(|(c, k)| Op::Unpin(c[k.min(c.len())..].to_vec())),
            1 => prop::option::weighted(0.8, 0usize..12).prop_map(Op::Capacity),
            1 => Just(Op::Clear),
        ]
    }

    /// The probes [`step`](super::step) matches after every operation in the proptest: three
    /// 6-block chains at block size 1 that the generated chains often share prefixes with.
    pub fn probes() -> Vec<Vec<BlockHash>> {
        let hasher = BlockHasher::new(BlockSize::new(1).expect("non-zero"));
        [
            [0u32, 1, 2, 0, 1, 2],
            [1, 1, 1, 1, 1, 1],
            [2, 0, 2, 0, 2, 0],
        ]
        .iter()
        .map(|t| hasher.sequence_hashes(t))
        .collect()
    }
}
