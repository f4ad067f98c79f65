// Per-token preprocessing of the chunked prefill (spec §2.1–§2.4, §4.2): the CPU twin is
// `MixerCtx::token_pre` in src/mixers/mamba3/token.rs plus the per-token part of `scan_head` in
// src/mixers/mamba3/prefill.rs. One block per chunk of one sequence (≤ CHUNK tokens).
//
// Chunk table entry (int4): {start row, tokens in chunk, end row of the sequence (exclusive),
// sequence index}. Input: the in_proj rows (`proj_t`: f32, or f16 with PROJ_F16). Outputs,
// all f32:
//   bcn  [rows][2][G][N]   B̄ then C̄, RMS-normed with their weights (bias added later)
//   tok  [rows][H][4]      {Δ, γ = λΔ, c = γ + Δ'(1−λ'), Lc = in-chunk inclusive Σ a}
//                          where Δ', λ' belong to the next token of the same sequence
//                          (c = γ for the sequence's last token) and a = A·Δ
//   theta[rows][S]         θ = π·tanh(angle)
//   csum [chunk][H][S]     Σ over the chunk of θ·Δ (the angle advance, for angle_pass)

#define PRE_THREADS 256
#define PRE_ROWS 4
#define PRE_SMEM_FLOATS ((3 * CHUNK + 2) * NHEADS + CHUNK * NANGLES)
// Read by the host (cuModuleGetGlobal) to size the launch.
extern "C" __device__ int prefill_pre_smem_bytes = PRE_SMEM_FLOATS * 4;

// Δ, a = A·Δ and λ of one (token, head) from its in_proj entries dd_dt, dd_A, trap and
// the head's Δ bias.
__device__ __forceinline__ void head_scalars(float dd_dt, float dd_a, float trap, float bias, float* dt,
                                             float* a, float* lam) {
    const float d = softplus_f(dd_dt + bias);
    *dt = d;
    *a = a_value_f(dd_a) * d;
    *lam = sigmoid_f(trap);
}

