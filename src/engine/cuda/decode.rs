//! The GPU decode step (spec §3.3): embedding, every layer, final norm and LM head for a
//! batch of one-token sequences, each with its own state. Per layer, for batches of up to
//! `GEMV_MAX_ROWS`: the in_proj GEMV with the RMSNorm fused on its input, `mixer_step`, the
//! out_proj GEMV adding into the residual (and the MLP's two GEMVs) — or, for 16-bit
//! models and batches whose heads fit in one block per SM, all layers in one cooperative
//! launch (kernels/decode_layers.cu, bit-identical; `GpuOptions::fused_decode`). Larger
//! batches run the projections through cuBLASLt. A batch that takes the launch per kernel
//! may be cut into lanes of rows on streams of their own (`GpuOptions::decode_lanes`): one
//! lane's projections, latency-bound at these sizes, then overlap another lane's work.
//! CPU twin: `CpuModel::forward` with one token per sequence (src/engine/cpu.rs).

use super::forward::Pipe;
use super::work::{Work, GEMV_MAX_ROWS};
use crate::cuda::context::{DevBuf, Gpu, MAX_LANES};
use crate::cuda::gemm::ElemType;
use crate::cuda::kernels::proj_ld;
use crate::error::Result;

/// Input rows the f32 GEMV stages in shared memory at a time (`GEMV_BG` in kernels/gemv.cu).
const GEMV_BG: usize = 4;

