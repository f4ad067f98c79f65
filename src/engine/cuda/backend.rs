//! The CUDA model as the engine's [`Backend`].

use super::model::CudaModel;
use super::state::{device_states, place_on};
use crate::engine::backend::{Backend, MAX_TOKENS_PER_PASS_GPU};
use crate::engine::logits::StepLogits;
use crate::engine::sample_step::SampleStep;
use crate::engine::sampling::Sampler;
use crate::engine::state::StateData;
use crate::engine::LogitsWant;
use crate::error::Result;
use crate::model::state_layout::StateLayout;
use crate::options::GpuOptions;

impl Backend for CudaModel {
    fn device_name(&self) -> String {
        CudaModel::device_name(self)
    }

    fn max_tokens_per_pass(&self) -> usize {
        MAX_TOKENS_PER_PASS_GPU
    }

    fn synchronize(&self) -> Result<()> {
        CudaModel::synchronize(self)
    }

    fn new_state(&self, layout: &StateLayout) -> Option<StateData> {
        CudaModel::new_state(self, layout).ok().map(StateData::Cuda)
    }

    fn place(&self, layout: &StateLayout, data: &mut StateData) -> Result<()> {
        place_on(self.gpu(), layout, data)
    }

    fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut StateData],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        CudaModel::forward(self, seqs, &mut device_states(states)?, want)
    }

    fn decode_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        out: &mut StepLogits,
    ) -> Result<()> {
        let dst = out.pinned(self.gpu(), tokens.len() * self.weights.dims.vocab_padded)?;
        let mut st = device_states(states)?;
        if self.decode_bucket(tokens.len())?.is_some() {
            self.decode_graph_into(tokens, &mut st, dst)
        } else {
            self.decode_eager_into(tokens, &mut st, dst)
        }
    }

    fn decode_sample(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        samplers: &mut [&mut Sampler],
        step: &mut SampleStep,
    ) -> Result<bool> {
        let d = self.weights.dims;
        let mut st = device_states(states)?;
        self.sampling.decode_sample(
            self.gpu(),
            d.vocab_size,
            d.vocab_padded,
            samplers,
            step,
            |sample| {
                if self.decode_bucket(tokens.len())?.is_some() {
                    sample(self.decode_graph_on_device(tokens, &mut st)?)
                } else {
                    self.decode_eager_then(tokens, &mut st, sample)
                }
            },
        )?;
        Ok(true)
    }

    fn last_step_row(&self, b: usize) -> Result<Vec<f32>> {
        self.sampling.last_step_row(b)
    }

    fn gpu_options(&self) -> Result<Option<GpuOptions>> {
        self.options().map(Some)
    }
    fn set_gpu_options(&self, o: GpuOptions) -> Result<()> {
        self.set_options(o)
    }
    fn reserve_passes(&self, rows: usize, seqs: usize) -> Result<()> {
        CudaModel::reserve_passes(self, rows, seqs)
    }
    fn capture_decode_graph(&self, bucket: usize) -> Result<()> {
        self.capture_decode(bucket)
    }
    fn has_decode_graph(&self, batch: usize) -> Result<bool> {
        Ok(self.decode_bucket(batch)?.is_some())
    }
    fn decode_graph(&self, tokens: &[u32], states: &mut [&mut StateData]) -> Result<Vec<Vec<f32>>> {
        CudaModel::decode_graph(self, tokens, &mut device_states(states)?)
    }
    fn capture_prefill_graph(&self, lens: &[usize], want: LogitsWant) -> Result<()> {
        self.capture_prefill(lens, want)
    }
    fn prefill_graph(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut StateData],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        CudaModel::prefill_graph(self, seqs, &mut device_states(states)?, want)
    }
    fn clear_graphs(&self) -> Result<()> {
        CudaModel::clear_graphs(self)
    }
}
