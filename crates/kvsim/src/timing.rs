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

    /// Appends to `out` the durations of `n` pure decode steps of `decode_requests` requests,
    /// the first reading `context_tokens` and each later one `decode_requests` more (the
    /// token each request produced). Each must equal [`step_us`](Self::step_us) of that
    /// shape, which the provided method calls; override it only to compute the same faster.
    fn decode_steps_us(
        &self,
        decode_requests: u64,
        context_tokens: u64,
        n: usize,
        out: &mut Vec<u64>,
    ) {
        out.extend((0..n as u64).map(|k| {
            let ctx = context_tokens.saturating_add(k.saturating_mul(decode_requests));
            self.step_us(&StepShape::new(0, decode_requests, ctx))
        }));
    }
}

/// `x.round() as u64` (round half away from zero, saturating), without a libm call.
#[inline]
fn round_us(x: f64) -> u64 {
    // Saturating cast: negative and NaN give 0, like `round` then the cast.
    let t = x as u64;
    // Exact: `x - t` for an `x` below 2^53 (above, `x` is whole and this is 0 or beyond 2^64).
    if x - t as f64 >= 0.5 {
        t.saturating_add(1)
    } else {
        t
    }
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
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
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
        round_us(us)
    }

    fn decode_steps_us(
        &self,
        decode_requests: u64,
        context_tokens: u64,
        n: usize,
        out: &mut Vec<u64>,
    ) {
        // The same sum as `step_us`, in the same order; its first three terms do not change.
        let fixed = self.base_us
            + self.prefill_us_per_token * 0.0
            + self.decode_us_per_request * decode_requests as f64;
        out.reserve(n);
        let c = self.context_us_per_token;
        // Below 2^53 every context is an exact f64: the context can be counted in i64 (and
        // rounded through i64) with the very same results.
        let last = (n as u64)
            .checked_mul(decode_requests)
            .and_then(|d| d.checked_add(context_tokens));
        if last.is_some_and(|l| l < 1 << 53) {
            let (mut ctx, step) = (context_tokens as i64, decode_requests as i64);
            let at = |ctx: i64| fixed + c * ctx as f64;
            let (lo, hi) = (at(ctx), at(last.map_or(0, |l| l as i64)));
            // With `c >= 0` the durations grow with the context: when the first and the one
            // after the last are in [0, 2^52), so is every one between, and each rounds
            // without a conversion. `x + 2^52` is `x` rounded to the nearest integer (ties to
            // even) in the low bits of a float with a unit step; a tie it rounded down to
            // even goes up instead (round half away from zero, as `f64::round`).
            const UNIT: f64 = (1u64 << 52) as f64;
            let round = |x: f64| {
                let y = x + UNIT;
                (y.to_bits() - UNIT.to_bits()) + u64::from(x - (y - UNIT) == 0.5)
            };
            if c >= 0.0 && (0.0..UNIT).contains(&lo) && (0.0..UNIT).contains(&hi) {
                // Four steps at a time, each lane counting its context in f64 (exact: whole
                // numbers below 2^53), so that the lanes can be computed side by side.
                const LANES: usize = 4;
                let wide = (n as u64 + LANES as u64)
                    .checked_mul(decode_requests)
                    .and_then(|d| d.checked_add(context_tokens))
                    .is_some_and(|l| l < 1 << 53);
                if wide {
                    let mut lane: [f64; LANES] =
                        std::array::from_fn(|l| (ctx + l as i64 * step) as f64);
                    let stride = (LANES as i64 * step) as f64;
                    for _ in 0..n / LANES {
                        let four: [u64; LANES] = std::array::from_fn(|l| {
                            let x = fixed + c * lane[l];
                            lane[l] += stride;
                            round(x)
                        });
                        out.extend_from_slice(&four);
                    }
                    ctx += (n - n % LANES) as i64 * step;
                }
                let left = if wide { n % LANES } else { n };
                out.extend((0..left).map(|_| {
                    let x = at(ctx);
                    ctx += step;
                    round(x)
                }));
                return;
            }
            for _ in 0..n {
                let x = at(ctx);
                let us = if (0.0..4e18).contains(&x) {
                    let t = x as i64;
                    (t + i64::from(x - t as f64 >= 0.5)) as u64
                } else {
                    round_us(x)
                };
                out.push(us);
                ctx += step;
            }
            return;
        }
        let mut ctx = context_tokens;
        for _ in 0..n {
            out.push(round_us(fixed + c * ctx as f64));
            ctx = ctx.saturating_add(decode_requests);
        }
    }
}

