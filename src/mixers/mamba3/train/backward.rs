//! The backward of the training mixer of [`super::forward`] (whose module doc has the
//! derivation, in the spec's notation): per (sequence, head) chunk by chunk in reverse with
//! the state gradient carried back, then per token through the rotation, the phases, the
//! per-head scalars and the B/C norms into the in_proj row.

#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the math

use super::forward::{MixerSaved, MixerShape};
use crate::cpu::math::{heavy_tail, sigmoid, silu, softplus};
use crate::cpu::matmul::{gemm, View, ViewMut};
use crate::cpu::ops::{rms_bwd, silu_grad};
use crate::cpu::Real;
use crate::mixers::mamba3::params::LayerParams;
use crate::model::config::AActivation;
use rayon::prelude::*;

/// Per-token scalars of one (sequence, head): `Δ, λ, a, γ, c`.
struct Scalars<F> {
    delta: Vec<F>,
    lambda: Vec<F>,
    a: Vec<F>,
    gamma: Vec<F>,
    scale: Vec<F>,
}

fn scalars<F: Real>(sh: &MixerShape, sv: &MixerSaved<F>, b: usize, h: usize) -> Scalars<F> {
    let (t_n, h_n) = (sh.seq_len, sh.d.nheads);
    let at = |v: &Vec<F>, t: usize| v[(b * t_n + t) * h_n + h];
    let delta: Vec<F> = (0..t_n).map(|t| at(&sv.delta, t)).collect();
    let lambda: Vec<F> = (0..t_n).map(|t| at(&sv.lambda, t)).collect();
    let a = (0..t_n).map(|t| at(&sv.aval, t) * delta[t]).collect();
    let gamma: Vec<F> = (0..t_n).map(|t| lambda[t] * delta[t]).collect();
    let scale = (0..t_n)
        .map(|t| {
            let back = if t + 1 < t_n {
                delta[t + 1] * (F::one() - lambda[t + 1])
            } else {
                F::zero()
            };
            gamma[t] + back
        })
        .collect();
    Scalars {
        delta,
        lambda,
        a,
        gamma,
        scale,
    }
}

fn gather_x<F: Real>(sh: &MixerShape, proj: &[F], b: usize, h: usize) -> Vec<F> {
    let d = &sh.d;
    let p_n = d.headdim;
    let mut x = vec![F::zero(); sh.seq_len * p_n];
    for t in 0..sh.seq_len {
        let r = b * sh.seq_len + t;
        x[t * p_n..(t + 1) * p_n]
            .copy_from_slice(&proj[r * d.d_in_proj + d.x_off() + h * p_n..][..p_n]);
    }
    x
}

/// In-chunk cumulative log-decay and the weights `W` (row-major `[l, l]`).
fn chunk_weights<F: Real>(sc: &Scalars<F>, c0: usize, l: usize, lc: &mut [F], w: &mut [F]) {
    let mut acc = F::zero();
    for j in 0..l {
        acc = acc + sc.a[c0 + j];
        lc[j] = acc;
    }
    for j in 0..l {
        for s in 0..l {
            w[j * l + s] = if s < j {
                (lc[j] - lc[s]).exp() * sc.scale[c0 + s]
            } else if s == j {
                sc.gamma[c0 + j]
            } else {
                F::zero()
            };
        }
    }
}

/// Gradients of one (sequence, head).
struct HeadGrad<F> {
    dx: Vec<F>,
    /// unrotated `dk`, `dq`, `[T, N]`
    dk: Vec<F>,
    dq: Vec<F>,
    ddelta: Vec<F>,
    dlambda: Vec<F>,
    /// gradient of `A` (the activated value, before `·Δ`)
    daval: Vec<F>,
    dtheta: Vec<F>,
    dd: F,
}

