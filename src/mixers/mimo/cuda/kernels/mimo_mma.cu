// The MIMO scan's chunk states and outputs as matrix products on tensor cores (16-bit
// models; after mimo.cu, whose MimoScan, mimo_place-free helpers and carry it shares).
// Compiled when MIMO_MMA is 1: ACT is bf16 or f16, P (MIMO_P) and N multiples of 16.
//
// A chunk holds L = 64/R rows, so that its (row t, rank r) pairs make 64 query rows
// m = t·R + r. Its keys and values are the same pairs plus the R of the row before the
// chunk (the look-back term): key rows j = (s + 1)·R + r', s = −1 … L−1, padded to 80. With
// Λ_t = Σ_{i≤t} a_i over the chunk, the recurrence h_t = α_t·h_{t−1} + β_t·w_{t−1} + γ_t·w_t
// unrolls to h_t = e^{Λ_t}·h_in + Σ_{s=−1}^{t} c(t,s)·w_s with
//   c(t,s) = [s ≥ 0]·γ_s·e^{Λ_t − Λ_s} + [s < t]·β_{s+1}·e^{Λ_t − Λ_{s+1}},
// so that per chunk and head:
//   local state  H = Σ_j c(L−1, s_j)·u_j k_jᵀ                     [P × 80]·[80 × N]
//   outputs      Y = (Q Kᵀ ⊙ C)·U + diag(e^{Λ_t})·Q·h_inᵀ + D·u   [64 × N]·[N × 80] …
// the products on wmma 16×16×16 tiles, f16 operands and f32 accumulators whatever the
// model's 16-bit dtype: bf16 operands (8 bits of mantissa) left the states of a bf16 model
// 3e-2 from the CPU's (H100), over the 1e-2 asked; f16 keeps 11 bits, and the operands
// (normed keys and queries, x·ψ, decayed states) stay far inside its range.
#if MIMO_MMA
#include <mma.h>
typedef __half mma_t;
__device__ __forceinline__ mma_t to_mma(float x) { return __float2half_rn(x); }

#define MMA_M 64
#define MMA_K 80
#define LDQ (D_STATE + 8)  // rows of Q, K, h_in
#define LDU (MIMO_P + 8)
#define LDS (MMA_K + 4)    // f32 scores
#define LDM (MMA_K + 8)    // masked scores, f16
#define MMA_L (MMA_M / MIMO_R)

// The shared memory of a chunk (the host's `mma_smem_bytes` computes the same size).
struct MimoTiles {
    mma_t* q;       // [64][LDQ]
    mma_t* k;       // [80][LDQ]
    mma_t* u;       // [80][LDU]
    float* s;       // [64][max(LDS, P + 4)]
    mma_t* m;       // [64][LDM]
    mma_t* h;       // [P][LDQ]
    float* lam;     // [L]: Λ_t
    float* beta;    // [L]
    float* gamma;   // [L]
};

__device__ __forceinline__ size_t mma_align(size_t b) { return (b + 127) & ~(size_t)127; }

__device__ MimoTiles mimo_tiles(char* smem) {
    MimoTiles t;
    size_t at = 0;
    t.q = reinterpret_cast<mma_t*>(smem + at);
    at = mma_align(at + MMA_M * LDQ * sizeof(mma_t));
    t.k = reinterpret_cast<mma_t*>(smem + at);
    at = mma_align(at + MMA_K * LDQ * sizeof(mma_t));
    t.u = reinterpret_cast<mma_t*>(smem + at);
    at = mma_align(at + MMA_K * LDU * sizeof(mma_t));
    t.s = reinterpret_cast<float*>(smem + at);
    const int lds = LDS > MIMO_P + 4 ? LDS : MIMO_P + 4;
    at = mma_align(at + MMA_M * lds * sizeof(float));
    t.m = reinterpret_cast<mma_t*>(smem + at);
    at = mma_align(at + MMA_M * LDM * sizeof(mma_t));
    t.h = reinterpret_cast<mma_t*>(smem + at);
    at = mma_align(at + MIMO_P * LDQ * sizeof(mma_t));
    t.lam = reinterpret_cast<float*>(smem + at);
    t.beta = t.lam + MMA_L;
    t.gamma = t.beta + MMA_L;
    return t;
}

