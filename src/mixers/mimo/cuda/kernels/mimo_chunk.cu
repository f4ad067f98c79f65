// Mamba-3 MIMO's scan over a packed pass in the chunked matrix form (spec-MIMO §4; the CPU
// twin is `scan_head` in src/mixers/mimo/prefill.rs, whose module doc holds the maths), on
// the tensor cores: parallel over the pass's chunks and heads, each block one (chunk, head),
// walking the chunk's tokens in tiles of MIMO_TOK = CHUNK / R tokens with the head's P×N
// state in registers. A tile is CHUNK pseudo-rows i = j·R + r (token j, rank r), with
//
//   k̃_i = rot(B̄_{r,g} + B_bias[h,r]),  q̃_i = rot(C̄_{r,g} + C_bias[h,r]),  u_i = x_j ⊙ ψ_r,
//   Lc_j = Σ_{s≤j} a_s,  c_s = γ_s + Δ_{s+1}(1 − λ_{s+1})  (the look-back of the next token;
//                                                           zero after a sequence's last)
//
//   Y_i = Σ_{i'} M_{i,i'}·u_{i'} + e^{Lc_j}·S·q̃_i + D·u_i,
//         M_{i,i'} = ⟨q̃_i, k̃_{i'}⟩ · (e^{Lc_j − Lc_s}·c_s if s < j, γ_j if s = j, else 0)
//   S'  = e^{Lc_end}·S + Σ_i e^{Lc_end − Lc_j}·c_j·outer(u_i, k̃_i)
//
// (s = i'/R: every rank of token j sees every rank of the tokens up to j). The state S
// between tiles is the "folded" one — it carries the look-back of the token after it — and
// a sequence's first token reaches into its carried state through the boundary fold
// S_enter = h⁻ + Δ_0(1 − λ_0)·Σ_r outer(v⁻ ⊙ ψ_r, k⁻_r) (§3.4).
//
// Four warp-level products on shared-memory tiles (scan_tiles.cuh; SCAN_MMA 0 exact f32
// FMA for f32 models, 1 TF32 for bf16 ones, 2 the model's f16 for f16 ones; f32
// accumulation): M = Q̃K̃ᵀ on the block lower triangle, weighted and stored as an operand;
// Y = Q̃Sᵀ with rows scaled by e^{Lc_j}; Y += M·U; S ← e^{Lc_end}·S + (w ⊙ U)ᵀ·K̃. Three launches, as Mamba-2's (ssd_chunk.cu):
//   mimo_chunk_states: each chunk's state from zero and its total log-decay, for every
//                      chunk but a sequence's last;
//   mimo_chunk_carry:  per (sequence, head), the state entering each chunk, seeded with the
//                      folded carried state;
//   mimo_chunk_out:    from the entering state (the carry's, or the folded carried state
//                      when every sequence is one chunk: `direct`), each tile's y_r staged
//                      in shared memory and through the gate (mimo_tile_gate: D·u_r, the
//                      per-rank norm, the rank sum) into out_proj's input; for a sequence's
//                      last chunk, its final state. (The gate as a kernel of its own cost
//                      0.7 ms a layer at B=8 T=4096 on an H100, most of it y's f32 round trip.)
// HEADDIM, DSTATE, MIMO_R and CHUNK (pseudo-rows of a tile) are compile-time.

#define MIMO_TOK (CHUNK / MIMO_R)  // tokens per tile
#if MIMO_TOK < 1
#error "CHUNK must hold at least one token's MIMO_R pseudo-rows"
#endif
// After the operand tiles: a tile's y for the gate (f32 [CHP][LDY]); its tokens' x and z
// (f32 [MIMO_TOK][P] each); per token Lc (a before the prefix sum), γ, c, and per
// pseudo-row the gate's 1/rms; then the head's constants, read once per block: B_bias and
// C_bias [2][R][N], ψ, ζ and ω [3][R][P].
#define LDY (PP + 4)
#define MIMO_Y_BYTES ALIGN128(CHP * LDY * 4)
#define MIMO_XZ_BYTES ALIGN128(2 * MIMO_TOK * HEADDIM * 4)
#define MIMO_TABLES ALIGN128(4 * CHP * 4)
#define MIMO_HEAD_FLOATS (2 * MIMO_R * DSTATE + 3 * MIMO_R * HEADDIM)
#define MIMO_CHUNK_SMEM (SCAN_TILES + MIMO_Y_BYTES + MIMO_XZ_BYTES + MIMO_TABLES + ALIGN128(MIMO_HEAD_FLOATS * 4))
// Two blocks an SM when two fit in its 228 KB (each also takes 1 KB the system reserves).
#define MIMO_CHUNK_MINB (2 * (MIMO_CHUNK_SMEM + 1024) <= 228 * 1024 ? 2 : 1)
// Floats per load of a B̄/C̄ half row (a float4 when N/2 is a multiple of 4: bcn's rows and
// the carve's buffers are 16-byte aligned then).
#define MIMO_KV ((DSTATE / 2) % 4 == 0 ? 4 : 1)
// Read by the host (cuModuleGetGlobal) to size the launch.
extern "C" __device__ int mimo_chunk_smem_bytes = MIMO_CHUNK_SMEM;
extern "C" __device__ int mimo_chunk_threads = SCAN_THREADS;

