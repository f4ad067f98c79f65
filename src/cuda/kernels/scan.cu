// The chunked scan of the prefill (spec §4), parallel over chunks as well as heads.
// CPU twin: `scan_head` in src/cpu/prefill.rs, whose module doc holds the mathematics:
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
// Inside a chunk the four products Q̃K̃ᵀ, M·X, Q̃·Sᵀ and (wX)ᵀK̃ run on shared-memory tiles:
// SCAN_MMA 0 exact f32 FMA, 1 TF32 tensor cores (f32 accumulate), 2 bf16/f16 tensor cores
// (operands rounded to act_t, f32 accumulate). The state S itself is always f32.
//
// Segment table entry (int4): {first chunk, chunks, sequence, flags (1 first, 2 last)}.

#define SCAN_THREADS 256
#define SCAN_WARPS (SCAN_THREADS / 32)

#if SCAN_MMA == 2
typedef act_t op_t;
#define PADO 8
#else
typedef float op_t;
#define PADO 4
#endif
#define PADF 4
#define LDQ (DSTATE + PADO)
#define LDX (HEADDIM + PADO)
#define LDM (CHUNK + PADO)
#define LDS (DSTATE + PADF)
#define LDMF (CHUNK + PADF)
#define LDY (HEADDIM + PADF)

#define ALIGN128(x) (((x) + 127) / 128 * 128)
#define SZ_Q ALIGN128(CHUNK * LDQ * (int)sizeof(op_t))
#define SZ_X ALIGN128(CHUNK * LDX * (int)sizeof(op_t))
#define SZ_S ALIGN128(HEADDIM * LDS * 4)
#define SZ_MF ALIGN128(CHUNK * LDMF * 4)
#if SCAN_MMA == 2
#define SZ_SO ALIGN128(HEADDIM * LDQ * (int)sizeof(op_t))
#define SZ_MO ALIGN128(CHUNK * LDM * (int)sizeof(op_t))
#else
#define SZ_SO 0
#define SZ_MO 0
#endif
#define SZ_Y ALIGN128(CHUNK * LDY * 4)
#define SZ_CS ALIGN128(2 * CHUNK * NANGLES * 4)
#define SZ_SC ALIGN128(4 * CHUNK * 4)
#define SCAN_SMEM (2 * SZ_Q + 2 * SZ_X + SZ_S + SZ_SO + SZ_MF + SZ_MO + SZ_Y + SZ_CS + SZ_SC)

// Read by the host (cuModuleGetGlobal) to size the launch.
extern "C" __device__ int scan_smem_bytes = SCAN_SMEM;
extern "C" __device__ int prefill_pre_smem_bytes = PRE_SMEM_FLOATS * 4;

template <bool COL> struct wlay { typedef nvcuda::wmma::row_major t; };
template <> struct wlay<true> { typedef nvcuda::wmma::col_major t; };

