//! The two floors the CPU numbers are judged against (see docs/performance.md, "This project's 2-core machine"):
//! - the GEMM rate this machine reaches through the `gemm` crate on the prefill's own
//!   shapes (so "prefill at ≥ 80% of GEMM" compares like with like), and
//! - the memory read bandwidth (decode reads every weight once per token).
//!
//! `cargo bench --bench floors -- [d_model] [layers] [tokens] [d_state] [headdim]`
//! (defaults 768 24 512 128 64). GEMM rates are the best of 15 timed calls: the floor is
//! what the GEMM *can* reach here, so the comparison is strict for the engine.

#[path = "common/args.rs"]
mod args;
#[path = "common/read.rs"]
mod read;
#[path = "common/timing.rs"]
mod timing;

use mamba3::cpu::matmul::{gemm, View, ViewMut};
use mamba3::model::rng::Rng;
use mamba3::model::Config;

/// The fastest of `repeats` timed calls, after one warm-up call.
fn best(repeats: usize, mut f: impl FnMut()) -> f64 {
    timing::median_best(repeats, &mut f).1
}

fn main() {
    let args = args::Args::new();
    let (dm, layers, t, n, p) = (
        args.num(0, 768),
        args.num(1, 24),
        args.num(2, 512),
        args.num(3, 128),
        args.num(4, 64),
    );
    let threads = rayon::current_num_threads();
    let cfg = Config::synthetic(dm, layers, n, p, 2, 1, 256);
    let d = cfg.dims();
    let mut rng = Rng::new(7);
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };

    // GEMM floor: the projections of one layer at this token count, on all threads.
    let x = rand(t * d.d_inner);
    let w_in = rand(d.d_in_proj * dm);
    let w_out = rand(dm * d.d_inner);
    let mut out = vec![0f32; t * d.d_in_proj];
    let secs_in = best(15, || {
        gemm(
            ViewMut::new(&mut out, t, d.d_in_proj),
            None,
            View::new(&x[..t * dm], t, dm),
            View::new(&w_in, d.d_in_proj, dm).t(),
            1.0,
            threads,
        )
    });
    let secs_out = best(15, || {
        gemm(
            ViewMut::new(&mut out[..t * dm], t, dm),
            None,
            View::new(&x, t, d.d_inner),
            View::new(&w_out, dm, d.d_inner).t(),
            1.0,
            threads,
        )
    });
    let flops_in = 2.0 * (t * dm * d.d_in_proj) as f64;
    let flops_out = 2.0 * (t * d.d_inner * dm) as f64;
    let rate = (flops_in + flops_out) / (secs_in + secs_out);
    println!(
        "gemm  in_proj [{t}x{dm}]·[{dm}x{}]: {:.1} GFLOP/s; out_proj [{t}x{}]·[{}x{dm}]: {:.1} GFLOP/s; combined {:.1} GFLOP/s on {threads} threads",
        d.d_in_proj,
        flops_in / secs_in / 1e9,
        d.d_inner,
        d.d_inner,
        flops_out / secs_out / 1e9,
        rate / 1e9
    );

    // Memory read bandwidth: sum a buffer much larger than the caches, on all threads.
    let n = 256 << 20; // 1 GiB of f32
    let buf: Vec<f32> = (0..n).map(|i| (i % 1024) as f32).collect();
    let words: &[u32] = bytemuck::cast_slice(&buf);
    let secs = best(5, || {
        std::hint::black_box(read::sum_words(words));
    });
    let gbs = (n * 4) as f64 / secs / 1e9;
    println!("memory read bandwidth: {gbs:.1} GB/s on {threads} threads (sum of a 1 GiB buffer)");

    // What these floors mean for the model shape.
    let per_token_proj = 2.0 * (dm * d.d_in_proj + d.d_inner * dm) as f64 * layers as f64;
    let l = d.chunk_len as f64;
    let (n_, p_) = (d.d_state as f64, d.headdim as f64);
    let per_token_scan = 2.0 * (l * n_ + l * p_ + n_ * p_ + p_ * n_) * (d.nheads * layers) as f64;
    let per_token = per_token_proj + per_token_scan;
    println!(
        "model d_model {dm} x {layers} layers: {:.1} MFLOP/token ({:.1} projections + {:.1} chunked scan); \
         GEMM floor {:.0} tokens/s; 80% of it {:.0} tokens/s",
        per_token / 1e6,
        per_token_proj / 1e6,
        per_token_scan / 1e6,
        rate / per_token,
        0.8 * rate / per_token
    );
    let weight_bytes_bf16 = 2.0 * (dm * d.d_in_proj + d.d_inner * dm) as f64 * layers as f64;
    let state_bytes = 2.0 * 4.0 * (d.n_layer * d.state_elems_per_layer()) as f64;
    println!(
        "decode floor (bf16 weights {:.1} MB + state read and written {:.1} MB, over the bandwidth): {:.2} ms/token",
        weight_bytes_bf16 / 1e6,
        state_bytes / 1e6,
        (weight_bytes_bf16 + state_bytes) / (gbs * 1e9) * 1e3
    );
}
