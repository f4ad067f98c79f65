//! Fast Mamba-1 prefill on the CPU, from a fresh or a carried state. The projections are
//! GEMMs over the window's rows; the selective scan (spec §2.3) keeps its sequential form —
//! each `(channel, state)` pair has its own decay, so there is no matrix form — but runs
//! along channels in the inner loop (contiguous, vectorisable, `exp_fast` in f32, decays
//! below the subnormal range flushed to 0), over
//! blocks of channels in parallel, with each block's state held transposed `[N, block]`
//! in L1 for the whole window.

use super::lm::{
    between_projections, conv_rows, decay_cutoff, decay_exp, lm_rows, project, rms_unit, ConvTaps,
    Scratch,
};
use super::{check_state, layer, layout, State};
use crate::cpu::math::{silu, softplus};
use crate::cpu::Real;
use crate::error::Result;
use crate::mixers::mamba1::weights::{Mamba1Mixer, Mamba1Weights};
use crate::mixers::LogitsWant;
use crate::model::family_config::Mamba1Config;
use rayon::prelude::*;

/// Channels per scan block: a 16-wide block of a 16-state layer is 256 state values, and
/// its rows of Δ, x and y stay in L1 across a whole window.
const BLOCK: usize = 16;

/// Run `tokens` from `state` (advancing it); returns the logits rows asked for, flattened
/// `[rows, vocab_padded]`. Nothing is changed when an argument is refused.
pub fn prefill<F: Real>(
    w: &Mamba1Weights,
    state: &mut State<F>,
    tokens: &[u32],
    want: LogitsWant,
) -> Result<Vec<F>> {
    prefill_rows(w, state, tokens, want, true)
}

/// [`prefill`], returning the hidden states after `norm_f` instead of logits when `!head`.
pub fn prefill_rows<F: Real>(
    w: &Mamba1Weights,
    state: &mut State<F>,
    tokens: &[u32],
    want: LogitsWant,
    head: bool,
) -> Result<Vec<F>> {
    let cfg = w.mixer_config()?.clone();
    check_state(state, &layout(&cfg, w.config.n_layer))?;
    let rows = tokens.len();
    lm_rows(w, tokens, want, head, |l, mw, normed, scratch| {
        let st = layer(state, l, &cfg);
        Ok(between_projections(
            normed,
            rows,
            (&mw.in_proj, mw.in_proj_bias.as_deref()),
            (&mw.out_proj, mw.out_proj_bias.as_deref()),
            scratch,
            |proj, scratch| mixer_rows(&cfg, mw, proj, rows, st.conv, st.ssm, scratch),
        ))
    })
}

/// One layer's mixer over `rows` consecutive tokens of one sequence, from the in_proj
/// output `[rows, 2·D_i]` to the out_proj input `y ⊙ silu(z)` `[rows, D_i]`; advances the
/// conv state `[D_i, K]` and the SSM state `[D_i, N]`. Buffers come from `scratch`.
pub fn mixer_rows<F: Real>(
    c: &Mamba1Config,
    mw: &Mamba1Mixer,
    proj: &[F],
    rows: usize,
    conv_state: &mut [F],
    ssm_state: &mut [F],
    scratch: &mut Scratch<F>,
) -> Vec<F> {
    let xc = conv_rows(
        proj,
        rows,
        (2 * c.d_inner, 0),
        conv_state,
        taps(c, mw),
        scratch,
    );
    let (dbc, delta) = ssm_inputs(c, mw, &xc, rows, scratch);
    let y = scan_rows(c, mw, &xc, &delta, &dbc, rows, ssm_state, scratch);
    let gated = gate_rows(c, &y, proj, rows, scratch);
    for v in [xc, dbc, delta, y] {
        scratch.give(v);
    }
    gated
}

pub(crate) fn taps<'a>(c: &Mamba1Config, mw: &'a Mamba1Mixer) -> ConvTaps<'a> {
    ConvTaps {
        weight: &mw.conv_weight,
        bias: mw.conv_bias.as_deref(),
        d_conv: c.d_conv,
    }
}

/// `[δ ; B ; C] = W_x·xc` per row (FalconMamba's norms applied) and `Δ` `[rows, D_i]`
/// after dt_proj, the bias and the softplus. Rows are independent (any mix of sequences).
pub(crate) fn ssm_inputs<F: Real>(
    c: &Mamba1Config,
    mw: &Mamba1Mixer,
    xc: &[F],
    rows: usize,
    scratch: &mut Scratch<F>,
) -> (Vec<F>, Vec<F>) {
    let (di, n, r) = (c.d_inner, c.d_state, c.dt_rank);
    let mut dbc = project(xc, rows, &mw.x_proj, None, scratch);
    let wd = r + 2 * n;
    if let Some(eps) = c.bcdt_rms_eps {
        let eps = F::from_f(eps);
        for row in dbc.chunks_mut(wd) {
            let (d, bc) = row.split_at_mut(r);
            let (b, cc) = bc.split_at_mut(n);
            rms_unit(d, eps);
            rms_unit(b, eps);
            rms_unit(cc, eps);
        }
    }
    let delta_low: Vec<F> = dbc.chunks(wd).flat_map(|row| row[..r].to_vec()).collect();
    let mut delta = project(&delta_low, rows, &mw.dt_proj, None, scratch);
    for row in delta.chunks_mut(di) {
        for (v, &b) in row.iter_mut().zip(&mw.dt_bias) {
            *v = softplus(*v + F::from_f(b as f64));
        }
    }
    (dbc, delta)
}

