//! The Mamba-2 mixer, spec §3.
//!
//! Per token `u` (spec §3.3), with `H` heads of `P` channels (`d_ssm = H·P`), `G` groups
//! of `H/G` contiguous heads, state size `N`, conv width `K`, `C_d = d_ssm + 2·G·N`:
//!
//! ```text
//! [z0 ; x0 ; z ; xBC ; dt] = W_in·u           (z before x — Mamba-1 is the other way)
//! conv ← shift_left(conv), conv[:, K−1] = xBC (only x‖B‖C is convolved)
//! v[c] = silu(Σ_k conv[c,k]·w[c,k] + b[c]),  v = [x (H×P) ; B (G×N) ; C (G×N)]
//! per head h, group g = h / (H/G):
//!   Δ_h  = clamp(softplus(dt[h] + dt_bias[h]), dt_limit)
//!   h[h] ← exp(Δ_h·A_h)·h[h] + Δ_h·x[h] ⊗ B[g],   A_h = −exp(A_log[h])  (one scalar)
//!   y[h] = h[h]·C[g] + D[h]·x[h]
//! o    = grouped_rms(y ⊙ silu(z)) ⊙ w_norm      (gate first; groups of d_ssm/G, §3.4)
//! out  = W_out·[silu(z0) ⊙ x0 ; o]             (the z0/x0 branch only when d_ssm < D_i)
//! ```
//!
//! The decay is one scalar per head and token, which is what allows the chunked matrix
//! (SSD) form of §3.5 for prefill.
//!
//! The carried state (§3.6) is the official cache without its batch axis: per layer
//! `conv [C_d, K]` and `ssm [H, P, N]` — see [`State`].

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod prefill;
pub mod reference;
pub mod step;
pub mod weights;

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod prefill_tests;

use crate::mixers::mamba1::{conv_ssm, LayerState};
use crate::model::family_config::Mamba2Config;
use crate::model::state_layout::{StateBuf, StateLayout, StateTensor};

/// The named tensors of one layer's state: `conv [C_d, K]` (the last `K` conv inputs,
/// `x‖B‖C` before conv, bias and SiLU, oldest first; zeros before the start of the
/// sequence) and `ssm [H, P, N]`.
pub fn layout(cfg: &Mamba2Config, n_layer: usize) -> StateLayout {
    StateLayout {
        n_layer,
        tensors: vec![
            StateTensor::new("conv", &[cfg.conv_dim(), cfg.d_conv]),
            StateTensor::new("ssm", &[cfg.nheads, cfg.headdim, cfg.d_state]),
        ],
    }
}

/// A sequence's state in every layer (flat, in [`layout`] order).
pub type State<F> = StateBuf<F>;

/// The state before the first token: all zeros.
pub fn zero_state<F: Copy + num_traits::Zero>(cfg: &Mamba2Config, n_layer: usize) -> State<F> {
    StateBuf::zeros(&layout(cfg, n_layer))
}

/// Layer `l` of a state, viewed in place.
pub fn layer<'a, F: Copy + num_traits::Zero>(
    st: &'a mut State<F>,
    l: usize,
    cfg: &Mamba2Config,
) -> LayerState<'a, F> {
    conv_ssm(st, l, cfg.conv_dim() * cfg.d_conv)
}
