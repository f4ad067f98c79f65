//! The batched Mamba-1 decode step on the CPU: one token for each of several sequences,
//! each with its own state. The projections (in_proj, x_proj, dt_proj, out_proj, the head)
//! read each weight once for the batch's rows; the conv and the scan run per sequence on
//! its own state.
//!
//! The whole step is one job on the thread team (`cpu/team.rs`), as Mamba-3 SISO's small
//! step is, the members meeting at four barriers per layer. On the rayon pool each of a
//! layer's parallel loops woke a sleeping worker (~9 % of a mamba-130m-shaped bf16 step in
//! futex wake-ups and waits), and the step's buffers were allocated afresh (~2.5 %); here
//! they are kept in [`StepWork`] across steps. The members take each phase's work piece by
//! piece (`Member::chunks`: weight rows of a product, or channels) rather than in fixed
//! shares: with fixed halves of this shape's products, phases of a few hundred µs that
//! stream memory, the two members of the 2-core machine drifted apart by more than the
//! barriers' spin at up to 40 of a step's 97 barriers, and the team then gave up and ran
//! alone (`team::run`'s rule for members kept off their cores). A piece of in_proj also
//! runs the conv of its x channels.

use super::lm::{
    conv_token, decay_cutoff, decay_exp, in_jobs, project_cols, rms_unit, team_job, TeamShared,
    TeamWork,
};
use super::prefill::taps;
use super::weights::{Mamba1Mixer, Mamba1Weights};
use super::{check_state, layout, State};
use crate::cpu::math::{silu, softplus};
use crate::cpu::matmul::{dot, piece_rows, product_cols, stream_input, stream_part};
use crate::cpu::team::{self, Member, SharedBuf};
use crate::cpu::Real;
use crate::error::{Error, Result};
use crate::model::family_config::Mamba1Config;
use crate::model::state_layout::StateLayout;
use crate::model::weights::Matrix;

/// Channels per piece of the scan phase (Δ's product, the scan, the gate): a few µs each.
const SCAN_PIECE: usize = 128;

/// A decode step's buffers, kept across steps by the caller (the engine keeps one per
/// model): the shared ones, which members write in parts, and each member's own.
#[derive(Default)]
pub struct StepWork<F> {
    /// `[rows, 2·D_i]`: in_proj's output, bias added
    proj: Vec<F>,
    /// `[rows, D_i]`: the conv's output
    xc: Vec<F>,
    /// `[rows, R + 2N]`: x_proj's output
    dbc: Vec<F>,
    /// `[rows, D_i]`: `y ⊙ silu(z)`
    gated: Vec<F>,
    lm: TeamWork<F, MemberWork<F>>,
}

/// What each member computes for itself in the mixer.
#[derive(Default)]
struct MemberWork<F> {
    /// `[rows, R + 2N]`: x_proj's output, FalconMamba's norms applied
    dbc: Vec<F>,
    /// `[rows, R]`: δ
    dlow: Vec<F>,
    /// `[piece, rows]`: Δ of the channels of the member's current piece
    delta: Vec<F>,
    /// `[piece·N]`: their A where it is not precomputed (f64)
    a: Vec<F>,
}

/// Advance every `states[i]` by `tokens[i]`; returns the logits `[batch, vocab_padded]`.
/// Nothing is changed when an argument is refused.
pub fn step<F: Real>(
    w: &Mamba1Weights,
    states: &mut [&mut State<F>],
    tokens: &[u32],
) -> Result<Vec<F>> {
    let mut logits = Vec::new();
    step_into(w, states, tokens, &mut StepWork::default(), &mut logits)?;
    Ok(logits)
}

/// [`step`] in buffers kept across steps: `work`, and `logits`, resized to `[batch,
/// vocab_padded]`.
pub fn step_into<F: Real>(
    w: &Mamba1Weights,
    states: &mut [&mut State<F>],
    tokens: &[u32],
    work: &mut StepWork<F>,
    logits: &mut Vec<F>,
) -> Result<()> {
    let members = team::members_for(step_bytes(w));
    step_on(w, states, tokens, work, logits, members, false).map(|_| ())
}

