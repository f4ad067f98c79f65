//! The tokenizer a run trains with: the text's bytes, a byte-level BPE trained here on the
//! training split, or an existing `tokenizer.json`.
//!
//! Training text is bytes, not necessarily UTF-8, while the `tokenizers` crate encodes
//! `&str`. [`TrainTokenizer::encode`] encodes each valid UTF-8 stretch with the
//! tokenizer and every byte of an invalid sequence as that byte's own token (the
//! byte-level alphabet, or `<0xNN>` with byte fallback). For a byte-level tokenizer the
//! ids therefore decode to exactly the input bytes, whatever they are.
//!
//! The BPE is the GPT-2 recipe: the ByteLevel pre-tokenizer (GPT-2's regex splits words,
//! bytes map to the printable alphabet of [`byte_to_char`]) and decoder, all 256 byte
//! symbols in the base vocabulary so every input is encodable, no normaliser (so decode ∘
//! encode is the identity), no special tokens, and merges of pairs seen at least twice
//! (so a small text may stop short of the vocabulary size asked for). The crate's trainer
//! takes the most frequent pair, ties by pair id, and ids follow the sorted alphabet, so
//! the same text and vocabulary size give the same `tokenizer.json`.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::TokenizerBuilder;

pub const BYTE_VOCAB: usize = 256;
/// `--vocab-size` of a BPE: more than the 256 byte symbols, at most 2^16 ids.
pub const BPE_VOCAB_RANGE: std::ops::RangeInclusive<usize> = 257..=65_536;

/// GPT-2's reversible byte → unicode map (the ByteLevel pre-tokenizer's alphabet).
pub fn byte_to_char(b: u8) -> char {
    if printable(b) {
        return b as char;
    }
    // Non-printable bytes map, in order, to U+0100, U+0101, ...
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

fn printable(b: u8) -> bool {
    (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE
}

/// The byte of a byte-level symbol (the inverse of [`byte_to_char`]).
pub fn char_to_byte(c: char) -> Option<u8> {
    match u32::from(c) {
        x @ 0..=255 if printable(x as u8) => Some(x as u8),
        x @ 256..=323 => (0..=255u8).filter(|&b| !printable(b)).nth(x as usize - 256),
        _ => None,
    }
}

/// A `tokenizer.json` for the byte tokenizer: a byte-level BPE whose 256 tokens are the
/// bytes in GPT-2's alphabet, with no merges, so that any `tokenizers`-based loader
/// encodes a text to exactly its bytes and decodes them back.
pub fn byte_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| {
            (
                byte_to_char(b).to_string(),
                serde_json::Value::from(b as u64),
            )
        })
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
    });
    let tok = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": []
        }
    });
    serde_json::to_string_pretty(&tok).unwrap()
}

/// What a run asked for, as recorded in `RunConfig::tokenizer`: `byte`, `bpe:N` (a BPE
/// of N tokens trained on the training split), or the path of a `tokenizer.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSpec {
    Byte,
    Bpe { vocab_size: usize },
    File(PathBuf),
}

impl TokenizerSpec {
    pub fn parse(s: &str) -> TokenizerSpec {
        if s == "byte" {
            return TokenizerSpec::Byte;
        }
        if let Some(n) = s.strip_prefix("bpe:").and_then(|n| n.parse().ok()) {
            return TokenizerSpec::Bpe { vocab_size: n };
        }
        TokenizerSpec::File(PathBuf::from(s))
    }
}

impl std::fmt::Display for TokenizerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizerSpec::Byte => write!(f, "byte"),
            TokenizerSpec::Bpe { vocab_size } => write!(f, "bpe:{vocab_size}"),
            TokenizerSpec::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A tokenizer read from (or trained into) a `tokenizer.json`.
pub struct JsonTokenizer {
    json: String,
    inner: tokenizers::Tokenizer,
    /// The id that stands for a lone byte (used for bytes of invalid UTF-8).
    byte_ids: Vec<Option<u32>>,
    /// For a byte-level tokenizer, the bytes each id spells.
    spelling: Option<Vec<Vec<u8>>>,
    /// One past the largest id (added tokens included).
    vocab_size: usize,
}

/// The tokenizer of a training run.
pub enum TrainTokenizer {
    /// Token = byte (vocabulary 256).
    Byte,
    Json(Box<JsonTokenizer>),
}

/// Token ids of a text, with the bytes covered by each prefix: `ends[i]` is the end (in
/// bytes) of the text that tokens `0..=i` spell.
pub struct Encoded {
    pub ids: Vec<u32>,
    pub ends: Vec<usize>,
}

