//! A Mamba-3 MIMO model's configuration, derived sizes and parameters (spec-MIMO §1),
//! read from either official checkpoint format and checked tensor by tensor.
//!
//! The config is the SISO `config.json` with `ssm_cfg.is_mimo = true`; `Config::validate`
//! refuses MIMO, so [`validate_mimo`] runs the SISO checks on a SISO view of the config
//! and adds the MIMO ones. Matrices are held in the requested dtype, vectors (norms,
//! `dt_bias`, `D`, the biases and the three `mimo_*` projections) in f32, as the official
//! model keeps them.

use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::dtype::{DType, TensorData};
use crate::model::rng::Rng;
use crate::model::tensor_file::{write_safetensors, RawTensor, TensorFile};
use crate::model::weights::{layer_name, locate, read_expected, Checked, Fnv, Matrix, MlpWeights};
use std::collections::HashMap;
use std::path::Path;

/// Every size of a MIMO model, derived from a validated config (spec-MIMO §1.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MimoDims {
    pub d_model: usize,
    pub n_layer: usize,
    /// `D_i = int(expand · d_model)`
    pub d_inner: usize,
    /// `P`
    pub headdim: usize,
    /// `H = D_i / P`
    pub nheads: usize,
    /// `N`
    pub d_state: usize,
    /// `G`
    pub ngroups: usize,
    /// `R`
    pub rank: usize,
    /// `S`, rotary angles per head (pairs `(i, i + N/2)`, `i < S`)
    pub num_rope_angles: usize,
    /// `2·D_i + 2·R·G·N + 3·H + S`
    pub d_in_proj: usize,
    pub vocab_size: usize,
    pub vocab_padded: usize,
    /// GatedMLP hidden width (0 without MLP)
    pub mlp_hidden: usize,
    pub chunk_len: usize,
}

impl MimoDims {
    /// Offsets of the slices of one `in_proj` output row (spec-MIMO §2.1).
    pub fn z_off(&self) -> usize {
        0
    }
    pub fn x_off(&self) -> usize {
        self.d_inner
    }
    /// B is `[R, G, N]`, rank outermost.
    pub fn b_off(&self) -> usize {
        2 * self.d_inner
    }
    pub fn c_off(&self) -> usize {
        2 * self.d_inner + self.bc_width()
    }
    pub fn dt_off(&self) -> usize {
        2 * self.d_inner + 2 * self.bc_width()
    }
    pub fn a_off(&self) -> usize {
        self.dt_off() + self.nheads
    }
    pub fn trap_off(&self) -> usize {
        self.dt_off() + 2 * self.nheads
    }
    pub fn angle_off(&self) -> usize {
        self.dt_off() + 3 * self.nheads
    }
    /// Width of the B (or C) slice: `R·G·N`.
    pub fn bc_width(&self) -> usize {
        self.rank * self.ngroups * self.d_state
    }
    /// Offset of row `(r, g)` inside the B (or C) slice.
    pub fn bc_row(&self, r: usize, g: usize) -> usize {
        (r * self.ngroups + g) * self.d_state
    }
    /// Group of head `h`: contiguous blocks of `H/G` heads (spec-MIMO §2.3, §9.2).
    pub fn group_of(&self, h: usize) -> usize {
        h / (self.nheads / self.ngroups)
    }
    /// Numbers in one sequence's state of one layer: `H·(P·N + R·N + P + S)` (§3.1).
    pub fn state_elems_per_layer(&self) -> usize {
        let (h, p, n, r, s) = (
            self.nheads,
            self.headdim,
            self.d_state,
            self.rank,
            self.num_rope_angles,
        );
        h * (p * n + r * n + p + s)
    }
}

