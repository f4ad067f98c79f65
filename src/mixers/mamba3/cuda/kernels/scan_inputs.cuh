// How a chunk's inputs reach a block of the chunked scan (scan.cu): the launch's arguments
// and the loads of a chunk's per-token scalars, B̄/C̄ and x quads, and gate inputs.

struct ScanArgs {
    const proj_t* proj;  // [rows][PROJ_LD]
    const float* bcn;    // [rows][BC_W]
    const float4* tok;   // [rows][H] {Δ, γ, c, Lc}
    const float* theta;  // [rows][S]
    const float* phi0;   // [chunk][H][S]
    const int4* chunks;  // {start, len, seq end, seq}
    const int4* segs;    // {first chunk, chunks, seq, flags}
    const int* order;    // segments in launch order
    const float* b_bias;
    const float* c_bias;
    const float* d_skip;
    const float* out_norm;  // [D_INNER] or null
    float* sbuf;            // [seg][H][P][N]: S_seg (A), S_enter (B, C)
    float* sdecay;          // [seg][H]
    act_t* y;               // [rows][D_INNER]
    float* y_pre;           // [rows][D_INNER] f32, y before the gate (training), or null
    float* const* states;   // per sequence
    int layer;
    float qk;           // a bound on |⟨q̃, k̃⟩| (the f16 operands' scale of M, SCAN_SCALED)
    int heads_fastest;  // the grid's shape (below)
};

// The row whose scalars {Δ, γ, c, Lc} a thread loads: lane mod PH_TPW of its warp's rows
// in the phase steps, so that Δ of those rows reaches every lane of the warp by shuffles
// (Δ loaded per row by every thread and multiplied into θ at once waited a round trip,
// ≈ 7 % of the stall samples, before the chunk's first barrier). Lanes < PH_TPW store them.
__device__ __forceinline__ int scalar_row() {
    return (threadIdx.x >> 5) * PH_TPW + (threadIdx.x & 31) % PH_TPW;
}

// A chunk's scalar inputs as this thread uses them, loaded together at the chunk's start
// (a loop that loaded each where it is used waited on them one after another).
// SCAN_EARLY: B̄/C̄ and x too are loaded at the chunk's start, with the scalars — with f32
// operands (one block per SM, registers to spare); the 16-bit mode's two blocks per SM
// have no registers for them and load them in the builds.
#define SCAN_EARLY (SCAN_MMA < 2)
// B̄, C̄ (K̃, Q̃) quads come in two regions of every row: the first NQ_ROT quads hold the
// columns n < 2·NANGLES, which turn by rotary angles, the other NQ_FLAT quads none. A thread's
// quad is in one region or the other at compile time, so that the build rotates only the
// quads that turn (at rope fraction 0.5 half of each warp had been rotated by the identity).
#define NQ_ROT (NANGLES / 2)
#define NQ_FLAT (NP / 4 - NQ_ROT)
#define KQ_IT_A ((CHP * NQ_ROT + SCAN_THREADS - 1) / SCAN_THREADS)
#define KQ_IT_B ((CHP * NQ_FLAT + SCAN_THREADS - 1) / SCAN_THREADS)
#define KQ_IT (KQ_IT_A + KQ_IT_B)
#define X_IT ((CHP * (PP / 4) + SCAN_THREADS - 1) / SCAN_THREADS)
struct ChunkIn {
    float lc_end;                // Lc of the chunk's last token
    float4 tok;                  // {Δ, γ, c, Lc} of the row scalar_row() (zero past len)
    float th[PH_Q][PH_TPW];      // θ of the angles and rows the phase steps give this thread
    float phi[PH_Q];             // the phases entering the chunk, of those angles
#if SCAN_EARLY
    float4 k[KQ_IT], q[KQ_IT], x[X_IT];
#endif
};

// This thread's quad of pass `it` over a tile of CHP rows of W quads (four consecutive
// elements each) from column C0 on, taken in the order tid + SCAN_THREADS·it: its row j and
// first column c. When a pass covers whole rows, c is the thread's own and j moves by a
// constant, so that every pass addresses one base plus a constant rather than a register
// of its own.
template <int W, int C0 = 0> struct Quad {
    int j, c;
    __device__ __forceinline__ explicit Quad(int it) {
        const int tid = threadIdx.x;
        if (SCAN_THREADS % W == 0) {
            j = tid / W + it * (SCAN_THREADS / W);
            c = C0 + 4 * (tid % W);
        } else {
            const int e = tid + SCAN_THREADS * it;
            j = e / W;
            c = C0 + 4 * (e % W);
        }
    }
    // (always, when the passes cover the tile exactly: a constant the compiler sees)
    __device__ __forceinline__ bool in_tile() const { return (CHP * W) % SCAN_THREADS == 0 || j < CHP; }
};
// A B̄, C̄, K̃, Q̃ quad: passes [0, KQ_IT_A) over the first region, then the second.
typedef Quad<(NQ_ROT > 0 ? NQ_ROT : 1)> QuadNA;
typedef Quad<(NQ_FLAT > 0 ? NQ_FLAT : 1), 4 * NQ_ROT> QuadNB;
struct QuadN {
    int j, c;
    bool tile;
    __device__ __forceinline__ explicit QuadN(int it) {
        if (it < KQ_IT_A) {
            const QuadNA e(it);
            j = e.j, c = e.c, tile = e.in_tile();
        } else {
            const QuadNB e(it - KQ_IT_A);
            j = e.j, c = e.c, tile = e.in_tile();
        }
    }
    __device__ __forceinline__ bool in_tile() const { return tile; }
};
typedef Quad<PP / 4> QuadP;  // of x rows

