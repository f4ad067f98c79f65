//! `CudaModel`: a model's weights on one GPU, its compiled kernels, cuBLASLt, the work
//! buffers of eager passes and the captured CUDA graphs. The engine's `Model` calls it
//! for `Device::Cuda`; states are already on the device when `forward` is called.

use super::captured::Graphs;
use super::forward::prefill_gemm_specs;
use super::forward::Pipe;
use super::kernels::Kernels;
use super::state::CudaState;
use super::weights::{in_proj_kind, proj_f16, scan_f16, GpuWeights};
use super::work::{Caps, Layout, Work};
use crate::cuda::context::Gpu;
use crate::cuda::gemm::Lt;
use crate::cuda::kernels::{KernelConfig, ScanMath};
use crate::engine::LogitsWant;
use crate::error::{Error, Result};
use crate::mixers::mamba3::Weights;
use crate::model::state_layout::{StateBuf, StateLayout};
use crate::model::{DType, Dims};
use crate::options::GpuOptions;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub struct CudaModel {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) weights: Arc<Weights>,
    /// A sequence's state, with the `ssm` tensor's storage dtype (`--state-dtype`).
    pub(crate) state_layout: StateLayout,
    pub(crate) gw: GpuWeights,
    /// the scan may take f16 operands (`weights::scan_f16`)
    scan_f16: bool,
    /// a prefill's in_proj output may be f16 (`weights::proj_f16`)
    proj_f16: bool,
    pub(crate) lt: Lt,
    inner: Mutex<Inner>,
    /// Sampling on the device, and the count of passes (eager or replayed) by which the
    /// logits a sampled step left are known to be valid. Locked before `inner`.
    pub(crate) sampling: super::sample::DeviceSampling,
}

pub(crate) struct Inner {
    pub opts: GpuOptions,
    kernels: HashMap<KernelConfig, Arc<Kernels>>,
    /// The last options asked for and their kernels: every pass asks, and a
    /// `KernelConfig` is a few dozen strings to build and hash.
    last: Option<(GpuOptions, Arc<Kernels>)>,
    work: Option<Work>,
    pub graphs: Graphs,
}

impl CudaModel {
    pub fn new(weights: Arc<Weights>, ordinal: usize, state_dtype: DType) -> Result<CudaModel> {
        Self::on(Gpu::new(ordinal)?, weights, state_dtype)
    }

