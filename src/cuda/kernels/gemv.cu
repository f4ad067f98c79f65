// The decode GEMVs: out[b·ldo + n] (+)= Σ_k in'[b][k] · W[n][k] for b < nb ≤ 16, with the
// input transformed on the way in. CPU twin: `matmul_t` in src/cpu/matmul.rs (with
// `rms_norm` of src/cpu/math.rs and the GatedMLP activation before it). Two versions:
//   gemv_*     one warp per output row, f32 FMA (f32 models; any shape);
//   gemv_tc_*  16-bit models: mma.sync on tensor cores, the input split into hi + lo
//              halves in the weights' dtype so that it counts to ~2⁻¹⁶, like f32.
// In both, each output element is reduced in a fixed order whatever the batch, so a
// sequence's result does not depend on what else is in the batch.

// ---- the f32 GEMV (f32 models, and shapes the tensor-core one does not take) ------------
// out[b·ldo + n] (+)= Σ_k in'[b][k] · W[n][k] for b < nb, n < N, with the input
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

#if ACT != 0
// ---- the tensor-core GEMV ---------------------------------------------------------------
// Block: 8 warps and 16 output rows. The input rows (nb ≤ 16, padded with zeros to NBP = 8
// or 16 and to KP = K rounded up to 32) are staged once in shared memory as hi and lo in
// act_t; warp w then reduces the 32-wide k blocks w, w + 8, …; the warps' partial sums
// meet in shared memory and are added in warp order.
//
// mma.sync m16n8k16, A = 16 weight rows × 16 k, B = 16 k × 8 input rows. Inside a 32-wide
// k block, lane (g = lane/4, t = lane%4) loads 16 bytes of weight rows g and g+8 at
// k = 8t … 8t+7 (coalesced), and the two MMAs of the block take k = 8t+{0,1,2,3} and
// 8t+{4,5,6,7} as their fragment's (2t, 2t+1, 2t+8, 2t+9): a permutation of k that the
// B fragments (the staged input at the same k) follow, so the sum is unchanged.
#define TC_WARPS 8
#define TC_PF 8  // k blocks per warp whose weights are loaded before the wait
#define KP(K) (((K) + 31) / 32 * 32)
// staged row stride (elements): ≡ 32 mod 64, so the 16-byte loads of 8 lanes hit 32 banks
#define LDXS(K) (KP(K) % 64 == 0 ? KP(K) + 32 : KP(K))


// acc[tile] += W rows (n0 + g, n0 + g + 8) · staged input, one 32-wide k block.
template <int NT>
__device__ __forceinline__ void tc_kblock(float (&acc)[2][NT][4], uint4 wg, uint4 wg8, const act_t* xhi,
                                          const act_t* xlo, int ld, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned a_lo[4] = {wg.x, wg8.x, wg.y, wg8.y};
    const unsigned a_hi[4] = {wg.z, wg8.z, wg.w, wg8.w};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const uint4 bh = *reinterpret_cast<const uint4*>(xhi + (8 * nt + g) * ld + k0 + 8 * t);
        const uint4 bl = *reinterpret_cast<const uint4*>(xlo + (8 * nt + g) * ld + k0 + 8 * t);
        mma16816(acc[0][nt], a_lo, bh.x, bh.y);
        mma16816(acc[0][nt], a_hi, bh.z, bh.w);
        mma16816(acc[1][nt], a_lo, bl.x, bl.y);
        mma16816(acc[1][nt], a_hi, bl.z, bl.w);
    }
}

template <int K, int NT>
__device__ __forceinline__ void gemv_tc_body(const float* __restrict__ in, const float* __restrict__ nw,
                                             const w_t* __restrict__ W, float* __restrict__ out, int ldo,
                                             int nb, int N, int mode, int acc_out) {
    static_assert(K % 8 == 0, "16-byte weight loads");
    constexpr int KB = KP(K) / 32, KBW = (KB + TC_WARPS - 1) / TC_WARPS, LD = LDXS(K), NBP = 8 * NT;
    extern __shared__ __align__(16) unsigned char tc_smem[];
    act_t* xhi = reinterpret_cast<act_t*>(tc_smem);
    act_t* xlo = xhi + NBP * LD;
    float* red = reinterpret_cast<float*>(xlo + NBP * LD);  // [TC_WARPS][16][NBP]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    const w_t* wr0 = W + (size_t)min(n0 + g, N - 1) * K;
    const w_t* wr1 = W + (size_t)min(n0 + g + 8, N - 1) * K;
    // This warp's first weight blocks, before waiting for the previous kernel.
    uint4 wpf[TC_PF < KBW ? TC_PF : KBW][2];
#pragma unroll
    for (int i = 0; i < (TC_PF < KBW ? TC_PF : KBW); ++i) {
        const int k = (warp + TC_WARPS * i) * 32 + 8 * t;
        const bool ok = warp + TC_WARPS * i < KB && k < K;
        wpf[i][0] = ok ? __ldg(reinterpret_cast<const uint4*>(wr0 + k)) : make_uint4(0, 0, 0, 0);
        wpf[i][1] = ok ? __ldg(reinterpret_cast<const uint4*>(wr1 + k)) : make_uint4(0, 0, 0, 0);
    }
    griddep_wait();
    griddep_launch();
    // Stage the input rows, all threads together (thread tid takes k = tid + 256·i of
    // every row, so that every load of a pass is in flight at once). The RMS norm's sums
    // of squares come first, reduced over the block for all rows at once.
    __shared__ float s_part[TC_WARPS][NBP], s_scale[NBP];
    constexpr int KT = (KP(K) + TC_WARPS * 32 - 1) / (TC_WARPS * 32);
    const int in_w = mode == 2 ? 2 * K : K;
    if (mode == 1) {
        float ss[NBP];
#pragma unroll
        for (int b = 0; b < NBP; ++b) {
            ss[b] = 0.f;
#pragma unroll
            for (int i = 0; i < KT; ++i) {
                const int k = threadIdx.x + TC_WARPS * 32 * i;
                if (b < nb && k < K) {
                    const float v = in[(size_t)b * in_w + k];
                    ss[b] += v * v;
                }
            }
        }
#pragma unroll
        for (int b = 0; b < NBP; ++b) {
            const float t = warp_sum(ss[b]);
            if (lane == 0) s_part[warp][b] = t;
        }
        __syncthreads();
        if (threadIdx.x < NBP) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < TC_WARPS; ++w) t += s_part[w][threadIdx.x];
            s_scale[threadIdx.x] = 1.f / sqrtf(t / (float)K + NORM_EPS);
        }
        __syncthreads();
    }
    // Four rows at a time: every load first (into registers), then the stores — shared
    // stores between them would keep the compiler from issuing the loads together.
