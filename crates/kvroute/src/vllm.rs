//! vLLM KV-event ingestion (feature `vllm`): decode the engine's MessagePack event batches and
//! apply them to a [`Router`].
//!
//! vLLM (`--kv-events-config` with the ZMQ publisher) sends one ZMQ multipart message per batch of
//! cache changes: `(topic, 8-byte big-endian sequence number, payload)`, where the payload is a
//! MessagePack `EventBatch`:
//!
//! ```text
//! [timestamp, [event, ...], data_parallel_rank?]
//! BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?, lora_name?
//! BlockRemoved     block_hashes, medium?
//! AllBlocksCleared
//! ```
//!
//! Each event is either an array whose first element names it (`["BlockStored", [...], ...]`,
//! msgspec's tagged array form) or a map with a `"type"` key and the fields by name. Engine block
//! hashes are integers (a negative `i64` is taken as its bit pattern) or byte strings. Extra fields
//! and trailing elements are ignored, so newer engines still decode.
//!
//! Engine hashes are not ours: vLLM hashes with its own function (and may mix in multimodal
//! inputs or a cache salt). [`VllmIngest`] therefore re-hashes each stored block's `token_ids`
//! with [`kvblock`] at the router's block size (salted with `lora_name`), chained from *our* hash
//! of the engine's parent, and remembers engine hash -> our hash per worker so that a later
//! `BlockRemoved` can name the same blocks.
//!
//! ```
//! use kvblock::{BlockHasher, BlockSize};
//! use kvroute::vllm::{BlockStored, EngineEvent, EngineHash, EventBatch, VllmIngest};
//! use kvroute::{Role, Router, WorkerId};
//!
//! let mut router = Router::builder().block_size(BlockSize::new(4)?).build()?;
//! let (w0, w1) = (WorkerId::new(0), WorkerId::new(1));
//! router.add_worker(w0);
//! router.add_worker(w1);
//!
//! // Worker 0's engine stored the 3 blocks of these 12 tokens under its own hashes 11, 12, 13.
//! let tokens: Vec<u32> = (100..112).collect();
//! let stored = BlockStored::new(
//!     vec![EngineHash::Int(11), EngineHash::Int(12), EngineHash::Int(13)],
//!     None,
//!     tokens.clone(),
//!     4,
//! );
//! let payload = EventBatch::new(0.5, vec![EngineEvent::BlockStored(stored)]).to_msgpack();
//!
//! // The ZMQ frames: topic, sequence number, payload.
//! let mut ingest = VllmIngest::new();
//! let seq = 0u64.to_be_bytes();
//! let summary = ingest.apply_multipart(&mut router, w0, &[&b""[..], &seq[..], &payload[..]])?;
//! assert_eq!((summary.events_applied, summary.blocks_stored), (1, 3));
//!
//! // The router now finds the prefix on worker 0.
//! let d = router.route_tokens(1, &tokens, Role::Unified)?;
//! assert_eq!((d.worker, d.cache_hits), (w0, 3));
//! let ours = BlockHasher::new(router.block_size()).sequence_hashes(&tokens);
//! assert_eq!(ingest.our_hash(w0, &EngineHash::Int(13)), Some(ours[2]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Sequence numbers and router event ids
//!
//! The router's index wants one id per [`KvEvent`] (0, 1, 2, ... per worker) while a batch has
//! one sequence number and any number of events. [`VllmIngest`] numbers the router events itself
//! and uses the batch sequence number only to detect trouble:
//!
//! - the expected number (the previous one plus 1; 0 at first): applied normally;
//! - a larger one (batches were missed): applied, and one router id is skipped so the index
//!   records a gap and marks the worker possibly stale;
//! - 0 when a larger one was expected (the publisher restarted): the worker's blocks are cleared
//!   and the batch is applied as the first of a new stream;
//! - any other smaller one (a duplicate or a replay): rejected with
//!   [`VllmError::DuplicateSequence`].
//!
//! A batch that does not decode or validate is rejected whole before anything changes, and its
//! sequence number is not consumed.
//!
//! # Limits
//!
//! - A `BlockStored` whose engine parent was never seen (the router joined late, or batches were
//!   missed) cannot be re-hashed, because our hash of a block depends on our hash of its parent:
//!   it is skipped, counted in [`IngestSummary::unknown_parents`], and the worker is marked
//!   possibly stale (the next router event id is skipped).
//! - `lora_id` without `lora_name` hashes as no adapter. [`Router::route_tokens`] hashes without a
//!   LoRA salt; route LoRA requests with [`Router::route`] and a salted [`BlockHasher`].
//! - `medium` and `data_parallel_rank` are decoded but not interpreted: give each data-parallel
//!   rank (or each medium you track) its own [`WorkerId`].
//! - The engine-to-ours map of a worker grows by the blocks stored and shrinks by the blocks
//!   removed; removals lost in missed batches stay until the worker is cleared (by an
//!   `AllBlocksCleared`, a publisher restart, or [`VllmIngest::forget_worker`]).

