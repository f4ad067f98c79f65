//! `mamba3 bench-train`: the wall time of one optimiser step (forward, backward, global-norm
//! clipping, AdamW) on a synthetic model of a given shape, with random byte tokens, on the
//! CPU or a GPU (SISO, or MIMO with `--mimo-rank R`). Median over the timed steps, warm-up
//! excluded. With `--devices` (N > 1), data-parallel: N micro-batches per step, one per
//! device, so tokens/s at a fixed per-device batch shows the scaling; it also reports the
//! median time a step waited for the gradient's reduction after its backward (what the
//! overlap of `--overlap-reduce on` hides).

use crate::cli::train::{data_parallel, DeviceList, OnOff, MAX_MIMO_RANK};
use crate::engine::{Device, DeviceChoice};
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::validate_trainable;
use crate::model::rng::Rng;
use crate::model::{Config, DType};
use crate::train::optim::{AdamW, AdamWConfig};
use crate::train::{Backend, Batch, CpuBackend, Params};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value_t = 768)]
    pub d_model: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 128)]
    pub d_state: usize,
    #[arg(long, default_value_t = 64)]
    pub headdim: usize,
    #[arg(long, default_value_t = 2)]
    pub expand: usize,
    #[arg(long, default_value_t = 256)]
    pub vocab: usize,
    #[arg(long, default_value_t = 64)]
    pub chunk: usize,
    /// Time a Mamba-3 MIMO model of this rank instead of SISO.
    #[arg(long)]
    pub mimo_rank: Option<usize>,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 512)]
    pub seq_len: usize,
    /// Timed optimiser steps (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Device: cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Data-parallel over these devices (`cuda:0,cuda:1`, `all`, `cpu,cpu`): each device
    /// takes one micro-batch of --batch × --seq-len tokens per step (a fixed per-device
    /// batch), gradients all-reduced. Replaces --device.
    #[arg(long)]
    pub devices: Option<DeviceList>,
    /// Data-parallel gradient buckets: MiB of gradient per all-reduce.
    #[arg(long, default_value_t = crate::train::buckets::DEFAULT_BUCKET_MB)]
    pub bucket_mb: f64,
    /// Data-parallel: overlap each bucket's all-reduce with the backward (`on`) or reduce
    /// after it (`off`).
    #[arg(long, default_value = "on")]
    pub overlap_reduce: OnOff,
    /// f32, or bf16 / f16 mixed precision (GPU).
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    /// One JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    for (flag, v) in [
        ("--batch", a.batch),
        ("--seq-len", a.seq_len),
        ("--steps", a.steps),
    ] {
        if v == 0 {
            return Err(Error::input(format!("{flag} 0: expected at least 1")));
        }
    }
    let mut cfg = Config::synthetic(
        a.d_model, a.layers, a.d_state, a.headdim, a.expand, 1, a.vocab,
    );
    cfg.ssm_cfg.chunk_size = a.chunk;
    if let Some(r) = a.mimo_rank {
        if !(1..=MAX_MIMO_RANK).contains(&r) {
            return Err(Error::input(format!(
                "--mimo-rank {r}: expected a rank from 1 to {MAX_MIMO_RANK}"
            )));
        }
        cfg.ssm_cfg.is_mimo = true;
        cfg.ssm_cfg.mimo_rank = r;
    }
    validate_trainable(&cfg)?;
    let devices = match &a.devices {
        Some(list) => list.resolve()?,
        None => vec![a.device.resolve()],
    };
    let device = devices[0];
    if devices.len() > 1 {
        let dp = data_parallel(&devices, &cfg, a.dtype, a.bucket_mb, a.overlap_reduce)?;
        let name = Backend::name(&dp);
        return bench(&a, &cfg, dp, name, devices.len());
    }
    match device {
        Device::Cpu => {
            if a.dtype != DType::F32 {
                return Err(Error::input("the CPU trains in f32 only"));
            }
            bench(&a, &cfg, CpuBackend, "cpu".into(), 1)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            let t = crate::train::cuda::CudaTrainer::new(&cfg, a.dtype, n)?;
            let name = t.device_name();
            bench(&a, &cfg, t, name, 1)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(Error::Device("this build has no CUDA support".into())),
    }
}

