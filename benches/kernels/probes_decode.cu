// Floors of the two decode targets (benches/gpu_floors.rs), measured without the model:
//
// - How fast can a large batch's f32 state stream through this GPU at all? At B=64 a step
//   reads and writes 24 layers × 24 heads × 64 × 128 f32 per sequence, 2.42 GB, so
//   100 k tokens/s needs ≥ 3.78 TB/s of in-place traffic with nothing else in the step.
//   probe_state_stream (probes.cu) has mixer_step's shape; here the same bytes stream in
//   the shapes most likely to be faster: every layer in one launch, a persistent grid
//   walking the buffer, and bulk copies (TMA) through shared memory; with a read-only and
//   an out-of-place copy for reference.
// - How short can a B=1 step of the fused decode (kernels/decode_layers.cu) be with
//   infinitely fast projections? probe_decode_skeleton keeps its three grid-wide
//   hand-overs per layer and the data each phase waits for (the residual read by every
//   block; a head's in_proj row and its state rows by the mixer's 48 blocks; the 1536
//   outputs by out_proj's 48), and drops the weights.
//
// They compute nothing of the model (no CPU twin).

__device__ __forceinline__ float pd_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// The sum over the block (256 threads) of v, in every thread; `red` holds 8 floats.
__device__ __forceinline__ float pd_block_sum(float v, float* red) {
    v = pd_warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) s += red[w];
    return s;
}

// `n` float4s streamed by a grid walking them, ROUND loads per thread in flight. mode 0:
// read and written back scaled (in place); 1: read only (a sum kept alive in `sink`);
// 2: read from p, written to p + n (out of place).
extern "C" __global__ void probe_stream_flat(float4* p, long long n, float a, int mode, float* sink) {
    constexpr int ROUND = 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    float acc = 0.f;
    for (long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x; base < n; base += ROUND * stride) {
        float4 v[ROUND];
#pragma unroll
        for (int r = 0; r < ROUND; ++r) {
            const long long i = base + r * stride;
            if (i < n) v[r] = __ldcs(p + i);
        }
#pragma unroll
        for (int r = 0; r < ROUND; ++r) {
            const long long i = base + r * stride;
            if (i >= n) continue;
            if (mode == 1) acc += v[r].x + v[r].y + v[r].z + v[r].w;
            else __stcs(p + i + (mode == 2 ? n : 0), make_float4(v[r].x * a, v[r].y * a, v[r].z * a, v[r].w * a));
        }
    }
    if (mode == 1 && acc == 1234.5f) sink[0] = acc;
}

#if __CUDA_ARCH__ >= 900
// Items of `item_bytes` (≤ 48 KB, a multiple of 16) at p, walked by each block from
// blockIdx.x in steps of the grid: each comes in by one bulk copy into one of STAGES
// shared-memory buffers (completion counted on an mbarrier), is scaled there by every
// thread, and goes back by one bulk copy; a buffer is refilled once its store has read it.
extern "C" __global__ void probe_stream_bulk(float* p, int item_bytes, int items, float a) {
    constexpr int STAGES = 3;
    extern __shared__ __align__(128) unsigned char pd_smem[];
    __shared__ __align__(8) unsigned long long bar[STAGES];
    const int nf = item_bytes / 4;
    auto buf = [&](int s) { return reinterpret_cast<float*>(pd_smem + (size_t)s * item_bytes); };
    auto load = [&](int s, int item) {
        const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
        const unsigned dst = (unsigned)__cvta_generic_to_shared(buf(s));
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(item_bytes) : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
            "l"(p + (size_t)item * nf), "r"(item_bytes), "r"(b)
            : "memory");
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int j = 0;  // this block's items so far
    if (threadIdx.x == 0)
        for (int s = 0; s < STAGES && blockIdx.x + s * gridDim.x < items; ++s) load(s, blockIdx.x + s * gridDim.x);
    for (int item = blockIdx.x; item < items; item += gridDim.x, ++j) {
        const int s = j % STAGES;
        const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
        const unsigned parity = (unsigned)(j / STAGES) & 1u;
        unsigned done = 0;
        while (!done)
            asm volatile(
                "{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                : "=r"(done)
                : "r"(b), "r"(parity)
                : "memory");
        float4* v = reinterpret_cast<float4*>(buf(s));
        for (int i = threadIdx.x; i < nf / 4; i += blockDim.x) {
            const float4 x = v[i];
            v[i] = make_float4(x.x * a, x.y * a, x.z * a, x.w * a);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned src = (unsigned)__cvta_generic_to_shared(buf(s));
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(p + (size_t)item * nf),
                         "r"(src), "r"(item_bytes)
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            const int next = item + STAGES * gridDim.x;
            if (next < items) {
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                load(s, next);
            }
        }
    }
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
#endif

// The benchmark shape's decode dimensions (d_model 768, in_proj 3432 rows, d_inner 1536,
// 24 heads of 64 × 128, each head's rows split between two blocks as at B=1).
#define PD_D 768
#define PD_PROJ 3432
#define PD_DI 1536
#define PD_HEADS 24
#define PD_P 64
#define PD_N 128
#define PD_ITEMS (2 * PD_HEADS)
#define PD_TILES (PD_D / 16)

// The fused decode's hand-over (kernels/decode_layers.cu): arrivals counted at `count`
// (zeroed by the host), thread 32 polls until it reaches `before` (probe_load_acquire:
// probes.cu, compiled with this file).
struct PdPhases {
    unsigned long long* count;
    unsigned long long before;
    __device__ __forceinline__ void wait() const {
        if (threadIdx.x == 32)
            while (probe_load_acquire(count) < before) {
            }
        __syncthreads();
    }
    __device__ __forceinline__ void arrive() const {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(count, 1ull);
        }
    }
};

