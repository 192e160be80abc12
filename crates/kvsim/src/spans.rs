//! Per-request measurements of real runs: vLLM's OpenTelemetry request spans, and the request
//! records `kvload --record` and `kvsim --requests-out` write. Both read into
//! [`MeasuredRequest`]s, which a simulation can replay ([`SimConfig::with_measured`]) and
//! calibration can fit ([`fit_spans`](crate::fit_spans)).
//!
//! [`SimConfig::with_measured`]: crate::SimConfig::with_measured

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, TraceError};
use crate::records::MeasuredRequest;

/// The span name vLLM gives a request (`SpanAttributes` in `vllm/tracing.py`).
pub const LLM_REQUEST_SPAN: &str = "llm_request";

fn bad(file: &str, line: usize, what: impl Into<String>) -> Error {
    Error::Spans(TraceError {
        file: file.to_string(),
        line,
        what: what.into(),
    })
}

/// Reads measured requests from a file; see [`parse_measured`].
pub fn load_measured(path: &Path) -> Result<Vec<MeasuredRequest>, Error> {
    let name = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|e| bad(&name, 0, format!("cannot read: {e}")))?;
    parse_measured(&name, &text)
}

/// Parses measured requests, one JSON object per line, in either of two shapes (lines may mix;
/// blank lines are skipped):
///
/// - **OTLP/JSON** (`{"resourceSpans": [...]}`), as an OpenTelemetry collector's file exporter
///   writes what vLLM exports with `--otlp-traces-endpoint`. Every span named `llm_request` is
///   one request: its start is the arrival, and it must carry `gen_ai.usage.prompt_tokens`,
///   `gen_ai.usage.completion_tokens`, `gen_ai.latency.time_to_first_token` and
///   `gen_ai.latency.e2e` (seconds). Other spans are ignored; a span whose status code is 2
///   (error) is a failed request.
/// - **A request record** as `kvload --record` and `kvsim --requests-out` write it:
///   `arrival_us`, `prompt_tokens`, `output_tokens`, `ttft_us`, `e2e_us` (whole µs),
///   optionally `cached_tokens` and `status` (`"ok"` or `"error"`); other fields are ignored.
///
/// The requests come back in arrival order (file order among equal arrivals), with arrival
/// times in µs from the first. A line that is not JSON, a span or record missing a field, a
/// negative or fractional count, a latency that is negative or not finite, a first token after
/// the end: an [`Error::Spans`] naming the file, the line and what was expected.
///
/// ```
/// let line = r#"{"arrival_us": 0, "prompt_tokens": 100, "output_tokens": 11, "ttft_us": 5000, "e2e_us": 105000}"#;
/// let reqs = kvsim::parse_measured("run.jsonl", line)?;
/// assert_eq!((reqs[0].input_len, reqs[0].finish_us), (100, 105_000));
/// assert_eq!(reqs[0].mean_itl_us(), Some(10_000.0));
/// let e = kvsim::parse_measured("run.jsonl", "{\"arrival_us\": 0}").unwrap_err();
/// assert_eq!(e.to_string(), "run.jsonl:1: a request record needs prompt_tokens (a whole number)");
/// # Ok::<(), kvsim::Error>(())
/// ```
pub fn parse_measured(name: &str, text: &str) -> Result<Vec<MeasuredRequest>, Error> {
    // (arrival in ns since the epoch or the record's clock, file order, request)
    let mut found: Vec<(i128, usize, MeasuredRequest)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(raw)
            .map_err(|e| bad(name, line, format!("not a JSON object: {e}")))?;
        let Value::Object(obj) = v else {
            return Err(bad(name, line, "not a JSON object"));
        };
        if let Some(rs) = obj.get("resourceSpans") {
            otlp_line(rs, &mut found).map_err(|what| bad(name, line, what))?;
        } else {
            let (arrival_ns, req) = read_record(&obj).map_err(|what| bad(name, line, what))?;
            found.push((arrival_ns, found.len(), req));
        }
    }
    if found.is_empty() {
        return Err(bad(
            name,
            0,
            "no requests: expected llm_request spans (OTLP/JSON) or request records, one per line",
        ));
    }
    found.sort_by_key(|&(t, i, _)| (t, i));
    let t0 = found[0].0;
    Ok(found
        .into_iter()
        .map(|(t, _, mut r)| {
            let at = u64::try_from((t - t0) / 1_000).unwrap_or(u64::MAX);
            r.first_token_us = r.first_token_us.saturating_add(at);
            r.finish_us = r.finish_us.saturating_add(at);
            r.arrival_us = at;
            r
        })
        .collect())
}

