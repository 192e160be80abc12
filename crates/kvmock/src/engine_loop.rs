//! One engine on the simulator's engine loop ([`kvsim::EngineLoop`], the one the simulator drives
//! every engine of a fleet through), with the arrival and step-end times supplied by the caller.
//! [`crate::driver`] runs it against the wall clock; a test runs it with the simulator's own times
//! and must get what `kvsim` gets. On top of the loop it keeps what an engine emulator needs:
//!
//! - On an arrival at time `t`, every step ending at or before `t` ends first.
//! - Every request that produced a token in the step (the decoding ones, and the ones whose
//!   prefill ended) gets a [`Note::Token`] stamped with the step's end.
//! - Each flush of the engine's KV events becomes one batch of vLLM events with engine-private
//!   hashes ([`crate::events::engine_block_hash`]) and the blocks' token ids.

use std::collections::HashMap;
use std::sync::Arc;

use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::{FixedState, KvEvent};
use kvroute_vllm::{BlockRemoved, BlockStored, EngineEvent, EngineHash, KeyValue};
use kvserve::keys::RequestKeys;
use kvsim::{Engine, EngineConfig, EngineLoop, EngineRequest, LinearTiming, Outcome, PlannedStep};

use crate::events::engine_block_hash;

/// What happened to a request, stamped with emulated microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    /// Scheduled with this many leading prompt blocks already cached.
    Admitted {
        /// The request.
        id: u64,
        /// Cached leading blocks (engine truth).
        cached_blocks: usize,
        /// Emulated time.
        at_us: u64,
    },
    /// One output token was produced.
    Token {
        /// The request.
        id: u64,
        /// Emulated time.
        at_us: u64,
    },
    /// The last token was produced.
    Finished {
        /// The request.
        id: u64,
        /// Emulated time.
        at_us: u64,
    },
    /// It can never fit the engine's blocks.
    Rejected {
        /// The request.
        id: u64,
    },
}

/// Counters for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    /// Requests running (prefilling or decoding).
    pub running: usize,
    /// Requests waiting to be scheduled.
    pub waiting: usize,
    /// Share of the KV blocks held by running requests (0 when unbounded).
    pub kv_usage: f64,
    /// Prompt tokens of scheduled requests (vLLM's prefix-cache queries).
    pub prefix_queries: u64,
    /// Of those, tokens found cached (vLLM's prefix-cache hits).
    pub prefix_hits: u64,
    /// Requests finished.
    pub finished: u64,
    /// Output tokens produced.
    pub generation_tokens: u64,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: u64,
    /// Blocks resident in the cache.
    pub cached_blocks: usize,
    /// KV events published.
    pub kv_events: u64,
    /// Time to first token in emulated seconds, arrival to the end of prefill: cumulative
    /// counts per bucket of [`TTFT_BUCKETS_S`].
    pub ttft_buckets: [u64; TTFT_BUCKETS_S.len()],
    /// Sum of those times, emulated seconds.
    pub ttft_sum_s: f64,
    /// Requests that produced a first token.
    pub ttft_count: u64,
    /// Time between a request's consecutive output tokens in emulated seconds: cumulative
    /// counts per bucket of [`ITL_BUCKETS_S`].
    pub itl_buckets: [u64; ITL_BUCKETS_S.len()],
    /// Sum of those times, emulated seconds.
    pub itl_sum_s: f64,
    /// Output tokens after a first one.
    pub itl_count: u64,
}

/// Counts `s` into a cumulative histogram over `bounds`.
fn observe(buckets: &mut [u64], bounds: &[f64], sum_s: &mut f64, count: &mut u64, s: f64) {
    *sum_s += s;
    *count += 1;
    for (b, &le) in buckets.iter_mut().zip(bounds) {
        *b += u64::from(s <= le);
    }
}

/// vLLM's buckets of `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS_S: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's buckets of `vllm:inter_token_latency_seconds`.
pub const ITL_BUCKETS_S: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// The LoRA adapter a request runs with, as vLLM's events name it: `name` keys its blocks (in
/// vLLM's block hashes and in a router's), `id` is informational.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lora {
    /// The adapter's name (`--lora-modules NAME=PATH`), the model name requests give.
    pub name: Arc<str>,
    /// vLLM's integer adapter id (1 for the first adapter).
    pub id: i64,
}

