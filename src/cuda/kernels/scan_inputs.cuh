// How a chunk's inputs reach a block of the chunked scan (scan.cu): the launch's arguments,
// the loads of a chunk's per-token scalars, B̄/C̄ and x quads and gate inputs, and the
// variants that start them a chunk ahead (L1 prefetch; B̄/C̄ staged in shared memory).

struct ScanArgs {
    const float* proj;   // [rows][PROJ_LD]
    const bc_t* bcn;     // [rows][BC_W]
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

// A chunk's scalar inputs as this thread uses them, loaded together at the chunk's start
// (a loop that loaded each where it is used waited on them one after another).
// SCAN_EARLY: B̄/C̄ and x too are loaded at the chunk's start, with the scalars — with f32
// operands (one block per SM, registers to spare); the 16-bit mode's two blocks per SM
// have no registers for them and load them in the builds.
#ifndef SCAN_EARLY
#define SCAN_EARLY (SCAN_MMA < 2)
#endif
// SCAN_EARLY_BC: B̄/C̄ alone loaded at the chunk's start (half the registers with BC16).
#ifndef SCAN_EARLY_BC
#define SCAN_EARLY_BC SCAN_EARLY
#endif
// Four consecutive n of a B̄ or C̄ row as loaded: a float4, or four bc_t in a uint2 (BC16).
#if BC16
typedef uint2 bcq_t;
__device__ __forceinline__ float2 half2_to_f2(unsigned u) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
}
__device__ __forceinline__ float4 bc_unpack(uint2 v) {
    const float2 a = half2_to_f2(v.x), b = half2_to_f2(v.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
#else
typedef float4 bcq_t;
__device__ __forceinline__ float4 bc_unpack(float4 v) { return v; }
#endif
#define KQ_IT ((CHP * (NP / 4) + SCAN_THREADS - 1) / SCAN_THREADS)
#define X_IT ((CHP * (PP / 4) + SCAN_THREADS - 1) / SCAN_THREADS)
struct ChunkIn {
    float lc_end;                // Lc of the chunk's last token
    float4 tok;                  // {Δ, γ, c, Lc} of row tid (tid < len)
    float adv[PH_Q][PH_TPW];     // θ·Δ of the angles and rows the phase steps give this thread
    float phi[PH_Q];             // the phases entering the chunk, of those angles
#if SCAN_EARLY_BC
    bcq_t k[KQ_IT], q[KQ_IT];
#endif
#if SCAN_EARLY
    float4 x[X_IT];
#endif
};

// This thread's quad of pass `it` over a tile of CHP rows of W quads (four consecutive
// elements each), taken in the order tid + SCAN_THREADS·it: its row j and first column c.
// When a pass covers whole rows, c is the thread's own and j moves by a constant, so that
// every pass addresses one base plus a constant rather than a register of its own.
template <int W> struct Quad {
    int j, c;
    __device__ __forceinline__ explicit Quad(int it) {
        const int tid = threadIdx.x;
        if (SCAN_THREADS % W == 0) {
            j = tid / W + it * (SCAN_THREADS / W);
            c = 4 * (tid % W);
        } else {
            const int e = tid + SCAN_THREADS * it;
            j = e / W;
            c = 4 * (e % W);
        }
    }
    __device__ __forceinline__ bool in_tile() const { return j < CHP; }
};
typedef Quad<NP / 4> QuadN;  // of B̄, C̄, K̃, Q̃ rows
typedef Quad<PP / 4> QuadP;  // of x rows

// A chunk's B̄ (and C̄) quad, and its x quad, of pass `it`: zeros past its tokens, the
// padding and the tile.
template <bool OUT>
__device__ __forceinline__ void load_bc_quad(const ScanArgs& A, int start, int len, int g, int it, bcq_t& k,
                                             bcq_t& q) {
    const QuadN e(it);
    k = q = bcq_t{};
    if (e.in_tile() && e.j < len && e.c < DSTATE) {
        const bc_t* bc = A.bcn + (size_t)(start + e.j) * BC_W;
        k = *reinterpret_cast<const bcq_t*>(bc + g * DSTATE + e.c);
        if (OUT) q = *reinterpret_cast<const bcq_t*>(bc + (NGROUPS + g) * DSTATE + e.c);
    }
}
__device__ __forceinline__ float4 load_x_quad(const ScanArgs& A, int start, int len, int h, int it) {
    const QuadP e(it);
    if (e.in_tile() && e.j < len && e.c < HEADDIM)
        return *reinterpret_cast<const float4*>(A.proj + (size_t)(start + e.j) * PROJ_LD + X_OFF + h * HEADDIM +
                                                e.c);
    return make_float4(0.f, 0.f, 0.f, 0.f);
}

// The output's D skip reads x from its operand copy sX with 16-bit operands (the copy's
// rounding is below that of the 16-bit output), not from global memory.
#ifndef SCAN_SKIP_FROM_SX
#define SCAN_SKIP_FROM_SX (SCAN_MMA >= 2)
#endif

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
            const float* row = A.proj + (size_t)(start + (r < len ? r : 0)) * PROJ_LD + h * HEADDIM + pp;
#if HEADDIM % 2 == 0  // the pair (pp, pp + 1) is 8-byte aligned (PROJ_LD and D_INNER are even)
            const bool ok = i < y_nt && r < len && pp < HEADDIM;
            const float2 zv = ok ? *reinterpret_cast<const float2*>(row + Z_OFF) : make_float2(0.f, 0.f);
            xz[i][hf][1][0] = zv.x;
            xz[i][hf][1][1] = zv.y;
#if !SCAN_SKIP_FROM_SX
            const float2 xv = ok ? *reinterpret_cast<const float2*>(row + X_OFF) : make_float2(0.f, 0.f);
            xz[i][hf][0][0] = xv.x;
            xz[i][hf][0][1] = xv.y;
#endif
#else
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const bool ok = i < y_nt && r < len && pp + u < HEADDIM;
                if (!SCAN_SKIP_FROM_SX) xz[i][hf][0][u] = ok ? row[X_OFF + u] : 0.f;
                xz[i][hf][1][u] = ok ? row[Z_OFF + u] : 0.f;
            }
#endif
        }
}

