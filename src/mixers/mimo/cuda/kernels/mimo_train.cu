// Training the Mamba-3 MIMO mixer on the GPU: the forward that keeps what the backward
// needs, and its exact backward — straight ports of src/mixers/mimo/train/{forward,backward}.rs
// (the same names, the same order of operations where it matters), in f32. Correctness
// first: one block per (sequence, head) walks its tokens one by one with the head's P×N
// state in shared memory; a chunked version on tensor cores is later work.
//
// Launch order per layer (src/train/cuda/mimo.rs):
//   forward   mt_rows_pre (block per row) → mt_head_fwd (block per (sequence, head))
//   backward  mt_head_fwd again (refills the per-head scratch: k̃, q̃, y, cos/sin, chunk
//             states) → mt_combine_bwd → mt_head_bwd → mt_rows_bwd, then column sums on
//             the host side for the parameters shared by the rows or the sequences.
//
// Sizes are arguments (`MimoTrainArgs`, the same fields in the same order as
// `MimoTrainArgs` in src/train/cuda/mimo.rs); every kernel runs with 256 threads.
// Indices: hb = b·H + h (sequence, head); row = b·T + t.

struct MimoTrainArgs {
    // parameters (f32)
    const float* dt_bias;  // [H]
    const float* b_bias;   // [H, R, N]
    const float* c_bias;   // [H, R, N]
    const float* b_norm;   // [N]
    const float* c_norm;   // [N]
    const float* mimo_x;   // ψ [H, R, P]
    const float* mimo_z;   // ζ [H, R, P]
    const float* mimo_o;   // ω [H, R, P]
    const float* d_skip;   // D [H]
    const float* out_norm; // [H·P], or null
    // the in_proj output [rows, ld] and its gradient
    const float* proj;
    float* dproj;
    // per row (saved by the forward, per layer)
    float* bn;     // B̄ [rows, R, G, N]
    float* cn;     // C̄ [rows, R, G, N]
    float* rb;     // RMS factors [rows, R·G]
    float* rc;
    float* delta;  // Δ [rows, H]
    float* aval;   // A [rows, H]
    float* lambda; // λ [rows, H]
    float* theta;  // θ [rows, S]
    // per (sequence, head) (scratch shared by the layers)
    float* cs;     // cos φ [B, H, T, S]
    float* sn;     // sin φ [B, H, T, S]
    float* k;      // k̃ [B, H, T, R, N]
    float* q;      // q̃ [B, H, T, R, N]
    float* y;      // readouts [B, H, T, R, P]
    float* states; // the state entering each chunk [B, H, nchunks, P, N]
    float* o;      // the combined output [rows, H·P]
    // backward
    const float* d_o; // [rows, H·P]
    float* dy;        // [B, H, T, R, P]
    float* du;        // [B, H, T, R, P]
    float* dkt;       // dk̃ [B, H, T, R, N]
    float* dqt;       // dq̃ [B, H, T, R, N]
    float* st;        // a chunk's states [B, H, chunk + 1, P, N]
    float* gph;       // suffix sums of dφ [B, H, T, S]
    float* dk;        // of the biased unrotated keys [rows, H, R, N]
    float* dq;        // of the queries [rows, H, R, N]
    float* dtheta;    // [rows, H, S]
    float* ddelta;    // [B, H, T]
    float* daval;     // [B, H, T]
    float* dlambda;   // [B, H, T]
    float* dd;        // [B, H]
    float* dpsi;      // [B, H, R, P]
    float* dzeta;     // [B, H, R, P]
    float* domega;    // [B, H, R, P]
    float* dwnorm;    // [B, H, P]
    float* dbc_w;     // B/C norm weights' contributions [2, rows·R·G, N]
    // sizes and offsets
    int batch, seq_len, heads, headdim, d_state, groups, rank, angles, chunk;
    int ld, x_off, b_off, c_off, dt_off, a_off, trap_off, ang_off;
    int a_softplus; // 0: heavy tail, 1: softplus
    float a_floor;
    float eps;
};
// 46 pointers, 18 ints, 2 floats: the host's struct has the same size (checked there too).
static_assert(sizeof(MimoTrainArgs) == 448, "MimoTrainArgs differs from the host's");

#define MT_PI 3.14159265358979f

