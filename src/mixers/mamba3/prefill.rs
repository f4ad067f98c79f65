//! Chunked prefill of one mixer layer (spec §4), for a packed batch of sequences.
//!
//! Per (sequence, head), tokens are cut into chunks of `L = chunk_len`. With
//! `Lc_j = Σ_{r ≤ j} a_r` inside a chunk, `c_s = γ_s + γ'_s` (the trapezoid's current weight
//! plus the next token's look-back weight `γ'_s = Δ_{s+1}(1 − λ_{s+1})`, zero for the
//! window's last token) and `S` the `P×N` state entering the chunk:
//!
//! ```text
//! y_j  = Σ_{s<j} e^{Lc_j − Lc_s}·c_s·⟨q̃_j, k̃_s⟩·x_s + γ_j·⟨q̃_j, k̃_j⟩·x_j     (intra-chunk)
//!      + e^{Lc_j}·S·q̃_j                                                     (inter-chunk)
//!      + D·x_j
//! S'   = e^{Lc_end}·S + Σ_s e^{Lc_end − Lc_s}·c_s·outer(x_s, k̃_s)
//! ```
//!
//! The intra- and inter-chunk sums and the state update are GEMMs (`Q̃K̃ᵀ`, `M·X`, `Q̃Sᵀ`,
//! `(wX)ᵀK̃`). A window that continues a state starts from the folded state
//! `S_enter = h⁻ + Δ_0(1 − λ_0)·outer(v⁻, k⁻)` (spec §3.4): the look-back term of the
//! window's first token reaches across the seam.

use super::state::LayerState;
use super::token::{MixerCtx, TokenPre};
use crate::cpu::math::{rotate_pairs, wrap_angle};
use crate::cpu::matmul::{gemm, View, ViewMut};
use crate::cpu::real::Real;
use rayon::prelude::*;

/// Rows `start..start+len` of the packed token matrix belong to one sequence.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    pub start: usize,
    pub len: usize,
}

/// What one (sequence, head) task leaves behind.
struct HeadOut<F> {
    /// gated output `[len, P]`
    y: Vec<F>,
    angle: Vec<F>,
    ssm: Vec<F>,
    k: Vec<F>,
    v: Vec<F>,
}

/// Mixer prefill for every sequence of a packed batch: `proj` is `[rows, d_in_proj]`, `out`
/// receives the gated output `[rows, D_i]` and each
/// sequence's state is advanced past its tokens.
pub fn mixer_prefill<F: Real>(
    ctx: &MixerCtx,
    proj: &[F],
    spans: &[Span],
    states: &mut [LayerState<F>],
    out: &mut [F],
) {
    let d = &ctx.d;
    let rows = spans.iter().map(|s| s.start + s.len).max().unwrap_or(0);
    let pre = ctx.token_pre(proj, rows);
    let tasks: Vec<(usize, usize)> = (0..spans.len())
        .flat_map(|b| (0..d.nheads).map(move |h| (b, h)))
        .collect();
    let results: Vec<HeadOut<F>> = {
        let states_ro: Vec<&LayerState<F>> = states.iter().collect();
        tasks
            .par_iter()
            .map(|&(b, h)| scan_head(ctx, proj, &pre, spans[b], h, states_ro[b]))
            .collect()
    };
    let (p_n, n_n, s_n) = (d.headdim, d.d_state, d.num_rope_angles);
    for (&(b, h), r) in tasks.iter().zip(results) {
        let sp = spans[b];
        for t in 0..sp.len {
            let o = &mut out[(sp.start + t) * d.d_inner + h * p_n..][..p_n];
            o.copy_from_slice(&r.y[t * p_n..(t + 1) * p_n]);
        }
        let st = &mut states[b];
        st.angle[h * s_n..(h + 1) * s_n].copy_from_slice(&r.angle);
        st.ssm[h * p_n * n_n..(h + 1) * p_n * n_n].copy_from_slice(&r.ssm);
        st.k[h * n_n..(h + 1) * n_n].copy_from_slice(&r.k);
        st.v[h * p_n..(h + 1) * p_n].copy_from_slice(&r.v);
    }
}

