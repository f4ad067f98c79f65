//! Which chunk length makes the MIMO CPU prefill fastest, at the spec's cost example
//! (spec-MIMO §7): d_model 768, d_state 128, headdim 64, mimo_rank 4, one mixer layer, f32.
//! Only the mixer is timed (in_proj and out_proj do not depend on the chunk length).
//!
//! `cargo bench --no-default-features --bench mimo_chunk [-- T]` (T tokens, default 2048);
//! `RAYON_NUM_THREADS` sets the threads. Each chunk length: one warm-up, then the best of
//! five runs, in wall time and in process CPU time (on a shared machine the CPU time of a
//! one-thread run is the steadier number).

#[path = "common/args.rs"]
mod args;
#[path = "common/mimo_layer.rs"]
mod mimo_layer;

use mamba3::mixers::mimo::{mimo_mixer_prefill, MimoLayerState, MimoMixerCtx};
use std::time::Instant;

fn main() {
    let t = args::Args::new().num(0, 2048);
    let (w, proj) = mimo_layer::spec_example(t);
    let d = w.dims;
    let ctx = MimoMixerCtx::new(&w, 0);
    println!(
        "MIMO mixer prefill, f32: T {t}, H {}, P {}, N {}, R {}, {} rayon threads",
        d.nheads,
        d.headdim,
        d.d_state,
        d.rank,
        rayon::current_num_threads()
    );
    println!("chunk  rows(L·R)  wall ms  cpu ms  tokens/s(cpu)  GFLOP/s(cpu)  rel L2 vs chunk 16");
    let run = |chunk: usize| -> (f64, f64, Vec<f32>) {
        let mut out = vec![0f32; t * d.d_inner];
        let mut st = MimoLayerState::zeros(&d);
        let (start, cpu0) = (Instant::now(), cpu_seconds());
        mimo_mixer_prefill(&ctx, &proj, t, chunk, &mut st.view(), &mut out).expect("prefill");
        (start.elapsed().as_secs_f64(), cpu_seconds() - cpu0, out)
    };
    let (_, _, base) = run(16);
    for chunk in [4, 8, 16, 32, 64, 128] {
        run(chunk);
        let (mut best, mut best_cpu) = (f64::INFINITY, f64::INFINITY);
        let mut out = Vec::new();
        for _ in 0..5 {
            let (s, c, o) = run(chunk);
            best = best.min(s);
            best_cpu = best_cpu.min(c);
            out = o;
        }
        // Every chunk length is the same function: only rounding may differ.
        let sq = |v: f32| (v as f64) * (v as f64);
        let num: f64 = out.iter().zip(&base).map(|(a, b)| sq(a - b)).sum();
        let den: f64 = base.iter().map(|&b| sq(b)).sum();
        let diff = (num / den).sqrt();
        // Multiply-adds ×2 of the four products per chunk (M = Q̃K̃ᵀ, M·U, Q̃Sᵀ, (wU)ᵀK̃),
        // counting the ¾ of the L·R × L·R blocks the prefill computes.
        let (rows, p, n) = ((chunk * d.rank) as f64, d.headdim as f64, d.d_state as f64);
        let flops_per_chunk = 2.0 * (0.75 * rows * rows * (n + p) + 2.0 * rows * p * n);
        let flops = flops_per_chunk * (t as f64 / chunk as f64) * d.nheads as f64;
        println!(
            "{chunk:5}  {:9}  {:7.1}  {:6.1}  {:13.0}  {:12.1}  {diff:.1e}",
            chunk * d.rank,
            best * 1e3,
            best_cpu * 1e3,
            t as f64 / best_cpu,
            flops / best_cpu / 1e9,
        );
    }
}

/// CPU time of the whole process (every thread), in seconds.
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
