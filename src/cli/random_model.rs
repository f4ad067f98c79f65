//! `mamba3 random-model`: write a Mamba-1 or Mamba-2 model of random weights and a given
//! shape as an official folder (`config.json`, `model.safetensors`, and a tokenizer copied
//! beside them when given): a real-shaped model for benchmarks against other engines and
//! for serving tests, without downloading a checkpoint.

use super::PathArg;
use crate::error::{Error, Result};
use crate::mixers::family::FamilyWeights;
use crate::mixers::family_synthetic::{official_config_json, synthetic};
use crate::mixers::MixerWeights;
use crate::model::family_config::FamilyConfig;
use crate::model::DType;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// mamba1 or mamba2.
    #[arg(long)]
    pub family: String,
    #[arg(long, default_value_t = 768)]
    pub d_model: usize,
    #[arg(long, default_value_t = 24)]
    pub layers: usize,
    /// State size N (official defaults: 16 for Mamba-1, 128 for Mamba-2).
    #[arg(long)]
    pub d_state: Option<usize>,
    /// Mamba-2 head dimension.
    #[arg(long, default_value_t = 64)]
    pub headdim: usize,
    #[arg(long, default_value_t = 50280)]
    pub vocab: usize,
    /// Matrices stored in this dtype.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A tokenizer.json to copy into the folder (with the tokenizer_config.json beside it,
    /// if any).
    #[arg(long)]
    pub tokenizer: Option<PathArg>,
    /// The folder to write (must not hold a model already).
    #[arg(long)]
    pub out: PathArg,
}

pub fn run(a: Args) -> Result<()> {
    let (layer, d_state) = match a.family.as_str() {
        "mamba1" => ("Mamba1", a.d_state.unwrap_or(16)),
        "mamba2" => ("Mamba2", a.d_state.unwrap_or(128)),
        other => {
            return Err(Error::input(format!(
                "--family {other}: expected mamba1 or mamba2"
            )))
        }
    };
    for f in ["config.json", "model.safetensors"] {
        if a.out.join(f).exists() {
            return Err(Error::input(format!(
                "--out {}: the folder already holds {f}; refusing to overwrite it",
                a.out.display()
            )));
        }
    }
    let text = official_config_json(layer, a.d_model, a.layers, a.vocab, d_state, a.headdim);
    let config = FamilyConfig::from_json_str(&text, "random-model flags")?;
    let weights = match synthetic(&config, a.dtype, a.seed) {
        FamilyWeights::Mamba1(w) => MixerWeights::Mamba1(Arc::new(w)),
        FamilyWeights::Mamba2(w) => MixerWeights::Mamba2(Arc::new(w)),
    };
    weights.save_official(&a.out, &text)?;
    if let Some(tok) = &a.tokenizer {
        let copy = |src: &std::path::Path, name: &str| -> Result<()> {
            let bytes = std::fs::read(src).map_err(|e| Error::io(src, e))?;
            crate::atomic::write(&a.out.join(name), &bytes)
        };
        copy(tok, "tokenizer.json")?;
        let cfg = tok.with_file_name("tokenizer_config.json");
        if cfg.is_file() {
            copy(&cfg, "tokenizer_config.json")?;
        }
    }
    eprintln!(
        "wrote {} ({} · d_model {} · {} layers · vocab {} · {:.1} M parameters in {})",
        a.out.display(),
        weights.kind().name(),
        a.d_model,
        a.layers,
        a.vocab,
        weights.param_count() as f64 / 1e6,
        a.dtype
    );
    Ok(())
}
