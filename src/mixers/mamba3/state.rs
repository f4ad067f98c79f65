//! One sequence's Mamba-3 state in one layer (spec §3.1): `angle [H,S]` (wrapped to
//! [0, 2π)), `ssm [H,P,N]`, `k [H,N]` (the last key: normed, biased, rotated, unscaled) and
//! `v [H,P]` (the last x). All zero for a fresh sequence.
//!
//! A whole sequence's state is a [`StateBuf`]: the four tensors of every layer, flat, in
//! that order (the device keeps the same bytes: `ST_*` in cuda/kernels/common.cuh). The
//! mixer's code works on [`LayerState`], a view of one layer's four slices.

use crate::model::config::Dims;
use crate::model::state_layout::{StateBuf, StateLayout, StateTensor};

/// The named tensors of one layer.
pub fn layout(d: &Dims) -> StateLayout {
    let (h, p, n, s) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
    StateLayout {
        n_layer: d.n_layer,
        tensors: vec![
            StateTensor::new("angle", &[h, s]),
            StateTensor::new("ssm", &[h, p, n]),
            StateTensor::new("k", &[h, n]),
            StateTensor::new("v", &[h, p]),
        ],
    }
}

/// A whole sequence's state.
pub type SeqState<F> = StateBuf<F>;

/// A fresh (zero) state for a model of these dims.
pub fn zero_state<F: Copy + num_traits::Zero>(d: &Dims) -> SeqState<F> {
    StateBuf::zeros(&layout(d))
}

/// One layer's state, viewed in place.
#[derive(Debug)]
pub struct LayerState<'a, F> {
    pub angle: &'a mut [F],
    pub ssm: &'a mut [F],
    pub k: &'a mut [F],
    pub v: &'a mut [F],
}

impl<'a, F> LayerState<'a, F> {
    /// View one layer's flat values (`[angle | ssm | k | v]`).
    pub fn of(flat: &'a mut [F], d: &Dims) -> LayerState<'a, F> {
        let (h, p, n, s) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
        let (angle, rest) = flat.split_at_mut(h * s);
        let (ssm, rest) = rest.split_at_mut(h * p * n);
        let (k, v) = rest.split_at_mut(h * n);
        assert_eq!(v.len(), h * p, "a Mamba-3 layer state of the wrong size");
        LayerState { angle, ssm, k, v }
    }
}

/// Layer `l` of a sequence's state.
pub fn layer<'a, F: Copy + num_traits::Zero>(
    st: &'a mut SeqState<F>,
    l: usize,
    d: &Dims,
) -> LayerState<'a, F> {
    LayerState::of(st.layer_mut(l), d)
}

/// Read-only views of a layer's four tensors, for tests and comparisons.
pub fn parts<'a, F>(flat: &'a [F], d: &Dims) -> [&'a [F]; 4] {
    let (h, p, n, s) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
    let (angle, rest) = flat.split_at(h * s);
    let (ssm, rest) = rest.split_at(h * p * n);
    let (k, v) = rest.split_at(h * n);
    [angle, ssm, k, v]
}

/// One layer's state, read-only.
#[derive(Clone, Copy, Debug)]
pub struct LayerRef<'a, F> {
    pub angle: &'a [F],
    pub ssm: &'a [F],
    pub k: &'a [F],
    pub v: &'a [F],
}

/// Every layer of a sequence's state, read-only (for comparisons and tests).
pub fn layers<'a, F: Copy + num_traits::Zero>(
    st: &'a SeqState<F>,
    d: &Dims,
) -> Vec<LayerRef<'a, F>> {
    (0..st.n_layer())
        .map(|l| {
            let [angle, ssm, k, v] = parts(st.layer(l), d);
            LayerRef { angle, ssm, k, v }
        })
        .collect()
}
