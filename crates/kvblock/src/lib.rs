//! Token ids to chained XXH3-64 KV block hashes.
//!
//! An LLM engine stores a prompt's KV cache in fixed-size blocks of tokens. Two prompts can
//! share a cached block only if they share the block *and everything before it*, so every block
//! is named by a **sequence hash** that chains the block's own content hash onto its parent's.
//! Caches, routers, indexes and the simulator all key on these hashes.
//!
//! The contract (stable, interoperable with Dynamo's router):
//!
//! - tokens are `u32`; only **full** blocks are hashed, a partial tail is ignored (or, in
//!   [`BlockSequence`], kept until it fills);
//! - the local hash of a block is XXH3-64 with seed `S` over its tokens as little-endian bytes;
//! - `seq[0] = local[0]`, `seq[i] = XXH3-64(seed S)` over `seq[i-1].to_le_bytes() ++ local[i].to_le_bytes()`;
//! - `S = 1337`, plus `XXH3-64(lora_name, seed 0)` and `XXH3-64(namespace, seed 1)` when a LoRA
//!   adapter name or a cache namespace is set (wrapping adds; an empty string means absent);
//! - a block with [`ExtraKeys`] (multimodal items, a cache salt: what vLLM publishes per block as
//!   `extra_keys`) has its local hash keyed by them first, by the versioned rule in
//!   [`ExtraKeys`]; no keys leaves every hash above as it is.
//!
//! ```
//! use kvblock::{BlockHasher, BlockSize};
//!
//! let hasher = BlockHasher::new(BlockSize::new(16)?);
//! let tokens: Vec<u32> = (0..40).collect();
//! let seq = hasher.sequence_hashes(&tokens); // 2 full blocks; the 8-token tail is ignored
//! assert_eq!(seq.len(), 2);
//! assert_eq!(seq[1].get(), 0xbf15_dffb_1644_7f38);
//! assert_eq!(seq[1], kvblock::chain(Some(seq[0]), hasher.local_hashes(&tokens)[1]));
//! # Ok::<(), kvblock::Error>(())
//! ```
//!
//! # Features
//!
//! | feature | default | what it adds | what it costs |
//! |---|---|---|---|
//! | `serde` | off | `Serialize`/`Deserialize` for [`BlockSize`], [`BlockHash`] and [`LocalBlockHash`] (plain integers) | the `serde` crate |
//!
//! Always needed: `xxhash-rust` (XXH3 only), `bytemuck` (token bytes without copying) and
//! `thiserror`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
// No input a caller, an engine or a file supplies may panic the library.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

use std::fmt;
use std::num::NonZeroU32;

use xxhash_rust::xxh3::xxh3_64_with_seed;

mod extra;
pub use extra::{vllm_extra_keys, ExtraKeys, MultimodalSpan};

/// The seed of the hashing contract when no salt is set.
pub const DEFAULT_SEED: u64 = 1337;

/// Errors of this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A block size that is not in `1..=u32::MAX` tokens.
    #[error("invalid block size {got}: expected a whole number of tokens from 1 to 4294967295")]
    InvalidBlockSize {
        /// The rejected value.
        got: u64,
    },
}

/// Tokens per KV block: a validated, non-zero size.
///
/// Engines and the router must agree on it; a mismatch means no block ever matches.
///
/// ```
/// let bs = kvblock::BlockSize::new(16)?;
/// assert_eq!(bs.get(), 16);
/// assert!(kvblock::BlockSize::new(0).is_err());
/// # Ok::<(), kvblock::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(try_from = "u64", into = "u64"))]
pub struct BlockSize(NonZeroU32);

impl BlockSize {
    /// A block size of `tokens` tokens; an error for 0 or for more than `u32::MAX`.
    pub fn new(tokens: usize) -> Result<Self, Error> {
        u32::try_from(tokens)
            .ok()
            .and_then(NonZeroU32::new)
            .map(BlockSize)
            .ok_or(Error::InvalidBlockSize { got: tokens as u64 })
    }

