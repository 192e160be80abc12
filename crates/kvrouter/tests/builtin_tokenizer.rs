//! Text prompts and chats with no model files: `kvrouter --router-tokenizer-path builtin:bytes`
//! in front of two `kvmock --tokenizer builtin:bytes` engines (the book's quick start). The
//! second identical request of each kind lands where the first one's blocks are, as hits. Real
//! processes on loopback ports; every wait is bounded.

mod common;

use common::{Engine, Kvrouter};
use kvtest::net::free_port;
use serde_json::{json, Value};

/// Routed requests and hit blocks so far, from the router's metrics.
fn hits(server: &Kvrouter) -> (f64, f64) {
    (
        server.metric("kvrouter_request_blocks_total"),
        server.metric("kvrouter_cache_hit_blocks_total"),
    )
}

/// Sends `body` twice to `path`: the first time nothing hits, the second time every full block
/// of the prompt is a hit on the worker the first one went to.
fn twice_hits(server: &Kvrouter, path: &str, body: &Value, blocks: u64) {
    let before: Vec<(String, u64)> = server.routed();
    let held: Vec<u64> = before.iter().map(|(w, _)| server.block_count(w)).collect();
    let (req0, hit0) = hits(server);
    let (status, text) = server.post(path, &body.to_string());
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "{v}");
    let (req1, hit1) = hits(server);
    assert_eq!(req1 - req0, blocks as f64, "blocks of the first request");
    assert_eq!(hit1, hit0, "a new prompt hits nothing");
    // The worker whose count went up, and its blocks once the engine's events are in.
    let after = server.routed();
    let i = (0..after.len()).find(|&i| after[i] != before[i]).unwrap();
    server.wait_blocks(&after[i].0, held[i] + blocks);
    let (status, text) = server.post(path, &body.to_string());
    assert_eq!(status, 200, "{text}");
    let (_, hit2) = hits(server);
    assert_eq!(hit2 - hit1, blocks as f64, "the repeat hits every block");
}

#[test]
fn text_and_chat_route_through_the_builtin_bytes_tokenizer() {
    let flags = ["--tokenizer", "builtin:bytes", "--block-size", "16"];
    let engines = [
        Engine::start_with(free_port(), free_port(), free_port(), &flags),
        Engine::start_with(free_port(), free_port(), free_port(), &flags),
    ];
    let server = Kvrouter::start(
        &[&engines[0], &engines[1]],
        &["--router-tokenizer-path", "builtin:bytes"],
    );

    // 64 ASCII characters: 64 tokens, 4 blocks of 16.
    let prompt = "The quick brown fox jumps over the lazy dog, again and again, ok";
    assert_eq!(prompt.len(), 64);
    let completion = json!({"model": "mock", "prompt": prompt, "max_tokens": 2});
    twice_hits(&server, "/v1/completions", &completion, 4);

    // A chat renders with ChatML on both sides (the router's and kvmock's builtin:bytes):
    // "<|im_start|>user\n" + 64 + "<|im_end|>\n" + "<|im_start|>assistant\n" = 114 bytes,
    // 7 full blocks.
    let chat = json!({"model": "mock", "max_tokens": 2,
                      "messages": [{"role": "user", "content": prompt}]});
    twice_hits(&server, "/v1/chat/completions", &chat, 7);
}

#[test]
fn an_unknown_builtin_tokenizer_is_refused_by_name() {
    let kvmock = common::kvmock_bin();
    let kvrouter = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvrouter"));
    for (bin, flag) in [
        (kvrouter, "--router-tokenizer-path"),
        (kvmock, "--tokenizer"),
    ] {
        let out = std::process::Command::new(&bin)
            .args(["--host", "127.0.0.1", "--port", &free_port().to_string()])
            .args([flag, "builtin:xyz"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{}", bin.display());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("builtin:xyz") && err.contains("expected builtin:bytes"),
            "{}: {err}",
            bin.display()
        );
    }
}
