//! What a captured CUDA graph holds and the store of them a model keeps (`Graphs`); the
//! capture and replay are in `graphs.rs`.

use super::state::CudaState;
use super::work::{Layout, Work};
use crate::cuda::context::PinnedBuf;
use crate::engine::LogitsWant;
use crate::options::GpuOptions;
use cudarc::driver::CudaGraph;
use std::collections::BTreeMap;

/// What a graph was captured with; replay needs all of it unchanged.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CaptureKey {
    pub opts: GpuOptions,
    pub kernels: usize,
    pub weights: u64,
}

pub(crate) struct Captured {
    pub graph: CudaGraph,
    pub work: Work,
    /// the tokens of a replay, which the graph copies to `work.tokens` first
    pub tokens_in: PinnedBuf<u32>,
    /// a launch may still be running (it read no logits back, so nothing waited for it):
    /// `tokens_in` must not be written before it is done
    pub in_flight: bool,
    pub key: CaptureKey,
    /// padding rows' state (decode; none for a prefill graph)
    pub scratch: Option<CudaState>,
    pub layout: Layout,
    /// the state addresses in `work.states` now (a decode loop rarely changes them)
    pub state_ptrs: Vec<u64>,
}

#[derive(Default)]
pub struct Graphs {
    pub(crate) decode: BTreeMap<usize, Captured>,
    pub(crate) prefill: Vec<(Vec<usize>, LogitsWant, Captured)>,
}

impl Graphs {
    pub fn decode_buckets(&self) -> Vec<usize> {
        self.decode.keys().copied().collect()
    }
}