// The rotated pair (n, n + N/2) of the key (`which` 0) or query (1) of head h, rank r at `row`.
__device__ __forceinline__ float2 mimo_pair(const MimoScan& p, size_t row, int h, int g, int r,
                                            int which, int n) {
    const int bcw = MIMO_R * p.groups * D_STATE, half = D_STATE / 2;
    const float* src = p.bcn + row * 2 * bcw + which * bcw + (r * p.groups + g) * D_STATE;
    const float* bias = (which ? p.c_bias : p.b_bias) + (h * MIMO_R + r) * D_STATE;
    float a = __ldg(src + n) + __ldg(bias + n), b = __ldg(src + n + half) + __ldg(bias + n + half);
    if (n < p.angles) {
        const float2 c = __ldg(p.cs + (row * p.heads + h) * p.angles + n);
        const float a0 = a;
        a = a0 * c.x - b * c.y;
        b = a0 * c.y + b * c.x;
    }
    return make_float2(a, b);
}

// c(t, s): the weight of w_s in h_t (s ≤ t; s = −1 the row before the chunk).
__device__ __forceinline__ float mimo_weight(const MimoTiles& sm, int t, int s) {
    float w = 0.f;
    if (s >= 0) w += sm.gamma[s] * expf(sm.lam[t] - sm.lam[s]);
    if (s < t) w += sm.beta[s + 1] * expf(sm.lam[t] - sm.lam[s + 1]);
    return w;
}

// The chunk's coefficients, keys and values in shared memory: Λ, β, γ per row; key and value
// rows j = (s + 1)·R + r' for s = −1 … len−1 (the look-back row from the state at a
// sequence's start, else from the row before), zero beyond. `c_end` ≥ 0: the values are
// scaled by c(c_end, s) (the local state's weights).
__device__ void mimo_load_kv(const MimoScan& p, const MimoTiles& sm, int c, int hd, int row0,
                             int len, bool seq_start, const float* st, int c_end) {
    const int g = hd / (p.heads / p.groups), half = D_STATE / 2;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        const float4 cf = __ldg(p.coef + (size_t)(row0 + t) * p.heads + hd);
        sm.lam[t] = cf.x;
        sm.beta[t] = cf.y;
        sm.gamma[t] = cf.z;
    }
    __syncthreads();
    if (threadIdx.x == 0)  // Λ: the prefix sums of a (at most 64)
        for (int t = 1; t < len; ++t) sm.lam[t] += sm.lam[t - 1];
    // keys
    for (int e = threadIdx.x; e < MMA_K * half; e += blockDim.x) {
        const int j = e / half, n = e % half, s = j / MIMO_R - 1, r = j % MIMO_R;
        float2 v = make_float2(0.f, 0.f);
        if (s < len) {
            if (s >= 0) {
                v = mimo_pair(p, row0 + s, hd, g, r, 0, n);
            } else if (seq_start) {
                const float* k = st + p.k_off + ((size_t)r * p.heads + hd) * D_STATE;
                v = make_float2(k[n], k[n + half]);
            } else {
                v = mimo_pair(p, row0 - 1, hd, g, r, 0, n);
            }
        }
        sm.k[j * LDQ + n] = to_mma(v.x);
        sm.k[j * LDQ + n + half] = to_mma(v.y);
    }
    __syncthreads();  // Λ, β, γ
    // values u = x ⊙ ψ_r, scaled by c(c_end, s) for the local state
    for (int e = threadIdx.x; e < MMA_K * MIMO_P; e += blockDim.x) {
        const int j = e / MIMO_P, pp = e % MIMO_P, s = j / MIMO_R - 1, r = j % MIMO_R;
        float v = 0.f;
        if (s < len) {
            float x;
            if (s >= 0)
                x = __ldg(p.proj + (size_t)(row0 + s) * p.ld + p.x_off + hd * MIMO_P + pp);
            else if (seq_start)
                x = st[p.v_off + hd * MIMO_P + pp];
            else
                x = __ldg(p.proj + (size_t)(row0 - 1) * p.ld + p.x_off + hd * MIMO_P + pp);
            v = x * __ldg(p.mimo_x + (hd * MIMO_R + r) * MIMO_P + pp);
            if (c_end >= 0) v *= mimo_weight(sm, c_end, s);
        }
        sm.u[j * LDU + pp] = to_mma(v);
    }
}

