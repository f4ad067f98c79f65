//! Random Mamba-1 and Mamba-2 models: for checking the fast paths against the references
//! on configurations the fixtures do not cover (biases, groups, FalconMamba norms, odd
//! widths), and for `mamba3 bench --family` on a shape without a checkpoint. Every
//! parameter is drawn away from any special value.

use crate::mixers::mamba1::weights::{Mamba1Mixer, Mamba1Weights};
use crate::mixers::mamba2::weights::{Mamba2Mixer, Mamba2Weights};
use crate::model::dtype::TensorData;
use crate::model::family_config::{
    ConfigLayout, FamilyConfig, Mamba1Config, Mamba2Config, MixerConfig,
};
use crate::model::family_weights::{Block, LmWeights};
use crate::model::rng::Rng;
use crate::model::weights::Matrix;
use crate::model::DType;

pub struct Gen(Rng);

impl Gen {
    pub fn new(seed: u64) -> Gen {
        Gen(Rng::new(seed))
    }
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n).map(|_| self.0.range(lo, hi) as f32).collect()
    }
    pub fn matrix(&mut self, rows: usize, cols: usize, scale: f64) -> Matrix {
        let b = scale / (cols as f64).sqrt();
        Matrix {
            rows,
            cols,
            data: TensorData::F32(self.vec(rows * cols, -b, b)),
        }
    }
    fn maybe(&mut self, present: bool, n: usize) -> Option<Vec<f32>> {
        present.then(|| self.vec(n, -0.3, 0.3))
    }
    /// Δ biases: inverse softplus of Δ in [lo, hi].
    fn dt_bias(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let dt = self.0.range(lo.ln(), hi.ln()).exp();
                (dt + (-(-dt).exp_m1()).ln()) as f32
            })
            .collect()
    }
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.0.below(vocab as u64) as u32).collect()
    }
}

fn lm<M>(
    g: &mut Gen,
    mixer: MixerConfig,
    d_model: usize,
    n_layer: usize,
    vocab: usize,
    tied: bool,
    mut layer: impl FnMut(&mut Gen) -> M,
) -> LmWeights<M> {
    let config = FamilyConfig {
        layout: ConfigLayout::Official,
        d_model,
        n_layer,
        vocab_size: vocab,
        vocab_padded: vocab,
        tie_embeddings: tied,
        norm_eps: 1e-5,
        mixer,
    };
    LmWeights {
        config,
        dtype: DType::F32,
        embedding: g.matrix(vocab, d_model, (d_model as f64).sqrt()),
        layers: (0..n_layer)
            .map(|_| Block {
                norm: g.vec(d_model, 0.7, 1.3),
                mixer: layer(g),
            })
            .collect(),
        norm_f: g.vec(d_model, 0.7, 1.3),
        lm_head: (!tied).then(|| g.matrix(vocab, d_model, 1.0)),
    }
}

impl<M> LmWeights<M> {
    /// The same model with its matrices held in `dtype` (rounded once).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        let conv = |m: &mut Matrix| *m = m.convert(dtype);
        conv(&mut self.embedding);
        self.lm_head.as_mut().map(conv);
        self.dtype = dtype;
        self
    }
}

impl Mamba1Weights {
    /// Its matrices in `dtype` (the mixer's vectors stay f32).
    pub fn mixers_with_dtype(mut self, dtype: DType) -> Self {
        for b in &mut self.layers {
            for m in [
                &mut b.mixer.in_proj,
                &mut b.mixer.x_proj,
                &mut b.mixer.dt_proj,
                &mut b.mixer.out_proj,
            ] {
                *m = m.convert(dtype);
            }
        }
        self.with_dtype(dtype)
    }
}

impl Mamba2Weights {
    /// Its matrices in `dtype` (the mixer's vectors stay f32).
    pub fn mixers_with_dtype(mut self, dtype: DType) -> Self {
        for b in &mut self.layers {
            for m in [&mut b.mixer.in_proj, &mut b.mixer.out_proj] {
                *m = m.convert(dtype);
            }
        }
        self.with_dtype(dtype)
    }
}

/// The official config of a Mamba-1 (`layer` "Mamba1") or Mamba-2 model of this shape,
/// every other field at the official default.
pub fn official_config(
    layer: &str,
    d_model: usize,
    n_layer: usize,
    vocab_size: usize,
    d_state: usize,
    headdim: usize,
) -> crate::error::Result<FamilyConfig> {
    let text = official_config_json(layer, d_model, n_layer, vocab_size, d_state, headdim);
    FamilyConfig::from_json_str(&text, "synthetic")
}

