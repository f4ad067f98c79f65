//! The host-side tables of one pass (how a packed batch is cut into chunks and segments)
//! and the device buffers a pass works in.
//!
//! Rows of the packed batch are sequence after sequence, no padding. Each sequence is cut
//! into chunks of `chunk_len` tokens (its last chunk may be short); consecutive chunks of a
//! sequence form segments, the unit of parallel work of the scan (kernels/scan.cu). How a
//! sequence is cut (`SegPlan`) is chosen by a model of the scan's makespan, and the scan's
//! blocks are launched longest first (`Layout::order`).

use crate::cuda::context::{DevBuf, Gpu};
use crate::engine::LogitsWant;
use crate::error::Result;
use crate::model::Dims;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, OnceLock};

/// Decode batches up to this size use the fused-norm GEMV kernels; larger ones cuBLASLt.
pub const GEMV_MAX_ROWS: usize = 16;

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
    /// the scan's launch order: every segment (phase C), then every segment but a
    /// sequence's last (phase A), each list longest first
    pub order: Vec<i32>,
    /// rows whose logits are wanted, in output order
    pub picked: Vec<i32>,
    /// (start, len) of each sequence
    pub spans: Vec<(usize, usize)>,
}

impl Layout {
    /// The layout of sequences of `lens` tokens; `slots` is how many scan blocks the GPU
    /// runs at once (SMs × blocks per SM). The segment plan is chosen for the whole batch,
    /// or with `batch_invariant` for each sequence as if it were alone (its scan's order of
    /// operations then does not depend on the other sequences).
    /// `MAMBA3_GPU_CHUNKS_PER_SEGMENT=P` or `P/T` replaces the model's choice (for
    /// measuring): segments of P chunks, or a last segment of T and P before it.
    pub fn new(
        lens: &[usize],
        d: &Dims,
        slots: usize,
        want: LogitsWant,
        batch_invariant: bool,
    ) -> Layout {
        static FORCED: OnceLock<Option<SegPlan>> = OnceLock::new();
        let forced = FORCED.get_or_init(|| {
            let v = crate::options::env().chunks_per_segment.clone()?;
            let (per, tail) = v.split_once('/').unwrap_or((&v, "0"));
            Some(SegPlan {
                per: per.trim().parse().ok()?,
                tail: tail.trim().parse().ok()?,
            })
        });
        let slots = slots.max(1);
        if let (None, true) = (forced, batch_invariant) {
            let own = |nc: usize| SegPlan::choose(&[nc], d.nheads, slots);
            return Layout::with_plans(lens, d, &own, want);
        }
        let plan = forced.unwrap_or_else(|| {
            let chunks: Vec<usize> = lens.iter().map(|n| n.div_ceil(d.chunk_len)).collect();
            SegPlan::choose(&chunks, d.nheads, slots)
        });
        Layout::with_plans(lens, d, &|_| plan, want)
    }

    /// The layout with segments of `per_seg` chunks (training takes 1: the scan then
    /// leaves the state entering every chunk in `sbuf`, which the backward needs).
    pub fn with_segments(lens: &[usize], d: &Dims, per_seg: usize, want: LogitsWant) -> Layout {
        let plan = SegPlan {
            per: per_seg,
            tail: 0,
        };
        Layout::with_plans(lens, d, &|_| plan, want)
    }

