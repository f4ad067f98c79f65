//! Mamba-2 on the GPU (spec §3.3, §3.4): one layer of a packed pass as launches — the
//! in_proj and out_proj products on cuBLASLt, the causal conv over x‖B‖C with its state
//! (Mamba-1's `conv.cu`), the scan, the gate with the grouped RMSNorm. The scan is the
//! chunked (SSD) form on the tensor cores, parallel over chunks and heads, with the carry
//! of the chunk states along each sequence between its two launches
//! (`kernels/ssd_chunk.cu`); passes of a few rows per sequence (decode steps) take the
//! recurrent form instead (`kernels/ssd_scan.cu`). The LM around the layers is the
//! engine's (`crate::engine::cuda::family`).

use crate::cuda::context::{DevBuf, Gpu, Kernel};
use crate::cuda::kernels::{
    check_smem, KernelConfig, Module, Program, CHUNK_SCAN, DTYPES, LANES, SCAN_TILES,
};
use crate::cuda::packed::{ptr_or_null, upload_opt, Carve, DevLinear, LayerRun, Table};
use crate::error::{Error, Result};
use crate::mixers::mamba1::cuda::{act_define, ConvIo, ConvKernels, CONV, LM_ROWS};
use crate::mixers::mamba2::weights::Mamba2Weights;
use crate::model::family_config::Mamba2Config;
use crate::model::DType;

pub const PROGRAM: Program = Program {
    name: "Mamba-2",
    head: "",
    sources: &[
        DTYPES,
        LANES,
        LM_ROWS,
        CONV,
        ("ssd_scan.cu", include_str!("kernels/ssd_scan.cu")),
        SCAN_TILES,
        CHUNK_SCAN,
        ("ssd_chunk.cu", include_str!("kernels/ssd_chunk.cu")),
    ],
    parts: &[0],
};

/// The lanes that hold one channel's state in the recurrent scan (`M2_Q`): the largest power of two
/// ≤ 32 dividing `N`, each lane keeping `N / Q` entries in registers. `None` when that is
/// over 64 (a state size with a large odd factor).
pub fn state_lanes(d_state: usize) -> Option<usize> {
    let q = (0..=5)
        .rev()
        .map(|k| 1usize << k)
        .find(|q| d_state.is_multiple_of(*q))?;
    (d_state / q <= 64).then_some(q)
}

/// Channels of a head per block of the recurrent scan: the largest divisor of `P` that keeps a block
/// at ≤ 256 threads.
fn channels_per_block(headdim: usize, lanes: usize) -> usize {
    (1..=headdim.min(256 / lanes))
        .rev()
        .find(|d| headdim.is_multiple_of(*d))
        .unwrap_or(1)
}

/// The compile-time constants of a Mamba-2 model's kernels; an error naming the size the
/// scans cannot hold.
pub fn kernel_config(cfg: &Mamba2Config, dtype: DType) -> Result<KernelConfig> {
    let lanes = state_lanes(cfg.d_state).ok_or_else(|| {
        Error::input(format!(
            "d_state {}: the GPU Mamba-2 scan needs d_state = s·2^k with s ≤ 64 (k ≤ 5)",
            cfg.d_state
        ))
    })?;
    // The chunked scan's tiles (src/cuda/kernels/scan_tiles.cuh) hold at most 128 channels.
    if cfg.headdim > 128 {
        return Err(Error::input(format!(
            "headdim {}: the GPU Mamba-2 scan supports headdim up to 128",
            cfg.headdim
        )));
    }
    let mut k = KernelConfig { defines: vec![] };
    k.set("ACT", act_define(dtype));
    k.set("DSTATE", &cfg.d_state.to_string());
    k.set("D_CONV", &cfg.d_conv.to_string());
    k.set("M2_Q", &lanes.to_string());
    k.set("HEADDIM", &cfg.headdim.to_string());
    k.set("NANGLES", "0");
    // f32 models: exact f32 FMA products, in tiles of 32 rows (64 would take the f32
    // operands over 110 KB of shared memory, one block per SM); bf16/f16: the model
    // dtype's tensor cores, f32 accumulation, tiles of 64 rows.
    let (mma, tile) = match dtype {
        DType::F32 | DType::F64 => ("0", "32"),
        DType::BF16 | DType::F16 => ("2", "64"),
    };
    k.set("SCAN_MMA", mma);
    k.set("CHUNK", tile);
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

/// Passes with at most this many rows per sequence, every sequence one chunk, take the
/// recurrent scan (decode steps): the chunked scan's tiles would be mostly padding. (Not
/// measured against the chunked scan at 2–4 rows.) Not with `batch_invariant`: the two
/// scans sum in different orders, and which one a sequence gets would follow the batch.
const RECURRENT_ROWS_PER_SEQ: usize = 4;

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
    scan_rows: Kernel,
    chunk_states: Kernel,
    scan_carry: Kernel,
    chunk_out: Kernel,
    gate_norm: Kernel,
    /// threads and dynamic shared memory of a chunked-scan block
    chunk_threads: u32,
    chunk_smem: u32,
}

/// A Mamba-2 model's mixers on the device.
pub struct GpuMamba2 {
    cfg: Mamba2Config,
    /// lanes per channel and channels per block of the recurrent scan
    lanes: usize,
    channels: usize,
    layers: Vec<Layer>,
    k: Kernels,
}

/// Rows per chunk of the scan, a block of the chunked scan each (the chunk states of a long
/// pass are `H·P·N` floats each): a multiple of its tiles (32 or 64 rows), at most
/// `M2_MAX_CHUNK` (256) of ssd_scan.cu.
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
    log_decay: u64,
}

