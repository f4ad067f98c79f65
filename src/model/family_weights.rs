//! Parameters of a Mamba-1 (or FalconMamba) or Mamba-2 language model, read from the
//! official or the transformers layout (spec §2.2, §3.2, §4, §5.2) and checked against the
//! config, each mismatch an error naming the tensor, the shape expected and the one found.
//!
//! Names: the embedding is `backbone.embedding.weight` (official) or
//! `backbone.embeddings.weight` (transformers); everything else is named alike. A tied head
//! may be stored twice (`torch.save`), once, or once with a metadata alias; a missing
//! `lm_head.weight` with `tie_embeddings` is normal. A `model.` prefix on every name (as in
//! Mistral's consolidated files) is accepted.
//!
//! Storage follows `weights.rs`: matrices that matmuls stream (`*proj.weight`, embedding,
//! head) in the dtype asked for; vectors, conv taps and `A_log` in f32 — the official
//! models keep `A_log`/`D` fp32 anyway, and every dtype a file may hold widens to f32
//! exactly (f64 files round once). Tensors of mixed dtypes in one file are fine.

use crate::error::{Error, Result};
use crate::model::dtype::DType;
use crate::model::family_config::{FamilyConfig, Mamba1Config, Mamba2Config, MixerConfig};
use crate::model::shards::TensorSource;
use crate::model::tensor_file::DiskDType;
use crate::model::weights::Matrix;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// One residual block: its pre-norm weight and its mixer.
#[derive(Clone, Debug, PartialEq)]
pub struct Block<M> {
    /// block `norm.weight` `[D_m]`
    pub norm: Vec<f32>,
    pub mixer: M,
}

/// The language model around the mixers (spec §1), generic over the mixer's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct LmWeights<M> {
    pub config: FamilyConfig,
    /// dtype of the matrices
    pub dtype: DType,
    /// `[vocab_padded, D_m]`
    pub embedding: Matrix,
    pub layers: Vec<Block<M>>,
    /// `[D_m]`
    pub norm_f: Vec<f32>,
    /// `[vocab_padded, D_m]`; `None` when tied to the embedding
    pub lm_head: Option<Matrix>,
}

impl<M> LmWeights<M> {
    /// The head matrix (the embedding when tied).
    pub fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }
}

/// Mamba-1 mixer parameters (spec §2.2), `in_proj`/`out_proj`/`x_proj`/`dt_proj` as
/// PyTorch `[out, in]` matrices.
#[derive(Clone, Debug, PartialEq)]
pub struct Mamba1Mixer {
    /// `[2·D_i, D_m]`: rows `0..D_i` give x, `D_i..2·D_i` give z
    pub in_proj: Matrix,
    pub in_proj_bias: Option<Vec<f32>>,
    /// `conv1d.weight` `[D_i, 1, K]` as `[D_i, K]`
    pub conv_weight: Vec<f32>,
    /// `[D_i]`
    pub conv_bias: Option<Vec<f32>>,
    /// `[R + 2N, D_i]`: δ rows, then B, then C
    pub x_proj: Matrix,
    /// `[D_i, R]`
    pub dt_proj: Matrix,
    /// `dt_proj.bias` `[D_i]`, the Δ bias
    pub dt_bias: Vec<f32>,
    /// `[D_i, N]`
    pub a_log: Vec<f32>,
    /// `[D_i]`
    pub d: Vec<f32>,
    /// `[D_m, D_i]`
    pub out_proj: Matrix,
    pub out_proj_bias: Option<Vec<f32>>,
}

/// Mamba-2 mixer parameters (spec §3.2).
#[derive(Clone, Debug, PartialEq)]
pub struct Mamba2Mixer {
    /// `[d_in_proj, D_m]`: rows z0, x0 (d_mlp each), z (d_ssm), x, B, C, dt
    pub in_proj: Matrix,
    pub in_proj_bias: Option<Vec<f32>>,
    /// `conv1d.weight` `[C_d, 1, K]` as `[C_d, K]`
    pub conv_weight: Vec<f32>,
    /// `[C_d]`
    pub conv_bias: Option<Vec<f32>>,
    /// `[H]`
    pub dt_bias: Vec<f32>,
    /// `[H]`
    pub a_log: Vec<f32>,
    /// `[H]`, or `[d_ssm]` with `D_has_hdim`
    pub d: Vec<f32>,
    /// gated norm weight `[d_ssm]`, present iff `rmsnorm`
    pub norm: Option<Vec<f32>>,
    /// `[D_m, D_i]`
    pub out_proj: Matrix,
    pub out_proj_bias: Option<Vec<f32>>,
}

