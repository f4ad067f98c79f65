//! The Mamba-1 mixer (and FalconMamba's variant of it), spec §2.
//!
//! Per token `u` (spec §2.3), with `D_i` channels, state size `N`, conv width `K`, Δ rank
//! `R`:
//!
//! ```text
//! [x ; z]     = W_in·u                        (x first, then z: §2.2)
//! conv        ← shift_left(conv), conv[:, K−1] = x       (pre-conv inputs, oldest first)
//! xc[c]       = silu(Σ_k conv[c,k]·w[c,k] + b[c])
//! [δ ; B ; C] = W_x·xc                        (R, N, N rows; FalconMamba RMS-normalises
//!                                              each without weight, §2.5)
//! Δ[c]        = softplus((W_dt·δ)[c] + b_dt[c])
//! h[c,n]      ← exp(Δ[c]·A[c,n])·h[c,n] + Δ[c]·B[n]·xc[c],   A = −exp(A_log)
//! y[c]        = Σ_n h[c,n]·C[n] + D[c]·xc[c]
//! out         = W_out·(y ⊙ silu(z))
//! ```
//!
//! B and C are shared by all channels; each `(c, n)` is an independent scalar recurrence
//! with its own decay, so the fast prefill blocks over time and vectorises over channels
//! rather than using Mamba-2's matrix form (§2.3, "Fast prefill").
//!
//! The carried state (§2.4) is the official cache without its batch axis: per layer
//! `conv [D_i, K]` and `ssm [D_i, N]` — see [`State`].

pub mod lm;
pub mod prefill;
pub mod reference;
pub mod step;

#[cfg(test)]
pub(crate) mod golden_tests;
#[cfg(test)]
mod prefill_tests;
#[cfg(test)]
pub(crate) mod test_models;

use crate::error::{Error, Result};
use crate::model::family_config::Mamba1Config;

/// One layer's carried state.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerState<F> {
    /// `[D_i, K]`: the last `K` conv inputs (x before conv, bias and SiLU), oldest first;
    /// zeros before the start of the sequence
    pub conv: Vec<F>,
    /// `[D_i, N]`: `h`
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
    pub fn zeros(cfg: &Mamba1Config, n_layer: usize) -> State<F> {
        let layer = LayerState {
            conv: vec![F::zero(); cfg.d_inner * cfg.d_conv],
            ssm: vec![F::zero(); cfg.d_inner * cfg.d_state],
        };
        State {
            layers: vec![layer; n_layer],
            position: 0,
        }
    }

    /// An error unless this state has the shapes of a model with `cfg` and `n_layer`.
    pub fn check(&self, cfg: &Mamba1Config, n_layer: usize) -> Result<()> {
        let (conv, ssm) = (cfg.d_inner * cfg.d_conv, cfg.d_inner * cfg.d_state);
        check_layers(
            self.layers.iter().map(|l| (l.conv.len(), l.ssm.len())),
            n_layer,
            (conv, ssm),
        )
    }
}

/// Shared by both families: `layers` must be `n_layer` pairs of `(conv, ssm)` lengths.
pub(crate) fn check_layers(
    layers: impl ExactSizeIterator<Item = (usize, usize)>,
    n_layer: usize,
    want: (usize, usize),
) -> Result<()> {
    if layers.len() != n_layer {
        return Err(Error::State(format!(
            "the state has {} layers, the model {n_layer}",
            layers.len()
        )));
    }
    for (l, found) in layers.enumerate() {
        if found != want {
            return Err(Error::State(format!(
                "layer {l}: expected (conv, ssm) of {want:?} elements, found {found:?}"
            )));
        }
    }
    Ok(())
}
