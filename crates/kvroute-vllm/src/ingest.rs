//! [`VllmIngest`]: decoded batches applied to a [`Router`], with per-worker sequence numbers and
//! engine-hash to our-hash maps.

use std::collections::BTreeMap;

use hashbrown::hash_map::Entry;
use kvblock::{BlockHash, BlockHasher, BlockSize, ExtraKeys};
use kvcache::{KvEvent, Tier, WorkerId};

use super::wire::SGLANG_CACHE_SALT_PREFIX;
use super::{
    decode_event_batch, parse_seq_frame, BlockStored, EngineEvent, EngineHash, EventBatch,
    KeyValue, VllmError,
};
use crate::Map;
use kvroute::{CacheGroup, GroupRule, Router};

/// What one call of [`VllmIngest`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IngestSummary {
    /// The batch's sequence number (as given, or the expected one).
    pub seq: u64,
    /// Engine events in the batch.
    pub events: usize,
    /// Events applied to the router (an event naming no known block is not applied).
    pub events_applied: usize,
    /// Blocks newly recorded as resident.
    pub blocks_stored: usize,
    /// Stored blocks the router already knew the worker held.
    pub already_present: usize,
    /// Blocks removed, by `BlockRemoved`.
    pub blocks_removed: usize,
    /// Blocks dropped by `AllBlocksCleared` or by a publisher restart.
    pub blocks_cleared: usize,
    /// Removed engine hashes that were never stored (or already removed): skipped.
    pub unknown_removals: usize,
    /// `BlockStored` events whose parent was never seen: skipped, and the worker marked stale.
    pub unknown_parents: usize,
    /// `Some((expected, got))` when batches were missed: applied, and the worker marked stale.
    pub gap: Option<(u64, u64)>,
    /// The publisher restarted (sequence number 0 again): the worker was cleared first.
    pub restarted: bool,
    /// Blocks the router cannot track: those of a group whose block size is not a multiple of
    /// the router's (accepted and counted; that group does not limit the worker's hits), and
    /// blocks with extra keys in a group of larger blocks (counted; left out of that group, so
    /// it serves no hit through them).
    pub untracked_blocks: usize,
    /// `BlockStored` events whose `kv_cache_spec_kind` the router does not know (or a sliding
    /// window without its size): treated as full attention.
    pub unknown_group_kinds: usize,
    /// Blocks newly recorded on a lower tier (a `medium` other than the GPU: CPU offloading).
    pub lower_tier_stored: usize,
    /// Blocks removed from a lower tier.
    pub lower_tier_removed: usize,
    /// When the engine published the batch (its `ts`), microseconds since the Unix epoch; 0
    /// when the batch has none (a `ts` of 0 or less, or not a number).
    pub published_us: u64,
}

/// Running totals of one worker's vLLM feed, since [`VllmIngest`] first saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IngestStats {
    /// Batches applied.
    pub batches: u64,
    /// Batches rejected (malformed, invalid, duplicate or numbered `u64::MAX`).
    pub rejected: u64,
    /// Engine events in applied batches.
    pub events: u64,
    /// Blocks newly recorded as resident.
    pub blocks_stored: u64,
    /// Blocks removed by `BlockRemoved`.
    pub blocks_removed: u64,
    /// Blocks dropped by clears and restarts.
    pub blocks_cleared: u64,
    /// Removed engine hashes never stored.
    pub unknown_removals: u64,
    /// `BlockStored` events skipped for an unknown parent.
    pub unknown_parents: u64,
    /// Batches that followed missed ones.
    pub gaps: u64,
    /// Publisher restarts.
    pub restarts: u64,
    /// Blocks of cache groups the router cannot track.
    pub untracked_blocks: u64,
    /// `BlockStored` events of a group kind the router does not know.
    pub unknown_group_kinds: u64,
}

impl IngestStats {
    fn add(&mut self, s: &IngestSummary) {
        self.batches += 1;
        self.events += s.events as u64;
        self.blocks_stored += s.blocks_stored as u64;
        self.blocks_removed += s.blocks_removed as u64;
        self.blocks_cleared += s.blocks_cleared as u64;
        self.unknown_removals += s.unknown_removals as u64;
        self.unknown_parents += s.unknown_parents as u64;
        self.gaps += u64::from(s.gap.is_some());
        self.restarts += u64::from(s.restarted);
        self.untracked_blocks += s.untracked_blocks as u64;
        self.unknown_group_kinds += s.unknown_group_kinds as u64;
    }
}

