//! Mixers beyond the Mamba-3 SISO of `cpu`: each in its own module, loading and maths.
pub mod mimo;
