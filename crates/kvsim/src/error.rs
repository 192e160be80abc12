//! The crate's error type.

use std::fmt;

/// Errors of this crate. Each names the setting (by its [`SimConfig`](crate::SimConfig) field),
/// the value and what is accepted, or the trace file and line.
///
/// ```
/// let mut cfg = kvsim::SimConfig::default();
/// cfg.instances = 0;
/// let e = kvsim::Simulation::new(cfg).unwrap_err();
/// assert_eq!(e.to_string(), "invalid instances 0: expected a whole number >= 1");
/// assert!(matches!(e, kvsim::Error::InvalidSetting { setting: "instances", .. }));
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting outside what is accepted.
    #[error("invalid {setting} {value}: expected {expected}")]
    InvalidSetting {
        /// The setting: a [`SimConfig`](crate::SimConfig) field name (`timing.base_us` for a
        /// field of the timing model). Other settings named in `expected` are spelled the same way.
        setting: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: String,
    },
    /// A malformed trace.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A malformed step-times CSV (see [`parse_steps`](crate::parse_steps)): file, line, what.
    #[error(transparent)]
    Steps(TraceError),
    /// Malformed measured requests (OTLP spans or request records, see
    /// [`parse_measured`](crate::parse_measured)): file, line, what.
    #[error(transparent)]
    Spans(TraceError),
    /// An engine log that does not give what is needed (see
    /// [`VllmLog`](crate::VllmLog)): file, line, what.
    #[error(transparent)]
    EngineLog(TraceError),
    /// Measured steps that do not determine the timing model (see
    /// [`fit_linear`](crate::fit_linear)).
    #[error("cannot fit the timing model: {0}")]
    Fit(String),
    /// The router refused a setting.
    #[error(transparent)]
    Router(#[from] kvroute::Error),
}

impl Error {
    pub(crate) fn invalid(
        setting: &'static str,
        value: impl fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        Error::InvalidSetting {
            setting,
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}

/// A malformed input file (a trace, a step-times CSV): the file, the 1-based line and what is
/// wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TraceError {
    /// The file as given.
    pub file: String,
    /// The 1-based line (0 when the file could not be read at all).
    pub line: usize,
    /// What is wrong.
    pub what: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.file, self.what)
        } else {
            write!(f, "{}:{}: {}", self.file, self.line, self.what)
        }
    }
}

impl std::error::Error for TraceError {}
