//! The MIMO mixer's exact backward, token by token in reverse per (sequence, head), the
//! states of a chunk recomputed from the one [`super::forward`] kept at its start.
//!
//! With `u_{t,r} = x_t ⊙ ψ_r`, `S_t = α_t·S_{t−1} + β_t·Σ_r outer(u_{t−1,r}, k̃_{t−1,r}) +
//! γ_t·Σ_r outer(u_{t,r}, k̃_{t,r})` and `y_{t,r} = S_t·q̃_{t,r} + D·u_{t,r}`, going back
//! from `dS = 0` after the last token:
//!
//! ```text
//! dS += Σ_r outer(dy_{t,r}, q̃_{t,r});   dq̃_{t,r} = S_tᵀ·dy_{t,r};   du_{t,r} += D·dy_{t,r};   dD += ⟨dy, u⟩
//! γ:  dγ_t += Σ_r ⟨u_{t,r}, dS·k̃_{t,r}⟩;        du_{t,r} += γ·dS·k̃_{t,r};     dk̃_{t,r} += γ·dSᵀ·u_{t,r}
//! β:  dβ_t += Σ_r ⟨u_{t−1,r}, dS·k̃_{t−1,r}⟩;  du_{t−1,r} += β·dS·k̃_{t−1,r}; dk̃_{t−1,r} += β·dSᵀ·u_{t−1,r}
//! dα_t = ⟨dS, S_{t−1}⟩;   dS ← α_t·dS
//! ```
//!
//! then `α = e^{AΔ}`, `β = αΔ(1 − λ)`, `γ = λΔ` back to `Δ`, `λ`, `A`; `dx = Σ_r du_r ⊙ ψ_r`,
//! `dψ_r += du_r ⊙ x`. The half-split rotation: `dk = R(φ)ᵀ·dk̃` and per pair `(i, i+N/2)`
//! `dφ_i += −dk̃_i·k̃_{i+N/2} + dk̃_{i+N/2}·k̃_i` (same for q, every rank); the phase wrap has
//! derivative 1, so with `g_t = Σ_{t' ≥ t} dφ_{t'}`: `dθ_t += g_t·Δ_t`, `dΔ_t += ⟨g_t, θ_t⟩`.
//! The output combination `o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r)` goes first. Finally to the
//! `in_proj` row and the parameters as in the SISO backward: `dk`, `dq` summed over the
//! heads of a group and through the shared B/C RMSNorm, `Δ = softplus(dd_dt + dt_bias)`,
//! `A = min(−f(dd_A), −A_floor)`, `λ = σ(trap)`, `θ = π·tanh(ang)`.

#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the formulas above

use super::forward::{abg, advance, head_of, rank_params, HeadSaved, MimoSaved, RowSaved};
use super::MimoShape;
use crate::cpu::math::{heavy_tail, sigmoid, silu, softplus};
use crate::cpu::matmul::dot;
use crate::cpu::ops::{rms_bwd, rms_fwd, silu_grad};
use crate::cpu::Real;
use crate::mixers::mamba3::params::LayerParams;
use crate::model::config::AActivation;
use rayon::prelude::*;

/// Gradients of one (sequence, head).
struct HeadGrad<F> {
    /// of the biased, unrotated keys and queries `[T, R, N]`
    dk: Vec<F>,
    dq: Vec<F>,
    /// of `x` and `z` `[T, P]`
    dx: Vec<F>,
    dz: Vec<F>,
    /// of `Δ`, `A`, `λ` `[T]`
    ddelta: Vec<F>,
    daval: Vec<F>,
    dlambda: Vec<F>,
    /// of `θ` `[T, S]` (this head's share)
    dtheta: Vec<F>,
    /// of `ψ`, `ζ`, `ω` `[R, P]` and the head's output-norm weights `[P]`
    dpsi: Vec<F>,
    dzeta: Vec<F>,
    domega: Vec<F>,
    dwnorm: Vec<F>,
    dd: F,
}

