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
// norm weights and biases — is loaded before waiting for it (`mixer_ahead`), and
// everything that does (one in_proj row) in one go right after (`mixer_run`), so the block
// waits for memory twice. The fused decode (kernels/decode_layers.cu) runs the same two.

#define STEP_THREADS 256
#define STEP_WARPS (STEP_THREADS / 32)
// State rows per warp and float4s per lane per row; when they fit in registers the state
// is loaded before the wait (if not, inside the update).
#define STEP_RPW ((HEADDIM + STEP_WARPS - 1) / STEP_WARPS)
#define STEP_NPL ((DSTATE / 4 + 31) / 32)
#define STEP_PREFETCH (STEP_RPW * STEP_NPL <= 16)

// This layer's per-head constants of the mixer (device addresses).
struct MixerW {
    const float *b_norm, *c_norm, *dt_bias, *b_bias, *c_bias, *d_skip, *out_norm;
};

// The block's working set for one (head, sequence): raw B, C of the head's group, then
// k̃, q̃; the previous key; x, z, the previous value, y; angles.
struct StepSmem {
    float b[DSTATE], c[DSTATE], k[DSTATE], q[DSTATE], kp[DSTATE];
    float x[HEADDIM], z[HEADDIM], vp[HEADDIM], y[HEADDIM];
    float ang[NANGLES], phi[NANGLES], cs[2 * NANGLES];
    float raw[3];   // dd_dt, dd_A, trap
    float scal[2];  // 1/rms of B, of C
    float red[32];
};

// Elements per thread of a vector of n (thread tid takes tid + STEP_THREADS·j).
#define STEP_PER(n) (((n) + STEP_THREADS - 1) / STEP_THREADS)

// What is loaded before the wait, in registers (so that nothing waits for it before the
// wait): the state rows; the thread's k_prev, v_prev and φ elements; its norm weights and
// biases; the head's Δ bias and D.
struct StepAhead {
    float4 h[STEP_PREFETCH ? STEP_RPW * STEP_NPL : 1];
    float kp[STEP_PER(DSTATE)], vp[STEP_PER(HEADDIM)], phi[STEP_PER(NANGLES)];
    float bw, cw, bb, cb, dtb, dsk;
};

// The part of the step that does not depend on the in_proj row: this head's state rows,
// k_prev, v_prev and φ, its constants.
__device__ __forceinline__ void mixer_ahead(StepAhead& ah, const MixerW& w,
                                            float* const* __restrict__ states, int layer, int h, int b) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* st = states[b] + (size_t)layer * ST_LAYER;
    const float* hs = st + ST_SSM + (size_t)h * HEADDIM * DSTATE;
    if (STEP_PREFETCH) {
#pragma unroll
        for (int r = 0; r < STEP_RPW; ++r)
#pragma unroll
            for (int q = 0; q < STEP_NPL; ++q) {
                const int pp = warp + r * STEP_WARPS, n4 = lane + 32 * q;
                if (pp < HEADDIM && n4 < DSTATE / 4)
                    ah.h[r * STEP_NPL + q] = reinterpret_cast<const float4*>(hs + pp * DSTATE)[n4];
            }
    }
    ah.bw = ah.cw = ah.bb = ah.cb = 0.f;
    if (tid < DSTATE) {  // one n per thread when DSTATE ≤ STEP_THREADS
        ah.bw = w.b_norm[tid];
        ah.cw = w.c_norm[tid];
        ah.bb = w.b_bias[h * DSTATE + tid];
        ah.cb = w.c_bias[h * DSTATE + tid];
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        ah.kp[j] = n < DSTATE ? st[ST_K + h * DSTATE + n] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(HEADDIM); ++j) {
        const int pp = tid + STEP_THREADS * j;
        ah.vp[j] = pp < HEADDIM ? st[ST_V + h * HEADDIM + pp] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(NANGLES); ++j) {
        const int i = tid + STEP_THREADS * j;
        ah.phi[j] = i < NANGLES ? st[ST_ANGLE + h * NANGLES + i] : 0.f;
    }
    ah.dtb = w.dt_bias[h];
    ah.dsk = w.d_skip[h];
}

struct NoMark {
    __device__ void operator()(int) const {}
};

