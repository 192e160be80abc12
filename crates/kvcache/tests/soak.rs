//! Soak: 10M events from 256 bounded engine caches through one `CacheIndex`. Resident pairs and
//! memory must stay flat after warm-up. Ignored by default (about a minute in release):
//!
//! `cargo test --release -p kvcache --test soak -- --ignored --nocapture`

use kvblock::BlockHash;
use kvcache::{BlockCache, CacheIndex, WorkerId};
use kvtest::splitmix;

const WORKERS: usize = 256;
const CAPACITY: usize = 2_000;
const EVENTS: u64 = 10_000_000;

/// Resident set size in KiB (Linux); `None` elsewhere.
fn rss_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[test]
#[ignore = "soak: run explicitly in release"]
fn ten_million_events_stay_flat() {
    let mut rng = splitmix::Rng(7);
    let mut caches: Vec<BlockCache> = (0..WORKERS)
        .map(|_| BlockCache::new(Some(CAPACITY)))
        .collect();
    let mut ids = vec![0u64; WORKERS];
    let mut index = CacheIndex::new();
    let mut events = 0u64;
    let mut samples: Vec<(u64, usize, Option<u64>)> = Vec::new();
    let mut chain = Vec::with_capacity(64);
    while events < EVENTS {
        let w = (rng.next_u64() % WORKERS as u64) as usize;
        // A prompt: one of 64 shared system prompts (16 blocks), then a few history blocks drawn
        // from a small per-prefix space (reused now and then), then a unique tail.
        let prefix = rng.next_u64() % 64;
        chain.clear();
        chain.extend((0..16).map(|i| BlockHash::new((prefix << 40) | i)));
        let history = rng.next_u64() % 512;
        chain.extend(
            (0..4).map(|i| BlockHash::new((1 << 62) | (prefix << 40) | (history << 8) | i)),
        );
        let unique = rng.next_u64() | (1 << 63);
        chain.extend(
            (0..(rng.next_u64() % 12)).map(|i| BlockHash::new(unique.wrapping_add(i) | (1 << 63))),
        );
        caches[w].insert(&chain).expect("nothing is pinned");
        for ev in caches[w].drain_events() {
            index
                .apply(WorkerId::new(w as u64), ids[w], &ev)
                .expect("in order");
            ids[w] += 1;
            events += 1;
            if events % 1_000_000 == 0 {
                samples.push((events, index.pairs(), rss_kib("VmRSS:")));
            }
        }
    }
    let truth: usize = caches.iter().map(BlockCache::len).sum();
    assert_eq!(
        index.pairs(),
        truth,
        "the index holds exactly what the engines hold"
    );
    for (w, c) in caches.iter().enumerate() {
        assert_eq!(index.block_count(WorkerId::new(w as u64)), c.len());
    }
    println!("events     pairs      rss (MiB)");
    for (e, p, r) in &samples {
        println!(
            "{e:>9}  {p:>9}  {}",
            r.map_or("n/a".into(), |k| format!("{:.1}", k as f64 / 1024.0))
        );
    }
    let peak = rss_kib("VmHWM:");
    if let Some(peak) = peak {
        println!(
            "peak RSS {:.1} MiB; {:.1} bytes per resident (block, worker) pair incl. the 256 engine caches",
            peak as f64 / 1024.0,
            peak as f64 * 1024.0 / truth as f64
        );
    }
    // Flat after warm-up: from the 3rd million on, pairs stay at capacity (a sample may fall
    // between an insert's Removed and Stored events: at most one chain below) and memory within 10%.
    let warm: Vec<_> = samples.iter().skip(2).collect();
    let full = WORKERS * CAPACITY;
    assert!(
        warm.iter().all(|s| (full - 32..=full).contains(&s.1)),
        "pairs must sit at capacity: {warm:?}"
    );
    if let (Some((_, _, Some(first))), Some((_, _, Some(last)))) = (warm.first(), warm.last()) {
        assert!(
            *last as f64 <= *first as f64 * 1.10,
            "memory grew from {first} KiB to {last} KiB"
        );
    }
}
