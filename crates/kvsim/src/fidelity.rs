//! Measured runs against simulated ones: phases, their figures, and fitting the step-time model
//! with the simulator in the loop (`kvsim calibrate --spans`).
//!
//! A request-level measurement (vLLM's spans, `kvload --record`) says nothing about single
//! engine steps, so the coefficients cannot be fitted by regression: a batch of 1 (a
//! synchronous phase) shows neither what batching shares nor what it costs. Instead
//! [`fit_spans`] replays the measured requests through a simulated engine configured as the
//! real one and moves the coefficients until the simulated phases look like the measured ones:
//! the relative error of mean and p90 TTFT, ITL and E2E, averaged over the phases fitted, is
//! minimised by Nelder–Mead in log space (deterministic: no randomness at all).

use std::ops::Range;

use serde::Serialize;

use crate::config::{SimConfig, TraceTiming};
use crate::error::Error;
use crate::records::MeasuredRequest;
use crate::sim::Simulation;
use crate::stats::nearest_rank;
use crate::timing::LinearTiming;
use crate::trace::Trace;

/// Cuts arrival-ordered requests into phases of `per` requests (the last may be shorter).
///
/// ```
/// assert_eq!(kvsim::phases_by_count(7, 3), [0..3, 3..6, 6..7]);
/// ```
pub fn phases_by_count(n: usize, per: usize) -> Vec<Range<usize>> {
    let per = per.max(1);
    (0..n.div_ceil(per))
        .map(|p| p * per..((p + 1) * per).min(n))
        .collect()
}

/// Cuts arrival-ordered requests into windows of `window_us` of arrival time from the first
/// request; empty windows are left out.
///
/// ```
/// let r = |t| kvsim::MeasuredRequest::new(t, 10, 2, 0, t + 5, t + 9);
/// let reqs = [r(0), r(400), r(1_000), r(2_500)];
/// assert_eq!(kvsim::phases_by_window(&reqs, 1_000), [0..2, 2..3, 3..4]);
/// ```
pub fn phases_by_window(requests: &[MeasuredRequest], window_us: u64) -> Vec<Range<usize>> {
    let w = window_us.max(1);
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut current = None;
    for (i, r) in requests.iter().enumerate() {
        let k = r.arrival_us / w;
        match out.last_mut() {
            Some(last) if current == Some(k) => last.end = i + 1,
            _ => {
                out.push(i..i + 1);
                current = Some(k);
            }
        }
    }
    out
}

/// One phase's figures, in milliseconds (the completed requests of the phase).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
#[non_exhaustive]
pub struct PhaseFigures {
    /// Completed requests.
    pub requests: usize,
    /// Mean time to first token.
    pub ttft_mean: f64,
    /// 90th percentile (nearest rank) of time to first token.
    pub ttft_p90: f64,
    /// Inter-token latency over the phase: the sum of every request's time from first to last
    /// token over the sum of its gaps (output tokens less one).
    pub itl_mean: f64,
    /// 90th percentile of the requests' mean inter-token latencies.
    pub itl_p90: f64,
    /// Mean end-to-end latency.
    pub e2e_mean: f64,
    /// 90th percentile of end-to-end latency.
    pub e2e_p90: f64,
}

impl PhaseFigures {
    /// The figures of `requests` (failed ones left out).
    pub fn of(requests: &[MeasuredRequest]) -> Self {
        let ok: Vec<&MeasuredRequest> = requests.iter().filter(|r| !r.failed).collect();
        if ok.is_empty() {
            return PhaseFigures::default();
        }
        let ms = |us: u64| us as f64 / 1e3;
        let mean = |v: &[u64]| v.iter().map(|&x| ms(x)).sum::<f64>() / v.len() as f64;
        let p90 = |v: &mut Vec<u64>| {
            v.sort_unstable();
            ms(v[nearest_rank(0.9, v.len() as u64) as usize - 1])
        };
        let mut ttft: Vec<u64> = ok.iter().map(|r| r.ttft_us()).collect();
        let mut e2e: Vec<u64> = ok.iter().map(|r| r.e2e_us()).collect();
        let (mut span, mut gaps) = (0u64, 0u64);
        // Mean ITLs in ns, so that the percentile is taken over whole numbers.
        let mut itl: Vec<u64> = Vec::new();
        for r in &ok {
            if r.output_len > 1 {
                span += r.finish_us.saturating_sub(r.first_token_us);
                gaps += r.output_len as u64 - 1;
                itl.push((r.mean_itl_us().unwrap_or(0.0) * 1e3).round() as u64);
            }
        }
        PhaseFigures {
            requests: ok.len(),
            ttft_mean: mean(&ttft),
            ttft_p90: p90(&mut ttft),
            itl_mean: if gaps == 0 {
                0.0
            } else {
                ms(span) / gaps as f64
            },
            itl_p90: if itl.is_empty() {
                0.0
            } else {
                p90(&mut itl) / 1e3
            },
            e2e_mean: mean(&e2e),
            e2e_p90: p90(&mut e2e),
        }
    }

