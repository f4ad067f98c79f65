//! The host-side tables of one pass (how a packed batch is cut into chunks and segments)
//! and the device buffers a pass works in.
//!
//! Rows of the packed batch are sequence after sequence, no padding. Each sequence is cut
//! into chunks of `chunk_len` tokens (its last chunk may be short); consecutive chunks of a
//! sequence form segments, the unit of parallel work of the scan (kernels/scan.cu). The
//! segment length is chosen so that segments × heads fills the GPU a few times over.

use super::context::{DevBuf, Gpu};
use crate::cpu::LogitsWant;
use crate::error::Result;
use crate::model::Dims;
use std::sync::OnceLock;

/// The tables of one pass, as uploaded (int4 rows; see the kernels' docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub rows: usize,
    /// {start row, tokens, sequence end row, sequence}
    pub chunks: Vec<[i32; 4]>,
    /// {first chunk, chunks, sequence, flags (1 first, 2 last)}
    pub segs: Vec<[i32; 4]>,
    /// {first chunk, chunks, first segment, segments}
    pub seqs: Vec<[i32; 4]>,
    /// rows whose logits are wanted, in output order
    pub picked: Vec<i32>,
    /// (start, len) of each sequence
    pub spans: Vec<(usize, usize)>,
}

impl Layout {
    /// The layout of sequences of `lens` tokens; `slots` is how many scan blocks the GPU
    /// runs at once (SMs × blocks per SM).
    /// `MAMBA3_GPU_CHUNKS_PER_SEGMENT=N` replaces the model's choice (for measuring).
    pub fn new(lens: &[usize], d: &Dims, slots: usize, want: LogitsWant) -> Layout {
        static FORCED: OnceLock<Option<usize>> = OnceLock::new();
        let forced = FORCED.get_or_init(|| {
            std::env::var("MAMBA3_GPU_CHUNKS_PER_SEGMENT")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
        });
        let per_seg =
            forced.unwrap_or_else(|| chunks_per_segment(lens, d.chunk_len, d.nheads, slots.max(1)));
        Layout::with_segments(lens, d, per_seg, want)
    }

    /// The layout with segments of `per_seg` chunks (training takes 1: the scan then
    /// leaves the state entering every chunk in `sbuf`, which the backward needs).
    pub fn with_segments(lens: &[usize], d: &Dims, per_seg: usize, want: LogitsWant) -> Layout {
        let l = d.chunk_len;
        let per_seg = per_seg.max(1);
        let mut lay = Layout {
            rows: 0,
            chunks: vec![],
            segs: vec![],
            seqs: vec![],
            picked: vec![],
            spans: vec![],
        };
        for (s, &n) in lens.iter().enumerate() {
            let start = lay.rows;
            let nc = n.div_ceil(l);
            let first_chunk = lay.chunks.len();
            for c in 0..nc {
                let a = start + c * l;
                lay.chunks.push([
                    a as i32,
                    (l.min(n - c * l)) as i32,
                    (start + n) as i32,
                    s as i32,
                ]);
            }
            // Split the chunks evenly into ceil(nc / per_seg) segments.
            let ns = nc.div_ceil(per_seg);
            let first_seg = lay.segs.len();
            let mut c0 = 0;
            for i in 0..ns {
                let cnt = nc / ns + usize::from(i < nc % ns);
                let flags = i32::from(i == 0) | (i32::from(i + 1 == ns) << 1);
                lay.segs
                    .push([(first_chunk + c0) as i32, cnt as i32, s as i32, flags]);
                c0 += cnt;
            }
            lay.seqs
                .push([first_chunk as i32, nc as i32, first_seg as i32, ns as i32]);
            match want {
                LogitsWant::All => lay.picked.extend((start..start + n).map(|r| r as i32)),
                LogitsWant::Last => lay.picked.push((start + n - 1) as i32),
                LogitsWant::None => {}
            }
            lay.spans.push((start, n));
            lay.rows += n;
        }
        lay
    }

    /// A layout of `n` one-token sequences (decode).
    pub fn decode(n: usize, d: &Dims) -> Layout {
        Layout::new(&vec![1; n], d, 1, LogitsWant::Last)
    }
}

