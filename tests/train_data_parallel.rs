//! Data-parallel training on CPU workers over the host collective (`train::parallel`):
//! one worker equals plain training bit for bit (the reduction overlapped with the
//! backward or after it; tests/train_overlap_reduce.rs compares the two for N > 1); with 2 and 4 workers the reduced
//! gradient is the rank-ordered sum of the ranks' micro-batches, bit for bit, and within
//! the documented bound of one worker's; runs repeat bit for bit; checkpoints resume.
mod common;
use common::{random_batch, sentences_text, short_run};

use mamba3::model::Config;
use mamba3::train::data::Dataset;
use mamba3::train::parallel::DataParallel;
use mamba3::train::trainer::{RunConfig, Trainer};
use mamba3::train::{Backend, Batch, CpuBackend, Params};

fn tiny_config() -> Config {
    let mut c = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
    c.ssm_cfg.chunk_size = 16;
    c.d_intermediate = 48;
    c.tie_embeddings = false;
    c
}

fn data() -> Dataset {
    let text = sentences_text(
        &[
            "In the beginning was the word. ",
            "The quick brown fox jumps over the lazy dog. ",
            "She sells sea shells by the sea shore.\n",
        ],
        20_000,
    );
    Dataset::from_bytes(&text, 5)
}

fn run_config(steps: u64, accum: usize) -> RunConfig {
    short_run(tiny_config(), steps, 2, accum, 40)
}

/// Bucket sizes that cut tensors (64 bytes), hold several (4 KiB) and hold everything.
const BUCKETS: [usize; 3] = [64, 4096, 1 << 30];

fn bits(p: &Params<f32>) -> Vec<u32> {
    p.tensors()
        .iter()
        .flat_map(|(_, t)| t.iter().map(|x| x.to_bits()))
        .collect()
}

fn losses<B: Backend>(t: &Trainer<B>) -> Vec<u64> {
    t.progress
        .train_loss
        .iter()
        .map(|(_, l)| l.to_bits())
        .collect()
}

/// `steps` steps; the weights (synced) and the trainer.
fn train<B: Backend>(backend: B, steps: u64, accum: usize) -> Trainer<B> {
    let mut t = Trainer::with_data(run_config(steps, accum), backend, data()).unwrap();
    while t.progress.step < steps {
        t.step().unwrap();
    }
    t.sync().unwrap();
    t
}

#[test]
fn one_worker_equals_plain_training_bit_for_bit() {
    for accum in [1, 3] {
        let mut plain = train(CpuBackend, 4, accum);
        for (bytes, overlap) in BUCKETS.iter().flat_map(|&b| [(b, true), (b, false)]) {
            let mut one = DataParallel::host(&tiny_config(), 1, bytes).unwrap();
            one.set_overlap(overlap);
            let dp = train(one, 4, accum);
            assert_eq!(
                losses(&dp),
                losses(&plain),
                "losses, accum {accum}, {bytes} B, overlap {overlap}"
            );
            assert!(
                bits(&dp.params) == bits(&plain.params),
                "weights, accum {accum}"
            );
            assert!(bits(&dp.opt.m) == bits(&plain.opt.m), "first moments");
            assert!(bits(&dp.opt.v) == bits(&plain.opt.v), "second moments");
            assert_eq!(dp.opt.step, plain.opt.step);
            // validation runs on rank 0's weights
            let mut dp = dp;
            assert_eq!(
                dp.validate().unwrap().to_bits(),
                plain.validate().unwrap().to_bits()
            );
        }
    }
}

fn batches(n: usize) -> Vec<Batch> {
    (0..n)
        .map(|i| random_batch(256, 2, 24, 100 + i as u64))
        .collect()
}

#[test]
fn reduced_gradient_is_the_rank_ordered_sum_and_near_one_workers() {
    let cfg = tiny_config();
    let params = Params::<f32>::init(&cfg, 11).unwrap();
    for (n, accum) in [(2, 2), (2, 6), (4, 4), (4, 8)] {
        let bs = batches(accum);
        // one worker: every micro-batch into one buffer, in order
        let mut one = Params::zeros(&cfg);
        let mut one_loss = 0.0;
        for b in &bs {
            one_loss += CpuBackend.loss_and_grad(&params, b, &mut one).unwrap();
        }
        // each micro-batch alone, for the bound
        let alone: Vec<Params<f32>> = (bs.iter())
            .map(|b| {
                let mut g = Params::zeros(&cfg);
                CpuBackend.loss_and_grad(&params, b, &mut g).unwrap();
                g
            })
            .collect();
        // the documented order: rank r adds micro-batches r, r + n, …; then ranks 0, 1, …
        let mut want = Params::<f32>::zeros(&cfg);
        for r in 0..n {
            let mut rank = Params::zeros(&cfg);
            for b in bs.iter().skip(r).step_by(n) {
                CpuBackend.loss_and_grad(&params, b, &mut rank).unwrap();
            }
            for (w, (_, g)) in want.tensors_mut().into_iter().zip(rank.tensors()) {
                w.iter_mut().zip(g).for_each(|(a, &b)| *a += b);
            }
        }
        for bytes in BUCKETS {
            let mut dp = DataParallel::host(&cfg, n, bytes).unwrap();
            let (loss, got) = dp.reduced_gradient(&params, &bs).unwrap();
            assert!(
                bits(&got) == bits(&want),
                "n {n} accum {accum} {bytes} B: not the rank-ordered sum"
            );
            assert!(
                (loss - one_loss).abs() <= 1e-12 * one_loss.abs(),
                "{loss} vs {one_loss}"
            );
        }
        // against one worker: the bound of `train::parallel`'s module doc, per tensor
        // ‖g_N − g_1‖∞ ≤ 2(A + R)·2⁻²⁴·Σᵢ‖gᵢ‖∞ (R rows per micro-batch)
        let u = f32::EPSILON as f64 / 2.0;
        let rows = bs[0].tokens() as f64;
        let mut worst = 0f64;
        for (ti, ((name, g1), (_, gn))) in one.tensors().into_iter().zip(want.tensors()).enumerate()
        {
            let inf = |t: &[f32]| t.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
            let mass: f64 = alone.iter().map(|a| inf(a.tensors()[ti].1)).sum();
            let bound = 2.0 * (accum as f64 + rows) * u * mass;
            let diff = g1
                .iter()
                .zip(gn)
                .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
            assert!(
                diff <= bound,
                "n {n} accum {accum} {name}: {diff:e} > {bound:e}"
            );
            if bound > 0.0 {
                worst = worst.max(diff / bound);
            }
        }
        eprintln!("n {n} accum {accum}: largest difference {worst:.3} of the bound");
    }
}

