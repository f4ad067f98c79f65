//! Mamba-1 on the GPU (spec §2.3, §2.5): one layer of a packed pass as launches — the
//! in_proj, x_proj, dt_proj and out_proj products on cuBLASLt (model-dtype inputs, f32
//! outputs), the causal conv with its state (`kernels/conv.cu`, shared with Mamba-2), the
//! FalconMamba norms, and the selective scan parallel over time chunks
//! (`kernels/selective_scan.cu`). The LM around the layers is the engine's
//! (`crate::engine::cuda::family`).

use crate::cuda::context::{DevBuf, Gpu, Kernel};
use crate::cuda::kernels::{KernelConfig, Module, Program, DTYPES, LANES};
use crate::cuda::packed::{ptr_or_null, upload_opt, Carve, DevLinear, LayerRun, Table};
use crate::error::Result;
use crate::mixers::mamba1::weights::Mamba1Weights;
use crate::model::family_config::Mamba1Config;
use crate::model::DType;

/// The LM row kernels every Mamba-1/Mamba-2 program starts with.
pub const LM_ROWS: (&str, &str) = (
    "lm_rows.cu",
    include_str!("../../../cuda/kernels/lm_rows.cu"),
);
/// The causal conv with its state (Mamba-2 uses it too).
pub const CONV: (&str, &str) = ("conv.cu", include_str!("kernels/conv.cu"));

pub const PROGRAM: Program = Program {
    name: "Mamba-1",
    head: "",
    sources: &[
        DTYPES,
        LANES,
        LM_ROWS,
        CONV,
        (
            "selective_scan.cu",
            include_str!("kernels/selective_scan.cu"),
        ),
    ],
    parts: &[0],
};

/// The `ACT` define of a dtype (lm_rows.cu).
pub fn act_define(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "1",
        DType::F16 => "2",
        _ => "0",
    }
}

/// The compile-time constants of a Mamba-1 model's kernels.
pub fn kernel_config(cfg: &Mamba1Config, dtype: DType) -> KernelConfig {
    let mut k = KernelConfig { defines: vec![] };
    k.set("ACT", act_define(dtype));
    k.set("D_STATE", &cfg.d_state.to_string());
    k.set("D_CONV", &cfg.d_conv.to_string());
    k
}

/// The scan's arguments (`M1Scan` in selective_scan.cu: the same fields in the same order).
#[repr(C)]
#[derive(Clone, Copy)]
struct M1Scan {
    u: u64,
    dt: u64,
    dt_bias: u64,
    a: u64,
    bc: u64,
    ld_bc: i32,
    b_off: i32,
    z: u64,
    ld_z: i32,
    d_skip: u64,
    d_inner: i32,
    ssm_off: i64,
}

crate::cuda::context::karg!(M1Scan);

struct Layer {
    in_proj: DevLinear,
    conv_w: DevBuf,
    conv_b: Option<DevBuf>,
    x_proj: DevLinear,
    dt_proj: DevLinear,
    dt_bias: DevBuf,
    /// `A = −exp(A_log)`, `[D_i, N]`
    a: DevBuf,
    d: DevBuf,
    out_proj: DevLinear,
}

struct Kernels {
    conv: ConvKernels,
    dbc_prep: Kernel,
    scan_local: Kernel,
    scan_carry: Kernel,
    scan_out: Kernel,
}

/// A Mamba-1 model's mixers on the device.
pub struct GpuMamba1 {
    cfg: Mamba1Config,
    layers: Vec<Layer>,
    k: Kernels,
}

/// Rows per chunk of the scan: ≥ 64 chunks' worth of parallelism for one 4k prompt, and
/// bounded chunk-state memory for long passes.
pub fn chunk_len(rows: usize) -> usize {
    if rows <= 16384 {
        64
    } else {
        256
    }
}

