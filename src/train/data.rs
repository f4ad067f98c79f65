//! Training text: the byte-level tokenizer, a train/validation split and deterministic
//! batches.
//!
//! Tokens are the text's bytes (vocabulary 256). [`byte_tokenizer_json`] (in
//! [`super::tokenizer`]) writes the same tokenizer in the Hugging Face `tokenizer.json` format — a byte-level BPE whose 256
//! tokens are the bytes in GPT-2's byte-to-unicode alphabet, with no merges — so that any
//! `tokenizers`-based loader encodes a text to exactly its bytes and decodes them back.
//!
//! The split cuts the text into blocks of [`BLOCK`] bytes and gives every
//! `val_every`-th block to validation. The batch of optimiser step `s`, micro-batch `m` is
//! drawn from a generator seeded by `(seed, s, m)` alone, so a resumed run sees the same
//! batches as an unbroken one.

use super::model::Batch;
use crate::error::{Error, Result};
use crate::model::rng::Rng;
use std::path::{Path, PathBuf};

pub use super::tokenizer::{byte_to_char, byte_tokenizer_json, BYTE_VOCAB};

pub const BLOCK: usize = 4096;

pub fn encode_bytes(text: &[u8]) -> Vec<u32> {
    text.iter().map(|&b| b as u32).collect()
}

/// Token streams for training and validation.
pub struct Dataset {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    /// Unigram byte counts of the training split.
    pub counts: Vec<u64>,
}

impl Dataset {
    /// Read and concatenate `files` (separated by a newline), then split.
    pub fn load(files: &[PathBuf], val_every: usize) -> Result<Dataset> {
        let mut text = Vec::new();
        for f in files {
            let b = std::fs::read(f).map_err(|e| Error::io(f, e))?;
            text.extend_from_slice(&b);
            if !text.ends_with(b"\n") {
                text.push(b'\n');
            }
        }
        Ok(Self::from_bytes(&text, val_every))
    }

    pub fn from_bytes(text: &[u8], val_every: usize) -> Dataset {
        let (mut train, mut val) = (Vec::new(), Vec::new());
        for (i, block) in text.chunks(BLOCK).enumerate() {
            if val_every > 0 && i % val_every == val_every - 1 {
                val.extend(encode_bytes(block));
            } else {
                train.extend(encode_bytes(block));
            }
        }
        let mut counts = vec![0u64; BYTE_VOCAB];
        train.iter().for_each(|&t| counts[t as usize] += 1);
        Dataset { train, val, counts }
    }

    /// The training batch of step `step`, micro-batch `micro`: `batch` windows of
    /// `seq_len + 1` tokens at uniformly drawn offsets.
    pub fn train_batch(
        &self,
        seed: u64,
        step: u64,
        micro: u64,
        batch: usize,
        seq_len: usize,
    ) -> Result<Batch> {
        if self.train.len() <= seq_len + 1 {
            return Err(Error::input(format!(
                "training text has {} tokens: need more than seq_len + 1 = {}",
                self.train.len(),
                seq_len + 1
            )));
        }
        let mut rng =
            Rng::new(seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ micro.rotate_left(32));
        let span = (self.train.len() - seq_len - 1) as u64;
        let wins: Vec<&[u32]> = (0..batch)
            .map(|_| {
                let o = rng.below(span + 1) as usize;
                &self.train[o..o + seq_len + 1]
            })
            .collect();
        Ok(Batch::from_windows(&wins))
    }

    /// Validation batches: consecutive windows (stride `seq_len`) from the start of the
    /// validation split, at most `max_windows`, grouped `batch` at a time.
    pub fn val_batches(&self, max_windows: usize, batch: usize, seq_len: usize) -> Vec<Batch> {
        let n = if self.val.len() > seq_len {
            ((self.val.len() - 1) / seq_len).min(max_windows)
        } else {
            0
        };
        let wins: Vec<&[u32]> = (0..n)
            .map(|i| &self.val[i * seq_len..i * seq_len + seq_len + 1])
            .collect();
        wins.chunks(batch.max(1)).map(Batch::from_windows).collect()
    }

    /// Cross-entropy (bits per token) of the validation split under the training split's
    /// unigram distribution (add-one smoothed): the baseline a model must beat. NaN without
    /// a validation split.
    pub fn unigram_bits(&self) -> f64 {
        if self.val.is_empty() {
            return f64::NAN;
        }
        let total: u64 = self.counts.iter().sum::<u64>() + BYTE_VOCAB as u64;
        let mut bits = 0.0;
        for &t in &self.val {
            let p = (self.counts[t as usize] + 1) as f64 / total as f64;
            bits -= p.log2();
        }
        bits / self.val.len().max(1) as f64
    }
}

/// Write the byte tokenizer next to a checkpoint.
pub fn save_byte_tokenizer(dir: &Path) -> Result<()> {
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, byte_tokenizer_json()).map_err(|e| Error::io(&p, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_batches_are_deterministic() {
        let text: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let d = Dataset::from_bytes(&text, 10);
        assert_eq!(d.train.len() + d.val.len(), text.len());
        assert_eq!(d.val.len(), BLOCK);
        let a = d.train_batch(1, 5, 0, 3, 16).unwrap();
        let b = d.train_batch(1, 5, 0, 3, 16).unwrap();
        let c = d.train_batch(1, 6, 0, 3, 16).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.inputs[1..16], a.targets[..15]);
        let v = d.val_batches(100, 4, 64);
        assert_eq!(v.iter().map(|b| b.batch).sum::<usize>(), (BLOCK - 1) / 64);
    }
}
