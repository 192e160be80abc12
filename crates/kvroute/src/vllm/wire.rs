//! The engine's wire types ([`EventBatch`], its events, [`EngineHash`]) and how each field is
//! written and read: hashes as integers or byte strings, token ids, optional integers and
//! strings.

use std::fmt;

use rmpv::Value;

use super::error::schema;
use super::VllmError;

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

pub(super) const STORED: &str = "BlockStored";
pub(super) const REMOVED: &str = "BlockRemoved";
pub(super) const CLEARED: &str = "AllBlocksCleared";

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
    ///
    /// [`decode_event_batch`]: super::decode_event_batch
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

pub(super) fn engine_hash(at: impl FnOnce() -> String, v: Value) -> Result<EngineHash, VllmError> {
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

pub(super) fn hash_list(at: &str, v: Value) -> Result<Vec<EngineHash>, VllmError> {
    match v {
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(k, h)| engine_hash(|| format!("{at}[{k}]"), h))
            .collect(),
        other => Err(schema(at.into(), "a list of block hashes", &other)),
    }
}

pub(super) fn token_list(at: &str, v: Value) -> Result<Vec<u32>, VllmError> {
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

pub(super) fn opt_i64(at: &str, v: Option<Value>) -> Result<Option<i64>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| schema(at.into(), "a 64-bit signed integer or nil", &v)),
    }
}

pub(super) fn opt_string(at: &str, v: Option<Value>) -> Result<Option<String>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) if s.is_str() => Ok(s.into_str()),
        Some(v) => Err(schema(at.into(), "a UTF-8 string or nil", &v)),
    }
}
