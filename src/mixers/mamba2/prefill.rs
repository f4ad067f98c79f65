//! Fast Mamba-2 prefill on the CPU: the chunked (SSD) form of spec §3.5, from a fresh or a
//! carried state. The projections are GEMMs over the window's rows; each head's scan runs
//! chunk by chunk as four small products on `gemm` (intra-chunk `(C·Bᵀ ∘ decay)·x̃`, the
//! carried state's read-out `C·Sᵀ`, and the state update `x̃ᵀ·B`), heads in parallel.
//!
//! The chunk length only changes rounding; the recurrence of §3.3 (the reference) is the
//! definition, and the tests hold this path to it.

use super::{layer, layout, State};
use crate::cpu::math::{silu, softplus};
use crate::cpu::matmul::{gemm, View, ViewMut};
use crate::cpu::Real;
use crate::error::Result;
use crate::mixers::mamba1::check_state;
use crate::mixers::mamba1::lm::{
    between_projections, conv_rows, decay_cutoff, decay_exp, lm_rows, rms_unit, ConvTaps, Scratch,
};
use crate::mixers::mamba2::weights::{Mamba2Mixer, Mamba2Weights};
use crate::mixers::LogitsWant;
use crate::model::family_config::Mamba2Config;
use rayon::prelude::*;

/// Run `tokens` from `state` (advancing it); returns the logits rows asked for, flattened
/// `[rows, vocab_padded]`. Nothing is changed when an argument is refused.
pub fn prefill<F: Real>(
    w: &Mamba2Weights,
    state: &mut State<F>,
    tokens: &[u32],
    want: LogitsWant,
) -> Result<Vec<F>> {
    prefill_rows(w, state, tokens, want, true)
}

/// [`prefill`], returning the hidden states after `norm_f` instead of logits when `!head`.
pub fn prefill_rows<F: Real>(
    w: &Mamba2Weights,
    state: &mut State<F>,
    tokens: &[u32],
    want: LogitsWant,
    head: bool,
) -> Result<Vec<F>> {
    let cfg = w.mixer_config()?.clone();
    check_state(state, &layout(&cfg, w.config.n_layer))?;
    let chunk = cfg.chunk_size;
    let rows = tokens.len();
    lm_rows(w, tokens, want, head, |l, mw, normed, scratch| {
        let st = layer(state, l, &cfg);
        Ok(between_projections(
            normed,
            rows,
            (&mw.in_proj, mw.in_proj_bias.as_deref()),
            (&mw.out_proj, mw.out_proj_bias.as_deref()),
            scratch,
            |proj, scratch| mixer_rows(&cfg, mw, proj, rows, (st.conv, st.ssm), chunk, scratch),
        ))
    })
}

/// One layer's mixer over `rows` consecutive tokens of one sequence, from the in_proj
/// output `proj` `[rows, d_in_proj]` to the out_proj input `[rows, D_i]`; advances the
/// conv state `[C_d, K]` and the SSM state `[H, P, N]`. `chunk` is the SSD chunk length.
/// Buffers come from `scratch`.
pub fn mixer_rows<F: Real>(
    c: &Mamba2Config,
    mw: &Mamba2Mixer,
    proj: &[F],
    rows: usize,
    (conv_state, ssm_state): (&mut [F], &mut [F]),
    chunk: usize,
    scratch: &mut Scratch<F>,
) -> Vec<F> {
    let (d_ssm, h_n, width) = (c.d_ssm, c.nheads, c.d_in_proj());
    let xbc_off = 2 * c.d_mlp() + d_ssm;
    let v = conv_rows(
        proj,
        rows,
        (width, xbc_off),
        conv_state,
        taps(c, mw),
        scratch,
    );
    let mut delta = scratch.take(rows * h_n);
    deltas_into(c, mw, proj, rows, &mut delta);
    let q = chunk.max(1).min(rows.max(1));
    let cb = chunk_cb(c, &v, rows, q, scratch);
    let p_n = c.headdim;
    // Each head's y `[rows, P]`, heads one after the other; its chunk temporaries once per
    // task of the pool, not per head.
    let mut per_head = scratch.take(h_n * rows * p_n);
    ssm_state
        .par_chunks_mut(p_n * c.d_state)
        .zip(per_head.par_chunks_mut(rows * p_n))
        .enumerate()
        .for_each_init(
            || HeadTemps::new(q, p_n, c.d_state),
            |tmp, (h, (s, y))| head_scan(c, mw, h, (&v, &delta, &cb), rows, s, q, y, tmp),
        );
    let mut y = scratch.take(rows * d_ssm);
    for t in 0..rows {
        for h in 0..h_n {
            let src = (h * rows + t) * p_n;
            y[t * d_ssm + h * p_n..t * d_ssm + (h + 1) * p_n]
                .copy_from_slice(&per_head[src..src + p_n]);
        }
    }
    let mut o = scratch.take(rows * c.d_inner);
    gate_rows_into(c, mw, proj, &y, rows, &mut o);
    for b in [v, delta, cb, per_head, y] {
        scratch.give(b);
    }
    o
}

