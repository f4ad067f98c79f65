//! Shared CPU machinery: the arithmetic types, the scalar activations, fast `exp` and
//! `sin/cos`, SIMD dot products, the GEMM and weight-streaming matmul, and the small
//! differentiable ops training uses. No mixer lives here: each mixer's CPU paths are in its
//! own folder under `crate::mixers`.

pub mod fastmath;
pub mod math;
pub mod matmul;
pub mod ops;
pub mod real;
pub mod simd;

pub use real::Real;
