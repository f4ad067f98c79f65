//! The projections at the benchmark shape (d_model 768, d_inner 1536, in_proj 3432 wide,
//! bf16 model: docs/performance.md, "The GPU benchmark shape") — a prefill's (32768 and 4096 rows) and a large
//! decode batch's lanes (64 and 32 rows) — each GEMM with every algorithm cuBLASLt's
//! heuristic proposes for it, and the in_proj output written as f32 or 16-bit. Questions:
//! does the heuristic's first guess leave time on the table (the engine times the large
//! products' guesses, `gemm_tune`; not the decode's), do the guesses give the same bits,
//! and what does a 16-bit in_proj output save in the GEMM itself?
//!
//! `cargo bench --features cuda --bench gpu_gemms` (on the GPU machine: the binary that
//! `scripts/gpu-check pack` builds, run by `scripts/gpu-check run gemms`). Each time is the
//! best of 5 runs of 20 back-to-back launches, per launch.

use mamba3::cuda::context::Gpu;
use mamba3::cuda::gemm::{pseudo_random_bytes, ElemType, GemmSpec, Lt};
use mamba3::error::Result;
use std::time::Instant;

const D_MODEL: usize = 768;
const D_INNER: usize = 1536;
const D_IN_PROJ: usize = 3432;

/// Seconds per launch of `s` with its current plan.
fn time(gpu: &Gpu, lt: &Lt, s: &GemmSpec, (a, w, d): (u64, u64, u64)) -> Result<f64> {
    const N: usize = 20;
    lt.gemm(gpu, s, a, w, d)?; // warm-up (loads the kernel)
    gpu.sync()?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..N {
            lt.gemm(gpu, s, a, w, d)?;
        }
        gpu.sync()?;
        best = best.min(start.elapsed().as_secs_f64() / N as f64);
    }
    Ok(best)
}

/// A device buffer of `n` values of type `t`, small pseudo-random numbers.
fn random(gpu: &Gpu, t: ElemType, n: usize, seed: u64) -> Result<mamba3::cuda::context::DevBuf> {
    gpu.upload(&pseudo_random_bytes(t, n, seed))
}

fn main() -> Result<()> {
    let gpu = Gpu::new(0)?;
    let lt = Lt::new(&gpu)?;
    println!("{} ({} SMs)", gpu.name, gpu.sms);
    println!(
        "{:<34} {:>6} {:>10} {:>8} {:>10} {:>10}",
        "GEMM", "rows", "D", "algo", "µs", "TFLOP/s"
    );
    let (f16t, bf16t, f32t) = (ElemType::F16, ElemType::BF16, ElemType::F32);
    for rows in [32768usize, 4096, 64, 32] {
        // (name, n, k, operand type, D type, accumulate)
        let (inp, fast, out) = (
            "in_proj (f16 input)",
            "in_proj (bf16 input, fast)",
            "out_proj (+= residual)",
        );
        let shapes = [
            (inp, D_IN_PROJ, D_MODEL, f16t, f32t, false),
            (inp, D_IN_PROJ, D_MODEL, f16t, f16t, false),
            (fast, D_IN_PROJ, D_MODEL, bf16t, f32t, false),
            (fast, D_IN_PROJ, D_MODEL, bf16t, f16t, false),
            (out, D_MODEL, D_INNER, bf16t, f32t, true),
        ];
        for (name, n, k, ab, dt, accumulate) in shapes {
            let s = GemmSpec::linear(rows, n, k, ab, dt, n, accumulate, false);
            let a = random(&gpu, ab, rows * k, 1)?;
            let w = random(&gpu, ab, n * k, 2)?;
            let d = random(&gpu, dt, rows * n, 3)?;
            let flops = 2.0 * (rows * n * k) as f64;
            // (cuBLASLt has no kernel for some type combinations, e.g. f16 · f16 → bf16)
            let n_algos = match lt.candidate_count(&s) {
                Ok(n) => n,
                Err(e) => {
                    println!("{name:<34} {rows:>6} {:>10}   {e}", format!("{dt:?}"));
                    continue;
                }
            };
            let mut first: Option<Vec<u8>> = None;
            for i in 0..n_algos {
                lt.use_candidate(&s, i)?;
                let t = time(&gpu, &lt, &s, (a.ptr, w.ptr, d.ptr))?;
                // the same bits as the first algorithm's? (one product into a fresh D)
                let fresh = random(&gpu, dt, rows * n, 3)?;
                lt.gemm(&gpu, &s, a.ptr, w.ptr, fresh.ptr)?;
                let mut bytes = vec![0u8; rows * n * dt.size()];
                gpu.dtoh(fresh.ptr, &mut bytes)?;
                let out = match &first {
                    None => {
                        first = Some(bytes);
                        "(reference)".to_string()
                    }
                    Some(f) if *f == bytes => "same bits".into(),
                    Some(f) => {
                        let differ = f.iter().zip(&bytes).filter(|(x, y)| x != y).count();
                        format!("{differ} bytes differ")
                    }
                };
                let [id, tile, stages, split_k, cluster, swizzle] = lt.candidate_config(&s, i)?;
                println!(
                    "{name:<34} {rows:>6} {:>10} {i:>8} {:>10.1} {:>10.0}   algo {id} tile {tile} \
                     stages {stages} split-K {split_k} cluster {cluster} swizzle {swizzle} {out}",
                    format!("{dt:?}"),
                    t * 1e6,
                    flops / t / 1e12
                );
            }
            // small products (a decode batch's lanes): the first candidates with K split
            if rows <= 64 {
                for i in 0..n_algos.min(3) {
                    for splits in [2u32, 3, 4, 6, 8, 12] {
                        if !lt.use_split_candidate(&s, i, splits)? {
                            continue;
                        }
                        let t = time(&gpu, &lt, &s, (a.ptr, w.ptr, d.ptr))?;
                        println!(
                            "{name:<34} {rows:>6} {:>10} {:>8} {:>10.1} {:>10.0}   split-K {splits}",
                            format!("{dt:?}"),
                            format!("{i}/{splits}"),
                            t * 1e6,
                            flops / t / 1e12
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
