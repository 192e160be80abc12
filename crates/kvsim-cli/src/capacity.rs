//! `kvsim capacity`: the highest arrival rate a fleet sustains within its latency targets, or
//! the fewest instances that sustain a rate, by a parallel bisection over simulations.
//!
//! Each round runs `probes` simulations at once (with the sweep's runner) at points that
//! depend only on what earlier rounds found, so the search, its table and its answer are the
//! same for a seed whatever the number of threads. The search keeps a bracket: the best
//! passing point and the nearest failing one beyond it.
//! - Before anything fails (rate) or passes (instances), a round tries a doubling ladder.
//! - Before anything passes (rate), a round tries a halving ladder below the lowest failure.
//! - Then a round splits the bracket into `probes + 1` equal parts.
//!
//! A run passes when the share of its requests within every target (`Report::slo`) is at
//! least `--attainment`. Attainment is assumed to fall as the rate grows (and to rise with
//! instances); a pass beyond a failure is shown in the table but does not move the bracket.

use std::fmt::Write as _;
use std::time::Instant;

use kvsim::{Report, SimConfig, TraceTiming};
use serde::Serialize;

use crate::args::CapacityArgs;
use crate::{Error, Options};

/// Relative width of the rate bracket at which the search stops early.
const RATE_TOLERANCE: f64 = 0.005;

/// What the search finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Find {
    /// The highest arrival rate (requests/s) that passes.
    Rate,
    /// The fewest instances that pass.
    Instances,
}

/// One simulation of the search.
#[derive(Debug, Clone, Serialize)]
struct Probe {
    /// The rate (req/s) or instance count tried.
    x: f64,
    /// The search round it ran in (0-based).
    round: usize,
    attainment: f64,
    ttft_attainment: Option<f64>,
    itl_attainment: Option<f64>,
    e2e_attainment: Option<f64>,
    goodput_rps: f64,
    ttft_p99_ms: f64,
    itl_p99_ms: f64,
    request_hit_rate: f64,
    pass: bool,
}

/// The search's result as JSON.
#[derive(Debug, Serialize)]
struct Outcome<'a> {
    find: &'static str,
    attainment_target: f64,
    slo: Option<&'a kvsim::SloReport>,
    /// The answer: the highest passing rate, or the fewest passing instances; `null` if none
    /// passed.
    answer: Option<f64>,
    /// The nearest failing point beyond the answer (`null` if none failed there).
    first_failure: Option<f64>,
    probes: Vec<Probe>,
}

/// The trace's own arrival rate (requests over its span), when a run replays a trace with
/// its timestamps: then a rate is reached through the speed-up.
fn trace_rate(cfg: &SimConfig) -> Option<f64> {
    let t = cfg.trace.as_ref()?;
    if cfg.trace_timing != TraceTiming::Keep {
        return None;
    }
    let n = cfg.request_count();
    let span_s = t.requests().get(n.checked_sub(1)?)?.arrival_us as f64 / 1e6;
    Some(if span_s > 0.0 {
        n as f64 / span_s
    } else {
        f64::INFINITY
    })
}

/// `cfg` at point `x` of the search.
fn at(cfg: &SimConfig, find: Find, x: f64) -> SimConfig {
    let mut c = cfg.clone();
    match (find, trace_rate(cfg)) {
        (Find::Rate, Some(base)) => c.trace_speedup = x / base,
        (Find::Rate, None) => c.request_rate = x,
        (Find::Instances, _) => c.instances = x as usize,
    }
    c
}

/// The bracket after the probes so far: (best pass, nearest failure beyond it).
fn bracket(find: Find, probes: &[Probe]) -> (Option<f64>, Option<f64>) {
    match find {
        Find::Rate => {
            let fail = probes
                .iter()
                .filter(|p| !p.pass)
                .map(|p| p.x)
                .reduce(f64::min);
            let pass = probes
                .iter()
                .filter(|p| p.pass && fail.is_none_or(|f| p.x < f))
                .map(|p| p.x)
                .reduce(f64::max);
            (pass, fail)
        }
        Find::Instances => {
            let pass = probes
                .iter()
                .filter(|p| p.pass)
                .map(|p| p.x)
                .reduce(f64::min);
            let fail = probes
                .iter()
                .filter(|p| !p.pass && pass.is_none_or(|f| p.x < f))
                .map(|p| p.x)
                .reduce(f64::max);
            (pass, fail)
        }
    }
}

