//! Routing one request with the `Kv` policy against a loaded router: an index of about 1M
//! (block, worker) pairs and ~4 in-flight 128-block requests per worker.
//!
//! Every worker's cache is a set of 128-block chains from the root: a 32-block "system prompt"
//! from a pool of 64, a 32-block "document" from 16 per system prompt, and a 64-block tail of its
//! own, with popular prefixes picked more often, so a prefix is held by many workers. A query is
//! a pooled system prompt and document plus a fresh tail: its leading 32 to 64 blocks are cached on
//! several workers. Each iteration routes one query and finishes it, so the state is stationary.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvkit::kvblock::{BlockHash, BlockHasher, BlockSize};
use kvkit::kvcache::{KvEvent, WorkerId};
use kvkit::kvroute::{
    BusyThreshold, CostModel, Policy, ReportedLoad, RequestId, Role, Router, RouterBuilder,
};
use kvtest::splitmix;

const BLOCK_SIZE: usize = 16;
const PREFIX_BLOCKS: usize = 32;
const DOC_BLOCKS: usize = 32;
const TAIL_BLOCKS: usize = 64;
const PREFIXES: usize = 64;
const DOCS_PER_PREFIX: usize = 16;
const TARGET_PAIRS: usize = 1 << 20;
const IN_FLIGHT_PER_WORKER: u64 = 4;
const QUERIES: usize = 256;

