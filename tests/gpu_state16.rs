//! 16-bit SSM states (`--state-dtype bf16|f16`) on the GPU against the f32 state of the
//! same model: Mamba-3 SISO's kernels (the prefill scan, `mixer_step`, the fused decode,
//! CUDA graphs) and the scans of MIMO, Mamba-1 and Mamba-2. Run
//! on the GPU machine: `cargo test --release --features cuda --test gpu_state16 --
//! --include-ignored`.
#![cfg(feature = "cuda")]
mod gpu;
use gpu::state16::narrow_state_follows_f32;
use gpu::{primed, rel_l2, to_f64};
use mamba3::engine::GpuOptions;
use mamba3::mixers::family_synthetic::{mamba1, mamba2, mamba2_config};
use mamba3::mixers::mamba3::Weights;
use mamba3::mixers::mimo::{mimo_config_from_json_str, MimoWeights};
use mamba3::model::family_config::Mamba1Config;
use mamba3::{DType, Device, MixerWeights, Model, State};
use std::sync::Arc;

/// As tests/state16.rs (the CPU measured at most 5.8e-3 with bf16).
const TOL: f64 = 2e-2;

fn siso(cfg: mamba3::model::Config, dtype: DType, seed: u64) -> MixerWeights {
    MixerWeights::Mamba3(Arc::new(Weights::synthetic(cfg, dtype, seed).unwrap()))
}

/// The fixtures (f32 weights), a small model with an MLP and the output norm (bf16
/// weights: the fused decode), and the benchmark's head shape (d_state 128, headdim 64,
/// bf16: the decode step's prefetched rows): the prefill's final 16-bit state is the f32
/// one rounded (within one unit in the last place), decode and a continued window stay
/// within TOL of the f32 state's logits, host and file round trips are exact.
#[test]
#[ignore = "needs a CUDA device"]
fn siso_16_bit_states_follow_the_f32_state() {
    let mut models = vec![];
    for name in ["siso-tiny", "siso-mlp-norm"] {
        let w = MixerWeights::load(&gpu::fixture(name), DType::F32).unwrap();
        models.push((w, name.to_string()));
    }
    models.push((
        siso(
            gpu::config(128, 3, 64, 32, 2, 0.5, true, 128, 32),
            DType::BF16,
            11,
        ),
        "small bf16".into(),
    ));
    models.push((
        siso(
            gpu::config(256, 2, 128, 64, 1, 0.5, false, 0, 64),
            DType::BF16,
            12,
        ),
        "bench heads bf16".into(),
    ));
    for (w, what) in models {
        for state in [DType::BF16, DType::F16] {
            narrow_state_follows_f32(w.clone(), Device::Cuda(0), state, 1.0, TOL, &what);
        }
    }
}

fn narrow_model(dtype: DType, state: DType) -> Model {
    let w = siso(
        gpu::config(128, 3, 64, 32, 2, 0.5, true, 128, 32),
        dtype,
        11,
    );
    Model::from_mixer_weights_with_state(w, Device::Cuda(0), state).unwrap()
}

/// Three decode steps, eager or through the captured graphs: logits, then the states.
fn decode3(m: &Model, states: &mut [State], graph: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    let out = gpu::decode3_rows(m, states, graph, 0);
    let hosts = states.iter().map(|s| s.to_host().unwrap().data).collect();
    (out, hosts)
}