#[test]
fn runs_with_the_same_workers_and_seed_are_bit_identical() {
    for n in [2, 4] {
        let a = train(DataParallel::host(&tiny_config(), n, 4096).unwrap(), 3, 4);
        let b = train(DataParallel::host(&tiny_config(), n, 64).unwrap(), 3, 4);
        assert_eq!(losses(&a), losses(&b), "n {n}");
        assert!(bits(&a.params) == bits(&b.params), "n {n}");
        // and the curve is one worker's up to the reduction order
        let one = train(CpuBackend, 3, 4);
        for ((_, x), (_, y)) in a.progress.train_loss.iter().zip(&one.progress.train_loss) {
            assert!(
                (x - y).abs() < 1e-4 * y.abs(),
                "n {n}: loss {x} vs one worker's {y}"
            );
        }
    }
}

#[test]
fn a_resumed_data_parallel_run_equals_the_unbroken_one() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let full = train(DataParallel::host(&cfg, 2, 4096).unwrap(), 6, 2);
    let mut first = Trainer::with_data(
        run_config(6, 2),
        DataParallel::host(&cfg, 2, 4096).unwrap(),
        data(),
    )
    .unwrap();
    for _ in 0..3 {
        first.step().unwrap();
    }
    first.save(dir.path()).unwrap();
    drop(first);
    let backend = DataParallel::host(&cfg, 2, 4096).unwrap();
    let mut second = Trainer::resume(dir.path(), backend, Some(data())).unwrap();
    while second.progress.step < 6 {
        second.step().unwrap();
    }
    second.sync().unwrap();
    assert_eq!(losses(&second), losses(&full));
    assert!(bits(&second.params) == bits(&full.params));
    // the checkpoint is the plain one's: a one-device run resumes from it
    let plain = Trainer::resume(dir.path(), CpuBackend, Some(data())).unwrap();
    assert_eq!(plain.progress.step, 3);
}

#[test]
fn an_uneven_deal_and_direct_gradients_are_refused() {
    let cfg = tiny_config();
    let mut t = Trainer::with_data(
        run_config(2, 3),
        DataParallel::host(&cfg, 2, 4096).unwrap(),
        data(),
    )
    .unwrap();
    let e = t.step().unwrap_err().to_string();
    assert!(
        e.contains("--accum 3") && e.contains("multiple of 2"),
        "{e}"
    );
    let mut dp = DataParallel::host(&cfg, 2, 4096).unwrap();
    let p = Params::<f32>::init(&cfg, 1).unwrap();
    let mut g = Params::zeros(&cfg);
    let e = dp
        .loss_and_grad(&p, &batches(1)[0], &mut g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("inside an optimiser step"), "{e}");
    assert!(DataParallel::host(&cfg, 0, 4096).is_err());
}

#[test]
fn the_command_trains_on_cpu_workers_and_refuses_bad_device_lists() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("text.txt");
    std::fs::write(
        &data,
        "In the beginning God created the heaven and the earth. ".repeat(400),
    )
    .unwrap();
    let out = tmp.path().join("run");
    let run = |extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_mamba3"))
            .args(["train", "--data"])
            .arg(&data)
            .arg("--out")
            .arg(&out)
            .args([
                "--d-model",
                "32",
                "--n-layer",
                "1",
                "--d-state",
                "16",
                "--headdim",
                "16",
            ])
            .args(["--batch", "2", "--seq-len", "16", "--eval-every", "1000"])
            .args(["--eval-windows", "2", "--warmup", "1", "--threads", "1"])
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    for (args, needle) in [
        (vec!["--devices", "cpu,cpu", "--accum", "3"], "--accum 3"),
        (vec!["--devices", "cpu,gpu:x"], "`gpu:x` is not a device"),
        (vec!["--devices", "cpu,cuda:0"], "found both"),
        (
            vec!["--devices", "cpu,cpu", "--accum", "2", "--bucket-mb", "0"],
            "--bucket-mb 0",
        ),
    ] {
        let (code, err) = run(&args);
        // an error (1, or clap's 2 for a value it cannot parse), not a panic (101)
        assert!(
            matches!(code, Some(1) | Some(2)),
            "{args:?}: {code:?} {err}"
        );
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let (code, err) = run(&["--devices", "cpu,cpu", "--accum", "2", "--steps", "2"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("2 devices"), "{err}");
    // the checkpoint is a one-device run's: it resumes on one CPU
    let (code, err) = run(&["--resume", "--steps", "3"]);
    assert_eq!(code, Some(0), "{err}");
}
