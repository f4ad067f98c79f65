// The backward of the chunked scan, for training. CPU twin: `head_backward` in
// src/mixers/mamba3/train/backward.rs; the derivation is in the module doc of src/mixers/mamba3/train/forward.rs.
//
// One block per (sequence, head) walks the sequence's chunks in reverse. The gradient of
// the state leaving the chunk, dS' (P×N, f32), lives in registers for the whole walk
// (TileS layout, as the forward's S). Per chunk, with Ā = Q̃K̃ᵀ, W the causal decay and
// trapezoid weights, Σ = W∘Ā, G = dY·Xᵀ, GW = G∘W, dYe = diag(e^{Lc})·dY and S the state
// entering the chunk (saved by the forward, one chunk per segment):
//   1. Ā, G on the tensor-core tiles; from them Σ and GW (to shared memory) and the scalar
//      gradients of W: dlc_j += Σ_s t, dlc_s −= t, dc_s += (G∘Ā)·e^{Lc_j − Lc_s} with
//      t = (G∘Ā)∘W below the diagonal; dγ_j = (G∘Ā)_jj;
//   2. dX = Σᵀ·dY + w_s·(K̃·dS'ᵀ) + D·dY  (w_s = e^{Lc_end − Lc_s}·c_s), into dproj;
//   3. dK̃ = GWᵀ·Q̃ + w_s·(X·dS'), with u_s = ⟨(X·dS')_s, k̃_s⟩: dc_s += e^{Lc_end − Lc_s}·u_s,
//      dlc_s −= w_s·u_s, dlc_end += w_s·u_s;
//   4. dQ̃ = GW·K̃ + dYe·S;
//   5. dlc_j += e^{Lc_j}·⟨dy_j, (Q̃Sᵀ)_j⟩;  dlc_end += e^{Lc_end}·⟨dS', S⟩;
//   6. dS' ← e^{Lc_end}·dS' + dYeᵀ·Q̃ (the next chunk back);
//   7. da_j = Σ_{j' ≥ j} dlc_j' (dlc_end added to the last token); the rotation backward
//      dq = R(φ)ᵀ·dq̃ and dφ_i = −dq̃_{2i}·q̃_{2i+1} + dq̃_{2i+1}·q̃_{2i} (plus the same for k).
// Outputs: dx (the in_proj gradient's x columns), unrotated dq, dk per head `[rows][H][N]`,
// dφ `[rows][H][S]`, {dc, dγ, da} per (row, head), and Σ⟨dy, x⟩ per (sequence, head) for D.
// Every reduction has a fixed order (quad shuffles, then per-warp partials in shared
// memory added in order): two runs give the same bits.
//
// Products on the forward's warp tiles (mma_kstep in scan.cu) with f32 operands: exact FMA
// (SCAN_MMA 0) or TF32 tensor cores (SCAN_MMA 1).

#if SCAN_MMA >= 2
#error "the training scan backward takes f32 operands: SCAN_MMA 0 or 1"
#endif

// k steps unrolled in the products: a few (f32 fragments, and the kernel is at 243 registers).
#define BWD_KUNROLL 2

typedef Tiling<CHP, NP> TileQ;  // dQ̃, dK̃, X·dS'

#define BW_SZ_X ALIGN128(CHP * LDX * 4)
#define BW_SZ_M2 (2 * ALIGN128(CHP * LDM * 4))
#define BW_SZ_U (BW_SZ_M2 > SZ_SO ? BW_SZ_M2 : SZ_SO)  // Σ and GW, later S
#define BW_SZ_TOK ALIGN128(9 * CHP * 4)
#define BW_SZ_RED ALIGN128((CHP * SCAN_WARPS + 2 * 8 * CHP + SCAN_WARPS * NANGLES + SCAN_WARPS) * 4)
#define SCAN_BWD_SMEM (2 * SZ_Q + 3 * BW_SZ_X + SZ_SO + BW_SZ_U + SZ_CS + BW_SZ_TOK + BW_SZ_RED + SZ_BIAS)
extern "C" __device__ int scan_bwd_smem_bytes = SCAN_BWD_SMEM;

