//! A map from block hashes to small values in which a lookup waits for one memory access:
//! bucketized cuckoo hashing.
//!
//! Every key may live in one of two buckets, each one aligned cache line of `N` slots (by
//! default [`WAYS`]; five for 4-byte values, [`COMPACT_WAYS`]),
//! whose addresses follow from the key's hash alone. A lookup reads both lines at once, so
//! their cache misses overlap, where a swiss table reads its control bytes and only then the
//! entry (two misses one after the other): on an index larger than the CPU cache a query's
//! probes cost one miss each instead of two. An insert pays for it, reading two lines where a
//! swiss table reads one control group. Removal vacates the slot. An insert that finds both
//! buckets full moves an entry of either to its other bucket, or walks further (bounded,
//! deterministic: no random choice), and grows the table if the walk fails. Growing doubles the
//! table by splitting every bucket in two, in one pass over it.
//!
//! Keys are any `u64` (block hashes); one value of `V` ([`Vacant::VACANT`]) marks a free slot and
//! is never stored. Iteration goes in slot order, which depends only on the operations applied.

use kvblock::BlockHash;

use crate::prefetch;

/// A value a [`BlockMap`] can hold: `VACANT` marks a free slot and is never stored.
pub(crate) trait Vacant: Copy + PartialEq {
    /// The value of a free slot.
    const VACANT: Self;
}

/// `u32::MAX`: the engine cache's slot numbers stay below it.
impl Vacant for u32 {
    const VACANT: u32 = u32::MAX;
}

/// Slots per bucket: four `u64` keys and their values fill a 64-byte line when values are
/// 8 bytes.
const WAYS: usize = 4;
/// Slots per bucket for 4-byte values: five keys and their values fit a 64-byte line (60
/// bytes), so a map of them takes a fifth fewer lines, and half as many where that fraction
/// keeps the bucket count below the next power of two.
pub(crate) const COMPACT_WAYS: usize = 5;
const _: () = assert!(std::mem::size_of::<Bucket<u32, COMPACT_WAYS>>() == 64);
/// By default the table grows past this share of its slots (as a swiss table does), in
/// eighths.
const LOAD_EIGHTHS: usize = 7;
/// Displacements an insert tries, after the one-step moves, before it grows the table instead.
const MAX_KICKS: usize = 64;
/// Keys whose buckets [`BlockMap::warm_ahead`] reads ahead of updating them: about as many
/// lines as a core keeps loading at once (on the block-16 simulation, 24 to 64 ran alike and 16
/// a tenth slower with first-level hints; 16 to 64 alike with second-level ones).
const LOOKAHEAD: usize = 32;

#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Bucket<V, const N: usize> {
    keys: [u64; N],
    vals: [V; N],
}

impl<V: Vacant, const N: usize> Bucket<V, N> {
    const EMPTY: Self = Bucket {
        keys: [0; N],
        vals: [V::VACANT; N],
    };

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        (0..N).find(|&w| self.keys[w] == key && self.vals[w] != V::VACANT)
    }

    /// Free slots, as a bit mask of ways.
    #[inline]
    fn free(&self) -> u32 {
        (0..N).fold(0, |m, w| m | (u32::from(self.vals[w] == V::VACANT) << w))
    }
}

/// The map; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct BlockMap<V, const N: usize = WAYS> {
    /// A power of two of them, or none before the first insert.
    buckets: Vec<Bucket<V, N>>,
    len: usize,
    /// Which slot the next displacement takes (rotating: deterministic).
    kicks: usize,
    /// The table grows past this share of its slots, in eighths.
    max_load: usize,
}

impl<V: Vacant, const N: usize> Default for BlockMap<V, N> {
    fn default() -> Self {
        BlockMap::with_max_load(LOAD_EIGHTHS)
    }
}

