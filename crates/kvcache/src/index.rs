//! The router's mirror of many workers' caches.

use kvblock::BlockHash;

use crate::blockmap::{spread, BlockMap};
use crate::hasher::Map;
use crate::workerset::{fits_inline, List, Spill, WorkerSet, MAX_WORKERS};
use crate::{Error, KvEvent, WorkerId};
use std::sync::atomic::{AtomicU16, Ordering::Relaxed};

#[derive(Debug, Clone)]
struct WorkerState {
    id: WorkerId,
    next_event: u64,
    blocks: usize,
    stale: bool,
    /// The mirror may not be prefix-closed (a block was removed while a block extending it may
    /// stay): queries walk this worker block by block.
    holey: bool,
}

/// What [`CacheIndex::apply`] did with an event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Applied {
    /// `Some((expected, got))` when ids were skipped: the event was applied, and the worker is
    /// marked possibly stale until it is cleared or removed.
    pub gap: Option<(u64, u64)>,
    /// Blocks newly recorded as resident.
    pub stored: usize,
    /// Stored blocks the worker was already known to hold.
    pub already_present: usize,
    /// Blocks removed.
    pub removed: usize,
    /// Removed blocks the index never saw on that worker (counted, not an error).
    pub unknown_removed: usize,
}

/// For one request, how long a leading run of its blocks each worker holds.
///
/// Reusable: pass the same value to [`CacheIndex::overlaps_into`] to avoid allocating per query.
#[derive(Debug, Clone, Default)]
pub struct Overlaps {
    runs: Vec<usize>,
    matched: Vec<(WorkerId, usize)>,
    active: Vec<(u32, u64)>,
    next: Vec<(u32, u64)>,
}

impl Overlaps {
    /// An empty result, to be filled by [`CacheIndex::overlaps_into`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The leading run held by `worker` (0 when it holds none or is unknown).
    pub fn get(&self, worker: WorkerId) -> usize {
        self.matched
            .iter()
            .find(|(w, _)| *w == worker)
            .map_or(0, |&(_, r)| r)
    }

    /// The run of the worker at a dense index (see [`CacheIndex::worker_index`]); 0 when none.
    #[inline]
    pub fn run_at(&self, index: usize) -> usize {
        self.runs.get(index).copied().unwrap_or(0)
    }

    /// Workers with a non-zero run, and their runs, shortest run first.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, usize)> + '_ {
        self.matched.iter().copied()
    }

    /// The longest run of any worker.
    pub fn max(&self) -> usize {
        self.matched.last().map_or(0, |&(_, r)| r)
    }

    /// Replaces the run of `worker` (at dense `index`) with `run`, for a caller that applies rules
    /// the index does not know (a router's cache groups, say). [`get`](Self::get), [`iter`](Self::iter)
    /// and [`max`](Self::max) follow.
    ///
    /// ```
    /// use kvcache::{CacheIndex, KvEvent, Overlaps, WorkerId};
    /// use kvblock::BlockHash;
    /// let mut index = CacheIndex::new();
    /// let w = WorkerId::new(3);
    /// let i = index.add_worker(w)?;
    /// let chain = [BlockHash::new(1), BlockHash::new(2)];
    /// index.apply(w, 0, &KvEvent::Stored { parent: None, blocks: chain.to_vec() })?;
    /// let mut o = index.overlaps(&chain);
    /// o.set_run(i, w, 1);
    /// assert_eq!((o.run_at(i), o.get(w), o.max()), (1, 1, 1));
    /// # Ok::<(), kvcache::Error>(())
    /// ```
    ///
    /// An `index` no index hands out (2^24 or more) has no slot: the worker's run is still set.
    pub fn set_run(&mut self, index: usize, worker: WorkerId, run: usize) {
        if index < MAX_WORKERS as usize {
            if self.runs.len() <= index {
                self.runs.resize(index + 1, 0);
            }
            self.runs[index] = run;
        }
        self.matched.retain(|&(w, _)| w != worker);
        if run > 0 {
            let at = self.matched.partition_point(|&(_, r)| r <= run);
            self.matched.insert(at, (worker, run));
        }
    }

    fn reset(&mut self, slots: usize) {
        self.runs.clear();
        self.runs.resize(slots, 0);
        self.matched.clear();
        self.active.clear();
    }
}