/// Backward of the output combination of every token of head `h`: returns `dy` `[T, R, P]`
/// and fills `dz`, `dζ`, `dω` and the output norm's gradient.
fn combine_backward<F: Real>(
    sh: &MimoShape,
    lp: &LayerParams<F>,
    proj: &[F],
    hs: &HeadSaved<F>,
    d_o: &[F],
    (b, h): (usize, usize),
    g: &mut HeadGrad<F>,
) -> Vec<F> {
    let d = &sh.d;
    let (p_n, r_n, t_n) = (d.headdim, d.rank, sh.seq_len);
    let mp = rank_params(lp);
    let (zeta, omega) = (head_of(&mp.z, sh, h), head_of(&mp.o, sh, h));
    let w_norm = lp.out_norm.as_ref().map(|w| &w[h * p_n..(h + 1) * p_n]);
    let mut dy = vec![F::zero(); t_n * r_n * p_n];
    let (mut normed, mut dg) = (vec![F::zero(); p_n], vec![F::zero(); p_n]);
    for t in 0..t_n {
        let row = b * t_n + t;
        let z = &proj[row * d.d_in_proj + d.z_off() + h * p_n..][..p_n];
        let dor = &d_o[row * d.d_inner + h * p_n..][..p_n];
        for r in 0..r_n {
            let j = (t * r_n + r) * p_n;
            let yr = &hs.y[j..j + p_n];
            let rfac = w_norm.map(|w| rms_fwd(yr, w, &mut normed));
            let gr: &[F] = if rfac.is_some() { &normed } else { yr };
            for p in 0..p_n {
                let (ze, om) = (zeta[r * p_n + p], omega[r * p_n + p]);
                let a = z[p] * ze;
                let s = silu(a);
                g.domega[r * p_n + p] = g.domega[r * p_n + p] + dor[p] * gr[p] * s;
                dg[p] = dor[p] * om * s;
                let da = dor[p] * om * gr[p] * silu_grad(a);
                g.dz[t * p_n + p] = g.dz[t * p_n + p] + da * ze;
                g.dzeta[r * p_n + p] = g.dzeta[r * p_n + p] + da * z[p];
            }
            match (w_norm, rfac) {
                (Some(w), Some(rf)) => {
                    rms_bwd(yr, w, rf, &dg, &mut dy[j..j + p_n], &mut g.dwnorm, false)
                }
                _ => dy[j..j + p_n].copy_from_slice(&dg),
            }
        }
    }
    dy
}

