//! `hash_incremental`: incremental hashing equals batch hashing for arbitrary tokens, block
//! sizes, salts and splits.

use arbitrary::{Arbitrary, Unstructured};
use kvblock::{BlockHasher, BlockSequence, BlockSize};

/// One fuzz input.
#[derive(Debug, Arbitrary)]
pub struct Input {
    /// The block size (0 must be rejected).
    pub block_size: u8,
    /// The LoRA name salting the hashes.
    pub lora: String,
    /// The tokens.
    pub tokens: Vec<u32>,
    /// Where to cut the tokens for incremental hashing (clamped, sorted).
    pub splits: Vec<u16>,
}

/// Runs one input; panics when incremental and batch hashing disagree.
pub fn check(input: &Input) {
    let Ok(bs) = BlockSize::new(usize::from(input.block_size)) else {
        assert_eq!(input.block_size, 0);
        return;
    };
    let h = BlockHasher::new(bs).with_lora_name(&input.lora);
    let batch = h.sequence_hashes(&input.tokens);
    assert_eq!(batch.len(), input.tokens.len() / bs.get());
    assert_eq!(h.local_hashes(&input.tokens).len(), batch.len());

    let mut cuts: Vec<usize> = input
        .splits
        .iter()
        .map(|&c| usize::from(c).min(input.tokens.len()))
        .collect();
    cuts.sort_unstable();
    let mut seq = BlockSequence::new(h);
    let mut got = Vec::new();
    let mut start = 0;
    for c in cuts.into_iter().chain(std::iter::once(input.tokens.len())) {
        seq.extend_into(&input.tokens[start..c], &mut got);
        start = c;
    }
    assert_eq!(got, batch);
    assert_eq!(seq.pending_tokens(), input.tokens.len() % bs.get());
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
