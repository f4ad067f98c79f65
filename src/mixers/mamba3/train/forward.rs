//! The Mamba-3 SISO mixer for training: the chunked forward of spec §4, keeping what the
//! backward needs, and its exact backward, chunk by chunk in reverse with the state
//! gradient carried backwards.
//!
//! # Forward (per sequence and head; spec §2, §4.1; windows start from a zero state)
//!
//! Per token `t`: `Δ_t = softplus(dd_dt + dt_bias)`, `A_t = min(−f(dd_A), −A_floor)`,
//! `a_t = A_t·Δ_t`, `λ_t = σ(trap_t)`, `γ_t = λ_t·Δ_t`, `c_t = γ_t + Δ_{t+1}(1 − λ_{t+1})`
//! (the second term zero for the last token), `θ_{t,i} = π·tanh(ang_{t,i})`,
//! `φ_t = wrap(φ_{t−1} + θ_t·Δ_t)`, `k = B̄_{g(h)} + B_bias`, `q = C̄_{g(h)} + C_bias`,
//! `k̃_t = R(φ_t)·k`, `q̃_t = R(φ_t)·q` (pairwise rotation).
//!
//! Tokens are cut into chunks of `L`; inside a chunk `lc_j = Σ_{r≤j} a_r` and, with `S` the
//! `P×N` state entering the chunk,
//!
//! ```text
//! W_{j,s} = e^{lc_j − lc_s}·c_s  (s < j),   γ_j  (s = j),   0  (s > j)
//! Y  = (W ∘ Q̃K̃ᵀ)·X + diag(e^{lc})·Q̃·Sᵀ + D·X                    y before the gate
//! S' = e^{lc_end}·S + Σ_s w_s·outer(x_s, k̃_s),   w_s = e^{lc_end − lc_s}·c_s
//! ```
//!
//! The chunks are [`crate::mixers::mamba3::chunk`]'s, as in the prefill; through its sink
//! the forward saves per (sequence, head) `Q̃, K̃` (`[T, N]`), the phases' `cos, sin` and the
//! state entering every chunk; per token the normed `B̄, C̄` with their RMS factors, `Δ`,
//! `A`, `λ`, `θ`, and the mixer's `y` (before the gate) and `o` (after it).
//!
//! # Backward
//!
//! Given `dY` (the gradient of `y`, through the gate) and `dS'` (zero after the last chunk),
//! per chunk in reverse, with `Ā = Q̃K̃ᵀ` and `Σ = W ∘ Ā` (both lower-triangular):
//!
//! ```text
//! G   = dY·Xᵀ masked to s ≤ j          dX  += Σᵀ·dY + D·dY            dD += Σ_j ⟨dy_j, x_j⟩
//! dQ̃ += (G∘W)·K̃                        dK̃ += (G∘W)ᵀ·Q̃
//! dW_{j,s} = G_{j,s}·Ā_{j,s}:  s < j:  dc_s += dW·e^{lc_j−lc_s},  dlc_j += dW·W,  dlc_s −= dW·W
//!                              s = j:  dγ_j += dW
//! inter:  I = Q̃·Sᵀ;  dlc_j += e^{lc_j}⟨dy_j, I_j⟩;  dQ̃_j += e^{lc_j}·S·dy_j…  (dQ̃ += diag(e^{lc})dY·S)
//!         dS  = diag(e^{lc})dYᵀ·Q̃ + e^{lc_end}·dS'        dlc_end += e^{lc_end}⟨dS', S⟩
//! state:  V = X·dS', U = K̃·dS'ᵀ, u_s = ⟨V_s, k̃_s⟩:
//!         dk̃_s += w_s·V_s,  dx_s += w_s·U_s,  dc_s += e^{lc_end−lc_s}·u_s,
//!         dlc_s −= w_s·u_s,  dlc_end += w_s·u_s
//! da_r = Σ_{j ≥ r} dlc_j   (lc_end is lc of the chunk's last token)
//! ```
//!
//! and `dS` goes to the previous chunk as its `dS'`. Then per token, in reverse over the
//! whole sequence: `dγ_t += dc_t`, `dΔ_{t+1} += dc_t(1 − λ_{t+1})`,
//! `dλ_{t+1} −= dc_t·Δ_{t+1}`; `dλ_t += dγ_t·Δ_t`, `dΔ_t += dγ_t·λ_t`; `dA_t = da_t·Δ_t`,
//! `dΔ_t += da_t·A_t`. The rotation: `dq = R(φ)ᵀ·dq̃` and, per pair `(2i, 2i+1)`,
//! `dφ_i += −dq̃_{2i}·q̃_{2i+1} + dq̃_{2i+1}·q̃_{2i}` (same for k); the wrap has derivative 1,
//! so with `g_t = Σ_{t' ≥ t} dφ_{t'}`: `dθ_{t,i} += g_{t,i}·Δ_t`, `dΔ_t += Σ_i g_{t,i}·θ_{t,i}`.
//! Finally to the in_proj row: `d dd_dt = dΔ·softplus'`, `d dd_A = −f'(dd_A)·dA` where the
//! floor is not active, `d trap = dλ·λ(1−λ)`, `d ang = π(1 − tanh²)·Σ_h dθ`, `dk`/`dq`
//! summed over the heads of a group into `dB̄`/`dC̄` (and into `B_bias`/`C_bias`), then
//! through the B/C RMSNorm.
//!
//! All products are GEMMs on the `gemm` wrapper; (sequence, head) pairs run in parallel.
//! The backward itself is in [`super::backward`].

