//! The GPU forward pass: the launch sequence of a prefill (spec §4 per layer) and of a
//! decode step (spec §3.3), over buffers that are already on the device. The CPU twin is
//! `CpuModel::forward` in src/cpu/forward.rs.
//!
//! Prefill, per layer: RMSNorm → in_proj GEMM (f32 out) → `prefill_pre` → `angle_pass` →
//! `scan_states` → `scan_pass` → `scan_outputs` (gated) → out_proj GEMM adding into the
//! residual; the MLP (when present) as norm → fc1 → `swiglu_rows` → fc2 adding into the
//! residual. Decode, per layer: in_proj as a GEMV with the RMSNorm fused on its input →
//! `mixer_step` → out_proj GEMV adding into the residual (cuBLASLt instead of the GEMVs
//! for large batches).
//!
//! Precision: the residual stream, the in_proj output, per-token scalars and the states are
//! f32 in every mode. In bf16/f16 the GEMM operands are 16-bit, except the in_proj input,
//! which is split into hi + lo halves (GEMM against `[W | W]`) unless `fast` is set, and
//! the scan runs on TF32 tensor cores (16-bit ones with `fast`). See docs/benchmarks.md
//! for what each choice costs in accuracy and time.

use super::context::{Gpu, KArg};
use super::gemm::{ElemType, GemmSpec, Lt};
use super::kernels::{proj_ld, Kernels, ScanMath};
use super::weights::GpuWeights;
use super::work::{Layout, Work};
use crate::engine::GpuOptions as CudaOptions;
use crate::error::Result;
use crate::model::{DType, Dims};

/// Decode batches up to this size use the fused-norm GEMV kernels; larger ones cuBLASLt.
pub const GEMV_MAX_ROWS: usize = 16;
const GEMV_BG: usize = 4;

/// Kernel parameters of `scan_states`/`scan_outputs` (`ScanArgs` in kernels/scan.cu).
#[repr(C)]
struct ScanArgs {
    proj: u64,
    bcn: u64,
    tok: u64,
    theta: u64,
    phi0: u64,
    chunks: u64,
    segs: u64,
    b_bias: u64,
    c_bias: u64,
    d_skip: u64,
    out_norm: u64,
    sbuf: u64,
    sdecay: u64,
    y: u64,
    states: u64,
    layer: i32,
    _pad: i32,
}

impl KArg for ScanArgs {
    fn ptr(&self) -> *mut std::ffi::c_void {
        self as *const ScanArgs as *mut std::ffi::c_void
    }
}

/// Everything one forward pass reads besides its `Work`.
pub struct Pipe<'a> {
    pub gpu: &'a Gpu,
    pub k: &'a Kernels,
    pub lt: &'a Lt,
    pub w: &'a GpuWeights,
    pub d: Dims,
    pub dtype: DType,
    pub opts: CudaOptions,
}

