//! The CPU backend of the mixers other than Mamba-3 SISO (which has its own packed-batch
//! pipeline in `cpu.rs`): Mamba-3 MIMO, Mamba-1 and Mamba-2, each through its mixer's fast
//! CPU paths on the engine's flat states.
//!
//! MIMO runs any pass as one packed batch (the projections over every row at once), on the
//! rayon pool. For Mamba-1 and Mamba-2 a pass of one token per sequence is their batched
//! decode step (every weight read once for the batch), one job on the thread team
//! (`cpu/team.rs`) in buffers kept here across steps, and a pass of longer sequences
//! prefills each from its own state in turn (each prefill parallel inside, on the pool).

use super::backend::Backend;
use super::logits::{HostBuf, LogitsWant, StepLogits};
use super::state::StateData;
use crate::error::{Error, Result};
use crate::mixers::{mamba1, mamba2, mimo, MixerWeights};
use crate::model::state_layout::StateBuf;
use std::sync::Mutex;

pub struct FamilyCpu {
    weights: MixerWeights,
    /// The buffers of Mamba-1's or Mamba-2's decode step, kept across steps.
    mamba1_work: Mutex<mamba1::step::StepWork<f32>>,
    mamba2_work: Mutex<mamba2::step::StepWork<f32>>,
}

impl FamilyCpu {
    /// A backend for `weights`; an error for Mamba-3 SISO, which `CpuModel` runs.
    pub fn new(weights: MixerWeights) -> Result<FamilyCpu> {
        if let MixerWeights::Mamba3(_) = weights {
            return Err(Error::input(
                "Mamba-3 SISO runs on the engine's CpuModel, not FamilyCpu",
            ));
        }
        Ok(FamilyCpu {
            weights,
            mamba1_work: Mutex::default(),
            mamba2_work: Mutex::default(),
        })
    }

    /// Each sequence's tokens from its own state: the rows `want` asks for, logits with
    /// `head`, else the hidden states after `norm_f`.
    fn run(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut StateBuf<f32>],
        want: LogitsWant,
        head: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let one_token_each = want == LogitsWant::Last && head && seqs.iter().all(|s| s.len() == 1);
        let tokens: Vec<u32> = seqs.iter().filter_map(|s| s.first().copied()).collect();
        let vp = self.weights.lm_dims().vocab_padded;
        let rows = |flat: Vec<f32>| flat.chunks(vp).map(<[f32]>::to_vec).collect();
        if one_token_each {
            let mut logits = Vec::new();
            if let Some(r) = self.team_step(&tokens, states, &mut logits) {
                return r.map(|()| rows(logits));
            }
        }
        // One trip into the thread pool per call: the parallel loops inside then split
        // their work among the pool's threads instead of each handing it over from this
        // thread and sleeping until it is done (a futex wake-up both ways per loop).
        rayon::scope(|_| match &self.weights {
            MixerWeights::Mimo(w) => {
                let chunk = mimo_chunk_len(w.dims.rank);
                mimo::mimo_forward(w, seqs, states, chunk, want, head)
            }
            MixerWeights::Mamba1(w) => seqs
                .iter()
                .zip(states.iter_mut())
                .map(|(s, st)| mamba1::prefill::prefill_rows(w, st, s, want, head))
                .collect(),
            MixerWeights::Mamba2(w) => seqs
                .iter()
                .zip(states.iter_mut())
                .map(|(s, st)| mamba2::prefill::prefill_rows(w, st, s, want, head))
                .collect(),
            MixerWeights::Mamba3(_) => unreachable!("refused by FamilyCpu::new"),
        })
    }

    /// A decode step on the thread team (`cpu/team.rs`: no pool wake-ups, buffers kept
    /// across steps), its logits `[batch, vocab_padded]` into `logits`; `None` for a
    /// family whose step runs on the pool.
    fn team_step(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateBuf<f32>],
        logits: &mut Vec<f32>,
    ) -> Option<Result<()>> {
        // A step that finds the buffers taken (another thread's step of this model) runs
        // in fresh ones.
        fn kept<T: Default>(m: &Mutex<T>, f: impl FnOnce(&mut T) -> Result<()>) -> Result<()> {
            match m.try_lock() {
                Ok(mut g) => f(&mut g),
                Err(_) => f(&mut T::default()),
            }
        }
        match &self.weights {
            MixerWeights::Mamba1(w) => Some(kept(&self.mamba1_work, |work| {
                mamba1::step::step_into(w, states, tokens, work, logits)
            })),
            MixerWeights::Mamba2(w) => Some(kept(&self.mamba2_work, |work| {
                mamba2::step::step_into(w, states, tokens, work, logits)
            })),
            _ => None,
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
        self.run(seqs, &mut StateData::hosts_mut(states)?, want, true)
    }

    fn decode_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        out: &mut StepLogits,
    ) -> Result<()> {
        let mut states = StateData::hosts_mut(states)?;
        // The step's logits straight into the caller's buffer, kept from step to step.
        let mut buf = match std::mem::replace(&mut out.buf, HostBuf::Heap(Vec::new())) {
            HostBuf::Heap(v) => v,
            #[cfg(feature = "cuda")]
            HostBuf::Pinned(_) => Vec::new(),
        };
        if let Some(r) = self.team_step(tokens, &mut states, &mut buf) {
            out.buf = HostBuf::Heap(buf);
            return r;
        }
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        let rows = self.run(&seqs, &mut states, LogitsWant::Last, true)?;
        out.buf = HostBuf::Heap(rows.concat());
        Ok(())
    }

    fn hidden(&self, tokens: &[u32], state: &mut StateData, want: LogitsWant) -> Result<Vec<f32>> {
        Ok(self
            .run(&[tokens], &mut [state.host_mut()?], want, false)?
            .remove(0))
    }
}