using namespace nvcuda;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> mimo_acc;

// Per (chunk, head): the chunk's state from zero, Σ_j c(len−1, s_j)·u_j k_jᵀ, into h_chunk
// (f32 [P, N]), and Λ_{len−1} into a_sum. Block 256 threads, dynamic shared memory.
extern "C" __global__ void mimo_mma_local(MimoScan p, const int* chunk_row0, const int* chunk_len,
                                          const int* chunk_seq, const int* seq_row0,
                                          const unsigned long long* seq_state, float* h_chunk,
                                          float* a_sum) {
    extern __shared__ __align__(128) char smem[];
    const MimoTiles sm = mimo_tiles(smem);
    const int c = blockIdx.x, hd = blockIdx.y;
    const int row0 = chunk_row0[c], len = chunk_len[c], s = chunk_seq[c];
    const float* st = reinterpret_cast<const float*>(seq_state[s]);
    mimo_load_kv(p, sm, c, hd, row0, len, row0 == seq_row0[s], st, len - 1);
    __syncthreads();
    float* out = h_chunk + ((size_t)c * p.heads + hd) * MIMO_P * D_STATE;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    // [P × 80]·[80 × N]: A = Uᵀ (u stored [80][P]: column-major P × 80), B = K row-major
    for (int tile = warp; tile < (MIMO_P / 16) * (D_STATE / 16); tile += warps) {
        const int ti = tile / (D_STATE / 16), tj = tile % (D_STATE / 16);
        mimo_acc acc;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < MMA_K; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::col_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::row_major> b;
            wmma::load_matrix_sync(a, sm.u + kk * LDU + ti * 16, LDU);
            wmma::load_matrix_sync(b, sm.k + kk * LDQ + tj * 16, LDQ);
            wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(out + (ti * 16) * D_STATE + tj * 16, acc, D_STATE,
                                wmma::mem_row_major);
    }
    if (threadIdx.x == 0) a_sum[(size_t)c * p.heads + hd] = sm.lam[len - 1];
}

