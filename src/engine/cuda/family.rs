//! The CUDA backend of the Mamba-1, Mamba-2 and Mamba-3 MIMO models (`FamilyCuda`): the LM
//! of spec §1 around the mixer's layer launches (`crate::mixers::mamba1::cuda`,
//! `mamba2::cuda`, `mimo::cuda`) — embedding, per layer `r ← r + Mixer(RMSNorm(r))` on an
//! f32 residual (MIMO's GatedMLP blocks are part of its layer), `norm_f` and the head on the
//! rows asked for.
//!
//! Every pass, prefill or decode, is a packed pass (`crate::cuda::packed`): the sequences'
//! rows end to end, each from its own state on the device, cut into chunks for the scans.
//! A decode step is the pass of one row per sequence, whose scans run one step from the
//! states themselves. Kernels take their sizes as arguments, compiled once per dtype and
//! state size (not per shape).

use super::sample::DeviceSampling;
use super::state::{device_states, place_on, CudaState};
use crate::cuda::context::{DevBuf, Gpu, KArg, Kernel};
use crate::cuda::gemm::Lt;
use crate::cuda::gemm_spec::{ElemType, GemmSpec};
use crate::cuda::kernels::{state_define, KernelConfig, Module};
use crate::cuda::packed::{upload_matrix, Carve, LayerRun, PackedPass, Scratch, Table};
use crate::engine::backend::{Backend, MAX_TOKENS_PER_PASS_GPU};
use crate::engine::cuda::weights::F16_SAFE;
use crate::engine::logits::{HostBuf, StepLogits};
use crate::engine::sample_step::SampleStep;
use crate::engine::sampling::Sampler;
use crate::engine::state::StateData;
use crate::engine::LogitsWant;
use crate::error::{Error, Result};
use crate::mixers::{mamba1, mamba2, mimo, LmDims, MixerWeights};
use crate::model::family_weights::LmWeights;
use crate::model::state_layout::StateLayout;
use crate::model::DType;
use crate::options::GpuOptions;
use cudarc::driver::CudaGraph;
use std::sync::{Arc, Mutex};

/// The mixer of every layer, on the device.
enum GpuMixer {
    Mamba1(mamba1::cuda::GpuMamba1),
    Mamba2(mamba2::cuda::GpuMamba2),
    Mimo(mimo::cuda::GpuMimo),
}

impl GpuMixer {
    fn layer(
        &self,
        run: &LayerRun,
        l: usize,
        normed: u64,
        residual: u64,
        scratch: u64,
    ) -> Result<()> {
        match self {
            GpuMixer::Mamba1(m) => m.layer(run, l, normed, residual, scratch),
            GpuMixer::Mamba2(m) => m.layer(run, l, normed, residual, scratch),
            GpuMixer::Mimo(m) => m.layer(run, l, normed, residual, scratch),
        }
    }
    fn scratch_bytes(&self, rows: usize, chunks: usize, act_bytes: usize) -> usize {
        match self {
            GpuMixer::Mamba1(m) => m.scratch_bytes(rows, chunks, act_bytes),
            GpuMixer::Mamba2(m) => m.scratch_bytes(rows, chunks, act_bytes),
            GpuMixer::Mimo(m) => m.scratch_bytes(rows, chunks, act_bytes),
        }
    }
    /// Rows per chunk of a pass of `rows` rows in `seqs` sequences on `gpu`.
    fn chunk_len(&self, gpu: &Gpu, rows: usize, seqs: usize, batch_invariant: bool) -> usize {
        match self {
            GpuMixer::Mamba1(_) => mamba1::cuda::chunk_len(rows),
            GpuMixer::Mamba2(_) => mamba2::cuda::chunk_len(rows),
            GpuMixer::Mimo(m) => m.chunk_len(gpu, rows, seqs, batch_invariant),
        }
    }
}

