//! The hot paths of kvcache: an engine's `match_len` and `insert` (with eviction), a router's
//! `overlaps` query over many workers, and the rate at which a router ingests KV events.
//!
//! Block hashes are mixed integers (`kvtest::splitmix`), deterministic from run to run. Every
//! bench reports its throughput in blocks.

// `criterion_group!` defines an undocumented `pub fn`; the workspace denies `missing_docs`.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvkit::kvblock::BlockHash;
use kvkit::kvcache::{BlockCache, CacheIndex, KvEvent, Overlaps, WorkerId};
use kvtest::splitmix;

/// Block `i` of chain `chain` in namespace `tag`: distinct for distinct triples (`chain` < 2^32,
/// `i` < 2^24, `tag` < 2^8).
fn block(tag: u64, chain: u64, i: u64) -> BlockHash {
    BlockHash::new(splitmix::mix((tag << 56) | (chain << 24) | i))
}

/// A chain of `len` blocks, distinct from every other `(tag, id)`.
fn chain(tag: u64, id: u64, len: usize) -> Vec<BlockHash> {
    (0..len as u64).map(|i| block(tag, id, i)).collect()
}

// ---------------------------------------------------------------------------------------------
// 1. BlockCache::match_len

const MATCH_RESIDENT: usize = 1 << 20;
const PROMPT_BLOCKS: usize = 64;

fn match_len(c: &mut Criterion) {
    let chains = MATCH_RESIDENT / PROMPT_BLOCKS;
    let prompts: Vec<Vec<BlockHash>> = (0..chains as u64)
        .map(|id| chain(1, id, PROMPT_BLOCKS))
        .collect();
    let mut cache = BlockCache::new(Some(MATCH_RESIDENT));
    for p in &prompts {
        cache.insert(p).expect("fits");
    }
    cache.drain_events().for_each(drop);
    assert_eq!(cache.len(), MATCH_RESIDENT);

    let mut group = c.benchmark_group("BlockCache::match_len");
    group.throughput(Throughput::Elements(PROMPT_BLOCKS as u64));
    // The same prompt every time: its 64 map slots stay in the CPU cache.
    let hot = &prompts[chains / 2];
    assert_eq!(cache.match_len(hot), PROMPT_BLOCKS);
    group.bench_function("64-block hit, 1M blocks resident, same prompt", |b| {
        b.iter(|| black_box(cache.match_len(black_box(hot))))
    });
    // A different resident prompt every time: every probe is likely a CPU cache miss.
    let mut next = 0usize;
    group.bench_function("64-block hit, 1M blocks resident, varied prompts", |b| {
        b.iter(|| {
            next = (next + 7_919) % chains;
            black_box(cache.match_len(black_box(&prompts[next])))
        })
    });
    group.finish();
}

// ---------------------------------------------------------------------------------------------
// 2. BlockCache::insert with eviction

const INSERT_CAPACITY: usize = 100_000;
const INSERT_CHAIN: usize = 16;

fn insert_evicting(c: &mut Criterion) {
    let resident_chains = INSERT_CAPACITY / INSERT_CHAIN;
    // A ring of chains larger than what fits: chain `t % ring` was evicted long before its turn
    // comes again, so every insert stores 16 new blocks and evicts the 16 oldest (one whole chain,
    // tail first).
    let ring = 8_192;
    assert!(ring > resident_chains);
    let chains: Vec<Vec<BlockHash>> = (0..ring as u64)
        .map(|id| chain(2, id, INSERT_CHAIN))
        .collect();
    let mut cache = BlockCache::new(Some(INSERT_CAPACITY));
    for ch in &chains[..resident_chains] {
        cache.insert(ch).expect("fits");
    }
    cache.drain_events().for_each(drop);
    let mut t = resident_chains;
    let before = cache.stats().evictions;

    let mut group = c.benchmark_group("BlockCache::insert");
    group.throughput(Throughput::Elements(INSERT_CHAIN as u64));
    group.bench_function(
        "16 new blocks into a full 100k-block cache, 16 evictions",
        |b| {
            b.iter(|| {
                let stored = cache
                    .insert(black_box(&chains[t % ring]))
                    .expect("evictable");
                t += 1;
                black_box(stored);
                // What an engine does with its events: hand them to the router (here: drop).
                for ev in cache.drain_events() {
                    black_box(ev);
                }
            })
        },
    );
    group.finish();
    let inserted = (t - resident_chains) as u64;
    assert_eq!(
        cache.stats().evictions - before,
        inserted * INSERT_CHAIN as u64
    );
    assert_eq!(cache.len(), INSERT_CAPACITY);
}

