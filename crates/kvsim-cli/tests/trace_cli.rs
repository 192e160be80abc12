//! The `kvsim` command on traces and sweeps: FILE:LINE errors, exit codes, sweep outputs.

use std::path::PathBuf;
use std::process::Command;

/// Six requests of two conversations, prefix-chained 16-token blocks.
const GOOD: &str = r#"{"timestamp": 0, "input_length": 32, "output_length": 3, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 27, "output_length": 4, "hash_ids": [0, 2]}
{"timestamp": 1000, "input_length": 64, "output_length": 3, "hash_ids": [0, 1, 3, 4]}
{"timestamp": 1010, "input_length": 43, "output_length": 4, "hash_ids": [0, 2, 5]}
{"timestamp": 2000, "input_length": 80, "output_length": 3, "hash_ids": [0, 1, 3, 4, 6]}
{"timestamp": 2010, "input_length": 75, "output_length": 4, "hash_ids": [0, 2, 5, 7, 8]}"#;

fn kvsim(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvsim"))
        .args(args)
        .output()
        .expect("runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout),
        text(&out.stderr),
    )
}

/// `text` written to `name` in `dir`, which is removed with everything in it when dropped.
fn temp_file(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn cli_trace_errors_exit_2_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = GOOD.to_string();
    let bad = format!("{good}\n{{\"timestamp\": 99999, \"input_length\": -4, \"output_length\": 1, \"hash_ids\": []}}");
    let p = temp_file(&dir, "bad.jsonl", &bad);
    let p = p.to_str().unwrap();
    let (code, out, err) = kvsim(&["--trace", p, "--trace-block-size", "16"]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert_eq!(
        err.trim(),
        format!("kvsim: {p}:7: input_length: expected a whole number from 0 to 16777216, got -4")
    );
    let g = temp_file(&dir, "good.jsonl", &good);
    let g = g.to_str().unwrap();
    let (code, _, err) = kvsim(&[
        "--trace",
        g,
        "--trace-block-size",
        "16",
        "--des-block-size",
        "512",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot be re-blocked"), "{err}");
    let (code, out, _) = kvsim(&[
        "--trace",
        g,
        "--trace-block-size",
        "16",
        "--des-num-requests",
        "4",
    ]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("  Fleet: 4 instance(s), routing=kv | trace: good.jsonl (4 requests)\n"),
        "{out}"
    );
    let (code, out, _) = kvsim(&["trace-stats", g, "--trace-block-size", "16"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("Requests: 6") && out.contains("Ideal hit rate"),
        "{out}"
    );
    let (code, _, err) = kvsim(&["trace-stats", "/nonexistent/trace.jsonl"]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("kvsim: /nonexistent/trace.jsonl: cannot read"),
        "{err}"
    );
}

#[test]
fn cli_sweep_rows_csv_json_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let csv = temp_file(&dir, "sweep.csv", "");
    let svg = temp_file(&dir, "sweep.svg", "");
    let (code, out, err) = kvsim(&[
        "sweep",
        "--param",
        "des-overlap-weight=0,1,8",
        "--des-num-requests",
        "120",
        "--des-block-size",
        "512",
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(
            "  Sweep of des-overlap-weight over 3 value(s) | Fleet: 4 instance(s), routing=kv"
        ),
        "{out}"
    );
    assert_eq!(out.lines().count(), 5, "{out}");
    let csv = std::fs::read_to_string(csv).unwrap();
    assert_eq!(csv.lines().count(), 4);
    assert!(csv
        .lines()
        .nth(1)
        .unwrap()
        .starts_with("des-overlap-weight,0,"));
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("TTFT p99") && svg.contains("hit rate"));
    let (code, out, _) = kvsim(&[
        "sweep",
        "--param",
        "des-routing=kv,round_robin",
        "--des-num-requests",
        "50",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0);
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rows[1]["value"], "round_robin");
    // A sweep is the same runs as single runs.
    let (_, single, _) = kvsim(&[
        "--des-routing",
        "round_robin",
        "--des-num-requests",
        "50",
        "--format",
        "json",
    ]);
    let single: serde_json::Value = serde_json::from_str(&single).unwrap();
    assert_eq!(rows[1]["request_hit_rate"], single["request_hit_rate"]);
    for (args, needle) in [
        (
            &["sweep", "--param", "des-instances=2,0"][..],
            "--param des-instances=0: invalid --des-instances 0",
        ),
        (
            &["sweep", "--param", "no-such-flag=1"][..],
            "--param no-such-flag=1: unexpected argument '--no-such-flag'",
        ),
        (
            &["sweep", "--param", "des-instances"][..],
            "expected NAME=V1,V2",
        ),
    ] {
        let (code, _, err) = kvsim(args);
        assert_eq!(code, 2, "{args:?}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1);
    }
}
