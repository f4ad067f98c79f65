//! The official goldens through the public API: both fixtures, loaded from
//! model.safetensors and from pytorch_model.bin, in f32 and bf16 — full prefill, continued
//! windows split on and off chunk boundaries, decode from the prefix, and the states after
//! the prefix.
mod common;
use common::*;
use mamba3::{DType, Device, LogitsWant, Model};

const FORMATS: [&str; 2] = ["model.safetensors", "pytorch_model.bin"];

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        _ => 1e-2,
    }
}

/// States in f32 meet the logits' 1e-4. With bf16 weights the states of deep layers are
/// more sensitive than the logits: measured on siso-mlp-norm, layer 2's ssm state is off by
/// 5.3e-2 (its k by 3.8e-2, through the phase, a running sum of θ·Δ) while the logits are
/// at 7e-3 — and still 2.6e-2 with every in_proj kept in f32, so it is the bf16 rounding of
/// the earlier layers' outputs, amplified, not something an engine can avoid.
fn state_tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        _ => 6e-2,
    }
}

#[test]
fn goldens_through_the_engine() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let gold = g.logits.as_slice();
        let t = g.input_ids.len();
        for file in FORMATS {
            for dtype in [DType::F32, DType::BF16] {
                let m = Model::load(&fixture(name).join(file), Device::Cpu, dtype).unwrap();
                let tol = tol(dtype);
                let what = format!("{file} {dtype}");
                let chunk = m.mamba3().unwrap().dims.chunk_len;

                let mut st = m.new_state();
                let full = m.prefill(&g.input_ids, &mut st, LogitsWant::All).unwrap();
                let e = rel_l2(&to_f64(&full.data), gold);
                assert!(e <= tol, "{name} {what}: prefill rel L2 {e:e}");

                // Windows on and off chunk boundaries, and windows of length 1.
                for ends in [
                    vec![chunk, 2 * chunk, t],
                    vec![1, chunk + 1, chunk + 2, t - 1, t],
                    vec![g.prefix, t],
                    vec![3, 4, 5, chunk - 1, 2 * chunk + 5, t],
                ] {
                    let got = windows(&m, &g.input_ids, &ends);
                    let e = rel_l2(&to_f64(&got), gold);
                    assert!(e <= tol, "{name} {what}: windows {ends:?} rel L2 {e:e}");
                }

                // Prefill the prefix, check the states, decode the rest.
                let mut st = m.new_state();
                let mut got = m
                    .prefill(&g.input_ids[..g.prefix], &mut st, LogitsWant::All)
                    .unwrap()
                    .data;
                check_states(&g, &st, state_tol(dtype), &format!("{name} {what}"));
                for &tok in &g.input_ids[g.prefix..] {
                    got.extend(m.decode(&[tok], &mut [&mut st]).unwrap().data);
                }
                let e = rel_l2(&to_f64(&got), gold);
                assert!(e <= tol, "{name} {what}: decode-from-prefix rel L2 {e:e}");

                // Decoding every token from the start is the same function too.
                if dtype == DType::F32 && file == FORMATS[0] {
                    let mut st = m.new_state();
                    let got: Vec<f32> = g
                        .input_ids
                        .iter()
                        .flat_map(|&tok| m.decode(&[tok], &mut [&mut st]).unwrap().data)
                        .collect();
                    let e = rel_l2(&to_f64(&got), gold);
                    assert!(e <= tol, "{name}: decode-only rel L2 {e:e}");
                }
            }
        }
    }
}

#[test]
fn both_formats_give_the_same_model() {
    for name in FIXTURES {
        let a = mamba3::mixers::mamba3::Weights::load(&fixture(name).join(FORMATS[0]), DType::F32)
            .unwrap();
        let b = mamba3::mixers::mamba3::Weights::load(&fixture(name).join(FORMATS[1]), DType::F32)
            .unwrap();
        assert_eq!(a, b, "{name}: safetensors and .bin differ");
    }
}

/// The `mamba3 logits` command, as outside checks drive it.
#[test]
fn logits_command_matches_goldens() {
    let exe = env!("CARGO_BIN_EXE_mamba3");
    let dir = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let g = Golden::load(name);
        let gold = g.logits.as_slice();
        let json_ids = dir.path().join(format!("{name}.json"));
        std::fs::write(&json_ids, serde_json::to_string(&g.input_ids).unwrap()).unwrap();
        let st_ids = fixture(name).join("golden.safetensors");
        let p = g.prefix.to_string();
        let cases: Vec<(Vec<&str>, &std::path::Path)> = vec![
            (vec![], &st_ids),
            (vec!["--windows", "1,7,33,40"], &json_ids),
            (vec!["--decode-from", &p, "--states-after", &p], &st_ids),
            (vec!["--dtype", "bf16", "--windows", "16,17"], &json_ids),
        ];
        for (extra, ids) in cases {
            let out = dir.path().join("out.safetensors");
            let model_dir = fixture(name);
            let status = std::process::Command::new(exe)
                .args(["logits", "--model"])
                .arg(&model_dir)
                .arg("--input-ids")
                .arg(ids)
                .arg("--out")
                .arg(&out)
                .args(&extra)
                .output()
                .unwrap();
            assert!(
                status.status.success(),
                "{name} {extra:?}: {}",
                String::from_utf8_lossy(&status.stderr)
            );
            let f = mamba3::model::tensor_file::TensorFile::open(&out).unwrap();
            let lg = f.get("logits").unwrap();
            assert_eq!(lg.shape, vec![g.input_ids.len(), g.vocab_padded]);
            let got = lg.to_float("logits", DType::F64).unwrap().to_f64_vec();
            let tol = if extra.contains(&"bf16") { 1e-2 } else { 1e-4 };
            let e = rel_l2(&got, gold);
            assert!(e <= tol, "{name} {extra:?}: rel L2 {e:e}");
            if extra.contains(&"--states-after") {
                let read = |n: &str| {
                    f.get(n)
                        .unwrap()
                        .to_float(n, DType::F64)
                        .unwrap()
                        .to_f64_vec()
                };
                for l in 0..2 {
                    for field in ["ssm", "k", "v"] {
                        let n = format!("state.{l}.{field}");
                        assert!(rel_l2(&read(&n), &g.tensor(&n)) <= 1e-4, "{name} {n}");
                    }
                    let n = format!("state.{l}.angle");
                    assert!(
                        rel_l2_angles(&read(&n), &g.tensor(&n)) <= 1e-4,
                        "{name} {n}"
                    );
                }
            }
        }
    }
}
