//! One engine's state machine: admission, continuous-batching step planning, the block cache
//! and the KV events it emits. It knows nothing about an event queue or a clock: the caller
//! asks it to plan a step, tells it when the step is over, and reads what happened. The
//! discrete-event simulator drives it with simulated time; an emulator can drive the very same
//! code with a wall clock.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use kvblock::{BlockHash, BlockSize};
use kvcache::{BlockCache, KvEvent, SlotId};
use serde::Serialize;

use crate::timing::{StepShape, TimingModel};

/// What an engine does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Pool {
    /// Prefill and decode (the default fleet).
    Unified,
    /// Prefill only; the KV then moves to a decode engine.
    Prefill,
    /// Decode only, from KV that arrived from a prefill engine.
    Decode,
}

impl Pool {
    /// The name reports use: `unified`, `prefill` or `decode`.
    pub fn name(self) -> &'static str {
        match self {
            Pool::Unified => "unified",
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so report tables can align the name.
        f.pad(self.name())
    }
}

/// How an engine allocates a request's KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum KvAllocation {
    /// At admission, every block the request will ever need (prompt and output): it never
    /// waits for memory once running, but memory sits reserved and unused.
    #[default]
    Reserve,
    /// As vLLM: the prompt's blocks at admission, then one block whenever a decoding request's
    /// context crosses a block boundary. When no block is free (nothing evictable), the newest
    /// running request is preempted: it gives back its blocks and pins and goes back to the
    /// front of the queue; when scheduled again it recomputes its prompt and the tokens it had
    /// produced (less what is still cached) as one prefill, then decodes the rest.
    Incremental,
}

impl KvAllocation {
    /// The name the CLI uses: `reserve` or `incremental`.
    pub fn name(self) -> &'static str {
        match self {
            KvAllocation::Reserve => "reserve",
            KvAllocation::Incremental => "incremental",
        }
    }
}

impl std::fmt::Display for KvAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvAllocation {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, crate::Error> {
        match s {
            "reserve" => Ok(KvAllocation::Reserve),
            "incremental" => Ok(KvAllocation::Incremental),
            _ => Err(crate::Error::invalid(
                "kv_allocation",
                s,
                "reserve or incremental",
            )),
        }
    }
}

/// How an engine schedules a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Scheduler {
    /// kvsim's own (the default, and what every report so far used): waiting requests are
    /// admitted at a step's start whenever a sequence slot and their KV blocks are free,
    /// whatever the token budget; a full prompt hit recomputes only the last token.
    #[default]
    Kvsim,
    /// As vLLM V1's scheduler (`vllm/v1/core/sched/scheduler.py`, `schedule()`), with
    /// incremental allocation: running requests first, each decode one token of the budget and
    /// a partial prefill what the budget leaves, its chunk's blocks allocated as it is
    /// scheduled (the newest running request preempted when none is free); then, only if no
    /// request was preempted in this step, waiting requests in order while the budget,
    /// `max_num_seqs` and free blocks allow, each with a first chunk in this same step. A
    /// cached prefix counts in whole blocks up to the prompt length less one token
    /// (`get_computed_blocks` in `vllm/v1/core/kv_cache_manager.py`).
    Vllm,
}

impl Scheduler {
    /// The name the CLI uses: `kvsim` or `vllm`.
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Kvsim => "kvsim",
            Scheduler::Vllm => "vllm",
        }
    }
}

impl std::fmt::Display for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Scheduler {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, crate::Error> {
        match s {
            "kvsim" => Ok(Scheduler::Kvsim),
            "vllm" => Ok(Scheduler::Vllm),
            _ => Err(crate::Error::invalid("scheduler", s, "kvsim or vllm")),
        }
    }
}

/// The settings of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineConfig {
    /// What the engine does with a request.
    pub pool: Pool,
    /// Tokens per KV block.
    pub block_size: BlockSize,
    /// KV blocks in all, the cache and running requests together; `None` is unbounded.
    pub kv_blocks: Option<usize>,
    /// Token budget of one step: prefill chunks plus one token per decoding request.
    pub max_batched_tokens: usize,
    /// Running requests at most.
    pub max_num_seqs: usize,
    /// Blocks of a host tier that the device's evictions are demoted to (`None`: none).
    pub host_kv_blocks: Option<usize>,
    /// Nanoseconds to load one block from the host tier back to the device; the load stalls
    /// the step that starts after the admission.
    pub host_load_ns_per_block: u64,
    /// Reserve a request's blocks at admission, or allocate as it decodes and preempt.
    pub kv_allocation: KvAllocation,
    /// How steps are scheduled ([`Scheduler::Vllm`] allocates incrementally whatever
    /// `kv_allocation` says).
    pub scheduler: Scheduler,
}

impl EngineConfig {
    /// A unified engine with unbounded KV blocks, a step budget of 8,192 tokens and at most 256
    /// running requests (the simulator's defaults).
    pub fn new(block_size: BlockSize) -> Self {
        EngineConfig {
            pool: Pool::Unified,
            block_size,
            kv_blocks: None,
            max_batched_tokens: 8192,
            max_num_seqs: 256,
            host_kv_blocks: None,
            host_load_ns_per_block: 0,
            kv_allocation: KvAllocation::Reserve,
            scheduler: Scheduler::Kvsim,
        }
    }

    /// Whether steps follow vLLM V1's rules: [`Scheduler::Vllm`] on an engine that prefills
    /// (a decode engine receives whole prompts and is scheduled as before).
    fn vllm(&self) -> bool {
        self.scheduler == Scheduler::Vllm && self.pool != Pool::Decode
    }

    /// Whether blocks are allocated as requests go (incremental allocation or vLLM's rules).
    fn incremental(&self) -> bool {
        self.kv_allocation == KvAllocation::Incremental || self.scheduler == Scheduler::Vllm
    }
}

/// A request handed to an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineRequest {
    /// The caller's id, echoed in every [`Outcome`]; among requests finishing in the same step,
    /// lower ids finish first.
    pub id: u64,
    /// Hashes of the prompt's full blocks.
    pub blocks: Vec<BlockHash>,
    /// Prompt tokens.
    pub input_len: usize,
    /// Output tokens.
    pub output_len: usize,
}

impl EngineRequest {
    /// A request with its prompt's full-block hashes and its lengths.
    pub fn new(id: u64, blocks: Vec<BlockHash>, input_len: usize, output_len: usize) -> Self {
        EngineRequest {
            id,
            blocks,
            input_len,
            output_len,
        }
    }
}

/// What happened to a request, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Scheduled: its leading `cached_blocks` were resident (and are now pinned), the rest of
    /// its blocks reserved. On a decode engine, the KV has arrived and decoding starts.
    Admitted {
        /// The request.
        id: u64,
        /// Leading prompt blocks resident when it was scheduled (engine truth).
        cached_blocks: usize,
    },
    /// Its first output token was produced: the end of its prefill, or (on a decode engine) its
    /// admission.
    FirstToken {
        /// The request.
        id: u64,
    },
    /// A prefill engine computed its prompt, stored it and let go of it: its KV can move to a
    /// decode engine.
    PrefillDone {
        /// The request.
        id: u64,
        /// Its prompt's blocks, handed back for the decode side.
        blocks: Vec<BlockHash>,
    },
    /// At admission, the blocks after its resident run that the host tier held: loaded back
    /// instead of recomputed (only with a host tier).
    HostLoaded {
        /// The request.
        id: u64,
        /// How many blocks.
        blocks: usize,
    },
    /// Preempted under KV pressure (incremental allocation): back to the front of the queue,
    /// to recompute what it lost when scheduled again.
    Preempted {
        /// The request.
        id: u64,
    },
    /// Its last token was produced; it has left the engine.
    Finished {
        /// The request.
        id: u64,
    },
}

