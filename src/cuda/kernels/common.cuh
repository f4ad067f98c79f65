// Shared by every kernel of the mamba3 GPU backend. Compiled by NVRTC once per model
// shape: the dimensions and the numeric mode arrive as -D defines (see src/cuda/kernels.rs),
// so every loop bound below is a compile-time constant.
//
// Types: `w_t` is the weights' dtype and `act_t` the dtype of the activations that feed the
// GEMMs (ACT: 0 f32, 1 bf16, 2 f16), `proj_t` the prefill's in_proj output's (f32, or f16
// with PROJ_F16, below). Everything else — the residual stream, the decode's in_proj output,
// the B/C norms, per-token scalars, the SSM and angle state — is f32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

// The inference program is compiled in parts, each on a thread of its own (the parts of
// `Program` in src/cuda/kernels.rs): every part reads every source, and a file keeps its
// entry points only in their part. PART 0 is the whole program.
#ifndef PART
#define PART 0
#endif
#define IN_PART(p) (PART == 0 || PART == (p))
#define PART_ROWS 1        // embed, norms, SwiGLU, prefill_pre, angle_pass, scan_pass, mixer_step, CUDA-core GEMVs
#define PART_SCAN 2        // scan_states, scan_outputs
#define PART_TC_DMODEL 3   // gemv_tc_dmodel
#define PART_TC_WIDE 4     // gemv_tc_dinner, gemv_tc_hidden
#define PART_FUSED8 5      // decode_layers8
#define PART_FUSED16 6     // decode_layers16

// (act_t, to_f and from_f: dtypes.cuh, the source before this one)
typedef act_t w_t;

#define PI_F 3.14159265358979323846f
#define TWO_PI_F 6.28318530717958647692f

// Two adjacent elements in one store (p aligned to two elements).
__device__ __forceinline__ void store_pair(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store_pair(__half* p, float a, float b) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

// Programmatic dependent launch (sm_90): a kernel may start while the previous one in the
// stream finishes; `griddep_wait` blocks until that one's writes are visible. Every kernel
// calls it before touching activations. Without the launch attribute both are no-ops.
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Scalar activations, spec §2.2 (twins of src/cpu/math.rs).
__device__ __forceinline__ float softplus_f(float u) { return u > 20.f ? u : log1pf(expf(u)); }
__device__ __forceinline__ float sigmoid_f(float u) { return 1.f / (1.f + expf(-u)); }
__device__ __forceinline__ float silu_f(float u) { return u * sigmoid_f(u); }
// silu by the hardware exp and reciprocal (a few ulp): for the scan's gate, applied to every
// output element, where the IEEE division's range checks and slow path cost ~8 % of the kernel.
// The exp flushes results below 2^-126 to zero, which `1 + e` cannot tell from the exact
// value; that drops the subnormal fix-up __expf carries (3 of 8 instructions), same bits.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float silu_approx_f(float u) {
    return __fdividef(u, 1.f + exp2_ftz(u * -1.44269504088896341f));
}
__device__ __forceinline__ float heavy_tail_f(float u) { return u >= 0.f ? 1.f + u : 1.f / (1.f - u); }
// A = min(-f(dd_A), -A_floor)
__device__ __forceinline__ float a_value_f(float dd_a) {
#if A_ACT == 0
    float f = heavy_tail_f(dd_a);
#else
    float f = softplus_f(dd_a);
#endif
    return fminf(-f, -A_FLOOR);
}
// wrap(φ) = φ − 2π·floor(φ/2π), into [0, 2π)
__device__ __forceinline__ float wrap_angle_f(float phi) {
    float w = phi - TWO_PI_F * floorf(phi / TWO_PI_F);
    return w >= TWO_PI_F ? w - TWO_PI_F : w;
}

