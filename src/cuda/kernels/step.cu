// The fused decode step of one mixer layer (spec §3.3): split, activations, B/C norms,
// angle update, rotation, state update, output, D skip and gate in one launch, one block
// per (head, sequence). CPU twin: `mixer_step` in src/cpu/step.rs:
//
//   φ ← wrap(φ + θ·Δ);  k̃, q̃ = rotate(B̄ + B_bias), rotate(C̄ + C_bias)
//   h ← α·h + β·outer(v_prev, k_prev) + γ·outer(x, k̃),   y = h·q̃ + D·x
//   α = e^{AΔ},  β = α·Δ·(1 − λ),  γ = λ·Δ;   then k_prev ← k̃, v_prev ← x

#define STEP_THREADS 256
#define STEP_WARPS (STEP_THREADS / 32)
// State rows per warp and float4s per lane per row; when they fit in registers the state
// is loaded before waiting for the previous kernel (it does not write the state).
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
    __shared__ float s_k[DSTATE], s_q[DSTATE], s_kp[DSTATE];
    __shared__ float s_x[HEADDIM], s_vp[HEADDIM], s_y[HEADDIM];
    __shared__ float s_cs[2 * NANGLES];
    __shared__ float s_scal[4];  // B̄ scale, C̄ scale
#if OUTNORM
    __shared__ float red[32];
#endif
    const int h = blockIdx.x, b = blockIdx.y, g = h / HEADS_PER_GROUP, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    float* st = states[b] + (size_t)layer * ST_LAYER;
    float* hs = st + ST_SSM + (size_t)h * HEADDIM * DSTATE;
    // This head's state rows p = warp + r·STEP_WARPS, float4 n4 = lane + 32·q.
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
    griddep_wait();
    griddep_launch();
    const float* row = proj + (size_t)b * PROJ_LD;

    const float dt = softplus_f(row[DT_OFF + h] + dt_bias[h]);
    const float a = a_value_f(row[A_OFF + h]) * dt;
    const float lam = sigmoid_f(row[TRAP_OFF + h]);
    const float alpha = expf(a), beta = alpha * dt * (1.f - lam), gamma = lam * dt;

    if (warp < 2) {  // RMS of B (warp 0) and C (warp 1) of this head's group
        const float* src = row + (warp ? C_OFF : B_OFF) + g * DSTATE;
        float ss = 0.f;
        for (int n = lane; n < DSTATE; n += 32) ss += src[n] * src[n];
        ss = warp_sum(ss);
        if (lane == 0) s_scal[warp] = 1.f / sqrtf(ss / (float)DSTATE + NORM_EPS);
    }
    for (int i = tid; i < NANGLES; i += STEP_THREADS) {
        float* phi = st + ST_ANGLE + h * NANGLES + i;
        const float ph = wrap_angle_f(*phi + PI_F * tanhf(row[ANG_OFF + i]) * dt);
        *phi = ph;
        sincosf(ph, &s_cs[NANGLES + i], &s_cs[i]);
    }
    for (int n = tid; n < DSTATE; n += STEP_THREADS) s_kp[n] = st[ST_K + h * DSTATE + n];
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) {
        s_vp[pp] = st[ST_V + h * HEADDIM + pp];
        s_x[pp] = row[X_OFF + h * HEADDIM + pp];
    }
    __syncthreads();
    for (int i = tid; i < DSTATE / 2; i += STEP_THREADS) {
        const int n = 2 * i;
        const float* bs = row + B_OFF + g * DSTATE;
        const float* cs = row + C_OFF + g * DSTATE;
        float k0 = bs[n] * s_scal[0] * b_norm[n] + b_bias[h * DSTATE + n];
        float k1 = bs[n + 1] * s_scal[0] * b_norm[n + 1] + b_bias[h * DSTATE + n + 1];
        float q0 = cs[n] * s_scal[1] * c_norm[n] + c_bias[h * DSTATE + n];
        float q1 = cs[n + 1] * s_scal[1] * c_norm[n + 1] + c_bias[h * DSTATE + n + 1];
        if (i < NANGLES) {
            const float c = s_cs[i], s = s_cs[NANGLES + i];
            float u = k0, v = k1;
            k0 = u * c - v * s;
            k1 = u * s + v * c;
            u = q0, v = q1;
            q0 = u * c - v * s;
            q1 = u * s + v * c;
        }
        s_k[n] = k0;
        s_k[n + 1] = k1;
        s_q[n] = q0;
        s_q[n + 1] = q1;
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
        if (lane == 0) s_y[pp] = acc + d_skip[h] * s_x[pp];
    }
    __syncthreads();
    for (int n = tid; n < DSTATE; n += STEP_THREADS) st[ST_K + h * DSTATE + n] = s_k[n];
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) st[ST_V + h * HEADDIM + pp] = s_x[pp];
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
        v *= silu_f(row[Z_OFF + h * HEADDIM + pp]);
        const size_t o = (size_t)b * D_INNER + h * HEADDIM + pp;
        if (y_f32) y_f32[o] = v;
        else y_act[o] = from_f<act_t>(v);
    }
}
