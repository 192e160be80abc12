//! `kvmock --otlp-traces-endpoint`: an `llm_request` span per request with vLLM's `gen_ai.*`
//! attributes, which the simulator reads as it reads a real vLLM's spans.

mod common;

use std::time::Duration;

use common::{completion_body, eventually, free_port, Mock};
use kvtest::net::OtlpReceiver;

#[test]
fn kvsim_reads_kvmocks_spans_as_it_reads_vllms() {
    let collector = OtlpReceiver::start();
    let endpoint = collector.endpoint();
    let m = Mock::start(
        free_port(),
        &["--otlp-traces-endpoint", &endpoint, "--speedup", "10"],
    );
    let lengths = [16usize, 40, 64, 100, 7];
    for (i, &n) in lengths.iter().enumerate() {
        let prompt: Vec<u32> = (0..n as u32).map(|t| 1_000 * i as u32 + t).collect();
        let (s, body) = m.post("/v1/completions", &completion_body(&prompt, 3 + i, false));
        assert_eq!(s, 200, "{body}");
    }
    eventually(
        "every request's span arrives",
        Duration::from_secs(20),
        || {
            collector
                .spans()
                .iter()
                .filter(|s| s["name"] == "llm_request")
                .count()
                == lengths.len()
        },
    );
    // What a collector's file exporter writes: one resourceSpans object per line.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("traces.otel.jsonl");
    let lines: Vec<String> = collector
        .bodies()
        .iter()
        .map(|b| {
            serde_json::from_str::<serde_json::Value>(b)
                .unwrap()
                .to_string()
        })
        .collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let measured = kvsim::load_measured(&file).unwrap();
    let mut got: Vec<(usize, usize)> = measured
        .iter()
        .map(|r| (r.input_len, r.output_len))
        .collect();
    got.sort();
    let mut want: Vec<(usize, usize)> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| (n, 3 + i))
        .collect();
    want.sort();
    assert_eq!(got, want);
    // The spans' latencies are the engine's own (emulated) ones: their TTFTs sum to its
    // histogram's.
    let ttft_s: f64 = measured
        .iter()
        .map(|r| (r.first_token_us - r.arrival_us) as f64 / 1e6)
        .sum();
    let engine = m.metric("vllm:time_to_first_token_seconds_sum");
    assert!(
        (ttft_s - engine).abs() < 1e-5 * lengths.len() as f64,
        "{ttft_s} vs {engine}"
    );
    assert!(measured
        .iter()
        .all(|r| r.arrival_us < r.first_token_us && r.first_token_us < r.finish_us));
}
