//! The turn's hand-over to the emitter: the previous turn's answer (sequences a stop string
//! ended), this turn's sampled ids taken into the sequences (ending and caching those an id
//! ends), and the batch of tokens sent to be detokenized and streamed.

use super::*;
use crate::engine::TokenLogprobs;

impl Scheduler {
    /// Take the emitter's answer for the previous turn (ending the sequences a stop string
    /// ended), take this turn's decoded ids, and hand the turn's tokens to the emitter.
    pub(super) fn hand_to_emitter(&mut self) {
        let t = Instant::now();
        if self.emitting {
            self.emitting = false;
            match self.outcomes.recv() {
                Ok(outcome) => self.apply(outcome),
                Err(_) => {
                    // (the emitter is gone: nothing more can reach the clients)
                    for s in &mut self.active {
                        s.closed = true;
                    }
                }
            }
        }
        let t = self.device.spent(Phase::EmitWait, t);
        let vocab = self.model.dims().vocab_size;
        let (model, sampled) = (&self.model, &self.sampled);
        let mut o = Out {
            cache: lock(&self.cache),
            cfg: &self.cfg,
            vocab,
            batch: &mut self.batch,
        };
        for (b, &i) in self.step_rows.iter().enumerate() {
            let s = &mut self.active[i];
            if s.closed {
                // (ended by a stop string one step ago: this token is never sent)
                continue;
            }
            if sampled.finite(b) {
                // (a row that was not finite is never sampled from nor cached)
                // Only a sequence that ends here and is cached needs its row of logits:
                // on a GPU that one row comes from the device.
                let lp = sampled.logprobs(b).cloned();
                o.take(s, sampled.ids()[b], lp, || {
                    model.step_logits_row(sampled, b).ok()
                });
            } else {
                let e = non_finite_logits(&s.state, s.state.position());
                Self::fail(&self.emitter, s, e.to_string());
            }
        }
        drop(o);
        self.step_rows.clear();
        if !self.batch.is_empty() {
            let batch = std::mem::take(&mut self.batch);
            self.emitting = self.emitter.send(Emit::Tokens(batch)).is_ok();
        }
        self.device.spent(Phase::Emit, t);
    }

    /// The emitter's answer for the previous turn's tokens.
    fn apply(&mut self, outcome: Outcome) {
        let cancelled = &self.shared.metrics.cancelled;
        for id in outcome.gone {
            if let Some(s) = self.active.iter_mut().find(|s| s.id == id && !s.closed) {
                s.closed = true;
                cancelled.fetch_add(1, Relaxed);
            }
        }
        let caching = self.cfg.cache_generated && self.cfg.cache_bytes > 0;
        for id in outcome.stopped {
            let Some(s) = self.active.iter_mut().find(|s| s.id == id && !s.closed) else {
                continue;
            };
            s.closed = true;
            // This turn's step fed the last sent token: the state holds the prompt and
            // every sent token, and the step's row is the logits after them.
            let Some(b) = s.step_row.filter(|_| caching) else {
                continue;
            };
            if let Ok(mut row) = self.model.step_logits_row(&self.sampled, b) {
                row.truncate(self.model.dims().vocab_size);
                let mut key = s.job.prompt.clone();
                key.extend_from_slice(s.tokens.generated());
                lock(&self.cache).insert(&key, s.state.clone(), Arc::new(row));
            }
        }
    }
}

/// What taking a sampled token needs, borrowed apart from the active list.
pub(super) struct Out<'a> {
    pub(super) cache: std::sync::MutexGuard<'a, PrefixCache>,
    pub(super) cfg: &'a SchedulerConfig,
    pub(super) vocab: usize,
    pub(super) batch: &'a mut Vec<TokenOut>,
}

impl Out<'_> {
    /// Take `token` as `seq`'s next, with its log-probabilities when asked for (`logits`
    /// gives the row it was sampled from, wanted only when a finished sequence is cached:
    /// `vocab_size` entries or more) into the turn's batch; a sequence whose id ends it
    /// is closed (and cached) now.
    pub(super) fn take(
        &mut self,
        seq: &mut Seq,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        logits: impl FnOnce() -> Option<Vec<f32>>,
    ) {
        let end = seq.tokens.push(token);
        self.batch.push(TokenOut {
            id: seq.id,
            token,
            end,
            logprobs,
        });
        if end.is_none() {
            seq.next = Some(token);
            return;
        }
        seq.closed = true;
        if self.cfg.cache_generated && self.cfg.cache_bytes > 0 {
            // The state has read the prompt and every generated token but the last.
            let gen = seq.tokens.generated();
            if gen.len() > 1 {
                let mut key = seq.job.prompt.clone();
                key.extend_from_slice(&gen[..gen.len() - 1]);
                // (a row the device no longer holds is not cached)
                if let Some(mut row) = logits() {
                    row.truncate(self.vocab);
                    self.cache.insert(&key, seq.state.clone(), Arc::new(row));
                }
            }
        }
    }
}
