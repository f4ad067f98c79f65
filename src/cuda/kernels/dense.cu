// Row-wise kernels around the GEMMs: embedding lookup, RMSNorm (spec §2.7), the GatedMLP
// activation, and the weight-streaming GEMV that decode uses for small batches.
// CPU twins: the embedding loop and `norm_rows` in src/cpu/forward.rs, `rms_norm` in
// src/cpu/math.rs, `matmul_t` in src/cpu/matmul.rs.

// res[r] = E[tokens[r]] (f32). One block per row.
extern "C" __global__ void embed(const unsigned* __restrict__ tokens, const w_t* __restrict__ E,
                                 float* __restrict__ res) {
    griddep_wait();
    griddep_launch();
    const w_t* e = E + (size_t)tokens[blockIdx.x] * D_MODEL;
    float* o = res + (size_t)blockIdx.x * D_MODEL;
    for (int i = threadIdx.x; i < D_MODEL; i += blockDim.x) o[i] = to_f(e[i]);
}

// out[r] = x[src_r] / sqrt(mean(x[src_r]²) + eps) ⊙ w, as act_t, one warp per row
// (src_r = rows_idx ? rows_idx[r] : r). With `split` (bf16/f16 only) the row is written as
// [hi | lo], hi = round(v), lo = round(v − hi), 2·D_MODEL wide: a GEMM against [W | W]
// then sees the f32 value to ~2⁻¹⁶ (the in_proj input is the activation whose rounding
// costs the most accuracy; see docs/benchmarks.md).
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                         act_t* __restrict__ out, int rows,
                                         const int* __restrict__ rows_idx, int split) {
    griddep_wait();
    griddep_launch();
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    int src = rows_idx ? rows_idx[r] : r;
    const float* xr = x + (size_t)src * D_MODEL;
    float ss = 0.f;
    for (int i = lane; i < D_MODEL; i += 32) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    float inv = 1.f / sqrtf(ss / (float)D_MODEL + NORM_EPS);
    act_t* o = out + (size_t)r * (split ? 2 * D_MODEL : D_MODEL);
    for (int i = lane; i < D_MODEL; i += 32) {
        float v = xr[i] * inv * w[i];
        act_t hi = from_f<act_t>(v);
        o[i] = hi;
        if (split) o[D_MODEL + i] = from_f<act_t>(v - to_f(hi));
    }
}

#if MLP_HIDDEN > 0
// GatedMLP activation: act[r][i] = vg[r][i] · silu(vg[r][MLP_HIDDEN + i]).
extern "C" __global__ void swiglu_rows(const float* __restrict__ vg, act_t* __restrict__ act,
                                       int rows) {
    griddep_wait();
    griddep_launch();
    size_t n = (size_t)rows * MLP_HIDDEN;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t r = e / MLP_HIDDEN, i = e % MLP_HIDDEN;
        const float* row = vg + r * 2 * MLP_HIDDEN;
        act[e] = from_f<act_t>(row[i] * silu_f(row[MLP_HIDDEN + i]));
    }
}
#endif

// ---------------------------------------------------------------------------------------
// Decode GEMV: out[b·ldo + n] (+)= Σ_k in'[b][k] · W[n][k] for b < nb, n < N, with the input
// transformed on the way in (f32 throughout, weights widened from w_t):
//   mode 0: in' = in                (in row width K)
//   mode 1: in' = rmsnorm(in) ⊙ nw  (in row width K, residual rows)
//   mode 2: in' = v ⊙ silu(g)       (in row width 2K: [v | g], the GatedMLP)
// One warp per output row; the block stages GEMV_BG input rows in shared memory at a time.
// Each output element is reduced in a fixed order whatever the batch, so a sequence's
// result does not depend on what else is in the batch.
#define GEMV_WARPS 8
#define GEMV_BG 4
// 16-byte weight chunks per lane held in registers: the whole row when it fits, loaded
// before waiting for the previous kernel (weights do not depend on it).
#define GEMV_PF 8

// a[b] += Σ_i w[k0 + i] · xs[b][k0 + i] over one 16-byte chunk of weights.
__device__ __forceinline__ void gemv_chunk(uint4 raw, int k0, const float* xs, int K, int bg,
                                           float* a) {
    constexpr int VEC = 16 / sizeof(w_t);
    const w_t* wv = reinterpret_cast<const w_t*>(&raw);
#pragma unroll
    for (int b = 0; b < GEMV_BG; ++b) {
        if (b >= bg) break;
        const float4* xv = reinterpret_cast<const float4*>(xs + b * K + k0);
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
            const float4 x4 = xv[q];
            a[b] += to_f(wv[4 * q]) * x4.x + to_f(wv[4 * q + 1]) * x4.y + to_f(wv[4 * q + 2]) * x4.z +
                    to_f(wv[4 * q + 3]) * x4.w;
        }
    }
}

