//! Helpers of the GPU tests (`tests/gpu_*.rs`), beside those all the integration tests
//! share (fixtures, goldens, error metrics: tests/common).
#![allow(dead_code)]

#[path = "../common/mod.rs"]
mod common;
#[allow(unused_imports)] // not every GPU test binary uses them
pub use common::*;

use mamba3::model::config::Config;

/// A synthetic SISO config for the random-config tests.
#[allow(clippy::too_many_arguments)]
pub fn config(
    d_model: usize,
    layers: usize,
    d_state: usize,
    headdim: usize,
    ngroups: usize,
    rope: f64,
    outnorm: bool,
    mlp: usize,
    chunk: usize,
) -> Config {
    let mut c = Config::synthetic(d_model, layers, d_state, headdim, 2, ngroups, 200);
    c.ssm_cfg.rope_fraction = rope;
    c.ssm_cfg.is_outproj_norm = outnorm;
    c.ssm_cfg.chunk_size = chunk;
    c.d_intermediate = mlp;
    c.tie_embeddings = mlp == 0;
    c
}

/// Deterministic pseudo-random tokens below `vocab`.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = mamba3::model::rng::Rng::new(seed);
    (0..n).map(|_| r.below(vocab as u64) as u32).collect()
}

/// `n` states, each after its own prompt.
pub fn primed(m: &mamba3::Model, n: usize) -> Vec<mamba3::State> {
    (0..n)
        .map(|i| {
            let mut s = m.new_state();
            let p = tokens(20 + 7 * i, m.dims().vocab_size, 300 + i as u64);
            m.prefill(&p, &mut s, mamba3::LogitsWant::None).unwrap();
            s
        })
        .collect()
}

/// Three decode steps of `states`, the rows `first …` of a batch (their tokens are those
/// rows'), eager or through the captured graphs: the logits of every step.
pub fn decode3_rows(
    m: &mamba3::Model,
    states: &mut [mamba3::State],
    graph: bool,
    first: usize,
) -> Vec<f32> {
    let mut out = Vec::new();
    let v = m.dims().vocab_size;
    for step in 0..3 {
        let toks: Vec<u32> = (first..first + states.len())
            .map(|b| ((b * 31 + step * 7) % v) as u32)
            .collect();
        let mut st: Vec<&mut mamba3::State> = states.iter_mut().collect();
        let lg = if graph {
            m.decode_graph(&toks, &mut st).unwrap()
        } else {
            m.decode_eager(&toks, &mut st).unwrap()
        };
        out.extend(lg.data);
    }
    out
}
