//! Mamba-1, Mamba-2 and Mamba-3 MIMO on the GPU: the official goldens (`m1-tiny`,
//! `m2-tiny` from official and transformers folders, `mimo-tiny`, `mimo-mlp-norm`;
//! f32/f16/bf16) through the engine on `cuda:0`, and the GPU against the CPU on random
//! configs of every option (FalconMamba's norms, biases, conv widths, groups, the gated-MLP
//! branch, per-channel D, Δ clamps, the norm's placement; MIMO ranks 1–8, groups, rope
//! fractions, the output norm, GatedMLP blocks), with sequences long enough for several
//! scan chunks, packed batches, windows and batched decode. Run on the GPU machine: `cargo test --release --test gpu_family --
//! --include-ignored`.
#![cfg(feature = "cuda")]
mod common;
use common::family::goldens_through_the_engine;
use common::*;
use mamba3::mixers::family_synthetic::{mamba1, mamba2, mamba2_config, Gen};
use mamba3::mixers::mimo::{mimo_config_from_json_str, MimoWeights};
use mamba3::mixers::MixerWeights;
use mamba3::model::family_config::{Mamba1Config, Mamba2Config};
use mamba3::{DType, Device, LogitsWant, MixerKind, Model, State};
use std::sync::Arc;

#[test]
#[ignore = "needs a CUDA device"]
fn family_goldens_on_the_gpu() {
    for (name, kind) in [
        ("m1-tiny", MixerKind::Mamba1),
        ("m2-tiny", MixerKind::Mamba2),
    ] {
        let folders = [
            fixture(name),
            fixture(name).join("pytorch_model.bin"),
            fixture(name).join("hf"),
        ];
        goldens_through_the_engine(name, &folders, kind, Device::Cuda(0));
    }
    for name in ["mimo-tiny", "mimo-mlp-norm"] {
        let folders = [fixture(name), fixture(name).join("pytorch_model.bin")];
        goldens_through_the_engine(name, &folders, MixerKind::Mamba3Mimo, Device::Cuda(0));
    }
}

fn m1_configs() -> Vec<(Mamba1Config, usize)> {
    let c = |d_inner, d_state, d_conv, dt_rank, conv_bias, proj_bias, eps| Mamba1Config {
        d_inner,
        d_state,
        d_conv,
        dt_rank,
        conv_bias,
        proj_bias,
        bcdt_rms_eps: eps,
    };
    vec![
        // the real state size, channels not a multiple of the scan's block
        (c(200, 16, 4, 7, true, false, None), 100),
        // FalconMamba's norms, biases, no conv bias, K = 2
        (c(64, 16, 2, 5, false, true, Some(1e-6)), 32),
        // K larger than some windows, a small state
        (c(48, 4, 5, 1, true, true, None), 16),
    ]
}

fn m2_configs() -> Vec<(Mamba2Config, usize)> {
    let base = mamba2_config;
    let mut v = vec![
        // the real state size (slices of 32 summed across 4 lanes), 2 groups
        (base(64, 16, 2, 128), 64),
        // the real head size too (a block of 256 threads a head)
        (base(128, 64, 1, 128), 128),
        // an odd state size held whole by one thread
        (base(32, 8, 1, 24), 32),
        // 8 groups of 2 heads (Codestral's grouping)
        (base(128, 16, 8, 32), 128),
        // the largest head the chunked scan's tiles hold
        (base(128, 128, 1, 64), 128),
    ];
    // gated-MLP branch, D per channel, biases, no conv bias, a real Δ clamp, K = 3, 3 groups
    let mut c = base(24, 4, 3, 6);
    c.d_ssm = 36;
    c.nheads = 9;
    c.d_has_hdim = true;
    c.proj_bias = true;
    c.conv_bias = false;
    c.dt_limit = (0.02, 0.4);
    c.d_conv = 3;
    v.push((c, 24));
    // the norm before the gate (state 64: slices of 32, 2 lanes); and no norm at all
    let mut c = base(16, 8, 2, 64);
    c.norm_before_gate = true;
    v.push((c, 16));
    let mut c = base(16, 4, 1, 5);
    c.rmsnorm = false;
    v.push((c, 16));
    v
}