// A chunk's B̄ (and C̄) quad, and its x quad, of pass `it`: zeros past its tokens, the
// padding and the tile.
template <bool OUT>
__device__ __forceinline__ void load_bc_quad(const ScanArgs& A, int start, int len, int g, int it, float4& k,
                                             float4& q) {
    const QuadN e(it);
    k = q = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e.in_tile() && e.j < len && e.c < DSTATE) {
        const float* bc = A.bcn + (size_t)(start + e.j) * BC_W;
        k = *reinterpret_cast<const float4*>(bc + g * DSTATE + e.c);
        if (OUT) q = *reinterpret_cast<const float4*>(bc + (NGROUPS + g) * DSTATE + e.c);
    }
}
__device__ __forceinline__ float4 load_x_quad(const ScanArgs& A, int start, int len, int h, int it) {
    const QuadP e(it);
    if (e.in_tile() && e.j < len && e.c < HEADDIM)
        return proj4(A.proj + (size_t)(start + e.j) * PROJ_LD + X_OFF + h * HEADDIM + e.c);
    return make_float4(0.f, 0.f, 0.f, 0.f);
}

// The output's D skip reads x from its operand copy sX with 16-bit operands (the copy's
// rounding is below that of the 16-bit output), not from global memory.
#define SCAN_SKIP_FROM_SX (SCAN_MMA >= 2)

// This warp's gate inputs for its output tiles (fragment layout): xz[tile][row half][x | z]
// [column], f32, zero outside the chunk and the head.
template <int T>
__device__ __forceinline__ void load_gate_inputs(const ScanArgs& A, int start, int len, int h, int y_rb, int y_first,
                                                 int y_nt, float (&xz)[T][2][2][2]) {
    const int lane = threadIdx.x & 31, fg = lane >> 2, ft = lane & 3;
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = 16 * y_rb + fg + 8 * hf, pp = 8 * (y_first + i) + 2 * ft;
            const proj_t* row = A.proj + (size_t)(start + (r < len ? r : 0)) * PROJ_LD + h * HEADDIM + pp;
#if HEADDIM % 2 == 0  // the pair (pp, pp + 1) is 8-byte aligned (PROJ_LD and D_INNER are even)
            const bool ok = i < y_nt && r < len && pp < HEADDIM;
            const float2 zv = ok ? proj2(row + Z_OFF) : make_float2(0.f, 0.f);
            xz[i][hf][1][0] = zv.x;
            xz[i][hf][1][1] = zv.y;
#if !SCAN_SKIP_FROM_SX
            const float2 xv = ok ? proj2(row + X_OFF) : make_float2(0.f, 0.f);
            xz[i][hf][0][0] = xv.x;
            xz[i][hf][0][1] = xv.y;
#endif
#else
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const bool ok = i < y_nt && r < len && pp + u < HEADDIM;
                if (!SCAN_SKIP_FROM_SX) xz[i][hf][0][u] = ok ? proj1(row + X_OFF + u) : 0.f;
                xz[i][hf][1][u] = ok ? proj1(row + Z_OFF + u) : 0.f;
            }
#endif
        }
}

template <bool OUT>
__device__ __forceinline__ void fetch_chunk(const ScanArgs& A, int c, int4 ck, int h, int g, ChunkIn& in) {
    const int start = ck.x, len = ck.y;
    in.lc_end = A.tok[(size_t)(start + len - 1) * NHEADS + h].w;
    const int j = scalar_row();
    in.tok = make_float4(0.f, 0.f, 0.f, 0.f);
    if (j < len) in.tok = A.tok[(size_t)(start + j) * NHEADS + h];
    fetch_theta(A.theta, A.phi0 + ((size_t)c * NHEADS + h) * NANGLES, start, len, in.th, in.phi);
#if SCAN_EARLY
#pragma unroll
    for (int u = 0; u < KQ_IT; ++u) load_bc_quad<OUT>(A, start, len, g, u, in.k[u], in.q[u]);
#pragma unroll
    for (int u = 0; u < X_IT; ++u) in.x[u] = load_x_quad(A, start, len, h, u);
#endif
}
