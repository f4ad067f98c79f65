// The model dtype's arithmetic, shared by every kernel program (the first source of each):
// `act_t` is the dtype of the weights and of the activations that feed the GEMMs (ACT: 0
// f32, 1 bf16, 2 f16), `to_f`/`from_f` its conversions to and from f32. `state_t` is the
// storage of the recurrent `ssm` state (STATE: 0 f32, 1 bf16, 2 f16; `--state-dtype`),
// read and written only through `st_load*`/`st_store*`: f32 in registers, rounded to
// nearest even when stored.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if ACT == 0
typedef float act_t;
#elif ACT == 1
typedef __nv_bfloat16 act_t;
#else
typedef __half act_t;
#endif

// `norm_t` is the dtype of RMS-normed rows and of the matrices that read them (the family
// models' in_proj, MLP fc1, head and embedding; NORM as ACT, default ACT): bf16 models whose
// normed rows and those matrices fit f16's range take f16 there (rounding 2⁻¹¹, not 2⁻⁸).
#ifndef NORM
#define NORM ACT
#endif
#if NORM == 0
typedef float norm_t;
#elif NORM == 1
typedef __nv_bfloat16 norm_t;
#else
typedef __half norm_t;
#endif

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

#if ACT != 0
// D += A·B on the tensor cores, mma.sync m16n8k16 with T operands (bf16 or f16) and f32
// accumulators. Fragments (lane = 4g + t): A a[0] (g, 2t..2t+1), a[1] (g+8, 2t..), a[2] (g, 2t+8..),
// a[3] (g+8, 2t+8..); B b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); C c[0..1] (g, 2t..2t+1),
// c[2..3] (g+8, 2t..2t+1).
template <typename T> __device__ __forceinline__ void mma16816_t(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma16816_t<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816_t<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The model dtype's.
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma16816_t<act_t>(c, a, b0, b1);
}
#endif

#ifndef STATE
#define STATE 0
#endif
#if STATE == 0
typedef float state_t;
#elif STATE == 1
typedef __nv_bfloat16 state_t;
#else
typedef __half state_t;
#endif

__device__ __forceinline__ float st_load(const state_t* p) { return to_f(*p); }
__device__ __forceinline__ void st_store(state_t* p, float v) { *p = from_f<state_t>(v); }
// Four consecutive entries, `p` aligned to four of them (16 bytes in f32, 8 in 16 bits).
__device__ __forceinline__ float4 st_load4(const state_t* p) {
#if STATE == 0
    return *reinterpret_cast<const float4*>(p);
#else
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const state_t* e = reinterpret_cast<const state_t*>(&u);
    return make_float4(to_f(e[0]), to_f(e[1]), to_f(e[2]), to_f(e[3]));
#endif
}
__device__ __forceinline__ void st_store4(state_t* p, float4 v) {
#if STATE == 0
    *reinterpret_cast<float4*>(p) = v;
#else
    uint2 u;
    state_t* e = reinterpret_cast<state_t*>(&u);
    e[0] = from_f<state_t>(v.x);
    e[1] = from_f<state_t>(v.y);
    e[2] = from_f<state_t>(v.z);
    e[3] = from_f<state_t>(v.w);
    *reinterpret_cast<uint2*>(p) = u;
#endif
}
