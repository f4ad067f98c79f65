//! Continuous batching on one engine thread.
//!
//! The thread owns the [`Model`], every sequence's [`State`] and the prefix cache; HTTP
//! handlers talk to it through a channel of [`Work`] and get [`Event`]s back on a channel
//! per request. Each turn of its loop:
//!
//! 1. takes in new work (blocking only when there is nothing to do) and drops the
//!    sequences whose client went away (their event channel is closed);
//! 2. admits waiting sequences into free slots, each starting from the longest cached
//!    prefix of its prompt;
//! 3. prefills at most `prefill_chunk` prompt tokens (shared by the sequences still
//!    reading their prompts, in arrival order, as one batched continued-window pass) so
//!    that a long prompt never stalls the running sequences for long; a window ends at each
//!    cache point (where this prompt branches from a cached one, and its end), and the state
//!    there goes into the prefix cache; on a GPU a short turn of one sequence replays a
//!    prefill graph of its length (`short_prefill.rs`);
//! 4. decodes one token for every running sequence in one batched step (sampled where
//!    the logits are: on a GPU only the ids come back);
//! 5. takes the emitter's answer for the previous turn's tokens (sequences a stop string
//!    ended leave now, one step late: the token decoded for them in step 4 is never sent,
//!    and the state cached for them is the one after their last sent token), applies the
//!    id rules (stop ids, `max_tokens`) to this turn's tokens, lets the sequences they end
//!    leave at once (their slot is free for the next turn), and hands the turn's tokens to
//!    the emitter ([`super::emitter`]), which detokenizes, checks stop strings and streams
//!    them out while the next turn's device work runs;
//! 6. reads at most `prefill_chunk` tokens of the oldest embedding request (each input
//!    from a fresh state: the whole-page, stateless read) and answers it when done.
//!
//! A panic inside a turn fails the sequences of that turn with an error event and the
//! thread carries on.

use super::emitter::{self, Emit, Outcome, TokenOut};
pub use super::event::Event;

mod embed;
mod handoff;
mod short_prefill;
use super::metrics::{DeviceMetrics, Metrics, Phase};
use super::prefix_cache::{Hit, PrefixCache};
use crate::engine::{row_logprobs, Device, LogitsWant, Model, SampleStep, State};
use crate::text::generate::{all_finite, non_finite_logits};
use crate::text::{FinishReason, GenParams, Sampler, TextRules, TokenRules, Tokenizer};
use embed::EmbedTask;
use handoff::Out;
use short_prefill::ShortPrefill;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences decoded together at most (slots).
    pub max_batch: usize,
    /// Prompt tokens prefilled per turn at most.
    pub prefill_chunk: usize,
    /// Prefix cache budget in bytes (0 disables the cache).
    pub cache_bytes: usize,
    /// Also cache the state at the end of each generation (prompt + answer), so that a
    /// conversation's next turn starts from there.
    pub cache_generated: bool,
    /// A branch point is snapshotted only if it is at least this many tokens past the
    /// cached prefix the prompt starts from.
    pub branch_min_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batch: 64,
            prefill_chunk: 512,
            cache_bytes: 1 << 30,
            cache_generated: true,
            branch_min_tokens: 32,
        }
    }
}

/// What the engine thread is asked to do.
pub enum Work {
    Generate(GenJob),
    Embed(EmbedJob),
    /// The server is shutting down and its grace period is over: end every sequence now
    /// (finish reason `abort`) and every one that arrives later.
    Shutdown,
}

pub struct GenJob {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// The choice index of this sequence in its response.
    pub index: usize,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    Last,
    Mean,
}

pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub pooling: Pooling,
    pub reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, String>>,
}

/// Handles shared between the HTTP side and the engine thread.
pub struct Shared {
    pub metrics: Arc<Metrics>,
    /// Sequences submitted and not yet admitted (the bounded queue).
    pub queued: AtomicUsize,
}

