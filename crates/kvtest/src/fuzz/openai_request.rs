//! `openai_request`: request bodies from the network into `kvserve::openai::parse` (feature
//! `openai`), the parser `kvrouter` and `kvmock` read every completions and chat request with,
//! as both endpoints. The first byte picks the mode: arbitrary bytes as the body, or (high bit
//! set) a JSON object built from structured input, with the fields the parser reads (`prompt`,
//! `messages`, `role`, `content`, `type`, `text`, `model`, `stream`, `cache_salt`, ...) holding
//! values of every JSON type, extreme numbers (`u32::MAX + 1`, `u64::MAX`, negatives, floats)
//! and nesting.
//!
//! Never a panic, and against a naive reading of the same bytes with `serde_json::Value`:
//!
//! - an error is `Json` exactly when the bytes are not JSON, `NotAnObject` exactly when they are
//!   JSON but not an object, and its message is short (a client's value is named, never quoted
//!   whole);
//! - an accepted body is a JSON object whose `model`, `stream`, `ignore_eos`, `cache_salt`
//!   (non-empty), `max_tokens` and prompt (text, token ids, or each message's role, text parts
//!   joined by newlines and media parts) are what the naive reading finds there; and
//!   `to_json()` of it parses back to the same request.

use arbitrary::Unstructured;
use kvserve::openai::{parse, Endpoint, Input, Request, RequestError};
use serde_json::{Map, Value};

/// Longest error message accepted: a field path, what it accepts and a shortened value.
const MESSAGE_MAX: usize = 400;

/// The fuzz target's body.
pub fn run(data: &[u8]) {
    let body = match data.first() {
        Some(&b) if b & 0x80 != 0 => {
            let mut u = Unstructured::new(&data[1..]);
            let mut m = Map::new();
            for _ in 0..u.int_in_range(0..=6u8).unwrap_or(0) {
                let k = key(&mut u);
                m.insert(k, value(&mut u, 0));
            }
            Value::Object(m).to_string().into_bytes()
        }
        _ => data.to_vec(),
    };
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        check(endpoint, &body);
    }
}

const KEYS: [&str; 16] = [
    "prompt",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "model",
    "stream",
    "stream_options",
    "include_usage",
    "ignore_eos",
    "max_tokens",
    "max_completion_tokens",
    "cache_salt",
    "image_url",
    "refusal",
];

const STRINGS: [&str; 9] = [
    "",
    "text",
    "image_url",
    "input_audio",
    "user",
    "refusal",
    "input_text",
    "my-lora",
    "\u{0}\u{fffd}é",
];

fn key(u: &mut Unstructured<'_>) -> String {
    match u.int_in_range(0..=KEYS.len()).unwrap_or(0) {
        i if i < KEYS.len() => KEYS[i].to_string(),
        _ => u.arbitrary::<String>().unwrap_or_default(),
    }
}

fn value(u: &mut Unstructured<'_>, depth: u32) -> Value {
    let top = if depth >= 4 { 5 } else { 7 };
    match u.int_in_range(0..=top).unwrap_or(0) {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary().unwrap_or(false)),
        2 => {
            let n: serde_json::Number = match u.int_in_range(0..=7u8).unwrap_or(0) {
                0 => u64::from(u.arbitrary::<u16>().unwrap_or(0)).into(),
                1 => u64::from(u32::MAX).into(),
                2 => (u64::from(u32::MAX) + 1).into(),
                3 => u64::MAX.into(),
                4 => (-1i64).into(),
                5 => i64::MIN.into(),
                6 => serde_json::Number::from_f64(1.5).unwrap_or_else(|| 0u8.into()),
                _ => u.arbitrary::<u64>().unwrap_or(0).into(),
            };
            Value::Number(n)
        }
        3 | 4 => match u.int_in_range(0..=STRINGS.len()).unwrap_or(0) {
            i if i < STRINGS.len() => Value::from(STRINGS[i]),
            _ => Value::from(u.arbitrary::<String>().unwrap_or_default()),
        },
        5 => Value::Array(
            (0..u.int_in_range(0..=4u8).unwrap_or(0))
                .map(|_| Value::from(u.arbitrary::<u32>().unwrap_or(0)))
                .collect(),
        ),
        6 => Value::Array(
            (0..u.int_in_range(0..=3u8).unwrap_or(0))
                .map(|_| value(u, depth + 1))
                .collect(),
        ),
        _ => {
            let mut m = Map::new();
            for _ in 0..u.int_in_range(0..=4u8).unwrap_or(0) {
                let k = key(u);
                m.insert(k, value(u, depth + 1));
            }
            Value::Object(m)
        }
    }
}

