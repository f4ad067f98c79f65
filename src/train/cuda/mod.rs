//! Training on the GPU: the same model, loss and AdamW as the CPU trainer (src/train),
//! with the parameters, their gradients and AdamW's moments resident on the device.
//!
//! - f32: every GEMM and the scan in exact f32 (checked against the CPU gradients);
//! - bf16 / f16 mixed precision: f32 master weights, moments and gradients; each step the
//!   matrices are rounded to the 16-bit type for the GEMMs, whose activation operands are
//!   16-bit too (f32 accumulation); the scan's products run on TF32 tensor cores; the
//!   residual stream, the in_proj output, the states and every reduction stay f32.
//!
//! A step is deterministic — fixed GEMM algorithms without atomic reductions, fixed-order
//! sums everywhere — so two runs from the same seed give the same weights bit for bit.
//!
//! - `kernels`: the training program (forward, backward, optimiser kernels);
//! - `flat`: where each tensor lives in the flat parameter, gradient and moment buffers;
//! - `acts`: the activations kept for the backward and the backward's scratch;
//! - `pass`: the forward and backward launch sequences;
//! - `replica`: the trainer as one rank of data-parallel training; `nccl`: the ranks'
//!   all-reduce.
//! - `mimo`: the MIMO mixer's kernels, buffers and launches (`ssm_cfg.is_mimo`), in the
//!   place of the SISO scan.

mod acts;
pub mod flat;
mod kernels;
mod mimo;
pub mod nccl;
mod pass;
pub mod replica;

use crate::cuda::context::{DevBuf, Gpu};
use crate::cuda::gemm::{ElemType, Lt};
use crate::cuda::kernels::{KernelConfig, ScanMath};
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::{param_dims, validate_trainable, Params};
use crate::model::{Config, DType, Dims};
use crate::train::optim::AdamW;
use crate::train::ready::{GradReady, NoHook, Stage};
use crate::train::{Backend, Batch};
use acts::Acts;
use flat::{Addrs, FlatLayout};
use kernels::TrainKernels;
use mimo::{MimoActs, MimoTrain};
use std::sync::Arc;

pub struct CudaTrainer {
    gpu: Arc<Gpu>,
    lt: Lt,
    k: TrainKernels,
    d: Dims,
    config: Config,
    dtype: DType,
    act: ElemType,
    /// a zero-valued host copy that fixes the tensor order and shapes
    shape: Params<f32>,
    flat: FlatLayout,
    params: DevBuf,
    grads: DevBuf,
    m: DevBuf,
    v: DevBuf,
    /// 16-bit copies of the matrices for the GEMMs (mixed precision): a flat buffer in the
    /// same layout, only the matrices' spans written
    half: Option<DevBuf>,
    acts: Option<Acts>,
    /// the MIMO mixer's kernels and buffers (a MIMO model only)
    mimo: Option<MimoTrain>,
    mimo_acts: Option<MimoActs>,
    norm_part: DevBuf,
    norm: DevBuf,
    /// the embedding gradient's table: {token, first, count} per distinct token, and the
    /// rows of each, grouped
    groups: DevBuf,
    rows_of: DevBuf,
    n_groups: usize,
    /// whether the device holds the run's parameters, and its moments
    params_here: bool,
    moments_here: bool,
}

/// Tensors of the GEMMs (rounded to 16 bits in mixed precision).
fn is_matrix(name: &str) -> bool {
    crate::mixers::mamba3::params::decays(name)
}

