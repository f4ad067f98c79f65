//! The gradient's all-reduce buckets: the trainable tensors cut into pieces of at most a
//! fixed number of bytes, from the last layer to the first (the head and final norm, then
//! layers N−1 … 0, the embedding last) — the order in which the backward finishes them
//! (`super::ready::Stage`), so that a bucket is reduced as soon as its layers are done
//! ([`Pending`], in `super::parallel`). Each bucket is a set of
//! element ranges of the flat gradient (`super::flat::FlatLayout`), reduced as one
//! operation; ranges that touch, or are parted only by the zero padding after a tensor,
//! are merged into one.

use super::flat::{FlatLayout, ALIGN};
use super::ready::Stage;
use crate::error::{Error, Result};
use crate::mixers::mamba3::params::Params;
use std::collections::HashSet;
use std::ops::Range;

/// The default bucket size of `--bucket-mb`.
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

/// One all-reduce: element ranges of the flat gradient, sorted, not overlapping.
#[derive(Clone, Debug, PartialEq)]
pub struct Bucket {
    pub ranges: Vec<Range<usize>>,
    /// parameter elements it holds (the ranges less the alignment gaps merged into them)
    pub params: usize,
    /// the [`Stage::key`] of its last tensor in the backward: once the backward has
    /// finished that stage, every element of the bucket is final
    pub ready_at: usize,
}

/// Buckets of at most `bucket_bytes` bytes of parameters each (at least one f32).
pub fn plan(shape: &Params<f32>, layout: &FlatLayout, bucket_bytes: usize) -> Vec<Bucket> {
    let cap = (bucket_bytes / 4).max(1);
    let n_layer = shape.layers.len();
    // tensors in the backward's order: by stage, last first; within a stage, last first
    let keys: Vec<usize> = (shape.tensors().into_iter())
        .map(|(n, _)| Stage::of(&n, n_layer).key(n_layer))
        .collect();
    let mut order: Vec<usize> = (0..keys.len()).rev().collect();
    order.sort_by_key(|&i| std::cmp::Reverse(keys[i]));
    // where a tensor ends, the layout's zero padding runs to the next multiple of ALIGN
    let ends: HashSet<usize> = layout.spans.iter().map(|&(off, len)| off + len).collect();
    let mut buckets = Vec::new();
    let mut pieces: Vec<Range<usize>> = Vec::new();
    let mut room = cap;
    // the backward finishes the tensors in this order, so a bucket is final at the stage
    // of the tensor that filled it last
    let mut last_key = 0;
    for i in order {
        last_key = keys[i];
        let (mut off, end) = (layout.spans[i].0, layout.spans[i].0 + layout.spans[i].1);
        while off < end {
            let take = room.min(end - off);
            pieces.push(off..off + take);
            off += take;
            room -= take;
            if room == 0 {
                buckets.push(merged(std::mem::take(&mut pieces), &ends, keys[i]));
                room = cap;
            }
        }
    }
    if !pieces.is_empty() {
        buckets.push(merged(pieces, &ends, last_key));
    }
    buckets
}

/// Sorted, with neighbours merged where they touch or where only a tensor's padding
/// parts them.
fn merged(mut pieces: Vec<Range<usize>>, ends: &HashSet<usize>, ready_at: usize) -> Bucket {
    let params = pieces.iter().map(|r| r.len()).sum();
    pieces.sort_by_key(|r| r.start);
    let mut ranges: Vec<Range<usize>> = Vec::new();
    for p in pieces {
        match ranges.last_mut() {
            Some(last)
                if p.start == last.end
                    || (ends.contains(&last.end)
                        && p.start == last.end.next_multiple_of(ALIGN)) =>
            {
                last.end = p.end
            }
            _ => ranges.push(p),
        }
    }
    Bucket {
        ranges,
        params,
        ready_at,
    }
}

/// The buckets of one reduction, launched in order as the backward finishes them.
pub struct Pending<'a> {
    buckets: &'a [Bucket],
    next: usize,
}

impl<'a> Pending<'a> {
    pub fn new(buckets: &'a [Bucket]) -> Pending<'a> {
        Pending { buckets, next: 0 }
    }

    /// The buckets not yet taken whose every element is final once the backward has
    /// finished the stage of key `key` (and those before it), in order; taken.
    pub fn ready(&mut self, key: usize) -> &'a [Bucket] {
        let from = self.next;
        while self
            .buckets
            .get(self.next)
            .is_some_and(|b| b.ready_at >= key)
        {
            self.next += 1;
        }
        &self.buckets[from..self.next]
    }

    /// Every bucket not yet taken (the backward is over); taken.
    pub fn rest(&mut self) -> &'a [Bucket] {
        let from = self.next;
        self.next = self.buckets.len();
        &self.buckets[from..]
    }
}

