//! A sequence's state on the device: one buffer holding, layer after layer,
//! `[angle H·S | ssm H·P·N | k H·N | v H·P]`, f32 (the host `LayerState` fields in order;
//! `ST_*` in kernels/common.cuh). Clones share the buffer until one of them is written
//! (copy-on-write, like host states), so a snapshot costs nothing until it is used.
//!
//! The buffers of dropped states go back to the GPU's [`StatePool`] for the next state.

use super::context::{DevBuf, Gpu};
use crate::cpu::{LayerState, SeqState};
use crate::error::{Error, Result};
use crate::model::Dims;
use std::sync::{Arc, Mutex};

/// Freed state buffers, kept for the next state of the same size. Allocating and freeing
/// device memory are slow driver calls (a free waits for the whole device), and a server
/// makes and drops states with every request: a fresh state, the copy-on-write copy after
/// a cache snapshot, an evicted entry. All work runs in order on one stream, so a buffer
/// can be handed out again at once: its new owner's work is queued after the old owner's.
#[derive(Default)]
pub struct StatePool {
    free: Mutex<Vec<DevBuf>>,
}

/// Bytes of free buffers a pool keeps at most (beyond that they are freed).
const POOL_KEEP_BYTES: usize = 256 << 20;

impl StatePool {
    fn take(&self, gpu: &Gpu, bytes: usize) -> Result<DevBuf> {
        let reused = self.free.lock().ok().and_then(|mut f| {
            let i = f.iter().position(|b| b.bytes == bytes)?;
            Some(f.swap_remove(i))
        });
        match reused {
            Some(b) => Ok(b),
            None => DevBuf::new(&gpu.ctx, bytes),
        }
    }

    fn put(&self, b: DevBuf) {
        if let Ok(mut f) = self.free.lock() {
            let held: usize = f.iter().map(|b| b.bytes).sum();
            if held + b.bytes <= POOL_KEEP_BYTES {
                f.push(b);
            }
        }
    }
}

/// A state's device memory; it goes back to the pool when the last clone is dropped.
struct Slot {
    buf: Option<DevBuf>,
    gpu: Arc<Gpu>,
}

impl Slot {
    fn new(gpu: &Arc<Gpu>, bytes: usize) -> Result<Slot> {
        Ok(Slot {
            buf: Some(gpu.state_pool.take(gpu, bytes)?),
            gpu: gpu.clone(),
        })
    }
    fn ptr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr)
    }
    fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.bytes)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.gpu.state_pool.put(b);
        }
    }
}

#[derive(Clone)]
pub struct CudaState {
    buf: Arc<Slot>,
    gpu: Arc<Gpu>,
}

impl CudaState {
    /// A zero state (a fresh sequence).
    pub fn zeros(gpu: &Arc<Gpu>, d: &Dims) -> Result<CudaState> {
        let bytes = d.n_layer * d.state_elems_per_layer() * 4;
        let buf = Slot::new(gpu, bytes)?;
        gpu.zero(buf.ptr(), bytes)?;
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
        let buf = Slot::new(gpu, flat.len() * 4)?;
        gpu.htod(&flat, buf.ptr())?;
        Ok(CudaState {
            buf: Arc::new(buf),
            gpu: gpu.clone(),
        })
    }

    /// A copy of the values on the host.
    pub fn to_host(&self, d: &Dims) -> Result<SeqState<f32>> {
        let per = d.state_elems_per_layer();
        let mut flat = vec![0f32; d.n_layer * per];
        self.gpu.dtoh(self.buf.ptr(), &mut flat)?;
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
            let copy = Slot::new(&self.gpu, self.buf.bytes())?;
            self.gpu
                .dtod(self.buf.ptr(), copy.ptr(), self.buf.bytes())?;
            self.buf = Arc::new(copy);
        }
        Ok(self.buf.ptr())
    }

    /// Whether this state lives on `gpu`'s device.
    pub fn is_on(&self, gpu: &Gpu) -> bool {
        self.gpu.ordinal == gpu.ordinal
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::state::StateData;
    use crate::engine::{Device, LogitsWant, Model};
    use crate::model::{Config, DType, Weights};

    /// Buffers come back from the pool zeroed for a fresh state, and a clone written after
    /// its source was dropped and reused does not see the reuse. Run on a machine with a
    /// CUDA device: `cargo test --release --lib state_pool -- --include-ignored`.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn state_pool_reuse_is_invisible() {
        let cfg = Config::synthetic(64, 2, 16, 16, 2, 1, 300);
        let w = Weights::synthetic(cfg, DType::F32, 5).unwrap();
        let m = Model::from_weights(w, Device::Cuda(0)).unwrap();
        let zero = m.new_state().to_host().unwrap();
        let prompt: Vec<u32> = (0..40).map(|t| (t * 37 + 11) % 300).collect();
        let mut reference = m.new_state();
        m.prefill(&prompt, &mut reference, LogitsWant::None)
            .unwrap();
        let after = reference.to_host().unwrap();
        for round in 0..20 {
            // A written state dropped: its buffer goes to the pool...
            let mut s = m.new_state();
            m.prefill(&prompt[..10 + round], &mut s, LogitsWant::None)
                .unwrap();
            let snapshot = s.clone();
            drop(s);
            // ...and a fresh state from it is zero.
            assert_eq!(m.new_state().to_host().unwrap(), zero, "round {round}");
            // A clone of a shared state copies on its first write and leaves the other.
            let mut c = reference.clone();
            m.decode(&[1], &mut [&mut c]).unwrap();
            assert_eq!(reference.to_host().unwrap(), after, "round {round}");
            drop(snapshot);
        }
        let pooled = m.new_state();
        let StateData::Cuda(cs) = &pooled.data else {
            panic!("a GPU model's state is on the GPU")
        };
        assert!(!cs.gpu.state_pool.free.lock().unwrap().is_empty());
    }
}
