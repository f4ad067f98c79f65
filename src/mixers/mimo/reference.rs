//! The token-by-token Mamba-3 MIMO language model (spec-MIMO §2.8 for the mixer, SISO
//! spec §2.7 for the blocks), written to be read beside the spec and generic over f32/f64.
//! It is the oracle the chunked prefill is checked against: no chunking, no rounding.
//!
//! The state carries the last token's R keys and raw x, so a window that continues a
//! state computes the look-back term of its first token exactly as an unbroken pass would
//! (the boundary fold of spec-MIMO §3.4 is implicit here).

use super::weights::{MimoDims, MimoLayerWeights, MimoWeights};
use crate::cpu::math::{a_value, rms_norm, sigmoid, silu, softplus, wrap_angle};
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::mixers::mamba3::reference::Mat;
use crate::model::config::{AActivation, NORM_EPS};
use crate::model::state_layout::{StateBuf, StateLayout, StateTensor};

/// One sequence's state in one MIMO layer, in the official cache layouts (spec-MIMO §3.1,
/// batch axis dropped). All zero for a fresh sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct MimoLayerState<F> {
    /// `φ` `[H, S]`, wrapped to [0, 2π)
    pub angle: Vec<F>,
    /// `h` `[H, P, N]`
    pub ssm: Vec<F>,
    /// last token's keys `k̃_r` `[R, H, N]`, rank-major: normed, biased, rotated, unscaled
    pub k: Vec<F>,
    /// last token's raw `x` `[H, P]` (before `mimo_x`)
    pub v: Vec<F>,
}

impl<F: Real> MimoLayerState<F> {
    pub fn zeros(d: &MimoDims) -> Self {
        let (h, p, n, r, s) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
        MimoLayerState {
            angle: vec![F::zero(); h * s],
            ssm: vec![F::zero(); h * p * n],
            k: vec![F::zero(); r * h * n],
            v: vec![F::zero(); h * p],
        }
    }

    /// An error naming the first field whose length does not fit `d`.
    pub fn check(&self, d: &MimoDims) -> Result<()> {
        let (h, p, n, r, s) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
        for (name, len, want) in [
            ("angle", self.angle.len(), h * s),
            ("ssm", self.ssm.len(), h * p * n),
            ("k", self.k.len(), r * h * n),
            ("v", self.v.len(), h * p),
        ] {
            if len != want {
                return Err(Error::State(format!(
                    "MIMO layer state `{name}` has {len} numbers, expected {want} \
                     (H {h}, P {p}, N {n}, R {r}, S {s})"
                )));
            }
        }
        Ok(())
    }
}

impl<F: Real> MimoLayerState<F> {
    /// A copy of layer `l` of a sequence's state.
    pub fn copy_of(st: &MimoSeqState<F>, l: usize, d: &MimoDims) -> Self {
        let mut flat = st.layer(l).to_vec();
        let v = MimoLayerView::of(&mut flat, d);
        MimoLayerState {
            angle: v.angle.to_vec(),
            ssm: v.ssm.to_vec(),
            k: v.k.to_vec(),
            v: v.v.to_vec(),
        }
    }

    /// A view of its four tensors, the form the mixer's code works on.
    pub fn view(&mut self) -> MimoLayerView<'_, F> {
        MimoLayerView {
            angle: &mut self.angle,
            ssm: &mut self.ssm,
            k: &mut self.k,
            v: &mut self.v,
        }
    }
}

/// One layer's state viewed in place (in a sequence's flat state, or a [`MimoLayerState`]).
#[derive(Debug)]
pub struct MimoLayerView<'a, F> {
    pub angle: &'a mut [F],
    pub ssm: &'a mut [F],
    pub k: &'a mut [F],
    pub v: &'a mut [F],
}

