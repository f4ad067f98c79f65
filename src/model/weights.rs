//! What every mixer's parameters share: row-major matrices, the gated-MLP block, locating a
//! checkpoint, reading the tensors a config expects with every check (names, shapes, dtypes,
//! finiteness, layer count), and the fingerprint that ties a state to its model. Each
//! mixer's own tensors are in its folder (`crate::mixers::mamba3::weights`,
//! `crate::mixers::mimo::weights`, ...).

use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::dtype::{DType, TensorData};
use crate::model::tensor_file::TensorFile;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// A row-major `[rows, cols]` matrix (PyTorch `nn.Linear` weight: `[out, in]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: TensorData,
}

impl Matrix {
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    pub fn convert(&self, dtype: DType) -> Matrix {
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data: self.data.convert(dtype),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct MlpWeights {
    /// `norm2.weight` `[D_m]`
    pub norm: Vec<f32>,
    /// `fc1.weight` `[2·hidden, D_m]`: value rows first, then gate rows
    pub fc1: Matrix,
    /// `fc2.weight` `[D_m, hidden]`
    pub fc2: Matrix,
}

/// The checkpoint file names we look for in a model directory, in order.
pub const CHECKPOINT_NAMES: [&str; 2] = ["model.safetensors", "pytorch_model.bin"];

/// Locate config and weights: `path` is a model directory, or a weights file with a
/// `config.json` beside it.
pub fn locate(path: &Path) -> Result<(PathBuf, PathBuf)> {
    if path.is_file() {
        let dir = path.parent().unwrap_or(Path::new("."));
        return Ok((dir.join("config.json"), path.to_path_buf()));
    }
    if !path.is_dir() {
        return Err(Error::input(format!(
            "model path {} does not exist (expected a directory holding config.json and {})",
            path.display(),
            CHECKPOINT_NAMES.join(" or ")
        )));
    }
    let weights = CHECKPOINT_NAMES
        .iter()
        .map(|n| path.join(n))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            Error::checkpoint(
                path.display(),
                format!(
                    "no weights found: expected one of {}",
                    CHECKPOINT_NAMES.join(", ")
                ),
            )
        })?;
    Ok((path.join("config.json"), weights))
}

/// FNV-1a, for fingerprints.
#[derive(Clone, Copy)]
pub struct Fnv(pub u64);
impl Fnv {
    pub fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    pub fn bytes(mut self, b: &[u8]) -> Fnv {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
        self
    }
    pub fn u64(self, v: u64) -> Fnv {
        self.bytes(&v.to_le_bytes())
    }
}
impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}

/// Hash a tensor's name, length and 32 evenly spaced values (as f32), so that the same
/// parameters give the same fingerprint whatever file format or dtype they came in.
pub(crate) fn fingerprint_tensor(h: Fnv, name: &str, data: &TensorData) -> Fnv {
    fingerprint_values(h, name, data.len(), |i| data.get_f64(i))
}

/// [`fingerprint_tensor`] of `n` values read through `get`.
pub(crate) fn fingerprint_values(h: Fnv, name: &str, n: usize, get: impl Fn(usize) -> f64) -> Fnv {
    let mut h = h.bytes(name.as_bytes()).u64(n as u64);
    let samples = n.min(32);
    for i in 0..samples {
        let idx = i * n / samples;
        h = h.bytes(&(get(idx) as f32).to_le_bytes());
    }
    h
}

/// Tensors [`read_expected`] checked, taken out by official name into typed fields.
pub(crate) struct Checked(pub std::collections::HashMap<String, TensorData>);

impl Checked {
    fn take(&mut self, name: &str) -> TensorData {
        self.0.remove(name).expect("checked by read_expected")
    }
    /// A vector, as f32.
    pub fn vec32(&mut self, name: &str) -> Vec<f32> {
        match self.take(name) {
            TensorData::F32(v) => v,
            other => other.to_f32_vec(),
        }
    }
    /// A `[rows, cols]` matrix in its held dtype.
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            data: self.take(name),
        }
    }
    /// Layer `i`'s GatedMLP block (`norm2`, `mlp.fc1`, `mlp.fc2`), when `hidden > 0`.
    pub fn mlp(&mut self, i: usize, d_model: usize, hidden: usize) -> Option<MlpWeights> {
        (hidden > 0).then(|| MlpWeights {
            norm: self.vec32(&layer_name(i, "norm2.weight")),
            fc1: self.matrix(&layer_name(i, "mlp.fc1.weight"), 2 * hidden, d_model),
            fc2: self.matrix(&layer_name(i, "mlp.fc2.weight"), d_model, hidden),
        })
    }
}

