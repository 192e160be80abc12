//! The router's mirror of many workers' caches.

use kvblock::BlockHash;

use crate::hasher::Map;
use crate::{Error, KvEvent, WorkerId};

/// The workers holding one block: a sparse bitset over dense worker indices, as sorted
/// `(word, bits)` pairs. One word covers 64 workers, so a block held by a few workers costs one
/// pair and an intersection costs one AND per non-empty word.
#[derive(Debug, Clone, PartialEq, Eq)]
enum WorkerSet {
    One((u32, u64)),
    Many(Vec<(u32, u64)>),
}

impl WorkerSet {
    fn single(idx: u32) -> Self {
        WorkerSet::One((idx / 64, 1 << (idx % 64)))
    }

    fn words(&self) -> &[(u32, u64)] {
        match self {
            WorkerSet::One(pair) => std::slice::from_ref(pair),
            WorkerSet::Many(v) => v,
        }
    }

    fn contains(&self, idx: u32) -> bool {
        let (word, bit) = (idx / 64, 1u64 << (idx % 64));
        match self {
            WorkerSet::One((w, b)) => *w == word && *b & bit != 0,
            WorkerSet::Many(v) => v
                .binary_search_by_key(&word, |p| p.0)
                .is_ok_and(|i| v[i].1 & bit != 0),
        }
    }

    /// Adds `idx`; true if it was absent.
    fn insert(&mut self, idx: u32) -> bool {
        let (word, bit) = (idx / 64, 1u64 << (idx % 64));
        match self {
            WorkerSet::One((w, b)) if *w == word => {
                let absent = *b & bit == 0;
                *b |= bit;
                absent
            }
            WorkerSet::One((w, b)) => {
                let mut v = vec![(*w, *b), (word, bit)];
                v.sort_unstable_by_key(|p| p.0);
                *self = WorkerSet::Many(v);
                true
            }
            WorkerSet::Many(v) => match v.binary_search_by_key(&word, |p| p.0) {
                Ok(i) => {
                    let absent = v[i].1 & bit == 0;
                    v[i].1 |= bit;
                    absent
                }
                Err(i) => {
                    v.insert(i, (word, bit));
                    true
                }
            },
        }
    }

    /// Removes `idx`; true if it was present.
    fn remove(&mut self, idx: u32) -> bool {
        let (word, bit) = (idx / 64, 1u64 << (idx % 64));
        match self {
            WorkerSet::One((w, b)) => {
                let present = *w == word && *b & bit != 0;
                if present {
                    *b &= !bit;
                }
                present
            }
            WorkerSet::Many(v) => {
                let Ok(i) = v.binary_search_by_key(&word, |p| p.0) else {
                    return false;
                };
                let present = v[i].1 & bit != 0;
                v[i].1 &= !bit;
                if v[i].1 == 0 {
                    v.remove(i);
                    if let [(w, b)] = v[..] {
                        *self = WorkerSet::One((w, b));
                    }
                }
                present
            }
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            WorkerSet::One((_, b)) => *b == 0,
            WorkerSet::Many(v) => v.is_empty(),
        }
    }
}

