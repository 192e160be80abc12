//! What a router needs of an OpenAI request body the prompt (text, token ids
//! or chat messages), the model, the streaming flags, `max_tokens` and vLLM's `cache_salt`.
//!
//! A router forwards the body unchanged; this only reads it, the way vLLM's OpenAI server does:
//! a field of the wrong type is an error naming the field, what it accepts and (shortened) what
//! was there. Tokenising (and rendering chat messages through the model's chat template) is the
//! caller's: this module has no tokenizer.
//!
//! ```
//! use kvserve::openai::{parse, Endpoint, Input};
//!
//! let req = parse(Endpoint::Completions, br#"{"model": "m", "prompt": [1, 2, 3], "stream": true}"#)?;
//! assert_eq!(req.input, Input::Ids(vec![1, 2, 3]));
//! assert_eq!((req.model.as_deref(), req.stream), (Some("m"), true));
//! // What it accepted writes back to a body that reads the same.
//! assert_eq!(parse(Endpoint::Completions, req.to_json().as_bytes())?, req);
//!
//! let chat = br#"{"messages": [{"role": "user", "content": [
//!     {"type": "text", "text": "what is this?"},
//!     {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}"#;
//! let req = parse(Endpoint::Chat, chat)?;
//! let Input::Messages(msgs) = &req.input else { unreachable!() };
//! assert_eq!((msgs[0].text(), msgs[0].has_media()), ("what is this?".to_string(), true));
//! assert_eq!(req.first_media_message(), Some(0));
//!
//! let err = parse(Endpoint::Completions, br#"{"prompt": "hi", "stream": "yes"}"#).unwrap_err();
//! assert_eq!(err.to_string(), r#"stream: expected a boolean, got "yes""#);
//! # Ok::<(), kvserve::openai::RequestError>(())
//! ```

use serde_json::{Map, Value};

/// Longest excerpt of a client-supplied value quoted in an error message.
const QUOTE_MAX: usize = 48;

/// Which OpenAI endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Endpoint {
    /// `POST /v1/completions`: a `prompt`.
    Completions,
    /// `POST /v1/chat/completions`: `messages`.
    Chat,
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Input {
    /// A completions prompt given as text (to be tokenised with special tokens, as vLLM does).
    Text(String),
    /// A completions prompt given as token ids.
    Ids(Vec<u32>),
    /// Chat messages (to be rendered through the model's chat template).
    Messages(Vec<ChatMessage>),
}

/// One chat message: its role and its content parts in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...: passed to the chat template as given.
    pub role: String,
    /// The content: a string content is one text part; `null` or absent is none.
    pub parts: Vec<Part>,
}

impl ChatMessage {
    /// The text parts joined by newlines, as vLLM flattens a list content for a template that
    /// takes a string.
    pub fn text(&self) -> String {
        let texts: Vec<&str> = self
            .parts
            .iter()
            .filter_map(|p| match p {
                Part::Text(t) => Some(t.as_str()),
                Part::Media(_) => None,
            })
            .collect();
        texts.join("\n")
    }

    /// Whether the content has an image, audio or video part.
    pub fn has_media(&self) -> bool {
        self.parts.iter().any(|p| matches!(p, Part::Media(_)))
    }
}

/// One part of a chat message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Part {
    /// A `text` part (also `input_text`, `output_text`, a bare string in the list, and a
    /// `refusal`'s text).
    Text(String),
    /// An image, audio or video part, by its `type` (`image_url`, `input_audio`, ...), or a part
    /// of any other type the router does not read (`thinking`, `prompt_embeds`, ...). Its data
    /// is not kept: the router cannot hash it, so the routable prompt ends before it (see the
    /// README's kvrouter section).
    Media(String),
}

