//! Chat requests with images: `kvrouter` routes them on the text before the first message with
//! a media part (the blocks vLLM hashes without multimodal keys), not on the whole text. Two
//! `kvmock` engines and the server share a word-level tokenizer and chat template; real
//! processes on loopback ports.

mod common;

use common::{Engine, Kvrouter};
use kvtest::net::free_port;
use serde_json::{json, Value};

const WORDS: &[&str] = &[
    "system",
    "user",
    "assistant",
    ":",
    "hello",
    "what",
    "is",
    "this",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
];
const SYSTEM: &str = "one two three four five six seven eight nine ten eleven twelve";

fn chat(user: Value) -> String {
    json!({"model": "mock", "max_tokens": 1, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user},
    ]})
    .to_string()
}

#[test]
fn a_chat_with_an_image_routes_on_the_text_before_its_message() {
    let dir = tempfile::tempdir().unwrap();
    kvserve::tokenize::write_test_tokenizer(dir.path(), WORDS).unwrap();
    let tok = dir.path().to_str().unwrap();
    let flags = ["--tokenizer", tok, "--block-size", "4"];
    let engines = [
        Engine::start_with(free_port(), free_port(), free_port(), &flags),
        Engine::start_with(free_port(), free_port(), free_port(), &flags),
    ];
    let server = Kvrouter::start(
        &[&engines[0], &engines[1]],
        &["--router-tokenizer-path", tok, "--block-size", "4"],
    );
    // "<s> system : one ... twelve user : hello assistant :" is 20 tokens: 5 blocks.
    let (s, body) = server.post("/v1/chat/completions", &chat(json!("hello")));
    assert_eq!(s, 200, "{body}");
    assert_eq!(server.metric("kvrouter_request_blocks_total"), 5.0);
    let first = server.routed_once();
    server.wait_blocks(&first, 5);

    // With an image in the user message, only "<s> system : one ... twelve user :" (17 tokens)
    // less its last token is routed on: 4 blocks, all hits on the engine holding them.
    let image = json!([
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "what is this"},
    ]);
    let (s, body) = server.post("/v1/chat/completions", &chat(image));
    assert_eq!(s, 200, "{body}");
    assert_eq!(server.metric("kvrouter_request_blocks_total"), 9.0);
    assert_eq!(server.metric("kvrouter_cache_hit_blocks_total"), 4.0);
    assert!(server.routed().contains(&(first.clone(), 2)));

    // An image in the first message leaves less than a block: routed on load alone.
    let body = json!({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]});
    let (s, text) = server.post("/v1/chat/completions", &body.to_string());
    assert_eq!(s, 200, "{text}");
    assert_eq!(server.metric("kvrouter_request_blocks_total"), 9.0);
}
