//! The arithmetic types of the CPU paths: f32 (the engine) and f64 (the oracle and tests).

use crate::model::dtype::{DType, Element};
use num_traits::{Float, FloatConst};

pub trait Real:
    Float + FloatConst + Element + std::fmt::Debug + std::iter::Sum + Send + Sync + 'static
{
    fn from_f(x: f64) -> Self;
    /// Round to `dtype` and back: the model's activation rounding (identity for wide types).
    fn round_to(self, dtype: DType) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn from_f(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn round_to(self, dtype: DType) -> Self {
        match dtype {
            DType::BF16 => half::bf16::from_f32(self).to_f32(),
            DType::F16 => half::f16::from_f32(self).to_f32(),
            DType::F32 | DType::F64 => self,
        }
    }
}

impl Real for f64 {
    #[inline(always)]
    fn from_f(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn round_to(self, dtype: DType) -> Self {
        dtype.round(self)
    }
}

/// Round every element of `xs` to `dtype` (no-op for f32/f64 storage).
pub fn round_slice<F: Real>(xs: &mut [F], dtype: DType) {
    if matches!(dtype, DType::BF16 | DType::F16) {
        for x in xs {
            *x = x.round_to(dtype);
        }
    }
}