struct ScanBwdArgs {
    const float* proj;   // [rows][PROJ_LD] (x columns)
    const float* bcn;    // [rows][BC_W]
    const float4* tok;   // [rows][H] {Δ, γ, c, Lc}
    const float* theta;  // [rows][S]
    const float* phi0;   // [chunk][H][S]
    const int4* chunks;  // {start, len, seq end, seq}
    const int4* seqs;    // {first chunk, chunks, first segment, segments}
    const float* b_bias;
    const float* c_bias;
    const float* d_skip;
    const float* sbuf;   // [chunk][H][P][N]: the state entering each chunk
    const float* dy;     // [rows][D_INNER]: gradient of y before the gate
    float* dproj;        // [rows][PROJ_LD]: x columns written
    float* dq;           // [rows][H][N]
    float* dk;           // [rows][H][N]
    float* dphi;         // [rows][H][S]
    float4* tokg;        // [rows][H] {dc, dγ, da, 0}
    float* dd_part;      // [sequence][H]
};

// Sum of a thread's two row values over the quad (the lanes that share fragment rows).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// Sum over the 8 row groups of a fragment column (lanes with the same t).
__device__ __forceinline__ float col8_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    return v + __shfl_xor_sync(0xffffffffu, v, 16);
}

// The rotation backward of dṽ (ṽ = k̃ or q̃, rows `ldv` apart in shared memory) on this
// thread's TileQ fragments `acc`: dv = R(φ)ᵀ·dṽ into `dv` `[rows][H][N]`, and ṽ's part of
// dφ, −dṽ_{2i}·ṽ_{2i+1} + dṽ_{2i+1}·ṽ_{2i}, into `dphi`: stored for the key, which comes
// first, added for the query (the same thread wrote the key's).
template <bool ADD_PHI>
__device__ __forceinline__ void unrotate(const float (&acc)[TileQ::T][4], const float* sv, int ldv, const float* s_cs,
                                         float* dphi, float* dv, int start, int len, int h, int q_rb, int q_first,
                                         int q_nt, int lane) {
    const int fg = lane >> 2, ft = lane & 3;
#pragma unroll
    for (int i = 0; i < TileQ::T; ++i) {
        if (i >= q_nt) break;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int j = 16 * q_rb + fg + 8 * hf, n = 8 * (q_first + i) + 2 * ft;
            if (j >= len || n >= DSTATE) continue;
            float d0 = acc[i][2 * hf], d1 = acc[i][2 * hf + 1];
            const size_t row = (size_t)(start + j) * NHEADS + h;
            if (n / 2 < NANGLES) {
                const float c = s_cs[cs_index(j, n / 2)], sn = s_cs[cs_index(j, n / 2) + 1];
                if (ADD_PHI)
                    dphi[row * NANGLES + n / 2] += -d0 * sv[j * ldv + n + 1] + d1 * sv[j * ldv + n];
                else
                    dphi[row * NANGLES + n / 2] = -d0 * sv[j * ldv + n + 1] + d1 * sv[j * ldv + n];
                const float r0 = d0 * c + d1 * sn, r1 = -d0 * sn + d1 * c;
                d0 = r0;
                d1 = r1;
            }
            *reinterpret_cast<float2*>(dv + row * DSTATE + n) = make_float2(d0, d1);
        }
    }
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS, 1) scan_bwd(ScanBwdArgs A) {
    extern __shared__ __align__(128) unsigned char bw_smem[];
    unsigned char* p = bw_smem;
    float* sQ = reinterpret_cast<float*>(p);
    p += SZ_Q;
    float* sK = reinterpret_cast<float*>(p);
    p += SZ_Q;
    float* sX = reinterpret_cast<float*>(p);
    p += BW_SZ_X;
    float* sDY = reinterpret_cast<float*>(p);
    p += BW_SZ_X;
    float* sDYE = reinterpret_cast<float*>(p);
    p += BW_SZ_X;
    float* sDS = reinterpret_cast<float*>(p);  // dS' [PP][LDSO]
    p += SZ_SO;
    float* sSig = reinterpret_cast<float*>(p);  // Σ [CHP][LDM]
    float* sGW = sSig + BW_SZ_M2 / 8;           // GW [CHP][LDM] (second half)
    float* sS = reinterpret_cast<float*>(p);    // S [PP][LDSO], once Σ and GW are dead
    p += BW_SZ_U;
    float* s_cs = reinterpret_cast<float*>(p);
    p += SZ_CS;
    float* s_gam = reinterpret_cast<float*>(p);
    float* s_sc = s_gam + CHP;
    float* s_lc = s_sc + CHP;
    float* s_xw = s_lc + CHP;    // e^{Lc_end − Lc_j}·c_j
    float* s_eend = s_xw + CHP;  // e^{Lc_end − Lc_j}
    float* s_dlc = s_eend + CHP;
    float* s_dc = s_dlc + CHP;
    float* s_dgam = s_dc + CHP;
    float* s_uxw = s_dgam + CHP;  // w_s·u_s (→ dlc_end)
    p += BW_SZ_TOK;
    float* s_rowp = reinterpret_cast<float*>(p);  // [CHP][SCAN_WARPS]
    float* s_colp = s_rowp + CHP * SCAN_WARPS;    // [2][8][CHP]: dlc, dc column partials
    float* s_ph = s_colp + 2 * 8 * CHP;           // [SCAN_WARPS][NANGLES]
    float* s_red = s_ph + SCAN_WARPS * NANGLES;   // [SCAN_WARPS]
    p += BW_SZ_RED;
    float* s_bb = reinterpret_cast<float*>(p);
    float* s_cb = s_bb + NP;

    const int4 sq = A.seqs[blockIdx.x];
    const int h = blockIdx.y, g = h / HEADS_PER_GROUP, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, fg = lane >> 2, ft = lane & 3;
    for (int n = tid; n < NP; n += SCAN_THREADS) {
        s_bb[n] = n < DSTATE ? A.b_bias[h * DSTATE + n] : 0.f;
        s_cb[n] = n < DSTATE ? A.c_bias[h * DSTATE + n] : 0.f;
    }
    const float dsk = A.d_skip[h];
    const int s_rb = TileS::rb(warp), s_first = TileS::first(warp), s_nt = TileS::count(warp);
    float sacc[TileS::T][4];  // dS'
    zero_acc(sacc);
    float dd_acc = 0.f;

    for (int c = sq.x + sq.y - 1; c >= sq.x; --c) {
        const int4 ck = A.chunks[c];
        const int start = ck.x, len = ck.y;
        __syncthreads();  // the previous chunk's readers are done
        const float lc_end = A.tok[(size_t)(start + len - 1) * NHEADS + h].w;
        for (int j = tid; j < CHP; j += SCAN_THREADS) {
            float4 v = make_float4(0.f, 0.f, 0.f, lc_end);
            if (j < len) v = A.tok[(size_t)(start + j) * NHEADS + h];
            s_gam[j] = v.y;
            s_sc[j] = v.z;
            s_lc[j] = v.w;
            s_eend[j] = expf(lc_end - v.w);
            s_xw[j] = s_eend[j] * v.z;
            s_dgam[j] = 0.f;
        }
        for (int e = tid; e < 2 * 8 * CHP; e += SCAN_THREADS) s_colp[e] = 0.f;
        // dS' as an operand
#pragma unroll
        for (int i = 0; i < TileS::T; ++i) {
            if (i >= s_nt) break;
            const int n = 8 * (s_first + i) + 2 * ft;
            float* row = sDS + (16 * s_rb + fg) * LDSO + n;
            *reinterpret_cast<float2*>(row) = make_float2(sacc[i][0], sacc[i][1]);
            *reinterpret_cast<float2*>(row + 8 * LDSO) = make_float2(sacc[i][2], sacc[i][3]);
        }
        __syncthreads();
        {
            float th[PH_Q][PH_TPW], dt[PH_TPW], phi[PH_Q];
            fetch_theta(A.theta, A.phi0 + ((size_t)c * NHEADS + h) * NANGLES, start, len, th, phi);
            fetch_dt(A.tok, h, start, len, dt);
            chunk_phases(th, dt, phi, len, s_cs, s_ph);
        }
        __syncthreads();
        // Q̃, K̃ (biased, rotated); X, dY, dYe. Rows past the chunk are zero.
        for (int e = tid; e < CHP * (NP / 4); e += SCAN_THREADS) {
            const int j = e / (NP / 4), n = 4 * (e % (NP / 4));
            float4 k = make_float4(0.f, 0.f, 0.f, 0.f), q = k;
            if (j < len && n < DSTATE) {
                const float* bc = A.bcn + (size_t)(start + j) * BC_W;
                k = add4(*reinterpret_cast<const float4*>(bc + g * DSTATE + n), *reinterpret_cast<const float4*>(s_bb + n));
                q = add4(*reinterpret_cast<const float4*>(bc + (NGROUPS + g) * DSTATE + n),
                         *reinterpret_cast<const float4*>(s_cb + n));
                if (n / 2 < NANGLES) {
                    const float4 cs = *reinterpret_cast<const float4*>(s_cs + cs_index(j, n / 2));
                    rotate4(k, cs);
                    rotate4(q, cs);
                }
            }
            *reinterpret_cast<float4*>(sK + j * LDK + n) = k;
            *reinterpret_cast<float4*>(sQ + j * LDQ + n) = q;
        }
        for (int e = tid; e < CHP * (PP / 4); e += SCAN_THREADS) {
            const int j = e / (PP / 4), pp = 4 * (e % (PP / 4));
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f), d = x;
            if (j < len && pp < HEADDIM) {
                x = *reinterpret_cast<const float4*>(A.proj + (size_t)(start + j) * PROJ_LD + X_OFF + h * HEADDIM + pp);
                d = *reinterpret_cast<const float4*>(A.dy + (size_t)(start + j) * D_INNER + h * HEADDIM + pp);
                dd_acc += d.x * x.x + d.y * x.y + d.z * x.z + d.w * x.w;
            }
            const float el = j < len ? expf(s_lc[j]) : 0.f;
            *reinterpret_cast<float4*>(sX + j * LDX + pp) = x;
            *reinterpret_cast<float4*>(sDY + j * LDX + pp) = d;
            *reinterpret_cast<float4*>(sDYE + j * LDX + pp) = make_float4(el * d.x, el * d.y, el * d.z, el * d.w);
        }
        __syncthreads();

        // ---- 1. Ā, G → Σ, GW and the scalar gradients of W
        {
            const int rb = TileM::rb(warp), first = TileM::first(warp);
            const int count = TileM::count(warp);
            int nt = count;
            const int causal = (16 * rb + 16) / 8 - first;
            nt = nt < causal ? nt : (causal < 0 ? 0 : causal);
            float aacc[TileM::T][4], gacc[TileM::T][4];
            zero_acc(aacc);
            zero_acc(gacc);
#pragma unroll BWD_KUNROLL
            for (int k0 = 0; k0 < NP; k0 += KSTEP)
                mma_kstep<TileM::T, true, true>(aacc, sQ + 16 * rb * LDQ, LDQ, sK + 8 * first * LDK, LDK, k0, nt);
#pragma unroll BWD_KUNROLL
            for (int k0 = 0; k0 < PP; k0 += KSTEP)
                mma_kstep<TileM::T, true, true>(gacc, sDY + 16 * rb * LDX, LDX, sX + 8 * first * LDX, LDX, k0, nt);
            float rowp[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < TileM::T; ++i) {
                if (i >= count) break;
                float col_lc[2] = {0.f, 0.f}, col_dc[2] = {0.f, 0.f};
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 16 * rb + fg + 8 * hf, s0 = 8 * (first + i) + 2 * ft;
                    float sig[2], gw[2];
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const int s = s0 + u;
                        const float a = i < nt ? aacc[i][2 * hf + u] : 0.f;
                        const float gg = i < nt ? gacc[i][2 * hf + u] : 0.f;
                        float w = 0.f;
                        if (s < r) {
                            const float E = expf(s_lc[r] - s_lc[s]);
                            w = E * s_sc[s];
                            const float dw = gg * a, t = dw * w;
                            rowp[hf] += t;
                            col_lc[u] -= t;
                            col_dc[u] += dw * E;
                        } else if (s == r) {
                            w = s_gam[r];
                            s_dgam[r] = gg * a;
                        }
                        sig[u] = w * a;
                        gw[u] = gg * w;
                    }
                    *reinterpret_cast<float2*>(sSig + r * LDM + s0) = make_float2(sig[0], sig[1]);
                    *reinterpret_cast<float2*>(sGW + r * LDM + s0) = make_float2(gw[0], gw[1]);
                }
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const float vl = col8_sum(col_lc[u]), vd = col8_sum(col_dc[u]);
                    if (fg == 0) {
                        const int s = 8 * (first + i) + 2 * ft + u;
                        s_colp[rb * CHP + s] = vl;
                        s_colp[(8 + rb) * CHP + s] = vd;
                    }
                }
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float v = quad_sum(rowp[hf]);
                if (ft == 0) s_rowp[(16 * rb + fg + 8 * hf) * SCAN_WARPS + warp % TileM::WPR] = v;
            }
        }
        __syncthreads();
        for (int j = tid; j < CHP; j += SCAN_THREADS) {
            float dl = 0.f, dc = 0.f;
            for (int w = 0; w < TileM::WPR; ++w) dl += s_rowp[j * SCAN_WARPS + w];
            for (int b = 0; b < TileM::RB; ++b) {
                dl += s_colp[b * CHP + j];
                dc += s_colp[(8 + b) * CHP + j];
            }
            s_dlc[j] = dl;
            s_dc[j] = dc;
        }
        __syncthreads();  // s_rowp is written again below

        // ---- 2. dX = Σᵀ·dY + w_s·(K̃·dS'ᵀ) + D·dY
        {
            const int rb = TileY::rb(warp), first = TileY::first(warp), nt = TileY::count(warp);
            float xacc[TileY::T][4], uacc[TileY::T][4];
            zero_acc(xacc);
            zero_acc(uacc);
#pragma unroll BWD_KUNROLL
            for (int k0 = 0; k0 < CHP; k0 += KSTEP)
                if (k0 + KSTEP > 16 * rb)  // Σᵀ is zero left of the diagonal
                    mma_kstep<TileY::T, false, false>(xacc, sSig + 16 * rb, LDM, sDY + 8 * first, LDX, k0, nt);
#pragma unroll BWD_KUNROLL
            for (int k0 = 0; k0 < NP; k0 += KSTEP)
                mma_kstep<TileY::T, true, true>(uacc, sK + 16 * rb * LDK, LDK, sDS + 8 * first * LDSO, LDSO, k0, nt);
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                if (i >= nt) break;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int s = 16 * rb + fg + 8 * hf, pp = 8 * (first + i) + 2 * ft;
                    if (s >= len) continue;
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        if (pp + u >= HEADDIM) break;
                        const float v = xacc[i][2 * hf + u] + s_xw[s] * uacc[i][2 * hf + u] + dsk * sDY[s * LDX + pp + u];
                        A.dproj[(size_t)(start + s) * PROJ_LD + X_OFF + h * HEADDIM + pp + u] = v;
                    }
                }
            }
        }

        // ---- 4a. dQ̃ = GW·K̃ (GW dies below; S comes into its place)
        const int q_rb = TileQ::rb(warp), q_first = TileQ::first(warp), q_nt = TileQ::count(warp);
        float qacc[TileQ::T][4];
        zero_acc(qacc);