/// The points of the next round (empty: the search is done).
fn next_points(
    find: Find,
    probes: &[Probe],
    start: f64,
    n: usize,
    max_instances: usize,
) -> Vec<f64> {
    let (pass, fail) = bracket(find, probes);
    let tried = |x: f64| probes.iter().any(|p| p.x == x);
    let mut pts: Vec<f64> = match (find, pass, fail) {
        (Find::Rate, _, None) => {
            let base = pass.map_or(start, |p| p * 2.0);
            (0..n)
                .map(|k| base * f64::from(1u32 << k.min(30)))
                .collect()
        }
        // Failing even at a thousandth of the first rate: the targets are missed without load.
        (Find::Rate, None, Some(f)) if f < start / 1000.0 => Vec::new(),
        (Find::Rate, None, Some(f)) => (1..=n).map(|k| f / f64::from(1u32 << k.min(30))).collect(),
        (Find::Rate, Some(p), Some(f)) => {
            if f - p <= RATE_TOLERANCE * f {
                return Vec::new();
            }
            (1..=n)
                .map(|i| p + (f - p) * i as f64 / (n + 1) as f64)
                .collect()
        }
        (Find::Instances, None, _) => {
            let base = fail.map_or(1.0, |f| f * 2.0);
            (0..n)
                .map(|k| (base * f64::from(1u32 << k.min(30))).min(max_instances as f64))
                .collect()
        }
        (Find::Instances, Some(p), f) => {
            let lo = f.unwrap_or(0.0);
            (1..=n)
                .map(|i| (lo + (p - lo) * i as f64 / (n + 1) as f64).round())
                .filter(|&x| x > lo && x < p)
                .collect()
        }
    };
    pts.retain(|&x| x.is_finite() && x > 0.0 && !tried(x));
    pts.sort_by(f64::total_cmp);
    pts.dedup();
    pts
}

fn probe(x: f64, round: usize, r: &Report, target: f64) -> Probe {
    let slo = r.slo.as_ref();
    let attainment = slo.map_or(0.0, |s| s.attainment);
    Probe {
        x,
        round,
        attainment,
        ttft_attainment: slo.and_then(|s| s.ttft_attainment),
        itl_attainment: slo.and_then(|s| s.itl_attainment),
        e2e_attainment: slo.and_then(|s| s.e2e_attainment),
        goodput_rps: slo.map_or(0.0, |s| s.goodput_rps),
        ttft_p99_ms: r.ttft_ms.p99,
        itl_p99_ms: r.itl_ms.p99,
        request_hit_rate: r.request_hit_rate,
        pass: attainment >= target,
    }
}

