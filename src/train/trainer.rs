//! The training loop: batches, gradient accumulation, clipping, AdamW, validation,
//! checkpoints with the optimiser state, and resume.
//!
//! A checkpoint directory holds `config.json` + `model.safetensors` (the official layout,
//! f32, SISO or MIMO as the model is), `tokenizer.json` (the run's tokenizer, whichever it is), `optimizer.safetensors`
//! (AdamW moments `m.<name>`, `v.<name>`), `trainer.json` (the run's settings, its step
//! and loss history) and `loss.csv`. A run resumed from it re-tokenizes its text with that
//! `tokenizer.json` (a BPE is never trained again) and takes the same batches and the
//! same arithmetic as the unbroken run, so it lands on the same weights bit for bit.
//!
//! Losses are nats per token of the run's tokenizer; validation is also reported in bits
//! per byte of held-out text, which compares across tokenizers.

use super::backend::Backend;
use super::data::{read_text, Dataset};
use super::optim::{AdamW, AdamWConfig, Schedule};
use super::tokenizer::{TokenizerSpec, TrainTokenizer};
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::Params;
use crate::model::config::Config;
use crate::model::dtype::DType;
use crate::model::tensor_file::{write_safetensors, RawTensor, TensorFile};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything that defines a run (saved in `trainer.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub model: Config,
    pub data: Vec<PathBuf>,
    /// `byte`, `bpe:N` or the path of the tokenizer.json used ([`TokenizerSpec`]); the
    /// tokenizer itself is the checkpoint's `tokenizer.json`.
    pub tokenizer: String,
    pub steps: u64,
    pub batch: usize,
    pub accum: usize,
    pub seq_len: usize,
    pub schedule: Schedule,
    pub adamw: AdamWConfig,
    pub clip: f64,
    pub seed: u64,
    pub val_every_block: usize,
    pub eval_every: u64,
    pub eval_windows: usize,
    pub ckpt_every: u64,
}

/// Where the run stands (saved in `trainer.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub step: u64,
    pub tokens: u64,
    pub seconds: f64,
    /// (step, mean training loss of that step, nats/token)
    pub train_loss: Vec<(u64, f64)>,
    /// (step, validation loss, nats/token)
    pub val_loss: Vec<(u64, f64)>,
    /// (step, validation loss, bits per byte of validation text)
    #[serde(default)]
    pub val_bpb: Vec<(u64, f64)>,
    /// unigram baseline on the validation split, bits per token (NaN, saved as null,
    /// without a validation split)
    #[serde(deserialize_with = "nan_if_null")]
    pub unigram_bits: f64,
    /// the same baseline in bits per byte
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub unigram_bpb: f64,
    /// bytes of text per token in the training split (1 for the byte tokenizer)
    #[serde(default = "one")]
    pub train_bytes_per_token: f64,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            step: 0,
            tokens: 0,
            seconds: 0.0,
            train_loss: Vec::new(),
            val_loss: Vec::new(),
            val_bpb: Vec::new(),
            unigram_bits: f64::NAN,
            unigram_bpb: f64::NAN,
            train_bytes_per_token: 1.0,
        }
    }
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn nan() -> f64 {
    f64::NAN
}

fn one() -> f64 {
    1.0
}

#[derive(Serialize, Deserialize)]
struct TrainerFile {
    run: RunConfig,
    progress: Progress,
}

fn read_trainer_file(dir: &Path) -> Result<TrainerFile> {
    let tf = dir.join("trainer.json");
    let text = std::fs::read_to_string(&tf).map_err(|e| Error::io(&tf, e))?;
    serde_json::from_str(&text).map_err(|e| Error::checkpoint(tf.display(), e.to_string()))
}

/// The settings of the run saved in checkpoint directory `dir`.
pub fn saved_run(dir: &Path) -> Result<RunConfig> {
    Ok(read_trainer_file(dir)?.run)
}

pub struct Trainer<B: Backend> {
    pub run: RunConfig,
    pub progress: Progress,
    pub params: Params<f32>,
    pub opt: AdamW,
    pub backend: B,
    data: Dataset,
}

/// Called after every optimiser step with (progress, loss, lr, grad norm, tokens/s).
pub type StepHook<'a> = dyn FnMut(&Progress, f64, f64, f64, f64) + 'a;

impl<B: Backend> Trainer<B> {
    /// A fresh run: the text of `run.data` with the tokenizer `run.tokenizer` asks for (a
    /// BPE is trained here), official initialisation from `run.seed`.
    pub fn new(run: RunConfig, backend: B) -> Result<Self> {
        let spec = TokenizerSpec::parse(&run.tokenizer);
        let data = Dataset::prepare(&read_text(&run.data)?, run.val_every_block, &spec)?;
        Self::with_data(run, backend, data)
    }

