//! Whole simulated runs, reported as simulated requests per wall-clock second.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvkit::kvblock::BlockSize;
use kvkit::kvsim::{CostModel, SimConfig, Simulation, Trace};

fn config(
    requests: usize,
    instances: usize,
    rate: f64,
    block_size: usize,
    kv_blocks: Option<usize>,
) -> SimConfig {
    let mut c = SimConfig::default();
    c.num_requests = requests;
    c.instances = instances;
    c.request_rate = rate;
    c.block_size = BlockSize::new(block_size).expect("non-zero");
    c.kv_blocks = kv_blocks;
    c
}

fn simulate(c: &mut Criterion) {
    let mut group = c.benchmark_group("simulate");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_secs(1));
    let runs = [
        // The source document's run: 200 requests, 4 instances, 8 prefixes of 2,048 tokens, block 512.
        (
            "source document run (200 req, 4 inst, block 512)",
            config(200, 4, 6.0, 512, None),
        ),
        // The same fleet shape scaled to 100k requests over 16 instances.
        (
            "100k req, 16 inst, block 512",
            config(100_000, 16, 96.0, 512, None),
        ),
        // Block 16: 256 blocks per prompt through caches, index and load tracker, bounded caches.
        (
            "20k req, 16 inst, block 16, 30k blocks/inst",
            config(20_000, 16, 60.0, 16, Some(30_000)),
        ),
        (
            "100k req, 16 inst, block 16, 30k blocks/inst",
            config(100_000, 16, 60.0, 16, Some(30_000)),
        ),
    ];
    let mut runs = runs.to_vec();
    // The whole Mooncake conversation trace (12,031 requests, 59 minutes) on 8 instances, when
    // the shared data sits beside the repository.
    let path = trace_path();
    match Trace::load(&path, BlockSize::new(512).expect("non-zero")) {
        Ok(trace) => {
            let mut cfg = SimConfig::default().with_trace(trace);
            cfg.instances = 8;
            cfg.kv_blocks = Some(900);
            // Routers that follow first tokens, and a closed loop.
            let mut prefill_aware = cfg.clone();
            prefill_aware.cost_model = CostModel::PrefillAware;
            let mut closed = cfg.clone();
            closed.concurrency = Some(32);
            runs.push((
                "conversation trace (12,031 req, 8 inst, 900 blocks/inst)",
                cfg,
            ));
            runs.push((
                "conversation trace, prefill-aware cost (8 inst, 900 blocks/inst)",
                prefill_aware,
            ));
            runs.push((
                "conversation trace, closed loop at concurrency 32 (8 inst, 900 blocks/inst)",
                closed,
            ));
        }
        Err(e) => eprintln!("skipping the trace run: {e}"),
    }
    for (name, cfg) in runs {
        group.throughput(Throughput::Elements(cfg.num_requests as u64));
        let sim = Simulation::new(cfg).expect("valid");
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| sim.run().expect("runs"))
        });
    }
    // The same trace run as a user runs it: reading and checking the file included. Its
    // throughput is in simulated seconds (the trace's span) per wall-clock second.
    if let Ok(trace) = Trace::load(&path, BlockSize::new(512).expect("non-zero")) {
        let span_s = trace.stats().span_s;
        group.throughput(Throughput::Elements(span_s.round() as u64));
        group.bench_function(
            BenchmarkId::from_parameter(
                "conversation trace, file to report (8 inst, kv, 900 blocks/inst; elements = simulated s)",
            ),
            |b| {
                b.iter(|| {
                    let trace =
                        Trace::load(&path, BlockSize::new(512).expect("non-zero")).expect("loads");
                    let mut cfg = SimConfig::default().with_trace(trace);
                    cfg.instances = 8;
                    cfg.kv_blocks = Some(900);
                    Simulation::new(cfg).expect("valid").run().expect("runs")
                })
            },
        );
    }
    group.finish();
}

/// The Mooncake conversation trace: `KVKIT_CONVERSATION_TRACE`, or the shared data beside the
/// repository.
fn trace_path() -> std::path::PathBuf {
    std::env::var_os("KVKIT_CONVERSATION_TRACE").map_or_else(
        || {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../shared/data/mooncake_conversation_trace.jsonl")
        },
        std::path::PathBuf::from,
    )
}

criterion_group!(benches, simulate);
criterion_main!(benches);
