//! The OpenAI-compatible surface: reading `/v1/completions` and `/v1/chat/completions`
//! requests, and writing their answers, streamed as server-sent events (one `data:` chunk per
//! token, then `data: [DONE]`) or whole.

use serde::Deserialize;
use serde_json::{json, Value};

/// Characters per token when a prompt's length is estimated from its text: the common rule
/// of thumb for English text with BPE tokenizers (an assumption; benchmarks send
/// `prompt_tokens` to say exactly).
pub const CHARS_PER_TOKEN: usize = 4;
/// `max_tokens` when a request has none: OpenAI's default for completions; for chat, an
/// assumption of a typical answer.
pub const DEFAULT_MAX_TOKENS_COMPLETION: u32 = 16;
pub const DEFAULT_MAX_TOKENS_CHAT: u32 = 256;

/// Which endpoint was called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
}

/// What a request asks of the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub stream: bool,
    pub model: Option<String>,
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    /// Benchmark extension: the prompt's length in tokens, overriding the text's.
    #[serde(default)]
    prompt_tokens: Option<u32>,
}

/// Parses a request body. Unknown fields (temperature, top_p, ...) are accepted and ignored,
/// as the sampling parameters change nothing in the model.
pub fn parse(api: Api, body: &[u8]) -> Result<Job, String> {
    let b: Body =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid: {e}"))?;
    let chars = match api {
        Api::Completions => match &b.prompt {
            None if b.prompt_tokens.is_some() => 0,
            None => return Err("`prompt` is required (a string or a list of strings)".into()),
            Some(p) => prompt_chars(p)?,
        },
        Api::Chat => match &b.messages {
            None if b.prompt_tokens.is_some() => 0,
            None => return Err("`messages` is required (a list of {role, content})".into()),
            Some(m) => m.iter().map(message_chars).sum::<Result<usize, String>>()?,
        },
    };
    let prompt_tokens = match b.prompt_tokens {
        Some(n) => n,
        None => u32::try_from(chars.div_ceil(CHARS_PER_TOKEN)).unwrap_or(u32::MAX),
    };
    let default = match api {
        Api::Completions => DEFAULT_MAX_TOKENS_COMPLETION,
        Api::Chat => DEFAULT_MAX_TOKENS_CHAT,
    };
    Ok(Job {
        prompt_tokens,
        max_tokens: b.max_tokens.or(b.max_completion_tokens).unwrap_or(default),
        stream: b.stream.unwrap_or(false),
        model: b.model,
    })
}

/// A prompt: a string, a list of strings, or token ids (a list of numbers, counted as tokens
/// x [`CHARS_PER_TOKEN`] characters).
fn prompt_chars(p: &Value) -> Result<usize, String> {
    match p {
        Value::String(s) => Ok(s.chars().count()),
        Value::Array(items) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => Ok(s.chars().count()),
                Value::Number(_) => Ok(CHARS_PER_TOKEN),
                Value::Array(ids) => Ok(ids.len() * CHARS_PER_TOKEN),
                _ => Err("`prompt` items must be strings or token ids".to_string()),
            })
            .sum(),
        _ => Err("`prompt` must be a string or a list of strings".into()),
    }
}

/// A chat message's content: a string, or a list of parts whose `text` counts.
fn message_chars(m: &Value) -> Result<usize, String> {
    match m.get("content") {
        Some(Value::String(s)) => Ok(s.chars().count()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| t.chars().count())
            .sum()),
        Some(Value::Null) | None => Ok(0),
        Some(_) => Err("a message's `content` must be a string or a list of parts".into()),
    }
}

/// The words the simulated model says, in turn.
const WORDS: [&str; 16] = [
    " Sluice",
    " steers",
    " every",
    " new",
    " stream",
    " to",
    " the",
    " accelerator",
    " that",
    " will",
    " serve",
    " it",
    " fastest",
    " and",
    " keeps",
    " it.",
];

/// Writes the answer of one request.
#[derive(Clone, Debug)]
pub struct Writer {
    pub api: Api,
    /// `cmpl-<backend>-<n>` / `chatcmpl-<backend>-<n>`.
    pub id: String,
    pub model: String,
    pub created: u64,
    /// Offset into [`WORDS`] (from the seed), so accelerators do not all say the same.
    pub word_offset: usize,
}

