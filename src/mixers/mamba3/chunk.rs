//! One chunk of the chunked scan (spec §4) for one (sequence, head): the routine that the
//! inference prefill ([`super::prefill`]) and the training forward
//! ([`super::train::forward`]) share; the training forward passes a sink that keeps what
//! its backward needs.
//!
//! Tokens are cut into chunks of `L = chunk_len`. With `Lc_j = Σ_{r ≤ j} a_r` inside a
//! chunk, `c_s = γ_s + γ'_s` (the trapezoid's current weight plus the next token's
//! look-back weight `γ'_s = Δ_{s+1}(1 − λ_{s+1})`, zero for the window's last token) and
//! `S` the `P×N` state entering the chunk:
//!
//! ```text
//! y_j  = Σ_{s<j} e^{Lc_j − Lc_s}·c_s·⟨q̃_j, k̃_s⟩·x_s + γ_j·⟨q̃_j, k̃_j⟩·x_j     (intra-chunk)
//!      + e^{Lc_j}·S·q̃_j                                                     (inter-chunk)
//!      + D·x_j
//! S'   = e^{Lc_end}·S + Σ_s e^{Lc_end − Lc_s}·c_s·outer(x_s, k̃_s)
//! ```
//!
//! The intra- and inter-chunk sums and the state update are GEMMs (`Q̃K̃ᵀ`, `M·X`, `Q̃Sᵀ`,
//! `(wX)ᵀK̃`), `y` is left before the gate.

use crate::cpu::math::{rotate_pairs, wrap_angle};
use crate::cpu::matmul::{gemm, View, ViewMut};
use crate::cpu::real::Real;
use crate::model::config::Dims;

/// Rows `start..start+len` of the packed token matrix belong to one sequence.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    pub start: usize,
    pub len: usize,
}

/// The per-token inputs of one head (spec §2.2–§2.3), by row of the packed token matrix.
/// The prefill and the training forward keep them in their own layouts.
pub trait HeadInputs<F> {
    /// `Δ`
    fn delta(&self, r: usize) -> F;
    /// `λ`
    fn lambda(&self, r: usize) -> F;
    /// the log-decay `a = A·Δ`
    fn decay(&self, r: usize) -> F;
    /// `θ`, `[S]`
    fn theta(&self, r: usize) -> &[F];
    /// The biased key and query (not yet rotated), `[N]` each.
    fn kq(&self, r: usize, k: &mut [F], q: &mut [F]);
}

/// Where the training forward keeps the chunk's rotated `k̃, q̃` (`[l, N]`) and the phases'
/// `cos, sin` (`[l, S]`).
pub struct TokenSink<'s, F> {
    pub q: &'s mut [F],
    pub k: &'s mut [F],
    pub cos: &'s mut [F],
    pub sin: &'s mut [F],
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

/// The scan of one (sequence, head), chunk by chunk: the phases and the state it carries,
/// and its scratch, allocated once.
pub struct HeadScan<'a, F, I> {
    inputs: I,
    d: Dims,
    /// the in_proj rows; the head's x is read in place (row stride `d_in_proj`)
    proj: &'a [F],
    sp: Span,
    h: usize,
    d_skip: F,
    /// `φ` `[S]` after the tokens scanned so far
    pub angle: Vec<F>,
    /// `S` `[P, N]` entering the next chunk
    pub state: Vec<F>,
    q: Vec<F>,
    k: Vec<F>,
    xw: Vec<F>,
    lc: Vec<F>,
    gamma: Vec<F>,
    scale: Vec<F>,
    m: Vec<F>,
    row_f: Vec<F>,
    col_f: Vec<F>,
    inter: Vec<F>,
    cos: Vec<F>,
    sin: Vec<F>,
}