/// Mixes a key (a multiply and a fold): trace ids are small consecutive integers.
#[inline]
pub(crate) fn spread(key: u64) -> u64 {
    let m = u128::from(key) * u128::from(0x9E37_79B9_7F4A_7C15_u64);
    (m as u64) ^ ((m >> 64) as u64)
}

impl<V: Vacant, const N: usize> BlockMap<V, N> {
    /// An empty map that grows past `eighths` eighths of its slots (1 to 7). The fuller, the
    /// smaller, but the more often an insert finds both of its buckets full and moves entries
    /// (at 7/8, about one insert in eight in steady churn; at 1/2, hardly ever).
    pub(crate) fn with_max_load(eighths: usize) -> Self {
        BlockMap {
            buckets: Vec::new(),
            len: 0,
            kicks: 0,
            max_load: eighths.clamp(1, 7),
        }
    }

    /// Entries stored.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Removes every entry, keeping the table.
    pub(crate) fn clear(&mut self) {
        self.buckets.fill(Bucket::EMPTY);
        self.len = 0;
    }

    /// The two buckets of `key` (now and then the same one: then it has one). Each is a bit
    /// mask of the key's hash, so when the table doubles, an entry of bucket `i` goes to bucket
    /// `i` or `i + n` and nowhere else (see [`grow`](Self::grow)).
    #[inline]
    fn buckets_of(&self, key: u64) -> (usize, usize) {
        let mask = self.buckets.len().wrapping_sub(1);
        let h = spread(key);
        (h as usize & mask, (h >> 32) as usize & mask)
    }

    /// The bucket and way of `key`, if stored.
    #[inline(always)]
    fn position(&self, key: u64) -> Option<(usize, usize)> {
        if self.buckets.is_empty() {
            return None;
        }
        let (a, b) = self.buckets_of(key);
        // Both lines are read before either is searched, so their misses overlap.
        let (ba, bb) = (&self.buckets[a], &self.buckets[b]);
        match ba.find(key) {
            Some(w) => Some((a, w)),
            None => bb.find(key).map(|w| (b, w)),
        }
    }

    #[inline(always)]
    pub(crate) fn get(&self, key: &BlockHash) -> Option<V> {
        self.position(key.get())
            .map(|(b, w)| self.buckets[b].vals[w])
    }

    #[inline]
    pub(crate) fn contains_key(&self, key: &BlockHash) -> bool {
        self.position(key.get()).is_some()
    }

    /// The value of `key`, to change in place; it must not be set to [`Vacant::VACANT`] (see
    /// [`update`](Self::update)).
    #[inline]
    pub(crate) fn get_mut(&mut self, key: &BlockHash) -> Option<&mut V> {
        let (b, w) = self.position(key.get())?;
        Some(&mut self.buckets[b].vals[w])
    }

    /// Applies `change` to the value of `key` and removes the entry unless `keep` says
    /// otherwise of the changed value. Returns what `change` returned (`None`: no such key).
    #[inline(always)]
    pub(crate) fn update<R>(
        &mut self,
        key: &BlockHash,
        change: impl FnOnce(&mut V) -> R,
        keep: impl FnOnce(V) -> bool,
    ) -> Option<R> {
        let (b, w) = self.position(key.get())?;
        let val = &mut self.buckets[b].vals[w];
        let out = change(val);
        if !keep(*val) {
            *val = V::VACANT;
            self.len -= 1;
        }
        Some(out)
    }

    /// Stores `val` (not [`Vacant::VACANT`]) under `key`; returns the value it replaced.
    #[cfg(test)]
    fn insert(&mut self, key: BlockHash, val: V) -> Option<V> {
        if let Some(slot) = self.get_mut(&key) {
            return Some(std::mem::replace(slot, val));
        }
        self.insert_vacant(key, val);
        None
    }

    /// Stores `val` (not [`Vacant::VACANT`]) under `key` unless `key` is present; returns
    /// whether it stored.
    #[inline]
    pub(crate) fn insert_absent(&mut self, key: BlockHash, val: V) -> bool {
        self.get_or_insert(key, val).is_none()
    }

