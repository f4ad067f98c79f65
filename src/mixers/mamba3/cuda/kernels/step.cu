// The fused decode step of one mixer layer (spec §3.3): split, activations, B/C norms,
// angle update, rotation, state update, output, D skip and gate in one launch, one block
// per (head, sequence). CPU twin: `mixer_step` in src/mixers/mamba3/step.rs:
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

// The block's working set for one (head, sequence): k̃, q̃ and the previous key (read as
// float4s); x, z, the previous value, y; the warps' partial sums.
struct StepSmem {
    __align__(16) float k[DSTATE];
    __align__(16) float q[DSTATE];
    __align__(16) float kp[DSTATE];
    float x[HEADDIM], z[HEADDIM], vp[HEADDIM], y[HEADDIM];
    float red[32];
};

// Elements per thread of a vector of n (thread tid takes tid + STEP_THREADS·j).
#define STEP_PER(n) (((n) + STEP_THREADS - 1) / STEP_THREADS)

// What is loaded before the wait, in registers (so that nothing waits for it before the
// wait): the state rows; the thread's norm weights and biases; the head's Δ bias and D.
struct StepAhead {
    float4 h[STEP_PREFETCH ? STEP_RPW * STEP_NPL : 1];
    float bw, cw, bb, cb, dtb, dsk;
};
// The head's small states as this thread uses them: k_prev, v_prev, and φ of angle n/2 for
// its columns n < 2·NANGLES. Apart, because when the fused decode splits a head between
// blocks one of them writes these while the other may still be about to read them: the
// other loads them before its previous phase's arrival (kernels/decode_layers.cu).
struct StepHead {
    float kp[STEP_PER(DSTATE)], vp[STEP_PER(HEADDIM)], phi[STEP_PER(DSTATE)];
};

__device__ __forceinline__ void mixer_head(StepHead& hd, float* const* __restrict__ states, int layer, int h,
                                           int b) {
    const int tid = threadIdx.x;
    const LayerSt st = layer_st(states[b], layer);
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        hd.kp[j] = n < DSTATE ? st.k[h * DSTATE + n] : 0.f;
        hd.phi[j] = n < 2 * NANGLES ? st.angle[h * NANGLES + n / 2] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(HEADDIM); ++j) {
        const int pp = tid + STEP_THREADS * j;
        hd.vp[j] = pp < HEADDIM ? st.v[h * HEADDIM + pp] : 0.f;
    }
}

// The rest of what does not depend on the in_proj row: this head's state rows p0 … p1 − 1
// (all of them, unless the fused decode splits a head), its constants.
__device__ __forceinline__ void mixer_ahead(StepAhead& ah, const MixerW& w,
                                            float* const* __restrict__ states, int layer, int h, int b,
                                            int p0 = 0, int p1 = HEADDIM) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const state_t* hs = layer_st(states[b], layer).ssm + (size_t)h * HEADDIM * DSTATE;
    if (STEP_PREFETCH) {
#pragma unroll
        for (int r = 0; r < STEP_RPW; ++r)
#pragma unroll
            for (int q = 0; q < STEP_NPL; ++q) {
                const int pp = p0 + warp + r * STEP_WARPS, n4 = lane + 32 * q;
                if (pp < p1 && n4 < DSTATE / 4)
                    ah.h[r * STEP_NPL + q] = st_load4(hs + pp * DSTATE + 4 * n4);
            }
    }
    ah.bw = ah.cw = ah.bb = ah.cb = 0.f;
    if (tid < DSTATE) {  // one n per thread when DSTATE ≤ STEP_THREADS
        ah.bw = w.b_norm[tid];
        ah.cw = w.c_norm[tid];
        ah.bb = w.b_bias[h * DSTATE + tid];
        ah.cb = w.c_bias[h * DSTATE + tid];
    }
    ah.dtb = w.dt_bias[h];
    ah.dsk = w.d_skip[h];
}

// This head's state rows in the layer (the fused decode's L2 prefetch).
__device__ __forceinline__ const state_t* mixer_state_rows(const MixerW&, float* seq, int layer, int h) {
    return layer_st(seq, layer).ssm + (size_t)h * HEADDIM * DSTATE;
}

struct NoMark {
    __device__ void operator()(int) const {}
};

