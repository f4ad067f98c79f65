//! The device-agnostic engine: a [`Model`] resident on one device, the [`State`] of each
//! sequence, prefill (stateless or continued windows, batches of different lengths) and
//! batched decode.

pub mod backend;
pub mod cpu;
pub mod cpu_family;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod drift;
pub mod logits;
pub mod logprobs;
pub mod model;
pub mod sample_step;
pub mod sampling;
pub mod state;

pub use device::{Device, DeviceChoice};
pub use logits::LogitsWant;
pub use logits::{Logits, StepLogits};
pub use logprobs::{row_logprobs, TokenLogprobs};
pub use model::{GpuOptions, Model};
pub use sample_step::SampleStep;
pub use sampling::{Sampler, SamplingParams};
pub use state::State;

/// Number of CUDA devices visible (0 without the `cuda` feature or without a driver).
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}