impl Pipe<'_> {
    /// One decode step for `nb` sequences (tokens and state addresses already in `work`);
    /// logits land in `work.logits` rows `0..nb`.
    pub fn decode(&self, work: &Work, nb: usize) -> Result<()> {
        self.embed(work, nb)?;
        if self.decode_fused(work, nb)? {
            return self.decode_head(work, nb);
        }
        // Lanes: the rows cut into contiguous runs, each through every layer on its own
        // stream (they share nothing but the weights). The head runs once for the whole
        // batch: per lane it would read its weights (the embedding, for a tied head) again.
        // One lane runs on the main stream, several on side streams 1 … lanes.
        let lanes = decode_lanes(self.opts.decode_lanes, nb, self.probe || self.timed);
        if lanes == 1 {
            self.decode_rows(work, 0, nb)?;
        } else {
            self.gpu.fork_lanes(lanes)?;
            for lane in 0..lanes {
                let (r0, r1) = (nb * lane / lanes, nb * (lane + 1) / lanes);
                Pipe {
                    lane: lane + 1,
                    ..*self
                }
                .decode_rows(work, r0, r1 - r0)?;
            }
            self.gpu.join_lanes(lanes)?;
        }
        self.decode_head(work, nb)
    }

    /// Every layer for rows `r0 … r0 + nb`: at once, or batch-invariant in groups the GEMV
    /// takes (a row's products then never depend on the batch: `GpuOptions::batch_invariant`).
    fn decode_rows(&self, work: &Work, r0: usize, nb: usize) -> Result<()> {
        if !self.opts.batch_invariant {
            return self.decode_layers(work, r0, nb);
        }
        for g in (0..nb).step_by(GEMV_MAX_ROWS) {
            self.decode_layers(work, r0 + g, GEMV_MAX_ROWS.min(nb - g))?;
        }
        Ok(())
    }

    /// Every layer, one launch per kernel, for rows `r0 … r0 + nb` of the batch.
    fn decode_layers(&self, work: &Work, r0: usize, nb: usize) -> Result<()> {
        let d = &self.d;
        let gemv = nb <= GEMV_MAX_ROWS;
        let res = work.res.at::<f32>(r0 * d.d_model);
        let proj = work.proj.at::<f32>(r0 * proj_ld(d));
        let states = work.states.at::<u64>(r0);
        let yf = work.yf.at::<f32>(r0 * d.d_inner);
        let y = self.act_at(&work.y, r0 * d.d_inner);
        let vg = work.vg.at::<f32>(r0 * 2 * d.mlp_hidden);
        for (l, lw) in self.w.layers.iter().enumerate() {
            let layer = l as i32;
            if gemv {
                self.gemv(
                    res,
                    lw.norm.ptr,
                    lw.in_proj.ptr,
                    (proj, proj_ld(d)),
                    nb,
                    d.d_in_proj,
                    d.d_model,
                    1,
                    false,
                )?;
            } else {
                self.in_proj_gemm(work, l, (r0, nb), ElemType::F32)?;
            }
            let (yf, ya) = if gemv { (yf, 0u64) } else { (0u64, y) };
            // Bound by the state traffic: at the least priority, behind the projections of
            // the other lanes (src/cuda/context.rs).
            Pipe {
                background: true,
                ..*self
            }
            .launch(
                &self.k.mixer_step,
                (d.nheads as u32, nb as u32, 1),
                256,
                0,
                &[
                    &proj,
                    &lw.b_norm.ptr,
                    &lw.c_norm.ptr,
                    &lw.dt_bias.ptr,
                    &lw.b_bias.ptr,
                    &lw.c_bias.ptr,
                    &lw.d.ptr,
                    &lw.out_norm.as_ref().map_or(0, |b| b.ptr),
                    &states,
                    &layer,
                    &yf,
                    &ya,
                ],
            )?;
            if gemv {
                self.gemv(
                    yf,
                    0,
                    lw.out_proj.ptr,
                    (res, d.d_model),
                    nb,
                    d.d_model,
                    d.d_inner,
                    0,
                    true,
                )?;
                if let Some(m) = &lw.mlp {
                    let hid = d.mlp_hidden;
                    self.gemv(
                        res,
                        m.norm.ptr,
                        m.fc1.ptr,
                        (vg, 2 * hid),
                        nb,
                        2 * hid,
                        d.d_model,
                        1,
                        false,
                    )?;
                    self.gemv(
                        vg,
                        0,
                        m.fc2.ptr,
                        (res, d.d_model),
                        nb,
                        d.d_model,
                        hid,
                        2,
                        true,
                    )?;
                }
            } else {
                self.out_proj_gemm(work, l, r0, nb)?;
                self.mlp_gemm(work, l, r0, nb)?;
            }
            self.look("decode layer", Some(l), res, nb, d.d_model, d.d_model, true)?;
        }
        Ok(())
    }

    /// Every layer of the step in one cooperative launch (kernels/decode_layers.cu), when
    /// the options, the model and the batch allow it; false (nothing launched) otherwise.
    fn decode_fused(&self, work: &Work, nb: usize) -> Result<bool> {
        let fused = self.k.decode_layers.get(usize::from(nb > 8));
        let (Some(Some((kern, smem))), Some(table)) = (fused, &self.w.layer_table) else {
            return Ok(false);
        };
        let (smem, grid) = (*smem, self.gpu.sms);
        // One block per SM: with more (head, sequence) pairs than blocks, some blocks walk
        // two heads one after the other and the launch per kernel is faster (measured:
        // docs/decisions.md, "Fused decode step"), so the fused step is for batches whose heads fit in one wave.
        if !self.opts.fused_decode
            || self.probe
            || nb > GEMV_MAX_ROWS
            || self.d.nheads * nb > grid
            || smem as usize > self.gpu.max_smem
        {
            return Ok(false);
        }
        let (layers, nb_i) = (self.w.layers.len() as i32, nb as i32);
        let phases = self.w.layers.len() * if self.d.mlp_hidden > 0 { 5 } else { 3 };
        let trace = Trace::new(self.gpu, phases, grid)?;
        self.gpu.launch_cooperative(
            kern,
            grid as u32,
            256,
            smem,
            self.opts.pdl,
            &[
                &table.ptr,
                &layers,
                &work.res.ptr,
                &work.proj.ptr,
                &work.yf.ptr,
                &work.vg.ptr,
                &work.states.ptr,
                &nb_i,
                &work.sync.ptr,
                &trace.ptr(),
            ],
        )?;
        trace.write(self.gpu)?;
        Ok(true)
    }

    /// The final norm and the LM head of a decode step (GEMV for small batches).
    fn decode_head(&self, work: &Work, nb: usize) -> Result<()> {
        let d = &self.d;
        let vp = d.vocab_padded;
        if nb <= GEMV_MAX_ROWS || self.opts.batch_invariant {
            for g in (0..nb).step_by(GEMV_MAX_ROWS) {
                self.gemv(
                    work.res.at::<f32>(g * d.d_model),
                    self.w.norm_f.ptr,
                    self.w.head().ptr,
                    (work.logits.at::<f32>(g * vp), vp),
                    GEMV_MAX_ROWS.min(nb - g),
                    vp,
                    d.d_model,
                    1,
                    false,
                )?;
            }
        } else {
            self.head_gemm(work, nb, 0)?;
        }
        self.look("decode head", None, work.logits.ptr, nb, vp, vp, true)
    }

    /// `out[b] (+)= transform(in[b]) · Wᵀ` (kernels/gemv.cu: `gemv_tc_*` on tensor cores for
    /// 16-bit models, else `gemv_*`; by input width `k`).
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
        let (nb_i, n_i, acc_i) = (nb as i32, n as i32, i32::from(acc));
        let which = if k == d.d_model {
            0
        } else if k == d.d_inner {
            1
        } else {
            2
        };
        // 16-bit models always take the tensor-core GEMV, whatever the batch: a row's result
        // must not depend on how many rows share the launch (graph buckets pad batches).
        if let Some((kern, smem)) = &self.k.gemv_tc[which] {
            let smem = smem[usize::from(nb > 8)];
            if smem as usize <= self.gpu.max_smem {
                return self.launch(
                    kern,
                    (n.div_ceil(16) as u32, 1, 1),
                    256,
                    smem,
                    &[&input, &nw, &w, &out, &ldo, &nb_i, &n_i, &mode, &acc_i],
                );
            }
        }
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
        let smem = (GEMV_BG * k * 4) as u32;
        self.launch(
            kern,
            (n.div_ceil(8) as u32, 1, 1),
            256,
            smem,
            &[&input, &nw, &w, &out, &ldo, &nb_i, &n_i, &mode, &acc_i],
        )
    }
}

