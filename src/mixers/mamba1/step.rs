//! The batched Mamba-1 decode step on the CPU: one token for each of several sequences,
//! each with its own state. The projections (in_proj, x_proj, dt_proj, out_proj) are one
//! product over the batch's rows, reading each weight once; the conv and the scan run per
//! sequence (in parallel) on its own state.

use super::lm::{conv_rows, decay_cutoff, decay_exp, lm_rows, project};
use super::prefill::{gate_rows, ssm_inputs, taps};
use super::weights::{Mamba1Mixer, Mamba1Weights};
use super::{check_state, layer, layout, State};
use crate::cpu::matmul::dot;
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::mixers::LogitsWant;
use crate::model::family_config::Mamba1Config;
use crate::model::state_layout::StateLayout;
use rayon::prelude::*;

/// Advance every `states[i]` by `tokens[i]`; returns the logits `[batch, vocab_padded]`.
/// Nothing is changed when an argument is refused.
pub fn step<F: Real>(
    w: &Mamba1Weights,
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
    let di = cfg.d_inner;
    let wd = cfg.dt_rank + 2 * cfg.d_state;
    let logits = lm_rows(w, tokens, LogitsWant::All, true, |l, mw, normed| {
        let proj = project(normed, b, &mw.in_proj, mw.in_proj_bias.as_deref());
        let mut xc = vec![F::zero(); b * di];
        xc.par_chunks_mut(di)
            .zip(states.par_iter_mut())
            .enumerate()
            .for_each(|(i, (row, st))| {
                let p = &proj[i * 2 * di..(i + 1) * 2 * di];
                let conv = layer(st, l, &cfg).conv;
                row.copy_from_slice(&conv_rows(p, 1, (2 * di, 0), conv, taps(&cfg, mw)));
            });
        let (dbc, delta) = ssm_inputs(&cfg, mw, &xc, b);
        let mut y = vec![F::zero(); b * di];
        y.par_chunks_mut(di)
            .zip(states.par_iter_mut())
            .enumerate()
            .for_each(|(i, (row, st))| {
                let (xr, dr) = (&xc[i * di..(i + 1) * di], &delta[i * di..(i + 1) * di]);
                let bc = &dbc[i * wd + cfg.dt_rank..(i + 1) * wd];
                let ssm = layer(st, l, &cfg).ssm;
                scan_token(&cfg, mw, xr, dr, bc, ssm, row);
            });
        let gated = gate_rows(&cfg, &y, &proj, b);
        Ok(project(
            &gated,
            b,
            &mw.out_proj,
            mw.out_proj_bias.as_deref(),
        ))
    })?;
    Ok(logits)
}

/// One token's selective scan of one sequence (spec §2.3): `x`, `delta` `[D_i]`, `bc` = B
/// then C `[2N]`; advances `ssm` `[D_i, N]` in place and writes `y` `[D_i]` with the D
/// skip. The state stays in its own layout (the prefill's scan transposes blocks of it to
/// run along channels over many tokens, which one token does not repay), `A = −exp(A_log)`
/// and the decays on the vectorised `exp_fast`, and each channel's read-out on the lanes
/// of `dot`: the libm `exp` of A alone was 4 % of a mamba-130m-shaped bf16 decode step.
/// Channels in parallel, a contiguous share per thread.
fn scan_token<F: Real>(
    c: &Mamba1Config,
    mw: &Mamba1Mixer,
    x: &[F],
    delta: &[F],
    bc: &[F],
    ssm: &mut [F],
    y: &mut [F],
) {
    let n = c.d_state;
    let (b, cc) = (&bc[..n], &bc[n..2 * n]);
    let cutoff = decay_cutoff::<F>();
    let share = c.d_inner.div_ceil(rayon::current_num_threads()).max(1);
    ssm.par_chunks_mut(share * n)
        .zip(y.par_chunks_mut(share))
        .enumerate()
        .for_each(|(blk, (s, ys))| {
            let c0 = blk * share;
            let (dl, xs) = (&delta[c0..c0 + ys.len()], &x[c0..c0 + ys.len()]);
            update_rows(s, &mw.a_log[c0 * n..(c0 + ys.len()) * n], b, dl, xs, cutoff);
            for (k, (h, yo)) in s.chunks_exact(n).zip(ys).enumerate() {
                let i = c0 + k;
                *yo = F::from_f(mw.d[i] as f64) * x[i] + dot::<F, F, false>(h, cc);
            }
        });
}

/// `h ← exp(Δ·A)·h + Δx·B` for a share of channels (`h` `[channels, N]`): a function of
/// its own so that its slices are known not to alias, the states' loop one the compiler
/// vectorises.
#[inline(never)]
fn update_rows<F: Real>(h: &mut [F], a_log: &[f32], b: &[F], delta: &[F], x: &[F], cutoff: F) {
    let n = b.len();
    for ((hr, ar), (&dl, &xv)) in h
        .chunks_exact_mut(n)
        .zip(a_log.chunks_exact(n))
        .zip(delta.iter().zip(x))
    {
        let dx = dl * xv;
        for j in 0..n {
            let a = -F::from_f(ar[j] as f64).exp_fast();
            hr[j] = decay_exp(dl * a, cutoff) * hr[j] + dx * b[j];
        }
    }
}

/// Refuse a decode step's arguments before anything is touched: one token per state, each
/// state of the model's `layout`, each token below `vocab`.
pub(crate) fn check_step<F: Copy + num_traits::Zero>(
    states: &[&mut State<F>],
    tokens: &[u32],
    layout: &StateLayout,
    vocab: usize,
) -> Result<()> {
    if states.len() != tokens.len() {
        return Err(Error::input(format!(
            "a decode step takes one token per sequence: {} tokens for {} states",
            tokens.len(),
            states.len()
        )));
    }
    for (st, &t) in states.iter().zip(tokens) {
        check_state(st, layout)?;
        if t as usize >= vocab {
            return Err(Error::TokenOutOfRange {
                id: t as u64,
                pos: 0,
                vocab,
            });
        }
    }
    Ok(())
}
