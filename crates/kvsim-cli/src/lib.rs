//! The `kvsim` command as a library: [`run`] parses a `kvsim` command line with the command's
//! own flag parser and returns what the command prints, so that other front ends (the Python
//! bindings in `kvkit-py`) take every flag exactly as the command does, with no copy of the
//! flags. The `kvsim` binary is [`run_with`] and a few lines that print.
//!
//! ```
//! let json = kvsim_cli::run(["kvsim", "--des-num-requests", "20", "--format", "json"])?;
//! let report: serde_json::Value = serde_json::from_str(&json).unwrap();
//! assert_eq!(report["requests"], 20);
//! assert!(matches!(kvsim_cli::run(["kvsim", "--des-instances", "0"]),
//!                  Err(kvsim_cli::Error::Usage(m)) if m.contains("--des-instances 0")));
//! # Ok::<(), kvsim_cli::Error>(())
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod args;
mod calibrate;
mod capacity;
mod plot;
mod row;
mod sweep;

use std::ffi::OsString;
use std::fmt;

use kvblock::BlockSize;
use kvsim::{Simulation, Trace};

use args::{flagged, one_line, parse_from, Cli, Cmd, RunArgs, SweepArgs};

/// Why a command line gave no output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The command line or what it names is wrong (an unknown flag, a value out of range, a
    /// file that cannot be read or written, a simulation that cannot run): one line naming the
    /// flag, as `kvsim` prints it after `kvsim: ` (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// `--help` or `--version` was given: not a failure, the text to show instead of output.
    #[error("{0}")]
    Help(Help),
}

/// The text of `--help` or `--version`.
#[derive(Debug)]
pub struct Help(clap::Error);

impl Help {
    /// Prints it to standard output as the command does (styled on a terminal).
    pub fn print(&self) -> std::io::Result<()> {
        self.0.print()
    }
}

impl fmt::Display for Help {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.render())
    }
}

/// What a run may do besides returning its output. The default (what [`run`] uses) does
/// neither: no progress bars, no notes on standard error.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// Draw progress bars on standard error when it is a terminal and `--quiet` is not given.
    pub progress: bool,
    /// Write notes to standard error (the capacity search's wall time).
    pub notes: bool,
}

impl Options {
    /// What the `kvsim` command does: progress bars and notes.
    pub fn command() -> Self {
        Options {
            progress: true,
            notes: true,
        }
    }
}

/// Runs a `kvsim` command line (the first item is the program name, as in `std::env::args`)
/// and returns what the command prints on standard output: the report (text or, with
/// `--format json`, JSON), a sweep's table, a capacity search's, a calibration's. Files the
/// flags name (`--requests-out`, `--csv`, `--plot`) are written. Quiet: no progress bars, no
/// notes on standard error.
pub fn run<I, T>(argv: I) -> Result<String, Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    run_with(argv, &Options::default())
}

/// [`run`] with progress bars and notes as `opts` allows.
pub fn run_with<I, T>(argv: I, opts: &Options) -> Result<String, Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let mut cli = match parse_from(&argv) {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            return Err(Error::Help(Help(e)))
        }
        Err(e) => return Err(Error::Usage(one_line(&e))),
    };
    cli.run.bars = opts.progress;
    match cli.cmd {
        None => run_one(&cli.run),
        Some(Cmd::TraceStats {
            file,
            trace_block_size,
            format,
        }) => trace_stats(&file, trace_block_size, &format),
        Some(Cmd::Sweep(mut args)) => {
            args.batch.run.bars = opts.progress;
            sweep_command(&args, &argv)
        }
        Some(Cmd::Capacity(mut args)) => {
            args.batch.run.bars = opts.progress;
            capacity::main(&args, opts)
        }
        Some(Cmd::Calibrate(args)) => calibrate::main(&args),
    }
}

/// Builds one configuration per swept value by parsing the command line again with the value
/// appended, so every run flag can be swept and is validated exactly as for a single run.
/// Several `--param`s move together: the i-th run takes the i-th value of each.
fn sweep_command(args: &SweepArgs, argv: &[OsString]) -> Result<String, Error> {
    let params = args
        .param
        .iter()
        .map(|p| sweep::parse_param(p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(Error::Usage)?;
    let runs = params.first().map_or(0, |p| p.1.len());
    if let Some((name, values)) = params.iter().find(|p| p.1.len() != runs) {
        return Err(Error::Usage(format!(
            "invalid --param {name}: {} value(s), but the first --param has {runs}; swept parameters move together",
            values.len()
        )));
    }
    let mut configs = Vec::with_capacity(runs);
    for i in 0..runs {
        let mut a = argv.to_vec();
        for (name, values) in &params {
            a.push(format!("--{name}").into());
            a.push(values[i].clone().into());
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
                return Err(Error::Usage(format!("--param {given}: {e}")));
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

fn run_one(args: &RunArgs) -> Result<String, Error> {
    let usage = |e: &kvsim::Error| Error::Usage(flagged(e));
    let cfg = args.config().map_err(Error::Usage)?;
    let total = cfg.request_count();
    let sim = Simulation::new(cfg).map_err(|e| usage(&e))?;
    let report = if let Some(path) = args.requests_out() {
        // Every request as it was simulated, then the report as without the flag.
        let (report, reqs) = sim.run_requests().map_err(|e| usage(&e))?;
        kvsim::write_records(path, &reqs).map_err(|e| {
            Error::Usage(format!(
                "--requests-out {}: cannot write: {e}",
                path.display()
            ))
        })?;
        report
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
        result.map_err(|e| usage(&e))?
    };
    Ok(if args.json() {
        format!("{}\n", report.to_json())
    } else {
        report.to_text(args.verbose())
    })
}

fn trace_stats(file: &std::path::Path, block_size: usize, format: &str) -> Result<String, Error> {
    let Ok(bs) = BlockSize::new(block_size) else {
        return Err(Error::Usage(format!(
            "invalid --trace-block-size {block_size}"
        )));
    };
    let t = Trace::load(file, bs).map_err(|e| Error::Usage(flagged(&e)))?;
    let stats = t.stats();
    Ok(if format == "json" {
        let json = serde_json::to_string_pretty(&stats).unwrap_or_default();
        format!("{json}\n")
    } else {
        stats.to_text(t.name())
    })
}
