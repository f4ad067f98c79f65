//! Mixers of the Mamba-1 and Mamba-2 families (spec `mamba1-mamba2-spec.md`).
pub mod mamba1;
pub mod mamba2;