    /// The value of `key`, to change in place (not to [`Vacant::VACANT`]); or, when `key` is
    /// absent, `None` after storing `val` (not [`Vacant::VACANT`]) under it. One pass over the
    /// key's two lines, where a lookup and then an insert would make two.
    #[inline(always)]
    pub(crate) fn get_or_insert(&mut self, key: BlockHash, val: V) -> Option<&mut V> {
        let k = key.get();
        if (self.len + 1) * 8 <= self.buckets.len() * N * self.max_load {
            let (a, b) = self.buckets_of(k);
            let found = match self.buckets[a].find(k) {
                Some(w) => Some((a, w)),
                None => self.buckets[b].find(k).map(|w| (b, w)),
            };
            if let Some((at, w)) = found {
                return Some(&mut self.buckets[at].vals[w]);
            }
            if self.put_in_emptier(a, b, k, val) {
                self.len += 1;
                return None;
            }
        } else if let Some((at, w)) = self.position(k) {
            return Some(&mut self.buckets[at].vals[w]);
        }
        self.insert_vacant(key, val);
        None
    }

    /// Stores `val` (not [`Vacant::VACANT`]) under `key`, which must be absent (the caller has
    /// just looked it up).
    pub(crate) fn insert_vacant(&mut self, key: BlockHash, val: V) {
        debug_assert!(val != V::VACANT && !self.contains_key(&key));
        if (self.len + 1) * 8 > self.buckets.len() * N * self.max_load {
            self.grow();
        }
        let mut homeless = (key.get(), val);
        while let Some(left) = self.place(homeless) {
            // The walk failed: a larger table takes the entry it left over.
            self.grow();
            homeless = left;
        }
        self.len += 1;
    }

    #[inline]
    fn put(&mut self, at: usize, w: usize, key: u64, val: V) {
        self.buckets[at].keys[w] = key;
        self.buckets[at].vals[w] = val;
    }

    /// Puts an entry into the emptier of its buckets `a` and `b` (two choices keep the buckets
    /// even, so both are full less often); false if both are full.
    #[inline]
    fn put_in_emptier(&mut self, a: usize, b: usize, key: u64, val: V) -> bool {
        let (fa, fb) = (self.buckets[a].free(), self.buckets[b].free());
        if fa | fb == 0 {
            return false;
        }
        let (at, free) = if fa.count_ones() >= fb.count_ones() {
            (a, fa)
        } else {
            (b, fb)
        };
        self.put(at, free.trailing_zeros() as usize, key, val);
        true
    }

    /// Puts an entry into one of its buckets, displacing others if both are full. Returns the
    /// entry left without a slot if that fails.
    fn place(&mut self, (key, val): (u64, V)) -> Option<(u64, V)> {
        let (a, b) = self.buckets_of(key);
        if self.put_in_emptier(a, b, key, val) {
            return None;
        }
        // Both full: an entry of either whose other bucket has room moves there (these reads
        // do not depend on each other); failing that, a walk.
        for at in [a, b] {
            for w in 0..N {
                let moved = self.buckets[at].keys[w];
                let (x, y) = self.buckets_of(moved);
                let alt = if x == at { y } else { x };
                let free = self.buckets[alt].free();
                if free != 0 {
                    let v = self.buckets[at].vals[w];
                    self.put(alt, free.trailing_zeros() as usize, moved, v);
                    self.put(at, w, key, val);
                    return None;
                }
            }
        }
        self.walk(if self.kicks % 2 == 0 { a } else { b }, key, val)
    }

