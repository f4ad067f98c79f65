// Mamba-3 MIMO on the GPU: one layer's kernels between its in_proj and out_proj products
// (docs/mamba3-mimo-spec.md, cited as §n; the CPU twin is src/mixers/mimo/reference.rs).
// Every pass is a packed pass (src/cuda/packed.rs): sequences' rows end to end, each from its
// own state, cut into chunks. In launch order:
//
//   mimo_pre        per row: B̄, C̄ RMS-normed per (rank, group); per head a = A·Δ, β, γ, Δ
//   mimo_phase      per (sequence, head, angle), a warp: φ ← wrap(φ + π·tanh(ang)·Δ) along the
//                   sequence from its state, cos φ and sin φ per row, the last φ to the state
//   the scan        the chunked matrix form on the tensor cores (mimo_chunk.cu:
//                   mimo_chunk_states, mimo_chunk_carry, mimo_chunk_out); y_r = h·q̃_r + D·u_r
//                   and, in mimo_chunk_out's tiles, the gate: o = Σ_r ω_r ⊙ G(y_r) ⊙
//                   silu(z ⊙ ζ_r) in the GEMM dtype
//   mimo_tail       per sequence: the state's k (last row's rotated keys) and v (last raw x)
//   mimo_glu        per row (GatedMLP blocks): v ⊙ silu(g)
//
// A pass of a few rows per sequence (decode steps) takes mimo_step (mimo_step.cu) instead of
// everything but mimo_glu: the same maths in one launch, the recurrent form in place on the
// state. DSTATE (N), MIMO_R (R) and MIMO_Q (Q) are compile-time.

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

// out[r, i] = v ⊙ silu(g) with [v ‖ g] = vg[r, :] (the GatedMLP's fc1 output, f32 [rows, 2·w]),
// in the GEMM dtype. Grid (rows), block 256.
extern "C" __global__ void mimo_glu(const float* vg, int width, act_t* out) {
    const size_t r = blockIdx.x;
    const float* src = vg + r * 2 * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        out[r * width + i] = from_f<act_t>(src[i] * silu_f(src[width + i]));
}
