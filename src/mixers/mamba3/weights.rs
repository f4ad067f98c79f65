//! Mamba-3 SISO's parameters, named and shaped as the official state_dict (spec §1.3,
//! §1.4), checked against the config and held in the dtype the user asked for.
//!
//! Matrices (`in_proj`, `out_proj`, MLP, head, and the embedding when it is tied to the
//! head) are stored row-major in the PyTorch `[out, in]` layout, in the chosen dtype: they
//! are the bytes every token reads. Vectors (norm weights, `dt_bias`, `B_bias`, `C_bias`,
//! `D`) and an untied embedding table are kept in f32 whatever the dtype: rounding them
//! costs accuracy for no speed (the official model keeps the four mixer vectors in fp32).
//! The shared machinery (matrices, checked reads, fingerprints) is `crate::model::weights`.

use crate::error::{Error, Result};
use crate::model::config::{Config, Dims};
use crate::model::dtype::{DType, TensorData};
use crate::model::rng::Rng;
use crate::model::tensor_file::{RawTensor, TensorFile};
use crate::model::weights::{
    fingerprint_tensor, layer_name, locate, read_expected, Checked, Fnv, Matrix, MlpWeights,
};
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// block `norm.weight` `[D_m]`
    pub norm: Vec<f32>,
    /// `[d_in_proj, D_m]`
    pub in_proj: Matrix,
    /// `[H]`
    pub dt_bias: Vec<f32>,
    /// `B_bias` `[H, N]` (stored `(H, 1, N)` on disk)
    pub b_bias: Vec<f32>,
    /// `C_bias` `[H, N]`
    pub c_bias: Vec<f32>,
    /// `B_norm.weight` `[N]`
    pub b_norm: Vec<f32>,
    /// `C_norm.weight` `[N]`
    pub c_norm: Vec<f32>,
    /// `D` `[H]`
    pub d: Vec<f32>,
    /// gated output `norm.weight` `[D_i]`, present iff `is_outproj_norm`
    pub out_norm: Option<Vec<f32>>,
    /// `[D_m, D_i]`
    pub out_proj: Matrix,
    pub mlp: Option<MlpWeights>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    pub config: Config,
    pub dims: Dims,
    pub dtype: DType,
    /// `[vocab_padded, D_m]`
    pub embedding: Matrix,
    pub layers: Vec<LayerWeights>,
    /// `[D_m]`
    pub norm_f: Vec<f32>,
    /// `[vocab_padded, D_m]`; `None` when tied to the embedding
    pub lm_head: Option<Matrix>,
    /// Identifies the parameters (not their dtype): states record it, and a state is only
    /// ever loaded into the model it came from.
    pub fingerprint: u64,
}

/// Expected (name, shape) of every tensor in an official checkpoint of this config.
pub fn expected_tensors(config: &Config) -> Vec<(String, Vec<usize>)> {
    let d = config.dims();
    let mut v = vec![(
        "backbone.embedding.weight".to_string(),
        vec![d.vocab_padded, d.d_model],
    )];
    for i in 0..d.n_layer {
        let l = |s: &str| layer_name(i, s);
        v.push((l("norm.weight"), vec![d.d_model]));
        v.push((l("mixer.dt_bias"), vec![d.nheads]));
        v.push((l("mixer.B_bias"), vec![d.nheads, 1, d.d_state]));
        v.push((l("mixer.C_bias"), vec![d.nheads, 1, d.d_state]));
        v.push((l("mixer.D"), vec![d.nheads]));
        v.push((l("mixer.in_proj.weight"), vec![d.d_in_proj, d.d_model]));
        v.push((l("mixer.B_norm.weight"), vec![d.d_state]));
        v.push((l("mixer.C_norm.weight"), vec![d.d_state]));
        if config.ssm_cfg.is_outproj_norm {
            v.push((l("mixer.norm.weight"), vec![d.d_inner]));
        }
        v.push((l("mixer.out_proj.weight"), vec![d.d_model, d.d_inner]));
        if d.mlp_hidden > 0 {
            v.push((l("norm2.weight"), vec![d.d_model]));
            v.push((l("mlp.fc1.weight"), vec![2 * d.mlp_hidden, d.d_model]));
            v.push((l("mlp.fc2.weight"), vec![d.d_model, d.mlp_hidden]));
        }
    }
    v.push(("backbone.norm_f.weight".into(), vec![d.d_model]));
    if !config.tie_embeddings {
        v.push(("lm_head.weight".into(), vec![d.vocab_padded, d.d_model]));
    }
    v
}

