//! Mamba-3 MIMO (`ssm_cfg.is_mimo = true`) on the CPU, after `docs/mamba3-mimo-spec.md`
//! (cited as "spec-MIMO §n"; what MIMO shares with SISO is in `mamba3-spec.md`).
//!
//! Per layer and token, with `R = mimo_rank` ranks `r` and head `h` (§2):
//!
//! ```text
//! π = W_in·u  →  z, x [H,P] | B, C [R,G,N] (rank outermost) | dd_dt, dd_A, trap [H] | ang [S]
//! B̄_{r,g} = rms(B_{r,g})·w_B,  k_r = rot(B̄_{r,g(h)} + B_bias[h,r], φ),  q_r likewise with C
//! φ ← wrap(φ + π·tanh(ang)·Δ)            one phase vector per head, shared by all ranks
//! rot: pairs (i, i + N/2) for i < S       (half-split; SISO pairs (2i, 2i+1))
//! u_r = x ⊙ ψ_r                           ψ = mimo_x [H,R,P]
//! h ← α·h + β·Σ_r outer(u⁻_r, k⁻_r) + γ·Σ_r outer(u_r, k_r)      α = e^{AΔ},
//!                                         β = αΔ(1 − λ), γ = λΔ  (§2.6)
//! y_r = h·q_r + D·u_r
//! o = Σ_r ω_r ⊙ G(y_r) ⊙ silu(z ⊙ ζ_r)    ζ = mimo_z, ω = mimo_o; G = identity or the
//!                                         per-rank RMSNorm over P times norm.weight[h] (§2.7)
//! out = W_out·o
//! ```
//!
//! The state per layer is `angle [H,S]`, `ssm [H,P,N]`, `k [R,H,N]` (the last token's
//! rotated keys, rank-major as the official cache) and `v [H,P]` (the last raw x, re-projected
//! by ψ when used) — §3.1. A window continuing a state enters with the folded state
//! `h⁻ + Δ_0(1 − λ_0)·Σ_r outer(v⁻ ⊙ ψ_r, k⁻_r)` (§3.4). The official code's MIMO defects
//! (§9) are not reproduced: any `ngroups` maps head h to group `floor(h/(H/G))`, phases are
//! wrapped, the split is at `N/2`.
//!
//! Entry points: [`MimoWeights::load`] (config + either checkpoint format), the oracle
//! [`MimoReference`] (`new_state`, `step`, `forward` from a fresh or carried state, f32/f64),
//! and the chunked prefill [`mimo_prefill`] (the LM over a window) on
//! [`mimo_mixer_prefill`] (one mixer layer). Training (the mixer's forward with saves and
//! its backward) is in [`train`].
//!
//! The module's float32 casts of the raw angles and `dd_A` (§5) are not emulated: in f64
//! the reference is 2.8e-8 / 2.6e-8 (relative L2) from the float32-stored golden logits of
//! `mimo-tiny` / `mimo-mlp-norm`, as the fixtures' independent float64 check reports for the
//! uncast maths (2.5e-8 with the casts; the storage floor).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod prefill;
pub mod reference;
pub mod train;
pub mod weights;

#[cfg(test)]
mod golden_tests;

pub use prefill::{mimo_forward, mimo_mixer_prefill, mimo_prefill, mimo_prefill_rows};
pub use reference::{
    check_window, layer, layout, mimo_zero_state, MimoLayerState, MimoLayerView, MimoMixerCtx,
    MimoReference, MimoSeqState,
};
pub use weights::{
    mimo_config_from_file, mimo_config_from_json_str, mimo_dims, validate_mimo, MimoDims,
    MimoLayerWeights, MimoWeights,
};
