//! How far a model whose `ssm` state is stored in 16 bits (`--state-dtype bf16|f16`)
//! drifts from the same model with an f32 state: both read the same prompt, then the f32
//! model decodes greedily and both are fed its tokens, so that every step compares the
//! two models' logits for the same history. `mamba3 bench-state-drift` reports it.

use super::{LogitsWant, Model};
use crate::error::{Error, Result};

/// The comparison of two models' logits over a greedy decode.
#[derive(Clone, Debug, PartialEq)]
pub struct Drift {
    /// Positions compared: the prompt's last, then one per decoded token.
    pub steps: usize,
    /// Of those, the positions where both models' greedy choice is the same token.
    pub agree: usize,
    /// The first position (0: the prompt's last) where the choices differ.
    pub first_disagreement: Option<usize>,
    /// max |logit difference| over every position and token.
    pub max_abs: f32,
    /// The mean over positions of each position's max |logit difference|.
    pub mean_max_abs: f64,
}

impl Drift {
    /// The share of positions where both models choose the same token.
    pub fn agreement(&self) -> f64 {
        self.agree as f64 / self.steps.max(1) as f64
    }
}

/// Compare `narrow` against `reference` (the same weights, another state dtype) over the
/// prompt and `tokens` greedily decoded tokens of `reference`.
pub fn state_drift(
    reference: &Model,
    narrow: &Model,
    prompt: &[u32],
    tokens: usize,
) -> Result<Drift> {
    if reference.fingerprint() != narrow.fingerprint() {
        return Err(Error::input(
            "the state drift compares one model with two state dtypes; these are two models",
        ));
    }
    if prompt.is_empty() {
        return Err(Error::input(
            "the state drift needs a prompt of at least one token",
        ));
    }
    let vocab = reference.dims().vocab_size;
    let (mut sr, mut sn) = (reference.new_state(), narrow.new_state());
    let mut lr = reference.prefill(prompt, &mut sr, LogitsWant::Last)?;
    let mut ln = narrow.prefill(prompt, &mut sn, LogitsWant::Last)?;
    let mut d = Drift {
        steps: 0,
        agree: 0,
        first_disagreement: None,
        max_abs: 0.0,
        mean_max_abs: 0.0,
    };
    let mut sum = 0.0;
    for step in 0..=tokens {
        let (a, b) = (&lr.row(0)[..vocab], &ln.row(0)[..vocab]);
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        d.max_abs = d.max_abs.max(diff);
        sum += diff as f64;
        let next = argmax(a);
        d.steps += 1;
        if next == argmax(b) {
            d.agree += 1;
        } else if d.first_disagreement.is_none() {
            d.first_disagreement = Some(step);
        }
        if step == tokens {
            break;
        }
        lr = reference.decode(&[next], &mut [&mut sr])?;
        ln = narrow.decode(&[next], &mut [&mut sn])?;
    }
    d.mean_max_abs = sum / d.steps as f64;
    Ok(d)
}

/// The first index of the largest value.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
