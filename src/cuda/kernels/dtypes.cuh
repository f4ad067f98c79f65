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

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

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