/// One resident or referenced block: its engine hash and tokens.
#[derive(Debug)]
struct BlockInfo {
    engine_hash: u64,
    /// Empty unless the engine publishes events (only events need them).
    tokens: Box<[u32]>,
    /// The adapter whose blocks these are (every block of a chain has its first block's).
    lora: Option<Lora>,
    /// The request's `cache_salt`, on a prompt's first block.
    salt: Option<Arc<str>>,
    /// Live requests whose prompt has this block.
    refs: u32,
    resident: bool,
}

#[derive(Debug)]
struct Live {
    blocks: Vec<BlockHash>,
    input_len: usize,
    output_len: usize,
    arrival_us: u64,
    first_token: bool,
    /// When its last token came (emulated), once it has one.
    last_token_us: u64,
}

/// The engine and its bookkeeping, advanced by explicit times.
#[derive(Debug)]
pub struct Core {
    engine: Engine,
    hasher: BlockHasher,
    now_us: u64,
    step_end: Option<u64>,
    blocks: HashMap<BlockHash, BlockInfo, FixedState>,
    live: HashMap<u64, Live, FixedState>,
    outcomes: Vec<Outcome>,
    notes: Vec<Note>,
    batches: Vec<Vec<EngineEvent>>,
    counters: Counters,
    publish: bool,
}