/// The selective scan of one sequence over `rows` tokens: `y` `[rows, D_i]` with the D
/// skip; advances `ssm_state` `[D_i, N]`. Blocks of channels run in parallel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn scan_rows<F: Real>(
    c: &Mamba1Config,
    mw: &Mamba1Mixer,
    xc: &[F],
    delta: &[F],
    dbc: &[F],
    rows: usize,
    ssm_state: &mut [F],
    scratch: &mut Scratch<F>,
) -> Vec<F> {
    let (di, n) = (c.d_inner, c.d_state);
    let blocks: Vec<Vec<F>> = ssm_state
        .par_chunks_mut(BLOCK * n)
        .enumerate()
        .map(|(bi, s)| scan_block(c, mw, bi * BLOCK, xc, delta, dbc, rows, s))
        .collect();
    let mut y = scratch.take(rows * di);
    for (bi, yb) in blocks.iter().enumerate() {
        let c0 = bi * BLOCK;
        let width = yb.len() / rows.max(1);
        for t in 0..rows {
            y[t * di + c0..t * di + c0 + width].copy_from_slice(&yb[t * width..(t + 1) * width]);
        }
    }
    y
}

/// `y ⊙ silu(z)` per row, z from the in_proj output `[rows, 2·D_i]`.
pub(crate) fn gate_rows<F: Real>(
    c: &Mamba1Config,
    y: &[F],
    proj: &[F],
    rows: usize,
    scratch: &mut Scratch<F>,
) -> Vec<F> {
    let di = c.d_inner;
    let mut gated = scratch.take(rows * di);
    for t in 0..rows {
        let z = &proj[t * 2 * di + di..(t + 1) * 2 * di];
        for i in 0..di {
            gated[t * di + i] = y[t * di + i] * silu(z[i]);
        }
    }
    gated
}

/// The scan of channels `c0 ..` (one block, `s` = their rows of the state `[width, N]`):
/// returns `y` `[rows, width]` with the D skip, and writes the state back.
#[allow(clippy::too_many_arguments)]
fn scan_block<F: Real>(
    c: &Mamba1Config,
    mw: &Mamba1Mixer,
    c0: usize,
    xc: &[F],
    delta: &[F],
    dbc: &[F],
    rows: usize,
    s: &mut [F],
) -> Vec<F> {
    let (di, n, r) = (c.d_inner, c.d_state, c.dt_rank);
    let wd = r + 2 * n;
    let width = s.len() / n;
    // State and A transposed to [N, width]: the inner loop runs along channels.
    let mut h = vec![F::zero(); n * width];
    let mut a = vec![F::zero(); n * width];
    for i in 0..width {
        for j in 0..n {
            h[j * width + i] = s[i * n + j];
            a[j * width + i] = -F::from_f(mw.a_log[(c0 + i) * n + j] as f64).exp();
        }
    }
    let d: Vec<F> = (0..width).map(|i| F::from_f(mw.d[c0 + i] as f64)).collect();
    let mut y = vec![F::zero(); rows * width];
    let mut dx = vec![F::zero(); width];
    let cutoff = decay_cutoff::<F>();
    for t in 0..rows {
        let dl = &delta[t * di + c0..t * di + c0 + width];
        let xl = &xc[t * di + c0..t * di + c0 + width];
        let b = &dbc[t * wd + r..t * wd + r + n];
        let cc = &dbc[t * wd + r + n..t * wd + r + 2 * n];
        let yt = &mut y[t * width..(t + 1) * width];
        for i in 0..width {
            dx[i] = dl[i] * xl[i];
            yt[i] = d[i] * xl[i];
        }
        for j in 0..n {
            let hj = &mut h[j * width..(j + 1) * width];
            let aj = &a[j * width..(j + 1) * width];
            let (bj, cj) = (b[j], cc[j]);
            update_lanes(hj, yt, aj, dl, &dx, (bj, cj), cutoff);
        }
    }
    for i in 0..width {
        for j in 0..n {
            s[i * n + j] = h[j * width + i];
        }
    }
    y
}

/// `h ← exp(Δ·a)·h + Δx·b`, `y += h·c` along a block's channels: a function of its own so
/// that its slices are known not to alias, one straight loop the compiler vectorises (in
/// builds without overflow checks, which `exp_fast`'s exponent arithmetic would carry).
#[inline(never)]
fn update_lanes<F: Real>(
    h: &mut [F],
    y: &mut [F],
    a: &[F],
    delta: &[F],
    dx: &[F],
    (b, c): (F, F),
    cutoff: F,
) {
    let w = h.len();
    let (y, a, delta, dx) = (&mut y[..w], &a[..w], &delta[..w], &dx[..w]);
    for i in 0..w {
        h[i] = decay_exp(delta[i] * a[i], cutoff) * h[i] + dx[i] * b;
        y[i] = y[i] + h[i] * c;
    }
}