fn check(endpoint: Endpoint, body: &[u8]) {
    let naive = serde_json::from_slice::<Value>(body);
    match parse(endpoint, body) {
        Err(e) => {
            let msg = e.to_string();
            assert!(
                !msg.is_empty() && msg.len() <= MESSAGE_MAX,
                "{} bytes of message: {msg}",
                msg.len()
            );
            match (&naive, &e) {
                (Err(_), RequestError::Json(_)) => {}
                (Ok(Value::Object(_)), RequestError::Json(_) | RequestError::NotAnObject(_)) => {
                    panic!("an object refused as not one: {e}")
                }
                (Ok(Value::Object(_)), _) => {}
                (Ok(_), RequestError::NotAnObject(_)) => {}
                _ => panic!("{e} for {naive:?}"),
            }
        }
        Ok(r) => {
            let Ok(Value::Object(m)) = &naive else {
                panic!("accepted a body that is not a JSON object: {r:?}")
            };
            agrees(endpoint, &r, m);
            let again = parse(endpoint, r.to_json().as_bytes());
            assert_eq!(again.as_ref(), Ok(&r), "to_json does not read back");
        }
    }
}

fn present<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

/// The accepted request holds what the naive reading finds in the object.
fn agrees(endpoint: Endpoint, r: &Request, m: &Map<String, Value>) {
    assert_eq!(r.endpoint, endpoint);
    assert_eq!(
        r.model.as_deref(),
        present(m, "model").map(|v| v.as_str().expect("a string model"))
    );
    assert_eq!(r.stream, present(m, "stream") == Some(&Value::Bool(true)));
    assert_eq!(
        r.ignore_eos,
        present(m, "ignore_eos") == Some(&Value::Bool(true))
    );
    assert_eq!(
        r.include_usage,
        m.get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true)
    );
    assert_eq!(
        r.cache_salt.as_deref(),
        present(m, "cache_salt").and_then(Value::as_str)
    );
    assert_ne!(r.cache_salt.as_deref(), Some(""));
    let max = match endpoint {
        Endpoint::Chat => present(m, "max_completion_tokens").or(present(m, "max_tokens")),
        _ => present(m, "max_tokens"),
    };
    assert_eq!(r.max_tokens, max.and_then(Value::as_u64));
    let token = |v: &Value| v.as_u64().and_then(|t| u32::try_from(t).ok());
    match (&r.input, endpoint) {
        (Input::Text(t), Endpoint::Completions) => {
            let p = &m["prompt"];
            assert!(
                p.as_str() == Some(t) || p.get(0).and_then(Value::as_str) == Some(t),
                "{p} is not {t:?}"
            );
        }
        (Input::Ids(ids), Endpoint::Completions) => {
            assert!(!ids.is_empty());
            let p = &m["prompt"];
            let list = match p.get(0) {
                Some(Value::Array(inner)) => inner,
                _ => p.as_array().expect("a list prompt"),
            };
            let naive: Vec<u32> = list.iter().map(|v| token(v).expect("ids")).collect();
            assert_eq!(&naive, ids);
        }
        (Input::Messages(msgs), Endpoint::Chat) => {
            let list = m["messages"].as_array().expect("a list of messages");
            assert_eq!(list.len(), msgs.len());
            assert!(!msgs.is_empty());
            for (msg, v) in msgs.iter().zip(list) {
                assert_eq!(Some(msg.role.as_str()), v["role"].as_str());
                let (text, media) = match &v["content"] {
                    Value::Null => (String::new(), false),
                    Value::String(s) => (s.clone(), false),
                    Value::Array(parts) => {
                        let mut texts = Vec::new();
                        let mut media = false;
                        for p in parts {
                            if let Value::String(t) = p {
                                texts.push(t.as_str());
                                continue;
                            }
                            // The text field of a text part; None for any other part.
                            let field = match p.get("type").filter(|t| !t.is_null()) {
                                None => Some("text"),
                                Some(t) => match t.as_str().expect("a string type") {
                                    "text" | "input_text" | "output_text" => Some("text"),
                                    "refusal" => Some("refusal"),
                                    _ => None,
                                },
                            };
                            match field {
                                Some(f) => texts.push(p[f].as_str().expect("a text part's text")),
                                None => media = true,
                            }
                        }
                        (texts.join("\n"), media)
                    }
                    c => panic!("accepted content {c}"),
                };
                assert_eq!(msg.has_media(), media);
                assert_eq!(msg.text(), text);
            }
        }
        (input, _) => panic!("{input:?} read from a {endpoint:?} body"),
    }
}
