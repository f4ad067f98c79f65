//! The Mamba-3 MIMO training path: its forward against the token-by-token oracle
//! (`MimoReference`) in f64, and every parameter tensor's gradient against central finite
//! differences in f64, on configs that exercise ranks 1, 2 and 4, ngroups > 1,
//! rope_fraction 1.0, the output norm, the MLP, tied and untied heads, the softplus A and
//! windows longer than one chunk whose length is not a multiple of it.
mod common;
use common::random_batch;

use mamba3::mixers::mimo::weights::validate_mimo;
use mamba3::mixers::mimo::{MimoReference, MimoWeights};
use mamba3::model::config::AActivation;
use mamba3::model::{Config, DType};
use mamba3::train::model::logits;
use mamba3::train::{loss_and_grad, Params};

struct Case {
    name: &'static str,
    rank: usize,
    ngroups: usize,
    rope: f64,
    outproj_norm: bool,
    d_intermediate: usize,
    tied: bool,
    softplus_a: bool,
}

const CASES: [Case; 4] = [
    Case {
        name: "R=1, G=1, rope 0.5, tied, no MLP",
        rank: 1,
        ngroups: 1,
        rope: 0.5,
        outproj_norm: false,
        d_intermediate: 0,
        tied: true,
        softplus_a: false,
    },
    Case {
        name: "R=2, G=2, rope 1.0, outproj norm, MLP, untied",
        rank: 2,
        ngroups: 2,
        rope: 1.0,
        outproj_norm: true,
        d_intermediate: 24,
        tied: false,
        softplus_a: false,
    },
    Case {
        name: "R=4, G=4 (one head per group), outproj norm, softplus A, tied",
        rank: 4,
        ngroups: 4,
        rope: 0.5,
        outproj_norm: true,
        d_intermediate: 0,
        tied: true,
        softplus_a: true,
    },
    Case {
        name: "R=4, G=1, rope 1.0, MLP, untied",
        rank: 4,
        ngroups: 1,
        rope: 1.0,
        outproj_norm: false,
        d_intermediate: 8,
        tied: false,
        softplus_a: false,
    },
];

fn config(c: &Case) -> Config {
    // d_model 16, expand 2 → d_inner 32, headdim 8 → 4 heads; d_state 8; chunk 4.
    let mut cfg = Config::synthetic(16, 2, 8, 8, 2, c.ngroups, 19);
    cfg.ssm_cfg.is_mimo = true;
    cfg.ssm_cfg.mimo_rank = c.rank;
    cfg.ssm_cfg.rope_fraction = c.rope;
    cfg.ssm_cfg.is_outproj_norm = c.outproj_norm;
    cfg.ssm_cfg.chunk_size = 4;
    cfg.d_intermediate = c.d_intermediate;
    cfg.tie_embeddings = c.tied;
    if c.softplus_a {
        cfg.ssm_cfg.a_activation = AActivation::Softplus;
    }
    validate_mimo(&cfg).unwrap();
    cfg
}

/// Relative L2 distance.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
fn training_forward_equals_the_mimo_reference() {
    for c in &CASES {
        let cfg = config(c);
        let w = MimoWeights::synthetic(cfg.clone(), DType::F32, 5).unwrap();
        let p: Params<f64> = Params::from_mimo_weights(&w);
        let b = random_batch(cfg.vocab_size, 2, 11, 9);
        let got = logits(&p, &b).unwrap();
        let oracle = MimoReference::<f64>::new(&w);
        let mut want = Vec::new();
        for seq in b.inputs.chunks(b.seq_len) {
            want.extend(oracle.forward(seq, &mut oracle.new_state()).unwrap());
        }
        assert_eq!(got.len(), want.len(), "{}", c.name);
        let e = rel(&got, &want);
        assert!(
            e < 1e-10,
            "{}: training logits vs MimoReference: {e:e}",
            c.name
        );
        // And the loss is the cross-entropy of those logits.
        let vp = w.dims.vocab_padded;
        let ce: f64 = want
            .chunks(vp)
            .zip(&b.targets)
            .map(|(l, &t)| {
                let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + l.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                lse - l[t as usize]
            })
            .sum::<f64>()
            / b.tokens() as f64;
        let loss = loss_and_grad(&p, &b, None).unwrap();
        assert!((loss - ce).abs() < 1e-12 * ce, "{}: {loss} vs {ce}", c.name);
    }
}

fn check(c: &Case) {
    let cfg = config(c);
    let w = MimoWeights::synthetic(cfg.clone(), DType::F32, 7).unwrap();
    let mut p: Params<f64> = Params::from_mimo_weights(&w);
    // Larger matrices than the official init so that every path carries signal (×1.5:
    // the synthetic MIMO `in_proj` is already doubled, so it ends ×3 as in SISO's checks;
    // more makes the loss so curved that central differences at h = 1e-5 are off by
    // 1e-5 of some gradients — the analytic value is their limit as h → 0).
    for t in p.tensors_mut() {
        if t.len() > 64 {
            t.iter_mut().for_each(|v| *v *= 1.5);
        }
    }
    let b = random_batch(cfg.vocab_size, 2, 11, 3); // 11 tokens, chunk 4: three chunks, one partial
    let mut g = Params::zeros(&cfg);
    let loss = loss_and_grad(&p, &b, Some(&mut g)).unwrap();
    assert!(loss.is_finite());
    let names: Vec<String> = p.tensors().into_iter().map(|(n, _)| n).collect();
    for want in [
        "mixer.mimo_x",
        "mixer.mimo_z",
        "mixer.mimo_o",
        "mixer.B_bias",
    ] {
        assert!(names.iter().any(|n| n.ends_with(want)), "{want} checked");
    }
    let worst = common::grad::check_against_finite_differences(c.name, &mut p, &g, &b);
    eprintln!("{}: loss {loss:.4}, worst relative error {worst:e}", c.name);
}

#[test]
fn mimo_gradients_match_finite_differences_rank1() {
    check(&CASES[0]);
}

#[test]
fn mimo_gradients_match_finite_differences_rank2_full() {
    check(&CASES[1]);
}

#[test]
fn mimo_gradients_match_finite_differences_rank4_groups_norm_softplus() {
    check(&CASES[2]);
}

#[test]
fn mimo_gradients_match_finite_differences_rank4_mlp_untied() {
    check(&CASES[3]);
}
