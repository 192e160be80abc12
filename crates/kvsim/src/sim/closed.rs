//! Closed loops: sessions whose turns wait for the previous one (and its think time), and the
//! concurrency gate on requests in flight.

use super::*;

/// A closed-loop run's plan and state: which turns wait for which, and the concurrency gate.
pub(super) struct Closed {
    pub(super) turns: Vec<Turn>,
    /// The next turn of each turn's session.
    pub(super) next_turn: Vec<Option<usize>>,
    /// First turns in plan order, and how many have been made ready.
    pub(super) roots: Vec<usize>,
    pub(super) next_root: usize,
    /// Requests in flight at most, and now.
    pub(super) limit: Option<usize>,
    pub(super) in_flight: usize,
    /// Ready turns waiting for a slot, first come first served.
    pub(super) queue: std::collections::VecDeque<usize>,
    /// The plan index of each sent request (by request id).
    pub(super) turn_of: Vec<usize>,
}

impl Closed {
    pub(super) fn new(cfg: &SimConfig) -> Option<Self> {
        let turns = closed_plan(cfg)?;
        let mut next_turn = vec![None; turns.len()];
        let mut roots = Vec::new();
        for (j, t) in turns.iter().enumerate() {
            match t.prev {
                Some(p) => next_turn[p] = Some(j),
                None => roots.push(j),
            }
        }
        Some(Closed {
            turns,
            next_turn,
            roots,
            next_root: 0,
            limit: cfg.concurrency,
            in_flight: 0,
            queue: std::collections::VecDeque::new(),
            turn_of: Vec::new(),
        })
    }
}

impl Run<'_> {
    /// Closed loop: makes the next first turn ready at its time.
    pub(super) fn schedule_next_root(&mut self) {
        let Some(c) = &self.closed else { return };
        if let Some(&j) = c.roots.get(c.next_root) {
            let t = c.turns[j].spec.arrival_us;
            self.push(t, Kind::Ready(j));
        }
    }

    /// Closed loop: turn `j` may go; it is sent if a slot is free, else queued.
    pub(super) fn ready(&mut self, j: usize) {
        let Some(c) = self.closed.as_mut() else {
            return;
        };
        let root = c.turns[j].prev.is_none();
        if root {
            c.next_root += 1;
        }
        let free = c.limit.is_none_or(|n| c.in_flight < n);
        if free {
            c.in_flight += 1;
        } else {
            c.queue.push_back(j);
        }
        if root {
            self.schedule_next_root();
        }
        if free {
            self.send_turn(j);
        }
    }

    /// Closed loop: sends turn `j` (its slot is taken).
    pub(super) fn send_turn(&mut self, j: usize) {
        let Some(c) = self.closed.as_mut() else {
            return;
        };
        let t = &mut c.turns[j];
        let (spec, turn) = (std::mem::replace(&mut t.spec, RequestSpec::empty()), t.turn);
        let session = t.session;
        c.turn_of.push(j);
        self.send(spec, turn, session);
    }

    /// Closed loop: request `id` is over (finished or rejected): its session's next turn
    /// becomes ready after its think time, and a queued turn takes the slot.
    pub(super) fn request_done(&mut self, id: usize) {
        let Some(c) = self.closed.as_mut() else {
            return;
        };
        let j = c.turn_of[id];
        c.in_flight -= 1;
        let next = c.next_turn[j].map(|k| {
            let t = &c.turns[k];
            (
                k,
                self.now.saturating_add(t.think_us).max(t.spec.arrival_us),
            )
        });
        let queued = c.queue.pop_front();
        if queued.is_some() {
            c.in_flight += 1;
        }
        if let Some((k, at)) = next {
            self.push(at, Kind::Ready(k));
        }
        if let Some(q) = queued {
            self.push(self.now, Kind::Send(q));
        }
    }
}
