//! Chunked prefill of one MIMO mixer layer (spec-MIMO §4), one sequence, heads in
//! parallel, from a fresh or a carried state.
//!
//! Per head, a chunk of `L` tokens is a matrix problem on `L·R` rows, token-major and
//! rank-minor (row `j·R + r`). With `Lc_j = Σ_{s ≤ j} a_s` inside the chunk,
//! `c_s = γ_s + γ'_s` (`γ'_s = Δ_{s+1}(1 − λ_{s+1})`, zero for the window's last token) and
//! `S` the `P×N` state entering the chunk (§4.1):
//!
//! ```text
//! Y[j·R+r] = Σ_{s<j} e^{Lc_j − Lc_s}·c_s·Σ_{r'} ⟨q̃_{j,r}, k̃_{s,r'}⟩·u_{s,r'}     (intra, strictly earlier)
//!          + γ_j·Σ_{r'} ⟨q̃_{j,r}, k̃_{j,r'}⟩·u_{j,r'}                            (same token, R×R block)
//!          + e^{Lc_j}·S·q̃_{j,r} + D·u_{j,r}                                     (inter, skip)
//! S' = e^{Lc_end}·S + Σ_{rows} e^{Lc_end − Lc_s}·c_s·outer(u_{s,r}, k̃_{s,r})
//! ```
//!
//! so the rank axis turns every product into a real GEMM: `M = Q̃K̃ᵀ` (`LR×LR`), `M·U`,
//! `Q̃Sᵀ` and `(wU)ᵀK̃`. (The same-token block uses rotated vectors; it equals the
//! kernel's unrotated `⟨q, k⟩` since one rotation is shared by both.) A window continuing a
//! state enters with the folded state `S_enter = h⁻ + Δ_0(1 − λ_0)·Σ_r outer(v⁻ ⊙ ψ_r, k⁻_r)`
//! (§3.4): the first token's look-back term reaches across the seam.

use super::reference::{
    check_window, layer, rotate_half, MimoLayerView, MimoMixerCtx, MimoSeqState, MimoTokenPre,
};
use super::weights::MimoWeights;
use crate::cpu::math::{rms_norm, silu, wrap_angle};
use crate::cpu::matmul::{gemm, matmul_t, View, ViewMut};
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::mixers::LogitsWant;
use crate::model::config::NORM_EPS;
use rayon::prelude::*;

/// The MIMO language model over one window of tokens from `state` (fresh or carried),
/// every mixer on the chunked prefill with chunks of `chunk_len` tokens: logits
/// `[T, vocab_padded]`; `state` is advanced past the window. The blocks are SISO spec §2.7.
pub fn mimo_prefill<F: Real>(
    w: &MimoWeights,
    tokens: &[u32],
    state: &mut MimoSeqState<F>,
    chunk_len: usize,
) -> Result<Vec<F>> {
    mimo_prefill_rows(w, tokens, state, chunk_len, LogitsWant::All, true)
}

/// [`mimo_prefill`] returning only the rows `want` asks for: logits `[rows, vocab_padded]`
/// with `head`, else the hidden states after `norm_f` `[rows, D_m]`.
pub fn mimo_prefill_rows<F: Real>(
    w: &MimoWeights,
    tokens: &[u32],
    state: &mut MimoSeqState<F>,
    chunk_len: usize,
    want: LogitsWant,
    head: bool,
) -> Result<Vec<F>> {
    Ok(mimo_forward(w, &[tokens], &mut [state], chunk_len, want, head)?.remove(0))
}

