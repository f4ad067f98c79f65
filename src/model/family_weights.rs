//! The language model around a Mamba-1 (or FalconMamba) or Mamba-2 mixer, read from the
//! official or the transformers layout (spec §4, §5.2) and checked against the config, each
//! mismatch an error naming the tensor, the shape expected and the one found; each mixer
//! reads its own tensors through [`TensorReader`] (`crate::mixers::mamba1::weights`,
//! `crate::mixers::mamba2::weights`), and `crate::mixers::family` loads either.
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
use crate::model::family_config::FamilyConfig;
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

/// `(config.json, weights)` for a folder or a file given directly.
pub fn locate(path: &Path) -> Result<(PathBuf, PathBuf)> {
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

/// A layer's tensor name.
pub fn layer(i: usize, suffix: &str) -> String {
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
