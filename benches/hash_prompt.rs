//! Hashing a prompt into chained block hashes, against a baseline that makes exactly the XXH3
//! calls the contract requires over a pre-made byte buffer. The ratio is kvblock's overhead.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvkit::kvblock::{BlockHash, BlockHasher, BlockSize, DEFAULT_SEED};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The floor: one XXH3 call per block over ready-made little-endian bytes, one 16-byte chain call.
fn baseline(bytes: &[u8], block_bytes: usize, out: &mut Vec<u64>) {
    out.clear();
    let mut prev: Option<u64> = None;
    for block in bytes.chunks_exact(block_bytes) {
        let local = xxh3_64_with_seed(block, DEFAULT_SEED);
        let seq = match prev {
            None => local,
            Some(p) => {
                let mut buf = [0u8; 16];
                buf[..8].copy_from_slice(&p.to_le_bytes());
                buf[8..].copy_from_slice(&local.to_le_bytes());
                xxh3_64_with_seed(&buf, DEFAULT_SEED)
            }
        };
        out.push(seq);
        prev = Some(seq);
    }
}

fn hash_prompt(c: &mut Criterion) {
    let mut group = c.benchmark_group("hash_prompt");
    for &tokens in &[1_024usize, 8_192, 131_072] {
        let prompt: Vec<u32> = (0..tokens as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
        for &bs in &[16usize, 64, 512] {
            group.throughput(Throughput::Elements(tokens as u64));
            let id = format!("{}k tokens, block {bs}", tokens / 1024);
            let hasher = BlockHasher::new(BlockSize::new(bs).expect("non-zero"));
            let mut out: Vec<BlockHash> = Vec::with_capacity(tokens / bs);
            group.bench_function(BenchmarkId::new("kvblock", &id), |b| {
                b.iter(|| {
                    out.clear();
                    hasher.sequence_hashes_into(None, black_box(&prompt), &mut out);
                    black_box(out.len())
                })
            });
            let mut raw: Vec<u64> = Vec::with_capacity(tokens / bs);
            group.bench_function(BenchmarkId::new("baseline", &id), |b| {
                b.iter(|| {
                    baseline(black_box(&bytes), bs * 4, &mut raw);
                    black_box(raw.len())
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, hash_prompt);
criterion_main!(benches);
