//! The batched Mamba-1 decode step on the CPU: one token for each of several sequences,
//! each with its own state. The projections (in_proj, x_proj, dt_proj, out_proj) are one
//! product over the batch's rows, reading each weight once; the conv and the scan run per
//! sequence (in parallel) on its own state.

use super::lm::{conv_rows, lm_rows, project};
use super::prefill::{gate_rows, scan_rows, ssm_inputs, taps};
use super::{check_state, layer, layout, State};
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::mixers::mamba1::weights::Mamba1Weights;
use crate::mixers::LogitsWant;
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
                let br = &dbc[i * wd..(i + 1) * wd];
                let ssm = layer(st, l, &cfg).ssm;
                row.copy_from_slice(&scan_rows(&cfg, mw, xr, dr, br, 1, ssm));
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
