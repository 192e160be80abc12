//! The server's per-request CPU work before forwarding: tokenise a 4,096-token prompt with a
//! Hugging Face tokenizer and route it among 64 workers (then finish it), against routing the
//! same token ids alone. The tokenizer is a word-level `tokenizer.json` written to a temporary
//! directory (the work per token is the tokenizer library's, not its vocabulary's size).

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvblock::{BlockHasher, BlockSize};
use kvroute::{KvEvent, RequestId, Role, Router, WorkerId};
use kvserve::tokenize;

const TOKENS: usize = 4096;
const WORKERS: u64 = 64;

fn bench(c: &mut Criterion) {
    let words: Vec<String> = (0..1000).map(|i| format!("w{i}")).collect();
    let refs: Vec<&str> = words.iter().map(String::as_str).collect();
    let dir = tempfile::tempdir().expect("a temporary directory");
    tokenize::write_test_tokenizer(dir.path(), &refs).expect("tokenizer written");
    let (codec, _) = tokenize::load(dir.path()).expect("tokenizer loads");
    let text: String = (0..TOKENS)
        .map(|i| words[(i * 7919) % words.len()].as_str())
        .collect::<Vec<_>>()
        .join(" ");
    let tokens = codec.encode(&text, false).expect("encodes");
    assert_eq!(tokens.len(), TOKENS);

    let bs = BlockSize::new(16).expect("16");
    let mut router = Router::builder().block_size(bs).build().expect("router");
    let blocks = BlockHasher::new(bs).sequence_hashes(&tokens);
    for w in 0..WORKERS {
        let id = WorkerId::new(w);
        router.add_worker(id);
        // Worker w holds a leading run of w * 4 blocks of the prompt.
        let n = (w as usize * 4).min(blocks.len());
        if n > 0 {
            let ev = KvEvent::Stored {
                parent: None,
                blocks: blocks[..n].to_vec(),
            };
            router.apply_event(id, 0, &ev).expect("applies");
        }
    }

    let mut g = c.benchmark_group("server_request");
    g.throughput(Throughput::Elements(TOKENS as u64));
    let mut id = 0u64;
    g.bench_function("tokenise_and_route_4096", |b| {
        b.iter(|| {
            id += 1;
            let t = codec.encode(black_box(&text), false).expect("encodes");
            let d = router
                .route_tokens(RequestId::new(id), &t, Role::Unified)
                .expect("routes");
            router.finish(RequestId::new(id)).expect("finishes");
            black_box(d)
        })
    });
    g.bench_function("route_4096_token_ids", |b| {
        b.iter(|| {
            id += 1;
            let d = router
                .route_tokens(RequestId::new(id), black_box(&tokens), Role::Unified)
                .expect("routes");
            router.finish(RequestId::new(id)).expect("finishes");
            black_box(d)
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
