// The fused decode step of one mixer layer (spec §3.3): split, activations, B/C norms,
// angle update, rotation, state update, output, D skip and gate in one launch, one block
// per (head, sequence). CPU twin: `mixer_step` in src/cpu/step.rs:
//
//   φ ← wrap(φ + θ·Δ);  k̃, q̃ = rotate(B̄ + B_bias), rotate(C̄ + C_bias)
//   h ← α·h + β·outer(v_prev, k_prev) + γ·outer(x, k̃),   y = h·q̃ + D·x
//   α = e^{AΔ},  β = α·Δ·(1 − λ),  γ = λ·Δ;   then k_prev ← k̃, v_prev ← x
//
// Latency is what counts here (a few microseconds per layer): everything that does not
// depend on the previous kernel — this head's state rows, its k_prev, v_prev and φ, the
// norm weights and biases — is loaded before waiting for it, and everything that does (one
// in_proj row) is loaded in one go right after, so the block waits for memory twice.

#define STEP_THREADS 256
#define STEP_WARPS (STEP_THREADS / 32)
// State rows per warp and float4s per lane per row; when they fit in registers the state
// is loaded before the wait (if not, inside the update).
#define STEP_RPW ((HEADDIM + STEP_WARPS - 1) / STEP_WARPS)
#define STEP_NPL ((DSTATE / 4 + 31) / 32)
#define STEP_PREFETCH (STEP_RPW * STEP_NPL <= 16)

extern "C" __global__ void __launch_bounds__(STEP_THREADS)
    mixer_step(const float* __restrict__ proj, const float* __restrict__ b_norm,
               const float* __restrict__ c_norm, const float* __restrict__ dt_bias,
               const float* __restrict__ b_bias, const float* __restrict__ c_bias,
               const float* __restrict__ d_skip, const float* __restrict__ out_norm,
               float* const* __restrict__ states, int layer, float* __restrict__ y_f32,
               act_t* __restrict__ y_act) {
    // raw B, C of this head's group, then k̃, q̃; the previous key
    __shared__ float s_b[DSTATE], s_c[DSTATE], s_k[DSTATE], s_q[DSTATE], s_kp[DSTATE];
    __shared__ float s_x[HEADDIM], s_z[HEADDIM], s_vp[HEADDIM], s_y[HEADDIM];
    __shared__ float s_ang[NANGLES], s_phi[NANGLES], s_cs[2 * NANGLES];
    __shared__ float s_raw[3];   // dd_dt, dd_A, trap
    __shared__ float s_scal[2];  // 1/rms of B, of C
#if OUTNORM
    __shared__ float red[32];
#endif
    const int h = blockIdx.x, b = blockIdx.y, g = h / HEADS_PER_GROUP, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    float* st = states[b] + (size_t)layer * ST_LAYER;
    float* hs = st + ST_SSM + (size_t)h * HEADDIM * DSTATE;

    // ---- before the wait: the state and this head's constants
    float4 hreg[STEP_PREFETCH ? STEP_RPW * STEP_NPL : 1];
    if (STEP_PREFETCH) {
#pragma unroll
        for (int r = 0; r < STEP_RPW; ++r)
#pragma unroll
            for (int q = 0; q < STEP_NPL; ++q) {
                const int pp = warp + r * STEP_WARPS, n4 = lane + 32 * q;
                if (pp < HEADDIM && n4 < DSTATE / 4)
                    hreg[r * STEP_NPL + q] = reinterpret_cast<const float4*>(hs + pp * DSTATE)[n4];
            }
    }
    float bw = 0.f, cw = 0.f, bb = 0.f, cb = 0.f;
    for (int n = tid; n < DSTATE; n += STEP_THREADS) {
        s_kp[n] = st[ST_K + h * DSTATE + n];
        if (n == tid) {  // one n per thread when DSTATE ≤ STEP_THREADS
            bw = b_norm[n];
            cw = c_norm[n];
            bb = b_bias[h * DSTATE + n];
            cb = c_bias[h * DSTATE + n];
        }
    }
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) s_vp[pp] = st[ST_V + h * HEADDIM + pp];
    for (int i = tid; i < NANGLES; i += STEP_THREADS) s_phi[i] = st[ST_ANGLE + h * NANGLES + i];
    const float dtb = dt_bias[h], dsk = d_skip[h];

    griddep_wait();
    griddep_launch();
    // ---- this sequence's in_proj row, in one go
    const float* row = proj + (size_t)b * PROJ_LD;
    for (int n = tid; n < DSTATE; n += STEP_THREADS) {
        s_b[n] = row[B_OFF + g * DSTATE + n];
        s_c[n] = row[C_OFF + g * DSTATE + n];
    }
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) {
        s_x[pp] = row[X_OFF + h * HEADDIM + pp];
        s_z[pp] = row[Z_OFF + h * HEADDIM + pp];
    }
    for (int i = tid; i < NANGLES; i += STEP_THREADS) s_ang[i] = row[ANG_OFF + i];
    if (tid < 3) s_raw[tid] = row[(tid == 0 ? DT_OFF : tid == 1 ? A_OFF : TRAP_OFF) + h];
    __syncthreads();

    const float dt = softplus_f(s_raw[0] + dtb);
    const float a = a_value_f(s_raw[1]) * dt;
    const float lam = sigmoid_f(s_raw[2]);
    const float alpha = expf(a), beta = alpha * dt * (1.f - lam), gamma = lam * dt;
    if (warp < 2) {  // RMS of B (warp 0) and C (warp 1)
        const float* src = warp ? s_c : s_b;
        float ss = 0.f;
        for (int n = lane; n < DSTATE; n += 32) ss += src[n] * src[n];
        ss = warp_sum(ss);
        if (lane == 0) s_scal[warp] = 1.f / sqrtf(ss / (float)DSTATE + NORM_EPS);
    }
    for (int i = tid; i < NANGLES; i += STEP_THREADS) {
        const float ph = wrap_angle_f(s_phi[i] + PI_F * tanhf(s_ang[i]) * dt);
        st[ST_ANGLE + h * NANGLES + i] = ph;
        sincos_phase(ph, &s_cs[NANGLES + i], &s_cs[i]);
    }
    __syncthreads();
    // k̃, q̃: normed, biased, rotated pairwise (thread n holds the constants of n).
    for (int n = tid; n < DSTATE; n += STEP_THREADS) {
        const float bwn = n == tid ? bw : b_norm[n], cwn = n == tid ? cw : c_norm[n];
        const float bbn = n == tid ? bb : b_bias[h * DSTATE + n], cbn = n == tid ? cb : c_bias[h * DSTATE + n];
        s_k[n] = s_b[n] * s_scal[0] * bwn + bbn;
        s_q[n] = s_c[n] * s_scal[1] * cwn + cbn;
    }
    __syncthreads();
    for (int i = tid; i < NANGLES; i += STEP_THREADS) {
        const int n = 2 * i;
        const float c = s_cs[i], s = s_cs[NANGLES + i];
        float u = s_k[n], v = s_k[n + 1];
        s_k[n] = u * c - v * s;
        s_k[n + 1] = u * s + v * c;
        u = s_q[n], v = s_q[n + 1];
        s_q[n] = u * c - v * s;
        s_q[n + 1] = u * s + v * c;
    }
    __syncthreads();
    // State rows: one warp per row p, float4 across n.
