//! MIMO's decode step of every layer in one cooperative launch: the fused decode of
//! `src/cuda/kernels/decode_layers.cu` around MIMO's step (`kernels/mimo_fused.cuh` over
//! `mimo_step.cu`). Per layer: the in_proj GEMV with its RMSNorm, the step of every
//! (sequence, head), the out_proj GEMV adding into the residual and the GatedMLP's two
//! GEMVs — phases that meet at counters in one launch instead of a dozen kernel boundaries
//! (at batch 1 a MIMO layer's kernels were each mostly launch and memory latency).
//!
//! For 16-bit models and decode passes of at most 16 sequences whose (head, sequence)
//! pairs fit in one wave of blocks. The GEMVs split the normed rows into hi + lo halves in
//! the weights' dtype (`gemv.cu`), so they count like f32 products — not bit for bit what
//! the unfused launches' cuBLASLt products give; `batch_invariant` keeps the unfused path.

use super::{GpuMimo, MimoDims, MimoScan, MIMO_SCAN, MIMO_STEP};
use crate::cuda::context::{DevBuf, Gpu, KArg, Kernel};
use crate::cuda::kernels::{
    f32_literal, proj_stride, state_define, KernelConfig, Module, Program, COMMON, DECODE_LAYERS,
    DTYPES, GEMV, LANES,
};
use crate::error::Result;
use crate::mixers::mamba1::cuda::act_define;
use crate::model::state_layout::StateLayout;
use crate::model::DType;

/// Threads of a fused block (`TC_WARPS · 32` of gemv.cu, `MSTEP_THREADS` of the step).
const THREADS: u32 = 256;
/// The most sequences of a fused step (two entry points: ≤ 8 rows, ≤ 16 rows).
pub const MAX_ROWS: usize = 16;

const MIMO_FUSED: (&str, &str) = ("mimo_fused.cuh", include_str!("kernels/mimo_fused.cuh"));

/// The fused decode program: compiled in its two parts (`decode_layers8`, `decode_layers16`).
pub const FUSED: Program = Program {
    name: "Mamba-3 MIMO fused decode",
    head: "#define MIMO_FUSED_DECODE 1\n#define FUSED_MIXER_SPLIT 0\n#define MSTEP_THREADS 256\n",
    sources: &[
        DTYPES,
        LANES,
        COMMON,
        GEMV,
        MIMO_SCAN,
        MIMO_STEP,
        MIMO_FUSED,
        DECODE_LAYERS,
    ],
    parts: &[5, 6],
};

/// One layer's entry of the table the kernel reads (`LayerW` of decode_layers.cu with
/// MIMO's `MixerW`, a `MimoScan`): the same fields in the same order.
#[repr(C)]
#[derive(Clone, Copy)]
struct FusedLayer {
    norm: u64,
    in_proj: u64,
    mix: MimoScan,
    out_proj: u64,
    mlp_norm: u64,
    fc1: u64,
    fc2: u64,
}

/// The constants of the fused program for a model of shape `d` (A's floor `a_floor`, the
/// residual norms' `eps`); `None` for f32 models and for widths the tensor-core GEMVs do
/// not take (multiples of 8).
pub fn fused_config(
    d: &MimoDims,
    a_floor: f32,
    dtype: DType,
    normed: DType,
    layout: &StateLayout,
    eps: f32,
) -> Result<Option<KernelConfig>> {
    let widths = [d.d_model, d.d_inner, d.mlp_hidden];
    if dtype == DType::F32 || widths.iter().any(|w| !w.is_multiple_of(8)) {
        return Ok(None);
    }
    let mut k = super::kernel_config(d, dtype)?
        .with_state_layout(layout)
        .map_err(|e| crate::error::Error::Device(format!("MIMO fused decode: {e}")))?;
    let i = |k: &mut KernelConfig, name: &str, v: usize| k.set(name, &v.to_string());
    i(&mut k, "D_MODEL", d.d_model);
    i(&mut k, "D_INNER", d.d_inner);
    i(&mut k, "NHEADS", d.nheads);
    i(&mut k, "NGROUPS", d.ngroups);
    i(&mut k, "D_IN_PROJ", d.d_in_proj);
    i(&mut k, "PROJ_LD", proj_stride(d.d_in_proj));
    i(&mut k, "MLP_HIDDEN", d.mlp_hidden);
    // (common.cuh's SISO helpers name these; MIMO's step takes its own from `MimoScan`)
    i(&mut k, "OUTNORM", 0);
    i(&mut k, "A_ACT", 0);
    k.set("A_FLOOR", &f32_literal(a_floor));
    k.set("NORM_EPS", &f32_literal(eps));
    k.set("ACT", act_define(dtype));
    k.set("NORM", act_define(normed));
    k.set("STATE", state_define(layout.state_dtype()));
    Ok(Some(k))
}

