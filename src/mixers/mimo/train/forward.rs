//! The MIMO mixer's training forward: spec-MIMO §2.8 token by token, per (sequence, head),
//! from a zero state, keeping what [`super::backward`] needs.
//!
//! Per token (shared by the heads) it keeps the normed `B̄`, `C̄` rows with their RMS
//! factors, `Δ`, `A`, `λ` and `θ`; per (sequence, head) the phases' `cos`/`sin`, the
//! rotated keys and queries `k̃_r`, `q̃_r`, the R readouts `y_r` (before the output
//! combination) and the state entering every chunk of `chunk_len` tokens — the backward
//! recomputes the states inside a chunk from it instead of keeping `T` states of `P×N`.
//!
//! The arithmetic is [`crate::mixers::mimo::reference`]'s, operation for operation, on the
//! trainable parameters in `F` instead of the f32 inference weights.

#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the spec's formulas

use super::MimoShape;
use crate::cpu::math::{a_value, sigmoid, silu, softplus, wrap_angle};
use crate::cpu::matmul::dot;
use crate::cpu::ops::rms_fwd;
use crate::cpu::Real;
use crate::mixers::mamba3::params::{LayerParams, MimoRankParams};
use crate::mixers::mimo::reference::rotate_half;
use rayon::prelude::*;

/// Per-token values every head reads (spec-MIMO §2.2–§2.3), `rows = batch·seq_len`.
pub(super) struct RowSaved<F> {
    /// `B̄` `[rows, R, G, N]`, RMS-normed per (rank, group) row
    pub(super) bn: Vec<F>,
    /// `C̄` `[rows, R, G, N]`
    pub(super) cn: Vec<F>,
    /// RMS factors of the `B` rows `[rows, R·G]`
    pub(super) rb: Vec<F>,
    /// RMS factors of the `C` rows `[rows, R·G]`
    pub(super) rc: Vec<F>,
    /// `Δ` `[rows, H]`
    pub(super) delta: Vec<F>,
    /// `A` `[rows, H]` (the decay is `a = A·Δ`)
    pub(super) aval: Vec<F>,
    /// `λ = σ(trap)` `[rows, H]`
    pub(super) lambda: Vec<F>,
    /// `θ = π·tanh(ang)` `[rows, S]`
    pub(super) theta: Vec<F>,
}

/// What one (sequence, head) keeps, each `[T, …]`.
pub(super) struct HeadSaved<F> {
    /// `cos φ`, `sin φ` `[T, S]`
    pub(super) cos: Vec<F>,
    pub(super) sin: Vec<F>,
    /// rotated keys `k̃` `[T, R, N]`
    pub(super) k: Vec<F>,
    /// rotated queries `q̃` `[T, R, N]`
    pub(super) q: Vec<F>,
    /// readouts `y_r = h·q̃_r + D·u_r` `[T, R, P]`
    pub(super) y: Vec<F>,
    /// the state entering each chunk `[nchunks, P, N]`
    pub(super) states: Vec<F>,
}

/// What the training forward of one MIMO mixer keeps for its backward.
pub struct MimoSaved<F> {
    pub(super) rows: RowSaved<F>,
    /// per (sequence, head), index `b·H + h`
    pub(super) heads: Vec<HeadSaved<F>>,
    /// the combined output `o` `[rows, D_i]` (the input of `out_proj`)
    pub o: Vec<F>,
}

/// The per-rank projections of a MIMO layer (present by construction of its `Params`).
pub(super) fn rank_params<F>(lp: &LayerParams<F>) -> &MimoRankParams<F> {
    lp.mimo
        .as_ref()
        .expect("a MIMO layer's parameters hold mimo_x, mimo_z and mimo_o")
}

