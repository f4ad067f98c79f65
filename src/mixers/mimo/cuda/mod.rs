//! Mamba-3 MIMO on the GPU (spec-MIMO §2, the maths in `super`'s module doc): one layer of a
//! packed pass as launches — the in_proj, out_proj and GatedMLP products on cuBLASLt
//! (model-dtype inputs, f32 outputs), and the mixer between them in `kernels/mimo.cu`:
//! per-row preprocessing, the phases along each sequence, the scan, the state's last keys,
//! the rank-combining gate. The LM around the layers is the engine's
//! (`crate::engine::cuda::family`).
//!
//! The scan is the chunked matrix form of `super::prefill` on the tensor cores
//! (`kernels/mimo_chunk.cu`): a tile of `CHUNK / R` tokens is `CHUNK` pseudo-rows (token,
//! rank), and the intra-chunk product `Q̃K̃ᵀ`, its product with the values, the readout of
//! the entering state and the state update are warp-level matrix products on
//! shared-memory tiles (`scan_tiles.cuh`, shared with Mamba-2's and SISO's scans): exact
//! f32 FMA for f32 models, TF32 for bf16 ones, f16 for f16 ones, f32 accumulation
//! (`scan_products`). Chunk states from zero, their carry along each sequence (seeded with
//! the boundary fold), then the outputs, each tile ending with the rank-combining gate —
//! one launch when every sequence is one chunk. Passes of at most
//! `RECURRENT_ROWS_PER_SEQ` rows per sequence, every sequence one chunk (decode steps),
//! take the fused step instead (`kernels/mimo_step.cu`): the recurrent form, with the
//! preprocessing, phases, gate and state tail of the pass, in one launch — the chunked
//! scan's tiles would be mostly padding, and each launch it replaces is mostly
//! latency at batch 1 — except with `batch_invariant`, where every pass takes the chunked
//! scan.

pub mod fused;

use super::weights::{MimoDims, MimoWeights};
use crate::cuda::context::{DevBuf, Gpu, KArg, Kernel};
use crate::cuda::kernels::{
    check_smem, KernelConfig, Module, Program, CHUNK_SCAN, DTYPES, LANES, SCAN_TILES,
};
use crate::cuda::packed::{ptr_or_null, upload_opt, Carve, DevLinear, LayerRun, Table};
use crate::error::{Error, Result};
use crate::mixers::mamba1::cuda::{act_define, LM_ROWS};
use crate::model::config::{AActivation, NORM_EPS};
use crate::model::DType;

const MIMO_SCAN: (&str, &str) = ("mimo_scan.cuh", include_str!("kernels/mimo_scan.cuh"));
const MIMO_STEP: (&str, &str) = ("mimo_step.cu", include_str!("kernels/mimo_step.cu"));

pub const PROGRAM: Program = Program {
    name: "Mamba-3 MIMO",
    head: "",
    sources: &[
        DTYPES,
        LANES,
        LM_ROWS,
        SCAN_TILES,
        CHUNK_SCAN,
        MIMO_SCAN,
        ("mimo.cu", include_str!("kernels/mimo.cu")),
        ("mimo_chunk.cu", include_str!("kernels/mimo_chunk.cu")),
        MIMO_STEP,
    ],
    parts: &[0],
};

/// Training (`crate::train::cuda`): the mixer's forward that keeps activations and its exact
/// backward, token by token per (sequence, head) in f32 — a port of `super::train`.
/// Standalone: every size is a kernel argument, so one compiled program serves every shape.
pub const TRAINING: Program = Program {
    name: "Mamba-3 MIMO training",
    head: "",
    sources: &[("mimo_train.cu", include_str!("kernels/mimo_train.cu"))],
    parts: &[0],
};

/// The lanes that hold one channel's state in the fused step (`MIMO_Q`): the largest power of two
/// ≤ 32 dividing `N/2` (so that the rotation pairs `(n, n + N/2)` meet in one lane). `None`
/// for an odd `N`, or when a lane would hold over 64 entries.
pub fn state_lanes(d_state: usize) -> Option<usize> {
    if d_state < 2 || !d_state.is_multiple_of(2) {
        return None;
    }
    let q = (0..=5)
        .rev()
        .map(|k| 1usize << k)
        .find(|q| (d_state / 2).is_multiple_of(*q))?;
    (d_state / q <= 64).then_some(q)
}