    /// A fresh run on `data`, tokenized as `run.tokenizer` says.
    pub fn with_data(run: RunConfig, backend: B, data: Dataset) -> Result<Self> {
        check_tokenizer(&run, &data.tokenizer)?;
        let params = Params::init(&run.model, run.seed)?;
        let opt = AdamW::new(run.adamw, &params);
        let progress = Progress {
            unigram_bits: data.unigram_bits(),
            unigram_bpb: data.unigram_bits_per_byte(),
            train_bytes_per_token: data.train_bytes as f64 / data.train.len().max(1) as f64,
            ..Progress::default()
        };
        Ok(Trainer {
            run,
            progress,
            params,
            opt,
            backend,
            data,
        })
    }

    /// Resume from `dir`, reading `files` (when given) instead of the run's own text files,
    /// tokenized by the checkpoint's tokenizer; the run then records them.
    pub fn resume_with_files(dir: &Path, backend: B, files: Option<Vec<PathBuf>>) -> Result<Self> {
        let Some(files) = files else {
            return Self::resume(dir, backend, None);
        };
        let file = read_trainer_file(dir)?;
        let saved = saved_tokenizer(dir, &file.run)?;
        let data = Dataset::from_text(&read_text(&files)?, file.run.val_every_block, saved)?;
        let mut t = Self::resume(dir, backend, Some(data))?;
        t.run.data = files;
        Ok(t)
    }

    /// Resume from a checkpoint directory written by [`Trainer::save`], on `data` or else
    /// the run's files tokenized by the directory's `tokenizer.json`.
    pub fn resume(dir: &Path, backend: B, data: Option<Dataset>) -> Result<Self> {
        let file = read_trainer_file(dir)?;
        let saved = saved_tokenizer(dir, &file.run)?;
        let data = match data {
            Some(d) if d.tokenizer.json() != saved.json() => {
                return Err(Error::input(format!(
                    "resume: the dataset's tokenizer is not the checkpoint's {}",
                    dir.join("tokenizer.json").display()
                )))
            }
            Some(d) => d,
            None => {
                Dataset::from_text(&read_text(&file.run.data)?, file.run.val_every_block, saved)?
            }
        };
        check_tokenizer(&file.run, &data.tokenizer)?;
        let params = Params::<f32>::load(dir)?;
        let mut opt = AdamW::new(file.run.adamw, &params);
        let op = dir.join("optimizer.safetensors");
        let f = TensorFile::open(&op)?;
        let names: Vec<String> = params.tensors().into_iter().map(|(n, _)| n).collect();
        for (prefix, moments) in [("m.", &mut opt.m), ("v.", &mut opt.v)] {
            for (name, t) in names.iter().zip(moments.tensors_mut()) {
                let key = format!("{prefix}{name}");
                let raw = f.get(&key).ok_or_else(|| {
                    Error::checkpoint(op.display(), format!("missing tensor `{key}`"))
                })?;
                let v = raw.to_float(&key, DType::F32)?.to_f32_vec();
                if v.len() != t.len() {
                    return Err(Error::checkpoint(
                        op.display(),
                        format!("`{key}` has the wrong size"),
                    ));
                }
                *t = v;
            }
        }
        opt.step = file.progress.step;
        let mut t = Trainer {
            run: file.run,
            progress: file.progress,
            params,
            opt,
            backend,
            data,
        };
        // A checkpoint from before bits per byte were recorded (byte tokenizer only).
        if t.progress.val_bpb.len() < t.progress.val_loss.len() {
            t.progress.val_bpb = (t.progress.val_loss.iter())
                .map(|&(s, l)| (s, t.bits_per_byte(l)))
                .collect();
        }
        if t.progress.unigram_bpb.is_nan() {
            t.progress.unigram_bpb = t.data.unigram_bits_per_byte();
        }
        Ok(t)
    }

    /// Save a checkpoint into `dir` (see the module doc). Every file is replaced
    /// atomically ([`crate::atomic`]); `trainer.json`, which says which step the folder
    /// holds, is replaced after the weights and the optimiser state, so a run killed at
    /// any moment resumes from a step whose files are all complete.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        self.sync()?;
        self.params.save(dir)?;
        let tp = dir.join("tokenizer.json");
        crate::atomic::write(&tp, self.data.tokenizer.json().as_bytes())?;
        let mut tensors = Vec::new();
        for (prefix, moments) in [("m.", &self.opt.m), ("v.", &self.opt.v)] {
            for (name, t) in moments.tensors() {
                tensors.push((
                    format!("{prefix}{name}"),
                    RawTensor::from_f32(vec![t.len()], t),
                ));
            }
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        write_safetensors(&dir.join("optimizer.safetensors"), &tensors, None)?;
        let file = TrainerFile {
            run: self.run.clone(),
            progress: self.progress.clone(),
        };
        let text = serde_json::to_string_pretty(&file)
            .map_err(|e| Error::Other(format!("trainer.json: {e}")))?;
        crate::atomic::write(&dir.join("trainer.json"), text.as_bytes())?;
        let mut csv = String::from("step,train_loss,val_loss,val_bpb\n");
        let p = &self.progress;
        let mut vi = p.val_loss.iter().zip(&p.val_bpb).peekable();
        for &(s, l) in &p.train_loss {
            let v = match vi.peek() {
                Some(&(&(vs, vl), &(_, vb))) if vs == s => {
                    vi.next();
                    format!("{vl},{vb}")
                }
                _ => ",".into(),
            };
            csv.push_str(&format!("{s},{l},{v}\n"));
        }
        crate::atomic::write(&dir.join("loss.csv"), csv.as_bytes())
    }

