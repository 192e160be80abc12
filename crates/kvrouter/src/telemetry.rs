//! `--scrape-metrics-s S`: every S seconds, each worker's `/metrics` (Prometheus text) is read
//! for vLLM's `vllm:num_requests_running`, `vllm:num_requests_waiting` and
//! `vllm:kv_cache_usage_perc` (older vLLM: `vllm:gpu_cache_usage_perc`), and the router's busy
//! thresholds use them next to its own counts ([`kvroute::Router::set_reported_load`]). A failed
//! scrape keeps the last values for one more period, then clears them.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvroute::ReportedLoad;
use serde_json::{json, Value};

use crate::state::{Server, Worker};

/// What an engine's `/metrics` says of its load; each `None` when the text lacks it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running`, summed over its label sets.
    pub running: Option<f64>,
    /// `vllm:num_requests_waiting`, summed over its label sets.
    pub waiting: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (else `vllm:gpu_cache_usage_perc`), a fraction: the mean
    /// over its label sets (data-parallel engines behind one server each report their own).
    pub kv_usage: Option<f64>,
}

impl EngineMetrics {
    /// Whether the text had none of the three.
    pub fn is_empty(&self) -> bool {
        self.running.is_none() && self.waiting.is_none() && self.kv_usage.is_none()
    }

    /// As the router takes it: counts rounded, absent values 0.
    pub fn reported(&self) -> ReportedLoad {
        let count = |v: Option<f64>| v.map_or(0, |v| v.round().max(0.0) as usize);
        ReportedLoad::new(
            count(self.running),
            count(self.waiting),
            self.kv_usage.unwrap_or(0.0).max(0.0),
        )
    }
}

/// Reads the three gauges from Prometheus text exposition (vLLM's `/metrics`): comment lines
/// (`# HELP`, `# TYPE`) and other metrics are skipped, samples of one metric with different
/// labels are combined (see [`EngineMetrics`]), values that are not finite numbers ignored.
pub fn parse_engine_metrics(text: &str) -> EngineMetrics {
    let mut running = None;
    let mut waiting = None;
    // (sum, samples) of each name.
    let mut usage = (0.0, 0u32);
    let mut gpu_usage = (0.0, 0u32);
    for line in text.lines() {
        let Some((name, value)) = sample(line) else {
            continue;
        };
        match name {
            "vllm:num_requests_running" => *running.get_or_insert(0.0) += value,
            "vllm:num_requests_waiting" => *waiting.get_or_insert(0.0) += value,
            "vllm:kv_cache_usage_perc" => usage = (usage.0 + value, usage.1 + 1),
            "vllm:gpu_cache_usage_perc" => gpu_usage = (gpu_usage.0 + value, gpu_usage.1 + 1),
            _ => {}
        }
    }
    let mean = |(sum, n): (f64, u32)| (n > 0).then(|| sum / f64::from(n));
    EngineMetrics {
        running,
        waiting,
        kv_usage: mean(usage).or(mean(gpu_usage)),
    }
}

/// One sample line's metric name and value: `name value [timestamp]` or
/// `name{label="value",...} value [timestamp]`. `None` for comments, blank lines, malformed
/// lines and values that are not finite.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let (name, mut rest) = line.split_at(name_end);
    if rest.starts_with('{') {
        rest = &rest[labels_end(rest)?..];
    }
    let value: f64 = rest.split_ascii_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name, value))
}