    /// The six figures in order: TTFT mean, p90, ITL mean, p90, E2E mean, p90.
    pub fn values(&self) -> [f64; 6] {
        [
            self.ttft_mean,
            self.ttft_p90,
            self.itl_mean,
            self.itl_p90,
            self.e2e_mean,
            self.e2e_p90,
        ]
    }
}

/// One phase, measured and simulated.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PhaseComparison {
    /// The phase's index.
    pub phase: usize,
    /// Whether the fit saw it (in-sample) or it was predicted (held out).
    pub fitted: bool,
    /// What was measured.
    pub real: PhaseFigures,
    /// What the simulation gave.
    pub sim: PhaseFigures,
}

impl PhaseComparison {
    /// Relative errors `|sim - real| / real` of the six figures (0 where real is 0).
    pub fn errors(&self) -> [f64; 6] {
        let (r, s) = (self.real.values(), self.sim.values());
        std::array::from_fn(|i| rel_err(s[i], r[i]))
    }
}

fn rel_err(sim: f64, real: f64) -> f64 {
    if real > 0.0 {
        (sim - real).abs() / real
    } else {
        0.0
    }
}

/// Mean absolute relative error of the phases' means over a set of phases.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
#[non_exhaustive]
pub struct FidelityError {
    /// Phases averaged.
    pub phases: usize,
    /// Of mean TTFT.
    pub ttft: f64,
    /// Of the phases' ITL.
    pub itl: f64,
    /// Of mean E2E.
    pub e2e: f64,
}

impl FidelityError {
    /// The mean absolute error of the phases' mean TTFT, ITL and E2E.
    pub fn of<'a>(phases: impl IntoIterator<Item = &'a PhaseComparison>) -> Self {
        let mut e = FidelityError::default();
        for p in phases {
            let err = p.errors();
            e.phases += 1;
            e.ttft += err[0];
            e.itl += err[2];
            e.e2e += err[4];
        }
        if e.phases > 0 {
            let n = e.phases as f64;
            e.ttft /= n;
            e.itl /= n;
            e.e2e /= n;
        }
        e
    }
}

/// Compares a simulation of `measured` under `cfg` with the measurement, phase by phase.
/// `measured` must be in arrival order (as [`parse_measured`](crate::parse_measured) gives
/// them); their failed requests are left out of both sides. `fitted` marks the phases a fit
/// saw. The simulation replays the requests' arrival times and lengths on the fleet of `cfg`
/// (its trace and request count are replaced), every prompt sharing its first
/// `shared_prefix_tokens` tokens.
pub fn compare_phases(
    cfg: &SimConfig,
    measured: &[MeasuredRequest],
    shared_prefix_tokens: usize,
    phases: &[Range<usize>],
    fitted: &[usize],
) -> Result<Vec<PhaseComparison>, Error> {
    let (ok, cfg) = replay_setup(cfg, measured, shared_prefix_tokens)?;
    let sim = Simulation::new(cfg)?.run_requests()?.1;
    Ok(compare(&ok, &sim, measured, phases, fitted))
}

/// The completed measured requests and a configuration that replays them.
fn replay_setup(
    cfg: &SimConfig,
    measured: &[MeasuredRequest],
    shared_prefix_tokens: usize,
) -> Result<(Vec<MeasuredRequest>, SimConfig), Error> {
    let ok: Vec<MeasuredRequest> = measured.iter().filter(|r| !r.failed).copied().collect();
    if ok.is_empty() {
        return Err(Error::Fit("no completed request to replay".into()));
    }
    let trace = Trace::from_measured(
        "measured requests",
        &ok,
        shared_prefix_tokens,
        cfg.block_size,
    );
    let mut cfg = cfg.clone().with_trace(trace);
    cfg.trace_timing = TraceTiming::Keep;
    cfg.trace_speedup = 1.0;
    Ok((ok, cfg))
}

