//! The generation loop, shared by `mamba3 generate` and the server.
//!
//! [`Continuation`] is one sequence's output side: from each row of logits it samples a
//! token, turns it into text (streaming detokenization), applies the stop rules and says
//! when the sequence is finished. The server drives many of them from one batched decode;
//! [`generate`] drives one, with the prompt prefilled in chunks.

use super::detok::StreamDecoder;
use super::sampling::{Sampler, SamplingParams};
use super::stop::StopMatcher;
use super::tokenizer::Tokenizer;
use crate::engine::{LogitsWant, Model, SampleStep, State, StepLogits};
use crate::error::Result;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything a request says about how to continue a prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the tokenizer's end-of-sequence ids.
    pub ignore_eos: bool,
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop string, a stop token or end-of-sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Ended by the server (shutting down) before either.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// The result of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOut {
    pub token: u32,
    /// Text that became final with this token (may be empty).
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// One sequence's output side: [`TokenRules`] (sampling and the rules that look only at
/// token ids) and [`TextRules`] (detokenizing and stop strings). The server runs the two
/// halves on different threads (the text side one step behind, see `serve::emitter`);
/// together they are this.
pub struct Continuation {
    tokens: TokenRules,
    text: TextRules,
    finished: Option<FinishReason>,
}

/// How a token ends its sequence by its id alone, before its text is looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenEnd {
    /// A stop token id or end-of-sequence: the token adds no text.
    StopId,
    /// `max_tokens` reached (unless the token's text completes a stop string).
    Length,
}

/// The token side of a continuation: the sampler, stop ids and `max_tokens`.
pub struct TokenRules {
    sampler: Sampler,
    stop_ids: Vec<u32>,
    max_tokens: usize,
    generated: Vec<u32>,
}

/// The text side of a continuation: streaming detokenization and stop strings.
pub struct TextRules {
    stop: StopMatcher,
    detok: Option<(Arc<Tokenizer>, StreamDecoder)>,
}

impl TokenRules {
    /// `prompt` feeds the repetition penalty; `tokenizer` (if any) gives the
    /// end-of-sequence ids.
    pub fn new(params: &GenParams, prompt: &[u32], tokenizer: Option<&Tokenizer>) -> Self {
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            if let Some(t) = tokenizer {
                stop_ids.extend(&t.eos_ids);
            }
        }
        TokenRules {
            sampler: Sampler::new(params.sampling.clone(), prompt),
            stop_ids,
            max_tokens: params.max_tokens,
            generated: Vec::new(),
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }
    pub fn sampler_mut(&mut self) -> &mut Sampler {
        &mut self.sampler
    }

    /// Take `token` as the next one (accepted into the sampler) and say whether its id
    /// ends the sequence.
    pub fn push(&mut self, token: u32) -> Option<TokenEnd> {
        self.sampler.accept(token);
        self.generated.push(token);
        if self.stop_ids.contains(&token) {
            Some(TokenEnd::StopId)
        } else if self.generated.len() >= self.max_tokens {
            Some(TokenEnd::Length)
        } else {
            None
        }
    }
}

impl TextRules {
    pub fn new(params: &GenParams, tokenizer: Option<Arc<Tokenizer>>) -> Self {
        TextRules {
            stop: StopMatcher::new(&params.stop),
            detok: tokenizer.map(|t| (t, StreamDecoder::new())),
        }
    }

    /// The text of one token alone, as a list of alternatives shows it: the tokenizer's
    /// decoding of it (special tokens included), or `token_id:N` without a tokenizer.
    pub fn token_text(&self, token: u32) -> String {
        match &self.detok {
            Some((tok, _)) => tok
                .decode(&[token], false)
                .unwrap_or_else(|_| format!("token_id:{token}")),
            None => format!("token_id:{token}"),
        }
    }

    /// The text `token` makes final and how the sequence ends, given how its id ends it
    /// (`end`, from [`TokenRules::push`]).
    pub fn push(&mut self, token: u32, end: Option<TokenEnd>) -> StepOut {
        let mut finish = None;
        let mut text = String::new();
        let mut cut = false;
        if end == Some(TokenEnd::StopId) {
            finish = Some(FinishReason::Stop);
        } else if let Some((tok, d)) = &mut self.detok {
            let r = self.stop.push(&d.push(tok, token));
            text = r.text;
            cut = r.stopped;
            if cut {
                finish = Some(FinishReason::Stop);
            }
        }
        if finish.is_none() && end == Some(TokenEnd::Length) {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() && !cut {
            // The end: let out what the detokenizer and the stop matcher still hold.
            if let Some((tok, d)) = &mut self.detok {
                let r = self.stop.push(&d.flush(tok));
                text.push_str(&r.text);
                if r.stopped {
                    finish = Some(FinishReason::Stop);
                } else {
                    text.push_str(&self.stop.flush());
                }
            }
        }
        StepOut {
            token,
            text,
            finish,
        }
    }
}

impl Continuation {
    /// `prompt` feeds the repetition penalty; `tokenizer` (if any) turns tokens into text
    /// and gives the end-of-sequence ids.
    pub fn new(params: &GenParams, prompt: &[u32], tokenizer: Option<Arc<Tokenizer>>) -> Self {
        Continuation {
            tokens: TokenRules::new(params, prompt, tokenizer.as_deref()),
            text: TextRules::new(params, tokenizer),
            finished: None,
        }
    }

