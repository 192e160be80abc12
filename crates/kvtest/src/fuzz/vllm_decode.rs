//! `vllm_decode`: bytes from the network into `kvroute_vllm` (feature `vllm`), never a panic.
//!
//! 1. The whole input is one MessagePack payload for `decode_event_batch`. A batch that decodes
//!    re-encodes (`to_msgpack`) to bytes that decode to the same batch and re-encode to the same
//!    bytes; every `BlockStored` has a block size of at least 1. An error is consistent with the
//!    input (`Truncated` gives its length, `TrailingBytes` ends inside it, `Msgpack` points into
//!    it) and its message is short: a value from the network is named, never quoted whole.
//!    `parse_seq_frame` of the input's first bytes accepts exactly 8 of them.
//! 2. The input is also a stream of messages through `VllmIngest` into a `Router` of block size
//!    16 with workers 0 and 1: `payload (0xc1 control payload)*`. `0xc1` is the one byte
//!    MessagePack never uses, so a checked-in payload (the fixtures of
//!    `crates/kvroute-vllm/tests/fixtures/`) is one message, and libFuzzer's cross-overs splice them
//!    into streams. The control byte (0 for the first message) picks the worker (bits 0-1: 0, 1,
//!    0, or the unregistered 9), the batch sequence number (bits 2-4: the expected one, one or
//!    1000 ahead, one behind, or 0) and the call (bits 5-7: `apply_multipart` with the frames
//!    `[topic, 8-byte big-endian seq, payload]`, `apply_payload` with or without the number, a
//!    7-byte sequence frame, or 4 frames).
//!
//! After every message the index's invariants hold, and:
//!
//! - an error (a payload that does not decode, a bad frame, an unregistered worker, a block size
//!   or token count the router cannot take, a duplicate sequence number or `u64::MAX`) leaves
//!   the router exactly as it was (the same index snapshot, cache view per worker and (block,
//!   worker) pair count) and the ingest's expected sequence numbers and hash maps too; with
//!   good frames and a registered worker, a payload that does not decode gives exactly the
//!   decoder's error;
//! - a success needs a payload that decodes; its summary counts that batch's events, its
//!   sequence number is the one given (or the expected one), and the next one expected follows
//!   it; a gap is reported exactly when the number is ahead, a restart exactly when it is behind
//!   (0); the worker's cache view moves by the stored minus the removed and cleared blocks, and
//!   the other workers' views and sequence numbers do not move.

use kvblock::BlockSize;
use kvcache::{IndexSnapshot, WorkerId};
use kvroute::{Error, Router};
use kvroute_vllm::{
    decode_event_batch, parse_seq_frame, EngineEvent, EventBatch, IngestStats, VllmError,
    VllmIngest,
};

/// Messages applied per input, at most.
const MAX_MESSAGES: usize = 64;

/// Longest error message accepted: names and short excerpts, never a whole value.
const MAX_MESSAGE_LEN: usize = 1024;

/// Separates messages; MessagePack never uses this byte.
const SEPARATOR: u8 = 0xc1;

const WORKERS: [WorkerId; 2] = [WorkerId::new(0), WorkerId::new(1)];
const UNREGISTERED: WorkerId = WorkerId::new(9);

/// The call a control byte makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Multipart,
    Payload,
    PayloadNextSeq,
    ShortSeqFrame,
    FourFrames,
}

/// The target: decode `data` as one payload, then as a stream of messages (module docs).
pub fn run(data: &[u8]) {
    check_decode(data);
    check_ingest(data);
}

fn check_decode(data: &[u8]) {
    let frame = &data[..data.len().min(9)];
    assert_eq!(
        parse_seq_frame(frame).is_ok(),
        frame.len() == 8,
        "{frame:02x?}"
    );
    match decode_event_batch(data) {
        Ok(batch) => check_round_trip(&batch),
        Err(e) => {
            check_message(&e);
            match e {
                VllmError::Truncated { len } => assert_eq!(len, data.len()),
                VllmError::TrailingBytes { end, extra } => {
                    assert!(
                        extra > 0 && end.checked_add(extra) == Some(data.len()),
                        "{e}"
                    );
                }
                VllmError::Msgpack { offset, .. } => assert!(offset <= data.len(), "{e}"),
                _ => {}
            }
        }
    }
}

