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
