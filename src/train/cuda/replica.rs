//! The GPU trainer as one rank of data-parallel training (`crate::train::parallel`): its
//! device-resident gradient reduced in place over NCCL, then the same AdamW launch as one
//! GPU's step.

use super::{grad_scale, CudaTrainer};
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::Params;
use crate::model::{Config, DType};
use crate::train::buckets::Bucket;
use crate::train::collective::{Collective, FlatBuf};
use crate::train::optim::AdamW;
use crate::train::parallel::{DataParallel, MakeReplica, Replica};
use crate::train::{Backend, Batch};

/// A [`CudaTrainer`] and the host side of its optimiser (configuration and step count;
/// the moments live on the device).
pub struct CudaReplica {
    trainer: CudaTrainer,
    opt: Option<AdamW>,
}

impl CudaReplica {
    pub fn new(config: &Config, dtype: DType, ordinal: usize) -> Result<CudaReplica> {
        Ok(CudaReplica {
            trainer: CudaTrainer::new(config, dtype, ordinal)?,
            opt: None,
        })
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

    fn accumulate(&mut self, batches: &[Batch]) -> Result<f64> {
        self.trainer.accumulate(batches)
    }

    fn reduce(&mut self, group: &mut dyn Collective, buckets: &[Bucket]) -> Result<()> {
        let t = &self.trainer;
        for b in buckets {
            let buf = FlatBuf::Device {
                ptr: t.grads.ptr,
                len: t.flat.len,
                stream: t.gpu.cu_stream() as *mut std::ffi::c_void,
            };
            group.all_reduce_sum(buf, &b.ranges)?;
        }
        Ok(())
    }

    fn apply(&mut self, accum: usize, clip: f64, lr: f64) -> Result<f64> {
        let opt = (self.opt.as_mut())
            .ok_or_else(|| Error::Other("a replica stepped before it had moments".into()))?;
        self.trainer.update(opt, grad_scale(accum), clip, lr)
    }

    fn loss(&mut self, batch: &Batch) -> Result<f64> {
        self.trainer.run(batch, false)
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
