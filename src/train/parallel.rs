//! Data-parallel training: one worker thread per device, each with a replica of the model
//! and the optimiser, behind the same [`Backend`] the trainer drives on one device.
//!
//! A step's global batch is its `accum` micro-batches of `batch` sequences each (the same
//! batches one device would take, `super::data::Dataset::train_batch`). They are dealt in
//! turn: micro-batch `i` goes to rank `i mod N`, so each rank takes `accum / N` of them
//! (`accum` must be a multiple of N). Each rank adds up the gradients of its micro-batches'
//! mean losses; the ranks then all-reduce the **sum** ([`Collective`], bucket by bucket in
//! the order of [`super::buckets`]), and every rank scales it once by `1 / accum`, clips it
//! and takes the same AdamW step as one device would — the same arithmetic on the same
//! bits, so the replicas stay bit-identical.
//!
//! **Overlap** (on by default; `--overlap-reduce off`, [`DataParallel::set_overlap`]): the
//! buckets come in the order the backward finishes their tensors, so during the backward
//! of a rank's *last* micro-batch each bucket's all-reduce starts as soon as the backward
//! says (through [`GradReady`], `super::ready`) that the stage of its last tensor is done,
//! while the backward goes on with the layers below; what the hook has not launched by the
//! end of the backward (all of it, for a backend that never calls the hook) is reduced
//! then. On a GPU the all-reduces run on a communication stream that waits for an event
//! after the stage, and the optimiser's stream waits for that stream
//! (`super::cuda::replica`); on the host they run inline in the hook. The sums are the same
//! operations on the same values in the same order as the reduction after the backward, so
//! both give the same bits. Off, every rank finishes its backward before any rank enters
//! the collective. On, a rank that fails mid-backward has its peers waiting in the
//! collective: it aborts the group ([`Collective::abort`]), the step fails on every rank,
//! and the [`DataParallel`] refuses further steps.
//!
//! Each step records how long it waited for the reduction after its backward (the slowest
//! rank's: [`Backend::reduce_wait`], which `bench-train` reports).
//!
//! Against one device with the same global batch, only the order of the f32 sums differs:
//! one device adds every micro-batch's contributions into one buffer; N ranks each add
//! their own micro-batches', then the rank sums are added in rank order. Each gradient
//! element is a sum of at most M = accum·(R + 1) terms cᵢ (R rows per micro-batch), so
//! the two differ by at most 2(M − 1)·2⁻²⁴·Σ|cᵢ| (first order in the unit roundoff).
//! `tests/train_data_parallel.rs` checks the computable form, per tensor
//! ‖g_N − g_1‖∞ ≤ 2(accum + R)·2⁻²⁴·Σ_micro ‖g_micro‖∞ (before the `1 / accum` scale;
//! measured at ≈ 5 % of it). With N = 1 the arithmetic is one device's, bit for bit, and
//! two runs with the same N and seed are bit-identical.
//!
//! Each step checks that every rank's gradient norm has the same bits, and every
//! [`Backend::sync`] (each checkpoint) that every rank's weights do; checkpoints are
//! rank 0's (the trainer writes them from its synced copy).

use super::backend::{host_apply, Backend};
use super::buckets::{self, Bucket, Pending};
use super::collective::{Collective, FlatBuf, HostCollective};
use super::flat::FlatLayout;
use super::model::Batch;
use super::optim::AdamW;
use super::ready::{GradReady, Stage};
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::Params;
use crate::model::Config;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// A rank's part in a reduction overlapped with its backward: its end of the group and
/// the buckets.
pub struct Reduce<'a> {
    pub group: &'a mut dyn Collective,
    pub buckets: &'a [Bucket],
}