/// A KV-cache group as the feed names it: `None` for an engine that sends no `group_idx`.
type GroupKey = Option<u32>;

/// Where a group's events go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The router's index (the group it hashes with).
    Primary,
    /// One of the router's other cache groups.
    Side(u32, CacheGroup),
    /// Nowhere: counted only.
    Untracked,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Feed {
    /// (group, engine hash) -> our hash, for the blocks the worker holds.
    blocks: Map<(GroupKey, EngineHash), BlockHash>,
    /// How many engine blocks of a group map to each of our hashes (more than one when the
    /// engine keys a block by more than we do): ours leaves the router with the last.
    refs: Map<(GroupKey, BlockHash), u32>,
    /// Each group's target, learned from its first `BlockStored`.
    groups: BTreeMap<GroupKey, Target>,
    /// The group the router's index mirrors, once seen.
    primary: Option<GroupKey>,
    /// (tier, engine hash) -> our hash, for the blocks the worker holds on a lower tier.
    lower: Map<(Tier, EngineHash), BlockHash>,
    /// The next router event id of each lower tier's mirror.
    lower_ids: BTreeMap<Tier, u64>,
    /// The next batch sequence number expected.
    next_seq: u64,
    /// Skip one router event id at the next apply, so the index records a gap (stale view).
    skip_id: bool,
    totals: IngestStats,
    /// The caller's stream position of the last batch applied (kept in snapshots).
    pub(super) position: Option<u64>,
}

/// One worker's vLLM feed in a [`MirrorSnapshot`](crate::MirrorSnapshot) (plain data, here so
/// that the snapshot module depends on this one and not the other way round).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct FeedSnapshot {
    /// The worker.
    pub worker: WorkerId,
    /// The next batch sequence number expected from its publisher.
    pub next_seq: u64,
    /// The caller's position in the worker's event stream that the snapshot reflects (the
    /// last batch applied), as given to [`VllmIngest::set_position`].
    pub position: Option<u64>,
    /// Whether the KV-cache group the router's index mirrors is known (false before the
    /// first store).
    pub group_known: bool,
    /// That group's index (`None` for an engine that sends none).
    pub group: Option<u32>,
    /// That group's engine hash to our hash, sorted by engine hash.
    pub blocks: Vec<(EngineHash, BlockHash)>,
    /// Whether the next router event id is skipped (a gap the index has yet to record).
    pub skip_id: bool,
}

/// Applies vLLM event batches to a [`Router`], one feed per worker: engine-to-ours hash maps,
/// sequence checking and counters. See the [module docs](super) for the rules.
///
/// Keep one `VllmIngest` beside each `Router` (for example in the same mutex). When a worker is
/// removed from the router, call [`forget_worker`](Self::forget_worker) too.
#[derive(Debug, Clone, Default)]
pub struct VllmIngest {
    feeds: Map<WorkerId, Feed>,
    /// Data-parallel ranks given their own worker: (engine, rank) to worker, and back.
    ranks: Map<(WorkerId, i64), WorkerId>,
    rank_of: Map<WorkerId, (WorkerId, u32)>,
}

