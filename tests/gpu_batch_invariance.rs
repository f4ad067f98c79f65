//! Batch invariance on the GPU: a sequence's logits and state, bit for bit, whether it runs
//! alone or beside other sequences — in a decode step (eager and graph replay, batches of
//! 1 … 64, across the GEMV / cuBLASLt boundary) and in a packed prefill — for every mixer
//! and dtype. The CPU already keeps this promise (tests/properties.rs); this test is where
//! the GPU's side is shown (docs/performance.md, "Batch invariance on the GPU").
//!
//! By default the GPU keeps the promise only in part (docs/performance.md says where);
//! with `GpuOptions::batch_invariant` (`--batch-invariant`) it keeps it everywhere, which
//! these tests assert. Each case prints the largest difference it found in either mode. Run on the GPU machine:
//! `cargo test --release --test gpu_batch_invariance -- --include-ignored --nocapture`.
#![cfg(feature = "cuda")]

mod gpu;
use gpu::*;
use mamba3::engine::GpuOptions;
use mamba3::mixers::family_synthetic::{mamba1, mamba2, mamba2_config};
use mamba3::mixers::mamba3::Weights;
use mamba3::mixers::mimo::{mimo_config_from_json_str, MimoWeights};
use mamba3::mixers::MixerWeights;
use mamba3::model::family_config::Mamba1Config;
use mamba3::model::DType;
use mamba3::{Device, LogitsWant, Model, State};
use std::sync::Arc;

/// Batches that cross every decode path: the GEMV (≤ 16 rows), the fused step (≤ 8 / 16),
/// cuBLASLt (> 16), the graph buckets' padding.
const BATCHES: [usize; 6] = [1, 2, 8, 17, 33, 64];

/// The models: Mamba-3 SISO at a shape where cuBLASLt has choices, and each other mixer.
fn models() -> Vec<(String, MixerWeights)> {
    let mut v = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let cfg = config(256, 2, 64, 32, 1, 0.5, true, 0, 64);
        let w = Weights::synthetic(cfg, dtype, 5).unwrap();
        v.push((format!("siso {dtype}"), MixerWeights::Mamba3(Arc::new(w))));
        let c = Mamba1Config {
            d_inner: 512,
            d_state: 16,
            d_conv: 4,
            dt_rank: 16,
            conv_bias: true,
            proj_bias: false,
            bcdt_rms_eps: None,
        };
        let w = mamba1(c, 256, 2, 1000, 6);
        v.push((
            format!("mamba1 {dtype}"),
            MixerWeights::Mamba1(Arc::new(w.mixers_with_dtype(dtype))),
        ));
        let w = mamba2(mamba2_config(256, 64, 1, 64), 256, 2, 1000, 7);
        v.push((
            format!("mamba2 {dtype}"),
            MixerWeights::Mamba2(Arc::new(w.mixers_with_dtype(dtype))),
        ));
        let json = r#"{"d_model": 256, "n_layer": 2, "vocab_size": 1000, "d_intermediate": 0,
            "tie_embeddings": true, "ssm_cfg": {"layer": "Mamba3", "d_state": 64,
            "headdim": 32, "expand": 2, "ngroups": 1, "rope_fraction": 0.5,
            "is_outproj_norm": false, "chunk_size": 16, "is_mimo": true, "mimo_rank": 4}}"#;
        let cfg = mimo_config_from_json_str(json, "test").unwrap();
        let w = MimoWeights::synthetic(cfg, dtype, 8).unwrap();
        v.push((format!("mimo {dtype}"), MixerWeights::Mimo(Arc::new(w))));
    }
    v
}

/// Largest |a − b| and whether every value is the same bit pattern.
fn compare(a: &[f32], b: &[f32]) -> (f32, bool) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    (max, same)
}

fn prompt(m: &Model, n: usize, seed: u64) -> Vec<u32> {
    tokens(n, m.dims().vocab_size, seed)
}