/// `--bucket-mb` in bytes: a positive size, at most 1 GiB.
pub fn bucket_bytes(mb: f64) -> Result<usize> {
    if !(mb > 0.0 && mb <= 1024.0) {
        return Err(Error::input(format!(
            "--bucket-mb {mb}: expected a size in MiB above 0 and at most 1024"
        )));
    }
    Ok(((mb * 1024.0 * 1024.0) as usize).max(4))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Config;

    fn shapes() -> Vec<Params<f32>> {
        let mut a = Config::synthetic(32, 3, 16, 16, 2, 1, 256);
        a.d_intermediate = 64;
        a.ssm_cfg.is_outproj_norm = true;
        a.tie_embeddings = false;
        let b = Config::synthetic(24, 2, 8, 8, 2, 1, 100);
        vec![Params::zeros(&a), Params::zeros(&b)]
    }

    #[test]
    fn every_parameter_is_in_exactly_one_bucket_for_any_size() {
        for p in shapes() {
            let layout = FlatLayout::new(&p);
            let smallest = p.tensors().iter().map(|(_, t)| t.len()).min().unwrap();
            // one element, smaller than the smallest tensor, odd sizes, one larger than all
            for bytes in [
                1,
                4,
                4 * (smallest / 2).max(1),
                36,
                1000,
                4096,
                4 * layout.len + 100,
            ] {
                let buckets = plan(&p, &layout, bytes);
                let mut hits = vec![0u8; layout.len];
                for b in &buckets {
                    assert!(b.params <= (bytes / 4).max(1), "bucket over {bytes} bytes");
                    assert!(b.ranges.windows(2).all(|w| w[0].end < w[1].start));
                    for r in &b.ranges {
                        hits[r.clone()].iter_mut().for_each(|h| *h += 1);
                    }
                }
                for (&(off, len), (name, _)) in layout.spans.iter().zip(p.tensors()) {
                    assert!(
                        hits[off..off + len].iter().all(|&h| h == 1),
                        "{name} not covered exactly once at {bytes} bytes"
                    );
                }
                // merged gaps only: nothing outside the tensors but alignment padding
                let covered: usize = hits.iter().map(|&h| h as usize).sum();
                assert!(covered >= p.numel() && covered <= layout.len);
                assert_eq!(buckets.iter().map(|b| b.params).sum::<usize>(), p.numel());
                if bytes >= 4 * layout.len {
                    assert_eq!(buckets.len(), 1, "one bucket holds everything");
                }
            }
        }
    }

    #[test]
    fn buckets_go_from_the_last_layer_to_the_first() {
        let p = &shapes()[0];
        let layout = FlatLayout::new(p);
        let names: Vec<String> = p.tensors().into_iter().map(|(n, _)| n).collect();
        // buckets of one element: the order of the tensors they visit
        let buckets = plan(p, &layout, 4);
        let owner = |at: usize| {
            (layout.spans.iter())
                .position(|&(off, len)| (off..off + len).contains(&at))
                .unwrap()
        };
        let mut seen: Vec<usize> = Vec::new();
        for b in &buckets {
            let t = owner(b.ranges[0].start);
            if seen.last() != Some(&t) {
                seen.push(t);
            }
        }
        let stages: Vec<usize> = (seen.iter())
            .map(|&t| Stage::of(&names[t], 3).key(3))
            .collect();
        assert!(stages.windows(2).all(|w| w[0] >= w[1]), "{stages:?}");
        assert_eq!(names[seen[0]], "lm_head.weight");
        assert_eq!(names[*seen.last().unwrap()], "backbone.embedding.weight");
    }

    #[test]
    fn a_bucket_is_ready_at_the_stage_of_its_last_tensor() {
        let p = &shapes()[0];
        let layout = FlatLayout::new(p);
        let keys: Vec<usize> = (p.tensors().iter())
            .map(|(n, _)| Stage::of(n, 3).key(3))
            .collect();
        for bytes in [4, 64, 1000, 4096, 1 << 30] {
            let buckets = plan(p, &layout, bytes);
            for b in &buckets {
                // the least stage among the tensors it touches
                let least = (layout.spans.iter().zip(&keys))
                    .filter(|(&(off, len), _)| {
                        (b.ranges.iter()).any(|r| r.start < off + len && off < r.end)
                    })
                    .map(|(_, &k)| k)
                    .min()
                    .unwrap();
                assert_eq!(b.ready_at, least, "{bytes} B");
            }
            assert!(buckets.windows(2).all(|w| w[0].ready_at >= w[1].ready_at));
            // the queue hands each bucket out once, in order, as its stage finishes
            let mut q = Pending::new(&buckets);
            let mut taken = 0;
            for key in (0..=4).rev() {
                for b in q.ready(key) {
                    assert!(b.ready_at >= key);
                    assert_eq!(*b, buckets[taken]);
                    taken += 1;
                }
                assert!(buckets[taken..].iter().all(|b| b.ready_at < key));
            }
            assert_eq!(taken, buckets.len());
            assert!(q.rest().is_empty());
            let mut q = Pending::new(&buckets);
            assert_eq!(q.rest().len(), buckets.len(), "without the hook: all after");
        }
    }

    #[test]
    fn bucket_size_is_checked() {
        assert_eq!(bucket_bytes(1.0).unwrap(), 1 << 20);
        for bad in [0.0, -1.0, f64::NAN, 5000.0] {
            let e = bucket_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("--bucket-mb"), "{e}");
        }
    }
}