impl VllmIngest {
    /// An adapter that knows no worker yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Gives data-parallel rank `rank` of engine `engine` its own worker: every batch of
    /// `engine` tagged with that `data_parallel_rank` applies to `worker`'s mirror (with its own
    /// sequence numbers, as each rank publishes its own stream), so the router scores each rank
    /// as the separate cache it is and [`rank_of`](Self::rank_of) says where to send a request
    /// routed to `worker`. Batches of a rank without a worker, and batches without a rank, apply
    /// to `engine` itself. `engine` need not be registered with the router; `worker` must be.
    /// Returns the worker the rank had before, if any.
    ///
    /// ```
    /// use kvroute_vllm::{BlockStored, EngineEvent, EngineHash, EventBatch, VllmIngest};
    /// use kvroute::{Router, WorkerId};
    ///
    /// let mut router = Router::builder().build()?;
    /// let engine = WorkerId::new(7);
    /// let (rank0, rank1) = (WorkerId::new(70), WorkerId::new(71));
    /// router.add_worker(rank0);
    /// router.add_worker(rank1);
    /// let mut ingest = VllmIngest::new();
    /// ingest.set_rank_worker(engine, 0, rank0);
    /// ingest.set_rank_worker(engine, 1, rank1);
    /// let stored = BlockStored::new(vec![EngineHash::Int(1)], None, (0..16).collect(), 16);
    /// let mut batch = EventBatch::new(0.0, vec![EngineEvent::BlockStored(stored)]);
    /// batch.data_parallel_rank = Some(1);
    /// ingest.apply_batch(&mut router, engine, Some(0), &batch)?;
    /// assert_eq!((router.cache_view(rank0), router.cache_view(rank1)), (0, 1));
    /// assert_eq!(ingest.rank_of(rank1), Some((engine, 1)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_rank_worker(
        &mut self,
        engine: WorkerId,
        rank: u32,
        worker: WorkerId,
    ) -> Option<WorkerId> {
        // A worker stands for one rank at a time.
        if let Some((e, r)) = self.rank_of.remove(&worker) {
            self.ranks.remove(&(e, i64::from(r)));
        }
        let before = self.ranks.insert((engine, i64::from(rank)), worker);
        if let Some(b) = before {
            self.rank_of.remove(&b);
        }
        self.rank_of.insert(worker, (engine, rank));
        before
    }

    /// The engine and data-parallel rank that `worker` stands for (see
    /// [`set_rank_worker`](Self::set_rank_worker)).
    pub fn rank_of(&self, worker: WorkerId) -> Option<(WorkerId, u32)> {
        self.rank_of.get(&worker).copied()
    }

    /// Where a batch of `engine` applies: its rank's worker, or the engine.
    fn target(&self, engine: WorkerId, batch: &EventBatch) -> WorkerId {
        batch
            .data_parallel_rank
            .and_then(|r| self.ranks.get(&(engine, r)).copied())
            .unwrap_or(engine)
    }

    /// Applies one ZMQ multipart message `(topic, sequence number, payload)` of `worker`'s
    /// publisher (a batch of a data-parallel rank with a worker of its own applies to that
    /// worker: see [`set_rank_worker`](Self::set_rank_worker)). The topic is not interpreted.
    pub fn apply_multipart<F: AsRef<[u8]>>(
        &mut self,
        router: &mut Router,
        worker: WorkerId,
        frames: &[F],
    ) -> Result<IngestSummary, VllmError> {
        let [_topic, seq, payload] = frames else {
            return Err(VllmError::FrameCount { got: frames.len() });
        };
        let seq = parse_seq_frame(seq.as_ref());
        let seq = self.counting_rejects(router, worker, seq)?;
        self.apply_payload(router, worker, Some(seq), payload.as_ref())
    }

    /// Decodes and applies one MessagePack payload of `worker`, with its batch sequence number
    /// (`None`: the next one expected).
    pub fn apply_payload(
        &mut self,
        router: &mut Router,
        worker: WorkerId,
        seq: Option<u64>,
        payload: &[u8],
    ) -> Result<IngestSummary, VllmError> {
        let batch = decode_event_batch(payload);
        let batch = self.counting_rejects(router, worker, batch)?;
        self.apply_batch(router, worker, seq, &batch)
    }

    /// Applies one decoded batch of `worker`, with its sequence number (`None`: the next one
    /// expected). The whole batch is validated first: on an error nothing was applied and the
    /// sequence number was not consumed.
    pub fn apply_batch(
        &mut self,
        router: &mut Router,
        worker: WorkerId,
        seq: Option<u64>,
        batch: &EventBatch,
    ) -> Result<IngestSummary, VllmError> {
        let worker = self.target(worker, batch);
        // An engine that has rank workers may itself be unregistered: checked before any change.
        if router.index().worker_index(worker).is_none() {
            return Err(kvroute::Error::UnknownWorker { worker }.into());
        }
        let checked = validate(batch, router.block_size().get());
        self.counting_rejects(router, worker, checked)?;
        let feed = self.feeds.entry(worker).or_default();
        let expected = feed.next_seq;
        let seq = seq.unwrap_or(expected);
        if seq == u64::MAX {
            // Past it, the next number would not fit: the batch could be replayed without end.
            feed.totals.rejected += 1;
            return Err(VllmError::SequenceOutOfRange { worker });
        }
        let mut out = IngestSummary {
            seq,
            events: batch.events.len(),
            // `as` saturates: a NaN or negative `ts` is 0, a huge one u64::MAX.
            published_us: (batch.timestamp * 1e6) as u64,
            ..IngestSummary::default()
        };
        if seq > expected {
            out.gap = Some((expected, seq));
            feed.skip_id = true;
        } else if seq < expected {
            if seq != 0 {
                feed.totals.rejected += 1;
                return Err(VllmError::DuplicateSequence {
                    worker,
                    got: seq,
                    expected,
                });
            }
            // The publisher restarted: whatever we mirrored may be gone.
            out.restarted = true;
            out.blocks_cleared += router.clear_worker(worker);
            feed.blocks.clear();
            feed.refs.clear();
            feed.lower.clear();
            // A restarted engine may serve another model: its groups are learned again.
            feed.groups.clear();
            feed.primary = None;
            feed.skip_id = false;
        }
        feed.next_seq = seq + 1;
        let bs = router.block_size();
        for event in &batch.events {
            match event {
                EngineEvent::BlockStored(st)
                    if Tier::from_medium(st.medium.as_deref()) != Tier::Device =>
                {
                    let tier = Tier::from_medium(st.medium.as_deref());
                    let mut blocks = Vec::with_capacity(st.block_hashes.len());
                    let primary = feed.primary.unwrap_or(None);
                    // An offloaded block of several of ours (a larger offload block size) names
                    // them by one hash: which ones is not said, so they are not tracked.
                    let ours_size = st.block_size == 0 || st.block_size == bs.get() as u64;
                    for h in st.block_hashes.iter().filter(|_| ours_size) {
                        // An offloaded block carries no tokens: it is a block the device held,
                        // or one another lower tier holds.
                        let known = feed.blocks.get(&(primary, h.clone())).or_else(|| {
                            [Tier::Host, Tier::Disk]
                                .iter()
                                .find_map(|&t| feed.lower.get(&(t, h.clone())))
                        });
                        match known.copied() {
                            Some(ours) => {
                                feed.lower.insert((tier, h.clone()), ours);
                                blocks.push(ours);
                            }
                            None => out.untracked_blocks += 1,
                        }
                    }
                    if !ours_size {
                        out.untracked_blocks += st.block_hashes.len();
                    }
                    if !blocks.is_empty() {
                        let a = apply_lower(
                            router,
                            worker,
                            feed,
                            tier,
                            KvEvent::Stored {
                                parent: None,
                                blocks,
                            },
                        )?;
                        out.events_applied += 1;
                        out.lower_tier_stored += a.stored;
                    }
                }
                EngineEvent::BlockRemoved(r)
                    if Tier::from_medium(r.medium.as_deref()) != Tier::Device =>
                {
                    let tier = Tier::from_medium(r.medium.as_deref());
                    let mut blocks = Vec::with_capacity(r.block_hashes.len());
                    for h in &r.block_hashes {
                        match feed.lower.remove(&(tier, h.clone())) {
                            Some(ours) => blocks.push(ours),
                            None => out.unknown_removals += 1,
                        }
                    }
                    if !blocks.is_empty() {
                        let a =
                            apply_lower(router, worker, feed, tier, KvEvent::Removed { blocks })?;
                        out.events_applied += 1;
                        out.lower_tier_removed += a.removed;
                    }
                }
                EngineEvent::BlockStored(st) => {
                    let target = feed.target_of(st, bs, &mut out);
                    store(router, worker, feed, st, target, &mut out)?;
                }
                EngineEvent::BlockRemoved(r) => {
                    let key = r.group_idx;
                    let target = feed.groups.get(&key).copied();
                    let mut blocks = Vec::with_capacity(r.block_hashes.len());
                    for h in &r.block_hashes {
                        match feed.blocks.remove(&(key, h.clone())) {
                            Some(ours) if feed.release(key, ours) => blocks.push(ours),
                            Some(_) => {}
                            None if target == Some(Target::Untracked) => out.untracked_blocks += 1,
                            None => out.unknown_removals += 1,
                        }
                    }
                    if blocks.is_empty() {
                        continue;
                    }
                    let ev = KvEvent::Removed { blocks };
                    let a = match target {
                        Some(Target::Side(g, spec)) => {
                            router.apply_group_event(worker, g, spec, &ev)?
                        }
                        _ => apply(router, worker, feed, &ev)?,
                    };
                    out.events_applied += 1;
                    out.blocks_removed += a.removed;
                    out.unknown_removals += a.unknown_removed;
                }
                EngineEvent::AllBlocksCleared => {
                    let a = apply(router, worker, feed, &KvEvent::Cleared)?;
                    out.events_applied += 1;
                    out.blocks_cleared += a.removed;
                    for target in feed.groups.values() {
                        if let Target::Side(g, spec) = *target {
                            let a = router.apply_group_event(worker, g, spec, &KvEvent::Cleared)?;
                            out.blocks_cleared += a.removed;
                        }
                    }
                    feed.blocks.clear();
                    feed.refs.clear();
                }
            }
        }
        feed.totals.add(&out);
        Ok(out)
    }

    /// Counts a rejected batch of a registered worker, and checks the worker is registered.
    fn counting_rejects<T>(
        &mut self,
        router: &Router,
        worker: WorkerId,
        r: Result<T, VllmError>,
    ) -> Result<T, VllmError> {
        // An engine whose ranks have workers of their own need not be registered itself.
        let ranked = || self.ranks.keys().any(|&(e, _)| e == worker);
        if router.index().worker_index(worker).is_none() && !ranked() {
            return Err(kvroute::Error::UnknownWorker { worker }.into());
        }
        if r.is_err() {
            self.feeds.entry(worker).or_default().totals.rejected += 1;
        }
        r
    }

    /// Forgets `worker`'s feed (hash map, expected sequence number, totals) and the rank it
    /// stood for, for example after removing it from the router. Returns whether it had a feed.
    pub fn forget_worker(&mut self, worker: WorkerId) -> bool {
        if let Some(key) = self.rank_of.remove(&worker) {
            self.ranks.remove(&(key.0, i64::from(key.1)));
        }
        self.feeds.remove(&worker).is_some()
    }

    /// The next batch sequence number expected from `worker` (0 for a new one).
    pub fn next_seq(&self, worker: WorkerId) -> u64 {
        self.feeds.get(&worker).map_or(0, |f| f.next_seq)
    }

    /// Our hash of a block the worker's engine names `engine`, while it is resident.
    /// (In the group the router's index mirrors; see [`our_hash_in`](Self::our_hash_in).)
    pub fn our_hash(&self, worker: WorkerId, engine: &EngineHash) -> Option<BlockHash> {
        let feed = self.feeds.get(&worker)?;
        let key = feed.primary.unwrap_or(None);
        feed.blocks.get(&(key, engine.clone())).copied()
    }

    /// Our hash of a block of KV-cache group `group` (`None`: an engine without groups) that
    /// the worker's engine names `engine`, while it is resident.
    pub fn our_hash_in(
        &self,
        worker: WorkerId,
        group: Option<u32>,
        engine: &EngineHash,
    ) -> Option<BlockHash> {
        self.feeds
            .get(&worker)?
            .blocks
            .get(&(group, engine.clone()))
            .copied()
    }

    /// How many engine hashes of `worker` are mapped to ours, over all its groups (its resident
    /// blocks, as reported).
    pub fn mapped_blocks(&self, worker: WorkerId) -> usize {
        self.feeds.get(&worker).map_or(0, |f| f.blocks.len())
    }

    /// `worker`'s running totals (all zero for an unknown worker).
    pub fn stats(&self, worker: WorkerId) -> IngestStats {
        self.feeds
            .get(&worker)
            .map_or_else(IngestStats::default, |f| f.totals)
    }

    pub(super) fn feed(&self, worker: WorkerId) -> Option<&Feed> {
        self.feeds.get(&worker)
    }

    pub(super) fn feed_mut(&mut self, worker: WorkerId) -> &mut Feed {
        self.feeds.entry(worker).or_default()
    }

    pub(super) fn insert_feed(&mut self, worker: WorkerId, feed: Feed) {
        self.feeds.insert(worker, feed);
    }

    /// Workers with a feed, in id order.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut w: Vec<WorkerId> = self.feeds.keys().copied().collect();
        w.sort_unstable();
        w
    }
}