pub type Mamba1Weights = LmWeights<Mamba1Mixer>;
pub type Mamba2Weights = LmWeights<Mamba2Mixer>;

/// Either family, as loaded from a folder.
#[derive(Clone, Debug, PartialEq)]
pub enum FamilyWeights {
    Mamba1(Mamba1Weights),
    Mamba2(Mamba2Weights),
}

impl FamilyWeights {
    /// Load a model folder (config.json + weights of either layout, possibly sharded), or a
    /// weights file / shard index with `config.json` beside it.
    pub fn load(path: &Path, dtype: DType) -> Result<FamilyWeights> {
        let (config_path, weights_path) = locate(path)?;
        let config = FamilyConfig::from_file(&config_path)?;
        let src = TensorSource::open(&weights_path)?;
        Self::from_source(config, &src, dtype)
    }

    pub fn from_source(
        config: FamilyConfig,
        src: &TensorSource,
        dtype: DType,
    ) -> Result<FamilyWeights> {
        let dm = config.d_model;
        Ok(match config.mixer.clone() {
            MixerConfig::Mamba1(m) => {
                FamilyWeights::Mamba1(load_lm(config, src, dtype, |r, l| {
                    mamba1_mixer(r, l, dm, &m)
                })?)
            }
            MixerConfig::Mamba2(m) => {
                FamilyWeights::Mamba2(load_lm(config, src, dtype, |r, l| {
                    mamba2_mixer(r, l, dm, &m)
                })?)
            }
        })
    }

    pub fn config(&self) -> &FamilyConfig {
        match self {
            FamilyWeights::Mamba1(w) => &w.config,
            FamilyWeights::Mamba2(w) => &w.config,
        }
    }
}

/// `(config.json, weights)` for a folder or a file given directly.
fn locate(path: &Path) -> Result<(PathBuf, PathBuf)> {
    if path.is_file() {
        let dir = path.parent().unwrap_or(Path::new("."));
        return Ok((dir.join("config.json"), path.to_path_buf()));
    }
    if !path.is_dir() {
        return Err(Error::input(format!(
            "model path {} does not exist (expected a folder holding config.json and weights)",
            path.display()
        )));
    }
    Ok((path.join("config.json"), path.to_path_buf()))
}

/// Reads checked tensors out of a source, remembering which it used so that leftovers (a
/// sign of a config that does not describe the file) can be refused at the end.
pub struct TensorReader<'a> {
    src: &'a TensorSource,
    dtype: DType,
    prefix: &'static str,
    used: BTreeSet<String>,
}

impl<'a> TensorReader<'a> {
    pub fn new(src: &'a TensorSource, dtype: DType) -> Self {
        let names = src.names();
        let prefixed = !names.is_empty() && names.iter().all(|n| n.starts_with("model."));
        TensorReader {
            src,
            dtype,
            prefix: if prefixed { "model." } else { "" },
            used: BTreeSet::new(),
        }
    }

    fn origin(&self) -> String {
        self.src.origin().display().to_string()
    }

    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Whether `name` (or an alias of it) is in the source.
    pub fn has(&self, name: &str) -> bool {
        self.src.resolve(&self.full(name)).is_some()
    }

    /// The float tensor `name` of exactly `shape`, as f64 values through `f`.
    fn read<T>(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        f: impl FnOnce(crate::model::dtype::TensorData) -> T,
    ) -> Result<T> {
        let full = self.full(name);
        let src = self.src;
        let raw = src.get(&full).ok_or_else(|| Error::MissingTensor {
            name: full.clone(),
            path: self.origin(),
            expected: shape.to_vec(),
        })?;
        if raw.shape != shape {
            return Err(Error::Tensor {
                name: full,
                expected: format!("shape {shape:?} (from config)"),
                found: format!("shape {:?}", raw.shape),
            });
        }
        if !matches!(raw.dtype, DiskDType::Float(_)) {
            return Err(Error::Tensor {
                name: full,
                expected: "dtype f32, bf16, f16 or f64".into(),
                found: format!("dtype {}", raw.dtype),
            });
        }
        let data = raw.to_float(&full, dtype)?;
        // Checked as held: a finite f32 can still overflow an f16.
        crate::model::finite::check_tensor(&full, &data)?;
        if let Some(stored) = src.resolve(&full) {
            self.used.insert(stored.to_string());
        }
        Ok(f(data))
    }

