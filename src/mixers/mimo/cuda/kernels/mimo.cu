// Mamba-3 MIMO on the GPU: one layer's kernels between its in_proj and out_proj products
// (docs/mamba3-mimo-spec.md, cited as §n; the CPU twin is src/mixers/mimo/reference.rs).
// Every pass is a packed pass (src/cuda/packed.rs): sequences' rows end to end, each from its
// own state, cut into chunks. In launch order:
//
//   mimo_pre        per row: B̄, C̄ RMS-normed per (rank, group); per head a = A·Δ, β, γ, Δ
//   mimo_phase      per (sequence, head, angle), a warp: φ ← wrap(φ + π·tanh(ang)·Δ) along the
//                   sequence from its state, cos φ and sin φ per row, the last φ to the state
//   the scan        the chunked matrix form on the tensor cores (mimo_chunk.cu:
//                   mimo_chunk_states, mimo_chunk_carry, mimo_chunk_out), or for passes
//                   of a few rows per sequence (decode steps) mimo_scan_rows below, the
//                   recurrent form in place on the state; y_r = h·q̃_r + D·u_r before the gate
//   mimo_tail       per sequence: the state's k (last row's rotated keys) and v (last raw x)
//   mimo_gate       per row: o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r) in the GEMM dtype
//   mimo_glu        per row (GatedMLP blocks): v ⊙ silu(g)
//
// mimo_scan_rows: with u_r = x ⊙ ψ_r and w_t = Σ_r outer(u_{t,r}, k̃_{t,r}), the state
// follows h_t = α_t·h_{t-1} + β_t·w_{t-1} + γ_t·w_t (§2.6), a sequence's first row taking
// w_{t-1} from the state's k and v (the boundary fold of §3.4). Keys and queries are rotated
// where they are read: lane q of a channel holds the state entries n = q + Q·i, and Q
// divides N/2, so the rotation pairs (n, n + N/2) of §2.4 meet in a lane.
// DSTATE (N), MIMO_R (R) and MIMO_Q (Q) are compile-time.
#define MIMO_SL (DSTATE / MIMO_Q)
#define MIMO_HALF (MIMO_SL / 2)

struct MimoScan {
    const float* proj;      // in_proj output [rows, ld]: z, x, B, C, dd_dt, dd_A, trap, angles
    int ld;
    int heads, headdim, groups, angles;
    int x_off, b_off, dt_off, a_off, trap_off, ang_off;
    const float* dt_bias;   // [H]
    const float* b_bias;    // [H, R, N]
    const float* c_bias;
    const float* b_norm;    // [N]
    const float* c_norm;
    const float* mimo_x;    // ψ [H, R, P]
    const float* mimo_z;    // ζ
    const float* mimo_o;    // ω
    const float* d_skip;    // [H]
    const float* out_norm;  // [H·P] or null
    float a_floor;
    int a_softplus;         // A = −softplus(dd_A) instead of the heavy tail
    float eps;
    float* bcn;             // [rows, 2, R·G·N]: B̄ then C̄
    float4* coef;           // [rows, H]: a = A·Δ, β, γ, Δ
    float2* cs;             // [rows, H, S]: cos φ, sin φ
    long long angle_off, ssm_off, k_off, v_off;  // this layer's state tensors, in floats (ssm: state_t)
};

__device__ __forceinline__ float mimo_wrap(float phi) {
    const float two_pi = 6.283185307179586f;
    float w = phi - two_pi * floorf(phi / two_pi);
    return w >= two_pi ? w - two_pi : w;
}

