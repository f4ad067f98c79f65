//! `mamba3 convert`: rewrite a checkpoint (the official `pytorch_model.bin`, shards, or
//! another safetensors file) as one `model.safetensors`, after checking every tensor
//! against the config. Mamba-3 SISO keeps exactly the official tensors; the other mixers
//! keep every stored tensor under its stored name (so a transformers folder stays one).

use super::PathArg;
use crate::error::{Error, Result};
use crate::mixers::mamba3::weights::expected_tensors;
use crate::mixers::mamba3::Weights;
use crate::mixers::{MixerKind, MixerWeights};
use crate::model::shards::TensorSource;
use crate::model::tensor_file::{write_safetensors, DiskDType, RawTensor, TensorFile};
use crate::model::weights::locate;
use crate::model::{Config, DType};
use std::path::Path;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory or weights file (config.json must sit beside it).
    #[arg(long)]
    pub model: PathArg,
    /// Output: a `.safetensors` file, or a directory to receive model.safetensors,
    /// config.json and any tokenizer files.
    #[arg(long)]
    pub out: PathArg,
    /// Convert float tensors to this dtype (default: keep each tensor's dtype).
    #[arg(long)]
    pub dtype: Option<DType>,
}

pub fn run(a: Args) -> Result<()> {
    if MixerKind::of_path(&a.model)? != MixerKind::Mamba3Siso {
        return repack(&a);
    }
    let (config_path, weights_path) = locate(&a.model)?;
    check_out(&a.out, &config_path)?;
    let config = Config::from_file(&config_path)?;
    let file = TensorFile::open(&weights_path)?;
    // Full check of names, shapes and dtypes against the config.
    Weights::from_tensor_file(config.clone(), &file, DType::F32)?;
    let mut tensors: Vec<(String, RawTensor)> = Vec::new();
    for (name, _) in expected_tensors(&config) {
        let raw = file.get(&name).expect("checked above");
        tensors.push((name.clone(), convert_raw(raw, &name, a.dtype)?));
    }
    write_out(&a, &config_path, &weights_path, tensors)
}

/// Any other mixer: every stored tensor, checked first by loading the model.
fn repack(a: &Args) -> Result<()> {
    MixerWeights::load(&a.model, DType::F32)?;
    let config_path = crate::mixers::config_path(&a.model);
    check_out(&a.out, &config_path)?;
    let src = TensorSource::open(&a.model)?;
    let mut tensors: Vec<(String, RawTensor)> = Vec::new();
    for name in src.names() {
        let raw = src.get(&name).expect("a stored name");
        tensors.push((name.clone(), convert_raw(raw, &name, a.dtype)?));
    }
    write_out(a, &config_path, src.origin(), tensors)
}

/// A tensor in `dtype` if it is a float tensor of another dtype, else as stored.
fn convert_raw(raw: RawTensor, name: &str, dtype: Option<DType>) -> Result<RawTensor<'static>> {
    Ok(match (dtype, raw.dtype) {
        (Some(to), DiskDType::Float(from)) if to != from => {
            RawTensor::from_data(raw.shape.clone(), &raw.to_float(name, to)?)
        }
        _ => RawTensor {
            dtype: raw.dtype,
            shape: raw.shape.clone(),
            bytes: std::borrow::Cow::Owned(raw.bytes.into_owned()),
        },
    })
}

/// Write `tensors` (sorted by name) to `--out`: a file, or a folder that also receives the
/// config and tokenizer files.
fn write_out(
    a: &Args,
    config_path: &Path,
    weights_path: &Path,
    mut tensors: Vec<(String, RawTensor)>,
) -> Result<()> {
    tensors.sort_by(|x, y| x.0.cmp(&y.0));
    let is_file = a.out.extension().is_some_and(|e| e == "safetensors");
    let target = if is_file {
        a.out.clone()
    } else {
        std::fs::create_dir_all(&a.out).map_err(|e| Error::io(&a.out, e))?;
        copy_beside(config_path, &a.out)?;
        if let Some(dir) = config_path.parent() {
            for extra in [
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
            ] {
                let p = dir.join(extra);
                if p.is_file() {
                    copy_beside(&p, &a.out)?;
                }
            }
        }
        a.out.join("model.safetensors")
    };
    write_safetensors(&target, &tensors, None)?;
    let bytes: usize = tensors.iter().map(|(_, t)| t.bytes.len()).sum();
    eprintln!(
        "wrote {} ({} tensors, {:.2} MiB) from {}",
        target.display(),
        tensors.len(),
        bytes as f64 / (1u64 << 20) as f64,
        weights_path.display()
    );
    Ok(())
}

/// Refuse, before reading any tensor, an output that would replace a file: a model's
/// weights or config are never overwritten (delete them first to convert again).
fn check_out(out: &Path, config_path: &Path) -> Result<()> {
    let is_file = out.extension().is_some_and(|e| e == "safetensors");
    if is_file {
        crate::atomic::refuse_model_file(out, "--out")?;
        if out.exists() {
            return Err(Error::input(format!(
                "--out {}: the file exists; refusing to overwrite it (remove it first)",
                out.display()
            )));
        }
        return crate::atomic::check_writable(out, "--out");
    }
    let target = out.join("model.safetensors");
    if target.exists() {
        return Err(Error::input(format!(
            "--out {}: the folder already holds model.safetensors; refusing to overwrite it \
             (remove it first or give another folder)",
            out.display()
        )));
    }
    let cfg = out.join("config.json");
    if cfg.exists() && cfg.canonicalize().ok() != config_path.canonicalize().ok() {
        return Err(Error::input(format!(
            "--out {}: the folder already holds another model's config.json; refusing to \
             overwrite it",
            out.display()
        )));
    }
    Ok(())
}

fn copy_beside(src: &Path, dir: &Path) -> Result<()> {
    let dst = dir.join(src.file_name().unwrap_or_default());
    if src.canonicalize().ok() == dst.canonicalize().ok() {
        return Ok(());
    }
    if dst.exists() {
        // A tokenizer file beside an earlier model is left alone.
        eprintln!("note: {} exists; kept as it is", dst.display());
        return Ok(());
    }
    let bytes = std::fs::read(src).map_err(|e| Error::io(src, e))?;
    crate::atomic::write(&dst, &bytes)
}