#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the math above

use crate::cpu::math::{a_value, sigmoid, silu, softplus};
use crate::cpu::ops::rms_fwd;
use crate::cpu::Real;
use crate::mixers::mamba3::chunk::{HeadInputs, HeadScan, Span, TokenSink};
use crate::mixers::mamba3::params::LayerParams;
use crate::model::config::{AActivation, Dims};
use rayon::prelude::*;

/// The mixer's constants for one layer.
#[derive(Clone, Copy)]
pub struct MixerShape {
    pub d: Dims,
    pub a_floor: f64,
    pub a_act: AActivation,
    /// sequences in the batch, each `seq_len` rows
    pub batch: usize,
    pub seq_len: usize,
}

pub(super) struct HeadSaved<F> {
    pub(super) q: Vec<F>,
    pub(super) k: Vec<F>,
    pub(super) cos: Vec<F>,
    pub(super) sin: Vec<F>,
    /// state entering each chunk, `[nchunks, P·N]`
    pub(super) states: Vec<F>,
}

/// What the training forward of one mixer keeps for its backward.
pub struct MixerSaved<F> {
    /// normed `B̄` then `C̄`, `[rows, 2, G, N]`
    pub(super) bcn: Vec<F>,
    /// their RMS factors `[rows, 2, G]`
    pub(super) rbc: Vec<F>,
    pub(super) delta: Vec<F>,
    pub(super) aval: Vec<F>,
    pub(super) lambda: Vec<F>,
    pub(super) theta: Vec<F>,
    pub(super) heads: Vec<HeadSaved<F>>,
    /// `y` before the gate, `[rows, D_i]`
    pub(super) y: Vec<F>,
    /// RMS factors of the output norm per (row, head)
    pub(super) ry: Vec<F>,
    /// the gated output `o`, `[rows, D_i]` (the input of out_proj)
    pub o: Vec<F>,
}