use std::fmt;

use kvblock::{BlockHash, BlockHasher};
use kvcache::{FixedState, KvEvent, WorkerId};
use rmpv::Value;

use crate::Router;

type Map<K, V> = hashbrown::HashMap<K, V, FixedState>;

/// The deepest MessagePack nesting accepted. The schema needs about 11 levels (the decoder counts
/// containers and strings); the bound keeps hostile input from exhausting the stack.
const MAX_DEPTH: usize = 64;

/// Longest excerpt of a network-supplied string quoted in an error message.
const QUOTE_MAX: usize = 48;

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
    /// The router refused the batch (for example an unregistered worker).
    #[error(transparent)]
    Router(#[from] crate::Error),
}

/// A block hash as the engine names it: opaque, and never equal to ours.
///
/// ```
/// use kvroute::vllm::EngineHash;
/// assert_eq!(EngineHash::from(7u64).to_string(), "7");
/// assert_eq!(EngineHash::from(-1i64), EngineHash::Int(u64::MAX)); // the i64 bit pattern
/// assert_eq!(EngineHash::from(&[0xab, 0x01][..]).to_string(), "0xab01");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EngineHash {
    /// An integer hash; a negative `i64` on the wire is kept as its two's-complement bits.
    Int(u64),
    /// A byte-string hash (MessagePack bin, or str taken as its bytes).
    Bytes(Vec<u8>),
}

impl From<u64> for EngineHash {
    fn from(v: u64) -> Self {
        EngineHash::Int(v)
    }
}

impl From<i64> for EngineHash {
    fn from(v: i64) -> Self {
        EngineHash::Int(v as u64)
    }
}

impl From<Vec<u8>> for EngineHash {
    fn from(v: Vec<u8>) -> Self {
        EngineHash::Bytes(v)
    }
}

impl From<&[u8]> for EngineHash {
    fn from(v: &[u8]) -> Self {
        EngineHash::Bytes(v.to_vec())
    }
}

impl fmt::Display for EngineHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineHash::Int(v) => write!(f, "{v}"),
            EngineHash::Bytes(b) => {
                f.write_str("0x")?;
                b.iter().try_for_each(|x| write!(f, "{x:02x}"))
            }
        }
    }
}

/// vLLM's `BlockStored`: a chain of full blocks became resident.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockStored {
    /// The engine's hashes of the new blocks, parent first.
    pub block_hashes: Vec<EngineHash>,
    /// The engine's hash of the block the chain extends (`None`: it starts a prompt).
    pub parent_block_hash: Option<EngineHash>,
    /// The blocks' tokens: exactly `block_hashes.len() * block_size` of them.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u64,
    /// The engine's LoRA adapter id (informational; `lora_name` salts the hash).
    pub lora_id: Option<i64>,
    /// Where the blocks live (`"GPU"`, `"CPU"`, ...), if the engine says.
    pub medium: Option<String>,
    /// The LoRA adapter's name, which salts our block hashes.
    pub lora_name: Option<String>,
}

impl BlockStored {
    /// A `BlockStored` without LoRA adapter or medium (set the public fields for those).
    pub fn new(
        block_hashes: Vec<EngineHash>,
        parent_block_hash: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: u64,
    ) -> Self {
        BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: None,
            lora_name: None,
        }
    }
}

/// vLLM's `BlockRemoved`: blocks were evicted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Where the blocks lived, if the engine says.
    pub medium: Option<String>,
}

