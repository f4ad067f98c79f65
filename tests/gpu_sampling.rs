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
use mamba3::engine::{row_logprobs, Device, LogitsWant, Model, SampleStep, StepLogits};
use mamba3::engine::{State, TokenLogprobs};
use mamba3::mixers::family_synthetic::{mamba1, mamba2, mamba2_config};
use mamba3::mixers::mamba3::Weights;
use mamba3::mixers::mimo::{mimo_config_from_json_str, MimoWeights};
use mamba3::mixers::MixerWeights;
use mamba3::model::family_config::Mamba1Config;
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
    let step = sample_step(g, ds, rows, ld, samplers, check_finite);
    let finite = (0..samplers.len()).map(|b| step.finite(b)).collect();
    (step.ids().to_vec(), finite)
}

/// [`sample`], the whole step (with the log-probabilities asked for).
fn sample_step(
    g: &Gpu,
    ds: &mut DeviceSampler,
    rows: &[f32],
    ld: usize,
    samplers: &mut [Sampler],
    check_finite: bool,
) -> SampleStep {
    let buf = g.upload(rows).unwrap();
    let mut step = SampleStep::new();
    let mut refs: Vec<&mut Sampler> = samplers.iter_mut().collect();
    ds.sample(buf.ptr, ld, &mut refs, check_finite, &mut step)
        .unwrap();
    step
}

/// Two log-probabilities agree: both NaN, the same infinity, or within 1e-5 of the size.
fn agree(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan())
        || a == b
        || (a as f64 - b as f64).abs() <= 1e-5 * (b as f64).abs().max(1.0)
}

/// The device's log-probabilities of a row equal the host's (`row_logprobs`) on the same
/// row: the same ids in the same order, the values within 1e-5.
fn assert_logprobs_agree(got: &TokenLogprobs, want: &TokenLogprobs, what: &str) {
    assert_eq!(got.token, want.token, "{what}");
    assert!(
        agree(got.logprob, want.logprob),
        "{what}: {} vs {}",
        got.logprob,
        want.logprob
    );
    let ids = |t: &TokenLogprobs| t.top.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(ids(got), ids(want), "{what}");
    for (a, b) in got.top.iter().zip(&want.top) {
        assert!(agree(a.1, b.1), "{what}: token {}: {} vs {}", a.0, a.1, b.1);
    }
}

/// Log-probabilities computed in the sampling kernel's block equal the host's of the same
/// rows (vocabularies of 1000 and 128256; ties; rows of NaN and −∞ entries, all NaN, all
/// −∞, a +∞; padding past the vocabulary larger than every token), for top-n of 0, 1, 7
/// and 20, greedy and drawn rows, and none for the rows that do not ask.
#[test]
#[ignore = "needs a CUDA device"]
fn device_logprobs_equal_the_host_computation() {
    let g = gpu();
    let mut rng = Rng::new(17);
    for vocab in [1000usize, 128_256] {
        let ld = vocab.next_multiple_of(64) + 64;
        let mut ds = DeviceSampler::new(&g, vocab).unwrap();
        let nb = 14;
        let mut rows = vec![0f32; nb * ld];
        for (b, row) in rows.chunks_mut(ld).enumerate() {
            for x in row[..vocab].iter_mut() {
                *x = if b.is_multiple_of(2) {
                    rng.below(9) as f32 * 0.75 // few values: ties everywhere
                } else {
                    (rng.uniform() as f32) * 30.0 - 15.0
                };
            }
            row[vocab..].fill(1000.0);
            match b {
                0 => row[..vocab].fill(f32::NAN),
                1 => row[..vocab].fill(f32::NEG_INFINITY),
                2 => {
                    for _ in 0..50 {
                        row[rng.below(vocab as u64) as usize] = f32::NAN;
                    }
                    for _ in 0..50 {
                        row[rng.below(vocab as u64) as usize] = f32::NEG_INFINITY;
                    }
                }
                3 => row[rng.below(vocab as u64) as usize] = f32::INFINITY,
                4 => {
                    row[..vocab].fill(f32::NEG_INFINITY);
                    row[5] = 2.0;
                    row[vocab - 1] = 2.0;
                }
                _ => {}
            }
        }
        let asks = [Some(20), Some(7), Some(1), Some(0), None];
        let mut samplers: Vec<Sampler> = (0..nb)
            .map(|b| {
                let p = SamplingParams {
                    logprobs: asks[b % asks.len()],
                    seed: Some(b as u64),
                    ..if b.is_multiple_of(3) {
                        SamplingParams::greedy()
                    } else {
                        SamplingParams::default()
                    }
                };
                Sampler::new(p, &[])
            })
            .collect();
        let step = sample_step(&g, &mut ds, &rows, ld, &mut samplers, false);
        for (b, row) in rows.chunks(ld).enumerate() {
            let what = format!("vocab {vocab}, row {b}");
            let Some(n) = asks[b % asks.len()] else {
                assert!(step.logprobs(b).is_none(), "{what}");
                continue;
            };
            let want = row_logprobs(&row[..vocab], step.ids()[b], n);
            let got = step.logprobs(b).unwrap_or_else(|| panic!("{what}: none"));
            assert_logprobs_agree(got, &want, &what);
        }
        // Checked for finiteness, the rows holding NaN or ±∞ get none.
        let step = sample_step(&g, &mut ds, &rows, ld, &mut samplers, true);
        for b in 0..5 {
            assert!(!step.finite(b) && step.logprobs(b).is_none());
        }
    }
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

/// Mamba-1, Mamba-2 and MIMO models (f32) with a vocabulary of 300.
fn family_models() -> Vec<(&'static str, MixerWeights)> {
    let m1 = Mamba1Config {
        d_inner: 64,
        d_state: 16,
        d_conv: 4,
        dt_rank: 4,
        conv_bias: true,
        proj_bias: false,
        bcdt_rms_eps: None,
    };
    let mimo = mimo_config_from_json_str(
        r#"{"d_model": 32, "n_layer": 2, "vocab_size": 300, "d_intermediate": 0,
            "tie_embeddings": true, "ssm_cfg": {"layer": "Mamba3", "d_state": 16,
            "headdim": 8, "expand": 2, "ngroups": 1, "rope_fraction": 0.5,
            "chunk_size": 16, "is_mimo": true, "mimo_rank": 2}}"#,
        "test",
    )
    .unwrap();
    vec![
        (
            "mamba1",
            MixerWeights::Mamba1(Arc::new(mamba1(m1, 32, 2, 300, 5))),
        ),
        (
            "mamba2",
            MixerWeights::Mamba2(Arc::new(mamba2(
                mamba2_config(32, 16, 1, 16),
                32,
                2,
                300,
                6,
            ))),
        ),
        (
            "mimo",
            MixerWeights::Mimo(Arc::new(
                MimoWeights::synthetic(mimo, DType::F32, 7).unwrap(),
            )),
        ),
    ]
}

