//! Chunked prefill of one mixer layer (spec §4), for a packed batch of sequences: per
//! (sequence, head), the chunks of [`super::chunk`] (whose module doc has the weights), each
//! gated as it is done. A window that continues a state starts from the folded state
//! `S_enter = h⁻ + Δ_0(1 − λ_0)·outer(v⁻, k⁻)` (spec §3.4): the look-back term of the
//! window's first token reaches across the seam.

pub use super::chunk::Span;
use super::chunk::{HeadInputs, HeadScan};
use super::state::LayerState;
use super::token::{MixerCtx, TokenPre};
use crate::cpu::real::Real;
use rayon::prelude::*;

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

/// The prefill's per-token inputs of head `h`.
struct PrefillInputs<'c, 'w, F> {
    ctx: &'c MixerCtx<'w>,
    pre: &'c TokenPre<F>,
    h: usize,
}

impl<F: Real> HeadInputs<F> for PrefillInputs<'_, '_, F> {
    #[inline(always)]
    fn delta(&self, r: usize) -> F {
        self.pre.delta[r * self.ctx.d.nheads + self.h]
    }
    #[inline(always)]
    fn lambda(&self, r: usize) -> F {
        self.pre.lambda[r * self.ctx.d.nheads + self.h]
    }
    #[inline(always)]
    fn decay(&self, r: usize) -> F {
        self.pre.a[r * self.ctx.d.nheads + self.h]
    }
    #[inline(always)]
    fn theta(&self, r: usize) -> &[F] {
        let s_n = self.ctx.d.num_rope_angles;
        &self.pre.theta[r * s_n..(r + 1) * s_n]
    }
    #[inline(always)]
    fn kq(&self, r: usize, k: &mut [F], q: &mut [F]) {
        let bc_w = 2 * self.ctx.d.ngroups * self.ctx.d.d_state;
        self.ctx
            .biased_kq(&self.pre.bc[r * bc_w..(r + 1) * bc_w], self.h, k, q);
    }
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
    let angle = st.angle[h * s_n..(h + 1) * s_n].to_vec();
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

    let inputs = PrefillInputs { ctx, pre, h };
    let d_skip = F::from_f(ctx.lw.d[h] as f64);
    let mut scan = HeadScan::new(d, inputs, proj, sp, h, d_skip, angle, ssm);
    let mut y = vec![F::zero(); sp.len * p_n];
    let mut last_k = k_prev.to_vec();
    let mut last_v = v_prev.to_vec();
    let mut c0 = 0;
    while c0 < sp.len {
        let l = l_max.min(sp.len - c0);
        let yc = &mut y[c0 * p_n..(c0 + l) * p_n];
        scan.chunk(c0, l, yc, None);
        // Gate each token with its z.
        for j in 0..l {
            let t = sp.start + c0 + j;
            let z = &proj[t * dpi + d.z_off() + h * p_n..][..p_n];
            ctx.gate(&mut yc[j * p_n..(j + 1) * p_n], z, h);
        }
        if c0 + l == sp.len {
            let t = sp.start + c0 + l - 1;
            last_k.copy_from_slice(scan.key(l - 1));
            last_v.copy_from_slice(&proj[t * dpi + d.x_off() + h * p_n..][..p_n]);
        }
        c0 += l;
    }
    HeadOut {
        y,
        angle: scan.angle,
        ssm: scan.state,
        k: last_k,
        v: last_v,
    }
}