/// The LM's parameters on the device: matrices in the model dtype, norms in f32.
struct LmDevice {
    embedding: DevBuf,
    /// `None`: tied to the embedding
    head: Option<DevBuf>,
    norms: Vec<DevBuf>,
    norm_f: DevBuf,
    eps: f32,
}

impl LmDevice {
    fn upload<M>(gpu: &Gpu, w: &LmWeights<M>, normed: DType) -> Result<LmDevice> {
        let norms: Vec<&[f32]> = w.layers.iter().map(|b| b.norm.as_slice()).collect();
        let lm = LmParts {
            embedding: &w.embedding,
            head: w.lm_head.as_ref(),
            norms,
            norm_f: &w.norm_f,
            eps: w.config.norm_eps,
            dtype: normed,
        };
        lm.upload(gpu)
    }

    /// Mamba-3's LM (spec §2.7 of mamba3-spec: the same blocks, ε fixed).
    fn upload_mimo(gpu: &Gpu, w: &mimo::MimoWeights, normed: DType) -> Result<LmDevice> {
        let lm = LmParts {
            embedding: &w.embedding,
            head: w.lm_head.as_ref(),
            norms: w.layers.iter().map(|l| l.norm.as_slice()).collect(),
            norm_f: &w.norm_f,
            eps: crate::model::config::NORM_EPS,
            dtype: normed,
        };
        lm.upload(gpu)
    }
    fn head(&self) -> u64 {
        self.head.as_ref().unwrap_or(&self.embedding).ptr
    }
}

/// A layer's floats in a device state, and its `ssm` tensor's (a device state's tensors all
/// start at multiples of 4 bytes: model::state_layout).
fn state_floats(layout: &StateLayout) -> (usize, usize) {
    let ssm = layout.tensors.iter().position(|t| t.name == "ssm");
    let ssm_floats = ssm.map_or(0, |i| layout.tensors[i].device_bytes() / 4);
    (layout.layer_bytes() / 4, ssm_floats)
}

/// The LM's parameters as every mixer's weights hold them; the embedding and head are
/// held in `dtype`, the normed rows' (`norm_t`).
struct LmParts<'a> {
    embedding: &'a crate::model::weights::Matrix,
    head: Option<&'a crate::model::weights::Matrix>,
    norms: Vec<&'a [f32]>,
    norm_f: &'a [f32],
    eps: f64,
    dtype: crate::model::DType,
}

impl LmParts<'_> {
    fn upload(&self, gpu: &Gpu) -> Result<LmDevice> {
        Ok(LmDevice {
            embedding: upload_matrix(gpu, self.embedding, self.dtype)?,
            head: self
                .head
                .map(|h| upload_matrix(gpu, h, self.dtype))
                .transpose()?,
            norms: self
                .norms
                .iter()
                .map(|n| gpu.upload(n))
                .collect::<Result<_>>()?,
            norm_f: gpu.upload(self.norm_f)?,
            eps: self.eps as f32,
        })
    }
}

/// Buffers kept between passes, and the captured decode graphs by batch size.
#[derive(Default)]
struct Work {
    scratch: Scratch,
    tables: Scratch,
    graphs: std::collections::BTreeMap<usize, DecodeGraph>,
}

pub struct FamilyCuda {
    gpu: Arc<Gpu>,
    lt: Lt,
    dims: LmDims,
    act: ElemType,
    /// the normed rows' dtype, and that of the matrices that read them ([`normed_dtype`])
    norm: ElemType,
    lm: LmDevice,
    mixer: GpuMixer,
    embed: Kernel,
    rms_norm: Kernel,
    add_bias: Kernel,
    layout: StateLayout,
    work: Mutex<Work>,
    /// Of the GPU options, these models use `batch_invariant` and (MIMO) `fused_decode`;
    /// the others (TF32, the fast scan, lanes) are Mamba-3 SISO's, kept only to be reported.
    options: Mutex<GpuOptions>,
    /// Sampling decode steps on the device. Locked before `work`.
    sampling: DeviceSampling,
    /// MIMO's decode step of every layer in one launch (16-bit models; `fused_decode`)
    fused: Option<mimo::cuda::fused::FusedDecode>,
}

