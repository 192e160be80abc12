//! Property tests of the hashing contract.

use kvblock::{BlockHasher, BlockSequence, BlockSize, ExtraKeys};
use proptest::prelude::*;

fn hasher(bs: usize) -> BlockHasher {
    BlockHasher::new(BlockSize::new(bs).expect("non-zero"))
}

/// A naive model: the contract spelled out with byte vectors and nothing clever.
fn model_sequence(bs: usize, seed: u64, tokens: &[u32]) -> Vec<u64> {
    model_keyed(bs, seed, tokens, &[])
}

/// The keyed model: per block, the plain local hash re-keyed by the documented encoding of a
/// list of text keys (each `0x01`, its length as u64 LE, its bytes).
fn model_keyed(bs: usize, seed: u64, tokens: &[u32], keys: &[Vec<String>]) -> Vec<u64> {
    use xxhash_rust::xxh3::xxh3_64_with_seed;
    let mut out = Vec::new();
    let mut prev: Option<u64> = None;
    for (i, block) in tokens.chunks(bs).filter(|b| b.len() == bs).enumerate() {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut local = xxh3_64_with_seed(&bytes, seed);
        if let Some(k) = keys.get(i).filter(|k| !k.is_empty()) {
            let mut enc = b"kvblock/extra-keys/1".to_vec();
            for s in k {
                enc.push(0x01);
                enc.extend_from_slice(&(s.len() as u64).to_le_bytes());
                enc.extend_from_slice(s.as_bytes());
            }
            local = xxh3_64_with_seed(&enc, local);
        }
        let seq = match prev {
            None => local,
            Some(p) => {
                let mut b = p.to_le_bytes().to_vec();
                b.extend_from_slice(&local.to_le_bytes());
                xxh3_64_with_seed(&b, seed)
            }
        };
        out.push(seq);
        prev = Some(seq);
    }
    out
}