/// Phase by phase: the measured phase ranges index `measured`, which holds failed requests;
/// `ok` and `sim` hold the completed ones only, in the same order.
fn compare(
    ok: &[MeasuredRequest],
    sim: &[MeasuredRequest],
    measured: &[MeasuredRequest],
    phases: &[Range<usize>],
    fitted: &[usize],
) -> Vec<PhaseComparison> {
    // Index of each measured request among the completed ones.
    let mut at = Vec::with_capacity(measured.len() + 1);
    let mut k = 0;
    for r in measured {
        at.push(k);
        k += usize::from(!r.failed);
    }
    at.push(k);
    phases
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (a, b) = (
                at[p.start.min(measured.len())],
                at[p.end.min(measured.len())],
            );
            PhaseComparison {
                phase: i,
                fitted: fitted.contains(&i),
                real: PhaseFigures::of(&ok[a..b]),
                sim: PhaseFigures::of(sim.get(a..b).unwrap_or(&[])),
            }
        })
        .collect()
}

/// The result of [`fit_spans`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SpanFit {
    /// The fitted step-time model.
    pub timing: LinearTiming,
    /// Every phase, measured and simulated with the fitted model.
    pub phases: Vec<PhaseComparison>,
    /// The error over the fitted phases.
    pub in_sample: FidelityError,
    /// The error over the other phases (none: 0 phases).
    pub held_out: FidelityError,
    /// Simulations run.
    pub evaluations: usize,
    /// The objective at the fit: the mean relative error of the six figures over the fitted
    /// phases.
    pub objective: f64,
}

/// Settings of [`fit_spans`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SpanFitOptions {
    /// Tokens every prompt shares at its start (spans carry no tokens).
    pub shared_prefix_tokens: usize,
    /// The phases to fit (indices into the phases); empty: all of them.
    pub fit_phases: Vec<usize>,
    /// Simulations at most.
    pub max_evaluations: usize,
}

impl Default for SpanFitOptions {
    fn default() -> Self {
        SpanFitOptions {
            shared_prefix_tokens: 0,
            fit_phases: Vec::new(),
            max_evaluations: 1_500,
        }
    }
}

impl SpanFitOptions {
    /// Every prompt shares its first `tokens` tokens.
    pub fn shared_prefix_tokens(mut self, tokens: usize) -> Self {
        self.shared_prefix_tokens = tokens;
        self
    }

    /// Fit only these phases (the rest are predicted); empty: all.
    pub fn fit_phases(mut self, phases: Vec<usize>) -> Self {
        self.fit_phases = phases;
        self
    }

    /// Run at most `n` simulations.
    pub fn max_evaluations(mut self, n: usize) -> Self {
        self.max_evaluations = n;
        self
    }
}

/// Fits `cfg.timing` (the linear model's four coefficients) to measured requests by replaying
/// them through the fleet of `cfg` and minimising the relative error of the phases' mean and
/// p90 TTFT, ITL and E2E. Deterministic: the same inputs give the same fit, on any machine.
///
/// ```
/// // Requests made by kvsim itself with known coefficients are fitted back to them.
/// use kvsim::{LinearTiming, SimConfig, Simulation, SpanFitOptions};
/// let mut cfg = SimConfig::default();
/// cfg.num_requests = 40;
/// cfg.output_len = 50;
/// cfg.instances = 1;
/// cfg.num_prefixes = 1; // every prompt starts with the same 2,048 tokens
/// let truth = LinearTiming::new(9_000.0, 40.0, 60.0, 0.2);
/// cfg.timing = truth;
/// let (_, reqs) = Simulation::new(cfg.clone())?.run_requests()?;
/// cfg.timing = LinearTiming::default();
/// let phases = kvsim::phases_by_count(reqs.len(), 10);
/// let opts = SpanFitOptions::default().shared_prefix_tokens(2_048);
/// let fit = kvsim::fit_spans(&cfg, &reqs, &phases, &opts)?;
/// assert!(fit.in_sample.e2e < 0.01, "{fit:?}");
/// # Ok::<(), kvsim::Error>(())
/// ```
pub fn fit_spans(
    cfg: &SimConfig,
    measured: &[MeasuredRequest],
    phases: &[Range<usize>],
    opts: &SpanFitOptions,
) -> Result<SpanFit, Error> {
    if phases.is_empty() {
        return Err(Error::Fit("no phase to fit".into()));
    }
    if let Some(&p) = opts.fit_phases.iter().find(|&&p| p >= phases.len()) {
        return Err(Error::invalid(
            "fit_phases",
            p,
            format!("a phase index below {}", phases.len()),
        ));
    }
    let fitted: Vec<usize> = if opts.fit_phases.is_empty() {
        (0..phases.len()).collect()
    } else {
        opts.fit_phases.clone()
    };
    let (ok, base) = replay_setup(cfg, measured, opts.shared_prefix_tokens)?;
    // Validated once here; each evaluation only changes the coefficients.
    Simulation::new(base.clone())?;
    let timing_of = |x: &[f64]| LinearTiming::new(x[0].exp(), x[1].exp(), x[2].exp(), x[3].exp());
    let mut evaluations = 0;
    let mut objective = |x: &[f64]| -> f64 {
        evaluations += 1;
        let mut c = base.clone();
        c.timing = timing_of(x);
        let Ok(sim) = Simulation::new(c).and_then(|s| s.run_requests()) else {
            return f64::INFINITY;
        };
        let cmp = compare(&ok, &sim.1, measured, phases, &fitted);
        let (mut sum, mut n) = (0.0, 0);
        for p in cmp.iter().filter(|p| p.fitted && p.real.requests > 0) {
            for e in p.errors() {
                sum += e;
                n += 1;
            }
        }
        if n == 0 {
            f64::INFINITY
        } else {
            sum / n as f64
        }
    };
    // Start from the configured model; coefficients at 0 start small instead (log space).
    let t = cfg.timing;
    let floor = |v: f64, small: f64| if v > 0.0 { v.ln() } else { small.ln() };
    let mut x = vec![
        floor(t.base_us, 1_000.0),
        floor(t.prefill_us_per_token, 1.0),
        floor(t.decode_us_per_request, 1.0),
        floor(t.context_us_per_token, 0.01),
    ];
    // Restarts from the best point with a fresh simplex: Nelder–Mead can stall on a
    // non-smooth objective (percentiles, whole-µs steps).
    let mut best = f64::INFINITY;
    let per_round = (opts.max_evaluations / 3).max(20);
    for step in [1.0, 0.5, 0.2] {
        let (bx, bf) = nelder_mead(&mut objective, &x, step, per_round);
        if bf < best {
            best = bf;
            x = bx;
        }
    }
    let timing = timing_of(&x);
    let mut c = base.clone();
    c.timing = timing;
    let sim = Simulation::new(c)?.run_requests()?.1;
    let cmp = compare(&ok, &sim, measured, phases, &fitted);
    Ok(SpanFit {
        timing,
        in_sample: FidelityError::of(cmp.iter().filter(|p| p.fitted)),
        held_out: FidelityError::of(cmp.iter().filter(|p| !p.fitted)),
        phases: cmp,
        evaluations,
        objective: best,
    })
}