/// Which step-time model a run uses (`--timing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TimingKind {
    /// [`LinearTiming`] with the `timing` coefficients.
    #[default]
    Linear,
    /// [`PolynomialTiming`], NVIDIA Dynamo mocker's polynomial, with the `polynomial` settings.
    Polynomial,
}

impl std::fmt::Display for TimingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TimingKind::Linear => "linear",
            TimingKind::Polynomial => "polynomial",
        })
    }
}

impl std::str::FromStr for TimingKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "linear" => Ok(TimingKind::Linear),
            "polynomial" => Ok(TimingKind::Polynomial),
            _ => Err(Error::invalid("timing_kind", s, "linear or polynomial")),
        }
    }
}

/// The polynomial step-time model of NVIDIA Dynamo's mocker, so that results can be compared
/// with that simulator. Times in milliseconds, as published in `ai-dynamo/dynamo`,
/// `lib/mocker/src/common/perf_model.rs` (`PerfModel::Polynomial`, commit `f80944a`):
///
/// - prefill: `t = ` new (uncached) tokens of the step;
///   `prefill_ms = 4.209989e-07·t² + 1.518344e-02·t + 1.650142e+01` (0 when `t = 0`);
/// - decode: `u = ` KV utilisation, the decoding requests' context tokens over the engine's KV
///   capacity in tokens; `decode_ms = max(1, -25.74·u² + 54.01·u + 5.74)` (0 without decoding
///   requests).
///
/// A step that prefills and decodes takes the sum. Unlike the linear model, decode time does
/// not grow with the batch size, only with utilisation. The capacity is the engine's KV blocks
/// times the block size; for unbounded engines it is `kv_capacity_tokens` (default 460,800
/// tokens, 900 blocks of 512: about an H100's KV memory for an 8B model).
///
/// ```
/// use kvsim::{PolynomialTiming, StepShape, TimingModel};
/// let t = PolynomialTiming::default();
/// // 8,192 new tokens: 4.209989e-07 * 8192^2 + 1.518344e-02 * 8192 + 16.50142 = 169.137 ms.
/// assert_eq!(t.step_us(&StepShape::new(8192, 0, 0)), 169_137);
/// // Half the KV in use by decoding requests: -25.74/4 + 54.01/2 + 5.74 = 26.31 ms.
/// assert_eq!(t.step_us(&StepShape::new(0, 64, 230_400)), 26_310);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct PolynomialTiming {
    /// Prefill milliseconds: `[c0, c1, c2]` of `c0 + c1·t + c2·t²`.
    pub prefill_ms: [f64; 3],
    /// Decode milliseconds: `[c0, c1, c2]` of `c0 + c1·u + c2·u²`, at least 1 ms.
    pub decode_ms: [f64; 3],
    /// KV capacity, tokens, that utilisation is measured against (`--timing-kv-tokens`, or the
    /// engine's `kv_blocks` times the block size).
    pub kv_capacity_tokens: u64,
}

impl Default for PolynomialTiming {
    fn default() -> Self {
        PolynomialTiming {
            prefill_ms: [1.650142e+01, 1.518344e-02, 4.209989e-07],
            decode_ms: [5.74, 54.01, -25.74],
            kv_capacity_tokens: 460_800,
        }
    }
}

impl PolynomialTiming {
    /// Dynamo's coefficients against a KV capacity of `kv_capacity_tokens` tokens.
    pub fn with_capacity(kv_capacity_tokens: u64) -> Self {
        PolynomialTiming {
            kv_capacity_tokens,
            ..PolynomialTiming::default()
        }
    }

