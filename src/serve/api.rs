//! The OpenAI request bodies, read leniently where clients differ (a prompt as text, texts,
//! token ids or lists of token ids; `stop` as a string or a list) and strictly where a
//! value is wrong: every refusal names the field, what it accepts and what it got.

use super::error::ApiError;
use super::scheduler::Pooling;
use crate::text::sampling::parse_logit_bias;
use crate::text::{ChatMessage, GenParams, SamplingParams, Tokenizer};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::BTreeMap;

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `/v1/completions` and `/v1/chat/completions` bodies (each route reads its own fields).
#[derive(Deserialize, Debug, Default)]
pub struct GenRequest {
    pub model: Option<String>,
    /// kept as text: a long prompt of token ids is read by [`prompts`] without a `Value`
    pub prompt: Option<Box<RawValue>>,
    pub messages: Option<Value>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
    pub return_token_ids: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub user: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
pub struct EmbedRequest {
    pub model: Option<String>,
    pub input: Option<Box<RawValue>>,
    pub encoding_format: Option<String>,
    pub pooling: Option<String>,
    pub dimensions: Option<u64>,
    pub user: Option<String>,
}

/// Parse a JSON body into `T`, telling malformed JSON from a field of the wrong type.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace()).copied();
    if first != Some(b'{') {
        let found = match serde_json::from_slice::<Value>(body) {
            Ok(v) => kind(&v).to_string(),
            Err(e) => format!("text that is not valid JSON ({e})"),
        };
        return Err(ApiError::invalid(format!(
            "the body must be a JSON object, found {found}"
        )));
    }
    // Tracking the path costs as much again as the parse (a long prompt of token ids is
    // thousands of elements): only a body that fails is read a second time, with it.
    if let Ok(v) = serde_json::from_slice::<T>(body) {
        return Ok(v);
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.classify() == serde_json::error::Category::Data && path != "." {
                Err(ApiError::param(&path, format!("`{path}`: {inner}")))
            } else {
                Err(ApiError::invalid(format!(
                    "the body is not valid JSON for this route (expected a JSON object): {inner}"
                )))
            }
        }
    }
}

/// Server limits a request is checked against.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_tokens: usize,
    pub max_prompt_tokens: usize,
    /// Text longer than this cannot be within `max_prompt_tokens` (no token stands for
    /// more bytes than the tokenizer's longest entry), so it is refused before tokenizing.
    pub max_prompt_bytes: usize,
}

/// The refusal of a prompt text too long to tokenize within the limits.
pub fn too_long(field: &str, bytes: usize, limits: &Limits) -> ApiError {
    ApiError::param(
        field,
        format!(
            "the prompt has {bytes} bytes of text: more than {} tokens (--max-prompt-tokens) \
             whatever it says, since no token of this tokenizer stands for more than {} bytes",
            limits.max_prompt_tokens,
            limits.max_prompt_bytes / limits.max_prompt_tokens.max(1)
        ),
    )
    .code("context_length_exceeded")
}

/// A prompt as given: text to tokenize or token ids.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptIn {
    Text(String),
    Ids(Vec<i64>),
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `prompt` / `input`: a string, an array of strings, an array of token ids, or an array
/// of arrays of token ids.
pub fn prompts(field: &str, raw: &RawValue) -> Result<Vec<PromptIn>, ApiError> {
    if let Some(ids) = flat_ids(raw.get()) {
        return Ok(vec![PromptIn::Ids(ids)]);
    }
    let v: Value = serde_json::from_str(raw.get())
        .map_err(|e| ApiError::param(field, format!("`{field}` is not valid JSON: {e}")))?;
    prompt_values(field, &v)
}

/// The common shape, a flat non-empty array of integers, read straight from the (already
/// validated) JSON text: a 4k-token prompt in a few tens of microseconds rather than a
/// `Value` tree. Anything else (floats, exponents, nesting, overflow) is `None`, for the
/// general path and its error messages.
fn flat_ids(text: &str) -> Option<Vec<i64>> {
    let body = text.trim().strip_prefix('[')?.strip_suffix(']')?;
    let mut ids = Vec::with_capacity(body.len() / 4 + 1);
    for item in body.split(',') {
        let item = item.trim_matches(|c: char| c.is_ascii_whitespace());
        let digits = item.strip_prefix('-').unwrap_or(item);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        ids.push(item.parse().ok()?);
    }
    Some(ids)
}

