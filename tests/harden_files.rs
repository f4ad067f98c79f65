//! Nothing lost: commands refuse to overwrite a model or a run, bad output paths fail
//! before the work, and a `kill -9` at any moment of a checkpoint or state write leaves a
//! complete file (the old or the new) from which `--resume` continues.

mod serve_util;

use mamba3::engine::{Device, Model};
use mamba3::mixers::mamba3::Weights;
use mamba3::model::{Config, DType};
use serve_util::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mamba3"));
    c.env_remove("MAMBA3_TIMELINE");
    c
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run mamba3")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn refused(o: &Output, needle: &str) {
    assert_eq!(o.status.code(), Some(1), "{}", stderr(o));
    assert!(stderr(o).contains(needle), "{}", stderr(o));
}

fn text_file(dir: &Path) -> PathBuf {
    let p = dir.join("data.txt");
    let line = "In the beginning God created the heaven and the earth. ";
    std::fs::write(&p, line.repeat(400)).unwrap();
    p
}

/// A tiny training run's arguments.
fn train_args<'a>(data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--data",
        data,
        "--out",
        out,
        "--d-model",
        "32",
        "--n-layer",
        "1",
        "--d-state",
        "16",
        "--headdim",
        "16",
        "--steps",
        steps,
        "--batch",
        "2",
        "--seq-len",
        "16",
        "--eval-every",
        "1000",
        "--eval-windows",
        "2",
        "--ckpt-every",
        "1",
        "--warmup",
        "1",
        "--threads",
        "1",
    ]
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn train_out_onto_a_model_or_a_run_needs_resume_or_force() {
    let tmp = tempfile::tempdir().unwrap();
    let data = text_file(tmp.path());
    let model = model_dir(true, false);
    let before = snapshot(model.path());
    let (d, m) = (data.to_str().unwrap(), model.path().to_str().unwrap());
    let o = run(&train_args(d, m, "2"));
    refused(&o, "--resume");
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(snapshot(model.path()), before, "the model is untouched");
    // A run's folder likewise; --force replaces it.
    let out = tmp.path().join("run");
    let o = run(&train_args(d, out.to_str().unwrap(), "2"));
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&train_args(d, out.to_str().unwrap(), "2"));
    refused(&o, "already holds");
    let mut forced = train_args(d, out.to_str().unwrap(), "3");
    forced.push("--force");
    let o = run(&forced);
    assert!(o.status.success(), "{}", stderr(&o));
    // Written files follow the umask (0666 less it), as any program's.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
    let umask = u32::from_str_radix(line["Umask:".len()..].trim(), 8).unwrap();
    use std::os::unix::fs::PermissionsExt;
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer.json",
        "config.json",
    ] {
        let mode = std::fs::metadata(out.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask, "{f}");
    }
}

#[test]
fn outputs_never_overwrite_a_models_files() {
    let model = model_dir(true, false);
    let before = snapshot(model.path());
    let m = model.path().to_str().unwrap();
    let weights = model.path().join("model.safetensors");
    let o = run(&[
        "logits",
        "--model",
        m,
        "--input-ids",
        "[1, 2]",
        "--out",
        weights.to_str().unwrap(),
    ]);
    refused(&o, "refusing to overwrite");
    let cfg = model.path().join("config.json");
    let o = run(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "a",
        "--save-state",
        cfg.to_str().unwrap(),
    ]);
    refused(&o, "refusing to overwrite");
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/siso-tiny");
    let o = run(&["convert", "--model", fixture.to_str().unwrap(), "--out", m]);
    refused(&o, "refusing to overwrite");
    let o = run(&[
        "convert",
        "--model",
        fixture.to_str().unwrap(),
        "--out",
        weights.to_str().unwrap(),
    ]);
    refused(&o, "refusing to overwrite");
    assert_eq!(snapshot(model.path()), before, "the model is untouched");
}

#[test]
fn a_bad_save_state_path_fails_before_the_generation() {
    let model = model_dir(true, false);
    let t = Instant::now();
    let o = run(&[
        "generate",
        "--model",
        model.path().to_str().unwrap(),
        "--prompt",
        "a",
        "--max-tokens",
        "1000000",
        "--save-state",
        "/nonexistent/folder/s.safetensors",
    ]);
    refused(&o, "does not exist");
    assert!(o.stdout.is_empty(), "nothing was generated");
    assert!(t.elapsed() < Duration::from_secs(30));
}

