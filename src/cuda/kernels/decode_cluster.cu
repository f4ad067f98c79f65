// Every layer of a one-sequence decode step in one launch, as thread-block clusters: one
// cluster of CL_BLOCKS blocks per head, one block per SM (16-bit models without an MLP or
// an output norm; `GpuOptions::cluster_decode`, off by default: an experiment until it is
// measured). CPU twin: the layer loop of `CpuModel::forward` with one token.
//
// Why: kernels/decode_layers.cu meets the whole grid three times per layer (in_proj, mixer,
// out_proj), and each meeting plus the staging after it costs ≈ 2 µs. Here the grid meets
// once per layer; the rest is inside a cluster, through distributed shared memory and
// cluster barriers. Per layer, in cluster h, block c:
//  1. residual: r ← r + Σ_h' p_h' (the previous layer's out_proj share of every head, in
//     head order, so every cluster computes the same r): block c its slice of CL_SLICE
//     values and their sum of squares; after the cluster meets, every block gathers the
//     whole normed row (RMSNorm, spec §2.1) from the slices;
//  2. in_proj: the CL_ROWS rows of head h's mixer (its z, x, Δ, A, λ; and B, C and the
//     angles, which every cluster computes for itself), CL_RPB per block, from weights
//     copied to shared memory a layer ahead; written to the cluster's own in_proj row;
//  3. the mixer (`mixer_run`, kernels/step.cu), state rows c·CL_YR … of the head;
//  4. out_proj share: p_h = W_o[:, h's columns] · y_h, each block over its CL_YR outputs,
//     summed inside the cluster, written for the next layer's step 1 (two buffers by layer
//     parity: a fast cluster writes the next layer's shares while a slow one may still read
//     this layer's); then the block arrives at the counter the next layer waits for.
// The shares and the residual are summed in another order than out_proj's GEMV sums, so
// the result differs from kernels/decode_layers.cu in the last bits.

#ifndef CL_BLOCKS
#define CL_BLOCKS 4
#endif
#define CL_ROWS (2 * HEADDIM + 2 * DSTATE + 3 + NANGLES)  // in_proj rows of one head's mixer
#define CL_RPB ((CL_ROWS + CL_BLOCKS - 1) / CL_BLOCKS)    // of them per block
#define CL_SLICE (D_MODEL / CL_BLOCKS)                    // residual values per block
#define CL_YR (HEADDIM / CL_BLOCKS)                       // state rows and outputs per block
#define CL_RW 4                                           // in_proj rows a warp sums at once

// (clusters are Hopper's: sm_90 and newer)
#if ACT != 0 && MLP_HIDDEN == 0 && OUTNORM == 0 && D_MODEL % 8 == 0 && D_INNER % 8 == 0 && \
    D_MODEL % CL_BLOCKS == 0 && HEADDIM % CL_BLOCKS == 0 && CL_YR % 8 == 0 && __CUDA_ARCH__ >= 900

// Dynamic shared memory: the in_proj rows, the out_proj columns, the normed residual row,
// this block's out_proj share, its residual slice and its sum of squares.
#define CL_W_IN 0
#define CL_W_OUT (CL_W_IN + CL_RPB * D_MODEL * 2)
#define CL_XN (CL_W_OUT + D_MODEL * CL_YR * 2)
#define CL_PART (CL_XN + D_MODEL * 4)
#define CL_SLICE_AT (CL_PART + D_MODEL * 4)
#define CL_SUMS (CL_SLICE_AT + CL_SLICE * 4)
#define CL_SMEM (CL_SUMS + 16)
extern "C" __device__ int decode_cluster_smem = CL_SMEM;
extern "C" __device__ int decode_cluster_blocks = CL_BLOCKS;

__device__ __forceinline__ void cl_copy16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src)
                 : "memory");
}

// The in_proj column of row r of head h's mixer: z, x (its own), B, C (its group's), then
// Δ, A, λ (its own) and the angles (shared by every head).
__device__ __forceinline__ int cl_row(int r, int h) {
    const int g = h / HEADS_PER_GROUP;
    if (r < HEADDIM) return Z_OFF + h * HEADDIM + r;
    r -= HEADDIM;
    if (r < HEADDIM) return X_OFF + h * HEADDIM + r;
    r -= HEADDIM;
    if (r < DSTATE) return B_OFF + g * DSTATE + r;
    r -= DSTATE;
    if (r < DSTATE) return C_OFF + g * DSTATE + r;
    r -= DSTATE;
    if (r == 0) return DT_OFF + h;
    if (r == 1) return A_OFF + h;
    if (r == 2) return TRAP_OFF + h;
    return ANG_OFF + r - 3;
}

