//! Checks of a family's fast CPU paths against its reference, shared by the Mamba-1 and
//! Mamba-2 tests: both keep `[conv | ssm]` states and the same prefill/step interface,
//! which [`FastFamily`] names once.

use super::golden_tests::{rel_l2, to64};
use crate::cpu::Real;
use crate::error::Result;
use crate::mixers::family_synthetic::Gen;
use crate::mixers::mamba1::weights::Mamba1Weights;
use crate::mixers::mamba2::weights::Mamba2Weights;
use crate::mixers::{mamba2, LogitsWant};
use crate::model::state_layout::StateBuf;

/// What the shared checks need of a family's weights.
pub trait FastFamily {
    fn zero_state<F: Real>(&self) -> StateBuf<F>;
    /// values of a layer's conv state (the rest is the SSM state)
    fn conv_len(&self) -> usize;
    fn vocab_padded(&self) -> usize;
    fn prefill<F: Real>(
        &self,
        st: &mut StateBuf<F>,
        tokens: &[u32],
        want: LogitsWant,
    ) -> Result<Vec<F>>;
    fn step<F: Real>(&self, states: &mut [&mut StateBuf<F>], tokens: &[u32]) -> Result<Vec<F>>;
    /// The f64 reference over `tokens` from `st`: every position's logits.
    fn reference(&self, st: &mut StateBuf<f64>, tokens: &[u32]) -> Vec<f64>;
    /// The team step in f32 on exactly `members` threads (fresh buffers): how many ran.
    fn step_on(
        &self,
        states: &mut [&mut StateBuf<f32>],
        tokens: &[u32],
        logits: &mut Vec<f32>,
        members: usize,
    ) -> Result<usize>;
}

impl FastFamily for Mamba1Weights {
    fn zero_state<F: Real>(&self) -> StateBuf<F> {
        super::zero_state(self.config.mamba1().unwrap(), self.config.n_layer)
    }
    fn conv_len(&self) -> usize {
        let c = self.config.mamba1().unwrap();
        c.d_inner * c.d_conv
    }
    fn vocab_padded(&self) -> usize {
        self.config.vocab_padded
    }
    fn prefill<F: Real>(
        &self,
        st: &mut StateBuf<F>,
        tokens: &[u32],
        want: LogitsWant,
    ) -> Result<Vec<F>> {
        super::prefill::prefill(self, st, tokens, want)
    }
    fn step<F: Real>(&self, states: &mut [&mut StateBuf<F>], tokens: &[u32]) -> Result<Vec<F>> {
        super::step::step(self, states, tokens)
    }
    fn reference(&self, st: &mut StateBuf<f64>, tokens: &[u32]) -> Vec<f64> {
        let r = super::reference::Reference::<f64>::new(self).unwrap();
        r.forward(st, tokens).unwrap().concat()
    }
    fn step_on(
        &self,
        states: &mut [&mut StateBuf<f32>],
        tokens: &[u32],
        logits: &mut Vec<f32>,
        members: usize,
    ) -> Result<usize> {
        let mut work = super::step::StepWork::default();
        super::step::step_on(self, states, tokens, &mut work, logits, members, true)
    }
}

impl FastFamily for Mamba2Weights {
    fn zero_state<F: Real>(&self) -> StateBuf<F> {
        mamba2::zero_state(self.config.mamba2().unwrap(), self.config.n_layer)
    }
    fn conv_len(&self) -> usize {
        let c = self.config.mamba2().unwrap();
        c.conv_dim() * c.d_conv
    }
    fn vocab_padded(&self) -> usize {
        self.config.vocab_padded
    }
    fn prefill<F: Real>(
        &self,
        st: &mut StateBuf<F>,
        tokens: &[u32],
        want: LogitsWant,
    ) -> Result<Vec<F>> {
        mamba2::prefill::prefill(self, st, tokens, want)
    }
    fn step<F: Real>(&self, states: &mut [&mut StateBuf<F>], tokens: &[u32]) -> Result<Vec<F>> {
        mamba2::step::step(self, states, tokens)
    }
    fn reference(&self, st: &mut StateBuf<f64>, tokens: &[u32]) -> Vec<f64> {
        let r = mamba2::reference::Reference::<f64>::new(self).unwrap();
        r.forward(st, tokens).unwrap().concat()
    }
    fn step_on(
        &self,
        states: &mut [&mut StateBuf<f32>],
        tokens: &[u32],
        logits: &mut Vec<f32>,
        members: usize,
    ) -> Result<usize> {
        let mut work = mamba2::step::StepWork::default();
        mamba2::step::step_on(self, states, tokens, &mut work, logits, members, true)
    }
}

