//! Mirror snapshots: a snapshot taken at any point of a vLLM event stream, sent through JSON,
//! restored, and followed by the rest of the stream gives exactly the live router and adapter.
#![cfg(feature = "serde")]

use kvblock::BlockSize;
use kvroute::{RequestId, Role, Router, WorkerId};
use kvroute_vllm::{
    BlockRemoved, BlockStored, EngineEvent, EngineHash, EventBatch, MirrorSnapshot, VllmError,
    VllmIngest,
};
use proptest::prelude::*;

const BS: usize = 4;
const N: usize = 6;
const WORKERS: [WorkerId; 2] = [WorkerId::new(0), WorkerId::new(5)];

fn router() -> Router {
    let mut r = Router::builder()
        .block_size(BlockSize::new(BS).unwrap())
        .build()
        .unwrap();
    for w in WORKERS {
        r.add_worker(w);
    }
    r
}

/// Prompt `p`'s tokens: the first two blocks are shared by every prompt, so two engine hashes
/// (one per prompt) map to one of ours there.
fn tokens(p: usize, upto: usize) -> Vec<u32> {
    (0..upto * BS)
        .map(|t| {
            if t < 2 * BS {
                t as u32
            } else {
                (p * 1000 + t) as u32
            }
        })
        .collect()
}

fn engine_hash(p: usize, i: usize) -> EngineHash {
    EngineHash::Int((p * 100 + i) as u64 + 1)
}

#[derive(Debug, Clone)]
enum Op {
    /// Worker w stored blocks from..upto of prompt p (the parent may be unknown: skipped).
    Store {
        w: usize,
        p: usize,
        from: usize,
        upto: usize,
    },
    /// Worker w evicted these blocks of prompt p.
    Remove {
        w: usize,
        p: usize,
        blocks: Vec<usize>,
    },
    Clear {
        w: usize,
    },
    /// The next batch of worker w comes with its sequence number moved by this much: a gap
    /// (positive), a restart (to 0), or a duplicate (rejected).
    Seq {
        w: usize,
        jump: i8,
    },
    /// The caller records a stream position for worker w.
    Position {
        w: usize,
        at: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..2usize, 0..3usize, 0..N, 1..=N).prop_map(|(w, p, from, upto)| {
            Op::Store { w, p, from: from.min(upto - 1), upto }
        }),
        3 => (0..2usize, 0..3usize, proptest::collection::vec(0..N, 1..4))
            .prop_map(|(w, p, blocks)| Op::Remove { w, p, blocks }),
        1 => (0..2usize).prop_map(|w| Op::Clear { w }),
        1 => (0..2usize, -3..3i8).prop_map(|(w, jump)| Op::Seq { w, jump }),
        2 => (0..2usize, any::<u64>()).prop_map(|(w, at)| Op::Position { w, at }),
    ]
}

/// A stream being applied: the router, the adapter, and each worker's next sequence number.
struct Live {
    router: Router,
    ingest: VllmIngest,
    seq: [u64; 2],
}

impl Live {
    fn apply(&mut self, op: &Op) -> Result<(), VllmError> {
        let batch = |e| EventBatch::new(0.0, vec![e]);
        let (w, b) = match op {
            Op::Store { w, p, from, upto } => {
                let hashes = (*from..*upto).map(|i| engine_hash(*p, i)).collect();
                let parent = from.checked_sub(1).map(|i| engine_hash(*p, i));
                let toks = tokens(*p, *upto)[from * BS..].to_vec();
                (
                    *w,
                    batch(EngineEvent::BlockStored(BlockStored::new(
                        hashes, parent, toks, BS as u64,
                    ))),
                )
            }
            Op::Remove { w, p, blocks } => {
                let hashes = blocks.iter().map(|&i| engine_hash(*p, i)).collect();
                (
                    *w,
                    batch(EngineEvent::BlockRemoved(BlockRemoved::new(hashes))),
                )
            }
            Op::Clear { w } => (*w, batch(EngineEvent::AllBlocksCleared)),
            Op::Seq { w, jump } => {
                let s = &mut self.seq[*w];
                *s = if *jump < -2 {
                    0
                } else {
                    s.saturating_add_signed(i64::from(*jump))
                };
                return Ok(());
            }
            Op::Position { w, at } => {
                self.ingest.set_position(WORKERS[*w], Some(*at));
                return Ok(());
            }
        };
        let r = self
            .ingest
            .apply_batch(&mut self.router, WORKERS[w], Some(self.seq[w]), &b);
        if r.is_ok() {
            self.seq[w] = self.seq[w].saturating_add(1);
        }
        r.map(|_| ())
    }