    /// A `[rows, cols]` matrix in the model dtype.
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let dtype = self.dtype;
        self.read(name, &[rows, cols], dtype, |data| Matrix {
            rows,
            cols,
            data,
        })
    }

    /// A tensor of `shape` as f32, flattened row-major.
    pub fn vector(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.read(name, shape, DType::F32, |d| d.to_f32_vec())
    }

    /// [`Self::vector`] when the config says it is there; when it says not, it must be
    /// absent (a bias the config does not know of would otherwise be silently ignored).
    pub fn optional_vector(
        &mut self,
        present: bool,
        name: &str,
        shape: &[usize],
        field: &str,
    ) -> Result<Option<Vec<f32>>> {
        if present {
            return self.vector(name, shape).map(Some);
        }
        if self.has(name) {
            return Err(Error::checkpoint(
                self.origin(),
                format!(
                    "tensor `{}` is present but the config says `{field}` is false",
                    self.full(name)
                ),
            ));
        }
        Ok(None)
    }

    /// Check the shape of a tensor that is not needed (a duplicate tied head) if it is
    /// there, and account for it.
    pub fn check_shape_if_present(&mut self, name: &str, shape: &[usize]) -> Result<()> {
        let full = self.full(name);
        let src = self.src;
        let Some(raw) = src.get(&full) else {
            return Ok(());
        };
        if raw.shape != shape {
            return Err(Error::Tensor {
                name: full,
                expected: format!("shape {shape:?} (from config)"),
                found: format!("shape {:?}", raw.shape),
            });
        }
        if let Some(stored) = src.resolve(&full) {
            self.used.insert(stored.to_string());
        }
        Ok(())
    }

    /// Refuse stored tensors nothing read: the config does not describe this file.
    pub fn finish(self, what: &str) -> Result<()> {
        match self
            .src
            .names()
            .into_iter()
            .find(|n| !self.used.contains(n))
        {
            None => Ok(()),
            Some(n) => Err(Error::checkpoint(
                self.origin(),
                format!("unexpected tensor `{n}`: not part of {what}"),
            )),
        }
    }
}

/// Official and transformers names of the embedding (spec §5.2).
pub const EMBEDDING_NAMES: [&str; 2] = ["backbone.embedding.weight", "backbone.embeddings.weight"];

fn layer(i: usize, suffix: &str) -> String {
    format!("backbone.layers.{i}.{suffix}")
}

/// The LM around the mixers (spec §1), with `mixer(reader, layer)` reading each mixer.
pub fn load_lm<M>(
    config: FamilyConfig,
    src: &TensorSource,
    dtype: DType,
    mut mixer: impl FnMut(&mut TensorReader, usize) -> Result<M>,
) -> Result<LmWeights<M>> {
    let mut r = TensorReader::new(src, dtype);
    let (vp, dm) = (config.vocab_padded, config.d_model);
    let emb_name = EMBEDDING_NAMES
        .iter()
        .find(|n| r.has(n))
        .copied()
        .unwrap_or(EMBEDDING_NAMES[0]);
    if let Some(other) = EMBEDDING_NAMES.iter().find(|n| **n != emb_name && r.has(n)) {
        return Err(Error::checkpoint(
            r.origin(),
            format!("both `{emb_name}` and `{other}` are present: which is the embedding?"),
        ));
    }
    let embedding = r.matrix(emb_name, vp, dm)?;
    // Grown as layers are read: a config claiming 10^9 layers fails at the first missing
    // one, not in an allocation.
    let mut layers = Vec::new();
    for i in 0..config.n_layer {
        layers.push(Block {
            norm: r.vector(&layer(i, "norm.weight"), &[dm])?,
            mixer: mixer(&mut r, i)?,
        });
    }
    let norm_f = r.vector("backbone.norm_f.weight", &[dm])?;
    let lm_head = if config.tie_embeddings {
        // `torch.save` writes the tied head under both names; it is the embedding.
        r.check_shape_if_present("lm_head.weight", &[vp, dm])?;
        None
    } else {
        Some(r.matrix("lm_head.weight", vp, dm)?)
    };
    let what = format!(
        "a {:?} model with {} layers and this config",
        config.family(),
        config.n_layer
    );
    r.finish(&what)?;
    Ok(LmWeights {
        config,
        dtype,
        embedding,
        layers,
        norm_f,
        lm_head,
    })
}