    /// The model on a device already opened (`Model::load` opens it while the checkpoint
    /// is read: creating the context is a good part of the start-up).
    pub fn on(gpu: Gpu, weights: Arc<Weights>, state_dtype: DType) -> Result<CudaModel> {
        let state_layout =
            crate::mixers::mamba3::state::layout(&weights.dims).with_state_dtype(state_dtype)?;
        gpu.bind()?; // it may have been opened on another thread
        let gpu = Arc::new(gpu);
        // Two threads beside the weights upload: cuBLASLt (a handle, then the kernels of a
        // short prefill's products, `Lt::warm`), and the inference kernels (from the disk
        // cache, or NVRTC). One after the other, the upload, cuBLASLt and the kernels took
        // 267–284, 116–150 and ≈ 20 ms, and the first prefill ≈ 100 ms more for cuBLASLt's
        // kernels (docs/decisions.md, "Weights upload and kernel loading").
        let opts = GpuOptions::from_env();
        let in_proj = in_proj_kind(&weights);
        let (scan_f16, proj_f16) = (scan_f16(&weights), proj_f16(&weights));
        let specs = match warm_rows()? {
            0 => Vec::new(),
            rows => {
                let w = &weights;
                prefill_gemm_specs(&w.dims, w.dtype, opts, (in_proj, proj_f16), rows)
            }
        };
        let math = scan_math(weights.dtype, scan_f16, opts);
        let kernel_cfg = kernel_config(&weights, &state_layout, math, proj_f16)?;
        let (gw, lt, kernels) = std::thread::scope(|s| {
            let lt = s.spawn(|| {
                let lt = crate::timeline::stage("cuBLASLt opened (thread)", || Lt::new(&gpu))?;
                // Only a head start: the products plan and load their kernels when first
                // used anyway, so a warm-up that fails (scratch memory, say) is no error.
                if let Err(e) = lt.warm(&gpu, 1, &specs) {
                    eprintln!("warning: cuBLASLt warm-up skipped: {e}");
                }
                Ok(lt)
            });
            let kernels = s.spawn(|| Kernels::load(&gpu, &kernel_cfg).map(Arc::new));
            let gw = crate::timeline::stage("weights uploaded", || {
                GpuWeights::upload(&gpu, &weights, in_proj)
            });
            let panicked = |what: &str| Error::Device(format!("{what} panicked"));
            let lt = lt
                .join()
                .unwrap_or_else(|_| Err(panicked("opening cuBLASLt")));
            let kernels = kernels
                .join()
                .unwrap_or_else(|_| Err(panicked("loading the kernels")));
            (gw, lt, kernels)
        });
        let (gw, lt) = (gw?, lt?);
        let m = CudaModel {
            gpu,
            weights,
            state_layout,
            gw,
            scan_f16,
            proj_f16,
            lt,
            inner: Mutex::new(Inner {
                opts,
                kernels: HashMap::new(),
                last: None,
                work: None,
                graphs: Graphs::default(),
            }),
            sampling: super::sample::DeviceSampling::new(),
        };
        // (compiled or loaded now, so that the first request is not the slow one)
        let kernels = kernels?;
        let mut inner = m.lock()?;
        inner.kernels.insert(kernel_cfg, kernels.clone());
        inner.last = Some((opts, kernels));
        drop(inner);
        crate::timeline::mark(|| "kernels ready".into());
        Ok(m)
    }

    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        self.inner.lock().map_err(|_| {
            Error::Device("the CUDA model's lock is poisoned (an earlier call panicked)".into())
        })
    }

    pub fn device_name(&self) -> String {
        self.gpu.name.clone()
    }

    pub fn dims(&self) -> Dims {
        self.weights.dims
    }

    pub fn options(&self) -> Result<GpuOptions> {
        Ok(self.lock()?.opts)
    }

    /// Change the numeric options (kernels for new ones are compiled on first use).
    /// Graphs captured under other options refuse to replay.
    pub fn set_options(&self, o: GpuOptions) -> Result<()> {
        let lanes = crate::cuda::context::MAX_LANES;
        if o.decode_lanes > lanes {
            return Err(Error::Input(format!(
                "GPU option decode_lanes: expected 0 (by the batch) to {lanes}, found {}",
                o.decode_lanes
            )));
        }
        let mut inner = self.lock()?;
        self.kernels(&mut inner, o)?;
        inner.opts = o;
        Ok(())
    }

    /// The kernels for options `o`, compiled or loaded once.
    pub(crate) fn kernels(&self, inner: &mut Inner, o: GpuOptions) -> Result<Arc<Kernels>> {
        if let Some((lo, k)) = &inner.last {
            if *lo == o {
                return Ok(k.clone());
            }
        }
        let k = self.kernels_for(inner, o)?;
        inner.last = Some((o, k.clone()));
        Ok(k)
    }

    fn kernels_for(&self, inner: &mut Inner, o: GpuOptions) -> Result<Arc<Kernels>> {
        let w = &self.weights;
        let math = scan_math(w.dtype, self.scan_f16, o);
        let cfg = kernel_config(w, &self.state_layout, math, self.proj_f16)?;
        if let Some(k) = inner.kernels.get(&cfg) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::load(&self.gpu, &cfg)?);
        inner.kernels.insert(cfg, k.clone());
        Ok(k)
    }

    pub(crate) fn pipe<'a>(&'a self, k: &'a Kernels, opts: GpuOptions) -> Pipe<'a> {
        Pipe {
            gpu: &self.gpu,
            k,
            lt: &self.lt,
            w: &self.gw,
            d: self.weights.dims,
            dtype: self.weights.dtype,
            opts,
            probe: crate::cuda::probe::enabled(),
            timed: crate::timeline::level() >= 2,
            lane: 0,
            background: false,
        }
    }

    /// How many scan blocks the GPU runs at once with the current options.
    pub(crate) fn scan_slots(&self) -> Result<usize> {
        let mut inner = self.lock()?;
        let o = inner.opts;
        Ok(self.kernels(&mut inner, o)?.scan.scan_slots)
    }

    /// Whether the kernels for the current options came from the disk cache.
    pub fn kernels_from_cache(&self) -> Result<bool> {
        let mut inner = self.lock()?;
        let o = inner.opts;
        Ok(self.kernels(&mut inner, o)?.from_cache)
    }

    /// A fresh (zero) state on the device.
    pub fn new_state(&self, layout: &StateLayout) -> Result<CudaState> {
        CudaState::zeros(&self.gpu, layout)
    }

    pub fn upload_state(&self, layout: &StateLayout, host: &StateBuf<f32>) -> Result<CudaState> {
        CudaState::from_host(&self.gpu, layout, host)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.gpu.sync()
    }

    /// The device addresses of the states' buffers (each made unique first).
    pub(crate) fn state_ptrs(&self, states: &mut [&mut CudaState]) -> Result<Vec<u64>> {
        states
            .iter_mut()
            .enumerate()
            .map(|(b, cs)| {
                if cs.is_on(&self.gpu) {
                    cs.unique_ptr()
                } else {
                    Err(Error::State(format!(
                        "state {b} is not on {} (place it on the model's device first)",
                        self.gpu.name
                    )))
                }
            })
            .collect()
    }

    /// Run each sequence from its state; returns each sequence's logits rows, flattened
    /// (as `CpuModel::forward`).
    pub fn forward(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut CudaState],
        want: LogitsWant,
    ) -> Result<Vec<Vec<f32>>> {
        let vp = self.weights.dims.vocab_padded;
        let decode = seqs.iter().all(|s| s.len() == 1);
        let logits = self.pass(seqs, states, want, |gpu, src, picked| {
            let mut logits = vec![0f32; picked * vp];
            gpu.dtoh(src, &mut logits)?;
            Ok(logits)
        })?;
        Ok(split_logits(&logits, seqs, want, vp, decode))
    }

    /// One decode step without a graph, its `[batch, vocab_padded]` logits copied into
    /// `dst` (which holds at least that many).
    pub fn decode_eager_into(
        &self,
        tokens: &[u32],
        states: &mut [&mut CudaState],
        dst: &mut [f32],
    ) -> Result<()> {
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        let n = tokens.len() * self.weights.dims.vocab_padded;
        self.pass(&seqs, states, LogitsWant::Last, |gpu, src, _| {
            gpu.dtoh(src, &mut dst[..n])
        })
    }

    /// One decode step without a graph whose logits stay on the device: `then(gpu, logits
    /// address)` runs while the work buffers are held.
    pub(crate) fn decode_eager_then<R>(
        &self,
        tokens: &[u32],
        states: &mut [&mut CudaState],
        then: impl FnOnce(u64) -> Result<R>,
    ) -> Result<R> {
        let seqs: Vec<&[u32]> = tokens.chunks(1).collect();
        self.pass(&seqs, states, LogitsWant::Last, |_, src, _| then(src))
    }

    /// Size the eager passes' work buffers for passes of up to `rows` tokens over up to
    /// `seqs` sequences now, rather than regrowing them (every buffer freed and allocated
    /// again) in the middle of serving.
    pub fn reserve_passes(&self, rows: usize, seqs: usize) -> Result<()> {
        let d = self.weights.dims;
        let caps = Caps::for_passes(rows, seqs, d.chunk_len);
        let mut inner = self.lock()?;
        if inner.work.as_ref().is_some_and(|w| w.caps.covers(&caps)) {
            return Ok(());
        }
        let c = inner.work.as_ref().map_or(caps, |w| w.caps.max(&caps));
        inner.work = None;
        inner.work = Some(Work::new(&self.gpu, &d, self.weights.dtype.size(), c)?);
        Ok(())
    }

    /// One eager pass; `read(gpu, logits address, picked rows)` fetches the logits before
    /// the work buffers are released (it must wait for the stream, as `Gpu::dtoh` does).
    fn pass<R>(
        &self,
        seqs: &[&[u32]],
        states: &mut [&mut CudaState],
        want: LogitsWant,
        read: impl FnOnce(&Gpu, u64, usize) -> Result<R>,
    ) -> Result<R> {
        let mut inner = self.lock()?;
        self.sampling.count_pass();
        let opts = inner.opts;
        let k = self.kernels(&mut inner, opts)?;
        let ptrs = self.state_ptrs(states)?;
        let d = self.weights.dims;
        let decode = seqs.iter().all(|s| s.len() == 1);
        let lay = if decode {
            Layout::decode(seqs.len(), &d)
        } else {
            let lens: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
            Layout::new(&lens, &d, k.scan.scan_slots, want, opts.batch_invariant)
        };
        let caps = Caps::of(&lay);
        let grow = inner.work.as_ref().is_none_or(|w| !w.caps.covers(&caps));
        if grow {
            // Grown by powers of two: reallocating frees and allocates every buffer, slow
            // driver calls, so a server whose batches vary settles on one size quickly.
            let c = inner
                .work
                .as_ref()
                .map_or(caps, |w| w.caps.max(&caps))
                .rounded_up();
            inner.work = None;
            inner.work = Some(Work::new(&self.gpu, &d, self.weights.dtype.size(), c)?);
            crate::timeline::mark(|| format!("work buffers allocated ({} rows)", c.rows));
        }
        let work = inner.work.as_ref().expect("allocated above");
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        self.gpu.htod(&tokens, work.tokens.ptr)?;
        self.gpu.htod(&ptrs, work.states.ptr)?;
        let pipe = self.pipe(&k, opts);
        let picked = if decode {
            pipe.decode(work, seqs.len())?;
            seqs.len()
        } else {
            work.put_layout(&self.gpu, &lay)?;
            pipe.prefill(work, &lay)?;
            lay.picked.len()
        };
        // (dtoh waits for the stream; with nothing to read, wait explicitly so that a
        // failed kernel is reported by the call that launched it)
        let out = read(&self.gpu, work.logits.ptr, picked)?;
        if picked == 0 {
            self.gpu.sync()?;
        }
        crate::timeline::mark(|| {
            let what = if decode { "decode step" } else { "prefill" };
            format!(
                "{what} of {} token(s) over {} sequence(s)",
                tokens.len(),
                seqs.len()
            )
        });
        Ok(out)
    }

    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

