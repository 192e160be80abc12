//! Embedding `kvroute` in a third-party router, with std threads and channels only.
//!
//! `cargo run --example embed_router`
//!
//! - One [`Router`] is shared as `Arc<Mutex<Router>>`; every call holds the lock for microseconds.
//! - 4 engine threads each own a capacity-bounded [`BlockCache`]. An engine receives prompts
//!   (block hashes) over its channel, looks them up (the true prefix hit), stores them (evicting
//!   as needed) and publishes the drained [`KvEvent`]s, numbered 0, 1, 2, ... per engine.
//! - 1 event thread applies those events to the router with `apply_event`: the router's view of
//!   each cache lags the engine by however many events are still in the channel.
//! - 2 request threads hash prompts built from shared prefixes (6 system prompts, 3 documents
//!   each, then a question of their own) with `kvblock::BlockHasher`, `route` them, send each to
//!   the chosen engine, wait for it, and `finish` the request.
//!
//! At the end it prints, per worker, the router's cache view next to the engine's true block
//! count (equal once every event is applied), and the share of requests that hit a cached prefix.
//! Prompts are deterministic; which worker serves which request depends a little on how the
//! threads interleave, so the counts can vary slightly from run to run.

use std::error::Error;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;

use kvkit::kvblock::{BlockHash, BlockHasher, BlockSize};
use kvkit::kvcache::{BlockCache, KvEvent, WorkerId};
use kvkit::kvroute::{Policy, RequestId, Role, Router};
use kvtest::splitmix;

const WORKERS: u64 = 4;
/// Blocks each engine can hold: enough for the hot prefixes, not for every question.
const CAPACITY: usize = 160;
const REQUEST_THREADS: u64 = 2;
const REQUESTS_PER_THREAD: u64 = 200;
const BLOCK_SIZE: usize = 16;
const SYSTEM_PROMPTS: u64 = 6;
const SYSTEM_BLOCKS: usize = 16;
const DOCS_PER_SYSTEM: u64 = 3;
const DOC_BLOCKS: usize = 8;
/// Decisions of the first request thread shown one by one.
const SHOWN: usize = 6;

/// A prompt sent to an engine; the engine replies with the leading run it already held.
struct Job {
    blocks: Vec<BlockHash>,
    reply: Sender<usize>,
}

/// One KV event as an engine publishes it.
struct Published {
    worker: WorkerId,
    event_id: u64,
    event: KvEvent,
}

/// What an engine thread reports when its job channel closes.
struct EngineReport {
    worker: WorkerId,
    served: u64,
    blocks: usize,
    events: u64,
    evictions: u64,
}

/// One routed request, as a request thread saw it.
struct Outcome {
    request_id: u64,
    system: u64,
    doc: u64,
    worker: WorkerId,
    blocks: usize,
    /// The leading run the router believed the worker held.
    expected: usize,
    /// The leading run the engine actually held.
    found: usize,
}

