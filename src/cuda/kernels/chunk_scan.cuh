// What the chunk-parallel scans of a packed pass share around scan_tiles.cuh's products —
// Mamba-2's (mixers/mamba2/cuda/kernels/ssd_chunk.cu) and Mamba-3 MIMO's
// (mixers/mimo/cuda/kernels/mimo_chunk.cu): the pass's chunk tables, the P×N state a warp
// holds in registers (its fragment tiles, loaded, handed to the products as an operand,
// written back), and the running log-decay of a tile's rows. Each block is one (chunk,
// head) of the pass and walks the chunk's rows in tiles; two launches around a carry along
// each sequence (chunk states from zero, then outputs from the entering state).

// The pass's tables a chunk block reads (src/cuda/packed.rs, `Table`).
struct ChunkTable {
    const int* row0;                     // [chunks] first row
    const int* len;                      // [chunks] rows
    const int* seq;                      // [chunks] sequence
    const int* seq_chunk0;               // [seqs] first chunk
    const int* seq_nchunks;              // [seqs] chunks
    const unsigned long long* seq_state; // [seqs] the state's address
};

// This lane's share of the head's state S [P, N] (TileS of scan_tiles.cuh): the tiles
// [first, first + nt) of 8 columns in row block rb; element e of tile i is
// (channel pp(e), column n(i, e)) of the mma accumulator layout.
struct StateTiles {
    int rb, first, nt, fg, ft;
    __device__ explicit StateTiles(int warp, int lane)
        : rb(TileS::rb(warp)), first(TileS::first(warp)), nt(TileS::count(warp)), fg(lane >> 2), ft(lane & 3) {}
    __device__ int pp(int e) const { return 16 * rb + fg + 8 * (e >> 1); }
    __device__ int n(int i, int e) const { return 8 * (first + i) + 2 * ft + (e & 1); }
    // whether element e of tile i is one of the state's (not padding)
    __device__ bool holds(int i, int e) const { return i < nt && pp(e) < HEADDIM && n(i, e) < DSTATE; }
    // offset of the element in a row-major [P, N] state
    __device__ size_t at(int i, int e) const { return (size_t)pp(e) * DSTATE + n(i, e); }
};

// The state as an operand tile sS [PP][LDSO] (for Y = Q·Sᵀ).
__device__ __forceinline__ void state_operand(const float (&sacc)[TileS::T][4], const StateTiles& s, op_t* sS) {
#pragma unroll
    for (int i = 0; i < TileS::T; ++i) {
        if (i >= s.nt) break;
        op_t* row = sS + (16 * s.rb + s.fg) * LDSO + 8 * (s.first + i) + 2 * s.ft;
        put_pair(row, sacc[i][0], sacc[i][1]);
        put_pair(row + 8 * LDSO, sacc[i][2], sacc[i][3]);
    }
}

// s_lc[0..CHP) ← its inclusive prefix sums, by warp 0, 32 rows at a time (rows past a
// tile hold zero, so they end up at Lc_end). The caller synchronizes before and after.
__device__ __forceinline__ void prefix_sum_warp0(float* s_lc) {
    if ((threadIdx.x >> 5) != 0) return;
    const int lane = threadIdx.x & 31;
    float carry = 0.f;
    for (int b = 0; b < CHP; b += 32) {
        const int j = b + lane;
        float v = j < CHP ? s_lc[j] : 0.f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        v += carry;
        if (j < CHP) s_lc[j] = v;
        carry = __shfl_sync(0xffffffffu, v, 31);
    }
}

// The carry of one state entry along a sequence's n chunks: chunk k's slot hc[k·stride]
// holds its state from zero and gets the state entering it, starting from h, which then
// advances by the chunk's total log-decay log_decay[k·decay_stride]; the last chunk has no
// local state. A batch of CARRY_BATCH chunks' inputs is loaded before the walk through
// them, so that a thread waits for memory once per batch, not once per chunk (with one load
// in flight, Mamba-2's carry took 1.07 ms of a layer's 4k prompt at the 2.7b shape on an
// H100, the SMs 2 % busy).
#define CARRY_BATCH 8
__device__ __forceinline__ void carry_walk(float h, float* hc, size_t stride, const float* log_decay,
                                           size_t decay_stride, int n) {
    for (int k0 = 0; k0 < n; k0 += CARRY_BATCH) {
        float local[CARRY_BATCH], decay[CARRY_BATCH];
#pragma unroll
        for (int i = 0; i < CARRY_BATCH; ++i) {
            const int k = k0 + i;
            const bool has = k < n - 1;
            local[i] = has ? hc[k * stride] : 0.f;
            decay[i] = has ? log_decay[k * decay_stride] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < CARRY_BATCH; ++i) {
            const int k = k0 + i;
            if (k >= n) break;
            hc[k * stride] = h;
            if (k < n - 1) h = expf(decay[i]) * h + local[i];
        }
    }
}
