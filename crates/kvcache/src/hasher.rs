//! A fixed, fast hasher for maps keyed by block hashes and ids.

use std::hash::{BuildHasher, Hasher};

/// A deterministic `BuildHasher` for integer keys (block hashes, worker and request ids).
///
/// Keys from traces are small consecutive integers, so they are mixed (a multiply and a fold)
/// rather than used as-is; there is no per-process random seed, so nothing built on it can vary
/// between runs.
///
/// ```
/// use std::hash::BuildHasher;
/// let s = kvcache::FixedState;
/// assert_eq!(s.hash_one(42u64), s.hash_one(42u64));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct FixedState;

impl BuildHasher for FixedState {
    type Hasher = FixedHasher;
    #[inline]
    fn build_hasher(&self) -> FixedHasher {
        FixedHasher(0)
    }
}

/// The hasher built by [`FixedState`].
#[derive(Debug, Clone, Copy)]
pub struct FixedHasher(u64);

const K: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for FixedHasher {
    #[inline]
    fn finish(&self) -> u64 {
        // Fold the high half into the low: hashbrown uses both the top 7 bits and the low bits.
        let m = u128::from(self.0) * u128::from(K);
        (m as u64) ^ ((m >> 64) as u64)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0 ^ i).wrapping_mul(K).rotate_left(26);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
}

pub(crate) type Map<K, V> = hashbrown::HashMap<K, V, FixedState>;

/// Keys whose map slots [`warm_ahead`] reads ahead of updating them.
const LOOKAHEAD: usize = 16;

/// For a loop updating `keys` one by one: at every [`LOOKAHEAD`]-th position `at`, [`warm`]s
/// the keys from `at` on, so the caller needs one line per loop.
#[inline]
pub(crate) fn warm_ahead<V>(
    map: &Map<kvblock::BlockHash, V>,
    keys: &[kvblock::BlockHash],
    at: usize,
) {
    if at % LOOKAHEAD == 0 {
        warm(map, &keys[at..(at + LOOKAHEAD).min(keys.len())]);
    }
}

/// Reads the map slots of `keys` before they are updated one by one: these lookups do not
/// depend on each other, so their cache misses overlap, and the updates then find the lines in
/// cache, where each update's misses would otherwise be paid after the last. For a key that is
/// present both its control bytes and its entry are read, for an absent one only the control
/// bytes. Measured, it pays for the index's removals and the engine cache's reservations, not
/// for the index's stores (mostly new keys into a growing map), which do without it.
#[inline]
fn warm<V>(map: &Map<kvblock::BlockHash, V>, keys: &[kvblock::BlockHash]) {
    let mut found = 0usize;
    for k in keys {
        found += usize::from(map.contains_key(k));
    }
    std::hint::black_box(found);
}
