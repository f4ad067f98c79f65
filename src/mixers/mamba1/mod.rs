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

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod lm;
pub mod prefill;
pub mod reference;
pub mod step;
pub mod weights;

#[cfg(test)]
pub(crate) mod fast_tests;
#[cfg(test)]
pub(crate) mod golden_tests;
#[cfg(test)]
mod prefill_tests;

use crate::error::{Error, Result};
use crate::model::family_config::Mamba1Config;
use crate::model::state_layout::{StateBuf, StateLayout, StateTensor};

/// The named tensors of one layer's state: `conv [D_i, K]` (the last `K` conv inputs, x
/// before conv, bias and SiLU, oldest first; zeros before the start of the sequence) and
/// `ssm [D_i, N]` (`h`).
pub fn layout(cfg: &Mamba1Config, n_layer: usize) -> StateLayout {
    StateLayout {
        n_layer,
        tensors: vec![
            StateTensor::new("conv", &[cfg.d_inner, cfg.d_conv]),
            StateTensor::new("ssm", &[cfg.d_inner, cfg.d_state]),
        ],
    }
}

/// A sequence's state in every layer (flat, in [`layout`] order).
pub type State<F> = StateBuf<F>;

/// One layer's state (Mamba-1 or Mamba-2), viewed in place.
#[derive(Debug)]
pub struct LayerState<'a, F> {
    pub conv: &'a mut [F],
    pub ssm: &'a mut [F],
}

/// Layer `l` of a Mamba-1 or Mamba-2 state whose layout is `[conv | ssm]`, the conv part
/// `conv_len` values long.
pub fn conv_ssm<F: Copy + num_traits::Zero>(
    st: &mut StateBuf<F>,
    l: usize,
    conv_len: usize,
) -> LayerState<'_, F> {
    let (conv, ssm) = st.layer_mut(l).split_at_mut(conv_len);
    LayerState { conv, ssm }
}

/// Layer `l` of a state, viewed in place.
pub fn layer<'a, F: Copy + num_traits::Zero>(
    st: &'a mut State<F>,
    l: usize,
    cfg: &Mamba1Config,
) -> LayerState<'a, F> {
    conv_ssm(st, l, cfg.d_inner * cfg.d_conv)
}

/// The state before the first token: all zeros.
pub fn zero_state<F: Copy + num_traits::Zero>(cfg: &Mamba1Config, n_layer: usize) -> State<F> {
    StateBuf::zeros(&layout(cfg, n_layer))
}

/// An error unless `st` has the shape of `layout` (the model's).
pub(crate) fn check_state<F: Copy + num_traits::Zero>(
    st: &StateBuf<F>,
    layout: &StateLayout,
) -> Result<()> {
    if st.fits(layout) {
        return Ok(());
    }
    Err(Error::State(format!(
        "a state of {} layers × {} values does not fit this model ({})",
        st.n_layer(),
        st.layer_len,
        layout.describe()
    )))
}