#pragma unroll BWD_KUNROLL
        for (int k0 = 0; k0 < CHP; k0 += KSTEP)
            if (k0 < 16 * q_rb + 16)  // GW is zero right of the diagonal
                mma_kstep<TileQ::T, true, false>(qacc, sGW + 16 * q_rb * LDM, LDM, sK + 8 * q_first, LDK, k0, q_nt);

        // ---- 3. dK̃ = w_s·(X·dS') + GWᵀ·Q̃, and u_s
        {
            float kacc[TileQ::T][4];
            {
                float vacc[TileQ::T][4];
                zero_acc(vacc);
#pragma unroll BWD_KUNROLL
                for (int k0 = 0; k0 < PP; k0 += KSTEP)
                    mma_kstep<TileQ::T, true, false>(vacc, sX + 16 * q_rb * LDX, LDX, sDS + 8 * q_first, LDSO, k0, q_nt);
                float rowu[2] = {0.f, 0.f};
#pragma unroll
                for (int i = 0; i < TileQ::T; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int s = 16 * q_rb + fg + 8 * (e >> 1), n = 8 * (q_first + i) + 2 * ft + (e & 1);
                        kacc[i][e] = 0.f;
                        if (i < q_nt) {
                            rowu[e >> 1] += vacc[i][e] * sK[s * LDK + n];
                            kacc[i][e] = s_xw[s] * vacc[i][e];
                        }
                    }
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float v = quad_sum(rowu[hf]);
                    if (ft == 0) s_rowp[(16 * q_rb + fg + 8 * hf) * SCAN_WARPS + warp % TileQ::WPR] = v;
                }
            }
