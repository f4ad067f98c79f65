//! The GPU forward pass: the launch sequence of a prefill (spec §4 per layer) and of a
//! decode step (spec §3.3), over buffers that are already on the device. The CPU twin is
//! `CpuModel::forward` in src/engine/cpu.rs.
//!
//! Prefill, per layer: RMSNorm → in_proj GEMM → `prefill_pre` → `angle_pass` →
//! `scan_states` → `scan_pass` → `scan_outputs` (gated) → out_proj GEMM adding into the
//! residual; the MLP (when present) as norm → fc1 → `swiglu_rows` → fc2 adding into the
//! residual. Decode, per layer: in_proj as a GEMV with the RMSNorm fused on its input →
//! `mixer_step` → out_proj GEMV adding into the residual (cuBLASLt instead of the GEMVs
//! for large batches).
//!
//! Precision: the residual stream, per-token scalars and the states are f32 in every mode;
//! the in_proj output too, except a 16-bit model's prefill writes it in f16 when its range
//! allows (`weights::proj_f16`: 2⁻¹¹ relative, −6 % prefill time on an H100). In bf16/f16
//! the GEMM operands are 16-bit; the in_proj input is f16
//! against an f16 copy of the weights (or, for models whose norm weights could overflow
//! f16, split into hi + lo halves against `[W | W]`, or rounded to the model dtype with
//! `fast`: see `weights::InProjInput`), and the scan runs on f16 tensor cores, whose
//! mantissa is TF32's, with its data-dependent operands scaled per chunk against f16's
//! range (kernels/scan.cu; TF32 when the B/C norm weights could overflow f16, the model's
//! dtype with `fast`). See docs/decisions.md, "Numerics of the 16-bit modes", for what each choice costs in accuracy and time.

use super::kernels::Kernels;
use super::weights::{GpuWeights, InProjInput, InProjKind};
use super::work::{Layout, Work};
use crate::cuda::context::{DevBuf, Gpu, KArg, Kernel};
use crate::cuda::gemm::{ElemType, GemmSpec, Lt};
use crate::cuda::kernels::{proj_ld, ScanMath};
use crate::cuda::probe::Region;
use crate::error::Result;
use crate::mixers::mamba3::cuda::scan::{ChunkScan, ScanArgs};
use crate::model::{DType, Dims};
use crate::options::GpuOptions as CudaOptions;

/// The in_proj GEMM's operand type, its K and the norm's output mode (`NORM_*`) for a
/// layer whose prefill input is of kind `kind` (`weights::InProjInput`).
fn in_proj_operands(
    kind: Option<InProjKind>,
    fast: bool,
    act: ElemType,
    d_model: usize,
) -> (ElemType, usize, i32) {
    match (kind, fast) {
        (Some(InProjKind::F16), _) => (ElemType::F16, d_model, NORM_F16),
        (Some(InProjKind::Split), false) => (act, 2 * d_model, NORM_SPLIT),
        _ => (act, d_model, NORM_ACT),
    }
}

/// The cuBLASLt products of a prefill of `rows` tokens that wants the last token's logits
/// (in_proj, out_proj, the MLP's two, the head), as the `Pipe` methods below make them:
/// what `Lt::warm` runs at start-up, so that the first prefill does not pay for loading
/// their kernels.
pub fn prefill_gemm_specs(
    d: &Dims,
    dtype: DType,
    opts: CudaOptions,
    (in_proj, proj_f16): (Option<InProjKind>, bool),
    rows: usize,
) -> Vec<GemmSpec> {
    let act = ElemType::of(dtype);
    let f32 = ElemType::F32;
    let (ab, k, _) = in_proj_operands(in_proj, opts.fast, act, d.d_model);
    let inv = opts.batch_invariant;
    let spec = |rows, n, k, ab, ldd, acc| {
        GemmSpec::linear(rows, n, k, ab, f32, ldd, acc, opts.tf32).invariant(inv)
    };
    let proj = if proj_f16 { ElemType::F16 } else { f32 };
    let mut specs = vec![
        GemmSpec::linear(rows, d.d_in_proj, k, ab, proj, proj_ld(d), false, opts.tf32)
            .invariant(inv),
        spec(rows, d.d_model, d.d_inner, act, d.d_model, true),
    ];
    let hid = d.mlp_hidden;
    if hid > 0 {
        specs.push(spec(rows, 2 * hid, d.d_model, act, 2 * hid, false));
        specs.push(spec(rows, d.d_model, hid, act, d.d_model, true));
    }
    specs.push(spec(
        1,
        d.vocab_padded,
        d.d_model,
        act,
        d.vocab_padded,
        false,
    ));
    specs
}

