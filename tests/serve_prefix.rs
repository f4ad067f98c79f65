//! Exactness of prefix-state reuse at the engine level: continuing from a cached state at
//! any position gives the logits of one full prefill (to float rounding of a different
//! window split) and the same greedy tokens.

mod serve_util;

use mamba3::engine::{Device, LogitsWant, Model};
use mamba3::mixers::mamba3::Weights;
use mamba3::model::{Config, DType};
use mamba3::serve::prefix_cache::PrefixCache;
use std::sync::Arc;

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let n: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let d: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (n / d).sqrt()
}

fn check(model: &Model, tokens: &[u32], cuts: &[usize]) {
    let vocab = model.dims().vocab_size;
    let mut full_state = model.new_state();
    let full = model
        .prefill(tokens, &mut full_state, LogitsWant::Last)
        .unwrap()
        .data;
    let mut cache = PrefixCache::new(1 << 30);
    for &cut in cuts {
        // Cache the state after the first `cut` tokens, as the server does...
        let mut st = model.new_state();
        let lg = model
            .prefill(&tokens[..cut], &mut st, LogitsWant::Last)
            .unwrap()
            .data;
        cache.insert(&tokens[..cut], st, Arc::new(lg[..vocab].to_vec()));
        // ...and a prompt that extends it starts from there.
        let hit = cache.lookup(tokens).hit.expect("a cached prefix");
        assert_eq!(hit.len, cut);
        let mut state = hit.state;
        let cont = model
            .prefill(&tokens[cut..], &mut state, LogitsWant::Last)
            .unwrap()
            .data;
        let e = rel(&cont[..vocab], &full[..vocab]);
        assert!(e <= 1e-5, "cut {cut}: relative error {e:e}");
        assert_eq!(
            mamba3::text::sampling::argmax(&cont[..vocab]),
            mamba3::text::sampling::argmax(&full[..vocab])
        );
        assert_eq!(state.position(), tokens.len() as u64);
        // Greedy continuations agree token for token.
        let mut a = state.clone();
        let mut b = full_state.clone();
        let (mut la, mut lb) = (cont.clone(), full.clone());
        for _ in 0..12 {
            let ta = mamba3::text::sampling::argmax(&la[..vocab]);
            let tb = mamba3::text::sampling::argmax(&lb[..vocab]);
            assert_eq!(ta, tb, "cut {cut}");
            la = model.decode(&[ta], &mut [&mut a]).unwrap().data;
            lb = model.decode(&[tb], &mut [&mut b]).unwrap().data;
        }
    }
}

#[test]
fn continuing_from_a_cached_state_is_exact_at_any_position() {
    let cfg = Config::synthetic(64, 2, 32, 16, 2, 1, 300);
    let model =
        Model::from_weights(Weights::synthetic(cfg, DType::F32, 9).unwrap(), Device::Cpu).unwrap();
    let tokens: Vec<u32> = (0..200u32).map(|i| (i * 31 + 7) % 300).collect();
    // Positions on and off the chunk grid (chunk 64), first and last tokens included.
    check(&model, &tokens, &[1, 17, 63, 64, 65, 128, 150, 199]);
}

#[test]
fn the_golden_fixture_continues_exactly_from_its_prefix() {
    let dir = serve_util::fixtures().join("siso-mlp-norm");
    let model = Model::load(&dir, Device::Cpu, DType::F32).unwrap();
    let g = mamba3::model::tensor_file::TensorFile::open(&dir.join("golden.safetensors")).unwrap();
    let ids: Vec<u32> = g
        .get("input_ids")
        .unwrap()
        .to_i64("input_ids")
        .unwrap()
        .iter()
        .map(|&x| x as u32)
        .collect();
    check(&model, &ids, &[5, 32, 97, 149]);
}
