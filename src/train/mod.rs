//! Training: the Mamba-3 language model's backward on the CPU, AdamW, checkpoints with the
//! optimiser state, and the `mamba3 train` loop.
//!
//! The trainable tensors (`crate::mixers::mamba3::params`, SISO or MIMO) and the mixer's
//! training forward and exact backward live with the mixer: `crate::mixers::mamba3::train`
//! (SISO, chunked) and `crate::mixers::mimo::train` (MIMO, CPU only).
//! - [`model`]: the LM forward that keeps activations, the cross-entropy loss and the
//!   backward through every layer.
//! - [`backend`]: the [`backend::Backend`] trait the trainer calls; the CPU implements it,
//!   and [`cuda`] (`CudaTrainer`) on a GPU.
//! - [`optim`]: AdamW with the official no-decay groups, global-norm clipping, warm-up +
//!   cosine schedule.
//! - [`tokenizer`]: the run's tokenizer — bytes, a byte-level BPE trained on the text with
//!   the `tokenizers` crate, or a given tokenizer.json — and its tokenizer.json.
//! - [`data`]: the train/validation split of the text's bytes, its tokens, deterministic
//!   batches.
//! - [`trainer`]: the loop, gradient accumulation, checkpoints and bit-exact resume.
//! - [`parallel`]: data-parallel training, one worker thread and replica per device
//!   ([`parallel::DataParallel`], a [`backend::Backend`]); [`collective`]: the all-reduce
//!   its ranks sum gradients with (the host stand-in here, NCCL in `cuda::nccl`);
//!   [`buckets`]: the reduction's buckets; [`flat`]: the flat layout of the tensors;
//!   [`ready`]: the hook through which a backward says which gradients are final, so that
//!   their buckets' all-reduces start while it goes on.
//! - [`plot`]: the loss-curve PNG.

pub mod backend;
pub mod buckets;
pub mod collective;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod flat;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod plot;
pub mod ready;
pub mod tokenizer;
pub mod trainer;

pub use crate::mixers::mamba3::params::Params;
pub use backend::{Backend, CpuBackend};
pub use model::{loss_and_grad, Batch};
