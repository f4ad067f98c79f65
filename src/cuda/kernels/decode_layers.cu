// Every layer of one decode step in a single launch (16-bit models, batches ≤ 16): per
// layer the in_proj GEMV with the RMSNorm on its input (`gemv_tc_*`), the mixer's step of
// every (head, sequence), the out_proj GEMV adding into the residual, and the MLP's two
// GEMVs when there is one. For Mamba-3 SISO these are the device functions of the unfused
// launches in the same order (`mixer_step`, kernels of mixers/mamba3), so the result is
// bit-identical to them; CPU twin: the layer loop of `CpuModel::forward` (src/engine/cpu.rs)
// with one token per sequence. A mixer brings `MixerW`, `StepSmem`, `StepAhead`,
// `StepHead`, `mixer_head`, `mixer_ahead`, `mixer_run` and `mixer_state_rows` (SISO's in
// mixers/mamba3/cuda/kernels/step.cu, MIMO's in mixers/mimo/cuda/kernels/mimo_fused.cuh).
// in_proj and fc1 are `norm_t` matrices (the normed rows' dtype), out_proj and fc2 `w_t`.
//
// Why: at batch 1 a layer is three kernels of a few microseconds each, and most of every
// kernel is waiting — for its launch, for its weights, for the previous kernel. Here the
// grid is one block per SM for the whole step (a cooperative launch, so that every block
// is resident) and phases meet at a counter instead of a kernel boundary: a block
// announces a finished phase with one atomic add, and a block that works in the next phase
// first loads everything that does not depend on it (its weight tiles, the head's state)
// and then waits for the count. Blocks with nothing to do in a phase skip it and go on to
// load for the next one.
//
// Counting: `sync[0]` counts the arrivals of the step so far. A phase with W workers
// (blocks that have tiles or heads in it) adds W; the workers of the next phase wait until
// the count reaches the sum over all earlier phases — every block computes the same sums.
// `sync[1]` counts the blocks that are done; the last one resets the counts for the next
// launch (at that point no block is waiting on them any more). Other hand-overs were
// measured and removed (docs/decisions.md, "Hand-over spread or tagged").

#if ACT != 0 && D_MODEL % 8 == 0 && D_INNER % 8 == 0 && (MLP_HIDDEN == 0 || MLP_HIDDEN % 8 == 0)
#define FUSED_PREFETCH 1
// The thread that polls for the end of a phase: not thread 0, which is still behind the
// fence of this block's own arrival when the block goes on to the next phase.
#define FUSED_POLLER 32
// Layers whose parameter addresses are copied to shared memory at the start: every poll
// (an acquire) invalidates L1, so a layer's addresses read from global memory at its start
// are an L2 round trip on the way to its first wait. Later layers read them from global.
#define FUSED_TABLE 64

// Device addresses of one layer's parameters, as src/engine/cuda/weights.rs lays them out.
struct LayerW {
    const float* norm;
    const norm_t* in_proj;
    MixerW mix;
    const w_t* out_proj;
    const float* mlp_norm;
    const norm_t* fc1;
    const w_t* fc2;
};

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

struct Phases {
    unsigned long long* count;
    // arrivals of every earlier phase
    unsigned long long before;
    // when not null: per (phase, block) the times (ns) of entering the phase, of the end of
    // the wait, of the arrival and of one or two points in between (MAMBA3_GPU_TRACE, a
    // diagnostic)
    unsigned long long* trace;
    int phase;
    __device__ __forceinline__ void mark(int k, int by = 0) const {
        if (trace && threadIdx.x == by) trace[((size_t)phase * gridDim.x + blockIdx.x) * 5 + k] = global_ns();
    }
    // Wait until every earlier phase is done (the whole block, after the poller sees it).
    // The poller marks the end of its wait itself: a timer read just after the barrier
    // can run before the barrier resolves (seen in the traces).
    __device__ __forceinline__ void wait() const {
        if (threadIdx.x == FUSED_POLLER) {
            while (load_acquire(count) < before) {
            }
            mark(1, FUSED_POLLER);
        }
        __syncthreads();
    }
    // This block's part of the phase is written.
    __device__ __forceinline__ void arrive() const {
        __syncthreads();
        if (threadIdx.x == 0) {
            mark(2);
            __threadfence();
            atomicAdd(count, 1ull);
        }
    }
    // The phase had `workers` workers.
    __device__ __forceinline__ void next(int workers) {
        before += (unsigned long long)workers;
        ++phase;
    }
};