/// `n` deterministic pseudo-random token ids named by `tag`.
fn tokens(tag: u64, n: usize) -> Vec<u32> {
    let mut rng = splitmix::Rng(tag.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (0..n).map(|_| (rng.next_u64() % 100_000) as u32).collect()
}

/// The shared prefixes, as tokens and as block hashes.
struct Corpus {
    hasher: BlockHasher,
    prefix_tokens: Vec<Vec<u32>>,
    prefix_blocks: Vec<Vec<BlockHash>>,
    doc_tokens: Vec<Vec<Vec<u32>>>,
    doc_blocks: Vec<Vec<Vec<BlockHash>>>,
    rng: splitmix::Rng,
    next_tail: u64,
}

/// One prompt: 128 blocks (2,048 tokens) whose first 64 come from the pools.
struct Prompt {
    prefix: usize,
    doc: usize,
    tokens: Vec<u32>,
    blocks: Vec<BlockHash>,
}

impl Corpus {
    fn new(seed: u64) -> Self {
        let hasher = BlockHasher::new(BlockSize::new(BLOCK_SIZE).expect("non-zero"));
        let prefix_tokens: Vec<Vec<u32>> = (0..PREFIXES as u64)
            .map(|p| tokens(p, PREFIX_BLOCKS * BLOCK_SIZE))
            .collect();
        let prefix_blocks: Vec<Vec<BlockHash>> = prefix_tokens
            .iter()
            .map(|t| hasher.sequence_hashes(t))
            .collect();
        let doc_tokens: Vec<Vec<Vec<u32>>> = (0..PREFIXES as u64)
            .map(|p| {
                (0..DOCS_PER_PREFIX as u64)
                    .map(|d| tokens(1_000 + p * 100 + d, DOC_BLOCKS * BLOCK_SIZE))
                    .collect()
            })
            .collect();
        let doc_blocks = doc_tokens
            .iter()
            .zip(&prefix_blocks)
            .map(|(docs, prefix)| {
                docs.iter()
                    .map(|t| {
                        let mut out = Vec::with_capacity(DOC_BLOCKS);
                        hasher.sequence_hashes_into(prefix.last().copied(), t, &mut out);
                        out
                    })
                    .collect()
            })
            .collect();
        Corpus {
            hasher,
            prefix_tokens,
            prefix_blocks,
            doc_tokens,
            doc_blocks,
            rng: splitmix::Rng(seed),
            next_tail: 1 << 40,
        }
    }

    /// A popular system prompt and document, then a tail nobody has seen.
    fn prompt(&mut self) -> Prompt {
        let prefix = self.rng.skewed(PREFIXES);
        let doc = self.rng.skewed(DOCS_PER_PREFIX);
        self.next_tail += 1;
        let tail = tokens(self.next_tail, TAIL_BLOCKS * BLOCK_SIZE);
        let mut blocks = Vec::with_capacity(PREFIX_BLOCKS + DOC_BLOCKS + TAIL_BLOCKS);
        blocks.extend_from_slice(&self.prefix_blocks[prefix]);
        blocks.extend_from_slice(&self.doc_blocks[prefix][doc]);
        let parent = blocks.last().copied();
        self.hasher.sequence_hashes_into(parent, &tail, &mut blocks);
        let mut toks = Vec::with_capacity(blocks.len() * BLOCK_SIZE);
        toks.extend_from_slice(&self.prefix_tokens[prefix]);
        toks.extend_from_slice(&self.doc_tokens[prefix][doc]);
        toks.extend_from_slice(&tail);
        Prompt {
            prefix,
            doc,
            tokens: toks,
            blocks,
        }
    }
}

/// A `Kv` router over `workers` workers whose index holds about [`TARGET_PAIRS`] pairs, with
/// [`IN_FLIGHT_PER_WORKER`] requests per worker in flight, and [`QUERIES`] fresh prompts.
fn fixture(workers: usize) -> (Router, Vec<Prompt>) {
    fixture_with(workers, Router::builder())
}

/// [`fixture`] with a router built from `builder` (its block size, policy, weight and seed
/// replaced by the fixture's).
fn fixture_with(workers: usize, builder: RouterBuilder) -> (Router, Vec<Prompt>) {
    fixture_of(workers, builder, false)
}

/// [`fixture_with`], then every worker evicts the tail block of the chain it stored last, as
/// an engine under memory pressure does: the steady state of a fleet.
fn fixture_evicted(workers: usize, builder: RouterBuilder) -> (Router, Vec<Prompt>) {
    fixture_of(workers, builder, true)
}

fn fixture_of(workers: usize, builder: RouterBuilder, evict: bool) -> (Router, Vec<Prompt>) {
    let mut router = builder
        .block_size(BlockSize::new(BLOCK_SIZE).expect("non-zero"))
        .policy(Policy::Kv)
        .overlap_weight(1.0)
        .seed(7)
        .build()
        .expect("valid settings");
    let mut corpus = Corpus::new(workers as u64);
    let per_worker = TARGET_PAIRS / workers;
    for w in 0..workers as u64 {
        let id = WorkerId::new(w);
        router.add_worker(id);
        // What this worker's engine holds: which prefixes and which documents.
        let mut has_prefix = [false; PREFIXES];
        let mut has_doc = [[false; DOCS_PER_PREFIX]; PREFIXES];
        let mut event_id = 0;
        let mut tail = None;
        while router.cache_view(id) < per_worker {
            let p = corpus.prompt();
            // As an engine reports it: the new part of the chain, under its resident parent.
            let skip = if has_doc[p.prefix][p.doc] {
                PREFIX_BLOCKS + DOC_BLOCKS
            } else if has_prefix[p.prefix] {
                PREFIX_BLOCKS
            } else {
                0
            };
            has_prefix[p.prefix] = true;
            has_doc[p.prefix][p.doc] = true;
            let event = KvEvent::Stored {
                parent: skip.checked_sub(1).map(|i| p.blocks[i]),
                blocks: p.blocks[skip..].to_vec(),
            };
            router
                .apply_event(id, event_id, &event)
                .expect("consistent events");
            event_id += 1;
            tail = p.blocks.last().copied();
        }
        if let (true, Some(tail)) = (evict, tail) {
            let event = KvEvent::Removed { blocks: vec![tail] };
            router
                .apply_event(id, event_id, &event)
                .expect("consistent events");
        }
    }
    let in_flight = IN_FLIGHT_PER_WORKER * workers as u64;
    for request in 0..in_flight {
        let p = corpus.prompt();
        router
            .route(RequestId::new(request), &p.blocks, Role::Unified)
            .expect("routable");
    }
    let queries: Vec<Prompt> = (0..QUERIES).map(|_| corpus.prompt()).collect();

    // What the measured requests see.
    let (mut holders32, mut holders64) = (0usize, 0usize);
    for q in &queries {
        let ov = router.index().overlaps(&q.blocks);
        holders32 += ov.iter().filter(|&(_, r)| r >= PREFIX_BLOCKS).count();
        holders64 += ov
            .iter()
            .filter(|&(_, r)| r >= PREFIX_BLOCKS + DOC_BLOCKS)
            .count();
    }
    let ids = router.workers();
    let active: Vec<usize> = ids.iter().map(|&w| router.active_blocks(w)).collect();
    let flights: Vec<usize> = ids.iter().map(|&w| router.in_flight(w)).collect();
    eprintln!(
        "fixture: {workers} workers, {} pairs, {} distinct blocks; in flight {} requests \
         ({}..={} per worker, {}..={} active blocks); a query's first 32 blocks cached on {:.1} \
         workers, first 64 on {:.1} (mean)",
        router.index().pairs(),
        router.index().distinct_blocks(),
        router.in_flight_total(),
        flights.iter().min().unwrap_or(&0),
        flights.iter().max().unwrap_or(&0),
        active.iter().min().unwrap_or(&0),
        active.iter().max().unwrap_or(&0),
        holders32 as f64 / QUERIES as f64,
        holders64 as f64 / QUERIES as f64,
    );
    (router, queries)
}

/// The route call alone: each request is finished outside the timed section, so the state stays
/// stationary without counting finish's cost.
fn route_only(c: &mut Criterion) {
    let mut group = c.benchmark_group("route");
    group.throughput(Throughput::Elements(1));
    let fresh = [8usize, 64, 256, 1_024].map(|w| (w, "128 blocks", false, false));
    // Every worker evicted once: walked block by block, unless removals are trusted to take
    // leaves (`tail_first_evictions`), as engines evicting tail first allow.
    let evicted = [64usize, 1_024].into_iter().flat_map(|w| {
        [
            (w, "128 blocks, every worker evicted", true, false),
            (
                w,
                "128 blocks, every worker evicted, tail-first trusted",
                true,
                true,
            ),
        ]
    });
    for (workers, name, evict, trust) in fresh.into_iter().chain(evicted) {
        let builder = Router::builder().tail_first_evictions(trust);
        let (mut router, queries) = if evict {
            fixture_evicted(workers, builder)
        } else {
            fixture_with(workers, builder)
        };
        let mut request = 1u64 << 32;
        group.bench_function(BenchmarkId::new(name, format!("{workers} workers")), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let q = &queries[request as usize % QUERIES];
                    let start = Instant::now();
                    let d =
                        router.route(RequestId::new(request), black_box(&q.blocks), Role::Unified);
                    timed += start.elapsed();
                    black_box(d.expect("routable"));
                    router.finish(RequestId::new(request)).expect("in flight");
                    request += 1;
                }
                timed
            })
        });
    }
    group.finish();
}