// C[M][N] = (acc ? c_scale·C : 0) + A·B on shared-memory tiles; element (m,k) of A is
// A[A_COL ? k·lda + m : m·lda + k], element (k,n) of B is B[B_COL ? n·ldb + k : k·ldb + n].
template <int M, int N, int K, bool A_COL, bool B_COL>
__device__ __forceinline__ void mm(float* C, int ldc, const op_t* A, int lda, const op_t* B,
                                   int ldb, bool acc, float c_scale) {
#if SCAN_MMA == 0
    for (int e = threadIdx.x; e < M * N; e += SCAN_THREADS) {
        int m = e / N, n = e % N;
        float s = 0.f;
#pragma unroll 8
        for (int k = 0; k < K; ++k)
            s = fmaf(A_COL ? A[k * lda + m] : A[m * lda + k], B_COL ? B[n * ldb + k] : B[k * ldb + n], s);
        C[m * ldc + n] = acc ? fmaf(c_scale, C[m * ldc + n], s) : s;
    }
#else
    using namespace nvcuda;
#if SCAN_MMA == 1
    constexpr int KS = 8;
    typedef wmma::precision::tf32 frag_t;
#else
    constexpr int KS = 16;
    typedef act_t frag_t;
#endif
    const int warp = threadIdx.x >> 5;
    for (int t = warp; t < (M / 16) * (N / 16); t += SCAN_WARPS) {
        const int tm = t / (N / 16), tn = t % (N / 16);
        float* cp = C + tm * 16 * ldc + tn * 16;
        wmma::fragment<wmma::accumulator, 16, 16, KS, float> c;
        if (acc) {
            wmma::load_matrix_sync(c, cp, ldc, wmma::mem_row_major);
#pragma unroll
            for (int i = 0; i < c.num_elements; ++i) c.x[i] *= c_scale;
        } else {
            wmma::fill_fragment(c, 0.f);
        }
#pragma unroll 2
        for (int k = 0; k < K; k += KS) {
            wmma::fragment<wmma::matrix_a, 16, 16, KS, frag_t, typename wlay<A_COL>::t> a;
            wmma::fragment<wmma::matrix_b, 16, 16, KS, frag_t, typename wlay<B_COL>::t> b;
            wmma::load_matrix_sync(a, A_COL ? A + k * lda + tm * 16 : A + tm * 16 * lda + k, lda);
            wmma::load_matrix_sync(b, B_COL ? B + tn * 16 * ldb + k : B + k * ldb + tn * 16, ldb);
#if SCAN_MMA == 1
#pragma unroll
            for (int i = 0; i < a.num_elements; ++i) a.x[i] = wmma::__float_to_tf32(a.x[i]);
#pragma unroll
            for (int i = 0; i < b.num_elements; ++i) b.x[i] = wmma::__float_to_tf32(b.x[i]);
#endif
            wmma::mma_sync(c, a, b, c);
        }
        wmma::store_matrix_sync(cp, c, ldc, wmma::mem_row_major);
    }
#endif
}

struct ScanArgs {
    const float* proj;   // [rows][PROJ_LD]
    const float* bcn;    // [rows][BC_W]
    const float4* tok;   // [rows][H] {Δ, γ, c, Lc}
    const float* theta;  // [rows][S]
    const float* phi0;   // [chunk][H][S]
    const int4* chunks;  // {start, len, seq end, seq}
    const int4* segs;    // {first chunk, chunks, seq, flags}
    const float* b_bias;
    const float* c_bias;
    const float* d_skip;
    const float* out_norm;  // [D_INNER] or null
    float* sbuf;            // [seg][H][P][N]: S_seg (A), S_enter (B, C)
    float* sdecay;          // [seg][H]
    act_t* y;               // [rows][D_INNER]
    float* const* states;   // per sequence
    int layer;
};