/// The dtype a tensor is held in: matrices that matmuls stream take the model dtype;
/// vectors, and an untied embedding table (only ever looked up one row per token, so its
/// precision costs memory, not speed), stay f32 — on the golden fixtures a bf16 embedding
/// alone adds a third of the bf16 error.
fn storage_dtype(name: &str, dtype: DType, tied: bool) -> DType {
    let lookup_only = name == "backbone.embedding.weight" && !tied;
    if dtype == DType::F64 || (is_matrix(name) && !lookup_only) {
        dtype
    } else {
        DType::F32
    }
}

/// Which tensors are matrices (kept in the model dtype) rather than f32 vectors.
fn is_matrix(name: &str) -> bool {
    name.ends_with("proj.weight")
        || name.ends_with("fc1.weight")
        || name.ends_with("fc2.weight")
        || name == "backbone.embedding.weight"
        || name == "lm_head.weight"
}

impl Weights {
    /// Load config and weights from a model directory (or a weights file), converting to
    /// `dtype`.
    pub fn load(path: &Path, dtype: DType) -> Result<Weights> {
        let (config_path, weights_path) = locate(path)?;
        let config = Config::from_file(&config_path)?;
        let file = TensorFile::open(&weights_path)?;
        Weights::from_tensor_file(config, &file, dtype)
    }

    /// Build from an open tensor file, checking every tensor against the config.
    pub fn from_tensor_file(config: Config, file: &TensorFile, dtype: DType) -> Result<Weights> {
        let fp = Fnv::new().bytes(config_fingerprint_text(&config).as_bytes());
        let (tensors, fp) = read_expected(
            &config,
            file,
            || expected_tensors(&config),
            "a model",
            |name| storage_dtype(name, dtype, config.tie_embeddings),
            fp,
        )?;
        let fingerprint = fp.0;
        Ok(Self::assemble(config, dtype, tensors, fingerprint))
    }

    /// Put checked tensors (by official name) into the typed structure.
    fn assemble(
        config: Config,
        dtype: DType,
        t: std::collections::HashMap<String, TensorData>,
        fingerprint: u64,
    ) -> Weights {
        let d = config.dims();
        let mut t = Checked(t);
        let embedding = t.matrix("backbone.embedding.weight", d.vocab_padded, d.d_model);
        let mut layers = Vec::with_capacity(d.n_layer);
        for i in 0..d.n_layer {
            let l = |s: &str| layer_name(i, s);
            let mlp = t.mlp(i, d.d_model, d.mlp_hidden);
            layers.push(LayerWeights {
                norm: t.vec32(&l("norm.weight")),
                in_proj: t.matrix(&l("mixer.in_proj.weight"), d.d_in_proj, d.d_model),
                dt_bias: t.vec32(&l("mixer.dt_bias")),
                b_bias: t.vec32(&l("mixer.B_bias")),
                c_bias: t.vec32(&l("mixer.C_bias")),
                b_norm: t.vec32(&l("mixer.B_norm.weight")),
                c_norm: t.vec32(&l("mixer.C_norm.weight")),
                d: t.vec32(&l("mixer.D")),
                out_norm: config
                    .ssm_cfg
                    .is_outproj_norm
                    .then(|| t.vec32(&l("mixer.norm.weight"))),
                out_proj: t.matrix(&l("mixer.out_proj.weight"), d.d_model, d.d_inner),
                mlp,
            });
        }
        let norm_f = t.vec32("backbone.norm_f.weight");
        let lm_head =
            (!config.tie_embeddings).then(|| t.matrix("lm_head.weight", d.vocab_padded, d.d_model));
        Weights {
            config,
            dims: d,
            dtype,
            embedding,
            layers,
            norm_f,
            lm_head,
            fingerprint,
        }
    }