// Per (chunk, head): y_r before the gate, f32 [rows, H, R, P], from the chunk's incoming
// state h_chunk[c] (the carry's). Block 256 threads, dynamic shared memory.
extern "C" __global__ void mimo_mma_out(MimoScan p, const int* chunk_row0, const int* chunk_len,
                                        const int* chunk_seq, const int* seq_row0,
                                        const unsigned long long* seq_state,
                                        const float* h_chunk, float* y) {
    extern __shared__ __align__(128) char smem[];
    const MimoTiles sm = mimo_tiles(smem);
    const int c = blockIdx.x, hd = blockIdx.y;
    const int row0 = chunk_row0[c], len = chunk_len[c], sq = chunk_seq[c];
    const int g = hd / (p.heads / p.groups), half = D_STATE / 2;
    const float* st = reinterpret_cast<const float*>(seq_state[sq]);
    mimo_load_kv(p, sm, c, hd, row0, len, row0 == seq_row0[sq], st, -1);
    // queries, rows m = t·R + r
    for (int e = threadIdx.x; e < MMA_M * half; e += blockDim.x) {
        const int m = e / half, n = e % half, t = m / MIMO_R, r = m % MIMO_R;
        float2 v = make_float2(0.f, 0.f);
        if (t < len) v = mimo_pair(p, row0 + t, hd, g, r, 1, n);
        sm.q[m * LDQ + n] = to_mma(v.x);
        sm.q[m * LDQ + n + half] = to_mma(v.y);
    }
    // the incoming state
    const float* h_in = h_chunk + ((size_t)c * p.heads + hd) * MIMO_P * D_STATE;
    for (int e = threadIdx.x; e < MIMO_P * D_STATE; e += blockDim.x)
        sm.h[(e / D_STATE) * LDQ + e % D_STATE] = to_mma(__ldg(h_in + e));
    __syncthreads();
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    // scores Q·Kᵀ [64 × 80]
    for (int tile = warp; tile < (MMA_M / 16) * (MMA_K / 16); tile += warps) {
        const int ti = tile / (MMA_K / 16), tj = tile % (MMA_K / 16);
        mimo_acc acc;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < D_STATE; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::col_major> b;
            wmma::load_matrix_sync(a, sm.q + ti * 16 * LDQ + kk, LDQ);
            wmma::load_matrix_sync(b, sm.k + tj * 16 * LDQ + kk, LDQ);
            wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(sm.s + ti * 16 * LDS + tj * 16, acc, LDS, wmma::mem_row_major);
    }
    __syncthreads();
    // masked and weighted: M = S ⊙ c(t, s); the queries scaled by e^{Λ_t} for h_in
    for (int e = threadIdx.x; e < MMA_M * MMA_K; e += blockDim.x) {
        const int m = e / MMA_K, j = e % MMA_K, t = m / MIMO_R, s = j / MIMO_R - 1;
        const float w = t < len && s <= t ? mimo_weight(sm, t, s) : 0.f;
        sm.m[m * LDM + j] = to_mma(sm.s[m * LDS + j] * w);
    }
    for (int e = threadIdx.x; e < MMA_M * D_STATE; e += blockDim.x) {
        const int m = e / D_STATE, n = e % D_STATE, t = m / MIMO_R;
        const float scale = t < len ? expf(sm.lam[t]) : 0.f;
        sm.q[m * LDQ + n] = to_mma(__half2float(sm.q[m * LDQ + n]) * scale);
    }
    __syncthreads();
    // Y = M·U + (e^Λ Q)·h_inᵀ [64 × P], into the score buffer (free again)
    const int ldy = MIMO_P + 4;
    float* ys = sm.s;
    for (int tile = warp; tile < (MMA_M / 16) * (MIMO_P / 16); tile += warps) {
        const int ti = tile / (MIMO_P / 16), tj = tile % (MIMO_P / 16);
        mimo_acc acc;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < MMA_K; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::row_major> b;
            wmma::load_matrix_sync(a, sm.m + ti * 16 * LDM + kk, LDM);
            wmma::load_matrix_sync(b, sm.u + kk * LDU + tj * 16, LDU);
            wmma::mma_sync(acc, a, b, acc);
        }
        for (int kk = 0; kk < D_STATE; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, mma_t, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, mma_t, wmma::col_major> b;
            wmma::load_matrix_sync(a, sm.q + ti * 16 * LDQ + kk, LDQ);
            wmma::load_matrix_sync(b, sm.h + tj * 16 * LDQ + kk, LDQ);
            wmma::mma_sync(acc, a, b, acc);
        }
        __syncwarp();
        wmma::store_matrix_sync(ys + ti * 16 * ldy + tj * 16, acc, ldy, wmma::mem_row_major);
    }
    __syncthreads();
    const float dskip = p.d_skip[hd];
    for (int e = threadIdx.x; e < len * MIMO_R * MIMO_P; e += blockDim.x) {
        const int m = e / MIMO_P, pp = e % MIMO_P, t = m / MIMO_R, r = m % MIMO_R;
        const size_t row = row0 + t;
        const float x = p.proj[row * p.ld + p.x_off + hd * MIMO_P + pp];
        const float u = x * p.mimo_x[(hd * MIMO_R + r) * MIMO_P + pp];
        y[((row * p.heads + hd) * MIMO_R + r) * MIMO_P + pp] = ys[m * ldy + pp] + dskip * u;
    }
}
#endif
