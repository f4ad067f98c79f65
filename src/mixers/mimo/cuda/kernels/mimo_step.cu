// The fused MIMO step (§2.6, §3.4): a pass whose every sequence is a few rows (decode steps)
// in one launch between the in_proj and out_proj products — what mimo_pre, mimo_phase, the
// scan, mimo_tail and mimo_gate do for a long pass, for one (sequence, head) per block:
//
//   Δ, α, β, γ from the row; φ ← wrap(φ + π·tanh(ang)·Δ); k̃_r, q̃_r = rotate(B̄_r + b_r),
//   rotate(C̄_r + c_r);  h ← α·h + Σ_r [β·(x⁻ψ_r)·k̃⁻_r + γ·(xψ_r)·k̃_r];  y_r = h·q̃_r + D·xψ_r;
//   o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r);  then k̃⁻ ← k̃, x⁻ ← x (the state's k and v)
//
// Why one launch: at batch 1 each of the five kernels it replaces is a few microseconds of
// launch and memory latency around almost no work (a decode step of the 187M shape took 3.7×
// SISO's). Layout: lane q of a channel holds the state entries n = q + Q·i (as the recurrent
// scan of mimo.cu), and every lane computes the keys, queries and phases of its own entries —
// the same for every channel — so nothing but the gate's norm crosses warps. A thread walks
// MSTEP_ITERS channels, their state rows loaded in registers before the first row is read.
// Q divides N/2, so the rotation pairs (n, n + N/2) of §2.4 meet in a lane.
#define MIMO_SL (DSTATE / MIMO_Q)
#define MIMO_HALF (MIMO_SL / 2)

// About 32 state entries per thread: P·N/32 threads, at least 64, at most 1024 (the fused
// decode sets its own block size).
#ifndef MSTEP_THREADS
#define MSTEP_WANT (HEADDIM * DSTATE / 32)
#define MSTEP_THREADS (MSTEP_WANT <= 64 ? 64 : MSTEP_WANT >= 1024 ? 1024 : (MSTEP_WANT + 31) / 32 * 32)
#endif
#define MSTEP_CPI (MSTEP_THREADS / MIMO_Q)  // channels per iteration
#define MSTEP_ITERS ((HEADDIM + MSTEP_CPI - 1) / MSTEP_CPI)


// Lane q's entries of the key (`which` 0) or query (1) of rank r at `row`: the (rank, group)
// row of B (C) RMS-normed over N (its sum of squares reduced over the Q lanes of a channel),
// plus the bias, the pairs (n, n + N/2) with n < S rotated by cs.
__device__ __forceinline__ void mstep_kq(const MimoScan& p, const float* pr, int h, int g, int r, int q,
                                         int which, const float2 cs[MIMO_HALF], float out[MIMO_SL]) {
    const int bcw = MIMO_R * p.groups * DSTATE;
    const float* src = pr + p.b_off + which * bcw + (r * p.groups + g) * DSTATE + q;
    const float* w = (which ? p.c_norm : p.b_norm) + q;
    const float* bias = (which ? p.c_bias : p.b_bias) + (h * MIMO_R + r) * DSTATE + q;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < MIMO_SL; ++i) {
        out[i] = __ldcg(src + i * MIMO_Q);
        ss += out[i] * out[i];
    }
    const float rn = 1.f / sqrtf(sum_adjacent_lanes<MIMO_Q>(ss) / (float)DSTATE + p.eps);
#pragma unroll
    for (int i = 0; i < MIMO_SL; ++i) out[i] = out[i] * rn * __ldg(w + i * MIMO_Q) + __ldg(bias + i * MIMO_Q);
#pragma unroll
    for (int i = 0; i < MIMO_HALF; ++i) {
        if (q + i * MIMO_Q < p.angles) {
            const float a = out[i], b = out[i + MIMO_HALF];
            out[i] = a * cs[i].x - b * cs[i].y;
            out[i + MIMO_HALF] = a * cs[i].y + b * cs[i].x;
        }
    }
}

// What one (sequence, head) holds in registers from before its in_proj rows are read to
// after its state is stored: lane q's entries of the channels it walks (h), their previous
// x, the previous keys, the phases, and the head's constants.
struct MimoHead {
    float h[MSTEP_ITERS][MIMO_SL], xp[MSTEP_ITERS];
    float kp[MIMO_R][MIMO_SL], phi[MIMO_HALF];
    float dskip, dt_bias;
};
// The block's shared memory: the rank outputs of a row and their norms' scales.
struct MimoSmem {
    float y[MIMO_R][HEADDIM];
    float rr[MIMO_R];
};