impl FamilyCuda {
    /// A Mamba-1, Mamba-2 or Mamba-3 MIMO model on CUDA device `ordinal`; an error for
    /// Mamba-3 SISO (`engine::cuda::CudaModel` runs it).
    /// The `ssm` state is stored in `state_dtype` (the kernels' `STATE`).
    pub fn new(weights: &MixerWeights, ordinal: usize, state_dtype: DType) -> Result<FamilyCuda> {
        let layout = weights.state_layout().with_state_dtype(state_dtype)?;
        let gpu = Arc::new(Gpu::new(ordinal)?);
        let dtype = weights.dtype();
        let normed = normed_dtype(weights);
        let with_state = |mut cfg: KernelConfig| {
            cfg.set("STATE", state_define(state_dtype));
            cfg.set("NORM", mamba1::cuda::act_define(normed));
            cfg
        };
        let (lm, mixer, module_kernels) = match weights {
            MixerWeights::Mamba1(w) => {
                let cfg = with_state(mamba1::cuda::kernel_config(w.mixer_config()?, dtype));
                let (module, _) = Module::load(&gpu, mamba1::cuda::PROGRAM, &cfg)?;
                let mixer =
                    GpuMixer::Mamba1(mamba1::cuda::GpuMamba1::upload(&gpu, w, &module, normed)?);
                (
                    LmDevice::upload(&gpu, w, normed)?,
                    mixer,
                    lm_kernels(&module)?,
                )
            }
            MixerWeights::Mamba2(w) => {
                let cfg = with_state(mamba2::cuda::kernel_config(w.mixer_config()?, dtype)?);
                let (module, _) = Module::load(&gpu, mamba2::cuda::PROGRAM, &cfg)?;
                let mixer =
                    GpuMixer::Mamba2(mamba2::cuda::GpuMamba2::upload(&gpu, w, &module, normed)?);
                (
                    LmDevice::upload(&gpu, w, normed)?,
                    mixer,
                    lm_kernels(&module)?,
                )
            }
            MixerWeights::Mimo(w) => {
                let cfg = with_state(mimo::cuda::kernel_config(&w.dims, dtype)?);
                let (module, _) = Module::load(&gpu, mimo::cuda::PROGRAM, &cfg)?;
                let mixer = GpuMixer::Mimo(mimo::cuda::GpuMimo::upload(&gpu, w, &module, normed)?);
                (
                    LmDevice::upload_mimo(&gpu, w, normed)?,
                    mixer,
                    lm_kernels(&module)?,
                )
            }
            other => {
                return Err(Error::Device(format!(
                    "FamilyCuda runs Mamba-1, Mamba-2 and Mamba-3 MIMO, not {}",
                    other.kind().name()
                )))
            }
        };
        let fused = match &mixer {
            GpuMixer::Mimo(m) => {
                let (layer_floats, ssm_floats) = state_floats(&layout);
                match m.fused_config(dtype, normed, &layout, lm.eps)? {
                    Some(cfg) => {
                        let norms: Vec<u64> = lm.norms.iter().map(|n| n.ptr).collect();
                        let (floats, ssm) = (layer_floats, ssm_floats);
                        mimo::cuda::fused::FusedDecode::new(&gpu, m, &norms, &cfg, floats, ssm)?
                    }
                    None => None,
                }
            }
            _ => None,
        };
        let lt = Lt::new(&gpu)?;
        let (embed, rms_norm, add_bias) = module_kernels;
        Ok(FamilyCuda {
            act: ElemType::of(dtype),
            norm: ElemType::of(normed),
            dims: weights.lm_dims(),
            gpu,
            lt,
            lm,
            mixer,
            embed,
            rms_norm,
            add_bias,
            layout,
            work: Mutex::new(Work::default()),
            options: Mutex::new(GpuOptions::from_env()),
            sampling: DeviceSampling::new(),
            fused,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The rows whose logits `want` asks for, in order, and each sequence's count.
    fn picked_rows(lens: &[usize], want: LogitsWant) -> Vec<i32> {
        let mut picked = Vec::new();
        let mut row0 = 0;
        for &len in lens {
            match want {
                LogitsWant::All => picked.extend((row0..row0 + len).map(|r| r as i32)),
                LogitsWant::Last => picked.push((row0 + len - 1) as i32),
                LogitsWant::None => {}
            }
            row0 += len;
        }
        picked
    }

    /// A pass's buffers in `scratch` (sized by a dry run on address 0).
    fn carve(&self, c: &mut Carve, rows: usize, chunks: usize, picked: usize) -> PassBufs {
        let (dm, vp, e) = (self.dims.d_model, self.dims.vocab_padded, self.act.size());
        PassBufs {
            tokens: c.take(rows, 4),
            residual: c.take(rows * dm, 4),
            normed: c.take(rows * dm, e),
            picked: c.take(picked, 4),
            logits: c.take(picked * vp, 4),
            mixer: c.take(self.mixer.scratch_bytes(rows, chunks, e), 1),
            picked_len: picked,
        }
    }

    /// The tables and buffers of a pass of sequences of `lens` rows from the states at
    /// `addrs`, in `tables` and `scratch`.
    fn prepare(
        &self,
        tables: &mut Scratch,
        scratch: &mut Scratch,
        lens: &[usize],
        addrs: &[u64],
        picked: usize,
    ) -> Result<(PackedPass, PassBufs)> {
        let rows: usize = lens.iter().sum();
        let chunk_len = self
            .mixer
            .chunk_len(&self.gpu, rows, lens.len(), self.batch_invariant());
        let pass = PackedPass::new(&self.gpu, tables, lens, addrs, chunk_len)?;
        let mut sizing = Carve::new(0);
        self.carve(&mut sizing, rows, pass.chunks, picked);
        let base = scratch.reserve(&self.gpu, sizing.used())?;
        let bufs = self.carve(&mut Carve::new(base), rows, pass.chunks, picked);
        Ok((pass, bufs))
    }

    /// The launches of a pass (what a graph captures): embedding, the layers, `norm_f` and
    /// the head on the picked rows. The tokens and picked rows must be on the device.
    fn launches(&self, pass: &PackedPass, b: &PassBufs) -> Result<()> {
        let gpu = &*self.gpu;
        let (rows, dm, vp) = (pass.rows as u32, self.dims.d_model, self.dims.vocab_padded);
        let dm_i = dm as i32;
        gpu.launch(
            &self.embed,
            (rows, 1, 1),
            256,
            0,
            false,
            &[&b.tokens, &self.lm.embedding.ptr, &b.residual, &dm_i],
        )?;
        let (layer_floats, ssm_floats) = state_floats(&self.layout);
        let all_rows = 0u64;
        let batch_invariant = self.batch_invariant();
        // a decode step (one row per sequence) of a fused model: every layer in one launch
        let fused = self.fused.as_ref().filter(|f| {
            pass.rows == pass.seqs
                && !batch_invariant
                && self.options.lock().is_ok_and(|o| o.fused_decode)
                && f.takes(gpu, pass.rows)
        });
        if let Some(f) = fused {
            f.run(gpu, pass.rows, b.residual, pass.at(Table::SeqState))?;
        }
        let layers = if fused.is_some() {
            &[][..]
        } else {
            &self.lm.norms[..]
        };
        for (l, norm) in layers.iter().enumerate() {
            let args: [&dyn KArg; 6] = [
                &b.residual,
                &all_rows,
                &norm.ptr,
                &b.normed,
                &dm_i,
                &self.lm.eps,
            ];
            gpu.launch(&self.rms_norm, (rows, 1, 1), 256, 0, false, &args)?;
            let run = LayerRun {
                gpu,
                lt: &self.lt,
                pass,
                state_off: l * layer_floats,
                ssm_floats,
                act: self.act,
                add_bias: &self.add_bias,
                batch_invariant,
            };
            self.mixer.layer(&run, l, b.normed, b.residual, b.mixer)?;
        }
        if b.picked_len == 0 {
            return Ok(());
        }
        let args: [&dyn KArg; 6] = [
            &b.residual,
            &b.picked,
            &self.lm.norm_f.ptr,
            &b.normed,
            &dm_i,
            &self.lm.eps,
        ];
        gpu.launch(
            &self.rms_norm,
            (b.picked_len as u32, 1, 1),
            256,
            0,
            false,
            &args,
        )?;
        let spec = GemmSpec::linear(
            b.picked_len,
            vp,
            dm,
            self.norm,
            ElemType::F32,
            vp,
            false,
            false,
        )
        .invariant(batch_invariant);
        self.lt.gemm(gpu, &spec, b.normed, self.lm.head(), b.logits)
    }

    /// Tokens (each < vocab_padded, else an error naming it) and each state's device address.
    fn inputs(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut CudaState],
    ) -> Result<(Vec<u32>, Vec<u64>)> {
        let tokens: Vec<u32> = seqs.concat();
        if let Some(pos) = tokens
            .iter()
            .position(|&t| t as usize >= self.dims.vocab_padded)
        {
            return Err(Error::TokenOutOfRange {
                id: tokens[pos] as u64,
                pos,
                vocab: self.dims.vocab_size,
            });
        }
        let addrs = states
            .iter_mut()
            .map(|s| s.unique_ptr())
            .collect::<Result<_>>()?;
        Ok((tokens, addrs))
    }

    /// One pass over packed sequences: each sequence's wanted rows of logits, flattened.
    fn pass(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut CudaState],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let host = self.pass_then(seqs, states, want, |logits, picked| {
            let mut host = vec![0f32; picked * self.dims.vocab_padded];
            self.gpu.dtoh(logits, &mut host)?;
            Ok(host)
        })?;
        Ok(self.split(&host, &lens, want))
    }

    /// One pass whose `[picked rows, vocab_padded]` logits stay on the device: `then(logits
    /// address, picked rows)` runs while the work buffers are held.
    fn pass_then<R>(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut CudaState],
        want: LogitsWant,
        then: impl FnOnce(u64, usize) -> Result<R>,
    ) -> Result<R> {
        let (tokens, addrs) = self.inputs(seqs, states)?;
        let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let picked = Self::picked_rows(&lens, want);
        let mut guard = self.lock()?;
        let work = &mut *guard;
        let (pass, b) = self.prepare(
            &mut work.tables,
            &mut work.scratch,
            &lens,
            &addrs,
            picked.len(),
        )?;
        self.gpu.htod(&tokens, b.tokens)?;
        self.gpu.htod(&picked, b.picked)?;
        self.sampling.count_pass();
        self.launches(&pass, &b)?;
        then(b.logits, picked.len())
    }