// The end (exclusive, a multiple of 16, at most CHP) of the columns of M that row block rb
// reaches: every rank of the last token that has a row in the block. (16·rb + 16 when R
// divides 16.)
__device__ __forceinline__ int mimo_causal_cols(int rb) {
    const int end = ((16 * rb + 15) / MIMO_R + 1) * MIMO_R;
    const int e16 = (end + 15) / 16 * 16;
    return e16 < CHP ? e16 : CHP;
}

// The boundary fold's term at state element (pp, n) of head h: Σ_r v⁻[pp]·ψ_r[pp]·k⁻_r[n]
// from the sequence's state `st` (f32 k [R, H, N] and v [H, P]), times w0 = Δ_0(1 − λ_0).
__device__ __forceinline__ float mimo_fold(const MimoScan& p, const float* st, int h, int pp, int n, float w0) {
    const float v = st[p.v_off + h * HEADDIM + pp];
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r)
        acc += p.mimo_x[(h * MIMO_R + r) * HEADDIM + pp] * st[p.k_off + ((size_t)r * p.heads + h) * DSTATE + n];
    return w0 * v * acc;
}

// Δ_0(1 − λ_0) of a sequence's first row (coef = (a, β, γ = λΔ, Δ)).
__device__ __forceinline__ float mimo_fold_weight(const MimoScan& p, size_t row, int h) {
    const float4 cf = p.coef[row * p.heads + h];
    return cf.w - cf.z;
}

template <int V> __device__ __forceinline__ void mimo_ldv(float (&d)[V], const float* src) {
    if constexpr (V == 4) {
        const float4 t = __ldg(reinterpret_cast<const float4*>(src));
        d[0] = t.x, d[1] = t.y, d[2] = t.z, d[3] = t.w;
    } else {
#pragma unroll
        for (int u = 0; u < V; ++u) d[u] = __ldg(src + u);
    }
}

