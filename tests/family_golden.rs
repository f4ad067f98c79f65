//! The official Mamba-1, Mamba-2 and Mamba-3 MIMO goldens (`../shared/fixtures/m1-tiny`,
//! `m2-tiny`, `mimo-tiny`, `mimo-mlp-norm`) through the engine, as a user loads them: every
//! file layout (official safetensors and `.bin`; transformers' `hf/` for Mamba-1/2), f32
//! and bf16 weights — full prefill, continued windows, the states after the prefix (every
//! tensor of the mixer's state layout against the golden tensor of the same name), decode
//! from the prefix, a packed batch against each sequence alone, and a saved state loaded
//! back — and through the `mamba3 logits` command.
mod common;
use common::family::goldens_through_the_engine;
use common::*;
use mamba3::{DType, Device, LogitsWant, MixerKind, Model};
use std::path::PathBuf;

/// (fixture, its model folders, its mixer)
fn models() -> Vec<(&'static str, Vec<PathBuf>, MixerKind)> {
    let m12 = |n: &str| {
        vec![
            fixture(n),
            fixture(n).join("pytorch_model.bin"),
            fixture(n).join("hf"),
        ]
    };
    let mimo = |n: &str| vec![fixture(n), fixture(n).join("pytorch_model.bin")];
    vec![
        ("m1-tiny", m12("m1-tiny"), MixerKind::Mamba1),
        ("m2-tiny", m12("m2-tiny"), MixerKind::Mamba2),
        ("mimo-tiny", mimo("mimo-tiny"), MixerKind::Mamba3Mimo),
        (
            "mimo-mlp-norm",
            mimo("mimo-mlp-norm"),
            MixerKind::Mamba3Mimo,
        ),
    ]
}

#[test]
fn family_goldens_through_the_engine() {
    for (name, folders, kind) in models() {
        goldens_through_the_engine(name, &folders, kind, Device::Cpu);
    }
}

#[test]
fn states_of_one_family_are_refused_by_another() {
    let m1 = Model::load(&fixture("m1-tiny"), Device::Cpu, DType::F32).unwrap();
    let m2 = Model::load(&fixture("m2-tiny"), Device::Cpu, DType::F32).unwrap();
    let mimo = Model::load(&fixture("mimo-tiny"), Device::Cpu, DType::F32).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for (a, b) in [(&m1, &m2), (&m2, &mimo), (&mimo, &m1)] {
        let mut st = a.new_state();
        a.prefill(&[1, 2, 3], &mut st, LogitsWant::None).unwrap();
        let e = b.prefill(&[4], &mut st, LogitsWant::Last).unwrap_err();
        assert!(e.to_string().contains("another model"), "{e}");
        let file = tmp.path().join("s.safetensors");
        st.save(&file).unwrap();
        assert!(b.load_state(&file).is_err());
    }
    // The same weights in the official and transformers layouts are one model.
    let hf = Model::load(&fixture("m1-tiny").join("hf"), Device::Cpu, DType::F32).unwrap();
    assert_eq!(hf.fingerprint(), m1.fingerprint());
    // Out-of-range tokens are errors that leave the state alone.
    let mut st = m2.new_state();
    m2.prefill(&[1, 2], &mut st, LogitsWant::None).unwrap();
    let before = st.to_host().unwrap();
    let e = m2
        .prefill(&[3, 100_000], &mut st, LogitsWant::All)
        .unwrap_err();
    assert!(e.to_string().contains("100000"), "{e}");
    assert_eq!(st.to_host().unwrap(), before);
    assert_eq!(st.position(), 2);
}

/// `mamba3 logits` on every family fixture and layout: full, windows, decode from the
/// prefix with the states written after it.
#[test]
fn logits_command_matches_family_goldens() {
    let exe = env!("CARGO_BIN_EXE_mamba3");
    let dir = tempfile::tempdir().unwrap();
    for (name, folders, _) in models() {
        let g = Golden::load(name);
        let ids = fixture(name).join("golden.safetensors");
        let p = g.prefix.to_string();
        for folder in &folders {
            for extra in [
                vec!["--windows", "1,7,33,40,100"],
                vec!["--decode-from", &p, "--states-after", &p],
                vec!["--dtype", "bf16"],
            ] {
                let what = format!("{name} {} {extra:?}", folder.display());
                let out = dir.path().join("out.safetensors");
                let run = std::process::Command::new(exe)
                    .args(["logits", "--model"])
                    .arg(folder)
                    .arg("--input-ids")
                    .arg(&ids)
                    .arg("--out")
                    .arg(&out)
                    .args(&extra)
                    .output()
                    .unwrap();
                assert!(
                    run.status.success(),
                    "{what}: {}",
                    String::from_utf8_lossy(&run.stderr)
                );
                let f = mamba3::model::tensor_file::TensorFile::open(&out).unwrap();
                let read = |n: &str| {
                    let t = f.get(n).unwrap_or_else(|| panic!("{what}: no {n}"));
                    t.to_float(n, DType::F64).unwrap().to_f64_vec()
                };
                let tol = if extra.contains(&"bf16") { 1e-2 } else { 1e-5 };
                let e = rel_l2(&read("logits"), &g.logits);
                assert!(e <= tol, "{what}: logits rel L2 {e:e}");
                if extra.contains(&"--states-after") {
                    for l in 0..2 {
                        for field in ["conv", "ssm", "k", "v", "angle"] {
                            let n = format!("state.{l}.{field}");
                            if f.get(&n).is_none() {
                                continue;
                            }
                            let e = if field == "angle" {
                                rel_l2_angles(&read(&n), &g.tensor(&n))
                            } else {
                                rel_l2(&read(&n), &g.tensor(&n))
                            };
                            assert!(e <= 1e-5, "{what}: {n} rel L2 {e:e}");
                        }
                        let n = format!("state.{l}.ssm");
                        assert!(f.get(&n).is_some(), "{what}: no {n}");
                    }
                }
            }
        }
    }
}