/// The same calls on the CPU and on the GPU model; every output within `tol` relative L2.
fn gpu_equals_cpu(weights: MixerWeights, what: &str, tol: f64) {
    let cpu = Model::from_mixer_weights(weights.clone(), Device::Cpu).unwrap();
    let gpu = Model::from_mixer_weights(weights, Device::Cuda(0)).unwrap();
    let vocab = cpu.dims().vocab_size;
    let mut g = Gen::new(7);
    // Several chunks of the scans (64 and 128 rows; Mamba-2's in tiles of 32 or 64 rows, the
    // last one short), a one-token sequence, a short one: a packed pass of sequences of
    // one and of several chunks.
    let seqs: Vec<Vec<u32>> = [300usize, 1, 77]
        .iter()
        .map(|&n| g.tokens(n, vocab))
        .collect();
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let run = |m: &Model| -> (Vec<f32>, Vec<State>) {
        let mut states: Vec<State> = refs.iter().map(|_| m.new_state()).collect();
        let mut st: Vec<&mut State> = states.iter_mut().collect();
        let mut out: Vec<f32> = m
            .prefill_batch(&refs, &mut st, LogitsWant::All)
            .unwrap()
            .into_iter()
            .flat_map(|l| l.data)
            .collect();
        for step in 0..3u32 {
            let toks: Vec<u32> = (0..refs.len() as u32)
                .map(|i| (i * 13 + step * 5 + 1) % vocab as u32)
                .collect();
            let mut st: Vec<&mut State> = states.iter_mut().collect();
            out.extend(m.decode(&toks, &mut st).unwrap().data);
        }
        (out, states)
    };
    let (want, cpu_states) = run(&cpu);
    let (got, gpu_states) = run(&gpu);
    let e = rel_l2(&to_f64(&got), &to_f64(&want));
    eprintln!("{what}: GPU vs CPU rel L2 {e:.2e}");
    assert!(e <= tol, "{what}: logits rel L2 {e:e}");
    // Tensor by tensor (angles modulo 2π, as the goldens are compared). With 16-bit
    // weights the states are held as gpu_engine holds Mamba-3 SISO's against the CPU
    // engine's, within 3e-2: the two engines round the GEMM inputs differently, and a
    // state sums those differences over every token (MIMO's angles over 300 tokens
    // measured 1.7e-2 while the logits stayed at 5.7e-3).
    let state_tol = if tol < 1e-4 { tol } else { 3e-2 };
    for (i, (a, b)) in gpu_states.iter().zip(&cpu_states).enumerate() {
        for (name, e) in state_errors(a, b) {
            assert!(e <= state_tol, "{what}: sequence {i}'s {name} rel L2 {e:e}");
        }
    }
    // A captured decode graph (a bucket larger than the batch) equals the eager step, and
    // leaves the same states.
    let mut eager_states = gpu_states.clone();
    let mut graph_states = gpu_states.clone();
    gpu.capture_decode_graph(4).unwrap();
    let toks = [3u32, 4, 5];
    let eager = gpu
        .decode_eager(&toks, &mut eager_states.iter_mut().collect::<Vec<_>>())
        .unwrap();
    let graph = gpu
        .decode_graph(&toks, &mut graph_states.iter_mut().collect::<Vec<_>>())
        .unwrap();
    let e = rel_l2(&to_f64(&graph.data), &to_f64(&eager.data));
    assert!(e <= 1e-6, "{what}: graph vs eager decode rel L2 {e:e}");
    for (a, b) in graph_states.iter().zip(&eager_states) {
        let (a, b) = (a.to_host().unwrap(), b.to_host().unwrap());
        let e = rel_l2(&to_f64(&a.data), &to_f64(&b.data));
        assert!(e <= 1e-6, "{what}: graph vs eager state rel L2 {e:e}");
    }
    // Windows of the long sequence, split inside and across chunks, equal one pass (the
    // windows of one and three tokens take Mamba-2's recurrent scan and MIMO's fused step,
    // the others their chunked scans, each from the state the other left; the window of 9
    // rows is one chunk, which the chunked scans run straight from the carried state).
    let mut st = gpu.new_state();
    let mut win = Vec::new();
    let mut start = 0;
    for end in [1, 4, 130, 131, 140, 300] {
        win.extend(
            gpu.prefill(&seqs[0][start..end], &mut st, LogitsWant::All)
                .unwrap()
                .data,
        );
        start = end;
    }
    let vp = cpu.dims().vocab_padded;
    let e = rel_l2(&to_f64(&win), &to_f64(&want[..300 * vp]));
    assert!(e <= tol, "{what}: windows rel L2 {e:e}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_equals_cpu_on_random_mamba1_configs() {
    for (i, (c, dm)) in m1_configs().into_iter().enumerate() {
        let w = mamba1(c.clone(), dm, 2, 90, 30 + i as u64);
        for dtype in [DType::F32, DType::BF16] {
            let w = MixerWeights::Mamba1(Arc::new(w.clone().mixers_with_dtype(dtype)));
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            gpu_equals_cpu(w, &format!("mamba1 {i} {dtype} {c:?}"), tol);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_equals_cpu_on_random_mamba2_configs() {
    for (i, (c, dm)) in m2_configs().into_iter().enumerate() {
        let w = mamba2(c.clone(), dm, 2, 90, 40 + i as u64);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let w = MixerWeights::Mamba2(Arc::new(w.clone().mixers_with_dtype(dtype)));
            let tol = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 5e-3,
                _ => 1e-2,
            };
            gpu_equals_cpu(w, &format!("mamba2 {i} {dtype} {c:?}"), tol);
        }
    }
}

/// MIMO configs: (d_model, d_state, headdim, ngroups, rank, rope_fraction, outproj norm,
/// d_intermediate, A's activation).
fn mimo_configs() -> Vec<String> {
    let c = |dm: usize,
             n: usize,
             p: usize,
             g: usize,
             r: usize,
             rope: f64,
             norm: bool,
             mlp: usize,
             softplus: bool| {
        let act = if softplus {
            r#", "a_activation": "softplus""#
        } else {
            ""
        };
        format!(
            r#"{{"d_model": {dm}, "n_layer": 2, "vocab_size": 90, "d_intermediate": {mlp},
                "tie_embeddings": {tie}, "ssm_cfg": {{"layer": "Mamba3", "d_state": {n},
                "headdim": {p}, "expand": 2, "ngroups": {g}, "rope_fraction": {rope},
                "is_outproj_norm": {norm}, "chunk_size": 16, "is_mimo": true,
                "mimo_rank": {r}{act}}}}}"#,
            tie = mlp == 0
        )
    };
    vec![
        // the benchmark's state and head sizes at rank 4, half the state rotated
        c(64, 128, 64, 1, 4, 0.5, false, 0, false),
        // rank 1, 2 groups of 2 heads, every pair rotated, the output norm
        c(64, 32, 16, 2, 1, 1.0, true, 0, false),
        // rank 2 with a GatedMLP, 4 groups, state 16 (lanes of 8)
        c(48, 16, 8, 4, 2, 0.5, true, 96, false),
        // rank 8, state 64, A by softplus
        c(32, 64, 16, 1, 8, 0.5, false, 0, true),
        // rank 8 in 2 groups of 4 heads (f32 tiles of 4 tokens, 16-bit of 8), all rotated
        c(64, 64, 16, 2, 8, 1.0, true, 0, false),
        // rank 3, which does not divide the scan's tiles (their last pseudo-rows are
        // padding), 2 groups, headdim 32
        c(64, 32, 32, 2, 3, 0.5, false, 0, false),
    ]
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_equals_cpu_on_random_mimo_configs() {
    for (i, json) in mimo_configs().into_iter().enumerate() {
        let cfg = mimo_config_from_json_str(&json, "test").unwrap();
        // f16 (the scan's f16 tiles of 64 pseudo-rows) for the benchmark's sizes and for
        // rank 8 in groups; bf16 and f32 for every config
        let f16 = [0, 4].contains(&i);
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        for dtype in dtypes.into_iter().filter(|&d| d != DType::F16 || f16) {
            let w = MimoWeights::synthetic(cfg.clone(), dtype, 60 + i as u64).unwrap();
            let tol = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 5e-3,
                _ => 1e-2,
            };
            gpu_equals_cpu(
                MixerWeights::Mimo(Arc::new(w)),
                &format!("mimo {i} {dtype} {json}"),
                tol,
            );
        }
    }
}
