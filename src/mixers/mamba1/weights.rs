//! Mamba-1's (and FalconMamba's) mixer parameters (spec §2.2), read from either file
//! layout by the LM loader of `crate::model::family_weights`.

use crate::error::Result;
use crate::model::family_config::{wrong_family, Mamba1Config};
use crate::model::family_weights::{layer, LmWeights, TensorReader};
use crate::model::weights::Matrix;

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
    /// `A = −exp(A_log)` `[D_i, N]` as the f32 decode step computes it (`exp_fast`), once at
    /// load: recomputed per token it was 4 % of a mamba-130m-shaped bf16 step ([`neg_a`]).
    pub a_neg: Vec<f32>,
    /// `[D_i]`
    pub d: Vec<f32>,
    /// `[D_m, D_i]`
    pub out_proj: Matrix,
    pub out_proj_bias: Option<Vec<f32>>,
}

pub type Mamba1Weights = LmWeights<Mamba1Mixer>;

/// Layer `i`'s mixer.
pub(crate) fn read_mixer(
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
        a_neg: Vec::new(),
        d: r.vector(&l("D"), &[di])?,
        out_proj: r.matrix(&l("out_proj.weight"), dm, di)?,
        out_proj_bias: r.optional_vector(m.proj_bias, &l("out_proj.bias"), &[dm], "bias")?,
    }
    .with_a())
}

impl Mamba1Mixer {
    /// `self` with [`Mamba1Mixer::a_neg`] computed from `a_log`.
    pub fn with_a(mut self) -> Self {
        self.a_neg = neg_a(&self.a_log);
        self
    }
}

/// `−exp(A_log)` per entry, with the decode step's f32 arithmetic.
pub fn neg_a(a_log: &[f32]) -> Vec<f32> {
    use crate::cpu::Real;
    a_log
        .iter()
        .map(|&v| -f32::from_f(v as f64).exp_fast())
        .collect()
}

impl LmWeights<Mamba1Mixer> {
    /// The Mamba-1 mixer config (an error if `config` describes another family: the fields
    /// are public, so the pairing is checked where it is relied on).
    pub fn mixer_config(&self) -> Result<&Mamba1Config> {
        self.config
            .mamba1()
            .ok_or_else(|| wrong_family("Mamba2", "Mamba1"))
    }
}
