//! Logs of the serving binaries (`kvrouter`, `kvmock`, `kvload`): `tracing` events written to
//! standard error as text or as one JSON object per line, filtered by `RUST_LOG` (default
//! `info`). A request's lines carry its id through the span it runs in.

use std::fmt;
use std::str::FromStr;

/// How log lines are written (`--log-format`).
///
/// ```
/// use kvserve::logging::LogFormat;
///
/// assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
/// assert_eq!(LogFormat::default().to_string(), "text");
/// assert!("yaml".parse::<LogFormat>().unwrap_err().contains("text or json"));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, the span's fields (such as `request_id`) included.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("expected text or json, got {s:?}")),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// Installs the process's log writer: `format` on standard error, filtered by `RUST_LOG` (its
/// syntax: `info`, `kvrouter=debug,warn`, ...; `info` when unset or unreadable). Does nothing
/// if a writer is installed already (a test calling it twice).
pub fn init(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colours on a terminal only: a file or a collector gets plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}