impl TrainTokenizer {
    /// Train a byte-level BPE of `vocab_size` tokens on `texts` (see the module doc).
    pub fn train_bpe<'a>(
        texts: impl Iterator<Item = &'a [u8]> + Send,
        vocab_size: usize,
    ) -> Result<TrainTokenizer> {
        if !BPE_VOCAB_RANGE.contains(&vocab_size) {
            return Err(Error::input(format!(
                "BPE vocabulary size {vocab_size}: must be in {}..={} (the 256 byte symbols \
                 plus at least one merge; e.g. 4096)",
                BPE_VOCAB_RANGE.start(),
                BPE_VOCAB_RANGE.end()
            )));
        }
        let byte_level = ByteLevel::new(false, false, true);
        let mut tok = TokenizerBuilder::<
            BPE,
            NormalizerWrapper,
            ByteLevel,
            PostProcessorWrapper,
            ByteLevel,
        >::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(byte_level))
        .with_decoder(Some(byte_level))
        .build()
        .map_err(|e| Error::Other(format!("building the BPE tokenizer: {e}")))?;
        let mut trainer = BpeTrainer::builder()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        // Only valid UTF-8 reaches the trainer; the bytes of invalid sequences are in the
        // base alphabet anyway.
        let pieces = texts.flat_map(|t| t.utf8_chunks().map(|c| c.valid()));
        tok.train(&mut trainer, pieces.filter(|s| !s.is_empty()))
            .map_err(|e| Error::Other(format!("training the BPE tokenizer: {e}")))?;
        let json = tok
            .to_string(true)
            .map_err(|e| Error::Other(format!("serialising the BPE tokenizer: {e}")))?;
        Self::from_json(json, "the trained BPE")
    }

    /// Read a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<TrainTokenizer> {
        let json = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(json, &path.display().to_string())
    }

    pub fn from_json(json: String, origin: &str) -> Result<TrainTokenizer> {
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e| {
            Error::input(format!(
                "{origin}: not a tokenizer.json the `tokenizers` crate can read: {e}"
            ))
        })?;
        let value: serde_json::Value = serde_json::from_str(&json)
            .map_err(|e| Error::input(format!("{origin}: not valid JSON: {e}")))?;
        let vocab_size = (inner.get_vocab(true).into_values().max()).map_or(0, |m| m as usize + 1);
        if vocab_size == 0 {
            return Err(Error::input(format!("{origin}: the vocabulary is empty")));
        }
        let spelling = has_byte_level(&value["pre_tokenizer"])
            .then(|| spell_byte_level(&inner, vocab_size))
            .flatten();
        let byte_ids = (0..=255u8)
            .map(|b| match spelling {
                Some(_) => inner.token_to_id(&byte_to_char(b).to_string()),
                None => inner.token_to_id(&format!("<0x{b:02X}>")),
            })
            .collect();
        Ok(TrainTokenizer::Json(Box::new(JsonTokenizer {
            json,
            inner,
            byte_ids,
            spelling,
            vocab_size,
        })))
    }

    pub fn is_byte(&self) -> bool {
        matches!(self, TrainTokenizer::Byte)
    }

    /// One past the largest token id (added tokens included): the model's `vocab_size`.
    pub fn vocab_size(&self) -> usize {
        match self {
            TrainTokenizer::Byte => BYTE_VOCAB,
            TrainTokenizer::Json(t) => t.vocab_size,
        }
    }

    /// The `tokenizer.json` written beside a checkpoint.
    pub fn json(&self) -> std::borrow::Cow<'_, str> {
        match self {
            TrainTokenizer::Byte => byte_tokenizer_json().into(),
            TrainTokenizer::Json(t) => t.json.as_str().into(),
        }
    }

    /// Token ids of `text` (see the module doc); `ends` only when `want_ends`.
    pub fn encode(&self, text: &[u8], want_ends: bool) -> Result<Encoded> {
        let t = match self {
            TrainTokenizer::Byte => {
                return Ok(Encoded {
                    ids: text.iter().map(|&b| b as u32).collect(),
                    ends: if want_ends {
                        (1..=text.len()).collect()
                    } else {
                        Vec::new()
                    },
                })
            }
            TrainTokenizer::Json(t) => t,
        };
        let (mut ids, mut ends) = (Vec::new(), Vec::new());
        let mut at = 0usize;
        for chunk in text.utf8_chunks() {
            let s = chunk.valid();
            if !s.is_empty() {
                // Offsets only where the spelling cannot say how many bytes a token is.
                let enc = match (&t.spelling, want_ends) {
                    (None, true) => t.inner.encode(s, false),
                    _ => t.inner.encode_fast(s, false),
                }
                .map_err(|e| Error::input(format!("tokenizing the text failed: {e}")))?;
                if want_ends {
                    let mut end = ends.last().copied().unwrap_or(at);
                    match &t.spelling {
                        Some(sp) => ends.extend(enc.get_ids().iter().map(|&i| {
                            end += sp[i as usize].len();
                            end
                        })),
                        // Running maximum: the tokens of one character share its offsets.
                        None => ends.extend(enc.get_offsets().iter().map(|&(_, e)| {
                            end = end.max(at + e);
                            end
                        })),
                    }
                }
                ids.extend_from_slice(enc.get_ids());
                at += s.len();
            }
            for &b in chunk.invalid() {
                let id = t.byte_ids[b as usize].ok_or_else(|| {
                    Error::input(format!(
                        "byte 0x{b:02X} at offset {at} is not valid UTF-8 and the tokenizer \
                         has no token for a lone byte (neither byte-level nor byte fallback)"
                    ))
                })?;
                ids.push(id);
                at += 1;
                if want_ends {
                    ends.push(at);
                }
            }
        }
        Ok(Encoded { ids, ends })
    }

    /// The bytes that `ids` spell, for the byte tokenizer and byte-level tokenizers (None
    /// for others, or an id outside the vocabulary).
    pub fn decode_bytes(&self, ids: &[u32]) -> Option<Vec<u8>> {
        match self {
            TrainTokenizer::Byte => ids.iter().map(|&i| u8::try_from(i).ok()).collect(),
            TrainTokenizer::Json(t) => {
                let sp = t.spelling.as_ref()?;
                let mut out = Vec::with_capacity(ids.len() * 4);
                for &i in ids {
                    out.extend_from_slice(sp.get(i as usize)?);
                }
                Some(out)
            }
        }
    }
}