impl BlockRemoved {
    /// A `BlockRemoved` without medium.
    pub fn new(block_hashes: Vec<EngineHash>) -> Self {
        BlockRemoved {
            block_hashes,
            medium: None,
        }
    }
}

/// One event of a vLLM [`EventBatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineEvent {
    /// Blocks became resident.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// Every block was dropped.
    AllBlocksCleared,
}

impl EngineEvent {
    /// The event's type name on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            EngineEvent::BlockStored(_) => STORED,
            EngineEvent::BlockRemoved(_) => REMOVED,
            EngineEvent::AllBlocksCleared => CLEARED,
        }
    }
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";
const CLEARED: &str = "AllBlocksCleared";

/// One vLLM event batch: the payload of one published message.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EventBatch {
    /// The engine's wall-clock time of the batch, in seconds.
    pub timestamp: f64,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published the batch, if any.
    pub data_parallel_rank: Option<i64>,
}

impl EventBatch {
    /// A batch without a data-parallel rank.
    pub fn new(timestamp: f64, events: Vec<EngineEvent>) -> Self {
        EventBatch {
            timestamp,
            events,
            data_parallel_rank: None,
        }
    }

    /// Encodes the batch as vLLM does: the positional (tagged array) shape, with every field,
    /// `data_parallel_rank` last only when set. [`decode_event_batch`] reads it back.
    pub fn to_msgpack(&self) -> Vec<u8> {
        let opt_str = |s: &Option<String>| s.as_deref().map_or(Value::Nil, Value::from);
        let hashes = |hs: &[EngineHash]| Value::Array(hs.iter().map(hash_value).collect());
        let events = self
            .events
            .iter()
            .map(|e| {
                let mut v = vec![Value::from(e.name())];
                match e {
                    EngineEvent::BlockStored(s) => v.extend([
                        hashes(&s.block_hashes),
                        s.parent_block_hash.as_ref().map_or(Value::Nil, hash_value),
                        Value::Array(s.token_ids.iter().map(|&t| Value::from(t)).collect()),
                        Value::from(s.block_size),
                        s.lora_id.map_or(Value::Nil, Value::from),
                        opt_str(&s.medium),
                        opt_str(&s.lora_name),
                    ]),
                    EngineEvent::BlockRemoved(r) => {
                        v.extend([hashes(&r.block_hashes), opt_str(&r.medium)]);
                    }
                    EngineEvent::AllBlocksCleared => {}
                }
                Value::Array(v)
            })
            .collect();
        let mut batch = vec![Value::F64(self.timestamp), Value::Array(events)];
        if let Some(rank) = self.data_parallel_rank {
            batch.push(Value::from(rank));
        }
        let mut out = Vec::new();
        if rmpv::encode::write_value(&mut out, &Value::Array(batch)).is_err() {
            // Writing to a Vec cannot fail; an empty payload would be rejected when decoded.
            out.clear();
        }
        out
    }
}

fn hash_value(h: &EngineHash) -> Value {
    match h {
        EngineHash::Int(v) => Value::from(*v),
        EngineHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

/// Reads a sequence-number frame: exactly 8 bytes, big-endian.
///
/// ```
/// assert_eq!(kvroute::vllm::parse_seq_frame(&7u64.to_be_bytes())?, 7);
/// assert!(kvroute::vllm::parse_seq_frame(&[0, 7]).is_err());
/// # Ok::<(), kvroute::vllm::VllmError>(())
/// ```
pub fn parse_seq_frame(frame: &[u8]) -> Result<u64, VllmError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| VllmError::SequenceFrame { len: frame.len() })
}

