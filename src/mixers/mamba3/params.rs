//! Trainable parameters: one flat vector per official tensor, in the arithmetic type `F`
//! (f32 master weights for training, f64 for gradient checks). The same struct holds
//! gradients and the optimiser's moments.
//!
//! Names, shapes and order are those of [`expected_tensors`] (the official state_dict;
//! a tied head is the embedding and has no tensor of its own). Conversion to and from
//! [`Weights`] gives the official checkpoint layout and the inference engine.
//!
//! The same struct holds a Mamba-3 MIMO model (`ssm_cfg.is_mimo`): its layers carry the
//! three `mimo_*` projections ([`MimoRankParams`]), `B_bias`/`C_bias` are `[H, R, N]` and
//! `in_proj` is MIMO's wider one; names and order are then `mimo_expected_tensors`', and
//! [`Params::save`]/[`Params::load`] go through [`MimoWeights`]. The LM around the mixer is
//! the same, so the optimiser, the trainer and checkpoints need no second copy.

use super::weights::{expected_tensors, LayerWeights, Weights};
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::mixers::mimo::weights::{mimo_dims, mimo_expected_tensors, validate_mimo};
use crate::mixers::mimo::{MimoLayerWeights, MimoWeights};
use crate::model::config::Config;
use crate::model::config::Dims;
use crate::model::dtype::{DType, Element, TensorData};
use crate::model::rng::Rng;
use crate::model::weights::{Fnv, Matrix, MlpWeights};
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub struct MlpParams<F> {
    /// `norm2.weight` `[D_m]`
    pub norm: Vec<F>,
    /// `fc1.weight` `[2·hidden, D_m]`
    pub fc1: Vec<F>,
    /// `fc2.weight` `[D_m, hidden]`
    pub fc2: Vec<F>,
}

