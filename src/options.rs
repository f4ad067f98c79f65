//! Every option the engine reads from the environment, read here and nowhere else, and
//! [`VARIABLES`], the table of them that the README lists. Options a user sets per run are
//! command-line flags (`--device`, `--dtype`, `--threads`, `--tf32`, `--fast`,
//! `--batch-invariant`); what is
//! here is for diagnostics, measurements and machine-wide settings.

use std::path::PathBuf;
use std::sync::OnceLock;

/// Each variable, its values and what it does (the README's table).
pub const VARIABLES: [(&str, &str); 17] = [
    ("MAMBA3_TIMELINE", "`1`: print when each stage of start-up ends (checkpoint read, device opened, kernels compiled or read from the cache, weights uploaded, each pass); `2`: also wait for and time every GPU step"),
    ("MAMBA3_KERNEL_CACHE", "folder of the compiled-kernel cache and the GEMM algorithm choices (default `~/.cache/mamba3/kernels`)"),
    ("MAMBA3_GPU_DEBUG", "`1`: check every GPU step's output for non-finite values and name the first"),
    ("MAMBA3_GPU_TRACE", "file: write the fused decode step's per-phase clock marks there (for the trace tools)"),
    ("MAMBA3_GPU_TF32", "`1`: f32 models run their GEMMs and scan products on TF32 tensor cores (also `--tf32`)"),
    ("MAMBA3_GPU_FAST", "`1`: 16-bit models run the prefill scan's products on 16-bit tensor cores (also `--fast`)"),
    ("MAMBA3_GPU_PDL", "`0`: no programmatic dependent launch between kernels"),
    ("MAMBA3_GPU_FUSED_DECODE", "`0`: 16-bit decode batches of up to 16 run one launch per kernel instead of the fused step"),
    ("MAMBA3_GPU_DECODE_LANES", "`1` … `4`: cut unfused decode batches into this many lanes on streams of their own (default: by batch size)"),
    ("MAMBA3_GPU_LANE_PRIORITY", "`0`: side lanes run at the lowest stream priority instead of the highest"),
    ("MAMBA3_GPU_LT_WARM", "rows of the start-up's cuBLASLt warm-up (default 16; `0` none)"),
    ("MAMBA3_GPU_GEMM_TUNE", "`0`: keep cuBLASLt's first algorithm for large GEMMs instead of timing its first 8"),
    ("MAMBA3_GPU_SCAN_F16", "`0`: keep the TF32 scan where f16 tensor cores would be chosen (an A/B diagnostic)"),
    ("MAMBA3_GPU_PROJ_F16", "`0`: keep the f32 in_proj output of 16-bit models (an A/B diagnostic)"),
    ("MAMBA3_GPU_CHUNKS_PER_SEGMENT", "`P` or `P/T`: force the prefill scan's segment plan (an A/B diagnostic)"),
    ("MAMBA3_GPU_MIMO_CHUNK", "tokens: the MIMO prefill scan's chunk length (a block's walk) instead of the model's choice (an A/B diagnostic)"),
    ("MAMBA3_GPU_DEFINES", "`NAME=VALUE …`: kernel constants added or overridden, to measure a tuning without a rebuild"),
];

fn var(name: &str) -> Option<String> {
    debug_assert!(
        VARIABLES.iter().any(|(n, _)| *n == name),
        "{name} is not in options::VARIABLES"
    );
    std::env::var(name).ok()
}

fn flag(name: &str, default: bool) -> bool {
    match var(name).as_deref() {
        Some("1") | Some("true") | Some("on") => true,
        Some("0") | Some("false") | Some("off") => false,
        _ => default,
    }
}

/// The GPU flags of the command line, set once by the command before it loads a model;
/// every GPU model of the process starts with them (`GpuOptions::from_env`).
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuFlags {
    pub tf32: bool,
    pub fast: bool,
    pub batch_invariant: bool,
}

static COMMAND_LINE: OnceLock<GpuFlags> = OnceLock::new();

/// Record the command line's GPU flags (the first call wins).
pub fn set_command_line(flags: GpuFlags) {
    let _ = COMMAND_LINE.set(flags);
}

/// The command line's `--fast` on the CPU: a bf16 model's many-row products on
/// activations rounded to bf16 rather than split into two bf16 parts
/// (`cpu::gemm_bf16`).
pub fn cpu_fast() -> bool {
    COMMAND_LINE.get().is_some_and(|f| f.fast)
}

/// `--state-dtype` of the command line (`f32`, `bf16` or `f16`, already checked by the
/// command), set once before it loads a model: the storage dtype of the `ssm` state of
/// every model `engine::Model::load` makes in this process. Kept as the name because this
/// module sits below the one that knows dtypes.
static STATE_DTYPE: OnceLock<&'static str> = OnceLock::new();

/// Record the command line's `--state-dtype` (the first call wins).
pub fn set_state_dtype(name: &'static str) {
    let _ = STATE_DTYPE.set(name);
}

/// The command line's `--state-dtype`, `f32` when none was given.
pub fn state_dtype_name() -> &'static str {
    STATE_DTYPE.get().copied().unwrap_or("f32")
}

/// The options read once per process.
#[derive(Clone, Debug)]
pub struct EnvOptions {
    pub timeline: u8,
    pub kernel_cache: Option<PathBuf>,
    pub gpu_debug: bool,
    pub gpu_trace: Option<PathBuf>,
    pub lane_priority: bool,
    /// The raw text; parsed (and its error reported) where the warm-up is planned.
    pub lt_warm: Option<String>,
    pub gemm_tune: bool,
    pub scan_f16: bool,
    pub proj_f16: bool,
    pub chunks_per_segment: Option<String>,
    pub mimo_chunk: Option<usize>,
    pub gpu_defines: Option<String>,
}