/// The backward of one (sequence, head).
fn head_backward<F: Real>(
    sh: &MimoShape,
    lp: &LayerParams<F>,
    proj: &[F],
    rs: &RowSaved<F>,
    hs: &HeadSaved<F>,
    d_o: &[F],
    (b, h): (usize, usize),
) -> HeadGrad<F> {
    let d = &sh.d;
    let (h_n, p_n, n_n, r_n, s_n, t_n) = (
        d.nheads,
        d.headdim,
        d.d_state,
        d.rank,
        d.num_rope_angles,
        sh.seq_len,
    );
    let (rk, rp, pn) = (r_n * n_n, r_n * p_n, p_n * n_n);
    let z = |len: usize| vec![F::zero(); len];
    let mut g = HeadGrad {
        dk: z(t_n * rk),
        dq: z(t_n * rk),
        dx: z(t_n * p_n),
        dz: z(t_n * p_n),
        ddelta: z(t_n),
        daval: z(t_n),
        dlambda: z(t_n),
        dtheta: z(t_n * s_n),
        dpsi: z(rp),
        dzeta: z(rp),
        domega: z(rp),
        dwnorm: z(p_n),
        dd: F::zero(),
    };
    let dy = combine_backward(sh, lp, proj, hs, d_o, (b, h), &mut g);
    let psi = head_of(&rank_params(lp).x, sh, h);
    let dh = lp.d[h];
    let x_of = |t: usize| &proj[(b * t_n + t) * d.d_in_proj + d.x_off() + h * p_n..][..p_n];
    // u_{t,r} = x_t ⊙ ψ_r for every token, `[T, R, P]`.
    let mut u = z(t_n * rp);
    for t in 0..t_n {
        let x = x_of(t);
        for r in 0..r_n {
            for p in 0..p_n {
                u[t * rp + r * p_n + p] = x[p] * psi[r * p_n + p];
            }
        }
    }
    // dk̃, dq̃ (rotated) accumulate here; turned into dk, dq after the scan.
    let (mut dkt, mut dqt) = (z(t_n * rk), z(t_n * rk));
    let mut du = z(t_n * rp);
    let mut ds = z(pn);
    let mut v = z(p_n);
    let l_n = d.chunk_len;
    let n_chunks = t_n.div_ceil(l_n);
    let mut st = z((l_n + 1) * pn);
    for c in (0..n_chunks).rev() {
        let (t0, t1) = (c * l_n, ((c + 1) * l_n).min(t_n));
        // Recompute S_{t0−1} … S_{t1−1}: slot j holds the state before token t0 + j.
        st[..pn].copy_from_slice(&hs.states[c * pn..(c + 1) * pn]);
        for t in t0..t1 {
            let j = t - t0;
            let (before, after) = st.split_at_mut((j + 1) * pn);
            after[..pn].copy_from_slice(&before[j * pn..]);
            let prev = (t > 0).then(|| (x_of(t - 1), &hs.k[(t - 1) * rk..t * rk]));
            let sc = abg(rs, (b * t_n + t) * h_n + h);
            advance(
                sh,
                psi,
                sc,
                prev,
                x_of(t),
                &hs.k[t * rk..(t + 1) * rk],
                &mut after[..pn],
            );
        }
        for t in (t0..t1).rev() {
            let j = t - t0;
            let (s_prev, s_t) = (&st[j * pn..(j + 1) * pn], &st[(j + 1) * pn..(j + 2) * pn]);
            // Readouts y_{t,r} = S_t·q̃_{t,r} + D·u_{t,r}.
            for r in 0..r_n {
                let dyr = &dy[t * rp + r * p_n..][..p_n];
                let qr = &hs.q[t * rk + r * n_n..][..n_n];
                let dqr = &mut dqt[t * rk + r * n_n..][..n_n];
                for p in 0..p_n {
                    let dyp = dyr[p];
                    let (srow, dsrow) = (
                        &s_t[p * n_n..(p + 1) * n_n],
                        &mut ds[p * n_n..(p + 1) * n_n],
                    );
                    // Zipped slices: no bounds checks, so the loops vectorise.
                    for (((ds, dq), &q), &s) in
                        dsrow.iter_mut().zip(dqr.iter_mut()).zip(qr).zip(srow)
                    {
                        *ds = *ds + dyp * q;
                        *dq = *dq + s * dyp;
                    }
                    g.dd = g.dd + dyp * u[t * rp + r * p_n + p];
                    du[t * rp + r * p_n + p] = du[t * rp + r * p_n + p] + dh * dyp;
                }
            }
            let i = (b * t_n + t) * h_n + h;
            let (alpha, beta, gamma) = abg(rs, i);
            // The γ term (token t) and the β term (token t − 1) of the update.
            let mut dgamma = F::zero();
            let mut dbeta = F::zero();
            for (tk, w) in [(Some(t), gamma), (t.checked_sub(1), beta)] {
                let Some(tk) = tk else { continue };
                let mut acc = F::zero();
                for r in 0..r_n {
                    let kr = &hs.k[tk * rk + r * n_n..][..n_n];
                    let ur = &u[tk * rp + r * p_n..][..p_n];
                    let dkr = &mut dkt[tk * rk + r * n_n..][..n_n];
                    for p in 0..p_n {
                        let dsrow = &ds[p * n_n..(p + 1) * n_n];
                        v[p] = dot::<F, F, false>(dsrow, kr);
                        let wu = w * ur[p];
                        for (dk, &ds) in dkr.iter_mut().zip(dsrow) {
                            *dk = *dk + wu * ds;
                        }
                        acc = acc + ur[p] * v[p];
                        du[tk * rp + r * p_n + p] = du[tk * rp + r * p_n + p] + w * v[p];
                    }
                }
                if tk == t {
                    dgamma = acc;
                } else {
                    dbeta = acc;
                }
            }
            let dalpha = dot::<F, F, false>(&ds, s_prev);
            ds.iter_mut().for_each(|x| *x = *x * alpha);
            let (delta, lambda, aval) = (rs.delta[i], rs.lambda[i], rs.aval[i]);
            // α = e^{AΔ}, β = αΔ(1 − λ), γ = λΔ.
            let da = (dalpha + dbeta * delta * (F::one() - lambda)) * alpha;
            g.ddelta[t] =
                g.ddelta[t] + dbeta * alpha * (F::one() - lambda) + dgamma * lambda + da * aval;
            g.dlambda[t] = g.dlambda[t] - dbeta * alpha * delta + dgamma * delta;
            g.daval[t] = g.daval[t] + da * delta;
        }
    }
    // Values: dx = Σ_r du_r ⊙ ψ_r, dψ_r += du_r ⊙ x.
    for t in 0..t_n {
        let x = x_of(t);
        for r in 0..r_n {
            for p in 0..p_n {
                let dur = du[t * rp + r * p_n + p];
                g.dx[t * p_n + p] = g.dx[t * p_n + p] + dur * psi[r * p_n + p];
                g.dpsi[r * p_n + p] = g.dpsi[r * p_n + p] + dur * x[p];
            }
        }
    }
    // Rotation and phases, in reverse for the suffix sums of dφ.
    let half = n_n / 2;
    let mut gphi = z(s_n);
    for t in (0..t_n).rev() {
        let (cos, sin) = (
            &hs.cos[t * s_n..(t + 1) * s_n],
            &hs.sin[t * s_n..(t + 1) * s_n],
        );
        for r in 0..r_n {
            let span = t * rk + r * n_n..t * rk + (r + 1) * n_n;
            for (rot, drot, dout) in [
                (
                    &hs.k[span.clone()],
                    &dkt[span.clone()],
                    &mut g.dk[span.clone()],
                ),
                (
                    &hs.q[span.clone()],
                    &dqt[span.clone()],
                    &mut g.dq[span.clone()],
                ),
            ] {
                // Coordinates past the rotated pairs pass through.
                dout.copy_from_slice(drot);
                for i in 0..s_n {
                    let (da, db) = (drot[i], drot[i + half]);
                    gphi[i] = gphi[i] - da * rot[i + half] + db * rot[i];
                    dout[i] = da * cos[i] + db * sin[i];
                    dout[i + half] = -da * sin[i] + db * cos[i];
                }
            }
        }
        let row = b * t_n + t;
        let delta = rs.delta[row * h_n + h];
        for i in 0..s_n {
            g.dtheta[t * s_n + i] = gphi[i] * delta;
            g.ddelta[t] = g.ddelta[t] + gphi[i] * rs.theta[row * s_n + i];
        }
    }
    g
}