fn prompt_values(field: &str, v: &Value) -> Result<Vec<PromptIn>, ApiError> {
    let shape = || {
        format!(
            "`{field}` must be a string, an array of strings, an array of token ids or an array \
             of arrays of token ids"
        )
    };
    let ids = |a: &[Value], at: &str| -> Result<Vec<i64>, ApiError> {
        a.iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_i64().ok_or_else(|| {
                    ApiError::param(
                        field,
                        format!(
                            "{}: element {at}{i} is {}, expected a token id",
                            shape(),
                            kind(x)
                        ),
                    )
                })
            })
            .collect()
    };
    match v {
        Value::String(s) => Ok(vec![PromptIn::Text(s.clone())]),
        Value::Array(a) if a.is_empty() => Err(ApiError::param(
            field,
            format!("`{field}` is an empty array: expected at least one prompt"),
        )),
        Value::Array(a) => match &a[0] {
            Value::String(_) => a
                .iter()
                .enumerate()
                .map(|(i, x)| match x {
                    Value::String(s) => Ok(PromptIn::Text(s.clone())),
                    other => Err(ApiError::param(
                        field,
                        format!(
                            "{}: element {i} is {}, expected a string",
                            shape(),
                            kind(other)
                        ),
                    )),
                })
                .collect(),
            Value::Number(_) => Ok(vec![PromptIn::Ids(ids(a, "")?)]),
            Value::Array(_) => a
                .iter()
                .enumerate()
                .map(|(i, x)| match x {
                    Value::Array(inner) => Ok(PromptIn::Ids(ids(inner, &format!("{i}."))?)),
                    other => Err(ApiError::param(
                        field,
                        format!(
                            "{}: element {i} is {}, expected an array of token ids",
                            shape(),
                            kind(other)
                        ),
                    )),
                })
                .collect(),
            other => Err(ApiError::param(
                field,
                format!("{}: found an array of {}", shape(), kind(other)),
            )),
        },
        other => Err(ApiError::param(
            field,
            format!("{}, found {}", shape(), kind(other)),
        )),
    }
}

/// Tokens of a prompt, checked against the vocabulary and the length limit.
pub fn tokens_of(
    field: &str,
    p: &PromptIn,
    tokenizer: Option<&Tokenizer>,
    add_special: bool,
    vocab: usize,
    limits: &Limits,
) -> Result<Vec<u32>, ApiError> {
    let ids: Vec<u32> = match p {
        PromptIn::Text(t) => {
            let tok = tokenizer.ok_or_else(|| no_tokenizer(field))?;
            if t.len() > limits.max_prompt_bytes {
                return Err(too_long(field, t.len(), limits));
            }
            tok.encode(t, add_special)
                .map_err(|e| ApiError::param(field, e.to_string()))?
        }
        PromptIn::Ids(ids) => ids
            .iter()
            .enumerate()
            .map(|(pos, &id)| {
                if id < 0 || id as u64 >= vocab as u64 {
                    Err(ApiError::param(
                        field,
                        format!(
                            "token id {id} at position {pos} is out of range: the model's vocabulary \
                             has {vocab} entries (0..{vocab})"
                        ),
                    ))
                } else {
                    Ok(id as u32)
                }
            })
            .collect::<Result<_, _>>()?,
    };
    if ids.is_empty() {
        return Err(ApiError::param(
            field,
            format!("`{field}` is empty: expected at least one token"),
        ));
    }
    if let Some((pos, &id)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(ApiError::param(
            field,
            format!(
                "the tokenizer produced id {id} at position {pos}, outside the model's vocabulary of \
                 {vocab}: the tokenizer does not belong to this model"
            ),
        ));
    }
    if ids.len() > limits.max_prompt_tokens {
        return Err(ApiError::param(
            field,
            format!(
                "the prompt has {} tokens; this server accepts at most {} (--max-prompt-tokens)",
                ids.len(),
                limits.max_prompt_tokens
            ),
        )
        .code("context_length_exceeded"));
    }
    Ok(ids)
}

