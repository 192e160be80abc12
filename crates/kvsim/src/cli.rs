//! The workload's command-line flags (feature `cli`), one set shared by every tool that makes
//! kvsim's request stream: the `kvsim` command and `kvload` flatten [`WorkloadArgs`] into their
//! own flags, so a workload is spelled the same way in a simulation and in a live run.
//!
//! ```
//! use clap::Parser;
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     workload: kvsim::cli::WorkloadArgs,
//! }
//! let cli = Cli::try_parse_from(["tool", "--request-rate", "12", "--des-num-requests", "30"]).unwrap();
//! let mut cfg = kvsim::SimConfig::default();
//! cli.workload.apply(&mut cfg).unwrap();
//! assert_eq!((cfg.request_rate, cfg.num_requests), (12.0, 30));
//! ```

use std::path::PathBuf;

use kvblock::BlockSize;

use crate::config::{ArrivalModel, Popularity, SimConfig, TraceTiming};
use crate::error::Error;
use crate::trace::Trace;

/// Arrivals, synthetic content and trace replay: the flags that say which requests arrive
/// when. Unset flags keep the [`SimConfig`]'s values.
#[derive(Debug, Clone, Default, clap::Args)]
#[non_exhaustive]
pub struct WorkloadArgs {
    /// Arrival rate, requests per second.
    #[arg(long, value_name = "R", help_heading = "Arrivals")]
    pub request_rate: Option<f64>,
    /// Arrival process: poisson, constant or gamma.
    #[arg(long, value_parser = parse_arrival, value_name = "MODEL", help_heading = "Arrivals")]
    pub arrival_model: Option<ArrivalModel>,
    /// Coefficient of variation of gamma inter-arrival times (1 = Poisson, higher = burstier).
    #[arg(long, value_name = "CV", help_heading = "Arrivals")]
    pub arrival_cv: Option<f64>,
    /// Requests to simulate (a trace: at most its length).
    #[arg(long, value_name = "N", help_heading = "Arrivals")]
    pub des_num_requests: Option<usize>,
    /// Seed of every random choice.
    #[arg(long, value_name = "S", help_heading = "Arrivals")]
    pub seed: Option<u64>,

    /// Prefixes in the synthetic pool.
    #[arg(long, value_name = "P", help_heading = "Synthetic content")]
    pub des_num_prefixes: Option<usize>,
    /// Tokens per prefix.
    #[arg(long, value_name = "L", help_heading = "Synthetic content")]
    pub des_prefix_len: Option<usize>,
    /// How requests pick a prefix: uniform, or zipf:S (exponent S > 0) for a few hot prefixes.
    #[arg(long, value_parser = parse_popularity, value_name = "DIST", help_heading = "Synthetic content")]
    pub prefix_popularity: Option<Popularity>,
    /// Prompt tokens per request, prefix included (a unique suffix fills the rest).
    #[arg(long, value_name = "TOKENS", help_heading = "Synthetic content")]
    pub input_len: Option<usize>,
    /// Output tokens per request.
    #[arg(long, value_name = "TOKENS", help_heading = "Synthetic content")]
    pub output_len: Option<usize>,

    /// Replay this Mooncake-format JSONL trace instead of the synthetic prefix pool (lines
    /// with session_id and think_time_ms replay as multi-turn sessions).
    #[arg(long, value_name = "FILE", help_heading = "Trace replay")]
    pub trace: Option<PathBuf>,
    /// Tokens per block of the trace's hash ids.
    #[arg(long, default_value_t = Trace::MOONCAKE_BLOCK_SIZE, value_parser = parse_block_size, value_name = "TOKENS", help_heading = "Trace replay")]
    pub trace_block_size: usize,
    /// Divide the trace's inter-arrival times by X.
    #[arg(long, value_name = "X", help_heading = "Trace replay")]
    pub trace_speedup: Option<f64>,
    /// keep: the trace's timestamps; rate: re-time arrivals with --arrival-model and --request-rate.
    #[arg(long, value_parser = parse_trace_timing, value_name = "MODE", help_heading = "Trace replay")]
    pub trace_timing: Option<TraceTiming>,
}

impl WorkloadArgs {
    /// Loads `--trace` into `cfg` (its block size becomes the run's); an unreadable or
    /// malformed trace is an [`Error::Trace`] naming the file and the line.
    pub fn load_trace(&self, cfg: &mut SimConfig) -> Result<(), Error> {
        if let Some(path) = &self.trace {
            let bs = BlockSize::new(self.trace_block_size).map_err(|_| {
                Error::invalid(
                    "trace_block_size",
                    self.trace_block_size,
                    "a whole number of tokens >= 1",
                )
            })?;
            let trace = Trace::load(path, bs)?;
            *cfg = cfg.clone().with_trace(trace);
        }
        Ok(())
    }

    /// [`load_trace`](Self::load_trace), then every other flag given onto `cfg`. Values are
    /// checked by [`SimConfig::validate`], not here.
    pub fn apply(&self, cfg: &mut SimConfig) -> Result<(), Error> {
        self.load_trace(cfg)?;
        self.apply_settings(cfg);
        Ok(())
    }

    /// Every flag given but `--trace` onto `cfg`.
    pub fn apply_settings(&self, cfg: &mut SimConfig) {
        fn set<T: Clone>(field: &mut T, flag: &Option<T>) {
            if let Some(v) = flag {
                *field = v.clone();
            }
        }
        set(&mut cfg.num_requests, &self.des_num_requests);
        set(&mut cfg.request_rate, &self.request_rate);
        set(&mut cfg.arrival_model, &self.arrival_model);
        set(&mut cfg.arrival_cv, &self.arrival_cv);
        set(&mut cfg.seed, &self.seed);
        set(&mut cfg.num_prefixes, &self.des_num_prefixes);
        set(&mut cfg.prefix_len, &self.des_prefix_len);
        set(&mut cfg.prefix_popularity, &self.prefix_popularity);
        set(&mut cfg.input_len, &self.input_len);
        set(&mut cfg.output_len, &self.output_len);
        set(&mut cfg.trace_speedup, &self.trace_speedup);
        set(&mut cfg.trace_timing, &self.trace_timing);
    }
}

/// The part of a library parse error after "expected", for clap's message.
fn expected(e: Error) -> String {
    match e {
        Error::InvalidSetting { expected, .. } => format!("expected {expected}"),
        other => other.to_string(),
    }
}

fn parse_arrival(s: &str) -> Result<ArrivalModel, String> {
    s.parse().map_err(expected)
}

fn parse_popularity(s: &str) -> Result<Popularity, String> {
    s.parse().map_err(expected)
}

fn parse_trace_timing(s: &str) -> Result<TraceTiming, String> {
    s.parse().map_err(expected)
}

/// A block size: a whole number of tokens >= 1 (and what [`BlockSize`] accepts).
pub fn parse_block_size(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| "expected a whole number of tokens >= 1".to_string())?;
    BlockSize::new(n)
        .map(BlockSize::get)
        .map_err(|e| e.to_string())
}