/// A step the engine has started: what it computes and how long that takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlannedStep {
    /// The work of the step.
    pub shape: StepShape,
    /// Its duration by the engine's timing model, at least 1 µs.
    pub duration_us: u64,
}

/// One request on the engine.
#[derive(Debug, Clone)]
struct Running {
    id: u64,
    blocks: Vec<BlockHash>,
    input: usize,
    output: usize,
    /// Blocks it occupies on this engine (prompt and, unless a prefill engine, output).
    mem_blocks: usize,
    /// Blocks counted for it in the engine's `private` (bounded engines): reserved at
    /// admission, less the prompt blocks that moved into the cache, plus blocks grown since.
    alloc: usize,
    /// Scheduled (prefilling or decoding), not waiting.
    scheduled: bool,
    /// Admission order (the newest scheduled request is preempted first).
    seq: u64,
    /// Its first token has been produced (a re-admission after preemption does not repeat it).
    first_done: bool,
    /// Step count when it started decoding, the step that produces its last token, and the
    /// step count at whose next plan it needs another block (incremental allocation).
    decode_start: u64,
    finish_at: u64,
    next_grow: u64,
    hits: usize,
    prefill_left: usize,
    decoding: bool,
    /// Cache slots of its blocks, in chain order: its leading cached run from admission, the
    /// whole prompt once stored, none after a store the cache refused. Releasing its chain
    /// finds the blocks through them without hashing (the release is the chain's either way).
    held: Vec<SlotId>,
}

/// One engine replica: continuous batching with chunked prefill over a real
/// [`kvcache::BlockCache`].
///
/// - **Admission** is first come, first served: the head of the queue is scheduled when fewer
///   than `max_num_seqs` requests run and its blocks fit: the leading run already resident is
///   pinned, the rest reserved (prompt, and output unless a prefill engine). A request that can
///   never fit is refused by [`submit`](Self::submit).
/// - **A step** combines one decode token per decoding request with prefill chunks of the
///   scheduled requests, in order, under `max_batched_tokens`. Prefill costs only the uncached
///   tokens (a full hit still computes the last prompt token, to produce the first output
///   token).
/// - **The cache** stores a prompt's blocks when its prefill is done; they stay, evictable,
///   after the request finishes. Every store and eviction is a [`KvEvent`] for the router.
///
/// ```
/// use kvblock::{BlockHasher, BlockSize};
/// use kvsim::{Engine, EngineConfig, EngineRequest, LinearTiming, Outcome};
///
/// let bs = BlockSize::new(16)?;
/// let mut engine = Engine::new(EngineConfig::new(bs), LinearTiming::default());
/// let tokens: Vec<u32> = (0..64).collect();
/// let blocks = BlockHasher::new(bs).sequence_hashes(&tokens);
/// assert!(engine.submit(EngineRequest::new(7, blocks, 64, 3)));
///
/// // Drive it: plan a step, let its time pass (here: not at all), report it done.
/// let mut outcomes = Vec::new();
/// engine.admit();
/// while let Some(step) = engine.plan_step() {
///     assert!(step.duration_us > 0);
///     engine.finish_step();
///     engine.admit();
/// }
/// engine.take_outcomes(&mut outcomes);
/// assert_eq!(outcomes, [
///     Outcome::Admitted { id: 7, cached_blocks: 0 },
///     Outcome::FirstToken { id: 7 },
///     Outcome::Finished { id: 7 },
/// ]);
/// assert_eq!(engine.cache().len(), 4); // the prompt's blocks stay cached
/// assert_eq!(engine.drain_events().len(), 1); // one Stored event for the router
/// # Ok::<(), kvblock::Error>(())
/// ```
#[derive(Clone)]
pub struct Engine {
    cfg: EngineConfig,
    timing: Arc<dyn TimingModel>,
    cache: BlockCache,
    /// Blocks held by running requests outside the cache (their unique and output blocks).
    private: usize,
    slots: Vec<Option<Running>>,
    free: Vec<usize>,
    waiting: VecDeque<usize>,
    prefilling: VecDeque<usize>,
    decoding: usize,
    context: u64,
    /// (step at which it produces its last token, id, slot): ids break ties, so the order does
    /// not depend on slot reuse.
    finishing: BinaryHeap<Reverse<(u64, u64, usize)>>,
    steps: u64,
    /// Incremental allocation: (step count at whose next plan it needs a block, id, slot) of
    /// decoding requests; entries a preemption or finish made stale are skipped.
    grow: BinaryHeap<Reverse<(u64, u64, usize)>>,
    admissions: u64,
    preemptions: u64,
    recomputed_tokens: u64,
    busy: bool,
    chunks: Vec<(usize, usize)>,
    step_decode: usize,
    busy_us: u64,
    inconsistent_inserts: u64,
    outcomes: Vec<Outcome>,
    /// The last [`admit`](Self::admit) left requests waiting, and nothing that could let the
    /// head in has happened since (memory and the running count change only at step ends).
    blocked: bool,
    /// Duration of the step in progress (or the last one).
    last_duration: u64,
    /// Durations of the quiet steps after the one in progress, computed ahead:
    /// `ahead[ahead_pos + i]` is the duration of step `ahead_first + i` (the entries before
    /// `ahead_pos` are used up). Valid while the decoding set is unchanged.
    ahead: Vec<u64>,
    ahead_pos: usize,
    ahead_first: u64,
    /// Nanoseconds of host-tier loads the next step waits for.
    load_ns: u64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("cfg", &self.cfg)
            .field("cached_blocks", &self.cache.len())
            .field("waiting", &self.waiting.len())
            .field("running", &self.running())
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(cfg: EngineConfig, timing: impl TimingModel + 'static) -> Self {
        Self::with_shared_timing(cfg, Arc::new(timing))
    }

    /// [`new`](Self::new) with a timing model shared by several engines.
    pub fn with_shared_timing(cfg: EngineConfig, timing: Arc<dyn TimingModel>) -> Self {
        Engine {
            cfg,
            timing,
            // The capacity follows what running requests hold privately, once they exist.
            cache: match cfg.host_kv_blocks {
                Some(h) if cfg.pool != Pool::Decode => BlockCache::new(None).with_host_tier(h),
                _ => BlockCache::new(None),
            },
            load_ns: 0,
            private: 0,
            slots: Vec::new(),
            free: Vec::new(),
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            decoding: 0,
            context: 0,
            finishing: BinaryHeap::new(),
            steps: 0,
            grow: BinaryHeap::new(),
            admissions: 0,
            preemptions: 0,
            recomputed_tokens: 0,
            busy: false,
            chunks: Vec::new(),
            step_decode: 0,
            busy_us: 0,
            inconsistent_inserts: 0,
            outcomes: Vec::new(),
            blocked: false,
            last_duration: 0,
            ahead: Vec::new(),
            ahead_pos: 0,
            ahead_first: 0,
        }
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The engine's block cache.
    pub fn cache(&self) -> &BlockCache {
        &self.cache
    }

    /// Whether a step is in progress (planned and not yet finished).
    pub fn is_busy(&self) -> bool {
        self.busy
    }

    /// Whether nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running() == 0
    }

    /// Requests waiting to be scheduled.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Scheduled requests: prefilling or decoding.
    pub fn running(&self) -> usize {
        self.prefilling.len() + self.decoding
    }

    /// Blocks running requests hold outside the cache (reserved for their uncached prompt
    /// blocks and their output).
    pub fn reserved_blocks(&self) -> usize {
        self.private
    }

