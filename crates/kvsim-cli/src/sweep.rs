//! `kvsim sweep`: one simulation per value of a run parameter, on every core.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};
use kvsim::{Report, SimConfig, Simulation};

use crate::args::{flagged, Batch, SweepArgs};
use crate::row::Row;
use crate::Error;

/// A progress bar on stderr.
pub(crate) fn bar(total: u64, unit: &str) -> ProgressBar {
    let b = ProgressBar::new(total);
    let style =
        ProgressStyle::with_template(&format!("{{bar:40}} {{pos}}/{{len}} {unit} ({{elapsed}})"))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    b.set_style(style);
    b
}

/// Splits `NAME=V1,V2,...` into the flag name (without dashes) and its values.
pub(crate) fn parse_param(s: &str) -> Result<(String, Vec<String>), String> {
    let (name, values) = s.split_once('=').ok_or_else(|| {
        format!("invalid --param {s:?}: expected NAME=V1,V2,... (e.g. des-overlap-weight=0,1,2)")
    })?;
    let name = name.trim().trim_start_matches('-').to_string();
    let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
    if name.is_empty() || values.iter().any(String::is_empty) {
        return Err(format!(
            "invalid --param {s:?}: expected NAME=V1,V2,... with no empty value"
        ));
    }
    Ok((name, values))
}

/// Runs every configuration on the batch's threads; results keep the order of the values.
pub(crate) fn run_all(
    configs: &[(String, SimConfig)],
    batch: &Batch,
) -> Result<Vec<Report>, String> {
    let (jobs, progress) = (batch.jobs(), batch.run.progress());
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Report, String>>>> = Mutex::new(vec![None; configs.len()]);
    let bar = progress.then(|| bar(configs.len() as u64, "runs"));
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, configs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((_, cfg)) = configs.get(i) else {
                    break;
                };
                let r = Simulation::new(cfg.clone())
                    .and_then(|sim| sim.run())
                    .map_err(|e| flagged(&e));
                if let Ok(mut all) = results.lock() {
                    all[i] = Some(r);
                }
                if let Some(b) = &bar {
                    b.inc(1);
                }
            });
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let all = results
        .into_inner()
        .map_err(|_| "a simulation thread panicked".to_string())?;
    all.into_iter()
        .map(|r| r.unwrap_or_else(|| Err("a simulation did not run".to_string())))
        .collect()
}

pub(crate) fn main(
    args: &SweepArgs,
    name: &str,
    configs: Vec<(String, SimConfig)>,
) -> Result<String, Error> {
    let reports = run_all(&configs, &args.batch).map_err(Error::Usage)?;
    let rows: Vec<Row> = configs
        .iter()
        .zip(&reports)
        .map(|((v, _), r)| Row::new(name, v, r))
        .collect();
    if let Some(path) = &args.csv {
        if let Err(e) = std::fs::write(path, to_csv(&rows)) {
            return Err(Error::Usage(format!("--csv {}: {e}", path.display())));
        }
    }
    if let Some(path) = &args.plot {
        if let Err(e) = crate::plot::draw(path, name, &rows) {
            return Err(Error::Usage(format!("--plot {}: {e}", path.display())));
        }
    }
    if args.batch.run.json() {
        let json = serde_json::to_string_pretty(&rows).unwrap_or_default();
        Ok(format!("{json}\n"))
    } else {
        let head = reports
            .first()
            .map(|r| r.to_text(false))
            .unwrap_or_default();
        let fleet = head.lines().next().unwrap_or("").trim();
        Ok(to_table(name, fleet, &rows))
    }
}

fn to_csv(rows: &[Row]) -> String {
    let mut s = String::from(
        "param,value,request_hit_rate,block_reuse,per_instance_hit_rate_min,per_instance_hit_rate_max,\
         load_balance,ttft_p50_ms,ttft_p99_ms,itl_p99_ms,makespan_s,evictions,completed,rejected,\
         decode_block_reuse,decode_load_balance,transfer_p99_ms",
    );
    let slo = rows.iter().any(|r| r.slo_attainment.is_some());
    s.push_str(if slo {
        ",slo_attainment,goodput_rps\n"
    } else {
        "\n"
    });
    for r in rows {
        let _ = writeln!(
            s,
            "{},{},{:.6},{:.6},{:.6},{:.6},{:.4},{:.3},{:.3},{:.3},{:.3},{},{},{},{},{},{}",
            r.param,
            r.value,
            r.request_hit_rate,
            r.block_reuse,
            r.per_instance_hit_rate_min,
            r.per_instance_hit_rate_max,
            r.load_balance,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p99_ms,
            r.makespan_s,
            r.evictions,
            r.completed,
            r.rejected,
            opt(r.decode_block_reuse, 6),
            opt(r.decode_load_balance, 4),
            opt(r.transfer_p99_ms, 3)
        );
        if slo {
            s.pop();
            let _ = writeln!(s, ",{},{}", opt(r.slo_attainment, 6), opt(r.goodput_rps, 4));
        }
    }
    s
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(String::new, |x| format!("{x:.digits$}"))
}

fn to_table(name: &str, fleet: &str, rows: &[Row]) -> String {
    let pd = rows.iter().any(|r| r.decode_block_reuse.is_some());
    let slo = rows.iter().any(|r| r.slo_attainment.is_some());
    let w = rows
        .iter()
        .map(|r| r.value.len())
        .max()
        .unwrap_or(0)
        .max(name.len());
    let mut s = format!("  Sweep of {name} over {} value(s) | {fleet}\n", rows.len());
    let _ = writeln!(
        s,
        "  {name:>w$}  hit-rate  block-reuse  per-instance  balance     TTFT p50     TTFT p99    ITL p99   makespan{}{}",
        if pd { "  decode-reuse  decode-balance  transfer p99" } else { "" },
        if slo { "  SLO-attained     goodput" } else { "" }
    );
    for r in rows {
        let _ = writeln!(
            s,
            "  {:>w$}  {:>7.1}%  {:>10.1}%  {:>12}  {:>7.2}  {:>8.0} ms  {:>8.0} ms  {:>6.1} ms  {:>8.1} s{}{}{}",
            r.value,
            r.request_hit_rate * 100.0,
            r.block_reuse * 100.0,
            format!("{:.0}–{:.0}%", r.per_instance_hit_rate_min * 100.0, r.per_instance_hit_rate_max * 100.0),
            r.load_balance,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p99_ms,
            r.makespan_s,
            match (r.decode_block_reuse, r.decode_load_balance, r.transfer_p99_ms) {
                (Some(reuse), Some(bal), Some(t)) => format!("  {:>11.1}%  {bal:>14.2}  {t:>9.1} ms", reuse * 100.0),
                _ => String::new(),
            },
            match (r.slo_attainment, r.goodput_rps) {
                (Some(a), Some(g)) => format!("  {:>11.1}%  {g:>6.2}/s", a * 100.0),
                _ => String::new(),
            },
            if r.load_balance > kvsim::HOT_SPOT_THRESHOLD { "  hot spot" } else { "" }
        );
    }
    s
}
