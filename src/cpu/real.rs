//! The arithmetic types of the CPU paths: f32 (the engine) and f64 (the oracle and tests).

use crate::model::dtype::Element;
use num_traits::{Float, FloatConst};

pub trait Real:
    Float + FloatConst + Element + std::fmt::Debug + std::iter::Sum + Send + Sync + 'static
{
    fn from_f(x: f64) -> Self;
    /// Widen a storage element (a shift for bf16).
    fn from_elem<W: Element>(w: W) -> Self;
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
}
