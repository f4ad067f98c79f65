//! Log-probabilities in OpenAI's two shapes. The engine reports each sampled token's
//! log-probability and its best alternatives by id ([`crate::engine::TokenLogprobs`], of the
//! model's raw logits: before temperature, penalties and bias); the emitter names the
//! tokens ([`TokenProbs::named`]) and the reply writes them:
//!
//! - `/v1/completions` (`logprobs: n`), the legacy shape: `{"tokens": [...],
//!   "token_logprobs": [...], "top_logprobs": [{token: logprob, ...}, ...],
//!   "text_offset": [...]}`, the offsets counted in characters from the completion's start
//!   (tokens whose texts are alike, as bytes of one character apart, are one key: the
//!   better one's);
//! - `/v1/chat/completions` (`logprobs: true`, `top_logprobs: n`): `{"content": [{"token",
//!   "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}`.
//!
//! A logprob of −∞ is written as JSON's `null` (JSON has no infinity).

use crate::engine::TokenLogprobs;
use serde_json::{json, Map, Value};

/// One sampled token's log-probabilities, its tokens named.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenProbs {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

impl TokenProbs {
    /// The engine's numbers with each id named by `name`.
    pub fn named(lp: &TokenLogprobs, name: impl Fn(u32) -> String) -> TokenProbs {
        TokenProbs {
            token: name(lp.token),
            logprob: lp.logprob,
            top: lp.top.iter().map(|&(id, v)| (name(id), v)).collect(),
        }
    }

    /// Its length in the completion's text offsets (characters).
    fn chars(&self) -> usize {
        self.token.chars().count()
    }
}

/// The legacy completions shape of `tokens`, the first starting at character `offset` of
/// the completion.
pub fn completion(tokens: &[TokenProbs], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.chars();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            // Two tokens of one text (bytes of a character, apart) are one key: the better.
            let mut m = Map::new();
            for (s, v) in &t.top {
                m.entry(s.clone()).or_insert(json!(v));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

/// How far the offsets of the tokens after `tokens` start, from where theirs did.
pub fn advance(tokens: &[TokenProbs]) -> usize {
    tokens.iter().map(TokenProbs::chars).sum()
}

/// The chat shape of `tokens`.
pub fn chat(tokens: &[TokenProbs]) -> Value {
    let entry = |s: &str, v: f32| json!({"token": s, "logprob": v, "bytes": s.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(s, v)| entry(s, *v)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probs() -> Vec<TokenProbs> {
        let name = |id: u32| ["a", "é", "<s>"][id as usize].to_string();
        vec![
            TokenProbs::named(
                &TokenLogprobs {
                    token: 1,
                    logprob: -0.5,
                    top: vec![(1, -0.5), (0, -1.5)],
                },
                name,
            ),
            TokenProbs::named(
                &TokenLogprobs {
                    token: 2,
                    logprob: f32::NEG_INFINITY,
                    top: vec![],
                },
                name,
            ),
        ]
    }

    #[test]
    fn both_shapes() {
        let p = probs();
        assert_eq!(
            completion(&p, 3),
            json!({"tokens": ["é", "<s>"], "token_logprobs": [-0.5, null],
                   "top_logprobs": [{"é": -0.5, "a": -1.5}, {}], "text_offset": [3, 4]})
        );
        assert_eq!(advance(&p), 4);
        assert_eq!(
            chat(&p),
            json!({"content": [
                {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [
                    {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                    {"token": "a", "logprob": -1.5, "bytes": [97]}]},
                {"token": "<s>", "logprob": null, "bytes": [60, 115, 62], "top_logprobs": []}]})
        );
    }
}
