//! The fast Mamba-1 prefill against the reference (random configs, windows from carried
//! states, f64 and f32) and against the goldens.

use super::fast_tests::{
    batched_step_matches_the_reference, state_err, team_step_is_member_invariant, windows,
    FastFamily,
};
use super::golden_tests::{conv_ssm_parts, fixture, rel_l2, to64, Golden, LAYOUTS, TOL};
use super::prefill::prefill;
use super::reference::Reference;
use super::step::step;
use super::{zero_state, State};
use crate::mixers::family_synthetic::{mamba1, Gen};
use crate::mixers::mamba1::weights::Mamba1Weights;
use crate::mixers::LogitsWant;
use crate::model::dtype::DType;
use crate::model::family_config::Mamba1Config;

fn against_reference(w: &Mamba1Weights, tokens: &[u32], what: &str) {
    let r = Reference::<f64>::new(w).unwrap();
    let mut ref_state = r.new_state();
    let gold: Vec<f64> = r.forward(&mut ref_state, tokens).unwrap().concat();
    let t = tokens.len();
    for ends in [vec![t], vec![1, 2, 19, t], vec![t / 2, t - 1, t]] {
        let (got, st) = windows::<f64>(w, tokens, &ends);
        let (e, es) = (
            rel_l2(&got, &gold),
            state_err(&st, &ref_state, w.conv_len()),
        );
        assert!(
            e <= 1e-12 && es <= 1e-12,
            "{what} f64 {ends:?}: logits {e:e} states {es:e}"
        );
        let (got, st) = windows::<f32>(w, tokens, &ends);
        let (e, es) = (
            rel_l2(&got, &gold),
            state_err(&st, &ref_state, w.conv_len()),
        );
        assert!(
            e <= TOL && es <= TOL,
            "{what} f32 {ends:?}: logits {e:e} states {es:e}"
        );
    }
    // Last row only, and no rows.
    let mut st = zero_state::<f64>(w.config.mamba1().unwrap(), w.config.n_layer);
    let last = prefill(w, &mut st, tokens, LogitsWant::Last).unwrap();
    let vocab = w.config.vocab_padded;
    assert!(
        rel_l2(&last, &gold[(t - 1) * vocab..]) <= 1e-12,
        "{what}: last row"
    );
    let mut st = zero_state::<f64>(w.config.mamba1().unwrap(), w.config.n_layer);
    assert!(prefill(w, &mut st, tokens, LogitsWant::None)
        .unwrap()
        .is_empty());
    assert!(
        state_err(&st, &ref_state, w.conv_len()) <= 1e-12,
        "{what}: states without logits"
    );
}

#[test]
fn prefill_matches_the_reference_on_random_configs() {
    let configs = [
        // plain Mamba-1, a channel count that is not a multiple of the scan block
        (
            Mamba1Config {
                d_inner: 40,
                d_state: 8,
                d_conv: 4,
                dt_rank: 3,
                conv_bias: true,
                proj_bias: false,
                bcdt_rms_eps: None,
            },
            24,
        ),
        // biases everywhere, no conv bias, K = 2, FalconMamba's norms
        (
            Mamba1Config {
                d_inner: 64,
                d_state: 16,
                d_conv: 2,
                dt_rank: 5,
                conv_bias: false,
                proj_bias: true,
                bcdt_rms_eps: Some(1e-6),
            },
            32,
        ),
        // K larger than some windows
        (
            Mamba1Config {
                d_inner: 48,
                d_state: 4,
                d_conv: 5,
                dt_rank: 1,
                conv_bias: true,
                proj_bias: true,
                bcdt_rms_eps: None,
            },
            16,
        ),
    ];
    for (i, (c, dm)) in configs.into_iter().enumerate() {
        let w = mamba1(c.clone(), dm, 2, 50, 11 + i as u64);
        let tokens = Gen::new(i as u64).tokens(37, 50);
        against_reference(&w, &tokens, &format!("config {i} {c:?}"));
    }
}

#[test]
fn prefill_matches_the_goldens_and_continues_with_reference_steps() {
    let g = Golden::load("m1-tiny");
    for layout in LAYOUTS {
        let w = Mamba1Weights::load(&fixture(&format!("m1-tiny/{layout}")), DType::F32).unwrap();
        let t = g.input_ids.len();
        for f64_path in [true, false] {
            let what = format!("m1-tiny {layout} {}", if f64_path { "f64" } else { "f32" });
            let (got, _) = if f64_path {
                let (o, s) = windows::<f64>(&w, &g.input_ids, &[t]);
                (o, Some(s))
            } else {
                (windows::<f32>(&w, &g.input_ids, &[3, 40, t]).0, None)
            };
            let e = rel_l2(&got, &g.logits);
            eprintln!("{what} prefill: logits rel L2 {e:.2e}");
            assert!(e <= TOL, "{what}: prefill logits {e:e}");
        }
        // Fast prefill of the prefix, its states, then the reference's steps from it.
        let mut st = zero_state::<f64>(w.config.mamba1().unwrap(), w.config.n_layer);
        let mut got =
            to64(&prefill(&w, &mut st, &g.input_ids[..g.prefix], LogitsWant::All).unwrap());
        for (l, (conv, ssm)) in conv_ssm_parts(&st, w.conv_len()).iter().enumerate() {
            let ec = rel_l2(conv, &g.tensor(&format!("state.{l}.conv")));
            let es = rel_l2(ssm, &g.tensor(&format!("state.{l}.ssm")));
            assert!(
                ec <= TOL && es <= TOL,
                "{layout}: prefill state.{l} conv {ec:e} ssm {es:e}"
            );
        }
        let r = Reference::<f64>::new(&w).unwrap();
        for &tok in &g.input_ids[g.prefix..] {
            got.extend(r.step(&mut st, tok).unwrap());
        }
        let e = rel_l2(&got, &g.logits);
        assert!(e <= TOL, "{layout}: prefill + reference steps {e:e}");
    }
}