    /// Logits rows cut back into one block per sequence.
    fn split(&self, host: &[f32], lens: &[usize], want: LogitsWant) -> Vec<Vec<f32>> {
        let vp = self.dims.vocab_padded;
        let mut out = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &len in lens {
            let n = match want {
                LogitsWant::All => len,
                LogitsWant::Last => 1,
                LogitsWant::None => 0,
            } * vp;
            out.push(host[at..at + n].to_vec());
            at += n;
        }
        out
    }

    fn batch_invariant(&self) -> bool {
        self.options.lock().is_ok_and(|o| o.batch_invariant)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Work>> {
        self.work
            .lock()
            .map_err(|_| Error::Device("work buffers poisoned".into()))
    }

    /// Capture the decode step of `batch` sequences as a CUDA graph, with buffers of its
    /// own; its replays take any states (their addresses go into its tables first).
    pub fn capture_decode(&self, batch: usize) -> Result<()> {
        if batch == 0 {
            return Err(Error::input(
                "a decode graph needs a batch size of at least 1",
            ));
        }
        let layout = self.layout.clone();
        let mut graph = DecodeGraph {
            tables: Scratch::default(),
            scratch: Scratch::default(),
            graph: None,
            bufs: None,
            spares: Vec::new(),
        };
        // One eager step on scratch states first: cuBLASLt plans its products outside the
        // capture, and every buffer reaches its size.
        let mut dummies: Vec<CudaState> = (0..batch)
            .map(|_| CudaState::zeros(&self.gpu, &layout))
            .collect::<Result<_>>()?;
        let addrs: Vec<u64> = dummies
            .iter_mut()
            .map(|s| s.unique_ptr())
            .collect::<Result<_>>()?;
        let lens = vec![1; batch];
        let (pass, b) =
            self.prepare(&mut graph.tables, &mut graph.scratch, &lens, &addrs, batch)?;
        let picked: Vec<i32> = (0..batch as i32).collect();
        self.gpu.htod(&vec![0u32; batch], b.tokens)?;
        self.gpu.htod(&picked, b.picked)?;
        self.launches(&pass, &b)?;
        self.gpu.sync()?;
        graph.graph = Some(self.gpu.capture_graph(|| self.launches(&pass, &b))?);
        graph.bufs = Some(b);
        // (a graph it replaces may hold a sampled step's logits)
        self.sampling.count_pass();
        self.lock()?.graphs.insert(batch, graph);
        Ok(())
    }

    /// The smallest captured decode batch that holds `batch` sequences.
    fn decode_bucket(&self, batch: usize) -> Result<Option<usize>> {
        Ok(self.lock()?.graphs.range(batch..).next().map(|(&b, _)| b))
    }

    /// One decode step by the graph of `bucket`, its `[batch, vocab_padded]` logits copied
    /// into `host`.
    fn decode_graph_into(
        &self,
        bucket: usize,
        tokens: &[u32],
        states: &mut [&mut CudaState],
        host: &mut [f32],
    ) -> Result<()> {
        let logits = self.replay_decode(bucket, tokens, states)?;
        self.gpu.dtoh(logits, host)
    }

    /// One decode step by the graph of `bucket` (≥ the batch: the spare rows decode token 0
    /// into spare states of the graph's own); returns the device address of its logits
    /// (the graph's own buffer: valid until the next replay or the graphs are dropped).
    fn replay_decode(
        &self,
        bucket: usize,
        tokens: &[u32],
        states: &mut [&mut CudaState],
    ) -> Result<u64> {
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        let (mut toks, mut addrs) = self.inputs(&seqs, states)?;
        let mut guard = self.lock()?;
        let work = &mut *guard;
        let g = work
            .graphs
            .get_mut(&bucket)
            .ok_or_else(|| Error::Device("decode graph vanished".into()))?;
        // Rows beyond the batch decode into spare states of the graph's own.
        while g.spares.len() < bucket - tokens.len() {
            g.spares.push(CudaState::zeros(&self.gpu, &self.layout)?);
        }
        for s in g.spares.iter_mut().take(bucket - tokens.len()) {
            addrs.push(s.unique_ptr()?);
            toks.push(0);
        }
        let lens = vec![1; bucket];
        let b = g
            .bufs
            .as_ref()
            .ok_or_else(|| Error::Device("decode graph without buffers".into()))?;
        let (logits, tok_at) = (b.logits, b.tokens);
        PackedPass::new(
            &self.gpu,
            &mut g.tables,
            &lens,
            &addrs,
            self.mixer
                .chunk_len(&self.gpu, bucket, bucket, self.batch_invariant()),
        )?;
        self.gpu.htod(&toks, tok_at)?;
        self.sampling.count_pass();
        g.graph
            .as_ref()
            .ok_or_else(|| Error::Device("decode graph not captured".into()))?
            .launch()
            .map_err(|e| crate::cuda::context::dev_err("replaying the decode graph", e))?;
        Ok(logits)
    }
}

/// A pass's buffers (device addresses).
struct PassBufs {
    tokens: u64,
    residual: u64,
    normed: u64,
    picked: u64,
    logits: u64,
    mixer: u64,
    picked_len: usize,
}

/// A captured decode step with the buffers it reads and writes.
struct DecodeGraph {
    tables: Scratch,
    scratch: Scratch,
    graph: Option<CudaGraph>,
    bufs: Option<PassBufs>,
    spares: Vec<CudaState>,
}

/// The LM row kernels of a Mamba-1/Mamba-2 program (lm_rows.cu).
/// The dtype of the normed rows and of the matrices that read them (in_proj, the MLP's
/// fc1, the head and the embedding): f16 for a bf16 model whose every such row and matrix
/// stays inside f16's range — a normed row's entries are at most √d_model·max|w| — so that
/// the GEMM input is rounded by 2⁻¹¹ rather than bf16's 2⁻⁸ (on `mimo-mlp-norm` the bf16
/// rounding alone took the logits from 8.7e-3, the CPU's, to 1.08e-2 of the goldens); bf16→f16
/// is exact for weights above 2⁻¹⁴. Otherwise the model's dtype.
fn normed_dtype(weights: &MixerWeights) -> DType {
    use crate::model::weights::Matrix;
    let dtype = weights.dtype();
    if dtype != DType::BF16 {
        return dtype;
    }
    let (d_model, norms, mats): (usize, Vec<&[f32]>, Vec<&Matrix>) = match weights {
        MixerWeights::Mamba1(w) => lm_reads(w, |m| vec![&m.in_proj]),
        MixerWeights::Mamba2(w) => lm_reads(w, |m| vec![&m.in_proj]),
        MixerWeights::Mimo(w) => {
            let mut norms: Vec<&[f32]> = vec![&w.norm_f];
            let mut mats: Vec<&Matrix> = vec![&w.embedding];
            mats.extend(&w.lm_head);
            for l in &w.layers {
                norms.push(&l.norm);
                mats.push(&l.in_proj);
                if let Some(m) = &l.mlp {
                    norms.push(&m.norm);
                    mats.push(&m.fc1);
                }
            }
            (w.dims.d_model, norms, mats)
        }
        _ => return dtype,
    };
    let max_abs = |v: &[f32]| v.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
    let row_bound = (d_model as f64).sqrt() * norms.iter().map(|n| max_abs(n)).fold(0.0, f64::max);
    let fits = row_bound < F16_SAFE && mats.iter().all(|m| m.data.max_abs() < F16_SAFE);
    if fits {
        DType::F16
    } else {
        dtype
    }
}

/// The norms and the normed rows' matrices of a Mamba-1/2 LM, `mixer_mats` naming the mixer's.
fn lm_reads<'a, M>(
    w: &'a LmWeights<M>,
    mixer_mats: impl Fn(&'a M) -> Vec<&'a crate::model::weights::Matrix>,
) -> (
    usize,
    Vec<&'a [f32]>,
    Vec<&'a crate::model::weights::Matrix>,
) {
    let mut norms: Vec<&[f32]> = vec![&w.norm_f];
    let mut mats = vec![&w.embedding];
    mats.extend(&w.lm_head);
    for b in &w.layers {
        norms.push(&b.norm);
        mats.extend(mixer_mats(&b.mixer));
    }
    (w.embedding.cols, norms, mats)
}

fn lm_kernels(module: &Module) -> Result<(Kernel, Kernel, Kernel)> {
    Ok((
        module.kernel("fam_embed")?,
        module.kernel("fam_rms_norm")?,
        module.kernel("fam_add_bias")?,
    ))
}

impl Backend for FamilyCuda {
    fn device_name(&self) -> String {
        format!("cuda:{} ({})", self.gpu.ordinal, self.gpu.name)
    }