    /// The cuckoo walk from `key`'s full bucket `at`: each step puts the homeless entry in one
    /// of the bucket's slots (rotating) and takes the entry it displaces to that entry's other
    /// bucket, until one has room or [`MAX_KICKS`] steps pass.
    fn walk(&mut self, mut at: usize, mut key: u64, mut val: V) -> Option<(u64, V)> {
        for _ in 0..MAX_KICKS {
            let w = self.kicks % N;
            self.kicks = self.kicks.wrapping_add(1);
            let bucket = &mut self.buckets[at];
            std::mem::swap(&mut bucket.keys[w], &mut key);
            std::mem::swap(&mut bucket.vals[w], &mut val);
            let (x, y) = self.buckets_of(key);
            at = if x == at { y } else { x };
            let free = self.buckets[at].free();
            if free != 0 {
                self.put(at, free.trailing_zeros() as usize, key, val);
                return None;
            }
        }
        Some((key, val))
    }

    /// Doubles the buckets (two at first). The entries of old bucket `i` split between new
    /// buckets `i` and `i + n` (each keeps the bucket of the same mask of its hash), which
    /// receive only those: one pass in order, with no displacement and no random reads.
    fn grow(&mut self) {
        let n = self.buckets.len();
        let old = std::mem::replace(&mut self.buckets, vec![Bucket::EMPTY; (n * 2).max(2)]);
        for (i, bucket) in old.iter().enumerate() {
            let mut fill = [0usize; 2];
            for w in 0..N {
                if bucket.vals[w] == V::VACANT {
                    continue;
                }
                let key = bucket.keys[w];
                let (a, b) = self.buckets_of(key);
                let to = if a & (n - 1) == i { a } else { b };
                let half = usize::from(to != i);
                self.put(to, fill[half], key, bucket.vals[w]);
                fill[half] += 1;
            }
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: &BlockHash) -> Option<V> {
        self.update(key, |v| *v, |_| false)
    }

    /// Keeps the entries for which `keep` (which may change the value, but not to
    /// [`Vacant::VACANT`]) returns true.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(BlockHash, &mut V) -> bool) {
        for bucket in &mut self.buckets {
            for w in 0..N {
                if bucket.vals[w] != V::VACANT
                    && !keep(BlockHash::new(bucket.keys[w]), &mut bucket.vals[w])
                {
                    bucket.vals[w] = V::VACANT;
                    self.len -= 1;
                }
            }
        }
    }

