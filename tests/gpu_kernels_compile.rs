//! Every GPU kernel compiles under NVRTC, for Hopper (sm_90a) and Ampere (sm_80), for a
//! spread of model shapes and every numeric mode, and the hardware probes for Hopper — no
//! GPU needed, so a broken kernel fails CI. It needs NVRTC 13.0 and the CUDA headers,
//! which `.ci/run` installs from the PyPI wheels into `.ci/nvrtc` (docs:
//! ../shared/docs/gpu.md):
//!
//! - with `LD_LIBRARY_PATH`/`CUDA_INCLUDE_DIR` pointing at them, it just runs;
//! - else it installs the wheels into `.ci/nvrtc` if they are not there yet
//!   (`scripts/nvrtc-wheels`, once per checkout) and re-runs itself with those set, so the
//!   README's `cargo test --release` needs no set-up step;
//! - if that install fails (no python3, no network) it fails and says why — unless
//!   `MAMBA3_SKIP_NVRTC_CHECK=1`, which makes it pass with a notice (CI never sets it).
//!
//! `MAMBA3_DUMP_CUBIN=DIR` writes every compiled cubin there, for `cuobjdump
//! --dump-resource-usage` (registers, shared memory, spills) and the SASS;
//! `MAMBA3_COMPILE_ONLY=TEXT` compiles only the programs whose name contains TEXT (e.g.
//! `bench BF16 F16`), for a quick look at one kernel while tuning.
#![cfg(feature = "cuda")]

mod gpu;
#[path = "../benches/kernels/program.rs"]
mod probe_kernels;
use mamba3::cuda::kernels::{
    compile_cubin, nvrtc_available, nvrtc_version, state_define, KernelConfig, ScanMath, SAMPLING,
};
use mamba3::mixers::family_synthetic::official_config;
use mamba3::mixers::mamba1::cuda::{kernel_config as m1_config, PROGRAM as M1_PROGRAM};
use mamba3::mixers::mamba2::cuda::{kernel_config as m2_config, PROGRAM as M2_PROGRAM};
use mamba3::mixers::mamba3::cuda::program::{INFERENCE, KERNEL_NAMES, TRAINING};
use mamba3::mixers::mimo::cuda::fused::{fused_config, FUSED as MIMO_FUSED};
use mamba3::mixers::mimo::cuda::{
    kernel_config as mimo_kernel_config, PROGRAM as MIMO_PROGRAM, TRAINING as MIMO_TRAINING,
};
use mamba3::mixers::mimo::{mimo_config_from_json_str, mimo_dims};
use mamba3::model::family_config::{FamilyConfig, MixerConfig};
use mamba3::model::DType;
use std::path::PathBuf;

const RERUN: &str = "MAMBA3_NVRTC_CHECK_RERUN";

/// `.ci/nvrtc`'s library and include directories, if the wheels are installed there.
fn ci_wheels() -> Option<(PathBuf, PathBuf)> {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".ci/nvrtc/lib");
    for py in std::fs::read_dir(&venv).ok()?.flatten() {
        let cu13 = py.path().join("site-packages/nvidia/cu13");
        if cu13.join("include/cuda_bf16.h").is_file() {
            return Some((cu13.join("lib"), cu13.join("include")));
        }
    }
    None
}

/// Whether the check can run in this process; re-runs it with the CI wheels if not.
fn nvrtc_here(test: &str) -> bool {
    if nvrtc_available() && mamba3::cuda::kernels::cuda_include_dir().is_some() {
        return true;
    }
    let skip = std::env::var("MAMBA3_SKIP_NVRTC_CHECK").as_deref() == Ok("1");
    let mut install_error = None;
    if std::env::var_os(RERUN).is_none() && ci_wheels().is_none() && !skip {
        install_error = install_wheels().err();
    }
    if std::env::var_os(RERUN).is_none() {
        if let Some((lib, inc)) = ci_wheels() {
            let ld = match std::env::var("LD_LIBRARY_PATH") {
                Ok(old) if !old.is_empty() => format!("{}:{old}", lib.display()),
                _ => lib.display().to_string(),
            };
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env("LD_LIBRARY_PATH", ld)
                .env("CUDA_INCLUDE_DIR", inc)
                .env(RERUN, "1")
                .status()
                .expect("re-running the test with the .ci/nvrtc wheels");
            assert!(
                status.success(),
                "the NVRTC compile check failed (re-run with .ci/nvrtc)"
            );
            return false;
        }
    }
    if skip {
        eprintln!("NOTICE: NVRTC or the CUDA headers are missing; kernel compile check SKIPPED");
        return false;
    }
    panic!(
        "NVRTC 13.0 and the CUDA headers are needed to check the GPU kernels, and installing \
         them with scripts/nvrtc-wheels failed: {}\n(set LD_LIBRARY_PATH and CUDA_INCLUDE_DIR \
         to an install of your own; MAMBA3_SKIP_NVRTC_CHECK=1 skips)",
        install_error.unwrap_or_else(|| "the wheels are installed but NVRTC does not load".into())
    );
}

