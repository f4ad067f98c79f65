// Mamba-2's scan (spec §3.3) over a packed pass, in the recurrent form, parallel over time
// chunks, heads and the P×N state of a head:
//
//   Δ_t = clamp(softplus(dt_t[h] + dt_bias[h]), dt_limit),  h_t = exp(Δ_t·A_h)·h_{t−1} + Δ_t·x_t ⊗ B_t
//   y_t[h, p] = Σ_n h_t[p, n]·C_t[n] + D[h, p]·x_t[h, p]
//
// The same three steps as Mamba-1's scan (mamba1/cuda/kernels/selective_scan.cu): chunk
// states from zero with Σ Δ, the carry along each sequence's chunks, the outputs from each
// chunk's incoming state (`direct` when every sequence is one chunk). A block holds one head:
// thread (p, q) keeps the state slice h[p, q·SLICE .. (q+1)·SLICE) in registers; the Q = N/SLICE
// threads of a p are adjacent lanes and sum y over their slices by shuffles.
// D_STATE (N) and M2_SLICE are compile-time; Q is a power of two dividing 32.
#define M2_Q (D_STATE / M2_SLICE)

struct M2Scan {
    const float* xbc;      // [rows, C_d] conv output: x (H·P), B (G·N), C (G·N)
    int conv_dim, d_ssm;   // C_d, H·P
    const float* dt;       // dt at dt[r·ld_dt + h]
    int ld_dt;
    const float* dt_bias;  // [H]
    const float* a;        // [H] A = −exp(A_log)
    const float* d_skip;   // [H·P]
    float dt_min, dt_max;
    int heads_per_group, headdim, groups;
    long long ssm_off;     // this layer's ssm tensor [H, P, N] in a state, in floats
};

__device__ __forceinline__ float m2_delta(const M2Scan& p, size_t r, int h) {
    const float d = softplus_f(p.dt[r * p.ld_dt + h] + p.dt_bias[h]);
    return fminf(fmaxf(d, p.dt_min), p.dt_max);
}

// Sum over the Q lanes of a p (adjacent, Q a power of two): every one of them gets it.
__device__ __forceinline__ float m2_sum_slices(float v) {
    const int base = threadIdx.x & ~31;
    const int live = min(32, (int)blockDim.x - base);
    const unsigned mask = live == 32 ? 0xffffffffu : ((1u << live) - 1u);
#pragma unroll
    for (int o = M2_Q / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
    return v;
}

extern "C" __global__ void m2_scan_local(M2Scan p, const int* chunk_row0, const int* chunk_len,
                                         float* h_chunk, float* dt_sum) {
    const int c = blockIdx.x, hd = blockIdx.y, heads = gridDim.y;
    const int pp = threadIdx.x / M2_Q, q = threadIdx.x % M2_Q;
    const int g = hd / p.heads_per_group, ch = hd * p.headdim + pp;
    float h[M2_SLICE];
#pragma unroll
    for (int i = 0; i < M2_SLICE; ++i) h[i] = 0.f;
    float sum = 0.f;
    const int row0 = chunk_row0[c], len = chunk_len[c];
    const float a = p.a[hd];
    for (int t = 0; t < len; ++t) {
        const size_t r = row0 + t;
        const float delta = m2_delta(p, r, hd);
        const float decay = expf(delta * a);
        const float* row = p.xbc + r * p.conv_dim;
        const float dx = delta * row[ch];
        const float* b = row + p.d_ssm + g * D_STATE + q * M2_SLICE;
#pragma unroll
        for (int i = 0; i < M2_SLICE; ++i) h[i] = decay * h[i] + dx * b[i];
        sum += delta;
    }
    float* out = h_chunk + (((size_t)c * heads + hd) * p.headdim + pp) * D_STATE + q * M2_SLICE;
#pragma unroll
    for (int i = 0; i < M2_SLICE; ++i) out[i] = h[i];
    if (threadIdx.x == 0) dt_sum[(size_t)c * heads + hd] = sum;
}

// One thread per state element of a head; h_chunk[c] becomes chunk c's incoming state.
extern "C" __global__ void m2_scan_carry(M2Scan p, const int* seg_chunk0, const int* seg_nchunks,
                                         const unsigned long long* seg_state, float* h_chunk,
                                         const float* dt_sum, int heads) {
    const int s = blockIdx.x / heads, hd = blockIdx.x % heads;
    const int per_head = p.headdim * D_STATE;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= per_head) return;
    float* st = reinterpret_cast<float*>(seg_state[s]) + p.ssm_off + (size_t)hd * per_head + e;
    float h = *st;
    const float a = p.a[hd];
    for (int k = 0; k < seg_nchunks[s]; ++k) {
        const int c = seg_chunk0[s] + k;
        float* hc = h_chunk + ((size_t)c * heads + hd) * per_head + e;
        const float local = *hc;
        *hc = h;
        h = expf(a * dt_sum[(size_t)c * heads + hd]) * h + local;
    }
    *st = h;
}

