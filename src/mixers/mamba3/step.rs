//! The decode step of one mixer layer (spec §3.3): one token per sequence, each from and
//! into its own state, written as the recurrence of spec §2.5:
//!
//! ```text
//! h ← α·h + β·outer(v_prev, k_prev) + γ·outer(x, k̃),   y = h·q̃ + D·x
//! α = e^{AΔ},  β = α·Δ·(1 − λ),  γ = λ·Δ
//! ```
//! Phases are wrapped to [0, 2π) as in prefill (the official decode does not wrap; the
//! result is the same modulo 2π).

use super::state::LayerState;
use super::token::{MixerCtx, TokenPre};
use crate::cpu::math::{rotate_pairs, wrap_angle};
use crate::cpu::matmul::dot;
use crate::cpu::real::Real;
use rayon::prelude::*;

/// One head of one sequence: its slices of the state and of the output.
struct HeadSlot<'a, F> {
    row: usize,
    h: usize,
    angle: &'a mut [F],
    ssm: &'a mut [F],
    k: &'a mut [F],
    v: &'a mut [F],
    y: &'a mut [F],
}

/// `proj` is `[B, d_in_proj]` (row b = sequence b's token), `out` gets `[B, D_i]`.
pub fn mixer_step<F: Real>(
    ctx: &MixerCtx,
    proj: &[F],
    states: &mut [LayerState<F>],
    out: &mut [F],
) {
    let d = &ctx.d;
    let (p_n, n_n, s_n) = (d.headdim, d.d_state, d.num_rope_angles);
    let pre = ctx.token_pre(proj, states.len());
    let mut slots: Vec<HeadSlot<F>> = Vec::with_capacity(states.len() * d.nheads);
    for (row, (st, y)) in states.iter_mut().zip(out.chunks_mut(d.d_inner)).enumerate() {
        let st = &mut *st;
        let heads = st
            .angle
            .chunks_mut(s_n)
            .zip(st.ssm.chunks_mut(p_n * n_n))
            .zip(st.k.chunks_mut(n_n))
            .zip(st.v.chunks_mut(p_n))
            .zip(y.chunks_mut(p_n));
        for (h, ((((angle, ssm), k), v), y)) in heads.enumerate() {
            slots.push(HeadSlot {
                row,
                h,
                angle,
                ssm,
                k,
                v,
                y,
            });
        }
    }
    // At least ~32k state elements per task: below that, waking a thread costs more.
    let min_len = (1usize << 15).div_ceil(p_n * n_n);
    slots
        .par_iter_mut()
        .with_min_len(min_len)
        .for_each(|s| head_step(ctx, &pre, proj, s.row, s.h, s.angle, s.ssm, s.k, s.v, s.y));
}

/// Head `h` of row `t` (one sequence's token): advance its state slices (`angle [S]`,
/// `ssm [P, N]`, `k [N]`, `v [P]`) and write its gated output `y [P]`.
#[allow(clippy::too_many_arguments)]
pub fn head_step<F: Real>(
    ctx: &MixerCtx,
    pre: &TokenPre<F>,
    proj: &[F],
    t: usize,
    h: usize,
    angle: &mut [F],
    ssm: &mut [F],
    k_state: &mut [F],
    v_state: &mut [F],
    y: &mut [F],
) {
    let d = &ctx.d;
    let (p_n, n_n, s_n) = (d.headdim, d.d_state, d.num_rope_angles);
    let bc_w = 2 * d.ngroups * n_n;
    let delta = pre.delta[t * d.nheads + h];
    let lambda = pre.lambda[t * d.nheads + h];
    let alpha = pre.a[t * d.nheads + h].exp_fast();
    let beta = alpha * delta * (F::one() - lambda);
    let gamma = lambda * delta;
    // cos, sin [S] and k, q [N], on the stack for the usual sizes
    const STACK: usize = 256;
    let mut stack = [F::zero(); 4 * STACK];
    let mut heap;
    let tmp: &mut [F] = if n_n <= STACK {
        &mut stack
    } else {
        heap = vec![F::zero(); 4 * n_n];
        &mut heap
    };
    let w = n_n.max(STACK);
    let (cs, kq) = tmp.split_at_mut(2 * w);
    let (cos, sin) = cs.split_at_mut(w);
    let (k, q) = kq.split_at_mut(w);
    let (cos, sin, k, q) = (
        &mut cos[..s_n],
        &mut sin[..s_n],
        &mut k[..n_n],
        &mut q[..n_n],
    );
    for i in 0..s_n {
        angle[i] = wrap_angle(angle[i] + pre.theta[t * s_n + i] * delta);
        (sin[i], cos[i]) = angle[i].sin_cos_fast();
    }
    ctx.biased_kq(&pre.bc[t * bc_w..(t + 1) * bc_w], h, k, q);
    rotate_pairs(k, cos, sin);
    rotate_pairs(q, cos, sin);
    let x = &proj[t * d.d_in_proj + d.x_off() + h * p_n..][..p_n];
    let d_skip = F::from_f(ctx.lw.d[h] as f64);
    for p in 0..p_n {
        let row = &mut ssm[p * n_n..(p + 1) * n_n];
        let (bv, gx) = (beta * v_state[p], gamma * x[p]);
        for n in 0..n_n {
            row[n] = alpha * row[n] + bv * k_state[n] + gx * k[n];
        }
        y[p] = dot::<F, F, false>(row, q) + d_skip * x[p];
    }
    k_state.copy_from_slice(k);
    v_state.copy_from_slice(x);
    let z = &proj[t * d.d_in_proj + d.z_off() + h * p_n..][..p_n];
    ctx.gate(y, z, h);
}