/// Where the label set at the start of `s` (`{...}`) ends, just past its `}`: braces and commas
/// inside quoted values (with `\"` and `\\` escapes) do not count.
fn labels_end(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// A worker's scraped values (in [`Worker`]).
#[derive(Debug, Default)]
pub struct Scraped {
    /// The last values read, until two scrapes in a row fail.
    last: Mutex<Option<EngineMetrics>>,
    /// Scrapes failed since the last one that worked.
    misses: AtomicU32,
    /// Scrapes failed, ever.
    errors: AtomicU64,
}

impl Scraped {
    /// The values held.
    pub fn last(&self) -> Option<EngineMetrics> {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A failed scrape keeps the last values for this many periods; the next failure clears them.
const KEPT_PERIODS: u32 = 1;

/// Most of an engine's `/metrics` read (vLLM's is tens of kilobytes).
const MAX_BODY: usize = 8 << 20;

/// Scrapes every worker's `/metrics` every `every`, forever.
pub async fn scrape_loop(server: Arc<Server>, every: Duration) {
    // A slow engine gets up to a period to answer (at least a second, at most ten).
    let limit = every.clamp(Duration::from_secs(1), Duration::from_secs(10));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let workers = server.workers();
        let got =
            futures_util::future::join_all(workers.iter().map(|w| scrape(&server, w, limit))).await;
        for (w, got) in workers.iter().zip(got) {
            record(&server, w, got);
        }
    }
}

/// One worker's `/metrics`, read within `limit`: `None` when it fails or holds none of the three.
async fn scrape(server: &Server, w: &Worker, limit: Duration) -> Option<EngineMetrics> {
    let req = hyper::Request::get(format!("{}/metrics", w.spec.url))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let read = async {
        let resp = server.client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .ok()?
            .to_bytes();
        Some(parse_engine_metrics(&String::from_utf8_lossy(&body)))
    };
    tokio::time::timeout(limit, read)
        .await
        .ok()
        .flatten()
        .filter(|m| !m.is_empty())
}

/// Keeps what a scrape of `w` read and gives it to the router; after a failure, keeps the
/// last values for [`KEPT_PERIODS`] more, then clears them.
fn record(server: &Server, w: &Worker, got: Option<EngineMetrics>) {
    let s = &w.engine;
    let report = match got {
        Some(m) => {
            s.misses.store(0, Ordering::Relaxed);
            Some(m)
        }
        None => {
            s.errors.fetch_add(1, Ordering::Relaxed);
            let missed = s.misses.fetch_add(1, Ordering::Relaxed) + 1;
            if missed <= KEPT_PERIODS {
                return;
            }
            if missed == KEPT_PERIODS + 1 {
                tracing::warn!(
                    "worker {}: its /metrics could not be read twice in a row; its engine's load is forgotten until it can",
                    w.spec.name
                );
            }
            None
        }
    };
    let mut m = server.mirror();
    *s.last.lock().unwrap_or_else(|e| e.into_inner()) = report;
    // Values are clamped at 0 and finite, so the router takes them.
    let _ = m
        .router
        .set_reported_load(w.id, report.map(|r| r.reported()));
}

/// The scraped gauges for `/metrics` (nothing without `--scrape-metrics-s`).
pub(crate) fn write_metrics(server: &Server, workers: &[Arc<Worker>], out: &mut String) {
    if server.cfg.scrape_metrics_s <= 0.0 {
        return;
    }
    let last: Vec<Option<EngineMetrics>> = workers.iter().map(|w| w.engine.last()).collect();
    for (name, help, value) in [
        (
            "kvrouter_worker_engine_running",
            "Requests running in the worker's engine, as its /metrics last said (--scrape-metrics-s).",
            (|m: &EngineMetrics| m.running) as fn(&EngineMetrics) -> Option<f64>,
        ),
        (
            "kvrouter_worker_engine_waiting",
            "Requests waiting in the worker's engine, as its /metrics last said (--scrape-metrics-s).",
            |m| m.waiting,
        ),
        (
            "kvrouter_worker_engine_kv_usage",
            "The share of the worker's engine's KV cache in use, as its /metrics last said (--scrape-metrics-s).",
            |m| m.kv_usage,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (w, m) in workers.iter().zip(&last) {
            if let Some(v) = m.as_ref().and_then(value) {
                let _ = writeln!(out, "{name}{{worker=\"{}\"}} {v}", w.spec.name);
            }
        }
    }
    let name = "kvrouter_worker_engine_scrape_errors_total";
    let _ = writeln!(
        out,
        "# HELP {name} Scrapes of the worker's /metrics that failed or held none of vLLM's load gauges.\n# TYPE {name} counter"
    );
    for w in workers {
        let n = w.engine.errors.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}{{worker=\"{}\"}} {n}", w.spec.name);
    }
}

/// A worker's scraped values for `/v1/admin/workers`: null when there are none.
pub(crate) fn admin_json(w: &Worker) -> Value {
    match w.engine.last() {
        Some(m) => json!({"running": m.running, "waiting": m.waiting, "kv_usage": m.kv_usage}),
        None => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// vLLM 0.33's exposition (abridged), two data-parallel engines.
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.75
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:num_requests_running_total Not the gauge.
vllm:num_requests_running_total{engine="0"} 1000
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 12.0
python_gc_objects_collected_total{generation="0"} 1234.0
"#;

    #[test]
    fn vllm_text_reads_as_sums_and_a_mean_usage() {
        let m = parse_engine_metrics(VLLM);
        assert_eq!(m.running, Some(12.0));
        assert_eq!(m.waiting, Some(2.0));
        assert_eq!(m.kv_usage, Some(0.5));
        assert_eq!(m.reported(), ReportedLoad::new(12, 2, 0.5));
    }

    #[test]
    fn the_older_usage_name_is_read_when_the_newer_is_absent() {
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9\n";
        assert_eq!(parse_engine_metrics(old).kv_usage, Some(0.9));
        // Both (kvmock serves both): the newer wins.
        let both = format!("{old}vllm:kv_cache_usage_perc{{model_name=\"m\"}} 0.4\n");
        assert_eq!(parse_engine_metrics(&both).kv_usage, Some(0.4));
    }

    #[test]
    fn odd_but_valid_lines_and_bad_ones() {
        let text = concat!(
            "vllm:num_requests_running 3\n",
            "vllm:num_requests_running{a=\"x} y\",b=\"q\\\"}\"} 4 1712345678000\n",
            "  vllm:num_requests_waiting{}  1e1\n",
            "vllm:num_requests_waiting{a=\"unterminated} 5\n",
            "vllm:num_requests_waiting NaN\n",
            "vllm:num_requests_waiting +Inf\n",
            "vllm:num_requests_waiting\n",
            "vllm:num_requests_waiting{a=\"1\"}\n",
            "vllm:kv_cache_usage_perc notanumber\n",
            "#vllm:kv_cache_usage_perc 1\n",
            "\n",
        );
        let m = parse_engine_metrics(text);
        assert_eq!(m.running, Some(7.0));
        assert_eq!(m.waiting, Some(10.0));
        assert_eq!(m.kv_usage, None);
        assert!(!m.is_empty());
        assert!(parse_engine_metrics("# nothing here\nother 1\n").is_empty());
        assert!(parse_engine_metrics("").is_empty());
    }

    proptest! {
        /// Rendered samples, with any label values (quotes, braces, backslashes escaped as the
        /// format asks), comments and unrelated metrics between them, read back exactly.
        #[test]
        fn rendered_samples_read_back(
            samples in prop::collection::vec(
                (0usize..3, 0u32..1000, "[a-z{}\" ,=\\\\]{0,8}", any::<bool>()),
                0..12,
            ),
        ) {
            const NAMES: [&str; 3] = [
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            ];
            let mut text = String::from("# HELP vllm:num_requests_running x\n");
            let mut want = [None::<f64>; 3];
            let mut usage = (0.0, 0u32);
            for (k, v, label, with_ts) in &samples {
                let escaped = label.replace('\\', "\\\\").replace('"', "\\\"");
                let value = if *k == 2 { f64::from(*v) / 1000.0 } else { f64::from(*v) };
                let ts = if *with_ts { " 1712345678000" } else { "" };
                let _ = writeln!(text, "{}{{engine=\"0\",l=\"{escaped}\"}} {value}{ts}", NAMES[*k]);
                let _ = writeln!(text, "# TYPE other gauge\nother{{l=\"{escaped}\"}} 5");
                if *k == 2 {
                    usage = (usage.0 + value, usage.1 + 1);
                } else {
                    *want[*k].get_or_insert(0.0) += value;
                }
            }
            let m = parse_engine_metrics(&text);
            prop_assert_eq!(m.running, want[0]);
            prop_assert_eq!(m.waiting, want[1]);
            prop_assert_eq!(m.kv_usage, (usage.1 > 0).then(|| usage.0 / f64::from(usage.1)));
        }
    }
}
