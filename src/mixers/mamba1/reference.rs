//! The token-by-token Mamba-1 language model: spec §2.3 (and §2.5 for FalconMamba) inside
//! the LM of §1, written to be read beside the spec. It is the oracle the fast paths are
//! checked against, generic over f32/f64. No blocking, no vectorisation, no tricks.

use super::lm::{rms_unit, Dense, LmRef, TokenOut};
use super::{check_state, layer, layout, zero_state, LayerState, State};
use crate::cpu::math::{silu, softplus};
use crate::cpu::Real;
use crate::error::Result;
use crate::mixers::mamba1::weights::{Mamba1Mixer, Mamba1Weights};
use crate::model::family_config::Mamba1Config;

struct RefLayer<F> {
    in_proj: Dense<F>,
    x_proj: Dense<F>,
    dt_proj: Dense<F>,
    out_proj: Dense<F>,
    /// `A = −exp(A_log)`, `[D_i, N]`
    a: Vec<F>,
}

pub struct Reference<'w, F> {
    w: &'w Mamba1Weights,
    cfg: Mamba1Config,
    lm: LmRef<F>,
    layers: Vec<RefLayer<F>>,
}

impl<'w, F: Real> Reference<'w, F> {
    pub fn new(w: &'w Mamba1Weights) -> Result<Self> {
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
                    x_proj: Dense::new(&b.mixer.x_proj),
                    dt_proj: Dense::new(&b.mixer.dt_proj),
                    out_proj: Dense::new(&b.mixer.out_proj),
                    a: b.mixer
                        .a_log
                        .iter()
                        .map(|&v| -F::from_f(v as f64).exp())
                        .collect(),
                })
                .collect(),
        })
    }

    /// The mixer's config.
    pub fn config(&self) -> &Mamba1Config {
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

    /// Spec §2.3: one token of one mixer, updating its state.
    fn mixer(&self, mw: &Mamba1Mixer, rl: &RefLayer<F>, u: &[F], st: &mut LayerState<F>) -> Vec<F> {
        let c = &self.cfg;
        let (di, n, k, r) = (c.d_inner, c.d_state, c.d_conv, c.dt_rank);
        let f = |v: f32| F::from_f(v as f64);
        let xz = rl.in_proj.apply(u, mw.in_proj_bias.as_deref());
        let (x, z) = xz.split_at(di);

        // Causal depthwise conv over the last K inputs, newest in column K−1.
        let mut xc = vec![F::zero(); di];
        for ch in 0..di {
            let window = &mut st.conv[ch * k..(ch + 1) * k];
            window.rotate_left(1);
            window[k - 1] = x[ch];
            let bias = mw.conv_bias.as_ref().map_or(F::zero(), |b| f(b[ch]));
            let taps = &mw.conv_weight[ch * k..(ch + 1) * k];
            let acc = window
                .iter()
                .zip(taps)
                .fold(bias, |acc, (&v, &w)| acc + v * f(w));
            xc[ch] = silu(acc);
        }

        let dbc = rl.x_proj.apply(&xc, None);
        let mut delta_low = dbc[..r].to_vec();
        let mut b = dbc[r..r + n].to_vec();
        let mut cc = dbc[r + n..r + 2 * n].to_vec();
        if let Some(eps) = c.bcdt_rms_eps {
            let eps = F::from_f(eps);
            rms_unit(&mut delta_low, eps);
            rms_unit(&mut b, eps);
            rms_unit(&mut cc, eps);
        }
        let dt = rl.dt_proj.apply(&delta_low, None);

        let mut gated = vec![F::zero(); di];
        for ch in 0..di {
            let delta = softplus(dt[ch] + f(mw.dt_bias[ch]));
            let h = &mut st.ssm[ch * n..(ch + 1) * n];
            let a = &rl.a[ch * n..(ch + 1) * n];
            let mut y = F::zero();
            for j in 0..n {
                h[j] = (delta * a[j]).exp() * h[j] + delta * b[j] * xc[ch];
                y = y + h[j] * cc[j];
            }
            y = y + f(mw.d[ch]) * xc[ch];
            gated[ch] = y * silu(z[ch]);
        }
        rl.out_proj.apply(&gated, mw.out_proj_bias.as_deref())
    }
}