/// One rank's model and optimiser, on its device: what a worker thread drives.
pub trait Replica {
    fn name(&self) -> String;
    /// Take the run's parameters.
    fn set_params(&mut self, params: &Params<f32>) -> Result<()>;
    /// Take the run's optimiser state (moments and step count).
    fn set_moments(&mut self, opt: &AdamW) -> Result<()>;
    /// Zero the gradient, then add the gradient of the mean loss of each of `batches`;
    /// returns the sum of their mean losses. With `reduce`, the gradient is also replaced
    /// by its sum over the group, one all-reduce per bucket, each started during the last
    /// batch's backward as soon as its tensors are final (the module doc).
    fn accumulate(&mut self, batches: &[Batch], reduce: Option<Reduce<'_>>) -> Result<f64>;
    /// Replace the gradient by its sum over the group, one all-reduce per bucket (after
    /// the backward).
    fn reduce(&mut self, group: &mut dyn Collective, buckets: &[Bucket]) -> Result<()>;
    /// Scale the gradient by `1 / accum`, clip it to the global norm `clip` (when
    /// positive) and take an AdamW step at `lr`, as one device's step does; returns the
    /// norm before clipping.
    fn apply(&mut self, accum: usize, clip: f64, lr: f64) -> Result<f64>;
    /// Seconds the last reduction ran after the end of the backward (all of it when not
    /// overlapped); asked after [`Replica::apply`].
    fn reduce_wait(&mut self) -> Result<f64>;
    /// Mean loss of `batch` at the replica's parameters.
    fn loss(&mut self, batch: &Batch) -> Result<f64>;
    /// The gradient buffer's tensors.
    fn gradient(&mut self) -> Result<Params<f32>>;
    /// The parameters and the optimiser state.
    fn state(&mut self) -> Result<(Params<f32>, AdamW)>;
}

/// A replica on the host over any [`Backend`]'s `loss_and_grad` (the CPU's): the gradient
/// as tensors, flattened into the [`FlatLayout`] for the reduction.
pub struct HostReplica<B: Backend> {
    backend: B,
    layout: FlatLayout,
    /// the [`Stage::key`] of each tensor
    keys: Vec<usize>,
    params: Params<f32>,
    opt: Option<AdamW>,
    grad: Params<f32>,
    flat: Vec<f32>,
    wait: f64,
}

impl<B: Backend> HostReplica<B> {
    pub fn new(config: &Config, backend: B) -> HostReplica<B> {
        let params = Params::zeros(config);
        let layout = FlatLayout::new(&params);
        let n_layer = params.layers.len();
        HostReplica {
            backend,
            flat: vec![0.0; layout.len],
            layout,
            keys: (params.tensors().iter())
                .map(|(n, _)| Stage::of(n, n_layer).key(n_layer))
                .collect(),
            wait: 0.0,
            grad: params.clone(),
            params,
            opt: None,
        }
    }
}

impl<B: Backend> Replica for HostReplica<B> {
    fn name(&self) -> String {
        self.backend.name()
    }

    fn set_params(&mut self, params: &Params<f32>) -> Result<()> {
        if params.config != self.params.config {
            return Err(Error::input(
                "the parameters belong to another model configuration than this replica's",
            ));
        }
        self.params = params.clone();
        Ok(())
    }

    fn set_moments(&mut self, opt: &AdamW) -> Result<()> {
        self.opt = Some(opt.clone());
        Ok(())
    }

    fn accumulate(&mut self, batches: &[Batch], reduce: Option<Reduce<'_>>) -> Result<f64> {
        self.grad
            .tensors_mut()
            .into_iter()
            .for_each(|t| t.fill(0.0));
        let mut loss = 0.0;
        let Some(reduce) = reduce else {
            for b in batches {
                loss += (self.backend).loss_and_grad(&self.params, b, &mut self.grad)?;
            }
            return Ok(loss);
        };
        let (last, first) = match batches.split_last() {
            Some((last, first)) => (Some(last), first),
            None => (None, batches),
        };
        for b in first {
            loss += (self.backend).loss_and_grad(&self.params, b, &mut self.grad)?;
        }
        let mut hook = HostReduce {
            group: reduce.group,
            pending: Pending::new(reduce.buckets),
            layout: &self.layout,
            keys: &self.keys,
            gathered: vec![false; self.keys.len()],
            flat: &mut self.flat,
            n_layer: self.params.layers.len(),
        };
        if let Some(b) = last {
            loss +=
                (self.backend).loss_and_grad_ready(&self.params, b, &mut self.grad, &mut hook)?;
        }
        let t0 = Instant::now();
        hook.finish(&mut self.grad)?;
        self.wait = t0.elapsed().as_secs_f64();
        Ok(loss)
    }