fn head_backward<F: Real>(
    sh: &MixerShape,
    lp: &LayerParams<F>,
    proj: &[F],
    sv: &MixerSaved<F>,
    dy: &[F],
    b: usize,
    h: usize,
) -> HeadGrad<F> {
    let d = &sh.d;
    let (p_n, n_n, s_n, lmax, t_n) = (
        d.headdim,
        d.d_state,
        d.num_rope_angles,
        d.chunk_len,
        sh.seq_len,
    );
    let hs = &sv.heads[b * d.nheads + h];
    let sc = scalars(sh, sv, b, h);
    let x = gather_x(sh, proj, b, h);
    let mut dyh = vec![F::zero(); t_n * p_n];
    for t in 0..t_n {
        let r = b * t_n + t;
        dyh[t * p_n..(t + 1) * p_n].copy_from_slice(&dy[r * d.d_inner + h * p_n..][..p_n]);
    }
    let dh = lp.d[h];
    let mut dx = vec![F::zero(); t_n * p_n];
    let mut dqr = vec![F::zero(); t_n * n_n];
    let mut dkr = vec![F::zero(); t_n * n_n];
    let mut dc = vec![F::zero(); t_n];
    let mut dgamma = vec![F::zero(); t_n];
    let mut da = vec![F::zero(); t_n];
    let mut dd = F::zero();
    let mut ds_next = vec![F::zero(); p_n * n_n];
    let mut ds_prev = vec![F::zero(); p_n * n_n];
    let mut lc = vec![F::zero(); lmax];
    let mut dlc = vec![F::zero(); lmax];
    let mut w = vec![F::zero(); lmax * lmax];
    let mut am = vec![F::zero(); lmax * lmax];
    let mut gm = vec![F::zero(); lmax * lmax];
    let mut tmp = vec![F::zero(); lmax * lmax];
    let mut inter = vec![F::zero(); lmax * p_n];
    let mut dye = vec![F::zero(); lmax * p_n];
    let mut vbuf = vec![F::zero(); lmax * n_n];
    let mut ubuf = vec![F::zero(); lmax * p_n];
    let nchunks = t_n.div_ceil(lmax);
    for ci in (0..nchunks).rev() {
        let c0 = ci * lmax;
        let l = lmax.min(t_n - c0);
        let s_in = &hs.states[ci * p_n * n_n..(ci + 1) * p_n * n_n];
        chunk_weights(&sc, c0, l, &mut lc, &mut w[..l * l]);
        dlc[..l].iter_mut().for_each(|v| *v = F::zero());
        let qv = View::new(&hs.q[c0 * n_n..(c0 + l) * n_n], l, n_n);
        let kv = View::new(&hs.k[c0 * n_n..(c0 + l) * n_n], l, n_n);
        let xc = &x[c0 * p_n..(c0 + l) * p_n];
        let xv = View::new(xc, l, p_n);
        let dyc = &dyh[c0 * p_n..(c0 + l) * p_n];
        let dyv = View::new(dyc, l, p_n);
        // Ā = Q̃K̃ᵀ, G = dY·Xᵀ.
        gemm(
            ViewMut::new(&mut am[..l * l], l, l),
            None,
            qv,
            kv.t(),
            F::one(),
            1,
        );
        gemm(
            ViewMut::new(&mut gm[..l * l], l, l),
            None,
            dyv,
            xv.t(),
            F::one(),
            1,
        );
        // dX += Σᵀ·dY with Σ = W∘Ā.
        for i in 0..l * l {
            tmp[i] = w[i] * am[i];
        }
        gemm(
            ViewMut::new(&mut dx[c0 * p_n..(c0 + l) * p_n], l, p_n),
            Some(F::one()),
            View::new(&tmp[..l * l], l, l).t(),
            dyv,
            F::one(),
            1,
        );
        // Scalar gradients of W, then G∘W for dQ̃, dK̃.
        for j in 0..l {
            for s in 0..j {
                let i = j * l + s;
                let dw = gm[i] * am[i];
                let t = dw * w[i];
                dlc[j] = dlc[j] + t;
                dlc[s] = dlc[s] - t;
                dc[c0 + s] = dc[c0 + s] + dw * (lc[j] - lc[s]).exp();
            }
            let i = j * l + j;
            dgamma[c0 + j] = dgamma[c0 + j] + gm[i] * am[i];
        }
        for i in 0..l * l {
            tmp[i] = gm[i] * w[i];
        }
        let gw = View::new(&tmp[..l * l], l, l);
        gemm(
            ViewMut::new(&mut dqr[c0 * n_n..(c0 + l) * n_n], l, n_n),
            Some(F::one()),
            gw,
            kv,
            F::one(),
            1,
        );
        gemm(
            ViewMut::new(&mut dkr[c0 * n_n..(c0 + l) * n_n], l, n_n),
            Some(F::one()),
            gw.t(),
            qv,
            F::one(),
            1,
        );
        // Inter-chunk term.
        let sview = View::new(s_in, p_n, n_n);
        gemm(
            ViewMut::new(&mut inter[..l * p_n], l, p_n),
            None,
            qv,
            sview.t(),
            F::one(),
            1,
        );
        for j in 0..l {
            let e = lc[j].exp();
            let mut dot = F::zero();
            for p in 0..p_n {
                dot = dot + dyc[j * p_n + p] * inter[j * p_n + p];
                dye[j * p_n + p] = e * dyc[j * p_n + p];
            }
            dlc[j] = dlc[j] + e * dot;
        }
        let dyev = View::new(&dye[..l * p_n], l, p_n);
        gemm(
            ViewMut::new(&mut dqr[c0 * n_n..(c0 + l) * n_n], l, n_n),
            Some(F::one()),
            dyev,
            sview,
            F::one(),
            1,
        );
        let lc_end = lc[l - 1];
        let e_end = lc_end.exp();
        let mut dlc_end = F::zero();
        for i in 0..p_n * n_n {
            dlc_end = dlc_end + ds_next[i] * s_in[i];
        }
        dlc_end = dlc_end * e_end;
        ds_prev.copy_from_slice(&ds_next);
        gemm(
            ViewMut::new(&mut ds_prev, p_n, n_n),
            Some(e_end),
            dyev.t(),
            qv,
            F::one(),
            1,
        );
        // State update term.
        let dsv = View::new(&ds_next, p_n, n_n);
        gemm(
            ViewMut::new(&mut vbuf[..l * n_n], l, n_n),
            None,
            xv,
            dsv,
            F::one(),
            1,
        );
        gemm(
            ViewMut::new(&mut ubuf[..l * p_n], l, p_n),
            None,
            kv,
            dsv.t(),
            F::one(),
            1,
        );
        for s in 0..l {
            let e = (lc_end - lc[s]).exp();
            let ws = e * sc.scale[c0 + s];
            let mut u = F::zero();
            for n in 0..n_n {
                let vv = vbuf[s * n_n + n];
                u = u + vv * hs.k[(c0 + s) * n_n + n];
                dkr[(c0 + s) * n_n + n] = dkr[(c0 + s) * n_n + n] + ws * vv;
            }
            for p in 0..p_n {
                dx[(c0 + s) * p_n + p] = dx[(c0 + s) * p_n + p] + ws * ubuf[s * p_n + p];
            }
            dc[c0 + s] = dc[c0 + s] + e * u;
            dlc[s] = dlc[s] - ws * u;
            dlc_end = dlc_end + ws * u;
        }
        // D skip.
        for i in 0..l * p_n {
            dx[c0 * p_n + i] = dx[c0 * p_n + i] + dh * dyc[i];
            dd = dd + dyc[i] * xc[i];
        }
        dlc[l - 1] = dlc[l - 1] + dlc_end;
        let mut acc = F::zero();
        for j in (0..l).rev() {
            acc = acc + dlc[j];
            da[c0 + j] = acc;
        }
        std::mem::swap(&mut ds_next, &mut ds_prev);
    }
    // Per-token scalars.
    let mut ddelta = vec![F::zero(); t_n];
    let mut dlambda = vec![F::zero(); t_n];
    let mut daval = vec![F::zero(); t_n];
    for t in 0..t_n {
        dgamma[t] = dgamma[t] + dc[t];
        if t + 1 < t_n {
            ddelta[t + 1] = ddelta[t + 1] + dc[t] * (F::one() - sc.lambda[t + 1]);
            dlambda[t + 1] = dlambda[t + 1] - dc[t] * sc.delta[t + 1];
        }
    }
    let r0 = b * t_n;
    for t in 0..t_n {
        dlambda[t] = dlambda[t] + dgamma[t] * sc.delta[t];
        ddelta[t] = ddelta[t] + dgamma[t] * sc.lambda[t];
        let aval = sv.aval[(r0 + t) * d.nheads + h];
        daval[t] = da[t] * sc.delta[t];
        ddelta[t] = ddelta[t] + da[t] * aval;
    }
    // Rotation and phases.
    let mut dtheta = vec![F::zero(); t_n * s_n];
    let mut g = vec![F::zero(); s_n];
    let mut dq = dqr;
    let mut dk = dkr;
    for t in (0..t_n).rev() {
        let (cs, sn) = (&hs.cos[t * s_n..][..s_n], &hs.sin[t * s_n..][..s_n]);
        for i in 0..s_n {
            let mut dphi = F::zero();
            for (dv, v) in [(&mut dq, &hs.q), (&mut dk, &hs.k)] {
                let (a, bb) = (t * n_n + 2 * i, t * n_n + 2 * i + 1);
                let (da_, db_) = (dv[a], dv[bb]);
                dphi = dphi - da_ * v[bb] + db_ * v[a];
                dv[a] = da_ * cs[i] + db_ * sn[i];
                dv[bb] = -da_ * sn[i] + db_ * cs[i];
            }
            g[i] = g[i] + dphi;
            let th = sv.theta[(r0 + t) * s_n + i];
            dtheta[t * s_n + i] = g[i] * sc.delta[t];
            ddelta[t] = ddelta[t] + g[i] * th;
        }
    }
    HeadGrad {
        dx,
        dk,
        dq,
        ddelta,
        dlambda,
        daval,
        dtheta,
        dd,
    }
}

