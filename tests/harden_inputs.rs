//! Nothing silent, bounded work, small frictions: NaN weights and states are refused at
//! load naming the tensor, non-finite logits stop a generation naming the layer, error
//! texts say what the input is, absurd sizes fail fast under a memory cap, and the
//! command-line conveniences the help promises work.

mod serve_util;

use mamba3::engine::{Device, Model};
use mamba3::mixers::mamba3::Weights;
use mamba3::model::DType;
use mamba3::Error;
use serve_util::*;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};
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

/// Exit status 1 (an error, not a panic's 101 or a signal) with `needle` in the message.
fn refused(o: &Output, needle: &str) {
    assert_eq!(o.status.code(), Some(1), "{}", stderr(o));
    assert!(stderr(o).contains(needle), "{}", stderr(o));
}

/// The tiny test model with the byte tokenizer, its weights changed by `edit`.
fn edited_model(edit: impl FnOnce(&mut Weights)) -> tempfile::TempDir {
    let dir = model_dir(true, false);
    let mut w = Weights::load(dir.path(), DType::F32).unwrap();
    edit(&mut w);
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    w.save(dir.path()).unwrap();
    dir
}

fn as_str(d: &tempfile::TempDir) -> &str {
    d.path().to_str().unwrap()
}

#[test]
fn a_nan_weight_is_refused_at_load_naming_the_tensor() {
    let dir = edited_model(|w| w.layers[1].dt_bias[3] = f32::NAN);
    let e = Weights::load(dir.path(), DType::F32).unwrap_err();
    assert!(matches!(e, Error::NonFinite(_)), "{e}");
    let o = run(&["generate", "--model", as_str(&dir), "--prompt", "In"]);
    refused(&o, "backbone.layers.1.mixer.dt_bias");
    assert!(stderr(&o).contains("element 3"), "{}", stderr(&o));
    assert!(!o.stdout.contains(&0), "no NUL bytes printed");
    // An f32 value beyond f16's range is refused when the model is held in f16.
    let dir = edited_model(|w| {
        if let mamba3::model::TensorData::F32(v) = &mut w.layers[0].out_proj.data {
            v[0] = 1e6;
        }
    });
    Weights::load(dir.path(), DType::F32).unwrap();
    let e = Weights::load(dir.path(), DType::F16).unwrap_err();
    assert!(
        e.to_string()
            .contains("backbone.layers.0.mixer.out_proj.weight"),
        "{e}"
    );
}

#[test]
fn a_nan_in_a_state_file_is_refused_naming_the_tensor() {
    let dir = model_dir(true, false);
    let model = Model::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    let mut st = model.new_state();
    model
        .prefill(&[1, 2, 3], &mut st, mamba3::LogitsWant::None)
        .unwrap();
    let p = dir.path().join("s.safetensors");
    st.save(&p).unwrap();
    // The data's last 4 bytes are the last tensor's last value: make it a NaN.
    let mut b = std::fs::read(&p).unwrap();
    let n = b.len();
    b[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&p, b).unwrap();
    let e = model.load_state(&p).unwrap_err();
    assert!(matches!(e, Error::NonFinite(_)), "{e}");
    assert!(e.to_string().contains("state.1.v"), "{e}");
}

#[test]
fn non_finite_logits_stop_the_generation_naming_the_layer() {
    // Finite weights (they pass the load check) so large that layer 0 overflows.
    let dir = edited_model(|w| {
        let m = &mut w.layers[0].in_proj;
        m.data = mamba3::model::TensorData::F32(vec![1e30; m.rows * m.cols]);
    });
    let o = run(&[
        "generate",
        "--model",
        as_str(&dir),
        "--prompt",
        "In the",
        "--max-tokens",
        "5",
    ]);
    refused(&o, "NaN or infinite");
    assert!(stderr(&o).contains("layer"), "{}", stderr(&o));
    assert!(!o.stdout.contains(&0), "no NUL bytes printed");
    // The server fails that request with an error, and keeps serving.
    let h = start(mamba3::text::ModelSource::Dir(dir.path().into()), |_| {});
    let r = mamba3::serve::client::post_json(
        h.addr,
        "/v1/completions",
        &serde_json::json!({"prompt": "In the", "max_tokens": 3}),
    )
    .unwrap();
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(r.text().contains("NaN or infinite"), "{}", r.text());
    assert_eq!(
        mamba3::serve::client::get(h.addr, "/health")
            .unwrap()
            .status,
        200
    );
}

