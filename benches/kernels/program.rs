//! The hardware probes' kernels (`probes*.cu` beside this file): measurements of the GPU, not the
//! model's. Used by `gpu_floors.rs` and compiled by tests/gpu_kernels_compile.rs.

use mamba3::cuda::kernels::Program;

pub const PROBES: Program = Program {
    name: "probe",
    head: "",
    sources: &[
        ("cluster.cuh", include_str!("cluster.cuh")),
        ("probes.cu", include_str!("probes.cu")),
        ("probes_decode.cu", include_str!("probes_decode.cu")),
    ],
    parts: &[0],
};