    /// The layout with the segment plan `plan_of(chunks)` for each sequence.
    fn with_plans(
        lens: &[usize],
        d: &Dims,
        plan_of: &dyn Fn(usize) -> SegPlan,
        want: LogitsWant,
    ) -> Layout {
        let l = d.chunk_len;
        let mut lay = Layout {
            rows: 0,
            chunks: vec![],
            segs: vec![],
            seqs: vec![],
            order: vec![],
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
            let cut = plan_of(nc).lengths(nc);
            let first_seg = lay.segs.len();
            let mut c0 = 0;
            for (i, &cnt) in cut.iter().enumerate() {
                let flags = i32::from(i == 0) | (i32::from(i + 1 == cut.len()) << 1);
                lay.segs
                    .push([(first_chunk + c0) as i32, cnt as i32, s as i32, flags]);
                c0 += cnt;
            }
            let ns = cut.len();
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
        // Longest first (stable), so that short blocks fill the slots the long ones leave.
        let by_len = |keep: &dyn Fn(&[i32; 4]) -> bool| {
            let mut v: Vec<i32> = (0..lay.segs.len() as i32)
                .filter(|&i| keep(&lay.segs[i as usize]))
                .collect();
            v.sort_by_key(|&i| Reverse(lay.segs[i as usize][1]));
            v
        };
        let (all, not_last) = (by_len(&|_| true), by_len(&|sg| sg[3] & 2 == 0));
        lay.order = [all, not_last].concat();
        lay
    }

    /// A layout of `n` one-token sequences (decode).
    pub fn decode(n: usize, d: &Dims) -> Layout {
        Layout::new(&vec![1; n], d, 1, LogitsWant::Last, false)
    }
}

/// How each sequence's chunks are cut into segments: a last segment of `tail` chunks
/// (none when 0, or when the sequence is no longer), and the chunks before it in segments
/// of at most `per`, as even as can be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegPlan {
    pub per: usize,
    pub tail: usize,
}

impl SegPlan {
    /// The segment lengths of a sequence of `nc` chunks.
    pub fn lengths(self, nc: usize) -> Vec<usize> {
        let (head, tail) = if self.tail > 0 && nc > self.tail {
            (nc - self.tail, Some(self.tail))
        } else {
            (nc, None)
        };
        let ns = head.div_ceil(self.per.max(1));
        let mut v: Vec<usize> = (0..ns)
            .map(|i| head / ns + usize::from(i < head % ns))
            .collect();
        v.extend(tail);
        v
    }

    /// The plan of least modelled makespan. Phase C runs every segment, phase A (about
    /// 0.4 of its work per chunk) every segment but a sequence's last; each phase's
    /// (segment, head) blocks go longest first to the first free of `slots`, and every
    /// block costs about a chunk more (its state read and written, its step of phase B,
    /// a first chunk with nothing to overlap). More segments mean shorter blocks but more
    /// phase-A work: a long batch takes one segment per sequence, one long prompt about
    /// as many segments as there are free slots per head, and a batch whose blocks
    /// overfill the slots by a fraction a short first segment and a long last one, the
    /// short blocks filling the slots the long ones leave. (Calibrated on the H200 at
    /// d_state 128: docs/decisions.md, "Segment plan" and "Segments of unequal lengths".)
    pub fn choose(chunks: &[usize], heads: usize, slots: usize) -> SegPlan {
        // Planning runs on the host before every pass, the GPU idle meanwhile: the plans
        // of recent batch shapes are kept.
        type Key = (Vec<(usize, usize)>, usize, usize);
        static RECENT: Mutex<Option<HashMap<Key, SegPlan>>> = Mutex::new(None);
        // (chunks, sequences of that many): every sequence of a length has the same cut
        let mut shape: BTreeMap<usize, usize> = BTreeMap::new();
        for &c in chunks {
            *shape.entry(c).or_default() += 1;
        }
        let key: Key = (shape.into_iter().collect(), heads, slots);
        if let Some(p) = RECENT
            .lock()
            .ok()
            .and_then(|r| r.as_ref()?.get(&key).copied())
        {
            return p;
        }
        let plan = SegPlan::search(&key.0, heads, slots);
        if let Ok(mut r) = RECENT.lock() {
            let m = r.get_or_insert_with(HashMap::new);
            if m.len() >= 256 {
                m.clear();
            }
            m.insert(key, plan);
        }
        plan
    }

