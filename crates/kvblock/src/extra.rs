//! Per-block extra keys: what besides its tokens tells one block apart from another.
//!
//! An image enters a prompt as placeholder token ids that are the same for every image, so two
//! different images give blocks with equal tokens. vLLM keeps them apart by mixing *extra keys*
//! into each block's hash: the multimodal items the block covers (identifier and offset), the
//! request's cache salt (first block only), prompt-embedding digests, the LoRA name. Its KV events
//! publish them per block (`extra_keys`), so a router can do the same.
//!
//! The rule is on [`ExtraKeys`].

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::{BlockSize, LocalBlockHash};

/// The domain prefix of the keyed hash; the trailing number is the rule's version.
const DOMAIN: &[u8] = b"kvblock/extra-keys/1";

/// One block's extra keys, canonically encoded.
///
/// # The rule (version 1, stable)
///
/// A block's keys are a list of values, encoded canonically as bytes, each value as one tag byte
/// and its payload (integers little-endian, lengths as `u64`):
///
/// | value | encoding |
/// |---|---|
/// | text | `0x01`, length, UTF-8 bytes |
/// | bytes | `0x02`, length, bytes |
/// | integer in `i64` | `0x03`, 8 bytes (so `7u64` and `7i64` are one key) |
/// | integer above `i64::MAX` | `0x04`, 8 bytes |
/// | tuple | `0x05`, element count, the elements |
/// | nil | `0x06` |
/// | false / true | `0x07` / `0x08` |
/// | float | `0x09`, the `f64` bits |
///
/// The keyed local hash is `XXH3-64(b"kvblock/extra-keys/1" ++ encoding, seed = plain local
/// hash)`; chaining is unchanged. **No keys (an empty list) leaves the hash as it was**, so every
/// earlier test vector holds, and a request without keys never matches a block stored with
/// keys.
///
/// Build with the chaining methods, or push values in a loop:
///
/// ```
/// use kvblock::{BlockHasher, BlockSize, ExtraKeys};
/// let hasher = BlockHasher::new(BlockSize::new(4)?);
/// let tokens = [9u32; 4]; // image placeholders
/// let a = ExtraKeys::new().tuple(ExtraKeys::new().str("img-A").int(0));
/// let b = ExtraKeys::new().tuple(ExtraKeys::new().str("img-B").int(0));
/// assert_ne!(hasher.hash_block_keyed(&tokens, &a), hasher.hash_block_keyed(&tokens, &b));
/// // No keys: the plain hash.
/// assert_eq!(hasher.hash_block_keyed(&tokens, &ExtraKeys::new()), hasher.hash_block(&tokens));
/// # Ok::<(), kvblock::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ExtraKeys {
    bytes: Vec<u8>,
    len: usize,
}

impl ExtraKeys {
    /// No keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether there are no keys (the block hashes as if it had none).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many top-level values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The canonical encoding.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn tagged(&mut self, tag: u8, payload: &[u8]) -> &mut Self {
        self.len += 1;
        self.bytes.push(tag);
        self.bytes.extend_from_slice(payload);
        self
    }

    fn sized(&mut self, tag: u8, data: &[u8]) -> &mut Self {
        self.tagged(tag, &(data.len() as u64).to_le_bytes());
        self.bytes.extend_from_slice(data);
        self
    }

    /// Appends a text value.
    pub fn push_str(&mut self, s: &str) -> &mut Self {
        self.sized(0x01, s.as_bytes())
    }

    /// Appends a byte-string value.
    pub fn push_bytes(&mut self, b: &[u8]) -> &mut Self {
        self.sized(0x02, b)
    }

    /// Appends a signed integer.
    pub fn push_int(&mut self, i: i64) -> &mut Self {
        self.tagged(0x03, &i.to_le_bytes())
    }

    /// Appends an unsigned integer (one in `i64` range is the same key as [`push_int`](Self::push_int)).
    pub fn push_uint(&mut self, u: u64) -> &mut Self {
        match i64::try_from(u) {
            Ok(i) => self.push_int(i),
            Err(_) => self.tagged(0x04, &u.to_le_bytes()),
        }
    }

    /// Appends a tuple of values.
    pub fn push_tuple(&mut self, t: &ExtraKeys) -> &mut Self {
        self.tagged(0x05, &(t.len as u64).to_le_bytes());
        self.bytes.extend_from_slice(&t.bytes);
        self
    }

    /// Appends nil.
    pub fn push_nil(&mut self) -> &mut Self {
        self.tagged(0x06, &[])
    }

    /// Appends a boolean.
    pub fn push_bool(&mut self, b: bool) -> &mut Self {
        self.tagged(if b { 0x08 } else { 0x07 }, &[])
    }

    /// Appends a float (keyed by its bits).
    pub fn push_float(&mut self, f: f64) -> &mut Self {
        self.tagged(0x09, &f.to_bits().to_le_bytes())
    }

    /// With a text value appended.
    #[must_use]
    pub fn str(mut self, s: &str) -> Self {
        self.push_str(s);
        self
    }

    /// With a signed integer appended.
    #[must_use]
    pub fn int(mut self, i: i64) -> Self {
        self.push_int(i);
        self
    }

    /// With a byte string appended.
    #[must_use]
    pub fn bytes(mut self, b: &[u8]) -> Self {
        self.push_bytes(b);
        self
    }

    /// With a tuple appended.
    #[must_use]
    pub fn tuple(mut self, t: ExtraKeys) -> Self {
        self.push_tuple(&t);
        self
    }

    /// The keyed local hash of a block whose plain local hash is `plain`.
    pub(crate) fn apply(&self, plain: LocalBlockHash) -> LocalBlockHash {
        if self.is_empty() {
            return plain;
        }
        let mut buf = Vec::with_capacity(DOMAIN.len() + self.bytes.len());
        buf.extend_from_slice(DOMAIN);
        buf.extend_from_slice(&self.bytes);
        LocalBlockHash::new(xxh3_64_with_seed(&buf, plain.get()))
    }
}

