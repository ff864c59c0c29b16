//! The OpenAI-compatible surface: reading `/v1/completions` and `/v1/chat/completions`
//! requests, and writing their answers, streamed as server-sent events (one `data:` chunk per
//! token, then `data: [DONE]`) or whole.
//!
//! The simulator's tokenizer: one token per whitespace-separated word, its id a hash of the
//! word ([`token_id`]). Real BPE tokenizers make about 1.3 tokens of an English word; what
//! matters here is that equal texts give equal ids, so that a prompt repeating an earlier
//! prompt and its answer (as a chat client resends history) hits the prefix cache. The words
//! the simulated model says ([`Writer::word`]) are tokens of the same tokenizer: an answer's
//! text, sent back, is the answer's tokens.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::model::TokenId;
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
    /// The prompt's token ids; None when the request gave only `prompt_tokens` (a prompt
    /// with no content, which the prefix cache cannot hit).
    pub prompt_ids: Option<Vec<TokenId>>,
    pub max_tokens: u32,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage before `[DONE]`.
    pub stream_usage: bool,
    pub model: Option<String>,
}

/// FNV-1a of a string: stable across runs and builds.
pub fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The id of one word.
pub fn token_id(word: &str) -> TokenId {
    fnv(word)
}

/// A text's tokens: one per whitespace-separated word.
pub fn tokenize(text: &str) -> impl Iterator<Item = TokenId> + '_ {
    text.split_whitespace().map(token_id)
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
    /// Benchmark extension: the prompt's length in tokens, overriding the text's (and its
    /// content: the prompt counts as N tokens with no ids).
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// Parses a request body. Unknown fields (temperature, top_p, ...) are accepted and ignored,
/// as the sampling parameters change nothing in the model.
pub fn parse(api: Api, body: &[u8]) -> Result<Job, String> {
    let b: Body =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid: {e}"))?;
    let ids = match api {
        Api::Completions => match &b.prompt {
            None if b.prompt_tokens.is_some() => Vec::new(),
            None => return Err("`prompt` is required (a string or a list of strings)".into()),
            Some(p) => prompt_ids(p)?,
        },
        Api::Chat => match &b.messages {
            None if b.prompt_tokens.is_some() => Vec::new(),
            None => return Err("`messages` is required (a list of {role, content})".into()),
            Some(m) => {
                let mut ids = Vec::new();
                for message in m {
                    message_ids(message, &mut ids)?;
                }
                ids
            }
        },
    };
    let (prompt_tokens, prompt_ids) = match b.prompt_tokens {
        Some(n) => (n, None),
        None => (u32::try_from(ids.len()).unwrap_or(u32::MAX), Some(ids)),
    };
    let default = match api {
        Api::Completions => DEFAULT_MAX_TOKENS_COMPLETION,
        Api::Chat => DEFAULT_MAX_TOKENS_CHAT,
    };
    Ok(Job {
        prompt_tokens,
        prompt_ids,
        max_tokens: b.max_tokens.or(b.max_completion_tokens).unwrap_or(default),
        stream: b.stream.unwrap_or(false),
        stream_usage: b
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        model: b.model,
    })
}

/// A prompt's tokens: a string, a list of strings (one after the other), or token ids (a
/// list of numbers, or of lists of numbers), taken as they are.
fn prompt_ids(p: &Value) -> Result<Vec<TokenId>, String> {
    let id = |v: &Value| {
        v.as_u64()
            .ok_or_else(|| "token ids in `prompt` must be integers >= 0".to_string())
    };
    match p {
        Value::String(s) => Ok(tokenize(s).collect()),
        Value::Array(items) => {
            let mut ids = Vec::new();
            for i in items {
                match i {
                    Value::String(s) => ids.extend(tokenize(s)),
                    Value::Number(_) => ids.push(id(i)?),
                    Value::Array(list) => {
                        for v in list {
                            ids.push(id(v)?);
                        }
                    }
                    _ => return Err("`prompt` items must be strings or token ids".to_string()),
                }
            }
            Ok(ids)
        }
        _ => Err("`prompt` must be a string or a list of strings".into()),
    }
}