    pub fn generated(&self) -> &[u32] {
        self.tokens.generated()
    }
    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }
    /// Its sampler, for a decode step that samples ([`Model::decode_sample`]): the token
    /// it picks goes to [`Continuation::push`].
    pub fn sampler_mut(&mut self) -> &mut Sampler {
        self.tokens.sampler_mut()
    }

    /// Whether the next token is the argmax (temperature 0), a cheap step.
    pub fn is_greedy(&self) -> bool {
        self.tokens.sampler.params().is_greedy()
    }

    /// Sample the next token from `logits` (exactly `vocab_size` entries), and say what
    /// text it adds and whether the sequence is done.
    pub fn step(&mut self, logits: &[f32]) -> StepOut {
        let token = self.tokens.sampler.sample(logits);
        self.push(token)
    }

    /// Take `token` as the next one (sampled elsewhere, or forced).
    pub fn push(&mut self, token: u32) -> StepOut {
        let end = self.tokens.push(token);
        let out = self.text.push(token, end);
        self.finished = out.finish;
        out
    }
}

pub use crate::engine::sample_step::all_finite;

/// The first layer whose part of `state` holds a non-finite value (layer `l`'s state
/// depends only on layers up to `l`, so this is where the values went bad first).
pub fn first_non_finite_layer(state: &State) -> Option<usize> {
    let tensors = state.tensors().ok()?;
    tensors
        .iter()
        .filter(|(_, t)| {
            !t.bytes
                .chunks_exact(4)
                .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
        })
        .filter_map(|(name, _)| name.split('.').nth(1)?.parse().ok())
        .min()
}

/// The error for a step whose logits are not all finite, instead of sampling from them:
/// names the layer where the values went bad, from the state the step left.
pub fn non_finite_logits(state: &State, position: u64) -> crate::Error {
    let place = match first_non_finite_layer(state) {
        Some(l) => format!(
            "layer {l} is the first whose state holds non-finite values (its mixer, or the \
             residual stream it reads)"
        ),
        None => "every layer's state is finite, so the values went bad after the last mixer \
                 (an MLP, the final norm or the head)"
            .to_string(),
    };
    crate::Error::NonFinite(format!(
        "the logits after {position} tokens are NaN or infinite: {place}; the weights were \
         checked finite at load, so an activation overflowed (try --dtype f32)"
    ))
}

/// Timings of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prefill: Duration,
    pub generated: usize,
    pub decode: Duration,
    pub finish: Option<FinishReason>,
}

/// Prefill `tokens` into `state` in chunks of `chunk` tokens (continued windows, exact),
/// calling `progress(done, total)` after each; returns the logits row of the last token
/// (`vocab_padded` entries).
pub fn prefill_chunked(
    model: &Model,
    tokens: &[u32],
    state: &mut State,
    chunk: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<f32>> {
    let mut last = Vec::new();
    let mut done = 0;
    for piece in tokens.chunks(chunk.max(1)) {
        last = model.prefill(piece, state, LogitsWant::Last)?.data;
        done += piece.len();
        progress(done, tokens.len());
    }
    Ok(last)
}

/// Generate from `state` after `prompt`: prefill the prompt in chunks, then decode one
/// token at a time until the continuation finishes; `on_step` sees every step. When the
/// prompt is empty, `last_logits` must hold the logits of the state's last token.
/// On return the state has read the prompt and every generated token but the last
/// (`feed_last` feeds that one too, so the state holds the whole text).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    model: &Model,
    state: &mut State,
    prompt: &[u32],
    last_logits: Option<Vec<f32>>,
    cont: &mut Continuation,
    chunk: usize,
    feed_last: bool,
    mut progress: impl FnMut(usize, usize),
    mut on_step: impl FnMut(&StepOut),
) -> Result<GenStats> {
    let vocab = model.dims().vocab_size;
    let t0 = Instant::now();
    let first = if prompt.is_empty() {
        last_logits.ok_or_else(|| {
            crate::Error::input(
                "nothing to continue from: the prompt is empty and no logits were given",
            )
        })?
    } else {
        prefill_chunked(model, prompt, state, chunk, &mut progress)?
    };
    model.synchronize()?;
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        prefill,
        ..Default::default()
    };
    if cont.tokens.max_tokens == 0 {
        // Nothing to generate: the state has read the prompt, and that is the result.
        stats.finish = Some(FinishReason::Length);
        return Ok(stats);
    }
    // Each step samples where its logits are (on a GPU, on the device), into one buffer.
    let mut step = SampleStep::new();
    if !all_finite(&first[..vocab]) {
        return Err(non_finite_logits(state, state.position()));
    }
    let mut out = cont.step(&first[..vocab]);
    loop {
        on_step(&out);
        stats.generated += 1;
        if out.finish.is_some() {
            stats.finish = out.finish;
            if feed_last {
                model.decode_into(&[out.token], &mut [state], &mut StepLogits::new())?;
            }
            break;
        }
        let token = model.decode_sample(
            &[out.token],
            &mut [&mut *state],
            &mut [cont.sampler_mut()],
            &mut step,
        )?[0];
        if !step.finite(0) {
            return Err(non_finite_logits(state, state.position()));
        }
        out = cont.push(token);
    }
    model.synchronize()?;
    stats.decode = t1.elapsed();
    Ok(stats)
}
