//! Mamba-2 on the GPU (spec §3.3, §3.4): one layer of a packed pass as launches — the
//! in_proj and out_proj products on cuBLASLt, the causal conv over x‖B‖C with its state
//! (Mamba-1's `conv.cu`), the scan parallel over time chunks, heads and state
//! (`kernels/ssd_scan.cu`), the gate with the grouped RMSNorm. The LM around the layers is
//! the engine's (`crate::engine::cuda::family`).

use crate::cuda::context::{DevBuf, Gpu, Kernel};
use crate::cuda::kernels::{KernelConfig, Module, Program, DTYPES};
use crate::cuda::packed::{ptr_or_null, upload_opt, Carve, DevLinear, LayerRun, Table};
use crate::error::{Error, Result};
use crate::mixers::mamba1::cuda::{act_define, ConvIo, ConvKernels, CONV, LM_ROWS};
use crate::model::family_config::Mamba2Config;
use crate::model::family_weights::Mamba2Weights;
use crate::model::DType;

pub const PROGRAM: Program = Program {
    name: "Mamba-2",
    head: "",
    sources: &[
        DTYPES,
        LM_ROWS,
        CONV,
        ("ssd_scan.cu", include_str!("kernels/ssd_scan.cu")),
    ],
    parts: &[0],
};

/// The lanes that hold one channel's state in the scan (`M2_Q`): the largest power of two
/// ≤ 32 dividing `N`, each lane keeping `N / Q` entries in registers. `None` when that is
/// over 64 (a state size with a large odd factor).
pub fn state_lanes(d_state: usize) -> Option<usize> {
    let q = (0..=5)
        .rev()
        .map(|k| 1usize << k)
        .find(|q| d_state.is_multiple_of(*q))?;
    (d_state / q <= 64).then_some(q)
}

/// Channels of a head per block of the scan: the largest divisor of `P` that keeps a block
/// at ≤ 256 threads.
fn channels_per_block(headdim: usize, lanes: usize) -> usize {
    (1..=headdim.min(256 / lanes))
        .rev()
        .find(|d| headdim.is_multiple_of(*d))
        .unwrap_or(1)
}

/// The compile-time constants of a Mamba-2 model's kernels; an error naming the size the
/// scan cannot hold.
pub fn kernel_config(cfg: &Mamba2Config, dtype: DType) -> Result<KernelConfig> {
    let lanes = state_lanes(cfg.d_state).ok_or_else(|| {
        Error::input(format!(
            "d_state {}: the GPU Mamba-2 scan needs d_state = s·2^k with s ≤ 64 (k ≤ 5)",
            cfg.d_state
        ))
    })?;
    let mut k = KernelConfig { defines: vec![] };
    k.set("ACT", act_define(dtype));
    k.set("D_STATE", &cfg.d_state.to_string());
    k.set("D_CONV", &cfg.d_conv.to_string());
    k.set("M2_Q", &lanes.to_string());
    Ok(k)
}

/// The scan's arguments (`M2Scan` in ssd_scan.cu: the same fields in the same order).
#[repr(C)]
#[derive(Clone, Copy)]
struct M2Scan {
    xbc: u64,
    conv_dim: i32,
    d_ssm: i32,
    dt: u64,
    ld_dt: i32,
    dt_bias: u64,
    a: u64,
    d_skip: u64,
    dt_min: f32,
    dt_max: f32,
    heads_per_group: i32,
    headdim: i32,
    groups: i32,
    ssm_off: i64,
}

crate::cuda::context::karg!(M2Scan);

struct Layer {
    in_proj: DevLinear,
    conv_w: DevBuf,
    conv_b: Option<DevBuf>,
    dt_bias: DevBuf,
    /// `A_h = −exp(A_log[h])`
    a: DevBuf,
    /// `D` per channel `[d_ssm]` (a per-head `D` repeated over its P channels)
    d: DevBuf,
    norm: Option<DevBuf>,
    out_proj: DevLinear,
}

