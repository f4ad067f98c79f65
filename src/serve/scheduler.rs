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
//!    there goes into the prefix cache;
//! 4. decodes one token for every running sequence in one batched step, samples, streams
//!    the text out, and lets finished sequences leave at once (their slot is free for the
//!    next turn);
//! 5. reads at most `prefill_chunk` tokens of the oldest embedding request (each input
//!    from a fresh state: the whole-page, stateless read) and answers it when done.
//!
//! A panic inside a turn fails the sequences of that turn with an error event and the
//! thread carries on.

use super::metrics::{Metrics, Phase};
use super::prefix_cache::{Hit, PrefixCache};
use crate::engine::{LogitsWant, Model, SampleStep, State};
use crate::text::generate::{all_finite, non_finite_logits};
use crate::text::{Continuation, FinishReason, GenParams, Sampler, StepOut, Tokenizer};
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
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

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The prompt is read: how many of its tokens came from the prefix cache.
    Started { index: usize, cached_tokens: usize },
    /// One generated token and the text it made final; the last one has `finish`.
    Token {
        index: usize,
        token: u32,
        text: String,
        finish: Option<FinishReason>,
    },
    /// The sequence failed; nothing more comes for it.
    Error { index: usize, message: String },
    /// The sequence was ended without a token (the server is shutting down).
    Finish { index: usize, reason: FinishReason },
}

/// Handles shared between the HTTP side and the engine thread.
pub struct Shared {
    pub metrics: Arc<Metrics>,
    /// Sequences submitted and not yet admitted (the bounded queue).
    pub queued: AtomicUsize,
}

struct Seq {
    job: GenJob,
    cont: Continuation,
    state: State,
    /// Prompt tokens already in the state.
    fed: usize,
    /// Positions where the state goes into the cache (increasing, all > fed).
    cache_points: Vec<usize>,
    /// Token to feed at the next decode step.
    next: Option<u32>,
    last_emit: Option<Instant>,
    closed: bool,
}

pub struct Scheduler {
    model: Model,
    tokenizer: Option<Arc<Tokenizer>>,
    cfg: SchedulerConfig,
    cache: PrefixCache,
    shared: Arc<Shared>,
    waiting: VecDeque<GenJob>,
    active: Vec<Seq>,
    embeds: VecDeque<EmbedTask>,
    /// The decode step's sampled ids (on a GPU sampled on the device), its rows (indices
    /// into `active`) and their tokens, kept from step to step.
    sampled: SampleStep,
    step_rows: Vec<usize>,
    step_tokens: Vec<u32>,
    /// Set by [`Work::Shutdown`].
    stopping: bool,
}

/// An embedding request being read, one input after another.
struct EmbedTask {
    job: EmbedJob,
    /// The input being read.
    input: usize,
    state: Option<State>,
    /// Tokens of that input already read.
    fed: usize,
    /// Sum of its pooled rows so far (f64).
    sum: Vec<f64>,
    out: Vec<Vec<f32>>,
}

impl Scheduler {
    pub fn new(
        model: Model,
        tokenizer: Option<Arc<Tokenizer>>,
        cfg: SchedulerConfig,
        shared: Arc<Shared>,
    ) -> Scheduler {
        shared
            .metrics
            .cache_budget
            .store(cfg.cache_bytes as u64, Relaxed);
        Scheduler {
            cache: PrefixCache::new(cfg.cache_bytes),
            model,
            tokenizer,
            cfg,
            shared,
            waiting: VecDeque::new(),
            active: Vec::new(),
            embeds: VecDeque::new(),
            sampled: SampleStep::new(),
            step_rows: Vec::new(),
            step_tokens: Vec::new(),
            stopping: false,
        }
    }

