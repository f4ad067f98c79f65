// Warp-level matrix products on shared-memory tiles, for the chunked scans — Mamba-3's
// (mixers/mamba3/cuda/kernels/scan.cu) and its backward (scan_bwd.cu), Mamba-2's
// (mixers/mamba2/cuda/kernels/ssd_chunk.cu): the operand type, the fragment loads, and how
// the warps of a block share an output. Needs CHUNK, HEADDIM, DSTATE, NANGLES (0 without
// rotation) and SCAN_MMA defined.
//
// SCAN_MMA: 0 exact f32 FMA (the same fragment layout, no tensor cores), 1 TF32 tensor
// cores (m16n8k8), 2 bf16/f16 tensor cores (m16n8k16, operands rounded to act_t), 3 f16
// tensor cores whatever act_t (the mantissa of TF32 at the cost and size of 16 bits); f32
// accumulation in every mode. Tiles are padded to multiples of 16 with zeros, so any
// chunk length ≤ 128, headdim ≤ 128 and d_state fit.


// Row extents are padded to 16, 32, 64 or 128 (whole row blocks per warp), column and
// reduction extents to a multiple of 16.
#define PAD16(x) (((x) + 15) / 16 * 16)
#define PADROWS(x) ((x) <= 16 ? 16 : (x) <= 32 ? 32 : (x) <= 64 ? 64 : 128)
#define CHP PADROWS(CHUNK)
#define PP PADROWS(HEADDIM)
#define NP PAD16(DSTATE)

#if SCAN_MMA >= 2
#if SCAN_MMA == 3
typedef __half op_t;
#else
typedef act_t op_t;
#endif
#define KSTEP 16
#define PADA 8  // row pads (elements) against bank conflicts of the fragment loads
#define PADB 8
#else
typedef float op_t;
#define KSTEP 8
#define PADA 4
#define PADB 8
#endif

#define OP_BYTES (SCAN_MMA >= 2 ? 2 : 4)  // sizeof(op_t), where the preprocessor needs it

// Leading dimensions (elements) of the forward's operand tiles (scan.cu), and their sizes.
#define LDQ (NP + PADA)   // sQ [CHP][LDQ]: q̃ (A operand)
#define LDK (NP + PADA)   // sK [CHP][LDK]: k̃ (B operand of Q̃K̃ᵀ and of the state update)
#define LDX (PP + PADB)   // sX [CHP][LDX]: x
#define LDW (PP + PADB)   // sW [CHP][LDW]: w ⊙ x (A operand, transposed, of the state update)
#define LDM (CHP + PADA)  // sM [CHP][LDM]: the weighted M
#define LDSO (NP + PADA)  // sS [PP][LDSO]: S in the operand type

#define ALIGN128(x) (((x) + 127) / 128 * 128)
#define SZ_Q ALIGN128(CHP * LDQ * OP_BYTES)
#define SZ_K ALIGN128(CHP * LDK * OP_BYTES)
#define SZ_X ALIGN128(CHP * LDX * OP_BYTES)
#define SZ_W ALIGN128(CHP * LDW * OP_BYTES)
#define SZ_M ALIGN128(CHP * LDM * OP_BYTES)
#define SZ_CS ALIGN128(2 * CHP * NANGLES * 4)
#define SZ_MCS (SZ_M > SZ_CS ? SZ_M : SZ_CS)  // cos/sin die before M is written
#define SZ_SO ALIGN128(PP * LDSO * OP_BYTES)
#define SZ_BIAS ALIGN128(2 * NP * 4)
// The operand tiles of the forward. Mind the total (with scan.cu's few KB of scalars): at
// the benchmark shape with f32 operands the block takes 163.75 KB, just inside the 164 KB
// shared-memory carve-out that leaves L1 92 KB; 35 KB more (transposed copies of x, wx
// and k̃ for ldmatrix) moved it to the 228 KB carve-out (L1 28 KB) and cost 11 % at
// B=8 T=4096 — more than the instructions it saved (docs/decisions.md, "Shared memory is worth more as L1"). The loads each
// chunk issues at its start (SCAN_EARLY, ≈ 80 KB) are staged in L1.
#define SCAN_TILES (SZ_Q + SZ_K + SZ_X + SZ_W + SZ_MCS + SZ_SO)

