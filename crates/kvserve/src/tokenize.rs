//! Text in and out: a Hugging Face `tokenizer.json` (or, without one, one token per UTF-8 byte)
//! and the model's chat template from `tokenizer_config.json`, rendered with minijinja.
//!
//! [`load`] also takes the name of a built-in tokenizer where a path is expected:
//! [`BUILTIN_BYTES`] (`builtin:bytes`) is one token per UTF-8 byte with the ChatML template
//! [`DEFAULT_CHAT_TEMPLATE`], which is what `kvmock` uses without a tokenizer, so a router and
//! engines can exchange text prompts and chats with no model files at all (a demo, not a model's
//! tokenizer).

use std::path::Path;
use std::sync::Arc;

use crate::openai::{ChatMessage, Input};
use minijinja::Environment;
use serde_json::Value;

use crate::error::Error;

/// The template used when the model ships none: ChatML.
pub const DEFAULT_CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n\
{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// How text becomes token ids and back.
#[derive(Clone)]
pub enum Codec {
    /// No tokenizer given: one token per UTF-8 byte; outputs are lower-case ASCII letters.
    Bytes,
    /// A Hugging Face tokenizer.
    Hf(Arc<Hf>),
}

/// A loaded Hugging Face tokenizer and what output sampling needs of it.
pub struct Hf {
    tok: tokenizers::Tokenizer,
    /// Ids of special tokens: never produced as output.
    special: std::collections::HashSet<u32>,
    /// Ordinary vocabulary size (added tokens excluded).
    ordinary: u64,
}

impl Hf {
    /// Wraps a tokenizer.
    pub fn new(tok: tokenizers::Tokenizer) -> Self {
        let special = tok
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        let ordinary = tok.get_vocab_size(false).max(1) as u64;
        Hf {
            tok,
            special,
            ordinary,
        }
    }
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codec::Bytes => f.write_str("Codec::Bytes"),
            Codec::Hf(_) => f.write_str("Codec::Hf"),
        }
    }
}

impl Codec {
    /// Token ids of `text`; `special` adds the tokenizer's special tokens (BOS), as vLLM does
    /// for completions (not for rendered chat prompts, whose template writes them).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        match self {
            Codec::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Codec::Hf(t) => t
                .tok
                .encode(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string()),
        }
    }

    /// Ids accepted in a prompt: below this (`None`: any).
    pub fn vocab_limit(&self) -> Option<u32> {
        match self {
            Codec::Bytes => None,
            Codec::Hf(t) => u32::try_from(t.tok.get_vocab_size(true)).ok(),
        }
    }

    /// The `k`-th output token of a request whose prompt hashed to `prompt_hash`: a seeded
    /// function of both, among the ordinary (not added) tokens.
    pub fn output_token(&self, seed: u64, prompt_hash: u64, k: usize) -> u32 {
        let draw = |salt: u64| {
            xxhash_rust::xxh3::xxh3_64_with_seed(
                &[
                    prompt_hash.to_le_bytes(),
                    (k as u64).to_le_bytes(),
                    salt.to_le_bytes(),
                ]
                .concat(),
                seed,
            )
        };
        match self {
            Codec::Bytes => 97 + (draw(0) % 26) as u32,
            Codec::Hf(t) => {
                // Special tokens are drawn again (a few tries; a vocabulary of only special
                // tokens keeps the last draw).
                let mut id = 0;
                for salt in 0..16 {
                    id = (draw(salt) % t.ordinary) as u32;
                    if !t.special.contains(&id) {
                        break;
                    }
                }
                id
            }
        }
    }

    /// A streaming decoder: text for each new token, as far as it is complete.
    pub fn decoder(&self) -> Decoder {
        Decoder {
            codec: self.clone(),
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

/// Incremental detokenisation (the method of Hugging Face's `DecodeStream`): the text of the
/// last few ids is decoded with and without the new one, and the difference is the new text,
/// held back while it ends in an incomplete UTF-8 sequence. Constant work per token.
#[derive(Debug)]
pub struct Decoder {
    codec: Codec,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Decoder {
    /// Adds one token; returns the new text (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let Codec::Hf(t) = &self.codec else {
            return char::from_u32(id).map(String::from).unwrap_or_default();
        };
        self.ids.push(id);
        let before = t
            .tok
            .decode(&self.ids[self.prefix..self.read], true)
            .unwrap_or_default();
        let now = t
            .tok
            .decode(&self.ids[self.prefix..], true)
            .unwrap_or_default();
        if now.len() <= before.len() || now.ends_with('\u{fffd}') {
            return String::new();
        }
        let Some(new) = now.get(before.len()..) else {
            return String::new();
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        new.to_string()
    }
}

/// A chat template and the special tokens it may use.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// A template from its Jinja source.
    pub fn new(source: &str, bos: String, eos: String) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::Template(e.to_string()))?;
        Ok(ChatTemplate { env, bos, eos })
    }

    /// Renders `messages` (OpenAI's list) with `add_generation_prompt = true`.
    pub fn render(&self, messages: &Value) -> Result<String, Error> {
        self.render_with(messages, true)
    }

    /// Renders `messages` with the template's `add_generation_prompt` set as given.
    pub fn render_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| Error::Template(e.to_string()))
    }
}