/// Decodes one vLLM MessagePack event batch (either event shape, either hash encoding).
///
/// ```
/// use kvroute::vllm::{decode_event_batch, EngineEvent};
/// // [1.5, [["AllBlocksCleared"]]] in MessagePack.
/// let payload = [0x92, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x91,
///     0xb0, b'A', b'l', b'l', b'B', b'l', b'o', b'c', b'k', b's',
///     b'C', b'l', b'e', b'a', b'r', b'e', b'd'];
/// let batch = decode_event_batch(&payload)?;
/// assert_eq!(batch.timestamp, 1.5);
/// assert_eq!(batch.events, [EngineEvent::AllBlocksCleared]);
/// assert!(decode_event_batch(&payload[..12]).is_err()); // truncated
/// # Ok::<(), kvroute::vllm::VllmError>(())
/// ```
pub fn decode_event_batch(payload: &[u8]) -> Result<EventBatch, VllmError> {
    let mut rest = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rest, MAX_DEPTH).map_err(|e| {
        let offset = payload.len().saturating_sub(rest.len());
        match e {
            rmpv::decode::Error::DepthLimitExceeded => VllmError::Msgpack {
                offset,
                reason: format!("nested deeper than {MAX_DEPTH} levels"),
            },
            e if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                VllmError::Truncated { len: payload.len() }
            }
            e => VllmError::Msgpack {
                offset,
                reason: e.to_string(),
            },
        }
    })?;
    if !rest.is_empty() {
        return Err(VllmError::TrailingBytes {
            end: payload.len() - rest.len(),
            extra: rest.len(),
        });
    }
    batch_from_value(value)
}

fn batch_from_value(value: Value) -> Result<EventBatch, VllmError> {
    const BATCH: &str = "an event batch [timestamp, events, data_parallel_rank]";
    let Value::Array(items) = value else {
        return Err(schema("batch".into(), BATCH, &value));
    };
    let mut it = items.into_iter();
    let missing = |field| VllmError::MissingField {
        at: "batch".into(),
        event: "EventBatch",
        field,
    };
    let timestamp = match it.next().ok_or_else(|| missing("timestamp"))? {
        Value::F64(x) => x,
        Value::F32(x) => f64::from(x),
        Value::Integer(i) => i.as_f64().unwrap_or_default(),
        other => return Err(schema("batch[0]".into(), "a timestamp (a number)", &other)),
    };
    let events = match it.next().ok_or_else(|| missing("events"))? {
        Value::Array(evs) => evs
            .into_iter()
            .enumerate()
            .map(|(i, v)| event_from_value(i, v))
            .collect::<Result<Vec<_>, _>>()?,
        other => return Err(schema("batch[1]".into(), "a list of events", &other)),
    };
    let data_parallel_rank = opt_i64("batch[2]", it.next())?;
    Ok(EventBatch {
        timestamp,
        events,
        data_parallel_rank,
    })
}

#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

/// An event's fields before conversion, filled by position or by name.
#[derive(Default)]
struct Raw {
    block_hashes: Option<Value>,
    parent_block_hash: Option<Value>,
    token_ids: Option<Value>,
    block_size: Option<Value>,
    lora_id: Option<Value>,
    medium: Option<Value>,
    lora_name: Option<Value>,
}

fn event_from_value(i: usize, v: Value) -> Result<EngineEvent, VllmError> {
    let at = format!("events[{i}]");
    let (kind, raw) = match v {
        Value::Array(items) => positional(&at, items)?,
        Value::Map(entries) => named(&at, entries)?,
        other => {
            return Err(schema(
                at,
                "an event (a tagged array or a map with a \"type\" key)",
                &other,
            ))
        }
    };
    build(at, kind, raw)
}

fn kind_of(at: String, v: &Value) -> Result<Kind, VllmError> {
    let name = match v {
        Value::String(s) => s.as_str(),
        _ => None,
    };
    match name {
        Some(STORED) => Ok(Kind::Stored),
        Some(REMOVED) => Ok(Kind::Removed),
        Some(CLEARED) => Ok(Kind::Cleared),
        Some(other) => Err(VllmError::UnknownEventType {
            at,
            got: clip(other),
        }),
        None => Err(schema(at, "an event type name (a string)", v)),
    }
}

fn positional(at: &str, items: Vec<Value>) -> Result<(Kind, Raw), VllmError> {
    let mut it = items.into_iter();
    let Some(tag) = it.next() else {
        return Err(VllmError::Schema {
            at: at.into(),
            expected: "an event type name first",
            got: "an empty array".into(),
        });
    };
    let kind = kind_of(format!("{at}[0]"), &tag)?;
    let mut raw = Raw::default();
    // Trailing elements beyond the known fields are ignored (newer engines add fields).
    match kind {
        Kind::Stored => {
            raw.block_hashes = it.next();
            raw.parent_block_hash = it.next();
            raw.token_ids = it.next();
            raw.block_size = it.next();
            raw.lora_id = it.next();
            raw.medium = it.next();
            raw.lora_name = it.next();
        }
        Kind::Removed => {
            raw.block_hashes = it.next();
            raw.medium = it.next();
        }
        Kind::Cleared => {}
    }
    Ok((kind, raw))
}