impl<'a, F> MimoLayerView<'a, F> {
    /// View one layer's flat values (`[angle | ssm | k | v]`, [`layout`] order).
    pub fn of(flat: &'a mut [F], d: &MimoDims) -> MimoLayerView<'a, F> {
        let (h, p, n, r, s) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
        let (angle, rest) = flat.split_at_mut(h * s);
        let (ssm, rest) = rest.split_at_mut(h * p * n);
        let (k, v) = rest.split_at_mut(r * h * n);
        assert_eq!(v.len(), h * p, "a MIMO layer state of the wrong size");
        MimoLayerView { angle, ssm, k, v }
    }

    /// An error naming the first tensor whose length does not fit `d`.
    pub fn check(&self, d: &MimoDims) -> Result<()> {
        let (h, p, n, r, s) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
        for (name, len, want) in [
            ("angle", self.angle.len(), h * s),
            ("ssm", self.ssm.len(), h * p * n),
            ("k", self.k.len(), r * h * n),
            ("v", self.v.len(), h * p),
        ] {
            if len != want {
                return Err(Error::State(format!(
                    "MIMO layer state `{name}` has {len} numbers, expected {want} \
                     (H {h}, P {p}, N {n}, R {r}, S {s})"
                )));
            }
        }
        Ok(())
    }
}

/// The named tensors of one layer's state (spec-MIMO §3.1): `angle [H,S]`, `ssm [H,P,N]`,
/// `k [R,H,N]`, `v [H,P]`.
pub fn layout(d: &MimoDims) -> StateLayout {
    let (h, p, n, r, s) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
    StateLayout {
        n_layer: d.n_layer,
        tensors: vec![
            StateTensor::new("angle", &[h, s]),
            StateTensor::new("ssm", &[h, p, n]),
            StateTensor::new("k", &[r, h, n]),
            StateTensor::new("v", &[h, p]),
        ],
    }
}

/// A whole sequence's MIMO state: every layer's four tensors, flat, in [`layout`] order.
pub type MimoSeqState<F> = StateBuf<F>;

pub fn mimo_zero_state<F: Real>(d: &MimoDims) -> MimoSeqState<F> {
    StateBuf::zeros(&layout(d))
}

/// Layer `l` of a sequence's state.
pub fn layer<'a, F: Real>(
    st: &'a mut MimoSeqState<F>,
    l: usize,
    d: &MimoDims,
) -> MimoLayerView<'a, F> {
    MimoLayerView::of(st.layer_mut(l), d)
}

/// Refuse tokens or a state that do not fit the model, before anything is touched.
pub fn check_window<F: Real>(d: &MimoDims, tokens: &[u32], state: &MimoSeqState<F>) -> Result<()> {
    if let Some(pos) = tokens.iter().position(|&t| t as usize >= d.vocab_size) {
        return Err(Error::TokenOutOfRange {
            id: tokens[pos] as u64,
            pos,
            vocab: d.vocab_size,
        });
    }
    let want = layout(d);
    if !state.fits(&want) {
        return Err(Error::State(format!(
            "a MIMO state of {} layers × {} values does not fit this model ({})",
            state.n_layer(),
            state.layer_len,
            want.describe()
        )));
    }
    Ok(())
}

/// Rotate the half-split pairs `(i, i + N/2)` by `φ_i` for `i < S`; the rest pass
/// (spec-MIMO §2.4; SISO rotates `(2i, 2i+1)` instead).
#[inline]
pub fn rotate_half<F: Real>(v: &mut [F], cos: &[F], sin: &[F]) {
    let half = v.len() / 2;
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * c - b * s;
        v[i + half] = a * s + b * c;
    }
}

/// Per-token values every head needs (spec-MIMO §2.2–§2.3), for `rows` tokens.
pub struct MimoTokenPre<F> {
    /// `B̄` `[rows, R, G, N]`, RMS-normed per (rank, group) row
    pub b: Vec<F>,
    /// `C̄` `[rows, R, G, N]`
    pub c: Vec<F>,
    /// `Δ` `[rows, H]`
    pub delta: Vec<F>,
    /// `a = A·Δ` `[rows, H]`
    pub a: Vec<F>,
    /// `λ = σ(trap)` `[rows, H]`
    pub lambda: Vec<F>,
    /// `θ_i = π·tanh(ang_i)` `[rows, S]`
    pub theta: Vec<F>,
}

/// One MIMO layer's mixer constants.
pub struct MimoMixerCtx<'a> {
    pub d: MimoDims,
    pub lw: &'a MimoLayerWeights,
    pub a_floor: f64,
    pub a_act: AActivation,
}

impl<'a> MimoMixerCtx<'a> {
    pub fn new(w: &'a MimoWeights, layer: usize) -> Self {
        MimoMixerCtx {
            d: w.dims,
            lw: &w.layers[layer],
            a_floor: w.config.ssm_cfg.a_floor,
            a_act: w.config.ssm_cfg.a_activation,
        }
    }