    fn max_tokens_per_pass(&self) -> usize {
        MAX_TOKENS_PER_PASS_GPU
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.sync()
    }

    fn new_state(&self, layout: &StateLayout) -> Option<StateData> {
        CudaState::zeros(&self.gpu, layout)
            .ok()
            .map(StateData::Cuda)
    }

    fn place(&self, layout: &StateLayout, data: &mut StateData) -> Result<()> {
        place_on(&self.gpu, layout, data)
    }

    fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut StateData],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        self.pass(seqs, &mut device_states(states)?, want)
    }

    fn decode_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        out: &mut StepLogits,
    ) -> Result<()> {
        let mut st = device_states(states)?;
        if let Some(bucket) = self.decode_bucket(tokens.len())? {
            // (into the step's pinned buffer, kept across steps: a fresh heap copy of B=64
            // rows of a 128k vocabulary cost milliseconds a step in page faults and a
            // pageable copy)
            let dst = out.pinned(&self.gpu, tokens.len() * self.dims.vocab_padded)?;
            return self.decode_graph_into(bucket, tokens, &mut st, dst);
        }
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        let rows = self.pass(&seqs, &mut st, LogitsWant::Last)?;
        out.buf = HostBuf::Heap(rows.concat());
        Ok(())
    }

    /// Sampled on the device, from the step's logits where they are (the eager pass's
    /// buffers or the graph's): only the ids (and the log-probabilities asked for) come
    /// back.
    fn decode_sample(
        &self,
        tokens: &[u32],
        states: &mut [&mut StateData],
        samplers: &mut [&mut Sampler],
        step: &mut SampleStep,
    ) -> Result<bool> {
        let mut st = device_states(states)?;
        let (vocab, ld) = (self.dims.vocab_size, self.dims.vocab_padded);
        self.sampling
            .decode_sample(&self.gpu, vocab, ld, samplers, step, |sample| {
                if let Some(bucket) = self.decode_bucket(tokens.len())? {
                    return sample(self.replay_decode(bucket, tokens, &mut st)?);
                }
                let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
                self.pass_then(&seqs, &mut st, LogitsWant::Last, |at, _| sample(at))
            })?;
        Ok(true)
    }

    fn last_step_row(&self, b: usize) -> Result<Vec<f32>> {
        self.sampling.last_step_row(b)
    }

    fn capture_decode_graph(&self, bucket: usize) -> Result<()> {
        self.capture_decode(bucket)
    }
    fn capture_prefill_graph(&self, _lens: &[usize], _want: LogitsWant) -> Result<()> {
        Err(Error::Device(
            "prefill graphs are captured for Mamba-3 SISO models only; this one's prefills run eagerly"
                .into(),
        ))
    }
    fn has_decode_graph(&self, batch: usize) -> Result<bool> {
        Ok(self.decode_bucket(batch)?.is_some())
    }
    fn decode_graph(&self, tokens: &[u32], states: &mut [&mut StateData]) -> Result<Vec<Vec<f32>>> {
        let bucket = self.decode_bucket(tokens.len())?.ok_or_else(|| {
            Error::input(format!("no decode graph holds a batch of {}", tokens.len()))
        })?;
        let mut flat = vec![0f32; tokens.len() * self.dims.vocab_padded];
        self.decode_graph_into(bucket, tokens, &mut device_states(states)?, &mut flat)?;
        Ok(flat
            .chunks(self.dims.vocab_padded)
            .map(<[f32]>::to_vec)
            .collect())
    }
    fn clear_graphs(&self) -> Result<()> {
        // (a sampled step's logits may have been a graph's)
        self.sampling.count_pass();
        self.lock()?.graphs.clear();
        Ok(())
    }
    fn gpu_options(&self) -> Result<Option<GpuOptions>> {
        Ok(self.options.lock().ok().map(|o| *o))
    }
    /// Graphs captured under other options are dropped (their GEMMs may differ).
    fn set_gpu_options(&self, o: GpuOptions) -> Result<()> {
        let mut cur = self
            .options
            .lock()
            .map_err(|_| Error::Device("a GPU pass panicked earlier".into()))?;
        if *cur != o {
            self.sampling.count_pass();
            self.lock()?.graphs.clear();
            *cur = o;
        }
        Ok(())
    }
}
