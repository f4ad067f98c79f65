// Mamba-2's scan (spec §3.3) in the recurrent form, for short passes (decode steps: every
// sequence one chunk of a few rows), where ssd_chunk.cu's tiles of CHUNK rows would be
// mostly padding (the chunked scan and its carry are ssd_chunk.cu's):
//
//   Δ_t = clamp(softplus(dt_t[h] + dt_bias[h]), dt_limit),  h_t = exp(Δ_t·A_h)·h_{t−1} + Δ_t·x_t ⊗ B_t
//   y_t[h, p] = Σ_n h_t[p, n]·C_t[n] + D[h, p]·x_t[h, p]
//
// A block of `m2_scan_rows` holds P_BLK channels p of one head for one sequence (grid z
// spans the head's channels); the Q = M2_Q adjacent lanes of a channel hold its state
// interleaved, lane q the entries n = q + Q·i, so that a warp's loads and stores of states,
// B and C are contiguous, and sum y by shuffles. Δ and the decay of the rows are computed
// once per block into shared memory. DSTATE (N) and M2_Q (a power of two dividing 32 and
// N) are compile-time.
#define M2_SL (DSTATE / M2_Q)
// the longest chunk (src/mixers/mamba2/cuda/mod.rs: chunk_len)
#define M2_MAX_CHUNK 256

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
    long long ssm_off;     // this layer's ssm tensor [H, P, N] (state_t) in a state, in floats
};

// This thread's place: chunk, head, channel, lane; and the chunk's Δ and exp(Δ·A) staged.
struct M2Place {
    int c, hd, heads, q, pp, g, ch, row0, len;
    float a;
};

__device__ __forceinline__ M2Place m2_place(const M2Scan& p, const int* chunk_row0,
                                            const int* chunk_len, float* s_delta,
                                            float* s_decay) {
    M2Place w;
    w.c = blockIdx.x;
    w.hd = blockIdx.y;
    w.heads = gridDim.y;
    w.q = threadIdx.x % M2_Q;
    w.pp = blockIdx.z * (blockDim.x / M2_Q) + threadIdx.x / M2_Q;
    w.g = w.hd / p.heads_per_group;
    w.ch = w.hd * p.headdim + w.pp;
    w.row0 = chunk_row0[w.c];
    w.len = chunk_len[w.c];
    w.a = p.a[w.hd];
    for (int t = threadIdx.x; t < w.len; t += blockDim.x) {
        const float d = softplus_f(p.dt[(size_t)(w.row0 + t) * p.ld_dt + w.hd] + p.dt_bias[w.hd]);
        const float delta = fminf(fmaxf(d, p.dt_min), p.dt_max);
        s_delta[t] = delta;
        s_decay[t] = expf(delta * w.a);
    }
    __syncthreads();
    return w;
}

// y (before the gate) of each sequence, f32 [rows, H·P], and its final state; every
// sequence is one chunk.
extern "C" __global__ void m2_scan_rows(M2Scan p, const int* chunk_row0, const int* chunk_len,
                                        const int* chunk_seg, const unsigned long long* seg_state,
                                        float* y) {
    __shared__ float s_delta[M2_MAX_CHUNK], s_decay[M2_MAX_CHUNK];
    const M2Place w = m2_place(p, chunk_row0, chunk_len, s_delta, s_decay);
    const size_t at = ((size_t)w.hd * p.headdim + w.pp) * DSTATE + w.q;
    state_t* st = reinterpret_cast<state_t*>(reinterpret_cast<float*>(seg_state[chunk_seg[w.c]]) + p.ssm_off) + at;
    float h[M2_SL];
#pragma unroll
    for (int i = 0; i < M2_SL; ++i) h[i] = st_load(st + i * M2_Q);
    const float dskip = p.d_skip[w.ch];
    for (int t = 0; t < w.len; ++t) {
        const size_t r = w.row0 + t;
        const float* row = p.xbc + r * p.conv_dim;
        const float x = row[w.ch];
        const float dx = s_delta[t] * x;
        const float decay = s_decay[t];
        const float* b = row + p.d_ssm + w.g * DSTATE + w.q;
        const float* cc = b + p.groups * DSTATE;
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < M2_SL; ++i) {
            h[i] = decay * h[i] + dx * b[i * M2_Q];
            acc += h[i] * cc[i * M2_Q];
        }
        acc = sum_adjacent_lanes<M2_Q>(acc);
        if (w.q == 0) y[r * p.d_ssm + w.ch] = acc + dskip * x;
    }
#pragma unroll
    for (int i = 0; i < M2_SL; ++i) st_store(st + i * M2_Q, h[i]);
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
