//! The language model around a mixer, token by token (spec §1), shared by the Mamba-1 and
//! Mamba-2 references: embedding → per layer `r ← r + Mixer(RMSNorm(r))` → `norm_f` →
//! head over `vocab_padded` rows.

use crate::cpu::math::{rms_norm, silu};
use crate::cpu::matmul::{matmul_t, piece_rows, product_cols, stream_input, STREAM_MAX_ROWS};
use crate::cpu::team::{self, Member, SharedBuf};
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::mixers::LogitsWant;
use crate::model::family_weights::LmWeights;
use crate::model::state_layout::StateBuf;
use crate::model::weights::Matrix;
use std::sync::Mutex;

/// A `[rows, cols]` matrix converted to the arithmetic type.
pub struct Dense<F> {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<F>,
}

impl<F: Real> Dense<F> {
    pub fn new(m: &Matrix) -> Self {
        Dense {
            rows: m.rows,
            cols: m.cols,
            data: (0..m.rows * m.cols)
                .map(|i| F::from_f(m.data.get_f64(i)))
                .collect(),
        }
    }

    /// `W·x (+ bias)`
    pub fn apply(&self, x: &[F], bias: Option<&[f32]>) -> Vec<F> {
        let mut y: Vec<F> = self
            .data
            .chunks(self.cols)
            .map(|row| row.iter().zip(x).map(|(&a, &b)| a * b).sum())
            .collect();
        if let Some(b) = bias {
            for (v, &bb) in y.iter_mut().zip(b) {
                *v = *v + F::from_f(bb as f64);
            }
        }
        y
    }
}

/// What the LM needs of a model, converted once.
pub struct LmRef<F> {
    embedding: Dense<F>,
    /// `None`: tied to the embedding
    head: Option<Dense<F>>,
    block_norms: Vec<Vec<f32>>,
    norm_f: Vec<f32>,
    eps: F,
}

/// One token's outputs: the hidden state after `norm_f`, and the logits.
pub struct TokenOut<F> {
    pub hidden: Vec<F>,
    pub logits: Vec<F>,
}

impl<F: Real> LmRef<F> {
    pub fn new<M>(w: &LmWeights<M>) -> Self {
        LmRef {
            embedding: Dense::new(&w.embedding),
            head: w.lm_head.as_ref().map(Dense::new),
            block_norms: w.layers.iter().map(|b| b.norm.clone()).collect(),
            norm_f: w.norm_f.clone(),
            eps: F::from_f(w.config.norm_eps),
        }
    }

    pub fn vocab_padded(&self) -> usize {
        self.embedding.rows
    }

    /// One token through the model; `mixer(layer, normed input)` runs layer `layer`'s
    /// mixer on its own state. `pos` only labels an out-of-range token in the error.
    pub fn token(
        &self,
        token: u32,
        pos: u64,
        mut mixer: impl FnMut(usize, &[F]) -> Vec<F>,
    ) -> Result<TokenOut<F>> {
        let (vocab, dm) = (self.embedding.rows, self.embedding.cols);
        if token as usize >= vocab {
            return Err(Error::TokenOutOfRange {
                id: token as u64,
                pos: pos as usize,
                vocab,
            });
        }
        let e = token as usize * dm;
        let mut residual: Vec<F> = self.embedding.data[e..e + dm].to_vec();
        let mut normed = vec![F::zero(); dm];
        for (l, w) in self.block_norms.iter().enumerate() {
            rms_norm(&residual, w, self.eps, &mut normed);
            let out = mixer(l, &normed);
            for (r, o) in residual.iter_mut().zip(out) {
                *r = *r + o;
            }
        }
        let mut hidden = vec![F::zero(); dm];
        rms_norm(&residual, &self.norm_f, self.eps, &mut hidden);
        let logits = self
            .head
            .as_ref()
            .unwrap_or(&self.embedding)
            .apply(&hidden, None);
        Ok(TokenOut { hidden, logits })
    }
}

/// `v ← v / sqrt(mean(v²) + eps)` (a weightless RMSNorm, FalconMamba's on δ, B, C).
pub fn rms_unit<F: Real>(v: &mut [F], eps: F) {
    let ms = v.iter().map(|&a| a * a).sum::<F>() / F::from_f(v.len() as f64);
    let r = F::one() / (ms + eps).sqrt();
    for a in v {
        *a = *a * r;
    }
}