fn check_round_trip(batch: &EventBatch) {
    for e in &batch.events {
        if let EngineEvent::BlockStored(s) = e {
            assert!(s.block_size >= 1, "decoded block size 0");
        }
    }
    let bytes = batch.to_msgpack();
    let again = decode_event_batch(&bytes)
        .unwrap_or_else(|e| panic!("the re-encoded batch {batch:?} does not decode: {e}"));
    assert_eq!(again.events, batch.events);
    assert_eq!(again.data_parallel_rank, batch.data_parallel_rank);
    assert_eq!(again.timestamp.to_bits(), batch.timestamp.to_bits());
    assert_eq!(again.to_msgpack(), bytes, "encoding is not stable");
}

fn check_message(e: &VllmError) {
    let msg = e.to_string();
    assert!(
        !msg.is_empty() && msg.len() <= MAX_MESSAGE_LEN,
        "error message of {} bytes: {msg:.200}",
        msg.len()
    );
}

/// What a rejected message must leave as it was.
#[derive(Debug, PartialEq)]
struct State {
    snapshot: IndexSnapshot,
    pairs: usize,
    /// Blocks in the index's view and in every other cache group, per worker.
    views: [usize; 2],
    /// The index's view alone.
    index_views: [usize; 2],
    next_seq: [u64; 2],
    mapped: [usize; 2],
}

impl State {
    fn of(router: &Router, ingest: &VllmIngest) -> Self {
        State {
            snapshot: router.snapshot_index(),
            pairs: router.index().pairs(),
            views: WORKERS.map(|w| {
                router.cache_view(w)
                    + router
                        .groups(w)
                        .iter()
                        .filter_map(|&(g, _)| router.group_view(w, g))
                        .sum::<usize>()
            }),
            index_views: WORKERS.map(|w| router.cache_view(w)),
            next_seq: WORKERS.map(|w| ingest.next_seq(w)),
            mapped: WORKERS.map(|w| ingest.mapped_blocks(w)),
        }
    }
}

/// The messages of the input: the first with control byte 0, each later one after a separator
/// and its control byte.
fn messages(data: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    let mut ctl = 0;
    let mut rest = data;
    while out.len() < MAX_MESSAGES {
        match rest.iter().position(|&b| b == SEPARATOR) {
            Some(i) => {
                out.push((ctl, &rest[..i]));
                let Some((&next, tail)) = rest[i + 1..].split_first() else {
                    break;
                };
                ctl = next;
                rest = tail;
            }
            None => {
                out.push((ctl, rest));
                break;
            }
        }
    }
    out
}

fn check_ingest(data: &[u8]) {
    let mut router = Router::builder()
        .block_size(BlockSize::new(16).expect("16 is a block size"))
        .build()
        .expect("a router of block size 16");
    for w in WORKERS {
        router.add_worker(w);
    }
    let mut ingest = VllmIngest::new();
    for (ctl, payload) in messages(data) {
        apply_one(&mut router, &mut ingest, ctl, payload);
    }
}