impl Feed {
    /// The part a snapshot keeps: the index's group only (see [`MirrorSnapshot`]).
    pub(super) fn snapshot(&self, worker: WorkerId) -> FeedSnapshot {
        let key = self.primary.unwrap_or(None);
        let mut blocks: Vec<(EngineHash, BlockHash)> = self
            .blocks
            .iter()
            .filter(|((g, _), _)| self.primary.is_some() && *g == key)
            .map(|((_, h), &ours)| (h.clone(), ours))
            .collect();
        blocks.sort_unstable();
        FeedSnapshot {
            worker,
            next_seq: self.next_seq,
            position: self.position,
            group_known: self.primary.is_some(),
            group: key,
            blocks,
            skip_id: self.skip_id,
        }
    }

    /// The feed of a snapshot; an engine hash listed twice is returned as the error.
    pub(super) fn restore(s: FeedSnapshot) -> Result<Feed, EngineHash> {
        let mut f = Feed {
            next_seq: s.next_seq,
            position: s.position,
            primary: s.group_known.then_some(s.group),
            skip_id: s.skip_id,
            ..Feed::default()
        };
        if let Some(key) = f.primary {
            f.groups.insert(key, Target::Primary);
            for (h, ours) in s.blocks {
                if f.blocks.insert((key, h.clone()), ours).is_some() {
                    return Err(h);
                }
                *f.refs.entry((key, ours)).or_insert(0) += 1;
            }
        }
        Ok(f)
    }