#pragma unroll
    for (int r = 0; r < STEP_RPW; ++r) {
        const int pp = warp + r * STEP_WARPS;
        if (pp >= HEADDIM) break;
        float4* hr = reinterpret_cast<float4*>(hs + pp * DSTATE);
        const float bv = beta * s_vp[pp], gx = gamma * s_x[pp];
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < STEP_NPL; ++q) {
            const int n4 = lane + 32 * q;
            if (n4 >= DSTATE / 4) break;
            float4 v = STEP_PREFETCH ? hreg[r * STEP_NPL + q] : hr[n4];
            const int n = 4 * n4;
            v.x = alpha * v.x + bv * s_kp[n] + gx * s_k[n];
            v.y = alpha * v.y + bv * s_kp[n + 1] + gx * s_k[n + 1];
            v.z = alpha * v.z + bv * s_kp[n + 2] + gx * s_k[n + 2];
            v.w = alpha * v.w + bv * s_kp[n + 3] + gx * s_k[n + 3];
            hr[n4] = v;
            acc += v.x * s_q[n] + v.y * s_q[n + 1] + v.z * s_q[n + 2] + v.w * s_q[n + 3];
        }
        acc = warp_sum(acc);
        if (lane == 0) s_y[pp] = acc + dsk * s_x[pp];
    }
    for (int n = tid; n < DSTATE; n += STEP_THREADS) st[ST_K + h * DSTATE + n] = s_k[n];
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) st[ST_V + h * HEADDIM + pp] = s_x[pp];
    __syncthreads();
#if OUTNORM
    float ss = 0.f;
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) ss += s_y[pp] * s_y[pp];
    const float inv = 1.f / sqrtf(block_sum(ss, red) / (float)HEADDIM + NORM_EPS);
#endif
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) {
        float v = s_y[pp];
#if OUTNORM
        v = v * inv * out_norm[h * HEADDIM + pp];
#endif
        v *= silu_f(s_z[pp]);
        const size_t o = (size_t)b * D_INNER + h * HEADDIM + pp;
        if (y_f32) y_f32[o] = v;
        else y_act[o] = from_f<act_t>(v);
    }
}