// y (before the gate) of each chunk, f32 [rows, H·P].
extern "C" __global__ void m2_scan_out(M2Scan p, const int* chunk_row0, const int* chunk_len,
                                       const int* chunk_seg, const unsigned long long* seg_state,
                                       const float* h_chunk, int direct, float* y) {
    const int c = blockIdx.x, hd = blockIdx.y, heads = gridDim.y;
    const int pp = threadIdx.x / M2_Q, q = threadIdx.x % M2_Q;
    const int g = hd / p.heads_per_group, ch = hd * p.headdim + pp;
    const size_t slice = ((size_t)hd * p.headdim + pp) * D_STATE + q * M2_SLICE;
    float* st = reinterpret_cast<float*>(seg_state[chunk_seg[c]]) + p.ssm_off + slice;
    const float* h0 =
        direct ? st : h_chunk + (size_t)c * heads * p.headdim * D_STATE + slice;
    float h[M2_SLICE];
#pragma unroll
    for (int i = 0; i < M2_SLICE; ++i) h[i] = h0[i];
    const int row0 = chunk_row0[c], len = chunk_len[c];
    const float a = p.a[hd];
    for (int t = 0; t < len; ++t) {
        const size_t r = row0 + t;
        const float delta = m2_delta(p, r, hd);
        const float decay = expf(delta * a);
        const float* row = p.xbc + r * p.conv_dim;
        const float x = row[ch];
        const float dx = delta * x;
        const float* b = row + p.d_ssm + g * D_STATE + q * M2_SLICE;
        const float* cc = b + p.groups * D_STATE;
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < M2_SLICE; ++i) {
            h[i] = decay * h[i] + dx * b[i];
            acc += h[i] * cc[i];
        }
        acc = m2_sum_slices(acc);
        if (q == 0) y[r * p.d_ssm + ch] = acc + p.d_skip[ch] * x;
    }
    if (direct) {
#pragma unroll
        for (int i = 0; i < M2_SLICE; ++i) st[i] = h[i];
    }
}

// The gate and the grouped RMSNorm (spec §3.4), and the gated-MLP branch when d_ssm < D_i:
// out[r] = [silu(z0) ⊙ x0 ; o], o = grouped_rms(y ⊙ silu(z)) ⊙ w (or y ⊙ silu(z) without a
// norm; norm_before_gate: grouped_rms(y) ⊙ w ⊙ silu(z)), in the GEMM dtype. One block per row.
// `proj` is the in_proj output ([z0 ; x0 ; z ; xBC ; dt], rows `ld` apart).
extern "C" __global__ void m2_gate_norm(const float* proj, int ld, const float* y, int d_mlp,
                                        int d_ssm, int groups, const float* norm_w,
                                        int norm_before_gate, float eps, act_t* out) {
    const size_t r = blockIdx.x;
    const float* pr = proj + r * ld;
    const float* yr = y + r * d_ssm;
    act_t* o = out + r * (size_t)(d_mlp + d_ssm);
    for (int i = threadIdx.x; i < d_mlp; i += blockDim.x)
        o[i] = from_f<act_t>(silu_f(pr[i]) * pr[d_mlp + i]);
    const float* z = pr + 2 * d_mlp;
    o += d_mlp;
    if (!norm_w) {
        for (int i = threadIdx.x; i < d_ssm; i += blockDim.x)
            o[i] = from_f<act_t>(yr[i] * silu_f(z[i]));
        return;
    }
    const int width = d_ssm / groups;
    for (int g = 0; g < groups; ++g) {
        const int i0 = g * width;
        float ss = 0.f;
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            const float v = norm_before_gate ? yr[i0 + i] : yr[i0 + i] * silu_f(z[i0 + i]);
            ss += v * v;
        }
        const float rr = 1.f / sqrtf(block_sum(ss) / (float)width + eps);
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            const int k = i0 + i;
            float v = norm_before_gate ? yr[k] : yr[k] * silu_f(z[k]);
            v = v * rr * norm_w[k];
            if (norm_before_gate) v *= silu_f(z[k]);
            o[k] = from_f<act_t>(v);
        }
    }
}