    /// Where a `BlockStored`'s group goes, learned from its first event.
    fn target_of(&mut self, st: &BlockStored, bs: BlockSize, out: &mut IngestSummary) -> Target {
        let key = st.group_idx;
        let (rule, known) = rule_of(st);
        out.unknown_group_kinds += usize::from(!known);
        if let Some(&t) = self.groups.get(&key) {
            return t;
        }
        let block_size = usize::try_from(st.block_size)
            .ok()
            .and_then(|b| BlockSize::new(b).ok());
        let target = match block_size {
            Some(b) if b == bs && rule == GroupRule::FullAttention && self.primary.is_none() => {
                self.primary = Some(key);
                Target::Primary
            }
            Some(b) if b.get() % bs.get() == 0 => {
                Target::Side(key.unwrap_or(0), CacheGroup::new(rule, b))
            }
            _ => Target::Untracked,
        };
        self.groups.insert(key, target);
        target
    }

    /// Counts one more engine block of `key` mapped to `ours`; true when it is the first.
    fn hold(&mut self, key: GroupKey, ours: BlockHash) -> bool {
        let n = self.refs.entry((key, ours)).or_insert(0);
        *n += 1;
        *n == 1
    }

    /// Counts one engine block of `key` less mapped to `ours`; true when it was the last.
    fn release(&mut self, key: GroupKey, ours: BlockHash) -> bool {
        match self.refs.get_mut(&(key, ours)) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.refs.remove(&(key, ours));
                true
            }
            None => true,
        }
    }
}

