//! The `mamba3` command: argument parsing and one module per subcommand. Each subcommand
//! only calls the library.

pub mod bench;
pub mod bench_serve;
pub mod bench_state_drift;
pub mod bench_train;
pub mod convert;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod random_model;
pub mod serve;
pub mod train;

use crate::engine::DeviceChoice;
use crate::error::Result;
use crate::model::DType;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "mamba3",
    version,
    about = "Run Mamba-3 state-space language models on the CPU and NVIDIA GPUs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Compute logits (and optionally states) for a token sequence, to a safetensors file.
    Logits(logits::Args),
    /// Print a model's config, size, dtype and memory footprint.
    Inspect(inspect::Args),
    /// Convert a checkpoint (e.g. the official pytorch_model.bin) to safetensors.
    Convert(convert::Args),
    /// Measure prefill tokens/s and decode latency on a checkpoint or a synthetic model.
    Bench(bench::Args),
    /// Continue a prompt: stream the generated text to stdout, a summary to stderr.
    Generate(generate::Args),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::Args),
    /// Load-test the server: aggregate decode tokens/s at N clients, prefix-cache TTFT.
    BenchServe(bench_serve::Args),
    /// Train a model on text files (byte-level), with checkpoints and a loss plot.
    Train(train::Args),
    /// Write a Mamba-1 or Mamba-2 model of random weights of a given shape (official folder).
    RandomModel(random_model::Args),
    /// Time optimiser steps (forward, backward, AdamW) on a synthetic model.
    BenchTrain(bench_train::Args),
    /// How far a 16-bit state (--state-dtype bf16|f16) drifts from the f32 one over N
    /// decoded tokens: greedy agreement, max |logit difference|.
    BenchStateDrift(bench_state_drift::Args),
}

/// Options every model-running subcommand shares.
#[derive(clap::Args, Debug, Clone)]
pub struct RunOpts {
    /// Device: cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Weight dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// f32 models on a GPU: GEMMs and scan products on TF32 tensor cores.
    #[arg(long)]
    pub tf32: bool,
    /// 16-bit models, faster and a little less accurate: on a GPU the prefill scan's
    /// products on 16-bit tensor cores; on a CPU with AVX-512 BF16 a bf16 model's prefill
    /// products on activations rounded to bf16 (else split into two bf16 parts).
    #[arg(long)]
    pub fast: bool,
    /// On a GPU: a sequence's output does not depend on the other sequences of its batch,
    /// bit for bit, as on the CPU (slower; see docs/performance.md).
    #[arg(long)]
    pub batch_invariant: bool,
    /// Storage of the recurrent `ssm` state: f32, bf16 or f16 (arithmetic in f32 either
    /// way; 16-bit halves the bytes a decode step streams and a cached prefix holds).
    #[arg(long, default_value = "f32")]
    pub state_dtype: DType,
}

impl RunOpts {
    pub fn init_threads(&self) {
        crate::options::set_command_line(crate::options::GpuFlags {
            tf32: self.tf32,
            fast: self.fast,
            batch_invariant: self.batch_invariant,
        });
        crate::options::set_state_dtype(self.state_dtype.name());
        init_threads(self.threads);
    }
}

/// `--threads N`, capped at the cores present (0: all of them): more threads than cores
/// only slow the work down, and 100,000 of them would take minutes to start.
pub fn thread_count(asked: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if asked > cores {
        eprintln!("note: --threads {asked} is more than the {cores} cores here; using {cores}");
    }
    if asked == 0 {
        cores
    } else {
        asked.min(cores)
    }
}

/// Size the global thread pool from `--threads` (see [`thread_count`]).
pub fn init_threads(threads: Option<usize>) {
    if let Some(n) = threads {
        // Only fails if the pool was already built, in which case it is in use already.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(thread_count(n))
            .build_global();
    }
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Logits(a) => logits::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Serve(a) => serve::run(a),
        Command::BenchServe(a) => bench_serve::run(a),
        Command::Train(a) => train::run(a),
        Command::RandomModel(a) => random_model::run(a),
        Command::BenchTrain(a) => bench_train::run(a),
        Command::BenchStateDrift(a) => bench_state_drift::run(a),
    }
}

/// A comma-separated list of numbers on the command line: `a,b,c`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct List(pub Vec<usize>);

impl std::str::FromStr for List {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        s.split(',')
            .filter(|p| !p.trim().is_empty())
            .map(|p| p.trim().parse::<usize>().map_err(|e| format!("`{p}`: {e}")))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(List)
    }
}

pub type PathArg = PathBuf;
