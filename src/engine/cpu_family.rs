//! The CPU backend of the mixers other than Mamba-3 SISO (which has its own packed-batch
//! pipeline in `cpu.rs`): Mamba-3 MIMO, Mamba-1 and Mamba-2, each through its mixer's fast
//! CPU paths on the engine's flat states.
//!
//! A pass of several sequences prefills each from its own state in turn (each prefill is
//! parallel inside); a pass of one token per sequence is a decode step, batched where the
//! mixer has a batched step (Mamba-1, Mamba-2: every weight read once for the batch).

use super::backend::Backend;
use super::logits::{HostBuf, LogitsWant, StepLogits};
use super::state::StateData;
use crate::error::{Error, Result};
use crate::mixers::{mamba1, mamba2, mimo, MixerWeights};
use crate::model::state_layout::StateBuf;

pub struct FamilyCpu {
    weights: MixerWeights,
}

impl FamilyCpu {
    /// A backend for `weights`; an error for Mamba-3 SISO, which `CpuModel` runs.
    pub fn new(weights: MixerWeights) -> Result<FamilyCpu> {
        if let MixerWeights::Mamba3(_) = weights {
            return Err(Error::input(
                "Mamba-3 SISO runs on the engine's CpuModel, not FamilyCpu",
            ));
        }
        Ok(FamilyCpu { weights })
    }

    /// One sequence's window from its state: the rows `want` asks for, logits with `head`,
    /// else the hidden states after `norm_f`.
    pub fn prefill(
        &self,
        tokens: &[u32],
        state: &mut StateBuf<f32>,
        want: LogitsWant,
        head: bool,
    ) -> Result<Vec<f32>> {
        match &self.weights {
            MixerWeights::Mimo(w) => {
                mimo::mimo_prefill_rows(w, tokens, state, mimo_chunk_len(w.dims.rank), want, head)
            }
            MixerWeights::Mamba1(w) => mamba1::prefill::prefill_rows(w, state, tokens, want, head),
            MixerWeights::Mamba2(w) => mamba2::prefill::prefill_rows(w, state, tokens, want, head),
            MixerWeights::Mamba3(_) => unreachable!("refused by FamilyCpu::new"),
        }
    }

    /// One token for each sequence: logits `[batch, vocab_padded]`.
    fn step(&self, tokens: &[u32], states: &mut [&mut StateBuf<f32>]) -> Result<Vec<f32>> {
        match &self.weights {
            MixerWeights::Mamba1(w) => mamba1::step::step(w, states, tokens),
            MixerWeights::Mamba2(w) => mamba2::step::step(w, states, tokens),
            _ => {
                let mut out = Vec::new();
                for (&t, st) in tokens.iter().zip(states.iter_mut()) {
                    out.extend(self.prefill(&[t], st, LogitsWant::Last, true)?);
                }
                Ok(out)
            }
        }
    }
}

/// The MIMO prefill's chunk on the CPU: about 32 rows (`L·R`) per chunk, whatever the
/// config's `chunk_size` (which only changes rounding). Measured with `benches/mimo_chunk.rs`
/// (docs/decisions.md, "MIMO CPU chunk length").
fn mimo_chunk_len(rank: usize) -> usize {
    (32 / rank.max(1)).max(1)
}

impl Backend for FamilyCpu {
    fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut StateData],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        let mut hosts = StateData::hosts_mut(states)?;
        if want == LogitsWant::Last && seqs.iter().all(|s| s.len() == 1) {
            let tokens: Vec<u32> = seqs.iter().map(|s| s[0]).collect();
            let vp = self.weights.lm_dims().vocab_padded;
            let rows = self.step(&tokens, &mut hosts)?;
            return Ok(rows.chunks(vp).map(<[f32]>::to_vec).collect());
        }
        seqs.iter()
            .zip(hosts)
            .map(|(s, st)| self.prefill(s, st, want, true))
            .collect()
    }

    fn decode_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        out: &mut StepLogits,
    ) -> Result<()> {
        let rows = self.step(tokens, &mut StateData::hosts_mut(states)?)?;
        out.buf = HostBuf::Heap(rows);
        Ok(())
    }

    fn hidden(&self, tokens: &[u32], state: &mut StateData, want: LogitsWant) -> Result<Vec<f32>> {
        self.prefill(tokens, state.host_mut()?, want, false)
    }
}
