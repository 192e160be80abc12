//! [`VllmIngest`]: decoded batches applied to a [`Router`], with per-worker sequence numbers and
//! engine-hash to our-hash maps.

use kvblock::{BlockHash, BlockHasher};
use kvcache::{FixedState, KvEvent, WorkerId};

use super::{decode_event_batch, parse_seq_frame, EngineEvent, EngineHash, EventBatch, VllmError};
use crate::Router;

type Map<K, V> = hashbrown::HashMap<K, V, FixedState>;

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
}

/// Running totals of one worker's vLLM feed, since [`VllmIngest`] first saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IngestStats {
    /// Batches applied.
    pub batches: u64,
    /// Batches rejected (malformed, invalid or duplicate).
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
    }
}

#[derive(Debug, Clone, Default)]
struct Feed {
    /// Engine hash -> our hash, for the blocks the worker holds.
    blocks: Map<EngineHash, BlockHash>,
    /// The next batch sequence number expected.
    next_seq: u64,
    /// Skip one router event id at the next apply, so the index records a gap (stale view).
    skip_id: bool,
    totals: IngestStats,
}

/// Applies vLLM event batches to a [`Router`], one feed per worker: engine-to-ours hash maps,
/// sequence checking and counters. See the [module docs](super) for the rules.
///
/// Keep one `VllmIngest` beside each `Router` (for example in the same mutex). When a worker is
/// removed from the router, call [`forget_worker`](Self::forget_worker) too.
#[derive(Debug, Clone, Default)]
pub struct VllmIngest {
    feeds: Map<WorkerId, Feed>,
}

impl VllmIngest {
    /// An adapter that knows no worker yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one ZMQ multipart message `(topic, sequence number, payload)` of `worker`'s
    /// publisher. The topic is not interpreted.
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
        let checked = validate(batch, router.block_size().get());
        self.counting_rejects(router, worker, checked)?;
        let feed = self.feeds.entry(worker).or_default();
        let expected = feed.next_seq;
        let seq = seq.unwrap_or(expected);
        let mut out = IngestSummary {
            seq,
            events: batch.events.len(),
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
            feed.skip_id = false;
        }
        feed.next_seq = seq.saturating_add(1);
        let bs = router.block_size();
        for event in &batch.events {
            match event {
                EngineEvent::BlockStored(s) => {
                    let parent = match &s.parent_block_hash {
                        None => None,
                        Some(h) => match feed.blocks.get(h) {
                            Some(&p) => Some(p),
                            None => {
                                out.unknown_parents += 1;
                                feed.skip_id = true;
                                continue;
                            }
                        },
                    };
                    if s.block_hashes.is_empty() {
                        continue;
                    }
                    let hasher =
                        BlockHasher::new(bs).with_lora_name(s.lora_name.as_deref().unwrap_or(""));
                    let mut blocks = Vec::with_capacity(s.block_hashes.len());
                    hasher.sequence_hashes_into(parent, &s.token_ids, &mut blocks);
                    let ev = KvEvent::Stored { parent, blocks };
                    match apply(router, worker, feed, &ev) {
                        Ok(a) => {
                            out.events_applied += 1;
                            out.blocks_stored += a.stored;
                            out.already_present += a.already_present;
                            if let KvEvent::Stored { blocks, .. } = ev {
                                // `validate` checked one token block per engine hash.
                                for (e, ours) in s.block_hashes.iter().zip(blocks) {
                                    feed.blocks.insert(e.clone(), ours);
                                }
                            }
                        }
                        // The index no longer holds the parent: it consumed the id and marked
                        // the worker stale.
                        Err(crate::Error::Index(kvcache::Error::UnknownParent { .. })) => {
                            out.unknown_parents += 1;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                EngineEvent::BlockRemoved(r) => {
                    let mut blocks = Vec::with_capacity(r.block_hashes.len());
                    for h in &r.block_hashes {
                        match feed.blocks.remove(h) {
                            Some(ours) => blocks.push(ours),
                            None => out.unknown_removals += 1,
                        }
                    }
                    if !blocks.is_empty() {
                        let a = apply(router, worker, feed, &KvEvent::Removed { blocks })?;
                        out.events_applied += 1;
                        out.blocks_removed += a.removed;
                        out.unknown_removals += a.unknown_removed;
                    }
                }
                EngineEvent::AllBlocksCleared => {
                    let a = apply(router, worker, feed, &KvEvent::Cleared)?;
                    out.events_applied += 1;
                    out.blocks_cleared += a.removed;
                    feed.blocks.clear();
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
        if router.index().worker_index(worker).is_none() {
            return Err(crate::Error::UnknownWorker { worker }.into());
        }
        if r.is_err() {
            self.feeds.entry(worker).or_default().totals.rejected += 1;
        }
        r
    }

    /// Forgets `worker`'s feed (hash map, expected sequence number, totals), for example after
    /// removing it from the router. Returns whether it was known.
    pub fn forget_worker(&mut self, worker: WorkerId) -> bool {
        self.feeds.remove(&worker).is_some()
    }

    /// The next batch sequence number expected from `worker` (0 for a new one).
    pub fn next_seq(&self, worker: WorkerId) -> u64 {
        self.feeds.get(&worker).map_or(0, |f| f.next_seq)
    }

    /// Our hash of a block the worker's engine names `engine`, while it is resident.
    pub fn our_hash(&self, worker: WorkerId, engine: &EngineHash) -> Option<BlockHash> {
        self.feeds.get(&worker)?.blocks.get(engine).copied()
    }

    /// How many engine hashes of `worker` are mapped to ours (its resident blocks, as reported).
    pub fn mapped_blocks(&self, worker: WorkerId) -> usize {
        self.feeds.get(&worker).map_or(0, |f| f.blocks.len())
    }

    /// `worker`'s running totals (all zero for an unknown worker).
    pub fn stats(&self, worker: WorkerId) -> IngestStats {
        self.feeds
            .get(&worker)
            .map_or_else(IngestStats::default, |f| f.totals)
    }

    /// Workers with a feed, in id order.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut w: Vec<WorkerId> = self.feeds.keys().copied().collect();
        w.sort_unstable();
        w
    }
}

/// Applies one router event with the next router event id of `worker` (skipping one when the
/// feed asks for a gap).
fn apply(
    router: &mut Router,
    worker: WorkerId,
    feed: &mut Feed,
    event: &KvEvent,
) -> Result<kvcache::Applied, crate::Error> {
    // The index's own counter, so events applied to the router directly do not collide.
    let next = router.index().next_event_id(worker).unwrap_or(0);
    let id = next.saturating_add(u64::from(std::mem::take(&mut feed.skip_id)));
    router.apply_event(worker, id, event)
}

/// Checks what can be checked without state: block sizes and token counts.
fn validate(batch: &EventBatch, router_block_size: usize) -> Result<(), VllmError> {
    for (i, e) in batch.events.iter().enumerate() {
        let EngineEvent::BlockStored(s) = e else {
            continue;
        };
        if usize::try_from(s.block_size).ok() != Some(router_block_size) {
            return Err(VllmError::BlockSizeMismatch {
                event: i,
                engine: s.block_size,
                router: router_block_size,
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
