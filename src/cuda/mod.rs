//! The GPU backend (NVIDIA, through `cudarc` with dynamic loading: the binary builds
//! without a CUDA toolkit and runs on the CPU when no driver is present).
//!
//! - `context`: the device, its stream, raw buffers, kernel launches;
//! - `kernels`: the CUDA C sources (`kernels/*.cu`), compiled by NVRTC per model shape and
//!   cached on disk;
//! - `gemm`: the projections through cuBLASLt; `gemm_tune`: a large one's algorithm chosen
//!   by timing;
//! - `weights`, `state`, `work`: what lives on the device;
//! - `forward`: the prefill launch sequence; `decode`: the decode step's; `scan`: the
//!   chunked mixer's launches, which the prefill and training share;
//! - `graphs`: CUDA-graph capture and replay;
//! - `model`: `CudaModel`, what the engine's `Model` calls;
//! - `probe`: `MAMBA3_GPU_DEBUG=1`, a finite-value check after every step
//!   (`MAMBA3_TIMELINE=2`, `crate::timeline`, times every step instead);
//! - `train`: training on the GPU (`CudaTrainer`, a `train::Backend`).
//!
//! Every kernel has a CPU twin of the same name in `crate::cpu` (`embed` → the embedding
//! loop of `CpuModel::forward`, `rms_norm_rows` → `rms_norm`, `prefill_pre` → `token_pre`,
//! `scan_*` → `scan_head`, `mixer_step` → `mixer_step`, `gemv` → `matmul_t`,
//! `decode_layers*` → the layer loop of `CpuModel::forward`); the mathematics is written
//! once, in those twins' module docs and in the spec.

pub mod context;
pub mod decode;
pub mod forward;
pub mod gemm;
pub mod gemm_tune;
pub mod graphs;
pub mod kernels;
pub mod model;
pub mod probe;
pub mod scan;
pub mod state;
pub mod train;
pub mod weights;
pub mod work;

pub use model::CudaModel;
pub use state::CudaState;

/// How many CUDA devices are visible; 0 when no driver can be loaded (never panics).
pub fn device_count() -> usize {
    std::panic::catch_unwind(|| {
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    })
    .unwrap_or(0)
}
