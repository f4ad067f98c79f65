//! The arithmetic types of the CPU paths: f32 (the engine) and f64 (the oracle and tests).

use crate::model::dtype::Element;
use num_traits::{Float, FloatConst};

pub trait Real:
    Float + FloatConst + Element + std::fmt::Debug + std::iter::Sum + Send + Sync + 'static
{
    fn from_f(x: f64) -> Self;
    /// Widen a storage element (a shift for bf16).
    fn from_elem<W: Element>(w: W) -> Self;
    /// `eˣ` as the fast paths compute it (vectorisable polynomial in f32, exact in f64).
    fn exp_fast(self) -> Self;
    /// `(sin x, cos x)` likewise, for phases in [0, 2π).
    fn sin_cos_fast(self) -> (Self, Self);
}

impl Real for f32 {
    #[inline(always)]
    fn from_f(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn from_elem<W: Element>(w: W) -> Self {
        w.to_f32()
    }
    #[inline(always)]
    fn exp_fast(self) -> Self {
        super::fastmath::exp_f32(self)
    }
    #[inline(always)]
    fn sin_cos_fast(self) -> (Self, Self) {
        super::fastmath::sin_cos_f32(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn from_f(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn from_elem<W: Element>(w: W) -> Self {
        w.to_f64()
    }
    #[inline(always)]
    fn exp_fast(self) -> Self {
        self.exp()
    }
    #[inline(always)]
    fn sin_cos_fast(self) -> (Self, Self) {
        self.sin_cos()
    }
}
