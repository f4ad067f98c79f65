// The chunked scan of the prefill (spec §4), parallel over chunks as well as heads.
// CPU twin: `HeadScan::chunk` in src/mixers/mamba3/chunk.rs, whose module doc holds the mathematics:
//
//   y_j = Σ_{s<j} e^{Lc_j − Lc_s}·c_s·⟨q̃_j, k̃_s⟩·x_s + γ_j·⟨q̃_j, k̃_j⟩·x_j + e^{Lc_j}·S·q̃_j + D·x_j
//   S'  = e^{Lc_end}·S + Σ_s e^{Lc_end − Lc_s}·c_s·outer(x_s, k̃_s)
//
// A sequence's chunks are grouped in segments of consecutive chunks. Three launches:
//   scan_states  (phase A): per (segment, head), the state the segment alone would leave
//                from zero, S_seg, and its total log-decay — for every segment but a
//                sequence's last;
//   scan_pass    (phase B): per (sequence, head), walks the segments: the state entering
//                the first is the carried state with the boundary fold (spec §3.4),
//                S_enter = h⁻ + Δ_0(1 − λ_0)·outer(v⁻, k⁻); each next one is
//                e^{decay}·S_enter + S_seg. Written over S_seg in place;
//   scan_outputs (phase C): per (segment, head), from S_enter, the outputs of every chunk
//                (gated, spec §2.6), and for a sequence's last segment the final state.
//
// Inside a chunk, four warp-level matrix products on shared-memory tiles, accumulated in
// registers (fragment layout of mma.sync m16n8k*, below):
//   M = Q̃K̃ᵀ (the lower block triangle only), weighted in registers by the causal decay
//   and trapezoid weights and stored as an operand;  Y = Q̃Sᵀ, rows scaled by e^{Lc_j};
//   Y += M·X, then D skip and gate straight from the accumulators;
//   S ← e^{Lc_end}·S + (wX)ᵀK̃ — S lives in registers, f32, for the whole segment, and a
//   copy in the operand type feeds the next chunk's Q̃Sᵀ.
// The products and the SCAN_MMA modes are in scan_tiles.cuh, the rotary phases in
// scan_phases.cuh, the loads of a chunk's inputs in scan_inputs.cuh.
//
// Segment table entry (int4): {first chunk, chunks, sequence, flags (1 first, 2 last)}.

// The chunk's per-token tables in shared memory, CHP floats each, in this order (scan_body
// and weigh_m both index them by it).
enum TokTable { TOK_GAM, TOK_SC, TOK_LC, TOK_ELC, TOK_XW, TOK_EML, TOK_TABLES };
#define SZ_TOKV ALIGN128(TOK_TABLES * CHP * 4)
#define SZ_RED ALIGN128(CHP * SCAN_WARPS * 4 + 2 * SCAN_WARPS * NANGLES * 4 + 7 * 4)
#define SCAN_SMEM (SCAN_TILES + SZ_TOKV + SZ_RED + SZ_BIAS)

// k steps unrolled in the forward's products: all of them on the tensor cores (ldmatrix
// fragments); a few with exact f32 FMA.
#if SCAN_MMA == 0
#define SCAN_KUNROLL 2
#elif SCAN_MMA == 1
#define SCAN_KUNROLL 4
#else
#define SCAN_KUNROLL 16
#endif
// Global loads issued together in the operand builds (registers permitting; 4 against 2 in
// the 16-bit modes: B=8 T=4096 fast −2.5 %, B=1 T=16384 −2.4 to −2.8 %, H100, 2026-12-05).
#define SCAN_LOAD_BATCH 4
// Two blocks per SM when they fit (the 16-bit mode at the benchmark shape).
#define SCAN_MINB (SCAN_SMEM <= 110 * 1024 ? 2 : 1)

// Read by the host (cuModuleGetGlobal) to size the launch.
extern "C" __device__ int scan_smem_bytes = SCAN_SMEM;
extern "C" __device__ int scan_threads = SCAN_THREADS;

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
// Rotate the pairs (x, y) and (z, w) by the angles whose (cos, sin) are cs.xy and cs.zw.
__device__ __forceinline__ void rotate4(float4& v, float4 cs) {
    const float a = v.x, b = v.y, c = v.z, d = v.w;
    v.x = a * cs.x - b * cs.y;
    v.y = a * cs.y + b * cs.x;
    v.z = c * cs.z - d * cs.w;
    v.w = c * cs.w + d * cs.z;
}

