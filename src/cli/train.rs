//! `mamba3 train`: train a Mamba-3 language model — SISO, or MIMO with `--mimo-rank R`
//! — on text files (bytes, a BPE trained on the text, or a given
//! tokenizer.json), with a progress bar, validation loss, checkpoints (resumable) and a
//! loss plot.

use crate::engine::{Device, DeviceChoice};
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::validate_trainable;
use crate::model::config::Config;
use crate::model::DType;
use crate::train::data::{read_text, Dataset};
use crate::train::optim::{AdamWConfig, Schedule};
use crate::train::tokenizer::{TokenizerSpec, BPE_VOCAB_RANGE};
use crate::train::trainer::{Progress, RunConfig, Trainer};
use crate::train::{Backend, CpuBackend};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Text files to train on (concatenated).
    #[arg(long, required_unless_present = "resume", num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Checkpoint directory (written every --ckpt-every steps and at the end).
    #[arg(long)]
    pub out: PathBuf,
    /// Continue the run saved in --out (its settings are kept; --steps may extend it).
    #[arg(long)]
    pub resume: bool,
    /// Start a fresh run in an --out that already holds a model or a run, replacing it.
    #[arg(long, conflicts_with = "resume")]
    pub force: bool,
    /// Tokenizer: `byte` (vocabulary 256), `bpe` (a byte-level BPE of --vocab-size tokens
    /// trained on the training split), or the path of a tokenizer.json to use as is. It is
    /// saved as tokenizer.json beside the model.
    #[arg(long, default_value = "byte")]
    pub tokenizer: String,
    /// Vocabulary size of `--tokenizer bpe` (257..=65536; default 4096).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    #[arg(long, default_value_t = 4)]
    pub n_layer: usize,
    #[arg(long, default_value_t = 64)]
    pub d_state: usize,
    #[arg(long, default_value_t = 64)]
    pub headdim: usize,
    #[arg(long, default_value_t = 2)]
    pub expand: usize,
    #[arg(long, default_value_t = 1)]
    pub ngroups: usize,
    /// GatedMLP width (0: no MLP).
    #[arg(long, default_value_t = 0)]
    pub d_intermediate: usize,
    #[arg(long, default_value_t = 64)]
    pub chunk_size: usize,
    #[arg(long, default_value_t = 0.5)]
    pub rope_fraction: f64,
    /// Gated RMSNorm before out_proj.
    #[arg(long)]
    pub outproj_norm: bool,
    /// Train a Mamba-3 MIMO model of this rank (1..=64; the official kernels use 1, 2, 4
    /// or 8) instead of SISO.
    #[arg(long)]
    pub mimo_rank: Option<usize>,
    /// Separate lm_head instead of the tied embedding.
    #[arg(long)]
    pub untied: bool,
    /// Optimiser steps (default 1000; with --resume, the saved run's count unless given).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Micro-batches per optimiser step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Final learning rate of the cosine schedule.
    #[arg(long, default_value_t = 3e-4)]
    pub min_lr: f64,
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f64,
    /// Clip gradients to this global norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Every N-th block of 4 KiB of the text is held out for validation.
    #[arg(long, default_value_t = 20)]
    pub val_every_block: usize,
    /// Validate every N steps (and at the end).
    #[arg(long, default_value_t = 100)]
    pub eval_every: u64,
    /// Validation windows (of --seq-len tokens) per evaluation.
    #[arg(long, default_value_t = 256)]
    pub eval_windows: usize,
    /// Checkpoint every N steps.
    #[arg(long, default_value_t = 200)]
    pub ckpt_every: u64,
    /// Print a log line every N steps (always, besides the bar).
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Device: cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Data-parallel training: one worker per device of a list (`cuda:0,cuda:1`, `all`: every
    /// GPU; `cpu,cpu`: CPU workers over the host collective, for tests). Replaces --device;
    /// --accum must be a multiple of the device count.
    #[arg(long)]
    pub devices: Option<DeviceList>,
    /// Data-parallel gradient buckets: MiB of gradient per all-reduce.
    #[arg(long, default_value_t = crate::train::buckets::DEFAULT_BUCKET_MB)]
    pub bucket_mb: f64,
    /// Data-parallel: `on` starts each bucket's all-reduce during the last micro-batch's
    /// backward, as soon as its layers are done; `off` reduces after the backward (the same
    /// bits).
    #[arg(long, default_value = "on")]
    pub overlap_reduce: OnOff,
    /// Arithmetic: f32, or (on a GPU) bf16 / f16 mixed precision with f32 master weights.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    /// Stop (with a checkpoint to resume from) once this many seconds have passed.
    #[arg(long)]
    pub max_seconds: Option<f64>,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

fn model_config(a: &Args, vocab_size: usize) -> Result<Config> {
    let mut c = Config::synthetic(
        a.d_model, a.n_layer, a.d_state, a.headdim, a.expand, a.ngroups, vocab_size,
    );
    c.d_intermediate = a.d_intermediate;
    c.tie_embeddings = !a.untied;
    c.ssm_cfg.chunk_size = a.chunk_size;
    c.ssm_cfg.rope_fraction = a.rope_fraction;
    c.ssm_cfg.is_outproj_norm = a.outproj_norm;
    if let Some(r) = a.mimo_rank {
        c.ssm_cfg.is_mimo = true;
        c.ssm_cfg.mimo_rank = r;
    }
    validate_trainable(&c)?;
    Ok(c)
}

/// What `--tokenizer` and `--vocab-size` ask for.
fn tokenizer_spec(a: &Args) -> Result<TokenizerSpec> {
    let spec = match a.tokenizer.as_str() {
        "bpe" => TokenizerSpec::Bpe {
            vocab_size: a.vocab_size.unwrap_or(4096),
        },
        t => TokenizerSpec::parse(t),
    };
    match &spec {
        TokenizerSpec::Bpe { vocab_size } if !BPE_VOCAB_RANGE.contains(vocab_size) => {
            return Err(Error::input(format!(
                "--vocab-size {vocab_size}: a byte-level BPE needs {}..={} tokens (the 256 \
                 bytes plus merges; e.g. 4096)",
                BPE_VOCAB_RANGE.start(),
                BPE_VOCAB_RANGE.end()
            )))
        }
        TokenizerSpec::Bpe { .. } => {}
        _ if a.vocab_size.is_some() => {
            return Err(Error::input(format!(
                "--vocab-size applies to --tokenizer bpe, not `{}`",
                a.tokenizer
            )))
        }
        TokenizerSpec::File(p) if !p.is_file() => {
            return Err(Error::input(format!(
                "--tokenizer {}: expected `byte`, `bpe` or the path of a tokenizer.json, \
                 and there is no such file",
                p.display()
            )))
        }
        _ => {}
    }
    Ok(spec)
}

/// A fresh run's settings and tokenized data (a BPE is trained here).
fn fresh_run(a: &Args) -> Result<(RunConfig, Dataset)> {
    let spec = tokenizer_spec(a)?;
    let text = read_text(&a.data)?;
    let t0 = Instant::now();
    let data = Dataset::prepare(&text, a.val_every_block, &spec)?;
    if !data.tokenizer.is_byte() {
        eprintln!(
            "tokenizer {spec}: {} tokens; the text is {} tokens for {} bytes ({:.2} bytes/token), \
             {:.1} s",
            data.tokenizer.vocab_size(),
            data.train.len() + data.val.len(),
            text.len(),
            text.len() as f64 / (data.train.len() + data.val.len()).max(1) as f64,
            t0.elapsed().as_secs_f64()
        );
    }
    if let TokenizerSpec::Bpe { vocab_size } = spec {
        if data.tokenizer.vocab_size() < vocab_size {
            eprintln!(
                "note: the training text supports only {} merges seen twice or more: the BPE \
                 has {} tokens, not {vocab_size}",
                data.tokenizer.vocab_size() - crate::train::data::BYTE_VOCAB,
                data.tokenizer.vocab_size()
            );
        }
    }
    let steps = a.steps.unwrap_or(1000);
    let run = RunConfig {
        model: model_config(a, data.tokenizer.vocab_size())?,
        data: a.data.clone(),
        tokenizer: spec.to_string(),
        steps,
        batch: a.batch,
        accum: a.accum.max(1),
        seq_len: a.seq_len,
        schedule: Schedule {
            peak: a.lr,
            min: a.min_lr,
            warmup: a.warmup,
            total: steps,
        },
        adamw: AdamWConfig {
            beta1: a.beta1,
            beta2: a.beta2,
            eps: 1e-8,
            weight_decay: a.weight_decay,
        },
        clip: a.clip,
        seed: a.seed,
        val_every_block: a.val_every_block,
        eval_every: a.eval_every,
        eval_windows: a.eval_windows,
        ckpt_every: a.ckpt_every,
    };
    Ok((run, data))
}

/// The largest `--mimo-rank` taken: far past any published model, small enough that a
/// typo cannot ask for a model R times too large to hold.
pub const MAX_MIMO_RANK: usize = 64;

/// Numbers that would make a run fail late, loop forever or diverge at once, refused
/// before any work.
fn check_numbers(a: &Args) -> Result<()> {
    let bad = |flag: &str, v: String, want: &str| {
        Err(Error::input(format!("{flag} {v}: expected {want}")))
    };
    if a.batch == 0 {
        return bad("--batch", "0".into(), "at least 1 sequence per micro-batch");
    }
    if a.seq_len == 0 {
        return bad("--seq-len", "0".into(), "at least 1 token per window");
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        return bad("--lr", a.lr.to_string(), "a finite learning rate above 0");
    }
    if !(a.min_lr.is_finite() && a.min_lr >= 0.0) {
        return bad(
            "--min-lr",
            a.min_lr.to_string(),
            "a finite number, 0 or more",
        );
    }
    for (flag, v) in [("--beta1", a.beta1), ("--beta2", a.beta2)] {
        if !(0.0..1.0).contains(&v) {
            return bad(flag, v.to_string(), "a number in [0, 1)");
        }
    }
    for (flag, v) in [("--weight-decay", a.weight_decay), ("--clip", a.clip)] {
        if !(v.is_finite() && v >= 0.0) {
            return bad(flag, v.to_string(), "a finite number, 0 or more");
        }
    }
    if let Some(r) = a.mimo_rank {
        if !(1..=MAX_MIMO_RANK).contains(&r) {
            return bad(
                "--mimo-rank",
                r.to_string(),
                &format!(
                    "a rank from 1 to {MAX_MIMO_RANK} (the official kernels use 1, 2, 4 or 8)"
                ),
            );
        }
    }
    if let Some(s) = a.max_seconds {
        if !(s.is_finite() && s > 0.0) {
            return bad(
                "--max-seconds",
                s.to_string(),
                "a number of seconds above 0",
            );
        }
    }
    Ok(())
}

/// A switch flag's value: `on` or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnOff(pub bool);

impl std::str::FromStr for OnOff {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "on" => Ok(OnOff(true)),
            "off" => Ok(OnOff(false)),
            _ => Err(Error::input(format!("`{s}`: expected on or off"))),
        }
    }
}