// ---------------------------------------------------------------------------------------------
// 3. CacheIndex::overlaps

/// Groups of chains sharing a 16-block prefix (think: system prompts).
const GROUPS: u64 = 10;
const SHARED_PREFIX: usize = 16;
const CHAINS_PER_WORKER: u64 = 100;
/// Distinct chains in the fleet; worker `w` holds the window `[5w, 5w + 100)` of them (mod 400),
/// so neighbouring workers share most of their chains.
const POOL: u64 = 400;
const STRIDE: u64 = 5;
/// The queried chain: held in full by every worker whose window covers it (all 8 of 8, 20 of 64,
/// 76 of 256), and up to its 16-block group prefix by every other worker.
const QUERY: u64 = 99;

/// Chain `j` of the pool: its group's 16-block prefix, then 48 blocks of its own.
fn pool_chain(j: u64) -> Vec<BlockHash> {
    let g = j % GROUPS;
    (0..PROMPT_BLOCKS as u64)
        .map(|i| {
            if (i as usize) < SHARED_PREFIX {
                block(3, g, i)
            } else {
                block(4, j, i)
            }
        })
        .collect()
}

fn fleet_index(workers: u64) -> CacheIndex {
    let pool: Vec<Vec<BlockHash>> = (0..POOL).map(pool_chain).collect();
    let mut index = CacheIndex::new();
    for w in 0..workers {
        // Event id k: one root `Stored` event per chain.
        for k in 0..CHAINS_PER_WORKER {
            let j = (w * STRIDE + k) % POOL;
            let ev = KvEvent::Stored {
                parent: None,
                blocks: pool[j as usize].clone(),
            };
            index.apply(WorkerId::new(w), k, &ev).expect("applies");
        }
    }
    index
}