pub fn no_tokenizer(field: &str) -> ApiError {
    ApiError::param(
        field,
        format!(
            "this model has no tokenizer (no tokenizer.json in its directory; start the server \
             with --tokenizer FILE), so `{field}` must be given as token ids"
        ),
    )
}

/// `stop`: a string or an array of strings.
fn stops(v: &Option<Value>) -> Result<Vec<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => {
            if a.len() > 16 {
                return Err(ApiError::param(
                    "stop",
                    format!("`stop` has {} entries: at most 16 are accepted", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::param(
                            "stop",
                            format!("`stop` element {i} is {}, expected a string", kind(x)),
                        )
                    })
                })
                .collect()
        }
        Some(other) => Err(ApiError::param(
            "stop",
            format!(
                "`stop` must be a string or an array of strings, found {}",
                kind(other)
            ),
        )),
    }
}

/// A count of alternatives, `field` of the request: an integer in 0..=20.
fn top_count(field: &str, v: &Value) -> Result<usize, ApiError> {
    let most = crate::engine::logprobs::MAX_TOP_LOGPROBS;
    match v.as_u64() {
        Some(n) if n <= most as u64 => Ok(n as usize),
        _ => Err(ApiError::param(
            field,
            format!("`{field}` must be an integer in 0..={most}, found {v}"),
        )),
    }
}

/// How many alternatives each token's log-probabilities list (`None`: none asked for).
/// `/v1/completions` asks with `logprobs: n`; `/v1/chat/completions` (`chat`) with
/// `logprobs: true` and `top_logprobs: n` (0 when left out).
fn logprobs(r: &GenRequest, chat: bool) -> Result<Option<usize>, ApiError> {
    let given = |v: &Option<Value>| v.as_ref().filter(|v| !v.is_null()).cloned();
    let (logprobs, top) = (given(&r.logprobs), given(&r.top_logprobs));
    if !chat {
        if let Some(v) = top {
            return Err(ApiError::param(
                "top_logprobs",
                format!(
                    "`top_logprobs` is a field of /v1/chat/completions, found {v}:                      /v1/completions takes `logprobs` as the count of alternatives"
                ),
            ));
        }
        return match logprobs {
            None | Some(Value::Bool(false)) => Ok(None),
            Some(v) => top_count("logprobs", &v).map(Some),
        };
    }
    let on = match logprobs {
        None | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => {
            return Err(ApiError::param(
                "logprobs",
                format!("`logprobs` must be true or false, found {v}"),
            ))
        }
    };
    match (on, top) {
        (false, Some(v)) => Err(ApiError::param(
            "top_logprobs",
            format!("`top_logprobs` is {v} but `logprobs` is not true: set `logprobs: true`"),
        )),
        (false, None) => Ok(None),
        (true, None) => Ok(Some(0)),
        (true, Some(v)) => top_count("top_logprobs", &v).map(Some),
    }
}

