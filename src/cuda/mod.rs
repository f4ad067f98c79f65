//! The shared GPU runtime (NVIDIA, through `cudarc` with dynamic loading: the binary builds
//! without a CUDA toolkit and runs on the CPU when no driver is present).
//!
//! - `context`: the device, its streams, raw buffers (and the recycled memory of sequence
//!   states), kernel launches;
//! - `kernels`: NVRTC compilation of kernel programs with the model's dimensions as
//!   constants, cached on disk; the shared kernels (`kernels/*.cu`: embedding, row norms,
//!   GEMVs) — each mixer's own kernels live in its folder (`crate::mixers::*::cuda`);
//! - `gemm`: the projections through cuBLASLt; `gemm_tune`: a large one's algorithm chosen
//!   by timing;
//! - `probe`: the debug option's finite-value check after every step.
//!
//! The model pipeline that runs on this runtime (weights on the device, states, work
//! buffers, the prefill and decode launch sequences, CUDA graphs) is the engine's CUDA
//! backend, `crate::engine::cuda`; training's is `crate::train::cuda`.

pub mod context;
pub mod gemm;
pub mod gemm_spec;
pub mod gemm_tune;
pub mod kernels;
pub mod packed;
pub mod probe;

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
