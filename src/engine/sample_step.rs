//! [`SampleStep`]: what a decode step that samples ([`crate::engine::Model::decode_sample`])
//! hands back — the chosen token of each row, whether its logits were finite, and for the
//! rows whose sampler asks ([`SamplingParams::logprobs`](super::SamplingParams)) the
//! token's log-probabilities — in buffers kept from step to step.
//!
//! On the CPU the step's logits come to the host and each row is sampled by its
//! [`Sampler`] ([`sample_rows_on_host`]); on a GPU the rows are sampled on the device and
//! only the ids (and the few log-probabilities asked for) come back
//! (`engine/cuda/sample.rs`).

use super::logits::StepLogits;
use super::logprobs::{row_logprobs, TokenLogprobs};
use super::sampling::Sampler;

/// The ids of one decode step, kept across steps.
#[derive(Default)]
pub struct SampleStep {
    pub(crate) ids: Vec<u32>,
    pub(crate) finite: Vec<bool>,
    /// Per row: the log-probabilities its sampler asked for (`None`: not asked, or the
    /// row was not finite).
    pub(crate) logprobs: Vec<Option<TokenLogprobs>>,
    /// The step's logits when they came to the host (the CPU's path); empty otherwise.
    pub(crate) logits: StepLogits,
    pub(crate) on_host: bool,
}

impl SampleStep {
    pub fn new() -> SampleStep {
        SampleStep::default()
    }

    /// The chosen token of each row (0 for a row whose logits were not finite).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Whether row `b`'s logits were all finite (a row that was not is not sampled: its
    /// id means nothing).
    pub fn finite(&self, b: usize) -> bool {
        self.finite[b]
    }

    /// Row `b`'s log-probabilities, when its sampler asked for them
    /// ([`SamplingParams::logprobs`](super::SamplingParams)) and the row was finite.
    pub fn logprobs(&self, b: usize) -> Option<&TokenLogprobs> {
        self.logprobs.get(b).and_then(Option::as_ref)
    }

    pub(crate) fn clear(&mut self) {
        self.ids.clear();
        self.finite.clear();
        self.logprobs.clear();
        self.on_host = false;
    }
}

/// Whether every value is finite. A non-finite f32 has all exponent bits set; the fold
/// over each block has no early exit, so it vectorises (a 128k-entry row in ~10 µs).
pub fn all_finite(values: &[f32]) -> bool {
    values.chunks(4096).all(|c| {
        c.iter().fold(0u32, |acc, x| {
            acc | u32::from(x.to_bits() & 0x7f80_0000 == 0x7f80_0000)
        }) == 0
    })
}

/// Sample each row of `step.logits` (`vocab` tokens of each) with its sampler, into
/// `step.ids` and `step.finite`. A row that is not finite is not sampled.
pub(crate) fn sample_rows_on_host(
    samplers: &mut [&mut Sampler],
    step: &mut SampleStep,
    vocab: usize,
) {
    let logits = &step.logits;
    // A greedy row costs an argmax (~2 µs at 32k entries), a row that draws or reports
    // log-probabilities about ten times more (softmax over the vocabulary, top-p
    // sorting). Handing work to the thread pool and waiting for it costs tens of µs, so
    // only a step with enough of it goes there.
    let cost: usize = samplers
        .iter()
        .map(|s| {
            let p = s.params();
            if p.is_greedy() && p.logprobs.is_none() {
                1
            } else {
                8
            }
        })
        .sum();
    let one = |(b, s): (usize, &mut &mut Sampler)| {
        let row = &logits.row(b)[..vocab];
        all_finite(row).then(|| {
            let t = s.sample(row);
            (t, s.params().logprobs.map(|n| row_logprobs(row, t, n)))
        })
    };
    let out: Vec<Option<(u32, Option<TokenLogprobs>)>> = if cost < 16 {
        samplers.iter_mut().enumerate().map(one).collect()
    } else {
        use rayon::prelude::*;
        samplers.par_iter_mut().enumerate().map(one).collect()
    };
    step.ids = out.iter().map(|t| t.as_ref().map_or(0, |t| t.0)).collect();
    step.finite = out.iter().map(Option::is_some).collect();
    step.logprobs = out.into_iter().map(|t| t.and_then(|t| t.1)).collect();
    step.on_host = true;
}