impl Writer {
    pub fn new(api: Api, backend: &str, n: u64, model: &str, created: u64, seed: u64) -> Self {
        let prefix = match api {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
        };
        Writer {
            api,
            id: format!("{prefix}-{backend}-{n}"),
            model: model.to_owned(),
            created,
            word_offset: (seed % WORDS.len() as u64) as usize,
        }
    }

    pub fn word(&self, index: u32) -> &'static str {
        WORDS[(self.word_offset + index as usize - 1) % WORDS.len()]
    }

    /// One SSE event for the `index`-th token; the last carries `finish_reason: "length"`.
    pub fn chunk(&self, index: u32, last: bool) -> String {
        let finish = if last { json!("length") } else { Value::Null };
        let word = self.word(index);
        let v = match self.api {
            Api::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": word, "logprobs": null, "finish_reason": finish}],
            }),
            Api::Chat => {
                let delta = if index == 1 {
                    json!({"role": "assistant", "content": word})
                } else {
                    json!({"content": word})
                };
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
        };
        format!("data: {v}\n\n")
    }

    /// The whole answer of a non-streaming request.
    pub fn whole(&self, prompt_tokens: u32, tokens: u32) -> Value {
        let text: String = (1..=tokens).map(|i| self.word(i)).collect();
        let usage = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        });
        match self.api {
            Api::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
                "usage": usage,
            }),
            Api::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": null, "finish_reason": "length"}],
                "usage": usage,
            }),
        }
    }
}

pub const DONE: &str = "data: [DONE]\n\n";

/// An OpenAI-style error body.
pub fn error(message: &str, kind: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_length_from_text_messages_or_the_benchmark_field() {
        let job = parse(
            Api::Completions,
            br#"{"prompt":"abcdefghi","max_tokens":5,"stream":true,"temperature":0}"#,
        )
        .unwrap();
        assert_eq!(
            job,
            Job {
                prompt_tokens: 3,
                max_tokens: 5,
                stream: true,
                model: None
            }
        );
        let job = parse(
            Api::Chat,
            br#"{"model":"m","messages":[{"role":"system","content":"12345678"},
                {"role":"user","content":[{"type":"text","text":"1234"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            (job.prompt_tokens, job.max_tokens),
            (3, DEFAULT_MAX_TOKENS_CHAT)
        );
        assert_eq!(job.model.as_deref(), Some("m"));
        let job = parse(
            Api::Chat,
            br#"{"messages":[],"prompt_tokens":700,"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(
            (job.prompt_tokens, job.max_tokens, job.stream),
            (700, 9, false)
        );
        let job = parse(Api::Completions, br#"{"prompt":["ab",[1,2,3]]}"#).unwrap();
        assert_eq!((job.prompt_tokens, job.max_tokens), (4, 16));
        assert_eq!(
            parse(Api::Completions, br#"{"prompt_tokens":5}"#)
                .unwrap()
                .prompt_tokens,
            5
        );
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let e = parse(Api::Completions, br#"{"max_tokens":5}"#).unwrap_err();
        assert!(e.contains("`prompt` is required"), "{e}");
        let e = parse(Api::Chat, br#"{"prompt":"x"}"#).unwrap_err();
        assert!(e.contains("`messages` is required"), "{e}");
        let e = parse(Api::Completions, br#"{"prompt":5}"#).unwrap_err();
        assert!(e.contains("must be a string"), "{e}");
        let e = parse(Api::Completions, b"{").unwrap_err();
        assert!(e.starts_with("request body is not valid"), "{e}");
        let e = parse(Api::Completions, br#"{"prompt":"x","max_tokens":-1}"#).unwrap_err();
        assert!(e.contains("expected u32"), "{e}");
    }

    #[test]
    fn chunks_are_openai_sse_events() {
        let w = Writer::new(Api::Completions, "gpu0", 7, "m", 1_700_000_000, 0);
        let c = w.chunk(1, false);
        assert!(c.starts_with("data: {") && c.ends_with("}\n\n"), "{c}");
        let v: Value = serde_json::from_str(c.trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(v["id"], "cmpl-gpu0-7");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " Sluice");
        assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
        let last: Value =
            serde_json::from_str(w.chunk(3, true).trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");

        let w = Writer::new(Api::Chat, "gpu1", 1, "m", 0, 1);
        let first: Value =
            serde_json::from_str(w.chunk(1, false).trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["delta"]["content"], " steers");
        let whole = w.whole(10, 2);
        assert_eq!(whole["choices"][0]["message"]["content"], " steers every");
        assert_eq!(whole["usage"]["total_tokens"], 12);
    }
}
