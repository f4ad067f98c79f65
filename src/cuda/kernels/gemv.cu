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
#if IN_PART(PART_ROWS)
GEMV_ENTRY(gemv_dmodel, D_MODEL)
GEMV_ENTRY(gemv_dinner, D_INNER)
#if MLP_HIDDEN > 0
GEMV_ENTRY(gemv_hidden, MLP_HIDDEN)
#endif
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
template <int NT, typename WT = w_t>
__device__ __forceinline__ void tc_kblock(float (&acc)[2][NT][4], uint4 wg, uint4 wg8, const WT* xhi,
                                          const WT* xlo, int ld, int k0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned a_lo[4] = {wg.x, wg8.x, wg.y, wg8.y};
    const unsigned a_hi[4] = {wg.z, wg8.z, wg.w, wg8.w};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const uint4 bh = *reinterpret_cast<const uint4*>(xhi + (8 * nt + g) * ld + k0 + 8 * t);
        const uint4 bl = *reinterpret_cast<const uint4*>(xlo + (8 * nt + g) * ld + k0 + 8 * t);
        mma16816_t<WT>(acc[0][nt], a_lo, bh.x, bh.y);
        mma16816_t<WT>(acc[0][nt], a_hi, bh.z, bh.w);
        mma16816_t<WT>(acc[1][nt], a_lo, bl.x, bl.y);
        mma16816_t<WT>(acc[1][nt], a_hi, bl.z, bl.w);
    }
}

// The shape of a K-wide tensor-core GEMV: 32-wide k blocks, how many each warp reduces,
// how many of them are loaded ahead (PFW per tile), the staged row stride.
template <int K> struct Tc {
    static_assert(K % 8 == 0, "16-byte weight loads");
    static constexpr int KB = KP(K) / 32;
    static constexpr int KBW = (KB + TC_WARPS - 1) / TC_WARPS;
    static constexpr int PFW = KBW < TC_PF ? KBW : TC_PF;
    static constexpr int LD = LDXS(K);
    // staged input float4s per thread (thread tid takes k = 4·(tid + 256·i) … + 3)
    static constexpr int KT = (KP(K) / 4 + TC_WARPS * 32 - 1) / (TC_WARPS * 32);
};

// Four 16-bit values, stored together.
template <typename T> struct __align__(8) Act4 {
    T v[4];
};

