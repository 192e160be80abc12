//! Fan-out bursts over a new prefix, with and without predicted blocks.
//!
//! `cargo run --release --example predicted_burst [EVENT_DELAY_MS] [TTL_MS]`
//!
//! Ten bursts, 10 s apart; each is 64 requests (an agent's fan-out, best-of-N, RL rollouts) that
//! share a new 8-block prefix (4,096 tokens) and add one block of their own, arriving 2 ms
//! apart. The engines' KV events reach the router after EVENT_DELAY_MS (default 50), so for
//! a while nobody knows who holds the new prefix. The ideal is one prefill of each prefix:
//! 8 + 64 blocks per burst. With predicted blocks (TTL_MS, default 1000) the router counts the
//! blocks it just routed as hits on their worker until the events confirm them.

use std::process::ExitCode;

use kvkit::kvblock::BlockSize;
use kvkit::kvsim::{SimConfig, Simulation, Trace};

const BURSTS: u64 = 10;
const FAN_OUT: u64 = 64;
const PREFIX_BLOCKS: u64 = 8;

/// The bursts as a Mooncake-format trace: hash ids name 512-token blocks.
fn trace_text() -> String {
    let mut text = String::new();
    let mut next_id = 0u64;
    for burst in 0..BURSTS {
        let prefix: Vec<u64> = (next_id..next_id + PREFIX_BLOCKS).collect();
        next_id += PREFIX_BLOCKS;
        for k in 0..FAN_OUT {
            let mut ids = prefix.clone();
            ids.push(next_id);
            next_id += 1;
            let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
            text.push_str(&format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 64, \"hash_ids\": [{}]}}\n",
                burst * 10_000 + 2 * k,
                (PREFIX_BLOCKS + 1) * 512,
                ids.join(", ")
            ));
        }
    }
    text
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let delay_ms: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(50);
    let ttl_ms: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1_000);
    let Ok(bs) = BlockSize::new(512) else {
        return ExitCode::FAILURE;
    };
    let trace = match Trace::parse("bursts.jsonl", &trace_text(), bs) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("predicted_burst: {e}");
            return ExitCode::FAILURE;
        }
    };
    let prompt_blocks = (BURSTS * FAN_OUT * (PREFIX_BLOCKS + 1)) as f64;
    let ideal = BURSTS * (PREFIX_BLOCKS + FAN_OUT);
    println!(
        "  {} bursts of {} requests, event delay {} ms; ideal: {} prefilled blocks",
        BURSTS, FAN_OUT, delay_ms, ideal
    );
    println!("  weight  predicted  prefilled blocks  vs ideal  TTFT p50  TTFT p99");
    for weight in [1.0, 4.0, 16.0] {
        for ttl in [0, ttl_ms] {
            let mut cfg = SimConfig::default().with_trace(trace.clone());
            cfg.instances = 8;
            cfg.overlap_weight = weight;
            cfg.event_delay_us = delay_ms * 1000;
            cfg.predicted_ttl_us = ttl * 1000;
            let r = match Simulation::new(cfg).and_then(|s| s.run()) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("predicted_burst: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let prefilled = (prompt_blocks * (1.0 - r.block_reuse)).round();
            println!(
                "  {:>6}  {:>9}  {:>16}  {:>7.2}×  {:>5.0} ms  {:>5.0} ms",
                weight,
                if ttl == 0 {
                    "off".to_string()
                } else {
                    format!("{ttl} ms")
                },
                prefilled,
                prefilled / ideal as f64,
                r.ttft_ms.p50,
                r.ttft_ms.p99
            );
        }
    }
    ExitCode::SUCCESS
}
