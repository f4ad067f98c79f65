//! The training loop end to end on tiny models: the training forward computes the same
//! loss as the token-by-token oracle, the loss of a tiny model on a fixed text falls as
//! it should (and the same check fails with a broken gradient), and a resumed run lands
//! bit for bit on the unbroken run.
mod common;
use common::{sentences_text, short_run};

use mamba3::mixers::mamba3::Reference;
use mamba3::mixers::mamba3::Weights;
use mamba3::model::rng::Rng;
use mamba3::model::{Config, DType};
use mamba3::train::data::Dataset;
use mamba3::train::trainer::{RunConfig, Trainer};
use mamba3::train::{loss_and_grad, Backend, Batch, CpuBackend, Params};

fn tiny_config() -> Config {
    let mut c = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
    c.ssm_cfg.chunk_size = 16;
    c
}

/// A fixed text with structure a small model can learn: sentences drawn from a small set.
fn text() -> Vec<u8> {
    sentences_text(
        &[
            "In the beginning was the word. ",
            "And the light shone in the darkness. ",
            "The quick brown fox jumps over the lazy dog. ",
            "Seven swans a swimming, six geese a laying. ",
            "She sells sea shells by the sea shore.\n",
            "All that glitters is not gold. ",
        ],
        60_000,
    )
}

fn run_config(steps: u64, accum: usize) -> RunConfig {
    // windows of 40 tokens: three chunks of 16, the last partial
    short_run(tiny_config(), steps, 4, accum, 40)
}

#[test]
fn training_forward_matches_the_oracle() {
    let mut cfg = tiny_config();
    cfg.ssm_cfg.chunk_size = 8;
    cfg.ssm_cfg.is_outproj_norm = true;
    cfg.d_intermediate = 40;
    cfg.tie_embeddings = false;
    let w = Weights::synthetic(cfg, DType::F32, 9).unwrap();
    let p: Params<f64> = Params::from_weights(&w);
    let mut rng = Rng::new(1);
    let wins: Vec<Vec<u32>> = (0..2)
        .map(|_| (0..=21).map(|_| rng.below(256) as u32).collect())
        .collect();
    let refs: Vec<&[u32]> = wins.iter().map(|v| v.as_slice()).collect();
    let b = Batch::from_windows(&refs);
    let ours = loss_and_grad(&p, &b, None).unwrap();
    let oracle = Reference::<f64>::new(&w);
    let mut total = 0.0;
    for win in &wins {
        let mut st = mamba3::mixers::mamba3::state::zero_state(&w.dims);
        let logits = oracle.run(&win[..21], &mut st);
        for (l, &t) in logits.iter().zip(&win[1..]) {
            let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + l.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            total += lse - l[t as usize];
        }
    }
    let oracle_loss = total / 42.0;
    assert!(
        (ours - oracle_loss).abs() < 1e-10,
        "training forward {ours} vs oracle {oracle_loss}"
    );
    // The f32 training forward agrees too.
    let p32: Params<f32> = Params::from_weights(&w);
    let l32 = loss_and_grad(&p32, &b, None).unwrap();
    assert!(
        (l32 - oracle_loss).abs() < 1e-4,
        "f32 {l32} vs {oracle_loss}"
    );
}

/// Wraps the CPU backend and damages the gradient.
struct Broken {
    inner: CpuBackend,
    how: &'static str,
}

impl Backend for Broken {
    fn name(&self) -> String {
        format!("broken ({})", self.how)
    }
    fn loss_and_grad(
        &mut self,
        p: &Params<f32>,
        b: &Batch,
        g: &mut Params<f32>,
    ) -> mamba3::Result<f64> {
        let mut mine = Params::zeros(&p.config);
        let loss = self.inner.loss_and_grad(p, b, &mut mine)?;
        match self.how {
            // The sign of the mixer's projections flipped: a classic backward bug.
            "flipped in_proj" => {
                for l in &mut mine.layers {
                    l.in_proj.iter_mut().for_each(|v| *v = -*v);
                }
            }
            // Gradient entries scrambled (right magnitudes, wrong places).
            "scrambled" => {
                for t in mine.tensors_mut() {
                    t.reverse();
                }
            }
            _ => unreachable!(),
        }
        for (a, bb) in g.tensors_mut().into_iter().zip(mine.tensors()) {
            a.iter_mut().zip(bb.1).for_each(|(x, &y)| *x += y);
        }
        Ok(loss)
    }
    fn loss(&mut self, p: &Params<f32>, b: &Batch) -> mamba3::Result<f64> {
        self.inner.loss(p, b)
    }
}

