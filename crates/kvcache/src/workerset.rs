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
///   worker indices as sorted `(word, bits)` pairs, one word per 64 workers; a list of one
///   word sits in the [`Spill`]'s own array ([`List::One`]).
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

/// The holders of one spilled [`WorkerSet`], as sorted `(word, bits)` pairs. A set within one
/// word (up to 64 neighbouring workers: the common spill of a fleet of up to 64 that shares a
/// prefix) is kept in its slot, so that reading it costs one access instead of a heap pointer's
/// two; a wider one on the heap.
#[derive(Debug, Clone)]
pub(crate) enum List {
    One((u32, u64)),
    Many(Vec<(u32, u64)>),
}

impl List {
    /// The pairs, sorted by word.
    #[inline]
    pub(crate) fn words(&self) -> &[(u32, u64)] {
        match self {
            List::One(pair) => std::slice::from_ref(pair),
            List::Many(v) => v,
        }
    }

    /// The bits of `word`, if it is listed.
    #[inline]
    fn bits_mut(&mut self, word: u32) -> Option<&mut u64> {
        match self {
            List::One((w, bits)) => (*w == word).then_some(bits),
            List::Many(v) => match v.binary_search_by_key(&word, |p| p.0) {
                Ok(j) => Some(&mut v[j].1),
                Err(_) => None,
            },
        }
    }

    /// Sets `bit` in `word`; true if it was clear.
    fn set(&mut self, word: u32, bit: u64) -> bool {
        if let Some(bits) = self.bits_mut(word) {
            return set_bit(bits, bit);
        }
        match self {
            List::One(pair) => {
                let (old, new) = (*pair, (word, bit));
                *self = List::Many(if old.0 < word {
                    vec![old, new]
                } else {
                    vec![new, old]
                });
                true
            }
            List::Many(v) => {
                // Not listed (see above): inserted in its place.
                let j = v.partition_point(|p| p.0 < word);
                v.insert(j, (word, bit));
                true
            }
        }
    }

    /// Clears `bit` in `word` (a word left empty goes); true if it was set. A list left with
    /// one word keeps it in its slot.
    fn clear(&mut self, word: u32, bit: u64) -> bool {
        match self {
            List::One((w, b)) => {
                let present = *w == word && *b & bit != 0;
                if *w == word {
                    *b &= !bit;
                }
                present
            }
            List::Many(v) => {
                let Ok(j) = v.binary_search_by_key(&word, |p| p.0) else {
                    return false;
                };
                let present = v[j].1 & bit != 0;
                v[j].1 &= !bit;
                if v[j].1 == 0 {
                    v.remove(j);
                }
                if let [pair] = v[..] {
                    *self = List::One(pair);
                }
                present
            }
        }
    }
}

/// The holder lists of spilled [`WorkerSet`]s, with their free slots.
#[derive(Debug, Clone, Default)]
pub(crate) struct Spill {
    pub(crate) lists: Vec<List>,
    pub(crate) free: Vec<u32>,
}

impl Spill {
    pub(crate) fn alloc(&mut self, list: List) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.lists[i as usize] = list;
                i
            }
            None => {
                self.lists.push(list);
                (self.lists.len() - 1) as u32
            }
        }
    }

    pub(crate) fn release(&mut self, i: u32) {
        self.lists[i as usize] = List::One((0, 0));
        self.free.push(i);
    }
}

/// Sets `bit` in `bits`; true if it was clear.
#[inline]
fn set_bit(bits: &mut u64, bit: u64) -> bool {
    let absent = *bits & bit == 0;
    *bits |= bit;
    absent
}

/// Whether the holders of one word fall in one of its halves (an aligned group of 32), so that
/// their set is inline rather than spilled.
#[inline]
pub(crate) fn fits_inline(bits: u64) -> bool {
    bits >> 32 == 0 || bits as u32 == 0
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
            Err(i) => spill.lists[i as usize].words(),
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
                let v = spill.lists[i as usize].words();
                let (word, bit) = (idx / 64, 1u64 << (idx % 64));
                v.binary_search_by_key(&word, |p| p.0)
                    .is_ok_and(|j| v[j].1 & bit != 0)
            }
        }
    }

    /// Adds `idx`; true if it was absent. The run hint stays.
    #[inline]
    pub(crate) fn insert(&mut self, idx: u32, spill: &mut Spill) -> bool {
        // The common cases inline (a worker joining its group's inline set, or a spilled
        // set's word that is already listed), where neither the form nor the hint changes.
        let bits = match self.form() {
            Ok((group, _)) if group == idx / 32 => return set_bit(&mut self.0, 1 << (idx % 32)),
            Err(i) => spill
                .lists
                .get_mut(i as usize)
                .and_then(|list| list.bits_mut(idx / 64)),
            Ok(_) => None,
        };
        match bits {
            Some(bits) => set_bit(bits, 1 << (idx % 64)),
            None => self.insert_rare(idx, spill),
        }
    }

    /// [`insert`](Self::insert) where the set may change form (out of line: rare).
    #[inline(never)]
    fn insert_rare(&mut self, idx: u32, spill: &mut Spill) -> bool {
        let hint = self.run_hint();
        let absent = self.insert_member(idx, spill);
        *self = self.with_run_hint(hint);
        absent
    }

    /// Removes `idx`; true if it was present. The run hint stays.
    #[inline]
    pub(crate) fn remove(&mut self, idx: u32, spill: &mut Spill) -> bool {
        // An inline set is updated here: clearing a member changes neither its form nor its
        // hint.
        if let Ok((group, members)) = self.form() {
            let bit = 1 << (idx % 32);
            let present = group == idx / 32 && members & bit != 0;
            if present {
                self.0 &= !u64::from(bit);
            }
            return present;
        }
        self.remove_rare(idx, spill)
    }

    /// [`remove`](Self::remove) of a spilled set, which may go back inline (out of line).
    #[inline(never)]
    fn remove_rare(&mut self, idx: u32, spill: &mut Spill) -> bool {
        let hint = self.run_hint();
        let present = self.remove_member(idx, spill);
        *self = self.with_run_hint(hint);
        present
    }

    fn insert_member(&mut self, idx: u32, spill: &mut Spill) -> bool {
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
                let list = match old.0.cmp(&word) {
                    std::cmp::Ordering::Equal => List::One((word, old.1 | bit)),
                    std::cmp::Ordering::Less => List::Many(vec![old, (word, bit)]),
                    std::cmp::Ordering::Greater => List::Many(vec![(word, bit), old]),
                };
                *self = WorkerSet(SPILLED | u64::from(spill.alloc(list)));
                true
            }
            Err(i) => spill.lists[i as usize].set(word, bit),
        }
    }

    /// A spilled set that fits inline again goes back.
    fn remove_member(&mut self, idx: u32, spill: &mut Spill) -> bool {
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
                let list = &mut spill.lists[i as usize];
                let present = list.clear(word, bit);
                match *list.words() {
                    [] | [(_, 0)] => {
                        spill.release(i);
                        *self = WorkerSet::EMPTY;
                    }
                    [(w, b)] if fits_inline(b) => {
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