template <bool OUT>
__device__ __forceinline__ void fetch_chunk(const ScanArgs& A, int c, int4 ck, int h, int g, ChunkIn& in) {
    const int start = ck.x, len = ck.y, tid = threadIdx.x;
    in.lc_end = A.tok[(size_t)(start + len - 1) * NHEADS + h].w;
    in.tok = make_float4(0.f, 0.f, 0.f, 0.f);
    if (tid < len) in.tok = A.tok[(size_t)(start + tid) * NHEADS + h];
    fetch_phases(A.theta, A.tok, h, A.phi0 + ((size_t)c * NHEADS + h) * NANGLES, start, len, in.adv, in.phi);
#if SCAN_EARLY_BC
#pragma unroll
    for (int u = 0; u < KQ_IT; ++u)
        load_bc_quad<OUT>(A, start, len, g, u, in.k[u], in.q[u]);
#endif
#if SCAN_EARLY
#pragma unroll
    for (int u = 0; u < X_IT; ++u) in.x[u] = load_x_quad(A, start, len, h, u);
#endif
}

// SCAN_PREFETCH_L1: the lines chunk c's fetch_chunk reads first (its rows' {Δ, γ, c, Lc}
// and θ, its entering phases; with SCAN_PREFETCH_X its x rows too) asked of L1 while the
// chunk before computes: latency hidden without registers, which the block has none to
// spare for. 1: after the operand builds of the chunk before; 2: before its state update. (Asking L2
// for all of a chunk's inputs, one piece per thread, was 3–6 % slower: docs/benchmarks.md.)
#ifndef SCAN_PREFETCH_L1
#define SCAN_PREFETCH_L1 0
#endif
#ifndef SCAN_PREFETCH_X
#define SCAN_PREFETCH_X 0
#endif
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
// The lines of a row of N floats at p: one per 32 floats, and its last (rows need not
// start on a line).
template <int N> __device__ __forceinline__ const float* row_line(const float* p, int i) {
    return p + (32 * i < N ? 32 * i : N - 1);
}
__device__ __forceinline__ void prefetch_chunk(const ScanArgs& A, int c, int h) {
    constexpr int TH = (NANGLES + 31) / 32 + 1, XL = SCAN_PREFETCH_X ? (HEADDIM + 31) / 32 + 1 : 0;
    constexpr int PER_ROW = 1 + TH + XL;
    const int4 ck = A.chunks[c];
    for (int e = threadIdx.x; e < CHP * PER_ROW; e += SCAN_THREADS) {
        const int j = e / PER_ROW, l = e % PER_ROW;
        if (j >= ck.y) continue;
        const size_t row = ck.x + j;
        if (l == 0) prefetch_l1(A.tok + row * NHEADS + h);
        else if (l <= TH) prefetch_l1(row_line<NANGLES>(A.theta + row * NANGLES, l - 1));
        else prefetch_l1(row_line<HEADDIM>(A.proj + row * PROJ_LD + X_OFF + h * HEADDIM, l - 1 - TH));
    }
    if (threadIdx.x < 2) prefetch_l1(row_line<NANGLES>(A.phi0 + ((size_t)c * NHEADS + h) * NANGLES, threadIdx.x));
}