#pragma unroll BWD_KUNROLL
            for (int k0 = 0; k0 < CHP; k0 += KSTEP)
                if (k0 + KSTEP > 16 * q_rb)  // GWᵀ is zero left of the diagonal
                    mma_kstep<TileQ::T, false, false>(kacc, sGW + 16 * q_rb, LDM, sQ + 8 * q_first, LDQ, k0, q_nt);
            // dk = R(φ)ᵀ·dk̃ and the key's part of dφ.
            unrotate<false>(kacc, sK, LDK, s_cs, A.dphi, A.dk, start, len, h, q_rb, q_first, q_nt, lane);
        }
        __syncthreads();  // Σ, GW dead; u_s partials complete
        for (int j = tid; j < CHP; j += SCAN_THREADS) {
            float u = 0.f;
            for (int w = 0; w < TileQ::WPR; ++w) u += s_rowp[j * SCAN_WARPS + w];
            s_dc[j] += s_eend[j] * u;
            s_dlc[j] -= s_xw[j] * u;
            s_uxw[j] = s_xw[j] * u;
        }
        {
            const float* src = A.sbuf + ((size_t)c * NHEADS + h) * HEADDIM * DSTATE;
            for (int e = tid; e < PP * (NP / 4); e += SCAN_THREADS) {
                const int pp = e / (NP / 4), n = 4 * (e % (NP / 4));
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (pp < HEADDIM && n < DSTATE) v = *reinterpret_cast<const float4*>(src + pp * DSTATE + n);
                *reinterpret_cast<float4*>(sS + pp * LDSO + n) = v;
            }
        }
        __syncthreads();

        // ---- 4b. dQ̃ += dYe·S; dq = R(φ)ᵀ·dq̃ and the query's part of dφ