// The RMS norm weights of the thread's input elements, loaded ahead (0 without a norm).
template <int K>
__device__ __forceinline__ void tc_norm_ahead(float4 (&nwr)[Tc<K>::KT], const float* __restrict__ nw) {
#pragma unroll
    for (int i = 0; i < Tc<K>::KT; ++i) {
        const int k = 4 * (threadIdx.x + TC_WARPS * 32 * i);
        nwr[i] = nw && k < K ? __ldg(reinterpret_cast<const float4*>(nw + k)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// This warp's first PFW weight k blocks of the 16-row tile at n0 (rows g, g + 8), loaded
// ahead: they do not depend on the previous kernel or phase.
template <int K, typename WT = w_t>
__device__ __forceinline__ void tc_prefetch(uint4 (&pf)[Tc<K>::PFW][2], const WT* __restrict__ W, int N,
                                            int n0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const WT* wr0 = W + (size_t)min(n0 + g, N - 1) * K;
    const WT* wr1 = W + (size_t)min(n0 + g + 8, N - 1) * K;
#pragma unroll
    for (int i = 0; i < Tc<K>::PFW; ++i) {
        const int k = (warp + TC_WARPS * i) * 32 + 8 * t;
        const bool ok = warp + TC_WARPS * i < Tc<K>::KB && k < K;
        pf[i][0] = ok ? __ldg(reinterpret_cast<const uint4*>(wr0 + k)) : make_uint4(0, 0, 0, 0);
        pf[i][1] = ok ? __ldg(reinterpret_cast<const uint4*>(wr1 + k)) : make_uint4(0, 0, 0, 0);
    }
}

// The dynamic shared memory of a tensor-core GEMV: staged hi and lo rows, warp partials.
template <int K, int NT, typename WT = w_t>
__device__ __forceinline__ void tc_smem_parts(WT*& xhi, WT*& xlo, float*& red) {
    extern __shared__ __align__(16) unsigned char tc_smem[];
    xhi = reinterpret_cast<WT*>(tc_smem);
    xlo = xhi + 8 * NT * Tc<K>::LD;
    red = reinterpret_cast<float*>(xlo + 8 * NT * Tc<K>::LD);  // [TC_WARPS][16][NBP]
}

// Stage the input rows (nb of them, zero-padded to NBP = 8·NT and to KP(K)) in shared
// memory as hi and lo in act_t, four rows at a time: every load of the four rows first
// (float4s; thread tid takes k = 4·(tid + 256·i) …), then, for the RMS norm, the rows' sums
// of squares over the block, then the stores. Short code on purpose: it runs once per
// launch or phase, so its instruction fetches are part of the latency. The input is read
// through L2 (`__ldcg`): in the fused decode other blocks of the same launch wrote it.
template <int K, int NT, int mode, typename WT = w_t>
__device__ __forceinline__ void tc_stage(const float* in, const float4 (&nwr)[Tc<K>::KT], int nb, WT* xhi,
                                         WT* xlo) {
    constexpr int NBP = 8 * NT, LD = Tc<K>::LD, KT = Tc<K>::KT;
    __shared__ float s_part[TC_WARPS][NBP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int in_w = mode == 2 ? 2 * K : K;
    __syncthreads();  // the previous user of the buffers is done
    // padding rows past the last group of four
    const int z0 = (nb + 3) / 4 * 4;
    for (int e = z0 * LD / 8 + threadIdx.x; e < NBP * LD / 8; e += TC_WARPS * 32) {
        reinterpret_cast<uint4*>(xhi)[e] = make_uint4(0, 0, 0, 0);
        reinterpret_cast<uint4*>(xlo)[e] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll 1
    for (int b0 = 0; b0 < nb; b0 += 4) {
        float4 v[4][KT], gt[4][mode == 2 ? KT : 1];
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int i = 0; i < KT; ++i) {
                const int k = 4 * (threadIdx.x + TC_WARPS * 32 * i);
                const bool ok = b0 + b < nb && k < K;
                const size_t at = (size_t)(b0 + b) * in_w + k;
                const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
                float4& g = gt[b][mode == 2 ? i : 0];
                const float4* row = reinterpret_cast<const float4*>(in + at);
                v[b][i] = ok ? __ldcg(row) : zero;
                if (mode == 2) g = ok ? __ldcg(row + K / 4) : zero;
            }
        float scale[4] = {1.f, 1.f, 1.f, 1.f};
        if (mode == 1) {
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                float ss = 0.f;
#pragma unroll
                for (int i = 0; i < KT; ++i)
                    ss += v[b][i].x * v[b][i].x + v[b][i].y * v[b][i].y + v[b][i].z * v[b][i].z +
                          v[b][i].w * v[b][i].w;
                ss = warp_sum(ss);
                if (lane == 0) s_part[warp][b0 + b] = ss;
            }
            __syncthreads();
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                float t = 0.f;
#pragma unroll
                for (int w = 0; w < TC_WARPS; ++w) t += s_part[w][b0 + b];
                scale[b] = 1.f / sqrtf(t / (float)K + NORM_EPS);
            }
        }
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int i = 0; i < KT; ++i) {
                const int k = 4 * (threadIdx.x + TC_WARPS * 32 * i);
                if (k >= KP(K)) continue;
                float x[4] = {v[b][i].x, v[b][i].y, v[b][i].z, v[b][i].w};
                if (mode == 1) {
                    const float w4[4] = {nwr[i].x, nwr[i].y, nwr[i].z, nwr[i].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) x[j] = x[j] * scale[b] * w4[j];
                }
                if (mode == 2) {
                    const float4 g = gt[b][mode == 2 ? i : 0];
                    x[0] *= silu_f(g.x);
                    x[1] *= silu_f(g.y);
                    x[2] *= silu_f(g.z);
                    x[3] *= silu_f(g.w);
                }
                Act4<WT> hi, lo;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    hi.v[j] = from_f<WT>(x[j]);
                    lo.v[j] = from_f<WT>(x[j] - to_f(hi.v[j]));
                }
                *reinterpret_cast<Act4<WT>*>(xhi + (b0 + b) * LD + k) = hi;
                *reinterpret_cast<Act4<WT>*>(xlo + (b0 + b) * LD + k) = lo;
            }
    }
    __syncthreads();
}