struct Kernels {
    conv: ConvKernels,
    scan_local: Kernel,
    scan_carry: Kernel,
    scan_out: Kernel,
    gate_norm: Kernel,
}

/// A Mamba-2 model's mixers on the device.
pub struct GpuMamba2 {
    cfg: Mamba2Config,
    /// lanes per channel and channels per block of the scan
    lanes: usize,
    channels: usize,
    layers: Vec<Layer>,
    k: Kernels,
}

/// Rows per chunk of the scan (the chunk states of a long pass are `H·P·N` floats each);
/// at most `M2_MAX_CHUNK` (256) of ssd_scan.cu.
pub fn chunk_len(rows: usize) -> usize {
    if rows <= 16384 {
        128
    } else {
        256
    }
}

struct Bufs {
    proj: u64,
    xbc: u64,
    y: u64,
    gated: u64,
    h_chunk: u64,
    dt_sum: u64,
}

impl GpuMamba2 {
    /// Upload the mixers of `w` and take their kernels from `module` (compiled from
    /// [`PROGRAM`] with [`kernel_config`]).
    pub fn upload(gpu: &Gpu, w: &Mamba2Weights, module: &Module) -> Result<GpuMamba2> {
        let cfg = w.mixer_config()?.clone();
        let lanes = state_lanes(cfg.d_state).unwrap_or(1);
        let channels = channels_per_block(cfg.headdim, lanes);
        let dt = w.dtype;
        let layers = w
            .layers
            .iter()
            .map(|b| {
                let m = &b.mixer;
                let a: Vec<f32> = m.a_log.iter().map(|&v| -v.exp()).collect();
                let d: Vec<f32> = if cfg.d_has_hdim {
                    m.d.clone()
                } else {
                    (0..cfg.d_ssm).map(|c| m.d[c / cfg.headdim]).collect()
                };
                Ok(Layer {
                    in_proj: DevLinear::upload(gpu, &m.in_proj, m.in_proj_bias.as_deref(), dt)?,
                    conv_w: gpu.upload(&m.conv_weight)?,
                    conv_b: upload_opt(gpu, m.conv_bias.as_deref())?,
                    dt_bias: gpu.upload(&m.dt_bias)?,
                    a: gpu.upload(&a)?,
                    d: gpu.upload(&d)?,
                    norm: upload_opt(gpu, m.norm.as_deref())?,
                    out_proj: DevLinear::upload(gpu, &m.out_proj, m.out_proj_bias.as_deref(), dt)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let k = Kernels {
            conv: ConvKernels::load(module)?,
            scan_local: module.kernel("m2_scan_local")?,
            scan_carry: module.kernel("m2_scan_carry")?,
            scan_out: module.kernel("m2_scan_out")?,
            gate_norm: module.kernel("m2_gate_norm")?,
        };
        Ok(GpuMamba2 {
            cfg,
            lanes,
            channels,
            layers,
            k,
        })
    }

    fn carve(&self, c: &mut Carve, rows: usize, chunks: usize, act_bytes: usize) -> Bufs {
        let cfg = &self.cfg;
        let state = cfg.nheads * cfg.headdim * cfg.d_state;
        Bufs {
            proj: c.take(rows * cfg.d_in_proj(), 4),
            xbc: c.take(rows * cfg.conv_dim(), 4),
            y: c.take(rows * cfg.d_ssm, 4),
            gated: c.take(rows * cfg.d_inner, act_bytes),
            h_chunk: c.take(chunks * state, 4),
            dt_sum: c.take(chunks * cfg.nheads, 4),
        }
    }

    pub fn scratch_bytes(&self, rows: usize, chunks: usize, act_bytes: usize) -> usize {
        let mut c = Carve::new(0);
        self.carve(&mut c, rows, chunks, act_bytes);
        c.used()
    }

    /// Layer `l` on the pass: `normed` (model dtype, `[rows, d_model]`) in, its output
    /// added to `residual` (f32); `scratch` holds [`Self::scratch_bytes`].
    pub fn layer(
        &self,
        run: &LayerRun,
        l: usize,
        normed: u64,
        residual: u64,
        scratch: u64,
    ) -> Result<()> {
        let (gpu, pass, cfg) = (run.gpu, run.pass, &self.cfg);
        let (rows, dip) = (pass.rows, cfg.d_in_proj());
        let w = &self.layers[l];
        let b = self.carve(&mut Carve::new(scratch), rows, pass.chunks, run.act.size());
        let grid_rows = (rows as u32, 1, 1);

        w.in_proj.apply(run, normed, b.proj, false)?;
        let xbc_off = 2 * cfg.d_mlp() + cfg.d_ssm;
        let conv = ConvIo {
            input: b.proj,
            ld: dip,
            offset: xbc_off,
            channels: cfg.conv_dim(),
            weight: w.conv_w.ptr,
            bias: ptr_or_null(&w.conv_b),
            out: b.xbc,
            out_act: 0,
        };
        self.k.conv.run(run, &conv)?;

        let p = M2Scan {
            xbc: b.xbc,
            conv_dim: cfg.conv_dim() as i32,
            d_ssm: cfg.d_ssm as i32,
            dt: b.proj + 4 * (xbc_off + cfg.conv_dim()) as u64,
            ld_dt: dip as i32,
            dt_bias: w.dt_bias.ptr,
            a: w.a.ptr,
            d_skip: w.d.ptr,
            dt_min: cfg.dt_limit.0 as f32,
            dt_max: if cfg.dt_limit.1.is_finite() {
                cfg.dt_limit.1 as f32
            } else {
                f32::INFINITY
            },
            heads_per_group: (cfg.nheads / cfg.ngroups) as i32,
            headdim: cfg.headdim as i32,
            groups: cfg.ngroups as i32,
            ssm_off: (run.state_off + cfg.conv_dim() * cfg.d_conv) as i64,
        };
        let heads = cfg.nheads as u32;
        // `channels` channels of a head per block, `lanes` threads each; z spans the head
        let block = (self.channels * self.lanes) as u32;
        let z = (cfg.headdim / self.channels) as u32;
        let direct = i32::from(pass.one_chunk_each);
        if !pass.one_chunk_each {
            let (row0, len) = (pass.at(Table::ChunkRow0), pass.at(Table::ChunkLen));
            let grid = (pass.chunks as u32, heads, z);
            gpu.launch(
                &self.k.scan_local,
                grid,
                block,
                0,
                false,
                &[&p, &row0, &len, &b.h_chunk, &b.dt_sum],
            )?;
            let per_head = cfg.headdim * cfg.d_state;
            let grid = (pass.seqs as u32 * heads, per_head.div_ceil(256) as u32, 1);
            let (c0, nc, st) = (
                pass.at(Table::SeqChunk0),
                pass.seq_nchunks(),
                pass.at(Table::SeqState),
            );
            let heads_i = heads as i32;
            gpu.launch(
                &self.k.scan_carry,
                grid,
                256,
                0,
                false,
                &[&p, &c0, &nc, &st, &b.h_chunk, &b.dt_sum, &heads_i],
            )?;
        }
        gpu.launch(
            &self.k.scan_out,
            (pass.chunks as u32, heads, z),
            block,
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
        let (ld, d_mlp, d_ssm, groups) = (
            dip as i32,
            cfg.d_mlp() as i32,
            cfg.d_ssm as i32,
            cfg.ngroups as i32,
        );
        let (norm, nbg, eps) = (
            ptr_or_null(&w.norm),
            i32::from(cfg.norm_before_gate),
            cfg.gated_norm_eps as f32,
        );
        gpu.launch(
            &self.k.gate_norm,
            grid_rows,
            256,
            0,
            false,
            &[
                &b.proj, &ld, &b.y, &d_mlp, &d_ssm, &groups, &norm, &nbg, &eps, &b.gated,
            ],
        )?;
        w.out_proj.apply(run, b.gated, residual, true)?;
        Ok(())
    }
}
