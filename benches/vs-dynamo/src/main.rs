//! kvkit's `CacheIndex` side by side with `dynamo-kv-router` 1.6.1's `RadixTree` and
//! `PositionalIndexer` (jump search and binary search), in one process, on one workload.
//!
//! `cargo run --release --manifest-path benches/vs-dynamo/Cargo.toml` prints one table:
//! overlap queries (full-hit and partial-hit), ingestion of `Stored` events, and memory per
//! (block, worker) pair, for 8, 64 and 256 workers.
//!
//! Method, in short (the README section says the same):
//! - The workload is built once per fleet size from a fixed seed. Worker `w` is in group `w % 4`
//!   and holds `C` chains of `D` blocks (16 tokens a block); the first `D / 4` blocks of its chain
//!   `c` are the prefix shared by every worker of its group, the rest are its own. `C` is chosen
//!   so that the index holds 2^20 (block, worker) pairs. A second workload of the same size,
//!   for ingestion and memory only: every worker holds the same chains (a fleet-wide system
//!   prompt), their events chain by chain or worker by worker.
//! - Both libraries hash the very same tokens with their own hashers (kvblock, and Dynamo's
//!   `compute_block_hash_for_seq` + `compute_seq_hash_for_block`); the harness checks that the
//!   two give the same sequence hashes, and that all four indexers give the same overlaps for
//!   every query before anything is timed.
//! - Events are `Stored` events of 16 blocks, each chain's first from the root and the next ones
//!   under the previous event's last block, workers interleaved. Each indexer is fed through its
//!   public single-threaded entry point (`RadixTree::apply_event`,
//!   `PositionalIndexer::apply_event` with its per-worker block map, as its worker thread does,
//!   `CacheIndex::apply`). Every event is built before the clock starts and consumed (dropped)
//!   inside the timed loop, for all indexers alike.
//! - Queries: `RadixTree::find_matches(Vec, false)`, `SyncIndexer::find_matches(&[..], false)`
//!   for both `PositionalIndexer` modes, `CacheIndex::overlaps_into` with one reused `Overlaps`,
//!   each on fresh copies of the queries made off the clock, 64 at a time (Radix takes its query
//!   by value; a router queries hashes it has just computed, so they are in cache). "Varied"
//!   rows run 2,048 different prompts (their blocks are mostly not in the CPU caches), "hot"
//!   rows cycle 8 prompts. Each timed pass runs every query once; passes of the four indexers
//!   are interleaved and rotated; the figure is the median of 9 passes. Each round (the four
//!   indexers back to back, for a query pass or a build) also gives a ratio of its own: the
//!   table shows their lowest and highest, which says how far the machine moved the row.
//! - Memory: a counting global allocator, switched on only while an indexer is built with
//!   events made and dropped one at a time: live bytes after minus before, over pairs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::positional::{LevelIndex, SearchMode};
use dynamo_kv_router::protocols::{
    compute_seq_hash_for_block, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash as DynLocal, OverlapScores, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::{compute_block_hash_for_seq, PositionalIndexer, RadixTree, SyncIndexer};
use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::{CacheIndex, KvEvent, Overlaps, WorkerId};

// ---------------------------------------------------------------------------------------------
// Memory: a counting allocator, on only while an index is built for the memory figure.

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; only a counter is updated besides.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            LIVE.fetch_add(layout.size() as isize, Relaxed);
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            LIVE.fetch_add(layout.size() as isize, Relaxed);
        }
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if COUNTING.load(Relaxed) {
            LIVE.fetch_sub(layout.size() as isize, Relaxed);
        }
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            LIVE.fetch_add(new_size as isize - layout.size() as isize, Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `build` with the allocation counter on; returns its result and the net bytes it kept.
fn measured<T>(build: impl FnOnce() -> T) -> (T, isize) {
    let before = LIVE.load(Relaxed);
    COUNTING.store(true, Relaxed);
    let out = build();
    COUNTING.store(false, Relaxed);
    (out, LIVE.load(Relaxed) - before)
}

// ---------------------------------------------------------------------------------------------
// The workload.

const BLOCK_TOKENS: usize = 16;
const GROUPS: usize = 4;
/// Blocks per `Stored` event.
const EVENT_BLOCKS: usize = 16;
/// (block, worker) pairs each fleet's index holds.
const TARGET_PAIRS: usize = 1 << 20;
/// Queries of each kind per fleet (each timed pass runs all of them).
const QUERIES: usize = 2_048;
/// Prompts of the hot query rows, cycled.
const HOT: usize = 8;
const QUERY_PASSES: usize = 9;
const INGEST_RUNS: usize = 3;
const JUMP: usize = 32;
/// Today's kvkit figure that section 5 of the issue says must not grow.
const MEMORY_LIMIT: f64 = 28.7;

/// SplitMix64 (the same generator as `kvtest::splitmix`, copied to keep this package light).
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        let out = mix(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The 16 tokens of the block named by `(tag, a, b, i)`.
fn block_tokens(out: &mut Vec<u32>, tag: u64, a: u64, b: u64, i: u64) {
    let mut rng = Rng(mix((tag << 60) ^ (a << 40) ^ (b << 16) ^ i));
    out.extend((0..BLOCK_TOKENS).map(|_| (rng.next_u64() % 128_000) as u32));
}

/// One chain, hashed by both libraries from the same tokens.
#[derive(Clone)]
struct Chain {
    ours: Vec<BlockHash>,
    local: Vec<DynLocal>,
    seq: Vec<ExternalSequenceBlockHash>,
}

impl Chain {
    fn hash(tokens: &[u32], hasher: &BlockHasher) -> Chain {
        let ours = hasher.sequence_hashes(tokens);
        let local =
            compute_block_hash_for_seq(tokens, BLOCK_TOKENS as u32, BlockHashOptions::default());
        let seq: Vec<ExternalSequenceBlockHash> = compute_seq_hash_for_block(&local)
            .into_iter()
            .map(ExternalSequenceBlockHash)
            .collect();
        assert_eq!(ours.len(), seq.len());
        assert!(
            ours.iter().zip(&seq).all(|(a, b)| a.get() == b.0),
            "kvblock and Dynamo disagree on a sequence hash"
        );
        Chain { ours, local, seq }
    }
}

struct Fleet {
    workers: usize,
    /// Events worker by worker (each worker's every chain, then the next worker's) instead of
    /// chain by chain.
    worker_major: bool,
    depth: usize,
    chains_per_worker: usize,
    /// Worker `w`'s chain `c` is `chains[w * chains_per_worker + c]`.
    chains: Vec<Chain>,
    /// Full-hit queries: indices into `chains`.
    full: Vec<usize>,
    /// Partial-hit queries: a group's shared prefix, then blocks nobody holds.
    partial: Vec<Chain>,
}

impl Fleet {
    fn new(workers: usize, depth: usize) -> Fleet {
        let hasher = BlockHasher::new(BlockSize::new(BLOCK_TOKENS).expect("non-zero"));
        let chains_per_worker = TARGET_PAIRS / (workers * depth);
        let shared = depth / 4;
        let mut tokens = Vec::with_capacity(depth * BLOCK_TOKENS);
        let mut chains = Vec::with_capacity(workers * chains_per_worker);
        for w in 0..workers {
            let g = (w % GROUPS) as u64;
            for c in 0..chains_per_worker as u64 {
                tokens.clear();
                for i in 0..depth as u64 {
                    if (i as usize) < shared {
                        block_tokens(&mut tokens, 1, g, c, i);
                    } else {
                        block_tokens(&mut tokens, 2, w as u64, c, i);
                    }
                }
                chains.push(Chain::hash(&tokens, &hasher));
            }
        }
        let mut rng = Rng(0x5eed ^ workers as u64);
        let full = (0..QUERIES).map(|_| rng.below(chains.len())).collect();
        let partial = (0..QUERIES as u64)
            .map(|q| {
                let g = rng.below(GROUPS) as u64;
                let c = rng.below(chains_per_worker) as u64;
                tokens.clear();
                for i in 0..depth as u64 {
                    if (i as usize) < shared {
                        block_tokens(&mut tokens, 1, g, c, i);
                    } else {
                        block_tokens(&mut tokens, 3, workers as u64, q, i);
                    }
                }
                Chain::hash(&tokens, &hasher)
            })
            .collect();
        Fleet {
            workers,
            worker_major: false,
            depth,
            chains_per_worker,
            chains,
            full,
            partial,
        }
    }

    /// A fleet-wide prefix: every worker holds the same `C` chains of `D` blocks (a system
    /// prompt every engine has cached), so every block has all the workers as holders. Only
    /// ingestion and memory are measured on it (every query would be a full hit everywhere).
    /// Events come chain by chain (each chain reaches every worker in turn), or with
    /// `worker_major` worker by worker (each worker caches every chain in turn, as when
    /// engines start one after another).
    fn same_chains(workers: usize, depth: usize, worker_major: bool) -> Fleet {
        let hasher = BlockHasher::new(BlockSize::new(BLOCK_TOKENS).expect("non-zero"));
        let chains_per_worker = TARGET_PAIRS / (workers * depth);
        let mut tokens = Vec::with_capacity(depth * BLOCK_TOKENS);
        let shared: Vec<Chain> = (0..chains_per_worker as u64)
            .map(|c| {
                tokens.clear();
                for i in 0..depth as u64 {
                    block_tokens(&mut tokens, 5, 0, c, i);
                }
                Chain::hash(&tokens, &hasher)
            })
            .collect();
        let chains = (0..workers)
            .flat_map(|_| shared.iter().map(Chain::clone))
            .collect();
        Fleet {
            workers,
            worker_major,
            depth,
            chains_per_worker,
            chains,
            full: Vec::new(),
            partial: Vec::new(),
        }
    }

    fn pairs(&self) -> usize {
        self.chains.len() * self.depth
    }

    /// Every event of the fleet in arrival order, as `(worker, event id, chain, first block)`:
    /// chain by chain, workers interleaved (or worker by worker), 16 blocks an event.
    fn events(&self) -> impl Iterator<Item = (usize, u64, usize, usize)> + '_ {
        let per_chain = self.depth / EVENT_BLOCKS;
        let (workers, chains) = (self.workers, self.chains_per_worker);
        let (outer, inner) = if self.worker_major {
            (workers, chains)
        } else {
            (chains, workers)
        };
        (0..outer).flat_map(move |a| {
            (0..inner).flat_map(move |b| {
                let (w, c) = if self.worker_major { (a, b) } else { (b, a) };
                (0..per_chain)
                    .map(move |k| (w, self.event_id(c, k), w * chains + c, k * EVENT_BLOCKS))
            })
        })
    }

    /// A worker's id for the `k`-th event of its chain `c`: 0, 1, ... in arrival order, so
    /// `event_id(chains_per_worker, 0)` is the first id after the fleet's own events.
    fn event_id(&self, c: usize, k: usize) -> u64 {
        (c * (self.depth / EVENT_BLOCKS) + k) as u64
    }

    fn our_event(&self, chain: usize, start: usize) -> KvEvent {
        let ch = &self.chains[chain].ours;
        KvEvent::Stored {
            parent: start.checked_sub(1).map(|p| ch[p]),
            blocks: ch[start..start + EVENT_BLOCKS].to_vec(),
        }
    }

    fn dynamo_event(&self, worker: usize, id: u64, chain: usize, start: usize) -> RouterEvent {
        let ch = &self.chains[chain];
        let blocks = (start..start + EVENT_BLOCKS)
            .map(|i| KvCacheStoredBlockData {
                block_hash: ch.seq[i],
                tokens_hash: ch.local[i],
                mm_extra_info: None,
            })
            .collect();
        RouterEvent::new(
            worker as u64,
            KvCacheEvent {
                event_id: id,
                data: KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: start.checked_sub(1).map(|p| ch.seq[p]),
                    start_position: None,
                    blocks,
                }),
                dp_rank: 0,
            },
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The four indexers behind one face.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Radix,
    Jump,
    Binary,
    Ours,
}

const KINDS: [Kind; 4] = [Kind::Radix, Kind::Jump, Kind::Binary, Kind::Ours];

/// The per-worker block map a `PositionalIndexer` worker thread keeps beside the shared index.
type WorkerBlocks = HashMap<WorkerWithDpRank, LevelIndex, rustc_hash::FxBuildHasher>;

enum Index {
    Radix(RadixTree),
    Positional(PositionalIndexer, WorkerBlocks),
    Ours(CacheIndex),
}

/// A pre-built event of either library.
enum Event {
    Dynamo(RouterEvent),
    Ours(WorkerId, u64, KvEvent),
}

impl Index {
    fn new(kind: Kind, fleet: &Fleet) -> Index {
        match kind {
            Kind::Radix => Index::Radix(RadixTree::new()),
            Kind::Jump => Index::Positional(
                PositionalIndexer::new_with_mode(JUMP, SearchMode::Strided),
                WorkerBlocks::default(),
            ),
            Kind::Binary => Index::Positional(
                PositionalIndexer::new_with_mode(JUMP, SearchMode::Binary),
                WorkerBlocks::default(),
            ),
            Kind::Ours => {
                let mut index = CacheIndex::new();
                for w in 0..fleet.workers {
                    index.add_worker(WorkerId::new(w as u64)).expect("fits");
                }
                Index::Ours(index)
            }
        }
    }

    fn apply(&mut self, event: Event) {
        match (self, event) {
            (Index::Radix(t), Event::Dynamo(e)) => t.apply_event(e).expect("applies"),
            (Index::Positional(p, wb), Event::Dynamo(e)) => {
                p.apply_event(wb, e, None).expect("applies")
            }
            (Index::Ours(i), Event::Ours(w, id, e)) => {
                let applied = i.apply(w, id, &e).expect("applies");
                debug_assert!(applied.gap.is_none());
                drop(e);
            }
            _ => unreachable!("event of the other library"),
        }
    }

    fn is_ours(&self) -> bool {
        matches!(self, Index::Ours(_))
    }
}

fn event(fleet: &Fleet, ours: bool, (w, id, chain, start): (usize, u64, usize, usize)) -> Event {
    if ours {
        Event::Ours(WorkerId::new(w as u64), id, fleet.our_event(chain, start))
    } else {
        Event::Dynamo(fleet.dynamo_event(w, id, chain, start))
    }
}

/// Builds `kind`'s index of the fleet with the allocation counter on (events made one at a time).
fn build_measured(kind: Kind, fleet: &Fleet) -> (Index, f64) {
    let ours = kind == Kind::Ours;
    let (index, bytes) = measured(|| {
        let mut index = Index::new(kind, fleet);
        for spec in fleet.events() {
            index.apply(event(fleet, ours, spec));
        }
        index
    });
    if let Index::Ours(i) = &index {
        assert_eq!(i.pairs(), fleet.pairs());
    }
    (index, bytes as f64 / fleet.pairs() as f64)
}

/// Builds `kind`'s index from pre-built events; returns blocks per second.
fn ingest_rate(kind: Kind, fleet: &Fleet) -> f64 {
    let ours = kind == Kind::Ours;
    let events: Vec<Event> = fleet.events().map(|s| event(fleet, ours, s)).collect();
    let mut index = Index::new(kind, fleet);
    let start = Instant::now();
    for e in events {
        index.apply(e);
    }
    let took = start.elapsed();
    black_box(&index);
    drop(index);
    fleet.pairs() as f64 / took.as_secs_f64()
}

/// Sorted non-zero `(worker, run)` pairs.
fn dynamo_runs(scores: &OverlapScores) -> Vec<(u64, usize)> {
    let mut v: Vec<(u64, usize)> = scores
        .scores
        .iter()
        .filter(|(_, &s)| s > 0)
        .map(|(w, &s)| (w.worker_id, s as usize))
        .collect();
    v.sort_unstable();
    v
}

fn query_runs(index: &Index, chain: &Chain, out: &mut Overlaps) -> Vec<(u64, usize)> {
    match index {
        Index::Radix(t) => dynamo_runs(&t.find_matches(chain.local.clone(), false)),
        Index::Positional(p, _) => dynamo_runs(&SyncIndexer::find_matches(p, &chain.local, false)),
        Index::Ours(i) => {
            i.overlaps_into(&chain.ours, out);
            let mut v: Vec<(u64, usize)> = out.iter().map(|(w, r)| (w.get(), r)).collect();
            v.sort_unstable();
            v
        }
    }
}

/// Queries timed per clock reading. `RadixTree::find_matches` takes its query by value, so each
/// chunk's copies are made (off the clock) just before it runs, small enough to stay in cache;
/// the other indexers get the same fresh copies, so every indexer reads its query from the CPU
/// cache, as a router does right after hashing the prompt (the index itself stays cold).
const CHUNK: usize = 64;

/// One timed pass over `queries`; returns the mean time per query.
fn query_pass(index: &Index, queries: &[&Chain], out: &mut Overlaps) -> Duration {
    let mut total = Duration::ZERO;
    for chunk in queries.chunks(CHUNK) {
        total += match index {
            Index::Radix(t) => {
                let owned: Vec<Vec<DynLocal>> = chunk.iter().map(|q| q.local.clone()).collect();
                let start = Instant::now();
                for q in owned {
                    black_box(t.find_matches(black_box(q), false));
                }
                start.elapsed()
            }
            Index::Positional(p, _) => {
                let owned: Vec<Vec<DynLocal>> = chunk.iter().map(|q| q.local.clone()).collect();
                let start = Instant::now();
                for q in &owned {
                    black_box(SyncIndexer::find_matches(p, black_box(q), false));
                }
                start.elapsed()
            }
            Index::Ours(i) => {
                let owned: Vec<Vec<BlockHash>> = chunk.iter().map(|q| q.ours.clone()).collect();
                let start = Instant::now();
                for q in &owned {
                    i.overlaps_into(black_box(q), out);
                    black_box(out.max());
                }
                start.elapsed()
            }
        };
    }
    total / queries.len() as u32
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

// ---------------------------------------------------------------------------------------------
// The table.

enum Unit {
    Micros,
    Rate,
    BytesPerPair,
}

struct Row {
    label: String,
    unit: Unit,
    /// Radix, jump, binary, ours.
    values: [f64; 4],
    /// The lowest and highest [`ratio_of`] the rounds gave, each from the four figures of one
    /// round (the indexers run back to back): how far the machine moved the ratio within the run.
    /// `None` for memory, which does not vary.
    paired: Option<(f64, f64)>,
}

/// kvkit against the best Dynamo figure of `values` (radix, jump, binary, ours), > 1 when kvkit
/// is better.
fn ratio_of(unit: &Unit, [r, j, b, o]: [f64; 4]) -> f64 {
    match unit {
        Unit::Micros | Unit::BytesPerPair => r.min(j).min(b) / o,
        Unit::Rate => o / r.max(j).max(b),
    }
}

/// A row of figures measured in rounds (`samples[k][round]` for indexer `k`): the medians, and
/// the range of the rounds' own ratios.
fn measured_row(label: String, unit: Unit, samples: &[Vec<f64>]) -> Row {
    let rounds = samples[0].len();
    let ratios: Vec<f64> = (0..rounds)
        .map(|i| ratio_of(&unit, std::array::from_fn(|k| samples[k][i])))
        .collect();
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Row {
        label,
        values: std::array::from_fn(|k| median(samples[k].clone())),
        unit,
        paired: Some((lo, hi)),
    }
}

impl Row {
    fn cell(&self, v: f64) -> String {
        match self.unit {
            Unit::Micros => format!("{v:.2} µs"),
            Unit::Rate => format!("{:.1} M/s", v / 1e6),
            Unit::BytesPerPair => format!("{v:.1} B"),
        }
    }

    /// kvkit against the best Dynamo figure, > 1 when kvkit is better.
    fn ratio(&self) -> f64 {
        ratio_of(&self.unit, self.values)
    }

    fn paired_cell(&self) -> String {
        self.paired
            .map_or("—".into(), |(lo, hi)| format!("{lo:.2}–{hi:.2}×"))
    }

    fn target(&self) -> String {
        let [r, _, _, o] = self.values;
        let mark = |ok: bool| if ok { "met" } else { "MISSED" };
        match self.unit {
            Unit::Micros => format!("≥ 2.5×: {}", mark(self.ratio() >= 2.5)),
            Unit::Rate => format!("≥ 1.5× RadixTree ({:.2}×): {}", o / r, mark(o / r >= 1.5)),
            Unit::BytesPerPair => format!("≤ {MEMORY_LIMIT} B: {}", mark(o <= MEMORY_LIMIT)),
        }
    }
}

fn main() {
    let began = Instant::now();
    // `-- --workers 64` (or `8,256`) runs only those fleets.
    let args: Vec<String> = std::env::args().skip(1).collect();
    // (workers, chain depth) of each fleet.
    const FLEETS: [(usize, usize); 3] = [(8, 64), (64, 64), (256, 128)];
    const USAGE: &str = "usage: kvkit-vs-dynamo [--workers 8,64,256] [--evicted [--tail-first]]";
    let (mut evicted, mut tail_first, mut only) = (false, false, None);
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--help" | "-h" => {
                println!(
                    "{USAGE}\n\nRuns kvkit's CacheIndex and dynamo-kv-router's indexers on one workload and prints the side-by-side table.\n\n  \
                     --workers LIST  only the fleets listed (of 8, 64 and 256)\n  \
                     --evicted       before the queries, every worker of every index stores one block of its own and evicts it:\n                  \
                     the content is unchanged, but kvkit's index walks each such worker block by block\n  \
                     --tail-first    with --evicted: kvkit's index trusts removals to take leaves (CacheIndex::set_tail_first)"
                );
                return;
            }
            "--evicted" => evicted = true,
            "--tail-first" => tail_first = true,
            "--workers" => {
                only = Some(workers_list(
                    rest.next().map_or("", String::as_str),
                    &FLEETS,
                    USAGE,
                ))
            }
            other => {
                eprintln!("error: unexpected argument `{other}`\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    if tail_first && !evicted {
        eprintln!("error: --tail-first: only with --evicted\n{USAGE}");
        std::process::exit(2);
    }
    let fleets: Vec<(usize, usize)> = FLEETS
        .into_iter()
        .filter(|(w, _)| only.as_ref().is_none_or(|o: &Vec<usize>| o.contains(w)))
        .collect();
    run(&fleets, evicted, tail_first, began);
}

/// `--workers`' list, each one of `fleets`' sizes; exits 2 naming the flag otherwise.
fn workers_list(list: &str, fleets: &[(usize, usize)], usage: &str) -> Vec<usize> {
    match list
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<usize>, _>>()
    {
        Ok(v) if !v.is_empty() && v.iter().all(|w| fleets.iter().any(|f| f.0 == *w)) => v,
        _ => {
            eprintln!("error: --workers: expected a list of 8, 64 and 256, got `{list}`\n{usage}");
            std::process::exit(2);
        }
    }
}

/// Every worker of `index` stores one root block of its own and evicts it.
fn evict_once(index: &mut Index, fleet: &Fleet) {
    let mut tokens = Vec::new();
    let hasher = BlockHasher::new(BlockSize::new(BLOCK_TOKENS).expect("non-zero"));
    for w in 0..fleet.workers {
        tokens.clear();
        block_tokens(&mut tokens, 4, w as u64, 0, 0);
        let chain = Chain::hash(&tokens, &hasher);
        let id = fleet.event_id(fleet.chains_per_worker, 0);
        match &mut *index {
            Index::Ours(i) => {
                let wid = WorkerId::new(w as u64);
                let stored = KvEvent::Stored {
                    parent: None,
                    blocks: chain.ours.clone(),
                };
                i.apply(wid, id, &stored).expect("applies");
                i.apply(wid, id + 1, &KvEvent::Removed { blocks: chain.ours })
                    .expect("applies");
            }
            other => {
                let stored = KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: None,
                    start_position: None,
                    blocks: vec![KvCacheStoredBlockData {
                        block_hash: chain.seq[0],
                        tokens_hash: chain.local[0],
                        mm_extra_info: None,
                    }],
                });
                let removed = KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: chain.seq.clone(),
                });
                for (k, data) in [stored, removed].into_iter().enumerate() {
                    let event = KvCacheEvent {
                        event_id: id + k as u64,
                        data,
                        dp_rank: 0,
                    };
                    other.apply(Event::Dynamo(RouterEvent::new(w as u64, event)));
                }
            }
        }
    }
}

