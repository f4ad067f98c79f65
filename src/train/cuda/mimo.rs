//! The MIMO mixer in GPU training (`ssm_cfg.is_mimo`): its kernels
//! (`crate::mixers::mimo::cuda::TRAINING`, kernels/mimo_train.cu — ports of the CPU's
//! `crate::mixers::mimo::train`), the buffers they keep, and the launches that take the
//! place of the SISO scan in [`super::pass`]. Everything else in a step (embedding, norms,
//! GEMMs, MLP, loss, AdamW) is the SISO trainer's.
//!
//! Correctness first: a block per (sequence, head) walks its tokens one by one, the state in
//! shared memory. Memory: the forward keeps per layer only the per-row values (normed B/C,
//! Δ, A, λ, θ); the backward runs the head forward of its layer again to refill the
//! per-head scratch (rotated keys and queries, readouts, phases, chunk states), which the
//! layers share.

use super::acts::{Acts, COLSUM_ROWS};
use super::flat::LayerAddrs;
use super::CudaTrainer;
use crate::cuda::context::{DevBuf, Gpu, KArg, Kernel};
use crate::cuda::kernels::{check_smem, proj_ld, KernelConfig, Module};
use crate::error::Result;
use crate::mixers::mimo::cuda::TRAINING;
use crate::mixers::mimo::weights::{mimo_dims, MimoDims};
use crate::model::config::{AActivation, Config, NORM_EPS};

/// The compiled MIMO training kernels and the sizes of one model.
pub struct MimoTrain {
    pub d: MimoDims,
    a_floor: f32,
    a_softplus: i32,
    rows_pre: Kernel,
    head_fwd: Kernel,
    combine_bwd: Kernel,
    head_bwd: Kernel,
    rows_bwd: Kernel,
    fwd_smem: u32,
    combine_smem: u32,
    bwd_smem: u32,
}

/// Threads of every MIMO training block.
const THREADS: u32 = 256;

impl MimoTrain {
    pub fn load(gpu: &Gpu, config: &Config) -> Result<MimoTrain> {
        let d = mimo_dims(config);
        let (module, _) = Module::load(gpu, TRAINING, &KernelConfig { defines: vec![] })?;
        let (p, n, r, s) = (d.headdim, d.d_state, d.rank, d.num_rope_angles);
        // The layouts in the comments of mt_head_fwd, mt_combine_bwd and mt_head_bwd.
        let fwd_smem = 4 * (p * n + 3 * r * n + 2 * p + 3 * s + r * p + r) as u32;
        let combine_smem = 4 * (5 * r * p + p + 2 * r) as u32;
        let bwd_smem = 4 * (p * n + 3 * r * n + 3 * r * p + 2 * p + 32) as u32;
        let k = MimoTrain {
            a_floor: config.ssm_cfg.a_floor as f32,
            a_softplus: i32::from(config.ssm_cfg.a_activation == AActivation::Softplus),
            rows_pre: module.kernel("mt_rows_pre")?,
            head_fwd: module.kernel("mt_head_fwd")?,
            combine_bwd: module.kernel("mt_combine_bwd")?,
            head_bwd: module.kernel("mt_head_bwd")?,
            rows_bwd: module.kernel("mt_rows_bwd")?,
            fwd_smem,
            combine_smem,
            bwd_smem,
            d,
        };
        for (kern, bytes) in [
            (&k.head_fwd, k.fwd_smem),
            (&k.combine_bwd, k.combine_smem),
            (&k.head_bwd, k.bwd_smem),
        ] {
            check_smem(gpu, kern, bytes)?;
            kern.allow_smem(bytes as usize)?;
        }
        Ok(k)
    }
}

/// The MIMO buffers of one training shape: per layer the per-row values the forward keeps,
/// and the per-head scratch every layer's backward shares.
pub struct MimoActs {
    /// per layer: `bn`, `cn` `[rows, R·G·N]`, `rb`, `rc` `[rows, R·G]`, `delta`, `aval`,
    /// `lambda` `[rows, H]`, `theta` `[rows, S]`, end to end
    rows_saved: Vec<DevBuf>,
    scratch: DevBuf,
    /// offsets (in floats) of the scratch tensors, in `Scratch` order
    at: Scratch<usize>,
    /// column-sum partials of the MIMO parameters' gradients
    colsum: DevBuf,
}