// K̃ (and Q̃) of a tile's `rows` pseudo-rows from row r0: B̄ (C̄) of the head's group plus
// the head's bias (s_bias), the pairs (n, n + N/2) with n < S turned by the row's phase
// (§2.4); zero past the pseudo-rows. A thread takes MIMO_KV consecutive n of a pseudo-row
// per item; every load of a batch of items is issued before its shared stores (which the
// compiler would not move them across), so a tile waits on memory about once.
// (Two items at a time where registers allow: the 16-bit and exact-f32 products' larger
// fragments spilled with two.)
#ifndef MIMO_LOAD_BATCH
#define MIMO_LOAD_BATCH (SCAN_MMA == 1 ? 2 : 1)
#endif
template <bool OUT>
__device__ __forceinline__ void mimo_build_kq(const MimoScan& p, size_t r0, int rows, int h, int g,
                                              const float* s_bias, op_t* sK, op_t* sQ) {
    constexpr int NH = DSTATE / 2, V = MIMO_KV, NV = NH / V;
    constexpr int IT = (CHP * NV + SCAN_THREADS - 1) / SCAN_THREADS;  // items per thread
    const int bcw = MIMO_R * p.groups * DSTATE;
#pragma unroll
    for (int i0 = 0; i0 < IT; i0 += MIMO_LOAD_BATCH) {
        float k[MIMO_LOAD_BATCH][2][V], q[MIMO_LOAD_BATCH][2][V];
        float2 cs[MIMO_LOAD_BATCH][V];
#pragma unroll
        for (int u = 0; u < MIMO_LOAD_BATCH; ++u) {
            const int e = (i0 + u) * SCAN_THREADS + threadIdx.x, i = e / NV, n = (e % NV) * V;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                k[u][0][v] = k[u][1][v] = q[u][0][v] = q[u][1][v] = 0.f;
                cs[u][v] = make_float2(1.f, 0.f);
            }
            if (i0 + u < IT && i < rows) {
                const int j = i / MIMO_R, r = i % MIMO_R;
                const size_t row = r0 + j;
                const float* src = p.bcn + row * 2 * bcw + (r * p.groups + g) * DSTATE + n;
                mimo_ldv<V>(k[u][0], src);
                mimo_ldv<V>(k[u][1], src + NH);
                if (OUT) {
                    mimo_ldv<V>(q[u][0], src + bcw);
                    mimo_ldv<V>(q[u][1], src + bcw + NH);
                }
                const float2* csr = p.cs + (row * p.heads + h) * p.angles;
#pragma unroll
                for (int v = 0; v < V; ++v)
                    if (n + v < p.angles) cs[u][v] = __ldg(csr + n + v);
            }
        }
#pragma unroll
        for (int u = 0; u < MIMO_LOAD_BATCH; ++u) {
            const int e = (i0 + u) * SCAN_THREADS + threadIdx.x, i = e / NV, n = (e % NV) * V;
            if (i0 + u >= IT || i >= CHP) break;
            const bool live = i < rows;  // padding rows stay zero (no bias)
            const int r = i % MIMO_R;
            const float* kb = s_bias + r * DSTATE + n;
            const float* qb = s_bias + (MIMO_R + r) * DSTATE + n;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                const float c = cs[u][v].x, sn = cs[u][v].y;
                const float k0 = live ? k[u][0][v] + kb[v] : 0.f, k1 = live ? k[u][1][v] + kb[v + NH] : 0.f;
                put_one(&sK[i * LDK + n + v], k0 * c - k1 * sn);
                put_one(&sK[i * LDK + n + v + NH], k0 * sn + k1 * c);
                if (OUT) {
                    const float q0 = live ? q[u][0][v] + qb[v] : 0.f, q1 = live ? q[u][1][v] + qb[v + NH] : 0.f;
                    put_one(&sQ[i * LDQ + n + v], q0 * c - q1 * sn);
                    put_one(&sQ[i * LDQ + n + v + NH], q0 * sn + q1 * c);
                }
            }
        }
    }
}

// x and z of a tile's tokens into s_x, s_z (f32 [MIMO_TOK][P]): the loads of a thread's
// share first, then its stores, so that they overlap the keys' loads (the caller issues
// those between `mimo_xz_load` and `mimo_xz_store`).
#define MIMO_XZIT ((MIMO_TOK * HEADDIM + SCAN_THREADS - 1) / SCAN_THREADS)
struct MimoXz {
    float x[MIMO_XZIT], z[MIMO_XZIT];
};
__device__ __forceinline__ MimoXz mimo_xz_load(const MimoScan& p, int h, size_t r0, int len) {
    MimoXz v;
    const float* zh = p.proj + h * HEADDIM;  // z of this head at row·ld; x at + x_off
#pragma unroll
    for (int t = 0; t < MIMO_XZIT; ++t) {
        const int e = t * SCAN_THREADS + threadIdx.x, j = e / HEADDIM, pp = e % HEADDIM;
        v.x[t] = v.z[t] = 0.f;
        if (j < len) {
            v.z[t] = __ldg(zh + (r0 + j) * p.ld + pp);
            v.x[t] = __ldg(zh + (r0 + j) * p.ld + p.x_off + pp);
        }
    }
    return v;
}
__device__ __forceinline__ void mimo_xz_store(const MimoXz& v, float* s_x, float* s_z) {
#pragma unroll
    for (int t = 0; t < MIMO_XZIT; ++t) {
        const int e = t * SCAN_THREADS + threadIdx.x;
        if (e < MIMO_TOK * HEADDIM) {
            s_x[e] = v.x[t];
            s_z[e] = v.z[t];
        }
    }
}

