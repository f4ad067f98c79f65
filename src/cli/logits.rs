//! `mamba3 logits`: the engine's outputs for one token sequence, for outside checks.
//!
//! The sequence can be read in one prefill, as consecutive continued windows
//! (`--windows`), or as a prefill followed by one-token decode steps (`--decode-from`).
//! Writes `logits [T, vocab_padded]` f32 and, with `--states-after P`, the state after
//! `P` tokens as `state.{l}.angle|ssm|k|v`.

use super::{PathArg, RunOpts};
use crate::engine::{LogitsWant, Model};
use crate::error::{Error, Result};
use crate::model::tensor_file::{write_safetensors, RawTensor, TensorFile};
use std::path::Path;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (the built-in default model when not given).
    #[arg(long)]
    pub model: Option<PathArg>,
    /// Token ids: a safetensors file with tensor `input_ids` (any integer dtype) or a JSON array.
    #[arg(long)]
    pub input_ids: PathArg,
    /// Output safetensors file.
    #[arg(long)]
    pub out: PathArg,
    /// Read the prefill as consecutive continued windows ending at these positions.
    #[arg(long)]
    pub windows: Option<super::List>,
    /// Prefill this many tokens, then decode the rest one token at a time.
    #[arg(long)]
    pub decode_from: Option<usize>,
    /// Also write the state after this many tokens.
    #[arg(long)]
    pub states_after: Option<usize>,
    #[command(flatten)]
    pub run: RunOpts,
}

/// Token ids from a safetensors file (`input_ids`), a JSON file, or the JSON array given
/// inline (`--input-ids '[1, 2, 3]'`, when no file has that name).
pub fn read_input_ids(path: &Path) -> Result<Vec<i64>> {
    let inline = path
        .to_str()
        .filter(|s| s.trim_start().starts_with('[') && !path.exists());
    let bytes = match inline {
        Some(s) => s.as_bytes().to_vec(),
        None => std::fs::read(path).map_err(|e| Error::io(path, e))?,
    };
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace()).copied();
    if matches!(first, Some(b'[') | Some(b'{')) {
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| Error::input(format!("{}: not valid JSON: {e}", path.display())))?;
        let v = match &v {
            serde_json::Value::Object(m) => m.get("input_ids").cloned().ok_or_else(|| {
                Error::input(format!(
                    "{}: JSON object without `input_ids`",
                    path.display()
                ))
            })?,
            _ => v,
        };
        let arr = match v {
            serde_json::Value::Array(a) if a.len() == 1 && a[0].is_array() => {
                a[0].as_array().cloned().unwrap_or_default()
            }
            serde_json::Value::Array(a) => a,
            other => {
                return Err(Error::input(format!(
                    "{}: expected a JSON array of token ids, found {other}",
                    path.display()
                )))
            }
        };
        return arr
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_i64().ok_or_else(|| {
                    Error::input(format!(
                        "{}: element {i} is {x}, expected an integer token id",
                        path.display()
                    ))
                })
            })
            .collect();
    }
    let file = TensorFile::open(path)?;
    let raw = file.get("input_ids").ok_or_else(|| {
        Error::input(format!(
            "{}: no tensor `input_ids` (found: {})",
            path.display(),
            file.names().join(", ")
        ))
    })?;
    raw.to_i64("input_ids")
}

/// Check ids against the vocabulary and convert.
pub fn to_tokens(ids: &[i64], vocab: usize) -> Result<Vec<u32>> {
    if ids.is_empty() {
        return Err(Error::input(
            "input_ids is empty: expected at least one token",
        ));
    }
    ids.iter()
        .enumerate()
        .map(|(pos, &id)| {
            if id < 0 {
                // Shown as given, not as the unsigned number it would wrap to.
                Err(Error::input(format!(
                    "token id {id} at position {pos} is negative: token ids are 0..{vocab}"
                )))
            } else if id as u64 >= vocab as u64 {
                Err(Error::TokenOutOfRange {
                    id: id as u64,
                    pos,
                    vocab,
                })
            } else {
                Ok(id as u32)
            }
        })
        .collect()
}

pub fn run(a: Args) -> Result<()> {
    crate::atomic::refuse_model_file(&a.out, "--out")?;
    crate::atomic::check_writable(&a.out, "--out")?;
    a.run.init_threads();
    let model_dir = crate::model::default_model::resolve(a.model.as_deref())?;
    let model = Model::load(&model_dir, a.run.device.resolve(), a.run.dtype)?;
    let tokens = to_tokens(&read_input_ids(&a.input_ids)?, model.dims().vocab_size)?;
    let t_len = tokens.len();
    let prefill_end = a.decode_from.unwrap_or(t_len);
    if prefill_end > t_len {
        return Err(Error::input(format!(
            "--decode-from {prefill_end} is past the end of the {t_len} tokens"
        )));
    }
    if let Some(p) = a.states_after {
        if p == 0 || p > t_len {
            return Err(Error::input(format!(
                "--states-after {p}: expected 1..={t_len}"
            )));
        }
    }
    // Window ends: the user's, the decode start and the state point, then the end.
    let mut ends: Vec<usize> = a.windows.clone().map(|l| l.0).unwrap_or_default();
    for (i, &e) in ends.iter().enumerate() {
        if e == 0 || e > prefill_end || (i > 0 && e <= ends[i - 1]) {
            return Err(Error::input(format!(
                "--windows must be increasing positions in 1..={prefill_end}, found {:?}",
                ends
            )));
        }
    }
    ends.push(prefill_end);
    ends.extend(a.states_after.filter(|&p| p <= prefill_end));
    ends.sort_unstable();
    ends.dedup();
    ends.retain(|&e| e > 0);

    let mut state = model.new_state();
    let mut logits: Vec<f32> = Vec::with_capacity(t_len * model.dims().vocab_padded);
    let mut saved = None;
    let mut start = 0;
    for &end in &ends {
        logits.extend(
            model
                .prefill(&tokens[start..end], &mut state, LogitsWant::All)?
                .data,
        );
        start = end;
        if a.states_after == Some(end) {
            saved = Some(state.tensors()?);
        }
    }
    for (i, &t) in tokens.iter().enumerate().skip(prefill_end) {
        logits.extend(model.decode(&[t], &mut [&mut state])?.data);
        if a.states_after == Some(i + 1) {
            saved = Some(state.tensors()?);
        }
    }
    let mut out = vec![(
        "logits".to_string(),
        RawTensor::from_f32(vec![t_len, model.dims().vocab_padded], &logits),
    )];
    out.extend(saved.unwrap_or_default());
    out.sort_by(|x, y| x.0.cmp(&y.0));
    write_safetensors(&a.out, &out, None)?;
    eprintln!(
        "wrote {} ({} positions, {} windows, {} decode steps)",
        a.out.display(),
        t_len,
        ends.len(),
        t_len - prefill_end
    );
    Ok(())
}