/// The router's view of many workers' caches, mirrored from their [`KvEvent`]s.
///
/// - Events are applied per worker in id order (0, 1, 2, ...). A duplicate or older id is
///   rejected ([`Error::StaleEvent`]), and so is `u64::MAX`, whose next id would not fit
///   ([`Error::EventIdOutOfRange`]); a gap is applied and reported ([`Applied::gap`]) and marks
///   the worker possibly stale until it is cleared or removed. A `Stored` event whose parent the
///   worker does not hold is rejected ([`Error::UnknownParent`]), consumes its id and marks the
///   worker stale. Removing blocks the index never saw is counted ([`Applied::unknown_removed`]).
/// - [`overlaps`](Self::overlaps) follows the request's blocks from the first, intersecting the
///   set of workers still matching with the holders of the blocks it probes, and stops when none
///   is left: its cost grows with the matched depth, not with the number of stored blocks or
///   idle workers. Keys are sequence hashes (a hash names a block *and its whole prefix*), so
///   a worker whose mirror is prefix-closed is probed at doubling strides, with a binary search
///   where the matching set shrinks: a 128-block hit costs about a dozen probes. A worker that
///   [may have holes](Self::may_have_holes) (it removed blocks since it was last empty, unless
///   removals are [trusted to take leaves](Self::set_tail_first)) is walked block by block while
///   it still matches, so every run is exact. Hashes that break the contract (one hash after
///   two different parents) are outside it: runs may then count a block whose prefix differs.
/// - Workers are numbered with dense indices (reused after removal) so callers can keep
///   per-worker arrays; `Cleared` and [`remove_worker`](Self::remove_worker) scan all blocks.
///
/// ```
/// use kvcache::{BlockHash, CacheIndex, KvEvent, WorkerId};
/// let b = |i| BlockHash::new(i);
/// let mut index = CacheIndex::new();
/// index.apply(WorkerId::new(0), 0, &KvEvent::Stored { parent: None, blocks: vec![b(1), b(2), b(3)] })?;
/// index.apply(WorkerId::new(1), 0, &KvEvent::Stored { parent: None, blocks: vec![b(1)] })?;
///
/// let ov = index.overlaps(&[b(1), b(2), b(9)]);
/// assert_eq!((ov.get(WorkerId::new(0)), ov.get(WorkerId::new(1))), (2, 1));
/// assert_eq!(index.block_count(WorkerId::new(0)), 3);
///
/// // A replayed id is rejected, a gap is applied and reported.
/// assert!(index.apply(WorkerId::new(1), 0, &KvEvent::Cleared).is_err());
/// let applied = index.apply(WorkerId::new(1), 5, &KvEvent::Removed { blocks: vec![b(1)] })?;
/// assert_eq!(applied.gap, Some((1, 5)));
/// assert!(index.is_stale(WorkerId::new(1)));
/// # Ok::<(), kvcache::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct CacheIndex {
    blocks: BlockMap<WorkerSet>,
    spill: Spill,
    workers: Vec<Option<WorkerState>>,
    /// `WorkerState::holey` as a bitset over dense indices, for a word-wise test of the
    /// workers a query still matches.
    holey: Vec<u64>,
    ids: Map<WorkerId, u32>,
    free: Vec<u32>,
    pairs: usize,
    /// Trust that every `Removed` takes only blocks nothing held extends (see
    /// [`set_tail_first`](CacheIndex::set_tail_first)).
    tail_first: bool,
    /// The run hints of chains' first blocks, kept apart so that a query can read its guess
    /// in cache and load its second round of probes with its first.
    heads: Heads,
}

/// The run hints of chains' first blocks ("heads"), [`HEADS`] slots of 16 bits (allocated with
/// the first worker), each tagged with a few bits of its block's hash. Written when a chain is
/// stored from its root and when a query reads a head (so a popular prompt's head keeps its
/// slot, and an index restored from a snapshot learns its heads as it is queried). Two heads
/// may share a slot, the later one winning: a wrong guess costs only lines loaded for nothing,
/// since only which lines a query loads early depends on it. Atomic so that queries, which
/// take `&self`, may write (relaxed: any value read is as good a guess).
#[derive(Default)]
struct Heads(Vec<AtomicU16>);

/// Chain heads whose run hints [`Heads`] keeps (32 KiB of them): a slot of a popular prompt's
/// head stays in the CPU cache.
const HEADS: usize = 1 << 14;
/// The bits of a [`Heads`] slot that hold the hint; the rest tag the block.
const HEAD_HINT_BITS: u32 = 12;
const HEAD_HINT_MASK: u16 = (1 << HEAD_HINT_BITS) - 1;

impl Heads {
    fn allocate(&mut self) {
        if self.0.is_empty() {
            self.0 = (0..HEADS).map(|_| AtomicU16::new(0)).collect();
        }
    }

    /// A head's slot and its tag.
    #[inline]
    fn slot(head: BlockHash) -> (usize, u16) {
        // Mixed as the map mixes its keys (trace ids are small consecutive integers).
        let h = spread(head.get());
        let slot = (h >> (64 - HEADS.trailing_zeros())) as usize;
        (slot, (h as u16) << HEAD_HINT_BITS)
    }

    /// Remembers `hint` as the run hint of `head`, a chain's first block.
    #[inline]
    fn note(&self, head: BlockHash, hint: usize) {
        let (slot, tag) = Self::slot(head);
        if let Some(e) = self.0.get(slot) {
            let v = tag | hint.min(usize::from(HEAD_HINT_MASK)) as u16;
            // Written only when it changes: a popular head's slot stays shared, not bounced
            // between the cores of concurrent queries.
            if e.load(Relaxed) != v {
                e.store(v, Relaxed);
            }
        }
    }

    /// The run hint last noted for `head` (a guess: another head may have taken its slot, or
    /// the block may be gone), if it is not 0.
    #[inline]
    fn hint(&self, head: BlockHash) -> Option<usize> {
        let (slot, tag) = Self::slot(head);
        let e = self.0.get(slot)?.load(Relaxed);
        let hint = usize::from(e & HEAD_HINT_MASK);
        (e & !HEAD_HINT_MASK == tag && hint > 0).then_some(hint)
    }
}

impl Clone for Heads {
    fn clone(&self) -> Self {
        Heads(
            self.0
                .iter()
                .map(|e| AtomicU16::new(e.load(Relaxed)))
                .collect(),
        )
    }
}

impl std::fmt::Debug for Heads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Heads({} slots)", self.0.len())
    }
}