/// Read a MIMO `config.json` (the official `MambaConfig`) and validate it.
pub fn mimo_config_from_json_str(text: &str, origin: &str) -> Result<Config> {
    let cfg: Config = serde_json::from_str(text).map_err(|e| Error::Config {
        path: origin.into(),
        msg: e.to_string(),
    })?;
    validate_mimo(&cfg).map_err(|e| match e {
        Error::Config { msg, .. } => Error::Config {
            path: origin.into(),
            msg,
        },
        e => e,
    })?;
    Ok(cfg)
}

pub fn mimo_config_from_file(path: &Path) -> Result<Config> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    mimo_config_from_json_str(&text, &path.display().to_string())
}

/// Refuse a config that is not a MIMO model this code can run, naming the field.
pub fn validate_mimo(cfg: &Config) -> Result<()> {
    let s = &cfg.ssm_cfg;
    if !s.is_mimo {
        return Err(Error::Unsupported {
            field: "ssm_cfg.is_mimo".into(),
            found: "false".into(),
            supported: "true here (a SISO model runs on the SISO path)".into(),
        });
    }
    // Every field MIMO shares with SISO is checked by the SISO validation.
    let mut siso = cfg.clone();
    siso.ssm_cfg.is_mimo = false;
    siso.validate()?;
    let bad = |msg: String| Error::Config {
        path: String::new(),
        msg,
    };
    if s.mimo_rank == 0 {
        return Err(bad("`ssm_cfg.mimo_rank` must be ≥ 1, found 0".into()));
    }
    // The half-split pairs `(i, i + N/2)` need an even N.
    if !s.d_state.is_multiple_of(2) {
        return Err(bad(format!(
            "`ssm_cfg.d_state` must be even for MIMO's half-split rotary pairs (i, i + d_state/2), \
             found {}",
            s.d_state
        )));
    }
    Ok(())
}

/// The sizes of a config already passed through [`validate_mimo`].
pub fn mimo_dims(cfg: &Config) -> MimoDims {
    let siso = cfg.dims();
    let r = cfg.ssm_cfg.mimo_rank;
    MimoDims {
        d_model: siso.d_model,
        n_layer: siso.n_layer,
        d_inner: siso.d_inner,
        headdim: siso.headdim,
        nheads: siso.nheads,
        d_state: siso.d_state,
        ngroups: siso.ngroups,
        rank: r,
        num_rope_angles: siso.num_rope_angles,
        d_in_proj: 2 * siso.d_inner
            + 2 * r * siso.ngroups * siso.d_state
            + 3 * siso.nheads
            + siso.num_rope_angles,
        vocab_size: siso.vocab_size,
        vocab_padded: siso.vocab_padded,
        mlp_hidden: siso.mlp_hidden,
        chunk_len: siso.chunk_len,
    }
}

