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