#[test]
fn prefill_refuses_bad_tokens_and_foreign_states_without_touching_them() {
    let w = Mamba1Weights::load(&fixture("m1-tiny"), DType::F32).unwrap();
    let mut st = zero_state::<f32>(w.config.mamba1().unwrap(), w.config.n_layer);
    prefill(&w, &mut st, &[1, 2, 3], LogitsWant::None).unwrap();
    let before = st.clone();
    let e = prefill(&w, &mut st, &[4, 999], LogitsWant::All)
        .unwrap_err()
        .to_string();
    assert!(e.contains("999") && e.contains("position 1"), "{e}");
    assert_eq!(st, before);
    let mut bad = zero_state::<f32>(w.config.mamba1().unwrap(), 3);
    let e = prefill(&w, &mut bad, &[1], LogitsWant::All)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 layers"), "{e}");
    assert!(prefill(&w, &mut st, &[], LogitsWant::All)
        .unwrap()
        .is_empty());
    assert_eq!(st, before);
}

#[test]
fn batched_step_matches_the_reference_f64_and_f32() {
    let w = Mamba1Weights::load(&fixture("m1-tiny"), DType::F32).unwrap();
    batched_step_matches_the_reference::<f64>(&w, 1e-12);
    batched_step_matches_the_reference::<f32>(&w, TOL);
    // bf16 weights take their own dot kernel (decode products widen them in registers).
    let w = Mamba1Weights::load(&fixture("m1-tiny"), DType::BF16).unwrap();
    batched_step_matches_the_reference::<f32>(&w, TOL);
}

/// Rough speed of the fast paths against the reference on a mamba-130m-shaped model of two
/// layers (f32). Run by hand with the test profile's overflow checks off (they keep
/// `exp_fast` from vectorising): `cargo test --config
/// 'profile.test.package.mamba3.overflow-checks=false' --no-default-features --lib --
/// --ignored --nocapture speed`.
#[test]
#[ignore]
fn speed_against_the_reference() {
    let c = Mamba1Config {
        d_inner: 1536,
        d_state: 16,
        d_conv: 4,
        dt_rank: 48,
        conv_bias: true,
        proj_bias: false,
        bcdt_rms_eps: None,
    };
    let w = mamba1(c.clone(), 768, 2, 50280, 1);
    let tokens = Gen::new(3).tokens(1024, 50280);
    let mut st = zero_state::<f32>(&c, 2);
    let t0 = std::time::Instant::now();
    prefill(&w, &mut st, &tokens, LogitsWant::Last).unwrap();
    let fast = tokens.len() as f64 / t0.elapsed().as_secs_f64();
    let r = Reference::<f32>::new(&w).unwrap();
    let mut st = r.new_state();
    let t0 = std::time::Instant::now();
    r.forward(&mut st, &tokens[..32]).unwrap();
    let slow = 32.0 / t0.elapsed().as_secs_f64();
    let mut states: Vec<State<f32>> = (0..8).map(|_| zero_state(&c, 2)).collect();
    let t0 = std::time::Instant::now();
    for i in 0..16 {
        let mut refs: Vec<&mut State<f32>> = states.iter_mut().collect();
        step(&w, &mut refs, &tokens[i * 8..(i + 1) * 8]).unwrap();
    }
    let dec = 128.0 / t0.elapsed().as_secs_f64();
    eprintln!(
        "mamba1 (2 layers of mamba-130m, f32, {} threads): prefill {fast:.0} tok/s, reference {slow:.0} tok/s, batch-8 decode {dec:.0} tok/s",
        rayon::current_num_threads()
    );
}

#[test]
fn weights_paired_with_another_familys_config_are_an_error() {
    let mut w = Mamba1Weights::load(&fixture("m1-tiny"), DType::F32).unwrap();
    let m1_cfg = w.config.mamba1().unwrap().clone();
    w.config =
        crate::model::family_config::FamilyConfig::from_file(&fixture("m2-tiny/config.json"))
            .unwrap();
    let mut st = zero_state::<f32>(&m1_cfg, 2);
    let e = prefill(&w, &mut st, &[1], LogitsWant::All)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Mamba2") && e.contains("Mamba1"), "{e}");
    assert!(step(&w, &mut [&mut st], &[1]).is_err());
    assert!(Reference::<f64>::new(&w).is_err());
}

/// The decode step on the thread team gives the same bits on one member and on two (each
/// a share of every product's rows and of the channels), for one sequence and a batch.
#[test]
fn team_step_is_the_same_on_any_number_of_members() {
    let c = Mamba1Config {
        d_inner: 40,
        d_state: 8,
        d_conv: 4,
        dt_rank: 3,
        conv_bias: true,
        proj_bias: true,
        bcdt_rms_eps: Some(1e-6),
    };
    for dtype in [DType::F32, DType::BF16] {
        let w = mamba1(c.clone(), 24, 2, 50, 4).with_dtype(dtype);
        team_step_is_member_invariant(&w, 50, &format!("{dtype}"));
    }
}
