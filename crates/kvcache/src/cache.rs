//! One engine's block cache.

use std::collections::VecDeque;

use crate::tier::HostTier;
use kvblock::BlockHash;

use crate::blockmap::{BlockMap, COMPACT_WAYS};
use crate::prefetch;
use crate::{Error, KvEvent};

const NIL: u32 = u32::MAX;
/// The `parent` of a free slot (no slot has this index: see [`MAX_BLOCKS`]), so that a stale
/// [`SlotId`] is recognised.
const FREE: u32 = u32::MAX - 1;
/// Slots are numbered with `u32`; an unbounded cache is bounded by that.
const MAX_BLOCKS: usize = (u32::MAX - 1) as usize;
/// The `stamp` of a slot that is not in the recency queue (pinned, or free).
const UNLISTED: u32 = u32::MAX;
/// How far ahead of the slot it examines a walk over known slots starts loading one: eviction
/// reads the recency queue in order, and a release has the request's slots, so their
/// addresses are known long before their cold lines are needed.
const SLOTS_AHEAD: usize = 8;

/// 32 bytes, aligned so that no slot spans two cache lines.
#[derive(Debug, Clone)]
#[repr(align(32))]
struct Slot {
    hash: BlockHash,
    parent: u32,
    /// Resident blocks that extend this one.
    children: u32,
    /// In-flight requests holding this block.
    pins: u32,
    /// Resident children with `pins > 0`.
    pinned_children: u32,
    /// A resident child (the last one a chain walk went to), or NIL: walking a chain tries it
    /// before hashing.
    hint: u32,
    /// The stamp of this block's entry in the recency queue, or [`UNLISTED`].
    stamp: u32,
}

/// A resident block's place in a [`BlockCache`], as [`pin_into`](BlockCache::pin_into) and
/// [`insert_into`](BlockCache::insert_into) hand it out: a handle that finds the block again
/// without hashing. It names that block while the block stays resident, which a pinned block
/// always does; after an eviction it may name another block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(u32);

/// Counters of a [`BlockCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Calls to [`BlockCache::lookup`].
    pub lookups: u64,
    /// Blocks those lookups found (the sum of the leading runs).
    pub hit_blocks: u64,
    /// Blocks stored by inserts.
    pub blocks_stored: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Blocks resident now.
    pub resident_blocks: usize,
}

/// One engine's capacity-bounded, content-addressed KV block cache.
///
/// - **Matching**: [`match_len`](Self::match_len) is the longest leading run of a prompt's chain
///   that is resident: one hash probe per matched block plus one.
/// - **Recency**: an insert touches the whole chain, leaving its leading blocks at least as
///   recent as its tail; so does releasing the last pin of a block (the request just used it).
/// - **Eviction**: the least recently used block that is not pinned and that no resident block
///   extends (tail first). The resident set is therefore always prefix-closed: a block is never
///   resident without its whole prefix.
/// - **Pinning**: blocks of in-flight requests are reference counted and never evicted. An insert
///   or a capacity change that cannot make room fails with [`Error::CapacityExhausted`] and
///   changes nothing.
/// - **Events**: every store, eviction and clear is queued as a [`KvEvent`], in order, for
///   [`drain_events`](Self::drain_events).
///
/// ```
/// use kvblock::BlockHash;
/// use kvcache::{BlockCache, KvEvent};
///
/// let chain = |ids: &[u64]| ids.iter().map(|&i| BlockHash::new(i)).collect::<Vec<_>>();
/// let mut cache = BlockCache::new(Some(3));
/// cache.insert(&chain(&[1, 2]))?;
/// cache.insert(&chain(&[3]))?;
/// assert_eq!(cache.match_len(&chain(&[1, 2, 9])), 2);
///
/// cache.insert(&chain(&[4]))?; // full: evicts the least recent leaf, block 2
/// assert_eq!(cache.match_len(&chain(&[1, 2])), 1);
///
/// let events: Vec<KvEvent> = cache.drain_events().collect();
/// assert_eq!(events.last(), Some(&KvEvent::Stored { parent: None, blocks: chain(&[4]) }));
/// assert_eq!(events[2], KvEvent::Removed { blocks: chain(&[2]) });
/// # Ok::<(), kvcache::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct BlockCache {
    capacity: Option<usize>,
    map: BlockMap<u32, COMPACT_WAYS>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// The unpinned resident blocks by recency, least recent first, as `(slot, stamp)`: a use
    /// appends an entry and leaves the block's older one behind, stale (its stamp no longer
    /// the slot's), so that a use writes one slot and the queue's end where a linked list
    /// would rewrite its neighbours; eviction reads the queue in order, so it can load slots
    /// ahead instead of chasing links. Stale entries go at the front as met, and all of them
    /// when they outnumber the live ones ([`compact`](Self::compact)).
    lru: VecDeque<(u32, u32)>,
    /// The next stamp: stamps grow along the queue.
    clock: u32,
    /// Blocks in the queue (resident, unpinned).
    listed: usize,
    pinned: usize,
    /// Unpinned blocks with a pinned child: only misuse of `pin`/`unpin` on partial chains
    /// creates them, and while there are any, the evictable count takes the slow path.
    broken: usize,
    events: Vec<KvEvent>,
    stats: CacheStats,
    scratch: Vec<u32>,
    /// Where evicted blocks go, when the engine offloads to host memory.
    host: Option<HostTier>,
}