/// Generation parameters of a request (`chat`: of `/v1/chat/completions`); `default_max`
/// applies when it names no limit.
pub fn gen_params(
    r: &GenRequest,
    chat: bool,
    limits: &Limits,
    default_max: usize,
    vocab: usize,
    has_tokenizer: bool,
) -> Result<GenParams, ApiError> {
    if let Some(n) = r.n {
        if n != 1 {
            return Err(ApiError::param(
                "n",
                format!("`n` is {n}: this server returns one choice per prompt (n = 1)"),
            ));
        }
    }
    if let Some(b) = r.best_of {
        if b != 1 {
            return Err(ApiError::param(
                "best_of",
                format!("`best_of` is {b}: only 1 is supported"),
            ));
        }
    }
    let logprobs = logprobs(r, chat)?;
    if r.echo == Some(true) {
        return Err(ApiError::param(
            "echo",
            "`echo` is not supported by this server",
        ));
    }
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param(
            "suffix",
            "`suffix` is not supported by this server",
        ));
    }
    let max = r.max_completion_tokens.or(r.max_tokens);
    let max_tokens = match max {
        None => default_max.min(limits.max_tokens),
        Some(0) => {
            return Err(ApiError::param(
                "max_tokens",
                "`max_tokens` is 0: expected at least 1",
            ))
        }
        Some(m) if m > limits.max_tokens as u64 => {
            return Err(ApiError::param(
                "max_tokens",
                format!(
                    "`max_tokens` is {m}; this server generates at most {} tokens per request \
                     (--max-tokens-limit)",
                    limits.max_tokens
                ),
            ))
        }
        Some(m) => m as usize,
    };
    let top_k = match r.top_k {
        None | Some(0) | Some(-1) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::param(
                "top_k",
                format!("`top_k` must be a positive integer, or 0 or -1 for off; found {k}"),
            ))
        }
    };
    let stop = stops(&r.stop)?;
    if !stop.is_empty() && !has_tokenizer {
        return Err(ApiError::param(
            "stop",
            "stop strings need a tokenizer and this model has none: use `stop_token_ids`",
        ));
    }
    let stop_token_ids = r.stop_token_ids.clone().unwrap_or_default();
    if let Some(t) = stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::param(
            "stop_token_ids",
            format!("stop token id {t} is outside the vocabulary (0..{vocab})"),
        ));
    }
    let logit_bias = match &r.logit_bias {
        Some(m) => {
            parse_logit_bias(m, vocab).map_err(|e| ApiError::param("logit_bias", e.to_string()))?
        }
        None => vec![],
    };
    let sampling = SamplingParams {
        temperature: r.temperature.unwrap_or(1.0),
        top_k,
        top_p: r.top_p.unwrap_or(1.0),
        min_p: r.min_p.unwrap_or(0.0),
        repetition_penalty: r.repetition_penalty.unwrap_or(1.0),
        frequency_penalty: r.frequency_penalty.unwrap_or(0.0),
        presence_penalty: r.presence_penalty.unwrap_or(0.0),
        seed: r.seed.map(|s| s as u64),
        logit_bias,
        logprobs,
    };
    sampling
        .validate()
        .map_err(|(field, msg)| ApiError::param(&field, msg))?;
    Ok(GenParams {
        sampling,
        max_tokens,
        stop,
        stop_token_ids,
        ignore_eos: r.ignore_eos.unwrap_or(false),
    })
}

/// `messages`: objects with a `role` and a `content` that is a string, null, or an array
/// of text parts.
pub fn messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let field = "messages";
    let arr = match v {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => {
            return Err(ApiError::param(
                field,
                "`messages` is empty: expected at least one message",
            ))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::param(
                field,
                "`messages` is missing: expected an array of messages",
            ))
        }
        Some(other) => {
            return Err(ApiError::param(
                field,
                format!(
                    "`messages` must be an array of messages, found {}",
                    kind(other)
                ),
            ))
        }
    };
    arr.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| {
                ApiError::param(field, format!("message {i} has no string `role`"))
            })?;
            let content = match m.get("content") {
                // Only an assistant turn may have no text (OpenAI: one that made tool calls).
                Some(Value::Null) if role == "assistant" => String::new(),
                None | Some(Value::Null) => {
                    return Err(ApiError::param(
                        field,
                        format!(
                            "message {i} (role {role:?}) has no `content`: expected a string or \
                             an array of text parts"
                        ),
                    ))
                }
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (
                            p.get("type").and_then(|t| t.as_str()),
                            p.get("text").and_then(|t| t.as_str()),
                        ) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            (ty, _) => {
                                return Err(ApiError::param(
                                    field,
                                    format!(
                                        "message {i} part {j} has type {ty:?}: only text parts \
                                         ({{\"type\": \"text\", \"text\": ...}}) are supported"
                                    ),
                                ))
                            }
                        }
                    }
                    text
                }
                Some(other) => {
                    return Err(ApiError::param(
                        field,
                        format!(
                        "message {i}: `content` must be a string or an array of parts, found {}",
                        kind(other)
                    ),
                    ))
                }
            };
            Ok(ChatMessage {
                role: role.to_string(),
                content,
            })
        })
        .collect()
}