// One 16-row tile at n0 against the staged rows: warp w reduces the k blocks w, w + 8, …
// (the first PFW from `pf`), the warps' partial sums meet in `red` and are added in warp
// order; out[b·ldo + n] (+)= the sum. With `acc_out`, thread e's old value of element
// e = 16·b + r is `prev` when `has_prev` (loaded ahead by `tc_prev`), else read here.
template <int K, int NT, typename WT = w_t>
__device__ __forceinline__ void tc_tile(const uint4 (&pf)[Tc<K>::PFW][2], const WT* __restrict__ W, int N,
                                        int n0, const WT* xhi, const WT* xlo, float* red,
                                        float* out, int ldo, int nb, int acc_out, float prev = 0.f,
                                        bool has_prev = false) {
    constexpr int NBP = 8 * NT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const WT* wr0 = W + (size_t)min(n0 + g, N - 1) * K;
    const WT* wr1 = W + (size_t)min(n0 + g + 8, N - 1) * K;
    float acc[2][NT][4];
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[s][nt][0] = acc[s][nt][1] = acc[s][nt][2] = acc[s][nt][3] = 0.f;
#pragma unroll
    for (int i = 0; i < Tc<K>::KBW; ++i) {
        const int kb = warp + TC_WARPS * i;
        if (kb >= Tc<K>::KB) break;
        uint4 w0, w1;
        if (i < Tc<K>::PFW) {
            w0 = pf[i < Tc<K>::PFW ? i : 0][0];
            w1 = pf[i < Tc<K>::PFW ? i : 0][1];
        } else {
            const int k = kb * 32 + 8 * t;
            w0 = k < K ? __ldg(reinterpret_cast<const uint4*>(wr0 + k)) : make_uint4(0, 0, 0, 0);
            w1 = k < K ? __ldg(reinterpret_cast<const uint4*>(wr1 + k)) : make_uint4(0, 0, 0, 0);
        }
        tc_kblock<NT, WT>(acc, w0, w1, xhi, xlo, Tc<K>::LD, kb * 32);
    }
    __syncthreads();  // `red` is free (a previous tile's sums are read)
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
        const float val = acc_out ? (has_prev && e == (int)threadIdx.x ? prev : __ldcg(o)) + s : s;
        *o = val;
    }
}

// The old value of the output element that `tc_tile` gives this thread (see there).
__device__ __forceinline__ float tc_prev(const float* out, int ldo, int nb, int N, int n0) {
    const int e = threadIdx.x, b = e / 16, n = n0 + e % 16;
    return e < 16 * nb && n < N ? __ldcg(out + (size_t)b * ldo + n) : 0.f;
}

// One tile per block: weights loaded, then the wait for the previous kernel.
template <int K, int NT, int mode>
__device__ __forceinline__ void gemv_tc_body(const float* in, const float* __restrict__ nw,
                                             const w_t* __restrict__ W, float* out, int ldo,
                                             int nb, int N, int acc_out) {
    const int n0 = blockIdx.x * 16;
    uint4 pf[Tc<K>::PFW][2];
    float4 nwr[Tc<K>::KT];
    tc_prefetch<K>(pf, W, N, n0);
    tc_norm_ahead<K>(nwr, mode == 1 ? nw : nullptr);
    griddep_wait();
    griddep_launch();
    act_t *xhi, *xlo;
    float* red;
    tc_smem_parts<K, NT>(xhi, xlo, red);
    tc_stage<K, NT, mode>(in, nwr, nb, xhi, xlo);
    tc_tile<K, NT>(pf, W, N, n0, xhi, xlo, red, out, ldo, nb, acc_out);
}

template <int K, int NT>
__device__ __forceinline__ void gemv_tc_modes(const float* in, const float* __restrict__ nw,
                                              const w_t* __restrict__ W, float* out, int ldo, int nb,
                                              int N, int mode, int acc) {
    if (mode == 0) gemv_tc_body<K, NT, 0>(in, nw, W, out, ldo, nb, N, acc);
    else if (mode == 1) gemv_tc_body<K, NT, 1>(in, nw, W, out, ldo, nb, N, acc);
    else gemv_tc_body<K, NT, 2>(in, nw, W, out, ldo, nb, N, acc);
}

// Shared memory of a tensor-core GEMV launch with input width K (read by the host).
#define TC_SMEM(K, NT) (2 * 8 * (NT) * LDXS(K) * (int)sizeof(act_t) + TC_WARPS * 16 * 8 * (NT) * 4)

#define GEMV_TC_ENTRY(name, KW)                                                                 \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32)                                \
        name(const float* __restrict__ in, const float* __restrict__ nw, const w_t* __restrict__ W, \
             float* __restrict__ out, int ldo, int nb, int N, int mode, int acc) {             \
        if (nb <= 8) gemv_tc_modes<KW, 1>(in, nw, W, out, ldo, nb, N, mode, acc);              \
        else gemv_tc_modes<KW, 2>(in, nw, W, out, ldo, nb, N, mode, acc);                      \
    }                                                                                          \
    extern "C" __device__ int name##_smem8 = TC_SMEM(KW, 1);                                   \
    extern "C" __device__ int name##_smem16 = TC_SMEM(KW, 2);
#if D_MODEL % 8 == 0 && IN_PART(PART_TC_DMODEL)
GEMV_TC_ENTRY(gemv_tc_dmodel, D_MODEL)
#endif
#if D_INNER % 8 == 0 && IN_PART(PART_TC_WIDE)
GEMV_TC_ENTRY(gemv_tc_dinner, D_INNER)
#endif
#if MLP_HIDDEN > 0 && MLP_HIDDEN % 8 == 0 && IN_PART(PART_TC_WIDE)
GEMV_TC_ENTRY(gemv_tc_hidden, MLP_HIDDEN)
#endif
#endif