// This block's first tile of a GEMV; its others follow gridDim.x apart.
__device__ __forceinline__ int first_tile(bool reverse) {
    return reverse ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;
}

// out (+)= transform(in) · Wᵀ over N rows in 16-row tiles; tile t goes to block t mod G,
// or to block G − 1 − (t mod G) with `reverse` (so that a small GEMV lands on other blocks
// than the heavy ones of the GEMV before it).
template <int K, int NT, int mode, typename WT>
__device__ __forceinline__ void fused_gemv(Phases& ph, const float* in, const float* nw, const WT* W,
                                           float* out, int ldo, int nb, int N, int acc, bool reverse) {
    // Two tiles' weights are loaded ahead when both fit in TC_PF k blocks per warp.
    constexpr int PFT = Tc<K>::PFW == Tc<K>::KBW && 2 * Tc<K>::KBW <= TC_PF ? 2 : 1;
    const int tiles = (N + 15) / 16, G = gridDim.x;
    const int first = first_tile(reverse);
    ph.mark(0);
    if (first < tiles) {
        uint4 pf[PFT][Tc<K>::PFW][2];
        float4 nwr[Tc<K>::KT];
#pragma unroll
        for (int j = 0; j < PFT; ++j)
            if (first + j * G < tiles) tc_prefetch<K, WT>(pf[j], W, N, 16 * (first + j * G));
        tc_norm_ahead<K>(nwr, mode == 1 ? nw : nullptr);
        // the first tile's old output values: only this block writes them
        const float prev = acc ? tc_prev(out, ldo, nb, N, 16 * first) : 0.f;
        ph.wait();
        WT *xhi, *xlo;
        float* red;
        tc_smem_parts<K, NT, WT>(xhi, xlo, red);
        tc_stage<K, NT, mode, WT>(in, nwr, nb, xhi, xlo);
        ph.mark(3);
#pragma unroll
        for (int j = 0; j < PFT; ++j)
            if (first + j * G < tiles)
                tc_tile<K, NT, WT>(pf[j], W, N, 16 * (first + j * G), xhi, xlo, red, out, ldo, nb, acc, prev,
                                   j == 0);
        for (int t = first + PFT * G; t < tiles; t += G) {
            tc_prefetch<K, WT>(pf[0], W, N, 16 * t);
            tc_tile<K, NT, WT>(pf[0], W, N, 16 * t, xhi, xlo, red, out, ldo, nb, acc, 0.f, false);
        }
        ph.arrive();  // (its mark 2 is also the end of the tiles)
    }
    ph.next(min(tiles, G));
}

// Blocks per head in the mixer phase: with few (head, sequence) pairs most SMs would idle
// while one block per head updates all its state rows, so a head's rows are split between
// two blocks while they all fit in one wave (not with the output norm, which spans the
// head). Both read the head's whole in_proj row and form k̃, q̃. Measured at B=1 (docs/
// decisions.md, "Mixer split over two blocks per head"): ≈ 287 → 271 µs per step; four blocks per head were no better.
#ifndef FUSED_MIXER_SPLIT
#define FUSED_MIXER_SPLIT 1  // log2 of the most blocks per head
#endif
// log2 of the blocks per head for a batch of nb
__device__ __forceinline__ int mixer_split(int nb) {
    int split = OUTNORM ? 0 : FUSED_MIXER_SPLIT;
    while (split > 0 && (NHEADS * nb << split) > (int)gridDim.x) --split;
    return split;
}
// Item i: part i mod 2^split of pair i / 2^split = b·NHEADS + h, and its state rows.
struct MixItem {
    int h, b, p0, p1;
    __device__ __forceinline__ MixItem(int i, int split) {
        const int hb = i >> split, rows = (HEADDIM + (1 << split) - 1) >> split;
        h = hb % NHEADS;
        b = hb / NHEADS;
        p0 = (i & ((1 << split) - 1)) * rows;
        p1 = min(HEADDIM, p0 + rows);
    }
};

// The head states of this block's first mixer item of a layer, loaded before the block
// arrives at the in_proj phase: with a split head, the block of rows 0 … writes them in the
// mixer phase, which the other block's arrival then precedes. (A later item of a block
// comes only without the split: its head is this block's alone.)
__device__ __forceinline__ void first_mixer_head(StepHead& hd, float* const* __restrict__ states, int layer,
                                                 int nb, int split) {
    if ((int)blockIdx.x < NHEADS * nb << split) {
        const MixItem it(blockIdx.x, split);
        mixer_head(hd, states, layer, it.h, it.b);
    }
}