// The rest of the step of head h, sequence b, once its in_proj row is in `proj` (read
// through L2: in the fused decode other blocks of the same launch wrote it). `mark(k)` is
// called between stages (the fused decode's trace). With rows p0 … p1 − 1 of a split head
// (no output norm then: it spans the head), the block updates those rows and writes their
// outputs; the block of p0 = 0 also writes the head's angle, k and v states.
template <class Mark = NoMark>
__device__ __forceinline__ void mixer_run(StepSmem& sm, const StepAhead& ah, const StepHead& hd, const MixerW& w,
                                          const float* proj, float* const* __restrict__ states, int layer,
                                          int h, int b, float* y_f32, act_t* y_act, Mark mark = {},
                                          int p0 = 0, int p1 = HEADDIM) {
    const bool head_states = p0 == 0;
    const int g = h / HEADS_PER_GROUP, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const LayerSt st = layer_st(states[b], layer);
    state_t* hs = st.ssm + (size_t)h * HEADDIM * DSTATE;
    // ---- this sequence's in_proj row: every load first, then the stores. Thread n takes
    // column n of B̄, C̄, k̃ and q̃, and the angle n/2 of its rotary pair (both threads of a
    // pair compute it; the pair meets by a shuffle), so that only two block barriers stand
    // between the loads and the state update: one for the norms' partial sums, one for k̃, q̃.
    const float* row = proj + (size_t)b * PROJ_LD;
    float rb[STEP_PER(DSTATE)], rc[STEP_PER(DSTATE)], ra[STEP_PER(DSTATE)];
    float rx[STEP_PER(HEADDIM)], rz[STEP_PER(HEADDIM)];
    float raw_dt, raw_a, raw_trap;
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        rb[j] = n < DSTATE ? __ldcg(row + B_OFF + g * DSTATE + n) : 0.f;
        rc[j] = n < DSTATE ? __ldcg(row + C_OFF + g * DSTATE + n) : 0.f;
        ra[j] = n < 2 * NANGLES ? __ldcg(row + ANG_OFF + n / 2) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(HEADDIM); ++j) {
        const int pp = tid + STEP_THREADS * j;
        rx[j] = pp < HEADDIM ? __ldcg(row + X_OFF + h * HEADDIM + pp) : 0.f;
        rz[j] = pp < HEADDIM ? __ldcg(row + Z_OFF + h * HEADDIM + pp) : 0.f;
    }
    // every thread needs Δ, A and λ: the same three words for all, read by all
    raw_dt = __ldcg(row + DT_OFF + h);
    raw_a = __ldcg(row + A_OFF + h);
    raw_trap = __ldcg(row + TRAP_OFF + h);
    float ssb = 0.f, ssc = 0.f;
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        ssb += rb[j] * rb[j];
        ssc += rc[j] * rc[j];
    }
    ssb = warp_sum(ssb);
    ssc = warp_sum(ssc);
    __syncthreads();  // the previous user of `sm` is done
    if (lane == 0) {
        sm.red[warp] = ssb;
        sm.red[STEP_WARPS + warp] = ssc;
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        if (n < DSTATE) sm.kp[n] = hd.kp[j];
    }
#pragma unroll
    for (int j = 0; j < STEP_PER(HEADDIM); ++j) {
        const int pp = tid + STEP_THREADS * j;
        if (pp < HEADDIM) {
            sm.x[pp] = rx[j];
            sm.z[pp] = rz[j];
            sm.vp[pp] = hd.vp[j];
            if (head_states) st.v[h * HEADDIM + pp] = rx[j];  // v_prev of the next step
        }
    }
    const float dt = softplus_f(raw_dt + ah.dtb);
    const float a = a_value_f(raw_a) * dt;
    const float lam = sigmoid_f(raw_trap);
    const float alpha = expf(a), beta = alpha * dt * (1.f - lam), gamma = lam * dt;
    // φ ← wrap(φ + π·tanh(θ)·Δ) of the thread's angle, and its (cos, sin)
    float cs[STEP_PER(DSTATE)], sn[STEP_PER(DSTATE)];
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        cs[j] = 1.f;
        sn[j] = 0.f;
        if (n < 2 * NANGLES) {
            const float ph = wrap_angle_f(hd.phi[j] + PI_F * tanhf(ra[j]) * dt);
            if (n % 2 == 0 && head_states) st.angle[h * NANGLES + n / 2] = ph;
            sincos_phase(ph, &sn[j], &cs[j]);
        }
    }
    __syncthreads();
    mark(3);
    float tb = 0.f, tc = 0.f;
