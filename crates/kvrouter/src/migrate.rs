//! Mid-stream migration (`--migration-limit`): what the router reads of a streamed answer, the
//! request that continues it on another worker, and the continuation's events rewritten into
//! the client's stream.
//!
//! The router forwards a streamed answer event by event (an event is complete at its blank
//! line), so a worker that fails mid-event never leaves half an event with the client. When it
//! fails before `[DONE]`, the events forwarded so far say what the client has: its text and its
//! number of tokens (one per chunk, as vLLM streams without speculative decoding). The request
//! is sent again with that text appended to the prompt (completions) or as the final assistant
//! message to continue (chat, vLLM's `continue_final_message`) and `max_tokens` reduced by the
//! tokens already streamed; the continuation's events get the first answer's `id` and
//! `created`, lose their opening role chunk, and their usage counts the whole answer.

use serde_json::{Map, Value};

use kvserve::openai::Endpoint;

/// Most bytes of an unfinished event held back; past it, the stream is forwarded as it comes
/// and cannot migrate (no engine sends events this long).
const MAX_EVENT_BYTES: usize = 1 << 20;

/// Cuts a byte stream into complete SSE events: what [`push`](Self::push) returns ends at an
/// event's end; the rest waits for more bytes.
#[derive(Debug, Default)]
pub(crate) struct Events {
    held: Vec<u8>,
    /// An event grew past `MAX_EVENT_BYTES`: bytes pass as they come from then on.
    passthrough: bool,
}

impl Events {
    /// Takes `data`; returns the complete events now available (empty: none yet).
    pub(crate) fn push(&mut self, data: &[u8]) -> Vec<u8> {
        if self.passthrough {
            return data.to_vec();
        }
        if self.held.is_empty() {
            if let Some(end) = last_event_end(data) {
                self.held.extend_from_slice(&data[end..]);
                return data[..end].to_vec();
            }
        }
        self.held.extend_from_slice(data);
        match last_event_end(&self.held) {
            Some(end) => {
                let rest = self.held.split_off(end);
                std::mem::replace(&mut self.held, rest)
            }
            None if self.held.len() > MAX_EVENT_BYTES => {
                self.passthrough = true;
                std::mem::take(&mut self.held)
            }
            None => Vec::new(),
        }
    }

    /// Bytes of an unfinished event, held back.
    #[cfg(test)]
    pub(crate) fn held(&self) -> &[u8] {
        &self.held
    }

    /// Whether events are still cut (false once an event outgrew the limit).
    pub(crate) fn whole(&self) -> bool {
        !self.passthrough
    }
}

/// The end (exclusive) of the last complete event in `b`: after a blank line (`\n\n` or
/// `\r\n\r\n`).
fn last_event_end(b: &[u8]) -> Option<usize> {
    (1..b.len())
        .rev()
        .find(|&i| b[i] == b'\n' && (b[i - 1] == b'\n' || (i >= 2 && &b[i - 2..i] == b"\n\r")))
        .map(|i| i + 1)
}

/// The `data:` payloads of complete events, in order.
fn payloads(events: &[u8]) -> impl Iterator<Item = &str> {
    std::str::from_utf8(events)
        .unwrap_or("")
        .split('\n')
        .filter_map(|line| line.trim_end_matches('\r').strip_prefix("data:"))
        .map(str::trim_start)
}

/// What the client has of a streamed answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Answer {
    /// The answer's `id` and `created`, from its first chunk.
    pub id: Option<Value>,
    pub created: Option<Value>,
    /// The text streamed so far.
    pub text: String,
    /// Token chunks streamed so far.
    pub tokens: u64,
    /// A chunk carried a `finish_reason`.
    pub finished: bool,
    /// `[DONE]` came.
    pub done: bool,
    /// An error event came (vLLM reports errors inside the stream).
    pub error: bool,
}