/// The routing-relevant fields of an OpenAI request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Which endpoint it was read as.
    pub endpoint: Endpoint,
    /// `model` (absent or `null`: `None`).
    pub model: Option<String>,
    /// The prompt or the messages.
    pub input: Input,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage` (read leniently: anything but `true` is `false`).
    pub include_usage: bool,
    /// `ignore_eos` (vLLM's extension).
    pub ignore_eos: bool,
    /// `max_tokens`, or for chat `max_completion_tokens` first (absent or `null`: `None`).
    pub max_tokens: Option<u64>,
    /// vLLM's `cache_salt`: keys the prompt's first block, so only requests with the same salt
    /// share cached blocks. Never empty.
    pub cache_salt: Option<String>,
    /// vLLM's chat extension `continue_final_message`: the prompt ends inside the last
    /// (assistant) message, which the answer continues, rather than with a new turn's opening.
    pub continue_final_message: bool,
}

/// Why a request body was refused. Each names the field and what it accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The body is not JSON.
    #[error("invalid JSON body: {0}")]
    Json(String),
    /// The body is JSON but not an object.
    #[error("the request body must be a JSON object, got {0}")]
    NotAnObject(&'static str),
    /// A required field is absent (or `null`).
    #[error("missing field `{field}`: expected {expected}")]
    MissingField {
        /// The field, e.g. `prompt` or `messages[2].role`.
        field: String,
        /// What it accepts.
        expected: &'static str,
    },
    /// A field of the wrong type or out of range.
    #[error("{field}: expected {expected}, got {got}")]
    WrongType {
        /// The field, e.g. `prompt[3]` or `messages[0].content[1]`.
        field: String,
        /// What it accepts.
        expected: &'static str,
        /// What was there (shortened).
        got: String,
    },
    /// An empty prompt or message list.
    #[error("{0} is empty: expected at least one {1}")]
    Empty(&'static str, &'static str),
    /// Several prompts in one completions request.
    #[error("prompt: a list of {0} prompts (batched prompts are not supported): expected one text or one list of token ids")]
    Batched(usize),
}

/// The kind of a JSON value, for messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// `v` as JSON, shortened to [`QUOTE_MAX`] characters.
fn quote(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(QUOTE_MAX) {
        Some((end, _)) => format!("{}... ({} bytes)", &s[..end], s.len()),
        None => s,
    }
}

fn wrong(field: impl Into<String>, expected: &'static str, got: &Value) -> RequestError {
    RequestError::WrongType {
        field: field.into(),
        expected,
        got: quote(got),
    }
}

/// A present, non-null field.
fn field<'a>(req: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    req.get(key).filter(|v| !v.is_null())
}

fn flag(req: &Map<String, Value>, key: &'static str) -> Result<bool, RequestError> {
    match field(req, key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(wrong(key, "a boolean", v)),
    }
}

fn ids(field: &str, items: &[Value]) -> Result<Vec<u32>, RequestError> {
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    wrong(
                        format!("{field}[{i}]"),
                        "a token id (an integer from 0 to 4294967295)",
                        t,
                    )
                })
        })
        .collect()
}

fn prompt(req: &Map<String, Value>) -> Result<Input, RequestError> {
    const EXPECTED: &str = "text or a list of token ids";
    let Some(p) = field(req, "prompt") else {
        return Err(RequestError::MissingField {
            field: "prompt".into(),
            expected: EXPECTED,
        });
    };
    let input = match p {
        Value::String(s) => Input::Text(s.clone()),
        Value::Array(items) => match items.as_slice() {
            [] => return Err(RequestError::Empty("prompt", "token id")),
            [Value::String(s)] => Input::Text(s.clone()),
            [Value::Array(inner)] => Input::Ids(ids("prompt[0]", inner)?),
            [Value::Number(_), ..] => Input::Ids(ids("prompt", items)?),
            [Value::String(_) | Value::Array(_), ..] => {
                return Err(RequestError::Batched(items.len()))
            }
            [v, ..] => return Err(wrong("prompt[0]", EXPECTED, v)),
        },
        v => return Err(wrong("prompt", EXPECTED, v)),
    };
    match &input {
        Input::Ids(v) if v.is_empty() => Err(RequestError::Empty("prompt", "token id")),
        _ => Ok(input),
    }
}

fn part(at: String, p: &Value) -> Result<Part, RequestError> {
    const EXPECTED: &str = "a string or a content part object";
    let o = match p {
        // vLLM reads a bare string in a content list as a text part.
        Value::String(t) => return Ok(Part::Text(t.clone())),
        Value::Object(o) => o,
        _ => return Err(wrong(at, EXPECTED, p)),
    };
    let text = |key: &str| match o.get(key) {
        Some(Value::String(t)) => Ok(Part::Text(t.clone())),
        Some(v) => Err(wrong(format!("{at}.{key}"), "a string", v)),
        None => Err(RequestError::MissingField {
            field: format!("{at}.{key}"),
            expected: "a string",
        }),
    };
    match o.get("type") {
        // A part without a type is a text part (vLLM reads `{"text": ...}` as one).
        None | Some(Value::Null) => text("text"),
        Some(Value::String(t)) => match t.as_str() {
            "text" | "input_text" | "output_text" => text("text"),
            "refusal" => text("refusal"),
            // Media, and any part type the router does not read: the engine may accept it,
            // so it is forwarded, and the routable prompt ends before it.
            t => Ok(Part::Media(t.to_string())),
        },
        Some(v) => Err(wrong(format!("{at}.type"), "a string", v)),
    }
}

fn messages(req: &Map<String, Value>) -> Result<Input, RequestError> {
    let msgs = match field(req, "messages") {
        None => {
            return Err(RequestError::MissingField {
                field: "messages".into(),
                expected: "a list of messages",
            })
        }
        Some(Value::Array(m)) => m,
        Some(v) => return Err(wrong("messages", "a list of messages", v)),
    };
    if msgs.is_empty() {
        return Err(RequestError::Empty("messages", "message"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(wrong(format!("messages[{i}]"), "a message object", m));
        };
        let role = match field(m, "role") {
            Some(Value::String(r)) => r.clone(),
            Some(v) => return Err(wrong(format!("messages[{i}].role"), "a string", v)),
            None => {
                return Err(RequestError::MissingField {
                    field: format!("messages[{i}].role"),
                    expected: "a string",
                })
            }
        };
        let parts = match field(m, "content") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![Part::Text(s.clone())],
            Some(Value::Array(parts)) => parts
                .iter()
                .enumerate()
                .map(|(k, p)| part(format!("messages[{i}].content[{k}]"), p))
                .collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(wrong(
                    format!("messages[{i}].content"),
                    "text or a list of content parts",
                    v,
                ))
            }
        };
        out.push(ChatMessage { role, parts });
    }
    Ok(Input::Messages(out))
}

/// Reads `body` as sent to `endpoint`. Fields the router does not need are not looked at (the
/// engine checks them); a needed field of the wrong type is an error. Never panics.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Request, RequestError> {
    let req = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => m,
        Ok(v) => return Err(RequestError::NotAnObject(kind(&v))),
        Err(e) => return Err(RequestError::Json(e.to_string())),
    };
    let model = match field(&req, "model") {
        None => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(v) => return Err(wrong("model", "a string", v)),
    };
    let input = match endpoint {
        Endpoint::Completions => prompt(&req)?,
        Endpoint::Chat => messages(&req)?,
    };
    let keys: &[&'static str] = match endpoint {
        Endpoint::Completions => &["max_tokens"],
        Endpoint::Chat => &["max_completion_tokens", "max_tokens"],
    };
    let mut max_tokens = None;
    for &k in keys {
        if let Some(v) = field(&req, k) {
            max_tokens = Some(
                v.as_u64()
                    .ok_or_else(|| wrong(k, "a whole number of tokens", v))?,
            );
            break;
        }
    }
    let cache_salt = match field(&req, "cache_salt") {
        None => None,
        // vLLM refuses an empty salt too.
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(v) => return Err(wrong("cache_salt", "a non-empty string", v)),
    };
    Ok(Request {
        endpoint,
        model,
        input,
        stream: flag(&req, "stream")?,
        include_usage: req
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        ignore_eos: flag(&req, "ignore_eos")?,
        max_tokens,
        cache_salt,
        continue_final_message: endpoint == Endpoint::Chat && flag(&req, "continue_final_message")?,
    })
}

impl Request {
    /// The index of the first chat message with an image, audio or video part (`None` for a
    /// completions prompt or a text-only chat).
    pub fn first_media_message(&self) -> Option<usize> {
        match &self.input {
            Input::Messages(m) => m.iter().position(ChatMessage::has_media),
            _ => None,
        }
    }

    /// A body with exactly these fields, which [`parse`] reads back as `self` (media parts keep
    /// only their type).
    pub fn to_json(&self) -> String {
        let mut m = Map::new();
        if let Some(model) = &self.model {
            m.insert("model".into(), Value::from(model.as_str()));
        }
        match &self.input {
            Input::Text(t) => {
                m.insert("prompt".into(), Value::from(t.as_str()));
            }
            Input::Ids(ids) => {
                m.insert("prompt".into(), Value::from(ids.clone()));
            }
            Input::Messages(msgs) => {
                let list = msgs
                    .iter()
                    .map(|msg| {
                        let parts: Vec<Value> = msg
                            .parts
                            .iter()
                            .map(|p| match p {
                                Part::Text(t) => {
                                    serde_json::json!({"type": "text", "text": t})
                                }
                                Part::Media(kind) => serde_json::json!({"type": kind}),
                            })
                            .collect();
                        serde_json::json!({"role": msg.role, "content": parts})
                    })
                    .collect();
                m.insert("messages".into(), Value::Array(list));
            }
        }
        m.insert("stream".into(), Value::Bool(self.stream));
        m.insert(
            "stream_options".into(),
            serde_json::json!({"include_usage": self.include_usage}),
        );
        m.insert("ignore_eos".into(), Value::Bool(self.ignore_eos));
        if let Some(n) = self.max_tokens {
            let key = match self.endpoint {
                Endpoint::Completions => "max_tokens",
                Endpoint::Chat => "max_completion_tokens",
            };
            m.insert(key.into(), Value::from(n));
        }
        if let Some(s) = &self.cache_salt {
            m.insert("cache_salt".into(), Value::from(s.as_str()));
        }
        if self.continue_final_message {
            m.insert("continue_final_message".into(), Value::Bool(true));
            m.insert("add_generation_prompt".into(), Value::Bool(false));
        }
        Value::Object(m).to_string()
    }
}

/// OpenAI's error object as JSON text, with vLLM's type names (`BadRequestError`,
/// `NotFoundError`, ...): `{"error": {"message", "type", "param": null, "code"}}`. The one
/// error body the router server and the engine emulator answer with.
///
/// ```
/// let body = kvserve::openai::error_body(400, "BadRequestError", "stream: expected a boolean");
/// let v: serde_json::Value = serde_json::from_str(&body).unwrap();
/// assert_eq!(v["error"]["code"], 400);
/// assert_eq!(v["error"]["type"], "BadRequestError");
/// ```
pub fn error_body(code: u16, kind: &str, message: &str) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(endpoint: Endpoint, body: &str) -> String {
        match parse(endpoint, body.as_bytes()) {
            Ok(r) => panic!("{body} parsed: {r:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn prompts_in_every_accepted_shape() {
        let p = |b: &str| parse(Endpoint::Completions, b.as_bytes()).map(|r| r.input);
        assert_eq!(p(r#"{"prompt": "hi"}"#), Ok(Input::Text("hi".into())));
        assert_eq!(p(r#"{"prompt": ["hi"]}"#), Ok(Input::Text("hi".into())));
        assert_eq!(p(r#"{"prompt": [1, 2]}"#), Ok(Input::Ids(vec![1, 2])));
        assert_eq!(
            p(r#"{"prompt": [[4294967295]]}"#),
            Ok(Input::Ids(vec![u32::MAX]))
        );
        // An empty text is the engine's to refuse (it may add a BOS token).
        assert_eq!(p(r#"{"prompt": ""}"#), Ok(Input::Text(String::new())));
    }

    #[test]
    fn errors_name_the_field_and_what_it_accepts() {
        let c = Endpoint::Completions;
        assert_eq!(
            err(c, "{}"),
            "missing field `prompt`: expected text or a list of token ids"
        );
        assert_eq!(
            err(c, "[1]"),
            "the request body must be a JSON object, got a list"
        );
        assert!(err(c, "{").starts_with("invalid JSON body: EOF"));
        assert_eq!(
            err(c, r#"{"prompt": [1, -2]}"#),
            "prompt[1]: expected a token id (an integer from 0 to 4294967295), got -2"
        );
        assert_eq!(
            err(c, r#"{"prompt": [[1], [2]]}"#),
            "prompt: a list of 2 prompts (batched prompts are not supported): expected one text or one list of token ids"
        );
        assert_eq!(
            err(c, r#"{"prompt": [[]]}"#),
            "prompt is empty: expected at least one token id"
        );
        assert_eq!(
            err(c, r#"{"prompt": "a", "cache_salt": ""}"#),
            r#"cache_salt: expected a non-empty string, got """#
        );
        assert_eq!(
            err(c, r#"{"prompt": "a", "max_tokens": 1.5}"#),
            "max_tokens: expected a whole number of tokens, got 1.5"
        );
        let long = format!(
            r#"{{"prompt": "a", "model": [{}]}}"#,
            "1,".repeat(100) + "1"
        );
        let e = err(c, &long);
        assert!(e.len() < 120 && e.ends_with("... (203 bytes)"), "{e}");
        let chat = Endpoint::Chat;
        assert_eq!(
            err(chat, r#"{"messages": []}"#),
            "messages is empty: expected at least one message"
        );
        assert_eq!(
            err(chat, r#"{"messages": [{"content": "x"}]}"#),
            "missing field `messages[0].role`: expected a string"
        );
        // A part type the router does not read ends the routable prompt; a bare string is text.
        let r = parse(
            chat,
            br#"{"messages": [{"role": "user", "content": ["a", {"type": "output_text", "text": "b"}, {"type": "thinking", "thinking": "c"}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.first_media_message(), Some(0));
        assert!(err(
            chat,
            r#"{"messages": [{"role": "user", "content": [{"type": 3}]}]}"#
        )
        .starts_with("messages[0].content[0].type: expected a string"));
    }

    #[test]
    fn chat_content_keeps_text_and_media_in_order() {
        let body = br#"{"model": "m", "max_tokens": 3, "max_completion_tokens": 5,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "assistant", "content": null},
                         {"role": "user", "content": [{"text": "a"}, {"type": "input_audio"}, {"type": "text", "text": "b"}]}]}"#;
        let r = parse(Endpoint::Chat, body).unwrap();
        assert_eq!(r.max_tokens, Some(5));
        let Input::Messages(m) = &r.input else {
            panic!("{r:?}")
        };
        assert_eq!(m[1].parts, vec![]);
        assert_eq!(m[2].text(), "a\nb");
        assert_eq!(r.first_media_message(), Some(2));
        assert!(!r.continue_final_message);
        assert_eq!(parse(Endpoint::Chat, r.to_json().as_bytes()), Ok(r));
    }

    #[test]
    fn continue_final_message_is_a_chat_flag() {
        let body = br#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
            "continue_final_message": true, "add_generation_prompt": false}"#;
        let r = parse(Endpoint::Chat, body).unwrap();
        assert!(r.continue_final_message);
        assert_eq!(parse(Endpoint::Chat, r.to_json().as_bytes()), Ok(r));
        let wrong =
            br#"{"messages": [{"role": "user", "content": "hi"}], "continue_final_message": 1}"#;
        assert!(parse(Endpoint::Chat, wrong)
            .unwrap_err()
            .to_string()
            .starts_with("continue_final_message: expected a boolean"));
    }
}