pub(crate) fn main(args: &CapacityArgs, opts: &Options) -> Result<String, Error> {
    let fail = |msg: String| Err(Error::Usage(msg));
    let cfg = match args.batch.run.config() {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if !cfg.slo.is_set() {
        return fail(
            "capacity needs a target: give --slo-ttft-ms, --slo-itl-ms and/or --slo-e2e-ms"
                .to_string(),
        );
    }
    if !(args.attainment > 0.0 && args.attainment <= 1.0) {
        return fail(format!(
            "invalid --attainment {}: expected a share above 0 and at most 1 (0.99 = 99% of requests)",
            args.attainment
        ));
    }
    if args.runs == 0 || args.probes == 0 {
        let (flag, v) = if args.runs == 0 {
            ("--runs", args.runs)
        } else {
            ("--probes", args.probes)
        };
        return fail(format!("invalid {flag} {v}: expected a whole number >= 1"));
    }
    if args.find == "rate" && cfg.concurrency.is_some() {
        return fail(
            "--concurrency sends requests as slots free up, whatever the rate: search --find instances instead"
                .to_string(),
        );
    }
    let find = if args.find == "instances" {
        if cfg.disaggregated() {
            return fail(
                "--find instances sizes a unified fleet: it cannot be combined with --des-prefill-instances/--des-decode-instances"
                    .to_string(),
            );
        }
        if args.max_instances == 0 || args.max_instances > 1 << 16 {
            return fail(format!(
                "invalid --max-instances {}: expected a whole number from 1 to 65536",
                args.max_instances
            ));
        }
        Find::Instances
    } else {
        Find::Rate
    };
    let start = match (find, trace_rate(&cfg)) {
        (Find::Rate, Some(base)) if base.is_finite() => base * cfg.trace_speedup,
        (Find::Rate, Some(_)) => {
            return fail(
                "--trace: every request has the same timestamp, so no rate can be set by speed-up; use --trace-timing rate"
                    .to_string(),
            )
        }
        (Find::Rate, None) => cfg.request_rate,
        (Find::Instances, _) => 1.0,
    };
    let began = Instant::now();
    let mut probes: Vec<Probe> = Vec::new();
    let mut reports: Vec<Report> = Vec::new();
    let mut round = 0;
    while probes.len() < args.runs {
        let n = args.probes.min(args.runs - probes.len());
        let pts = next_points(find, &probes, start, n, args.max_instances);
        if pts.is_empty() {
            break;
        }
        let configs: Vec<(String, SimConfig)> = pts
            .iter()
            .map(|&x| (x.to_string(), at(&cfg, find, x)))
            .collect();
        let got = match crate::sweep::run_all(&configs, &args.batch) {
            Ok(r) => r,
            Err(e) => return fail(e),
        };
        for (&x, r) in pts.iter().zip(got) {
            probes.push(probe(x, round, &r, args.attainment));
            reports.push(r);
        }
        round += 1;
    }
    let wall = began.elapsed();
    let (pass, failure) = bracket(find, &probes);
    if let Some(path) = &args.plot {
        let (label, points): (&str, Vec<(f64, f64)>) = (
            match find {
                Find::Rate => "request rate (req/s)",
                Find::Instances => "instances",
            },
            probes.iter().map(|p| (p.x, p.attainment)).collect(),
        );
        if let Err(e) = crate::plot::draw_attainment(path, label, &points, args.attainment) {
            return fail(format!("--plot {}: {e}", path.display()));
        }
    }
    let mut order: Vec<usize> = (0..probes.len()).collect();
    order.sort_by(|&a, &b| probes[a].x.total_cmp(&probes[b].x));
    let slo = reports.first().and_then(|r| r.slo.as_ref());
    let mut text;
    if args.batch.run.json() {
        let out = Outcome {
            find: match find {
                Find::Rate => "rate",
                Find::Instances => "instances",
            },
            attainment_target: args.attainment,
            slo,
            answer: pass,
            first_failure: failure,
            probes: order.iter().map(|&i| probes[i].clone()).collect(),
        };
        let json = serde_json::to_string_pretty(&out).unwrap_or_default();
        text = format!("{json}\n");
    } else {
        let head = reports.first().map_or_else(String::new, |r| {
            format!(
                "routing={} | {} | {}",
                r.routing,
                r.content,
                match find {
                    Find::Rate => format!("{} instance(s)", r.instances),
                    Find::Instances => format!("{} req/s", cfg.request_rate),
                }
            )
        });
        text = to_table(find, args.attainment, slo, &head, &probes, &order);
        text.push_str(&answer_line(find, args, pass, failure, &probes));
    }
    if opts.notes {
        eprintln!(
            "kvsim: capacity search: {} runs in {} rounds, {:.2} s wall time",
            probes.len(),
            round,
            wall.as_secs_f64()
        );
    }
    Ok(text)
}

fn targets(slo: Option<&kvsim::SloReport>) -> String {
    let Some(s) = slo else {
        return String::new();
    };
    [("TTFT", s.ttft_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)]
        .iter()
        .filter_map(|(n, t)| t.map(|t| format!("{n} <= {t} ms")))
        .collect::<Vec<_>>()
        .join(", ")
}

fn to_table(
    find: Find,
    target: f64,
    slo: Option<&kvsim::SloReport>,
    head: &str,
    probes: &[Probe],
    order: &[usize],
) -> String {
    let what = match find {
        Find::Rate => "highest request rate",
        Find::Instances => "fewest instances",
    };
    let mut s = format!(
        "  Capacity search: {what} with >= {:.1}% of requests within {} | {head}\n",
        target * 100.0,
        targets(slo)
    );
    let col = match find {
        Find::Rate => "rate (req/s)",
        Find::Instances => "instances",
    };
    let _ = writeln!(
        s,
        "  {col:>12}  round  attained  TTFT-ok   ITL-ok   E2E-ok    goodput   TTFT p99   ITL p99  hit-rate  verdict"
    );
    let pct = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{:.1}%", v * 100.0));
    for &i in order {
        let p = &probes[i];
        let x = match find {
            Find::Rate => format!("{:.3}", p.x),
            Find::Instances => format!("{}", p.x),
        };
        let _ = writeln!(
            s,
            "  {x:>12}  {:>5}  {:>8}  {:>7}  {:>7}  {:>7}  {:>7.2}/s  {:>6.0} ms  {:>5.1} ms  {:>7.1}%  {}",
            p.round,
            pct(Some(p.attainment)),
            pct(p.ttft_attainment),
            pct(p.itl_attainment),
            pct(p.e2e_attainment),
            p.goodput_rps,
            p.ttft_p99_ms,
            p.itl_p99_ms,
            p.request_hit_rate * 100.0,
            if p.pass { "pass" } else { "FAIL" }
        );
    }
    s
}

fn answer_line(
    find: Find,
    args: &CapacityArgs,
    pass: Option<f64>,
    failure: Option<f64>,
    probes: &[Probe],
) -> String {
    let runs = probes.len();
    // The best attainment seen (on a tie: the lowest rate, or the most instances).
    let best = probes.iter().reduce(|a, b| {
        let tie_break = (find == Find::Rate) == (b.x < a.x);
        if b.attainment > a.attainment || (b.attainment == a.attainment && tie_break) {
            b
        } else {
            a
        }
    });
    let best = best.map_or_else(String::new, |b| {
        format!(
            "; the best attainment, {:.1}% at {}, is below the target: relax the targets or --attainment",
            b.attainment * 100.0,
            match find {
                Find::Rate => format!("{:.3} req/s", b.x),
                Find::Instances => format!("{} instance(s)", b.x),
            }
        )
    });
    match (find, pass, failure) {
        (Find::Rate, Some(p), Some(f)) => format!(
            "  Answer: {p:.3} req/s sustained ({f:.3} req/s is not); {runs} runs\n"
        ),
        (Find::Rate, Some(p), None) => format!(
            "  Answer: at least {p:.3} req/s: every rate tried passed; raise --runs to search higher\n"
        ),
        (Find::Rate, None, _) => format!(
            "  Answer: none: even the lowest rate tried fails{best}; {runs} runs\n"
        ),
        (Find::Instances, Some(p), _) => format!(
            "  Answer: {p} instance(s) sustain the rate{}; {runs} runs\n",
            failure.map_or_else(String::new, |f| format!(" ({f} do not)"))
        ),
        (Find::Instances, None, _) => format!(
            "  Answer: none: up to {} instance(s) tried, none sustains the rate{best}; {runs} runs\n",
            args.max_instances
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(x: f64, pass: bool) -> Probe {
        Probe {
            x,
            round: 0,
            attainment: if pass { 1.0 } else { 0.0 },
            ttft_attainment: None,
            itl_attainment: None,
            e2e_attainment: None,
            goodput_rps: 0.0,
            ttft_p99_ms: 0.0,
            itl_p99_ms: 0.0,
            request_hit_rate: 0.0,
            pass,
        }
    }

    /// The search against a known threshold: a rate passes below 13.7, instances from 11 on.
    #[test]
    fn search_converges_on_a_known_threshold() {
        for probes_per_round in [1, 2, 4, 7] {
            let mut ps: Vec<Probe> = Vec::new();
            loop {
                let pts = next_points(Find::Rate, &ps, 6.0, probes_per_round, 0);
                if pts.is_empty() || ps.len() > 200 {
                    break;
                }
                ps.extend(pts.iter().map(|&x| p(x, x < 13.7)));
            }
            let (pass, fail) = bracket(Find::Rate, &ps);
            let (pass, fail) = (pass.unwrap(), fail.unwrap());
            assert!(pass < 13.7 && fail >= 13.7 && fail - pass <= RATE_TOLERANCE * fail);
            let mut ps: Vec<Probe> = Vec::new();
            loop {
                let pts = next_points(Find::Instances, &ps, 1.0, probes_per_round, 64);
                if pts.is_empty() || ps.len() > 200 {
                    break;
                }
                ps.extend(pts.iter().map(|&x| p(x, x >= 11.0)));
            }
            assert_eq!(
                bracket(Find::Instances, &ps),
                (Some(11.0), Some(10.0)),
                "{probes_per_round}"
            );
        }
        // Nothing passes: the instance ladder stops at the cap.
        let mut ps: Vec<Probe> = Vec::new();
        for _ in 0..10 {
            let pts = next_points(Find::Instances, &ps, 1.0, 4, 20);
            ps.extend(pts.iter().map(|&x| p(x, false)));
        }
        assert_eq!(bracket(Find::Instances, &ps), (None, Some(20.0)));
        assert!(ps.iter().all(|q| q.x <= 20.0));
    }

    /// When every rate fails, the halving ladder stops below a thousandth of the first rate.
    #[test]
    fn a_search_where_nothing_passes_ends() {
        let mut ps: Vec<Probe> = Vec::new();
        for _ in 0..100 {
            let pts = next_points(Find::Rate, &ps, 6.0, 4, 0);
            if pts.is_empty() {
                break;
            }
            ps.extend(pts.iter().map(|&x| p(x, false)));
        }
        let lowest = ps.iter().map(|q| q.x).fold(f64::INFINITY, f64::min);
        assert!(
            ps.len() <= 16 && lowest < 6.0 / 1000.0,
            "{} runs, {lowest}",
            ps.len()
        );
        assert_eq!(bracket(Find::Rate, &ps), (None, Some(lowest)));
    }

    /// A pass beyond a failure (noise) does not move the bracket.
    #[test]
    fn a_pass_beyond_a_failure_is_ignored() {
        let ps = [p(4.0, true), p(8.0, false), p(16.0, true)];
        assert_eq!(bracket(Find::Rate, &ps), (Some(4.0), Some(8.0)));
        let ps = [p(2.0, false), p(4.0, true), p(1.0, true)];
        assert_eq!(bracket(Find::Instances, &ps), (Some(1.0), None));
    }
}
