//! Fitting the linear timing model to measured engine steps (`kvsim calibrate`).

use std::path::Path;

use serde::Serialize;

use crate::error::{Error, TraceError};
use crate::timing::{LinearTiming, StepShape, TimingModel};

/// The CSV header [`parse_steps`] expects (the columns may come in any order; others are
/// ignored).
pub const STEPS_HEADER: &str = "prefill_tokens,decode_requests,context_tokens,step_us";

/// One measured engine step: its shape and how long it took.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct StepSample {
    /// What the step computed.
    pub shape: StepShape,
    /// Its measured duration, µs.
    pub step_us: f64,
}

impl StepSample {
    /// A measured step.
    pub fn new(shape: StepShape, step_us: f64) -> Self {
        StepSample { shape, step_us }
    }
}

/// A least-squares fit of [`LinearTiming`] and how well it predicts the steps it was fitted on.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct LinearFit {
    /// Fixed cost per step, µs (`--timing-base-us`).
    pub base_us: f64,
    /// Per prefilled token, µs (`--timing-prefill-us`).
    pub prefill_us_per_token: f64,
    /// Per decoding request, µs (`--timing-decode-us`).
    pub decode_us_per_request: f64,
    /// Per context token of decoding requests, µs (`--timing-context-us`).
    pub context_us_per_token: f64,
    /// Steps fitted.
    pub steps: usize,
    /// Mean absolute percentage error of the fitted model's (whole-µs) step times.
    pub mape: f64,
    /// The largest absolute percentage error of one step.
    pub max_ape: f64,
    /// Coefficients fixed at 0 because their column is 0 in every step (e.g. no prefill).
    pub fixed_at_zero: Vec<&'static str>,
}

impl LinearFit {
    /// The fitted model.
    pub fn timing(&self) -> LinearTiming {
        LinearTiming::new(
            self.base_us,
            self.prefill_us_per_token,
            self.decode_us_per_request,
            self.context_us_per_token,
        )
    }
}

fn bad(file: &str, line: usize, what: impl Into<String>) -> Error {
    Error::Steps(TraceError {
        file: file.to_string(),
        line,
        what: what.into(),
    })
}

/// Reads a step-times CSV file; see [`parse_steps`].
pub fn load_steps(path: &Path) -> Result<Vec<StepSample>, Error> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| bad(&name, 0, e.to_string()))?;
    parse_steps(&name, &text)
}

/// Parses measured steps: a header naming the columns of [`STEPS_HEADER`], then one step per
/// line (whole numbers of tokens and requests, a duration in µs > 0). Blank lines are skipped.
/// Errors name the file and the 1-based line.
///
/// ```
/// let text = "prefill_tokens,decode_requests,context_tokens,step_us\n512,0,0,17000\n0,8,9000,7600\n";
/// let steps = kvsim::parse_steps("steps.csv", text)?;
/// assert_eq!(steps.len(), 2);
/// let e = kvsim::parse_steps("steps.csv", "prefill_tokens,step_us\n").unwrap_err();
/// assert_eq!(e.to_string(), "steps.csv:1: no column decode_requests: expected the header prefill_tokens,decode_requests,context_tokens,step_us");
/// # Ok::<(), kvsim::Error>(())
/// ```
pub fn parse_steps(name: &str, text: &str) -> Result<Vec<StepSample>, Error> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((h, header)) = lines.next() else {
        return Err(bad(
            name,
            0,
            format!("empty: expected the header {STEPS_HEADER}"),
        ));
    };
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let mut at = [0usize; 4];
    for (k, want) in STEPS_HEADER.split(',').enumerate() {
        at[k] = cols.iter().position(|c| *c == want).ok_or_else(|| {
            bad(
                name,
                h + 1,
                format!("no column {want}: expected the header {STEPS_HEADER}"),
            )
        })?;
    }
    let mut out = Vec::new();
    for (i, line) in lines {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != cols.len() {
            return Err(bad(
                name,
                i + 1,
                format!(
                    "{} fields, expected {} as in the header",
                    fields.len(),
                    cols.len()
                ),
            ));
        }
        let mut whole = [0u64; 3];
        for (k, w) in whole.iter_mut().enumerate() {
            let f = fields[at[k]];
            *w = f.parse().map_err(|_| {
                bad(
                    name,
                    i + 1,
                    format!(
                        "{} {f:?}: expected a whole number >= 0",
                        STEPS_HEADER.split(',').nth(k).unwrap_or("")
                    ),
                )
            })?;
        }
        let f = fields[at[3]];
        let step_us = match f.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => x,
            _ => {
                return Err(bad(
                    name,
                    i + 1,
                    format!("step_us {f:?}: expected a finite number of µs > 0"),
                ))
            }
        };
        out.push(StepSample::new(
            StepShape::new(whole[0], whole[1], whole[2]),
            step_us,
        ));
    }
    Ok(out)
}

