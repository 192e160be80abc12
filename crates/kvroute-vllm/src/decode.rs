//! Bytes from the network into [`EventBatch`]es: the MessagePack payload (either event shape) and
//! the sequence-number frame.

use rmpv::Value;

use super::error::{clip, schema};
use super::wire::{
    engine_hash, extra_keys, hash_list, opt_group, opt_i64, opt_lookahead, opt_string, opt_u64,
    token_list, CLEARED, REMOVED, STORED,
};
use super::{BlockRemoved, BlockStored, EngineEvent, EventBatch, VllmError};

/// The deepest MessagePack nesting accepted. The schema needs about 11 levels (the decoder counts
/// containers and strings); the bound keeps hostile input from exhausting the stack.
const MAX_DEPTH: usize = 64;

/// Reads a sequence-number frame: exactly 8 bytes, big-endian.
///
/// ```
/// assert_eq!(kvroute_vllm::parse_seq_frame(&7u64.to_be_bytes())?, 7);
/// assert!(kvroute_vllm::parse_seq_frame(&[0, 7]).is_err());
/// # Ok::<(), kvroute_vllm::VllmError>(())
/// ```
pub fn parse_seq_frame(frame: &[u8]) -> Result<u64, VllmError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| VllmError::SequenceFrame { len: frame.len() })
}

/// A sequence-number frame as vLLM sends it (on every published batch, in a replay request and
/// in each replay answer): 8 bytes, big-endian.
///
/// ```
/// assert_eq!(kvroute_vllm::seq_frame(7), [0, 0, 0, 0, 0, 0, 0, 7]);
/// ```
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// The sequence frame that ends a replay answer: -1 as a big-endian `i64`.
pub const REPLAY_END: [u8; 8] = (-1i64).to_be_bytes();

/// Reads the sequence frame of a replay answer: `Some(seq)` for a batch, `None` for the end
/// marker (a negative `i64`, [`REPLAY_END`]).
///
/// ```
/// use kvroute_vllm::{parse_replay_seq, seq_frame, REPLAY_END};
/// assert_eq!(parse_replay_seq(&seq_frame(3))?, Some(3));
/// assert_eq!(parse_replay_seq(&REPLAY_END)?, None);
/// assert!(parse_replay_seq(&[1, 2]).is_err());
/// # Ok::<(), kvroute_vllm::VllmError>(())
/// ```
pub fn parse_replay_seq(frame: &[u8]) -> Result<Option<u64>, VllmError> {
    let seq = <[u8; 8]>::try_from(frame)
        .map(i64::from_be_bytes)
        .map_err(|_| VllmError::SequenceFrame { len: frame.len() })?;
    Ok(u64::try_from(seq).ok())
}