#pragma unroll
    for (int w = 0; w < STEP_WARPS; ++w) {
        tb += sm.red[w];
        tc += sm.red[STEP_WARPS + w];
    }
    const float scal_b = 1.f / sqrtf(tb / (float)DSTATE + NORM_EPS);
    const float scal_c = 1.f / sqrtf(tc / (float)DSTATE + NORM_EPS);
    // k̃, q̃: normed, biased, rotated pairwise (thread n holds the constants of n); the
    // final k state is this step's k̃.
#pragma unroll
    for (int j = 0; j < STEP_PER(DSTATE); ++j) {
        const int n = tid + STEP_THREADS * j;
        const bool own = n == tid && n < DSTATE;
        const int nc = n < DSTATE ? n : 0;
        const float bwn = own ? ah.bw : w.b_norm[nc], cwn = own ? ah.cw : w.c_norm[nc];
        const float bbn = own ? ah.bb : w.b_bias[h * DSTATE + nc];
        const float cbn = own ? ah.cb : w.c_bias[h * DSTATE + nc];
        const float k = rb[j] * scal_b * bwn + bbn, q = rc[j] * scal_c * cwn + cbn;
        const float kx = __shfl_xor_sync(0xffffffffu, k, 1), qx = __shfl_xor_sync(0xffffffffu, q, 1);
        float kr = k, qr = q;
        if (n < 2 * NANGLES) {  // the pair (u, v) = (k[n & ~1], k[n | 1]) turns by its angle
            const float c = cs[j], s_ = sn[j];
            if (n % 2 == 0) {
                kr = k * c - kx * s_;
                qr = q * c - qx * s_;
            } else {
                kr = kx * s_ + k * c;
                qr = qx * s_ + q * c;
            }
        }
        if (n < DSTATE) {
            sm.k[n] = kr;
            sm.q[n] = qr;
            if (head_states) st.k[h * DSTATE + n] = kr;
        }
    }
    __syncthreads();
    mark(4);
    // State rows: one warp per row p, float4 across n (the lane's k_prev, k̃, q̃ in registers:
    // the state stores could alias shared memory for all the compiler knows).
    float4 kp4[STEP_NPL], k4[STEP_NPL], q4[STEP_NPL];
#pragma unroll
    for (int q = 0; q < STEP_NPL; ++q) {
        const int n = 4 * (lane + 32 * q) < DSTATE ? 4 * (lane + 32 * q) : 0;
        kp4[q] = *reinterpret_cast<const float4*>(sm.kp + n);
        k4[q] = *reinterpret_cast<const float4*>(sm.k + n);
        q4[q] = *reinterpret_cast<const float4*>(sm.q + n);
    }
#pragma unroll
    for (int r = 0; r < STEP_RPW; ++r) {
        const int pp = p0 + warp + r * STEP_WARPS;
        if (pp >= p1) break;
        state_t* hr = hs + pp * DSTATE;
        const float bv = beta * sm.vp[pp], gx = gamma * sm.x[pp];
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < STEP_NPL; ++q) {
            const int n4 = lane + 32 * q;
            if (n4 >= DSTATE / 4) break;
            float4 v = STEP_PREFETCH ? ah.h[r * STEP_NPL + q] : st_load4(hr + 4 * n4);
            const float4 kp = kp4[q], k = k4[q], qq = q4[q];
            v.x = alpha * v.x + bv * kp.x + gx * k.x;
            v.y = alpha * v.y + bv * kp.y + gx * k.y;
            v.z = alpha * v.z + bv * kp.z + gx * k.z;
            v.w = alpha * v.w + bv * kp.w + gx * k.w;
            st_store4(hr + 4 * n4, v);
            acc += v.x * qq.x + v.y * qq.y + v.z * qq.z + v.w * qq.w;
        }
        acc = warp_sum(acc);
        if (lane == 0) sm.y[pp] = acc + ah.dsk * sm.x[pp];
    }
    __syncthreads();
#if OUTNORM
    float ss = 0.f;
    for (int pp = p0 + tid; pp < p1; pp += STEP_THREADS) ss += sm.y[pp] * sm.y[pp];
    const float inv = 1.f / sqrtf(block_sum(ss, sm.red) / (float)HEADDIM + NORM_EPS);
#endif
    for (int pp = p0 + tid; pp < p1; pp += STEP_THREADS) {
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
#if IN_PART(PART_ROWS)
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
    StepHead hd;
    mixer_head(hd, states, layer, blockIdx.x, blockIdx.y);
    mixer_ahead(ah, w, states, layer, blockIdx.x, blockIdx.y);
    griddep_wait();
    griddep_launch();
    mixer_run(sm, ah, hd, w, proj, states, layer, blockIdx.x, blockIdx.y, y_f32, y_act);
}
#endif