    fn reduce(&mut self, group: &mut dyn Collective, buckets: &[Bucket]) -> Result<()> {
        let t0 = Instant::now();
        self.layout.gather(&self.grad, &mut self.flat);
        for b in buckets {
            group.all_reduce_sum(FlatBuf::Host(&mut self.flat), &b.ranges)?;
        }
        self.layout.scatter(&self.flat, &mut self.grad);
        self.wait = t0.elapsed().as_secs_f64();
        Ok(())
    }

    fn reduce_wait(&mut self) -> Result<f64> {
        Ok(self.wait)
    }

    fn apply(&mut self, accum: usize, clip: f64, lr: f64) -> Result<f64> {
        let opt = (self.opt.as_mut())
            .ok_or_else(|| Error::Other("a replica stepped before it had moments".into()))?;
        Ok(host_apply(
            &mut self.params,
            opt,
            &mut self.grad,
            accum,
            clip,
            lr,
        ))
    }

    fn loss(&mut self, batch: &Batch) -> Result<f64> {
        self.backend.loss(&self.params, batch)
    }

    fn gradient(&mut self) -> Result<Params<f32>> {
        Ok(self.grad.clone())
    }

    fn state(&mut self) -> Result<(Params<f32>, AdamW)> {
        let opt =
            (self.opt.clone()).unwrap_or_else(|| AdamW::new(Default::default(), &self.params));
        Ok((self.params.clone(), opt))
    }
}

/// The host's overlapped reduction, inline in the backward's hook: at each stage, the
/// tensors it finished are copied into the flat buffer and the buckets they complete are
/// all-reduced there; at the end, the rest, and the flat sums back into the tensors (the
/// tensors reduced during the backward are final, so the backward never reads them again).
struct HostReduce<'a> {
    group: &'a mut dyn Collective,
    pending: Pending<'a>,
    layout: &'a FlatLayout,
    keys: &'a [usize],
    /// which tensors are in `flat` already
    gathered: Vec<bool>,
    flat: &'a mut [f32],
    n_layer: usize,
}

impl HostReduce<'_> {
    /// Copy into the flat buffer every tensor of stage key ≥ `key` not copied yet.
    fn gather(&mut self, grad: &Params<f32>, key: usize) {
        for (i, (_, t)) in grad.tensors().into_iter().enumerate() {
            if self.keys[i] >= key && !self.gathered[i] {
                let off = self.layout.spans[i].0;
                self.flat[off..off + t.len()].copy_from_slice(t);
                self.gathered[i] = true;
            }
        }
    }

    fn all_reduce(&mut self, buckets: &[Bucket]) -> Result<()> {
        for b in buckets {
            (self.group).all_reduce_sum(FlatBuf::Host(&mut *self.flat), &b.ranges)?;
        }
        Ok(())
    }

    /// The backward is over: the buckets not yet reduced, then the sums into `grad`.
    fn finish(&mut self, grad: &mut Params<f32>) -> Result<()> {
        self.gather(grad, 0);
        let rest = self.pending.rest();
        self.all_reduce(rest)?;
        self.layout.scatter(&*self.flat, grad);
        Ok(())
    }
}

impl GradReady<Params<f32>> for HostReduce<'_> {
    fn ready(&mut self, stage: Stage, grad: &mut Params<f32>) -> Result<()> {
        let key = stage.key(self.n_layer);
        self.gather(grad, key);
        let ready = self.pending.ready(key);
        self.all_reduce(ready)
    }
}

