//! An experiment for the bf16 decode stream (docs/decisions.md, "bf16 decode stream on the
//! EPYC"): one activation row against every bf16 weight row of a mamba-130m-shaped step,
//! by the product kernel's one-row dot (`simd::dot_rows`: widen by a shift and a mask, two
//! FMAs per 32 weights) and by `vdpbf16ps` on the activation split once into `hi + lo` bf16
//! parts (two instructions per 32 weights). Both run the same split of rows over rayon.
//! Reports ms per pass and GB/s, median of 30, alternated.
//!
//! `cargo bench --bench bf16_dot -- [d_model] [layers] [vocab]` (defaults 768 24 50280)

#[path = "common/args.rs"]
mod args;

use half::bf16;
use mamba3::cpu::simd::{dot_rows, kernel_order};
use mamba3::model::rng::Rng;
use rayon::prelude::*;
use std::time::Instant;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows per rayon task: a few tasks per thread, as the product's stream takes.
fn block(n: usize) -> usize {
    n.div_ceil(4 * rayon::current_num_threads()).max(16)
}

fn widen_pass(mats: &[(Vec<bf16>, usize, usize)], xs: &[Vec<f32>], outs: &mut [Vec<f32>]) {
    for (((w, n, k), x), o) in mats.iter().zip(xs).zip(outs.iter_mut()) {
        o.par_chunks_mut(block(*n)).enumerate().for_each(|(b, t)| {
            let r0 = b * block(*n);
            for (j, v) in t.iter_mut().enumerate() {
                let mut one = [0f32; 1];
                dot_rows::<bf16, 1>(x, *k, &w[(r0 + j) * k..(r0 + j + 1) * k], &mut one);
                *v = one[0];
            }
        });
    }
}

/// `x` as pairs of its bf16 parts: per 32 elements, 16 words of `hi` pairs, then 16 of `lo`.
#[cfg(target_arch = "x86_64")]
fn split(x: &[f32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(x.len());
    for block in x.chunks(32) {
        let parts: Vec<(u16, u16)> = block
            .iter()
            .map(|&v| {
                let hi = bf16::from_f32(v);
                (hi.to_bits(), bf16::from_f32(v - hi.to_f32()).to_bits())
            })
            .collect();
        for p in parts.chunks(2) {
            out.push(p[0].0 as u32 | (p[1].0 as u32) << 16);
        }
        for p in parts.chunks(2) {
            out.push(p[0].1 as u32 | (p[1].1 as u32) << 16);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_dp(xs: &[u32], w: &[bf16]) -> f32 {
    let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= w.len() {
        _mm_prefetch::<_MM_HINT_T0>((w.as_ptr().add(i) as *const i8).wrapping_add(4096));
        let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(w.as_ptr().add(i) as *const _));
        let hi: __m512bh = std::mem::transmute(_mm512_loadu_si512(xs.as_ptr().add(i) as *const _));
        let lo: __m512bh =
            std::mem::transmute(_mm512_loadu_si512(xs.as_ptr().add(i + 16) as *const _));
        a0 = _mm512_dpbf16_ps(a0, wv, hi);
        a1 = _mm512_dpbf16_ps(a1, wv, lo);
        i += 32;
    }
    assert_eq!(i, w.len(), "the experiment takes rows of a multiple of 32");
    _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
}

#[cfg(target_arch = "x86_64")]
fn dp_pass(mats: &[(Vec<bf16>, usize, usize)], xs: &[Vec<u32>], outs: &mut [Vec<f32>]) {
    for (((w, n, k), x), o) in mats.iter().zip(xs).zip(outs.iter_mut()) {
        o.par_chunks_mut(block(*n)).enumerate().for_each(|(b, t)| {
            let r0 = b * block(*n);
            for (j, v) in t.iter_mut().enumerate() {
                // SAFETY: the features were checked in main.
                *v = unsafe { dot_dp(x, &w[(r0 + j) * k..(r0 + j + 1) * k]) };
            }
        });
    }
}

fn main() {
    let args = args::Args::new();
    let num = |i, d| args.num(i, d);
    let (dm, layers, vocab) = (num(0, 768), num(1, 24), num(2, 50280));
    #[cfg(target_arch = "x86_64")]
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")) {
        println!("no AVX-512 BF16 on this CPU");
        return;
    }
    let di = 2 * dm;
    let mut rng = Rng::new(11);
    let mut mat = |n: usize, k: usize| {
        let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f64(rng.normal())).collect();
        (w, n, k)
    };
    // Mamba-1's in_proj and out_proj per layer, then the head (the rows a multiple of 32).
    let mut mats = Vec::new();
    for _ in 0..layers {
        mats.push(mat(2 * di, dm));
        mats.push(mat(dm, di));
    }
    mats.push(mat(vocab, dm));
    let bytes: usize = mats.iter().map(|(_, n, k)| n * k * 2).sum();
    let x: Vec<f32> = (0..di).map(|_| rng.normal() as f32).collect();
    let xs_widen: Vec<Vec<f32>> = mats
        .iter()
        .map(|(_, _, k)| kernel_order::<bf16>(&x[..*k], 1, *k).into_owned())
        .collect();
    #[cfg(target_arch = "x86_64")]
    let xs_dp: Vec<Vec<u32>> = mats.iter().map(|(_, _, k)| split(&x[..*k])).collect();
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|(_, n, _)| vec![0f32; *n]).collect();
    let (mut widen_t, mut dp_t) = (Vec::new(), Vec::new());
    for _ in 0..30 {
        let t = Instant::now();
        widen_pass(&mats, &xs_widen, &mut outs);
        widen_t.push(t.elapsed().as_secs_f64());
        #[cfg(target_arch = "x86_64")]
        {
            let t = Instant::now();
            dp_pass(&mats, &xs_dp, &mut outs);
            dp_t.push(t.elapsed().as_secs_f64());
        }
    }
    for (label, mut ts) in [("shift+mask, 2 FMA", widen_t), ("vdpbf16ps hi+lo", dp_t)] {
        ts.sort_by(f64::total_cmp);
        let med = ts[ts.len() / 2];
        println!(
            "{label:<18} {:.1} MB per pass: median {:6.2} ms (best {:6.2}), {:5.1} GB/s",
            bytes as f64 / 1e6,
            med * 1e3,
            ts[0] * 1e3,
            bytes as f64 / med / 1e9
        );
    }
}
