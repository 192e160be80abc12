//! The one rule that turns an OpenAI request into what its blocks are keyed by, besides its
//! tokens, used by the router server when it routes and by `kvmock` when it caches, as vLLM keys
//! them:
//!
//! - a LoRA adapter's name salts every block (vLLM puts it first in each block's extra keys);
//! - vLLM's `cache_salt` keys the prompt's first block (the chain carries it to the rest), so
//!   only requests with the same salt share blocks ([`kvblock::vllm_extra_keys`]);
//! - a chat prompt with media is routed on its text before the first media message's content
//!   (the media's own tokens and keys are the engine's to know).

use kvblock::{vllm_extra_keys, BlockHash, BlockSize, ExtraKeys};
use kvroute::Salt;

use crate::openai::Request;

/// What a request's blocks are keyed by, besides its tokens.
///
/// # Example
///
/// ```
/// use kvblock::BlockSize;
/// use kvserve::keys::RequestKeys;
/// use kvserve::openai::{parse, Endpoint};
///
/// let bs = BlockSize::new(4)?;
/// let tokens: Vec<u32> = (0..8).collect();
/// let body = br#"{"model": "sql-lora", "prompt": [0], "cache_salt": "tenant-1"}"#;
/// let req = parse(Endpoint::Completions, body)?;
/// let keys = RequestKeys::of(&req, |model| model == "sql-lora");
/// assert_eq!((keys.lora(), keys.cache_salt()), (Some("sql-lora"), Some("tenant-1")));
/// // Other blocks than the same tokens under no keys, and than under another salt.
/// let plain = RequestKeys::default().block_hashes(bs, &tokens);
/// let other = RequestKeys::new(Some("sql-lora"), Some("tenant-2")).block_hashes(bs, &tokens);
/// assert_ne!(keys.block_hashes(bs, &tokens), plain);
/// assert_ne!(keys.block_hashes(bs, &tokens), other);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestKeys {
    lora: Option<String>,
    cache_salt: Option<String>,
    first_media_message: Option<usize>,
}

impl RequestKeys {
    /// Keys of a request for LoRA adapter `lora` (`None`: the base model) with vLLM's
    /// `cache_salt`. Empty strings are no adapter and no salt.
    pub fn new(lora: Option<&str>, cache_salt: Option<&str>) -> Self {
        let some = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_string);
        RequestKeys {
            lora: some(lora),
            cache_salt: some(cache_salt),
            first_media_message: None,
        }
    }

    /// The keys of `req`: its `model` is an adapter when `is_adapter` says so (nothing in a
    /// request tells an adapter from a base model), its `cache_salt`, and where its first media
    /// message is.
    pub fn of(req: &Request, is_adapter: impl Fn(&str) -> bool) -> Self {
        let lora = req.model.as_deref().filter(|m| is_adapter(m));
        RequestKeys {
            first_media_message: req.first_media_message(),
            ..RequestKeys::new(lora, req.cache_salt.as_deref())
        }
    }

    /// The adapter's name, if the request runs on one.
    pub fn lora(&self) -> Option<&str> {
        self.lora.as_deref()
    }

    /// vLLM's `cache_salt`, if the request has one.
    pub fn cache_salt(&self) -> Option<&str> {
        self.cache_salt.as_deref()
    }

    /// The index of the first chat message with media: the prompt is routed on the text
    /// before its content.
    pub fn first_media_message(&self) -> Option<usize> {
        self.first_media_message
    }

    /// The router's salt: the adapter's name.
    pub fn salt(&self) -> Salt {
        self.lora.as_deref().map(Salt::lora).unwrap_or_default()
    }

    /// Each full block's extra keys for a prompt of `tokens` tokens (the salt on the first);
    /// empty when the request has none.
    pub fn extra_keys(&self, block_size: BlockSize, tokens: usize) -> Vec<ExtraKeys> {
        match &self.cache_salt {
            None => Vec::new(),
            Some(salt) => vllm_extra_keys(block_size, tokens, &[], Some(salt)),
        }
    }

    /// The chained hashes of every full block of `tokens` under these keys: what the router
    /// looks up and what an engine with the same keys caches.
    pub fn block_hashes(&self, block_size: BlockSize, tokens: &[u32]) -> Vec<BlockHash> {
        let keys = self.extra_keys(block_size, tokens.len());
        self.salt().block_hashes(block_size, tokens, &keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::{Role, Router, WorkerId};

    #[test]
    fn the_router_finds_the_blocks_these_keys_hash() {
        let bs = BlockSize::new(4).unwrap();
        let tokens: Vec<u32> = (0..12).collect();
        let cases = [
            RequestKeys::default(),
            RequestKeys::new(Some("a"), None),
            RequestKeys::new(None, Some("s")),
            RequestKeys::new(Some("a"), Some("s")),
        ];
        for (i, stored) in cases.iter().enumerate() {
            let mut router = Router::builder().block_size(bs).build().unwrap();
            let w = WorkerId::new(0);
            router.add_worker(w);
            let blocks = stored.block_hashes(bs, &tokens);
            assert_eq!(blocks.len(), 3);
            router
                .apply_event(
                    w,
                    0,
                    &kvroute::KvEvent::Stored {
                        parent: None,
                        blocks,
                    },
                )
                .unwrap();
            for (j, asked) in cases.iter().enumerate() {
                let id = kvroute::RequestId::new(j as u64);
                let keys = asked.extra_keys(bs, tokens.len());
                let d = router
                    .route_tokens_keyed(id, &tokens, &asked.salt(), &keys, Role::Unified)
                    .unwrap();
                router.finish(id).unwrap();
                let want = if i == j { 3 } else { 0 };
                assert_eq!(d.cache_hits, want, "stored {stored:?}, asked {asked:?}");
            }
        }
    }

    #[test]
    fn empty_names_are_no_keys_and_adapters_are_the_callers_to_know() {
        assert_eq!(RequestKeys::new(Some(""), Some("")), RequestKeys::default());
        let body = br#"{"model": "base", "prompt": "x", "cache_salt": "t"}"#;
        let req = crate::openai::parse(crate::openai::Endpoint::Completions, body).unwrap();
        let keys = RequestKeys::of(&req, |m| m == "lora");
        assert_eq!((keys.lora(), keys.cache_salt()), (None, Some("t")));
        assert_eq!(keys.salt(), Salt::default());
    }
}
