//! Device buffers of one training shape (`batch` windows of `seq_len` tokens): what the
//! forward keeps for the backward, per layer, and the backward's scratch. Activations that
//! feed a GEMM are in the activation dtype (`act`, 2 or 4 bytes); everything else is f32.

use crate::cuda::context::{DevBuf, Gpu};
use crate::cuda::kernels::proj_ld;
use crate::engine::cuda::work::Layout;
use crate::engine::LogitsWant;
use crate::error::Result;
use crate::model::Dims;

/// One layer's saved forward values.
pub struct LayerActs {
    /// residual entering the layer, f32 `[rows, D_m]`
    pub r_in: DevBuf,
    /// its RMSNorm, the in_proj input (act)
    pub xin: DevBuf,
    /// in_proj output f32 `[rows, proj_ld]`
    pub proj: DevBuf,
    /// normed B̄, C̄ f32 `[rows, 2·G·N]`
    pub bcn: DevBuf,
    /// per (row, head) {Δ, γ, c, Lc}
    pub tok: DevBuf,
    /// θ `[rows, S]`, the phase entering each chunk `[chunks, H, S]`
    pub theta: DevBuf,
    pub phi0: DevBuf,
    /// the state entering each chunk `[chunks, H, P, N]`
    pub sbuf: DevBuf,
    /// y before the gate f32, and the gated output o (act) `[rows, D_i]`
    pub y_pre: DevBuf,
    pub o: DevBuf,
    pub mlp: Option<MlpActs>,
}

pub struct MlpActs {
    pub r_mid: DevBuf,
    pub xin: DevBuf,
    /// fc1 output `[v | g]` f32 `[rows, 2·hidden]`
    pub vg: DevBuf,
    /// v ⊙ silu(g) (act) `[rows, hidden]`
    pub act: DevBuf,
}

pub struct Acts {
    pub batch: usize,
    pub seq_len: usize,
    pub rows: usize,
    pub layout: Layout,
    pub layers: Vec<LayerActs>,
    pub tokens: DevBuf,
    pub targets: DevBuf,
    /// residual stream f32 `[rows, D_m]` (after the forward: the final residual)
    pub res: DevBuf,
    pub hfin: DevBuf,
    pub logits: DevBuf,
    pub dlogits: DevBuf,
    pub losses: DevBuf,
    // scan tables and scratch
    pub chunks: DevBuf,
    pub segs: DevBuf,
    pub order: DevBuf,
    pub seqs: DevBuf,
    pub csum: DevBuf,
    pub sdecay: DevBuf,
    /// zeroed per-sequence states (the forward starts every window from zero) and their
    /// addresses
    pub states: DevBuf,
    pub state_ptrs: DevBuf,
    // backward scratch
    pub dres: DevBuf,
    /// dres (or dproj, dvg) as a 16-bit GEMM operand
    pub dact16: DevBuf,
    pub dn: DevBuf,
    pub d_o: DevBuf,
    pub dy: DevBuf,
    pub dproj: DevBuf,
    pub dq: DevBuf,
    pub dk: DevBuf,
    pub dphi: DevBuf,
    pub tokg: DevBuf,
    pub dd_part: DevBuf,
    /// per-row contributions to a parameter gradient, `[rows, max(D_m, D_i, 2·hidden)]`
    pub contrib: DevBuf,
    /// B/C norm weights' contributions `[2, rows, G, N]`
    pub bc_rows: DevBuf,
    /// column-sum partials
    pub colsum: DevBuf,
    pub dact: DevBuf,
    pub dvg: DevBuf,
}

impl Acts {
    pub fn new(gpu: &Gpu, d: &Dims, act: usize, batch: usize, seq_len: usize) -> Result<Acts> {
        let rows = batch * seq_len;
        let layout = Layout::with_segments(&vec![seq_len; batch], d, 1, LogitsWant::All);
        let nch = layout.chunks.len();
        let (dm, di, h, s, n, p) = (
            d.d_model,
            d.d_inner,
            d.nheads,
            d.num_rope_angles,
            d.d_state,
            d.headdim,
        );
        let hid = d.mlp_hidden;
        let f = |k: usize| gpu.alloc::<f32>(k.max(1));
        let a = |k: usize| gpu.alloc::<u8>((k * act).max(1));
        let mut layers = Vec::with_capacity(d.n_layer);
        for _ in 0..d.n_layer {
            layers.push(LayerActs {
                r_in: f(rows * dm)?,
                xin: a(rows * dm)?,
                proj: f(rows * proj_ld(d))?,
                bcn: f(rows * 2 * d.ngroups * n)?,
                tok: f(rows * h * 4)?,
                theta: f(rows * s)?,
                phi0: f(nch * h * s)?,
                sbuf: f(nch * h * p * n)?,
                y_pre: f(rows * di)?,
                o: a(rows * di)?,
                mlp: if hid > 0 {
                    Some(MlpActs {
                        r_mid: f(rows * dm)?,
                        xin: a(rows * dm)?,
                        vg: f(rows * 2 * hid)?,
                        act: a(rows * hid)?,
                    })
                } else {
                    None
                },
            });
        }
        let widest = dm.max(di).max(2 * hid).max(d.d_in_proj);
        let state_elems = d.n_layer * d.state_elems_per_layer();
        let states = f(batch * state_elems)?;
        let ptrs: Vec<u64> = (0..batch)
            .map(|b| states.at::<f32>(b * state_elems))
            .collect();
        let acts = Acts {
            batch,
            seq_len,
            rows,
            layers,
            tokens: gpu.alloc::<u32>(rows)?,
            targets: gpu.alloc::<u32>(rows)?,
            res: f(rows * dm)?,
            hfin: a(rows * dm)?,
            logits: f(rows * d.vocab_padded)?,
            dlogits: a(rows * d.vocab_padded)?,
            losses: f(rows)?,
            chunks: gpu.upload(&layout.chunks)?,
            segs: gpu.upload(&layout.segs)?,
            order: gpu.upload(&layout.order)?,
            seqs: gpu.upload(&layout.seqs)?,
            csum: f(nch * h * s)?,
            sdecay: f(nch * h)?,
            states,
            state_ptrs: gpu.upload(&ptrs)?,
            dres: f(rows * dm)?,
            dact16: a(rows * widest)?,
            dn: f(rows * dm)?,
            d_o: f(rows * di)?,
            dy: f(rows * di)?,
            dproj: f(rows * proj_ld(d))?,
            dq: f(rows * h * n)?,
            dk: f(rows * h * n)?,
            dphi: f(rows * h * s)?,
            tokg: f(rows * h * 4)?,
            dd_part: f(batch * h)?,
            contrib: f(rows * widest)?,
            bc_rows: f(2 * rows * d.ngroups * n)?,
            colsum: f(rows.div_ceil(COLSUM_ROWS) * widest.max(h * n))?,
            dact: f(rows * hid)?,
            dvg: a(rows * 2 * hid)?,
            layout,
        };
        Ok(acts)
    }
}

/// Rows per column-sum partial (`COLSUM_ROWS` in kernels/train.cu).
pub const COLSUM_ROWS: usize = 64;