/// Per-token preprocessing of every row of `proj` (`[rows, d_in_proj]`).
fn rows_pre<F: Real>(sh: &MimoShape, lp: &LayerParams<F>, proj: &[F]) -> RowSaved<F> {
    let d = &sh.d;
    let rows = sh.batch * sh.seq_len;
    let (h_n, n_n, s_n, bcw) = (d.nheads, d.d_state, d.num_rope_angles, d.bc_width());
    let nrow = bcw / n_n;
    let mut rs = RowSaved {
        bn: vec![F::zero(); rows * bcw],
        cn: vec![F::zero(); rows * bcw],
        rb: vec![F::zero(); rows * nrow],
        rc: vec![F::zero(); rows * nrow],
        delta: vec![F::zero(); rows * h_n],
        aval: vec![F::zero(); rows * h_n],
        lambda: vec![F::zero(); rows * h_n],
        theta: vec![F::zero(); rows * s_n],
    };
    let a_floor = F::from_f(sh.a_floor);
    rs.bn
        .par_chunks_mut(bcw)
        .zip(rs.cn.par_chunks_mut(bcw))
        .zip(rs.rb.par_chunks_mut(nrow))
        .zip(rs.rc.par_chunks_mut(nrow))
        .zip(rs.delta.par_chunks_mut(h_n))
        .zip(rs.aval.par_chunks_mut(h_n))
        .zip(rs.lambda.par_chunks_mut(h_n))
        .zip(rs.theta.par_chunks_mut(s_n))
        .enumerate()
        .for_each(
            |(t, (((((((bn, cn), rb), rc), delta), aval), lambda), theta))| {
                let row = &proj[t * d.d_in_proj..(t + 1) * d.d_in_proj];
                // One N-wide RMSNorm per (rank, group) row, all sharing w_B (resp. w_C).
                for j in 0..nrow {
                    let src = j * n_n..(j + 1) * n_n;
                    let b = &row[d.b_off()..][src.clone()];
                    rb[j] = rms_fwd(b, &lp.b_norm, &mut bn[src.clone()]);
                    let c = &row[d.c_off()..][src.clone()];
                    rc[j] = rms_fwd(c, &lp.c_norm, &mut cn[src]);
                }
                for h in 0..h_n {
                    delta[h] = softplus(row[d.dt_off() + h] + lp.dt_bias[h]);
                    aval[h] = a_value(row[d.a_off() + h], a_floor, sh.a_act);
                    lambda[h] = sigmoid(row[d.trap_off() + h]);
                }
                for i in 0..s_n {
                    theta[i] = F::PI() * row[d.angle_off() + i].tanh();
                }
            },
        );
    rs
}

/// Biased, unrotated key and query of head `h`, rank `r` at row `row`:
/// `k = B̄[r][g(h)] + B_bias[h][r]`, `q = C̄[r][g(h)] + C_bias[h][r]`.
pub(super) fn biased_kq<F: Real>(
    sh: &MimoShape,
    lp: &LayerParams<F>,
    rs: &RowSaved<F>,
    (row, h, r): (usize, usize, usize),
    k: &mut [F],
    q: &mut [F],
) {
    let d = &sh.d;
    let n_n = d.d_state;
    let src = row * d.bc_width() + d.bc_row(r, d.group_of(h));
    let bias = (h * d.rank + r) * n_n;
    for i in 0..n_n {
        k[i] = rs.bn[src + i] + lp.b_bias[bias + i];
        q[i] = rs.cn[src + i] + lp.c_bias[bias + i];
    }
}

/// The scalars of the recurrence at row `row`, head `h`: `(α, β, γ)` with `α = e^{AΔ}`,
/// `β = α·Δ·(1 − λ)`, `γ = λ·Δ` (spec-MIMO §2.6).
#[inline]
pub(super) fn abg<F: Real>(rs: &RowSaved<F>, i: usize) -> (F, F, F) {
    let (delta, lambda) = (rs.delta[i], rs.lambda[i]);
    let alpha = (rs.aval[i] * delta).exp();
    (alpha, alpha * delta * (F::one() - lambda), lambda * delta)
}

