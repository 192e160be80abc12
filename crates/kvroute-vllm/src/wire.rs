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
/// use kvroute_vllm::EngineHash;
/// assert_eq!(EngineHash::from(7u64).to_string(), "7");
/// assert_eq!(EngineHash::from(-1i64), EngineHash::Int(u64::MAX)); // the i64 bit pattern
/// assert_eq!(EngineHash::from(&[0xab, 0x01][..]).to_string(), "0xab01");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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
    /// Per block (parent first), what besides its tokens keyed the engine's hash: multimodal
    /// identifiers with offsets, the cache salt, the LoRA name, prompt-embedding digests
    /// (`None`: no keys). Empty when the engine sent none. Our re-hash keys each block with them
    /// ([`kvblock::ExtraKeys`]).
    pub extra_keys: Vec<Option<Vec<KeyValue>>>,
    /// The KV-cache group the blocks belong to (hybrid models have several); `None`: the only one.
    pub group_idx: Option<u32>,
    /// The group's kind as vLLM names it (`full_attention`, `sliding_window`, `mamba`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding-window group's window, in tokens.
    pub kv_cache_spec_sliding_window: Option<u64>,
    /// Per block, the tokens after it that also keyed the engine's hash of it (lookahead
    /// hashing, e.g. speculative decoding): vLLM 0.33 writes `list[list[int]]`, one list per
    /// block; an older flat `list[int]` reads as one list. `None` (absent or nil): lookahead
    /// hashing is off. Accepted, not hashed (see the [module docs](super#limits)).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    /// The request's cache salt, from SGLang's `BlockStoredWithMetadata` (its trailing
    /// `metadata` map, `{"cache_salt": ...}`). Ingestion keys a prompt's first block with it, as
    /// the router keys a request with `cache_salt` ([`kvblock::vllm_extra_keys`]), so only
    /// requests with the same salt hit.
    pub cache_salt: Option<String>,
}

/// The prefix SGLang puts before a cache salt it also writes into a block's extra keys (the
/// name Dynamo's router strips): such a key is the salt, not a key of its own.
pub const SGLANG_CACHE_SALT_PREFIX: &str = "dynamo-cache-salt:";

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
            extra_keys: Vec::new(),
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
            lookahead_token_ids: None,
            cache_salt: None,
        }
    }

    /// The same event for KV-cache group `group_idx` of kind `kind` (and its window, for a
    /// sliding-window group).
    #[must_use]
    pub fn in_group(mut self, group_idx: u32, kind: &str, sliding_window: Option<u64>) -> Self {
        self.group_idx = Some(group_idx);
        self.kv_cache_spec_kind = Some(kind.into());
        self.kv_cache_spec_sliding_window = sliding_window;
        self
    }
}

/// One value of a block's extra keys, as the engine wrote it (MessagePack's types).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyValue {
    /// Text.
    Str(String),
    /// A byte string.
    Bytes(Vec<u8>),
    /// A signed integer.
    Int(i64),
    /// An unsigned integer above `i64::MAX`.
    UInt(u64),
    /// A float, by its bits.
    Float(u64),
    /// A boolean.
    Bool(bool),
    /// Nil.
    Nil,
    /// A tuple (an array on the wire).
    Tuple(Vec<KeyValue>),
}

impl KeyValue {
    pub(super) fn push_onto(&self, keys: &mut kvblock::ExtraKeys) {
        match self {
            KeyValue::Str(s) => keys.push_str(s),
            KeyValue::Bytes(b) => keys.push_bytes(b),
            KeyValue::Int(i) => keys.push_int(*i),
            KeyValue::UInt(u) => keys.push_uint(*u),
            KeyValue::Float(bits) => keys.push_float(f64::from_bits(*bits)),
            KeyValue::Bool(b) => keys.push_bool(*b),
            KeyValue::Nil => keys.push_nil(),
            KeyValue::Tuple(items) => keys.push_tuple(&to_extra_keys(items)),
        };
    }

    fn to_value(&self) -> Value {
        match self {
            KeyValue::Str(s) => Value::from(s.as_str()),
            KeyValue::Bytes(b) => Value::Binary(b.clone()),
            KeyValue::Int(i) => Value::from(*i),
            KeyValue::UInt(u) => Value::from(*u),
            KeyValue::Float(bits) => Value::F64(f64::from_bits(*bits)),
            KeyValue::Bool(b) => Value::Boolean(*b),
            KeyValue::Nil => Value::Nil,
            KeyValue::Tuple(items) => Value::Array(items.iter().map(KeyValue::to_value).collect()),
        }
    }
}

/// The canonical [`kvblock::ExtraKeys`] of one block's key values.
pub(super) fn to_extra_keys(values: &[KeyValue]) -> kvblock::ExtraKeys {
    let mut keys = kvblock::ExtraKeys::new();
    for v in values {
        v.push_onto(&mut keys);
    }
    keys
}

