//! Bad input never panics and never corrupts state: each case gets a typed error that
//! names what was expected and what was found.
mod common;
use common::*;
use mamba3::mixers::mamba3::Weights;
use mamba3::model::tensor_file::{write_safetensors, RawTensor, TensorFile};
use mamba3::model::{Config, DType};
use mamba3::{Device, Error, LogitsWant, Model};
use std::path::Path;

fn copy_config(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
}

fn load_err(dir: &Path) -> Error {
    match Model::load(dir, Device::Cpu, DType::F32) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn truncated_checkpoints_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for file in ["model.safetensors", "pytorch_model.bin"] {
        let full = std::fs::read(fixture("siso-tiny").join(file)).unwrap();
        for cut in [0, 3, 8, 100, full.len() / 2, full.len() - 1] {
            let dir = tmp.path().join(format!("{file}-{cut}"));
            copy_config(&fixture("siso-tiny"), &dir);
            std::fs::write(dir.join(file), &full[..cut]).unwrap();
            let e = load_err(&dir);
            let msg = e.to_string();
            assert!(
                matches!(e, Error::Checkpoint { .. }),
                "{file} cut at {cut}: {msg}"
            );
            assert!(
                msg.contains(file),
                "{file} cut at {cut}: message does not name the file: {msg}"
            );
        }
    }
}

/// Write the fixture's tensors back with one change.
fn rewrite(dir: &Path, edit: impl Fn(&mut Vec<(String, RawTensor<'static>)>)) {
    copy_config(&fixture("siso-tiny"), dir);
    let f = TensorFile::open(&fixture("siso-tiny").join("model.safetensors")).unwrap();
    let mut tensors: Vec<(String, RawTensor<'static>)> = f
        .names()
        .into_iter()
        .map(|n| {
            let t = f.get(&n).unwrap();
            let data = t.to_float(&n, DType::F32).unwrap();
            (n, RawTensor::from_data(t.shape.clone(), &data))
        })
        .collect();
    edit(&mut tensors);
    write_safetensors(&dir.join("model.safetensors"), &tensors, None).unwrap();
}

#[test]
fn missing_tensor_wrong_shape_wrong_dtype_and_extra_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("missing");
    rewrite(&dir, |t| {
        t.retain(|(n, _)| n != "backbone.layers.1.mixer.D")
    });
    let e = load_err(&dir);
    assert!(matches!(e, Error::MissingTensor { .. }), "{e}");
    assert!(
        e.to_string().contains("backbone.layers.1.mixer.D") && e.to_string().contains("[8]"),
        "{e}"
    );

    let dir = tmp.path().join("shape");
    rewrite(&dir, |t| {
        for (n, r) in t.iter_mut() {
            if n == "backbone.layers.0.mixer.in_proj.weight" {
                r.shape = vec![r.shape[1], r.shape[0]];
            }
        }
    });
    let e = load_err(&dir);
    let msg = e.to_string();
    assert!(matches!(e, Error::Tensor { .. }), "{msg}");
    assert!(
        msg.contains("in_proj") && msg.contains("[352, 64]") && msg.contains("[64, 352]"),
        "{msg}"
    );

    let dir = tmp.path().join("dtype");
    rewrite(&dir, |t| {
        for (n, r) in t.iter_mut() {
            if n == "backbone.norm_f.weight" {
                *r = RawTensor::from_i64(vec![64], &[1; 64]);
            }
        }
    });
    let e = load_err(&dir);
    assert!(
        e.to_string().contains("norm_f") && e.to_string().contains("i64"),
        "{e}"
    );

    let dir = tmp.path().join("extra");
    rewrite(&dir, |t| {
        t.push((
            "backbone.layers.2.norm.weight".into(),
            RawTensor::from_f32(vec![64], &[1.0; 64]),
        ))
    });
    let e = load_err(&dir);
    assert!(
        e.to_string()
            .contains("unexpected tensor `backbone.layers.2.norm.weight`"),
        "{e}"
    );
}

#[test]
fn configs_we_cannot_run_name_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("siso-tiny").join("config.json")).unwrap(),
    )
    .unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "ssm_cfg.layer",
            Box::new(|c| c["ssm_cfg"]["layer"] = "Mamba7".into()),
        ),
        // Read as a Mamba-2 config, which has no such field.
        (
            "ssm_cfg.is_outproj_norm",
            Box::new(|c| c["ssm_cfg"]["layer"] = "Mamba2".into()),
        ),
        // Read as MIMO, whose rank-shaped biases the SISO file does not have.
        (
            "B_bias",
            Box::new(|c| c["ssm_cfg"]["is_mimo"] = true.into()),
        ),
        (
            "attn_layer_idx",
            Box::new(|c| c["attn_layer_idx"] = serde_json::json!([0])),
        ),
        ("rms_norm", Box::new(|c| c["rms_norm"] = false.into())),
        (
            "rope_fraction",
            Box::new(|c| c["ssm_cfg"]["rope_fraction"] = 0.25.into()),
        ),
        ("headdim", Box::new(|c| c["ssm_cfg"]["headdim"] = 48.into())),
        ("d_model", Box::new(|c| c["d_model"] = "wide".into())),
    ];
    for (field, edit) in cases {
        let dir = tmp.path().join(field);
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = base.clone();
        edit(&mut c);
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        std::fs::copy(
            fixture("siso-tiny").join("model.safetensors"),
            dir.join("model.safetensors"),
        )
        .unwrap();
        let e = load_err(&dir);
        assert!(e.to_string().contains(field), "{field}: {e}");
    }
    // A config that runs but does not match the checkpoint: a shape error, not a panic.
    let dir = tmp.path().join("mismatch");
    let mut c = base.clone();
    c["d_model"] = 32.into();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    std::fs::copy(
        fixture("siso-tiny").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    assert!(matches!(load_err(&dir), Error::Tensor { .. }));
    assert!(Model::load(&tmp.path().join("nowhere"), Device::Cpu, DType::F32).is_err());
}