#[test]
fn max_tokens_0_saves_the_prompts_state() {
    let dir = model_dir(true, false);
    let st = dir.path().join("s.safetensors");
    let o = run(&[
        "generate",
        "--model",
        as_str(&dir),
        "--prompt",
        "In the beginning",
        "--max-tokens",
        "0",
        "--save-state",
        st.to_str().unwrap(),
        "--no-echo",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "",
        "nothing generated"
    );
    let tok = mamba3::text::Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let n = tok.encode("In the beginning", true).unwrap().len() as u64;
    let model = Model::load(dir.path(), Device::Cpu, DType::F32).unwrap();
    assert_eq!(model.load_state(&st).unwrap().position(), n);
}

#[test]
fn error_texts_say_what_the_input_is() {
    let dir = model_dir(true, false);
    let o = run(&[
        "generate",
        "--model",
        as_str(&dir),
        "--input-ids",
        "[1, -5]",
    ]);
    refused(&o, "token id -5 at position 1");
    // A .bin that is not a zip.
    let bad = tempfile::tempdir().unwrap();
    std::fs::copy(
        dir.path().join("config.json"),
        bad.path().join("config.json"),
    )
    .unwrap();
    std::fs::write(bad.path().join("pytorch_model.bin"), b"hello, not a zip").unwrap();
    let e = Weights::load(bad.path(), DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a zip archive"), "{e}");
    assert!(!e.contains("safetensors"), "{e}");
    // Configs that are not configs.
    for (text, found) in [("[]", "an array"), ("{}", "an empty object")] {
        std::fs::write(dir.path().join("config.json"), text).unwrap();
        let e = Weights::load(dir.path(), DType::F32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a model config") && e.contains(found), "{e}");
    }
}

/// Run under an address-space cap of `gib` GiB: an allocation past it fails at once.
fn capped(args: &[&str], gib: u64) -> Output {
    let mut c = bin();
    // Few malloc arenas: their address-space reservations (64 MiB each, up to 8 per core)
    // would otherwise fill the cap on a machine with many cores.
    c.args(args).env("MALLOC_ARENA_MAX", "2");
    unsafe {
        c.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: gib << 30,
                rlim_max: gib << 30,
            };
            libc::setrlimit(libc::RLIMIT_AS, &r);
            Ok(())
        });
    }
    c.output().unwrap()
}

#[test]
fn absurd_sizes_fail_fast_under_a_memory_cap() {
    let dir = model_dir(true, false);
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["n_layer"] = serde_json::json!(10_000_000);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let t = Instant::now();
    let o = capped(&["generate", "--model", as_str(&dir), "--prompt", "a"], 2);
    refused(&o, "n_layer 10000000");
    assert!(t.elapsed() < Duration::from_secs(30));

    // 100,000 threads asked: capped at the cores, and the command finishes.
    let dir = model_dir(true, false);
    let t = Instant::now();
    let o = capped(
        &[
            "generate",
            "--model",
            as_str(&dir),
            "--prompt",
            "a",
            "--max-tokens",
            "2",
            "--threads",
            "100000",
        ],
        4,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("more than the"), "{}", stderr(&o));
    assert!(t.elapsed() < Duration::from_secs(60));
}

fn data_file(dir: &Path) -> String {
    let p = dir.join("d.txt");
    std::fs::write(&p, "abc ".repeat(3000)).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn training_numbers_are_checked_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data_file(tmp.path());
    let out = tmp.path().join("o");
    let o = out.to_str().unwrap();
    let base = [
        "train",
        "--data",
        &data,
        "--out",
        o,
        "--d-model",
        "32",
        "--n-layer",
        "1",
    ];
    for (extra, needle) in [
        (&["--batch", "0"][..], "--batch 0"),
        (&["--lr", "nan"][..], "--lr NaN"),
        (&["--lr", "0"][..], "--lr 0"),
        (&["--lr=-1"][..], "--lr -1"),
        (&["--lr", "inf"][..], "--lr inf"),
        (&["--mimo-rank", "0"][..], "--mimo-rank 0"),
        (&["--mimo-rank", "65"][..], "--mimo-rank 65"),
    ] {
        let o = run(&[&base[..], extra].concat());
        refused(&o, needle);
    }
    assert!(!out.exists(), "nothing was written");
    let o = run(&[
        "bench-train",
        "--batch",
        "0",
        "--d-model",
        "32",
        "--layers",
        "1",
    ]);
    refused(&o, "--batch 0");
}