#[cfg(test)]
mod tests {
    use crate::engine::sampling::{Sampler, SamplingParams};
    use crate::engine::{Device, LogitsWant, Model, SampleStep, State, StepLogits};
    use crate::mixers::mamba3::Weights;
    use crate::model::{Config, DType};

    fn model() -> Model {
        let cfg = Config::synthetic(64, 2, 16, 16, 2, 1, 300);
        Model::from_weights(Weights::synthetic(cfg, DType::F32, 5).unwrap(), Device::Cpu).unwrap()
    }

    fn prompt(i: usize) -> Vec<u32> {
        (0..5 + i as u32).map(|t| (t * 37 + 11) % 300).collect()
    }

    fn primed(m: &Model, n: usize) -> Vec<State> {
        (0..n)
            .map(|i| {
                let mut s = m.new_state();
                m.prefill(&prompt(i), &mut s, LogitsWant::None).unwrap();
                s
            })
            .collect()
    }

    /// Option sets of every kind, seeded.
    fn params(i: usize) -> SamplingParams {
        let seed = Some(100 + i as u64);
        let base = SamplingParams {
            seed,
            ..Default::default()
        };
        match i % 6 {
            0 => SamplingParams::greedy(),
            1 => SamplingParams {
                temperature: 0.8,
                ..base
            },
            2 => SamplingParams {
                top_k: 5,
                top_p: 0.9,
                ..base
            },
            3 => SamplingParams {
                min_p: 0.05,
                repetition_penalty: 1.3,
                ..base
            },
            4 => SamplingParams {
                frequency_penalty: 0.7,
                presence_penalty: 0.4,
                logit_bias: vec![(7, 3.0), (9, -2.0)],
                ..base
            },
            _ => SamplingParams {
                repetition_penalty: 1.5,
                logit_bias: vec![(3, 1.0)],
                ..SamplingParams::greedy()
            },
        }
    }