fn route(c: &mut Criterion) {
    let mut group = c.benchmark_group("route + finish");
    group.throughput(Throughput::Elements(1));
    for &workers in &[8usize, 64, 256, 1_024] {
        let (mut router, queries) = fixture(workers);
        let mut request = 1u64 << 32;
        group.bench_function(
            BenchmarkId::new("128 blocks", format!("{workers} workers")),
            |b| {
                b.iter(|| {
                    let q = &queries[request as usize % QUERIES];
                    let d = router
                        .route(RequestId::new(request), black_box(&q.blocks), Role::Unified)
                        .expect("routable");
                    router.finish(RequestId::new(request)).expect("in flight");
                    request += 1;
                    black_box(d)
                })
            },
        );
    }
    group.finish();
}

fn route_tokens(c: &mut Criterion) {
    let mut group = c.benchmark_group("route_tokens + finish");
    let (mut router, queries) = fixture(64);
    let tokens = queries[0].tokens.len();
    group.throughput(Throughput::Elements(tokens as u64));
    let mut request = 1u64 << 32;
    group.bench_function(
        BenchmarkId::new(format!("{tokens} tokens, block {BLOCK_SIZE}"), "64 workers"),
        |b| {
            b.iter(|| {
                let q = &queries[request as usize % QUERIES];
                let d = router
                    .route_tokens(RequestId::new(request), black_box(&q.tokens), Role::Unified)
                    .expect("routable");
                router.finish(RequestId::new(request)).expect("in flight");
                request += 1;
                black_box(d)
            })
        },
    );
    group.finish();
}

