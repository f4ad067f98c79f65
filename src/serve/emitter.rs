//! The emitter: the text side of a replica's sequences, on a thread of its own, so that
//! detokenizing, stop strings and handing tokens to the HTTP side overlap the device's
//! next step instead of sitting between two steps.
//!
//! The engine thread ([`super::scheduler`]) samples each turn's tokens and applies the
//! rules that look only at ids (stop ids, `max_tokens`); it hands the turn's tokens here
//! as one [`Emit::Tokens`] and goes on with its next turn. The emitter turns them into
//! text and events, and answers each batch with an [`Outcome`]: the sequences a stop
//! string ended (the engine learns it one turn late: it has decoded one token more for
//! them, which is never sent) and those whose client is gone. The engine waits for that
//! answer before it hands over the next batch, so the emitter is never more than one turn
//! behind. Every event of an admitted sequence goes out through here, in order.

use super::event::Event;
use super::logprobs::TokenProbs;
use super::metrics::{DeviceMetrics, Metrics};
use crate::engine::TokenLogprobs;
use crate::text::{TextRules, TokenEnd};
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What the engine thread asks of the emitter.
pub enum Emit {
    /// A sequence was admitted: where its events go and its text rules; sends `Started`.
    Open {
        id: u64,
        index: usize,
        events: UnboundedSender<Event>,
        arrived: Instant,
        text: TextRules,
        cached_tokens: usize,
    },
    /// One turn's tokens, each sequence's in order; answered by an [`Outcome`].
    Tokens(Vec<TokenOut>),
    /// The sequence ends with this event (an error, or `abort`); nothing more goes out
    /// for it. `None`: it ends silently (its client is gone).
    End { id: u64, event: Option<Event> },
}

/// One sampled token of a sequence and how its id ends the sequence.
pub struct TokenOut {
    pub id: u64,
    pub token: u32,
    pub end: Option<TokenEnd>,
    /// Its log-probabilities by id, when the request asked for them (named here).
    pub logprobs: Option<TokenLogprobs>,
}

/// The emitter's answer to one [`Emit::Tokens`].
#[derive(Default, Debug)]
pub struct Outcome {
    /// Sequences a stop string ended (the engine did not know they had ended).
    pub stopped: Vec<u64>,
    /// Sequences whose client went away.
    pub gone: Vec<u64>,
}

struct Open {
    index: usize,
    events: UnboundedSender<Event>,
    arrived: Instant,
    last_emit: Option<Instant>,
    text: TextRules,
}

/// Start the emitter thread of one replica.
pub fn spawn(
    metrics: Arc<Metrics>,
    device: Arc<DeviceMetrics>,
) -> std::io::Result<(Sender<Emit>, Receiver<Outcome>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel::<Emit>();
    let (out_tx, out_rx) = std::sync::mpsc::channel::<Outcome>();
    let thread = std::thread::Builder::new()
        .name("mamba3-emitter".into())
        .spawn(move || {
            let mut e = Emitter {
                open: HashMap::new(),
                metrics,
                device,
            };
            for msg in rx {
                let t = Instant::now();
                match msg {
                    Emit::Tokens(tokens) => {
                        // A panic in the text side fails those sequences, not the server.
                        let r = std::panic::catch_unwind(AssertUnwindSafe(|| e.tokens(&tokens)));
                        let outcome = r.unwrap_or_else(|_| e.fail_all(&tokens));
                        if out_tx.send(outcome).is_err() {
                            return;
                        }
                    }
                    Emit::Open {
                        id,
                        index,
                        events,
                        arrived,
                        text,
                        cached_tokens,
                    } => {
                        let _ = events.send(Event::Started {
                            index,
                            cached_tokens,
                        });
                        e.open.insert(
                            id,
                            Open {
                                index,
                                events,
                                arrived,
                                last_emit: None,
                                text,
                            },
                        );
                    }
                    Emit::End { id, event } => {
                        if let (Some(s), Some(ev)) = (e.open.remove(&id), event) {
                            let _ = s.events.send(ev);
                        }
                    }
                }
                e.device.emitter_busy.since(t);
            }
        })?;
    Ok((tx, out_rx, thread))
}

struct Emitter {
    open: HashMap<u64, Open>,
    metrics: Arc<Metrics>,
    device: Arc<DeviceMetrics>,
}

impl Emitter {
    fn tokens(&mut self, tokens: &[TokenOut]) -> Outcome {
        let mut outcome = Outcome::default();
        for t in tokens {
            // (a sequence that ended already sends nothing more)
            let Some(s) = self.open.get_mut(&t.id) else {
                continue;
            };
            let out = s.text.push(t.token, t.end);
            let logprobs = t
                .logprobs
                .as_ref()
                .map(|lp| TokenProbs::named(lp, |id| s.text.token_text(id)));
            let now = Instant::now();
            match s.last_emit {
                None => self.metrics.ttft.observe((now - s.arrived).as_secs_f64()),
                Some(last) => self.metrics.itl.observe((now - last).as_secs_f64()),
            }
            s.last_emit = Some(now);
            self.device
                .generated_tokens
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let finish = out.finish;
            let sent = s.events.send(Event::Token {
                index: s.index,
                token: out.token,
                text: out.text,
                finish,
                logprobs,
            });
            if sent.is_err() {
                self.open.remove(&t.id);
                outcome.gone.push(t.id);
            } else if finish.is_some() {
                self.open.remove(&t.id);
                if t.end.is_none() {
                    outcome.stopped.push(t.id);
                }
            }
        }
        outcome
    }

    /// After a panic in [`Emitter::tokens`]: the batch's sequences end with an error.
    fn fail_all(&mut self, tokens: &[TokenOut]) -> Outcome {
        let mut outcome = Outcome::default();
        for t in tokens {
            if let Some(s) = self.open.remove(&t.id) {
                let _ = s.events.send(Event::Error {
                    index: s.index,
                    message: "internal error while detokenizing".into(),
                });
                outcome.stopped.push(t.id);
            }
        }
        outcome
    }
}
