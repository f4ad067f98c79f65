// Mamba-1's selective scan (spec §2.3) over a packed pass, parallel over time chunks as well
// as channels, so that one long sequence fills the GPU:
//
//   h_t[d, n] = exp(Δ_t[d]·A[d, n])·h_{t−1}[d, n] + Δ_t[d]·B_t[n]·u_t[d]
//   y_t[d]    = Σ_n C_t[n]·h_t[d, n] + D[d]·u_t[d],   out_t[d] = y_t[d]·silu(z_t[d])
//
// Each sequence's rows are cut into chunks (`chunk_*` tables, src/cuda/packed.rs).
//  1. `m1_scan_local`: per chunk, the state reached from zero, and Σ_t Δ_t (the chunk's
//     decay is exp(A·ΣΔ)).
//  2. `m1_scan_carry`: per sequence, along its chunks: each chunk's incoming state, from the
//     sequence's state; the sequence's final state is written back.
//  3. `m1_scan_out`: per chunk, the outputs from the incoming state.
// A pass whose sequences are each one chunk (decode, short prompts) runs step 3 alone
// (`direct`), reading and writing the states themselves. D_STATE (N) is compile-time: the
// state of a channel lives in registers.

// Chunks whose carry inputs are loaded at once (m1_scan_carry).
#define M1_CARRY_BATCH 8

struct M1Scan {
    const float* u;        // [rows, D_i] conv output
    const float* dt;       // [rows, D_i] dt_proj output, before bias and softplus
    const float* dt_bias;  // [D_i]
    const float* a;        // [D_i, N] A = −exp(A_log)
    const float* bc;       // B at bc[r·ld_bc + b_off], C at + N
    int ld_bc, b_off;
    const float* z;        // z at z[r·ld_z + d]
    int ld_z;
    const float* d_skip;   // [D_i]
    int d_inner;
    long long ssm_off;     // this layer's ssm tensor [D_i, N] (state_t) in a state, in floats
};

extern "C" __global__ void m1_scan_local(M1Scan p, const int* chunk_row0, const int* chunk_len,
                                         float* h_chunk, float* dt_sum) {
    const int d = blockIdx.y * blockDim.x + threadIdx.x, c = blockIdx.x;
    if (d >= p.d_inner) return;
    float h[D_STATE], a[D_STATE];
#pragma unroll
    for (int n = 0; n < D_STATE; ++n) {
        h[n] = 0.f;
        a[n] = p.a[(size_t)d * D_STATE + n];
    }
    float sum = 0.f;
    const int row0 = chunk_row0[c], len = chunk_len[c];
    for (int t = 0; t < len; ++t) {
        const size_t r = row0 + t;
        const float delta = softplus_f(p.dt[r * p.d_inner + d] + p.dt_bias[d]);
        const float du = delta * p.u[r * p.d_inner + d];
        const float* b = p.bc + r * p.ld_bc + p.b_off;
#pragma unroll
        for (int n = 0; n < D_STATE; ++n) h[n] = expf(delta * a[n]) * h[n] + du * b[n];
        sum += delta;
    }
    float* out = h_chunk + ((size_t)c * p.d_inner + d) * D_STATE;
#pragma unroll
    for (int n = 0; n < D_STATE; ++n) out[n] = h[n];
    dt_sum[(size_t)c * p.d_inner + d] = sum;
}

// h_chunk[c] (a chunk's state from zero) is replaced by the chunk's incoming state.
// One thread per state entry (d, n): coalesced over h_chunk's [chunk][D_i][N] rows. Each
// batch of M1_CARRY_BATCH chunks' local states and Δ sums is loaded before the walk through
// them, so that the walk waits for memory once per batch, not once per chunk (the walk
// itself is the same arithmetic, in the same order, as one chunk at a time).
extern "C" __global__ void m1_scan_carry(M1Scan p, const int* seg_chunk0, const int* seg_nchunks,
                                         const unsigned long long* seg_state, float* h_chunk,
                                         const float* dt_sum) {
    const int e = blockIdx.y * blockDim.x + threadIdx.x, s = blockIdx.x;
    if (e >= p.d_inner * D_STATE) return;
    const int d = e / D_STATE;
    state_t* st = reinterpret_cast<state_t*>(reinterpret_cast<float*>(seg_state[s]) + p.ssm_off) + e;
    const float a = p.a[e];
    float h = st_load(st);
    const int c0 = seg_chunk0[s], n = seg_nchunks[s];
    const size_t stride = (size_t)p.d_inner * D_STATE;
    float* hc = h_chunk + (size_t)c0 * stride + e;
    for (int k0 = 0; k0 < n; k0 += M1_CARRY_BATCH) {
        float local[M1_CARRY_BATCH], sum[M1_CARRY_BATCH];
#pragma unroll
        for (int i = 0; i < M1_CARRY_BATCH; ++i) {
            const int k = k0 + i;
            local[i] = k < n ? hc[k * stride] : 0.f;
            sum[i] = k < n ? dt_sum[(size_t)(c0 + k) * p.d_inner + d] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < M1_CARRY_BATCH; ++i) {
            const int k = k0 + i;
            if (k >= n) break;
            hc[k * stride] = h;
            h = expf(a * sum[i]) * h + local[i];
        }
    }
    st_store(st, h);
}