    /// Serve until every sender of `rx` is gone.
    pub fn run(mut self, rx: Receiver<Work>) {
        loop {
            if self.idle() {
                match rx.recv() {
                    Ok(w) => self.take(w),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(w) => self.take(w),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if self.idle() {
                            return;
                        }
                        break;
                    }
                }
            }
            let turn = std::panic::catch_unwind(AssertUnwindSafe(|| self.turn()));
            if let Err(panic) = turn {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                for s in self.active.drain(..) {
                    let _ = s.job.events.send(Event::Error {
                        index: s.job.index,
                        message: format!("internal error in the engine: {msg}"),
                    });
                }
                if let Some(t) = self.embeds.pop_front() {
                    let _ = t
                        .job
                        .reply
                        .send(Err(format!("internal error in the engine: {msg}")));
                }
            }
            self.publish();
        }
    }

    fn take(&mut self, w: Work) {
        match w {
            Work::Shutdown => {
                self.stopping = true;
                let abort = |job: &GenJob| {
                    let _ = job.events.send(Event::Finish {
                        index: job.index,
                        reason: FinishReason::Abort,
                    });
                };
                for s in self.active.drain(..) {
                    abort(&s.job);
                }
                for job in self.waiting.drain(..) {
                    self.shared.queued.fetch_sub(1, Relaxed);
                    abort(&job);
                }
                for t in self.embeds.drain(..) {
                    let _ = t.job.reply.send(Err("the server is shutting down".into()));
                }
            }
            Work::Generate(job) if self.stopping => {
                self.shared.queued.fetch_sub(1, Relaxed);
                let _ = job.events.send(Event::Finish {
                    index: job.index,
                    reason: FinishReason::Abort,
                });
            }
            Work::Embed(job) if self.stopping => {
                let _ = job.reply.send(Err("the server is shutting down".into()));
            }
            Work::Generate(job) => self.waiting.push_back(job),
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

    /// Read at most `prefill_chunk` tokens of the oldest embedding request (each input
    /// from a fresh state, in continued windows), so that a long input does not stall the
    /// running sequences; answer it when its last input is read.
    fn embed_step(&mut self) -> Result<(), String> {
        let mut budget = self.cfg.prefill_chunk.max(1);
        while budget > 0 {
            let Some(task) = self.embeds.front_mut() else {
                return Ok(());
            };
            if task.job.reply.is_closed() {
                self.embeds.pop_front();
                continue;
            }
            let tokens = &task.job.inputs[task.input];
            let end = tokens.len().min(task.fed + budget);
            let last = end == tokens.len();
            let want = match (task.job.pooling, last) {
                (Pooling::Mean, _) => LogitsWant::All,
                (Pooling::Last, true) => LogitsWant::Last,
                (Pooling::Last, false) => LogitsWant::None,
            };
            let state = task.state.get_or_insert_with(|| self.model.new_state());
            let rows = self
                .model
                .hidden(&tokens[task.fed..end], state, want)
                .map_err(|e| e.to_string())?;
            let d = task.sum.len();
            for r in rows.chunks(d) {
                task.sum
                    .iter_mut()
                    .zip(r)
                    .for_each(|(a, &b)| *a += b as f64);
            }
            budget -= end - task.fed;
            task.fed = end;
            if !last {
                continue;
            }
            let n = match task.job.pooling {
                Pooling::Mean => tokens.len(),
                Pooling::Last => 1,
            };
            let v = task.sum.iter().map(|&x| (x / n as f64) as f32).collect();
            task.out.push(v);
            task.sum.iter_mut().for_each(|x| *x = 0.0);
            task.state = None;
            task.fed = 0;
            task.input += 1;
            if task.input == task.job.inputs.len() {
                if let Some(t) = self.embeds.pop_front() {
                    let _ = t.job.reply.send(Ok(t.out));
                }
            }
        }
        Ok(())
    }

    fn publish(&self) {
        let m = &self.shared.metrics;
        m.active_sequences.store(self.active.len() as i64, Relaxed);
        m.queue_depth
            .store(self.shared.queued.load(Relaxed) as i64, Relaxed);
        let st = self.cache.stats();
        m.cache_bytes.store(st.bytes as u64, Relaxed);
        m.cache_entries.store(st.entries as u64, Relaxed);
        m.cache_evictions.store(st.evictions, Relaxed);
    }

    fn turn(&mut self) {
        // Clients that went away leave at once.
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let gone = before - self.waiting.len();
        self.shared.queued.fetch_sub(gone, Relaxed);
        let before = self.active.len();
        self.active
            .retain(|s| !s.closed && !s.job.events.is_closed());
        let cancelled = (before - self.active.len()) + gone;
        self.shared
            .metrics
            .cancelled
            .fetch_add(cancelled as u64, Relaxed);

        while self.active.len() < self.cfg.max_batch {
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            self.shared.queued.fetch_sub(1, Relaxed);
            let t = Instant::now();
            self.admit(job);
            self.shared.metrics.spent(Phase::Admit, t);
        }
        self.publish();
        let t = Instant::now();
        self.prefill_step();
        self.shared.metrics.spent(Phase::Prefill, t);
        self.decode_step();
        if let Err(e) = self.embed_step() {
            if let Some(t) = self.embeds.pop_front() {
                let _ = t.job.reply.send(Err(format!("embedding failed: {e}")));
            }
        }
        self.active.retain(|s| !s.closed);
    }

    fn admit(&mut self, job: GenJob) {
        let m = &self.shared.metrics;
        m.prompt_tokens.fetch_add(job.prompt.len() as u64, Relaxed);
        let lookup = if self.cfg.cache_bytes > 0 {
            Some(self.cache.lookup(&job.prompt))
        } else {
            None
        };
        let (hit, shared) = match lookup {
            Some(l) => (l.hit, l.shared),
            None => (None, 0),
        };
        let cont = Continuation::new(&job.params, &job.prompt, self.tokenizer.clone());
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
        let mut seq = Seq {
            state,
            fed,
            cache_points: Vec::new(),
            next: None,
            last_emit: None,
            closed: false,
            cont,
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
        let _ = seq.job.events.send(Event::Started {
            index: seq.job.index,
            cached_tokens: seq.fed,
        });
        if let Some(logits) = first_logits {
            let out = seq.cont.step(&logits);
            self.out().emit(&mut seq, out, || Some(logits.to_vec()));
        }
        if !seq.closed {
            self.active.push(seq);
        }
    }

    fn out(&mut self) -> Out<'_> {
        Out {
            cache: &mut self.cache,
            metrics: &self.shared.metrics,
            cfg: &self.cfg,
            vocab: self.model.dims().vocab_size,
        }
    }

    fn fail(seq: &mut Seq, message: String) {
        let _ = seq.job.events.send(Event::Error {
            index: seq.job.index,
            message,
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
            self.model
                .prefill_batch(&pieces, &mut states, LogitsWant::Last)
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                for &(i, _) in &picked {
                    Self::fail(&mut self.active[i], format!("prefill failed: {e}"));
                }
                return;
            }
        };
        let mut o = Out {
            cache: &mut self.cache,
            metrics: &self.shared.metrics,
            cfg: &self.cfg,
            vocab,
        };
        for (&(i, end), lg) in picked.iter().zip(logits) {
            let row = &lg.data[..vocab];
            let s = &mut self.active[i];
            s.fed = end;
            if !all_finite(row) {
                // Never sampled from nor cached: the sequence fails naming the layer.
                let e = non_finite_logits(&s.state, s.state.position());
                Self::fail(s, e.to_string());
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
                let out = s.cont.step(row);
                o.emit(s, out, || Some(row.to_vec()));
            }
        }
    }

    fn decode_step(&mut self) {
        let (rows, tokens) = (&mut self.step_rows, &mut self.step_tokens);
        rows.clear();
        tokens.clear();
        for (i, s) in self.active.iter().enumerate() {
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
                    samplers.push(s.cont.sampler_mut());
                    it.next();
                }
            }
            // Sampled where the logits are: on a GPU only the ids come back.
            self.model
                .decode_sample(tokens, &mut states, &mut samplers, &mut self.sampled)
                .map(|_| ())
        };
        let m = &self.shared.metrics;
        let t = m.spent(Phase::Decode, t);
        m.decode_steps.fetch_add(1, Relaxed);
        m.decode_rows.fetch_add(rows.len() as u64, Relaxed);
        if let Err(e) = result {
            for &i in rows.iter() {
                Self::fail(&mut self.active[i], format!("decode failed: {e}"));
            }
            return;
        }
        let vocab = self.model.dims().vocab_size;
        let t = self.shared.metrics.spent(Phase::Sample, t);
        let (model, sampled) = (&self.model, &self.sampled);
        let mut o = Out {
            cache: &mut self.cache,
            metrics: &self.shared.metrics,
            cfg: &self.cfg,
            vocab,
        };
        for (b, &i) in rows.iter().enumerate() {
            let s = &mut self.active[i];
            if sampled.finite(b) {
                // (a row that was not finite is never sampled from nor cached)
                let out = s.cont.push(sampled.ids()[b]);
                // Only a sequence that ends here and is cached needs its row of logits:
                // on a GPU that one row comes from the device.
                o.emit(s, out, || model.step_logits_row(sampled, b).ok());
            } else {
                let e = non_finite_logits(&s.state, s.state.position());
                Self::fail(s, e.to_string());
            }
        }
        self.shared.metrics.spent(Phase::Emit, t);
    }
}

