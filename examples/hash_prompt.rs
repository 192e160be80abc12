//! Hash a prompt into KV block hashes, the way a router and an engine both must.
//!
//! `cargo run --example hash_prompt [TOKENS] [BLOCK_SIZE]` (defaults: 100 tokens, block 16).

use kvkit::kvblock::{BlockHasher, BlockSequence, BlockSize};

fn main() {
    let mut args = std::env::args().skip(1);
    let tokens: usize = parse(args.next(), 100, "TOKENS");
    let block_size = match BlockSize::new(parse(args.next(), 16, "BLOCK_SIZE")) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("hash_prompt: BLOCK_SIZE: {e}");
            std::process::exit(2);
        }
    };
    // A stand-in for a tokenizer's output: a shared "system prompt" then a user turn.
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    let hasher = BlockHasher::new(block_size);

    let hashes = hasher.sequence_hashes(&prompt);
    println!(
        "{tokens} tokens at block size {block_size}: {} full block(s), {} token(s) in the partial tail",
        hashes.len(),
        tokens % block_size.get()
    );
    for (i, h) in hashes.iter().enumerate() {
        println!("  block {i:>3}: {h}");
    }

    // The same hashes arrive incrementally as a conversation grows.
    let mut seq = BlockSequence::new(hasher);
    let mut incremental = Vec::new();
    for turn in prompt.chunks(37) {
        incremental.extend(seq.extend(turn));
    }
    assert_eq!(
        incremental, hashes,
        "incremental hashing must equal batch hashing"
    );
    println!(
        "incremental hashing in 37-token turns gives the same {} hashes",
        incremental.len()
    );

    let lora = hasher.with_lora_name("my-lora").sequence_hashes(&prompt);
    if let (Some(a), Some(b)) = (hashes.first(), lora.first()) {
        println!("a LoRA adapter salts every hash: block 0 is {b} instead of {a}");
    }
}

fn parse(arg: Option<String>, default: usize, name: &str) -> usize {
    match arg {
        None => default,
        Some(s) => s.parse().unwrap_or_else(|_| {
            eprintln!("hash_prompt: {name}: expected a whole number, got {s:?}");
            std::process::exit(2);
        }),
    }
}
