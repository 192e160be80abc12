//! The set of workers holding one block, packed in 8 bytes ([`WorkerSet`]) with a shared
//! overflow list for sets too sparse to inline ([`Spill`]): what every entry of the router's
//! [`CacheIndex`](crate::CacheIndex) stores.

use crate::blockmap::Vacant;

/// The workers holding one block, in 8 bytes so that a block map entry is 16 (four to a cache
/// line): the map is what ingestion and lookups miss the CPU cache on.
///
/// - Inline (bit 63 clear): the holders fall in one aligned group of 32 dense indices; bits
///   32..51 are the group, bits 0..32 its members. A block held by one worker, or by a few
///   neighbouring ones, stays inline and costs nothing more.
/// - Spilled (bit 63 set): the low 32 bits index a [`Spill`] list, a sparse bitset over dense
///   worker indices as sorted `(word, bits)` pairs, one word per 64 workers.
/// - Either way bits 51..63 are the block's [`run_hint`](Self::run_hint), which changes no
///   answer, only where a query probes.
///
/// Either way [`words`](Self::words) presents the set as `(word, bits)` pairs, so an intersection
/// costs one AND per non-empty word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkerSet(u64);

impl Vacant for WorkerSet {
    /// No stored set is empty: a block whose last holder leaves is removed.
    const VACANT: WorkerSet = WorkerSet::EMPTY;
}

pub(crate) const SPILLED: u64 = 1 << 63;
/// Where [`WorkerSet::run_hint`] sits, and its largest value.
pub(crate) const HINT_SHIFT: u32 = 51;
pub(crate) const MAX_HINT: usize = (1 << 12) - 1;
pub(crate) const HINT_MASK: u64 = (MAX_HINT as u64) << HINT_SHIFT;
/// Groups of 32 workers an inline set can name (bits 32..51): dense indices stay below 2^24.
pub(crate) const GROUP_MASK: u64 = (1 << (HINT_SHIFT - 32)) - 1;
/// Dense worker indices the sets can hold.
pub(crate) const MAX_WORKERS: u32 = 1 << (HINT_SHIFT - 32 + 5);

/// The holder lists of spilled [`WorkerSet`]s, with their free slots (kept allocated for reuse).
#[derive(Debug, Clone, Default)]
pub(crate) struct Spill {
    pub(crate) lists: Vec<Vec<(u32, u64)>>,
    pub(crate) free: Vec<u32>,
}

impl Spill {
    pub(crate) fn alloc(&mut self) -> u32 {
        match self.free.pop() {
            Some(i) => i,
            None => {
                self.lists.push(Vec::new());
                (self.lists.len() - 1) as u32
            }
        }
    }

    pub(crate) fn release(&mut self, i: u32) {
        self.lists[i as usize].clear();
        self.free.push(i);
    }
}

impl WorkerSet {
    pub(crate) const EMPTY: WorkerSet = WorkerSet(0);

    pub(crate) fn single(idx: u32) -> Self {
        WorkerSet((u64::from(idx / 32) << 32) | (1 << (idx % 32)))
    }

    pub(crate) fn inline(group: u32, members: u32) -> Self {
        WorkerSet((u64::from(group) << 32) | u64::from(members))
    }

    /// `Err(list)` when spilled, else `Ok((group, members))`.
    #[inline]
    pub(crate) fn form(self) -> Result<(u32, u32), u32> {
        if self.0 & SPILLED != 0 {
            Err(self.0 as u32)
        } else {
            Ok((((self.0 >> 32) & GROUP_MASK) as u32, self.0 as u32))
        }
    }

    /// How many blocks after this one the `Stored` event that first stored it went on (at
    /// most [`MAX_HINT`]): where a run through this block is likely to end, since prompts tend
    /// to share whole stored runs. Only a guess of where to probe; it is never trusted.
    #[inline]
    pub(crate) fn run_hint(self) -> usize {
        ((self.0 & HINT_MASK) >> HINT_SHIFT) as usize
    }

    pub(crate) fn with_run_hint(self, hint: usize) -> Self {
        WorkerSet((self.0 & !HINT_MASK) | ((hint.min(MAX_HINT) as u64) << HINT_SHIFT))
    }

