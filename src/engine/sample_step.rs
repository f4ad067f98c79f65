//! [`SampleStep`]: what a decode step that samples ([`crate::engine::Model::decode_sample`])
//! hands back — the chosen token of each row and whether its logits were finite — in
//! buffers kept from step to step.
//!
//! On the CPU the step's logits come to the host and each row is sampled by its
//! [`Sampler`] ([`sample_rows_on_host`]); on a GPU the rows are sampled on the device and
//! only the ids come back (`engine/cuda/sample.rs`).

use super::logits::StepLogits;
use super::sampling::Sampler;

/// The ids of one decode step, kept across steps.
#[derive(Default)]
pub struct SampleStep {
    pub(crate) ids: Vec<u32>,
    pub(crate) finite: Vec<bool>,
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

    pub(crate) fn clear(&mut self) {
        self.ids.clear();
        self.finite.clear();
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
pub(crate) fn sample_rows_on_host(samplers: &mut [&mut Sampler], step: &mut SampleStep, vocab: usize) {
    let logits = &step.logits;
    // A greedy row costs an argmax (~2 µs at 32k entries), a row that draws about ten
    // times more (softmax over the vocabulary, top-p sorting). Handing work to the thread
    // pool and waiting for it costs tens of µs, so only a step with enough of it goes there.
    let cost: usize = samplers
        .iter()
        .map(|s| if s.params().is_greedy() { 1 } else { 8 })
        .sum();
    let one = |(b, s): (usize, &mut &mut Sampler)| {
        let row = &logits.row(b)[..vocab];
        all_finite(row).then(|| s.sample(row))
    };
    let out: Vec<Option<u32>> = if cost < 16 {
        samplers.iter_mut().enumerate().map(one).collect()
    } else {
        use rayon::prelude::*;
        samplers.par_iter_mut().enumerate().map(one).collect()
    };
    step.ids = out.iter().map(|t| t.unwrap_or(0)).collect();
    step.finite = out.iter().map(Option::is_some).collect();
    step.on_host = true;
}
