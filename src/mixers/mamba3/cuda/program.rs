//! The Mamba-3 kernel programs: the inference program (the shared kernels, then the
//! mixer's: per-token preprocessing, the chunked scan, the decode step, the fused decode
//! of every layer) and the training program (the forward's scan, its backward, and the
//! training row kernels), and the constants one model's kernels are compiled with.

use crate::cuda::kernels::{
    f32_literal, proj_ld, state_define, KernelConfig, Program, ScanMath, COMMON, DECODE_LAYERS,
    DENSE, DTYPES, GEMV, SCAN_TILES, TRAIN,
};
use crate::error::{Error, Result};
use crate::model::state_layout::StateLayout;
use crate::model::{Config, DType, Dims};

const PREFILL_PRE: (&str, &str) = ("prefill_pre.cu", include_str!("kernels/prefill_pre.cu"));
const SCAN_PHASES: (&str, &str) = ("scan_phases.cuh", include_str!("kernels/scan_phases.cuh"));
const SCAN_INPUTS: (&str, &str) = ("scan_inputs.cuh", include_str!("kernels/scan_inputs.cuh"));
const SCAN: (&str, &str) = ("scan.cu", include_str!("kernels/scan.cu"));

/// Inference: every kernel of a prefill and a decode step.
pub const INFERENCE: Program = Program {
    name: "inference",
    head: "",
    sources: &[
        DTYPES,
        COMMON,
        DENSE,
        GEMV,
        PREFILL_PRE,
        SCAN_TILES,
        SCAN_PHASES,
        SCAN_INPUTS,
        SCAN,
        ("step.cu", include_str!("kernels/step.cu")),
        DECODE_LAYERS,
    ],
    parts: &[1, 2, 3, 4, 5, 6],
};

/// Training: the forward's row and scan kernels, the backward and the optimiser
/// (`crate::train::cuda`). The training program's backward keeps the forward's scan at 8
/// warps (scan_tiles.cuh).
pub const TRAINING: Program = Program {
    name: "training",
    head: "#define PROGRAM_TRAINING 1\n",
    sources: &[
        DTYPES,
        COMMON,
        DENSE,
        PREFILL_PRE,
        SCAN_TILES,
        SCAN_PHASES,
        SCAN_INPUTS,
        SCAN,
        ("scan_bwd.cu", include_str!("kernels/scan_bwd.cu")),
        TRAIN,
    ],
    parts: &[0],
};

/// The kernels the inference program exports (`gemv_tc_*` and `decode_layers*` only for
/// 16-bit models).
pub const KERNEL_NAMES: [&str; 17] = [
    "embed",
    "rms_norm_rows",
    "swiglu_rows",
    "gemv_dmodel",
    "gemv_dinner",
    "gemv_hidden",
    "gemv_tc_dmodel",
    "gemv_tc_dinner",
    "gemv_tc_hidden",
    "prefill_pre",
    "angle_pass",
    "scan_states",
    "scan_outputs",
    "scan_pass",
    "mixer_step",
    "decode_layers8",
    "decode_layers16",
];