/// `route + finish` with each option of the routing model on, then all: the prefill-aware cost
/// and a busy threshold that never bites here (each request's first token reported with
/// `prefill_done`, as they need), temperature sampling, predicted blocks that lapse after 50
/// requests (1 ms each on the clock). While nobody is busy the router's scan skips the busy
/// test, so the threshold is measured a second time with one worker busy by its engine's report
/// (more waiting requests than the limit): the scans then take the list of the others.
fn route_model(c: &mut Criterion) {
    let mut group = c.benchmark_group("route + finish, options on");
    group.throughput(Throughput::Elements(1));
    let busy = BusyThreshold::new()
        .decode_fraction(0.9, 4 * 128)
        .prefill_tokens(1 << 16)
        .waiting_requests(8);
    // Each option, whether it needs each request's first token reported, and whether one
    // worker's engine reports it busy.
    type With = fn(RouterBuilder, BusyThreshold) -> RouterBuilder;
    let options: [(&str, With, bool, bool); 6] = [
        (
            "prefill-aware",
            |b, _| b.cost_model(CostModel::PrefillAware),
            true,
            false,
        ),
        ("temperature 0.5", |b, _| b.temperature(0.5), false, false),
        ("busy threshold", |b, t| b.busy_threshold(t), true, false),
        (
            "busy threshold, one busy",
            |b, t| b.busy_threshold(t),
            true,
            true,
        ),
        (
            "predicted 50 ms",
            |b, _| b.predicted_ttl(Duration::from_millis(50)),
            false,
            false,
        ),
        (
            "all",
            |b, t| {
                b.cost_model(CostModel::PrefillAware)
                    .temperature(0.5)
                    .busy_threshold(t)
                    .predicted_ttl(Duration::from_millis(50))
            },
            true,
            false,
        ),
    ];
    for &workers in &[64usize, 1_024] {
        for (name, with, first_token, one_busy) in options {
            let (mut router, queries) = fixture_with(workers, with(Router::builder(), busy));
            if one_busy {
                let report = ReportedLoad::new(1, 9, 0.5);
                let w = WorkerId::new(0);
                router.set_reported_load(w, Some(report)).expect("valid");
                assert!(router.explain(&queries[0].blocks, Role::Unified)[0].busy);
            }
            let mut request = 1u64 << 32;
            group.bench_function(BenchmarkId::new(name, format!("{workers} workers")), |b| {
                b.iter(|| {
                    let q = &queries[request as usize % QUERIES];
                    router.set_clock(Duration::from_millis(request - (1 << 32)));
                    let id = RequestId::new(request);
                    let d = router
                        .route(id, black_box(&q.blocks), Role::Unified)
                        .expect("routable");
                    if first_token {
                        router.prefill_done(id).expect("in flight");
                    }
                    router.finish(id).expect("in flight");
                    request += 1;
                    black_box(d)
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, route_only, route, route_tokens, route_model);
criterion_main!(benches);