fn run(fleets: &[(usize, usize)], evicted: bool, tail_first: bool, began: Instant) {
    let mut full_rows = Vec::new();
    let mut partial_rows = Vec::new();
    let mut ingest_rows = Vec::new();
    let mut memory_rows = Vec::new();

    for &(workers, depth) in fleets {
        let fleet = Fleet::new(workers, depth);

        // Memory (and the indexes the queries run against).
        let mut memory = [0.0; 4];
        let mut indexes: Vec<Index> = KINDS
            .iter()
            .enumerate()
            .map(|(k, &kind)| {
                let (index, bytes) = build_measured(kind, &fleet);
                memory[k] = bytes;
                index
            })
            .collect();
        if evicted {
            for index in &mut indexes {
                if let Index::Ours(i) = index {
                    i.set_tail_first(tail_first);
                }
                evict_once(index, &fleet);
            }
            if let Index::Ours(i) = &indexes[3] {
                let walked = (0..workers).filter(|&w| i.may_have_holes(WorkerId::new(w as u64)));
                assert_eq!(walked.count(), if tail_first { 0 } else { workers });
            }
        }
        let distinct = match &indexes[3] {
            Index::Ours(i) => i.distinct_blocks(),
            _ => unreachable!(),
        };
        eprintln!(
            "{workers} workers, depth {depth}: {} chains of {depth} blocks per worker, {} pairs, \
             {distinct} distinct blocks; kvblock and Dynamo hashes agree on all {} chains",
            fleet.chains_per_worker,
            fleet.pairs(),
            fleet.chains.len() + fleet.partial.len()
        );

        // Same answers everywhere, and the shape the workload promises.
        let mut out = Overlaps::new();
        let shared = depth / 4;
        let group = workers / GROUPS;
        for (full, chain) in [true, false].into_iter().flat_map(|full| {
            let qs: Vec<&Chain> = if full {
                fleet.full.iter().map(|&c| &fleet.chains[c]).collect()
            } else {
                fleet.partial.iter().collect()
            };
            qs.into_iter().map(move |q| (full, q))
        }) {
            let reference = query_runs(&indexes[3], chain, &mut out);
            let held_in_full = reference.iter().filter(|&&(_, r)| r == depth).count();
            assert_eq!(
                reference.len(),
                group,
                "every group member shares the prefix"
            );
            assert_eq!(held_in_full, usize::from(full));
            assert!(reference.iter().all(|&(_, r)| r == depth || r == shared));
            for index in &indexes[..3] {
                assert_eq!(query_runs(index, chain, &mut out), reference);
            }
        }

        // Queries: passes of the four indexers interleaved, the order rotated each round.
        for (full, hot) in [(true, false), (true, true), (false, false), (false, true)] {
            let mut queries: Vec<&Chain> = if full {
                fleet.full.iter().map(|&c| &fleet.chains[c]).collect()
            } else {
                fleet.partial.iter().collect()
            };
            if hot {
                // A few prompts over and over: their blocks stay in the CPU caches.
                let few = queries[..HOT].to_vec();
                queries = few.iter().copied().cycle().take(QUERIES).collect();
            }
            let mut samples = vec![Vec::new(); 4];
            for round in 0..=QUERY_PASSES {
                for k in 0..4 {
                    let k = (k + round) % 4;
                    let t = query_pass(&indexes[k], &queries, &mut out);
                    if round > 0 {
                        samples[k].push(t.as_secs_f64() * 1e6);
                    }
                }
            }
            let row = measured_row(
                format!(
                    "query {}, {}, {workers} workers, {depth} blocks{}",
                    if full { "full-hit" } else { "partial-hit" },
                    if hot {
                        format!("hot ({HOT} prompts)")
                    } else {
                        format!("varied ({QUERIES} prompts)")
                    },
                    match (evicted, tail_first) {
                        (false, _) => "",
                        (true, false) => ", every worker evicted once",
                        (true, true) => ", every worker evicted once, kvkit trusting tail-first",
                    }
                ),
                Unit::Micros,
                &samples,
            );
            if full {
                full_rows.push((hot, row));
            } else {
                partial_rows.push((hot, row));
            }
        }
        assert!(indexes[3].is_ours());
        drop(indexes);

        // Ingest: fresh indexes, pre-built events; runs of the four interleaved.
        let mut samples = vec![Vec::new(); 4];
        for round in 0..INGEST_RUNS {
            for k in 0..4 {
                let k = (k + round) % 4;
                samples[k].push(ingest_rate(KINDS[k], &fleet));
            }
        }
        ingest_rows.push(measured_row(
            format!("ingest, {workers} workers, 16-block Stored events"),
            Unit::Rate,
            &samples,
        ));
        memory_rows.push(Row {
            label: format!("memory, {workers} workers, bytes per (block, worker) pair"),
            unit: Unit::BytesPerPair,
            values: memory,
            paired: None,
        });

        // The same chains on every worker: ingestion (in both orders) and memory.
        for worker_major in [false, true] {
            let same = Fleet::same_chains(workers, depth, worker_major);
            let mut samples = vec![Vec::new(); 4];
            for round in 0..INGEST_RUNS {
                for k in 0..4 {
                    let k = (k + round) % 4;
                    samples[k].push(ingest_rate(KINDS[k], &same));
                }
            }
            let order = if worker_major {
                "worker by worker"
            } else {
                "chain by chain"
            };
            ingest_rows.push(measured_row(
                format!("ingest, {workers} workers, all holding the same chains, {order}"),
                Unit::Rate,
                &samples,
            ));
            if !worker_major {
                eprintln!(
                    "{workers} workers, same chains: {} chains of {depth} blocks held by every worker, {} pairs",
                    same.chains_per_worker,
                    same.pairs()
                );
                memory_rows.push(Row {
                    label: format!(
                        "memory, {workers} workers, all holding the same chains, bytes per (block, worker) pair"
                    ),
                    unit: Unit::BytesPerPair,
                    values: std::array::from_fn(|k| build_measured(KINDS[k], &same).1),
                    paired: None,
                });
            }
        }
    }

    println!(
        "| row | Dynamo RadixTree | Dynamo PositionalIndexer jump {JUMP} | Dynamo PositionalIndexer binary | kvkit CacheIndex | kvkit / fastest Dynamo | rounds' own ratios | target |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    // Varied before hot, full-hit before partial-hit, fleets in order.
    let mut query_rows: Vec<(bool, bool, &Row)> = full_rows
        .iter()
        .map(|(hot, r)| (*hot, false, r))
        .chain(partial_rows.iter().map(|(hot, r)| (*hot, true, r)))
        .collect();
    query_rows.sort_by_key(|&(hot, partial, _)| (hot, partial));
    for row in query_rows
        .into_iter()
        .map(|(_, _, r)| r)
        .chain(&ingest_rows)
        .chain(&memory_rows)
    {
        let [r, j, b, o] = row.values;
        println!(
            "| {} | {} | {} | {} | {} | {:.2}× | {} | {} |",
            row.label,
            row.cell(r),
            row.cell(j),
            row.cell(b),
            row.cell(o),
            row.ratio(),
            row.paired_cell(),
            row.target()
        );
    }
    println!();
    println!(
        "Ratio > 1: kvkit is ahead (best Dynamo time or bytes over kvkit's; kvkit's rate over the \
         best Dynamo rate). Median of {QUERY_PASSES} interleaved passes of {QUERIES} queries, of \
         {INGEST_RUNS} builds of 2^20 pairs; all four indexers checked to give identical overlaps. \
         Rounds' own ratios: the lowest and highest ratio of one round's four figures (the \
         indexers back to back), how far the machine moved the ratio within the run."
    );
    eprintln!("done in {:.0?}", began.elapsed());
}