#pragma unroll 1
    for (int b0 = 0; b0 < NBP; b0 += 4) {
        float v[4][KT], gt[4][KT];
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int i = 0; i < KT; ++i) {
                const int k = threadIdx.x + TC_WARPS * 32 * i;
                const bool ok = b0 + b < nb && k < K;
                const float* row = in + (size_t)(b0 + b) * in_w;
                v[b][i] = ok ? row[k] : 0.f;
                gt[b][i] = ok && mode == 2 ? row[K + k] : 0.f;
            }
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int i = 0; i < KT; ++i) {
                const int k = threadIdx.x + TC_WARPS * 32 * i;
                if (k >= KP(K)) continue;
                float x = v[b][i];
                if (mode == 1 && k < K) x = x * s_scale[b0 + b] * nw[k];
                if (mode == 2) x = x * silu_f(gt[b][i]);
                const act_t hi = from_f<act_t>(x);
                xhi[(b0 + b) * LD + k] = hi;
                xlo[(b0 + b) * LD + k] = from_f<act_t>(x - to_f(hi));
            }
    }
    __syncthreads();
    float acc[2][NT][4];
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[s][nt][0] = acc[s][nt][1] = acc[s][nt][2] = acc[s][nt][3] = 0.f;
#pragma unroll
    for (int i = 0; i < KBW; ++i) {
        const int kb = warp + TC_WARPS * i;
        if (kb >= KB) break;
        uint4 w0, w1;
        if (i < TC_PF) {
            w0 = wpf[i < TC_PF ? i : 0][0];
            w1 = wpf[i < TC_PF ? i : 0][1];
        } else {
            const int k = kb * 32 + 8 * t;
            w0 = k < K ? __ldg(reinterpret_cast<const uint4*>(wr0 + k)) : make_uint4(0, 0, 0, 0);
            w1 = k < K ? __ldg(reinterpret_cast<const uint4*>(wr1 + k)) : make_uint4(0, 0, 0, 0);
        }
        tc_kblock<NT>(acc, w0, w1, xhi, xlo, LD, kb * 32);
    }
    // Partial sums of this warp: rows g, g + 8, input rows 2t, 2t + 1 of each tile.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float* r = red + warp * 16 * NBP;
        const int c = 8 * nt + 2 * t;
        r[g * NBP + c] = acc[0][nt][0] + acc[1][nt][0];
        r[g * NBP + c + 1] = acc[0][nt][1] + acc[1][nt][1];
        r[(g + 8) * NBP + c] = acc[0][nt][2] + acc[1][nt][2];
        r[(g + 8) * NBP + c + 1] = acc[0][nt][3] + acc[1][nt][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * nb; e += TC_WARPS * 32) {
        const int b = e / 16, r = e % 16, n = n0 + r;
        if (n >= N) continue;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < TC_WARPS; ++w) s += red[(w * 16 + r) * NBP + b];
        float* o = out + (size_t)b * ldo + n;
        *o = acc_out ? *o + s : s;
    }
}

// Shared memory of a tensor-core GEMV launch with input width K (read by the host).
#define TC_SMEM(K, NT) (2 * 8 * (NT) * LDXS(K) * (int)sizeof(act_t) + TC_WARPS * 16 * 8 * (NT) * 4)

#define GEMV_TC_ENTRY(name, KW)                                                                 \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32)                                \
        name(const float* __restrict__ in, const float* __restrict__ nw, const w_t* __restrict__ W, \
             float* __restrict__ out, int ldo, int nb, int N, int mode, int acc) {             \
        if (nb <= 8) gemv_tc_body<KW, 1>(in, nw, W, out, ldo, nb, N, mode, acc);               \
        else gemv_tc_body<KW, 2>(in, nw, W, out, ldo, nb, N, mode, acc);                       \
    }                                                                                          \
    extern "C" __device__ int name##_smem8 = TC_SMEM(KW, 1);                                   \
    extern "C" __device__ int name##_smem16 = TC_SMEM(KW, 2);
#if D_MODEL % 8 == 0
GEMV_TC_ENTRY(gemv_tc_dmodel, D_MODEL)
#endif
#if D_INNER % 8 == 0
GEMV_TC_ENTRY(gemv_tc_dinner, D_INNER)
#endif
#if MLP_HIDDEN > 0 && MLP_HIDDEN % 8 == 0
GEMV_TC_ENTRY(gemv_tc_hidden, MLP_HIDDEN)
#endif
#endif
