//! How a generation's events become an HTTP response: one JSON body (`collect`) or a
//! server-sent event stream (`stream`), in the shape of OpenAI's completions or chat
//! completions.

use super::error::ApiError;
use super::logprobs::{self, TokenProbs};
use super::scheduler::Event;
use crate::text::FinishReason;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

/// How a response is written, per route.
pub(super) struct Reply {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) prompt_tokens: usize,
    pub(super) n: usize,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) return_ids: bool,
    /// The request asked for log-probabilities.
    pub(super) logprobs: bool,
}

impl Reply {
    fn object(&self) -> &'static str {
        match (self.kind, self.stream) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn usage(&self, completion: usize, cached: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object(), "created": self.created, "model": self.model,
               "choices": choices})
    }

    /// What follows `"choices":[…]` in each streamed chunk: `,"created":…,"id":…,"model":…,"object":…}`,
    /// written once per response.
    fn chunk_tail(&self) -> String {
        let head = json!({"id": self.id, "object": self.object(), "created": self.created,
                          "model": self.model});
        format!(",{}", &head.to_string()[1..])
    }

    /// One streamed piece of choice `index` as JSON text (`tail` from
    /// [`Reply::chunk_tail`]). Written directly, as it goes out for every token of every
    /// client: the same text as serialising the chunk's `Value` (keys in serde_json's
    /// sorted order), without building one.
    fn delta(
        &self,
        tail: &str,
        index: usize,
        text: &str,
        token: u32,
        finish: Option<FinishReason>,
    ) -> String {
        use std::fmt::Write;
        let text = Value::from(text).to_string();
        let fin = match finish {
            Some(f) => format!("\"{}\"", f.as_str()),
            None => "null".into(),
        };
        let mut s = String::with_capacity(96 + text.len() + tail.len());
        s.push_str("{\"choices\":[{");
        let _ = match self.kind {
            Kind::Completion => write!(
                s,
                "\"finish_reason\":{fin},\"index\":{index},\"logprobs\":null,\"text\":{text}"
            ),
            Kind::Chat if text == "\"\"" => write!(
                s,
                "\"delta\":{{}},\"finish_reason\":{fin},\"index\":{index},\"logprobs\":null"
            ),
            Kind::Chat => write!(
                s,
                "\"delta\":{{\"content\":{text}}},\"finish_reason\":{fin},\"index\":{index},\"logprobs\":null"
            ),
        };
        if self.return_ids {
            let _ = write!(s, ",\"token_ids\":[{token}]");
        }
        s.push_str("}]");
        s.push_str(tail);
        s
    }
}

/// Collected output of one choice.
#[derive(Default, Clone)]
struct Choice {
    text: String,
    tokens: Vec<u32>,
    probs: Vec<TokenProbs>,
    finish: Option<FinishReason>,
    cached: usize,
}

impl Reply {
    /// The `logprobs` of a choice (or of a streamed piece of one) holding `probs`, its first
    /// token at character `offset` of the completion; `null` when none were asked for.
    fn logprobs(&self, probs: &[TokenProbs], offset: usize) -> Value {
        match (self.logprobs, self.kind) {
            (false, _) => Value::Null,
            (true, Kind::Completion) => logprobs::completion(probs, offset),
            (true, Kind::Chat) => logprobs::chat(probs),
        }
    }

    /// One streamed piece that carries a token's log-probabilities, as a `Value` (the
    /// rarer path: [`Reply::delta`] writes the others directly).
    fn delta_with_logprobs(
        &self,
        index: usize,
        text: &str,
        token: u32,
        finish: Option<FinishReason>,
        probs: &TokenProbs,
        offset: usize,
    ) -> Value {
        let fin = finish.map(|f| f.as_str());
        let lp = self.logprobs(std::slice::from_ref(probs), offset);
        let mut c = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text, "logprobs": lp, "finish_reason": fin})
            }
            Kind::Chat => {
                let delta = if text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": fin})
            }
        };
        if self.return_ids {
            c["token_ids"] = json!([token]);
        }
        self.chunk(json!([c]))
    }
}

pub(super) async fn collect(
    reply: &Reply,
    mut rx: UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut choices = vec![Choice::default(); reply.n];
    let mut left = reply.n;
    while left > 0 {
        match rx.recv().await {
            Some(Event::Started {
                index,
                cached_tokens,
            }) => choices[index].cached = cached_tokens,
            Some(Event::Token {
                index,
                token,
                text,
                finish,
                logprobs,
            }) => {
                let c = &mut choices[index];
                c.text.push_str(&text);
                c.tokens.push(token);
                c.probs.extend(logprobs);
                if finish.is_some() {
                    c.finish = finish;
                    left -= 1;
                }
            }
            Some(Event::Finish { index, reason }) => {
                choices[index].finish = Some(reason);
                left -= 1;
            }
            Some(Event::Error { message, .. }) => return Err(ApiError::internal(message)),
            None => {
                return Err(ApiError::internal(
                    "the engine stopped before the answer was complete",
                ))
            }
        }
    }
    let completion: usize = choices.iter().map(|c| c.tokens.len()).sum();
    let cached: usize = choices.iter().map(|c| c.cached).sum();
    let list: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let fin = c.finish.map(|f| f.as_str());
            let lp = reply.logprobs(&c.probs, 0);
            let mut v = match reply.kind {
                Kind::Completion => {
                    json!({"index": i, "text": c.text, "logprobs": lp, "finish_reason": fin})
                }
                Kind::Chat => {
                    json!({"index": i, "message": {"role": "assistant", "content": c.text},
                                     "logprobs": lp, "finish_reason": fin})
                }
            };
            if reply.return_ids {
                v["token_ids"] = json!(c.tokens);
            }
            v
        })
        .collect();
    let mut body = reply.chunk(json!(list));
    body["usage"] = reply.usage(completion, cached);
    Ok(axum::Json(body).into_response())
}