    /// Preprocess `rows` consecutive `in_proj` output rows (`proj` is `[rows, d_in_proj]`).
    pub fn token_pre<F: Real>(&self, proj: &[F], rows: usize) -> MimoTokenPre<F> {
        let d = &self.d;
        let (h_n, n_n, s_n, bcw) = (d.nheads, d.d_state, d.num_rope_angles, d.bc_width());
        let eps = F::from_f(NORM_EPS);
        let a_floor = F::from_f(self.a_floor);
        let mut pre = MimoTokenPre {
            b: vec![F::zero(); rows * bcw],
            c: vec![F::zero(); rows * bcw],
            delta: vec![F::zero(); rows * h_n],
            a: vec![F::zero(); rows * h_n],
            lambda: vec![F::zero(); rows * h_n],
            theta: vec![F::zero(); rows * s_n],
        };
        for t in 0..rows {
            let row = &proj[t * d.d_in_proj..(t + 1) * d.d_in_proj];
            // One N-wide RMSNorm per (rank, group) row, all sharing w_B (resp. w_C).
            for j in 0..bcw / n_n {
                let (src, dst) = (j * n_n..(j + 1) * n_n, t * bcw + j * n_n);
                let b = &row[d.b_off()..][src.clone()];
                rms_norm(b, &self.lw.b_norm, eps, &mut pre.b[dst..dst + n_n]);
                let c = &row[d.c_off()..][src];
                rms_norm(c, &self.lw.c_norm, eps, &mut pre.c[dst..dst + n_n]);
            }
            for h in 0..h_n {
                let delta = softplus(row[d.dt_off() + h] + F::from_f(self.lw.dt_bias[h] as f64));
                pre.delta[t * h_n + h] = delta;
                pre.a[t * h_n + h] = a_value(row[d.a_off() + h], a_floor, self.a_act) * delta;
                pre.lambda[t * h_n + h] = sigmoid(row[d.trap_off() + h]);
            }
            for i in 0..s_n {
                pre.theta[t * s_n + i] = F::PI() * row[d.angle_off() + i].tanh();
            }
        }
        pre
    }

    /// Biased, unrotated key and query of head `h`, rank `r`, from one token's normed
    /// `B̄`, `C̄` rows (`[R, G, N]` each): `k = B̄[r][g(h)] + B_bias[h][r]` (same for q).
    #[inline]
    pub fn biased_kq<F: Real>(
        &self,
        b: &[F],
        c: &[F],
        h: usize,
        r: usize,
        k: &mut [F],
        q: &mut [F],
    ) {
        let d = &self.d;
        let n_n = d.d_state;
        let src = d.bc_row(r, d.group_of(h));
        let bias = (h * d.rank + r) * n_n;
        for i in 0..n_n {
            k[i] = b[src + i] + F::from_f(self.lw.b_bias[bias + i] as f64);
            q[i] = c[src + i] + F::from_f(self.lw.c_bias[bias + i] as f64);
        }
    }

    /// `ψ`, `ζ` or `ω` of head `h`, rank `r`: a P-slice of a `[H, R, P]` tensor.
    #[inline]
    pub fn per_rank<'v>(&self, v: &'v [f32], h: usize, r: usize) -> &'v [f32] {
        let p_n = self.d.headdim;
        &v[(h * self.d.rank + r) * p_n..][..p_n]
    }

    /// Output of head `h` from its R readouts `y` (`[R, P]`) and its `z` (spec-MIMO §2.7):
    /// `o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r)`, `G` the per-rank RMSNorm over P times
    /// `w_norm[h]` with the output norm, else the identity. `fast` takes the gate's
    /// exponential from [`Real::exp_fast`] (the same in f64; 2 ulp in f32).
    pub fn combine_ranks<F: Real>(&self, y: &[F], z: &[F], h: usize, o: &mut [F], fast: bool) {
        let p_n = self.d.headdim;
        o.iter_mut().for_each(|v| *v = F::zero());
        // The prefill calls this per (token, head): no allocation for usual head sizes.
        let mut stack = [F::zero(); 256];
        let mut heap;
        let normed: &mut [F] = if p_n <= stack.len() {
            &mut stack[..p_n]
        } else {
            heap = vec![F::zero(); p_n];
            &mut heap
        };
        for r in 0..self.d.rank {
            let yr = &y[r * p_n..(r + 1) * p_n];
            let g: &[F] = match &self.lw.out_norm {
                Some(w) => {
                    rms_norm(yr, &w[h * p_n..(h + 1) * p_n], F::from_f(NORM_EPS), normed);
                    normed
                }
                None => yr,
            };
            let (zeta, omega) = (
                self.per_rank(&self.lw.mimo_z, h, r),
                self.per_rank(&self.lw.mimo_o, h, r),
            );
            for p in 0..p_n {
                let a = z[p] * F::from_f(zeta[p] as f64);
                let gate = if fast {
                    a / (F::one() + (-a).exp_fast())
                } else {
                    silu(a)
                };
                o[p] = o[p] + F::from_f(omega[p] as f64) * g[p] * gate;
            }
        }
    }
}