// Threads of a scan block (the host reads `scan_threads`). 512 for the forward with f32
// operands when its tiles allow one block per SM only: 16 warps instead of 8 hide more of
// the latency the products and builds wait on (B=8 T=4096 on the H200: 46.0 vs 51.4 ms),
// and each warp's smaller share of the tiles fits 128 registers. Otherwise 256 (the
// 16-bit mode's two blocks per SM would spill at 64 registers; the training program's
// backward is written for 8 warps).
#if SCAN_MMA < 2 && !defined(PROGRAM_TRAINING) && SCAN_TILES > 110 * 1024
#define SCAN_THREADS 512
#else
#define SCAN_THREADS 256
#endif
#define SCAN_WARPS (SCAN_THREADS / 32)

// ---- warp-level products ------------------------------------------------------------------
// Fragment layout of mma.sync m16n8k*: lane = 4g + t. The accumulator of a 16×8 tile holds
// c[0] (g, 2t), c[1] (g, 2t+1), c[2] (g+8, 2t), c[3] (g+8, 2t+1). A is 16×KSTEP row-major,
// B is KSTEP×8.

__device__ __forceinline__ unsigned pack2(op_t lo, op_t hi);
#if SCAN_MMA >= 2
__device__ __forceinline__ unsigned pack2(op_t lo, op_t hi) {
    unsigned short l = *reinterpret_cast<unsigned short*>(&lo), h = *reinterpret_cast<unsigned short*>(&hi);
    return (unsigned)l | ((unsigned)h << 16);
}
#endif
__device__ __forceinline__ unsigned tf32_bits(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(tf32_bits(x)); }