fn apply_one(router: &mut Router, ingest: &mut VllmIngest, ctl: u8, payload: &[u8]) {
    let (slot, worker) = match ctl & 3 {
        1 => (Some(1), WORKERS[1]),
        3 => (None, UNREGISTERED),
        _ => (Some(0), WORKERS[0]),
    };
    let expected = ingest.next_seq(worker);
    let seq = match (ctl >> 2) & 7 {
        4 => expected.wrapping_add(1),
        5 => expected.wrapping_add(1000),
        6 => expected.wrapping_sub(1),
        7 => 0,
        _ => expected,
    };
    let call = match ctl >> 5 {
        4 => Call::Payload,
        5 => Call::PayloadNextSeq,
        6 => Call::ShortSeqFrame,
        7 => Call::FourFrames,
        _ => Call::Multipart,
    };
    let decoded = decode_event_batch(payload);
    let before = State::of(router, ingest);
    let stats_before = ingest.stats(worker);
    let seq_bytes = seq.to_be_bytes();
    let topic = b"kv-events";
    let result = match call {
        Call::Multipart => {
            ingest.apply_multipart(router, worker, &[&topic[..], &seq_bytes[..], payload])
        }
        Call::Payload => ingest.apply_payload(router, worker, Some(seq), payload),
        Call::PayloadNextSeq => ingest.apply_payload(router, worker, None, payload),
        Call::ShortSeqFrame => {
            ingest.apply_multipart(router, worker, &[&topic[..], &seq_bytes[1..], payload])
        }
        Call::FourFrames => ingest.apply_multipart(
            router,
            worker,
            &[&topic[..], &seq_bytes[..], payload, &b""[..]],
        ),
    };
    if let Err(e) = router.index().check_invariants() {
        panic!("index invariants after {call:?} of {worker} (seq {seq}): {e}");
    }
    let seq = if call == Call::PayloadNextSeq {
        expected
    } else {
        seq
    };
    let after = State::of(router, ingest);
    match result {
        Err(e) => {
            check_message(&e);
            assert_eq!(
                after, before,
                "{call:?} of {worker} failed ({e}) but changed state"
            );
            let frames_ok = matches!(call, Call::Multipart | Call::Payload | Call::PayloadNextSeq);
            match slot {
                None => assert!(
                    matches!(
                        e,
                        VllmError::FrameCount { .. }
                            | VllmError::Router(Error::UnknownWorker { .. })
                    ),
                    "unregistered {worker}: {e}"
                ),
                Some(_) => {
                    if frames_ok {
                        if let Err(d) = &decoded {
                            assert_eq!(&e, d, "{call:?}: not the decoder's error");
                        }
                    }
                    let counted = !matches!(e, VllmError::FrameCount { .. });
                    let mut want: IngestStats = stats_before;
                    want.rejected += u64::from(counted);
                    assert_eq!(ingest.stats(worker), want, "{call:?} of {worker}: {e}");
                }
            }
        }
        Ok(s) => {
            let Some(slot) = slot else {
                panic!("{call:?} of unregistered {worker} succeeded: {s:?}");
            };
            assert!(
                matches!(call, Call::Multipart | Call::Payload | Call::PayloadNextSeq),
                "{call:?} succeeded: {s:?}"
            );
            let batch = match &decoded {
                Ok(b) => b,
                Err(d) => panic!("applied a payload that does not decode ({d}): {s:?}"),
            };
            assert_eq!(s.events, batch.events.len(), "{s:?}");
            assert!(s.events_applied <= s.events, "{s:?}");
            assert_eq!(s.seq, seq, "{s:?}");
            assert_ne!(seq, u64::MAX, "the last number applied: {s:?}");
            assert_eq!(ingest.next_seq(worker), seq + 1, "{s:?}");
            assert_eq!(s.gap, (seq > expected).then_some((expected, seq)), "{s:?}");
            assert_eq!(s.restarted, seq < expected, "{s:?}");
            if seq < expected {
                assert_eq!(seq, 0, "a smaller number than expected applied: {s:?}");
            }
            let view = before.views[slot] as i128 + s.blocks_stored as i128
                - s.blocks_removed as i128
                - s.blocks_cleared as i128;
            assert_eq!(after.views[slot] as i128, view, "cache view after {s:?}");
            let pairs = before.pairs as i128 + after.index_views[slot] as i128
                - before.index_views[slot] as i128;
            assert_eq!(after.pairs as i128, pairs, "pair count after {s:?}");
            let other = 1 - slot;
            assert_eq!(after.views[other], before.views[other]);
            assert_eq!(after.next_seq[other], before.next_seq[other]);
            assert_eq!(after.mapped[other], before.mapped[other]);
            let stats = ingest.stats(worker);
            assert_eq!(stats.batches, stats_before.batches + 1);
            assert_eq!(stats.rejected, stats_before.rejected);
        }
    }
}
