// What a MIMO layer's kernels take (src/mixers/mimo/cuda/mod.rs `MimoScan`, field for field):
// the in_proj rows and where each part of a row starts, the layer's parameters, the
// per-row scratch of a long pass, and where the layer's state tensors start in a
// sequence's state. Shared by the MIMO program and the fused decode (mimo_fused.cuh).

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