/// The per-head scratch tensors (`MimoTrainArgs` in mimo_train.cu says their shapes).
#[derive(Clone, Copy)]
struct Scratch<T> {
    cs: T,
    sn: T,
    k: T,
    q: T,
    y: T,
    states: T,
    dy: T,
    du: T,
    dkt: T,
    dqt: T,
    st: T,
    gph: T,
    dk: T,
    dq: T,
    dtheta: T,
    ddelta: T,
    daval: T,
    dlambda: T,
    dd: T,
    dpsi: T,
    dzeta: T,
    domega: T,
    dwnorm: T,
    dbc_w: T,
}

/// Floats of each per-row tensor of one layer, in `rows_saved` order.
fn row_sizes(d: &MimoDims, rows: usize) -> [usize; 8] {
    let (rgn, rg) = (d.bc_width(), d.rank * d.ngroups);
    let (h, s) = (d.nheads, d.num_rope_angles);
    [
        rows * rgn,
        rows * rgn,
        rows * rg,
        rows * rg,
        rows * h,
        rows * h,
        rows * h,
        rows * s,
    ]
}

impl MimoActs {
    pub fn new(gpu: &Gpu, m: &MimoTrain, batch: usize, seq_len: usize) -> Result<MimoActs> {
        let d = &m.d;
        let rows = batch * seq_len;
        let (h, p, n, r, s) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
        let (rn, rp, pn) = (r * n, r * p, p * n);
        let nch = seq_len.div_ceil(d.chunk_len);
        let bh = batch * h;
        let per_row: usize = row_sizes(d, rows).iter().sum();
        let rows_saved = (0..d.n_layer)
            .map(|_| gpu.alloc::<f32>(per_row.max(1)))
            .collect::<Result<Vec<_>>>()?;
        let sizes = Scratch {
            cs: rows * h * s,
            sn: rows * h * s,
            k: rows * h * rn,
            q: rows * h * rn,
            y: rows * h * rp,
            states: bh * nch * pn,
            dy: rows * h * rp,
            du: rows * h * rp,
            dkt: rows * h * rn,
            dqt: rows * h * rn,
            st: bh * (d.chunk_len + 1) * pn,
            gph: rows * h * s,
            dk: rows * h * rn,
            dq: rows * h * rn,
            dtheta: rows * h * s,
            ddelta: rows * h,
            daval: rows * h,
            dlambda: rows * h,
            dd: bh,
            dpsi: bh * rp,
            dzeta: bh * rp,
            domega: bh * rp,
            dwnorm: bh * p,
            dbc_w: 2 * rows * d.bc_width(),
        };
        // Offsets: each tensor after the previous one, 16-byte aligned.
        let mut next = 0usize;
        let mut place = |len: usize| {
            let at = next;
            next += len.next_multiple_of(4);
            at
        };
        let at = Scratch {
            cs: place(sizes.cs),
            sn: place(sizes.sn),
            k: place(sizes.k),
            q: place(sizes.q),
            y: place(sizes.y),
            states: place(sizes.states),
            dy: place(sizes.dy),
            du: place(sizes.du),
            dkt: place(sizes.dkt),
            dqt: place(sizes.dqt),
            st: place(sizes.st),
            gph: place(sizes.gph),
            dk: place(sizes.dk),
            dq: place(sizes.dq),
            dtheta: place(sizes.dtheta),
            ddelta: place(sizes.ddelta),
            daval: place(sizes.daval),
            dlambda: place(sizes.dlambda),
            dd: place(sizes.dd),
            dpsi: place(sizes.dpsi),
            dzeta: place(sizes.dzeta),
            domega: place(sizes.domega),
            dwnorm: place(sizes.dwnorm),
            dbc_w: place(sizes.dbc_w),
        };
        let scratch = gpu.alloc::<f32>(next.max(1))?;
        // The widest column sum: dk over the rows (H·R·N columns), the per-head partials
        // over the sequences (H·R·P), the B/C norm rows (N columns of R·G rows per row).
        let parts = |r: usize| r.div_ceil(COLSUM_ROWS);
        let colsum = parts(rows) * h * rn + parts(batch) * h * rp + parts(rows * r * d.ngroups) * n;
        Ok(MimoActs {
            rows_saved,
            scratch,
            at,
            colsum: gpu.alloc::<f32>(colsum.max(1))?,
        })
    }
}

