//! kvmock's injected faults over real sockets: an engine that dies after N streamed tokens
//! (its stream ends without `[DONE]`, the process exits with status 3), and chat requests that
//! continue their final message (vLLM's `continue_final_message`), as a router's migration
//! sends them.

mod common;

use std::time::Duration;

use common::{eventually, free_port, Mock};
use serde_json::{json, Value};

#[test]
fn an_engine_dies_after_the_tokens_it_was_given() {
    let mut m = Mock::start(
        free_port(),
        &["--speedup", "20", "--fault-die-after-tokens", "5"],
    );
    let body = json!({"prompt": "hello", "max_tokens": 20, "stream": true}).to_string();
    let got = kvtest::net::request(m.port, "POST", "/v1/completions", "", &body);
    assert_eq!(got.status, 200);
    assert!(!got.body.contains("[DONE]"), "{}", got.body);
    let tokens = got
        .body
        .split("\n\n")
        .filter(|e| e.starts_with("data: {"))
        .count();
    assert!((1..=5).contains(&tokens), "{tokens} tokens: {}", got.body);
    let child = m.child_mut();
    let mut status = None;
    eventually("kvmock exits", Duration::from_secs(10), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    assert_eq!(status.unwrap().code(), Some(3));
    m.stop();
}

#[test]
fn a_chat_continues_its_final_message() {
    let m = Mock::start(free_port(), &["--speedup", "50"]);
    let msgs = json!([{"role": "user", "content": "Say hello"}]);
    let turn = |body: Value| {
        let (s, text) = m.post("/v1/chat/completions", &body.to_string());
        assert_eq!(s, 200, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let fresh = turn(json!({"messages": msgs, "max_tokens": 4}));
    let partial = fresh["choices"][0]["message"]["content"].as_str().unwrap();
    let mut cont = msgs.as_array().unwrap().clone();
    cont.push(json!({"role": "assistant", "content": partial}));
    let next = turn(json!({"messages": cont, "max_tokens": 4,
                           "continue_final_message": true, "add_generation_prompt": false}));
    // The continued prompt is the fresh one plus the answer so far, with no new turn opened:
    // with one token per byte, exactly the answer's length longer.
    let prompt = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompt(&next), prompt(&fresh) + partial.len() as u64);
    // Without an assistant message to continue: a 400 naming the field.
    let (s, text) = m.post(
        "/v1/chat/completions",
        &json!({"messages": msgs, "continue_final_message": true}).to_string(),
    );
    assert_eq!(s, 400, "{text}");
    assert!(text.contains("continue_final_message"), "{text}");
}