fn named(at: &str, entries: Vec<(Value, Value)>) -> Result<(Kind, Raw), VllmError> {
    let mut raw = Raw::default();
    let mut tag = None;
    for (k, v) in entries {
        // Keys that are not strings, and names this crate does not know, are ignored.
        let slot = match k.as_str() {
            Some("type") => &mut tag,
            Some("block_hashes") => &mut raw.block_hashes,
            Some("parent_block_hash") => &mut raw.parent_block_hash,
            Some("token_ids") => &mut raw.token_ids,
            Some("block_size") => &mut raw.block_size,
            Some("lora_id") => &mut raw.lora_id,
            Some("medium") => &mut raw.medium,
            Some("lora_name") => &mut raw.lora_name,
            _ => continue,
        };
        *slot = Some(v);
    }
    let Some(tag) = tag else {
        return Err(VllmError::MissingField {
            at: at.into(),
            event: "event",
            field: "type",
        });
    };
    Ok((kind_of(format!("{at}.type"), &tag)?, raw))
}

fn build(at: String, kind: Kind, raw: Raw) -> Result<EngineEvent, VllmError> {
    let required = |v: Option<Value>, event, field| {
        v.ok_or_else(|| VllmError::MissingField {
            at: at.clone(),
            event,
            field,
        })
    };
    match kind {
        Kind::Stored => {
            let hashes = required(raw.block_hashes, STORED, "block_hashes")?;
            let parent = required(raw.parent_block_hash, STORED, "parent_block_hash")?;
            let tokens = required(raw.token_ids, STORED, "token_ids")?;
            let block_size = required(raw.block_size, STORED, "block_size")?;
            Ok(EngineEvent::BlockStored(BlockStored {
                block_hashes: hash_list(&format!("{at}.block_hashes"), hashes)?,
                parent_block_hash: match parent {
                    Value::Nil => None,
                    v => Some(engine_hash(|| format!("{at}.parent_block_hash"), v)?),
                },
                token_ids: token_list(&format!("{at}.token_ids"), tokens)?,
                block_size: match block_size.as_u64() {
                    Some(n) if n > 0 => n,
                    _ => {
                        return Err(schema(
                            format!("{at}.block_size"),
                            "a block size of at least 1 token",
                            &block_size,
                        ))
                    }
                },
                lora_id: opt_i64(&format!("{at}.lora_id"), raw.lora_id)?,
                medium: opt_string(&format!("{at}.medium"), raw.medium)?,
                lora_name: opt_string(&format!("{at}.lora_name"), raw.lora_name)?,
            }))
        }
        Kind::Removed => {
            let hashes = required(raw.block_hashes, REMOVED, "block_hashes")?;
            Ok(EngineEvent::BlockRemoved(BlockRemoved {
                block_hashes: hash_list(&format!("{at}.block_hashes"), hashes)?,
                medium: opt_string(&format!("{at}.medium"), raw.medium)?,
            }))
        }
        Kind::Cleared => Ok(EngineEvent::AllBlocksCleared),
    }
}

fn engine_hash(at: impl FnOnce() -> String, v: Value) -> Result<EngineHash, VllmError> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(EngineHash::Int(u)),
            (None, Some(s)) => Ok(EngineHash::from(s)),
            (None, None) => Err(schema(at(), "an integer block hash", &Value::Integer(i))),
        },
        Value::Binary(b) => Ok(EngineHash::Bytes(b)),
        Value::String(s) => Ok(EngineHash::Bytes(s.into_bytes())),
        other => Err(schema(
            at(),
            "a block hash (an integer or a byte string)",
            &other,
        )),
    }
}

fn hash_list(at: &str, v: Value) -> Result<Vec<EngineHash>, VllmError> {
    match v {
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(k, h)| engine_hash(|| format!("{at}[{k}]"), h))
            .collect(),
        other => Err(schema(at.into(), "a list of block hashes", &other)),
    }
}