// f16 operands (SCAN_MMA 3, and 2 in f16 models) keep TF32's mantissa but overflow past
// 65504. The data-dependent ones are stored scaled by a power of two per chunk: 1 while a
// bound on the chunk's magnitudes is below 2^14, else what brings it there; the products'
// results are scaled back, exactly. The bounds, known before the operands are built:
//   x, w ⊙ x:  max|x| · max(1, max c)                (w_j = e^{Lc_end − Lc_j}·c_j ≤ c_j)
//   M:         qk · max(c, γ)     (|⟨q̃_r, k̃_s⟩| ≤ qk, from the norm weights and biases;
//                                  the decay weights are ≤ c_s, the diagonal's γ_r)
//   S's copy:  its own maximum, taken when the previous chunk updates it.
// q̃ and k̃ themselves are bounded by the same weights, which the host checks.
#if SCAN_MMA == 3 || (SCAN_MMA == 2 && ACT == 2)
#define SCAN_SCALED 1
#else
#define SCAN_SCALED 0
#endif
// The exponent e ≥ 0 with m·2^−e < 2^14 (m ≥ 0; 0 in unscaled builds).
__device__ __forceinline__ int f16_shift(float m) {
#if SCAN_SCALED
    const int e = ((__float_as_int(m) >> 23) & 0xff) - 127;
    return e > 13 ? e - 13 : 0;
#else
    return 0;
#endif
}
// With f16 in_proj rows and f16 operands scaled per chunk, a thread keeps its x quads as
// stored (two registers each, not four) from the load for the chunk's maximum, before the
// chunk's first barrier, to the build, instead of loading them twice.
#define SCAN_X_RAW (SCAN_SCALED && PROJ_F16)
#if SCAN_X_RAW
// (load_x_quad's quad, not unpacked)
__device__ __forceinline__ uint2 load_x_raw(const ScanArgs& A, int start, int len, int h, int it) {
    const QuadP e(it);
    if (e.in_tile() && e.j < len && e.c < HEADDIM)
        return *reinterpret_cast<const uint2*>(A.proj + (size_t)(start + e.j) * PROJ_LD + X_OFF + h * HEADDIM + e.c);
    return make_uint2(0u, 0u);
}
// max |x| over the quads: the sign bits cleared, the halves compared as f16 pairs.
__device__ __forceinline__ float raw_abs_max(const uint2 (&q)[X_IT]) {
    __half2 m = __float2half2_rn(0.f);
#pragma unroll
    for (int u = 0; u < X_IT; ++u) {
        const unsigned a = q[u].x & 0x7fff7fffu, b = q[u].y & 0x7fff7fffu;
        m = __hmax2(m, __hmax2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b)));
    }
    return fmaxf(__low2float(m), __high2float(m));
}
#endif

__device__ __forceinline__ float slot_max(const int* slot) { return __int_as_float(*slot); }
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }
// Fold this thread's magnitude m into the block maximum at `slot` (non-negative floats
// order as their bits do).
__device__ __forceinline__ void max_into(int* slot, float m) {
#if SCAN_SCALED
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) atomicMax(slot, __float_as_int(m));
#endif
}

template <int T> __device__ __forceinline__ float abs_max(const float (&acc)[T][4]) {
    float m[4] = {0.f, 0.f, 0.f, 0.f};  // four independent chains, not one of 4T
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) m[e] = fmaxf(m[e], fabsf(acc[i][e]));
    return fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
}

// M's weights, in place, times `down` (SCAN_SCALED's shift of M): e^{Lc_r − Lc_s}·c_s below
// the diagonal (SPLIT: as e^{Lc_r}·(e^{−Lc_s}·c_s), from the chunk's tables; else per pair),
// γ_r on it, 0 above.
// SPLIT is block-uniform and chosen outside, so that the loop has no branches (choosing
// per pair, with a guard per tile, took ≈ 15 instructions a pair instead of ≈ 8). The
// tiles past the warp's causal count are weighted too, and not stored (with an even
// tiling they lie inside the chunk, so their table reads do too).
// s_tok: the chunk's per-token tables (TokTable).
template <bool SPLIT>
__device__ __forceinline__ void weigh_m(float (&macc)[TileM::T][4], int m_rb, int m_first, int m_nt,
                                        const float* s_tok, float down) {
    const float *s_gam = s_tok + TOK_GAM * CHP, *s_sc = s_tok + TOK_SC * CHP, *s_lc = s_tok + TOK_LC * CHP,
                *s_elc = s_tok + TOK_ELC * CHP, *s_eml = s_tok + TOK_EML * CHP;
    constexpr bool even = TileM::NT % TileM::WPR == 0;
    const int lane = threadIdx.x & 31, fg = lane >> 2, ft = lane & 3;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * m_rb + fg + 8 * hf;
        const float er = s_elc[r] * down, lr = s_lc[r], gam = s_gam[r] * down;
#pragma unroll
        for (int i = 0; i < TileM::T; ++i) {
            if (!even && i >= m_nt) break;
            const int s = 8 * (m_first + i) + 2 * ft;
            float d[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                d[u] = SPLIT ? er * s_eml[s + u] : expf(lr - s_lc[s + u]) * (s_sc[s + u] * down);
                d[u] = s + u < r ? d[u] : (s + u == r ? gam : 0.f);
                macc[i][2 * hf + u] *= d[u];
            }
        }
    }
}