/// Three sequences prefilled to different lengths, then one step of batch 1 and of batch 3
/// on one and on two members of the thread team: the same bits, logits and states.
pub fn team_step_is_member_invariant(w: &impl FastFamily, vocab: usize, what: &str) {
    let mut gen = Gen::new(9);
    let start: Vec<StateBuf<f32>> = (0..3)
        .map(|i| {
            let mut st = w.zero_state();
            w.prefill::<f32>(&mut st, &gen.tokens(2 + 3 * i, vocab), LogitsWant::None)
                .unwrap();
            st
        })
        .collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for batch in [1, 3] {
        let toks = gen.tokens(batch, vocab);
        let mut runs = Vec::new();
        for members in [1, 2] {
            let mut sts = start.clone();
            let mut refs: Vec<&mut StateBuf<f32>> = sts.iter_mut().take(batch).collect();
            let mut logits = Vec::new();
            let ran = w.step_on(&mut refs, &toks, &mut logits, members).unwrap();
            assert_eq!(ran, members.min(crate::cpu::team::max_members()));
            let states: Vec<u32> = sts.iter().flat_map(|s| bits(&s.data)).collect();
            runs.push((bits(&logits), states));
        }
        assert!(
            runs[0] == runs[1],
            "{what} batch {batch}: 1 and 2 members differ"
        );
    }
}

/// Windows `ends` of `tokens` through the fast path from a fresh state: all logits and the
/// final state.
pub fn windows<F: Real>(
    w: &impl FastFamily,
    tokens: &[u32],
    ends: &[usize],
) -> (Vec<f64>, StateBuf<F>) {
    let mut st = w.zero_state();
    let mut out = Vec::new();
    let mut start = 0;
    for &end in ends {
        out.extend(to64(
            &w.prefill::<F>(&mut st, &tokens[start..end], LogitsWant::All)
                .unwrap(),
        ));
        start = end;
    }
    (out, st)
}

/// The worst of the conv and SSM parts of every layer (their scales differ, so each is
/// compared alone).
pub fn state_err<F: Real>(a: &StateBuf<F>, b: &StateBuf<f64>, conv: usize) -> f64 {
    a.data
        .chunks(a.layer_len)
        .zip(b.data.chunks(b.layer_len))
        .map(|(x, y)| {
            let (xc, xs) = x.split_at(conv);
            let (yc, ys) = y.split_at(conv);
            rel_l2(&to64(xc), yc).max(rel_l2(&to64(xs), ys))
        })
        .fold(0.0, f64::max)
}

/// Three sequences of different lengths, prefilled by the fast path, then decoded together
/// by the batched step: each equals its own reference run.
pub fn batched_step_matches_the_reference<F: Real>(w: &impl FastFamily, tol: f64) {
    let vocab = w.vocab_padded();
    let mut gen = Gen::new(7);
    let prompts: Vec<Vec<u32>> = [5, 1, 23].iter().map(|&n| gen.tokens(n, vocab)).collect();
    let steps: Vec<Vec<u32>> = (0..4).map(|_| gen.tokens(3, vocab)).collect();
    let mut states: Vec<StateBuf<F>> = prompts
        .iter()
        .map(|p| {
            let mut st = w.zero_state();
            w.prefill(&mut st, p, LogitsWant::None).unwrap();
            st
        })
        .collect();
    let mut got: Vec<Vec<f64>> = vec![Vec::new(); 3];
    let mut alone_states = states.clone();
    for toks in &steps {
        let mut refs: Vec<&mut StateBuf<F>> = states.iter_mut().collect();
        let out = w.step(&mut refs, toks).unwrap();
        for (i, row) in out.chunks(vocab).enumerate() {
            got[i].extend(to64(row));
            // Batch invariance: the same sequence stepped alone gives the same bits.
            let alone = w
                .step(&mut [&mut alone_states[i]], &toks[i..i + 1])
                .unwrap();
            let bits = |v: &[F]| to64(v).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&alone),
                bits(row),
                "sequence {i}: alone against batched"
            );
        }
    }
    for (i, p) in prompts.iter().enumerate() {
        let mut st = w.zero_state();
        w.reference(&mut st, p);
        let seq: Vec<u32> = steps.iter().map(|s| s[i]).collect();
        let want = w.reference(&mut st, &seq);
        let e = rel_l2(&got[i], &want);
        assert!(e <= tol, "sequence {i}: batched step rel L2 {e:e}");
        assert!(
            state_err(&states[i], &st, w.conv_len()) <= tol,
            "sequence {i}: states"
        );
    }
    // Refusals leave every state as it was.
    let before = states.clone();
    let mut refs: Vec<&mut StateBuf<F>> = states.iter_mut().collect();
    let e = w.step(&mut refs, &[1, 2]).unwrap_err().to_string();
    assert!(e.contains("2 tokens for 3 states"), "{e}");
    let e = w
        .step(&mut refs, &[1, vocab as u32, 2])
        .unwrap_err()
        .to_string();
    assert!(e.contains("out of range"), "{e}");
    assert_eq!(states, before);
}