/// Time steps of `ranks` micro-batches of `a.batch` sequences each (one per device).
fn bench<B: Backend>(
    a: &Args,
    cfg: &Config,
    mut backend: B,
    device: String,
    ranks: usize,
) -> Result<()> {
    let mut params = Params::<f32>::init(cfg, 0)?;
    let mut opt = AdamW::new(AdamWConfig::default(), &params);
    let mut rng = Rng::new(1);
    let mut times = Vec::with_capacity(a.steps);
    let mut waits = Vec::with_capacity(a.steps);
    let mut last_loss = f64::NAN;
    for i in 0..a.warmup + a.steps.max(1) {
        let batches: Vec<Batch> = (0..ranks)
            .map(|_| {
                let windows: Vec<Vec<u32>> = (0..a.batch)
                    .map(|_| {
                        (0..=a.seq_len)
                            .map(|_| rng.below(a.vocab as u64) as u32)
                            .collect()
                    })
                    .collect();
                let refs: Vec<&[u32]> = windows.iter().map(|w| w.as_slice()).collect();
                Batch::from_windows(&refs)
            })
            .collect();
        let t0 = Instant::now();
        let (loss, _) = backend.step(&mut params, &mut opt, &batches, 1.0, 1e-3)?;
        let dt = t0.elapsed().as_secs_f64();
        if !loss.is_finite() {
            return Err(Error::Other(format!("loss became {loss} at step {i}")));
        }
        last_loss = loss;
        if i >= a.warmup {
            times.push(dt);
            waits.extend(backend.reduce_wait());
        }
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let med = times[times.len() / 2];
    let tokens = (ranks * a.batch * a.seq_len) as f64;
    // data-parallel: the median wait for the reduction after the backward, in ms
    waits.sort_by(|x, y| x.total_cmp(y));
    let wait_ms = waits.get(waits.len() / 2).map(|w| w * 1e3);
    let overlap = (ranks > 1).then_some(a.overlap_reduce.0);
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "device": device, "dtype": a.dtype.to_string(), "d_model": a.d_model,
                "layers": a.layers, "d_state": a.d_state, "headdim": a.headdim,
                "mimo_rank": a.mimo_rank,
                "vocab": a.vocab, "batch": a.batch, "seq_len": a.seq_len, "devices": ranks,
                "params": params.numel(), "steps": times.len(),
                "step_ms": med * 1e3, "step_ms_min": times[0] * 1e3,
                "step_ms_max": times[times.len() - 1] * 1e3,
                "tokens_per_s": tokens / med, "tokens_per_s_per_device": tokens / med / ranks as f64,
                "reduce_wait_ms": wait_ms, "overlap_reduce": overlap,
                "last_loss": last_loss,
            })
        );
    } else {
        let mixer = a
            .mimo_rank
            .map_or("SISO".into(), |r| format!("MIMO rank {r}"));
        println!(
            "train step on {device} ({}), {mixer} · d_model {} · {} layers · d_state {} · \
             headdim {} · {} × {} × {} tokens: median {:.2} ms (min {:.2}, max {:.2}) over {} \
             steps, {:.0} tokens/s ({:.0} per device)",
            a.dtype,
            a.d_model,
            a.layers,
            a.d_state,
            a.headdim,
            ranks,
            a.batch,
            a.seq_len,
            med * 1e3,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3,
            times.len(),
            tokens / med,
            tokens / med / ranks as f64
        );
        if let (Some(w), Some(on)) = (wait_ms, overlap) {
            println!(
                "  gradient reduction: median {w:.3} ms after the backward (overlap {})",
                if on { "on" } else { "off" }
            );
        }
    }
    Ok(())
}
