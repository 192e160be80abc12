//! vLLM event ingestion through `VllmIngest`: decoded batches of `BlockStored` events (16 blocks
//! of 16 tokens, each chained on the previous event's last block) and the `BlockRemoved` events
//! that evict them, applied to a router with 8 workers. Throughput in blocks. The work per block
//! is the re-hash of its tokens, the engine-to-ours map and the router's index.

// `criterion_group!` defines an undocumented `pub fn`; the workspace denies `missing_docs`.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvkit::kvblock::BlockSize;
use kvkit::kvroute::{Router, WorkerId};
use kvkit::kvroute_vllm::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, VllmIngest,
};
use kvtest::splitmix;

const WORKERS: u64 = 8;
const BLOCKS_PER_EVENT: usize = 16;
const EVENTS: usize = 64;
const BS: usize = 16;

/// One worker's stream: `EVENTS` stores chained one after another, then their removal, tail first.
fn stream(worker: u64) -> Vec<EventBatch> {
    let mut rng = splitmix::Rng(worker + 1);
    let mut out = Vec::new();
    let mut parent: Option<EngineHash> = None;
    let mut all = Vec::new();
    for e in 0..EVENTS {
        let hashes: Vec<EngineHash> = (0..BLOCKS_PER_EVENT)
            .map(|b| EngineHash::Int((worker << 40) | ((e * BLOCKS_PER_EVENT + b) as u64)))
            .collect();
        let tokens: Vec<u32> = (0..BLOCKS_PER_EVENT * BS)
            .map(|_| (rng.next_u64() % 50_000) as u32)
            .collect();
        let st = BlockStored::new(hashes.clone(), parent.clone(), tokens, BS as u64);
        parent = hashes.last().cloned();
        all.extend(hashes);
        out.push(EventBatch::new(0.0, vec![EngineEvent::BlockStored(st)]));
    }
    for chunk in all.rchunks(BLOCKS_PER_EVENT) {
        let rm = BlockRemoved::new(chunk.iter().rev().cloned().collect());
        out.push(EventBatch::new(0.0, vec![EngineEvent::BlockRemoved(rm)]));
    }
    out
}

fn bench(c: &mut Criterion) {
    let streams: Vec<Vec<EventBatch>> = (0..WORKERS).map(stream).collect();
    let blocks = (WORKERS as usize * EVENTS * BLOCKS_PER_EVENT * 2) as u64;
    let mut g = c.benchmark_group("vllm_ingest");
    g.throughput(Throughput::Elements(blocks));
    g.bench_function("store_then_remove_16_block_events_8_workers", |b| {
        b.iter(|| {
            let mut router = Router::builder()
                .block_size(BlockSize::new(BS).expect("16"))
                .build()
                .expect("router");
            let mut ingest = VllmIngest::new();
            for w in 0..WORKERS {
                router.add_worker(WorkerId::new(w));
            }
            for (w, s) in streams.iter().enumerate() {
                for batch in s {
                    let r = ingest.apply_batch(&mut router, WorkerId::new(w as u64), None, batch);
                    black_box(r.expect("applies"));
                }
            }
            black_box(router.index().pairs())
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
