//! SplitMix64: the one small deterministic generator that benches, examples, the soak test and
//! the fuzz regression replay share. Same numbers on every run and machine, no dependency.
//!
//! ```
//! use kvtest::splitmix::{mix, Rng};
//!
//! let mut rng = Rng(7);
//! let first = rng.next_u64();
//! assert_eq!(first, mix(7));
//! assert_eq!(Rng(7).next_u64(), first, "seeded: the same stream every time");
//! assert!(rng.below(10) < 10);
//! assert!((0.0..1.0).contains(&rng.unit()));
//! assert!(rng.skewed(5) < 5);
//! ```

/// The SplitMix64 finalizer over a golden-ratio step: a bijective 64-bit mixer, so small ids look
/// like real hashes to a hash map.
#[must_use]
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 stream; the field is the state (the seed, to start with).
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let out = mix(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out
    }

    /// A number below `n` (n > 0; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An index below `n` (n > 0), skewed towards 0 (density ~ 1/sqrt(x)): popular prefixes.
    pub fn skewed(&mut self, n: usize) -> usize {
        let u = self.unit();
        ((n as f64 * u * u) as usize).min(n - 1)
    }
}