/// vLLM's `BlockRemoved`: blocks were evicted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Where the blocks lived, if the engine says.
    pub medium: Option<String>,
    /// The KV-cache group the blocks belonged to; `None`: the only one.
    pub group_idx: Option<u32>,
}

impl BlockRemoved {
    /// A `BlockRemoved` without medium.
    pub fn new(block_hashes: Vec<EngineHash>) -> Self {
        BlockRemoved {
            block_hashes,
            medium: None,
            group_idx: None,
        }
    }

    /// The same event for KV-cache group `group_idx`.
    #[must_use]
    pub fn in_group(mut self, group_idx: u32) -> Self {
        self.group_idx = Some(group_idx);
        self
    }
}

/// One event of a vLLM [`EventBatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
// Events live in their batch's list and are applied in place: boxing `BlockStored`, the event
// carrying tokens, would add an allocation per stored event to shrink the others.
#[allow(clippy::large_enum_variant)]
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

    /// Encodes the batch in the positional (tagged array) shape of older vLLM versions: the
    /// fields in declaration order, the optional trailing ones (`extra_keys`, `group_idx`, ...)
    /// only up to the last one set, `data_parallel_rank` last only when set.
    /// [`decode_event_batch`] reads it back.
    ///
    /// [`decode_event_batch`]: super::decode_event_batch
    pub fn to_msgpack(&self) -> Vec<u8> {
        self.encode(|e| {
            let mut v = vec![Value::from(e.name())];
            v.extend(fields(e).into_iter().map(|(_, value, _)| value));
            // Trailing defaults are omitted, as msgspec does.
            let required = match e {
                EngineEvent::BlockStored(_) => 8,
                EngineEvent::BlockRemoved(_) => 3,
                EngineEvent::AllBlocksCleared => 1,
            };
            while v.len() > required && v.last() == Some(&Value::Nil) {
                v.pop();
            }
            Value::Array(v)
        })
    }

    /// Encodes the batch in the map shape current vLLM versions publish (msgspec's tagged
    /// structs): `type` first, then the fields by name in declaration order; the fields without
    /// a default always, the defaulted ones only when set. [`decode_event_batch`] reads it back.
    ///
    /// ```
    /// use kvroute_vllm::{decode_event_batch, BlockRemoved, EngineEvent, EngineHash, EventBatch};
    /// let removed = BlockRemoved::new(vec![EngineHash::Int(5)]).in_group(1);
    /// let batch = EventBatch::new(2.0, vec![EngineEvent::BlockRemoved(removed)]);
    /// assert_eq!(decode_event_batch(&batch.to_msgpack_map())?, batch);
    /// assert_eq!(decode_event_batch(&batch.to_msgpack())?, batch);
    /// # Ok::<(), kvroute_vllm::VllmError>(())
    /// ```
    ///
    /// [`decode_event_batch`]: super::decode_event_batch
    pub fn to_msgpack_map(&self) -> Vec<u8> {
        self.encode(|e| {
            let mut m = vec![(Value::from("type"), Value::from(e.name()))];
            for (name, value, defaulted) in fields(e) {
                if !(defaulted && value == Value::Nil) {
                    m.push((Value::from(name), value));
                }
            }
            Value::Map(m)
        })
    }

    fn encode(&self, event: impl Fn(&EngineEvent) -> Value) -> Vec<u8> {
        let events = self.events.iter().map(event).collect();
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

/// An event's fields in declaration order: name, value, and whether the field has a default
/// (and may be left out when it is nil).
fn fields(e: &EngineEvent) -> Vec<(&'static str, Value, bool)> {
    let opt_str = |s: &Option<String>| s.as_deref().map_or(Value::Nil, Value::from);
    let hashes = |hs: &[EngineHash]| Value::Array(hs.iter().map(hash_value).collect());
    let tokens = |ts: &[u32]| Value::Array(ts.iter().map(|&t| Value::from(t)).collect());
    match e {
        EngineEvent::BlockStored(s) => vec![
            ("block_hashes", hashes(&s.block_hashes), false),
            (
                "parent_block_hash",
                s.parent_block_hash.as_ref().map_or(Value::Nil, hash_value),
                false,
            ),
            ("token_ids", tokens(&s.token_ids), false),
            ("block_size", Value::from(s.block_size), false),
            ("lora_id", s.lora_id.map_or(Value::Nil, Value::from), false),
            ("medium", opt_str(&s.medium), false),
            ("lora_name", opt_str(&s.lora_name), true),
            (
                "extra_keys",
                if s.extra_keys.is_empty() {
                    Value::Nil
                } else {
                    Value::Array(
                        s.extra_keys
                            .iter()
                            .map(|k| {
                                k.as_ref().map_or(Value::Nil, |vs| {
                                    Value::Array(vs.iter().map(KeyValue::to_value).collect())
                                })
                            })
                            .collect(),
                    )
                },
                true,
            ),
            (
                "group_idx",
                s.group_idx.map_or(Value::Nil, Value::from),
                true,
            ),
            ("kv_cache_spec_kind", opt_str(&s.kv_cache_spec_kind), true),
            (
                "kv_cache_spec_sliding_window",
                s.kv_cache_spec_sliding_window
                    .map_or(Value::Nil, Value::from),
                true,
            ),
            (
                "lookahead_token_ids",
                s.lookahead_token_ids
                    .as_deref()
                    .map_or(Value::Nil, |lists| {
                        Value::Array(lists.iter().map(|l| tokens(l)).collect())
                    }),
                true,
            ),
            // SGLang's `BlockStoredWithMetadata` appends it last.
            (
                "metadata",
                s.cache_salt.as_deref().map_or(Value::Nil, |salt| {
                    Value::Map(vec![(Value::from("cache_salt"), Value::from(salt))])
                }),
                true,
            ),
        ],
        EngineEvent::BlockRemoved(r) => vec![
            ("block_hashes", hashes(&r.block_hashes), false),
            ("medium", opt_str(&r.medium), false),
            (
                "group_idx",
                r.group_idx.map_or(Value::Nil, Value::from),
                true,
            ),
        ],
        EngineEvent::AllBlocksCleared => Vec::new(),
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

pub(super) fn opt_u64(
    at: &str,
    v: Option<Value>,
    what: &'static str,
) -> Result<Option<u64>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| schema(at.into(), what, &v)),
    }
}