/// Makes a rank's replica inside its worker thread (a GPU context belongs to the thread
/// that opens it).
pub type MakeReplica = Box<dyn FnOnce() -> Result<Box<dyn Replica>> + Send>;

enum Cmd {
    Params(Arc<Params<f32>>),
    Moments(Arc<AdamW>),
    /// with `reduce`, the reduction overlapped with the last backward
    Accumulate {
        batches: Vec<Batch>,
        reduce: bool,
    },
    Reduce,
    Apply {
        accum: usize,
        clip: f64,
        lr: f64,
    },
    Abort,
    Loss(Batch),
    Gradient,
    State,
    Checksum,
}

enum Reply {
    Done,
    Name(String),
    Value(f64),
    /// the gradient norm, and the seconds the reduction ran after the backward
    Applied(f64, f64),
    Hash(u64),
    Gradient(Box<Params<f32>>),
    State(Box<(Params<f32>, AdamW)>),
}

struct Worker {
    to: Sender<Cmd>,
    from: Receiver<Result<Reply>>,
    thread: Option<JoinHandle<()>>,
}

/// The data-parallel [`Backend`]: N worker threads, rank `r` on the r-th replica.
pub struct DataParallel {
    workers: Vec<Worker>,
    names: Vec<String>,
    buckets: Arc<Vec<Bucket>>,
    params_here: bool,
    moments_here: bool,
    overlap: bool,
    /// seconds the last step waited for the reduction after its backward (slowest rank)
    last_wait: Option<f64>,
    /// why the group was aborted (no more steps)
    aborted: Option<String>,
}

/// Micro-batch `i` of a step goes to rank `i mod world`; refuses an `accum` that does not
/// share out evenly.
pub fn check_accum(accum: usize, world: usize) -> Result<()> {
    if world == 0 || !accum.is_multiple_of(world) {
        return Err(Error::input(format!(
            "--accum {accum}: data-parallel training over {world} devices deals each step's \
             micro-batches out in turn, so --accum must be a multiple of {world}"
        )));
    }
    Ok(())
}

