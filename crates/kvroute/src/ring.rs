//! The consistent-hash ring of the `PrefixAware` policy.

use kvblock::BlockHash;
use kvcache::WorkerId;
use xxhash_rust::xxh3::xxh3_64_with_seed;

const RING_SEED: u64 = 0x6b76_726f_7574_6521;

/// Virtual nodes of every worker, sorted by position. A key belongs to the first node at or after
/// it (wrapping), so adding a worker takes over about 1/(N+1) of the keys and removing one moves
/// only its own keys.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ring {
    points: Vec<(u64, WorkerId)>,
    vnodes: u32,
}

impl Ring {
    pub(crate) fn new(vnodes: u32) -> Self {
        Ring {
            points: Vec::new(),
            vnodes,
        }
    }

    pub(crate) fn vnodes(&self) -> u32 {
        self.vnodes
    }

    pub(crate) fn add(&mut self, w: WorkerId) {
        let mut fresh: Vec<(u64, WorkerId)> = (0..self.vnodes)
            .map(|v| {
                let mut bytes = [0u8; 12];
                bytes[..8].copy_from_slice(&w.get().to_le_bytes());
                bytes[8..].copy_from_slice(&v.to_le_bytes());
                (xxh3_64_with_seed(&bytes, RING_SEED), w)
            })
            .collect();
        fresh.sort_unstable();
        // Two sorted runs: the stable sort finds them and merges them in one pass, where
        // re-sorting the whole ring on every add made registering N workers O(N^2 log N).
        // (Equal points are equal tuples, so stability changes nothing.)
        self.points.extend(fresh);
        self.points.sort();
    }

    pub(crate) fn remove(&mut self, w: WorkerId) {
        self.points.retain(|p| p.1 != w);
    }

    /// The key of a request: its first `k` blocks, named by the chained hash of the k-th (which
    /// already identifies its whole prefix), mixed so that small sequential ids spread.
    pub(crate) fn key(chain: &[BlockHash], k: usize) -> Option<u64> {
        let last = chain.get(k.min(chain.len()).checked_sub(1)?)?;
        Some(xxh3_64_with_seed(&last.get().to_le_bytes(), RING_SEED))
    }

    pub(crate) fn owner(&self, key: u64) -> Option<WorkerId> {
        let i = self.points.partition_point(|p| p.0 < key);
        self.points.get(i).or(self.points.first()).map(|p| p.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn owners(r: &Ring, keys: &[u64]) -> Vec<WorkerId> {
        keys.iter()
            .map(|&k| r.owner(k).expect("non-empty"))
            .collect()
    }

    proptest! {
        #[test]
        fn removing_moves_only_that_workers_keys(n in 2u64..12, gone in 0u64..12, seed in any::<u64>()) {
            let gone = WorkerId::new(gone % n);
            let keys: Vec<u64> = (0..2000u64).map(|i| xxh3_64_with_seed(&i.to_le_bytes(), seed)).collect();
            let mut r = Ring::new(64);
            (0..n).for_each(|w| r.add(WorkerId::new(w)));
            let before = owners(&r, &keys);
            r.remove(gone);
            let after = owners(&r, &keys);
            for (b, a) in before.iter().zip(&after) {
                if *b != gone {
                    prop_assert_eq!(a, b);
                } else {
                    prop_assert_ne!(*a, gone);
                }
            }
        }

        /// Adding merges each worker's points into the sorted ring: any order of adds (and
        /// removes) gives the ring sorted from scratch.
        #[test]
        fn adds_in_any_order_keep_the_ring_sorted(ids in prop::collection::vec(0u64..40, 1..30), vnodes in 1u32..20) {
            let mut r = Ring::new(vnodes);
            let mut all = Vec::new();
            for (k, &w) in ids.iter().enumerate() {
                let w = WorkerId::new(w);
                if k % 7 == 6 {
                    r.remove(w);
                    all.retain(|p: &(u64, WorkerId)| p.1 != w);
                    continue;
                }
                r.add(w);
                let mut one = Ring::new(vnodes);
                one.add(w);
                all.extend(one.points);
                all.sort_unstable();
                prop_assert_eq!(&r.points, &all);
            }
        }

        #[test]
        fn adding_moves_about_one_in_n_plus_one(n in 2u64..16, seed in any::<u64>()) {
            let keys: Vec<u64> = (0..4000u64).map(|i| xxh3_64_with_seed(&i.to_le_bytes(), seed)).collect();
            let mut r = Ring::new(128);
            (0..n).for_each(|w| r.add(WorkerId::new(w)));
            let before = owners(&r, &keys);
            r.add(WorkerId::new(n));
            let after = owners(&r, &keys);
            let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
            // Every moved key moved to the new worker, and about 1/(N+1) of them moved.
            prop_assert!(before.iter().zip(&after).all(|(b, a)| b == a || *a == WorkerId::new(n)));
            let share = moved as f64 / keys.len() as f64;
            let expect = 1.0 / (n + 1) as f64;
            prop_assert!((share - expect).abs() < 0.5 * expect + 0.02, "moved {share:.3}, expected ~{expect:.3}");
        }
    }
}
