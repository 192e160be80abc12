//! `index_events`: arbitrary event streams of several workers into a `kvcache::CacheIndex`
//! (unknown parents, gaps, duplicates and replays, removals of unknown blocks, `Cleared`, worker
//! removal, `clear_worker`, queries, snapshot/restore), each step compared with the naive model
//! of [`crate::index`] (the model the proptest uses) by [`crate::index::step`]: never a panic,
//! the same `Ok`/`Err` kind, the same `Applied` counts, the same overlaps, block counts, stale
//! flags and next event ids; `check_invariants` after every step.

use arbitrary::{Arbitrary, Unstructured};
use kvcache::{BlockHash, CacheIndex, KvEvent, WorkerId};

use crate::index as model;
use model::{Model, Op};

const MAX_OPS: usize = 300;

/// Worker ids: a few in the first dense word, more across the 32/64 boundaries once
/// placeholders are registered, and extreme raw ids.
fn worker(w: u8) -> u64 {
    match w % 12 {
        9 => 200,
        10 => u64::MAX,
        11 => 1 << 40,
        k => u64::from(k),
    }
}

/// At most 8 codes of a 4-letter alphabet, as a chain of sequence hashes
/// ([`crate::chains::path`]).
fn blocks(v: &[u8]) -> Vec<BlockHash> {
    crate::chains::path(&v[..v.len().min(8)], 4)
}

/// A KV event on paths of codes (at most 8, see [`crate::chains`]).
#[derive(Debug, Arbitrary)]
pub enum FuzzEvent {
    /// `KvEvent::Stored`.
    Stored {
        /// Where the stored tail starts under its parent (`None`: the whole path from the root).
        parent: Option<u8>,
        /// The stored blocks.
        blocks: Vec<u8>,
    },
    /// `KvEvent::Removed`.
    Removed(Vec<u8>),
    /// `KvEvent::Cleared`.
    Cleared,
}

impl FuzzEvent {
    fn event(&self) -> KvEvent {
        match self {
            FuzzEvent::Stored { parent, blocks: b } => {
                crate::chains::stored(&b[..b.len().min(8)], *parent, 4)
            }
            FuzzEvent::Removed(b) => match b.split_first() {
                Some((&from, rest)) => crate::chains::removed(&rest[..rest.len().min(8)], from, 4),
                None => KvEvent::Removed { blocks: Vec::new() },
            },
            FuzzEvent::Cleared => KvEvent::Cleared,
        }
    }
}

/// The encoding of one [`Op`] (worker codes: 0..=8, 200, `u64::MAX`, 2^40): the variants, their
/// order and field types are the byte layout of the target's seeds and regressions.
#[derive(Debug, Arbitrary)]
pub enum FuzzOp {
    /// The next expected id (delta 0), a replay (< 0) or a gap (> 0).
    Apply(u8, i8, FuzzEvent),
    /// An exact id: 0, `u64::MAX`, or anything.
    ApplyAt(u8, u64, FuzzEvent),
    /// [`Op::Add`].
    Add(u8),
    /// [`Op::Remove`].
    Remove(u8),
    /// [`Op::Clear`].
    Clear(u8),
    /// [`Op::Query`] (block ids `% 16`, at most 8).
    Query(Vec<u8>),
    /// [`Op::Restore`].
    Restore,
}

/// One fuzz input.
#[derive(Debug, Arbitrary)]
pub struct Input {
    /// Workers registered first (`% 70`), so dense indices of the tested ones cross the 32- and
    /// 64-worker boundaries of the holder sets.
    pub placeholders: u8,
    /// The operations (at most 300 are applied).
    pub ops: Vec<FuzzOp>,
}

fn op(f: &FuzzOp) -> Op {
    match f {
        FuzzOp::Apply(w, d, e) => Op::Apply {
            worker: worker(*w),
            id_delta: *d,
            event: e.event(),
        },
        FuzzOp::ApplyAt(w, id, e) => Op::ApplyAt {
            worker: worker(*w),
            id: *id,
            event: e.event(),
        },
        FuzzOp::Add(w) => Op::Add(worker(*w)),
        FuzzOp::Remove(w) => Op::Remove(worker(*w)),
        FuzzOp::Clear(w) => Op::Clear(worker(*w)),
        FuzzOp::Query(q) => Op::Query(blocks(q)),
        FuzzOp::Restore => Op::Restore,
    }
}

/// Runs one input; panics on the first disagreement with the model.
pub fn check(input: &Input) {
    let mut real = CacheIndex::new();
    let mut model = Model::default();
    for k in 0..u64::from(input.placeholders % 70) {
        let w = WorkerId::new(10_000 + k);
        real.add_worker(w).expect("few workers");
        model.workers.entry(w).or_default();
    }
    for f in input.ops.iter().take(MAX_OPS) {
        if let Err(e) = model::step(&mut real, &mut model, &op(f)) {
            panic!("index_events: {e}");
        }
    }
}

/// What the fuzz target does with its bytes, for replaying regressions under `cargo test`.
pub fn run(data: &[u8]) {
    if data.len() < <Input as Arbitrary>::size_hint(0).0 {
        return;
    }
    if let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) {
        check(&input);
    }
}