/// `mamba3 convert` repacks any family's folder (a `.bin`, a transformers folder) into one
/// `model.safetensors` beside its config; the result loads as the same model, or, converted
/// to bf16, meets the bf16 tolerance. `mamba3 inspect` names the mixer.
#[test]
fn convert_and_inspect_take_every_family() {
    let exe = env!("CARGO_BIN_EXE_mamba3");
    let dir = tempfile::tempdir().unwrap();
    for (i, (name, src, dtype)) in [
        (
            "m1-tiny",
            fixture("m1-tiny").join("pytorch_model.bin"),
            None,
        ),
        ("m2-tiny", fixture("m2-tiny").join("hf"), Some("bf16")),
        (
            "mimo-tiny",
            fixture("mimo-tiny").join("pytorch_model.bin"),
            None,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let out = dir.path().join(format!("out{i}"));
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["convert", "--model"])
            .arg(&src)
            .arg("--out")
            .arg(&out);
        if let Some(d) = dtype {
            cmd.args(["--dtype", d]);
        }
        let run = cmd.output().unwrap();
        assert!(
            run.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert!(out.join("model.safetensors").is_file() && out.join("config.json").is_file());
        let a = Model::load(&out, Device::Cpu, DType::F32).unwrap();
        let g = Golden::load(name);
        let mut st = a.new_state();
        let got = a.prefill(&g.input_ids, &mut st, LogitsWant::All).unwrap();
        let e = rel_l2(&to_f64(&got.data), &g.logits);
        let tol = if dtype.is_some() { 1e-2 } else { 1e-5 };
        assert!(e <= tol, "{name} converted: rel L2 {e:e}");
        if dtype.is_none() {
            let b = Model::load(&src, Device::Cpu, DType::F32).unwrap();
            assert_eq!(a.fingerprint(), b.fingerprint(), "{name}");
        }
        let run = std::process::Command::new(exe)
            .args(["inspect", "--model"])
            .arg(&out)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&run.stdout);
        assert!(
            run.status.success() && text.contains("mixer"),
            "{name}: {text}"
        );
        assert!(text.contains(a.kind().name()), "{name}: {text}");
    }
}

/// `mamba3 random-model` writes an official folder that loads as the model it describes,
/// and refuses to overwrite one.
#[test]
fn random_model_writes_a_loadable_official_folder() {
    let exe = env!("CARGO_BIN_EXE_mamba3");
    let dir = tempfile::tempdir().unwrap();
    for (family, kind) in [("mamba1", MixerKind::Mamba1), ("mamba2", MixerKind::Mamba2)] {
        let out = dir.path().join(family);
        let args = [
            "random-model",
            "--family",
            family,
            "--d-model",
            "64",
            "--layers",
            "2",
            "--headdim",
            "16",
            "--vocab",
            "300",
            "--out",
        ];
        let run = std::process::Command::new(exe)
            .args(args)
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let m = Model::load(&out, Device::Cpu, DType::F32).unwrap();
        assert_eq!(
            (m.kind(), m.dims().d_model, m.dims().vocab_size),
            (kind, 64, 300)
        );
        let mut st = m.new_state();
        let lg = m.prefill(&[1, 2, 299], &mut st, LogitsWant::Last).unwrap();
        assert!(lg.data.iter().all(|v| v.is_finite()));
        let again = std::process::Command::new(exe)
            .args(args)
            .arg(&out)
            .output()
            .unwrap();
        assert!(!again.status.success());
        assert!(String::from_utf8_lossy(&again.stderr).contains("refusing to overwrite"));
    }
}

/// A Mamba-1/2 checkpoint holding a NaN or an infinity is refused at load, naming the
/// tensor, as a Mamba-3 one is.
#[test]
fn non_finite_family_weights_are_refused() {
    use mamba3::mixers::family::FamilyWeights;
    use mamba3::mixers::family_synthetic::{official_config, synthetic};
    use mamba3::model::TensorData;
    let dir = tempfile::tempdir().unwrap();
    for layer in ["Mamba1", "Mamba2"] {
        let cfg = official_config(layer, 32, 2, 64, 16, 16).unwrap();
        let json = format!(
            r#"{{"d_model": 32, "n_layer": 2, "vocab_size": 64, "ssm_cfg": {{"layer": "{layer}",
               "d_state": 16{}}}}}"#,
            if layer == "Mamba2" {
                r#", "headdim": 16"#
            } else {
                ""
            }
        );
        let w = match synthetic(&cfg, DType::F32, 3) {
            FamilyWeights::Mamba1(mut w) => {
                let TensorData::F32(v) = &mut w.layers[1].mixer.out_proj.data else {
                    panic!("f32")
                };
                v[5] = f32::NAN;
                mamba3::MixerWeights::Mamba1(std::sync::Arc::new(w))
            }
            FamilyWeights::Mamba2(mut w) => {
                w.layers[0].mixer.a_log[2] = f32::INFINITY;
                mamba3::MixerWeights::Mamba2(std::sync::Arc::new(w))
            }
        };
        let out = dir.path().join(layer);
        let e = w.save_official(&out, &json).unwrap_err().to_string();
        let name = if layer == "Mamba1" {
            "backbone.layers.1.mixer.out_proj.weight"
        } else {
            "backbone.layers.0.mixer.A_log"
        };
        assert!(e.contains(name) && e.contains("finite"), "{layer}: {e}");
        assert!(Model::load(&out, Device::Cpu, DType::F32).is_err());
    }
}