/// Official names of a layer's tensors.
pub fn layer_name(i: usize, suffix: &str) -> String {
    format!("backbone.layers.{i}.{suffix}")
}

/// `file` must hold tensors for at least `config.n_layer` layers (one past the highest
/// `backbone.layers.{i}.` index); more is reported by name as unexpected tensors.
/// Every tensor `expected()` lists, read from `file` and checked: the file holds the
/// config's layers (checked before `expected` sizes anything from the config), no tensor
/// outside the list (a tied head's stored duplicate aside), each present with its shape and
/// a float dtype, and finite once held in `held(name)`. Returns them by name, and `fp`
/// extended by samples of the values as stored (so the fingerprint does not depend on the
/// dtype asked for). `model` names the kind of model in messages.
pub(crate) fn read_expected(
    config: &Config,
    file: &TensorFile,
    expected: impl FnOnce() -> Vec<(String, Vec<usize>)>,
    model: &str,
    held: impl Fn(&str) -> DType,
    mut fp: Fnv,
) -> Result<(std::collections::HashMap<String, TensorData>, Fnv)> {
    let path = file.path().display().to_string();
    // Before anything is sized from the config: its layer count must be the file's,
    // so that a config claiming 10^7 layers fails here, not in an allocation.
    check_layer_count(config, file, &path)?;
    let expected = expected();
    let expected_names: BTreeSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    for name in file.names() {
        let tied_head = name == "lm_head.weight" && config.tie_embeddings;
        if !expected_names.contains(name.as_str()) && !tied_head {
            let rank = if config.ssm_cfg.is_mimo {
                format!(", mimo_rank {}", config.ssm_cfg.mimo_rank)
            } else {
                String::new()
            };
            return Err(Error::checkpoint(
                &path,
                format!(
                    "unexpected tensor `{name}`: not part of {model} with this config \
                     ({} layers{rank}, d_intermediate {}, is_outproj_norm {}, tie_embeddings {})",
                    config.n_layer,
                    config.d_intermediate,
                    config.ssm_cfg.is_outproj_norm,
                    config.tie_embeddings
                ),
            ));
        }
    }
    let mut tensors = std::collections::HashMap::new();
    for (name, shape) in expected {
        let raw = file.get(&name).ok_or_else(|| Error::MissingTensor {
            name: name.clone(),
            path: path.clone(),
            expected: shape.clone(),
        })?;
        if raw.shape != shape {
            return Err(Error::Tensor {
                name,
                expected: format!("shape {shape:?} (from config)"),
                found: format!("shape {:?}", raw.shape),
            });
        }
        if !matches!(raw.dtype, crate::model::tensor_file::DiskDType::Float(_)) {
            return Err(Error::Tensor {
                name,
                expected: "dtype f32, bf16, f16 or f64".into(),
                found: format!("dtype {}", raw.dtype),
            });
        }
        // Straight from the file's bytes to the held dtype.
        let data = raw.to_float(&name, held(&name))?;
        // Checked as held: a finite f32 can still overflow an f16.
        crate::model::finite::check_tensor(&name, &data)?;
        fp = fingerprint_values(fp, &name, data.len(), |i| {
            raw.float_at(i).unwrap_or(f64::NAN)
        });
        tensors.insert(name, data);
    }
    Ok((tensors, fp))
}

fn check_layer_count(config: &Config, file: &TensorFile, path: &str) -> Result<()> {
    let in_file = file
        .names()
        .iter()
        .filter_map(|n| {
            n.strip_prefix("backbone.layers.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .map(|i| i.saturating_add(1))
        .max()
        .unwrap_or(0);
    if in_file < config.n_layer {
        return Err(Error::checkpoint(
            path,
            format!(
                "the config says n_layer {} but the checkpoint holds tensors for only {in_file} \
                 layers",
                config.n_layer
            ),
        ));
    }
    Ok(())
}
