// The row-wise kernels of the training backward, and the optimiser. CPU twins in
// src/train: the loss and the norm backwards in model.rs (`loss_and_grad`,
// `norm_rows_bwd`) and ops.rs (`rms_bwd`, `silu_grad`), the gate and the per-token
// scatter in scan_backward.rs (`mixer_backward`), AdamW and the global norm in optim.rs.
//
// Parameter gradients that are sums over rows (norm weights, biases, dt_bias, D) are formed
// as per-row contributions and then summed by `col_sum_part` + `col_sum_final` in a fixed
// order, never with atomics: two runs give the same bits.

// ---- loss ---------------------------------------------------------------------------------
// Softmax cross-entropy of one row of logits over all VOCAB_PADDED entries (as the CPU
// trainer): loss_r = ln Σ e^{l − m} − (l_t − m); dlogits = (softmax − onehot(t)) / rows.
#define CE_THREADS 256
extern "C" __global__ void __launch_bounds__(CE_THREADS)
    cross_entropy_rows(const float* __restrict__ logits, const unsigned* __restrict__ targets,
                       act_t* __restrict__ dlogits, float* __restrict__ losses, float inv_rows) {
    __shared__ float red[32];
    const float* l = logits + (size_t)blockIdx.x * VOCAB_PADDED;
    act_t* dl = dlogits + (size_t)blockIdx.x * VOCAB_PADDED;
    // the row's maximum, over the block
    float m = __int_as_float(0xff800000);  // −∞
    for (int i = threadIdx.x; i < VOCAB_PADDED; i += CE_THREADS) m = fmaxf(m, l[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < CE_THREADS / 32; ++w) m = fmaxf(m, red[w]);
    float s = 0.f;
    for (int i = threadIdx.x; i < VOCAB_PADDED; i += CE_THREADS) s += expf(l[i] - m);
    s = block_sum(s, red);
    const unsigned t = targets[blockIdx.x];
    if (threadIdx.x == 0) losses[blockIdx.x] = logf(s) - (l[t] - m);
    const float inv_s = 1.f / s;
    for (int i = threadIdx.x; i < VOCAB_PADDED; i += CE_THREADS) {
        float p = expf(l[i] - m) * inv_s * inv_rows;
        if ((unsigned)i == t) p -= inv_rows;
        dl[i] = from_f<act_t>(p);
    }
}

// ---- RMSNorm backward over D_MODEL-wide rows (CPU twin: `norm_rows_bwd`) -----------------
// With x̂ = x·r, r = 1/sqrt(mean(x²) + eps), g = dout ⊙ w:
//   dx += r·(g − x̂·mean(g ⊙ x̂)),   dw_rows[row] = dout ⊙ x̂ (summed over rows later).
// One warp per row.
extern "C" __global__ void rms_norm_bwd_rows(const float* __restrict__ x, const float* __restrict__ w,
                                             const float* __restrict__ dout, float* __restrict__ dx,
                                             float* __restrict__ dw_rows, int rows, int accumulate) {
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * D_MODEL;
    const float* dr = dout + (size_t)r * D_MODEL;
    float ss = 0.f;
    for (int i = lane; i < D_MODEL; i += 32) ss += xr[i] * xr[i];
    const float rr = 1.f / sqrtf(warp_sum(ss) / (float)D_MODEL + NORM_EPS);
    float dot = 0.f;
    for (int i = lane; i < D_MODEL; i += 32) {
        const float xh = xr[i] * rr;
        dw_rows[(size_t)r * D_MODEL + i] = dr[i] * xh;
        dot += dr[i] * w[i] * xh;
    }
    const float mean = warp_sum(dot) / (float)D_MODEL;
    float* o = dx + (size_t)r * D_MODEL;
    for (int i = lane; i < D_MODEL; i += 32) {
        const float g = rr * (dr[i] * w[i] - xr[i] * rr * mean);
        o[i] = accumulate ? o[i] + g : g;
    }
}

// ---- the gate (spec §2.6) backward; CPU twin: the first loop of `mixer_backward` --------
// y = the scan output before the gate, z = in_proj's z columns, d_o = gradient of the gated
// output. Without the output norm: dy = d_o·silu(z), dz = d_o·y·silu'(z). With it, per
// head n = y·r·w (r = 1/rms of the head's y): dn = d_o·silu(z), dz = d_o·n·silu'(z), then
// the RMSNorm backward gives dy and the norm weight's per-row contribution dn ⊙ ŷ.
// One block per row; warp w takes heads w, w + 8, …
__device__ __forceinline__ float silu_grad_f(float u) {
    const float s = sigmoid_f(u);
    return s * (1.f + u * (1.f - s));
}
extern "C" __global__ void __launch_bounds__(256)
    gate_bwd_rows(const float* __restrict__ proj, const float* __restrict__ y_pre,
                  const float* __restrict__ out_norm, const float* __restrict__ d_o,
                  float* __restrict__ dy, float* __restrict__ dproj, float* __restrict__ dnorm_rows) {
    const size_t r = blockIdx.x;
    const float* z = proj + r * PROJ_LD + Z_OFF;
    const float* y = y_pre + r * D_INNER;
    const float* g = d_o + r * D_INNER;
    float* dyr = dy + r * D_INNER;
    float* dz = dproj + r * PROJ_LD + Z_OFF;
#if OUTNORM
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int h = warp; h < NHEADS; h += 8) {
        const int o = h * HEADDIM;
        float ss = 0.f;
        for (int p = lane; p < HEADDIM; p += 32) ss += y[o + p] * y[o + p];
        const float rr = 1.f / sqrtf(warp_sum(ss) / (float)HEADDIM + NORM_EPS);
        float dot = 0.f;
        for (int p = lane; p < HEADDIM; p += 32) {
            const int i = o + p;
            const float yh = y[i] * rr, sz = silu_f(z[i]);
            const float dn = g[i] * sz;
            dz[i] = g[i] * yh * out_norm[i] * silu_grad_f(z[i]);
            dnorm_rows[r * D_INNER + i] = dn * yh;
            dot += dn * out_norm[i] * yh;
        }
        const float mean = warp_sum(dot) / (float)HEADDIM;
        for (int p = lane; p < HEADDIM; p += 32) {
            const int i = o + p;
            const float dn = g[i] * silu_f(z[i]);
            dyr[i] = rr * (dn * out_norm[i] - y[i] * rr * mean);
        }
    }
#else
    for (int i = threadIdx.x; i < D_INNER; i += blockDim.x) {
        dyr[i] = g[i] * silu_f(z[i]);
        dz[i] = g[i] * y[i] * silu_grad_f(z[i]);
    }
#endif
}

