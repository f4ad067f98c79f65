//! The mixers: one folder each, holding its maths (module doc, in the notation of its
//! spec under `docs/spec/`), its token-by-token reference, its fast CPU paths, its CUDA
//! launches and kernels, its backward and its tests.
//!
//! The family is data: [`MixerKind`] is read from the config, and everything the engine
//! needs to know about a mixer without running it — its parameters ([`MixerWeights`]),
//! the per-layer state it carries ([`MixerWeights::state_layout`]), the sizes of its
//! language model ([`LmDims`]) — is asked of it here. This file is the one place a mixer
//! is registered; the engine's backends (`engine/cpu*.rs`, `engine/cuda/`) say which
//! mixers each runs.

pub mod family;
pub mod family_synthetic;
pub mod mamba1;
pub mod mamba2;
pub mod mamba3;
pub mod mimo;

use crate::error::{Error, Result};
use crate::mixers::family::FamilyWeights;
use crate::mixers::mamba1::weights::Mamba1Weights;
use crate::mixers::mamba2::weights::Mamba2Weights;
use crate::mixers::mamba3::Weights;
use crate::model::family_config::{detect_family, parse_json_lenient, FamilyKind};
use crate::model::state_layout::StateLayout;
use crate::model::tensor_file::{write_safetensors, RawTensor};
use crate::model::weights::{fingerprint_tensor, fingerprint_values, Fnv};
use crate::model::{DType, Matrix};
use mimo::MimoWeights;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which positions' logits (or hidden rows) a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWant {
    /// every position of every sequence
    All,
    /// the last position of each sequence
    Last,
    /// none (only advance the states)
    None,
}

/// Which mixer a model's layers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MixerKind {
    /// Mamba-3, single input single output (`layer = "Mamba3"`, `is_mimo = false`).
    Mamba3Siso,
    /// Mamba-3 MIMO (`layer = "Mamba3"`, `is_mimo = true`).
    Mamba3Mimo,
    /// Mamba-1 and FalconMamba (official `layer` absent or `"Mamba1"`; transformers
    /// `model_type` `mamba` or `falcon_mamba`).
    Mamba1,
    /// Mamba-2 (official `layer = "Mamba2"`; transformers `model_type = "mamba2"`).
    Mamba2,
}

impl MixerKind {
    /// The mixer a `config.json` (either layout) names, without validating the rest.
    pub fn detect(text: &str, origin: &str) -> Result<MixerKind> {
        Ok(match detect_family(text, origin)? {
            FamilyKind::Mamba1 => MixerKind::Mamba1,
            FamilyKind::Mamba2 => MixerKind::Mamba2,
            FamilyKind::Mamba3 => {
                let root = parse_json_lenient(text).map_err(|e| Error::Config {
                    path: origin.into(),
                    msg: format!("not valid JSON: {e}"),
                })?;
                match root.pointer("/ssm_cfg/is_mimo") {
                    Some(serde_json::Value::Bool(true)) => MixerKind::Mamba3Mimo,
                    _ => MixerKind::Mamba3Siso,
                }
            }
        })
    }

    /// The mixer of the model folder (or weights file) at `path`, from its `config.json`.
    pub fn of_path(path: &Path) -> Result<MixerKind> {
        if !path.is_file() && !path.is_dir() {
            return Err(Error::input(format!(
                "model path {} does not exist (expected a directory holding config.json and \
                 model.safetensors, pytorch_model.bin or model.safetensors.index.json)",
                path.display()
            )));
        }
        let config = config_path(path);
        let text = std::fs::read_to_string(&config).map_err(|e| Error::io(&config, e))?;
        MixerKind::detect(&text, &config.display().to_string())
    }

    /// The name used in messages, state files and `--family`.
    pub fn name(self) -> &'static str {
        match self {
            MixerKind::Mamba3Siso => "mamba3",
            MixerKind::Mamba3Mimo => "mamba3-mimo",
            MixerKind::Mamba1 => "mamba1",
            MixerKind::Mamba2 => "mamba2",
        }
    }
}

/// The sizes of the language model around the mixers, the same for every mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmDims {
    pub d_model: usize,
    pub n_layer: usize,
    /// token ids below this are valid
    pub vocab_size: usize,
    /// rows of the embedding and of each position's logits
    pub vocab_padded: usize,
}