template <int K>
__device__ __forceinline__ void gemv_body(const float* __restrict__ in, const float* __restrict__ nw,
                                          const w_t* __restrict__ W, float* __restrict__ out, int ldo,
                                          int nb, int N, int mode, int acc) {
    extern __shared__ float xs[];  // [GEMV_BG][K]
    __shared__ float red[32];
    static_assert(K > 0, "empty GEMV");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * GEMV_WARPS + warp;
    constexpr int VEC = 16 / sizeof(w_t);
    constexpr bool vec_ok = (K % VEC) == 0;
    constexpr int CHUNKS = (K + 32 * VEC - 1) / (32 * VEC);
    constexpr bool keep = vec_ok && CHUNKS <= GEMV_PF;
    const w_t* wr = W + (size_t)min(n, N - 1) * K;
    uint4 wreg[keep ? CHUNKS : 1];
#pragma unroll
    for (int it = 0; it < (keep ? CHUNKS : 0); ++it) {
        const int k0 = (it * 32 + lane) * VEC;
        if (keep && k0 < K) wreg[it] = __ldg(reinterpret_cast<const uint4*>(wr + k0));
    }
    griddep_wait();
    griddep_launch();
    const int in_w = mode == 2 ? 2 * K : K;
    for (int b0 = 0; b0 < nb; b0 += GEMV_BG) {
        const int bg = min(GEMV_BG, nb - b0);
        __syncthreads();
        for (int b = 0; b < bg; ++b) {
            const float* row = in + (size_t)(b0 + b) * in_w;
            float scale = 1.f;
            if (mode == 1) {
                float ss = 0.f;
                for (int k = threadIdx.x; k < K; k += blockDim.x) ss += row[k] * row[k];
                ss = block_sum(ss, red);
                scale = 1.f / sqrtf(ss / (float)K + NORM_EPS);
            }
            for (int k = threadIdx.x; k < K; k += blockDim.x) {
                float v = row[k];
                if (mode == 1) v = v * scale * nw[k];
                if (mode == 2) v = v * silu_f(row[K + k]);
                xs[b * K + k] = v;
            }
        }
        __syncthreads();
        if (n >= N) continue;
        float a[GEMV_BG];
#pragma unroll
        for (int b = 0; b < GEMV_BG; ++b) a[b] = 0.f;
        if (keep) {
#pragma unroll
            for (int it = 0; it < (keep ? CHUNKS : 0); ++it) {
                const int k0 = (it * 32 + lane) * VEC;
                if (k0 < K) gemv_chunk(wreg[it], k0, xs, K, bg, a);
            }
        } else if (vec_ok) {
#pragma unroll 4
            for (int k0 = lane * VEC; k0 < K; k0 += 32 * VEC)
                gemv_chunk(__ldg(reinterpret_cast<const uint4*>(wr + k0)), k0, xs, K, bg, a);
        } else {
            for (int k = lane; k < K; k += 32) {
                float wf = to_f(wr[k]);
#pragma unroll
                for (int b = 0; b < GEMV_BG; ++b)
                    if (b < bg) a[b] += wf * xs[b * K + k];
            }
        }
#pragma unroll
        for (int b = 0; b < GEMV_BG; ++b) {
            float s = warp_sum(a[b]);
            if (lane == 0 && b < bg) {
                float* o = out + (size_t)(b0 + b) * ldo + n;
                *o = acc ? *o + s : s;
            }
        }
    }
}

// One entry point per input width (all compile-time constants of the model).
#define GEMV_ENTRY(name, KW)                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                             \
        name(const float* __restrict__ in, const float* __restrict__ nw, const w_t* __restrict__ W, \
             float* __restrict__ out, int ldo, int nb, int N, int mode, int acc) {            \
        gemv_body<KW>(in, nw, W, out, ldo, nb, N, mode, acc);                                 \
    }
GEMV_ENTRY(gemv_dmodel, D_MODEL)
GEMV_ENTRY(gemv_dinner, D_INNER)
#if MLP_HIDDEN > 0
GEMV_ENTRY(gemv_hidden, MLP_HIDDEN)
#endif
