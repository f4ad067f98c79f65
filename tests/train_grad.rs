//! Gradient checks: the analytical backward of the training forward against central
//! finite differences in f64, for every parameter tensor, on configs that exercise
//! ngroups > 1, rope_fraction 1.0, the output norm, the MLP, tied and untied heads,
//! the softplus A, and windows longer than one chunk.
mod common;
use common::random_batch;

use mamba3::mixers::mamba3::Weights;
use mamba3::model::{Config, DType};
use mamba3::train::{loss_and_grad, Params};

struct Case {
    name: &'static str,
    ngroups: usize,
    rope: f64,
    outproj_norm: bool,
    d_intermediate: usize,
    tied: bool,
    softplus_a: bool,
}

fn config(c: &Case) -> Config {
    // d_model 16, expand 2 → d_inner 32, headdim 8 → 4 heads; d_state 8; chunk 4.
    let mut cfg = Config::synthetic(16, 2, 8, 8, 2, c.ngroups, 19);
    cfg.ssm_cfg.rope_fraction = c.rope;
    cfg.ssm_cfg.is_outproj_norm = c.outproj_norm;
    cfg.ssm_cfg.chunk_size = 4;
    cfg.d_intermediate = c.d_intermediate;
    cfg.tie_embeddings = c.tied;
    if c.softplus_a {
        cfg.ssm_cfg.a_activation = mamba3::model::config::AActivation::Softplus;
    }
    cfg.validate().unwrap();
    cfg
}

fn check(c: &Case) {
    let cfg = config(c);
    let w = Weights::synthetic(cfg.clone(), DType::F32, 7).unwrap();
    let mut p: Params<f64> = Params::from_weights(&w);
    // Larger matrices than the official init so that every path carries signal.
    for t in p.tensors_mut() {
        if t.len() > 64 {
            t.iter_mut().for_each(|v| *v *= 3.0);
        }
    }
    let b = random_batch(cfg.vocab_size, 2, 11, 3); // 11 tokens, chunk 4: three chunks, one partial
    let mut g = Params::zeros(&cfg);
    let loss = loss_and_grad(&p, &b, Some(&mut g)).unwrap();
    assert!(loss.is_finite());
    let worst = common::grad::check_against_finite_differences(c.name, &mut p, &g, &b);
    eprintln!("{}: loss {loss:.4}, worst relative error {worst:e}", c.name);
}

#[test]
fn gradients_match_finite_differences_plain() {
    check(&Case {
        name: "plain (G=1, rope 0.5, tied, no MLP)",
        ngroups: 1,
        rope: 0.5,
        outproj_norm: false,
        d_intermediate: 0,
        tied: true,
        softplus_a: false,
    });
}

#[test]
fn gradients_match_finite_differences_full() {
    check(&Case {
        name: "full (G=2, rope 1.0, outproj norm, MLP, untied)",
        ngroups: 2,
        rope: 1.0,
        outproj_norm: true,
        d_intermediate: 24,
        tied: false,
        softplus_a: false,
    });
}

#[test]
fn gradients_match_finite_differences_softplus_a() {
    check(&Case {
        name: "softplus A, G=4 (one head per group), MLP, tied",
        ngroups: 4,
        rope: 0.5,
        outproj_norm: false,
        d_intermediate: 8,
        tied: true,
        softplus_a: true,
    });
}