/// A chat message's content: a string, or a list of parts whose `text` counts. (A real chat
/// template adds role tokens between messages; the simulator has none.)
fn message_ids(m: &Value, ids: &mut Vec<TokenId>) -> Result<(), String> {
    match m.get("content") {
        Some(Value::String(s)) => ids.extend(tokenize(s)),
        Some(Value::Array(parts)) => {
            for t in parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
            {
                ids.extend(tokenize(t));
            }
        }
        Some(Value::Null) | None => {}
        Some(_) => return Err("a message's `content` must be a string or a list of parts".into()),
    }
    Ok(())
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
    /// Offset into `WORDS` (from the seed), so accelerators do not all say the same.
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

    /// The token ids of the first `n` words, as the tokenizer reads them back.
    pub fn token_ids(&self, n: u32) -> Vec<TokenId> {
        (1..=n).flat_map(|i| tokenize(self.word(i))).collect()
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

    /// The SSE event that ends a stream with `stream_options.include_usage`: no choices,
    /// the usage.
    pub fn usage_chunk(&self, prompt_tokens: u32, tokens: u32, cached_tokens: u32) -> String {
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        };
        let v = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": usage(prompt_tokens, tokens, cached_tokens),
        });
        format!("data: {v}\n\n")
    }

    /// The whole answer of a non-streaming request.
    pub fn whole(&self, prompt_tokens: u32, tokens: u32, cached_tokens: u32) -> Value {
        let text: String = (1..=tokens).map(|i| self.word(i)).collect();
        let usage = usage(prompt_tokens, tokens, cached_tokens);
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

/// OpenAI's usage object; `cached_tokens`: prompt tokens that came from the prefix cache.
fn usage(prompt_tokens: u32, tokens: u32, cached_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tokens,
        "total_tokens": prompt_tokens + tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
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
    fn prompt_tokens_are_words_or_ids_or_the_benchmark_field() {
        let job = parse(
            Api::Completions,
            br#"{"prompt":"the cat  sat\non the mat","max_tokens":5,"stream":true,"temperature":0}"#,
        )
        .unwrap();
        let ids = job.prompt_ids.clone().unwrap();
        assert_eq!(
            job,
            Job {
                prompt_tokens: 6,
                prompt_ids: Some(ids.clone()),
                max_tokens: 5,
                stream: true,
                stream_usage: false,
                model: None
            }
        );
        // One id per word, the same word the same id.
        assert_eq!(ids[0], token_id("the"));
        assert_eq!(ids[0], ids[4]);
        assert_ne!(ids[0], ids[1]);
        let job = parse(
            Api::Chat,
            br#"{"model":"m","messages":[{"role":"system","content":"you are brief"},
                {"role":"user","content":[{"type":"text","text":"hello"}]}],
                "stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(
            (job.prompt_tokens, job.max_tokens, job.stream_usage),
            (4, DEFAULT_MAX_TOKENS_CHAT, true)
        );
        assert_eq!(
            job.prompt_ids.unwrap(),
            tokenize("you are brief hello").collect::<Vec<_>>()
        );
        assert_eq!(job.model.as_deref(), Some("m"));
        // The benchmark field: a count with no content.
        let job = parse(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"a b"}],"prompt_tokens":700,"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(
            (
                job.prompt_tokens,
                job.prompt_ids,
                job.max_tokens,
                job.stream
            ),
            (700, None, 9, false)
        );
        let job = parse(Api::Completions, br#"{"prompt":["ab c",[1,2,3]]}"#).unwrap();
        assert_eq!((job.prompt_tokens, job.max_tokens), (5, 16));
        assert_eq!(
            job.prompt_ids.unwrap(),
            vec![token_id("ab"), token_id("c"), 1, 2, 3]
        );
        assert_eq!(
            parse(Api::Completions, br#"{"prompt_tokens":5}"#)
                .unwrap()
                .prompt_tokens,
            5
        );
    }

    /// An answer's text, sent back in a later prompt, is the answer's tokens: what lets a
    /// conversation's next turn hit the blocks of the answer.
    #[test]
    fn an_answer_read_back_is_its_tokens() {
        let w = Writer::new(Api::Completions, "gpu0", 1, "m", 0, 5);
        let text = w.whole(3, 40, 0)["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_owned();
        let streamed: String = (1..=40)
            .map(|i| {
                let c = w.chunk(i, i == 40);
                let v: Value = serde_json::from_str(c.trim_start_matches("data: ").trim()).unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_owned()
            })
            .collect();
        assert_eq!(text, streamed);
        assert_eq!(tokenize(&text).collect::<Vec<_>>(), w.token_ids(40));
        assert_eq!(w.token_ids(40).len(), 40);
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
        let e = parse(Api::Completions, br#"{"prompt":[[1,-2]]}"#).unwrap_err();
        assert!(e.contains("integers >= 0"), "{e}");
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
        let whole = w.whole(10, 2, 0);
        assert_eq!(whole["choices"][0]["message"]["content"], " steers every");
        assert_eq!(whole["usage"]["total_tokens"], 12);
        let usage: Value =
            serde_json::from_str(w.usage_chunk(10, 2, 8).trim_start_matches("data: ").trim())
                .unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert_eq!(usage["usage"]["completion_tokens"], 2);
    }
}