/// The compile-time constants of a MIMO model's kernels; an error naming the size the scan
/// cannot hold.
pub fn kernel_config(d: &MimoDims, dtype: DType) -> Result<KernelConfig> {
    let lanes = state_lanes(d.d_state).ok_or_else(|| {
        Error::input(format!(
            "d_state {}: the GPU MIMO scan needs an even d_state = s·2^k with 2s ≤ 64 (k ≤ 6)",
            d.d_state
        ))
    })?;
    if d.rank > 8 {
        return Err(Error::input(format!(
            "mimo_rank {}: the GPU MIMO scan holds at most 8 ranks per thread",
            d.rank
        )));
    }
    // The chunked scan's tiles (src/cuda/kernels/scan_tiles.cuh) hold at most 128 channels.
    if d.headdim > 128 {
        return Err(Error::input(format!(
            "headdim {}: the GPU MIMO scan supports headdim up to 128",
            d.headdim
        )));
    }
    let mut k = KernelConfig { defines: vec![] };
    k.set("ACT", act_define(dtype));
    k.set("DSTATE", &d.d_state.to_string());
    k.set("HEADDIM", &d.headdim.to_string());
    k.set("MIMO_R", &d.rank.to_string());
    k.set("MIMO_Q", &lanes.to_string());
    k.set("NANGLES", "0"); // (the chunked scan rotates as it builds its tiles)
    let (mma, tile) = scan_products(dtype);
    k.set("SCAN_MMA", mma);
    k.set("CHUNK", tile);
    // (`MAMBA3_GPU_DEFINES`, e.g. "SCAN_MMA=2 CHUNK=64" for bf16 operands, measures a
    // variant without a rebuild)
    Ok(k.tuned())
}

/// The chunked scan's products (`SCAN_MMA`) and pseudo-rows per tile (`CHUNK`, `CHUNK / R`
/// tokens). f32 models: exact f32 FMA. bf16 models: TF32 tensor cores — bf16 operands (8
/// bits of mantissa) were what took a first MIMO tensor-core scan's states past the 3e-2
/// the GPU is held to against the CPU (docs/decisions.md, "MIMO tensor-core scan"), and
/// f16 ones would need SISO's per-chunk scaling against overflow. f16 models: their own
/// f16 on the tensor cores, as Mamba-2's. f32 operands in tiles of 32 (64 would take them
/// over 110 KB of shared memory at d_state 128, one block per SM), f16 ones in tiles of
/// 64 (the official MIMO chunk of 64/R tokens); f32 accumulation in every mode.
fn scan_products(dtype: DType) -> (&'static str, &'static str) {
    match dtype {
        DType::F32 | DType::F64 => ("0", "32"),
        DType::BF16 => ("1", "32"),
        DType::F16 => ("2", "64"),
    }
}

/// Passes with at most this many rows per sequence, every sequence one chunk, take the
/// fused step (decode steps): the chunked scan's tiles would be mostly padding. Not
/// with `batch_invariant`: the two scans sum in different orders, and which one a sequence
/// gets would follow the batch.
const RECURRENT_ROWS_PER_SEQ: usize = 4;

/// Rows (tokens) per chunk of the scan, a block of the chunked scan each, walked in tiles of
/// `CHUNK / R` tokens (the chunk states of a long pass are `H·P·N` floats each), for a pass
/// of `rows` rows in `seqs` sequences of a model of `heads` heads on a GPU that holds
/// `slots` blocks of the scan at once. Every sequence is one chunk when its heads fill
/// between 5/4 of the SMs and every slot: one wave whose blocks walk whole sequences skips
/// the chunk states and their carry (a third of the chunked scan's work) and beats the
/// chunked scan's better balance — B=8 T=4096 at the 187M shape on an H100 (192 blocks, 264
/// slots): 158.9 ms against 173.9 ms in chunks of 256 (docs/decisions.md, "MIMO prefill:
/// where the scan's time went, and whole sequences per block"). Not under
/// `batch_invariant`: whether a sequence's scan is cut would follow its batch.
fn chunk_len(
    rows: usize,
    seqs: usize,
    heads: usize,
    slots: usize,
    sms: usize,
    batch_invariant: bool,
) -> usize {
    if let Some(n) = crate::options::env().mimo_chunk {
        return n;
    }
    let blocks = seqs * heads;
    if !batch_invariant && 4 * blocks >= 5 * sms && blocks <= slots {
        return rows.max(1);
    }
    if rows <= 16384 {
        64
    } else {
        256
    }
}