pub(crate) fn taps<'a>(c: &Mamba2Config, mw: &'a Mamba2Mixer) -> ConvTaps<'a> {
    ConvTaps {
        weight: &mw.conv_weight,
        bias: mw.conv_bias.as_deref(),
        d_conv: c.d_conv,
    }
}

/// Δ `[rows, H]` after the bias, the softplus and the clamp (spec §3.3), into `delta`, a
/// buffer the caller keeps.
pub(crate) fn deltas_into<F: Real>(
    c: &Mamba2Config,
    mw: &Mamba2Mixer,
    proj: &[F],
    rows: usize,
    delta: &mut Vec<F>,
) {
    let (h_n, width) = (c.nheads, c.d_in_proj());
    let dt_off = 2 * c.d_mlp() + c.d_ssm + c.conv_dim();
    let (lo, hi) = (F::from_f(c.dt_limit.0), F::from_f(c.dt_limit.1));
    delta.resize(rows * h_n, F::zero());
    for t in 0..rows {
        for h in 0..h_n {
            let u = proj[t * width + dt_off + h] + F::from_f(mw.dt_bias[h] as f64);
            delta[t * h_n + h] = softplus(u).max(lo).min(hi);
        }
    }
}

/// From the SSM output `y` `[rows, d_ssm]` to the out_proj input `o` `[rows, D_i]`, a
/// buffer the caller keeps: the gate, the grouped RMSNorm (§3.4) and the gated-MLP branch,
/// row by row.
pub(crate) fn gate_rows_into<F: Real>(
    c: &Mamba2Config,
    mw: &Mamba2Mixer,
    proj: &[F],
    y_ssm: &[F],
    rows: usize,
    o: &mut [F],
) {
    let (d_mlp, d_ssm, width) = (c.d_mlp(), c.d_ssm, c.d_in_proj());
    let z_off = 2 * d_mlp;
    let eps = F::from_f(c.gated_norm_eps);
    for t in 0..rows {
        let pr = &proj[t * width..(t + 1) * width];
        let orow = &mut o[t * c.d_inner..(t + 1) * c.d_inner];
        for i in 0..d_mlp {
            orow[i] = silu(pr[i]) * pr[d_mlp + i];
        }
        let y = &mut orow[d_mlp..];
        y.copy_from_slice(&y_ssm[t * d_ssm..(t + 1) * d_ssm]);
        let z = &pr[z_off..z_off + d_ssm];
        match &mw.norm {
            None => y.iter_mut().zip(z).for_each(|(y, &z)| *y = *y * silu(z)),
            Some(w) => {
                if !c.norm_before_gate {
                    y.iter_mut().zip(z).for_each(|(y, &z)| *y = *y * silu(z));
                }
                for g in y.chunks_mut(d_ssm / c.ngroups) {
                    rms_unit(g, eps);
                }
                for i in 0..d_ssm {
                    y[i] = y[i] * F::from_f(w[i] as f64);
                    if c.norm_before_gate {
                        y[i] = y[i] * silu(z[i]);
                    }
                }
            }
        }
    }
}

/// `C·Bᵀ` of every chunk and group, shared by the group's heads: chunk `k`, group `g` at
/// `[(k·G + g)·q², ..]`, `len × len` row-major for a chunk of `len` rows.
fn chunk_cb<F: Real>(
    c: &Mamba2Config,
    v: &[F],
    rows: usize,
    q: usize,
    scratch: &mut Scratch<F>,
) -> Vec<F> {
    let (n, g_n, cd) = (c.d_state, c.ngroups, c.conv_dim());
    let chunks = rows.div_ceil(q);
    let mut cb = scratch.take(chunks * g_n * q * q);
    cb.par_chunks_mut(q * q)
        .enumerate()
        .for_each(|(slot, out)| {
            let (k, g) = (slot / g_n, slot % g_n);
            let start = k * q;
            let len = q.min(rows - start);
            let b_off = c.d_ssm + g * n;
            let c_off = c.d_ssm + g_n * n + g * n;
            let b_rows = View::strided(&v[start * cd + b_off..], len, n, cd, 1);
            let c_rows = View::strided(&v[start * cd + c_off..], len, n, cd, 1);
            gemm(
                ViewMut::new(&mut out[..len * len], len, len),
                None,
                c_rows,
                b_rows.t(),
                F::one(),
                1,
            );
        });
    cb
}