impl CudaTrainer {
    /// A trainer for `config` on CUDA device `ordinal`, in f32 or 16-bit mixed precision.
    pub fn new(config: &Config, dtype: DType, ordinal: usize) -> Result<CudaTrainer> {
        validate_trainable(config)?;
        // `d` has MIMO's in_proj width for a MIMO model; the shared kernels are compiled
        // with the SISO sizes, which are the same everywhere else.
        let d = param_dims(config);
        if !d.headdim.is_multiple_of(4) {
            return Err(Error::Device(format!(
                "GPU training needs headdim to be a multiple of 4; this model has {}",
                d.headdim
            )));
        }
        let (act, scan) = match dtype {
            DType::F32 => (ElemType::F32, ScanMath::F32),
            DType::BF16 => (ElemType::BF16, ScanMath::Tf32),
            DType::F16 => (ElemType::F16, ScanMath::Tf32),
            DType::F64 => {
                return Err(Error::Device(
                    "GPU training runs in f32 or bf16/f16 mixed precision, not f64".into(),
                ))
            }
        };
        let gpu = Arc::new(Gpu::new(ordinal)?);
        let kc = KernelConfig::new(config, &config.dims(), dtype, scan)?.with_embedding(DType::F32);
        let k = TrainKernels::load(&gpu, &kc)?;
        let mimo = if config.ssm_cfg.is_mimo {
            Some(MimoTrain::load(&gpu, config)?)
        } else {
            None
        };
        let lt = Lt::new(&gpu)?;
        let shape = Params::<f32>::zeros(config);
        let flat = FlatLayout::new(&shape);
        // zeroed: the alignment gaps between tensors stay zero
        let f = |n: usize| -> Result<DevBuf> {
            let b = gpu.alloc::<f32>(n.max(1))?;
            gpu.zero(b.ptr, b.bytes)?;
            Ok(b)
        };
        let norm_blocks = flat.len.div_ceil(NORM_PER_BLOCK);
        Ok(CudaTrainer {
            params: f(flat.len)?,
            grads: f(flat.len)?,
            m: f(flat.len)?,
            v: f(flat.len)?,
            half: if dtype == DType::F32 {
                None
            } else {
                Some(gpu.alloc::<u16>(flat.len)?)
            },
            acts: None,
            mimo,
            mimo_acts: None,
            norm_part: gpu.alloc::<f64>(norm_blocks)?,
            norm: gpu.alloc::<f64>(1)?,
            groups: gpu.alloc::<[i32; 4]>(1)?,
            rows_of: gpu.alloc::<i32>(1)?,
            n_groups: 0,
            params_here: false,
            moments_here: false,
            gpu,
            lt,
            k,
            d,
            config: config.clone(),
            dtype,
            act,
            shape,
            flat,
        })
    }

    pub fn device_name(&self) -> String {
        self.gpu.name.clone()
    }

    /// The MIMO kernels and the current shape's MIMO buffers (a MIMO model, prepared).
    fn mimo_parts(&self) -> (&MimoTrain, &MimoActs) {
        match (&self.mimo, &self.mimo_acts) {
            (Some(m), Some(ma)) => (m, ma),
            _ => unreachable!("MIMO launches run only for a MIMO model after `prepare`"),
        }
    }

    /// Addresses into one of the f32 flat buffers.
    fn addrs(&self, base: u64) -> Addrs {
        self.flat.addrs(&self.shape, base, 4)
    }

    /// The weights the GEMMs read: the 16-bit copies, or the master weights.
    fn gemm_weights(&self) -> Addrs {
        match &self.half {
            Some(h) => self.flat.addrs(&self.shape, h.ptr, 2),
            None => self.addrs(self.params.ptr),
        }
    }

    fn check_config(&self, p: &Params<f32>) -> Result<()> {
        if p.config != self.config {
            return Err(Error::input(
                "the parameters belong to another model configuration than this GPU trainer's",
            ));
        }
        p.check()
    }

    /// Put `p` on the device (and refresh the 16-bit copies).
    fn upload_params(&mut self, p: &Params<f32>) -> Result<()> {
        self.check_config(p)?;
        for ((_, t), &(off, _)) in p.tensors().iter().zip(&self.flat.spans) {
            self.gpu.htod(t, self.params.at::<f32>(off))?;
        }
        self.refresh_half()?;
        self.params_here = true;
        Ok(())
    }

    fn upload_moments(&mut self, opt: &AdamW) -> Result<()> {
        for (buf, host) in [(&self.m, &opt.m), (&self.v, &opt.v)] {
            for ((_, t), &(off, _)) in host.tensors().iter().zip(&self.flat.spans) {
                self.gpu.htod(t, buf.at::<f32>(off))?;
            }
        }
        self.moments_here = true;
        Ok(())
    }

    fn download(&self, buf: &DevBuf, into: &mut Params<f32>) -> Result<()> {
        for (t, &(off, _)) in into.tensors_mut().into_iter().zip(&self.flat.spans) {
            self.gpu.dtoh(buf.at::<f32>(off), t)?;
        }
        Ok(())
    }