// K̃ (and Q̃) for passes [IT0, IT0 + IT) of QuadN: B̄ (C̄) quads plus the head's bias,
// turned pairwise by the chunk's rotary table (ROT: the region whose columns have angles),
// stored as operands. Straight-line code: a branch per quad, and the bias reloaded after
// every shared store, were a third of the build's instructions. Rows past the chunk's
// tokens are not zeroed: their B̄, C̄ load as zero, so they hold the bias (the table turns
// them by (1, 0)), and it meets only zero weights — c and γ are zero there, so M's columns
// and w ⊙ X's rows are — or outputs that are dropped (Y's rows past `len`).
// Loads go in batches of BATCH passes, all issued before the batch's shared stores (which
// the compiler would not move them across).
template <bool OUT, bool ROT, int IT0, int IT>
__device__ __forceinline__ void build_kq(const ScanArgs& A, const ChunkIn& in, int start, int len, int g,
                                         const float* s_bb, const float* s_cb, const float* s_cs, op_t* sK, op_t* sQ) {
    if (IT == 0) return;
    // (1 for an empty region too: the arrays below need a size even where they are not used)
    constexpr int BATCH = IT == 0 ? 1 : SCAN_EARLY ? IT : IT < SCAN_LOAD_BATCH ? IT : SCAN_LOAD_BATCH;
    // a thread's column is its own for every quad when the passes cover whole rows
    constexpr int W = ROT ? NQ_ROT : NQ_FLAT;
    constexpr bool fixed_col = W > 0 && SCAN_THREADS % W == 0;
    float4 bk = make_float4(0.f, 0.f, 0.f, 0.f), bq = bk;
    if (fixed_col) {  // (s_bb, s_cb are zero past DSTATE, to NP)
        bk = *reinterpret_cast<const float4*>(s_bb + QuadN(IT0).c);
        if (OUT) bq = *reinterpret_cast<const float4*>(s_cb + QuadN(IT0).c);
    }
#pragma unroll
    for (int i0 = 0; i0 < IT; i0 += BATCH) {
        float4 kv[BATCH], qv[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            if (i0 + u >= IT) break;
#if SCAN_EARLY
            kv[u] = in.k[IT0 + i0 + u];
            qv[u] = in.q[IT0 + i0 + u];
#else
            load_bc_quad<OUT>(A, start, len, g, IT0 + i0 + u, kv[u], qv[u]);
#endif
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const QuadN e(IT0 + i0 + u);
            const int j = e.j, n = e.c;
            if (i0 + u >= IT || !e.in_tile()) break;
            if (!fixed_col) {
                bk = *reinterpret_cast<const float4*>(s_bb + n);
                if (OUT) bq = *reinterpret_cast<const float4*>(s_cb + n);
            }
            float4 k = add4(kv[u], bk), q = add4(qv[u], bq);
            if (ROT) {  // angles n/2 and n/2 + 1 (NANGLES is even)
                const float4 cs = *reinterpret_cast<const float4*>(s_cs + cs_index(j, n / 2));
                rotate4(k, cs);
                if (OUT) rotate4(q, cs);
            }
            put_quad(sK + j * LDK + n, k);
            if (OUT) put_quad(sQ + j * LDQ + n, q);
        }
    }
}

// The final k and v states (spec §3.2), in f32: the sequence's last token (row `row` of
// the proj, `j` of the chunk) — its key biased and turned as build_kq turns it, and its x.
// Once per sequence, so not in the builds' passes, where a store per quad cost a branch.
__device__ __forceinline__ void final_kv(const ScanArgs& A, size_t row, int j, int g, int h, const float* s_bb,
                                         const float* s_cs, const LayerSt& st) {
    for (int e = threadIdx.x; e < NP / 4 + HEADDIM; e += SCAN_THREADS) {
        if (e < NP / 4) {
            const int n = 4 * e;
            if (n >= DSTATE) continue;
            float4 k = add4(*reinterpret_cast<const float4*>(A.bcn + row * BC_W + g * DSTATE + n),
                            *reinterpret_cast<const float4*>(s_bb + n));
            if (n / 2 < NANGLES) rotate4(k, *reinterpret_cast<const float4*>(s_cs + cs_index(j, n / 2)));
            *reinterpret_cast<float4*>(st.k + h * DSTATE + n) = k;
        } else {
            const int pp = e - NP / 4;
            st.v[h * HEADDIM + pp] = proj1(A.proj + row * PROJ_LD + X_OFF + h * HEADDIM + pp);
        }
    }
}