/// FNV-1a over the bits of every parameter: the replicas' weights compared cheaply.
fn checksum(p: &Params<f32>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, t) in p.tensors() {
        for x in t {
            h = (h ^ x.to_bits() as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn serve(
    make: MakeReplica,
    mut group: Box<dyn Collective>,
    buckets: Arc<Vec<Bucket>>,
    from: Receiver<Cmd>,
    to: Sender<Result<Reply>>,
) {
    let mut replica = match make() {
        Ok(r) => {
            let _ = to.send(Ok(Reply::Name(r.name())));
            r
        }
        Err(e) => {
            let _ = to.send(Err(e));
            return;
        }
    };
    while let Ok(cmd) = from.recv() {
        let r = &mut replica;
        let reply = match cmd {
            Cmd::Params(p) => r.set_params(&p).map(|_| Reply::Done),
            Cmd::Moments(o) => r.set_moments(&o).map(|_| Reply::Done),
            Cmd::Accumulate { batches, reduce } => {
                let got = if reduce {
                    let group = group.as_mut();
                    r.accumulate(
                        &batches,
                        Some(Reduce {
                            group,
                            buckets: &buckets[..],
                        }),
                    )
                } else {
                    r.accumulate(&batches, None)
                };
                // peers may be waiting in the collective for this rank
                if got.is_err() && reduce {
                    group.abort();
                }
                got.map(Reply::Value)
            }
            Cmd::Reduce => {
                let got = r.reduce(group.as_mut(), &buckets);
                if got.is_err() {
                    group.abort();
                }
                got.map(|_| Reply::Done)
            }
            Cmd::Apply { accum, clip, lr } => (r.apply(accum, clip, lr))
                .and_then(|norm| Ok(Reply::Applied(norm, r.reduce_wait()?))),
            Cmd::Abort => {
                group.abort();
                Ok(Reply::Done)
            }
            Cmd::Loss(b) => r.loss(&b).map(Reply::Value),
            Cmd::Gradient => r.gradient().map(|g| Reply::Gradient(Box::new(g))),
            Cmd::State => r.state().map(|s| Reply::State(Box::new(s))),
            Cmd::Checksum => r.state().map(|(p, _)| Reply::Hash(checksum(&p))),
        };
        if to.send(reply).is_err() {
            break;
        }
    }
}

impl DataParallel {
    /// Start one worker per replica maker, rank `i` with `groups[i]` (its rank must be
    /// `i`), reducing in buckets of `bucket_bytes`.
    pub fn new(
        config: &Config,
        makers: Vec<MakeReplica>,
        groups: Vec<Box<dyn Collective>>,
        bucket_bytes: usize,
    ) -> Result<DataParallel> {
        let n = makers.len();
        if n == 0 || groups.len() != n {
            return Err(Error::input(format!(
                "data-parallel training needs one collective rank per replica (≥ 1); got {n} \
                 replicas and {} ranks",
                groups.len()
            )));
        }
        for (i, g) in groups.iter().enumerate() {
            if g.rank() != i || g.world_size() != n {
                return Err(Error::input(format!(
                    "collective rank {} of {} given as rank {i} of {n}",
                    g.rank(),
                    g.world_size()
                )));
            }
        }
        let shape = Params::<f32>::zeros(config);
        let buckets = Arc::new(buckets::plan(
            &shape,
            &FlatLayout::new(&shape),
            bucket_bytes,
        ));
        let mut workers = Vec::with_capacity(n);
        for (rank, (make, group)) in makers.into_iter().zip(groups).enumerate() {
            let (to, cmds) = channel();
            let (replies, from) = channel();
            let b = buckets.clone();
            let thread = std::thread::Builder::new()
                .name(format!("dp-rank-{rank}"))
                .spawn(move || serve(make, group, b, cmds, replies))
                .map_err(|e| Error::Other(format!("starting the worker of rank {rank}: {e}")))?;
            workers.push(Worker {
                to,
                from,
                thread: Some(thread),
            });
        }
        let mut dp = DataParallel {
            workers,
            names: Vec::new(),
            buckets,
            params_here: false,
            moments_here: false,
            overlap: true,
            last_wait: None,
            aborted: None,
        };
        // every replica made (or the first failure)
        let mut first_err = None;
        for rank in 0..n {
            match dp.reply(rank) {
                Ok(Reply::Name(s)) => dp.names.push(s),
                Ok(_) => unreachable!("a worker's first reply is its name"),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(dp),
        }
    }

    /// N ranks of [`HostReplica`]s on the CPU backend over the [`HostCollective`].
    pub fn host(config: &Config, n: usize, bucket_bytes: usize) -> Result<DataParallel> {
        let makers = (0..n)
            .map(|_| {
                let c = config.clone();
                Box::new(move || {
                    Ok(Box::new(HostReplica::new(&c, super::CpuBackend)) as Box<dyn Replica>)
                }) as MakeReplica
            })
            .collect();
        let groups = (HostCollective::group(n)?.into_iter())
            .map(|g| Box::new(g) as Box<dyn Collective>)
            .collect();
        Self::new(config, makers, groups, bucket_bytes)
    }

    pub fn world_size(&self) -> usize {
        self.workers.len()
    }

    /// The reduction's buckets.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Overlap the reduction with the last micro-batch's backward (the default) or run it
    /// after (the module doc); the same bits either way.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// Every rank's gradient for `shards`, reduced over the group (overlapped with the
    /// backward or after it); the ranks' summed losses. A failure aborts the group.
    fn accumulate_and_reduce(&mut self, mut shards: Vec<Vec<Batch>>) -> Result<Vec<f64>> {
        if let Some(why) = &self.aborted {
            return Err(Error::Other(format!(
                "this data-parallel group was aborted by an earlier failure ({why}); start \
                 a new one"
            )));
        }
        let reduce = self.overlap;
        let got = self.values(|r| Cmd::Accumulate {
            batches: std::mem::take(&mut shards[r]),
            reduce,
        });
        // overlapped, a failed rank may have left its peers inside the collective; after
        // the backward, every rank's backward is done before any rank enters it
        let got = match got {
            Ok(losses) if !reduce => self.all(|_| Cmd::Reduce).map(|_| losses),
            Err(e) if !reduce => return Err(e),
            got => got,
        };
        if let Err(e) = &got {
            // ranks whose reduction is queued (on a GPU) stop waiting for the failed one
            let _ = self.all(|_| Cmd::Abort);
            self.aborted = Some(e.to_string());
        }
        got
    }

    fn reply(&self, rank: usize) -> Result<Reply> {
        match self.workers[rank].from.recv() {
            Ok(r) => r,
            Err(_) => Err(Error::Other(format!(
                "the data-parallel worker of rank {rank} stopped (it panicked)"
            ))),
        }
    }

    /// Send `cmd(rank)` to every rank, then wait for every reply (all of them, so that the
    /// channels stay in step); the replies by rank, or the first error.
    fn all(&self, mut cmd: impl FnMut(usize) -> Cmd) -> Result<Vec<Reply>> {
        for (rank, w) in self.workers.iter().enumerate() {
            w.to.send(cmd(rank)).map_err(|_| {
                Error::Other(format!("the data-parallel worker of rank {rank} stopped"))
            })?;
        }
        let replies: Vec<Result<Reply>> = (0..self.workers.len()).map(|r| self.reply(r)).collect();
        replies.into_iter().collect()
    }

    fn values(&self, cmd: impl FnMut(usize) -> Cmd) -> Result<Vec<f64>> {
        (self.all(cmd)?.into_iter())
            .map(|r| match r {
                Reply::Value(v) => Ok(v),
                _ => Err(Error::Other("a worker answered out of turn".into())),
            })
            .collect()
    }

    fn load(&mut self, params: &Params<f32>, opt: Option<&AdamW>) -> Result<()> {
        if !self.params_here {
            let p = Arc::new(params.clone());
            self.all(|_| Cmd::Params(p.clone()))?;
            self.params_here = true;
        }
        if let (Some(opt), false) = (opt, self.moments_here) {
            let o = Arc::new(opt.clone());
            self.all(|_| Cmd::Moments(o.clone()))?;
            self.moments_here = true;
        }
        Ok(())
    }

    /// Each rank's share of a step's micro-batches (see the module doc).
    fn deal(&self, batches: &[Batch]) -> Result<Vec<Vec<Batch>>> {
        let n = self.world_size();
        check_accum(batches.len(), n)?;
        let mut shards = vec![Vec::new(); n];
        for (i, b) in batches.iter().enumerate() {
            shards[i % n].push(b.clone());
        }
        Ok(shards)
    }

    /// The all-reduced sum of the gradients of the mean losses of `batches` at `params`
    /// (not yet scaled by `1 / batches.len()`) and the sum of those losses, as rank 0 holds
    /// them after the reduction — for checks. Makes `params` the replicas' parameters and
    /// checks that every rank holds the same gradient bits.
    pub fn reduced_gradient(
        &mut self,
        params: &Params<f32>,
        batches: &[Batch],
    ) -> Result<(f64, Params<f32>)> {
        self.params_here = false;
        self.load(params, None)?;
        let shards = self.deal(batches)?;
        let losses = self.accumulate_and_reduce(shards)?;
        let mut grads = (self.all(|_| Cmd::Gradient)?.into_iter()).map(|r| match r {
            Reply::Gradient(g) => Ok(*g),
            _ => Err(Error::Other("a worker answered out of turn".into())),
        });
        let g0 = grads.next().expect("at least one rank")?;
        for (rank, g) in grads.enumerate() {
            if checksum(&g?) != checksum(&g0) {
                return Err(Error::Other(format!(
                    "rank {} reduced another gradient than rank 0",
                    rank + 1
                )));
            }
        }
        Ok((losses.iter().sum(), g0))
    }
}

impl Backend for DataParallel {
    fn name(&self) -> String {
        format!("{} devices ({})", self.world_size(), self.names.join(", "))
    }

    fn loss_and_grad(&mut self, _: &Params<f32>, _: &Batch, _: &mut Params<f32>) -> Result<f64> {
        Err(Error::input(
            "data-parallel training computes gradients inside an optimiser step only \
             (Backend::step, or DataParallel::reduced_gradient for checks)",
        ))
    }

    /// On rank 0.
    fn loss(&mut self, params: &Params<f32>, batch: &Batch) -> Result<f64> {
        self.load(params, None)?;
        let w = &self.workers[0];
        w.to.send(Cmd::Loss(batch.clone()))
            .map_err(|_| Error::Other("the data-parallel worker of rank 0 stopped".into()))?;
        match self.reply(0)? {
            Reply::Value(v) => Ok(v),
            _ => Err(Error::Other("a worker answered out of turn".into())),
        }
    }

    fn step(
        &mut self,
        params: &mut Params<f32>,
        opt: &mut AdamW,
        batches: &[Batch],
        clip: f64,
        lr: f64,
    ) -> Result<(f64, f64)> {
        if batches.is_empty() {
            return Err(Error::input("an optimiser step needs at least one batch"));
        }
        let shards = self.deal(batches)?;
        self.load(params, Some(opt))?;
        let losses = self.accumulate_and_reduce(shards)?;
        let accum = batches.len();
        let (norms, waits): (Vec<f64>, Vec<f64>) =
            (self.all(|_| Cmd::Apply { accum, clip, lr })?)
                .into_iter()
                .map(|r| match r {
                    Reply::Applied(norm, wait) => Ok((norm, wait)),
                    _ => Err(Error::Other("a worker answered out of turn".into())),
                })
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .unzip();
        self.last_wait = waits.into_iter().reduce(f64::max);
        if let Some(r) = norms.iter().position(|n| n.to_bits() != norms[0].to_bits()) {
            return Err(Error::Other(format!(
                "the replicas diverged: rank {r}'s gradient norm {} is not rank 0's {}",
                norms[r], norms[0]
            )));
        }
        Ok((losses.iter().sum::<f64>() / accum as f64, norms[0]))
    }

    fn reduce_wait(&self) -> Option<f64> {
        self.last_wait
    }

    /// Rank 0's parameters and optimiser state, after checking that every rank's weights
    /// have the same bits.
    fn sync(&mut self, params: &mut Params<f32>, opt: &mut AdamW) -> Result<()> {
        if !self.params_here {
            return Ok(());
        }
        let hashes: Vec<u64> = (self.all(|_| Cmd::Checksum)?.into_iter())
            .map(|r| match r {
                Reply::Hash(h) => h,
                _ => 0,
            })
            .collect();
        if let Some(r) = hashes.iter().position(|&h| h != hashes[0]) {
            return Err(Error::Other(format!(
                "the replicas diverged: rank {r}'s weights differ from rank 0's"
            )));
        }
        let w = &self.workers[0];
        w.to.send(Cmd::State)
            .map_err(|_| Error::Other("the data-parallel worker of rank 0 stopped".into()))?;
        let Reply::State(s) = self.reply(0)? else {
            return Err(Error::Other("a worker answered out of turn".into()));
        };
        let (p, o) = *s;
        *params = p;
        if self.moments_here {
            *opt = o;
        }
        Ok(())
    }
}

impl Drop for DataParallel {
    fn drop(&mut self) {
        // closing the channels ends each worker's loop
        let threads: Vec<_> = (self.workers.iter_mut())
            .filter_map(|w| w.thread.take())
            .collect();
        self.workers.clear();
        for t in threads {
            let _ = t.join();
        }
    }
}
