//! The batched Mamba-2 decode step on the CPU: one token for each of several sequences,
//! each with its own state. in_proj and out_proj read each weight once for the batch's
//! rows; the conv and the state update (spec §3.3, one token: no chunking) run per
//! sequence on its own state.
//!
//! As Mamba-1's step (`mamba1/step.rs`), the whole step is one job on the thread team
//! (`cpu/team.rs`) in buffers kept across steps: the members take every product's weight
//! rows, the conv's channels and the heads piece by piece, meeting at four barriers per
//! layer — after in_proj (the conv reads x, B and C of every head),
//! after the conv (every head reads its group's B and C), after the heads (the gate's
//! grouped norm reads every head of a group; each member then gates every row for
//! itself), after out_proj.

use super::prefill::{deltas_into, gate_rows_into, taps};
use super::{layout, State};
use crate::cpu::matmul::{dot, piece_rows, stream_input};
use crate::cpu::team::{self, Member, SharedBuf};
use crate::cpu::Real;
use crate::error::Result;
use crate::mixers::mamba1::lm::{
    conv_token, decay_cutoff, decay_exp, in_jobs, project_cols, team_job, TeamShared, TeamWork,
};
use crate::mixers::mamba1::step::check_step;
use crate::mixers::mamba2::weights::{Mamba2Mixer, Mamba2Weights};
use crate::model::family_config::Mamba2Config;
use crate::model::weights::Matrix;

/// Channels per piece of the conv: a few µs each.
const CONV_PIECE: usize = 256;

/// A decode step's buffers, kept across steps by the caller (the engine keeps one per
/// model): the shared ones, which members write in parts, and each member's own.
#[derive(Default)]
pub struct StepWork<F> {
    /// `[rows, d_in_proj]`: in_proj's output, bias added
    proj: Vec<F>,
    /// `[rows, C_d]`: the conv's output (x, B, C)
    v: Vec<F>,
    /// `[rows, d_ssm]`: the heads' output with the D skip
    y: Vec<F>,
    lm: TeamWork<F, MemberWork<F>>,
}

/// What each member computes for itself in the mixer.
#[derive(Default)]
struct MemberWork<F> {
    /// `[rows, H]`: Δ
    delta: Vec<F>,
    /// `[rows, D_i]`: the gate's output, out_proj's input
    gated: Vec<F>,
}

/// Advance every `states[i]` by `tokens[i]`; returns the logits `[batch, vocab_padded]`.
/// Nothing is changed when an argument is refused.
pub fn step<F: Real>(
    w: &Mamba2Weights,
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
    w: &Mamba2Weights,
    states: &mut [&mut State<F>],
    tokens: &[u32],
    work: &mut StepWork<F>,
    logits: &mut Vec<F>,
) -> Result<()> {
    let bytes = |m: &Matrix| m.data.len() * m.data.dtype().size();
    let step_bytes: usize = w
        .layers
        .iter()
        .map(|b| bytes(&b.mixer.in_proj) + bytes(&b.mixer.out_proj))
        .sum::<usize>()
        + bytes(w.head());
    let members = team::members_for(step_bytes);
    step_on(w, states, tokens, work, logits, members, false).map(|_| ())
}

/// [`step_into`] on up to `members` threads (exactly that many, capped at the pool's, if
/// `exact`); returns how many ran the last job. Batches over
/// [`crate::cpu::matmul::STREAM_MAX_ROWS`] run in parts of that many rows, each a job (as
/// Mamba-1's).
pub(crate) fn step_on<F: Real>(
    w: &Mamba2Weights,
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
    w: &Mamba2Weights,
    cfg: &Mamba2Config,
    states: &mut [&mut State<F>],
    tokens: &[u32],
    work: &mut StepWork<F>,
    logits: &mut [F],
    members: (usize, bool),
) -> usize {
    let rows = tokens.len();
    let (width, dm, vp) = (cfg.d_in_proj(), w.config.d_model, w.config.vocab_padded);
    let widest = [width, dm, vp].into_iter().max().unwrap_or(0);
    work.proj.resize(rows * width, F::zero());
    work.v.resize(rows * cfg.conv_dim(), F::zero());
    work.y.resize(rows * cfg.d_ssm, F::zero());
    let StepWork { proj, v, y, lm } = work;
    let mix = Shared {
        proj: SharedBuf::new(proj),
        v: SharedBuf::new(v),
        y: SharedBuf::new(y),
    };
    let mixer = |m: &Member,
                 l,
                 mw: &Mamba2Mixer,
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
    v: SharedBuf<'a, F>,
    y: SharedBuf<'a, F>,
}