    /// Round the master matrices into the 16-bit copies.
    fn refresh_half(&self) -> Result<()> {
        let Some(half) = &self.half else {
            return Ok(());
        };
        for ((name, _), &(off, len)) in self.shape.tensors().iter().zip(&self.flat.spans) {
            if !is_matrix(name) {
                continue;
            }
            let (src, dst) = (self.params.at::<f32>(off), half.at::<u16>(off));
            let (one, len_i) = (1i32, len as i32);
            let blocks = len.div_ceil(256).min(65535) as u32;
            // one row of `len` elements
            self.gpu.launch(
                &self.k.cast_rows,
                (blocks, 1, 1),
                256,
                0,
                false,
                &[&src, &len_i, &dst, &len_i, &one, &len_i],
            )?;
        }
        Ok(())
    }

    /// Activations for `batch`'s shape; tokens, targets and the embedding-gradient table
    /// uploaded.
    fn prepare(&mut self, batch: &Batch) -> Result<()> {
        let d = &self.d;
        crate::train::model::check_batch(d, batch)?;
        let same = self
            .acts
            .as_ref()
            .is_some_and(|a| a.batch == batch.batch && a.seq_len == batch.seq_len);
        if !same {
            self.acts = None;
            let act = self.act.size();
            self.mimo_acts = None;
            self.acts = Some(Acts::new(&self.gpu, d, act, batch.batch, batch.seq_len)?);
            if let Some(m) = &self.mimo {
                let ma = MimoActs::new(&self.gpu, m, batch.batch, batch.seq_len)?;
                self.mimo_acts = Some(ma);
            }
            let rows = batch.tokens();
            self.groups = self.gpu.alloc::<[i32; 4]>(rows)?;
            self.rows_of = self.gpu.alloc::<i32>(rows)?;
        }
        let a = self.acts.as_ref().expect("allocated above");
        self.gpu.htod(&batch.inputs, a.tokens.ptr)?;
        self.gpu.htod(&batch.targets, a.targets.ptr)?;
        // Rows of each distinct token, in row order (the embedding gradient's sums).
        let mut order: Vec<i32> = (0..batch.tokens() as i32).collect();
        order.sort_by_key(|&r| (batch.inputs[r as usize], r));
        let mut groups: Vec<[i32; 4]> = Vec::new();
        for (i, &r) in order.iter().enumerate() {
            let t = batch.inputs[r as usize] as i32;
            match groups.last_mut() {
                Some(g) if g[0] == t => g[2] += 1,
                _ => groups.push([t, i as i32, 1, 0]),
            }
        }
        self.gpu.htod(&groups, self.groups.ptr)?;
        self.gpu.htod(&order, self.rows_of.ptr)?;
        self.n_groups = groups.len();
        Ok(())
    }

    /// Forward (and with `grad`, backward into the gradient buffer, telling the hook after
    /// each stage: `crate::train::ready`) of one batch; the mean loss.
    fn run(&mut self, batch: &Batch, grad: Option<&mut dyn GradReady<()>>) -> Result<f64> {
        self.prepare(batch)?;
        let a = self.acts.as_ref().expect("prepared");
        let (p, gw, g) = (
            self.addrs(self.params.ptr),
            self.gemm_weights(),
            self.addrs(self.grads.ptr),
        );
        self.forward(a, &p, &gw)?;
        if let Some(ready) = grad {
            self.backward(a, &p, &gw, &g, ready)?;
            let groups = self.n_groups as u32;
            self.gpu.launch(
                &self.k.embed_bwd,
                (groups, 1, 1),
                256,
                0,
                false,
                &[
                    &self.groups.ptr,
                    &self.rows_of.ptr,
                    &a.dres.ptr,
                    &g.embedding,
                ],
            )?;
            ready.ready(Stage::Embedding, &mut ())?;
        }
        let mut losses = vec![0f32; a.rows];
        self.gpu.dtoh(a.losses.ptr, &mut losses)?;
        Ok(losses.iter().map(|&l| l as f64).sum::<f64>() / a.rows as f64)
    }

    /// Zero the gradient buffer and add the gradient of each batch's mean loss; the sum of
    /// those losses.
    fn accumulate(&mut self, batches: &[Batch]) -> Result<f64> {
        self.zero_grads()?;
        let mut loss = 0.0;
        for b in batches {
            loss += self.run(b, Some(&mut NoHook))?;
        }
        Ok(loss)
    }

    fn zero_grads(&self) -> Result<()> {
        self.gpu.zero(self.grads.ptr, self.flat.len * 4)
    }