template <int PHASE>
__device__ __forceinline__ void scan_body(const ScanArgs& A) {
    extern __shared__ __align__(128) unsigned char smem[];
    op_t* Q = reinterpret_cast<op_t*>(smem);
    op_t* K = reinterpret_cast<op_t*>(smem + SZ_Q);
    op_t* X = reinterpret_cast<op_t*>(smem + 2 * SZ_Q);
    op_t* Xw = reinterpret_cast<op_t*>(smem + 2 * SZ_Q + SZ_X);
    float* S = reinterpret_cast<float*>(smem + 2 * SZ_Q + 2 * SZ_X);
    unsigned char* p = smem + 2 * SZ_Q + 2 * SZ_X + SZ_S;
#if SCAN_MMA == 2
    op_t* So = reinterpret_cast<op_t*>(p);
    p += SZ_SO;
#else
    op_t* So = S;
#endif
    float* Mf = reinterpret_cast<float*>(p);
    p += SZ_MF;
#if SCAN_MMA == 2
    op_t* Mo = reinterpret_cast<op_t*>(p);
    p += SZ_MO;
    constexpr int ldso = LDQ, ldmo = LDM;
#else
    op_t* Mo = Mf;
    constexpr int ldso = LDS, ldmo = LDMF;
#endif
    float* Y = reinterpret_cast<float*>(p);
    p += SZ_Y;
    float* s_cos = reinterpret_cast<float*>(p);
    float* s_sin = s_cos + CHUNK * NANGLES;
    p += SZ_CS;
    float* s_dt = reinterpret_cast<float*>(p);
    float* s_gam = s_dt + CHUNK;
    float* s_sc = s_gam + CHUNK;
    float* s_lc = s_sc + CHUNK;

    griddep_wait();
    griddep_launch();
    const int4 sg = A.segs[blockIdx.x];
    const bool last_seg = sg.w & 2;
    if (PHASE == 0 && last_seg) return;
    const int h = blockIdx.y, g = h / HEADS_PER_GROUP, tid = threadIdx.x;
    float* sb = A.sbuf + ((size_t)blockIdx.x * NHEADS + h) * HEADDIM * DSTATE;
    float* st = A.states[sg.z] + (size_t)A.layer * ST_LAYER;

    for (int e = tid; e < HEADDIM * DSTATE; e += SCAN_THREADS)
        S[(e / DSTATE) * LDS + e % DSTATE] = PHASE == 0 ? 0.f : sb[e];
    float decay_sum = 0.f;

    for (int c = sg.x; c < sg.x + sg.y; ++c) {
        const int4 ck = A.chunks[c];
        const int start = ck.x, len = ck.y;
        const bool last_chunk = c == sg.x + sg.y - 1;
        __syncthreads();
        for (int j = tid; j < len; j += SCAN_THREADS) {
            float4 v = A.tok[(size_t)(start + j) * NHEADS + h];
            s_dt[j] = v.x;
            s_gam[j] = v.y;
            s_sc[j] = v.z;
            s_lc[j] = v.w;
        }
        __syncthreads();
        const float lc_end = s_lc[len - 1];
        for (int j = len + tid; j < CHUNK; j += SCAN_THREADS) {
            s_dt[j] = 0.f;
            s_gam[j] = 0.f;
            s_sc[j] = 0.f;
            s_lc[j] = lc_end;
        }
        // Phases inside the chunk (spec §2.4): φ_j = wrap(φ_enter + Σ_{j' ≤ j} θ_j'·Δ_j'),
        // the sum as a warp scan over tokens, one warp per angle.
        {
            const int lane = tid & 31, warp = tid >> 5;
            for (int i = warp; i < NANGLES; i += SCAN_WARPS) {
                float base = A.phi0[((size_t)c * NHEADS + h) * NANGLES + i];
                for (int j0 = 0; j0 < len; j0 += 32) {
                    const int j = j0 + lane;
                    float v = j < len ? A.theta[(size_t)(start + j) * NANGLES + i] * s_dt[j] : 0.f;
#pragma unroll
                    for (int o = 1; o < 32; o <<= 1) {
                        const float t = __shfl_up_sync(0xffffffffu, v, o);
                        if (lane >= o) v += t;
                    }
                    if (j < len) {
                        float sn, cs;
                        sincosf(wrap_angle_f(base + v), &sn, &cs);
                        s_cos[j * NANGLES + i] = cs;
                        s_sin[j * NANGLES + i] = sn;
                    }
                    base += __shfl_sync(0xffffffffu, v, 31);
                }
            }
        }
        __syncthreads();
        // K̃ (and Q̃): biased, rotated pairwise; rows past the chunk's tokens are zero.
        for (int e = tid; e < CHUNK * (DSTATE / 2); e += SCAN_THREADS) {
            const int j = e / (DSTATE / 2), i = e % (DSTATE / 2), n = 2 * i;
            float k0 = 0.f, k1 = 0.f, q0 = 0.f, q1 = 0.f;
            if (j < len) {
                const float* bc = A.bcn + (size_t)(start + j) * BC_W;
                k0 = bc[g * DSTATE + n] + A.b_bias[h * DSTATE + n];
                k1 = bc[g * DSTATE + n + 1] + A.b_bias[h * DSTATE + n + 1];
                q0 = bc[(NGROUPS + g) * DSTATE + n] + A.c_bias[h * DSTATE + n];
                q1 = bc[(NGROUPS + g) * DSTATE + n + 1] + A.c_bias[h * DSTATE + n + 1];
                if (i < NANGLES) {
                    const float cs = s_cos[j * NANGLES + i], sn = s_sin[j * NANGLES + i];
                    float a = k0, b = k1;
                    k0 = a * cs - b * sn;
                    k1 = a * sn + b * cs;
                    a = q0, b = q1;
                    q0 = a * cs - b * sn;
                    q1 = a * sn + b * cs;
                }
            }
            K[j * LDQ + n] = from_f<op_t>(k0);
            K[j * LDQ + n + 1] = from_f<op_t>(k1);
            if (PHASE == 1) {
                Q[j * LDQ + n] = from_f<op_t>(q0);
                Q[j * LDQ + n + 1] = from_f<op_t>(q1);
            }
            // The final k state: the last token's rotated key, in f32 (spec §3.2).
            if (PHASE == 1 && j == len - 1 && start + len == ck.z) {
                st[ST_K + h * DSTATE + n] = k0;
                st[ST_K + h * DSTATE + n + 1] = k1;
            }
        }
        for (int e = tid; e < CHUNK * HEADDIM; e += SCAN_THREADS) {
            const int j = e / HEADDIM, pp = e % HEADDIM;
            const float x = j < len ? A.proj[(size_t)(start + j) * PROJ_LD + X_OFF + h * HEADDIM + pp] : 0.f;
            if (PHASE == 1) X[j * LDX + pp] = from_f<op_t>(x);
            Xw[j * LDX + pp] = from_f<op_t>(x * expf(lc_end - s_lc[j]) * s_sc[j]);
            if (PHASE == 1 && j == len - 1 && start + len == ck.z) st[ST_V + h * HEADDIM + pp] = x;
        }
        __syncthreads();
        if (PHASE == 1) {
            // M = Q̃K̃ᵀ, then the causal decay and trapezoid weights.
            mm<CHUNK, CHUNK, DSTATE, false, true>(Mf, LDMF, Q, LDQ, K, LDQ, false, 0.f);
            __syncthreads();
            for (int e = tid; e < CHUNK * CHUNK; e += SCAN_THREADS) {
                const int j = e / CHUNK, s = e % CHUNK;
                const float w = s < j ? expf(s_lc[j] - s_lc[s]) * s_sc[s] : (s == j ? s_gam[j] : 0.f);
                Mo[j * ldmo + s] = from_f<op_t>(Mf[j * LDMF + s] * w);
            }
            // Q̃ rows take the inter-chunk decay e^{Lc_j}.
            for (int e = tid; e < CHUNK * DSTATE; e += SCAN_THREADS) {
                const int j = e / DSTATE, n = e % DSTATE;
                Q[j * LDQ + n] = from_f<op_t>(to_f(Q[j * LDQ + n]) * expf(s_lc[j]));
            }
#if SCAN_MMA == 2
            for (int e = tid; e < HEADDIM * DSTATE; e += SCAN_THREADS) {
                const int pp = e / DSTATE, n = e % DSTATE;
                So[pp * LDQ + n] = from_f<op_t>(S[pp * LDS + n]);
            }
#endif
            __syncthreads();
            mm<CHUNK, HEADDIM, CHUNK, false, false>(Y, LDY, Mo, ldmo, X, LDX, false, 0.f);
            __syncthreads();
            mm<CHUNK, HEADDIM, DSTATE, false, true>(Y, LDY, Q, LDQ, So, ldso, true, 1.f);
            __syncthreads();
            // D skip and gate (spec §2.6); the skip uses x in f32.
            const int lane = tid & 31, warp = tid >> 5;
            for (int j = warp; j < len; j += SCAN_WARPS) {
                const float* row = A.proj + (size_t)(start + j) * PROJ_LD;
                float yv[(HEADDIM + 31) / 32];
                float ss = 0.f;
#pragma unroll
                for (int q = 0; q < (HEADDIM + 31) / 32; ++q) {
                    const int pp = lane + 32 * q;
                    float v = 0.f;
                    if (pp < HEADDIM) v = Y[j * LDY + pp] + A.d_skip[h] * row[X_OFF + h * HEADDIM + pp];
                    yv[q] = v;
                    ss += v * v;
                }
#if OUTNORM
                const float inv = 1.f / sqrtf(warp_sum(ss) / (float)HEADDIM + NORM_EPS);
#endif
#pragma unroll
                for (int q = 0; q < (HEADDIM + 31) / 32; ++q) {
                    const int pp = lane + 32 * q;
                    if (pp >= HEADDIM) continue;
                    float v = yv[q];
#if OUTNORM
                    v = v * inv * A.out_norm[h * HEADDIM + pp];
#endif
                    v *= silu_f(row[Z_OFF + h * HEADDIM + pp]);
                    A.y[(size_t)(start + j) * D_INNER + h * HEADDIM + pp] = from_f<act_t>(v);
                }
            }
        }
        // S ← e^{Lc_end}·S + (wX)ᵀK̃ (the last chunk of a middle segment needs none).
        if (!(PHASE == 1 && last_chunk && !last_seg))
            mm<HEADDIM, DSTATE, CHUNK, true, false>(S, LDS, Xw, LDX, K, LDQ, true, expf(lc_end));
        decay_sum += lc_end;
    }
    __syncthreads();
    if (PHASE == 0) {
        for (int e = tid; e < HEADDIM * DSTATE; e += SCAN_THREADS) sb[e] = S[(e / DSTATE) * LDS + e % DSTATE];
        if (tid == 0) A.sdecay[blockIdx.x * NHEADS + h] = decay_sum;
    } else if (last_seg) {
        for (int e = tid; e < HEADDIM * DSTATE; e += SCAN_THREADS)
            st[ST_SSM + h * HEADDIM * DSTATE + e] = S[(e / DSTATE) * LDS + e % DSTATE];
    }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS, 1) scan_states(ScanArgs a) { scan_body<0>(a); }
