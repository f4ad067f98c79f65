//! A sequence's state on the device: one buffer holding, layer after layer,
//! `[angle H·S | ssm H·P·N | k H·N | v H·P]`, f32 (the host `LayerState` fields in order;
//! `ST_*` in kernels/common.cuh). Clones share the buffer until one of them is written
//! (copy-on-write, like host states), so a snapshot costs nothing until it is used.
//!
//! States live in pieces of larger device allocations, recycled by the GPU's [`StatePool`].

use super::context::{DevBuf, Gpu};
use crate::cpu::{LayerState, SeqState};
use crate::error::{Error, Result};
use crate::model::Dims;
use std::sync::{Arc, Mutex};

/// Device memory for states: slabs of several states each, cut into pieces that are
/// recycled. Allocating and freeing device memory are slow driver calls (a free waits for
/// the whole device), and a server makes states with every request (a fresh one, the
/// copy-on-write copy after a cache snapshot): a slab makes one allocation serve several,
/// and a dropped state's piece goes back to the free list for the next one. Slabs are
/// freed with the pool, so it holds the peak of states alive at once (which the prefix
/// cache's budget bounds). All work runs in order on one stream, so a piece can be handed
/// out again at once: its new owner's work is queued after the old owner's.
#[derive(Default)]
pub struct StatePool {
    free: Mutex<Vec<Piece>>,
}

/// Bytes a slab aims at (a larger state gets a slab of its own), ...
const SLAB_BYTES: usize = 64 << 20;
/// ... holding at most this many states.
const SLAB_STATES: usize = 16;
/// Pieces start at multiples of this (the kernels' vector loads).
const PIECE_ALIGN: usize = 256;

/// One state's bytes in a slab.
struct Piece {
    slab: Arc<DevBuf>,
    offset: usize,
    bytes: usize,
}

impl Piece {
    fn ptr(&self) -> u64 {
        self.slab.ptr + self.offset as u64
    }
}

impl StatePool {
    fn take(&self, gpu: &Gpu, bytes: usize) -> Result<Piece> {
        let mut free = self
            .free
            .lock()
            .map_err(|_| Error::Device("the state pool's lock is poisoned".into()))?;
        if let Some(i) = free.iter().rposition(|p| p.bytes == bytes) {
            return Ok(free.swap_remove(i));
        }
        let stride = bytes.div_ceil(PIECE_ALIGN) * PIECE_ALIGN;
        let n = (SLAB_BYTES / stride).clamp(1, SLAB_STATES);
        // (short of memory for a whole slab, a state may still fit alone)
        let (slab, n) = match DevBuf::new(&gpu.ctx, stride * n) {
            Ok(b) => (b, n),
            Err(_) if n > 1 => (DevBuf::new(&gpu.ctx, bytes)?, 1),
            Err(e) => return Err(e),
        };
        let slab = Arc::new(slab);
        free.extend((1..n).map(|i| Piece {
            slab: slab.clone(),
            offset: i * stride,
            bytes,
        }));
        Ok(Piece {
            slab,
            offset: 0,
            bytes,
        })
    }

    fn put(&self, p: Piece) {
        if let Ok(mut f) = self.free.lock() {
            f.push(p);
        }
    }
}

/// A state's device memory; it goes back to the pool when the last clone is dropped.
struct Slot {
    piece: Option<Piece>,
    gpu: Arc<Gpu>,
}

impl Slot {
    fn new(gpu: &Arc<Gpu>, bytes: usize) -> Result<Slot> {
        Ok(Slot {
            piece: Some(gpu.state_pool.take(gpu, bytes)?),
            gpu: gpu.clone(),
        })
    }
    fn ptr(&self) -> u64 {
        self.piece.as_ref().map_or(0, Piece::ptr)
    }
    fn bytes(&self) -> usize {
        self.piece.as_ref().map_or(0, |p| p.bytes)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(p) = self.piece.take() {
            self.gpu.state_pool.put(p);
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

    /// Pieces come back from the pool zeroed for a fresh state, states of one slab do not
    /// touch each other, and a clone written after its source was dropped and reused does
    /// not see the reuse. Run on a machine with a
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
        // Many states at once (more than one slab): each holds its own prompt's state.
        let prompts: Vec<&[u32]> = (0..40).map(|i| &prompt[i % 7..]).collect();
        let mut many: Vec<_> = prompts.iter().map(|_| m.new_state()).collect();
        for (s, p) in many.iter_mut().zip(&prompts) {
            m.prefill(p, s, LogitsWant::None).unwrap();
        }
        for (s, p) in many.iter().zip(&prompts) {
            let mut alone = m.new_state();
            m.prefill(p, &mut alone, LogitsWant::None).unwrap();
            assert_eq!(s.to_host().unwrap(), alone.to_host().unwrap());
        }
        drop(many);
        let pooled = m.new_state();
        let StateData::Cuda(cs) = &pooled.data else {
            panic!("a GPU model's state is on the GPU")
        };
        assert!(!cs.gpu.state_pool.free.lock().unwrap().is_empty());
    }
}
