//! Replay a Mooncake-format request trace through a simulated fleet, once per routing policy.
//!
//! `cargo run --release --example replay_trace [TRACE] [INSTANCES] [KV_BLOCKS]`
//!
//! TRACE defaults to the conversation trace in the shared data folder beside the repository
//! (`../shared/data/mooncake_conversation_trace.jsonl`); pass any JSONL trace whose hash ids name
//! 512-token blocks. The first 3,000 requests are replayed on 8 instances of 2,000 blocks each.

use std::path::PathBuf;
use std::process::ExitCode;

use kvkit::kvblock::BlockSize;
use kvkit::kvsim::{Policy, SimConfig, Simulation, Trace};

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../shared/data/mooncake_conversation_trace.jsonl"));
    let instances: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(8);
    let kv_blocks: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2_000);
    let Ok(block_size) = BlockSize::new(512) else {
        return ExitCode::FAILURE;
    };
    let trace = match Trace::load(&path, block_size) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("replay_trace: {e}\n(pass the path of a Mooncake-format trace as the first argument)");
            return ExitCode::from(2);
        }
    };
    print!("{}", trace.stats().to_text(trace.name()));
    println!();
    println!("  policy        block-reuse  requests/instance (max/mean)  TTFT p99");
    for policy in Policy::ALL {
        let mut cfg = SimConfig::default().with_trace(trace.clone());
        cfg.num_requests = 3_000;
        cfg.instances = instances;
        cfg.kv_blocks = Some(kv_blocks);
        cfg.routing = policy;
        match Simulation::new(cfg).and_then(|s| s.run()) {
            Ok(r) => println!(
                "  {:<12}  {:>10.1}%  {:>28.2}  {:>6.0} ms{}",
                policy.to_string(),
                r.block_reuse * 100.0,
                r.load_balance,
                r.ttft_ms.p99,
                if r.hot_spot { "  <- hot spot" } else { "" }
            ),
            Err(e) => {
                eprintln!("replay_trace: {e}");
                return ExitCode::from(2);
            }
        }
    }
    ExitCode::SUCCESS
}