// The gate of a tile's tokens (§2.7), from y staged in sY: y_r += D·x ⊙ ψ_r, then
// o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r), G the per-rank RMSNorm over P times out_norm[h]
// when there is one, written in the GEMM dtype to out [rows, H·P]. A thread per (token,
// channel); with a norm, y goes back to sY and a warp per pseudo-row sums its squares
// (lanes in a fixed order).
#define MIMO_GIT ((MIMO_TOK * HEADDIM + SCAN_THREADS - 1) / SCAN_THREADS)
__device__ __forceinline__ void mimo_tile_gate(const MimoScan& p, size_t r0, int len, int h, float* sY,
                                               float* s_rs, const float* s_x, const float* s_z,
                                               const float* s_psi, const float* s_zeta, const float* s_omega,
                                               act_t* out) {
    const float dskip = p.d_skip[h];
    float yv[MIMO_GIT][MIMO_R], zv[MIMO_GIT];
#pragma unroll
    for (int t = 0; t < MIMO_GIT; ++t) {
        const int e = t * SCAN_THREADS + threadIdx.x, j = e / HEADDIM, pp = e % HEADDIM;
        zv[t] = 0.f;
        float xf = 0.f;
        if (j < len) {
            zv[t] = s_z[e];
            xf = s_x[e];
        }
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) {
            float* y = &sY[(j * MIMO_R + r) * LDY + pp];
            yv[t][r] = 0.f;
            if (j < len) {
                yv[t][r] = *y + dskip * (xf * s_psi[r * HEADDIM + pp]);
                if (p.out_norm) *y = yv[t][r];
            }
        }
    }
    if (p.out_norm) {
        __syncthreads();
        const int lane = threadIdx.x & 31;
        for (int i = threadIdx.x >> 5; i < len * MIMO_R; i += SCAN_WARPS) {
            float ss = 0.f;
            for (int pp = lane; pp < HEADDIM; pp += 32) ss += sY[i * LDY + pp] * sY[i * LDY + pp];
            ss = fam_warp_sum(ss);
            if (lane == 0) s_rs[i] = 1.f / sqrtf(ss / (float)HEADDIM + p.eps);
        }
        __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < MIMO_GIT; ++t) {
        const int e = t * SCAN_THREADS + threadIdx.x, j = e / HEADDIM, pp = e % HEADDIM;
        if (j >= len) continue;
        const float on = p.out_norm ? p.out_norm[h * HEADDIM + pp] : 1.f;
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) {
            float gv = yv[t][r];
            if (p.out_norm) gv = gv * s_rs[j * MIMO_R + r] * on;
            o = o + s_omega[r * HEADDIM + pp] * gv * silu_f(zv[t] * s_zeta[r * HEADDIM + pp]);
        }
        out[(r0 + j) * (size_t)(p.heads * HEADDIM) + h * HEADDIM + pp] = from_f<act_t>(o);
    }
}