impl Default for ChatTemplate {
    fn default() -> Self {
        // The built-in template parses.
        ChatTemplate::new(DEFAULT_CHAT_TEMPLATE, String::new(), String::new()).unwrap_or_else(
            |_| ChatTemplate {
                env: Environment::new(),
                bos: String::new(),
                eos: String::new(),
            },
        )
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    }
}

/// The prompt of an OpenAI completions request (read with [`crate::openai::parse`]) as token
/// ids: text through `encode`, token ids as they are. Chat messages are refused (render them
/// with [`chat_text`] first).
///
/// ```
/// use kvserve::tokenize::prompt_tokens;
/// use kvserve::openai::{parse, Endpoint};
/// let input = |b: &str| parse(Endpoint::Completions, b.as_bytes()).map(|r| r.input);
/// let ids = prompt_tokens(&input(r#"{"prompt": [1, 2, 3]}"#)?, |_| Err("no text".into()));
/// assert_eq!(ids, Ok(vec![1, 2, 3]));
/// let text = prompt_tokens(&input(r#"{"prompt": "hi"}"#)?, |t| Ok(vec![t.len() as u32]));
/// assert_eq!(text, Ok(vec![2]));
/// # Ok::<(), kvserve::openai::RequestError>(())
/// ```
pub fn prompt_tokens(
    input: &Input,
    encode: impl Fn(&str) -> Result<Vec<u32>, String>,
) -> Result<Vec<u32>, String> {
    match input {
        Input::Text(s) => encode(s),
        Input::Ids(ids) => Ok(ids.clone()),
        _ => Err("a completions request needs a `prompt`, not messages".into()),
    }
}

/// The messages as the chat template takes them: each message's role and its text parts joined
/// by newlines (vLLM's flattening for a template that takes string content). Media parts are
/// left out: the emulated engine has no vision or audio encoder.
fn template_messages(msgs: &[ChatMessage]) -> Value {
    Value::Array(
        msgs.iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.text()}))
            .collect(),
    )
}

/// The text chat `messages` render to through the model's chat template (with the generation
/// prompt), as the engine renders it.
pub fn chat_text(template: &ChatTemplate, msgs: &[ChatMessage]) -> Result<String, String> {
    template
        .render(&template_messages(msgs))
        .map_err(|e| e.to_string())
}

/// The text of chat `messages` whose last message the answer continues (vLLM's
/// `continue_final_message`): rendered without the generation prompt and cut right after the
/// last message's content, so that whatever closes a turn is left out. An error when the last
/// message is not an assistant's or has no text, or when the template does not render its
/// content verbatim.
///
/// ```
/// use kvserve::openai::{parse, Endpoint, Input};
/// use kvserve::tokenize::{builtin, chat_text_continued};
/// let (_, template) = builtin("builtin:bytes")?;
/// let req = parse(Endpoint::Chat, br#"{"messages": [{"role": "user", "content": "Say hello"},
///     {"role": "assistant", "content": "Hel"}], "continue_final_message": true}"#)?;
/// let Input::Messages(msgs) = &req.input else { unreachable!() };
/// let text = chat_text_continued(&template, msgs)?;
/// assert!(text.ends_with("<|im_start|>assistant\nHel"), "{text}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn chat_text_continued(
    template: &ChatTemplate,
    msgs: &[ChatMessage],
) -> Result<String, String> {
    let last = match msgs.last() {
        Some(m) if m.role == "assistant" => m.text(),
        _ => return Err("continue_final_message: the last message must be the assistant's".into()),
    };
    if last.is_empty() {
        return Err("continue_final_message: the last message has no text to continue".into());
    }
    let text = template
        .render_with(&template_messages(msgs), false)
        .map_err(|e| e.to_string())?;
    match text.rfind(&last) {
        Some(at) => Ok(text[..at + last.len()].to_string()),
        None => Err(
            "continue_final_message: the chat template does not render the last message's text as it is"
                .into(),
        ),
    }
}