/// Spec-MIMO §2.8: one token of one mixer, from its `in_proj` output row `proj`
/// (`[d_in_proj]`); writes `o` (`[D_i]`, before `out_proj`) and advances `st`.
pub fn mixer_token<F: Real>(
    ctx: &MimoMixerCtx,
    proj: &[F],
    st: &mut MimoLayerView<'_, F>,
    o: &mut [F],
) {
    let d = &ctx.d;
    let (h_n, p_n, n_n, r_n, s_n) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
    let pre = ctx.token_pre(proj, 1);
    let z = &proj[d.z_off()..d.z_off() + d.d_inner];
    let x = &proj[d.x_off()..d.x_off() + d.d_inner];
    let (mut k, mut q) = (vec![F::zero(); r_n * n_n], vec![F::zero(); r_n * n_n]);
    let mut y = vec![F::zero(); r_n * p_n];
    let (mut cos, mut sin) = (vec![F::zero(); s_n], vec![F::zero(); s_n]);
    for h in 0..h_n {
        let (delta, lambda) = (pre.delta[h], pre.lambda[h]);
        let phi = &mut st.angle[h * s_n..(h + 1) * s_n];
        for i in 0..s_n {
            phi[i] = wrap_angle(phi[i] + pre.theta[i] * delta);
            (sin[i], cos[i]) = phi[i].sin_cos();
        }
        // One phase vector per head, shared by every rank.
        for r in 0..r_n {
            let (kr, qr) = (
                &mut k[r * n_n..(r + 1) * n_n],
                &mut q[r * n_n..(r + 1) * n_n],
            );
            ctx.biased_kq(&pre.b, &pre.c, h, r, kr, qr);
            rotate_half(kr, &cos, &sin);
            rotate_half(qr, &cos, &sin);
        }
        let alpha = pre.a[h].exp();
        let beta = alpha * delta * (F::one() - lambda);
        let gamma = lambda * delta;
        let xh = &x[h * p_n..(h + 1) * p_n];
        let xprev = &mut st.v[h * p_n..(h + 1) * p_n];
        let s = &mut st.ssm[h * p_n * n_n..(h + 1) * p_n * n_n];
        // h ← α·h + Σ_r [β·outer(x⁻ ⊙ ψ_r, k⁻_r) + γ·outer(x ⊙ ψ_r, k̃_r)]
        for v in s.iter_mut() {
            *v = alpha * *v;
        }
        for r in 0..r_n {
            let psi = ctx.per_rank(&ctx.lw.mimo_x, h, r);
            let kprev = &st.k[(r * h_n + h) * n_n..(r * h_n + h + 1) * n_n];
            let kr = &k[r * n_n..(r + 1) * n_n];
            for p in 0..p_n {
                let ps = F::from_f(psi[p] as f64);
                let (wb, wg) = (beta * xprev[p] * ps, gamma * xh[p] * ps);
                let row = &mut s[p * n_n..(p + 1) * n_n];
                for n in 0..n_n {
                    row[n] = row[n] + wb * kprev[n] + wg * kr[n];
                }
            }
        }
        // y_r = h·q̃_r + D·(x ⊙ ψ_r)
        let dh = F::from_f(ctx.lw.d[h] as f64);
        for r in 0..r_n {
            let psi = ctx.per_rank(&ctx.lw.mimo_x, h, r);
            let qr = &q[r * n_n..(r + 1) * n_n];
            for p in 0..p_n {
                let row = &s[p * n_n..(p + 1) * n_n];
                let acc: F = row.iter().zip(qr).map(|(&a, &b)| a * b).sum();
                y[r * p_n + p] = acc + dh * xh[p] * F::from_f(psi[p] as f64);
            }
        }
        ctx.combine_ranks(
            &y,
            &z[h * p_n..(h + 1) * p_n],
            h,
            &mut o[h * p_n..(h + 1) * p_n],
            false,
        );
        for r in 0..r_n {
            st.k[(r * h_n + h) * n_n..(r * h_n + h + 1) * n_n]
                .copy_from_slice(&k[r * n_n..(r + 1) * n_n]);
        }
        xprev.copy_from_slice(xh);
    }
}

