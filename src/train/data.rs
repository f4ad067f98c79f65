//! Training text: a train/validation split of the text's bytes, token ids of the run's
//! tokenizer, and deterministic batches.
//!
//! The split cuts the text into blocks of [`BLOCK`] bytes and gives every
//! `val_every`-th block to validation, whatever the tokenizer, so runs with different
//! tokenizers are judged on the same held-out bytes. Each run of consecutive blocks of one
//! split is tokenized on its own (a token never straddles the cut between a training and a
//! validation block); the split's ids are the runs' ids end to end. With the byte
//! tokenizer that is the text's bytes, as it always was.
//!
//! Losses are per token, so to compare tokenizers the validation split keeps, for every
//! token, the bytes of text spelled up to it: a loss in nats/token times tokens/bytes is
//! nats per byte.
//!
//! The batch of optimiser step `s`, micro-batch `m` is drawn from a generator seeded by
//! `(seed, s, m)` alone, so a resumed run sees the same batches as an unbroken one.

use super::model::Batch;
use super::tokenizer::{TokenizerSpec, TrainTokenizer};
use crate::error::{Error, Result};
use crate::model::rng::Rng;
use rayon::prelude::*;
use std::path::PathBuf;

pub use super::tokenizer::{byte_to_char, byte_tokenizer_json, BYTE_VOCAB};

pub const BLOCK: usize = 4096;

/// Read and concatenate `files`, each ending in a newline.
pub fn read_text(files: &[PathBuf]) -> Result<Vec<u8>> {
    let mut text = Vec::new();
    for f in files {
        let b = std::fs::read(f).map_err(|e| Error::io(f, e))?;
        text.extend_from_slice(&b);
        if !text.ends_with(b"\n") {
            text.push(b'\n');
        }
    }
    Ok(text)
}

/// The split as runs of consecutive blocks of one side: `(is_validation, bytes)`.
pub fn split_runs(text: &[u8], val_every: usize) -> Vec<(bool, &[u8])> {
    let mut runs: Vec<(bool, std::ops::Range<usize>)> = Vec::new();
    for i in 0..text.len().div_ceil(BLOCK) {
        let val = val_every > 0 && i % val_every == val_every - 1;
        let r = i * BLOCK..((i + 1) * BLOCK).min(text.len());
        match runs.last_mut() {
            Some((v, last)) if *v == val => last.end = r.end,
            _ => runs.push((val, r)),
        }
    }
    runs.into_iter().map(|(v, r)| (v, &text[r])).collect()
}

/// Token streams for training and validation.
pub struct Dataset {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    /// Unigram token counts of the training split (one per vocabulary entry).
    pub counts: Vec<u64>,
    /// Bytes of text in the training and validation splits.
    pub train_bytes: usize,
    pub val_bytes: usize,
    /// `val_ends[i]`: bytes of the validation text spelled by `val[..=i]`.
    pub val_ends: Vec<usize>,
    pub tokenizer: TrainTokenizer,
}

impl Dataset {
    /// Read and concatenate `files` (separated by a newline), then split into bytes.
    pub fn load(files: &[PathBuf], val_every: usize) -> Result<Dataset> {
        Ok(Self::from_bytes(&read_text(files)?, val_every))
    }

    /// The byte-tokenized split of `text`.
    pub fn from_bytes(text: &[u8], val_every: usize) -> Dataset {
        Self::from_text(text, val_every, TrainTokenizer::Byte).expect("bytes always tokenize")
    }

    /// The split of `text` with the tokenizer `spec` asks for: a BPE is trained here on
    /// the training split only.
    pub fn prepare(text: &[u8], val_every: usize, spec: &TokenizerSpec) -> Result<Dataset> {
        let tokenizer = match spec {
            TokenizerSpec::Byte => TrainTokenizer::Byte,
            TokenizerSpec::Bpe { vocab_size } => {
                let runs = split_runs(text, val_every);
                let train = runs.into_iter().filter(|r| !r.0).map(|r| r.1);
                TrainTokenizer::train_bpe(train, *vocab_size)?
            }
            TokenizerSpec::File(p) => TrainTokenizer::from_file(p)?,
        };
        Self::from_text(text, val_every, tokenizer)
    }