/// The `config.json` text of [`official_config`].
pub fn official_config_json(
    layer: &str,
    d_model: usize,
    n_layer: usize,
    vocab_size: usize,
    d_state: usize,
    headdim: usize,
) -> String {
    let head = if layer == "Mamba2" {
        format!(r#", "headdim": {headdim}"#)
    } else {
        String::new()
    };
    format!(
        "{{\"d_model\": {d_model}, \"n_layer\": {n_layer}, \"vocab_size\": {vocab_size}, \
         \"ssm_cfg\": {{\"layer\": \"{layer}\", \"d_state\": {d_state}{head}}}, \
         \"rms_norm\": true, \"residual_in_fp32\": true, \"fused_add_norm\": true, \
         \"pad_vocab_size_multiple\": 8, \"tie_embeddings\": true}}\n"
    )
}

/// A random model of `config`'s shape with matrices in `dtype`.
pub fn synthetic(
    config: &FamilyConfig,
    dtype: DType,
    seed: u64,
) -> crate::mixers::family::FamilyWeights {
    use crate::mixers::family::FamilyWeights;
    let (dm, nl, v) = (config.d_model, config.n_layer, config.vocab_padded);
    let mut w = match &config.mixer {
        MixerConfig::Mamba1(c) => {
            FamilyWeights::Mamba1(mamba1(c.clone(), dm, nl, v, seed).mixers_with_dtype(dtype))
        }
        MixerConfig::Mamba2(c) => {
            FamilyWeights::Mamba2(mamba2(c.clone(), dm, nl, v, seed).mixers_with_dtype(dtype))
        }
    };
    match &mut w {
        FamilyWeights::Mamba1(m) => {
            m.config = config.clone();
            tie(m);
        }
        FamilyWeights::Mamba2(m) => {
            m.config = config.clone();
            tie(m);
        }
    }
    w
}

/// Make the head follow the config: none when tied, a copy of the embedding otherwise.
fn tie<M>(m: &mut LmWeights<M>) {
    if m.config.tie_embeddings {
        m.lm_head = None;
    } else if m.lm_head.is_none() {
        m.lm_head = Some(m.embedding.clone());
    }
}

pub fn mamba1(
    c: Mamba1Config,
    d_model: usize,
    n_layer: usize,
    vocab: usize,
    seed: u64,
) -> Mamba1Weights {
    let mut g = Gen::new(seed);
    let (di, n, k, r) = (c.d_inner, c.d_state, c.d_conv, c.dt_rank);
    let m = c.clone();
    lm(
        &mut g,
        MixerConfig::Mamba1(c),
        d_model,
        n_layer,
        vocab,
        seed.is_multiple_of(2),
        |g| {
            Mamba1Mixer {
                in_proj: g.matrix(2 * di, d_model, 2.0),
                in_proj_bias: g.maybe(m.proj_bias, 2 * di),
                conv_weight: g.vec(di * k, -0.6, 0.6),
                conv_bias: g.maybe(m.conv_bias, di),
                x_proj: g.matrix(r + 2 * n, di, 2.0),
                dt_proj: g.matrix(di, r, 1.0),
                dt_bias: g.dt_bias(di, 0.005, 0.5),
                a_log: g.vec(di * n, 0.0, 16f64.ln()),
                a_neg: Vec::new(),
                d: g.vec(di, 0.5, 1.5),
                out_proj: g.matrix(d_model, di, 1.0),
                out_proj_bias: g.maybe(m.proj_bias, d_model),
            }
            .with_a()
        },
    )
}

/// A Mamba-2 mixer config of the official defaults at this size (`D_i = 2·d_model`, every
/// channel through the SSM, a gated per-group RMSNorm, no Δ clamp, conv bias, no
/// projection biases, chunk 256): the base the tests vary.
pub fn mamba2_config(
    d_model: usize,
    headdim: usize,
    ngroups: usize,
    d_state: usize,
) -> Mamba2Config {
    let d_inner = 2 * d_model;
    Mamba2Config {
        d_inner,
        d_ssm: d_inner,
        d_state,
        d_conv: 4,
        headdim,
        nheads: d_inner / headdim,
        ngroups,
        d_has_hdim: false,
        rmsnorm: true,
        norm_before_gate: false,
        gated_norm_eps: 1e-5,
        dt_limit: (0.0, f64::INFINITY),
        conv_bias: true,
        proj_bias: false,
        chunk_size: 256,
    }
}

pub fn mamba2(
    c: Mamba2Config,
    d_model: usize,
    n_layer: usize,
    vocab: usize,
    seed: u64,
) -> Mamba2Weights {
    let mut g = Gen::new(seed);
    let m = c.clone();
    lm(
        &mut g,
        MixerConfig::Mamba2(c),
        d_model,
        n_layer,
        vocab,
        seed % 2 == 1,
        |g| Mamba2Mixer {
            in_proj: g.matrix(m.d_in_proj(), d_model, 2.0),
            in_proj_bias: g.maybe(m.proj_bias, m.d_in_proj()),
            conv_weight: g.vec(m.conv_dim() * m.d_conv, -0.6, 0.6),
            conv_bias: g.maybe(m.conv_bias, m.conv_dim()),
            dt_bias: g.dt_bias(m.nheads, 0.01, 1.0),
            a_log: g.vec(m.nheads, 0.0, 16f64.ln()),
            d: g.vec(if m.d_has_hdim { m.d_ssm } else { m.nheads }, 0.5, 1.5),
            norm: m.rmsnorm.then(|| g.vec(m.d_ssm, 0.7, 1.3)),
            out_proj: g.matrix(d_model, m.d_inner, 1.0),
            out_proj_bias: g.maybe(m.proj_bias, d_model),
        },
    )
}