/// Install the wheels into `.ci/nvrtc` (scripts/nvrtc-wheels: pip, from PyPI).
fn install_wheels() -> Result<(), String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/nvrtc-wheels");
    eprintln!("installing NVRTC and the CUDA headers into .ci/nvrtc (once) ...");
    let out = std::process::Command::new(&script)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} exited with {}: {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[test]
fn every_kernel_compiles_under_nvrtc() {
    if !nvrtc_here("every_kernel_compiles_under_nvrtc") {
        return;
    }
    println!("NVRTC {:?}", nvrtc_version().unwrap());
    let c = gpu::config;
    let shapes = [
        // the benchmark shape
        (c(768, 24, 128, 64, 1, 0.5, false, 0, 64), "bench"),
        // the fixtures' shapes
        (c(64, 2, 32, 16, 1, 0.5, false, 0, 16), "siso-tiny"),
        (c(96, 3, 64, 32, 2, 1.0, true, 160, 32), "siso-mlp-norm"),
        // shapes that do not tile by 16 (exact FMA scan)
        (c(48, 1, 16, 8, 3, 0.5, true, 64, 8), "odd"),
    ];
    let modes = [
        (DType::F32, ScanMath::F32),
        (DType::F32, ScanMath::Tf32),
        (DType::BF16, ScanMath::Tf32),
        (DType::BF16, ScanMath::Half),
        (DType::BF16, ScanMath::F16),
        (DType::F16, ScanMath::Half),
    ];
    let mut jobs = Vec::new();
    for (cfg, what) in &shapes {
        cfg.validate().unwrap();
        for &(dtype, scan) in &modes {
            let mut kc = KernelConfig::new(cfg, &cfg.dims(), dtype, scan).unwrap();
            // 16-bit models write a prefill's in_proj output in f16 when it fits
            // (`weights::proj_f16`); the TF32-scan mode keeps f32, as models that do not fit
            if dtype != DType::F32 && scan != ScanMath::Tf32 {
                kc.set("PROJ_F16", "1");
            }
            // every mode for the benchmark shape (and once for Ampere), the main modes
            // for the others
            let main = matches!(scan, ScanMath::F32 | ScanMath::Half) || dtype == DType::BF16;
            let inference = INFERENCE;
            if *what == "bench" || main {
                let name = format!("{what} {dtype:?} {scan:?}");
                jobs.push((name, inference, kc.clone(), "sm_90a"));
            }
            if *what == "bench" && dtype == DType::BF16 && scan == ScanMath::Tf32 {
                jobs.push((
                    format!("{what} {dtype:?} {scan:?}"),
                    inference,
                    kc.clone(),
                    "sm_80",
                ));
            }
            // the training program in its two modes: f32 (exact scan), bf16 (TF32 scan)
            if matches!(
                (dtype, scan),
                (DType::F32, ScanMath::F32) | (DType::BF16, ScanMath::Tf32)
            ) {
                let name = format!("{what} {dtype:?} {scan:?} training");
                jobs.push((name, TRAINING, kc, "sm_90a"));
            }
        }
    }
    // 16-bit SSM states (`--state-dtype`): every shape, an f32 and a bf16 model
    for (cfg, what) in &shapes {
        for state in [DType::BF16, DType::F16] {
            for (dtype, scan) in [(DType::F32, ScanMath::F32), (DType::BF16, ScanMath::Half)] {
                let layout = mamba3::mixers::mamba3::state::layout(&cfg.dims())
                    .with_state_dtype(state)
                    .unwrap();
                let kc = KernelConfig::new(cfg, &cfg.dims(), dtype, scan)
                    .unwrap()
                    .with_state_layout(&layout)
                    .unwrap();
                let name = format!("{what} {dtype:?} {scan:?} state {state:?}");
                jobs.push((name, INFERENCE, kc, "sm_90a"));
            }
        }
    }
    // Mamba-1 and Mamba-2: the fixtures' and the real checkpoints' state sizes, every dtype
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (what, cfg) in family_shapes() {
            let (program, kc) = match &cfg.mixer {
                MixerConfig::Mamba1(m) => (M1_PROGRAM, m1_config(m, dtype)),
                MixerConfig::Mamba2(m) => (M2_PROGRAM, m2_config(m, dtype).unwrap()),
            };
            jobs.push((format!("{what} {dtype:?}"), program, kc.clone(), "sm_90a"));
            // 16-bit SSM states (`--state-dtype`) with a bf16 model
            if dtype == DType::BF16 {
                for state in [DType::BF16, DType::F16] {
                    let mut kc = kc.clone();
                    kc.set("STATE", state_define(state));
                    // as FamilyCuda compiles a bf16 model whose normed rows fit f16
                    kc.set("NORM", "2");
                    let name = format!("{what} {dtype:?} state {state:?}");
                    jobs.push((name, program, kc, "sm_90a"));
                }
            }
        }
    }
    // Mamba-3 MIMO: the fixtures' and the benchmark's state sizes and ranks 1, 2, 3, 4, 8,
    // every dtype
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (d_state, rank, headdim) in [
            (128, 4, 64),
            (32, 4, 16),
            (64, 2, 8),
            (16, 1, 16),
            (64, 8, 16),
            // a rank that does not divide the scan's tiles, a headdim of 128
            (32, 3, 128),
        ] {
            let json = format!(
                r#"{{"d_model": 128, "n_layer": 1, "vocab_size": 100, "ssm_cfg": {{
                    "layer": "Mamba3", "d_state": {d_state}, "headdim": {headdim},
                    "is_mimo": true, "mimo_rank": {rank}}}}}"#
            );
            let cfg = mimo_config_from_json_str(&json, "test").unwrap();
            let kc = mimo_kernel_config(&mimo_dims(&cfg), dtype).unwrap();
            jobs.push((
                format!("MIMO N{d_state} R{rank} {dtype:?}"),
                MIMO_PROGRAM,
                kc.clone(),
                "sm_90a",
            ));
            if dtype == DType::BF16 {
                for state in [DType::BF16, DType::F16] {
                    let mut kc = kc.clone();
                    kc.set("STATE", state_define(state));
                    // as FamilyCuda compiles a bf16 model whose normed rows fit f16
                    kc.set("NORM", "2");
                    let name = format!("MIMO N{d_state} R{rank} {dtype:?} state {state:?}");
                    jobs.push((name, MIMO_PROGRAM, kc, "sm_90a"));
                }
                // the scan in bf16 operands (`MAMBA3_GPU_DEFINES="SCAN_MMA=2 CHUNK=64"`)
                let mut kc = kc.clone();
                kc.set("SCAN_MMA", "2");
                kc.set("CHUNK", "64");
                let name = format!("MIMO N{d_state} R{rank} {dtype:?} bf16 scan");
                jobs.push((name, MIMO_PROGRAM, kc, "sm_90a"));
            }
        }
    }
    // MIMO's fused decode (16-bit models): the benchmark's shape and the fixtures' sizes,
    // with and without a GatedMLP and an output norm, f16 normed rows for a bf16 model (as
    // FamilyCuda compiles one whose normed rows fit f16), 16-bit states
    for (d_model, d_state, rank, headdim, mlp) in [
        (768, 128, 4, 64, false),
        (128, 32, 4, 16, true),
        (128, 64, 2, 32, false),
        (64, 16, 1, 16, true),
    ] {
        let mlp_cfg = if mlp { r#", "d_intermediate": 96"# } else { "" };
        let json = format!(
            r#"{{"d_model": {d_model}, "n_layer": 2, "vocab_size": 100{mlp_cfg}, "ssm_cfg": {{
                "layer": "Mamba3", "d_state": {d_state}, "headdim": {headdim},
                "is_mimo": true, "mimo_rank": {rank}, "is_outproj_norm": {mlp}}}}}"#
        );
        let cfg = mimo_config_from_json_str(&json, "test").unwrap();
        let d = mimo_dims(&cfg);
        for (dtype, normed, state) in [
            (DType::BF16, DType::F16, DType::F32),
            (DType::BF16, DType::BF16, DType::BF16),
            (DType::F16, DType::F16, DType::F16),
        ] {
            let layout = mamba3::mixers::mimo::reference::layout(&d)
                .with_state_dtype(state)
                .unwrap();
            let kc = fused_config(&d, 0.0, dtype, normed, &layout, 1e-5)
                .unwrap()
                .expect("a 16-bit model of widths that are multiples of 8 is fused");
            let name = format!("MIMO fused d{d_model} N{d_state} R{rank} {dtype:?} norm {normed:?} state {state:?}");
            jobs.push((name, MIMO_FUSED, kc, "sm_90a"));
        }
    }
    // Mamba-3 MIMO training (f32, every size an argument), for Hopper and Ampere
    for arch in ["sm_90a", "sm_80"] {
        let kc = KernelConfig { defines: vec![] };
        jobs.push(("MIMO training".into(), MIMO_TRAINING, kc, arch));
    }
    // the decode batch's sampling (no model constants), for Hopper and Ampere
    for arch in ["sm_90a", "sm_80"] {
        let kc = KernelConfig { defines: vec![] };
        jobs.push(("sampling".into(), SAMPLING, kc, arch));
    }
    // the hardware probes of benches/gpu_floors.rs (no model constants)
    let probes = KernelConfig { defines: vec![] };
    jobs.push(("probes".into(), probe_kernels::PROBES, probes, "sm_90a"));
    if let Ok(only) = std::env::var("MAMBA3_COMPILE_ONLY") {
        jobs.retain(|(what, ..)| what.contains(only.as_str()));
        assert!(
            !jobs.is_empty(),
            "MAMBA3_COMPILE_ONLY={only:?} matches no kernel program"
        );
    }
    // Each program compiled as the engine compiles it: in its parts (Program::parts).
    let jobs: Vec<_> = jobs
        .into_iter()
        .flat_map(|(what, program, kc, arch)| {
            program
                .parts()
                .iter()
                .map(move |&part| (what.clone(), program, kc.for_part(part), arch, part))
                .collect::<Vec<_>>()
        })
        .collect();
    let entries = std::sync::Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some((what, program, kc, arch, part)) = jobs.get(i) else {
                    break;
                };
                match compile_cubin(*program, kc, arch) {
                    Ok((cubin, log)) if !cubin.is_empty() && !log.contains("warning") => {
                        // the fused decode's parts hold their entry points
                        if *program == MIMO_FUSED {
                            let want = if *part == 5 {
                                "decode_layers8"
                            } else {
                                "decode_layers16"
                            };
                            assert!(has_entry(&cubin, want), "{what} part {part}: no {want}");
                        }
                        if *program == INFERENCE {
                            let names: Vec<&str> = KERNEL_NAMES
                                .into_iter()
                                .filter(|n| has_entry(&cubin, n))
                                .collect();
                            let key = (what.clone(), *arch, kc.for_part(0));
                            entries.lock().unwrap().push((key, *part, names));
                        }
                        // MAMBA3_DUMP_CUBIN=DIR keeps the cubins (for cuobjdump: registers,
                        // spills, SASS) — no GPU needed.
                        if let Some(dir) = std::env::var_os("MAMBA3_DUMP_CUBIN") {
                            let name = format!("{what} {arch} part {part}.cubin").replace(' ', "_");
                            let _ = std::fs::write(PathBuf::from(dir).join(name), &cubin);
                        }
                    }
                    Ok((_, log)) => failures
                        .lock()
                        .unwrap()
                        .push(format!("{what} {arch}: warnings:\n{log}")),
                    Err(e) => failures.lock().unwrap().push(format!("{what} {arch}: {e}")),
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // The parts of an inference program hold each of its kernels once, and every kernel
    // that its shape and dtype need (what `Kernels::load` asks for).
    let entries = entries.into_inner().unwrap();
    // (the parts finish in any order: each program once)
    let mut programs = Vec::new();
    for (key, ..) in &entries {
        if !programs.contains(&key) {
            programs.push(key);
        }
    }
    for key in programs {
        let (what, arch, kc) = key;
        let parts: Vec<_> = entries.iter().filter(|(k, ..)| k == key).collect();
        assert_eq!(parts.len(), INFERENCE.parts().len(), "{what} {arch}");
        let half = kc.define("ACT") != Some("0");
        let mlp = kc.has_mlp();
        // (the tensor-core kernels tile their input widths by 8)
        let by8 = |k: &str| kc.define(k).unwrap().parse::<usize>().unwrap() % 8 == 0;
        for name in KERNEL_NAMES {
            let held = parts.iter().filter(|(_, _, n)| n.contains(&name)).count();
            let needed = match name {
                "swiglu_rows" | "gemv_hidden" => mlp,
                "gemv_tc_dmodel" => half && by8("D_MODEL"),
                "gemv_tc_dinner" => half && by8("D_INNER"),
                "gemv_tc_hidden" => half && mlp && by8("MLP_HIDDEN"),
                "decode_layers8" | "decode_layers16" => {
                    half && by8("D_MODEL") && by8("D_INNER") && (!mlp || by8("MLP_HIDDEN"))
                }
                _ => true,
            };
            assert!(held <= 1, "{what} {arch}: `{name}` is in {held} parts");
            if needed {
                assert_eq!(held, 1, "{what} {arch}: `{name}` is in no part");
            }
        }
    }
    let n = jobs.len();
    println!("{n} kernel programs (parts) compiled");
}