    /// Mean validation loss (nats/token) over the run's validation windows.
    pub fn validate(&mut self) -> Result<f64> {
        let batches =
            self.data
                .val_batches(self.run.eval_windows, self.run.batch, self.run.seq_len);
        if batches.is_empty() {
            return Ok(f64::NAN);
        }
        let (mut sum, mut n) = (0.0, 0usize);
        for b in &batches {
            sum += self.backend.loss(&self.params, b)? * b.tokens() as f64;
            n += b.tokens();
        }
        Ok(sum / n as f64)
    }

    /// A validation loss in nats/token as bits per byte of the validation text the
    /// windows predict (NaN without validation windows).
    pub fn bits_per_byte(&self, nats_per_token: f64) -> f64 {
        let (tokens, bytes) = self
            .data
            .val_window_span(self.run.eval_windows, self.run.seq_len);
        nats_per_token * (tokens as f64 / bytes as f64) / std::f64::consts::LN_2
    }

    pub fn dataset(&self) -> &Dataset {
        &self.data
    }

    /// One optimiser step (all micro-batches); returns (loss, lr, grad norm).
    pub fn step(&mut self) -> Result<(f64, f64, f64)> {
        let step = self.progress.step;
        let batches = (0..self.run.accum as u64)
            .map(|micro| {
                self.data
                    .train_batch(self.run.seed, step, micro, self.run.batch, self.run.seq_len)
            })
            .collect::<Result<Vec<_>>>()?;
        let lr = self.run.schedule.lr(step);
        let (loss, norm) =
            self.backend
                .step(&mut self.params, &mut self.opt, &batches, self.run.clip, lr)?;
        self.progress.tokens += batches.iter().map(|b| b.tokens() as u64).sum::<u64>();
        self.progress.step += 1;
        self.progress.train_loss.push((step, loss));
        Ok((loss, lr, norm))
    }

    /// Bring `params` and `opt` up to date with the backend (a device-resident backend
    /// holds the newest ones).
    pub fn sync(&mut self) -> Result<()> {
        self.backend.sync(&mut self.params, &mut self.opt)
    }

    /// Train until `run.steps`, validating every `eval_every` steps and checkpointing into
    /// `dir` every `ckpt_every` steps and at the end. With a `deadline`, stops after the
    /// first step that ends past it (saving a checkpoint to resume from). Returns whether
    /// the run is complete.
    pub fn train(
        &mut self,
        dir: &Path,
        hook: &mut StepHook,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        while self.progress.step < self.run.steps {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                self.save(dir)?;
                return Ok(false);
            }
            let t0 = Instant::now();
            let tok0 = self.progress.tokens;
            let (loss, lr, norm) = self.step()?;
            if !loss.is_finite() {
                return Err(Error::Other(format!(
                    "loss became {loss} at step {}",
                    self.progress.step
                )));
            }
            let s = self.progress.step;
            if self.run.eval_every > 0
                && (s.is_multiple_of(self.run.eval_every) || s == self.run.steps)
            {
                let v = self.validate()?;
                if v.is_finite() {
                    self.progress.val_loss.push((s - 1, v));
                    let bpb = self.bits_per_byte(v);
                    self.progress.val_bpb.push((s - 1, bpb));
                }
            }
            let dt = t0.elapsed().as_secs_f64();
            self.progress.seconds += dt;
            let tps = (self.progress.tokens - tok0) as f64 / dt;
            hook(&self.progress, loss, lr, norm, tps);
            if self.run.ckpt_every > 0
                && s.is_multiple_of(self.run.ckpt_every)
                && s < self.run.steps
            {
                self.save(dir)?;
            }
        }
        self.save(dir)?;
        Ok(true)
    }
}

/// The tokenizer a resumed run reads back: the byte tokenizer, or the checkpoint's
/// `tokenizer.json`.
fn saved_tokenizer(dir: &Path, run: &RunConfig) -> Result<TrainTokenizer> {
    match TokenizerSpec::parse(&run.tokenizer) {
        TokenizerSpec::Byte => Ok(TrainTokenizer::Byte),
        _ => TrainTokenizer::from_file(&dir.join("tokenizer.json")),
    }
}

/// The run's tokenizer setting, the data's tokenizer and the model's vocabulary agree.
fn check_tokenizer(run: &RunConfig, tok: &TrainTokenizer) -> Result<()> {
    let spec = TokenizerSpec::parse(&run.tokenizer);
    if (spec == TokenizerSpec::Byte) != tok.is_byte() {
        return Err(Error::input(format!(
            "the run's tokenizer is `{}` but the data was tokenized {}",
            run.tokenizer,
            if tok.is_byte() {
                "byte by byte"
            } else {
                "by a tokenizer.json"
            }
        )));
    }
    if run.model.vocab_size != tok.vocab_size() {
        return Err(Error::input(format!(
            "the tokenizer has {} tokens but the model's vocab_size is {}",
            tok.vocab_size(),
            run.model.vocab_size
        )));
    }
    Ok(())
}
