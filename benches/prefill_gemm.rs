//! The products of a prefill, alone: `matmul_t` of `rows` activation rows by one layer's
//! in_proj and out_proj at a Mamba-2 shape, for f32 weights, bf16 weights on the path
//! `matmul_t` takes on this CPU (AVX-512 BF16 where present: split activations, and
//! rounded ones as under `--fast`), and bf16 weights widened for the `gemm` crate (the
//! path without AVX-512 BF16). Reports ms per layer and GFLOP/s, best and median.
//!
//! `cargo bench --bench prefill_gemm -- [d_model] [rows] [passes]`
//! (defaults 1536 512 10: the mamba2-780m shape, d_state 128, headdim 64, ngroups 1).

#[path = "common/args.rs"]
mod args;
#[path = "common/timing.rs"]
mod timing;

use mamba3::cpu::gemm_bf16;
use mamba3::cpu::matmul::{matmul_t, matmul_t_widened};
use mamba3::model::dtype::{DType, TensorData};
use mamba3::model::rng::Rng;
use mamba3::model::weights::Matrix;

fn main() {
    let args = args::Args::new();
    let num = |i, d| args.num(i, d);
    let (dm, rows, passes) = (num(0, 1536), num(1, 512), num(2, 10));
    let di = 2 * dm;
    // Mamba-2's in_proj: z, x, B, C, dt.
    let shapes = [(2 * di + 2 * 128 + di / 64, dm), (dm, di)];
    let mut rng = Rng::new(7);
    let f32_mats: Vec<Matrix> = shapes
        .iter()
        .map(|&(n, k)| Matrix {
            rows: n,
            cols: k,
            data: TensorData::F32((0..n * k).map(|_| 0.05 * rng.normal() as f32).collect()),
        })
        .collect();
    let bf16_mats: Vec<Matrix> = f32_mats
        .iter()
        .map(|m| Matrix {
            rows: m.rows,
            cols: m.cols,
            data: m.data.convert(DType::BF16),
        })
        .collect();
    let x: Vec<f32> = (0..rows * di).map(|_| rng.normal() as f32).collect();
    let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(n, _)| vec![0f32; rows * n]).collect();
    let flops: f64 = shapes
        .iter()
        .map(|&(n, k)| 2.0 * (rows * n * k) as f64)
        .sum();
    println!(
        "d_model {dm}, {rows} rows, products {shapes:?}, AVX-512 BF16: {}",
        gemm_bf16::available()
    );
    #[derive(Clone, Copy)]
    enum Path {
        MatmulT,
        Rounded,
        Widened,
    }
    let paths: [(&str, &[Matrix], Path); 4] = [
        ("f32 weights", &f32_mats, Path::MatmulT),
        ("bf16 weights (matmul_t)", &bf16_mats, Path::MatmulT),
        ("bf16, rounded (--fast)", &bf16_mats, Path::Rounded),
        ("bf16 weights widened", &bf16_mats, Path::Widened),
    ];
    for (label, mats, path) in paths {
        let mut pass = || {
            for ((m, o), &(_, k)) in mats.iter().zip(outs.iter_mut()).zip(&shapes) {
                let x = &x[..rows * k];
                match (path, &m.data) {
                    (Path::Rounded, TensorData::BF16(w)) => {
                        assert!(
                            gemm_bf16::matmul_t_bf16(x, rows, (w, m.rows, m.cols), o, false),
                            "no AVX-512 BF16 here"
                        );
                    }
                    (Path::Widened, _) => matmul_t_widened(x, rows, m, o),
                    _ => matmul_t(x, rows, m, o),
                }
            }
        };
        let (median, best) = timing::median_best(passes, &mut pass);
        println!(
            "{label:<26} best {:7.2} ms  median {:7.2} ms  {:6.1} GFLOP/s (best)",
            best * 1e3,
            median * 1e3,
            flops / best / 1e9
        );
    }
}