// sin and cos of a wrapped phase φ ∈ [0, 2π): moved to [−π, π), where the hardware
// approximation is accurate to ~1e-6 absolute (sincosf would keep a slow path for huge
// arguments, with a stack frame, that wrapped phases never take).
__device__ __forceinline__ void sincos_phase(float phi, float* s, float* c) {
    __sincosf(phi >= PI_F ? phi - TWO_PI_F : phi, s, c);
}
// sin and cos of an unwrapped phase (|φ| ≪ 2^20), reduced to [−π, π] by a two-part 2π:
// where only sin and cos are wanted, not the wrapped value (the wrap divides, with a slow path).
#define TWO_PI_HI 6.28318548202514648f    // 2π rounded to f32
#define TWO_PI_LO -1.74845560e-7f            // 2π − TWO_PI_HI
__device__ __forceinline__ void sincos_unwrapped(float phi, float* s, float* c) {
    const float k = rintf(phi * (1.f / TWO_PI_F));
    __sincosf(fmaf(-k, TWO_PI_LO, fmaf(-k, TWO_PI_HI, phi)), s, c);
}

// (mma16816, the tensor-core product on act_t operands: dtypes.cuh)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A 64-bit load that acquires at GPU scope (a flag or count another block released).
__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); `red` holds 32 floats.
// Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

// One sequence's state in one layer, inside its per-sequence buffer (see src/engine/cuda/state.rs):
// [angle H·S | ssm H·P·N | k H·N | v H·P], layers one after another; `ssm` in state_t, the
// rest f32. ST_ANGLE, ST_SSM, ST_K, ST_V (byte offsets in a layer) and ST_LAYER (bytes of a
// layer) are defines from the layout (src/model/state_layout.rs, mixers/mamba3/cuda/program.rs).
struct LayerSt {
    float* angle;
    state_t* ssm;
    float* k;
    float* v;
};
__device__ __forceinline__ LayerSt layer_st(float* seq, int layer) {
    char* b = reinterpret_cast<char*>(seq) + (size_t)layer * ST_LAYER;
    return {reinterpret_cast<float*>(b + ST_ANGLE), reinterpret_cast<state_t*>(b + ST_SSM),
            reinterpret_cast<float*>(b + ST_K), reinterpret_cast<float*>(b + ST_V)};
}

// The prefill's in_proj output (`proj`, read by prefill_pre and the scan): f32, or f16
// with PROJ_F16 (16-bit models whose in_proj output is bounded well inside f16's range:
// src/engine/cuda/weights.rs `proj_f16`). The decode's in_proj rows are always f32.
#ifndef PROJ_F16
#define PROJ_F16 0
#endif
#if PROJ_F16
typedef __half proj_t;
#else
typedef float proj_t;
#endif
// Four f16 values packed in 8 bytes, as f32.
__device__ __forceinline__ float4 unpack_half4(uint2 u) {
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
// Elements of a proj row as f32: one, two (p aligned to two elements), four (to four).
__device__ __forceinline__ float proj1(const proj_t* p) { return to_f(*p); }
__device__ __forceinline__ float2 proj2(const proj_t* p) {
#if PROJ_F16
    return __half22float2(*reinterpret_cast<const __half2*>(p));
#else
    return *reinterpret_cast<const float2*>(p);
#endif
}
__device__ __forceinline__ float4 proj4(const proj_t* p) {
#if PROJ_F16
    return unpack_half4(*reinterpret_cast<const uint2*>(p));
#else
    return *reinterpret_cast<const float4*>(p);
#endif
}

// in_proj rows are stored PROJ_LD apart (D_IN_PROJ rounded up to 8: aligned rows).
// Offsets inside one in_proj row (spec §2.1): z, x, B, C, dd_dt, dd_A, trap, angles.
#define Z_OFF 0
#define X_OFF D_INNER
#define B_OFF (2 * D_INNER)
#define C_OFF (B_OFF + NGROUPS * DSTATE)
#define DT_OFF (C_OFF + NGROUPS * DSTATE)
#define A_OFF (DT_OFF + NHEADS)
#define TRAP_OFF (DT_OFF + 2 * NHEADS)
#define ANG_OFF (DT_OFF + 3 * NHEADS)
#define HEADS_PER_GROUP (NHEADS / NGROUPS)
// width of one token's normed B̄ then C̄: [2][G][N]
#define BC_W (2 * NGROUPS * DSTATE)