    /// Global norm of the gradient times `scale`, then AdamW with clipping to `clip`;
    /// returns the norm.
    fn update(&mut self, opt: &mut AdamW, scale: f32, clip: f64, lr: f64) -> Result<f64> {
        let n = self.flat.len as u64;
        let parts = self.flat.len.div_ceil(NORM_PER_BLOCK);
        self.gpu.launch(
            &self.k.sumsq_part,
            (parts as u32, 1, 1),
            256,
            0,
            false,
            &[&self.grads.ptr, &n, &scale, &self.norm_part.ptr],
        )?;
        let parts_i = parts as i32;
        self.gpu.launch(
            &self.k.sumsq_final,
            (1, 1, 1),
            32,
            0,
            false,
            &[&self.norm_part.ptr, &parts_i, &self.norm.ptr],
        )?;
        let k = opt.next_step(lr);
        let max_norm = clip as f32;
        let n_decay = self.flat.n_decay as u64;
        let blocks = self.flat.len.div_ceil(256).min(4096) as u32;
        self.gpu.launch(
            &self.k.adamw,
            (blocks, 1, 1),
            256,
            0,
            false,
            &[
                &self.params.ptr,
                &self.grads.ptr,
                &self.m.ptr,
                &self.v.ptr,
                &n,
                &n_decay,
                &self.norm.ptr,
                &scale,
                &max_norm,
                &k.beta1,
                &k.beta2,
                &k.step_size,
                &k.bc2_sqrt,
                &k.eps,
                &k.decay,
            ],
        )?;
        self.refresh_half()?;
        let mut norm = [0f64];
        self.gpu.dtoh(self.norm.ptr, &mut norm)?;
        Ok(norm[0])
    }

    /// The gradient of the mean loss of `batch` at `params` (f32), and the loss: for
    /// checks against the CPU. Makes `params` the device's parameters.
    pub fn gradient(&mut self, params: &Params<f32>, batch: &Batch) -> Result<(f64, Params<f32>)> {
        self.upload_params(params)?;
        self.moments_here = false;
        self.zero_grads()?;
        let loss = self.run(batch, Some(&mut NoHook))?;
        let mut g = Params::zeros(&self.config);
        self.download(&self.grads, &mut g)?;
        Ok((loss, g))
    }
}

/// The factor of a gradient summed over `accum` micro-batches.
fn grad_scale(accum: usize) -> f32 {
    if accum > 1 {
        1.0 / accum as f32
    } else {
        1.0
    }
}

/// Gradient elements per block of the norm's first pass (`NORM_PER_BLOCK` in train.cu).
const NORM_PER_BLOCK: usize = 256 * 64;

impl Backend for CudaTrainer {
    fn name(&self) -> String {
        format!("{} ({:?})", self.gpu.name, self.dtype)
    }

    fn loss_and_grad(
        &mut self,
        params: &Params<f32>,
        batch: &Batch,
        grad: &mut Params<f32>,
    ) -> Result<f64> {
        let (loss, g) = self.gradient(params, batch)?;
        for (a, (_, b)) in grad.tensors_mut().into_iter().zip(g.tensors()) {
            a.iter_mut().zip(b).for_each(|(x, &y)| *x += y);
        }
        Ok(loss)
    }

    fn loss(&mut self, params: &Params<f32>, batch: &Batch) -> Result<f64> {
        if !self.params_here {
            self.upload_params(params)?;
        }
        self.run(batch, None)
    }

    fn step(
        &mut self,
        params: &mut Params<f32>,
        opt: &mut AdamW,
        batches: &[Batch],
        clip: f64,
        lr: f64,
    ) -> Result<(f64, f64)> {
        if batches.is_empty() {
            return Err(Error::input("an optimiser step needs at least one batch"));
        }
        if !self.params_here {
            self.upload_params(params)?;
        }
        if !self.moments_here {
            self.upload_moments(opt)?;
        }
        let loss = self.accumulate(batches)?;
        let accum = batches.len();
        let norm = self.update(opt, grad_scale(accum), clip, lr)?;
        Ok((loss / accum as f64, norm))
    }

    fn sync(&mut self, params: &mut Params<f32>, opt: &mut AdamW) -> Result<()> {
        if self.params_here {
            self.download(&self.params, params)?;
        }
        if self.moments_here {
            self.download(&self.m, &mut opt.m)?;
            self.download(&self.v, &mut opt.v)?;
        }
        Ok(())
    }
}