/// A model's parameters, whichever its mixer.
#[derive(Clone, Debug)]
pub enum MixerWeights {
    Mamba3(Arc<Weights>),
    Mimo(Arc<MimoWeights>),
    Mamba1(Arc<Mamba1Weights>),
    Mamba2(Arc<Mamba2Weights>),
}

impl MixerWeights {
    /// Load a model folder (or a weights file with `config.json` beside it) of any mixer
    /// and either file layout, matrices in `dtype`.
    /// Every loader checks each tensor's name, shape, dtype and finiteness as it reads it.
    pub fn load(path: &Path, dtype: DType) -> Result<MixerWeights> {
        Ok(match MixerKind::of_path(path)? {
            MixerKind::Mamba3Siso => MixerWeights::Mamba3(Arc::new(Weights::load(path, dtype)?)),
            MixerKind::Mamba3Mimo => MixerWeights::Mimo(Arc::new(MimoWeights::load(path, dtype)?)),
            MixerKind::Mamba1 | MixerKind::Mamba2 => match FamilyWeights::load(path, dtype)? {
                FamilyWeights::Mamba1(w) => MixerWeights::Mamba1(Arc::new(w)),
                FamilyWeights::Mamba2(w) => MixerWeights::Mamba2(Arc::new(w)),
            },
        })
    }

    pub fn kind(&self) -> MixerKind {
        match self {
            MixerWeights::Mamba3(_) => MixerKind::Mamba3Siso,
            MixerWeights::Mimo(_) => MixerKind::Mamba3Mimo,
            MixerWeights::Mamba1(_) => MixerKind::Mamba1,
            MixerWeights::Mamba2(_) => MixerKind::Mamba2,
        }
    }

    /// The Mamba-3 SISO parameters, if that is the mixer.
    pub fn mamba3(&self) -> Option<&Arc<Weights>> {
        match self {
            MixerWeights::Mamba3(w) => Some(w),
            _ => None,
        }
    }

    pub fn lm_dims(&self) -> LmDims {
        match self {
            MixerWeights::Mamba3(w) => LmDims {
                d_model: w.dims.d_model,
                n_layer: w.dims.n_layer,
                vocab_size: w.dims.vocab_size,
                vocab_padded: w.dims.vocab_padded,
            },
            MixerWeights::Mimo(w) => LmDims {
                d_model: w.dims.d_model,
                n_layer: w.dims.n_layer,
                vocab_size: w.dims.vocab_size,
                vocab_padded: w.dims.vocab_padded,
            },
            MixerWeights::Mamba1(w) => family_dims(&w.config),
            MixerWeights::Mamba2(w) => family_dims(&w.config),
        }
    }

    /// The dtype of the matrices.
    pub fn dtype(&self) -> DType {
        match self {
            MixerWeights::Mamba3(w) => w.dtype,
            MixerWeights::Mimo(w) => w.dtype,
            MixerWeights::Mamba1(w) => w.dtype,
            MixerWeights::Mamba2(w) => w.dtype,
        }
    }

    /// The named tensors one sequence's state holds per layer.
    pub fn state_layout(&self) -> StateLayout {
        match self {
            MixerWeights::Mamba3(w) => mamba3::state::layout(&w.dims),
            MixerWeights::Mimo(w) => mimo::layout(&w.dims),
            MixerWeights::Mamba1(w) => mamba1::layout(
                w.config.mamba1().expect("a Mamba-1 config"),
                w.config.n_layer,
            ),
            MixerWeights::Mamba2(w) => mamba2::layout(
                w.config.mamba2().expect("a Mamba-2 config"),
                w.config.n_layer,
            ),
        }
    }