/// Buffers kept across the layers of a pass. A prefill's per-layer arrays run to tens of
/// MB; fresh ones came back from the allocator as fresh pages, faulted in and cleared at
/// every layer — a quarter of a bf16 mamba2-780m prefill on the 2-core EPYC
/// (docs/decisions.md, "Family CPU prefill: buffers kept across layers").
pub struct Scratch<F> {
    kept: Vec<Vec<F>>,
}

impl<F: Real> Default for Scratch<F> {
    fn default() -> Self {
        Scratch { kept: Vec::new() }
    }
}

impl<F: Real> Scratch<F> {
    /// `len` zeros, in the smallest kept buffer that holds them (else the largest, grown).
    pub fn take(&mut self, len: usize) -> Vec<F> {
        let fits = (0..self.kept.len())
            .filter(|&i| self.kept[i].capacity() >= len)
            .min_by_key(|&i| self.kept[i].capacity());
        let largest = (0..self.kept.len()).max_by_key(|&i| self.kept[i].capacity());
        let mut v = fits
            .or(largest)
            .map_or_else(Vec::new, |i| self.kept.swap_remove(i));
        v.clear();
        v.resize(len, F::zero());
        v
    }

    /// Keeps `v` for a later [`Scratch::take`].
    pub fn give(&mut self, v: Vec<F>) {
        self.kept.push(v);
    }
}

/// The LM around a mixer over many rows at once (spec §1): a window of one sequence in
/// prefill, or one token of each sequence in a batched decode step. `mixer(layer, weights,
/// normed rows)` returns the mixer's output rows `[rows, D_m]`. Token errors name the
/// position in `tokens`. Returns the chosen rows, flattened: logits `[rows, vocab_padded]`
/// with `head`, else the hidden states after `norm_f` `[rows, D_m]`. The mixer takes its
/// buffers from, and its output comes back to, one [`Scratch`] kept across the layers.
pub fn lm_rows<F: Real, M>(
    w: &LmWeights<M>,
    tokens: &[u32],
    want: LogitsWant,
    head: bool,
    mut mixer: impl FnMut(usize, &M, &[F], &mut Scratch<F>) -> Result<Vec<F>>,
) -> Result<Vec<F>> {
    let (vocab, dm) = (w.embedding.rows, w.embedding.cols);
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(Error::TokenOutOfRange {
            id: t as u64,
            pos: i,
            vocab,
        });
    }
    let rows = tokens.len();
    if rows == 0 {
        return Ok(Vec::new());
    }
    let eps = F::from_f(w.config.norm_eps);
    let mut residual = vec![F::zero(); rows * dm];
    for (r, &t) in residual.chunks_mut(dm).zip(tokens) {
        for (j, v) in r.iter_mut().enumerate() {
            *v = F::from_f(w.embedding.data.get_f64(t as usize * dm + j));
        }
    }
    let mut normed = vec![F::zero(); rows * dm];
    let mut scratch = Scratch::default();
    for (l, block) in w.layers.iter().enumerate() {
        norm_rows(&residual, &block.norm, eps, &mut normed, dm);
        let out = mixer(l, &block.mixer, &normed, &mut scratch)?;
        debug_assert_eq!(out.len(), rows * dm);
        for (r, &o) in residual.iter_mut().zip(&out) {
            *r = *r + o;
        }
        scratch.give(out);
    }
    let keep = match want {
        LogitsWant::All => rows,
        LogitsWant::Last => 1,
        LogitsWant::None => return Ok(Vec::new()),
    };
    let tail = &residual[(rows - keep) * dm..];
    let mut hidden = vec![F::zero(); keep * dm];
    norm_rows(tail, &w.norm_f, eps, &mut hidden, dm);
    if !head {
        return Ok(hidden);
    }
    let head = w.head();
    let mut logits = vec![F::zero(); keep * head.rows];
    matmul_t(&hidden, keep, head, &mut logits);
    Ok(logits)
}

fn norm_rows<F: Real>(x: &[F], w: &[f32], eps: F, out: &mut [F], width: usize) {
    for (xr, or) in x.chunks(width).zip(out.chunks_mut(width)) {
        rms_norm(xr, w, eps, or);
    }
}

/// `out[rows, W.rows] = x·Wᵀ (+ bias)` for a weight matrix in any storage dtype, `out`
/// from `scratch`.
pub fn project<F: Real>(
    x: &[F],
    rows: usize,
    w: &Matrix,
    bias: Option<&[f32]>,
    scratch: &mut Scratch<F>,
) -> Vec<F> {
    let mut out = scratch.take(rows * w.rows);
    matmul_t(x, rows, w, &mut out);
    if let Some(b) = bias {
        for r in out.chunks_mut(w.rows) {
            for (v, &bb) in r.iter_mut().zip(b) {
                *v = *v + F::from_f(bb as f64);
            }
        }
    }
    out
}

