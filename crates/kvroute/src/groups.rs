//! KV-cache groups beyond the one the router's index mirrors (hybrid models), and the rule that
//! turns every group's residency into the hit an engine's prefix cache will find.
//!
//! A hybrid model (full and sliding-window attention, or attention and state-space layers) keeps
//! one KV-cache group per layer kind. Every group stores the *same* block hashes, but evicts on
//! its own: a sliding-window group frees the blocks that fall out of its window first. The
//! router's [`CacheIndex`](kvcache::CacheIndex) mirrors one group per worker (the *primary*: full
//! attention at the router's block size); every other group is a [`CacheGroup`] kept apart here,
//! so a removal in one group never drops another group's copy.
//!
//! The hit, as vLLM's hybrid coordinator computes it: start from the primary group's leading run
//! (or, for a worker with no primary group, every block of the request), at most the blocks
//! before the prompt's last token when the router hashed the tokens itself
//! ([`Router::route_tokens`](crate::Router::route_tokens): the engine always recomputes that
//! token), then let each group cut it to the longest prefix it can serve, and repeat until no
//! group cuts further:
//!
//! - [`GroupRule::FullAttention`]: every block before the hit point is resident (a leading run);
//! - [`GroupRule::SlidingWindow`]: only the `ceil((window - 1) / block_size)` blocks just before
//!   the hit point are resident (or every block, when the hit point is nearer the start);
//! - [`GroupRule::LastState`] (state-space layers with prefix caching): the block just before the
//!   hit point is resident.
//!
//! A group's block size may be a multiple `k` of the router's: its block `j` is then named by
//! our hash of block `(j + 1) * k - 1` (the chain up to the same token), and its hit points are
//! multiples of `k` router blocks.

use std::collections::BTreeMap;

use kvblock::{BlockHash, BlockSize};
use kvcache::{Applied, CacheIndex, FixedState, KvEvent, Overlaps, WorkerId};

use crate::Error;

type Set = hashbrown::HashSet<BlockHash, FixedState>;

/// How one cache group's residency limits a hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GroupRule {
    /// Every block before the hit point must be resident.
    FullAttention,
    /// Only the blocks inside the window before the hit point must be resident.
    SlidingWindow {
        /// The attention window, in tokens.
        window_tokens: usize,
    },
    /// Only the block just before the hit point must be resident (a state-space layer that
    /// keeps its state at block boundaries).
    LastState,
}

/// One cache group of a worker: its rule and its block size.
///
/// ```
/// use kvblock::BlockSize;
/// use kvroute::{CacheGroup, GroupRule};
/// let sw = CacheGroup::new(GroupRule::SlidingWindow { window_tokens: 128 }, BlockSize::new(16)?);
/// assert_eq!(sw.blocks_needed(), 8); // ceil(127 / 16)
/// # Ok::<(), kvblock::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheGroup {
    /// The rule.
    pub rule: GroupRule,
    /// Tokens per block of this group.
    pub block_size: BlockSize,
}

impl CacheGroup {
    /// A group with `rule` at `block_size`.
    pub fn new(rule: GroupRule, block_size: BlockSize) -> Self {
        CacheGroup { rule, block_size }
    }

    /// How many resident blocks (of this group's size) just before a hit point the rule needs;
    /// `usize::MAX` for full attention (all of them).
    pub fn blocks_needed(&self) -> usize {
        match self.rule {
            GroupRule::FullAttention => usize::MAX,
            // At least one: vLLM's scan for a window of 1 token also ends at the last resident block.
            GroupRule::SlidingWindow { window_tokens } => window_tokens
                .saturating_sub(1)
                .div_ceil(self.block_size.get())
                .max(1),
            GroupRule::LastState => 1,
        }
    }
}

#[derive(Debug, Clone)]
struct Group {
    spec: CacheGroup,
    /// Router blocks per group block.
    factor: usize,
    blocks: Set,
}

impl Group {
    /// The longest hit (in router blocks, a multiple of `factor`) of at most `max` router
    /// blocks that this group can serve for `chain`.
    fn hit(&self, chain: &[BlockHash], max: usize) -> usize {
        let k = self.factor;
        let m = max.min(chain.len()) / k;
        let resident = |j: usize| self.blocks.contains(&chain[(j + 1) * k - 1]);
        let need = self.spec.blocks_needed();
        if need == usize::MAX {
            return (0..m).take_while(|&j| resident(j)).count() * k;
        }
        // From the right, the first stretch of `need` resident blocks ends the hit; with none,
        // the leading run (shorter than `need`) is the hit.
        let mut run = 0;
        for j in (0..m).rev() {
            if resident(j) {
                run += 1;
                if run >= need {
                    return (j + need) * k;
                }
            } else {
                run = 0;
            }
        }
        run * k
    }
}

/// Every worker's groups beyond the primary one.
#[derive(Debug, Clone, Default)]
pub(crate) struct Groups {
    workers: BTreeMap<WorkerId, BTreeMap<u32, Group>>,
    /// By dense worker index: whether the index's group ever stored a block for the worker
    /// (since it was last cleared). Without it, hits start from the whole request.
    primary: Vec<bool>,
}