/// A whole number of a JSON value: a number, or a string of digits (OTLP/JSON writes 64-bit
/// integers as strings).
fn whole(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Seconds of an OTLP attribute value, finite and >= 0.
fn seconds(v: &Value) -> Option<f64> {
    let x = match v {
        Value::Number(n) => n.as_f64()?,
        Value::String(s) => s.parse().ok()?,
        _ => return None,
    };
    (x.is_finite() && x >= 0.0).then_some(x)
}

/// Whole microseconds of `s` seconds.
fn us_of(s: f64) -> u64 {
    // Saturating: a latency of more than 584,000 years is not a real one, and is not refused.
    (s * 1e6).round() as u64
}

/// The requests of one OTLP/JSON line.
fn otlp_line(
    resource_spans: &Value,
    found: &mut Vec<(i128, usize, MeasuredRequest)>,
) -> Result<(), String> {
    fn list<'a>(v: Option<&'a Value>, what: &str) -> Result<&'a [Value], String> {
        match v {
            None => Ok(&[]),
            Some(Value::Array(a)) => Ok(a),
            Some(_) => Err(format!("{what} is not an array")),
        }
    }
    for rs in list(Some(resource_spans), "resourceSpans")? {
        for ss in list(rs.get("scopeSpans"), "scopeSpans")? {
            for span in list(ss.get("spans"), "spans")? {
                if span.get("name").and_then(Value::as_str) != Some(LLM_REQUEST_SPAN) {
                    continue;
                }
                let req = otlp_span(span)?;
                found.push((req.0, found.len(), req.1));
            }
        }
    }
    Ok(())
}

/// One `llm_request` span: its start (ns) and the request.
fn otlp_span(span: &Value) -> Result<(i128, MeasuredRequest), String> {
    let start = span
        .get("startTimeUnixNano")
        .and_then(whole)
        .ok_or("an llm_request span needs startTimeUnixNano (nanoseconds)")?;
    let mut attrs = Map::new();
    if let Some(Value::Array(a)) = span.get("attributes") {
        for kv in a {
            let (Some(k), Some(v)) = (kv.get("key").and_then(Value::as_str), kv.get("value"))
            else {
                continue;
            };
            // An AnyValue: one of stringValue, intValue, doubleValue, boolValue, ...
            if let Some((_, inner)) = v.as_object().and_then(|o| o.iter().next()) {
                attrs.insert(k.to_string(), inner.clone());
            }
        }
    }
    let count = |key: &str| -> Result<usize, String> {
        attrs
            .get(key)
            .and_then(whole)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("an llm_request span needs {key} (a whole number of tokens)"))
    };
    let secs = |key: &str| -> Result<f64, String> {
        attrs.get(key).and_then(seconds).ok_or_else(|| {
            format!("an llm_request span needs {key} (seconds, a finite number >= 0)")
        })
    };
    let input_len = count("gen_ai.usage.prompt_tokens")?;
    let output_len = count("gen_ai.usage.completion_tokens")?;
    let ttft = secs("gen_ai.latency.time_to_first_token")?;
    let e2e = secs("gen_ai.latency.e2e")?;
    if ttft > e2e {
        return Err(format!(
            "time_to_first_token {ttft} s is after e2e {e2e} s: expected the first token within the request"
        ));
    }
    let failed = span
        .get("status")
        .and_then(|s| s.get("code"))
        .is_some_and(|c| c.as_u64() == Some(2) || c.as_str() == Some("STATUS_CODE_ERROR"));
    let mut r = MeasuredRequest::new(0, input_len, output_len, 0, us_of(ttft), us_of(e2e));
    r.failed = failed;
    Ok((i128::from(start), r))
}