impl Pipe<'_> {
    fn act(&self) -> ElemType {
        ElemType::of(self.dtype)
    }

    /// Whether the in_proj input goes in as hi + lo halves.
    fn split(&self) -> bool {
        self.dtype != DType::F32 && !self.opts.fast
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        rows: usize,
        n: usize,
        k: usize,
        a: u64,
        w: u64,
        d: u64,
        d_f32: bool,
        acc: bool,
    ) -> Result<()> {
        self.gemm_ld(rows, n, k, a, w, d, n, d_f32, acc)
    }

    /// [`Pipe::gemm`] with D's rows `ldd` apart.
    #[allow(clippy::too_many_arguments)]
    fn gemm_ld(
        &self,
        rows: usize,
        n: usize,
        k: usize,
        a: u64,
        w: u64,
        d: u64,
        ldd: usize,
        d_f32: bool,
        acc: bool,
    ) -> Result<()> {
        let spec = GemmSpec {
            rows,
            n,
            k,
            ldd,
            a: self.act(),
            w: self.act(),
            d: if d_f32 { ElemType::F32 } else { self.act() },
            accumulate: acc,
            tf32: self.opts.tf32,
        };
        self.lt.gemm(self.gpu, &spec, a, w, d)
    }

    fn launch(
        &self,
        k: &super::context::Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[&dyn KArg],
    ) -> Result<()> {
        self.gpu.launch(k, grid, block, smem, self.opts.pdl, args)
    }

    /// `out[r] = rmsnorm(x[idx[r] or r]) ⊙ w` for `rows` rows, as GEMM input.
    fn norm_rows(
        &self,
        x: u64,
        w: u64,
        out: u64,
        rows: usize,
        idx: u64,
        split: bool,
    ) -> Result<()> {
        let (rows_i, split_i) = (rows as i32, i32::from(split));
        self.launch(
            &self.k.rms_norm_rows,
            (rows.div_ceil(8) as u32, 1, 1),
            256,
            0,
            &[&x, &w, &out, &rows_i, &idx, &split_i],
        )
    }

    fn embed(&self, work: &Work, rows: usize) -> Result<()> {
        self.launch(
            &self.k.embed,
            (rows as u32, 1, 1),
            256,
            0,
            &[&work.tokens.ptr, &self.w.embedding.ptr, &work.res.ptr],
        )
    }

    /// The in_proj GEMM from the residual rows: norm (split or not) + cuBLASLt.
    fn in_proj_gemm(&self, work: &Work, l: usize, rows: usize) -> Result<()> {
        let (d, lw) = (&self.d, &self.w.layers[l]);
        let split = self.split();
        self.norm_rows(work.res.ptr, lw.norm.ptr, work.xin.ptr, rows, 0, split)?;
        let (w, k) = match (&lw.in_proj_split, split) {
            (Some(ws), true) => (ws.ptr, 2 * d.d_model),
            _ => (lw.in_proj.ptr, d.d_model),
        };
        self.gemm_ld(
            rows,
            d.d_in_proj,
            k,
            work.xin.ptr,
            w,
            work.proj.ptr,
            proj_ld(d),
            true,
            false,
        )
    }

    /// The MLP of layer `l` through cuBLASLt (prefill and large decode batches).
    fn mlp_gemm(&self, work: &Work, l: usize, rows: usize) -> Result<()> {
        let (d, Some(m)) = (&self.d, &self.w.layers[l].mlp) else {
            return Ok(());
        };
        let hid = d.mlp_hidden;
        self.norm_rows(work.res.ptr, m.norm.ptr, work.xin.ptr, rows, 0, false)?;
        self.gemm(
            rows,
            2 * hid,
            d.d_model,
            work.xin.ptr,
            m.fc1.ptr,
            work.vg.ptr,
            true,
            false,
        )?;
        let sw = self
            .k
            .swiglu_rows
            .as_ref()
            .expect("compiled when the model has an MLP");
        let rows_i = rows as i32;
        let blocks = (rows * hid).div_ceil(256).min(65535) as u32;
        self.launch(
            sw,
            (blocks, 1, 1),
            256,
            0,
            &[&work.vg.ptr, &work.act.ptr, &rows_i],
        )?;
        self.gemm(
            rows,
            d.d_model,
            hid,
            work.act.ptr,
            m.fc2.ptr,
            work.res.ptr,
            true,
            true,
        )
    }

    /// Final norm of the picked rows and the head: logits `[picked, vocab_padded]`.
    fn head_gemm(&self, work: &Work, picked: usize, idx: u64) -> Result<()> {
        let d = &self.d;
        self.norm_rows(
            work.res.ptr,
            self.w.norm_f.ptr,
            work.hfin.ptr,
            picked,
            idx,
            false,
        )?;
        self.gemm(
            picked,
            d.vocab_padded,
            d.d_model,
            work.hfin.ptr,
            self.w.head().ptr,
            work.logits.ptr,
            true,
            false,
        )
    }

    /// A prefill pass over `lay` (tables, tokens and state addresses already in `work`).
    pub fn prefill(&self, work: &Work, lay: &Layout) -> Result<()> {
        let d = &self.d;
        let (rows, nseg, nseq, nchunk) =
            (lay.rows, lay.segs.len(), lay.seqs.len(), lay.chunks.len());
        let h = d.nheads as u32;
        self.embed(work, rows)?;
        for (l, lw) in self.w.layers.iter().enumerate() {
            let layer = l as i32;
            self.in_proj_gemm(work, l, rows)?;
            self.launch(
                &self.k.prefill_pre,
                (nchunk as u32, 1, 1),
                256,
                self.k.pre_smem,
                &[
                    &work.proj.ptr,
                    &work.chunks.ptr,
                    &lw.b_norm.ptr,
                    &lw.c_norm.ptr,
                    &lw.dt_bias.ptr,
                    &work.bcn.ptr,
                    &work.tok.ptr,
                    &work.theta.ptr,
                    &work.csum.ptr,
                ],
            )?;
            self.launch(
                &self.k.angle_pass,
                (nseq as u32, 1, 1),
                256,
                0,
                &[
                    &work.seqs.ptr,
                    &work.csum.ptr,
                    &work.phi0.ptr,
                    &work.states.ptr,
                    &layer,
                ],
            )?;
            let args = ScanArgs {
                proj: work.proj.ptr,
                bcn: work.bcn.ptr,
                tok: work.tok.ptr,
                theta: work.theta.ptr,
                phi0: work.phi0.ptr,
                chunks: work.chunks.ptr,
                segs: work.segs.ptr,
                b_bias: lw.b_bias.ptr,
                c_bias: lw.c_bias.ptr,
                d_skip: lw.d.ptr,
                out_norm: lw.out_norm.as_ref().map_or(0, |b| b.ptr),
                sbuf: work.sbuf.ptr,
                sdecay: work.sdecay.ptr,
                y: work.y.ptr,
                states: work.states.ptr,
                layer,
                _pad: 0,
            };
            if nseg > nseq {
                self.launch(
                    &self.k.scan_states,
                    (nseg as u32, h, 1),
                    256,
                    self.k.scan_smem,
                    &[&args],
                )?;
            }
            let tiles = (d.headdim * d.d_state).div_ceil(4 * 256) as u32;
            self.launch(
                &self.k.scan_pass,
                (nseq as u32, h, tiles),
                256,
                0,
                &[
                    &work.seqs.ptr,
                    &work.chunks.ptr,
                    &work.tok.ptr,
                    &work.sbuf.ptr,
                    &work.sdecay.ptr,
                    &work.states.ptr,
                    &layer,
                ],
            )?;
            self.launch(
                &self.k.scan_outputs,
                (nseg as u32, h, 1),
                256,
                self.k.scan_smem,
                &[&args],
            )?;
            self.gemm(
                rows,
                d.d_model,
                d.d_inner,
                work.y.ptr,
                lw.out_proj.ptr,
                work.res.ptr,
                true,
                true,
            )?;
            self.mlp_gemm(work, l, rows)?;
        }
        self.head_gemm(work, lay.picked.len(), work.picked.ptr)
    }

    /// One decode step for `nb` sequences (tokens and state addresses already in `work`);
    /// logits land in `work.logits` rows `0..nb`.
    pub fn decode(&self, work: &Work, nb: usize) -> Result<()> {
        let d = &self.d;
        self.embed(work, nb)?;
        let gemv = nb <= GEMV_MAX_ROWS;
        for (l, lw) in self.w.layers.iter().enumerate() {
            let layer = l as i32;
            if gemv {
                self.gemv(
                    work.res.ptr,
                    lw.norm.ptr,
                    lw.in_proj.ptr,
                    (work.proj.ptr, proj_ld(d)),
                    nb,
                    d.d_in_proj,
                    d.d_model,
                    1,
                    false,
                )?;
            } else {
                self.in_proj_gemm(work, l, nb)?;
            }
            let (yf, ya) = if gemv {
                (work.yf.ptr, 0u64)
            } else {
                (0u64, work.y.ptr)
            };
            self.launch(
                &self.k.mixer_step,
                (d.nheads as u32, nb as u32, 1),
                256,
                0,
                &[
                    &work.proj.ptr,
                    &lw.b_norm.ptr,
                    &lw.c_norm.ptr,
                    &lw.dt_bias.ptr,
                    &lw.b_bias.ptr,
                    &lw.c_bias.ptr,
                    &lw.d.ptr,
                    &lw.out_norm.as_ref().map_or(0, |b| b.ptr),
                    &work.states.ptr,
                    &layer,
                    &yf,
                    &ya,
                ],
            )?;
            if gemv {
                self.gemv(
                    work.yf.ptr,
                    0,
                    lw.out_proj.ptr,
                    (work.res.ptr, d.d_model),
                    nb,
                    d.d_model,
                    d.d_inner,
                    0,
                    true,
                )?;
                if let Some(m) = &lw.mlp {
                    let hid = d.mlp_hidden;
                    self.gemv(
                        work.res.ptr,
                        m.norm.ptr,
                        m.fc1.ptr,
                        (work.vg.ptr, 2 * hid),
                        nb,
                        2 * hid,
                        d.d_model,
                        1,
                        false,
                    )?;
                    self.gemv(
                        work.vg.ptr,
                        0,
                        m.fc2.ptr,
                        (work.res.ptr, d.d_model),
                        nb,
                        d.d_model,
                        hid,
                        2,
                        true,
                    )?;
                }
            } else {
                self.gemm(
                    nb,
                    d.d_model,
                    d.d_inner,
                    work.y.ptr,
                    lw.out_proj.ptr,
                    work.res.ptr,
                    true,
                    true,
                )?;
                self.mlp_gemm(work, l, nb)?;
            }
        }
        if gemv {
            self.gemv(
                work.res.ptr,
                self.w.norm_f.ptr,
                self.w.head().ptr,
                (work.logits.ptr, d.vocab_padded),
                nb,
                d.vocab_padded,
                d.d_model,
                1,
                false,
            )
        } else {
            self.head_gemm(work, nb, 0)
        }
    }

    /// `out[b] (+)= transform(in[b]) · Wᵀ` (kernels/dense.cu `gemv_*`, by input width `k`).
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        input: u64,
        nw: u64,
        w: u64,
        out: (u64, usize),
        nb: usize,
        n: usize,
        k: usize,
        mode: i32,
        acc: bool,
    ) -> Result<()> {
        let (out, ldo) = (out.0, out.1 as i32);
        let d = &self.d;
        let kern = if k == d.d_model {
            &self.k.gemv_dmodel
        } else if k == d.d_inner {
            &self.k.gemv_dinner
        } else {
            self.k
                .gemv_hidden
                .as_ref()
                .expect("compiled when the model has an MLP")
        };
        let (nb_i, n_i, acc_i) = (nb as i32, n as i32, i32::from(acc));
        let smem = (GEMV_BG * k * 4) as u32;
        self.launch(
            kern,
            (n.div_ceil(8) as u32, 1, 1),
            256,
            smem,
            &[&input, &nw, &w, &out, &ldo, &nb_i, &n_i, &mode, &acc_i],
        )
    }

    /// The scan math this pipeline's kernels were built with.
    pub fn scan_math(&self) -> ScanMath {
        self.k.config.scan_math()
    }
}
