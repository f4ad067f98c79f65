//! `mamba3 inspect`: what a model is and what it costs.

use super::PathArg;
use crate::error::Result;
use crate::mixers::mamba3::Weights;
use crate::mixers::{MixerKind, MixerWeights};
use crate::model::tensor_file::TensorFile;
use crate::model::weights::locate;
use crate::model::DType;
use std::path::Path;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json + model.safetensors or pytorch_model.bin); the
    /// built-in default model when not given.
    #[arg(long)]
    pub model: Option<PathArg>,
    /// Dtype to account the memory footprint in.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
}

pub fn run(a: Args) -> Result<()> {
    let model = crate::model::default_model::resolve(a.model.as_deref())?;
    if MixerKind::of_path(&model)? != MixerKind::Mamba3Siso {
        return family(&model, &MixerWeights::load(&model, a.dtype)?);
    }
    let (config_path, weights_path) = locate(&model)?;
    let file = TensorFile::open(&weights_path)?;
    let disk_dtypes: std::collections::BTreeSet<String> = file
        .names()
        .iter()
        .filter_map(|n| file.get(n).map(|t| t.dtype.to_string()))
        .collect();
    let w = Weights::from_tensor_file(
        crate::model::Config::from_file(&config_path)?,
        &file,
        a.dtype,
    )?;
    let d = &w.dims;
    let gib = |b: usize| b as f64 / (1u64 << 20) as f64;
    match &a.model {
        Some(m) => println!("model        {}", m.display()),
        None => println!(
            "model        {} ({})",
            model.display(),
            crate::model::default_model::DESCRIPTION
        ),
    }
    println!(
        "weights      {} (on disk: {})",
        weights_path.display(),
        disk_dtypes.into_iter().collect::<Vec<_>>().join(", ")
    );
    println!("fingerprint  {:016x}", w.fingerprint);
    println!(
        "shape        d_model {} · layers {} · d_inner {} · heads {}×{} · d_state {} · groups {} · rope angles {}",
        d.d_model, d.n_layer, d.d_inner, d.nheads, d.headdim, d.d_state, d.ngroups, d.num_rope_angles
    );
    println!(
        "             vocab {} (padded {}) · mlp hidden {} · chunk {} · outproj norm {} · tied head {}",
        d.vocab_size, d.vocab_padded, d.mlp_hidden, d.chunk_len, w.config.ssm_cfg.is_outproj_norm, w.config.tie_embeddings
    );
    println!(
        "parameters   {} ({:.2} M)",
        w.param_count(),
        w.param_count() as f64 / 1e6
    );
    println!(
        "memory       {:.2} MiB of weights in {}",
        gib(w.bytes()),
        a.dtype
    );
    print_state(&crate::mixers::mamba3::state::layout(d), gib);
    println!("config\n{}", w.config.to_json());
    Ok(())
}

/// The summary of a model of another mixer than Mamba-3 SISO.
fn family(path: &Path, w: &MixerWeights) -> Result<()> {
    let d = w.lm_dims();
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    println!("model        {}", path.display());
    println!("mixer        {}", w.kind().name());
    println!("fingerprint  {:016x}", w.fingerprint());
    println!(
        "shape        d_model {} · layers {} · vocab {} (padded {})",
        d.d_model, d.n_layer, d.vocab_size, d.vocab_padded
    );
    match w {
        MixerWeights::Mimo(m) => println!("mixer dims   {:?}", m.dims),
        MixerWeights::Mamba1(m) => println!("config       {:?}", m.config),
        MixerWeights::Mamba2(m) => println!("config       {:?}", m.config),
        MixerWeights::Mamba3(_) => {}
    }
    let n = w.param_count();
    println!(
        "parameters   {n} ({:.2} M), matrices in {}",
        n as f64 / 1e6,
        w.dtype()
    );
    print_state(&w.state_layout(), mib);
    Ok(())
}

/// A sequence's state on a device, with its `ssm` tensor in f32 and in 16 bits
/// (`--state-dtype bf16|f16`).
fn print_state(layout: &crate::model::state_layout::StateLayout, mib: impl Fn(usize) -> f64) {
    let half = layout
        .clone()
        .with_state_dtype(crate::model::DType::BF16)
        .map_or(0, |l| l.device_bytes());
    println!(
        "state        {:.3} MiB per sequence with an f32 ssm, {:.3} MiB with --state-dtype bf16|f16 ({})",
        mib(layout.device_bytes()),
        mib(half),
        layout.describe()
    );
}
