//! A cache's second tier: blocks the device evicted, demoted to host memory (vLLM's CPU
//! offloading), with their own LRU and capacity.

use std::collections::BTreeMap;

use kvblock::BlockHash;

use crate::{FixedState, KvEvent};

type Map<K, V> = hashbrown::HashMap<K, V, FixedState>;

/// Where a cached block lives: an engine's device memory, or a tier it offloads to. A hit on a
/// lower tier saves the recompute but costs a transfer back (see `kvroute`'s tier credits).
///
/// ```
/// use kvcache::Tier;
/// assert_eq!(Tier::from_medium(Some("CPU")), Tier::Host);
/// assert_eq!(Tier::from_medium(None), Tier::Device);
/// assert_eq!(Tier::from_medium(Some("STORAGE")), Tier::Disk);
/// assert_eq!(Tier::from_medium(Some("gpu")), Tier::Device);
/// assert_eq!(Tier::Disk.to_string(), "disk");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[non_exhaustive]
pub enum Tier {
    /// GPU memory: a hit is free.
    #[default]
    Device,
    /// Host (CPU) memory.
    Host,
    /// Local disk.
    Disk,
}

impl Tier {
    /// The tier of an engine's `medium` field: `GPU` (or none) is the device, `CPU` the host,
    /// `STORAGE` (vLLM) or `DISK` the disk; any other medium counts as the host (case ignored).
    pub fn from_medium(medium: Option<&str>) -> Tier {
        // Called for every ingested event: compared in place, without an uppercase copy.
        let is = |m: &str, names: &[&str]| names.iter().any(|n| m.eq_ignore_ascii_case(n));
        match medium {
            None => Tier::Device,
            Some(m) if is(m, &["GPU", "CUDA"]) => Tier::Device,
            Some(m) if is(m, &["STORAGE", "DISK"]) => Tier::Disk,
            Some(_) => Tier::Host,
        }
    }

    /// The tier's name: `device`, `host` or `disk`.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Demoted blocks in LRU order, at most `capacity`; the events a mirror of this tier needs.
#[derive(Debug, Clone, Default)]
pub(crate) struct HostTier {
    capacity: usize,
    clock: u64,
    /// Each block's last use.
    used: Map<BlockHash, u64>,
    /// Blocks by last use, oldest first.
    order: BTreeMap<u64, BlockHash>,
    pub(crate) events: Vec<KvEvent>,
}

impl HostTier {
    pub(crate) fn new(capacity: usize) -> Self {
        HostTier {
            capacity,
            ..HostTier::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.used.len()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn contains(&self, block: BlockHash) -> bool {
        self.used.contains_key(&block)
    }

    /// Makes `block` the most recent; returns whether it was new.
    fn use_block(&mut self, block: BlockHash) -> bool {
        self.clock += 1;
        let old = self.used.insert(block, self.clock);
        if let Some(t) = old {
            self.order.remove(&t);
        }
        self.order.insert(self.clock, block);
        old.is_none()
    }

    /// Takes blocks the device evicted (tail first, as it evicts), then drops the least
    /// recently used beyond capacity; queues a `Stored` of the new ones and a `Removed` of the
    /// dropped ones.
    pub(crate) fn demote(&mut self, blocks: &[BlockHash]) {
        if self.capacity == 0 {
            return;
        }
        let mut stored = Vec::new();
        for &b in blocks {
            if self.use_block(b) {
                stored.push(b);
            }
        }
        if !stored.is_empty() {
            self.events.push(KvEvent::Stored {
                parent: None,
                blocks: stored,
            });
        }
        let mut dropped = Vec::new();
        while self.used.len() > self.capacity {
            let Some((_, b)) = self.order.pop_first() else {
                break;
            };
            self.used.remove(&b);
            dropped.push(b);
        }
        if !dropped.is_empty() {
            self.events.push(KvEvent::Removed { blocks: dropped });
        }
    }

    /// How many of `chain[from..]` this tier holds as a leading run, each made the most recent.
    pub(crate) fn take_run(&mut self, chain: &[BlockHash], from: usize) -> usize {
        let run = self.run(chain, from);
        for &b in chain.iter().skip(from).take(run) {
            self.use_block(b);
        }
        run
    }

    /// How many of `chain[from..]` this tier holds as a leading run.
    pub(crate) fn run(&self, chain: &[BlockHash], from: usize) -> usize {
        chain
            .get(from..)
            .unwrap_or_default()
            .iter()
            .take_while(|&b| self.used.contains_key(b))
            .count()
    }

    /// Blocks from least to most recently used.
    #[cfg(test)]
    fn order(&self) -> Vec<BlockHash> {
        self.order.values().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 3 } else { 256 }))]
        /// Against a naive LRU (a list, most recent last): same blocks in the same order, and
        /// the events replayed on a set give the tier's blocks.
        #[test]
        fn host_tier_is_an_lru(cap in 0usize..6, ops in prop::collection::vec(
            (any::<bool>(), prop::collection::vec(0u64..12, 0..5), 0usize..3), 0..60)) {
            let mut tier = HostTier::new(cap);
            let mut naive: Vec<BlockHash> = Vec::new();
            let mut mirror = std::collections::BTreeSet::new();
            for (demote, blocks, from) in ops {
                let chain: Vec<BlockHash> = blocks.into_iter().map(BlockHash::new).collect();
                if demote {
                    tier.demote(&chain);
                    if cap > 0 {
                        for b in &chain {
                            naive.retain(|x| x != b);
                            naive.push(*b);
                        }
                        while naive.len() > cap {
                            naive.remove(0);
                        }
                    }
                } else {
                    let from = from.min(chain.len());
                    let want = chain[from..].iter().take_while(|b| naive.contains(b)).count();
                    prop_assert_eq!(tier.take_run(&chain, from), want);
                    for b in &chain[from..from + want] {
                        naive.retain(|x| x != b);
                        naive.push(*b);
                    }
                }
                for ev in tier.events.drain(..) {
                    match ev {
                        KvEvent::Stored { blocks, .. } => mirror.extend(blocks),
                        KvEvent::Removed { blocks } => {
                            for b in blocks {
                                prop_assert!(mirror.remove(&b), "removed {:?} never stored", b);
                            }
                        }
                        KvEvent::Cleared => mirror.clear(),
                    }
                }
                prop_assert_eq!(tier.order(), naive.clone());
                prop_assert_eq!(mirror.iter().copied().collect::<std::collections::BTreeSet<_>>(),
                    naive.iter().copied().collect());
                prop_assert!(tier.len() <= cap);
            }
        }
    }
}