// The mixer of every (head, sequence), or of every part of one: item i goes to block i mod G.
// `hd`: the first item's head states (first_mixer_head); `split` as mixer_split gives it.
__device__ __forceinline__ void fused_mixer(Phases& ph, StepSmem& sm, const MixerW& w, const float* proj,
                                            float* const* __restrict__ states, int layer, int nb, int split,
                                            float* yf, StepHead& hd) {
    const int items = NHEADS * nb << split, G = gridDim.x;
    int i = blockIdx.x;
    ph.mark(0);
    if (i < items) {
        StepAhead ah;
        MixItem it(i, split);
        mixer_ahead(ah, w, states, layer, it.h, it.b, it.p0, it.p1);
        ph.wait();
        for (;;) {
            const auto mark = [&](int k) { ph.mark(k); };
            mixer_run(sm, ah, hd, w, proj, states, layer, it.h, it.b, yf, nullptr, mark, it.p0, it.p1);
            i += G;
            if (i >= items) break;
            it = MixItem(i, split);
            mixer_head(hd, states, layer, it.h, it.b);
            mixer_ahead(ah, w, states, layer, it.h, it.b, it.p0, it.p1);
        }
        ph.arrive();
    }
    ph.next(min(items, G));
}

// Bring `bytes` at p (16-byte aligned, a multiple of 16) into L2, without waiting for it.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Thread j of the block asks L2 for its j-th piece of a layer: its tiles of each GEMV (as
// `fused_gemv` assigns them) and its mixer items' state rows. Issued a layer ahead, so that
// the loads each phase makes before its wait hit L2 instead of DRAM. Measured at batch 1
// (docs/decisions.md, "L2 prefetch of the next layer"): the mixer's phase 4.9 → 4.4 µs per layer, the step 1–3 % shorter;
// the GEMVs' input staging did not move (it is not waiting on the weights).
struct PrefetchList {
    int j;  // pieces counted so far
    __device__ __forceinline__ void piece(const void* p, unsigned bytes) {
        if (j++ % (int)blockDim.x == (int)threadIdx.x) prefetch_l2(p, bytes);
    }
    template <int K, typename WT> __device__ __forceinline__ void gemv(const WT* W, int N, bool reverse) {
        const int G = gridDim.x, tiles = (N + 15) / 16;
        for (int t = first_tile(reverse); t < tiles; t += G)
            piece(W + (size_t)16 * t * K, (unsigned)((N - 16 * t < 16 ? N - 16 * t : 16) * K * sizeof(WT)));
    }
};
__device__ __forceinline__ void prefetch_layer(const LayerW& w, float* const* __restrict__ states, int layer,
                                               int nb, int split) {
    PrefetchList pl = {0};
    pl.gemv<D_MODEL>(w.in_proj, D_IN_PROJ, false);
    for (int i = blockIdx.x; i < NHEADS * nb << split; i += gridDim.x) {
        const MixItem it(i, split);
        pl.piece(mixer_state_rows(w.mix, states[it.b], layer, it.h) + (size_t)it.p0 * DSTATE,
                 (it.p1 - it.p0) * DSTATE * sizeof(state_t));
    }
    pl.gemv<D_INNER>(w.out_proj, D_MODEL, true);
#if MLP_HIDDEN > 0
    pl.gemv<D_MODEL>(w.fc1, 2 * MLP_HIDDEN, false);
    pl.gemv<MLP_HIDDEN>(w.fc2, D_MODEL, true);
#endif
}

