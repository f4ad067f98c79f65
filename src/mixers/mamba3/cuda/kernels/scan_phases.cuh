// The rotary phases of one chunk's tokens, for the chunked scan (scan.cu) and its backward
// (scan_bwd.cu), whose blocks each work on one head's chunks with SCAN_WARPS warps. CPU
// twin: the phases of `HeadScan::chunk` in src/mixers/mamba3/chunk.rs.
//
// Spec §2.4: φ_j = φ_enter + Σ_{j' ≤ j} θ_j'·Δ_j', as (cos, sin)
// pairs in s_cs[2(j·NANGLES + i)] (rows past `len`: (1, 0)). Warp w holds θ and Δ of the
// tokens [w·PH_TPW, (w+1)·PH_TPW), lane the angles lane + 32q (fetch_theta). Two steps
// around a block barrier: phase_sums forms the advances θ·Δ and their running sums and
// leaves the warps' totals in s_ph (SCAN_WARPS × NANGLES); phase_table adds the totals of
// the warps before and the entering phase, and writes (cos, sin). Only sin and cos are
// wanted, so the phase is reduced, not wrapped (sincos_unwrapped). θ and Δ are multiplied
// in phase_sums, not where they are loaded: a caller that loads them before a barrier then
// waits for them after it (the product at the load was ≈ 7 % of the scan's stall samples).
// Where the table holds (cos, sin) of angle i at row j (the builds of K̃, Q̃ read a quad's
// two angles as one float4 from here).
__device__ __forceinline__ int cs_index(int j, int i) { return 2 * (j * NANGLES + i); }
#define PH_Q ((NANGLES + 31) / 32)
#define PH_TPW (CHP / SCAN_WARPS)
// th: θ on entry, the running sums of θ·Δ on return.
__device__ __forceinline__ void phase_sums(float (&th)[PH_Q][PH_TPW], const float (&dt)[PH_TPW], float* s_ph) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int q = 0; q < PH_Q; ++q) {
        float run = 0.f;
#pragma unroll
        for (int u = 0; u < PH_TPW; ++u) th[q][u] = run += th[q][u] * dt[u];
        if (lane + 32 * q < NANGLES) s_ph[warp * NANGLES + lane + 32 * q] = run;
    }
}
__device__ __forceinline__ void phase_table(const float (&run)[PH_Q][PH_TPW], const float (&phi_enter)[PH_Q],
                                            int len, float* s_cs, const float* s_ph) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int q = 0; q < PH_Q; ++q) {
        const int i = lane + 32 * q;
        if (i >= NANGLES) continue;
        float base = phi_enter[q];
#pragma unroll
        for (int w = 0; w < SCAN_WARPS - 1; ++w) {
            const float t = s_ph[w * NANGLES + i];  // loaded by every warp: no serial chain
            if (w < warp) base += t;
        }
#pragma unroll
        for (int u = 0; u < PH_TPW; ++u) {
            const int j = warp * PH_TPW + u;
            float sn = 0.f, cs = 1.f;
            if (j < len) sincos_unwrapped(base + run[q][u], &sn, &cs);
            s_cs[cs_index(j, i)] = cs;
            s_cs[cs_index(j, i) + 1] = sn;
        }
    }
}
// Both steps, for a caller with nothing to do between them; the caller syncs before
// reading s_cs.
__device__ __forceinline__ void chunk_phases(float (&th)[PH_Q][PH_TPW], const float (&dt)[PH_TPW],
                                             const float (&phi_enter)[PH_Q], int len, float* s_cs, float* s_ph) {
    phase_sums(th, dt, s_ph);
    __syncthreads();
    phase_table(th, phi_enter, len, s_cs, s_ph);
}

// This thread's θ and entering phases for the phase steps, of the chunk at row `start`;
// zeros past the chunk and the angles.
__device__ __forceinline__ void fetch_theta(const float* __restrict__ theta, const float* __restrict__ phi_enter,
                                            int start, int len, float (&th)[PH_Q][PH_TPW], float (&phi)[PH_Q]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int q = 0; q < PH_Q; ++q) {
        const int i = lane + 32 * q;
        phi[q] = i < NANGLES ? phi_enter[i] : 0.f;
#pragma unroll
        for (int u = 0; u < PH_TPW; ++u) {
            const int j = warp * PH_TPW + u;
            th[q][u] = i < NANGLES && j < len ? theta[(size_t)(start + j) * NANGLES + i] : 0.f;
        }
    }
}
// Δ of this warp's rows for the phase steps (tok: {Δ, γ, c, Lc} per row and head).
__device__ __forceinline__ void fetch_dt(const float4* __restrict__ tok, int h, int start, int len,
                                         float (&dt)[PH_TPW]) {
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int u = 0; u < PH_TPW; ++u) {
        const int j = warp * PH_TPW + u;
        dt[u] = j < len ? reinterpret_cast<const float*>(tok + (size_t)(start + j) * NHEADS + h)[0] : 0.f;
    }
}
