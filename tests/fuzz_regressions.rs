//! Replays the fuzz targets' checked-in inputs under plain `cargo test`.
//!
//! The fuzz package (`fuzz/`) is outside the workspace and needs cargo-fuzz and libFuzzer to run;
//! its targets only wrap the bodies of `kvtest::fuzz::<target>` (each with `run(&[u8])`, decoding
//! bytes exactly as `fuzz_target!` does), which this test calls directly. Every file of
//! `fuzz/regressions/<target>/` (minimized crash inputs, kept after the fix) and of
//! `fuzz/seeds/<target>/` goes through its target's body, then 200 pseudo-random byte strings
//! from a fixed seed, so the test never runs empty.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use kvtest::fuzz::{
    block_cache_ops, hash_incremental, index_events, openai_request, router_ops, trace_line,
    vllm_decode,
};
use kvtest::splitmix;

fn files(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    v.sort();
    v
}

fn replay(target: &str, run: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut inputs: Vec<(String, Vec<u8>)> = Vec::new();
    for dir in ["regressions", "seeds"] {
        for path in files(&root.join(dir).join(target)) {
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            inputs.push((path.display().to_string(), bytes));
        }
    }
    let mut rng = splitmix::Rng(0x6b76_6b69_7400 ^ target.len() as u64);
    for k in 0..200 {
        let len = (rng.next_u64() % 600) as usize;
        // Half uniform bytes; half small, mostly odd ones, which `arbitrary` decodes as longer
        // operation lists ("keep going" flags are the low bit) with short collections.
        let bytes = (0..len)
            .map(|_| {
                let r = rng.next_u64();
                match (k % 2, r % 4) {
                    (0, _) => r as u8,
                    (_, 0) => (r >> 8) as u8 % 32,
                    _ => ((r >> 8) as u8 % 32) | 1,
                }
            })
            .collect();
        inputs.push((format!("pseudo-random input {k}"), bytes));
    }
    let failed: Vec<String> = inputs
        .iter()
        .filter_map(|(name, bytes)| {
            catch_unwind(AssertUnwindSafe(|| run(bytes)))
                .err()
                .map(|_| name.clone())
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{target}: {} input(s) fail: {failed:#?}",
        failed.len()
    );
}

#[test]
fn block_cache_ops_regressions() {
    replay("block_cache_ops", block_cache_ops::run);
}

#[test]
fn index_events_regressions() {
    replay("index_events", index_events::run);
}

#[test]
fn router_ops_regressions() {
    replay("router_ops", router_ops::run);
}

#[test]
fn trace_line_regressions() {
    replay("trace_line", trace_line::run);
}

#[test]
fn hash_incremental_regressions() {
    replay("hash_incremental", hash_incremental::run);
}

#[test]
fn vllm_decode_regressions() {
    replay("vllm_decode", vllm_decode::run);
}

#[test]
fn openai_request_regressions() {
    replay("openai_request", openai_request::run);
}