/// One member's part of layer `l`'s mixer, from the normed rows to its output in `lm.hs`,
/// with the operations of the pool's step (`prefill::deltas_into`, the head update,
/// `prefill::gate_rows_into`), so the same bits on any number of members.
///
/// # Safety
/// Called by every member of one job, with the shared buffers sized for the batch.
#[allow(clippy::too_many_arguments)]
unsafe fn mixer<F: Real>(
    m: &Member,
    c: &Mamba2Config,
    l: usize,
    mw: &Mamba2Mixer,
    normed: &[F],
    xk: &mut Vec<F>,
    mine: &mut MemberWork<F>,
    sh: &Shared<F>,
    lm: &TeamShared<F>,
) {
    let rows = normed.len() / mw.in_proj.cols;
    let (width, cd, k, d_ssm) = (c.d_in_proj(), c.conv_dim(), c.d_conv, c.d_ssm);
    let (p_n, n) = (c.headdim, c.d_state);
    let xbc_off = 2 * c.d_mlp() + d_ssm;
    let dm = mw.out_proj.rows;
    let x_in = stream_input(normed, rows, &mw.in_proj, xk);
    let w_in = (&mw.in_proj, mw.in_proj_bias.as_deref());
    for js in m.chunks(width, piece_rows(&mw.in_proj)) {
        project_cols(x_in, rows, w_in, js, (&sh.proj, &lm.tmp));
    }
    m.barrier();
    // The conv of the channels (x, B, C), each sequence on its own state.
    let proj = sh.proj.get();
    for cs in m.chunks(cd, CONV_PIECE) {
        for (b, (ll, st)) in lm.states.iter().enumerate() {
            let base = l * ll;
            let conv = st.part(base + cs.start * k..base + cs.end * k);
            let x = &proj[b * width + xbc_off + cs.start..b * width + xbc_off + cs.end];
            let o = sh.v.part(b * cd + cs.start..b * cd + cs.end);
            conv_token(x, cs.start, conv, taps(c, mw), o);
        }
    }
    m.barrier();
    // Δ of every head (a few values a row) in each member, then the heads one by one.
    deltas_into(c, mw, proj, rows, &mut mine.delta);
    let v = sh.v.get();
    for heads in m.chunks(c.nheads, 1) {
        for (b, (ll, st)) in lm.states.iter().enumerate() {
            let base = l * ll + cd * k;
            let h = heads.start;
            let hs = st.part(base + h * p_n * n..base + (h + 1) * p_n * n);
            let yh = sh.y.part(b * d_ssm + h * p_n..b * d_ssm + (h + 1) * p_n);
            let dh = mine.delta[b * c.nheads + h];
            update_head(c, mw, h, &v[b * cd..(b + 1) * cd], dh, hs, yh);
        }
    }
    m.barrier();
    // The gate of every row (its grouped norm reads whole groups of heads), then a share
    // of out_proj's rows.
    mine.gated.resize(rows * c.d_inner, F::zero());
    gate_rows_into(c, mw, proj, sh.y.get(), rows, &mut mine.gated);
    let g_in = stream_input(&mine.gated, rows, &mw.out_proj, xk);
    let w_out = (&mw.out_proj, mw.out_proj_bias.as_deref());
    for js in m.chunks(dm, piece_rows(&mw.out_proj)) {
        project_cols(g_in, rows, w_out, js, (&lm.hs, &lm.tmp));
    }
    m.barrier();
}

/// One token's state update and read-out of head `h`: `v` = the conv output `[C_d]`,
/// `delta` its Δ, `hs` its state `[P, N]`; writes its `y` `[P]` with the D skip.
fn update_head<F: Real>(
    c: &Mamba2Config,
    mw: &Mamba2Mixer,
    h: usize,
    v: &[F],
    delta: F,
    hs: &mut [F],
    yh: &mut [F],
) {
    let (p_n, n, g_n) = (c.headdim, c.d_state, c.ngroups);
    let (x, bc) = v.split_at(c.d_ssm);
    let (b, cc) = bc.split_at(g_n * n);
    let g = c.group_of(h);
    let (bg, cg) = (&b[g * n..(g + 1) * n], &cc[g * n..(g + 1) * n]);
    let a = -F::from_f(mw.a_log[h] as f64).exp();
    let decay = decay_exp(delta * a, decay_cutoff());
    for p in 0..p_n {
        let ch = h * p_n + p;
        let dx = delta * x[ch];
        let row = &mut hs[p * n..(p + 1) * n];
        // The update, then the read-out on `dot`'s lanes: one running sum through the row
        // kept each step waiting on the last add (not vectorised).
        for j in 0..n {
            row[j] = decay * row[j] + dx * bg[j];
        }
        let acc = dot::<F, F, false>(row, cg);
        let d = if c.d_has_hdim { mw.d[ch] } else { mw.d[h] };
        yh[p] = acc + F::from_f(d as f64) * x[ch];
    }
}