struct StreamState {
    rx: UnboundedReceiver<Event>,
    reply: Reply,
    /// `reply.chunk_tail()`
    tail: String,
    out: VecDeque<SseEvent>,
    /// Per choice: where its next token's text offset starts (completions' logprobs).
    offsets: Vec<usize>,
    left: usize,
    completion: usize,
    cached: usize,
    done: bool,
}

impl StreamState {
    fn push_json(&mut self, v: Value) {
        self.out.push_back(SseEvent::default().data(v.to_string()));
    }

    fn finish(&mut self) {
        if self.reply.include_usage {
            let mut u = self.reply.chunk(json!([]));
            u["usage"] = self.reply.usage(self.completion, self.cached);
            self.push_json(u);
        }
        self.out.push_back(SseEvent::default().data("[DONE]"));
        self.done = true;
    }

    fn take(&mut self, ev: Option<Event>) {
        match ev {
            Some(Event::Started {
                index,
                cached_tokens,
            }) => {
                self.cached += cached_tokens;
                if self.reply.kind == Kind::Chat {
                    let c = json!([{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": null, "finish_reason": null}]);
                    let v = self.reply.chunk(c);
                    self.push_json(v);
                }
            }
            Some(Event::Token {
                index,
                token,
                text,
                finish,
                logprobs: Some(probs),
            }) => {
                // (every token goes out with its log-probabilities, text or none)
                self.completion += 1;
                let at = self.offsets[index];
                self.offsets[index] += logprobs::advance(std::slice::from_ref(&probs));
                let v = self
                    .reply
                    .delta_with_logprobs(index, &text, token, finish, &probs, at);
                self.push_json(v);
                if finish.is_some() {
                    self.left -= 1;
                    if self.left == 0 {
                        self.finish();
                    }
                }
            }
            Some(Event::Token {
                index,
                token,
                text,
                finish,
                logprobs: None,
            }) => {
                self.completion += 1;
                if !text.is_empty() || finish.is_some() || self.reply.return_ids {
                    let d = self.reply.delta(&self.tail, index, &text, token, finish);
                    self.out.push_back(SseEvent::default().data(d));
                }
                if finish.is_some() {
                    self.left -= 1;
                    if self.left == 0 {
                        self.finish();
                    }
                }
            }
            Some(Event::Finish { index, reason }) => {
                let c = match self.reply.kind {
                    Kind::Completion => json!([{"index": index, "text": "", "logprobs": null,
                                                "finish_reason": reason.as_str()}]),
                    Kind::Chat => json!([{"index": index, "delta": {}, "logprobs": null,
                                          "finish_reason": reason.as_str()}]),
                };
                let v = self.reply.chunk(c);
                self.push_json(v);
                self.left -= 1;
                if self.left == 0 {
                    self.finish();
                }
            }
            Some(Event::Error { message, .. }) => {
                self.push_json(ApiError::internal(message).body());
                self.out.push_back(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
            None => {
                self.push_json(
                    ApiError::internal("the engine stopped before the answer was complete").body(),
                );
                self.out.push_back(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
        }
    }
}

pub(super) fn stream(reply: Reply, rx: UnboundedReceiver<Event>) -> Response {
    let st = StreamState {
        rx,
        left: reply.n,
        offsets: vec![0; reply.n],
        tail: reply.chunk_tail(),
        reply,
        out: VecDeque::new(),
        completion: 0,
        cached: 0,
        done: false,
    };
    let s = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((Ok::<_, Infallible>(e), st));
            }
            if st.done {
                return None;
            }
            let ev = st.rx.recv().await;
            st.take(ev);
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamed chunk as a `Value`, serialised: what [`Reply::delta`] must write.
    fn delta_value(
        r: &Reply,
        index: usize,
        text: &str,
        token: u32,
        finish: Option<FinishReason>,
    ) -> String {
        let fin = finish.map(|f| f.as_str());
        let mut c = match r.kind {
            Kind::Completion => {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": fin})
            }
            Kind::Chat => {
                let delta = if text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": fin})
            }
        };
        if r.return_ids {
            c["token_ids"] = json!([token]);
        }
        r.chunk(json!([c])).to_string()
    }

    #[test]
    fn streamed_chunks_are_the_values_text() {
        for kind in [Kind::Completion, Kind::Chat] {
            for return_ids in [false, true] {
                let r = Reply {
                    kind,
                    id: "cmpl-6f0a\"x".into(),
                    created: 1_700_000_000,
                    model: "mamba3 \\ \u{e9}".into(),
                    prompt_tokens: 3,
                    n: 2,
                    stream: true,
                    include_usage: false,
                    return_ids,
                    logprobs: false,
                };
                let tail = r.chunk_tail();
                for text in ["", "a", " said \"hi\"\n\tthen\\", "\u{1F600}\u{0}\u{1f}"] {
                    for finish in [None, Some(FinishReason::Stop), Some(FinishReason::Length)] {
                        let got = r.delta(&tail, 1, text, 31999, finish);
                        assert_eq!(got, delta_value(&r, 1, text, 31999, finish));
                    }
                }
            }
        }
    }
}
