//! The plain records of a run, a leaf every other module may use: what the simulator hands the
//! report about each request and engine, and what a measurement (a load generator, an engine's
//! spans, a simulation) says about one request.

use crate::engine::Pool;

/// What a load generator measured about one request, in microseconds from the start of its
/// run (the same clock as [`WorkloadRequest::arrival_us`](crate::WorkloadRequest::arrival_us)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MeasuredRequest {
    /// When it was sent.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub input_len: usize,
    /// Output tokens received.
    pub output_len: usize,
    /// Prompt tokens the endpoint reported cached.
    pub cached_tokens: usize,
    /// When its first output token arrived.
    pub first_token_us: u64,
    /// When its last output token arrived.
    pub finish_us: u64,
    /// It failed (an error status, a broken stream, a timeout): counted as rejected.
    pub failed: bool,
    /// The instance that served it, when known (a simulation's requests).
    pub instance: Option<usize>,
    /// Times it was preempted, when known (a simulation's requests).
    pub preemptions: Option<u32>,
}

impl MeasuredRequest {
    /// A completed request.
    pub fn new(
        arrival_us: u64,
        input_len: usize,
        output_len: usize,
        cached_tokens: usize,
        first_token_us: u64,
        finish_us: u64,
    ) -> Self {
        MeasuredRequest {
            arrival_us,
            input_len,
            output_len,
            cached_tokens,
            first_token_us,
            finish_us,
            failed: false,
            instance: None,
            preemptions: None,
        }
    }

    /// Time to first token, µs.
    pub fn ttft_us(&self) -> u64 {
        self.first_token_us.saturating_sub(self.arrival_us)
    }

    /// End-to-end latency, µs.
    pub fn e2e_us(&self) -> u64 {
        self.finish_us.saturating_sub(self.arrival_us)
    }

    /// Mean inter-token latency, µs: the time from the first token to the last over the gaps
    /// between them; `None` for a failed request or fewer than two output tokens.
    pub fn mean_itl_us(&self) -> Option<f64> {
        (!self.failed && self.output_len > 1).then(|| {
            self.finish_us.saturating_sub(self.first_token_us) as f64 / (self.output_len - 1) as f64
        })
    }

    /// A request that failed after being sent at `arrival_us`.
    pub fn failed(arrival_us: u64, input_len: usize) -> Self {
        MeasuredRequest {
            arrival_us,
            input_len,
            failed: true,
            ..MeasuredRequest::default()
        }
    }
}

/// What the simulator hands the report about one request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RequestRecord {
    pub(crate) arrival: u64,
    pub(crate) input: usize,
    pub(crate) output: usize,
    pub(crate) prompt_blocks: usize,
    /// The engine that prefills it (unified or prefill pool).
    pub(crate) engine: usize,
    /// Leading prompt blocks resident on `engine` when it was scheduled (engine truth).
    pub(crate) hits: usize,
    /// The decode engine, when disaggregated.
    pub(crate) decode_engine: Option<usize>,
    /// Leading prompt blocks already on the decode engine when the transfer started.
    pub(crate) decode_hits: usize,
    /// Blocks after `hits` loaded from the engine's host tier.
    pub(crate) host_hits: usize,
    /// When the prefill engine scheduled it.
    pub(crate) scheduled: u64,
    pub(crate) transfer_us: u64,
    pub(crate) first_token: u64,
    pub(crate) finish: u64,
    pub(crate) rejected: bool,
    /// Its turn in its session, from 1 (1 in an open-loop run).
    pub(crate) turn: u32,
    /// Times its engine preempted it.
    pub(crate) preemptions: u32,
}

/// What the simulator hands the report about one engine.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EngineRecord {
    pub(crate) pool: Pool,
    pub(crate) evictions: u64,
    pub(crate) resident_blocks: usize,
    /// Blocks its host tier holds at the end.
    pub(crate) host_blocks: usize,
    pub(crate) busy_us: u64,
    pub(crate) preemptions: u64,
    pub(crate) recomputed_tokens: u64,
}

/// How the later turns of sessions were routed, with session affinity on: to the engine their
/// router knew for the session, elsewhere, or with no engine known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct SessionCounts {
    pub(crate) kept: usize,
    pub(crate) moved: usize,
    pub(crate) new: usize,
}

/// Everything a finished run hands the report.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Records {
    pub(crate) requests: Vec<RequestRecord>,
    pub(crate) engines: Vec<EngineRecord>,
    /// (step duration, tokens it produced for decoding requests): ITL samples by weight.
    pub(crate) itl: Vec<(u64, u64)>,
    pub(crate) router_errors: u64,
    pub(crate) inconsistent_inserts: u64,
    /// With session affinity on: how later turns were routed.
    pub(crate) sessions: Option<SessionCounts>,
}