    /// The set as sorted `(word, bits)` pairs; `buf` holds the one pair of an inline set.
    #[inline]
    pub(crate) fn words<'a>(
        self,
        spill: &'a Spill,
        buf: &'a mut [(u32, u64); 1],
    ) -> &'a [(u32, u64)] {
        match self.form() {
            Err(i) => &spill.lists[i as usize],
            Ok((group, members)) => {
                buf[0] = (group / 2, u64::from(members) << (32 * (group % 2)));
                &buf[..]
            }
        }
    }

    pub(crate) fn contains(self, idx: u32, spill: &Spill) -> bool {
        match self.form() {
            Ok((group, members)) => group == idx / 32 && members & (1 << (idx % 32)) != 0,
            Err(i) => {
                let v = &spill.lists[i as usize];
                let (word, bit) = (idx / 64, 1u64 << (idx % 64));
                v.binary_search_by_key(&word, |p| p.0)
                    .is_ok_and(|j| v[j].1 & bit != 0)
            }
        }
    }

    /// Adds `idx`; true if it was absent. The run hint stays.
    pub(crate) fn insert(&mut self, idx: u32, spill: &mut Spill) -> bool {
        let hint = self.run_hint();
        let absent = self.insert_member(idx, spill);
        *self = self.with_run_hint(hint);
        absent
    }

    /// Removes `idx`; true if it was present. The run hint stays.
    pub(crate) fn remove(&mut self, idx: u32, spill: &mut Spill) -> bool {
        let hint = self.run_hint();
        let present = self.remove_member(idx, spill);
        *self = self.with_run_hint(hint);
        present
    }

    pub(crate) fn insert_member(&mut self, idx: u32, spill: &mut Spill) -> bool {
        let (word, bit) = (idx / 64, 1u64 << (idx % 64));
        match self.form() {
            Ok((group, members)) if group == idx / 32 || members == 0 => {
                let b = 1 << (idx % 32);
                let same = if group == idx / 32 { members } else { 0 };
                *self = WorkerSet::inline(idx / 32, same | b);
                same & b == 0
            }
            Ok((group, members)) => {
                let old = (group / 2, u64::from(members) << (32 * (group % 2)));
                let i = spill.alloc();
                let v = &mut spill.lists[i as usize];
                if old.0 == word {
                    v.push((word, old.1 | bit));
                } else if old.0 < word {
                    v.extend([old, (word, bit)]);
                } else {
                    v.extend([(word, bit), old]);
                }
                *self = WorkerSet(SPILLED | u64::from(i));
                true
            }
            Err(i) => {
                let v = &mut spill.lists[i as usize];
                match v.binary_search_by_key(&word, |p| p.0) {
                    Ok(j) => {
                        let absent = v[j].1 & bit == 0;
                        v[j].1 |= bit;
                        absent
                    }
                    Err(j) => {
                        v.insert(j, (word, bit));
                        true
                    }
                }
            }
        }
    }

    /// A spilled set that fits inline again goes back.
    pub(crate) fn remove_member(&mut self, idx: u32, spill: &mut Spill) -> bool {
        match self.form() {
            Ok((group, members)) => {
                let b = 1 << (idx % 32);
                let present = group == idx / 32 && members & b != 0;
                if present {
                    *self = WorkerSet::inline(group, members & !b);
                }
                present
            }
            Err(i) => {
                let (word, bit) = (idx / 64, 1u64 << (idx % 64));
                let v = &mut spill.lists[i as usize];
                let Ok(j) = v.binary_search_by_key(&word, |p| p.0) else {
                    return false;
                };
                let present = v[j].1 & bit != 0;
                v[j].1 &= !bit;
                if v[j].1 == 0 {
                    v.remove(j);
                }
                match v[..] {
                    [] => {
                        spill.release(i);
                        *self = WorkerSet::EMPTY;
                    }
                    [(w, b)] if b >> 32 == 0 || b as u32 == 0 => {
                        let (group, members) = if b >> 32 == 0 {
                            (w * 2, b as u32)
                        } else {
                            (w * 2 + 1, (b >> 32) as u32)
                        };
                        spill.release(i);
                        *self = WorkerSet::inline(group, members);
                    }
                    _ => {}
                }
                present
            }
        }
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 & SPILLED == 0 && self.0 as u32 == 0
    }
}
