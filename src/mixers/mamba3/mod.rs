//! Mamba-3 SISO (`ssm_cfg.layer = "Mamba3"`, `is_mimo = false`). The spec is
//! `docs/spec/mamba3-spec.md`; section numbers below (§) are its.
//!
//! # The maths (spec §2, one token `t`, head `h`, in the spec's notation)
//!
//! `π_t = W_in·u_t` is split into `z, x` (`[H, P]`), `B, C` (`[G, N]`), `dd_dt, dd_A, trap`
//! (`[H]`) and `ang` (`[S]`, shared by the heads) (§2.1). Per head (§2.2):
//!
//! ```text
//! Δ = softplus(dd_dt + dt_bias)     A = min(−f(dd_A), −A_floor)     a = A·Δ
//! λ = σ(trap)                       θ_i = π·tanh(ang_i)
//! ```
//!
//! with `f` the heavy-tail activation (or softplus for older checkpoints, §10.1). B and C
//! are RMS-normed per group and biased per head: `k = B̄_{g(h)} + B_bias_h`,
//! `q = C̄_{g(h)} + C_bias_h` (§2.3). The phases accumulate and wrap,
//! `φ_t = wrap(φ_{t−1} + θ_t·Δ_t)`, and rotate `k, q` pairwise: `k̃ = R(φ)·k`,
//! `q̃ = R(φ)·q` (§2.4). The exponential-trapezoid recurrence (§2.5), with
//! `α = e^{a}`, `β = α·Δ·(1 − λ)`, `γ = λ·Δ`:
//!
//! ```text
//! h_t = α·h_{t−1} + β·outer(x_{t−1}, k̃_{t−1}) + γ·outer(x_t, k̃_t)      h: [P, N]
//! y_t = h_t·q̃_t + D·x_t
//! o_t = y_t ⊙ silu(z_t)        (or rms(y_t)·w ⊙ silu(z_t) per head with the output norm, §2.6)
//! ```
//!
//! and `out_proj` maps `o` back to `d_model`. The state a sequence carries per layer
//! (§3.1) is `angle [H,S]`, `ssm [H,P,N]`, `k [H,N]` (the last `k̃`) and `v [H,P]` (the
//! last `x`): [`state`].
//!
//! The chunked form (§4) computes the same function with matrix products: inside a chunk
//! of `L` tokens the intra-chunk sum is `(W ∘ Q̃K̃ᵀ)·X` with decay-and-trapezoid weights
//! `W`, the inter-chunk term `diag(e^{lc})·Q̃·Sᵀ`, and the state update
//! `S' = e^{lc_end}·S + (wX)ᵀK̃` ([`chunk`]'s module doc has the weights). A window that
//! continues a carried state starts from the folded state
//! `S_enter = h⁻ + Δ_0(1 − λ_0)·outer(v⁻, k⁻)` (§3.4, the boundary fold).
//!
//! # Files
//!
//! - [`reference`]: the token-by-token language model, generic over f32/f64: the oracle.
//! - [`token`]: per-token preprocessing of an `in_proj` row and the output gate, shared by
//!   the chunked prefill and the decode step.
//! - [`chunk`]: one chunk of the chunked scan, shared by the prefill and the training forward.
//! - [`chunk`]: one chunk of one head, the routine the prefill and the training forward
//!   share (its module doc has the chunk's weights).
//! - [`prefill`]: the chunked prefill of a packed batch (threads over sequence × head).
//! - [`step`]: the batched decode step.
//! - [`state`]: the state's layout and per-layer views.
//! - [`weights`]: the checkpoint's tensors, checked and typed ([`Weights`]).
//! - [`params`]: trainable parameters by official name; [`train`]: the chunked training
//!   forward that keeps activations, and its exact backward.
//! - [`cuda`] (feature `cuda`): the chunked mixer's launches and every Mamba-3 kernel.
//! - Tests: `tests/reference_golden.rs`, `tests/golden.rs`, `tests/properties.rs`,
//!   `tests/train_grad.rs` (CPU); `tests/gpu_*.rs` (GPU).

pub mod chunk;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod params;
pub mod prefill;
pub mod reference;
pub mod state;
pub mod step;
pub mod token;
pub mod train;
pub mod weights;

pub use reference::Reference;
pub use weights::{LayerWeights, Weights};