    /// Steps finished so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Microseconds of all steps planned so far.
    pub fn busy_us(&self) -> u64 {
        self.busy_us
    }

    /// Requests preempted so far (incremental allocation).
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Prefill tokens computed by requests scheduled again after a preemption: their prompt
    /// and the tokens they had produced, less what was still cached.
    pub fn recomputed_tokens(&self) -> u64 {
        self.recomputed_tokens
    }

    /// Prompt stores the cache refused as inconsistent with what it holds (0 unless two
    /// prompts disagree about a block's parent).
    pub fn inconsistent_inserts(&self) -> u64 {
        self.inconsistent_inserts
    }

    /// Blocks a request of these lengths occupies on this engine: its prompt and (unless this
    /// is a prefill engine) its output.
    pub fn blocks_needed(&self, input_len: usize, output_len: usize) -> usize {
        let tokens = match self.cfg.pool {
            Pool::Prefill => input_len,
            _ => input_len + output_len,
        };
        self.cfg.block_size.blocks_for(tokens)
    }

    /// Queues a request; `false` (and nothing changed) when it can never fit, because it needs
    /// more blocks than the engine has.
    pub fn submit(&mut self, req: EngineRequest) -> bool {
        let mem_blocks = self.blocks_needed(req.input_len, req.output_len);
        if self.cfg.kv_blocks.is_some_and(|t| mem_blocks > t) {
            return false;
        }
        let run = Running {
            id: req.id,
            blocks: req.blocks,
            input: req.input_len,
            output: req.output_len,
            mem_blocks,
            alloc: 0,
            scheduled: false,
            seq: 0,
            first_done: false,
            decode_start: 0,
            finish_at: 0,
            next_grow: 0,
            hits: 0,
            prefill_left: req.input_len,
            decoding: false,
            held: Vec::new(),
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s] = Some(run);
                s
            }
            None => {
                self.slots.push(Some(run));
                self.slots.len() - 1
            }
        };
        if self.waiting.is_empty() {
            self.blocked = false;
        }
        self.waiting.push_back(slot);
        true
    }

    /// Schedules waiting requests, first come first served, while the head fits. Under
    /// [`Scheduler::Vllm`] admission is part of [`plan_step`](Self::plan_step) (it depends on
    /// the step's budget), and this does nothing.
    pub fn admit(&mut self) {
        if self.cfg.vllm() {
            return;
        }
        while let Some(&s) = self.waiting.front() {
            if self.running() >= self.cfg.max_num_seqs || !self.admit_one(s) {
                break;
            }
            self.waiting.pop_front();
        }
        self.blocked = !self.waiting.is_empty();
    }

    /// Starts the next step, if anything is scheduled: prefill chunks under the token budget
    /// and one decode token per decoding request.
    pub fn plan_step(&mut self) -> Option<PlannedStep> {
        if self.cfg.vllm() {
            return self.plan_step_vllm();
        }
        if !self.grow.is_empty() {
            self.grow_blocks();
        }
        if self.prefilling.is_empty() && self.decoding == 0 {
            return None;
        }
        let mut budget = self.cfg.max_batched_tokens.saturating_sub(self.decoding);
        let mut prefill_tokens = 0;
        self.chunks.clear();
        for &s in &self.prefilling {
            if budget == 0 {
                break;
            }
            let Some(r) = &self.slots[s] else { continue };
            let chunk = r.prefill_left.min(budget);
            self.chunks.push((s, chunk));
            budget -= chunk;
            prefill_tokens += chunk;
        }
        Some(self.start_step(prefill_tokens))
    }

    /// [`plan_step`](Self::plan_step) under [`Scheduler::Vllm`]: decodes' blocks (which may
    /// preempt), then running prefills in admission order with their chunks' blocks, then
    /// waiting requests while the budget, the sequence slots and free blocks allow.
    fn plan_step_vllm(&mut self) -> Option<PlannedStep> {
        let before = self.preemptions;
        if !self.grow.is_empty() {
            self.grow_blocks();
        }
        // Each decode takes one token of the budget (vLLM requires max_num_seqs <=
        // max_num_batched_tokens, so decodes alone never exceed it).
        let mut budget = self.cfg.max_batched_tokens.saturating_sub(self.decoding);
        let mut prefill_tokens = 0;
        self.chunks.clear();
        let mut i = 0;
        while i < self.prefilling.len() && budget > 0 {
            let s = self.prefilling[i];
            let Some(r) = &self.slots[s] else {
                i += 1;
                continue;
            };
            let chunk = r.prefill_left.min(budget);
            // Preempting makes room from the newest request back; if that reaches this one, it
            // and every newer one are waiting again and the step schedules no more.
            if !self.allocate_chunk(s, chunk) {
                break;
            }
            self.chunks.push((s, chunk));
            budget -= chunk;
            prefill_tokens += chunk;
            i += 1;
        }
        // vLLM admits nothing in a step that preempted (unless nothing else runs: an empty
        // step would only come back here).
        let idle = self.chunks.is_empty() && self.decoding == 0;
        let admits = self.preemptions == before || idle;
        if admits {
            while budget > 0 && self.running() < self.cfg.max_num_seqs {
                let Some(&s) = self.waiting.front() else {
                    break;
                };
                let Some(chunk) = self.admit_vllm(s, budget) else {
                    break;
                };
                self.waiting.pop_front();
                self.chunks.push((s, chunk));
                budget -= chunk;
                prefill_tokens += chunk;
            }
        }
        // Blocked only if the head was tried and did not fit: after a step that preempted, the
        // next one tries again (so it is not a quiet step).
        self.blocked = admits && !self.waiting.is_empty();
        if self.chunks.is_empty() && self.decoding == 0 {
            return None;
        }
        Some(self.start_step(prefill_tokens))
    }

    /// Allocates the blocks request `s` needs to compute `chunk` more prompt tokens,
    /// preempting the newest scheduled request while none is free; false when `s` itself was
    /// preempted.
    fn allocate_chunk(&mut self, s: usize, chunk: usize) -> bool {
        let Some(r) = self.slots[s].as_ref() else {
            return false;
        };
        if self.cfg.kv_blocks.is_none() {
            return true;
        }
        let computed = r.input - r.prefill_left;
        let need = self
            .cfg
            .block_size
            .blocks_for(computed + chunk)
            .saturating_sub(r.hits + r.alloc);
        loop {
            if resize(&mut self.cache, self.cfg.kv_blocks, self.private + need) {
                self.private += need;
                if let Some(r) = self.slots[s].as_mut() {
                    r.alloc += need;
                }
                return true;
            }
            let Some(v) = self.newest_scheduled() else {
                return false;
            };
            self.preempt(v);
            if v == s {
                return false;
            }
        }
    }

    /// The slot of the scheduled request admitted last.
    fn newest_scheduled(&self) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().filter(|r| r.scheduled).map(|r| (r.seq, i)))
            .max()
            .map(|(_, i)| i)
    }

    /// Admits waiting request `s` under [`Scheduler::Vllm`] with a first chunk of at most
    /// `budget` tokens, if the blocks of its cached run and of that chunk fit: the chunk's
    /// size, or `None` (nothing changed).
    fn admit_vllm(&mut self, s: usize, budget: usize) -> Option<usize> {
        let bs = self.cfg.block_size.get();
        let r = self.slots[s].as_mut()?;
        // A cached prefix counts in whole blocks, at most the prompt less its last token
        // (which is computed again for the first output token's logits).
        let cap = (r.input.saturating_sub(1) / bs).min(r.blocks.len());
        r.held.clear();
        let hits = self.cache.pin_into(&r.blocks[..cap], &mut r.held);
        let host_run = if r.first_done {
            0
        } else {
            self.cache.take_host_run(&r.blocks[..cap], hits)
        };
        let cached = (hits + host_run) * bs;
        let chunk = (r.input - cached).min(budget);
        let need = self.cfg.block_size.blocks_for(cached + chunk) - hits;
        if !resize(&mut self.cache, self.cfg.kv_blocks, self.private + need) {
            let r = self.slots[s].as_mut()?;
            self.cache.unpin_slots(&r.blocks[..hits], &r.held);
            r.held.clear();
            return None;
        }
        let bounded = self.cfg.kv_blocks.is_some();
        if bounded {
            self.private += need;
        }
        let r = self.slots[s].as_mut()?;
        let id = r.id;
        r.hits = hits;
        r.alloc = if bounded { need } else { 0 };
        r.scheduled = true;
        self.admissions += 1;
        r.seq = self.admissions;
        r.prefill_left = r.input - cached;
        self.prefilling.push_back(s);
        if r.first_done {
            // Resumed after a preemption: it recomputes what it lost, as a prefill.
            self.recomputed_tokens += r.prefill_left as u64;
            return Some(chunk);
        }
        self.outcomes.push(Outcome::Admitted {
            id,
            cached_blocks: hits,
        });
        if host_run > 0 {
            self.load_ns = self
                .load_ns
                .saturating_add((host_run as u64).saturating_mul(self.cfg.host_load_ns_per_block));
            self.outcomes.push(Outcome::HostLoaded {
                id,
                blocks: host_run,
            });
        }
        Some(chunk)
    }

    /// Starts the step whose prefill chunks are planned: its shape and duration.
    fn start_step(&mut self, prefill_tokens: usize) -> PlannedStep {
        self.step_decode = self.decoding;
        let shape = StepShape::new(prefill_tokens as u64, self.decoding as u64, self.context);
        // Host-tier loads of the requests just admitted stall this step.
        let load_us = std::mem::take(&mut self.load_ns).div_ceil(1000);
        let duration_us = self.timing.step_us(&shape).max(1).saturating_add(load_us);
        self.busy = true;
        self.busy_us += duration_us;
        self.last_duration = duration_us;
        PlannedStep { shape, duration_us }
    }

    /// Ids of the requests that produce a decode token in the step in progress.
    pub fn decoding_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots
            .iter()
            .flatten()
            .filter(|r| r.decoding)
            .map(|r| r.id)
    }

    /// Quiet steps, counting the one in progress: pure decode steps after whose end nothing
    /// but the step count and the context change (no prefill chunk, no request's last token,
    /// nothing waiting that could be scheduled). Such steps can be run back to back with
    /// [`skip_quiet_steps`](Self::skip_quiet_steps) instead of one by one; the step after the
    /// last quiet one is planned like any other and may change something at its end. 0 when
    /// no step is in progress or it is not quiet. Valid until the next call that changes the
    /// engine ([`submit`](Self::submit) included).
    pub fn quiet_steps(&self) -> u64 {
        if !self.busy
            || !self.prefilling.is_empty()
            || !self.chunks.is_empty()
            || self.step_decode != self.decoding
            || (!self.waiting.is_empty() && !self.blocked)
        {
            return 0;
        }
        let quiet = match self.finishing.peek() {
            // The step in progress is number `steps + 1`; the first that finishes a request is
            // not quiet.
            Some(&Reverse((step, _, _))) => step.saturating_sub(self.steps + 1),
            None => 0,
        };
        match self.grow.peek() {
            // Planning the step after step count `at` allocates a block (and may evict or
            // preempt): the steps planned ahead stop before it.
            Some(&Reverse((at, _, _))) => quiet.min(at.saturating_sub(self.steps + 1)),
            None => quiet,
        }
    }

    /// The durations of the `n` steps after the one in progress, were they planned after
    /// quiet steps (`n` at most [`quiet_steps`](Self::quiet_steps)); cached, so that skipping
    /// them later does not compute them twice.
    pub fn quiet_durations(&mut self, n: usize) -> &[u64] {
        self.extend_ahead(n);
        let ahead = &self.ahead[self.ahead_pos..];
        &ahead[..n.min(ahead.len())]
    }

    /// Finishes the step in progress and plans the next, `n` times, exactly as
    /// [`finish_step`](Self::finish_step), [`admit`](Self::admit) and
    /// [`plan_step`](Self::plan_step) would; `n` must not exceed
    /// [`quiet_steps`](Self::quiet_steps) (it is clamped to it). `planned` sees each step
    /// planned. Returns the total duration of the steps finished.
    pub fn skip_quiet_steps(&mut self, n: u64, mut planned: impl FnMut(&PlannedStep)) -> u64 {
        let n = n.min(self.quiet_steps());
        if n == 0 {
            return 0;
        }
        self.extend_ahead(n as usize);
        let decode = self.step_decode as u64;
        let mut elapsed = 0;
        let (mut context, mut busy_us, mut last) = (self.context, self.busy_us, self.last_duration);
        // `ahead` starts with the step planned after the one in progress.
        let ahead = &self.ahead[self.ahead_pos..];
        for &duration_us in &ahead[..(n as usize).min(ahead.len())] {
            elapsed += last;
            context += decode;
            busy_us += duration_us;
            last = duration_us;
            planned(&PlannedStep {
                shape: StepShape::new(0, decode, context),
                duration_us,
            });
        }
        self.ahead_pos = (self.ahead_pos + n as usize).min(self.ahead.len());
        self.ahead_first += n;
        self.steps += n;
        (self.context, self.busy_us, self.last_duration) = (context, busy_us, last);
        elapsed
    }

    /// Makes `ahead` hold the durations of the `n` steps after the one in progress.
    fn extend_ahead(&mut self, n: usize) {
        let first = self.steps + 2;
        if self.ahead_pos == self.ahead.len() || self.ahead_first > first {
            self.clear_ahead();
            self.ahead_first = first;
        }
        if self.ahead_first < first {
            // Used up: the steps finished since.
            let gone = usize::try_from(first - self.ahead_first).unwrap_or(usize::MAX);
            self.ahead_pos = self.ahead_pos.saturating_add(gone).min(self.ahead.len());
            self.ahead_first = first;
        }
        let have = self.ahead.len() - self.ahead_pos;
        if have >= n {
            return;
        }
        if self.ahead_pos > 0 {
            self.ahead.drain(..self.ahead_pos);
            self.ahead_pos = 0;
        }
        let decode = self.decoding as u64;
        // Step `ahead_first + have` reads the context grown by every step before it.
        let k = self.ahead_first + have as u64 - (self.steps + 1);
        let from = self.ahead.len();
        self.timing
            .decode_steps_us(decode, self.context + k * decode, n - have, &mut self.ahead);
        for d in &mut self.ahead[from..] {
            *d = (*d).max(1);
        }
    }

    /// Forgets the durations computed ahead (the decoding set changed).
    fn clear_ahead(&mut self) {
        self.ahead.clear();
        self.ahead_pos = 0;
    }

    /// Ends the step in progress: every decoding request produced a token, prefill chunks are
    /// done. Requests that produced their last token leave, finished prefills store their
    /// prompt blocks.
    pub fn finish_step(&mut self) {
        if !std::mem::take(&mut self.busy) {
            return;
        }
        self.steps += 1;
        // Whatever the step changes may let the waiting head in: the next admit tries again.
        self.blocked = false;
        // Every request that was decoding in this step produced one token.
        self.context += self.step_decode as u64;
        while let Some(&Reverse((step, id, s))) = self.finishing.peek() {
            if step > self.steps {
                break;
            }
            self.finishing.pop();
            // A preempted request's entry is stale (it finishes later, or elsewhere).
            if self.slots[s]
                .as_ref()
                .is_some_and(|r| r.id == id && r.decoding && r.finish_at == step)
            {
                self.finish(s);
            }
        }
        for i in 0..self.chunks.len() {
            let (s, chunk) = self.chunks[i];
            if let Some(r) = self.slots[s].as_mut() {
                r.prefill_left -= chunk;
                if self.cfg.vllm() && r.prefill_left > 0 {
                    self.store_computed(s);
                }
            }
        }
        // Chunks go to the queue's front first, so completed prefills are a prefix of it.
        while let Some(&s) = self.prefilling.front() {
            if self.slots[s].as_ref().is_some_and(|r| r.prefill_left > 0) {
                break;
            }
            self.prefilling.pop_front();
            self.prefill_done(s);
        }
    }

    /// Moves what happened since the last call to the end of `out`, in order.
    pub fn take_outcomes(&mut self, out: &mut Vec<Outcome>) {
        out.append(&mut self.outcomes);
    }

    /// KV events queued since the last drain, in order.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, KvEvent> {
        self.cache.drain_events()
    }

    /// KV events queued and not yet drained.
    pub fn pending_events(&self) -> usize {
        self.cache.pending_events()
    }

    /// The host tier's KV events queued since the last drain, in order.
    pub fn drain_host_events(&mut self) -> std::vec::Drain<'_, KvEvent> {
        self.cache.drain_host_events()
    }

    /// The host tier's KV events queued and not yet drained.
    pub fn pending_host_events(&self) -> usize {
        self.cache.pending_host_events()
    }

    /// Checks the internal invariants (for property tests): the cache's own, and that every
    /// pinned or reserved block belongs to a running request.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        self.cache.check_invariants()?;
        if self.running() == 0
            && (self.private != 0 || self.cache.pinned_blocks() != 0 || self.context != 0)
        {
            return Err(format!(
                "nothing runs, yet {} blocks are reserved, {} pinned and {} context tokens counted",
                self.private,
                self.cache.pinned_blocks(),
                self.context
            ));
        }
        if let Some(t) = self.cfg.kv_blocks {
            if self.cache.len() + self.private > t {
                return Err(format!(
                    "{} cached + {} reserved blocks exceed the engine's {t}",
                    self.cache.len(),
                    self.private
                ));
            }
        }
        Ok(())
    }

    /// Schedules a waiting request if memory allows: pins its cached run and reserves the rest.
    fn admit_one(&mut self, s: usize) -> bool {
        let Some(r) = self.slots[s].as_mut() else {
            return true; // cannot happen: a queued slot is occupied
        };
        // The leading run resident now (engine truth), pinned so it stays while the request runs.
        r.held.clear();
        let hits = self.cache.pin_into(&r.blocks, &mut r.held);
        // The run after it that the host tier holds, taken before the resize below, whose
        // evictions are demoted into the host tier and could push it out.
        let host_run = if self.cfg.pool == Pool::Decode || r.first_done {
            0
        } else {
            self.cache.take_host_run(&r.blocks, hits)
        };
        let total = match self.cfg.kv_allocation {
            // The prompt's blocks only; the rest as decoding goes.
            KvAllocation::Incremental => self.cfg.block_size.blocks_for(r.input),
            _ => r.mem_blocks,
        };
        let need = total - hits;
        // The cache gets whatever the running requests, this one included, do not hold privately.
        if !resize(&mut self.cache, self.cfg.kv_blocks, self.private + need) {
            if let Some(r) = self.slots[s].as_mut() {
                self.cache.unpin_slots(&r.blocks[..hits], &r.held);
                r.held.clear();
            }
            return false;
        }
        if self.cfg.kv_blocks.is_some() {
            self.private += need;
        }
        let bs = self.cfg.block_size.get();
        let Some(r) = self.slots[s].as_mut() else {
            return true;
        };
        let id = r.id;
        r.hits = hits;
        r.alloc = if self.cfg.kv_blocks.is_some() {
            need
        } else {
            0
        };
        r.scheduled = true;
        self.admissions += 1;
        r.seq = self.admissions;
        if r.first_done {
            // Scheduled again after a preemption: it recomputes what it lost, as a prefill.
            let cached_tokens = (hits * bs).min(r.input.saturating_sub(1));
            r.prefill_left = r.input - cached_tokens;
            self.recomputed_tokens += r.prefill_left as u64;
            self.prefilling.push_back(s);
            return true;
        }
        self.outcomes.push(Outcome::Admitted {
            id,
            cached_blocks: hits,
        });
        if self.cfg.pool == Pool::Decode {
            // The prompt's KV arrived by transfer: it becomes resident now and decoding starts.
            self.store_prompt(s);
            self.outcomes.push(Outcome::FirstToken { id });
            if let Some(r) = self.slots[s].as_mut() {
                r.first_done = true;
            }
            self.start_decoding(s);
            return true;
        }
        // Blocks after the resident run that the host tier holds are loaded, not recomputed.
        let loaded = host_run;
        if loaded > 0 {
            self.load_ns = self
                .load_ns
                .saturating_add((loaded as u64).saturating_mul(self.cfg.host_load_ns_per_block));
            self.outcomes
                .push(Outcome::HostLoaded { id, blocks: loaded });
        }
        // A full hit still computes the last prompt token, to produce the first output token.
        let cached_tokens = ((hits + loaded) * bs).min(r.input.saturating_sub(1));
        r.prefill_left = r.input - cached_tokens;
        self.prefilling.push_back(s);
        true
    }

    /// Makes the prompt's full blocks resident and pins the ones that were not pinned at
    /// admission; the blocks reserved for them move into the cache.
    fn store_prompt(&mut self, s: usize) {
        let Some(r) = self.slots[s].as_mut() else {
            return;
        };
        if self.cfg.kv_blocks.is_some() {
            self.private -= r.blocks.len() - r.hits;
            r.alloc -= r.blocks.len() - r.hits;
            resize(&mut self.cache, self.cfg.kv_blocks, self.private);
        }
        let mut chain = std::mem::take(&mut r.held);
        chain.clear();
        if self.cache.insert_into(&r.blocks, &mut chain).is_ok() {
            // The whole prompt is resident and linked: pinning its slots from `hits` on is
            // pinning that part of the chain.
            self.cache.pin_slots(&chain[r.hits..]);
        } else {
            self.inconsistent_inserts += 1;
            self.cache.pin(&r.blocks[r.hits..]);
        }
        r.held = chain;
    }

    /// Under [`Scheduler::Vllm`], a partial prefill's blocks enter the cache as they are
    /// computed (vLLM caches every full block of a request when it is scheduled): they are
    /// shared at once, and a preempted request finds them again unless they were evicted.
    /// The request pins them; `hits` counts its pinned leading blocks from then on.
    fn store_computed(&mut self, s: usize) {
        let bs = self.cfg.block_size.get();
        let Some(r) = self.slots[s].as_mut() else {
            return;
        };
        let full = ((r.input - r.prefill_left) / bs).min(r.blocks.len());
        if full <= r.hits {
            return;
        }
        let moved = full - r.hits;
        if self.cfg.kv_blocks.is_some() {
            self.private -= moved;
            r.alloc -= moved;
            resize(&mut self.cache, self.cfg.kv_blocks, self.private);
        }
        let mut chain = Vec::with_capacity(full);
        if self
            .cache
            .insert_into(&r.blocks[..full], &mut chain)
            .is_ok()
        {
            self.cache.pin_slots(&chain[r.hits..]);
            r.hits = full;
            r.held = chain;
        } else {
            // A chain the cache contradicts (nothing was inserted): the blocks stay private
            // until the prompt is stored whole, as under kvsim's own rules.
            self.inconsistent_inserts += 1;
            if self.cfg.kv_blocks.is_some() {
                self.private += moved;
                r.alloc += moved;
                resize(&mut self.cache, self.cfg.kv_blocks, self.private);
            }
        }
    }

    /// Releases the request's pins: its stored prompt's chain, found through its slots.
    fn unpin_request(cache: &mut BlockCache, r: &Running) {
        cache.unpin_slots(&r.blocks, &r.held);
    }

    /// The prompt is computed and the first token produced.
    fn prefill_done(&mut self, s: usize) {
        self.store_prompt(s);
        let Some(r) = self.slots[s].as_ref() else {
            return;
        };
        let (id, output) = (r.id, r.output);
        if self.cfg.pool == Pool::Prefill {
            // The prefill engine lets go of the request; its KV moves to a decode engine.
            Self::unpin_request(&mut self.cache, r);
            if self.cfg.kv_blocks.is_some() {
                self.private -= r.alloc;
                resize(&mut self.cache, self.cfg.kv_blocks, self.private);
            }
            let blocks = self.release(s);
            self.outcomes.push(Outcome::PrefillDone { id, blocks });
            return;
        }
        if let Some(r) = self.slots[s].as_mut() {
            if !std::mem::replace(&mut r.first_done, true) {
                self.outcomes.push(Outcome::FirstToken { id });
            }
        }
        if output <= 1 {
            self.finish(s);
        } else {
            self.start_decoding(s);
        }
    }

    fn start_decoding(&mut self, s: usize) {
        let Some(r) = self.slots[s].as_mut() else {
            return;
        };
        if r.output <= 1 {
            self.finish(s);
            return;
        }
        r.decoding = true;
        self.ahead_pos = 0;
        self.ahead.clear();
        self.decoding += 1;
        self.context += (r.input + 1) as u64;
        r.decode_start = self.steps;
        r.finish_at = self.steps + (r.output as u64 - 1);
        self.finishing.push(Reverse((r.finish_at, r.id, s)));
        if self.cfg.incremental() && self.cfg.kv_blocks.is_some() {
            let held = r.blocks.len() + r.alloc;
            let at = (held * self.cfg.block_size.get()) as u64 + self.steps - r.input as u64;
            Self::schedule_grow(&mut self.grow, r, s, at);
        }
    }

    /// Queues the request's next block allocation at step count `at`, unless it would come
    /// after its last decode step. The decode step after step count `n` computes the KV of
    /// its context `input + n - decode_start`.
    fn schedule_grow(
        grow: &mut BinaryHeap<Reverse<(u64, u64, usize)>>,
        r: &mut Running,
        s: usize,
        at: u64,
    ) {
        if at < r.finish_at {
            r.next_grow = at;
            grow.push(Reverse((at, r.id, s)));
        }
    }

    /// Incremental allocation, before planning a step: every decoding request whose context
    /// crosses into a new block gets one; when none is free the newest scheduled request is
    /// preempted, until the block fits or the request needing it was the one preempted.
    fn grow_blocks(&mut self) {
        while let Some(&Reverse((at, id, s))) = self.grow.peek() {
            if at > self.steps {
                break;
            }
            self.grow.pop();
            let live = self.slots[s]
                .as_ref()
                .is_some_and(|r| r.id == id && r.decoding && r.next_grow == at);
            if !live {
                continue;
            }
            loop {
                if resize(&mut self.cache, self.cfg.kv_blocks, self.private + 1) {
                    self.private += 1;
                    let bs = self.cfg.block_size.get() as u64;
                    if let Some(r) = self.slots[s].as_mut() {
                        r.alloc += 1;
                        Self::schedule_grow(&mut self.grow, r, s, at + bs);
                    }
                    break;
                }
                let Some(v) = self.newest_scheduled() else {
                    break;
                };
                self.preempt(v);
                if v == s {
                    break;
                }
            }
        }
    }

    /// Sends a scheduled request back to the front of the queue, giving back its blocks and
    /// pins; what it produced is kept (a re-admission recomputes it as part of its prompt).
    fn preempt(&mut self, v: usize) {
        let Some(r) = self.slots[v].as_mut() else {
            return;
        };
        r.scheduled = false;
        if std::mem::take(&mut r.decoding) {
            self.ahead_pos = 0;
            self.ahead.clear();
            self.decoding -= 1;
            // The first token and one per decode step since: they become prompt tokens.
            let produced = 1 + (self.steps - r.decode_start) as usize;
            self.context -= (r.input + produced) as u64;
            r.input += produced;
            r.output -= produced;
            Self::unpin_request(&mut self.cache, r);
        } else {
            if let Some(i) = self.prefilling.iter().position(|&x| x == v) {
                self.prefilling.remove(i);
            }
            self.cache.unpin_slots(&r.blocks[..r.hits], &r.held);
        }
        r.held.clear();
        r.hits = 0;
        r.prefill_left = r.input;
        if self.cfg.kv_blocks.is_some() {
            self.private -= std::mem::take(&mut r.alloc);
            resize(&mut self.cache, self.cfg.kv_blocks, self.private);
        }
        let id = r.id;
        self.waiting.push_front(v);
        self.blocked = false;
        self.preemptions += 1;
        self.outcomes.push(Outcome::Preempted { id });
    }

    fn finish(&mut self, s: usize) {
        let Some(r) = self.slots[s].as_mut() else {
            return;
        };
        if std::mem::take(&mut r.decoding) {
            self.ahead_pos = 0;
            self.ahead.clear();
            self.decoding -= 1;
            self.context -= (r.input + r.output) as u64;
        }
        Self::unpin_request(&mut self.cache, r);
        if self.cfg.kv_blocks.is_some() {
            self.private -= r.alloc;
            resize(&mut self.cache, self.cfg.kv_blocks, self.private);
        }
        let id = r.id;
        self.release(s);
        self.outcomes.push(Outcome::Finished { id });
    }

    /// Frees a request's slot, returning its blocks.
    fn release(&mut self, s: usize) -> Vec<BlockHash> {
        let blocks = self.slots[s].take().map(|r| r.blocks).unwrap_or_default();
        self.free.push(s);
        blocks
    }
}