#[test]
fn bad_tokens_and_empty_input_leave_the_state_untouched() {
    let m = Model::load(&fixture("siso-tiny"), Device::Cpu, DType::F32).unwrap();
    let mut st = m.new_state();
    m.prefill(&[1, 2, 3], &mut st, LogitsWant::None).unwrap();
    let before = st.to_host().unwrap();
    let e = m
        .prefill(&[5, 256, 7], &mut st, LogitsWant::All)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TokenOutOfRange {
                id: 256,
                pos: 1,
                vocab: 256
            }
        ),
        "{e}"
    );
    let e = m.decode(&[999], &mut [&mut st]).unwrap_err();
    assert!(
        e.to_string().contains("999") && e.to_string().contains("256"),
        "{e}"
    );
    let e = m.prefill(&[], &mut st, LogitsWant::All).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    let e = m.decode(&[1, 2], &mut [&mut st]).unwrap_err();
    assert!(e.to_string().contains("2 sequences but 1 states"), "{e}");
    let e = m.prefill_batch(&[], &mut [], LogitsWant::All).unwrap_err();
    assert!(e.to_string().contains("empty batch"), "{e}");
    assert_eq!(st.position(), 3);
    assert!(
        st.to_host().unwrap() == before,
        "a refused call changed the state"
    );
}

#[test]
fn states_of_another_model_are_refused() {
    let tiny = Model::load(&fixture("siso-tiny"), Device::Cpu, DType::F32).unwrap();
    let other = Model::load(&fixture("siso-mlp-norm"), Device::Cpu, DType::F32).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny.safetensors");
    let mut st = tiny.new_state();
    tiny.prefill(&[1, 2, 3], &mut st, LogitsWant::None).unwrap();
    st.save(&path).unwrap();
    let e = other.load_state(&path).unwrap_err();
    assert!(e.to_string().contains("belongs to another model"), "{e}");
    // Same shape, different weights: refused too.
    let cfg = Config::from_file(&fixture("siso-tiny").join("config.json")).unwrap();
    let twin =
        Model::from_weights(Weights::synthetic(cfg, DType::F32, 5).unwrap(), Device::Cpu).unwrap();
    let e = twin.load_state(&path).unwrap_err();
    assert!(e.to_string().contains("belongs to another model"), "{e}");
    // A state passed straight in, and a file that is not a state.
    let mut foreign = tiny.new_state();
    let e = other
        .prefill(&[1], &mut foreign, LogitsWant::All)
        .unwrap_err();
    assert!(e.to_string().contains("another model"), "{e}");
    let e = tiny
        .load_state(&fixture("siso-tiny").join("model.safetensors"))
        .unwrap_err();
    assert!(e.to_string().contains("not a mamba3 state file"), "{e}");
    // The same model in bf16 accepts it: a state belongs to parameters, not to a dtype.
    let bf = Model::load(
        &fixture("siso-tiny").join("pytorch_model.bin"),
        Device::Cpu,
        DType::BF16,
    )
    .unwrap();
    assert_eq!(bf.load_state(&path).unwrap().position(), 3);
}

#[test]
fn the_command_reports_errors_without_panicking() {
    let exe = env!("CARGO_BIN_EXE_mamba3");
    let tmp = tempfile::tempdir().unwrap();
    let ids = tmp.path().join("ids.json");
    let out = tmp.path().join("o.safetensors");
    let model = fixture("siso-tiny");
    let run = |args: &[&str], ids_text: &str| {
        std::fs::write(&ids, ids_text).unwrap();
        let o = std::process::Command::new(exe)
            .args(["logits", "--model"])
            .arg(&model)
            .arg("--input-ids")
            .arg(&ids)
            .arg("--out")
            .arg(&out)
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    for (args, text, needle) in [
        (vec![], "[1, 2, 300]", "300"),
        (vec![], "[]", "empty"),
        (vec![], "[1, \"a\"]", "expected an integer"),
        (vec![], "{not json", "not valid JSON"),
        (vec!["--windows", "5,3"], "[1,2,3,4,5,6]", "--windows"),
        (vec!["--decode-from", "9"], "[1,2,3]", "--decode-from"),
        (vec!["--dtype", "f8"], "[1]", "f8"),
        (vec!["--device", "tpu"], "[1]", "tpu"),
    ] {
        let (code, err) = run(&args, text);
        assert!(
            code == Some(1) || code == Some(2),
            "{args:?} {text}: exit {code:?} (101 = panic): {err}"
        );
        assert!(err.contains(needle), "{args:?} {text}: {err}");
    }
}
