//! The `convert`, `inspect` and `bench` commands, driven as a user would.
mod common;
use common::*;
use mamba3::mixers::mamba3::Weights;
use mamba3::model::DType;

fn mamba3(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_mamba3"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn convert_bin_to_safetensors_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let bin = fixture(name).join("pytorch_model.bin");
        let out = tmp.path().join(name);
        let o = mamba3(&[
            "convert",
            "--model",
            bin.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(out.join("config.json").is_file());
        let a = Weights::load(&bin, DType::F32).unwrap();
        let b = Weights::load(&out, DType::F32).unwrap();
        assert_eq!(a, b, "{name}: converted weights differ");
        // A bf16 conversion halves the matrices and loads as the same model.
        let half = out.join("bf16.safetensors");
        let o = mamba3(&[
            "convert",
            "--model",
            bin.to_str().unwrap(),
            "--out",
            half.to_str().unwrap(),
            "--dtype",
            "bf16",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let c = Weights::load(&half, DType::BF16).unwrap();
        assert_eq!(c.dims, a.dims);
        assert!(
            std::fs::metadata(&half).unwrap().len()
                < std::fs::metadata(out.join("model.safetensors"))
                    .unwrap()
                    .len()
        );
    }
    let o = mamba3(&[
        "convert",
        "--model",
        "/nonexistent",
        "--out",
        tmp.path().join("x").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent"));
}

#[test]
fn inspect_prints_the_model() {
    let o = mamba3(&[
        "inspect",
        "--model",
        fixture("siso-mlp-norm").to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "d_model 96",
        "layers 3",
        "heads 6×32",
        "d_state 64",
        "groups 2",
        "vocab 300 (padded 304)",
        "mlp hidden 256",
        "parameters",
        "MiB",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
    }
}

#[test]
fn bench_json_has_the_schema() {
    let o = mamba3(&[
        "bench",
        "--d-model",
        "32",
        "--layers",
        "2",
        "--d-state",
        "16",
        "--headdim",
        "8",
        "--prompt",
        "5,40",
        "--batch",
        "1,3",
        "--repeats",
        "1",
        "--decode-steps",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (j, (b, t)) in lines.iter().zip([(1, 5), (1, 40), (3, 5), (3, 40)]) {
        assert_eq!(j["device"], "cpu");
        assert_eq!(j["dtype"], "f32");
        assert_eq!(j["batch"], b);
        assert_eq!(j["prompt_len"], t);
        assert!(j["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(j["decode_ms_per_token"].as_f64().unwrap() > 0.0);
    }
}