// One block per row; a warp per RMSNorm of an N-row of B or C; the first threads do the heads.
extern "C" __global__ void mimo_pre(MimoScan p) {
    const size_t row = blockIdx.x;
    const float* pr = p.proj + row * p.ld;
    const int bcw = MIMO_R * p.groups * DSTATE;
    for (int h = threadIdx.x; h < p.heads; h += blockDim.x) {
        const float delta = softplus_f(pr[p.dt_off + h] + p.dt_bias[h]);
        const float u = pr[p.a_off + h];
        const float f = p.a_softplus ? softplus_f(u) : (u >= 0.f ? 1.f + u : 1.f / (1.f - u));
        const float a = fminf(-f, -p.a_floor) * delta;
        const float lambda = 1.f / (1.f + expf(-pr[p.trap_off + h]));
        const float alpha = expf(a);
        p.coef[row * p.heads + h] =
            make_float4(a, alpha * delta * (1.f - lambda), lambda * delta, delta);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int j = warp; j < 2 * MIMO_R * p.groups; j += warps) {
        const int which = j / (MIMO_R * p.groups), rg = j % (MIMO_R * p.groups);
        const float* src = pr + p.b_off + which * bcw + rg * DSTATE;
        const float* w = which ? p.c_norm : p.b_norm;
        float ss = 0.f;
        for (int n = lane; n < DSTATE; n += 32) ss += src[n] * src[n];
        const float r = 1.f / sqrtf(fam_warp_sum(ss) / (float)DSTATE + p.eps);
        float* dst = p.bcn + row * 2 * bcw + which * bcw + rg * DSTATE;
        for (int n = lane; n < DSTATE; n += 32) dst[n] = src[n] * r * w[n];
    }
}

// One warp per (sequence, head, angle), 32 rows at a time: lane j's φ is the entering φ plus
// the inclusive prefix sum of the 32 rows' increments π·tanh(ang)·Δ, wrapped once, and the
// next 32 rows enter with the last row's. (A thread walking the rows one by one took 0.8 ms
// a layer for a 4k prompt on an H100, the φ chain's latency times the rows; the sums here
// round differently from wrapping at every row, within f32's rounding of φ.)
extern "C" __global__ void mimo_phase(MimoScan p, const int* seq_row0, const int* seq_len,
                                      const unsigned long long* seq_state) {
    const int s = blockIdx.x;
    const int e = (blockIdx.y * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (e >= p.heads * p.angles) return;  // whole warps (the block is a multiple of 32)
    const int h = e / p.angles, i = e % p.angles;
    float* st = reinterpret_cast<float*>(seq_state[s]) + p.angle_off + e;
    float phi = *st;
    const int row0 = seq_row0[s], len = seq_len[s];
    const float pi = 3.14159265358979f;
    for (int t0 = 0; t0 < len; t0 += 32) {
        const int t = t0 + lane;
        const size_t row = row0 + t;
        float v = t < len ? pi * tanhf(__ldg(p.proj + row * p.ld + p.ang_off + i)) *
                                __ldg(&p.coef[row * p.heads + h].w)
                          : 0.f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        const float mine = mimo_wrap(phi + v);
        if (t < len) {
            float sn, c;
            sincosf(mine, &sn, &c);
            p.cs[(row * p.heads + h) * p.angles + i] = make_float2(c, sn);
        }
        phi = __shfl_sync(0xffffffffu, mine, min(31, len - 1 - t0));
    }
    if (lane == 0) *st = phi;
}

// Lane q's entries of the rotated key (`which` 0) or query (1) of head h, rank r, at `row`:
// B̄ (C̄) of the head's group plus the bias, the pairs (n, n + N/2) with n < S rotated.
__device__ __forceinline__ void mimo_kq(const MimoScan& p, size_t row, int h, int g, int r,
                                        int q, int which, float out[MIMO_SL]) {
    const int bcw = MIMO_R * p.groups * DSTATE;
    const float* src = p.bcn + row * 2 * bcw + which * bcw + (r * p.groups + g) * DSTATE + q;
    const float* bias = (which ? p.c_bias : p.b_bias) + (h * MIMO_R + r) * DSTATE + q;
#pragma unroll
    for (int i = 0; i < MIMO_SL; ++i) out[i] = __ldg(src + i * MIMO_Q) + __ldg(bias + i * MIMO_Q);
    const float2* cs = p.cs + (row * p.heads + h) * p.angles;
#pragma unroll
    for (int i = 0; i < MIMO_HALF; ++i) {
        const int n = q + i * MIMO_Q;
        if (n < p.angles) {
            const float2 c = __ldg(cs + n);
            const float a = out[i], b = out[i + MIMO_HALF];
            out[i] = a * c.x - b * c.y;
            out[i + MIMO_HALF] = a * c.y + b * c.x;
        }
    }
}

// This thread's place in the recurrent scan, and the keys and raw x of the token before the
// sequence's first (the state's k and v, §3.4).
struct MimoPlace {
    int c, hd, q, pp, g, row0, len;
    float psi[MIMO_R];
    float x_prev;
    float k_prev[MIMO_R][MIMO_SL];
};

__device__ __forceinline__ void mimo_place(const MimoScan& p, const int* chunk_row0, const int* chunk_len,
                                           const int* chunk_seq, const unsigned long long* seq_state,
                                           MimoPlace& w) {
    w.c = blockIdx.x;
    w.hd = blockIdx.y;
    w.q = threadIdx.x % MIMO_Q;
    w.pp = blockIdx.z * (blockDim.x / MIMO_Q) + threadIdx.x / MIMO_Q;
    w.g = w.hd / (p.heads / p.groups);
    w.row0 = chunk_row0[w.c];
    w.len = chunk_len[w.c];
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r) w.psi[r] = p.mimo_x[(w.hd * MIMO_R + r) * p.headdim + w.pp];
    const float* st = reinterpret_cast<const float*>(seq_state[chunk_seq[w.c]]);
    w.x_prev = st[p.v_off + w.hd * p.headdim + w.pp];
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r)
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i)
            w.k_prev[r][i] = st[p.k_off + ((size_t)r * p.heads + w.hd) * DSTATE + w.q + i * MIMO_Q];
}