struct Seq {
    /// Names the sequence to the emitter.
    id: u64,
    job: GenJob,
    /// The id side of its continuation (the text side is the emitter's).
    tokens: TokenRules,
    state: State,
    /// Prompt tokens already in the state.
    fed: usize,
    /// Positions where the state goes into the cache (increasing, all > fed).
    cache_points: Vec<usize>,
    /// Token to feed at the next decode step.
    next: Option<u32>,
    /// Its row in this turn's decode step (whose logits a late stop caches).
    step_row: Option<usize>,
    closed: bool,
}

pub struct Scheduler {
    model: Model,
    tokenizer: Option<Arc<Tokenizer>>,
    cfg: SchedulerConfig,
    /// The prefix cache (locked only briefly: a server of several replicas looks into it
    /// to send a prompt where its prefix is, see `serve::dispatch`).
    cache: Arc<Mutex<PrefixCache>>,
    shared: Arc<Shared>,
    /// This replica's counters.
    device: Arc<DeviceMetrics>,
    waiting: VecDeque<GenJob>,
    active: Vec<Seq>,
    embeds: VecDeque<EmbedTask>,
    /// The decode step's sampled ids (on a GPU sampled on the device), its rows (indices
    /// into `active`) and their tokens, kept from step to step.
    sampled: SampleStep,
    step_rows: Vec<usize>,
    step_tokens: Vec<u32>,
    /// The tokens of this turn, for the emitter.
    batch: Vec<TokenOut>,
    emitter: Sender<Emit>,
    outcomes: Receiver<Outcome>,
    emitter_thread: Option<std::thread::JoinHandle<()>>,
    /// A batch was handed to the emitter and its outcome not yet taken.
    emitting: bool,
    next_id: u64,
    /// Set by [`Work::Shutdown`].
    stopping: bool,
    /// Short prefill turns by CUDA graph.
    short_prefill: ShortPrefill,
}

impl Scheduler {
    /// A scheduler of `model` with its prefix cache `cache` (of `cfg.cache_bytes`), whose
    /// counters go to `device` (one of `shared.metrics`'s replicas); starts its emitter
    /// thread.
    pub fn new(
        model: Model,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: SchedulerConfig,
        shared: Arc<Shared>,
        device: Arc<DeviceMetrics>,
        cache: Arc<Mutex<PrefixCache>>,
    ) -> std::io::Result<Scheduler> {
        shared
            .metrics
            .cache_budget
            .store(cfg.cache_bytes as u64, Relaxed);
        let (emitter, outcomes, thread) = emitter::spawn(shared.metrics.clone(), device.clone())?;
        Ok(Scheduler {
            cache,
            short_prefill: ShortPrefill::new(&model),
            model,
            tokenizer,
            cfg,
            shared,
            device,
            waiting: VecDeque::new(),
            active: Vec::new(),
            embeds: VecDeque::new(),
            sampled: SampleStep::new(),
            step_rows: Vec::new(),
            step_tokens: Vec::new(),
            batch: Vec::new(),
            emitter,
            outcomes,
            emitter_thread: Some(thread),
            emitting: false,
            next_id: 0,
            stopping: false,
        })
    }

    /// The sizes of the model served.
    pub fn dims(&self) -> crate::mixers::LmDims {
        self.model.dims()
    }

