//! Shared CPU machinery: the arithmetic types, the scalar activations, fast `exp` and
//! `sin/cos`, SIMD dot products, the GEMM and weight-streaming matmul, the thread team of small decode
//! steps, and the small
//! differentiable ops training uses. No mixer lives here: each mixer's CPU paths are in its
//! own folder under `crate::mixers`.

pub mod fastmath;
pub mod gemm_bf16;
pub mod math;
pub mod matmul;
pub mod ops;
pub mod real;
pub mod simd;
pub mod team;

pub use real::Real;