    /// The search behind `choose`, over a batch `shape` of (chunks, sequences).
    fn search(shape: &[(usize, usize)], heads: usize, slots: usize) -> SegPlan {
        let longest = shape.iter().map(|&(c, _)| c).max().unwrap_or(1).max(1);
        // uniform cuts: one per segment count of the longest sequence
        let mut cands: Vec<SegPlan> = (1..=longest)
            .rev()
            .map(|ns| SegPlan {
                per: longest.div_ceil(ns),
                tail: 0,
            })
            .collect();
        for k in 1..16 {
            let tail = longest * k / 16;
            let head = longest - tail;
            if tail == 0 || head == 0 {
                continue;
            }
            for per in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128] {
                cands.push(SegPlan {
                    per: per.min(head),
                    tail,
                });
            }
        }
        let mut seen = std::collections::HashSet::new();
        cands.retain(|p| seen.insert(*p));
        let mut best = (
            f64::INFINITY,
            SegPlan {
                per: longest,
                tail: 0,
            },
        );
        for p in cands {
            let c = p.makespan(shape, heads, slots, best.0);
            if c < best.0 - 1e-9 {
                best = (c, p);
            }
        }
        best.1
    }

    /// The modelled time of phases A and C of a batch `shape` of (chunks, sequences), in
    /// chunks of phase C; `give_up` once a lower bound passes it.
    fn makespan(self, shape: &[(usize, usize)], heads: usize, slots: usize, give_up: f64) -> f64 {
        const BLOCK_COST: f64 = 1.0;
        const PHASE_A: f64 = 0.4;
        // (cost, blocks): every head of every sequence of a length has the same blocks
        let (mut a, mut c) = (vec![], vec![]);
        for &(nc, seqs) in shape {
            let (cut, n) = (self.lengths(nc), seqs * heads);
            for (i, &len) in cut.iter().enumerate() {
                c.push((len as f64 + BLOCK_COST, n));
                if i + 1 < cut.len() {
                    a.push((PHASE_A * len as f64 + BLOCK_COST, n));
                }
            }
        }
        let bound = |v: &[(f64, usize)]| {
            let (sum, max) = v
                .iter()
                .fold((0., 0f64), |(s, m), &(x, n)| (s + x * n as f64, m.max(x)));
            (sum / slots as f64).max(max)
        };
        if bound(&a) + bound(&c) >= give_up {
            return f64::INFINITY;
        }
        list_makespan(a, slots) + list_makespan(c, slots)
    }
}