pub fn pooling(v: &Option<String>) -> Result<Pooling, ApiError> {
    match v.as_deref() {
        None | Some("last") => Ok(Pooling::Last),
        Some("mean") => Ok(Pooling::Mean),
        Some(other) => Err(ApiError::param(
            "pooling",
            format!("`pooling` is {other:?}: expected \"last\" or \"mean\""),
        )),
    }
}

/// Standard base64 of little-endian f32s (OpenAI's `encoding_format: "base64"`).
pub fn base64_f32(v: &[f32]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        out.push(A[(n >> 18) as usize & 63] as char);
        out.push(A[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            A[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            A[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_shapes() {
        let p = |s: &str| prompts("prompt", &serde_json::from_str::<Box<RawValue>>(s).unwrap());
        assert_eq!(p("\"hi\"").unwrap(), vec![PromptIn::Text("hi".into())]);
        assert_eq!(p("[1,2]").unwrap(), vec![PromptIn::Ids(vec![1, 2])]);
        assert_eq!(p("[[1],[2,3]]").unwrap().len(), 2);
        assert_eq!(p("[\"a\",\"b\"]").unwrap().len(), 2);
        let e = p("[1,\"x\"]").unwrap_err();
        assert!(e.message.contains("element 1 is a string"), "{}", e.message);
        assert!(p("{}").unwrap_err().message.contains("found an object"));
        assert!(p("[]").is_err());
        // The flat-ids fast path agrees with the general one, and leaves it what it cannot read.
        assert_eq!(
            p(" [ 7 ,\n8,-1 ] ").unwrap(),
            vec![PromptIn::Ids(vec![7, 8, -1])]
        );
        assert_eq!(p("[0]").unwrap(), vec![PromptIn::Ids(vec![0])]);
        let e = p("[1, 2.5]").unwrap_err();
        assert!(e.message.contains("element 1 is a number"), "{}", e.message);
        let e = p("[1, 99999999999999999999]").unwrap_err();
        assert!(e.message.contains("element 1 is a number"), "{}", e.message);
        assert!(p("[1,[2]]")
            .unwrap_err()
            .message
            .contains("element 1 is an array"));
    }

    #[test]
    fn body_errors_name_the_field() {
        let e = parse_body::<GenRequest>(b"{\"max_tokens\": \"ten\"}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("invalid type: string"), "{}", e.message);
        let e = parse_body::<GenRequest>(b"{\"max_tokens\": 3,").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        let e = parse_body::<GenRequest>(b"[1]").unwrap_err();
        assert!(e.message.contains("JSON object"), "{}", e.message);
    }

    #[test]
    fn limits_are_enforced() {
        let limits = Limits {
            max_tokens: 100,
            max_prompt_tokens: 4,
            max_prompt_bytes: 16,
        };
        let r = GenRequest {
            max_tokens: Some(101),
            ..Default::default()
        };
        let e = gen_params(&r, false, &limits, 16, 50, true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = tokens_of(
            "prompt",
            &PromptIn::Ids(vec![1; 5]),
            None,
            true,
            50,
            &limits,
        )
        .unwrap_err();
        assert!(e.message.contains("5 tokens"), "{}", e.message);
        let e = tokens_of(
            "prompt",
            &PromptIn::Ids(vec![1, 50]),
            None,
            true,
            50,
            &limits,
        )
        .unwrap_err();
        assert!(
            e.message.contains("token id 50 at position 1"),
            "{}",
            e.message
        );
        let e = tokens_of(
            "prompt",
            &PromptIn::Text("x".into()),
            None,
            true,
            50,
            &limits,
        )
        .unwrap_err();
        assert!(e.message.contains("no tokenizer"), "{}", e.message);
    }

    #[test]
    fn base64_matches_known_values() {
        // 1.0f32 = 00 00 80 3f
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
    }
}