template <int NT>
__device__ __forceinline__ void fused_layers(Phases& ph, StepSmem& sm, const LayerW* __restrict__ layers,
                                             const LayerW* tab, int n_layers, float* res, float* proj,
                                             float* yf, float* vg, float* const* __restrict__ states,
                                             int nb) {
    auto layer = [&](int l) { return l < FUSED_TABLE ? tab[l] : layers[l]; };
    const int split = mixer_split(nb);
    for (int l = 0; l < n_layers; ++l) {
        const LayerW w = layer(l);
        if (FUSED_PREFETCH && l + 1 < n_layers) prefetch_layer(layer(l + 1), states, l + 1, nb, split);
        // Let the head's GEMV (launched next, with PDL) start loading its weights.
        if (l == n_layers - 1) griddep_launch();
        StepHead hd;
        first_mixer_head(hd, states, l, nb, split);
        fused_gemv<D_MODEL, NT, 1, norm_t>(ph, res, w.norm, w.in_proj, proj, PROJ_LD, nb, D_IN_PROJ, 0, false);
        fused_mixer(ph, sm, w.mix, proj, states, l, nb, split, yf, hd);
        fused_gemv<D_INNER, NT, 0, w_t>(ph, yf, nullptr, w.out_proj, res, D_MODEL, nb, D_MODEL, 1, true);
#if MLP_HIDDEN > 0
        fused_gemv<D_MODEL, NT, 1, norm_t>(ph, res, w.mlp_norm, w.fc1, vg, 2 * MLP_HIDDEN, nb, 2 * MLP_HIDDEN, 0,
                                           false);
        fused_gemv<MLP_HIDDEN, NT, 2, w_t>(ph, vg, nullptr, w.fc2, res, D_MODEL, nb, D_MODEL, 1, true);
#endif
    }
}

#define FUSED_MAX(a, b) ((a) > (b) ? (a) : (b))
#if MLP_HIDDEN > 0
#define FUSED_SMEM(NT) FUSED_MAX(FUSED_MAX(TC_SMEM(D_MODEL, NT), TC_SMEM(D_INNER, NT)), TC_SMEM(MLP_HIDDEN, NT))
#else
#define FUSED_SMEM(NT) FUSED_MAX(TC_SMEM(D_MODEL, NT), TC_SMEM(D_INNER, NT))
#endif
#define FUSED_TABLE_AT(NT) ((FUSED_SMEM(NT) + 15) / 16 * 16)  // the layer table, after the GEMVs'

// res: the embedded rows (nb × D_MODEL f32), left as the last layer's output; proj, yf, vg:
// the unfused decode's buffers; sync: the zeroed counters owned by this launch's buffers.
// One entry point per row tile (nb ≤ 8, ≤ 16): registers are allotted per kernel.
template <int NT>
__device__ __forceinline__ void decode_layers_body(const LayerW* __restrict__ layers, int n_layers, float* res,
                                                   float* proj, float* yf, float* vg,
                                                   float* const* __restrict__ states, int nb,
                                                   unsigned long long* sync, unsigned long long* trace) {
    __shared__ StepSmem sm;
    extern __shared__ __align__(16) unsigned char fused_dyn[];
    LayerW* tab = reinterpret_cast<LayerW*>(fused_dyn + FUSED_TABLE_AT(NT));
    static_assert(sizeof(LayerW) % 8 == 0, "the table is copied in 8-byte words");
    const int words = min(n_layers, FUSED_TABLE) * (int)(sizeof(LayerW) / 8);
    for (int i = threadIdx.x; i < words; i += blockDim.x)
        reinterpret_cast<unsigned long long*>(tab)[i] = reinterpret_cast<const unsigned long long*>(layers)[i];
    __syncthreads();
    // Layer 0's weights and states asked of L2 before the wait for the kernel before (the
    // embedding, launched with PDL): neither is written by it, and a prefetch is only a hint.
    if (FUSED_PREFETCH) prefetch_layer(FUSED_TABLE > 0 ? tab[0] : layers[0], states, 0, nb, mixer_split(nb));
    griddep_wait();
    Phases ph = {sync, 0ull, trace, 0};
    fused_layers<NT>(ph, sm, layers, tab, n_layers, res, proj, yf, vg, states, nb);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(sync + 1, 1ull) == gridDim.x - 1) {
            atomicExch(sync, 0ull);
            atomicExch(sync + 1, 0ull);
        }
    }
}

#define DECODE_LAYERS_ENTRY(name, NT)                                                                \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, 1)                                  \
        name(const LayerW* __restrict__ layers, int n_layers, float* res, float* proj, float* yf,     \
             float* vg, float* const* __restrict__ states, int nb, unsigned long long* sync,          \
             unsigned long long* trace) {                                                            \
        decode_layers_body<NT>(layers, n_layers, res, proj, yf, vg, states, nb, sync, trace);         \
    }                                                                                                \
    extern "C" __device__ int name##_smem = FUSED_TABLE_AT(NT) + FUSED_TABLE * (int)sizeof(LayerW);
#if IN_PART(PART_FUSED8)
DECODE_LAYERS_ENTRY(decode_layers8, 1)
#endif
#if IN_PART(PART_FUSED16)
DECODE_LAYERS_ENTRY(decode_layers16, 2)
#endif
#endif
