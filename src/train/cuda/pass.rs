//! The launch sequences of a training step on the GPU: the forward that keeps its
//! activations (the inference prefill's kernels, one chunk per scan segment) and the
//! backward, layer by layer in reverse, telling a `GradReady` hook as each stage's
//! gradients are queued (data-parallel overlap). CPU twin: `loss_and_grad` in
//! src/train/model.rs; the order of the steps below is that function's.

use super::acts::{Acts, COLSUM_ROWS};
use super::flat::{Addrs, LayerAddrs};
use super::CudaTrainer;
use crate::cuda::context::{KArg, Kernel};
use crate::cuda::gemm::{ElemType, GemmOp, GemmSpec};
use crate::cuda::kernels::proj_ld;
use crate::error::Result;
use crate::mixers::mamba3::cuda::scan::{ChunkScan, ScanArgs};
use crate::train::ready::{GradReady, Stage};

/// Kernel parameters of `scan_bwd` (`ScanBwdArgs` in kernels/scan_bwd.cu).
#[repr(C)]
struct ScanBwdArgs {
    proj: u64,
    bcn: u64,
    tok: u64,
    theta: u64,
    phi0: u64,
    chunks: u64,
    seqs: u64,
    b_bias: u64,
    c_bias: u64,
    d_skip: u64,
    sbuf: u64,
    dy: u64,
    dproj: u64,
    dq: u64,
    dk: u64,
    dphi: u64,
    tokg: u64,
    dd_part: u64,
}

impl ScanBwdArgs {
    /// The backward of the scan that read `f` in the forward: its buffers and weights, the
    /// sequence table and the gradients of `a`.
    fn new(f: &ScanArgs, a: &Acts) -> ScanBwdArgs {
        ScanBwdArgs {
            proj: f.proj,
            bcn: f.bcn,
            tok: f.tok,
            theta: f.theta,
            phi0: f.phi0,
            chunks: f.chunks,
            seqs: a.seqs.ptr,
            b_bias: f.b_bias,
            c_bias: f.c_bias,
            d_skip: f.d_skip,
            sbuf: f.sbuf,
            dy: a.dy.ptr,
            dproj: a.dproj.ptr,
            dq: a.dq.ptr,
            dk: a.dk.ptr,
            dphi: a.dphi.ptr,
            tokg: a.tokg.ptr,
            dd_part: a.dd_part.ptr,
        }
    }
}

impl KArg for ScanBwdArgs {
    fn ptr(&self) -> *mut std::ffi::c_void {
        self as *const ScanBwdArgs as *mut std::ffi::c_void
    }
}

/// A matrix operand: device address and row stride (0: packed).
type Mat = (u64, usize);

impl CudaTrainer {
    pub(super) fn launch(
        &self,
        k: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[&dyn KArg],
    ) -> Result<()> {
        // No programmatic dependent launch: the training kernels read what the previous
        // launch wrote from their first instruction.
        self.gpu.launch(k, grid, block, smem, false, args)
    }

