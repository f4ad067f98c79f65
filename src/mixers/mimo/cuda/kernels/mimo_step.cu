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

// About 32 state entries per thread: P·N/32 threads, at least 64, at most 1024.
#define MSTEP_WANT (HEADDIM * DSTATE / 32)
#define MSTEP_THREADS (MSTEP_WANT <= 64 ? 64 : MSTEP_WANT >= 1024 ? 1024 : (MSTEP_WANT + 31) / 32 * 32)
#define MSTEP_CPI (MSTEP_THREADS / MIMO_Q)  // channels per iteration
#define MSTEP_ITERS ((HEADDIM + MSTEP_CPI - 1) / MSTEP_CPI)

extern "C" __device__ int mimo_step_threads = MSTEP_THREADS;

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
        out[i] = src[i * MIMO_Q];
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

// Grid (chunks, heads): every sequence one chunk of a few rows; `gated` (the GEMM dtype, the
// out_proj's input) as mimo_gate writes it; the state updated in place.
extern "C" __global__ void __launch_bounds__(MSTEP_THREADS, 1)
    mimo_step(MimoScan p, const int* chunk_row0, const int* chunk_len, const int* chunk_seq,
              const unsigned long long* seq_state, act_t* gated) {
    __shared__ float y_s[MIMO_R][HEADDIM];
    __shared__ float rr_s[MIMO_R];
    const int c = blockIdx.x, hd = blockIdx.y, tid = threadIdx.x;
    const int q = tid % MIMO_Q, cg = tid / MIMO_Q;
    const int g = hd / (p.heads / p.groups);
    const int row0 = chunk_row0[c], len = chunk_len[c];
    float* st = reinterpret_cast<float*>(seq_state[chunk_seq[c]]);
    state_t* hs = reinterpret_cast<state_t*>(st + p.ssm_off) + (size_t)hd * HEADDIM * DSTATE + q;

    // Everything that does not depend on the in_proj rows first: the state rows, the
    // previous keys and x, the phases.
    float h[MSTEP_ITERS][MIMO_SL], xp[MSTEP_ITERS];
#pragma unroll
    for (int it = 0; it < MSTEP_ITERS; ++it) {
        const int pp = cg + MSTEP_CPI * it;
        xp[it] = pp < HEADDIM ? st[p.v_off + hd * HEADDIM + pp] : 0.f;
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) h[it][i] = pp < HEADDIM ? st_load(hs + (size_t)pp * DSTATE + i * MIMO_Q) : 0.f;
    }
    float kp[MIMO_R][MIMO_SL], phi[MIMO_HALF];
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r)
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) kp[r][i] = st[p.k_off + ((size_t)r * p.heads + hd) * DSTATE + q + i * MIMO_Q];
#pragma unroll
    for (int i = 0; i < MIMO_HALF; ++i) {
        const int n = q + i * MIMO_Q;
        phi[i] = n < p.angles ? st[p.angle_off + hd * p.angles + n] : 0.f;
    }
    const float dskip = p.d_skip[hd], dt_bias = p.dt_bias[hd];
    const float pi = 3.14159265358979f;

    for (int t = 0; t < len; ++t) {
        const size_t row = row0 + t;
        const float* pr = p.proj + row * p.ld;
        // the head's coefficients (mimo_pre)
        const float delta = softplus_f(pr[p.dt_off + hd] + dt_bias);
        const float u = pr[p.a_off + hd];
        const float f = p.a_softplus ? softplus_f(u) : (u >= 0.f ? 1.f + u : 1.f / (1.f - u));
        const float a = fminf(-f, -p.a_floor) * delta;
        const float lambda = 1.f / (1.f + expf(-pr[p.trap_off + hd]));
        const float alpha = expf(a);
        const float beta = alpha * delta * (1.f - lambda), gamma = lambda * delta;
        // this lane's phases (mimo_phase, one row)
        float2 cs[MIMO_HALF];
#pragma unroll
        for (int i = 0; i < MIMO_HALF; ++i) {
            const int n = q + i * MIMO_Q;
            if (n < p.angles) {
                phi[i] = mimo_wrap(phi[i] + pi * tanhf(pr[p.ang_off + n]) * delta);
                sincosf(phi[i], &cs[i].y, &cs[i].x);
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
            const float x = pr[p.x_off + hd * HEADDIM + ppc];
            float psi[MIMO_R];
#pragma unroll
            for (int r = 0; r < MIMO_R; ++r) psi[r] = __ldg(p.mimo_x + (hd * MIMO_R + r) * HEADDIM + ppc);
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) h[it][i] *= alpha;
#pragma unroll
            for (int r = 0; r < MIMO_R; ++r) {
                const float wb = beta * xp[it] * psi[r], wg = gamma * x * psi[r];
#pragma unroll
                for (int i = 0; i < MIMO_SL; ++i) h[it][i] = h[it][i] + wb * kp[r][i] + wg * k[r][i];
            }
            xp[it] = x;
#pragma unroll
            for (int r = 0; r < MIMO_R; ++r) {
                float acc = 0.f;
#pragma unroll
                for (int i = 0; i < MIMO_SL; ++i) acc += h[it][i] * qc[r][i];
                acc = sum_adjacent_lanes<MIMO_Q>(acc);
                if (live && q == 0) y_s[r][pp] = acc + dskip * x * psi[r];
            }
        }
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r)
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) kp[r][i] = k[r][i];
        __syncthreads();
        // the gate (mimo_gate): a warp per rank's norm, then a thread per channel
        const int warp = tid >> 5, lane = tid & 31;
        for (int r = warp; r < MIMO_R; r += MSTEP_THREADS / 32) {
            float rr = 1.f;
            if (p.out_norm) {
                float ss = 0.f;
                for (int i = lane; i < HEADDIM; i += 32) ss += y_s[r][i] * y_s[r][i];
                rr = 1.f / sqrtf(fam_warp_sum(ss) / (float)HEADDIM + p.eps);
            }
            if (lane == 0) rr_s[r] = rr;
        }
        __syncthreads();
        for (int i = tid; i < HEADDIM; i += MSTEP_THREADS) {
            const float z = pr[hd * HEADDIM + i];
            float o = 0.f;
#pragma unroll
            for (int r = 0; r < MIMO_R; ++r) {
                const int at = (hd * MIMO_R + r) * HEADDIM + i;
                float gy = y_s[r][i];
                if (p.out_norm) gy = gy * rr_s[r] * p.out_norm[hd * HEADDIM + i];
                o = o + p.mimo_o[at] * gy * silu_f(z * p.mimo_z[at]);
            }
            gated[row * (size_t)(p.heads * HEADDIM) + hd * HEADDIM + i] = from_f<act_t>(o);
        }
        __syncthreads();  // y_s is the next row's; every thread has read the old k, v, φ
    }

    // the state: h in place, and (mimo_tail) the last row's keys, x and phases
#pragma unroll
    for (int it = 0; it < MSTEP_ITERS; ++it) {
        const int pp = cg + MSTEP_CPI * it;
        if (pp < HEADDIM) {
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) st_store(hs + (size_t)pp * DSTATE + i * MIMO_Q, h[it][i]);
            if (q == 0) st[p.v_off + hd * HEADDIM + pp] = xp[it];
        }
    }
    if (cg == 0) {
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r)
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) st[p.k_off + ((size_t)r * p.heads + hd) * DSTATE + q + i * MIMO_Q] = kp[r][i];
#pragma unroll
        for (int i = 0; i < MIMO_HALF; ++i) {
            const int n = q + i * MIMO_Q;
            if (n < p.angles) st[p.angle_off + hd * p.angles + n] = phi[i];
        }
    }
}
