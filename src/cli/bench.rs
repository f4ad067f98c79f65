//! `mamba3 bench`: prefill tokens/s and decode latency, on a checkpoint or on a synthetic
//! model given by its shape. Medians over repeats, warm-up excluded; inputs are random
//! tokens (never all zeros).

use super::{PathArg, RunOpts};
use crate::engine::{LogitsWant, Model, State, StepLogits};
use crate::error::{Error, Result};
use crate::mixers::family::FamilyWeights;
use crate::mixers::family_synthetic::{official_config, synthetic};
use crate::mixers::mamba3::Weights;
use crate::mixers::mimo::{mimo_config_from_json_str, MimoWeights};
use crate::mixers::MixerWeights;
use crate::model::rng::Rng;
use crate::model::Config;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory; without it a synthetic model of the shape below is built.
    #[arg(long)]
    pub model: Option<PathArg>,
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 64)]
    pub d_state: usize,
    #[arg(long, default_value_t = 32)]
    pub headdim: usize,
    #[arg(long, default_value_t = 2)]
    pub expand: usize,
    #[arg(long, default_value_t = 1)]
    pub ngroups: usize,
    #[arg(long, default_value_t = 256)]
    pub vocab: usize,
    #[arg(long, default_value_t = 64)]
    pub chunk: usize,
    /// The synthetic model's mixer: mamba3, mamba1 or mamba2.
    #[arg(long, default_value = "mamba3")]
    pub family: String,
    /// Mamba-3 MIMO rank R of the synthetic model (0: SISO).
    #[arg(long, default_value_t = 0)]
    pub mimo_rank: usize,
    /// Prompt lengths to prefill.
    #[arg(long, default_value = "512")]
    pub prompt: super::List,
    /// Batch sizes.
    #[arg(long, default_value = "1")]
    pub batch: super::List,
    /// Decode steps timed after each prefill.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Timed repeats of each prefill (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Untimed warm-up runs.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// GPU: time decode without CUDA graphs (by default each batch size's decode step is
    /// captured as a graph before it is timed).
    #[arg(long)]
    pub no_graphs: bool,
    #[command(flatten)]
    pub run: RunOpts,
}