impl KernelConfig {
    /// The constants of one model's kernels (`Half` scan math means TF32 for f32 models).
    pub fn new(cfg: &Config, dims: &Dims, dtype: DType, scan: ScanMath) -> Result<KernelConfig> {
        let d = dims;
        let act = match dtype {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
            DType::F64 => {
                return Err(Error::Device(
                    "the GPU runs f32, bf16 or f16 models, not f64".into(),
                ))
            }
        };
        let scan = match scan {
            ScanMath::Half | ScanMath::F16 if dtype == DType::F32 => ScanMath::Tf32,
            ScanMath::F16 if dtype == DType::F16 => ScanMath::Half,
            s => s,
        };
        // The scan's tiles (kernels/scan.cu) hold at most 128 rows.
        for (what, v) in [("chunk_size", d.chunk_len), ("headdim", d.headdim)] {
            if v > 128 {
                return Err(Error::Device(format!(
                    "the GPU scan supports {what} up to 128; this model has {v}"
                )));
            }
        }
        if !d.d_state.is_multiple_of(4) {
            return Err(Error::Device(format!(
                "d_state {} is not a multiple of 4, which the GPU kernels need",
                d.d_state
            )));
        }
        // Rotation pairs are read as float4s (two angles at a time), and each block of a
        // layer's state ([angle H·S | ssm | k | v], common.cuh) must start 16-byte aligned.
        let aligned = d.num_rope_angles.is_multiple_of(2)
            && (d.nheads * d.num_rope_angles).is_multiple_of(4)
            && d.d_inner.is_multiple_of(4);
        if !aligned {
            return Err(Error::Device(format!(
                "the GPU kernels need an even number of rotary angles with nheads·angles and \
                 d_inner multiples of 4; this model has {} angles, {} heads, d_inner {}",
                d.num_rope_angles, d.nheads, d.d_inner
            )));
        }
        let i = |k: &str, v: usize| (k.to_string(), v.to_string());
        let defines = vec![
            i("D_MODEL", d.d_model),
            i("D_INNER", d.d_inner),
            i("NHEADS", d.nheads),
            i("HEADDIM", d.headdim),
            i("DSTATE", d.d_state),
            i("NGROUPS", d.ngroups),
            i("NANGLES", d.num_rope_angles),
            i("D_IN_PROJ", d.d_in_proj),
            i("PROJ_LD", proj_ld(d)),
            i("CHUNK", d.chunk_len),
            i("VOCAB_PADDED", d.vocab_padded),
            i("MLP_HIDDEN", d.mlp_hidden),
            i("OUTNORM", usize::from(cfg.ssm_cfg.is_outproj_norm)),
            i(
                "A_ACT",
                match cfg.ssm_cfg.a_activation {
                    crate::model::config::AActivation::HeavyTail => 0,
                    crate::model::config::AActivation::Softplus => 1,
                },
            ),
            ("A_FLOOR".into(), f32_literal(cfg.ssm_cfg.a_floor as f32)),
            (
                "NORM_EPS".into(),
                f32_literal(crate::model::config::NORM_EPS as f32),
            ),
            i("ACT", act),
            i("SCAN_MMA", scan as usize),
            // An untied embedding is kept in f32 (model::weights `storage_dtype`).
            i(
                "EMBED_F32",
                usize::from(dtype == DType::F32 || !cfg.tie_embeddings),
            ),
        ];
        let cfg =
            KernelConfig { defines }.with_state_layout(&crate::mixers::mamba3::state::layout(d))?;
        Ok(cfg.tuned())
    }

    /// The state's storage: `STATE` (the `ssm` tensor's dtype: 0 f32, 1 bf16, 2 f16) and
    /// the byte offsets `ST_ANGLE`, `ST_SSM`, `ST_K`, `ST_V` of a layer's tensors and
    /// `ST_LAYER`, its bytes (kernels/common.cuh), from the layout every other part of the
    /// engine uses.
    pub fn with_state_layout(mut self, layout: &StateLayout) -> Result<KernelConfig> {
        let names = ["angle", "ssm", "k", "v"];
        let found: Vec<&str> = layout.tensors.iter().map(|t| t.name).collect();
        if found != names {
            return Err(Error::State(format!(
                "the Mamba-3 kernels take a state of {names:?}; this layout holds {found:?}"
            )));
        }
        self.set("STATE", state_define(layout.state_dtype()));
        for (i, name) in ["ST_ANGLE", "ST_SSM", "ST_K", "ST_V"].iter().enumerate() {
            self.set(name, &layout.byte_offset_in_layer(i).to_string());
        }
        self.set("ST_LAYER", &layout.layer_bytes().to_string());
        Ok(self)
    }
}