/// Per-token preprocessing (spec §2.2–§2.3).
fn token_pre<F: Real>(sh: &MixerShape, lp: &LayerParams<F>, proj: &[F]) -> MixerSaved<F> {
    let d = &sh.d;
    let rows = sh.batch * sh.seq_len;
    let (h_n, n_n, g_n, s_n) = (d.nheads, d.d_state, d.ngroups, d.num_rope_angles);
    let mut sv = MixerSaved {
        bcn: vec![F::zero(); rows * 2 * g_n * n_n],
        rbc: vec![F::zero(); rows * 2 * g_n],
        delta: vec![F::zero(); rows * h_n],
        aval: vec![F::zero(); rows * h_n],
        lambda: vec![F::zero(); rows * h_n],
        theta: vec![F::zero(); rows * s_n],
        heads: Vec::new(),
        y: Vec::new(),
        ry: Vec::new(),
        o: Vec::new(),
    };
    let a_floor = F::from_f(sh.a_floor);
    sv.bcn
        .par_chunks_mut(2 * g_n * n_n)
        .zip(sv.rbc.par_chunks_mut(2 * g_n))
        .zip(sv.delta.par_chunks_mut(h_n))
        .zip(sv.aval.par_chunks_mut(h_n))
        .zip(sv.lambda.par_chunks_mut(h_n))
        .zip(sv.theta.par_chunks_mut(s_n))
        .enumerate()
        .for_each(|(t, (((((bc, rbc), delta), aval), lambda), theta))| {
            let row = &proj[t * d.d_in_proj..(t + 1) * d.d_in_proj];
            for g in 0..g_n {
                let b = &row[d.b_off() + g * n_n..][..n_n];
                let c = &row[d.c_off() + g * n_n..][..n_n];
                rbc[g] = rms_fwd(b, &lp.b_norm, &mut bc[g * n_n..(g + 1) * n_n]);
                rbc[g_n + g] = rms_fwd(c, &lp.c_norm, &mut bc[(g_n + g) * n_n..][..n_n]);
            }
            for h in 0..h_n {
                delta[h] = softplus(row[d.dt_off() + h] + lp.dt_bias[h]);
                aval[h] = a_value(row[d.a_off() + h], a_floor, sh.a_act);
                lambda[h] = sigmoid(row[d.trap_off() + h]);
            }
            for i in 0..s_n {
                theta[i] = F::PI() * row[d.angle_off() + i].tanh();
            }
        });
    sv
}

/// The training forward's per-token inputs of head `h`.
struct TrainInputs<'s, F> {
    sh: &'s MixerShape,
    lp: &'s LayerParams<F>,
    sv: &'s MixerSaved<F>,
    h: usize,
}

impl<F: Real> HeadInputs<F> for TrainInputs<'_, F> {
    #[inline(always)]
    fn delta(&self, r: usize) -> F {
        self.sv.delta[r * self.sh.d.nheads + self.h]
    }
    #[inline(always)]
    fn lambda(&self, r: usize) -> F {
        self.sv.lambda[r * self.sh.d.nheads + self.h]
    }
    #[inline(always)]
    fn decay(&self, r: usize) -> F {
        let i = r * self.sh.d.nheads + self.h;
        self.sv.aval[i] * self.sv.delta[i]
    }
    #[inline(always)]
    fn theta(&self, r: usize) -> &[F] {
        let s_n = self.sh.d.num_rope_angles;
        &self.sv.theta[r * s_n..(r + 1) * s_n]
    }
    #[inline(always)]
    fn kq(&self, r: usize, k: &mut [F], q: &mut [F]) {
        let d = &self.sh.d;
        let (n_n, g_n, h) = (d.d_state, d.ngroups, self.h);
        let g = d.group_of(h);
        let bc = &self.sv.bcn[r * 2 * g_n * n_n..];
        for i in 0..n_n {
            k[i] = bc[g * n_n + i] + self.lp.b_bias[h * n_n + i];
            q[i] = bc[(g_n + g) * n_n + i] + self.lp.c_bias[h * n_n + i];
        }
    }
}