/// Bytes of the matrices a step reads.
fn step_bytes(w: &Mamba1Weights) -> usize {
    let bytes = |m: &Matrix| m.data.len() * m.data.dtype().size();
    let layers: usize = w
        .layers
        .iter()
        .map(|b| {
            let m = &b.mixer;
            bytes(&m.in_proj) + bytes(&m.x_proj) + bytes(&m.dt_proj) + bytes(&m.out_proj)
        })
        .sum();
    layers + bytes(w.head())
}

/// [`step_into`] on up to `members` threads (exactly that many, capped at the pool's, if
/// `exact`); returns how many ran the last job. Batches over
/// [`crate::cpu::matmul::STREAM_MAX_ROWS`] run in parts of that many rows, each a job:
/// every row takes the weight-streaming products (the same bits whatever the batch; the
/// pool's step took the GEMM above 64 rows).
pub(crate) fn step_on<F: Real>(
    w: &Mamba1Weights,
    states: &mut [&mut State<F>],
    tokens: &[u32],
    work: &mut StepWork<F>,
    logits: &mut Vec<F>,
    members: usize,
    exact: bool,
) -> Result<usize> {
    let cfg = w.mixer_config()?.clone();
    let vp = w.config.vocab_padded;
    check_step(states, tokens, &layout(&cfg, w.config.n_layer), vp)?;
    Ok(in_jobs(states, tokens, logits, vp, |st, toks, out| {
        job(w, &cfg, st, toks, work, out, (members, exact))
    }))
}

/// One team job: the step of up to [`crate::cpu::matmul::STREAM_MAX_ROWS`] sequences,
/// checked.
fn job<F: Real>(
    w: &Mamba1Weights,
    cfg: &Mamba1Config,
    states: &mut [&mut State<F>],
    tokens: &[u32],
    work: &mut StepWork<F>,
    logits: &mut [F],
    members: (usize, bool),
) -> usize {
    let rows = tokens.len();
    let (di, dm, vp) = (cfg.d_inner, w.config.d_model, w.config.vocab_padded);
    let wd = cfg.dt_rank + 2 * cfg.d_state;
    let widest = [2 * di, wd, dm, vp].into_iter().max().unwrap_or(0);
    work.proj.resize(rows * 2 * di, F::zero());
    work.xc.resize(rows * di, F::zero());
    work.dbc.resize(rows * wd, F::zero());
    work.gated.resize(rows * di, F::zero());
    let StepWork {
        proj,
        xc,
        dbc,
        gated,
        lm,
    } = work;
    let mix = Shared {
        proj: SharedBuf::new(proj),
        xc: SharedBuf::new(xc),
        dbc: SharedBuf::new(dbc),
        gated: SharedBuf::new(gated),
    };
    let mixer = |m: &Member,
                 l,
                 mw: &Mamba1Mixer,
                 normed: &[F],
                 xk: &mut Vec<F>,
                 mine: &mut MemberWork<F>,
                 sh: &TeamShared<F>| {
        // SAFETY: called by every member of the job, the buffers sized above.
        unsafe { mixer(m, cfg, l, mw, normed, xk, mine, &mix, sh) }
    };
    team_job(w, states, tokens, logits, lm, widest, members, mixer)
}

/// The mixer's buffers the members share.
struct Shared<'a, F> {
    proj: SharedBuf<'a, F>,
    xc: SharedBuf<'a, F>,
    dbc: SharedBuf<'a, F>,
    gated: SharedBuf<'a, F>,
}