/// The MIMO language model over a packed batch: each sequence's tokens from its own state
/// (fresh or carried), which is advanced past them. The projections are one product over
/// every row of the batch (a decode step of B sequences reads each weight once); each
/// sequence's mixers run on its own rows. Returns each sequence's rows `want` asks for,
/// logits with `head`, else the hidden states after `norm_f`. Nothing is changed when an
/// argument is refused.
pub fn mimo_forward<F: Real>(
    w: &MimoWeights,
    seqs: &[&[u32]],
    states: &mut [&mut MimoSeqState<F>],
    chunk_len: usize,
    want: LogitsWant,
    head: bool,
) -> Result<Vec<Vec<F>>> {
    let d = w.dims;
    if seqs.len() != states.len() {
        return Err(Error::input(format!(
            "{} sequences but {} states: expected one state per sequence",
            seqs.len(),
            states.len()
        )));
    }
    for (s, st) in seqs.iter().zip(states.iter()) {
        check_window(&d, s, st)?;
    }
    if chunk_len == 0 {
        return Err(Error::input("chunk length 0: expected at least 1"));
    }
    let starts: Vec<usize> = seqs
        .iter()
        .scan(0, |acc, s| {
            let start = *acc;
            *acc += s.len();
            Some(start)
        })
        .collect();
    let tokens: Vec<u32> = seqs.concat();
    let (rows, dm) = (tokens.len(), d.d_model);
    let mut hs = vec![F::zero(); rows * dm];
    hs.par_chunks_mut(dm).zip(&tokens).for_each(|(row, &t)| {
        for (i, v) in row.iter_mut().enumerate() {
            *v = F::from_f(w.embedding.data.get_f64(t as usize * dm + i));
        }
    });
    let mut res = vec![F::zero(); rows * dm];
    let mut normed = vec![F::zero(); rows * dm];
    let mut proj = vec![F::zero(); rows * d.d_in_proj];
    let mut o = vec![F::zero(); rows * d.d_inner];
    let mut vg = vec![F::zero(); rows * 2 * d.mlp_hidden];
    let mut act = vec![F::zero(); rows * d.mlp_hidden];
    for (l, lw) in w.layers.iter().enumerate() {
        add_assign(&mut res, &hs);
        norm_rows(&res, &lw.norm, dm, &mut normed);
        matmul_t(&normed, rows, &lw.in_proj, &mut proj);
        let ctx = MimoMixerCtx::new(w, l);
        for ((s, &start), st) in seqs.iter().zip(&starts).zip(states.iter_mut()) {
            let (pr, or) = (start * d.d_in_proj, start * d.d_inner);
            mimo_mixer_prefill(
                &ctx,
                &proj[pr..pr + s.len() * d.d_in_proj],
                s.len(),
                chunk_len,
                &mut layer(st, l, &d),
                &mut o[or..or + s.len() * d.d_inner],
            )?;
        }
        matmul_t(&o, rows, &lw.out_proj, &mut hs);
        if let Some(mlp) = &lw.mlp {
            add_assign(&mut res, &hs);
            norm_rows(&res, &mlp.norm, dm, &mut normed);
            let hidden = d.mlp_hidden;
            matmul_t(&normed, rows, &mlp.fc1, &mut vg);
            act.par_chunks_mut(hidden)
                .zip(vg.par_chunks(2 * hidden))
                .for_each(|(a, vg)| {
                    for i in 0..hidden {
                        a[i] = vg[i] * silu(vg[hidden + i]);
                    }
                });
            matmul_t(&act, rows, &mlp.fc2, &mut hs);
        }
    }
    add_assign(&mut res, &hs);
    // The rows asked for, sequence by sequence: `(first row, count)`.
    let picked: Vec<(usize, usize)> = seqs
        .iter()
        .zip(&starts)
        .map(|(s, &start)| match want {
            LogitsWant::All => (start, s.len()),
            LogitsWant::Last => (start + s.len().saturating_sub(1), s.len().min(1)),
            LogitsWant::None => (start, 0),
        })
        .collect();
    let kept: usize = picked.iter().map(|p| p.1).sum();
    let mut sel = Vec::with_capacity(kept * dm);
    for &(first, count) in &picked {
        sel.extend_from_slice(&res[first * dm..(first + count) * dm]);
    }
    let mut out = vec![F::zero(); kept * dm];
    norm_rows(&sel, &w.norm_f, dm, &mut out);
    let width = if head {
        let mut logits = vec![F::zero(); kept * d.vocab_padded];
        matmul_t(&out, kept, w.head(), &mut logits);
        out = logits;
        d.vocab_padded
    } else {
        dm
    };
    let mut at = 0;
    Ok(picked
        .iter()
        .map(|&(_, count)| {
            let rows = out[at * width..(at + count) * width].to_vec();
            at += count;
            rows
        })
        .collect())
}

