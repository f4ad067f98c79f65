//! Small differentiable pieces shared by the training forward and backward: RMSNorm with
//! its backward, the SiLU derivative, and GEMM shorthands on row-major slices.

use crate::cpu::math::sigmoid;
use crate::cpu::matmul::{gemm, View, ViewMut};
use crate::cpu::Real;
use crate::model::config::NORM_EPS;

/// `out = x·r ⊙ w` with `r = 1/sqrt(mean(x²) + eps)`; returns `r`.
#[inline]
pub fn rms_fwd<F: Real>(x: &[F], w: &[F], out: &mut [F]) -> F {
    let ms = x.iter().map(|&v| v * v).sum::<F>() / F::from_f(x.len() as f64);
    let r = F::one() / (ms + F::from_f(NORM_EPS)).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
    r
}

/// Backward of [`rms_fwd`]: with `x̂ = x·r`, `dw += dout ⊙ x̂` and
/// `dx (+)= r·(g − x̂·mean(g ⊙ x̂))`, `g = dout ⊙ w`. `accumulate` adds into `dx`.
#[inline]
pub fn rms_bwd<F: Real>(
    x: &[F],
    w: &[F],
    r: F,
    dout: &[F],
    dx: &mut [F],
    dw: &mut [F],
    accumulate: bool,
) {
    let n = F::from_f(x.len() as f64);
    let mut dot = F::zero();
    for i in 0..x.len() {
        let xh = x[i] * r;
        dw[i] = dw[i] + dout[i] * xh;
        dot = dot + dout[i] * w[i] * xh;
    }
    let mean = dot / n;
    for i in 0..x.len() {
        let xh = x[i] * r;
        let g = r * (dout[i] * w[i] - xh * mean);
        dx[i] = if accumulate { dx[i] + g } else { g };
    }
}

/// `d silu(u)/du = σ(u)·(1 + u·(1 − σ(u)))`
#[inline]
pub fn silu_grad<F: Real>(u: F) -> F {
    let s = sigmoid(u);
    s * (F::one() + u * (F::one() - s))
}

/// `out[m, n] = x[m, k] · W[n, k]ᵀ` (a linear layer).
pub fn linear<F: Real>(x: &[F], m: usize, w: &[F], n: usize, k: usize, out: &mut [F], th: usize) {
    gemm(
        ViewMut::new(out, m, n),
        None,
        View::new(x, m, k),
        View::new(w, n, k).t(),
        F::one(),
        th,
    );
}

/// `dW[n, k] += dy[m, n]ᵀ · x[m, k]` (a linear layer's weight gradient).
pub fn linear_dw<F: Real>(
    dy: &[F],
    x: &[F],
    m: usize,
    n: usize,
    k: usize,
    dw: &mut [F],
    th: usize,
) {
    gemm(
        ViewMut::new(dw, n, k),
        Some(F::one()),
        View::new(dy, m, n).t(),
        View::new(x, m, k),
        F::one(),
        th,
    );
}

/// `dx[m, k] (+)= dy[m, n] · W[n, k]` (a linear layer's input gradient).
#[allow(clippy::too_many_arguments)]
pub fn linear_dx<F: Real>(
    dy: &[F],
    w: &[F],
    m: usize,
    n: usize,
    k: usize,
    dx: &mut [F],
    accumulate: bool,
    th: usize,
) {
    gemm(
        ViewMut::new(dx, m, k),
        accumulate.then_some(F::one()),
        View::new(dy, m, n),
        View::new(w, n, k),
        F::one(),
        th,
    );
}