__device__ __forceinline__ float mt_sigmoid(float u) { return 1.f / (1.f + expf(-u)); }
__device__ __forceinline__ float mt_silu(float u) { return u * mt_sigmoid(u); }
__device__ __forceinline__ float mt_silu_grad(float u) {
    const float s = mt_sigmoid(u);
    return s * (1.f + u * (1.f - s));
}
__device__ __forceinline__ float mt_softplus(float u) { return u > 20.f ? u : log1pf(expf(u)); }

// A = min(−f(dd_A), −A_floor), f the heavy tail or softplus.
__device__ __forceinline__ float mt_a_value(float dd_a, const MimoTrainArgs& a) {
    const float f = a.a_softplus ? mt_softplus(dd_a) : (dd_a >= 0.f ? 1.f + dd_a : 1.f / (1.f - dd_a));
    return fminf(-f, -a.a_floor);
}

// dA/d(dd_A), 0 where the floor holds.
__device__ __forceinline__ float mt_a_value_grad(float dd_a, const MimoTrainArgs& a) {
    float f, fp;
    if (a.a_softplus) {
        f = mt_softplus(dd_a);
        fp = mt_sigmoid(dd_a);
    } else if (dd_a >= 0.f) {
        f = 1.f + dd_a;
        fp = 1.f;
    } else {
        const float v = 1.f - dd_a;
        f = 1.f / v;
        fp = 1.f / (v * v);
    }
    return -f < -a.a_floor ? -fp : 0.f;
}

// φ − 2π·floor(φ/2π), into [0, 2π).
__device__ __forceinline__ float mt_wrap(float phi) {
    const float two_pi = MT_PI + MT_PI;
    const float w = phi - two_pi * floorf(phi / two_pi);
    return w >= two_pi ? w - two_pi : w;
}

// The sum of `v` over the block, returned to every thread; `red` holds 32 floats of shared
// memory. A fixed tree: deterministic.
__device__ float mt_block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); // `red` is free: every thread has read the previous sum
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) s += red[i];
    return s;
}

// The sum of `v` over the warp, returned to every lane.
__device__ __forceinline__ float mt_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One state entry (p, n) after one token (forward.rs `advance`): α·s + Σ_r [β·x⁻_p·ψ_rp·k̃⁻_rn
// + γ·x_p·ψ_rp·k̃_rn]; `kp`/`xp` are null at the first token of a window.
__device__ __forceinline__ float mt_advance(float s, float alpha, float beta, float gamma,
                                            const float* xp, const float* xc, const float* kp,
                                            const float* kc, const float* psi, int p, int n,
                                            int P, int N, int R) {
    float v = alpha * s;
    for (int r = 0; r < R; ++r) {
        const float ps = psi[r * P + p];
        const float wg = gamma * xc[p] * ps;
        if (kp) {
            const float wb = beta * xp[p] * ps;
            v = v + wb * kp[r * N + n] + wg * kc[r * N + n];
        } else {
            v = v + wg * kc[r * N + n];
        }
    }
    return v;
}

// (α, β, γ) of row-head `i`: α = e^{AΔ}, β = α·Δ·(1 − λ), γ = λ·Δ.
__device__ __forceinline__ void mt_abg(const MimoTrainArgs& a, size_t i, float& alpha, float& beta,
                                       float& gamma) {
    const float delta = a.delta[i], lambda = a.lambda[i];
    alpha = expf(a.aval[i] * delta);
    beta = alpha * delta * (1.f - lambda);
    gamma = lambda * delta;
}

// ---------------------------------------------------------------------------------------
// Forward

// Per row (forward.rs `rows_pre`): one N-wide RMSNorm per (rank, group) row of B and C, all
// sharing w_B (resp. w_C); Δ, A, λ per head; θ per angle. A warp per normed row.
extern "C" __global__ void mt_rows_pre(MimoTrainArgs a) {
    const size_t row = blockIdx.x;
    const int N = a.d_state, RG = a.rank * a.groups, H = a.heads, S = a.angles;
    const float* raw = a.proj + row * a.ld;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int jj = warp; jj < 2 * RG; jj += warps) {
        const bool is_c = jj >= RG;
        const int j = is_c ? jj - RG : jj;
        const float* x = raw + (is_c ? a.c_off : a.b_off) + j * N;
        const float* w = is_c ? a.c_norm : a.b_norm;
        float ss = 0.f;
        for (int n = lane; n < N; n += 32) ss += x[n] * x[n];
        ss = mt_warp_sum(ss);
        const float r = 1.f / sqrtf(ss / (float)N + a.eps);
        float* out = (is_c ? a.cn : a.bn) + row * RG * N + j * N;
        for (int n = lane; n < N; n += 32) out[n] = x[n] * r * w[n];
        if (lane == 0) (is_c ? a.rc : a.rb)[row * RG + j] = r;
    }
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        a.delta[row * H + h] = mt_softplus(raw[a.dt_off + h] + a.dt_bias[h]);
        a.aval[row * H + h] = mt_a_value(raw[a.a_off + h], a);
        a.lambda[row * H + h] = mt_sigmoid(raw[a.trap_off + h]);
    }
    for (int i = threadIdx.x; i < S; i += blockDim.x) a.theta[row * S + i] = MT_PI * tanhf(raw[a.ang_off + i]);
}