    /// A GEMM of `op` (src/cuda/gemm.rs) with operands in the activation type and an f32
    /// (or activation-type) result.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        op: GemmOp,
        rows: usize,
        n: usize,
        k: usize,
        a: Mat,
        w: Mat,
        d: Mat,
        acc: bool,
    ) -> Result<()> {
        let spec = GemmSpec {
            op,
            rows,
            n,
            k,
            ldd: if d.1 == 0 { n } else { d.1 },
            lda: a.1,
            ldw: w.1,
            a: self.act,
            w: self.act,
            d: ElemType::F32,
            accumulate: acc,
            tf32: false,
            batch_invariant: false,
        };
        self.lt.gemm(&self.gpu, &spec, a.0, w.0, d.0)
    }

    /// The backward of `y = x·Wᵀ` (`x`: `rows × n_in`, W: `n_out × n_in`) from `dy`:
    /// dW += dyᵀ·x into `dw`, and dx = dy·W into `dx`.
    #[allow(clippy::too_many_arguments)]
    fn linear_bwd(
        &self,
        rows: usize,
        n_in: usize,
        n_out: usize,
        dy: Mat,
        x: u64,
        w: u64,
        dw: u64,
        dx: u64,
    ) -> Result<()> {
        self.gemm(GemmOp::Dw, n_out, n_in, rows, dy, (x, 0), (dw, 0), true)?;
        self.gemm(GemmOp::Dx, rows, n_in, n_out, dy, (w, 0), (dx, 0), false)
    }

    fn norm_rows(&self, x: u64, w: u64, out: u64, rows: usize) -> Result<()> {
        let (rows_i, idx, mode) = (rows as i32, 0u64, 0i32);
        self.launch(
            &self.k.rms_norm_rows,
            (rows.div_ceil(8) as u32, 1, 1),
            256,
            0,
            &[&x, &w, &out, &rows_i, &idx, &mode],
        )
    }

    /// `dx (+)= ∂rmsnorm(x; w)ᵀ·dout`, and the weight's gradient added into `dw`.
    #[allow(clippy::too_many_arguments)]
    fn norm_rows_bwd(
        &self,
        a: &Acts,
        x: u64,
        w: u64,
        dout: u64,
        dx: u64,
        dw: u64,
        accumulate: bool,
    ) -> Result<()> {
        let (rows_i, acc) = (a.rows as i32, i32::from(accumulate));
        self.launch(
            &self.k.rms_norm_bwd_rows,
            (a.rows.div_ceil(8) as u32, 1, 1),
            256,
            0,
            &[&x, &w, &dout, &dx, &a.contrib.ptr, &rows_i, &acc],
        )?;
        self.col_sum(a, a.contrib.ptr, a.rows, self.d.d_model, self.d.d_model, dw)
    }

    /// `dst[c] += Σ_r src[r·ld + c]`, in a fixed order.
    pub(super) fn col_sum(
        &self,
        a: &Acts,
        src: u64,
        rows: usize,
        cols: usize,
        ld: usize,
        dst: u64,
    ) -> Result<()> {
        self.col_sum_with(a.colsum.ptr, src, rows, cols, ld, dst)
    }

    /// [`Self::col_sum`] with its partials in `part` (`rows.div_ceil(COLSUM_ROWS)·cols`
    /// floats).
    pub(super) fn col_sum_with(
        &self,
        part: u64,
        src: u64,
        rows: usize,
        cols: usize,
        ld: usize,
        dst: u64,
    ) -> Result<()> {
        let parts = rows.div_ceil(COLSUM_ROWS);
        let (rows_i, cols_i, ld_i, parts_i, acc) =
            (rows as i32, cols as i32, ld as i32, parts as i32, 1i32);
        let tiles = cols.div_ceil(128) as u32;
        self.launch(
            &self.k.col_sum_part,
            (tiles, parts as u32, 1),
            128,
            0,
            &[&src, &rows_i, &cols_i, &ld_i, &part],
        )?;
        self.launch(
            &self.k.col_sum_final,
            (tiles, 1, 1),
            128,
            0,
            &[&part, &parts_i, &cols_i, &dst, &acc],
        )
    }

    /// `src` (f32, rows `lds` apart) as a 16-bit GEMM operand in `a.dact16` (packed);
    /// f32 training uses `src` as it is.
    fn operand(&self, a: &Acts, src: u64, lds: usize, rows: usize, cols: usize) -> Result<Mat> {
        if self.act == ElemType::F32 {
            return Ok((src, lds));
        }
        let (lds_i, ldd_i, rows_i, cols_i) = (lds as i32, cols as i32, rows as i32, cols as i32);
        let blocks = (rows * cols).div_ceil(256).min(65535) as u32;
        self.launch(
            &self.k.cast_rows,
            (blocks, 1, 1),
            256,
            0,
            &[&src, &lds_i, &a.dact16.ptr, &ldd_i, &rows_i, &cols_i],
        )?;
        Ok((a.dact16.ptr, 0))
    }

    /// Layer `l`'s chunked mixer over the batch in `a` with parameters `lw`: the forward
    /// runs it, the backward reads the same buffers back.
    fn layer_scan(&self, a: &Acts, l: usize, lw: &LayerAddrs) -> ChunkScan {
        let la = &a.layers[l];
        ChunkScan {
            args: ScanArgs {
                proj: la.proj.ptr,
                bcn: la.bcn.ptr,
                tok: la.tok.ptr,
                theta: la.theta.ptr,
                phi0: la.phi0.ptr,
                chunks: a.chunks.ptr,
                segs: a.segs.ptr,
                order: a.order.ptr,
                b_bias: lw.b_bias,
                c_bias: lw.c_bias,
                d_skip: lw.d,
                out_norm: lw.out_norm.unwrap_or(0),
                sbuf: la.sbuf.ptr,
                sdecay: a.sdecay.ptr,
                y: la.o.ptr,
                y_pre: la.y_pre.ptr,
                states: a.state_ptrs.ptr,
                layer: l as i32,
                qk: 0.0,          // the TF32 scan does not scale its operands
                heads_fastest: 0, // set by `launches`
            },
            seqs: a.seqs.ptr,
            csum: a.csum.ptr,
            b_norm: lw.b_norm,
            c_norm: lw.c_norm,
            dt_bias: lw.dt_bias,
            nchunk: a.layout.chunks.len(),
            nseg: a.layout.segs.len(),
            nseq: a.layout.seqs.len(),
        }
    }

    /// The forward of the batch in `a` (tokens and targets uploaded) with parameters `p`
    /// (master, f32) and GEMM weights `gw`; leaves the per-row losses and dlogits.
    pub(super) fn forward(&self, a: &Acts, p: &Addrs, gw: &Addrs) -> Result<()> {
        let d = &self.d;
        let (rows, dm, di) = (a.rows, d.d_model, d.d_inner);
        self.gpu.zero(a.states.ptr, a.states.bytes)?;
        self.launch(
            &self.k.embed,
            (rows as u32, 1, 1),
            256,
            0,
            &[&a.tokens.ptr, &p.embedding, &a.res.ptr],
        )?;
        for (l, (la, lw)) in a.layers.iter().zip(&p.layers).enumerate() {
            self.gpu.dtod(a.res.ptr, la.r_in.ptr, rows * dm * 4)?;
            self.norm_rows(a.res.ptr, lw.norm, la.xin.ptr, rows)?;
            let w_in = gw.layers[l].in_proj;
            self.gemm(
                GemmOp::Linear,
                rows,
                d.d_in_proj,
                dm,
                (la.xin.ptr, 0),
                (w_in, 0),
                (la.proj.ptr, proj_ld(d)),
                false,
            )?;
            if self.mimo.is_some() {
                self.mimo_forward(a, l, lw)?;
            } else {
                let mixer = self.layer_scan(a, l, lw);
                let launch = |k: &Kernel, grid, threads, smem, args: &[&dyn KArg]| {
                    self.launch(k, grid, threads, smem, args)
                };
                mixer.pre(d, &self.k.scan, &launch)?;
                mixer.scan(d, &self.k.scan, &launch)?;
            }
            let w_out = gw.layers[l].out_proj;
            self.gemm(
                GemmOp::Linear,
                rows,
                dm,
                di,
                (la.o.ptr, 0),
                (w_out, 0),
                (a.res.ptr, 0),
                true,
            )?;
            if let (Some(m), Some(mw), Some(mg)) = (&la.mlp, &lw.mlp, &gw.layers[l].mlp) {
                let hid = d.mlp_hidden;
                self.gpu.dtod(a.res.ptr, m.r_mid.ptr, rows * dm * 4)?;
                self.norm_rows(a.res.ptr, mw.norm, m.xin.ptr, rows)?;
                self.gemm(
                    GemmOp::Linear,
                    rows,
                    2 * hid,
                    dm,
                    (m.xin.ptr, 0),
                    (mg.fc1, 0),
                    (m.vg.ptr, 0),
                    false,
                )?;
                let sw = self.k.swiglu_rows.as_ref().expect("compiled with the MLP");
                let rows_i = rows as i32;
                let blocks = (rows * hid).div_ceil(256).min(65535) as u32;
                self.launch(
                    sw,
                    (blocks, 1, 1),
                    256,
                    0,
                    &[&m.vg.ptr, &m.act.ptr, &rows_i],
                )?;
                self.gemm(
                    GemmOp::Linear,
                    rows,
                    dm,
                    hid,
                    (m.act.ptr, 0),
                    (mg.fc2, 0),
                    (a.res.ptr, 0),
                    true,
                )?;
            }
        }
        self.norm_rows(a.res.ptr, p.norm_f, a.hfin.ptr, rows)?;
        let vp = d.vocab_padded;
        self.gemm(
            GemmOp::Linear,
            rows,
            vp,
            dm,
            (a.hfin.ptr, 0),
            (gw.head(), 0),
            (a.logits.ptr, 0),
            false,
        )?;
        let inv_rows = 1.0f32 / rows as f32;
        self.launch(
            &self.k.cross_entropy_rows,
            (rows as u32, 1, 1),
            256,
            0,
            &[
                &a.logits.ptr,
                &a.targets.ptr,
                &a.dlogits.ptr,
                &a.losses.ptr,
                &inv_rows,
            ],
        )
    }

    /// The backward of the forward just run on `a`: adds the gradient of the batch's mean
    /// loss into `g`. `p` are the master parameters, `gw` the GEMM weights. `ready` hears
    /// after the head and after each layer that their gradients are queued in full (the
    /// embedding's comes after `embed_bwd`, in `run`).
    pub(super) fn backward(
        &self,
        a: &Acts,
        p: &Addrs,
        gw: &Addrs,
        g: &Addrs,
        ready: &mut dyn GradReady<()>,
    ) -> Result<()> {
        let d = &self.d;
        let (rows, dm, di, vp) = (a.rows, d.d_model, d.d_inner, d.vocab_padded);
        let pl = proj_ld(d);
        // Head and final norm.
        let dl = (a.dlogits.ptr, 0);
        self.linear_bwd(rows, dm, vp, dl, a.hfin.ptr, gw.head(), g.head(), a.dn.ptr)?;
        self.norm_rows_bwd(
            a, a.res.ptr, p.norm_f, a.dn.ptr, a.dres.ptr, g.norm_f, false,
        )?;
        ready.ready(Stage::Head, &mut ())?;
        for l in (0..d.n_layer).rev() {
            let (la, lw, lg, lgw) = (&a.layers[l], &p.layers[l], &g.layers[l], &gw.layers[l]);
            if let (Some(m), Some(mw), Some(mg), Some(mgw)) = (&la.mlp, &lw.mlp, &lg.mlp, &lgw.mlp)
            {
                let hid = d.mlp_hidden;
                let dr = self.operand(a, a.dres.ptr, dm, rows, dm)?;
                self.linear_bwd(rows, hid, dm, dr, m.act.ptr, mgw.fc2, mg.fc2, a.dact.ptr)?;
                let sw = self
                    .k
                    .swiglu_bwd_rows
                    .as_ref()
                    .expect("compiled with the MLP");
                let rows_i = rows as i32;
                let blocks = (rows * hid).div_ceil(256).min(65535) as u32;
                self.launch(
                    sw,
                    (blocks, 1, 1),
                    256,
                    0,
                    &[&m.vg.ptr, &a.dact.ptr, &a.dvg.ptr, &rows_i],
                )?;
                let dvg = (a.dvg.ptr, 0);
                self.linear_bwd(rows, dm, 2 * hid, dvg, m.xin.ptr, mgw.fc1, mg.fc1, a.dn.ptr)?;
                self.norm_rows_bwd(a, m.r_mid.ptr, mw.norm, a.dn.ptr, a.dres.ptr, mg.norm, true)?;
            }
            // out_proj and the gate
            let dr = self.operand(a, a.dres.ptr, dm, rows, dm)?;
            self.linear_bwd(
                rows,
                di,
                dm,
                dr,
                la.o.ptr,
                lgw.out_proj,
                lg.out_proj,
                a.d_o.ptr,
            )?;
            if self.mimo.is_some() {
                self.mimo_backward(a, l, lw, lg)?;
            } else {
                self.siso_mixer_backward(a, l, lw, lg)?;
            }
            // in_proj and the layer norm
            let dp = self.operand(a, a.dproj.ptr, pl, rows, d.d_in_proj)?;
            self.linear_bwd(
                rows,
                dm,
                d.d_in_proj,
                dp,
                la.xin.ptr,
                lgw.in_proj,
                lg.in_proj,
                a.dn.ptr,
            )?;
            self.norm_rows_bwd(a, la.r_in.ptr, lw.norm, a.dn.ptr, a.dres.ptr, lg.norm, true)?;
            ready.ready(Stage::Layer(l), &mut ())?;
        }
        Ok(())
    }

    /// The SISO mixer's backward of layer `l` from `a.d_o`: the gate, the scan, the
    /// per-token preprocessing into `a.dproj`, and the mixer's own parameters into `lg`.
    fn siso_mixer_backward(
        &self,
        a: &Acts,
        l: usize,
        lw: &LayerAddrs,
        lg: &LayerAddrs,
    ) -> Result<()> {
        let d = &self.d;
        let (rows, di) = (a.rows, d.d_inner);
        let (h, n, s, gn) = (d.nheads, d.d_state, d.num_rope_angles, d.ngroups);
        let pl = proj_ld(d);
        let la = &a.layers[l];
        self.launch(
            &self.k.gate_bwd_rows,
            (rows as u32, 1, 1),
            256,
            0,
            &[
                &la.proj.ptr,
                &la.y_pre.ptr,
                &lw.out_norm.unwrap_or(0),
                &a.d_o.ptr,
                &a.dy.ptr,
                &a.dproj.ptr,
                &a.contrib.ptr,
            ],
        )?;
        if let Some(on) = lg.out_norm {
            self.col_sum(a, a.contrib.ptr, rows, di, di, on)?;
        }
        // the scan
        let args = ScanBwdArgs::new(&self.layer_scan(a, l, lw).args, a);
        let nseq = a.layout.seqs.len() as u32;
        self.launch(
            &self.k.scan_bwd,
            (nseq, h as u32, 1),
            256,
            self.k.bwd_smem,
            &[&args],
        )?;
        let seq_len = a.seq_len as i32;
        self.launch(
            &self.k.phase_grad_pass,
            (nseq, (h * s).div_ceil(128) as u32, 1),
            128,
            0,
            &[&a.dphi.ptr, &seq_len],
        )?;
        let rows_i = rows as i32;
        self.launch(
            &self.k.mixer_pre_bwd,
            (rows as u32, 1, 1),
            256,
            0,
            &[
                &la.proj.ptr,
                &lw.dt_bias,
                &lw.b_norm,
                &lw.c_norm,
                &la.theta.ptr,
                &a.tokg.ptr,
                &a.dphi.ptr,
                &a.dk.ptr,
                &a.dq.ptr,
                &a.dproj.ptr,
                &a.bc_rows.ptr,
                &rows_i,
                &seq_len,
            ],
        )?;
        // the mixer's own parameters
        let dt_cols = a.dproj.ptr + 4 * d.dt_off() as u64;
        self.col_sum(a, dt_cols, rows, h, pl, lg.dt_bias)?;
        self.col_sum(a, a.dk.ptr, rows, h * n, h * n, lg.b_bias)?;
        self.col_sum(a, a.dq.ptr, rows, h * n, h * n, lg.c_bias)?;
        self.col_sum(a, a.dd_part.ptr, a.batch, h, h, lg.d)?;
        self.col_sum(a, a.bc_rows.ptr, rows * gn, n, n, lg.b_norm)?;
        let c_rows = a.bc_rows.ptr + 4 * (rows * gn * n) as u64;
        self.col_sum(a, c_rows, rows * gn, n, n, lg.c_norm)?;
        Ok(())
    }
}