    /// On the CPU, `decode_sample` picks exactly what sampling `decode_into`'s rows with the
    /// same samplers picks (same seeds, same tokens), advances the states alike, and keeps
    /// each step's rows for `step_logits_row`.
    #[test]
    fn decode_sample_equals_sampling_the_logits() {
        let m = model();
        let n = 7;
        let (mut a, mut b) = (primed(&m, n), primed(&m, n));
        let mk = || -> Vec<Sampler> {
            (0..n)
                .map(|i| Sampler::new(params(i), &prompt(i)))
                .collect()
        };
        let (mut sa, mut sb) = (mk(), mk());
        let mut toks: Vec<u32> = (0..n as u32).map(|i| i * 13 % 300).collect();
        let (mut logits, mut step) = (StepLogits::new(), SampleStep::new());
        for _ in 0..6 {
            m.decode_into(&toks, &mut a.iter_mut().collect::<Vec<_>>(), &mut logits)
                .unwrap();
            let want: Vec<u32> = sa
                .iter_mut()
                .enumerate()
                .map(|(r, s)| s.sample(&logits.row(r)[..300]))
                .collect();
            let got = m
                .decode_sample(
                    &toks,
                    &mut b.iter_mut().collect::<Vec<_>>(),
                    &mut sb.iter_mut().collect::<Vec<_>>(),
                    &mut step,
                )
                .unwrap()
                .to_vec();
            assert_eq!(got, want);
            assert!((0..n).all(|r| step.finite(r)));
            for r in 0..n {
                assert_eq!(m.step_logits_row(&step, r).unwrap(), logits.row(r));
            }
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x.position(), y.position());
                assert_eq!(x.to_host().unwrap(), y.to_host().unwrap());
            }
            for (r, &t) in got.iter().enumerate() {
                sa[r].accept(t);
                sb[r].accept(t);
            }
            toks = got;
        }
        // One sampler per token, or a clear error and no ids.
        let err = m
            .decode_sample(
                &toks,
                &mut b.iter_mut().collect::<Vec<_>>(),
                &mut [],
                &mut step,
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("one sampler per token") && err.contains("7 tokens, 0 samplers"),
            "{err}"
        );
        assert!(step.ids().is_empty());
        assert!(m.step_logits_row(&step, 0).is_err());
    }

    /// The log-probabilities a step reports are log_softmax of the same step's raw logits
    /// (in f64, within 1e-6 of each value's size), for the rows that ask alone, whatever
    /// their sampling options; the top-n are the n best of the row, ties to the lower id.
    #[test]
    fn logprobs_are_log_softmax_of_the_steps_logits() {
        let m = model();
        let n = 6;
        let (mut a, mut b) = (primed(&m, n), primed(&m, n));
        let asks = [Some(0), None, Some(5), Some(20), None, Some(1)];
        let mut sb: Vec<Sampler> = (0..n)
            .map(|i| {
                let p = SamplingParams {
                    logprobs: asks[i],
                    ..params(i)
                };
                Sampler::new(p, &prompt(i))
            })
            .collect();
        let mut toks: Vec<u32> = (0..n as u32).map(|i| i * 29 % 300).collect();
        let (mut logits, mut step) = (StepLogits::new(), SampleStep::new());
        for _ in 0..4 {
            m.decode_into(&toks, &mut a.iter_mut().collect::<Vec<_>>(), &mut logits)
                .unwrap();
            let ids = m
                .decode_sample(
                    &toks,
                    &mut b.iter_mut().collect::<Vec<_>>(),
                    &mut sb.iter_mut().collect::<Vec<_>>(),
                    &mut step,
                )
                .unwrap()
                .to_vec();
            for r in 0..n {
                let row = &logits.row(r)[..300];
                let max = row.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y as f64));
                let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                let want = |t: u32| row[t as usize] as f64 - max - sum.ln();
                let close = |got: f32, t: u32| {
                    (got as f64 - want(t)).abs() <= 1e-6 * want(t).abs().max(1.0)
                };
                let Some(k) = asks[r] else {
                    assert!(step.logprobs(r).is_none());
                    continue;
                };
                let lp = step.logprobs(r).expect("asked for");
                assert_eq!(lp.token, ids[r]);
                assert!(
                    close(lp.logprob, ids[r]),
                    "row {r}: {} vs {}",
                    lp.logprob,
                    want(ids[r])
                );
                let mut order: Vec<u32> = (0..300).collect();
                order.sort_by(|&x, &y| row[y as usize].total_cmp(&row[x as usize]).then(x.cmp(&y)));
                let top: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
                assert_eq!(top, order[..k], "row {r}");
                assert!(lp.top.iter().all(|&(t, v)| close(v, t)));
            }
            for (r, &t) in ids.iter().enumerate() {
                sb[r].accept(t);
            }
            toks = ids;
        }
    }

    #[test]
    fn count_words_hold_the_seen_and_generated_tokens() {
        let p = SamplingParams {
            repetition_penalty: 1.2,
            frequency_penalty: 0.5,
            ..Default::default()
        };
        let mut s = Sampler::new(p, &[4, 9]);
        s.accept(9);
        s.accept(2);
        s.accept(2);
        let seen = super::super::sampling::SEEN_BIT;
        assert_eq!(
            s.count_words(),
            vec![(2, seen | 2), (4, seen), (9, seen | 1)]
        );
        // Without penalties nothing is kept.
        let mut s = Sampler::new(SamplingParams::default(), &[4]);
        s.accept(4);
        assert!(s.count_words().is_empty());
    }
}