/// How many rows the start-up's warm-up products have (`MAMBA3_GPU_LT_WARM`, default 16; 0
/// none). A prefill of another length may need other kernels; a short prompt's first
/// prefill is the one a user waits for. It brought the first token 36–60 ms sooner
/// (docs/decisions.md, "cuBLASLt warm-up during the upload").
fn warm_rows() -> Result<usize> {
    match &crate::options::env().lt_warm {
        None => Ok(16),
        Some(v) => v.trim().parse().map_err(|_| {
            Error::Input(format!(
                "MAMBA3_GPU_LT_WARM: expected a number of rows (0: no warm-up), found {v:?}"
            ))
        }),
    }
}

/// How the prefill scan multiplies for these options (kernels/scan_tiles.cuh).
fn scan_math(dtype: DType, scan_f16: bool, o: GpuOptions) -> ScanMath {
    match (dtype, o.fast, o.tf32) {
        (DType::F32, _, true) => ScanMath::Tf32,
        (DType::F32, _, false) => ScanMath::F32,
        (_, true, _) => ScanMath::Half,
        // f16 operands: TF32's mantissa at the cost of 16 bits (docs/decisions.md, "f16 scan operands");
        // `MAMBA3_GPU_SCAN_F16=0` keeps TF32, a diagnostic for A/B runs
        (_, false, _) if scan_f16 && crate::options::env().scan_f16 => ScanMath::F16,
        (_, false, _) => ScanMath::Tf32,
    }
}