/// Kernel parameters (`MimoTrainArgs` in mimo_train.cu: the same fields in the same order).
#[repr(C)]
struct MimoTrainArgs {
    dt_bias: u64,
    b_bias: u64,
    c_bias: u64,
    b_norm: u64,
    c_norm: u64,
    mimo_x: u64,
    mimo_z: u64,
    mimo_o: u64,
    d_skip: u64,
    out_norm: u64,
    proj: u64,
    dproj: u64,
    bn: u64,
    cn: u64,
    rb: u64,
    rc: u64,
    delta: u64,
    aval: u64,
    lambda: u64,
    theta: u64,
    cs: u64,
    sn: u64,
    k: u64,
    q: u64,
    y: u64,
    states: u64,
    o: u64,
    d_o: u64,
    dy: u64,
    du: u64,
    dkt: u64,
    dqt: u64,
    st: u64,
    gph: u64,
    dk: u64,
    dq: u64,
    dtheta: u64,
    ddelta: u64,
    daval: u64,
    dlambda: u64,
    dd: u64,
    dpsi: u64,
    dzeta: u64,
    domega: u64,
    dwnorm: u64,
    dbc_w: u64,
    batch: i32,
    seq_len: i32,
    heads: i32,
    headdim: i32,
    d_state: i32,
    groups: i32,
    rank: i32,
    angles: i32,
    chunk: i32,
    ld: i32,
    x_off: i32,
    b_off: i32,
    c_off: i32,
    dt_off: i32,
    a_off: i32,
    trap_off: i32,
    ang_off: i32,
    a_softplus: i32,
    a_floor: f32,
    eps: f32,
}

// The kernels' struct is 448 bytes (a static_assert in mimo_train.cu).
const _: () = assert!(std::mem::size_of::<MimoTrainArgs>() == 448);

impl KArg for MimoTrainArgs {
    fn ptr(&self) -> *mut std::ffi::c_void {
        self as *const MimoTrainArgs as *mut std::ffi::c_void
    }
}

impl CudaTrainer {
    /// The kernels' arguments for layer `l` with parameters `lw`; `o` receives the head
    /// forward's output (f32 `[rows, D_i]`).
    fn mimo_args(
        &self,
        m: &MimoTrain,
        ma: &MimoActs,
        a: &Acts,
        l: usize,
        lw: &LayerAddrs,
    ) -> MimoTrainArgs {
        let d = &m.d;
        let la = &a.layers[l];
        let mw = lw
            .mimo
            .expect("a MIMO model's layers have mimo_x, mimo_z and mimo_o");
        let rows = a.rows;
        let mut row_at = ma.rows_saved[l].ptr;
        let mut row_next = row_sizes(d, rows).into_iter().map(move |len| {
            let p = row_at;
            row_at += 4 * len as u64;
            p
        });
        let mut rn = || row_next.next().expect("eight per-row tensors");
        let (bn, cn, rb, rc, delta, aval, lambda, theta) =
            (rn(), rn(), rn(), rn(), rn(), rn(), rn(), rn());
        let s = |off: usize| ma.scratch.at::<f32>(off);
        let at = &ma.at;
        let i = |v: usize| v as i32;
        MimoTrainArgs {
            dt_bias: lw.dt_bias,
            b_bias: lw.b_bias,
            c_bias: lw.c_bias,
            b_norm: lw.b_norm,
            c_norm: lw.c_norm,
            mimo_x: mw.x,
            mimo_z: mw.z,
            mimo_o: mw.o,
            d_skip: lw.d,
            out_norm: lw.out_norm.unwrap_or(0),
            proj: la.proj.ptr,
            dproj: a.dproj.ptr,
            bn,
            cn,
            rb,
            rc,
            delta,
            aval,
            lambda,
            theta,
            cs: s(at.cs),
            sn: s(at.sn),
            k: s(at.k),
            q: s(at.q),
            y: s(at.y),
            states: s(at.states),
            o: la.y_pre.ptr,
            d_o: a.d_o.ptr,
            dy: s(at.dy),
            du: s(at.du),
            dkt: s(at.dkt),
            dqt: s(at.dqt),
            st: s(at.st),
            gph: s(at.gph),
            dk: s(at.dk),
            dq: s(at.dq),
            dtheta: s(at.dtheta),
            ddelta: s(at.ddelta),
            daval: s(at.daval),
            dlambda: s(at.dlambda),
            dd: s(at.dd),
            dpsi: s(at.dpsi),
            dzeta: s(at.dzeta),
            domega: s(at.domega),
            dwnorm: s(at.dwnorm),
            dbc_w: s(at.dbc_w),
            batch: i(a.batch),
            seq_len: i(a.seq_len),
            heads: i(d.nheads),
            headdim: i(d.headdim),
            d_state: i(d.d_state),
            groups: i(d.ngroups),
            rank: i(d.rank),
            angles: i(d.num_rope_angles),
            chunk: i(d.chunk_len),
            ld: i(proj_ld(&self.d)),
            x_off: i(d.x_off()),
            b_off: i(d.b_off()),
            c_off: i(d.c_off()),
            dt_off: i(d.dt_off()),
            a_off: i(d.a_off()),
            trap_off: i(d.trap_off()),
            ang_off: i(d.angle_off()),
            a_softplus: m.a_softplus,
            a_floor: m.a_floor,
            eps: NORM_EPS as f32,
        }
    }

