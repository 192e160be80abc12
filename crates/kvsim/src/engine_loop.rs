//! The engine loop without a clock: in which order an [`Engine`] is driven. The simulator drives
//! every engine of a fleet through it from one event queue; `kvmock` drives one engine through it
//! against the wall clock. Time is the host's: it stamps what the engine reports, and ends each
//! planned step when its time comes.

use crate::{Engine, EngineRequest, PlannedStep};

/// A host of one or more engines (numbered by the host) that supplies time and handles what the
/// engines report; the provided methods are the loop itself.
///
/// - A request arrives: [`submit`](Self::submit); an idle engine starts a step at once.
/// - A step ends: [`end_step`](Self::end_step) finishes it, and the next one starts.
/// - A step starts: the engine admits what fits, its outcomes and KV events are handed to the
///   host, and the step is planned; the host ends it after its duration.
///
/// # Example
///
/// The smallest host: one engine, a clock that jumps to each step's end.
///
/// ```
/// use kvblock::BlockSize;
/// use kvsim::{Engine, EngineConfig, EngineLoop, EngineRequest, LinearTiming, Outcome, PlannedStep};
///
/// struct Host {
///     engine: Engine,
///     now_us: u64,
///     step_end: Option<u64>,
///     finished: Vec<(u64, u64)>,
/// }
///
/// impl EngineLoop for Host {
///     fn engine_mut(&mut self, _e: usize) -> &mut Engine {
///         &mut self.engine
///     }
///     fn on_outcomes(&mut self, _e: usize) {
///         let mut out = Vec::new();
///         self.engine.take_outcomes(&mut out);
///         for o in out {
///             if let Outcome::Finished { id } = o {
///                 self.finished.push((id, self.now_us));
///             }
///         }
///     }
///     fn on_events(&mut self, _e: usize) {
///         self.engine.drain_events().for_each(drop);
///     }
///     fn on_step_planned(&mut self, _e: usize, step: PlannedStep) {
///         self.step_end = Some(self.now_us + step.duration_us);
///     }
///     fn on_step_ending(&mut self, _e: usize) {
///         self.step_end = None;
///     }
/// }
///
/// let cfg = EngineConfig::new(BlockSize::new(16).unwrap());
/// let mut host = Host {
///     engine: Engine::new(cfg, LinearTiming::default()),
///     now_us: 0,
///     step_end: None,
///     finished: Vec::new(),
/// };
/// assert!(host.submit(0, EngineRequest::new(7, Vec::new(), 100, 3)));
/// while let Some(end) = host.step_end {
///     host.now_us = end;
///     host.end_step(0);
/// }
/// assert_eq!(host.finished.len(), 1);
/// assert_eq!(host.finished[0].0, 7);
/// ```
pub trait EngineLoop {
    /// Engine `e`.
    fn engine_mut(&mut self, e: usize) -> &mut Engine;

    /// Takes engine `e`'s outcomes ([`Engine::take_outcomes`]) and stamps them with the time.
    fn on_outcomes(&mut self, e: usize);

    /// Takes engine `e`'s queued KV events ([`Engine::drain_events`], and the host tier's) and
    /// sends them on.
    fn on_events(&mut self, e: usize);

    /// Engine `e` planned a step: the host calls [`end_step`](Self::end_step) once
    /// `step.duration_us` has passed.
    fn on_step_planned(&mut self, e: usize, step: PlannedStep);

    /// Engine `e`'s step is about to end (the engine still shows the step's requests).
    fn on_step_ending(&mut self, _e: usize) {}

    /// Submits `req` to engine `e`, and starts a step if the engine was idle. `false` if the
    /// request can never fit the engine (nothing else happens then).
    fn submit(&mut self, e: usize, req: EngineRequest) -> bool {
        if !self.engine_mut(e).submit(req) {
            return false;
        }
        if !self.engine_mut(e).is_busy() {
            self.start_step(e);
        }
        true
    }

    /// Ends engine `e`'s step in progress and starts the next one.
    fn end_step(&mut self, e: usize) {
        self.on_step_ending(e);
        let engine = self.engine_mut(e);
        engine.finish_step();
        // kvsim's property tests check the engine's invariants after every step.
        #[cfg(test)]
        if let Err(broken) = engine.check_invariants() {
            panic!("engine {e} after step {}: {broken}", engine.steps());
        }
        self.on_outcomes(e);
        self.on_events(e);
        self.start_step(e);
    }

    /// Admits what fits on engine `e` and, unless it has nothing to run, plans its next step.
    fn start_step(&mut self, e: usize) {
        self.engine_mut(e).admit();
        self.on_outcomes(e);
        self.on_events(e);
        if let Some(step) = self.engine_mut(e).plan_step() {
            self.on_step_planned(e, step);
        }
    }
}