/// Minimises `f` from `x0` with a simplex of edge `step`, for at most `max_evals` evaluations:
/// the best point and its value.
fn nelder_mead(
    f: &mut dyn FnMut(&[f64]) -> f64,
    x0: &[f64],
    step: f64,
    max_evals: usize,
) -> (Vec<f64>, f64) {
    let n = x0.len();
    let mut simplex: Vec<(Vec<f64>, f64)> = Vec::with_capacity(n + 1);
    simplex.push((x0.to_vec(), f(x0)));
    for i in 0..n {
        let mut x = x0.to_vec();
        x[i] += step;
        let v = f(&x);
        simplex.push((x, v));
    }
    let mut evals = n + 1;
    let order = |s: &mut Vec<(Vec<f64>, f64)>| s.sort_by(|a, b| a.1.total_cmp(&b.1));
    while evals < max_evals {
        order(&mut simplex);
        let spread = simplex[n].1 - simplex[0].1;
        if spread.abs() < 1e-7 {
            break;
        }
        let centroid: Vec<f64> = (0..n)
            .map(|j| simplex[..n].iter().map(|p| p.0[j]).sum::<f64>() / n as f64)
            .collect();
        let along = |t: f64| -> Vec<f64> {
            (0..n)
                .map(|j| centroid[j] + t * (simplex[n].0[j] - centroid[j]))
                .collect()
        };
        let xr = along(-1.0);
        let fr = f(&xr);
        evals += 1;
        if fr < simplex[0].1 {
            let xe = along(-2.0);
            let fe = f(&xe);
            evals += 1;
            simplex[n] = if fe < fr { (xe, fe) } else { (xr, fr) };
        } else if fr < simplex[n - 1].1 {
            simplex[n] = (xr, fr);
        } else {
            let (xc, fc) = if fr < simplex[n].1 {
                let x = along(-0.5);
                let v = f(&x);
                (x, v)
            } else {
                let x = along(0.5);
                let v = f(&x);
                (x, v)
            };
            evals += 1;
            if fc < simplex[n].1.min(fr) {
                simplex[n] = (xc, fc);
            } else {
                // Shrink towards the best point.
                let best = simplex[0].0.clone();
                for p in simplex.iter_mut().skip(1) {
                    for (x, b) in p.0.iter_mut().zip(&best) {
                        *x = b + 0.5 * (*x - b);
                    }
                    p.1 = f(&p.0);
                    evals += 1;
                }
            }
        }
    }
    order(&mut simplex);
    let (x, v) = simplex.swap_remove(0);
    (x, v)
}