proptest! {
    #[test]
    fn keyed_matches_naive_model(bs in 1usize..20, tokens in prop::collection::vec(any::<u32>(), 0..120),
                                 keys in prop::collection::vec(prop::collection::vec("[a-z]{0,4}", 0..3), 0..10),
                                 lora in "[a-z]{0,3}") {
        let h = hasher(bs).with_lora_name(&lora);
        let extra: Vec<ExtraKeys> = keys
            .iter()
            .map(|k| k.iter().fold(ExtraKeys::new(), |e, s| e.str(s)))
            .collect();
        let got: Vec<u64> = h.sequence_hashes_keyed(&tokens, &extra).iter().map(|x| x.get()).collect();
        prop_assert_eq!(&got, &model_keyed(bs, h.seed(), &tokens, &keys));
        // Blocks before the first keyed one hash as plain blocks; from it on, differently.
        let plain = h.sequence_hashes(&tokens);
        let first = keys.iter().position(|k| !k.is_empty()).unwrap_or(usize::MAX);
        for (i, (a, b)) in got.iter().zip(&plain).enumerate() {
            prop_assert_eq!(a == &b.get(), i < first);
        }
    }

    #[test]
    fn matches_naive_model(bs in 1usize..40, tokens in prop::collection::vec(any::<u32>(), 0..300),
                           lora in "[a-z]{0,6}", ns in "[a-z]{0,6}") {
        let h = hasher(bs).with_lora_name(&lora).with_namespace(&ns);
        let got: Vec<u64> = h.sequence_hashes(&tokens).iter().map(|x| x.get()).collect();
        prop_assert_eq!(got, model_sequence(bs, h.seed(), &tokens));
    }

    #[test]
    fn prefix_property(bs in 1usize..40, tokens in prop::collection::vec(any::<u32>(), 0..300), cut in 0usize..300) {
        let h = hasher(bs);
        let cut = cut.min(tokens.len());
        let whole = h.sequence_hashes(&tokens);
        let prefix = h.sequence_hashes(&tokens[..cut]);
        prop_assert_eq!(&whole[..prefix.len()], &prefix[..]);
        prop_assert_eq!(prefix.len(), cut / bs);
    }

    #[test]
    fn incremental_equals_batch(bs in 1usize..40, tokens in prop::collection::vec(any::<u32>(), 0..300),
                                mut cuts in prop::collection::vec(0usize..300, 0..8)) {
        let h = hasher(bs).with_namespace("tenant");
        cuts.iter_mut().for_each(|c| *c = (*c).min(tokens.len()));
        cuts.sort_unstable();
        let mut s = BlockSequence::new(h);
        let mut got = Vec::new();
        let mut start = 0;
        for &c in cuts.iter().chain(std::iter::once(&tokens.len())) {
            got.extend(s.extend(&tokens[start..c]));
            start = c;
        }
        prop_assert_eq!(&got, &h.sequence_hashes(&tokens));
        prop_assert_eq!(s.pending_tokens(), tokens.len() % bs);
        prop_assert_eq!(s.completed_blocks(), got.len());
    }

    #[test]
    fn tail_never_changes_full_blocks(bs in 1usize..40, tokens in prop::collection::vec(any::<u32>(), 0..200),
                                      tail in prop::collection::vec(any::<u32>(), 0..40)) {
        let h = hasher(bs);
        let full = tokens.len() - tokens.len() % bs;
        let tail = &tail[..tail.len().min(bs - 1)];
        let mut with_tail = tokens[..full].to_vec();
        with_tail.extend_from_slice(tail);
        prop_assert_eq!(h.sequence_hashes(&tokens[..full]), h.sequence_hashes(&with_tail));
        prop_assert_eq!(h.local_hashes(&tokens[..full]), h.local_hashes(&with_tail));
    }

    #[test]
    fn salt_changes_every_hash(bs in 1usize..20, tokens in prop::collection::vec(any::<u32>(), 1..200),
                               a in "[a-z]{1,8}", b in "[a-z]{1,8}") {
        prop_assume!(a != b);
        let h = hasher(bs);
        let plain = h.sequence_hashes(&tokens);
        for salted in [h.with_lora_name(&a), h.with_namespace(&a)] {
            let s = salted.sequence_hashes(&tokens);
            prop_assert!(plain.iter().zip(&s).all(|(x, y)| x != y));
            let l = salted.local_hashes(&tokens);
            prop_assert!(h.local_hashes(&tokens).iter().zip(&l).all(|(x, y)| x != y));
        }
        let la = h.with_lora_name(&a).sequence_hashes(&tokens);
        let lb = h.with_lora_name(&b).sequence_hashes(&tokens);
        prop_assert!(la.iter().zip(&lb).all(|(x, y)| x != y));
        // The same string as LoRA name and as namespace must not collide either.
        let na = h.with_namespace(&a).sequence_hashes(&tokens);
        prop_assert!(la.iter().zip(&na).all(|(x, y)| x != y));
    }

    #[test]
    fn empty_salt_is_no_salt(bs in 1usize..20, tokens in prop::collection::vec(any::<u32>(), 0..100)) {
        let h = hasher(bs);
        prop_assert_eq!(h.with_lora_name("").with_namespace("").sequence_hashes(&tokens), h.sequence_hashes(&tokens));
    }
}

#[cfg(feature = "serde")]
#[test]
fn serde_as_plain_integers() {
    let h = kvblock::BlockHash::new(46);
    assert_eq!(serde_json::to_string(&h).unwrap(), "46");
    let back: kvblock::BlockHash = serde_json::from_str("46").unwrap();
    assert_eq!(back, h);
    let l: kvblock::LocalBlockHash = serde_json::from_str("18446744073709551615").unwrap();
    assert_eq!(l.get(), u64::MAX);
    let bs: BlockSize = serde_json::from_str("16").unwrap();
    assert_eq!(bs.get(), 16);
    assert!(serde_json::from_str::<BlockSize>("0").is_err());
}