template <bool OUT>
__device__ __forceinline__ void mimo_chunk_body(const MimoScan& p, const ChunkTable& t, float* h_chunk,
                                                float* log_decay, int direct, act_t* gated) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* at = smem;
    op_t* sQ = reinterpret_cast<op_t*>(at);  // [CHP][LDQ] q̃ (the query side)
    at += SZ_Q;
    op_t* sK = reinterpret_cast<op_t*>(at);  // [CHP][LDK] k̃ (the key side)
    at += SZ_K;
    op_t* sU = reinterpret_cast<op_t*>(at);  // [CHP][LDX] u = x ⊙ ψ_r
    at += SZ_X;
    op_t* sW = reinterpret_cast<op_t*>(at);  // [CHP][LDW] e^{Lc_end − Lc_j}·c_j·u
    at += SZ_W;
    op_t* sM = reinterpret_cast<op_t*>(at);  // [CHP][LDM] the weighted Q̃K̃ᵀ
    at += SZ_MCS;
    op_t* sS = reinterpret_cast<op_t*>(at);  // [PP][LDSO] the entering state as an operand
    at += SZ_SO;
    float* sY = reinterpret_cast<float*>(at);  // [CHP][LDY] y for the gate
    at += MIMO_Y_BYTES;
    float* s_x = reinterpret_cast<float*>(at);  // [MIMO_TOK][P] x of the tile's tokens, then z
    float* s_z = s_x + MIMO_TOK * HEADDIM;
    at += MIMO_XZ_BYTES;
    float* s_lc = reinterpret_cast<float*>(at);  // [CHP] per token: a, then Lc (Lc_end past the tile)
    float* s_gam = s_lc + CHP;                   // [CHP] γ (zero past the tile's tokens)
    float* s_c = s_gam + CHP;                    // [CHP] c = γ + the next token's look-back
    float* s_rs = s_c + CHP;                     // [CHP] per pseudo-row: the gate's 1/rms
    at += MIMO_TABLES;
    float* s_bias = reinterpret_cast<float*>(at);  // [2][R][N] B_bias, C_bias of the head
    float* s_psi = s_bias + 2 * MIMO_R * DSTATE;   // [R][P] ψ, then ζ, then ω
    float* s_zeta = s_psi + MIMO_R * HEADDIM;
    float* s_omega = s_zeta + MIMO_R * HEADDIM;

    const int c = blockIdx.x, h = blockIdx.y, heads = p.heads;
    const int sq = t.seq[c];
    const bool seq_last = c == t.seq_chunk0[sq] + t.seq_nchunks[sq] - 1;
    if (!OUT && seq_last) return;
    const int row0 = t.row0[c], total = t.len[c];
    const int g = h / (p.heads / p.groups), tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, fg = lane >> 2, ft = lane & 3;
    const size_t head_at = (size_t)h * HEADDIM * DSTATE;
    const float* st_f = reinterpret_cast<const float*>(t.seq_state[sq]);
    // the sequence's ssm state (of the storage type `state_t`, dtypes.cuh)
    state_t* st = reinterpret_cast<state_t*>(reinterpret_cast<float*>(t.seq_state[sq]) + p.ssm_off) + head_at;
    float* hc = h_chunk + (size_t)c * heads * HEADDIM * DSTATE + head_at;

    // The head's constants.
    for (int e = tid; e < MIMO_HEAD_FLOATS; e += SCAN_THREADS) {
        const int rn = MIMO_R * DSTATE, rp = MIMO_R * HEADDIM;
        float v;
        if (e < rn) v = p.b_bias[h * rn + e];
        else if (e < 2 * rn) v = p.c_bias[h * rn + e - rn];
        else if (e < 2 * rn + rp) v = p.mimo_x[h * rp + e - 2 * rn];
        else if (e < 2 * rn + 2 * rp) v = p.mimo_z[h * rp + e - 2 * rn - rp];
        else v = p.mimo_o[h * rp + e - 2 * rn - 2 * rp];
        s_bias[e] = v;
    }

    // This warp's tiles of S, f32 in registers for the whole chunk: from zero (states),
    // the carry's entering state, or (direct) the carried state with the boundary fold.
    const StateTiles s(warp, lane);
    float sacc[TileS::T][4];
    {
        const float w0 = OUT && direct ? mimo_fold_weight(p, row0, h) : 0.f;
#pragma unroll
        for (int i = 0; i < TileS::T; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = 0.f;
                if (OUT && s.holds(i, e)) {
                    v = direct ? st_load(st + s.at(i, e)) + mimo_fold(p, st_f, h, s.pp(e), s.n(i, e), w0)
                               : hc[s.at(i, e)];
                }
                sacc[i][e] = v;
            }
    }
    // The state columns past DSTATE (to NP) are zero in K̃ and Q̃ for the whole chunk.
#if NP > DSTATE
    for (int e = tid; e < CHP * (NP - DSTATE); e += SCAN_THREADS) {
        const int i = e / (NP - DSTATE), n = DSTATE + e % (NP - DSTATE);
        put_one(&sK[i * LDK + n], 0.f);
        put_one(&sQ[i * LDQ + n], 0.f);
    }