impl GpuMamba2 {
    /// Upload the mixers of `w` and take their kernels from `module` (compiled from
    /// [`PROGRAM`] with [`kernel_config`]); an error when the chunked scan's shared memory
    /// does not fit `gpu`.
    /// `normed` is the dtype of the normed rows and of the matrices that read them (`norm_t`).
    pub fn upload(
        gpu: &Gpu,
        w: &Mamba2Weights,
        module: &Module,
        normed: DType,
    ) -> Result<GpuMamba2> {
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
                    in_proj: DevLinear::upload(gpu, &m.in_proj, m.in_proj_bias.as_deref(), normed)?,
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
            scan_rows: module.kernel("m2_scan_rows")?,
            chunk_states: module.kernel("m2_chunk_states")?,
            scan_carry: module.kernel("m2_scan_carry")?,
            chunk_out: module.kernel("m2_chunk_out")?,
            gate_norm: module.kernel("m2_gate_norm")?,
            chunk_threads: module.global("m2_chunk_threads")?,
            chunk_smem: module.global("m2_chunk_smem_bytes")?,
        };
        for kern in [&k.chunk_states, &k.chunk_out] {
            check_smem(gpu, kern, k.chunk_smem)?;
            kern.allow_smem(k.chunk_smem as usize)?;
        }
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
            log_decay: c.take(chunks * cfg.nheads, 4),
        }
    }

    pub fn scratch_bytes(&self, rows: usize, chunks: usize, act_bytes: usize) -> usize {
        let mut c = Carve::new(0);
        self.carve(&mut c, rows, chunks, act_bytes);
        c.used()
    }

    /// The chunked scan of a layer: each chunk's state from zero, their carry along each
    /// sequence, then every chunk's outputs and each sequence's final state (one launch
    /// when every sequence is one chunk).
    fn chunked_scan(&self, run: &LayerRun, p: &M2Scan, b: &Bufs) -> Result<()> {
        let (gpu, pass, cfg) = (run.gpu, run.pass, &self.cfg);
        let heads = cfg.nheads as u32;
        let t = pass.chunk_table();
        let grid = (pass.chunks as u32, heads, 1);
        let (threads, smem) = (self.k.chunk_threads, self.k.chunk_smem);
        let direct = i32::from(pass.one_chunk_each);
        if !pass.one_chunk_each {
            let launch = &self.k.chunk_states;
            gpu.launch(
                launch,
                grid,
                threads,
                smem,
                false,
                &[p, &t, &b.h_chunk, &b.log_decay],
            )?;
            let per_head = cfg.headdim * cfg.d_state;
            let carry_grid = (pass.seqs as u32 * heads, per_head.div_ceil(256) as u32, 1);
            let heads_i = heads as i32;
            gpu.launch(
                &self.k.scan_carry,
                carry_grid,
                256,
                0,
                false,
                &[
                    p,
                    &t.seq_chunk0,
                    &t.seq_nchunks,
                    &t.seq_state,
                    &b.h_chunk,
                    &b.log_decay,
                    &heads_i,
                ],
            )?;
        }
        gpu.launch(
            &self.k.chunk_out,
            grid,
            threads,
            smem,
            false,
            &[p, &t, &b.h_chunk, &direct, &b.y],
        )
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
        let short = pass.one_chunk_each && pass.rows <= RECURRENT_ROWS_PER_SEQ * pass.seqs;
        if short && !run.batch_invariant {
            // `channels` channels of a head per block, `lanes` threads each; z spans the head
            let block = (self.channels * self.lanes) as u32;
            let z = (cfg.headdim / self.channels) as u32;
            gpu.launch(
                &self.k.scan_rows,
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
                    &b.y,
                ],
            )?;
        } else {
            self.chunked_scan(run, &p, &b)?;
        }
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

#[cfg(test)]
mod tests {
    use super::{chunk_len, kernel_config, state_lanes};
    use crate::mixers::family_synthetic::mamba2_config;
    use crate::model::DType;

    #[test]
    fn chunks_are_whole_tiles_and_fit_the_recurrent_scan() {
        for rows in [1, 64, 16384, 16385, 1 << 20] {
            let c = chunk_len(rows);
            // the chunked scan's tiles (CHUNK: 32 rows for f32, 64 for 16-bit models) divide
            // a chunk, and the recurrent scan's staging holds one (M2_MAX_CHUNK)
            assert!(c.is_multiple_of(64) && c <= 256, "rows {rows}: chunk {c}");
        }
    }

    #[test]
    fn kernel_config_picks_the_products_and_refuses_what_the_tiles_cannot_hold() {
        let cfg = mamba2_config(64, 16, 2, 128);
        let get = |dtype| {
            let k = kernel_config(&cfg, dtype).unwrap();
            let d = |n: &str| k.define(n).unwrap().to_string();
            (d("SCAN_MMA"), d("CHUNK"), d("HEADDIM"), d("DSTATE"))
        };
        let s = |v: &str| v.to_string();
        assert_eq!(get(DType::F32), (s("0"), s("32"), s("16"), s("128")));
        assert_eq!(get(DType::BF16), (s("2"), s("64"), s("16"), s("128")));
        assert_eq!(get(DType::F16), (s("2"), s("64"), s("16"), s("128")));
        let wide = mamba2_config(256, 256, 1, 128);
        let e = kernel_config(&wide, DType::BF16).unwrap_err().to_string();
        assert!(e.contains("headdim 256") && e.contains("up to 128"), "{e}");
        assert_eq!(state_lanes(128), Some(32));
    }
}
