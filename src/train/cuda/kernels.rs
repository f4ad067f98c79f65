//! The training program's kernels (`kernels::TRAIN_SOURCES`), compiled by NVRTC for one
//! model shape and numeric mode, cached on disk like the inference kernels.

use crate::cuda::context::{Gpu, Kernel};
use crate::cuda::kernels::{KernelConfig, Module};
use crate::error::{Error, Result};
use crate::mixers::mamba3::cuda::program::TRAINING;
use crate::mixers::mamba3::cuda::scan::{check_smem, ScanKernels};

pub struct TrainKernels {
    // the forward (shared with inference)
    pub embed: Kernel,
    pub rms_norm_rows: Kernel,
    pub swiglu_rows: Option<Kernel>,
    pub scan: ScanKernels,
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
    /// Dynamic shared memory of the scan backward.
    pub bwd_smem: u32,
}

impl TrainKernels {
    pub fn load(gpu: &Gpu, cfg: &KernelConfig) -> Result<TrainKernels> {
        let (module, _) = Module::load(gpu, TRAINING, cfg)?;
        let get = |name| module.kernel(name);
        let global = |name: &str| module.global(name);
        let mlp = cfg.has_mlp();
        let k = TrainKernels {
            embed: get("embed")?,
            rms_norm_rows: get("rms_norm_rows")?,
            swiglu_rows: mlp.then(|| get("swiglu_rows")).transpose()?,
            scan: ScanKernels::load(gpu, &module)?,
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
            bwd_smem: global("scan_bwd_smem_bytes")?,
        };
        // the training launches (and scan_bwd) take the scan's default block of 256 threads
        let threads = k.scan.scan_threads;
        if threads != 256 {
            return Err(Error::Device(format!(
                "training needs scan blocks of 256 threads; this build has {threads} \
                 (SCAN_THREADS in MAMBA3_GPU_DEFINES is for inference only)"
            )));
        }
        check_smem(gpu, &k.scan_bwd, k.bwd_smem)?;
        k.scan_bwd.allow_smem(k.bwd_smem as usize)?;
        Ok(k)
    }
}