/// One token's state update of head `h` (spec-MIMO §2.6), in place on `s` (`[P, N]`):
/// `s ← α·s + Σ_r [β·outer(x⁻ ⊙ ψ_r, k̃⁻_r) + γ·outer(x ⊙ ψ_r, k̃_r)]`; `prev` is `None`
/// at the first token of a window (no previous-token term).
pub(super) fn advance<F: Real>(
    sh: &MimoShape,
    psi: &[F],
    (alpha, beta, gamma): (F, F, F),
    prev: Option<(&[F], &[F])>,
    x: &[F],
    k: &[F],
    s: &mut [F],
) {
    let (p_n, n_n, r_n) = (sh.d.headdim, sh.d.d_state, sh.d.rank);
    for v in s.iter_mut() {
        *v = alpha * *v;
    }
    for r in 0..r_n {
        let ps = &psi[r * p_n..(r + 1) * p_n];
        let kr = &k[r * n_n..(r + 1) * n_n];
        for p in 0..p_n {
            let wg = gamma * x[p] * ps[p];
            let row = &mut s[p * n_n..(p + 1) * n_n];
            // Zipped slices: no bounds checks, so the loops vectorise.
            match prev {
                Some((xprev, kprev)) => {
                    let wb = beta * xprev[p] * ps[p];
                    let kp = &kprev[r * n_n..(r + 1) * n_n];
                    for ((v, &a), &b) in row.iter_mut().zip(kp).zip(kr) {
                        *v = *v + wb * a + wg * b;
                    }
                }
                None => {
                    for (v, &b) in row.iter_mut().zip(kr) {
                        *v = *v + wg * b;
                    }
                }
            }
        }
    }
}

/// `o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r)` for one head (spec-MIMO §2.7); `psi_zo` are
/// the head's `(ζ, ω)` `[R, P]`, `w_norm` its slice of the output norm, if any.
pub(super) fn combine<F: Real>(
    y: &[F],
    z: &[F],
    (zeta, omega): (&[F], &[F]),
    w_norm: Option<&[F]>,
    o: &mut [F],
) {
    let p_n = z.len();
    o.iter_mut().for_each(|v| *v = F::zero());
    // Called per (token, head): no allocation for usual head sizes.
    let mut stack = [F::zero(); 256];
    let mut heap;
    let normed: &mut [F] = if p_n <= stack.len() {
        &mut stack[..p_n]
    } else {
        heap = vec![F::zero(); p_n];
        &mut heap
    };
    for r in 0..y.len() / p_n {
        let yr = &y[r * p_n..(r + 1) * p_n];
        let g: &[F] = match w_norm {
            Some(w) => {
                rms_fwd(yr, w, normed);
                normed
            }
            None => yr,
        };
        for p in 0..p_n {
            let a = z[p] * zeta[r * p_n + p];
            o[p] = o[p] + omega[r * p_n + p] * g[p] * silu(a);
        }
    }
}

/// The slices `[R, P]` of head `h` in a `[H, R, P]` tensor.
#[inline]
pub(super) fn head_of<'v, F>(v: &'v [F], sh: &MimoShape, h: usize) -> &'v [F] {
    let w = sh.d.rank * sh.d.headdim;
    &v[h * w..(h + 1) * w]
}

