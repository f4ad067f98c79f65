//! The CUDA C kernels (`kernels/*.cu`, embedded in the binary), compiled by NVRTC at run
//! time for the device's architecture (`sm_90a` on Hopper) with the model's dimensions as
//! compile-time constants, and cached on disk as cubin so that later starts skip the
//! compile.
//!
//! Cache: `$MAMBA3_KERNEL_CACHE`, else `$XDG_CACHE_HOME/mamba3/kernels`, else
//! `~/.cache/mamba3/kernels`; one file per (source, options, NVRTC version, architecture).
//! A cache that cannot be read or written only costs the compile.
//! CUDA headers (`cuda_bf16.h`, `mma.h`): `$CUDA_INCLUDE_DIR`, else `$CUDA_HOME/include`,
//! else `/usr/local/cuda/include`.

use super::context::{dev_err, Gpu, Kernel};
use super::scan::ScanKernels;
use crate::error::{Error, Result};
use crate::model::weights::Fnv;
use crate::model::{Config, DType, Dims};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::path::PathBuf;

/// Every kernel source, in the order they are concatenated into one program.
pub const SOURCES: [(&str, &str); 10] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("dense.cu", include_str!("kernels/dense.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
    ("prefill_pre.cu", include_str!("kernels/prefill_pre.cu")),
    ("scan_tiles.cuh", include_str!("kernels/scan_tiles.cuh")),
    ("scan_phases.cuh", include_str!("kernels/scan_phases.cuh")),
    ("scan_inputs.cuh", include_str!("kernels/scan_inputs.cuh")),
    ("scan.cu", include_str!("kernels/scan.cu")),
    ("step.cu", include_str!("kernels/step.cu")),
    ("decode_layers.cu", include_str!("kernels/decode_layers.cu")),
];

/// The training program: the forward's row and scan kernels plus the backward and the
/// optimiser (src/cuda/train).
pub const TRAIN_SOURCES: [(&str, &str); 9] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("dense.cu", include_str!("kernels/dense.cu")),
    ("prefill_pre.cu", include_str!("kernels/prefill_pre.cu")),
    ("scan_tiles.cuh", include_str!("kernels/scan_tiles.cuh")),
    ("scan_phases.cuh", include_str!("kernels/scan_phases.cuh")),
    ("scan_inputs.cuh", include_str!("kernels/scan_inputs.cuh")),
    ("scan.cu", include_str!("kernels/scan.cu")),
    ("scan_bwd.cu", include_str!("kernels/scan_bwd.cu")),
    ("train.cu", include_str!("kernels/train.cu")),
];

/// Hardware probes, not the model's (benches/gpu_floors.rs).
pub const PROBE_SOURCES: [(&str, &str); 3] = [
    ("cluster.cuh", include_str!("kernels/cluster.cuh")),
    ("probes.cu", include_str!("kernels/probes.cu")),
    ("probes_decode.cu", include_str!("kernels/probes_decode.cu")),
];

/// Which set of kernels a module holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Program {
    Inference,
    Training,
    Probes,
}

impl Program {
    fn sources(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Program::Inference => &SOURCES,
            Program::Training => &TRAIN_SOURCES,
            Program::Probes => &PROBE_SOURCES,
        }
    }

    /// The parts it is compiled in, each on a thread of its own (`PART` in
    /// kernels/common.cuh): NVRTC compiles a program on one core, and the inference
    /// program's 2 MB of cubin took ≈ 7.5 s on a freshly booted H200 machine (< 1 s on one
    /// that had run a process before; docs/benchmarks.md). Each part keeps its own entry points, so the parts
    /// together are the whole program; 0 is the whole program in one piece.
    pub fn parts(self) -> &'static [u32] {
        match self {
            Program::Inference => &[1, 2, 3, 4, 5, 6],
            Program::Training | Program::Probes => &[0],
        }
    }

    /// What the program is for, in an error message.
    fn what(self) -> &'static str {
        match self {
            Program::Inference => "inference",
            Program::Training => "training",
            Program::Probes => "probe",
        }
    }
}

/// The kernels a module exports (`gemv_tc_*` and `decode_layers*` only for 16-bit models).
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