impl BlockCache {
    /// A cache of `capacity` blocks; `None` is unbounded (up to 2^32 - 2 blocks), 0 holds
    /// nothing (the same capacity as [`set_capacity`](Self::set_capacity) takes).
    pub fn new(capacity: Option<usize>) -> Self {
        BlockCache {
            capacity,
            // Five ways a line: 30,000 blocks fit 8,192 lines (at most 7/8 full, 73% at
            // 30,000) where four ways needed 16,384. Half the memory, and a few percent off the
            // block-16 simulation, whose engines' maps no longer crowd the CPU cache as much.
            map: BlockMap::with_max_load(7),
            slots: Vec::new(),
            free: Vec::new(),
            lru: VecDeque::new(),
            clock: 0,
            listed: 0,
            pinned: 0,
            broken: 0,
            events: Vec::new(),
            stats: CacheStats::default(),
            scratch: Vec::new(),
            host: None,
        }
    }

    /// Adds a host tier of `capacity` blocks: every block the device evicts is demoted to it
    /// (as vLLM's CPU offloading keeps it), with its own LRU; its events are queued apart
    /// ([`drain_host_events`](Self::drain_host_events)).
    ///
    /// ```
    /// use kvcache::{BlockCache, KvEvent};
    /// use kvblock::BlockHash;
    /// let chain = |ids: &[u64]| ids.iter().copied().map(BlockHash::new).collect::<Vec<_>>();
    /// let mut cache = BlockCache::new(Some(2)).with_host_tier(8);
    /// cache.insert(&chain(&[1, 2]))?;
    /// cache.insert(&chain(&[3, 4]))?; // evicts 2, then 1: both go to the host tier
    /// assert_eq!((cache.match_len(&chain(&[1, 2])), cache.host_run(&chain(&[1, 2]), 0)), (0, 2));
    /// assert_eq!(cache.drain_host_events().collect::<Vec<_>>(),
    ///            [KvEvent::Stored { parent: None, blocks: chain(&[2, 1]) }]);
    /// # Ok::<(), kvcache::Error>(())
    /// ```
    #[must_use]
    pub fn with_host_tier(mut self, capacity: usize) -> Self {
        self.host = Some(HostTier::new(capacity));
        self
    }

    /// The host tier's capacity and how many blocks it holds (`None`: no host tier).
    pub fn host_tier(&self) -> Option<(usize, usize)> {
        self.host.as_ref().map(|h| (h.capacity(), h.len()))
    }

    /// How many of `chain[from..]` the host tier holds as a leading run (0 without one).
    pub fn host_run(&self, chain: &[BlockHash], from: usize) -> usize {
        self.host.as_ref().map_or(0, |h| h.run(chain, from))
    }

    /// [`host_run`](Self::host_run), making those blocks the host tier's most recent (a request
    /// is loading them).
    pub fn take_host_run(&mut self, chain: &[BlockHash], from: usize) -> usize {
        self.host.as_mut().map_or(0, |h| h.take_run(chain, from))
    }

    /// Whether the host tier holds `block`.
    pub fn host_contains(&self, block: BlockHash) -> bool {
        self.host.as_ref().is_some_and(|h| h.contains(block))
    }