/// One MIMO layer's parameters (spec-MIMO §1.3), in the official layouts.
#[derive(Clone, Debug, PartialEq)]
pub struct MimoLayerWeights {
    /// block `norm.weight` `[D_m]`
    pub norm: Vec<f32>,
    /// `[d_in_proj, D_m]`
    pub in_proj: Matrix,
    /// `[H]`
    pub dt_bias: Vec<f32>,
    /// `B_bias` `[H, R, N]`
    pub b_bias: Vec<f32>,
    /// `C_bias` `[H, R, N]`
    pub c_bias: Vec<f32>,
    /// `B_norm.weight` `[N]`, shared by every rank and group
    pub b_norm: Vec<f32>,
    /// `C_norm.weight` `[N]`
    pub c_norm: Vec<f32>,
    /// `mimo_x` (ψ) `[H, R, P]`: values `u_r = x ⊙ ψ_r`
    pub mimo_x: Vec<f32>,
    /// `mimo_z` (ζ) `[H, R, P]`: gate `silu(z ⊙ ζ_r)`
    pub mimo_z: Vec<f32>,
    /// `mimo_o` (ω) `[H, R, P]`: weights of the rank sum
    pub mimo_o: Vec<f32>,
    /// `D` `[H]`
    pub d: Vec<f32>,
    /// gated output `norm.weight` `[D_i]` (read as `[H, P]`), iff `is_outproj_norm`
    pub out_norm: Option<Vec<f32>>,
    /// `[D_m, D_i]`
    pub out_proj: Matrix,
    pub mlp: Option<MlpWeights>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MimoWeights {
    pub config: Config,
    pub dims: MimoDims,
    /// dtype of the matrices
    pub dtype: DType,
    /// `[vocab_padded, D_m]`
    pub embedding: Matrix,
    pub layers: Vec<MimoLayerWeights>,
    /// `[D_m]`
    pub norm_f: Vec<f32>,
    /// `[vocab_padded, D_m]`; `None` when tied to the embedding
    pub lm_head: Option<Matrix>,
}

/// Expected (name, shape) of every tensor of an official MIMO checkpoint of this config.
pub fn mimo_expected_tensors(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let d = mimo_dims(cfg);
    let (h, r, n, p) = (d.nheads, d.rank, d.d_state, d.headdim);
    let mut v = vec![(
        "backbone.embedding.weight".to_string(),
        vec![d.vocab_padded, d.d_model],
    )];
    for i in 0..d.n_layer {
        let l = |s: &str| layer_name(i, s);
        v.push((l("norm.weight"), vec![d.d_model]));
        v.push((l("mixer.dt_bias"), vec![h]));
        v.push((l("mixer.B_bias"), vec![h, r, n]));
        v.push((l("mixer.C_bias"), vec![h, r, n]));
        v.push((l("mixer.mimo_x"), vec![h, r, p]));
        v.push((l("mixer.mimo_z"), vec![h, r, p]));
        v.push((l("mixer.mimo_o"), vec![h, r, p]));
        v.push((l("mixer.D"), vec![h]));
        v.push((l("mixer.in_proj.weight"), vec![d.d_in_proj, d.d_model]));
        v.push((l("mixer.B_norm.weight"), vec![n]));
        v.push((l("mixer.C_norm.weight"), vec![n]));
        if cfg.ssm_cfg.is_outproj_norm {
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
    if !cfg.tie_embeddings {
        v.push(("lm_head.weight".into(), vec![d.vocab_padded, d.d_model]));
    }
    v
}

/// Matrices (held in the model dtype) as opposed to f32 vectors.
fn is_matrix(name: &str) -> bool {
    name.ends_with("proj.weight")
        || name.ends_with("fc1.weight")
        || name.ends_with("fc2.weight")
        || name == "backbone.embedding.weight"
        || name == "lm_head.weight"
}

impl MimoWeights {
    /// Load `config.json` and the weights from a model directory (or a weights file with a
    /// `config.json` beside it), matrices converted to `dtype`.
    pub fn load(path: &Path, dtype: DType) -> Result<MimoWeights> {
        let (config_path, weights_path) = locate(path)?;
        let config = mimo_config_from_file(&config_path)?;
        let file = TensorFile::open(&weights_path)?;
        Self::from_tensor_file(config, &file, dtype)
    }

    /// Build from an open tensor file, checking every name, shape and dtype.
    pub fn from_tensor_file(config: Config, file: &TensorFile, dtype: DType) -> Result<Self> {
        validate_mimo(&config)?;
        let (tensors, _) = read_expected(
            &config,
            file,
            || mimo_expected_tensors(&config),
            "a MIMO model",
            |name| if is_matrix(name) { dtype } else { DType::F32 },
            Fnv::new(),
        )?;
        Ok(Self::assemble(config, dtype, tensors))
    }

    /// Put checked tensors (by official name) into the typed structure.
    fn assemble(config: Config, dtype: DType, t: HashMap<String, TensorData>) -> Self {
        let d = mimo_dims(&config);
        let mut t = Checked(t);
        let embedding = t.matrix("backbone.embedding.weight", d.vocab_padded, d.d_model);
        let mut layers = Vec::with_capacity(d.n_layer);
        for i in 0..d.n_layer {
            let l = |s: &str| layer_name(i, s);
            let mlp = t.mlp(i, d.d_model, d.mlp_hidden);
            layers.push(MimoLayerWeights {
                norm: t.vec32(&l("norm.weight")),
                in_proj: t.matrix(&l("mixer.in_proj.weight"), d.d_in_proj, d.d_model),
                dt_bias: t.vec32(&l("mixer.dt_bias")),
                b_bias: t.vec32(&l("mixer.B_bias")),
                c_bias: t.vec32(&l("mixer.C_bias")),
                b_norm: t.vec32(&l("mixer.B_norm.weight")),
                c_norm: t.vec32(&l("mixer.C_norm.weight")),
                mimo_x: t.vec32(&l("mixer.mimo_x")),
                mimo_z: t.vec32(&l("mixer.mimo_z")),
                mimo_o: t.vec32(&l("mixer.mimo_o")),
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
        MimoWeights {
            config,
            dims: d,
            dtype,
            embedding,
            layers,
            norm_f,
            lm_head,
        }
    }

    /// A random MIMO model of this config, deterministic in `seed`: the official init
    /// shapes and scales (spec §1.3, §1.5) with every vector perturbed away from its init
    /// value and `in_proj` doubled (as the fixtures do), so that no term is invisible.
    pub fn synthetic(config: Config, dtype: DType, seed: u64) -> Result<Self> {
        validate_mimo(&config)?;
        let s = &config.ssm_cfg;
        let r = s.mimo_rank as f64;
        let n_layer = config.n_layer as f64;
        let mut rng = Rng::new(seed);
        let mut tensors = HashMap::new();
        for (name, shape) in mimo_expected_tensors(&config) {
            let n: usize = shape.iter().product();
            let fan_in = *shape.last().expect("no scalars") as f64;
            let perturbed = |rng: &mut Rng, init: f64| -> Vec<f64> {
                (0..n).map(|_| init * (1.0 + 0.2 * rng.normal())).collect()
            };
            let vals: Vec<f64> = if name.ends_with("embedding.weight") || name == "lm_head.weight" {
                (0..n).map(|_| 0.02 * rng.normal()).collect()
            } else if name.ends_with("out_proj.weight") || name.ends_with("fc2.weight") {
                let b = 1.0 / fan_in.sqrt() / n_layer.sqrt();
                (0..n).map(|_| rng.range(-b, b)).collect()
            } else if name.ends_with("in_proj.weight") {
                let b = 2.0 / fan_in.sqrt();
                (0..n).map(|_| rng.range(-b, b)).collect()
            } else if is_matrix(&name) {
                let b = 1.0 / fan_in.sqrt();
                (0..n).map(|_| rng.range(-b, b)).collect()
            } else if name.ends_with("dt_bias") {
                (0..n)
                    .map(|_| {
                        let (lo, hi) = (s.dt_min.ln(), s.dt_max.ln());
                        let dt = rng.range(lo, hi).exp().max(s.dt_init_floor);
                        dt + (-(-dt).exp_m1()).ln()
                    })
                    .collect()
            } else if name.ends_with("mimo_x") || name.ends_with("mimo_o") {
                perturbed(&mut rng, 1.0 / r)
            } else {
                // norms, biases, D, mimo_z: init ones
                perturbed(&mut rng, 1.0)
            };
            let f32s = TensorData::F64(vals).convert(DType::F32);
            let held = if is_matrix(&name) {
                f32s.convert(dtype)
            } else {
                f32s
            };
            tensors.insert(name, held);
        }
        Ok(Self::assemble(config, dtype, tensors))
    }

    /// The head matrix (the embedding when tied).
    pub fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// Every tensor under its official name (a tied head once), in the held dtypes.
    pub fn to_tensors(&self) -> Vec<(String, RawTensor<'static>)> {
        let d = &self.dims;
        let m = |x: &Matrix| RawTensor::from_data(vec![x.rows, x.cols], &x.data);
        let (h, r, n, p) = (d.nheads, d.rank, d.d_state, d.headdim);
        let mut out = vec![("backbone.embedding.weight".to_string(), m(&self.embedding))];
        for (i, lw) in self.layers.iter().enumerate() {
            let l = |s: &str| layer_name(i, s);
            let v = |shape: Vec<usize>, x: &[f32]| RawTensor::from_f32(shape, x);
            out.push((l("norm.weight"), v(vec![d.d_model], &lw.norm)));
            out.push((l("mixer.dt_bias"), v(vec![h], &lw.dt_bias)));
            out.push((l("mixer.B_bias"), v(vec![h, r, n], &lw.b_bias)));
            out.push((l("mixer.C_bias"), v(vec![h, r, n], &lw.c_bias)));
            out.push((l("mixer.mimo_x"), v(vec![h, r, p], &lw.mimo_x)));
            out.push((l("mixer.mimo_z"), v(vec![h, r, p], &lw.mimo_z)));
            out.push((l("mixer.mimo_o"), v(vec![h, r, p], &lw.mimo_o)));
            out.push((l("mixer.D"), v(vec![h], &lw.d)));
            out.push((l("mixer.in_proj.weight"), m(&lw.in_proj)));
            out.push((l("mixer.B_norm.weight"), v(vec![n], &lw.b_norm)));
            out.push((l("mixer.C_norm.weight"), v(vec![n], &lw.c_norm)));
            if let Some(x) = &lw.out_norm {
                out.push((l("mixer.norm.weight"), v(vec![d.d_inner], x)));
            }
            out.push((l("mixer.out_proj.weight"), m(&lw.out_proj)));
            if let Some(mlp) = &lw.mlp {
                out.push((l("norm2.weight"), v(vec![d.d_model], &mlp.norm)));
                out.push((l("mlp.fc1.weight"), m(&mlp.fc1)));
                out.push((l("mlp.fc2.weight"), m(&mlp.fc2)));
            }
        }
        out.push((
            "backbone.norm_f.weight".into(),
            RawTensor::from_f32(vec![d.d_model], &self.norm_f),
        ));
        if let Some(x) = &self.lm_head {
            out.push(("lm_head.weight".into(), m(x)));
        }
        out
    }

    /// Save as `config.json` + `model.safetensors` in `dir`, the official MIMO layout that
    /// [`MimoWeights::load`] (and so `mamba3 logits`/`generate`) reads.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        crate::atomic::write(&dir.join("config.json"), self.config.to_json().as_bytes())?;
        let mut tensors = self.to_tensors();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        write_safetensors(&dir.join("model.safetensors"), &tensors, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"d_model": 64, "n_layer": 2, "vocab_size": 256,
        "ssm_cfg": {"layer": "Mamba3", "d_state": 32, "headdim": 16, "is_mimo": true,
                    "mimo_rank": 4, "chunk_size": 16}}"#;

    fn with(edit: impl Fn(&mut serde_json::Value)) -> String {
        let mut v: serde_json::Value = serde_json::from_str(TINY).unwrap();
        edit(&mut v);
        v.to_string()
    }

    #[test]
    fn derives_the_spec_example() {
        let c = mimo_config_from_json_str(
            r#"{"d_model": 768, "n_layer": 24, "vocab_size": 50277,
                "ssm_cfg": {"layer": "Mamba3", "is_mimo": true}}"#,
            "t",
        )
        .unwrap();
        let d = mimo_dims(&c);
        // spec-MIMO §1.2: R defaults to 4; d_in_proj 4200 (SISO 3432)
        assert_eq!(
            (d.d_inner, d.nheads, d.num_rope_angles, d.rank),
            (1536, 24, 32, 4)
        );
        assert_eq!(d.d_in_proj, 4200);
        assert_eq!(
            d.state_elems_per_layer(),
            24 * (64 * 128 + 4 * 128 + 64 + 32)
        );
        let d = mimo_dims(&mimo_config_from_json_str(TINY, "t").unwrap());
        assert_eq!(d.d_in_proj, 544, "mimo-tiny golden.json says 544");
        assert_eq!((d.b_off(), d.c_off(), d.dt_off()), (256, 384, 512));
        assert_eq!(d.angle_off() + d.num_rope_angles, d.d_in_proj);
    }

    #[test]
    fn refuses_configs_naming_the_field() {
        let cases: Vec<(String, &str)> = vec![
            (with(|v| v["ssm_cfg"]["is_mimo"] = false.into()), "is_mimo"),
            (with(|v| v["ssm_cfg"]["mimo_rank"] = 0.into()), "mimo_rank"),
            (
                with(|v| v["ssm_cfg"]["layer"] = "Mamba2".into()),
                "ssm_cfg.layer",
            ),
            (with(|v| v["ssm_cfg"]["ngroups"] = 3.into()), "ngroups"),
            (
                with(|v| v["ssm_cfg"]["rope_fraction"] = 0.25.into()),
                "rope_fraction",
            ),
            (with(|v| v["ssm_cfg"]["headdim"] = 48.into()), "headdim"),
            (with(|v| v["ssm_cfg"]["d_state"] = 31.into()), "d_state"),
            (
                with(|v| v["ssm_cfg"]["chunk_size"] = 0.into()),
                "chunk_size",
            ),
            (
                with(|v| v["attn_layer_idx"] = serde_json::json!([0])),
                "attn_layer_idx",
            ),
            (with(|v| v["d_model"] = "big".into()), "cfg.json"),
        ];
        for (text, field) in cases {
            let e = mimo_config_from_json_str(&text, "cfg.json").unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
        // The SISO loader still refuses MIMO (unchanged).
        assert!(Config::from_json_str(TINY, "t").is_err());
    }

    #[test]
    fn bad_checkpoints_are_errors_naming_tensor_expected_and_found() {
        let cfg = mimo_config_from_json_str(TINY, "t").unwrap();
        let w = MimoWeights::synthetic(cfg.clone(), DType::F32, 3).unwrap();
        let dir = std::env::temp_dir().join(format!("mimo-bad-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |edit: &dyn Fn(&mut Named)| {
            let mut t = w.to_tensors();
            edit(&mut t);
            t.sort_by(|a, b| a.0.cmp(&b.0));
            let p = dir.join("model.safetensors");
            crate::model::tensor_file::write_safetensors(&p, &t, None).unwrap();
            MimoWeights::from_tensor_file(cfg.clone(), &TensorFile::open(&p).unwrap(), DType::F32)
        };
        let ok = write(&|_| {}).unwrap();
        assert_eq!(ok, w, "round trip");
        let e = write(&|t| {
            let i = t
                .iter()
                .position(|(n, _)| n.ends_with("0.mixer.mimo_x"))
                .unwrap();
            t[i].1 = RawTensor::from_f32(vec![8, 2, 16], &[0.0; 256]);
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("mimo_x") && e.contains("[8, 4, 16]") && e.contains("[8, 2, 16]"),
            "{e}"
        );
        let e = write(&|t| t.retain(|(n, _)| !n.ends_with("1.mixer.C_bias")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("C_bias") && e.contains("[8, 4, 32]"), "{e}");
        let e = write(&|t| {
            t.push((
                "backbone.layers.0.mixer.extra".into(),
                RawTensor::from_f32(vec![1], &[0.0]),
            ))
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unexpected tensor `backbone.layers.0.mixer.extra`"),
            "{e}"
        );
        let e = write(&|t| {
            let i = t
                .iter()
                .position(|(n, _)| n.ends_with("0.mixer.D"))
                .unwrap();
            t[i].1 = RawTensor::from_i64(vec![8], &[0; 8]);
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("mixer.D") && e.contains("i64"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Tensors under their names, as a checkpoint file holds them.
    type Named = Vec<(String, RawTensor<'static>)>;
}