/// Validation loss (nats/byte) before and after `STEPS` steps.
const STEPS: u64 = 150;

fn train_and_validate<B: Backend>(backend: B) -> (f64, f64) {
    let data = Dataset::from_bytes(&text(), 5);
    let mut t = Trainer::with_data(run_config(STEPS, 1), backend, data).unwrap();
    let before = t.validate().unwrap();
    while t.progress.step < t.run.steps {
        t.step().unwrap();
    }
    (before, t.validate().unwrap())
}

/// The bar a correct gradient must clear: `STEPS` steps take the validation loss of this text
/// from ln 256 ≈ 5.5 nats to below 0.6 nats/byte (the text's unigram entropy is ≈ 2.8
/// nats; getting well below it needs the model to use context).
const BAR: f64 = 0.6;

#[test]
fn loss_falls_and_a_broken_gradient_would_fail() {
    let (before, after) = train_and_validate(CpuBackend);
    eprintln!("correct gradient: validation loss {before:.3} -> {after:.3}");
    let broken: Vec<(&str, f64)> = ["flipped in_proj", "scrambled"]
        .into_iter()
        .map(|how| {
            let (_, l) = train_and_validate(Broken {
                inner: CpuBackend,
                how,
            });
            eprintln!("{how}: validation loss {l:.3}");
            (how, l)
        })
        .collect();
    let data = Dataset::from_bytes(&text(), 5);
    let unigram_nats = data.unigram_bits() * std::f64::consts::LN_2;
    eprintln!("unigram baseline {unigram_nats:.3}");
    assert!(before > 5.0, "initial loss {before}");
    assert!(
        after < BAR,
        "validation loss {after} after training, expected < {BAR}"
    );
    assert!(unigram_nats > 2.0 * BAR, "unigram {unigram_nats}");
    for (how, l) in broken {
        assert!(l > BAR, "{how}: a broken gradient reached {l} < {BAR}");
    }
}

#[test]
fn resume_equals_the_unbroken_run() {
    let dir = tempfile::tempdir().unwrap();
    let data = || Dataset::from_bytes(&text(), 5);
    let mut full = Trainer::with_data(run_config(8, 2), CpuBackend, data()).unwrap();
    while full.progress.step < 8 {
        full.step().unwrap();
    }
    let mut first = Trainer::with_data(run_config(8, 2), CpuBackend, data()).unwrap();
    while first.progress.step < 3 {
        first.step().unwrap();
    }
    first.save(dir.path()).unwrap();
    drop(first);
    let mut second = Trainer::resume(dir.path(), CpuBackend, Some(data())).unwrap();
    assert_eq!(second.progress.step, 3);
    while second.progress.step < 8 {
        second.step().unwrap();
    }
    assert_eq!(second.progress.train_loss, full.progress.train_loss);
    for ((name, a), (_, b)) in second
        .params
        .tensors()
        .into_iter()
        .zip(full.params.tensors())
    {
        let same = a
            .iter()
            .zip(b.iter())
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{name} differs after resume");
    }
    assert_eq!(second.opt.m, full.opt.m);
    assert_eq!(second.opt.v, full.opt.v);
    // The checkpoint is an ordinary model directory the engine loads.
    let w = Weights::load(dir.path(), DType::F32).unwrap();
    assert_eq!(w.config, tiny_config());
    assert!(dir.path().join("tokenizer.json").is_file());
}
