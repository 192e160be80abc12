//! How much memory a router's `CacheIndex` needs per resident (block, worker) pair.
//!
//! `cargo run --release --example index_memory` builds an index of 1,024 workers holding
//! 10,000,000 (block, worker) pairs between them: each worker holds 8 popular 64-block chains
//! (system prompts, each held by 128 workers) and ~9,254 blocks of its own in chains of 64. It
//! prints the pairs, the distinct blocks, the peak resident set size and the bytes per pair.
//! Resident set sizes come from `/proc/self/status` (Linux); elsewhere they print "unavailable".

use std::time::Instant;

use kvkit::kvblock::BlockHash;
use kvkit::kvcache::{CacheIndex, KvEvent, WorkerId};
use kvtest::splitmix;

const WORKERS: u64 = 1_024;
const TARGET_PAIRS: u64 = 10_000_000;
const CHAIN: u64 = 64;
/// Popular chains in the fleet, and how many of them each worker holds.
const SHARED_POOL: u64 = 64;
const SHARED_EACH: u64 = 8;

/// Block `i` of chain `chain`; `shared` chains and private ones never collide.
fn block(shared: bool, chain: u64, i: u64) -> BlockHash {
    BlockHash::new(splitmix::mix((u64::from(shared) << 63) | (chain << 8) | i))
}

/// Applies one root `Stored` event of `blocks` for worker `w`, as event `*id`.
fn store(index: &mut CacheIndex, w: u64, id: &mut u64, blocks: impl Iterator<Item = BlockHash>) {
    let ev = KvEvent::Stored {
        parent: None,
        blocks: blocks.collect(),
    };
    index
        .apply(WorkerId::new(w), *id, &ev)
        .expect("a root Stored event applies");
    *id += 1;
}

/// A `VmRSS` / `VmHWM` line of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line
        .trim_start_matches(field)
        .trim_start_matches(':')
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or_else(
        || "unavailable".to_string(),
        |b| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0)),
    )
}

fn main() {
    let rss_before = status_bytes("VmRSS");
    let start = Instant::now();

    let mut index = CacheIndex::new();
    // Split TARGET_PAIRS as evenly as possible: the first `extra` workers hold one more block.
    let (base, extra) = (TARGET_PAIRS / WORKERS, TARGET_PAIRS % WORKERS);
    let mut private_chain = 0u64;
    for w in 0..WORKERS {
        let mut id = 0;
        let mut held = 0;
        for k in 0..SHARED_EACH {
            // Spread so each popular chain is held by WORKERS * SHARED_EACH / SHARED_POOL workers.
            let c = (w + k * (SHARED_POOL / SHARED_EACH)) % SHARED_POOL;
            store(
                &mut index,
                w,
                &mut id,
                (0..CHAIN).map(|i| block(true, c, i)),
            );
            held += CHAIN;
        }
        let quota = base + u64::from(w < extra);
        while held < quota {
            let len = CHAIN.min(quota - held);
            store(
                &mut index,
                w,
                &mut id,
                (0..len).map(|i| block(false, private_chain, i)),
            );
            private_chain += 1;
            held += len;
        }
    }
    let built = start.elapsed();

    let rss_after = status_bytes("VmRSS");
    let peak = status_bytes("VmHWM");
    let pairs = index.pairs();
    assert_eq!(pairs as u64, TARGET_PAIRS);
    println!("workers:          {}", index.worker_count());
    println!("pairs:            {pairs}");
    println!("distinct blocks:  {}", index.distinct_blocks());
    println!("built in:         {:.2} s", built.as_secs_f64());
    println!("RSS before:       {}", mib(rss_before));
    println!("RSS after:        {}", mib(rss_after));
    println!("peak RSS (VmHWM): {}", mib(peak));
    match (rss_before, rss_after, peak) {
        (Some(b), Some(a), Some(p)) => {
            println!(
                "bytes per pair:   {:.1} (RSS delta), {:.1} (peak - start)",
                a.saturating_sub(b) as f64 / pairs as f64,
                p.saturating_sub(b) as f64 / pairs as f64
            );
            println!(
                "bytes per distinct block: {:.1} (RSS delta)",
                a.saturating_sub(b) as f64 / index.distinct_blocks() as f64
            );
        }
        _ => println!("bytes per pair:   unavailable"),
    }
    // Keep the index alive until the figures are read.
    drop(index);
}