pub struct Measurement {
    pub batch: usize,
    pub prompt_len: usize,
    pub prefill_s: f64,
    pub decode_step_s: f64,
    /// the first (untimed) prefill of this point, start-up costs included
    pub first_prefill_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// Time one (batch, prompt) point.
pub fn measure(
    model: &Model,
    batch: usize,
    prompt_len: usize,
    a: &Args,
    rng: &mut Rng,
) -> Result<Measurement> {
    let vocab = model.dims().vocab_size as u64;
    let seqs: Vec<Vec<u32>> = (0..batch)
        .map(|_| (0..prompt_len).map(|_| rng.below(vocab) as u32).collect())
        .collect();
    let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
    let mut prefill_times = Vec::new();
    let mut states: Vec<State> = Vec::new();
    let mut first_prefill_s = f64::NAN;
    for i in 0..a.warmup + a.repeats.max(1) {
        states = (0..batch).map(|_| model.new_state()).collect();
        let mut st: Vec<&mut State> = states.iter_mut().collect();
        let t0 = Instant::now();
        model.prefill_batch(&refs, &mut st, LogitsWant::Last)?;
        model.synchronize()?;
        if i == 0 {
            first_prefill_s = t0.elapsed().as_secs_f64();
        }
        if i >= a.warmup {
            prefill_times.push(t0.elapsed().as_secs_f64());
        }
    }
    if model.device() != crate::engine::Device::Cpu && !a.no_graphs {
        model.capture_decode_graph(batch)?;
    }
    let mut decode_times = Vec::new();
    let mut tokens: Vec<u32> = (0..batch).map(|_| rng.below(vocab) as u32).collect();
    // One buffer for every step, as generation and the server keep it (pinned on a GPU).
    let mut logits = StepLogits::new();
    for i in 0..a.decode_steps + a.warmup.max(1) {
        let mut st: Vec<&mut State> = states.iter_mut().collect();
        let t0 = Instant::now();
        // (returns with the logits on the host: no further wait, as in serving)
        model.decode_into(&tokens, &mut st, &mut logits)?;
        if i >= a.warmup.max(1) {
            decode_times.push(t0.elapsed().as_secs_f64());
        }
        // Feed the argmax back, like greedy generation.
        for (b, t) in tokens.iter_mut().enumerate() {
            let row = &logits.row(b)[..model.dims().vocab_size];
            *t = row
                .iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .map_or(0, |(i, _)| i as u32);
        }
    }
    Ok(Measurement {
        batch,
        prompt_len,
        prefill_s: median(prefill_times),
        decode_step_s: median(decode_times),
        first_prefill_s,
    })
}

pub fn run(a: Args) -> Result<()> {
    a.run.init_threads();
    let device = a.run.device.resolve();
    let t_load = Instant::now();
    let model = match &a.model {
        Some(dir) => Model::load(dir, device, a.run.dtype)?,
        None => Model::from_mixer_weights(synthetic_weights(&a)?, device)?,
    };
    let load_s = t_load.elapsed().as_secs_f64();
    let d = model.dims();
    let shape = format!(
        "{} · d_model {} · layers {} · vocab {}",
        model.kind().name(),
        d.d_model,
        d.n_layer,
        d.vocab_padded,
    );
    let device_name = model.device_name();
    if !a.json {
        println!(
            "{} on {} · {} · state {} · {:.1} M params · loaded in {:.2} s",
            shape,
            device_name,
            model.dtype(),
            model.state_dtype(),
            model.weights().param_count() as f64 / 1e6,
            load_s
        );
        println!(
            "{:>6} {:>7} {:>16} {:>12} {:>14} {:>16}",
            "batch", "prompt", "prefill tok/s", "prefill ms", "decode ms/tok", "decode tok/s"
        );
    }
    let synthetic = a.model.is_none();
    let mut rng = Rng::new(42);
    let batches = a.batch.0.clone();
    let prompts = a.prompt.0.clone();
    for &b in &batches {
        for &t in &prompts {
            let m = measure(&model, b, t, &a, &mut rng)?;
            let prefill_tps = (b * t) as f64 / m.prefill_s;
            let decode_tps = b as f64 / m.decode_step_s;
            if a.json {
                let j = serde_json::json!({
                    "device": model.device().to_string(),
                    "device_name": device_name,
                    "dtype": model.dtype().name(),
                    "state_dtype": model.state_dtype().name(),
                    "batch": b,
                    "prompt_len": t,
                    "prefill_tokens_per_s": prefill_tps,
                    "prefill_ms": m.prefill_s * 1e3,
                    "decode_ms_per_token": m.decode_step_s * 1e3,
                    "decode_us_per_token": m.decode_step_s * 1e6,
                    "decode_tokens_per_s": decode_tps,
                    "mixer": model.kind().name(),
                    "d_model": d.d_model, "layers": d.n_layer, "vocab_padded": d.vocab_padded,
                    // the shape flags describe a synthetic model only, not a loaded one
                    "model": a.model.as_ref().map(|p| p.display().to_string()),
                    "d_state": synthetic.then_some(a.d_state),
                    "headdim": synthetic.then_some(a.headdim),
                    "expand": synthetic.then_some(a.expand),
                    "ngroups": synthetic.then_some(a.ngroups),
                    "mimo_rank": synthetic.then_some(a.mimo_rank),
                    "chunk": synthetic.then_some(a.chunk),
                    "threads": rayon::current_num_threads(),
                    "load_s": load_s,
                    "first_prefill_s": m.first_prefill_s,
                    "gpu_options": model.gpu_options()?.map(|o| format!("{o:?}")),
                    "graphs": model.device() != crate::engine::Device::Cpu && !a.no_graphs,
                });
                println!("{j}");
            } else {
                println!(
                    "{:>6} {:>7} {:>16.0} {:>12.2} {:>14.3} {:>16.0}",
                    b,
                    t,
                    prefill_tps,
                    m.prefill_s * 1e3,
                    m.decode_step_s * 1e3,
                    decode_tps
                );
            }
        }
    }
    Ok(())
}

/// The synthetic model of the shape and mixer the flags give.
fn synthetic_weights(a: &Args) -> Result<MixerWeights> {
    let dtype = a.run.dtype;
    match (a.family.as_str(), a.mimo_rank) {
        ("mamba3", 0) => {
            let mut cfg = Config::synthetic(
                a.d_model, a.layers, a.d_state, a.headdim, a.expand, a.ngroups, a.vocab,
            );
            cfg.ssm_cfg.chunk_size = a.chunk;
            Ok(MixerWeights::Mamba3(Arc::new(Weights::synthetic(
                cfg, dtype, 0,
            )?)))
        }
        ("mamba3", r) => {
            let cfg = mimo_config_from_json_str(
                &format!(
                    r#"{{"d_model": {}, "n_layer": {}, "vocab_size": {}, "ssm_cfg": {{
                        "layer": "Mamba3", "d_state": {}, "headdim": {}, "expand": {},
                        "ngroups": {}, "chunk_size": {}, "is_mimo": true, "mimo_rank": {r}}}}}"#,
                    a.d_model,
                    a.layers,
                    a.vocab,
                    a.d_state,
                    a.headdim,
                    a.expand,
                    a.ngroups,
                    a.chunk
                ),
                "bench flags",
            )?;
            Ok(MixerWeights::Mimo(Arc::new(MimoWeights::synthetic(
                cfg, dtype, 0,
            )?)))
        }
        (family @ ("mamba1" | "mamba2"), 0) => {
            let layer = if family == "mamba1" {
                "Mamba1"
            } else {
                "Mamba2"
            };
            let cfg = official_config(layer, a.d_model, a.layers, a.vocab, a.d_state, a.headdim)?;
            Ok(match synthetic(&cfg, dtype, 0) {
                FamilyWeights::Mamba1(w) => MixerWeights::Mamba1(Arc::new(w)),
                FamilyWeights::Mamba2(w) => MixerWeights::Mamba2(Arc::new(w)),
            })
        }
        (family, r) => Err(Error::input(format!(
            "--family {family} with --mimo-rank {r}: expected mamba3, mamba1 or mamba2, and a \
             MIMO rank only with mamba3"
        ))),
    }
}