// Outputs of each chunk, gated, in the GEMM dtype. `direct`: the chunk is its sequence's
// whole pass, starting from and written back to the state; else from h_chunk (after carry).
extern "C" __global__ void m1_scan_out(M1Scan p, const int* chunk_row0, const int* chunk_len,
                                       const int* chunk_seg, const unsigned long long* seg_state,
                                       const float* h_chunk, int direct, act_t* out) {
    const int d = blockIdx.y * blockDim.x + threadIdx.x, c = blockIdx.x;
    if (d >= p.d_inner) return;
    state_t* st =
        reinterpret_cast<state_t*>(reinterpret_cast<float*>(seg_state[chunk_seg[c]]) + p.ssm_off) + (size_t)d * D_STATE;
    const float* h0 = h_chunk + ((size_t)c * p.d_inner + d) * D_STATE;
    float h[D_STATE], a[D_STATE];
#pragma unroll
    for (int n = 0; n < D_STATE; ++n) {
        h[n] = direct ? st_load(st + n) : h0[n];
        a[n] = p.a[(size_t)d * D_STATE + n];
    }
    const int row0 = chunk_row0[c], len = chunk_len[c];
    for (int t = 0; t < len; ++t) {
        const size_t r = row0 + t;
        const float delta = softplus_f(p.dt[r * p.d_inner + d] + p.dt_bias[d]);
        const float u = p.u[r * p.d_inner + d];
        const float du = delta * u;
        const float* b = p.bc + r * p.ld_bc + p.b_off;
        const float* cc = b + D_STATE;
        float y = 0.f;
#pragma unroll
        for (int n = 0; n < D_STATE; ++n) {
            h[n] = expf(delta * a[n]) * h[n] + du * b[n];
            y += h[n] * cc[n];
        }
        y += p.d_skip[d] * u;
        out[r * p.d_inner + d] = from_f<act_t>(y * silu_f(p.z[r * p.ld_z + d]));
    }
    if (direct) {
#pragma unroll
        for (int n = 0; n < D_STATE; ++n) st_store(st + n, h[n]);
    }
}

// FalconMamba (spec §2.5): weightless RMS norms on Δ_low, B and C of each row, in place,
// then Δ_low in the GEMM dtype for dt_proj. Without the norms (`eps` < 0) only the copy.
// One block of 128 threads per row.
extern "C" __global__ void m1_dbc_prep(float* dbc, int ld, int dt_rank, float eps,
                                       act_t* dt_low) {
    float* row = dbc + (size_t)blockIdx.x * ld;
    if (eps >= 0.f) {
        const int starts[3] = {0, dt_rank, dt_rank + D_STATE};
        const int lens[3] = {dt_rank, D_STATE, D_STATE};
        for (int k = 0; k < 3; ++k) {
            float ss = 0.f;
            for (int j = threadIdx.x; j < lens[k]; j += blockDim.x)
                ss += row[starts[k] + j] * row[starts[k] + j];
            const float r = 1.f / sqrtf(block_sum(ss) / (float)lens[k] + eps);
            __syncthreads();
            for (int j = threadIdx.x; j < lens[k]; j += blockDim.x) row[starts[k] + j] *= r;
            __syncthreads();
        }
    }
    for (int j = threadIdx.x; j < dt_rank; j += blockDim.x)
        dt_low[(size_t)blockIdx.x * dt_rank + j] = from_f<act_t>(row[j]);
}
