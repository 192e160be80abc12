//! One engine's capacity-bounded LRU block cache with longest-leading-run matching, which emits
//! KV events, and the router's `CacheIndex`, which mirrors many workers from those events.
//!
//! This crate is being built; see the workspace README for what exists today.
#![deny(missing_docs)]
