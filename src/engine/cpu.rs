//! The Mamba-3 language model on the CPU (spec §2.7): embedding, per layer fused
//! residual add + RMSNorm, `in_proj`, mixer, `out_proj`, optional GatedMLP, final norm
//! and head — over a packed batch of sequences.
//!
//! One path serves prefill and decode: a batch whose sequences all hold one token takes the
//! recurrent mixer step, any other batch the chunked mixer. The dtype of the weights is the
//! user's; activations stay in the arithmetic type `F` (on the CPU, rounding them to bf16
//! would only cost accuracy: they are never stored in bulk).

use crate::cpu::math::{rms_norm, silu};
use crate::cpu::matmul::{matmul_t, product_cols, stream_input};
use crate::cpu::real::Real;
use crate::cpu::team::{self, Member, SharedBuf};
use crate::error::{Error, Result};
use crate::mixers::mamba3::prefill::{mixer_prefill, Span};
use crate::mixers::mamba3::state::{layer, layout, zero_state, LayerState, SeqState};
use crate::mixers::mamba3::step::{head_step, mixer_step};
use crate::mixers::mamba3::token::{MixerCtx, TokenPre};
use crate::mixers::mamba3::Weights;
use crate::model::config::NORM_EPS;
use crate::model::weights::Matrix;
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

use super::backend::Backend;
pub use super::logits::LogitsWant;
use super::logits::{HostBuf, StepLogits};
use super::state::StateData;

pub struct CpuModel<F> {
    pub weights: Arc<Weights>,
    /// Bytes of the matrices one decode step reads (every layer's and the head's).
    step_bytes: usize,
    /// The small decode step's buffers, kept across steps.
    work: Mutex<StepWork<F>>,
}

/// Decode batches of up to this many sequences, of a model whose step reads at most
/// [`SMALL_STEP_MAX_BYTES`] of weights, take [`CpuModel::small_step`].
const SMALL_STEP_ROWS: usize = 8;

/// Above this, a step's phases last long enough (milliseconds) that the pool's wake-ups
/// cost little (under 2 %), and the pool's work stealing rides out members drifting
/// apart, where the team's fixed shares wait (d_model 768 · 24 layers on the idle 2-core
/// machine: 34–35 ms/token f32 and 23 bf16 on the team against 20 and 14 on the pool).
const SMALL_STEP_MAX_BYTES: usize = 32 << 20;

/// Buffers of the small decode step: shared ones that members write in parts, and each
/// member's own. Fresh buffers every step cost page faults (decisions.md, "CPU decode of
/// small models: one team job per step").
#[derive(Default)]
struct StepWork<F> {
    /// `[rows, d_model]`: each layer's output (out_proj, or the MLP's fc2)
    hs: Vec<F>,
    /// `[rows, d_in_proj]`
    proj: Vec<F>,
    /// `[rows, d_inner]`: the mixer's gated output
    y: Vec<F>,
    /// `[rows, 2·mlp_hidden]`
    vg: Vec<F>,
    /// `[n, rows]` of the widest product, for the transposes of batches
    tmp: Vec<F>,
    members: Vec<Mutex<MemberWork<F>>>,
}

/// What each member computes for itself (the same values in every member).
#[derive(Default)]
struct MemberWork<F> {
    /// `[rows, d_model]`: the residual stream
    res: Vec<F>,
    /// `[rows, d_model]`: its norm
    normed: Vec<F>,
    /// `[rows, mlp_hidden]`
    act: Vec<F>,
    pre: TokenPre<F>,
    /// a product's input in the kernels' order
    xk: Vec<F>,
}

/// Bytes of one decode step's matrices.
fn step_bytes(w: &Weights) -> usize {
    let bytes = |m: &Matrix| m.data.len() * m.data.dtype().size();
    w.layers
        .iter()
        .map(|l| {
            bytes(&l.in_proj)
                + bytes(&l.out_proj)
                + l.mlp.as_ref().map_or(0, |m| bytes(&m.fc1) + bytes(&m.fc2))
        })
        .sum::<usize>()
        + bytes(w.head())
}

