//! Sampling on the device (kernels/sample.cu, engine/cuda/sample.rs) against the CPU
//! `Sampler`'s rules: (a) greedy ids are the host's first maximum of the same rows (ties,
//! NaN, −∞ rows, padding past the vocabulary), with bias and penalties the host sampler's
//! token, step after step; (b) for several option sets, many seeded draws per row follow
//! the exact probabilities computed on the host by the CPU's rules (a chi-square test with
//! a fixed, generous bound) and never fall outside the candidates (ties at the top-k and
//! top-p cuts included); (c) through the engine, same seeds give the same ids, a replayed
//! decode graph the same as eager steps, and a step's row of logits fetched afterwards is
//! the step's. Run on a machine with a CUDA device:
//! `cargo test --release --features cuda --test gpu_sampling -- --include-ignored`.
#![cfg(feature = "cuda")]

mod gpu;
use gpu::*;
use mamba3::cuda::context::Gpu;
use mamba3::engine::cuda::sample::DeviceSampler;
use mamba3::engine::sampling::{argmax, Sampler, SamplingParams};
use mamba3::engine::{Device, LogitsWant, Model, SampleStep, StepLogits};
use mamba3::mixers::mamba3::Weights;
use mamba3::model::rng::Rng;
use mamba3::model::DType;
use std::sync::Arc;

fn gpu() -> Arc<Gpu> {
    Arc::new(Gpu::new(0).unwrap())
}

/// Sample `rows` (`[samplers.len(), ld]`, uploaded) once with these samplers.
fn sample(
    g: &Gpu,
    ds: &mut DeviceSampler,
    rows: &[f32],
    ld: usize,
    samplers: &mut [Sampler],
    check_finite: bool,
) -> (Vec<u32>, Vec<bool>) {
    let buf = g.upload(rows).unwrap();
    let (mut ids, mut finite) = (Vec::new(), Vec::new());
    let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
    ds.sample(buf.ptr, ld, &mut refs, check_finite, &mut ids, &mut finite)
        .unwrap();
    (ids, finite)
}

#[test]
#[ignore = "needs a CUDA device"]
fn greedy_ids_are_the_first_maximum() {
    let g = gpu();
    let mut rng = Rng::new(5);
    for vocab in [1000usize, 128_256] {
        let ld = vocab.next_multiple_of(64) + 64;
        let mut ds = DeviceSampler::new(&g, vocab).unwrap();
        let nb = 12;
        let mut rows = vec![0f32; nb * ld];
        for (b, row) in rows.chunks_mut(ld).enumerate() {
            // Few distinct values: many ties; the padding past the vocabulary is larger
            // than any token's and must never win.
            for x in row[..vocab].iter_mut() {
                *x = rng.below(7) as f32;
            }
            row[vocab..].fill(100.0);
            match b {
                0 => row[..vocab].fill(f32::NAN),
                1 => row[..vocab].fill(f32::NEG_INFINITY),
                2 => {
                    row[..vocab].fill(f32::NAN);
                    row[vocab - 3] = -5.0;
                }
                3..=6 => {
                    for _ in 0..10 {
                        row[rng.below(vocab as u64) as usize] = f32::NAN;
                    }
                    row[rng.below(vocab as u64) as usize] = f32::NEG_INFINITY;
                }
                _ => {}
            }
        }
        let mut samplers: Vec<Sampler> = (0..nb)
            .map(|_| Sampler::new(SamplingParams::greedy(), &[]))
            .collect();
        let (ids, _) = sample(&g, &mut ds, &rows, ld, &mut samplers, false);
        let want: Vec<u32> = rows.chunks(ld).map(|r| argmax(&r[..vocab])).collect();
        assert_eq!(ids, want, "vocab {vocab}");
        // Checked for finiteness, the rows holding NaN or ±∞ are not sampled.
        let mut samplers: Vec<Sampler> = (0..nb)
            .map(|_| Sampler::new(SamplingParams::greedy(), &[]))
            .collect();
        let (_, finite) = sample(&g, &mut ds, &rows, ld, &mut samplers, true);
        let want: Vec<bool> = rows
            .chunks(ld)
            .map(|r| r[..vocab].iter().all(|x| x.is_finite()))
            .collect();
        assert_eq!(finite, want);
    }
}

