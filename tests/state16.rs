//! 16-bit SSM states (`--state-dtype bf16|f16`) on the CPU: every mixer's state after a
//! prefill is the f32 state rounded, decoding stays near the f32 state's logits, state
//! files keep the dtype and convert between dtypes, wrong dtypes are refused.
mod common;
use common::state16::{narrow_state_follows_f32, ssm_values};
use common::*;
use mamba3::mixers::family_synthetic::{mamba1, mamba2, mamba2_config};
use mamba3::mixers::mimo::{mimo_config_from_json_str, MimoWeights};
use mamba3::model::family_config::Mamba1Config;
use mamba3::model::state_layout::round_slice;
use mamba3::{DType, Device, LogitsWant, MixerWeights, Model};
use std::sync::Arc;

/// Relative L2 of the logits allowed between a 16-bit and the f32 state over 24 decode
/// steps after a 70-token prefill, on these small models (measured at most 5.8e-3 with
/// bf16, 6.3e-4 with f16: `-- --nocapture` prints them).
const TOL: f64 = 2e-2;

fn siso(name: &str) -> MixerWeights {
    MixerWeights::load(&fixture(name), DType::F32).unwrap()
}

fn family_models() -> Vec<(MixerWeights, String)> {
    let m1 = Mamba1Config {
        d_inner: 64,
        d_state: 16,
        d_conv: 4,
        dt_rank: 5,
        conv_bias: true,
        proj_bias: false,
        bcdt_rms_eps: None,
    };
    let mimo = r#"{"d_model": 32, "n_layer": 2, "vocab_size": 90, "d_intermediate": 0,
        "tie_embeddings": true, "ssm_cfg": {"layer": "Mamba3", "d_state": 32, "headdim": 16,
        "expand": 2, "ngroups": 1, "rope_fraction": 0.5, "is_outproj_norm": false,
        "chunk_size": 16, "is_mimo": true, "mimo_rank": 2}}"#;
    let mimo = mimo_config_from_json_str(mimo, "test").unwrap();
    vec![
        (
            MixerWeights::Mamba1(Arc::new(mamba1(m1, 32, 2, 90, 7))),
            "mamba1".into(),
        ),
        (
            MixerWeights::Mamba2(Arc::new(mamba2(mamba2_config(32, 16, 1, 32), 32, 2, 90, 8))),
            "mamba2".into(),
        ),
        (
            MixerWeights::Mimo(Arc::new(
                MimoWeights::synthetic(mimo, DType::F32, 9).unwrap(),
            )),
            "mimo".into(),
        ),
    ]
}

#[test]
fn every_mixer_with_a_16_bit_state_follows_the_f32_one() {
    let mut models: Vec<(MixerWeights, String)> = ["siso-tiny", "siso-mlp-norm"]
        .iter()
        .map(|n| (siso(n), n.to_string()))
        .collect();
    models.extend(family_models());
    for (w, what) in models {
        for state in [DType::BF16, DType::F16] {
            narrow_state_follows_f32(w.clone(), Device::Cpu, state, 0.0, TOL, &what);
        }
    }
}

/// A file of one state dtype loads into a model of another: widened exactly into f32,
/// rounded to nearest even into 16 bits. A file of another model is still refused.
#[test]
fn state_files_convert_between_state_dtypes() {
    let w = siso("siso-tiny");
    let vocab = w.lm_dims().vocab_size;
    let wide = Model::from_mixer_weights_with_state(w.clone(), Device::Cpu, DType::F32).unwrap();
    let prompt: Vec<u32> = (0..40).map(|t| ((t * 13 + 1) % vocab) as u32).collect();
    let mut s = wide.new_state();
    wide.prefill(&prompt, &mut s, LogitsWant::None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f32_file = dir.path().join("f32.safetensors");
    s.save(&f32_file).unwrap();
    for state in [DType::BF16, DType::F16] {
        let narrow = Model::from_mixer_weights_with_state(w.clone(), Device::Cpu, state).unwrap();
        // f32 file → 16-bit state: the ssm rounded, the rest as it was
        let loaded = narrow.load_state(&f32_file).unwrap();
        let mut want = ssm_values(&s);
        round_slice(state, &mut want);
        assert_eq!(ssm_values(&loaded), want, "{state}");
        assert_eq!(loaded.layout().state_dtype(), state);
        // 16-bit file → f32 state: the same values, widened
        let narrow_file = dir.path().join(format!("{state}.safetensors"));
        loaded.save(&narrow_file).unwrap();
        let widened = wide.load_state(&narrow_file).unwrap();
        assert_eq!(ssm_values(&widened), want, "{state}");
        assert_eq!(widened.layout().state_dtype(), DType::F32);
        // a state of the 16-bit model given to the f32 model is refused (not converted)
        let mut other = loaded.clone();
        let e = wide
            .decode(&[1], &mut [&mut other])
            .unwrap_err()
            .to_string();
        assert!(e.contains("another model"), "{e}");
    }
    // the model identity check stays
    let other = siso("siso-mlp-norm");
    let m = Model::from_mixer_weights_with_state(other, Device::Cpu, DType::BF16).unwrap();
    let e = m.load_state(&f32_file).unwrap_err().to_string();
    assert!(e.contains("belongs to another model"), "{e}");
}

#[test]
fn f64_states_are_refused() {
    let e = Model::from_mixer_weights_with_state(siso("siso-tiny"), Device::Cpu, DType::F64)
        .err()
        .expect("an f64 state is refused")
        .to_string();
    assert!(
        e.contains("--state-dtype f64") && e.contains("f32, bf16 or f16"),
        "{e}"
    );
}

fn mamba3(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_mamba3"))
        .args(args)
        .output()
        .unwrap()
}

/// `bench-state-drift` compares a 16-bit state with f32 (refusing f32 against itself), and
/// on a fixture reports every position compared; `generate --state-dtype` takes the three
/// dtypes and refuses others by name.
#[test]
fn state_dtype_flags() {
    let model = fixture("siso-tiny");
    let model = model.to_str().unwrap();
    let out = mamba3(&["bench-state-drift", "--model", model, "--tokens", "8"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--state-dtype bf16 or f16, found f32"),
        "{err}"
    );
    let args = [
        "bench-state-drift",
        "--model",
        model,
        "--tokens",
        "8",
        "--state-dtype",
        "bf16",
        "--json",
    ];
    let out = mamba3(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["positions"], 9);
    assert_eq!(j["state_dtype"], "bf16");
    let agree = j["greedy_agreement"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&agree), "{j}");
    let out = mamba3(&["bench-state-drift", "--model", model, "--state-dtype", "f8"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown dtype `f8`"), "{err}");
}