    /// Every parameter tensor, by name (the official names where the mixer has them).
    fn tensors(&self) -> Vec<(String, Param<'_>)> {
        let mut out = Vec::new();
        match self {
            MixerWeights::Mamba3(w) => {
                for (name, t) in w.to_tensors() {
                    out.push((name, Param::Count(t.numel())));
                }
            }
            MixerWeights::Mimo(w) => {
                out.push(("embedding".into(), Param::Matrix(&w.embedding)));
                out.push(("norm_f".into(), Param::flat(&w.norm_f)));
                if let Some(h) = &w.lm_head {
                    out.push(("lm_head".into(), Param::Matrix(h)));
                }
                for (i, l) in w.layers.iter().enumerate() {
                    let n = |s: &str| format!("{i}.{s}");
                    for (s, m) in [("in_proj", &l.in_proj), ("out_proj", &l.out_proj)] {
                        out.push((n(s), Param::Matrix(m)));
                    }
                    for (s, v) in [
                        ("norm", &l.norm),
                        ("dt_bias", &l.dt_bias),
                        ("B_bias", &l.b_bias),
                        ("C_bias", &l.c_bias),
                        ("B_norm", &l.b_norm),
                        ("C_norm", &l.c_norm),
                        ("mimo_x", &l.mimo_x),
                        ("mimo_z", &l.mimo_z),
                        ("mimo_o", &l.mimo_o),
                        ("D", &l.d),
                    ] {
                        out.push((n(s), Param::flat(v)));
                    }
                    if let Some(v) = &l.out_norm {
                        out.push((n("out_norm"), Param::flat(v)));
                    }
                    if let Some(m) = &l.mlp {
                        out.push((n("mlp.norm"), Param::flat(&m.norm)));
                        out.push((n("mlp.fc1"), Param::Matrix(&m.fc1)));
                        out.push((n("mlp.fc2"), Param::Matrix(&m.fc2)));
                    }
                }
            }
            MixerWeights::Mamba1(w) => {
                let c = w.config.mamba1().expect("a Mamba-1 config");
                let (di, n, k) = (c.d_inner, c.d_state, c.d_conv);
                let dm = w.config.d_model;
                lm_tensors(w, &mut out, |m, push| {
                    push("in_proj.weight", Param::Matrix(&m.in_proj));
                    push(
                        "conv1d.weight",
                        Param::Vector(&m.conv_weight, vec![di, 1, k]),
                    );
                    push("x_proj.weight", Param::Matrix(&m.x_proj));
                    push("dt_proj.weight", Param::Matrix(&m.dt_proj));
                    push("dt_proj.bias", Param::Vector(&m.dt_bias, vec![di]));
                    push("A_log", Param::Vector(&m.a_log, vec![di, n]));
                    push("D", Param::Vector(&m.d, vec![di]));
                    push("out_proj.weight", Param::Matrix(&m.out_proj));
                    for (s, v, len) in [
                        ("in_proj.bias", &m.in_proj_bias, 2 * di),
                        ("conv1d.bias", &m.conv_bias, di),
                        ("out_proj.bias", &m.out_proj_bias, dm),
                    ] {
                        if let Some(v) = v {
                            push(s, Param::Vector(v, vec![len]));
                        }
                    }
                });
            }
            MixerWeights::Mamba2(w) => {
                let c = w.config.mamba2().expect("a Mamba-2 config");
                let (cd, k, h, dm) = (c.conv_dim(), c.d_conv, c.nheads, w.config.d_model);
                lm_tensors(w, &mut out, |m, push| {
                    push("in_proj.weight", Param::Matrix(&m.in_proj));
                    push(
                        "conv1d.weight",
                        Param::Vector(&m.conv_weight, vec![cd, 1, k]),
                    );
                    push("dt_bias", Param::Vector(&m.dt_bias, vec![h]));
                    push("A_log", Param::Vector(&m.a_log, vec![h]));
                    push("D", Param::Vector(&m.d, vec![m.d.len()]));
                    push("out_proj.weight", Param::Matrix(&m.out_proj));
                    for (s, v, len) in [
                        ("norm.weight", &m.norm, c.d_ssm),
                        ("in_proj.bias", &m.in_proj_bias, c.d_in_proj()),
                        ("conv1d.bias", &m.conv_bias, cd),
                        ("out_proj.bias", &m.out_proj_bias, dm),
                    ] {
                        if let Some(v) = v {
                            push(s, Param::Vector(v, vec![len]));
                        }
                    }
                });
            }
        }
        out
    }

