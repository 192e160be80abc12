//! Router replicas that share their in-flight load: this replica's routes and finishes queued
//! as [`LoadDelta`]s, and the other replicas' deltas applied to its load view.

use super::*;

/// Another replica's request in flight on one of our workers.
#[derive(Debug, Clone)]
pub(super) struct Remote {
    pub(super) slot: usize,
    pub(super) generation: u64,
    pub(super) blocks: Vec<BlockHash>,
    /// Blocks still counted as its worker's pending prefill.
    pub(super) prefill: Option<usize>,
    pub(super) expires: Duration,
}

impl Router {
    /// Queues a delta of this replica's, when it shares its load.
    pub(super) fn share(&mut self, change: LoadChange) {
        if let Some(replica) = self.config.replica {
            self.outbox
                .push(LoadDelta::new(replica, self.next_delta, change));
            self.next_delta += 1;
        }
    }

    /// This replica's load deltas since the last call, in order, to send to the other replicas
    /// (empty unless built with [`RouterBuilder::replica`]).
    pub fn drain_load_deltas(&mut self) -> Vec<LoadDelta> {
        std::mem::take(&mut self.outbox)
    }

    /// Applies another replica's load delta to this router's load view, at time `now` (any
    /// monotonic clock the replica uses for [`expire_remote_load`](Self::expire_remote_load)).
    /// Idempotent: a delta seen twice counts once, a `Finished` that arrives before its
    /// `Routed` cancels it, and this replica's own deltas are ignored. A route to a worker this
    /// router does not know is ignored. Returns whether the load changed.
    ///
    /// ```
    /// use kvblock::BlockHash;
    /// use kvroute::{RequestId, Role, Router, WorkerId};
    /// let w = WorkerId::new(0);
    /// let mut a = Router::builder().replica(1).build()?;
    /// let mut b = Router::builder().replica(2).build()?;
    /// a.add_worker(w);
    /// b.add_worker(w);
    /// let blocks = [BlockHash::new(1), BlockHash::new(2)];
    /// a.route(RequestId::new(7), &blocks, Role::Unified)?;
    /// let now = std::time::Duration::ZERO;
    /// for d in a.drain_load_deltas() {
    ///     assert!(b.apply_load_delta(&d, now));
    ///     assert!(!b.apply_load_delta(&d, now)); // a duplicate
    /// }
    /// assert_eq!(b.active_blocks(w), 2);
    /// a.finish(RequestId::new(7))?;
    /// for d in a.drain_load_deltas() {
    ///     b.apply_load_delta(&d, now);
    /// }
    /// assert_eq!(b.active_blocks(w), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_load_delta(&mut self, delta: &LoadDelta, now: Duration) -> bool {
        if Some(delta.replica) == self.config.replica {
            return false;
        }
        let ttl = self.config.remote_ttl;
        match &delta.change {
            LoadChange::Routed {
                request,
                worker,
                blocks,
                pending,
                session,
            } => {
                let key = (delta.replica, *request);
                if self.remote.contains_key(&key) || self.tombstones.contains_key(&key) {
                    return false;
                }
                if let Some(s) =
                    session.filter(|_| self.config.session_affinity != SessionAffinity::Off)
                {
                    self.sessions.record(s, *worker, self.now);
                }
                let Some(i) = self.member_index(*worker) else {
                    return false;
                };
                let Some(load) = self.slots[i].as_mut() else {
                    return false;
                };
                // Its first token may have been reported before its route arrived.
                let prefill = pending.filter(|_| self.prefilled.remove(&key).is_none());
                load.blocks.add(blocks);
                match prefill {
                    Some(p) => load.pending += p,
                    None => load.decode.add(blocks),
                }
                let generation = load.generation;
                self.mirror(i);
                let predicted = self.config.predicted_ttl;
                if !predicted.is_zero() {
                    // On this router's clock, like its own predictions, so the expiry queue
                    // stays in order.
                    let lapses = self.now.saturating_add(predicted);
                    // Each run of blocks the index does not hold.
                    let mut at = 0;
                    while at < blocks.len() {
                        let held = |b: &BlockHash| self.index.holds(*worker, *b);
                        let start = at + blocks[at..].iter().take_while(|b| held(b)).count();
                        let len = blocks[start..].iter().take_while(|b| !held(b)).count();
                        self.predicted
                            .add(i, start, &blocks[start..start + len], lapses);
                        at = start + len;
                    }
                }
                self.remote.insert(
                    key,
                    Remote {
                        slot: i,
                        generation,
                        blocks: blocks.clone(),
                        prefill,
                        expires: now.saturating_add(ttl),
                    },
                );
                true
            }
            LoadChange::PrefillDone { request } => {
                let key = (delta.replica, *request);
                let Some(r) = self.remote.get_mut(&key) else {
                    if !self.tombstones.contains_key(&key) {
                        self.prefilled.insert(key, now.saturating_add(ttl));
                    }
                    return false;
                };
                let Some(p) = r.prefill.take() else {
                    return false;
                };
                match self.slots.get_mut(r.slot).and_then(Option::as_mut) {
                    Some(load) if load.generation == r.generation => {
                        load.pending -= p;
                        load.decode.add(&r.blocks);
                        let slot = r.slot;
                        self.mirror(slot);
                        true
                    }
                    _ => false,
                }
            }
            LoadChange::Finished { request } => {
                let key = (delta.replica, *request);
                // Remembered, so that a late or repeated `Routed` never counts it again.
                self.tombstones.insert(key, now.saturating_add(ttl));
                self.prefilled.remove(&key);
                match self.remote.remove(&key) {
                    Some(r) => self.release_remote(&r),
                    None => false,
                }
            }
        }
    }

    pub(super) fn release_remote(&mut self, r: &Remote) -> bool {
        match self.slots.get_mut(r.slot).and_then(Option::as_mut) {
            Some(load) if load.generation == r.generation => {
                load.blocks.release(&r.blocks);
                match r.prefill {
                    Some(p) => load.pending -= p,
                    None => load.decode.release(&r.blocks),
                }
                self.mirror(r.slot);
                true
            }
            _ => false,
        }
    }

    /// Drops other replicas' requests whose time to live ended by `now` (their `Finished` was
    /// lost, or the replica died), and forgets finished ones as old (a `Routed` delayed longer
    /// than the time to live would count again). Call it now and then: until then every remote
    /// request seen finished takes a few dozen bytes. Returns how many
    /// requests were dropped.
    pub fn expire_remote_load(&mut self, now: Duration) -> usize {
        let gone: Vec<(u64, RequestId)> = self
            .remote
            .iter()
            .filter(|(_, r)| r.expires <= now)
            .map(|(k, _)| *k)
            .collect();
        for k in &gone {
            if let Some(r) = self.remote.remove(k) {
                self.release_remote(&r);
            }
        }
        self.tombstones.retain(|_, t| *t > now);
        self.prefilled.retain(|_, t| *t > now);
        gone.len()
    }

    /// Other replicas' requests counted in this router's load.
    pub fn remote_in_flight(&self) -> usize {
        self.remote.len()
    }
}