// Copy block c's in_proj rows of head h (W: the layer's in_proj) to `dst`, asynchronously.
__device__ __forceinline__ void cl_fetch_in(w_t* dst, const w_t* W, int h, int c) {
    constexpr int PIECES = D_MODEL / 8;  // 16 bytes each
    const int r0 = c * CL_RPB, n = min(CL_RPB, CL_ROWS - r0);
    for (int i = threadIdx.x; i < n * PIECES; i += blockDim.x) {
        const int r = i / PIECES, k = 8 * (i % PIECES);
        cl_copy16(dst + (size_t)r * D_MODEL + k, W + (size_t)cl_row(r0 + r, h) * D_MODEL + k);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Copy W_o[:, h·HEADDIM + c·CL_YR …] (D_MODEL rows of CL_YR) to `dst`, asynchronously.
__device__ __forceinline__ void cl_fetch_out(w_t* dst, const w_t* W, int h, int c) {
    constexpr int PIECES = CL_YR / 8;
    const int col = h * HEADDIM + c * CL_YR;
    for (int i = threadIdx.x; i < D_MODEL * PIECES; i += blockDim.x) {
        const int row = i / PIECES, k = 8 * (i % PIECES);
        cl_copy16(dst + (size_t)row * CL_YR + k, W + (size_t)row * D_INNER + col + k);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Wait (poller thread 32, then the block) until `count` reaches `all`. The clusters cannot
// wait for one that is not resident: after 2 s the kernel traps (an error, not a hang);
// the host launches only when every cluster fits at once. `seen`, when not null, gets the
// time the poller saw it (the trace below).
__device__ __forceinline__ void cl_wait(const unsigned long long* count, unsigned long long all,
                                        unsigned long long* seen) {
    if (threadIdx.x == 32) {
        const unsigned long long t0 = global_ns();
        while (load_acquire(count) < all) {
            if (global_ns() - t0 > 2000000000ull) __trap();
        }
        if (seen) *seen = global_ns();
    }
    __syncthreads();
}

// MAMBA3_GPU_TRACE (a diagnostic): per (layer, block) CL_MARKS times in ns of the global
// timer — the layer entered, the previous layer's shares seen, the normed row and the
// weights in, the head's in_proj row whole, the mixer done, the arrival.
#define CL_MARKS 6
#define CL_MARK(k)                                                                                 \
    do {                                                                                           \
        if (trace && tid == 0) trace[((size_t)l * gridDim.x + blockIdx.x) * CL_MARKS + (k)] = global_ns(); \
    } while (0)

// res: the embedded row (D_MODEL f32), left as the last layer's output; cproj: NHEADS
// in_proj rows (PROJ_LD apart), one per cluster; shares: 2 × NHEADS × D_MODEL f32; yf: the
// gated mixer output (D_INNER f32); sync: two zeroed counters (the fused decode's, Work::sync),
// zero again at the end; trace: null, or n_layers × grid × CL_MARKS times (above).
extern "C" __global__ void __launch_bounds__(STEP_THREADS, 1)
    decode_cluster(const LayerW* __restrict__ layers, int n_layers, float* res, float* cproj,
                   float* shares, float* yf, float* const* __restrict__ states,
                   unsigned long long* sync, unsigned long long* trace) {
    extern __shared__ __align__(16) unsigned char cl_dyn[];
    __shared__ StepSmem sm;
    w_t* w_in = reinterpret_cast<w_t*>(cl_dyn + CL_W_IN);
    w_t* w_out = reinterpret_cast<w_t*>(cl_dyn + CL_W_OUT);
    float* xn = reinterpret_cast<float*>(cl_dyn + CL_XN);
    float* part = reinterpret_cast<float*>(cl_dyn + CL_PART);
    float* slice = reinterpret_cast<float*>(cl_dyn + CL_SLICE_AT);
    float* sums = reinterpret_cast<float*>(cl_dyn + CL_SUMS);
    const int c = (int)cl_rank(), h = (int)blockIdx.x / CL_BLOCKS, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int p0 = c * CL_YR, p1 = p0 + CL_YR;
    const unsigned long long grid = gridDim.x;
    float* prow = cproj + (size_t)h * PROJ_LD;

    cl_fetch_in(w_in, layers[0].in_proj, h, c);
    cl_fetch_out(w_out, layers[0].out_proj, h, c);
    griddep_wait();
    for (int i = tid; i < CL_SLICE; i += blockDim.x) slice[i] = res[c * CL_SLICE + i];
    for (int l = 0; l < n_layers; ++l) {
        const LayerW w = layers[l];
        CL_MARK(0);
        // before anything of this layer is written: the head's k, v, φ and state rows
        StepHead hd;
        mixer_head(hd, states, l, h, 0);
        StepAhead ah;
        mixer_ahead(ah, w.mix, states, l, h, 0, p0, p1);
        // ---- 1. the residual and its norm
        if (l > 0) {
            cl_wait(sync, (unsigned long long)l * grid,
                    trace ? trace + ((size_t)l * gridDim.x + blockIdx.x) * CL_MARKS + 1 : nullptr);
            const float* sh = shares + (size_t)((l - 1) & 1) * NHEADS * D_MODEL + c * CL_SLICE;
            for (int i = tid; i < CL_SLICE; i += blockDim.x) {
                float v = slice[i];
                for (int hh = 0; hh < NHEADS; ++hh) v += __ldcg(sh + (size_t)hh * D_MODEL + i);
                slice[i] = v;
            }
        }
        float ss = 0.f;
        for (int i = tid; i < CL_SLICE; i += blockDim.x) ss += slice[i] * slice[i];
        ss = block_sum(ss, sm.red);
        if (tid == 0) sums[0] = ss;
        cl_meet();
        float tot = 0.f;
        for (int r = 0; r < CL_BLOCKS; ++r) tot += cl_load(sums, r);
        const float inv = 1.f / sqrtf(tot / (float)D_MODEL + NORM_EPS);
        for (int e = tid; e < D_MODEL; e += blockDim.x)
            xn[e] = cl_load(slice + e % CL_SLICE, e / CL_SLICE) * inv * w.norm[e];
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        CL_MARK(2);
        // ---- 2. this block's in_proj rows: each warp CL_RW rows at a time, so that the
        // row sums' shuffles overlap (and each xn value read serves CL_RW rows)
        {
            const int r0 = c * CL_RPB, n = min(CL_RPB, CL_ROWS - r0);
            for (int rb = CL_RW * warp; rb < n; rb += CL_RW * STEP_WARPS) {
                float acc[CL_RW];
#pragma unroll
                for (int q = 0; q < CL_RW; ++q) acc[q] = 0.f;
                for (int k = 8 * lane; k < D_MODEL; k += 256) {
                    const float4 a = *reinterpret_cast<const float4*>(xn + k);
                    const float4 b = *reinterpret_cast<const float4*>(xn + k + 4);
#pragma unroll
                    for (int q = 0; q < CL_RW; ++q) {
                        if (rb + q >= n) break;
                        const uint4 u = *reinterpret_cast<const uint4*>(w_in + (size_t)(rb + q) * D_MODEL + k);
                        const w_t* e = reinterpret_cast<const w_t*>(&u);
                        acc[q] += to_f(e[0]) * a.x + to_f(e[1]) * a.y + to_f(e[2]) * a.z + to_f(e[3]) * a.w;
                        acc[q] += to_f(e[4]) * b.x + to_f(e[5]) * b.y + to_f(e[6]) * b.z + to_f(e[7]) * b.w;
                    }
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                    for (int q = 0; q < CL_RW; ++q) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], o);
#pragma unroll
                for (int q = 0; q < CL_RW; ++q)
                    if (lane == q && rb + q < n) prow[cl_row(r0 + rb + q, h)] = acc[q];
            }
        }
        __syncthreads();  // the rows' weights are read: the next layer's may come in
        if (l + 1 < n_layers) cl_fetch_in(w_in, layers[l + 1].in_proj, h, c);
        cl_meet();  // the head's in_proj row is whole (release/acquire at cluster scope)
        CL_MARK(3);
        // ---- 3. the mixer of state rows p0 … p1 − 1
        mixer_run(sm, ah, hd, w.mix, prow, states, l, h, 0, yf, nullptr, NoMark{}, p0, p1);
        __syncthreads();
        CL_MARK(4);
        // ---- 4. this block's out_proj share, summed over the cluster
        float y[CL_YR];
#pragma unroll
        for (int j = 0; j < CL_YR; ++j) y[j] = yf[h * HEADDIM + p0 + j];
        for (int e = tid; e < D_MODEL; e += blockDim.x) {
            const w_t* wr = w_out + (size_t)e * CL_YR;
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < CL_YR; ++j) acc += to_f(wr[j]) * y[j];
            part[e] = acc;
        }
        __syncthreads();  // the out_proj columns are read
        if (l + 1 < n_layers) cl_fetch_out(w_out, layers[l + 1].out_proj, h, c);
        cl_meet();
        float* sh = shares + (size_t)(l & 1) * NHEADS * D_MODEL + (size_t)h * D_MODEL + c * CL_SLICE;
        for (int i = tid; i < CL_SLICE; i += blockDim.x) {
            float s = 0.f;
            for (int r = 0; r < CL_BLOCKS; ++r) s += cl_load(part + c * CL_SLICE + i, r);
            sh[i] = s;
        }
        __syncthreads();
        if (tid == 0) {
            __threadfence();
            atomicAdd(sync, 1ull);
        }
        CL_MARK(5);
    }
    // the last layer's residual, for the final norm and the head: cluster 0 writes it
    if (h == 0) {
        cl_wait(sync, (unsigned long long)n_layers * grid, nullptr);
        const float* sh = shares + (size_t)((n_layers - 1) & 1) * NHEADS * D_MODEL + c * CL_SLICE;
        for (int i = tid; i < CL_SLICE; i += blockDim.x) {
            float v = slice[i];
            for (int hh = 0; hh < NHEADS; ++hh) v += __ldcg(sh + (size_t)hh * D_MODEL + i);
            res[c * CL_SLICE + i] = v;
        }
    }
    // no block still reads another's shared memory once all have passed a last meeting
    cl_meet();
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        if (atomicAdd(sync + 1, 1ull) == grid - 1) {
            atomicExch(sync, 0ull);
            atomicExch(sync + 1, 0ull);
        }
    }
}
#endif