fn mamba1_mixer(
    r: &mut TensorReader,
    i: usize,
    dm: usize,
    m: &Mamba1Config,
) -> Result<Mamba1Mixer> {
    let l = |s: &str| layer(i, &format!("mixer.{s}"));
    let (di, n, k, rk) = (m.d_inner, m.d_state, m.d_conv, m.dt_rank);
    Ok(Mamba1Mixer {
        in_proj: r.matrix(&l("in_proj.weight"), 2 * di, dm)?,
        in_proj_bias: r.optional_vector(m.proj_bias, &l("in_proj.bias"), &[2 * di], "bias")?,
        conv_weight: r.vector(&l("conv1d.weight"), &[di, 1, k])?,
        conv_bias: r.optional_vector(m.conv_bias, &l("conv1d.bias"), &[di], "conv_bias")?,
        x_proj: r.matrix(&l("x_proj.weight"), rk + 2 * n, di)?,
        dt_proj: r.matrix(&l("dt_proj.weight"), di, rk)?,
        dt_bias: r.vector(&l("dt_proj.bias"), &[di])?,
        a_log: r.vector(&l("A_log"), &[di, n])?,
        d: r.vector(&l("D"), &[di])?,
        out_proj: r.matrix(&l("out_proj.weight"), dm, di)?,
        out_proj_bias: r.optional_vector(m.proj_bias, &l("out_proj.bias"), &[dm], "bias")?,
    })
}

fn mamba2_mixer(
    r: &mut TensorReader,
    i: usize,
    dm: usize,
    m: &Mamba2Config,
) -> Result<Mamba2Mixer> {
    let l = |s: &str| layer(i, &format!("mixer.{s}"));
    let (cd, k, h) = (m.conv_dim(), m.d_conv, m.nheads);
    let d_len = if m.d_has_hdim { m.d_ssm } else { h };
    Ok(Mamba2Mixer {
        in_proj: r.matrix(&l("in_proj.weight"), m.d_in_proj(), dm)?,
        in_proj_bias: r.optional_vector(
            m.proj_bias,
            &l("in_proj.bias"),
            &[m.d_in_proj()],
            "bias",
        )?,
        conv_weight: r.vector(&l("conv1d.weight"), &[cd, 1, k])?,
        conv_bias: r.optional_vector(m.conv_bias, &l("conv1d.bias"), &[cd], "conv_bias")?,
        dt_bias: r.vector(&l("dt_bias"), &[h])?,
        a_log: r.vector(&l("A_log"), &[h])?,
        d: r.vector(&l("D"), &[d_len])?,
        norm: r.optional_vector(m.rmsnorm, &l("norm.weight"), &[m.d_ssm], "rmsnorm")?,
        out_proj: r.matrix(&l("out_proj.weight"), dm, m.d_inner)?,
        out_proj_bias: r.optional_vector(m.proj_bias, &l("out_proj.bias"), &[dm], "bias")?,
    })
}

impl LmWeights<Mamba1Mixer> {
    /// The Mamba-1 mixer config (an error if `config` describes another family: the fields
    /// are public, so the pairing is checked where it is relied on).
    pub fn mixer_config(&self) -> Result<&Mamba1Config> {
        self.config
            .mamba1()
            .ok_or_else(|| wrong_family("Mamba2", "Mamba1"))
    }

    /// [`FamilyWeights::load`] for a folder that must hold a Mamba-1 model.
    pub fn load(path: &Path, dtype: DType) -> Result<Mamba1Weights> {
        match FamilyWeights::load(path, dtype)? {
            FamilyWeights::Mamba1(w) => Ok(w),
            FamilyWeights::Mamba2(_) => Err(wrong_family("Mamba2", "Mamba1")),
        }
    }
}

impl LmWeights<Mamba2Mixer> {
    /// The Mamba-2 mixer config (an error if `config` describes another family).
    pub fn mixer_config(&self) -> Result<&Mamba2Config> {
        self.config
            .mamba2()
            .ok_or_else(|| wrong_family("Mamba1", "Mamba2"))
    }

    /// [`FamilyWeights::load`] for a folder that must hold a Mamba-2 model.
    pub fn load(path: &Path, dtype: DType) -> Result<Mamba2Weights> {
        match FamilyWeights::load(path, dtype)? {
            FamilyWeights::Mamba2(w) => Ok(w),
            FamilyWeights::Mamba1(_) => Err(wrong_family("Mamba1", "Mamba2")),
        }
    }
}

fn wrong_family(found: &str, want: &str) -> Error {
    Error::Unsupported {
        field: "mixer family (ssm_cfg.layer / model_type)".into(),
        found: found.into(),
        supported: want.into(),
    }
}

#[cfg(test)]
#[path = "family_weights_tests.rs"]
mod tests;