/// One member's part of layer `l`'s mixer, from the normed rows to its output in `lm.hs`,
/// with the operations of the pool's step (`prefill::ssm_inputs`, `scan`, `gate_rows`),
/// so the same bits on any number of members. Four barriers: after in_proj and the conv
/// (x_proj reads every channel), after x_proj (Δ needs all of δ), after the scan and the
/// gate (out_proj reads every channel), after out_proj (the residual takes every row).
///
/// # Safety
/// Called by every member of one job, with the shared buffers sized for the batch.
#[allow(clippy::too_many_arguments)]
unsafe fn mixer<F: Real>(
    m: &Member,
    c: &Mamba1Config,
    l: usize,
    mw: &Mamba1Mixer,
    normed: &[F],
    xk: &mut Vec<F>,
    mine: &mut MemberWork<F>,
    sh: &Shared<F>,
    lm: &TeamShared<F>,
) {
    let rows = normed.len() / mw.in_proj.cols;
    let (di, n, r, k) = (c.d_inner, c.d_state, c.dt_rank, c.d_conv);
    let wd = r + 2 * n;
    let dm = mw.out_proj.rows;
    let MemberWork {
        dbc: dbc_n,
        dlow,
        delta,
        a,
    } = mine;
    // in_proj piece by piece, and the conv of each piece's x channels, each sequence on
    // its own state.
    let x_in = stream_input(normed, rows, &mw.in_proj, xk);
    let w_in = (&mw.in_proj, mw.in_proj_bias.as_deref());
    for js in m.chunks(2 * di, piece_rows(&mw.in_proj)) {
        project_cols(x_in, rows, w_in, js.clone(), (&sh.proj, &lm.tmp));
        let cs = js.start.min(di)..js.end.min(di);
        for (b, (ll, st)) in lm.states.iter().enumerate() {
            let base = l * ll;
            let conv = st.part(base + cs.start * k..base + cs.end * k);
            let x = sh.proj.part(b * 2 * di + cs.start..b * 2 * di + cs.end);
            let o = sh.xc.part(b * di + cs.start..b * di + cs.end);
            conv_token(x, cs.start, conv, taps(c, mw), o);
        }
    }
    m.barrier();
    // x_proj: every channel in, its R + 2N rows out.
    let x_in = stream_input(sh.xc.get(), rows, &mw.x_proj, xk);
    for js in m.chunks(wd, 16) {
        product_cols(x_in, rows, &mw.x_proj, js, (&sh.dbc, &lm.tmp), true);
    }
    m.barrier();
    // δ, B, C of every row (FalconMamba's norms) in each member, then channel by channel
    // piece Δ, the scan and the gate.
    dbc_n.clear();
    dbc_n.extend_from_slice(sh.dbc.get());
    if let Some(e) = c.bcdt_rms_eps {
        let e = F::from_f(e);
        for row in dbc_n.chunks_mut(wd) {
            let (d, bc) = row.split_at_mut(r);
            let (b, cc) = bc.split_at_mut(n);
            rms_unit(d, e);
            rms_unit(b, e);
            rms_unit(cc, e);
        }
    }
    dlow.clear();
    dlow.extend(dbc_n.chunks(wd).flat_map(|row| row[..r].iter().copied()));
    let d_in = stream_input(dlow, rows, &mw.dt_proj, xk);
    let cutoff = decay_cutoff::<F>();
    for cs in m.chunks(di, SCAN_PIECE) {
        delta.resize(cs.len() * rows, F::zero());
        stream_part(d_in, rows, &mw.dt_proj, cs.start, delta, true);
        for (jj, dr) in delta.chunks_mut(rows).enumerate() {
            let bias = F::from_f(mw.dt_bias[cs.start + jj] as f64);
            for v in dr {
                *v = softplus(*v + bias);
            }
        }
        let a_share = neg_a_share(mw, cs.start * n..cs.end * n, a);
        for (b, (ll, st)) in lm.states.iter().enumerate() {
            let base = l * ll + di * k;
            let ssm = st.part(base + cs.start * n..base + cs.end * n);
            let x = sh.xc.part(b * di + cs.start..b * di + cs.end);
            let bc = &dbc_n[b * wd + r..(b + 1) * wd];
            let z0 = b * 2 * di + di;
            let z = sh.proj.part(z0 + cs.start..z0 + cs.end);
            let g = sh.gated.part(b * di + cs.start..b * di + cs.end);
            let io = (&*x, &*z, g);
            scan_gate(mw, cs.start, (rows, b), io, delta, bc, a_share, ssm, cutoff);
        }
    }
    m.barrier();
    // out_proj: every channel in, the D_m rows out.
    let g_in = stream_input(sh.gated.get(), rows, &mw.out_proj, xk);
    let w_out = (&mw.out_proj, mw.out_proj_bias.as_deref());
    for js in m.chunks(dm, piece_rows(&mw.out_proj)) {
        project_cols(g_in, rows, w_out, js, (&lm.hs, &lm.tmp));
    }
    m.barrier();
}

