//! A sequence's state on the device: one buffer holding, layer after layer,
//! `[angle H·S | ssm H·P·N | k H·N | v H·P]`, f32 (the host `LayerState` fields in order;
//! `ST_*` in kernels/common.cuh). Clones share the buffer until one of them is written
//! (copy-on-write, like host states), so a snapshot costs nothing until it is used.

use super::context::{DevBuf, Gpu};
use crate::cpu::{LayerState, SeqState};
use crate::error::{Error, Result};
use crate::model::Dims;
use std::sync::Arc;

#[derive(Clone)]
pub struct CudaState {
    buf: Arc<DevBuf>,
    gpu: Arc<Gpu>,
}

impl CudaState {
    /// A zero state (a fresh sequence).
    pub fn zeros(gpu: &Arc<Gpu>, d: &Dims) -> Result<CudaState> {
        let bytes = d.n_layer * d.state_elems_per_layer() * 4;
        let buf = DevBuf::new(&gpu.ctx, bytes)?;
        gpu.zero(buf.ptr, bytes)?;
        Ok(CudaState {
            buf: Arc::new(buf),
            gpu: gpu.clone(),
        })
    }

    pub fn from_host(gpu: &Arc<Gpu>, d: &Dims, host: &SeqState<f32>) -> Result<CudaState> {
        if host.len() != d.n_layer {
            return Err(Error::State(format!(
                "state has {} layers, the model {}",
                host.len(),
                d.n_layer
            )));
        }
        let mut flat = Vec::with_capacity(d.n_layer * d.state_elems_per_layer());
        for l in host {
            flat.extend_from_slice(&l.angle);
            flat.extend_from_slice(&l.ssm);
            flat.extend_from_slice(&l.k);
            flat.extend_from_slice(&l.v);
        }
        if flat.len() != d.n_layer * d.state_elems_per_layer() {
            return Err(Error::State(format!(
                "state holds {} values, the model's state {}",
                flat.len(),
                d.n_layer * d.state_elems_per_layer()
            )));
        }
        Ok(CudaState {
            buf: Arc::new(gpu.upload(&flat)?),
            gpu: gpu.clone(),
        })
    }

    /// A copy of the values on the host.
    pub fn to_host(&self, d: &Dims) -> Result<SeqState<f32>> {
        let per = d.state_elems_per_layer();
        let mut flat = vec![0f32; d.n_layer * per];
        self.gpu.dtoh(self.buf.ptr, &mut flat)?;
        let (h, p, n, s) = (d.nheads, d.headdim, d.d_state, d.num_rope_angles);
        Ok(flat
            .chunks(per)
            .map(|c| {
                let (angle, rest) = c.split_at(h * s);
                let (ssm, rest) = rest.split_at(h * p * n);
                let (k, v) = rest.split_at(h * n);
                LayerState {
                    angle: angle.to_vec(),
                    ssm: ssm.to_vec(),
                    k: k.to_vec(),
                    v: v.to_vec(),
                }
            })
            .collect())
    }

    /// The device address of a buffer this state alone owns (copying a shared one first).
    pub fn unique_ptr(&mut self) -> Result<u64> {
        if Arc::get_mut(&mut self.buf).is_none() {
            let copy = DevBuf::new(&self.gpu.ctx, self.buf.bytes)?;
            self.gpu.dtod(self.buf.ptr, copy.ptr, self.buf.bytes)?;
            self.buf = Arc::new(copy);
        }
        Ok(self.buf.ptr)
    }

    /// Whether this state lives on `gpu`'s device.
    pub fn is_on(&self, gpu: &Gpu) -> bool {
        self.gpu.ordinal == gpu.ordinal
    }
}