/// One layer's mixer over `rows` between its projections: in_proj (`w_in`, bias), then
/// `mixer(in_proj's output, scratch)`, then out_proj (`w_out`, bias) of what it returns;
/// the buffers go back to `scratch`, out_proj's output is returned.
pub fn between_projections<F: Real>(
    normed: &[F],
    rows: usize,
    (w_in, b_in): (&Matrix, Option<&[f32]>),
    (w_out, b_out): (&Matrix, Option<&[f32]>),
    scratch: &mut Scratch<F>,
    mixer: impl FnOnce(&[F], &mut Scratch<F>) -> Vec<F>,
) -> Vec<F> {
    let proj = project(normed, rows, w_in, b_in, scratch);
    let inner = mixer(&proj, scratch);
    scratch.give(proj);
    let out = project(&inner, rows, w_out, b_out, scratch);
    scratch.give(inner);
    out
}

/// A depthwise causal conv's parameters: `weight` `[C, K]` (`conv1d.weight` `[C, 1, K]`),
/// optional `bias` `[C]`.
#[derive(Clone, Copy)]
pub struct ConvTaps<'a> {
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub d_conv: usize,
}

/// Causal depthwise conv over `rows` new inputs `x` (row `t` = `x[t·stride + off ..][..C]`)
/// continuing from `conv_state` `[C, K]` (the last K inputs, oldest first), then SiLU;
/// updates the state to the last K inputs. Returns `[rows, C]` (from `scratch`).
pub fn conv_rows<F: Real>(
    x: &[F],
    rows: usize,
    (stride, off): (usize, usize),
    conv_state: &mut [F],
    taps: ConvTaps,
    scratch: &mut Scratch<F>,
) -> Vec<F> {
    let ConvTaps {
        weight,
        bias,
        d_conv: k,
    } = taps;
    let c_n = conv_state.len() / k;
    // Inputs in time order, token-major so the loops below run along channels: the K held
    // inputs, then the new ones. The window of new token t is entries t+1 ..= t+K.
    let mut ext = scratch.take((k + rows) * c_n);
    for c in 0..c_n {
        for j in 0..k {
            ext[j * c_n + c] = conv_state[c * k + j];
        }
    }
    for t in 0..rows {
        ext[(k + t) * c_n..(k + t + 1) * c_n]
            .copy_from_slice(&x[t * stride + off..t * stride + off + c_n]);
    }
    let mut taps_t = vec![F::zero(); k * c_n];
    for c in 0..c_n {
        for j in 0..k {
            taps_t[j * c_n + c] = F::from_f(weight[c * k + j] as f64);
        }
    }
    let mut out = scratch.take(rows * c_n);
    for (t, o) in out.chunks_mut(c_n).enumerate() {
        match bias {
            Some(b) => o
                .iter_mut()
                .zip(b)
                .for_each(|(o, &b)| *o = F::from_f(b as f64)),
            None => o.fill(F::zero()),
        }
        for j in 0..k {
            let e = &ext[(t + 1 + j) * c_n..(t + 2 + j) * c_n];
            let w = &taps_t[j * c_n..(j + 1) * c_n];
            for c in 0..c_n {
                o[c] = o[c] + e[c] * w[c];
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    }
    for c in 0..c_n {
        for j in 0..k {
            conv_state[c * k + j] = ext[(rows + j) * c_n + c];
        }
    }
    scratch.give(ext);
    out
}

/// `eˣ` for a log decay `x ≤ 0`, flushed to exactly 0 below half the exponent range:
/// there the factor is far below the type's epsilon against the O(1) terms it is summed
/// with, and letting it through makes subnormal products, which cost x86 cores ~100 cycles
/// each (they made the Mamba-2 chunk products 10× slower on strongly decaying heads).
#[inline(always)]
pub fn decay_exp<F: Real>(x: F, cutoff: F) -> F {
    // Computed unconditionally so that the choice is a select and loops vectorise.
    let e = x.exp_fast();
    if x < cutoff {
        F::zero()
    } else {
        e
    }
}

/// The cutoff of [`decay_exp`]: `ln(smallest normal) / 2` (−43.7 in f32, −354 in f64).
pub fn decay_cutoff<F: Real>() -> F {
    F::min_positive_value().ln() * F::from_f(0.5)
}

/// One token's causal conv of the channels `c0 ..` of `x` (their new inputs), `conv` their
/// rows of the conv state `[width, K]` (oldest first), shifted to take `x`; writes
/// `o = silu(Σ_k conv[c,k]·w[c,k] + b[c])`: the operations of [`conv_rows`] for one row,
/// without its transposed copies and buffers (a decode step's conv).
pub fn conv_token<F: Real>(x: &[F], c0: usize, conv: &mut [F], taps: ConvTaps, o: &mut [F]) {
    let k = taps.d_conv;
    for (i, ((row, &xv), o)) in conv.chunks_exact_mut(k).zip(x).zip(o).enumerate() {
        let c = c0 + i;
        let w = &taps.weight[c * k..(c + 1) * k];
        let mut acc = match taps.bias {
            Some(b) => F::from_f(b[c] as f64),
            None => F::zero(),
        };
        row.copy_within(1.., 0);
        row[k - 1] = xv;
        for (&v, &t) in row.iter().zip(w) {
            acc = acc + v * F::from_f(t as f64);
        }
        *o = silu(acc);
    }
}

/// The buffers of a decode step on the thread team (`cpu/team.rs`) that the LM around
/// any mixer shares among the members.
pub(crate) struct TeamShared<'a, F> {
    /// `[rows, D_m]`: each layer's mixer output (out_proj, bias added)
    pub hs: SharedBuf<'a, F>,
    /// `[widest product, rows]`: the products' transposes for batches
    pub tmp: SharedBuf<'a, F>,
    /// `[rows, vocab_padded]`: the logits
    pub out: SharedBuf<'a, F>,
    /// each sequence's state: `(layer_len, data)`
    pub states: Vec<(usize, SharedBuf<'a, F>)>,
}

/// A member's own buffers for the LM around the mixer (kept across steps).
#[derive(Default)]
pub(crate) struct TeamLm<F> {
    /// `[rows, D_m]`: the residual stream (the same values in every member)
    res: Vec<F>,
    /// `[rows, D_m]`: its norm
    normed: Vec<F>,
    /// a product's input in the kernels' order
    pub xk: Vec<F>,
}

/// The LM's part of a team decode step's buffers, kept across steps: the layer output and
/// the products' transposes the members share, and each member's own LM buffers beside its
/// mixer's `W`.
pub(crate) struct TeamWork<F, W> {
    /// `[rows, D_m]`: out_proj's output, bias added
    hs: Vec<F>,
    /// `[widest, rows]`: the products' transposes for batches
    tmp: Vec<F>,
    members: Vec<Mutex<(TeamLm<F>, W)>>,
}

impl<F, W> Default for TeamWork<F, W> {
    fn default() -> Self {
        TeamWork {
            hs: Vec::new(),
            tmp: Vec::new(),
            members: Vec::new(),
        }
    }
}

/// A family's decode step over `states` in jobs of at most [`STREAM_MAX_ROWS`] rows (every
/// row on the weight-streaming products: the same bits whatever the batch): `job(states,
/// tokens, logits)` for each, `logits` resized to `[batch, vocab_padded]`. Returns what the
/// last job returned (how many members ran it).
pub(crate) fn in_jobs<F: Real>(
    states: &mut [&mut StateBuf<F>],
    tokens: &[u32],
    logits: &mut Vec<F>,
    vocab_padded: usize,
    mut job: impl FnMut(&mut [&mut StateBuf<F>], &[u32], &mut [F]) -> usize,
) -> usize {
    logits.resize(tokens.len() * vocab_padded, F::zero());
    let mut ran = 0;
    for ((st, toks), out) in states
        .chunks_mut(STREAM_MAX_ROWS)
        .zip(tokens.chunks(STREAM_MAX_ROWS))
        .zip(logits.chunks_mut(STREAM_MAX_ROWS * vocab_padded))
    {
        ran = job(st, toks, out);
    }
    ran
}

/// One job of a team decode step: `tokens` (one per state) on `members` threads (exactly
/// that many, capped at the pool's, if `exact`), each member running [`team_lm`] with
/// `mixer(member, layer, weights, normed rows, xk, its own W, the shared LM buffers)`;
/// `widest` is the widest product's output row. Returns how many members ran.
#[allow(clippy::too_many_arguments)]
pub(crate) fn team_job<F: Real, M: Sync, W: Default + Send>(
    w: &LmWeights<M>,
    states: &mut [&mut StateBuf<F>],
    tokens: &[u32],
    logits: &mut [F],
    work: &mut TeamWork<F, W>,
    widest: usize,
    (members, exact): (usize, bool),
    mixer: impl Fn(&Member, usize, &M, &[F], &mut Vec<F>, &mut W, &TeamShared<F>) + Sync,
) -> usize {
    let rows = tokens.len();
    work.hs.resize(rows * w.embedding.cols, F::zero());
    work.tmp.resize(rows * widest, F::zero());
    if work.members.len() < members {
        work.members.resize_with(members, Default::default);
    }
    let TeamWork {
        hs,
        tmp,
        members: own,
    } = work;
    let lm = TeamShared {
        hs: SharedBuf::new(hs),
        tmp: SharedBuf::new(tmp),
        out: SharedBuf::new(logits),
        states: states
            .iter_mut()
            .map(|s| (s.layer_len, SharedBuf::new(&mut s.data)))
            .collect(),
    };
    let own = &*own;
    let run = if exact { team::run_exact } else { team::run };
    run(members, &|m: &Member| {
        let mut guard = own[m.id].lock().unwrap_or_else(|e| e.into_inner());
        let (mine_lm, mine) = &mut *guard;
        // SAFETY: every shared buffer is written in disjoint shares (the products' weight
        // rows, the members' channels and heads) and read whole only after the barrier
        // that ends the phase writing it.
        unsafe {
            team_lm(m, w, tokens, mine_lm, &lm, |l, mw, normed, xk| {
                mixer(m, l, mw, normed, xk, mine, &lm)
            })
        }
    })
}

/// One member's part of a team decode step of the LM (the operations of [`lm_rows`], so
/// the same bits on any number of members): the embedding, then per layer the residual
/// add, the norm and `mixer(member, layer, weights, normed rows, xk)`, which leaves the
/// layer's output in `sh.hs` and meets the others at a barrier after writing it; then
/// `norm_f` and the head, its rows taken piece by piece.
///
/// # Safety
/// Called by every member of one job, with the shared buffers sized for the batch.
pub(crate) unsafe fn team_lm<F: Real, M>(
    m: &Member,
    w: &LmWeights<M>,
    tokens: &[u32],
    lm: &mut TeamLm<F>,
    sh: &TeamShared<F>,
    mut mixer: impl FnMut(usize, &M, &[F], &mut Vec<F>),
) {
    let rows = tokens.len();
    let dm = w.embedding.cols;
    let eps = F::from_f(w.config.norm_eps);
    let TeamLm { res, normed, xk } = lm;
    res.resize(rows * dm, F::zero());
    normed.resize(rows * dm, F::zero());
    for (row, &t) in res.chunks_mut(dm).zip(tokens) {
        for (j, v) in row.iter_mut().enumerate() {
            *v = F::from_f(w.embedding.data.get_f64(t as usize * dm + j));
        }
    }
    let add = |res: &mut [F], hs: &[F]| {
        for (r, &o) in res.iter_mut().zip(hs) {
            *r = *r + o;
        }
    };
    for (l, block) in w.layers.iter().enumerate() {
        if l > 0 {
            add(res, sh.hs.get());
        }
        norm_rows(res, &block.norm, eps, normed, dm);
        mixer(l, &block.mixer, normed, xk);
    }
    add(res, sh.hs.get());
    norm_rows(res, &w.norm_f, eps, normed, dm);
    let head = w.head();
    let x = stream_input(normed, rows, head, xk);
    for js in m.chunks(head.rows, piece_rows(head)) {
        product_cols(x, rows, head, js, (&sh.out, &sh.tmp), true);
    }
}

/// Columns `js` of `out[rows, W.rows] = x·Wᵀ + bias` (the operations of [`project`]) for
/// a member of a team, `xk` from [`stream_input`]; weights streaming from memory (f32
/// rows 8 at a time).
///
/// # Safety
/// As [`product_cols`]: nobody else touches these columns of `out` or `tmp` until the
/// next barrier.
pub(crate) unsafe fn project_cols<F: Real>(
    xk: &[F],
    rows: usize,
    (w, bias): (&Matrix, Option<&[f32]>),
    js: std::ops::Range<usize>,
    (out, tmp): (&SharedBuf<F>, &SharedBuf<F>),
) {
    product_cols(xk, rows, w, js.clone(), (out, tmp), true);
    if let Some(bias) = bias {
        let n = w.rows;
        for b in 0..rows {
            let o = out.part(b * n + js.start..b * n + js.end);
            for (v, &bb) in o.iter_mut().zip(&bias[js.clone()]) {
                *v = *v + F::from_f(bb as f64);
            }
        }
    }
}