/// How the chunk products of the scan are computed (`SCAN_MMA` in kernels/scan.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScanMath {
    /// exact f32 FMA
    F32 = 0,
    /// TF32 tensor cores, f32 accumulate
    Tf32 = 1,
    /// bf16/f16 tensor cores (the model dtype), f32 accumulate
    Half = 2,
    /// f16 tensor cores whatever the model dtype (TF32's mantissa in 16 bits), f32 accumulate
    F16 = 3,
}

/// Everything a compiled module depends on besides the source.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelConfig {
    pub defines: Vec<(String, String)>,
}

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
        Ok(KernelConfig { defines }.tuned())
    }

    /// The same with the constant `k` set to `v`, unless `MAMBA3_GPU_DEFINES` sets it.
    pub fn with(mut self, k: &str, v: &str) -> KernelConfig {
        self.set(k, v);
        self.tuned()
    }

    fn tuned(mut self) -> KernelConfig {
        self.tuning_from_env();
        self
    }

    /// `MAMBA3_GPU_DEFINES="NAME=VALUE ..."`: kernel constants added or overridden, for
    /// measuring a tuning variant without a rebuild (part of the cache key like the rest).
    fn tuning_from_env(&mut self) {
        let Ok(extra) = std::env::var("MAMBA3_GPU_DEFINES") else {
            return;
        };
        for item in extra.split([' ', ',']).filter(|s| !s.is_empty()) {
            if let Some((k, v)) = item.split_once('=') {
                self.set(k, v);
            }
        }
    }

    /// Set the constant `k` to `v` (added, or replacing its value).
    pub fn set(&mut self, k: &str, v: &str) {
        match self.defines.iter_mut().find(|(n, _)| n == k) {
            Some((_, old)) => *old = v.to_string(),
            None => self.defines.push((k.to_string(), v.to_string())),
        }
    }

    /// The same kernels for an embedding table held in `dtype` (f32, or the model dtype).
    pub fn with_embedding(mut self, dtype: DType) -> KernelConfig {
        for (k, v) in &mut self.defines {
            if k == "EMBED_F32" {
                *v = usize::from(dtype == DType::F32).to_string();
            }
        }
        self
    }

    pub fn scan_math(&self) -> ScanMath {
        match self.define("SCAN_MMA") {
            Some("1") => ScanMath::Tf32,
            Some("2") => ScanMath::Half,
            Some("3") => ScanMath::F16,
            _ => ScanMath::F32,
        }
    }

    /// The value of the constant `k`, if it is set.
    pub fn define(&self, k: &str) -> Option<&str> {
        self.defines
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the model has an MLP (the kernels of its MLP are compiled).
    pub fn has_mlp(&self) -> bool {
        self.define("MLP_HIDDEN").is_some_and(|v| v != "0")
    }

    /// The same constants for part `part` of a program (`Program::parts`).
    pub fn for_part(&self, part: u32) -> KernelConfig {
        let mut cfg = self.clone();
        cfg.defines.retain(|(k, _)| k != "PART");
        if part != 0 {
            cfg.defines.push(("PART".into(), part.to_string()));
        }
        cfg
    }
}

/// The row stride of the in_proj output: `d_in_proj` rounded up to 8 (16-byte-aligned f32
/// rows; cuBLASLt's bf16 kernels were seen to write NaN into f32 rows 2760 bytes apart).
pub fn proj_ld(d: &Dims) -> usize {
    d.d_in_proj.next_multiple_of(8)
}

/// An f32 constant written so that NVRTC reads back exactly the same bits.
fn f32_literal(v: f32) -> String {
    format!("__int_as_float({:#010x})", v.to_bits())
}

/// The whole program: every source file, in order.
pub fn program_source(program: Program) -> String {
    // (the training program's backward keeps the forward's scan at 8 warps: scan_tiles.cuh)
    let head = match program {
        Program::Inference | Program::Probes => "",
        Program::Training => "#define PROGRAM_TRAINING 1\n",
    };
    let body: String = program
        .sources()
        .iter()
        .map(|(name, text)| format!("// ---- {name}\n{text}\n"))
        .collect();
    format!("{head}{body}")
}

/// Where the CUDA headers are, if anywhere.
pub fn cuda_include_dir() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("CUDA_INCLUDE_DIR").map(PathBuf::from),
        std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("include")),
        Some(PathBuf::from("/usr/local/cuda/include")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.join("cuda_bf16.h").is_file())
}