/// One task's buffers for [`head_scan`]'s chunks.
struct HeadTemps<F> {
    cum: Vec<F>,
    xt: Vec<F>,
    m: Vec<F>,
    c_scaled: Vec<F>,
    b_weighted: Vec<F>,
}

impl<F: Real> HeadTemps<F> {
    fn new(q: usize, p_n: usize, n: usize) -> Self {
        HeadTemps {
            cum: vec![F::zero(); q],
            xt: vec![F::zero(); q * p_n],
            m: vec![F::zero(); q * q],
            c_scaled: vec![F::zero(); q * n],
            b_weighted: vec![F::zero(); q * n],
        }
    }
}

/// Head `h` over all rows, chunk by chunk (spec §3.5): writes its `y` `[rows, P]` (with
/// the D skip) and advances its state `s` `[P, N]`.
#[allow(clippy::too_many_arguments)]
fn head_scan<F: Real>(
    c: &Mamba2Config,
    mw: &Mamba2Mixer,
    h: usize,
    (v, delta, cb): (&[F], &[F], &[F]),
    rows: usize,
    s: &mut [F],
    q: usize,
    y: &mut [F],
    tmp: &mut HeadTemps<F>,
) {
    let (p_n, n, h_n, cd) = (c.headdim, c.d_state, c.nheads, c.conv_dim());
    let g = c.group_of(h);
    let x_off = h * p_n;
    let b_off = c.d_ssm + g * n;
    let c_off = c.d_ssm + c.ngroups * n + g * n;
    let a = -F::from_f(mw.a_log[h] as f64).exp();
    let d_of = |p: usize| {
        F::from_f(if c.d_has_hdim {
            mw.d[x_off + p]
        } else {
            mw.d[h]
        } as f64)
    };
    let cutoff = decay_cutoff::<F>();
    let HeadTemps {
        cum,
        xt,
        m,
        c_scaled,
        b_weighted,
    } = tmp;
    let mut start = 0;
    while start < rows {
        let len = q.min(rows - start);
        // s_i: cumulative log decay within the chunk; x̃ = Δ·x.
        let mut acc = F::zero();
        for i in 0..len {
            let t = start + i;
            let dlt = delta[t * h_n + h];
            acc = acc + dlt * a;
            cum[i] = acc;
            for p in 0..p_n {
                xt[i * p_n + p] = dlt * v[t * cd + x_off + p];
            }
        }
        // M = (C·Bᵀ) ∘ exp(s_i − s_j), lower triangle.
        let slot = ((start / q) * c.ngroups + g) * q * q;
        m[..len * len].copy_from_slice(&cb[slot..slot + len * len]);
        // (the lower triangle and the zeros apart: a branch per element kept the loop
        // scalar, 9 % of a bf16 prefill at the mamba2-780m shape)
        for i in 0..len {
            let (lower, upper) = m[i * len..(i + 1) * len].split_at_mut(i + 1);
            for (e, &cj) in lower.iter_mut().zip(&cum[..=i]) {
                *e = *e * decay_exp(cum[i] - cj, cutoff);
            }
            upper.fill(F::zero());
        }
        let yc = &mut y[start * p_n..(start + len) * p_n];
        gemm(
            ViewMut::new(yc, len, p_n),
            None,
            View::new(&m[..len * len], len, len),
            View::new(&xt[..len * p_n], len, p_n),
            F::one(),
            1,
        );
        // The carried state's contribution: exp(s_i)·(C_i·Sᵀ).
        for i in 0..len {
            let e = decay_exp(cum[i], cutoff);
            for j in 0..n {
                c_scaled[i * n + j] = e * v[(start + i) * cd + c_off + j];
            }
        }
        gemm(
            ViewMut::new(yc, len, p_n),
            Some(F::one()),
            View::new(&c_scaled[..len * n], len, n),
            View::new(s, p_n, n).t(),
            F::one(),
            1,
        );
        for i in 0..len {
            let t = start + i;
            for p in 0..p_n {
                yc[i * p_n + p] = yc[i * p_n + p] + d_of(p) * v[t * cd + x_off + p];
            }
        }
        // S ← exp(s_last)·S + x̃ᵀ·(exp(s_last − s_j)·B_j).
        let last = cum[len - 1];
        for i in 0..len {
            let e = decay_exp(last - cum[i], cutoff);
            for j in 0..n {
                b_weighted[i * n + j] = e * v[(start + i) * cd + b_off + j];
            }
        }
        gemm(
            ViewMut::new(s, p_n, n),
            Some(decay_exp(last, cutoff)),
            View::new(&xt[..len * p_n], len, p_n).t(),
            View::new(&b_weighted[..len * n], len, n),
            F::one(),
            1,
        );
        start += len;
    }
}
