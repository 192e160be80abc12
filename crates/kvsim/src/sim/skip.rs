//! Skipping quiet steps: an engine's run of pure decode steps in which nothing but the step
//! count and the context changes is planned ahead as a chain instead of queued step by step,
//! and committed, or cut short by an interruption, so that every event still runs in the order
//! the step-by-step loop would have given it.

use super::*;

/// Quiet steps skipped at most in one go (bounds the lookahead an interruption may waste).
pub(super) const MAX_CHAIN: u64 = 4096;

impl Event {
    /// The handled event whose push made this one: a real one, told by the push's insertion
    /// number, or a skipped step.
    pub(super) fn pusher(&self) -> Node {
        match self.kind {
            Kind::StepDone(e, _) if self.ahead => Node::Quiet(e, self.pos),
            _ => Node::Real {
                seq: self.seq,
                time: self.vpush,
                vpush: self.ppush,
            },
        }
    }
}

/// An event as the step-by-step loop handles it, for ordering same-time pushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Node {
    /// A handled event, by the insertion number of a push it made, its time and push time.
    Real { seq: u64, time: u64, vpush: u64 },
    /// Skipped step `.1` of engine `.0`'s chain.
    Quiet(usize, usize),
}

/// An engine's run of quiet steps, skipped rather than queued one by one: steps that start at
/// `t0` and end at `ends[0]`, `ends[1]`, ..., followed by the step whose end is queued.
#[derive(Debug, Default)]
pub(super) struct Chain {
    pub(super) active: bool,
    pub(super) t0: u64,
    pub(super) ends: Vec<u64>,
    /// The insertion number the first step's end would have had, and that push's `ppush`.
    pub(super) seq0: u64,
    pub(super) ppush0: u64,
}

impl Chain {
    /// Start time of skipped step `j` (0-based), which is the end of the one before.
    pub(super) fn start(&self, j: usize) -> u64 {
        if j == 0 {
            self.t0
        } else {
            self.ends[j - 1]
        }
    }
}