#if SCAN_MMA != 0
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
// ldmatrix moves 8×8 matrices of 16-bit elements; on 32-bit (TF32) data the same
// instruction moves 8×4 matrices, and non-transposed that is the fragment layout of
// m16n8k8 (a row per lane quad, column = lane mod 4).
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const op_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const op_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2(unsigned (&r)[4], const op_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x2_t(unsigned (&r)[4], const op_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
#endif
#if SCAN_MMA == 3
// m16n8k16 on f16 operands (dtypes.cuh's mma16816 takes act_t's type).
__device__ __forceinline__ void mma_op(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#elif SCAN_MMA == 2
__device__ __forceinline__ void mma_op(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma16816(c, a, b0, b1);
}
#endif
#if SCAN_MMA == 1
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// acc[i] += A[0..16)[k0..k0+KSTEP) · B[k0..k0+KSTEP)[8i..8i+8) for the tiles i < nt.
// A: element (m, k) at A[m·lda + k] when AK ("k contiguous"), else at A[k·lda + m].
// B: element (k, n) at B[n·ldb + k] when BK, else at B[k·ldb + n].
template <bool AK>
__device__ __forceinline__ op_t a_at(const op_t* A, int lda, int m, int k) {
    return AK ? A[m * lda + k] : A[k * lda + m];
}
// ROUNDED: the operands were rounded to TF32 when stored (the forward's put_pair and
// put_quad do), so SCAN_MMA 1 loads them as they are, k-contiguous ones by ldmatrix.
template <int T, bool AK, bool BK, bool ROUNDED = false>
__device__ __forceinline__ void mma_kstep(float (&acc)[T][4], const op_t* A, int lda, const op_t* B,
                                          int ldb, int k0, int nt) {
    const int lane = threadIdx.x & 31;
#if SCAN_MMA < 2
    const int g = lane >> 2, t = lane & 3;
#endif
#if SCAN_MMA == 0
#pragma unroll
    for (int i = 0; i < T; ++i) {
        if (i >= nt) break;
        const int n0 = 8 * i + 2 * t;
#pragma unroll
        for (int k = k0; k < k0 + KSTEP; ++k) {
            const float a0 = a_at<AK>(A, lda, g, k), a1 = a_at<AK>(A, lda, g + 8, k);
            const float b0 = BK ? B[n0 * ldb + k] : B[k * ldb + n0];
            const float b1 = BK ? B[(n0 + 1) * ldb + k] : B[k * ldb + n0 + 1];
            acc[i][0] = fmaf(a0, b0, acc[i][0]);
            acc[i][1] = fmaf(a0, b1, acc[i][1]);
            acc[i][2] = fmaf(a1, b0, acc[i][2]);
            acc[i][3] = fmaf(a1, b1, acc[i][3]);
        }
    }
#elif SCAN_MMA == 1
    if (ROUNDED) {
        const int mi = lane >> 3, r = lane & 7;
        unsigned a[4];
        if (AK) {
            ldsm_x4(a, A + ((mi & 1) * 8 + r) * lda + k0 + (mi >> 1) * 4);
        } else {
            a[0] = __float_as_uint(A[(k0 + t) * lda + g]);
            a[1] = __float_as_uint(A[(k0 + t) * lda + g + 8]);
            a[2] = __float_as_uint(A[(k0 + t + 4) * lda + g]);
            a[3] = __float_as_uint(A[(k0 + t + 4) * lda + g + 8]);
        }
#pragma unroll
        for (int i = 0; i < T; i += 2) {
            if (i >= nt) break;
            const bool two = i + 1 < nt;
            unsigned b[4];
            if (BK) {  // matrices (i, k lo), (i, k hi), (i+1, k lo), (i+1, k hi)
                const op_t* at = B + (8 * (i + (mi >> 1)) + r) * ldb + k0 + (mi & 1) * 4;
                if (two) ldsm_x4(b, at);
                else ldsm_x2(b, B + (8 * i + r) * ldb + k0 + (mi & 1) * 4);
            } else {
                b[0] = __float_as_uint(B[(k0 + t) * ldb + 8 * i + g]);
                b[1] = __float_as_uint(B[(k0 + t + 4) * ldb + 8 * i + g]);
                if (two) {
                    b[2] = __float_as_uint(B[(k0 + t) * ldb + 8 * i + 8 + g]);
                    b[3] = __float_as_uint(B[(k0 + t + 4) * ldb + 8 * i + 8 + g]);
                }
            }
            mma_tf32(acc[i], a, b[0], b[1]);
            if (two) mma_tf32(acc[i + 1 < T ? i + 1 : i], a, b[2], b[3]);
        }
        return;
    }
    const unsigned a0 = tf32_bits(a_at<AK>(A, lda, g, k0 + t)), a1 = tf32_bits(a_at<AK>(A, lda, g + 8, k0 + t));
    const unsigned a2 = tf32_bits(a_at<AK>(A, lda, g, k0 + t + 4));
    const unsigned a3 = tf32_bits(a_at<AK>(A, lda, g + 8, k0 + t + 4));
#pragma unroll
    for (int i = 0; i < T; ++i) {
        if (i >= nt) break;
        const int n = 8 * i + g;
        const unsigned b0 = tf32_bits(BK ? B[n * ldb + k0 + t] : B[(k0 + t) * ldb + n]);
        const unsigned b1 = tf32_bits(BK ? B[n * ldb + k0 + t + 4] : B[(k0 + t + 4) * ldb + n]);
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
#else
    // ldmatrix: lane l gives the row address of 8×8 matrix l/8; .trans hands out the
    // transposed fragment, which is how the "not contiguous in k" operands are read.
    const int mi = lane >> 3, r = lane & 7;
    unsigned a[4];
    if (AK) ldsm_x4(a, A + ((mi & 1) * 8 + r) * lda + k0 + (mi >> 1) * 8);
    else ldsm_x4_t(a, A + (k0 + (mi >> 1) * 8 + r) * lda + (mi & 1) * 8);
#pragma unroll
    for (int i = 0; i < T; i += 2) {
        if (i >= nt) break;
        unsigned b[4];
        if (i + 1 < nt) {  // tiles i and i+1: matrices (i, k lo), (i, k hi), (i+1, k lo), (i+1, k hi)
            const int tile = i + (mi >> 1), kh = (mi & 1) * 8;
            if (BK) ldsm_x4(b, B + (8 * tile + r) * ldb + k0 + kh);
            else ldsm_x4_t(b, B + (k0 + kh + r) * ldb + 8 * tile);
        } else {
            const int kh = (mi & 1) * 8;
            if (BK) ldsm_x2(b, B + (8 * i + r) * ldb + k0 + kh);
            else ldsm_x2_t(b, B + (k0 + kh + r) * ldb + 8 * i);
        }
        mma_op(acc[i], a, b[0], b[1]);
        if (i + 1 < nt) mma_op(acc[i + 1 < T ? i + 1 : i], a, b[2], b[3]);
    }
#endif
}

// How the SCAN_WARPS warps share an output of ROWS × COLS (multiples of 16 and 8): row
// blocks of 16 rows, each split among WPR warps into runs of T tiles of 8 columns.
template <int ROWS, int COLS> struct Tiling {
    static constexpr int RB = ROWS / 16;
    static_assert(RB >= 1 && RB <= SCAN_WARPS && SCAN_WARPS % RB == 0, "row blocks per warp");
    static constexpr int WPR = SCAN_WARPS / RB;
    static constexpr int NT = COLS / 8;
    static constexpr int T = (NT + WPR - 1) / WPR;
    __device__ static int rb(int warp) { return warp / WPR; }
    __device__ static int first(int warp) { return (warp % WPR) * T; }
    // every warp has T tiles when the columns split evenly (a constant the compiler sees)
    __device__ static int count(int warp) {
        if (NT % WPR == 0) return T;
        const int n = NT - first(warp);
        return n < 0 ? 0 : (n < T ? n : T);
    }
};
typedef Tiling<CHP, CHP> TileM;  // M = Q̃K̃ᵀ
typedef Tiling<CHP, PP> TileY;   // Y
typedef Tiling<PP, NP> TileS;    // S

template <int T> __device__ __forceinline__ void zero_acc(float (&acc)[T][4]) {
#pragma unroll
    for (int i = 0; i < T; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}
template <int T> __device__ __forceinline__ void scale_acc(float (&acc)[T][4], float f) {
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] *= f;
}

// Store a pair (row r, columns n, n+1) of op_t (rounded to TF32 in SCAN_MMA 1).
__device__ __forceinline__ void put_pair(op_t* p, float a, float b) {
#if SCAN_MMA >= 2
    *reinterpret_cast<unsigned*>(p) = pack2(from_f<op_t>(a), from_f<op_t>(b));
#elif SCAN_MMA == 1
    *reinterpret_cast<float2*>(p) = make_float2(tf32_round(a), tf32_round(b));
#else
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
#endif
}

// One op_t (rounded to TF32 in SCAN_MMA 1).
__device__ __forceinline__ void put_one(op_t* p, float v) {
#if SCAN_MMA >= 2
    *p = from_f<op_t>(v);
#elif SCAN_MMA == 1
    *p = tf32_round(v);
#else
    *p = v;
#endif
}

// Four consecutive op_t (8 or 16 bytes, aligned).
__device__ __forceinline__ void put_quad(op_t* p, float4 v) {
#if SCAN_MMA >= 2
    *reinterpret_cast<uint2*>(p) =
        make_uint2(pack2(from_f<op_t>(v.x), from_f<op_t>(v.y)), pack2(from_f<op_t>(v.z), from_f<op_t>(v.w)));
#elif SCAN_MMA == 1
    *reinterpret_cast<float4*>(p) = make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
#else
    *reinterpret_cast<float4*>(p) = v;
#endif
}