#[derive(Debug, Clone)]
struct WorkerState {
    id: WorkerId,
    next_event: u64,
    blocks: usize,
    stale: bool,
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
///   rejected ([`Error::StaleEvent`]); a gap is applied and reported ([`Applied::gap`]) and marks
///   the worker possibly stale until it is cleared or removed. A `Stored` event whose parent the
///   worker does not hold is rejected ([`Error::UnknownParent`]), consumes its id and marks the
///   worker stale. Removing blocks the index never saw is counted ([`Applied::unknown_removed`]).
/// - [`overlaps`](Self::overlaps) walks the request's blocks from the first, intersecting the set
///   of workers still matching with each block's holders, and stops when none is left: its cost
///   grows with the matched depth, not with the number of stored blocks or idle workers.
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
    blocks: Map<BlockHash, WorkerSet>,
    workers: Vec<Option<WorkerState>>,
    ids: Map<WorkerId, u32>,
    free: Vec<u32>,
    pairs: usize,
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
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.workers[i as usize] = Some(state);
                i
            }
            None => {
                let i = u32::try_from(self.workers.len())
                    .map_err(|_| Error::TooManyWorkers { worker })?;
                self.workers.push(Some(state));
                i
            }
        };
        self.ids.insert(worker, i);
        Ok(i)
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
        st.next_event = event_id.saturating_add(1);
        match event {
            KvEvent::Stored { parent, blocks } => {
                if let Some(p) = *parent {
                    if !self.blocks.get(&p).is_some_and(|s| s.contains(idx)) {
                        st.stale = true;
                        return Err(Error::UnknownParent {
                            worker,
                            event_id,
                            parent: p,
                        });
                    }
                }
                for &b in blocks {
                    let newly = match self.blocks.entry(b) {
                        hashbrown::hash_map::Entry::Occupied(mut e) => e.get_mut().insert(idx),
                        hashbrown::hash_map::Entry::Vacant(v) => {
                            v.insert(WorkerSet::single(idx));
                            true
                        }
                    };
                    if newly {
                        out.stored += 1;
                    } else {
                        out.already_present += 1;
                    }
                }
                st.blocks += out.stored;
                self.pairs += out.stored;
            }
            KvEvent::Removed { blocks } => {
                for &b in blocks {
                    let removed = match self.blocks.entry(b) {
                        hashbrown::hash_map::Entry::Occupied(mut e) => {
                            let removed = e.get_mut().remove(idx);
                            if e.get().is_empty() {
                                e.remove();
                            }
                            removed
                        }
                        hashbrown::hash_map::Entry::Vacant(_) => false,
                    };
                    if removed {
                        out.removed += 1;
                    } else {
                        out.unknown_removed += 1;
                    }
                }
                st.blocks -= out.removed;
                self.pairs -= out.removed;
            }
            KvEvent::Cleared => {
                out.removed = st.blocks;
                st.stale = false;
                self.drop_blocks(idx);
            }
        }
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
        n
    }

    /// Removes `worker` and all of its blocks. Returns whether it was known.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let Some(idx) = self.ids.remove(&worker) else {
            return false;
        };
        self.drop_blocks(idx);
        self.workers[idx as usize] = None;
        self.free.push(idx);
        true
    }

    fn drop_blocks(&mut self, idx: u32) {
        let Some(st) = self.workers[idx as usize].as_mut() else {
            return;
        };
        if st.blocks > 0 {
            self.blocks.retain(|_, set| {
                set.remove(idx);
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
    pub fn overlaps_into(&self, chain: &[BlockHash], out: &mut Overlaps) {
        out.reset(self.workers.len());
        let Some(first) = chain.first().and_then(|h| self.blocks.get(h)) else {
            return;
        };
        out.active.extend_from_slice(first.words());
        for (depth, h) in chain.iter().enumerate().skip(1) {
            let holders = self.blocks.get(h).map_or(&[][..], |s| s.words());
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
                    depth,
                );
            }
            std::mem::swap(&mut out.active, &mut out.next);
            if out.active.is_empty() {
                return;
            }
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

    /// Blocks the index believes `worker` holds (the cache view); 0 for an unknown worker.
    pub fn block_count(&self, worker: WorkerId) -> usize {
        self.state(worker).map_or(0, |s| s.blocks)
    }

    /// Whether `worker` is believed to hold `block`.
    pub fn holds(&self, worker: WorkerId, block: BlockHash) -> bool {
        match (self.ids.get(&worker), self.blocks.get(&block)) {
            (Some(&i), Some(set)) => set.contains(i),
            _ => false,
        }
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

    /// Checks the bookkeeping against the block map; property tests call it after every step.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut per = vec![0usize; self.workers.len()];
        for (h, set) in &self.blocks {
            if set.is_empty() {
                return Err(format!("{h} has an empty holder set"));
            }
            let words = set.words();
            if words.windows(2).any(|p| p[0].0 >= p[1].0) || words.iter().any(|p| p.1 == 0) {
                return Err(format!("{h} has a malformed holder set"));
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
        if per.iter().sum::<usize>() != self.pairs
            || self.ids.len() + self.free.len() != self.workers.len()
        {
            return Err("pair or worker totals are wrong".into());
        }
        Ok(())
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