/// Chunks per segment, by a model of the scan's makespan: phase C runs every segment,
/// phase A (about 0.4 of its work per chunk) every segment but a sequence's last, each in
/// waves of `slots` blocks of (segment, head), and every block costs about a third of a
/// chunk more (its state read and written, its step of phase B). More segments mean
/// shorter blocks but more phase-A work; for a long batch one segment per sequence is
/// best, for one long prompt about as many segments as there are free slots per head.
/// (Calibrated on the H200 at d_state 128: docs/benchmarks.md, "segments".)
fn chunks_per_segment(lens: &[usize], chunk: usize, heads: usize, slots: usize) -> usize {
    const BLOCK_COST: f64 = 0.3;
    const PHASE_A: f64 = 0.4;
    let chunks: Vec<usize> = lens.iter().map(|n| n.div_ceil(chunk)).collect();
    let longest = chunks.iter().copied().max().unwrap_or(1).max(1);
    let cost = |per: usize| {
        let c_blocks: usize = chunks.iter().map(|c| c.div_ceil(per)).sum::<usize>() * heads;
        let a_blocks = c_blocks - chunks.len() * heads;
        // waves × chunks per block
        let per = per.min(longest) as f64 + BLOCK_COST;
        (a_blocks.div_ceil(slots) as f64 * PHASE_A + c_blocks.div_ceil(slots) as f64) * per
    };
    (1..=longest)
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(b.cmp(&a)))
        .unwrap_or(1)
}

/// Sizes a `Work` can hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    pub rows: usize,
    pub chunks: usize,
    pub segs: usize,
    pub seqs: usize,
    pub picked: usize,
}

impl Caps {
    pub fn of(l: &Layout) -> Caps {
        Caps {
            rows: l.rows,
            chunks: l.chunks.len(),
            segs: l.segs.len(),
            seqs: l.seqs.len(),
            picked: l.picked.len(),
        }
    }
    pub fn covers(&self, o: &Caps) -> bool {
        self.rows >= o.rows
            && self.chunks >= o.chunks
            && self.segs >= o.segs
            && self.seqs >= o.seqs
            && self.picked >= o.picked
    }
    /// What passes of up to `rows` tokens over up to `seqs` sequences need, with the last
    /// position's logits of each sequence (`chunk`: the model's chunk length). A segment
    /// holds at least one chunk, and a sequence's chunks are ceil(len / chunk).
    pub fn for_passes(rows: usize, seqs: usize, chunk: usize) -> Caps {
        let chunks = rows.div_ceil(chunk.max(1)) + seqs;
        Caps {
            rows,
            chunks,
            segs: chunks,
            seqs,
            picked: seqs,
        }
    }

    /// Each size rounded up to a power of two.
    pub fn rounded_up(&self) -> Caps {
        Caps {
            rows: self.rows.next_power_of_two(),
            chunks: self.chunks.next_power_of_two(),
            segs: self.segs.next_power_of_two(),
            seqs: self.seqs.next_power_of_two(),
            picked: self.picked.next_power_of_two(),
        }
    }
    pub fn max(&self, o: &Caps) -> Caps {
        Caps {
            rows: self.rows.max(o.rows),
            chunks: self.chunks.max(o.chunks),
            segs: self.segs.max(o.segs),
            seqs: self.seqs.max(o.seqs),
            picked: self.picked.max(o.picked),
        }
    }
}

