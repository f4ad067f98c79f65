//! Streaming detokenization: text as tokens arrive, never cutting a character in half.
//!
//! A byte-level tokenizer may split one UTF-8 character over several tokens, so the text
//! of a token alone can be a broken character. We decode a short window of recent tokens
//! twice — up to the last emitted token and up to the newest — and emit the difference
//! once it no longer ends in a replacement character (the approach of HF TGI). A run of
//! tokens that never completes a character is emitted anyway after `MAX_HELD` tokens.

use super::tokenizer::Tokenizer;

const MAX_HELD: usize = 8;

#[derive(Default, Clone, Debug)]
pub struct StreamDecoder {
    tokens: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// Tokens before this one have been emitted.
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Add a token; returns the text that became final (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, token: u32) -> String {
        self.tokens.push(token);
        self.emit(tok, false)
    }

    /// Whatever is still held back (at the end of a generation).
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        self.emit(tok, true)
    }

    fn emit(&mut self, tok: &Tokenizer, force: bool) -> String {
        if self.read >= self.tokens.len() {
            return String::new();
        }
        let before = tok
            .decode(&self.tokens[self.prefix..self.read], true)
            .unwrap_or_default();
        let after = tok
            .decode(&self.tokens[self.prefix..], true)
            .unwrap_or_default();
        let held = self.tokens.len() - self.read;
        let complete = !after.ends_with('\u{FFFD}');
        if !(complete || force || held >= MAX_HELD) {
            return String::new();
        }
        let delta = match after.get(before.len()..) {
            Some(d) if after.starts_with(&before) => d.to_string(),
            // The window's text changed shape (a decoder that rewrites earlier text):
            // emit the new part after the longest common prefix.
            _ => {
                let common = before
                    .char_indices()
                    .zip(after.chars())
                    .take_while(|((_, a), b)| a == b)
                    .last()
                    .map_or(0, |((i, a), _)| i + a.len_utf8());
                after[common..].to_string()
            }
        };
        self.prefix = self.read;
        self.read = self.tokens.len();
        delta
    }
}