/// Sets the cache's capacity to what `private` blocks leave of `total`; false when they leave
/// too little for the blocks the cache cannot evict.
fn resize(cache: &mut BlockCache, total: Option<usize>, private: usize) -> bool {
    match total {
        None => true,
        Some(total) => match total.checked_sub(private) {
            Some(room) => cache.set_capacity(Some(room)).is_ok(),
            None => false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::LinearTiming;
    use proptest::prelude::*;

    fn engine(bs: usize, kv: usize, alloc: KvAllocation) -> Engine {
        let mut c = EngineConfig::new(BlockSize::new(bs).unwrap());
        c.kv_blocks = Some(kv);
        c.kv_allocation = alloc;
        Engine::new(c, LinearTiming::new(1_000.0, 1.0, 1.0, 0.0))
    }

    /// Runs the engine until nothing is left (at most `limit` steps), checking its invariants
    /// after every step; returns the outcomes and the steps taken.
    fn drain(e: &mut Engine, limit: u64) -> (Vec<Outcome>, u64) {
        let mut out = Vec::new();
        e.admit();
        while e.plan_step().is_some() {
            e.finish_step();
            e.check_invariants().unwrap();
            e.admit();
            assert!(e.steps() <= limit, "no progress after {limit} steps");
        }
        e.take_outcomes(&mut out);
        (out, e.steps())
    }

    /// Two requests of one 4-token block and 9 output tokens on 5 blocks of 4 tokens:
    /// - both are admitted with their prompt block and prefilled in step 1;
    /// - each grows a block before step 2 (context 5) and wants a third before step 6
    ///   (context 9): A gets it (3 + 1 cached... 2 pinned + 3 private = 5), B, the newest, is
    ///   preempted, having produced 5 tokens (the first and 4 decode steps);
    /// - A finishes at step 9; B is admitted again with its prompt block still cached and
    ///   recomputes 9 - 4 = 5 tokens in step 10, then decodes its last 3 tokens (steps 11-13).
    ///
    /// With reserve allocation B waits for A's 4 blocks instead: 9 + 9 steps, no preemption.
    #[test]
    fn preemption_by_hand() {
        let bs = BlockSize::new(4).unwrap();
        let hasher = kvblock::BlockHasher::new(bs);
        let req = |id: u64, t: u32| {
            let blocks = hasher.sequence_hashes(&[t, t, t, t]);
            EngineRequest::new(id, blocks, 4, 9)
        };
        let mut e = engine(4, 5, KvAllocation::Incremental);
        assert!(e.submit(req(1, 7)) && e.submit(req(2, 8)));
        let (out, steps) = drain(&mut e, 100);
        assert_eq!(
            out,
            [
                Outcome::Admitted {
                    id: 1,
                    cached_blocks: 0
                },
                Outcome::Admitted {
                    id: 2,
                    cached_blocks: 0
                },
                Outcome::FirstToken { id: 1 },
                Outcome::FirstToken { id: 2 },
                Outcome::Preempted { id: 2 },
                Outcome::Finished { id: 1 },
                Outcome::Finished { id: 2 },
            ]
        );
        assert_eq!((steps, e.preemptions(), e.recomputed_tokens()), (13, 1, 5));
        assert_eq!((e.reserved_blocks(), e.cache().pinned_blocks()), (0, 0));

        let mut e = engine(4, 5, KvAllocation::Reserve);
        assert!(e.submit(req(1, 7)) && e.submit(req(2, 8)));
        let (_, steps) = drain(&mut e, 100);
        assert_eq!((steps, e.preemptions()), (18, 0));
    }

    /// An engine under vLLM V1's rules: 1 ms per step plus 1 µs per prefill token and per
    /// decoding request, so that step shapes can be read off durations.
    fn vllm_engine(bs: usize, kv: Option<usize>, budget: usize, seqs: usize) -> Engine {
        let mut c = EngineConfig::new(BlockSize::new(bs).unwrap());
        c.kv_blocks = kv;
        c.max_batched_tokens = budget;
        c.max_num_seqs = seqs;
        c.scheduler = Scheduler::Vllm;
        Engine::new(c, LinearTiming::new(1_000.0, 1.0, 1.0, 0.0))
    }

    /// A request of `input` distinct tokens (starting at `from`) and `output` output tokens.
    fn request(e: &Engine, id: u64, from: u32, input: usize, output: usize) -> EngineRequest {
        let tokens: Vec<u32> = (from..from + input as u32).collect();
        let blocks = kvblock::BlockHasher::new(e.config().block_size).sequence_hashes(&tokens);
        EngineRequest::new(id, blocks, input, output)
    }

    /// Plans one step (admission is part of it): its (prefill tokens, decoding requests).
    fn step(e: &mut Engine) -> Option<(u64, u64)> {
        e.admit();
        let p = e.plan_step()?;
        e.finish_step();
        e.check_invariants().unwrap();
        Some((p.shape.prefill_tokens, p.shape.decode_requests))
    }

    /// Running requests go before waiting ones, and a partial prefill continues with what the
    /// budget leaves. Budget 64: A (100 tokens) takes 64, then 36 and B (50 tokens, arrived
    /// meanwhile) is admitted with the 28 left; B finishes its prompt with 22 while A decodes
    /// (each decode one token of the budget). With 8,192 both prompts fit in the first step
    /// after B arrives.
    #[test]
    fn vllm_running_first_then_waiting_with_what_is_left() {
        let mut e = vllm_engine(16, None, 64, 32);
        assert!(e.submit(request(&e, 1, 0, 100, 3)));
        assert_eq!(step(&mut e), Some((64, 0)));
        assert!(e.submit(request(&e, 2, 1_000, 50, 3)));
        assert_eq!(step(&mut e), Some((36 + 28, 0)));
        let mut out = Vec::new();
        e.take_outcomes(&mut out);
        assert_eq!(
            out,
            [
                Outcome::Admitted {
                    id: 1,
                    cached_blocks: 0
                },
                Outcome::Admitted {
                    id: 2,
                    cached_blocks: 0
                },
                Outcome::FirstToken { id: 1 },
            ]
        );
        assert_eq!(step(&mut e), Some((22, 1)));
        assert_eq!(step(&mut e), Some((0, 2)));

        let mut e = vllm_engine(16, None, 8_192, 32);
        assert!(e.submit(request(&e, 1, 0, 100, 3)));
        assert_eq!(step(&mut e), Some((100, 0)));
        assert!(e.submit(request(&e, 2, 1_000, 50, 3)));
        assert_eq!(step(&mut e), Some((50, 1)));
    }

    /// Waiting requests are admitted in order while the budget allows: with a budget of 64 and
    /// three prompts of 40, the first takes 40 and the second 24 in step 1; the third waits
    /// for a step with budget left (kvsim's own rules admit all three at once).
    #[test]
    fn vllm_admission_stops_when_the_budget_is_spent() {
        for (scheduler, running_after_one) in [(Scheduler::Vllm, 2), (Scheduler::Kvsim, 3)] {
            let mut e = vllm_engine(16, None, 64, 32);
            e.cfg.scheduler = scheduler;
            for id in 0..3 {
                assert!(e.submit(request(&e, id, 1_000 * id as u32, 40, 5)));
            }
            assert_eq!(step(&mut e), Some((64, 0)));
            assert_eq!(e.running(), running_after_one, "{scheduler}");
        }
    }

    /// max_num_seqs and free blocks bound admission, first come first served: with 2
    /// sequences the third request waits for a finish; with 10 blocks of 16, after A (100
    /// tokens: 7 blocks) the head B (60 tokens: 4 blocks) does not fit and C (10 tokens, 1
    /// block), behind it, waits too.
    #[test]
    fn vllm_admission_is_bounded_by_sequences_and_blocks_in_order() {
        for budget in [64, 8_192] {
            let mut e = vllm_engine(16, None, budget, 2);
            for id in 0..3 {
                assert!(e.submit(request(&e, id, 1_000 * id as u32, 10, 4)));
            }
            step(&mut e);
            assert_eq!((e.running(), e.waiting()), (2, 1), "budget {budget}");

            let mut e = vllm_engine(16, Some(10), budget, 8);
            assert!(e.submit(request(&e, 1, 0, 100, 2)));
            let mut out = Vec::new();
            while !out.contains(&Outcome::FirstToken { id: 1 }) {
                step(&mut e).unwrap();
                e.take_outcomes(&mut out);
            }
            // A holds 7 blocks; B needs 4 of the 3 left, and C waits behind it.
            assert!(e.submit(request(&e, 2, 1_000, 60, 2)));
            assert!(e.submit(request(&e, 3, 2_000, 10, 2)));
            assert_eq!(step(&mut e), Some((0, 1)));
            assert_eq!(e.waiting(), 2, "budget {budget}");
            let (out, _) = drain(&mut e, 1_000);
            let firsts: Vec<u64> = out
                .iter()
                .filter_map(|o| match o {
                    Outcome::Admitted { id, .. } => Some(*id),
                    _ => None,
                })
                .collect();
            assert_eq!(firsts, [2, 3], "budget {budget}: in order");
        }
    }

    /// A cached prefix counts in whole blocks, at most the prompt less one token: with blocks
    /// of 16 a 32-token prompt whose two blocks are cached reuses one block and computes 16
    /// tokens; a 33-token prompt reuses both and computes 1. kvsim's own rule computes only
    /// the last token of a full hit.
    #[test]
    fn vllm_reuses_a_cached_prefix_up_to_the_prompt_less_one_token() {
        for budget in [64, 8_192] {
            for (input, scheduler, cached_blocks, computed) in [
                (32, Scheduler::Vllm, 1, 16),
                (33, Scheduler::Vllm, 2, 1),
                (32, Scheduler::Kvsim, 2, 1),
            ] {
                let mut e = vllm_engine(16, Some(100), budget, 8);
                e.cfg.scheduler = scheduler;
                assert!(e.submit(request(&e, 1, 0, 32, 1)));
                drain(&mut e, 100);
                assert_eq!(e.cache().len(), 2);
                assert!(e.submit(request(&e, 2, 0, input, 1)));
                assert_eq!(step(&mut e), Some((computed, 0)), "{scheduler} {input}");
                let mut out = Vec::new();
                e.take_outcomes(&mut out);
                assert_eq!(
                    out[0],
                    Outcome::Admitted {
                        id: 2,
                        cached_blocks
                    },
                    "{scheduler}"
                );
            }
        }
    }

    /// Under KV pressure the newest running request is preempted and later recomputed. Blocks
    /// of 4, 5 blocks: A and B (one 4-token block, 9 output tokens) both run; at context 9
    /// each needs a third block, A gets the last one and B, the newest, is preempted with 5
    /// tokens produced; it resumes when A finishes, recomputing its 4 + 5 tokens less its
    /// cached prompt block (5 tokens), and no request is admitted in the step that preempted.
    #[test]
    fn vllm_preempts_the_newest_and_recomputes_it() {
        for budget in [64, 8_192] {
            let mut e = vllm_engine(4, Some(5), budget, 8);
            assert!(e.submit(request(&e, 1, 0, 4, 9)) && e.submit(request(&e, 2, 100, 4, 9)));
            let (out, steps) = drain(&mut e, 100);
            assert_eq!(
                out,
                [
                    Outcome::Admitted {
                        id: 1,
                        cached_blocks: 0
                    },
                    Outcome::Admitted {
                        id: 2,
                        cached_blocks: 0
                    },
                    Outcome::FirstToken { id: 1 },
                    Outcome::FirstToken { id: 2 },
                    Outcome::Preempted { id: 2 },
                    Outcome::Finished { id: 1 },
                    Outcome::Finished { id: 2 },
                ],
                "budget {budget}"
            );
            assert_eq!((steps, e.preemptions(), e.recomputed_tokens()), (13, 1, 5));
            assert_eq!((e.reserved_blocks(), e.cache().pinned_blocks()), (0, 0));
        }
    }

    /// Chunks allocate their blocks as they are scheduled, and computed blocks enter the cache
    /// at once (pinned by their request). Blocks of 4, 6 blocks, budget 8: A (20 tokens)
    /// computes 8 tokens (2 blocks cached), then 8 more (4) while B waits for budget; A's last
    /// 4 tokens (its 5th block) leave 4 for B's first chunk (the 6th). When A starts decoding
    /// and needs a 6th block of its own, none is free: B, the newest, is preempted (its block
    /// stays cached, evictable, and is evicted for A's), and resumes when A has finished.
    #[test]
    fn vllm_chunks_allocate_as_they_go_and_preempt_the_newest() {
        let mut e = vllm_engine(4, Some(6), 8, 4);
        assert!(e.submit(request(&e, 1, 0, 20, 2)));
        assert_eq!(step(&mut e), Some((8, 0)));
        assert_eq!((e.reserved_blocks(), e.cache().len()), (0, 2));
        assert!(e.submit(request(&e, 2, 100, 8, 8)));
        assert_eq!(step(&mut e), Some((8, 0)));
        assert_eq!(
            (e.running(), e.cache().len(), e.cache().pinned_blocks()),
            (1, 4, 4)
        );
        assert_eq!(step(&mut e), Some((4 + 4, 0)));
        assert_eq!(e.running(), 2);
        assert_eq!(step(&mut e), Some((0, 1)));
        assert_eq!((e.preemptions(), e.waiting()), (1, 1));
        let (out, _) = drain(&mut e, 100);
        assert!(out.contains(&Outcome::Preempted { id: 2 }), "{out:?}");
        assert!(
            out.contains(&Outcome::Finished { id: 1 })
                && out.contains(&Outcome::Finished { id: 2 })
        );
        assert_eq!((e.reserved_blocks(), e.cache().pinned_blocks()), (0, 0));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// Incremental allocation on tiny caches: whatever arrives, the engine never deadlocks
        /// (it runs dry within a bound), every request is refused at once or finishes exactly
        /// once with one first token, and no block stays pinned or reserved.
        #[test]
        fn incremental_allocation_never_deadlocks(
            kv in 2usize..24, bs in prop::sample::select(vec![1usize, 2, 4, 16]),
            seqs in 1usize..6, budget in 8usize..64, vllm in any::<bool>(),
            reqs in prop::collection::vec((0u32..4, 1usize..40, 1usize..40, 0u64..6), 1..24),
        ) {
            let mut c = EngineConfig::new(BlockSize::new(bs).unwrap());
            c.kv_blocks = Some(kv);
            c.kv_allocation = KvAllocation::Incremental;
            c.scheduler = if vllm { Scheduler::Vllm } else { Scheduler::Kvsim };
            c.max_num_seqs = seqs;
            c.max_batched_tokens = budget.max(seqs + 1);
            let mut e = Engine::new(c, LinearTiming::new(1_000.0, 1.0, 1.0, 0.0));
            let hasher = kvblock::BlockHasher::new(c.block_size);
            let mut accepted = Vec::new();
            let mut out = Vec::new();
            for (i, &(prefix, input, output, wait)) in reqs.iter().enumerate() {
                // Prompts share a prefix by `prefix`, so pins overlap.
                let tokens: Vec<u32> = (0..input as u32).map(|t| if t < 8 { prefix } else { t + 100 * i as u32 }).collect();
                if e.submit(EngineRequest::new(i as u64, hasher.sequence_hashes(&tokens), input, output)) {
                    accepted.push(i as u64);
                } else {
                    prop_assert!(e.blocks_needed(input, output) > kv);
                }
                for _ in 0..wait {
                    e.admit();
                    if e.plan_step().is_none() {
                        break;
                    }
                    e.finish_step();
                    e.check_invariants().map_err(TestCaseError::fail)?;
                }
            }
            let (rest, _) = drain(&mut e, 1_000_000);
            e.take_outcomes(&mut out);
            out.extend(rest);
            for id in &accepted {
                let finished = out.iter().filter(|o| **o == Outcome::Finished { id: *id }).count();
                let first = out.iter().filter(|o| **o == Outcome::FirstToken { id: *id }).count();
                prop_assert_eq!((finished, first), (1, 1), "request {}", id);
            }
            prop_assert!(e.is_idle());
            prop_assert_eq!((e.reserved_blocks(), e.cache().pinned_blocks()), (0, 0));
        }
    }
}
