// The fused MIMO step (§2.6, §3.4): a pass whose every sequence is a few rows (decode steps)
// in one launch between the in_proj and out_proj products — what mimo_pre, mimo_phase, the
// scan, mimo_tail and mimo_chunk_out's gate do for a long pass, for one (sequence, head) per block:
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


// Angles (n < S ≤ N/2) per thread: thread t holds φ of angles t, t + T, …
#define MSTEP_PHI ((DSTATE / 2 + MSTEP_THREADS - 1) / MSTEP_THREADS)
// Entries of an N-row per lane when a warp takes one row
#define MSTEP_NPL ((DSTATE + 31) / 32)

// What one (sequence, head) holds in registers from before its in_proj rows are read to
// after its state is stored: lane q's entries of the channels it walks (h), their previous
// x, its angles' phases, and the head's constants. The keys, queries and previous keys are
// the block's, in shared memory (`MimoSmem`).
struct MimoHead {
    float h[MSTEP_ITERS][MIMO_SL], xp[MSTEP_ITERS];
    float phi[MSTEP_PHI];
    float dskip, dt_bias;
};
// The block's shared memory: a row's rotated, biased, normed keys (kq[0]) and queries
// (kq[1]) of every rank, the previous row's keys (the state's k), the row's cos φ and sin φ,
// the rank outputs and their norms' scales.
struct MimoSmem {
    float kq[2][MIMO_R][DSTATE];
    float kprev[MIMO_R][DSTATE];
    float2 cs[DSTATE / 2];
    float y[MIMO_R][HEADDIM];
    float rr[MIMO_R];
};

// Everything that does not depend on the in_proj rows, to registers: the state rows, the
// previous x, the phases, the head's constants. `st`: the sequence's state.
__device__ __forceinline__ void mimo_head_regs(MimoHead& m, const MimoScan& p, const float* st, int hd) {
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
    for (int j = 0; j < MSTEP_PHI; ++j) {
        const int n = tid + MSTEP_THREADS * j;
        m.phi[j] = n < p.angles ? st[p.angle_off + hd * p.angles + n] : 0.f;
    }
    m.dskip = p.d_skip[hd];
    m.dt_bias = p.dt_bias[hd];
}

// The state's previous keys to shared memory (read after the row's first barrier). First a
// barrier: the block's previous head may still be storing its own from there.
__device__ __forceinline__ void mimo_head_smem(MimoSmem& sm, const MimoScan& p, const float* st, int hd) {
    __syncthreads();
    for (int e = threadIdx.x; e < MIMO_R * DSTATE; e += MSTEP_THREADS) {
        const int r = e / DSTATE, n = e % DSTATE;
        sm.kprev[r][n] = st[p.k_off + ((size_t)r * p.heads + hd) * DSTATE + n];
    }
}

// One row of head hd: `pr` its in_proj row (read through L2: in the fused decode other
// blocks of the same launch wrote it), `out` the row's gated output [H·P] (the out_proj's
// input). Every thread of the block calls it. The keys and queries are the block's work
// (a warp per (rank, B or C) row), not every channel's; the update and read-out walk the
// ranks outermost so that a thread holds one rank's entries at a time.
template <typename Out>
__device__ __forceinline__ void mimo_head_row(MimoHead& m, MimoSmem& sm, const MimoScan& p, const float* pr, int hd,
                                              Out* out) {
    const int tid = threadIdx.x, q = tid % MIMO_Q, cg = tid / MIMO_Q, warp = tid >> 5, lane = tid & 31;
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
    // this thread's phases (mimo_phase, one row)
#pragma unroll
    for (int j = 0; j < MSTEP_PHI; ++j) {
        const int n = tid + MSTEP_THREADS * j;
        if (n < p.angles) {
            m.phi[j] = mimo_wrap(m.phi[j] + pi * tanhf(__ldcg(pr + p.ang_off + n)) * delta);
            float sn, cn;
            sincosf(m.phi[j], &sn, &cn);
            sm.cs[n] = make_float2(cn, sn);
        }
    }
    // B̄_r (which 0) and C̄_r (1): the (rank, group) row RMS-normed over N, plus the bias
    const int bcw = MIMO_R * p.groups * DSTATE;
    for (int row = warp; row < 2 * MIMO_R; row += MSTEP_THREADS / 32) {
        const int which = row / MIMO_R, r = row % MIMO_R;
        const float* src = pr + p.b_off + which * bcw + (r * p.groups + g) * DSTATE;
        const float* w = which ? p.c_norm : p.b_norm;
        const float* bias = (which ? p.c_bias : p.b_bias) + (hd * MIMO_R + r) * DSTATE;
        float v[MSTEP_NPL], ss = 0.f;
#pragma unroll
        for (int j = 0; j < MSTEP_NPL; ++j) {
            const int n = lane + 32 * j;
            v[j] = n < DSTATE ? __ldcg(src + n) : 0.f;
            ss += v[j] * v[j];
        }
        const float rn = 1.f / sqrtf(fam_warp_sum(ss) / (float)DSTATE + p.eps);
#pragma unroll
        for (int j = 0; j < MSTEP_NPL; ++j) {
            const int n = lane + 32 * j;
            if (n < DSTATE) sm.kq[which][r][n] = v[j] * rn * __ldg(w + n) + __ldg(bias + n);
        }
    }
    __syncthreads();
    // the rotation of the pairs (n, n + N/2), n < S
    for (int e = tid; e < 2 * MIMO_R * p.angles; e += MSTEP_THREADS) {
        const int n = e % p.angles, wr = e / p.angles;
        float* row = sm.kq[wr / MIMO_R][wr % MIMO_R];
        const float2 c = sm.cs[n];
        const float x0 = row[n], x1 = row[n + DSTATE / 2];
        row[n] = x0 * c.x - x1 * c.y;
        row[n + DSTATE / 2] = x0 * c.y + x1 * c.x;
    }
    __syncthreads();
    // the state update of each channel, rank by rank (mimo_advance):
    // h ← α·h + Σ_r [β·(x⁻ψ_r)·k̃⁻_r + γ·(xψ_r)·k̃_r]
    float x[MSTEP_ITERS];
#pragma unroll
    for (int it = 0; it < MSTEP_ITERS; ++it) {
        const int pp = cg + MSTEP_CPI * it;
        x[it] = pp < HEADDIM ? __ldcg(pr + p.x_off + hd * HEADDIM + pp) : 0.f;
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) m.h[it][i] *= alpha;
    }
    const float* psi_h = p.mimo_x + hd * MIMO_R * HEADDIM;
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r) {
        float kp[MIMO_SL], k[MIMO_SL];
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) {
            kp[i] = sm.kprev[r][q + i * MIMO_Q];
            k[i] = sm.kq[0][r][q + i * MIMO_Q];
        }