    /// The split of `text`, tokenized by `tokenizer`.
    pub fn from_text(text: &[u8], val_every: usize, tokenizer: TrainTokenizer) -> Result<Dataset> {
        let runs = split_runs(text, val_every);
        let encoded = runs
            .par_iter()
            .map(|&(val, bytes)| tokenizer.encode(bytes, val))
            .collect::<Result<Vec<_>>>()?;
        let (mut train, mut val, mut val_ends) = (Vec::new(), Vec::new(), Vec::new());
        let (mut train_bytes, mut val_bytes) = (0, 0);
        for (&(is_val, bytes), e) in runs.iter().zip(encoded) {
            if is_val {
                val_ends.extend(e.ends.iter().map(|&x| val_bytes + x));
                val_bytes += bytes.len();
                val.extend(e.ids);
            } else {
                train_bytes += bytes.len();
                train.extend(e.ids);
            }
        }
        let vocab = tokenizer.vocab_size();
        let mut counts = vec![0u64; vocab];
        for &t in &train {
            counts[t as usize] += 1;
        }
        Ok(Dataset {
            train,
            val,
            counts,
            train_bytes,
            val_bytes,
            val_ends,
            tokenizer,
        })
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

    /// How many validation windows of `seq_len` predicted tokens there are, at most
    /// `max_windows`.
    fn val_windows(&self, max_windows: usize, seq_len: usize) -> usize {
        if self.val.len() > seq_len {
            ((self.val.len() - 1) / seq_len).min(max_windows)
        } else {
            0
        }
    }

    /// Validation batches: consecutive windows (stride `seq_len`) from the start of the
    /// validation split, at most `max_windows`, grouped `batch` at a time.
    pub fn val_batches(&self, max_windows: usize, batch: usize, seq_len: usize) -> Vec<Batch> {
        let n = self.val_windows(max_windows, seq_len);
        let wins: Vec<&[u32]> = (0..n)
            .map(|i| &self.val[i * seq_len..i * seq_len + seq_len + 1])
            .collect();
        wins.chunks(batch.max(1)).map(Batch::from_windows).collect()
    }

    /// (tokens, bytes of text) that the validation windows predict: tokens `1..=n·seq_len`
    /// of the split.
    pub fn val_window_span(&self, max_windows: usize, seq_len: usize) -> (usize, usize) {
        let t = self.val_windows(max_windows, seq_len) * seq_len;
        if t == 0 {
            return (0, 0);
        }
        (t, self.val_ends[t] - self.val_ends[0])
    }

    /// Bits the training split's unigram distribution (add-one smoothed) spends on the
    /// whole validation split.
    fn unigram_total_bits(&self) -> f64 {
        let total: u64 = self.counts.iter().sum::<u64>() + self.counts.len() as u64;
        let mut bits = 0.0;
        for &t in &self.val {
            let p = (self.counts[t as usize] + 1) as f64 / total as f64;
            bits -= p.log2();
        }
        bits
    }

    /// The unigram baseline a model must beat, in bits per token of the validation
    /// split. NaN without a validation split.
    pub fn unigram_bits(&self) -> f64 {
        if self.val.is_empty() {
            return f64::NAN;
        }
        self.unigram_total_bits() / self.val.len() as f64
    }

    /// The unigram baseline in bits per byte of validation text (comparable across
    /// tokenizers). NaN without a validation split.
    pub fn unigram_bits_per_byte(&self) -> f64 {
        if self.val.is_empty() {
            return f64::NAN;
        }
        self.unigram_total_bits() / self.val_bytes as f64
    }
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
        assert_eq!(d.val_window_span(100, 64), (63 * 64, 63 * 64));
    }

    /// The byte path is the text's blocks, as it was before other tokenizers existed.
    #[test]
    fn byte_split_is_the_blocks() {
        let text: Vec<u8> = (0..70_001u32).map(|i| (i * 7 % 256) as u8).collect();
        for val_every in [0, 1, 2, 5] {
            let (mut train, mut val) = (Vec::new(), Vec::new());
            for (i, block) in text.chunks(BLOCK).enumerate() {
                let side = if val_every > 0 && i % val_every == val_every - 1 {
                    &mut val
                } else {
                    &mut train
                };
                side.extend(block.iter().map(|&b| b as u32));
            }
            let d = Dataset::from_bytes(&text, val_every);
            assert_eq!((d.train.len(), d.val.len()), (train.len(), val.len()));
            assert!(d.train == train && d.val == val, "val_every {val_every}");
            assert_eq!(d.train_bytes, train.len());
            assert_eq!(d.val_bytes, val.len());
            assert_eq!(d.counts.len(), BYTE_VOCAB);
            assert_eq!(d.counts.iter().sum::<u64>(), train.len() as u64);
            if !val.is_empty() {
                let per_byte = d.unigram_bits_per_byte();
                assert_eq!(per_byte.to_bits(), d.unigram_bits().to_bits());
            }
        }
    }
}
