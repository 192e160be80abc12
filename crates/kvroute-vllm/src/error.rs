//! [`VllmError`], and the helpers that make its messages name the offending value without
//! quoting all of it.

use kvcache::WorkerId;
use rmpv::Value;

/// Longest excerpt of a network-supplied string quoted in an error message.
pub(super) const QUOTE_MAX: usize = 48;

/// Errors of vLLM event ingestion. Each names the offending value and what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum VllmError {
    /// The payload ends inside a MessagePack value.
    #[error("vLLM event payload is truncated: its {len} byte(s) end inside a MessagePack value")]
    Truncated {
        /// The payload's length.
        len: usize,
    },
    /// The payload is not MessagePack (or nests deeper than the schema allows).
    #[error("vLLM event payload is not valid MessagePack at byte {offset}: {reason}")]
    Msgpack {
        /// Bytes read before the decoder gave up.
        offset: usize,
        /// What the decoder reported.
        reason: String,
    },
    /// Bytes follow the event batch.
    #[error(
        "vLLM event payload has {extra} byte(s) after the event batch, which ends at byte {end}"
    )]
    TrailingBytes {
        /// Where the batch ends.
        end: usize,
        /// How many bytes follow it.
        extra: usize,
    },
    /// A value of the wrong type or out of range.
    #[error("{at}: expected {expected}, got {got}")]
    Schema {
        /// Where, e.g. `events[2].token_ids[7]`.
        at: String,
        /// What the schema wants there.
        expected: &'static str,
        /// What was there.
        got: String,
    },
    /// A required field is absent.
    #[error("{at} ({event}): missing required field {field}")]
    MissingField {
        /// Which event, e.g. `events[0]`.
        at: String,
        /// The event's type.
        event: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// An event type this crate does not know.
    #[error(
        "{at}: unknown event type {got:?}: expected BlockStored, BlockRemoved or AllBlocksCleared"
    )]
    UnknownEventType {
        /// Which event, e.g. `events[0]`.
        at: String,
        /// The type given (shortened if long).
        got: String,
    },
    /// A `BlockStored` whose `extra_keys` list does not have one entry per block.
    #[error(
        "events[{event}] (BlockStored): {keys} extra_keys entries for {blocks} block hash(es): \
         expected one per block"
    )]
    ExtraKeysCountMismatch {
        /// The event's position in its batch.
        event: usize,
        /// Entries in `extra_keys`.
        keys: usize,
        /// Entries in `block_hashes`.
        blocks: usize,
    },
    /// A `BlockStored` at another block size than the router's: its blocks could never match.
    #[error(
        "events[{event}] (BlockStored): block size {engine} does not match the router's block \
         size {router}"
    )]
    BlockSizeMismatch {
        /// The event's position in its batch.
        event: usize,
        /// The engine's block size.
        engine: u64,
        /// The router's block size.
        router: usize,
    },
    /// A `BlockStored` whose token ids do not fill exactly its blocks.
    #[error(
        "events[{event}] (BlockStored): {tokens} token id(s) for {blocks} block(s) of \
         {block_size} tokens: expected {expected}"
    )]
    TokenCountMismatch {
        /// The event's position in its batch.
        event: usize,
        /// Token ids given.
        tokens: usize,
        /// Block hashes given.
        blocks: usize,
        /// Tokens per block.
        block_size: u64,
        /// `blocks * block_size`.
        expected: u64,
    },
    /// A multipart message without exactly three frames.
    #[error("expected 3 ZMQ frames (topic, sequence number, payload), got {got}")]
    FrameCount {
        /// Frames given.
        got: usize,
    },
    /// A sequence-number frame that is not 8 bytes.
    #[error("sequence number frame is {len} byte(s): expected an 8-byte big-endian number")]
    SequenceFrame {
        /// The frame's length.
        len: usize,
    },
    /// A batch sequence number already applied for this worker. Nothing was applied.
    #[error(
        "{worker}: batch sequence number {got} already seen (expected {expected}); not applied"
    )]
    DuplicateSequence {
        /// The worker.
        worker: WorkerId,
        /// The batch's sequence number.
        got: u64,
        /// The next one expected.
        expected: u64,
    },
    /// A batch numbered `u64::MAX`: sequence numbers run from 0 to 2^64 - 2, so that the one
    /// after every applied batch fits. Nothing was applied.
    #[error("{worker}: batch sequence number 18446744073709551615 (u64::MAX) is out of range: numbers run from 0 to 2^64 - 2; not applied")]
    SequenceOutOfRange {
        /// The worker.
        worker: WorkerId,
    },
    /// A [`MirrorSnapshot`](super::MirrorSnapshot) that cannot be restored.
    #[error("bad mirror snapshot: {why}")]
    BadSnapshot {
        /// What is wrong with it.
        why: String,
    },
    /// The router refused the batch (for example an unregistered worker).
    #[error(transparent)]
    Router(#[from] kvroute::Error),
}

pub(super) fn schema(at: String, expected: &'static str, got: &Value) -> VllmError {
    VllmError::Schema {
        at,
        expected,
        got: describe(got),
    }
}

/// A short description of a value for an error message (never the whole value: it comes from
/// the network and may be large).
fn describe(v: &Value) -> String {
    match v {
        Value::Nil => "nil".into(),
        Value::Boolean(b) => format!("boolean {b}"),
        Value::Integer(i) => format!("integer {i}"),
        Value::F32(x) => format!("float {x}"),
        Value::F64(x) => format!("float {x}"),
        Value::String(s) => match s.as_str() {
            Some(s) => format!("string {:?}", clip(s)),
            None => format!("a string of {} bytes that is not UTF-8", s.as_bytes().len()),
        },
        Value::Binary(b) => format!("{} bytes of binary", b.len()),
        Value::Array(a) => format!("an array of {} element(s)", a.len()),
        Value::Map(m) => format!("a map of {} entr(ies)", m.len()),
        Value::Ext(t, d) => format!("an extension value (type {t}, {} bytes)", d.len()),
    }
}

pub(super) fn clip(s: &str) -> String {
    match s.char_indices().nth(QUOTE_MAX) {
        Some((cut, _)) => format!("{}...", &s[..cut]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode_event_batch;

    #[test]
    fn errors_name_the_value() {
        let e = decode_event_batch(&[0x07]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "batch: expected an event batch [timestamp, events, data_parallel_rank], got integer 7"
        );
        assert_eq!(clip(&"x".repeat(100)).len(), QUOTE_MAX + 3);
        assert_eq!(clip("é".repeat(60).as_str()).chars().count(), QUOTE_MAX + 3);
    }
}
