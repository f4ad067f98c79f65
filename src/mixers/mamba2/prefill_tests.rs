//! The chunked Mamba-2 prefill against the reference (random configs, chunk lengths that do
//! and do not divide the window, windows from carried states, f64 and f32) and against the
//! goldens.

use super::prefill::prefill;
use super::reference::Reference;
use super::step::step;
use super::{zero_state, State};
use crate::cpu::Real;
use crate::mixers::mamba1::golden_tests::{
    conv_ssm_parts, fixture, rel_l2, to64, Golden, LAYOUTS, TOL,
};
use crate::mixers::mamba1::lm::LogitRows;
use crate::model::dtype::DType;
use crate::model::family_config::{Mamba2Config, MixerConfig};
use crate::model::family_synthetic::{mamba2, Gen};
use crate::model::family_weights::Mamba2Weights;

fn windows<F: Real>(w: &Mamba2Weights, tokens: &[u32], ends: &[usize]) -> (Vec<f64>, State<F>) {
    let mut st = zero_state(w.config.mamba2().unwrap(), w.config.n_layer);
    let mut out = Vec::new();
    let mut start = 0;
    for &end in ends {
        out.extend(to64(
            &prefill::<F>(w, &mut st, &tokens[start..end], LogitRows::All).unwrap(),
        ));
        start = end;
    }
    (out, st)
}

/// Values of a layer's conv state.
fn conv_len(w: &Mamba2Weights) -> usize {
    let c = w.config.mamba2().unwrap();
    c.conv_dim() * c.d_conv
}

/// The worst of the conv and SSM parts of every layer (their scales differ, so each is
/// compared alone).
fn state_err<F: Real>(a: &State<F>, b: &State<f64>, conv: usize) -> f64 {
    a.data
        .chunks(a.layer_len)
        .zip(b.data.chunks(b.layer_len))
        .map(|(x, y)| {
            let (xc, xs) = x.split_at(conv);
            let (yc, ys) = y.split_at(conv);
            rel_l2(&to64(xc), yc).max(rel_l2(&to64(xs), ys))
        })
        .fold(0.0, f64::max)
}

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
                state_err(&st, &ref_state, conv_len(&w)),
            );
            assert!(
                e <= 1e-12 && es <= 1e-12,
                "{what} chunk {chunk} f64 {ends:?}: logits {e:e} states {es:e}"
            );
            let (got, st) = windows::<f32>(&w, tokens, &ends);
            let (e, es) = (
                rel_l2(&got, &gold),
                state_err(&st, &ref_state, conv_len(&w)),
            );
            assert!(
                e <= TOL && es <= TOL,
                "{what} chunk {chunk} f32 {ends:?}: logits {e:e} states {es:e}"
            );
        }
    }
    let mut st = zero_state::<f64>(w.config.mamba2().unwrap(), w.config.n_layer);
    let last = prefill(w, &mut st, tokens, LogitRows::Last).unwrap();
    let vocab = w.config.vocab_padded;
    assert!(
        rel_l2(&last, &gold[(t - 1) * vocab..]) <= 1e-12,
        "{what}: last row"
    );
}

fn config(d_model: usize, headdim: usize, ngroups: usize, d_state: usize) -> Mamba2Config {
    let d_inner = 2 * d_model;
    Mamba2Config {
        d_inner,
        d_ssm: d_inner,
        d_state,
        d_conv: 4,
        headdim,
        nheads: d_inner / headdim,
        ngroups,
        d_has_hdim: false,
        rmsnorm: true,
        norm_before_gate: false,
        gated_norm_eps: 1e-5,
        dt_limit: (0.0, f64::INFINITY),
        conv_bias: true,
        proj_bias: false,
        chunk_size: 16,
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
            to64(&prefill(&w, &mut st, &g.input_ids[..g.prefix], LogitRows::All).unwrap());
        for (l, (conv, ssm)) in conv_ssm_parts(&st, conv_len(&w)).iter().enumerate() {
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

/// Three sequences of different lengths, prefilled by the fast path, then decoded together
/// by the batched step: each equals its own reference run.
fn batched_step_matches_the_reference<F: Real>(w: &Mamba2Weights, tol: f64) {
    let cfg = w.config.mamba2().unwrap();
    let vocab = w.config.vocab_padded;
    let mut gen = Gen::new(7);
    let prompts: Vec<Vec<u32>> = [5, 1, 23].iter().map(|&n| gen.tokens(n, vocab)).collect();
    let steps: Vec<Vec<u32>> = (0..4).map(|_| gen.tokens(3, vocab)).collect();
    let mut states: Vec<State<F>> = prompts
        .iter()
        .map(|p| {
            let mut st = zero_state(cfg, w.config.n_layer);
            prefill(w, &mut st, p, LogitRows::None).unwrap();
            st
        })
        .collect();
    let mut got: Vec<Vec<f64>> = vec![Vec::new(); 3];
    for toks in &steps {
        let mut refs: Vec<&mut State<F>> = states.iter_mut().collect();
        let out = step(w, &mut refs, toks).unwrap();
        for (i, row) in out.chunks(vocab).enumerate() {
            got[i].extend(to64(row));
        }
    }
    let r = Reference::<f64>::new(w).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let mut st = r.new_state();
        r.forward(&mut st, p).unwrap();
        let seq: Vec<u32> = steps.iter().map(|s| s[i]).collect();
        let want = r.forward(&mut st, &seq).unwrap().concat();
        let e = rel_l2(&got[i], &want);
        assert!(e <= tol, "sequence {i}: batched step rel L2 {e:e}");
        assert!(
            state_err(&states[i], &st, conv_len(w)) <= tol,
            "sequence {i}: states"
        );
    }
    // Refusals leave every state as it was.
    let before = states.clone();
    let mut refs: Vec<&mut State<F>> = states.iter_mut().collect();
    let e = step(w, &mut refs, &[1, 2]).unwrap_err().to_string();
    assert!(e.contains("2 tokens for 3 states"), "{e}");
    let e = step(w, &mut refs, &[1, vocab as u32, 2])
        .unwrap_err()
        .to_string();
    assert!(e.contains("out of range"), "{e}");
    assert_eq!(states, before);
}

#[test]
fn batched_step_matches_the_reference_f64_and_f32() {
    let w = Mamba2Weights::load(&fixture("m2-tiny"), DType::F32).unwrap();
    batched_step_matches_the_reference::<f64>(&w, 1e-12);
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
    prefill(&w, &mut st, &tokens, LogitRows::Last).unwrap();
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
