//! How long an engine step takes.

use crate::error::Error;

/// What an engine computes in one step: the input of a [`TimingModel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct StepShape {
    /// Prompt tokens computed in this step (cached tokens are not computed).
    pub prefill_tokens: u64,
    /// Requests that each produce one output token in this step.
    pub decode_requests: u64,
    /// Tokens in the KV cache of those decoding requests (prompt plus output so far): what
    /// their attention reads.
    pub context_tokens: u64,
}

impl StepShape {
    /// A step shape (for tests and custom models).
    pub fn new(prefill_tokens: u64, decode_requests: u64, context_tokens: u64) -> Self {
        StepShape {
            prefill_tokens,
            decode_requests,
            context_tokens,
        }
    }
}

/// The duration of one continuous-batching engine step. Implement it to plug in your own fit.
///
/// ```
/// use kvsim::{StepShape, TimingModel};
/// struct Flat;
/// impl TimingModel for Flat {
///     fn step_us(&self, _: &StepShape) -> u64 { 10_000 }
/// }
/// assert_eq!(Flat.step_us(&StepShape::new(512, 3, 9_000)), 10_000);
/// ```
pub trait TimingModel: Send + Sync {
    /// Microseconds the step takes (the simulator uses at least 1).
    fn step_us(&self, step: &StepShape) -> u64;
}

/// `step_us = base + a * prefill_tokens + b * decode_requests + c * context_tokens`.
///
/// The defaults describe an 8B dense model in 16-bit on one H100-class GPU: a fixed per-step
/// cost of 7,050 µs (kernel launches, sampling, scheduling), 19.5 µs per prefilled token
/// (about 51k tokens/s of prefill, compute-bound), 25.4 µs per decoding request and 0.04 µs per
/// context token read by decode attention (memory-bound). A cold 8,192-token prefill then takes
/// about 167 ms. They are round figures of the kind published for vLLM on such hardware, meant
/// as a starting point: fit the four coefficients to your own engine's step times (a linear
/// regression over logged steps) and pass them with `--timing-*`.
///
/// ```
/// use kvsim::{LinearTiming, StepShape, TimingModel};
/// let t = LinearTiming::default();
/// assert_eq!(t.step_us(&StepShape::new(8192, 0, 0)), 166_794);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LinearTiming {
    /// Fixed cost per step, µs (`--timing-base-us`).
    pub base_us: f64,
    /// Per prefilled token, µs (`--timing-prefill-us`).
    pub prefill_us_per_token: f64,
    /// Per decoding request, µs (`--timing-decode-us`).
    pub decode_us_per_request: f64,
    /// Per context token of decoding requests, µs (`--timing-context-us`).
    pub context_us_per_token: f64,
}

impl Default for LinearTiming {
    fn default() -> Self {
        LinearTiming {
            base_us: 7_050.0,
            prefill_us_per_token: 19.5,
            decode_us_per_request: 25.4,
            context_us_per_token: 0.04,
        }
    }
}

impl LinearTiming {
    /// A model with the given coefficients (µs).
    pub fn new(
        base_us: f64,
        prefill_us_per_token: f64,
        decode_us_per_request: f64,
        context_us_per_token: f64,
    ) -> Self {
        LinearTiming {
            base_us,
            prefill_us_per_token,
            decode_us_per_request,
            context_us_per_token,
        }
    }

    /// Every coefficient must be finite and >= 0.
    pub fn validate(&self) -> Result<(), Error> {
        for (flag, v) in [
            ("timing.base_us", self.base_us),
            ("timing.prefill_us_per_token", self.prefill_us_per_token),
            ("timing.decode_us_per_request", self.decode_us_per_request),
            ("timing.context_us_per_token", self.context_us_per_token),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::invalid(flag, v, "a finite number >= 0"));
            }
        }
        Ok(())
    }
}

impl TimingModel for LinearTiming {
    fn step_us(&self, s: &StepShape) -> u64 {
        let us = self.base_us
            + self.prefill_us_per_token * s.prefill_tokens as f64
            + self.decode_us_per_request * s.decode_requests as f64
            + self.context_us_per_token * s.context_tokens as f64;
        // Round to whole microseconds: simulated time is an integer.
        us.round() as u64
    }
}
