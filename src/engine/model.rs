//! `Model`: weights resident on one device, and the calls every user of the engine makes —
//! `new_state`, `prefill`, `decode` — whatever the device.

use super::backend::{Backend, INVARIANT_PASS, INVARIANT_WINDOW};
pub use super::backend::{MAX_TOKENS_PER_PASS, MAX_TOKENS_PER_PASS_GPU};
use super::cpu::CpuModel;
use super::cpu_family::FamilyCpu;
use super::device::Device;
use super::logits::LogitsWant;
pub use super::logits::{Logits, StepLogits};
use super::sample_step::{sample_rows_on_host, SampleStep};
use super::sampling::Sampler;
use super::state::{State, StateData};
use crate::error::{Error, Result};
use crate::mixers::mamba3::Weights;
pub use crate::mixers::{LmDims, MixerKind, MixerWeights};
use crate::model::state_layout::StateLayout;
use crate::model::DType;
pub use crate::options::GpuOptions;
use std::path::Path;
use std::sync::Arc;

pub struct Model {
    weights: MixerWeights,
    dims: LmDims,
    /// States of another model are refused (see [`MixerWeights::fingerprint`]).
    fingerprint: u64,
    /// The named tensors of a sequence's state (the mixer's).
    state_layout: Arc<StateLayout>,
    device: Device,
    backend: Box<dyn Backend>,
}

impl Model {
    /// Load a model directory (config.json + weights, any mixer, either file layout), its
    /// states stored as the command line's `--state-dtype` says (f32 by default).
    pub fn load(path: &Path, device: Device, dtype: DType) -> Result<Model> {
        Self::load_with_state(path, device, dtype, state_dtype_of_command_line())
    }