/// `rms_norm_rows` output modes (kernels/dense.cu).
const NORM_ACT: i32 = 0;
const NORM_SPLIT: i32 = 1;
const NORM_F16: i32 = 2;

/// Everything one forward pass reads besides its `Work`.
#[derive(Clone, Copy)]
pub struct Pipe<'a> {
    pub gpu: &'a Gpu,
    pub k: &'a Kernels,
    pub lt: &'a Lt,
    pub w: &'a GpuWeights,
    pub d: Dims,
    pub dtype: DType,
    pub opts: CudaOptions,
    /// check every step's output for non-finite values (`MAMBA3_GPU_DEBUG=1`)
    pub probe: bool,
    /// wait after every step and mark it on the start-up timeline (`MAMBA3_TIMELINE=2`)
    pub timed: bool,
    /// the stream this pipe launches on (0: the main one, 1 … MAX_LANES: the lanes' side
    /// streams; see `Gpu::fork_lanes`)
    pub lane: usize,
    /// launch at the least priority on a side lane (`Gpu::launch_on`)
    pub background: bool,
}

impl Pipe<'_> {
    fn act(&self) -> ElemType {
        ElemType::of(self.dtype)
    }

    /// The address `elems` elements into `buf`, a buffer of the activation dtype.
    pub(super) fn act_at(&self, buf: &DevBuf, elems: usize) -> u64 {
        buf.ptr + (elems * self.act().size()) as u64
    }

    /// With `timed` on: wait, and mark the step on the timeline. With `probe` on: wait, and
    /// check `rows × cols` values (rows `ld` apart, f32 or the activation dtype) that `what`
    /// wrote.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn look(
        &self,
        what: &str,
        layer: Option<usize>,
        ptr: u64,
        rows: usize,
        cols: usize,
        ld: usize,
        f32_values: bool,
    ) -> Result<()> {
        let dtype = if f32_values { DType::F32 } else { self.dtype };
        self.look_at(
            what,
            layer,
            Region {
                ptr,
                rows,
                cols,
                ld,
                dtype,
            },
        )
    }

    /// [`Pipe::look`] of a packed `rows × cols` matrix of `dtype`.
    fn look_typed(
        &self,
        what: &str,
        l: usize,
        ptr: u64,
        rows: usize,
        cols: usize,
        dtype: DType,
    ) -> Result<()> {
        self.look_at(
            what,
            Some(l),
            Region {
                ptr,
                rows,
                cols,
                ld: cols,
                dtype,
            },
        )
    }

    fn look_at(&self, what: &str, layer: Option<usize>, region: Region) -> Result<()> {
        if self.timed {
            self.gpu.sync()?;
            crate::timeline::mark(|| match layer {
                Some(l) => format!("  step {what} of layer {l}"),
                None => format!("  step {what}"),
            });
        }
        if !self.probe {
            return Ok(());
        }
        crate::cuda::probe::check(self.gpu, what, layer, region)
    }

    /// How the in_proj input of layer `l` is written (`rms_norm_rows`' `mode`): the weight,
    /// the input's element type and width, and the mode.
    fn in_proj_route(&self, l: usize) -> (u64, ElemType, usize, i32) {
        let lw = &self.w.layers[l];
        let kind = lw.in_proj_input.as_ref().map(InProjInput::kind);
        let (ab, k, mode) = in_proj_operands(kind, self.opts.fast, self.act(), self.d.d_model);
        let w = match (&lw.in_proj_input, mode) {
            (Some(InProjInput::F16(w) | InProjInput::Split(w)), NORM_F16 | NORM_SPLIT) => w.ptr,
            _ => lw.in_proj.ptr,
        };
        (w, ab, k, mode)
    }

    /// D (+)= A·Wᵀ with A and W in the activation type; D f32 (`d_f32`) or in that type.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
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
        let d_type = if d_f32 { ElemType::F32 } else { self.act() };
        let spec = GemmSpec::linear(rows, n, k, self.act(), d_type, n, acc, self.opts.tf32)
            .invariant(self.opts.batch_invariant);
        self.lt.gemm_on(self.gpu, self.lane, &spec, a, w, d)
    }

    /// A GEMM whose operands are of type `ab`, into rows of type `dt` `ldd` apart (no
    /// accumulation).
    #[allow(clippy::too_many_arguments)]
    fn gemm_typed(
        &self,
        rows: usize,
        n: usize,
        k: usize,
        ab: ElemType,
        a: u64,
        w: u64,
        (d, dt, ldd): (u64, ElemType, usize),
    ) -> Result<()> {
        let spec = GemmSpec::linear(rows, n, k, ab, dt, ldd, false, self.opts.tf32)
            .invariant(self.opts.batch_invariant);
        self.lt.gemm_on(self.gpu, self.lane, &spec, a, w, d)
    }

    pub(super) fn launch(
        &self,
        k: &crate::cuda::context::Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[&dyn KArg],
    ) -> Result<()> {
        self.gpu.launch_on(
            self.lane,
            self.background,
            k,
            grid,
            block,
            smem,
            self.opts.pdl,
            args,
        )
    }

    /// `out[r] = rmsnorm(x[idx[r] or r]) ⊙ w` for `rows` rows, as GEMM input written as
    /// `mode` says (`NORM_*`).
    fn norm_rows(&self, x: u64, w: u64, out: u64, rows: usize, idx: u64, mode: i32) -> Result<()> {
        let rows_i = rows as i32;
        self.launch(
            &self.k.rms_norm_rows,
            (rows.div_ceil(8) as u32, 1, 1),
            256,
            0,
            &[&x, &w, &out, &rows_i, &idx, &mode],
        )
    }

    pub(super) fn embed(&self, work: &Work, rows: usize) -> Result<()> {
        self.launch(
            &self.k.embed,
            (rows as u32, 1, 1),
            256,
            0,
            &[&work.tokens.ptr, &self.w.embedding.ptr, &work.res.ptr],
        )
    }

    /// The element type of the prefill's in_proj output (`PROJ_F16` of the kernels:
    /// `weights::proj_f16`); the decode's is always f32.
    pub(super) fn prefill_proj(&self) -> ElemType {
        if self.k.config.define("PROJ_F16") == Some("1") {
            ElemType::F16
        } else {
            ElemType::F32
        }
    }

    /// The in_proj GEMM of rows `r0 … r0 + rows` of the residual: norm (into the route's
    /// input) + cuBLASLt, into in_proj rows of type `out` (f32, or `prefill_proj`).
    pub(super) fn in_proj_gemm(
        &self,
        work: &Work,
        l: usize,
        (r0, rows): (usize, usize),
        out: ElemType,
    ) -> Result<()> {
        let (d, lw) = (&self.d, &self.w.layers[l]);
        let (w, ab, k, mode) = self.in_proj_route(l);
        let res = work.res.at::<f32>(r0 * d.d_model);
        let xin = work.xin.ptr + (r0 * k * ab.size()) as u64;
        let proj = work.proj.ptr + (r0 * proj_ld(d) * out.size()) as u64;
        self.norm_rows(res, lw.norm.ptr, xin, rows, 0, mode)?;
        let xin_dtype = if ab == ElemType::F16 && self.dtype == DType::BF16 {
            DType::F16
        } else {
            self.dtype
        };
        self.look_typed("rms_norm_rows (in_proj input)", l, xin, rows, k, xin_dtype)?;
        self.gemm_typed(rows, d.d_in_proj, k, ab, xin, w, (proj, out, proj_ld(d)))
    }

    /// The out_proj GEMM of layer `l` for rows `r0 … r0 + rows`, adding the gated mixer
    /// output into the residual.
    pub(super) fn out_proj_gemm(
        &self,
        work: &Work,
        l: usize,
        r0: usize,
        rows: usize,
    ) -> Result<()> {
        let d = &self.d;
        let w = self.w.layers[l].out_proj.ptr;
        let y = self.act_at(&work.y, r0 * d.d_inner);
        let res = work.res.at::<f32>(r0 * d.d_model);
        self.gemm(rows, d.d_model, d.d_inner, y, w, res, true, true)
    }

    /// The MLP of layer `l` through cuBLASLt (prefill and large decode batches), for rows
    /// `r0 … r0 + rows`.
    pub(super) fn mlp_gemm(&self, work: &Work, l: usize, r0: usize, rows: usize) -> Result<()> {
        let (d, Some(m)) = (&self.d, &self.w.layers[l].mlp) else {
            return Ok(());
        };
        let hid = d.mlp_hidden;
        let res = work.res.at::<f32>(r0 * d.d_model);
        let xin = self.act_at(&work.xin, r0 * d.d_model);
        let vg = work.vg.at::<f32>(r0 * 2 * hid);
        let act = self.act_at(&work.act, r0 * hid);
        self.norm_rows(res, m.norm.ptr, xin, rows, 0, NORM_ACT)?;
        self.gemm(rows, 2 * hid, d.d_model, xin, m.fc1.ptr, vg, true, false)?;
        let sw = self
            .k
            .swiglu_rows
            .as_ref()
            .expect("compiled when the model has an MLP");
        let rows_i = rows as i32;
        let blocks = (rows * hid).div_ceil(256).min(65535) as u32;
        self.launch(sw, (blocks, 1, 1), 256, 0, &[&vg, &act, &rows_i])?;
        self.gemm(rows, d.d_model, hid, act, m.fc2.ptr, res, true, true)
    }

    /// Final norm of the picked rows and the head: logits `[picked, vocab_padded]`.
    pub(super) fn head_gemm(&self, work: &Work, picked: usize, idx: u64) -> Result<()> {
        let d = &self.d;
        self.norm_rows(
            work.res.ptr,
            self.w.norm_f.ptr,
            work.hfin.ptr,
            picked,
            idx,
            NORM_ACT,
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

    /// A prefill pass over `lay` (tables, tokens and state addresses already in `work`):
    /// the launch sequence of the module doc. Each step checks what it wrote when the
    /// debug probe or the step timeline is on (`Pipe::look`).
    pub fn prefill(&self, work: &Work, lay: &Layout) -> Result<()> {
        self.prefill_embed(work, lay.rows)?;
        for l in 0..self.w.layers.len() {
            self.prefill_in_proj(work, l, lay.rows)?;
            self.prefill_mixer(work, l, lay)?;
            self.prefill_out_proj(work, l, lay.rows)?;
            self.prefill_mlp(work, l, lay.rows)?;
        }
        self.prefill_head(work, lay.picked.len())
    }

    fn prefill_embed(&self, work: &Work, rows: usize) -> Result<()> {
        let dm = self.d.d_model;
        self.embed(work, rows)?;
        self.look("embed", None, work.res.ptr, rows, dm, dm, true)
    }

    /// RMSNorm and the in_proj GEMM of every row (f32 rows, or f16 where `prefill_proj`).
    fn prefill_in_proj(&self, work: &Work, l: usize, rows: usize) -> Result<()> {
        let d = &self.d;
        let proj_type = self.prefill_proj();
        self.in_proj_gemm(work, l, (0, rows), proj_type)?;
        let dtype = if proj_type == ElemType::F16 {
            DType::F16
        } else {
            DType::F32
        };
        let (ptr, cols, ld) = (work.proj.ptr, d.d_in_proj, proj_ld(d));
        let region = Region {
            ptr,
            rows,
            cols,
            ld,
            dtype,
        };
        self.look_at("in_proj", Some(l), region)
    }

    /// The chunked mixer of layer `l` (the mixer's launches: `mixers::mamba3::cuda::scan`):
    /// per-token preprocessing, then the scan, which writes the gated output and the states.
    fn prefill_mixer(&self, work: &Work, l: usize, lay: &Layout) -> Result<()> {
        let (d, lw, rows) = (&self.d, &self.w.layers[l], lay.rows);
        let mixer = ChunkScan {
            args: ScanArgs {
                proj: work.proj.ptr,
                bcn: work.bcn.ptr,
                tok: work.tok.ptr,
                theta: work.theta.ptr,
                phi0: work.phi0.ptr,
                chunks: work.chunks.ptr,
                segs: work.segs.ptr,
                order: work.order.ptr,
                b_bias: lw.b_bias.ptr,
                c_bias: lw.c_bias.ptr,
                d_skip: lw.d.ptr,
                out_norm: lw.out_norm.as_ref().map_or(0, |b| b.ptr),
                sbuf: work.sbuf.ptr,
                sdecay: work.sdecay.ptr,
                y: work.y.ptr,
                y_pre: 0,
                states: work.states.ptr,
                layer: l as i32,
                qk: lw.scan_qk,
                heads_fastest: 0, // set by `launches`
            },
            seqs: work.seqs.ptr,
            csum: work.csum.ptr,
            b_norm: lw.b_norm.ptr,
            c_norm: lw.c_norm.ptr,
            dt_bias: lw.dt_bias.ptr,
            nchunk: lay.chunks.len(),
            nseg: lay.segs.len(),
            nseq: lay.seqs.len(),
        };
        let launch = |k: &Kernel, grid, threads, smem, args: &[&dyn KArg]| {
            self.launch(k, grid, threads, smem, args)
        };
        mixer.pre(d, &self.k.scan, &launch)?;
        let (bcw, tw) = (2 * d.ngroups * d.d_state, 4 * d.nheads);
        let (bcn, tok) = (work.bcn.ptr, work.tok.ptr);
        self.look("prefill_pre (B̄, C̄)", Some(l), bcn, rows, bcw, bcw, true)?;
        self.look(
            "prefill_pre (token scalars)",
            Some(l),
            tok,
            rows,
            tw,
            tw,
            true,
        )?;
        mixer.scan(d, &self.k.scan, &launch)?;
        let di = d.d_inner;
        self.look("scan_outputs", Some(l), work.y.ptr, rows, di, di, false)
    }

    /// out_proj, adding into the residual.
    fn prefill_out_proj(&self, work: &Work, l: usize, rows: usize) -> Result<()> {
        let dm = self.d.d_model;
        self.out_proj_gemm(work, l, 0, rows)?;
        self.look("out_proj", Some(l), work.res.ptr, rows, dm, dm, true)
    }

    /// The MLP when the layer has one: norm, fc1, SwiGLU, fc2 adding into the residual.
    fn prefill_mlp(&self, work: &Work, l: usize, rows: usize) -> Result<()> {
        self.mlp_gemm(work, l, 0, rows)?;
        if self.w.layers[l].mlp.is_none() {
            return Ok(());
        }
        let (dm, hd) = (self.d.d_model, self.d.mlp_hidden);
        self.look("fc1", Some(l), work.vg.ptr, rows, 2 * hd, 2 * hd, true)?;
        self.look("swiglu_rows", Some(l), work.act.ptr, rows, hd, hd, false)?;
        self.look("fc2", Some(l), work.res.ptr, rows, dm, dm, true)
    }

    /// The final norm and the head on the picked rows.
    fn prefill_head(&self, work: &Work, picked: usize) -> Result<()> {
        let (dm, vp) = (self.d.d_model, self.d.vocab_padded);
        self.head_gemm(work, picked, work.picked.ptr)?;
        self.look("final norm", None, work.hfin.ptr, picked, dm, dm, false)?;
        self.look("head", None, work.logits.ptr, picked, vp, vp, true)
    }

    /// The scan math this pipeline's kernels were built with.
    pub fn scan_math(&self) -> ScanMath {
        self.k.config.scan_math()
    }
}
