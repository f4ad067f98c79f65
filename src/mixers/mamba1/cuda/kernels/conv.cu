// The causal depthwise conv of Mamba-1 and Mamba-2 (spec §2.3, §3.3) over a packed pass:
// rows of several sequences, each continuing from its own `conv [C, K]` state (its last K
// inputs, oldest first). D_CONV (K) is a compile-time constant; sizes are arguments.
//
// A pass is described by its segment tables (src/cuda/packed.rs): `row_seg[r]` the sequence
// of row r, `seg_row0[s]`/`seg_len[s]` its rows, `seg_state[s]` the device address of its
// state; `conv_off` the offset (in floats) of this layer's conv tensor in a state.

// out[r, c] = silu(bias[c] + Σ_j in(t − K + 1 + j)[c] · w[c, j]), where in(p) is the row's
// own input at position p of its sequence, or the state's column K + p for p < 0.
// One thread per (row, channel); `out_act` (optional) gets the same values in the GEMM dtype.
extern "C" __global__ void conv_rows(const float* in, int ld_in, int in_off, int channels,
                                     const int* row_seg, const int* seg_row0,
                                     const unsigned long long* seg_state, long long conv_off,
                                     const float* w, const float* bias, float* out,
                                     act_t* out_act, int rows) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * channels) return;
    const int r = (int)(i / channels), c = (int)(i % channels);
    const int s = row_seg[r], row0 = seg_row0[s], t = r - row0;
    const float* st = reinterpret_cast<const float*>(seg_state[s]) + conv_off + (size_t)c * D_CONV;
    float acc = bias ? bias[c] : 0.f;
#pragma unroll
    for (int j = 0; j < D_CONV; ++j) {
        const int p = t - (D_CONV - 1) + j;
        const float v = p >= 0 ? in[(size_t)(row0 + p) * ld_in + in_off + c] : st[D_CONV + p];
        acc += v * w[c * D_CONV + j];
    }
    const float y = silu_f(acc);
    out[(size_t)r * channels + c] = y;
    if (out_act) out_act[(size_t)r * channels + c] = from_f<act_t>(y);
}

// Each sequence's conv state ← its last K inputs (older state columns shift in when the
// sequence's rows are fewer than K). Runs after `conv_rows`, which reads the old state.
// One thread per (sequence, channel).
extern "C" __global__ void conv_state_update(const float* in, int ld_in, int in_off,
                                             int channels, const int* seg_row0,
                                             const int* seg_len,
                                             const unsigned long long* seg_state,
                                             long long conv_off, int seqs) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)seqs * channels) return;
    const int s = (int)(i / channels), c = (int)(i % channels);
    const int row0 = seg_row0[s], len = seg_len[s];
    float* st = reinterpret_cast<float*>(seg_state[s]) + conv_off + (size_t)c * D_CONV;
    float next[D_CONV];
#pragma unroll
    for (int j = 0; j < D_CONV; ++j) {
        const int p = len - D_CONV + j;
        next[j] = p >= 0 ? in[(size_t)(row0 + p) * ld_in + in_off + c] : st[D_CONV + p];
    }
#pragma unroll
    for (int j = 0; j < D_CONV; ++j) st[j] = next[j];
}
