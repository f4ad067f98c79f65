//! Mamba-2's mixer parameters (spec §3.2), read from either file
//! layout by the LM loader of `crate::model::family_weights`.

use crate::error::Result;
use crate::model::family_config::{wrong_family, Mamba2Config};
use crate::model::family_weights::{layer, LmWeights, TensorReader};
use crate::model::weights::Matrix;

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

pub type Mamba2Weights = LmWeights<Mamba2Mixer>;

/// Layer `i`'s mixer.
pub(crate) fn read_mixer(
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

impl LmWeights<Mamba2Mixer> {
    /// The Mamba-2 mixer config (an error if `config` describes another family).
    pub fn mixer_config(&self) -> Result<&Mamba2Config> {
        self.config
            .mamba2()
            .ok_or_else(|| wrong_family("Mamba1", "Mamba2"))
    }
}