    /// Tokens per block.
    pub fn get(self) -> usize {
        self.0.get() as usize
    }

    /// How many **full** blocks `tokens` tokens fill.
    pub fn full_blocks(self, tokens: usize) -> usize {
        tokens / self.get()
    }

    /// How many blocks `tokens` tokens occupy, counting a partial last block.
    pub fn blocks_for(self, tokens: usize) -> usize {
        tokens.div_ceil(self.get())
    }
}

impl Default for BlockSize {
    /// 16 tokens, the canonical size engines and routers use.
    fn default() -> Self {
        BlockSize(NonZeroU32::MIN.saturating_add(15))
    }
}

impl TryFrom<u64> for BlockSize {
    type Error = Error;
    fn try_from(v: u64) -> Result<Self, Error> {
        u32::try_from(v)
            .ok()
            .and_then(NonZeroU32::new)
            .map(BlockSize)
            .ok_or(Error::InvalidBlockSize { got: v })
    }
}

impl From<BlockSize> for u64 {
    fn from(b: BlockSize) -> u64 {
        u64::from(b.0.get())
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

macro_rules! hash_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
        #[cfg_attr(feature = "serde", serde(transparent))]
        pub struct $name(u64);

        impl $name {
            /// Wraps a raw 64-bit value (for ids that come from elsewhere: traces, events).
            pub const fn new(raw: u64) -> Self {
                Self(raw)
            }

            /// The raw 64-bit value.
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#018x}", self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#018x})"), self.0)
            }
        }
    };
}

hash_newtype!(
    /// The content hash of one block's tokens, independent of what precedes it.
    ///
    /// ```
    /// let h = kvblock::LocalBlockHash::new(0xff);
    /// assert_eq!(h.to_string(), "0x00000000000000ff");
    /// ```
    LocalBlockHash
);
hash_newtype!(
    /// The chained hash of a block: it names the block *and its whole prefix*. This is the key
    /// of caches, indexes and KV events.
    ///
    /// ```
    /// let h = kvblock::BlockHash::new(46); // an id from a trace
    /// assert_eq!(h.get(), 46);
    /// ```
    BlockHash
);

/// Chains `local` onto `parent` with the default (unsalted) seed: `seq[i]` from `seq[i-1]`.
///
/// With no parent the sequence hash of a first block is its local hash. Use
/// [`BlockHasher::chain`] for a salted hasher.
///
/// ```
/// use kvblock::{chain, BlockHash, LocalBlockHash};
/// let first = chain(None, LocalBlockHash::new(7));
/// assert_eq!(first, BlockHash::new(7));
/// ```
pub fn chain(parent: Option<BlockHash>, local: LocalBlockHash) -> BlockHash {
    chain_with_seed(DEFAULT_SEED, parent, local)
}

#[inline]
fn chain_with_seed(seed: u64, parent: Option<BlockHash>, local: LocalBlockHash) -> BlockHash {
    match parent {
        None => BlockHash(local.0),
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.0.to_le_bytes());
            buf[8..].copy_from_slice(&local.0.to_le_bytes());
            BlockHash(xxh3_64_with_seed(&buf, seed))
        }
    }
}

/// Hashes token ids into block hashes at one block size, with an optional salt.
///
/// Cheap to copy; build one per (block size, LoRA adapter, namespace) and reuse it.
///
/// ```
/// use kvblock::{BlockHasher, BlockSize};
/// let bs = BlockSize::new(16)?;
/// let tokens: Vec<u32> = (0..16).collect();
/// let plain = BlockHasher::new(bs).local_hashes(&tokens);
/// let lora = BlockHasher::new(bs).with_lora_name("my-lora").local_hashes(&tokens);
/// assert_eq!(plain[0].get(), 0xd47a_8f41_c833_328a);
/// assert_eq!(lora[0].get(), 0x6be4_5096_17b3_e757);
/// # Ok::<(), kvblock::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHasher {
    block_size: BlockSize,
    lora_salt: u64,
    namespace_salt: u64,
    seed: u64,
}