/// Whether libnvrtc can be loaded (never panics).
pub fn nvrtc_available() -> bool {
    std::panic::catch_unwind(|| unsafe { nvrtc_sys::is_culib_present() }).unwrap_or(false)
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_available() {
        return Err(Error::Device(
            "libnvrtc was not found: install the CUDA toolkit (or the nvidia-cuda-nvrtc wheel) \
             and put its lib directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let (mut a, mut b) = (0, 0);
    unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| dev_err("asking NVRTC for its version", e))?;
    Ok((a, b))
}

/// The `--gpu-architecture` for a compute capability: `sm_90a` on Hopper (for its own
/// instructions), `sm_XY` elsewhere.
pub fn arch_for(cc: (i32, i32)) -> String {
    if cc == (9, 0) {
        "sm_90a".into()
    } else {
        format!("sm_{}{}", cc.0, cc.1)
    }
}

/// NVRTC options for one configuration.
fn options(cfg: &KernelConfig, arch: &str, include: &std::path::Path) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".into(),
        "-default-device".into(),
        "-lineinfo".into(),
        format!("--include-path={}", include.display()),
    ];
    o.extend(cfg.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    o
}

/// Compile the program for `arch` and return the cubin, with the compiler's log.
pub fn compile_cubin(
    program: Program,
    cfg: &KernelConfig,
    arch: &str,
) -> Result<(Vec<u8>, String)> {
    nvrtc_version()?;
    let include = cuda_include_dir().ok_or_else(|| {
        Error::Device(
            "the CUDA headers (cuda_bf16.h) were not found: set CUDA_INCLUDE_DIR or CUDA_HOME"
                .into(),
        )
    })?;
    let src = std::ffi::CString::new(program_source(program))
        .map_err(|_| Error::Device("kernel source holds a NUL byte".into()))?;
    let prog = nvrtc::create_program(&src, Some(c"mamba3.cu"))
        .map_err(|e| dev_err("creating the NVRTC program", e))?;
    let opts = options(cfg, arch, &include);
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let out = compiled
        .map_err(|e| {
            Error::Device(format!(
                "NVRTC failed to compile the kernels for {arch} ({e:?}):\n{log}"
            ))
        })
        .and_then(|_| {
            let mut size = 0usize;
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| dev_err("reading the cubin size", e))?;
            let mut cubin = vec![0u8; size];
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| dev_err("reading the cubin", e))?;
            Ok(cubin)
        });
    let _ = unsafe { nvrtc::destroy_program(prog) };
    Ok((out?, log))
}

pub(super) fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MAMBA3_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("mamba3").join("kernels"))
}

/// The cubin for `cfg` on `arch`: from the disk cache, or compiled (and cached).
/// Returns whether it came from the cache.
pub fn cubin_cached(program: Program, cfg: &KernelConfig, arch: &str) -> Result<(Vec<u8>, bool)> {
    let (va, vb) = nvrtc_version()?;
    let key = Fnv::new()
        .bytes(program_source(program).as_bytes())
        .bytes(format!("{:?}|{arch}|nvrtc {va}.{vb}", cfg.defines).as_bytes())
        .0;
    let path = cache_dir().map(|d| d.join(format!("{key:016x}-{arch}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok((bytes, true));
            }
        }
    }
    let (cubin, _log) = compile_cubin(program, cfg, arch)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            let _ = std::fs::create_dir_all(dir)
                .and_then(|_| std::fs::write(&tmp, &cubin))
                .and_then(|_| std::fs::rename(&tmp, p));
        }
    }
    Ok((cubin, false))
}

/// A compiled program loaded on the device: its kernels and the `__device__ int` constants
/// through which a kernel source tells the host how it was sized.
pub struct Module<'g> {
    gpu: &'g Gpu,
    /// one per part of the program, searched in order
    parts: Vec<std::sync::Arc<cudarc::driver::CudaModule>>,
}

/// One part's cubin, with whether it came from the cache and what its compile cost.
struct PartCubin {
    cubin: Vec<u8>,
    from_cache: bool,
    wall_s: f64,
    cpu_s: f64,
}

