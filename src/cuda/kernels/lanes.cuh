// Sums across lanes, for every program (after dtypes.cuh): the family models' and the fused
// decode's mixers reduce over a warp or over a few adjacent lanes of it.

// Sum of `v` over the warp; every lane gets it.
__device__ __forceinline__ float fam_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over groups of Q adjacent lanes (Q a power of two dividing 32); every lane of a group
// gets its group's. A block may be narrower than a warp.
template <int Q> __device__ __forceinline__ float sum_adjacent_lanes(float v) {
    const int base = threadIdx.x & ~31;
    const int live = min(32, (int)blockDim.x - base);
    const unsigned mask = live == 32 ? 0xffffffffu : ((1u << live) - 1u);
#pragma unroll
    for (int o = Q / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
    return v;
}