// The rest of the step of head h, sequence b, once its in_proj row is in `proj` (read
// through L2: in the fused decode other blocks of the same launch wrote it). `mark(k)` is
// called between stages (the fused decode's trace).
template <class Mark = NoMark>
__device__ __forceinline__ void mixer_run(StepSmem& sm, const StepAhead& ah, const MixerW& w,
                                          const float* proj, float* const* __restrict__ states, int layer,
                                          int h, int b, float* y_f32, act_t* y_act, Mark mark = {}) {
    const int g = h / HEADS_PER_GROUP, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* st = states[b] + (size_t)layer * ST_LAYER;
    float* hs = st + ST_SSM + (size_t)h * HEADDIM * DSTATE;
    // ---- this sequence's in_proj row: every load first, then the stores
    const float* row = proj + (size_t)b * PROJ_LD;
    float rb[STEP_PER(DSTATE)], rc[STEP_PER(DSTATE)], rx[STEP_PER(HEADDIM)], rz[STEP_PER(HEADDIM)];
    float ra[STEP_PER(NANGLES)];
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        rb[j] = n < DSTATE ? __ldcg(row + B_OFF + g * DSTATE + n) : 0.f;
        rc[j] = n < DSTATE ? __ldcg(row + C_OFF + g * DSTATE + n) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(HEADDIM); ++j) {
        const int pp = tid + STEP_THREADS * j;
        rx[j] = pp < HEADDIM ? __ldcg(row + X_OFF + h * HEADDIM + pp) : 0.f;
        rz[j] = pp < HEADDIM ? __ldcg(row + Z_OFF + h * HEADDIM + pp) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(NANGLES); ++j) {
        const int i = tid + STEP_THREADS * j;
        ra[j] = i < NANGLES ? __ldcg(row + ANG_OFF + i) : 0.f;
    }
    const float raw = tid < 3 ? __ldcg(row + (tid == 0 ? DT_OFF : tid == 1 ? A_OFF : TRAP_OFF) + h) : 0.f;
    __syncthreads();  // the previous user of `sm` is done
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        if (n < DSTATE) {
            sm.b[n] = rb[j];
            sm.c[n] = rc[j];
            sm.kp[n] = ah.kp[j];
        }
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(HEADDIM); ++j) {
        const int pp = tid + STEP_THREADS * j;
        if (pp < HEADDIM) {
            sm.x[pp] = rx[j];
            sm.z[pp] = rz[j];
            sm.vp[pp] = ah.vp[j];
        }
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(NANGLES); ++j) {
        const int i = tid + STEP_THREADS * j;
        if (i < NANGLES) {
            sm.ang[i] = ra[j];
            sm.phi[i] = ah.phi[j];
        }
    }
    if (tid < 3) sm.raw[tid] = raw;
    __syncthreads();
    mark(3);

    const float dt = softplus_f(sm.raw[0] + ah.dtb);
    const float a = a_value_f(sm.raw[1]) * dt;
    const float lam = sigmoid_f(sm.raw[2]);
    const float alpha = expf(a), beta = alpha * dt * (1.f - lam), gamma = lam * dt;
    if (warp < 2) {  // RMS of B (warp 0) and C (warp 1)
        const float* src = warp ? sm.c : sm.b;
        float ss = 0.f;
        for (int n = lane; n < DSTATE; n += 32) ss += src[n] * src[n];
        ss = warp_sum(ss);
        if (lane == 0) sm.scal[warp] = 1.f / sqrtf(ss / (float)DSTATE + NORM_EPS);
    }
    for (int i = tid; i < NANGLES; i += STEP_THREADS) {
        const float ph = wrap_angle_f(sm.phi[i] + PI_F * tanhf(sm.ang[i]) * dt);
        st[ST_ANGLE + h * NANGLES + i] = ph;
        sincos_phase(ph, &sm.cs[NANGLES + i], &sm.cs[i]);
    }
    __syncthreads();
    // k̃, q̃: normed, biased, rotated pairwise (thread n holds the constants of n).
    for (int n = tid; n < DSTATE; n += STEP_THREADS) {
        const float bwn = n == tid ? ah.bw : w.b_norm[n], cwn = n == tid ? ah.cw : w.c_norm[n];
        const float bbn = n == tid ? ah.bb : w.b_bias[h * DSTATE + n];
        const float cbn = n == tid ? ah.cb : w.c_bias[h * DSTATE + n];
        sm.k[n] = sm.b[n] * sm.scal[0] * bwn + bbn;
        sm.q[n] = sm.c[n] * sm.scal[1] * cwn + cbn;
    }
    __syncthreads();
    for (int i = tid; i < NANGLES; i += STEP_THREADS) {
        const int n = 2 * i;
        const float c = sm.cs[i], s = sm.cs[NANGLES + i];
        float u = sm.k[n], v = sm.k[n + 1];
        sm.k[n] = u * c - v * s;
        sm.k[n + 1] = u * s + v * c;
        u = sm.q[n], v = sm.q[n + 1];
        sm.q[n] = u * c - v * s;
        sm.q[n + 1] = u * s + v * c;
    }
    __syncthreads();
    mark(4);
    // State rows: one warp per row p, float4 across n.