template <int PHASE>
__device__ __forceinline__ void scan_body(const ScanArgs& A) {
    constexpr bool OUT = PHASE == 1;
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* p = smem;
    op_t* sQ = reinterpret_cast<op_t*>(p);
    p += SZ_Q;
    op_t* sK = reinterpret_cast<op_t*>(p);
    p += SZ_K;
    op_t* sX = reinterpret_cast<op_t*>(p);
    p += SZ_X;
    op_t* sW = reinterpret_cast<op_t*>(p);
    p += SZ_W;
    op_t* sM = reinterpret_cast<op_t*>(p);
    float* s_cs = reinterpret_cast<float*>(p);  // [CHP][NANGLES] (cos, sin); aliases sM (dead by then)
    p += SZ_MCS;
    op_t* sS = reinterpret_cast<op_t*>(p);
    p += SZ_SO;
    float* s_tok = reinterpret_cast<float*>(p);
    float* s_gam = s_tok + TOK_GAM * CHP;
    float* s_sc = s_tok + TOK_SC * CHP;  // c_j (zero on padding rows)
    float* s_lc = s_tok + TOK_LC * CHP;
    float* s_elc = s_tok + TOK_ELC * CHP;  // e^{Lc_j}
    float* s_xw = s_tok + TOK_XW * CHP;    // e^{Lc_end − Lc_j}·c_j
    float* s_eml = s_tok + TOK_EML * CHP;  // e^{−Lc_j}·c_j (when `split`)
    p += SZ_TOKV;
    float* s_rs = reinterpret_cast<float*>(p);    // [CHP][SCAN_WARPS] row sums of squares
    float* s_ph = s_rs + CHP * SCAN_WARPS;        // [SCAN_WARPS][NANGLES] phase partial sums
    // block maxima for the scaled operands (SCAN_SCALED), two of each by chunk parity:
    // [0, 1] |S| entering the chunk, [2, 3] |x|, [4, 5] c and γ
    int* s_max = reinterpret_cast<int*>(s_ph + 2 * SCAN_WARPS * NANGLES);
    // this head's D (a global load where the skip needs it waited out a round trip, ≈ 4 % of
    // the stall samples; a register across the chunk loop is one the block does not have)
    float* s_dskip = reinterpret_cast<float*>(s_max + 6);
    p += SZ_RED;
    float* s_bb = reinterpret_cast<float*>(p);    // this head's B_bias, C_bias
    float* s_cb = s_bb + NP;

    griddep_wait();
    griddep_launch();
    // Grid (H, positions) when the blocks fill more than one wave: heads fastest, so that
    // the order's longest segments start first. Else (positions, H), the block order from
    // before the order table, which measured 1.5 % faster for a single wave (why is not
    // known: which blocks share an SM differs).
    const bool heads_fastest = A.heads_fastest;
    const int h = heads_fastest ? blockIdx.x : blockIdx.y, si = A.order[heads_fastest ? blockIdx.y : blockIdx.x];
    const int4 sg = A.segs[si];
    const bool last_seg = sg.w & 2;
    if (PHASE == 0 && last_seg) return;
    const int g = h / HEADS_PER_GROUP, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, fg = lane >> 2, ft = lane & 3;
    float* sb = A.sbuf + ((size_t)si * NHEADS + h) * HEADDIM * DSTATE;
    const LayerSt st = layer_st(A.states[sg.z], A.layer);

    for (int n = tid; n < NP; n += SCAN_THREADS) {
        s_bb[n] = n < DSTATE ? A.b_bias[h * DSTATE + n] : 0.f;
        s_cb[n] = n < DSTATE ? A.c_bias[h * DSTATE + n] : 0.f;
    }
    if (tid == 0) *s_dskip = A.d_skip[h];  // (read after the chunk loop's barriers)
#if SCAN_SCALED
    if (tid < 6) s_max[tid] = 0;
    __syncthreads();
#endif
    // The state of this warp's tiles of S (rows p, columns n), in registers.
    const int s_rb = TileS::rb(warp), s_first = TileS::first(warp), s_nt = TileS::count(warp);
    float sacc[TileS::T][4];
#pragma unroll
    for (int i = 0; i < TileS::T; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pp = 16 * s_rb + fg + 8 * (e >> 1), n = 8 * (s_first + i) + 2 * ft + (e & 1);
            sacc[i][e] = (OUT && i < s_nt && pp < HEADDIM && n < DSTATE) ? sb[pp * DSTATE + n] : 0.f;
        }
    if (OUT) max_into(&s_max[sg.x & 1], abs_max(sacc));
    float decay_sum = 0.f;

    for (int c = sg.x; c < sg.x + sg.y; ++c) {
        const int4 ck = A.chunks[c];
        const int start = ck.x, len = ck.y;
        const bool seq_end = start + len == ck.z;
        const bool last_chunk = c == sg.x + sg.y - 1;
        ChunkIn in;
        fetch_chunk<OUT>(A, c, ck, h, g, in);
#if SCAN_X_RAW
        // x as it is stored (f16), for its maximum before the barrier and the build after it
        uint2 xq[X_IT];
#pragma unroll
        for (int u = 0; u < X_IT; ++u) xq[u] = load_x_raw(A, start, len, h, u);
#elif SCAN_SCALED
        // x for its maximum, loaded before the barrier (used after it) and again by the
        // build, from L1
        float4 xq[X_IT];
#pragma unroll
        for (int u = 0; u < X_IT; ++u) xq[u] = load_x_quad(A, start, len, h, u);
#endif
        __syncthreads();  // the previous chunk's readers are done
        const int par = c & 1;
        if (OUT) {
            // S entering the chunk, in the operand type, for Y = Q̃Sᵀ.
            // Scaled by `down` only when it is not 1 (most chunks): a copy per case.
            const float down = pow2(-f16_shift(slot_max(&s_max[par])));
            auto copy = [&](float f) {
#pragma unroll
                for (int i = 0; i < TileS::T; ++i) {
                    if (i >= s_nt) break;
                    const int n = 8 * (s_first + i) + 2 * ft;
                    op_t* row = sS + (16 * s_rb + fg) * LDSO + n;
                    put_pair(row, sacc[i][0] * f, sacc[i][1] * f);
                    put_pair(row + 8 * LDSO, sacc[i][2] * f, sacc[i][3] * f);
                }
            };
            if (down == 1.f) copy(1.f);
            else copy(down);
        }
#if SCAN_SCALED
        // the next chunk's maxima start from zero (their slots were last read above, one
        // chunk ago, before the barrier)
        if (tid < 3) s_max[2 * tid + (par ^ 1)] = 0;
#endif
        // Per-token scalars; padding rows get zero weights and the chunk's end decay. The
        // decay between two tokens, e^{Lc_r − Lc_s}, is formed as e^{Lc_r}·e^{−Lc_s} when
        // e^{−Lc_s} cannot overflow (as the CPU twin does), else per pair.
        const float lc_end = in.lc_end;
        const bool split = -lc_end < 60.f;
        const int tok_row = scalar_row();
        if (lane < PH_TPW) {
            const int j = tok_row;
            const float4 v = j < len ? in.tok : make_float4(0.f, 0.f, 0.f, lc_end);
            s_gam[j] = v.y;
            s_sc[j] = v.z;
            s_lc[j] = v.w;
            s_elc[j] = expf(v.w);
            s_xw[j] = expf(lc_end - v.w) * v.z;
            s_eml[j] = split ? expf(-v.w) * v.z : 0.f;
        }
#if SCAN_SCALED
        {
#if SCAN_X_RAW
            const float m = raw_abs_max(xq);
#else
            float m = 0.f;
#pragma unroll
            for (int u = 0; u < X_IT; ++u)
                m = fmaxf(m, fmaxf(fmaxf(fabsf(xq[u].x), fabsf(xq[u].y)), fmaxf(fabsf(xq[u].z), fabsf(xq[u].w))));
#endif
            max_into(&s_max[2 + par], m);
            max_into(&s_max[4 + par], lane < PH_TPW && tok_row < len ? fmaxf(fabsf(in.tok.y), fabsf(in.tok.z)) : 0.f);
        }
#endif
        {
            float dt[PH_TPW];  // Δ of this warp's rows, from the lanes that loaded them
#pragma unroll
            for (int u = 0; u < PH_TPW; ++u) dt[u] = __shfl_sync(0xffffffffu, in.tok.x, u);
            phase_sums(in.th, dt, s_ph);
        }
        __syncthreads();
#if SCAN_SCALED
        const float cg_max = slot_max(&s_max[4 + par]);
        const int x_shift = f16_shift(slot_max(&s_max[2 + par]) * fmaxf(1.f, cg_max));
        const int m_shift = f16_shift(A.qk * cg_max);
#else
        const int x_shift = 0, m_shift = 0;
#endif
        phase_table(in.th, in.phi, len, s_cs, s_ph);
        __syncthreads();
        // K̃ (and Q̃): the quads that turn, then the others. (The warp barrier keeps the
        // second region's loads from being hoisted over the first's work: with them in
        // flight together the accurate build spilled 16 bytes.)
        build_kq<OUT, true, 0, KQ_IT_A>(A, in, start, len, g, s_bb, s_cb, s_cs, sK, sQ);
        __syncwarp();
        build_kq<OUT, false, KQ_IT_A, KQ_IT_B>(A, in, start, len, g, s_bb, s_cb, s_cs, sK, sQ);
        // X and w ⊙ X, times `x_down` (SCAN_SCALED).
        const float x_down = pow2(-x_shift);
#if HEADDIM % 4 == 0
        {
            constexpr int IT = X_IT;
            constexpr int BATCH = SCAN_EARLY ? IT : IT < 4 ? IT : 4;
#pragma unroll
            for (int i0 = 0; i0 < IT; i0 += BATCH) {
                float4 xv[BATCH];
#pragma unroll
                for (int u = 0; u < BATCH; ++u) {
#if SCAN_X_RAW
                    xv[u] = unpack_half4(xq[i0 + u]);
#elif SCAN_EARLY
                    xv[u] = in.x[i0 + u];
#else
                    xv[u] = load_x_quad(A, start, len, h, i0 + u);
#endif
                }
#pragma unroll
                for (int u = 0; u < BATCH; ++u) {
                    const QuadP e(i0 + u);
                    const int j = e.j, pp = e.c;
                    if (i0 + u >= IT || !e.in_tile()) break;
                    const float4 x = xv[u];
#if SCAN_X_RAW
                    // (x_shift is the block's: one branch for all; unscaled, the f16 copy is x)
                    if (OUT && x_shift == 0) *reinterpret_cast<uint2*>(sX + j * LDX + pp) = xq[i0 + u];
                    else
#endif
                    if (OUT) put_quad(sX + j * LDX + pp, make_float4(x.x * x_down, x.y * x_down, x.z * x_down, x.w * x_down));
                    const float w = s_xw[j] * x_down;
                    put_quad(sW + j * LDW + pp, make_float4(x.x * w, x.y * w, x.z * w, x.w * w));
                }
            }
        }
#else
        for (int e = tid; e < CHP * (PP / 2); e += SCAN_THREADS) {
            const int j = e / (PP / 2), pp = 2 * (e % (PP / 2));
            float x0 = 0.f, x1 = 0.f;
            if (j < len && pp < HEADDIM) {
                const proj_t* xr = A.proj + (size_t)(start + j) * PROJ_LD + X_OFF + h * HEADDIM + pp;
                x0 = proj1(xr);
                if (pp + 1 < HEADDIM) x1 = proj1(xr + 1);
            }
            if (OUT) put_pair(sX + j * LDX + pp, x0 * x_down, x1 * x_down);
            const float w = s_xw[j] * x_down;
            put_pair(sW + j * LDW + pp, x0 * w, x1 * w);
        }
#endif
        if (OUT && seq_end) final_kv(A, start + len - 1, len - 1, g, h, s_bb, s_cs, st);
        __syncthreads();
        if (OUT) {
            // M = Q̃K̃ᵀ on the lower block triangle, weighted, stored as an operand.
            const int m_rb = TileM::rb(warp), m_first = TileM::first(warp);
            int m_nt = TileM::count(warp);
            {
                const int causal = (16 * m_rb + 16) / 8 - m_first;  // tiles left of the diagonal's end
                m_nt = m_nt < causal ? m_nt : (causal < 0 ? 0 : causal);
            }
            float macc[TileM::T][4];
            zero_acc(macc);
            const op_t* qa = sQ + 16 * m_rb * LDQ;
            const op_t* kb = sK + 8 * m_first * LDK;
            // When every warp has T tiles, a warp with any causal tile computes all T (a
            // constant count keeps the guards out of the k loop; the extra tiles lie inside
            // the tile and are not stored).
            constexpr bool even = TileM::NT % TileM::WPR == 0;
            if (m_nt > 0) {
#pragma unroll SCAN_KUNROLL
                for (int k0 = 0; k0 < NP; k0 += KSTEP)
                    mma_kstep<TileM::T, true, true, true>(macc, qa, LDQ, kb, LDK, k0, even ? TileM::T : m_nt);
            }
            const float down = pow2(-m_shift);
            if (split) weigh_m<true>(macc, m_rb, m_first, m_nt, s_tok, down);
            else weigh_m<false>(macc, m_rb, m_first, m_nt, s_tok, down);
            // (stored in a loop of its own: weighting and storing in one made the 16-bit
            // build spill more)
#pragma unroll
            for (int i = 0; i < TileM::T; ++i) {
                if (i >= m_nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 16 * m_rb + fg + 8 * hf, s = 8 * (m_first + i) + 2 * ft;
                    put_pair(sM + r * LDM + s, macc[i][2 * hf], macc[i][2 * hf + 1]);
                }
            }
        }
        const int y_rb = TileY::rb(warp), y_first = TileY::first(warp), y_nt = TileY::count(warp);
        float yacc[TileY::T][4];
        // The gate's z (and x) are loaded before both of Y's products, so that their
        // latency hides behind them. (Loaded just before Y += M·X, they were waited for:
        // 8 % of the stall samples, B=8 T=4096 24.40 → 23.97 ms on an H100; loaded before
        // M = Q̃K̃ᵀ, the registers held that long cost more than they gained.)
        float xz[TileY::T][2][2][2];  // [tile][row half][x | z][column]
        if (OUT) load_gate_inputs(A, start, len, h, y_rb, y_first, y_nt, xz);
        if (OUT) {
            // Y = diag(e^{Lc})·Q̃Sᵀ, in the units of M·X as stored (S's copy was scaled down
            // by its own shift).
            zero_acc(yacc);
            const op_t* qa = sQ + 16 * y_rb * LDQ;
            const op_t* sbp = sS + 8 * y_first * LDSO;
#pragma unroll SCAN_KUNROLL
            for (int k0 = 0; k0 < NP; k0 += KSTEP) mma_kstep<TileY::T, true, true, true>(yacc, qa, LDQ, sbp, LDSO, k0, y_nt);
            const float f = pow2(f16_shift(slot_max(&s_max[par])) - m_shift - x_shift);
            const float e0 = s_elc[16 * y_rb + fg] * f, e1 = s_elc[16 * y_rb + fg + 8] * f;
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                yacc[i][0] *= e0;
                yacc[i][1] *= e0;
                yacc[i][2] *= e1;
                yacc[i][3] *= e1;
            }
        }
        if (OUT) {
            __syncthreads();  // sM complete; every reader of sS is done (phase A writes neither)
            // Y += M·X over the causal columns, then the D skip and the gate (spec §2.6).
            const op_t* ma = sM + 16 * y_rb * LDM;
            const op_t* xb = sX + 8 * y_first;
            // causal: M is zero right of the diagonal block (k0 < 16·y_rb + 16). A constant
            // trip count with a break, not a counted loop: the count, hoisted out of the chunk
            // loop, was spilled and reloaded every chunk (≈ 5 % of the stall samples). Fully
            // unrolled when it is at most 4 steps (16-bit operands, chunk 64); 2 at a time
            // otherwise (more would spill).
#if CHP / KSTEP <= 4
#pragma unroll
#else
#pragma unroll 2
#endif
            for (int k0 = 0; k0 < CHP; k0 += KSTEP) {
                if (k0 >= 16 * y_rb + 16) break;
                mma_kstep<TileY::T, true, false, true>(yacc, ma, LDM, xb, LDX, k0, y_nt);
            }
#if SCAN_SCALED
            if (m_shift + x_shift) scale_acc(yacc, pow2(m_shift + x_shift));  // (block-uniform)
#endif
#if SCAN_SKIP_FROM_SX
            // sX was stored scaled down by 2^x_shift: D takes the scale back (exact, one
            // product instead of one per element)
            const float dsk = *s_dskip * pow2(x_shift);
#else
            const float dsk = *s_dskip;
#endif
            float ss[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                if (i >= y_nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 16 * y_rb + fg + 8 * hf;
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        // rows past the chunk and padding columns: x = 0, and Y is 0 there
                        float& v = yacc[i][2 * hf + u];
#if SCAN_SKIP_FROM_SX
                        const float x = to_f(sX[r * LDX + 8 * (y_first + i) + 2 * ft + u]);
#else
                        const float x = xz[i][hf][0][u];
#endif
                        v = r < len ? v + dsk * x : 0.f;
                        ss[hf] += v * v;
                    }
                }
            }
#if OUTNORM
            // Per-row sums of squares: the quad's lanes, then the warps sharing the row.
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                ss[hf] += __shfl_xor_sync(0xffffffffu, ss[hf], 1);
                ss[hf] += __shfl_xor_sync(0xffffffffu, ss[hf], 2);
                if (ft == 0) s_rs[(16 * y_rb + fg + 8 * hf) * SCAN_WARPS + warp % TileY::WPR] = ss[hf];
            }
            __syncthreads();
            float inv[2];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float tot = 0.f;
                for (int w = 0; w < TileY::WPR; ++w) tot += s_rs[(16 * y_rb + fg + 8 * hf) * SCAN_WARPS + w];
                inv[hf] = 1.f / sqrtf(tot / (float)HEADDIM + NORM_EPS);
            }