/// Fits `step_us = base + a·prefill_tokens + b·decode_requests + c·context_tokens` by least
/// squares on relative errors: each step's residual is divided by its measured time, which is
/// what the mean absolute percentage error measures, and keeps a few long prefill steps (whose
/// jitter is milliseconds) from drowning the short decode steps that fix the per-request
/// cost. Solved by a QR factorisation of the column-scaled design, so large token counts do
/// not cost precision. A coefficient whose column is 0 in every step is fixed at 0 and
/// named in [`LinearFit::fixed_at_zero`]. Coefficients may come out negative when the data
/// say so; `--timing-*` then refuses them, and the fit is telling you the linear model does
/// not describe your engine.
///
/// Errors: fewer steps than coefficients, or columns that are not independent (e.g. context
/// always a fixed multiple of the decoding requests).
///
/// ```
/// use kvsim::{fit_linear, LinearTiming, StepSample, StepShape, TimingModel};
/// let truth = LinearTiming::new(5_000.0, 20.0, 30.0, 0.05);
/// let steps: Vec<StepSample> = (0..50u64)
///     .map(|i| StepShape::new(i * 97 % 4096, i % 13, i * 7919 % 100_000))
///     .map(|s| StepSample::new(s, truth.step_us(&s) as f64))
///     .collect();
/// let fit = fit_linear(&steps)?;
/// assert!((fit.prefill_us_per_token - 20.0).abs() < 0.01);
/// assert!(fit.mape < 1e-3);
/// # Ok::<(), kvsim::Error>(())
/// ```
pub fn fit_linear(steps: &[StepSample]) -> Result<LinearFit, Error> {
    const NAMES: [&str; 4] = [
        "base_us",
        "prefill_us_per_token",
        "decode_us_per_request",
        "context_us_per_token",
    ];
    let row = |s: &StepSample| {
        [
            1.0,
            s.shape.prefill_tokens as f64,
            s.shape.decode_requests as f64,
            s.shape.context_tokens as f64,
        ]
    };
    // Columns that are not all zero, each scaled to unit length.
    let used: Vec<usize> = (0..4)
        .filter(|&k| steps.iter().any(|s| row(s)[k] != 0.0))
        .collect();
    if steps.len() < used.len().max(1) {
        return Err(Error::Fit(format!(
            "{} step(s): expected at least {} (one per coefficient)",
            steps.len(),
            used.len().max(1)
        )));
    }
    // Each step's equation divided by its measured time: residuals are relative errors.
    let mut cols: Vec<Vec<f64>> = used
        .iter()
        .map(|&k| steps.iter().map(|s| row(s)[k] / s.step_us).collect())
        .collect();
    let norms: Vec<f64> = cols
        .iter()
        .map(|c| c.iter().map(|x| x * x).sum::<f64>().sqrt())
        .collect();
    for (c, n) in cols.iter_mut().zip(&norms) {
        c.iter_mut().for_each(|x| *x /= n);
    }
    // Modified Gram-Schmidt: cols become Q, r is upper triangular.
    let m = cols.len();
    let mut r = vec![vec![0.0; m]; m];
    for j in 0..m {
        for i in 0..j {
            let dot: f64 = cols[i].iter().zip(&cols[j]).map(|(a, b)| a * b).sum();
            r[i][j] = dot;
            let qi = cols[i].clone();
            cols[j].iter_mut().zip(&qi).for_each(|(x, q)| *x -= dot * q);
        }
        let n = cols[j].iter().map(|x| x * x).sum::<f64>().sqrt();
        if n < 1e-9 {
            return Err(Error::Fit(format!(
                "{} does not vary independently of the other columns: expected steps that mix prefill, decode and context in varying proportions",
                NAMES[used[j]]
            )));
        }
        r[j][j] = n;
        cols[j].iter_mut().for_each(|x| *x /= n);
    }
    // Solve R x = Qᵀ y by back substitution, then undo the scaling.
    let y = vec![1.0; steps.len()];
    let qty: Vec<f64> = cols
        .iter()
        .map(|q| q.iter().zip(&y).map(|(a, b)| a * b).sum())
        .collect();
    let mut x = vec![0.0; m];
    for i in (0..m).rev() {
        let tail: f64 = (i + 1..m).map(|k| r[i][k] * x[k]).sum();
        x[i] = (qty[i] - tail) / r[i][i];
    }
    let mut coef = [0.0; 4];
    for (j, &k) in used.iter().enumerate() {
        coef[k] = x[j] / norms[j];
    }
    let model = LinearTiming::new(coef[0], coef[1], coef[2], coef[3]);
    let (mut sum, mut max) = (0.0, 0.0f64);
    for s in steps {
        let ape = (model.step_us(&s.shape) as f64 - s.step_us).abs() / s.step_us;
        sum += ape;
        max = max.max(ape);
    }
    Ok(LinearFit {
        base_us: coef[0],
        prefill_us_per_token: coef[1],
        decode_us_per_request: coef[2],
        context_us_per_token: coef[3],
        steps: steps.len(),
        mape: sum / steps.len() as f64,
        max_ape: max,
        fixed_at_zero: (0..4)
            .filter(|k| !used.contains(k))
            .map(|k| NAMES[k])
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SimRng;

    /// Steps of a realistic mix (prefill-only, decode-only and mixed), timed by `truth` with
    /// multiplicative Gaussian noise of 1% (seeded), about the jitter of a GPU's step times.
    fn noisy(truth: &dyn TimingModel, n: usize, seed: u64) -> Vec<StepSample> {
        let mut rng = SimRng::new(seed, 77);
        (0..n)
            .map(|i| {
                let prefill = if i % 3 == 1 { 0 } else { rng.below(8192) };
                let decode = if i % 3 == 0 { 0 } else { 1 + rng.below(255) };
                let context = decode * (64 + rng.below(8000));
                let shape = StepShape::new(prefill, decode, context);
                let t = truth.step_us(&shape) as f64 * (1.0 + 0.01 * rng.normal());
                StepSample::new(shape, t)
            })
            .collect()
    }

    #[test]
    fn recovers_known_coefficients_within_one_percent_from_noisy_steps() {
        for (truth, seed) in [
            (LinearTiming::default(), 1),
            (LinearTiming::new(2_000.0, 35.0, 60.0, 0.02), 2),
            (LinearTiming::new(12_000.0, 9.0, 40.0, 0.11), 3),
        ] {
            let fit = fit_linear(&noisy(&truth, 10_000, seed)).unwrap();
            let got = fit.timing();
            for (name, want, have) in [
                ("base", truth.base_us, got.base_us),
                (
                    "prefill",
                    truth.prefill_us_per_token,
                    got.prefill_us_per_token,
                ),
                (
                    "decode",
                    truth.decode_us_per_request,
                    got.decode_us_per_request,
                ),
                (
                    "context",
                    truth.context_us_per_token,
                    got.context_us_per_token,
                ),
            ] {
                let rel = (have - want).abs() / want;
                assert!(rel < 0.01, "{name}: {have} against {want} ({rel})");
            }
            // The noise is 1% (a mean absolute 0.8%): the fit cannot do much better or worse.
            assert!((0.007..0.009).contains(&fit.mape), "{}", fit.mape);
            assert!(fit.fixed_at_zero.is_empty());
        }
    }

    #[test]
    fn exact_data_fit_exactly_and_missing_columns_stay_zero() {
        // Pure decode steps: no prefill column.
        let truth = LinearTiming::new(6_000.0, 0.0, 20.0, 0.05);
        let steps: Vec<StepSample> = (1..40u64)
            .map(|i| StepShape::new(0, i, i * (500 + i * 7919 % 3000)))
            .map(|s| StepSample::new(s, truth.step_us(&s) as f64))
            .collect();
        let fit = fit_linear(&steps).unwrap();
        assert_eq!(fit.fixed_at_zero, ["prefill_us_per_token"]);
        assert_eq!(fit.prefill_us_per_token, 0.0);
        assert!((fit.base_us - 6_000.0).abs() < 0.5, "{}", fit.base_us);
        assert!((fit.context_us_per_token - 0.05).abs() < 1e-5);
        assert!(fit.max_ape < 1e-3);
    }

    #[test]
    fn underdetermined_fits_are_refused() {
        // Context always 1,000 per request: context and decode cannot be told apart.
        let steps: Vec<StepSample> = (1..20u64)
            .map(|i| StepSample::new(StepShape::new(i * 37 % 100, i, i * 1000), 100.0 + i as f64))
            .collect();
        let e = fit_linear(&steps).unwrap_err().to_string();
        assert!(
            e.contains("context_us_per_token does not vary independently"),
            "{e}"
        );
        let e = fit_linear(&[]).unwrap_err().to_string();
        assert_eq!(
            e,
            "cannot fit the timing model: 0 step(s): expected at least 1 (one per coefficient)"
        );
    }

    #[test]
    fn bad_csv_lines_are_named() {
        let h = format!("{STEPS_HEADER}\n");
        for (text, want) in [
            (String::new(), "f.csv: empty: expected the header prefill_tokens,decode_requests,context_tokens,step_us".to_string()),
            (format!("{h}1,2,3\n"), "f.csv:2: 3 fields, expected 4 as in the header".to_string()),
            (format!("{h}1,2,3,4\n\n-1,2,3,4\n"), "f.csv:4: prefill_tokens \"-1\": expected a whole number >= 0".to_string()),
            (format!("{h}1,2.5,3,4\n"), "f.csv:2: decode_requests \"2.5\": expected a whole number >= 0".to_string()),
            (format!("{h}1,2,3,0\n"), "f.csv:2: step_us \"0\": expected a finite number of µs > 0".to_string()),
            (format!("{h}1,2,3,NaN\n"), "f.csv:2: step_us \"NaN\": expected a finite number of µs > 0".to_string()),
        ] {
            assert_eq!(parse_steps("f.csv", &text).unwrap_err().to_string(), want);
        }
        // Columns in another order, an extra column.
        let s = parse_steps(
            "f.csv",
            "step_us,gpu,context_tokens,decode_requests,prefill_tokens\n900,a,30,2,10\n",
        )
        .unwrap();
        assert_eq!(s, [StepSample::new(StepShape::new(10, 2, 30), 900.0)]);
    }
}