#if MLP_HIDDEN > 0
// GatedMLP activation backward: act = v·silu(g) → dv = dact·silu(g), dg = dact·v·silu'(g).
extern "C" __global__ void swiglu_bwd_rows(const float* __restrict__ vg, const float* __restrict__ dact,
                                           act_t* __restrict__ dvg, int rows) {
    const size_t n = (size_t)rows * MLP_HIDDEN;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / MLP_HIDDEN, i = e % MLP_HIDDEN;
        const float* row = vg + r * 2 * MLP_HIDDEN;
        const float v = row[i], gt = row[MLP_HIDDEN + i], da = dact[e];
        dvg[r * 2 * MLP_HIDDEN + i] = from_f<act_t>(da * silu_f(gt));
        dvg[r * 2 * MLP_HIDDEN + MLP_HIDDEN + i] = from_f<act_t>(da * v * silu_grad_f(gt));
    }
}
#endif

// dst[r][c] = src[r][c] for c < cols, f32 → act_t (GEMM operands of 16-bit training).
extern "C" __global__ void cast_rows(const float* __restrict__ src, int lds, act_t* __restrict__ dst, int ldd,
                                     int rows, int cols) {
    const size_t n = (size_t)rows * cols;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / cols, c = e % cols;
        dst[r * ldd + c] = from_f<act_t>(src[r * lds + c]);
    }
}

