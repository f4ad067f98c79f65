//! Data-parallel training on GPUs over NCCL (src/train/parallel.rs, src/train/cuda/
//! replica.rs, nccl.rs): one rank over a one-rank communicator equals plain GPU training
//! bit for bit (f32 and bf16: losses, norms, weights, moments), with the reduction
//! overlapped with the backward on the NCCL stream and after it, SISO and MIMO; on 2 and
//! 4 GPUs, when the
//! machine has them, the reduced gradient is one GPU's sum of the same micro-batches within
//! the bound of the module doc, the loss of a few steps follows one GPU's, and two runs are
//! bit-identical, overlapped or not. Needs a CUDA device and NCCL as `libnccl.so` on LD_LIBRARY_PATH (run with
//! `--include-ignored` on the GPU machine; scripts/gpu-check links PyTorch's copy).
#![cfg(feature = "cuda")]

mod gpu;
use gpu::{config, random_batch};
use mamba3::model::{Config, DType};
use mamba3::train::cuda::replica::data_parallel;
use mamba3::train::cuda::CudaTrainer;
use mamba3::train::optim::{AdamW, AdamWConfig};
use mamba3::train::{Backend, Batch, Params};

fn cfg() -> Config {
    config(48, 2, 32, 16, 2, 1.0, true, 64, 16)
}

/// `accum` micro-batches of 2 × 40 tokens for step `s`.
fn step_batches(cfg: &Config, s: u64, accum: usize) -> Vec<Batch> {
    (0..accum)
        .map(|i| random_batch(cfg.vocab_size, 2, 40, 1000 * s + i as u64))
        .collect()
}

/// Three steps from the same start: (loss, norm) bits per step, weights, moments.
fn three_steps<B: Backend>(
    backend: &mut B,
    cfg: &Config,
    accum: usize,
) -> (Vec<(u64, u64)>, Params<f32>, AdamW) {
    let mut p = Params::<f32>::init(cfg, 5).unwrap();
    let mut o = AdamW::new(AdamWConfig::default(), &p);
    let mut curve = Vec::new();
    for s in 0..3 {
        let (l, n) =
            (backend.step(&mut p, &mut o, &step_batches(cfg, s, accum), 1.0, 3e-3)).unwrap();
        curve.push((l.to_bits(), n.to_bits()));
    }
    backend.sync(&mut p, &mut o).unwrap();
    (curve, p, o)
}

fn f64s(curve: &[(u64, u64)]) -> Vec<f64> {
    curve.iter().map(|&(l, _)| f64::from_bits(l)).collect()
}

