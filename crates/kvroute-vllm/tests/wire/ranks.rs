//! Data-parallel ranks: each rank of an engine is its own worker, with its own mirror and its own
//! sequence numbers, and the router scores the ranks apart.

use kvblock::BlockHasher;
use kvroute::{BlockSize, RequestId, Role, Router, WorkerId};
use kvroute_vllm::{BlockStored, EngineEvent, EngineHash, EventBatch, VllmError, VllmIngest};

fn stored(first: u64, tokens: std::ops::Range<u32>, parent: Option<u64>) -> EngineEvent {
    let n = (tokens.len() / 16) as u64;
    let hashes = (first..first + n).map(EngineHash::Int).collect();
    EngineEvent::BlockStored(BlockStored::new(
        hashes,
        parent.map(EngineHash::Int),
        tokens.collect(),
        16,
    ))
}

fn batch(events: Vec<EngineEvent>, rank: Option<i64>) -> EventBatch {
    let mut b = EventBatch::new(0.0, events);
    b.data_parallel_rank = rank;
    b
}

#[test]
fn each_rank_has_its_own_mirror_and_stream() {
    let bs = BlockSize::new(16).unwrap();
    let mut router = Router::builder().block_size(bs).build().unwrap();
    let engine = WorkerId::new(1);
    let ranks = [WorkerId::new(10), WorkerId::new(11)];
    for w in ranks {
        router.add_worker(w);
    }
    let mut ingest = VllmIngest::new();
    assert_eq!(ingest.set_rank_worker(engine, 0, ranks[0]), None);
    assert_eq!(ingest.set_rank_worker(engine, 1, ranks[1]), None);

    // Rank 0 caches tokens 0..64, rank 1 tokens 1000..1032; each stream counts from 0.
    ingest
        .apply_batch(
            &mut router,
            engine,
            Some(0),
            &batch(vec![stored(1, 0..32, None)], Some(0)),
        )
        .unwrap();
    ingest
        .apply_batch(
            &mut router,
            engine,
            Some(0),
            &batch(vec![stored(100, 1000..1032, None)], Some(1)),
        )
        .unwrap();
    ingest
        .apply_batch(
            &mut router,
            engine,
            Some(1),
            &batch(vec![stored(3, 32..64, Some(2))], Some(0)),
        )
        .unwrap();
    assert_eq!(
        (router.cache_view(ranks[0]), router.cache_view(ranks[1])),
        (4, 2)
    );
    assert_eq!(
        (ingest.next_seq(ranks[0]), ingest.next_seq(ranks[1])),
        (2, 1)
    );
    // A replay on rank 1's stream is a duplicate of rank 1, whatever rank 0's stream says.
    let empty = batch(vec![], Some(1));
    ingest
        .apply_batch(&mut router, engine, Some(1), &empty)
        .unwrap();
    let dup = ingest.apply_batch(&mut router, engine, Some(1), &empty);
    assert!(
        matches!(dup, Err(VllmError::DuplicateSequence { worker, got: 1, expected: 2 }) if worker == ranks[1]),
        "{dup:?}"
    );

    // The router picks the rank that holds the prompt, and says which engine and rank it is.
    let tokens: Vec<u32> = (0..64).collect();
    let d = router
        .route_tokens(RequestId::new(1), &tokens, Role::Unified)
        .unwrap();
    assert_eq!((d.worker, d.cache_hits), (ranks[0], 4));
    assert_eq!(ingest.rank_of(d.worker), Some((engine, 0)));
    let other: Vec<u32> = (1000..1032).collect();
    let d = router
        .route_tokens(RequestId::new(2), &other, Role::Unified)
        .unwrap();
    assert_eq!((d.worker, d.cache_hits), (ranks[1], 2));
    assert_eq!(
        BlockHasher::new(bs).sequence_hashes(&other).len(),
        router.cache_view(ranks[1])
    );

    // A rank without a worker applies to the engine itself, which must then be registered.
    let unmapped = batch(vec![stored(200, 2000..2016, None)], Some(5));
    assert!(ingest
        .apply_batch(&mut router, engine, Some(0), &unmapped)
        .is_err());
    assert_eq!(
        ingest.next_seq(engine),
        0,
        "a refused batch consumes no sequence number"
    );
    router.add_worker(engine);
    ingest
        .apply_batch(&mut router, engine, Some(0), &unmapped)
        .unwrap();
    assert_eq!(router.cache_view(engine), 1);

    // A worker stands for one rank at a time: moving it frees its old rank.
    let spare = WorkerId::new(13);
    router.add_worker(spare);
    ingest.set_rank_worker(engine, 7, spare);
    ingest.set_rank_worker(engine, 8, spare);
    assert_eq!(ingest.rank_of(spare), Some((engine, 8)));
    let to_7 = batch(vec![stored(300, 3000..3016, None)], Some(7));
    ingest
        .apply_batch(&mut router, engine, Some(1), &to_7)
        .unwrap();
    assert_eq!(
        (router.cache_view(spare), router.cache_view(engine)),
        (0, 2)
    );

    // Re-pointing a rank forgets the old worker's rank.
    assert_eq!(
        ingest.set_rank_worker(engine, 1, WorkerId::new(12)),
        Some(ranks[1])
    );
    assert_eq!(ingest.rank_of(ranks[1]), None);
    assert_eq!(ingest.rank_of(WorkerId::new(12)), Some((engine, 1)));
}

#[test]
fn multipart_messages_of_a_rank_reach_its_worker() {
    let mut router = Router::builder().build().unwrap();
    let engine = WorkerId::new(3);
    let rank2 = WorkerId::new(32);
    router.add_worker(rank2);
    let mut ingest = VllmIngest::new();
    ingest.set_rank_worker(engine, 2, rank2);
    let payload = batch(vec![stored(1, 0..16, None)], Some(2)).to_msgpack();
    let frames: [&[u8]; 3] = [b"kv@3", &0u64.to_be_bytes(), &payload];
    let s = ingest
        .apply_multipart(&mut router, engine, &frames)
        .unwrap();
    assert_eq!(s.blocks_stored, 1);
    assert_eq!(router.cache_view(rank2), 1);
}

#[test]
fn a_forgotten_rank_worker_gives_its_rank_back_to_the_engine() {
    let mut router = Router::builder().build().unwrap();
    let (engine, rank0) = (WorkerId::new(4), WorkerId::new(40));
    router.add_worker(engine);
    router.add_worker(rank0);
    let mut ingest = VllmIngest::new();
    ingest.set_rank_worker(engine, 0, rank0);
    let b = batch(vec![stored(1, 0..16, None)], Some(0));
    ingest
        .apply_batch(&mut router, engine, Some(0), &b)
        .unwrap();
    assert!(ingest.forget_worker(rank0));
    assert_eq!(ingest.rank_of(rank0), None);
    ingest
        .apply_batch(&mut router, engine, Some(0), &b)
        .unwrap();
    assert_eq!(
        (router.cache_view(engine), router.cache_view(rank0)),
        (1, 1)
    );
}