impl Core {
    /// An idle engine; `publish` keeps the KV events as vLLM batches for
    /// [`take_batches`](Self::take_batches).
    pub fn new(cfg: EngineConfig, timing: LinearTiming, publish: bool) -> Self {
        Core {
            engine: Engine::new(cfg, timing),
            hasher: BlockHasher::new(cfg.block_size),
            now_us: 0,
            step_end: None,
            blocks: HashMap::default(),
            live: HashMap::default(),
            outcomes: Vec::new(),
            notes: Vec::new(),
            batches: Vec::new(),
            counters: Counters::default(),
            publish,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> BlockSize {
        self.hasher.block_size()
    }

    /// The engine (read only).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The emulated time of the last event handled.
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// When the step in progress ends, if one is.
    pub fn next_deadline(&self) -> Option<u64> {
        self.step_end
    }

    /// Ends every step that ends at or before `t_us`, and moves the clock to `t_us`.
    pub fn advance_to(&mut self, t_us: u64) {
        while let Some(end) = self.step_end {
            if end > t_us {
                break;
            }
            self.now_us = end;
            self.end_step(0);
            self.refresh_counters();
        }
        self.now_us = self.now_us.max(t_us);
    }

    /// A request arrives at `t_us` (at least the current time) with its prompt `tokens`.
    /// Returns `false` (and a [`Note::Rejected`]) if it can never fit.
    pub fn arrive(&mut self, t_us: u64, id: u64, tokens: &[u32], output_len: usize) -> bool {
        self.arrive_keyed(t_us, id, tokens, output_len, None, None)
    }

    /// [`arrive`](Self::arrive) for LoRA adapter `lora` with vLLM's `cache_salt`, keyed by the
    /// rule the router keys requests by ([`RequestKeys`]): an adapter's blocks are other blocks
    /// than the base model's, and a salted prompt's than an unsalted one's. Their events carry
    /// the adapter's name and id, and each block's extra keys as vLLM writes them (the adapter's
    /// name, then the salt on the prompt's first block).
    pub fn arrive_keyed(
        &mut self,
        t_us: u64,
        id: u64,
        tokens: &[u32],
        output_len: usize,
        lora: Option<&Lora>,
        cache_salt: Option<&str>,
    ) -> bool {
        self.advance_to(t_us);
        let keys = RequestKeys::new(lora.map(|l| &*l.name), cache_salt);
        let blocks = keys.block_hashes(self.block_size(), tokens);
        // The engine's own hash is keyed too (engine-private, like vLLM's).
        let lora_key = keys
            .lora()
            .map_or(0, |l| xxhash_rust::xxh3::xxh3_64(l.as_bytes()));
        let salt_key = keys
            .cache_salt()
            .map_or(0, |s| xxhash_rust::xxh3::xxh3_64_with_seed(s.as_bytes(), 1));
        let salt: Option<Arc<str>> = keys.cache_salt().map(Arc::from);
        let bs = self.block_size().get();
        // Remember each block's engine hash, and its tokens for the events that will name it.
        let publish = self.publish;
        let mut parent = None;
        for (i, &b) in blocks.iter().enumerate() {
            let info = self.blocks.entry(b).or_insert_with(|| {
                let t = &tokens[i * bs..(i + 1) * bs];
                let first = i == 0;
                BlockInfo {
                    engine_hash: engine_block_hash(parent, t)
                        ^ lora_key
                        ^ if first { salt_key } else { 0 },
                    tokens: if publish { t.into() } else { Box::default() },
                    lora: lora.cloned(),
                    salt: salt.clone().filter(|_| first),
                    refs: 0,
                    resident: false,
                }
            });
            info.refs += 1;
            parent = Some(info.engine_hash);
        }
        let req = EngineRequest::new(id, blocks.clone(), tokens.len(), output_len);
        // The request is live before the loop may admit it.
        self.live.insert(
            id,
            Live {
                blocks,
                input_len: tokens.len(),
                output_len,
                arrival_us: self.now_us,
                first_token: false,
                last_token_us: 0,
            },
        );
        if !self.submit(0, req) {
            let blocks = self.live.remove(&id).map(|l| l.blocks).unwrap_or_default();
            self.release_blocks(&blocks);
            self.notes.push(Note::Rejected { id });
            return false;
        }
        self.refresh_counters();
        true
    }

    /// Moves the notes since the last call to `out`.
    pub fn take_notes(&mut self, out: &mut Vec<Note>) {
        out.append(&mut self.notes);
    }

    /// Moves the KV-event batches since the last call to `out`, one per engine flush.
    pub fn take_batches(&mut self, out: &mut Vec<Vec<EngineEvent>>) {
        out.append(&mut self.batches);
    }

    /// The counters for `/metrics`.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    fn handle_outcomes(&mut self) {
        let mut out = std::mem::take(&mut self.outcomes);
        self.engine.take_outcomes(&mut out);
        let at_us = self.now_us;
        let bs = self.block_size().get() as u64;
        for o in out.drain(..) {
            match o {
                Outcome::Admitted { id, cached_blocks } => {
                    if let Some(l) = self.live.get(&id) {
                        self.counters.prefix_queries += l.input_len as u64;
                        self.counters.prefix_hits +=
                            (cached_blocks as u64 * bs).min(l.input_len as u64);
                    }
                    self.notes.push(Note::Admitted {
                        id,
                        cached_blocks,
                        at_us,
                    });
                }
                Outcome::FirstToken { id } => {
                    if let Some(l) = self.live.get_mut(&id) {
                        if !std::mem::replace(&mut l.first_token, true) {
                            let s = at_us.saturating_sub(l.arrival_us) as f64 / 1e6;
                            let c = &mut self.counters;
                            observe(
                                &mut c.ttft_buckets,
                                &TTFT_BUCKETS_S,
                                &mut c.ttft_sum_s,
                                &mut c.ttft_count,
                                s,
                            );
                            l.last_token_us = at_us;
                        }
                    }
                    self.notes.push(Note::Token { id, at_us });
                }
                Outcome::Finished { id } => {
                    if let Some(l) = self.live.remove(&id) {
                        self.counters.finished += 1;
                        self.counters.prompt_tokens += l.input_len as u64;
                        self.counters.generation_tokens += l.output_len as u64;
                        self.release_blocks(&l.blocks);
                    }
                    self.notes.push(Note::Finished { id, at_us });
                }
                _ => {}
            }
        }
        self.outcomes = out;
    }

    fn release_blocks(&mut self, blocks: &[BlockHash]) {
        for b in blocks {
            if let Some(info) = self.blocks.get_mut(b) {
                info.refs = info.refs.saturating_sub(1);
                if info.refs == 0 && !info.resident {
                    self.blocks.remove(b);
                }
            }
        }
    }

    fn flush_events(&mut self) {
        if self.engine.pending_events() == 0 {
            return;
        }
        let events: Vec<KvEvent> = self.engine.drain_events().collect();
        let bs = self.block_size().get() as u64;
        let mut batch = Vec::with_capacity(events.len());
        for ev in events {
            match ev {
                KvEvent::Stored { parent, blocks } => {
                    let mut hashes = Vec::with_capacity(blocks.len());
                    let mut tokens = Vec::with_capacity(blocks.len() * bs as usize);
                    let mut keys = Vec::with_capacity(blocks.len());
                    let mut lora = None;
                    for b in &blocks {
                        if let Some(info) = self.blocks.get_mut(b) {
                            info.resident = true;
                            // Unpublished, an event only keeps the bookkeeping: it is on the
                            // way to every step's first token.
                            if self.publish {
                                hashes.push(EngineHash::Int(info.engine_hash));
                                tokens.extend_from_slice(&info.tokens);
                                lora = lora.or_else(|| info.lora.clone());
                                let k: Vec<KeyValue> = (info.lora.iter().map(|l| &*l.name))
                                    .chain(info.salt.as_deref())
                                    .map(|s| KeyValue::Str(s.to_string()))
                                    .collect();
                                keys.push(Some(k).filter(|k| !k.is_empty()));
                            }
                        }
                    }
                    let parent = parent
                        .and_then(|p| self.blocks.get(&p))
                        .map(|i| EngineHash::Int(i.engine_hash));
                    let mut s = BlockStored::new(hashes, parent, tokens, bs);
                    s.medium = Some("GPU".into());
                    if let Some(l) = lora {
                        // As vLLM's block pool publishes a LoRA request's blocks.
                        s.lora_name = Some(l.name.to_string());
                        s.lora_id = Some(l.id);
                    }
                    if keys.iter().any(Option::is_some) {
                        s.extra_keys = keys;
                    }
                    batch.push(EngineEvent::BlockStored(s));
                }
                KvEvent::Removed { blocks } => {
                    let mut hashes = Vec::with_capacity(blocks.len());
                    for b in &blocks {
                        if let Some(info) = self.blocks.get_mut(b) {
                            info.resident = false;
                            if self.publish {
                                hashes.push(EngineHash::Int(info.engine_hash));
                            }
                            if info.refs == 0 {
                                self.blocks.remove(b);
                            }
                        }
                    }
                    let mut r = BlockRemoved::new(hashes);
                    r.medium = Some("GPU".into());
                    batch.push(EngineEvent::BlockRemoved(r));
                }
                KvEvent::Cleared => {
                    self.blocks.retain(|_, i| {
                        i.resident = false;
                        i.refs > 0
                    });
                    batch.push(EngineEvent::AllBlocksCleared);
                }
            }
        }
        self.counters.kv_events += batch.len() as u64;
        if self.publish && !batch.is_empty() {
            self.batches.push(batch);
        }
    }

    fn refresh_counters(&mut self) {
        let e = &self.engine;
        self.counters.running = e.running();
        self.counters.waiting = e.waiting();
        self.counters.cached_blocks = e.cache().len();
        self.counters.kv_usage = match e.config().kv_blocks {
            Some(total) if total > 0 => {
                (e.cache().pinned_blocks() + e.reserved_blocks()) as f64 / total as f64
            }
            _ => 0.0,
        };
    }
}

/// Events before outcomes: a request that finishes in the step that stored its blocks (one
/// output token) releases them in its outcome, and a block no request holds is forgotten unless
/// the events made it resident.
impl EngineLoop for Core {
    fn engine_mut(&mut self, _e: usize) -> &mut Engine {
        &mut self.engine
    }

