//! AdamW (decoupled weight decay, as `torch.optim.AdamW`), the official parameter groups
//! (no decay on `dt_bias`, `D`, `B_bias`, `C_bias` and every norm weight), gradient
//! clipping by global norm, and a linear warm-up + cosine learning-rate schedule.
//!
//! Every update is elementwise and sequential in a fixed order, so a step is a pure
//! function of (parameters, gradient, moments, step): resuming from saved moments lands
//! bit for bit where the unbroken run would.

use crate::mixers::mamba3::params::{decays, Params};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// Linear warm-up to `peak` over `warmup` steps, then cosine decay to `min` at `total`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub peak: f64,
    pub min: f64,
    pub warmup: u64,
    pub total: u64,
}

impl Schedule {
    /// Learning rate of optimiser step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let t = ((step - self.warmup) as f64 / span).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

/// One step's AdamW coefficients in f32: `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
/// `p ← p·decay − step_size·m / (√v / bc2_sqrt + eps)` (decay only on the decayed group).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCoefficients {
    pub beta1: f32,
    pub beta2: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    pub decay: f32,
}

/// The optimiser's state: first and second moments and the number of steps taken.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    pub m: Params<f32>,
    pub v: Params<f32>,
}

/// Global L2 norm of a gradient (accumulated in f64).
pub fn global_norm(g: &Params<f32>) -> f64 {
    g.tensors()
        .iter()
        .flat_map(|(_, t)| t.iter())
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt()
}

/// Multiply every gradient element by `s`.
pub fn scale(g: &mut Params<f32>, s: f32) {
    for t in g.tensors_mut() {
        t.iter_mut().for_each(|x| *x *= s);
    }
}

/// Clip to `max_norm` (if positive); returns the norm before clipping.
pub fn clip_global_norm(g: &mut Params<f32>, max_norm: f64) -> f64 {
    let n = global_norm(g);
    if max_norm > 0.0 && n > max_norm {
        scale(g, (max_norm / (n + 1e-6)) as f32);
    }
    n
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: &Params<f32>) -> Self {
        AdamW {
            cfg,
            step: 0,
            m: Params::zeros(&params.config),
            v: Params::zeros(&params.config),
        }
    }

    /// Count one more step and return its f32 coefficients at learning rate `lr` (the
    /// CPU update below and the GPU's `adamw` kernel use the same ones).
    pub fn next_step(&mut self, lr: f64) -> StepCoefficients {
        self.step += 1;
        let c = self.cfg;
        let t = self.step as i32;
        StepCoefficients {
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            step_size: (lr / (1.0 - c.beta1.powi(t))) as f32,
            bc2_sqrt: (1.0 - c.beta2.powi(t)).sqrt() as f32,
            eps: c.eps as f32,
            decay: (1.0 - lr * c.weight_decay) as f32,
        }
    }

    /// One update of `p` with gradient `g` at learning rate `lr`.
    pub fn update(&mut self, p: &mut Params<f32>, g: &Params<f32>, lr: f64) {
        let StepCoefficients {
            beta1: b1,
            beta2: b2,
            step_size,
            bc2_sqrt,
            eps,
            decay: wd_decay,
        } = self.next_step(lr);
        let names: Vec<String> = p.tensors().into_iter().map(|(n, _)| n).collect();
        let grads = g.tensors();
        for ((((name, pt), mt), vt), (_, gt)) in names
            .iter()
            .zip(p.tensors_mut())
            .zip(self.m.tensors_mut())
            .zip(self.v.tensors_mut())
            .zip(grads)
        {
            let decay = if decays(name) { wd_decay } else { 1.0 };
            for i in 0..pt.len() {
                let gi = gt[i];
                mt[i] = b1 * mt[i] + (1.0 - b1) * gi;
                vt[i] = b2 * vt[i] + (1.0 - b2) * gi * gi;
                let denom = vt[i].sqrt() / bc2_sqrt + eps;
                pt[i] = pt[i] * decay - step_size * mt[i] / denom;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays() {
        let s = Schedule {
            peak: 1e-3,
            min: 1e-4,
            warmup: 10,
            total: 110,
        };
        assert!((s.lr(0) - 1e-4).abs() < 1e-12);
        assert!((s.lr(9) - 1e-3).abs() < 1e-12);
        assert!((s.lr(10) - 1e-3).abs() < 1e-12);
        assert!((s.lr(60) - 5.5e-4).abs() < 1e-12);
        assert!((s.lr(110) - 1e-4).abs() < 1e-12);
        assert!((s.lr(500) - 1e-4).abs() < 1e-12);
    }
}
