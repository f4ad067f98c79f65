//! Where a request goes in a server of several model replicas (`--devices`: one per GPU,
//! each with its own engine thread, scheduler and prefix cache).
//!
//! A generation goes to the replica whose prefix cache agrees longest with its prompt —
//! a cached prefix state lives on one device, and a prompt that branches from a cached
//! one should branch there too (that replica snapshots the branch point, and the next
//! prompt on the same prefix hits) — when that agreement is worth it (a cached prefix,
//! or at least `branch_min_tokens` tokens in common); otherwise to the replica with the
//! fewest sequences (sent and not yet ended). Embeddings go to the least loaded one;
//! shutdown to every one. With one replica everything goes to it.

use super::metrics::DeviceMetrics;
use super::prefix_cache::PrefixCache;
use super::scheduler::Work;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

/// One replica as the HTTP side sees it.
pub struct Replica {
    pub work: Sender<Work>,
    /// Its prefix cache (its engine thread owns the states; here only looked at).
    pub cache: Arc<Mutex<PrefixCache>>,
    pub metrics: Arc<DeviceMetrics>,
}

/// The replicas of a server; cloned cheaply (every handler and the listener hold one).
#[derive(Clone)]
pub struct Dispatch {
    replicas: Arc<Vec<Replica>>,
    /// Tokens in common with a replica's cached keys that make a prompt go there even
    /// without a cached prefix (where a branch snapshot would be taken).
    branch_min_tokens: usize,
}

/// The engine thread(s) have stopped (the work is dropped).
#[derive(Debug)]
pub struct Stopped;

impl Dispatch {
    pub fn new(replicas: Vec<Replica>, branch_min_tokens: usize) -> Dispatch {
        Dispatch {
            replicas: Arc::new(replicas),
            branch_min_tokens: branch_min_tokens.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.replicas.len()
    }
    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    /// Hand `w` to its replica (every replica for a shutdown).
    pub fn send(&self, w: Work) -> Result<(), Stopped> {
        let r = match &w {
            Work::Shutdown => {
                let mut sent = false;
                for r in self.replicas.iter() {
                    sent |= r.work.send(Work::Shutdown).is_ok();
                }
                return if sent { Ok(()) } else { Err(Stopped) };
            }
            Work::Generate(job) => self.pick(&job.prompt),
            Work::Embed(_) => self.least_loaded(),
        };
        let replica = &self.replicas[r];
        let generate = matches!(w, Work::Generate(_));
        if generate {
            replica.metrics.sent.fetch_add(1, Relaxed);
        }
        replica.work.send(w).map_err(|_| {
            if generate {
                replica.metrics.sent.fetch_sub(1, Relaxed);
            }
            Stopped
        })
    }

    /// The replica for a prompt: the holder of its longest cached prefix or branch, if
    /// worth it, else the least loaded.
    pub fn pick(&self, prompt: &[u32]) -> usize {
        if self.replicas.len() == 1 {
            return 0;
        }
        let mut best: Option<(usize, (usize, usize))> = None;
        for (i, r) in self.replicas.iter().enumerate() {
            let (hit, shared) = r.cache.lock().map(|c| c.peek(prompt)).unwrap_or((0, 0));
            if hit == 0 && shared < self.branch_min_tokens {
                continue;
            }
            let better = match best {
                None => true,
                Some((b, (bh, bs))) => {
                    (hit, shared) > (bh, bs)
                        || ((hit, shared) == (bh, bs) && self.load(i) < self.load(b))
                }
            };
            if better {
                best = Some((i, (hit, shared)));
            }
        }
        best.map_or_else(|| self.least_loaded(), |(i, _)| i)
    }

    /// Sequences sent to replica `i` and not yet ended.
    fn load(&self, i: usize) -> i64 {
        self.replicas[i].metrics.load()
    }

    /// The replica with the fewest sequences (the first of equals).
    pub fn least_loaded(&self) -> usize {
        (0..self.replicas.len())
            .min_by_key(|&i| self.load(i))
            .unwrap_or(0)
    }
}