// ---- embedding backward (CPU twin: the last loop of `loss_and_grad`) -----------------------
// dE[v] += Σ of the residual gradients of the rows whose token is v, in row order. The host
// lists, per distinct token, its rows (`rows_of`, grouped; `groups` = {token, first, count}).
// One block per distinct token.
extern "C" __global__ void embed_bwd(const int4* __restrict__ groups, const int* __restrict__ rows_of,
                                     const float* __restrict__ dres, float* __restrict__ demb) {
    const int4 gp = groups[blockIdx.x];
    float* o = demb + (size_t)gp.x * D_MODEL;
    for (int i = threadIdx.x; i < D_MODEL; i += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < gp.z; ++k) s += dres[(size_t)rows_of[gp.y + k] * D_MODEL + i];
        o[i] += s;
    }
}

// ---- deterministic column sums ------------------------------------------------------------
// dst[c] (+)= Σ_r src[r·ld + c]: part[p][c] sums rows [p·COLSUM_ROWS, (p+1)·COLSUM_ROWS),
// then the parts are added in order.
#define COLSUM_ROWS 64
extern "C" __global__ void col_sum_part(const float* __restrict__ src, int rows, int cols, int ld,
                                        float* __restrict__ part) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, p = blockIdx.y;
    if (c >= cols) return;
    const int r0 = p * COLSUM_ROWS, r1 = min(rows, r0 + COLSUM_ROWS);
    float s = 0.f;
#pragma unroll 8
    for (int r = r0; r < r1; ++r) s += src[(size_t)r * ld + c];
    part[(size_t)p * cols + c] = s;
}
extern "C" __global__ void col_sum_final(const float* __restrict__ part, int parts, int cols,
                                         float* __restrict__ dst, int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.f;
    for (int p = 0; p < parts; ++p) s += part[(size_t)p * cols + c];
    dst[c] = accumulate ? dst[c] + s : s;
}

// ---- phase gradient pass -------------------------------------------------------------------
// g_t = Σ_{t' ≥ t} dφ_{t'} over each sequence (the wrap has derivative 1), per (head,
// angle), in place. Grid (sequences, tiles of 128 (head, angle) pairs); sequences are
// `seq_len` rows each.
#define PHASE_BATCH 16
extern "C" __global__ void __launch_bounds__(128) phase_grad_pass(float* __restrict__ dphi, int seq_len) {
    const int e = blockIdx.y * 128 + threadIdx.x;
    if (e >= NHEADS * NANGLES) return;
    float* base = dphi + (size_t)blockIdx.x * seq_len * NHEADS * NANGLES + e;
    float g = 0.f;
    for (int t1 = seq_len; t1 > 0; t1 -= PHASE_BATCH) {
        float v[PHASE_BATCH];
#pragma unroll
        for (int i = 0; i < PHASE_BATCH; ++i) {
            const int t = t1 - 1 - i;
            v[i] = t >= 0 ? base[(size_t)t * NHEADS * NANGLES] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < PHASE_BATCH; ++i) {
            const int t = t1 - 1 - i;
            if (t < 0) break;
            g += v[i];
            base[(size_t)t * NHEADS * NANGLES] = g;
        }
    }
}