/// The hit rule of a `BlockStored`'s group, and whether its kind is known.
fn rule_of(st: &BlockStored) -> (GroupRule, bool) {
    match (
        st.kv_cache_spec_kind.as_deref(),
        st.kv_cache_spec_sliding_window,
    ) {
        (None | Some("full_attention" | "mla_attention" | "sink_full_attention"), _) => {
            (GroupRule::FullAttention, true)
        }
        (Some("sliding_window" | "sliding_window_mla"), Some(w)) => (
            GroupRule::SlidingWindow {
                window_tokens: usize::try_from(w).unwrap_or(usize::MAX),
            },
            true,
        ),
        (Some("mamba"), _) => (GroupRule::LastState, true),
        _ => (GroupRule::FullAttention, false),
    }
}

/// A block's extra keys for our hash: the engine's, less the LoRA name vLLM puts first (it
/// salts the hasher already) and SGLang's prefixed copies of the cache salt; the cache salt
/// (SGLang's metadata, or its prefixed key) keys the prompt's first block only, as
/// [`kvblock::vllm_extra_keys`] keys a request's (later blocks carry it through the chain).
fn block_keys(st: &BlockStored, i: usize) -> ExtraKeys {
    let values: &[KeyValue] = match st.extra_keys.get(i) {
        Some(Some(values)) => values,
        _ => &[],
    };
    let values = match (values.first(), &st.lora_name) {
        (Some(KeyValue::Str(first)), Some(name)) if first == name => &values[1..],
        _ => values,
    };
    let mut salt = st.cache_salt.as_deref();
    let mut keys = ExtraKeys::new();
    for v in values {
        match v {
            // SGLang's layout repeats its metadata's salt here; a vLLM key that merely starts
            // so (a client's own cache_salt) is an ordinary key.
            KeyValue::Str(s)
                if st.cache_salt.is_some() && s.starts_with(SGLANG_CACHE_SALT_PREFIX) =>
            {
                salt = salt.or(s.get(SGLANG_CACHE_SALT_PREFIX.len()..));
            }
            v => v.push_onto(&mut keys),
        }
    }
    if i == 0 && st.parent_block_hash.is_none() {
        if let Some(salt) = salt.filter(|s| !s.is_empty()) {
            keys.push_str(salt);
        }
    }
    keys
}

