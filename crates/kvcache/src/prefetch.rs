//! A prefetch hint: the one module of the workspace that may use `unsafe` (see DESIGN.md,
//! "Unsafe"). It asks the CPU to start loading a cache line without waiting for it, so that
//! several independent misses overlap; a safe load does the same job less well (it occupies a
//! register and a load slot until the line arrives) and is what runs elsewhere: on other
//! targets and under Miri.
#![allow(unsafe_code)]

/// Whether [`prefetch`] issues a real hint on this target (x86_64, outside Miri). Where it
/// does not, callers bring a line in with a safe load of one of its words instead.
pub(crate) const HINTS: bool = cfg!(all(target_arch = "x86_64", not(miri)));

/// Starts loading the cache line holding `*r` into the CPU's caches and returns at once (a
/// no-op where [`HINTS`] is false). For a line needed within a few accesses.
#[inline(always)]
pub(crate) fn prefetch<T>(r: &T) {
    hint::<false, T>(r);
}

/// [`prefetch`] into the second-level cache and below, not the first: for a line needed many
/// accesses later. A first-level hint holds one of that level's few miss buffers until its
/// line arrives, so a long read-ahead of them stalls on the buffers (on the block-16
/// simulation, whose updates read 32 keys ahead, this one ran about a tenth faster).
#[inline(always)]
pub(crate) fn prefetch_far<T>(r: &T) {
    hint::<true, T>(r);
}

#[inline(always)]
fn hint<const FAR: bool, T>(r: &T) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let p = std::ptr::from_ref(r).cast::<i8>();
        // SAFETY: `_mm_prefetch` is a hint: it never faults and changes nothing the program
        // can observe, whatever the address (here that of a live reference). SSE, which it
        // requires, is part of the x86_64 baseline.
        unsafe {
            if FAR {
                _mm_prefetch::<_MM_HINT_T1>(p);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(p);
            }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = r;
}
