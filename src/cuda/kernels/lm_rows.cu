// The language model around a Mamba-1 or Mamba-2 mixer (spec §1 of mamba1-mamba2-spec):
// embedding, RMSNorm, bias rows, written with their sizes as arguments so that one compile
// serves every shape of a dtype (the mixers' programs add their own kernels after this file).
//
// Types (dtypes.cuh, the source before this one): `act_t` is the model dtype, in which the
// GEMMs read their inputs; the residual stream, the GEMM outputs and every per-token value
// are f32.

// Twins of src/cpu/math.rs (IEEE exp and division: the f32 goldens ask for 1e-5).
__device__ __forceinline__ float softplus_f(float u) { return u > 20.f ? u : log1pf(expf(u)); }
__device__ __forceinline__ float silu_f(float u) { return u / (1.f + expf(-u)); }

// Sum of `v` over the block (blockDim.x a multiple of 32, ≤ 1024); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    v = fam_warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // `part` may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += part[w];
    return s;
}

// out[r, :] = table[tokens[r], :] in f32. One block per row.
extern "C" __global__ void fam_embed(const unsigned* tokens, const norm_t* table, float* out,
                                     int dm) {
    const int r = blockIdx.x;
    const norm_t* src = table + (size_t)tokens[r] * dm;
    for (int j = threadIdx.x; j < dm; j += blockDim.x) out[(size_t)r * dm + j] = to_f(src[j]);
}

// out[i, :] = x[row(i), :] / sqrt(mean(x²) + eps) ⊙ w, in `norm_t`; row(i) = rows[i],
// or i when `rows` is null. One block per output row.
extern "C" __global__ void fam_rms_norm(const float* x, const int* rows, const float* w,
                                        norm_t* out, int dm, float eps) {
    const int i = blockIdx.x;
    const float* xr = x + (size_t)(rows ? rows[i] : i) * dm;
    float ss = 0.f;
    for (int j = threadIdx.x; j < dm; j += blockDim.x) ss += xr[j] * xr[j];
    const float r = 1.f / sqrtf(block_sum(ss) / (float)dm + eps);
    for (int j = threadIdx.x; j < dm; j += blockDim.x)
        out[(size_t)i * dm + j] = from_f<norm_t>(xr[j] * r * w[j]);
}

// x[r, c] += bias[c] for c < cols, rows `ld` apart. Grid (rows), block 256.
extern "C" __global__ void fam_add_bias(float* x, const float* bias, int cols, int ld) {
    float* xr = x + (size_t)blockIdx.x * ld;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) xr[c] += bias[c];
}