#endif
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                if (i >= y_nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 16 * y_rb + fg + 8 * hf, pp = 8 * (y_first + i) + 2 * ft;
                    if (r >= len || pp >= HEADDIM) continue;
                    const size_t at = (size_t)(start + r) * D_INNER + h * HEADDIM + pp;
                    float out[2] = {0.f, 0.f};
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        if (pp + u >= HEADDIM) break;
                        float v = yacc[i][2 * hf + u];
                        if (A.y_pre) A.y_pre[at + u] = v;
#if OUTNORM
                        v = v * inv[hf] * A.out_norm[h * HEADDIM + pp + u];
#endif
                        out[u] = v * silu_approx_f(xz[i][hf][1][u]);
                    }
#if HEADDIM % 2 == 0
                    store_pair(A.y + at, out[0], out[1]);
#else
                    A.y[at] = from_f<act_t>(out[0]);
                    if (pp + 1 < HEADDIM) A.y[at + 1] = from_f<act_t>(out[1]);
#endif
                }
            }
        }
        // S ← e^{Lc_end}·S + (wX)ᵀK̃ (the last chunk of a middle segment needs none).
        if (!(OUT && last_chunk && !last_seg)) {
            scale_acc(sacc, expf(lc_end) * pow2(-x_shift));  // w ⊙ x was stored scaled down
            const op_t* wa = sW + 16 * s_rb;
            const op_t* kb = sK + 8 * s_first;
#pragma unroll SCAN_KUNROLL
            for (int k0 = 0; k0 < CHP; k0 += KSTEP) mma_kstep<TileS::T, false, false, true>(sacc, wa, LDW, kb, LDK, k0, s_nt);
#if SCAN_SCALED
            if (x_shift) scale_acc(sacc, pow2(x_shift));
#endif
            // the next chunk stores it as an operand, scaled by this maximum
            if (OUT && !last_chunk) max_into(&s_max[par ^ 1], abs_max(sacc));
        }
        decay_sum += lc_end;
    }
    // S_seg (phase A) or the sequence's final state (phase C, last segment), from registers.
    if (PHASE == 0 || last_seg) {
        state_t* fin = st.ssm + (size_t)h * HEADDIM * DSTATE;
#pragma unroll
        for (int i = 0; i < TileS::T; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int pp = 16 * s_rb + fg + 8 * (e >> 1), n = 8 * (s_first + i) + 2 * ft + (e & 1);
                if (!(i < s_nt && pp < HEADDIM && n < DSTATE)) continue;
                if (PHASE == 0) sb[pp * DSTATE + n] = sacc[i][e];
                else st_store(fin + pp * DSTATE + n, sacc[i][e]);
            }
        if (PHASE == 0 && tid == 0) A.sdecay[si * NHEADS + h] = decay_sum;
    }
}