/// Sequence 0's decode step alone and as row 0 of each batch (eager, then replayed from
/// a captured graph); returns the cases that were not bit-identical.
fn decode_cases(name: &str, m: &Model) -> Vec<String> {
    let mut failed = Vec::new();
    let mut s0 = m.new_state();
    m.prefill(&prompt(m, 37, 1), &mut s0, LogitsWant::None)
        .unwrap();
    let others: Vec<State> = (0..63)
        .map(|i| {
            let mut s = m.new_state();
            m.prefill(&prompt(m, 5 + i, 100 + i as u64), &mut s, LogitsWant::None)
                .unwrap();
            s
        })
        .collect();
    let step = |batch: usize, graph: bool| -> (Vec<f32>, Vec<f32>) {
        let mut states: Vec<State> = std::iter::once(s0.clone())
            .chain(others[..batch - 1].iter().cloned())
            .collect();
        let toks: Vec<u32> = (0..batch as u32).map(|i| 3 + i).collect();
        let mut refs: Vec<&mut State> = states.iter_mut().collect();
        let logits = if graph {
            m.decode_graph(&toks, &mut refs).unwrap()
        } else {
            m.decode_eager(&toks, &mut refs).unwrap()
        };
        (logits.row(0).to_vec(), states[0].to_host().unwrap().data)
    };
    let (alone, alone_state) = step(1, false);
    for graph in [false, true] {
        for &b in &BATCHES {
            if graph {
                m.capture_decode_graph(b).unwrap();
            }
            let (row, state) = step(b, graph);
            let (dl, sl) = compare(&alone, &row);
            let (ds, ss) = compare(&alone_state, &state);
            let how = if graph { "graph" } else { "eager" };
            println!(
                "{name}: decode {how} B={b}: logits {} (max |Δ| {dl:.3e}), state {} (max |Δ| {ds:.3e})",
                if sl { "identical" } else { "differ" },
                if ss { "identical" } else { "differ" },
            );
            if !(sl && ss) {
                failed.push(format!("{name} decode {how} B={b}"));
            }
        }
        m.clear_graphs().unwrap();
    }
    failed
}

/// Sequence 0's prefill alone and packed with sequences of other lengths (before and
/// after it in the batch), from a fresh and from a carried state.
fn prefill_cases(name: &str, m: &Model) -> Vec<String> {
    let mut failed = Vec::new();
    let p0 = prompt(m, 150, 2);
    let mut carried = m.new_state();
    m.prefill(&prompt(m, 21, 3), &mut carried, LogitsWant::None)
        .unwrap();
    for (start, from) in [(m.new_state(), "fresh"), (carried, "carried")] {
        let mut alone = start.clone();
        let la = m.prefill(&p0, &mut alone, LogitsWant::All).unwrap();
        let alone_state = alone.to_host().unwrap().data;
        for n_others in [1usize, 7] {
            let others: Vec<Vec<u32>> = (0..n_others)
                .map(|i| prompt(m, 40 + 61 * i, 200 + i as u64))
                .collect();
            for at in [0, n_others] {
                let mut seqs: Vec<&[u32]> = others.iter().map(|o| o.as_slice()).collect();
                seqs.insert(at, &p0);
                let mut states: Vec<State> = seqs.iter().map(|_| m.new_state()).collect();
                states[at] = start.clone();
                let mut refs: Vec<&mut State> = states.iter_mut().collect();
                let out = m.prefill_batch(&seqs, &mut refs, LogitsWant::All).unwrap();
                let (dl, sl) = compare(&la.data, &out[at].data);
                let (ds, ss) = compare(&alone_state, &states[at].to_host().unwrap().data);
                println!(
                    "{name}: prefill {from}, beside {n_others} at {at}: logits {} (max |Δ| {dl:.3e}), state {} (max |Δ| {ds:.3e})",
                    if sl { "identical" } else { "differ" },
                    if ss { "identical" } else { "differ" },
                );
                if !(sl && ss) {
                    failed.push(format!("{name} prefill {from} beside {n_others} at {at}"));
                }
            }
        }
    }
    failed
}

/// Each model in the default mode (printed: where the promise holds and by how much it
/// fails) and with `batch_invariant` (asserted: everywhere, bit for bit).
fn each_mode(case: fn(&str, &Model) -> Vec<String>) {
    let mut failed = Vec::new();
    for (name, w) in models() {
        let m = Model::from_mixer_weights(w, Device::Cuda(0)).unwrap();
        let default = case(&format!("{name} default"), &m);
        println!("{name} default: not invariant in {} cases", default.len());
        let o = m.gpu_options().unwrap().unwrap();
        m.set_gpu_options(GpuOptions {
            batch_invariant: true,
            ..o
        })
        .unwrap();
        failed.extend(case(&format!("{name} batch-invariant"), &m));
    }
    assert!(failed.is_empty(), "not batch-invariant: {failed:?}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_sequence_decodes_the_same_alone_or_in_any_batch() {
    each_mode(decode_cases);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_sequence_prefills_the_same_alone_or_packed() {
    each_mode(prefill_cases);
}