#pragma unroll BWD_KUNROLL
        for (int k0 = 0; k0 < PP; k0 += KSTEP)
            mma_kstep<TileQ::T, true, false>(qacc, sDYE + 16 * q_rb * LDX, LDX, sS + 8 * q_first, LDSO, k0, q_nt);
        unrotate<true>(qacc, sQ, LDQ, s_cs, A.dphi, A.dq, start, len, h, q_rb, q_first, q_nt, lane);

        // ---- 5. dlc_j += e^{Lc_j}·⟨dy_j, (Q̃Sᵀ)_j⟩;  dlc_end += e^{Lc_end}·⟨dS', S⟩
        {
            const int rb = TileY::rb(warp), first = TileY::first(warp), nt = TileY::count(warp);
            float iacc[TileY::T][4];
            zero_acc(iacc);
#pragma unroll BWD_KUNROLL
            for (int k0 = 0; k0 < NP; k0 += KSTEP)
                mma_kstep<TileY::T, true, true>(iacc, sQ + 16 * rb * LDQ, LDQ, sS + 8 * first * LDSO, LDSO, k0, nt);
            float rowi[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < TileY::T; ++i) {
                if (i >= nt) break;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = 16 * rb + fg + 8 * (e >> 1), pp = 8 * (first + i) + 2 * ft + (e & 1);
                    rowi[e >> 1] += iacc[i][e] * sDY[j * LDX + pp];
                }
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float v = quad_sum(rowi[hf]);
                if (ft == 0) s_rowp[(16 * rb + fg + 8 * hf) * SCAN_WARPS + warp % TileY::WPR] = v;
            }
        }
        float ends = 0.f;