impl Run<'_> {
    pub(super) fn node_vpush(&self, n: Node) -> u64 {
        match n {
            Node::Real { vpush, .. } => vpush,
            Node::Quiet(e, j) => self.chains[e].start(j),
        }
    }

    pub(super) fn node_parent(&self, n: Node) -> Option<Node> {
        match n {
            Node::Real { .. } => None,
            Node::Quiet(e, 0) => {
                let c = &self.chains[e];
                Some(Node::Real {
                    seq: c.seq0,
                    time: c.t0,
                    vpush: c.ppush0,
                })
            }
            Node::Quiet(e, j) => Some(Node::Quiet(e, j - 1)),
        }
    }

    /// The step-by-step loop's order of two events handled at the same time; `None` when
    /// what is known cannot tell.
    pub(super) fn order(&self, mut a: Node, mut b: Node) -> Option<std::cmp::Ordering> {
        loop {
            if a == b {
                return None;
            }
            if let (Node::Real { seq: x, .. }, Node::Real { seq: y, .. }) = (a, b) {
                return Some(x.cmp(&y));
            }
            match self.node_vpush(a).cmp(&self.node_vpush(b)) {
                std::cmp::Ordering::Equal => {}
                o => return Some(o),
            }
            a = self.node_parent(a)?;
            b = self.node_parent(b)?;
        }
    }

    pub(super) fn is_stale(&self, ev: &Event) -> bool {
        matches!(ev.kind, Kind::StepDone(e, g) if g != self.gens[e])
    }

    /// Queues `ev` (its `seq` already set). Where it shares (time, vpush) with a queued event
    /// and one of them was pushed ahead, their order is that of the pushes' parents (by
    /// `ppush`): an ahead `StepDone` that must come later is pushed again; anything else
    /// marks the run ambiguous.
    pub(super) fn push_event(&mut self, ev: Event) {
        let mut requeue = Vec::new();
        if self.fast && (ev.ahead || self.ahead_queued > 0) {
            for o in self.queue.iter() {
                if o.time != ev.time || o.vpush != ev.vpush || !(o.ahead || ev.ahead) {
                    continue;
                }
                if self.is_stale(o) {
                    continue;
                }
                let Some(want) = self.order(ev.pusher(), o.pusher()) else {
                    self.ambiguous = true;
                    continue;
                };
                if want == ev.seq.cmp(&o.seq) {
                    continue; // already in the right order
                }
                // `o` must come after `ev`, which has the higher insertion number.
                match o.kind {
                    Kind::StepDone(e, _) if o.ahead && want.is_lt() && ev.seq > o.seq => {
                        requeue.push(e);
                    }
                    _ => self.ambiguous = true,
                }
            }
        }
        if ev.ahead {
            self.ahead_queued += 1;
        }
        self.queue.push(ev);
        for e in requeue {
            self.requeue(e);
        }
    }

    /// Pushes engine `e`'s queued (ahead) `StepDone` again, with a new insertion number.
    pub(super) fn requeue(&mut self, e: usize) {
        let gen = self.gens[e];
        let Some(old) = self
            .queue
            .iter()
            .find(|o| matches!(o.kind, Kind::StepDone(x, g) if x == e && g == gen))
        else {
            return;
        };
        let (time, vpush, ppush, ahead, pos) = (old.time, old.vpush, old.ppush, old.ahead, old.pos);
        self.gens[e] = gen.wrapping_add(1);
        self.seq += 1;
        self.push_event(Event {
            time,
            vpush,
            seq: self.seq,
            ppush,
            ahead,
            pos,
            kind: Kind::StepDone(e, self.gens[e]),
        });
    }

    /// Runs `n` of engine `e`'s skipped quiet steps for real and ends its chain.
    pub(super) fn commit(&mut self, e: usize, n: u64) {
        self.chains[e].active = false;
        let itl = &mut self.itl;
        // Quiet steps' durations change slowly: counted run by run.
        let (mut d, mut w) = (0, 0);
        self.fleet.engines[e].skip_quiet_steps(n, |step| {
            if step.duration_us != d {
                if w > 0 {
                    itl.add(d, w);
                }
                (d, w) = (step.duration_us, 0);
            }
            w += step.shape.decode_requests;
        });
        if w > 0 {
            itl.add(d, w);
        }
    }

    /// Something is about to be submitted to engine `e` now: the quiet steps the step-by-step
    /// loop would have finished before this event run for real, and the end of the step then
    /// in progress is queued in place of the chain's end (the next admission happens there).
    pub(super) fn interrupt(&mut self, e: usize) {
        let chain = &self.chains[e];
        if !chain.active {
            return;
        }
        let (t, v) = (self.now, self.cur_vpush);
        // The submitting event is a real one (an arrival or a transfer).
        let cur = Node::Real {
            seq: self.cur_seq,
            time: v,
            vpush: self.cur_ppush,
        };
        let mut m = 0;
        for j in 0..chain.ends.len() {
            let (end, start) = (chain.ends[j], chain.start(j));
            let before = if end != t {
                end < t
            } else if start != v {
                start < v
            } else {
                // Step j and the submitting event were pushed at the same time: by whom first.
                match self
                    .node_parent(Node::Quiet(e, j))
                    .and_then(|p| self.order(p, cur))
                {
                    Some(o) => o.is_lt(),
                    None => {
                        self.ambiguous = true;
                        false
                    }
                }
            };
            if !before {
                break;
            }
            m = j + 1;
        }
        let chain = &self.chains[e];
        let l = chain.ends.len();
        let (t0, seq0, ppush0) = (chain.t0, chain.seq0, chain.ppush0);
        let (end, vpush, ppush) = if m < l {
            (
                chain.ends[m],
                chain.start(m),
                if m == 0 { ppush0 } else { chain.start(m - 1) },
            )
        } else {
            (0, 0, 0)
        };
        self.commit(e, m as u64);
        if m == l {
            return; // the queued end is that of the step now in progress
        }
        self.gens[e] = self.gens[e].wrapping_add(1);
        let kind = Kind::StepDone(e, self.gens[e]);
        if m == 0 {
            // Exactly the push the step-by-step loop made at t0.
            debug_assert_eq!(vpush, t0);
            self.push_event(Event {
                time: end,
                vpush,
                seq: seq0,
                ppush,
                ahead: false,
                pos: 0,
                kind,
            });
        } else {
            self.seq += 1;
            self.push_event(Event {
                time: end,
                vpush,
                seq: self.seq,
                ppush,
                ahead: true,
                pos: m - 1,
                kind,
            });
        }
    }
}