/// The kernels' arguments (`MimoScan` in mimo.cu: the same fields in the same order).
#[repr(C)]
#[derive(Clone, Copy)]
struct MimoScan {
    proj: u64,
    ld: i32,
    heads: i32,
    headdim: i32,
    groups: i32,
    angles: i32,
    x_off: i32,
    b_off: i32,
    dt_off: i32,
    a_off: i32,
    trap_off: i32,
    ang_off: i32,
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
    a_floor: f32,
    a_softplus: i32,
    eps: f32,
    bcn: u64,
    coef: u64,
    cs: u64,
    angle_off: i64,
    ssm_off: i64,
    k_off: i64,
    v_off: i64,
}

crate::cuda::context::karg!(MimoScan);

struct Mlp {
    norm: DevBuf,
    fc1: DevLinear,
    fc2: DevLinear,
}

struct Layer {
    in_proj: DevLinear,
    dt_bias: DevBuf,
    b_bias: DevBuf,
    c_bias: DevBuf,
    b_norm: DevBuf,
    c_norm: DevBuf,
    mimo_x: DevBuf,
    mimo_z: DevBuf,
    mimo_o: DevBuf,
    d: DevBuf,
    out_norm: Option<DevBuf>,
    out_proj: DevLinear,
    mlp: Option<Mlp>,
}

struct Kernels {
    pre: Kernel,
    phase: Kernel,
    step: Kernel,
    chunk_states: Kernel,
    chunk_carry: Kernel,
    chunk_out: Kernel,
    tail: Kernel,
    glu: Kernel,
    rms_norm: Kernel,
    /// threads of a fused-step block
    step_threads: u32,
    /// threads and dynamic shared memory of a chunked-scan block
    chunk_threads: u32,
    chunk_smem: u32,
    /// blocks of the chunked scan the GPU holds at once
    chunk_slots: usize,
}

/// A MIMO model's mixers (and GatedMLPs) on the device.
pub struct GpuMimo {
    d: MimoDims,
    a_floor: f32,
    a_softplus: bool,
    layers: Vec<Layer>,
    k: Kernels,
}

struct Bufs {
    proj: u64,
    bcn: u64,
    coef: u64,
    cs: u64,
    gated: u64,
    h_chunk: u64,
    log_decay: u64,
    mlp_normed: u64,
    mlp_vg: u64,
    mlp_act: u64,
}