pub(super) fn opt_group(at: &str, v: Option<Value>) -> Result<Option<u32>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|g| u32::try_from(g).ok())
            .map(Some)
            .ok_or_else(|| schema(at.into(), "a group index from 0 to 4294967295, or nil", &v)),
    }
}

fn key_value(at: &str, v: Value) -> Result<KeyValue, VllmError> {
    Ok(match v {
        Value::Nil => KeyValue::Nil,
        Value::Boolean(b) => KeyValue::Bool(b),
        Value::Integer(i) => match (i.as_i64(), i.as_u64()) {
            (Some(s), _) => KeyValue::Int(s),
            (None, Some(u)) => KeyValue::UInt(u),
            (None, None) => return Err(schema(at.into(), "an integer", &Value::Integer(i))),
        },
        Value::F32(f) => KeyValue::Float(f64::from(f).to_bits()),
        Value::F64(f) => KeyValue::Float(f.to_bits()),
        Value::String(s) => match s.into_str() {
            Some(s) => KeyValue::Str(s),
            None => {
                return Err(VllmError::Schema {
                    at: at.into(),
                    expected: "a UTF-8 string",
                    got: "a string that is not UTF-8".into(),
                })
            }
        },
        Value::Binary(b) => KeyValue::Bytes(b),
        Value::Array(items) => KeyValue::Tuple(
            items
                .into_iter()
                .enumerate()
                .map(|(k, x)| key_value(&format!("{at}[{k}]"), x))
                .collect::<Result<_, _>>()?,
        ),
        other => {
            return Err(schema(
                at.into(),
                "an extra key (a string, bytes, a number, a tuple or nil)",
                &other,
            ))
        }
    })
}

pub(super) fn extra_keys(
    at: &str,
    v: Option<Value>,
) -> Result<Vec<Option<Vec<KeyValue>>>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Array(blocks)) => blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| match b {
                Value::Nil => Ok(None),
                Value::Array(items) => items
                    .into_iter()
                    .enumerate()
                    .map(|(k, x)| key_value(&format!("{at}[{i}][{k}]"), x))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some),
                other => Err(schema(
                    format!("{at}[{i}]"),
                    "a block's extra keys (a tuple or nil)",
                    &other,
                )),
            })
            .collect(),
        Some(other) => Err(schema(
            at.into(),
            "a list of per-block extra keys, or nil",
            &other,
        )),
    }
}

/// `lookahead_token_ids`: a list of per-block token lists (vLLM 0.33; a nil entry is an empty
/// list), or an older flat token list, read as one list; absent or nil is `None`.
pub(super) fn opt_lookahead(
    at: &str,
    v: Option<Value>,
) -> Result<Option<Vec<Vec<u32>>>, VllmError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Array(items))
            if items
                .iter()
                .any(|x| matches!(x, Value::Array(_) | Value::Nil)) =>
        {
            items
                .into_iter()
                .enumerate()
                .map(|(i, x)| match x {
                    Value::Nil => Ok(Vec::new()),
                    x => token_list(&format!("{at}[{i}]"), x),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        }
        Some(v) => token_list(at, v).map(|flat| Some(vec![flat])),
    }
}