/// Locks the router. A thread that panicked while holding the lock is reported when it is
/// joined; the others carry on instead of panicking in turn.
fn lock(router: &Mutex<Router>) -> MutexGuard<'_, Router> {
    router.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `n` stand-in token ids named by `tag` (a tokenizer's output in a real router).
fn tokens(tag: u64, n: usize) -> Vec<u32> {
    let mut rng = splitmix::Rng(tag);
    (0..n).map(|_| (rng.next_u64() % 50_000) as u32).collect()
}

/// An engine: serves jobs until every request thread is done, publishing its cache's events.
fn engine(
    worker: WorkerId,
    jobs: Receiver<Job>,
    events: Sender<Published>,
) -> Result<EngineReport, String> {
    let mut cache = BlockCache::new(Some(CAPACITY));
    let mut next_event = 0u64;
    let mut served = 0u64;
    for job in jobs {
        let found = cache.lookup(&job.blocks);
        cache
            .insert(&job.blocks)
            .map_err(|e| format!("{worker}: {e}"))?;
        for event in cache.drain_events() {
            let published = Published {
                worker,
                event_id: next_event,
                event,
            };
            events
                .send(published)
                .map_err(|_| format!("{worker}: the event thread is gone"))?;
            next_event += 1;
        }
        served += 1;
        // A request thread that stopped waiting has already failed; nothing to tell it.
        let _ = job.reply.send(found);
    }
    Ok(EngineReport {
        worker,
        served,
        blocks: cache.len(),
        events: next_event,
        evictions: cache.stats().evictions,
    })
}

/// The event subscriber: applies every published event to the shared router, in arrival order
/// (which is each engine's own order). Returns how many were applied.
fn subscriber(router: Arc<Mutex<Router>>, events: Receiver<Published>) -> Result<u64, String> {
    let mut applied = 0;
    for p in events {
        lock(&router)
            .apply_event(p.worker, p.event_id, &p.event)
            .map_err(|e| format!("event {} of {}: {e}", p.event_id, p.worker))?;
        applied += 1;
    }
    Ok(applied)
}

/// A request thread: builds prompts from shared prefixes, routes them, waits, finishes them.
fn requests(
    thread_no: u64,
    router: Arc<Mutex<Router>>,
    engines: Vec<Sender<Job>>,
    hasher: BlockHasher,
) -> Result<Vec<Outcome>, String> {
    let mut rng = splitmix::Rng(thread_no + 1);
    let (reply, replies) = channel();
    let mut outcomes = Vec::new();
    for i in 0..REQUESTS_PER_THREAD {
        let request_id = thread_no * 1_000_000 + i;
        // Popular system prompts and documents come up more often (the lower of two draws).
        let system = rng.below(SYSTEM_PROMPTS).min(rng.below(SYSTEM_PROMPTS));
        let doc = rng.below(DOCS_PER_SYSTEM).min(rng.below(DOCS_PER_SYSTEM));
        let question_tokens = (2 + rng.below(4) as usize) * BLOCK_SIZE + rng.below(8) as usize;
        let mut prompt = tokens(system, SYSTEM_BLOCKS * BLOCK_SIZE);
        prompt.extend(tokens(100 + system * 10 + doc, DOC_BLOCKS * BLOCK_SIZE));
        prompt.extend(tokens(rng.next_u64(), question_tokens));
        // Full blocks only: the partial tail is not cacheable.
        let blocks = hasher.sequence_hashes(&prompt);

        let decision = lock(&router)
            .route(RequestId::new(request_id), &blocks, Role::Unified)
            .map_err(|e| format!("request {request_id}: {e}"))?;
        let engine = usize::try_from(decision.worker.get())
            .ok()
            .and_then(|w| engines.get(w))
            .ok_or_else(|| format!("request {request_id}: no engine for {}", decision.worker))?;
        let n = blocks.len();
        engine
            .send(Job {
                blocks,
                reply: reply.clone(),
            })
            .map_err(|_| format!("{} is gone", decision.worker))?;
        let found = replies
            .recv()
            .map_err(|_| format!("{} dropped request {request_id}", decision.worker))?;
        lock(&router)
            .finish(RequestId::new(request_id))
            .map_err(|e| format!("request {request_id}: {e}"))?;
        outcomes.push(Outcome {
            request_id,
            system,
            doc,
            worker: decision.worker,
            blocks: n,
            expected: decision.cache_hits,
            found,
        });
    }
    Ok(outcomes)
}

/// Joins a thread, turning a panic or an error into this example's error.
fn join<T>(handle: thread::JoinHandle<Result<T, String>>, what: &str) -> Result<T, Box<dyn Error>> {
    match handle.join() {
        Ok(result) => Ok(result?),
        Err(_) => Err(format!("the {what} thread panicked").into()),
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let block_size = BlockSize::new(BLOCK_SIZE)?;
    let mut router = Router::builder()
        .block_size(block_size)
        .policy(Policy::Kv)
        .overlap_weight(1.0)
        .seed(7)
        .build()?;
    for w in 0..WORKERS {
        router.add_worker(WorkerId::new(w));
    }
    let router = Arc::new(Mutex::new(router));
    let hasher = BlockHasher::new(block_size);

    let (event_tx, event_rx) = channel();
    let subscriber_thread = {
        let router = Arc::clone(&router);
        thread::spawn(move || subscriber(router, event_rx))
    };
    let mut job_txs = Vec::new();
    let mut engine_threads = Vec::new();
    for w in 0..WORKERS {
        let (job_tx, job_rx) = channel();
        let events = event_tx.clone();
        job_txs.push(job_tx);
        engine_threads.push(thread::spawn(move || {
            engine(WorkerId::new(w), job_rx, events)
        }));
    }
    // The engines hold the only event senders now: the subscriber stops after their last event.
    drop(event_tx);

    let request_threads: Vec<_> = (0..REQUEST_THREADS)
        .map(|t| {
            let router = Arc::clone(&router);
            let engines = job_txs.clone();
            thread::spawn(move || requests(t, router, engines, hasher))
        })
        .collect();
    // Likewise the request threads hold the only job senders: engines stop when they are done.
    drop(job_txs);

    let mut outcomes = Vec::new();
    for handle in request_threads {
        outcomes.extend(join(handle, "request")?);
    }
    let mut reports = Vec::new();
    for handle in engine_threads {
        reports.push(join(handle, "engine")?);
    }
    let applied = join(subscriber_thread, "event")?;

    println!(
        "{WORKERS} engines ({CAPACITY} blocks each), {REQUEST_THREADS} request threads x \
         {REQUESTS_PER_THREAD} prompts, block size {BLOCK_SIZE}, {applied} events applied"
    );
    println!();
    println!("first requests of thread 0:");
    for o in outcomes.iter().take(SHOWN) {
        println!(
            "  request {:>3}: system {} doc {}, {:>2} blocks -> {} (router expected {:>2} cached, engine had {:>2})",
            o.request_id, o.system, o.doc, o.blocks, o.worker, o.expected, o.found
        );
    }
    println!();
    println!("worker     requests  router view  engine blocks  events  evictions");
    let router = lock(&router);
    for r in &reports {
        let view = router.cache_view(r.worker);
        println!(
            "{:<10} {:>8}  {view:>11}  {:>13}  {:>6}  {:>9}{}",
            r.worker.to_string(),
            r.served,
            r.blocks,
            r.events,
            r.evictions,
            if view == r.blocks { "" } else { "  (lagging)" }
        );
    }
    println!();

    let total = outcomes.len();
    let expected = outcomes.iter().filter(|o| o.expected > 0).count();
    let found = outcomes.iter().filter(|o| o.found > 0).count();
    let blocks: usize = outcomes.iter().map(|o| o.blocks).sum();
    let reused: usize = outcomes.iter().map(|o| o.found).sum();
    let exact = outcomes.iter().filter(|o| o.expected == o.found).count();
    let pct = |n: usize, d: usize| 100.0 * n as f64 / d.max(1) as f64;
    println!(
        "requests that hit a cached prefix: {found} of {total} ({:.1}%) on the engines, \
         {expected} ({:.1}%) as the router expected",
        pct(found, total),
        pct(expected, total)
    );
    println!(
        "prompt blocks served from cache: {reused} of {blocks} ({:.1}%); the router's expected \
         hit was exact for {exact} requests ({:.1}%)",
        pct(reused, blocks),
        pct(exact, total)
    );
    Ok(())
}
