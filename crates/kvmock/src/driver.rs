//! [`Core`] against the wall clock, on its own thread: emulated time is wall time since start
//! times the speed-up. Arrivals are stamped when the server received them; the thread sleeps
//! until the step in progress ends (in emulated time) or a request arrives, whichever is first,
//! so tokens leave at their emulated times.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvsim::{EngineConfig, LinearTiming};
use tokio::sync::mpsc as tmpsc;

use crate::engine_loop::{Core, Counters, Lora, Note};
use crate::events::Publisher;

/// What a request's stream receives from the engine, stamped with emulated microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Handed to the engine.
    Arrived {
        /// Emulated time.
        at_us: u64,
    },
    /// Scheduled, with this many cached leading blocks.
    Admitted {
        /// Cached leading prompt blocks.
        cached_blocks: usize,
        /// Emulated time.
        at_us: u64,
    },
    /// One more output token.
    Token {
        /// Emulated time.
        at_us: u64,
    },
    /// The last token was produced.
    Finished {
        /// Emulated time.
        at_us: u64,
    },
    /// The request can never fit the engine.
    Rejected,
}

struct Submit {
    id: u64,
    arrived: Instant,
    tokens: Vec<u32>,
    output_len: usize,
    lora: Option<Lora>,
    cache_salt: Option<String>,
    tx: tmpsc::UnboundedSender<Progress>,
}

/// A handle on the engine thread; dropping every handle stops it.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Submit>,
    counters: Arc<Mutex<Counters>>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").finish_non_exhaustive()
    }
}

impl EngineHandle {
    /// Starts the engine thread. `speedup` > 0: emulated time runs that many times faster than
    /// the wall clock.
    pub fn start(
        cfg: EngineConfig,
        timing: LinearTiming,
        speedup: f64,
        publisher: Option<Publisher>,
    ) -> Self {
        let (tx, rx) = mpsc::channel();
        let counters = Arc::new(Mutex::new(Counters::default()));
        let shared = Arc::clone(&counters);
        std::thread::Builder::new()
            .name("kvmock-engine".into())
            .spawn(move || run(cfg, timing, speedup, publisher, rx, shared))
            .map(|_| ())
            .unwrap_or_else(|e| tracing::error!("cannot start the engine thread: {e}"));
        EngineHandle { tx, counters }
    }

    /// Hands a request that arrived at `arrived` (when the server received it), for LoRA
    /// adapter `lora` if any and with vLLM's `cache_salt` if any, to the engine; its progress
    /// arrives on the returned channel.
    pub fn submit(
        &self,
        id: u64,
        arrived: Instant,
        tokens: Vec<u32>,
        output_len: usize,
        lora: Option<Lora>,
        cache_salt: Option<String>,
    ) -> tmpsc::UnboundedReceiver<Progress> {
        let (tx, rx) = tmpsc::unbounded_channel();
        // If the engine thread is gone the receiver sees a closed channel.
        let _ = self.tx.send(Submit {
            id,
            arrived,
            tokens,
            output_len,
            lora,
            cache_salt,
            tx,
        });
        rx
    }

    /// The latest counters.
    pub fn counters(&self) -> Counters {
        self.counters.lock().map(|c| *c).unwrap_or_default()
    }
}

fn run(
    cfg: EngineConfig,
    timing: LinearTiming,
    speedup: f64,
    publisher: Option<Publisher>,
    rx: mpsc::Receiver<Submit>,
    shared: Arc<Mutex<Counters>>,
) {
    let start = Instant::now();
    let emu = |at: Instant| (at.duration_since(start).as_secs_f64() * 1e6 * speedup) as u64;
    let wall = |us: u64| start + Duration::from_secs_f64(us as f64 / 1e6 / speedup);
    let mut core = Core::new(cfg, timing, publisher.is_some());
    let mut streams: std::collections::HashMap<u64, tmpsc::UnboundedSender<Progress>> =
        std::collections::HashMap::new();
    let mut notes = Vec::new();
    let mut batches = Vec::new();
    kvserve::clock::precise_timers();
    loop {
        let got = match core.next_deadline() {
            Some(t) => recv_until(&rx, wall(t)),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match got {
            Ok(s) => {
                // The arrival is stamped when the server received it, so the hop to this
                // thread does not delay the request (unless the engine has moved past it).
                let t = emu(s.arrived.max(start)).max(core.now_us());
                let _ = s.tx.send(Progress::Arrived { at_us: t });
                streams.insert(s.id, s.tx);
                core.arrive_keyed(
                    t,
                    s.id,
                    &s.tokens,
                    s.output_len,
                    s.lora.as_ref(),
                    s.cache_salt.as_deref(),
                );
            }
            Err(RecvTimeoutError::Timeout) => {
                if let Some(t) = core.next_deadline() {
                    core.advance_to(t);
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
        core.take_notes(&mut notes);
        for n in notes.drain(..) {
            let (id, p) = match n {
                Note::Admitted {
                    id,
                    cached_blocks,
                    at_us,
                } => (
                    id,
                    Progress::Admitted {
                        cached_blocks,
                        at_us,
                    },
                ),
                Note::Token { id, at_us } => (id, Progress::Token { at_us }),
                Note::Finished { id, at_us } => (id, Progress::Finished { at_us }),
                Note::Rejected { id } => (id, Progress::Rejected),
            };
            let done = matches!(p, Progress::Finished { .. } | Progress::Rejected);
            if let Some(tx) = streams.get(&id) {
                // A client that went away stops listening; the engine still runs the request.
                let _ = tx.send(p);
            }
            if done {
                streams.remove(&id);
            }
        }
        if let Some(p) = &publisher {
            core.take_batches(&mut batches);
            for b in batches.drain(..) {
                p.publish(b);
            }
        }
        if let Ok(mut c) = shared.lock() {
            *c = core.counters();
        }
    }
}

/// Waits for a request until `deadline`, on time (see [`clock`](crate::clock)).
fn recv_until(rx: &mpsc::Receiver<Submit>, deadline: Instant) -> Result<Submit, RecvTimeoutError> {
    let sleep = kvserve::clock::sleep_part(deadline);
    if !sleep.is_zero() {
        match rx.recv_timeout(sleep) {
            Err(RecvTimeoutError::Timeout) => {}
            got => return got,
        }
    }
    kvserve::clock::poll_until(deadline, || match rx.try_recv() {
        Ok(s) => Some(Ok(s)),
        Err(mpsc::TryRecvError::Disconnected) => Some(Err(RecvTimeoutError::Disconnected)),
        Err(mpsc::TryRecvError::Empty) => None,
    })
    .unwrap_or(Err(RecvTimeoutError::Timeout))
}
