//! [`Backend`]: what a device does for the engine's [`Model`](super::Model). The CPU
//! (`super::cpu::CpuModel<f32>`) and CUDA (`super::cuda::CudaModel`) models implement it;
//! `Model` holds one as a trait object and never asks which. The GPU-only calls (options,
//! graphs) have defaults that say a GPU is needed.
//!
//! Every call receives states already checked against the model and placed on the
//! backend's device ([`Backend::place`]).

use super::logits::StepLogits;
use super::sample_step::SampleStep;
use super::sampling::Sampler;
use super::state::StateData;
use super::LogitsWant;
use crate::error::{Error, Result};
use crate::model::state_layout::StateLayout;
use crate::options::GpuOptions;

/// At most this many tokens go through one pass of the layers on the CPU; longer prompts
/// are read as consecutive continued windows, which is exact and bounds activation memory.
pub const MAX_TOKENS_PER_PASS: usize = 8192;

/// The same bound on a GPU, where memory is plentiful and larger passes run faster.
pub const MAX_TOKENS_PER_PASS_GPU: usize = 65536;

/// Batch-invariant prefill (`GpuOptions::batch_invariant`): each sequence is read in
/// windows of this many tokens, whatever else is in the batch…
pub const INVARIANT_WINDOW: usize = 4096;
/// …and a pass takes at most this many rows (the scans' chunk length, chosen by a pass's
/// rows, is then the same in every pass).
pub const INVARIANT_PASS: usize = 16384;

pub(crate) fn needs_gpu(what: &str) -> Error {
    Error::Device(format!(
        "{what} need a CUDA device; this model runs on the CPU"
    ))
}

/// The defaults are a CPU backend's: states live on the host.
pub(crate) trait Backend {
    /// A human-readable name of the device.
    fn device_name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    /// How many tokens one pass of the layers takes at most.
    fn max_tokens_per_pass(&self) -> usize {
        MAX_TOKENS_PER_PASS
    }

    /// Wait until queued device work has finished.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// A fresh (zero) state's data on this device; `None` keeps the host state (always on
    /// the CPU; on a GPU when device memory cannot be had now).
    fn new_state(&self, _layout: &StateLayout) -> Option<StateData> {
        None
    }

    /// Move a state's data onto this device (a no-op when it is there).
    fn place(&self, layout: &StateLayout, data: &mut StateData) -> Result<()> {
        data.bring_to_host(layout)
    }

    /// One pass of the layers: each sequence from its state; each sequence's logits rows
    /// (all positions, the last, or none), flattened.
    fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut StateData],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>>;

    /// One decode step of one token per sequence into `out` (a captured graph's replay
    /// where one holds the batch).
    fn decode_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        out: &mut StepLogits,
    ) -> Result<()>;

    /// One decode step whose rows are sampled where the logits are (a GPU: on the
    /// device, only the ids coming back) into `step`'s ids and finiteness; false when this
    /// backend does not (the CPU's default), and the engine samples the rows of
    /// [`Backend::decode_into`] on the host instead.
    fn decode_sample(
        &self,
        _tokens: &[u32],
        _states: &mut [&mut StateData],
        _samplers: &mut [&mut Sampler],
        _step: &mut SampleStep,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Row `b` of the logits of the last step [`Backend::decode_sample`] sampled on the
    /// device (`vocab_padded` entries), while no other pass has run since.
    fn last_step_row(&self, _b: usize) -> Result<Vec<f32>> {
        Err(Error::input(
            "no decode step's logits were left on a device (the CPU keeps them in the step)",
        ))
    }

    /// One sequence's window from its host state, like `forward`, but the hidden states
    /// after `norm_f` (`[rows, d_model]`) instead of logits: what embeddings pool. Runs on
    /// the CPU (a GPU model hands it to its CPU twin).
    fn hidden(
        &self,
        _tokens: &[u32],
        _state: &mut StateData,
        _want: LogitsWant,
    ) -> Result<Vec<f32>> {
        Err(Error::input("hidden states are computed by a CPU backend"))
    }

    fn gpu_options(&self) -> Result<Option<GpuOptions>> {
        Ok(None)
    }
    fn set_gpu_options(&self, _o: GpuOptions) -> Result<()> {
        Err(needs_gpu("GPU options"))
    }
    /// Size the work buffers for passes of up to `rows` tokens over `seqs` sequences.
    fn reserve_passes(&self, _rows: usize, _seqs: usize) -> Result<()> {
        Ok(())
    }
    fn capture_decode_graph(&self, _bucket: usize) -> Result<()> {
        Err(needs_gpu("CUDA graphs"))
    }
    /// Whether a captured decode graph holds a batch of `batch`.
    fn has_decode_graph(&self, _batch: usize) -> Result<bool> {
        Ok(false)
    }
    /// Replay the decode graph: `[batch, vocab_padded]` logits rows.
    fn decode_graph(
        &self,
        _tokens: &[u32],
        _states: &mut [&mut StateData],
    ) -> Result<Vec<Vec<f32>>> {
        Err(needs_gpu("CUDA graphs"))
    }
    fn capture_prefill_graph(&self, _lens: &[usize], _want: LogitsWant) -> Result<()> {
        Err(needs_gpu("CUDA graphs"))
    }
    fn prefill_graph(
        &self,
        _seqs: &[&[u32]],
        _states: &mut [&mut StateData],
        _want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        Err(needs_gpu("CUDA graphs"))
    }
    fn clear_graphs(&self) -> Result<()> {
        Ok(())
    }
}