/// The bytes every id of a byte-level tokenizer spells: its symbols through
/// [`char_to_byte`], an added token's text as it is. None if a token is not byte-level.
fn spell_byte_level(t: &tokenizers::Tokenizer, vocab_size: usize) -> Option<Vec<Vec<u8>>> {
    let added = t.get_added_tokens_decoder();
    (0..vocab_size as u32)
        .map(|i| match (added.get(&i), t.id_to_token(i)) {
            (Some(a), _) => Some(a.content.as_bytes().to_vec()),
            (None, Some(tok)) => tok.chars().map(char_to_byte).collect(),
            (None, None) => Some(Vec::new()),
        })
        .collect()
}

/// Whether a pre-tokenizer (possibly a `Sequence` of them) includes ByteLevel.
fn has_byte_level(v: &serde_json::Value) -> bool {
    match v.get("type").and_then(|t| t.as_str()) {
        Some("ByteLevel") => true,
        Some("Sequence") => v["pretokenizers"]
            .as_array()
            .is_some_and(|a| a.iter().any(has_byte_level)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        assert_eq!(byte_to_char(b'A'), 'A');
        assert_eq!(byte_to_char(b' '), '\u{120}');
        assert_eq!(byte_to_char(b'\n'), '\u{10a}');
        assert_eq!(byte_to_char(0), '\u{100}');
        assert_eq!(byte_to_char(0xAD), '\u{143}');
        let all: std::collections::BTreeSet<char> = (0..=255u8).map(byte_to_char).collect();
        assert_eq!(all.len(), 256);
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte(' '), None);
    }

    #[test]
    fn spec_round_trips_through_its_string() {
        for spec in [
            TokenizerSpec::Byte,
            TokenizerSpec::Bpe { vocab_size: 4096 },
            TokenizerSpec::File("runs/tok/tokenizer.json".into()),
        ] {
            assert_eq!(TokenizerSpec::parse(&spec.to_string()), spec);
        }
    }

    #[test]
    fn byte_tokenizer_encodes_bytes() {
        let text = b"a\xff\n\xc3\xa9";
        let e = TrainTokenizer::Byte.encode(text, true).unwrap();
        assert_eq!(e.ids, [97, 255, 10, 195, 169]);
        assert_eq!(e.ends, [1, 2, 3, 4, 5]);
        let back = TrainTokenizer::Byte.decode_bytes(&e.ids).unwrap();
        assert_eq!(back, text);
    }
}
