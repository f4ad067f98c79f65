//! The batched Mamba-2 decode step on the CPU: one token for each of several sequences,
//! each with its own state. in_proj and out_proj are one product over the batch's rows;
//! the conv and the state update (spec §3.3, one token: no chunking) run per sequence, in
//! parallel, on its own state, and within a sequence in parallel over heads.

use super::prefill::{deltas, gate_rows, taps};
use super::{layer, layout, State};
use crate::cpu::matmul::dot;
use crate::cpu::Real;
use crate::error::Result;
use crate::mixers::mamba1::lm::{conv_rows, decay_cutoff, decay_exp, lm_rows, project};
use crate::mixers::mamba1::step::check_step;
use crate::mixers::mamba2::weights::{Mamba2Mixer, Mamba2Weights};
use crate::mixers::LogitsWant;
use crate::model::family_config::Mamba2Config;
use rayon::prelude::*;

/// Advance every `states[i]` by `tokens[i]`; returns the logits `[batch, vocab_padded]`.
/// Nothing is changed when an argument is refused.
pub fn step<F: Real>(
    w: &Mamba2Weights,
    states: &mut [&mut State<F>],
    tokens: &[u32],
) -> Result<Vec<F>> {
    let cfg = w.mixer_config()?.clone();
    check_step(
        states,
        tokens,
        &layout(&cfg, w.config.n_layer),
        w.config.vocab_padded,
    )?;
    let b = tokens.len();
    let (width, d_ssm) = (cfg.d_in_proj(), cfg.d_ssm);
    let xbc_off = 2 * cfg.d_mlp() + d_ssm;
    let logits = lm_rows(w, tokens, LogitsWant::All, true, |l, mw, normed| {
        let proj = project(normed, b, &mw.in_proj, mw.in_proj_bias.as_deref());
        let delta = deltas(&cfg, mw, &proj, b);
        let mut y = vec![F::zero(); b * d_ssm];
        y.par_chunks_mut(d_ssm)
            .zip(states.par_iter_mut())
            .enumerate()
            .for_each(|(i, (row, st))| {
                let p = &proj[i * width..(i + 1) * width];
                let ls = layer(st, l, &cfg);
                let v = conv_rows(p, 1, (width, xbc_off), ls.conv, taps(&cfg, mw));
                let dr = &delta[i * cfg.nheads..(i + 1) * cfg.nheads];
                update_heads(&cfg, mw, &v, dr, ls.ssm, row);
            });
        let o = gate_rows(&cfg, mw, &proj, &y, b);
        Ok(project(&o, b, &mw.out_proj, mw.out_proj_bias.as_deref()))
    })?;
    Ok(logits)
}

/// One token's state update and read-out for every head: `v` = conv output `[C_d]`,
/// `delta` `[H]`, `ssm` `[H, P, N]`; writes `y` `[d_ssm]` with the D skip.
fn update_heads<F: Real>(
    c: &Mamba2Config,
    mw: &Mamba2Mixer,
    v: &[F],
    delta: &[F],
    ssm: &mut [F],
    y: &mut [F],
) {
    let (p_n, n, g_n) = (c.headdim, c.d_state, c.ngroups);
    let (x, bc) = v.split_at(c.d_ssm);
    let (b, cc) = bc.split_at(g_n * n);
    // Heads are independent: in parallel, so that one sequence's step (decode at batch 1)
    // uses every thread rather than one.
    ssm.par_chunks_mut(p_n * n)
        .zip(y.par_chunks_mut(p_n))
        .enumerate()
        .for_each(|(h, (hs, yh))| {
            let g = c.group_of(h);
            let (bg, cg) = (&b[g * n..(g + 1) * n], &cc[g * n..(g + 1) * n]);
            let a = -F::from_f(mw.a_log[h] as f64).exp();
            let decay = decay_exp(delta[h] * a, decay_cutoff());
            for p in 0..p_n {
                let ch = h * p_n + p;
                let dx = delta[h] * x[ch];
                let row = &mut hs[p * n..(p + 1) * n];
                // The update, then the read-out on `dot`'s lanes: one running sum through
                // the row kept each step waiting on the last add (not vectorised).
                for j in 0..n {
                    row[j] = decay * row[j] + dx * bg[j];
                }
                let acc = dot::<F, F, false>(row, cg);
                let d = if c.d_has_hdim { mw.d[ch] } else { mw.d[h] };
                yh[p] = acc + F::from_f(d as f64) * x[ch];
            }
        });
}
