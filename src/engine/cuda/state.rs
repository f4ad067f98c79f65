//! A sequence's state on the device: one buffer holding, layer after layer, each tensor of
//! the layout in its storage dtype at its byte offset (SISO: `[angle H·S | ssm H·P·N | k H·N
//! | v H·P]`, `ssm` in f32, bf16 or f16; `model::state_layout`, `ST_*` in
//! kernels/common.cuh). Uploads and downloads convert to and from the host's f32 values,
//! exactly for values that came from the device. Clones share the buffer until one of them is written
//! (copy-on-write, like host states), so a snapshot costs nothing until it is used.
//!
//! States live in pieces of larger device allocations, recycled by the GPU's state pool
//! (`crate::cuda::context::StatePool`).

use crate::cuda::context::{Gpu, Slot};
use crate::error::{Error, Result};
use crate::model::state_layout::{StateBuf, StateLayout};
use std::sync::Arc;

#[derive(Clone)]
pub struct CudaState {
    buf: Arc<Slot>,
    gpu: Arc<Gpu>,
}

impl CudaState {
    /// A zero state (a fresh sequence).
    pub fn zeros(gpu: &Arc<Gpu>, layout: &StateLayout) -> Result<CudaState> {
        let bytes = layout.device_bytes();
        let buf = Slot::new(gpu, bytes)?;
        gpu.zero(buf.ptr(), bytes)?;
        Ok(CudaState {
            buf: Arc::new(buf),
            gpu: gpu.clone(),
        })
    }

    /// The host state's bytes on the device (the same flat layout).
    pub fn from_host(
        gpu: &Arc<Gpu>,
        layout: &StateLayout,
        host: &StateBuf<f32>,
    ) -> Result<CudaState> {
        if !host.fits(layout) {
            return Err(Error::State(format!(
                "state holds {} values, the model's state {} ({})",
                host.data.len(),
                layout.len(),
                layout.describe()
            )));
        }
        let bytes = layout.to_bytes(host);
        let buf = Slot::new(gpu, bytes.len())?;
        gpu.htod(&bytes, buf.ptr())?;
        Ok(CudaState {
            buf: Arc::new(buf),
            gpu: gpu.clone(),
        })
    }

    /// A copy of the values on the host.
    pub fn to_host(&self, layout: &StateLayout) -> Result<StateBuf<f32>> {
        let mut bytes = vec![0u8; layout.device_bytes()];
        self.gpu.dtoh(self.buf.ptr(), &mut bytes)?;
        layout.from_bytes(&bytes)
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

/// Move a state's data onto `gpu` (a no-op when it is there already): `Backend::place` of
/// every CUDA backend.
pub fn place_on(
    gpu: &Arc<Gpu>,
    layout: &StateLayout,
    data: &mut crate::engine::state::StateData,
) -> Result<()> {
    use crate::engine::state::StateData;
    let host = match data {
        StateData::Host(h) => h.clone(),
        StateData::Cuda(s) if s.is_on(gpu) => return Ok(()),
        StateData::Cuda(s) => Arc::new(s.to_host(layout)?),
    };
    *data = StateData::Cuda(CudaState::from_host(gpu, layout, &host)?);
    Ok(())
}

/// The device data of states placed on a GPU (an error for a host state).
pub fn device_states<'a>(
    states: &'a mut [&mut crate::engine::state::StateData],
) -> Result<Vec<&'a mut CudaState>> {
    states.iter_mut().map(|s| s.device_mut()).collect()
}

#[cfg(test)]
mod tests {
    use crate::engine::state::StateData;
    use crate::engine::{Device, LogitsWant, Model};
    use crate::mixers::mamba3::Weights;
    use crate::model::{Config, DType};

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
