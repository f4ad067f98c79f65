//! The chunked Mamba-2 prefill against the reference (random configs, chunk lengths that do
//! and do not divide the window, windows from carried states, f64 and f32) and against the
//! goldens.

use super::prefill::prefill;
use super::reference::Reference;
use super::step::step;
use super::{zero_state, State};
use crate::mixers::family_synthetic::{mamba2, mamba2_config, Gen};
use crate::mixers::mamba1::fast_tests::{
    batched_step_matches_the_reference, state_err, team_step_is_member_invariant, windows,
    FastFamily,
};
use crate::mixers::mamba1::golden_tests::{
    conv_ssm_parts, fixture, rel_l2, to64, Golden, LAYOUTS, TOL,
};
use crate::mixers::mamba2::weights::Mamba2Weights;
use crate::mixers::LogitsWant;
use crate::model::dtype::DType;
use crate::model::family_config::{Mamba2Config, MixerConfig};

fn with_chunk(w: &Mamba2Weights, chunk: usize) -> Mamba2Weights {
    let mut w = w.clone();
    if let MixerConfig::Mamba2(m) = &mut w.config.mixer {
        m.chunk_size = chunk;
    }
    w
}

fn against_reference(w: &Mamba2Weights, tokens: &[u32], what: &str) {
    let r = Reference::<f64>::new(w).unwrap();
    let mut ref_state = r.new_state();
    let gold: Vec<f64> = r.forward(&mut ref_state, tokens).unwrap().concat();
    let t = tokens.len();
    for chunk in [1, 4, 16, 64] {
        let w = with_chunk(w, chunk);
        for ends in [vec![t], vec![1, 2, 19, t], vec![5, t - 1, t]] {
            let (got, st) = windows::<f64>(&w, tokens, &ends);
            let (e, es) = (
                rel_l2(&got, &gold),
                state_err(&st, &ref_state, w.conv_len()),
            );
            assert!(
                e <= 1e-12 && es <= 1e-12,
                "{what} chunk {chunk} f64 {ends:?}: logits {e:e} states {es:e}"
            );
            let (got, st) = windows::<f32>(&w, tokens, &ends);
            let (e, es) = (
                rel_l2(&got, &gold),
                state_err(&st, &ref_state, w.conv_len()),
            );
            assert!(
                e <= TOL && es <= TOL,
                "{what} chunk {chunk} f32 {ends:?}: logits {e:e} states {es:e}"
            );
        }
    }
    let mut st = zero_state::<f64>(w.config.mamba2().unwrap(), w.config.n_layer);
    let last = prefill(w, &mut st, tokens, LogitsWant::Last).unwrap();
    let vocab = w.config.vocab_padded;
    assert!(
        rel_l2(&last, &gold[(t - 1) * vocab..]) <= 1e-12,
        "{what}: last row"
    );
}

/// The official defaults at this size, with chunks of 16 rows.
fn config(d_model: usize, headdim: usize, ngroups: usize, d_state: usize) -> Mamba2Config {
    Mamba2Config {
        chunk_size: 16,
        ..mamba2_config(d_model, headdim, ngroups, d_state)
    }
}

#[test]
fn prefill_matches_the_reference_on_random_configs() {
    let mut configs = vec![config(32, 8, 1, 16), config(32, 8, 2, 8)];
    // gated-MLP branch, D per channel, biases, no conv bias, a real Δ clamp, K = 3
    let mut c = config(24, 4, 3, 6);
    c.d_ssm = 36;
    c.nheads = 9;
    c.d_has_hdim = true;
    c.proj_bias = true;
    c.conv_bias = false;
    c.dt_limit = (0.02, 0.4);
    c.d_conv = 3;
    configs.push(c);
    // normalise before gating; and no norm at all
    let mut c = config(16, 8, 2, 4);
    c.norm_before_gate = true;
    configs.push(c);
    let mut c = config(16, 4, 1, 5);
    c.rmsnorm = false;
    configs.push(c);
    for (i, c) in configs.into_iter().enumerate() {
        let dm = c.d_inner / 2;
        let w = mamba2(c.clone(), dm, 2, 40, 21 + i as u64);
        let tokens = Gen::new(100 + i as u64).tokens(37, 40);
        against_reference(&w, &tokens, &format!("config {i} {c:?}"));
    }
}

#[test]
fn prefill_matches_the_goldens_and_continues_with_reference_steps() {
    let g = Golden::load("m2-tiny");
    let t = g.input_ids.len();
    for layout in LAYOUTS {
        let w = Mamba2Weights::load(&fixture(&format!("m2-tiny/{layout}")), DType::F32).unwrap();
        let got = windows::<f64>(&w, &g.input_ids, &[t]).0;
        let e = rel_l2(&got, &g.logits);
        let got = windows::<f32>(&w, &g.input_ids, &[3, 16, 40, t]).0;
        let e32 = rel_l2(&got, &g.logits);
        eprintln!("m2-tiny {layout} prefill: logits rel L2 f64 {e:.2e} f32 {e32:.2e}");
        assert!(
            e <= TOL && e32 <= TOL,
            "{layout}: prefill logits f64 {e:e} f32 {e32:e}"
        );

        let mut st = zero_state::<f64>(w.config.mamba2().unwrap(), w.config.n_layer);
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
fn batched_step_matches_the_reference_f64_and_f32() {
    let w = Mamba2Weights::load(&fixture("m2-tiny"), DType::F32).unwrap();
    batched_step_matches_the_reference::<f64>(&w, 1e-12);
    batched_step_matches_the_reference::<f32>(&w, TOL);
    // bf16 weights take their own dot kernel (decode products widen them in registers).
    let w = Mamba2Weights::load(&fixture("m2-tiny"), DType::BF16).unwrap();
    batched_step_matches_the_reference::<f32>(&w, TOL);
}

/// Rough speed of the fast paths against the reference on a mamba2-130m-shaped model of two
/// layers (f32). Run by hand with the test profile's overflow checks off (they keep
/// `exp_fast` from vectorising): `cargo test --config
/// 'profile.test.package.mamba3.overflow-checks=false' --no-default-features --lib --
/// --ignored --nocapture speed`.
#[test]
#[ignore]
fn speed_against_the_reference() {
    let mut c = config(768, 64, 1, 128);
    c.chunk_size = 256;
    let w = mamba2(c.clone(), 768, 2, 50288, 1);
    let tokens = Gen::new(3).tokens(1024, 50288);
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
        "mamba2 (2 layers of mamba2-130m, f32, {} threads): prefill {fast:.0} tok/s, reference {slow:.0} tok/s, batch-8 decode {dec:.0} tok/s",
        rayon::current_num_threads()
    );
}

/// The decode step on the thread team gives the same bits on one member and on two (each
/// a share of every product's rows, of the conv's channels and of the heads), for one
/// sequence and a batch.
#[test]
fn team_step_is_the_same_on_any_number_of_members() {
    // two groups, the gated-MLP branch, D per channel, biases
    let mut c = config(24, 4, 3, 6);
    c.d_ssm = 36;
    c.nheads = 9;
    c.d_has_hdim = true;
    c.proj_bias = true;
    for dtype in [DType::F32, DType::BF16] {
        let w = mamba2(c.clone(), 24, 2, 40, 5).with_dtype(dtype);
        team_step_is_member_invariant(&w, 40, &format!("{dtype}"));
    }
}