impl GpuMimo {
    /// Upload the mixers of `w` and take their kernels from `module` (compiled from
    /// [`PROGRAM`] with [`kernel_config`]).
    /// `normed` is the dtype of the normed rows and of the matrices that read them (`norm_t`).
    pub fn upload(gpu: &Gpu, w: &MimoWeights, module: &Module, normed: DType) -> Result<GpuMimo> {
        let d = w.dims;
        let dt = w.dtype;
        let layers = w
            .layers
            .iter()
            .map(|l| {
                let mlp = l
                    .mlp
                    .as_ref()
                    .map(|m| -> Result<Mlp> {
                        Ok(Mlp {
                            norm: gpu.upload(&m.norm)?,
                            fc1: DevLinear::upload(gpu, &m.fc1, None, normed)?,
                            fc2: DevLinear::upload(gpu, &m.fc2, None, dt)?,
                        })
                    })
                    .transpose()?;
                Ok(Layer {
                    in_proj: DevLinear::upload(gpu, &l.in_proj, None, normed)?,
                    dt_bias: gpu.upload(&l.dt_bias)?,
                    b_bias: gpu.upload(&l.b_bias)?,
                    c_bias: gpu.upload(&l.c_bias)?,
                    b_norm: gpu.upload(&l.b_norm)?,
                    c_norm: gpu.upload(&l.c_norm)?,
                    mimo_x: gpu.upload(&l.mimo_x)?,
                    mimo_z: gpu.upload(&l.mimo_z)?,
                    mimo_o: gpu.upload(&l.mimo_o)?,
                    d: gpu.upload(&l.d)?,
                    out_norm: upload_opt(gpu, l.out_norm.as_deref())?,
                    out_proj: DevLinear::upload(gpu, &l.out_proj, None, dt)?,
                    mlp,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut k = Kernels {
            pre: module.kernel("mimo_pre")?,
            phase: module.kernel("mimo_phase")?,
            step: module.kernel("mimo_step")?,
            chunk_states: module.kernel("mimo_chunk_states")?,
            chunk_carry: module.kernel("mimo_chunk_carry")?,
            chunk_out: module.kernel("mimo_chunk_out")?,
            tail: module.kernel("mimo_tail")?,
            glu: module.kernel("mimo_glu")?,
            rms_norm: module.kernel("fam_rms_norm")?,
            step_threads: module.global("mimo_step_threads")?,
            chunk_threads: module.global("mimo_chunk_threads")?,
            chunk_smem: module.global("mimo_chunk_smem_bytes")?,
            chunk_slots: 0,
        };
        for kern in [&k.chunk_states, &k.chunk_out] {
            check_smem(gpu, kern, k.chunk_smem)?;
            kern.allow_smem(k.chunk_smem as usize)?;
        }
        k.chunk_slots = gpu.resident_blocks(&k.chunk_out, k.chunk_threads, k.chunk_smem)?;
        Ok(GpuMimo {
            d,
            a_floor: w.config.ssm_cfg.a_floor as f32,
            a_softplus: w.config.ssm_cfg.a_activation == AActivation::Softplus,
            layers,
            k,
        })
    }

    fn carve(&self, c: &mut Carve, rows: usize, chunks: usize, act_bytes: usize) -> Bufs {
        let d = &self.d;
        let state = d.nheads * d.headdim * d.d_state;
        Bufs {
            proj: c.take(rows * d.d_in_proj, 4),
            bcn: c.take(rows * 2 * d.bc_width(), 4),
            coef: c.take(rows * d.nheads, 16),
            cs: c.take((rows * d.nheads * d.num_rope_angles).max(1), 8),
            gated: c.take(rows * d.d_inner, act_bytes),
            h_chunk: c.take(chunks * state, 4),
            log_decay: c.take(chunks * d.nheads, 4),
            mlp_normed: c.take(rows * d.d_model * usize::from(d.mlp_hidden > 0), act_bytes),
            mlp_vg: c.take(rows * 2 * d.mlp_hidden, 4),
            mlp_act: c.take(rows * d.mlp_hidden, act_bytes),
        }
    }

    /// Rows per chunk of the scan of a pass (`chunk_len`).
    pub fn chunk_len(&self, gpu: &Gpu, rows: usize, seqs: usize, batch_invariant: bool) -> usize {
        chunk_len(
            rows,
            seqs,
            self.d.nheads,
            self.k.chunk_slots,
            gpu.sms,
            batch_invariant,
        )
    }

    pub fn scratch_bytes(&self, rows: usize, chunks: usize, act_bytes: usize) -> usize {
        let mut c = Carve::new(0);
        self.carve(&mut c, rows, chunks, act_bytes);
        c.used()
    }

    fn args(&self, w: &Layer, run: &LayerRun, b: &Bufs) -> MimoScan {
        let scratch = [b.bcn, b.coef, b.cs];
        let (proj, ld) = (b.proj, self.d.d_in_proj);
        self.scan_args(w, run.state_off, run.ssm_floats, proj, ld, scratch)
    }

    /// Layer `w`'s kernel arguments: its state at `state_off` floats into a sequence's
    /// (`ssm` `ssm_floats` long), its in_proj rows at `proj`, `ld` apart, and the long
    /// pass's scratch rows (B̄ and C̄, the coefficients, the phases).
    fn scan_args(
        &self,
        w: &Layer,
        state_off: usize,
        ssm_floats: usize,
        proj: u64,
        ld: usize,
        [bcn, coef, cs]: [u64; 3],
    ) -> MimoScan {
        let d = &self.d;
        let (h, p, n, r, s) = (d.nheads, d.headdim, d.d_state, d.rank, d.num_rope_angles);
        let angle_off = state_off;
        let ssm_off = angle_off + h * s;
        let k_off = ssm_off + ssm_floats;
        let v_off = k_off + r * h * n;
        MimoScan {
            proj,
            ld: ld as i32,
            heads: h as i32,
            headdim: p as i32,
            groups: d.ngroups as i32,
            angles: s as i32,
            x_off: d.x_off() as i32,
            b_off: d.b_off() as i32,
            dt_off: d.dt_off() as i32,
            a_off: d.a_off() as i32,
            trap_off: d.trap_off() as i32,
            ang_off: d.angle_off() as i32,
            dt_bias: w.dt_bias.ptr,
            b_bias: w.b_bias.ptr,
            c_bias: w.c_bias.ptr,
            b_norm: w.b_norm.ptr,
            c_norm: w.c_norm.ptr,
            mimo_x: w.mimo_x.ptr,
            mimo_z: w.mimo_z.ptr,
            mimo_o: w.mimo_o.ptr,
            d_skip: w.d.ptr,
            out_norm: ptr_or_null(&w.out_norm),
            a_floor: self.a_floor,
            a_softplus: i32::from(self.a_softplus),
            eps: NORM_EPS as f32,
            bcn,
            coef,
            cs,
            angle_off: angle_off as i64,
            ssm_off: ssm_off as i64,
            k_off: k_off as i64,
            v_off: v_off as i64,
        }
    }

    /// The chunked scan of a layer: each chunk's state from zero, their carry along each
    /// sequence (from the folded carried state), then every chunk's outputs and each
    /// sequence's final state (one launch when every sequence is one chunk).
    fn chunked_scan(&self, run: &LayerRun, p: &MimoScan, b: &Bufs) -> Result<()> {
        let (gpu, pass, d) = (run.gpu, run.pass, &self.d);
        let t = pass.chunk_table();
        let heads = d.nheads as u32;
        let grid = (pass.chunks as u32, heads, 1);
        let (threads, smem) = (self.k.chunk_threads, self.k.chunk_smem);
        let direct = i32::from(pass.one_chunk_each);
        if !pass.one_chunk_each {
            let args: [&dyn KArg; 4] = [p, &t, &b.h_chunk, &b.log_decay];
            gpu.launch(&self.k.chunk_states, grid, threads, smem, false, &args)?;
            let per_head = d.headdim * d.d_state;
            let carry_grid = (pass.seqs as u32 * heads, per_head.div_ceil(256) as u32, 1);
            gpu.launch(&self.k.chunk_carry, carry_grid, 256, 0, false, &args)?;
        }
        let args: [&dyn KArg; 5] = [p, &t, &b.h_chunk, &direct, &b.gated];
        gpu.launch(&self.k.chunk_out, grid, threads, smem, false, &args)
    }

    /// Layer `l` on the pass: `normed` (`norm_t`, `[rows, d_model]`) in, the mixer's
    /// output (and the GatedMLP's, when the block has one) added to `residual` (f32);
    /// `scratch` holds [`Self::scratch_bytes`].
    pub fn layer(
        &self,
        run: &LayerRun,
        l: usize,
        normed: u64,
        residual: u64,
        scratch: u64,
    ) -> Result<()> {
        let (gpu, pass, d) = (run.gpu, run.pass, &self.d);
        let rows = pass.rows;
        let w = &self.layers[l];
        let b = self.carve(&mut Carve::new(scratch), rows, pass.chunks, run.act.size());
        let grid_rows = (rows as u32, 1, 1);
        let p = self.args(w, run, &b);
        let (seq_row0, seq_len, seq_state) = (
            pass.at(Table::SeqRow0),
            pass.at(Table::SeqLen),
            pass.at(Table::SeqState),
        );

        w.in_proj.apply(run, normed, b.proj, false)?;
        let short = pass.one_chunk_each && rows <= RECURRENT_ROWS_PER_SEQ * pass.seqs;
        if short && !run.batch_invariant {
            let grid = (pass.chunks as u32, d.nheads as u32, 1);
            let (chunk_row0, chunk_len, chunk_seq) = (
                pass.at(Table::ChunkRow0),
                pass.at(Table::ChunkLen),
                pass.at(Table::ChunkSeq),
            );
            let args: [&dyn KArg; 6] = [
                &p,
                &chunk_row0,
                &chunk_len,
                &chunk_seq,
                &seq_state,
                &b.gated,
            ];
            gpu.launch(&self.k.step, grid, self.k.step_threads, 0, false, &args)?;
        } else {
            gpu.launch(&self.k.pre, grid_rows, 256, 0, false, &[&p])?;
            let phases = d.nheads * d.num_rope_angles;
            if phases > 0 {
                // a warp per (head, angle)
                let grid = (pass.seqs as u32, (32 * phases).div_ceil(128) as u32, 1);
                let args: [&dyn KArg; 4] = [&p, &seq_row0, &seq_len, &seq_state];
                gpu.launch(&self.k.phase, grid, 128, 0, false, &args)?;
            }
            self.chunked_scan(run, &p, &b)?;
            let args: [&dyn KArg; 4] = [&p, &seq_row0, &seq_len, &seq_state];
            gpu.launch(&self.k.tail, (pass.seqs as u32, 1, 1), 256, 0, false, &args)?;
        }
        w.out_proj.apply(run, b.gated, residual, true)?;

        if let Some(m) = &w.mlp {
            let (no_rows, dm, eps) = (0u64, d.d_model as i32, NORM_EPS as f32);
            let args: [&dyn KArg; 6] = [&residual, &no_rows, &m.norm.ptr, &b.mlp_normed, &dm, &eps];
            gpu.launch(&self.k.rms_norm, grid_rows, 256, 0, false, &args)?;
            m.fc1.apply(run, b.mlp_normed, b.mlp_vg, false)?;
            let width = d.mlp_hidden as i32;
            let args: [&dyn KArg; 3] = [&b.mlp_vg, &width, &b.mlp_act];
            gpu.launch(&self.k.glu, grid_rows, 256, 0, false, &args)?;
            m.fc2.apply(run, b.mlp_act, residual, true)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::kernel_config;
    use crate::mixers::mimo::{mimo_config_from_json_str, mimo_dims};
    use crate::model::DType;

    fn dims(d_state: usize, headdim: usize, rank: usize) -> super::MimoDims {
        let json = format!(
            r#"{{"d_model": 128, "n_layer": 1, "vocab_size": 100, "ssm_cfg": {{
                "layer": "Mamba3", "d_state": {d_state}, "headdim": {headdim},
                "is_mimo": true, "mimo_rank": {rank}}}}}"#
        );
        mimo_dims(&mimo_config_from_json_str(&json, "test").unwrap())
    }

    #[test]
    fn kernel_config_picks_the_products_and_refuses_what_the_tiles_cannot_hold() {
        let get = |dtype| {
            let k = kernel_config(&dims(128, 64, 4), dtype).unwrap();
            let d = |n: &str| k.define(n).unwrap().to_string();
            (
                d("SCAN_MMA"),
                d("CHUNK"),
                d("HEADDIM"),
                d("DSTATE"),
                d("MIMO_R"),
            )
        };
        let s = |v: &str| v.to_string();
        assert_eq!(
            get(DType::F32),
            (s("0"), s("32"), s("64"), s("128"), s("4"))
        );
        assert_eq!(
            get(DType::BF16),
            (s("1"), s("32"), s("64"), s("128"), s("4"))
        );
        assert_eq!(
            get(DType::F16),
            (s("2"), s("64"), s("64"), s("128"), s("4"))
        );
        let e = kernel_config(&dims(64, 256, 2), DType::BF16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("headdim 256") && e.contains("up to 128"), "{e}");
        let e = kernel_config(&dims(64, 16, 9), DType::F32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mimo_rank 9") && e.contains("at most 8"), "{e}");
    }
}