// Everything that does not depend on the in_proj rows: the state rows, the previous keys
// and x, the phases. `st`: the sequence's state.
__device__ __forceinline__ void mimo_head_load(MimoHead& m, const MimoScan& p, const float* st, int hd) {
    const int tid = threadIdx.x, q = tid % MIMO_Q, cg = tid / MIMO_Q;
    const state_t* hs = reinterpret_cast<const state_t*>(st + p.ssm_off) + (size_t)hd * HEADDIM * DSTATE + q;
#pragma unroll
    for (int it = 0; it < MSTEP_ITERS; ++it) {
        const int pp = cg + MSTEP_CPI * it;
        m.xp[it] = pp < HEADDIM ? st[p.v_off + hd * HEADDIM + pp] : 0.f;
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i)
            m.h[it][i] = pp < HEADDIM ? st_load(hs + (size_t)pp * DSTATE + i * MIMO_Q) : 0.f;
    }
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r)
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) m.kp[r][i] = st[p.k_off + ((size_t)r * p.heads + hd) * DSTATE + q + i * MIMO_Q];
#pragma unroll
    for (int i = 0; i < MIMO_HALF; ++i) {
        const int n = q + i * MIMO_Q;
        m.phi[i] = n < p.angles ? st[p.angle_off + hd * p.angles + n] : 0.f;
    }
    m.dskip = p.d_skip[hd];
    m.dt_bias = p.dt_bias[hd];
}

// One row of head hd: `pr` its in_proj row (read through L2: in the fused decode other
// blocks of the same launch wrote it), `out` the row's gated output [H·P] (the out_proj's
// input). Every thread of the block calls it.
template <typename Out>
__device__ __forceinline__ void mimo_head_row(MimoHead& m, MimoSmem& sm, const MimoScan& p, const float* pr, int hd,
                                              Out* out) {
    const int tid = threadIdx.x, q = tid % MIMO_Q, cg = tid / MIMO_Q;
    const int g = hd / (p.heads / p.groups);
    const float pi = 3.14159265358979f;
    // the head's coefficients (mimo_pre)
    const float delta = softplus_f(__ldcg(pr + p.dt_off + hd) + m.dt_bias);
    const float u = __ldcg(pr + p.a_off + hd);
    const float f = p.a_softplus ? softplus_f(u) : (u >= 0.f ? 1.f + u : 1.f / (1.f - u));
    const float a = fminf(-f, -p.a_floor) * delta;
    const float lambda = 1.f / (1.f + expf(-__ldcg(pr + p.trap_off + hd)));
    const float alpha = expf(a);
    const float beta = alpha * delta * (1.f - lambda), gamma = lambda * delta;
    // this lane's phases (mimo_phase, one row)
    float2 cs[MIMO_HALF];
#pragma unroll
    for (int i = 0; i < MIMO_HALF; ++i) {
        const int n = q + i * MIMO_Q;
        if (n < p.angles) {
            m.phi[i] = mimo_wrap(m.phi[i] + pi * tanhf(__ldcg(pr + p.ang_off + n)) * delta);
            sincosf(m.phi[i], &cs[i].y, &cs[i].x);
        }
    }
    float k[MIMO_R][MIMO_SL], qc[MIMO_R][MIMO_SL];
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r) {
        mstep_kq(p, pr, hd, g, r, q, 0, cs, k[r]);
        mstep_kq(p, pr, hd, g, r, q, 1, cs, qc[r]);
    }
    // the state update and readout of each channel (mimo_advance, mimo_scan_rows)
