// Hardware probes for sizing the decode step (benches/gpu_floors.rs): what a thread-block
// cluster barrier, an exchange through distributed shared memory, a grid-wide hand-over
// (through one global counter, as the fused decode does it, or spread over a flag per block
// or several counters), and a block filling its shared memory cost on this GPU. They
// compute nothing of the model (so they have no CPU twin). Each loops `iters` times; the
// host times two iteration counts and divides the difference.
//
// Why: at batch 1 a decode layer is three grid-wide phases (kernels/decode_layers.cu), and
// each hand-over plus the staging after it costs ≈ 2 µs (docs/decisions.md, "Where a fused decode layer's time goes"). A design with
// one block cluster per head (the head's in_proj rows, its mixer and its share of out_proj
// inside the cluster, one grid-wide hand-over per layer) would trade two of the three for
// cluster barriers and shared-memory exchanges, and needs each SM to fill ≈ 150 KB of
// shared memory with weights per layer; these probes price those three (such a kernel was
// built, measured 1.7× slower than the fused decode and removed: docs/decisions.md, "Cluster decode"). The
// last, probe_state_stream, measures how close mixer_step comes to the state traffic's
// floor at a large batch.

// (cluster helpers: kernels/cluster.cuh)

__device__ __forceinline__ unsigned long long probe_load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// `iters` cluster barriers, nothing else. (Dynamic shared memory only sizes the launch so
// that one block fits an SM, as in the decode design.)
extern "C" __global__ void probe_cluster_barrier(int iters) {
    for (int i = 0; i < iters; ++i) cl_meet();
}

// Per round: every block writes `n` floats to its shared memory, the cluster meets, each
// thread sums its elements over every block of the cluster (distributed shared memory), and
// the cluster meets again before the next round overwrites them. `out[block]` keeps the
// sums alive.
extern "C" __global__ void probe_cluster_exchange(int iters, int n, float* out) {
    extern __shared__ float slice[];
    const unsigned rank = cl_rank(), blocks = cl_blocks();
    float acc = 0.f;
    for (int i = 0; i < iters; ++i) {
        for (int j = threadIdx.x; j < n; j += blockDim.x) slice[j] = acc + (float)(j + rank);
        cl_meet();
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            float s = 0.f;
            for (unsigned r = 0; r < blocks; ++r) s += cl_load(&slice[j], r);
            acc += 1e-30f * s;
        }
        cl_meet();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// The grid-wide hand-over of kernels/decode_layers.cu: each block arrives with a fence and
// one atomic add to `count` (zeroed by the host), and its thread 32 polls with acquire
// loads until every block of the round has arrived. Every block must be resident: the host
// launches it cooperatively.
extern "C" __global__ void probe_grid_handover(int iters, unsigned long long* count) {
    for (int i = 0; i < iters; ++i) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(count, 1ull);
        }
        if (threadIdx.x == 32) {
            const unsigned long long all = (unsigned long long)(i + 1) * gridDim.x;
            while (probe_load_acquire(count) < all) {
            }
        }
        __syncthreads();
    }
}

__device__ __forceinline__ unsigned probe_load_acquire_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The same hand-over with a flag per block instead of one counter: a block arrives by a
// release store of the round number to its own word, `stride` words after the previous
// block's (1: packed, 32: one 128-byte line each), so that arrivals do not queue at one
// address; warp 1 polls, each lane the flags of blocks lane, lane + 32, …, until all show
// the round. Flags zeroed by the host.
extern "C" __global__ void probe_grid_handover_flags(int iters, unsigned* flags, int stride) {
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < iters; ++i) {
        const unsigned round = (unsigned)i + 1;
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + (size_t)blockIdx.x * stride),
                         "r"(round)
                         : "memory");
        }
        if (threadIdx.x >= 32 && threadIdx.x < 64) {
            bool seen;
            do {
                seen = true;
                for (int b = lane; b < (int)gridDim.x; b += 32)
                    seen &= probe_load_acquire_u32(flags + (size_t)b * stride) >= round;
            } while (!__all_sync(0xffffffffu, seen));
        }
        __syncthreads();
    }
}

// The same with the counter split in `parts` counters 16 words (128 bytes) apart: block b
// adds to counter b mod parts, and lane j < parts of warp 1 polls counter j until it holds
// its share of the round. Counters zeroed by the host.
extern "C" __global__ void probe_grid_handover_split(int iters, unsigned long long* counts, int parts) {
    const int lane = threadIdx.x & 31;
    const int mine = lane < parts ? ((int)gridDim.x - lane + parts - 1) / parts : 0;  // blocks of counter lane
    for (int i = 0; i < iters; ++i) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counts + (size_t)(blockIdx.x % parts) * 16, 1ull);
        }
        if (threadIdx.x >= 32 && threadIdx.x < 64) {
            const unsigned long long all = (unsigned long long)(i + 1) * mine;
            bool seen;
            do {
                seen = lane >= parts || probe_load_acquire(counts + (size_t)lane * 16) >= all;
            } while (!__all_sync(0xffffffffu, seen));
        }
        __syncthreads();
    }
}

// Per round: each block copies `bytes` (a multiple of 16) from the next of `parts` parts of
// `src` into its shared memory with 16-byte cp.async, and waits for them. With `parts` ×
// `bytes` beyond L2 the parts come from DRAM; with `parts` = the grid, from L2 after the
// first round. `out[0]` keeps the copies alive.
extern "C" __global__ void probe_smem_fill(const uint4* src, int bytes, int parts, int iters, unsigned* out) {
    extern __shared__ uint4 buf[];
    const int n = bytes / 16;
    unsigned seen = 0;
    for (int i = 0; i < iters; ++i) {
        const uint4* part = src + (size_t)((blockIdx.x + (size_t)i * gridDim.x) % parts) * n;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const unsigned dst = (unsigned)__cvta_generic_to_shared(buf + j);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(part + j) : "memory");
        }
        asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        seen += buf[(threadIdx.x * 7u + (unsigned)i) % (unsigned)n].x;
        __syncthreads();
    }
    if (seen == 0x9e3779b9u) out[0] = seen;
}

// The state traffic of one decode layer at a large batch, without its mathematics: block b
// reads its `per_block` bytes (a multiple of 16) of f32 state — at the benchmark shape one
// head's 64 × 128 rows — all loads of a round first, then writes them back scaled: the
// memory shape of mixer_step (kernels/step.cu), one block per (head, sequence).
extern "C" __global__ void probe_state_stream(float4* state, int per_block, float a) {
    constexpr int ROUND = 8;  // float4s in flight per thread
    float4* p = state + (size_t)blockIdx.x * (per_block / 16);
    const int n = per_block / 16;
    for (int base = 0; base < n; base += ROUND * blockDim.x) {
        float4 v[ROUND];
#pragma unroll
        for (int r = 0; r < ROUND; ++r) {
            const int i = base + r * blockDim.x + threadIdx.x;
            if (i < n) v[r] = p[i];
        }
#pragma unroll
        for (int r = 0; r < ROUND; ++r) {
            const int i = base + r * blockDim.x + threadIdx.x;
            if (i < n) p[i] = make_float4(v[r].x * a, v[r].y * a, v[r].z * a, v[r].w * a);
        }
    }
}

// Nothing: a node of the step-shaped graphs that price what a decode step costs around its
// kernels (benches/gpu_floors.rs, `step_round_trip`). Waits for the kernel before and lets
// the next one start, as every kernel of the step does.
extern "C" __global__ void probe_empty(int unused) {
    (void)unused;
#if __CUDA_ARCH__ >= 900  // (common.cuh's griddep_wait and griddep_launch; not included here)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