fn kernel_config(
    w: &Weights,
    state: &StateLayout,
    math: ScanMath,
    proj_f16: bool,
) -> Result<KernelConfig> {
    let cfg = KernelConfig::new(&w.config, &w.dims, w.dtype, math)?.with_state_layout(state)?;
    let cfg = if proj_f16 {
        cfg.with("PROJ_F16", "1")
    } else {
        cfg
    };
    Ok(cfg.with_embedding(w.embedding.dtype()))
}

/// Cut the picked rows' logits into per-sequence vectors as `LogitsWant` says.
pub(crate) fn split_logits(
    logits: &[f32],
    seqs: &[&[u32]],
    want: LogitsWant,
    vp: usize,
    one_row_each: bool,
) -> Vec<Vec<f32>> {
    if want == LogitsWant::None {
        return vec![Vec::new(); seqs.len()];
    }
    let mut out = Vec::with_capacity(seqs.len());
    let mut at = 0;
    for s in seqs {
        let n = if one_row_each || want == LogitsWant::Last {
            1
        } else {
            s.len()
        };
        out.push(logits[at * vp..(at + n) * vp].to_vec());
        at += n;
    }
    out
}

#[cfg(test)]
mod warm_up_tests {
    use super::super::forward::prefill_gemm_specs;
    use super::super::model::CudaModel;
    use super::super::weights::{in_proj_kind, proj_f16};
    use crate::engine::LogitsWant;
    use crate::mixers::mamba3::Weights;
    use crate::model::{Config, DType};
    use std::sync::Arc;