/// Device buffers of one pass.
pub struct Work {
    pub caps: Caps,
    pub tokens: DevBuf,
    /// residual stream, f32 `[rows, D_m]`
    pub res: DevBuf,
    /// GEMM input (normed rows; `[hi | lo]` when split), act `[rows, 2·D_m]`
    pub xin: DevBuf,
    /// in_proj output f32 `[rows, d_in_proj]`
    pub proj: DevBuf,
    pub bcn: DevBuf,
    pub tok: DevBuf,
    pub theta: DevBuf,
    /// gated mixer output, act `[rows, D_i]`, and its f32 twin for the decode GEMV
    pub y: DevBuf,
    pub yf: DevBuf,
    /// MLP `[v | g]` f32 and activation (act)
    pub vg: DevBuf,
    pub act: DevBuf,
    pub chunks: DevBuf,
    pub csum: DevBuf,
    pub phi0: DevBuf,
    pub segs: DevBuf,
    pub sbuf: DevBuf,
    pub sdecay: DevBuf,
    pub seqs: DevBuf,
    /// device address of each sequence's state
    pub states: DevBuf,
    pub picked: DevBuf,
    /// final-normed picked rows (act) and their logits (f32)
    pub hfin: DevBuf,
    pub logits: DevBuf,
    /// the fused decode's two phase counters (kernels/decode_layers.cu), zero between launches
    pub sync: DevBuf,
}

impl Work {
    pub fn new(gpu: &Gpu, d: &Dims, act_size: usize, c: Caps) -> Result<Work> {
        let r = c.rows.max(1);
        let f = |n: usize| gpu.alloc::<f32>(n.max(1));
        let a = |n: usize| gpu.alloc::<u8>((n * act_size).max(1));
        let (h, s) = (d.nheads, d.num_rope_angles);
        Ok(Work {
            caps: c,
            tokens: gpu.alloc::<u32>(r)?,
            res: f(r * d.d_model)?,
            xin: a(r * 2 * d.d_model)?,
            proj: f(r * super::kernels::proj_ld(d))?,
            bcn: f(r * 2 * d.ngroups * d.d_state)?,
            tok: f(r * h * 4)?,
            theta: f(r * s)?,
            y: a(r * d.d_inner)?,
            yf: f(r * d.d_inner)?,
            vg: f(r * 2 * d.mlp_hidden)?,
            act: a(r * d.mlp_hidden)?,
            chunks: gpu.alloc::<[i32; 4]>(c.chunks.max(1))?,
            csum: f(c.chunks * h * s)?,
            phi0: f(c.chunks * h * s)?,
            segs: gpu.alloc::<[i32; 4]>(c.segs.max(1))?,
            sbuf: f(c.segs * h * d.headdim * d.d_state)?,
            sdecay: f(c.segs * h)?,
            seqs: gpu.alloc::<[i32; 4]>(c.seqs.max(1))?,
            states: gpu.alloc::<u64>(c.seqs.max(1))?,
            picked: gpu.alloc::<i32>(c.picked.max(1))?,
            hfin: a(c.picked * d.d_model)?,
            logits: f(c.picked * d.vocab_padded)?,
            sync: {
                let b = gpu.alloc::<u64>(2)?;
                gpu.zero(b.ptr, b.bytes)?;
                b
            },
        })
    }

    /// Upload a layout's tables (not the tokens or states).
    pub fn put_layout(&self, gpu: &Gpu, l: &Layout) -> Result<()> {
        gpu.htod(&l.chunks, self.chunks.ptr)?;
        gpu.htod(&l.segs, self.segs.ptr)?;
        gpu.htod(&l.seqs, self.seqs.ptr)?;
        gpu.htod(&l.picked, self.picked.ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::chunks_per_segment;

    #[test]
    fn segments_follow_the_free_slots() {
        // A long batch fills the GPU with one segment per (sequence, head)...
        assert_eq!(chunks_per_segment(&[4096; 8], 64, 24, 264), 64);
        assert_eq!(chunks_per_segment(&[4096; 64], 64, 24, 132), 64);
        // ...unless that leaves most SMs idle in a last partial wave.
        assert_eq!(chunks_per_segment(&[4096; 8], 64, 24, 132), 32);
        // One long prompt: about as many segments per head as there are slots per head.
        let per = chunks_per_segment(&[4096], 64, 24, 264);
        assert!((5..=8).contains(&per), "{per}");
        // A very long prompt: not one segment per chunk (each block has a cost of its own).
        let per = chunks_per_segment(&[16384], 64, 24, 132);
        assert!((8..=32).contains(&per), "{per}");
        // Short sequences: one chunk each, nothing to split.
        assert_eq!(chunks_per_segment(&[10, 3], 64, 24, 264), 1);
    }
}