#pragma unroll
        for (int i = 0; i < TileS::T; ++i) {
            if (i >= s_nt) break;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int pp = 16 * s_rb + fg + 8 * (e >> 1), n = 8 * (s_first + i) + 2 * ft + (e & 1);
                ends += sacc[i][e] * sS[pp * LDSO + n];
            }
        }
        ends = warp_sum(ends);
        if (lane == 0) s_red[warp] = ends;

        // ---- 6. dS' ← e^{Lc_end}·dS' + dYeᵀ·Q̃
        {
            const float el = expf(lc_end);
#pragma unroll
            for (int i = 0; i < TileS::T; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) sacc[i][e] *= el;
#pragma unroll BWD_KUNROLL
            for (int k0 = 0; k0 < CHP; k0 += KSTEP)
                mma_kstep<TileS::T, false, false>(sacc, sDYE + 16 * s_rb, LDX, sQ + 8 * s_first, LDQ, k0, s_nt);
        }
        __syncthreads();

        // ---- 7. the per-token scalars, da as a reverse cumulative sum
        if (tid == 0) {
            float dl_end = 0.f;
            for (int w = 0; w < SCAN_WARPS; ++w) dl_end += s_red[w];
            dl_end *= expf(lc_end);
            for (int j = 0; j < len; ++j) dl_end += s_uxw[j];
            float acc = 0.f;
            for (int j = len - 1; j >= 0; --j) {
                float inter = 0.f;
                for (int w = 0; w < TileY::WPR; ++w) inter += s_rowp[j * SCAN_WARPS + w];
                float dl = s_dlc[j] + expf(s_lc[j]) * inter;
                if (j == len - 1) dl += dl_end;
                acc += dl;
                A.tokg[(size_t)(start + j) * NHEADS + h] = make_float4(s_dc[j], s_dgam[j], acc, 0.f);
            }
        }
    }
    // Σ⟨dy, x⟩ of this (sequence, head), for D.
    dd_acc = warp_sum(dd_acc);
    __syncthreads();
    if (lane == 0) s_red[warp] = dd_acc;
    __syncthreads();
    if (tid == 0) {
        float t = 0.f;
        for (int w = 0; w < SCAN_WARPS; ++w) t += s_red[w];
        A.dd_part[blockIdx.x * NHEADS + h] = t;
    }
}