/// When the last of the blocks ends, (cost, how many) taken longest first by whichever of
/// `slots` frees first.
fn list_makespan(mut blocks: Vec<(f64, usize)>, slots: usize) -> f64 {
    blocks.sort_by(|x, y| y.0.total_cmp(&x.0));
    // the slots by the time they free (fixed point, 1/1024 chunk), with their counts:
    // equal blocks move whole groups of slots at once
    let mut free: BTreeMap<u64, usize> = BTreeMap::from([(0, slots)]);
    let mut end = 0;
    for (cost, mut left) in blocks {
        let t = (cost * 1024.0) as u64;
        while left > 0 {
            let Some((at, n)) = free.pop_first() else {
                break;
            };
            let k = n.min(left);
            if n > k {
                free.insert(at, n - k);
            }
            *free.entry(at + t).or_default() += k;
            end = end.max(at + t);
            left -= k;
        }
    }
    end as f64 / 1024.0
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
    /// `Layout::order`
    pub order: DevBuf,
    pub sbuf: DevBuf,
    pub sdecay: DevBuf,
    pub seqs: DevBuf,
    /// device address of each sequence's state
    pub states: DevBuf,
    pub picked: DevBuf,
    /// final-normed picked rows (act) and their logits (f32)
    pub hfin: DevBuf,
    pub logits: DevBuf,
    /// the fused decode's phase counter and its count of finished blocks (kernels/
    /// decode_layers.cu; both zero between launches)
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
            proj: f(r * crate::cuda::kernels::proj_ld(d))?,
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
            order: gpu.alloc::<i32>(2 * c.segs.max(1))?,
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
        gpu.htod(&l.order, self.order.ptr)?;
        gpu.htod(&l.seqs, self.seqs.ptr)?;
        gpu.htod(&l.picked, self.picked.ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::{Layout, SegPlan};
    use crate::engine::LogitsWant;

    fn plan(chunks: usize, seqs: usize, slots: usize) -> SegPlan {
        SegPlan::choose(&vec![chunks; seqs], 24, slots)
    }

    #[test]
    fn plans_follow_the_free_slots() {
        let uniform = |per| SegPlan { per, tail: 0 };
        // A long batch that overfills the slots many times: one segment per sequence.
        assert_eq!(plan(64, 64, 264), uniform(64));
        assert_eq!(plan(64, 64, 132), uniform(64));
        // One long prompt: about as many segments per head as there are slots per head.
        let p = plan(64, 1, 264);
        assert!(p.tail == 0 && (5..=8).contains(&p.per), "{p:?}");
        let cut = plan(256, 1, 132).lengths(256);
        assert!((4..=32).contains(&cut.len()), "{cut:?}");
        // Short sequences: one chunk each, nothing to split.
        assert_eq!(plan(1, 2, 264).lengths(1), [1]);
        // 192 (sequence, head) pairs on 264 slots: a long last segment per pair, and the
        // short first ones in the slots the long ones leave, beat one segment per pair.
        let p = plan(64, 8, 264);
        let cut = p.lengths(64);
        assert!(cut.len() >= 2 && *cut.last().unwrap() >= 32, "{cut:?}");
        let (m, one) = (
            p.makespan(&[(64, 8)], 24, 264, f64::INFINITY),
            uniform(64).makespan(&[(64, 8)], 24, 264, f64::INFINITY),
        );
        assert!(m < 0.9 * one, "{m} against {one}");
    }

    #[test]
    fn the_mixed_batch_of_the_gpu_tests_takes_a_tail_plan() {
        // tests/gpu_engine.rs `random_cases`, the last: 40 sequences, chunk 16, 8 heads,
        // on an H200 (132 SMs, two scan blocks each)
        let chunks: Vec<usize> = (0..40usize)
            .map(|i| (120 + (37 * i) % 150).div_ceil(16))
            .collect();
        let p = SegPlan::choose(&chunks, 8, 264);
        assert!(p.tail > 0 && chunks.iter().any(|&c| c > p.tail), "{p:?}");
    }

    #[test]
    fn plans_cut_every_chunk_once() {
        for per in 1..=9 {
            for tail in 0..=9 {
                for nc in 1..=30 {
                    let cut = SegPlan { per, tail }.lengths(nc);
                    assert_eq!(cut.iter().sum::<usize>(), nc, "{per} {tail} {nc}");
                    assert!(cut.iter().all(|&c| c > 0));
                    if tail > 0 && nc > tail {
                        assert_eq!(*cut.last().unwrap(), tail);
                    }
                }
            }
        }
    }

    #[test]
    fn the_order_lists_every_segment_longest_first() {
        let d = crate::model::config::Config::synthetic(64, 1, 16, 16, 2, 1, 32).dims();
        let lens = [64 * d.chunk_len, 3 * d.chunk_len + 5, 1];
        let plan = SegPlan { per: 2, tail: 40 };
        let lay = Layout::with_plans(&lens, &d, &|_| plan, LogitsWant::Last);
        let nseg = lay.segs.len();
        let (c, a) = lay.order.split_at(nseg);
        let mut seen: Vec<i32> = c.to_vec();
        seen.sort();
        assert_eq!(seen, (0..nseg as i32).collect::<Vec<_>>());
        let not_last: Vec<i32> = (0..nseg as i32)
            .filter(|&i| lay.segs[i as usize][3] & 2 == 0)
            .collect();
        let mut seen_a = a.to_vec();
        seen_a.sort();
        assert_eq!(seen_a, not_last);
        assert_eq!(a.len(), nseg - lens.len());
        for list in [c, a] {
            let l: Vec<i32> = list.iter().map(|&i| lay.segs[i as usize][1]).collect();
            assert!(l.windows(2).all(|w| w[0] >= w[1]), "{l:?}");
        }
        assert_eq!(lay.segs[c[0] as usize][1], 40);
    }
}