// Spec-MIMO §2.8 for one (sequence, head) from a zero state (forward.rs `head_forward`):
// keeps cos/sin, k̃, q̃, the readouts y and the state entering each chunk; writes the head's
// output into `o`. Grid (B, H); shared memory P·N + 3·R·N + 2·P + 3·S + R·P + R floats
// (`fwd_smem` in src/train/cuda/mimo.rs).
extern "C" __global__ void mt_head_fwd(MimoTrainArgs a) {
    const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int P = a.headdim, N = a.d_state, R = a.rank, S = a.angles, T = a.seq_len, H = a.heads;
    const int RN = R * N, RP = R * P, PN = P * N, half = N / 2, G = a.groups;
    const int g = h / (H / G), nch = (T + a.chunk - 1) / a.chunk;
    extern __shared__ float sm[];
    float* s = sm;          // the state [P, N]
    float* kc = s + PN;     // k̃ of this token [R, N]
    float* kp = kc + RN;    // k̃ of the previous token
    float* qc = kp + RN;    // q̃ of this token
    float* xc = qc + RN;    // x of this token [P]
    float* xp = xc + P;     // x of the previous token
    float* phi = xp + P;    // [S]
    float* cosv = phi + S;  // [S]
    float* sinv = cosv + S; // [S]
    float* yv = sinv + S;   // readouts [R, P]
    float* rf = yv + RP;    // output-norm factors [R]
    const size_t hb = (size_t)b * H + h;
    const float* psi = a.mimo_x + (size_t)h * RP;
    const float* zeta = a.mimo_z + (size_t)h * RP;
    const float* omega = a.mimo_o + (size_t)h * RP;
    const float* wn = a.out_norm ? a.out_norm + (size_t)h * P : nullptr;
    const float dh = a.d_skip[h];
    for (int e = tid; e < PN; e += nt) s[e] = 0.f;
    for (int i = tid; i < S; i += nt) phi[i] = 0.f;
    __syncthreads();
    for (int t = 0; t < T; ++t) {
        const size_t row = (size_t)b * T + t, i_bh = row * H + h, ht = hb * T + t;
        if (t % a.chunk == 0) {
            float* dst = a.states + (hb * nch + t / a.chunk) * PN;
            for (int e = tid; e < PN; e += nt) dst[e] = s[e];
        }
        const float delta = a.delta[i_bh];
        for (int i = tid; i < S; i += nt) {
            phi[i] = mt_wrap(phi[i] + a.theta[row * S + i] * delta);
            float sv, cv;
            sincosf(phi[i], &sv, &cv);
            cosv[i] = cv;
            sinv[i] = sv;
            a.cs[ht * S + i] = cv;
            a.sn[ht * S + i] = sv;
        }
        for (int p = tid; p < P; p += nt) xc[p] = a.proj[row * a.ld + a.x_off + h * P + p];
        __syncthreads();
        // Biased keys and queries, rotated by half-split pairs (i, i + N/2), i < S.
        for (int e = tid; e < R * half; e += nt) {
            const int r = e / half, i = e % half;
            const size_t src = row * (size_t)(R * G * N) + (size_t)(r * G + g) * N;
            const size_t bias = ((size_t)h * R + r) * N;
            const float k0 = a.bn[src + i] + a.b_bias[bias + i];
            const float k1 = a.bn[src + i + half] + a.b_bias[bias + i + half];
            const float q0 = a.cn[src + i] + a.c_bias[bias + i];
            const float q1 = a.cn[src + i + half] + a.c_bias[bias + i + half];
            float kr0 = k0, kr1 = k1, qr0 = q0, qr1 = q1;
            if (i < S) {
                const float c = cosv[i], sv = sinv[i];
                kr0 = k0 * c - k1 * sv;
                kr1 = k0 * sv + k1 * c;
                qr0 = q0 * c - q1 * sv;
                qr1 = q0 * sv + q1 * c;
            }
            kc[r * N + i] = kr0;
            kc[r * N + i + half] = kr1;
            qc[r * N + i] = qr0;
            qc[r * N + i + half] = qr1;
            a.k[ht * RN + r * N + i] = kr0;
            a.k[ht * RN + r * N + i + half] = kr1;
            a.q[ht * RN + r * N + i] = qr0;
            a.q[ht * RN + r * N + i + half] = qr1;
        }
        __syncthreads();
        float alpha, beta, gamma;
        mt_abg(a, i_bh, alpha, beta, gamma);
        for (int e = tid; e < PN; e += nt) {
            const int p = e / N, n = e % N;
            s[e] = mt_advance(s[e], alpha, beta, gamma, t > 0 ? xp : nullptr, xc, t > 0 ? kp : nullptr, kc,
                              psi, p, n, P, N, R);
        }
        __syncthreads();
        // Readouts y_r = S·q̃_r + D·x ⊙ ψ_r.
        for (int e = tid; e < RP; e += nt) {
            const int r = e / P, p = e % P;
            float acc = 0.f;
            for (int n = 0; n < N; ++n) acc += s[p * N + n] * qc[r * N + n];
            const float v = acc + dh * xc[p] * psi[r * P + p];
            yv[e] = v;
            a.y[ht * RP + e] = v;
        }
        __syncthreads();
        if (wn) {
            for (int r = tid; r < R; r += nt) {
                float ss = 0.f;
                for (int p = 0; p < P; ++p) ss += yv[r * P + p] * yv[r * P + p];
                rf[r] = 1.f / sqrtf(ss / (float)P + a.eps);
            }
            __syncthreads();
        }
        // o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r).
        for (int p = tid; p < P; p += nt) {
            const float z = a.proj[row * a.ld + h * P + p]; // z is the first slice
            float acc = 0.f;
            for (int r = 0; r < R; ++r) {
                const float gr = wn ? yv[r * P + p] * rf[r] * wn[p] : yv[r * P + p];
                acc = acc + omega[r * P + p] * gr * mt_silu(z * zeta[r * P + p]);
            }
            a.o[row * (size_t)(H * P) + h * P + p] = acc;
        }
        // This token's keys and values become the previous ones.
        for (int e = tid; e < RN; e += nt) kp[e] = kc[e];
        for (int p = tid; p < P; p += nt) xp[p] = xc[p];
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// Backward

// Backward of the output combination of every token of one (sequence, head) (backward.rs
// `combine_backward`): dy [T, R, P], dz into dproj, the head's dζ, dω and output-norm
// partials. Grid (B, H); shared memory 5·R·P + P + 2·R floats (`combine_smem`).
extern "C" __global__ void mt_combine_bwd(MimoTrainArgs a) {
    const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int P = a.headdim, R = a.rank, T = a.seq_len, H = a.heads, RP = R * P;
    extern __shared__ float sm[];
    float* dg = sm;             // ∂/∂G(y_r) [R, P]
    float* dzr = dg + RP;       // each rank's share of dz [R, P]
    float* dom = dzr + RP;      // dω accumulated over the tokens [R, P]
    float* dze = dom + RP;      // dζ [R, P]
    float* yv = dze + RP;       // this token's readouts [R, P]
    float* dwn = yv + RP;       // output-norm weights' gradient [P]
    float* rf = dwn + P;        // output-norm factors [R]
    float* mean = rf + R;       // rms_bwd's mean(g ⊙ x̂) [R]
    const size_t hb = (size_t)b * H + h;
    const float* zeta = a.mimo_z + (size_t)h * RP;
    const float* omega = a.mimo_o + (size_t)h * RP;
    const float* wn = a.out_norm ? a.out_norm + (size_t)h * P : nullptr;
    for (int e = tid; e < RP; e += nt) dom[e] = dze[e] = 0.f;
    for (int p = tid; p < P; p += nt) dwn[p] = 0.f;
    for (int t = 0; t < T; ++t) {
        const size_t row = (size_t)b * T + t, ht = hb * T + t;
        for (int e = tid; e < RP; e += nt) yv[e] = a.y[ht * RP + e];
        __syncthreads();
        if (wn) {
            for (int r = tid; r < R; r += nt) {
                float ss = 0.f;
                for (int p = 0; p < P; ++p) ss += yv[r * P + p] * yv[r * P + p];
                rf[r] = 1.f / sqrtf(ss / (float)P + a.eps);
            }
            __syncthreads();
        }
        for (int e = tid; e < RP; e += nt) {
            const int r = e / P, p = e % P;
            const float z = a.proj[row * a.ld + h * P + p];
            const float dor = a.d_o[row * (size_t)(H * P) + h * P + p];
            const float gr = wn ? yv[e] * rf[r] * wn[p] : yv[e];
            const float ze = zeta[e], om = omega[e];
            const float u = z * ze;
            const float sl = mt_silu(u);
            dom[e] = dom[e] + dor * gr * sl;
            dg[e] = dor * om * sl;
            const float da = dor * om * gr * mt_silu_grad(u);
            dzr[e] = da * ze;
            dze[e] = dze[e] + da * z;
        }
        __syncthreads();
        for (int p = tid; p < P; p += nt) {
            float dz = 0.f;
            for (int r = 0; r < R; ++r) dz = dz + dzr[r * P + p];
            a.dproj[row * a.ld + h * P + p] = dz;
            if (wn) {
                for (int r = 0; r < R; ++r) dwn[p] = dwn[p] + dg[r * P + p] * (yv[r * P + p] * rf[r]);
            }
        }
        if (wn) {
            for (int r = tid; r < R; r += nt) {
                float dot = 0.f;
                for (int p = 0; p < P; ++p) dot = dot + dg[r * P + p] * wn[p] * (yv[r * P + p] * rf[r]);
                mean[r] = dot / (float)P;
            }
        }
        __syncthreads();
        for (int e = tid; e < RP; e += nt) {
            const int r = e / P, p = e % P;
            a.dy[ht * RP + e] = wn ? rf[r] * (dg[e] * wn[p] - yv[e] * rf[r] * mean[r]) : dg[e];
        }
        __syncthreads();
    }
    for (int e = tid; e < RP; e += nt) {
        a.domega[hb * RP + e] = dom[e];
        a.dzeta[hb * RP + e] = dze[e];
    }
    for (int p = tid; p < P; p += nt) a.dwnorm[hb * P + p] = wn ? dwn[p] : 0.f;
}

// The exact backward of one (sequence, head) (backward.rs `head_backward`), after
// mt_combine_bwd: token by token in reverse, each chunk's states recomputed from the one the
// forward kept; then dx, dψ, the rotation and the phases, and the Δ, A, λ columns of dproj.
// Grid (B, H); shared memory P·N + 3·R·N + 3·R·P + 2·P + 32 floats (`head_bwd_smem`).
extern "C" __global__ void mt_head_bwd(MimoTrainArgs a) {
    const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int P = a.headdim, N = a.d_state, R = a.rank, S = a.angles, T = a.seq_len, H = a.heads;
    const int RN = R * N, RP = R * P, PN = P * N, half = N / 2, L = a.chunk;
    const int nch = (T + L - 1) / L;
    extern __shared__ float sm[];
    float* ds = sm;        // dS [P, N]
    float* qv = ds + PN;   // q̃_t [R, N]
    float* kv = qv + RN;   // k̃_t
    float* kpv = kv + RN;  // k̃_{t−1}
    float* dyv = kpv + RN; // dy_t [R, P]
    float* ut = dyv + RP;  // u_t = x_t ⊙ ψ [R, P]
    float* up = ut + RP;   // u_{t−1}
    float* xc = up + RP;   // x_t [P]
    float* xp = xc + P;    // x_{t−1}
    float* red = xp + P;   // 32 floats for the block sums
    const size_t hb = (size_t)b * H + h;
    const float* psi = a.mimo_x + (size_t)h * RP;
    const float dh = a.d_skip[h];
    const float* xcol = a.proj + a.x_off + h * P; // x of row `row` at xcol[row·ld + p]
    float* du = a.du + hb * T * RP;
    float* dkt = a.dkt + hb * T * RN;
    float* dqt = a.dqt + hb * T * RN;
    float* stb = a.st + hb * (size_t)(L + 1) * PN;
    const float* kh = a.k + hb * T * RN;
    const float* qh = a.q + hb * T * RN;
    for (int e = tid; e < PN; e += nt) ds[e] = 0.f;
    for (size_t e = tid; e < (size_t)T * RP; e += nt) du[e] = 0.f;
    for (size_t e = tid; e < (size_t)T * RN; e += nt) dkt[e] = dqt[e] = 0.f;
    float dd_acc = 0.f; // this thread's share of dD
    __syncthreads();
    for (int c = nch - 1; c >= 0; --c) {
        const int t0 = c * L, t1 = min(T, (c + 1) * L);
        // Recompute S_{t0−1} … S_{t1−1}: slot j holds the state before token t0 + j. Each
        // thread owns its entries through the chunk, so no barrier inside.
        const float* s0 = a.states + (hb * nch + c) * PN;
        for (int e = tid; e < PN; e += nt) {
            const int p = e / N, n = e % N;
            float v = s0[e];
            stb[e] = v;
            for (int t = t0; t < t1; ++t) {
                const size_t row = (size_t)b * T + t;
                float alpha, beta, gamma;
                mt_abg(a, row * H + h, alpha, beta, gamma);
                const bool first = t == 0;
                v = mt_advance(v, alpha, beta, gamma, first ? nullptr : xcol + (row - 1) * a.ld,
                               xcol + row * a.ld, first ? nullptr : kh + (size_t)(t - 1) * RN,
                               kh + (size_t)t * RN, psi, p, n, P, N, R);
                stb[(size_t)(t - t0 + 1) * PN + e] = v;
            }
        }
        __syncthreads();
        for (int t = t1 - 1; t >= t0; --t) {
            const int j = t - t0;
            const size_t row = (size_t)b * T + t, i_bh = row * H + h, ht = hb * T + t;
            const float* s_prev = stb + (size_t)j * PN;
            const float* s_t = stb + (size_t)(j + 1) * PN;
            for (int e = tid; e < RN; e += nt) {
                qv[e] = qh[(size_t)t * RN + e];
                kv[e] = kh[(size_t)t * RN + e];
                kpv[e] = t > 0 ? kh[(size_t)(t - 1) * RN + e] : 0.f;
            }
            for (int p = tid; p < P; p += nt) {
                xc[p] = xcol[row * a.ld + p];
                xp[p] = t > 0 ? xcol[(row - 1) * a.ld + p] : 0.f;
            }
            __syncthreads();
            for (int e = tid; e < RP; e += nt) {
                const int p = e % P;
                dyv[e] = a.dy[ht * RP + e];
                ut[e] = xc[p] * psi[e];
                up[e] = xp[p] * psi[e];
            }
            __syncthreads();
            // Readouts y_{t,r} = S_t·q̃_{t,r} + D·u_{t,r}.
            for (int e = tid; e < PN; e += nt) {
                const int p = e / N, n = e % N;
                float v = ds[e];
                for (int r = 0; r < R; ++r) v = v + dyv[r * P + p] * qv[r * N + n];
                ds[e] = v;
            }
            for (int e = tid; e < RN; e += nt) {
                const int r = e / N, n = e % N;
                float v = 0.f;
                for (int p = 0; p < P; ++p) v = v + s_t[p * N + n] * dyv[r * P + p];
                dqt[(size_t)t * RN + e] = v;
            }
            for (int e = tid; e < RP; e += nt) {
                dd_acc = dd_acc + dyv[e] * ut[e];
                du[(size_t)t * RP + e] = du[(size_t)t * RP + e] + dh * dyv[e];
            }
            __syncthreads();
            float alpha, beta, gamma;
            mt_abg(a, i_bh, alpha, beta, gamma);
            // The γ term (token t) and the β term (token t − 1) of the update.
            float dgamma = 0.f, dbeta = 0.f;
            for (int term = 0; term < 2; ++term) {
                if (term == 1 && t == 0) break;
                const int tk = term == 0 ? t : t - 1;
                const float w = term == 0 ? gamma : beta;
                const float* kr = term == 0 ? kv : kpv;
                const float* ur = term == 0 ? ut : up;
                float acc = 0.f;
                for (int e = tid; e < RP; e += nt) {
                    const int r = e / P, p = e % P;
                    float v = 0.f;
                    for (int n = 0; n < N; ++n) v = v + ds[p * N + n] * kr[r * N + n];
                    acc = acc + ur[e] * v;
                    du[(size_t)tk * RP + e] = du[(size_t)tk * RP + e] + w * v;
                }
                for (int e = tid; e < RN; e += nt) {
                    const int r = e / N, n = e % N;
                    float v = dkt[(size_t)tk * RN + e];
                    for (int p = 0; p < P; ++p) v = v + (w * ur[r * P + p]) * ds[p * N + n];
                    dkt[(size_t)tk * RN + e] = v;
                }
                const float sum = mt_block_sum(acc, red);
                if (term == 0) dgamma = sum;
                else dbeta = sum;
            }
            float pa = 0.f;
            for (int e = tid; e < PN; e += nt) pa = pa + ds[e] * s_prev[e];
            const float dalpha = mt_block_sum(pa, red); // its barriers end the reads of ds
            for (int e = tid; e < PN; e += nt) ds[e] = ds[e] * alpha;
            if (tid == 0) {
                const float delta = a.delta[i_bh], lambda = a.lambda[i_bh], aval = a.aval[i_bh];
                const float da = (dalpha + dbeta * delta * (1.f - lambda)) * alpha;
                a.ddelta[ht] = dbeta * alpha * (1.f - lambda) + dgamma * lambda + da * aval;
                a.dlambda[ht] = -dbeta * alpha * delta + dgamma * delta;
                a.daval[ht] = da * delta;
            }
            __syncthreads();
        }
    }
    const float dd_sum = mt_block_sum(dd_acc, red);
    if (tid == 0) a.dd[hb] = dd_sum;
    // Values: dx = Σ_r du_r ⊙ ψ_r, dψ_r = Σ_t du_{t,r} ⊙ x_t.
    for (size_t e = tid; e < (size_t)T * P; e += nt) {
        const int t = (int)(e / P), p = (int)(e % P);
        float v = 0.f;
        for (int r = 0; r < R; ++r) v = v + du[(size_t)t * RP + r * P + p] * psi[r * P + p];
        a.dproj[((size_t)b * T + t) * a.ld + a.x_off + h * P + p] = v;
    }
    for (int e = tid; e < RP; e += nt) {
        const int p = e % P;
        float v = 0.f;
        for (int t = 0; t < T; ++t) v = v + du[(size_t)t * RP + e] * xcol[((size_t)b * T + t) * a.ld + p];
        a.dpsi[hb * RP + e] = v;
    }
    // The rotation back: dk = R(φ)ᵀ·dk̃ (same for q); coordinates past the pairs pass through.
    for (size_t e = tid; e < (size_t)T * R * half; e += nt) {
        const int t = (int)(e / (R * half)), r = (int)(e / half % R), i = (int)(e % half);
        const size_t ht = hb * T + t, row = (size_t)b * T + t;
        const size_t at = (size_t)t * RN + r * N, out = (row * H + h) * RN + r * N;
        for (int which = 0; which < 2; ++which) {
            const float* drot = (which == 0 ? dkt : dqt) + at;
            float* dout = (which == 0 ? a.dk : a.dq) + out;
            float d0 = drot[i], d1 = drot[i + half];
            if (i < S) {
                const float c = a.cs[ht * S + i], sv = a.sn[ht * S + i];
                dout[i] = d0 * c + d1 * sv;
                dout[i + half] = -d0 * sv + d1 * c;
            } else {
                dout[i] = d0;
                dout[i + half] = d1;
            }
        }
    }
    // The phases: g_t = Σ_{t' ≥ t} dφ_{t'}, dθ_t = g_t·Δ_t (this head's share), in reverse.
    for (int i = tid; i < S; i += nt) {
        float gphi = 0.f;
        for (int t = T - 1; t >= 0; --t) {
            const size_t ht = hb * T + t, row = (size_t)b * T + t;
            for (int r = 0; r < R; ++r) {
                const size_t at = (size_t)t * RN + r * N;
                gphi = gphi - dkt[at + i] * kh[at + i + half] + dkt[at + i + half] * kh[at + i];
                gphi = gphi - dqt[at + i] * qh[at + i + half] + dqt[at + i + half] * qh[at + i];
            }
            a.gph[ht * S + i] = gphi;
            a.dtheta[(row * H + h) * S + i] = gphi * a.delta[row * H + h];
        }
    }
    __syncthreads();
    // dΔ_t += ⟨g_t, θ_t⟩; then Δ = softplus(dd_dt + dt_bias), A = a_value(dd_A), λ = σ(trap)
    // into the row's columns.
    for (int t = tid; t < T; t += nt) {
        const size_t ht = hb * T + t, row = (size_t)b * T + t;
        float ddelta = a.ddelta[ht];
        for (int i = 0; i < S; ++i) ddelta = ddelta + a.gph[ht * S + i] * a.theta[row * S + i];
        const float* raw = a.proj + row * a.ld;
        float* drow = a.dproj + row * a.ld;
        const float u = raw[a.dt_off + h] + a.dt_bias[h];
        drow[a.dt_off + h] = ddelta * (u > 20.f ? 1.f : mt_sigmoid(u));
        drow[a.a_off + h] = mt_a_value_grad(raw[a.a_off + h], a) * a.daval[ht];
        const float lam = a.lambda[row * H + h];
        drow[a.trap_off + h] = a.dlambda[ht] * lam * (1.f - lam);
    }
}

// Per row, after mt_head_bwd: the angle columns (θ = π·tanh(ang), summed over the heads) and
// the B/C columns (dk, dq summed over the heads of a group, then back through the shared
// RMSNorm of each (rank, group) row; the norm weights' contributions into dbc_w). A warp per
// normed row.
extern "C" __global__ void mt_rows_bwd(MimoTrainArgs a) {
    const size_t row = blockIdx.x;
    const int N = a.d_state, R = a.rank, G = a.groups, RG = R * G, H = a.heads, S = a.angles;
    const int hpg = H / G, RN = R * N;
    const float* raw = a.proj + row * a.ld;
    float* drow = a.dproj + row * a.ld;
    const size_t rows = (size_t)a.batch * a.seq_len;
    for (int i = threadIdx.x; i < S; i += blockDim.x) {
        float v = 0.f;
        for (int h = 0; h < H; ++h) v = v + a.dtheta[(row * H + h) * S + i];
        const float th = tanhf(raw[a.ang_off + i]);
        drow[a.ang_off + i] = v * MT_PI * (1.f - th * th);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int jj = warp; jj < 2 * RG; jj += warps) {
        const bool is_c = jj >= RG;
        const int j = is_c ? jj - RG : jj, r = j / G, g = j % G;
        const float* x = raw + (is_c ? a.c_off : a.b_off) + j * N;
        const float* w = is_c ? a.c_norm : a.b_norm;
        const float* dsrc = is_c ? a.dq : a.dk;
        const float rr = (is_c ? a.rc : a.rb)[row * RG + j];
        float* dw = a.dbc_w + ((is_c ? rows * RG : 0) + row * RG + j) * N;
        // dout of the normed row: the heads of group g, rank r
        float dot = 0.f;
        for (int n = lane; n < N; n += 32) {
            float dout = 0.f;
            for (int h = g * hpg; h < (g + 1) * hpg; ++h) dout = dout + dsrc[(row * H + h) * RN + r * N + n];
            const float xh = x[n] * rr;
            dw[n] = dout * xh;
            dot = dot + dout * w[n] * xh;
        }
        const float mean = mt_warp_sum(dot) / (float)N;
        for (int n = lane; n < N; n += 32) {
            float dout = 0.f;
            for (int h = g * hpg; h < (g + 1) * hpg; ++h) dout = dout + dsrc[(row * H + h) * RN + r * N + n];
            const float xh = x[n] * rr;
            drow[(is_c ? a.c_off : a.b_off) + j * N + n] = rr * (dout * w[n] - xh * mean);
        }
    }
}
