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
    let _ = install(format, None);
}

/// What exports spans as OpenTelemetry traces (none without the `otlp` feature).
#[cfg(feature = "otlp")]
type Tracer = opentelemetry_sdk::trace::SdkTracer;
#[cfg(not(feature = "otlp"))]
type Tracer = std::convert::Infallible;

/// The process's log writer, and with `tracer` its spans exported as OpenTelemetry traces.
fn install(format: LogFormat, tracer: Option<Tracer>) -> Result<(), String> {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours on a terminal only: a file or a collector gets plain text.
    let ansi = std::io::stderr().is_terminal();
    let lines = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let registry = tracing_subscriber::registry().with(lines.with_filter(filter));
    #[cfg(not(feature = "otlp"))]
    let _ = tracer;
    #[cfg(feature = "otlp")]
    if let Some(tracer) = tracer {
        // Spans (info and above) go to the collector whatever RUST_LOG lets through to the log.
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            // The spans' own fields only: no source locations, threads or busy/idle times.
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
        return registry.with(layer).try_init().map_err(|e| e.to_string());
    }
    registry.try_init().map_err(|e| e.to_string())
}

#[cfg(feature = "otlp")]
pub use otlp::{continue_trace, init_traced, trace_headers, tracing_on, TraceGuard};

#[cfg(feature = "otlp")]
mod otlp {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{
        BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::{install, LogFormat};

    /// Span batches the collector did not take (unreachable, refused): counted, never waited on.
    static EXPORT_ERRORS: AtomicU64 = AtomicU64::new(0);

    /// Whether spans are exported (set once by [`init_traced`] with an endpoint).
    static ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Whether this process exports traces: spans made only for the collector need not be
    /// made otherwise.
    pub fn tracing_on() -> bool {
        ON.load(Ordering::Relaxed)
    }

    /// The OTLP exporter, counting the batches it could not deliver.
    #[derive(Debug)]
    struct Counting(opentelemetry_otlp::SpanExporter);

    impl SpanExporter for Counting {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            let r = self.0.export(batch).await;
            if r.is_err() {
                EXPORT_ERRORS.fetch_add(1, Ordering::Relaxed);
            }
            r
        }

        fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
            self.0.shutdown_with_timeout(timeout)
        }
    }

    /// Exports the spans still queued when dropped (at the end of `main`).
    #[derive(Debug)]
    #[must_use = "dropping the guard stops the export"]
    pub struct TraceGuard(Option<SdkTracerProvider>);

    impl TraceGuard {
        /// Span batches the collector did not take since the start (a counter for `/metrics`).
        pub fn export_errors() -> u64 {
            EXPORT_ERRORS.load(Ordering::Relaxed)
        }
    }

    impl Drop for TraceGuard {
        fn drop(&mut self) {
            if let Some(p) = self.0.take() {
                let _ = p.shutdown();
            }
        }
    }

    /// [`init`](super::init), and with `endpoint` (an OTLP/HTTP traces URL such as
    /// `http://127.0.0.1:4318/v1/traces`, vLLM's `--otlp-traces-endpoint`) every span at info
    /// and above exported as OpenTelemetry traces, in JSON, by a background thread: a batch is
    /// sent every half second, a full queue drops spans, an unreachable collector costs
    /// [`TraceGuard::export_errors`], never a request's time. `service` names the process
    /// (`service.name`). W3C trace context is what [`continue_trace`] reads and
    /// [`trace_headers`] writes.
    pub fn init_traced(
        format: LogFormat,
        endpoint: Option<&str>,
        service: &str,
    ) -> Result<TraceGuard, String> {
        let Some(endpoint) = endpoint else {
            install(format, None)?;
            return Ok(TraceGuard(None));
        };
        if !endpoint.starts_with("http://") {
            return Err(format!(
                "--otlp-traces-endpoint {endpoint:?}: expected an OTLP/HTTP URL, http://HOST:PORT/v1/traces"
            ));
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(endpoint)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("--otlp-traces-endpoint {endpoint:?}: {e}"))?;
        let batches = BatchSpanProcessor::builder(Counting(exporter))
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(Duration::from_millis(500))
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batches)
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name(service.to_string())
                    .build(),
            )
            .build();
        let tracer = provider.tracer(service.to_string());
        install(format, Some(tracer))?;
        ON.store(true, Ordering::Relaxed);
        Ok(TraceGuard(Some(provider)))
    }

    /// Makes `span` continue the caller's trace: `header` reads the request's headers
    /// (`traceparent`, `tracestate`). Returns the trace id (32 hex digits) when tracing is on.
    pub fn continue_trace(
        span: &tracing::Span,
        header: impl Fn(&str) -> Option<String>,
    ) -> Option<String> {
        let carrier: std::collections::HashMap<String, String> = ["traceparent", "tracestate"]
            .into_iter()
            .filter_map(|k| Some((k.to_string(), header(k)?)))
            .collect();
        let parent = TraceContextPropagator::new().extract(&carrier);
        if parent.span().span_context().is_valid() {
            let _ = span.set_parent(parent);
        }
        let id = span.context().span().span_context().trace_id();
        (id != opentelemetry::trace::TraceId::INVALID).then(|| id.to_string())
    }

    /// The W3C headers (`traceparent`, and `tracestate` if any) that carry `span`'s trace to
    /// the next hop; none when tracing is off.
    pub fn trace_headers(span: &tracing::Span) -> Vec<(&'static str, String)> {
        let mut carrier = std::collections::HashMap::new();
        TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
        ["traceparent", "tracestate"]
            .into_iter()
            .filter_map(|k| Some((k, carrier.remove(k)?)))
            .filter(|(_, v)| !v.is_empty())
            .collect()
    }
}