fn norm_rows<F: Real>(x: &[F], w: &[f32], width: usize, out: &mut [F]) {
    out.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .for_each(|(o, r)| rms_norm(r, w, F::from_f(NORM_EPS), o));
}

fn add_assign<F: Real>(acc: &mut [F], x: &[F]) {
    acc.iter_mut().zip(x).for_each(|(a, &b)| *a = *a + b);
}

/// What one head leaves behind.
struct HeadOut<F> {
    /// combined output `o` `[len, P]`
    o: Vec<F>,
    /// last keys `[R, N]`
    k: Vec<F>,
    v: Vec<F>,
}

/// Mixer prefill of one sequence: `proj` is the `in_proj` output `[len, d_in_proj]`;
/// `out` receives `o` `[len, D_i]` (before `out_proj`) and `state` is advanced past the
/// window. `chunk_len` is the chunk length `L` (≥ 1; any value gives the same function).
/// Sizes that do not fit are an error and leave everything untouched.
pub fn mimo_mixer_prefill<F: Real>(
    ctx: &MimoMixerCtx,
    proj: &[F],
    len: usize,
    chunk_len: usize,
    state: &mut MimoLayerView<'_, F>,
    out: &mut [F],
) -> Result<()> {
    let d = &ctx.d;
    if chunk_len == 0 {
        return Err(Error::input("chunk length 0: expected at least 1"));
    }
    for (what, found, want) in [
        ("in_proj output", proj.len(), len * d.d_in_proj),
        ("mixer output", out.len(), len * d.d_inner),
    ] {
        if found != want {
            return Err(Error::input(format!(
                "MIMO mixer prefill: {what} has {found} numbers, expected {want} for {len} tokens"
            )));
        }
    }
    state.check(d)?;
    if len == 0 {
        return Ok(());
    }
    let pre = ctx.token_pre(proj, len);
    let (h_n, p_n, n_n, s_n) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
    // Each head advances its own angle and ssm slices in place; the carried keys and
    // values are read by every head before any is replaced (below).
    let results: Vec<HeadOut<F>> = {
        let MimoLayerView { angle, ssm, k, v } = state;
        let (k_prev, v_prev): (&[F], &[F]) = (k, v);
        let angles: Vec<&mut [F]> = if s_n == 0 {
            (0..h_n).map(|_| <&mut [F]>::default()).collect()
        } else {
            angle.chunks_mut(s_n).collect()
        };
        ssm.par_chunks_mut(p_n * n_n)
            .zip(angles)
            .enumerate()
            .map(|(h, (ssm_h, angle_h))| {
                let carried = Carried {
                    k: k_prev,
                    v: v_prev,
                };
                scan_head(ctx, proj, len, chunk_len, &pre, h, angle_h, ssm_h, carried)
            })
            .collect()
    };
    for (h, r) in results.into_iter().enumerate() {
        for t in 0..len {
            out[t * d.d_inner + h * p_n..][..p_n].copy_from_slice(&r.o[t * p_n..(t + 1) * p_n]);
        }
        for rk in 0..d.rank {
            state.k[(rk * h_n + h) * n_n..][..n_n].copy_from_slice(&r.k[rk * n_n..(rk + 1) * n_n]);
        }
        state.v[h * p_n..(h + 1) * p_n].copy_from_slice(&r.v);
    }
    Ok(())
}

/// The layer's carried keys `[R, H, N]` and raw x `[H, P]` as the window found them.
struct Carried<'a, F> {
    k: &'a [F],
    v: &'a [F],
}