/// The environment's options (read at the first call).
pub fn env() -> &'static EnvOptions {
    static ENV: OnceLock<EnvOptions> = OnceLock::new();
    ENV.get_or_init(|| EnvOptions {
        timeline: var("MAMBA3_TIMELINE")
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0),
        kernel_cache: var("MAMBA3_KERNEL_CACHE").map(PathBuf::from),
        gpu_debug: flag("MAMBA3_GPU_DEBUG", false),
        gpu_trace: var("MAMBA3_GPU_TRACE").map(PathBuf::from),
        lane_priority: flag("MAMBA3_GPU_LANE_PRIORITY", true),
        lt_warm: var("MAMBA3_GPU_LT_WARM"),
        gemm_tune: flag("MAMBA3_GPU_GEMM_TUNE", true),
        scan_f16: flag("MAMBA3_GPU_SCAN_F16", true),
        proj_f16: flag("MAMBA3_GPU_PROJ_F16", true),
        chunks_per_segment: var("MAMBA3_GPU_CHUNKS_PER_SEGMENT"),
        mimo_chunk: var("MAMBA3_GPU_MIMO_CHUNK")
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n| n > 0),
        gpu_defines: var("MAMBA3_GPU_DEFINES"),
    })
}

/// Numeric and launch options of a GPU model (ignored on the CPU). They can change at
/// any time; CUDA graphs captured under other options refuse to replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuOptions {
    /// f32 models: GEMMs and scan products on TF32 tensor cores instead of exact f32.
    pub tf32: bool,
    /// bf16/f16 models: the prefill scan's products on 16-bit tensor cores (operands
    /// rounded to the model dtype) instead of TF32 — faster, a little less accurate (see
    /// docs/decisions.md). For the rare model whose norm weights could overflow the f16
    /// in_proj input, it also rounds that input to the model dtype instead of splitting it.
    pub fast: bool,
    /// Programmatic dependent launch between kernels (Hopper and newer).
    pub pdl: bool,
    /// 16-bit models, decode batches of up to 16: every layer of a step in one cooperative
    /// launch (kernels/decode_layers.cu) instead of three or five launches per layer.
    /// Bit-identical either way; it only changes the speed.
    pub fused_decode: bool,
    /// A sequence's logits and state, bit for bit, do not depend on the other sequences of
    /// its batch (as on the CPU): every GEMM runs one algorithm per shape whatever its row
    /// count (no split-K), Mamba-3's decode projections take the GEMV at every batch size,
    /// the prefill scan's segments are planned per sequence and prompts are read in windows
    /// of fixed length. Slower; docs/performance.md says by how much.
    pub batch_invariant: bool,
    /// Decode batches that run one launch per kernel (larger than the fused step takes):
    /// the rows are cut into this many lanes (1 … 4; 0 chooses by the batch size), each
    /// running every layer on a stream of its own, so that one lane's latency-bound
    /// projections overlap another's work (the head then runs once for the batch). Each
    /// lane leaves the states the decode of its rows alone would.
    pub decode_lanes: usize,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            tf32: false,
            fast: false,
            pdl: true,
            fused_decode: true,
            decode_lanes: 0,
            batch_invariant: false,
        }
    }
}

impl GpuOptions {
    /// The defaults, overridden by the command line's flags and by `MAMBA3_GPU_TF32=1`,
    /// `MAMBA3_GPU_FAST=1`, `MAMBA3_GPU_PDL=0`, `MAMBA3_GPU_FUSED_DECODE=0`,
    /// `MAMBA3_GPU_DECODE_LANES=N`.
    pub fn from_env() -> GpuOptions {
        let d = GpuOptions::default();
        let GpuFlags {
            tf32,
            fast,
            batch_invariant,
        } = COMMAND_LINE.get().copied().unwrap_or_default();
        GpuOptions {
            tf32: tf32 || flag("MAMBA3_GPU_TF32", d.tf32),
            fast: fast || flag("MAMBA3_GPU_FAST", d.fast),
            pdl: flag("MAMBA3_GPU_PDL", d.pdl),
            fused_decode: flag("MAMBA3_GPU_FUSED_DECODE", d.fused_decode),
            decode_lanes: var("MAMBA3_GPU_DECODE_LANES")
                .and_then(|v| v.parse::<usize>().ok())
                .map_or(d.decode_lanes, |n| n.min(4)),
            batch_invariant,
        }
    }
}

/// NCCL's own variable for NVLink multicast (NVLS): off unless the user set it, before a
/// communicator is made. The GPU machines this project measures on must never use NVLink
/// multicast, and a one-host all-reduce of gradient buckets has no need of it.
pub fn nccl_without_nvlink_multicast() {
    const NVLS: &str = "NCCL_NVLS_ENABLE";
    if std::env::var_os(NVLS).is_none() {
        std::env::set_var(NVLS, "0");
    }
}

#[cfg(test)]
mod tests {
    use super::VARIABLES;

    /// The README's table lists every variable, so a user can find each one.
    #[test]
    fn the_readme_lists_every_variable() {
        let readme = include_str!("../README.md");
        for (name, _) in VARIABLES {
            assert!(readme.contains(&format!("`{name}`")), "README lacks {name}");
        }
    }
}