    /// Every entry, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, V)> + '_ {
        self.buckets.iter().flat_map(|b| {
            (0..N)
                .filter(|&w| b.vals[w] != V::VACANT)
                .map(|w| (BlockHash::new(b.keys[w]), b.vals[w]))
        })
    }

    /// Every value, in slot order.
    pub(crate) fn values(&self) -> impl Iterator<Item = V> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// For a loop updating `keys` one by one, called at every position `at` in order: starts
    /// loading the buckets of the key [`LOOKAHEAD`] positions ahead (at position 0, of the first
    /// [`LOOKAHEAD`] keys), so that each update finds its lines in cache, where its misses
    /// would otherwise be paid after the last update's. With a prefetch hint the window slides
    /// key by key, every key's lines requested as long before its update (into the second-level
    /// cache: [`prefetch_far`](prefetch::prefetch_far)); without one, every
    /// [`LOOKAHEAD`]-th position reads one word of each of the next keys' lines (reads that do
    /// not depend on each other, so their misses overlap).
    #[inline]
    pub(crate) fn warm_ahead(&self, keys: &[BlockHash], at: usize) {
        if self.buckets.is_empty() {
            return;
        }
        if prefetch::HINTS {
            let ahead = match at {
                0 => &keys[..LOOKAHEAD.min(keys.len())],
                _ => keys.get(at + LOOKAHEAD - 1..at + LOOKAHEAD).unwrap_or(&[]),
            };
            for k in ahead {
                self.hint_lines::<true>(k);
            }
        } else if at % LOOKAHEAD == 0 {
            let mut touched = 0;
            for k in &keys[at..(at + LOOKAHEAD).min(keys.len())] {
                let (a, b) = self.buckets_of(k.get());
                touched ^= self.buckets[a].keys[0] ^ self.buckets[b].keys[0];
            }
            std::hint::black_box(touched);
        }
    }

    /// Starts loading both lines of `key`, for a lookup that is coming (nothing without a
    /// prefetch hint: a safe load would wait for the line here).
    #[inline]
    pub(crate) fn prefetch_key(&self, key: &BlockHash) {
        if prefetch::HINTS && !self.buckets.is_empty() {
            self.hint_lines::<false>(key);
        }
    }

    /// Hints both lines of `key` (the table is not empty): into the second-level cache when
    /// `FAR` ([`prefetch_far`](prefetch::prefetch_far)), else the first.
    #[inline(always)]
    fn hint_lines<const FAR: bool>(&self, key: &BlockHash) {
        let (a, b) = self.buckets_of(key.get());
        for line in [&self.buckets[a], &self.buckets[b]] {
            if FAR {
                prefetch::prefetch_far(line);
            } else {
                prefetch::prefetch(line);
            }
        }
    }

    /// Checks the table's own invariants (for tests): every entry in one of its buckets, each
    /// key once, the count right.
    #[cfg(test)]
    fn check(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for (i, bucket) in self.buckets.iter().enumerate() {
            for w in 0..N {
                if bucket.vals[w] == V::VACANT {
                    continue;
                }
                let key = bucket.keys[w];
                let (a, b) = self.buckets_of(key);
                if i != a && i != b {
                    return Err(format!("{key:#x} in bucket {i}, not its {a} or {b}"));
                }
                if !seen.insert(key) {
                    return Err(format!("{key:#x} stored twice"));
                }
            }
        }
        if seen.len() != self.len {
            return Err(format!("len {} but {} entries", self.len, seen.len()));
        }
        if !self.buckets.is_empty() && !self.buckets.len().is_power_of_two() {
            return Err(format!("{} buckets", self.buckets.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Get(u64),
        /// Removes the keys whose value is odd and adds one to the rest.
        Retain,
        Update(u64, u32),
        /// Sets the value, removing the entry when it is a multiple of 3.
        UpdateOrRemove(u64, u32),
        /// Stores only if absent.
        InsertAbsent(u64, u32),
        /// Adds one to the value if present, else stores.
        GetOrInsert(u64, u32),
        Clear,
    }

    /// Keys from a small pool (so removals and repeats hit), at spread-out and at small values.
    fn key() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..300,
            (0u64..300).prop_map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (key(), 0u32..1000).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => key().prop_map(Op::Remove),
            2 => key().prop_map(Op::Get),
            2 => (key(), 0u32..1000).prop_map(|(k, v)| Op::Update(k, v)),
            2 => (key(), 0u32..1000).prop_map(|(k, v)| Op::UpdateOrRemove(k, v)),
            4 => (key(), 0u32..1000).prop_map(|(k, v)| Op::InsertAbsent(k, v)),
            4 => (key(), 0u32..1000).prop_map(|(k, v)| Op::GetOrInsert(k, v)),
            1 => Just(Op::Clear),
            1 => Just(Op::Retain),
        ]
    }

    /// Operations per case: fewer under Miri, which interprets every one.
    const MAX_OPS: usize = if cfg!(miri) { 40 } else { 600 };

    proptest! {
        // A few cases under Miri (which runs kvcache's tests in CI), all of them otherwise.
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 3 } else { 256 }))]
        /// The same operations on the map (at any highest load, with four or five ways) and on
        /// a `BTreeMap` give the same answers; the table's invariants hold after every step.
        #[test]
        fn behaves_like_a_map(
            load in 1usize..8,
            five in any::<bool>(),
            ops in prop::collection::vec(op(), 1..MAX_OPS),
        ) {
            if five {
                like_a_map::<COMPACT_WAYS>(load, ops)?;
            } else {
                like_a_map::<4>(load, ops)?;
            }
        }
    }

    /// One case of `behaves_like_a_map`, with `N` ways.
    fn like_a_map<const N: usize>(load: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let mut map = BlockMap::<u32, N>::with_max_load(load);
        let mut model = BTreeMap::<u64, u32>::new();
        for op in ops {
            match op {
                Op::Insert(k, v) => {
                    prop_assert_eq!(map.insert(BlockHash::new(k), v), model.insert(k, v));
                }
                Op::Remove(k) => {
                    prop_assert_eq!(map.remove(&BlockHash::new(k)), model.remove(&k));
                }
                Op::Get(k) => {
                    prop_assert_eq!(map.get(&BlockHash::new(k)), model.get(&k).copied());
                    prop_assert_eq!(map.contains_key(&BlockHash::new(k)), model.contains_key(&k));
                }
                Op::Update(k, v) => {
                    if let Some(x) = map.get_mut(&BlockHash::new(k)) {
                        *x = v;
                    }
                    if let Some(x) = model.get_mut(&k) {
                        *x = v;
                    }
                }
                Op::UpdateOrRemove(k, v) => {
                    let got = map.update(
                        &BlockHash::new(k),
                        |x| std::mem::replace(x, v),
                        |x| x % 3 != 0,
                    );
                    let want = model.get_mut(&k).map(|x| std::mem::replace(x, v));
                    if v % 3 == 0 {
                        model.remove(&k);
                    }
                    prop_assert_eq!(got, want);
                }
                Op::InsertAbsent(k, v) => {
                    let absent = !model.contains_key(&k);
                    if absent {
                        model.insert(k, v);
                    }
                    prop_assert_eq!(map.insert_absent(BlockHash::new(k), v), absent);
                }
                Op::GetOrInsert(k, v) => {
                    let got = map.get_or_insert(BlockHash::new(k), v).map(|x| {
                        *x += 1;
                        *x
                    });
                    let want = match model.get_mut(&k) {
                        Some(x) => {
                            *x += 1;
                            Some(*x)
                        }
                        None => {
                            model.insert(k, v);
                            None
                        }
                    };
                    prop_assert_eq!(got, want);
                }
                Op::Clear => {
                    map.clear();
                    model.clear();
                }
                Op::Retain => {
                    map.retain(|_, v| {
                        *v += 1;
                        *v % 2 == 1
                    });
                    model.retain(|_, v| {
                        *v += 1;
                        *v % 2 == 1
                    });
                }
            }
            prop_assert_eq!(map.check(), Ok(()));
            prop_assert_eq!(map.len(), model.len());
            let mut all: Vec<(u64, u32)> = map.iter().map(|(k, v)| (k.get(), v)).collect();
            all.sort_unstable();
            prop_assert_eq!(all, model.iter().map(|(&k, &v)| (k, v)).collect::<Vec<_>>());
        }
        Ok(())
    }

    /// A million keys in, every one found, half removed, the rest still found: the walk and the
    /// growth hold up at the highest load.
    #[test]
    #[cfg_attr(miri, ignore = "a million keys takes hours under Miri")]
    fn a_million_keys() {
        let mut map = BlockMap::<u32>::default();
        let key = |i: u32| BlockHash::new(spread(u64::from(i) + 1));
        for i in 0..1_000_000 {
            assert_eq!(map.insert(key(i), i), None);
        }
        assert_eq!(map.len(), 1_000_000);
        assert!((0..1_000_000).all(|i| map.get(&key(i)) == Some(i)));
        for i in (0..1_000_000).step_by(2) {
            assert_eq!(map.remove(&key(i)), Some(i));
        }
        assert!((0..1_000_000).all(|i| map.get(&key(i)) == (i % 2 == 1).then_some(i)));
        assert_eq!(map.check(), Ok(()));
    }
}
