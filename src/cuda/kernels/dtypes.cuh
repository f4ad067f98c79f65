// The model dtype's arithmetic, shared by every kernel program (the first source of each):
// `act_t` is the dtype of the weights and of the activations that feed the GEMMs (ACT: 0
// f32, 1 bf16, 2 f16), `to_f`/`from_f` its conversions to and from f32.
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
