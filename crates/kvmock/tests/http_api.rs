//! kvmock's OpenAI-compatible API over real sockets: completions (text and token ids, plain and
//! streamed), chat through the model's template, models, health, metrics, and bad input.

mod common;

use common::{completion_body, free_port, sse_events, Mock};
use serde_json::{json, Value};

const WORDS: &[&str] = &[
    "hello",
    "world",
    "user",
    "assistant",
    ":",
    "the",
    "cache",
    "is",
    "warm",
    "system",
];

#[test]
fn completions_chat_models_health_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    kvserve::tokenize::write_test_tokenizer(dir.path(), WORDS).unwrap();
    let tok = dir.path().to_str().unwrap();
    let m = Mock::start(
        free_port(),
        &[
            "--tokenizer",
            tok,
            "--speedup",
            "20",
            "--block-size",
            "4",
            "--served-model-name",
            "tiny",
        ],
    );

    let (s, body) = m.get("/v1/models");
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(m.get("/health").0, 200);
    assert!(m.get("/version").1.contains("kvmock"));

    // Text prompt: the tokenizer's ids (8 words), detokenised output of max_tokens tokens.
    let text = "the cache is warm the cache is warm";
    let req = json!({"model": "tiny", "prompt": text, "max_tokens": 5});
    let (s, body) = m.post("/v1/completions", &req.to_string());
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 8);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let out = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(out.split_whitespace().count(), 5, "{out:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // The same prompt again, streamed: both full blocks are the leading cached run; the
    // output tokens are the same (deterministic).
    let req = json!({"prompt": text, "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}});
    let (s, body) = m.post("/v1/completions", &req.to_string());
    assert_eq!(s, 200);
    let events = sse_events(&body);
    let chunks: Vec<&Value> = events
        .iter()
        .filter(|e| e["choices"].as_array().is_some_and(|c| !c.is_empty()))
        .collect();
    assert_eq!(chunks.len(), 5);
    let streamed: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, out);
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 8);

    // Token ids as the prompt.
    let (s, body) = m.post(
        "/v1/completions",
        &completion_body(&[3, 4, 3, 4, 3], 2, false),
    );
    assert_eq!(s, 200, "{body}");

    // Chat: the template renders "<s>user : hello world assistant :" (7 tokens).
    let req = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3});
    let (s, body) = m.post("/v1/chat/completions", &req.to_string());
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    // Streamed chat: a role chunk, then one content chunk per token.
    let req = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}],
                     "max_tokens": 3, "stream": true});
    let (_, body) = m.post("/v1/chat/completions", &req.to_string());
    let events = sse_events(&body);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(events.len(), 4);
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk"));

    let (s, text) = m.get("/metrics");
    assert_eq!(s, 200);
    // Each family is declared once (Prometheus's format allows no second TYPE line).
    let mut families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .collect();
    let declared = families.len();
    families.sort();
    families.dedup();
    assert_eq!(families.len(), declared, "{text}");
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} in {text}"
        );
    }
    // The last token leaves before the step's bookkeeping ends (tokens go out first), so the
    // gauge may still read 1 for a moment after the stream is complete.
    common::eventually(
        "no request running",
        std::time::Duration::from_secs(2),
        || m.metric("vllm:num_requests_running") == 0.0,
    );
    // Five successful requests, each with one time to first token.
    assert_eq!(m.metric("vllm:time_to_first_token_seconds_count"), 5.0);
    assert!(text.contains("vllm:time_to_first_token_seconds_bucket{"));
    // Every output token after a request's first has one inter-token latency.
    assert_eq!(
        m.metric("vllm:inter_token_latency_seconds_count"),
        m.metric("vllm:generation_tokens_total") - 5.0
    );
    assert!(m.metric("vllm:inter_token_latency_seconds_sum") > 0.0);
    assert!(m.metric("vllm:prefix_cache_hits_total") >= 8.0);
    assert!(m.metric("vllm:prefix_cache_queries_total") >= 16.0);
}

#[test]
fn bad_input_gets_openai_errors_and_other_requests_continue() {
    let m = Mock::start(
        free_port(),
        &[
            "--speedup",
            "50",
            "--num-gpu-blocks",
            "8",
            "--block-size",
            "16",
            "--max-model-len",
            "100",
        ],
    );
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/v1/completions", "{not json", 400, "invalid JSON"),
        ("/v1/completions", "[1, 2]", 400, "JSON object"),
        ("/v1/completions", r#"{"max_tokens": 3}"#, 400, "prompt"),
        (
            "/v1/completions",
            r#"{"prompt": "abc", "max_tokens": 0}"#,
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [], "max_tokens": 2}"#,
            400,
            "empty",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1, -2], "max_tokens": 2}"#,
            400,
            "token id",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "abc", "stream": "yes"}"#,
            400,
            "stream",
        ),
        (
            "/v1/completions",
            r#"{"model": "other", "prompt": "abc"}"#,
            404,
            "does not exist",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#,
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            r#"{"max_tokens": 2}"#,
            400,
            "messages",
        ),
    ];
    for (path, body, status, needle) in cases {
        let (s, text) = m.post(path, body);
        assert_eq!(s, *status, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{body}: {msg}");
        assert_eq!(v["error"]["code"], *status);
        assert!(v["error"]["type"].is_string());
    }
    // Beyond the context (100 tokens), and never fitting 8 blocks of 16 tokens (90 + 60 > 100
    // is the context; 90 tokens + 40 output = 130 tokens = 9 blocks > 8).
    let (s, text) = m.post("/v1/completions", &completion_body(&[7; 90], 20, false));
    assert_eq!(s, 400);
    assert!(text.contains("maximum context length"), "{text}");
    let m2 = Mock::start(free_port(), &["--speedup", "50", "--num-gpu-blocks", "8"]);
    let (s, text) = m2.post("/v1/completions", &completion_body(&[7; 120], 20, false));
    assert_eq!(s, 400);
    assert!(text.contains("KV blocks"), "{text}");
    // Still serving.
    let (s, _) = m.post("/v1/completions", &completion_body(&[7; 40], 4, true));
    assert_eq!(s, 200);
    let (s, _) = m.get("/no/such/route");
    assert_eq!(s, 404);
}
