//! Pieces of the Mamba-3 mixer shared by the chunked prefill and the decode step:
//! per-token preprocessing of one `in_proj` row (spec §2.1–§2.3) and the output gate (§2.6).

use super::weights::LayerWeights;
use crate::cpu::math::{a_value, rms_norm, sigmoid, softplus};
use crate::cpu::real::Real;
use crate::model::config::{AActivation, Dims, NORM_EPS};

/// Constants of one layer's mixer, converted once.
pub struct MixerCtx<'a> {
    pub d: Dims,
    pub lw: &'a LayerWeights,
    pub a_floor: f64,
    pub a_act: AActivation,
}

/// Per-token values every head needs, computed once per token.
#[derive(Default)]
pub struct TokenPre<F> {
    /// `B̄` then `C̄`, each `[G, N]`, normed.
    pub bc: Vec<F>,
    /// `[H]` each
    pub delta: Vec<F>,
    pub a: Vec<F>,
    pub lambda: Vec<F>,
    /// `θ_i = π·tanh(ang_i)` `[S]`
    pub theta: Vec<F>,
}

impl MixerCtx<'_> {
    /// Per-token preprocessing of `rows` in_proj rows, into flat per-token arrays.
    pub fn token_pre<F: Real>(&self, proj: &[F], rows: usize) -> TokenPre<F> {
        use rayon::prelude::*;
        let d = &self.d;
        let (h_n, n_n, g_n, s_n) = (d.nheads, d.d_state, d.ngroups, d.num_rope_angles);
        let mut pre = TokenPre {
            bc: vec![F::zero(); rows * 2 * g_n * n_n],
            delta: vec![F::zero(); rows * h_n],
            a: vec![F::zero(); rows * h_n],
            lambda: vec![F::zero(); rows * h_n],
            theta: vec![F::zero(); rows * s_n],
        };
        pre.bc
            .par_chunks_mut(2 * g_n * n_n)
            .zip(pre.delta.par_chunks_mut(h_n))
            .zip(pre.a.par_chunks_mut(h_n))
            .zip(pre.lambda.par_chunks_mut(h_n))
            .zip(pre.theta.par_chunks_mut(s_n))
            .enumerate()
            .with_min_len(16)
            .for_each(|(t, ((((bc, delta), a), lambda), theta))| {
                let row = &proj[t * d.d_in_proj..(t + 1) * d.d_in_proj];
                self.token_row(row, bc, delta, a, lambda, theta);
            });
        pre
    }

    /// [`MixerCtx::token_pre`] into `pre`'s buffers (resized, reused across calls), on the
    /// calling thread: the same values.
    pub fn token_pre_into<F: Real>(&self, proj: &[F], rows: usize, pre: &mut TokenPre<F>) {
        let d = &self.d;
        let (h_n, n_n, g_n, s_n) = (d.nheads, d.d_state, d.ngroups, d.num_rope_angles);
        let bcw = 2 * g_n * n_n;
        pre.bc.resize(rows * bcw, F::zero());
        pre.delta.resize(rows * h_n, F::zero());
        pre.a.resize(rows * h_n, F::zero());
        pre.lambda.resize(rows * h_n, F::zero());
        pre.theta.resize(rows * s_n, F::zero());
        for t in 0..rows {
            self.token_row(
                &proj[t * d.d_in_proj..(t + 1) * d.d_in_proj],
                &mut pre.bc[t * bcw..(t + 1) * bcw],
                &mut pre.delta[t * h_n..(t + 1) * h_n],
                &mut pre.a[t * h_n..(t + 1) * h_n],
                &mut pre.lambda[t * h_n..(t + 1) * h_n],
                &mut pre.theta[t * s_n..(t + 1) * s_n],
            );
        }
    }

    /// One token's values from its in_proj `row`.
    fn token_row<F: Real>(
        &self,
        row: &[F],
        bc: &mut [F],
        delta: &mut [F],
        a: &mut [F],
        lambda: &mut [F],
        theta: &mut [F],
    ) {
        let d = &self.d;
        let (h_n, n_n, g_n, s_n) = (d.nheads, d.d_state, d.ngroups, d.num_rope_angles);
        let eps = F::from_f(NORM_EPS);
        let a_floor = F::from_f(self.a_floor);
        let lw = self.lw;
        let (bn, cn) = bc.split_at_mut(g_n * n_n);
        for g in 0..g_n {
            let b = &row[d.b_off() + g * n_n..d.b_off() + (g + 1) * n_n];
            let c = &row[d.c_off() + g * n_n..d.c_off() + (g + 1) * n_n];
            rms_norm(b, &lw.b_norm, eps, &mut bn[g * n_n..(g + 1) * n_n]);
            rms_norm(c, &lw.c_norm, eps, &mut cn[g * n_n..(g + 1) * n_n]);
        }
        for h in 0..h_n {
            delta[h] = softplus(row[d.dt_off() + h] + F::from_f(lw.dt_bias[h] as f64));
            a[h] = a_value(row[d.a_off() + h], a_floor, self.a_act) * delta[h];
            lambda[h] = sigmoid(row[d.trap_off() + h]);
        }
        for i in 0..s_n {
            theta[i] = F::PI() * row[d.angle_off() + i].tanh();
        }
    }

    /// Biased key and query of head `h` for one token: `k = B̄[g(h)] + B_bias[h]`,
    /// `q = C̄[g(h)] + C_bias[h]` (not yet rotated).
    #[inline]
    pub fn biased_kq<F: Real>(&self, bc: &[F], h: usize, k: &mut [F], q: &mut [F]) {
        let (n_n, g_n) = (self.d.d_state, self.d.ngroups);
        let g = self.d.group_of(h);
        let bn = &bc[g * n_n..(g + 1) * n_n];
        let cn = &bc[(g_n + g) * n_n..(g_n + g + 1) * n_n];
        let bb = &self.lw.b_bias[h * n_n..(h + 1) * n_n];
        let cb = &self.lw.c_bias[h * n_n..(h + 1) * n_n];
        for i in 0..n_n {
            k[i] = bn[i] + F::from_f(bb[i] as f64);
            q[i] = cn[i] + F::from_f(cb[i] as f64);
        }
    }

    /// The gate of head `h` on one token, in place: `y ⊙ silu(z)`, or with the output
    /// norm `rms(y)·w ⊙ silu(z)` over the head's P channels (spec §2.6).
    #[inline]
    pub fn gate<F: Real>(&self, y: &mut [F], z: &[F], h: usize) {
        let p_n = self.d.headdim;
        if let Some(w) = &self.lw.out_norm {
            let mut tmp = [F::zero(); 256];
            let mut heap;
            let normed: &mut [F] = if p_n <= 256 {
                &mut tmp[..p_n]
            } else {
                heap = vec![F::zero(); p_n];
                &mut heap
            };
            rms_norm(y, &w[h * p_n..(h + 1) * p_n], F::from_f(NORM_EPS), normed);
            y.copy_from_slice(normed);
        }
        for (yv, &zv) in y.iter_mut().zip(z) {
            // silu(z) = z·σ(z), with the vectorisable exp
            *yv = *yv * zv / (F::one() + (-zv).exp_fast());
        }
    }
}
