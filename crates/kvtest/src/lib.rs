//! Test support for kvkit (`publish = false`): the naive models, the operation enums that drive
//! them and their proptest strategies, the seeded generator, and the fuzz target bodies. Shared
//! by the proptests of `kvcache` and `kvroute`, the fuzz targets (`fuzz/`), the fuzz regression
//! replay (`tests/fuzz_regressions.rs`), the benches, the examples and the soak test, so that
//! none of them copies or `#[path]`-includes another's files.
//!
//! - [`chains`]: block lists that obey the sequence-hash contract (a hash names its prefix).
//! - [`splitmix`]: SplitMix64, the deterministic generator of benches, examples and tests.
//! - [`cache`]: a naive `BlockCache`, its [`cache::Op`], the differential [`cache::step`].
//! - [`index`]: a naive `CacheIndex`, its [`index::Op`], the differential [`index::step`].
//! - [`router`]: a naive `Router` (on the index model) and the one [`router::Op`] that both the
//!   router proptest and the `router_ops` fuzz target drive it with.
//! - [`fuzz`]: the fuzz target bodies, `run(&[u8])` each.
//!
//! The models are slow and obviously right (vectors, sets, linear scans); the real code is
//! checked against them after every operation, together with its `check_invariants`.
#![forbid(unsafe_code)]

pub mod cache;
pub mod chains;
pub mod fuzz;
pub mod index;
pub mod net;
pub mod router;
pub mod splitmix;
