//! Scalar activations and the RMSNorm, in the spec's definitions (§2.2, §2.3, §2.7).

use super::real::Real;
use crate::model::config::AActivation;

/// `softplus(u) = ln(1 + eᵘ)`, returning `u` above 20 as PyTorch does.
#[inline]
pub fn softplus<F: Real>(u: F) -> F {
    if u > F::from_f(20.0) {
        u
    } else {
        u.exp().ln_1p()
    }
}

/// Heavy-tail activation: `1 + u` for `u ≥ 0`, `1/(1 − u)` below (spec §2.2).
#[inline]
pub fn heavy_tail<F: Real>(u: F) -> F {
    if u >= F::zero() {
        F::one() + u
    } else {
        F::one() / (F::one() - u)
    }
}

/// `A = min(−f(dd_A), −A_floor)`.
#[inline]
pub fn a_value<F: Real>(dd_a: F, a_floor: F, act: AActivation) -> F {
    let f = match act {
        AActivation::HeavyTail => heavy_tail(dd_a),
        AActivation::Softplus => softplus(dd_a),
    };
    (-f).min(-a_floor)
}

#[inline]
pub fn sigmoid<F: Real>(u: F) -> F {
    F::one() / (F::one() + (-u).exp())
}

/// `u·σ(u)`, on the vectorisable `exp_fast` (in f32 within a few ulp of the library's
/// `exp`; glibc's scalar call was 4 % of a Mamba-2 prefill, its gates and conv).
#[inline]
pub fn silu<F: Real>(u: F) -> F {
    u / (F::one() + (-u).exp_fast())
}

/// `wrap(φ) = φ − 2π·floor(φ/2π)`, into [0, 2π).
#[inline]
pub fn wrap_angle<F: Real>(phi: F) -> F {
    let two_pi = F::PI() + F::PI();
    let w = phi - two_pi * (phi / two_pi).floor();
    // floor can leave exactly 2π after rounding; fold it to 0.
    if w >= two_pi {
        w - two_pi
    } else {
        w
    }
}

/// `out = x / sqrt(mean(x²) + eps) ⊙ w`.
#[inline]
pub fn rms_norm<F: Real>(x: &[F], w: &[f32], eps: F, out: &mut [F]) {
    let ms = x.iter().map(|&v| v * v).sum::<F>() / F::from_f(x.len() as f64);
    let r = F::one() / (ms + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * F::from_f(g as f64);
    }
}

/// Rotate consecutive pairs `(2i, 2i+1)` by `φ_i` for `i < S`; the rest pass (spec §2.4).
#[inline]
pub fn rotate_pairs<F: Real>(v: &mut [F], cos: &[F], sin: &[F]) {
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        v[2 * i] = a * c - b * s;
        v[2 * i + 1] = a * s + b * c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_match_their_definitions() {
        assert_eq!(softplus(30.0f64), 30.0);
        assert!((softplus(0.0f64) - 2f64.ln()).abs() < 1e-15);
        assert_eq!(heavy_tail(2.0f64), 3.0);
        assert_eq!(heavy_tail(-1.0f64), 0.5);
        assert_eq!(a_value(-1e9f64, 1e-4, AActivation::HeavyTail), -1e-4);
        assert!((wrap_angle(-0.5f64) - (2.0 * std::f64::consts::PI - 0.5)).abs() < 1e-12);
        assert!((wrap_angle(7.0f64) - (7.0 - 2.0 * std::f64::consts::PI)).abs() < 1e-12);
        let w = wrap_angle(-1e-20f32);
        assert!((0.0..2.0 * std::f32::consts::PI).contains(&w));
    }
}