/// The fused decode of one MIMO model on its device: the kernels, the layer table and the
/// step's own buffers.
pub struct FusedDecode {
    /// `decode_layers8`, `decode_layers16` and their dynamic shared memory
    kernels: [(Kernel, u32); 2],
    table: DevBuf,
    layers: usize,
    nheads: usize,
    proj: DevBuf,
    yf: DevBuf,
    vg: DevBuf,
    /// the phase counters (zero between launches: the last block resets them)
    sync: DevBuf,
}

impl GpuMimo {
    /// [`fused_config`] for this model.
    pub fn fused_config(
        &self,
        dtype: DType,
        normed: DType,
        layout: &StateLayout,
        eps: f32,
    ) -> Result<Option<KernelConfig>> {
        fused_config(&self.d, self.a_floor, dtype, normed, layout, eps)
    }
}

impl FusedDecode {
    /// The fused decode of `mimo`, whose layers' residual norms are `norms` (device
    /// addresses), each layer's state `layer_floats` floats after the previous one's with
    /// its `ssm` tensor `ssm_floats` long. `None` when the model's shape is not fused
    /// (f32, widths) or the device cannot hold a block's shared memory.
    pub fn new(
        gpu: &Gpu,
        mimo: &GpuMimo,
        norms: &[u64],
        cfg: &KernelConfig,
        layer_floats: usize,
        ssm_floats: usize,
    ) -> Result<Option<FusedDecode>> {
        let d = &mimo.d;
        let (module, _) = Module::load(gpu, FUSED, cfg)?;
        let mut kernels = Vec::new();
        for name in ["decode_layers8", "decode_layers16"] {
            if !module.has(name) {
                return Ok(None);
            }
            let smem = module.global(&format!("{name}_smem"))?;
            if smem as usize > gpu.max_smem {
                return Ok(None);
            }
            let kern = module.kernel(name)?;
            kern.allow_smem(smem as usize)?;
            kernels.push((kern, smem));
        }
        let ld = proj_stride(d.d_in_proj);
        let table: Vec<FusedLayer> = mimo
            .layers
            .iter()
            .zip(norms)
            .enumerate()
            .map(|(l, (w, &norm))| {
                let mlp = w.mlp.as_ref();
                FusedLayer {
                    norm,
                    in_proj: w.in_proj.w.ptr,
                    mix: mimo.scan_args(w, l * layer_floats, ssm_floats, 0, ld, [0; 3]),
                    out_proj: w.out_proj.w.ptr,
                    mlp_norm: mlp.map_or(0, |m| m.norm.ptr),
                    fc1: mlp.map_or(0, |m| m.fc1.w.ptr),
                    fc2: mlp.map_or(0, |m| m.fc2.w.ptr),
                }
            })
            .collect();
        let [k8, k16]: [(Kernel, u32); 2] = kernels
            .try_into()
            .unwrap_or_else(|_| unreachable!("two entry points"));
        Ok(Some(FusedDecode {
            kernels: [k8, k16],
            table: gpu.upload(&table)?,
            layers: table.len(),
            nheads: d.nheads,
            proj: gpu.alloc::<f32>(MAX_ROWS * ld)?,
            yf: gpu.alloc::<f32>(MAX_ROWS * d.d_inner)?,
            vg: gpu.alloc::<f32>((MAX_ROWS * 2 * d.mlp_hidden).max(1))?,
            sync: gpu.upload(&[0u64; 2])?,
        }))
    }

    /// Whether a decode pass of `nb` sequences takes the fused step: at most
    /// [`MAX_ROWS`], and every (head, sequence) a block of the one wave.
    pub fn takes(&self, gpu: &Gpu, nb: usize) -> bool {
        nb > 0 && nb <= MAX_ROWS && self.nheads * nb <= gpu.sms
    }

    /// Every layer of the step: `residual` (`[nb, d_model]` f32, the embedded rows) in and
    /// out, `states` the device array of the sequences' state addresses.
    pub fn run(&self, gpu: &Gpu, nb: usize, residual: u64, states: u64) -> Result<()> {
        let (kern, smem) = &self.kernels[usize::from(nb > 8)];
        let (layers, nb_i, no_trace) = (self.layers as i32, nb as i32, 0u64);
        let args: [&dyn KArg; 10] = [
            &self.table.ptr,
            &layers,
            &residual,
            &self.proj.ptr,
            &self.yf.ptr,
            &self.vg.ptr,
            &states,
            &nb_i,
            &self.sync.ptr,
            &no_trace,
        ];
        gpu.launch_cooperative(kern, gpu.sms as u32, THREADS, *smem, false, &args)
    }
}