/// Decodes one vLLM MessagePack event batch (either event shape, either hash encoding).
///
/// ```
/// use kvroute_vllm::{decode_event_batch, EngineEvent};
/// // [1.5, [["AllBlocksCleared"]]] in MessagePack.
/// let payload = [0x92, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x91,
///     0xb0, b'A', b'l', b'l', b'B', b'l', b'o', b'c', b'k', b's',
///     b'C', b'l', b'e', b'a', b'r', b'e', b'd'];
/// let batch = decode_event_batch(&payload)?;
/// assert_eq!(batch.timestamp, 1.5);
/// assert_eq!(batch.events, [EngineEvent::AllBlocksCleared]);
/// assert!(decode_event_batch(&payload[..12]).is_err()); // truncated
/// # Ok::<(), kvroute_vllm::VllmError>(())
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
    extra_keys: Option<Value>,
    group_idx: Option<Value>,
    kv_cache_spec_kind: Option<Value>,
    kv_cache_spec_sliding_window: Option<Value>,
    lookahead_token_ids: Option<Value>,
    metadata: Option<Value>,
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
            match it.next() {
                // SGLang's `BlockStoredWithMetadata` in its first layout: the 7 fields of its
                // `BlockStored`, then the metadata map where vLLM has `lora_name`.
                Some(m @ Value::Map(_)) => raw.metadata = Some(m),
                lora_name => {
                    raw.lora_name = lora_name;
                    raw.extra_keys = it.next();
                    raw.group_idx = it.next();
                    raw.kv_cache_spec_kind = it.next();
                    raw.kv_cache_spec_sliding_window = it.next();
                    raw.lookahead_token_ids = match it.next() {
                        // SGLang's layout has `locality` (a string) here.
                        Some(Value::String(_)) => None,
                        v => v,
                    };
                    // SGLang's later layout puts the metadata map after every positional
                    // field (`locality`, `ownership`); the first map past the known fields.
                    raw.metadata = it.find(Value::is_map);
                }
            }
        }
        Kind::Removed => {
            raw.block_hashes = it.next();
            raw.medium = it.next();
            raw.group_idx = it.next();
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
            Some("extra_keys") => &mut raw.extra_keys,
            Some("group_idx") => &mut raw.group_idx,
            Some("kv_cache_spec_kind") => &mut raw.kv_cache_spec_kind,
            Some("kv_cache_spec_sliding_window") => &mut raw.kv_cache_spec_sliding_window,
            Some("lookahead_token_ids") => &mut raw.lookahead_token_ids,
            Some("metadata") => &mut raw.metadata,
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
                extra_keys: extra_keys(&format!("{at}.extra_keys"), raw.extra_keys)?,
                group_idx: opt_group(&format!("{at}.group_idx"), raw.group_idx)?,
                kv_cache_spec_kind: opt_string(
                    &format!("{at}.kv_cache_spec_kind"),
                    raw.kv_cache_spec_kind,
                )?,
                kv_cache_spec_sliding_window: opt_u64(
                    &format!("{at}.kv_cache_spec_sliding_window"),
                    raw.kv_cache_spec_sliding_window,
                    "a window in tokens (an integer >= 0), or nil",
                )?,
                lookahead_token_ids: opt_lookahead(
                    &format!("{at}.lookahead_token_ids"),
                    raw.lookahead_token_ids,
                )?,
                cache_salt: metadata_salt(&format!("{at}.metadata"), raw.metadata)?,
            }))
        }
        Kind::Removed => {
            let hashes = required(raw.block_hashes, REMOVED, "block_hashes")?;
            Ok(EngineEvent::BlockRemoved(BlockRemoved {
                block_hashes: hash_list(&format!("{at}.block_hashes"), hashes)?,
                medium: opt_string(&format!("{at}.medium"), raw.medium)?,
                group_idx: opt_group(&format!("{at}.group_idx"), raw.group_idx)?,
            }))
        }
        Kind::Cleared => Ok(EngineEvent::AllBlocksCleared),
    }
}

/// The `cache_salt` of SGLang's `BlockStoredWithMetadata` metadata map (absent, nil or without
/// the key: none; other keys are ignored, as newer fields).
fn metadata_salt(at: &str, v: Option<Value>) -> Result<Option<String>, VllmError> {
    const EXPECTED: &str = "a metadata map ({\"cache_salt\": string}) or nil";
    let entries = match v {
        None | Some(Value::Nil) => return Ok(None),
        Some(Value::Map(entries)) => entries,
        Some(v) => return Err(schema(at.into(), EXPECTED, &v)),
    };
    let salt = entries
        .into_iter()
        .find(|(k, _)| k.as_str() == Some("cache_salt"))
        .map(|(_, v)| v);
    opt_string(&format!("{at}.cache_salt"), salt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_frame_must_be_eight_bytes() {
        assert_eq!(
            parse_seq_frame(&[1, 2, 3]),
            Err(VllmError::SequenceFrame { len: 3 })
        );
        assert_eq!(parse_seq_frame(&258u64.to_be_bytes()), Ok(258));
    }
}
