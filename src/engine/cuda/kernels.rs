//! The inference kernels of one model, loaded on the device: the shared row and GEMV
//! kernels and the mixer's (today Mamba-3's inference program,
//! `crate::mixers::mamba3::cuda::program::INFERENCE`).

use crate::cuda::context::{Gpu, Kernel};
use crate::cuda::kernels::{KernelConfig, Module};
use crate::error::Result;
use crate::mixers::mamba3::cuda::program::INFERENCE;
use crate::mixers::mamba3::cuda::scan::ScanKernels;

/// One model's kernels, loaded on the device.
pub struct Kernels {
    pub embed: Kernel,
    pub rms_norm_rows: Kernel,
    pub swiglu_rows: Option<Kernel>,
    /// decode GEMVs by input width: d_model, d_inner, MLP hidden
    pub gemv_dmodel: Kernel,
    pub gemv_dinner: Kernel,
    pub gemv_hidden: Option<Kernel>,
    /// the tensor-core GEMVs (16-bit models), by input width, with their shared memory
    /// for batches of ≤ 8 and ≤ 16 rows
    pub gemv_tc: [Option<(Kernel, [u32; 2])>; 3],
    /// the prefill's chunked mixer (mixers/mamba3/cuda/scan.rs)
    pub scan: ScanKernels,
    pub mixer_step: Kernel,
    /// every layer of a decode step in one cooperative launch (16-bit models), for
    /// batches of ≤ 8 and of ≤ 16 rows, with its shared memory
    pub decode_layers: [Option<(Kernel, u32)>; 2],
    pub config: KernelConfig,
    /// Whether the cubin came from the disk cache.
    pub from_cache: bool,
}

impl Kernels {
    pub fn load(gpu: &Gpu, cfg: &KernelConfig) -> Result<Kernels> {
        let (module, from_cache) = Module::load(gpu, INFERENCE, cfg)?;
        let get = |name| module.kernel(name);
        let global = |name: &str| module.global(name);
        let mlp = cfg.has_mlp();
        // A kernel of 16-bit models only, when this shape compiled it.
        let half_only = |name: &str| cfg.define("ACT") != Some("0") && module.has(name);
        let tc = |name: &'static str| -> Result<Option<(Kernel, [u32; 2])>> {
            if !half_only(name) {
                return Ok(None);
            }
            let smem = [
                global(&format!("{name}_smem8"))?,
                global(&format!("{name}_smem16"))?,
            ];
            Ok(Some((get(name)?, smem)))
        };
        let gemv_tc = [
            tc("gemv_tc_dmodel")?,
            tc("gemv_tc_dinner")?,
            if mlp { tc("gemv_tc_hidden")? } else { None },
        ];
        let fused = |name: &'static str| -> Result<Option<(Kernel, u32)>> {
            if !half_only(name) {
                return Ok(None);
            }
            Ok(Some((get(name)?, global(&format!("{name}_smem"))?)))
        };
        let decode_layers = [fused("decode_layers8")?, fused("decode_layers16")?];
        let k = Kernels {
            embed: get("embed")?,
            rms_norm_rows: get("rms_norm_rows")?,
            swiglu_rows: mlp.then(|| get("swiglu_rows")).transpose()?,
            gemv_dmodel: get("gemv_dmodel")?,
            gemv_dinner: get("gemv_dinner")?,
            gemv_hidden: mlp.then(|| get("gemv_hidden")).transpose()?,
            gemv_tc,
            scan: ScanKernels::load(gpu, &module)?,
            mixer_step: get("mixer_step")?,
            decode_layers,
            config: cfg.clone(),
            from_cache,
        };
        let gemv_smem = gpu.max_smem - 1024;
        let mut sized = vec![(&k.gemv_dmodel, gemv_smem), (&k.gemv_dinner, gemv_smem)];
        if let Some(g) = &k.gemv_hidden {
            sized.push((g, gemv_smem));
        }
        for (g, smem) in k.decode_layers.iter().flatten() {
            if *smem as usize <= gpu.max_smem {
                sized.push((g, *smem as usize));
            }
        }
        for (g, smem) in k.gemv_tc.iter().flatten() {
            if smem[1] as usize <= gpu.max_smem {
                sized.push((g, smem[1] as usize));
            } else if smem[0] as usize <= gpu.max_smem {
                sized.push((g, smem[0] as usize));
            }
        }
        for (kern, bytes) in sized {
            kern.allow_smem(bytes)?;
        }
        Ok(k)
    }
}