impl<'a, F: Real, I: HeadInputs<F>> HeadScan<'a, F, I> {
    /// The scan of head `h` over the rows of `sp`, from the phases `angle` and the state
    /// `state` (already folded, spec §3.4).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        d: &Dims,
        inputs: I,
        proj: &'a [F],
        sp: Span,
        h: usize,
        d_skip: F,
        angle: Vec<F>,
        state: Vec<F>,
    ) -> Self {
        let (p_n, n_n, s_n, l_max) = (d.headdim, d.d_state, d.num_rope_angles, d.chunk_len);
        HeadScan {
            inputs,
            d: *d,
            proj,
            sp,
            h,
            d_skip,
            angle,
            state,
            q: vec![F::zero(); l_max * n_n],
            k: vec![F::zero(); l_max * n_n],
            xw: vec![F::zero(); l_max * p_n],
            lc: vec![F::zero(); l_max],
            gamma: vec![F::zero(); l_max],
            scale: vec![F::zero(); l_max],
            m: vec![F::zero(); l_max * l_max],
            row_f: vec![F::zero(); l_max],
            col_f: vec![F::zero(); l_max],
            inter: vec![F::zero(); l_max * p_n],
            cos: vec![F::zero(); s_n],
            sin: vec![F::zero(); s_n],
        }
    }

    /// The rotated key `k̃` of token `j` of the last chunk scanned.
    pub fn key(&self, j: usize) -> &[F] {
        let n_n = self.d.d_state;
        &self.k[j * n_n..(j + 1) * n_n]
    }

    /// Tokens `c0..c0+l` of the span (a chunk, `l ≤ chunk_len`): writes their `y` before
    /// the gate into `y` (`[l, P]`), advances the phases and the state, and hands the
    /// rotated keys and queries and the phases' cos/sin to `sink`.
    pub fn chunk(&mut self, c0: usize, l: usize, y: &mut [F], mut sink: Option<TokenSink<F>>) {
        let d = self.d;
        let (p_n, n_n, s_n) = (d.headdim, d.d_state, d.num_rope_angles);
        let dpi = d.d_in_proj;
        let (proj, sp, h, d_skip) = (self.proj, self.sp, self.h, self.d_skip);
        let Self {
            inputs,
            angle,
            state,
            q,
            k,
            xw,
            lc,
            gamma,
            scale,
            m,
            row_f,
            col_f,
            inter,
            cos,
            sin,
            ..
        } = self;
        let inputs = &*inputs;

        // Per-token: phases, rotated q/k, trapezoid weights, cumulative decay.
        let mut acc = F::zero();
        for j in 0..l {
            let t = sp.start + c0 + j;
            let delta = inputs.delta(t);
            let lambda = inputs.lambda(t);
            let theta = inputs.theta(t);
            for i in 0..s_n {
                angle[i] = wrap_angle(angle[i] + theta[i] * delta);
                (sin[i], cos[i]) = angle[i].sin_cos_fast();
            }
            let (kj, qj) = (
                &mut k[j * n_n..(j + 1) * n_n],
                &mut q[j * n_n..(j + 1) * n_n],
            );
            inputs.kq(t, kj, qj);
            rotate_pairs(kj, cos, sin);
            rotate_pairs(qj, cos, sin);
            if let Some(s) = sink.as_mut() {
                s.k[j * n_n..(j + 1) * n_n].copy_from_slice(kj);
                s.q[j * n_n..(j + 1) * n_n].copy_from_slice(qj);
                s.cos[j * s_n..(j + 1) * s_n].copy_from_slice(cos);
                s.sin[j * s_n..(j + 1) * s_n].copy_from_slice(sin);
            }
            gamma[j] = lambda * delta;
            let look_back = if c0 + j + 1 < sp.len {
                inputs.delta(t + 1) * (F::one() - inputs.lambda(t + 1))
            } else {
                F::zero()
            };
            scale[j] = gamma[j] + look_back;
            acc = acc + inputs.decay(t);
            lc[j] = acc;
        }
        let lc_end = lc[l - 1];
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
            ViewMut::strided(m, a, a, l, 1),
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
        let yc = &mut y[..l * p_n];
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
        let sv = View::new(state, p_n, n_n);
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
            ViewMut::new(state, p_n, n_n),
            Some(lc_end.exp_fast()),
            View::new(&xw[..l * p_n], l, p_n).t(),
            kv,
            F::one(),
            1,
        );
    }
}
