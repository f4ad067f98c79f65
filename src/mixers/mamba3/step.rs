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
use super::token::MixerCtx;
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
    let bc_w = 2 * d.ngroups * n_n;
    // At least ~32k state elements per task: below that, waking a thread costs more.
    let min_len = (1usize << 15).div_ceil(p_n * n_n);
    slots.par_iter_mut().with_min_len(min_len).for_each(|s| {
        let (t, h) = (s.row, s.h);
        let delta = pre.delta[t * d.nheads + h];
        let lambda = pre.lambda[t * d.nheads + h];
        let alpha = pre.a[t * d.nheads + h].exp_fast();
        let beta = alpha * delta * (F::one() - lambda);
        let gamma = lambda * delta;
        let mut cos = vec![F::zero(); s_n];
        let mut sin = vec![F::zero(); s_n];
        for i in 0..s_n {
            s.angle[i] = wrap_angle(s.angle[i] + pre.theta[t * s_n + i] * delta);
            (sin[i], cos[i]) = s.angle[i].sin_cos_fast();
        }
        let mut k = vec![F::zero(); n_n];
        let mut q = vec![F::zero(); n_n];
        ctx.biased_kq(&pre.bc[t * bc_w..(t + 1) * bc_w], h, &mut k, &mut q);
        rotate_pairs(&mut k, &cos, &sin);
        rotate_pairs(&mut q, &cos, &sin);
        let x = &proj[t * d.d_in_proj + d.x_off() + h * p_n..][..p_n];
        let d_skip = F::from_f(ctx.lw.d[h] as f64);
        for p in 0..p_n {
            let row = &mut s.ssm[p * n_n..(p + 1) * n_n];
            let (bv, gx) = (beta * s.v[p], gamma * x[p]);
            for n in 0..n_n {
                row[n] = alpha * row[n] + bv * s.k[n] + gx * k[n];
            }
            s.y[p] = dot::<F, F, false>(row, &q) + d_skip * x[p];
        }
        s.k.copy_from_slice(&k);
        s.v.copy_from_slice(x);
        let z = &proj[t * d.d_in_proj + d.z_off() + h * p_n..][..p_n];
        ctx.gate(s.y, z, h);
    });
}