fn overlaps(c: &mut Criterion) {
    let query = pool_chain(QUERY);
    let mut group = c.benchmark_group("CacheIndex::overlaps");
    group.throughput(Throughput::Elements(PROMPT_BLOCKS as u64));
    for &workers in &[8u64, 64, 256] {
        let index = fleet_index(workers);
        let mut out = Overlaps::new();
        index.overlaps_into(&query, &mut out);
        let full = out.iter().filter(|&(_, r)| r == PROMPT_BLOCKS).count();
        assert!(full > 0 && out.iter().all(|(_, r)| r >= SHARED_PREFIX));
        assert_eq!(out.iter().count() as u64, workers);
        eprintln!(
            "overlaps fleet: {workers} workers, {} distinct blocks, {} pairs; query held in full by \
             {full}, by its 16-block prefix by the rest",
            index.distinct_blocks(),
            index.pairs()
        );
        group.bench_function(
            BenchmarkId::new(
                "64-block hit, overlaps_into (reused)",
                format!("{workers} workers"),
            ),
            |b| {
                b.iter(|| {
                    index.overlaps_into(black_box(&query), &mut out);
                    black_box(out.max())
                })
            },
        );
        if workers == 64 {
            group.bench_function(
                BenchmarkId::new(
                    "64-block hit, overlaps (allocating)",
                    format!("{workers} workers"),
                ),
                |b| b.iter(|| black_box(index.overlaps(black_box(&query)))),
            );
        }
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------------
// 4. CacheIndex::apply: event ingestion

const INGEST_WORKERS: u64 = 8;
const EVENT_BLOCKS: usize = 16;
const INGEST_CHAIN: usize = 64;
/// Chains each worker keeps resident: 1,024 x 64 = 64k blocks per worker.
const WINDOW: usize = 1_024;
/// Chains each worker cycles through; > WINDOW, so every stored chain was removed before.
const INGEST_RING: usize = 2 * WINDOW;

/// One worker's pre-built events for one 64-block chain: 4 `Stored` of 16 (the first from the
/// root, each later one under the previous event's last block), and 4 `Removed` of 16, tail first
/// as an engine evicts.
struct ChainEvents {
    stored: Vec<KvEvent>,
    removed: Vec<KvEvent>,
}

fn chain_events(blocks: &[BlockHash]) -> ChainEvents {
    let stored = blocks
        .chunks(EVENT_BLOCKS)
        .enumerate()
        .map(|(k, part)| KvEvent::Stored {
            parent: k
                .checked_sub(1)
                .map(|p| blocks[p * EVENT_BLOCKS + EVENT_BLOCKS - 1]),
            blocks: part.to_vec(),
        })
        .collect();
    let removed = blocks
        .rchunks(EVENT_BLOCKS)
        .map(|part| KvEvent::Removed {
            blocks: part.iter().rev().copied().collect(),
        })
        .collect();
    ChainEvents { stored, removed }
}

/// A rolling fleet: at step `t` every worker stores ring chain `t` and removes chain
/// `t - WINDOW`, so the index stays at WINDOW chains per worker.
struct Ingest {
    index: CacheIndex,
    /// `events[w][c]`: worker `w`'s events for its ring chain `c`.
    events: Vec<Vec<ChainEvents>>,
    next_id: Vec<u64>,
    t: usize,
}

impl Ingest {
    /// `shared`: all workers store the same chains (a popular prompt), else each its own.
    fn new(shared: bool) -> Self {
        let events = (0..INGEST_WORKERS)
            .map(|w| {
                let owner = if shared { 0 } else { w };
                (0..INGEST_RING as u64)
                    .map(|c| chain_events(&chain(5, owner * INGEST_RING as u64 + c, INGEST_CHAIN)))
                    .collect()
            })
            .collect();
        let mut s = Ingest {
            index: CacheIndex::new(),
            events,
            next_id: vec![0; INGEST_WORKERS as usize],
            t: 0,
        };
        for _ in 0..WINDOW {
            s.step(false);
        }
        assert_eq!(
            s.index.pairs(),
            INGEST_WORKERS as usize * WINDOW * INGEST_CHAIN
        );
        s
    }

    /// Applies one step's events; returns the blocks they name.
    fn step(&mut self, remove: bool) -> u64 {
        let mut blocks = 0;
        for w in 0..INGEST_WORKERS as usize {
            let worker = WorkerId::new(w as u64);
            let evs = self.events[w][self.t % INGEST_RING].stored.iter();
            let old = (self.t + INGEST_RING - WINDOW) % INGEST_RING;
            let rem = if remove {
                self.events[w][old].removed.iter()
            } else {
                [].iter()
            };
            for ev in evs.chain(rem) {
                let id = self.next_id[w];
                self.next_id[w] += 1;
                let applied = self.index.apply(worker, id, ev).expect("applies");
                black_box(applied);
                blocks += ev.block_count() as u64;
            }
        }
        self.t += 1;
        blocks
    }
}

fn ingest(c: &mut Criterion) {
    let mut group = c.benchmark_group("CacheIndex::apply");
    for (shared, what) in [(false, "own chains"), (true, "same chains")] {
        let mut state = Ingest::new(shared);
        // Per step: 8 workers x (64 blocks stored + 64 removed).
        let per_step = INGEST_WORKERS * 2 * INGEST_CHAIN as u64;
        group.throughput(Throughput::Elements(per_step));
        group.bench_function(
            format!("8 workers, {what}, Stored+Removed, 64k blocks each"),
            |b| b.iter(|| black_box(state.step(true))),
        );
        assert_eq!(
            state.index.pairs(),
            INGEST_WORKERS as usize * WINDOW * INGEST_CHAIN
        );
    }
    // Storing into an empty index (the start-up burst), with the fresh index built outside the
    // timing: 8 workers x 64 chains x 64 blocks.
    let chains_each = 64u64;
    let events: Vec<Vec<ChainEvents>> = (0..INGEST_WORKERS)
        .map(|w| {
            (0..chains_each)
                .map(|c| chain_events(&chain(6, w * chains_each + c, INGEST_CHAIN)))
                .collect()
        })
        .collect();
    group.throughput(Throughput::Elements(
        INGEST_WORKERS * chains_each * INGEST_CHAIN as u64,
    ));
    group.bench_function(
        "8 workers, 32k blocks into an empty index, Stored only",
        |b| {
            b.iter_batched(
                CacheIndex::new,
                |mut index| {
                    for (w, chains) in events.iter().enumerate() {
                        let worker = WorkerId::new(w as u64);
                        for (id, ev) in chains.iter().flat_map(|c| &c.stored).enumerate() {
                            black_box(index.apply(worker, id as u64, ev).expect("applies"));
                        }
                    }
                    index
                },
                BatchSize::SmallInput,
            )
        },
    );
    group.finish();
}

criterion_group!(benches, match_len, insert_evicting, overlaps, ingest);
criterion_main!(benches);
