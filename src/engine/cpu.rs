//! The Mamba-3 language model on the CPU (spec §2.7): embedding, per layer fused
//! residual add + RMSNorm, `in_proj`, mixer, `out_proj`, optional GatedMLP, final norm
//! and head — over a packed batch of sequences.
//!
//! One path serves prefill and decode: a batch whose sequences all hold one token takes the
//! recurrent mixer step, any other batch the chunked mixer. The dtype of the weights is the
//! user's; activations stay in the arithmetic type `F` (on the CPU, rounding them to bf16
//! would only cost accuracy: they are never stored in bulk).

use crate::cpu::math::{rms_norm, silu};
use crate::cpu::matmul::matmul_t;
use crate::cpu::real::Real;
use crate::error::{Error, Result};
use crate::mixers::mamba3::prefill::{mixer_prefill, Span};
use crate::mixers::mamba3::state::{layer, layout, zero_state, LayerState, SeqState};
use crate::mixers::mamba3::step::mixer_step;
use crate::mixers::mamba3::token::MixerCtx;
use crate::model::config::NORM_EPS;
use crate::model::weights::Weights;
use rayon::prelude::*;
use std::sync::Arc;

use super::backend::Backend;
pub use super::logits::LogitsWant;
use super::logits::{HostBuf, StepLogits};
use super::state::StateData;

pub struct CpuModel<F> {
    pub weights: Arc<Weights>,
    _f: std::marker::PhantomData<F>,
}

/// Check a batch before anything is touched, so that bad input leaves states unchanged.
pub fn check_batch(vocab_size: usize, seqs: &[&[u32]], n_states: usize) -> Result<()> {
    if seqs.is_empty() {
        return Err(Error::input("empty batch: expected at least one sequence"));
    }
    if seqs.len() != n_states {
        return Err(Error::input(format!(
            "{} sequences but {} states: expected one state per sequence",
            seqs.len(),
            n_states
        )));
    }
    for (b, s) in seqs.iter().enumerate() {
        if s.is_empty() {
            return Err(Error::input(format!(
                "sequence {b} is empty: expected at least one token"
            )));
        }
        if let Some(pos) = s.iter().position(|&t| t as usize >= vocab_size) {
            return Err(Error::TokenOutOfRange {
                id: s[pos] as u64,
                pos,
                vocab: vocab_size,
            });
        }
    }
    Ok(())
}

/// Row-wise RMSNorm of `[rows, width]` into `out`.
fn norm_rows<F: Real>(x: &[F], w: &[f32], width: usize, out: &mut [F]) {
    out.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .with_min_len(8)
        .for_each(|(o, r)| rms_norm(r, w, F::from_f(NORM_EPS), o));
}

/// Cut the picked rows (`[picked, width]`) back into one block per sequence.
fn split_rows<F: Real>(
    rows: Vec<F>,
    spans: &[Span],
    want: LogitsWant,
    width: usize,
) -> Vec<Vec<F>> {
    match want {
        LogitsWant::All => spans
            .iter()
            .map(|s| rows[s.start * width..(s.start + s.len) * width].to_vec())
            .collect(),
        LogitsWant::Last => rows.chunks(width).map(|c| c.to_vec()).collect(),
        LogitsWant::None => vec![Vec::new(); spans.len()],
    }
}

fn add_assign<F: Real>(acc: &mut [F], x: &[F]) {
    acc.par_chunks_mut(1 << 14)
        .zip(x.par_chunks(1 << 14))
        .for_each(|(a, b)| {
            a.iter_mut().zip(b).for_each(|(a, &b)| *a = *a + b);
        });
}

impl<F: Real> CpuModel<F> {
    pub fn new(weights: Arc<Weights>) -> Self {
        CpuModel {
            weights,
            _f: std::marker::PhantomData,
        }
    }

    pub fn zero_state(&self) -> SeqState<F> {
        zero_state(&self.weights.dims)
    }