impl Answer {
    /// Reads complete events (as forwarded to the client).
    pub(crate) fn read(&mut self, events: &[u8]) {
        for data in payloads(events) {
            if data == "[DONE]" {
                self.done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if v.get("error").is_some() {
                self.error = true;
                continue;
            }
            if self.id.is_none() {
                self.id = v.get("id").cloned();
                self.created = v.get("created").cloned();
            }
            let Some(choice) = v["choices"].get(0) else {
                continue;
            };
            if !choice["finish_reason"].is_null() {
                self.finished = true;
            }
            let text = choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str());
            let role_only = choice["delta"].get("role").is_some()
                && text.is_none_or(str::is_empty)
                && choice["finish_reason"].is_null();
            if let (Some(t), false) = (text, role_only) {
                self.text.push_str(t);
                self.tokens += 1;
            }
        }
    }
}

/// Tokenises text (the router's tokenizer).
pub(crate) type Encode<'a> = dyn Fn(&str) -> Result<Vec<u32>, String> + 'a;

/// The body that continues `answer` of the request `body` sent to `endpoint`, or why it cannot
/// be continued. `encode` tokenises text (the router's tokenizer), needed only for a prompt of
/// token ids. `None` when the answer is complete (its `max_tokens` streamed).
pub(crate) fn continuation(
    endpoint: Endpoint,
    body: &[u8],
    answer: &Answer,
    encode: Option<&Encode<'_>>,
) -> Result<Option<Vec<u8>>, String> {
    let mut req: Map<String, Value> = match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => m,
        _ => return Err("the request body is not a JSON object".into()),
    };
    if req.get("n").and_then(Value::as_u64).unwrap_or(1) > 1
        || req.get("best_of").and_then(Value::as_u64).unwrap_or(1) > 1
    {
        return Err("n > 1 answers cannot be continued one by one".into());
    }
    if req.get("echo").and_then(Value::as_bool) == Some(true) {
        return Err("an echoed prompt would be echoed again".into());
    }
    let chat = matches!(endpoint, Endpoint::Chat);
    let keys: &[&str] = if chat {
        &["max_completion_tokens", "max_tokens"]
    } else {
        &["max_tokens"]
    };
    for &k in keys {
        if let Some(max) = req.get(k).and_then(Value::as_u64) {
            if answer.tokens >= max {
                return Ok(None);
            }
            req.insert(k.into(), Value::from(max - answer.tokens));
            break;
        }
    }
    if answer.text.is_empty() {
        // Nothing to continue from (no token yet, or only empty ones): the request again.
        return serde_json::to_vec(&req)
            .map(Some)
            .map_err(|e| e.to_string());
    }
    if !chat {
        let prompt = match req.get("prompt") {
            Some(Value::String(p)) => Value::from(format!("{p}{}", answer.text)),
            Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => {
                let Some(encode) = encode else {
                    return Err(
                        "a prompt of token ids needs the router's tokenizer to continue".into(),
                    );
                };
                let mut ids = ids.clone();
                ids.extend(encode(&answer.text)?.into_iter().map(Value::from));
                Value::Array(ids)
            }
            _ => return Err("a batch of prompts cannot be continued".into()),
        };
        req.insert("prompt".into(), prompt);
    } else {
        let continuing = req_flag(&req, "continue_final_message");
        let Some(Value::Array(msgs)) = req.get_mut("messages") else {
            return Err("no messages".into());
        };
        match msgs.last_mut() {
            // The client's own final message was being continued: it grows.
            Some(Value::Object(last)) if continuing => {
                let so_far = last.get("content").and_then(Value::as_str).unwrap_or("");
                let grown = format!("{so_far}{}", answer.text);
                last.insert("content".into(), Value::from(grown));
            }
            _ => msgs.push(serde_json::json!({"role": "assistant", "content": answer.text})),
        }
        req.insert("continue_final_message".into(), Value::Bool(true));
        req.insert("add_generation_prompt".into(), Value::Bool(false));
    }
    serde_json::to_vec(&req)
        .map(Some)
        .map_err(|e| e.to_string())
}

fn req_flag(req: &Map<String, Value>, key: &str) -> bool {
    req.get(key).and_then(Value::as_bool) == Some(true)
}

/// Rewrites a continuation's events into the client's stream (see the module's comment).
#[derive(Debug, Clone)]
pub(crate) struct Rewrite {
    id: Option<Value>,
    created: Option<Value>,
    /// Tokens the client had before this continuation.
    before: u64,
}