    /// Every coefficient finite, the capacity at least one token.
    pub fn validate(&self) -> Result<(), Error> {
        if self
            .prefill_ms
            .iter()
            .chain(&self.decode_ms)
            .any(|c| !c.is_finite())
        {
            return Err(Error::invalid(
                "polynomial",
                format!("{:?} {:?}", self.prefill_ms, self.decode_ms),
                "finite coefficients",
            ));
        }
        if self.kv_capacity_tokens == 0 {
            return Err(Error::invalid(
                "polynomial.kv_capacity_tokens",
                0,
                "a whole number of tokens >= 1",
            ));
        }
        Ok(())
    }
}

impl TimingModel for PolynomialTiming {
    fn step_us(&self, s: &StepShape) -> u64 {
        let poly = |c: &[f64; 3], x: f64| c[0] + c[1] * x + c[2] * x * x;
        let mut ms = 0.0;
        if s.prefill_tokens > 0 {
            ms += poly(&self.prefill_ms, s.prefill_tokens as f64).max(0.0);
        }
        if s.decode_requests > 0 {
            let u = s.context_tokens as f64 / self.kv_capacity_tokens as f64;
            ms += poly(&self.decode_ms, u).max(1.0);
        }
        round_us(ms * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_f64_round() {
        let xs = [
            0.0,
            -0.0,
            0.5,
            1.5,
            2.5,
            0.499_999_999_999_999_94,
            7_050.499_999_999_999,
            -0.4,
            -3.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            4_503_599_627_370_495.5,
            9_007_199_254_740_993.0,
            1.8e19,
            1e300,
        ];
        for x in xs {
            assert_eq!(round_us(x), x.round() as u64, "{x}");
        }
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..100_000 {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let x = f64::from_bits(s >> 2) % 1e7;
            assert_eq!(round_us(x), x.round() as u64, "{x}");
        }
    }

    #[test]
    fn batched_decode_steps_equal_single_steps() {
        for t in [
            LinearTiming::default(),
            LinearTiming::new(1000.0, 1.0, 0.5, 0.3),
            LinearTiming::new(0.0, 0.0, 0.0, 0.125),
            LinearTiming::new(0.5, 0.0, 0.0, 0.5),
            LinearTiming::new(0.0, 0.0, 0.25, 0.25),
            LinearTiming::new(0.499_999_999_999_999_94, 0.0, 0.0, 0.0),
            LinearTiming::new(7_050.0, 0.0, 25.4, 0.1),
            LinearTiming::new(0.0, 0.0, 0.0, 1e-9),
            LinearTiming::new(4.5e15, 0.0, 0.0, 1.0),
            LinearTiming::new(1e18, 0.0, 3.0, 1e6),
            LinearTiming::new(f64::NAN, 0.0, 0.0, 1.0),
        ] {
            for (n, ctx) in [
                (1, 0),
                (1, 1),
                (3, 1),
                (2, 4_503_599_627_370_000),
                (7, 12_345),
                (256, 3_000_000),
                (3, u64::MAX - 4),
                (1, (1 << 53) - 300),
                (1, (1 << 53) - 502),
                (0, 17),
            ] {
                let mut fast = Vec::new();
                t.decode_steps_us(n, ctx, 500, &mut fast);
                let slow: Vec<u64> = (0..500u64)
                    .map(|k| t.step_us(&StepShape::new(0, n, ctx.saturating_add(k * n))))
                    .collect();
                assert_eq!(fast, slow);
            }
        }
        // Random coefficients and contexts, many of them on exact halves.
        let mut rng = crate::rng::SimRng::new(0x2545_F491_4F6C_DD1D, 0);
        let mut next = |m: u64| rng.below(m);
        for _ in 0..2_000 {
            let quarter = |x: u64| x as f64 / 4.0;
            let t = LinearTiming::new(
                quarter(next(40_000)),
                0.0,
                quarter(next(200)),
                if next(2) == 0 {
                    quarter(next(8))
                } else {
                    next(1 << 20) as f64 / 1e7
                },
            );
            let (n, ctx, steps) = (next(300), next(1 << 24), next(70));
            let mut fast = Vec::new();
            t.decode_steps_us(n, ctx, steps as usize, &mut fast);
            let slow: Vec<u64> = (0..steps)
                .map(|k| t.step_us(&StepShape::new(0, n, ctx + k * n)))
                .collect();
            assert_eq!(fast, slow, "{t:?} {n} {ctx}");
        }
    }
}