#pragma unroll
    for (int it = 0; it < MSTEP_ITERS; ++it) {
        const int pp = cg + MSTEP_CPI * it;
        const bool live = pp < HEADDIM;
        const int ppc = live ? pp : 0;
        const float x = __ldcg(pr + p.x_off + hd * HEADDIM + ppc);
        float psi[MIMO_R];
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) psi[r] = __ldg(p.mimo_x + (hd * MIMO_R + r) * HEADDIM + ppc);
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) m.h[it][i] *= alpha;
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) {
            const float wb = beta * m.xp[it] * psi[r], wg = gamma * x * psi[r];
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) m.h[it][i] = m.h[it][i] + wb * m.kp[r][i] + wg * k[r][i];
        }
        m.xp[it] = x;
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) {
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) acc += m.h[it][i] * qc[r][i];
            acc = sum_adjacent_lanes<MIMO_Q>(acc);
            if (live && q == 0) sm.y[r][pp] = acc + m.dskip * x * psi[r];
        }
    }
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r)
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) m.kp[r][i] = k[r][i];
    __syncthreads();
    // the gate (mimo_gate): a warp per rank's norm, then a thread per channel
    const int warp = tid >> 5, lane = tid & 31;
    for (int r = warp; r < MIMO_R; r += MSTEP_THREADS / 32) {
        float rr = 1.f;
        if (p.out_norm) {
            float ss = 0.f;
            for (int i = lane; i < HEADDIM; i += 32) ss += sm.y[r][i] * sm.y[r][i];
            rr = 1.f / sqrtf(fam_warp_sum(ss) / (float)HEADDIM + p.eps);
        }
        if (lane == 0) sm.rr[r] = rr;
    }
    __syncthreads();
    for (int i = tid; i < HEADDIM; i += MSTEP_THREADS) {
        const float z = __ldcg(pr + hd * HEADDIM + i);
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) {
            const int at = (hd * MIMO_R + r) * HEADDIM + i;
            float gy = sm.y[r][i];
            if (p.out_norm) gy = gy * sm.rr[r] * p.out_norm[hd * HEADDIM + i];
            o = o + p.mimo_o[at] * gy * silu_f(z * p.mimo_z[at]);
        }
        out[hd * HEADDIM + i] = from_f<Out>(o);
    }
    __syncthreads();  // sm is the next row's; every thread has read the old k, v, φ
}

// The state: h in place, and (mimo_tail) the last row's keys, x and phases.
__device__ __forceinline__ void mimo_head_store(const MimoHead& m, const MimoScan& p, float* st, int hd) {
    const int tid = threadIdx.x, q = tid % MIMO_Q, cg = tid / MIMO_Q;
    state_t* hs = reinterpret_cast<state_t*>(st + p.ssm_off) + (size_t)hd * HEADDIM * DSTATE + q;
#pragma unroll
    for (int it = 0; it < MSTEP_ITERS; ++it) {
        const int pp = cg + MSTEP_CPI * it;
        if (pp < HEADDIM) {
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) st_store(hs + (size_t)pp * DSTATE + i * MIMO_Q, m.h[it][i]);
            if (q == 0) st[p.v_off + hd * HEADDIM + pp] = m.xp[it];
        }
    }
    if (cg == 0) {
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r)
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) st[p.k_off + ((size_t)r * p.heads + hd) * DSTATE + q + i * MIMO_Q] = m.kp[r][i];
#pragma unroll
        for (int i = 0; i < MIMO_HALF; ++i) {
            const int n = q + i * MIMO_Q;
            if (n < p.angles) st[p.angle_off + hd * p.angles + n] = m.phi[i];
        }
    }
}

#ifndef MIMO_FUSED_DECODE
extern "C" __device__ int mimo_step_threads = MSTEP_THREADS;
// Blocks per SM the registers are budgeted for (a define: `MAMBA3_GPU_DEFINES` measures
// others). Two: B=64 decodes 10.8 k tokens/s at the 187M shape on an H100, 9.2 k with one,
// 7.0 k with three (docs/performance.md).
#ifndef MSTEP_MINB
#define MSTEP_MINB 2
#endif

// Grid (chunks, heads): every sequence one chunk of a few rows; `gated` (the GEMM dtype, the
// out_proj's input) as mimo_gate writes it; the state updated in place.
extern "C" __global__ void __launch_bounds__(MSTEP_THREADS, MSTEP_MINB)
    mimo_step(MimoScan p, const int* chunk_row0, const int* chunk_len, const int* chunk_seq,
              const unsigned long long* seq_state, act_t* gated) {
    __shared__ MimoSmem sm;
    const int c = blockIdx.x, hd = blockIdx.y;
    const int row0 = chunk_row0[c], len = chunk_len[c];
    float* st = reinterpret_cast<float*>(seq_state[chunk_seq[c]]);
    MimoHead m;
    mimo_head_load(m, p, st, hd);
    for (int t = 0; t < len; ++t) {
        const size_t row = row0 + t;
        mimo_head_row(m, sm, p, p.proj + row * p.ld, hd, gated + row * (size_t)(p.heads * HEADDIM));
    }
    mimo_head_store(m, p, st, hd);
}
#endif