/// `--devices`: a comma-separated list of `cpu`, `cuda`, `cuda:N`, or `all` (every GPU).
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceList {
    All,
    List(Vec<Device>),
}

impl std::str::FromStr for DeviceList {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("all") {
            return Ok(DeviceList::All);
        }
        let list = (s.split(','))
            .map(|d| match d.parse::<DeviceChoice>() {
                Ok(DeviceChoice::Exact(d)) => Ok(d),
                _ => Err(Error::input(format!(
                    "--devices {s}: `{}` is not a device; expected a comma-separated list of \
                     cpu, cuda or cuda:N, or `all`",
                    d.trim()
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceList::List(list))
    }
}

impl DeviceList {
    /// The devices, with `all` resolved; one kind only (all CPU or all CUDA).
    pub fn resolve(&self) -> Result<Vec<Device>> {
        let list = match self {
            DeviceList::List(l) => l.clone(),
            DeviceList::All => {
                let n = crate::engine::cuda_device_count();
                if n == 0 {
                    return Err(Error::Device(
                        "--devices all: no CUDA device is visible (or this build has no CUDA \
                         support)"
                            .into(),
                    ));
                }
                (0..n).map(Device::Cuda).collect()
            }
        };
        let cpus = list.iter().filter(|d| **d == Device::Cpu).count();
        if cpus != 0 && cpus != list.len() {
            return Err(Error::input(
                "--devices: expected CPU workers only or GPUs only, found both",
            ));
        }
        Ok(list)
    }
}

/// A backend for the devices of `--devices` (N > 1): data-parallel workers, the reduction
/// overlapped with the backward when `overlap`.
pub fn data_parallel(
    devices: &[Device],
    config: &Config,
    dtype: DType,
    bucket_mb: f64,
    overlap: OnOff,
) -> Result<crate::train::parallel::DataParallel> {
    let mut dp = group(devices, config, dtype, bucket_mb)?;
    dp.set_overlap(overlap.0);
    Ok(dp)
}

fn group(
    devices: &[Device],
    config: &Config,
    dtype: DType,
    bucket_mb: f64,
) -> Result<crate::train::parallel::DataParallel> {
    let bytes = crate::train::buckets::bucket_bytes(bucket_mb)?;
    if devices.iter().all(|d| *d == Device::Cpu) {
        if dtype != DType::F32 {
            return Err(Error::input(format!(
                "training on the CPU runs in f32; --dtype {dtype} needs GPUs in --devices"
            )));
        }
        return crate::train::parallel::DataParallel::host(config, devices.len(), bytes);
    }
    #[cfg(feature = "cuda")]
    {
        let ordinals = (devices.iter())
            .map(|d| match d {
                Device::Cuda(n) => Ok(*n),
                Device::Cpu => Err(Error::input(
                    "--devices: expected CPU workers only or GPUs only, found both",
                )),
            })
            .collect::<Result<Vec<usize>>>()?;
        crate::train::cuda::replica::data_parallel(config, dtype, &ordinals, bytes)
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::Device(
        "this build has no CUDA support (build with --features cuda)".into(),
    ))
}

pub fn run(mut a: Args) -> Result<()> {
    check_numbers(&a)?;
    super::init_threads(a.threads);
    let devices = match &a.devices {
        Some(list) => list.resolve()?,
        None => vec![a.device.resolve()],
    };
    if devices.len() == 1 {
        a.device = DeviceChoice::Exact(devices[0]);
    }
    let device = devices[0];
    if device == Device::Cpu && a.dtype != DType::F32 {
        return Err(Error::input(format!(
            "training on the CPU runs in f32; --dtype {} needs --device cuda",
            a.dtype
        )));
    }
    let held = crate::atomic::model_files_in(&a.out);
    if !a.resume && !a.force && !held.is_empty() {
        return Err(Error::input(format!(
            "--out {} already holds a model or a training run ({}): continue it with --resume, \
             or replace it with --force",
            a.out.display(),
            held.join(", ")
        )));
    }
    if a.out.exists() && !a.out.is_dir() {
        return Err(Error::input(format!(
            "--out {}: that is a file, expected a folder",
            a.out.display()
        )));
    }
    // A resumed run keeps its mixer; --mimo-rank may only repeat it.
    if a.resume {
        let saved = &crate::train::trainer::saved_run(&a.out)?.model.ssm_cfg;
        let saved_rank = saved.is_mimo.then_some(saved.mimo_rank);
        if a.mimo_rank.is_some() && a.mimo_rank != saved_rank {
            return Err(Error::input(format!(
                "--mimo-rank {}: the run in {} trains {}; a resumed run keeps its model",
                a.mimo_rank.unwrap_or(0),
                a.out.display(),
                saved_rank.map_or("a SISO model".into(), |r| format!(
                    "a MIMO model of rank {r}"
                ))
            )));
        }
    }
    let fresh = if a.resume {
        if a.tokenizer != "byte" || a.vocab_size.is_some() {
            eprintln!(
                "note: --resume keeps the run's tokenizer ({}); --tokenizer and --vocab-size \
                 are ignored",
                a.out.join("tokenizer.json").display()
            );
        }
        None
    } else {
        Some(fresh_run(&a)?)
    };
    if devices.len() > 1 {
        let run = match &fresh {
            Some((run, _)) => run.clone(),
            None => crate::train::trainer::saved_run(&a.out)?,
        };
        crate::train::parallel::check_accum(run.accum, devices.len())?;
        let backend = data_parallel(&devices, &run.model, a.dtype, a.bucket_mb, a.overlap_reduce)?;
        return train_with(a, fresh, backend);
    }
    match device {
        Device::Cpu => train_with(a, fresh, CpuBackend),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            let config = match &fresh {
                Some((run, _)) => run.model.clone(),
                None => crate::train::trainer::saved_run(&a.out)?.model,
            };
            let backend = crate::train::cuda::CudaTrainer::new(&config, a.dtype, n)?;
            train_with(a, fresh, backend)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(Error::Device(
            "this build has no CUDA support (build with --features cuda)".into(),
        )),
    }
}

fn train_with<B: Backend>(a: Args, fresh: Option<(RunConfig, Dataset)>, backend: B) -> Result<()> {
    std::fs::create_dir_all(&a.out).map_err(|e| Error::io(&a.out, e))?;
    let mut trainer = match fresh {
        Some((run, data)) => Trainer::with_data(run, backend, data)?,
        None => {
            // --data given again replaces the run's files (moved, or more text).
            let data = (!a.data.is_empty()).then(|| a.data.clone());
            let mut t = Trainer::resume_with_files(&a.out, backend, data)?;
            if let Some(s) = a.steps {
                t.run.steps = s;
            }
            t
        }
    };
    let r = &trainer.run;
    let mixer = if r.model.ssm_cfg.is_mimo {
        format!("MIMO rank {}", r.model.ssm_cfg.mimo_rank)
    } else {
        "SISO".into()
    };
    eprintln!(
        "training {} parameters ({mixer}, {} layers, d_model {}, d_state {}, headdim {}) on {}: \
         {} steps × {} × {} × {} tokens ({} tokenizer, vocabulary {}), from step {}",
        trainer.params.numel(),
        r.model.n_layer,
        r.model.d_model,
        r.model.ssm_cfg.d_state,
        r.model.ssm_cfg.headdim,
        crate::train::Backend::name(&trainer.backend),
        r.steps,
        r.accum,
        r.batch,
        r.seq_len,
        r.tokenizer,
        r.model.vocab_size,
        trainer.progress.step
    );
    if trainer.progress.unigram_bits.is_finite() {
        eprintln!(
            "unigram baseline on the validation split: {:.4} bits/byte ({:.4} bits/token)",
            trainer.progress.unigram_bpb, trainer.progress.unigram_bits
        );
    } else {
        eprintln!(
            "no validation split: the text is shorter than {} blocks of 4 KiB (--val-every-block)",
            r.val_every_block
        );
    }
    let pb = ProgressBar::new(r.steps);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap(),
    );
    pb.set_position(trainer.progress.step);
    let log_every = a.log_every.max(1);
    let mut ema: Option<f64> = None;
    let mut hook = |p: &Progress, loss: f64, lr: f64, norm: f64, tps: f64| {
        let e = ema.map_or(loss, |e| 0.95 * e + 0.05 * loss);
        ema = Some(e);
        let val = (p.val_loss.last().zip(p.val_bpb.last()))
            .map(|(&(_, v), &(_, b))| format!(" val {v:.4} ({b:.3} bpb)"))
            .unwrap_or_default();
        pb.set_message(format!("loss {e:.4}{val} {tps:.0} tok/s"));
        pb.set_position(p.step);
        if p.step.is_multiple_of(log_every) || p.step == 1 {
            let line = format!(
                "step {} loss {loss:.4} (avg {e:.4}){val} lr {lr:.2e} |g| {norm:.3} {tps:.0} tok/s {:.0}s",
                p.step, p.seconds
            );
            if pb.is_hidden() {
                eprintln!("{line}");
            } else {
                pb.println(line);
            }
        }
    };
    let deadline = a
        .max_seconds
        .map(|s| std::time::Instant::now() + std::time::Duration::from_secs_f64(s));
    let done = trainer.train(&a.out, &mut hook, deadline)?;
    pb.finish();
    if !done {
        eprintln!(
            "time limit reached at step {}: checkpoint in {}; continue with --resume",
            trainer.progress.step,
            a.out.display()
        );
    }
    let p = &trainer.progress;
    if let Some((&(_, v), &(_, b))) = p.val_loss.last().zip(p.val_bpb.last()) {
        eprintln!(
            "final validation loss {v:.4} nats/token = {b:.4} bits/byte (unigram {:.4} bits/byte)",
            p.unigram_bpb
        );
    }
    let png = a.out.join("loss.png");
    crate::train::plot::loss_png(p, &png)?;
    eprintln!("checkpoint and loss plot in {}", a.out.display());
    Ok(())
}
