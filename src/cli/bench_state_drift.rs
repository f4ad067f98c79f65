//! `mamba3 bench-state-drift`: how far a 16-bit `ssm` state (`--state-dtype bf16|f16`)
//! takes a model's logits from those of its f32 state over N greedily decoded tokens
//! (`engine::drift`): the greedy agreement rate and the largest |logit difference|.

use super::{PathArg, RunOpts};
use crate::engine::drift::state_drift;
use crate::engine::Model;
use crate::error::{Error, Result};
use crate::model::DType;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (the built-in default model when not given).
    #[arg(long)]
    pub model: Option<PathArg>,
    /// Tokens to decode after the prompt.
    #[arg(long, default_value_t = 1024)]
    pub tokens: usize,
    /// The prompt: token ids as a JSON array or file (as `mamba3 logits --input-ids`);
    /// 16 fixed ids below the vocabulary size when not given.
    #[arg(long)]
    pub input_ids: Option<PathArg>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub run: RunOpts,
}

pub fn run(a: Args) -> Result<()> {
    // the f32 model is the reference: its state dtype is not the command line's
    super::init_threads(a.run.threads);
    crate::options::set_command_line(crate::options::GpuFlags {
        tf32: a.run.tf32,
        fast: a.run.fast,
        batch_invariant: a.run.batch_invariant,
    });
    if a.run.state_dtype == DType::F32 {
        return Err(Error::input(
            "bench-state-drift compares a 16-bit state with the f32 one: expected \
             --state-dtype bf16 or f16, found f32",
        ));
    }
    let dir = crate::model::default_model::resolve(a.model.as_deref())?;
    let device = a.run.device.resolve();
    let reference = Model::load_with_state(&dir, device, a.run.dtype, DType::F32)?;
    let narrow = Model::load_with_state(&dir, device, a.run.dtype, a.run.state_dtype)?;
    let vocab = reference.dims().vocab_size;
    let prompt: Vec<u32> = match &a.input_ids {
        Some(p) => super::logits::to_tokens(&super::logits::read_input_ids(p)?, vocab)?,
        None => (0..16).map(|i| ((i * 37 + 11) % vocab) as u32).collect(),
    };
    let d = state_drift(&reference, &narrow, &prompt, a.tokens)?;
    if a.json {
        let j = serde_json::json!({
            "model": dir.display().to_string(),
            "device": reference.device().to_string(),
            "dtype": reference.dtype().name(),
            "state_dtype": narrow.state_dtype().name(),
            "prompt_len": prompt.len(),
            "tokens": a.tokens,
            "positions": d.steps,
            "greedy_agreement": d.agreement(),
            "first_disagreement": d.first_disagreement,
            "max_abs_logit_diff": d.max_abs,
            "mean_max_abs_logit_diff": d.mean_max_abs,
        });
        println!("{j}");
    } else {
        println!(
            "{} · {} weights · state {} against f32 on {} · prompt {} + {} decoded tokens",
            dir.display(),
            reference.dtype(),
            narrow.state_dtype(),
            reference.device_name(),
            prompt.len(),
            a.tokens
        );
        let first = d
            .first_disagreement
            .map_or("none".to_string(), |p| p.to_string());
        println!(
            "greedy agreement {:.4} ({} of {} positions, first disagreement at {first}) · \
             max |Δlogit| {:.3e} · mean per-position max |Δlogit| {:.3e}",
            d.agreement(),
            d.agree,
            d.steps,
            d.max_abs,
            d.mean_max_abs
        );
    }
    Ok(())
}
