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

pub mod prefill;
pub mod reference;
pub mod step;

#[cfg(test)]
mod golden_tests;
#[cfg(test)]
mod prefill_tests;

use crate::error::Result;
use crate::mixers::mamba1::check_layers;
use crate::model::family_config::Mamba2Config;

/// One layer's carried state.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerState<F> {
    /// `[C_d, K]`: the last `K` conv inputs (`x‖B‖C` before conv, bias and SiLU), oldest
    /// first; zeros before the start of the sequence
    pub conv: Vec<F>,
    /// `[H, P, N]`
    pub ssm: Vec<F>,
}

/// A sequence's state in every layer, and how many tokens it has seen.
#[derive(Clone, Debug, PartialEq)]
pub struct State<F> {
    pub layers: Vec<LayerState<F>>,
    pub position: u64,
}

impl<F: num_traits::Zero + Clone> State<F> {
    /// The state before the first token: all zeros.
    pub fn zeros(cfg: &Mamba2Config, n_layer: usize) -> State<F> {
        let layer = LayerState {
            conv: vec![F::zero(); cfg.conv_dim() * cfg.d_conv],
            ssm: vec![F::zero(); cfg.nheads * cfg.headdim * cfg.d_state],
        };
        State {
            layers: vec![layer; n_layer],
            position: 0,
        }
    }

    /// An error unless this state has the shapes of a model with `cfg` and `n_layer`.
    pub fn check(&self, cfg: &Mamba2Config, n_layer: usize) -> Result<()> {
        let want = (
            cfg.conv_dim() * cfg.d_conv,
            cfg.nheads * cfg.headdim * cfg.d_state,
        );
        check_layers(
            self.layers.iter().map(|l| (l.conv.len(), l.ssm.len())),
            n_layer,
            want,
        )
    }
}
