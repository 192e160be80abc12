//! The simulator against real vLLM runs (`../shared/data/vllm-otel/`).

use std::path::PathBuf;

use kvsim::{KvAllocation, SimConfig, SpanFitOptions, VllmLog};

fn data(model: &str, file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/vllm-otel").join(model).join(file)
}

fn engine_cfg(log: &VllmLog) -> SimConfig {
    let mut cfg = SimConfig::default();
    let bs = log.block_size.unwrap();
    cfg.block_size = kvblock::BlockSize::new(bs).unwrap();
    cfg.instances = 1;
    cfg.kv_blocks = log.kv_blocks(bs);
    cfg.max_batched_tokens = log.max_num_batched_tokens.unwrap();
    cfg.max_num_seqs = log.max_num_seqs.unwrap();
    cfg.kv_allocation = KvAllocation::Incremental;
    cfg
}

#[test]
#[ignore = "needs ../shared/data (the real vLLM runs)"]
fn scratch() {
    for model in ["codellama-34b", "llama-2-7b"] {
        let log = VllmLog::load(&data(model, "vllm.log")).unwrap();
        let reqs = kvsim::load_measured(&data(model, "traces.otel.jsonl")).unwrap();
        let cfg = engine_cfg(&log);
        let phases = kvsim::phases_by_count(reqs.len(), 25);
        for fit_phases in [vec![], vec![0, 1]] {
            let t = std::time::Instant::now();
            let fit = kvsim::fit_spans(&cfg, &reqs, &phases, &SpanFitOptions::default().fit_phases(fit_phases)).unwrap();
            println!("{model}: {:?} in {:?}, evals {}, obj {:.4}\n in {:?}\n out {:?}", fit.timing, t.elapsed(), fit.evaluations, fit.objective, fit.in_sample, fit.held_out);
            for p in &fit.phases {
                println!("  {} {} real {:.0}/{:.1}/{:.0} sim {:.0}/{:.1}/{:.0}", p.phase, p.fitted, p.real.ttft_mean, p.real.itl_mean, p.real.e2e_mean, p.sim.ttft_mean, p.sim.itl_mean, p.sim.e2e_mean);
            }
        }
    }
}
