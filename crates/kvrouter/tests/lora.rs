//! A LoRA adapter end to end: two `kvmock` engines serving `my-lora` (`--lora-modules`), and
//! `kvrouter`, which learns the adapter from their `/v1/models` and hashes a request for it with
//! the adapter's name, as vLLM (and kvmock) key its blocks. Real processes on loopback ports.

mod common;

use std::time::Duration;

use common::{Engine, Kvrouter};
use kvtest::net::free_port;
use serde_json::Value;

fn completion(model: &str, tokens: &[u32]) -> String {
    serde_json::json!({"model": model, "prompt": tokens, "max_tokens": 1}).to_string()
}

fn cached_tokens(body: &str) -> u64 {
    let v: Value = serde_json::from_str(body).unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("{v}"))
}

#[test]
fn a_lora_request_hashes_with_the_adapter_name_and_hits_its_own_blocks() {
    let lora = ["--lora-modules", "my-lora=/adapters/my-lora"];
    let engines = [
        Engine::start_with(free_port(), free_port(), free_port(), &lora),
        Engine::start_with(free_port(), free_port(), free_port(), &lora),
    ];
    let server = Kvrouter::start(&[&engines[0], &engines[1]], &[]);
    // The adapter is learned from the engines' /v1/models.
    common::eventually("my-lora is learned", Duration::from_secs(10), || {
        server.get_json("/v1/admin/workers")["lora_adapters"] == serde_json::json!(["my-lora"])
    });
    let models = server.get_json("/v1/models");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["mock", "my-lora"], "{models}");
    let blocks = || -> u64 { engines.iter().map(|e| server.block_count(&e.name())).sum() };
    let wait_blocks = |n: u64| {
        common::eventually(
            &format!("the mirrors hold {n} blocks"),
            Duration::from_secs(10),
            || blocks() >= n,
        );
    };

    let prompt: Vec<u32> = (0..64).collect();
    let (s, body) = server.post("/v1/completions", &completion("mock", &prompt));
    assert_eq!(s, 200, "{body}");
    wait_blocks(4);
    // The same tokens for the adapter are other blocks, for the engine and for the router.
    let (s, body) = server.post("/v1/completions", &completion("my-lora", &prompt));
    assert_eq!(s, 200, "{body}");
    assert_eq!(cached_tokens(&body), 0, "{body}");
    assert_eq!(server.metric("kvrouter_cache_hit_blocks_total"), 0.0);
    wait_blocks(8);
    // The adapter's prefix again: routed to the engine holding its blocks, and a hit there.
    let mut longer = prompt.clone();
    longer.extend(500..516);
    let (s, body) = server.post("/v1/completions", &completion("my-lora", &longer));
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["model"], "my-lora", "{v}");
    assert_eq!(cached_tokens(&body), 64, "{body}");
    assert_eq!(server.metric("kvrouter_cache_hit_blocks_total"), 4.0);
    assert_eq!(server.metric("kvrouter_request_blocks_total"), 13.0);
}