    /// Everything a router decides with: the index snapshot, the adapter's, and the hits of each
    /// prompt on each worker.
    fn state(&mut self) -> (MirrorSnapshot, Vec<(WorkerId, usize)>) {
        let mut hits = Vec::new();
        for p in 0..3 {
            for c in self.router.explain(
                &kvblock::BlockHasher::new(self.router.block_size()).sequence_hashes(&tokens(p, N)),
                Role::Unified,
            ) {
                hits.push((c.worker, c.cache_hits));
            }
        }
        (self.ingest.snapshot(&self.router), hits)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn restore_then_replay_is_the_live_state(
        ops in proptest::collection::vec(op(), 0..40),
        cut in any::<prop::sample::Index>(),
    ) {
        let k = cut.index(ops.len() + 1);
        let mut live = Live { router: router(), ingest: VllmIngest::new(), seq: [0; 2] };
        for op in &ops[..k] {
            let _ = live.apply(op);
        }
        // Through JSON, as a server stores it.
        let json = serde_json::to_string(&live.ingest.snapshot(&live.router)).unwrap();
        let snap: MirrorSnapshot = serde_json::from_str(&json).unwrap();
        let mut restored = router();
        // A restarted router registers no workers before restoring: the snapshot brings them.
        let mut fresh = Router::builder().block_size(BlockSize::new(BS).unwrap()).build().unwrap();
        VllmIngest::restore(&mut fresh, snap.clone()).unwrap();
        prop_assert_eq!(fresh.workers(), WORKERS.to_vec());
        let ingest = VllmIngest::restore(&mut restored, snap).unwrap();
        let mut again = Live { router: restored, ingest, seq: live.seq };
        for op in &ops[k..] {
            let a = live.apply(op).is_ok();
            let b = again.apply(op).is_ok();
            prop_assert_eq!(a, b, "{:?}", op);
        }
        prop_assert_eq!(live.router.snapshot_index(), again.router.snapshot_index());
        prop_assert_eq!(live.state(), again.state());
        for w in WORKERS {
            prop_assert_eq!(live.ingest.next_seq(w), again.ingest.next_seq(w));
            prop_assert_eq!(live.ingest.mapped_blocks(w), again.ingest.mapped_blocks(w));
            prop_assert_eq!(live.ingest.position(w), again.ingest.position(w));
        }
        prop_assert!(again.router.index().check_invariants().is_ok());
        // A request routes the same way on both.
        let t = tokens(1, N);
        let a = live.router.route_tokens(RequestId::new(1), &t, Role::Unified).unwrap();
        let b = again.router.route_tokens(RequestId::new(1), &t, Role::Unified).unwrap();
        prop_assert_eq!((a.worker, a.cache_hits), (b.worker, b.cache_hits));
    }
}

#[test]
fn bad_snapshots_are_errors_and_change_nothing() {
    let mut live = Live {
        router: router(),
        ingest: VllmIngest::new(),
        seq: [0; 2],
    };
    live.apply(&Op::Store {
        w: 0,
        p: 0,
        from: 0,
        upto: 3,
    })
    .unwrap();
    let good = live.ingest.snapshot(&live.router);
    let check = |snap: MirrorSnapshot, needle: &str| {
        let mut r = router();
        let e = VllmIngest::restore(&mut r, snap).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
        assert_eq!(r.snapshot_index(), router().snapshot_index(), "unchanged");
    };
    let mut v = good.clone();
    v.version = 99;
    check(v, "version 99 (expected 1)");
    let mut size = good.clone();
    size.block_size = 16;
    check(size, "block size 16 (the router's is 4)");
    let mut twice = good.clone();
    twice.feeds.push(twice.feeds[0].clone());
    check(twice, "has two feeds");
    let mut dup = good.clone();
    let first = dup.feeds[0].blocks[0].clone();
    dup.feeds[0].blocks.push(first);
    check(dup, "is listed twice");
    let mut stranger = good;
    stranger.feeds[0].worker = WorkerId::new(77);
    check(stranger, "worker 77 that the index does not list");
}
