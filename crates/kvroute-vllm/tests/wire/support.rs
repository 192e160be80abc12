//! What the wire tests share: two workers and a router of block size 16 holding both, and
//! consecutive token ids.

use kvblock::BlockSize;
use kvroute::{Router, WorkerId};

pub const W0: WorkerId = WorkerId::new(0);
pub const W1: WorkerId = WorkerId::new(1);

/// A router of block size 16 (seed 1) with workers W0 and W1.
pub fn router() -> Router {
    let mut r = Router::builder()
        .block_size(BlockSize::new(16).unwrap())
        .seed(1)
        .build()
        .unwrap();
    r.add_worker(W0);
    r.add_worker(W1);
    r
}

/// Token ids `start..start + n`.
pub fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}