/// This member's share of `out[rows, W.rows] = x·Wᵀ` (weight rows cut among the members),
/// on the weight-streaming kernel: the bits of [`matmul_t`]. `xk` is the member's own
/// buffer for the input in the kernels' order.
///
/// # Safety
/// Every member of the job calls it for the same product, and nobody reads `out` or
/// `tmp` until the next barrier.
unsafe fn product_share<F: Real>(
    m: &Member,
    x: &[F],
    rows: usize,
    w: &Matrix,
    (out, tmp): (&SharedBuf<F>, &SharedBuf<F>),
    xk: &mut Vec<F>,
) {
    let r = m.share(w.rows, 16);
    if r.is_empty() {
        return;
    }
    let xk = stream_input(x, rows, w, xk);
    product_cols(xk, rows, w, r, (out, tmp), false);
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
            step_bytes: step_bytes(&weights),
            weights,
            work: Mutex::new(StepWork::default()),
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
        if let Some(logits) = self.small_step(seqs, states, want, true) {
            return logits;
        }
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
        if let Some(logits) = self.small_step(seqs, states, want, head) {
            return Ok(logits?
                .chunks(self.weights.dims.vocab_padded)
                .map(|c| c.to_vec())
                .collect());
        }
        // One trip into the thread pool per call: the parallel loops below then split
        // their work locally instead of handing it across threads each time.
        let (rows, spans, width) = rayon::scope(|_| self.run_in_pool(seqs, states, want, head))?;
        Ok(split_rows(rows, &spans, want, width))
    }

    /// A decode step of up to [`SMALL_STEP_ROWS`] sequences (one token each, the last
    /// position's logits wanted) on the thread team ([`crate::cpu::team`]) or the calling
    /// thread alone ([`team::members_for`]), in buffers kept across steps: the same arithmetic
    /// as [`CpuModel::run_in_pool`], so the same bits, on any number of members. `None`
    /// for any other call.
    fn small_step(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        want: LogitsWant,
        head: bool,
    ) -> Option<Result<Vec<F>>> {
        if !head
            || want != LogitsWant::Last
            || seqs.is_empty()
            || seqs.len() > SMALL_STEP_ROWS
            || self.step_bytes > SMALL_STEP_MAX_BYTES
            || seqs.iter().any(|s| s.len() != 1)
        {
            return None;
        }
        Some(
            self.small_step_on(seqs, states, team::members_for(self.step_bytes), false)
                .map(|(logits, _)| logits),
        )
    }

    /// Tokens in the vocabulary, one state per sequence, each of this model's shape.
    fn check_inputs(&self, seqs: &[&[u32]], states: &[&mut SeqState<F>]) -> Result<()> {
        let d = self.weights.dims;
        check_batch(d.vocab_size, seqs, states.len())?;
        let state_layout = layout(&d);
        for (b, st) in states.iter().enumerate() {
            if !st.fits(&state_layout) {
                return Err(Error::State(format!(
                    "state {b} does not have this model's shape ({})",
                    state_layout.describe()
                )));
            }
        }
        Ok(())
    }

    /// [`CpuModel::small_step`] on up to `members` threads (exactly that many, capped at
    /// the pool's, if `exact`); also returns how many ran it.
    fn small_step_on(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        members: usize,
        exact: bool,
    ) -> Result<(Vec<F>, usize)> {
        let w = &*self.weights;
        self.check_inputs(seqs, states)?;
        let d = w.dims;
        let rows = seqs.len();
        let (dm, vp) = (d.d_model, d.vocab_padded);
        let mut fresh = StepWork::default();
        let mut guard = self.work.try_lock();
        let work: &mut StepWork<F> = match guard.as_mut() {
            Ok(g) => g,
            Err(_) => &mut fresh,
        };
        let widest = [d.d_in_proj, dm, 2 * d.mlp_hidden, vp]
            .into_iter()
            .max()
            .unwrap_or(0);
        work.hs.resize(rows * dm, F::zero());
        work.proj.resize(rows * d.d_in_proj, F::zero());
        work.y.resize(rows * d.d_inner, F::zero());
        work.vg.resize(rows * 2 * d.mlp_hidden, F::zero());
        work.tmp.resize(rows * widest, F::zero());
        if work.members.len() < members {
            work.members.resize_with(members, Default::default);
        }
        let mut logits = vec![F::zero(); rows * vp];
        let tokens: Vec<u32> = seqs.iter().map(|s| s[0]).collect();
        let StepWork {
            hs,
            proj,
            y,
            vg,
            tmp,
            members: own,
        } = work;
        let (hs, proj, y, vg, tmp) = (
            SharedBuf::new(hs),
            SharedBuf::new(proj),
            SharedBuf::new(y),
            SharedBuf::new(vg),
            SharedBuf::new(tmp),
        );
        let out = SharedBuf::new(&mut logits);
        let st: Vec<SharedBuf<F>> = states
            .iter_mut()
            .map(|s| SharedBuf::new(&mut s.data))
            .collect();
        let own = &*own;
        let run = if exact { team::run_exact } else { team::run };
        let ran = run(members, &|m: &Member| {
            let mut mine = own[m.id].lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: every shared buffer below is written in disjoint shares (the
            // products' weight rows, the mixer's (row, head) slots) and read only after the
            // barrier that ends the phase writing it; each state slot belongs to one member.
            unsafe {
                self.step_member(
                    m,
                    &tokens,
                    &mut mine,
                    [&hs, &proj, &y, &vg, &tmp],
                    &st,
                    &out,
                )
            }
        });
        drop(guard);
        Ok((logits, ran))
    }

    /// One member's part of [`CpuModel::small_step`].
    ///
    /// # Safety
    /// Called by every member of one job, with shared buffers sized for the batch.
    unsafe fn step_member(
        &self,
        m: &Member,
        tokens: &[u32],
        mine: &mut MemberWork<F>,
        [hs, proj, y, vg, tmp]: [&SharedBuf<F>; 5],
        states: &[SharedBuf<F>],
        out: &SharedBuf<F>,
    ) {
        let w = &*self.weights;
        let d = w.dims;
        let rows = tokens.len();
        let dm = d.d_model;
        let cfg = &w.config;
        let MemberWork {
            res,
            normed,
            act,
            pre,
            xk,
        } = mine;
        res.clear();
        res.resize(rows * dm, F::zero());
        normed.resize(rows * dm, F::zero());
        act.resize(rows * d.mlp_hidden, F::zero());
        // The embedding rows, added to the zero residual (as the packed pass does).
        crate::with_data!(&w.embedding.data, e => {
            for (row, &t) in res.chunks_mut(dm).zip(tokens) {
                let src = &e[t as usize * dm..(t as usize + 1) * dm];
                row.iter_mut().zip(src).for_each(|(o, &v)| *o = *o + F::from_elem(v));
            }
        });
        let norm = |res: &[F], wn: &[f32], normed: &mut [F]| {
            for (o, r) in normed.chunks_mut(dm).zip(res.chunks(dm)) {
                rms_norm(r, wn, F::from_f(NORM_EPS), o);
            }
        };
        let add = |res: &mut [F], hs: &[F]| res.iter_mut().zip(hs).for_each(|(a, &b)| *a = *a + b);
        let (h_n, p_n, n_n, s_n) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
        let (o_ssm, o_k, o_v) = (
            h_n * s_n,
            h_n * s_n + h_n * p_n * n_n,
            h_n * s_n + h_n * p_n * n_n + h_n * n_n,
        );
        for (l, lw) in w.layers.iter().enumerate() {
            if l > 0 {
                add(res, hs.get());
            }
            norm(res, &lw.norm, normed);
            product_share(m, normed, rows, &lw.in_proj, (proj, tmp), xk);
            m.barrier();
            let ctx = MixerCtx {
                d,
                lw,
                a_floor: cfg.ssm_cfg.a_floor,
                a_act: cfg.ssm_cfg.a_activation,
            };
            let proj_all = proj.get();
            ctx.token_pre_into(proj_all, rows, pre);
            for slot in m.share(rows * h_n, 1) {
                let (b, h) = (slot / h_n, slot % h_n);
                let base = l * (o_v + h_n * p_n);
                let st = &states[b];
                head_step(
                    &ctx,
                    pre,
                    proj_all,
                    b,
                    h,
                    st.part(base + h * s_n..base + (h + 1) * s_n),
                    st.part(base + o_ssm + h * p_n * n_n..base + o_ssm + (h + 1) * p_n * n_n),
                    st.part(base + o_k + h * n_n..base + o_k + (h + 1) * n_n),
                    st.part(base + o_v + h * p_n..base + o_v + (h + 1) * p_n),
                    y.part(b * d.d_inner + h * p_n..b * d.d_inner + (h + 1) * p_n),
                );
            }
            m.barrier();
            product_share(m, y.get(), rows, &lw.out_proj, (hs, tmp), xk);
            m.barrier();
            if let Some(mlp) = &lw.mlp {
                add(res, hs.get());
                norm(res, &mlp.norm, normed);
                product_share(m, normed, rows, &mlp.fc1, (vg, tmp), xk);
                m.barrier();
                let hidden = d.mlp_hidden;
                for (a, vg) in act.chunks_mut(hidden).zip(vg.get().chunks(2 * hidden)) {
                    for i in 0..hidden {
                        a[i] = vg[i] * silu(vg[hidden + i]);
                    }
                }
                product_share(m, act, rows, &mlp.fc2, (hs, tmp), xk);
                m.barrier();
            }
        }
        add(res, hs.get());
        norm(res, &w.norm_f, normed);
        product_share(m, normed, rows, w.head(), (out, tmp), xk);
    }

    fn run_in_pool(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut SeqState<F>],
        want: LogitsWant,
        head: bool,
    ) -> Result<(Vec<F>, Vec<Span>, usize)> {
        let w = &*self.weights;
        self.check_inputs(seqs, states)?;
        let d = w.dims;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Config, DType};

    /// The small decode step gives the bits of the pooled pass, on one, two and three
    /// members, for batches of 1 to 8, f32 and bf16 weights, f32 and f64 arithmetic, with
    /// and without the MLP and the output norm, over several steps.
    fn same_bits<F: Real>(dtype: DType) {
        for (i, (mlp, norm, groups)) in [(false, false, 1), (true, true, 2)].into_iter().enumerate()
        {
            let mut c = Config::synthetic(64, 2, 16, 8, 2, groups, 50);
            c.d_intermediate = if mlp { 40 } else { 0 };
            c.ssm_cfg.is_outproj_norm = norm;
            let w = Arc::new(Weights::synthetic(c, dtype, 7 + i as u64).unwrap());
            let m = CpuModel::<F>::new(w.clone());
            for rows in [1, 3, 8] {
                for members in [1, 2, 3] {
                    let mut pooled: Vec<SeqState<F>> = (0..rows).map(|_| m.zero_state()).collect();
                    let mut small = pooled.clone();
                    for step in 0..4u32 {
                        let toks: Vec<u32> =
                            (0..rows as u32).map(|b| (b * 7 + step * 3) % 50).collect();
                        let seqs: Vec<&[u32]> = toks.chunks(1).collect();
                        let mut sp: Vec<&mut SeqState<F>> = pooled.iter_mut().collect();
                        let want =
                            rayon::scope(|_| m.run_in_pool(&seqs, &mut sp, LogitsWant::Last, true))
                                .unwrap()
                                .0;
                        let mut ss: Vec<&mut SeqState<F>> = small.iter_mut().collect();
                        let (got, ran) = m.small_step_on(&seqs, &mut ss, members, true).unwrap();
                        assert_eq!(ran, members.min(team::max_members()));
                        let bits = |v: &[F]| {
                            v.iter()
                                .map(|&x| <F as crate::model::dtype::Element>::to_f64(x).to_bits())
                                .collect::<Vec<_>>()
                        };
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "logits: {dtype} rows {rows} members {members} step {step}"
                        );
                        for (a, b) in small.iter().zip(&pooled) {
                            assert_eq!(
                                bits(&a.data),
                                bits(&b.data),
                                "state: rows {rows} members {members}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn small_decode_step_gives_the_bits_of_the_pooled_pass() {
        same_bits::<f32>(DType::F32);
        same_bits::<f32>(DType::BF16);
        same_bits::<f64>(DType::F64);
    }
}