    /// Write a Mamba-1 or Mamba-2 model as an official folder: `config_json` (its
    /// `MambaConfig`, which must describe these weights: it is read back and checked) and
    /// `model.safetensors` under the official names.
    pub fn save_official(&self, dir: &Path, config_json: &str) -> Result<()> {
        if !matches!(self, MixerWeights::Mamba1(_) | MixerWeights::Mamba2(_)) {
            return Err(Error::input(format!(
                "save_official writes Mamba-1 and Mamba-2 models, not {}",
                self.kind().name()
            )));
        }
        let mut tensors = Vec::new();
        for (name, p) in self.tensors() {
            let raw = match p {
                Param::Matrix(m) => RawTensor::from_data(vec![m.rows, m.cols], &m.data),
                Param::Vector(v, shape) => RawTensor::from_f32(shape, v),
                Param::Count(_) => unreachable!("Mamba-3 only"),
            };
            tensors.push((name, raw));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        crate::atomic::write(&dir.join("config.json"), config_json.as_bytes())?;
        write_safetensors(&dir.join("model.safetensors"), &tensors, None)?;
        let back = MixerWeights::load(dir, self.dtype())?;
        if back.fingerprint() != self.fingerprint() {
            return Err(Error::input(
                "the config given does not describe these weights (they read back differently)",
            ));
        }
        Ok(())
    }

    /// Parameters (a tied head counted once).
    pub fn param_count(&self) -> usize {
        self.tensors().iter().map(|(_, p)| p.len()).sum()
    }

    /// A hash of the config and of samples of every parameter: states are refused by a
    /// model with another fingerprint.
    pub fn fingerprint(&self) -> u64 {
        if let MixerWeights::Mamba3(w) = self {
            return w.fingerprint;
        }
        let config = match self {
            MixerWeights::Mimo(w) => format!("{:?}", w.dims),
            MixerWeights::Mamba1(w) => format!("{:?}", w.config.mixer),
            MixerWeights::Mamba2(w) => format!("{:?}", w.config.mixer),
            MixerWeights::Mamba3(_) => unreachable!("returned above"),
        };
        let mut h = Fnv::new()
            .bytes(self.kind().name().as_bytes())
            .bytes(config.as_bytes())
            .u64(self.lm_dims().vocab_padded as u64);
        for (name, p) in self.tensors() {
            h = match p {
                Param::Matrix(m) => fingerprint_tensor(h, &name, &m.data),
                Param::Vector(v, _) => fingerprint_values(h, &name, v.len(), |i| v[i] as f64),
                Param::Count(n) => h.bytes(name.as_bytes()).u64(n as u64),
            };
        }
        h.0
    }
}

/// One parameter tensor, for counting, fingerprints and saving.
enum Param<'a> {
    Matrix(&'a Matrix),
    /// f32 values and their shape
    Vector(&'a [f32], Vec<usize>),
    /// only its size (Mamba-3 has its own fingerprint and writer)
    Count(usize),
}

impl<'a> Param<'a> {
    fn flat(v: &'a [f32]) -> Param<'a> {
        Param::Vector(v, vec![v.len()])
    }
    fn len(&self) -> usize {
        match self {
            Param::Matrix(m) => m.rows * m.cols,
            Param::Vector(v, _) => v.len(),
            Param::Count(n) => *n,
        }
    }
}

/// The LM's own tensors, then each block's norm and (through `mixer`) its mixer's, under
/// their official names.
fn lm_tensors<'a, M>(
    w: &'a crate::model::family_weights::LmWeights<M>,
    out: &mut Vec<(String, Param<'a>)>,
    mixer: impl Fn(&'a M, &mut dyn FnMut(&str, Param<'a>)),
) {
    out.push((
        "backbone.embedding.weight".into(),
        Param::Matrix(&w.embedding),
    ));
    out.push(("backbone.norm_f.weight".into(), Param::flat(&w.norm_f)));
    if let Some(h) = &w.lm_head {
        out.push(("lm_head.weight".into(), Param::Matrix(h)));
    }
    for (i, b) in w.layers.iter().enumerate() {
        out.push((
            format!("backbone.layers.{i}.norm.weight"),
            Param::flat(&b.norm),
        ));
        mixer(&b.mixer, &mut |s, p| {
            out.push((format!("backbone.layers.{i}.mixer.{s}"), p))
        });
    }
}

fn family_dims(c: &crate::model::family_config::FamilyConfig) -> LmDims {
    LmDims {
        d_model: c.d_model,
        n_layer: c.n_layer,
        vocab_size: c.vocab_size.min(c.vocab_padded),
        vocab_padded: c.vocab_padded,
    }
}

/// `config.json` of a model folder, or beside a weights file.
pub fn config_path(path: &Path) -> PathBuf {
    if path.is_file() {
        path.parent().unwrap_or(Path::new(".")).join("config.json")
    } else {
        path.join("config.json")
    }
}