impl BlockHasher {
    /// A hasher with the default seed 1337 and no salt.
    pub fn new(block_size: BlockSize) -> Self {
        BlockHasher {
            block_size,
            lora_salt: 0,
            namespace_salt: 0,
            seed: DEFAULT_SEED,
        }
    }

    /// Salts every hash with a LoRA adapter name (empty = no adapter).
    #[must_use]
    pub fn with_lora_name(mut self, name: &str) -> Self {
        self.lora_salt = salt(name, 0);
        self.reseed()
    }

    /// Salts every hash with a cache namespace (empty = none), e.g. to isolate tenants.
    #[must_use]
    pub fn with_namespace(mut self, namespace: &str) -> Self {
        self.namespace_salt = salt(namespace, 1);
        self.reseed()
    }

    fn reseed(mut self) -> Self {
        self.seed = DEFAULT_SEED
            .wrapping_add(self.lora_salt)
            .wrapping_add(self.namespace_salt);
        self
    }

    /// Tokens per block.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// The XXH3 seed in use (1337 unless salted).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The local hash of one block's tokens (any length; callers pass a full block).
    #[inline]
    pub fn hash_block(&self, tokens: &[u32]) -> LocalBlockHash {
        LocalBlockHash(hash_tokens(tokens, self.seed))
    }

    /// Chains `local` onto `parent` with this hasher's seed.
    #[inline]
    pub fn chain(&self, parent: Option<BlockHash>, local: LocalBlockHash) -> BlockHash {
        chain_with_seed(self.seed, parent, local)
    }

    /// Local hashes of every full block of `tokens`; a partial tail is ignored.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        let mut out = Vec::with_capacity(self.block_size.full_blocks(tokens.len()));
        self.local_hashes_into(tokens, &mut out);
        out
    }

    /// Appends the local hashes of every full block of `tokens` to `out`.
    pub fn local_hashes_into(&self, tokens: &[u32], out: &mut Vec<LocalBlockHash>) {
        out.extend(
            tokens
                .chunks_exact(self.block_size.get())
                .map(|b| self.hash_block(b)),
        );
    }

    /// Sequence hashes of every full block of `tokens`; a partial tail is ignored.
    pub fn sequence_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(self.block_size.full_blocks(tokens.len()));
        self.sequence_hashes_into(None, tokens, &mut out);
        out
    }

    /// Appends the sequence hashes of every full block of `tokens`, chained onto `parent`, to
    /// `out`, and returns the last hash (or `parent` when no block is full). Allocates nothing
    /// when `out` has room.
    pub fn sequence_hashes_into(
        &self,
        parent: Option<BlockHash>,
        tokens: &[u32],
        out: &mut Vec<BlockHash>,
    ) -> Option<BlockHash> {
        let mut last = parent;
        out.reserve(self.block_size.full_blocks(tokens.len()));
        for block in tokens.chunks_exact(self.block_size.get()) {
            let h = self.chain(last, self.hash_block(block));
            out.push(h);
            last = Some(h);
        }
        last
    }
}

impl BlockHasher {
    /// The local hash of one block's tokens keyed by its extra keys (empty keys: the plain
    /// [`hash_block`](Self::hash_block)).
    #[inline]
    pub fn hash_block_keyed(&self, tokens: &[u32], keys: &ExtraKeys) -> LocalBlockHash {
        keys.apply(self.hash_block(tokens))
    }