fn token_list(at: &str, v: Value) -> Result<Vec<u32>, VllmError> {
    match v {
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(k, t)| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        schema(format!("{at}[{k}]"), "a token id from 0 to 4294967295", t)
                    })
            })
            .collect(),
        other => Err(schema(at.into(), "a list of token ids", &other)),
    }
}

fn opt_i64(at: &str, v: Option<Value>) -> Result<Option<i64>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| schema(at.into(), "a 64-bit signed integer or nil", &v)),
    }
}

fn opt_string(at: &str, v: Option<Value>) -> Result<Option<String>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) if s.is_str() => Ok(s.into_str()),
        Some(v) => Err(schema(at.into(), "a UTF-8 string or nil", &v)),
    }
}

fn schema(at: String, expected: &'static str, got: &Value) -> VllmError {
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

fn clip(s: &str) -> String {
    match s.char_indices().nth(QUOTE_MAX) {
        Some((cut, _)) => format!("{}...", &s[..cut]),
        None => s.to_string(),
    }
}

/// What one call of [`VllmIngest`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IngestSummary {
    /// The batch's sequence number (as given, or the expected one).
    pub seq: u64,
    /// Engine events in the batch.
    pub events: usize,
    /// Events applied to the router (an event naming no known block is not applied).
    pub events_applied: usize,
    /// Blocks newly recorded as resident.
    pub blocks_stored: usize,
    /// Stored blocks the router already knew the worker held.
    pub already_present: usize,
    /// Blocks removed, by `BlockRemoved`.
    pub blocks_removed: usize,
    /// Blocks dropped by `AllBlocksCleared` or by a publisher restart.
    pub blocks_cleared: usize,
    /// Removed engine hashes that were never stored (or already removed): skipped.
    pub unknown_removals: usize,
    /// `BlockStored` events whose parent was never seen: skipped, and the worker marked stale.
    pub unknown_parents: usize,
    /// `Some((expected, got))` when batches were missed: applied, and the worker marked stale.
    pub gap: Option<(u64, u64)>,
    /// The publisher restarted (sequence number 0 again): the worker was cleared first.
    pub restarted: bool,
}

/// Running totals of one worker's vLLM feed, since [`VllmIngest`] first saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IngestStats {
    /// Batches applied.
    pub batches: u64,
    /// Batches rejected (malformed, invalid or duplicate).
    pub rejected: u64,
    /// Engine events in applied batches.
    pub events: u64,
    /// Blocks newly recorded as resident.
    pub blocks_stored: u64,
    /// Blocks removed by `BlockRemoved`.
    pub blocks_removed: u64,
    /// Blocks dropped by clears and restarts.
    pub blocks_cleared: u64,
    /// Removed engine hashes never stored.
    pub unknown_removals: u64,
    /// `BlockStored` events skipped for an unknown parent.
    pub unknown_parents: u64,
    /// Batches that followed missed ones.
    pub gaps: u64,
    /// Publisher restarts.
    pub restarts: u64,
}

impl IngestStats {
    fn add(&mut self, s: &IngestSummary) {
        self.batches += 1;
        self.events += s.events as u64;
        self.blocks_stored += s.blocks_stored as u64;
        self.blocks_removed += s.blocks_removed as u64;
        self.blocks_cleared += s.blocks_cleared as u64;
        self.unknown_removals += s.unknown_removals as u64;
        self.unknown_parents += s.unknown_parents as u64;
        self.gaps += u64::from(s.gap.is_some());
        self.restarts += u64::from(s.restarted);
    }
}

#[derive(Debug, Clone, Default)]
struct Feed {
    /// Engine hash -> our hash, for the blocks the worker holds.
    blocks: Map<EngineHash, BlockHash>,
    /// The next batch sequence number expected.
    next_seq: u64,
    /// Skip one router event id at the next apply, so the index records a gap (stale view).
    skip_id: bool,
    totals: IngestStats,
}

/// Applies vLLM event batches to a [`Router`], one feed per worker: engine-to-ours hash maps,
/// sequence checking and counters. See the [module docs](self) for the rules.
///
/// Keep one `VllmIngest` beside each `Router` (for example in the same mutex). When a worker is
/// removed from the router, call [`forget_worker`](Self::forget_worker) too.
#[derive(Debug, Clone, Default)]
pub struct VllmIngest {
    feeds: Map<WorkerId, Feed>,
}