    /// Run each sequence's tokens from its state (a fresh state is a stateless window, a
    /// carried one a continued window), leaving every state positioned after its tokens.
    /// Returns each sequence's logits, `[positions, vocab_padded]` flattened.
    pub fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        want: LogitsWant,
    ) -> Result<Vec<Vec<F>>> {
        self.run(seqs, states, want, true)
    }

    /// Like [`CpuModel::forward`], but returns the hidden states after the final norm
    /// (`norm_f`), `[positions, d_model]` flattened, instead of logits: the features that
    /// embeddings pool.
    pub fn hidden(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        want: LogitsWant,
    ) -> Result<Vec<Vec<F>>> {
        self.run(seqs, states, want, false)
    }

    /// Like [`CpuModel::forward`], but the picked positions' logits stay in one buffer,
    /// `[picked, vocab_padded]` (a decode step's `[batch, vocab_padded]`), uncut.
    pub fn forward_flat(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        want: LogitsWant,
    ) -> Result<Vec<F>> {
        Ok(rayon::scope(|_| self.run_in_pool(seqs, states, want, true))?.0)
    }

    /// The forward pass; `head` selects logits (true) or the normed hidden rows (false).
    fn run(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        want: LogitsWant,
        head: bool,
    ) -> Result<Vec<Vec<F>>> {
        // One trip into the thread pool per call: the parallel loops below then split
        // their work locally instead of handing it across threads each time.
        let (rows, spans, width) = rayon::scope(|_| self.run_in_pool(seqs, states, want, head))?;
        Ok(split_rows(rows, &spans, want, width))
    }

    fn run_in_pool(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        want: LogitsWant,
        head: bool,
    ) -> Result<(Vec<F>, Vec<Span>, usize)> {
        let w = &*self.weights;
        check_batch(w.dims.vocab_size, seqs, states.len())?;
        let d = w.dims;
        let state_layout = layout(&d);
        for (b, st) in states.iter().enumerate() {
            if !st.fits(&state_layout) {
                return Err(Error::State(format!(
                    "state {b} does not have this model's shape ({})",
                    state_layout.describe()
                )));
            }
        }
        let dm = d.d_model;
        let mut spans = Vec::with_capacity(seqs.len());
        let mut rows = 0;
        for s in seqs {
            spans.push(Span {
                start: rows,
                len: s.len(),
            });
            rows += s.len();
        }
        let one_token_each = seqs.iter().all(|s| s.len() == 1);

        // Embedding lookup.
        let mut hs = vec![F::zero(); rows * dm];
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        crate::with_data!(&w.embedding.data, e => {
            hs.par_chunks_mut(dm).zip(&tokens).for_each(|(row, &t)| {
                let src = &e[t as usize * dm..(t as usize + 1) * dm];
                row.iter_mut().zip(src).for_each(|(o, &v)| *o = F::from_elem(v));
            });
        });
        let mut res = vec![F::zero(); rows * dm];
        // Buffers reused by every layer (each is fully overwritten before it is read).
        let mut normed = vec![F::zero(); rows * dm];
        let mut proj = vec![F::zero(); rows * d.d_in_proj];
        let mut y = vec![F::zero(); rows * d.d_inner];
        let mut vg = vec![F::zero(); rows * 2 * d.mlp_hidden];
        let mut act = vec![F::zero(); rows * d.mlp_hidden];
        let cfg = &w.config;
        for (l, lw) in w.layers.iter().enumerate() {
            add_assign(&mut res, &hs);
            norm_rows(&res, &lw.norm, dm, &mut normed);
            matmul_t(&normed, rows, &lw.in_proj, &mut proj);
            let ctx = MixerCtx {
                d,
                lw,
                a_floor: cfg.ssm_cfg.a_floor,
                a_act: cfg.ssm_cfg.a_activation,
            };
            let mut layer_states: Vec<LayerState<F>> =
                states.iter_mut().map(|s| layer(s, l, &d)).collect();
            if one_token_each {
                mixer_step(&ctx, &proj, &mut layer_states, &mut y);
            } else {
                mixer_prefill(&ctx, &proj, &spans, &mut layer_states, &mut y);
            }
            matmul_t(&y, rows, &lw.out_proj, &mut hs);
            if let Some(mlp) = &lw.mlp {
                add_assign(&mut res, &hs);
                norm_rows(&res, &mlp.norm, dm, &mut normed);
                let hidden = d.mlp_hidden;
                matmul_t(&normed, rows, &mlp.fc1, &mut vg);
                act.par_chunks_mut(hidden)
                    .zip(vg.par_chunks(2 * hidden))
                    .for_each(|(a, vg)| {
                        for i in 0..hidden {
                            a[i] = vg[i] * silu(vg[hidden + i]);
                        }
                    });
                matmul_t(&act, rows, &mlp.fc2, &mut hs);
            }
        }
        add_assign(&mut res, &hs);
        drop(hs);

        // Final norm and head on the rows asked for.
        let picked: Vec<usize> = match want {
            LogitsWant::All => (0..rows).collect(),
            LogitsWant::Last => spans.iter().map(|s| s.start + s.len - 1).collect(),
            LogitsWant::None => vec![],
        };
        let mut sel = vec![F::zero(); picked.len() * dm];
        for (i, &r) in picked.iter().enumerate() {
            sel[i * dm..(i + 1) * dm].copy_from_slice(&res[r * dm..(r + 1) * dm]);
        }
        let mut normed = vec![F::zero(); sel.len()];
        norm_rows(&sel, &w.norm_f, dm, &mut normed);
        if !head {
            return Ok((normed, spans, dm));
        }
        let vp = d.vocab_padded;
        let mut logits = vec![F::zero(); picked.len() * vp];
        matmul_t(&normed, picked.len(), w.head(), &mut logits);
        Ok((logits, spans, vp))
    }
}

impl Backend for CpuModel<f32> {
    fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut StateData],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        CpuModel::forward(self, seqs, &mut StateData::hosts_mut(states)?, want)
    }

    fn decode_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        out: &mut StepLogits,
    ) -> Result<()> {
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        let data =
            self.forward_flat(&seqs, &mut StateData::hosts_mut(states)?, LogitsWant::Last)?;
        out.buf = HostBuf::Heap(data);
        Ok(())
    }

    fn hidden(&self, tokens: &[u32], state: &mut StateData, want: LogitsWant) -> Result<Vec<f32>> {
        Ok(CpuModel::hidden(self, &[tokens], &mut [state.host_mut()?], want)?.remove(0))
    }
}