/// Kill `cmd` with SIGKILL after `after`, or let it finish first; whether it was killed.
fn kill_after(cmd: &mut Command, after: Duration) -> bool {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while t.elapsed() < after {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    true
}

/// A small deterministic sequence of delays (ms) in `lo..hi`.
fn delays(n: usize, lo: u64, hi: u64, seed: u64) -> Vec<Duration> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            Duration::from_millis(lo + x % (hi - lo))
        })
        .collect()
}

#[test]
fn kill_9_during_checkpoints_then_resume_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let data = text_file(tmp.path());
    let out = tmp.path().join("run");
    let (d, o) = (data.to_str().unwrap(), out.to_str().unwrap());
    for (i, wait) in delays(8, 100, 900, 7).into_iter().enumerate() {
        // Until a first checkpoint exists the run starts afresh; then it resumes.
        let started = out.join("trainer.json").exists();
        let mut args = train_args(d, o, "100000");
        if started {
            args = vec!["train", "--out", o, "--resume", "--threads", "1"];
        } else {
            args.push("--force");
        }
        kill_after(bin().args(&args), wait);
        // A temporary file left behind means the kill landed inside a write.
        let torn = std::fs::read_dir(&out).map_or(0, |d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
                .count()
        });
        println!("kill {i} after {wait:?}: {torn} write(s) interrupted");
        if !out.join("trainer.json").exists() {
            continue;
        }
        // Every file of the checkpoint is whole: the weights and optimiser state load.
        Weights::load(&out, DType::F32).unwrap_or_else(|e| panic!("kill {i}: {e}"));
        mamba3::model::tensor_file::TensorFile::open(&out.join("optimizer.safetensors"))
            .unwrap_or_else(|e| panic!("kill {i}: {e}"));
        let t: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("trainer.json")).unwrap()).unwrap();
        assert!(t["progress"]["step"].as_u64().is_some(), "kill {i}: {t}");
    }
    let step = |out: &Path| {
        let t: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("trainer.json")).unwrap()).unwrap();
        t["progress"]["step"].as_u64().unwrap()
    };
    let at = step(&out);
    let target = (at + 3).to_string();
    let r = run(&[
        "train",
        "--out",
        o,
        "--resume",
        "--steps",
        &target,
        "--threads",
        "1",
    ]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(step(&out), at + 3, "the resumed run reached its target");
    // No temporary files are left behind.
    for e in std::fs::read_dir(&out).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(!n.contains(".tmp-"), "left behind: {n}");
    }
}

#[test]
fn kill_9_during_state_writes_leaves_the_old_state_or_the_new() {
    // A model whose state is a few MB, so that its write takes a while.
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::synthetic(256, 4, 128, 32, 2, 1, 269);
    Weights::synthetic(cfg, DType::F32, 1)
        .unwrap()
        .save(dir.path())
        .unwrap();
    std::fs::copy(
        fixtures().join("byte-tokenizer/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let model = Model::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    let st = dir.path().join("s.safetensors");
    let m = dir.path().to_str().unwrap();
    let gen = |prompt: &str| {
        let mut c = bin();
        c.args([
            "generate",
            "--model",
            m,
            "--prompt",
            prompt,
            "--max-tokens",
            "0",
        ]);
        c.args(["--save-state", st.to_str().unwrap(), "--threads", "1"]);
        c
    };
    assert!(gen("old").output().unwrap().status.success());
    let old = model.load_state(&st).unwrap().position();
    // Finish one uninterrupted run to learn how long a whole one takes.
    let t = Instant::now();
    assert!(gen("a new longer prompt")
        .output()
        .unwrap()
        .status
        .success());
    let whole = t.elapsed().as_millis() as u64 + 1;
    let new = model.load_state(&st).unwrap().position();
    assert_ne!(old, new);
    let mut killed = 0;
    for (i, wait) in delays(16, whole / 3, whole + 2, 11).into_iter().enumerate() {
        // Alternate which text is written, so a torn write would mix them.
        let prompt = if i % 2 == 0 {
            "old"
        } else {
            "a new longer prompt"
        };
        killed += kill_after(&mut gen(prompt), wait) as usize;
        let pos = model
            .load_state(&st)
            .unwrap_or_else(|e| panic!("after kill {i}: {e}"))
            .position();
        assert!(pos == old || pos == new, "after kill {i}: position {pos}");
    }
    assert!(killed > 0, "no run was killed");
}
