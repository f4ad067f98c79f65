//! The CPU backend: the token-by-token reference (the oracle) and the fast paths —
//! chunked prefill on a real GEMM, threaded with rayon, and the batched decode step.

pub mod fastmath;
pub mod forward;
pub mod math;
pub mod matmul;
pub mod mixer;
pub mod prefill;
pub mod real;
pub mod reference;
pub mod simd;
pub mod state;
pub mod step;

pub use forward::{CpuModel, LogitsWant};
pub use real::Real;
pub use reference::Reference;
pub use state::{zero_state, LayerState, SeqState};
