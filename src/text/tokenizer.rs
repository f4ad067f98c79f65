//! The tokenizer: an HF `tokenizer.json` read by the `tokenizers` crate (the official
//! Mamba-3 checkpoints use the Llama-3.1 one), plus the ids that end a generation by
//! default (`eos_token` of `tokenizer_config.json`, `eos_token_id` of
//! `generation_config.json`).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// Ids that end a generation unless the request says otherwise.
    pub eos_ids: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": "..."}`.
pub fn special_token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Read a JSON file that may be absent: `Ok(None)` when it does not exist.
pub fn read_json_opt(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::input(format!("{}: not valid JSON: {e}", path.display())))
}

impl Tokenizer {
    /// Load `tokenizer.json`; the end-of-sequence ids come from the `tokenizer_config.json`
    /// and `generation_config.json` beside it, when present.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        if !path.is_file() {
            return Err(Error::input(format!(
                "tokenizer {} does not exist (expected an HF tokenizer.json)",
                path.display()
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        // Malformed JSON makes the `tokenizers` crate panic in places (its decoder reader
        // unwraps): check the syntax here, and turn any panic left into an error.
        serde_json::from_slice::<serde::de::IgnoredAny>(&bytes)
            .map_err(|e| Error::input(format!("{}: not valid JSON: {e}", path.display())))?;
        let read = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(&bytes));
        let inner = match read {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                return Err(Error::input(format!(
                    "{}: not a tokenizer.json the `tokenizers` crate can read: {e}",
                    path.display()
                )))
            }
            Err(_) => {
                return Err(Error::input(format!(
                    "{}: not a tokenizer.json the `tokenizers` crate can read (it failed \
                     inside)",
                    path.display()
                )))
            }
        };
        let mut t = Tokenizer {
            inner,
            path: path.to_path_buf(),
            eos_ids: Vec::new(),
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        if let Some(cfg) = read_json_opt(&dir.join("tokenizer_config.json"))? {
            if let Some(eos) = special_token_text(cfg.get("eos_token")) {
                t.eos_ids.extend(t.inner.token_to_id(&eos));
            }
        }
        if let Some(gen) = read_json_opt(&dir.join("generation_config.json"))? {
            match gen.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => {
                    t.eos_ids.extend(n.as_u64().map(|x| x as u32))
                }
                Some(serde_json::Value::Array(a)) => t
                    .eos_ids
                    .extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32)),
                _ => {}
            }
        }
        t.eos_ids.sort_unstable();
        t.eos_ids.dedup();
        Ok(t)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Entries of the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The longest vocabulary entry in bytes, as the tokenizer spells it (at least the
    /// bytes of text it stands for: a byte-level BPE spells each byte as one or two, a
    /// SentencePiece byte token as six): a text of more than `n` times as many bytes has
    /// more than `n` tokens, which bounds the work before tokenizing.
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token ids of `text`; `add_special` adds what the tokenizer's post-processor adds
    /// (the BOS token for Llama-3).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::input(format!("tokenizing the text failed: {e}")))
    }

    /// Text of `ids`; special tokens (BOS, EOS, chat markers) are left out when
    /// `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::input(format!("detokenizing {} ids failed: {e}", ids.len())))
    }
}