// SCAN_BC_STAGE (with BC16): chunk c's B̄/C̄ rows copied into shared memory by cp.async
// while the chunk before computes, into the tiles that are dead from its Y = Q̃Sᵀ on: C̄
// into sQ's rows, where each thread then turns its quads into Q̃ in place, B̄ into sS's
// (same row length), which K̃ is built from before S's copy is stored there. The build then
// waits on shared memory instead of a round trip to L2, for one barrier more per chunk
// (before S's copy) and no registers or shared memory.
#ifndef SCAN_BC_STAGE
#define SCAN_BC_STAGE 0
#endif
#if SCAN_BC_STAGE && !(BC16 && DSTATE % 8 == 0 && PP >= CHP && LDSO == LDK)
#undef SCAN_BC_STAGE
#define SCAN_BC_STAGE 0
#endif
#if SCAN_BC_STAGE
// A thread copies consecutive 16-byte pieces of one row (SCAN_THREADS / CHP threads a row):
// one base address each side, the rest immediate offsets.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
template <bool OUT>
__device__ __forceinline__ void stage_bc(const ScanArgs& A, int c, int g, op_t* sQ, op_t* sS) {
    constexpr int PIECES = DSTATE / 8, TPR = SCAN_THREADS / CHP, PPT = (PIECES + TPR - 1) / TPR;
    const int4 ck = A.chunks[c];
    const int j = threadIdx.x / TPR, n0 = 8 * PPT * (threadIdx.x % TPR);
    if (j < ck.y) {
        const bc_t* row = A.bcn + (size_t)(ck.x + j) * BC_W + g * DSTATE + n0;
        const unsigned to_b = smem_addr(sS + j * LDK + n0), to_c = smem_addr(sQ + j * LDQ + n0);
#pragma unroll
        for (int k = 0; k < PPT; ++k) {
            if (n0 + 8 * k >= DSTATE) break;
            cp_async16(to_b + 16 * k, row + 8 * k);
            if (OUT) cp_async16(to_c + 16 * k, row + NGROUPS * DSTATE + 8 * k);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
#endif
__device__ __forceinline__ void stage_wait() {
#if SCAN_BC_STAGE
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