/// One request record: its arrival (ns) and the request.
fn read_record(obj: &Map<String, Value>) -> Result<(i128, MeasuredRequest), String> {
    let num = |key: &str| -> Result<u64, String> {
        obj.get(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("a request record needs {key} (a whole number)"))
    };
    let arrival = num("arrival_us")?;
    let input_len = num("prompt_tokens")?;
    let output_len = num("output_tokens")?;
    let ttft = num("ttft_us")?;
    let e2e = num("e2e_us")?;
    let cached = match obj.get("cached_tokens") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .ok_or("cached_tokens must be a whole number of tokens")?,
    };
    let failed = match obj.get("status").map(|s| s.as_str()) {
        None | Some(Some("ok")) => false,
        Some(Some("error")) => true,
        Some(_) => return Err("status must be \"ok\" or \"error\"".into()),
    };
    if !failed && ttft > e2e {
        return Err(format!(
            "ttft_us {ttft} is after e2e_us {e2e}: expected the first token within the request"
        ));
    }
    let (Ok(input_len), Ok(output_len), Ok(cached)) = (
        usize::try_from(input_len),
        usize::try_from(output_len),
        usize::try_from(cached),
    ) else {
        return Err("a token count beyond this machine's word".into());
    };
    let mut r = MeasuredRequest::new(0, input_len, output_len, cached, ttft, e2e);
    r.failed = failed;
    Ok((i128::from(arrival) * 1_000, r))
}

/// Writes `requests` to `path`, one [`record_line`] each: the file `kvsim --requests-out` and
/// `kvload --record` write, and [`parse_measured`] reads.
pub fn write_records(path: &Path, requests: &[MeasuredRequest]) -> std::io::Result<()> {
    let mut text = String::with_capacity(requests.len() * 200);
    for r in requests {
        text.push_str(&record_line(r));
        text.push('\n');
    }
    std::fs::write(path, text)
}

/// One request as a record line (no newline), the shape [`parse_measured`] reads back:
/// `arrival_us`, `prompt_tokens`, `cached_tokens`, `output_tokens`, `ttft_us`, `e2e_us`,
/// `mean_itl_us` (null for fewer than two output tokens), `status`, then `instance` and
/// `preemptions` when known.
///
/// ```
/// let r = kvsim::MeasuredRequest::new(1_000, 100, 11, 32, 6_000, 106_000);
/// assert_eq!(
///     kvsim::record_line(&r),
///     r#"{"arrival_us":1000,"prompt_tokens":100,"cached_tokens":32,"output_tokens":11,"ttft_us":5000,"e2e_us":105000,"mean_itl_us":10000.0,"status":"ok"}"#
/// );
/// ```
pub fn record_line(r: &MeasuredRequest) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(200);
    let ttft = r.first_token_us.saturating_sub(r.arrival_us);
    let e2e = r.finish_us.saturating_sub(r.arrival_us);
    let _ = write!(
        s,
        "{{\"arrival_us\":{},\"prompt_tokens\":{},\"cached_tokens\":{},\"output_tokens\":{},\"ttft_us\":{ttft},\"e2e_us\":{e2e},\"mean_itl_us\":",
        r.arrival_us, r.input_len, r.cached_tokens, r.output_len
    );
    match r.mean_itl_us() {
        // serde_json's shortest round-trip form, one decimal at least.
        Some(itl) => s.push_str(&Value::from(itl).to_string()),
        None => s.push_str("null"),
    }
    let _ = write!(
        s,
        ",\"status\":\"{}\"",
        if r.failed { "error" } else { "ok" }
    );
    if let Some(i) = r.instance {
        let _ = write!(s, ",\"instance\":{i}");
    }
    if let Some(p) = r.preemptions {
        let _ = write!(s, ",\"preemptions\":{p}");
    }
    s.push('}');
    s
}
