//! The shape of one sequence's recurrent state, whatever the mixer: per layer, a list of
//! named f32 tensors (Mamba-3: `angle`, `ssm`, `k`, `v`; Mamba-1/2: `conv`, `ssm`), and a
//! flat buffer holding them layer after layer in that order.
//!
//! The mixer says what its layout is (`crate::mixers::state_layout`); everything that moves
//! states around without computing with them — snapshots, state files, the prefix cache,
//! uploads to a device — works on the flat buffer and the names, so it needs no change when
//! a mixer is added.

use crate::error::{Error, Result};

/// One named tensor of a layer's state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StateTensor {
    pub name: &'static str,
    pub shape: Vec<usize>,
}

impl StateTensor {
    pub fn new(name: &'static str, shape: &[usize]) -> StateTensor {
        StateTensor {
            name,
            shape: shape.to_vec(),
        }
    }
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Every layer's state tensors, in the order they are stored.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StateLayout {
    pub n_layer: usize,
    /// The tensors of one layer (every layer has the same).
    pub tensors: Vec<StateTensor>,
}

impl StateLayout {
    /// f32 elements of one layer.
    pub fn layer_len(&self) -> usize {
        self.tensors.iter().map(StateTensor::len).sum()
    }
    /// f32 elements of a whole sequence's state.
    pub fn len(&self) -> usize {
        self.n_layer * self.layer_len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Offset of tensor `i` inside a layer.
    pub fn offset_in_layer(&self, i: usize) -> usize {
        self.tensors[..i].iter().map(StateTensor::len).sum()
    }
    /// The name a state file gives tensor `i` of layer `l`: `state.{l}.{name}`.
    pub fn file_name(&self, l: usize, i: usize) -> String {
        format!("state.{l}.{}", self.tensors[i].name)
    }
    /// `"2 layers of angle [8, 4], ssm [8, 16, 32], …"`, for messages and file metadata.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .tensors
            .iter()
            .map(|t| format!("{} {:?}", t.name, t.shape))
            .collect();
        format!("{} layers of {}", self.n_layer, parts.join(", "))
    }
}

/// A sequence's state: every layer's tensors, flat, in layout order. `F` is f32 in the
/// engine and f64 in the references' tests.
#[derive(Clone, Debug, PartialEq)]
pub struct StateBuf<F> {
    pub layer_len: usize,
    pub data: Vec<F>,
}

impl<F: Copy + num_traits::Zero> StateBuf<F> {
    /// All zeros: a fresh sequence.
    pub fn zeros(layout: &StateLayout) -> StateBuf<F> {
        StateBuf {
            layer_len: layout.layer_len(),
            data: vec![F::zero(); layout.len()],
        }
    }
    /// Wrap flat values, checking their count against the layout.
    pub fn from_flat(layout: &StateLayout, data: Vec<F>) -> Result<StateBuf<F>> {
        if data.len() != layout.len() {
            return Err(Error::State(format!(
                "a state of {} values does not fit this model's layout ({}: {} values)",
                data.len(),
                layout.describe(),
                layout.len()
            )));
        }
        Ok(StateBuf {
            layer_len: layout.layer_len(),
            data,
        })
    }
    pub fn n_layer(&self) -> usize {
        self.data.len().checked_div(self.layer_len).unwrap_or(0)
    }
    /// Layer `l`'s values.
    pub fn layer(&self, l: usize) -> &[F] {
        &self.data[l * self.layer_len..(l + 1) * self.layer_len]
    }
    pub fn layer_mut(&mut self, l: usize) -> &mut [F] {
        &mut self.data[l * self.layer_len..(l + 1) * self.layer_len]
    }
    /// Every layer's values, in order.
    pub fn layers_mut(&mut self) -> std::slice::ChunksExactMut<'_, F> {
        self.data.chunks_exact_mut(self.layer_len.max(1))
    }
    /// Whether it has the layout's size.
    pub fn fits(&self, layout: &StateLayout) -> bool {
        self.layer_len == layout.layer_len() && self.data.len() == layout.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_and_names_follow_the_layout() {
        let l = StateLayout {
            n_layer: 2,
            tensors: vec![
                StateTensor::new("conv", &[3, 4]),
                StateTensor::new("ssm", &[3, 5]),
            ],
        };
        assert_eq!((l.layer_len(), l.len(), l.offset_in_layer(1)), (27, 54, 12));
        assert_eq!(l.file_name(1, 0), "state.1.conv");
        let mut s = StateBuf::<f32>::zeros(&l);
        s.layer_mut(1)[0] = 2.0;
        assert_eq!(s.data[27], 2.0);
        assert_eq!(s.n_layer(), 2);
        assert!(StateBuf::from_flat(&l, vec![0f32; 53]).is_err());
    }
}