    /// The head forward of every (sequence, head): fills the per-head scratch and writes
    /// the mixer's output (f32) into the layer's `y_pre`.
    fn mimo_heads(&self, m: &MimoTrain, a: &Acts, args: &MimoTrainArgs) -> Result<()> {
        let grid = (a.batch as u32, m.d.nheads as u32, 1);
        self.launch(&m.head_fwd, grid, THREADS, m.fwd_smem, &[args])
    }

    /// Layer `l`'s mixer forward: from its in_proj output to its output `o` (the out_proj
    /// operand, in the activation type).
    pub(super) fn mimo_forward(&self, a: &Acts, l: usize, lw: &LayerAddrs) -> Result<()> {
        let (m, ma) = self.mimo_parts();
        let args = self.mimo_args(m, ma, a, l, lw);
        self.launch(&m.rows_pre, (a.rows as u32, 1, 1), THREADS, 0, &[&args])?;
        self.mimo_heads(m, a, &args)?;
        // the f32 output into the GEMM's operand type (a copy in f32 training)
        let la = &a.layers[l];
        let di = m.d.d_inner as i32;
        let rows_i = a.rows as i32;
        let blocks = (a.rows * m.d.d_inner).div_ceil(256).min(65535) as u32;
        self.launch(
            &self.k.cast_rows,
            (blocks, 1, 1),
            256,
            0,
            &[&la.y_pre.ptr, &di, &la.o.ptr, &di, &rows_i, &di],
        )
    }

    /// Layer `l`'s mixer backward from `a.d_o`: writes every column of `a.dproj` and adds
    /// the mixer's parameter gradients into `lg`.
    pub(super) fn mimo_backward(
        &self,
        a: &Acts,
        l: usize,
        lw: &LayerAddrs,
        lg: &LayerAddrs,
    ) -> Result<()> {
        let (m, ma) = self.mimo_parts();
        let d = &m.d;
        let args = self.mimo_args(m, ma, a, l, lw);
        let grid = (a.batch as u32, d.nheads as u32, 1);
        self.mimo_heads(m, a, &args)?;
        self.launch(&m.combine_bwd, grid, THREADS, m.combine_smem, &[&args])?;
        self.launch(&m.head_bwd, grid, THREADS, m.bwd_smem, &[&args])?;
        self.launch(&m.rows_bwd, (a.rows as u32, 1, 1), THREADS, 0, &[&args])?;
        // The parameters every row or sequence shares: sums over the rows (or sequences)
        // in a fixed order.
        let (h, p, n, r) = (d.nheads, d.headdim, d.d_state, d.rank);
        let (rows, b, pl) = (a.rows, a.batch, proj_ld(&self.d));
        let part = ma.colsum.ptr;
        let dt_cols = a.dproj.ptr + 4 * d.dt_off() as u64;
        self.col_sum_with(part, dt_cols, rows, h, pl, lg.dt_bias)?;
        self.col_sum_with(part, args.dk, rows, h * r * n, h * r * n, lg.b_bias)?;
        self.col_sum_with(part, args.dq, rows, h * r * n, h * r * n, lg.c_bias)?;
        self.col_sum_with(part, args.dd, b, h, h, lg.d)?;
        let mg = lg
            .mimo
            .expect("a MIMO model's gradient has mimo_x, mimo_z and mimo_o");
        self.col_sum_with(part, args.dpsi, b, h * r * p, h * r * p, mg.x)?;
        self.col_sum_with(part, args.dzeta, b, h * r * p, h * r * p, mg.z)?;
        self.col_sum_with(part, args.domega, b, h * r * p, h * r * p, mg.o)?;
        if let Some(on) = lg.out_norm {
            self.col_sum_with(part, args.dwnorm, b, h * p, h * p, on)?;
        }
        let norm_rows = rows * r * d.ngroups;
        self.col_sum_with(part, args.dbc_w, norm_rows, n, n, lg.b_norm)?;
        let c_rows = args.dbc_w + 4 * (norm_rows * n) as u64;
        self.col_sum_with(part, c_rows, norm_rows, n, n, lg.c_norm)
    }
}