/// Where a multimodal chat prompt stops being text the router can reproduce: the rendered
/// prompt up to the start of the content of `msgs[first]` (the first message with an image,
/// audio or video part). vLLM puts a media item's placeholder tokens in the content of its
/// message, and its block hashes differ from a text-only prompt's only from the first block
/// that holds a placeholder; everything before the message's content renders the same whatever
/// the content is. `None` when the template does not render the content verbatim (a marker put
/// in its place is not found once).
pub fn chat_text_before(
    template: &ChatTemplate,
    msgs: &[ChatMessage],
    first: usize,
) -> Option<String> {
    // A marker no tokenizer or template produces by itself.
    const MARK: &str = "\u{1}kvkit-media-starts-here\u{1}";
    let mut v = template_messages(msgs);
    let content = v.get_mut(first)?.get_mut("content")?;
    *content = Value::from(MARK);
    let text = template.render(&v).ok()?;
    let at = text.find(MARK)?;
    if text[at + MARK.len()..].contains(MARK) {
        return None;
    }
    Some(text[..at].to_string())
}

/// The built-in demo tokenizer's name: one token per UTF-8 byte (ids 0 to 255) and the ChatML
/// template ([`DEFAULT_CHAT_TEMPLATE`]), exactly what `kvmock` does when given no tokenizer.
pub const BUILTIN_BYTES: &str = "builtin:bytes";

/// The prefix that names a built-in tokenizer instead of a file.
const BUILTIN_PREFIX: &str = "builtin:";

/// A built-in tokenizer by its full name (`builtin:bytes`); an unknown name is an error naming
/// it and the names there are.
///
/// ```
/// use kvserve::tokenize::builtin;
/// let (codec, template) = builtin("builtin:bytes")?;
/// assert_eq!(codec.encode("hi", true).unwrap(), [104, 105]);
/// assert!(builtin("builtin:xyz").unwrap_err().to_string().contains("expected builtin:bytes"));
/// # Ok::<(), kvserve::Error>(())
/// ```
pub fn builtin(name: &str) -> Result<(Codec, ChatTemplate), Error> {
    match name {
        BUILTIN_BYTES => Ok((Codec::Bytes, ChatTemplate::default())),
        _ => Err(Error::Tokenizer {
            path: name.to_string(),
            message: format!("unknown built-in tokenizer, expected {BUILTIN_BYTES}"),
        }),
    }
}

/// Loads `--tokenizer PATH`: a `tokenizer.json`, or a directory with it and (optionally)
/// `tokenizer_config.json` holding `chat_template`, `bos_token`, `eos_token`; or a built-in
/// tokenizer's name (see [`builtin`]), which no file of that name can shadow.
pub fn load(path: &Path) -> Result<(Codec, ChatTemplate), Error> {
    if let Some(name) = path.to_str().filter(|p| p.starts_with(BUILTIN_PREFIX)) {
        return builtin(name);
    }
    let err = |message: String| Error::Tokenizer {
        path: path.display().to_string(),
        message,
    };
    let (file, dir) = if path.is_dir() {
        (path.join("tokenizer.json"), Some(path.to_path_buf()))
    } else {
        (path.to_path_buf(), path.parent().map(Path::to_path_buf))
    };
    let tok = tokenizers::Tokenizer::from_file(&file)
        .map_err(|e| err(format!("cannot load {}: {e}", file.display())))?;
    let config = dir
        .map(|d| d.join("tokenizer_config.json"))
        .filter(|c| c.is_file());
    let template = match config {
        None => ChatTemplate::default(),
        Some(c) => {
            let text = std::fs::read_to_string(&c)
                .map_err(|e| err(format!("cannot read {}: {e}", c.display())))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| err(format!("{}: bad JSON: {e}", c.display())))?;
            let source = match v.get("chat_template") {
                Some(Value::String(s)) => s.clone(),
                // A list of named templates: the "default" one, else the first.
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .unwrap_or(DEFAULT_CHAT_TEMPLATE)
                    .to_string(),
                _ => DEFAULT_CHAT_TEMPLATE.to_string(),
            };
            ChatTemplate::new(
                &source,
                token_text(v.get("bos_token")),
                token_text(v.get("eos_token")),
            )
            .map_err(|e| err(e.to_string()))?
        }
    };
    Ok((Codec::Hf(Arc::new(Hf::new(tok))), template))
}