/// What streaming a token out needs, borrowed apart from the active list.
struct Out<'a> {
    cache: &'a mut PrefixCache,
    metrics: &'a Metrics,
    cfg: &'a SchedulerConfig,
    vocab: usize,
}

impl Out<'_> {
    /// Stream one step of `seq` (`logits` gives the row it was sampled from, wanted only
    /// when a finished sequence is cached: `vocab_size` entries or more); mark the
    /// sequence closed when it is finished or its client is gone.
    fn emit(&mut self, seq: &mut Seq, out: StepOut, logits: impl FnOnce() -> Option<Vec<f32>>) {
        let now = Instant::now();
        let m = self.metrics;
        match seq.last_emit {
            None => m.ttft.observe((now - seq.job.arrived).as_secs_f64()),
            Some(t) => m.itl.observe((now - t).as_secs_f64()),
        }
        seq.last_emit = Some(now);
        m.generated_tokens.fetch_add(1, Relaxed);
        let finished = out.finish.is_some();
        let sent = seq.job.events.send(Event::Token {
            index: seq.job.index,
            token: out.token,
            text: out.text,
            finish: out.finish,
        });
        if sent.is_err() {
            m.cancelled.fetch_add(1, Relaxed);
            seq.closed = true;
            return;
        }
        if !finished {
            seq.next = Some(out.token);
            return;
        }
        seq.closed = true;
        if self.cfg.cache_generated && self.cfg.cache_bytes > 0 {
            // The state has read the prompt and every generated token but the last.
            let gen = seq.cont.generated();
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