impl CacheIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a worker (events register workers too). Returns its dense index.
    pub fn add_worker(&mut self, worker: WorkerId) -> Result<usize, Error> {
        self.ensure(worker).map(|i| i as usize)
    }

    fn ensure(&mut self, worker: WorkerId) -> Result<u32, Error> {
        if let Some(&i) = self.ids.get(&worker) {
            return Ok(i);
        }
        let state = WorkerState {
            id: worker,
            next_event: 0,
            blocks: 0,
            stale: false,
            holey: false,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.workers[i as usize] = Some(state);
                i
            }
            None => {
                let i = u32::try_from(self.workers.len())
                    .ok()
                    .filter(|&i| i < MAX_WORKERS)
                    .ok_or(Error::TooManyWorkers { worker })?;
                self.workers.push(Some(state));
                i
            }
        };
        self.ids.insert(worker, i);
        self.set_holey(i, false);
        self.heads.allocate();
        Ok(i)
    }

    /// Marks (or clears) the worker at `idx` as possibly holey, in its state and the bitset.
    fn set_holey(&mut self, idx: u32, holey: bool) {
        let (word, bit) = (idx as usize / 64, 1u64 << (idx % 64));
        if self.holey.len() <= word {
            self.holey.resize(word + 1, 0);
        }
        if holey {
            self.holey[word] |= bit;
        } else {
            self.holey[word] &= !bit;
        }
        if let Some(Some(st)) = self.workers.get_mut(idx as usize) {
            st.holey = holey;
        }
    }

    /// Applies one event of `worker` (registering the worker if new). See the type's docs for
    /// the id rules.
    pub fn apply(
        &mut self,
        worker: WorkerId,
        event_id: u64,
        event: &KvEvent,
    ) -> Result<Applied, Error> {
        let idx = self.ensure(worker)?;
        let st = self.workers[idx as usize]
            .as_mut()
            .ok_or(Error::TooManyWorkers { worker })?;
        if event_id == u64::MAX {
            // Past it, the next id would not fit: the id could be replayed without end.
            return Err(Error::EventIdOutOfRange { worker });
        }
        if event_id < st.next_event {
            return Err(Error::StaleEvent {
                worker,
                got: event_id,
                expected: st.next_event,
            });
        }
        let mut out = Applied {
            gap: (event_id > st.next_event).then_some((st.next_event, event_id)),
            ..Applied::default()
        };
        st.stale |= out.gap.is_some();
        st.next_event = event_id + 1;
        // Only what is applied shapes the mirror: skipped events leave it stale, not holey,
        // unless removals are trusted to take leaves: a skipped `Removed` leaves blocks here
        // that the engine no longer holds, under which its later removals are not leaves. So a
        // trusted worker is holey while it is stale.
        let mut holey = st.holey || (self.tail_first && st.stale);
        match event {
            KvEvent::Stored { parent, blocks } => {
                if let Some(p) = *parent {
                    if !self
                        .blocks
                        .get(&p)
                        .is_some_and(|s| s.contains(idx, &self.spill))
                    {
                        // Rejected, so the mirror is unchanged: stale (the engine holds blocks
                        // it lacks), but no less prefix-closed than before; trusted, holey
                        // with the staleness (a gap this event carried, above all).
                        st.stale = true;
                        let holey = (st.holey || self.tail_first) && st.blocks > 0;
                        self.set_holey(idx, holey);
                        return Err(Error::UnknownParent {
                            worker,
                            event_id,
                            parent: p,
                        });
                    }
                }
                // Where the blocks other workers' chains already hold end and this event's new
                // ones begin, stored chains branch: where a query's runs are likely to end.
                // Run hints hop along those held blocks (each hop a block and its hint); the hop
                // that passes the branch is cut to end there.
                let (mut hop, mut leading) = ((0, 0), true);
                for (k, &b) in blocks.iter().enumerate() {
                    self.blocks.warm_ahead(blocks, k);
                    let hint = blocks.len() - 1 - k;
                    let (newly, held) = add_holder(&mut self.blocks, &mut self.spill, b, idx, hint);
                    if leading {
                        match held {
                            Some(h) if k == 0 || k > hop.0 + hop.1 => hop = (k, h),
                            Some(_) => {}
                            None => {
                                leading = false;
                                if k > 0 && hop.0 + hop.1 > k - 1 {
                                    if let Some(set) = self.blocks.get_mut(&blocks[hop.0]) {
                                        *set = set.with_run_hint(k - 1 - hop.0);
                                    }
                                }
                            }
                        }
                    }
                    if newly {
                        out.stored += 1;
                    } else {
                        out.already_present += 1;
                    }
                }
                st.blocks += out.stored;
                self.pairs += out.stored;
                if parent.is_none() {
                    if let Some(&head) = blocks.first() {
                        let hint = self.blocks.get(&head).map_or(0, WorkerSet::run_hint);
                        self.heads.note(head, hint);
                    }
                }
            }
            KvEvent::Removed { blocks } => {
                for (k, &b) in blocks.iter().enumerate() {
                    self.blocks.warm_ahead(blocks, k);
                    let spill = &mut self.spill;
                    let removed = self
                        .blocks
                        .update(&b, |set| set.remove(idx, spill), |set| !set.is_empty())
                        .unwrap_or(false);
                    if removed {
                        out.removed += 1;
                    } else {
                        out.unknown_removed += 1;
                    }
                }
                st.blocks -= out.removed;
                self.pairs -= out.removed;
                // The index does not know which removed block was a leaf of this worker: any
                // removal that leaves blocks behind may have left a hole, unless trusted.
                holey |= out.removed > 0 && !self.tail_first;
            }
            KvEvent::Cleared => {
                out.removed = st.blocks;
                st.stale = false;
                self.drop_blocks(idx);
            }
        }
        let empty = self.workers[idx as usize]
            .as_ref()
            .is_none_or(|s| s.blocks == 0);
        // An empty mirror is prefix-closed again.
        self.set_holey(idx, holey && !empty);
        Ok(out)
    }

    /// Forgets every block of `worker` but keeps it registered (its event ids continue).
    /// Returns how many blocks it held.
    pub fn clear_worker(&mut self, worker: WorkerId) -> usize {
        let Some(&idx) = self.ids.get(&worker) else {
            return 0;
        };
        let n = self.workers[idx as usize].as_ref().map_or(0, |s| s.blocks);
        if let Some(st) = self.workers[idx as usize].as_mut() {
            st.stale = false;
        }
        self.drop_blocks(idx);
        self.set_holey(idx, false);
        n
    }

    /// Removes `worker` and all of its blocks. Returns whether it was known.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let Some(idx) = self.ids.remove(&worker) else {
            return false;
        };
        self.drop_blocks(idx);
        self.set_holey(idx, false);
        self.workers[idx as usize] = None;
        self.free.push(idx);
        true
    }

    fn drop_blocks(&mut self, idx: u32) {
        let Some(st) = self.workers[idx as usize].as_mut() else {
            return;
        };
        if st.blocks > 0 {
            let spill = &mut self.spill;
            self.blocks.retain(|_, set| {
                set.remove(idx, spill);
                !set.is_empty()
            });
        }
        self.pairs -= st.blocks;
        st.blocks = 0;
    }

    /// For every worker, the leading run of `chain` it holds.
    pub fn overlaps(&self, chain: &[BlockHash]) -> Overlaps {
        let mut out = Overlaps::new();
        self.overlaps_into(chain, &mut out);
        out
    }

    /// [`overlaps`](Self::overlaps) into a reused result, allocating nothing once it has grown.
    ///
    /// Sequence hashes name a block *and its whole prefix*, so a worker whose mirror is
    /// prefix-closed holds block `i` only if it holds every block before it: the set of such
    /// workers still matching can only shrink along the chain. For them the walk probes a few
    /// positions (doubling strides, then a binary search where the set shrinks) instead of every
    /// block. Workers that [may have holes](Self::may_have_holes) are walked block by block
    /// while they still match, so every run stays exact.
    ///
    /// The index also keeps the run hints of chains' first blocks apart, in 32 KiB (noted as
    /// chains are stored from their root, and as queries read them): a query starts loading
    /// the probes its head's hint points to along with the head itself, so that when the guess
    /// holds, its second round of probes waits for no memory.
    pub fn overlaps_into(&self, chain: &[BlockHash], out: &mut Overlaps) {
        out.reset(self.workers.len());
        let Some(&head) = chain.first() else {
            return;
        };
        // The probes the head's run hint will send [`jump`](Self::jump) to, loaded with the
        // head's own: when the guess holds, the second round of probes finds them in cache.
        if let Some(hint) = self.heads.hint(head) {
            for p in hinted_probes(chain.len(), 1, hint) {
                self.blocks.prefetch_key(&chain[p]);
            }
        }
        let Some(first) = self.blocks.get(&head) else {
            return;
        };
        self.heads.note(head, first.run_hint());
        let mut buf = [(0, 0)];
        // Element by element: `extend_from_slice` of a slice whose length is not known calls
        // `memcpy`, most of the time for the one word of an inline set.
        for &w in first.words(&self.spill, &mut buf) {
            out.active.push(w);
        }
        // Every active worker holds chain[..depth]; `hint` is chain[depth - 1]'s run hint (0:
        // none known).
        let (mut depth, mut hint) = (1, first.run_hint());
        while depth < chain.len() && !out.active.is_empty() {
            depth = if self.any_holey(&out.active) {
                self.walk(chain, depth, out)
            } else {
                self.jump(chain, depth, hint, out)
            };
            hint = 0;
        }
        for &(word, bits) in &out.active {
            record(
                &self.workers,
                &mut out.runs,
                &mut out.matched,
                word,
                bits,
                chain.len(),
            );
        }
        out.active.clear();
    }

    /// Whether any worker of `active` may have holes.
    fn any_holey(&self, active: &[(u32, u64)]) -> bool {
        active
            .iter()
            .any(|&(w, bits)| self.holey.get(w as usize).is_some_and(|h| h & bits != 0))
    }

    /// The holders of `block` (empty when no worker holds it).
    #[inline]
    fn holders_of(&self, block: &BlockHash) -> WorkerSet {
        self.blocks.get(block).unwrap_or(WorkerSet::EMPTY)
    }

    /// Narrows `out.active` to the holders of `set`, recording the workers that drop out with
    /// a run of `run`.
    fn narrow(&self, set: WorkerSet, run: usize, out: &mut Overlaps) {
        let mut buf = [(0, 0)];
        let holders = set.words(&self.spill, &mut buf);
        out.next.clear();
        let mut j = 0;
        for &(word, bits) in &out.active {
            while j < holders.len() && holders[j].0 < word {
                j += 1;
            }
            let keep = match holders.get(j) {
                Some(&(w, b)) if w == word => bits & b,
                _ => 0,
            };
            if keep != 0 {
                out.next.push((word, keep));
            }
            record(
                &self.workers,
                &mut out.runs,
                &mut out.matched,
                word,
                bits & !keep,
                run,
            );
        }
        std::mem::swap(&mut out.active, &mut out.next);
    }

    /// Whether every worker of `active` is among the holders in `set`.
    fn holds_all(&self, active: &[(u32, u64)], set: WorkerSet) -> bool {
        let mut buf = [(0, 0)];
        let holders = set.words(&self.spill, &mut buf);
        let mut j = 0;
        active.iter().all(|&(word, bits)| {
            while j < holders.len() && holders[j].0 < word {
                j += 1;
            }
            matches!(holders.get(j), Some(&(w, b)) if w == word && bits & b == bits)
        })
    }

    /// Block by block from `depth`, one batch of probes: the probes are independent, so their
    /// cache misses overlap instead of being paid one after another between the merges.
    /// Returns the depth reached.
    fn walk(&self, chain: &[BlockHash], depth: usize, out: &mut Overlaps) -> usize {
        const BATCH: usize = 8;
        let end = (depth + BATCH).min(chain.len());
        let mut sets = [WorkerSet::EMPTY; BATCH];
        for (set, h) in sets.iter_mut().zip(&chain[depth..end]) {
            *set = self.holders_of(h);
        }
        for (k, &set) in sets[..end - depth].iter().enumerate() {
            self.narrow(set, depth + k, out);
            if out.active.is_empty() {
                return depth + k + 1;
            }
        }
        end
    }

    /// For prefix-closed active workers only, all holding `chain[..depth]`; `hint` is the run
    /// hint of `chain[depth - 1]` (0: none). One batch of independent probes: with a hint, the
    /// guessed end of the stored run, the block after it and the chain's last block (a prompt
    /// that shares a stored run and goes its own way is settled by these three); without one,
    /// `depth + 2^k - 1` up to the last block. Where the set shrank between two probes, that
    /// stretch is searched for where each run ends ([`first_lacked`](Self::first_lacked)).
    /// Returns the depth reached.
    fn jump(&self, chain: &[BlockHash], depth: usize, hint: usize, out: &mut Overlaps) -> usize {
        const PROBES: usize = 16;
        let n = chain.len();
        let mut at = [0usize; PROBES];
        let mut sets = [WorkerSet::EMPTY; PROBES];
        let mut count = 0;
        // Positions first, then all their lines requested at once: independent, so their
        // misses overlap.
        let mut push = |p: usize, count: &mut usize| {
            if *count == 0 || at[*count - 1] < p {
                at[*count] = p;
                *count += 1;
            }
        };
        if hint > 0 {
            for p in hinted_probes(n, depth, hint) {
                push(p, &mut count);
            }
        } else {
            let mut step = 1;
            loop {
                let p = (depth + step - 1).min(n - 1);
                push(p, &mut count);
                if p == n - 1 || count == PROBES {
                    break;
                }
                step *= 2;
            }
        }
        // The first two probes are read at once (with a run hint, the guessed end and the
        // block after it: all a partial hit, the common query, needs). With a prefetch hint
        // the rest are requested now and read only when the walk reaches them, so a partial
        // hit does not wait for the last block's lines; without one, reading them is how
        // they are requested.
        let mut loaded = if crate::prefetch::HINTS {
            count.min(2)
        } else {
            count
        };
        for &p in &at[loaded..count] {
            self.blocks.prefetch_key(&chain[p]);
        }
        for (set, &p) in sets.iter_mut().zip(&at[..loaded]) {
            *set = self.holders_of(&chain[p]);
        }
        // Invariant: every active worker holds chain[..lo], and `lo_hint` is chain[lo - 1]'s
        // run hint. Probes all active workers hold are passed; at one some lack, `lo..=at[k]`
        // is searched for the first position any of them lacks, they are dropped there, and
        // the same probe is read again for the rest: one batch serves every run it brackets.
        let (mut lo, mut lo_hint) = (depth, hint);
        let mut k = 0;
        while k < count {
            if k == loaded {
                sets[k] = self.holders_of(&chain[at[k]]);
                loaded += 1;
            }
            if self.holds_all(&out.active, sets[k]) {
                (lo, lo_hint) = (at[k] + 1, sets[k].run_hint());
                k += 1;
                continue;
            }
            let (p, set) = self.first_lacked(chain, lo, lo_hint, at[k], sets[k], &out.active);
            self.narrow(set, p, out);
            (lo, lo_hint) = (p + 1, set.run_hint());
            if out.active.is_empty() {
                break;
            }
            // Only saves a read: the survivors hold chain[p], so when p is the probe they pass it.
            if p == at[k] {
                k += 1;
            }
        }
        lo
    }

    /// The first position in `lo..=hi` that some worker of `active` lacks, and its holders, given
    /// that all hold `chain[..lo]` (`lo_hint` being `chain[lo - 1]`'s run hint) and some lack
    /// `chain[hi]` (whose holders are `hi_set`).
    ///
    /// First up to [`GUESSES`](Self::GUESSES) times the run hint's guess: the guessed end of
    /// the stored run and the block after it, two independent probes that settle a run ending
    /// there. Then a binary search, the fewest probes (each is a cache miss when the index is
    /// large). A wrong guess only narrows the stretch.
    fn first_lacked(
        &self,
        chain: &[BlockHash],
        mut lo: usize,
        mut lo_hint: usize,
        mut hi: usize,
        mut hi_set: WorkerSet,
        active: &[(u32, u64)],
    ) -> (usize, WorkerSet) {
        let mut guesses = 0;
        while lo < hi {
            let guess = lo + lo_hint;
            if lo_hint > 0 && guess <= hi && guesses < Self::GUESSES {
                guesses += 1;
                // The guessed end is chain[guess - 1]; the block after it is chain[guess].
                let end_set = self.holders_of(&chain[guess - 1]);
                let next_set = if guess == hi {
                    hi_set
                } else {
                    self.holders_of(&chain[guess])
                };
                if !self.holds_all(active, end_set) {
                    (hi, hi_set, lo_hint) = (guess - 1, end_set, 0);
                } else if !self.holds_all(active, next_set) {
                    return (guess, next_set);
                } else {
                    (lo, lo_hint) = (guess + 1, next_set.run_hint());
                }
                continue;
            }
            let mid = lo + (hi - lo) / 2;
            let set = self.holders_of(&chain[mid]);
            if self.holds_all(active, set) {
                (lo, lo_hint) = (mid + 1, set.run_hint());
            } else {
                hi = mid;
                hi_set = set;
            }
        }
        (hi, hi_set)
    }

    /// Run-hint guesses per [`first_lacked`](Self::first_lacked) before it bisects: a guess that
    /// only confirms a run costs two probes, so small hints must not make the search linear.
    const GUESSES: usize = 2;

    /// Every block with the dense indices of its holders (for snapshots).
    pub(crate) fn holders(&self) -> impl Iterator<Item = (BlockHash, Vec<usize>)> + '_ {
        self.blocks.iter().map(|(b, set)| {
            let mut buf = [(0, 0); 1];
            let mut v = Vec::new();
            for &(word, mut bits) in set.words(&self.spill, &mut buf) {
                while bits != 0 {
                    v.push(word as usize * 64 + bits.trailing_zeros() as usize);
                    bits &= bits - 1;
                }
            }
            (b, v)
        })
    }

    /// Every block with its run hint (for snapshots).
    pub(crate) fn run_hints(&self) -> impl Iterator<Item = (BlockHash, usize)> + '_ {
        self.blocks.iter().map(|(b, set)| (b, set.run_hint()))
    }

    /// Sets the run hint of a block the index holds (from a snapshot); false if it holds none.
    pub(crate) fn set_run_hint(&mut self, block: BlockHash, hint: usize) -> bool {
        match self.blocks.get_mut(&block) {
            Some(set) => {
                *set = set.with_run_hint(hint);
                true
            }
            None => false,
        }
    }

    /// Sets a registered worker's state from a snapshot; returns how many blocks were new.
    pub(crate) fn restore_worker(
        &mut self,
        worker: WorkerId,
        next_event: u64,
        stale: bool,
        holey: bool,
        blocks: &[BlockHash],
    ) -> usize {
        let Some(&idx) = self.ids.get(&worker) else {
            return 0;
        };
        let mut stored = 0;
        for &b in blocks {
            // The snapshot's run hints are set once every worker is in.
            let (newly, _) = add_holder(&mut self.blocks, &mut self.spill, b, idx, 0);
            stored += usize::from(newly);
        }
        if let Some(Some(st)) = self.workers.get_mut(idx as usize) {
            st.next_event = next_event;
            st.stale = stale;
            st.blocks += stored;
        }
        let empty = self.block_count(worker) == 0;
        self.set_holey(idx, holey && !empty);
        self.pairs += stored;
        stored
    }

    /// Blocks the index believes `worker` holds (the cache view); 0 for an unknown worker.
    pub fn block_count(&self, worker: WorkerId) -> usize {
        self.state(worker).map_or(0, |s| s.blocks)
    }

    /// Whether `worker` is believed to hold `block`.
    pub fn holds(&self, worker: WorkerId, block: BlockHash) -> bool {
        match (self.ids.get(&worker), self.blocks.get(&block)) {
            (Some(&i), Some(set)) => set.contains(i, &self.spill),
            _ => false,
        }
    }

    /// Trusts (or stops trusting) that the engines evict tail first: every `Removed` event takes
    /// only blocks that no block the engine keeps extends, as [`BlockCache`](crate::BlockCache),
    /// vLLM's prefix cache and SGLang's radix cache do, and each worker's events come from one
    /// engine. A removal then leaves the mirror prefix-closed, and its queries keep probing at
    /// strides; without the trust (the default) a worker's first removal makes it
    /// [holey](Self::may_have_holes) until it is empty, and from then on it is walked block by
    /// block, several times slower. In exchange a [stale](Self::is_stale) worker (skipped event
    /// ids, a rejected store) is holey until it is empty: removals it missed may have left
    /// blocks that later removals are not leaves of. Turning the trust on marks the stale
    /// workers holey at once; a worker already holey stays so until it is empty. The setting is
    /// not part of a snapshot: set it again after [`restore`](Self::restore).
    ///
    /// Trusting engines that break the rule (a sliding-window group dropping the blocks before
    /// its window, several data-parallel ranks' events on one worker's stream) makes the runs of
    /// the workers they feed overcount. vLLM may hold two copies of one block and report each
    /// one's removal: after the first the mirror lacks a block the engine still holds, and a
    /// trusted run may pass it, as the engine's own run does.
    ///
    /// ```
    /// use kvcache::{BlockCache, CacheIndex, WorkerId};
    /// use kvblock::BlockHash;
    /// let chain: Vec<BlockHash> = (1..=4).map(BlockHash::new).collect();
    /// let mut engine = BlockCache::new(Some(4));
    /// engine.insert(&chain)?;
    /// engine.insert(&[BlockHash::new(9)])?; // evicts block 4, the tail
    /// let (mut index, w) = (CacheIndex::new(), WorkerId::new(0));
    /// index.set_tail_first(true);
    /// for (id, ev) in engine.drain_events().enumerate() {
    ///     index.apply(w, id as u64, &ev)?;
    /// }
    /// assert!(!index.may_have_holes(w));
    /// assert_eq!(index.overlaps(&chain).get(w), 3);
    /// # Ok::<(), kvcache::Error>(())
    /// ```
    pub fn set_tail_first(&mut self, trust: bool) {
        self.tail_first = trust;
        if trust {
            // Stale workers may hold blocks whose removal was lost (the same rule as `apply`).
            let stale: Vec<u32> = (0..self.workers.len() as u32)
                .filter(|&i| {
                    self.workers[i as usize]
                        .as_ref()
                        .is_some_and(|s| s.stale && s.blocks > 0)
                })
                .collect();
            for i in stale {
                self.set_holey(i, true);
            }
        }
    }

    /// Whether removals are trusted to take leaves ([`set_tail_first`](Self::set_tail_first)).
    pub fn tail_first(&self) -> bool {
        self.tail_first
    }

    /// Whether `worker`'s mirror may not be prefix-closed: since it was last empty, a `Removed`
    /// event removed some of its blocks and left others (the index does not know whether a
    /// removed block was a leaf), or, when removals are trusted to take leaves
    /// ([`set_tail_first`](Self::set_tail_first)), the worker is [stale](Self::is_stale). By
    /// default a gap or a rejected store makes the worker stale, not holey: only applied events
    /// shape the mirror, and stores go under a parent the worker holds, or start a chain.
    /// [`overlaps`](Self::overlaps) walks a holey worker block by block; every other worker's
    /// run is found with a few probes.
    ///
    /// ```
    /// use kvcache::{BlockHash, CacheIndex, KvEvent, WorkerId};
    /// let (mut index, w) = (CacheIndex::new(), WorkerId::new(1));
    /// let chain: Vec<BlockHash> = (1..=3).map(BlockHash::new).collect();
    /// index.apply(w, 0, &KvEvent::Stored { parent: None, blocks: chain.clone() })?;
    /// index.apply(w, 4, &KvEvent::Stored { parent: Some(chain[2]), blocks: vec![BlockHash::new(9)] })?;
    /// assert!(index.is_stale(w) && !index.may_have_holes(w)); // a gap: stale, still closed
    /// index.apply(w, 5, &KvEvent::Removed { blocks: vec![chain[1]] })?;
    /// assert!(index.may_have_holes(w)); // block 3 (and 9) may stay without block 2
    /// assert_eq!(index.overlaps(&chain).get(w), 1);
    /// # Ok::<(), kvcache::Error>(())
    /// ```
    pub fn may_have_holes(&self, worker: WorkerId) -> bool {
        self.state(worker).is_some_and(|s| s.holey)
    }

    /// Whether events of `worker` were skipped or rejected since it was last cleared.
    pub fn is_stale(&self, worker: WorkerId) -> bool {
        self.state(worker).is_some_and(|s| s.stale)
    }

    /// The next event id expected from `worker` (`None` for an unknown worker).
    pub fn next_event_id(&self, worker: WorkerId) -> Option<u64> {
        self.state(worker).map(|s| s.next_event)
    }

    /// The dense index of `worker`, stable while it is registered.
    pub fn worker_index(&self, worker: WorkerId) -> Option<usize> {
        self.ids.get(&worker).map(|&i| i as usize)
    }

    /// The worker at a dense index.
    pub fn worker_at(&self, index: usize) -> Option<WorkerId> {
        self.workers.get(index)?.as_ref().map(|s| s.id)
    }

    /// One more than the largest dense index in use: the length per-worker arrays need.
    pub fn index_bound(&self) -> usize {
        self.workers.len()
    }

    /// Registered workers, in id order.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut w: Vec<WorkerId> = self.ids.keys().copied().collect();
        w.sort_unstable();
        w
    }

    /// Registered workers.
    pub fn worker_count(&self) -> usize {
        self.ids.len()
    }

    /// Distinct blocks held by at least one worker.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Resident (block, worker) pairs over all workers.
    pub fn pairs(&self) -> usize {
        self.pairs
    }

    fn state(&self, worker: WorkerId) -> Option<&WorkerState> {
        let &i = self.ids.get(&worker)?;
        self.workers.get(i as usize)?.as_ref()
    }

    /// Checks that every worker's run of `chain` from [`overlaps`](Self::overlaps) (probed at
    /// strides where the worker is deemed hole-free) equals a block-by-block walk of the mirror;
    /// tests of code that feeds the index call it, as `check_invariants`.
    #[doc(hidden)]
    pub fn check_runs(&self, chain: &[BlockHash]) -> Result<(), String> {
        let ov = self.overlaps(chain);
        for w in self.workers() {
            let walked = chain.iter().take_while(|b| self.holds(w, **b)).count();
            if ov.get(w) != walked {
                return Err(format!(
                    "{w}: run {} where the walk gives {walked}",
                    ov.get(w)
                ));
            }
        }
        Ok(())
    }

    /// Checks the bookkeeping against the block map; property tests call it after every step.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut per = vec![0usize; self.workers.len()];
        for (h, set) in self.blocks.iter() {
            if set.is_empty() {
                return Err(format!("{h} has an empty holder set"));
            }
            let mut buf = [(0, 0)];
            let words = set.words(&self.spill, &mut buf);
            if words.windows(2).any(|p| p[0].0 >= p[1].0) || words.iter().any(|p| p.1 == 0) {
                return Err(format!("{h} has a malformed holder set"));
            }
            // Spilled only when it does not fit inline, and one word kept in its slot.
            if let Err(i) = set.form() {
                let list = &self.spill.lists[i as usize];
                let narrow = matches!(words, [(_, b)] if fits_inline(*b));
                if narrow || matches!(list, List::Many(v) if v.len() < 2) {
                    return Err(format!("{h} has a holder list in the wrong form"));
                }
            }
            for &(w, bits) in words {
                for b in 0..64 {
                    if bits & (1 << b) != 0 {
                        let i = w as usize * 64 + b;
                        match self.workers.get(i) {
                            Some(Some(_)) => per[i] += 1,
                            _ => return Err(format!("{h} is held by unregistered index {i}")),
                        }
                    }
                }
            }
        }
        for (i, st) in self.workers.iter().enumerate() {
            if let Some(st) = st {
                if st.blocks != per[i] || self.ids.get(&st.id) != Some(&(i as u32)) {
                    return Err(format!(
                        "{}: counted {} blocks, holds {}",
                        st.id, st.blocks, per[i]
                    ));
                }
            }
        }
        let spilled = self.blocks.values().filter(|s| s.form().is_err()).count();
        if spilled + self.spill.free.len() != self.spill.lists.len() {
            return Err("spilled holder lists leak".into());
        }
        if per.iter().sum::<usize>() != self.pairs
            || self.ids.len() + self.free.len() != self.workers.len()
        {
            return Err("pair or worker totals are wrong".into());
        }
        Ok(())
    }
}

