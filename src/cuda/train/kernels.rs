//! The training program's kernels (`kernels::TRAIN_SOURCES`), compiled by NVRTC for one
//! model shape and numeric mode, cached on disk like the inference kernels.

use crate::cuda::context::{Gpu, Kernel};
use crate::cuda::kernels::{KernelConfig, Module, Program};
use crate::cuda::scan::ScanKernels;
use crate::error::{Error, Result};

pub struct TrainKernels {
    // the forward (shared with inference)
    pub embed: Kernel,
    pub rms_norm_rows: Kernel,
    pub swiglu_rows: Option<Kernel>,
    pub prefill_pre: Kernel,
    pub angle_pass: Kernel,
    pub scan_states: Kernel,
    pub scan_pass: Kernel,
    pub scan_outputs: Kernel,
    // the loss, the backward and the optimiser
    pub cross_entropy_rows: Kernel,
    pub rms_norm_bwd_rows: Kernel,
    pub gate_bwd_rows: Kernel,
    pub swiglu_bwd_rows: Option<Kernel>,
    pub cast_rows: Kernel,
    pub embed_bwd: Kernel,
    pub col_sum_part: Kernel,
    pub col_sum_final: Kernel,
    pub scan_bwd: Kernel,
    pub phase_grad_pass: Kernel,
    pub mixer_pre_bwd: Kernel,
    pub sumsq_part: Kernel,
    pub sumsq_final: Kernel,
    pub adamw: Kernel,
    /// Dynamic shared memory of the forward scan, of prefill_pre and of the scan backward.
    pub scan_smem: u32,
    pub pre_smem: u32,
    pub bwd_smem: u32,
}

impl TrainKernels {
    /// The chunked mixer's kernels (src/cuda/scan.rs), on a GPU that runs `slots` scan
    /// blocks at once (training launches 256 threads per block: `load` checks it).
    pub(crate) fn scan(&self, slots: usize) -> ScanKernels<'_> {
        ScanKernels {
            prefill_pre: &self.prefill_pre,
            angle_pass: &self.angle_pass,
            scan_states: &self.scan_states,
            scan_pass: &self.scan_pass,
            scan_outputs: &self.scan_outputs,
            pre_smem: self.pre_smem,
            scan_smem: self.scan_smem,
            scan_threads: 256,
            scan_slots: slots,
        }
    }

    pub fn load(gpu: &Gpu, cfg: &KernelConfig) -> Result<TrainKernels> {
        let (module, _) = Module::load(gpu, Program::Training, cfg)?;
        let get = |name| module.kernel(name);
        let global = |name: &str| module.global(name);
        let mlp = cfg
            .defines
            .iter()
            .any(|(k, v)| k == "MLP_HIDDEN" && v != "0");
        let k = TrainKernels {
            embed: get("embed")?,
            rms_norm_rows: get("rms_norm_rows")?,
            swiglu_rows: mlp.then(|| get("swiglu_rows")).transpose()?,
            prefill_pre: get("prefill_pre")?,
            angle_pass: get("angle_pass")?,
            scan_states: get("scan_states")?,
            scan_pass: get("scan_pass")?,
            scan_outputs: get("scan_outputs")?,
            cross_entropy_rows: get("cross_entropy_rows")?,
            rms_norm_bwd_rows: get("rms_norm_bwd_rows")?,
            gate_bwd_rows: get("gate_bwd_rows")?,
            swiglu_bwd_rows: mlp.then(|| get("swiglu_bwd_rows")).transpose()?,
            cast_rows: get("cast_rows")?,
            embed_bwd: get("embed_bwd")?,
            col_sum_part: get("col_sum_part")?,
            col_sum_final: get("col_sum_final")?,
            scan_bwd: get("scan_bwd")?,
            phase_grad_pass: get("phase_grad_pass")?,
            mixer_pre_bwd: get("mixer_pre_bwd")?,
            sumsq_part: get("sumsq_part")?,
            sumsq_final: get("sumsq_final")?,
            adamw: get("adamw")?,
            scan_smem: global("scan_smem_bytes")?,
            pre_smem: global("prefill_pre_smem_bytes")?,
            bwd_smem: global("scan_bwd_smem_bytes")?,
        };
        // the training launches (and scan_bwd) take the scan's default block of 256 threads
        let threads = global("scan_threads")?;
        if threads != 256 {
            return Err(Error::Device(format!(
                "training needs scan blocks of 256 threads; this build has {threads} \
                 (SCAN_THREADS in MAMBA3_GPU_DEFINES is for inference only)"
            )));
        }
        for (kern, bytes) in [
            (&k.scan_states, k.scan_smem),
            (&k.scan_outputs, k.scan_smem),
            (&k.prefill_pre, k.pre_smem),
            (&k.scan_bwd, k.bwd_smem),
        ] {
            if bytes as usize > gpu.max_smem {
                return Err(Error::Device(format!(
                    "training this shape needs {bytes} bytes of shared memory per block in \
                     `{}`; {} allows {} (a smaller chunk_size, d_state or headdim fits)",
                    kern.name, gpu.name, gpu.max_smem
                )));
            }
            kern.allow_smem(bytes as usize)?;
        }
        Ok(k)
    }
}
