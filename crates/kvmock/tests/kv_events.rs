//! kvmock's KV events on vLLM's wire, decoded by the router side (`kvroute_vllm`): both
//! shapes, replay after a missed sequence number, and an engine restart.

mod common;

use common::{completion_body, free_port, next_msg, replay, rt, subscriber, Mock};
use kvblock::{BlockHasher, BlockSize};
use kvroute::{RequestId, Role, Router, WorkerId};
use kvroute_vllm::{decode_event_batch, parse_seq_frame, EngineEvent, VllmIngest};
use zeromq::SocketRecv;

const BS: usize = 16;

fn new_router() -> Router {
    let mut r = Router::builder()
        .block_size(BlockSize::new(BS).unwrap())
        .build()
        .unwrap();
    r.add_worker(WorkerId::new(0));
    r
}

fn events_args(pub_port: u16, replay_port: u16, shape: &str, extra: &[&str]) -> Vec<String> {
    let cfg = format!(
        r#"{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{pub_port}", "replay_endpoint": "tcp://127.0.0.1:{replay_port}", "topic": "kv"}}"#
    );
    let mut a: Vec<String> = [
        "--enable-kv-events",
        "--kv-events-config",
        &cfg,
        "--kv-events-shape",
        shape,
        "--speedup",
        "20",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn start(port: u16, args: &[String]) -> Mock {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    Mock::start(port, &a)
}

/// Prompts that share a 64-token prefix by pairs.
fn prompt(i: u32) -> Vec<u32> {
    (0..64)
        .map(|k| 1_000 * (i % 3) + k)
        .chain((0..40).map(|k| 50_000 + 100 * i + k))
        .collect()
}

/// Reads published messages until the engine's cache size (from /metrics) equals the router's
/// view, or 10 s pass. Returns every message read.
async fn drain_until_synced(
    sub: &mut zeromq::SubSocket,
    m: &Mock,
    router: &mut Router,
    ingest: &mut VllmIngest,
) -> Vec<Vec<bytes::Bytes>> {
    let w = WorkerId::new(0);
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let want = m.metric("kvmock:cached_blocks") as usize;
        if router.cache_view(w) == want && want > 0 {
            // Anything still in flight is applied too; then the views must still agree.
            while let Some(frames) =
                tokio::time::timeout(std::time::Duration::from_millis(300), sub.recv())
                    .await
                    .ok()
                    .and_then(Result::ok)
            {
                let frames = frames.into_vec();
                ingest.apply_multipart(router, w, &frames).unwrap();
                seen.push(frames);
            }
            assert_eq!(
                router.cache_view(w),
                m.metric("kvmock:cached_blocks") as usize
            );
            return seen;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "router view {} never reached {want}",
            router.cache_view(w)
        );
        if let Some(frames) = next_msg(sub, 1).await {
            ingest.apply_multipart(router, w, &frames).unwrap();
            seen.push(frames);
        }
    }
}

#[test]
fn both_shapes_rebuild_the_engine_cache_in_a_router() {
    for shape in ["map", "array"] {
        let (http, publ, rep) = (free_port(), free_port(), free_port());
        let m = start(
            http,
            &events_args(publ, rep, shape, &["--num-gpu-blocks", "20"]),
        );
        rt().block_on(async {
            let mut sub = subscriber(publ).await;
            let (mut router, mut ingest) = (new_router(), VllmIngest::new());
            for i in 0..8 {
                let (s, body) = m.post("/v1/completions", &completion_body(&prompt(i), 3, false));
                assert_eq!(s, 200, "{body}");
            }
            let msgs = drain_until_synced(&mut sub, &m, &mut router, &mut ingest).await;
            // Frames: topic, 8-byte big-endian sequence, payload in the requested shape.
            let first = &msgs[0];
            assert_eq!(first.len(), 3);
            assert_eq!(&first[0][..], b"kv");
            assert_eq!(parse_seq_frame(&first[1]).unwrap(), 0);
            let v = rmpv::decode::read_value(&mut &first[2][..]).unwrap();
            let ev = &v.as_array().unwrap()[1].as_array().unwrap()[0];
            assert_eq!(ev.is_map(), shape == "map", "{shape}: {ev}");
            let batch = decode_event_batch(&first[2]).unwrap();
            let EngineEvent::BlockStored(s) = &batch.events[0] else {
                panic!("the first event stores the first prompt")
            };
            assert_eq!((s.block_size, s.token_ids.len()), (BS as u64, 96));
            assert_eq!(s.medium.as_deref(), Some("GPU"));
            // Engine hashes are the engine's own: the router had to re-hash the tokens.
            let ours = BlockHasher::new(BlockSize::new(BS).unwrap()).sequence_hashes(&prompt(0));
            let kvroute_vllm::EngineHash::Int(h0) = s.block_hashes[0] else {
                panic!()
            };
            assert_ne!(h0, ours[0].get());
            // With 20 blocks, 8 prompts of 7 blocks evicted some: removals were published too.
            let removed = msgs.iter().any(|f| {
                decode_event_batch(&f[2])
                    .unwrap()
                    .events
                    .iter()
                    .any(|e| matches!(e, EngineEvent::BlockRemoved(_)))
            });
            assert!(removed, "{shape}: evictions are published");
            // The router finds the last prompt's blocks on the worker.
            let d = router
                .route_tokens(RequestId::new(1), &prompt(7), Role::Unified)
                .unwrap();
            assert_eq!(d.cache_hits, 6, "{shape}");
        });
    }
}

#[test]
fn replay_fills_a_missed_sequence_number() {
    let (http, publ, rep) = (free_port(), free_port(), free_port());
    let m = start(http, &events_args(publ, rep, "map", &[]));
    rt().block_on(async {
        let mut sub = subscriber(publ).await;
        let (mut router, mut ingest) = (new_router(), VllmIngest::new());
        let w = WorkerId::new(0);
        // Three requests, one after the other: three batches (seq 0, 1, 2).
        for i in 0..3 {
            let (s, _) = m.post(
                "/v1/completions",
                &completion_body(&prompt(10 + i), 2, false),
            );
            assert_eq!(s, 200);
        }
        let mut msgs = Vec::new();
        while msgs.len() < 3 {
            msgs.push(next_msg(&mut sub, 10).await.expect("a batch in time"));
        }
        let seqs: Vec<u64> = msgs
            .iter()
            .map(|f| parse_seq_frame(&f[1]).unwrap())
            .collect();
        assert_eq!(seqs, [0, 1, 2]);
        // Seq 1 is "lost": applying 2 after 0 reports the gap.
        ingest.apply_multipart(&mut router, w, &msgs[0]).unwrap();
        let s = ingest.apply_multipart(&mut router, w, &msgs[2]).unwrap();
        assert_eq!(s.gap, Some((1, 2)));
        // Replay from 1 gives batches 1 and 2, byte for byte, then the end marker.
        let got = replay(rep, 1).await;
        let want: Vec<(i64, bytes::Bytes)> = msgs[1..]
            .iter()
            .map(|f| (parse_seq_frame(&f[1]).unwrap() as i64, f[2].clone()))
            .collect();
        assert_eq!(got, want);
        // A fresh router fed 0 then the replayed batches agrees with the engine.
        let (mut r2, mut i2) = (new_router(), VllmIngest::new());
        i2.apply_multipart(&mut r2, w, &msgs[0]).unwrap();
        for (seq, payload) in &got {
            let seq = (*seq as u64).to_be_bytes();
            let s = i2
                .apply_multipart(&mut r2, w, &[&b"kv"[..], &seq[..], &payload[..]])
                .unwrap();
            assert_eq!(s.gap, None);
        }
        assert_eq!(r2.cache_view(w), m.metric("kvmock:cached_blocks") as usize);
        // Replay from 0 gives everything; from beyond the end, only the marker.
        assert_eq!(replay(rep, 0).await.len(), 3);
        assert!(replay(rep, 99).await.is_empty());
    });
}

#[test]
fn an_engine_restart_starts_the_sequence_again_and_the_router_clears() {
    let (http, publ, rep) = (free_port(), free_port(), free_port());
    let args = events_args(publ, rep, "map", &[]);
    let w = WorkerId::new(0);
    let (mut router, mut ingest) = (new_router(), VllmIngest::new());
    let mut m = start(http, &args);
    rt().block_on(async {
        let mut sub = subscriber(publ).await;
        for i in 0..3 {
            m.post(
                "/v1/completions",
                &completion_body(&prompt(20 + i), 2, false),
            );
        }
        drain_until_synced(&mut sub, &m, &mut router, &mut ingest).await;
    });
    let before = router.cache_view(w);
    assert!(before > 0);
    assert_eq!(ingest.next_seq(w), 3);
    m.stop();
    // The same engine again on the same ports: an empty cache, sequence numbers from 0.
    let m = start(http, &args);
    rt().block_on(async {
        let mut sub = subscriber(publ).await;
        m.post("/v1/completions", &completion_body(&prompt(30), 2, false));
        let frames = next_msg(&mut sub, 10)
            .await
            .expect("a batch after the restart");
        assert_eq!(parse_seq_frame(&frames[1]).unwrap(), 0);
        let s = ingest.apply_multipart(&mut router, w, &frames).unwrap();
        assert!(s.restarted);
        assert_eq!(s.blocks_cleared, before);
        assert_eq!(
            router.cache_view(w),
            m.metric("kvmock:cached_blocks") as usize
        );
    });
}

#[test]
fn a_data_parallel_rank_offsets_the_ports_and_tags_its_batches() {
    let (http, base) = (free_port(), free_port());
    // Rank 2 publishes on base + 2, as vLLM offsets a rank's endpoints.
    let publ = base + 2;
    assert!(
        std::net::TcpListener::bind(("127.0.0.1", publ)).is_ok(),
        "port {publ} is free"
    );
    let cfg = format!(r#"{{"endpoint": "tcp://127.0.0.1:{base}"}}"#);
    let m = Mock::start(
        http,
        &[
            "--enable-kv-events",
            "--kv-events-config",
            &cfg,
            "--data-parallel-rank",
            "2",
            "--speedup",
            "20",
        ],
    );
    rt().block_on(async {
        let mut sub = subscriber(publ).await;
        m.post("/v1/completions", &completion_body(&prompt(40), 2, false));
        let frames = next_msg(&mut sub, 10)
            .await
            .expect("a batch on the offset port");
        assert_eq!(&frames[0][..], b"", "the default topic is empty");
        let batch = decode_event_batch(&frames[2]).unwrap();
        assert_eq!(batch.data_parallel_rank, Some(2));
    });
    assert!(m.get("/metrics").1.contains("engine=\"2\""));
}
