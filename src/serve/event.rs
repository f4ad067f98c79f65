//! What a request's stream receives from the engine side: the scheduler's admission
//! (`Started`) and the emitter's tokens, errors and endings. Its own module so that the
//! scheduler and the emitter, which both send them, need not import each other.

use super::logprobs::TokenProbs;
use crate::text::FinishReason;

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The prompt is read: how many of its tokens came from the prefix cache.
    Started { index: usize, cached_tokens: usize },
    /// One generated token and the text it made final; the last one has `finish`. With
    /// its log-probabilities when the request asked for them.
    Token {
        index: usize,
        token: u32,
        text: String,
        finish: Option<FinishReason>,
        logprobs: Option<TokenProbs>,
    },
    /// The sequence failed; nothing more comes for it.
    Error { index: usize, message: String },
    /// The sequence was ended without a token (the server is shutting down).
    Finish { index: usize, reason: FinishReason },
}