/// Each family mixer's `decode_sample` on the GPU (eager, then through a captured decode
/// graph) picks, over 40 greedy steps with bias and penalties, exactly the tokens the host
/// sampler picks from the same model's `decode_into` rows, and the log-probabilities it
/// reports equal the host's of those rows; a step's row fetched afterwards is the step's.
#[test]
#[ignore = "needs a CUDA device"]
fn family_decode_sample_equals_the_host_sampler() {
    for (what, w) in family_models() {
        let m = Model::from_mixer_weights(w, Device::Cuda(0)).unwrap();
        let v = m.dims().vocab_size;
        for graph in [false, true] {
            if graph {
                m.capture_decode_graph(8).unwrap();
            }
            let n = 5;
            let (mut a, mut b): (Vec<State>, Vec<State>) = (primed(&m, n), primed(&m, n));
            let params = |i: usize| SamplingParams {
                repetition_penalty: 1.0 + 0.2 * i as f32,
                frequency_penalty: if i.is_multiple_of(2) { 0.5 } else { 0.0 },
                presence_penalty: if i.is_multiple_of(3) { 0.3 } else { 0.0 },
                logit_bias: vec![(i as u32 * 7, 1.5)],
                logprobs: [Some(3), None, Some(20), Some(0), None][i],
                ..SamplingParams::greedy()
            };
            let prompt: Vec<u32> = (0..12).map(|t| t * 13 % 300).collect();
            let mut host: Vec<Sampler> = (0..n).map(|i| Sampler::new(params(i), &prompt)).collect();
            let mut dev: Vec<Sampler> = (0..n).map(|i| Sampler::new(params(i), &prompt)).collect();
            let mut toks: Vec<u32> = (0..n as u32).map(|i| i * 11).collect();
            let (mut logits, mut step) = (StepLogits::new(), SampleStep::new());
            for s in 0..40 {
                m.decode_into(&toks, &mut a.iter_mut().collect::<Vec<_>>(), &mut logits)
                    .unwrap();
                let ids = m
                    .decode_sample(
                        &toks,
                        &mut b.iter_mut().collect::<Vec<_>>(),
                        &mut dev.iter_mut().collect::<Vec<_>>(),
                        &mut step,
                    )
                    .unwrap()
                    .to_vec();
                for r in 0..n {
                    let row = &logits.row(r)[..v];
                    let want = host[r].sample(row);
                    let at = format!("{what}, graph {graph}, step {s}, row {r}");
                    assert_eq!(ids[r], want, "{at}");
                    assert!(step.finite(r));
                    match params(r).logprobs {
                        Some(k) => assert_logprobs_agree(
                            step.logprobs(r).unwrap(),
                            &row_logprobs(row, want, k),
                            &at,
                        ),
                        None => assert!(step.logprobs(r).is_none()),
                    }
                    if s == 39 {
                        assert_eq!(m.step_logits_row(&step, r).unwrap(), logits.row(r));
                    }
                    host[r].accept(want);
                    dev[r].accept(want);
                }
                toks = ids;
            }
            m.clear_graphs().unwrap();
        }
    }
}