    /// Sequence hashes of every full block of `tokens`, block `i` keyed by `keys[i]` (a block
    /// past the end of `keys` has none); a partial tail is ignored.
    ///
    /// ```
    /// use kvblock::{vllm_extra_keys, BlockHasher, BlockSize, MultimodalSpan};
    /// let bs = BlockSize::new(16)?;
    /// let hasher = BlockHasher::new(bs);
    /// let tokens = vec![7u32; 48]; // 16 text tokens, then 32 image placeholders
    /// let keys = |id| vllm_extra_keys(bs, tokens.len(), &[MultimodalSpan::new(id, 16, 32)], None);
    /// let a = hasher.sequence_hashes_keyed(&tokens, &keys("img-A"));
    /// let b = hasher.sequence_hashes_keyed(&tokens, &keys("img-B"));
    /// assert_eq!(a[0], b[0]); // the text block is shared
    /// assert_ne!(a[1], b[1]); // the image blocks are not
    /// assert_eq!(hasher.sequence_hashes_keyed(&tokens, &[]), hasher.sequence_hashes(&tokens));
    /// # Ok::<(), kvblock::Error>(())
    /// ```
    pub fn sequence_hashes_keyed(&self, tokens: &[u32], keys: &[ExtraKeys]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(self.block_size.full_blocks(tokens.len()));
        self.sequence_hashes_keyed_into(None, tokens, keys, &mut out);
        out
    }

    /// [`sequence_hashes_into`](Self::sequence_hashes_into) with per-block extra keys, as
    /// [`sequence_hashes_keyed`](Self::sequence_hashes_keyed).
    pub fn sequence_hashes_keyed_into(
        &self,
        parent: Option<BlockHash>,
        tokens: &[u32],
        keys: &[ExtraKeys],
        out: &mut Vec<BlockHash>,
    ) -> Option<BlockHash> {
        let mut last = parent;
        out.reserve(self.block_size.full_blocks(tokens.len()));
        for (i, block) in tokens.chunks_exact(self.block_size.get()).enumerate() {
            let local = match keys.get(i) {
                Some(k) => self.hash_block_keyed(block, k),
                None => self.hash_block(block),
            };
            let h = self.chain(last, local);
            out.push(h);
            last = Some(h);
        }
        last
    }
}

fn salt(s: &str, seed: u64) -> u64 {
    if s.is_empty() {
        0
    } else {
        xxh3_64_with_seed(s.as_bytes(), seed)
    }
}

#[inline]
fn hash_tokens(tokens: &[u32], seed: u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // The contract hashes little-endian bytes, which is the in-memory layout here.
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

/// Incremental hashing of a growing token stream (multi-turn chat, agent loops).
///
/// Feed tokens as they arrive; each call returns the blocks it completed. For any split of a
/// token list into pieces, the hashes equal [`BlockHasher::sequence_hashes`] of the whole list.
///
/// ```
/// use kvblock::{BlockHasher, BlockSequence, BlockSize};
/// let h = BlockHasher::new(BlockSize::new(4)?);
/// let tokens: Vec<u32> = (0..10).collect();
/// let mut s = BlockSequence::new(h);
/// let mut got = s.extend(&tokens[..3]); // nothing complete yet
/// assert!(got.is_empty());
/// got.extend(s.extend(&tokens[3..]));
/// assert_eq!(got, h.sequence_hashes(&tokens));
/// assert_eq!(s.pending_tokens(), 2);
/// # Ok::<(), kvblock::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct BlockSequence {
    hasher: BlockHasher,
    last: Option<BlockHash>,
    tail: Vec<u32>,
    blocks: usize,
}

impl BlockSequence {
    /// An empty sequence.
    pub fn new(hasher: BlockHasher) -> Self {
        Self::from_parent(hasher, None)
    }

    /// A sequence that continues after `parent` (the hash of the last full block already seen).
    pub fn with_parent(hasher: BlockHasher, parent: BlockHash) -> Self {
        Self::from_parent(hasher, Some(parent))
    }

    fn from_parent(hasher: BlockHasher, last: Option<BlockHash>) -> Self {
        BlockSequence {
            hasher,
            last,
            tail: Vec::with_capacity(hasher.block_size.get()),
            blocks: 0,
        }
    }

    /// Adds tokens and returns the hashes of the blocks they completed.
    pub fn extend(&mut self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::new();
        self.extend_into(tokens, &mut out);
        out
    }