/// Re-hashes and applies one `BlockStored` to its target.
fn store(
    router: &mut Router,
    worker: WorkerId,
    feed: &mut Feed,
    st: &BlockStored,
    target: Target,
    out: &mut IngestSummary,
) -> Result<(), VllmError> {
    let key = st.group_idx;
    let factor = match target {
        Target::Untracked => {
            out.untracked_blocks += st.block_hashes.len();
            return Ok(());
        }
        Target::Primary => 1,
        Target::Side(_, spec) => spec.block_size.get() / router.block_size().get(),
    };
    let keyed = st.cache_salt.is_some() || !st.extra_keys.iter().all(Option::is_none);
    if factor > 1 && keyed {
        // Our hashes key router-sized blocks; a larger block's keys cannot be split onto them.
        out.untracked_blocks += st.block_hashes.len();
        return Ok(());
    }
    let parent = match &st.parent_block_hash {
        None => None,
        // The parent in this group or, for a group at the router's block size, in the index's
        // group: vLLM names a block by the same hash in every group, and a sliding-window or
        // Mamba group may have evicted (or never kept) a parent the full-attention group holds.
        Some(h) => match feed.blocks.get(&(key, h.clone())).or_else(|| {
            let primary = feed.primary.filter(|_| factor == 1)?;
            feed.blocks.get(&(primary, h.clone()))
        }) {
            Some(&p) => Some(p),
            None => {
                out.unknown_parents += 1;
                if target == Target::Primary {
                    feed.skip_id = true;
                }
                return Ok(());
            }
        },
    };
    if st.block_hashes.is_empty() {
        return Ok(());
    }
    let hasher =
        BlockHasher::new(router.block_size()).with_lora_name(st.lora_name.as_deref().unwrap_or(""));
    let keys: Vec<ExtraKeys> = if factor == 1 && keyed {
        (0..st.block_hashes.len())
            .map(|i| block_keys(st, i))
            .collect()
    } else {
        Vec::new()
    };
    let mut fine = Vec::with_capacity(st.block_hashes.len() * factor);
    hasher.sequence_hashes_keyed_into(parent, &st.token_ids, &keys, &mut fine);
    // A group block is named by our hash of its last router block.
    let ours: Vec<BlockHash> = if factor == 1 {
        fine
    } else {
        fine.into_iter().skip(factor - 1).step_by(factor).collect()
    };
    // Map the engine's blocks to ours now (undone below if the index refuses the event); the
    // same engine block stored again is held once.
    let mut mapped = Vec::new();
    let mut new = Vec::new();
    for (i, (e, &o)) in st.block_hashes.iter().zip(&ours).enumerate() {
        match feed.blocks.entry((key, e.clone())) {
            Entry::Occupied(x) if *x.get() == o => continue,
            Entry::Occupied(mut x) => {
                x.insert(o);
            }
            Entry::Vacant(x) => {
                x.insert(o);
            }
        }
        mapped.push(i);
        if feed.hold(key, o) {
            new.push(o);
        }
    }
    let applied = match target {
        Target::Side(g, spec) => {
            out.already_present += ours.len() - new.len();
            let ev = KvEvent::Stored {
                parent,
                blocks: new,
            };
            router.apply_group_event(worker, g, spec, &ev)
        }
        _ => {
            // The index wants the event's chain unbroken: store every block, new or not.
            let ev = KvEvent::Stored {
                parent,
                blocks: ours,
            };
            apply(router, worker, feed, &ev)
        }
    };
    if applied.is_err() {
        for &i in &mapped {
            if let Some(o) = feed.blocks.remove(&(key, st.block_hashes[i].clone())) {
                feed.release(key, o);
            }
        }
    }
    match applied {
        Ok(a) => {
            out.events_applied += 1;
            out.blocks_stored += a.stored;
            out.already_present += a.already_present;
        }
        // The index no longer holds the parent: it consumed the id and marked the worker stale.
        Err(kvroute::Error::Index(kvcache::Error::UnknownParent { .. })) => {
            out.unknown_parents += 1;
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// Applies one router event with the next router event id of `worker` (skipping one when the
/// feed asks for a gap).
fn apply(
    router: &mut Router,
    worker: WorkerId,
    feed: &mut Feed,
    event: &KvEvent,
) -> Result<kvcache::Applied, kvroute::Error> {
    // The index's own counter, so events applied to the router directly do not collide.
    let next = router.index().next_event_id(worker).unwrap_or(0);
    let id = next.saturating_add(u64::from(std::mem::take(&mut feed.skip_id)));
    router.apply_event(worker, id, event)
}

/// Checks what can be checked without state: block sizes and token counts.
/// Applies an event to the worker's mirror of a lower tier, with that tier's next event id.
fn apply_lower(
    router: &mut Router,
    worker: WorkerId,
    feed: &mut Feed,
    tier: Tier,
    event: KvEvent,
) -> Result<kvcache::Applied, VllmError> {
    let id = feed.lower_ids.entry(tier).or_insert(0);
    let a = router.apply_tier_event(worker, tier, *id, &event)?;
    *id += 1;
    Ok(a)
}

fn validate(batch: &EventBatch, router_block_size: usize) -> Result<(), VllmError> {
    for (i, e) in batch.events.iter().enumerate() {
        let EngineEvent::BlockStored(s) = e else {
            continue;
        };
        // An offloaded block names a block the device held; it carries no tokens.
        if Tier::from_medium(s.medium.as_deref()) != Tier::Device {
            continue;
        }
        // The group the router hashes with must be at its block size; other groups may differ.
        let hashed_with = s.group_idx.unwrap_or(0) == 0 && rule_of(s).0 == GroupRule::FullAttention;
        if hashed_with && usize::try_from(s.block_size).ok() != Some(router_block_size) {
            return Err(VllmError::BlockSizeMismatch {
                event: i,
                engine: s.block_size,
                router: router_block_size,
            });
        }
        if !s.extra_keys.is_empty() && s.extra_keys.len() != s.block_hashes.len() {
            return Err(VllmError::ExtraKeysCountMismatch {
                event: i,
                keys: s.extra_keys.len(),
                blocks: s.block_hashes.len(),
            });
        }
        let expected = (s.block_hashes.len() as u64).saturating_mul(s.block_size);
        if s.token_ids.len() as u64 != expected {
            return Err(VllmError::TokenCountMismatch {
                event: i,
                tokens: s.token_ids.len(),
                blocks: s.block_hashes.len(),
                block_size: s.block_size,
                expected,
            });
        }
    }
    Ok(())
}
