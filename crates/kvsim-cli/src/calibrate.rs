//! `kvsim calibrate`: the step-time model from measured steps (least squares) or from measured
//! requests (the simulator in the loop, `kvsim::fit_spans`).

use std::fmt::Write as _;
use std::path::Path;

use kvsim::{PhaseComparison, SpanFitOptions};

use crate::args::{flagged, CalibrateArgs};
use crate::{plot, Error};

/// A usage error.
fn usage_error(msg: impl Into<String>) -> Result<String, Error> {
    Err(Error::Usage(msg.into()))
}

pub(crate) fn main(args: &CalibrateArgs) -> Result<String, Error> {
    match (&args.steps, &args.run.spans) {
        (Some(file), _) => steps(file, if args.run.json() { "json" } else { "text" }),
        (None, Some(file)) => spans(args, file),
        (None, None) => usage_error("calibrate needs --spans FILE or --steps FILE.csv"),
    }
}

/// Phases as `--fit-phases` lists them: `0,1`, `0-3`, `0-1,5`.
fn parse_phases(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |x: &str| {
            x.trim().parse::<usize>().map_err(|_| {
                format!("invalid --fit-phases {s:?}: expected phase numbers such as 0,1 or 0-3")
            })
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b || b - a > 1_000_000 {
                    return Err(format!(
                        "invalid --fit-phases {s:?}: {a}-{b} is not a range"
                    ));
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    if out.is_empty() {
        return Err(format!(
            "invalid --fit-phases {s:?}: expected at least one phase"
        ));
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn spans(args: &CalibrateArgs, file: &Path) -> Result<String, Error> {
    let mut cfg = match args.run.config() {
        Ok(c) => c,
        Err(msg) => return usage_error(msg),
    };
    // Spans of one engine replay on one engine unless told otherwise.
    if args.run.des_instances.is_none() {
        cfg.instances = 1;
    }
    let measured = match kvsim::load_measured(file) {
        Ok(m) => m,
        Err(e) => return usage_error(format!("--spans {e}")),
    };
    let phases = match args.phase_window_s {
        Some(s) if !(s.is_finite() && s > 0.0) => {
            return usage_error(format!(
                "invalid --phase-window-s {s}: expected a number of seconds > 0"
            ))
        }
        Some(s) => kvsim::phases_by_window(&measured, (s * 1e6).round() as u64),
        None if args.phase_requests == 0 => {
            return usage_error("invalid --phase-requests 0: expected a whole number >= 1")
        }
        None => kvsim::phases_by_count(measured.len(), args.phase_requests),
    };
    let fit_phases = match args.fit_phases.as_deref().map(parse_phases).transpose() {
        Ok(p) => p.unwrap_or_default(),
        Err(e) => return usage_error(e),
    };
    if let Some(&p) = fit_phases.iter().find(|&&p| p >= phases.len()) {
        return usage_error(format!(
            "invalid --fit-phases: phase {p}, but the requests make {} phases (0-{})",
            phases.len(),
            phases.len() - 1
        ));
    }
    let opts = SpanFitOptions::default()
        .shared_prefix_tokens(args.run.shared_prefix_tokens.unwrap_or(0))
        .fit_phases(fit_phases.clone())
        .max_evaluations(args.max_evaluations);
    let fit = match kvsim::fit_spans(&cfg, &measured, &phases, &opts) {
        Ok(f) => f,
        Err(e) => return usage_error(flagged(&e)),
    };
    if let Some(path) = &args.plot {
        // The run's folder and file name: enough to tell runs apart, no more of the path.
        let shown: Vec<_> = file.iter().rev().take(2).collect();
        let shown: Vec<_> = shown.iter().rev().map(|p| p.to_string_lossy()).collect();
        let title = format!("kvsim against {}", shown.join("/"));
        if let Err(e) = plot::draw_fidelity(path, &title, &fit.phases) {
            return usage_error(format!("--plot {}: {e}", path.display()));
        }
    }
    let t = fit.timing;
    let mut flags = vec![
        format!("--timing-base-us {}", significant(t.base_us, 6)),
        format!(
            "--timing-prefill-us {}",
            significant(t.prefill_us_per_token, 6)
        ),
        format!(
            "--timing-decode-us {}",
            significant(t.decode_us_per_request, 6)
        ),
        format!(
            "--timing-context-us {}",
            significant(t.context_us_per_token, 6)
        ),
        format!("--des-block-size {}", cfg.block_size),
    ];
    if let Some(b) = cfg.kv_blocks {
        flags.push(format!("--des-kv-blocks {b}"));
    }
    flags.push(format!("--max-batched-tokens {}", cfg.max_batched_tokens));
    flags.push(format!("--max-num-seqs {}", cfg.max_num_seqs));
    flags.push(format!("--kv-allocation {}", cfg.kv_allocation));
    flags.push(format!("--scheduler {}", cfg.scheduler));
    flags.push(format!("--des-instances {}", cfg.instances));
    if let Some(n) = args.run.shared_prefix_tokens.filter(|&n| n > 0) {
        flags.push(format!("--shared-prefix-tokens {n}"));
    }
    if args.run.json() {
        let doc = serde_json::json!({
            "requests": measured.len(),
            "phases": fit.phases,
            "fit_phases": fit.phases.iter().filter(|p| p.fitted).map(|p| p.phase).collect::<Vec<_>>(),
            "timing": fit.timing,
            "in_sample": fit.in_sample,
            "held_out": fit.held_out,
            "objective": fit.objective,
            "evaluations": fit.evaluations,
            "flags": flags.join(" "),
        });
        return Ok(format!(
            "{}\n",
            serde_json::to_string_pretty(&doc).unwrap_or_default()
        ));
    }
    let mut out = String::new();
    let fitted = fit.phases.iter().filter(|p| p.fitted).count();
    let _ = writeln!(
        out,
        "  Calibration: {} requests from {} in {} phases ({} fitted), {} simulations",
        measured.len(),
        file.display(),
        fit.phases.len(),
        fitted,
        fit.evaluations
    );
    let _ = writeln!(
        out,
        "  Engine: block {} tok, {} KV blocks, {} tokens per step, {} sequences, {} allocation, {} scheduler, {} instance(s)",
        cfg.block_size,
        cfg.kv_blocks.map_or("unbounded".to_string(), |b| b.to_string()),
        cfg.max_batched_tokens,
        cfg.max_num_seqs,
        cfg.kv_allocation,
        cfg.scheduler,
        cfg.instances
    );
    out.push_str(&phase_table(&fit.phases));
    let line = |what: &str, e: &kvsim::FidelityError| {
        format!(
            "  Mean absolute error, {what} ({} phases): TTFT {:.1}%, ITL {:.1}%, E2E {:.1}%\n",
            e.phases,
            e.ttft * 100.0,
            e.itl * 100.0,
            e.e2e * 100.0
        )
    };
    out.push_str(&line("fitted phases", &fit.in_sample));
    if fit.held_out.phases > 0 {
        out.push_str(&line("held-out phases", &fit.held_out));
    }
    let _ = writeln!(out, "  Flags: {}", flags.join(" "));
    Ok(out)
}

/// Each phase measured against simulated: mean TTFT, ITL and mean E2E, ms.
pub(crate) fn phase_table(phases: &[PhaseComparison]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  phase  fit  reqs | TTFT ms   real      sim    err | ITL ms  real    sim    err | E2E ms    real       sim    err"
    );
    for p in phases {
        let e = p.errors();
        let _ = writeln!(
            out,
            "  {:>5}  {:>3}  {:>4} |      {:>8.1} {:>8.1} {:>5.1}% |     {:>6.2} {:>6.2} {:>5.1}% |     {:>9.1} {:>9.1} {:>5.1}%",
            p.phase,
            if p.fitted { "yes" } else { "no" },
            p.real.requests,
            p.real.ttft_mean,
            p.sim.ttft_mean,
            e[0] * 100.0,
            p.real.itl_mean,
            p.sim.itl_mean,
            e[2] * 100.0,
            p.real.e2e_mean,
            p.sim.e2e_mean,
            e[4] * 100.0,
        );
    }
    out
}

/// `x` with `digits` significant digits, as the shortest decimal that reads back the same.
pub(crate) fn significant(x: f64, digits: i32) -> String {
    if x == 0.0 || !x.is_finite() {
        return x.to_string();
    }
    let scale = 10f64.powi(digits - 1 - x.abs().log10().floor() as i32);
    ((x * scale).round() / scale).to_string()
}

fn steps(file: &std::path::Path, format: &str) -> Result<String, Error> {
    let fit = match kvsim::load_steps(file).and_then(|s| kvsim::fit_linear(&s)) {
        Ok(f) => f,
        Err(e @ kvsim::Error::Fit(_)) => {
            return usage_error(format!("--steps {}: {e}", file.display()))
        }
        Err(e) => return usage_error(format!("--steps {e}")),
    };
    if format == "json" {
        let json = serde_json::to_string_pretty(&fit).unwrap_or_default();
        return Ok(format!("{json}\n"));
    }
    use std::fmt::Write as _;
    let mut out = String::new();
    let c = [
        ("--timing-base-us", fit.base_us, "us per step"),
        (
            "--timing-prefill-us",
            fit.prefill_us_per_token,
            "us per prefill token",
        ),
        (
            "--timing-decode-us",
            fit.decode_us_per_request,
            "us per decoding request",
        ),
        (
            "--timing-context-us",
            fit.context_us_per_token,
            "us per context token",
        ),
    ];
    let _ = writeln!(
        out,
        "  Calibration: {} steps from {}, least squares on relative error",
        fit.steps,
        file.display()
    );
    for (flag, v, unit) in c {
        let _ = writeln!(out, "  {:<20} {:>14}  {unit}", flag, significant(v, 6));
    }
    if !fit.fixed_at_zero.is_empty() {
        let _ = writeln!(
            out,
            "  fixed at 0 (their column is 0 in every step): {}",
            fit.fixed_at_zero.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "  Mean absolute percentage error {:.2}% (worst step {:.2}%)",
        fit.mape * 100.0,
        fit.max_ape * 100.0
    );
    if c.iter().any(|x| x.1 < 0.0) {
        let _ = writeln!(out, "  WARNING: a negative coefficient: --timing-* accepts only >= 0; the linear model does not describe these steps well");
    }
    let flags: Vec<String> = c
        .iter()
        .map(|(f, v, _)| format!("{f} {}", significant(*v, 6)))
        .collect();
    let _ = writeln!(out, "  Flags: {}", flags.join(" "));
    Ok(out)
}