/// Whether a cubin defines the kernel `name` (its code section is `.text.<name>`).
fn has_entry(cubin: &[u8], name: &str) -> bool {
    let section = format!(".text.{name}\0");
    cubin
        .windows(section.len())
        .any(|w| w == section.as_bytes())
}

/// Shapes the kernels cannot take are refused when the kernels are configured, with the
/// reason, instead of failing on the device (no NVRTC needed).
#[test]
fn shapes_the_kernels_cannot_take_are_refused() {
    let c = gpu::config;
    let cases = [
        // d_state 12 with rope 0.5: 3 rotary angles (odd)
        (c(64, 1, 12, 16, 1, 0.5, false, 0, 16), "3 angles"),
        // 3 heads × 2 angles: the ssm block of the state would start 8 bytes off
        (c(48, 1, 8, 32, 1, 0.5, false, 0, 16), "3 heads"),
        // d_state 6: not a multiple of 4
        (c(64, 1, 6, 16, 1, 0.5, false, 0, 16), "d_state 6"),
        // headdim 256: past the scan's tiles
        (
            c(256, 1, 16, 256, 1, 0.5, false, 0, 16),
            "headdim up to 128",
        ),
    ];
    for (cfg, needle) in cases {
        cfg.validate().unwrap();
        let err = KernelConfig::new(&cfg, &cfg.dims(), DType::BF16, ScanMath::Half)
            .err()
            .unwrap_or_else(|| panic!("accepted a shape the kernels cannot take ({needle})"))
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
    // the benchmark shape is fine
    let bench = c(768, 24, 128, 64, 1, 0.5, false, 0, 64);
    assert!(KernelConfig::new(&bench, &bench.dims(), DType::BF16, ScanMath::Half).is_ok());
}

/// Mamba-1/Mamba-2 shapes whose kernels differ (state size, conv width): mamba-130m and
/// mamba2-130m, FalconMamba's state 16, Mamba-2 with state 64 and 256.
fn family_shapes() -> Vec<(String, FamilyConfig)> {
    let mut v = Vec::new();
    for (layer, d_state, headdim) in [
        ("Mamba1", 16, 64),
        ("Mamba2", 128, 64),
        ("Mamba2", 64, 32),
        ("Mamba2", 256, 64),
        // the random GPU configs' odd sizes (tiles padded: state 24 and 6, heads of 8 and 4)
        ("Mamba2", 24, 8),
        ("Mamba2", 6, 4),
        ("Mamba2", 128, 128),
    ] {
        let cfg = official_config(layer, 768, 2, 1000, d_state, headdim).unwrap();
        v.push((format!("{layer} N{d_state} P{headdim}"), cfg));
    }
    v
}