// One step of the state: h ← α·h + Σ_r [β·(x⁻ψ_r)·k⁻_r + γ·(xψ_r)·k_r]; the keys and x of
// this row become the previous ones.
__device__ __forceinline__ void mimo_advance(const MimoScan& p, MimoPlace& w, size_t row,
                                             float4 cf, float x, float h[MIMO_SL]) {
    const float alpha = expf(cf.x);
    float k[MIMO_R][MIMO_SL];
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r) mimo_kq(p, row, w.hd, w.g, r, w.q, 0, k[r]);
#pragma unroll
    for (int i = 0; i < MIMO_SL; ++i) h[i] *= alpha;
#pragma unroll
    for (int r = 0; r < MIMO_R; ++r) {
        const float wb = cf.y * w.x_prev * w.psi[r], wg = cf.z * x * w.psi[r];
#pragma unroll
        for (int i = 0; i < MIMO_SL; ++i) {
            h[i] = h[i] + wb * w.k_prev[r][i] + wg * k[r][i];
            w.k_prev[r][i] = k[r][i];
        }
    }
    w.x_prev = x;
}

// The recurrent scan of a pass whose every sequence is one chunk of a few rows (decode
// steps), in place on the state: y_r before the gate, f32 [rows, H, R, P].
extern "C" __global__ void mimo_scan_rows(MimoScan p, const int* chunk_row0, const int* chunk_len,
                                          const int* chunk_seq, const unsigned long long* seq_state, float* y) {
    MimoPlace w;
    mimo_place(p, chunk_row0, chunk_len, chunk_seq, seq_state, w);
    const size_t at = ((size_t)w.hd * p.headdim + w.pp) * DSTATE + w.q;
    state_t* st = reinterpret_cast<state_t*>(reinterpret_cast<float*>(seq_state[chunk_seq[w.c]]) + p.ssm_off) + at;
    float h[MIMO_SL];
#pragma unroll
    for (int i = 0; i < MIMO_SL; ++i) h[i] = st_load(st + i * MIMO_Q);
    const float dskip = p.d_skip[w.hd];
    for (int t = 0; t < w.len; ++t) {
        const size_t row = w.row0 + t;
        const float4 cf = p.coef[row * p.heads + w.hd];
        const float x = p.proj[row * p.ld + p.x_off + w.hd * p.headdim + w.pp];
        mimo_advance(p, w, row, cf, x, h);
        float* yr = y + ((row * p.heads + w.hd) * MIMO_R) * p.headdim + w.pp;
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) {
            float qr[MIMO_SL];
            mimo_kq(p, row, w.hd, w.g, r, w.q, 1, qr);
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < MIMO_SL; ++i) acc += h[i] * qr[i];
            acc = sum_adjacent_lanes<MIMO_Q>(acc);
            if (w.q == 0) yr[r * p.headdim] = acc + dskip * x * w.psi[r];
        }
    }
