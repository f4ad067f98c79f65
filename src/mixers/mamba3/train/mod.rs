//! The Mamba-3 SISO mixer for training: [`forward`] keeps what the backward needs (its
//! module doc has the derivation), [`backward`] is its exact backward.

pub mod backward;
pub mod forward;
