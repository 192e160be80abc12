//! vLLM's `medium`: blocks offloaded to host memory are mirrored as the host tier and credited
//! where the device's run ends; they carry no tokens, so they map through the device's hashes.

use kvroute::{RequestId, Role, Router, Tier, TierCredits, WorkerId};
use kvroute_vllm::{BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, VllmIngest};

fn hashes(ids: std::ops::Range<u64>) -> Vec<EngineHash> {
    ids.map(EngineHash::Int).collect()
}

fn offloaded(ids: std::ops::Range<u64>, medium: &str) -> EngineEvent {
    let mut st = BlockStored::new(hashes(ids), None, Vec::new(), 0);
    st.medium = Some(medium.to_string());
    EngineEvent::BlockStored(st)
}

fn removed(ids: std::ops::Range<u64>, medium: Option<&str>) -> EngineEvent {
    let mut r = BlockRemoved::new(hashes(ids));
    r.medium = medium.map(str::to_string);
    EngineEvent::BlockRemoved(r)
}

#[test]
fn offloaded_blocks_are_the_host_tier_and_count_after_the_device_run() {
    let mut router = Router::builder()
        .tier_credits(TierCredits::new(0.5, 0.25))
        .build()
        .unwrap();
    let (w, other) = (WorkerId::new(0), WorkerId::new(1));
    router.add_worker(w);
    router.add_worker(other);
    let mut ingest = VllmIngest::new();
    let tokens: Vec<u32> = (0..64).collect();
    let gpu = EngineEvent::BlockStored(BlockStored::new(hashes(1..5), None, tokens.clone(), 16));
    // The GPU computes 4 blocks, the connector offloads them to the CPU, the GPU evicts the
    // last 2: a batch that mixes media applies whole.
    let batch = EventBatch::new(0.0, vec![gpu, offloaded(1..5, "CPU"), removed(3..5, None)]);
    let s = ingest.apply_batch(&mut router, w, Some(0), &batch).unwrap();
    assert_eq!(
        (s.blocks_stored, s.lower_tier_stored, s.blocks_removed),
        (4, 4, 2)
    );
    assert_eq!(
        (router.cache_view(w), router.tier_view(w, Tier::Host)),
        (2, 4)
    );

    // Blocks 0 and 1 on the GPU, 2 and 3 on the host (0 and 1 are not counted twice).
    let d = router
        .route_tokens(RequestId::new(1), &tokens, Role::Unified)
        .unwrap();
    assert_eq!((d.worker, d.cache_hits, d.lower_tier_hits), (w, 2, 2));
    assert_eq!(d.cost, 4.0 - 2.0 - 0.5 * 2.0);
    router.finish(RequestId::new(1)).unwrap();

    // The host drops block 3; a disk copy of it counts at the disk's credit.
    let batch = EventBatch::new(
        0.0,
        vec![removed(4..5, Some("CPU")), offloaded(4..5, "DISK")],
    );
    let s = ingest.apply_batch(&mut router, w, Some(1), &batch).unwrap();
    assert_eq!(s.lower_tier_removed, 1);
    // Block 4's engine hash left the device map with the GPU eviction: not trackable.
    assert_eq!(s.untracked_blocks, 1);
    let c = &router.explain(
        &kvblock::BlockHasher::new(router.block_size()).sequence_hashes(&tokens),
        Role::Unified,
    )[0];
    assert_eq!((c.cache_hits, c.lower_tier_hits), (2, 1));

    // An offload of blocks the device never reported is counted, not guessed.
    let batch = EventBatch::new(0.0, vec![offloaded(90..92, "CPU")]);
    let s = ingest.apply_batch(&mut router, w, Some(2), &batch).unwrap();
    assert_eq!(s.untracked_blocks, 2);
    // A restart forgets the lower tiers too.
    let s = ingest
        .apply_batch(&mut router, w, Some(0), &EventBatch::new(0.0, vec![]))
        .unwrap();
    assert!(s.restarted);
    assert_eq!(router.tier_view(w, Tier::Host), 0);
}

#[test]
fn bad_credits_are_rejected() {
    assert!(Router::builder()
        .tier_credits(TierCredits::new(1.5, 0.0))
        .build()
        .is_err());
    assert!(Router::builder()
        .tier_credits(TierCredits::new(0.5, f64::NAN))
        .build()
        .is_err());
}

/// A block the device evicted but the host still holds may move on to disk; vLLM's `STORAGE`
/// is the disk; an offload block of several of ours is counted, not guessed.
#[test]
fn lower_tiers_map_through_each_other_and_larger_offload_blocks_are_counted() {
    let mut router = Router::builder().build().unwrap();
    let w = WorkerId::new(0);
    router.add_worker(w);
    let mut ingest = VllmIngest::new();
    let tokens: Vec<u32> = (0..32).collect();
    let gpu = EngineEvent::BlockStored(BlockStored::new(hashes(1..3), None, tokens.clone(), 16));
    let batch = EventBatch::new(
        0.0,
        vec![
            gpu,
            offloaded(1..3, "CPU"),
            removed(1..3, None),
            offloaded(1..3, "STORAGE"),
        ],
    );
    let s = ingest.apply_batch(&mut router, w, Some(0), &batch).unwrap();
    assert_eq!((s.lower_tier_stored, s.untracked_blocks), (4, 0));
    assert_eq!(
        (
            router.cache_view(w),
            router.tier_view(w, Tier::Host),
            router.tier_view(w, Tier::Disk)
        ),
        (0, 2, 2)
    );
    let mut big = BlockStored::new(hashes(7..8), None, Vec::new(), 48);
    big.medium = Some("CPU".to_string());
    let batch = EventBatch::new(0.0, vec![EngineEvent::BlockStored(big)]);
    let s = ingest.apply_batch(&mut router, w, Some(1), &batch).unwrap();
    assert_eq!((s.lower_tier_stored, s.untracked_blocks), (0, 1));
}
