//! A deterministic discrete-event simulator of a fleet of LLM engine replicas behind the
//! `kvroute` router.
//!
//! Each simulated engine owns a real [`kvcache::BlockCache`] and runs continuous batching with
//! chunked prefill; its KV events feed a real [`kvroute::Router`], which routes every arriving
//! request with the same cost function a deployed router uses. Cache hit rate is therefore an
//! emergent property of content, capacity and routing, and a result here transfers to a router
//! built on the same crates.
//!
//! - Simulated time is integer microseconds; one event queue ordered by (time, insertion order).
//!   The same settings and seed give the same report, byte for byte, on any machine.
//! - Step time is a pluggable [`TimingModel`]; the default [`LinearTiming`] describes an 8B
//!   model on one H100-class GPU and is meant to be replaced by your own fit.
//! - One engine's state machine is [`Engine`]: it knows nothing about the event queue, so the
//!   same code can be driven by a wall clock (an engine emulator) as by simulated time.
//!
//! ```
//! use kvsim::{SimConfig, Simulation};
//!
//! let mut cfg = SimConfig::default();
//! cfg.num_requests = 50;
//! cfg.block_size = kvblock::BlockSize::new(512)?;
//! let report = Simulation::new(cfg)?.run()?;
//! assert_eq!(report.completed, 50);
//! assert!(report.request_hit_rate > 0.5);
//! println!("{}", report.to_text(false));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Modules
//!
//! The pieces depend on each other one way only: `error` and `stats` are leaves; `timing`,
//! `trace`, `config` and `workload` describe a run; `engine` is one engine's state machine;
//! `fleet` holds the engines and their routers; `sim` is the event loop; `report` turns the
//! plain records the loop hands it into figures.
//!
//! # Features
//!
//! `cli` (off): `cli::WorkloadArgs`, the workload's command-line flags as a `clap` struct
//! that the `kvsim` command and `kvload` both flatten (costs the `clap` crate). Otherwise the
//! library depends on `kvroute` (and so `kvcache`, `kvblock`), `serde` and
//! `serde_json` (the JSON report and trace parsing), `rand_core`/`rand_xoshiro` (seeded
//! sampling), `libm` and `thiserror`. The `kvsim` command, with clap, plotters and indicatif, is
//! the separate `kvsim-cli` package.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
// No input a caller, an engine or a file supplies may panic the library.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod calibrate;
#[cfg(feature = "cli")]
pub mod cli;
mod config;
mod engine;
mod engine_loop;
mod error;
mod fastline;
mod fidelity;
mod fleet;
mod records;
mod report;
mod requests;
mod rng;
mod sim;
mod slo;
mod spans;
mod stats;
mod timing;
mod trace;
mod vllm_log;
mod workload;

pub use calibrate::{fit_linear, load_steps, parse_steps, LinearFit, StepSample, STEPS_HEADER};
pub use config::{ArrivalModel, DpRouting, PdLink, Popularity, SimConfig, TraceTiming};
pub use engine::{
    Engine, EngineConfig, EngineRequest, KvAllocation, Outcome, PlannedStep, Pool, Scheduler,
};
pub use engine_loop::EngineLoop;
pub use error::{Error, TraceError};
pub use fidelity::{
    compare_phases, fit_spans, phases_by_count, phases_by_window, FidelityError, PhaseComparison,
    PhaseFigures, SpanFit, SpanFitOptions,
};
pub use kvroute::{CostModel, Policy, SessionAffinity};
pub use records::MeasuredRequest;
pub use report::{
    InstanceReport, PdReport, PoolReport, Report, SessionsReport, TierReport, TurnReport,
    TurnsReport, HOT_SPOT_THRESHOLD,
};
pub use requests::{measured_report, workload_requests, PromptContent, WorkloadRequest};
pub use sim::Simulation;
pub use slo::{Slo, SloReport};
pub use spans::{load_measured, parse_measured, record_line, write_records, LLM_REQUEST_SPAN};
pub use stats::Summary;
pub use timing::{LinearTiming, PolynomialTiming, StepShape, TimingKind, TimingModel};
pub use trace::{Lengths, Trace, TraceRequest, TraceStats, MAX_TOKENS};
pub use vllm_log::VllmLog;

// The README's example, compiled and run as a doc test so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
