//! 16-bit SSM states (`--state-dtype bf16|f16`) against the f32 state of the same model on
//! one device: the CPU tests (`tests/state16.rs`) and the GPU ones (`tests/gpu_state16.rs`)
//! share it.
use super::*;
use mamba3::model::state_layout::round_slice;
use mamba3::{DType, Device, LogitsWant, MixerWeights, Model, State};

/// The `ssm` values of every layer of a state, in order.
pub fn ssm_values(s: &State) -> Vec<f32> {
    let l = s.layout();
    let i = l.tensors.iter().position(|t| t.name == "ssm").unwrap();
    let (off, len) = (l.offset_in_layer(i), l.tensors[i].len());
    let host = s.to_host().unwrap();
    (0..l.n_layer)
        .flat_map(|k| host.layer(k)[off..off + len].to_vec())
        .collect()
}

/// `weights` on `device` with an f32 state and with a `state` one:
/// - a prefill of 70 tokens (several scan chunks) leaves in the 16-bit state the f32
///   state's `ssm` rounded, within `ulps` units in the last place of the 16-bit dtype (0 on
///   the CPU, where the two runs do the same arithmetic; on a GPU the passes may group
///   sums differently), and the other tensors within `tol` relative L2;
/// - 24 decode steps fed the same tokens keep the logits within `tol` relative L2 of the
///   f32 state's, step by step, and so does a continued window of 40 tokens after them
///   (a prefill that reads the 16-bit state); the state dtype is what was asked;
/// - a 16-bit state brought to the host and placed back is unchanged, and so is a state
///   saved to a file and loaded back; the file holds `ssm` in the 16-bit dtype.
pub fn narrow_state_follows_f32(
    weights: MixerWeights,
    device: Device,
    state: DType,
    ulps: f32,
    tol: f64,
    what: &str,
) {
    let vocab = weights.lm_dims().vocab_size;
    let wide = Model::from_mixer_weights_with_state(weights.clone(), device, DType::F32).unwrap();
    let narrow = Model::from_mixer_weights_with_state(weights, device, state).unwrap();
    assert_eq!(
        (wide.state_dtype(), narrow.state_dtype()),
        (DType::F32, state)
    );
    let prompt: Vec<u32> = (0..70).map(|t| ((t * 31 + 7) % vocab) as u32).collect();
    let (mut sw, mut sn) = (wide.new_state(), narrow.new_state());
    wide.prefill(&prompt, &mut sw, LogitsWant::Last).unwrap();
    narrow.prefill(&prompt, &mut sn, LogitsWant::Last).unwrap();
    // the ssm after the prefill: the f32 one rounded
    let (w, n) = (ssm_values(&sw), ssm_values(&sn));
    let mut rounded = w.clone();
    round_slice(state, &mut rounded);
    let eps = match state {
        DType::BF16 => 2f32.powi(-7),
        _ => 2f32.powi(-10),
    };
    for (i, (a, b)) in n.iter().zip(&rounded).enumerate() {
        let ulp = eps * b.abs().max(a.abs()).max(f32::MIN_POSITIVE);
        assert!(
            (a - b).abs() <= ulps * ulp,
            "{what} {state}: ssm[{i}] {a} against the f32 state rounded {b} (f32 {})",
            w[i]
        );
    }
    let (hw, hn) = (sw.to_host().unwrap(), sn.to_host().unwrap());
    let e = rel_l2(&to_f64(&hn.data), &to_f64(&hw.data));
    assert!(
        e <= tol,
        "{what} {state}: state after the prefill, rel L2 {e:e}"
    );
    // decode
    let mut worst = 0f64;
    for step in 0..24 {
        let t = ((step * 17 + 3) % vocab) as u32;
        let lw = wide.decode(&[t], &mut [&mut sw]).unwrap();
        let ln = narrow.decode(&[t], &mut [&mut sn]).unwrap();
        let e = rel_l2(&to_f64(&ln.data), &to_f64(&lw.data));
        assert!(
            e <= tol,
            "{what} {state}: decode step {step}, logits rel L2 {e:e}"
        );
        worst = worst.max(e);
    }
    println!("{what} {state}: decode logits within rel L2 {worst:.2e} of the f32 state's");
    // a continued window: the prefill reads the 16-bit state it starts from
    let more: Vec<u32> = (0..40).map(|t| ((t * 11 + 5) % vocab) as u32).collect();
    let lw = wide.prefill(&more, &mut sw, LogitsWant::Last).unwrap();
    let ln = narrow.prefill(&more, &mut sn, LogitsWant::Last).unwrap();
    let e = rel_l2(&to_f64(&ln.data), &to_f64(&lw.data));
    assert!(
        e <= tol,
        "{what} {state}: continued window, logits rel L2 {e:e}"
    );
    // host round trip and file round trip are exact
    let before = sn.to_host().unwrap();
    let mut moved = sn.clone();
    narrow.place(&mut moved).unwrap();
    assert_eq!(
        moved.to_host().unwrap(),
        before,
        "{what} {state}: placed again"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");
    sn.save(&path).unwrap();
    let file = mamba3::model::tensor_file::TensorFile::open(&path).unwrap();
    let raw = file.get("state.0.ssm").unwrap();
    assert_eq!(
        raw.dtype,
        mamba3::model::raw_tensor::DiskDType::Float(state),
        "{what}: the file's ssm dtype"
    );
    assert_eq!(file.metadata()["state_dtype"], state.name());
    let back = narrow.load_state(&path).unwrap();
    assert_eq!(
        back.to_host().unwrap(),
        before,
        "{what} {state}: loaded back"
    );
    assert_eq!(back.position(), sn.position());
    // the loaded state decodes as the one it was saved from
    let (mut a, mut b) = (back, sn);
    let la = narrow.decode(&[5], &mut [&mut a]).unwrap();
    let lb = narrow.decode(&[5], &mut [&mut b]).unwrap();
    assert_eq!(la, lb, "{what} {state}: decode from the loaded state");
}