#endif
    float decay_sum = 0.f;

    for (int j0 = 0; j0 < total; j0 += MIMO_TOK) {
        const int len = total - j0 < MIMO_TOK ? total - j0 : MIMO_TOK;  // tokens in this tile
        const int rows = len * MIMO_R;                                    // pseudo-rows
        const size_t r0 = (size_t)row0 + j0;
        const bool last_tile = j0 + MIMO_TOK >= total;
        __syncthreads();  // the previous tile's readers are done (and the head's constants written)
        // x and z of the tile, loaded with the keys below.
        const MimoXz xz = mimo_xz_load(p, h, r0, len);
        // Per token: a, γ and c. The token after the chunk's last is the next chunk's first
        // row when the sequence goes on.
        for (int j = tid; j < CHP; j += SCAN_THREADS) {
            float a = 0.f, gam = 0.f, cc = 0.f;
            if (j < len) {
                const float4 cf = p.coef[(r0 + j) * heads + h];
                a = cf.x;
                gam = cf.z;
                cc = gam;
                if (j0 + j + 1 < total || !seq_last) {
                    const float4 nx = p.coef[(r0 + j + 1) * heads + h];
                    cc += nx.w - nx.z;  // Δ(1 − λ) of the next token
                }
            }
            s_lc[j] = a;
            s_gam[j] = gam;
            s_c[j] = cc;
        }
        if (OUT) state_operand(sacc, s, sS);
        mimo_build_kq<OUT>(p, r0, rows, h, g, s_bias, sK, sQ);
        mimo_xz_store(xz, s_x, s_z);
        __syncthreads();
        prefix_sum_warp0(s_lc);
        __syncthreads();
        const float lc_end = s_lc[len - 1];
        // U and w ⊙ U, w_j = e^{Lc_end − Lc_j}·c_j (zero past the rows and channels).
        for (int e = tid; e < CHP * PP; e += SCAN_THREADS) {
            const int i = e / PP, pp = e % PP, j = i / MIMO_R;
            float u = 0.f, w = 0.f;
            if (i < rows && pp < HEADDIM) {
                u = s_x[j * HEADDIM + pp] * s_psi[(i % MIMO_R) * HEADDIM + pp];
                w = expf(lc_end - s_lc[j]) * s_c[j];
            }
            if (OUT) put_one(sU + i * LDX + pp, u);
            put_one(sW + i * LDW + pp, u * w);
        }
        __syncthreads();
        if (OUT) {
            // M = Q̃K̃ᵀ on the block lower triangle, weighted per token pair.
            const int m_rb = TileM::rb(warp), m_first = TileM::first(warp);
            int m_nt = TileM::count(warp);
            {
                const int causal = mimo_causal_cols(m_rb) / 8 - m_first;  // tiles left of the causal end
                m_nt = m_nt < causal ? m_nt : (causal < 0 ? 0 : causal);
            }
            float macc[TileM::T][4];
            zero_acc(macc);
            // (a warp with any causal tile computes all T when every warp has T: a constant
            // count keeps the guards out of the k loop; the extra tiles are not stored)
            constexpr bool even = TileM::NT % TileM::WPR == 0;
            if (m_nt > 0) {
                for (int k0 = 0; k0 < NP; k0 += KSTEP)
                    mma_kstep<TileM::T, true, true, true>(macc, sQ + 16 * m_rb * LDQ, LDQ, sK + 8 * m_first * LDK,
                                                          LDK, k0, even ? TileM::T : m_nt);
            }
#pragma unroll
            for (int i = 0; i < TileM::T; ++i) {
                if (i >= m_nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int rr = 16 * m_rb + fg + 8 * hf, cc = 8 * (m_first + i) + 2 * ft;
                    const int j = rr / MIMO_R;
                    const float lr = s_lc[j], gam = s_gam[j];
                    float w[2];
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const int sj = (cc + u) / MIMO_R;
                        w[u] = sj < j ? expf(lr - s_lc[sj]) * s_c[sj] : (sj == j ? gam : 0.f);
                    }
                    put_pair(sM + rr * LDM + cc, macc[i][2 * hf] * w[0], macc[i][2 * hf + 1] * w[1]);
                }
            }
            // Y = diag(e^{Lc_j})·Q̃Sᵀ
            const int y_rb = TileY::rb(warp), y_first = TileY::first(warp), y_nt = TileY::count(warp);
            float yacc[TileY::T][4];
            zero_acc(yacc);
            for (int k0 = 0; k0 < NP; k0 += KSTEP)
                mma_kstep<TileY::T, true, true, true>(yacc, sQ + 16 * y_rb * LDQ, LDQ, sS + 8 * y_first * LDSO, LDSO,
                                                      k0, y_nt);
            const float e0 = expf(s_lc[(16 * y_rb + fg) / MIMO_R]), e1 = expf(s_lc[(16 * y_rb + fg + 8) / MIMO_R]);
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                yacc[i][0] *= e0;
                yacc[i][1] *= e0;
                yacc[i][2] *= e1;
                yacc[i][3] *= e1;
            }
            __syncthreads();  // sM complete
            // Y += M·U over the causal columns (M is zero right of them).
            const int y_cols = mimo_causal_cols(y_rb);
            for (int k0 = 0; k0 < CHP; k0 += KSTEP) {
                if (k0 >= y_cols) break;
                mma_kstep<TileY::T, true, false, true>(yacc, sM + 16 * y_rb * LDM, LDM, sU + 8 * y_first, LDX, k0,
                                                       y_nt);
            }
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                if (i >= y_nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int rr = 16 * y_rb + fg + 8 * hf, pp = 8 * (y_first + i) + 2 * ft;
                    sY[rr * LDY + pp] = yacc[i][2 * hf];
                    sY[rr * LDY + pp + 1] = yacc[i][2 * hf + 1];
                }
            }
            // S ← e^{Lc_end}·S + (w ⊙ U)ᵀ·K̃ (not after the last tile of a chunk whose
            // final state nobody reads).
            if (!(last_tile && !seq_last)) {
                scale_acc(sacc, expf(lc_end));
                for (int k0 = 0; k0 < CHP; k0 += KSTEP)
                    mma_kstep<TileS::T, false, false, true>(sacc, sW + 16 * s.rb, LDW, sK + 8 * s.first, LDK, k0,
                                                            s.nt);
            }
            __syncthreads();  // y staged
            mimo_tile_gate(p, r0, len, h, sY, s_rs, s_x, s_z, s_psi, s_zeta, s_omega, gated);
        } else {
            scale_acc(sacc, expf(lc_end));
            for (int k0 = 0; k0 < CHP; k0 += KSTEP)
                mma_kstep<TileS::T, false, false, true>(sacc, sW + 16 * s.rb, LDW, sK + 8 * s.first, LDK, k0, s.nt);
        }
        decay_sum += lc_end;
    }
    // The chunk's state from zero (mimo_chunk_states), or the sequence's final state.
    if (!OUT || seq_last) {
#pragma unroll
        for (int i = 0; i < TileS::T; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (!s.holds(i, e)) continue;
                if (OUT)
                    st_store(st + s.at(i, e), sacc[i][e]);
                else
                    hc[s.at(i, e)] = sacc[i][e];
            }
        if (!OUT && tid == 0) log_decay[(size_t)c * heads + h] = decay_sum;
    }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS, MIMO_CHUNK_MINB)
    mimo_chunk_states(MimoScan p, ChunkTable t, float* h_chunk, float* log_decay) {
    mimo_chunk_body<false>(p, t, h_chunk, log_decay, 0, nullptr);
}
extern "C" __global__ void __launch_bounds__(SCAN_THREADS, MIMO_CHUNK_MINB)
    mimo_chunk_out(MimoScan p, ChunkTable t, float* h_chunk, int direct, act_t* gated) {
    mimo_chunk_body<true>(p, t, h_chunk, nullptr, direct, gated);
}