#[test]
#[ignore = "needs a CUDA device and NCCL"]
fn one_rank_over_nccl_equals_plain_gpu_training_bit_for_bit() {
    let cfg = cfg();
    for dtype in [DType::F32, DType::BF16] {
        let mut plain = CudaTrainer::new(&cfg, dtype, 0).unwrap();
        let (c1, p1, o1) = three_steps(&mut plain, &cfg, 2);
        drop(plain);
        // small buckets: many all-reduces, tensors cut across them; the reduction
        // overlapped with the backward on the NCCL stream, and after it
        for overlap in [true, false] {
            let mut dp = data_parallel(&cfg, dtype, &[0], 4096).unwrap();
            dp.set_overlap(overlap);
            let (c2, p2, o2) = three_steps(&mut dp, &cfg, 2);
            let what = format!("{dtype:?} overlap {overlap}");
            assert_eq!(c1, c2, "{what}: losses or norms differ");
            assert_eq!(p1, p2, "{what}: weights differ");
            assert_eq!(
                (&o1.m, &o1.v, o1.step),
                (&o2.m, &o2.v, o2.step),
                "{what}: moments"
            );
            let wait = dp
                .reduce_wait()
                .expect("a data-parallel step records its wait");
            assert!(wait.is_finite() && wait >= 0.0, "{what}: wait {wait}");
            println!(
                "{what}: one NCCL rank = plain GPU training over 3 steps, bit for bit \
                 (last step waited {:.3} ms for the reduction)",
                wait * 1e3
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device and NCCL"]
fn one_rank_overlapped_with_a_mimo_model_equals_plain_gpu_training() {
    let mut cfg = cfg();
    cfg.ssm_cfg.is_mimo = true;
    cfg.ssm_cfg.mimo_rank = 2;
    let mut plain = CudaTrainer::new(&cfg, DType::F32, 0).unwrap();
    let (c1, p1, o1) = three_steps(&mut plain, &cfg, 2);
    drop(plain);
    // one bucket per 64 bytes and one for everything
    for bytes in [64, 1 << 30] {
        let mut dp = data_parallel(&cfg, DType::F32, &[0], bytes).unwrap();
        assert!(dp.overlap());
        let (c2, p2, o2) = three_steps(&mut dp, &cfg, 2);
        assert_eq!(c1, c2, "MIMO {bytes} B: losses or norms differ");
        assert_eq!(p1, p2, "MIMO {bytes} B: weights differ");
        assert_eq!((&o1.m, &o1.v), (&o2.m, &o2.v), "MIMO {bytes} B: moments");
    }
    println!("MIMO: one overlapped NCCL rank = plain GPU training over 3 steps, bit for bit");
}

#[test]
#[ignore = "needs several CUDA devices and NCCL"]
fn several_gpus_follow_one_and_repeat_bit_for_bit() {
    let cfg = cfg();
    let visible = mamba3::engine::cuda_device_count();
    for n in [2, 4] {
        if n > visible {
            println!("skipped N = {n}: this machine shows {visible} GPU(s)");
            continue;
        }
        let ordinals: Vec<usize> = (0..n).collect();
        let accum = 2 * n;
        // the reduced gradient against one GPU's micro-batch gradients
        let p = Params::<f32>::init(&cfg, 8).unwrap();
        let bs = step_batches(&cfg, 9, accum);
        let mut one = CudaTrainer::new(&cfg, DType::F32, 0).unwrap();
        let alone: Vec<Params<f32>> = bs.iter().map(|b| one.gradient(&p, b).unwrap().1).collect();
        drop(one);
        let mut dp = data_parallel(&cfg, DType::F32, &ordinals, 4096).unwrap();
        let (_, got) = dp.reduced_gradient(&p, &bs).unwrap();
        drop(dp);
        let u = f32::EPSILON as f64 / 2.0;
        let rows = bs[0].tokens() as f64;
        for (ti, (name, g)) in got.tensors().into_iter().enumerate() {
            let inf = |t: &[f32]| t.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
            let mass: f64 = alone.iter().map(|a| inf(a.tensors()[ti].1)).sum();
            let bound = 2.0 * (accum as f64 + rows) * u * mass;
            let diff = (0..g.len())
                .map(|i| {
                    let sum: f64 = alone.iter().map(|a| a.tensors()[ti].1[i] as f64).sum();
                    (g[i] as f64 - sum).abs()
                })
                .fold(0f64, f64::max);
            assert!(diff <= bound, "N {n} {name}: {diff:e} > {bound:e}");
        }
        // a few steps: one GPU's curve up to the reduction order; two runs the same bits
        let mut plain = CudaTrainer::new(&cfg, DType::F32, 0).unwrap();
        let (c1, _, _) = three_steps(&mut plain, &cfg, accum);
        drop(plain);
        let mut a = data_parallel(&cfg, DType::F32, &ordinals, 4096).unwrap();
        let (ca, pa, _) = three_steps(&mut a, &cfg, accum);
        drop(a);
        let mut b = data_parallel(&cfg, DType::F32, &ordinals, 4096).unwrap();
        let (cb, pb, _) = three_steps(&mut b, &cfg, accum);
        drop(b);
        // the reduction after the backward: the same bits as the overlapped one
        let mut c = data_parallel(&cfg, DType::F32, &ordinals, 4096).unwrap();
        c.set_overlap(false);
        let (cc, pc, _) = three_steps(&mut c, &cfg, accum);
        assert_eq!(ca, cc, "N {n}: overlapped and after-backward losses differ");
        assert_eq!(
            pa, pc,
            "N {n}: overlapped and after-backward weights differ"
        );
        for (x, y) in f64s(&ca).iter().zip(f64s(&c1)) {
            assert!(
                (x - y).abs() <= 1e-4 * y.abs(),
                "N {n}: loss {x} vs one GPU's {y}"
            );
        }
        assert_eq!(ca, cb, "N {n}: two runs' losses differ");
        assert_eq!(pa, pb, "N {n}: two runs' weights differ");
        println!("N = {n}: within the bound of one GPU; two runs bit-identical; overlap on = off");
    }
}