#if IN_PART(PART_SCAN)
extern "C" __global__ void __launch_bounds__(SCAN_THREADS, SCAN_MINB) scan_states(ScanArgs a) { scan_body<0>(a); }
extern "C" __global__ void __launch_bounds__(SCAN_THREADS, SCAN_MINB) scan_outputs(ScanArgs a) { scan_body<1>(a); }
#endif

// Phase B: state passing across segments, seeded with the folded carried state.
// Grid (sequences, H, tiles of 4·PASS_THREADS state elements). The segments' states and
// decays are read PASS_BATCH at a time, ahead of the walk that needs them. (Nsight
// Compute, B=8 T=4096 on an H100: 36 µs a layer at 8 % of the SMs, with 138 registers a
// thread — one block per SM for a grid of 1536 blocks, each thread's walk a few dependent
// round trips to memory. `PASS_BATCH=8 PASS_MINB=4` takes 64 registers, no stack, four
// blocks per SM, and was no faster: B=8 T=4096 24.92, 25.11 ms against 25.07, B=1 2 %
// slower; docs/decisions.md, "scan_pass blocks per SM".)
// Sequence table entry (int4): {first chunk, chunks, first segment, segments}.
#define PASS_BATCH 16
#define PASS_MINB 1
#define PASS_THREADS 256
#if IN_PART(PART_ROWS)
extern "C" __global__ void __launch_bounds__(PASS_THREADS, PASS_MINB)
    scan_pass(const int4* __restrict__ seqs, const int4* __restrict__ chunks,
              const float4* __restrict__ tok, float* __restrict__ sbuf,
              const float* __restrict__ sdecay, float* const* __restrict__ states, int layer) {
    griddep_wait();
    griddep_launch();
    const int4 sq = seqs[blockIdx.x];
    const int h = blockIdx.y;
    const int e = (blockIdx.z * PASS_THREADS + threadIdx.x) * 4;
    if (e >= HEADDIM * DSTATE) return;
    const LayerSt st = layer_st(states[blockIdx.x], layer);
    const float4 t0 = tok[(size_t)chunks[sq.x].x * NHEADS + h];
    const float w0 = t0.x - t0.y;  // Δ_0(1 − λ_0)
    const int pp = e / DSTATE, n = e % DSTATE;
    const float wv = w0 * st.v[h * HEADDIM + pp];
    float4 s = st_load4(st.ssm + h * HEADDIM * DSTATE + e);
    const float* kk = st.k + h * DSTATE + n;
    s.x += wv * kk[0];
    s.y += wv * kk[1];
    s.z += wv * kk[2];
    s.w += wv * kk[3];
    const int end = sq.z + sq.w;
    for (int b0 = sq.z; b0 < end; b0 += PASS_BATCH) {
        float4 seg[PASS_BATCH];
        float dec[PASS_BATCH];
#pragma unroll
        for (int i = 0; i < PASS_BATCH; ++i) {
            const int sgi = b0 + i;
            if (sgi < end - 1) {
                seg[i] = *reinterpret_cast<const float4*>(sbuf + ((size_t)sgi * NHEADS + h) * HEADDIM * DSTATE + e);
                dec[i] = sdecay[sgi * NHEADS + h];
            }
        }
#pragma unroll
        for (int i = 0; i < PASS_BATCH; ++i) {
            const int sgi = b0 + i;
            if (sgi >= end) break;
            float4* b = reinterpret_cast<float4*>(sbuf + ((size_t)sgi * NHEADS + h) * HEADDIM * DSTATE + e);
            *b = s;
            if (sgi < end - 1) {
                const float d = expf(dec[i]);
                const float4 t = seg[i];
                s = make_float4(fmaf(d, s.x, t.x), fmaf(d, s.y, t.y), fmaf(d, s.z, t.z), fmaf(d, s.w, t.w));
            }
        }
    }
}
#endif