impl Rewrite {
    pub(crate) fn new(answer: &Answer) -> Self {
        Rewrite {
            id: answer.id.clone(),
            created: answer.created.clone(),
            before: answer.tokens,
        }
    }

    /// The continuation's complete `events`, as the client's stream goes on.
    pub(crate) fn events(&self, events: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(events.len());
        for data in payloads(events) {
            let Ok(mut v) = serde_json::from_str::<Value>(data) else {
                if data == "[DONE]" {
                    out.extend_from_slice(b"data: [DONE]\n\n");
                }
                continue;
            };
            if v.get("error").is_none() && !self.chunk(&mut v) {
                continue;
            }
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(v.to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        out
    }

    /// Rewrites one chunk; false to drop it (the opening role chunk).
    fn chunk(&self, v: &mut Value) -> bool {
        if let (Some(id), Some(_)) = (&self.id, v.get("id")) {
            v["id"] = id.clone();
        }
        if let (Some(c), Some(_)) = (&self.created, v.get("created")) {
            v["created"] = c.clone();
        }
        if let Some(Value::Object(delta)) = v["choices"].get_mut(0).map(|c| &mut c["delta"]) {
            if delta.remove("role").is_some()
                && delta
                    .get("content")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                && v["choices"][0]["finish_reason"].is_null()
            {
                return false;
            }
        }
        if let Some(Value::Object(u)) = v.get_mut("usage") {
            let get = |u: &Map<String, Value>, k: &str| u.get(k).and_then(Value::as_u64);
            if let (Some(p), Some(c)) = (get(u, "prompt_tokens"), get(u, "completion_tokens")) {
                let (p, c) = (p.saturating_sub(self.before), c + self.before);
                u.insert("prompt_tokens".into(), Value::from(p));
                u.insert("completion_tokens".into(), Value::from(c));
                u.insert("total_tokens".into(), Value::from(p + c));
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn sse(v: &Value) -> String {
        format!("data: {v}\n\n")
    }

    proptest! {
        /// However the bytes are cut, the events come out whole and in order, nothing lost.
        #[test]
        fn events_come_out_whole(events in proptest::collection::vec("[a-z ]{0,12}", 0..8), cuts in proptest::collection::vec(0usize..200, 0..10), crlf: bool) {
            let sep = if crlf { "\r\n\r\n" } else { "\n\n" };
            let stream: String = events.iter().map(|e| format!("data: {e}{sep}")).collect();
            let bytes = stream.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.push(bytes.len());
            cuts.sort_unstable();
            let (mut ev, mut out, mut from) = (Events::default(), Vec::new(), 0);
            for c in cuts {
                let got = ev.push(&bytes[from..c]);
                // Whatever comes out ends at an event's end.
                prop_assert!(got.is_empty() || got.ends_with(sep.as_bytes()));
                out.extend_from_slice(&got);
                from = c;
            }
            prop_assert_eq!(out, bytes.to_vec());
            prop_assert!(ev.held().is_empty());
        }
    }

    #[test]
    fn an_overlong_event_passes_through() {
        let mut ev = Events::default();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(ev.push(&big).len(), big.len());
        assert!(!ev.whole());
        assert_eq!(ev.push(b"ab"), b"ab");
    }

    fn chat_stream() -> String {
        let c = |delta: Value, finish: Value| {
            sse(
                &json!({"id": "chatcmpl-1", "created": 5, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
            )
        };
        [
            c(json!({"role": "assistant", "content": ""}), Value::Null),
            c(json!({"content": "He"}), Value::Null),
            c(json!({"content": "llo"}), Value::Null),
        ]
        .concat()
    }

    #[test]
    fn the_answer_so_far_skips_the_role_chunk() {
        let mut a = Answer::default();
        a.read(chat_stream().as_bytes());
        assert_eq!(
            (a.id.clone(), a.text.as_str(), a.tokens, a.finished, a.done),
            (Some(json!("chatcmpl-1")), "Hello", 2, false, false)
        );
        a.read(b"data: [DONE]\n\n");
        assert!(a.done);
    }

    #[test]
    fn a_chat_continues_its_answer_as_the_final_message() {
        let mut a = Answer::default();
        a.read(chat_stream().as_bytes());
        let body = br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": true}"#;
        let next = continuation(Endpoint::Chat, body, &a, None)
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_slice(&next).unwrap();
        assert_eq!(v["max_tokens"], 8);
        assert_eq!(
            v["messages"][1],
            json!({"role": "assistant", "content": "Hello"})
        );
        assert_eq!(v["continue_final_message"], true);
        assert_eq!(v["add_generation_prompt"], false);
        // A client continuing its own message: that message grows.
        let body = br#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Oh, "}], "continue_final_message": true, "max_completion_tokens": 3}"#;
        let v: Value = serde_json::from_slice(
            &continuation(Endpoint::Chat, body, &a, None)
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(v["messages"].as_array().unwrap().len(), 2);
        assert_eq!(v["messages"][1]["content"], "Oh, Hello");
        assert_eq!(v["max_completion_tokens"], 1);
    }

    #[test]
    fn completions_continue_from_text_or_token_ids() {
        let a = Answer {
            text: "lo w".into(),
            tokens: 2,
            ..Answer::default()
        };
        let text = br#"{"prompt": "hel", "max_tokens": 5}"#;
        let v: Value = serde_json::from_slice(
            &continuation(Endpoint::Completions, text, &a, None)
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (v["prompt"].clone(), v["max_tokens"].clone()),
            (json!("hello w"), json!(3))
        );
        let ids = br#"{"prompt": [1, 2], "max_tokens": 5}"#;
        assert!(continuation(Endpoint::Completions, ids, &a, None)
            .unwrap_err()
            .contains("tokenizer"));
        let encode = |t: &str| Ok(t.bytes().map(u32::from).collect());
        let v: Value = serde_json::from_slice(
            &continuation(Endpoint::Completions, ids, &a, Some(&encode))
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(v["prompt"], json!([1, 2, 108, 111, 32, 119]));
        // Complete already, or not continuable.
        let done = Answer {
            tokens: 5,
            ..a.clone()
        };
        assert_eq!(
            continuation(Endpoint::Completions, text, &done, None),
            Ok(None)
        );
        for body in [
            &br#"{"prompt": "x", "n": 2}"#[..],
            br#"{"prompt": "x", "echo": true}"#,
            br#"{"prompt": ["x", "y"]}"#,
        ] {
            assert!(continuation(Endpoint::Completions, body, &a, None).is_err());
        }
        // No token yet: the request as it was.
        let v: Value = serde_json::from_slice(
            &continuation(Endpoint::Completions, text, &Answer::default(), None)
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (v["prompt"].clone(), v["max_tokens"].clone()),
            (json!("hel"), json!(5))
        );
    }

    #[test]
    fn continuation_events_join_the_first_stream() {
        let mut a = Answer::default();
        a.read(chat_stream().as_bytes());
        let r = Rewrite::new(&a);
        let c = |delta: Value, finish: Value| {
            sse(
                &json!({"id": "chatcmpl-9", "created": 7, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
            )
        };
        let second = [
            c(json!({"role": "assistant", "content": ""}), Value::Null),
            c(json!({"content": "!"}), json!("length")),
            sse(&json!({"id": "chatcmpl-9", "created": 7, "choices": [],
                "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}})),
            "data: [DONE]\n\n".into(),
        ]
        .concat();
        let out = String::from_utf8(r.events(second.as_bytes())).unwrap();
        let events: Vec<&str> = out.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3, "{out}");
        let first: Value = serde_json::from_str(&events[0][6..]).unwrap();
        assert_eq!(
            (first["id"].clone(), first["created"].clone()),
            (json!("chatcmpl-1"), json!(5))
        );
        assert_eq!(first["choices"][0]["delta"], json!({"content": "!"}));
        let usage: Value = serde_json::from_str(&events[1][6..]).unwrap();
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13})
        );
        assert_eq!(events[2], "data: [DONE]");
    }
}
