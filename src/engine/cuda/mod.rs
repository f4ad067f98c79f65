//! The engine's CUDA backend: a model's weights, states and work buffers on one GPU, the
//! launch sequences of a prefill and a decode step, and CUDA graphs of both.
//!
//! - `weights`, `state`, `work`: what lives on the device;
//! - `forward`: the prefill launch sequence (`Pipe`); `decode`: the decode step's;
//! - `kernels`: one model's inference kernels, loaded;
//! - `graphs`: CUDA-graph capture and replay; `captured`: what a captured graph holds;
//! - `model`: `CudaModel`, what the engine's `Model` calls;
//! - `sample`: sampling a decode batch on the device (every GPU backend's).
//!
//! Every kernel has a CPU twin of the same name (`embed` → the embedding loop of
//! `engine::cpu::CpuModel`, `rms_norm_rows` → `cpu::math::rms_norm`, `prefill_pre` →
//! `token_pre`, `scan_*` → `HeadScan::chunk`, `mixer_step` → `mixer_step` (the Mamba-3 ones in
//! `crate::mixers::mamba3`), `gemv` → `cpu::matmul::matmul_t`, `decode_layers*` → the
//! layer loop of `CpuModel`); the mathematics is written once, in those twins' module docs
//! and in the spec.

pub mod backend;
pub mod captured;
pub mod decode;
pub mod family;
pub mod forward;
pub mod graphs;
pub mod kernels;
pub mod model;
pub mod sample;
pub mod state;
pub mod weights;
pub mod work;

pub use model::CudaModel;
pub use state::CudaState;