#pragma unroll
    for (int i = 0; i < MIMO_SL; ++i) st_store(st + i * MIMO_Q, h[i]);
}

// The state's k (the last row's rotated keys, [R, H, N]) and v (its raw x, [H, P]). One block
// per sequence, after the scan has read the old ones.
extern "C" __global__ void mimo_tail(MimoScan p, const int* seq_row0, const int* seq_len,
                                     const unsigned long long* seq_state) {
    const int s = blockIdx.x;
    const size_t row = seq_row0[s] + seq_len[s] - 1;
    float* st = reinterpret_cast<float*>(seq_state[s]);
    const int half = DSTATE / 2, bcw = MIMO_R * p.groups * DSTATE;
    for (int e = threadIdx.x; e < MIMO_R * p.heads * half; e += blockDim.x) {
        const int r = e / (p.heads * half), h = (e / half) % p.heads, n = e % half;
        const int g = h / (p.heads / p.groups);
        const float* src = p.bcn + row * 2 * bcw + (r * p.groups + g) * DSTATE;
        const float* bias = p.b_bias + (h * MIMO_R + r) * DSTATE;
        float a = src[n] + bias[n], b = src[n + half] + bias[n + half];
        if (n < p.angles) {
            const float2 c = p.cs[(row * p.heads + h) * p.angles + n];
            const float a0 = a;
            a = a0 * c.x - b * c.y;
            b = a0 * c.y + b * c.x;
        }
        float* k = st + p.k_off + ((size_t)r * p.heads + h) * DSTATE;
        k[n] = a;
        k[n + half] = b;
    }
    for (int e = threadIdx.x; e < p.heads * p.headdim; e += blockDim.x)
        st[p.v_off + e] = p.proj[row * p.ld + p.x_off + e];
}

// o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r) (§2.7), G the per-rank RMSNorm over P times
// out_norm[h] when there is one. One block per row, a warp per head.
extern "C" __global__ void mimo_gate(MimoScan p, const float* y, act_t* out) {
    const size_t row = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int pn = p.headdim;
    for (int h = warp; h < p.heads; h += warps) {
        const float* yh = y + (row * p.heads + h) * MIMO_R * pn;
        float rr[MIMO_R];
#pragma unroll
        for (int r = 0; r < MIMO_R; ++r) {
            rr[r] = 1.f;
            if (p.out_norm) {
                float ss = 0.f;
                for (int i = lane; i < pn; i += 32) ss += yh[r * pn + i] * yh[r * pn + i];
                rr[r] = 1.f / sqrtf(fam_warp_sum(ss) / (float)pn + p.eps);
            }
        }
        const float* z = p.proj + row * p.ld + h * pn;
        for (int i = lane; i < pn; i += 32) {
            float o = 0.f;
#pragma unroll
            for (int r = 0; r < MIMO_R; ++r) {
                const int at = (h * MIMO_R + r) * pn + i;
                float g = yh[r * pn + i];
                if (p.out_norm) g = g * rr[r] * p.out_norm[h * pn + i];
                o = o + p.mimo_o[at] * g * silu_f(z[i] * p.mimo_z[at]);
            }
            out[row * (size_t)(p.heads * pn) + h * pn + i] = from_f<act_t>(o);
        }
    }
}

// out[r, i] = v ⊙ silu(g) with [v ‖ g] = vg[r, :] (the GatedMLP's fc1 output, f32 [rows, 2·w]),
// in the GEMM dtype. Grid (rows), block 256.
extern "C" __global__ void mimo_glu(const float* vg, int width, act_t* out) {
    const size_t r = blockIdx.x;
    const float* src = vg + r * 2 * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        out[r * width + i] = from_f<act_t>(src[i] * silu_f(src[width + i]));
}
