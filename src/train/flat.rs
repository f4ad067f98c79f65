//! The trainable tensors as one flat f32 buffer: where each tensor lives, the tensors that
//! take weight decay first (so that the GPU's AdamW is one launch with one boundary). The
//! GPU trainer keeps its parameters, gradients and moments in this layout; data-parallel
//! training reduces gradients in it (`super::buckets`).

use crate::mixers::mamba3::params::{decays, Params};

/// Every tensor starts at a multiple of this many elements (16-byte aligned GEMM operands,
/// also in 16-bit copies); the gaps stay zero.
pub const ALIGN: usize = 8;

/// Where each tensor of [`Params::tensors`] lives in a flat buffer (element offsets).
pub struct FlatLayout {
    /// (offset, length) per tensor, in `Params::tensors` order
    pub spans: Vec<(usize, usize)>,
    pub len: usize,
    /// elements of the weight-decayed tensors (they come first)
    pub n_decay: usize,
}

impl FlatLayout {
    pub fn new(p: &Params<f32>) -> FlatLayout {
        let tensors = p.tensors();
        let mut spans = vec![(0, 0); tensors.len()];
        let mut at = 0;
        for pass in [true, false] {
            for (i, (name, t)) in tensors.iter().enumerate() {
                if decays(name) == pass {
                    spans[i] = (at, t.len());
                    at += t.len().next_multiple_of(ALIGN);
                }
            }
        }
        let n_decay = tensors
            .iter()
            .filter(|(n, _)| decays(n))
            .map(|(_, t)| t.len().next_multiple_of(ALIGN))
            .sum();
        FlatLayout {
            spans,
            len: at,
            n_decay,
        }
    }

    /// Copy the tensors of `p` into the flat host buffer `out` (`len` elements; the gaps
    /// are left as they are).
    pub fn gather(&self, p: &Params<f32>, out: &mut [f32]) {
        for ((_, t), &(off, len)) in p.tensors().iter().zip(&self.spans) {
            out[off..off + len].copy_from_slice(t);
        }
    }

    /// Copy the flat host buffer `flat` back into the tensors of `p`.
    pub fn scatter(&self, flat: &[f32], p: &mut Params<f32>) {
        for (t, &(off, len)) in p.tensors_mut().into_iter().zip(&self.spans) {
            t.copy_from_slice(&flat[off..off + len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Config;

    #[test]
    fn decayed_tensors_come_first_and_nothing_overlaps() {
        let mut cfg = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
        cfg.d_intermediate = 64;
        cfg.ssm_cfg.is_outproj_norm = true;
        cfg.tie_embeddings = false;
        let p = Params::<f32>::zeros(&cfg);
        let f = FlatLayout::new(&p);
        assert!(f.len >= p.numel() && f.len < p.numel() + ALIGN * f.spans.len());
        let mut spans = f.spans.clone();
        spans.sort();
        let mut at = 0;
        for (off, len) in spans {
            assert_eq!(off, at, "tensors in order, aligned, not overlapping");
            assert_eq!(off % ALIGN, 0);
            at += len.next_multiple_of(ALIGN);
        }
        assert_eq!(at, f.len);
        for ((name, t), &(off, len)) in p.tensors().iter().zip(&f.spans) {
            assert_eq!(t.len(), len);
            assert_eq!(decays(name), off < f.n_decay, "{name}");
        }
    }
}