/// Lanes of a decode batch of `nb` that runs one launch per kernel: `option` when it is
/// not 0 (at most one per row), else by the batch, as measured on the H200 at d_model 768
/// (docs/decisions.md, "Decode lanes"): two lanes of at most 8 rows from 6 to 16 rows, one from 17 to 32,
/// two above. Lanes of one or two rows lose; so do lanes of 9 – 16 rows (the GEMV's slow
/// two-tile form). Four lanes of 8 gain 3–6 % at 24 – 32 rows in a CUDA graph, but
/// launched eagerly each lane's launches cost the host as much as the whole step's (the
/// server decodes batches past its graphs eagerly: 31 rows in four lanes took 1.93–1.98 ms
/// per step, in one 1.63–1.64), and eager and replayed steps must compute the same. `sync`
/// (probing or timing every step) waits on the main stream only, so it takes one.
fn decode_lanes(option: usize, nb: usize, sync: bool) -> usize {
    let lanes = match (option, nb) {
        _ if sync => 1,
        (0, 6..=16) => 2,
        (0, 0..=32) => 1,
        (0, _) => 2,
        (n, _) => n,
    };
    lanes.clamp(1, MAX_LANES).min(nb.max(1))
}

/// Times per (phase, block) of the fused decode (kernels/decode_layers.cu): entered,
/// waited, arrived, and two marks in between (after staging a GEMV's input, whose tiles end
/// at the arrival; after loading the in_proj row and after the rotation of the mixer).
const FUSED_MARKS: usize = 5;

/// `MAMBA3_GPU_TRACE=FILE`, a diagnostic of the fused decode: the times of the last eager
/// step, one line per (phase, block): `phase block t…` in ns of the GPU's global timer, 0
/// where a block had no work or a mark does not apply (scripts/trace_summary.py reads it).
/// Nothing is allocated or written without it.
struct Trace {
    /// the file and the device buffer, when tracing
    on: Option<(std::path::PathBuf, DevBuf)>,
    grid: usize,
}

impl Trace {
    fn new(gpu: &Gpu, phases: usize, grid: usize) -> Result<Trace> {
        let path = &crate::options::env().gpu_trace;
        let on = match path {
            Some(p) => {
                let buf = gpu.alloc::<u64>(phases * grid * FUSED_MARKS)?;
                gpu.zero(buf.ptr, buf.bytes)?;
                Some((p.clone(), buf))
            }
            None => None,
        };
        Ok(Trace { on, grid })
    }

    /// The kernel's trace argument (0: off).
    fn ptr(&self) -> u64 {
        self.on.as_ref().map_or(0, |(_, b)| b.ptr)
    }

    fn write(self, gpu: &Gpu) -> Result<()> {
        let Some((path, buf)) = self.on else {
            return Ok(());
        };
        gpu.sync()?;
        let mut v = vec![0u64; buf.bytes / 8];
        gpu.dtoh(buf.ptr, &mut v)?;
        let mut out = String::new();
        for (i, r) in v.chunks(FUSED_MARKS).enumerate() {
            let times: Vec<String> = r.iter().map(u64::to_string).collect();
            out += &format!("{} {} {}\n", i / self.grid, i % self.grid, times.join(" "));
        }
        std::fs::write(&path, out).map_err(|e| crate::error::Error::io(&path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::decode_lanes;

    #[test]
    fn lanes_by_batch() {
        let auto: Vec<usize> = [1, 2, 5, 6, 8, 9, 16, 17, 24, 32, 33, 64, 128]
            .iter()
            .map(|&nb| decode_lanes(0, nb, false))
            .collect();
        assert_eq!(auto, [1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 2, 2, 2]);
        assert_eq!(decode_lanes(3, 64, false), 3);
        assert_eq!(decode_lanes(4, 2, false), 2);
        assert_eq!(decode_lanes(0, 64, true), 1);
    }
}
