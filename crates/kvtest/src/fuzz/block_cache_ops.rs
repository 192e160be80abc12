//! `block_cache_ops`: arbitrary insert / lookup / match / pin / unpin / set_capacity / clear
//! sequences on a `kvcache::BlockCache`, each step compared with the naive model of
//! [`crate::cache`] (the model the proptest uses) by [`crate::cache::step`]: same answers, same
//! error kinds, same events, same recency order, pins and counters; `check_invariants` after
//! every step.

use arbitrary::{Arbitrary, Unstructured};
use kvblock::{BlockHash, BlockHasher, BlockSize};
use kvcache::BlockCache;

use crate::cache as model;
use model::{Model, Op};

/// Steps per input: the model is quadratic, and longer runs find nothing shorter ones do not.
const MAX_OPS: usize = 200;

/// A prompt's chain: mostly real chained hashes of short strings over a 3-letter alphabet at
/// block size 1 (so prompts share prefixes often), sometimes small raw ids that may contradict
/// the chains (repeats, gaps, other parents).
#[derive(Debug, Arbitrary)]
pub enum Chain {
    /// Up to 8 tokens `% 3`, hashed at block size 1.
    Tokens(Vec<u8>),
    /// Up to 5 raw ids `% 6`.
    Ids(Vec<u8>),
}

/// The encoding of one [`Op`]: the variants, their order and field types are the byte layout of
/// the target's seeds and regressions.
#[derive(Debug, Arbitrary)]
pub enum FuzzOp {
    /// [`Op::Insert`].
    Insert(Chain),
    /// [`Op::Lookup`].
    Lookup(Chain),
    /// Pin the chain from position `.1 % 3` (a request may pin from mid-chain).
    Pin(Chain, u8),
    /// Unpin the chain from position `.1 % 3`.
    Unpin(Chain, u8),
    /// `None`: unbounded; 255: `usize::MAX`; else `% 14` (0 holds nothing).
    Capacity(Option<u8>),
    /// [`Op::Clear`].
    Clear,
}

/// One fuzz input: the starting capacity and the operations.
#[derive(Debug, Arbitrary)]
pub struct Input {
    /// `None` or 0: unbounded; else `% 12`.
    pub capacity: Option<u8>,
    /// The operations (at most 200 are applied).
    pub ops: Vec<FuzzOp>,
}

fn chain(c: &Chain) -> Vec<BlockHash> {
    match c {
        Chain::Tokens(t) => {
            let tokens: Vec<u32> = t.iter().take(8).map(|&x| u32::from(x % 3)).collect();
            BlockHasher::new(BlockSize::new(1).expect("non-zero")).sequence_hashes(&tokens)
        }
        Chain::Ids(ids) => ids
            .iter()
            .take(5)
            .map(|&x| BlockHash::new(u64::from(x % 6)))
            .collect(),
    }
}

fn from_mid(c: &Chain, k: u8) -> Vec<BlockHash> {
    let c = chain(c);
    c[usize::from(k % 3).min(c.len())..].to_vec()
}

fn op(f: &FuzzOp) -> Op {
    match f {
        FuzzOp::Insert(c) => Op::Insert(chain(c)),
        FuzzOp::Lookup(c) => Op::Lookup(chain(c)),
        FuzzOp::Pin(c, k) => Op::Pin(from_mid(c, *k)),
        FuzzOp::Unpin(c, k) => Op::Unpin(from_mid(c, *k)),
        FuzzOp::Capacity(None) => Op::Capacity(None),
        FuzzOp::Capacity(Some(255)) => Op::Capacity(Some(usize::MAX)),
        FuzzOp::Capacity(Some(c)) => Op::Capacity(Some(usize::from(*c % 14))),
        FuzzOp::Clear => Op::Clear,
    }
}

/// Runs one input; panics on the first disagreement with the model.
pub fn check(input: &Input) {
    let cap = input.capacity.map(|c| usize::from(c % 12));
    let mut real = BlockCache::new(cap.filter(|&c| c > 0));
    let mut model = Model::new(cap);
    let mut probes = model::strategy::probes();
    probes.push((0..6).map(BlockHash::new).collect());
    for f in input.ops.iter().take(MAX_OPS) {
        if let Err(e) = model::step(&mut real, &mut model, &op(f), &probes) {
            panic!("block_cache_ops: {e}");
        }
    }
}

/// What the fuzz target does with its bytes (as `libfuzzer_sys::fuzz_target!` decodes a typed
/// input), for replaying regressions under `cargo test`.
pub fn run(data: &[u8]) {
    if data.len() < <Input as Arbitrary>::size_hint(0).0 {
        return;
    }
    if let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) {
        check(&input);
    }
}