#if IN_PART(PART_ROWS)
extern "C" __global__ void __launch_bounds__(PRE_THREADS)
    prefill_pre(const proj_t* __restrict__ proj, const int4* __restrict__ chunks,
                const float* __restrict__ b_norm, const float* __restrict__ c_norm,
                const float* __restrict__ dt_bias, float* __restrict__ bcn,
                float* __restrict__ tok, float* __restrict__ theta, float* __restrict__ csum) {
    extern __shared__ float pre_smem[];  // PRE_SMEM_FLOATS
    float(*s_dt)[NHEADS] = reinterpret_cast<float(*)[NHEADS]>(pre_smem);
    float(*s_lam)[NHEADS] = reinterpret_cast<float(*)[NHEADS]>(pre_smem + (CHUNK + 1) * NHEADS);
    float(*s_a)[NHEADS] = reinterpret_cast<float(*)[NHEADS]>(pre_smem + 2 * (CHUNK + 1) * NHEADS);
    float(*s_th)[NANGLES] = reinterpret_cast<float(*)[NANGLES]>(pre_smem + (3 * CHUNK + 2) * NHEADS);
    griddep_wait();
    griddep_launch();
    const int4 ck = chunks[blockIdx.x];
    const int start = ck.x, len = ck.y, seq_end = ck.z;
    const bool has_next = start + len < seq_end;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = PRE_THREADS / 32;

    // B̄, C̄: one warp per (token, B|C, group) row of N, PRE_ROWS rows at a time with all
    // their loads in flight (a row at a time would wait for memory once per row).
    constexpr int NPL = (DSTATE + 31) / 32;  // elements per lane
    const int tasks = len * 2 * NGROUPS;
    for (int t0 = warp * PRE_ROWS; t0 < tasks; t0 += nw * PRE_ROWS) {
        float v[PRE_ROWS][NPL];
#pragma unroll
        for (int u = 0; u < PRE_ROWS; ++u) {
            const int task = t0 + u, j = task / (2 * NGROUPS), r = task % (2 * NGROUPS);
            const proj_t* src = proj + (size_t)(start + j) * PROJ_LD + (r < NGROUPS ? B_OFF : C_OFF - NGROUPS * DSTATE) +
                               r * DSTATE;
#pragma unroll
            for (int q = 0; q < NPL; ++q) {
                const int n = lane + 32 * q;
                v[u][q] = task < tasks && n < DSTATE ? proj1(src + n) : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < PRE_ROWS; ++u) {
            const int task = t0 + u, j = task / (2 * NGROUPS), r = task % (2 * NGROUPS);
            if (task >= tasks) break;
            const float* wn = r < NGROUPS ? b_norm : c_norm;
            float ss = 0.f;
#pragma unroll
            for (int q = 0; q < NPL; ++q) ss += v[u][q] * v[u][q];
            const float inv = 1.f / sqrtf(warp_sum(ss) / (float)DSTATE + NORM_EPS);
            float* dst = bcn + (size_t)(start + j) * BC_W + r * DSTATE;
#pragma unroll
            for (int q = 0; q < NPL; ++q) {
                const int n = lane + 32 * q;
                if (n < DSTATE) dst[n] = v[u][q] * inv * wn[n];
            }
        }
    }
    // Per (token, head) scalars, including the next token after the chunk when it exists.
    const int jn = has_next ? len + 1 : len;
    for (int e = threadIdx.x; e < jn * NHEADS; e += PRE_THREADS) {
        int j = e / NHEADS, h = e % NHEADS;
        const proj_t* row = proj + (size_t)(start + j) * PROJ_LD;
        float d, a, l;
        head_scalars(proj1(row + DT_OFF + h), proj1(row + A_OFF + h), proj1(row + TRAP_OFF + h), dt_bias[h], &d,
                     &a, &l);
        s_dt[j][h] = d;
        s_lam[j][h] = l;
        if (j < len) s_a[j][h] = a;
    }
    for (int e = threadIdx.x; e < len * NANGLES; e += PRE_THREADS) {
        int j = e / NANGLES, i = e % NANGLES;
        float th = PI_F * tanhf(proj1(proj + (size_t)(start + j) * PROJ_LD + ANG_OFF + i));
        s_th[j][i] = th;
        theta[(size_t)(start + j) * NANGLES + i] = th;
    }
    __syncthreads();
    // Trapezoid weights and the in-chunk decay cumsum: one thread per head.
    for (int h = threadIdx.x; h < NHEADS; h += PRE_THREADS) {
        float lc = 0.f;
        for (int j = 0; j < len; ++j) {
            float gam = s_lam[j][h] * s_dt[j][h];
            bool nxt = j + 1 < len || has_next;
            float look = nxt ? s_dt[j + 1][h] * (1.f - s_lam[j + 1][h]) : 0.f;
            lc += s_a[j][h];
            float4 v = make_float4(s_dt[j][h], gam, gam + look, lc);
            reinterpret_cast<float4*>(tok)[(size_t)(start + j) * NHEADS + h] = v;
        }
    }
    // Angle advance of the chunk per (head, angle).
    for (int e = threadIdx.x; e < NHEADS * NANGLES; e += PRE_THREADS) {
        int h = e / NANGLES, i = e % NANGLES;
        float s = 0.f;
        for (int j = 0; j < len; ++j) s += s_th[j][i] * s_dt[j][h];
        csum[(size_t)blockIdx.x * NHEADS * NANGLES + e] = s;
    }
}
#endif

// Angle state passing across chunks (spec §2.4): for each sequence, φ entering each chunk
// = wrap(φ entering the previous chunk + its advance), seeded from the state's angle; the
// state is left at the angle after the sequence's last token. Grid (sequences, tiles of
// 128 (head, angle) pairs); the advances are loaded 32 chunks at a time so that the walk
// waits for memory once per 16 chunks, not once per chunk.
#define ANGLE_THREADS 128
#define ANGLE_BATCH 32
#if IN_PART(PART_ROWS)
extern "C" __global__ void __launch_bounds__(ANGLE_THREADS)
    angle_pass(const int4* __restrict__ seqs, const float* __restrict__ csum,
               float* __restrict__ phi0, float* const* __restrict__ states, int layer) {
    griddep_wait();
    griddep_launch();
    const int4 sq = seqs[blockIdx.x];
    const int e = blockIdx.y * ANGLE_THREADS + threadIdx.x;
    if (e >= NHEADS * NANGLES) return;
    float* st = layer_st(states[blockIdx.x], layer).angle;
    float phi = st[e];
    for (int c0 = sq.x; c0 < sq.x + sq.y; c0 += ANGLE_BATCH) {
        float adv[ANGLE_BATCH];
#pragma unroll
        for (int i = 0; i < ANGLE_BATCH; ++i)
            if (c0 + i < sq.x + sq.y) adv[i] = csum[(size_t)(c0 + i) * NHEADS * NANGLES + e];
#pragma unroll
        for (int i = 0; i < ANGLE_BATCH; ++i) {
            if (c0 + i >= sq.x + sq.y) break;
            phi0[(size_t)(c0 + i) * NHEADS * NANGLES + e] = phi;
            phi = wrap_angle_f(phi + adv[i]);
        }
    }
    st[e] = phi;
}
#endif