/// A MIMO layer's per-rank projections, each `[H, R, P]` (spec-MIMO §1.3).
#[derive(Clone, Debug, PartialEq)]
pub struct MimoRankParams<F> {
    /// `mimo_x` (ψ): values `u_r = x ⊙ ψ_r`
    pub x: Vec<F>,
    /// `mimo_z` (ζ): gates `silu(z ⊙ ζ_r)`
    pub z: Vec<F>,
    /// `mimo_o` (ω): weights of the rank sum
    pub o: Vec<F>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerParams<F> {
    pub norm: Vec<F>,
    /// `[d_in_proj, D_m]`
    pub in_proj: Vec<F>,
    pub dt_bias: Vec<F>,
    /// `[H, N]` (MIMO: `[H, R, N]`)
    pub b_bias: Vec<F>,
    pub c_bias: Vec<F>,
    /// MIMO only
    pub mimo: Option<MimoRankParams<F>>,
    pub b_norm: Vec<F>,
    pub c_norm: Vec<F>,
    pub d: Vec<F>,
    /// `[D_i]`, iff `is_outproj_norm`
    pub out_norm: Option<Vec<F>>,
    /// `[D_m, D_i]`
    pub out_proj: Vec<F>,
    pub mlp: Option<MlpParams<F>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Params<F> {
    pub config: Config,
    /// `[vocab_padded, D_m]`
    pub embedding: Vec<F>,
    pub layers: Vec<LayerParams<F>>,
    pub norm_f: Vec<F>,
    /// `[vocab_padded, D_m]`; `None` when tied
    pub lm_head: Option<Vec<F>>,
}

/// The sizes of a trainable config, SISO or MIMO: MIMO's `d_in_proj` is its own
/// (`2·D_i + 2·R·G·N + 3·H + S`); every other size is shared.
pub fn param_dims(config: &Config) -> Dims {
    let mut d = config.dims();
    if config.ssm_cfg.is_mimo {
        d.d_in_proj = mimo_dims(config).d_in_proj;
    }
    d
}

/// The ranks of a config's mixer: `mimo_rank` for MIMO, 1 for SISO.
pub fn ranks(config: &Config) -> usize {
    if config.ssm_cfg.is_mimo {
        config.ssm_cfg.mimo_rank
    } else {
        1
    }
}

/// Refuse a config this module cannot train (SISO or MIMO checks).
pub fn validate_trainable(config: &Config) -> Result<()> {
    if config.ssm_cfg.is_mimo {
        validate_mimo(config)
    } else {
        config.validate()
    }
}

/// Names and shapes of a config's tensors in state_dict order, SISO or MIMO.
pub fn trainable_tensors(config: &Config) -> Vec<(String, Vec<usize>)> {
    if config.ssm_cfg.is_mimo {
        mimo_expected_tensors(config)
    } else {
        expected_tensors(config)
    }
}

/// Official no-weight-decay group: `dt_bias`, `D`, the biases and every norm weight
/// (everything that is not a matrix).
pub fn decays(name: &str) -> bool {
    name.ends_with("proj.weight")
        || name.ends_with("fc1.weight")
        || name.ends_with("fc2.weight")
        || name == "backbone.embedding.weight"
        || name == "lm_head.weight"
}

impl<F: Real> Params<F> {
    /// All zeros, shaped for `config` (gradients, moments).
    pub fn zeros(config: &Config) -> Self {
        let d = param_dims(config);
        let r = ranks(config);
        let z = |n: usize| vec![F::zero(); n];
        Params {
            config: config.clone(),
            embedding: z(d.vocab_padded * d.d_model),
            layers: (0..d.n_layer)
                .map(|_| LayerParams {
                    norm: z(d.d_model),
                    in_proj: z(d.d_in_proj * d.d_model),
                    dt_bias: z(d.nheads),
                    b_bias: z(d.nheads * r * d.d_state),
                    c_bias: z(d.nheads * r * d.d_state),
                    mimo: config.ssm_cfg.is_mimo.then(|| MimoRankParams {
                        x: z(d.nheads * r * d.headdim),
                        z: z(d.nheads * r * d.headdim),
                        o: z(d.nheads * r * d.headdim),
                    }),
                    b_norm: z(d.d_state),
                    c_norm: z(d.d_state),
                    d: z(d.nheads),
                    out_norm: config.ssm_cfg.is_outproj_norm.then(|| z(d.d_inner)),
                    out_proj: z(d.d_model * d.d_inner),
                    mlp: (d.mlp_hidden > 0).then(|| MlpParams {
                        norm: z(d.d_model),
                        fc1: z(2 * d.mlp_hidden * d.d_model),
                        fc2: z(d.d_model * d.mlp_hidden),
                    }),
                })
                .collect(),
            norm_f: z(d.d_model),
            lm_head: (!config.tie_embeddings).then(|| z(d.vocab_padded * d.d_model)),
        }
    }

    /// Every tensor by official name, in [`trainable_tensors`] order.
    pub fn tensors(&self) -> Vec<(String, &Vec<F>)> {
        let names = trainable_tensors(&self.config);
        let mut refs: Vec<&Vec<F>> = vec![&self.embedding];
        for l in &self.layers {
            refs.extend([&l.norm, &l.dt_bias, &l.b_bias, &l.c_bias]);
            if let Some(m) = &l.mimo {
                refs.extend([&m.x, &m.z, &m.o]);
            }
            refs.extend([&l.d, &l.in_proj]);
            refs.extend([&l.b_norm, &l.c_norm]);
            refs.extend(l.out_norm.as_ref());
            refs.push(&l.out_proj);
            if let Some(m) = &l.mlp {
                refs.extend([&m.norm, &m.fc1, &m.fc2]);
            }
        }
        refs.push(&self.norm_f);
        refs.extend(self.lm_head.as_ref());
        assert_eq!(names.len(), refs.len());
        names.into_iter().map(|(n, _)| n).zip(refs).collect()
    }

    /// Mutable tensors, same order as [`Params::tensors`].
    pub fn tensors_mut(&mut self) -> Vec<&mut Vec<F>> {
        let mut refs: Vec<&mut Vec<F>> = vec![&mut self.embedding];
        for l in &mut self.layers {
            refs.extend([&mut l.norm, &mut l.dt_bias, &mut l.b_bias, &mut l.c_bias]);
            if let Some(m) = &mut l.mimo {
                refs.extend([&mut m.x, &mut m.z, &mut m.o]);
            }
            refs.extend([&mut l.d, &mut l.in_proj]);
            refs.extend([&mut l.b_norm, &mut l.c_norm]);
            refs.extend(l.out_norm.as_mut());
            refs.push(&mut l.out_proj);
            if let Some(m) = &mut l.mlp {
                refs.extend([&mut m.norm, &mut m.fc1, &mut m.fc2]);
            }
        }
        refs.push(&mut self.norm_f);
        refs.extend(self.lm_head.as_mut());
        refs
    }

    pub fn numel(&self) -> usize {
        self.tensors().iter().map(|(_, t)| t.len()).sum()
    }

    /// The head matrix (the embedding when tied).
    pub fn head(&self) -> &[F] {
        self.lm_head.as_deref().unwrap_or(&self.embedding)
    }

    /// From inference weights (any dtype), widened to `F`.
    pub fn from_weights(w: &Weights) -> Self {
        let mut p = Self::zeros(&w.config);
        let conv =
            |t: &TensorData| -> Vec<F> { t.to_f64_vec().into_iter().map(F::from_f).collect() };
        let vecf = |v: &[f32]| -> Vec<F> { v.iter().map(|&x| F::from_f(x as f64)).collect() };
        p.embedding = conv(&w.embedding.data);
        for (lp, lw) in p.layers.iter_mut().zip(&w.layers) {
            lp.norm = vecf(&lw.norm);
            lp.in_proj = conv(&lw.in_proj.data);
            lp.dt_bias = vecf(&lw.dt_bias);
            lp.b_bias = vecf(&lw.b_bias);
            lp.c_bias = vecf(&lw.c_bias);
            lp.b_norm = vecf(&lw.b_norm);
            lp.c_norm = vecf(&lw.c_norm);
            lp.d = vecf(&lw.d);
            lp.out_norm = lw.out_norm.as_deref().map(vecf);
            lp.out_proj = conv(&lw.out_proj.data);
            lp.mlp = lw.mlp.as_ref().map(|m| MlpParams {
                norm: vecf(&m.norm),
                fc1: conv(&m.fc1.data),
                fc2: conv(&m.fc2.data),
            });
        }
        p.norm_f = vecf(&w.norm_f);
        p.lm_head = w.lm_head.as_ref().map(|m| conv(&m.data));
        p
    }

    /// To inference weights with matrices in `dtype` (vectors stay f32).
    pub fn to_weights(&self, dtype: DType) -> Weights {
        let d = self.config.dims();
        let f32v = |v: &[F]| -> Vec<f32> { v.iter().map(|x| Element::to_f64(*x) as f32).collect() };
        let mat = |v: &[F], rows: usize, cols: usize| Matrix {
            rows,
            cols,
            data: TensorData::from_fn(v.len(), dtype, |i| Element::to_f64(v[i])),
        };
        let mut fp = Fnv::new().bytes(b"mamba3-train");
        for (name, t) in self.tensors() {
            fp = fp.bytes(name.as_bytes());
            for x in t.iter() {
                fp = fp.bytes(&(Element::to_f64(*x) as f32).to_le_bytes());
            }
        }
        Weights {
            config: self.config.clone(),
            dims: d,
            dtype,
            embedding: mat(&self.embedding, d.vocab_padded, d.d_model),
            layers: self
                .layers
                .iter()
                .map(|l| LayerWeights {
                    norm: f32v(&l.norm),
                    in_proj: mat(&l.in_proj, d.d_in_proj, d.d_model),
                    dt_bias: f32v(&l.dt_bias),
                    b_bias: f32v(&l.b_bias),
                    c_bias: f32v(&l.c_bias),
                    b_norm: f32v(&l.b_norm),
                    c_norm: f32v(&l.c_norm),
                    d: f32v(&l.d),
                    out_norm: l.out_norm.as_deref().map(f32v),
                    out_proj: mat(&l.out_proj, d.d_model, d.d_inner),
                    mlp: l.mlp.as_ref().map(|m| MlpWeights {
                        norm: f32v(&m.norm),
                        fc1: mat(&m.fc1, 2 * d.mlp_hidden, d.d_model),
                        fc2: mat(&m.fc2, d.d_model, d.mlp_hidden),
                    }),
                })
                .collect(),
            norm_f: f32v(&self.norm_f),
            lm_head: self
                .lm_head
                .as_ref()
                .map(|h| mat(h, d.vocab_padded, d.d_model)),
            fingerprint: fp.0,
        }
    }

    /// From MIMO inference weights (any dtype), widened to `F`.
    pub fn from_mimo_weights(w: &MimoWeights) -> Self {
        let mut p = Self::zeros(&w.config);
        let conv =
            |t: &TensorData| -> Vec<F> { t.to_f64_vec().into_iter().map(F::from_f).collect() };
        let vecf = |v: &[f32]| -> Vec<F> { v.iter().map(|&x| F::from_f(x as f64)).collect() };
        p.embedding = conv(&w.embedding.data);
        for (lp, lw) in p.layers.iter_mut().zip(&w.layers) {
            lp.norm = vecf(&lw.norm);
            lp.in_proj = conv(&lw.in_proj.data);
            lp.dt_bias = vecf(&lw.dt_bias);
            lp.b_bias = vecf(&lw.b_bias);
            lp.c_bias = vecf(&lw.c_bias);
            lp.mimo = Some(MimoRankParams {
                x: vecf(&lw.mimo_x),
                z: vecf(&lw.mimo_z),
                o: vecf(&lw.mimo_o),
            });
            lp.b_norm = vecf(&lw.b_norm);
            lp.c_norm = vecf(&lw.c_norm);
            lp.d = vecf(&lw.d);
            lp.out_norm = lw.out_norm.as_deref().map(vecf);
            lp.out_proj = conv(&lw.out_proj.data);
            lp.mlp = lw.mlp.as_ref().map(|m| MlpParams {
                norm: vecf(&m.norm),
                fc1: conv(&m.fc1.data),
                fc2: conv(&m.fc2.data),
            });
        }
        p.norm_f = vecf(&w.norm_f);
        p.lm_head = w.lm_head.as_ref().map(|m| conv(&m.data));
        p
    }

    /// To MIMO inference weights with matrices in `dtype` (vectors stay f32). Panics on a
    /// SISO config (callers dispatch on `ssm_cfg.is_mimo`).
    pub fn to_mimo_weights(&self, dtype: DType) -> MimoWeights {
        let d = mimo_dims(&self.config);
        let f32v = |v: &[F]| -> Vec<f32> { v.iter().map(|x| Element::to_f64(*x) as f32).collect() };
        let mat = |v: &[F], rows: usize, cols: usize| Matrix {
            rows,
            cols,
            data: TensorData::from_fn(v.len(), dtype, |i| Element::to_f64(v[i])),
        };
        MimoWeights {
            config: self.config.clone(),
            dims: d,
            dtype,
            embedding: mat(&self.embedding, d.vocab_padded, d.d_model),
            layers: self
                .layers
                .iter()
                .map(|l| {
                    let m = l.mimo.as_ref().expect("a MIMO layer has mimo_x/z/o");
                    MimoLayerWeights {
                        norm: f32v(&l.norm),
                        in_proj: mat(&l.in_proj, d.d_in_proj, d.d_model),
                        dt_bias: f32v(&l.dt_bias),
                        b_bias: f32v(&l.b_bias),
                        c_bias: f32v(&l.c_bias),
                        b_norm: f32v(&l.b_norm),
                        c_norm: f32v(&l.c_norm),
                        mimo_x: f32v(&m.x),
                        mimo_z: f32v(&m.z),
                        mimo_o: f32v(&m.o),
                        d: f32v(&l.d),
                        out_norm: l.out_norm.as_deref().map(f32v),
                        out_proj: mat(&l.out_proj, d.d_model, d.d_inner),
                        mlp: l.mlp.as_ref().map(|m| MlpWeights {
                            norm: f32v(&m.norm),
                            fc1: mat(&m.fc1, 2 * d.mlp_hidden, d.d_model),
                            fc2: mat(&m.fc2, d.d_model, d.mlp_hidden),
                        }),
                    }
                })
                .collect(),
            norm_f: f32v(&self.norm_f),
            lm_head: self
                .lm_head
                .as_ref()
                .map(|h| mat(h, d.vocab_padded, d.d_model)),
        }
    }

    /// Save as an official model folder (`config.json` + f32 `model.safetensors`), in the
    /// SISO or the MIMO layout as the config says.
    pub fn save(&self, dir: &Path) -> Result<()> {
        if self.config.ssm_cfg.is_mimo {
            self.to_mimo_weights(DType::F32).save(dir)
        } else {
            self.to_weights(DType::F32).save(dir)
        }
    }

    /// Load an official Mamba-3 model folder, SISO or MIMO (its `config.json` says which).
    pub fn load(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let cfg: Config = serde_json::from_str(&text)
            .map_err(|e| Error::checkpoint(cfg_path.display(), e.to_string()))?;
        Ok(if cfg.ssm_cfg.is_mimo {
            Self::from_mimo_weights(&MimoWeights::load(dir, DType::F32)?)
        } else {
            Self::from_weights(&Weights::load(dir, DType::F32)?)
        })
    }

    /// The official initialisation (spec §1.5 and §1.3): embedding (and an untied head)
    /// `N(0, 0.02)`; `in_proj`/`fc1` PyTorch-Linear uniform `±1/√fan_in`; `out_proj`/`fc2`
    /// the same divided by `√n_layer`; `dt_bias` the inverse softplus of a log-uniform Δ in
    /// `[dt_min, dt_max]`; norms, `B_bias`, `C_bias` and `D` ones. Deterministic in `seed`.
    ///
    /// MIMO (spec-MIMO §1.3): `mimo_x` and `mimo_o` `1/R`, `mimo_z` ones.
    pub fn init(config: &Config, seed: u64) -> Result<Self> {
        validate_trainable(config)?;
        let s = &config.ssm_cfg;
        let n_layer = config.n_layer as f64;
        let inv_rank = 1.0 / ranks(config) as f64;
        let mut rng = Rng::new(seed);
        let mut p = Self::zeros(config);
        let shapes = trainable_tensors(config);
        for ((name, shape), t) in shapes.iter().zip(p.tensors_mut()) {
            let fan_in = *shape.last().unwrap() as f64;
            let mut fill = |f: &mut dyn FnMut(&mut Rng) -> f64| {
                for x in t.iter_mut() {
                    *x = F::from_f(f(&mut rng) as f32 as f64);
                }
            };
            if name.ends_with("embedding.weight") || name == "lm_head.weight" {
                fill(&mut |r| 0.02 * r.normal());
            } else if name.ends_with("out_proj.weight") || name.ends_with("fc2.weight") {
                let b = 1.0 / fan_in.sqrt() / n_layer.sqrt();
                fill(&mut |r| r.range(-b, b));
            } else if decays(name) {
                let b = 1.0 / fan_in.sqrt();
                fill(&mut |r| r.range(-b, b));
            } else if name.ends_with("dt_bias") {
                fill(&mut |r| {
                    let dt = r
                        .range(s.dt_min.ln(), s.dt_max.ln())
                        .exp()
                        .max(s.dt_init_floor);
                    dt + (-(-dt).exp_m1()).ln()
                });
            } else if name.ends_with("mimo_x") || name.ends_with("mimo_o") {
                fill(&mut |_| inv_rank);
            } else {
                fill(&mut |_| 1.0);
            }
        }
        Ok(p)
    }

    /// Check that every tensor has the length the config asks for.
    pub fn check(&self) -> Result<()> {
        for ((name, shape), (_, t)) in trainable_tensors(&self.config).iter().zip(self.tensors()) {
            let n: usize = shape.iter().product();
            if t.len() != n {
                return Err(Error::Tensor {
                    name: name.clone(),
                    expected: format!("{n} elements (shape {shape:?})"),
                    found: format!("{} elements", t.len()),
                });
            }
        }
        Ok(())
    }
}