extern "C" __global__ void __launch_bounds__(SCAN_THREADS, 1) scan_outputs(ScanArgs a) { scan_body<1>(a); }

// Phase B: state passing across segments, seeded with the folded carried state.
// Grid (sequences, H, tiles of 4·SCAN_THREADS state elements).
// Sequence table entry (int4): {first chunk, chunks, first segment, segments}.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    scan_pass(const int4* __restrict__ seqs, const int4* __restrict__ chunks,
              const float4* __restrict__ tok, float* __restrict__ sbuf,
              const float* __restrict__ sdecay, float* const* __restrict__ states, int layer) {
    griddep_wait();
    griddep_launch();
    const int4 sq = seqs[blockIdx.x];
    const int h = blockIdx.y;
    const int e = (blockIdx.z * SCAN_THREADS + threadIdx.x) * 4;
    if (e >= HEADDIM * DSTATE) return;
    const float* st = states[blockIdx.x] + (size_t)layer * ST_LAYER;
    const float4 t0 = tok[(size_t)chunks[sq.x].x * NHEADS + h];
    const float w0 = t0.x - t0.y;  // Δ_0(1 − λ_0)
    const int pp = e / DSTATE, n = e % DSTATE;
    const float wv = w0 * st[ST_V + h * HEADDIM + pp];
    float4 s = *reinterpret_cast<const float4*>(st + ST_SSM + h * HEADDIM * DSTATE + e);
    const float* kk = st + ST_K + h * DSTATE + n;
    s.x += wv * kk[0];
    s.y += wv * kk[1];
    s.z += wv * kk[2];
    s.w += wv * kk[3];
    for (int sgi = sq.z; sgi < sq.z + sq.w; ++sgi) {
        float4* b = reinterpret_cast<float4*>(sbuf + ((size_t)sgi * NHEADS + h) * HEADDIM * DSTATE + e);
        if (sgi == sq.z + sq.w - 1) {
            *b = s;
        } else {
            const float4 t = *b;
            const float d = expf(sdecay[sgi * NHEADS + h]);
            *b = s;
            s = make_float4(fmaf(d, s.x, t.x), fmaf(d, s.y, t.y), fmaf(d, s.z, t.z), fmaf(d, s.w, t.w));
        }
    }
}