struct RefLayer<F> {
    in_proj: Mat<F>,
    out_proj: Mat<F>,
    mlp: Option<(Mat<F>, Mat<F>)>,
}

/// The MIMO language model, one token at a time.
pub struct MimoReference<'w, F> {
    w: &'w MimoWeights,
    embedding: Mat<F>,
    head: Mat<F>,
    layers: Vec<RefLayer<F>>,
}

impl<'w, F: Real> MimoReference<'w, F> {
    pub fn new(w: &'w MimoWeights) -> Self {
        MimoReference {
            w,
            embedding: Mat::new(&w.embedding),
            head: Mat::new(w.head()),
            layers: w
                .layers
                .iter()
                .map(|l| RefLayer {
                    in_proj: Mat::new(&l.in_proj),
                    out_proj: Mat::new(&l.out_proj),
                    mlp: l.mlp.as_ref().map(|m| (Mat::new(&m.fc1), Mat::new(&m.fc2))),
                })
                .collect(),
        }
    }

    pub fn dims(&self) -> &MimoDims {
        &self.w.dims
    }

    /// A fresh sequence's state.
    pub fn new_state(&self) -> MimoSeqState<F> {
        mimo_zero_state(&self.w.dims)
    }

    /// One token through the model: `(hidden after norm_f [D_m], logits [vocab_padded])`.
    pub fn step_hidden(&self, token: u32, state: &mut MimoSeqState<F>) -> Result<(Vec<F>, Vec<F>)> {
        check_window(&self.w.dims, &[token], state)?;
        Ok(self.step_unchecked(token, state))
    }

    /// One token through the model: its logits over `vocab_padded` rows.
    pub fn step(&self, token: u32, state: &mut MimoSeqState<F>) -> Result<Vec<F>> {
        Ok(self.step_hidden(token, state)?.1)
    }

    /// A window of tokens from `state` (fresh or carried): logits `[T, vocab_padded]`.
    pub fn forward(&self, tokens: &[u32], state: &mut MimoSeqState<F>) -> Result<Vec<F>> {
        Ok(self.forward_hidden(tokens, state)?.1)
    }

    /// As [`forward`](Self::forward), also returning the hidden states `[T, D_m]`.
    pub fn forward_hidden(
        &self,
        tokens: &[u32],
        state: &mut MimoSeqState<F>,
    ) -> Result<(Vec<F>, Vec<F>)> {
        check_window(&self.w.dims, tokens, state)?;
        let (mut hidden, mut logits) = (Vec::new(), Vec::new());
        for &t in tokens {
            let (h, l) = self.step_unchecked(t, state);
            hidden.extend(h);
            logits.extend(l);
        }
        Ok((hidden, logits))
    }

    /// SISO spec §2.7: embedding, per layer fused residual add + RMSNorm, mixer, optional
    /// GatedMLP; final add + RMSNorm and head.
    fn step_unchecked(&self, token: u32, state: &mut MimoSeqState<F>) -> (Vec<F>, Vec<F>) {
        let d = &self.w.dims;
        let dm = d.d_model;
        let eps = F::from_f(NORM_EPS);
        let mut hs: Vec<F> = self.embedding.row(token as usize).to_vec();
        let mut res = vec![F::zero(); dm];
        let mut n = vec![F::zero(); dm];
        let mut o = vec![F::zero(); d.d_inner];
        for (l, (lw, rl)) in self.w.layers.iter().zip(&self.layers).enumerate() {
            add_into(&mut res, &hs);
            rms_norm(&res, &lw.norm, eps, &mut n);
            let ctx = MimoMixerCtx::new(self.w, l);
            mixer_token(&ctx, &rl.in_proj.apply(&n), &mut layer(state, l, d), &mut o);
            hs = rl.out_proj.apply(&o);
            if let (Some(mw), Some((fc1, fc2))) = (&lw.mlp, &rl.mlp) {
                add_into(&mut res, &hs);
                rms_norm(&res, &mw.norm, eps, &mut n);
                let h = d.mlp_hidden;
                let vg = fc1.apply(&n);
                let act: Vec<F> = (0..h).map(|i| vg[i] * silu(vg[h + i])).collect();
                hs = fc2.apply(&act);
            }
        }
        add_into(&mut res, &hs);
        rms_norm(&res, &self.w.norm_f, eps, &mut n);
        let logits = self.head.apply(&n);
        (n, logits)
    }
}

fn add_into<F: Real>(acc: &mut [F], x: &[F]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a = *a + b;
    }
}