/// Backward of one mixer. `d_o` is the gradient of the gated output `[rows, D_i]`. Writes
/// the gradient of `proj` into `dproj` (`[rows, d_in_proj]`, overwritten) and adds the
/// mixer's own parameter gradients into `grad`.
pub fn mixer_backward<F: Real>(
    sh: &MixerShape,
    lp: &LayerParams<F>,
    proj: &[F],
    sv: &MixerSaved<F>,
    d_o: &[F],
    dproj: &mut [F],
    grad: &mut LayerParams<F>,
) {
    let d = &sh.d;
    let (h_n, p_n, n_n, g_n, s_n, t_n) = (
        d.nheads,
        d.headdim,
        d.d_state,
        d.ngroups,
        d.num_rope_angles,
        sh.seq_len,
    );
    let rows = sh.batch * t_n;
    let dpi = d.d_in_proj;
    dproj.iter_mut().for_each(|v| *v = F::zero());
    // Gate backward: dy and dz.
    let mut dy = vec![F::zero(); rows * d.d_inner];
    let mut d_onorm = vec![F::zero(); d.d_inner];
    for r in 0..rows {
        let z = &proj[r * dpi + d.z_off()..][..d.d_inner];
        let yr = &sv.y[r * d.d_inner..(r + 1) * d.d_inner];
        let dor = &d_o[r * d.d_inner..(r + 1) * d.d_inner];
        let dyr = &mut dy[r * d.d_inner..(r + 1) * d.d_inner];
        let dz = &mut dproj[r * dpi + d.z_off()..][..d.d_inner];
        match &lp.out_norm {
            None => {
                for i in 0..d.d_inner {
                    dyr[i] = dor[i] * silu(z[i]);
                    dz[i] = dor[i] * yr[i] * silu_grad(z[i]);
                }
            }
            Some(w) => {
                let mut dn = vec![F::zero(); p_n];
                for h in 0..h_n {
                    let rg = h * p_n..(h + 1) * p_n;
                    let ryv = sv.ry[r * h_n + h];
                    for (k, i) in rg.clone().enumerate() {
                        let n = yr[i] * ryv * w[i];
                        dn[k] = dor[i] * silu(z[i]);
                        dz[i] = dor[i] * n * silu_grad(z[i]);
                    }
                    rms_bwd(
                        &yr[rg.clone()],
                        &w[rg.clone()],
                        ryv,
                        &dn,
                        &mut dyr[rg.clone()],
                        &mut d_onorm[rg],
                        false,
                    );
                }
            }
        }
    }
    if let Some(g) = &mut grad.out_norm {
        g.iter_mut().zip(&d_onorm).for_each(|(a, &b)| *a = *a + b);
    }
    // Scan backward per (sequence, head).
    let tasks: Vec<(usize, usize)> = (0..sh.batch)
        .flat_map(|b| (0..h_n).map(move |h| (b, h)))
        .collect();
    let grads: Vec<HeadGrad<F>> = tasks
        .par_iter()
        .map(|&(b, h)| head_backward(sh, lp, proj, sv, &dy, b, h))
        .collect();
    // Scatter into dproj and parameter gradients.
    let a_floor = F::from_f(sh.a_floor);
    let mut dbc = vec![F::zero(); 2 * g_n * n_n];
    for b in 0..sh.batch {
        for t in 0..t_n {
            let r = b * t_n + t;
            let row = &proj[r * dpi..(r + 1) * dpi];
            let drow = &mut dproj[r * dpi..(r + 1) * dpi];
            dbc.iter_mut().for_each(|v| *v = F::zero());
            for h in 0..h_n {
                let hg = &grads[b * h_n + h];
                let g = d.group_of(h);
                drow[d.x_off() + h * p_n..][..p_n].copy_from_slice(&hg.dx[t * p_n..(t + 1) * p_n]);
                for i in 0..n_n {
                    let (dk, dq) = (hg.dk[t * n_n + i], hg.dq[t * n_n + i]);
                    dbc[g * n_n + i] = dbc[g * n_n + i] + dk;
                    dbc[(g_n + g) * n_n + i] = dbc[(g_n + g) * n_n + i] + dq;
                    grad.b_bias[h * n_n + i] = grad.b_bias[h * n_n + i] + dk;
                    grad.c_bias[h * n_n + i] = grad.c_bias[h * n_n + i] + dq;
                }
                // Δ = softplus(u), u = dd_dt + dt_bias.
                let u = row[d.dt_off() + h] + lp.dt_bias[h];
                let sp_grad = if u > F::from_f(20.0) {
                    F::one()
                } else {
                    sigmoid(u)
                };
                let ddt = hg.ddelta[t] * sp_grad;
                drow[d.dt_off() + h] = ddt;
                grad.dt_bias[h] = grad.dt_bias[h] + ddt;
                // A = min(−f(dd_A), −A_floor).
                let dda = row[d.a_off() + h];
                let (f, fp) = match sh.a_act {
                    AActivation::HeavyTail => (
                        heavy_tail(dda),
                        if dda >= F::zero() {
                            F::one()
                        } else {
                            let v = F::one() - dda;
                            F::one() / (v * v)
                        },
                    ),
                    AActivation::Softplus => (softplus(dda), sigmoid(dda)),
                };
                drow[d.a_off() + h] = if -f < -a_floor {
                    -fp * hg.daval[t]
                } else {
                    F::zero()
                };
                let lam = sv.lambda[r * h_n + h];
                drow[d.trap_off() + h] = hg.dlambda[t] * lam * (F::one() - lam);
                for i in 0..s_n {
                    drow[d.angle_off() + i] = drow[d.angle_off() + i] + hg.dtheta[t * s_n + i];
                }
            }
            for i in 0..s_n {
                let th = row[d.angle_off() + i].tanh();
                drow[d.angle_off() + i] = drow[d.angle_off() + i] * F::PI() * (F::one() - th * th);
            }
            for g in 0..g_n {
                let rb = sv.rbc[r * 2 * g_n + g];
                let rc = sv.rbc[r * 2 * g_n + g_n + g];
                let braw = &row[d.b_off() + g * n_n..][..n_n];
                let craw = &row[d.c_off() + g * n_n..][..n_n];
                let (db_out, dc_out) = drow.split_at_mut(d.c_off());
                rms_bwd(
                    braw,
                    &lp.b_norm,
                    rb,
                    &dbc[g * n_n..(g + 1) * n_n],
                    &mut db_out[d.b_off() + g * n_n..][..n_n],
                    &mut grad.b_norm,
                    false,
                );
                rms_bwd(
                    craw,
                    &lp.c_norm,
                    rc,
                    &dbc[(g_n + g) * n_n..][..n_n],
                    &mut dc_out[g * n_n..][..n_n],
                    &mut grad.c_norm,
                    false,
                );
            }
        }
        for h in 0..h_n {
            grad.d[h] = grad.d[h] + grads[b * h_n + h].dd;
        }
    }
}