impl Groups {
    pub(crate) fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    pub(crate) fn apply(
        &mut self,
        worker: WorkerId,
        group: u32,
        spec: CacheGroup,
        router_block_size: BlockSize,
        event: &KvEvent,
    ) -> Result<Applied, Error> {
        let (gs, bs) = (spec.block_size.get(), router_block_size.get());
        if gs % bs != 0 {
            return Err(Error::GroupBlockSize {
                group,
                block_size: gs,
                router: bs,
            });
        }
        let g = self
            .workers
            .entry(worker)
            .or_default()
            .entry(group)
            .or_insert_with(|| Group {
                spec,
                factor: gs / bs,
                blocks: Set::default(),
            });
        // A group's kind or size never changes while the engine runs; if it does (a new model
        // behind the same worker), the old residency means nothing.
        if g.spec != spec {
            *g = Group {
                spec,
                factor: gs / bs,
                blocks: Set::default(),
            };
        }
        let mut out = Applied::default();
        match event {
            KvEvent::Stored { blocks, .. } => {
                for &b in blocks {
                    if g.blocks.insert(b) {
                        out.stored += 1;
                    } else {
                        out.already_present += 1;
                    }
                }
            }
            KvEvent::Removed { blocks } => {
                for b in blocks {
                    if g.blocks.remove(b) {
                        out.removed += 1;
                    } else {
                        out.unknown_removed += 1;
                    }
                }
            }
            KvEvent::Cleared => {
                out.removed = g.blocks.len();
                g.blocks.clear();
            }
        }
        Ok(out)
    }

    /// Notes that the index stored blocks for the worker at dense `index`.
    #[inline]
    pub(crate) fn primary_stored(&mut self, index: usize) {
        if self.primary.len() <= index {
            self.primary.resize(index + 1, false);
        }
        self.primary[index] = true;
    }

    /// Drops every group of `worker` (at dense `index`); returns how many blocks they held.
    pub(crate) fn clear_worker(&mut self, worker: WorkerId, index: Option<usize>) -> usize {
        if let Some(p) = index.and_then(|i| self.primary.get_mut(i)) {
            *p = false;
        }
        self.workers
            .remove(&worker)
            .map_or(0, |w| w.values().map(|g| g.blocks.len()).sum::<usize>())
    }

    pub(crate) fn group_blocks(&self, worker: WorkerId, group: u32) -> Option<usize> {
        Some(self.workers.get(&worker)?.get(&group)?.blocks.len())
    }

    pub(crate) fn groups_of(&self, worker: WorkerId) -> Vec<(u32, CacheGroup)> {
        self.workers.get(&worker).map_or_else(Vec::new, |w| {
            w.iter().map(|(&id, g)| (id, g.spec)).collect()
        })
    }

    /// Replaces each grouped worker's run in `out` with the hit every group can serve.
    /// No hit exceeds `cap` blocks (the engine's own cap: all but the last prompt token).
    pub(crate) fn cut(
        &self,
        index: &CacheIndex,
        chain: &[BlockHash],
        cap: usize,
        out: &mut Overlaps,
    ) {
        for (&worker, w) in &self.workers {
            let Some(i) = index.worker_index(worker) else {
                continue;
            };
            let start = if self.primary.get(i).copied().unwrap_or(false) {
                out.run_at(i)
            } else {
                chain.len()
            };
            let mut hit = start.min(cap);
            loop {
                let before = hit;
                for g in w.values() {
                    hit = g.hit(chain, hit);
                }
                if hit == before {
                    break;
                }
            }
            if hit != out.run_at(i) {
                out.set_run(i, worker, hit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u64) -> Vec<BlockHash> {
        (1..=n).map(BlockHash::new).collect()
    }

    fn group(rule: GroupRule, bs: usize, resident: &[u64]) -> Group {
        let spec = CacheGroup::new(rule, BlockSize::new(bs).unwrap());
        Group {
            spec,
            factor: bs / 4,
            blocks: resident.iter().map(|&h| BlockHash::new(h)).collect(),
        }
    }

    #[test]
    fn sliding_window_needs_only_the_window() {
        // Window of 9 tokens at block size 4: ceil(8 / 4) = 2 blocks before the hit point.
        let g = group(
            GroupRule::SlidingWindow { window_tokens: 9 },
            4,
            &[1, 4, 5, 7],
        );
        let c = chain(8);
        assert_eq!(g.hit(&c, 8), 5); // blocks 3 and 4 (hashes 4, 5) end at 5
        assert_eq!(g.hit(&c, 4), 1); // no two in a row below 4: the leading run, 1
        let full = group(GroupRule::FullAttention, 4, &[1, 2, 3, 5]);
        assert_eq!(full.hit(&c, 8), 3);
        let last = group(GroupRule::LastState, 4, &[2, 6]);
        assert_eq!(last.hit(&c, 8), 6);
        assert_eq!(last.hit(&c, 5), 2);
    }

    #[test]
    fn coarse_groups_are_named_by_the_last_fine_block() {
        // Group blocks of 8 tokens over router blocks of 4: group block j is chain[2j + 1].
        let g = group(GroupRule::LastState, 8, &[4]);
        assert_eq!(g.hit(&chain(8), 8), 4);
        assert_eq!(g.hit(&chain(8), 3), 0);
    }
}