#[test]
fn generate_echoes_the_prompt_and_takes_inline_ids() {
    let dir = model_dir(true, false);
    let args = [
        "generate",
        "--model",
        as_str(&dir),
        "--prompt",
        "In the beginning",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
    ];
    let with = run(&args);
    assert!(with.status.success(), "{}", stderr(&with));
    let without = run(&[&args[..], &["--no-echo"]].concat());
    let (w, wo) = (
        String::from_utf8_lossy(&with.stdout).into_owned(),
        String::from_utf8_lossy(&without.stdout).into_owned(),
    );
    assert_eq!(w, format!("In the beginning{wo}"));
    let o = run(&[
        "generate",
        "--model",
        as_str(&dir),
        "--input-ids",
        "[264, 73, 110]",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "--print-ids",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = engine_greedy(&load(dir.path()), &[264, 73, 110], 3, &[]);
    let got: Vec<u32> = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(got, want);
}

#[test]
fn resume_reads_the_data_given() {
    let tmp = tempfile::tempdir().unwrap();
    let a = data_file(tmp.path());
    let b = tmp.path().join("other.txt");
    std::fs::write(&b, "xyz ".repeat(3000)).unwrap();
    let out = tmp.path().join("run");
    let o = out.to_str().unwrap();
    let common = [
        "--d-model",
        "32",
        "--n-layer",
        "1",
        "--d-state",
        "16",
        "--headdim",
        "16",
        "--batch",
        "2",
        "--seq-len",
        "16",
        "--eval-windows",
        "2",
        "--threads",
        "1",
    ];
    let r = run(&[
        &["train", "--data", &a, "--out", o, "--steps", "2"][..],
        &common,
    ]
    .concat());
    assert!(r.status.success(), "{}", stderr(&r));
    let r = run(&[
        "train",
        "--resume",
        "--out",
        o,
        "--steps",
        "4",
        "--data",
        b.to_str().unwrap(),
        "--threads",
        "1",
    ]);
    assert!(r.status.success(), "{}", stderr(&r));
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("trainer.json")).unwrap()).unwrap();
    assert_eq!(t["run"]["data"], serde_json::json!([b.to_str().unwrap()]));
    assert_eq!(t["progress"]["step"], 4);
}

/// The cost of the load-time non-finite scan, printed (run by hand:
/// `cargo test --release --test harden_inputs -- --ignored --nocapture`): the scan's
/// throughput, and its share of loading an 85M-parameter checkpoint.
#[test]
#[ignore]
fn non_finite_scan_cost() {
    use mamba3::model::finite::first_non_finite;
    use mamba3::model::TensorData;
    let n = 64 << 20;
    let f32s = TensorData::F32((0..n).map(|i| (i % 1000) as f32 * 1e-3).collect());
    let bf16s = f32s.convert(DType::BF16);
    for (what, d) in [("f32", &f32s), ("bf16", &bf16s)] {
        let t = Instant::now();
        assert!(first_non_finite(d).is_none());
        let s = t.elapsed().as_secs_f64();
        let bytes = d.len() * d.dtype().size();
        println!(
            "scan {what}: {} MiB in {:.1} ms = {:.1} GB/s",
            bytes >> 20,
            s * 1e3,
            bytes as f64 / s / 1e9
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = mamba3::model::Config::synthetic(1024, 8, 64, 64, 2, 1, 32000);
    let w = Weights::synthetic(cfg, DType::F32, 1).unwrap();
    w.save(dir.path()).unwrap();
    let params = w.param_count();
    drop(w);
    let t = Instant::now();
    let w = Weights::load(dir.path(), DType::F32).unwrap();
    let load = t.elapsed().as_secs_f64();
    // The scan of the same tensors, timed alone (the load above includes it).
    let mut scan = 0.0;
    for (name, raw) in w.to_tensors() {
        let d = raw.to_float(&name, DType::F32).unwrap();
        let t0 = Instant::now();
        assert!(first_non_finite(&d).is_none());
        scan += t0.elapsed().as_secs_f64();
    }
    println!(
        "load of {params} parameters (f32, warm page cache): {:.1} ms, of which the scan \
         {:.1} ms ({:.1} %)",
        load * 1e3,
        scan * 1e3,
        100.0 * scan / load
    );
}