/// Greedy with bias and penalties: the device's token is the host sampler's, step after
/// step (the device's counts follow the accepted tokens).
#[test]
#[ignore = "needs a CUDA device"]
fn greedy_with_penalties_follows_the_host_sampler() {
    let g = gpu();
    let vocab = 5000;
    let mut ds = DeviceSampler::new(&g, vocab).unwrap();
    let mut rng = Rng::new(9);
    let row: Vec<f32> = (0..vocab)
        .map(|_| (rng.uniform() as f32) * 4.0 - 2.0)
        .collect();
    let prompt: Vec<u32> = (0..50).map(|_| rng.below(vocab as u64) as u32).collect();
    let opts = [
        SamplingParams {
            repetition_penalty: 1.8,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            frequency_penalty: 1.5,
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logit_bias: vec![(17, 5.0), (17, 0.5), (23, 4.0), (4999, 3.0)],
            repetition_penalty: 1.3,
            frequency_penalty: 0.4,
            ..SamplingParams::greedy()
        },
    ];
    let mut dev: Vec<Sampler> = opts
        .iter()
        .map(|p| Sampler::new(p.clone(), &prompt))
        .collect();
    let mut host: Vec<Sampler> = opts
        .iter()
        .map(|p| Sampler::new(p.clone(), &prompt))
        .collect();
    let rows: Vec<f32> = (0..opts.len()).flat_map(|_| row.iter().copied()).collect();
    for step in 0..40 {
        let (ids, _) = sample(&g, &mut ds, &rows, vocab, &mut dev, true);
        for (b, &id) in ids.iter().enumerate() {
            assert_eq!(id, host[b].sample(&row), "row {b}, step {step}");
            host[b].accept(id);
            dev[b].accept(id);
        }
    }
}