    /// The host tier's queued events, oldest first.
    pub fn drain_host_events(&mut self) -> std::vec::Drain<'_, KvEvent> {
        match &mut self.host {
            Some(h) => h.events.drain(..),
            None => self.events.drain(0..0),
        }
    }

    /// How many host-tier events are queued.
    pub fn pending_host_events(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.events.len())
    }

    /// The capacity in blocks (`None`: unbounded).
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    fn limit(&self) -> usize {
        self.capacity.map_or(MAX_BLOCKS, |c| c.min(MAX_BLOCKS))
    }

    /// Blocks resident now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no block is resident.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Resident blocks pinned by in-flight requests.
    pub fn pinned_blocks(&self) -> usize {
        self.pinned
    }

    /// Whether `block` is resident.
    pub fn contains(&self, block: BlockHash) -> bool {
        self.map.contains_key(&block)
    }

    /// How many requests pin `block` (0 when it is not resident).
    pub fn pin_count(&self, block: BlockHash) -> u32 {
        self.map
            .get(&block)
            .map_or(0, |s| self.slots[s as usize].pins)
    }

    /// Counters so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            resident_blocks: self.map.len(),
            ..self.stats
        }
    }

    /// The longest leading run of `chain` that is resident. Changes nothing, counts nothing.
    #[inline]
    pub fn match_len(&self, chain: &[BlockHash]) -> usize {
        let mut prev = NIL;
        for (i, h) in chain.iter().enumerate() {
            match self.find(prev, h) {
                Some(s) => prev = s,
                None => return i,
            }
        }
        chain.len()
    }

    /// The slot of block `h`, trying first the hinted child of `prev` (a slot, or NIL).
    #[inline]
    fn find(&self, prev: u32, h: &BlockHash) -> Option<u32> {
        if prev != NIL {
            let c = self.slots[prev as usize].hint;
            if c != NIL && self.slots[c as usize].hash == *h {
                return Some(c);
            }
        }
        self.map.get(h)
    }

    /// Remembers that a chain walk went from `prev` (a slot, or NIL) to its child `s`.
    #[inline]
    fn set_hint(&mut self, prev: u32, s: u32) {
        if prev != NIL && self.slots[s as usize].parent == prev {
            self.slots[prev as usize].hint = s;
        }
    }

    /// [`match_len`](Self::match_len), counted in the stats as a lookup.
    pub fn lookup(&mut self, chain: &[BlockHash]) -> usize {
        let run = self.match_len(chain);
        self.stats.lookups += 1;
        self.stats.hit_blocks += run as u64;
        run
    }

    /// Stores a prompt's chain (`chain[0]` starts a prompt): touches its resident leading run and
    /// stores the rest, evicting as needed. Returns how many blocks were stored.
    ///
    /// Fails, changing nothing, when room cannot be made ([`Error::CapacityExhausted`]) or when
    /// the chain contradicts the cache ([`Error::InconsistentChain`]).
    pub fn insert(&mut self, chain: &[BlockHash]) -> Result<usize, Error> {
        // The resident leading run, checked to be the same chain the cache holds. Its slots are
        // kept so that touching it needs no second lookup.
        let mut slots = std::mem::take(&mut self.scratch);
        slots.clear();
        let mut last = NIL;
        for (i, h) in chain.iter().enumerate() {
            let Some(s) = self.find(last, h) else { break };
            if self.slots[s as usize].parent != last {
                self.scratch = slots;
                return Err(Error::InconsistentChain {
                    block: *h,
                    position: i,
                    why: "is resident under a different parent",
                });
            }
            slots.push(s);
            last = s;
        }
        let run = slots.len();
        let result = self.insert_after_run(chain, run, last, &mut slots);
        self.scratch = slots;
        result
    }

    fn insert_after_run(
        &mut self,
        chain: &[BlockHash],
        run: usize,
        last: u32,
        slots: &mut Vec<u32>,
    ) -> Result<usize, Error> {
        let new = &chain[run..];
        if new.is_empty() {
            self.touch_slots(slots);
            return Ok(0);
        }
        // Reserve the new keys with the slots they will have (free ones first, then new ones
        // past the end), so that each key is hashed once; a key already present is a duplicate
        // or a block after a gap.
        let mut fresh = self.slots.len();
        for (j, h) in new.iter().enumerate() {
            self.map.warm_ahead(new, j);
            let s = match self.free.last() {
                Some(&s) => s,
                // Below FREE and NIL: the resident count bounds this long before.
                None => u32::try_from(fresh).map_or(FREE, |s| s.min(FREE)),
            };
            if self.map.insert_absent(*h, s) {
                if self.free.pop().is_none() {
                    fresh += 1;
                }
                slots.push(s);
            } else {
                let why = if new[..j].contains(h) {
                    "appears twice"
                } else {
                    "is resident after a block that is not"
                };
                self.unreserve(&new[..j], slots, run);
                return Err(Error::InconsistentChain {
                    block: *h,
                    position: run + j,
                    why,
                });
            }
        }
        let resident = self.map.len() - new.len();
        let needed = (resident + new.len()).saturating_sub(self.limit());
        if needed > 0 || fresh > FREE as usize {
            let evictable = self.evictable(last, new.len());
            if needed > evictable || fresh > FREE as usize {
                self.unreserve(new, slots, run);
                return Err(self.exhausted(needed, evictable));
            }
        }
        if last != NIL {
            // The run gains a resident child now, so eviction cannot take it.
            self.slots[last as usize].children += 1;
        }
        // Most recent first, so eviction below does not have to step over the run.
        self.touch_slots(&slots[..run]);
        self.evict(needed);

        let mut parent = last;
        for (j, &s) in slots[run..].iter().enumerate() {
            let h = new[j];
            let slot = Slot {
                hash: h,
                parent,
                children: u32::from(j + 1 < new.len()),
                pins: 0,
                pinned_children: 0,
                hint: NIL,
                stamp: UNLISTED,
            };
            // The reserved slots past the end come in order.
            match self.slots.get_mut(s as usize) {
                Some(old) => *old = slot,
                None => self.slots.push(slot),
            }
            if parent != NIL {
                self.slots[parent as usize].hint = s;
            }
            parent = s;
        }
        self.touch_slots(slots);
        self.stats.blocks_stored += new.len() as u64;
        self.events.push(KvEvent::Stored {
            parent: run.checked_sub(1).map(|i| chain[i]),
            blocks: new.to_vec(),
        });
        Ok(new.len())
    }

    /// Pins the resident leading run of `chain` for an in-flight request (reference counted).
    /// Returns the run's length. Blocks after the run are not pinned.
    ///
    /// `chain` may start anywhere in a prompt (to pin blocks stored after an earlier pin); from
    /// its second block on, the run follows the chain as the cache holds it, stopping at a block
    /// that is not resident or that the cache holds under another parent (a chain that repeats a
    /// block, say).
    pub fn pin(&mut self, chain: &[BlockHash]) -> usize {
        self.pin_walk(chain, |_| {})
    }

    /// The walk of [`pin`](Self::pin), telling `pinned` each slot it pins, in chain order.
    #[inline]
    fn pin_walk(&mut self, chain: &[BlockHash], mut pinned: impl FnMut(u32)) -> usize {
        let mut prev = None;
        let mut n = 0;
        for h in chain {
            match self.find(prev.unwrap_or(NIL), h) {
                Some(s) if prev.is_none_or(|p| self.slots[s as usize].parent == p) => {
                    self.pin_slot(s);
                    self.set_hint(prev.unwrap_or(NIL), s);
                    pinned(s);
                    prev = Some(s);
                    n += 1;
                }
                _ => break,
            }
        }
        n
    }

    /// Releases one pin from each block of the leading run of `chain` that is resident, linked
    /// as [`pin`](Self::pin) follows it, and pinned; a block whose last pin goes counts as used
    /// now. Returns how many were released.
    pub fn unpin(&mut self, chain: &[BlockHash]) -> usize {
        self.unpin_walk(chain, &[])
    }

    /// [`unpin`](Self::unpin), trying `slots[i]` (where given) as `chain[i]`'s place before
    /// hashing: a slot is taken only when it holds that very block, pinned, so the result is
    /// always exactly `unpin(chain)`'s.
    fn unpin_walk(&mut self, chain: &[BlockHash], slots: &[SlotId]) -> usize {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let mut prev = None;
        for (i, h) in chain.iter().enumerate() {
            if prefetch::HINTS {
                // The slots are known ahead; those of a long-running request are cold.
                if let Some(x) = slots
                    .get(i + SLOTS_AHEAD)
                    .and_then(|&SlotId(c)| self.slots.get(c as usize))
                {
                    prefetch::prefetch(x);
                }
            }
            let known = slots.get(i).map(|&SlotId(c)| c).filter(|&c| {
                self.slots
                    .get(c as usize)
                    .is_some_and(|x| x.pins > 0 && x.parent != FREE && x.hash == *h)
            });
            match known.or_else(|| self.find(prev.unwrap_or(NIL), h)) {
                Some(s)
                    if self.slots[s as usize].pins > 0
                        && prev.is_none_or(|p| self.slots[s as usize].parent == p) =>
                {
                    scratch.push(s);
                    prev = Some(s);
                }
                _ => break,
            }
        }
        // Tail first, so the leading blocks end up the most recent.
        for &s in scratch.iter().rev() {
            self.unpin_slot(s);
        }
        let n = scratch.len();
        self.scratch = scratch;
        n
    }

    /// [`pin`](Self::pin), also appending the pinned blocks' slots to `out`, in chain order.
    pub fn pin_into(&mut self, chain: &[BlockHash], out: &mut Vec<SlotId>) -> usize {
        self.pin_walk(chain, |s| out.push(SlotId(s)))
    }

    /// [`insert`](Self::insert), also appending, when it succeeds, the slots of the whole
    /// chain (its resident run and the blocks stored) to `out`, in chain order.
    pub fn insert_into(
        &mut self,
        chain: &[BlockHash],
        out: &mut Vec<SlotId>,
    ) -> Result<usize, Error> {
        let stored = self.insert(chain)?;
        // `insert` leaves the chain's slots in the scratch buffer.
        out.extend(self.scratch.iter().map(|&s| SlotId(s)));
        Ok(stored)
    }

    /// Pins the blocks of `slots`, in order, as [`pin`](Self::pin) pins a chain: each should be
    /// resident (a slot handed out for a block still pinned, or just stored), and each after
    /// the first the child of the one before. A slot that holds no block is skipped.
    pub fn pin_slots(&mut self, slots: &[SlotId]) {
        for &SlotId(s) in slots {
            if self.slots.get(s as usize).is_some_and(|x| x.parent != FREE) {
                self.pin_slot(s);
            }
        }
    }

    /// Exactly [`unpin`](Self::unpin)`(chain)`, finding `chain[i]` through `slots[i]` (as
    /// [`pin_into`](Self::pin_into) or [`insert_into`](Self::insert_into) handed them out for
    /// this chain) without hashing while that slot still holds the block, pinned. `slots` may
    /// be shorter than `chain` (the rest is found by hash) or stale (checked, then hashed).
    /// Returns how many pins were released.
    pub fn unpin_slots(&mut self, chain: &[BlockHash], slots: &[SlotId]) -> usize {
        self.unpin_walk(chain, slots)
    }

    /// Changes the capacity in blocks (`None`: unbounded; 0 holds nothing), evicting down to it.
    /// Fails, changing nothing, when the blocks that cannot be evicted exceed it.
    ///
    /// An engine that also keeps blocks outside the cache (a running request's output, say)
    /// shrinks and grows the cache with this as those come and go.
    pub fn set_capacity(&mut self, capacity: Option<usize>) -> Result<(), Error> {
        let limit = capacity.map_or(MAX_BLOCKS, |c| c.min(MAX_BLOCKS));
        let needed = self.map.len().saturating_sub(limit);
        if needed > 0 {
            let evictable = self.evictable(NIL, 0);
            if needed > evictable {
                return Err(Error::CapacityExhausted {
                    needed,
                    evictable,
                    capacity: limit,
                    pinned: self.pinned,
                });
            }
        }
        self.capacity = capacity;
        self.evict(needed);
        Ok(())
    }

    /// Drops every block and queues [`KvEvent::Cleared`]. Fails while any block is pinned.
    pub fn clear(&mut self) -> Result<usize, Error> {
        if self.pinned > 0 {
            return Err(Error::Pinned {
                pinned: self.pinned,
            });
        }
        let n = self.map.len();
        self.map.clear();
        self.slots.clear();
        self.free.clear();
        self.lru.clear();
        self.clock = 0;
        self.listed = 0;
        self.broken = 0;
        self.events.push(KvEvent::Cleared);
        Ok(n)
    }

    /// The queued events, oldest first; they are removed as the iterator is consumed.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, KvEvent> {
        self.events.drain(..)
    }

    /// Events queued and not yet drained.
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    fn exhausted(&self, needed: usize, evictable: usize) -> Error {
        Error::CapacityExhausted {
            needed,
            evictable,
            capacity: self.limit(),
            pinned: self.pinned,
        }
    }

    /// Undoes the reservation of `keys`, whose slots follow `slots[run..]`: the free ones go
    /// back to the free list as they were.
    fn unreserve(&mut self, keys: &[BlockHash], slots: &mut Vec<u32>, run: usize) {
        for h in keys {
            self.map.remove(h);
        }
        let end = self.slots.len();
        for &s in slots[run..].iter().rev() {
            if (s as usize) < end {
                self.free.push(s);
            }
        }
        slots.truncate(run);
    }

    /// Blocks eviction could remove, one after another, without touching `protect` or its prefix.
    /// `reserved` map entries are keys of an insert in progress, not resident blocks (their
    /// slots are free or past the end, with no pins).
    fn evictable(&self, protect: u32, reserved: usize) -> usize {
        let resident = self.map.len() - reserved;
        if self.broken == 0 {
            // Pins cover whole prefixes, so every unpinned block outside the protected path can go.
            let mut on_path = 0;
            let mut s = protect;
            while s != NIL {
                let slot = &self.slots[s as usize];
                on_path += usize::from(slot.pins == 0);
                s = slot.parent;
            }
            return resident - self.pinned - on_path;
        }
        // Slow path: mark every block that is pinned, protected, or an ancestor of one.
        let mut held = vec![false; self.slots.len()];
        let mut count = 0;
        let starts = self
            .map
            .values()
            .filter(|&s| self.slots.get(s as usize).is_some_and(|x| x.pins > 0))
            .chain((protect != NIL).then_some(protect));
        for start in starts {
            let mut s = start;
            while s != NIL && !held[s as usize] {
                held[s as usize] = true;
                count += 1;
                s = self.slots[s as usize].parent;
            }
        }
        resident - count
    }

    /// Evicts `n` blocks (the caller checked they are evictable) and queues one `Removed` event.
    fn evict(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let mut removed = Vec::with_capacity(n);
        for _ in 0..n {
            let Some(s) = self.lru_leaf() else {
                break; // unreachable after the caller's check; nothing more to take
            };
            let slot = &self.slots[s as usize];
            let (hash, parent) = (slot.hash, slot.parent);
            if parent != NIL {
                let p = &mut self.slots[parent as usize];
                p.children -= 1;
                if p.hint == s {
                    p.hint = NIL;
                }
            }
            self.slots[s as usize].parent = FREE;
            self.free.push(s);
            removed.push(hash);
        }
        // Apart, so that the removals' (cold) hash-table probes can overlap.
        for (i, hash) in removed.iter().enumerate() {
            self.map.warm_ahead(&removed, i);
            self.map.remove(hash);
        }
        self.stats.evictions += removed.len() as u64;
        if let Some(h) = &mut self.host {
            h.demote(&removed);
        }
        self.events.push(KvEvent::Removed { blocks: removed });
    }

    /// Takes the least recent unpinned block that no resident block extends out of the queue
    /// (with whole-prefix pins, the least recent of all is one), or `None`.
    fn lru_leaf(&mut self) -> Option<u32> {
        let mut i = 0;
        while let Some(&(s, stamp)) = self.lru.get(i) {
            if prefetch::HINTS {
                if let Some(&(ahead, _)) = self.lru.get(i + SLOTS_AHEAD) {
                    prefetch::prefetch(&self.slots[ahead as usize]);
                }
            }
            let slot = &self.slots[s as usize];
            if slot.stamp != stamp {
                // Stale: the block was used again, pinned or evicted since.
                if i == 0 {
                    self.lru.pop_front();
                } else {
                    i += 1;
                }
                continue;
            }
            if slot.children > 0 {
                i += 1;
                continue;
            }
            if i == 0 {
                self.lru.pop_front();
            }
            self.unlink(s);
            return Some(s);
        }
        None
    }

    /// Makes the unpinned blocks of a chain, given by slot, the most recent, tail first.
    fn touch_slots(&mut self, slots: &[u32]) {
        for &s in slots.iter().rev() {
            if self.slots[s as usize].pins == 0 {
                self.push_mru(s);
            }
        }
    }

    fn pin_slot(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        // Saturates rather than overflows: 2^32 pins of one block cannot happen in practice.
        slot.pins = slot.pins.saturating_add(1);
        if slot.pins > 1 {
            return;
        }
        let (had_pinned_children, parent) = (slot.pinned_children > 0, slot.parent);
        self.unlink(s);
        self.pinned += 1;
        if had_pinned_children {
            self.broken -= 1;
        }
        if parent != NIL {
            let p = &mut self.slots[parent as usize];
            p.pinned_children += 1;
            if p.pins == 0 && p.pinned_children == 1 {
                self.broken += 1;
            }
        }
    }

    fn unpin_slot(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        slot.pins -= 1;
        if slot.pins > 0 {
            return;
        }
        let (has_pinned_children, parent) = (slot.pinned_children > 0, slot.parent);
        self.push_mru(s);
        self.pinned -= 1;
        if has_pinned_children {
            self.broken += 1;
        }
        if parent != NIL {
            let p = &mut self.slots[parent as usize];
            p.pinned_children -= 1;
            if p.pins == 0 && p.pinned_children == 0 {
                self.broken -= 1;
            }
        }
    }

    /// Takes block `s` out of the recency queue, if it is there: its entry goes stale, or
    /// goes at once if it is the last (as when blocks just stored are pinned, head first).
    fn unlink(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        if slot.stamp != UNLISTED {
            if self.lru.back() == Some(&(s, slot.stamp)) {
                self.lru.pop_back();
            }
            slot.stamp = UNLISTED;
            self.listed -= 1;
        }
    }

    /// Makes block `s` the most recent in the queue (its older entry, if any, goes stale).
    fn push_mru(&mut self, s: u32) {
        if self.clock == UNLISTED || self.lru.len() > 2 * self.listed + 64 {
            self.compact();
        }
        let slot = &mut self.slots[s as usize];
        if slot.stamp == UNLISTED {
            self.listed += 1;
        }
        slot.stamp = self.clock;
        self.lru.push_back((s, self.clock));
        self.clock += 1;
    }

    /// Drops the queue's stale entries and renumbers the rest from 0 in order, which keeps
    /// the queue within about twice the blocks it lists and stamps below [`UNLISTED`] (the
    /// live entries are at most the slots, fewer than it).
    fn compact(&mut self) {
        let slots = &mut self.slots;
        let mut clock = 0;
        self.lru.retain_mut(|(s, stamp)| {
            let slot = &mut slots[*s as usize];
            if slot.stamp != *stamp {
                return false;
            }
            slot.stamp = clock;
            *stamp = clock;
            clock += 1;
            true
        });
        self.clock = clock;
    }

    /// The live entries of the recency queue, least recent first.
    fn listed_slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.lru
            .iter()
            .filter(|&&(s, stamp)| self.slots[s as usize].stamp == stamp)
            .map(|&(s, _)| s)
    }

    /// Resident blocks from least to most recently used, pinned ones excluded. For tests.
    #[doc(hidden)]
    pub fn recency_order(&self) -> Vec<BlockHash> {
        self.listed_slots()
            .map(|s| self.slots[s as usize].hash)
            .collect()
    }

    /// Checks every internal invariant; property tests call it after every step.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.slots.len();
        let mut resident = vec![false; n];
        for (h, s) in self.map.iter() {
            let slot = self
                .slots
                .get(s as usize)
                .ok_or_else(|| format!("{h} maps to missing slot {s}"))?;
            if slot.hash != h {
                return Err(format!("{h} maps to slot {s} holding {}", slot.hash));
            }
            resident[s as usize] = true;
        }
        for &f in &self.free {
            if resident[f as usize] {
                return Err(format!("slot {f} is both free and resident"));
            }
            let slot = &self.slots[f as usize];
            if slot.parent != FREE || slot.pins > 0 {
                return Err(format!("free slot {f} is not marked free"));
            }
        }
        if self.map.len() + self.free.len() != n {
            return Err("slots leak".into());
        }
        if self.map.len() > self.limit() {
            return Err(format!(
                "{} resident > capacity {}",
                self.map.len(),
                self.limit()
            ));
        }
        let mut children = vec![0u32; n];
        let mut pinned_children = vec![0u32; n];
        let mut pinned = 0;
        for s in (0..n).filter(|&s| resident[s]) {
            let slot = &self.slots[s];
            pinned += usize::from(slot.pins > 0);
            if slot.parent != NIL {
                let p = slot.parent as usize;
                if !resident.get(p).copied().unwrap_or(false) {
                    return Err(format!("{} is resident without its parent", slot.hash));
                }
                children[p] += 1;
                pinned_children[p] += u32::from(slot.pins > 0);
            }
        }
        let mut broken = 0;
        for s in (0..n).filter(|&s| resident[s]) {
            let slot = &self.slots[s];
            let h = slot.hint;
            if h != NIL
                && (!resident.get(h as usize).copied().unwrap_or(false)
                    || self.slots[h as usize].parent != s as u32)
            {
                return Err(format!("the hint of {} is not a resident child", slot.hash));
            }
            if slot.children != children[s] || slot.pinned_children != pinned_children[s] {
                return Err(format!("child counts of {} are wrong", slot.hash));
            }
            broken += usize::from(slot.pins == 0 && slot.pinned_children > 0);
        }
        if pinned != self.pinned || broken != self.broken {
            return Err(format!(
                "pinned {} / broken {} counters, actual {pinned} / {broken}",
                self.pinned, self.broken
            ));
        }
        // The queue: stamps grow along it and stay below the clock; a slot's stamp is that of
        // one entry exactly when it is resident and unpinned.
        let mut last = None;
        for &(s, stamp) in &self.lru {
            if self.slots.get(s as usize).is_none() {
                return Err(format!("queue entry names slot {s}, past the end"));
            }
            if last.is_some_and(|l| stamp <= l) || stamp >= self.clock {
                return Err(format!("queue stamps out of order at slot {s}"));
            }
            last = Some(stamp);
        }
        let mut listed = 0;
        for s in self.listed_slots() {
            if !resident[s as usize] || self.slots[s as usize].pins > 0 {
                return Err(format!("queue lists {}", self.slots[s as usize].hash));
            }
            listed += 1;
        }
        let unpinned = (0..n).filter(|&s| resident[s] && self.slots[s].pins == 0);
        if unpinned.clone().any(|s| self.slots[s].stamp == UNLISTED)
            || listed != self.map.len() - self.pinned
            || listed != self.listed
        {
            return Err("the queue does not hold exactly the unpinned blocks".into());
        }
        if (0..n).any(|s| !resident[s] && self.slots[s].stamp != UNLISTED) {
            return Err("a free slot is listed".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A request's prompt: a path in a small tree of blocks, so prompts share prefixes.
    fn chain(path: &[u8]) -> Vec<BlockHash> {
        let mut h = 0u64;
        path.iter()
            .map(|&b| {
                h = h.wrapping_mul(31).wrapping_add(u64::from(b) + 1);
                BlockHash::new(h)
            })
            .collect()
    }

    /// A running prompt: its cached run's length at admission, whether its store ran, and the
    /// slots it holds (its cached run; the whole prompt once stored; none after a refused store).
    type Held = (usize, bool, Vec<SlotId>);

    #[derive(Debug, Clone)]
    enum Op {
        Admit(usize),
        Store(usize),
        Release(usize),
        Capacity(Option<usize>),
    }

    /// Drives two caches the way an engine does: `a` with chain calls only (pin the cached run,
    /// store the prompt and pin the rest, release the whole chain), `b` with the slot calls
    /// (`pin_into`, `insert_into` and `pin_slots`, `unpin_slots`). Every result, event, the
    /// recency order and the counters must agree, and both caches' invariants hold, after
    /// every step.
    fn slots_match_chains(
        prompts: &[Vec<u8>],
        ops: &[Op],
        cap: Option<usize>,
    ) -> Result<(), TestCaseError> {
        let chains: Vec<Vec<BlockHash>> = prompts.iter().map(|p| chain(p)).collect();
        let (mut a, mut b) = (BlockCache::new(cap), BlockCache::new(cap));
        let mut state: Vec<Option<Held>> = vec![None; chains.len()];
        for op in ops {
            match *op {
                Op::Admit(i) | Op::Store(i) | Op::Release(i) if i >= chains.len() => {}
                Op::Admit(i) => {
                    if state[i].is_none() {
                        let mut held = Vec::new();
                        let h = a.pin(&chains[i]);
                        prop_assert_eq!(b.pin_into(&chains[i], &mut held), h);
                        prop_assert_eq!(held.len(), h);
                        state[i] = Some((h, false, held));
                    }
                }
                Op::Store(i) => {
                    if let Some((h, stored @ false, held)) = state[i].as_mut() {
                        *stored = true;
                        let ra = a.insert(&chains[i]);
                        let pa = a.pin(&chains[i][*h..]);
                        let mut all = Vec::new();
                        let rb = b.insert_into(&chains[i], &mut all);
                        prop_assert_eq!(&ra, &rb);
                        if rb.is_ok() {
                            prop_assert_eq!(all.len(), chains[i].len());
                            b.pin_slots(&all[*h..]);
                            prop_assert_eq!(pa, all.len() - *h);
                            *held = all;
                        } else {
                            // A refused store pins by hash whatever is resident; the release
                            // then goes by the chain alone.
                            prop_assert_eq!(b.pin(&chains[i][*h..]), pa);
                            held.clear();
                        }
                    }
                }
                Op::Release(i) => {
                    if let Some((h, stored, held)) = state[i].take() {
                        let run = if stored {
                            &chains[i][..]
                        } else {
                            &chains[i][..h]
                        };
                        let n = a.unpin(run);
                        prop_assert_eq!(b.unpin_slots(run, &held), n);
                    }
                }
                Op::Capacity(c) => {
                    prop_assert_eq!(a.set_capacity(c), b.set_capacity(c));
                }
            }
            prop_assert_eq!(
                a.drain_events().collect::<Vec<_>>(),
                b.drain_events().collect::<Vec<_>>()
            );
            prop_assert_eq!(a.recency_order(), b.recency_order());
            prop_assert_eq!(a.pinned_blocks(), b.pinned_blocks());
            prop_assert_eq!(a.len(), b.len());
            prop_assert_eq!(a.stats(), b.stats());
            a.check_invariants().map_err(TestCaseError::fail)?;
            b.check_invariants().map_err(TestCaseError::fail)?;
        }
        Ok(())
    }

    /// The case CI's proptest shrank to: a store refused (capacity 0) leaves its prompt to be
    /// released by the chain, which takes a pin that another prompt sharing its first block
    /// holds; that prompt's release must then do what the chain call does (stop at the block
    /// that lost its pin), not skip that block and release the rest.
    #[test]
    fn refused_store_then_shared_prefix_release() {
        use Op::*;
        let prompts = [vec![0], vec![1, 0], vec![0], vec![0], vec![1, 1]];
        let ops = [
            Admit(1),
            Capacity(Some(0)),
            Store(1),
            Admit(4),
            Capacity(None),
            Store(4),
            Release(1),
            Release(4),
        ];
        slots_match_chains(&prompts, &ops, None).unwrap();
        // And the same with the slot calls alone: the released counts are the chain calls'.
        let (p, q) = (chain(&[1, 0]), chain(&[1, 1]));
        let mut c = BlockCache::new(Some(0));
        assert_eq!(c.pin_into(&p, &mut Vec::new()), 0);
        assert!(c.insert_into(&p, &mut Vec::new()).is_err());
        c.set_capacity(None).unwrap();
        let mut held = Vec::new();
        assert_eq!(c.insert_into(&q, &mut held), Ok(2));
        c.pin_slots(&held);
        assert_eq!(c.unpin(&p), 1); // the refused prompt's release takes q's pin on block 1
        assert_eq!(c.unpin_slots(&q, &held), 0); // as `unpin(&q)`: block 1 is no longer pinned
        assert_eq!(c.pin_count(q[1]), 1);
        c.check_invariants().unwrap();
    }

    /// A slot that was freed and reused for another block is not taken for the old one.
    #[test]
    fn stale_slots_are_checked() {
        let (p, q) = (chain(&[0]), chain(&[1]));
        let mut c = BlockCache::new(Some(1));
        let mut held = Vec::new();
        c.insert_into(&p, &mut held).unwrap();
        c.insert(&q).unwrap(); // evicts p; its slot now holds q
        c.pin(&q);
        assert_eq!(c.unpin_slots(&p, &held), 0);
        assert_eq!(c.pin_count(q[0]), 1);
        c.pin_slots(&[SlotId(7)]); // no such slot: skipped
        c.check_invariants().unwrap();
    }

    /// The recency queue through many compactions and a clock run up to its end: the order
    /// stays a naive list's (a use moves a block to the back, eviction takes the front).
    #[test]
    fn recency_survives_compaction_and_the_clock_running_out() {
        let mut c = BlockCache::new(Some(4));
        let mut model: Vec<BlockHash> = Vec::new();
        let mut rng = 7u64;
        let steps = if cfg!(miri) { 600 } else { 5_000 };
        for step in 0..steps {
            if step == 100 {
                // As if billions of uses had gone by: the next few run the clock out.
                let live: Vec<u32> = c.listed_slots().collect();
                c.lru.clear();
                for (i, &s) in live.iter().enumerate() {
                    let stamp = UNLISTED - 8 + i as u32;
                    c.slots[s as usize].stamp = stamp;
                    c.lru.push_back((s, stamp));
                }
                c.clock = UNLISTED - 8 + live.len() as u32;
            }
            rng = rng
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            // Seven blocks for four places, then four: uses without evictions, whose stale
            // entries only compaction takes.
            let b = BlockHash::new((rng >> 33) % if step < steps / 2 { 7 } else { 4 });
            c.insert(&[b]).unwrap();
            model.retain(|&x| x != b);
            model.push(b);
            if model.len() > 4 {
                model.remove(0);
            }
            assert_eq!(c.recency_order(), model, "step {step}");
            c.check_invariants().unwrap();
            assert!(c.lru.len() <= 2 * c.listed + 65);
        }
        assert!(c.clock < steps as u32, "the clock started again from 0");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 3 } else { 256 }))]
        /// Pinning, storing and releasing through slots does exactly what the chain calls do,
        /// used the way an engine uses them: pin the cached run, store the prompt and pin the
        /// rest, release it all.
        #[test]
        fn slot_calls_equal_chain_calls(
            prompts in prop::collection::vec(prop::collection::vec(0u8..3, 1..6), 1..8),
            ops in prop::collection::vec(prop_oneof![
                (0usize..8).prop_map(Op::Admit),
                (0usize..8).prop_map(Op::Store),
                (0usize..8).prop_map(Op::Release),
                prop::option::of(0usize..12).prop_map(Op::Capacity),
            ], 1..60),
            cap in prop::option::of(0usize..12),
        ) {
            slots_match_chains(&prompts, &ops, cap)?;
        }
    }
}