/// Largest `−Lc_end` for which `e^{Lc_j}` and `e^{−Lc_s}` can be formed separately
/// without overflow; beyond it, every pair gets its own exponential.
fn split_exp_limit<F: Real>() -> F {
    F::from_f(if std::mem::size_of::<F>() == 4 {
        60.0
    } else {
        600.0
    })
}

fn scan_head<F: Real>(
    ctx: &MixerCtx,
    proj: &[F],
    pre: &TokenPre<F>,
    sp: Span,
    h: usize,
    st: &LayerState<F>,
) -> HeadOut<F> {
    let d = &ctx.d;
    let (h_n, p_n, n_n, s_n, l_max) = (
        d.nheads,
        d.headdim,
        d.d_state,
        d.num_rope_angles,
        d.chunk_len,
    );
    let dpi = d.d_in_proj;
    let bc_w = 2 * d.ngroups * n_n;
    let d_skip = F::from_f(ctx.lw.d[h] as f64);

    let mut angle = st.angle[h * s_n..(h + 1) * s_n].to_vec();
    let mut ssm = st.ssm[h * p_n * n_n..(h + 1) * p_n * n_n].to_vec();
    let k_prev = &st.k[h * n_n..(h + 1) * n_n];
    let v_prev = &st.v[h * p_n..(h + 1) * p_n];

    // Boundary fold (spec §3.4).
    if sp.len > 0 {
        let t0 = sp.start;
        let w = pre.delta[t0 * h_n + h] * (F::one() - pre.lambda[t0 * h_n + h]);
        for p in 0..p_n {
            let wv = w * v_prev[p];
            for n in 0..n_n {
                ssm[p * n_n + n] = ssm[p * n_n + n] + wv * k_prev[n];
            }
        }
    }

    let mut y = vec![F::zero(); sp.len * p_n];
    let mut q = vec![F::zero(); l_max * n_n];
    let mut k = vec![F::zero(); l_max * n_n];
    let mut xw = vec![F::zero(); l_max * p_n];
    let mut lc = vec![F::zero(); l_max];
    let mut gamma = vec![F::zero(); l_max];
    let mut scale = vec![F::zero(); l_max];
    let mut m = vec![F::zero(); l_max * l_max];
    let (mut row_f, mut col_f) = (vec![F::zero(); l_max], vec![F::zero(); l_max]);
    let mut inter = vec![F::zero(); l_max * p_n];
    let mut cos = vec![F::zero(); s_n];
    let mut sin = vec![F::zero(); s_n];
    let mut last_k = k_prev.to_vec();
    let mut last_v = v_prev.to_vec();

    let mut c0 = 0;
    while c0 < sp.len {
        let l = l_max.min(sp.len - c0);
        // Per-token: phases, rotated q/k, x, trapezoid weights, cumulative decay.
        let mut acc = F::zero();
        for j in 0..l {
            let t = sp.start + c0 + j;
            let delta = pre.delta[t * h_n + h];
            let lambda = pre.lambda[t * h_n + h];
            for i in 0..s_n {
                angle[i] = wrap_angle(angle[i] + pre.theta[t * s_n + i] * delta);
                (sin[i], cos[i]) = angle[i].sin_cos_fast();
            }
            let (kj, qj) = (
                &mut k[j * n_n..(j + 1) * n_n],
                &mut q[j * n_n..(j + 1) * n_n],
            );
            ctx.biased_kq(&pre.bc[t * bc_w..(t + 1) * bc_w], h, kj, qj);
            rotate_pairs(kj, &cos, &sin);
            rotate_pairs(qj, &cos, &sin);
            gamma[j] = lambda * delta;
            let look_back = if c0 + j + 1 < sp.len {
                pre.delta[(t + 1) * h_n + h] * (F::one() - pre.lambda[(t + 1) * h_n + h])
            } else {
                F::zero()
            };
            scale[j] = gamma[j] + look_back;
            acc = acc + pre.a[t * h_n + h];
            lc[j] = acc;
        }
        let lc_end = lc[l - 1];
        // x rows are read in place from the in_proj output (row stride d_in_proj).
        let x = &proj[(sp.start + c0) * dpi + d.x_off() + h * p_n..];
        let (qv, kv, xv) = (
            View::new(&q[..l * n_n], l, n_n),
            View::new(&k[..l * n_n], l, n_n),
            View::strided(x, l, p_n, dpi, 1),
        );

        // Intra-chunk: M = (Q̃K̃ᵀ) masked and weighted, then Y = M·X. M is lower
        // triangular, so rows [0, a) only need columns [0, a): a quarter of both
        // products is skipped.
        let a = l / 2;
        gemm(
            ViewMut::strided(&mut m, a, a, l, 1),
            None,
            qv.rows(0, a),
            kv.rows(0, a).t(),
            F::one(),
            1,
        );
        gemm(
            ViewMut::strided(&mut m[a * l..], l - a, l, l, 1),
            None,
            qv.rows(a, l),
            kv.t(),
            F::one(),
            1,
        );
        let split = -lc_end < split_exp_limit::<F>();
        if split {
            for j in 0..l {
                row_f[j] = lc[j].exp_fast();
                col_f[j] = (-lc[j]).exp_fast() * scale[j];
            }
        }
        for j in 0..l {
            let row = &mut m[j * l..(j + 1) * l];
            if split {
                let r = row_f[j];
                for s in 0..j {
                    row[s] = row[s] * (r * col_f[s]);
                }
            } else {
                for s in 0..j {
                    row[s] = row[s] * ((lc[j] - lc[s]).exp_fast() * scale[s]);
                }
            }
            row[j] = row[j] * gamma[j];
            row[j + 1..].iter_mut().for_each(|v| *v = F::zero());
        }
        let yc = &mut y[c0 * p_n..(c0 + l) * p_n];
        let (y_top, y_bottom) = yc.split_at_mut(a * p_n);
        let mv = View::new(&m[..l * l], l, l);
        gemm(
            ViewMut::new(y_top, a, p_n),
            None,
            mv.rows(0, a).cols(0, a),
            xv.rows(0, a),
            F::one(),
            1,
        );
        gemm(
            ViewMut::new(y_bottom, l - a, p_n),
            None,
            mv.rows(a, l),
            xv,
            F::one(),
            1,
        );

        // Inter-chunk: Y += diag(e^{Lc})·Q̃·Sᵀ, then the D skip.
        let sv = View::new(&ssm, p_n, n_n);
        gemm(
            ViewMut::new(&mut inter[..l * p_n], l, p_n),
            None,
            qv,
            sv.t(),
            F::one(),
            1,
        );
        for j in 0..l {
            let e = lc[j].exp_fast();
            for p in 0..p_n {
                let i = j * p_n + p;
                yc[i] = yc[i] + e * inter[i] + d_skip * x[j * dpi + p];
            }
        }

        // State: S ← e^{Lc_end}·S + (w ⊙ X)ᵀ·K̃ with w_s = e^{Lc_end − Lc_s}·c_s.
        for j in 0..l {
            let w = (lc_end - lc[j]).exp_fast() * scale[j];
            for p in 0..p_n {
                xw[j * p_n + p] = w * x[j * dpi + p];
            }
        }
        gemm(
            ViewMut::new(&mut ssm, p_n, n_n),
            Some(lc_end.exp_fast()),
            View::new(&xw[..l * p_n], l, p_n).t(),
            kv,
            F::one(),
            1,
        );

        // Gate each token with its z.
        for j in 0..l {
            let t = sp.start + c0 + j;
            let z = &proj[t * dpi + d.z_off() + h * p_n..][..p_n];
            ctx.gate(&mut yc[j * p_n..(j + 1) * p_n], z, h);
        }
        last_k.copy_from_slice(&k[(l - 1) * n_n..l * n_n]);
        last_v.copy_from_slice(&x[(l - 1) * dpi..(l - 1) * dpi + p_n]);
        c0 += l;
    }
    HeadOut {
        y,
        angle,
        ssm,
        k: last_k,
        v: last_v,
    }
}