    /// [`Model::load`] with the `ssm` state stored in `state_dtype` (f32, bf16 or f16; the
    /// arithmetic is f32 either way).
    pub fn load_with_state(
        path: &Path,
        device: Device,
        dtype: DType,
        state_dtype: DType,
    ) -> Result<Model> {
        crate::model::state_layout::check_state_dtype(state_dtype)?;
        if dtype == DType::F64 {
            return Err(Error::input(
                "dtype f64 is for the CPU oracle (cpu::CpuModel<f64>); the engine runs f32, bf16 or f16",
            ));
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(ordinal) = device {
            let kind = MixerKind::of_path(path)?;
            match kind {
                MixerKind::Mamba3Siso => {}
                MixerKind::Mamba1 | MixerKind::Mamba2 | MixerKind::Mamba3Mimo => {
                    let weights = crate::timeline::stage("checkpoint read and converted", || {
                        MixerWeights::load(path, dtype)
                    })?;
                    return Self::from_mixer_weights_with_state(weights, device, state_dtype);
                }
            }
            // Open the device while the checkpoint is read and converted: the two take
            // comparable times at start-up, and neither needs the other. Nor does loading
            // the cuBLASLt library (`Lt::new` waits for it; an error shows there). That
            // load holds the context's creation back ≈ 150 ms, but loaded once the context
            // exists it holds the weights upload back as long, and loaded by `Lt::new` it
            // was slower still (docs/decisions.md, "cuBLASLt library loaded at start").
            std::thread::spawn(crate::cuda::gemm::Lt::load_library);
            let gpu = std::thread::spawn(move || {
                crate::timeline::stage("CUDA device opened (thread)", || {
                    crate::cuda::context::Gpu::new(ordinal)
                })
            });
            let weights = crate::timeline::stage("checkpoint read and converted", || {
                Weights::load(path, dtype)
            });
            let gpu = gpu
                .join()
                .map_err(|_| Error::Device("opening the CUDA device panicked".into()))?;
            let weights = Arc::new(weights?);
            let model = crate::engine::cuda::CudaModel::on(gpu?, weights.clone(), state_dtype)?;
            return Self::assemble(
                MixerWeights::Mamba3(weights),
                device,
                Box::new(model),
                state_dtype,
            );
        }
        let weights = crate::timeline::stage("checkpoint read and converted", || {
            MixerWeights::load(path, dtype)
        })?;
        Self::from_mixer_weights_with_state(weights, device, state_dtype)
    }

    /// A model of Mamba-3 SISO parameters built in memory (synthetic, trained, converted).
    pub fn from_weights(weights: Weights, device: Device) -> Result<Model> {
        Self::from_mixer_weights(MixerWeights::Mamba3(Arc::new(weights)), device)
    }

    /// A model of any mixer's parameters on `device`, states as `--state-dtype` says.
    pub fn from_mixer_weights(weights: MixerWeights, device: Device) -> Result<Model> {
        Self::from_mixer_weights_with_state(weights, device, state_dtype_of_command_line())
    }

    /// A model of any mixer's parameters on `device`, the `ssm` state stored in
    /// `state_dtype`.
    pub fn from_mixer_weights_with_state(
        weights: MixerWeights,
        device: Device,
        state_dtype: DType,
    ) -> Result<Model> {
        crate::model::state_layout::check_state_dtype(state_dtype)?;
        let backend: Box<dyn Backend> =
            match device {
                Device::Cpu => cpu_backend(&weights)?,
                #[cfg(feature = "cuda")]
                Device::Cuda(ordinal) => match &weights {
                    MixerWeights::Mamba3(w) => Box::new(crate::engine::cuda::CudaModel::new(
                        w.clone(),
                        ordinal,
                        state_dtype,
                    )?),
                    w @ (MixerWeights::Mamba1(_)
                    | MixerWeights::Mamba2(_)
                    | MixerWeights::Mimo(_)) => Box::new(
                        crate::engine::cuda::family::FamilyCuda::new(w, ordinal, state_dtype)?,
                    ),
                },
                #[cfg(not(feature = "cuda"))]
                Device::Cuda(_) => {
                    return Err(Error::Device(
                        "this build has no CUDA support (rebuild with `--features cuda`)".into(),
                    ))
                }
            };
        Self::assemble(weights, device, backend, state_dtype)
    }

    fn assemble(
        weights: MixerWeights,
        device: Device,
        backend: Box<dyn Backend>,
        state_dtype: DType,
    ) -> Result<Model> {
        Ok(Model {
            dims: weights.lm_dims(),
            fingerprint: weights.fingerprint(),
            state_layout: Arc::new(weights.state_layout().with_state_dtype(state_dtype)?),
            weights,
            device,
            backend,
        })
    }

    /// The storage dtype of the `ssm` state (`--state-dtype`).
    pub fn state_dtype(&self) -> DType {
        self.state_layout.state_dtype()
    }

    /// The named tensors of one sequence's state.
    pub fn state_layout(&self) -> &StateLayout {
        &self.state_layout
    }

    /// The parameters, whichever the mixer.
    pub fn weights(&self) -> &MixerWeights {
        &self.weights
    }
    /// The Mamba-3 SISO parameters, if that is the model's mixer.
    pub fn mamba3(&self) -> Option<&Arc<Weights>> {
        self.weights.mamba3()
    }
    /// Which mixer the model's layers use.
    pub fn kind(&self) -> MixerKind {
        self.weights.kind()
    }
    /// The sizes of the language model (vocabulary, width, depth).
    pub fn dims(&self) -> LmDims {
        self.dims
    }
    pub fn dtype(&self) -> DType {
        self.weights.dtype()
    }
    /// A hash of the config and parameters; a state records the one of its model.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    pub fn device(&self) -> Device {
        self.device
    }
    /// A human-readable name of the device (the GPU's name on CUDA).
    pub fn device_name(&self) -> String {
        self.backend.device_name()
    }

    /// Wait until queued device work has finished (a no-op on the CPU); for timing.
    pub fn synchronize(&self) -> Result<()> {
        self.backend.synchronize()
    }

    /// A fresh (zero) state for one sequence, on this model's device.
    pub fn new_state(&self) -> State {
        let host = State::new_host(self.fingerprint, self.state_layout.clone());
        match self.backend.new_state(&self.state_layout) {
            Some(data) => State { data, ..host },
            None => host,
        }
    }

    /// Load a state saved by [`State::save`] onto this model's device; refused if it
    /// belongs to another model.
    pub fn load_state(&self, path: &Path) -> Result<State> {
        let mut s = State::load_host(path, self.fingerprint, self.state_layout.clone())?;
        self.place(&mut s)?;
        Ok(s)
    }

    /// Move a state of this model onto this model's device (a no-op when it is there).
    pub fn place(&self, state: &mut State) -> Result<()> {
        self.check_state(state, 0)?;
        self.backend.place(&self.state_layout, &mut state.data)
    }