/// The chunked forward of one (sequence, head) from a zero state: what the backward needs,
/// and `y` before the gate `[T, P]`.
fn head_forward<F: Real>(
    sh: &MixerShape,
    lp: &LayerParams<F>,
    proj: &[F],
    sv: &MixerSaved<F>,
    b: usize,
    h: usize,
) -> (HeadSaved<F>, Vec<F>) {
    let d = &sh.d;
    let (p_n, n_n, s_n, lmax, t_n) = (
        d.headdim,
        d.d_state,
        d.num_rope_angles,
        d.chunk_len,
        sh.seq_len,
    );
    let mut hs = HeadSaved {
        q: vec![F::zero(); t_n * n_n],
        k: vec![F::zero(); t_n * n_n],
        cos: vec![F::zero(); t_n * s_n],
        sin: vec![F::zero(); t_n * s_n],
        states: Vec::with_capacity(t_n.div_ceil(lmax) * p_n * n_n),
    };
    let sp = Span {
        start: b * t_n,
        len: t_n,
    };
    let inputs = TrainInputs { sh, lp, sv, h };
    let (angle, state) = (vec![F::zero(); s_n], vec![F::zero(); p_n * n_n]);
    let mut scan = HeadScan::new(d, inputs, proj, sp, h, lp.d[h], angle, state);
    let mut y = vec![F::zero(); t_n * p_n];
    let mut c0 = 0;
    while c0 < t_n {
        let l = lmax.min(t_n - c0);
        hs.states.extend_from_slice(&scan.state);
        let sink = TokenSink {
            q: &mut hs.q[c0 * n_n..(c0 + l) * n_n],
            k: &mut hs.k[c0 * n_n..(c0 + l) * n_n],
            cos: &mut hs.cos[c0 * s_n..(c0 + l) * s_n],
            sin: &mut hs.sin[c0 * s_n..(c0 + l) * s_n],
        };
        scan.chunk(c0, l, &mut y[c0 * p_n..(c0 + l) * p_n], Some(sink));
        c0 += l;
    }
    (hs, y)
}

/// Training forward of one mixer on `proj` (`[rows, d_in_proj]`, rows = batch·seq_len,
/// each sequence from a zero state). Returns the saved activations; `saved.o` is the gated
/// output `[rows, D_i]`.
pub fn mixer_forward<F: Real>(sh: &MixerShape, lp: &LayerParams<F>, proj: &[F]) -> MixerSaved<F> {
    let d = &sh.d;
    let (h_n, p_n, t_n) = (d.nheads, d.headdim, sh.seq_len);
    let rows = sh.batch * t_n;
    let mut sv = token_pre(sh, lp, proj);
    let tasks: Vec<(usize, usize)> = (0..sh.batch)
        .flat_map(|b| (0..h_n).map(move |h| (b, h)))
        .collect();
    let outs: Vec<(HeadSaved<F>, Vec<F>)> = tasks
        .par_iter()
        .map(|&(b, h)| head_forward(sh, lp, proj, &sv, b, h))
        .collect();
    let mut y = vec![F::zero(); rows * d.d_inner];
    for (&(b, h), (_, yh)) in tasks.iter().zip(&outs) {
        for t in 0..t_n {
            let r = b * t_n + t;
            y[r * d.d_inner + h * p_n..][..p_n].copy_from_slice(&yh[t * p_n..(t + 1) * p_n]);
        }
    }
    sv.heads = outs.into_iter().map(|(hs, _)| hs).collect();
    // Gate (spec §2.6).
    let mut o = vec![F::zero(); rows * d.d_inner];
    let mut ry = vec![F::zero(); rows * h_n];
    o.par_chunks_mut(d.d_inner)
        .zip(ry.par_chunks_mut(h_n))
        .enumerate()
        .for_each(|(r, (orow, ryrow))| {
            let z = &proj[r * d.d_in_proj + d.z_off()..][..d.d_inner];
            let yr = &y[r * d.d_inner..(r + 1) * d.d_inner];
            for h in 0..h_n {
                let rg = h * p_n..(h + 1) * p_n;
                match &lp.out_norm {
                    Some(w) => {
                        ryrow[h] = rms_fwd(&yr[rg.clone()], &w[rg.clone()], &mut orow[rg.clone()])
                    }
                    None => orow[rg.clone()].copy_from_slice(&yr[rg.clone()]),
                }
                for i in rg {
                    orow[i] = orow[i] * silu(z[i]);
                }
            }
        });
    sv.y = y;
    sv.ry = ry;
    sv.o = o;
    sv
}