/// `A` of the state entries `range` (`[channels, N]`): precomputed at load in f32
/// ([`Mamba1Mixer::a_neg`]), else computed into `buf` with the same operations.
fn neg_a_share<'a, F: Real>(
    mw: &'a Mamba1Mixer,
    range: std::ops::Range<usize>,
    buf: &'a mut Vec<F>,
) -> &'a [F] {
    if std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>() {
        return bytemuck::cast_slice(&mw.a_neg[range]);
    }
    buf.clear();
    buf.extend(
        mw.a_log[range]
            .iter()
            .map(|&v| -F::from_f(v as f64).exp_fast()),
    );
    buf
}

/// One token's selective scan of sequence `b` for channels `c0 ..` (spec §2.3), then the
/// gate: `x`, `z` their conv output and gate input, `delta` `[channels, rows]` (Δ of every
/// sequence), `bc` = B then C `[2N]`, `a` their `A`; advances `ssm` `[channels, N]` in
/// place and writes `g = (D·x + Σ_n h·C) ⊙ silu(z)`. The state stays in its own layout
/// (the prefill's scan transposes blocks of it to run along channels over many tokens,
/// which one token does not repay), the decays on the vectorised `exp_fast`, and each
/// channel's read-out on the lanes of `dot`.
#[allow(clippy::too_many_arguments)]
fn scan_gate<F: Real>(
    mw: &Mamba1Mixer,
    c0: usize,
    (rows, b): (usize, usize),
    (x, z, g): (&[F], &[F], &mut [F]),
    delta: &[F],
    bc: &[F],
    a: &[F],
    ssm: &mut [F],
    cutoff: F,
) {
    let n = bc.len() / 2;
    let (bv, cc) = bc.split_at(n);
    for (i, (dl, &xv)) in delta.iter().skip(b).step_by(rows).zip(x).enumerate() {
        let h = &mut ssm[i * n..(i + 1) * n];
        update_row(h, &a[i * n..(i + 1) * n], bv, *dl, xv, cutoff);
        let y = F::from_f(mw.d[c0 + i] as f64) * xv + dot::<F, F, false>(h, cc);
        g[i] = y * silu(z[i]);
    }
}

/// `h ← exp(Δ·A)·h + Δx·B` for one channel (`h`, `a`, `b` `[N]`): a function of its own so
/// that its slices are known not to alias, a loop the compiler vectorises.
#[inline(never)]
fn update_row<F: Real>(h: &mut [F], a: &[F], b: &[F], dl: F, xv: F, cutoff: F) {
    let n = h.len();
    let (a, b) = (&a[..n], &b[..n]);
    let dx = dl * xv;
    for j in 0..n {
        h[j] = decay_exp(dl * a[j], cutoff) * h[j] + dx * b[j];
    }
}

/// Refuse a decode step's arguments before anything is touched: one token per state, each
/// state of the model's `layout`, each token below `vocab`.
pub(crate) fn check_step<F: Copy + num_traits::Zero>(
    states: &[&mut State<F>],
    tokens: &[u32],
    layout: &StateLayout,
    vocab: usize,
) -> Result<()> {
    if states.len() != tokens.len() {
        return Err(Error::input(format!(
            "a decode step takes one token per sequence: {} tokens for {} states",
            tokens.len(),
            states.len()
        )));
    }
    for (st, &t) in states.iter().zip(tokens) {
        check_state(st, layout)?;
        if t as usize >= vocab {
            return Err(Error::TokenOutOfRange {
                id: t as u64,
                pos: 0,
                vocab,
            });
        }
    }
    Ok(())
}
