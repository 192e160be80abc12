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
#![deny(missing_docs)]
// No input a caller, an engine or a file supplies may panic the library.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod config;
mod report;
mod rng;
mod sim;
mod timing;
mod trace;
mod workload;

pub use config::{ArrivalModel, Popularity, SimConfig, TraceTiming, MAX_TOKENS};
pub use kvroute::Policy;
pub use report::{InstanceReport, PdReport, PoolReport, Report, Summary, HOT_SPOT_THRESHOLD};
pub use sim::Simulation;
pub use timing::{LinearTiming, StepShape, TimingModel};
pub use trace::{Lengths, Trace, TraceError, TraceRequest, TraceStats};

/// Errors of this crate. Each names the setting (by its CLI flag), the value and what is
/// accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting outside what is accepted.
    #[error("invalid {flag} {value}: expected {expected}")]
    InvalidSetting {
        /// The CLI flag of the setting.
        flag: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: String,
    },
    /// The router refused a setting.
    #[error(transparent)]
    Router(#[from] kvroute::Error),
}

impl Error {
    pub(crate) fn invalid(
        flag: &'static str,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        Error::InvalidSetting {
            flag,
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}