#pragma unroll
        for (int it = 0; it < MSTEP_ITERS; ++it) {
            const int pp = min(cg + MSTEP_CPI * it, HEADDIM - 1);
            const float psi = __ldg(psi_h + r * HEADDIM + pp);
            const float wb = beta * m.xp[it] * psi, wg = gamma * x[it] * psi;
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) m.h[it][i] = m.h[it][i] + wb * kp[i] + wg * k[i];
        }
    }
    // the read-out y_r = h·q̃_r + D·xψ_r, rank by rank
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r) {
        float qc[MIMO_SL];
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) qc[i] = sm.kq[1][r][q + i * MIMO_Q];
#pragma unroll
        for (int it = 0; it < MSTEP_ITERS; ++it) {
            const int pp = cg + MSTEP_CPI * it;
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) acc += m.h[it][i] * qc[i];
            acc = sum_adjacent_lanes<MIMO_Q>(acc);
            if (pp < HEADDIM && q == 0) sm.y[r][pp] = acc + m.dskip * x[it] * __ldg(psi_h + r * HEADDIM + pp);
        }
    }
#pragma unroll
    for (int it = 0; it < MSTEP_ITERS; ++it) m.xp[it] = x[it];
    __syncthreads();  // every thread has read the previous keys and this row's
    for (int e = tid; e < MIMO_R * DSTATE; e += MSTEP_THREADS) sm.kprev[e / DSTATE][e % DSTATE] = sm.kq[0][e / DSTATE][e % DSTATE];
    // the gate (mimo_tile_gate): a warp per rank's norm, then a thread per channel
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
    __syncthreads();  // sm is the next row's
}

// The state: h in place, and (mimo_tail) the last row's keys, x and phases.
__device__ __forceinline__ void mimo_head_store(const MimoHead& m, const MimoSmem& sm, const MimoScan& p, float* st,
                                                int hd) {
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
    for (int e = tid; e < MIMO_R * DSTATE; e += MSTEP_THREADS) {
        const int r = e / DSTATE, n = e % DSTATE;
        st[p.k_off + ((size_t)r * p.heads + hd) * DSTATE + n] = sm.kprev[r][n];
    }
#pragma unroll
    for (int j = 0; j < MSTEP_PHI; ++j) {
        const int n = tid + MSTEP_THREADS * j;
        if (n < p.angles) st[p.angle_off + hd * p.angles + n] = m.phi[j];
    }
}

#ifndef MIMO_FUSED_DECODE
extern "C" __device__ int mimo_step_threads = MSTEP_THREADS;
// Blocks per SM the registers are budgeted for (a define: `MAMBA3_GPU_DEFINES` measures
// others; docs/decisions.md, "MIMO decode: registers per step block").
#ifndef MSTEP_MINB
#define MSTEP_MINB 2
#endif

// Grid (chunks, heads): every sequence one chunk of a few rows; `gated` (the GEMM dtype, the
// out_proj's input) as mimo_chunk_out writes it; the state updated in place.
extern "C" __global__ void __launch_bounds__(MSTEP_THREADS, MSTEP_MINB)
    mimo_step(MimoScan p, const int* chunk_row0, const int* chunk_len, const int* chunk_seq,
              const unsigned long long* seq_state, act_t* gated) {
    __shared__ MimoSmem sm;
    const int c = blockIdx.x, hd = blockIdx.y;
    const int row0 = chunk_row0[c], len = chunk_len[c];
    float* st = reinterpret_cast<float*>(seq_state[chunk_seq[c]]);
    MimoHead m;
    mimo_head_regs(m, p, st, hd);
    mimo_head_smem(sm, p, st, hd);
    for (int t = 0; t < len; ++t) {
        const size_t row = row0 + t;
        mimo_head_row(m, sm, p, p.proj + row * p.ld, hd, gated + row * (size_t)(p.heads * HEADDIM));
    }
    mimo_head_store(m, sm, p, st, hd);
}
#endif
