// Mamba-2's scan (spec §3.3) over a packed pass in the chunked (SSD) form, on the tensor
// cores: parallel over the pass's chunks and heads, each block one (chunk, head), walking
// the chunk's rows in tiles of CHUNK rows with the head's P×N state in registers. For a
// tile of L rows entering with state S, Δ_j = clamp(softplus(dt_j + dt_bias)), Lc_j the
// running sum of Δ·A over the tile's rows:
//
//   y_j = Σ_{s≤j} e^{Lc_j − Lc_s}·Δ_s·⟨C_j, B_s⟩·x_s + e^{Lc_j}·S·C_j + D·x_j
//   S'  = e^{Lc_end}·S + Σ_s e^{Lc_end − Lc_s}·Δ_s·x_s ⊗ B_s
//
// which is Mamba-3 SISO's chunk (mixers/mamba3/cuda/kernels/scan.cu) without the look-back
// term, the rotation and the B/C bias. Four warp-level products on shared-memory tiles
// (scan_tiles.cuh; SCAN_MMA 0 exact f32 FMA for f32 models, 2 the model's bf16/f16 with f32
// accumulation): M = C·Bᵀ on the lower block triangle, weighted and stored as an operand;
// Y = C·Sᵀ with rows scaled by e^{Lc_j}; Y += M·X; S ← e^{Lc_end}·S + (w ⊙ X)ᵀ·B.
//
// Two launches around `m2_scan_carry` (below), the steps of Mamba-1's chunked scan
// (the chunk tables, the state's tiles, the log-decay prefix sum and the carry's walk are chunk_scan.cuh's,
// shared with Mamba-3 MIMO's scan):
//   m2_chunk_states: each chunk's state from zero and its total log-decay, for every chunk
//                    but a sequence's last (the carry does not need those);
//   m2_chunk_out:    from the state entering the chunk (the carry's, or the sequence's
//                    state when every sequence is one chunk: `direct`), y before the gate
//                    (f32 [rows, H·P]) and, for a sequence's last chunk, its final state.
// HEADDIM, DSTATE and CHUNK (the tile's rows) are compile-time; the groups are not.

// Per-row tables of a tile in shared memory after the operand tiles: Δ and Lc.
#define M2_SMEM (SCAN_TILES + ALIGN128(2 * CHP * 4))
#define M2_MINB (M2_SMEM <= 110 * 1024 ? 2 : 1)
// Read by the host (cuModuleGetGlobal) to size the launch.
extern "C" __device__ int m2_chunk_smem_bytes = M2_SMEM;
extern "C" __device__ int m2_chunk_threads = SCAN_THREADS;

template <bool OUT>
__device__ __forceinline__ void m2_chunk_body(const M2Scan& p, const ChunkTable& t, float* h_chunk,
                                              float* log_decay, int direct, float* y) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* at = smem;
    op_t* sC = reinterpret_cast<op_t*>(at);  // [CHP][LDQ] C (the query side)
    at += SZ_Q;
    op_t* sB = reinterpret_cast<op_t*>(at);  // [CHP][LDK] B (the key side)
    at += SZ_K;
    op_t* sX = reinterpret_cast<op_t*>(at);  // [CHP][LDX] x
    at += SZ_X;
    op_t* sW = reinterpret_cast<op_t*>(at);  // [CHP][LDW] e^{Lc_end − Lc_s}·Δ_s·x_s
    at += SZ_W;
    op_t* sM = reinterpret_cast<op_t*>(at);  // [CHP][LDM] the weighted C·Bᵀ
    at += SZ_MCS;
    op_t* sS = reinterpret_cast<op_t*>(at);  // [PP][LDSO] the entering state as an operand
    at += SZ_SO;
    float* s_dt = reinterpret_cast<float*>(at);  // [CHP] Δ (zero past the tile's rows)
    float* s_lc = s_dt + CHP;                    // [CHP] Lc (Lc_end past the tile's rows)

    const int c = blockIdx.x, h = blockIdx.y, heads = gridDim.y;
    const int sq = t.seq[c];
    const bool seq_last = c == t.seq_chunk0[sq] + t.seq_nchunks[sq] - 1;
    if (!OUT && seq_last) return;
    const int row0 = t.row0[c], total = t.len[c];
    const int g = h / p.heads_per_group, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, fg = lane >> 2, ft = lane & 3;
    const float a = p.a[h], dt_bias = p.dt_bias[h];
    const size_t head_at = (size_t)h * HEADDIM * DSTATE;
    // the sequence's ssm state (of the storage type `state_t`, dtypes.cuh)
    state_t* st = reinterpret_cast<state_t*>(reinterpret_cast<float*>(t.seq_state[sq]) + p.ssm_off) + head_at;
    float* hc = h_chunk + (size_t)c * heads * HEADDIM * DSTATE + head_at;
    const float* xs = p.xbc + h * HEADDIM;                  // x of this head
    const float* bs = p.xbc + p.d_ssm + g * DSTATE;         // B of its group
    const float* cs = bs + p.groups * DSTATE;               // C of its group

    // This warp's tiles of S (rows p, columns n), f32 in registers for the whole chunk.
    const StateTiles s(warp, lane);
    float sacc[TileS::T][4];
