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
use crate::error::{Error, Result};
use crate::model::weights::Fnv;
use crate::model::{DType, Dims};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::path::PathBuf;

/// The kernels every model shares: constants and helpers (`common.cuh`), the embedding and
/// row kernels (`dense.cu`), and the weight-streaming GEMVs of decode (`gemv.cu`).
pub const COMMON: (&str, &str) = ("common.cuh", include_str!("kernels/common.cuh"));
/// The model dtype's type and conversions: the first source of every program.
pub const DTYPES: (&str, &str) = ("dtypes.cuh", include_str!("kernels/dtypes.cuh"));
/// Sums across a warp's lanes (the family programs and the fused decode of MIMO).
pub const LANES: (&str, &str) = ("lanes.cuh", include_str!("kernels/lanes.cuh"));
pub const DENSE: (&str, &str) = ("dense.cu", include_str!("kernels/dense.cu"));
pub const GEMV: (&str, &str) = ("gemv.cu", include_str!("kernels/gemv.cu"));
/// Every layer of a decode step in one cooperative launch, around a mixer's step functions.
pub const DECODE_LAYERS: (&str, &str) =
    ("decode_layers.cu", include_str!("kernels/decode_layers.cu"));
/// The training program's row kernels: the backward of the norms, SwiGLU, embedding and
/// cross-entropy, column sums, the gradient norm and AdamW.
pub const TRAIN: (&str, &str) = ("train.cu", include_str!("kernels/train.cu"));
/// Warp-level matrix products on shared-memory tiles (mma.sync fragments, or exact f32 FMA
/// in the same layout), for the chunked scans: Mamba-3's (`mixers/mamba3/cuda/kernels/scan.cu`)
/// and Mamba-2's (`mixers/mamba2/cuda/kernels/ssd_chunk.cu`).
pub const SCAN_TILES: (&str, &str) = ("scan_tiles.cuh", include_str!("kernels/scan_tiles.cuh"));
/// What the chunk-parallel scans of a packed pass (Mamba-2's, Mamba-3 MIMO's) share around
/// [`SCAN_TILES`]: the chunk tables, the state a warp holds, the tile's running log-decay.
pub const CHUNK_SCAN: (&str, &str) = ("chunk_scan.cuh", include_str!("kernels/chunk_scan.cuh"));

/// An error unless `gpu` lets a block of `kern` take `bytes` of shared memory.
pub fn check_smem(gpu: &Gpu, kern: &Kernel, bytes: u32) -> Result<()> {
    if bytes as usize > gpu.max_smem {
        return Err(Error::Device(format!(
            "`{}` needs {bytes} bytes of shared memory per block for this model's shape; {} \
             allows {} (a smaller chunk_size, d_state or headdim fits)",
            kern.name, gpu.name, gpu.max_smem
        )));
    }
    Ok(())
}

/// Sampling the next token of every row of a decode batch on the device (every mixer's).
pub const SAMPLE: (&str, &str) = ("sample.cu", include_str!("kernels/sample.cu"));

/// The sampling program: standalone, no model constants (sizes are arguments).
pub const SAMPLING: Program = Program {
    name: "sampling",
    head: "",
    sources: &[SAMPLE],
    parts: &[0],
};

/// A set of kernels compiled as one NVRTC program: its sources in the order they are
/// concatenated, and the parts it is compiled in, each on a thread of its own (`PART` in
/// kernels/common.cuh; 0 is the whole program in one piece). NVRTC compiles a program on
/// one core, so a large program split in parts starts faster (docs/decisions.md, "Kernels
/// compiled in six parts"). A mixer defines its programs (e.g.
/// `crate::mixers::mamba3::cuda::program`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Program {
    /// What the program is for, in messages.
    pub name: &'static str,
    /// Lines put before the sources (`#define`s that select the program's own code).
    pub head: &'static str,
    pub sources: &'static [(&'static str, &'static str)],
    pub parts: &'static [u32],
}

impl Program {
    pub fn parts(self) -> &'static [u32] {
        self.parts
    }
    fn what(self) -> &'static str {
        self.name
    }
}

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
    /// The same with the constant `k` set to `v`, unless `MAMBA3_GPU_DEFINES` sets it.
    pub fn with(mut self, k: &str, v: &str) -> KernelConfig {
        self.set(k, v);
        self.tuned()
    }

    pub(crate) fn tuned(mut self) -> KernelConfig {
        self.tuning_from_env();
        self
    }

    /// `MAMBA3_GPU_DEFINES="NAME=VALUE ..."`: kernel constants added or overridden, for
    /// measuring a tuning variant without a rebuild (part of the cache key like the rest).
    fn tuning_from_env(&mut self) {
        let Some(extra) = &crate::options::env().gpu_defines else {
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

/// The kernels' `STATE` define for the `ssm` state's storage dtype (`state_t` in
/// kernels/dtypes.cuh): 0 f32, 1 bf16, 2 f16.
pub fn state_define(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "1",
        DType::F16 => "2",
        _ => "0",
    }
}

/// The row stride of the in_proj output: `d_in_proj` rounded up to 8 (16-byte-aligned f32
/// rows; cuBLASLt's bf16 kernels were seen to write NaN into f32 rows 2760 bytes apart).
pub fn proj_ld(d: &Dims) -> usize {
    proj_stride(d.d_in_proj)
}

/// [`proj_ld`] for a row of `d_in_proj` values (also MIMO's fused decode).
pub fn proj_stride(d_in_proj: usize) -> usize {
    d_in_proj.next_multiple_of(8)
}

/// An f32 constant written so that NVRTC reads back exactly the same bits.
pub fn f32_literal(v: f32) -> String {
    format!("__int_as_float({:#010x})", v.to_bits())
}

/// The whole program: every source file, in order.
pub fn program_source(program: Program) -> String {
    let head = program.head;
    let body: String = program
        .sources
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
    if let Some(d) = &crate::options::env().kernel_cache {
        return Some(d.clone());
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