/// `dA/d(dd_A)` of `A = min(−f(dd_A), −A_floor)` (0 where the floor holds).
fn a_value_grad<F: Real>(dd_a: F, a_floor: F, act: AActivation) -> F {
    let (f, fp) = match act {
        AActivation::HeavyTail => (
            heavy_tail(dd_a),
            if dd_a >= F::zero() {
                F::one()
            } else {
                let v = F::one() - dd_a;
                F::one() / (v * v)
            },
        ),
        AActivation::Softplus => (softplus(dd_a), sigmoid(dd_a)),
    };
    if -f < -a_floor {
        -fp
    } else {
        F::zero()
    }
}

fn add_into<F: Real>(acc: &mut [F], x: &[F]) {
    acc.iter_mut().zip(x).for_each(|(a, &b)| *a = *a + b);
}

/// Backward of one MIMO mixer. `d_o` is the gradient of its output `o` `[rows, D_i]`.
/// Writes the gradient of `proj` into `dproj` (`[rows, d_in_proj]`, overwritten) and adds
/// the mixer's own parameter gradients into `grad`.
pub fn mimo_mixer_backward<F: Real>(
    sh: &MimoShape,
    lp: &LayerParams<F>,
    proj: &[F],
    sv: &MimoSaved<F>,
    d_o: &[F],
    dproj: &mut [F],
    grad: &mut LayerParams<F>,
) {
    let d = &sh.d;
    let (h_n, p_n, n_n, r_n, s_n, t_n) = (
        d.nheads,
        d.headdim,
        d.d_state,
        d.rank,
        d.num_rope_angles,
        sh.seq_len,
    );
    let (rk, bcw, dpi) = (r_n * n_n, d.bc_width(), d.d_in_proj);
    let nrow = bcw / n_n;
    let rs = &sv.rows;
    let grads: Vec<HeadGrad<F>> = sv
        .heads
        .par_iter()
        .enumerate()
        .map(|(j, hs)| head_backward(sh, lp, proj, rs, hs, d_o, (j / h_n, j % h_n)))
        .collect();
    dproj.iter_mut().for_each(|v| *v = F::zero());
    let a_floor = F::from_f(sh.a_floor);
    let (mut dbn, mut dcn) = (vec![F::zero(); bcw], vec![F::zero(); bcw]);
    for b in 0..sh.batch {
        for t in 0..t_n {
            let row = b * t_n + t;
            let raw = &proj[row * dpi..(row + 1) * dpi];
            let drow = &mut dproj[row * dpi..(row + 1) * dpi];
            dbn.iter_mut().for_each(|v| *v = F::zero());
            dcn.iter_mut().for_each(|v| *v = F::zero());
            for h in 0..h_n {
                let hg = &grads[b * h_n + h];
                drow[d.z_off() + h * p_n..][..p_n].copy_from_slice(&hg.dz[t * p_n..][..p_n]);
                drow[d.x_off() + h * p_n..][..p_n].copy_from_slice(&hg.dx[t * p_n..][..p_n]);
                for r in 0..r_n {
                    let (dk, dq) = (
                        &hg.dk[t * rk + r * n_n..][..n_n],
                        &hg.dq[t * rk + r * n_n..][..n_n],
                    );
                    let src = d.bc_row(r, d.group_of(h));
                    add_into(&mut dbn[src..src + n_n], dk);
                    add_into(&mut dcn[src..src + n_n], dq);
                    let bias = (h * r_n + r) * n_n;
                    add_into(&mut grad.b_bias[bias..bias + n_n], dk);
                    add_into(&mut grad.c_bias[bias..bias + n_n], dq);
                }
                // Δ = softplus(u), u = dd_dt + dt_bias.
                let u = raw[d.dt_off() + h] + lp.dt_bias[h];
                let sp_grad = if u > F::from_f(20.0) {
                    F::one()
                } else {
                    sigmoid(u)
                };
                let ddt = hg.ddelta[t] * sp_grad;
                drow[d.dt_off() + h] = ddt;
                grad.dt_bias[h] = grad.dt_bias[h] + ddt;
                drow[d.a_off() + h] =
                    a_value_grad(raw[d.a_off() + h], a_floor, sh.a_act) * hg.daval[t];
                let lam = rs.lambda[row * h_n + h];
                drow[d.trap_off() + h] = hg.dlambda[t] * lam * (F::one() - lam);
                add_into(
                    &mut drow[d.angle_off()..d.angle_off() + s_n],
                    &hg.dtheta[t * s_n..(t + 1) * s_n],
                );
            }
            for i in 0..s_n {
                let th = raw[d.angle_off() + i].tanh();
                drow[d.angle_off() + i] = drow[d.angle_off() + i] * F::PI() * (F::one() - th * th);
            }
            // Through the B/C RMSNorm of every (rank, group) row.
            for j in 0..nrow {
                let span = j * n_n..(j + 1) * n_n;
                let (db_out, dc_out) = drow.split_at_mut(d.c_off());
                rms_bwd(
                    &raw[d.b_off()..][span.clone()],
                    &lp.b_norm,
                    rs.rb[row * nrow + j],
                    &dbn[span.clone()],
                    &mut db_out[d.b_off()..][span.clone()],
                    &mut grad.b_norm,
                    false,
                );
                rms_bwd(
                    &raw[d.c_off()..][span.clone()],
                    &lp.c_norm,
                    rs.rc[row * nrow + j],
                    &dcn[span.clone()],
                    &mut dc_out[span],
                    &mut grad.c_norm,
                    false,
                );
            }
        }
    }
    let gm = grad
        .mimo
        .as_mut()
        .expect("a MIMO layer's gradient holds mimo_x, mimo_z and mimo_o");
    let rp = r_n * p_n;
    for (h, hg) in grads.iter().enumerate().map(|(j, g)| (j % h_n, g)) {
        grad.d[h] = grad.d[h] + hg.dd;
        add_into(&mut gm.x[h * rp..(h + 1) * rp], &hg.dpsi);
        add_into(&mut gm.z[h * rp..(h + 1) * rp], &hg.dzeta);
        add_into(&mut gm.o[h * rp..(h + 1) * rp], &hg.domega);
        if let Some(w) = &mut grad.out_norm {
            add_into(&mut w[h * p_n..(h + 1) * p_n], &hg.dwnorm);
        }
    }
}