#pragma unroll
    for (int i = 0; i < TileS::T; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const size_t k = s.at(i, e);
            sacc[i][e] = OUT && s.holds(i, e) ? (direct ? st_load(st + k) : hc[k]) : 0.f;
        }
    float decay_sum = 0.f;

    for (int j0 = 0; j0 < total; j0 += CHUNK) {
        const int len = total - j0 < CHUNK ? total - j0 : CHUNK;
        const size_t r0 = (size_t)row0 + j0;
        const bool last_tile = j0 + CHUNK >= total;
        __syncthreads();  // the previous tile's readers are done
        for (int j = tid; j < CHP; j += SCAN_THREADS) {
            float d = 0.f;
            if (j < len) {
                d = softplus_f(p.dt[(r0 + j) * p.ld_dt + h] + dt_bias);
                d = fminf(fmaxf(d, p.dt_min), p.dt_max);
            }
            s_dt[j] = d;
            s_lc[j] = d * a;  // summed into Lc below
        }
        if (OUT) state_operand(sacc, s, sS);  // S entering the tile, for Y = C·Sᵀ
        // B and C rows (zeros past the tile's rows and the state), in pairs of columns.
        for (int e = tid; e < CHP * (NP / 2); e += SCAN_THREADS) {
            const int j = e / (NP / 2), n = 2 * (e % (NP / 2));
            float b0 = 0.f, b1 = 0.f, c0 = 0.f, c1 = 0.f;
            if (j < len && n < DSTATE) {
                const size_t row = (r0 + j) * p.conv_dim;
                b0 = bs[row + n];
                if (OUT) c0 = cs[row + n];
                if (n + 1 < DSTATE) {
                    b1 = bs[row + n + 1];
                    if (OUT) c1 = cs[row + n + 1];
                }
            }
            put_pair(sB + j * LDK + n, b0, b1);
            if (OUT) put_pair(sC + j * LDQ + n, c0, c1);
        }
        __syncthreads();
        // Lc_j = Σ_{i≤j} Δ_i·A (rows past the tile add zero, so they hold Lc_end).
        prefix_sum_warp0(s_lc);
        __syncthreads();
        const float lc_end = s_lc[len - 1];
        // X and w ⊙ X, w_s = e^{Lc_end − Lc_s}·Δ_s.
        for (int e = tid; e < CHP * (PP / 2); e += SCAN_THREADS) {
            const int j = e / (PP / 2), pp = 2 * (e % (PP / 2));
            float x0 = 0.f, x1 = 0.f;
            if (j < len && pp < HEADDIM) {
                const float* xr = xs + (r0 + j) * p.conv_dim + pp;
                x0 = xr[0];
                if (pp + 1 < HEADDIM) x1 = xr[1];
            }
            if (OUT) put_pair(sX + j * LDX + pp, x0, x1);
            const float w = expf(lc_end - s_lc[j]) * s_dt[j];
            put_pair(sW + j * LDW + pp, x0 * w, x1 * w);
        }
        __syncthreads();
        if (OUT) {
            // M = C·Bᵀ on the lower block triangle, weighted e^{Lc_r − Lc_s}·Δ_s (s ≤ r, else 0).
            const int m_rb = TileM::rb(warp), m_first = TileM::first(warp);
            int m_nt = TileM::count(warp);
            {
                const int causal = (16 * m_rb + 16) / 8 - m_first;  // tiles left of the diagonal's end
                m_nt = m_nt < causal ? m_nt : (causal < 0 ? 0 : causal);
            }
            float macc[TileM::T][4];
            zero_acc(macc);
            // (a warp with any causal tile computes all T when every warp has T: a constant
            // count keeps the guards out of the k loop; the extra tiles are not stored)
            constexpr bool even = TileM::NT % TileM::WPR == 0;
            if (m_nt > 0) {
                for (int k0 = 0; k0 < NP; k0 += KSTEP)
                    mma_kstep<TileM::T, true, true, true>(macc, sC + 16 * m_rb * LDQ, LDQ, sB + 8 * m_first * LDK,
                                                          LDK, k0, even ? TileM::T : m_nt);
            }
#pragma unroll
            for (int i = 0; i < TileM::T; ++i) {
                if (i >= m_nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 16 * m_rb + fg + 8 * hf, s = 8 * (m_first + i) + 2 * ft;
                    const float lr = s_lc[r];
                    float w[2];
#pragma unroll
                    for (int u = 0; u < 2; ++u) w[u] = s + u <= r ? expf(lr - s_lc[s + u]) * s_dt[s + u] : 0.f;
                    put_pair(sM + r * LDM + s, macc[i][2 * hf] * w[0], macc[i][2 * hf + 1] * w[1]);
                }
            }
            // Y = diag(e^{Lc})·C·Sᵀ
            const int y_rb = TileY::rb(warp), y_first = TileY::first(warp), y_nt = TileY::count(warp);
            float yacc[TileY::T][4];
            zero_acc(yacc);
            for (int k0 = 0; k0 < NP; k0 += KSTEP)
                mma_kstep<TileY::T, true, true, true>(yacc, sC + 16 * y_rb * LDQ, LDQ, sS + 8 * y_first * LDSO, LDSO,
                                                      k0, y_nt);
            const float e0 = expf(s_lc[16 * y_rb + fg]), e1 = expf(s_lc[16 * y_rb + fg + 8]);
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                yacc[i][0] *= e0;
                yacc[i][1] *= e0;
                yacc[i][2] *= e1;
                yacc[i][3] *= e1;
            }
            __syncthreads();  // sM complete
            // Y += M·X over the causal columns (M is zero right of the diagonal block).
            for (int k0 = 0; k0 < CHP; k0 += KSTEP) {
                if (k0 >= 16 * y_rb + 16) break;
                mma_kstep<TileY::T, true, false, true>(yacc, sM + 16 * y_rb * LDM, LDM, sX + 8 * y_first, LDX, k0,
                                                       y_nt);
            }
            // + D·x (x in f32 from the conv's output), y before the gate.
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                if (i >= y_nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 16 * y_rb + fg + 8 * hf;
                    if (r >= len) continue;
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const int pp = 8 * (y_first + i) + 2 * ft + u;
                        if (pp >= HEADDIM) continue;
                        const int ch = h * HEADDIM + pp;
                        const float x = xs[(r0 + r) * p.conv_dim + pp];
                        y[(r0 + r) * p.d_ssm + ch] = yacc[i][2 * hf + u] + p.d_skip[ch] * x;
                    }
                }
            }
        }
        // S ← e^{Lc_end}·S + (w ⊙ X)ᵀ·B (not after the last tile of a chunk whose final
        // state nobody reads).
        if (!(OUT && last_tile && !seq_last)) {
            scale_acc(sacc, expf(lc_end));
            for (int k0 = 0; k0 < CHP; k0 += KSTEP)
                mma_kstep<TileS::T, false, false, true>(sacc, sW + 16 * s.rb, LDW, sB + 8 * s.first, LDK, k0, s.nt);
        }
        decay_sum += lc_end;
    }
    // The chunk's state from zero (m2_chunk_states), or the sequence's final state.
    if (!OUT || seq_last) {
#pragma unroll
        for (int i = 0; i < TileS::T; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (!s.holds(i, e)) continue;
                const size_t k = s.at(i, e);
                if (OUT)
                    st_store(st + k, sacc[i][e]);
                else
                    hc[k] = sacc[i][e];
            }
        if (!OUT && tid == 0) log_decay[(size_t)c * heads + h] = decay_sum;
    }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS, M2_MINB)
    m2_chunk_states(M2Scan p, ChunkTable t, float* h_chunk, float* log_decay) {
    m2_chunk_body<false>(p, t, h_chunk, log_decay, 0, nullptr);
}
extern "C" __global__ void __launch_bounds__(SCAN_THREADS, M2_MINB)
    m2_chunk_out(M2Scan p, ChunkTable t, float* h_chunk, int direct, float* y) {
    m2_chunk_body<true>(p, t, h_chunk, nullptr, direct, y);
}

// One thread per state element of a head: h_chunk[c] (chunk c's state from zero, from
// m2_chunk_states) becomes chunk c's entering state (chunk_scan.cuh's carry_walk). A
// sequence's last chunk has no local state (m2_chunk_out writes the final state from its
// entering one). Grid (sequences·H, P·N / 256).
extern "C" __global__ void m2_scan_carry(M2Scan p, const int* seg_chunk0, const int* seg_nchunks,
                                         const unsigned long long* seg_state, float* h_chunk,
                                         const float* log_decay, int heads) {
    const int s = blockIdx.x / heads, hd = blockIdx.x % heads;
    const int per_head = p.headdim * DSTATE;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= per_head) return;
    const state_t* st = reinterpret_cast<const state_t*>(reinterpret_cast<const float*>(seg_state[s]) + p.ssm_off) +
                        (size_t)hd * per_head + e;
    const int c0 = seg_chunk0[s];
    carry_walk(st_load(st), h_chunk + ((size_t)c0 * heads + hd) * per_head + e, (size_t)heads * per_head,
               log_decay + (size_t)c0 * heads + hd, heads, seg_nchunks[s]);
}