    /// Adds tokens and appends the hashes of the blocks they completed to `out`.
    pub fn extend_into(&mut self, mut tokens: &[u32], out: &mut Vec<BlockHash>) {
        let bs = self.hasher.block_size.get();
        let before = out.len();
        if !self.tail.is_empty() {
            let take = (bs - self.tail.len()).min(tokens.len());
            self.tail.extend_from_slice(&tokens[..take]);
            tokens = &tokens[take..];
            if self.tail.len() < bs {
                return;
            }
            let h = self
                .hasher
                .chain(self.last, self.hasher.hash_block(&self.tail));
            out.push(h);
            self.last = Some(h);
            self.tail.clear();
        }
        let full = tokens.len() - tokens.len() % bs;
        self.last = self
            .hasher
            .sequence_hashes_into(self.last, &tokens[..full], out);
        self.tail.extend_from_slice(&tokens[full..]);
        self.blocks += out.len() - before;
    }

    /// The hash of the last completed block (or the starting parent), if any.
    pub fn last(&self) -> Option<BlockHash> {
        self.last
    }

    /// Tokens waiting for their block to fill.
    pub fn pending_tokens(&self) -> usize {
        self.tail.len()
    }

    /// Blocks completed by this sequence (not counting a starting parent).
    pub fn completed_blocks(&self) -> usize {
        self.blocks
    }

    /// The hasher in use.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    #[test]
    fn design_test_vectors() {
        let h16 = BlockHasher::new(BlockSize::new(16).unwrap());
        let l = h16.local_hashes(&toks(16));
        assert_eq!(l[0].get(), 0xd47a8f41c833328a);
        assert_eq!(h16.sequence_hashes(&toks(16))[0].get(), 0xd47a8f41c833328a);

        let l = h16.local_hashes(&toks(32));
        let s = h16.sequence_hashes(&toks(32));
        assert_eq!(l[1].get(), 0xd43939178abd00db);
        assert_eq!(s[1].get(), 0xbf15dffb16447f38);
        assert_eq!(h16.local_hashes(&toks(40)), l);
        assert_eq!(h16.sequence_hashes(&toks(40)), s);

        let h64 = BlockHasher::new(BlockSize::new(64).unwrap());
        let l = h64.local_hashes(&toks(128));
        assert_eq!(
            l.iter().map(|h| h.get()).collect::<Vec<_>>(),
            vec![0x304d910e689e42bf, 0x2e0cebb8f3781524]
        );
        assert_eq!(h64.sequence_hashes(&toks(128))[1].get(), 0x23bd5ef232e90ecb);

        let lora = h16.with_lora_name("my-lora");
        assert_eq!(lora.local_hashes(&toks(16))[0].get(), 0x6be4509617b3e757);
    }

    #[test]
    fn extra_keys_vectors() {
        let h16 = BlockHasher::new(BlockSize::new(16).unwrap());
        let image = ExtraKeys::new().tuple(ExtraKeys::new().str("img-A").int(0));
        let salted = ExtraKeys::new().str("tenant-1");
        let t = toks(16);
        let got = [
            h16.hash_block_keyed(&t, &image).get(),
            h16.hash_block_keyed(&t, &salted).get(),
            h16.with_lora_name("my-lora")
                .hash_block_keyed(&t, &image)
                .get(),
        ];
        // Computed independently (Python `xxhash` over the documented encoding).
        assert_eq!(
            got,
            [0xf9ae8b51a16c49eb, 0x0ed1f3f9c34d631d, 0x087dcb165654c72a]
        );
        assert_eq!(
            h16.hash_block_keyed(&t, &ExtraKeys::new()).get(),
            0xd47a8f41c833328a
        );
        let keys = [ExtraKeys::new(), image];
        let s = h16.sequence_hashes_keyed(&toks(32), &keys);
        assert_eq!(s[0].get(), 0xd47a8f41c833328a);
        assert_eq!(s[1].get(), 0xdedbe3073048e12b);
    }