/// Writes a tiny word-level `tokenizer.json` (whitespace pre-tokenizer, the given words plus
/// `<unk>`, `<s>` and `</s>`) and a `tokenizer_config.json` with a small chat template into
/// `dir`: test material, never a file to check in.
pub fn write_test_tokenizer(dir: &Path, words: &[&str]) -> std::io::Result<()> {
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["<unk>", "<s>", "</s>"].iter().chain(words).enumerate() {
        vocab.insert((*w).to_string(), Value::from(i));
    }
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string())?;
    let config = serde_json::json!({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] | trim }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_tokenizer_loads_encodes_and_renders() {
        let dir = tempfile::tempdir().unwrap();
        write_test_tokenizer(dir.path(), &["hello", "world", "user", "assistant", ":"]).unwrap();
        let (codec, template) = load(dir.path()).unwrap();
        assert_eq!(codec.encode("hello world", false).unwrap(), vec![3, 4]);
        let msgs = serde_json::json!([{"role": "user", "content": " hello "}]);
        let text = template.render(&msgs).unwrap();
        assert_eq!(text, "<s>user : hello assistant :");
        let ids = codec.encode(&text, false).unwrap();
        assert_eq!(ids, vec![1, 5, 7, 3, 6, 7]);
        let mut d = codec.decoder();
        let out: String = [3u32, 4].iter().map(|&i| d.push(i)).collect();
        assert_eq!(out, "hello world");
        assert!(codec.output_token(1, 2, 3) < 8);
        assert!(load(&dir.path().join("missing.json")).is_err());
    }

    /// A byte-level BPE tokenizer (GPT-2's pre-tokenizer regex has a look-ahead: the pure-Rust
    /// fancy-regex engine must handle it), with a merge, loads, encodes and streams text back.
    #[test]
    fn a_byte_level_bpe_tokenizer_works() {
        let dir = tempfile::tempdir().unwrap();
        let vocab: serde_json::Map<String, Value> =
            ["h", "e", "l", "o", "\u{120}", "w", "r", "d", "ll"]
                .iter()
                .enumerate()
                .map(|(i, t)| ((*t).to_string(), Value::from(i)))
                .collect();
        let tok = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "vocab": vocab, "merges": ["l l"]}
        });
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let (codec, _) = load(&dir.path().join("tokenizer.json")).unwrap();
        let ids = codec.encode("hello  world", false).unwrap();
        // h e ll o Ġ Ġ w o r l d
        assert_eq!(ids, vec![0, 1, 8, 3, 4, 4, 5, 3, 6, 2, 7]);
        let mut d = codec.decoder();
        let text: String = ids.iter().map(|&i| d.push(i)).collect();
        assert_eq!(text, "hello  world");
    }

    #[test]
    fn a_media_prompt_renders_up_to_its_first_media_message() {
        let body = br#"{"messages": [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "user", "content": "and this?"}]}"#;
        let req = crate::openai::parse(crate::openai::Endpoint::Chat, body).unwrap();
        let Input::Messages(msgs) = &req.input else {
            panic!("{req:?}")
        };
        let t = ChatTemplate::default();
        let full = chat_text(&t, msgs).unwrap();
        let before = chat_text_before(&t, msgs, 1).unwrap();
        assert_eq!(
            before,
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
        );
        assert!(full.starts_with(&before) && full.contains("what is"));
        assert_eq!(chat_text_before(&t, msgs, 3), None);
        // A template that does not render the content as given hides where it starts.
        let upper = ChatTemplate::new(
            "{% for m in messages %}{{ m.content | upper }}{% endfor %}",
            String::new(),
            String::new(),
        )
        .unwrap();
        assert_eq!(chat_text_before(&upper, msgs, 1), None);
    }

    #[test]
    fn builtin_bytes_is_bytes_and_chatml() {
        let (codec, template) = load(Path::new("builtin:bytes")).unwrap();
        assert!(matches!(codec, Codec::Bytes));
        // UTF-8 bytes, not chars: "é" is two tokens; no BOS even when asked for specials.
        assert_eq!(codec.encode("aé", true).unwrap(), vec![97, 0xc3, 0xa9]);
        assert_eq!(codec.vocab_limit(), None);
        let msgs = serde_json::json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"}
        ]);
        assert_eq!(
            template.render(&msgs).unwrap(),
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        // The same template kvmock uses without a tokenizer: the two render alike.
        assert_eq!(
            template.render(&msgs).unwrap(),
            ChatTemplate::default().render(&msgs).unwrap()
        );
    }

    #[test]
    fn an_unknown_builtin_names_the_value_and_the_choices() {
        let e = load(Path::new("builtin:xyz")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tokenizer builtin:xyz: unknown built-in tokenizer, expected builtin:bytes"
        );
        // Not a path either: no file lookup happens for the prefix.
        assert!(builtin("builtin:").is_err());
        assert!(builtin("bytes").is_err());
    }

    #[test]
    fn without_a_tokenizer_text_is_bytes() {
        let c = Codec::Bytes;
        assert_eq!(c.encode("ab", true).unwrap(), vec![97, 98]);
        let t = c.output_token(0, 0, 0);
        assert!((97..123).contains(&t));
        assert_eq!(c.decoder().push(97), "a");
        let text = ChatTemplate::default()
            .render(&serde_json::json!([{"role": "user", "content": "hi"}]))
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
