//! The training program's kernels (`kernels::TRAIN_SOURCES`), compiled by NVRTC for one
//! model shape and numeric mode, cached on disk like the inference kernels.

use crate::cuda::context::{dev_err, Gpu, Kernel};
use crate::cuda::kernels::{arch_for, cubin_cached, KernelConfig, Program};
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
    pub fn load(gpu: &Gpu, cfg: &KernelConfig) -> Result<TrainKernels> {
        gpu.bind()?;
        let (cubin, _) = cubin_cached(Program::Training, cfg, &arch_for(gpu.cc))?;
        let module = gpu
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| dev_err("loading the training kernels", e))?;
        let get = |name: &'static str| -> Result<Kernel> {
            let func = module
                .load_function(name)
                .map_err(|e| dev_err(&format!("finding kernel `{name}`"), e))?;
            Ok(Kernel { name, func })
        };
        let global = |name: &str| -> Result<u32> {
            use cudarc::driver::DevicePtr;
            let view = module
                .get_global(name, &gpu.stream)
                .map_err(|e| dev_err(&format!("finding `{name}`"), e))?;
            let (ptr, _g) = view.device_ptr(&gpu.stream);
            let mut v = [0i32];
            gpu.dtoh(ptr, &mut v)?;
            Ok(v[0] as u32)
        };
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
            use cudarc::driver::sys::CUfunction_attribute as FA;
            kern.func
                .set_attribute(
                    FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(|e| {
                    dev_err(&format!("raising the shared memory of `{}`", kern.name), e)
                })?;
        }
        Ok(k)
    }
}
