//! Where a training step's arithmetic runs. The trainer only sees [`Backend`]: the CPU
//! implementation below runs [`super::model::loss_and_grad`] in f32 and the optimiser on
//! the host; the GPU one (`crate::train::cuda::CudaTrainer`) keeps the parameters, the
//! gradients and AdamW's moments on the device and brings them back in [`Backend::sync`].

use super::model::{loss_and_grad, loss_and_grad_ready, Batch};
use super::optim::{clip_global_norm, scale, AdamW};
use super::ready::GradReady;
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::Params;

pub trait Backend {
    /// A short name for logs ("cpu", "cuda:0").
    fn name(&self) -> String;
    /// Mean loss of `batch` at `params`, adding the gradient of that mean into `grad`.
    fn loss_and_grad(
        &mut self,
        params: &Params<f32>,
        batch: &Batch,
        grad: &mut Params<f32>,
    ) -> Result<f64>;
    /// [`Backend::loss_and_grad`] that tells `ready` after each stage of the backward that
    /// its gradients are final (`super::ready`). The default never calls it: whoever waits
    /// on the hook then does after the backward what it would have done during it.
    fn loss_and_grad_ready(
        &mut self,
        params: &Params<f32>,
        batch: &Batch,
        grad: &mut Params<f32>,
        _ready: &mut dyn GradReady<Params<f32>>,
    ) -> Result<f64> {
        self.loss_and_grad(params, batch, grad)
    }
    /// Mean loss of `batch` (no gradient). A backend that holds the run's parameters
    /// itself (after a [`Backend::step`]) uses those; `params` is the trainer's copy.
    fn loss(&mut self, params: &Params<f32>, batch: &Batch) -> Result<f64>;
    /// One optimiser step over the micro-batches `batches`: their mean loss and mean
    /// gradient, clipped to the global norm `clip` (when positive), then an AdamW update at
    /// learning rate `lr`. Returns (mean loss, gradient norm before clipping). The default
    /// runs on the host through [`Backend::loss_and_grad`].
    fn step(
        &mut self,
        params: &mut Params<f32>,
        opt: &mut AdamW,
        batches: &[Batch],
        clip: f64,
        lr: f64,
    ) -> Result<(f64, f64)> {
        if batches.is_empty() {
            return Err(Error::input("an optimiser step needs at least one batch"));
        }
        let mut grad = Params::zeros(&params.config);
        let mut loss = 0.0;
        for b in batches {
            loss += self.loss_and_grad(params, b, &mut grad)?;
        }
        let accum = batches.len();
        let norm = host_apply(params, opt, &mut grad, accum, clip, lr);
        Ok((loss / accum as f64, norm))
    }
    /// Bring `params` and `opt` up to date with what the backend holds (a no-op for
    /// backends that update them in place).
    fn sync(&mut self, _params: &mut Params<f32>, _opt: &mut AdamW) -> Result<()> {
        Ok(())
    }
    /// Seconds the last step waited, after its backward, for the gradient's reduction over
    /// several devices (the slowest rank's); None for a backend on one device.
    fn reduce_wait(&self) -> Option<f64> {
        None
    }
}

/// The end of a step on the host: the gradient summed over `accum` micro-batches scaled
/// by `1 / accum`, clipped to the global norm `clip` (when positive), then AdamW at `lr`.
/// Returns the norm before clipping. (The data-parallel replicas on the host end their
/// steps here too, which keeps them bit for bit with one device.)
pub fn host_apply(
    params: &mut Params<f32>,
    opt: &mut AdamW,
    grad: &mut Params<f32>,
    accum: usize,
    clip: f64,
    lr: f64,
) -> f64 {
    if accum > 1 {
        scale(grad, (1.0 / accum as f64) as f32);
    }
    let norm = clip_global_norm(grad, clip);
    opt.update(params, grad, lr);
    norm
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
    fn loss_and_grad_ready(
        &mut self,
        params: &Params<f32>,
        batch: &Batch,
        grad: &mut Params<f32>,
        ready: &mut dyn GradReady<Params<f32>>,
    ) -> Result<f64> {
        loss_and_grad_ready(params, batch, Some((grad, ready)))
    }
    fn loss(&mut self, params: &Params<f32>, batch: &Batch) -> Result<f64> {
        loss_and_grad(params, batch, None)
    }
}