/// Where a run hint sends the probes of a chain of `n` blocks whose first `depth` are held,
/// `hint` being `chain[depth - 1]`'s: the guessed end of the stored run, the block after it and
/// the chain's last block.
#[inline]
fn hinted_probes(n: usize, depth: usize, hint: usize) -> [usize; 3] {
    let end = (depth - 1 + hint).min(n - 1);
    [end, (end + 1).min(n - 1), n - 1]
}

/// Records that the worker at `idx` holds `b`, with `hint` as its run hint if the block is new
/// to the index. Returns whether the worker was not recorded yet, and the block's run hint if
/// the index held it already.
#[inline(always)]
fn add_holder(
    blocks: &mut BlockMap<WorkerSet>,
    spill: &mut Spill,
    b: BlockHash,
    idx: u32,
    hint: usize,
) -> (bool, Option<usize>) {
    match blocks.get_or_insert(b, WorkerSet::single(idx).with_run_hint(hint)) {
        Some(set) => {
            let held = set.run_hint();
            (set.insert(idx, spill), Some(held))
        }
        None => (true, None),
    }
}

fn record(
    workers: &[Option<WorkerState>],
    runs: &mut [usize],
    matched: &mut Vec<(WorkerId, usize)>,
    word: u32,
    mut bits: u64,
    run: usize,
) {
    while bits != 0 {
        let i = word as usize * 64 + bits.trailing_zeros() as usize;
        bits &= bits - 1;
        if let (Some(slot), Some(Some(st))) = (runs.get_mut(i), workers.get(i)) {
            *slot = run;
            matched.push((st.id, run));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().copied().map(BlockHash::new).collect()
    }

    /// A chain's first block keeps its run hint among the heads, as stored and as cut where
    /// another chain branches off, or as a query reads it; a block stored under a parent is no
    /// head.
    #[test]
    fn heads_follow_the_first_blocks_run_hints() {
        let mut index = CacheIndex::new();
        let (a, b) = (WorkerId::new(1), WorkerId::new(2));
        assert_eq!(index.heads.hint(BlockHash::new(1)), None);
        let stored = |blocks: &[u64], parent: Option<u64>| KvEvent::Stored {
            parent: parent.map(BlockHash::new),
            blocks: chain(blocks),
        };
        index.apply(a, 0, &stored(&[1, 2, 3, 4], None)).unwrap();
        assert_eq!(index.heads.hint(BlockHash::new(1)), Some(3));
        index.apply(a, 1, &stored(&[5, 6], Some(4))).unwrap();
        assert_eq!(index.heads.hint(BlockHash::new(5)), None);
        // Worker b shares two blocks and branches: the head's run is cut to end there.
        index.apply(b, 0, &stored(&[1, 2, 9], None)).unwrap();
        assert_eq!(index.heads.hint(BlockHash::new(1)), Some(1));
        assert_eq!(index.overlaps(&chain(&[1, 2, 3, 4, 5])).get(a), 5);
        // A head with a run of one block has nothing to guess.
        index.apply(b, 1, &stored(&[7], None)).unwrap();
        assert_eq!(index.heads.hint(BlockHash::new(7)), None);
        // An index restored from a snapshot learns a head when a query reads it.
        let restored = CacheIndex::restore(index.snapshot()).unwrap();
        assert_eq!(restored.heads.hint(BlockHash::new(1)), None);
        assert_eq!(restored.overlaps(&chain(&[1, 2, 3])).get(a), 3);
        assert_eq!(restored.heads.hint(BlockHash::new(1)), Some(1));
        // A clone keeps what its original learnt.
        assert_eq!(restored.clone().heads.hint(BlockHash::new(1)), Some(1));
    }
}
