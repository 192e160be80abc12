//! Block lists that obey the sequence-hash contract: a block's hash names the block *and its
//! whole prefix*, so the same hash never follows two different parents. `CacheIndex::overlaps`
//! relies on it (a worker whose mirror is prefix-closed holds a block only with its prefix), so
//! every generated event and query is built from paths of small codes, the way real sequence
//! hashes are built from token blocks.
//!
//! ```
//! use kvtest::chains::path;
//! let a = path(&[1, 2, 0], 3);
//! let b = path(&[1, 2, 2], 3);
//! assert_eq!(a[..2], b[..2]); // the same leading codes, the same blocks
//! assert_ne!(a[2], b[2]);
//! ```

use kvblock::{chain, BlockHash, LocalBlockHash};
use kvcache::KvEvent;

/// The chain of sequence hashes of `codes`, each taken modulo `alphabet` (at least 1): block
/// `i` names `codes[..=i]`.
pub fn path(codes: &[u8], alphabet: u8) -> Vec<BlockHash> {
    let mut parent = None;
    codes
        .iter()
        .map(|&c| {
            let h = chain(parent, LocalBlockHash::new(u64::from(c % alphabet.max(1))));
            parent = Some(h);
            h
        })
        .collect()
}

/// A `Stored` event of the path of `codes` (see [`path`]): with `split` `None` the whole path
/// from the root, else the blocks from position `1 + split % len` on, under the block before
/// them as parent (which the worker may or may not hold).
pub fn stored(codes: &[u8], split: Option<u8>, alphabet: u8) -> KvEvent {
    let blocks = path(codes, alphabet);
    match split {
        Some(s) if !blocks.is_empty() => {
            let at = 1 + usize::from(s) % blocks.len();
            KvEvent::Stored {
                parent: Some(blocks[at - 1]),
                blocks: blocks[at..].to_vec(),
            }
        }
        _ => KvEvent::Stored {
            parent: None,
            blocks,
        },
    }
}

/// A `Removed` event of the blocks of the path of `codes` from position `from % (len + 1)` on:
/// a middle stretch or a whole path leaves holes where a longer chain stays resident.
pub fn removed(codes: &[u8], from: u8, alphabet: u8) -> KvEvent {
    let blocks = path(codes, alphabet);
    let from = usize::from(from) % (blocks.len() + 1);
    KvEvent::Removed {
        blocks: blocks[from..].to_vec(),
    }
}

/// A `Removed` event of the one block at position `at % len` of the path of `codes`: a hole
/// wherever the path continues on the worker.
pub fn removed_one(codes: &[u8], at: u8, alphabet: u8) -> KvEvent {
    let blocks = path(codes, alphabet);
    let blocks = match blocks.len() {
        0 => Vec::new(),
        n => vec![blocks[usize::from(at) % n]],
    };
    KvEvent::Removed { blocks }
}
