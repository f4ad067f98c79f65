//! One sequence's recurrent state in one layer (spec §3.1), in the CPU layout.

use super::real::Real;
use crate::model::config::Dims;

/// `angle [H,S]` (wrapped to [0, 2π)), `ssm [H,P,N]`, `k [H,N]` (last key: normed, biased,
/// rotated, unscaled), `v [H,P]` (last x). All zero for a fresh sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerState<F> {
    pub angle: Vec<F>,
    pub ssm: Vec<F>,
    pub k: Vec<F>,
    pub v: Vec<F>,
}

impl<F: Real> LayerState<F> {
    pub fn zeros(d: &Dims) -> Self {
        let (h, p, n, s) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
        LayerState {
            angle: vec![F::zero(); h * s],
            ssm: vec![F::zero(); h * p * n],
            k: vec![F::zero(); h * n],
            v: vec![F::zero(); h * p],
        }
    }
}

/// A whole sequence's state: one `LayerState` per layer.
pub type SeqState<F> = Vec<LayerState<F>>;

pub fn zero_state<F: Real>(d: &Dims) -> SeqState<F> {
    (0..d.n_layer).map(|_| LayerState::zeros(d)).collect()
}