impl VllmIngest {
    /// An adapter that knows no worker yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one ZMQ multipart message `(topic, sequence number, payload)` of `worker`'s
    /// publisher. The topic is not interpreted.
    pub fn apply_multipart<F: AsRef<[u8]>>(
        &mut self,
        router: &mut Router,
        worker: WorkerId,
        frames: &[F],
    ) -> Result<IngestSummary, VllmError> {
        let [_topic, seq, payload] = frames else {
            return Err(VllmError::FrameCount { got: frames.len() });
        };
        let seq = parse_seq_frame(seq.as_ref());
        let seq = self.counting_rejects(router, worker, seq)?;
        self.apply_payload(router, worker, Some(seq), payload.as_ref())
    }

    /// Decodes and applies one MessagePack payload of `worker`, with its batch sequence number
    /// (`None`: the next one expected).
    pub fn apply_payload(
        &mut self,
        router: &mut Router,
        worker: WorkerId,
        seq: Option<u64>,
        payload: &[u8],
    ) -> Result<IngestSummary, VllmError> {
        let batch = decode_event_batch(payload);
        let batch = self.counting_rejects(router, worker, batch)?;
        self.apply_batch(router, worker, seq, &batch)
    }

    /// Applies one decoded batch of `worker`, with its sequence number (`None`: the next one
    /// expected). The whole batch is validated first: on an error nothing was applied and the
    /// sequence number was not consumed.
    pub fn apply_batch(
        &mut self,
        router: &mut Router,
        worker: WorkerId,
        seq: Option<u64>,
        batch: &EventBatch,
    ) -> Result<IngestSummary, VllmError> {
        let checked = validate(batch, router.block_size().get());
        self.counting_rejects(router, worker, checked)?;
        let feed = self.feeds.entry(worker).or_default();
        let expected = feed.next_seq;
        let seq = seq.unwrap_or(expected);
        let mut out = IngestSummary {
            seq,
            events: batch.events.len(),
            ..IngestSummary::default()
        };
        if seq > expected {
            out.gap = Some((expected, seq));
            feed.skip_id = true;
        } else if seq < expected {
            if seq != 0 {
                feed.totals.rejected += 1;
                return Err(VllmError::DuplicateSequence {
                    worker,
                    got: seq,
                    expected,
                });
            }
            // The publisher restarted: whatever we mirrored may be gone.
            out.restarted = true;
            out.blocks_cleared += router.clear_worker(worker);
            feed.blocks.clear();
            feed.skip_id = false;
        }
        feed.next_seq = seq.saturating_add(1);
        let bs = router.block_size();
        for event in &batch.events {
            match event {
                EngineEvent::BlockStored(s) => {
                    let parent = match &s.parent_block_hash {
                        None => None,
                        Some(h) => match feed.blocks.get(h) {
                            Some(&p) => Some(p),
                            None => {
                                out.unknown_parents += 1;
                                feed.skip_id = true;
                                continue;
                            }
                        },
                    };
                    if s.block_hashes.is_empty() {
                        continue;
                    }
                    let hasher =
                        BlockHasher::new(bs).with_lora_name(s.lora_name.as_deref().unwrap_or(""));
                    let mut blocks = Vec::with_capacity(s.block_hashes.len());
                    hasher.sequence_hashes_into(parent, &s.token_ids, &mut blocks);
                    let ev = KvEvent::Stored { parent, blocks };
                    match apply(router, worker, feed, &ev) {
                        Ok(a) => {
                            out.events_applied += 1;
                            out.blocks_stored += a.stored;
                            out.already_present += a.already_present;
                            if let KvEvent::Stored { blocks, .. } = ev {
                                // `validate` checked one token block per engine hash.
                                for (e, ours) in s.block_hashes.iter().zip(blocks) {
                                    feed.blocks.insert(e.clone(), ours);
                                }
                            }
                        }
                        // The index no longer holds the parent: it consumed the id and marked
                        // the worker stale.
                        Err(crate::Error::Index(kvcache::Error::UnknownParent { .. })) => {
                            out.unknown_parents += 1;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                EngineEvent::BlockRemoved(r) => {
                    let mut blocks = Vec::with_capacity(r.block_hashes.len());
                    for h in &r.block_hashes {
                        match feed.blocks.remove(h) {
                            Some(ours) => blocks.push(ours),
                            None => out.unknown_removals += 1,
                        }
                    }
                    if !blocks.is_empty() {
                        let a = apply(router, worker, feed, &KvEvent::Removed { blocks })?;
                        out.events_applied += 1;
                        out.blocks_removed += a.removed;
                        out.unknown_removals += a.unknown_removed;
                    }
                }
                EngineEvent::AllBlocksCleared => {
                    let a = apply(router, worker, feed, &KvEvent::Cleared)?;
                    out.events_applied += 1;
                    out.blocks_cleared += a.removed;
                    feed.blocks.clear();
                }
            }
        }
        feed.totals.add(&out);
        Ok(out)
    }

    /// Counts a rejected batch of a registered worker, and checks the worker is registered.
    fn counting_rejects<T>(
        &mut self,
        router: &Router,
        worker: WorkerId,
        r: Result<T, VllmError>,
    ) -> Result<T, VllmError> {
        if router.index().worker_index(worker).is_none() {
            return Err(crate::Error::UnknownWorker { worker }.into());
        }
        if r.is_err() {
            self.feeds.entry(worker).or_default().totals.rejected += 1;
        }
        r
    }

    /// Forgets `worker`'s feed (hash map, expected sequence number, totals), for example after
    /// removing it from the router. Returns whether it was known.
    pub fn forget_worker(&mut self, worker: WorkerId) -> bool {
        self.feeds.remove(&worker).is_some()
    }

    /// The next batch sequence number expected from `worker` (0 for a new one).
    pub fn next_seq(&self, worker: WorkerId) -> u64 {
        self.feeds.get(&worker).map_or(0, |f| f.next_seq)
    }

    /// Our hash of a block the worker's engine names `engine`, while it is resident.
    pub fn our_hash(&self, worker: WorkerId, engine: &EngineHash) -> Option<BlockHash> {
        self.feeds.get(&worker)?.blocks.get(engine).copied()
    }

    /// How many engine hashes of `worker` are mapped to ours (its resident blocks, as reported).
    pub fn mapped_blocks(&self, worker: WorkerId) -> usize {
        self.feeds.get(&worker).map_or(0, |f| f.blocks.len())
    }

    /// `worker`'s running totals (all zero for an unknown worker).
    pub fn stats(&self, worker: WorkerId) -> IngestStats {
        self.feeds
            .get(&worker)
            .map_or_else(IngestStats::default, |f| f.totals)
    }

    /// Workers with a feed, in id order.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut w: Vec<WorkerId> = self.feeds.keys().copied().collect();
        w.sort_unstable();
        w
    }
}

/// Applies one router event with the next router event id of `worker` (skipping one when the
/// feed asks for a gap).
fn apply(
    router: &mut Router,
    worker: WorkerId,
    feed: &mut Feed,
    event: &KvEvent,
) -> Result<kvcache::Applied, crate::Error> {
    // The index's own counter, so events applied to the router directly do not collide.
    let next = router.index().next_event_id(worker).unwrap_or(0);
    let id = next.saturating_add(u64::from(std::mem::take(&mut feed.skip_id)));
    router.apply_event(worker, id, event)
}

/// Checks what can be checked without state: block sizes and token counts.
fn validate(batch: &EventBatch, router_block_size: usize) -> Result<(), VllmError> {
    for (i, e) in batch.events.iter().enumerate() {
        let EngineEvent::BlockStored(s) = e else {
            continue;
        };
        if usize::try_from(s.block_size).ok() != Some(router_block_size) {
            return Err(VllmError::BlockSizeMismatch {
                event: i,
                engine: s.block_size,
                router: router_block_size,
            });
        }
        let expected = (s.block_hashes.len() as u64).saturating_mul(s.block_size);
        if s.token_ids.len() as u64 != expected {
            return Err(VllmError::TokenCountMismatch {
                event: i,
                tokens: s.token_ids.len(),
                blocks: s.block_hashes.len(),
                block_size: s.block_size,
                expected,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn sequence_frame_must_be_eight_bytes() {
        assert_eq!(
            parse_seq_frame(&[1, 2, 3]),
            Err(VllmError::SequenceFrame { len: 3 })
        );
        assert_eq!(parse_seq_frame(&258u64.to_be_bytes()), Ok(258));
    }
}