#pragma unroll
    for (int r = 0; r < STEP_RPW; ++r) {
        const int pp = warp + r * STEP_WARPS;
        if (pp >= HEADDIM) break;
        float4* hr = reinterpret_cast<float4*>(hs + pp * DSTATE);
        const float bv = beta * sm.vp[pp], gx = gamma * sm.x[pp];
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < STEP_NPL; ++q) {
            const int n4 = lane + 32 * q;
            if (n4 >= DSTATE / 4) break;
            float4 v = STEP_PREFETCH ? ah.h[r * STEP_NPL + q] : hr[n4];
            const int n = 4 * n4;
            v.x = alpha * v.x + bv * sm.kp[n] + gx * sm.k[n];
            v.y = alpha * v.y + bv * sm.kp[n + 1] + gx * sm.k[n + 1];
            v.z = alpha * v.z + bv * sm.kp[n + 2] + gx * sm.k[n + 2];
            v.w = alpha * v.w + bv * sm.kp[n + 3] + gx * sm.k[n + 3];
            hr[n4] = v;
            acc += v.x * sm.q[n] + v.y * sm.q[n + 1] + v.z * sm.q[n + 2] + v.w * sm.q[n + 3];
        }
        acc = warp_sum(acc);
        if (lane == 0) sm.y[pp] = acc + ah.dsk * sm.x[pp];
    }
    for (int n = tid; n < DSTATE; n += STEP_THREADS) st[ST_K + h * DSTATE + n] = sm.k[n];
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) st[ST_V + h * HEADDIM + pp] = sm.x[pp];
    __syncthreads();
#if OUTNORM
    float ss = 0.f;
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) ss += sm.y[pp] * sm.y[pp];
    const float inv = 1.f / sqrtf(block_sum(ss, sm.red) / (float)HEADDIM + NORM_EPS);
#endif
    for (int pp = tid; pp < HEADDIM; pp += STEP_THREADS) {
        float v = sm.y[pp];
#if OUTNORM
        v = v * inv * w.out_norm[h * HEADDIM + pp];
#endif
        v *= silu_f(sm.z[pp]);
        const size_t o = (size_t)b * D_INNER + h * HEADDIM + pp;
        if (y_f32) y_f32[o] = v;
        else y_act[o] = from_f<act_t>(v);
    }
}

// One block per (head, sequence).
extern "C" __global__ void __launch_bounds__(STEP_THREADS)
    mixer_step(const float* __restrict__ proj, const float* __restrict__ b_norm,
               const float* __restrict__ c_norm, const float* __restrict__ dt_bias,
               const float* __restrict__ b_bias, const float* __restrict__ c_bias,
               const float* __restrict__ d_skip, const float* __restrict__ out_norm,
               float* const* __restrict__ states, int layer, float* __restrict__ y_f32,
               act_t* __restrict__ y_act) {
    __shared__ StepSmem sm;
    const MixerW w = {b_norm, c_norm, dt_bias, b_bias, c_bias, d_skip, out_norm};
    StepAhead ah;
    mixer_ahead(ah, w, states, layer, blockIdx.x, blockIdx.y);
    griddep_wait();
    griddep_launch();
    mixer_run(sm, ah, w, proj, states, layer, blockIdx.x, blockIdx.y, y_f32, y_act);
}