    #[test]
    fn extra_keys_encoding_is_canonical() {
        assert_eq!(ExtraKeys::new().int(7), {
            let mut k = ExtraKeys::new();
            k.push_uint(7);
            k
        });
        let mut big = ExtraKeys::new();
        big.push_uint(u64::MAX);
        assert_ne!(big, ExtraKeys::new().int(-1));
        // A tuple is not its elements spliced in.
        let flat = ExtraKeys::new().str("a").int(1);
        let nested = ExtraKeys::new().tuple(ExtraKeys::new().str("a").int(1));
        assert_ne!(flat.as_bytes(), nested.as_bytes());
        // Text is not bytes.
        assert_ne!(ExtraKeys::new().str("a"), ExtraKeys::new().bytes(b"a"));
        assert_eq!(nested.len(), 1);
        assert_eq!(flat.len(), 2);
    }

    #[test]
    fn vllm_extra_keys_follow_the_engine_rule() {
        let bs = BlockSize::new(4).unwrap();
        let items = [
            MultimodalSpan::new("a", 2, 4),
            MultimodalSpan::new("b", 8, 4),
        ];
        let k = vllm_extra_keys(bs, 14, &items, Some("s"));
        let t = |id: &str, off: i64| ExtraKeys::new().str(id).int(off);
        assert_eq!(k.len(), 3);
        assert_eq!(k[0], ExtraKeys::new().tuple(t("a", 2)).str("s"));
        assert_eq!(k[1], ExtraKeys::new().tuple(t("a", -2)));
        assert_eq!(k[2], ExtraKeys::new().tuple(t("b", 0)));
        assert!(vllm_extra_keys(bs, 14, &[], Some(""))
            .iter()
            .all(ExtraKeys::is_empty));
    }

    #[test]
    fn free_chain_matches_unsalted_hasher() {
        let h = BlockHasher::new(BlockSize::new(16).unwrap());
        let l = h.local_hashes(&toks(32));
        let s = h.sequence_hashes(&toks(32));
        assert_eq!(chain(Some(s[0]), l[1]), s[1]);
        assert_eq!(chain(None, l[0]), s[0]);
    }

    #[test]
    fn block_size_validation_names_the_value() {
        let e = BlockSize::new(0).unwrap_err();
        assert_eq!(e, Error::InvalidBlockSize { got: 0 });
        assert!(e.to_string().contains("invalid block size 0"));
        #[cfg(target_pointer_width = "64")]
        assert!(BlockSize::new(1 << 40).is_err());
        assert_eq!(BlockSize::new(512).unwrap().blocks_for(513), 2);
        assert_eq!(BlockSize::new(512).unwrap().full_blocks(1023), 1);
        assert_eq!(BlockSize::default().get(), 16);
    }

    #[test]
    fn display_is_hex() {
        assert_eq!(BlockHash::new(0xabc).to_string(), "0x0000000000000abc");
        assert_eq!(
            format!("{:?}", LocalBlockHash::new(1)),
            "LocalBlockHash(0x0000000000000001)"
        );
    }

    #[test]
    fn salt_order_does_not_matter_and_empty_is_absent() {
        let h = BlockHasher::new(BlockSize::new(4).unwrap());
        assert_eq!(h.with_lora_name("").with_namespace(""), h);
        assert_eq!(
            h.with_lora_name("a").with_namespace("b").seed(),
            h.with_namespace("b").with_lora_name("a").seed()
        );
    }

    #[test]
    fn sequence_continues_from_parent() {
        let h = BlockHasher::new(BlockSize::new(4).unwrap());
        let all = h.sequence_hashes(&toks(12));
        let mut s = BlockSequence::with_parent(h, all[0]);
        assert_eq!(s.extend(&(4..12).collect::<Vec<_>>()), all[1..].to_vec());
        assert_eq!(s.completed_blocks(), 2);
        assert_eq!(s.last(), Some(all[2]));
    }
}

// The README's example, compiled and run as a doc test so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