// `layers` layers of a B=1 step (one block per SM, cooperative launch), each of three phases:
// in_proj (every block reads the residual and its sum of squares, writes its rows of the
// in_proj row), mixer (48 blocks: a head's row of B, C, angles, x, z and scalars; a norm;
// its 32 state rows read before the wait, updated and written; 32 outputs), out_proj
// (48 blocks: all 1536 outputs read; 16 residual values written). With `data` = 0 only the
// hand-overs. The state is `PD_HEADS` heads × 24 layers.
extern "C" __global__ void probe_decode_skeleton(int layers, unsigned long long* count, float* res, float* proj,
                                                 float* y, float* state, int data) {
    __shared__ float red[8];
    __shared__ __align__(16) float k[PD_N];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, G = gridDim.x;
    const int rows = (PD_PROJ + G - 1) / G;
    PdPhases ph = {count, 0ull};
    for (int l = 0; l < layers; ++l) {
        // ---- in_proj
        ph.wait();
        if (data) {
            float v[3], ss = 0.f;
#pragma unroll
            for (int j = 0; j < 3; ++j) {
                v[j] = __ldcg(res + tid + 256 * j);
                ss += v[j] * v[j];
            }
            const float inv = rsqrtf(pd_block_sum(ss, red) / PD_D + 1e-5f);
            const int row = blockIdx.x * rows + tid;
            if (tid < rows && row < PD_PROJ) proj[row] = v[0] * inv;
        }
        ph.arrive();
        ph.before += G;
        // ---- mixer
        const int item = blockIdx.x;
        if (item < PD_ITEMS) {
            const int h = item / 2, p0 = (item % 2) * (PD_P / 2);
            float4* hs = reinterpret_cast<float4*>(state + ((size_t)(l % 24) * PD_HEADS + h) * PD_P * PD_N);
            float4 st[4];
            if (data)
#pragma unroll
                for (int r = 0; r < 4; ++r) st[r] = hs[(p0 + warp + 8 * r) * (PD_N / 4) + lane];
            ph.wait();
            if (data) {
                // B at 2·D_INNER, C after it, angles after C, x and z of the head: the real offsets
                // do not matter, the number of dependent loads does
                const float b = tid < PD_N ? __ldcg(proj + 2 * PD_DI + tid) : 0.f;
                const float c = tid < PD_N ? __ldcg(proj + 2 * PD_DI + PD_N + tid) : 0.f;
                const float ang = tid < PD_N / 4 ? __ldcg(proj + 2 * PD_DI + 2 * PD_N + tid) : 0.f;
                const float x = tid < PD_P / 2 ? __ldcg(proj + h * PD_P + p0 + tid) : 0.f;
                const float z = tid < PD_P / 2 ? __ldcg(proj + PD_DI + h * PD_P + p0 + tid) : 0.f;
                const float dt = __ldcg(proj + PD_PROJ - 3 * PD_HEADS + h);
                const float inv = rsqrtf(pd_block_sum(b * b + c * c, red) / PD_N + 1e-5f);
                if (tid < PD_N) k[tid] = (b * inv + ang) * __expf(dt);
                __syncthreads();
                const float4 k4 = reinterpret_cast<const float4*>(k)[lane];
                const float xs = __shfl_sync(0xffffffffu, x, warp) + z;  // (some row's x; the value is not the point)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    float4 s = st[r];
                    s.x = 0.9f * s.x + xs * k4.x;
                    s.y = 0.9f * s.y + xs * k4.y;
                    s.z = 0.9f * s.z + xs * k4.z;
                    s.w = 0.9f * s.w + xs * k4.w;
                    hs[(p0 + warp + 8 * r) * (PD_N / 4) + lane] = s;
                    const float acc = pd_warp_sum(s.x * c + s.y + s.z + s.w);
                    if (lane == 0) y[h * PD_P + p0 + warp + 8 * r] = acc;
                }
            }
            ph.arrive();
        }
        ph.before += PD_ITEMS;
        // ---- out_proj (the last blocks, as the fused decode deals it)
        const int tile = G - 1 - (int)blockIdx.x;
        if (tile < PD_TILES) {
            ph.wait();
            if (data) {
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < PD_DI / 256; ++j) s += __ldcg(y + tid + 256 * j);
                s = pd_block_sum(s, red);
                if (tid < 16) res[16 * tile + tid] = 0.5f * res[16 * tile + tid] + 1e-3f * s;
            }
            ph.arrive();
        }
        ph.before += PD_TILES;
    }
}