    fn check_state(&self, s: &State, b: usize) -> Result<()> {
        if s.model != self.fingerprint || *s.layout != *self.state_layout {
            return Err(Error::State(format!(
                "state {b} belongs to another model (fingerprint {:016x}, this model {:016x})",
                s.model, self.fingerprint
            )));
        }
        Ok(())
    }

    /// Read `tokens` from `state` (fresh: a stateless window; carried: a continued window)
    /// and leave the state after them.
    pub fn prefill(&self, tokens: &[u32], state: &mut State, want: LogitsWant) -> Result<Logits> {
        Ok(self.prefill_batch(&[tokens], &mut [state], want)?.remove(0))
    }

    /// How many tokens one pass of the layers takes at most on this model's device.
    pub fn max_tokens_per_pass(&self) -> usize {
        self.backend.max_tokens_per_pass()
    }

    /// Prefill a batch of sequences of any lengths, each from and into its own state.
    /// Returns each sequence's logits (all positions, the last, or none).
    pub fn prefill_batch(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut State],
        want: LogitsWant,
    ) -> Result<Vec<Logits>> {
        super::cpu::check_batch(self.dims.vocab_size, seqs, states.len())?;
        for (b, s) in states.iter_mut().enumerate() {
            self.check_state(s, b)?;
            self.place(s)?;
        }
        let vocab = self.dims.vocab_padded;
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
        // Cut into passes of at most MAX_TOKENS_PER_PASS tokens, shared among the
        // sequences that still have tokens left; batch-invariant: every sequence in
        // windows of INVARIANT_WINDOW tokens (where it is cut must not depend on the
        // others), as many per pass as fit in INVARIANT_PASS rows.
        let invariant = self.gpu_options()?.is_some_and(|o| o.batch_invariant);
        let mut done = vec![0usize; seqs.len()];
        while done.iter().zip(seqs).any(|(&d, s)| d < s.len()) {
            let mut live: Vec<usize> = (0..seqs.len())
                .filter(|&b| done[b] < seqs[b].len())
                .collect();
            let share = if invariant {
                live.truncate(INVARIANT_PASS / INVARIANT_WINDOW);
                INVARIANT_WINDOW
            } else {
                (self.max_tokens_per_pass() / live.len()).max(1)
            };
            let pieces: Vec<&[u32]> = live
                .iter()
                .map(|&b| &seqs[b][done[b]..(done[b] + share).min(seqs[b].len())])
                .collect();
            let mut live_states: Vec<&mut State> = states
                .iter_mut()
                .enumerate()
                .filter(|(b, _)| done[*b] < seqs[*b].len())
                .take(live.len())
                .map(|(_, s)| &mut **s)
                .collect();
            let logits = self.forward(&pieces, &mut live_states, want)?;
            for ((&b, piece), lg) in live.iter().zip(&pieces).zip(logits) {
                done[b] += piece.len();
                match want {
                    LogitsWant::All => out[b].extend(lg),
                    LogitsWant::Last => out[b] = lg,
                    LogitsWant::None => {}
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|d| Logits::from_rows(d, vocab))
            .collect())
    }

    /// One token for each sequence of a batch, each from and into its own state. Returns
    /// `[B, vocab_padded]` logits. On a GPU with a captured decode graph that holds the
    /// batch (see [`Model::capture_decode_graph`]) the step is a graph replay.
    pub fn decode(&self, tokens: &[u32], states: &mut [&mut State]) -> Result<Logits> {
        if self.backend.has_decode_graph(tokens.len())? {
            return self.decode_graph(tokens, states);
        }
        self.decode_eager(tokens, states)
    }

    /// [`Model::decode`] into `out`, a buffer kept across steps (see [`StepLogits`]): the
    /// serving loop's call. On a failure `out` holds no rows.
    pub fn decode_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut State],
        out: &mut StepLogits,
    ) -> Result<()> {
        out.rows = 0;
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        self.check_and_place(&seqs, states)?;
        let vp = self.dims.vocab_padded;
        self.backend
            .decode_into(tokens, &mut data_of(states), out)?;
        self.round_host_states(states);
        for s in states.iter_mut() {
            s.position += 1;
        }
        out.rows = tokens.len();
        out.vocab = vp;
        Ok(())
    }

    /// One decode step whose rows are each sampled by their sampler (`samplers[b]` for
    /// `tokens[b]`): the ids, in `step` (with whether each row's logits were finite: a row
    /// that was not is not sampled). On a GPU the rows are sampled on the device and only
    /// the ids come back (a draw from the device's own generator: the same candidates and
    /// probabilities as the CPU's `Sampler`, other draws; greedy rows the same token); on
    /// the CPU each sampler samples its row as [`Sampler::sample`] does. The ids are not
    /// accepted: the caller accepts each finite row's id into its sampler
    /// ([`Sampler::accept`], as `Continuation::push` does), which keeps the host's and
    /// the device's counts in step. On a failure `step` holds no ids.
    pub fn decode_sample<'s>(
        &self,
        tokens: &[u32],
        states: &mut [&mut State],
        samplers: &mut [&mut Sampler],
        step: &'s mut SampleStep,
    ) -> Result<&'s [u32]> {
        step.clear();
        step.logits.rows = 0;
        if samplers.len() != tokens.len() {
            return Err(Error::input(format!(
                "a sampled decode step needs one sampler per token: {} tokens, {} samplers",
                tokens.len(),
                samplers.len()
            )));
        }
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        self.check_and_place(&seqs, states)?;
        let on_device = self
            .backend
            .decode_sample(tokens, &mut data_of(states), samplers, step)?;
        if !on_device {
            self.backend
                .decode_into(tokens, &mut data_of(states), &mut step.logits)?;
            step.logits.rows = tokens.len();
            step.logits.vocab = self.dims.vocab_padded;
            sample_rows_on_host(samplers, step, self.dims.vocab_size);
        }
        for s in states.iter_mut() {
            s.position += 1;
        }
        Ok(&step.ids)
    }

    /// Row `b` of the logits of the step `step` came from (`vocab_padded` entries): from
    /// the step itself on the CPU, fetched from the device on a GPU (one row, while no
    /// other pass has run on the model since).
    pub fn step_logits_row(&self, step: &SampleStep, b: usize) -> Result<Vec<f32>> {
        if b >= step.ids.len() {
            return Err(Error::input(format!(
                "row {b} of a step of {} rows",
                step.ids.len()
            )));
        }
        if step.on_host {
            return Ok(step.logits.row(b).to_vec());
        }
        self.backend.last_step_row(b)
    }

    /// [`Model::decode`] without CUDA graphs.
    pub fn decode_eager(&self, tokens: &[u32], states: &mut [&mut State]) -> Result<Logits> {
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        self.check_and_place(&seqs, states)?;
        let rows = self.forward(&seqs, states, LogitsWant::Last)?;
        Ok(Logits::from_rows(rows.concat(), self.dims.vocab_padded))
    }

    fn check_and_place(&self, seqs: &[&[u32]], states: &mut [&mut State]) -> Result<()> {
        super::cpu::check_batch(self.dims.vocab_size, seqs, states.len())?;
        for (b, s) in states.iter_mut().enumerate() {
            self.check_state(s, b)?;
            self.place(s)?;
        }
        Ok(())
    }

    /// The GPU options (`None` on the CPU).
    pub fn gpu_options(&self) -> Result<Option<GpuOptions>> {
        self.backend.gpu_options()
    }

    /// Change the GPU options (an error on the CPU).
    pub fn set_gpu_options(&self, o: GpuOptions) -> Result<()> {
        self.backend.set_gpu_options(o)
    }

    /// Make room now for passes of up to `rows` tokens over up to `seqs` sequences (with
    /// the last position's logits of each), so that serving never stops to regrow the
    /// GPU's work buffers; a no-op on the CPU.
    pub fn reserve_passes(&self, rows: usize, seqs: usize) -> Result<()> {
        self.backend.reserve_passes(rows, seqs)
    }

    /// Capture the decode step for batches of up to `bucket` sequences as one CUDA graph;
    /// [`Model::decode`] replays it from then on for batches that fit.
    pub fn capture_decode_graph(&self, bucket: usize) -> Result<()> {
        self.backend.capture_decode_graph(bucket)
    }

    /// Replay the captured decode graph of the smallest bucket that holds the batch; an
    /// error if there is none or the model's options changed since the capture.
    pub fn decode_graph(&self, tokens: &[u32], states: &mut [&mut State]) -> Result<Logits> {
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        self.check_and_place(&seqs, states)?;
        let rows = self.backend.decode_graph(tokens, &mut data_of(states))?;
        for s in states.iter_mut() {
            s.position += 1;
        }
        Ok(Logits::from_rows(rows.concat(), self.dims.vocab_padded))
    }

    /// Capture one prefill pass of sequences of exactly these lengths as a CUDA graph.
    pub fn capture_prefill_graph(&self, lens: &[usize], want: LogitsWant) -> Result<()> {
        if lens.iter().sum::<usize>() > self.max_tokens_per_pass() {
            return Err(Error::input(format!(
                "a prefill graph holds one pass of at most {} tokens",
                self.max_tokens_per_pass()
            )));
        }
        self.backend.capture_prefill_graph(lens, want)
    }

    /// Replay the prefill graph captured for exactly these lengths; an error if there is
    /// none or the model's options changed since the capture.
    pub fn prefill_graph(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut State],
        want: LogitsWant,
    ) -> Result<Vec<Logits>> {
        self.check_and_place(seqs, states)?;
        let rows = self
            .backend
            .prefill_graph(seqs, &mut data_of(states), want)?;
        for (s, t) in states.iter_mut().zip(seqs) {
            s.position += t.len() as u64;
        }
        let vocab = self.dims.vocab_padded;
        Ok(rows
            .into_iter()
            .map(|d| Logits::from_rows(d, vocab))
            .collect())
    }

    /// Drop every captured CUDA graph (a no-op on the CPU).
    pub fn clear_graphs(&self) -> Result<()> {
        self.backend.clear_graphs()
    }

    /// One pass of the layers over a checked batch whose states are on this device.
    fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut State],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        let out = self.backend.forward(seqs, &mut data_of(states), want)?;
        self.round_host_states(states);
        for (s, t) in states.iter_mut().zip(seqs) {
            s.position += t.len() as u64;
        }
        Ok(out)
    }

    /// A 16-bit `ssm` state on the host: the CPU backends compute in f32 and leave f32
    /// values, rounded here to the state's dtype, as a device stores them at the end of
    /// each step or pass. (The host keeps them widened to f32: exact, and what a device
    /// state brought to the host holds.)
    fn round_host_states(&self, states: &mut [&mut State]) {
        if !self.state_layout.is_narrow() {
            return;
        }
        for s in states.iter_mut() {
            if let StateData::Host(h) = &mut s.data {
                self.state_layout.round_host(Arc::make_mut(h));
            }
        }
    }
}

