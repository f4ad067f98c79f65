//! The weight stream of one batch-1 decode step, alone: `matmul_t` of one input row over a
//! model's matrices in order (per layer in_proj, x_proj, dt_proj, out_proj; then the head),
//! inside one trip into the thread pool as the engine's step takes it. Reports ms per pass
//! and the read rate, against which the engine's decode is judged (docs/performance.md),
//! and beside it, in the same process, a plain sum over the same weight bytes: how fast
//! this process reads memory at all (on a VM that moves from one process to the next).
//!
//! `cargo bench --bench decode_gemv -- [d_model] [layers] [vocab] [dtype]`
//! (defaults 768 24 50280 bf16: the mamba-130m shape; `dtype` f32, bf16 or f16).

#[path = "common/args.rs"]
mod args;
#[path = "common/read.rs"]
mod read;
#[path = "common/timing.rs"]
mod timing;

use mamba3::cpu::matmul::matmul_t;
use mamba3::model::dtype::{DType, TensorData};
use mamba3::model::rng::Rng;
use mamba3::model::weights::Matrix;

fn main() {
    let args = args::Args::new();
    let num = |i, d| args.num(i, d);
    let (dm, layers, vocab) = (num(0, 768), num(1, 24), num(2, 50280));
    let dtype = match args.word(3).unwrap_or("bf16") {
        "f32" => DType::F32,
        "f16" => DType::F16,
        _ => DType::BF16,
    };
    let di = 2 * dm;
    let dt_rank = dm.div_ceil(16);
    let mut rng = Rng::new(11);
    let mut mat = |rows: usize, cols: usize| Matrix {
        rows,
        cols,
        data: TensorData::F32((0..rows * cols).map(|_| rng.normal() as f32).collect())
            .convert(dtype),
    };
    // Mamba-1's layer: in_proj [2·D_i, D], x_proj [R + 2N, D_i], dt_proj [D_i, R], out_proj [D, D_i].
    let mut mats = Vec::new();
    for _ in 0..layers {
        mats.push(mat(2 * di, dm));
        mats.push(mat(dt_rank + 32, di));
        mats.push(mat(di, dt_rank));
        mats.push(mat(dm, di));
    }
    mats.push(mat(vocab, dm));
    let bytes: usize = mats.iter().map(|m| m.rows * m.cols * dtype.size()).sum();
    let x: Vec<f32> = (0..di.max(dm)).map(|_| rng.normal() as f32).collect();
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; m.rows]).collect();
    let mut pass = || {
        rayon::scope(|_| {
            for (m, o) in mats.iter().zip(outs.iter_mut()) {
                matmul_t(&x[..m.cols], 1, m, o);
            }
        })
    };
    // The same bytes read as u32 words and summed, each matrix split over the threads.
    let read = || {
        let s: u32 = mats
            .iter()
            .map(|m| {
                let words: &[u32] = match &m.data {
                    TensorData::F32(v) => bytemuck::cast_slice(v),
                    TensorData::BF16(v) => bytemuck::cast_slice(v),
                    TensorData::F16(v) => bytemuck::cast_slice(v),
                    TensorData::F64(v) => bytemuck::cast_slice(v),
                };
                read::sum_words(words)
            })
            .fold(0u32, u32::wrapping_add);
        std::hint::black_box(s);
    };
    let (med, best) = timing::median_best(20, &mut pass);
    let (read_med, _) = timing::median_best(20, &mut || rayon::scope(|_| read()));
    println!(
        "d_model {dm} x {layers} layers, vocab {vocab}, {dtype}: {:.1} MB per pass, median {:.2} ms (best {:.2}), {:.1} GB/s on {} threads; a plain read of the same bytes {:.1} GB/s",
        bytes as f64 / 1e6,
        med * 1e3,
        best * 1e3,
        bytes as f64 / med / 1e9,
        rayon::current_num_threads(),
        bytes as f64 / read_med / 1e9,
    );
}