/// A multimodal item's place in a prompt: its identifier and the tokens its placeholders occupy.
///
/// ```
/// let image = kvblock::MultimodalSpan::new("img-A", 4, 32);
/// assert_eq!((image.offset, image.length), (4, 32));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct MultimodalSpan {
    /// The item's identifier (vLLM: the multimodal hash, with the LoRA name prefixed when the
    /// tower connector uses LoRA).
    pub identifier: String,
    /// The first placeholder token's position in the prompt.
    pub offset: usize,
    /// How many placeholder tokens.
    pub length: usize,
}

impl MultimodalSpan {
    /// An item at token `offset` covering `length` tokens.
    pub fn new(identifier: impl Into<String>, offset: usize, length: usize) -> Self {
        MultimodalSpan {
            identifier: identifier.into(),
            offset,
            length,
        }
    }
}

/// Each full block's extra keys for a prompt of `tokens` tokens, as vLLM builds them: for every
/// multimodal item that overlaps the block, the tuple `(identifier, item offset - block start)`
/// (negative when the item began in an earlier block), in prompt order; then the cache salt, in
/// the first block only. The LoRA name, which vLLM puts first in every block's keys, is not
/// included: salt the hasher with it ([`BlockHasher::with_lora_name`](crate::BlockHasher::with_lora_name)),
/// which is how ingestion treats it too.
///
/// ```
/// use kvblock::{vllm_extra_keys, BlockSize, ExtraKeys, MultimodalSpan};
/// let bs = BlockSize::new(16)?;
/// // An image in tokens 8..40 of a 48-token prompt: blocks 0, 1 and 2 cover part of it.
/// let keys = vllm_extra_keys(bs, 48, &[MultimodalSpan::new("img-A", 8, 32)], Some("tenant-1"));
/// assert_eq!(keys.len(), 3);
/// assert_eq!(keys[0], ExtraKeys::new().tuple(ExtraKeys::new().str("img-A").int(8)).str("tenant-1"));
/// assert_eq!(keys[2], ExtraKeys::new().tuple(ExtraKeys::new().str("img-A").int(-24)));
/// # Ok::<(), kvblock::Error>(())
/// ```
pub fn vllm_extra_keys(
    block_size: BlockSize,
    tokens: usize,
    items: &[MultimodalSpan],
    cache_salt: Option<&str>,
) -> Vec<ExtraKeys> {
    let bs = block_size.get();
    (0..block_size.full_blocks(tokens))
        .map(|b| {
            let (start, end) = (b * bs, (b + 1) * bs);
            let mut keys = ExtraKeys::new();
            for item in items {
                if item.offset < end && item.offset.saturating_add(item.length) > start {
                    let rel = i64::try_from(item.offset)
                        .unwrap_or(i64::MAX)
                        .saturating_sub(i64::try_from(start).unwrap_or(i64::MAX));
                    keys.push_tuple(&ExtraKeys::new().str(&item.identifier).int(rel));
                }
            }
            if let (0, Some(salt)) = (b, cache_salt.filter(|s| !s.is_empty())) {
                keys.push_str(salt);
            }
            keys
        })
        .collect()
}
