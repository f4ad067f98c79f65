//! Mamba-3 SISO on the GPU: the chunked mixer's launches ([`scan`]) and its kernels
//! (`kernels/*.cu`: `prefill_pre`, the scan's three phases, the decode step `mixer_step`,
//! the fused decode of every layer `decode_layers`, and the scan's backward).

pub mod program;
pub mod scan;