    /// A randomly initialised model of this config (official init of §1.5 and §1.3, with
    /// every vector perturbed away from its initial value so that no term is invisible).
    /// Deterministic in `seed`.
    pub fn synthetic(config: Config, dtype: DType, seed: u64) -> Result<Weights> {
        config.validate()?;
        let d = config.dims();
        let s = &config.ssm_cfg;
        let mut rng = Rng::new(seed);
        let mut tensors = std::collections::HashMap::new();
        let mut fp = Fnv::new().bytes(config_fingerprint_text(&config).as_bytes());
        let n_layer = d.n_layer as f64;
        for (name, shape) in expected_tensors(&config) {
            let n: usize = shape.iter().product();
            let fan_in = *shape.last().unwrap() as f64;
            let vals: Vec<f64> = if name.ends_with("embedding.weight") || name == "lm_head.weight" {
                (0..n).map(|_| 0.02 * rng.normal()).collect()
            } else if name.ends_with("out_proj.weight") || name.ends_with("fc2.weight") {
                let b = 1.0 / fan_in.sqrt() / n_layer.sqrt();
                (0..n).map(|_| rng.range(-b, b)).collect()
            } else if is_matrix(&name) {
                let b = 1.0 / fan_in.sqrt();
                (0..n).map(|_| rng.range(-b, b)).collect()
            } else if name.ends_with("dt_bias") {
                (0..n)
                    .map(|_| {
                        let (lo, hi) = (s.dt_min.ln(), s.dt_max.ln());
                        let dt = (rng.range(lo, hi)).exp().max(s.dt_init_floor);
                        dt + (-(-dt).exp_m1()).ln()
                    })
                    .collect()
            } else {
                // norms, biases, D: official init is ones; perturbed.
                (0..n).map(|_| 1.0 + 0.2 * rng.normal()).collect()
            };
            let data = TensorData::F64(vals).convert(DType::F32);
            fp = fingerprint_tensor(fp, &name, &data);
            let data = if is_matrix(&name) {
                data.convert(dtype)
            } else {
                data
            };
            tensors.insert(name, data);
        }
        Ok(Self::assemble(config, dtype, tensors, fp.0))
    }

    /// The head matrix (the embedding when tied).
    pub fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// Every tensor under its official name, in its stored dtype (norm weights and the
    /// fp32 vectors as f32). A tied head is written once, as the embedding.
    pub fn to_tensors(&self) -> Vec<(String, RawTensor<'static>)> {
        let d = &self.dims;
        let mut out = Vec::new();
        let m =
            |name: String, x: &Matrix| (name, RawTensor::from_data(vec![x.rows, x.cols], &x.data));
        let v = |name: String, shape: Vec<usize>, x: &[f32]| (name, RawTensor::from_f32(shape, x));
        out.push(m("backbone.embedding.weight".into(), &self.embedding));
        for (i, lw) in self.layers.iter().enumerate() {
            let l = |s: &str| layer_name(i, s);
            out.push(v(l("norm.weight"), vec![d.d_model], &lw.norm));
            out.push(v(l("mixer.dt_bias"), vec![d.nheads], &lw.dt_bias));
            out.push(v(
                l("mixer.B_bias"),
                vec![d.nheads, 1, d.d_state],
                &lw.b_bias,
            ));
            out.push(v(
                l("mixer.C_bias"),
                vec![d.nheads, 1, d.d_state],
                &lw.c_bias,
            ));
            out.push(v(l("mixer.D"), vec![d.nheads], &lw.d));
            out.push(m(l("mixer.in_proj.weight"), &lw.in_proj));
            out.push(v(l("mixer.B_norm.weight"), vec![d.d_state], &lw.b_norm));
            out.push(v(l("mixer.C_norm.weight"), vec![d.d_state], &lw.c_norm));
            if let Some(w) = &lw.out_norm {
                out.push(v(l("mixer.norm.weight"), vec![d.d_inner], w));
            }
            out.push(m(l("mixer.out_proj.weight"), &lw.out_proj));
            if let Some(mlp) = &lw.mlp {
                out.push(v(l("norm2.weight"), vec![d.d_model], &mlp.norm));
                out.push(m(l("mlp.fc1.weight"), &mlp.fc1));
                out.push(m(l("mlp.fc2.weight"), &mlp.fc2));
            }
        }
        out.push(v(
            "backbone.norm_f.weight".into(),
            vec![d.d_model],
            &self.norm_f,
        ));
        if let Some(h) = &self.lm_head {
            out.push(m("lm_head.weight".into(), h));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Number of parameters (a tied head counted once).
    pub fn param_count(&self) -> usize {
        self.to_tensors().iter().map(|(_, t)| t.numel()).sum()
    }

    /// Bytes the parameters occupy in memory.
    pub fn bytes(&self) -> usize {
        self.to_tensors().iter().map(|(_, t)| t.bytes.len()).sum()
    }

    /// Save as `model.safetensors` + `config.json` in `dir` (the official layout).
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let cfg = dir.join("config.json");
        crate::atomic::write(&cfg, self.config.to_json().as_bytes())?;
        crate::model::tensor_file::write_safetensors(
            &dir.join("model.safetensors"),
            &self.to_tensors(),
            None,
        )
    }
}

/// The config fields that change what a state means, as text for hashing.
fn config_fingerprint_text(c: &Config) -> String {
    let d = c.dims();
    format!("{d:?}|{:?}|{}", c.ssm_cfg.a_activation, c.ssm_cfg.a_floor)
}
