//! The GPU trainer as one rank of data-parallel training (`crate::train::parallel`): its
//! device-resident gradient reduced in place over NCCL, then the same AdamW launch as one
//! GPU's step.
//!
//! Overlapped, the all-reduces run on a communication stream of the replica's own: at each
//! stage of the last micro-batch's backward that completes buckets, an event on the
//! compute stream marks the stage's last kernel, the communication stream waits for it and
//! NCCL queues the buckets there, while the compute stream goes on with the layers below.
//! After the backward the compute stream waits for the communication stream, so the
//! optimiser's launches read the reduced gradient. Two timing events (the backward's end on
//! the compute stream, the reduction's on the stream it ran on) give the step's wait.

use super::{grad_scale, CudaTrainer};
use crate::cuda::context::dev_err;
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::Params;
use crate::model::{Config, DType};
use crate::train::buckets::{Bucket, Pending};
use crate::train::collective::{Collective, FlatBuf};
use crate::train::optim::AdamW;
use crate::train::parallel::{DataParallel, MakeReplica, Reduce, Replica};
use crate::train::ready::{GradReady, NoHook, Stage};
use crate::train::{Backend, Batch};
use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::sync::Arc;

/// A [`CudaTrainer`] and the host side of its optimiser (configuration and step count;
/// the moments live on the device).
pub struct CudaReplica {
    trainer: CudaTrainer,
    opt: Option<AdamW>,
    /// where the overlapped all-reduces run
    comm: Arc<CudaStream>,
    /// timing events: the end of the last backward, the end of its reduction
    backward_end: CudaEvent,
    reduce_end: CudaEvent,
    /// whether the events hold a step's marks
    marked: bool,
}

impl CudaReplica {
    pub fn new(config: &Config, dtype: DType, ordinal: usize) -> Result<CudaReplica> {
        let trainer = CudaTrainer::new(config, dtype, ordinal)?;
        let ctx = &trainer.gpu.ctx;
        let comm = (ctx.new_stream()).map_err(|e| dev_err("creating the NCCL stream", e))?;
        let timing = || {
            (ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)))
                .map_err(|e| dev_err("creating a timing event", e))
        };
        Ok(CudaReplica {
            backward_end: timing()?,
            reduce_end: timing()?,
            marked: false,
            comm,
            trainer,
            opt: None,
        })
    }

    /// The gradient buffer as NCCL's operand on `stream`.
    fn flat_buf(&self, stream: &CudaStream) -> FlatBuf<'static> {
        FlatBuf::Device {
            ptr: self.trainer.grads.ptr,
            len: self.trainer.flat.len,
            stream: stream.cu_stream() as *mut std::ffi::c_void,
        }
    }
}

/// The overlapped reduction of one backward (see the module doc).
struct DeviceReduce<'a> {
    group: &'a mut dyn Collective,
    pending: Pending<'a>,
    compute: Arc<CudaStream>,
    comm: Arc<CudaStream>,
    buf: (u64, usize),
    n_layer: usize,
}

impl DeviceReduce<'_> {
    /// Queue `buckets` on the communication stream after the compute stream's work so far.
    fn launch(&mut self, buckets: &[Bucket]) -> Result<()> {
        if buckets.is_empty() {
            return Ok(());
        }
        let stage_end = (self.compute.record_event(None))
            .map_err(|e| dev_err("recording the end of a backward stage", e))?;
        (self.comm.wait(&stage_end))
            .map_err(|e| dev_err("the NCCL stream waiting for the backward", e))?;
        for b in buckets {
            let buf = FlatBuf::Device {
                ptr: self.buf.0,
                len: self.buf.1,
                stream: self.comm.cu_stream() as *mut std::ffi::c_void,
            };
            self.group.all_reduce_sum(buf, &b.ranges)?;
        }
        Ok(())
    }
}

impl GradReady<()> for DeviceReduce<'_> {
    fn ready(&mut self, stage: Stage, _: &mut ()) -> Result<()> {
        let buckets = self.pending.ready(stage.key(self.n_layer));
        self.launch(buckets)
    }
}

impl Replica for CudaReplica {
    fn name(&self) -> String {
        format!("cuda:{} {}", self.trainer.gpu.ordinal, self.trainer.name())
    }

    fn set_params(&mut self, params: &Params<f32>) -> Result<()> {
        self.trainer.upload_params(params)
    }

    fn set_moments(&mut self, opt: &AdamW) -> Result<()> {
        self.trainer.upload_moments(opt)?;
        self.opt = Some(opt.clone());
        Ok(())
    }

