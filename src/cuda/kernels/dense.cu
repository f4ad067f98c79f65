// Row-wise kernels around the GEMMs: embedding lookup, RMSNorm (spec §2.7) and the
// GatedMLP activation. CPU twins: the embedding loop and `norm_rows` in
// src/engine/cpu.rs, `rms_norm` in src/cpu/math.rs.

// res[r] = E[tokens[r]] (f32). One block per row. An untied table is f32 (EMBED_F32).
#if EMBED_F32
typedef float emb_t;
#else
typedef w_t emb_t;
#endif
#if IN_PART(PART_ROWS)
extern "C" __global__ void embed(const unsigned* __restrict__ tokens, const emb_t* __restrict__ E,
                                 float* __restrict__ res) {
    griddep_wait();
    griddep_launch();
    const emb_t* e = E + (size_t)tokens[blockIdx.x] * D_MODEL;
    float* o = res + (size_t)blockIdx.x * D_MODEL;
    for (int i = threadIdx.x; i < D_MODEL; i += blockDim.x) o[i] = to_f(e[i]);
}
#endif

// out[r] = x[src_r] / sqrt(mean(x[src_r]²) + eps) ⊙ w, one warp per row
// (src_r = rows_idx ? rows_idx[r] : r), written as a GEMM input by `mode`:
//   0: act_t, D_MODEL wide;
//   1: [hi | lo] in act_t, 2·D_MODEL wide, hi = round(v), lo = round(v − hi): a GEMM
//      against [W | W] then sees the f32 value to ~2⁻¹⁶ (16-bit models only);
//   2: f16, D_MODEL wide (the in_proj input of 16-bit models; see src/engine/cuda/weights.rs).
#if IN_PART(PART_ROWS)
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                         void* __restrict__ out, int rows,
                                         const int* __restrict__ rows_idx, int mode) {
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
    if (mode == 2) {
        __half* o = reinterpret_cast<__half*>(out) + (size_t)r * D_MODEL;
        for (int i = lane; i < D_MODEL; i += 32) o[i] = __float2half_rn(xr[i] * inv * w[i]);
        return;
    }
    act_t* o = reinterpret_cast<act_t*>(out) + (size_t)r * (mode == 1 ? 2 * D_MODEL : D_MODEL);
    for (int i = lane; i < D_MODEL; i += 32) {
        float v = xr[i] * inv * w[i];
        act_t hi = from_f<act_t>(v);
        o[i] = hi;
        if (mode == 1) o[D_MODEL + i] = from_f<act_t>(v - to_f(hi));
    }
}
#endif

#if MLP_HIDDEN > 0
// GatedMLP activation: act[r][i] = vg[r][i] · silu(vg[r][MLP_HIDDEN + i]).
#if IN_PART(PART_ROWS)
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
#endif