/// Spec-MIMO §2.8 for one (sequence, head) from a zero state; writes the head's output
/// `[T, P]` into `o_head`.
fn head_forward<F: Real>(
    sh: &MimoShape,
    lp: &LayerParams<F>,
    proj: &[F],
    rs: &RowSaved<F>,
    b: usize,
    h: usize,
    o_head: &mut [F],
) -> HeadSaved<F> {
    let d = &sh.d;
    let (h_n, p_n, n_n, r_n, s_n, t_n) = (
        d.nheads,
        d.headdim,
        d.d_state,
        d.rank,
        d.num_rope_angles,
        sh.seq_len,
    );
    let mp = rank_params(lp);
    let (psi, zo) = (
        head_of(&mp.x, sh, h),
        (head_of(&mp.z, sh, h), head_of(&mp.o, sh, h)),
    );
    let w_norm = lp.out_norm.as_ref().map(|w| &w[h * p_n..(h + 1) * p_n]);
    let (rk, rp) = (r_n * n_n, r_n * p_n);
    let mut hs = HeadSaved {
        cos: vec![F::zero(); t_n * s_n],
        sin: vec![F::zero(); t_n * s_n],
        k: vec![F::zero(); t_n * rk],
        q: vec![F::zero(); t_n * rk],
        y: vec![F::zero(); t_n * rp],
        states: Vec::with_capacity(t_n.div_ceil(d.chunk_len) * p_n * n_n),
    };
    let mut phi = vec![F::zero(); s_n];
    let mut s = vec![F::zero(); p_n * n_n];
    let dh = lp.d[h];
    for t in 0..t_n {
        if t % d.chunk_len == 0 {
            hs.states.extend_from_slice(&s);
        }
        let row = b * t_n + t;
        let i = row * h_n + h;
        let (cos, sin) = (
            &mut hs.cos[t * s_n..(t + 1) * s_n],
            &mut hs.sin[t * s_n..(t + 1) * s_n],
        );
        for j in 0..s_n {
            phi[j] = wrap_angle(phi[j] + rs.theta[row * s_n + j] * rs.delta[i]);
            (sin[j], cos[j]) = phi[j].sin_cos();
        }
        for r in 0..r_n {
            let kr = &mut hs.k[t * rk + r * n_n..][..n_n];
            let qr = &mut hs.q[t * rk + r * n_n..][..n_n];
            biased_kq(sh, lp, rs, (row, h, r), kr, qr);
            rotate_half(kr, cos, sin);
            rotate_half(qr, cos, sin);
        }
        let x = &proj[row * d.d_in_proj + d.x_off() + h * p_n..][..p_n];
        let (done, now) = hs.k.split_at(t * rk);
        let prev = (t > 0).then(|| {
            let xprev = &proj[(row - 1) * d.d_in_proj + d.x_off() + h * p_n..][..p_n];
            (xprev, &done[(t - 1) * rk..])
        });
        advance(sh, psi, abg(rs, i), prev, x, &now[..rk], &mut s);
        for r in 0..r_n {
            let qr = &hs.q[t * rk + r * n_n..][..n_n];
            for p in 0..p_n {
                let acc = dot::<F, F, false>(&s[p * n_n..(p + 1) * n_n], qr);
                hs.y[t * rp + r * p_n + p] = acc + dh * x[p] * psi[r * p_n + p];
            }
        }
        let z = &proj[row * d.d_in_proj + d.z_off() + h * p_n..][..p_n];
        combine(
            &hs.y[t * rp..(t + 1) * rp],
            z,
            zo,
            w_norm,
            &mut o_head[t * p_n..(t + 1) * p_n],
        );
    }
    hs
}

/// The training forward of one MIMO mixer over `proj` (`[rows, d_in_proj]`, the
/// `in_proj` output of `batch` windows of `seq_len` tokens, each from a zero state).
pub fn mimo_mixer_forward<F: Real>(
    sh: &MimoShape,
    lp: &LayerParams<F>,
    proj: &[F],
) -> MimoSaved<F> {
    let d = &sh.d;
    let (h_n, p_n, t_n) = (d.nheads, d.headdim, sh.seq_len);
    let rows = rows_pre(sh, lp, proj);
    // Each (sequence, head) writes its own `[T, P]` block; gathered into rows below.
    let mut o_heads = vec![F::zero(); sh.batch * h_n * t_n * p_n];
    let heads: Vec<HeadSaved<F>> = o_heads
        .par_chunks_mut(t_n * p_n)
        .enumerate()
        .map(|(j, oh)| head_forward(sh, lp, proj, &rows, j / h_n, j % h_n, oh))
        .collect();
    let mut o = vec![F::zero(); sh.batch * t_n * d.d_inner];
    for (j, oh) in o_heads.chunks(t_n * p_n).enumerate() {
        let (b, h) = (j / h_n, j % h_n);
        for t in 0..t_n {
            o[(b * t_n + t) * d.d_inner + h * p_n..][..p_n]
                .copy_from_slice(&oh[t * p_n..(t + 1) * p_n]);
        }
    }
    MimoSaved { rows, heads, o }
}