// One thread per state element of a head: h_chunk[c] (chunk c's state from zero, from
// mimo_chunk_states) becomes chunk c's entering state, the first one the carried state
// with the boundary fold. A sequence's last chunk has no local state (mimo_chunk_out
// writes the final state from its entering one). Grid (sequences·H, P·N / 256).
extern "C" __global__ void mimo_chunk_carry(MimoScan p, ChunkTable t, float* h_chunk, const float* log_decay) {
    const int s = blockIdx.x / p.heads, hd = blockIdx.x % p.heads;
    const int per_head = HEADDIM * DSTATE;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= per_head) return;
    const float* st_f = reinterpret_cast<const float*>(t.seq_state[s]);
    const state_t* st = reinterpret_cast<const state_t*>(st_f + p.ssm_off) + (size_t)hd * per_head + e;
    const int c0 = t.seq_chunk0[s], n = t.seq_nchunks[s];
    const float w0 = mimo_fold_weight(p, t.row0[c0], hd);
    const float h = st_load(st) + mimo_fold(p, st_f, hd, e / DSTATE, e % DSTATE, w0);
    carry_walk(h, h_chunk + ((size_t)c0 * p.heads + hd) * per_head + e, (size_t)p.heads * per_head,
               log_decay + (size_t)c0 * p.heads + hd, p.heads, n);
}