    /// The start-up's warm-up (`Lt::warm` over `forward::prefill_gemm_specs`) runs the very
    /// products of a 16-token prefill: that prefill makes no plan of its own.
    /// `cargo test --release --features cuda --lib warm_up -- --include-ignored`.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn warm_up_covers_a_short_prefill() {
        for (dtype, mlp) in [(DType::BF16, true), (DType::F16, false), (DType::F32, true)] {
            let mut cfg = Config::synthetic(64, 2, 16, 16, 2, 1, 300);
            // 200 rounds up to a hidden width of 256, not d_inner's 128: fc2's product is
            // then not out_proj's (which would share its plan)
            cfg.d_intermediate = if mlp { 200 } else { 0 };
            let w = Arc::new(Weights::synthetic(cfg, dtype, 3).unwrap());
            let m = CudaModel::new(w.clone(), 0, DType::F32).unwrap();
            let opts = m.options().unwrap();
            let specs =
                prefill_gemm_specs(&w.dims, dtype, opts, (in_proj_kind(&w), proj_f16(&w)), 16);
            m.lt.warm(&m.gpu, 1, &specs).unwrap();
            let warmed = m.lt.plan_count();
            let distinct: std::collections::HashSet<_> = specs.iter().collect();
            assert_eq!(distinct.len(), if mlp { 5 } else { 3 }, "{dtype:?}");
            assert_eq!(warmed, distinct.len(), "{dtype:?}");
            let prompt: Vec<u32> = (0..16).map(|t| (t * 7 + 3) % 300).collect();
            let mut state = m
                .new_state(&crate::mixers::mamba3::state::layout(&w.dims))
                .unwrap();
            let logits = m
                .forward(&[&prompt], &mut [&mut state], LogitsWant::Last)
                .unwrap();
            assert!(logits[0].iter().all(|v| v.is_finite()), "{dtype:?}");
            assert_eq!(
                m.lt.plan_count(),
                warmed,
                "{dtype:?}: the prefill made new plans"
            );
        }
    }
}