/// Every chunk of one head, in order, advancing its `angle` `[S]` and `ssm` `[P, N]`.
#[allow(clippy::too_many_arguments)]
fn scan_head<F: Real>(
    ctx: &MimoMixerCtx,
    proj: &[F],
    len: usize,
    chunk_len: usize,
    pre: &MimoTokenPre<F>,
    h: usize,
    angle: &mut [F],
    ssm: &mut [F],
    st: Carried<F>,
) -> HeadOut<F> {
    let d = &ctx.d;
    let (h_n, p_n, n_n, r_n, s_n) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
    let (dpi, bcw) = (d.d_in_proj, d.bc_width());
    let l_max = chunk_len.min(len);
    let rows_max = l_max * r_n;
    let d_skip = F::from_f(ctx.lw.d[h] as f64);
    let psi: Vec<F> = (0..r_n)
        .flat_map(|r| ctx.per_rank(&ctx.lw.mimo_x, h, r).iter())
        .map(|&v| F::from_f(v as f64))
        .collect();
    let x_of = |t: usize| &proj[t * dpi + d.x_off() + h * p_n..][..p_n];

    // Boundary fold (§3.4): the carried keys and raw x enter with weight Δ_0(1 − λ_0).
    let fold = pre.delta[h] * (F::one() - pre.lambda[h]);
    for r in 0..r_n {
        let k_prev = &st.k[(r * h_n + h) * n_n..][..n_n];
        for p in 0..p_n {
            let w = fold * st.v[h * p_n + p] * psi[r * p_n + p];
            let row = &mut ssm[p * n_n..(p + 1) * n_n];
            for n in 0..n_n {
                row[n] = row[n] + w * k_prev[n];
            }
        }
    }

    let mut o = vec![F::zero(); len * p_n];
    let mut q = vec![F::zero(); rows_max * n_n];
    let mut k = vec![F::zero(); rows_max * n_n];
    let mut u = vec![F::zero(); rows_max * p_n];
    let mut uw = vec![F::zero(); rows_max * p_n];
    let mut m = vec![F::zero(); rows_max * rows_max];
    let mut y = vec![F::zero(); rows_max * p_n];
    let mut inter = vec![F::zero(); rows_max * p_n];
    let mut lc = vec![F::zero(); l_max];
    let mut gamma = vec![F::zero(); l_max];
    let mut scale = vec![F::zero(); l_max];
    let mut decay = vec![F::zero(); l_max * l_max];
    let (mut cos, mut sin) = (vec![F::zero(); s_n], vec![F::zero(); s_n]);

    let mut c0 = 0;
    while c0 < len {
        let l = l_max.min(len - c0);
        let rows = l * r_n;
        // Per token: phase, rotated keys/queries of every rank, values, weights, decay.
        let mut acc = F::zero();
        for j in 0..l {
            let t = c0 + j;
            let delta = pre.delta[t * h_n + h];
            for i in 0..s_n {
                angle[i] = wrap_angle(angle[i] + pre.theta[t * s_n + i] * delta);
                (sin[i], cos[i]) = angle[i].sin_cos_fast();
            }
            let (b, c) = (
                &pre.b[t * bcw..(t + 1) * bcw],
                &pre.c[t * bcw..(t + 1) * bcw],
            );
            let x = x_of(t);
            for r in 0..r_n {
                let row = j * r_n + r;
                let (kr, qr) = (
                    &mut k[row * n_n..(row + 1) * n_n],
                    &mut q[row * n_n..(row + 1) * n_n],
                );
                ctx.biased_kq(b, c, h, r, kr, qr);
                rotate_half(kr, &cos, &sin);
                rotate_half(qr, &cos, &sin);
                for p in 0..p_n {
                    u[row * p_n + p] = x[p] * psi[r * p_n + p];
                }
            }
            gamma[j] = pre.lambda[t * h_n + h] * delta;
            let look_back = if t + 1 < len {
                pre.delta[(t + 1) * h_n + h] * (F::one() - pre.lambda[(t + 1) * h_n + h])
            } else {
                F::zero()
            };
            scale[j] = gamma[j] + look_back;
            acc = acc + pre.a[t * h_n + h];
            lc[j] = acc;
        }
        let lc_end = lc[l - 1];
        // Token-pair weights: strictly earlier tokens decay, the same token takes γ.
        for j in 0..l {
            for s in 0..l {
                decay[j * l + s] = if s < j {
                    (lc[j] - lc[s]).exp_fast() * scale[s]
                } else if s == j {
                    gamma[j]
                } else {
                    F::zero()
                };
            }
        }
        let (qv, kv, uv) = (
            View::new(&q[..rows * n_n], rows, n_n),
            View::new(&k[..rows * n_n], rows, n_n),
            View::new(&u[..rows * p_n], rows, p_n),
        );

        // Intra-chunk: M = Q̃K̃ᵀ weighted per token pair, then Y = M·U. M is block lower
        // triangular (R×R blocks), so the rows of the first `a` tokens only need their
        // first `a` tokens' columns: a quarter of both products is skipped.
        let top = (l / 2) * r_n;
        gemm(
            ViewMut::strided(&mut m, top, top, rows, 1),
            None,
            qv.rows(0, top),
            kv.rows(0, top).t(),
            F::one(),
            1,
        );
        gemm(
            ViewMut::strided(&mut m[top * rows..], rows - top, rows, rows, 1),
            None,
            qv.rows(top, rows),
            kv.t(),
            F::one(),
            1,
        );
        for i in 0..rows {
            let cols = if i < top { top } else { rows };
            let wrow = &decay[(i / r_n) * l..(i / r_n + 1) * l];
            let mrow = &mut m[i * rows..i * rows + cols];
            for (block, &wv) in mrow.chunks_exact_mut(r_n).zip(wrow) {
                block.iter_mut().for_each(|v| *v = *v * wv);
            }
        }
        let (y_top, y_bottom) = y[..rows * p_n].split_at_mut(top * p_n);
        let mv = View::new(&m[..rows * rows], rows, rows);
        gemm(
            ViewMut::new(y_top, top, p_n),
            None,
            mv.rows(0, top).cols(0, top),
            uv.rows(0, top),
            F::one(),
            1,
        );
        gemm(
            ViewMut::new(y_bottom, rows - top, p_n),
            None,
            mv.rows(top, rows),
            uv,
            F::one(),
            1,
        );

        // Inter-chunk and skip: Y += e^{Lc_j}·Q̃·Sᵀ + D·U.
        gemm(
            ViewMut::new(&mut inter[..rows * p_n], rows, p_n),
            None,
            qv,
            View::new(ssm, p_n, n_n).t(),
            F::one(),
            1,
        );
        for i in 0..rows {
            let e = lc[i / r_n].exp_fast();
            for p in 0..p_n {
                let at = i * p_n + p;
                y[at] = y[at] + e * inter[at] + d_skip * u[at];
            }
        }

        // State: S ← e^{Lc_end}·S + (w ⊙ U)ᵀ·K̃, w = e^{Lc_end − Lc_s}·c_s per token.
        for i in 0..rows {
            let s = i / r_n;
            let w = (lc_end - lc[s]).exp_fast() * scale[s];
            for p in 0..p_n {
                uw[i * p_n + p] = w * u[i * p_n + p];
            }
        }
        gemm(
            ViewMut::new(ssm, p_n, n_n),
            Some(lc_end.exp_fast()),
            View::new(&uw[..rows * p_n], rows, p_n).t(),
            kv,
            F::one(),
            1,
        );

        // Combine each token's R readouts into one P-vector.
        for j in 0..l {
            let t = c0 + j;
            let z = &proj[t * dpi + d.z_off() + h * p_n..][..p_n];
            ctx.combine_ranks(
                &y[j * r_n * p_n..(j + 1) * r_n * p_n],
                z,
                h,
                &mut o[t * p_n..(t + 1) * p_n],
                true,
            );
        }
        c0 += l;
    }
    // The last token's keys (still in the buffers) and raw x become the carried k and v.
    let l_last = len - (len - 1) / l_max * l_max;
    HeadOut {
        o,
        k: k[(l_last - 1) * r_n * n_n..l_last * r_n * n_n].to_vec(),
        v: x_of(len - 1).to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mixers::mimo::golden_tests::{fixture, rel_l2, Golden, MIMO_FIXTURES};
    use crate::mixers::mimo::reference::{mixer_token, MimoLayerState, MimoReference};
    use crate::mixers::mimo::weights::mimo_config_from_json_str;
    use crate::model::rng::Rng;
    use crate::model::DType;

    fn to64<F: Real>(v: &[F]) -> Vec<f64> {
        v.iter().map(|x| x.to_f64().unwrap()).collect()
    }

    /// Worst relative L2 of prefill vs reference over the four state tensors; angles are
    /// compared through (cos, sin) so that a wrap at 2π is no difference.
    fn state_gap<F: Real>(a: &MimoLayerState<F>, b: &MimoLayerState<F>) -> f64 {
        let trig = |s: &MimoLayerState<F>| -> Vec<f64> {
            s.angle
                .iter()
                .flat_map(|p| {
                    let p = p.to_f64().unwrap();
                    [p.cos(), p.sin()]
                })
                .collect()
        };
        [
            rel_l2(&trig(a), &trig(b)),
            rel_l2(&a.ssm, &to64(&b.ssm)),
            rel_l2(&a.k, &to64(&b.k)),
            rel_l2(&a.v, &to64(&b.v)),
        ]
        .into_iter()
        .fold(0.0, f64::max)
    }

    /// A random MIMO layer: (d_model, headdim, d_state, R, G, rope, outproj norm).
    fn random_model(
        shape: (usize, usize, usize, usize, usize, f64, bool),
        dtype: DType,
    ) -> MimoWeights {
        let (dm, p, n, r, g, rope, norm) = shape;
        let cfg = format!(
            r#"{{"d_model": {dm}, "n_layer": 1, "vocab_size": 30, "ssm_cfg": {{
                "layer": "Mamba3", "d_state": {n}, "headdim": {p}, "ngroups": {g},
                "rope_fraction": {rope}, "is_outproj_norm": {norm}, "is_mimo": true,
                "mimo_rank": {r}}}}}"#
        );
        let cfg = mimo_config_from_json_str(&cfg, "random").unwrap();
        MimoWeights::synthetic(cfg, dtype, (dm * 31 + r * 7 + g) as u64).unwrap()
    }

    /// The mixer prefill, run as windows ending at `ends` from `start`, against the
    /// token-by-token mixer from the same state: worst relative L2 of outputs and states.
    fn prefill_vs_reference<F: Real>(
        w: &MimoWeights,
        proj: &[F],
        start: &MimoLayerState<F>,
        ends: &[usize],
        chunk: usize,
    ) -> f64 {
        let ctx = MimoMixerCtx::new(w, 0);
        let (dpi, di) = (w.dims.d_in_proj, w.dims.d_inner);
        let len = *ends.last().unwrap();
        let mut want_st = start.clone();
        let mut want = vec![F::zero(); len * di];
        for t in 0..len {
            let row = &proj[t * dpi..(t + 1) * dpi];
            mixer_token(
                &ctx,
                row,
                &mut want_st.view(),
                &mut want[t * di..(t + 1) * di],
            );
        }
        let mut st = start.clone();
        let mut got = vec![F::zero(); len * di];
        let mut s = 0;
        for &e in ends {
            let (p, o) = (&proj[s * dpi..e * dpi], &mut got[s * di..e * di]);
            mimo_mixer_prefill(&ctx, p, e - s, chunk, &mut st.view(), o).unwrap();
            s = e;
        }
        rel_l2(&got, &to64(&want)).max(state_gap(&st, &want_st))
    }

    fn check_random_configs<F: Real>(dtype: DType, tol: f64) {
        let shapes = [
            (32, 8, 16, 1, 2, 0.5, false),
            (32, 8, 16, 2, 4, 1.0, true),
            (48, 16, 32, 4, 2, 0.5, true),
            (32, 16, 8, 8, 1, 1.0, false),
            (64, 16, 32, 4, 8, 1.0, false),
        ];
        let mut worst = 0.0f64;
        for shape in shapes {
            let w = random_model(shape, dtype);
            let dpi = w.dims.d_in_proj;
            let mut rng = Rng::new(shape.0 as u64 + shape.3 as u64);
            let total = 9 + 45;
            let proj: Vec<F> = (0..total * dpi).map(|_| F::from_f(rng.normal())).collect();
            // A carried state: the reference over 9 tokens.
            let ctx = MimoMixerCtx::new(&w, 0);
            let mut carried = MimoLayerState::zeros(&w.dims);
            let mut scratch = vec![F::zero(); w.dims.d_inner];
            for t in 0..9 {
                mixer_token(
                    &ctx,
                    &proj[t * dpi..(t + 1) * dpi],
                    &mut carried.view(),
                    &mut scratch,
                );
            }
            let fresh = MimoLayerState::zeros(&w.dims);
            let rest = &proj[9 * dpi..];
            for chunk in [1, 4, 8, 16, 64] {
                for (start, ends) in [
                    (&fresh, vec![45]),
                    (&fresh, vec![1, 2, 19, 45]),
                    (&carried, vec![45]),
                    (&carried, vec![5, 6, 23, 44, 45]),
                    (&carried, vec![7]),
                ] {
                    let e = prefill_vs_reference(&w, rest, start, &ends, chunk);
                    assert!(e <= tol, "{shape:?} chunk {chunk} windows {ends:?}: {e:e}");
                    worst = worst.max(e);
                }
            }
        }
        eprintln!("mixer prefill vs reference, {dtype}: worst {worst:.1e}");
    }

    #[test]
    fn mixer_prefill_equals_the_reference_in_f64() {
        check_random_configs::<f64>(DType::F64, 1e-12);
    }

    #[test]
    fn mixer_prefill_equals_the_reference_in_f32() {
        check_random_configs::<f32>(DType::F32, 5e-6);
    }

    /// The LM on the chunked prefill against the goldens: one pass, windows split anywhere,
    /// the states after the prefix, and prefix prefill + reference steps for the rest.
    fn check_goldens<F: Real>(dtype: DType, tol: f64) {
        for name in MIMO_FIXTURES {
            let g = Golden::load(name);
            let gold = g.tensor("logits");
            let t = g.input_ids.len();
            for file in ["model.safetensors", "pytorch_model.bin"] {
                let w = MimoWeights::load(&fixture(name).join(file), dtype).unwrap();
                let chunk = w.dims.chunk_len;
                let r = MimoReference::<F>::new(&w);
                for c in [chunk, 5] {
                    let mut st = r.new_state();
                    let full = mimo_prefill(&w, &g.input_ids, &mut st, c).unwrap();
                    let e = rel_l2(&full, &gold);
                    eprintln!("{name} {file} {dtype} chunk {c}: prefill logits {e:.2e}");
                    assert!(e <= tol, "{name} {file} {dtype} chunk {c}: {e:e}");
                    for ends in [
                        vec![chunk, 2 * chunk, t],
                        vec![1, chunk + 1, chunk + 2, t - 1, t],
                        vec![3, 4, 5, chunk - 1, 2 * chunk + 5, t],
                    ] {
                        let mut st = r.new_state();
                        let mut got = Vec::new();
                        let mut s = 0;
                        for &e in &ends {
                            got.extend(mimo_prefill(&w, &g.input_ids[s..e], &mut st, c).unwrap());
                            s = e;
                        }
                        let e = rel_l2(&got, &gold);
                        assert!(e <= tol, "{name} {file} chunk {c} windows {ends:?}: {e:e}");
                    }
                    let mut st = r.new_state();
                    let mut got = mimo_prefill(&w, &g.input_ids[..g.prefix], &mut st, c).unwrap();
                    for l in 0..w.dims.n_layer {
                        let ls = MimoLayerState::copy_of(&st, l, &w.dims);
                        for (f, v) in [("ssm", &ls.ssm), ("k", &ls.k), ("v", &ls.v)] {
                            let e = rel_l2(v, &g.tensor(&format!("state.{l}.{f}")));
                            assert!(e <= tol, "{name} {file} chunk {c}: state.{l}.{f} {e:e}");
                        }
                        let mut gold_st = ls.clone();
                        let ga = g.tensor(&format!("state.{l}.angle"));
                        gold_st.angle = ga.iter().map(|&v| F::from_f(v)).collect();
                        let trig = |a: &[F]| -> Vec<f64> {
                            a.iter()
                                .flat_map(|p| {
                                    [p.to_f64().unwrap().cos(), p.to_f64().unwrap().sin()]
                                })
                                .collect()
                        };
                        let e = rel_l2(&trig(&ls.angle), &trig(&gold_st.angle));
                        assert!(e <= tol, "{name} {file} chunk {c}: state.{l}.angle {e:e}");
                    }
                    for &tok in &g.input_ids[g.prefix..] {
                        got.extend(r.step(tok, &mut st).unwrap());
                    }
                    let e = rel_l2(&got, &gold);
                    assert!(e <= tol, "{name} {file} chunk {c}: prefix + steps {e:e}");
                }
            }
        }
    }

    #[test]
    fn lm_prefill_matches_goldens_in_f64() {
        check_goldens::<f64>(DType::F64, 1e-7);
    }

    #[test]
    fn lm_prefill_matches_goldens_in_f32() {
        check_goldens::<f32>(DType::F32, 1e-5);
    }

    /// bf16 matrices (vectors stay f32), f32 arithmetic: the fixtures ask ≤ 1e-2.
    #[test]
    fn lm_prefill_with_bf16_weights_meets_the_bf16_tolerance() {
        for name in MIMO_FIXTURES {
            let g = Golden::load(name);
            let w = MimoWeights::load(&fixture(name), DType::BF16).unwrap();
            let mut st = crate::mixers::mimo::mimo_zero_state::<f32>(&w.dims);
            let got = mimo_prefill(&w, &g.input_ids, &mut st, w.dims.chunk_len).unwrap();
            let e = rel_l2(&got, &g.tensor("logits"));
            eprintln!("{name} bf16 weights: prefill logits {e:.2e}");
            assert!(e <= 1e-2, "{name} bf16: {e:e}");
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        let w = MimoWeights::load(&fixture(MIMO_FIXTURES[0]), DType::F32).unwrap();
        let mut st = crate::mixers::mimo::mimo_zero_state::<f32>(&w.dims);
        assert!(mimo_prefill(&w, &[1, 999], &mut st, 16).is_err());
        assert!(mimo_prefill(&w, &[1, 2], &mut st, 0).is_err());
        assert!(mimo_prefill(&w, &[], &mut st, 16).unwrap().is_empty());
        st.data.pop();
        assert!(mimo_prefill(&w, &[1], &mut st, 16).is_err());
        let ctx = MimoMixerCtx::new(&w, 0);
        let mut ls = MimoLayerState::<f32>::zeros(&w.dims);
        let (proj, mut out) = (
            vec![0.0; 2 * w.dims.d_in_proj],
            vec![0.0; 2 * w.dims.d_inner],
        );
        assert!(mimo_mixer_prefill(&ctx, &proj, 3, 16, &mut ls.view(), &mut out).is_err());
        assert!(mimo_mixer_prefill(&ctx, &proj, 2, 0, &mut ls.view(), &mut out).is_err());
        assert!(mimo_mixer_prefill(&ctx, &proj, 2, 16, &mut ls.view(), &mut out[1..]).is_err());
        assert_eq!(ls, MimoLayerState::zeros(&w.dims));
        mimo_mixer_prefill(&ctx, &proj, 2, 16, &mut ls.view(), &mut out).unwrap();
    }
}