// ---- per-token scatter into the in_proj gradient (CPU twin: the scatter loop of
// `mixer_backward`) -----------------------------------------------------------------------
// Inputs per row: the scan backward's {dc, dγ, da} per head (`tokg`, and the previous
// token's dc), the phase gradients g (after `phase_grad_pass`), the unrotated dk, dq per
// head. Per head, with Δ = softplus(dd_dt + dt_bias), λ = σ(trap), A = a_value(dd_A):
//   dγ_t += dc_t;  dλ_t = dγ_t·Δ_t − dc_{t−1}·Δ_t;  dΔ_t = dγ_t·λ_t + dc_{t−1}(1 − λ_t)
//          + da_t·A_t + Σ_i g_{t,i}·θ_{t,i};  dA_t = da_t·Δ_t
//   d dd_dt = dΔ·softplus′,  d dd_A = −f′(dd_A)·dA (0 where the floor holds),
//   d trap = dλ·λ(1 − λ),  d ang_i = π(1 − tanh²)·Σ_h g_{t,h,i}·Δ_{t,h}
// and the B/C RMSNorm backward of Σ_{h∈g} dk (dq) into the B (C) columns, with the norm
// weights' per-row contributions in bc_rows [2][rows][G][N]. One block per row.
extern "C" __global__ void __launch_bounds__(256)
    mixer_pre_bwd(const float* __restrict__ proj, const float* __restrict__ dt_bias,
                  const float* __restrict__ b_norm, const float* __restrict__ c_norm,
                  const float* __restrict__ theta, const float4* __restrict__ tokg,
                  const float* __restrict__ gphi, const float* __restrict__ dk,
                  const float* __restrict__ dq, float* __restrict__ dproj,
                  float* __restrict__ bc_rows, int rows, int seq_len) {
    __shared__ float s_delta[NHEADS];
    const int r = blockIdx.x, t = r % seq_len, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* row = proj + (size_t)r * PROJ_LD;
    float* drow = dproj + (size_t)r * PROJ_LD;
    for (int h = tid; h < NHEADS; h += blockDim.x) {
        const float u = row[DT_OFF + h] + dt_bias[h];
        const float dt = softplus_f(u), lam = sigmoid_f(row[TRAP_OFF + h]);
        const float dda = row[A_OFF + h];
        const float aval = a_value_f(dda);
        const float4 tg = tokg[(size_t)r * NHEADS + h];
        const float dc_prev = t > 0 ? tokg[(size_t)(r - 1) * NHEADS + h].x : 0.f;
        const float dgam = tg.y + tg.x;
        float dlam = dgam * dt - dc_prev * dt;
        float ddt = dgam * lam + dc_prev * (1.f - lam) + tg.z * aval;
        const float* g = gphi + ((size_t)r * NHEADS + h) * NANGLES;
        const float* th = theta + (size_t)r * NANGLES;
        for (int i = 0; i < NANGLES; ++i) ddt += g[i] * th[i];
        const float daval = tg.z * dt;
        drow[DT_OFF + h] = ddt * (u > 20.f ? 1.f : sigmoid_f(u));
#if A_ACT == 0
        const float f = heavy_tail_f(dda);
        const float fp = dda >= 0.f ? 1.f : 1.f / ((1.f - dda) * (1.f - dda));
#else
        const float f = softplus_f(dda);
        const float fp = sigmoid_f(dda);
#endif
        drow[A_OFF + h] = -f < -A_FLOOR ? -fp * daval : 0.f;
        drow[TRAP_OFF + h] = dlam * lam * (1.f - lam);
        s_delta[h] = dt;
    }
    __syncthreads();
    for (int i = tid; i < NANGLES; i += blockDim.x) {
        float s = 0.f;
        for (int h = 0; h < NHEADS; ++h) s += gphi[((size_t)r * NHEADS + h) * NANGLES + i] * s_delta[h];
        const float th = tanhf(row[ANG_OFF + i]);
        drow[ANG_OFF + i] = s * PI_F * (1.f - th * th);
    }
    // B/C norms: warp w < 2G takes (B|C, group) = (w / G, w % G); lanes over n.
    for (int task = warp; task < 2 * NGROUPS; task += blockDim.x / 32) {
        const bool is_c = task >= NGROUPS;
        const int grp = task % NGROUPS;
        const float* raw = row + (is_c ? C_OFF : B_OFF) + grp * DSTATE;
        const float* wn = is_c ? c_norm : b_norm;
        const float* src = is_c ? dq : dk;
        float ss = 0.f;
        for (int n = lane; n < DSTATE; n += 32) ss += raw[n] * raw[n];
        const float rr = 1.f / sqrtf(warp_sum(ss) / (float)DSTATE + NORM_EPS);
        float dot = 0.f;
        float* contrib = bc_rows + ((size_t)(is_c ? rows : 0) + r) * NGROUPS * DSTATE + grp * DSTATE;
        for (int n = lane; n < DSTATE; n += 32) {
            float d = 0.f;
            for (int h = grp * HEADS_PER_GROUP; h < (grp + 1) * HEADS_PER_GROUP; ++h)
                d += src[((size_t)r * NHEADS + h) * DSTATE + n];
            const float xh = raw[n] * rr;
            contrib[n] = d * xh;
            dot += d * wn[n] * xh;
        }
        const float mean = warp_sum(dot) / (float)DSTATE;
        float* out = drow + (is_c ? C_OFF : B_OFF) + grp * DSTATE;
        for (int n = lane; n < DSTATE; n += 32) {
            float d = 0.f;
            for (int h = grp * HEADS_PER_GROUP; h < (grp + 1) * HEADS_PER_GROUP; ++h)
                d += src[((size_t)r * NHEADS + h) * DSTATE + n];
            out[n] = rr * (d * wn[n] - raw[n] * rr * mean);
        }
    }
}

