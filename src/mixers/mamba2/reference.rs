//! The token-by-token Mamba-2 language model: spec §3.3 and §3.4 inside the LM of §1,
//! written to be read beside the spec. It is the oracle the chunked prefill is checked
//! against, generic over f32/f64. No chunking, no tricks.

use super::{layer, layout, zero_state, State};
use crate::cpu::math::{silu, softplus};
use crate::cpu::Real;
use crate::error::Result;
use crate::mixers::mamba1::lm::{rms_unit, Dense, LmRef, TokenOut};
use crate::mixers::mamba1::{check_state, LayerState};
use crate::mixers::mamba2::weights::{Mamba2Mixer, Mamba2Weights};
use crate::model::family_config::Mamba2Config;

struct RefLayer<F> {
    in_proj: Dense<F>,
    out_proj: Dense<F>,
}

pub struct Reference<'w, F> {
    w: &'w Mamba2Weights,
    cfg: Mamba2Config,
    lm: LmRef<F>,
    layers: Vec<RefLayer<F>>,
}

impl<'w, F: Real> Reference<'w, F> {
    pub fn new(w: &'w Mamba2Weights) -> Result<Self> {
        let cfg = w.mixer_config()?.clone();
        Ok(Reference {
            w,
            cfg,
            lm: LmRef::new(w),
            layers: w
                .layers
                .iter()
                .map(|b| RefLayer {
                    in_proj: Dense::new(&b.mixer.in_proj),
                    out_proj: Dense::new(&b.mixer.out_proj),
                })
                .collect(),
        })
    }

    /// The mixer's config.
    pub fn config(&self) -> &Mamba2Config {
        &self.cfg
    }

    /// The state before the first token.
    pub fn new_state(&self) -> State<F> {
        zero_state(&self.cfg, self.w.config.n_layer)
    }

    /// One token: its logits over `vocab_padded` rows.
    pub fn step(&self, state: &mut State<F>, token: u32) -> Result<Vec<F>> {
        Ok(self.step_full(state, token)?.logits)
    }

    /// One token: the hidden state after `norm_f` and the logits.
    pub fn step_full(&self, state: &mut State<F>, token: u32) -> Result<TokenOut<F>> {
        check_state(state, &layout(&self.cfg, self.w.config.n_layer))?;
        self.lm.token(token, 0, |l, u| {
            self.mixer(
                &self.w.layers[l].mixer,
                &self.layers[l],
                u,
                &mut layer(state, l, &self.cfg),
            )
        })
    }

    /// Every token of `tokens` in turn, from `state` (a fresh or a carried one): the logits
    /// of every position.
    pub fn forward(&self, state: &mut State<F>, tokens: &[u32]) -> Result<Vec<Vec<F>>> {
        tokens.iter().map(|&t| self.step(state, t)).collect()
    }

    /// Spec §3.3: one token of one mixer, updating its state.
    fn mixer(&self, mw: &Mamba2Mixer, rl: &RefLayer<F>, u: &[F], st: &mut LayerState<F>) -> Vec<F> {
        let c = &self.cfg;
        let (d_mlp, d_ssm, n, k) = (c.d_mlp(), c.d_ssm, c.d_state, c.d_conv);
        let (h_n, p_n, g_n, cd) = (c.nheads, c.headdim, c.ngroups, c.conv_dim());
        let f = |v: f32| F::from_f(v as f64);
        let proj = rl.in_proj.apply(u, mw.in_proj_bias.as_deref());
        let z0 = &proj[..d_mlp];
        let x0 = &proj[d_mlp..2 * d_mlp];
        let z = &proj[2 * d_mlp..2 * d_mlp + d_ssm];
        let xbc = &proj[2 * d_mlp + d_ssm..2 * d_mlp + d_ssm + cd];
        let dt = &proj[2 * d_mlp + d_ssm + cd..];

        // Causal depthwise conv over x‖B‖C, newest input in column K−1.
        let mut v = vec![F::zero(); cd];
        for ch in 0..cd {
            let window = &mut st.conv[ch * k..(ch + 1) * k];
            window.rotate_left(1);
            window[k - 1] = xbc[ch];
            let bias = mw.conv_bias.as_ref().map_or(F::zero(), |b| f(b[ch]));
            let taps = &mw.conv_weight[ch * k..(ch + 1) * k];
            let acc = window
                .iter()
                .zip(taps)
                .fold(bias, |acc, (&x, &w)| acc + x * f(w));
            v[ch] = silu(acc);
        }
        let (x, bc) = v.split_at(d_ssm);
        let (b, cc) = bc.split_at(g_n * n);

        let (lo, hi) = (F::from_f(c.dt_limit.0), F::from_f(c.dt_limit.1));
        let mut y = vec![F::zero(); d_ssm];
        for h in 0..h_n {
            let g = c.group_of(h);
            let (bg, cg) = (&b[g * n..(g + 1) * n], &cc[g * n..(g + 1) * n]);
            let delta = softplus(dt[h] + f(mw.dt_bias[h])).max(lo).min(hi);
            let a = -F::from_f(mw.a_log[h] as f64).exp();
            let decay = (delta * a).exp();
            for p in 0..p_n {
                let ch = h * p_n + p;
                let row = &mut st.ssm[ch * n..(ch + 1) * n];
                let mut acc = F::zero();
                for j in 0..n {
                    row[j] = decay * row[j] + delta * x[ch] * bg[j];
                    acc = acc + row[j] * cg[j];
                }
                let d = if c.d_has_hdim { mw.d[ch] } else { mw.d[h] };
                y[ch] = acc + f(d) * x[ch];
            }
        }

        // Gate and grouped RMSNorm (§3.4): groups of d_ssm/G channels, eps from the config.
        let mut o: Vec<F> = Vec::with_capacity(c.d_inner);
        o.extend(z0.iter().zip(x0).map(|(&zz, &xx)| silu(zz) * xx));
        let gate = |i: usize| silu(z[i]);
        match &mw.norm {
            None => o.extend((0..d_ssm).map(|i| y[i] * gate(i))),
            Some(w) => {
                let mut normed: Vec<F> = if c.norm_before_gate {
                    y.clone()
                } else {
                    (0..d_ssm).map(|i| y[i] * gate(i)).collect()
                };
                let eps = F::from_f(c.gated_norm_eps);
                for grp in normed.chunks_mut(d_ssm / g_n) {
                    rms_unit(grp, eps);
                }
                for i in 0..d_ssm {
                    normed[i] = normed[i] * f(w[i]);
                    if c.norm_before_gate {
                        normed[i] = normed[i] * gate(i);
                    }
                }
                o.extend(normed);
            }
        }
        rl.out_proj.apply(&o, mw.out_proj_bias.as_deref())
    }
}