/// The device data of each state.
fn data_of<'a>(states: &'a mut [&mut State]) -> Vec<&'a mut StateData> {
    states.iter_mut().map(|s| &mut s.data).collect()
}

/// Hidden states for embeddings (a separate, small addition: the product layer's
/// `/v1/embeddings` pools these).
impl Model {
    /// Read `tokens` from `state` like [`Model::prefill`], but return the hidden states
    /// after the final norm (`norm_f`) instead of logits: `[rows, d_model]` row-major, for
    /// all positions or the last (`LogitsWant::None` returns nothing). Long inputs are read
    /// as consecutive continued windows, as in prefill.
    ///
    /// Runs on the CPU backend whatever the model's device (on a CUDA model the state is
    /// brought to the host first and stays there until the next GPU call places it back).
    pub fn hidden(&self, tokens: &[u32], state: &mut State, want: LogitsWant) -> Result<Vec<f32>> {
        super::cpu::check_batch(self.dims.vocab_size, &[tokens], 1)?;
        self.check_state(state, 0)?;
        state.data.bring_to_host(&self.state_layout)?;
        let cpu = cpu_backend(&self.weights)?;
        let mut out = Vec::new();
        for piece in tokens.chunks(MAX_TOKENS_PER_PASS) {
            let rows = cpu.hidden(piece, &mut state.data, want)?;
            self.round_host_states(&mut [&mut *state]);
            state.position += piece.len() as u64;
            match want {
                LogitsWant::All => out.extend(rows),
                LogitsWant::Last => out = rows,
                LogitsWant::None => {}
            }
        }
        Ok(out)
    }
}

/// The command line's `--state-dtype` (`crate::options`), f32 when none was given.
fn state_dtype_of_command_line() -> DType {
    crate::options::state_dtype_name()
        .parse()
        .unwrap_or(DType::F32)
}

/// The CPU backend of a model's mixer.
fn cpu_backend(weights: &MixerWeights) -> Result<Box<dyn Backend>> {
    Ok(match weights {
        MixerWeights::Mamba3(w) => Box::new(CpuModel::<f32>::new(w.clone())),
        other => Box::new(FamilyCpu::new(other.clone())?),
    })
}
