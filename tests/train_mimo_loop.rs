//! Training a Mamba-3 MIMO model end to end on the CPU: the loss of a tiny model on a fixed
//! text falls, the checkpoint is an official MIMO model folder that the engine (and so
//! `mamba3 logits`/`generate`) loads and that gives the trainer's logits, and a resumed run
//! lands bit for bit on the unbroken run.
mod common;
use common::{sentences_text, short_run};

use mamba3::mixers::mimo::MimoWeights;
use mamba3::model::{Config, DType};
use mamba3::train::data::Dataset;
use mamba3::train::trainer::{RunConfig, Trainer};
use mamba3::train::{Batch, CpuBackend};
use mamba3::{Device, LogitsWant, MixerKind, MixerWeights, Model};

fn tiny_mimo(rank: usize) -> Config {
    let mut c = Config::synthetic(32, 2, 16, 16, 2, 1, 256);
    c.ssm_cfg.is_mimo = true;
    c.ssm_cfg.mimo_rank = rank;
    c.ssm_cfg.chunk_size = 8;
    c
}

fn text() -> Vec<u8> {
    sentences_text(
        &[
            "In the beginning was the word. ",
            "The quick brown fox jumps over the lazy dog. ",
            "She sells sea shells by the sea shore.\n",
            "All that glitters is not gold. ",
        ],
        30_000,
    )
}

fn run_config(rank: usize, steps: u64, accum: usize) -> RunConfig {
    // windows of 30 tokens: chunks of 8, the last partial
    short_run(tiny_mimo(rank), steps, 4, accum, 30)
}

#[test]
fn mimo_loss_falls_and_the_checkpoint_gives_the_trainers_logits() {
    let dir = tempfile::tempdir().unwrap();
    let data = Dataset::from_bytes(&text(), 5);
    let mut t = Trainer::with_data(run_config(2, 60, 1), CpuBackend, data).unwrap();
    let before = t.validate().unwrap();
    while t.progress.step < t.run.steps {
        t.step().unwrap();
    }
    let after = t.validate().unwrap();
    eprintln!("MIMO R=2: validation loss {before:.3} -> {after:.3} nats/byte");
    assert!(before > 5.0, "initial loss {before} (ln 256 ≈ 5.55)");
    // The text's unigram entropy is ≈ 2.7 nats/byte: below 2.0 needs context.
    assert!(after < 2.0, "validation loss {after} after 60 steps");
    t.save(dir.path()).unwrap();

    let w = MixerWeights::load(dir.path(), DType::F32).unwrap();
    assert_eq!(w.kind(), MixerKind::Mamba3Mimo);
    let mimo = MimoWeights::load(dir.path(), DType::F32).unwrap();
    assert_eq!(mimo.config, t.params.config);
    assert_eq!(mimo.dims.rank, 2);

    let tokens: Vec<u32> = text()[..25].iter().map(|&b| b as u32).collect();
    let mut window = tokens.clone();
    window.push(0);
    let ours = mamba3::train::model::logits(&t.params, &Batch::from_windows(&[&window])).unwrap();
    let m = Model::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    let got = m
        .prefill(&tokens, &mut m.new_state(), LogitsWant::All)
        .unwrap();
    assert_eq!(got.rows, tokens.len());
    let vp = ours.len() / tokens.len();
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for i in 0..tokens.len() {
        for (a, b) in got.row(i).iter().zip(&ours[i * vp..]) {
            num += (*a as f64 - *b as f64).powi(2);
            den += (*b as f64).powi(2);
        }
    }
    let e = (num / den).sqrt();
    // f32 both ways, chunked prefill against the token-by-token training forward.
    assert!(e < 1e-5, "engine logits vs the trainer's: rel L2 {e:e}");
}

#[test]
fn mimo_resume_equals_the_unbroken_run() {
    let dir = tempfile::tempdir().unwrap();
    let data = || Dataset::from_bytes(&text(), 5);
    let mut full = Trainer::with_data(run_config(4, 6, 2), CpuBackend, data()).unwrap();
    while full.progress.step < 6 {
        full.step().unwrap();
    }
    let mut first = Trainer::with_data(run_config(4, 6, 2), CpuBackend, data()).unwrap();
    while first.progress.step < 2 {
        first.step().unwrap();
    }
    first.save(dir.path()).unwrap();
    drop(first);
    let mut second = Trainer::resume(dir.path(), CpuBackend, Some(data())).unwrap();
    assert_eq!(second.progress.step, 2);
    assert!(second.params.layers[0].mimo.is_some());
    while second.progress.step < 6 {
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
}

/// The command line end to end: `mamba3 train --mimo-rank 2`, `--resume`, then
/// `mamba3 logits` on the checkpoint.
#[test]
fn mimo_train_resume_and_logits_commands() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d.txt");
    std::fs::write(&data, text()).unwrap();
    let out = tmp.path().join("run");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_mamba3"))
            .env_remove("MAMBA3_TIMELINE")
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "mamba3 {args:?}: {err}");
        err
    };
    let (d, o) = (data.to_str().unwrap(), out.to_str().unwrap());
    let log = run(&[
        "train",
        "--data",
        d,
        "--out",
        o,
        "--mimo-rank",
        "2",
        "--d-model",
        "32",
        "--n-layer",
        "1",
        "--d-state",
        "16",
        "--headdim",
        "16",
        "--chunk-size",
        "8",
        "--batch",
        "2",
        "--seq-len",
        "20",
        "--steps",
        "2",
        "--eval-windows",
        "2",
        "--threads",
        "1",
    ]);
    assert!(log.contains("MIMO rank 2"), "{log}");
    let log = run(&[
        "train",
        "--resume",
        "--out",
        o,
        "--steps",
        "3",
        "--threads",
        "1",
    ]);
    assert!(log.contains("from step 2"), "{log}");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["ssm_cfg"]["is_mimo"], true);
    assert_eq!(cfg["ssm_cfg"]["mimo_rank"], 2);
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("trainer.json")).unwrap()).unwrap();
    assert_eq!(t["progress"]["step"], 3);
    let logits = tmp.path().join("l.safetensors");
    run(&[
        "logits",
        "--model",
        o,
        "--input-ids",
        "[72, 101, 108, 108, 111]",
        "--out",
        logits.to_str().unwrap(),
    ]);
    let f = mamba3::model::tensor_file::TensorFile::open(&logits).unwrap();
    let l = f.get("logits").expect("a logits tensor");
    assert_eq!(l.shape[0], 5, "one row per input token");
}