impl GpuMamba1 {
    /// Upload the mixers of `w` and take their kernels from `module` (compiled from
    /// [`PROGRAM`] with [`kernel_config`]).
    /// `normed` is the dtype of the normed rows and of the matrices that read them (`norm_t`).
    pub fn upload(
        gpu: &Gpu,
        w: &Mamba1Weights,
        module: &Module,
        normed: DType,
    ) -> Result<GpuMamba1> {
        let cfg = w.mixer_config()?.clone();
        let dt = w.dtype;
        let layers = w
            .layers
            .iter()
            .map(|b| {
                let m = &b.mixer;
                let a: Vec<f32> = m.a_log.iter().map(|&v| -v.exp()).collect();
                Ok(Layer {
                    in_proj: DevLinear::upload(gpu, &m.in_proj, m.in_proj_bias.as_deref(), normed)?,
                    conv_w: gpu.upload(&m.conv_weight)?,
                    conv_b: upload_opt(gpu, m.conv_bias.as_deref())?,
                    x_proj: DevLinear::upload(gpu, &m.x_proj, None, dt)?,
                    dt_proj: DevLinear::upload(gpu, &m.dt_proj, None, dt)?,
                    dt_bias: gpu.upload(&m.dt_bias)?,
                    a: gpu.upload(&a)?,
                    d: gpu.upload(&m.d)?,
                    out_proj: DevLinear::upload(gpu, &m.out_proj, m.out_proj_bias.as_deref(), dt)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let k = Kernels {
            conv: ConvKernels::load(module)?,
            dbc_prep: module.kernel("m1_dbc_prep")?,
            scan_local: module.kernel("m1_scan_local")?,
            scan_carry: module.kernel("m1_scan_carry")?,
            scan_out: module.kernel("m1_scan_out")?,
        };
        Ok(GpuMamba1 { cfg, layers, k })
    }

    /// The scratch one layer takes for a pass of `rows` rows in `chunks` chunks, carved
    /// from `c` (a dry run on address 0 sizes it).
    fn carve(&self, c: &mut Carve, rows: usize, chunks: usize, act_bytes: usize) -> Bufs {
        let (di, n, r) = (self.cfg.d_inner, self.cfg.d_state, self.cfg.dt_rank);
        Bufs {
            xz: c.take(rows * 2 * di, 4),
            u: c.take(rows * di, 4),
            u_act: c.take(rows * di, act_bytes),
            dbc: c.take(rows * (r + 2 * n), 4),
            dt_low: c.take(rows * r, act_bytes),
            dt: c.take(rows * di, 4),
            y: c.take(rows * di, act_bytes),
            h_chunk: c.take(chunks * di * n, 4),
            dt_sum: c.take(chunks * di, 4),
        }
    }

    pub fn scratch_bytes(&self, rows: usize, chunks: usize, act_bytes: usize) -> usize {
        let mut c = Carve::new(0);
        self.carve(&mut c, rows, chunks, act_bytes);
        c.used()
    }

    /// Layer `l` on the pass: `normed` (`norm_t`, `[rows, d_model]`) in, its output
    /// added to `residual` (f32); `scratch` holds [`Self::scratch_bytes`].
    pub fn layer(
        &self,
        run: &LayerRun,
        l: usize,
        normed: u64,
        residual: u64,
        scratch: u64,
    ) -> Result<()> {
        let (gpu, pass) = (run.gpu, run.pass);
        let (di, n, r) = (self.cfg.d_inner, self.cfg.d_state, self.cfg.dt_rank);
        let rows = pass.rows;
        let w = &self.layers[l];
        let b = self.carve(&mut Carve::new(scratch), rows, pass.chunks, run.act.size());
        let grid_rows = (rows as u32, 1, 1);

        w.in_proj.apply(run, normed, b.xz, false)?;
        let conv = ConvIo {
            input: b.xz,
            ld: 2 * di,
            offset: 0,
            channels: di,
            weight: w.conv_w.ptr,
            bias: ptr_or_null(&w.conv_b),
            out: b.u,
            out_act: b.u_act,
        };
        self.k.conv.run(run, &conv)?;

        let dbc_cols = r + 2 * n;
        w.x_proj.apply(run, b.u_act, b.dbc, false)?;
        let eps = self.cfg.bcdt_rms_eps.map_or(-1.0f32, |e| e as f32);
        let (ld_dbc, rank) = (dbc_cols as i32, r as i32);
        gpu.launch(
            &self.k.dbc_prep,
            grid_rows,
            128,
            0,
            false,
            &[&b.dbc, &ld_dbc, &rank, &eps, &b.dt_low],
        )?;
        w.dt_proj.apply(run, b.dt_low, b.dt, false)?;

        let p = M1Scan {
            u: b.u,
            dt: b.dt,
            dt_bias: w.dt_bias.ptr,
            a: w.a.ptr,
            bc: b.dbc,
            ld_bc: dbc_cols as i32,
            b_off: r as i32,
            z: b.xz + 4 * di as u64,
            ld_z: 2 * di as i32,
            d_skip: w.d.ptr,
            d_inner: di as i32,
            ssm_off: (run.state_off + di * self.cfg.d_conv) as i64,
        };
        let ch_blocks = di.div_ceil(128) as u32;
        let direct = i32::from(pass.one_chunk_each);
        if !pass.one_chunk_each {
            let grid = (pass.chunks as u32, ch_blocks, 1);
            let (row0, len) = (pass.at(Table::ChunkRow0), pass.at(Table::ChunkLen));
            gpu.launch(
                &self.k.scan_local,
                grid,
                128,
                0,
                false,
                &[&p, &row0, &len, &b.h_chunk, &b.dt_sum],
            )?;
            let (c0, nc, st) = (
                pass.at(Table::SeqChunk0),
                pass.seq_nchunks(),
                pass.at(Table::SeqState),
            );
            // one thread per state entry (d, n)
            let entry_blocks = (di * self.cfg.d_state).div_ceil(128) as u32;
            gpu.launch(
                &self.k.scan_carry,
                (pass.seqs as u32, entry_blocks, 1),
                128,
                0,
                false,
                &[&p, &c0, &nc, &st, &b.h_chunk, &b.dt_sum],
            )?;
        }
        gpu.launch(
            &self.k.scan_out,
            (pass.chunks as u32, ch_blocks, 1),
            128,
            0,
            false,
            &[
                &p,
                &pass.at(Table::ChunkRow0),
                &pass.at(Table::ChunkLen),
                &pass.at(Table::ChunkSeq),
                &pass.at(Table::SeqState),
                &b.h_chunk,
                &direct,
                &b.y,
            ],
        )?;
        w.out_proj.apply(run, b.y, residual, true)?;
        Ok(())
    }
}

/// The causal conv's kernels (`kernels/conv.cu`), shared with Mamba-2.
pub struct ConvKernels {
    rows: Kernel,
    state_update: Kernel,
}

/// What the conv of one layer reads and writes: `channels` inputs at column `offset` of
/// `input` (f32 rows `ld` apart), the taps `[C, K]` and bias (0: none), the f32 outputs
/// `[rows, C]` and optionally (non-zero) a copy in the model dtype.
pub struct ConvIo {
    pub input: u64,
    pub ld: usize,
    pub offset: usize,
    pub channels: usize,
    pub weight: u64,
    pub bias: u64,
    pub out: u64,
    pub out_act: u64,
}

impl ConvKernels {
    pub fn load(module: &Module) -> Result<ConvKernels> {
        Ok(ConvKernels {
            rows: module.kernel("conv_rows")?,
            state_update: module.kernel("conv_state_update")?,
        })
    }

    /// The conv of every row of the pass, then each sequence's conv state (the layer's
    /// first state tensor, at `run.state_off`) moved on. The width K is compiled in.
    pub fn run(&self, run: &LayerRun, io: &ConvIo) -> Result<()> {
        let (gpu, pass) = (run.gpu, run.pass);
        let conv_off = run.state_off as i64;
        let (ld, off, ch) = (io.ld as i32, io.offset as i32, io.channels as i32);
        let (rows, seqs) = (pass.rows as i32, pass.seqs as i32);
        gpu.launch(
            &self.rows,
            LayerRun::grid_1d(pass.rows * io.channels),
            256,
            0,
            false,
            &[
                &io.input,
                &ld,
                &off,
                &ch,
                &pass.at(Table::RowSeq),
                &pass.at(Table::SeqRow0),
                &pass.at(Table::SeqState),
                &conv_off,
                &io.weight,
                &io.bias,
                &io.out,
                &io.out_act,
                &rows,
            ],
        )?;
        gpu.launch(
            &self.state_update,
            LayerRun::grid_1d(pass.seqs * io.channels),
            256,
            0,
            false,
            &[
                &io.input,
                &ld,
                &off,
                &ch,
                &pass.at(Table::SeqRow0),
                &pass.at(Table::SeqLen),
                &pass.at(Table::SeqState),
                &conv_off,
                &seqs,
            ],
        )
    }
}

/// One layer's scratch buffers (device addresses).
struct Bufs {
    xz: u64,
    u: u64,
    u_act: u64,
    dbc: u64,
    dt_low: u64,
    dt: u64,
    y: u64,
    h_chunk: u64,
    dt_sum: u64,
}