// ---- optimiser -----------------------------------------------------------------------------
// Sum of squares of the flat gradient (times `scale`), in f64: part[b] over a fixed range
// per block, then `sumsq_final` adds the parts in order and writes the norm.
#define NORM_THREADS 256
#define NORM_PER_BLOCK (NORM_THREADS * 64)
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    sumsq_part(const float* __restrict__ g, long long n, float scale, double* __restrict__ part) {
    __shared__ double red[NORM_THREADS / 32];
    const long long b0 = (long long)blockIdx.x * NORM_PER_BLOCK;
    double s = 0.0;
    for (long long i = b0 + threadIdx.x; i < min(n, b0 + NORM_PER_BLOCK); i += NORM_THREADS) {
        const double v = (double)(g[i] * scale);
        s += v * v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < NORM_THREADS / 32; ++w) t += red[w];
        part[blockIdx.x] = t;
    }
}
extern "C" __global__ void sumsq_final(const double* __restrict__ part, int parts, double* __restrict__ norm) {
    if (threadIdx.x != 0) return;
    double t = 0.0;
    for (int p = 0; p < parts; ++p) t += part[p];
    *norm = sqrt(t);
}

// AdamW (torch.optim.AdamW; CPU twin `AdamW::update`), elementwise over the flat tensors;
// the first `n_decay` elements take weight decay. The gradient is first scaled by
// `grad_scale` (1/accumulation), then clipped to `max_norm` by the global norm in `norm`.
extern "C" __global__ void adamw(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                 float* __restrict__ v, long long n, long long n_decay,
                                 const double* __restrict__ norm, float grad_scale, float max_norm,
                                 float b1, float b2, float step_size, float bc2_sqrt, float eps,
                                 float decay) {
    const double nv = *norm;
    const bool clip = max_norm > 0.f && nv > (double)max_norm;
    const float cs = clip ? (float)((double)max_norm / (nv + 1e-6)) : 1.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float gi = g[i];
        if (grad_scale != 1.f) gi *= grad_scale;
        if (clip) gi *= cs;
        const float mi = b1 * m[i] + (1.f - b1) * gi;
        const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) / bc2_sqrt + eps;
        const float dec = i < n_decay ? decay : 1.f;
        p[i] = p[i] * dec - step_size * mi / denom;
    }
}
