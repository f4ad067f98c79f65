//! The oracle chain on random small configs (proptest): chunked prefill equals the
//! token-by-token reference in f64; windows split anywhere equal one window; decode equals
//! prefill; a packed batch equals each sequence alone; save → load → continue and
//! snapshot → continue equal the unbroken run bit for bit.
mod common;
use common::*;
use mamba3::engine::cpu::CpuModel;
use mamba3::mixers::mamba3::state::{layers, zero_state, SeqState};
use mamba3::mixers::mamba3::Reference;
use mamba3::mixers::mamba3::Weights;
use mamba3::model::Dims;
use mamba3::model::{Config, DType};
use mamba3::{Device, LogitsWant, Model};
use proptest::prelude::*;
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Case {
    config: Config,
    seed: u64,
}

fn config_strategy() -> impl Strategy<Value = Case> {
    (
        (
            prop::sample::select(vec![8usize, 16, 24]),
            1usize..=2,
            prop::sample::select(vec![4usize, 8, 16]),
        ),
        (
            prop::sample::select(vec![4usize, 8]),
            any::<bool>(),
            prop::sample::select(vec![0.5f64, 1.0]),
        ),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        (
            prop::sample::select(vec![1usize, 2, 3, 5, 8, 16]),
            prop::sample::select(vec![11usize, 50]),
        ),
        any::<u64>(),
    )
        .prop_map(
            |((dm, layers, n), (p, two_groups, rope), (norm, mlp, tied), (chunk, vocab), seed)| {
                let mut c = Config::synthetic(dm, layers, n, p, 2, 1, vocab);
                let heads = c.dims().nheads;
                c.ssm_cfg.ngroups = if two_groups && heads.is_multiple_of(2) {
                    2
                } else {
                    1
                };
                c.ssm_cfg.rope_fraction = rope;
                c.ssm_cfg.is_outproj_norm = norm;
                c.ssm_cfg.chunk_size = chunk;
                c.d_intermediate = if mlp { 24 } else { 0 };
                c.tie_embeddings = tied;
                c.validate().expect("strategy builds valid configs");
                Case { config: c, seed }
            },
        )
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = mamba3::model::rng::Rng::new(seed ^ 0xABCD);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

fn states_close(
    a: &SeqState<f64>,
    b: &SeqState<f64>,
    d: &Dims,
    tol: f64,
) -> Result<(), TestCaseError> {
    for (x, y) in layers(a, d).iter().zip(layers(b, d)) {
        for (u, v) in [(x.ssm, y.ssm), (x.k, y.k), (x.v, y.v)] {
            let e = rel_l2(u, v);
            prop_assert!(e <= tol || v.iter().all(|z| *z == 0.0), "state rel {e:e}");
        }
        prop_assert!(rel_l2_angles(x.angle, y.angle) <= tol);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn chunked_prefill_equals_reference_in_f64(case in config_strategy(), len in 1usize..40) {
        let w = Arc::new(Weights::synthetic(case.config.clone(), DType::F64, case.seed).unwrap());
        let toks = tokens(case.seed, len, w.dims.vocab_size);
        let r = Reference::<f64>::new(&w);
        let mut rs = zero_state::<f64>(&w.dims);
        let want: Vec<f64> = r.run(&toks, &mut rs).concat();
        let m = CpuModel::<f64>::new(w.clone());
        let mut s = m.zero_state();
        let got = m.forward(&[&toks], &mut [&mut s], LogitsWant::All).unwrap().remove(0);
        let e = rel_l2(&got, &want);
        prop_assert!(e <= 1e-9, "logits rel {e:e}");
        states_close(&s, &rs, &w.dims, 1e-9)?;
    }

    #[test]
    fn windows_anywhere_equal_one_window(case in config_strategy(), len in 2usize..40, cuts in prop::collection::vec(1usize..40, 1..5)) {
        let w = Arc::new(Weights::synthetic(case.config.clone(), DType::F64, case.seed).unwrap());
        let toks = tokens(case.seed, len, w.dims.vocab_size);
        let m = CpuModel::<f64>::new(w.clone());
        let mut one = m.zero_state();
        let want = m.forward(&[&toks], &mut [&mut one], LogitsWant::All).unwrap().remove(0);
        let mut ends: Vec<usize> = cuts.into_iter().filter(|&c| c < len).collect();
        ends.push(len);
        ends.sort_unstable();
        ends.dedup();
        let mut s = m.zero_state();
        let mut got = Vec::new();
        let mut start = 0;
        for e in ends {
            got.extend(m.forward(&[&toks[start..e]], &mut [&mut s], LogitsWant::All).unwrap().remove(0));
            start = e;
        }
        let e = rel_l2(&got, &want);
        prop_assert!(e <= 1e-9, "windows rel {e:e}");
        states_close(&s, &one, &w.dims, 1e-9)?;
    }

    #[test]
    fn decode_equals_prefill_and_batches_equal_singles(case in config_strategy(), lens in prop::collection::vec(1usize..20, 1..4)) {
        let w = Arc::new(Weights::synthetic(case.config.clone(), DType::F64, case.seed).unwrap());
        let m = CpuModel::<f64>::new(w.clone());
        let seqs: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &n)| tokens(case.seed + i as u64, n, w.dims.vocab_size)).collect();
        // Each alone, by prefill and by decode.
        let mut alone = Vec::new();
        for s in &seqs {
            let mut st = m.zero_state();
            let p = m.forward(&[s], &mut [&mut st], LogitsWant::All).unwrap().remove(0);
            let mut dst = m.zero_state();
            let d: Vec<f64> = s.iter().flat_map(|&t| m.forward(&[&[t]], &mut [&mut dst], LogitsWant::Last).unwrap().remove(0)).collect();
            prop_assert!(rel_l2(&d, &p) <= 1e-9, "decode vs prefill");
            alone.push(p);
        }
        // All together in one packed batch.
        let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
        let mut states: Vec<SeqState<f64>> = seqs.iter().map(|_| m.zero_state()).collect();
        let mut sref: Vec<&mut SeqState<f64>> = states.iter_mut().collect();
        let packed = m.forward(&refs, &mut sref, LogitsWant::All).unwrap();
        for (p, a) in packed.iter().zip(&alone) {
            prop_assert!(rel_l2(p, a) <= 1e-9, "packed vs alone");
        }
    }

    #[test]
    fn save_load_continue_is_bit_identical(case in config_strategy(), len in 2usize..30, cut in 1usize..29, decodes in 0usize..4) {
        let cut = cut.min(len - 1);
        let w = Weights::synthetic(case.config.clone(), DType::F32, case.seed).unwrap();
        let m = Model::from_weights(w, Device::Cpu).unwrap();
        let toks = tokens(case.seed, len + decodes, m.dims().vocab_size);
        let (prefix, rest, tail) = (&toks[..cut], &toks[cut..len], &toks[len..]);
        let run = |st: &mut mamba3::State| -> Vec<f32> {
            let mut out = m.prefill(rest, st, LogitsWant::All).unwrap().data;
            for &t in tail {
                out.extend(m.decode(&[t], &mut [st]).unwrap().data);
            }
            out
        };
        let mut unbroken = m.new_state();
        m.prefill(prefix, &mut unbroken, LogitsWant::None).unwrap();
        let snapshot = unbroken.clone();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        unbroken.save(&path).unwrap();
        let want = run(&mut unbroken);
        let mut loaded = m.load_state(&path).unwrap();
        prop_assert_eq!(loaded.position(), cut as u64);
        let got = run(&mut loaded);
        prop_assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "loaded run differs");
        let mut restored = snapshot;
        let again = run(&mut restored);
        prop_assert!(again.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "snapshot run differs");
        prop_assert!(loaded.to_host().unwrap() == unbroken.to_host().unwrap(), "final states differ");
    }
}