/// Row logits after bias and penalties, as `Sampler::sample` computes them.
fn penalised(row: &[f32], p: &SamplingParams, prompt: &[u32], generated: &[u32]) -> Vec<f32> {
    let mut l = row.to_vec();
    for &(t, b) in &p.logit_bias {
        l[t as usize] += b;
    }
    let mut seen: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    seen.sort_unstable();
    seen.dedup();
    if p.repetition_penalty != 1.0 {
        for &t in &seen {
            let x = &mut l[t as usize];
            *x = if *x > 0.0 {
                *x / p.repetition_penalty
            } else {
                *x * p.repetition_penalty
            };
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        let mut counts = std::collections::BTreeMap::new();
        for &t in generated {
            *counts.entry(t).or_insert(0u32) += 1;
        }
        for (&t, &c) in &counts {
            l[t as usize] -= c as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
    l
}

/// The exact probability of every token under the CPU `Sampler`'s rules (the candidates:
/// non-NaN; top-k by value, ties to the lower index; weights exp(y − max), 0 below e⁻⁸⁷;
/// top-p: the shortest head by weight (ties to the lower index) reaching top_p of the
/// total; min-p: weight ≥ min_p).
fn probabilities(l: &[f32], p: &SamplingParams) -> Vec<f64> {
    let inv_t = 1.0 / p.temperature;
    let mut cand: Vec<(usize, f32)> = l
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_nan())
        .map(|(i, &v)| (i, v * inv_t))
        .collect();
    let desc = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.sort_by(desc);
        cand.truncate(p.top_k);
    }
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    for c in cand.iter_mut() {
        let d = c.1 - max;
        c.1 = if d >= -87.0 { d.exp() } else { 0.0 };
    }
    if p.top_p < 1.0 {
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        cand.sort_by(desc);
        let mut acc = 0.0;
        let keep = cand.iter().position(|c| {
            acc += c.1 as f64;
            acc >= p.top_p as f64 * total
        });
        cand.truncate(keep.map_or(cand.len(), |k| k + 1));
    }
    if p.min_p > 0.0 {
        cand.retain(|c| c.1 >= p.min_p);
    }
    let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
    let mut prob = vec![0.0; l.len()];
    for c in cand {
        prob[c.0] = c.1 as f64 / total;
    }
    prob
}

/// Pearson's chi-square of `counts` against `prob` (tokens expected fewer than 5 times
/// pooled into one bin) and its degrees of freedom.
fn chi_square(counts: &[u64], prob: &[f64], n: u64) -> (f64, usize) {
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(prob) {
        let e = p * n as f64;
        if p == 0.0 {
            continue;
        }
        if e < 5.0 {
            pool_o += c as f64;
            pool_e += e;
        } else {
            stat += (c as f64 - e).powi(2) / e;
            bins += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
        bins += 1;
    }
    (stat, bins.saturating_sub(1))
}

#[test]
#[ignore = "needs a CUDA device"]
fn draws_follow_the_cpu_rules() {
    let g = gpu();
    let vocab = 3000;
    let mut ds = DeviceSampler::new(&g, vocab).unwrap();
    let mut rng = Rng::new(21);
    // A peaked row (most mass in a few dozen tokens), a row of ties (values i mod 10) and
    // a flat row.
    let peaked: Vec<f32> = (0..vocab)
        .map(|_| (rng.uniform() as f32).powi(6) * 14.0 - 4.0)
        .collect();
    let ties: Vec<f32> = (0..vocab).map(|i| (i % 10) as f32 * 0.3).collect();
    let flat = vec![0.5f32; vocab];
    let prompt: Vec<u32> = (0..40).map(|_| rng.below(vocab as u64) as u32).collect();
    let generated: Vec<u32> = (0..30).map(|i| prompt[i % 7]).collect();
    let base = SamplingParams::default();
    let sets: Vec<(&str, &[f32], SamplingParams)> = vec![
        (
            "temperature",
            &peaked,
            SamplingParams {
                temperature: 0.7,
                ..base.clone()
            },
        ),
        (
            "top-k",
            &peaked,
            SamplingParams {
                top_k: 20,
                ..base.clone()
            },
        ),
        (
            "top-p",
            &peaked,
            SamplingParams {
                top_p: 0.8,
                temperature: 1.3,
                ..base.clone()
            },
        ),
        (
            "min-p",
            &peaked,
            SamplingParams {
                min_p: 0.02,
                ..base.clone()
            },
        ),
        (
            "top-k, top-p, min-p",
            &peaked,
            SamplingParams {
                top_k: 50,
                top_p: 0.9,
                min_p: 0.01,
                ..base.clone()
            },
        ),
        (
            "penalties and bias",
            &peaked,
            SamplingParams {
                repetition_penalty: 1.5,
                frequency_penalty: 0.3,
                presence_penalty: 0.2,
                logit_bias: vec![(5, 4.0), (6, -3.0), (prompt[0], 2.0)],
                ..base.clone()
            },
        ),
        // ties at the top-k cut: 300 tokens have each value; k = 450 keeps all of the top
        // value and the 150 lowest indices of the next
        (
            "top-k ties",
            &ties,
            SamplingParams {
                top_k: 450,
                ..base.clone()
            },
        ),
        // ties at the top-p cut: the lowest indices
        (
            "top-p ties",
            &flat,
            SamplingParams {
                top_p: 0.25,
                ..base.clone()
            },
        ),
    ];
    let (rows_per_call, calls) = (256usize, 40usize);
    for (k, (what, row, p)) in sets.into_iter().enumerate() {
        let l = penalised(row, &p, &prompt, &generated);
        let prob = probabilities(&l, &p);
        let rows: Vec<f32> = (0..rows_per_call)
            .flat_map(|_| row.iter().copied())
            .collect();
        let mut counts = vec![0u64; vocab];
        for call in 0..calls {
            // Fresh samplers each call (their device slots filled from the same history),
            // each with its own seed: every draw from the same distribution.
            let mut samplers: Vec<Sampler> = (0..rows_per_call)
                .map(|r| {
                    let seed = Some((k * 1_000_000 + call * rows_per_call + r) as u64);
                    let mut s = Sampler::new(SamplingParams { seed, ..p.clone() }, &prompt);
                    generated.iter().for_each(|&t| s.accept(t));
                    s
                })
                .collect();
            let (ids, _) = sample(&g, &mut ds, &rows, vocab, &mut samplers, true);
            for id in ids {
                assert!(
                    prob[id as usize] > 0.0,
                    "{what}: token {id} is no candidate"
                );
                counts[id as usize] += 1;
            }
        }
        let n = (rows_per_call * calls) as u64;
        let (stat, df) = chi_square(&counts, &prob, n);
        // Far above the 99.99th percentile for any df (mean df, sd sqrt(2 df)).
        let bound = df as f64 + 8.0 * (2.0 * df as f64).sqrt() + 30.0;
        println!("{what}: chi-square {stat:.1} over {df} degrees of freedom (bound {bound:.1})");
        assert!(
            stat < bound,
            "{what}: chi-square {stat} over {df} df, bound {bound}"
        );
    }
}

fn model() -> Model {
    let cfg = config(128, 3, 64, 32, 2, 0.5, true, 128, 32);
    Model::from_weights(
        Weights::synthetic(cfg, DType::F32, 11).unwrap(),
        Device::Cuda(0),
    )
    .unwrap()
}

/// Six sampled steps of `n` sequences (option sets of every kind, seeds from `seed`).
fn run(m: &Model, n: usize, seed: u64) -> Vec<u32> {
    let mut states = primed(m, n);
    let mut samplers: Vec<Sampler> = (0..n)
        .map(|i| {
            let p = SamplingParams {
                seed: Some(seed + i as u64),
                top_k: if i % 3 == 1 { 8 } else { 0 },
                top_p: if i % 3 == 2 { 0.9 } else { 1.0 },
                temperature: if i % 4 == 0 { 0.0 } else { 1.0 },
                repetition_penalty: 1.1,
                ..Default::default()
            };
            Sampler::new(p, &[])
        })
        .collect();
    let mut toks: Vec<u32> = (0..n as u32).collect();
    let (mut step, mut out) = (SampleStep::new(), Vec::new());
    for _ in 0..6 {
        let ids = m
            .decode_sample(
                &toks,
                &mut states.iter_mut().collect::<Vec<_>>(),
                &mut samplers.iter_mut().collect::<Vec<_>>(),
                &mut step,
            )
            .unwrap()
            .to_vec();
        for (s, &t) in samplers.iter_mut().zip(&ids) {
            s.accept(t);
        }
        out.extend(&ids);
        toks = ids;
    }
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn same_seed_same_ids_and_replay_equals_eager() {
    let m = model();
    let n = 5;
    let eager = run(&m, n, 1);
    assert_eq!(run(&m, n, 1), eager, "same seeds, same ids");
    assert_ne!(run(&m, n, 77), eager, "other seeds, other ids");
    m.capture_decode_graph(8).unwrap();
    assert_eq!(
        run(&m, n, 1),
        eager,
        "a replayed graph samples as eager steps do"
    );
    m.clear_graphs().unwrap();

    // Greedy ids are the host's argmax of the step's own logits, and the row fetched
    // after the step is the step's.
    let (mut a, mut b) = (primed(&m, n), primed(&m, n));
    let toks: Vec<u32> = (0..n as u32).map(|i| i * 3).collect();
    let mut logits = StepLogits::new();
    m.decode_into(&toks, &mut a.iter_mut().collect::<Vec<_>>(), &mut logits)
        .unwrap();
    let mut samplers: Vec<Sampler> = (0..n)
        .map(|_| Sampler::new(SamplingParams::greedy(), &[]))
        .collect();
    let mut step = SampleStep::new();
    let ids = m
        .decode_sample(
            &toks,
            &mut b.iter_mut().collect::<Vec<_>>(),
            &mut samplers.iter_mut().collect::<Vec<_>>(),
            &mut step,
        )
        .unwrap()
        .to_vec();
    let v = m.dims().vocab_size;
    for (r, &id) in ids.iter().enumerate() {
        assert_eq!(id, argmax(&logits.row(r)[..v]));
        assert_eq!(m.step_logits_row(&step, r).unwrap(), logits.row(r));
    }
    // Another pass makes the step's logits unavailable, with an error.
    m.prefill(&[1, 2], &mut b[0], LogitsWant::None).unwrap();
    assert!(m.step_logits_row(&step, 0).is_err());
}