    /// Serve until every sender of `rx` is gone.
    pub fn run(mut self, rx: Receiver<Work>) {
        loop {
            if self.idle() {
                match rx.recv() {
                    Ok(w) => self.take(w),
                    Err(_) => break,
                }
            }
            let mut gone = false;
            loop {
                match rx.try_recv() {
                    Ok(w) => self.take(w),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        gone = true;
                        break;
                    }
                }
            }
            if gone && self.idle() {
                break;
            }
            let t = Instant::now();
            let turn = std::panic::catch_unwind(AssertUnwindSafe(|| self.turn()));
            if let Err(panic) = turn {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                self.batch.clear();
                for s in std::mem::take(&mut self.active) {
                    self.end(
                        &s,
                        Some(Event::Error {
                            index: s.job.index,
                            message: format!("internal error in the engine: {msg}"),
                        }),
                    );
                }
                if let Some(t) = self.embeds.pop_front() {
                    let _ = t
                        .job
                        .reply
                        .send(Err(format!("internal error in the engine: {msg}")));
                }
            }
            self.device.engine_busy.since(t);
            self.publish();
        }
        // Let the emitter send what it holds, then stop it.
        let (tx, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.emitter, tx));
        if let Some(t) = self.emitter_thread.take() {
            let _ = t.join();
        }
    }

    /// End an admitted sequence with `event` (after the tokens the emitter holds).
    fn end(&self, s: &Seq, event: Option<Event>) {
        let _ = self.emitter.send(Emit::End { id: s.id, event });
    }

    fn take(&mut self, w: Work) {
        match w {
            Work::Shutdown => {
                self.stopping = true;
                for s in std::mem::take(&mut self.active) {
                    let reason = FinishReason::Abort;
                    let index = s.job.index;
                    self.end(&s, Some(Event::Finish { index, reason }));
                }
                for job in self.waiting.drain(..) {
                    self.shared.queued.fetch_sub(1, Relaxed);
                    let _ = job.events.send(Event::Finish {
                        index: job.index,
                        reason: FinishReason::Abort,
                    });
                }
                for t in self.embeds.drain(..) {
                    let _ = t.job.reply.send(Err("the server is shutting down".into()));
                }
            }
            Work::Generate(job) if self.stopping => {
                self.device.taken.fetch_add(1, Relaxed);
                self.shared.queued.fetch_sub(1, Relaxed);
                let _ = job.events.send(Event::Finish {
                    index: job.index,
                    reason: FinishReason::Abort,
                });
            }
            Work::Embed(job) if self.stopping => {
                let _ = job.reply.send(Err("the server is shutting down".into()));
            }
            Work::Generate(job) => {
                self.device.held.fetch_add(1, Relaxed);
                self.device.taken.fetch_add(1, Relaxed);
                self.waiting.push_back(job);
            }
            Work::Embed(job) => {
                let d = self.model.dims().d_model;
                self.embeds.push_back(EmbedTask {
                    job,
                    input: 0,
                    state: None,
                    fed: 0,
                    sum: vec![0.0; d],
                    out: Vec::new(),
                });
            }
        }
    }

    fn idle(&self) -> bool {
        self.active.is_empty() && self.waiting.is_empty() && self.embeds.is_empty()
    }

    fn publish(&self) {
        let d = &self.device;
        d.active_sequences.store(self.active.len() as i64, Relaxed);
        d.queue_depth.store(self.waiting.len() as i64, Relaxed);
        d.held
            .store((self.waiting.len() + self.active.len()) as i64, Relaxed);
        self.shared
            .metrics
            .queue_depth
            .store(self.shared.queued.load(Relaxed) as i64, Relaxed);
        let st = lock(&self.cache).stats();
        d.cache_bytes.store(st.bytes as u64, Relaxed);
        d.cache_entries.store(st.entries as u64, Relaxed);
        d.cache_evictions.store(st.evictions, Relaxed);
    }

    fn turn(&mut self) {
        // Clients that went away leave at once.
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let gone = before - self.waiting.len();
        self.shared.queued.fetch_sub(gone, Relaxed);
        let (left, active): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut self.active)
            .into_iter()
            .partition(|s| s.closed || s.job.events.is_closed());
        self.active = active;
        for s in &left {
            self.end(s, None);
        }
        self.shared
            .metrics
            .cancelled
            .fetch_add((left.len() + gone) as u64, Relaxed);

        while self.active.len() < self.cfg.max_batch {
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            self.shared.queued.fetch_sub(1, Relaxed);
            let t = Instant::now();
            self.admit(job);
            self.device.spent(Phase::Admit, t);
        }
        self.publish();
        let t = Instant::now();
        self.prefill_step();
        self.device.spent(Phase::Prefill, t);
        self.decode_step();
        self.hand_to_emitter();
        if let Err(e) = self.embed_step() {
            if let Some(t) = self.embeds.pop_front() {
                let _ = t.job.reply.send(Err(format!("embedding failed: {e}")));
            }
        }
        self.active.retain(|s| !s.closed);
    }

    fn admit(&mut self, job: GenJob) {
        let m = &self.device;
        self.shared
            .metrics
            .prompt_tokens
            .fetch_add(job.prompt.len() as u64, Relaxed);
        let lookup = if self.cfg.cache_bytes > 0 {
            Some(lock(&self.cache).lookup(&job.prompt))
        } else {
            None
        };
        let (hit, shared) = match lookup {
            Some(l) => (l.hit, l.shared),
            None => (None, 0),
        };
        let plen = job.prompt.len();
        // A hit starts from the cached state as it is (shared until the first write); only a
        // miss needs a fresh one.
        let (state, fed, first_logits) = match hit {
            Some(Hit { len, state, logits }) => {
                m.cache_hits.fetch_add(1, Relaxed);
                m.cache_hit_tokens.fetch_add(len as u64, Relaxed);
                (state, len, (len == plen).then_some(logits))
            }
            None => {
                m.cache_misses.fetch_add(1, Relaxed);
                (self.model.new_state(), 0, None)
            }
        };
        let tokens = TokenRules::new(&job.params, &job.prompt, self.tokenizer.as_deref());
        let text = TextRules::new(&job.params, self.tokenizer.clone());
        let id = self.next_id;
        self.next_id += 1;
        let _ = self.emitter.send(Emit::Open {
            id,
            index: job.index,
            events: job.events.clone(),
            arrived: job.arrived,
            text,
            cached_tokens: fed,
        });
        let mut seq = Seq {
            id,
            tokens,
            state,
            fed,
            cache_points: Vec::new(),
            next: None,
            step_row: None,
            closed: false,
            job,
        };
        if self.cfg.cache_bytes > 0 {
            if shared < plen && shared >= seq.fed + self.cfg.branch_min_tokens.max(1) {
                seq.cache_points.push(shared);
            }
            if plen > seq.fed {
                seq.cache_points.push(plen);
            }
        }
        if let Some(logits) = first_logits {
            let sampler = seq.tokens.sampler_mut();
            let token = sampler.sample(&logits);
            let lp = sampler
                .params()
                .logprobs
                .map(|n| row_logprobs(&logits, token, n));
            self.out()
                .take(&mut seq, token, lp, || Some(logits.to_vec()));
        }
        if !seq.closed {
            self.active.push(seq);
        }
    }

    fn out(&mut self) -> Out<'_> {
        Out {
            cache: lock(&self.cache),
            cfg: &self.cfg,
            vocab: self.model.dims().vocab_size,
            batch: &mut self.batch,
        }
    }

    fn fail(emitter: &Sender<Emit>, seq: &mut Seq, message: String) {
        let index = seq.job.index;
        let _ = emitter.send(Emit::End {
            id: seq.id,
            event: Some(Event::Error { index, message }),
        });
        seq.closed = true;
    }

    fn prefill_step(&mut self) {
        let mut budget = self.cfg.prefill_chunk.max(1);
        let mut picked: Vec<(usize, usize)> = Vec::new(); // (seq index, end position)
        for (i, s) in self.active.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if s.closed || s.fed >= s.job.prompt.len() {
                continue;
            }
            let stop = s
                .cache_points
                .iter()
                .copied()
                .find(|&p| p > s.fed)
                .unwrap_or(s.job.prompt.len());
            let end = stop.min(s.fed + budget);
            budget -= end - s.fed;
            picked.push((i, end));
        }
        if picked.is_empty() {
            return;
        }
        let vocab = self.model.dims().vocab_size;
        let t = Instant::now();
        let result = {
            let mut pieces: Vec<&[u32]> = Vec::new();
            let mut states: Vec<&mut State> = Vec::new();
            let mut it = picked.iter().peekable();
            for (i, s) in self.active.iter_mut().enumerate() {
                if let Some(&&(j, end)) = it.peek() {
                    if i == j {
                        pieces.push(&s.job.prompt[s.fed..end]);
                        states.push(&mut s.state);
                        it.next();
                    }
                }
            }
            self.short_prefill
                .prefill(&self.model, &pieces, &mut states)
        };
        self.device.device_busy.since(t);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                for &(i, _) in &picked {
                    Self::fail(
                        &self.emitter,
                        &mut self.active[i],
                        format!("prefill failed: {e}"),
                    );
                }
                return;
            }
        };
        let mut o = Out {
            cache: lock(&self.cache),
            cfg: &self.cfg,
            vocab,
            batch: &mut self.batch,
        };
        for (&(i, end), lg) in picked.iter().zip(logits) {
            let row = &lg.data[..vocab];
            let s = &mut self.active[i];
            s.fed = end;
            if !all_finite(row) {
                // Never sampled from nor cached: the sequence fails naming the layer.
                let e = non_finite_logits(&s.state, s.state.position());
                Self::fail(&self.emitter, s, e.to_string());
                continue;
            }
            if s.cache_points.contains(&end) {
                o.cache.insert(
                    &s.job.prompt[..end],
                    s.state.clone(),
                    Arc::new(row.to_vec()),
                );
            }
            if end == s.job.prompt.len() {
                let sampler = s.tokens.sampler_mut();
                let token = sampler.sample(row);
                let lp = sampler
                    .params()
                    .logprobs
                    .map(|n| row_logprobs(row, token, n));
                o.take(s, token, lp, || Some(row.to_vec()));
            }
        }
    }

    /// One batched decode step of every running sequence; its ids stay in `sampled` until
    /// [`Scheduler::hand_to_emitter`] takes them.
    fn decode_step(&mut self) {
        let (rows, tokens) = (&mut self.step_rows, &mut self.step_tokens);
        rows.clear();
        tokens.clear();
        for (i, s) in self.active.iter_mut().enumerate() {
            s.step_row = None;
            if let (false, Some(t)) = (s.closed, s.next) {
                rows.push(i);
                tokens.push(t);
            }
        }
        if rows.is_empty() {
            return;
        }
        let t = Instant::now();
        let result = {
            let mut states: Vec<&mut State> = Vec::with_capacity(rows.len());
            let mut samplers: Vec<&mut Sampler> = Vec::with_capacity(rows.len());
            let mut it = rows.iter().peekable();
            for (i, s) in self.active.iter_mut().enumerate() {
                if it.peek() == Some(&&i) {
                    states.push(&mut s.state);
                    samplers.push(s.tokens.sampler_mut());
                    it.next();
                }
            }
            // Sampled where the logits are: on a GPU only the ids come back.
            self.model
                .decode_sample(tokens, &mut states, &mut samplers, &mut self.sampled)
                .map(|_| ())
        };
        self.device.device_busy.since(t);
        let m = &self.device;
        m.spent(Phase::Decode, t);
        m.decode_steps.fetch_add(1, Relaxed);
        m.decode_rows.fetch_add(rows.len() as u64, Relaxed);
        match result {
            Ok(()) => {
                for (b, &i) in rows.iter().enumerate() {
                    self.active[i].step_row = Some(b);
                }
            }
            Err(e) => {
                for &i in rows.iter() {
                    Self::fail(
                        &self.emitter,
                        &mut self.active[i],
                        format!("decode failed: {e}"),
                    );
                }
                rows.clear();
            }
        }
    }
}

/// The prefix cache, whole even if a thread panicked holding it (every change to it
/// completes before anything can panic).
fn lock(cache: &Mutex<PrefixCache>) -> std::sync::MutexGuard<'_, PrefixCache> {
    cache.lock().unwrap_or_else(|e| e.into_inner())
}