/// CPU seconds (user + system) this thread has used so far (for the timeline only).
#[cfg(target_os = "linux")]
fn thread_cpu_s() -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// (no per-thread CPU time outside Linux: the timeline shows 0)
#[cfg(not(target_os = "linux"))]
fn thread_cpu_s() -> f64 {
    0.0
}

impl<'g> Module<'g> {
    /// Compile `program` for `cfg` (or take it from the disk cache: the flag says which)
    /// and load it.
    pub fn load(gpu: &'g Gpu, program: Program, cfg: &KernelConfig) -> Result<(Self, bool)> {
        gpu.bind()?;
        let arch = arch_for(gpu.cc);
        let one_part = |part: u32| -> Result<PartCubin> {
            let (t0, cpu0) = (std::time::Instant::now(), thread_cpu_s());
            let (cubin, from_cache) = cubin_cached(program, &cfg.for_part(part), &arch)?;
            Ok(PartCubin {
                cubin,
                from_cache,
                wall_s: t0.elapsed().as_secs_f64(),
                cpu_s: thread_cpu_s() - cpu0,
            })
        };
        let parts: Vec<PartCubin> = match program.parts() {
            [part] => vec![one_part(*part)?],
            parts => std::thread::scope(|s| {
                let threads: Vec<_> = parts
                    .iter()
                    .map(|&p| s.spawn(move || one_part(p)))
                    .collect();
                threads
                    .into_iter()
                    .map(|t| {
                        t.join().unwrap_or_else(|_| {
                            Err(Error::Device("an NVRTC compile thread panicked".into()))
                        })
                    })
                    .collect::<Result<_>>()
            })?,
        };
        let from_cache = parts.iter().all(|p| p.from_cache);
        crate::timeline::mark(|| {
            let kb = parts.iter().map(|p| p.cubin.len()).sum::<usize>() / 1024;
            let n = parts.len();
            if from_cache {
                return format!(
                    "{} kernels read from the cache ({kb} KB, {n} parts)",
                    program.what()
                );
            }
            let slowest = parts.iter().max_by(|a, b| a.wall_s.total_cmp(&b.wall_s));
            let (wall, cpu) = slowest.map_or((0.0, 0.0), |p| (p.wall_s, p.cpu_s));
            format!(
                "{} kernels compiled by NVRTC ({kb} KB, {n} parts; the slowest {wall:.2} s, \
                 {cpu:.2} s of CPU)",
                program.what()
            )
        });
        let parts = parts
            .into_iter()
            .map(|p| {
                gpu.ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(p.cubin))
                    .map_err(|e| {
                        dev_err(
                            &format!("loading the compiled {} kernels", program.what()),
                            e,
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        crate::timeline::mark(|| format!("{} kernels loaded on the device", program.what()));
        Ok((Module { gpu, parts }, from_cache))
    }

    /// The function `name` of the first part that has it.
    fn function(&self, name: &str) -> Option<cudarc::driver::CudaFunction> {
        self.parts.iter().find_map(|m| m.load_function(name).ok())
    }

    pub fn kernel(&self, name: &'static str) -> Result<Kernel> {
        let func = self.function(name).ok_or_else(|| {
            Error::Device(format!(
                "kernel `{name}` is in none of the {} compiled parts",
                self.parts.len()
            ))
        })?;
        Ok(Kernel { name, func })
    }

    /// Whether this build has kernel `name` (some exist only for some shapes).
    pub fn has(&self, name: &str) -> bool {
        self.function(name).is_some()
    }

    /// The value of the `__device__ int` named `name`.
    pub fn global(&self, name: &str) -> Result<u32> {
        use cudarc::driver::DevicePtr;
        let view = self
            .parts
            .iter()
            .find_map(|m| m.get_global(name, &self.gpu.stream).ok())
            .ok_or_else(|| {
                Error::Device(format!(
                    "`{name}` is in none of the {} compiled parts",
                    self.parts.len()
                ))
            })?;
        let (ptr, _g) = view.device_ptr(&self.gpu.stream);
        let mut v = [0i32];
        self.gpu.dtoh(ptr, &mut v)?;
        Ok(v[0] as u32)
    }
}

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
    /// the prefill's chunked mixer (src/cuda/scan.rs)
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
        let (module, from_cache) = Module::load(gpu, Program::Inference, cfg)?;
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
