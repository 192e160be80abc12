//! The `kvsim` command: simulate a fleet of LLM engines behind a KV-aware router.
#![forbid(unsafe_code)]

mod args;
mod calibrate;
mod capacity;
mod plot;
mod row;
mod sweep;

use std::process::ExitCode;

use kvblock::BlockSize;
use kvsim::{Simulation, Trace};

use args::{flagged, one_line, parse_from, Cli, Cmd, RunArgs, SweepArgs};

fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("kvsim: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = match parse_from(std::env::args_os()) {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => return usage_error(one_line(&e)),
    };
    match cli.cmd {
        None => run(&cli.run),
        Some(Cmd::TraceStats {
            file,
            trace_block_size,
            format,
        }) => trace_stats(&file, trace_block_size, &format),
        Some(Cmd::Sweep(args)) => sweep_command(&args),
        Some(Cmd::Capacity(args)) => capacity::main(&args),
        Some(Cmd::Calibrate(args)) => calibrate::main(&args),
    }
}

/// Builds one configuration per swept value by parsing the command line again with the value
/// appended, so every run flag can be swept and is validated exactly as for a single run.
/// Several `--param`s move together: the i-th run takes the i-th value of each.
fn sweep_command(args: &SweepArgs) -> ExitCode {
    let params = match args
        .param
        .iter()
        .map(|p| sweep::parse_param(p))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(p) => p,
        Err(e) => return usage_error(e),
    };
    let runs = params.first().map_or(0, |p| p.1.len());
    if let Some((name, values)) = params.iter().find(|p| p.1.len() != runs) {
        return usage_error(format!(
            "invalid --param {name}: {} value(s), but the first --param has {runs}; swept parameters move together",
            values.len()
        ));
    }
    let argv: Vec<String> = std::env::args().collect();
    let mut configs = Vec::with_capacity(runs);
    for i in 0..runs {
        let mut a = argv.clone();
        for (name, values) in &params {
            a.push(format!("--{name}"));
            a.push(values[i].clone());
        }
        let label = params
            .iter()
            .map(|p| p.1[i].as_str())
            .collect::<Vec<_>>()
            .join("/");
        let parsed = match parse_from(&a) {
            Ok(Cli {
                cmd: Some(Cmd::Sweep(s)),
                ..
            }) => s.batch.run.config(),
            Ok(_) => Err("internal: the sweep's command line did not parse as a sweep".to_string()),
            Err(e) => Err(one_line(&e)),
        };
        match parsed {
            Ok(cfg) => configs.push((label, cfg)),
            Err(e) => {
                let given = params
                    .iter()
                    .map(|p| format!("{}={}", p.0, p.1[i]))
                    .collect::<Vec<_>>()
                    .join(" ");
                return usage_error(format!("--param {given}: {e}"));
            }
        }
    }
    let name = params
        .iter()
        .map(|p| p.0.as_str())
        .collect::<Vec<_>>()
        .join("/");
    sweep::main(args, &name, configs)
}

fn run(args: &RunArgs) -> ExitCode {
    let cfg = match args.config() {
        Ok(c) => c,
        Err(msg) => return usage_error(msg),
    };
    let total = cfg.request_count();
    let sim = match Simulation::new(cfg) {
        Ok(s) => s,
        Err(e) => return usage_error(flagged(&e)),
    };
    let result = if let Some(path) = args.requests_out() {
        // Every request as it was simulated, then the report as without the flag.
        let (report, reqs) = match sim.run_requests() {
            Ok(x) => x,
            Err(e) => return usage_error(flagged(&e)),
        };
        if let Err(e) = kvsim::write_records(path, &reqs) {
            return usage_error(format!(
                "--requests-out {}: cannot write: {e}",
                path.display()
            ));
        }
        Ok(report)
    } else {
        let bar =
            (args.progress() && total >= 20_000).then(|| sweep::bar(total as u64, "requests"));
        let result = match &bar {
            Some(b) => sim.run_with_progress(&mut |done| b.set_position(done as u64)),
            None => sim.run(),
        };
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        result
    };
    match result {
        Ok(report) if args.json() => emit(&format!("{}\n", report.to_json())),
        Ok(report) => emit(&report.to_text(args.verbose())),
        Err(e) => return usage_error(flagged(&e)),
    }
    ExitCode::SUCCESS
}

/// Writes `text` to stdout; a reader that went away (`kvsim ... | head`) is not an error, any
/// other failure to write ends the command with one line and exit code 1.
pub(crate) fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("kvsim: cannot write the output: {e}");
            std::process::exit(1);
        }
        _ => {}
    }
}

fn trace_stats(file: &std::path::Path, block_size: usize, format: &str) -> ExitCode {
    let Ok(bs) = BlockSize::new(block_size) else {
        return usage_error(format!("invalid --trace-block-size {block_size}"));
    };
    match Trace::load(file, bs) {
        Ok(t) => {
            let stats = t.stats();
            if format == "json" {
                let json = serde_json::to_string_pretty(&stats).unwrap_or_default();
                emit(&format!("{json}\n"));
            } else {
                emit(&stats.to_text(t.name()));
            }
            ExitCode::SUCCESS
        }
        Err(e) => usage_error(flagged(&e)),
    }
}