/// With a 16-bit state, a decode graph's replay is bit-identical to eager decode (logits
/// and states) for padded and exact buckets and a large batch, and the fused decode of
/// every layer is bit-identical to the launch per kernel.
#[test]
#[ignore = "needs a CUDA device"]
fn graphs_and_fused_decode_with_16_bit_states() {
    for (dtype, state) in [
        (DType::BF16, DType::BF16),
        (DType::BF16, DType::F16),
        (DType::F32, DType::BF16),
    ] {
        let m = narrow_model(dtype, state);
        for (bucket, batch) in [(4usize, 4usize), (4, 3), (16, 12), (64, 64)] {
            m.capture_decode_graph(bucket).unwrap();
            let base = primed(&m, batch);
            let eager = decode3(&m, &mut base.clone(), false);
            let graph = decode3(&m, &mut base.clone(), true);
            assert!(
                eager.0 == graph.0,
                "{dtype} state {state} bucket {bucket} batch {batch}: logits differ"
            );
            assert!(
                eager.1 == graph.1,
                "{dtype} state {state} bucket {bucket} batch {batch}: states differ"
            );
        }
        m.clear_graphs().unwrap();
        let o = m.gpu_options().unwrap().unwrap();
        for batch in [1usize, 8, 16] {
            let base = primed(&m, batch);
            let mut runs = vec![];
            for fused in [true, false] {
                m.set_gpu_options(GpuOptions {
                    fused_decode: fused,
                    ..o
                })
                .unwrap();
                runs.push(decode3(&m, &mut base.clone(), false));
            }
            assert!(
                runs[0] == runs[1],
                "{dtype} state {state} batch {batch}: fused decode differs"
            );
        }
        m.set_gpu_options(o).unwrap();
        println!("{dtype} weights, {state} state: graphs and fused decode bit-identical");
    }
}

/// Decode at batch 64 (the throughput case: GEMMs and `mixer_step`) with a 16-bit state
/// stays within TOL of the f32 state's logits over 16 steps.
#[test]
#[ignore = "needs a CUDA device"]
fn batch_64_decode_follows_the_f32_state() {
    for state in [DType::BF16, DType::F16] {
        let wide = narrow_model(DType::BF16, DType::F32);
        let narrow = narrow_model(DType::BF16, state);
        let (mut a, mut b) = (primed(&wide, 64), primed(&narrow, 64));
        let v = wide.dims().vocab_size;
        let mut worst = 0f64;
        for step in 0..16 {
            let toks: Vec<u32> = (0..64).map(|i| ((i * 13 + step * 5) % v) as u32).collect();
            let la = wide
                .decode(&toks, &mut a.iter_mut().collect::<Vec<_>>())
                .unwrap();
            let lb = narrow
                .decode(&toks, &mut b.iter_mut().collect::<Vec<_>>())
                .unwrap();
            let e = rel_l2(&to_f64(&lb.data), &to_f64(&la.data));
            assert!(e <= TOL, "state {state} step {step}: logits rel L2 {e:e}");
            worst = worst.max(e);
        }
        println!("batch 64, {state} state: logits within rel L2 {worst:.2e} of f32");
    }
}

/// MIMO, Mamba-1 and Mamba-2 (the CPU test's synthetic models, and the benchmark's MIMO
/// state and head sizes): the same checks as SISO's.
#[test]
#[ignore = "needs a CUDA device"]
fn family_16_bit_states_follow_the_f32_state() {
    let m1 = Mamba1Config {
        d_inner: 200,
        d_state: 16,
        d_conv: 4,
        dt_rank: 7,
        conv_bias: true,
        proj_bias: false,
        bcdt_rms_eps: None,
    };
    let mimo = |n: usize, p: usize, r: usize| {
        let json = format!(
            r#"{{"d_model": 64, "n_layer": 2, "vocab_size": 90, "d_intermediate": 0,
            "tie_embeddings": true, "ssm_cfg": {{"layer": "Mamba3", "d_state": {n},
            "headdim": {p}, "expand": 2, "ngroups": 1, "rope_fraction": 0.5,
            "is_outproj_norm": false, "chunk_size": 16, "is_mimo": true, "mimo_rank": {r}}}}}"#
        );
        let cfg = mimo_config_from_json_str(&json, "test").unwrap();
        MixerWeights::Mimo(Arc::new(
            MimoWeights::synthetic(cfg, DType::BF16, 9).unwrap(),
        ))
    };
    let models = [
        (
            MixerWeights::Mamba1(Arc::new(mamba1(m1, 100, 2, 90, 7))),
            "mamba1",
        ),
        (
            MixerWeights::Mamba2(Arc::new(mamba2(
                mamba2_config(64, 16, 2, 128),
                64,
                2,
                90,
                8,
            ))),
            "mamba2",
        ),
        (mimo(128, 64, 4), "mimo N128 P64 R4"),
        (mimo(32, 16, 2), "mimo N32 P16 R2"),
    ];
    for (w, what) in models {
        for state in [DType::BF16, DType::F16] {
            narrow_state_follows_f32(w.clone(), Device::Cuda(0), state, 1.0, TOL, what);
        }
    }
}