    fn accumulate(&mut self, batches: &[Batch], reduce: Option<Reduce<'_>>) -> Result<f64> {
        let Some(reduce) = reduce else {
            return self.trainer.accumulate(batches);
        };
        let (last, first) = match batches.split_last() {
            Some((last, first)) => (Some(last), first),
            None => (None, batches),
        };
        self.trainer.zero_grads()?;
        let mut loss = 0.0;
        for b in first {
            loss += self.trainer.run(b, Some(&mut NoHook))?;
        }
        let compute = self.trainer.gpu.stream.clone();
        let mut hook = DeviceReduce {
            group: reduce.group,
            pending: Pending::new(reduce.buckets),
            compute: compute.clone(),
            comm: self.comm.clone(),
            buf: (self.trainer.grads.ptr, self.trainer.flat.len),
            n_layer: self.trainer.d.n_layer,
        };
        if let Some(b) = last {
            loss += self.trainer.run(b, Some(&mut hook))?;
        }
        let mark = |e: &CudaEvent, s: &CudaStream| {
            e.record(s)
                .map_err(|e| dev_err("recording a timing event", e))
        };
        mark(&self.backward_end, &compute)?;
        // what the hook did not launch (all of it, were it never called)
        let rest = hook.pending.rest();
        hook.launch(rest)?;
        mark(&self.reduce_end, &self.comm)?;
        self.marked = true;
        // the optimiser reads the reduced gradient
        (compute.join(&self.comm)).map_err(|e| dev_err("waiting for the NCCL stream", e))?;
        Ok(loss)
    }

    fn reduce(&mut self, group: &mut dyn Collective, buckets: &[Bucket]) -> Result<()> {
        let compute = self.trainer.gpu.stream.clone();
        let mark = |e: &CudaEvent| {
            e.record(&compute)
                .map_err(|e| dev_err("recording a timing event", e))
        };
        mark(&self.backward_end)?;
        for b in buckets {
            group.all_reduce_sum(self.flat_buf(&compute), &b.ranges)?;
        }
        mark(&self.reduce_end)?;
        self.marked = true;
        Ok(())
    }

    fn reduce_wait(&mut self) -> Result<f64> {
        if !self.marked {
            return Ok(0.0);
        }
        let ms = (self.backward_end.elapsed_ms(&self.reduce_end))
            .map_err(|e| dev_err("timing the reduction", e))?;
        // the reduction may end before the backward's last kernel does
        Ok((ms as f64 / 1e3).max(0.0))
    }

    fn apply(&mut self, accum: usize, clip: f64, lr: f64) -> Result<f64> {
        let opt = (self.opt.as_mut())
            .ok_or_else(|| Error::Other("a replica stepped before it had moments".into()))?;
        self.trainer.update(opt, grad_scale(accum), clip, lr)
    }

    fn loss(&mut self, batch: &Batch) -> Result<f64> {
        self.trainer.run(batch, None)
    }

    fn gradient(&mut self) -> Result<Params<f32>> {
        let mut g = Params::zeros(&self.trainer.config);
        self.trainer.download(&self.trainer.grads, &mut g)?;
        Ok(g)
    }

    fn state(&mut self) -> Result<(Params<f32>, AdamW)> {
        let mut p = Params::zeros(&self.trainer.config);
        let mut opt = (self.opt.clone()).unwrap_or_else(|| AdamW::new(Default::default(), &p));
        self.trainer.sync(&mut p, &mut opt)?;
        Ok((p, opt))
    }
}

/// Data-parallel training on the GPUs `ordinals` (each once), one rank per GPU, over NCCL.
pub fn data_parallel(
    config: &Config,
    dtype: DType,
    ordinals: &[usize],
    bucket_bytes: usize,
) -> Result<DataParallel> {
    let mut seen = std::collections::BTreeSet::new();
    if let Some(o) = ordinals.iter().find(|&&o| !seen.insert(o)) {
        return Err(Error::input(format!(
            "--devices names cuda:{o} twice: NCCL runs one rank per GPU"
        )));
    }
    let visible = crate::cuda::device_count();
    if let Some(o) = ordinals.iter().find(|&&o| o >= visible) {
        return Err(Error::Device(format!(
            "CUDA device {o} requested, but {visible} device(s) are visible"
        )));
    }
    let groups = super::nccl::NcclCollective::group(ordinals)?;
    let makers = ordinals
        .iter()
        .map(|&o| {
            let c = config.clone();
            Box::new(move || Ok(Box::new(CudaReplica::new(&c, dtype, o)?) as Box<dyn Replica>))
                as MakeReplica
        })
        .collect();
    let groups = (groups.into_iter())
        .map(|g| Box::new(g) as Box<dyn Collective>)
        .collect();
    DataParallel::new(config, makers, groups, bucket_bytes)
}
