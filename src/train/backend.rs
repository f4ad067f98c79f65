//! Where a training step's arithmetic runs. The trainer only sees [`Backend`]: the CPU
//! implementation below runs [`super::model::loss_and_grad`] in f32; a GPU backend
//! (device-resident weights, its own kernels, bf16 mixed precision with f32 master
//! weights) implements the same two calls.

use super::model::{loss_and_grad, Batch};
use super::params::Params;
use crate::error::Result;

pub trait Backend {
    /// A short name for logs ("cpu", "cuda:0").
    fn name(&self) -> String;
    /// Mean loss of `batch`, adding the gradient of that mean into `grad`.
    fn loss_and_grad(
        &mut self,
        params: &Params<f32>,
        batch: &Batch,
        grad: &mut Params<f32>,
    ) -> Result<f64>;
    /// Mean loss of `batch` (no gradient).
    fn loss(&mut self, params: &Params<f32>, batch: &Batch) -> Result<f64>;
}

/// The CPU backend: f32 arithmetic on rayon's pool.
#[derive(Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn loss_and_grad(
        &mut self,
        params: &Params<f32>,
        batch: &Batch,
        grad: &mut Params<f32>,
    ) -> Result<f64> {
        loss_and_grad(params, batch, Some(grad))
    }
    fn loss(&mut self, params: &Params<f32>, batch: &Batch) -> Result<f64> {
        loss_and_grad(params, batch, None)
    }
}