    fn on_outcomes(&mut self, _e: usize) {
        self.flush_events();
        self.handle_outcomes();
    }

    fn on_events(&mut self, _e: usize) {
        self.flush_events();
    }

    fn on_step_planned(&mut self, _e: usize, step: PlannedStep) {
        self.step_end = Some(self.now_us.saturating_add(step.duration_us));
    }

    fn on_step_ending(&mut self, _e: usize) {
        // The requests decoding in this step each produced a token.
        let at_us = self.now_us;
        for id in self.engine.decoding_ids() {
            self.notes.push(Note::Token { id, at_us });
            if let Some(l) = self.live.get_mut(&id) {
                let s = at_us.saturating_sub(l.last_token_us) as f64 / 1e6;
                l.last_token_us = at_us;
                let c = &mut self.counters;
                observe(
                    &mut c.itl_buckets,
                    &ITL_BUCKETS_S,
                    &mut c.itl_sum_s,
                    &mut c.itl_count,
                    s,
                );
            }
        }
        self.step_end = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::{Router, WorkerId};
    use kvroute_vllm::VllmIngest;

    fn cfg(kv: Option<usize>) -> EngineConfig {
        let mut c = EngineConfig::new(BlockSize::new(4).unwrap());
        c.kv_blocks = kv;
        c
    }

    fn run(core: &mut Core) -> Vec<Note> {
        while let Some(t) = core.next_deadline() {
            core.advance_to(t);
        }
        let mut notes = Vec::new();
        core.take_notes(&mut notes);
        notes
    }

    /// A router (block size 4) with one worker fed `batches` as kvmock publishes them (map
    /// shape, numbered in order), and each batch's summary.
    fn mirror(
        batches: Vec<Vec<EngineEvent>>,
    ) -> (Router, WorkerId, Vec<kvroute_vllm::IngestSummary>) {
        let mut router = Router::builder()
            .block_size(BlockSize::new(4).unwrap())
            .build()
            .unwrap();
        let w = WorkerId::new(0);
        router.add_worker(w);
        let mut ingest = VllmIngest::new();
        let summaries = batches
            .into_iter()
            .enumerate()
            .map(|(seq, b)| {
                let payload = crate::events::encode_batch(
                    &kvroute_vllm::EventBatch::new(0.0, b),
                    crate::events::WireShape::Map,
                );
                ingest
                    .apply_payload(&mut router, w, Some(seq as u64), &payload)
                    .unwrap()
            })
            .collect();
        (router, w, summaries)
    }

    #[test]
    fn a_request_gets_all_its_tokens_and_a_second_one_hits() {
        let mut core = Core::new(cfg(None), LinearTiming::default(), true);
        let prompt: Vec<u32> = (0..10).collect();
        assert!(core.arrive(0, 1, &prompt, 3));
        let notes = run(&mut core);
        let tokens = notes
            .iter()
            .filter(|n| matches!(n, Note::Token { id: 1, .. }))
            .count();
        assert_eq!(tokens, 3);
        assert!(matches!(notes.last(), Some(Note::Finished { id: 1, .. })));
        let t = core.now_us() + 1_000;
        assert!(core.arrive(t, 2, &prompt, 1));
        let notes = run(&mut core);
        assert!(notes.contains(&Note::Admitted {
            id: 2,
            cached_blocks: 2,
            at_us: t
        }));
    }

    #[test]
    fn published_events_rebuild_the_cache_in_a_router() {
        // A tiny cache, so that blocks are evicted and removals published.
        let mut core = Core::new(cfg(Some(12)), LinearTiming::default(), true);
        let mut t = 0;
        for id in 0..30u64 {
            let prompt: Vec<u32> = (0..16).map(|k| (id % 5) as u32 * 100 + k).collect();
            core.arrive(t, id, &prompt, 2);
            t += 3_000;
        }
        run(&mut core);
        let mut batches = Vec::new();
        core.take_batches(&mut batches);
        let (router, w, summaries) = mirror(batches);
        for s in summaries {
            assert_eq!((s.unknown_parents, s.unknown_removals), (0, 0));
        }
        assert!(core.engine().cache().stats().evictions > 0);
        assert_eq!(router.cache_view(w), core.engine().cache().len());
        // Nothing is left referenced but the resident blocks.
        assert_eq!(core.blocks.len(), core.engine().cache().len());
    }

    #[test]
    fn a_lora_request_keys_its_blocks_by_the_adapter_and_says_so_in_its_events() {
        let mut core = Core::new(cfg(None), LinearTiming::default(), true);
        let prompt: Vec<u32> = (0..8).collect();
        let lora = Lora {
            name: "my-lora".into(),
            id: 1,
        };
        assert!(core.arrive(0, 1, &prompt, 1));
        run(&mut core);
        // The same tokens under the adapter are other blocks: no hit on the base model's.
        let t = core.now_us() + 1_000;
        assert!(core.arrive_keyed(t, 2, &prompt, 1, Some(&lora), None));
        let notes = run(&mut core);
        assert!(notes.contains(&Note::Admitted {
            id: 2,
            cached_blocks: 0,
            at_us: t
        }));
        let t = core.now_us() + 1_000;
        assert!(core.arrive_keyed(t, 3, &prompt, 1, Some(&lora), None));
        let notes = run(&mut core);
        assert!(notes.contains(&Note::Admitted {
            id: 3,
            cached_blocks: 2,
            at_us: t
        }));
        let mut batches = Vec::new();
        core.take_batches(&mut batches);
        let stored: Vec<&BlockStored> = batches
            .iter()
            .flatten()
            .filter_map(|e| match e {
                EngineEvent::BlockStored(s) => Some(s),
                _ => None,
            })
            .collect();
        assert_eq!(stored.len(), 2, "{stored:?}");
        // Each request finished in the step that stored its blocks, and still published them.
        assert!(
            stored.iter().all(|s| s.block_hashes.len() == 2),
            "{stored:?}"
        );
        assert_eq!(
            (stored[0].lora_name.as_deref(), stored[0].lora_id),
            (None, None)
        );
        assert_eq!(stored[1].lora_name.as_deref(), Some("my-lora"));
        assert_eq!(stored[1].lora_id, Some(1));
        let key = Some(vec![KeyValue::Str("my-lora".into())]);
        assert_eq!(stored[1].extra_keys, vec![key.clone(), key]);
        assert_ne!(stored[0].block_hashes, stored[1].block_hashes);
        // A router re-hashing the events finds the adapter's blocks under the adapter's salt.
        let (mut router, _, _) = mirror(batches);
        let salted = router
            .route_tokens_salted(
                kvroute::RequestId::new(9),
                &prompt,
                &kvroute::Salt::lora("my-lora"),
                kvroute::Role::Unified,
            )
            .unwrap();
        assert_eq!(salted.cache_hits, 2);
        router.finish(kvroute::RequestId::new(9)).unwrap();
    }

    #[test]
    fn salted_requests_are_keyed_by_the_routers_rule_and_their_events_say_so() {
        let bs = BlockSize::new(4).unwrap();
        let lora = Lora {
            name: "my-lora".into(),
            id: 1,
        };
        let prompt: Vec<u32> = (0..8).collect();
        // (adapter, salt) of each request, one after the other on one engine.
        let cases = [
            (None, Some("tenant-1")),
            (Some(&lora), Some("tenant-1")),
            (None, Some("tenant-2")),
        ];
        let mut core = Core::new(cfg(None), LinearTiming::default(), true);
        for (id, &(l, salt)) in cases.iter().enumerate() {
            let t = core.now_us() + 1_000;
            assert!(core.arrive_keyed(t, id as u64, &prompt, 1, l, salt));
            let notes = run(&mut core);
            // Each is other blocks than the ones before it.
            assert!(notes.contains(&Note::Admitted {
                id: id as u64,
                cached_blocks: 0,
                at_us: t
            }));
        }
        let mut batches = Vec::new();
        core.take_batches(&mut batches);
        let (mut router, _, _) = mirror(batches);
        // The router, keying requests by the same rule, finds each one's blocks.
        for (id, &(l, salt)) in cases.iter().enumerate() {
            let keys = RequestKeys::new(l.map(|l| &*l.name), salt);
            assert!(core
                .engine()
                .cache()
                .contains(keys.block_hashes(bs, &prompt)[1]));
            let rid = kvroute::RequestId::new(id as u64);
            let extra = keys.extra_keys(bs, prompt.len());
            let d = router
                .route_tokens_keyed(rid, &prompt, &keys.salt(), &extra, kvroute::Role::Unified)
                .unwrap();
            router.finish(rid).unwrap();
            assert_eq!(d.cache_hits, 2, "{keys:?}");
        }
        let unsalted = router
            .route_tokens(kvroute::RequestId::new(9), &prompt, kvroute::Role::Unified)
            .unwrap();
        assert_eq!(unsalted.cache_hits, 0);
    }
}
